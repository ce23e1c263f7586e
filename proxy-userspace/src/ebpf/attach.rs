//! Attaching the tc programs to pod-facing interfaces, including those of pods that start
//! later, so that they stay attached when the agent exits: a restarting agent (a rollout, a
//! crash) must not leave pods without service translation. A new agent swaps its programs in
//! atomically where the old ones were.
//!
//! Kernels 6.6 and later attach through tcx links, pinned in `<pin dir>/links/` (a link lives
//! while its pin does). Older kernels attach cls_bpf filters through netlink at a fixed
//! priority and handle, replaced in place; such filters outlive the process by themselves.
use std::{
    collections::HashMap,
    ffi::CStr,
    io,
    path::{Path, PathBuf},
};

use anyhow::Context;
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

use super::{PROG_EGRESS, PROG_INGRESS};

/// Where our netlink filters sit (kernels before 6.6): a fixed place, so a restarted agent
/// replaces them instead of adding more.
const NL_PRIORITY: u16 = 0x4b50;
const NL_HANDLE: TcHandle = TcHandle::new(0, 1);

const DIRECTIONS: [(&str, TcAttachType, &str); 2] = [
    (PROG_INGRESS, TcAttachType::Ingress, "ingress"),
    (PROG_EGRESS, TcAttachType::Egress, "egress"),
];

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
            if self.attached.contains_key(&name) {
                continue;
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
        self.forget_gone_pins(&all)
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
                let pin = self.links_dir.join(format!("tc-{index}-{direction}"));
                attach_tcx(prog, interface, attach_type, &pin)
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
