//! What the maps should hold for a desired state: each Service port's frontends, with slot 0
//! (flags, affinity) and the backends in slot order, and a load balancer's source ranges. A
//! pure function of the state, as the other modes' `rules.rs`, golden-tested so that every
//! change of what is programmed shows in review. The writer ([`super::writer`]) gives the
//! backends their ids and applies a plan in a safe order.
use std::{fmt::Write as _, net::IpAddr};

use proxy_common::{
    Addr, BACKEND_LOCAL, Backend, Be16, Be32, Be128, SCOPE_INTERNAL, SERVICE_AFFINITY,
    SERVICE_EXTERNAL, SERVICE_LOAD_BALANCER, SERVICE_LOCAL_ONLY, SERVICE_MAGLEV,
    SERVICE_SOURCE_RANGES, SERVICE_TWO_SCOPES, ServiceKey, ServiceValue,
};

use crate::model::{
    DesiredState, Endpoint, Family, LbAlgorithm, Protocol, ServicePort, ServicePortName,
};

/// A service address as the datapath matches it: slot 0 of the services map.
pub type Frontend<A = Be32> = ServiceKey<A>;

/// The model's name of the address family `A`.
pub fn family_of<A: Addr>() -> Family {
    match A::NODE_PORT.ip() {
        IpAddr::V4(_) => Family::V4,
        IpAddr::V6(_) => Family::V6,
    }
}

/// `endpoints` of family `A` as backends of a port of `protocol` (flagged local when on this
/// node); the other family's are another writer's.
pub(super) fn as_backends<'a, A: Addr>(
    state: &DesiredState,
    endpoints: impl IntoIterator<Item = &'a Endpoint>,
    protocol: Protocol,
) -> Vec<Backend<A>> {
    endpoints
        .into_iter()
        .filter_map(|ep| {
            Some(Backend {
                addr: A::from_ip(ep.ip)?,
                port: Be16::new(ep.port),
                proto: protocol.number(),
                flags: if state.is_local(ep) { BACKEND_LOCAL } else { 0 },
            })
        })
        .collect()
}

/// Every endpoint the state lists for `spn`, usable or not.
pub(super) fn listed_backends<A: Addr>(
    state: &DesiredState,
    spn: &ServicePortName,
) -> Vec<Backend<A>> {
    state.port(spn).map_or_else(Vec::new, |sp| {
        as_backends(state, state.endpoints_of(spn), sp.protocol)
    })
}

/// A frontend as a service port wants it: slot 0 (flags, affinity) and the backends.
pub struct FrontendPlan<A = Be32> {
    pub fe: Frontend<A>,
    /// Slot 0 without its count (the writer sets it).
    pub head: ServiceValue,
    pub backends: Vec<Backend<A>>,
    /// loadBalancerSourceRanges of family `A` (with [`SERVICE_SOURCE_RANGES`] in the head).
    pub source_ranges: Vec<(IpAddr, u8)>,
}

