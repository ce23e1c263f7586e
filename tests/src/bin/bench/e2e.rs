//! `cargo xtask bench e2e`: the agent serving N ClusterIP Services in the sandbox, measured as a
//! user sees it. For each N: the agent (release build) starts on the stand-in API server holding
//! N Services of 3 endpoints (the first and the last-created with the sandbox's real pods, the
//! others with addresses nothing answers); then, from the client pod, short TCP connections
//! (connect, a line, its reply, close) straight to the pods, to the first Service's ClusterIP
//! and to the last one's, in interleaved rounds; then one-endpoint changes applied to the API
//! server one at a time, each timed until the datapath's map holds it.
//!
//! Per N: connections a second (median of the rounds) with p50/p99 connection times, the ratio
//! to direct, the time from the agent's start to its first full sync, the agent's VmRSS then,
//! and the one-change latency (p50/p99). Written as a markdown table and two SVG charts under
//! target/bench/, with the machine's description.
//!
//! Each N runs every mode that runs on this machine (`--modes`; IPVS needs the VM's kernel):
//! ebpf, translating pods' connections per packet (its default) and at connect()
//! (ebpf-socket-lb), and kube-proxy's modes as this project writes them (iptables on legacy
//! iptables, nftables, userspace). A mode's direct figures are measured in its own rounds,
//! interleaved with its Service paths.
use std::{
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use proxy_tests::{
    BACKEND_PORT, NODE1_IP, Sandbox,
    agent::{TestCgroup, agent_bin},
    apiserver::{self, ApiServer},
    programs::PrivateBpffs,
    scenarios::Mode,
};

use crate::{
    agent::{Running, Sample, TooSlow, mib},
    chart::{Series, line_chart},
    connections::{self, Failures, Load, median, percentile},
};

pub struct Options {
    pub services: Vec<u32>,
    /// The modes, as the scenario suite names them.
    pub modes: Vec<&'static Mode>,
    pub load: Load,
    pub rounds: u32,
    /// One-endpoint changes timed per N.
    pub changes: u32,
}

const NAMESPACE: &str = "bench";
/// How long a mode may take from its start to its first full sync: one that takes longer
/// stops there (reported), and is not run at larger counts.
const START_BUDGET: Duration = Duration::from_secs(300);
/// The Services' port; their endpoints listen on the sandbox backends' port.
const PORT: u16 = 80;
/// The pods behind the first and the last Service (node1's two, node2's one).
const PODS: [&str; 3] = ["be1", "be2", "be4"];

/// The modes measured by default (the scenario suite's names, and [`EBPF_SOCKET_LB`]):
/// iptables on nf_tables is left out, its restore of 10k Services takes minutes here.
pub const DEFAULT_MODES: &[&str] = &[
    "ebpf",
    "ebpf-socket-lb",
    "iptables-legacy",
    "nftables",
    "userspace",
];

/// The ebpf mode with pods' TCP connections translated at connect() (`--bpf-socket-lb all`),
/// beside its default, which translates them per packet. The client pod's threads join the
/// agent's cgroup for it, as a pod's processes are below the cgroup the programs are attached
/// to on a node. Not in the scenario suite, whose pod clients are threads of the test process
/// (see tests/tests/host.rs for its tests).
pub static EBPF_SOCKET_LB: Mode = Mode {
    id: "ebpf-socket-lb",
    title: "ebpf, socket LB for pods",
    args: &["--proxy-mode", "ebpf", "--bpf-socket-lb", "all"],
    kernel_has: || Ok(()),
    not_applicable: &[],
    needs: &[],
    ipv6: false,
};

/// A mode by its name: the scenario suite's, or [`EBPF_SOCKET_LB`].
pub fn parse_mode(id: &str) -> Result<&'static Mode, String> {
    if id == EBPF_SOCKET_LB.id {
        return Ok(&EBPF_SOCKET_LB);
    }
    proxy_tests::scenarios::parse_mode(id).map_err(|e| format!("{e}, {}", EBPF_SOCKET_LB.id))
}

