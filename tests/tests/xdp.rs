//! The external programs (`xdp_external`, `tc_external_ingress`, `tc_external_egress`) under
//! BPF_PROG_TEST_RUN: NodePort, LoadBalancer and external IP frames from outside in, verdict and
//! rewritten bytes out, both checksums checked by recomputing them.
//!
//! Route lookups are made in the network namespace of the thread that runs the test, so every
//! run here happens inside a private namespace (never the machine's) with two external
//! interfaces, routes and static neighbours: the programs' forwarding decisions then depend on
//! nothing outside the test. XDP runs get their ingress interface through the `xdp_md`
//! context, tc runs theirs through the `__sk_buff` one.
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    ops::Range,
    sync::atomic::{AtomicU32, Ordering},
};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use proxy_common::{
    Be16, Be32, CT_CLOSING, CT_EXTERNAL, CT_FORWARD, CT_NETFILTER, CT_OPENING, CT_REPLY, CT_SNAT,
    CT_TIME_WAIT, CtKey, CtValue, DROP_FRAG_NEEDED, DROP_NO_LOCAL_ENDPOINTS, DROP_NO_ROUTE,
    DROP_SNAT_PORTS_EXHAUSTED, DROP_SOURCE_RANGE, IFACE_XDP_FORWARD, MAP_SERVICES, SCOPE_INTERNAL,
    ServiceKey, ServiceValue,
};
use proxy_tests::{
    NS_PREFIX, Netns,
    fixtures::ct_key,
    packet::{self, ETH_HLEN, Spec, TCP, UDP},
    privileged,
    programs::{
        ExternalSvc, Programs, Svc, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC, XDP_DROP,
        XDP_PASS, XDP_REDIRECT, XDP_TX, add_external_service, add_service, ready_endpoint,
    },
    say_skipped,
};
use proxy_userspace::{
    model::{DesiredState, Protocol},
    modes::ebpf::MapSizes,
    modes::ebpf::inspect::monotonic_ns,
};

/// The translated flows' source ports here (`--bpf-snat-port-range`): narrower than the
/// default, so that collisions are frequent and the range can be filled.
const SNAT_PORT_MIN: u16 = 61000;
const SNAT_PORT_MAX: u16 = 65535;

/// This node ("node1"): its primary address (the SNAT address) and a second one, both on ext0.
const NODE: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 10);
const NODE_B: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 11);
/// Clients outside the cluster, behind the router (ext0's default route).
const CLIENT: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 7);
const CLIENT2: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 8);
/// Outside every source range used here.
const OUTSIDER: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 99);
/// A pod on this node (its traffic goes through the pod programs, not the external ones).
const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 10);
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const LB: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 20);

/// Endpoints, by where the routes of the lab namespace send them.
const LOCAL_BE: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 11);
/// node2, behind 192.168.0.12 on ext0.
const REMOTE_BE: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 11);
const REMOTE_BE2: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 12);
/// node3, behind 192.168.1.13 on ext1.
const EXT1_BE: Ipv4Addr = Ipv4Addr::new(10, 244, 3, 11);
/// node4, behind a gateway whose neighbour entry does not exist (yet).
const UNRESOLVED_BE: Ipv4Addr = Ipv4Addr::new(10, 244, 4, 11);
/// node5: an unreachable route.
const UNREACHABLE_BE: Ipv4Addr = Ipv4Addr::new(10, 244, 5, 11);

const NODE_PORT: u16 = 30080;
const PORT: u16 = 80;
const TARGET: u16 = 8080;

const EXT0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0e, 0x00];
const EXT1_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0e, 0x01];
const ROUTER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0f, 0x01];
const NODE2_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0f, 0x12];
const NODE3_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0f, 0x13];

const SIZES: MapSizes = MapSizes {
    services: 1024,
    backends: 1024,
    conntrack: 1 << 16,
    conntrack6: 1 << 16,
};

const ACK: u8 = 0x10;
const SYN_ACK: u8 = 0x12;
const FIN_ACK: u8 = 0x11;

/// The programs, programmed with some services, and a network namespace for their route
/// lookups: ext0 (192.168.0.10 and .11/24, default route via the router, node2's pods via
/// 192.168.0.12, node4's via an unresolved gateway, node5's unreachable) and ext1
/// (192.168.1.10/24, node3's pods via 192.168.1.13). Both external, XDP may transmit on both.
struct Lab {
    p: Programs,
    ns: Netns,
    ext0: u32,
    ext1: u32,
}

fn mac(m: [u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

fn lab(test: &str, services: &[ExternalSvc<'_>]) -> Option<Lab> {
    if !privileged(test) {
        return None;
    }
    let mut state = DesiredState::new("node1");
    for svc in services {
        add_external_service(&mut state, svc);
    }
    let lab = lab_with(state);
    if !lab.p.xdp_runs_take_a_context() {
        // Skipped even under SANDBOX_NO_SKIP: the kernel, not the machine, lacks it.
        say_skipped(
            test,
            "this kernel's BPF_PROG_TEST_RUN takes no xdp_md context (Linux 5.15), so a run \
             cannot name the interface a frame arrived on; here datapath.rs checks that the \
             programs load, external.rs and the scenarios check their traffic",
        );
        return None;
    }
    Some(lab)
}

fn lab_with(state: DesiredState) -> Lab {
    let mut p = Programs::load(SIZES).expect("loading the BPF programs");
    p.program(&state).expect("programming the maps");
    // The sandbox's prefix and pid: a namespace left by a killed run is cleaned up with theirs.
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let name = format!(
        "{NS_PREFIX}{}-xdp{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    let ns = Netns::create(&name).expect("creating the lab namespace");
    let lines = [
        format!(
            "link add ext0 address {} type veth peer name ext0p",
            mac(EXT0_MAC)
        ),
        format!(
            "link add ext1 address {} type veth peer name ext1p",
            mac(EXT1_MAC)
        ),
        "link set ext0 up".into(),
        "link set ext0p up".into(),
        "link set ext1 up".into(),
        "link set ext1p up".into(),
        "addr add 192.168.0.10/24 dev ext0".into(),
        "addr add 192.168.0.11/24 dev ext0".into(),
        "addr add 192.168.1.10/24 dev ext1".into(),
        format!(
            "neigh add 192.168.0.1 lladdr {} dev ext0 nud permanent",
            mac(ROUTER_MAC)
        ),
        format!(
            "neigh add 192.168.0.12 lladdr {} dev ext0 nud permanent",
            mac(NODE2_MAC)
        ),
        format!(
            "neigh add 192.168.1.13 lladdr {} dev ext1 nud permanent",
            mac(NODE3_MAC)
        ),
        "route add default via 192.168.0.1 dev ext0".into(),
        "route add 10.244.2.0/24 via 192.168.0.12 dev ext0".into(),
        "route add 10.244.3.0/24 via 192.168.1.13 dev ext1".into(),
        "route add 10.244.4.0/24 via 192.168.0.14 dev ext0".into(),
        "route add unreachable 10.244.5.0/24".into(),
    ];
    ns.ip_batch(&lines).expect("building the lab namespace");
    // Route lookups for forwarding answer only where forwarding is on (in the lab only).
    ns.exec("sysctl", &["-q", "-w", "net.ipv4.conf.all.forwarding=1"])
        .expect("enabling forwarding in the lab namespace");
    let (ext0, ext1) = ns.run(|| {
        // SAFETY: plain C strings.
        unsafe {
            (
                libc::if_nametoindex(c"ext0".as_ptr()),
                libc::if_nametoindex(c"ext1".as_ptr()),
            )
        }
    });
    assert!(ext0 != 0 && ext1 != 0, "the lab's interfaces");
    p.set_node_addrs(&[NODE, NODE_B], NODE);
    p.set_snat_ports(SNAT_PORT_MIN, SNAT_PORT_MAX);
    p.set_external_iface(ext0, IFACE_XDP_FORWARD);
    p.set_external_iface(ext1, IFACE_XDP_FORWARD);
    Lab { p, ns, ext0, ext1 }
}

impl Lab {
    /// `xdp_external` on a frame received on ext0.
    fn xdp(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.xdp_on(frame, self.ext0)
    }

    fn xdp_on(&self, frame: &[u8], ifindex: u32) -> (u32, Vec<u8>) {
        self.ns.run(|| self.p.run_xdp(frame, Some(ifindex)))
    }

    /// A tc program on a frame seen on ext0.
    fn tc(&self, prog: &str, frame: &[u8]) -> (u32, Vec<u8>) {
        self.tc_on(prog, frame, self.ext0)
    }

    fn tc_on(&self, prog: &str, frame: &[u8], ifindex: u32) -> (u32, Vec<u8>) {
        self.ns.run(|| self.p.run_on(prog, frame, ifindex))
    }

    /// The conntrack entry at `key`, if any.
    fn ct(&self, key: CtKey) -> Option<CtValue> {
        self.p.conntrack().get(&key, 0).ok()
    }

    fn ct_len(&self) -> usize {
        self.p.conntrack().keys().count()
    }
}

/// A service port (TCP unless `protocol` says otherwise) named `name` with a NodePort and
/// these endpoints, nothing else external.
fn node_port<'a>(
    name: &'a str,
    node_port: u16,
    endpoints: &'a [(Ipv4Addr, u16, &'a str)],
) -> ExternalSvc<'a> {
    ExternalSvc {
        name,
        cluster_ip: CLUSTER_IP,
        port: PORT,
        protocol: Protocol::Tcp,
        node_port: Some(node_port),
        load_balancer_ips: &[],
        external_ips: &[],
        external_traffic_local: false,
        source_ranges: &[],
        endpoints,
    }
}

/// `spec`'s frame as it arrives on ext0: to ext0's MAC from `from`.
fn on_wire(spec: &Spec, from: [u8; 6]) -> Vec<u8> {
    let mut f = spec.build();
    f[0..6].copy_from_slice(&EXT0_MAC);
    f[6..12].copy_from_slice(&from);
    f
}

/// A client's packet, from the router.
fn from_client(spec: &Spec) -> Vec<u8> {
    on_wire(spec, ROUTER_MAC)
}

/// The answer to `spec`, from `from` to `to` (a SYN-ACK for TCP).
fn answer<A: Into<IpAddr>>(spec: &Spec, from: (A, u16), to: (A, u16)) -> Spec {
    Spec {
        src: from.0.into(),
        sport: from.1,
        dst: to.0.into(),
        dport: to.1,
        tcp_flags: if spec.proto == TCP { SYN_ACK } else { 0 },
        ..spec.clone()
    }
}

/// What a translated frame must carry.
struct Want {
    src: (Ipv4Addr, u16),
    dst: (Ipv4Addr, u16),
    /// Forwarded by the program: a hop off the TTL and these (destination, source) MACs, or
    /// `None`: MACs left to whoever sends it (the stack, `bpf_redirect_neigh`).
    hop: bool,
    macs: Option<([u8; 6], [u8; 6])>,
}

/// Handed to the stack (a local endpoint): addresses and ports only.
fn delivered(src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16)) -> Want {
    Want {
        src,
        dst,
        hop: false,
        macs: None,
    }
}

/// Forwarded out of an interface towards `next_hop` (its MAC) from `iface_mac`.
fn forwarded(
    src: (Ipv4Addr, u16),
    dst: (Ipv4Addr, u16),
    next_hop: [u8; 6],
    iface_mac: [u8; 6],
) -> Want {
    Want {
        src,
        dst,
        hop: true,
        macs: Some((next_hop, iface_mac)),
    }
}

/// The flag a new flow of `proto` is recorded with besides its kind: TCP starts opening.
fn opening(proto: u8) -> u8 {
    if proto == TCP { CT_OPENING } else { 0 }
}