/// The frontends of family `A` a service port should have, each with its slot 0 and backends, new flows
/// picking by `lb_algorithm` unless the Service says otherwise: its cluster IPs, and where the
/// Service is reachable from outside, its NodePort (on every node address), external IPs and
/// load balancer addresses. With externalTrafficPolicy Local, those hold only this node's
/// endpoints, and a second scope holds every endpoint for clients inside the cluster. TCP and
/// UDP only: SCTP ports are kept in the model and skipped here. A port without a cluster IP of
/// family `A` has none of its frontends (kube-proxy's proxier of that family serves only the
/// ports with one).
pub fn frontends<A: Addr>(
    state: &DesiredState,
    spn: &ServicePortName,
    lb_algorithm: LbAlgorithm,
) -> Vec<FrontendPlan<A>> {
    let served =
        |sp: &&ServicePort| sp.protocol != Protocol::Sctp && sp.in_family(family_of::<A>());
    let Some(sp) = state.port(spn).filter(served) else {
        return Vec::new();
    };
    let proto = sp.protocol.number();
    let of_family = |ips: &[IpAddr]| {
        ips.iter()
            .filter_map(|ip| A::from_ip(*ip))
            .collect::<Vec<A>>()
    };
    let mut policy = 0;
    if sp.session_affinity_timeout.is_some() {
        policy |= SERVICE_AFFINITY;
    }
    if sp.lb_algorithm.unwrap_or(lb_algorithm) == LbAlgorithm::Maglev {
        policy |= SERVICE_MAGLEV;
    }
    let head = |flags: u16| {
        ServiceValue::head(
            0,
            policy | flags,
            sp.session_affinity_timeout.map_or(0, u32::from),
        )
    };
    let internal_flags = if sp.internal_traffic_local {
        SERVICE_LOCAL_ONLY
    } else {
        0
    };
    let cluster = as_backends(state, state.cluster_endpoints(spn), sp.protocol);
    let mut wanted: Vec<FrontendPlan<A>> = of_family(&sp.cluster_ips)
        .into_iter()
        .map(|addr| FrontendPlan {
            fe: ServiceKey::new(addr, Be16::new(sp.port), proto, 0),
            head: head(internal_flags),
            backends: cluster.clone(),
            source_ranges: Vec::new(),
        })
        .collect();

    let mut external: Vec<(ServiceKey<A>, bool)> = Vec::new();
    if let Some(node_port) = sp.node_port {
        external.push((
            ServiceKey::new(A::NODE_PORT, Be16::new(node_port), proto, 0),
            false,
        ));
    }
    for addr in of_family(&sp.external_ips) {
        external.push((ServiceKey::new(addr, Be16::new(sp.port), proto, 0), false));
    }
    for addr in of_family(&sp.load_balancer_ips) {
        external.push((ServiceKey::new(addr, Be16::new(sp.port), proto, 0), true));
    }
    if external.is_empty() {
        return wanted;
    }
    let ranges: Vec<(IpAddr, u8)> = sp
        .source_ranges
        .iter()
        .filter(|c| A::from_ip(c.addr).is_some())
        .map(|c| (c.addr, c.len))
        .collect();
    // The other family's ranges only: no source of this family may use the addresses.
    let restricted = !sp.source_ranges.is_empty();
    let external_backends = as_backends(state, state.external_endpoints(spn), sp.protocol);
    let every_endpoint = as_backends(state, state.usable_endpoints(spn, false), sp.protocol);
    for (fe, load_balancer) in external {
        let mut flags = SERVICE_EXTERNAL;
        if sp.external_traffic_local {
            flags |= SERVICE_LOCAL_ONLY | SERVICE_TWO_SCOPES;
        }
        if load_balancer {
            flags |= SERVICE_LOAD_BALANCER;
        }
        let limited = load_balancer && restricted;
        if limited {
            flags |= SERVICE_SOURCE_RANGES;
        }
        if sp.external_traffic_local {
            // Pods and host clients reach it there, held to the same ranges (kube-proxy's
            // firewall applies to every source), which the head's entries hold for both.
            // Planned (so written) before the head that sends them there.
            wanted.push(FrontendPlan {
                fe: fe.with_scope(SCOPE_INTERNAL),
                head: head(flags & (SERVICE_LOAD_BALANCER | SERVICE_SOURCE_RANGES)),
                backends: every_endpoint.clone(),
                source_ranges: Vec::new(),
            });
        }
        wanted.push(FrontendPlan {
            fe,
            head: head(flags),
            backends: external_backends.clone(),
            source_ranges: if limited { ranges.clone() } else { Vec::new() },
        });
    }
    wanted
}

/// Flags of slot 0 by name, as [`render`] shows them.
const FLAG_NAMES: [(u16, &str); 7] = [
    (SERVICE_LOCAL_ONLY, "local-only"),
    (SERVICE_AFFINITY, "affinity"),
    (SERVICE_MAGLEV, "maglev"),
    (SERVICE_EXTERNAL, "external"),
    (SERVICE_TWO_SCOPES, "two-scopes"),
    (SERVICE_SOURCE_RANGES, "source-ranges"),
    (SERVICE_LOAD_BALANCER, "load-balancer"),
];

/// The plan of every service port of `state`, one line a frontend: its address, slot 0's
/// flags (and affinity timeout), its backends in slot order (`L`: on this node) and its
/// source ranges.
pub fn render(state: &DesiredState, lb_algorithm: LbAlgorithm) -> String {
    let mut out = String::new();
    for spn in state.port_names() {
        let _ = writeln!(out, "{spn}/{}", spn.protocol);
        for plan in frontends::<Be32>(state, spn, lb_algorithm) {
            let _ = writeln!(out, "  {}", show(&plan));
        }
        for plan in frontends::<Be128>(state, spn, lb_algorithm) {
            let _ = writeln!(out, "  {}", show(&plan));
        }
    }
    out
}

