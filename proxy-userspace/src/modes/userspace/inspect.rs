//! The userspace mode's state, read back: `iptables-save` of the nat and filter tables parsed
//! into the rows the eBPF maps give, following the rules as [`crate::modes::userspace::rules`] writes
//! them (kube-proxy's userspace layout). A frontend's rules send it to its Service port's proxy
//! port on the node (`KUBE-PORTALS-*`, `KUBE-NODEPORT-*`); the endpoints behind that port live
//! in the agent's memory, so a row's one backend is the proxy: `node:port (proxy)`. Frontends
//! without endpoints are rejected or dropped in `KUBE-PORTALS-FIREWALL`: rows without backends.
//!
//! The rules do not say which frontend of a Service port is its cluster IP: the agent writes the
//! cluster IP first, so the first address of a Service port (by its rules' comment) is taken as
//! the cluster IP, those with source ranges as load balancer IPs, the others as external IPs.
use std::collections::BTreeMap;

use super::rules::{
    CONTAINER_NODEPORTS, CONTAINER_PORTALS, FIREWALL, HOST_NODEPORTS, HOST_PORTALS,
};
use crate::{
    model::Family,
    netfilter::{
        conntrack,
        iptables::{self, Tables},
        iptables_save::{SavedRule, chains, parse_save},
    },
    rows::{Rows, ServiceRow, What, backend, host_port, merge_families, range, row},
};

/// What a row's proxy backend says after the address.
pub const PROXY: &str = " (proxy)";