/// Checks `after` (what a program made of `before`) against `want`: the tuple, the TTL, the
/// MACs, both checksums (a zero UDP checksum stays zero), and that no other byte changed.
fn assert_translated(before: &[u8], after: &[u8], want: &Want) {
    assert_eq!(after.len(), before.len(), "length must not change");
    let seen = packet::read(after);
    assert_eq!(
        ((seen.src, seen.sport), (seen.dst, seen.dport)),
        (want.src, want.dst),
        "translated tuple"
    );
    let ttl = ETH_HLEN + 8;
    assert_eq!(
        after[ttl],
        before[ttl] - u8::from(want.hop),
        "TTL (one hop off when forwarded)"
    );
    match want.macs {
        Some((dst, src)) => assert_eq!(
            (&after[0..6], &after[6..12]),
            (&dst[..], &src[..]),
            "MACs of the route"
        ),
        None => assert_eq!(&after[..12], &before[..12], "MACs must not change"),
    }
    let zero = before[ETH_HLEN + 9] == UDP && packet::read(before).l4_csum == 0;
    packet::assert_checksums(after, zero);
    let l4 = ETH_HLEN + usize::from(before[ETH_HLEN] & 0x0f) * 4;
    let csum = l4 + if before[ETH_HLEN + 9] == TCP { 16 } else { 6 };
    // MACs, TTL, IP checksum and addresses, ports, L4 checksum.
    let allowed: [Range<usize>; 5] = [
        0..12,
        ttl..ttl + 1,
        ETH_HLEN + 10..ETH_HLEN + 20,
        l4..l4 + 4,
        csum..csum + 2,
    ];
    for (i, (a, b)) in before.iter().zip(after).enumerate() {
        assert!(
            a == b || allowed.iter().any(|r| r.contains(&i)),
            "byte {i} changed ({a:#x} -> {b:#x})"
        );
    }
}

/// The source port a frame was translated to, checked to be in the SNAT range.
fn snat_port(frame: &[u8]) -> u16 {
    let port = packet::read(frame).sport;
    assert!(
        (SNAT_PORT_MIN..=SNAT_PORT_MAX).contains(&port),
        "translated source port {port} outside {SNAT_PORT_MIN}-{SNAT_PORT_MAX}"
    );
    port
}

fn untouched_xdp(lab: &Lab, frame: &[u8], what: &str) {
    let (verdict, out) = lab.xdp(frame);
    assert_eq!(
        (verdict, out.as_slice()),
        (XDP_PASS, frame),
        "{what}: XDP must pass it untouched"
    );
}

fn untouched_tc(lab: &Lab, prog: &str, frame: &[u8], what: &str) {
    let (verdict, out) = lab.tc(prog, frame);
    assert_eq!(
        (verdict, out.as_slice()),
        (TC_ACT_UNSPEC, frame),
        "{what}: {prog} must pass it untouched"
    );
}

/// The three kinds of frame every translation is checked on.
fn specs(dst: Ipv4Addr, dport: u16, sport: u16) -> [Spec; 3] {
    [
        Spec::tcp(CLIENT, sport, dst, dport),
        Spec::udp(CLIENT, sport, dst, dport),
        Spec {
            udp_zero_checksum: true,
            ..Spec::udp(CLIENT, sport + 1, dst, dport)
        },
    ]
}

/// Both protocols of a NodePort service on `endpoints` (TCP `web`, UDP `dns`).
fn both_protocols<'a>(endpoints: &'a [(Ipv4Addr, u16, &'a str)]) -> [ExternalSvc<'a>; 2] {
    [
        node_port("web", NODE_PORT, endpoints),
        ExternalSvc {
            protocol: Protocol::Udp,
            ..node_port("dns", NODE_PORT, endpoints)
        },
    ]
}

/// A local endpoint gets the packet with the client's address kept, through the stack; its
/// replies leave with the address the client used.
#[test]
fn a_node_port_to_a_local_endpoint_is_dnated_and_handed_to_the_stack() {
    let eps = [(LOCAL_BE, TARGET, "node1")];
    let Some(lab) = lab(
        "a_node_port_to_a_local_endpoint_is_dnated_and_handed_to_the_stack",
        &both_protocols(&eps),
    ) else {
        return;
    };
    for (i, node) in [NODE, NODE_B].into_iter().enumerate() {
        for (xdp, sport) in [(true, 40000), (false, 40005)] {
            for spec in specs(node, NODE_PORT, sport + 10 * i as u16) {
                let frame = from_client(&spec);
                let (verdict, out) = if xdp {
                    lab.xdp(&frame)
                } else {
                    lab.tc("tc_external_ingress", &frame)
                };
                let to_stack = if xdp { XDP_PASS } else { TC_ACT_UNSPEC };
                assert_eq!(verdict, to_stack, "{spec:?}");
                let client = (CLIENT, spec.sport);
                assert_translated(&frame, &out, &delivered(client, (LOCAL_BE, TARGET)));
                // Recorded as an external flow, not translated at its source.
                let fwd = lab
                    .ct(ct_key(client, (node, NODE_PORT), spec.proto))
                    .expect("forward entry");
                assert_eq!(
                    (fwd.direction, fwd.flags),
                    (CT_FORWARD, CT_EXTERNAL | opening(spec.proto))
                );
                // On its way into the pod the pod program leaves it alone.
                untouched_tc(&lab, "tc_egress", &out, "the DNATed packet to the pod");
                // The endpoint's reply leaves the node from the address the client used.
                let reply = on_wire(&answer(&spec, (LOCAL_BE, TARGET), client), EXT0_MAC);
                let (verdict, out) = lab.tc("tc_external_egress", &reply);
                assert_eq!(verdict, TC_ACT_UNSPEC);
                assert_translated(&reply, &out, &delivered((node, NODE_PORT), client));
            }
        }
    }
}

/// `spec` with its first payload word chosen so that, once its tuple is `src` -> `dst`, its
/// UDP checksum computes to zero (which must be sent as all ones: zero means "none").
fn zero_once_translated(spec: Spec, src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16)) -> Spec {
    let translated = Spec {
        src: src.0.into(),
        sport: src.1,
        dst: dst.0.into(),
        dport: dst.1,
        payload: vec![0; 6],
        ..spec.clone()
    };
    // The checksum with the word at zero is the complement of the sum without it: as the word,
    // it makes the sum all ones, and the checksum zero.
    let word = packet::read(&translated.build()).l4_csum;
    let mut payload = vec![0; 6];
    payload[..2].copy_from_slice(&word.to_be_bytes());
    Spec { payload, ..spec }
}

/// A UDP checksum that the translation makes zero is sent as all ones, by XDP and tc, both
/// ways.
#[test]
fn a_udp_checksum_that_becomes_zero_is_sent_as_all_ones() {
    let eps = [(LOCAL_BE, TARGET, "node1")];
    let Some(lab) = lab(
        "a_udp_checksum_that_becomes_zero_is_sent_as_all_ones",
        &both_protocols(&eps),
    ) else {
        return;
    };
    for (xdp, sport) in [(true, 40000), (false, 40001)] {
        let client = (CLIENT, sport);
        let spec = zero_once_translated(
            Spec::udp(CLIENT, sport, NODE, NODE_PORT),
            client,
            (LOCAL_BE, TARGET),
        );
        let frame = from_client(&spec);
        let (_, out) = if xdp {
            lab.xdp(&frame)
        } else {
            lab.tc("tc_external_ingress", &frame)
        };
        assert_translated(&frame, &out, &delivered(client, (LOCAL_BE, TARGET)));
        assert_eq!(packet::read(&out).l4_csum, 0xffff);
        let reply = zero_once_translated(
            answer(&spec, (LOCAL_BE, TARGET), client),
            (NODE, NODE_PORT),
            client,
        );
        let reply = on_wire(&reply, EXT0_MAC);
        let (_, out) = lab.tc("tc_external_egress", &reply);
        assert_translated(&reply, &out, &delivered((NODE, NODE_PORT), client));
        assert_eq!(packet::read(&out).l4_csum, 0xffff);
    }
}

/// Another node's endpoint gets the packet from the node address the client used and a port
/// of the SNAT range, forwarded at once by a route lookup (XDP_TX: back out of ext0); the
/// reply to that address and port goes back to the client from the NodePort.
#[test]
fn a_node_port_to_another_nodes_endpoint_is_sent_from_the_node_and_its_reply_back() {
    let eps = [(REMOTE_BE, TARGET, "node2")];
    let Some(lab) = lab(
        "a_node_port_to_another_nodes_endpoint_is_sent_from_the_node_and_its_reply_back",
        &both_protocols(&eps),
    ) else {
        return;
    };
    for (i, node) in [NODE, NODE_B].into_iter().enumerate() {
        for spec in specs(node, NODE_PORT, 41000 + 10 * i as u16) {
            let client = (CLIENT, spec.sport);
            let frame = from_client(&spec);
            let (verdict, out) = lab.xdp(&frame);
            assert_eq!(verdict, XDP_TX, "{spec:?}");
            let port = snat_port(&out);
            let sent = (node, port);
            assert_translated(
                &frame,
                &out,
                &forwarded(sent, (REMOTE_BE, TARGET), NODE2_MAC, EXT0_MAC),
            );
            // Both entries say where each direction goes back to.
            let fwd = lab
                .ct(ct_key(client, (node, NODE_PORT), spec.proto))
                .expect("forward entry");
            assert_eq!(
                (fwd.direction, fwd.flags, fwd.nat_addr, fwd.nat_port),
                (
                    CT_FORWARD,
                    CT_EXTERNAL | CT_SNAT | opening(spec.proto),
                    Be32::from_octets(node.octets()),
                    Be16::new(port)
                )
            );
            let rev = lab
                .ct(ct_key((REMOTE_BE, TARGET), sent, spec.proto))
                .expect("reply entry keyed to the node address and port");
            assert_eq!(
                (rev.direction, rev.nat_addr, rev.nat_port),
                (
                    CT_REPLY,
                    Be32::from_octets(CLIENT.octets()),
                    Be16::new(client.1)
                )
            );
            // The next packet of the flow keeps its port.
            let next = from_client(&Spec {
                tcp_flags: ACK,
                ..spec.clone()
            });
            let (verdict, again) = lab.xdp(&next);
            assert_eq!((verdict, packet::read(&again).sport), (XDP_TX, port));
            // The reply, from node2, goes back to the client through the router.
            let reply = on_wire(&answer(&spec, (REMOTE_BE, TARGET), sent), NODE2_MAC);
            let (verdict, back) = lab.xdp(&reply);
            assert_eq!(verdict, XDP_TX);
            let to_client = forwarded((node, NODE_PORT), client, ROUTER_MAC, EXT0_MAC);
            assert_translated(&reply, &back, &to_client);
            // tc makes the same of it.
            let (verdict, tc_back) = lab.tc("tc_external_ingress", &reply);
            assert_eq!((verdict, &tc_back), (TC_ACT_REDIRECT, &back));
        }
    }
}

