//! `cargo xtask bench datapath`: the tc ingress program under BPF_PROG_TEST_RUN, per packet, with
//! 1 to 100k services in the maps (written by the agent's own map writer).
//!
//! `cargo xtask bench agent`: the agent process on 1 to 30k services, from its start to its first
//! full sync, and its memory then (see `bench/agent.rs`).
//!
//! A test run repeats the program on the same buffer, and the program rewrites it, so a
//! repeated packet would stop being a service packet after the first run. The established-flow
//! figure therefore uses two services that point at each other (A -> B's address, B -> A's), so
//! every repetition is a full conntrack hit plus address and port rewrite. A new flow can only
//! be measured one run at a time (each run a new 5-tuple); the kernel's timer reads are then
//! inside each figure, so the same one-run method is also shown for established flows.
use std::{
    net::{Ipv4Addr, Ipv6Addr},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use clap::Parser;
use proxy_tests::{
    packet::{self, ETH_HLEN, Spec},
    programs::{
        ExternalSvc, Programs, Svc, TC_ACT_UNSPEC, XDP_PASS, add_external_service, add_service,
        ready_endpoint,
    },
};
use proxy_userspace::{
    model::{DesiredState, Placement, Protocol},
    modes::ebpf::MapSizes,
};

#[path = "bench/agent.rs"]
mod agent;
#[path = "bench/chart.rs"]
mod chart;
#[path = "bench/connections.rs"]
mod connections;
#[path = "bench/e2e.rs"]
mod e2e;
#[path = "bench/external.rs"]
mod external;

#[derive(Parser)]
struct Args {
    /// `datapath` (the programs, per packet), `agent` (the agent process: time to its first
    /// full sync, and its memory), `external` (NodePorts from outside) or `e2e` (ClusterIPs at
    /// 1 to 30k services).
    which: String,
    /// Service counts to measure with, comma-separated [datapath: 1,10000,100000; agent and
    /// e2e: 1,1000,10000,30000,100000].
    #[arg(long, value_delimiter = ',')]
    services: Option<Vec<u32>>,
    /// e2e: the modes, comma-separated, as the scenario suite names them (docs/parity.md), and
    /// ebpf-socket-lb (`--bpf-socket-lb all`)
    /// [ebpf,ebpf-socket-lb,iptables-legacy,nftables,userspace].
    #[arg(long, value_delimiter = ',', value_parser = e2e::parse_mode)]
    modes: Option<Vec<&'static proxy_tests::scenarios::Mode>>,
    /// Backends (endpoints) per service [datapath: 10; agent: 3].
    #[arg(long)]
    backends: Option<u32>,
    /// agent: where the agent reads the Services from.
    #[arg(long, value_enum, default_value = "manifest")]
    source: agent::SourceKind,
    /// agent: how the manifest is written.
    #[arg(long, value_enum, default_value = "list")]
    manifest_format: agent::ManifestFormat,
    /// agent: measure the agent's second start, on the maps the first pinned (an upgrade or a
    /// crash), instead of its first on the node.
    #[arg(long)]
    restart: bool,
    /// agent: measurements per service count (the median is reported) [1]; external: rounds
    /// each way [5].
    #[arg(long)]
    runs: Option<u32>,
    /// agent: the agent binary to run [the proxy-userspace built next to this benchmark, or
    /// $PROXY_USERSPACE_BIN].
    #[arg(long)]
    agent: Option<std::path::PathBuf>,
    /// Repetitions in the kernel for the repeatable figures.
    #[arg(long, default_value_t = 1_000_000)]
    repeat: u32,
    /// Distinct new flows (one test run each).
    #[arg(long, default_value_t = 1_000_000)]
    new_flows: u32,
    /// external, e2e: seconds a round, each way.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// external, e2e: client threads.
    #[arg(long, default_value_t = 4)]
    threads: u32,
    /// e2e: one-endpoint changes timed per service count and mode (a second apart).
    #[arg(long, default_value_t = 20)]
    changes: u32,
    /// e2e: a short run for CI: 1 and 1000 services, 2 rounds of 1 s, 10 changes.
    #[arg(long)]
    quick: bool,
    /// e2e: measure nothing; draw the charts again from the table of an earlier run's e2e.md
    /// (such as docs/bench/e2e.md), beside it.
    #[arg(long)]
    replot: Option<std::path::PathBuf>,
}

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 10);
const VIP_A: Ipv4Addr = Ipv4Addr::new(10, 95, 0, 1);
const VIP_B: Ipv4Addr = Ipv4Addr::new(10, 95, 0, 2);
const FIRST_BACKEND: Ipv4Addr = Ipv4Addr::new(10, 128, 0, 0);
/// The XDP rows: a client outside the node, the node's address, and a load balancer address
/// that, with the NodePort, forms a ping-pong pair (each one's endpoint is the other, so a
/// repeated test run on one buffer is an established flow every time).
const EXT_CLIENT: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 100);
const NODE: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 11);
const LB_B: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
const NODE_PORT: u16 = 30080;
/// A NodePort whose endpoints are on another node: new flows get a source port each.
const REMOTE_NODE_PORT: u16 = 30090;
/// New flows measured through it: the default SNAT range holds 28976 ports per endpoint and
/// node address; 500 live flows an endpoint keep random port picks from colliding often.
const REMOTE_FLOWS: u32 = 5_000;

