//! `cargo xtask bench agent`: the real agent binary (release build) on N Services of one
//! ClusterIP TCP port and one EndpointSlice of 3 endpoints each, from a manifest file (or from
//! the stand-in API server with `--source api`). It reports how long the agent takes from its
//! start to the end of its first full sync, how much of that the sync itself took (the BPF map
//! writes), and the agent's memory afterwards (VmRSS and VmHWM from /proc/<pid>/status).
//!
//! The agent runs in a network namespace of its own (with no pod interfaces, so nothing is
//! attached) and pins its maps on a private bpffs; both are removed afterwards. The objects have
//! the shape the API server returns (see `apiserver::service` / `apiserver::endpoint_slice`,
//! plus the server-set metadata); the manifest is a `kind: List`, as `kubectl get -o yaml`
//! prints it, or `---` separated documents with `--manifest-format documents`.
use std::{
    io::{BufRead, BufReader, BufWriter, Write},
    net::{Ipv4Addr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use proxy_tests::{
    NS_PREFIX, Netns,
    agent::{TestCgroup, agent_bin},
    apiserver,
    programs::PrivateBpffs,
};
use serde_json::{Value, json};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SourceKind {
    /// `--manifest FILE`.
    Manifest,
    /// `--kubeconfig` to the stand-in API server (tests/src/apiserver.rs) in the agent's netns.
    Api,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ManifestFormat {
    /// One `kind: List` document, as `kubectl get -o yaml` prints it.
    List,
    /// One `---` separated document per object.
    Documents,
}

pub struct Options {
    pub services: Vec<u32>,
    pub endpoints: u32,
    pub source: SourceKind,
    pub format: ManifestFormat,
    /// Measure a second start, on the maps the first one pinned.
    pub restart: bool,
    pub runs: u32,
    /// The agent binary; None: the one built next to this benchmark.
    pub agent: Option<PathBuf>,
}

/// How long the agent may take for one measurement before the benchmark gives up.
const PATIENCE: Duration = Duration::from_secs(600);

/// The agent had not finished its first full sync when the benchmark's patience ran out.
#[derive(Debug)]
pub struct TooSlow {
    pub patience: Duration,
    /// The agent's log so far.
    log: String,
}

impl std::fmt::Display for TooSlow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "no full sync within {:?}:\n{}", self.patience, self.log)
    }
}

impl std::error::Error for TooSlow {}

const NAMESPACE: &str = "bench";
const NODE: &str = "bench-node";

pub fn run(opts: &Options) -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "the agent benchmark starts the agent, which loads BPF programs and needs a network namespace: run it as root"
        );
    }
    proxy_tests::cleanup_stale();
    let agent = match &opts.agent {
        Some(path) => path.clone(),
        None => agent_bin()?,
    };
    let dir = TempDir::new()?;
    println!(
        "agent {} from {}, {} endpoints a service, {}{}",
        agent.display(),
        match opts.source {
            SourceKind::Manifest => format!("a manifest ({:?})", opts.format).to_lowercase(),
            SourceKind::Api => "the stand-in API server".to_owned(),
        },
        opts.endpoints,
        if opts.runs > 1 {
            format!("median of {} runs", opts.runs)
        } else {
            "one run each".to_owned()
        },
        if opts.restart {
            ", each a second start on the maps the first pinned"
        } else {
            ""
        }
    );
    // The agent's own size with one service: the baseline the bytes per service are counted from.
    let mut counts = opts.services.clone();
    if !counts.contains(&1) {
        counts.insert(0, 1);
    }
    let mut rows: Vec<(u32, Sample)> = Vec::new();
    for &count in &counts {
        let mut samples = Vec::new();
        for run in 0..opts.runs {
            let sample = measure(opts, &agent, &dir.0, count)
                .with_context(|| format!("with {count} services"))?;
            eprintln!(
                "  {count} services, run {}: first full sync {:.2} s after start (map writes {:.2} s), VmRSS {:.1} MiB, VmHWM {:.1} MiB",
                run + 1,
                sample.synced.as_secs_f64(),
                sample.sync.as_secs_f64(),
                mib(sample.rss),
                mib(sample.hwm)
            );
            samples.push(sample);
        }
        samples.sort_by_key(|s| s.synced);
        rows.push((count, samples.swap_remove(samples.len() / 2)));
    }
    let base = rows.iter().find(|(n, _)| *n == 1).map(|(_, s)| s.rss);
    println!();
    println!(
        "| services | source loaded | dataplane made | first full sync done | of which map writes | without map writes | agent CPU | VmRSS | of which files | VmHWM | bytes/service |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (count, s) in rows.iter().filter(|(n, _)| opts.services.contains(n)) {
        let per_service = match base {
            Some(base) if *count > 1 => {
                format!(
                    "{:.0}",
                    s.rss.saturating_sub(base) as f64 / f64::from(count - 1)
                )
            }
            _ => "–".to_owned(),
        };
        println!(
            "| {count} | {:.3} s | {:.3} s | {:.3} s | {:.3} s | {:.3} s | {:.2} s | {:.1} MiB | {:.1} MiB | {:.1} MiB | {per_service} |",
            s.loaded.as_secs_f64(),
            s.dataplane.as_secs_f64(),
            s.synced.as_secs_f64(),
            s.sync.as_secs_f64(),
            s.synced.saturating_sub(s.sync).as_secs_f64(),
            s.cpu.as_secs_f64(),
            mib(s.rss),
            mib(s.rss_file),
            mib(s.hwm),
        );
    }
    println!();
    println!(
        "Times are from the agent's start. \"source loaded\": the source's first complete view is in \
         the change tracker; \"dataplane made\": BPF object and maps loaded; \"map writes\": the \
         first full sync's own duration (its log line). Memory is read right after that sync; \
         \"of which files\": the pages of the agent's binary and libraries mapped in (RssFile: the \
         kernel maps 64 KiB around each page touched), about the same at every count; \
         bytes/service is VmRSS over the one-service run's, per extra service."
    );
    Ok(())
}

pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

#[derive(Clone, Copy, Debug)]
pub struct Sample {
    /// Start -> the source's first load is in the tracker.
    pub loaded: Duration,
    /// Start -> the dataplane is loaded (ebpf) or ready (iptables).
    pub dataplane: Duration,
    /// Start -> the first full sync is done.
    pub synced: Duration,
    /// That sync's own duration, as the agent logged it.
    pub sync: Duration,
    /// The agent's user + system CPU time up to then.
    pub cpu: Duration,
    pub rss: u64,
    /// Of `rss`, the file-backed pages (RssFile).
    pub rss_file: u64,
    pub hwm: u64,
}

/// Objects of `count` services: each a Service and its EndpointSlice, as the API server
/// stores them.
fn objects(count: u32, endpoints: u32) -> impl Iterator<Item = Value> {
    (0..count).flat_map(move |i| {
        let name = format!("svc-{i}");
        let vip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 1)) + i).to_string();
        let ips: Vec<String> = (0..endpoints)
            .map(|k| Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 1)) + i * endpoints + k))
            .map(|ip| ip.to_string())
            .collect();
        let nodes: Vec<String> = (0..endpoints)
            .map(|k| format!("node-{}", (i * endpoints + k) % 100))
            .collect();
        let eps: Vec<(&str, bool, Option<&str>)> = ips
            .iter()
            .zip(&nodes)
            .map(|(ip, node)| (ip.as_str(), true, Some(node.as_str())))
            .collect();
        let service = apiserver::service(NAMESPACE, &name, &vip, &[("http", 80, "TCP", 8080)]);
        let slice = apiserver::endpoint_slice(
            NAMESPACE,
            &format!("{name}-{:05x}", i.wrapping_mul(2654435761) & 0xfffff),
            &name,
            &eps,
            &[("http", 8080, "TCP")],
        );
        [service, slice]
    })
}

/// The server-set metadata `kubectl get -o yaml` also prints.
fn with_server_metadata(mut object: Value, n: u64) -> Value {
    let meta = &mut object["metadata"];
    meta["uid"] = json!(format!("6c1b3f0e-0000-4000-8000-{n:012x}"));
    meta["resourceVersion"] = json!((1000 + n).to_string());
    meta["creationTimestamp"] = json!("2025-01-01T00:00:00Z");
    object
}

fn write_manifest(path: &Path, opts: &Options, count: u32) -> anyhow::Result<u64> {
    let mut out = BufWriter::new(std::fs::File::create(path)?);
    let items = objects(count, opts.endpoints)
        .enumerate()
        .map(|(n, o)| with_server_metadata(o, n as u64));
    match opts.format {
        ManifestFormat::List => {
            let list = json!({
                "apiVersion": "v1",
                "items": items.collect::<Vec<_>>(),
                "kind": "List",
                "metadata": {"resourceVersion": ""},
            });
            serde_yaml::to_writer(&mut out, &list)?;
        }
        ManifestFormat::Documents => {
            for item in items {
                out.write_all(b"---\n")?;
                serde_yaml::to_writer(&mut out, &item)?;
            }
        }
    }
    out.flush()?;
    Ok(std::fs::metadata(path)?.len())
}

