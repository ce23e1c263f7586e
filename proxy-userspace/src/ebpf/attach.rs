//! Attaching the tc programs to pod-facing interfaces, including those of pods that start
//! later, so that they stay attached when the agent exits: a restarting agent (a rollout, a
//! crash) must not leave pods without service translation. A new agent swaps its programs in
//! atomically where the old ones were.
//!
//! Kernels 6.6 and later attach through tcx links, pinned in `<pin dir>/links/` (a link lives
//! while its pin does). Older kernels attach cls_bpf filters through netlink at a fixed
//! priority and handle, replaced in place; such filters outlive the process by themselves.
//!
//! A new pod's first packets (typically its first DNS query) must already be translated, so
//! the programs are attached as the kernel announces the interface (see [`AttachThread`]), on
//! a thread of their own that never waits for a sync of the maps.
use std::{
    collections::HashMap,
    ffi::{CStr, CString},
    io,
    os::{
        fd::{AsFd, AsRawFd},
        unix::net::UnixStream,
    },
    path::{Path, PathBuf},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use aya::{
    Ebpf,
    programs::{
        SchedClassifier, TcAttachType,
        links::{FdLink, LinkError, PinnedLink},
        tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
    },
    sys::SyscallError,
    util::KernelVersion,
};

use super::{
    PROG_EGRESS, PROG_INGRESS,
    link_events::{LinkEvent, LinkEvents},
};

/// How often the interfaces are listed anyway: a safety net for attachments that failed and
/// for notifications lost without the kernel saying so (when it says so, they are listed at
/// once).
const RESCAN_PERIOD: Duration = Duration::from_secs(10);

/// Where our netlink filters sit (kernels before 6.6): a fixed place, so a restarted agent
/// replaces them instead of adding more.
const NL_PRIORITY: u16 = 0x4b50;
const NL_HANDLE: TcHandle = TcHandle::new(0, 1);

const DIRECTIONS: [(&str, TcAttachType, &str); 2] = [
    (PROG_INGRESS, TcAttachType::Ingress, "ingress"),
    (PROG_EGRESS, TcAttachType::Egress, "egress"),
];

/// The BPF object (its programs) and the [`Attacher`], on a thread of their own: a matching
/// interface gets the programs within a millisecond or so of appearing, whatever the rest of
/// the agent is doing (a long sync, say). Dropping this stops the thread (the programs stay
/// attached).
pub struct AttachThread {
    /// Closing `stop` wakes the thread up, and it ends.
    stop: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
}

impl AttachThread {
    /// Attaches the programs of `ebpf` to the interfaces matching `pattern` there are (failing
    /// if that fails), then starts the thread that attaches them to those that appear or get a
    /// matching name later.
    pub fn start(mut ebpf: Ebpf, pattern: &str, pin_dir: &Path) -> anyhow::Result<Self> {
        // Subscribed before listing: an interface appearing meanwhile is in one or the other.
        let events = LinkEvents::subscribe().context("subscribing to link notifications")?;
        let mut attacher = Attacher::new(pattern, pin_dir)?;
        attacher.scan(&mut ebpf)?;
        let (stop, stopped) = UnixStream::pair()?;
        let thread = std::thread::Builder::new()
            .name("attach".into())
            .spawn(move || attach_loop(ebpf, attacher, events, stopped))
            .context("starting the attach thread")?;
        Ok(Self {
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// An error once the thread has ended, which it does only by panicking: pods that start
    /// from then on are not served.
    pub fn check(&self) -> anyhow::Result<()> {
        if self.thread.as_ref().is_none_or(|t| t.is_finished()) {
            bail!(
                "the attach thread stopped: new pod interfaces get no programs; restart the agent"
            );
        }
        Ok(())
    }
}

impl Drop for AttachThread {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The attach thread: link notifications as they come, a full listing now and then.
fn attach_loop(mut ebpf: Ebpf, mut attacher: Attacher, mut events: LinkEvents, stop: UnixStream) {
    let mut batch = Vec::new();
    let mut next_scan = Instant::now() + RESCAN_PERIOD;
    loop {
        let pollfd = |fd: std::os::fd::BorrowedFd<'_>| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let mut fds = [pollfd(events.as_fd()), pollfd(stop.as_fd())];
        // Rounded up: waking up a little early would only loop.
        let wait = next_scan.saturating_duration_since(Instant::now());
        let timeout = wait.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
        // SAFETY: poll(2) on two pollfds we own, for the duration of the call.
        if unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) } < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                tracing::warn!("waiting for link notifications: {e}");
                std::thread::sleep(Duration::from_secs(1));
            }
            continue;
        }
        if fds[1].revents != 0 {
            return; // the dataplane is gone
        }
        let mut rescan = Instant::now() >= next_scan;
        if fds[0].revents != 0 {
            if let Err(e) = events.read(&mut batch) {
                // ENOBUFS: the kernel's queue overflowed (a burst of interfaces).
                tracing::warn!("link notifications lost ({e}); listing the interfaces again");
                rescan = true;
                if e.raw_os_error() != Some(libc::ENOBUFS) {
                    // Something else, which might come back at once: the listings every
                    // second carry on meanwhile, rather than a busy loop.
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
            for event in batch.drain(..) {
                attacher.handle(&mut ebpf, event);
            }
        }
        if rescan {
            if let Err(e) = attacher.scan(&mut ebpf) {
                tracing::warn!("listing the interfaces to attach to: {e:#}");
            }
            next_scan = Instant::now() + RESCAN_PERIOD;
        }
    }
}

/// Interfaces matched by a pattern, and the ifindex each was attached at (a pod that restarts
/// gets an interface of the same name with a new index).
pub struct Attacher {
    pattern: String,
    links_dir: PathBuf,
    tcx: bool,
    attached: HashMap<String, u32>,
}

impl Attacher {
    pub fn new(pattern: &str, pin_dir: &Path) -> anyhow::Result<Self> {
        let links_dir = pin_dir.join("links");
        std::fs::create_dir_all(&links_dir)
            .with_context(|| format!("creating {}", links_dir.display()))?;
        Ok(Self {
            pattern: pattern.to_owned(),
            links_dir,
            tcx: tcx_supported(),
            attached: HashMap::new(),
        })
    }

    /// Attaches both programs to every matching interface not yet attached. Interfaces that
    /// went away are forgotten (the kernel detached their programs), and so are their pins.
    pub fn scan(&mut self, ebpf: &mut Ebpf) -> anyhow::Result<()> {
        let all = interfaces()?;
        let present: HashMap<String, u32> = all
            .iter()
            .filter(|(name, _)| glob_match(&self.pattern, name))
            .cloned()
            .collect();
        self.attached
            .retain(|name, index| present.get(name) == Some(index));
        for (name, index) in present {
            if !self.attached.contains_key(&name) {
                self.attach_and_record(ebpf, name, index);
            }
        }
        self.forget_gone_pins(&all)
    }

    /// Follows a link notification: attaches to an interface that appeared, or got a
    /// matching name (CNI plugins often make a veth under a temporary name, or in the pod's
    /// namespace, then rename it or move it here); forgets one that went away.
    pub fn handle(&mut self, ebpf: &mut Ebpf, event: LinkEvent) {
        match event {
            LinkEvent::Changed { index, name } => {
                // Most notifications are about an interface we know (going up, say).
                if self.attached.get(&name) == Some(&index) {
                    return;
                }
                // Renamed: its old name no longer designates it (its programs stay).
                self.attached.retain(|_, i| *i != index);
                if glob_match(&self.pattern, &name) {
                    self.attach_and_record(ebpf, name, index);
                }
            }
            LinkEvent::Removed { index } => {
                self.attached.retain(|_, i| *i != index);
                // Its links died with it; their pins go too.
                for (_, _, direction) in DIRECTIONS {
                    let _ = std::fs::remove_file(self.pin(index, direction));
                }
            }
        }
    }

    fn attach_and_record(&mut self, ebpf: &mut Ebpf, name: String, index: u32) {
        // The programs are attached by name: the name must still be this interface's (it may
        // have been renamed or deleted since it was listed; the next notification says).
        if ifindex(&name) != Some(index) {
            tracing::debug!(interface = %name, index, "no longer there under that name");
            return;
        }
        match self.attach(ebpf, &name, index) {
            Ok(()) => {
                tracing::info!(interface = %name, "attached tc programs");
                self.attached.insert(name, index);
            }
            // The interface may vanish between listing and attaching (a pod deleted).
            Err(e) => tracing::warn!(interface = %name, "cannot attach tc programs: {e:#}"),
        }
    }

    fn pin(&self, index: u32, direction: &str) -> PathBuf {
        self.links_dir.join(format!("tc-{index}-{direction}"))
    }

    fn attach(&self, ebpf: &mut Ebpf, interface: &str, index: u32) -> anyhow::Result<()> {
        if !self.tcx {
            // cls_bpf needs the clsact qdisc; it may exist already.
            if let Err(e) = tc::qdisc_add_clsact(interface) {
                tracing::debug!(interface, "clsact qdisc not added (may exist already): {e}");
            }
        }
        for (name, attach_type, direction) in DIRECTIONS {
            let prog: &mut SchedClassifier = ebpf
                .program_mut(name)
                .context("program missing")?
                .try_into()?;
            if self.tcx {
                attach_tcx(prog, interface, attach_type, &self.pin(index, direction))
            } else {
                attach_netlink(prog, interface, attach_type)
            }
            .with_context(|| format!("attaching {name} to {interface}"))?;
        }
        Ok(())
    }

    /// Removes the pins of links whose interface is gone (the link died with it).
    fn forget_gone_pins(&self, interfaces: &[(String, u32)]) -> anyhow::Result<()> {
        for entry in std::fs::read_dir(&self.links_dir)? {
            let entry = entry?;
            let name = entry.file_name();
            let index = name.to_str().and_then(|n| {
                n.strip_prefix("tc-")?
                    .split('-')
                    .next()?
                    .parse::<u32>()
                    .ok()
            });
            if index.is_some_and(|i| !interfaces.iter().any(|(_, present)| *present == i)) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        Ok(())
    }
}

fn tcx_supported() -> bool {
    KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0))
}

/// Swaps `prog` into the link pinned at `pin` (atomically, for packets in flight; the pin stays
/// throughout, so a crash halfway leaves the old program serving), or makes a new link there.
fn attach_tcx(
    prog: &mut SchedClassifier,
    interface: &str,
    attach_type: TcAttachType,
    pin: &Path,
) -> anyhow::Result<()> {
    match PinnedLink::from_pin(pin) {
        Ok(pinned) => {
            let link = SchedClassifierLink::try_from(FdLink::from(pinned))?;
            match prog.attach_to_link(link) {
                // Our fd goes with the taken link; the pin keeps the link.
                Ok(id) => {
                    prog.take_link(id)?;
                    return Ok(());
                }
                // The link of an interface that went away (its index now reused): replace it.
                Err(e) => {
                    tracing::debug!(pin = %pin.display(), "pinned link not updatable: {e}");
                    std::fs::remove_file(pin)?;
                }
            }
        }
        Err(LinkError::SyscallError(SyscallError { io_error, .. }))
            if io_error.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(e).with_context(|| format!("opening the pinned link {}", pin.display()));
        }
    }
    let id = prog.attach(interface, attach_type)?;
    let link: FdLink = prog.take_link(id)?.try_into()?;
    link.pin(pin)
        .with_context(|| format!("pinning the link at {}", pin.display()))?;
    Ok(())
}

/// Replaces the program of our filter, or creates the filter; then lets it outlive us.
fn attach_netlink(
    prog: &mut SchedClassifier,
    interface: &str,
    attach_type: TcAttachType,
) -> anyhow::Result<()> {
    let existing =
        SchedClassifierLink::attached(interface, attach_type, NL_PRIORITY, NL_HANDLE, None)?;
    let id = match prog.attach_to_link(existing) {
        Ok(id) => id,
        Err(_) => prog.attach_with_options(
            interface,
            attach_type,
            TcAttachOptions::Netlink(NlOptions {
                priority: NL_PRIORITY,
                handle: NL_HANDLE,
                ..Default::default()
            }),
        )?,
    };
    // Dropping the link would detach the filter.
    std::mem::forget(prog.take_link(id)?);
    Ok(())
}

/// Detaches the programs from every interface matching `pattern` and removes the link pins:
/// `agent --cleanup`, for going back to kube-proxy.
pub fn detach_all(pattern: &str, pin_dir: &Path) -> anyhow::Result<usize> {
    let mut detached = 0;
    let links_dir = pin_dir.join("links");
    if links_dir.exists() {
        for entry in std::fs::read_dir(&links_dir)? {
            // Unpinning drops the last reference to the tcx link, which detaches it.
            std::fs::remove_file(entry?.path())?;
            detached += 1;
        }
    }
    if !tcx_supported() {
        for (name, _) in interfaces()?
            .iter()
            .filter(|(name, _)| glob_match(pattern, name))
        {
            for (prog, attach_type, _) in DIRECTIONS {
                if tc::qdisc_detach_program(name, attach_type, prog).is_ok() {
                    detached += 1;
                }
            }
        }
    }
    Ok(detached)
}

/// The index of the interface called `name`, if there is one.
fn ifindex(name: &str) -> Option<u32> {
    let name = CString::new(name).ok()?;
    // SAFETY: if_nametoindex reads a NUL-terminated string.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    (index != 0).then_some(index)
}

/// The interfaces of this network namespace, by name with their index.
fn interfaces() -> anyhow::Result<Vec<(String, u32)>> {
    // SAFETY: if_nameindex returns an array terminated by a zero entry, freed below.
    let list = unsafe { libc::if_nameindex() };
    if list.is_null() {
        return Err(std::io::Error::last_os_error()).context("listing network interfaces");
    }
    let mut out = Vec::new();
    let mut p = list;
    unsafe {
        while (*p).if_index != 0 {
            let name = CStr::from_ptr((*p).if_name).to_string_lossy().into_owned();
            out.push((name, (*p).if_index));
            p = p.add(1);
        }
        libc::if_freenameindex(list);
    }
    Ok(out)
}

/// Shell-style matching with `*` (any run of characters); several patterns separated by commas.
pub fn glob_match(patterns: &str, name: &str) -> bool {
    patterns
        .split(',')
        .map(str::trim)
        .any(|p| match_one(p.as_bytes(), name.as_bytes()))
}

fn match_one(p: &[u8], s: &[u8]) -> bool {
    match p.split_first() {
        None => s.is_empty(),
        Some((b'*', rest)) => (0..=s.len()).any(|i| match_one(rest, &s[i..])),
        Some((c, rest)) => s.first() == Some(c) && match_one(rest, &s[1..]),
    }
}

#[cfg(test)]
mod tests {
    use super::glob_match;

    #[test]
    fn globs() {
        assert!(glob_match("veth-*", "veth-be1"));
        assert!(!glob_match("veth-*", "eth0"));
        assert!(glob_match("cali*,veth*", "cali12ab"));
        assert!(glob_match("*", "x"));
        assert!(glob_match("lxc*c", "lxcabc"));
        assert!(!glob_match("lxc*c", "lxcab"));
        assert!(glob_match("eth0", "eth0"));
    }
}