fn vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 0)) + i)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(table) = &args.replot {
        anyhow::ensure!(args.which == "e2e", "--replot is for bench e2e");
        return e2e::replot(table);
    }
    let modes = match args.modes.clone() {
        Some(modes) => modes,
        None => e2e::DEFAULT_MODES
            .iter()
            .map(|id| e2e::parse_mode(id).map_err(anyhow::Error::msg))
            .collect::<anyhow::Result<_>>()?,
    };
    match args.which.as_str() {
        "datapath" => datapath(&Datapath {
            services: args.services.unwrap_or_else(|| vec![1, 10_000, 100_000]),
            backends: args.backends.unwrap_or(10),
            repeat: args.repeat,
            new_flows: args.new_flows,
        }),
        "agent" => agent::run(&agent::Options {
            services: args
                .services
                .unwrap_or_else(|| vec![1, 1_000, 10_000, 30_000, 100_000]),
            endpoints: args.backends.unwrap_or(3),
            source: args.source,
            format: args.manifest_format,
            restart: args.restart,
            runs: args.runs.unwrap_or(1).max(1),
            agent: args.agent,
        }),
        "external" => external::run(&external::Options {
            seconds: args.seconds,
            rounds: args.runs.unwrap_or(5).max(1),
            threads: args.threads,
        }),
        "e2e" if args.quick => e2e::run(&e2e::Options {
            services: args.services.unwrap_or_else(|| vec![1, 1_000]),
            modes,
            load: connections::Load {
                seconds: 1.0,
                threads: args.threads,
            },
            rounds: 2,
            changes: 10,
        }),
        "e2e" => e2e::run(&e2e::Options {
            services: args
                .services
                .unwrap_or_else(|| vec![1, 1_000, 10_000, 30_000, 100_000]),
            modes,
            load: connections::Load {
                seconds: args.seconds,
                threads: args.threads,
            },
            rounds: args.runs.unwrap_or(3).max(1),
            changes: args.changes,
        }),
        other => bail!("unknown benchmark {other:?}; available: datapath, agent, external, e2e"),
    }
}

/// The datapath benchmark's settings.
struct Datapath {
    services: Vec<u32>,
    backends: u32,
    repeat: u32,
    new_flows: u32,
}

