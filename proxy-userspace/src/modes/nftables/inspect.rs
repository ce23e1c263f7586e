//! The nftables mode's state, read back: `nft -j list table ip kube-proxy` (and `ip6`) parsed
//! into the rows the eBPF maps give, following the table as [`crate::modes::nftables::rules`]
//! writes it (kube-proxy's layout): the `service-ips` and `service-nodeports` verdict maps lead to a Service port's
//! `service-*`, `local-*` or `external-*` chain, whose `numgen` rules (kube-proxy's `numgen ...
//! vmap` too) and affinity rules lead to the `endpoint-*` chains and their `dnat to`;
//! `firewall-ips` to the source ranges; `no-endpoint-services` and `no-endpoint-nodeports` hold
//! the frontends refused or dropped.
//!
//! Tolerant: objects, rules and expressions it does not recognise are ignored.
use std::collections::{BTreeMap, HashMap};

use anyhow::Context;
use serde_json::Value;

use crate::{
    modes::nftables::rules::Table,
    netfilter::{conntrack, rules::source_ranges_of},
    rows::{
        BackendRow, ClientAffinityRow, Rows, ServiceRow, What, backend, host_port, merge_families,
        protocol, range, row,
    },
};

/// The parts of the table inspect reads.
#[derive(Default)]
struct Listed {
    /// Map name -> its elements (key, value).
    maps: HashMap<String, Vec<(Value, Value)>>,
    /// Set name -> its default timeout (seconds) and its elements.
    sets: HashMap<String, (Option<u64>, Vec<Value>)>,
    /// Chain name -> its rules' expressions, in order.
    chains: HashMap<String, Vec<Vec<Value>>>,
}

impl Listed {
    fn parse(json: &str) -> anyhow::Result<Self> {
        let doc: Value = serde_json::from_str(json).context("parsing nft's JSON")?;
        let mut table = Listed::default();
        let items = doc["nftables"].as_array().map(Vec::as_slice).unwrap_or(&[]);
        for item in items {
            let Some((kind, object)) = item.as_object().and_then(|o| o.iter().next()) else {
                continue;
            };
            let name = object["name"].as_str().unwrap_or_default().to_owned();
            let elements = || object["elem"].as_array().cloned().unwrap_or_default();
            match kind.as_str() {
                "map" => {
                    let pairs = elements()
                        .into_iter()
                        .filter_map(|e| match e {
                            Value::Array(mut kv) if kv.len() == 2 => {
                                let value = kv.pop()?;
                                Some((kv.pop()?, value))
                            }
                            _ => None,
                        })
                        .collect();
                    table.maps.insert(name, pairs);
                }
                "set" => {
                    let timeout = object["timeout"].as_u64();
                    table.sets.insert(name, (timeout, elements()));
                }
                "rule" => {
                    let chain = object["chain"].as_str().unwrap_or_default().to_owned();
                    let expr = object["expr"].as_array().cloned().unwrap_or_default();
                    table.chains.entry(chain).or_default().push(expr);
                }
                _ => {}
            }
        }
        Ok(table)
    }

    fn rules(&self, chain: &str) -> &[Vec<Value>] {
        self.chains.get(chain).map(Vec::as_slice).unwrap_or(&[])
    }

    fn map(&self, name: &str) -> &[(Value, Value)] {
        self.maps.get(name).map(Vec::as_slice).unwrap_or(&[])
    }

    /// The elements of the set `name`, plain values (not their timeouts or comments).
    fn set_values(&self, name: &str) -> Vec<&Value> {
        self.sets
            .get(name)
            .map(|(_, elems)| elems.iter().map(unwrap_elem).collect())
            .unwrap_or_default()
    }
}

/// An element's value without its comment, timeout or expiry (`{"elem": {"val": ...}}`).
fn unwrap_elem(v: &Value) -> &Value {
    match v.get("elem").and_then(|e| e.get("val")) {
        Some(val) => val,
        None => v,
    }
}