/// LoadBalancer and external IPs (and cluster IPs reached from outside) leave from the node's
/// primary address (CONFIG_SNAT_ADDR), whichever node address that is; without one they cannot
/// be sent at all.
#[test]
fn load_balancer_and_external_ips_to_another_node_leave_from_the_snat_address() {
    let eps = [(REMOTE_BE, TARGET, "node2")];
    let Some(lab) = lab(
        "load_balancer_and_external_ips_to_another_node_leave_from_the_snat_address",
        &[ExternalSvc {
            load_balancer_ips: &[LB],
            external_ips: &[EXTERNAL_IP],
            ..node_port("web", NODE_PORT, &eps)
        }],
    ) else {
        return;
    };
    lab.p.set_node_addrs(&[NODE, NODE_B], NODE_B);
    for (i, vip) in [LB, EXTERNAL_IP].into_iter().enumerate() {
        let spec = Spec::tcp(CLIENT, 42000 + i as u16, vip, PORT);
        let frame = from_client(&spec);
        let (verdict, out) = lab.xdp(&frame);
        assert_eq!(verdict, XDP_TX, "{vip}");
        let sent = (NODE_B, snat_port(&out));
        assert_translated(
            &frame,
            &out,
            &forwarded(sent, (REMOTE_BE, TARGET), NODE2_MAC, EXT0_MAC),
        );
        let reply = on_wire(&answer(&spec, (REMOTE_BE, TARGET), sent), NODE2_MAC);
        let (verdict, back) = lab.xdp(&reply);
        assert_eq!(verdict, XDP_TX);
        let to_client = forwarded((vip, PORT), (CLIENT, spec.sport), ROUTER_MAC, EXT0_MAC);
        assert_translated(&reply, &back, &to_client);
    }
    // The service's cluster IP is served from outside too, as kube-proxy serves it where the
    // network routes the service range to the nodes.
    let spec = Spec::tcp(CLIENT, 42005, CLUSTER_IP, PORT);
    let frame = from_client(&spec);
    let (verdict, out) = lab.xdp(&frame);
    assert_eq!(verdict, XDP_TX, "the cluster IP");
    let sent = (NODE_B, snat_port(&out));
    let want = forwarded(sent, (REMOTE_BE, TARGET), NODE2_MAC, EXT0_MAC);
    assert_translated(&frame, &out, &want);
    let reply = on_wire(&answer(&spec, (REMOTE_BE, TARGET), sent), NODE2_MAC);
    let (_, back) = lab.xdp(&reply);
    let to_client = forwarded(
        (CLUSTER_IP, PORT),
        (CLIENT, spec.sport),
        ROUTER_MAC,
        EXT0_MAC,
    );
    assert_translated(&reply, &back, &to_client);
    // Not a NodePort on an address that is not the node's, nor on a service address.
    for spec in [
        Spec::tcp(CLIENT, 42010, Ipv4Addr::new(192, 168, 0, 99), NODE_PORT),
        Spec::tcp(CLIENT, 42010, LB, NODE_PORT),
    ] {
        let frame = from_client(&spec);
        untouched_xdp(&lab, &frame, &format!("{spec:?}"));
        untouched_tc(&lab, "tc_external_ingress", &frame, &format!("{spec:?}"));
    }
    // No SNAT address (the agent found none): a new flow to another node is dropped.
    lab.p.set_node_addrs(&[NODE, NODE_B], Ipv4Addr::UNSPECIFIED);
    let frame = from_client(&Spec::tcp(CLIENT, 42020, LB, PORT));
    assert_eq!(lab.xdp(&frame).0, XDP_DROP);
    assert_eq!(lab.tc("tc_external_ingress", &frame).0, TC_ACT_SHOT);
    assert_eq!(lab.p.drops(DROP_NO_ROUTE), 2);
}

/// A flow sent on to another node's endpoint leaves from the address of the interface the
/// route to the endpoint goes out of (as netfilter's MASQUERADE picks), whichever node address
/// or service address the client used, so that the endpoint's replies come back to that
/// interface (on a multi-homed node, the other one may not be reachable from the endpoint);
/// they are translated back there. Such an address serves no NodePort by being one.
#[test]
fn flows_to_other_nodes_leave_from_the_address_of_the_interface_they_leave_by() {
    let via_ext1 = [(EXT1_BE, TARGET, "node3")];
    let Some(lab) = lab(
        "flows_to_other_nodes_leave_from_the_address_of_the_interface_they_leave_by",
        &[ExternalSvc {
            load_balancer_ips: &[LB],
            ..node_port("via-ext1", NODE_PORT, &via_ext1)
        }],
    ) else {
        return;
    };
    let ext1_addr = Ipv4Addr::new(192, 168, 1, 10);
    lab.p.set_uplink(lab.ext0, IFACE_XDP_FORWARD, NODE);
    lab.p.set_uplink(lab.ext1, IFACE_XDP_FORWARD, ext1_addr);
    lab.p.add_snat_only_addr(ext1_addr);
    for (i, (vip, vport)) in [(NODE_B, NODE_PORT), (LB, PORT)].into_iter().enumerate() {
        for xdp in [true, false] {
            let sport = 47000 + 2 * i as u16 + u16::from(xdp);
            let spec = Spec::tcp(CLIENT, sport, vip, vport);
            let frame = from_client(&spec);
            let (verdict, out) = match xdp {
                true => lab.xdp(&frame),
                false => lab.tc("tc_external_ingress", &frame),
            };
            let redirected = if xdp { XDP_REDIRECT } else { TC_ACT_REDIRECT };
            assert_eq!(verdict, redirected, "{vip}:{vport}, xdp {xdp}");
            let sent = (ext1_addr, snat_port(&out));
            let want = forwarded(sent, (EXT1_BE, TARGET), NODE3_MAC, EXT1_MAC);
            assert_translated(&frame, &out, &want);
            // The reply comes back to ext1's address, on ext1.
            let reply = on_wire(&answer(&spec, (EXT1_BE, TARGET), sent), NODE3_MAC);
            let (verdict, back) = match xdp {
                true => lab.xdp_on(&reply, lab.ext1),
                false => lab.tc_on("tc_external_ingress", &reply, lab.ext1),
            };
            assert_eq!(verdict, redirected, "the reply, xdp {xdp}");
            let to_client = forwarded((vip, vport), (CLIENT, sport), ROUTER_MAC, EXT0_MAC);
            assert_translated(&reply, &back, &to_client);
        }
    }
    let frame = from_client(&Spec::tcp(CLIENT, 47010, ext1_addr, NODE_PORT));
    untouched_xdp(
        &lab,
        &frame,
        "a NodePort on an address only flows leave from",
    );
    untouched_tc(&lab, "tc_external_ingress", &frame, "the same on tc");
}

/// Two clients with the same source port reach the same endpoint: each gets its own port, and
/// each reply finds its own client. Many flows: never a port twice.
#[test]
fn snat_ports_never_collide() {
    let eps = [(REMOTE_BE, TARGET, "node2")];
    let Some(lab) = lab(
        "snat_ports_never_collide",
        &[node_port("web", NODE_PORT, &eps)],
    ) else {
        return;
    };
    let mut ports = BTreeSet::new();
    let mut flows = Vec::new();
    for client in [CLIENT, CLIENT2] {
        let spec = Spec::tcp(client, 40000, NODE, NODE_PORT);
        let (verdict, out) = lab.xdp(&from_client(&spec));
        assert_eq!(verdict, XDP_TX);
        let port = snat_port(&out);
        assert!(ports.insert(port), "port {port} given twice");
        flows.push((spec, port));
    }
    for (spec, port) in &flows {
        let reply = on_wire(&answer(spec, (REMOTE_BE, TARGET), (NODE, *port)), NODE2_MAC);
        let (_, back) = lab.xdp(&reply);
        assert_eq!(
            (
                IpAddr::from(packet::read(&back).dst),
                packet::read(&back).dport
            ),
            (spec.src, 40000),
            "the reply to port {port} goes to its own client"
        );
    }
    // 600 clients, all on source port 40000: random picks collide often (some 40 pairs among
    // 600 of 4536 ports), and each collision must be noticed.
    for i in 0..600u32 {
        let client = Ipv4Addr::from(0x6440_0000 + i); // 100.64.0.0/10
        let spec = Spec::tcp(client, 40000, NODE, NODE_PORT);
        let (verdict, out) = lab.xdp(&from_client(&spec));
        assert_eq!(verdict, XDP_TX, "flow {i}");
        let port = snat_port(&out);
        assert!(ports.insert(port), "flow {i}: port {port} given twice");
    }
}

/// Marks `ports` of NODE as held by live flows to REMOTE_BE:TARGET (their reply entries).
fn hold_ports(lab: &Lab, ports: impl Iterator<Item = u16>, flags: u8, last_seen_ns: u64) {
    let mut ct = lab.p.conntrack();
    for port in ports {
        let value = CtValue {
            backend_id: 1,
            vip: Be32::from_octets(NODE.octets()),
            vport: Be16::new(NODE_PORT),
            direction: CT_REPLY,
            flags: CT_EXTERNAL | CT_SNAT | flags,
            nat_addr: Be32::from_octets(OUTSIDER.octets()),
            last_seen_ns,
            nat_port: Be16::new(port),
            seq_hint: 0,
            packets: 0,
        };
        ct.insert(ct_key((REMOTE_BE, TARGET), (NODE, port), TCP), value, 0)
            .unwrap();
    }
}

/// A port held by a live flow is never handed out; when all are, new flows are dropped (and
/// counted) until the flows holding them end.
#[test]
fn snat_ports_held_by_live_flows_are_skipped_and_can_run_out() {
    let eps = [(REMOTE_BE, TARGET, "node2")];
    let Some(lab) = lab(
        "snat_ports_held_by_live_flows_are_skipped_and_can_run_out",
        &[node_port("web", NODE_PORT, &eps)],
    ) else {
        return;
    };
    // Every 8th port held: each new flow tries 8 at most, so some 200 of these tries hit one.
    let held = |p: &u16| p.is_multiple_of(8);
    hold_ports(
        &lab,
        (SNAT_PORT_MIN..=SNAT_PORT_MAX).filter(held),
        0,
        monotonic_ns(),
    );
    let mut ports = BTreeSet::new();
    for i in 0..200u16 {
        let spec = Spec::tcp(CLIENT, 20000 + i, NODE, NODE_PORT);
        let (verdict, out) = lab.xdp(&from_client(&spec));
        assert_eq!(verdict, XDP_TX, "flow {i}");
        let port = snat_port(&out);
        assert!(
            !held(&port),
            "flow {i} took port {port}, held by a live flow"
        );
        assert!(ports.insert(port), "flow {i}: port {port} given twice");
    }
    // All held: nothing left for a new flow (the client retries).
    hold_ports(&lab, SNAT_PORT_MIN..=SNAT_PORT_MAX, 0, monotonic_ns());
    let frame = from_client(&Spec::tcp(CLIENT2, 40000, NODE, NODE_PORT));
    assert_eq!(lab.xdp(&frame).0, XDP_DROP);
    assert_eq!(lab.tc("tc_external_ingress", &frame).0, TC_ACT_SHOT);
    assert_eq!(lab.p.drops(DROP_SNAT_PORTS_EXHAUSTED), 2);
}

/// A flood of SYNs nobody completes (spoofed clients) cannot lock new connections out: when
/// every port tried is held, a new flow takes that of a flow still being opened and idle for a
/// second (a handshake in progress keeps its port; an open flow always does), and the flow
/// that lost it never takes it back (the endpoint would see one 5-tuple for two clients).
#[test]
fn a_syn_flood_leaves_ports_for_new_flows() {
    let eps = [(REMOTE_BE, TARGET, "node2")];
    let Some(lab) = lab(
        "a_syn_flood_leaves_ports_for_new_flows",
        &[node_port("web", NODE_PORT, &eps)],
    ) else {
        return;
    };
    let second = 1_000_000_000;
    let now = monotonic_ns();
    if now < 3 * second {
        eprintln!("\nSKIPPED: the clock started less than 3 s ago\n");
        return;
    }
    let all = || SNAT_PORT_MIN..=SNAT_PORT_MAX;
    let new_flow = |client_port| from_client(&Spec::tcp(CLIENT2, client_port, NODE, NODE_PORT));
    for (what, flags, ago, taken) in [
        ("being opened, seen just now", CT_OPENING, 0, false),
        ("open, idle 3 s", 0, 3 * second, false),
        ("being opened, idle 3 s", CT_OPENING, 3 * second, true),
    ] {
        hold_ports(&lab, all(), flags, now - ago);
        let want = if taken { XDP_TX } else { XDP_DROP };
        assert_eq!(
            lab.xdp(&new_flow(40000)).0,
            want,
            "every port held by a flow {what}"
        );
    }

    // A real flow being opened, idle 3 s, with the only port of the range.
    let old = Spec::tcp(CLIENT, 41000, NODE, NODE_PORT);
    let (_, out) = lab.xdp(&from_client(&old));
    let port = snat_port(&out);
    let old_fwd = ct_key((CLIENT, 41000), (NODE, NODE_PORT), TCP);
    let port_key = ct_key((REMOTE_BE, TARGET), (NODE, port), TCP);
    let mut ct = lab.p.conntrack();
    for key in [&old_fwd, &port_key] {
        let mut entry = ct.get(key, 0).unwrap();
        assert_ne!(entry.flags & CT_OPENING, 0);
        entry.last_seen_ns = now - 3 * second;
        ct.insert(key, entry, 0).unwrap();
    }
    lab.p.set_snat_ports(port, port);
    let (verdict, out) = lab.xdp(&new_flow(40001));
    assert_eq!((verdict, snat_port(&out)), (XDP_TX, port));
    // The old flow's next packet finds its port another's: it does not take it back (and, the
    // range being full, is dropped).
    let late = from_client(&Spec {
        tcp_flags: ACK,
        ..old
    });
    assert_eq!(lab.xdp(&late).0, XDP_DROP);
    let rev = lab.ct(port_key).expect("the port's reply entry");
    assert_eq!(
        (rev.nat_addr, rev.nat_port),
        (Be32::from_octets(CLIENT2.octets()), Be16::new(40001))
    );
}