fn datapath(args: &Datapath) -> anyhow::Result<()> {
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "the datapath benchmark loads BPF programs: run it as root (or with CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON)"
        );
    }
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!(
        "tc_ingress under BPF_PROG_TEST_RUN, kernel {}, {} backends a service, ns per packet",
        kernel.trim(),
        args.backends
    );
    let rep = format!("x{}", short(args.repeat));
    println!(
        "{:>9} {:>11} {:>9} {:>13} {:>13} {:>13} {:>13} {:>13}",
        "services",
        "cold sync",
        "floor",
        "not a service",
        "established",
        "established",
        "established",
        "new flow"
    );
    println!(
        "{:>9} {:>11} {:>9} {:>13} {:>13} {:>13} {:>13} {:>13}",
        "", "", rep, rep, rep, "1 run each", "of new flows", "1 run each"
    );
    let mut xdp_rows = Vec::new();
    for &count in &args.services {
        let (row, xdp) = measure(args, count).with_context(|| format!("with {count} services"))?;
        xdp_rows.push((count, xdp));
        println!(
            "{:>9} {:>11} {:>9.1} {:>13.1} {:>13.1} {:>13.1} {:>13.1} {:>13.1}",
            count,
            format!("{:.0?}", row.cold_sync),
            row.floor,
            row.pass,
            row.established,
            row.established_single,
            row.established_many,
            row.new_flow
        );
    }
    println!(
        "\"1 run each\" includes the kernel's per-run timer reads; compare those columns with each other. \
         \"of new flows\": one packet of each new flow in turn once established, its conntrack \
         entries as cold in the caches as the new flow's were; the other one-run column repeats \
         one flow."
    );
    println!(
        "\nxdp_external under BPF_PROG_TEST_RUN on the same maps (a NodePort from outside), ns per packet"
    );
    println!(
        "{:>9} {:>9} {:>13} {:>15} {:>15}",
        "services", "floor", "established", "new flow", "new flow"
    );
    println!(
        "{:>9} {:>9} {:>13} {:>15} {:>15}",
        "",
        rep,
        format!("local, {rep}"),
        "local, 1 each",
        "remote, 1 each"
    );
    for (count, x) in &xdp_rows {
        println!(
            "{:>9} {:>9.1} {:>13.1} {:>15.1} {:>15.1}",
            count, x.floor, x.established, x.new_local, x.new_remote
        );
    }
    println!(
        "local: DNAT, handed to the stack (XDP_PASS). remote: a source port allocated, the route \
         looked up; transmitting is not measured (a test run's packet has nowhere to go, so the \
         program leaves it to tc); {REMOTE_FLOWS} flows over 10 endpoints."
    );
    println!(
        "\ntc_ingress and xdp_external on IPv6 frames (tc_ingress6 and xdp_external6, by tail \
         call), IPv6 services only, ns per packet"
    );
    println!(
        "{:>9} {:>13} {:>13} {:>15} {:>15}",
        "services", "established", "new flow", "XDP established", "XDP new flow"
    );
    println!(
        "{:>9} {:>13} {:>13} {:>15} {:>15}",
        "",
        rep,
        "1 run each",
        format!("local, {rep}"),
        "local, 1 each"
    );
    for &count in &args.services {
        let row = measure6(args, count).with_context(|| format!("IPv6, with {count} services"))?;
        println!(
            "{:>9} {:>13.1} {:>13.1} {:>15.1} {:>15.1}",
            count, row.established, row.new_flow, row.xdp_established, row.xdp_new_flow
        );
    }
    println!(
        "An IPv6 XDP new flow goes from xdp_external6 to xdp_new_flow6, which records it, and \
         back (two tail calls)."
    );
    Ok(())
}

/// The repeated established-flow figure: `client`'s packet to `vip`, whose endpoint is the
/// other service of a ping-pong pair whose endpoint is `vip` again, so that a repeated run on
/// one buffer is an established flow every time.
fn ping_pong(
    p: &Programs,
    client: impl Into<std::net::IpAddr>,
    vip: impl Into<std::net::IpAddr>,
    repeat: u32,
) -> anyhow::Result<Duration> {
    let ping = Spec {
        tcp_flags: 0x10,
        ..Spec::tcp(client, 40000, vip, 80)
    }
    .build();
    // Two warm-up runs create both flows' conntrack entries; each flow's answer, and the
    // client's packet after it, open them (as a handshake would: an opening flow takes the
    // slow path).
    let (_, to_b) = p.run("tc_ingress", &ping);
    let (_, to_a) = p.run("tc_ingress", &to_b);
    answer(p, "tc_egress", &to_b);
    answer(p, "tc_egress", &to_a);
    p.time("tc_ingress", &ping, 2)?;
    p.time("tc_ingress", &ping, repeat)
}

/// The IPv6 figures of one service count.
struct Row6 {
    established: f64,
    new_flow: f64,
    /// xdp_external (to xdp_external6 by tail call) on an established NodePort flow.
    xdp_established: f64,
    /// xdp_external on new NodePort flows to a local endpoint (through xdp_new_flow6).
    xdp_new_flow: f64,
}

/// The IPv6 twin of `vip(i)` (`fd00:97::` and the same low 32 bits).
fn vip6(i: u32) -> Ipv6Addr {
    let v4 = vip(i).octets();
    Ipv6Addr::from([
        0xfd, 0, 0, 0x97, 0, 0, 0, 0, 0, 0, 0, 0, v4[0], v4[1], v4[2], v4[3],
    ])
}