/// A frontend key: (address, protocol, port) from `addr . proto . port` (None address for a
/// NodePort's `proto . port`).
fn frontend(key: &Value) -> Option<(Option<String>, &'static str, u16)> {
    let parts = unwrap_elem(key).get("concat")?.as_array()?;
    let port = |v: &Value| v.as_u64().or_else(|| v.as_str()?.parse().ok());
    let proto = |v: &Value| match v {
        Value::Number(n) => protocol(&n.to_string()),
        Value::String(s) => protocol(s),
        _ => "?",
    };
    match parts.as_slice() {
        [addr, p, n] => Some((
            Some(addr.as_str()?.to_owned()),
            proto(p),
            port(n)?.try_into().ok()?,
        )),
        [p, n] => Some((None, proto(p), port(n)?.try_into().ok()?)),
        _ => None,
    }
}

/// A verdict: `goto`/`jump` and its chain, or `drop`, `accept`...
fn verdict(v: &Value) -> Option<(&str, Option<&str>)> {
    let (kind, body) = v.as_object()?.iter().next()?;
    match kind.as_str() {
        "goto" | "jump" => Some((kind, Some(body.get("target")?.as_str()?))),
        "drop" | "accept" | "reject" | "return" | "continue" => Some((kind, None)),
        _ => None,
    }
}

/// Every chain the expressions of a rule go to (a verdict, or the verdicts of a vmap).
fn targets(rule: &[Value]) -> Vec<&str> {
    let mut out = Vec::new();
    for expr in rule {
        if let Some((_, Some(target))) = verdict(expr) {
            out.push(target);
        }
        if let Some(set) = expr
            .get("vmap")
            .and_then(|m| m.get("data"))
            .and_then(|d| d.get("set"))
            .and_then(Value::as_array)
        {
            for element in set {
                if let Some((_, Some(target))) = element
                    .as_array()
                    .and_then(|kv| kv.get(1))
                    .and_then(verdict)
                {
                    out.push(target);
                }
            }
        }
    }
    out
}

/// A rule's only expression's jump target: a jump no packet escapes.
fn unconditional(rule: &[Value]) -> Option<&str> {
    match rule {
        [only] => verdict(only)?.1,
        _ => None,
    }
}

/// The `@set` names a rule matches or updates.
fn sets_used(rule: &[Value]) -> Vec<&str> {
    let mut out = Vec::new();
    for expr in rule {
        let named = [
            expr.get("match").and_then(|m| m.get("right")),
            expr.get("set").and_then(|s| s.get("set")),
        ];
        for name in named.into_iter().flatten().filter_map(Value::as_str) {
            if let Some(name) = name.strip_prefix('@') {
                out.push(name);
            }
        }
    }
    out
}

/// Whether a rule matches on `fib saddr type local` (the node's own traffic).
fn matches_fib(rule: &[Value]) -> bool {
    rule.iter().any(|e| {
        e.get("match")
            .and_then(|m| m.get("left"))
            .is_some_and(|l| l.get("fib").is_some())
    })
}

/// The address a `dnat to` rule translates to.
fn dnat(rule: &[Value]) -> Option<String> {
    rule.iter().find_map(|e| {
        let d = e.get("dnat")?;
        let addr = d.get("addr")?.as_str()?;
        let port = d.get("port").and_then(Value::as_u64);
        Some(match port.and_then(|p| u16::try_from(p).ok()) {
            Some(port) => host_port(addr, port),
            None => addr.to_owned(),
        })
    })
}

/// The protocol a rule matches with `meta l4proto`.
fn l4proto(rule: &[Value]) -> Option<&'static str> {
    rule.iter().find_map(|e| {
        let m = e.get("match")?;
        let key = m.get("left")?.get("meta")?.get("key")?.as_str()?;
        (key == "l4proto").then_some(())?;
        Some(protocol(m.get("right")?.as_str()?))
    })
}