/// A closed flow's port goes to a new flow a second after the close, or a minute after if the
/// endpoint closed first (it holds the 5-tuple in TIME_WAIT); a late packet of the old flow
/// then never takes the port back.
#[test]
fn a_closed_flows_port_is_given_again_after_the_endpoint_is_done_with_it() {
    let eps = [(REMOTE_BE, TARGET, "node2")];
    let Some(lab) = lab(
        "a_closed_flows_port_is_given_again_after_the_endpoint_is_done_with_it",
        &[node_port("web", NODE_PORT, &eps)],
    ) else {
        return;
    };
    // Teardown through the programs: who closed first is recorded in both entries.
    let mut closed = Vec::new();
    for (client_port, endpoint_first) in [(44000, false), (44001, true)] {
        let spec = Spec::tcp(CLIENT, client_port, NODE, NODE_PORT);
        let (_, out) = lab.xdp(&from_client(&spec));
        let sent = (NODE, snat_port(&out));
        let fin = |s: Spec| Spec {
            tcp_flags: FIN_ACK,
            ..s
        };
        let client_fin = from_client(&fin(spec.clone()));
        let endpoint_fin = on_wire(&fin(answer(&spec, (REMOTE_BE, TARGET), sent)), NODE2_MAC);
        let order = if endpoint_first {
            [&endpoint_fin, &client_fin]
        } else {
            [&client_fin, &endpoint_fin]
        };
        for frame in order {
            assert_eq!(lab.xdp(frame).0, XDP_TX);
        }
        let want = CT_CLOSING | if endpoint_first { CT_TIME_WAIT } else { 0 };
        let fwd = ct_key((CLIENT, client_port), (NODE, NODE_PORT), TCP);
        let rev = ct_key((REMOTE_BE, TARGET), sent, TCP);
        for key in [fwd, rev] {
            let flags = lab.ct(key).expect("entry").flags;
            assert_eq!(
                flags & (CT_CLOSING | CT_TIME_WAIT),
                want,
                "endpoint closed first: {endpoint_first}, {key:?}"
            );
        }
        closed.push((fwd, rev, spec));
    }
    // Every port held by a flow that closed some time ago: free or not.
    let second = 1_000_000_000;
    let now = monotonic_ns();
    let cases = [
        ("just closed", CT_CLOSING, 0, false),
        (
            "closed by the endpoint 2 s ago",
            CT_CLOSING | CT_TIME_WAIT,
            2 * second,
            false,
        ),
        (
            "closed by the endpoint 61 s ago",
            CT_CLOSING | CT_TIME_WAIT,
            61 * second,
            true,
        ),
        ("closed by the client 2 s ago", CT_CLOSING, 2 * second, true),
    ];
    for (i, (what, flags, ago, free)) in cases.into_iter().enumerate() {
        if ago > now {
            eprintln!("\nSKIPPED case {what:?}: the clock started less than {ago} ns ago\n");
            continue;
        }
        hold_ports(&lab, SNAT_PORT_MIN..=SNAT_PORT_MAX, flags, now - ago);
        let frame = from_client(&Spec::tcp(CLIENT2, 40000 + i as u16, NODE, NODE_PORT));
        let want = if free { XDP_TX } else { XDP_DROP };
        assert_eq!(lab.xdp(&frame).0, want, "every port held by a flow {what}");
    }
    // The first flow above (the client closed first) closed 2 s ago; with its port the only
    // one in the range, a new flow takes it.
    let (old_fwd, old_rev, old_spec) = &closed[0];
    let port = old_rev.dport.get();
    let mut ct = lab.p.conntrack();
    for key in [old_fwd, old_rev] {
        let mut entry = ct.get(key, 0).unwrap();
        entry.last_seen_ns = now - 2 * second;
        ct.insert(key, entry, 0).unwrap();
    }
    lab.p.set_snat_ports(port, port);
    let new = Spec::tcp(CLIENT2, 45000, NODE, NODE_PORT);
    let (verdict, out) = lab.xdp(&from_client(&new));
    assert_eq!((verdict, snat_port(&out)), (XDP_TX, port));
    // A late packet of the old flow does not take the port back: the reply entry stays the new
    // flow's, and the endpoint's replies on that port go to the new client.
    let late = from_client(&Spec {
        tcp_flags: ACK,
        ..old_spec.clone()
    });
    lab.xdp(&late);
    let rev = lab.ct(*old_rev).expect("the port's reply entry");
    assert_eq!(
        (rev.nat_addr, rev.nat_port),
        (Be32::from_octets(CLIENT2.octets()), Be16::new(45000))
    );
    let reply = on_wire(&answer(&new, (REMOTE_BE, TARGET), (NODE, port)), NODE2_MAC);
    let (verdict, back) = lab.xdp(&reply);
    assert_eq!(verdict, XDP_TX);
    assert_eq!(packet::read(&back).dport, 45000);
}

/// A reply whose flow is gone is not translated (and its entry goes): a later packet on that
/// 5-tuple is not the service's.
#[test]
fn a_reply_without_its_flow_is_not_translated() {
    let eps = [(REMOTE_BE, TARGET, "node2")];
    let Some(lab) = lab(
        "a_reply_without_its_flow_is_not_translated",
        &[node_port("web", NODE_PORT, &eps)],
    ) else {
        return;
    };
    let spec = Spec::tcp(CLIENT, 43000, NODE, NODE_PORT);
    let (_, out) = lab.xdp(&from_client(&spec));
    let sent = (NODE, snat_port(&out));
    let fwd = ct_key((CLIENT, 43000), (NODE, NODE_PORT), TCP);
    lab.p.conntrack().remove(&fwd).unwrap();
    let reply = on_wire(&answer(&spec, (REMOTE_BE, TARGET), sent), NODE2_MAC);
    untouched_xdp(&lab, &reply, "a reply without a flow");
    assert!(lab.ct(ct_key((REMOTE_BE, TARGET), sent, TCP)).is_none());
    untouched_tc(
        &lab,
        "tc_external_ingress",
        &reply,
        "a reply without a flow",
    );
    // A pod's own flow through a cluster IP is not external: its replies are not for the
    // external egress program.
    let mut state = DesiredState::new("node1");
    add_service(
        &mut state,
        &Svc {
            name: "internal",
            vip: CLUSTER_IP,
            port: PORT,
            protocol: Protocol::Tcp,
            endpoints: &[(LOCAL_BE, TARGET)],
        },
    );
    let lab = lab_with(state);
    let (verdict, _) = lab.tc(
        "tc_ingress",
        &Spec::tcp(POD, 43001, CLUSTER_IP, PORT).build(),
    );
    assert_eq!(verdict, TC_ACT_UNSPEC);
    let reply = Spec::tcp(LOCAL_BE, TARGET, POD, 43001).build();
    untouched_tc(&lab, "tc_external_egress", &reply, "a pod flow's reply");
    // Nor are packets without any flow.
    let stray = on_wire(&Spec::tcp(LOCAL_BE, TARGET, CLIENT, 43002), EXT0_MAC);
    untouched_tc(&lab, "tc_external_egress", &stray, "no flow");
}

/// XDP transmits only where the route lookup resolved everything and the agent allowed it on
/// both interfaces; otherwise it passes the frame untouched (having recorded the flow) and the
/// tc program forwards it: `bpf_redirect` with the route's MACs, `bpf_redirect_neigh` for an
/// unresolved next hop, a drop when there is no route or no hop left.
#[test]
fn forwarding_follows_the_route_and_what_xdp_may_do() {
    let remote = [(REMOTE_BE, TARGET, "node2")];
    let via_ext1 = [(EXT1_BE, TARGET, "node3")];
    let unresolved = [(UNRESOLVED_BE, TARGET, "node4")];
    let unreachable = [(UNREACHABLE_BE, TARGET, "node5")];
    let Some(lab) = lab(
        "forwarding_follows_the_route_and_what_xdp_may_do",
        &[
            node_port("remote", 30080, &remote),
            node_port("via-ext1", 30081, &via_ext1),
            node_port("unresolved", 30082, &unresolved),
            node_port("unreachable", 30083, &unreachable),
        ],
    ) else {
        return;
    };
    // Out of another interface: redirected, with that interface's MAC.
    let to_ext1 = |out: &[u8]| {
        forwarded(
            (NODE, snat_port(out)),
            (EXT1_BE, TARGET),
            NODE3_MAC,
            EXT1_MAC,
        )
    };
    let frame = from_client(&Spec::tcp(CLIENT, 44000, NODE, 30081));
    let (verdict, out) = lab.xdp(&frame);
    assert_eq!(verdict, XDP_REDIRECT);
    assert_translated(&frame, &out, &to_ext1(&out));
    let (verdict, tc_out) = lab.tc("tc_external_ingress", &frame);
    assert_eq!((verdict, &tc_out), (TC_ACT_REDIRECT, &out));

    // Where XDP may not transmit (the egress, then the ingress interface): left to tc, which
    // sends it with the port XDP recorded.
    for (sport, port, backend, hop_mac, out_mac, iface) in [
        (44001, 30081, EXT1_BE, NODE3_MAC, EXT1_MAC, lab.ext1),
        (44002, 30080, REMOTE_BE, NODE2_MAC, EXT0_MAC, lab.ext0),
    ] {
        lab.p.set_external_iface(iface, 0);
        let spec = Spec::tcp(CLIENT, sport, NODE, port);
        let frame = from_client(&spec);
        untouched_xdp(&lab, &frame, "XDP may not transmit there");
        let fwd = lab
            .ct(ct_key((CLIENT, sport), (NODE, port), TCP))
            .expect("XDP recorded the flow");
        let (verdict, out) = lab.tc("tc_external_ingress", &frame);
        assert_eq!(verdict, TC_ACT_REDIRECT);
        let sent = (NODE, fwd.nat_port.get());
        assert_translated(
            &frame,
            &out,
            &forwarded(sent, (backend, TARGET), hop_mac, out_mac),
        );
        lab.p.set_external_iface(iface, IFACE_XDP_FORWARD);
    }

    // The next hop's MAC unknown: tc lets the kernel resolve it (MACs untouched here).
    let frame = from_client(&Spec::tcp(CLIENT, 44003, NODE, 30082));
    untouched_xdp(&lab, &frame, "an unresolved next hop");
    let (verdict, out) = lab.tc("tc_external_ingress", &frame);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    let want = Want {
        hop: true,
        ..delivered((NODE, snat_port(&out)), (UNRESOLVED_BE, TARGET))
    };
    assert_translated(&frame, &out, &want);

    // No route: dropped by tc.
    let frame = from_client(&Spec::tcp(CLIENT, 44004, NODE, 30083));
    untouched_xdp(&lab, &frame, "no route");
    assert_eq!(lab.tc("tc_external_ingress", &frame).0, TC_ACT_SHOT);
    assert_eq!(lab.p.drops(DROP_NO_ROUTE), 1);

    // No hop left: the same.
    let mut frame = from_client(&Spec::tcp(CLIENT, 44005, NODE, 30080));
    frame[ETH_HLEN + 8] = 1;
    packet::set_ip_checksum(&mut frame);
    untouched_xdp(&lab, &frame, "TTL 1");
    assert_eq!(lab.tc("tc_external_ingress", &frame).0, TC_ACT_SHOT);
    assert_eq!(lab.p.drops(DROP_NO_ROUTE), 2);

    // Bigger than the egress interface's MTU (and not a GRO packet, which the kernel would
    // segment), not to be fragmented: XDP leaves it to tc, which answers as the kernel's
    // forwarding would, with a fragmentation needed quoting it untranslated and naming the
    // MTU, counted as such (not as a missing route).
    lab.ns
        .ip_batch(&["link set ext1 mtu 1280".to_string()])
        .unwrap();
    let big = Spec {
        payload: vec![7; 1300],
        ..Spec::tcp(CLIENT, 44006, NODE, 30081)
    };
    let frame = from_client(&big);
    untouched_xdp(&lab, &frame, "bigger than the egress MTU");
    let (verdict, out) = lab.tc("tc_external_ingress", &frame);
    assert_eq!(verdict, TC_ACT_REDIRECT, "sent back out of ext0");
    // The lookup names the MTU from Linux 5.12; before, 0 (the client takes its minimum).
    let mtu = u16::from_be_bytes([out[ETH_HLEN + 26], out[ETH_HLEN + 27]]);
    assert!(mtu == 1280 || mtu == 0, "next-hop MTU {mtu}");
    packet::assert_unreachable(&out, &frame, packet::ICMP_FRAG_NEEDED, mtu);
    assert_eq!(lab.p.drops(DROP_FRAG_NEEDED), 1);
    assert_eq!(lab.p.drops(DROP_NO_ROUTE), 2);
    // One that may be fragmented is sent as it is (a tunnel fragments what carries it).
    let mut frame = from_client(&Spec {
        sport: 44008,
        ..big
    });
    frame[ETH_HLEN + 6] = 0;
    packet::set_ip_checksum(&mut frame);
    let (verdict, out) = lab.tc("tc_external_ingress", &frame);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_translated(&frame, &out, &to_ext1(&out));
    // What fits is sent as before.
    let fits = from_client(&Spec::tcp(CLIENT, 44007, NODE, 30081));
    assert_eq!(lab.tc("tc_external_ingress", &fits).0, TC_ACT_REDIRECT);
}