/// An IPv6-only service port `name` on `vip`:`port` (TCP) with `endpoints` (on another node);
/// its name.
fn add_service6(
    state: &mut DesiredState,
    name: &str,
    vip: Ipv6Addr,
    port: u16,
    endpoints: &[(Ipv6Addr, u16)],
) -> proxy_userspace::model::ServicePortName {
    let spn = add_service(
        state,
        &Svc {
            name,
            vip: Ipv4Addr::UNSPECIFIED,
            port,
            protocol: Protocol::Tcp,
            endpoints: &[],
        },
    );
    let mut sp = state.port(&spn).expect("just added").clone();
    sp.cluster_ips = [vip.into()].into();
    state.insert_port(spn.clone(), sp);
    let endpoints = endpoints
        .iter()
        .map(|(ip, port)| ready_endpoint((*ip).into(), *port))
        .collect();
    state.set_endpoints(spn.clone(), endpoints);
    spn
}

/// [`measure`]'s tc figures over IPv6: `count` IPv6 services, and an IPv6 ping-pong pair.
fn measure6(args: &Datapath, count: u32) -> anyhow::Result<Row6> {
    let sizes = MapSizes {
        services: count * (args.backends + 1) + 64,
        backends: count * args.backends + 64,
        conntrack: 1024,
        conntrack6: 2 * (args.new_flows + args.new_flows.min(200_000) + 4) + 1024,
    };
    let mut p = Programs::load(sizes)?;
    let mut state = DesiredState::new("node1");
    let backend = |n: u32| {
        let mut o = vip6(0).octets();
        o[3] = 0x98;
        o[12..].copy_from_slice(&n.to_be_bytes());
        Ipv6Addr::from(o)
    };
    let mut endpoints = Vec::with_capacity(args.backends as usize);
    for i in 0..count {
        endpoints.clear();
        endpoints.extend((0..args.backends).map(|b| (backend(i * args.backends + b), 8080)));
        add_service6(&mut state, &format!("svc6-{i}"), vip6(i), 80, &endpoints);
    }
    let (a, b) = (vip6(u32::MAX), vip6(u32::MAX - 1));
    add_service6(&mut state, "bench6-a", a, 80, &[(b, 81)]);
    add_service6(&mut state, "bench6-b", b, 81, &[(a, 80)]);
    // The XDP ping-pong pair, as IPv4's (add_external): a NodePort whose local endpoint is a
    // load balancer address whose local endpoint is the NodePort.
    let (node, lb) = (
        Ipv6Addr::new(0x2001, 0xdb8, 0, 2, 0, 0, 0, 0x11),
        Ipv6Addr::new(0x2001, 0xdb8, 0x203, 0, 0, 0, 0, 2),
    );
    for (name, i, port, endpoint) in [
        ("bench6-np", 1, 80, (lb, 81)),
        ("bench6-lb", 2, 81, (node, NODE_PORT)),
    ] {
        let spn = add_service6(&mut state, name, vip6(u32::MAX - 1 - i), port, &[endpoint]);
        let sp = state.port_mut(&spn).expect("just added");
        match name {
            "bench6-np" => sp.node_port = Some(NODE_PORT),
            _ => sp.load_balancer_ips = [lb.into()].into(),
        }
        state.edit_endpoints(&spn, |eps| {
            for e in eps {
                e.placement = Placement::shared(Some("node1"), None);
            }
        });
    }
    p.program(&state)?;
    p.set_node_addrs6(&[node]);
    let ns = |d: Duration| d.as_nanos() as f64;
    let client = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 0x10);
    let established = ns(ping_pong(&p, client, a, args.repeat)?);
    // One run each, new flows to every service in turn: the destination, a client address
    // byte and the source port from the flow number.
    let mut frame = Spec::tcp(client, 0, vip6(0), 80).build();
    let (daddr, sport) = (ETH_HLEN + 24, ETH_HLEN + 40);
    let mut total = 0.0;
    for i in 0..args.new_flows {
        frame[daddr..daddr + 16].copy_from_slice(&vip6(i % count).octets());
        frame[ETH_HLEN + 22] = (i >> 16) as u8;
        frame[sport..sport + 2].copy_from_slice(&((i & 0xffff) as u16).to_be_bytes());
        let (verdict, out, took) = p.run_timed("tc_ingress", &frame);
        let (_, _, dst, _) = packet::tuple(&out);
        if verdict != TC_ACT_UNSPEC
            || !matches!(dst, std::net::IpAddr::V6(d) if d.octets()[3] == 0x98)
        {
            bail!("IPv6 new flow {i} was not sent to a backend (verdict {verdict}, to {dst})");
        }
        total += ns(took);
    }
    // XDP serves established IPv6 flows only: tc starts the pair's two flows (and answers
    // open them), then XDP is timed on the client's packet.
    let client6 = Ipv6Addr::new(0x2001, 0xdb8, 0xff, 0, 0, 0, 0, 0x99);
    let ping = Spec {
        tcp_flags: 0x10,
        ..Spec::tcp(client6, 40000, node, NODE_PORT)
    }
    .build();
    let (_, to_lb) = p.run("tc_external_ingress", &ping);
    let (_, to_np) = p.run("tc_external_ingress", &to_lb);
    answer(&p, "tc_external_egress", &to_lb);
    answer(&p, "tc_external_egress", &to_np);
    time_xdp(&p, &ping, 2)?;
    let xdp_established = ns(time_xdp(&p, &ping, args.repeat)?);
    // New NodePort flows, one run each: a client address byte and the source port from the
    // flow number.
    let xdp_flows = args.new_flows.min(200_000);
    let mut frame = Spec::tcp(client6, 0, node, NODE_PORT).build();
    let mut xdp_total = 0.0;
    for i in 0..xdp_flows {
        frame[ETH_HLEN + 22] = 1 + (i >> 16) as u8;
        frame[sport..sport + 2].copy_from_slice(&((i & 0xffff) as u16).to_be_bytes());
        xdp_total += ns(time_xdp(&p, &frame, 1)?);
    }
    Ok(Row6 {
        established,
        new_flow: total / args.new_flows as f64,
        xdp_established,
        xdp_new_flow: xdp_total / xdp_flows as f64,
    })
}

