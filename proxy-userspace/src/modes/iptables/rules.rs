//! The iptables rules of a desired state, in kube-proxy's layout (its iptables proxier, 1.28
//! and later), as one `iptables-restore --noflush` input. A pure function of the state and
//! the settings, so that the golden tests show every rule change in review.
//!
//! nat: `KUBE-SERVICES` matches each frontend (cluster IP, external IP, load balancer IP) and
//! jumps to the Service port's chain; the NodePorts go through `KUBE-NODEPORTS`, reached last
//! for packets to a node address. `KUBE-SVC-*` (cluster endpoints) and `KUBE-SVL-*` (this
//! node's endpoints, for a Local traffic policy) pick an endpoint with `statistic` (1/n,
//! 1/(n-1), ...), or the last one a client used with `recent` (session affinity), and jump to
//! its `KUBE-SEP-*`, which DNATs. `KUBE-EXT-*` is the way in from outside (masquerade, or for
//! externalTrafficPolicy Local the client kept), `KUBE-FW-*` the loadBalancerSourceRanges.
//! Traffic that must leave with the node's address is marked (`KUBE-MARK-MASQ`) and
//! masqueraded in `KUBE-POSTROUTING`.
//!
//! filter: frontends without endpoints are rejected (`KUBE-SERVICES`,
//! `KUBE-EXTERNAL-SERVICES`; dropped where a Local policy has no local endpoint), load balancer
//! traffic from outside the source ranges is dropped (`KUBE-PROXY-FIREWALL`), health check node
//! ports are accepted, and `KUBE-FORWARD` lets marked and established traffic through.
use std::{
    collections::BTreeSet,
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
};

use crate::{
    model::{DesiredState, Endpoint, ServicePort, ServicePortName},
    netfilter::rules::{MASQ_MARK, Settings, hash16},
};

/// Chain names of one Service port (kube-proxy's hashes, so that they read the same).
struct Chains {
    cluster: String,
    local: String,
    external: String,
    firewall: String,
}

impl Chains {
    fn of(spn: &str, protocol: &str) -> Self {
        let hash = hash16(&format!("{spn}{protocol}"));
        Self {
            cluster: format!("KUBE-SVC-{hash}"),
            local: format!("KUBE-SVL-{hash}"),
            external: format!("KUBE-EXT-{hash}"),
            firewall: format!("KUBE-FW-{hash}"),
        }
    }
}

/// kube-proxy's endpoint chain: `KUBE-SEP-` and a hash of the port, protocol and endpoint.
fn endpoint_chain(spn: &str, protocol: &str, endpoint: &str) -> String {
    format!("KUBE-SEP-{}", hash16(&format!("{spn}{protocol}{endpoint}")))
}

/// The rules of `state`, and the per-Service chains they declare. `existing`: the per-Service
/// nat chains programmed now; those no longer wanted are deleted in the same transaction.
pub struct Rendered {
    pub text: String,
    pub chains: BTreeSet<String>,
}

/// Lines of one table: chain declarations and rules, kept apart so that every declaration
/// comes first.
#[derive(Default)]
struct Table {
    chains: Vec<String>,
    rules: String,
}

impl Table {
    fn chain(&mut self, name: &str) {
        self.chains.push(name.to_owned());
    }

    fn rule(&mut self, chain: &str, args: &str) {
        let _ = writeln!(self.rules, "-A {chain} {args}");
    }

    fn write(&self, out: &mut String, table: &str, stale: &[&String]) {
        let _ = writeln!(out, "*{table}");
        for chain in &self.chains {
            let _ = writeln!(out, ":{chain} - [0:0]");
        }
        for chain in stale {
            let _ = writeln!(out, ":{chain} - [0:0]");
        }
        out.push_str(&self.rules);
        for chain in stale {
            let _ = writeln!(out, "-X {chain}");
        }
        out.push_str("COMMIT\n");
    }
}

