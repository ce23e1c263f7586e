//! `proxy-userspace inspect`: reads what the mode installed on the node (while the agent runs
//! or after it stopped) and prints it as a table for people or JSON for scripts. In the ebpf
//! mode, the pinned maps; in the others, the mode's own state, parsed back into the same rows:
//! the nftables table ([`nftables`]), the iptables rules ([`iptables`], [`userspace`]), the IPVS
//! table and kube-proxy's ipsets ([`ipvs`]), the kernel's conntrack table ([`conntrack`]) and
//! the affinity the kernel remembers.

use std::{fmt::Write as _, path::Path};

use anyhow::{Context, bail};
use serde::Serialize;

use crate::{
    modes::{
        ebpf::inspect as ebpf, iptables::inspect as iptables, ipvs::inspect as ipvs,
        nftables::inspect as nftables, userspace::inspect as userspace,
    },
    netfilter::conntrack,
    rows::{AffinityRow, BackendRow, ClientAffinityRow, ConntrackRow, FlowRow, ServiceRow},
};

pub fn affinity_table(rows: &[AffinityRow]) -> String {
    let mut out = format!(
        "{:<16} {:<22} {:<5} {:>8} {:>8}\n",
        "CLIENT", "SERVICE", "PROTO", "BACKEND", "IDLE(s)"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:<16} {:<22} {:<5} {:>8} {:>8.1}",
            r.client, r.service, r.protocol, r.backend_id, r.idle_seconds
        );
    }
    out
}

pub fn services_table(rows: &[ServiceRow]) -> String {
    services_table_of(rows, true)
}

/// `ids`: the backends have ids (the eBPF maps'; the other modes' have none).
fn services_table_of(rows: &[ServiceRow], ids: bool) -> String {
    let mut out = format!(
        "{:<24} {:<5} {:<12} {}\n",
        "SERVICE",
        "PROTO",
        "KIND",
        if ids {
            "BACKENDS (id address)"
        } else {
            "BACKENDS"
        }
    );
    for r in rows {
        let list: Vec<String> = r
            .backends
            .iter()
            .map(|b| match ids {
                true => format!("{} {}", b.id, b.address),
                false => b.address.clone(),
            })
            .collect();
        let list = match (r.draining, list.is_empty()) {
            (true, _) => "(removed: draining its established connections)".to_owned(),
            (false, true) => "(none)".to_owned(),
            (false, false) => list.join(", "),
        };
        let mut policies = Vec::new();
        if r.in_cluster_scope {
            policies.push("in-cluster clients".to_owned());
        }
        if r.local_only {
            policies.push(match r.kind {
                "ClusterIP" => "internal traffic local".to_owned(),
                _ => "external traffic local".to_owned(),
            });
        }
        if !r.source_ranges.is_empty() {
            policies.push(format!("sources {}", r.source_ranges.join(" ")));
        }
        if let Some(timeout) = r.affinity_timeout_seconds {
            policies.push(format!("affinity {timeout}s"));
        }
        if r.maglev {
            policies.push("maglev".to_owned());
        }
        let list = match policies.is_empty() {
            true => list,
            false => format!("{list} [{}]", policies.join(", ")),
        };
        let _ = writeln!(
            out,
            "{:<24} {:<5} {:<12} {}",
            r.address, r.protocol, r.kind, list
        );
    }
    out
}

pub fn backends_table(rows: &[BackendRow]) -> String {
    let mut out = format!("{:>8} {:<24} {:<5} STATE\n", "ID", "ADDRESS", "PROTO");
    for r in rows {
        let state = if r.draining { "draining" } else { "active" };
        let _ = writeln!(
            out,
            "{:>8} {:<24} {:<5} {state}",
            r.id, r.address, r.protocol
        );
    }
    out
}

pub fn conntrack_table(rows: &[FlowRow]) -> String {
    let mut out = format!(
        "{:<8} {:<5} {:<22} {:<22} {:<22} {:>8} {:>8} {:>8} STATE\n",
        "DIR", "PROTO", "SOURCE", "DESTINATION", "SERVICE", "BACKEND", "PACKETS", "IDLE(s)"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:<8} {:<5} {:<22} {:<22} {:<22} {:>8} {:>8} {:>8.1} {}{}",
            r.direction,
            r.protocol,
            r.source,
            r.destination,
            r.service,
            r.backend_id,
            r.packets,
            r.idle_seconds,
            match (r.expired, r.closing) {
                (true, _) => "expired",
                (false, true) => "closing",
                (false, false) => "open",
            },
            match (&r.translated, r.direction) {
                (Some(nat), "forward") => format!(" (sent from {nat})"),
                (Some(nat), _) => format!(" (answers {nat})"),
                (None, _) if r.external => " (external)".to_owned(),
                (None, _) => String::new(),
            }
        );
    }
    out
}
/// A proxy mode whose state `inspect` reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// The pinned BPF maps in --bpf-pin-dir.
    Ebpf,
    /// `table ip kube-proxy` (nft -j list table ip kube-proxy).
    Nftables,
    /// kube-proxy's iptables chains (iptables-save, of the backend holding them).
    Iptables,
    /// The userspace mode's iptables chains (KUBE-PORTALS-*, KUBE-NODEPORT-*).
    Userspace,
    /// kube-proxy's IPVS mode: found, not read yet.
    Ipvs,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Nftables => "nftables",
            Mode::Iptables => "iptables",
            Mode::Userspace => "userspace",
            Mode::Ipvs => "ipvs",
        }
    }
}