fn measure(opts: &Options, agent: &Path, dir: &Path, count: u32) -> anyhow::Result<Sample> {
    let ns = Netns::create(&format!("{NS_PREFIX}{}-bench", std::process::id()))?;
    ns.ip(&["link", "set", "lo", "up"])?;
    let bpffs = PrivateBpffs::new()?;
    let mut cmd = Command::new(agent);
    cmd.args(["--logging-format", "json", "agent"])
        .arg("--bpf-pin-dir")
        .arg(bpffs.path())
        // Nothing to attach to: the namespace has only `lo`.
        .args(["--pod-interfaces", "bench-none*"])
        .args(["--healthz-bind-address", "", "--metrics-bind-address", ""]);
    // Agents with socket programs for host-network clients get a cgroup of their own (with no
    // process in it), never the machine's root cgroup.
    let _cgroup = if supports(agent, "--bpf-cgroup-path")? {
        let cgroup = TestCgroup::new()?;
        cmd.arg("--bpf-cgroup-path").arg(cgroup.path());
        Some(cgroup)
    } else {
        None
    };
    // Kept alive until the agent is stopped.
    let mut _api = None;
    let loaded_message = match opts.source {
        SourceKind::Manifest => {
            let path = dir.join(format!("services-{count}.yaml"));
            eprint!("  {count} services: writing the manifest...");
            let bytes = write_manifest(&path, opts, count)?;
            eprintln!(" {:.1} MB", bytes as f64 / 1e6);
            cmd.arg("--manifest").arg(&path);
            "loaded the manifest"
        }
        SourceKind::Api => {
            let listener = ns.try_run(|| TcpListener::bind("127.0.0.1:0"))??;
            let api = apiserver::ApiServer::start_with_listener(listener)?;
            eprint!("  {count} services: filling the stand-in API server...");
            api.apply(apiserver::node(NODE, "192.0.2.1"));
            for object in objects(count, opts.endpoints) {
                api.apply(object);
            }
            eprintln!(" done");
            let kubeconfig = dir.join("kubeconfig");
            api.kubeconfig(&kubeconfig)?;
            cmd.arg("--kubeconfig")
                .arg(&kubeconfig)
                .args(["--hostname-override", NODE]);
            _api = Some(api);
            "Services and EndpointSlices listed"
        }
    };
    cmd.env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    ns.enter(&mut cmd)?;
    if opts.restart {
        eprintln!("  {count} services: starting the agent a first time");
        let first = cmd
            .spawn()
            .with_context(|| format!("starting {}", agent.display()))?;
        let mut first = Running::new(first);
        first.watch(Instant::now(), loaded_message, PATIENCE)?;
        first.stop();
    }
    eprintln!("  {count} services: starting the agent");
    let started = Instant::now();
    let child = cmd
        .spawn()
        .with_context(|| format!("starting {}", agent.display()))?;
    let mut agent = Running::new(child);
    let result = agent.watch(started, loaded_message, PATIENCE);
    agent.stop();
    result
}

/// Whether `agent` (an older build, say) knows the agent flag `flag`.
fn supports(agent: &Path, flag: &str) -> anyhow::Result<bool> {
    let help = Command::new(agent)
        .args(["agent", "--help"])
        .output()
        .with_context(|| format!("running {} agent --help", agent.display()))?;
    Ok(String::from_utf8_lossy(&help.stdout).contains(flag))
}

/// The agent process, its log lines as they arrive (with the time each was read), stopped on
/// drop.
pub struct Running {
    child: Child,
    lines: mpsc::Receiver<(Instant, String)>,
    log: Vec<String>,
}

