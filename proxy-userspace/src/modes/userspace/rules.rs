//! The iptables rules of the userspace mode, in kube-proxy's userspace layout, as one
//! `iptables-restore --noflush` input of one family (`ip6tables-restore` takes IPv6's). A pure
//! function of the state, the settings and the proxy ports, so that the golden test shows
//! every rule change in review.
//!
//! nat: each frontend of a Service port with endpoints is sent to the Service port's proxy
//! socket. `KUBE-PORTALS-CONTAINER` (from PREROUTING: pods, and other hosts) REDIRECTs the
//! cluster IPs, external IPs and load balancer IPs to the proxy port (the incoming interface's
//! address); `KUBE-PORTALS-HOST` (from OUTPUT: processes on the node) DNATs them to the node's
//! address and the proxy port, because a REDIRECT of local traffic goes to 127.0.0.1, from
//! where a UDP reply of a socket bound to every address leaves with the wrong source (what
//! kube-proxy found too). `KUBE-NODEPORT-CONTAINER` and `KUBE-NODEPORT-HOST` do the same for
//! the NodePorts, reached last and only for local destinations.
//!
//! filter: `KUBE-PORTALS-FIREWALL` (from INPUT, FORWARD and OUTPUT, new connections) sees the
//! frontends that the nat rules left alone: without endpoints they are rejected (the client
//! learns at once: TCP RST, ICMP port unreachable), or dropped where a Local traffic policy has
//! no endpoint on this node but other nodes have some (as the iptables mode does); and a load
//! balancer IP with loadBalancerSourceRanges is redirected only for sources within them (nat),
//! the others dropped here. `KUBE-NODEPORT-NON-LOCAL` (kube-proxy's) accepts new connections
//! to the proxy ports of NodePorts and to the health check node ports, for nodes whose INPUT
//! denies by default.
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
};

use crate::{
    model::{Cidr, DesiredState, Family, Protocol, ServicePort, ServicePortName},
    rows::host_port,
};

pub const CONTAINER_PORTALS: &str = "KUBE-PORTALS-CONTAINER";
pub const HOST_PORTALS: &str = "KUBE-PORTALS-HOST";
pub const CONTAINER_NODEPORTS: &str = "KUBE-NODEPORT-CONTAINER";
pub const HOST_NODEPORTS: &str = "KUBE-NODEPORT-HOST";
pub const NON_LOCAL_NODEPORTS: &str = "KUBE-NODEPORT-NON-LOCAL";
pub const FIREWALL: &str = "KUBE-PORTALS-FIREWALL";

/// The chains the mode owns, by table, in the order they are written.
pub const CHAINS: &[(&str, &[&str])] = &[
    ("filter", &[FIREWALL, NON_LOCAL_NODEPORTS]),
    (
        "nat",
        &[
            CONTAINER_PORTALS,
            HOST_PORTALS,
            CONTAINER_NODEPORTS,
            HOST_NODEPORTS,
        ],
    ),
];

/// What the rules of one family depend on besides the state and the proxy ports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub family: Family,
    /// Where traffic from the node's own processes is DNATed to (with the proxy port): the
    /// node's primary address of the family (kube-proxy's `hostIP`).
    pub node_ip: IpAddr,
    /// The node addresses NodePorts answer on; None: every local address (`addrtype LOCAL`).
    pub node_port_addresses: Option<Vec<IpAddr>>,
}

/// Which of a Service port's proxy sockets: the one of its cluster IPs (endpoints following
/// internalTrafficPolicy), or the one of its external frontends (NodePort, external IPs, load
/// balancer IPs; endpoints following externalTrafficPolicy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listener {
    Internal,
    External,
}

/// The proxy ports of one Service port. `external` is set only where the external frontends
/// have a socket of their own ([`needs_external_listener`]); otherwise they share `internal`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyPorts {
    pub internal: u16,
    pub external: Option<u16>,
}

impl ProxyPorts {
    fn of(&self, listener: Listener) -> u16 {
        match listener {
            Listener::Internal => self.internal,
            Listener::External => self.external.unwrap_or(self.internal),
        }
    }
}

/// Whether the mode proxies `port` in `family`: TCP or UDP (kube-proxy's userspace mode had no
/// SCTP), with a cluster IP of the family (kube-proxy's proxier of the family).
pub fn proxied(port: &ServicePort, family: Family) -> bool {
    port.protocol != Protocol::Sctp && port.in_family(family)
}

/// Whether `port` can be reached in `family` from outside the cluster (NodePort, external or
/// load balancer IPs).
fn has_external(port: &ServicePort, family: Family) -> bool {
    port.node_port.is_some()
        || port.external_ips.iter().any(|ip| family.has(*ip))
        || port.load_balancer_ips.iter().any(|ip| family.has(*ip))
}

