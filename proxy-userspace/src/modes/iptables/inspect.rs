//! The iptables mode's state, read back: `iptables-save` of the nat and filter tables parsed
//! into the rows the eBPF maps give (as [`crate::modes::iptables::rules`] writes them, in kube-proxy's
//! layout), and the `recent` lists of session affinity. Also the `iptables-save` reader the
//! userspace mode's parser uses.
//!
//! The parsers are tolerant: what they do not recognise (other tools' chains and rules, options
//! in another order, options they do not know) is ignored, and they read both the
//! `iptables-restore` input the agent writes and what `iptables-save` prints of it.
use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
};

use anyhow::Context;

use crate::{
    model::Family,
    netfilter::{
        conntrack,
        iptables::{self, Tables},
        iptables_save::{SavedRule, chains, parse_save},
        rules::source_ranges_of,
    },
    rows::{
        BackendRow, ClientAffinityRow, Rows, ServiceRow, What, backend, host_port, merge_families,
        range, row,
    },
};

/// Where a frontend's chain leads: its endpoints and policies.
#[derive(Default)]
struct Resolved {
    backends: Vec<String>,
    local_only: bool,
    affinity_timeout_seconds: Option<u32>,
    source_ranges: Vec<String>,
}

/// Follows a frontend's jump: `KUBE-FW-*` (source ranges) to `KUBE-EXT-*` (the way in from
/// outside) to `KUBE-SVC-*` or `KUBE-SVL-*` (this node's endpoints), to their `KUBE-SEP-*`.
fn resolve(nat: &HashMap<&str, Vec<&SavedRule>>, chain: &str, depth: u8) -> Resolved {
    let rules = nat.get(chain).map(Vec::as_slice).unwrap_or_default();
    let jumps = |prefixes: &[&str]| -> Vec<&SavedRule> {
        rules
            .iter()
            .copied()
            .filter(|r| {
                r.target()
                    .is_some_and(|t| prefixes.iter().any(|p| t.starts_with(p)))
            })
            .collect()
    };
    if depth > 4 {
        return Resolved::default();
    }
    if chain.starts_with("KUBE-FW-") {
        let allowed = jumps(&["KUBE-EXT-", "KUBE-SVC-", "KUBE-SVL-"]);
        let mut resolved = allowed
            .first()
            .and_then(|r| r.target())
            .map(|next| resolve(nat, next, depth + 1))
            .unwrap_or_default();
        resolved.source_ranges = allowed
            .iter()
            .filter_map(|r| r.value(&["-s", "--source"]))
            .map(range)
            .collect();
        return resolved;
    }
    if chain.starts_with("KUBE-EXT-") {
        // The policy's jump is the one for every source (the others: pods and the node
        // itself, for externalTrafficPolicy Local); without it, outside clients get nothing.
        let policy = jumps(&["KUBE-SVC-", "KUBE-SVL-"])
            .into_iter()
            .find(|r| !r.has("--src-type") && r.value(&["-s", "--source"]).is_none())
            .and_then(|r| r.target());
        let mut resolved = policy
            .map(|next| resolve(nat, next, depth + 1))
            .unwrap_or_default();
        resolved.local_only |= rules.iter().any(|r| r.has("--src-type"));
        return resolved;
    }
    let mut resolved = Resolved {
        local_only: chain.starts_with("KUBE-SVL-"),
        ..Resolved::default()
    };
    for rule in jumps(&["KUBE-SEP-"]) {
        if rule.has("--rcheck") {
            resolved.affinity_timeout_seconds = rule
                .value(&["--seconds"])
                .and_then(|s| s.parse().ok())
                .or(resolved.affinity_timeout_seconds);
        }
        let Some(endpoint) = rule.target().and_then(|sep| endpoint(nat, sep)) else {
            continue;
        };
        if !resolved.backends.contains(&endpoint) {
            resolved.backends.push(endpoint);
        }
    }
    resolved
}