impl Running {
    pub fn new(mut child: Child) -> Self {
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if tx.send((Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            log: Vec::new(),
        }
    }

    /// Follows the log until the first full sync: when each step was reached, and the memory
    /// then. `loaded_message` starts the source's line saying its first view is complete.
    /// [`TooSlow`] (with the log) once `patience` has passed since `started`.
    pub fn watch(
        &mut self,
        started: Instant,
        loaded_message: &str,
        patience: Duration,
    ) -> anyhow::Result<Sample> {
        let (mut loaded, mut dataplane) = (None, None);
        let deadline = started + patience;
        loop {
            let (at, line) = match self.lines.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => line,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Some(status) = self.child.try_wait()? {
                        bail!("the agent exited ({status}):\n{}", self.log.join("\n"));
                    }
                    if Instant::now() > deadline {
                        let log = self.log.join("\n");
                        return Err(TooSlow { patience, log }.into());
                    }
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.child.wait()?;
                    bail!("the agent exited ({status}):\n{}", self.log.join("\n"));
                }
            };
            self.log.push(line.clone());
            let Ok(event) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            let fields = &event["fields"];
            let message = fields["message"].as_str().unwrap_or_default();
            let since = at - started;
            if message.starts_with(loaded_message) && loaded.is_none() {
                loaded = Some(since);
                eprintln!("    source loaded after {:.2} s", since.as_secs_f64());
            } else if message == "ebpf dataplane loaded" || message.ends_with(" dataplane ready") {
                dataplane = Some(since);
            } else if message == "full sync done" {
                // Read at once, before anything else runs in the agent.
                let (rss, rss_file, hwm) = memory(self.child.id())?;
                let cpu = cpu_time(self.child.id())?;
                let elapsed = fields["elapsed"].as_str().unwrap_or_default();
                let sync = parse_debug_duration(elapsed)
                    .with_context(|| format!("the sync's elapsed {elapsed:?}"))?;
                return Ok(Sample {
                    loaded: loaded.context("no log line says the source was loaded")?,
                    dataplane: dataplane.context("no log line says the dataplane was loaded")?,
                    synced: since,
                    sync,
                    cpu,
                    rss,
                    rss_file,
                    hwm,
                });
            } else if event["level"] == "ERROR" || event["level"] == "WARN" {
                eprintln!("    agent: {message}");
            }
        }
    }

    /// Forgets the log lines read so far but not looked at.
    pub fn skip_pending(&mut self) {
        while let Ok((_, line)) = self.lines.try_recv() {
            self.log.push(line);
        }
    }

    /// Waits for the next log line whose message is one of `messages`; when it was read.
    pub fn next_message(
        &mut self,
        messages: &[&str],
        patience: Duration,
    ) -> anyhow::Result<Instant> {
        let deadline = Instant::now() + patience;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (at, line) = match self.lines.recv_timeout(left) {
                Ok(line) => line,
                Err(_) => bail!(
                    "no {messages:?} within {patience:?}:\n{}",
                    self.log.join("\n")
                ),
            };
            self.log.push(line.clone());
            let message = serde_json::from_str::<Value>(&line)
                .ok()
                .and_then(|e| e["fields"]["message"].as_str().map(str::to_owned));
            if message.is_some_and(|m| messages.contains(&m.as_str())) {
                return Ok(at);
            }
        }
    }

    /// SIGTERM, as the kubelet does; SIGKILL if it has not exited 10 s later.
    pub fn stop(&mut self) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop();
    }
}

/// VmRSS, RssFile and VmHWM of `pid`, in bytes.
fn memory(pid: u32) -> anyhow::Result<(u64, u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("no {name} in /proc/{pid}/status"))?;
        let kib: u64 = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()?;
        Ok(kib * 1024)
    };
    Ok((field("VmRSS:")?, field("RssFile:")?, field("VmHWM:")?))
}

/// User plus system CPU time of `pid` (fields 14 and 15 of /proc/<pid>/stat).
fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces: count from after its closing parenthesis.
    let rest = &stat[stat.rfind(')').context("malformed stat")? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(Duration::from_secs_f64(ticks as f64 / hz as f64))
}

/// A Duration as `{:?}` prints it ("1.2s", "712.5ms", "80µs", "15ns").
fn parse_debug_duration(text: &str) -> Option<Duration> {
    let units = [("ns", 1e-9), ("µs", 1e-6), ("ms", 1e-3), ("s", 1.0)];
    units.iter().find_map(|(unit, scale)| {
        let number: f64 = text.strip_suffix(unit)?.parse().ok()?;
        Some(Duration::from_secs_f64(number * scale))
    })
}

/// The benchmark's manifests and kubeconfig, removed at the end.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!("proxy-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_durations() {
        for d in [
            Duration::from_nanos(15),
            Duration::from_micros(80),
            Duration::from_micros(712_345),
            Duration::from_millis(1_234),
        ] {
            let parsed = parse_debug_duration(&format!("{d:?}")).unwrap();
            assert!(parsed.abs_diff(d) < Duration::from_micros(1), "{d:?}");
        }
    }
}