/// What one N measured in one mode.
struct Cell {
    services: u32,
    mode: &'static str,
    /// Direct, first Service, last Service: median rate, p50 and p99 connection time.
    paths: [(f64, Duration, Duration); 3],
    /// The last Service's rate over direct, per round: with the load's threads, then with one.
    ratios: [Ratio; 2],
    start: Sample,
    change_p50: Duration,
    change_p99: Duration,
    /// How many changes those are (fewer than asked where syncs are slow).
    changes: usize,
}

fn vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 1)) + i)
}

pub fn run(opts: &Options) -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "the end-to-end benchmark builds network namespaces and runs the agent: run it as root"
        );
    }
    proxy_tests::cleanup_stale();
    // The agents inherit it (the userspace mode needs a socket a Service port).
    let open_files = proxy_userspace::modes::userspace::raise_open_files_limit();
    let agent = agent_bin()?;
    let mut sandbox = Sandbox::build().context("building the sandbox")?;
    sandbox.start_backends(BACKEND_PORT)?;
    // Thousands of connections a second to one address: the client reuses its ports in
    // TIME_WAIT (after a second, with timestamps) and has the whole port range, so that finding
    // a free port does not slow a path to one address (a Service) more than one to three (the
    // pods): measured with the default range, that search alone cost a Service path 25%. Its
    // own namespace only.
    let status = sandbox
        .pod("client")
        .ns
        .cmd("sysctl")
        .args([
            "-q",
            "-w",
            "net.ipv4.tcp_tw_reuse=1",
            "net.ipv4.ip_local_port_range=1024 65535",
        ])
        .status()?;
    anyhow::ensure!(
        status.success(),
        "sysctl tcp_tw_reuse in the client pod failed"
    );
    // node1 reuses its ports in TIME_WAIT too: the userspace mode's proxy opens a connection to
    // an endpoint for each of the client's, and without it runs out of ports after a few rounds.
    // (Its port range stays: the ebpf mode's SNAT ports are below it.)
    let status = (sandbox.node1.cmd("sysctl"))
        .args(["-q", "-w", "net.ipv4.tcp_tw_reuse=1"])
        .status()?;
    anyhow::ensure!(status.success(), "sysctl tcp_tw_reuse on node1 failed");
    let machine = machine();
    println!("{machine}");
    println!(
        "short TCP connections from the client pod, {} threads, {} interleaved rounds of {:.1} s \
         per path; {} one-endpoint changes per N",
        opts.load.threads, opts.rounds, opts.load.seconds, opts.changes
    );
    let mut cells = Vec::new();
    let mut not_run = Vec::new();
    // The modes that could not serve at some count, not run at the larger ones.
    let mut stopped = Vec::new();
    for &n in &opts.services {
        let listener = sandbox
            .node1
            .try_run(|| TcpListener::bind("127.0.0.1:0"))??;
        let api = ApiServer::start_with_listener(listener)?;
        eprint!("{n} services: filling the stand-in API server...");
        api.apply(apiserver::node("node1", &NODE1_IP.to_string()));
        for object in objects(&sandbox, n) {
            api.apply(object);
        }
        eprintln!(" done");
        for mode in &opts.modes {
            // The userspace proxy holds a socket a Service port, and two a connection.
            let wanted = u64::from(n) + 8192;
            if mode.id == "userspace" && open_files < wanted {
                let why = format!(
                    "userspace at {n} Services: not run, the agent may open {open_files} files \
                     (this process's hard limit, which it cannot raise: no CAP_SYS_RESOURCE) \
                     and needs about {wanted}"
                );
                eprintln!("{why}");
                not_run.push(why);
                continue;
            }
            if stopped.contains(&mode.id) {
                continue;
            }
            match measure(&mut sandbox, &agent, &api, n, (mode.id, mode.args), opts) {
                Ok(cell) => cells.push(cell),
                Err(e) if e.downcast_ref::<TooSlow>().is_some() => {
                    let why = format!(
                        "{} at {n} Services and more: stopped, no full sync within {} s of \
                         the agent's start",
                        mode.id,
                        START_BUDGET.as_secs()
                    );
                    eprintln!("{why}");
                    not_run.push(why);
                    stopped.push(mode.id);
                }
                Err(e) => return Err(e.context(format!("{n} services, {}", mode.id))),
            }
        }
    }
    let mut table = table(&cells);
    for why in &not_run {
        let _ = writeln!(table, "\nNot measured: {why}.");
    }
    println!("\n{table}");
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&dir)?;
    let points: Vec<Point> = cells.iter().map(Point::of).collect();
    write_charts(&dir, &points)?;
    std::fs::write(
        dir.join("e2e.md"),
        format!("{machine}\n\n{table}\n![rate](e2e-rate.svg)\n![sync](e2e-sync.svg)\n"),
    )?;
    println!(
        "written: {}/e2e.md, e2e-rate.svg, e2e-sync.svg",
        dir.display()
    );
    Ok(())
}