/// `changed`: write the own chains of only these Service ports (a partial sync, as kube-proxy's
/// between full syncs: the others' chains stay as they are, untouched by `--noflush`); None:
/// every Service port's. The shared chains are always written whole.
pub fn render(
    state: &DesiredState,
    settings: &Settings,
    existing: &BTreeSet<String>,
    changed: Option<&BTreeSet<ServicePortName>>,
) -> Rendered {
    let mut filter = Table::default();
    let mut nat = Table::default();
    for chain in [
        "KUBE-NODEPORTS",
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-FORWARD",
        "KUBE-PROXY-FIREWALL",
    ] {
        filter.chain(chain);
    }
    for chain in [
        "KUBE-SERVICES",
        "KUBE-NODEPORTS",
        "KUBE-POSTROUTING",
        "KUBE-MARK-MASQ",
    ] {
        nat.chain(chain);
    }
    filter.rule("KUBE-FORWARD", "-m conntrack --ctstate INVALID -j DROP");
    filter.rule(
        "KUBE-FORWARD",
        &format!(
            "-m comment --comment \"kubernetes forwarding rules\" -m mark --mark {MASQ_MARK}/{MASQ_MARK} -j ACCEPT"
        ),
    );
    filter.rule(
        "KUBE-FORWARD",
        "-m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    );
    nat.rule(
        "KUBE-POSTROUTING",
        &format!("-m mark ! --mark {MASQ_MARK}/{MASQ_MARK} -j RETURN"),
    );
    // Cleared, so that a packet traversing the rules again is not masqueraded again.
    nat.rule(
        "KUBE-POSTROUTING",
        &format!("-j MARK --xor-mark {MASQ_MARK}"),
    );
    nat.rule(
        "KUBE-POSTROUTING",
        "-m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully",
    );
    nat.rule("KUBE-MARK-MASQ", &format!("-j MARK --or-mark {MASQ_MARK}"));

    let mut chains = BTreeSet::new();
    for (spn, port) in state.ports() {
        let mut own = service_rules(
            state,
            settings,
            spn,
            port,
            &mut filter,
            &mut nat,
            &mut chains,
        );
        if changed.is_none_or(|c| c.contains(spn)) {
            nat.chains.append(&mut own.chains);
            nat.rules.push_str(&own.rules);
        }
    }

    let nodeports = "-m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\"";
    match &settings.node_port_addresses {
        // Never loopback: route_localnet stays off (CVE-2020-8558), so a NodePort DNATed
        // there would be dropped (kube-proxy's --iptables-localhost-nodeports=false).
        None => nat.rule(
            "KUBE-SERVICES",
            &format!(
                "{nodeports} -m addrtype --dst-type LOCAL ! -d {} -j KUBE-NODEPORTS",
                settings.family.loopback()
            ),
        ),
        Some(addrs) => {
            for addr in addrs {
                nat.rule(
                    "KUBE-SERVICES",
                    &format!("{nodeports} -d {addr} -j KUBE-NODEPORTS"),
                );
            }
        }
    }

    let stale: Vec<&String> = existing.difference(&chains).collect();
    let mut text = String::new();
    filter.write(&mut text, "filter", &[]);
    nat.write(&mut text, "nat", &stale);
    Rendered { text, chains }
}

/// The rules of one Service port in `settings.family` (kube-proxy's `writeServiceToRules`):
/// its frontends' jumps in the shared chains (`filter`, `nat`), and its own chains (returned);
/// nothing where it has no cluster IP of the family.
fn service_rules(
    state: &DesiredState,
    settings: &Settings,
    spn: &ServicePortName,
    port: &ServicePort,
    filter: &mut Table,
    nat: &mut Table,
    declared: &mut BTreeSet<String>,
) -> Table {
    let mut own = Table::default();
    let family = settings.family;
    if !port.in_family(family) {
        return own;
    }
    let name = spn.to_string();
    let proto = port.protocol.keyword();
    let matches = format!("-m {proto} -p {proto}");
    let chains = Chains::of(&name, proto);
    let cluster_ips = family.filter(&port.cluster_ips);
    let external_ips = family.filter(&port.external_ips);
    let lb_ips = family.filter(&port.load_balancer_ips);
    let has_external = port.node_port.is_some() || !external_ips.is_empty() || !lb_ips.is_empty();

    let mut cluster_endpoints = state.usable_endpoints(spn, false);
    let mut local_endpoints = state.usable_endpoints(spn, true);
    cluster_endpoints.retain(|ep| family.has(ep.ip));
    local_endpoints.retain(|ep| family.has(ep.ip));
    let internal = if port.internal_traffic_local {
        &local_endpoints
    } else {
        &cluster_endpoints
    };
    let external = if port.external_traffic_local {
        &local_endpoints
    } else {
        &cluster_endpoints
    };
    let internal_chain = if port.internal_traffic_local {
        &chains.local
    } else {
        &chains.cluster
    };
    let external_policy_chain = if port.external_traffic_local {
        &chains.local
    } else {
        &chains.cluster
    };
    // As kube-proxy: the cluster chain serves the cluster IP (internalTrafficPolicy Cluster)
    // and, for a Service reachable from outside, pods and the node reaching its external
    // frontends with externalTrafficPolicy Local (the short-circuit), which the external
    // chain keeps even where this node has no local endpoint.
    let uses_cluster =
        !cluster_endpoints.is_empty() && (!port.internal_traffic_local || has_external);
    let uses_local = !local_endpoints.is_empty()
        && (port.internal_traffic_local || (has_external && port.external_traffic_local));
    let uses_external =
        has_external && (!cluster_endpoints.is_empty() || !local_endpoints.is_empty());
    // The endpoints each used chain jumps to (none where the chain is not written).
    let used = |yes: bool, endpoints: &[&Endpoint]| {
        if yes {
            targets(&name, proto, endpoints)
        } else {
            Vec::new()
        }
    };
    let cluster_targets = used(uses_cluster, &cluster_endpoints);
    let local_targets = used(uses_local, &local_endpoints);
    let firewall = !port.source_ranges.is_empty() && !lb_ips.is_empty();
    let lb_chain = if firewall {
        &chains.firewall
    } else {
        &chains.external
    };

    let internal_verdict =
        without_endpoints(internal, port.internal_traffic_local, &cluster_endpoints);
    let external_verdict = has_external
        .then(|| without_endpoints(external, port.external_traffic_local, &cluster_endpoints))
        .flatten();

    for vip in &cluster_ips {
        match internal_verdict {
            None => nat.rule(
                "KUBE-SERVICES",
                &format!(
                    "-m comment --comment \"{name} cluster IP\" {matches} -d {vip} --dport {} -j {internal_chain}",
                    port.port
                ),
            ),
            Some((why, verdict)) => filter.rule(
                "KUBE-SERVICES",
                &format!(
                    "-m comment --comment \"{name} {why}\" {matches} -d {vip} --dport {} -j {verdict}",
                    port.port
                ),
            ),
        }
    }
    let external_frontends = external_ips
        .iter()
        .map(|ip| (ip, "external IP", &chains.external))
        .chain(lb_ips.iter().map(|ip| (ip, "loadbalancer IP", lb_chain)));
    // Without usable endpoints for outside clients, their packets are refused or dropped in
    // the filter table; the external chain still takes pods and the node (it DNATs them, so
    // the filter rule no longer matches them).
    for (ip, kind, chain) in external_frontends {
        if uses_external {
            nat.rule(
                "KUBE-SERVICES",
                &format!(
                    "-m comment --comment \"{name} {kind}\" {matches} -d {ip} --dport {} -j {chain}",
                    port.port
                ),
            );
        }
        if let Some((why, verdict)) = external_verdict {
            filter.rule(
                "KUBE-EXTERNAL-SERVICES",
                &format!(
                    "-m comment --comment \"{name} {why}\" {matches} -d {ip} --dport {} -j {verdict}",
                    port.port
                ),
            );
        }
    }
    if let Some(node_port) = port.node_port {
        if uses_external {
            nat.rule(
                "KUBE-NODEPORTS",
                &format!(
                    "-m comment --comment {name} {matches} --dport {node_port} -j {}",
                    chains.external
                ),
            );
        }
        if let Some((why, verdict)) = external_verdict {
            filter.rule(
                "KUBE-EXTERNAL-SERVICES",
                &format!(
                    "-m comment --comment \"{name} {why}\" -m addrtype --dst-type LOCAL {matches} --dport {node_port} -j {verdict}"
                ),
            );
        }
    }
    if let Some(hc) = port.health_check_node_port {
        filter.rule(
            "KUBE-NODEPORTS",
            &format!(
                "-m comment --comment \"{name} health check node port\" -m tcp -p tcp --dport {hc} -j ACCEPT"
            ),
        );
    }
    // Load balancer traffic from outside the source ranges is not DNATed by KUBE-FW-*; it is
    // dropped here.
    if firewall && uses_external {
        for ip in &lb_ips {
            filter.rule(
                "KUBE-PROXY-FIREWALL",
                &format!(
                    "-m comment --comment \"{name} traffic not accepted by {}\" {matches} -d {ip} --dport {} -j DROP",
                    chains.firewall, port.port
                ),
            );
        }
    }

    // Off-cluster traffic to a cluster IP is masqueraded at the head of the chain the cluster
    // IP jumps to (KUBE-SVL-* for internalTrafficPolicy Local), as kube-proxy writes it.
    let cluster_ip_masquerade = |own: &mut Table, chain: &str| {
        let from = if settings.masquerade_all {
            String::new()
        } else if let Some(cluster_cidr) = settings.cluster_cidr {
            format!(" ! -s {cluster_cidr}")
        } else {
            return;
        };
        for vip in &cluster_ips {
            own.rule(
                chain,
                &format!(
                    "-m comment --comment \"{name} cluster IP\" {matches} -d {vip} --dport {}{from} -j KUBE-MARK-MASQ",
                    port.port
                ),
            );
        }
    };
    if uses_cluster {
        own.chain(&chains.cluster);
        declared.insert(chains.cluster.clone());
        if !port.internal_traffic_local {
            cluster_ip_masquerade(&mut own, &chains.cluster);
        }
        endpoint_jumps(&mut own, &chains.cluster, &name, port, &cluster_targets);
    }
    if uses_local {
        own.chain(&chains.local);
        declared.insert(chains.local.clone());
        if port.internal_traffic_local {
            cluster_ip_masquerade(&mut own, &chains.local);
        }
        endpoint_jumps(&mut own, &chains.local, &name, port, &local_targets);
    }
    if uses_external {
        own.chain(&chains.external);
        declared.insert(chains.external.clone());
        let ext = &chains.external;
        if port.external_traffic_local {
            // Pods and the node itself are inside the cluster: any endpoint, as for the
            // cluster IP (kube-proxy's short-circuit); the node's own traffic masqueraded.
            if uses_cluster {
                if let Some(cluster_cidr) = settings.cluster_cidr {
                    own.rule(
                        ext,
                        &format!(
                            "-m comment --comment \"pod traffic for {name} external destinations\" -s {cluster_cidr} -j {}",
                            chains.cluster
                        ),
                    );
                }
                own.rule(
                    ext,
                    &format!(
                        "-m comment --comment \"masquerade LOCAL traffic for {name} external destinations\" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ"
                    ),
                );
                own.rule(
                    ext,
                    &format!(
                        "-m comment --comment \"route LOCAL traffic for {name} external destinations\" -m addrtype --src-type LOCAL -j {}",
                        chains.cluster
                    ),
                );
            }
        } else {
            own.rule(
                ext,
                &format!(
                    "-m comment --comment \"masquerade traffic for {name} external destinations\" -j KUBE-MARK-MASQ"
                ),
            );
        }
        if !external.is_empty() {
            own.rule(ext, &format!("-j {external_policy_chain}"));
        }
    }
    if firewall && uses_external {
        own.chain(&chains.firewall);
        declared.insert(chains.firewall.clone());
        let own_ips = settings
            .admits_load_balancer_ips(&port.source_ranges)
            .then_some(&lb_ips);
        let sources = (port.source_ranges.iter().filter(|r| r.family() == family))
            .map(ToString::to_string)
            .chain(own_ips.into_iter().flatten().map(ToString::to_string));
        for source in sources {
            own.rule(
                &chains.firewall,
                &format!(
                    "-m comment --comment \"{name} loadbalancer IP\" -s {source} -j {}",
                    chains.external
                ),
            );
        }
    }
    // Endpoints in both lists have one chain.
    for target in cluster_targets.iter().chain(&local_targets) {
        let Target {
            ip,
            port: ep_port,
            chain,
        } = target;
        if !declared.insert(chain.clone()) {
            continue;
        }
        own.chain(chain);
        own.rule(
            chain,
            &format!("-m comment --comment {name} -s {ip} -j KUBE-MARK-MASQ"),
        );
        let recent = if port.session_affinity_timeout.is_some() {
            format!(" -m recent --name {chain} --set")
        } else {
            String::new()
        };
        let to = SocketAddr::new(*ip, *ep_port);
        own.rule(
            chain,
            &format!("-m comment --comment {name}{recent} {matches} -j DNAT --to-destination {to}"),
        );
    }
    own
}

/// An endpoint a Service chain jumps to, and its `KUBE-SEP-*` chain.
struct Target {
    ip: IpAddr,
    port: u16,
    chain: String,
}

/// `endpoints` of the Service port `name`, each with its chain name (kube-proxy's: of
/// `ip:port`, `[ip]:port` for IPv6).
fn targets(name: &str, proto: &str, endpoints: &[&Endpoint]) -> Vec<Target> {
    endpoints
        .iter()
        .map(|ep| Target {
            ip: ep.ip,
            port: ep.port,
            chain: endpoint_chain(name, proto, &SocketAddr::new(ep.ip, ep.port).to_string()),
        })
        .collect()
}

/// What a frontend whose policy leaves it `endpoints` does when there are none: refuse at once
/// (REJECT), or drop where only this node's endpoints may be used and other nodes have some
/// (the client's retry may reach one of those). None: it has endpoints.
fn without_endpoints(
    endpoints: &[&Endpoint],
    local_policy: bool,
    cluster: &[&Endpoint],
) -> Option<(&'static str, &'static str)> {
    if !endpoints.is_empty() {
        None
    } else if local_policy && !cluster.is_empty() {
        Some(("has no local endpoints", "DROP"))
    } else {
        Some(("has no endpoints", "REJECT"))
    }
}

/// A Service chain's jumps to its endpoints: to the one a client used last while affinity
/// holds, else one at random, each with the probability that makes the choice uniform.
fn endpoint_jumps(
    nat: &mut Table,
    chain: &str,
    name: &str,
    port: &ServicePort,
    targets: &[Target],
) {
    if let Some(timeout) = port.session_affinity_timeout {
        for Target {
            ip,
            port: p,
            chain: ep_chain,
        } in targets
        {
            nat.rule(
                chain,
                &format!(
                    "-m comment --comment \"{name} -> {}\" -m recent --name {ep_chain} --rcheck --seconds {timeout} --reap -j {ep_chain}",
                    SocketAddr::new(*ip, *p)
                ),
            );
        }
    }
    let n = targets.len();
    for (
        i,
        Target {
            ip,
            port: p,
            chain: ep_chain,
        },
    ) in targets.iter().enumerate()
    {
        let statistic = if i + 1 < n {
            format!(
                " -m statistic --mode random --probability {:.10}",
                1.0 / (n - i) as f64
            )
        } else {
            String::new()
        };
        nat.rule(
            chain,
            &format!(
                "-m comment --comment \"{name} -> {}\"{statistic} -j {ep_chain}",
                SocketAddr::new(*ip, *p)
            ),
        );
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    use crate::{
        model::{Cidr, Family},
        testing::{fixture, golden, netfilter_settings_of},
    };

    const FIXTURE: &str = crate::testing::SERVICES;

    /// The dual-stack fixture's rules in each family, as `iptables-restore` and
    /// `ip6tables-restore` take them: each family's half of the dual-stack Service, the
    /// single-stack ones in their family only.
    #[test]
    fn dual_stack_rules_match_the_golden_files() {
        let state = fixture(crate::testing::DUAL_STACK);
        let render = |family| {
            render(
                &state,
                &netfilter_settings_of(family),
                &BTreeSet::new(),
                None,
            )
        };
        let (v4, v6) = (render(Family::V4).text, render(Family::V6).text);
        golden("modes/iptables", "dual_stack_ipv4.golden", &v4);
        golden("modes/iptables", "dual_stack_ipv6.golden", &v6);
        assert!(
            v4.contains("-d 10.96.0.20/32") || v4.contains("-d 10.96.0.20 "),
            "{v4}"
        );
        assert!(!v4.contains("fd00:") && !v4.contains("2001:"), "{v4}");
        assert!(!v6.contains("shop/web") && !v6.contains(" 10."), "{v6}");
        for want in [
            "-j DNAT --to-destination [fd00:10:244:1::12]:8080",
            "-d 2001:db8:192:2::11 -j KUBE-NODEPORTS",
            "-s 2001:db8:192:2::/64 -j KUBE-EXT-",
            "kube-system/dns:dns has no endpoints\" -m udp -p udp -d fd00:10:96::a --dport 53 -j REJECT",
        ] {
            assert!(v6.contains(want), "no {want:?} in:\n{v6}");
        }
    }

    /// Both families' rules, as the kernel's tools take them.
    #[test]
    fn dual_stack_rules_restore() {
        let test = "modes::iptables::rules::tests::dual_stack_rules_restore";
        let rules = |family| {
            let state = fixture(crate::testing::DUAL_STACK);
            let settings = netfilter_settings_of(family);
            render(&state, &settings, &BTreeSet::new(), None).text
        };
        for (tables, saved) in crate::testing::saved_in_each_tables(test, &Family::ALL, rules) {
            let endpoint = match tables.family {
                Family::V4 => "--to-destination 10.244.1.12:8080",
                Family::V6 => "--to-destination [fd00:10:244:1::12]:8080",
            };
            assert!(
                saved.contains(endpoint),
                "{tables:?}: no {endpoint}:\n{saved}"
            );
        }
    }

    #[test]
    fn rules_match_the_golden_file() {
        let settings = crate::testing::netfilter_settings();
        // A chain of a Service gone since the last sync: deleted in the same transaction.
        let existing = BTreeSet::from(["KUBE-SVC-GONEGONEGONEGONE".to_string()]);
        let rendered = render(&fixture(FIXTURE), &settings, &existing, None);
        golden("modes/iptables", "rules.golden", &rendered.text);
        assert!(!rendered.chains.contains("KUBE-SVC-GONEGONEGONEGONE"));
    }

    /// A partial sync after one Service port changed: the shared chains whole, the own chains of
    /// that port only, and a gone port's chains deleted.
    #[test]
    fn a_partial_sync_writes_the_changed_ports_own_chains_only() {
        let settings = crate::testing::netfilter_settings();
        let state = fixture(FIXTURE);
        let full = render(&state, &settings, &BTreeSet::new(), None);
        let web = state
            .port_names()
            .find(|spn| spn.to_string() == "shop/web:http")
            .expect("shop/web:http in the fixture")
            .clone();
        let mut existing = full.chains.clone();
        existing.insert("KUBE-SVC-GONEGONEGONEGONE".to_string());
        let partial = render(&state, &settings, &existing, Some(&BTreeSet::from([web])));
        golden("modes/iptables", "partial.golden", &partial.text);
        assert_eq!(
            partial.chains, full.chains,
            "every port's chains are still wanted"
        );
        let web_chain = Chains::of("shop/web:http", "tcp").cluster;
        for line in full.text.lines() {
            let own_rule_of = |chain: &str| line.starts_with(&format!("-A {chain} "));
            if line.contains("-A KUBE-SERVICES") || line.contains("-A KUBE-NODEPORTS") {
                assert!(partial.text.contains(line), "shared rule missing: {line}");
            } else if let Some(chain) = full.chains.iter().find(|c| own_rule_of(c)) {
                let own = chain == &web_chain || line.contains("shop/web:http");
                assert_eq!(partial.text.contains(line), own, "{line}");
            }
        }
    }

    #[test]
    fn without_a_cluster_cidr_or_with_masquerade_all() {
        let state = fixture(FIXTURE);
        let every_address = Settings::defaults(Family::V4);
        let text = render(&state, &every_address, &BTreeSet::new(), None).text;
        // Every local address but the loopback range (issue 24, item 8).
        assert!(text.contains("-m addrtype --dst-type LOCAL ! -d 127.0.0.0/8 -j KUBE-NODEPORTS"));
        assert!(
            !text.contains("! -s"),
            "no cluster CIDR: no masquerade rule by source"
        );
        assert!(!text.contains("pod traffic for"));
        let all = Settings {
            masquerade_all: true,
            ..Settings::defaults(Family::V4)
        };
        let text = render(&state, &all, &BTreeSet::new(), None).text;
        assert!(text.contains(
            "-A KUBE-SVC-67NZLRHBNDSAWJRO -m comment --comment \"shop/web:http cluster IP\" -m tcp -p tcp -d 10.96.0.10 --dport 80 -j KUBE-MARK-MASQ"
        ), "{text}");
    }

    /// internalTrafficPolicy Local: off-cluster traffic to the cluster IP (and with
    /// --masquerade-all, every client's) is masqueraded in the KUBE-SVL-* chain the cluster IP
    /// jumps to, as kube-proxy writes it (issue 24, item 5).
    #[test]
    fn internal_local_cluster_ips_are_masqueraded_in_their_own_chain() {
        let mut state = fixture(FIXTURE);
        // A port with endpoints on this node, made internalTrafficPolicy Local.
        let spn = state
            .port_names()
            .find(|spn| !state.usable_endpoints(spn, true).is_empty())
            .expect("the fixture has local endpoints")
            .clone();
        let port = state.port_mut(&spn).unwrap();
        port.internal_traffic_local = true;
        let local = Chains::of(&spn.to_string(), port.protocol.keyword()).local;
        let name = spn.to_string();
        for settings in [
            Settings {
                cluster_cidr: Some(Cidr::v4(Ipv4Addr::new(10, 244, 0, 0), 16)),
                ..Settings::defaults(Family::V4)
            },
            Settings {
                masquerade_all: true,
                ..Settings::defaults(Family::V4)
            },
        ] {
            let text = render(&state, &settings, &BTreeSet::new(), None).text;
            let masquerade = text.lines().find(|l| {
                l.starts_with(&format!("-A {local} "))
                    && l.contains(&format!("\"{name} cluster IP\""))
                    && l.ends_with("-j KUBE-MARK-MASQ")
            });
            assert!(
                masquerade.is_some(),
                "no masquerade rule in {local}:\n{text}"
            );
        }
    }

    #[test]
    fn chain_names_are_kube_proxys() {
        // The names in kube-proxy's own iptables tests.
        assert_eq!(
            Chains::of("ns1/svc1:p80", "tcp").cluster,
            "KUBE-SVC-XPGD46QRK7WJZT7O"
        );
        assert_eq!(
            endpoint_chain("ns1/svc1:p80", "tcp", "10.180.0.1:80"),
            "KUBE-SEP-SXIVWICOYRO3J4NJ"
        );
        assert_eq!(
            Chains::of("ns2/svc2:p80", "tcp").external,
            "KUBE-EXT-GNZBNJ2PO5MGZ6GT"
        );
    }
}
