//! The agent as a process in a sandbox node, on a manifest file, with its maps on a private
//! bpffs and its socket programs on a cgroup of its own; and editing that manifest the way an
//! operator would.
use std::{
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use proxy_userspace::{
    modes::ebpf::inspect,
    source::manifest::{self, Object},
};

use crate::{NS_PREFIX, Sandbox, apiserver::ApiServer, find_bin, programs::PrivateBpffs};

pub const AGENT_BIN_ENV: &str = "PROXY_USERSPACE_BIN";

pub fn agent_bin() -> Result<PathBuf> {
    find_bin("proxy-userspace", AGENT_BIN_ENV)
}

/// Where a test agent reads the desired state from.
pub enum AgentSource<'a> {
    /// A manifest file with this text.
    Manifest(&'a str),
    /// The stand-in API server (through a kubeconfig); it must be reachable from the node.
    Api(&'a ApiServer),
}

/// The port of the agent's /healthz and /livez (kube-proxy's), on the node's loopback.
pub const HEALTHZ_PORT: u16 = 10256;
/// The port of the agent's /metrics (kube-proxy's), on the node's loopback.
pub const METRICS_PORT: u16 = 10249;

/// Runs `agent --cleanup` of the binary `agent` in `node`, on the pins in `pin_dir`.
pub fn cleanup(agent: &Path, node: &crate::Netns, pin_dir: &Path) -> Result<()> {
    let mut cmd = Command::new(agent);
    cmd.args(["agent", "--cleanup"])
        .arg("--bpf-pin-dir")
        .arg(pin_dir);
    node.enter(&mut cmd)?;
    let out = cmd.output()?;
    if !out.status.success() {
        bail!(
            "agent --cleanup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// A running agent. Its process belongs to the sandbox (stopped when the sandbox drops).
pub struct AgentRun {
    pub pid: u32,
    /// The agent's arguments after `agent`, to start it again.
    args: Vec<std::ffi::OsString>,
    /// The manifest file (written only for [`AgentSource::Manifest`]).
    pub manifest: PathBuf,
    pub log: PathBuf,
    pub bpffs: PrivateBpffs,
    /// The agent's `--bpf-cgroup-path`: host-network clients put in it reach services.
    pub cgroup: TestCgroup,
    node: String,
    /// The network namespace of `node`.
    node_ns: String,
    dir: PathBuf,
    /// Started as kube-proxy (see [`AgentRun::start_as_kube_proxy`]).
    kube_proxy: bool,
    /// Where the `extra` arguments it was started with begin in `args`.
    extra_from: usize,
    /// Run from the agent's image, as the DaemonSet runs it ([`crate::image`]): the runc
    /// bundle, and the container's name.
    container: Option<(PathBuf, String)>,
}

/// How a test agent runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launch {
    /// The binary the tests built, as a process in the node's network namespace.
    Process,
    /// That binary in the agent's image, run by runc with the DaemonSet's securityContext and
    /// volumes ([`crate::image`]).
    Image,
}

impl AgentRun {
    /// Starts `proxy-userspace agent` in `node` on a copy of `manifest_text`, and waits until
    /// the datapath maps hold at least `expect_services` service addresses.
    pub fn start(
        sandbox: &mut Sandbox,
        node: &str,
        manifest_text: &str,
        expect_services: usize,
    ) -> Result<Self> {
        Self::start_from(
            sandbox,
            node,
            AgentSource::Manifest(manifest_text),
            expect_services,
        )
    }

    /// Starts the agent on either source; see [`AgentRun::start`].
    pub fn start_from(
        sandbox: &mut Sandbox,
        node: &str,
        source: AgentSource<'_>,
        expect_services: usize,
    ) -> Result<Self> {
        Self::start_with_args(sandbox, node, source, expect_services, &[])
    }

    /// [`AgentRun::start_from`], with `extra` arguments for the agent.
    pub fn start_with_args(
        sandbox: &mut Sandbox,
        node: &str,
        source: AgentSource<'_>,
        expect_services: usize,
        extra: &[&str],
    ) -> Result<Self> {
        Self::start_launched(
            sandbox,
            node,
            source,
            expect_services,
            extra,
            Launch::Process,
        )
    }

    /// [`AgentRun::start_with_args`], run as `launch` says.
    pub fn start_launched(
        sandbox: &mut Sandbox,
        node: &str,
        source: AgentSource<'_>,
        expect_services: usize,
        extra: &[&str],
        launch: Launch,
    ) -> Result<Self> {
        Self::start_inner(sandbox, node, source, expect_services, extra, None, launch)
    }

    /// Starts the agent as kube-proxy's DaemonSet starts kube-proxy: named `kube-proxy`, no
    /// subcommand, `--config` a file holding `config` (see [`AgentRun::config_file`]), then
    /// `extra`, on a copy of `manifest_text`, run as `launch` says; returns after its first full
    /// sync.
    pub fn start_as_kube_proxy(
        sandbox: &mut Sandbox,
        node: &str,
        manifest_text: &str,
        config: &str,
        extra: &[&str],
        launch: Launch,
    ) -> Result<Self> {
        let source = AgentSource::Manifest(manifest_text);
        Self::start_inner(sandbox, node, source, 0, extra, Some(config), launch)
    }

    fn start_inner(
        sandbox: &mut Sandbox,
        node: &str,
        source: AgentSource<'_>,
        expect_services: usize,
        extra: &[&str],
        kube_proxy_config: Option<&str>,
        launch: Launch,
    ) -> Result<Self> {
        // One directory an agent: two nodes may run one each.
        let dir = std::env::temp_dir().join(format!("{}-agent-{node}", sandbox.prefix));
        std::fs::create_dir_all(&dir)?;
        let mut args: Vec<std::ffi::OsString> = Vec::new();
        if let Some(config) = kube_proxy_config {
            let path = dir.join("config.conf");
            std::fs::write(&path, config)?;
            args.push(format!("--config={}", path.display()).into());
        }
        let manifest = dir.join("services.yaml");
        let log = dir.join("agent.log");
        let bpffs = PrivateBpffs::new()?;
        let cgroup = TestCgroup::new()?;
        let mut arg = |a: &dyn AsRef<std::ffi::OsStr>| args.push(a.as_ref().to_owned());
        match source {
            AgentSource::Manifest(text) => {
                std::fs::write(&manifest, text)?;
                arg(&"--manifest");
                arg(&manifest);
            }
            AgentSource::Api(api) => {
                let kubeconfig = dir.join("kubeconfig");
                api.kubeconfig(&kubeconfig)?;
                arg(&"--kubeconfig");
                arg(&kubeconfig);
            }
        }
        let healthz = format!("127.0.0.1:{HEALTHZ_PORT}");
        let metrics = format!("127.0.0.1:{METRICS_PORT}");
        let defaults: [(&str, &dyn AsRef<std::ffi::OsStr>); 9] = [
            ("--hostname-override", &node),
            ("--min-sync-period", &"0s"),
            ("--bpf-pin-dir", &bpffs.path()),
            ("--bpf-cgroup-path", &cgroup.path()),
            ("--healthz-bind-address", &healthz),
            ("--metrics-bind-address", &metrics),
            // Small maps: tests run side by side. Conntrack holds the spoofed-teardown
            // scenario's flood of new flows (about 60k entries) without evicting its victims.
            ("--bpf-services-max", &"4096"),
            ("--bpf-backends-max", &"4096"),
            ("--bpf-ct-max", &"262144"),
        ];
        // A flag in `extra` replaces its default.
        for (flag, value) in defaults {
            if !extra.contains(&flag) {
                arg(&flag);
                arg(value);
            }
        }
        let extra_from = args.len();
        args.extend(extra.iter().map(Into::into));
        let mut run = Self {
            pid: 0,
            args,
            manifest,
            log,
            bpffs,
            cgroup,
            node: node.to_owned(),
            node_ns: sandbox.node(node).name.clone(),
            dir,
            kube_proxy: kube_proxy_config.is_some(),
            extra_from,
            container: None,
        };
        if launch == Launch::Image {
            let bundle = run.dir.join("bundle");
            crate::image::unpack(&bundle)?;
            let name = format!("{}-{node}", sandbox.prefix);
            run.container = Some((bundle, name));
        }
        run.spawn(sandbox)?;
        // Its configuration file may name another mode.
        let ebpf = kube_proxy_config.is_none()
            && !extra
                .windows(2)
                .any(|w| w[0] == "--proxy-mode" && w[1] != "ebpf");
        if ebpf {
            run.wait_for(sandbox, "the first sync", |rows| {
                rows.len() >= expect_services
            })?;
            // The programs take over once the first sync has filled the maps.
            run.wait_for_log(sandbox, "programs attached")?;
        }
        // Done, so that a test counting syncs from here (`syncs`) counts this one in.
        run.wait_for_log(sandbox, "full sync done")?;
        Ok(run)
    }

    /// Waits until the agent's log holds `needle` (20 s at most), checking the agent lives.
    pub fn wait_for_log(&self, sandbox: &mut Sandbox, needle: &str) -> Result<()> {
        self.wait_for_log_that(sandbox, &format!("{needle:?} in the log"), |log| {
            log.contains(needle)
        })
    }

    /// How many syncs the agent has logged as done.
    pub fn syncs(&self) -> usize {
        self.log_text().matches("sync done").count()
    }

    /// Waits until the agent has logged more syncs than `before` (20 s at most). A change
    /// written after [`AgentRun::syncs`] returned `before` is programmed then, unless a sync
    /// already under way at the write ended first (with the tests' `--min-sync-period 0s`, a
    /// sync runs on each change, or every 30 s).
    pub fn wait_for_sync_after(&self, sandbox: &mut Sandbox, before: usize) -> Result<()> {
        self.wait_for_log_that(sandbox, &format!("a sync after the {before}th"), |log| {
            log.matches("sync done").count() > before
        })
    }

    /// Waits until `ok` holds for the agent's log (20 s at most: a start in `auto` mode under
    /// emulation loads and verifies the BPF programs, then writes a netfilter mode's rules),
    /// checking the agent lives.
    fn wait_for_log_that(
        &self,
        sandbox: &mut Sandbox,
        what: &str,
        ok: impl Fn(&str) -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + crate::patience(Duration::from_secs(20));
        while !ok(&self.log_text()) {
            if let Some(child) = sandbox.child(self.pid)
                && let Some(status) = child.try_wait()?
            {
                bail!("the agent exited ({status}):\n{}", self.log_text());
            }
            if Instant::now() > deadline {
                bail!(
                    "timed out waiting for {what}; agent log:\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// The `--config` file of an agent started by [`AgentRun::start_as_kube_proxy`].
    pub fn config_file(&self) -> PathBuf {
        self.dir.join("config.conf")
    }

    /// Waits (10 s at most) until the agent has exited by itself: its exit status.
    pub fn wait_for_exit(&self, sandbox: &mut Sandbox) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + crate::patience(Duration::from_secs(10));
        loop {
            let child = sandbox
                .child(self.pid)
                .context("the agent is not the sandbox's")?;
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!("the agent still runs; its log:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn spawn(&mut self, sandbox: &mut Sandbox) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let ns = crate::Netns::open(&self.node_ns);
        let mut cmd = match &self.container {
            None => {
                let mut cmd = Command::new(agent_bin()?);
                if self.kube_proxy {
                    // kube-proxy's DaemonSet names the program and no subcommand.
                    std::os::unix::process::CommandExt::arg0(&mut cmd, "kube-proxy");
                } else {
                    cmd.arg("agent");
                }
                cmd.args(&self.args).env("RUST_LOG", "info");
                cmd
            }
            Some((bundle, name)) => {
                let program = match self.kube_proxy {
                    true => ["/usr/local/bin/kube-proxy"].as_slice(),
                    false => &["/usr/local/bin/proxy-userspace", "agent"],
                };
                // The DaemonSet's volumes, at its paths; the arguments naming them follow.
                let volumes = [
                    (self.dir.as_path(), self.dir.as_path()),
                    (self.bpffs.path(), Path::new(crate::image::BPFFS)),
                    (self.cgroup.path(), Path::new(crate::image::CGROUP)),
                    (crate::image::xtables_lock()?, crate::image::xtables_lock()?),
                ];
                let args: Vec<String> = program
                    .iter()
                    .map(|a| a.to_string())
                    .chain(self.args.iter().map(|a| {
                        let host = Path::new(a);
                        match volumes.iter().find(|(source, _)| *source == host) {
                            Some((_, inside)) => inside.display().to_string(),
                            None => a.to_string_lossy().into_owned(),
                        }
                    }))
                    .collect();
                crate::image::configure(
                    bundle,
                    &args,
                    &["RUST_LOG=info".to_owned()],
                    &ns.path(),
                    &volumes,
                )?;
                let mut cmd = Command::new("runc");
                cmd.arg("run").arg("--bundle").arg(bundle).arg(name);
                cmd
            }
        };
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
        self.pid = sandbox.spawn(&ns, cmd)?;
        Ok(())
    }

    /// Stops the agent (SIGTERM, as the kubelet does).
    pub fn stop(&self, sandbox: &mut Sandbox) -> Result<()> {
        sandbox.stop(self.pid)?;
        Ok(())
    }

    /// Kills the agent with SIGKILL (a crash, an OOM kill: no chance to clean up) and reaps it.
    pub fn kill(&self, sandbox: &mut Sandbox) -> Result<()> {
        if let Some((_, name)) = &self.container {
            // The agent is the container's process, not runc (which then exits).
            let status = Command::new("runc").args(["kill", name, "KILL"]).status()?;
            if !status.success() {
                bail!("runc kill {name}: {status}");
            }
            sandbox.stop(self.pid)?;
            return Ok(());
        }
        // SAFETY: kill(2) on our own child, not reaped yet (so its pid is still ours); the
        // sandbox reaps it just below.
        if unsafe { libc::kill(self.pid as libc::pid_t, libc::SIGKILL) } != 0 {
            bail!("kill -9 {}: {}", self.pid, std::io::Error::last_os_error());
        }
        sandbox.stop(self.pid)?;
        Ok(())
    }

    /// Starts the agent again with the same arguments (and the same pinned maps); returns once
    /// it has synced again, as its log says.
    pub fn start_again(&mut self, sandbox: &mut Sandbox) -> Result<()> {
        let full_syncs = |log: &str| log.matches("full sync done").count();
        let before = full_syncs(&self.log_text());
        self.spawn(sandbox)?;
        self.wait_for_log_that(sandbox, "the restarted agent's first sync", |log| {
            full_syncs(log) > before
        })
    }

    /// Starts the stopped agent again with `extra` instead of the extra arguments it was
    /// started with (another mode's, say) and the same pins; returns once the ebpf mode's
    /// programs are attached (or for the others, its first sync is done), as its log says.
    pub fn switch_mode(&mut self, sandbox: &mut Sandbox, extra: &[&str]) -> Result<()> {
        let ebpf = !extra
            .windows(2)
            .any(|w| w[0] == "--proxy-mode" && w[1] != "ebpf");
        let needle = if ebpf {
            "programs attached"
        } else {
            "full sync done"
        };
        let before = self.log_text().matches(needle).count();
        self.args.truncate(self.extra_from);
        self.args.extend(extra.iter().map(Into::into));
        self.spawn(sandbox)?;
        self.wait_for_log_that(sandbox, &format!("{needle:?} in the log again"), |log| {
            log.matches(needle).count() > before
        })
    }

    /// Runs `proxy-userspace agent --cleanup` in the agent's node, on its pins.
    pub fn cleanup(&self, sandbox: &Sandbox) -> Result<()> {
        cleanup(&agent_bin()?, sandbox.node(&self.node), self.bpffs.path())
    }

    /// GET `path` from the agent's health server: the status code and the body.
    pub fn healthz(&self, sandbox: &Sandbox, path: &str) -> Result<(u16, String)> {
        self.http_get(sandbox, HEALTHZ_PORT, path)
    }

    /// GET `/metrics` from the agent's metrics server: the body.
    pub fn metrics(&self, sandbox: &Sandbox) -> Result<String> {
        let (code, body) = self.http_get(sandbox, METRICS_PORT, "/metrics")?;
        anyhow::ensure!(code == 200, "/metrics answered {code}: {body}");
        Ok(body)
    }

    /// Another path of the metrics port (`/proxyMode`, `/healthz`): its body, answered 200.
    pub fn metrics_path(&self, sandbox: &Sandbox, path: &str) -> Result<String> {
        let (code, body) = self.http_get(sandbox, METRICS_PORT, path)?;
        anyhow::ensure!(code == 200, "{path} answered {code}: {body}");
        Ok(body)
    }

    fn http_get(&self, sandbox: &Sandbox, port: u16, path: &str) -> Result<(u16, String)> {
        let at = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        crate::client::http_get(sandbox.node(&self.node), at, path)
    }

    /// Polls the pinned services until `ok` holds (10 s at most), checking the agent lives.
    pub fn wait_for(
        &self,
        sandbox: &mut Sandbox,
        what: &str,
        ok: impl Fn(&[proxy_userspace::rows::ServiceRow]) -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + crate::patience(Duration::from_secs(10));
        loop {
            if let Some(child) = sandbox.child(self.pid)
                && let Some(status) = child.try_wait()?
            {
                bail!(
                    "the agent exited ({status}) before {what}:\n{}",
                    self.log_text()
                );
            }
            if let Ok(rows) = inspect::services(self.bpffs.path())
                && ok(&rows)
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "timed out waiting for {what}; agent log:\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Runs `proxy-userspace inspect <what> [extra]` against this agent's maps.
    /// It runs in the agent's node, where the rules of the other modes are.
    pub fn inspect_cli(&self, what: &str, extra: &[&str]) -> Result<String> {
        let mut cmd = Command::new(agent_bin()?);
        cmd.args(["inspect", what])
            .args(extra)
            .arg("--bpf-pin-dir")
            .arg(self.bpffs.path());
        crate::Netns::open(&self.node_ns).enter(&mut cmd)?;
        let out = cmd.output()?;
        if !out.status.success() {
            bail!(
                "inspect {what} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8(out.stdout)?)
    }
}

impl Drop for AgentRun {
    fn drop(&mut self) {
        if let Some((_, name)) = &self.container {
            // Gone already unless its runc was killed.
            let _ = Command::new("runc")
                .args(["delete", "--force", name])
                .stderr(Stdio::null())
                .status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A cgroup of a test's own, for an agent's socket programs (`--bpf-cgroup-path`), so that tests
/// never attach them to the machine's root cgroup: made under the machine's cgroup2 mount (or,
/// without one, on a cgroup2 mounted for it), removed on drop. Processes put in it with
/// [`TestCgroup::enter`] are the clients those programs see.
pub struct TestCgroup {
    path: PathBuf,
    /// The cgroup2 mount it is under.
    root: PathBuf,
    /// The cgroup2 mount made for it, unmounted on drop.
    mounted: Option<PathBuf>,
}

impl TestCgroup {
    pub fn new() -> Result<Self> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let (root, mounted) = match cgroup2_mount() {
            Some(root) => (root, None),
            None => {
                let at = std::env::temp_dir().join(format!("{NS_PREFIX}{pid}-cgroup2-{n}"));
                proxy_userspace::modes::ebpf::cgroup::ensure(&at)
                    .context("no cgroup2 mounted, and mounting one failed")?;
                (at.clone(), Some(at))
            }
        };
        if n == 0 {
            remove_stale_cgroups(&root);
        }
        let path = root.join(format!("{NS_PREFIX}{pid}-cg{n}"));
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self {
            path,
            root,
            mounted,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Makes `cmd` move itself into this cgroup before it runs its program (a socket belongs
    /// to the cgroup of the process that created it).
    pub fn enter(&self, cmd: &mut Command) -> Result<()> {
        let procs = self.path.join("cgroup.procs");
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&procs)
            .with_context(|| format!("opening {}", procs.display()))?;
        // SAFETY: the closure only calls write(2) (async-signal-safe) on an fd it owns.
        unsafe {
            cmd.pre_exec(move || {
                // "0": the writing process itself.
                if libc::write(file.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(())
    }
}

/// This process's stay in a [`TestCgroup`] (see [`TestCgroup::join`]): it goes back to the
/// cgroup it came from when this drops.
pub struct Joined {
    /// The `cgroup.procs` of the cgroup it came from.
    back: PathBuf,
}

impl TestCgroup {
    /// Moves this whole process (every thread) into the cgroup, until the returned guard
    /// drops: for clients that must be threads of this process (the benchmarks'), whose sockets
    /// the programs attached here must see. Nothing else of this process may run meanwhile.
    pub fn join(&self) -> Result<Joined> {
        let own = std::fs::read_to_string("/proc/self/cgroup")?;
        let from = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .context("this process is in no cgroup v2 (/proc/self/cgroup)")?;
        let back = self
            .root
            .join(from.trim_start_matches('/'))
            .join("cgroup.procs");
        let pid = std::process::id().to_string();
        std::fs::write(self.path.join("cgroup.procs"), &pid)
            .with_context(|| format!("moving this process into {}", self.path.display()))?;
        Ok(Joined { back })
    }
}

impl Drop for Joined {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(&self.back, std::process::id().to_string()) {
            eprintln!("warning: moving back to {}: {e}", self.back.display());
        }
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Processes that just exited may take a moment to leave it.
        let deadline = Instant::now() + Duration::from_secs(2);
        while let Err(e) = std::fs::remove_dir(&self.path) {
            if e.kind() == std::io::ErrorKind::NotFound || Instant::now() > deadline {
                if e.kind() != std::io::ErrorKind::NotFound {
                    eprintln!("warning: removing cgroup {}: {e}", self.path.display());
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Some(at) = &self.mounted {
            let _ = proxy_userspace::modes::ebpf::bpffs::unmount(at);
            let _ = std::fs::remove_dir(at);
        }
    }
}

/// Where cgroup2 is mounted, if it is.
fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let mount_point = fields.nth(1)?;
        (fields.next()? == "cgroup2").then(|| PathBuf::from(mount_point))
    })
}

/// Removes the (empty) cgroups of test processes that no longer exist.
fn remove_stale_cgroups(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(NS_PREFIX))
            .and_then(|rest| rest.split_once("-cg"))
            .map(|(pid, _)| pid.to_owned())
        else {
            continue;
        };
        if pid.bytes().all(|b| b.is_ascii_digit()) && !Path::new("/proc").join(&pid).exists() {
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

/// Rewrites a manifest file through `edit`, replacing it by an atomic rename (as editors and
/// ConfigMap volumes do).
pub fn edit_manifest(path: &Path, edit: impl FnOnce(&mut Vec<Object>)) -> Result<()> {
    let text = std::fs::read_to_string(path)?;
    let mut objects = manifest::parse(&text)
        .context("parsing the manifest")?
        .objects;
    edit(&mut objects);
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, manifest_text(&objects)?)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// `objects` as a manifest.
pub fn manifest_text(objects: &[Object]) -> Result<String> {
    let mut out = String::new();
    for object in objects {
        out.push_str("---\n");
        out.push_str(&match object {
            Object::Service(s) => serde_yaml::to_string(s)?,
            Object::EndpointSlice(s) => serde_yaml::to_string(s)?,
            Object::Node(n) => serde_yaml::to_string(n)?,
            Object::ServiceCidr(c) => serde_yaml::to_string(c)?,
        });
    }
    Ok(out)
}

/// Removes the endpoint with address `ip` from every EndpointSlice of service `name`.
pub fn remove_endpoint(objects: &mut [Object], name: &str, ip: &str) {
    for object in objects {
        if let Object::EndpointSlice(slice) = object {
            let owner = slice
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("kubernetes.io/service-name"));
            if owner.map(String::as_str) == Some(name)
                && let Some(endpoints) = slice.endpoints.as_mut()
            {
                endpoints.retain(|e| !e.addresses.iter().any(|a| a == ip));
            }
        }
    }
}

/// Adds an endpoint with address `ip` on `node` (ready, serving, not terminating) to the first
/// EndpointSlice of service `name` of its family, as a Deployment's new pod appears in a
/// rollout.
pub fn add_endpoint(objects: &mut [Object], name: &str, ip: &str, node: &str) {
    let endpoint = serde_yaml::from_str(&format!(
        "{{addresses: [\"{ip}\"], nodeName: {node}, \
         conditions: {{ready: true, serving: true, terminating: false}}}}"
    ))
    .expect("an endpoint");
    let family = if ip.contains(':') { "IPv6" } else { "IPv4" };
    for object in objects {
        if slice_of(object, name)
            && let Object::EndpointSlice(slice) = object
            && slice.address_type == family
        {
            slice.endpoints.get_or_insert_default().push(endpoint);
            return;
        }
    }
}

/// Sets the conditions of the endpoint with address `ip` in every EndpointSlice of service
/// `name` (e.g. `false, true, true`: a pod that is shutting down but still serves).
pub fn set_conditions(
    objects: &mut [Object],
    name: &str,
    ip: &str,
    ready: bool,
    serving: bool,
    terminating: bool,
) {
    for object in objects {
        if slice_of(object, name)
            && let Object::EndpointSlice(slice) = object
        {
            for endpoint in slice.endpoints.iter_mut().flatten() {
                if endpoint.addresses.iter().any(|a| a == ip) {
                    endpoint.conditions = Some(
                        serde_yaml::from_str(&format!(
                            "{{ready: {ready}, serving: {serving}, terminating: {terminating}}}"
                        ))
                        .expect("endpoint conditions"),
                    );
                }
            }
        }
    }
}

/// Whether `object` is an EndpointSlice of service `name`.
fn slice_of(object: &Object, name: &str) -> bool {
    matches!(object, Object::EndpointSlice(_))
        && object
            .metadata()
            .labels
            .as_ref()
            .and_then(|l| l.get("kubernetes.io/service-name"))
            .is_some_and(|owner| owner == name)
}