/// The Services and slices for `n`.
fn objects(sandbox: &Sandbox, n: u32) -> Vec<serde_json::Value> {
    let mut out = Vec::with_capacity(2 * n as usize);
    for i in 0..n {
        let name = format!("svc-{i}");
        out.push(apiserver::service(
            NAMESPACE,
            &name,
            &vip(i).to_string(),
            &[("http", PORT, "TCP", BACKEND_PORT)],
        ));
        out.push(slice(&name, &endpoints_of(sandbox, n, i)));
    }
    out
}

/// The endpoints of Service `i` of `n`: the sandbox's pods for the first and the last, three
/// addresses nothing answers for the others.
fn endpoints_of(sandbox: &Sandbox, n: u32, i: u32) -> Vec<String> {
    if i == 0 || i == n - 1 {
        return PODS.iter().map(|p| sandbox.pod(p).ip.to_string()).collect();
    }
    (0..3)
        .map(|k| Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 1)) + 3 * i + k))
        .map(|ip| ip.to_string())
        .collect()
}

fn slice(service: &str, ips: &[String]) -> serde_json::Value {
    let endpoints: Vec<(&str, bool, Option<&str>)> =
        ips.iter().map(|ip| (ip.as_str(), true, None)).collect();
    apiserver::endpoint_slice(
        NAMESPACE,
        &format!("{service}-1"),
        service,
        &endpoints,
        &[("http", BACKEND_PORT, "TCP")],
    )
}

