//! Attaching the tc programs to pod-facing interfaces, including those of pods that start later.
use std::{collections::HashMap, ffi::CStr};

use anyhow::Context;
use aya::{
    Ebpf,
    programs::{SchedClassifier, TcAttachType, tc},
};

use super::{PROG_EGRESS, PROG_INGRESS};

/// Interfaces matched by a pattern, and the ifindex each was attached at (a pod that restarts
/// gets an interface of the same name with a new index).
pub struct Attacher {
    pattern: String,
    attached: HashMap<String, u32>,
}

impl Attacher {
    pub fn new(pattern: &str) -> Self {
        Self {
            pattern: pattern.to_owned(),
            attached: HashMap::new(),
        }
    }

    /// Attaches both programs to every matching interface not yet attached. Interfaces that
    /// went away are forgotten (the kernel removed their programs with them).
    pub fn scan(&mut self, ebpf: &mut Ebpf) -> anyhow::Result<()> {
        let present: HashMap<String, u32> = interfaces()?
            .into_iter()
            .filter(|(name, _)| glob_match(&self.pattern, name))
            .collect();
        self.attached
            .retain(|name, index| present.get(name) == Some(index));
        for (name, index) in present {
            if self.attached.contains_key(&name) {
                continue;
            }
            match attach(ebpf, &name) {
                Ok(()) => {
                    tracing::info!(interface = %name, "attached tc programs");
                    self.attached.insert(name, index);
                }
                // The interface may vanish between listing and attaching (a pod deleted).
                Err(e) => tracing::warn!(interface = %name, "cannot attach tc programs: {e:#}"),
            }
        }
        Ok(())
    }
}

fn attach(ebpf: &mut Ebpf, interface: &str) -> anyhow::Result<()> {
    // Kernels before 6.6 attach through a clsact qdisc; newer ones use tcx links and skip it.
    if let Err(e) = tc::qdisc_add_clsact(interface) {
        tracing::debug!(interface, "clsact qdisc not added (may exist already): {e}");
    }
    for (name, attach_type) in [
        (PROG_INGRESS, TcAttachType::Ingress),
        (PROG_EGRESS, TcAttachType::Egress),
    ] {
        let prog: &mut SchedClassifier = ebpf
            .program_mut(name)
            .context("program missing")?
            .try_into()?;
        prog.attach(interface, attach_type)
            .with_context(|| format!("attaching {name} to {interface}"))?;
    }
    Ok(())
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