/// The source ranges a firewall chain lets through: those of `ip saddr != { ... } drop`.
fn ranges(rules: &[Vec<Value>]) -> Vec<String> {
    let mut out = Vec::new();
    let prefix = |v: &Value| -> Option<String> {
        match v {
            Value::String(addr) => Some(range(addr)),
            _ => {
                let p = v.get("prefix")?;
                Some(format!("{}/{}", p.get("addr")?.as_str()?, p.get("len")?))
            }
        }
    };
    for rule in rules {
        for expr in rule {
            let Some(m) = expr.get("match") else { continue };
            if m.get("op").and_then(Value::as_str) != Some("!=") {
                continue;
            }
            match m.get("right") {
                Some(Value::Object(o)) if o.contains_key("set") => {
                    let set = o["set"].as_array().map(Vec::as_slice).unwrap_or(&[]);
                    out.extend(set.iter().filter_map(prefix));
                }
                Some(v) => out.extend(prefix(v)),
                None => {}
            }
        }
    }
    out
}

/// Where a frontend's chain leads: its endpoints and policies.
#[derive(Default)]
struct Resolved {
    backends: Vec<String>,
    local_only: bool,
    affinity_timeout_seconds: Option<u32>,
}

/// Follows `external-*` (the way in from outside: its last jump to a `service-*` or `local-*`
/// chain is the policy's) to the chain that picks an endpoint, to the `endpoint-*` chains.
fn resolve(table: &Listed, chain: &str) -> Resolved {
    let rules = table.rules(chain);
    if chain.starts_with("external-") {
        let policy = rules
            .iter()
            .filter_map(|r| unconditional(r))
            .rfind(|t| t.starts_with("service-") || t.starts_with("local-"));
        let mut resolved = policy.map(|p| resolve(table, p)).unwrap_or_default();
        // externalTrafficPolicy Local: the node's own traffic is handled apart.
        resolved.local_only |= rules.iter().any(|r| matches_fib(r));
        return resolved;
    }
    let mut resolved = Resolved {
        local_only: chain.starts_with("local-"),
        ..Resolved::default()
    };
    for rule in rules {
        for set in sets_used(rule) {
            if let Some((Some(timeout), _)) = table.sets.get(set) {
                resolved.affinity_timeout_seconds = u32::try_from(*timeout).ok();
            }
        }
        for target in targets(rule)
            .into_iter()
            .filter(|t| t.starts_with("endpoint-"))
        {
            let Some(endpoint) = table.rules(target).iter().find_map(|r| dnat(r)) else {
                continue;
            };
            if !resolved.backends.contains(&endpoint) {
                resolved.backends.push(endpoint);
            }
        }
    }
    resolved
}

