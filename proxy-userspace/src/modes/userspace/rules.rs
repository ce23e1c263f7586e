//! The iptables rules of the userspace mode, in kube-proxy's userspace layout, as one
//! `iptables-restore --noflush` input. A pure function of the state, the settings and the
//! proxy ports, so that the golden test shows every rule change in review.
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
    net::{Ipv4Addr, SocketAddrV4},
};

use crate::model::{Cidr, DesiredState, Family, Protocol, ServicePort, ServicePortName, ipv4};

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

/// What the rules depend on besides the state and the proxy ports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Where traffic from the node's own processes is DNATed to (with the proxy port): the
    /// node's primary address (kube-proxy's `hostIP`).
    pub node_ip: Ipv4Addr,
    /// The node addresses NodePorts answer on; None: every local address (`addrtype LOCAL`).
    pub node_port_addresses: Option<Vec<Ipv4Addr>>,
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

/// Whether the mode proxies `port` at all: TCP or UDP (kube-proxy's userspace mode had no
/// SCTP), with an IPv4 cluster IP (the mode is IPv4 only: kube-proxy's IPv4 proxier's ports).
pub fn proxied(port: &ServicePort) -> bool {
    port.protocol != Protocol::Sctp && port.in_family(Family::V4)
}

/// Whether `port` can be reached from outside the cluster (NodePort, external or LB IPs).
fn has_external(port: &ServicePort) -> bool {
    port.node_port.is_some()
        || !ipv4(&port.external_ips).is_empty()
        || !ipv4(&port.load_balancer_ips).is_empty()
}

/// Whether the external frontends of `port` need a proxy socket of their own: when the
/// traffic policies pick different endpoints for them than for the cluster IPs.
pub fn needs_external_listener(port: &ServicePort) -> bool {
    has_external(port) && port.external_traffic_local != port.internal_traffic_local
}

/// The endpoints `listener` of `spn` proxies to: the usable IPv4 ones, only this node's where
/// its traffic policy is Local.
pub fn endpoints(
    state: &DesiredState,
    spn: &ServicePortName,
    port: &ServicePort,
    listener: Listener,
) -> Vec<SocketAddrV4> {
    let local_only = match listener {
        Listener::Internal => port.internal_traffic_local,
        Listener::External => port.external_traffic_local,
    };
    state
        .usable_endpoints(spn, local_only)
        .iter()
        .filter_map(|ep| {
            let ip = ep.ipv4()?;
            Some(SocketAddrV4::new(ip, ep.port))
        })
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

/// The `iptables-restore --noflush` input that makes the mode's chains hold exactly the rules
/// of `state`, for the Service ports in `ports` (those with an open proxy socket).
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
    dest: Option<Ipv4Addr>,
    source: Option<(Ipv4Addr, u8)>,
) -> String {
    let mut rule =
        format!("-m comment --comment \"{comment}\" -p {proto} -m {proto} --dport {dport}");
    if let Some(ip) = dest {
        let _ = write!(rule, " -d {ip}/32");
    }
    if let Some((net, len)) = source {
        let _ = write!(rule, " -s {net}/{len}");
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
    let node_ip = settings.node_ip;
    let mut cluster_endpoints = state.usable_endpoints(spn, false);
    cluster_endpoints.retain(|ep| ep.ip.is_ipv4());
    // What a frontend whose listener has no endpoints does (None: it has some).
    let verdict = |listener: Listener| {
        let local = match listener {
            Listener::Internal => port.internal_traffic_local,
            Listener::External => port.external_traffic_local,
        };
        if !endpoints(state, spn, port, listener).is_empty() {
            None
        } else if local && !cluster_endpoints.is_empty() {
            Some(("has no local endpoints", "DROP"))
        } else {
            Some(("has no endpoints", "REJECT"))
        }
    };
    // Only these sources may reach the load balancer IPs (all when None).
    let ranges: Option<Vec<(Ipv4Addr, u8)>> = (!port.source_ranges.is_empty())
        .then(|| port.source_ranges.iter().filter_map(Cidr::as_v4).collect());

    let frontends = ipv4(&port.cluster_ips)
        .into_iter()
        .map(|ip| (ip, Listener::Internal, false))
        .chain(
            ipv4(&port.external_ips)
                .into_iter()
                .map(|ip| (ip, Listener::External, false)),
        )
        .chain(
            ipv4(&port.load_balancer_ips)
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
        let sources: Vec<Option<(Ipv4Addr, u8)>> = match &ranges {
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
                format!("{matched} -j DNAT --to-destination {node_ip}:{proxy_port}"),
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
        let addresses: Vec<Option<Ipv4Addr>> = match &settings.node_port_addresses {
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
                        format!("{matched} -j DNAT --to-destination {node_ip}:{proxy_port}"),
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
    if let Some(hc) = port.health_check_node_port {
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

    /// Proxy ports as the dataplane would open them, numbered from 40001 in order.
    fn ports_of(state: &DesiredState) -> BTreeMap<ServicePortName, ProxyPorts> {
        let mut next = 40000;
        let mut take = || {
            next += 1;
            next
        };
        state
            .ports()
            .filter(|(_, port)| proxied(port))
            .map(|(spn, port)| {
                let internal = take();
                let external = needs_external_listener(port).then(&mut take);
                (spn.clone(), ProxyPorts { internal, external })
            })
            .collect()
    }

    fn settings() -> Settings {
        Settings {
            node_ip: Ipv4Addr::new(192, 0, 2, 11),
            node_port_addresses: Some(vec![Ipv4Addr::new(192, 0, 2, 11)]),
        }
    }

    #[test]
    fn rules_match_the_golden_file() {
        let state = fixture(FIXTURE);
        let text = render(&state, &settings(), &ports_of(&state));
        golden("modes/userspace", "rules.golden", &text);
    }

    #[test]
    fn listeners_follow_the_traffic_policies() {
        let state = fixture(FIXTURE);
        let ports = ports_of(&state);
        // externalTrafficPolicy Local beside internalTrafficPolicy Cluster: two sockets.
        let local = spn("shop", "local", "");
        assert!(ports[&local].external.is_some());
        let port = &state.port(&local).unwrap();
        let addr = |last| SocketAddrV4::new(Ipv4Addr::new(10, 244, 1, last), 8080);
        let cluster = endpoints(&state, &local, port, Listener::Internal);
        assert_eq!(cluster.len(), 2);
        assert_eq!(
            endpoints(&state, &local, port, Listener::External),
            [addr(13)],
            "only node1's"
        );
        // Both policies Local: one socket, this node's endpoints (none here).
        let elsewhere = spn("shop", "elsewhere", "");
        assert_eq!(ports[&elsewhere].external, None);
        let port = &state.port(&elsewhere).unwrap();
        assert!(endpoints(&state, &elsewhere, port, Listener::Internal).is_empty());
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
