//! `proxy-userspace inspect` prints what a mode installed on the node (while the agent runs or
//! after it stopped) as a table for people or JSON for scripts. Each mode's reader, beside its
//! rules (`modes/<mode>/inspect.rs`), parses its state back into the same [`Rows`]: the ebpf
//! mode's pinned maps, the nftables table, the iptables rules, the IPVS table and kube-proxy's
//! ipsets, the kernel's conntrack table and the affinity the kernel remembers.

use std::fmt::Write as _;

use serde::Serialize;

use crate::rows::{
    AffinityRow, BackendRow, ClientAffinityRow, ConntrackRow, FeatureRow, FlowRow, Rows, ServiceRow,
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
            // Id 0: none (the ebpf mode's SCTP ports, which netfilter serves).
            .map(|b| match ids && b.id != 0 {
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
        // Id 0: none (the ebpf mode's SCTP ports, which netfilter serves).
        let id = match r.id {
            0 => "-".to_owned(),
            id => id.to_string(),
        };
        let _ = writeln!(out, "{id:>8} {:<24} {:<5} {state}", r.address, r.protocol);
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
            r.state,
            match (&r.translated, r.direction) {
                (Some(nat), "forward") => format!(" (sent from {nat})"),
                (Some(peer), "netfilter") => format!(" (translated by netfilter; peer {peer})"),
                (Some(nat), _) => format!(" (answers {nat})"),
                (None, _) if r.external => " (external)".to_owned(),
                (None, _) => String::new(),
            }
        );
    }
    out
}
/// `rows` as a table, or as JSON.
pub fn show(rows: &Rows, json: bool) -> anyhow::Result<String> {
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
    match rows {
        Rows::Services { rows, ids } => out(rows, json, |r| services_table_of(r, *ids)),
        Rows::Backends { rows, ids: true } => out(rows, json, |r| backends_table(r)),
        Rows::Backends { rows, ids: false } => out(rows, json, |r| endpoints_table(r)),
        Rows::Flows(rows) => out(rows, json, |r| conntrack_table(r)),
        Rows::Conntrack(rows) => out(rows, json, |r| kernel_flows_table(r)),
        Rows::Affinity(rows) => out(rows, json, |r| affinity_table(r)),
        Rows::ClientAffinity(rows) => out(rows, json, |r| client_affinity_table(r)),
        Rows::Features(rows) => out(rows, json, |r| features_table(r)),
    }
}

fn features_table(rows: &[FeatureRow]) -> String {
    let mut out = format!(
        "{:<18} {:<6} {:<7} WITHOUT IT\n",
        "FEATURE", "SINCE", "PRESENT"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:<18} {:<6} {:<7} {}",
            r.feature,
            r.since,
            if r.present { "yes" } else { "no" },
            r.without
        );
    }
    out
}

/// The kernel's conntrack entries of Service flows (the netfilter modes').
fn kernel_flows_table(rows: &[ConntrackRow]) -> String {
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