/// Whether the external frontends of `port` in `family` need a proxy socket of their own: when
/// the traffic policies pick different endpoints for them than for the cluster IPs.
pub fn needs_external_listener(port: &ServicePort, family: Family) -> bool {
    has_external(port, family) && port.external_traffic_local != port.internal_traffic_local
}

/// The endpoints `listener` of `spn` proxies to in `family`: the usable ones of the family,
/// only this node's where its traffic policy is Local.
pub fn endpoints(
    state: &DesiredState,
    spn: &ServicePortName,
    port: &ServicePort,
    listener: Listener,
    family: Family,
) -> Vec<SocketAddr> {
    let local_only = match listener {
        Listener::Internal => port.internal_traffic_local,
        Listener::External => port.external_traffic_local,
    };
    state
        .usable_endpoints(spn, local_only)
        .iter()
        .filter(|ep| family.has(ep.ip))
        .map(|ep| SocketAddr::new(ep.ip, ep.port))
        .collect()
}

/// The rules of the mode's chains, by chain.
#[derive(Default)]
struct Rules(BTreeMap<&'static str, Vec<String>>);

impl Rules {
    fn add(&mut self, chain: &'static str, rule: String) {
        self.0.entry(chain).or_default().push(rule);
    }
}

/// The `iptables-restore --noflush` input that makes the mode's chains of `settings.family`
/// hold exactly the rules of `state`, for the Service ports in `ports` (those with an open
/// proxy socket of the family).
pub fn render(
    state: &DesiredState,
    settings: &Settings,
    ports: &BTreeMap<ServicePortName, ProxyPorts>,
) -> String {
    let mut rules = Rules::default();
    for (spn, proxy) in ports {
        if let Some(port) = state.port(spn) {
            service_rules(state, settings, spn, port, proxy, &mut rules);
        }
    }
    let mut out = String::new();
    for (table, chains) in CHAINS {
        let _ = writeln!(out, "*{table}");
        for chain in *chains {
            let _ = writeln!(out, ":{chain} - [0:0]");
        }
        for chain in *chains {
            for rule in rules.0.get(chain).into_iter().flatten() {
                let _ = writeln!(out, "-A {chain} {rule}");
            }
        }
        out.push_str("COMMIT\n");
    }
    out
}

/// The match of one frontend: kube-proxy's `iptablesCommonPortalArgs`, and a source range.
fn portal(
    comment: &str,
    proto: &str,
    dport: u16,
    dest: Option<IpAddr>,
    source: Option<Cidr>,
) -> String {
    let mut rule =
        format!("-m comment --comment \"{comment}\" -p {proto} -m {proto} --dport {dport}");
    if let Some(ip) = dest {
        let len = if ip.is_ipv4() { 32 } else { 128 };
        let _ = write!(rule, " -d {ip}/{len}");
    }
    if let Some(range) = source {
        let _ = write!(rule, " -s {range}");
    }
    rule
}

/// The rules of one Service port.
fn service_rules(
    state: &DesiredState,
    settings: &Settings,
    spn: &ServicePortName,
    port: &ServicePort,
    proxy: &ProxyPorts,
    rules: &mut Rules,
) {
    let name = spn.to_string();
    let proto = match port.protocol {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => return,
    };
    let family = settings.family;
    let to_node = |proxy_port: u16| host_port(&settings.node_ip.to_string(), proxy_port);
    let mut cluster_endpoints = state.usable_endpoints(spn, false);
    cluster_endpoints.retain(|ep| family.has(ep.ip));
    // What a frontend whose listener has no endpoints does (None: it has some).
    let verdict = |listener: Listener| {
        let local = match listener {
            Listener::Internal => port.internal_traffic_local,
            Listener::External => port.external_traffic_local,
        };
        if !endpoints(state, spn, port, listener, family).is_empty() {
            None
        } else if local && !cluster_endpoints.is_empty() {
            Some(("has no local endpoints", "DROP"))
        } else {
            Some(("has no endpoints", "REJECT"))
        }
    };
    // Only these sources may reach the load balancer IPs (all when None).
    let ranges: Option<Vec<Cidr>> = (!port.source_ranges.is_empty()).then(|| {
        let mut ranges = port.source_ranges.to_vec();
        ranges.retain(|r| r.family() == family);
        ranges
    });

    let frontends = family
        .filter(&port.cluster_ips)
        .into_iter()
        .map(|ip| (ip, Listener::Internal, false))
        .chain(
            family
                .filter(&port.external_ips)
                .into_iter()
                .map(|ip| (ip, Listener::External, false)),
        )
        .chain(
            family
                .filter(&port.load_balancer_ips)
                .into_iter()
                .map(|ip| (ip, Listener::External, true)),
        );
    for (ip, listener, load_balancer) in frontends {
        if let Some((why, target)) = verdict(listener) {
            rules.add(
                FIREWALL,
                format!(
                    "{} -j {target}",
                    portal(&format!("{name} {why}"), proto, port.port, Some(ip), None)
                ),
            );
            continue;
        }
        let proxy_port = proxy.of(listener);
        let sources: Vec<Option<Cidr>> = match &ranges {
            Some(ranges) if load_balancer => ranges.iter().copied().map(Some).collect(),
            _ => vec![None],
        };
        for source in sources {
            let matched = portal(&name, proto, port.port, Some(ip), source);
            rules.add(
                CONTAINER_PORTALS,
                format!("{matched} -j REDIRECT --to-ports {proxy_port}"),
            );
            rules.add(
                HOST_PORTALS,
                format!("{matched} -j DNAT --to-destination {}", to_node(proxy_port)),
            );
        }
        if load_balancer && ranges.is_some() {
            let comment = format!("{name} traffic not accepted by loadBalancerSourceRanges");
            rules.add(
                FIREWALL,
                format!(
                    "{} -j DROP",
                    portal(&comment, proto, port.port, Some(ip), None)
                ),
            );
        }
    }

    if let Some(node_port) = port.node_port {
        // None: every local address, as the jumps to the chains match.
        let addresses: Vec<Option<IpAddr>> = match &settings.node_port_addresses {
            None => vec![None],
            Some(addrs) => addrs.iter().copied().map(Some).collect(),
        };
        match verdict(Listener::External) {
            Some((why, target)) => {
                for addr in addresses {
                    let local = if addr.is_none() {
                        " -m addrtype --dst-type LOCAL"
                    } else {
                        ""
                    };
                    rules.add(
                        FIREWALL,
                        format!(
                            "{}{local} -j {target}",
                            portal(&format!("{name} {why}"), proto, node_port, addr, None)
                        ),
                    );
                }
            }
            None => {
                let proxy_port = proxy.of(Listener::External);
                for addr in addresses {
                    let matched = portal(&name, proto, node_port, addr, None);
                    rules.add(
                        CONTAINER_NODEPORTS,
                        format!("{matched} -j REDIRECT --to-ports {proxy_port}"),
                    );
                    rules.add(
                        HOST_NODEPORTS,
                        format!("{matched} -j DNAT --to-destination {}", to_node(proxy_port)),
                    );
                }
                rules.add(
                    NON_LOCAL_NODEPORTS,
                    format!(
                        "{} -m conntrack --ctstate NEW -j ACCEPT",
                        portal(&name, proto, proxy_port, None, None)
                    ),
                );
            }
        }
    }
    if let Some(hc) = port.health_check_node_port.map(u16::from) {
        rules.add(
            NON_LOCAL_NODEPORTS,
            format!(
                "{} -m conntrack --ctstate NEW -j ACCEPT",
                portal(
                    &format!("{name} health check node port"),
                    "tcp",
                    hc,
                    None,
                    None
                )
            ),
        );
    }
}

/// Proxy ports as the dataplane would open them for `family`, numbered from 40001 in order
/// (the golden files' and inspect's tests).
#[cfg(test)]
pub(crate) fn numbered_ports(
    state: &DesiredState,
    family: Family,
) -> BTreeMap<ServicePortName, ProxyPorts> {
    let mut next = 40000;
    let mut take = || {
        next += 1;
        next
    };
    state
        .ports()
        .filter(|(_, port)| proxied(port, family))
        .map(|(spn, port)| {
            let internal = take();
            let external = needs_external_listener(port, family).then(&mut take);
            (spn.clone(), ProxyPorts { internal, external })
        })
        .collect()
}

/// The settings the golden files are rendered with: node1's address of `family` answering
/// NodePorts.
#[cfg(test)]
pub(crate) fn settings_of(family: Family) -> Settings {
    let node_ip: IpAddr = match family {
        Family::V4 => "192.0.2.11",
        Family::V6 => "2001:db8:192:2::11",
    }
    .parse()
    .unwrap();
    Settings {
        family,
        node_ip,
        node_port_addresses: Some(vec![node_ip]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{fixture, golden};

    const FIXTURE: &str = crate::testing::SERVICES;

    fn spn(ns: &str, name: &str, port: &str) -> ServicePortName {
        ServicePortName::new(
            crate::model::NamespacedName::new(ns, name),
            port,
            Protocol::Tcp,
        )
    }

    fn ports_of(state: &DesiredState) -> BTreeMap<ServicePortName, ProxyPorts> {
        numbered_ports(state, Family::V4)
    }

    fn settings() -> Settings {
        settings_of(Family::V4)
    }

    #[test]
    fn rules_match_the_golden_file() {
        let state = fixture(FIXTURE);
        let text = render(&state, &settings(), &ports_of(&state));
        golden("modes/userspace", "rules.golden", &text);
    }

    /// Each family's rules for the dual-stack fixture: the dual-stack Service's half of the
    /// family, the single-stack ones in their family only.
    #[test]
    fn dual_stack_rules_match_the_golden_files() {
        let state = fixture(crate::testing::DUAL_STACK);
        let render = |family| {
            render(
                &state,
                &settings_of(family),
                &numbered_ports(&state, family),
            )
        };
        let (v4, v6) = (render(Family::V4), render(Family::V6));
        golden("modes/userspace", "dual_stack_ipv4.golden", &v4);
        golden("modes/userspace", "dual_stack_ipv6.golden", &v6);
        assert!(!v4.contains("fd00:") && !v4.contains("2001:"), "{v4}");
        assert!(!v6.contains("shop/web") && !v6.contains(" 10."), "{v6}");
        for want in [
            "-d fd00:10:96::20/128 -j REDIRECT --to-ports 4000",
            "-j DNAT --to-destination [2001:db8:192:2::11]:4000",
            "-s 2001:db8:192:2::/64 -j REDIRECT",
        ] {
            assert!(v6.contains(want), "no {want:?} in:\n{v6}");
        }
    }

    /// Both families' rules, as the kernel's tools take them.
    #[test]
    fn dual_stack_rules_restore() {
        let test = "modes::userspace::rules::tests::dual_stack_rules_restore";
        let rules = |family| {
            let state = fixture(crate::testing::DUAL_STACK);
            render(
                &state,
                &settings_of(family),
                &numbered_ports(&state, family),
            )
        };
        for (tables, saved) in crate::testing::saved_in_each_tables(test, &Family::ALL, rules) {
            let to_node = match tables.family {
                Family::V4 => "--to-destination 192.0.2.11:4000",
                Family::V6 => "--to-destination [2001:db8:192:2::11]:4000",
            };
            assert!(
                saved.contains(to_node),
                "{tables:?}: no {to_node}:\n{saved}"
            );
        }
    }

    #[test]
    fn listeners_follow_the_traffic_policies() {
        let state = fixture(FIXTURE);
        let ports = ports_of(&state);
        // externalTrafficPolicy Local beside internalTrafficPolicy Cluster: two sockets.
        let local = spn("shop", "local", "");
        assert!(ports[&local].external.is_some());
        let port = &state.port(&local).unwrap();
        let addr = |last| SocketAddr::from(([10, 244, 1, last], 8080));
        let cluster = endpoints(&state, &local, port, Listener::Internal, Family::V4);
        assert_eq!(cluster.len(), 2);
        assert_eq!(
            endpoints(&state, &local, port, Listener::External, Family::V4),
            [addr(13)],
            "only node1's"
        );
        // Both policies Local: one socket, this node's endpoints (none here).
        let elsewhere = spn("shop", "elsewhere", "");
        assert_eq!(ports[&elsewhere].external, None);
        let port = &state.port(&elsewhere).unwrap();
        assert!(endpoints(&state, &elsewhere, port, Listener::Internal, Family::V4).is_empty());
        // Both Cluster: one socket.
        assert_eq!(ports[&spn("shop", "front", "")].external, None);
    }

    #[test]
    fn every_local_address_and_missing_ports() {
        let state = fixture(FIXTURE);
        let every = Settings {
            node_port_addresses: None,
            ..settings()
        };
        let mut ports = ports_of(&state);
        let text = render(&state, &every, &ports);
        assert!(text.contains(
            "-A KUBE-NODEPORT-CONTAINER -m comment --comment \"shop/front\" -p tcp -m tcp --dport 30080 -j REDIRECT --to-ports "
        ), "{text}");
        assert!(text.contains(
            "-A KUBE-PORTALS-FIREWALL -m comment --comment \"shop/empty has no endpoints\" -p tcp -m tcp --dport 30083 -m addrtype --dst-type LOCAL -j REJECT"
        ), "{text}");
        // A Service port without a proxy socket gets no rules.
        ports.remove(&spn("shop", "web", "http"));
        let text = render(&state, &every, &ports);
        assert!(!text.contains("shop/web"), "{text}");
        // Nothing at all: the chains, emptied.
        let text = render(&state, &every, &BTreeMap::new());
        assert_eq!(
            text,
            "*filter\n:KUBE-PORTALS-FIREWALL - [0:0]\n:KUBE-NODEPORT-NON-LOCAL - [0:0]\nCOMMIT\n\
             *nat\n:KUBE-PORTALS-CONTAINER - [0:0]\n:KUBE-PORTALS-HOST - [0:0]\n\
             :KUBE-NODEPORT-CONTAINER - [0:0]\n:KUBE-NODEPORT-HOST - [0:0]\nCOMMIT\n"
        );
    }
}