/// XDP handles only headers without options; tc translates those.
#[test]
fn ip_options_are_left_to_tc() {
    let eps = [(LOCAL_BE, TARGET, "node1")];
    let remote = [(REMOTE_BE, TARGET, "node2")];
    let Some(lab) = lab(
        "ip_options_are_left_to_tc",
        &[
            node_port("local", 30080, &eps),
            node_port("remote", 30081, &remote),
        ],
    ) else {
        return;
    };
    for words in [1, 10] {
        let mut options = vec![1u8; words * 4];
        *options.last_mut().unwrap() = 0;
        for (port, verdict) in [(30080, TC_ACT_UNSPEC), (30081, TC_ACT_REDIRECT)] {
            let spec = Spec {
                ip_options: options.clone(),
                ..Spec::tcp(CLIENT, 45000 + words as u16, NODE, port)
            };
            let frame = from_client(&spec);
            untouched_xdp(&lab, &frame, "IP options");
            let (v, out) = lab.tc("tc_external_ingress", &frame);
            assert_eq!(v, verdict, "{words} option words to {port}");
            let client = (CLIENT, spec.sport);
            let want = if port == 30080 {
                delivered(client, (LOCAL_BE, TARGET))
            } else {
                forwarded(
                    (NODE, snat_port(&out)),
                    (REMOTE_BE, TARGET),
                    NODE2_MAC,
                    EXT0_MAC,
                )
            };
            assert_translated(&frame, &out, &want);
        }
    }
}

/// The second load balancer address of [`local_policy_lab`].
const LB2: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 11);

/// Two externalTrafficPolicy Local services: NodePort 30090 and [`LB`] with an endpoint here
/// and one on node2; NodePort 30091 and [`LB2`] with both endpoints on node2.
fn local_policy_lab(test: &str) -> Option<Lab> {
    let mixed = [(LOCAL_BE, TARGET, "node1"), (REMOTE_BE, TARGET, "node2")];
    let elsewhere = [(REMOTE_BE, TARGET, "node2"), (REMOTE_BE2, TARGET, "node2")];
    lab(
        test,
        &[
            ExternalSvc {
                load_balancer_ips: &[LB],
                external_traffic_local: true,
                ..node_port("mixed", 30090, &mixed)
            },
            ExternalSvc {
                load_balancer_ips: &[LB2],
                external_traffic_local: true,
                ..node_port("elsewhere", 30091, &elsewhere)
            },
        ],
    )
}

/// externalTrafficPolicy Local: only this node's endpoints, the client's address kept; none
/// here: dropped (and counted), never sent elsewhere.
#[test]
fn external_traffic_policy_local_keeps_the_client_and_drops_without_a_local_endpoint() {
    let Some(lab) = local_policy_lab(
        "external_traffic_policy_local_keeps_the_client_and_drops_without_a_local_endpoint",
    ) else {
        return;
    };
    for (vip, vport) in [(NODE, 30090), (LB, PORT)] {
        for sport in 46000..46020 {
            let spec = Spec::tcp(CLIENT, sport, vip, vport);
            let frame = from_client(&spec);
            let client = (CLIENT, sport);
            let (to_stack, out) = if sport % 2 == 0 {
                let (v, out) = lab.xdp(&frame);
                (v == XDP_PASS, out)
            } else {
                let (v, out) = lab.tc("tc_external_ingress", &frame);
                (v == TC_ACT_UNSPEC, out)
            };
            assert!(to_stack, "{vip}:{vport} from {sport}: to the stack");
            assert_translated(&frame, &out, &delivered(client, (LOCAL_BE, TARGET)));
            let reply = on_wire(&answer(&spec, (LOCAL_BE, TARGET), client), EXT0_MAC);
            let (_, out) = lab.tc("tc_external_egress", &reply);
            assert_translated(&reply, &out, &delivered((vip, vport), client));
        }
    }
    for (i, (vip, vport)) in [(NODE, 30091), (LB2, PORT)].into_iter().enumerate() {
        let frame = from_client(&Spec::tcp(CLIENT, 46100 + i as u16, vip, vport));
        assert_eq!(lab.xdp(&frame).0, XDP_DROP, "{vip}:{vport}");
        assert_eq!(lab.tc("tc_external_ingress", &frame).0, TC_ACT_SHOT);
    }
    assert_eq!(lab.p.drops(DROP_NO_LOCAL_ENDPOINTS), 4);
}

/// A pod reaching its own node's NodePort (or a LoadBalancer address) of an
/// externalTrafficPolicy Local service is inside the cluster: kube-proxy gives it any
/// endpoint (the frontend's internal scope), not only this node's.
#[test]
fn a_pod_reaching_an_etp_local_node_port_gets_any_endpoint() {
    let Some(lab) = local_policy_lab("a_pod_reaching_an_etp_local_node_port_gets_any_endpoint")
    else {
        return;
    };
    for (vip, vport, all) in [
        (NODE, 30090, [LOCAL_BE, REMOTE_BE]),
        (LB, PORT, [LOCAL_BE, REMOTE_BE]),
        (NODE, 30091, [REMOTE_BE, REMOTE_BE2]),
        (LB2, PORT, [REMOTE_BE, REMOTE_BE2]),
    ] {
        let mut reached = BTreeSet::new();
        for sport in 47000..47040 {
            let spec = Spec::tcp(POD, sport, vip, vport);
            let frame = spec.build();
            let (verdict, out) = lab.tc("tc_ingress", &frame);
            assert_eq!(
                verdict, TC_ACT_UNSPEC,
                "{vip}:{vport} from the pod's port {sport}"
            );
            let seen = packet::read(&out);
            assert_eq!((seen.src, seen.sport, seen.dport), (POD, sport, TARGET));
            packet::assert_checksums(&out, false);
            reached.insert(seen.dst);
            // Its reply comes back from the address the pod used.
            let reply = answer(&spec, (seen.dst, TARGET), (POD, sport)).build();
            let (_, back) = lab.tc("tc_egress", &reply);
            let back = packet::read(&back);
            assert_eq!((back.src, back.sport), (vip, vport));
        }
        assert_eq!(
            reached,
            BTreeSet::from(all),
            "{vip}:{vport}: 40 flows should reach every endpoint"
        );
    }
}

/// loadBalancerSourceRanges apply to the LoadBalancer addresses only: other sources are
/// dropped there (and counted), and reach the NodePort and external IPs as before.
#[test]
fn load_balancer_source_ranges() {
    let eps = [(LOCAL_BE, TARGET, "node1")];
    let Some(lab) = lab(
        "load_balancer_source_ranges",
        &[ExternalSvc {
            load_balancer_ips: &[LB],
            external_ips: &[EXTERNAL_IP],
            source_ranges: &[
                (Ipv4Addr::new(203, 0, 113, 0), 24),
                (Ipv4Addr::new(198, 18, 0, 0), 15),
            ],
            ..node_port("ranged", NODE_PORT, &eps)
        }],
    ) else {
        return;
    };
    let mut dropped = 0;
    for (source, allowed) in [
        (CLIENT, true),
        (Ipv4Addr::new(198, 19, 255, 255), true),
        (Ipv4Addr::new(198, 18, 0, 1), true),
        (OUTSIDER, false),
        (Ipv4Addr::new(198, 20, 0, 0), false),
        (Ipv4Addr::new(203, 0, 114, 7), false),
    ] {
        let spec = Spec::tcp(source, 48000, LB, PORT);
        let frame = from_client(&spec);
        let (xdp, out) = lab.xdp(&frame);
        let (tc, tc_out) = lab.tc(
            "tc_external_ingress",
            &from_client(&Spec {
                sport: 48001,
                ..spec.clone()
            }),
        );
        if allowed {
            assert_eq!((xdp, tc), (XDP_PASS, TC_ACT_UNSPEC), "{source}");
            assert_translated(
                &frame,
                &out,
                &delivered((source, 48000), (LOCAL_BE, TARGET)),
            );
            assert_eq!(packet::read(&tc_out).dst, LOCAL_BE);
        } else {
            assert_eq!((xdp, tc), (XDP_DROP, TC_ACT_SHOT), "{source}");
            dropped += 2;
        }
        // The NodePort and the external IP take any source.
        for (vip, vport) in [(NODE, NODE_PORT), (EXTERNAL_IP, PORT)] {
            let spec = Spec::tcp(source, 48002, vip, vport);
            let frame = from_client(&spec);
            let (verdict, out) = lab.xdp(&frame);
            assert_eq!(verdict, XDP_PASS, "{source} to {vip}:{vport}");
            assert_translated(
                &frame,
                &out,
                &delivered((source, 48002), (LOCAL_BE, TARGET)),
            );
        }
    }
    assert_eq!(lab.p.drops(DROP_SOURCE_RANGE), dropped);
}

/// An outside client bound to another node's endpoint by session affinity is not sent there
/// once the Service's externalTrafficPolicy turns Local (the endpoint still serves clients
/// inside the cluster, so it is not draining): the binding names an endpoint the frontend no
/// longer has.
#[test]
fn session_affinity_follows_a_policy_turned_local() {
    let eps = [(LOCAL_BE, TARGET, "node1"), (REMOTE_BE, TARGET, "node2")];
    let svc = ExternalSvc {
        load_balancer_ips: &[LB],
        ..node_port("sticky", NODE_PORT, &eps)
    };
    let Some(mut lab) = lab("session_affinity_follows_a_policy_turned_local", &[]) else {
        return;
    };
    let mut state = DesiredState::new("node1");
    let spn = add_external_service(&mut state, &svc);
    state.port_mut(&spn).unwrap().session_affinity_timeout = std::num::NonZeroU32::new(3600);
    lab.p.program(&state).unwrap();
    // The verdict, and where the frame goes.
    let connect = |lab: &Lab, client, client_port| {
        let spec = Spec::tcp(client, client_port, LB, PORT);
        let (verdict, out) = lab.xdp(&from_client(&spec));
        (verdict, packet::read(&out).dst)
    };
    // A client bound to the remote endpoint (sent on: XDP_TX), the first of 100 that is.
    let client = (1..=100u8)
        .map(|n| Ipv4Addr::new(203, 0, 113, 100 + n))
        .find(|&client| connect(&lab, client, 43000) == (XDP_TX, REMOTE_BE))
        .expect("one of 100 clients bound to the remote endpoint");
    assert!((43001..43006).all(|port| connect(&lab, client, port) == (XDP_TX, REMOTE_BE)));
    state.port_mut(&spn).unwrap().external_traffic_local = true;
    lab.p.program(&state).unwrap();
    // Delivered here, to the local endpoint, from now on.
    for port in 43100..43105 {
        assert_eq!(connect(&lab, client, port), (XDP_PASS, LOCAL_BE));
    }
}