/// The endpoint a `KUBE-SEP-*` chain DNATs to.
fn endpoint(nat: &HashMap<&str, Vec<&SavedRule>>, chain: &str) -> Option<String> {
    nat.get(chain)?
        .iter()
        .find_map(|r| r.value(&["--to-destination"]))
        .map(str::to_owned)
}

/// The kind of a `KUBE-SERVICES` frontend: from its comment (`... cluster IP`, `... external
/// IP`, `... loadbalancer IP`), else from the chain it jumps to.
fn kind(rule: &SavedRule, target: &str) -> &'static str {
    match rule.comment() {
        Some(c) if c.ends_with(" cluster IP") => "ClusterIP",
        Some(c) if c.ends_with(" external IP") => "ExternalIP",
        Some(c) if c.ends_with(" loadbalancer IP") => "LoadBalancer",
        _ if target.starts_with("KUBE-FW-") => "LoadBalancer",
        _ if target.starts_with("KUBE-EXT-") => "ExternalIP",
        _ => "ClusterIP",
    }
}

/// The frontends of `text` (`iptables-save -t nat` and `-t filter`), each with its endpoints
/// and policies; frontends without endpoints (REJECT or DROP in filter) without backends.
pub fn services(text: &str) -> Vec<ServiceRow> {
    let rules = parse_save(text);
    let nat = chains(&rules, "nat");
    let filter = chains(&rules, "filter");
    // By (address, protocol): a frontend is in nat or (without endpoints) in filter.
    let mut rows: BTreeMap<(String, &'static str), ServiceRow> = BTreeMap::new();
    let service_chain = |t: &str| {
        ["KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-"]
            .iter()
            .any(|p| t.starts_with(p))
    };
    let frontends = [("KUBE-SERVICES", false), ("KUBE-NODEPORTS", true)];
    for (chain, node_port) in frontends {
        for rule in nat.get(chain).into_iter().flatten() {
            let Some(target) = rule.target().filter(|t| service_chain(t)) else {
                continue;
            };
            let Some(port) = rule.dport() else { continue };
            let (address, kind) = match (node_port, rule.destination()) {
                (true, _) => (format!("*:{port}"), "NodePort"),
                (false, Some(ip)) => (host_port(ip, port), kind(rule, target)),
                (false, None) => continue,
            };
            let protocol = rule.protocol();
            let resolved = resolve(&nat, target, 0);
            let mut row = row(address.clone(), protocol, kind);
            row.backends = resolved
                .backends
                .into_iter()
                .map(|b| backend(b, protocol))
                .collect();
            row.local_only = resolved.local_only;
            row.affinity_timeout_seconds = resolved.affinity_timeout_seconds;
            row.source_ranges = source_ranges_of(&address, resolved.source_ranges);
            rows.entry((address, protocol)).or_insert(row);
        }
    }
    // Refused (REJECT: no endpoints) or dropped (DROP: none where a Local policy looks).
    let refused = [
        ("KUBE-SERVICES", "ClusterIP"),
        ("KUBE-EXTERNAL-SERVICES", "ExternalIP"),
    ];
    for (chain, kind) in refused {
        for rule in filter.get(chain).into_iter().flatten() {
            let Some(verdict) = rule.target().filter(|t| matches!(*t, "REJECT" | "DROP")) else {
                continue;
            };
            let Some(port) = rule.dport() else { continue };
            let (address, kind) = match rule.destination() {
                Some(ip) => (host_port(ip, port), kind),
                None => (format!("*:{port}"), "NodePort"),
            };
            let protocol = rule.protocol();
            let mut row = row(address.clone(), protocol, kind);
            row.local_only = verdict == "DROP";
            rows.entry((address, protocol)).or_insert(row);
        }
    }
    let mut rows: Vec<ServiceRow> = rows.into_values().collect();
    rows.sort();
    rows
}

/// Every endpoint the rules DNAT to (the `KUBE-SEP-*` chains).
pub fn backends(text: &str) -> Vec<BackendRow> {
    let rules = parse_save(text);
    let mut rows: Vec<BackendRow> = rules
        .iter()
        .filter(|r| r.table == "nat" && r.chain.starts_with("KUBE-SEP-"))
        .filter_map(|r| {
            Some(backend(
                r.value(&["--to-destination"])?.into(),
                r.protocol(),
            ))
        })
        .collect();
    rows.sort();
    rows.dedup();
    rows
}

/// The session affinity the kernel remembers: each `recent` list (`lists`: its name, as under
/// `/proc/net/xt_recent/`, and its text) named after a `KUBE-SEP-*` chain holds the clients
/// sent to that endpoint. The lists do not say when an entry expires (the `--seconds` of the
/// Service chain's check decides, and expired entries stay listed until checked again).
pub fn affinity(text: &str, lists: &[(String, String)]) -> Vec<ClientAffinityRow> {
    let rules = parse_save(text);
    let nat = chains(&rules, "nat");
    let mut rows = Vec::new();
    for (name, list) in lists {
        if !name.starts_with("KUBE-SEP-") {
            continue;
        }
        // The other family's lists (or a list whose chain is gone) are not this text's.
        let Some(sep) = nat.get(name.as_str()) else {
            continue;
        };
        let dnat = sep
            .iter()
            .find(|r| r.value(&["--to-destination"]).is_some());
        let service = sep.iter().find_map(|r| r.comment()).unwrap_or(name);
        for line in list.lines() {
            let Some(client) = line.split_whitespace().find_map(|w| w.strip_prefix("src=")) else {
                continue;
            };
            rows.push(ClientAffinityRow {
                client: client.to_owned(),
                service: service.to_owned(),
                protocol: dnat.map_or("?", |r| r.protocol()),
                endpoint: dnat
                    .and_then(|r| r.value(&["--to-destination"]))
                    .unwrap_or("?")
                    .to_owned(),
                expires_seconds: None,
            });
        }
    }
    rows.sort();
    rows
}

/// The `recent` match's lists (iptables session affinity): name and text. None loaded: none.
pub(crate) fn recent_lists() -> anyhow::Result<Vec<(String, String)>> {
    let dir = Path::new("/proc/self/net/xt_recent");
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    let mut lists = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(entry.path())
            .with_context(|| format!("reading {}", entry.path().display()))?;
        lists.push((name, text));
    }
    Ok(lists)
}