/// What `inspect` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum What {
    /// Each frontend (cluster IP, NodePort, load balancer IP, external IP) with its endpoints
    /// and policies.
    Services,
    /// The endpoints.
    Backends,
    /// The flows sent to a Service.
    Conntrack,
    /// sessionAffinity ClientIP: which client is sent to which endpoint.
    Affinity,
}

/// The mode installed on this node (in this network namespace): the ebpf mode's pins in
/// `pin_dir`, else the one mode whose rules are here.
pub fn detect(pin_dir: &Path) -> anyhow::Result<Mode> {
    // A non-ebpf agent removes the pins when it starts, and the ebpf agent the others' rules.
    if pin_dir.join(proxy_common::MAP_SERVICES).exists() {
        return Ok(Mode::Ebpf);
    }
    let mut found = Vec::new();
    if crate::modes::nftables::installed() {
        found.push(Mode::Nftables);
    }
    // The IPVS mode writes some of the iptables mode's chains (KUBE-SERVICES...) too.
    if crate::modes::ipvs::installed() {
        found.push(Mode::Ipvs);
    } else if crate::modes::iptables::installed() {
        found.push(Mode::Iptables);
    }
    if crate::modes::userspace::installed() {
        found.push(Mode::Userspace);
    }
    match found.as_slice() {
        [mode] => Ok(*mode),
        [] => {
            // SAFETY: geteuid has no preconditions.
            let root = unsafe { libc::geteuid() } == 0;
            bail!(
                "no proxy mode is installed on this node (in this network namespace): no pinned \
                 maps in {} (ebpf), no `table ip kube-proxy` (nftables), no kube-proxy iptables \
                 chains (iptables, userspace), no IPVS virtual servers (ipvs). Is the agent \
                 running here? Pass --bpf-pin-dir if it pins its maps elsewhere, or --proxy-mode \
                 to read one mode's state{}",
                pin_dir.display(),
                if root {
                    ""
                } else {
                    " (reading the rules needs root)"
                }
            )
        }
        several => {
            let names: Vec<&str> = several.iter().map(|m| m.name()).collect();
            bail!(
                "the state of several proxy modes is on this node ({}): pass --proxy-mode to \
                 choose one (an agent starting in one mode removes the others'; `agent \
                 --cleanup` removes all)",
                names.join(", ")
            )
        }
    }
}