/// An externalTrafficPolicy Local frontend whose in-cluster scope is missing (the agent
/// writes it first; a full map could still leave it out) serves pods by its external scope
/// rather than passing their packets untranslated.
#[test]
fn a_missing_in_cluster_scope_leaves_no_pod_packet_untranslated() {
    let eps = [(LOCAL_BE, TARGET, "node1"), (REMOTE_BE, TARGET, "node2")];
    let Some(lab) = lab(
        "a_missing_in_cluster_scope_leaves_no_pod_packet_untranslated",
        &[ExternalSvc {
            load_balancer_ips: &[LB],
            external_traffic_local: true,
            ..node_port("local", NODE_PORT, &eps)
        }],
    ) else {
        return;
    };
    let data = MapData::from_pin(lab.p.bpffs.path().join(MAP_SERVICES)).unwrap();
    let mut services: BpfHashMap<_, ServiceKey, ServiceValue> =
        Map::HashMap(data).try_into().unwrap();
    let lb = Be32::from_octets(LB.octets());
    services
        .remove(&ServiceKey::new(lb, Be16::new(PORT), TCP, 0).with_scope(SCOPE_INTERNAL))
        .unwrap();
    for client_port in 48200..48210 {
        let frame = Spec::tcp(POD, client_port, LB, PORT).build();
        let (verdict, out) = lab.tc("tc_ingress", &frame);
        assert_eq!((verdict, packet::read(&out).dst), (TC_ACT_UNSPEC, LOCAL_BE));
    }
}

/// loadBalancerSourceRanges hold for pods reaching the load balancer address too (kube-proxy's
/// firewall applies to every source), with either traffic policy; the cluster IP stays open.
#[test]
fn load_balancer_source_ranges_hold_for_pods() {
    let eps = [(LOCAL_BE, TARGET, "node1"), (REMOTE_BE, TARGET, "node2")];
    let ranges = [(Ipv4Addr::new(10, 244, 1, 0), 24)];
    for local in [false, true] {
        let svc = ExternalSvc {
            load_balancer_ips: &[LB],
            source_ranges: &ranges,
            external_traffic_local: local,
            ..node_port("ranged", NODE_PORT, &eps)
        };
        let Some(lab) = lab("load_balancer_source_ranges_hold_for_pods", &[svc]) else {
            return;
        };
        let other_pod = Ipv4Addr::new(10, 244, 7, 10);
        for (source, vip, allowed) in [
            (POD, LB, true),
            (other_pod, LB, false),
            (other_pod, CLUSTER_IP, true),
        ] {
            let frame = Spec::tcp(source, 48100, vip, PORT).build();
            let (verdict, out) = lab.tc("tc_ingress", &frame);
            let what = format!("{source} to {vip}, externalTrafficPolicy Local: {local}");
            if allowed {
                assert_eq!(verdict, TC_ACT_UNSPEC, "{what}");
                assert!(
                    [LOCAL_BE, REMOTE_BE].contains(&packet::read(&out).dst),
                    "{what}"
                );
            } else {
                assert_eq!(verdict, TC_ACT_SHOT, "{what}");
            }
        }
        assert_eq!(lab.p.drops(DROP_SOURCE_RANGE), 1);
    }
}

/// Everything that is not a packet to an external frontend (or a reply of one of its flows)
/// passes every external program untouched, and leaves no conntrack entry behind.
#[test]
fn non_service_and_malformed_frames_pass_untouched() {
    let local = [(LOCAL_BE, TARGET, "node1")];
    let remote = [(REMOTE_BE, TARGET, "node2")];
    let Some(lab) = lab(
        "non_service_and_malformed_frames_pass_untouched",
        &[
            ExternalSvc {
                load_balancer_ips: &[LB],
                ..node_port("local", 30080, &local)
            },
            node_port("remote", 30081, &remote),
        ],
    ) else {
        return;
    };
    let good = from_client(&Spec::tcp(CLIENT, 40000, NODE, 30081));
    let mutate = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut frame = good.clone();
        f(&mut frame);
        frame
    };
    let mut cases: Vec<(String, Vec<u8>)> = vec![
        (
            "another port of the node".into(),
            Spec::tcp(CLIENT, 40000, NODE, 22),
        ),
        (
            "UDP to a TCP NodePort".into(),
            Spec::udp(CLIENT, 40000, NODE, 30080),
        ),
        (
            "the cluster IP, another port".into(),
            Spec::tcp(CLIENT, 40000, CLUSTER_IP, 443),
        ),
        (
            "the LB IP, another port".into(),
            Spec::tcp(CLIENT, 40000, LB, 443),
        ),
        (
            "a NodePort on another address".into(),
            Spec::tcp(CLIENT, 40000, LB, 30080),
        ),
        (
            "a reply-shaped packet without a flow".into(),
            Spec::tcp(REMOTE_BE, TARGET, NODE, SNAT_PORT_MIN),
        ),
        (
            "not to this node".into(),
            Spec::udp(CLIENT, 40000, Ipv4Addr::new(8, 8, 8, 8), 53),
        ),
    ]
    .into_iter()
    .map(|(what, spec)| (what, from_client(&spec)))
    .collect();
    let mut arp = vec![0u8; 60];
    arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    cases.push(("ARP".into(), arp));
    let mut ipv6 = vec![0u8; ETH_HLEN + 40 + 20];
    ipv6[12..14].copy_from_slice(&0x86ddu16.to_be_bytes());
    ipv6[ETH_HLEN] = 0x60;
    ipv6[ETH_HLEN + 5] = 20;
    ipv6[ETH_HLEN + 6] = TCP;
    cases.push(("IPv6".into(), ipv6));
    let mut vlan = good[..12].to_vec();
    vlan.extend_from_slice(&[0x81, 0x00, 0x00, 0x07]);
    vlan.extend_from_slice(&good[12..]);
    cases.push(("VLAN-tagged".into(), vlan));
    for (what, f) in [
        (
            "IHL below 5",
            &(|f: &mut Vec<u8>| f[ETH_HLEN] = 0x44) as &dyn Fn(&mut Vec<u8>),
        ),
        ("IHL beyond the packet", &|f| f[ETH_HLEN] = 0x4f),
        ("IP version 6 in an IPv4 frame", &|f| f[ETH_HLEN] = 0x65),
        ("total length below the headers", &|f| {
            f[ETH_HLEN + 2..ETH_HLEN + 4].copy_from_slice(&30u16.to_be_bytes())
        }),
        ("total length beyond the frame", &|f| {
            f[ETH_HLEN + 2..ETH_HLEN + 4].copy_from_slice(&1500u16.to_be_bytes())
        }),
        // A first fragment is translated by tc (fragments_of_node_port_flows_are_translated_by_tc).
        ("a later fragment whose first one was never seen", &|f| {
            f[ETH_HLEN + 7] = 0x10
        }),
        ("ICMP to the NodePort", &|f| f[ETH_HLEN + 9] = 1),
    ] {
        cases.push((what.into(), mutate(f)));
    }
    // Every truncation: XDP takes any frame with an Ethernet header; a tc test run refuses
    // IPv4 frames shorter than the fixed IPv4 header.
    const IPV4_MIN: usize = ETH_HLEN + 20;
    for (what, frame) in [
        ("TCP", &good),
        ("UDP", &from_client(&Spec::udp(CLIENT, 40000, NODE, 30081))),
    ] {
        for len in ETH_HLEN..frame.len() {
            cases.push((format!("{what} cut to {len} bytes"), frame[..len].to_vec()));
        }
    }
    for (what, frame) in &cases {
        untouched_xdp(&lab, frame, what);
        if frame.len() >= IPV4_MIN {
            untouched_tc(&lab, "tc_external_ingress", frame, what);
            untouched_tc(&lab, "tc_external_egress", frame, what);
        }
    }
    assert_eq!(lab.ct_len(), 0, "no flow recorded");
}

/// XDP and tc decide alike: on the same frame (tc running after XDP, as it does for what XDP
/// passes on, follows the flow XDP recorded, and the other way round) the verdicts match and
/// the frames they make are the same bytes.
#[test]
fn xdp_and_tc_agree_on_the_same_frame() {
    let local = [(LOCAL_BE, TARGET, "node1")];
    let remote = [(REMOTE_BE, TARGET, "node2")];
    let via_ext1 = [(EXT1_BE, TARGET, "node3")];
    let lb3 = Ipv4Addr::new(198, 51, 100, 12);
    let Some(lab) = lab(
        "xdp_and_tc_agree_on_the_same_frame",
        &[
            ExternalSvc {
                external_ips: &[EXTERNAL_IP],
                ..node_port("local", 30080, &local)
            },
            ExternalSvc {
                protocol: Protocol::Udp,
                ..node_port("local-udp", 30080, &local)
            },
            ExternalSvc {
                load_balancer_ips: &[LB],
                ..node_port("remote", 30081, &remote)
            },
            ExternalSvc {
                protocol: Protocol::Udp,
                ..node_port("remote-udp", 30081, &remote)
            },
            node_port("via-ext1", 30082, &via_ext1),
            ExternalSvc {
                load_balancer_ips: &[LB2],
                external_traffic_local: true,
                ..node_port("local-policy", 30083, &remote)
            },
            ExternalSvc {
                load_balancer_ips: &[lb3],
                source_ranges: &[(CLIENT, 32)],
                ..node_port("ranged", 30084, &local)
            },
        ],
    ) else {
        return;
    };
    let zero = |spec: Spec| Spec {
        udp_zero_checksum: true,
        ..spec
    };
    let specs = [
        Spec::tcp(CLIENT, 49000, NODE, 30080),
        Spec::tcp(CLIENT, 49000, EXTERNAL_IP, PORT),
        Spec::udp(CLIENT, 49000, NODE_B, 30080),
        zero(Spec::udp(CLIENT, 49001, NODE, 30080)),
        Spec::tcp(CLIENT, 49000, NODE, 30081),
        Spec::tcp(CLIENT, 49000, LB, PORT),
        Spec::udp(CLIENT, 49000, NODE_B, 30081),
        zero(Spec::udp(CLIENT, 49001, NODE, 30081)),
        Spec::tcp(CLIENT, 49000, NODE, 30082),
        Spec::tcp(CLIENT, 49000, NODE, 30083),
        Spec::tcp(CLIENT, 49000, LB2, PORT),
        Spec::tcp(CLIENT, 49000, lb3, PORT),
        Spec::tcp(CLIENT2, 49000, lb3, PORT),
        Spec::tcp(CLIENT, 49000, NODE, 22),
    ];
    let same = |xdp: u32, tc: u32| {
        matches!(
            (xdp, tc),
            (XDP_PASS, TC_ACT_UNSPEC)
                | (XDP_TX | XDP_REDIRECT, TC_ACT_REDIRECT)
                | (XDP_DROP, TC_ACT_SHOT)
        )
    };
    let mut forwarded = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        // XDP first, then tc on the next packet of the flow; a new flow (another client
        // port) the other way round.
        for (first_xdp, sport) in [(true, spec.sport), (false, spec.sport + 100)] {
            let frame = from_client(&Spec {
                sport,
                ..spec.clone()
            });
            let (x, t) = if first_xdp {
                let x = lab.xdp(&frame);
                (x, lab.tc("tc_external_ingress", &frame))
            } else {
                let t = lab.tc("tc_external_ingress", &frame);
                (lab.xdp(&frame), t)
            };
            assert!(
                same(x.0, t.0),
                "case {i} {spec:?}: XDP {} but tc {}",
                x.0,
                t.0
            );
            assert_eq!(
                x.1, t.1,
                "case {i} {spec:?}: XDP and tc made different frames"
            );
            if matches!(x.0, XDP_TX | XDP_REDIRECT) {
                forwarded.push((
                    Spec {
                        sport,
                        ..spec.clone()
                    },
                    x.1,
                ));
            }
        }
    }
    assert_eq!(forwarded.len(), 10, "the forwarded cases");
    // The replies to what was sent from the node, the same way.
    for (spec, sent) in forwarded {
        let out = packet::read(&sent);
        // node3's endpoint answers through ext1.
        let (ifindex, from) = if out.dst == EXT1_BE {
            (lab.ext1, NODE3_MAC)
        } else {
            (lab.ext0, NODE2_MAC)
        };
        let mut reply = on_wire(
            &answer(&spec, (out.dst, out.dport), (out.src, out.sport)),
            from,
        );
        if ifindex == lab.ext1 {
            reply[..6].copy_from_slice(&EXT1_MAC);
        }
        let x = lab.xdp_on(&reply, ifindex);
        let t = lab.tc_on("tc_external_ingress", &reply, ifindex);
        assert!(
            same(x.0, t.0),
            "reply to {spec:?}: XDP {} but tc {}",
            x.0,
            t.0
        );
        assert_eq!(x.1, t.1, "reply to {spec:?}");
        let back = packet::read(&x.1);
        assert_eq!(
            (
                IpAddr::from(back.src),
                back.sport,
                IpAddr::from(back.dst),
                back.dport
            ),
            (spec.dst, spec.dport, spec.src, spec.sport)
        );
        assert_eq!(&x.1[..6], &ROUTER_MAC, "back through the router");
    }
}