struct XdpRow {
    floor: f64,
    established: f64,
    new_local: f64,
    new_remote: f64,
}

/// The XDP program `repeat` times on `frame`: the mean time per run (it must pass the frame
/// on: anything else means the setup is wrong).
fn time_xdp(p: &Programs, frame: &[u8], repeat: u32) -> anyhow::Result<Duration> {
    let (verdict, took) = p.time_verdict(proxy_userspace::modes::ebpf::PROG_XDP, frame, repeat)?;
    if verdict != XDP_PASS {
        bail!("the XDP program returned {verdict} (not XDP_PASS)");
    }
    Ok(took)
}

/// The endpoint's answer (an ACK) to `sent`, the translated packet of a flow, through `prog`:
/// the flow's handshake done, so that it is timed as the established flow it stands for.
fn answer(p: &Programs, prog: &str, sent: &[u8]) {
    let seen = packet::read(sent);
    let reply = Spec {
        tcp_flags: 0x10,
        ..Spec::tcp(seen.dst, seen.dport, seen.src, seen.sport)
    };
    p.run(prog, &reply.build());
}

/// The XDP rows, on programs whose maps hold the external services of [`add_external`].
fn measure_xdp(p: &Programs, args: &Datapath) -> anyhow::Result<XdpRow> {
    p.set_node_addrs(&[NODE], NODE);
    let ns = |d: Duration| d.as_nanos() as f64;
    let mut arp = vec![0u8; 60];
    arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    let floor = ns(time_xdp(p, &arp, args.repeat)?);
    let ping = Spec {
        tcp_flags: 0x10,
        ..Spec::tcp(EXT_CLIENT, 40000, NODE, NODE_PORT)
    }
    .build();
    let (_, sent) = p.run_xdp(&ping, None);
    answer(p, "tc_external_egress", &sent);
    time_xdp(p, &ping, 2)?;
    let established = ns(time_xdp(p, &ping, args.repeat)?);
    let new_flows = |dport: u16, n: u32| -> anyhow::Result<f64> {
        let mut frame = Spec::tcp(EXT_CLIENT, 0, NODE, dport).build();
        let sport_off = ETH_HLEN + 20;
        let mut total = 0.0;
        for i in 0..n {
            // A distinct 5-tuple: client address low bits and source port from the flow number.
            frame[ETH_HLEN + 14] = 1 + (i >> 16) as u8;
            frame[sport_off..sport_off + 2].copy_from_slice(&((i & 0xffff) as u16).to_be_bytes());
            total += ns(time_xdp(p, &frame, 1)?);
        }
        Ok(total / n as f64)
    };
    Ok(XdpRow {
        floor,
        established,
        new_local: new_flows(NODE_PORT, args.new_flows.min(200_000))?,
        new_remote: new_flows(REMOTE_NODE_PORT, REMOTE_FLOWS.min(args.new_flows))?,
    })
}

