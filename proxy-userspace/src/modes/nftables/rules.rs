//! The nftables ruleset of a desired state, in kube-proxy's layout (its nftables proxier, 1.31
//! and later), as one `nft -f` transaction. A pure function of the state, the settings and what
//! the table holds now, so that the golden tests show every rule change in review.
//!
//! Everything lives in `table ip kube-proxy`, and the same for IPv6 in `table ip6 kube-proxy`
//! (kube-proxy's two proxiers: each table serves the Service ports with a cluster IP of its
//! family, with their addresses, source ranges and endpoints of that family). Its base chains hook into netfilter: the
//! `filter-*` ones before DNAT (they see the frontend a packet was sent to), `nat-*` for the
//! translation. New connections are looked up by (address, protocol, port) in verdict maps:
//! `service-ips` (cluster, external and load balancer IPs) and `service-nodeports` (the
//! NodePorts, on the `nodeport-ips` set or every local address) from the `services` chain;
//! `no-endpoint-services` / `no-endpoint-nodeports` (REJECT through `reject-chain`, or DROP where
//! a Local policy has no local endpoint) from the `*-endpoints-check` chains; `firewall-ips`
//! (loadBalancerSourceRanges) from `firewall-check`; `cluster-ips` rejects a cluster IP's
//! undefined ports. A map element jumps to the Service port's own chains, named as kube-proxy
//! names them (`service-`, `local-`, `external-`, `firewall-`, `endpoint-` and the set
//! `affinity-`, then `HASH-namespace/name/protocol/port`): `service-*` (cluster endpoints) and
//! `local-*` (this node's) pick an endpoint with one `numgen random mod N == 0` rule each (not
//! kube-proxy's anonymous `vmap`, which makes the kernel's transactions quadratic: see
//! `endpoint_jumps`), or the one a client used last while its `affinity-*` set remembers it;
//! `endpoint-*` DNATs; `external-*` is the way in from outside (masquerade, or for
//! externalTrafficPolicy Local the client kept); `firewall-*` drops sources outside the ranges.
//! Traffic that must leave with the node's address is marked (`mark-for-masquerade`) and
//! masqueraded in `masquerading`.
//!
//! Syncs are incremental, as kube-proxy's are: [`Programmed`] records, per Service port, the
//! chains, sets and map elements written for it, and a sync of a few changed Service ports
//! rewrites only their chains and adds or deletes only their elements. A full sync with a
//! record rewrites everything in place (the affinity sets keep their entries); without one
//! (the agent's first sync, or after a failed one) the table is deleted and written anew in the
//! same transaction, whatever an earlier run left in it. Chains no longer used are deleted in
//! the transaction that removes the last rule and element pointing to them (kube-proxy waits a
//! second and uses another one, for kernels before 6.2 that could still count them as used).
//!
//! Unlike the iptables mode there is no accept for health check node ports or forwarded
//! traffic: an nftables accept ends only this table's base chain, it cannot override another
//! table's drop (kube-proxy's nftables mode has none either).
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
};

use crate::{
    dataplane::Scope,
    model::{Cidr, DesiredState, Endpoint, Family, ServicePort, ServicePortName},
    netfilter::rules::{MASQ_MARK, Settings, hash16},
};

/// The IPv4 table, as nft commands name it.
pub const TABLE: Table = Table {
    family: Family::V4,
    name: "ip kube-proxy",
    comment: "kube-proxy's Services (kube-proxy-ebpf, nftables mode)",
    checks_cluster_ips: true,
};

/// The IPv6 one.
pub const TABLE6: Table = Table {
    family: Family::V6,
    name: "ip6 kube-proxy",
    ..TABLE
};

/// The nftables mode's tables, one a family.
pub const TABLES: [Table; 2] = [TABLE, TABLE6];

/// An nftables table the rules are written to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Table {
    /// The family of the addresses it serves (its nftables family: `ip` or `ip6`).
    pub family: Family,
    /// Family and name, as nft commands take them.
    pub name: &'static str,
    pub comment: &'static str,
    /// Whether traffic to a cluster IP at a port no Service has is rejected, and traffic to an
    /// unallocated cluster IP in the state's Service CIDRs dropped (kube-proxy's
    /// `cluster-ips-check`): by the table that serves every protocol.
    pub checks_cluster_ips: bool,
}

/// The base chains: name, type, hook, priority; kube-proxy's. The source ranges are checked
/// before DNAT (-100), on the frontend; the endpoint and cluster-IP checks after it (filter,
/// 0), so that what DNAT sent elsewhere (a pod's or the node's connection to an
/// externalTrafficPolicy Local frontend without local endpoints, which goes to any endpoint)
/// no longer meets them.
const BASE_CHAINS: &[(&str, &str, &str, i32)] = &[
    ("filter-prerouting-pre-dnat", "filter", "prerouting", -110),
    ("filter-output-pre-dnat", "filter", "output", -110),
    ("filter-input", "filter", "input", 0),
    ("filter-forward", "filter", "forward", 0),
    ("filter-output", "filter", "output", 0),
    ("nat-prerouting", "nat", "prerouting", -100),
    ("nat-output", "nat", "output", -100),
    ("nat-postrouting", "nat", "postrouting", 100),
];

/// The jumps from the base chains: from, for new connections only, to (kube-proxy's). The
/// endpoint checks are not in a prerouting chain: `reject` is valid only on the input, forward
/// and output hooks (before kernel 5.9).
#[rustfmt::skip]
const JUMPS: &[(&str, bool, &str)] = &[
    ("filter-prerouting-pre-dnat", true, "firewall-check"),
    ("filter-output-pre-dnat", true, "firewall-check"),
    ("filter-input", true, "nodeport-endpoints-check"),
    ("filter-input", true, "service-endpoints-check"),
    ("filter-forward", true, "service-endpoints-check"),
    ("filter-output", true, "service-endpoints-check"),
    ("filter-forward", true, "cluster-ips-check"),
    ("filter-output", true, "cluster-ips-check"),
    ("nat-output", false, "services"),
    ("nat-prerouting", false, "services"),
    ("nat-postrouting", false, "masquerading"),
];