/// The frontends of `json` (`nft -j list table ip kube-proxy`), each with its endpoints and
/// policies; frontends without endpoints (refused or dropped) without backends.
///
/// The table does not tell external IPs from load balancer IPs: a load balancer IP with
/// loadBalancerSourceRanges (in `firewall-ips`) shows as LoadBalancer, the others as ExternalIP.
pub fn services(json: &str) -> anyhow::Result<Vec<ServiceRow>> {
    let table = Listed::parse(json)?;
    let mut rows: BTreeMap<(String, &'static str), ServiceRow> = BTreeMap::new();
    let address = |addr: Option<String>, port: u16| match addr {
        Some(ip) => host_port(&ip, port),
        None => format!("*:{port}"),
    };
    let firewalled: HashMap<(String, &str), &str> = table
        .map("firewall-ips")
        .iter()
        .filter_map(|(key, value)| {
            let (addr, proto, port) = frontend(key)?;
            Some(((address(addr, port), proto), verdict(value)?.1?))
        })
        .collect();
    for map in ["service-ips", "service-nodeports"] {
        for (key, value) in table.map(map) {
            let (Some((addr, proto, port)), Some((_, Some(target)))) =
                (frontend(key), verdict(value))
            else {
                continue;
            };
            let node_port = addr.is_none();
            let address = address(addr, port);
            let kind = match (node_port, target.starts_with("external-")) {
                (true, _) => "NodePort",
                (false, false) => "ClusterIP",
                (false, true) if firewalled.contains_key(&(address.clone(), proto)) => {
                    "LoadBalancer"
                }
                (false, true) => "ExternalIP",
            };
            let resolved = resolve(&table, target);
            let mut row = row(address.clone(), proto, kind);
            row.backends = resolved
                .backends
                .into_iter()
                .map(|b| backend(b, proto))
                .collect();
            row.local_only = resolved.local_only;
            row.affinity_timeout_seconds = resolved.affinity_timeout_seconds;
            if let Some(firewall) = firewalled.get(&(address.clone(), proto)) {
                row.source_ranges = source_ranges_of(&address, ranges(table.rules(firewall)));
            }
            rows.entry((address, proto)).or_insert(row);
        }
    }
    // Refused (no endpoints) or dropped (none where a Local policy looks). A frontend with
    // externalTrafficPolicy Local and no local endpoint is in both maps (pods and the node
    // itself are still served): its row is the one above.
    let cluster_ips = table.set_values("cluster-ips");
    for map in ["no-endpoint-services", "no-endpoint-nodeports"] {
        for (key, value) in table.map(map) {
            let (Some((addr, proto, port)), Some((verdict, _))) = (frontend(key), verdict(value))
            else {
                continue;
            };
            let kind = match &addr {
                None => "NodePort",
                Some(ip) if cluster_ips.iter().any(|c| c.as_str() == Some(ip)) => "ClusterIP",
                Some(_) => "ExternalIP",
            };
            let address = address(addr, port);
            let mut row = row(address.clone(), proto, kind);
            row.local_only = verdict == "drop";
            rows.entry((address, proto)).or_insert(row);
        }
    }
    let mut rows: Vec<ServiceRow> = rows.into_values().collect();
    rows.sort();
    Ok(rows)
}

/// Every endpoint the table DNATs to (the `endpoint-*` chains).
pub fn backends(json: &str) -> anyhow::Result<Vec<BackendRow>> {
    let table = Listed::parse(json)?;
    let mut rows: Vec<BackendRow> = table
        .chains
        .iter()
        .filter(|(name, _)| name.starts_with("endpoint-"))
        .flat_map(|(_, rules)| rules)
        .filter_map(|r| Some(backend(dnat(r)?, l4proto(r).unwrap_or("?"))))
        .collect();
    rows.sort();
    rows.dedup();
    Ok(rows)
}

/// The Service port and endpoint of an `affinity-HASH-namespace/name/protocol/port__ip/port`
/// set, from its name: (`namespace/name:port`, protocol, `ip:port`).
fn affinity_name(set: &str) -> Option<(String, &'static str, String)> {
    let rest = set.strip_prefix("affinity-")?;
    let (_hash, rest) = rest.split_once('-')?;
    let (base, endpoint) = rest.rsplit_once("__")?;
    let mut parts = base.splitn(4, '/');
    let (namespace, name, proto, port) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let service = match port {
        "" => format!("{namespace}/{name}"),
        port => format!("{namespace}/{name}:{port}"),
    };
    // An IPv6 address has its colons as dots there (`fd00..1`).
    let endpoint = match endpoint.rsplit_once('/') {
        Some((ip, port)) if ip.matches('.').count() > 3 => {
            format!("[{}]:{port}", ip.replace('.', ":"))
        }
        Some((ip, port)) => format!("{ip}:{port}"),
        None => endpoint.to_owned(),
    };
    Some((service, protocol(proto), endpoint))
}

/// The session affinity the kernel remembers: the elements of the `affinity-*` sets, each a
/// client sent to the set's endpoint, with the seconds until it is forgotten.
pub fn affinity(json: &str) -> anyhow::Result<Vec<ClientAffinityRow>> {
    let table = Listed::parse(json)?;
    // The endpoint each set's chain DNATs to (the chain updates the set).
    let mut endpoints: HashMap<&str, String> = HashMap::new();
    for (chain, rules) in &table.chains {
        if !chain.starts_with("endpoint-") {
            continue;
        }
        let Some(to) = rules.iter().find_map(|r| dnat(r)) else {
            continue;
        };
        for set in rules.iter().flat_map(|r| sets_used(r)) {
            endpoints.insert(set, to.clone());
        }
    }
    let mut rows = Vec::new();
    for (set, (_, elements)) in &table.sets {
        let Some((service, protocol, from_name)) = affinity_name(set) else {
            continue;
        };
        let endpoint = endpoints.get(set.as_str()).cloned().unwrap_or(from_name);
        for element in elements {
            let Some(client) = unwrap_elem(element).as_str() else {
                continue;
            };
            rows.push(ClientAffinityRow {
                client: client.to_owned(),
                service: service.clone(),
                protocol,
                endpoint: endpoint.clone(),
                expires_seconds: element
                    .get("elem")
                    .and_then(|e| e.get("expires"))
                    .and_then(Value::as_u64),
            });
        }
    }
    rows.sort();
    Ok(rows)
}

/// `table`, as nft lists it in JSON.
pub(crate) fn nft_list(table: Table) -> anyhow::Result<String> {
    let (family, name) = table.name.split_once(' ').expect("family and name");
    crate::command::run("nft", &["-j", "list", "table", family, name], "nftables")
}

/// The rows `read` finds in each of `listed` (tables as nft lists them), together.
fn each<T: Ord>(
    listed: &[String],
    read: fn(&str) -> anyhow::Result<Vec<T>>,
) -> anyhow::Result<Vec<T>> {
    let mut rows = Vec::new();
    for json in listed {
        rows.extend(read(json)?);
    }
    rows.sort();
    rows.dedup();
    Ok(rows)
}

/// `what` of `tables` (the nftables mode's: [`crate::modes::nftables::rules::TABLES`]): the
/// first must exist, the others are read where they do (kube-proxy's IPv4-only clusters have
/// no IPv6 table).
pub fn read(what: What, tables: &[Table]) -> anyhow::Result<Rows> {
    let mut listed = Vec::new();
    for (i, table) in tables.iter().enumerate() {
        if i == 0 || crate::modes::nftables::exists(table.name) {
            listed.push(nft_list(*table)?);
        }
    }
    let services = || -> anyhow::Result<Vec<ServiceRow>> {
        let mut rows = Vec::new();
        for json in &listed {
            rows.extend(services(json)?);
        }
        Ok(merge_families(rows))
    };
    Ok(match what {
        What::Services => Rows::Services {
            rows: services()?,
            ids: false,
        },
        What::Backends => Rows::Backends {
            rows: each(&listed, backends)?,
            ids: false,
        },
        What::Conntrack => Rows::Conntrack(conntrack::service_flows(&services()?)?),
        What::Affinity => Rows::ClientAffinity(each(&listed, affinity)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        dataplane::Scope,
        modes::nftables::rules::{TABLE, render},
        testing::{fixture, rule_backends},
    };

    fn rendered() -> String {
        let settings = crate::testing::netfilter_settings();
        let state = fixture(crate::testing::SERVICES);
        render(&state, &settings, TABLE, None, Scope::All).text
    }

    /// The golden ruleset (nftables/testdata/ruleset.golden) as `nft -j` lists it: only nft
    /// turns the one into the other, so this file is checked against the rendered ruleset by
    /// the privileged test below, which rewrites it with UPDATE_GOLDEN=1.
    const LISTED: &str = include_str!("testdata/nftables.json");

    /// What the golden ruleset's Services (src/testdata/services.yaml, node1) show.
    fn expected() -> Vec<(&'static str, &'static str, &'static str, Vec<&'static str>)> {
        let web = vec!["10.244.1.11:8080", "10.244.1.12:8080", "10.244.2.11:8080"];
        let front = vec!["10.244.1.12:8080", "10.244.2.11:8080"];
        let local = vec!["10.244.1.13:8080", "10.244.2.13:8080"];
        vec![
            ("*:30080", "TCP", "NodePort", front.clone()),
            ("*:30081", "TCP", "NodePort", vec!["10.244.1.13:8080"]),
            // eTP Local, endpoints on node2 only: pods and the node itself use any endpoint,
            // the rest is dropped.
            ("*:30082", "TCP", "NodePort", vec![]),
            ("*:30083", "TCP", "NodePort", vec![]),
            ("10.96.0.10:80", "TCP", "ClusterIP", web),
            ("10.96.0.20:80", "TCP", "ClusterIP", front.clone()),
            ("10.96.0.21:80", "TCP", "ClusterIP", local),
            ("10.96.0.22:80", "TCP", "ClusterIP", vec![]),
            ("10.96.0.23:80", "TCP", "ClusterIP", vec![]),
            (
                "10.96.0.53:53",
                "UDP",
                "ClusterIP",
                vec!["10.244.1.53:53", "10.244.2.53:53"],
            ),
            ("198.51.100.10:80", "TCP", "ExternalIP", front.clone()),
            ("203.0.113.10:80", "TCP", "ExternalIP", front),
            (
                "203.0.113.11:80",
                "TCP",
                "LoadBalancer",
                vec!["10.244.1.13:8080"],
            ),
        ]
    }

    fn check(rows: &[ServiceRow]) {
        let got: Vec<(&str, &str, &str, Vec<&str>)> = rows
            .iter()
            .map(|r| (r.address.as_str(), r.protocol, r.kind, rule_backends(r)))
            .collect();
        assert_eq!(got, expected());
        let by = |a: &str| rows.iter().find(|r| r.address == a).unwrap();
        let local: Vec<&str> = rows
            .iter()
            .filter(|r| r.local_only)
            .map(|r| r.address.as_str())
            .collect();
        assert_eq!(
            local,
            ["*:30081", "*:30082", "10.96.0.22:80", "203.0.113.11:80"]
        );
        assert_eq!(by("10.96.0.53:53").affinity_timeout_seconds, Some(10800));
        assert_eq!(by("10.96.0.10:80").affinity_timeout_seconds, None);
        assert_eq!(by("203.0.113.11:80").source_ranges, ["192.0.2.0/24"]);
        assert!(
            rows.iter()
                .all(|r| r.address == "203.0.113.11:80" || r.source_ranges.is_empty())
        );
    }

    #[test]
    fn services_of_the_listed_golden_ruleset() {
        check(&services(LISTED).unwrap());
    }

    #[test]
    fn backends_and_affinity_of_the_listed_golden_ruleset() {
        let all: Vec<String> = backends(LISTED)
            .unwrap()
            .into_iter()
            .map(|b| format!("{} {}", b.protocol, b.address))
            .collect();
        assert_eq!(
            all,
            [
                "TCP 10.244.1.11:8080",
                "TCP 10.244.1.12:8080",
                "TCP 10.244.1.13:8080",
                "UDP 10.244.1.53:53",
                "TCP 10.244.2.11:8080",
                "TCP 10.244.2.13:8080",
                "TCP 10.244.2.14:8080",
                "UDP 10.244.2.53:53"
            ]
        );
        // The fixture's affinity set with one client, as nft lists a dynamic set's element.
        let mut doc: Value = serde_json::from_str(LISTED).unwrap();
        let set = doc["nftables"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .find(|i| {
                i["set"]["name"]
                    .as_str()
                    .is_some_and(|n| n.contains("10.244.1.53/53"))
            })
            .unwrap();
        set["set"]["elem"] =
            serde_json::json!([{"elem": {"val": "10.244.1.10", "expires": 10799}}]);
        assert_eq!(
            affinity(&doc.to_string()).unwrap(),
            [ClientAffinityRow {
                client: "10.244.1.10".into(),
                service: "kube-system/dns:dns".into(),
                protocol: "UDP",
                endpoint: "10.244.1.53:53".into(),
                expires_seconds: Some(10799),
            }]
        );
        assert_eq!(
            affinity_name("affinity-4S5KJQ3X-shop/front/tcp/__10.244.1.12/8080"),
            Some(("shop/front".into(), "TCP", "10.244.1.12:8080".into()))
        );
    }

    #[test]
    fn unknown_objects_and_expressions_are_ignored() {
        let json = r#"{"nftables": [{"metainfo": {}}, {"flowtable": {"name": "f"}},
            {"map": {"name": "service-ips", "elem": [
                [{"concat": ["10.96.0.10", "tcp", 80]}, {"goto": {"target": "service-X"}}],
                [{"concat": ["10.96.0.11"]}, {"goto": {"target": "service-X"}}],
                "junk"]}},
            {"rule": {"chain": "service-X", "expr": [{"counter": {}},
                {"vmap": {"key": {"numgen": {"mode": "random", "mod": 1}},
                          "data": {"set": [[0, {"goto": {"target": "endpoint-Y"}}]]}}}]}},
            {"rule": {"chain": "endpoint-Y", "expr": [{"xt": {}}, {"dnat": {"addr": "10.244.1.11", "port": 8080}}]}}
        ]}"#;
        let rows = services(json).unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rule_backends(&rows[0]), ["10.244.1.11:8080"]);
        assert!(services("not json").is_err());
    }

    /// The rendered ruleset through the kernel: written with `nft -f` in a network namespace
    /// of its own, listed with `nft -j`, parsed. Also checks (or with UPDATE_GOLDEN=1
    /// rewrites) the listed golden file the unprivileged tests read.
    #[test]
    fn services_read_back_from_the_kernel() {
        let test = "modes::nftables::inspect::tests::services_read_back_from_the_kernel";
        if !crate::testing::privileged(test, "nft") {
            return;
        }
        let listed = crate::testing::in_new_netns(|| {
            crate::command::pipe("nft", &["-f", "-"], &rendered())?;
            nft_list(TABLE)
        });
        check(&services(&listed).unwrap());
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("src/modes/nftables/testdata/nftables.json");
        // Handles and versions aside, the file is what nft lists now.
        let normalized = |json: &str| {
            let mut doc: Value = serde_json::from_str(json).unwrap();
            let items = doc["nftables"].as_array_mut().unwrap();
            items.retain(|i| i.get("metainfo").is_none());
            for item in items.iter_mut() {
                let Some(object) = item
                    .as_object_mut()
                    .and_then(|o| o.values_mut().next())
                    .and_then(Value::as_object_mut)
                else {
                    continue;
                };
                object.remove("handle");
                // The kernel lists elements in its own order.
                if let Some(Value::Array(elements)) = object.get_mut("elem") {
                    elements.sort_by_key(|e| e.to_string());
                }
            }
            doc
        };
        if std::env::var_os("UPDATE_GOLDEN").is_some() {
            // One object a line, for review.
            let doc = normalized(&listed);
            let items: Vec<String> = doc["nftables"]
                .as_array()
                .unwrap()
                .iter()
                .map(Value::to_string)
                .collect();
            let text = format!("{{\"nftables\": [\n{}\n]}}\n", items.join(",\n"));
            std::fs::write(&path, text).unwrap();
            return;
        }
        assert_eq!(
            normalized(&listed),
            normalized(LISTED),
            "{} is not what nft lists of the rendered ruleset (UPDATE_GOLDEN=1 rewrites it)",
            path.display()
        );
    }
}