/// The external services the XDP rows use: the ping-pong pair, and a NodePort whose 10
/// endpoints are on another node.
fn add_external(state: &mut DesiredState) {
    // Name, service port, endpoint, load balancer addresses (none: a NodePort instead).
    type Frontend<'a> = (&'a str, u16, (Ipv4Addr, u16), &'a [Ipv4Addr]);
    let pair: [Frontend<'_>; 2] = [
        ("bench-np", NODE_PORT, (LB_B, 81), &[]),
        ("bench-lb", 81, (NODE, NODE_PORT), &[LB_B]),
    ];
    for (i, (name, port, endpoint, lbs)) in pair.into_iter().enumerate() {
        add_external_service(
            state,
            &ExternalSvc {
                name,
                cluster_ip: Ipv4Addr::new(10, 97, 0, i as u8 + 1),
                port,
                protocol: Protocol::Tcp,
                node_port: lbs.is_empty().then_some(NODE_PORT),
                load_balancer_ips: lbs,
                external_ips: &[],
                external_traffic_local: false,
                source_ranges: &[],
                endpoints: &[(endpoint.0, endpoint.1, "node1")],
            },
        );
    }
    let remote: Vec<(Ipv4Addr, u16, &str)> = (0..10)
        .map(|i| (Ipv4Addr::new(10, 244, 2, 10 + i), 8080, "node2"))
        .collect();
    add_external_service(
        state,
        &ExternalSvc {
            name: "bench-remote",
            cluster_ip: Ipv4Addr::new(10, 97, 0, 3),
            port: 80,
            protocol: Protocol::Tcp,
            node_port: Some(REMOTE_NODE_PORT),
            load_balancer_ips: &[],
            external_ips: &[],
            external_traffic_local: false,
            source_ranges: &[],
            endpoints: &remote,
        },
    );
}

struct Row {
    cold_sync: Duration,
    floor: f64,
    pass: f64,
    established: f64,
    established_single: f64,
    /// One packet of each of the new flows in turn, once they are established.
    established_many: f64,
    new_flow: f64,
}

fn short(n: u32) -> String {
    if n >= 1_000_000 && n.is_multiple_of(1_000_000) {
        format!("{}M", n / 1_000_000)
    } else {
        n.to_string()
    }
}