/// A frontend without endpoints is refused with an ICMP port unreachable from the address the
/// client used: XDP leaves that to tc.
#[test]
fn a_frontend_without_endpoints_is_refused_by_tc() {
    let Some(lab) = lab(
        "a_frontend_without_endpoints_is_refused_by_tc",
        &[ExternalSvc {
            load_balancer_ips: &[LB],
            ..node_port("empty", NODE_PORT, &[])
        }],
    ) else {
        return;
    };
    for spec in [
        Spec::tcp(CLIENT, 40000, NODE, NODE_PORT),
        Spec::tcp(CLIENT, 40001, NODE_B, NODE_PORT),
        Spec::tcp(CLIENT, 40002, LB, PORT),
    ] {
        let frame = from_client(&spec);
        untouched_xdp(&lab, &frame, "no endpoints");
        let (verdict, out) = lab.tc("tc_external_ingress", &frame);
        assert_eq!(verdict, TC_ACT_REDIRECT, "sent back out of ext0");
        packet::assert_port_unreachable(&out, &frame);
    }
    assert_eq!(lab.ct_len(), 0, "no flow recorded");
}

/// A local and a remote endpoint, for NodePorts `NODE_PORT` and `NODE_PORT + 1`.
const LOCAL: [(Ipv4Addr, u16, &str); 1] = [(LOCAL_BE, TARGET, "node1")];
const REMOTE: [(Ipv4Addr, u16, &str); 1] = [(REMOTE_BE, TARGET, "node2")];

/// `svc` over UDP.
fn udp(svc: ExternalSvc<'static>) -> ExternalSvc<'static> {
    ExternalSvc {
        protocol: Protocol::Udp,
        ..svc
    }
}

/// `frame` as it arrives on ext0 from `from`.
fn arriving(mut frame: Vec<u8>, from: [u8; 6]) -> Vec<u8> {
    frame[0..6].copy_from_slice(&EXT0_MAC);
    frame[6..12].copy_from_slice(&from);
    frame
}

/// ICMP errors about external flows are translated as netfilter translates its RELATED
/// packets, for local and remote endpoints, over TCP and UDP, quoting 8 bytes of the packet
/// (a router's least) or its whole TCP header: the endpoint's error about what it was sent
/// leaves from the NodePort, quoting what the client sent; a router's error about what the node
/// sent the client reaches the endpoint, quoting what the endpoint sent; and the same for a
/// remote endpoint's flow, whose errors are forwarded at once.
#[test]
fn icmp_errors_about_external_flows_are_translated_back() {
    let services = [
        node_port("web", NODE_PORT, &LOCAL),
        udp(node_port("dns", NODE_PORT, &LOCAL)),
        node_port("web-remote", NODE_PORT + 1, &REMOTE),
        udp(node_port("dns-remote", NODE_PORT + 1, &REMOTE)),
    ];
    let Some(lab) = lab(
        "icmp_errors_about_external_flows_are_translated_back",
        &services,
    ) else {
        return;
    };
    let router = Ipv4Addr::new(192, 168, 0, 1);
    let unreachable = (packet::ICMP_DEST_UNREACH, packet::ICMP_PORT_UNREACH);
    let too_big = (packet::ICMP_DEST_UNREACH, packet::ICMP_FRAG_NEEDED);
    let error = |from, (kind, code): (u8, u8), quoted: &Spec, quote| {
        packet::icmp_error(from, kind, code, &quoted.build(), quote)
    };
    let cases = [(TCP, 8), (TCP, 20), (UDP, 8)];
    for (i, (proto, quote)) in cases.into_iter().enumerate() {
        let what = format!("proto {proto}, quoting {quote} bytes");
        let sport = 42000 + i as u16;
        let spec = match proto {
            TCP => Spec::tcp(CLIENT, sport, NODE, NODE_PORT),
            _ => Spec::udp(CLIENT, sport, NODE, NODE_PORT),
        };
        let client = (CLIENT, sport);
        assert_eq!(lab.xdp(&from_client(&spec)).0, XDP_PASS, "{what}");
        // The local endpoint's error about the packet it got leaves from the NodePort.
        let got = Spec {
            dst: LOCAL_BE.into(),
            dport: TARGET,
            ..spec.clone()
        };
        let (verdict, out) = lab.tc(
            "tc_external_egress",
            &error(LOCAL_BE, unreachable, &got, quote),
        );
        assert_eq!(verdict, TC_ACT_UNSPEC, "{what}");
        packet::assert_icmp_error(&out, &error(NODE, unreachable, &spec, quote));
        // A router's error about the reply sent to the client: to the endpoint, through the
        // stack.
        let reply = answer(&spec, (NODE, NODE_PORT), client);
        let frame = arriving(error(router, too_big, &reply, quote), ROUTER_MAC);
        let (verdict, out) = lab.tc("tc_external_ingress", &frame);
        assert_eq!(verdict, TC_ACT_UNSPEC, "{what}");
        let by_endpoint = answer(&spec, (LOCAL_BE, TARGET), client);
        packet::assert_icmp_error(&out, &error(router, too_big, &by_endpoint, quote));

        // A remote endpoint's flow.
        let spec = Spec {
            dport: NODE_PORT + 1,
            ..spec
        };
        let (verdict, out) = lab.xdp(&from_client(&spec));
        assert_eq!(verdict, XDP_TX, "{what}");
        let sent = (NODE, snat_port(&out));
        // Its error about what the node sent it goes back to the client, from the NodePort.
        let got = Spec {
            src: sent.0.into(),
            sport: sent.1,
            dst: REMOTE_BE.into(),
            dport: TARGET,
            ..spec.clone()
        };
        let frame = arriving(error(REMOTE_BE, unreachable, &got, quote), NODE2_MAC);
        let (verdict, out) = lab.tc("tc_external_ingress", &frame);
        assert_eq!(verdict, TC_ACT_REDIRECT, "{what}");
        assert_eq!((&out[0..6], &out[6..12]), (&ROUTER_MAC[..], &EXT0_MAC[..]));
        let mut want = error(NODE, unreachable, &spec, quote);
        packet::hop(&mut want);
        packet::assert_icmp_error(&out, &want);
        // A router's error about the reply sent to the client goes on to the endpoint, from
        // the node address and port it knows the flow by.
        let reply = answer(&spec, (NODE, NODE_PORT + 1), client);
        let frame = arriving(error(router, too_big, &reply, quote), ROUTER_MAC);
        let (verdict, out) = lab.tc("tc_external_ingress", &frame);
        assert_eq!(verdict, TC_ACT_REDIRECT, "{what}");
        assert_eq!((&out[0..6], &out[6..12]), (&NODE2_MAC[..], &EXT0_MAC[..]));
        let by_endpoint = answer(&spec, (REMOTE_BE, TARGET), sent);
        let mut want = error(NODE, too_big, &by_endpoint, quote);
        packet::hop(&mut want);
        packet::assert_icmp_error(&out, &want);
    }
    // Errors about packets of no flow pass untouched, through XDP too.
    let stray = Spec::tcp(NODE, NODE_PORT, CLIENT, 9);
    let frame = arriving(error(router, too_big, &stray, 8), ROUTER_MAC);
    untouched_xdp(&lab, &frame, "an error about no flow");
    untouched_tc(
        &lab,
        "tc_external_ingress",
        &frame,
        "an error about no flow",
    );
}

/// `spec`'s frame forwarded out of ext0 towards `next_hop`, in two fragments cut at `cut`.
fn forwarded_fragments(spec: &Spec, next_hop: [u8; 6], cut: usize) -> [Vec<u8>; 2] {
    let mut frame = spec.build();
    frame[0..6].copy_from_slice(&next_hop);
    frame[6..12].copy_from_slice(&EXT0_MAC);
    let (mut first, mut later) = packet::fragments(&frame, cut);
    packet::hop(&mut first);
    packet::hop(&mut later);
    [first, later]
}

/// NodePort datagrams in fragments: XDP leaves every fragment to tc, which translates the first
/// as a whole packet and the later one by its IP header alone, to a local endpoint (handed to
/// the stack) and to a remote one (from the node address, forwarded); the remote endpoint's
/// reply in fragments goes back to the client.
#[test]
fn fragments_of_node_port_flows_are_translated_by_tc() {
    let services = [
        udp(node_port("dns", NODE_PORT, &LOCAL)),
        udp(node_port("dns-remote", NODE_PORT + 1, &REMOTE)),
    ];
    let Some(lab) = lab(
        "fragments_of_node_port_flows_are_translated_by_tc",
        &services,
    ) else {
        return;
    };
    let datagram = |sport, dport| Spec {
        payload: vec![7; 40],
        ..Spec::udp(CLIENT, sport, NODE, dport)
    };
    // A local endpoint.
    let spec = datagram(44000, NODE_PORT);
    let pieces = packet::fragments(&from_client(&spec), 16);
    let delivered = Spec {
        dst: LOCAL_BE.into(),
        dport: TARGET,
        ..spec.clone()
    };
    let want = packet::fragments(&from_client(&delivered), 16);
    for (piece, want) in [(&pieces.0, &want.0), (&pieces.1, &want.1)] {
        untouched_xdp(&lab, piece, "a fragment");
        assert_eq!(
            lab.tc("tc_external_ingress", piece),
            (TC_ACT_UNSPEC, want.clone())
        );
    }
    // A remote endpoint, and its reply.
    let spec = datagram(44001, NODE_PORT + 1);
    let (first, later) = packet::fragments(&from_client(&spec), 16);
    let (verdict, out) = lab.tc("tc_external_ingress", &first);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    let sent = (NODE, snat_port(&out));
    let to_endpoint = Spec {
        src: sent.0.into(),
        sport: sent.1,
        dst: REMOTE_BE.into(),
        dport: TARGET,
        ..spec.clone()
    };
    let want = forwarded_fragments(&to_endpoint, NODE2_MAC, 16);
    assert_eq!(out, want[0]);
    assert_eq!(
        lab.tc("tc_external_ingress", &later),
        (TC_ACT_REDIRECT, want[1].clone())
    );
    let reply = answer(&spec, (REMOTE_BE, TARGET), sent);
    let (first, later) = packet::fragments(&on_wire(&reply, NODE2_MAC), 16);
    let back = answer(&spec, (NODE, NODE_PORT + 1), (CLIENT, spec.sport));
    let want = forwarded_fragments(&back, ROUTER_MAC, 16);
    for (piece, want) in [(&first, &want[0]), (&later, &want[1])] {
        untouched_xdp(&lab, piece, "a fragment of the reply");
        assert_eq!(
            lab.tc("tc_external_ingress", piece),
            (TC_ACT_REDIRECT, want.clone())
        );
    }
}

/// An outside client's connection to a NodePort opened through kube-proxy's rules before the
/// programs took over, left to netfilter by the agent (an entry on each of its 5-tuples, the
/// reply one to the node address and port netfilter sent it from): XDP and tc pass its packets
/// untouched both ways, even a reply whose port netfilter picked is itself a NodePort.
#[test]
fn a_node_port_connection_left_to_netfilter_passes_untouched() {
    let eps = [(REMOTE_BE, TARGET, "node2")];
    let Some(lab) = lab(
        "a_node_port_connection_left_to_netfilter_passes_untouched",
        &[
            node_port("web", NODE_PORT, &eps),
            node_port("other", NODE_PORT + 1, &eps),
        ],
    ) else {
        return;
    };
    let (client, frontend) = ((CLIENT, 40300), (NODE, NODE_PORT));
    // Netfilter sent it from the node, on a port that is the other Service's NodePort.
    let (endpoint, sent_from) = ((REMOTE_BE, TARGET), (NODE, NODE_PORT + 1));
    let left = CtValue {
        vip: Be32::from_octets(NODE.octets()),
        vport: Be16::new(NODE_PORT),
        direction: CT_NETFILTER,
        last_seen_ns: monotonic_ns(),
        ..CtValue::default()
    };
    let mut ct = lab.p.conntrack();
    ct.insert(ct_key(client, frontend, TCP), left, 0).unwrap();
    ct.insert(ct_key(endpoint, sent_from, TCP), left, 0)
        .unwrap();
    let ack = |src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16)| {
        from_client(&Spec {
            tcp_flags: 0x10,
            ..Spec::tcp(src.0, src.1, dst.0, dst.1)
        })
    };
    for frame in [ack(client, frontend), ack(endpoint, sent_from)] {
        untouched_xdp(&lab, &frame, "a packet of a connection left to netfilter");
        untouched_tc(&lab, "tc_external_ingress", &frame, "the same");
    }
    assert_eq!(lab.ct_len(), 2, "no flow of the programs' own");
}