/// One frontend of a plan, as [`render`] shows it.
fn show<A: Addr>(plan: &FrontendPlan<A>) -> String {
    let mut line = describe(&plan.fe);
    let flags: Vec<&str> = FLAG_NAMES
        .iter()
        .filter(|(flag, _)| plan.head.flags & flag != 0)
        .map(|(_, name)| *name)
        .collect();
    if !flags.is_empty() {
        let _ = write!(line, " [{}]", flags.join(" "));
    }
    if plan.head.flags & SERVICE_AFFINITY != 0 {
        let _ = write!(line, " timeout {}s", plan.head.backend_id);
    }
    let backends: Vec<String> = plan
        .backends
        .iter()
        .map(|b| {
            let local = if b.flags & BACKEND_LOCAL != 0 {
                " L"
            } else {
                ""
            };
            format!(
                "{}{local}",
                std::net::SocketAddr::new(b.addr.ip(), b.port.get())
            )
        })
        .collect();
    let _ = write!(
        line,
        " -> {}",
        match backends.is_empty() {
            true => "(none)".to_owned(),
            false => backends.join(", "),
        }
    );
    if !plan.source_ranges.is_empty() {
        let ranges: Vec<String> = plan
            .source_ranges
            .iter()
            .map(|(addr, len)| format!("{addr}/{len}"))
            .collect();
        let _ = write!(line, " from {}", ranges.join(", "));
    }
    line
}