/// The frontends of `text` (`iptables-save -t nat` and `-t filter` of one family), each with
/// its proxy port as its backend; frontends without endpoints without backends.
pub fn services(text: &str) -> Vec<ServiceRow> {
    let rules = parse_save(text);
    let nat = chains(&rules, "nat");
    let filter = chains(&rules, "filter");
    let all = |names: &[&str]| -> Vec<&SavedRule> {
        names
            .iter()
            .flat_map(|n| nat.get(n).into_iter().flatten().copied())
            .collect()
    };
    // Where the node's own traffic goes: the node address of each proxy port.
    let mut node_of_port: BTreeMap<u16, String> = BTreeMap::new();
    for rule in all(&[HOST_PORTALS, HOST_NODEPORTS]) {
        if let Some((node, port)) = rule
            .value(&["--to-destination"])
            .and_then(|to| to.rsplit_once(':'))
            && let Ok(port) = port.parse()
        {
            node_of_port.insert(port, node.to_owned());
        }
    }
    let proxy_port = |rule: &SavedRule| -> Option<u16> {
        match rule.value(&["--to-ports"]) {
            Some(ports) => ports.split(['-', ',']).next()?.parse().ok(),
            None => rule
                .value(&["--to-destination"])?
                .rsplit_once(':')?
                .1
                .parse()
                .ok(),
        }
    };
    let proxy = |port: u16| match node_of_port.get(&port) {
        Some(node) => format!("{node}:{port}{PROXY}"),
        None => format!("*:{port}{PROXY}"),
    };

    let mut rows: BTreeMap<(String, &'static str), ServiceRow> = BTreeMap::new();
    // The node addresses NodePorts answer on, as the NodePort rules name them.
    let mut node_addresses: Vec<&str> = Vec::new();
    for rule in all(&[CONTAINER_NODEPORTS, HOST_NODEPORTS]) {
        let (Some(port), Some(to)) = (rule.dport(), proxy_port(rule)) else {
            continue;
        };
        node_addresses.extend(rule.destination());
        let protocol = rule.protocol();
        let address = format!("*:{port}");
        rows.entry((address.clone(), protocol)).or_insert_with(|| {
            let mut row = row(address, protocol, "NodePort");
            row.backends = vec![backend(proxy(to), protocol)];
            row
        });
    }
    // The Service ports' frontends, by the rules' comment (the Service port's name), in order.
    let mut first_of: BTreeMap<(String, &'static str), String> = BTreeMap::new();
    for rule in all(&[CONTAINER_PORTALS, HOST_PORTALS]) {
        let (Some(ip), Some(port), Some(to)) = (rule.destination(), rule.dport(), proxy_port(rule))
        else {
            continue;
        };
        let protocol = rule.protocol();
        let address = host_port(ip, port);
        let name = rule.comment().unwrap_or_default().to_owned();
        let first = first_of
            .entry((name, protocol))
            .or_insert_with(|| address.clone());
        let kind = if *first == address {
            "ClusterIP"
        } else {
            "ExternalIP"
        };
        let row = rows.entry((address.clone(), protocol)).or_insert_with(|| {
            let mut row = row(address, protocol, kind);
            row.backends = vec![backend(proxy(to), protocol)];
            row
        });
        if let Some(source) = rule.value(&["-s", "--source"]) {
            let source = range(source);
            if !row.source_ranges.contains(&source) {
                row.source_ranges.push(source);
            }
            row.kind = "LoadBalancer";
        }
    }
    // Refused (no endpoints) or dropped (none where a Local policy looks).
    let mut first_port: BTreeMap<(String, &'static str), u16> = BTreeMap::new();
    for rule in filter.get(FIREWALL).into_iter().flatten() {
        let Some(verdict) = rule.target().filter(|t| matches!(*t, "REJECT" | "DROP")) else {
            continue;
        };
        let Some(name) = rule.comment().and_then(|c| {
            c.strip_suffix(" has no endpoints")
                .or_else(|| c.strip_suffix(" has no local endpoints"))
        }) else {
            // Load balancer traffic from outside the source ranges: its row has the ranges.
            continue;
        };
        let Some(port) = rule.dport() else { continue };
        let protocol = rule.protocol();
        // A Service port's frontends come first, its NodePort last, on another port.
        let service_port = *first_port
            .entry((name.to_owned(), protocol))
            .or_insert(port);
        let (address, kind) = match rule.destination() {
            Some(ip) if port == service_port && !node_addresses.contains(&ip) => {
                let address = host_port(ip, port);
                let first = first_of
                    .entry((name.to_owned(), protocol))
                    .or_insert_with(|| address.clone());
                let kind = if *first == address {
                    "ClusterIP"
                } else {
                    "ExternalIP"
                };
                (address, kind)
            }
            _ => (format!("*:{port}"), "NodePort"),
        };
        let mut row = row(address.clone(), protocol, kind);
        row.local_only = verdict == "DROP";
        rows.entry((address, protocol)).or_insert(row);
    }
    let mut rows: Vec<ServiceRow> = rows.into_values().collect();
    rows.sort();
    rows
}

/// `what` of the mode's rules (in the backend holding them), both families: IPv6's where
/// `ip6tables` runs here. The endpoints and the ClientIP affinity live in the agent's memory
/// (each Service port's proxy): not readable from here.
pub fn read(what: What) -> anyhow::Result<Rows> {
    let frontends = || -> anyhow::Result<Vec<ServiceRow>> {
        let backend = super::detect_backend()?;
        let mut rows = services(&iptables::save(backend)?);
        let v6 = Tables {
            backend,
            family: Family::V6,
        };
        if let Ok(text) = iptables::save(v6) {
            rows.extend(services(&text));
        }
        Ok(merge_families(rows))
    };
    Ok(match what {
        What::Services => Rows::Services {
            rows: frontends()?,
            ids: false,
        },
        What::Conntrack => Rows::Conntrack(conntrack::service_flows(&frontends()?)?),
        What::Backends | What::Affinity => anyhow::bail!(
            "`inspect {}` is not available in userspace mode: the endpoints and the ClientIP \
             affinity live in the agent's memory (each Service port's proxy). `inspect \
             services` shows each frontend's proxy port",
            match what {
                What::Backends => "backends",
                _ => "affinity",
            }
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        modes::userspace::rules::{numbered_ports, render, settings_of},
        testing::{fixture, rule_backends},
    };

    /// The golden file's rules (proxy ports numbered from 40001 in order, as its test does).
    fn rendered() -> String {
        rendered_of(crate::testing::SERVICES, Family::V4)
    }

    fn rendered_of(fixture_text: &str, family: Family) -> String {
        let state = fixture(fixture_text);
        let ports = numbered_ports(&state, family);
        render(&state, &settings_of(family), &ports)
    }

    fn expected() -> Vec<(&'static str, &'static str, &'static str, Vec<String>)> {
        let proxy = |port: u16| vec![format!("192.0.2.11:{port} (proxy)")];
        vec![
            ("*:30080", "TCP", "NodePort", proxy(40004)),
            ("*:30081", "TCP", "NodePort", proxy(40006)),
            ("*:30082", "TCP", "NodePort", vec![]),
            ("*:30083", "TCP", "NodePort", vec![]),
            ("10.96.0.10:80", "TCP", "ClusterIP", proxy(40007)),
            ("10.96.0.20:80", "TCP", "ClusterIP", proxy(40004)),
            ("10.96.0.21:80", "TCP", "ClusterIP", proxy(40005)),
            ("10.96.0.22:80", "TCP", "ClusterIP", vec![]),
            ("10.96.0.23:80", "TCP", "ClusterIP", vec![]),
            ("10.96.0.53:53", "UDP", "ClusterIP", proxy(40001)),
            ("198.51.100.10:80", "TCP", "ExternalIP", proxy(40004)),
            ("203.0.113.10:80", "TCP", "ExternalIP", proxy(40004)),
            ("203.0.113.11:80", "TCP", "LoadBalancer", proxy(40006)),
        ]
    }

    fn check(rows: &[ServiceRow]) {
        let got: Vec<(&str, &str, &str, Vec<String>)> = rows
            .iter()
            .map(|r| {
                let backends = rule_backends(r).into_iter().map(str::to_owned).collect();
                (r.address.as_str(), r.protocol, r.kind, backends)
            })
            .collect();
        assert_eq!(got, expected());
        let local: Vec<&str> = rows
            .iter()
            .filter(|r| r.local_only)
            .map(|r| r.address.as_str())
            .collect();
        assert_eq!(local, ["*:30082", "10.96.0.22:80"]);
        let lb = rows.iter().find(|r| r.kind == "LoadBalancer").unwrap();
        assert_eq!(lb.source_ranges, ["192.0.2.0/24"]);
    }

    /// The rules as rendered now and as the golden file holds them (a layout change that
    /// breaks inspect fails here).
    #[test]
    fn services_of_the_golden_rules() {
        check(&services(&rendered()));
        check(&services(include_str!("testdata/rules.golden")));
    }

    /// Both families' rules of the dual-stack fixture, merged: IPv6 addresses in brackets, the
    /// NodePort of a Service port in both families one row with both proxies.
    #[test]
    fn services_of_both_families() {
        let dual = crate::testing::DUAL_STACK;
        let mut rows = services(&rendered_of(dual, Family::V4));
        rows.extend(services(&rendered_of(dual, Family::V6)));
        let rows = merge_families(rows);
        let find = |address: &str| {
            let row = rows.iter().find(|r| r.address == address);
            row.unwrap_or_else(|| panic!("no {address} in {rows:#?}"))
        };
        assert_eq!(find("[fd00:10:96::20]:80").kind, "ClusterIP");
        assert_eq!(find("10.96.0.20:80").kind, "ClusterIP");
        let node_port = find("*:30080");
        let backends = rule_backends(node_port);
        assert_eq!(backends.len(), 2, "{backends:?}");
        assert!(backends[0].starts_with("192.0.2.11:"), "{backends:?}");
        assert!(
            backends[1].starts_with("[2001:db8:192:2::11]:"),
            "{backends:?}"
        );
    }

    /// As iptables-save prints them back from the kernel, in both backends.
    #[test]
    fn services_read_back_from_the_kernel() {
        let test = "modes::userspace::inspect::tests::services_read_back_from_the_kernel";
        for saved in crate::testing::saved_in_each_backend(test, rendered) {
            check(&services(&saved));
        }
    }
}