fn measure(args: &Datapath, count: u32) -> anyhow::Result<(Row, XdpRow)> {
    let slots = count * (args.backends + 1) + 64;
    let sizes = MapSizes {
        services: slots,
        backends: count * args.backends + 64,
        // The tc and XDP new flows, and the established ones.
        conntrack: 2 * (args.new_flows + args.new_flows.min(200_000) + REMOTE_FLOWS) + 1024,
        // IPv4 only (measure6 has the IPv6 figures).
        conntrack6: 1024,
    };
    let mut p = Programs::load(sizes)?;
    // The external services' local endpoints are node1's.
    let mut state = DesiredState::new("node1");
    let mut endpoints = Vec::with_capacity(args.backends as usize);
    for i in 0..count {
        endpoints.clear();
        for b in 0..args.backends {
            let n = i * args.backends + b;
            endpoints.push((Ipv4Addr::from(u32::from(FIRST_BACKEND) + n), 8080));
        }
        add_service(
            &mut state,
            &Svc {
                name: &format!("svc-{i}"),
                vip: vip(i),
                port: 80,
                protocol: Protocol::Tcp,
                endpoints: &endpoints,
            },
        );
    }
    // The ping-pong pair for the repeated established-flow figure.
    add_service(
        &mut state,
        &Svc {
            name: "bench-a",
            vip: VIP_A,
            port: 80,
            protocol: Protocol::Tcp,
            endpoints: &[(VIP_B, 81)],
        },
    );
    add_service(
        &mut state,
        &Svc {
            name: "bench-b",
            vip: VIP_B,
            port: 81,
            protocol: Protocol::Tcp,
            endpoints: &[(VIP_A, 80)],
        },
    );
    add_external(&mut state);
    let started = Instant::now();
    p.program(&state)?;
    let cold_sync = started.elapsed();

    let ns = |d: Duration| d.as_nanos() as f64;
    // Not IPv4 at all: the program returns after one comparison, so this is the test run's own
    // floor (entering the program, the timer) to read the other figures against.
    let mut arp = vec![0u8; 60];
    arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    let floor = ns(p.time("tc_ingress", &arp, args.repeat)?);
    let pass_frame = Spec::tcp(CLIENT, 40000, Ipv4Addr::new(10, 244, 9, 9), 80).build();
    let pass = ns(p.time("tc_ingress", &pass_frame, args.repeat)?);
    let established = ns(ping_pong(&p, CLIENT, VIP_A, args.repeat)?);

    // One run each: new flows to every service in turn, then one established flow as often.
    // Flow `i`: a distinct 5-tuple, its client address and source port from the flow number.
    let flow = |i: u32| {
        let [a, b, _, d] = CLIENT.octets();
        let client = Ipv4Addr::new(a, b, (i >> 16) as u8, d);
        Spec::tcp(client, (i & 0xffff) as u16, vip(i % count), 80)
    };
    let mut total = 0.0;
    // Where each flow went (its endpoint), to establish it below.
    let mut sent_to = Vec::with_capacity(args.new_flows as usize);
    for i in 0..args.new_flows {
        let (verdict, out, took) = p.run_timed("tc_ingress", &flow(i).build());
        let seen = packet::read(&out);
        let backend = u32::from(seen.dst).wrapping_sub(u32::from(FIRST_BACKEND));
        if verdict != TC_ACT_UNSPEC || backend >= count * args.backends {
            bail!("new flow {i} was not sent to a backend (verdict {verdict})");
        }
        total += ns(took);
        sent_to.push((seen.dst, seen.dport));
    }
    let new_flow = total / args.new_flows as f64;
    // The same flows established (answered, and acknowledged by the client), a block at a
    // time, then one packet of each in turn: established packets whose conntrack entries are no
    // warmer in the caches than a new flow's lookups were, each well within a second of its
    // flow's last packet (a flow quiet longer has its reply entry looked at too).
    let ack = |i: u32| {
        Spec {
            tcp_flags: 0x10,
            ..flow(i)
        }
        .build()
    };
    let mut total = 0.0;
    const BLOCK: u32 = 16_384;
    for start in (0..args.new_flows).step_by(BLOCK as usize) {
        let block = start..(start + BLOCK).min(args.new_flows);
        for i in block.clone() {
            // The flow's first packet as the program sent it on: to its endpoint.
            let (endpoint, port) = sent_to[i as usize];
            let first = flow(i);
            let sent = Spec::tcp(first.src, first.sport, endpoint, port);
            answer(&p, "tc_egress", &sent.build());
            p.run("tc_ingress", &ack(i));
        }
        for i in block {
            let (verdict, _, took) = p.run_timed("tc_ingress", &ack(i));
            if verdict != TC_ACT_UNSPEC {
                bail!("established flow {i}'s packet was not passed on (verdict {verdict})");
            }
            total += ns(took);
        }
    }
    let established_many = total / args.new_flows as f64;
    let mut total = 0.0;
    let single_runs = args.new_flows.min(200_000);
    let established_frame = Spec {
        tcp_flags: 0x10,
        ..Spec::tcp(CLIENT, 41000, vip(0), 80)
    }
    .build();
    let (_, sent) = p.run("tc_ingress", &established_frame);
    answer(&p, "tc_egress", &sent);
    p.run("tc_ingress", &established_frame);
    for _ in 0..single_runs {
        total += ns(p.time("tc_ingress", &established_frame, 1)?);
    }
    let established_single = total / single_runs as f64;
    let xdp = measure_xdp(&p, args)?;
    Ok((
        Row {
            cold_sync,
            floor,
            pass,
            established,
            established_single,
            established_many,
            new_flow,
        },
        xdp,
    ))
}
