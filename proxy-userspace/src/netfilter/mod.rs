//! What the netfilter modes (iptables, nftables, IPVS, userspace) share.
pub mod conntrack;
pub mod conntrack_tuning;
pub mod iptables;
pub mod iptables_save;
pub mod rules;
pub mod stale_udp;
#[cfg(test)]
pub(crate) mod tracer;

use anyhow::Context;

/// Sets `key` (a path under /proc/sys) to `value` unless it is so already; whether it changed.
pub fn ensure_sysctl(key: &str, value: &str) -> anyhow::Result<bool> {
    let path = format!("/proc/sys/{key}");
    let now = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    if now.trim() == value {
        return Ok(false);
    }
    std::fs::write(&path, value).with_context(|| format!("setting {key} to {value}"))?;
    Ok(true)
}