/// `what` of the mode's rules (in the backend holding them), both families: IPv6's where
/// `ip6tables` runs here.
pub fn read(what: What) -> anyhow::Result<Rows> {
    let backend = super::detect_backend()?;
    let mut saved = vec![iptables::save(backend)?];
    let v6 = Tables {
        backend,
        family: Family::V6,
    };
    if let Ok(text) = iptables::save(v6) {
        saved.push(text);
    }
    // Each family's text on its own: a dual-stack Service's chains have the same names in
    // both.
    let services = || merge_families(saved.iter().flat_map(|t| services(t)).collect());
    Ok(match what {
        What::Services => Rows::Services {
            rows: services(),
            ids: false,
        },
        What::Backends => Rows::Backends {
            rows: {
                let mut rows: Vec<BackendRow> = saved.iter().flat_map(|t| backends(t)).collect();
                rows.sort();
                rows
            },
            ids: false,
        },
        What::Conntrack => Rows::Conntrack(conntrack::service_flows(&services())?),
        What::Affinity => {
            let lists = recent_lists()?;
            let mut rows: Vec<ClientAffinityRow> =
                saved.iter().flat_map(|t| affinity(t, &lists)).collect();
            rows.sort();
            rows.dedup();
            Rows::ClientAffinity(rows)
        }
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::{
        modes::iptables::rules::render,
        testing::{fixture, netfilter_settings as settings, rule_backends},
    };

    fn rendered() -> String {
        let state = fixture(crate::testing::SERVICES);
        render(&state, &settings(), &BTreeSet::new(), None).text
    }

    /// What the golden file's Services (src/testdata/services.yaml, node1) show.
    fn expected() -> Vec<ServiceRow> {
        let tcp = |address: &str, kind, backends: &[&str]| {
            let mut r = row(address.to_owned(), "TCP", kind);
            r.backends = backends
                .iter()
                .map(|b| backend(b.to_string(), "TCP"))
                .collect();
            r
        };
        let web = ["10.244.1.11:8080", "10.244.1.12:8080", "10.244.2.11:8080"];
        let front = ["10.244.1.12:8080", "10.244.2.11:8080"];
        let local = ["10.244.1.13:8080", "10.244.2.13:8080"];
        let local_only = |mut r: ServiceRow| {
            r.local_only = true;
            r
        };
        let mut dns = row("10.96.0.53:53".into(), "UDP", "ClusterIP");
        dns.backends = ["10.244.1.53:53", "10.244.2.53:53"]
            .iter()
            .map(|b| backend(b.to_string(), "UDP"))
            .collect();
        dns.affinity_timeout_seconds = Some(10800);
        let mut local_lb = local_only(tcp("203.0.113.11:80", "LoadBalancer", &local[..1]));
        local_lb.source_ranges = vec!["192.0.2.0/24".into()];
        let mut rows = vec![
            tcp("10.96.0.10:80", "ClusterIP", &web),
            dns,
            tcp("10.96.0.20:80", "ClusterIP", &front),
            tcp("198.51.100.10:80", "ExternalIP", &front),
            tcp("203.0.113.10:80", "LoadBalancer", &front),
            tcp("*:30080", "NodePort", &front),
            tcp("10.96.0.21:80", "ClusterIP", &local),
            local_lb,
            local_only(tcp("*:30081", "NodePort", &local[..1])),
            // No endpoint on node1, some on node2: dropped.
            local_only(tcp("10.96.0.22:80", "ClusterIP", &[])),
            local_only(tcp("*:30082", "NodePort", &[])),
            // No endpoints: rejected.
            tcp("10.96.0.23:80", "ClusterIP", &[]),
            tcp("*:30083", "NodePort", &[]),
        ];
        rows.sort();
        rows
    }

    /// The rules as rendered now and as the golden file holds them (a layout change that
    /// breaks inspect fails here), and as iptables-save prints them back from the kernel.
    #[test]
    fn services_of_the_golden_rules() {
        assert_eq!(services(&rendered()), expected());
        assert_eq!(services(include_str!("testdata/rules.golden")), expected());
    }

    #[test]
    fn services_read_back_from_the_kernel() {
        let test = "modes::iptables::inspect::tests::services_read_back_from_the_kernel";
        for saved in crate::testing::saved_in_each_backend(test, rendered) {
            assert_eq!(services(&saved), expected(), "{saved}");
        }
    }

    #[test]
    fn backends_and_affinity_of_the_golden_rules() {
        let text = rendered();
        let all: Vec<String> = backends(&text).into_iter().map(|b| b.address).collect();
        assert_eq!(
            all,
            [
                "10.244.1.11:8080",
                "10.244.1.12:8080",
                "10.244.1.13:8080",
                "10.244.1.53:53",
                "10.244.2.11:8080",
                "10.244.2.13:8080",
                // shop/elsewhere's, for pods and the node (eTP Local's short-circuit).
                "10.244.2.14:8080",
                "10.244.2.53:53"
            ]
        );
        let list = "src=10.244.1.10 ttl: 64 last_seen: 4295123456 oldest_pkt: 1 4295123456\n\
                    src=192.0.2.50 ttl: 63 last_seen: 4295123999 oldest_pkt: 1 4295123999\n";
        let lists = [
            ("KUBE-SEP-FOVVATSJWM3ZDQHB".to_string(), list.to_string()),
            ("other-list".to_string(), list.to_string()),
        ];
        let rows = affinity(&text, &lists);
        assert_eq!(
            rows,
            [
                ClientAffinityRow {
                    client: "10.244.1.10".into(),
                    service: "kube-system/dns:dns".into(),
                    protocol: "UDP",
                    endpoint: "10.244.1.53:53".into(),
                    expires_seconds: None,
                },
                ClientAffinityRow {
                    client: "192.0.2.50".into(),
                    service: "kube-system/dns:dns".into(),
                    protocol: "UDP",
                    endpoint: "10.244.1.53:53".into(),
                    expires_seconds: None,
                },
            ]
        );
    }

    /// What `iptables-save` prints of the rules (options reordered, `/32` added, other chains
    /// and tools' rules around): the same rows.
    #[test]
    fn services_as_iptables_save_prints_them() {
        let saved = "# Generated by iptables-save v1.8.9 on Mon Dec  1 11:00:00 2025\n\
            *nat\n\
            :PREROUTING ACCEPT [0:0]\n\
            :KUBE-SERVICES - [0:0]\n\
            -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
            -A DOCKER -d 172.17.0.2/32 ! -i docker0 -p tcp -m tcp --dport 80 -j DNAT --to-destination 172.17.0.2:80\n\
            -A KUBE-SERVICES -d 10.96.0.53/32 -p udp -m comment --comment \"kube-system/dns:dns cluster IP\" -m udp --dport 53 -j KUBE-SVC-2KKYJRIGYGQNRODB\n\
            -A KUBE-SVC-2KKYJRIGYGQNRODB ! -s 10.244.0.0/16 -d 10.96.0.53/32 -p udp -m comment --comment \"kube-system/dns:dns cluster IP\" -m udp --dport 53 -j KUBE-MARK-MASQ\n\
            -A KUBE-SVC-2KKYJRIGYGQNRODB -m comment --comment \"kube-system/dns:dns -> 10.244.1.53:53\" -m recent --rcheck --seconds 10800 --reap --name KUBE-SEP-FOVVATSJWM3ZDQHB --mask 255.255.255.255 --rsource -j KUBE-SEP-FOVVATSJWM3ZDQHB\n\
            -A KUBE-SVC-2KKYJRIGYGQNRODB -m comment --comment \"kube-system/dns:dns -> 10.244.1.53:53\" -j KUBE-SEP-FOVVATSJWM3ZDQHB\n\
            -A KUBE-SEP-FOVVATSJWM3ZDQHB -s 10.244.1.53/32 -m comment --comment \"kube-system/dns:dns\" -j KUBE-MARK-MASQ\n\
            -A KUBE-SEP-FOVVATSJWM3ZDQHB -p udp -m comment --comment \"kube-system/dns:dns\" -m recent --set --name KUBE-SEP-FOVVATSJWM3ZDQHB --mask 255.255.255.255 --rsource -m udp -j DNAT --to-destination 10.244.1.53:53\n\
            -A KUBE-SERVICES -d 192.0.2.11/32 -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -j KUBE-NODEPORTS\n\
            COMMIT\n\
            *filter\n\
            -A KUBE-EXTERNAL-SERVICES -p tcp -m comment --comment \"shop/empty has no endpoints\" -m addrtype --dst-type LOCAL -m tcp --dport 30083 -j REJECT --reject-with icmp-port-unreachable\n\
            -A KUBE-SERVICES -d 10.96.0.23/32 -p tcp -m comment --comment \"shop/empty has no endpoints\" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable\n\
            COMMIT\n";
        let rows = services(saved);
        let addresses: Vec<(&str, &str, Vec<&str>)> = rows
            .iter()
            .map(|r| (r.address.as_str(), r.kind, rule_backends(r)))
            .collect();
        assert_eq!(
            addresses,
            [
                ("*:30083", "NodePort", vec![]),
                ("10.96.0.23:80", "ClusterIP", vec![]),
                ("10.96.0.53:53", "ClusterIP", vec!["10.244.1.53:53"]),
            ]
        );
        assert_eq!(rows[2].affinity_timeout_seconds, Some(10800));
    }
}