// IPv6: the external programs, tc and XDP, on IPv6 frames.

/// ext0's IPv6 address, the one NodePorts answer on.
const NODE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 1, 0, 0, 0, 0x10);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xff, 0, 0, 0, 0, 0x99);
/// node2's pod, behind 2001:db8:0:1::12 on ext0.
const REMOTE_BE6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 2, 0, 0, 0, 0x11);
/// The MTU of the lab's interfaces for [`lab6`] (what `packet::icmp_error` writes into a packet
/// too big).
const LAB6_MTU: u16 = 1400;

/// The lab with IPv6 on ext0 (its address [`NODE6`], the router and node2 as neighbours, node2's
/// pods routed via node2, an MTU of [`LAB6_MTU`]) and an IPv6-only service with a NodePort, TCP
/// and UDP, and [`REMOTE_BE6`] as its endpoint.
fn lab6(test: &str) -> Option<Lab> {
    if !privileged(test) {
        return None;
    }
    let mut state = DesiredState::new("node1");
    for protocol in [Protocol::Tcp, Protocol::Udp] {
        let svc = ExternalSvc {
            protocol,
            ..node_port("web6", NODE_PORT, &[])
        };
        let key = add_external_service(&mut state, &svc);
        let sp = state.port_mut(&key).expect("just added");
        sp.cluster_ips = [Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x10).into()].into();
        state.set_endpoints(key, vec![ready_endpoint(REMOTE_BE6.into(), TARGET)]);
    }
    let lab = lab_with(state);
    if !lab.p.xdp_runs_take_a_context() {
        say_skipped(
            test,
            "this kernel's BPF_PROG_TEST_RUN takes no xdp_md context (Linux 5.15)",
        );
        return None;
    }
    let lines = [
        format!("link set ext0 mtu {LAB6_MTU}"),
        "addr add 2001:db8:0:1::10/64 dev ext0 nodad".into(),
        format!(
            "neigh add 2001:db8:0:1::1 lladdr {} dev ext0 nud permanent",
            mac(ROUTER_MAC)
        ),
        format!(
            "neigh add 2001:db8:0:1::12 lladdr {} dev ext0 nud permanent",
            mac(NODE2_MAC)
        ),
        "route add default via 2001:db8:0:1::1 dev ext0".into(),
        "route add fd00:10:244:2::/64 via 2001:db8:0:1::12 dev ext0".into(),
    ];
    lab.ns.ip_batch(&lines).expect("IPv6 in the lab namespace");
    lab.ns
        .exec("sysctl", &["-q", "-w", "net.ipv6.conf.all.forwarding=1"])
        .expect("enabling IPv6 forwarding in the lab namespace");
    lab.p.set_node_addrs6(&[NODE6]);
    Some(lab)
}

/// An IPv6 NodePort whose endpoint is on another node: the client's packet leaves from the
/// node's address (a SNAT port picked) towards node2, a hop off, with valid checksums; the
/// endpoint's reply goes back to the client from the NodePort, towards the router. XDP sends
/// each out again itself (a new flow through xdp_new_flow6 and back), byte for byte as tc does.
#[test]
fn an_ipv6_node_port_to_another_nodes_endpoint_is_sent_from_the_node_and_its_reply_back() {
    let Some(lab) = lab6(
        "an_ipv6_node_port_to_another_nodes_endpoint_is_sent_from_the_node_and_its_reply_back",
    ) else {
        return;
    };
    for spec in [
        Spec::tcp(CLIENT6, 40000, NODE6, NODE_PORT),
        Spec::udp(CLIENT6, 40001, NODE6, NODE_PORT),
    ] {
        let frame = from_client(&spec);
        let (verdict, out) = lab.xdp(&frame);
        assert_eq!(verdict, XDP_TX, "{spec:?}");
        let (verdict, by_tc) = lab.tc("tc_external_ingress", &frame);
        assert_eq!((verdict, &by_tc), (TC_ACT_REDIRECT, &out), "{spec:?}");
        let (src, snat_port, dst, dport) = packet::tuple(&out);
        assert_eq!(
            (src, dst, dport),
            (NODE6.into(), REMOTE_BE6.into(), TARGET),
            "{spec:?}"
        );
        assert_eq!(out[ETH_HLEN + 7], frame[ETH_HLEN + 7] - 1, "a hop off");
        assert_eq!((&out[..6], &out[6..12]), (&NODE2_MAC[..], &EXT0_MAC[..]));
        packet::assert_checksums(&out, false);
        // The flow's next packet.
        let next = Spec {
            tcp_flags: if spec.proto == TCP { ACK } else { 0 },
            ..spec.clone()
        };
        let (verdict, by_xdp) = lab.xdp(&from_client(&next));
        assert_eq!(verdict, XDP_TX, "{spec:?}");
        let (_, by_tc) = lab.tc("tc_external_ingress", &from_client(&next));
        assert_eq!(by_xdp, by_tc, "XDP and tc translate alike: {spec:?}");
        packet::assert_checksums(&by_xdp, false);
        let reply = on_wire(
            &answer(&spec, (REMOTE_BE6, TARGET), (NODE6, snat_port)),
            NODE2_MAC,
        );
        let (verdict, back) = lab.xdp(&reply);
        assert_eq!(verdict, XDP_TX, "{spec:?}");
        assert_eq!(
            packet::tuple(&back),
            (NODE6.into(), NODE_PORT, CLIENT6.into(), spec.sport),
            "{spec:?}"
        );
        assert_eq!(back[ETH_HLEN + 7], reply[ETH_HLEN + 7] - 1, "a hop off");
        assert_eq!((&back[..6], &back[6..12]), (&ROUTER_MAC[..], &EXT0_MAC[..]));
        packet::assert_checksums(&back, false);
        let (verdict, by_tc) = lab.tc("tc_external_ingress", &reply);
        assert_eq!((verdict, by_tc), (TC_ACT_REDIRECT, back), "{spec:?}");
    }
}

/// An IPv6 packet too big for the interface its endpoint is behind is answered with an ICMPv6
/// packet too big naming that interface's MTU (IPv6 routers never fragment), from the address
/// the client sent it to, quoting its headers: byte for byte what the test's builder makes.
#[test]
fn an_ipv6_packet_too_big_for_the_way_on_is_answered_with_packet_too_big() {
    let Some(lab) = lab6("an_ipv6_packet_too_big_for_the_way_on_is_answered_with_packet_too_big")
    else {
        return;
    };
    let spec = Spec {
        tcp_flags: ACK,
        payload: vec![0; usize::from(LAB6_MTU)],
        ..Spec::tcp(CLIENT6, 40002, NODE6, NODE_PORT)
    };
    // The flow is open (a SYN fits), then a full-sized segment does not.
    let syn = Spec {
        payload: Vec::new(),
        tcp_flags: 0x02,
        ..spec.clone()
    };
    assert_eq!(
        lab.tc("tc_external_ingress", &from_client(&syn)).0,
        TC_ACT_REDIRECT
    );
    let frame = from_client(&spec);
    let (verdict, out) = lab.tc("tc_external_ingress", &frame);
    assert_eq!(verdict, TC_ACT_REDIRECT, "sent back out of ext0");
    let want = packet::icmp_error(NODE6, packet::ICMPV6_PACKET_TOO_BIG, 0, &frame, 16);
    assert_eq!(out[ETH_HLEN..], want[ETH_HLEN..]);
    assert_eq!(lab.p.drops(DROP_FRAG_NEEDED), 1);
}

/// ICMPv6 errors from outside about an IPv6 NodePort flow to another node's endpoint, as over
/// IPv4: the endpoint's port unreachable about what the node sent it goes back to the client
/// from the NodePort, quoting the client's packet; a router's packet too big about the reply
/// sent to the client goes on to the endpoint, quoting its reply as it sent it. Both forwarded
/// a hop off, byte for byte what the test's builder makes (the ICMPv6 checksum covers the
/// rewritten outer addresses). An error about no flow passes untouched.
#[test]
fn icmpv6_errors_about_external_flows_are_translated_back() {
    let Some(lab) = lab6("icmpv6_errors_about_external_flows_are_translated_back") else {
        return;
    };
    let router = Ipv6Addr::new(0x2001, 0xdb8, 0, 1, 0, 0, 0, 1);
    let unreachable = (packet::ICMPV6_DEST_UNREACH, packet::ICMPV6_PORT_UNREACH);
    let too_big = (packet::ICMPV6_PACKET_TOO_BIG, 0);
    let error = |from: Ipv6Addr, (kind, code): (u8, u8), quoted: &Spec, quote| {
        packet::icmp_error(from, kind, code, &quoted.build(), quote)
    };
    let hop = |mut f: Vec<u8>| {
        f[ETH_HLEN + 7] -= 1;
        f
    };
    for (i, (proto, quote)) in [(TCP, 8), (TCP, 20), (UDP, 8)].into_iter().enumerate() {
        let what = format!("proto {proto}, quoting {quote} bytes");
        let sport = 42000 + i as u16;
        let spec = match proto {
            TCP => Spec::tcp(CLIENT6, sport, NODE6, NODE_PORT),
            _ => Spec::udp(CLIENT6, sport, NODE6, NODE_PORT),
        };
        let (verdict, out) = lab.tc("tc_external_ingress", &from_client(&spec));
        assert_eq!(verdict, TC_ACT_REDIRECT, "{what}");
        let sent = (NODE6, packet::tuple(&out).1);
        let got = Spec {
            src: sent.0.into(),
            sport: sent.1,
            dst: REMOTE_BE6.into(),
            dport: TARGET,
            ..spec.clone()
        };
        let frame = arriving(error(REMOTE_BE6, unreachable, &got, quote), NODE2_MAC);
        let (verdict, out) = lab.tc("tc_external_ingress", &frame);
        assert_eq!(verdict, TC_ACT_REDIRECT, "{what}");
        assert_eq!((&out[0..6], &out[6..12]), (&ROUTER_MAC[..], &EXT0_MAC[..]));
        let want = hop(error(NODE6, unreachable, &spec, quote));
        assert_eq!(
            out[ETH_HLEN..],
            want[ETH_HLEN..],
            "{what}: the endpoint's error"
        );
        let reply = answer(&spec, (NODE6, NODE_PORT), (CLIENT6, sport));
        let frame = arriving(error(router, too_big, &reply, quote), ROUTER_MAC);
        let (verdict, out) = lab.tc("tc_external_ingress", &frame);
        assert_eq!(verdict, TC_ACT_REDIRECT, "{what}");
        assert_eq!((&out[0..6], &out[6..12]), (&NODE2_MAC[..], &EXT0_MAC[..]));
        let by_endpoint = answer(&spec, (REMOTE_BE6, TARGET), sent);
        let want = hop(error(NODE6, too_big, &by_endpoint, quote));
        assert_eq!(
            out[ETH_HLEN..],
            want[ETH_HLEN..],
            "{what}: the router's error"
        );
    }
    let stray = Spec::tcp(NODE6, NODE_PORT, CLIENT6, 9);
    let frame = arriving(error(router, too_big, &stray, 8), ROUTER_MAC);
    untouched_tc(
        &lab,
        "tc_external_ingress",
        &frame,
        "an error about no flow",
    );
}