fn measure(
    sandbox: &mut Sandbox,
    agent: &Path,
    api: &ApiServer,
    n: u32,
    (mode, mode_args): (&'static str, &[&str]),
    opts: &Options,
) -> anyhow::Result<Cell> {
    let node = &sandbox.node1;
    let dir = std::env::temp_dir().join(format!("proxy-bench-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let kubeconfig = dir.join("kubeconfig");
    api.kubeconfig(&kubeconfig)?;
    let bpffs = PrivateBpffs::new()?;
    let cgroup = TestCgroup::new()?;
    let mut cmd = Command::new(agent);
    cmd.args(["--logging-format", "json", "agent", "--kubeconfig"])
        .arg(&kubeconfig)
        .args(["--hostname-override", "node1", "--bpf-pin-dir"])
        .arg(bpffs.path())
        .arg("--bpf-cgroup-path")
        .arg(cgroup.path())
        .args(["--healthz-bind-address", "", "--metrics-bind-address", ""])
        .args(mode_args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    node.enter(&mut cmd)?;
    eprintln!("{n} services, {mode}: starting the agent");
    let started = Instant::now();
    let mut running = Running::new(cmd.spawn().context("starting the agent")?);
    let start = match running.watch(started, "Services and EndpointSlices listed", START_BUDGET) {
        Ok(start) => start,
        Err(e) => {
            // What the mode wrote so far goes before the next agent starts.
            running.stop();
            proxy_tests::agent::cleanup(agent, &sandbox.node1, bpffs.path())?;
            return Err(e);
        }
    };
    eprintln!(
        "{n} services, {mode}: first full sync {:.2} s after start, VmRSS {:.1} MiB",
        start.synced.as_secs_f64(),
        mib(start.rss)
    );

    // For the measurements.
    let joined = match mode == EBPF_SOCKET_LB.id {
        true => Some(cgroup.join()?),
        false => None,
    };
    let client = &sandbox.pod("client").ns;
    let direct: Vec<SocketAddr> = PODS
        .iter()
        .map(|p| sandbox.pod(p).addr(BACKEND_PORT))
        .collect();
    let targets = [
        direct,
        vec![SocketAddr::from((vip(0), PORT))],
        vec![SocketAddr::from((vip(n - 1), PORT))],
    ];
    let mut rates: [Vec<f64>; 3] = Default::default();
    let mut latencies: [Vec<Duration>; 3] = Default::default();
    let mut failures: [Failures; 3] = Default::default();
    let mut round = |load: Load, rates: &mut [Vec<f64>; 3], latencies: &mut [Vec<Duration>; 3]| {
        for (path, target) in targets.iter().enumerate() {
            let r = connections::measure(client, target, load, &mut failures[path])?;
            rates[path].push(r.rate);
            latencies[path].extend(r.latencies);
        }
        anyhow::Ok(())
    };
    // Rounds until the last Service's ratio is told apart from 0.97 and 0.90 (or the cap).
    let mut ratios = [Ratio::default(), Ratio::default()];
    let (mut one_rates, mut one_latencies) = (Default::default(), Default::default());
    for (k, threads) in [opts.load.threads, 1].into_iter().enumerate() {
        let load = Load {
            threads,
            ..opts.load
        };
        let (rates, latencies) = match k {
            0 => (&mut rates, &mut latencies),
            _ => (&mut one_rates, &mut one_latencies),
        };
        for r in 0..opts.rounds * MORE_ROUNDS {
            eprint!(
                "\r{n} services, {mode}: {threads} threads, round {} ",
                r + 1
            );
            round(load, rates, latencies)?;
            ratios[k] = Ratio::of(&rates[2], &rates[0]);
            if r + 1 >= opts.rounds && ratios[k].decided() {
                break;
            }
        }
    }
    if joined.is_some() {
        // Proof that the client's connections took the socket path: none reached conntrack.
        let flows = proxy_userspace::modes::ebpf::inspect::conntrack(bpffs.path())?;
        let service = SocketAddr::from((vip(n - 1), PORT)).to_string();
        let per_packet = flows.iter().filter(|f| f.destination == service).count();
        anyhow::ensure!(
            per_packet == 0,
            "{mode}: {per_packet} of the client's connections were translated per packet"
        );
    }
    drop(joined);
    eprintln!();
    let mut paths = [(0.0, Duration::ZERO, Duration::ZERO); 3];
    for i in 0..3 {
        paths[i] = (
            median(&mut rates[i]),
            percentile(&mut latencies[i], 50.0),
            percentile(&mut latencies[i], 99.0),
        );
    }

    let mut changes = one_endpoint_changes(sandbox, api, &mut running, n, opts.changes)?;
    let cell = Cell {
        services: n,
        mode,
        paths,
        ratios,
        start,
        change_p50: percentile(&mut changes, 50.0),
        change_p99: percentile(&mut changes, 99.0),
        changes: changes.len(),
    };
    running.stop();
    // What the mode left goes before the next agent starts, outside anything measured.
    proxy_tests::agent::cleanup(agent, &sandbox.node1, bpffs.path())?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(cell)
}

/// Times `count` changes of one Service's endpoints (a fourth endpoint added, then removed
/// again), each from its write to the API server until the agent logs the sync that
/// programmed it, a little over a second apart; at least 3, then as many as 90 s allow.
fn one_endpoint_changes(
    sandbox: &Sandbox,
    api: &ApiServer,
    agent: &mut Running,
    n: u32,
    count: u32,
) -> anyhow::Result<Vec<Duration>> {
    let m = n / 2;
    let name = format!("svc-{m}");
    let mut ips = endpoints_of(sandbox, n, m);
    let mut times = Vec::new();
    // Where each sync takes seconds (iptables with tens of thousands of Services), fewer.
    let budget = Instant::now() + Duration::from_secs(90);
    for k in 0..count {
        if k >= 3 && Instant::now() > budget {
            break;
        }
        if k % 2 == 0 {
            ips.push("10.200.0.1".into());
        } else {
            ips.pop();
        }
        agent.skip_pending();
        let at = Instant::now();
        api.apply(slice(&name, &ips));
        let done = agent
            .next_message(&["sync done", "full sync done"], Duration::from_secs(60))
            .with_context(|| format!("change {k} of {name}"))?;
        times.push(done - at);
        // One at a time: with the default --min-sync-period (1 s, as kube-proxy's), a change
        // after a quiet second is synced at once; one sooner waits for the rest of the second.
        std::thread::sleep(Duration::from_millis(1100));
    }
    Ok(times)
}

fn table(cells: &[Cell]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| services | mode | direct conn/s (p50 / p99) | first Service | ratio | last Service | ratio | start to first full sync | VmRSS | one change p50 / p99 (changes) | last / direct, 95% interval (rounds) | the same, 1 thread |"
    );
    let _ = writeln!(
        out,
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for c in cells {
        let path = |(rate, p50, p99): (f64, Duration, Duration)| {
            format!("{rate:.0} ({:.2} / {:.2} ms)", ms(p50), ms(p99))
        };
        let direct = c.paths[0].0;
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.2} | {} | {:.2} | {:.2} s | {:.1} MiB | {:.2} / {:.2} ms ({}) | {} | {} |",
            c.services,
            c.mode,
            path(c.paths[0]),
            path(c.paths[1]),
            c.paths[1].0 / direct,
            path(c.paths[2]),
            c.paths[2].0 / direct,
            c.start.synced.as_secs_f64(),
            mib(c.start.rss),
            ms(c.change_p50),
            ms(c.change_p99),
            c.changes,
            c.ratios[0],
            c.ratios[1],
        );
    }
    let _ = writeln!(
        out,
        "\nRates are medians of the rounds, connection times over all of them; ratio: through \
         the Service / direct, in the same mode's rounds (direct is the ceiling here: client, \
         node and servers share the machine). The interval: of the mean of the rounds' own \
         ratios (last Service over direct in one round; Student's t), rounds added (up to three \
         times those asked for) until it lies above 0.90 or below 0.97, so that a ratio near 1 \
         is told from one near 0.9; 'undecided' otherwise. The same again with one client \
         thread. The API source: start to first full sync includes \
         listing the Services. One change: a fourth endpoint added to (or removed from) one \
         Service, from the write to the stand-in API server until the agent logs the sync that \
         programmed it; the changes come a second apart (with --min-sync-period at its default \
         1 s, a change sooner after a sync waits for the rest of that second, as with \
         kube-proxy). ebpf: the client pod's connections translated per packet by the tc \
         programs (the default); ebpf-socket-lb: at connect() by the socket programs \
         (--bpf-socket-lb all). iptables-legacy, nftables, userspace: kube-proxy's modes as \
         this project writes them (iptables on legacy iptables: with nf_tables, iptables-restore of 10k \
         Services took 190 s on this machine). In the iptables modes the direct figure falls \
         with the number of Services because every new connection through the node, to a \
         Service or not, walks KUBE-SERVICES (or KUBE-PORTALS-CONTAINER) rule by rule: compare \
         absolute rates across modes (the chart)."
    );
    out
}

/// The machine the figures come from.
fn machine() -> String {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")?
                .split_once(':')
                .map(|(_, m)| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let when = proxy_userspace::serve::healthz::rfc3339(std::time::SystemTime::now());
    format!(
        "Machine: {cpu}, {cores} cores, kernel {}; measured {when}.",
        kernel.trim()
    )
}

/// What the charts show of one N in one mode.
struct Point {
    services: u32,
    mode: String,
    /// Connections a second straight to the pods, and to the last Service.
    direct: f64,
    last: f64,
    /// Seconds from the agent's start to its first full sync.
    synced: f64,
}

impl Point {
    fn of(cell: &Cell) -> Self {
        Self {
            services: cell.services,
            mode: cell.mode.to_owned(),
            direct: cell.paths[0].0,
            last: cell.paths[2].0,
            synced: cell.start.synced.as_secs_f64(),
        }
    }

    /// A row of the table [`table`] writes.
    fn parse(row: &str) -> Option<Self> {
        let cells: Vec<&str> = row
            .trim()
            .trim_matches('|')
            .split('|')
            .map(str::trim)
            .collect();
        let first = |cell: &str| -> Option<f64> { cell.split_whitespace().next()?.parse().ok() };
        Some(Self {
            services: cells.first()?.parse().ok()?,
            mode: (*cells.get(1)?).to_owned(),
            direct: first(cells.get(2)?)?,
            last: first(cells.get(5)?)?,
            synced: first(cells.get(7)?)?,
        })
    }
}

/// e2e-rate.svg and e2e-sync.svg in `dir`: each mode in its own colour, the rate to its last
/// Service beside its own direct rate (dashed: the ceiling its ratio is taken against).
fn write_charts(dir: &Path, points: &[Point]) -> anyhow::Result<()> {
    let mut services: Vec<u32> = points.iter().map(|p| p.services).collect();
    services.sort_unstable();
    services.dedup();
    let mut modes: Vec<&str> = Vec::new();
    for p in points {
        if !modes.contains(&p.mode.as_str()) {
            modes.push(&p.mode);
        }
    }
    let labels: Vec<String> = services.iter().map(u32::to_string).collect();
    // One value a count (NaN where the mode was not run: no point there).
    let of_mode = |mode: &str, value: fn(&Point) -> f64| -> Vec<f64> {
        (services.iter())
            .map(|&n| {
                (points.iter())
                    .find(|p| p.mode == mode && p.services == n)
                    .map_or(f64::NAN, value)
            })
            .collect()
    };
    let series = |name: String, colour, values, dashed| Series {
        name,
        values,
        colour,
        dashed,
    };
    let mut rates = Vec::new();
    let mut synced = Vec::new();
    for (k, mode) in modes.iter().enumerate() {
        rates.push(series(
            mode.to_string(),
            k,
            of_mode(mode, |p| p.last),
            false,
        ));
        rates.push(series(
            format!("{mode}: direct"),
            k,
            of_mode(mode, |p| p.direct),
            true,
        ));
        synced.push(series(
            mode.to_string(),
            k,
            of_mode(mode, |p| p.synced),
            false,
        ));
    }
    let charts = [
        (
            "e2e-rate.svg",
            line_chart(
                "Short TCP connections a second to the last Service, by number of Services",
                "connections/s",
                &labels,
                &rates,
            ),
        ),
        (
            "e2e-sync.svg",
            line_chart(
                "Agent start to first full sync, by number of Services",
                "seconds",
                &labels,
                &synced,
            ),
        ),
    ];
    for (name, svg) in &charts {
        std::fs::write(dir.join(name), svg)?;
    }
    Ok(())
}

/// Draws the charts again from an e2e.md table a run wrote (`--replot`), beside it: a change of
/// the charts' drawing needs no new measurement.
pub fn replot(table: &Path) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(table).with_context(|| format!("reading {}", table.display()))?;
    let points: Vec<Point> = text.lines().filter_map(Point::parse).collect();
    anyhow::ensure!(
        !points.is_empty(),
        "{} holds no table row of bench e2e",
        table.display()
    );
    let dir = table.parent().unwrap_or(Path::new("."));
    write_charts(dir, &points)?;
    println!(
        "written from {} rows: {}/e2e-rate.svg, e2e-sync.svg",
        points.len(),
        dir.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_the_table_are_read_back() {
        let row = "| 30000 | ebpf | 10155 (0.35 / 1.07 ms) | 9830 (0.36 / 1.12 ms) | 0.97 | 9754 (0.36 / 1.16 ms) | 0.96 | 1.42 s | 80.8 MiB | 1.83 / 1.99 ms (20) |";
        let p = Point::parse(row).unwrap();
        assert_eq!((p.services, p.mode.as_str()), (30000, "ebpf"));
        assert_eq!((p.direct, p.last, p.synced), (10155.0, 9754.0, 1.42));
        assert!(Point::parse("| ---: | --- |").is_none());
        assert!(Point::parse("| services | mode | direct").is_none());
    }

    #[test]
    fn ratios_are_decided_when_their_interval_leaves_out_090_or_097() {
        let direct = [10000.0; 4];
        let near_one = Ratio::of(&[9950.0, 10010.0, 9980.0, 10020.0], &direct);
        assert!(near_one.decided() && near_one.low > 0.90, "{near_one}");
        let near_090 = Ratio::of(&[9000.0, 9050.0, 8950.0, 9020.0], &direct);
        assert!(near_090.decided() && near_090.high < 0.97, "{near_090}");
        let noisy = Ratio::of(&[8000.0, 10500.0, 9100.0, 9900.0], &direct);
        assert!(!noisy.decided(), "{noisy}");
        assert!(noisy.to_string().ends_with("(4) undecided"), "{noisy}");
        assert!(
            !Ratio::of(&[9900.0], &direct[..1]).decided(),
            "one round decides nothing"
        );
    }
}

/// Rounds at most, as a multiple of those asked for, while a ratio is undecided.
const MORE_ROUNDS: u32 = 3;

/// The last Service's rate over direct: the mean of the rounds' own ratios and its 95%
/// interval.
#[derive(Clone, Copy, Debug, Default)]
struct Ratio {
    mean: f64,
    low: f64,
    high: f64,
    rounds: usize,
}

impl Ratio {
    fn of(service: &[f64], direct: &[f64]) -> Self {
        let ratios: Vec<f64> = service.iter().zip(direct).map(|(s, d)| s / d).collect();
        let n = ratios.len();
        if n == 0 {
            return Self::default();
        }
        let mean = ratios.iter().sum::<f64>() / n as f64;
        if n == 1 {
            return Self {
                mean,
                low: f64::NEG_INFINITY,
                high: f64::INFINITY,
                rounds: 1,
            };
        }
        let variance = ratios.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        let half = student_t95(n - 1) * (variance / n as f64).sqrt();
        Self {
            mean,
            low: mean - half,
            high: mean + half,
            rounds: n,
        }
    }

    /// Whether the interval tells 0.97 from 0.90: it lies above the one or below the other.
    fn decided(&self) -> bool {
        self.low > 0.90 || self.high < 0.97
    }
}

impl std::fmt::Display for Ratio {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.rounds < 2 {
            return write!(f, "{:.2} ({})", self.mean, self.rounds);
        }
        write!(
            f,
            "{:.2} [{:.2}, {:.2}] ({}){}",
            self.mean,
            self.low,
            self.high,
            self.rounds,
            if self.decided() { "" } else { " undecided" }
        )
    }
}

/// Student's t for a two-sided 95% interval with `df` degrees of freedom.
fn student_t95(df: usize) -> f64 {
    const T: [f64; 20] = [
        12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13,
        2.12, 2.11, 2.10, 2.09, 2.09,
    ];
    T.get(df.wrapping_sub(1)).copied().unwrap_or(2.0)
}