/// A frontend in words, for errors and the plan's golden file.
pub(super) fn describe<A: Addr>(key: &ServiceKey<A>) -> String {
    let addr = match key.addr.ip() {
        _ if key.addr == A::NODE_PORT => "node port ".to_string(),
        IpAddr::V4(ip) => ip.to_string(),
        IpAddr::V6(ip) => format!("[{ip}]"),
    };
    let scope = if key.scope == SCOPE_INTERNAL {
        " (internal scope)"
    } else {
        ""
    };
    format!(
        "{addr}:{}/{}{scope}",
        key.port.get(),
        Protocol::from_number(key.proto).map_or("?", Protocol::name)
    )
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::model::{Cidr, Endpoint, NamespacedName, Placement, ServicePort, TargetPort};

    fn endpoint(ip: &str, node: &str) -> Endpoint {
        Endpoint {
            ip: ip.parse().unwrap(),
            port: 8080,
            ready: true,
            serving: true,
            terminating: false,
            placement: Placement::shared(Some(node), None),
        }
    }

    /// A LoadBalancer Service with one endpoint on this node and one elsewhere.
    fn state(external_local: bool, ranges: &[(&str, u8)]) -> (DesiredState, ServicePortName) {
        let spn = ServicePortName::new(NamespacedName::new("ns", "lb"), "", Protocol::Tcp);
        let mut state = DesiredState::new("node1");
        state.insert_port(
            spn.clone(),
            ServicePort {
                cluster_ips: ["10.96.0.1".parse().unwrap()].into(),
                port: 80,
                protocol: Protocol::Tcp,
                target_port: TargetPort::Number(8080),
                node_port: Some(30080),
                external_ips: [
                    "198.51.100.1".parse().unwrap(),
                    "2001:db8::1".parse().unwrap(),
                ]
                .into(),
                load_balancer_ips: ["203.0.113.1".parse().unwrap()].into(),
                session_affinity_timeout: None,
                external_traffic_local: external_local,
                internal_traffic_local: false,
                lb_algorithm: None,
                source_ranges: ranges
                    .iter()
                    .map(|(ip, len)| Cidr {
                        addr: ip.parse().unwrap(),
                        len: *len,
                    })
                    .collect(),
                health_check_node_port: None,
            },
        );
        state.set_endpoints(
            spn.clone(),
            vec![
                endpoint("10.244.1.5", "node1"),
                endpoint("10.244.2.5", "node2"),
            ],
        );
        (state, spn)
    }

    /// Each frontend as `address:port scope flags [backend addresses (L = local)] ranges`.
    fn shown(state: &DesiredState, spn: &ServicePortName) -> Vec<String> {
        frontends::<Be32>(state, spn, LbAlgorithm::Random)
            .iter()
            .map(|w| {
                let backends: Vec<String> = w
                    .backends
                    .iter()
                    .map(|b| {
                        let local = if b.flags & BACKEND_LOCAL != 0 {
                            "L"
                        } else {
                            ""
                        };
                        format!("{}{local}", b.addr.ip())
                    })
                    .collect();
                format!(
                    "{} scope {} flags {} [{}] {:?}",
                    describe(&w.fe),
                    w.fe.scope,
                    w.head.flags,
                    backends.join(" "),
                    w.source_ranges
                )
            })
            .collect()
    }

    #[test]
    fn external_frontends_with_the_cluster_policy() {
        let (state, spn) = state(false, &[("192.0.2.0", 24), ("2001:db8::", 32)]);
        let ext = SERVICE_EXTERNAL;
        let lb = SERVICE_EXTERNAL | SERVICE_LOAD_BALANCER | SERVICE_SOURCE_RANGES;
        assert_eq!(
            shown(&state, &spn),
            [
                "10.96.0.1:80/TCP scope 0 flags 0 [10.244.1.5L 10.244.2.5] []".to_string(),
                format!("node port :30080/TCP scope 0 flags {ext} [10.244.1.5L 10.244.2.5] []"),
                format!("198.51.100.1:80/TCP scope 0 flags {ext} [10.244.1.5L 10.244.2.5] []"),
                format!(
                    "203.0.113.1:80/TCP scope 0 flags {lb} [10.244.1.5L 10.244.2.5] \
                     [(192.0.2.0, 24)]"
                ),
            ]
        );
    }

    #[test]
    fn external_frontends_with_the_local_policy_have_an_in_cluster_scope() {
        let (state, spn) = state(true, &[]);
        let local = SERVICE_EXTERNAL | SERVICE_LOCAL_ONLY | SERVICE_TWO_SCOPES;
        let shown = shown(&state, &spn);
        assert_eq!(shown.len(), 7, "{shown:#?}");
        assert_eq!(
            shown[0],
            "10.96.0.1:80/TCP scope 0 flags 0 [10.244.1.5L 10.244.2.5] []"
        );
        // The in-cluster scope first: written before the head that sends pods there.
        assert_eq!(
            shown[1],
            "node port :30080/TCP (internal scope) scope 1 flags 0 [10.244.1.5L 10.244.2.5] []"
        );
        assert_eq!(
            shown[2],
            format!("node port :30080/TCP scope 0 flags {local} [10.244.1.5L] []")
        );
        let lb_in_cluster = SERVICE_LOAD_BALANCER;
        assert_eq!(
            shown[5],
            format!(
                "203.0.113.1:80/TCP (internal scope) scope 1 flags {lb_in_cluster} \
                 [10.244.1.5L 10.244.2.5] []"
            )
        );
    }

    /// The plan of the Services every mode's golden files are rendered from, as node1 sees
    /// them (session affinity, Local policies, source ranges, endpoints elsewhere, none).
    #[test]
    fn plan_matches_the_golden_file() {
        let state = crate::testing::fixture(crate::testing::SERVICES);
        let plan = render(&state, LbAlgorithm::Random);
        crate::testing::golden("modes/ebpf", "plan.golden", &plan);
    }

    /// Each family's frontends for its own maps, as kube-proxy's proxier of each family: a
    /// dual-stack Service's both halves, an IPv6-only one's IPv6 frontends (its NodePort
    /// included), each with its own family's endpoints only.
    #[test]
    fn each_family_gets_its_own_frontends() {
        let state = crate::testing::fixture(crate::testing::DUAL_STACK);
        for spn in state.port_names() {
            let v4 = frontends::<Be32>(&state, spn, LbAlgorithm::Random);
            let v6 = frontends::<Be128>(&state, spn, LbAlgorithm::Random);
            let sp = state.port(spn).unwrap();
            assert_eq!(!v4.is_empty(), sp.in_family(Family::V4), "{spn}");
            assert_eq!(!v6.is_empty(), sp.in_family(Family::V6), "{spn}");
            for plan in &v6 {
                assert!(plan.backends.iter().all(|b| b.addr.ip().is_ipv6()), "{spn}");
            }
        }
        let plan = render(&state, LbAlgorithm::Random);
        assert!(
            plan.contains("10.96.0.20:80") && plan.contains("10.244.2.11:8080"),
            "{plan}"
        );
        assert!(plan.contains("[fd00:"), "{plan}");
    }
}