/// The other chains every sync has.
const FIXED_CHAINS: &[&str] = &[
    "nodeport-endpoints-check",
    "service-endpoints-check",
    "firewall-check",
    "services",
    "masquerading",
    "cluster-ips-check",
    "mark-for-masquerade",
    "reject-chain",
];

const CLUSTER_IPS: &str = "cluster-ips";
const NODEPORT_IPS: &str = "nodeport-ips";
const SERVICE_IPS: &str = "service-ips";
const SERVICE_NODEPORTS: &str = "service-nodeports";
const NO_ENDPOINT_SERVICES: &str = "no-endpoint-services";
const NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
const FIREWALL_IPS: &str = "firewall-ips";

/// An address (its type: `ipv4_addr` or `ipv6_addr`, by the table's family).
const ADDR: &str = "ADDR";
const IP_PORT_VERDICT: &str = "ADDR . inet_proto . inet_service : verdict";
const PORT_VERDICT: &str = "inet_proto . inet_service : verdict";

/// The sets and maps filled per Service port: kind, name, type, comment.
#[rustfmt::skip]
const CONTAINERS: &[(&str, &str, &str, &str)] = &[
    ("set", CLUSTER_IPS, ADDR, "cluster IPs of the Services"),
    ("map", SERVICE_IPS, IP_PORT_VERDICT, "cluster, external and load balancer IPs"),
    ("map", SERVICE_NODEPORTS, PORT_VERDICT, "NodePorts"),
    ("map", NO_ENDPOINT_SERVICES, IP_PORT_VERDICT, "frontends without endpoints: reject or drop"),
    ("map", NO_ENDPOINT_NODEPORTS, PORT_VERDICT, "NodePorts without endpoints: reject or drop"),
    ("map", FIREWALL_IPS, IP_PORT_VERDICT, "load balancer IPs with loadBalancerSourceRanges"),
];