/// `what` of `mode`'s state, as a table or as JSON.
pub fn show(mode: Mode, what: What, pin_dir: &Path, json: bool) -> anyhow::Result<String> {
    fn out<T: Serialize + ?Sized>(
        rows: &T,
        json: bool,
        table: impl FnOnce(&T) -> String,
    ) -> anyhow::Result<String> {
        match json {
            true => Ok(serde_json::to_string_pretty(rows)?),
            false => Ok(table(rows)),
        }
    }
    // The iptables rules of the iptables and userspace modes.
    let iptables_rules = || -> anyhow::Result<String> {
        match mode {
            Mode::Iptables => {
                crate::netfilter::iptables::save(crate::modes::iptables::detect_backend()?)
            }
            _ => crate::netfilter::iptables::save(crate::modes::userspace::detect_backend()?),
        }
    };
    // The frontends in the mode's own state.
    let frontends = || -> anyhow::Result<Vec<ServiceRow>> {
        match mode {
            Mode::Nftables => nftables::services(&nftables::nft_list()?),
            Mode::Ipvs => Ok(ipvs::services(&ipvs::read()?, &ipvs::ipset_save()?)),
            Mode::Iptables => Ok(iptables::services(&iptables_rules()?)),
            _ => Ok(userspace::services(&iptables_rules()?)),
        }
    };
    match (mode, what) {
        (Mode::Ebpf, What::Services) => out(&ebpf::services(pin_dir)?, json, |r| services_table(r)),
        (Mode::Ebpf, What::Backends) => out(&ebpf::backends(pin_dir)?, json, |r| backends_table(r)),
        (Mode::Ebpf, What::Conntrack) => {
            out(&ebpf::conntrack(pin_dir)?, json, |r| conntrack_table(r))
        }
        (Mode::Ebpf, What::Affinity) => out(&ebpf::affinity(pin_dir)?, json, |r| affinity_table(r)),
        (_, What::Services) => out(&frontends()?, json, |r| services_table_of(r, false)),
        (_, What::Conntrack) => {
            let flows = conntrack::flows(&conntrack::conntrack_list()?, &frontends()?);
            out(&flows, json, |r| flows_table(r))
        }
        (Mode::Ipvs, What::Backends) => {
            out(&ipvs::backends(&frontends()?), json, |r| endpoints_table(r))
        }
        (Mode::Ipvs, What::Affinity) => {
            let path = "/proc/net/ip_vs_conn";
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
            out(&ipvs::affinity(&text), json, |r| client_affinity_table(r))
        }
        (Mode::Userspace, What::Backends | What::Affinity) => bail!(
            "`inspect {}` is not available in userspace mode: the endpoints and the ClientIP \
             affinity live in the agent's memory (each Service port's proxy). `inspect \
             services` shows each frontend's proxy port",
            match what {
                What::Backends => "backends",
                _ => "affinity",
            }
        ),
        (Mode::Nftables, What::Backends) => {
            out(&nftables::backends(&nftables::nft_list()?)?, json, |r| {
                endpoints_table(r)
            })
        }
        (_, What::Backends) => {
            let rows = iptables::backends(&iptables_rules()?);
            out(&rows, json, |r| endpoints_table(r))
        }
        (Mode::Nftables, What::Affinity) => {
            let rows = nftables::affinity(&nftables::nft_list()?)?;
            out(&rows, json, |r| client_affinity_table(r))
        }
        (_, What::Affinity) => {
            let rows = iptables::affinity(&iptables_rules()?, &iptables::recent_lists()?);
            out(&rows, json, |r| client_affinity_table(r))
        }
    }
}

fn flows_table(rows: &[ConntrackRow]) -> String {
    let mut out = format!(
        "{:<8} {:<5} {:<22} {:<22} {:<22} {:<22} {:>8} {:>10} STATE\n",
        "DIR", "PROTO", "SOURCE", "DESTINATION", "SERVICE", "TRANSLATED", "PACKETS", "EXPIRES(s)"
    );
    for r in rows {
        let packets = r.packets.map_or("-".to_owned(), |p| p.to_string());
        let _ = writeln!(
            out,
            "{:<8} {:<5} {:<22} {:<22} {:<22} {:<22} {:>8} {:>10} {}{}",
            r.direction,
            r.protocol,
            r.source,
            r.destination,
            r.service,
            r.translated,
            packets,
            r.expires_seconds,
            r.state,
            if r.external { " (external)" } else { "" }
        );
    }
    out
}

/// The endpoints of the modes without backend ids or draining.
fn endpoints_table(rows: &[BackendRow]) -> String {
    let mut out = format!("{:<24} PROTO\n", "ADDRESS");
    for r in rows {
        let _ = writeln!(out, "{:<24} {}", r.address, r.protocol);
    }
    out
}

fn client_affinity_table(rows: &[ClientAffinityRow]) -> String {
    let mut out = format!(
        "{:<16} {:<32} {:<5} {:<22} {:>10}\n",
        "CLIENT", "SERVICE", "PROTO", "ENDPOINT", "EXPIRES(s)"
    );
    for r in rows {
        let expires = r.expires_seconds.map_or("-".to_owned(), |s| s.to_string());
        let _ = writeln!(
            out,
            "{:<16} {:<32} {:<5} {:<22} {:>10}",
            r.client, r.service, r.protocol, r.endpoint, expires
        );
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::rows::{backend, row};

    #[test]
    fn tables_of_the_other_modes() {
        let mut web = row("10.96.0.10:80".into(), "TCP", "ClusterIP");
        web.backends = vec![
            backend("10.244.1.11:8080".into(), "TCP"),
            backend("10.244.1.12:8080".into(), "TCP"),
        ];
        web.affinity_timeout_seconds = Some(10800);
        let mut none = row("*:30082".into(), "TCP", "NodePort");
        none.local_only = true;
        assert_eq!(
            services_table_of(&[web, none], false),
            "SERVICE                  PROTO KIND         BACKENDS\n\
             10.96.0.10:80            TCP   ClusterIP    10.244.1.11:8080, 10.244.1.12:8080 [affinity 10800s]\n\
             *:30082                  TCP   NodePort     (none) [external traffic local]\n"
        );
    }
}
