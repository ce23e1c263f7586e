//! Network namespaces and the `ip` / process helpers the sandbox is built from.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use anyhow::{Context, Result, bail};

/// Where `ip netns add` puts its namespace files.
pub const NETNS_DIR: &str = "/run/netns";

/// A named network namespace (`/run/netns/<name>`).
///
/// One made by [`Netns::create`] (or by the sandbox) is deleted when dropped, also while
/// unwinding from a panic; [`Netns::open`] gives a handle that leaves the namespace alone.
#[derive(Debug)]
pub struct Netns {
    pub name: String,
    owned: bool,
}

impl Netns {
    /// `ip netns add <name>`; the namespace is deleted again on drop.
    pub fn create(name: &str) -> Result<Netns> {
        let ns = Netns::adopt(name);
        run(Command::new("ip").args(["netns", "add", name]))?;
        Ok(ns)
    }

    /// A handle to an existing namespace, not deleted on drop.
    pub fn open(name: &str) -> Netns {
        Netns {
            name: name.to_string(),
            owned: false,
        }
    }

    /// An owned handle for a namespace that is about to be created (or already was) by
    /// someone else, e.g. a batch of `netns add`: dropped, it deletes the namespace if it exists.
    pub(crate) fn adopt(name: &str) -> Netns {
        Netns {
            name: name.to_string(),
            owned: true,
        }
    }

    /// Stops the drop from deleting the namespace (used after a batched delete).
    pub(crate) fn disarm(&mut self) {
        self.owned = false;
    }

    pub fn path(&self) -> PathBuf {
        Path::new(NETNS_DIR).join(&self.name)
    }

    pub fn exists(&self) -> bool {
        self.path().exists()
    }

    /// Runs `f` on a fresh thread that has entered this namespace (setns CLONE_NEWNET) and
    /// returns its result. Sockets created inside stay in the namespace after `f` returns.
    /// Panics if the namespace can't be entered; see [`Netns::try_run`].
    pub fn run<R: Send, F: FnOnce() -> R + Send>(&self, f: F) -> R {
        self.try_run(f).unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// [`Netns::run`], with failure to enter the namespace as an error. A panic in `f` is
    /// propagated to the caller.
    pub fn try_run<R: Send, F: FnOnce() -> R + Send>(&self, f: F) -> Result<R> {
        let path = self.path();
        let file = File::open(&path).with_context(|| format!("open {}", path.display()))?;
        std::thread::scope(|scope| {
            let thread = std::thread::Builder::new()
                .name(format!("netns {}", self.name))
                .spawn_scoped(scope, move || -> Result<R> {
                    // SAFETY: setns on a valid fd; affects only this (short-lived) thread.
                    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                        let err = std::io::Error::last_os_error();
                        bail!("setns into network namespace {}: {err}", self.name);
                    }
                    drop(file);
                    Ok(f())
                })
                .context("spawn thread")?;
            thread
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }

    /// `ip netns exec <name> <program>`. Note that `ip netns exec` runs the program in a new
    /// mount namespace with a fresh `/sys` (so `/sys/fs/bpf` is not mounted there); use
    /// [`Netns::enter`] for a program that must see the host's mounts.
    pub fn cmd(&self, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, program]);
        cmd
    }

    /// Makes `cmd` enter this namespace (setns in the child before exec), keeping the mount
    /// namespace of the caller (bpffs, cgroups stay visible). Works on any `Command`.
    pub fn enter(&self, cmd: &mut Command) -> Result<()> {
        let path = self.path();
        let file = File::open(&path).with_context(|| format!("open {}", path.display()))?;
        // SAFETY: the closure only calls setns (async-signal-safe) on an fd it owns.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(())
    }

    /// `ip -n <name> <args>`, checked; returns stdout.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        run(Command::new("ip").args(["-n", &self.name]).args(args))
    }

    /// `ip netns exec <name> <program> <args>`, checked; returns stdout.
    pub fn exec(&self, program: &str, args: &[&str]) -> Result<String> {
        run(self.cmd(program).args(args))
    }

    /// Runs `lines` through `ip -n <name> -batch -` (stops at the first failing line).
    pub fn ip_batch(&self, lines: &[String]) -> Result<()> {
        let mut cmd = Command::new("ip");
        cmd.args(["-n", &self.name, "-batch", "-"]);
        let child = spawn_with_input(&mut cmd, &lines.join("\n"))?;
        check(&cmd, child.wait_with_output()).map(drop)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if self.owned
            && self.exists()
            && let Err(e) = run(Command::new("ip").args(["netns", "del", &self.name]))
        {
            eprintln!("warning: deleting network namespace {}: {e:#}", self.name);
        }
    }
}

/// Renders a command line for error messages.
pub(crate) fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&arg.to_string_lossy());
    }
    s
}

/// Runs `cmd` to completion; fails (with its stderr) on a non-zero exit. Returns stdout.
pub fn run(cmd: &mut Command) -> Result<String> {
    let output = cmd.stdin(Stdio::null()).output();
    check(cmd, output)
}

fn check(cmd: &Command, output: std::io::Result<Output>) -> Result<String> {
    let output = output.with_context(|| format!("run `{}`", describe(cmd)))?;
    if !output.status.success() {
        bail!(
            "`{}` failed ({}): {}",
            describe(cmd),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Spawns `cmd` with piped stdio and writes `input` to its stdin.
pub(crate) fn spawn_with_input(cmd: &mut Command, input: &str) -> Result<Child> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("run `{}`", describe(cmd)))?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let mut text = input.to_string();
    text.push('\n');
    // Batches are far smaller than a pipe buffer, so writing before reading can't deadlock.
    let written = stdin.write_all(text.as_bytes());
    drop(stdin);
    if let Err(e) = written {
        let out = child.wait_with_output();
        let stderr = out.map(|o| String::from_utf8_lossy(&o.stderr).into_owned());
        bail!(
            "write to `{}`: {e}; stderr: {}",
            describe(cmd),
            stderr.unwrap_or_default()
        );
    }
    Ok(child)
}

/// Runs `ip` batches in parallel: each entry is (namespace for `-n`, or None, lines).
/// Waits for all of them and reports every failure.
pub(crate) fn ip_batches(batches: &[(Option<&str>, Vec<String>)]) -> Result<()> {
    let mut running = Vec::new();
    for (ns, lines) in batches {
        let mut cmd = Command::new("ip");
        if let Some(ns) = ns {
            cmd.args(["-n", ns]);
        }
        cmd.args(["-batch", "-"]);
        let child = spawn_with_input(&mut cmd, &lines.join("\n"));
        running.push((cmd, child));
    }
    wait_all(running)
}

/// Runs commands in parallel, waits for all, reports every failure.
pub(crate) fn run_parallel(cmds: Vec<Command>) -> Result<()> {
    let running = cmds
        .into_iter()
        .map(|mut cmd| {
            let child = cmd
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .with_context(|| format!("run `{}`", describe(&cmd)));
            (cmd, child)
        })
        .collect();
    wait_all(running)
}

fn wait_all(running: Vec<(Command, Result<Child>)>) -> Result<()> {
    let mut errors = Vec::new();
    for (cmd, child) in running {
        let result = child.and_then(|child| check(&cmd, child.wait_with_output()));
        if let Err(e) = result {
            errors.push(format!("{e:#}"));
        }
    }
    if !errors.is_empty() {
        bail!("{}", errors.join("\n"));
    }
    Ok(())
}