/// A map or set element as `delete element` names it: its container and key.
type ElementKey = (&'static str, String);

/// What the table holds for the Service ports, as the last successful sync left it.
#[derive(Clone, Debug, PartialEq)]
pub struct Programmed {
    settings: Settings,
    /// The Service CIDRs the fixed rules drop unallocated cluster IPs of.
    service_cidrs: Vec<String>,
    ports: BTreeMap<ServicePortName, PortObjects>,
    /// Every element with the Service ports that want it and what each wants after its key
    /// (comment, verdict); the first port's is written. Several ports want one element: every
    /// port of a Service its cluster IP in `cluster-ips`, and Services that claim the same
    /// frontend (the first one serves it).
    elements: BTreeMap<ElementKey, Vec<(ServicePortName, String)>>,
}

/// The objects of one Service port.
#[derive(Clone, Debug, Default, PartialEq)]
struct PortObjects {
    chains: BTreeSet<String>,
    /// The affinity sets, and the timeout they were created with.
    affinity: BTreeSet<String>,
    affinity_timeout: u32,
    elements: Vec<ElementKey>,
}

impl Programmed {
    /// Whether the table holds no Service port.
    pub fn is_empty(&self) -> bool {
        self.ports.is_empty()
    }

    /// The per-Service-port chains in the table.
    pub fn chains(&self) -> impl Iterator<Item = &str> {
        self.ports
            .values()
            .flat_map(|p| p.chains.iter().map(String::as_str))
    }
}

/// A transaction, and what the table holds once it is committed.
pub struct Rendered {
    /// The `nft -f` input; empty when nothing changed.
    pub text: String,
    pub programmed: Programmed,
}

/// The parts of a transaction, in the order they must run: the fixed objects; each Service
/// port's chains and sets (flushed, rewritten); the elements that go, then those that come
/// (pointing to chains declared above); last the chains no longer referred to.
#[derive(Default)]
struct Transaction {
    head: String,
    ports: String,
    deleted: String,
    added: String,
    tail: String,
}

/// The transaction that makes the table serve `state`. `programmed`: what the table holds now
/// (None: unknown, the table is written anew); `scope`: the Service ports that changed since.
/// Settings different from the programmed ones write the table anew too.
pub fn render(
    state: &DesiredState,
    settings: &Settings,
    table: Table,
    programmed: Option<Programmed>,
    scope: Scope<'_>,
) -> Rendered {
    debug_assert_eq!(settings.family, table.family);
    let t = table.name;
    let family = Nft::of(table.family);
    let cidrs: Vec<String> = match table.checks_cluster_ips {
        true => (state.service_cidrs().iter())
            .filter(|c| c.family() == table.family)
            .map(ToString::to_string)
            .collect(),
        false => Vec::new(),
    };
    let mut tx = Transaction::default();
    let (mut programmed, ports): (Programmed, BTreeSet<ServicePortName>) = match programmed {
        Some(p) if p.settings == *settings => match scope {
            Scope::Changed(changed) if p.service_cidrs == cidrs => (p, changed.clone()),
            // Everything, in place (a Service CIDR change too: affinity sets keep their
            // entries).
            _ => {
                fixed(&mut tx.head, settings, table, &cidrs, true);
                let mut p = p;
                p.service_cidrs.clone_from(&cidrs);
                // The sets and maps were flushed above: every element is written again.
                p.elements.clear();
                let all = state.port_names().chain(p.ports.keys()).cloned().collect();
                (p, all)
            }
        },
        // Whatever the table holds (an earlier run's leftovers, objects of an older layout):
        // gone, in the same transaction that writes it again. Adding first makes the delete
        // valid when there is no table.
        _ => {
            let _ = writeln!(tx.head, "add table {t}");
            let _ = writeln!(tx.head, "delete table {t}");
            fixed(&mut tx.head, settings, table, &cidrs, false);
            let fresh = Programmed {
                settings: settings.clone(),
                service_cidrs: cidrs.clone(),
                ports: BTreeMap::new(),
                elements: BTreeMap::new(),
            };
            (fresh, state.port_names().cloned().collect())
        }
    };

    // The element each touched key showed before this transaction.
    let mut before: BTreeMap<ElementKey, Option<String>> = BTreeMap::new();
    for spn in &ports {
        let old = programmed.ports.remove(spn).unwrap_or_default();
        let new = state
            .port(spn)
            .map(|port| service_port(state, settings, family, spn, port))
            .unwrap_or_default();
        let out = &mut tx.ports;
        // First, so that nothing refers to the sets and chains replaced below.
        for chain in &old.chains {
            let _ = writeln!(out, "flush chain {t} {chain}");
        }
        // An affinity set keeps its entries unless its timeout changed.
        let kept: BTreeSet<&String> = if old.affinity_timeout == new.affinity_timeout {
            old.affinity.intersection(&new.affinity).collect()
        } else {
            BTreeSet::new()
        };
        for set in old.affinity.iter().filter(|s| !kept.contains(s)) {
            let _ = writeln!(out, "delete set {t} {set}");
        }
        for set in new.affinity.iter().filter(|s| !kept.contains(s)) {
            let _ = writeln!(
                out,
                "add set {t} {set} {{ type {} ; flags dynamic,timeout ; timeout {}s ; }}",
                family.addr_type, new.affinity_timeout
            );
        }
        for (chain, _) in &new.chains {
            if !old.chains.contains(chain) {
                let _ = writeln!(out, "add chain {t} {chain}");
            }
        }
        for (chain, rules) in &new.chains {
            for rule in rules {
                let _ = writeln!(out, "add rule {t} {chain} {rule}");
            }
        }
        let chains: BTreeSet<String> = new.chains.into_iter().map(|(c, _)| c).collect();
        for chain in old.chains.difference(&chains) {
            let _ = writeln!(tx.tail, "delete chain {t} {chain}");
        }

        for key in &old.elements {
            before
                .entry(key.clone())
                .or_insert_with(|| winner(&programmed.elements, key));
            if let Some(owners) = programmed.elements.get_mut(key) {
                owners.retain(|(owner, _)| owner != spn);
                if owners.is_empty() {
                    programmed.elements.remove(key);
                }
            }
        }
        let mut keys = Vec::with_capacity(new.elements.len());
        for (key, rest) in new.elements {
            before
                .entry(key.clone())
                .or_insert_with(|| winner(&programmed.elements, &key));
            let owners = programmed.elements.entry(key.clone()).or_default();
            match owners.binary_search_by(|(owner, _)| owner.cmp(spn)) {
                Ok(i) => owners[i].1 = rest,
                Err(i) => owners.insert(i, (spn.clone(), rest)),
            }
            keys.push(key);
        }
        if state.contains(spn) {
            keys.sort();
            keys.dedup();
            programmed.ports.insert(
                spn.clone(),
                PortObjects {
                    chains,
                    affinity: new.affinity,
                    affinity_timeout: new.affinity_timeout,
                    elements: keys,
                },
            );
        }
    }

    for (key, was) in before {
        let now = winner(&programmed.elements, &key);
        if was == now {
            continue;
        }
        let (container, key) = key;
        if was.is_some() {
            let _ = writeln!(tx.deleted, "delete element {t} {container} {{ {key} }}");
        }
        if let Some(rest) = now {
            let _ = writeln!(tx.added, "add element {t} {container} {{ {key}{rest} }}");
        }
    }

    let Transaction {
        head,
        ports,
        deleted,
        added,
        tail,
    } = tx;
    Rendered {
        text: [head, ports, deleted, added, tail].concat(),
        programmed,
    }
}

/// What the element `key` says: the first of the ports that want it.
fn winner(
    elements: &BTreeMap<ElementKey, Vec<(ServicePortName, String)>>,
    key: &ElementKey,
) -> Option<String> {
    elements.get(key)?.first().map(|(_, rest)| rest.clone())
}

/// How the rules of a family say things.
#[derive(Clone, Copy)]
struct Nft {
    /// The address match's protocol: `ip` or `ip6` (`ip6 saddr`).
    ip: &'static str,
    addr_type: &'static str,
    loopback: &'static str,
}

impl Nft {
    fn of(family: Family) -> Self {
        match family {
            Family::V4 => Nft {
                ip: "ip",
                addr_type: "ipv4_addr",
                loopback: "127.0.0.0/8",
            },
            Family::V6 => Nft {
                ip: "ip6",
                addr_type: "ipv6_addr",
                loopback: "::1",
            },
        }
    }
}

/// The table and its fixed objects; `in_place`: they may exist already, and are emptied.
fn fixed(out: &mut String, settings: &Settings, table: Table, cidrs: &[String], in_place: bool) {
    let t = table.name;
    let Nft {
        ip,
        addr_type,
        loopback,
    } = Nft::of(table.family);
    let _ = writeln!(out, "add table {t} {{ comment \"{}\" ; }}", table.comment);
    for (name, kind, hook, priority) in BASE_CHAINS {
        let _ = writeln!(
            out,
            "add chain {t} {name} {{ type {kind} hook {hook} priority {priority} ; }}"
        );
    }
    for name in FIXED_CHAINS {
        let _ = writeln!(out, "add chain {t} {name}");
    }
    for (kind, name, what, comment) in CONTAINERS {
        let what = what.replace(ADDR, addr_type);
        let _ = writeln!(
            out,
            "add {kind} {t} {name} {{ type {what} ; comment \"{comment}\" ; }}"
        );
    }
    if settings.node_port_addresses.is_some() {
        let _ = writeln!(
            out,
            "add set {t} {NODEPORT_IPS} {{ type {addr_type} ; comment \"node addresses that NodePorts answer on\" ; }}"
        );
    }
    if in_place {
        let chains = BASE_CHAINS
            .iter()
            .map(|c| c.0)
            .chain(FIXED_CHAINS.iter().copied());
        for name in chains {
            let _ = writeln!(out, "flush chain {t} {name}");
        }
        for (kind, name, _, _) in CONTAINERS {
            let _ = writeln!(out, "flush {kind} {t} {name}");
        }
        if settings.node_port_addresses.is_some() {
            let _ = writeln!(out, "flush set {t} {NODEPORT_IPS}");
        }
    }

    let mut rule = |chain: &str, rule: &str| {
        let _ = writeln!(out, "add rule {t} {chain} {rule}");
    };
    for (from, new_only, to) in JUMPS {
        let ct = if *new_only { "ct state new " } else { "" };
        rule(from, &format!("{ct}jump {to}"));
    }
    rule(
        "mark-for-masquerade",
        &format!("mark set mark or {MASQ_MARK}"),
    );
    rule("masquerading", &format!("mark and {MASQ_MARK} == 0 return"));
    // Cleared, so that a packet traversing the rules again is not masqueraded again.
    rule("masquerading", &format!("mark set mark xor {MASQ_MARK}"));
    rule("masquerading", "masquerade fully-random");
    rule("reject-chain", "reject");
    // After DNAT: a cluster IP still there was sent to a port no Service port defines.
    if table.checks_cluster_ips {
        rule(
            "cluster-ips-check",
            &format!("{ip} daddr @{CLUSTER_IPS} reject comment \"undefined port of a cluster IP\""),
        );
    }
    // Then, past every allocated one, a cluster IP no Service has (kube-proxy's rule, from the
    // ServiceCIDR objects).
    if !cidrs.is_empty() {
        rule(
            "cluster-ips-check",
            &format!(
                "{ip} daddr {{ {} }} drop comment \"drop traffic to unallocated cluster IPs\"",
                cidrs.join(", ")
            ),
        );
    }
    let by_frontend = &format!("{ip} daddr . meta l4proto . th dport vmap");
    rule("services", &format!("{by_frontend} @{SERVICE_IPS}"));
    rule(
        "service-endpoints-check",
        &format!("{by_frontend} @{NO_ENDPOINT_SERVICES}"),
    );
    rule("firewall-check", &format!("{by_frontend} @{FIREWALL_IPS}"));
    let by_port = "meta l4proto . th dport vmap";
    match &settings.node_port_addresses {
        // Never on loopback (CVE-2020-8558). nodeport-endpoints-check runs on the input hook
        // only: the address is local there.
        None => {
            let local = format!("fib daddr type local {ip} daddr != {loopback}");
            rule(
                "services",
                &format!("{local} {by_port} @{SERVICE_NODEPORTS}"),
            );
            rule(
                "nodeport-endpoints-check",
                &format!("{ip} daddr != {loopback} {by_port} @{NO_ENDPOINT_NODEPORTS}"),
            );
        }
        Some(addrs) => {
            let on = format!("{ip} daddr @{NODEPORT_IPS}");
            rule("services", &format!("{on} {by_port} @{SERVICE_NODEPORTS}"));
            rule(
                "nodeport-endpoints-check",
                &format!("{on} {by_port} @{NO_ENDPOINT_NODEPORTS}"),
            );
            if !addrs.is_empty() {
                let addrs: Vec<String> = addrs.iter().map(IpAddr::to_string).collect();
                let _ = writeln!(
                    out,
                    "add element {t} {NODEPORT_IPS} {{ {} }}",
                    addrs.join(", ")
                );
            }
        }
    }
}

/// kube-proxy's name of a Service port's object: `prefix`, the first 8 characters of the
/// base32 of the SHA-256 of `name`, `-`, `name`. (kube-proxy truncates names longer than 240
/// characters; with the API's name lengths none is longer than 204.)
fn named(prefix: &str, name: &str) -> String {
    format!("{prefix}{}-{name}", &hash16(name)[..8])
}

/// What a Service port's object names are made of: `namespace/name/protocol/port`.
fn port_base(spn: &ServicePortName) -> String {
    let proto = spn.protocol.keyword();
    format!(
        "{}/{}/{proto}/{}",
        spn.service.namespace, spn.service.name, spn.port
    )
}

/// The chains, affinity sets and elements of one Service port.
#[derive(Default)]
struct PortRules {
    /// In the order written, each with its rules.
    chains: Vec<(String, Vec<String>)>,
    affinity: BTreeSet<String>,
    affinity_timeout: u32,
    /// Each with what follows its key (comment, verdict).
    elements: Vec<(ElementKey, String)>,
}

impl PortRules {
    fn element(&mut self, container: &'static str, key: String, rest: String) {
        self.elements.push(((container, key), rest));
    }
}

/// An endpoint a policy chain jumps to, its chain and its affinity set.
struct Target {
    ip: IpAddr,
    port: u16,
    chain: String,
    affinity: String,
}

/// The ones of `endpoints` in `family` of the Service port whose name base is `base`.
fn targets(base: &str, family: Family, endpoints: &[&Endpoint]) -> Vec<Target> {
    endpoints
        .iter()
        .filter(|ep| family.has(ep.ip))
        .map(|ep| {
            // An nftables name has no colons: kube-proxy's `__fd00..1/80` for [fd00::1]:80.
            let ip = ep.ip.to_string().replace(':', ".");
            let name = format!("{base}__{ip}/{}", ep.port);
            Target {
                ip: ep.ip,
                port: ep.port,
                chain: named("endpoint-", &name),
                affinity: named("affinity-", &name),
            }
        })
        .collect()
}

/// The objects of one Service port in the table of `settings.family` (kube-proxy's per-port
/// part of `syncProxyRules`): none where the port has no cluster IP of the family.
fn service_port(
    state: &DesiredState,
    settings: &Settings,
    nft: Nft,
    spn: &ServicePortName,
    port: &ServicePort,
) -> PortRules {
    let family = settings.family;
    if !port.in_family(family) {
        return PortRules::default();
    }
    let ip = nft.ip;
    let name = spn.to_string();
    let proto = port.protocol.keyword();
    let base = port_base(spn);
    let cluster_chain = named("service-", &base);
    let local_chain = named("local-", &base);
    let external_chain = named("external-", &base);
    let firewall_chain = named("firewall-", &base);
    let cluster_ips = family.filter(&port.cluster_ips);
    let external_ips = family.filter(&port.external_ips);
    let lb_ips = family.filter(&port.load_balancer_ips);
    // The load balancer's own addresses too where the ranges admit the node (kube-proxy's
    // allowFromNode).
    let own_ips = settings
        .admits_load_balancer_ips(&port.source_ranges)
        .then_some(&lb_ips);
    let ranges: Vec<String> = (port.source_ranges.iter())
        .filter(|range| range.family() == family)
        .map(Cidr::to_string)
        .chain(own_ips.into_iter().flatten().map(ToString::to_string))
        .collect();
    let has_external = port.node_port.is_some() || !external_ips.is_empty() || !lb_ips.is_empty();
    let (itl, etl) = (port.internal_traffic_local, port.external_traffic_local);

    let cluster = targets(&base, family, &state.usable_endpoints(spn, false));
    let local = targets(&base, family, &state.usable_endpoints(spn, true));
    let has_endpoints = !cluster.is_empty();
    let has_internal = has_endpoints && !(itl && local.is_empty());
    let has_external_endpoints = has_endpoints && !(etl && local.is_empty());
    // With externalTrafficPolicy Local the cluster chain still serves pods and the node itself
    // (the short-circuit below), as kube-proxy's UsesClusterEndpoints.
    let uses_cluster = has_endpoints && (!itl || has_external);
    let uses_local = !local.is_empty() && (itl || (has_external && etl));
    let uses_external = has_endpoints && has_external;
    let firewall = !lb_ips.is_empty() && !ranges.is_empty();
    let internal_chain = if itl { &local_chain } else { &cluster_chain };
    let external_policy_chain = if etl { &local_chain } else { &cluster_chain };
    // No endpoint anywhere: refused at once. None where a Local policy looks, but elsewhere:
    // dropped (a retry may reach a node that has one).
    let refuse = format!(
        " comment \"{name}\" : {}",
        if has_endpoints {
            "drop"
        } else {
            "goto reject-chain"
        }
    );
    let goto = |chain: &str| format!(" : goto {chain}");

    let mut p = PortRules {
        affinity_timeout: port.session_affinity_timeout.map_or(0, u32::from),
        ..PortRules::default()
    };
    let frontend = |ip: &IpAddr| format!("{ip} . {proto} . {}", port.port);
    for ip in &cluster_ips {
        p.element(CLUSTER_IPS, ip.to_string(), String::new());
        if has_internal {
            p.element(SERVICE_IPS, frontend(ip), goto(internal_chain));
        } else {
            p.element(NO_ENDPOINT_SERVICES, frontend(ip), refuse.clone());
        }
    }
    // A frontend can be in both maps: eTP Local without local endpoints still serves pods and
    // the node itself (nat), and drops the rest (filter, which sees only what nat left).
    for ip in external_ips.iter().chain(&lb_ips) {
        if has_endpoints {
            p.element(SERVICE_IPS, frontend(ip), goto(&external_chain));
        }
        if !has_external_endpoints {
            p.element(NO_ENDPOINT_SERVICES, frontend(ip), refuse.clone());
        }
    }
    if firewall {
        for ip in &lb_ips {
            p.element(FIREWALL_IPS, frontend(ip), goto(&firewall_chain));
        }
    }
    if let Some(node_port) = port.node_port {
        let key = format!("{proto} . {node_port}");
        if has_endpoints {
            p.element(SERVICE_NODEPORTS, key.clone(), goto(&external_chain));
        }
        if !has_external_endpoints {
            p.element(NO_ENDPOINT_NODEPORTS, key, refuse.clone());
        }
    }

    // Connections to a cluster IP from outside the pod network are masqueraded: their
    // replies must come back through this node.
    let masquerade: Vec<String> = cluster_ips
        .iter()
        .filter(|_| has_internal)
        .filter_map(|vip| {
            let from = if settings.masquerade_all {
                String::new()
            } else {
                let cluster_cidr = settings.cluster_cidr?;
                format!(" {ip} saddr != {cluster_cidr}")
            };
            Some(format!(
                "{ip} daddr {vip} {proto} dport {}{from} jump mark-for-masquerade",
                port.port
            ))
        })
        .collect();
    let affinity = port.session_affinity_timeout.is_some();
    if uses_cluster {
        let mut rules = if itl { Vec::new() } else { masquerade.clone() };
        rules.extend(endpoint_jumps(ip, &cluster, affinity));
        p.chains.push((cluster_chain.clone(), rules));
    }
    if uses_local {
        let mut rules = if itl { masquerade } else { Vec::new() };
        rules.extend(endpoint_jumps(ip, &local, affinity));
        p.chains.push((local_chain.clone(), rules));
    }
    if uses_external {
        let mut rules = Vec::new();
        if !etl {
            rules.push("jump mark-for-masquerade".to_owned());
        } else {
            // Pods and the node itself are inside the cluster: any endpoint, as for the cluster
            // IP (kube-proxy's short-circuit); the node's own traffic masqueraded, as its source
            // is the frontend's own address.
            if let Some(cluster_cidr) = settings.cluster_cidr {
                rules.push(format!(
                    "{ip} saddr {cluster_cidr} goto {cluster_chain} comment \"pods: any endpoint\""
                ));
            }
            rules.push(
                "fib saddr type local jump mark-for-masquerade comment \"this node: masqueraded\""
                    .to_owned(),
            );
            rules.push(format!(
                "fib saddr type local goto {cluster_chain} comment \"this node: any endpoint\""
            ));
        }
        if has_external_endpoints {
            rules.push(format!("goto {external_policy_chain}"));
        }
        p.chains.push((external_chain, rules));
    }
    if firewall {
        let rule = format!("{ip} saddr != {{ {} }} drop", ranges.join(", "));
        p.chains.push((firewall_chain, vec![rule]));
    }
    // Endpoints in both lists have one chain.
    let used = (uses_cluster.then_some(&cluster).into_iter().flatten())
        .chain(uses_local.then_some(&local).into_iter().flatten());
    let mut seen = BTreeSet::new();
    for target in used {
        if !seen.insert(&target.chain) {
            continue;
        }
        let mut rules = vec![format!("{ip} saddr {} jump mark-for-masquerade", target.ip)];
        if affinity {
            p.affinity.insert(target.affinity.clone());
            rules.push(format!("update @{} {{ {ip} saddr }}", target.affinity));
        }
        rules.push(format!(
            "meta l4proto {proto} dnat to {}",
            SocketAddr::new(target.ip, target.port)
        ));
        p.chains.push((target.chain.clone(), rules));
    }
    p
}

/// A policy chain's jumps to its endpoints: to the one a client used last while its affinity
/// set remembers it, else one at random.
fn endpoint_jumps(ip: &str, targets: &[Target], affinity: bool) -> Vec<String> {
    let mut rules = Vec::new();
    if affinity {
        for t in targets {
            rules.push(format!("{ip} saddr @{} goto {}", t.affinity, t.chain));
        }
    }
    // One rule an endpoint, as the iptables mode's statistic rules: of the n left, the first
    // is taken one time in n, so each endpoint gets an equal share. Not kube-proxy's single
    // `numgen random mod N vmap { 0 : goto ..., }`: each such rule holds an anonymous map, and
    // the kernel (6.x) binds each anonymous map by walking the whole transaction and names it
    // by walking the table's sets, so a full sync of 10k Services took 36 to 70 s in the
    // kernel, holding the nftables lock of the node; with these rules, 3 s.
    for (i, t) in targets.iter().enumerate() {
        rules.push(match targets.len() - i {
            1 => format!("goto {}", t.chain),
            left => format!("numgen random mod {left} == 0 goto {}", t.chain),
        });
    }
    rules
}

#[cfg(test)]
pub(super) mod tests {
    use std::{io::Write as _, net::Ipv4Addr, process::Command};

    use super::*;
    use crate::{
        model::{NamespacedName, Placement, Protocol},
        modes::nftables::tests::privileged,
        testing::{fixture, golden},
    };

    pub(in crate::modes::nftables) const FIXTURE: &str = crate::testing::SERVICES;

    fn settings() -> Settings {
        crate::testing::netfilter_settings()
    }

    fn spn(namespace: &str, name: &str, port: &str, protocol: Protocol) -> ServicePortName {
        ServicePortName::new(NamespacedName::new(namespace, name), port, protocol)
    }

    fn web() -> ServicePortName {
        spn("shop", "web", "http", Protocol::Tcp)
    }

    fn dns() -> ServicePortName {
        spn("kube-system", "dns", "dns", Protocol::Udp)
    }

    /// The fixture a sync later: shop/web lost an endpoint, kube-system/dns is gone.
    fn changed(mut state: DesiredState) -> (DesiredState, BTreeSet<ServicePortName>) {
        let gone: IpAddr = Ipv4Addr::new(10, 244, 2, 11).into();
        state.edit_endpoints(&web(), |eps| eps.retain(|ep| ep.ip != gone));
        state.remove_port(&dns());
        (state, BTreeSet::from([web(), dns()]))
    }

    #[test]
    fn ruleset_matches_the_golden_file() {
        let rendered = render(&fixture(FIXTURE), &settings(), TABLE, None, Scope::All);
        golden("modes/nftables", "ruleset.golden", &rendered.text);
    }

    /// Both families' tables, as the dataplane writes them in one transaction: the IPv4 one
    /// has the dual-stack Service's IPv4 half, the IPv6 one its IPv6 half and the IPv6-only
    /// Services, nothing of the IPv4-only one.
    #[test]
    fn dual_stack_rulesets_match_the_golden_file() {
        let text = dual_stack();
        golden("modes/nftables", "dual_stack.golden", &text);
        let (v4, v6) = text.split_at(text.find("add table ip6 kube-proxy").unwrap());
        assert!(
            v4.contains("10.96.0.20 . tcp . 80") && !v4.contains("fd00:"),
            "{v4}"
        );
        assert!(!v6.contains("shop/web") && !v6.contains(" 10.244."), "{v6}");
        assert!(
            v6.contains("dnat to [fd00:10:244:1::12]:8080")
                && v6.contains("ip6 saddr != { 2001:db8:192:2::/64, 2001:db8:203:113::10 } drop")
                && v6.contains("ip6 daddr { fd00:10:96::/112 } drop"),
            "{v6}"
        );
    }

    /// The two tables of the dual-stack fixture, IPv4's first.
    fn dual_stack() -> String {
        let state = fixture(crate::testing::DUAL_STACK);
        TABLES
            .iter()
            .map(|table| {
                let settings = crate::testing::netfilter_settings_of(table.family);
                render(&state, &settings, *table, None, Scope::All).text
            })
            .collect()
    }

    #[test]
    fn partial_sync_matches_the_golden_file() {
        let state = fixture(FIXTURE);
        let full = render(&state, &settings(), TABLE, None, Scope::All);
        let (next, changed) = changed(state);
        let partial = render(
            &next,
            &settings(),
            TABLE,
            Some(full.programmed),
            Scope::Changed(&changed),
        );
        golden("modes/nftables", "partial.golden", &partial.text);
        // Only the two changed ports are touched.
        for line in partial.text.lines() {
            assert!(
                line.contains("shop/web")
                    || line.contains("kube-system/dns")
                    || line.contains("10.96.0.53"),
                "{line}"
            );
        }
        let chains: Vec<&str> = partial.programmed.chains().collect();
        assert!(chains.iter().all(|c| !c.contains("kube-system/dns")));
        assert!(!chains.contains(&"endpoint-KNW5FFQ5-shop/web/tcp/http__10.244.2.11/8080"));
        assert!(chains.contains(&"endpoint-FAYF65XV-shop/web/tcp/http__10.244.1.11/8080"));
        // Nothing changed: nothing to do.
        let none = render(
            &next,
            &settings(),
            TABLE,
            Some(partial.programmed),
            Scope::Changed(&BTreeSet::new()),
        );
        assert_eq!(none.text, "");
    }

    #[test]
    fn full_sync_with_a_record_rewrites_in_place() {
        let state = fixture(FIXTURE);
        let full = render(&state, &settings(), TABLE, None, Scope::All);
        assert!(
            full.text
                .starts_with("add table ip kube-proxy\ndelete table ip kube-proxy\n")
        );
        let again = render(
            &state,
            &settings(),
            TABLE,
            Some(full.programmed.clone()),
            Scope::All,
        );
        assert!(!again.text.contains("delete table"), "{}", again.text);
        assert!(again.text.contains("flush map ip kube-proxy service-ips\n"));
        // The affinity sets keep what they remember.
        assert!(
            !again.text.contains("set ip kube-proxy affinity-"),
            "{}",
            again.text
        );
        assert_eq!(again.programmed, full.programmed);
        // Other settings: written anew.
        let other = Settings::defaults(Family::V4);
        let anew = render(
            &state,
            &other,
            TABLE,
            Some(full.programmed),
            Scope::Changed(&BTreeSet::new()),
        );
        assert!(anew.text.contains("delete table ip kube-proxy\n"));
    }

    /// A ServiceCIDR appearing rewrites the fixed rules in place, with the drop of unallocated
    /// cluster IPs after the undefined-port reject; the affinity sets keep their entries.
    #[test]
    fn a_service_cidr_change_rewrites_in_place() {
        let cut = FIXTURE
            .find("kind: ServiceCIDR")
            .expect("the fixture's ServiceCIDR");
        let without = fixture(&FIXTURE[..FIXTURE[..cut].rfind("---").unwrap()]);
        assert!(without.service_cidrs().is_empty());
        let full = render(&without, &settings(), TABLE, None, Scope::All);
        assert!(!full.text.contains("unallocated"), "{}", full.text);
        let with = fixture(FIXTURE);
        let changed = render(
            &with,
            &settings(),
            TABLE,
            Some(full.programmed),
            Scope::Changed(&BTreeSet::new()),
        );
        let text = &changed.text;
        assert!(!text.contains("delete table"), "{text}");
        assert!(!text.contains("set ip kube-proxy affinity-"), "{text}");
        let reject = text
            .find("cluster-ips-check ip daddr @cluster-ips reject")
            .unwrap();
        let drop = text
            .find("cluster-ips-check ip daddr { 10.96.0.0/16 } drop")
            .unwrap();
        assert!(reject < drop, "{text}");
        // The SCTP table of the ebpf mode checks no cluster IP.
        let sctp = Table {
            family: Family::V4,
            name: "ip other",
            comment: "",
            checks_cluster_ips: false,
        };
        let text = render(&with, &settings(), sctp, None, Scope::All).text;
        assert!(
            !text.contains("add rule ip other cluster-ips-check"),
            "{text}"
        );
    }

    #[test]
    fn without_a_cluster_cidr_or_with_masquerade_all() {
        let state = fixture(FIXTURE);
        let text = render(
            &state,
            &Settings::defaults(Family::V4),
            TABLE,
            None,
            Scope::All,
        )
        .text;
        assert!(text.contains(
            "add rule ip kube-proxy services fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports\n"
        ));
        assert!(!text.contains("nodeport-ips"));
        assert!(
            !text
                .lines()
                .any(|l| l.contains("ip saddr !=") && l.contains("mark-for-masquerade")),
            "no cluster CIDR: no masquerade rule by source"
        );
        assert!(!text.contains("pods: any endpoint"));
        let all = Settings {
            masquerade_all: true,
            ..Settings::defaults(Family::V4)
        };
        let text = render(&state, &all, TABLE, None, Scope::All).text;
        assert!(
            text.contains("add rule ip kube-proxy service-KHN6ECMT-shop/web/tcp/http ip daddr 10.96.0.10 tcp dport 80 jump mark-for-masquerade\n"),
            "{text}"
        );
    }

    #[test]
    fn names_are_kube_proxys() {
        // The names in kube-proxy's own nftables tests.
        let svc1 = port_base(&spn("ns1", "svc1", "p80", Protocol::Tcp));
        assert_eq!(
            named("service-", &svc1),
            "service-ULMVA6XW-ns1/svc1/tcp/p80"
        );
        let ep = Endpoint {
            ip: Ipv4Addr::new(10, 180, 0, 1).into(),
            port: 80,
            ready: true,
            serving: true,
            terminating: false,
            placement: None,
        };
        assert_eq!(
            targets(&svc1, Family::V4, &[&ep])[0].chain,
            "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
        );
        let svc2 = port_base(&spn("ns2", "svc2", "p80", Protocol::Tcp));
        assert_eq!(
            named("external-", &svc2),
            "external-42NFTM6N-ns2/svc2/tcp/p80"
        );
        let svc5 = port_base(&spn("ns5", "svc5", "p80", Protocol::Tcp));
        assert_eq!(
            named("firewall-", &svc5),
            "firewall-HVFWP5L3-ns5/svc5/tcp/p80"
        );
        let ep = Endpoint {
            ip: Ipv4Addr::new(10, 180, 0, 3).into(),
            ..ep
        };
        assert_eq!(
            targets(&svc5, Family::V4, &[&ep])[0].affinity,
            "affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80"
        );
    }

    /// The transactions as the kernel takes them: in a namespace of its own, a table left by
    /// an earlier run, a full sync, partial syncs (ports changed, removed, back; elements that
    /// change verdict; affinity sets created, re-created with another timeout, deleted), a full
    /// sync in place and one with other settings. After each, the table is exactly what a full
    /// sync of the same state writes into an empty namespace.
    #[test]
    fn nft_takes_full_and_partial_syncs() {
        if !privileged("modes::nftables::rules::tests::nft_takes_full_and_partial_syncs") {
            return;
        }
        let ns = Netns::new("sync");
        let fresh = Netns::new("fresh");
        ns.apply(
            "add table ip kube-proxy\n\
             add chain ip kube-proxy service-GONEGONE-shop/gone/tcp/http\n\
             add chain ip kube-proxy filter-output-post-dnat { type filter hook output priority -90 ; }\n",
        );
        let mut programmed = None;
        let mut sync = |state: &DesiredState, settings: &Settings, scope: Scope<'_>| {
            let rendered = render(state, settings, TABLE, programmed.take(), scope);
            ns.apply(&rendered.text);
            programmed = Some(rendered.programmed);
            fresh.apply(&render(state, settings, TABLE, None, Scope::All).text);
            assert_eq!(ns.table(), fresh.table(), "after:\n{}", rendered.text);
            ns.nft(&["list", "table", "ip", "kube-proxy"], "").unwrap()
        };

        let s0 = fixture(FIXTURE);
        let listed = sync(&s0, &settings(), Scope::All);
        assert!(
            !listed.contains("GONEGONE") && !listed.contains("post-dnat"),
            "{listed}"
        );

        let (mut state, changed) = changed(s0.clone());
        let listed = sync(&state, &settings(), Scope::Changed(&changed));
        assert!(
            listed.contains("chain service-KHN6ECMT-shop/web/tcp/http {"),
            "{listed}"
        );
        assert!(
            !listed.contains("shop/web/tcp/http__10.244.2.11/8080"),
            "{listed}"
        );
        assert!(
            !listed.contains("kube-system/dns") && !listed.contains("10.96.0.53"),
            "{listed}"
        );

        // shop/elsewhere gets a local endpoint (drop -> its chains), shop/empty goes, dns comes
        // back with another timeout, shop/local loses its source ranges.
        let elsewhere = spn("shop", "elsewhere", "", Protocol::Tcp);
        let empty = spn("shop", "empty", "", Protocol::Tcp);
        let local = spn("shop", "local", "", Protocol::Tcp);
        let mut endpoint = s0.endpoints_of(&elsewhere)[0].clone();
        endpoint.ip = Ipv4Addr::new(10, 244, 1, 14).into();
        endpoint.placement = Placement::shared(Some("node1"), None);
        state.edit_endpoints(&elsewhere, |eps| eps.insert(0, endpoint));
        state.remove_port(&empty);
        let mut port = ServicePort::clone(s0.port(&dns()).unwrap());
        port.session_affinity_timeout = std::num::NonZeroU32::new(60);
        state.insert_port(dns(), port);
        state.set_endpoints(dns(), s0.endpoints_of(&dns()).to_vec());
        state.port_mut(&local).unwrap().source_ranges = Box::default();
        let changed = BTreeSet::from([elsewhere, empty, dns(), local]);
        let listed = sync(&state, &settings(), Scope::Changed(&changed));
        assert!(listed.contains("timeout 1m"), "{listed}");
        assert!(!listed.contains("firewall-NEUDBC3L"), "{listed}");

        state.port_mut(&dns()).unwrap().session_affinity_timeout = std::num::NonZeroU32::new(120);
        let listed = sync(
            &state,
            &settings(),
            Scope::Changed(&BTreeSet::from([dns()])),
        );
        assert!(listed.contains("timeout 2m"), "{listed}");

        sync(&state, &settings(), Scope::All);
        sync(
            &state,
            &Settings::defaults(Family::V4),
            Scope::Changed(&BTreeSet::new()),
        );
    }

    /// Both families' tables in one transaction, as the kernel takes it, written anew over
    /// themselves.
    #[test]
    fn nft_takes_both_families() {
        if !privileged("modes::nftables::rules::tests::nft_takes_both_families") {
            return;
        }
        let ns = Netns::new("dual");
        ns.apply(&dual_stack());
        ns.apply(&dual_stack());
        let listed = ns.nft(&["list", "table", "ip6", "kube-proxy"], "").unwrap();
        for want in [
            "fd00:10:96::20 . tcp . 80 : goto service-5JQP6IZY-shop/front/tcp/",
            "chain endpoint-LIMBBTGS-shop/local/tcp/http__fd00.10.244.2..13/8080 {",
            "dnat to [fd00:10:244:2::13]:8080",
            "ip6 daddr fd00:10:96::/112 drop",
        ] {
            assert!(listed.contains(want), "no {want:?} in:\n{listed}");
        }
    }

    /// A network namespace of the test's own, deleted when dropped.
    struct Netns(String);

    impl Netns {
        fn new(tag: &str) -> Self {
            let name = format!("kpe-nft-{}-{tag}", std::process::id());
            if let Err(e) = run(Command::new("ip").args(["netns", "add", &name]), "") {
                panic!("ip netns add {name}: {e}");
            }
            Self(name)
        }

        /// `nft ARGS` in the namespace, `stdin` on its standard input.
        fn nft(&self, args: &[&str], stdin: &str) -> Result<String, String> {
            run(
                Command::new("ip")
                    .args(["netns", "exec", &self.0, "nft"])
                    .args(args),
                stdin,
            )
        }

        fn apply(&self, text: &str) {
            if let Err(e) = self.nft(&["-f", "-"], text) {
                panic!("nft rejected the transaction: {e}\n{text}");
            }
        }

        /// The table as JSON, reduced to what must match whatever order it was written in:
        /// each chain's rules in order, each set and map with its elements sorted, no handles.
        fn table(&self) -> BTreeMap<String, Vec<String>> {
            let json = self
                .nft(&["-j", "list", "table", "ip", "kube-proxy"], "")
                .unwrap();
            let json: serde_json::Value = serde_json::from_str(&json).unwrap();
            let mut table = BTreeMap::new();
            for item in json["nftables"].as_array().unwrap() {
                let (kind, object) = item.as_object().unwrap().iter().next().unwrap();
                let mut object = object.as_object().unwrap().clone();
                object.remove("handle");
                let entry = match kind.as_str() {
                    "metainfo" => continue,
                    "rule" => format!("chain {} rules", object["chain"].as_str().unwrap()),
                    _ => format!("{kind} {}", object["name"].as_str().unwrap()),
                };
                let mut values = Vec::new();
                if let Some(serde_json::Value::Array(elements)) = object.remove("elem") {
                    values.extend(elements.iter().map(|e| e.to_string()));
                    values.sort();
                }
                values.insert(0, serde_json::Value::Object(object).to_string());
                table.entry(entry).or_insert_with(Vec::new).extend(values);
            }
            table
        }
    }

    impl Drop for Netns {
        fn drop(&mut self) {
            let _ = run(Command::new("ip").args(["netns", "delete", &self.0]), "");
        }
    }

    fn run(command: &mut Command, stdin: &str) -> Result<String, String> {
        let mut child = command
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(stdin.as_bytes())
            .map_err(|e| e.to_string())?;
        let output = child.wait_with_output().map_err(|e| e.to_string())?;
        if !output.status.success() {
            return Err(String::from_utf8_lossy(&output.stderr).trim().to_string());
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }
}
