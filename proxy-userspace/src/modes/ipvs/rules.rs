//! What kube-proxy's IPVS mode programs for a desired state, as pure functions of the state and
//! the settings, so that the golden tests show every change in review:
//!
//! - [`plan`]: the IPVS virtual servers (one per frontend address, protocol and port: cluster
//!   IPs, external IPs, load balancer IPs, and each NodePort on each node address) with their
//!   real servers, the addresses bound to `kube-ipvs0`, and the ipset entries;
//! - [`ipset_restore`]: the ipsets, as one `ipset restore` input (each set refilled through a
//!   temporary set and swapped in, so that no packet sees a half-written set);
//! - [`iptables_restore`]: kube-proxy's few iptables rules (its IPVS proxier's
//!   `writeIptablesRules`), which match those sets: masquerade what needs it (off-cluster
//!   sources to cluster IPs, NodePorts, load balancer and external IPs unless their traffic
//!   policy is Local, hairpin connections), drop load balancer traffic from outside its source
//!   ranges, and refuse new connections to a service address on a port that is not a Service's.
//!
//! IPVS does the load balancing and the DNAT itself; a virtual server without real servers
//! answers with an ICMP port unreachable (the client's connection is refused), so there is no
//! reject rule per Service as in the iptables mode.
//!
//! Each family has its own plan, as kube-proxy has a proxier a family: the IPv6 one's sets are
//! named `KUBE-6-...` ([`set_name`]) and its rules go through `ip6tables-restore`.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
};

use super::netlink::{FLAG_PERSISTENT, Service, ServiceKey};
use crate::{
    model::{Cidr, DesiredState, Endpoint, Family, Protocol, ServicePortName},
    netfilter::rules::MASQ_MARK,
};

/// What the plan of one family depends on besides the state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub family: Family,
    /// `--ipvs-scheduler`.
    pub scheduler: String,
    /// `--cluster-cidr` (its range of the family): traffic from outside it to a cluster IP is
    /// masqueraded.
    pub cluster_cidr: Option<Cidr>,
    /// `--masquerade-all`: every connection to a cluster IP is masqueraded.
    pub masquerade_all: bool,
    /// The node addresses of the family NodePorts answer on (one virtual server each).
    pub node_port_ips: Vec<IpAddr>,
    /// The node's own addresses of the family: a load balancer whose source ranges hold one
    /// of them is reachable from the node itself (kube-proxy's `allowFromNode`).
    pub node_ips: Vec<IpAddr>,
}

/// One ipset: its name, type, and the comment its iptables rules carry (kube-proxy's).
pub struct SetDef {
    pub name: &'static str,
    pub kind: &'static str,
    pub comment: &'static str,
}

pub const LOOP_BACK: &str = "KUBE-LOOP-BACK";
pub const CLUSTER_IP: &str = "KUBE-CLUSTER-IP";
pub const EXTERNAL_IP: &str = "KUBE-EXTERNAL-IP";
pub const EXTERNAL_IP_LOCAL: &str = "KUBE-EXTERNAL-IP-LOCAL";
pub const LOAD_BALANCER: &str = "KUBE-LOAD-BALANCER";
pub const LOAD_BALANCER_FW: &str = "KUBE-LOAD-BALANCER-FW";
pub const LOAD_BALANCER_LOCAL: &str = "KUBE-LOAD-BALANCER-LOCAL";
pub const LOAD_BALANCER_SOURCE_IP: &str = "KUBE-LOAD-BALANCER-SOURCE-IP";
pub const LOAD_BALANCER_SOURCE_CIDR: &str = "KUBE-LOAD-BALANCER-SOURCE-CIDR";
pub const NODE_PORT_TCP: &str = "KUBE-NODE-PORT-TCP";
pub const NODE_PORT_LOCAL_TCP: &str = "KUBE-NODE-PORT-LOCAL-TCP";
pub const NODE_PORT_UDP: &str = "KUBE-NODE-PORT-UDP";
pub const NODE_PORT_LOCAL_UDP: &str = "KUBE-NODE-PORT-LOCAL-UDP";
pub const NODE_PORT_SCTP: &str = "KUBE-NODE-PORT-SCTP-HASH";
pub const NODE_PORT_LOCAL_SCTP: &str = "KUBE-NODE-PORT-LOCAL-SCTP-HASH";
pub const HEALTH_CHECK_NODE_PORT: &str = "KUBE-HEALTH-CHECK-NODE-PORT";
pub const IPVS_IPS: &str = "KUBE-IPVS-IPS";

/// kube-proxy's ipsets, in its order (their IPv4 names: see [`set_name`]).
#[rustfmt::skip]
pub const SETS: &[SetDef] = &[
    SetDef { name: LOOP_BACK, kind: "hash:ip,port,ip", comment: "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose" },
    SetDef { name: CLUSTER_IP, kind: "hash:ip,port", comment: "Kubernetes service cluster ip + port for masquerade purpose" },
    SetDef { name: EXTERNAL_IP, kind: "hash:ip,port", comment: "Kubernetes service external ip + port for masquerade and filter purpose" },
    SetDef { name: EXTERNAL_IP_LOCAL, kind: "hash:ip,port", comment: "Kubernetes service external ip + port with externalTrafficPolicy=local" },
    SetDef { name: LOAD_BALANCER, kind: "hash:ip,port", comment: "Kubernetes service lb portal" },
    SetDef { name: LOAD_BALANCER_FW, kind: "hash:ip,port", comment: "Kubernetes service load balancer ip + port for load balancer with sourceRange" },
    SetDef { name: LOAD_BALANCER_LOCAL, kind: "hash:ip,port", comment: "Kubernetes service load balancer ip + port with externalTrafficPolicy=local" },
    SetDef { name: LOAD_BALANCER_SOURCE_IP, kind: "hash:ip,port,ip", comment: "Kubernetes service load balancer ip + port + source IP for packet filter purpose" },
    SetDef { name: LOAD_BALANCER_SOURCE_CIDR, kind: "hash:ip,port,net", comment: "Kubernetes service load balancer ip + port + source cidr for packet filter purpose" },
    SetDef { name: NODE_PORT_TCP, kind: "bitmap:port", comment: "Kubernetes nodeport TCP port for masquerade purpose" },
    SetDef { name: NODE_PORT_LOCAL_TCP, kind: "bitmap:port", comment: "Kubernetes nodeport TCP port with externalTrafficPolicy=local" },
    SetDef { name: NODE_PORT_UDP, kind: "bitmap:port", comment: "Kubernetes nodeport UDP port for masquerade purpose" },
    SetDef { name: NODE_PORT_LOCAL_UDP, kind: "bitmap:port", comment: "Kubernetes nodeport UDP port with externalTrafficPolicy=local" },
    SetDef { name: NODE_PORT_SCTP, kind: "hash:ip,port", comment: "Kubernetes nodeport SCTP port for masquerade purpose with type 'hash ip:port'" },
    SetDef { name: NODE_PORT_LOCAL_SCTP, kind: "hash:ip,port", comment: "Kubernetes nodeport SCTP port with externalTrafficPolicy=local with type 'hash ip:port'" },
    SetDef { name: HEALTH_CHECK_NODE_PORT, kind: "bitmap:port", comment: "Kubernetes health check node port" },
    SetDef { name: IPVS_IPS, kind: "hash:ip", comment: "Kubernetes service IP list" },
];

fn set_def(name: &str) -> &'static SetDef {
    SETS.iter().find(|s| s.name == name).expect("a known set")
}

/// The name of the set `name` (of [`SETS`], or a temporary one) in `family`: kube-proxy's IPv6
/// sets are `KUBE-6-...`, cut to ipset's 31 characters.
pub fn set_name(name: &str, family: Family) -> String {
    match (family, name.strip_prefix("KUBE-")) {
        (Family::V6, Some(rest)) => {
            let mut v6 = format!("KUBE-6-{rest}");
            v6.truncate(31);
            v6
        }
        _ => name.to_owned(),
    }
}

/// One planned virtual server: the service, its real servers, and the Service port it serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VirtualServer {
    pub service: Service,
    pub dests: BTreeSet<(IpAddr, u16)>,
    pub owner: ServicePortName,
}

/// Everything the mode programs for one state in one family.
#[derive(Debug)]
pub struct Plan {
    pub family: Family,
    pub virtual_servers: BTreeMap<ServiceKey, VirtualServer>,
    /// The addresses bound to `kube-ipvs0`: cluster, external and load balancer IPs.
    pub bind: BTreeSet<IpAddr>,
    /// Each set's entries, in `ipset` syntax, by the set's IPv4 name; every set of [`SETS`] is
    /// present.
    pub sets: BTreeMap<&'static str, BTreeSet<String>>,
    /// Load balancer frontends (address, protocol, port) whose source ranges leave out the
    /// node: the node's own connections to them are dropped (`KUBE-IPVS-OUT-FILTER`).
    pub no_node_access: BTreeSet<(IpAddr, &'static str, u16)>,
}

impl Plan {
    fn add(&mut self, set: &'static str, entry: String) {
        self.sets.entry(set).or_default().insert(entry);
    }

    fn is_empty(&self, set: &str) -> bool {
        self.sets.get(set).is_none_or(BTreeSet::is_empty)
    }
}

/// The endpoint addresses of `endpoints` (of one family).
fn dests(endpoints: &[&Endpoint]) -> BTreeSet<(IpAddr, u16)> {
    endpoints.iter().map(|ep| (ep.ip, ep.port)).collect()
}

/// An address and port in `ipset` syntax's order: `10.0.0.1,tcp:80` (IPv6 unbracketed).
fn ip_port_entry(ip: IpAddr, proto: &str, port: u16) -> String {
    format!("{ip},{proto}:{port}")
}

/// The virtual servers, bound addresses and set entries of `state` in `settings.family`
/// (kube-proxy's IPVS `syncProxyRules` of that family's proxier).
///
/// Real servers follow kube-proxy's `syncEndpoint`: the usable endpoints (ready, else serving
/// and terminating); for a frontend whose traffic policy is Local (cluster IPs with
/// internalTrafficPolicy Local; NodePorts, external and load balancer IPs with
/// externalTrafficPolicy Local) only this node's, and when this node has none, the cluster's
/// where the Service uses them, so that pods on this node still reach the Service (kube-proxy
/// #97081; traffic from outside then reaches an endpoint without masquerade, and its reply is
/// lost, as with kube-proxy).
pub fn plan(state: &DesiredState, settings: &Settings) -> Plan {
    let family = settings.family;
    let mut plan = Plan {
        family,
        virtual_servers: BTreeMap::new(),
        bind: BTreeSet::new(),
        sets: SETS.iter().map(|def| (def.name, BTreeSet::new())).collect(),
        no_node_access: BTreeSet::new(),
    };
    // The family's: the ports with a cluster IP of it, and their endpoints of it.
    for (spn, port) in state.ports().filter(|(_, port)| port.in_family(family)) {
        let proto = port.protocol.keyword();
        let mut cluster = state.usable_endpoints(spn, false);
        let mut local = state.usable_endpoints(spn, true);
        cluster.retain(|ep| family.has(ep.ip));
        local.retain(|ep| family.has(ep.ip));
        let external_ips = family.filter(&port.external_ips);
        let lb_ips = family.filter(&port.load_balancer_ips);
        let has_external =
            port.node_port.is_some() || !external_ips.is_empty() || !lb_ips.is_empty();
        let uses_cluster =
            !port.internal_traffic_local || (has_external && !port.external_traffic_local);
        let for_policy = |local_policy: bool| {
            if !local_policy {
                dests(&cluster)
            } else if !local.is_empty() {
                dests(&local)
            } else if uses_cluster {
                dests(&cluster)
            } else {
                BTreeSet::new()
            }
        };
        let internal = for_policy(port.internal_traffic_local);
        let external = for_policy(port.external_traffic_local);
        let (flags, timeout) = match port.session_affinity_timeout {
            Some(t) => (FLAG_PERSISTENT, t.get()),
            None => (0, 0),
        };
        // Persistence per client address: all of it (a mask for IPv4, a prefix for IPv6).
        let netmask = match family {
            Family::V4 => u32::MAX,
            Family::V6 => 128,
        };
        let add_vs = |plan: &mut Plan, addr: IpAddr, vs_port: u16, dests| {
            let key = ServiceKey {
                addr,
                protocol: port.protocol.number(),
                port: vs_port,
            };
            plan.virtual_servers
                .entry(key)
                .or_insert_with(|| VirtualServer {
                    service: Service {
                        key,
                        scheduler: settings.scheduler.clone(),
                        flags,
                        timeout,
                        netmask,
                    },
                    dests,
                    owner: spn.clone(),
                });
        };
        let ip_port = |ip: IpAddr| ip_port_entry(ip, proto, port.port);

        for ip in family.filter(&port.cluster_ips) {
            add_vs(&mut plan, ip, port.port, internal.clone());
            plan.bind.insert(ip);
            plan.add(CLUSTER_IP, ip_port(ip));
        }
        for &ip in &external_ips {
            add_vs(&mut plan, ip, port.port, external.clone());
            plan.bind.insert(ip);
            let set = if port.external_traffic_local {
                EXTERNAL_IP_LOCAL
            } else {
                EXTERNAL_IP
            };
            plan.add(set, ip_port(ip));
        }
        for &ip in &lb_ips {
            add_vs(&mut plan, ip, port.port, external.clone());
            plan.bind.insert(ip);
            plan.add(LOAD_BALANCER, ip_port(ip));
            if port.external_traffic_local {
                plan.add(LOAD_BALANCER_LOCAL, ip_port(ip));
            }
            let ranges: Vec<&Cidr> = port
                .source_ranges
                .iter()
                .filter(|range| range.family() == family)
                .collect();
            if port.source_ranges.is_empty() {
                continue;
            }
            plan.add(LOAD_BALANCER_FW, ip_port(ip));
            for range in &ranges {
                plan.add(
                    LOAD_BALANCER_SOURCE_CIDR,
                    format!("{},{range}", ip_port(ip)),
                );
            }
            let from_node = settings
                .node_ips
                .iter()
                .any(|n| ranges.iter().any(|range| range.contains(*n)));
            if from_node {
                // The node reaches the address with the address itself as source.
                plan.add(LOAD_BALANCER_SOURCE_IP, format!("{},{ip}", ip_port(ip)));
            } else {
                plan.no_node_access.insert((ip, proto, port.port));
            }
        }
        if let Some(node_port) = port.node_port {
            for &ip in &settings.node_port_ips {
                add_vs(&mut plan, ip, node_port, external.clone());
            }
            let (all, local_set) = match port.protocol {
                Protocol::Tcp => (NODE_PORT_TCP, NODE_PORT_LOCAL_TCP),
                Protocol::Udp => (NODE_PORT_UDP, NODE_PORT_LOCAL_UDP),
                Protocol::Sctp => (NODE_PORT_SCTP, NODE_PORT_LOCAL_SCTP),
            };
            let entries: Vec<String> = if port.protocol == Protocol::Sctp {
                settings
                    .node_port_ips
                    .iter()
                    .map(|ip| ip_port_entry(*ip, proto, node_port))
                    .collect()
            } else {
                vec![node_port.to_string()]
            };
            for entry in entries {
                if port.external_traffic_local {
                    plan.add(local_set, entry.clone());
                }
                plan.add(all, entry);
            }
        }
        if let Some(hc) = port.health_check_node_port {
            plan.add(HEALTH_CHECK_NODE_PORT, hc.to_string());
        }
        // Hairpin: a local endpoint reaching itself through the Service is masqueraded, so
        // that its reply comes back through IPVS.
        for ep in state.endpoints_of(spn) {
            if family.has(ep.ip) && state.is_local(ep) {
                let ip = ep.ip;
                plan.add(
                    LOOP_BACK,
                    format!("{},{ip}", ip_port_entry(ip, proto, ep.port)),
                );
            }
        }
    }
    for ip in plan.bind.clone() {
        plan.add(IPVS_IPS, ip.to_string());
    }
    plan
}

/// The temporary set that set number `i` of [`SETS`] is refilled through, in `family`.
fn temp_set(i: usize, family: Family) -> String {
    set_name(&format!("KUBE-IPVS-TMP-{i}"), family)
}

/// Whether `name` is one of the mode's sets, of either family, or a temporary one.
pub fn is_own_set(name: &str) -> bool {
    let of_family = |family| SETS.iter().any(|s| set_name(s.name, family) == name);
    Family::ALL.into_iter().any(of_family)
        || name.starts_with("KUBE-IPVS-TMP-")
        || name.starts_with("KUBE-6-IPVS-TMP-")
}

fn create_args(kind: &str, family: Family) -> &'static str {
    match (kind, family) {
        ("bitmap:port", _) => "range 0-65535",
        (_, Family::V4) => "family inet hashsize 1024 maxelem 65536",
        (_, Family::V6) => "family inet6 hashsize 1024 maxelem 65536",
    }
}

/// The `ipset restore` input that makes every set of [`SETS`] in `plan`'s family hold exactly
/// its entries: each set is created if missing, and refilled through a temporary set swapped
/// in at once.
pub fn ipset_restore(plan: &Plan) -> String {
    let mut out = String::new();
    for (i, def) in SETS.iter().enumerate() {
        let args = create_args(def.kind, plan.family);
        let name = set_name(def.name, plan.family);
        let tmp = temp_set(i, plan.family);
        let _ = writeln!(out, "create {name} {} {args} -exist", def.kind);
        let _ = writeln!(out, "create {tmp} {} {args} -exist", def.kind);
        let _ = writeln!(out, "flush {tmp}");
        for entry in plan.sets.get(def.name).into_iter().flatten() {
            let _ = writeln!(out, "add {tmp} {entry}");
        }
        let _ = writeln!(out, "swap {tmp} {name}");
        let _ = writeln!(out, "destroy {tmp}");
    }
    out
}

/// nat and filter chains of the mode: (table, chain).
#[rustfmt::skip]
pub const CHAINS: &[(&str, &str)] = &[
    ("nat", "KUBE-SERVICES"),
    ("nat", "KUBE-POSTROUTING"),
    ("nat", "KUBE-NODE-PORT"),
    ("nat", "KUBE-LOAD-BALANCER"),
    ("nat", "KUBE-MARK-MASQ"),
    ("filter", "KUBE-FORWARD"),
    ("filter", "KUBE-NODE-PORT"),
    ("filter", "KUBE-PROXY-FIREWALL"),
    ("filter", "KUBE-SOURCE-RANGES-FIREWALL"),
    ("filter", "KUBE-IPVS-FILTER"),
    ("filter", "KUBE-IPVS-OUT-FILTER"),
];

/// The rules matching the non-empty sets: (set, table, chain, protocol match, match, target),
/// kube-proxy's `ipsetWithIptablesChain`.
#[rustfmt::skip]
const SET_RULES: &[(&str, &str, &str, &str, &str, &str)] = &[
    (LOOP_BACK, "nat", "KUBE-POSTROUTING", "", "dst,dst,src", "MASQUERADE"),
    (LOAD_BALANCER, "nat", "KUBE-SERVICES", "", "dst,dst", "KUBE-LOAD-BALANCER"),
    (LOAD_BALANCER_LOCAL, "nat", "KUBE-LOAD-BALANCER", "", "dst,dst", "RETURN"),
    (NODE_PORT_LOCAL_TCP, "nat", "KUBE-NODE-PORT", "tcp", "dst", "RETURN"),
    (NODE_PORT_TCP, "nat", "KUBE-NODE-PORT", "tcp", "dst", "KUBE-MARK-MASQ"),
    (NODE_PORT_LOCAL_UDP, "nat", "KUBE-NODE-PORT", "udp", "dst", "RETURN"),
    (NODE_PORT_UDP, "nat", "KUBE-NODE-PORT", "udp", "dst", "KUBE-MARK-MASQ"),
    (NODE_PORT_LOCAL_SCTP, "nat", "KUBE-NODE-PORT", "sctp", "dst,dst", "RETURN"),
    (NODE_PORT_SCTP, "nat", "KUBE-NODE-PORT", "sctp", "dst,dst", "KUBE-MARK-MASQ"),
    (LOAD_BALANCER_FW, "filter", "KUBE-PROXY-FIREWALL", "", "dst,dst", "KUBE-SOURCE-RANGES-FIREWALL"),
    (LOAD_BALANCER_SOURCE_CIDR, "filter", "KUBE-SOURCE-RANGES-FIREWALL", "", "dst,dst,src", "RETURN"),
    (LOAD_BALANCER_SOURCE_IP, "filter", "KUBE-SOURCE-RANGES-FIREWALL", "", "dst,dst,src", "RETURN"),
];

/// The `iptables-restore --noflush` input of `plan` (`ip6tables-restore`'s for IPv6): every
/// chain of [`CHAINS`] written whole.
pub fn iptables_restore(plan: &Plan, settings: &Settings) -> String {
    let set = |name: &str| set_name(name, plan.family);
    let mut nat = String::new();
    let mut filter = String::new();
    let mut rule = |table: &str, chain: &str, args: &str| {
        let out = if table == "nat" {
            &mut nat
        } else {
            &mut filter
        };
        let _ = writeln!(out, "-A {chain} {args}");
    };
    let matching = |name: &str, how: &str| {
        format!(
            "-m comment --comment \"{}\" -m set --match-set {} {how}",
            set_def(name).comment,
            set(name)
        )
    };

    for (set, table, chain, proto, how, target) in SET_RULES {
        if plan.is_empty(set) {
            continue;
        }
        let proto = if proto.is_empty() {
            String::new()
        } else {
            format!("-p {proto} ")
        };
        rule(
            table,
            chain,
            &format!("{proto}{} -j {target}", matching(set, how)),
        );
    }
    if !plan.is_empty(CLUSTER_IP) {
        let args = if settings.masquerade_all {
            format!("{} -j KUBE-MARK-MASQ", matching(CLUSTER_IP, "dst,dst"))
        } else if let Some(cluster_cidr) = settings.cluster_cidr {
            format!(
                "{} ! -s {cluster_cidr} -j KUBE-MARK-MASQ",
                matching(CLUSTER_IP, "dst,dst")
            )
        } else {
            // Without the pod range, only the node's own connections (whose source is the
            // cluster IP itself, bound to kube-ipvs0) are masqueraded.
            format!("{} -j KUBE-MARK-MASQ", matching(CLUSTER_IP, "src,dst"))
        };
        rule("nat", "KUBE-SERVICES", &args);
    }
    // External IPs: accepted (so that IPVS gets them) from off the node, and where the address
    // is the node's own.
    let external_ip_rules = |rule: &mut dyn FnMut(&str, &str, &str), m: &str| {
        rule(
            "nat",
            "KUBE-SERVICES",
            &format!("{m} -m physdev ! --physdev-is-in -m addrtype ! --src-type LOCAL -j ACCEPT"),
        );
        rule(
            "nat",
            "KUBE-SERVICES",
            &format!("{m} -m addrtype --dst-type LOCAL -j ACCEPT"),
        );
    };
    if !plan.is_empty(EXTERNAL_IP) {
        let m = matching(EXTERNAL_IP, "dst,dst");
        rule("nat", "KUBE-SERVICES", &format!("{m} -j KUBE-MARK-MASQ"));
        external_ip_rules(&mut rule, &m);
    }
    if !plan.is_empty(EXTERNAL_IP_LOCAL) {
        external_ip_rules(&mut rule, &matching(EXTERNAL_IP_LOCAL, "dst,dst"));
    }
    rule(
        "nat",
        "KUBE-SERVICES",
        "-m addrtype --dst-type LOCAL -j KUBE-NODE-PORT",
    );
    rule("nat", "KUBE-LOAD-BALANCER", "-j KUBE-MARK-MASQ");
    rule("filter", "KUBE-SOURCE-RANGES-FIREWALL", "-j DROP");
    for (ip, proto, port) in &plan.no_node_access {
        rule(
            "filter",
            "KUBE-IPVS-OUT-FILTER",
            &format!("-s {ip} -m ipvs --vaddr {ip} --vproto {proto} --vport {port} -j DROP"),
        );
    }
    // Traffic to the virtual servers is accepted before any other nat rule sees it.
    for name in [CLUSTER_IP, LOAD_BALANCER] {
        if !plan.is_empty(name) {
            rule(
                "nat",
                "KUBE-SERVICES",
                &format!("-m set --match-set {} dst,dst -j ACCEPT", set(name)),
            );
        }
    }
    rule(
        "filter",
        "KUBE-FORWARD",
        &format!(
            "-m comment --comment \"kubernetes forwarding rules\" -m mark --mark {MASQ_MARK}/{MASQ_MARK} -j ACCEPT"
        ),
    );
    rule(
        "filter",
        "KUBE-FORWARD",
        "-m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    );
    rule(
        "filter",
        "KUBE-NODE-PORT",
        &format!("{} -j ACCEPT", matching(HEALTH_CHECK_NODE_PORT, "dst")),
    );
    // A packet netfilter's window tracking judges out of a connection's window (a blind RST,
    // FIN or SYN) never reaches IPVS, which would close the connection on any RST and then give
    // the next SYN of its 5-tuple another endpoint: the iptables mode's KUBE-FORWARD drop, for
    // the service addresses and NodePorts IPVS serves on INPUT.
    for (proto, name, how) in [
        ("", IPVS_IPS, "dst"),
        ("-p tcp ", NODE_PORT_TCP, "dst"),
        ("-p tcp ", NODE_PORT_LOCAL_TCP, "dst"),
    ] {
        if !plan.is_empty(name) {
            rule(
                "filter",
                "KUBE-IPVS-FILTER",
                &format!(
                    "{proto}-m conntrack --ctstate INVALID -m set --match-set {} {how} -j DROP",
                    set(name)
                ),
            );
        }
    }
    // A service address (bound to kube-ipvs0, so local) answers only on its Services' ports:
    // new connections to another port would reach the node's own listeners (kube-proxy #72236).
    for (name, how) in [
        (LOAD_BALANCER, "dst,dst"),
        (CLUSTER_IP, "dst,dst"),
        (EXTERNAL_IP, "dst,dst"),
        (EXTERNAL_IP_LOCAL, "dst,dst"),
        (HEALTH_CHECK_NODE_PORT, "dst"),
    ] {
        rule(
            "filter",
            "KUBE-IPVS-FILTER",
            &format!("-m set --match-set {} {how} -j RETURN", set(name)),
        );
    }
    rule(
        "filter",
        "KUBE-IPVS-FILTER",
        &format!(
            "-m conntrack --ctstate NEW -m set --match-set {} dst -j REJECT",
            set(IPVS_IPS)
        ),
    );
    rule(
        "nat",
        "KUBE-POSTROUTING",
        &format!("-m mark ! --mark {MASQ_MARK}/{MASQ_MARK} -j RETURN"),
    );
    // Cleared, so that a packet traversing the rules again is not masqueraded again.
    rule(
        "nat",
        "KUBE-POSTROUTING",
        &format!("-j MARK --xor-mark {MASQ_MARK}"),
    );
    rule(
        "nat",
        "KUBE-POSTROUTING",
        "-m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully",
    );
    rule(
        "nat",
        "KUBE-MARK-MASQ",
        &format!("-j MARK --or-mark {MASQ_MARK}"),
    );

    let mut out = String::new();
    for (table, rules) in [("filter", &filter), ("nat", &nat)] {
        let _ = writeln!(out, "*{table}");
        for (_, chain) in CHAINS.iter().filter(|(t, _)| *t == table) {
            let _ = writeln!(out, ":{chain} - [0:0]");
        }
        out.push_str(rules);
        out.push_str("COMMIT\n");
    }
    out
}

/// The virtual servers of `plan` as `ipvsadm -Ln` lists them (for the golden file and logs).
pub fn describe(plan: &Plan) -> String {
    let mut out = String::new();
    for vs in plan.virtual_servers.values() {
        let s = &vs.service;
        let persistent = if s.flags & FLAG_PERSISTENT != 0 {
            format!(" persistent {}", s.timeout)
        } else {
            String::new()
        };
        let _ = writeln!(out, "{} {}{persistent}  # {}", s.key, s.scheduler, vs.owner);
        for &(ip, port) in &vs.dests {
            let _ = writeln!(out, "  -> {} Masq 1", SocketAddr::new(ip, port));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{fixture, golden};

    pub(crate) const FIXTURE: &str = crate::testing::SERVICES;

    pub(crate) fn settings() -> Settings {
        settings_of(Family::V4)
    }

    /// The golden files' settings of `family`, from the netfilter modes' (node1's address).
    pub(crate) fn settings_of(family: Family) -> Settings {
        let netfilter = crate::testing::netfilter_settings_of(family);
        Settings {
            family,
            scheduler: "rr".into(),
            cluster_cidr: netfilter.cluster_cidr,
            masquerade_all: false,
            node_port_ips: netfilter.node_ips.clone(),
            node_ips: netfilter.node_ips,
        }
    }

    #[test]
    fn plan_and_rules_match_the_golden_files() {
        let plan = plan(&fixture(FIXTURE), &settings());
        golden("modes/ipvs", "ipvs.golden", &describe(&plan));
        golden("modes/ipvs", "ipset.golden", &ipset_restore(&plan));
        golden(
            "modes/ipvs",
            "rules.golden",
            &iptables_restore(&plan, &settings()),
        );
    }

    /// Each family's plan of the dual-stack fixture: the IPv6 one's sets are KUBE-6-..., of
    /// family inet6, its virtual servers and real servers IPv6's.
    #[test]
    fn dual_stack_plans_match_the_golden_files() {
        let state = fixture(crate::testing::DUAL_STACK);
        for family in Family::ALL {
            let settings = settings_of(family);
            let plan = plan(&state, &settings);
            let text = format!(
                "{}\n{}\n{}",
                describe(&plan),
                ipset_restore(&plan),
                iptables_restore(&plan, &settings)
            );
            let name = format!("dual_stack_{}.golden", family.name().to_lowercase());
            golden("modes/ipvs", &name, &text);
            let other = match family {
                Family::V4 => "fd00:",
                Family::V6 => "10.96.",
            };
            assert!(!text.contains(other), "{text}");
        }
        let v6 = plan(&state, &settings_of(Family::V6));
        let text = ipset_restore(&v6) + &iptables_restore(&v6, &settings_of(Family::V6));
        for want in [
            "create KUBE-6-CLUSTER-IP hash:ip,port family inet6",
            "add KUBE-6-IPVS-TMP-1 fd00:10:96::20,tcp:80",
            "create KUBE-6-LOAD-BALANCER-SOURCE-CID hash:ip,port,net family inet6",
            "--match-set KUBE-6-CLUSTER-IP dst,dst ! -s fd00:10:244::/56 -j KUBE-MARK-MASQ",
        ] {
            assert!(text.contains(want), "no {want:?} in:\n{text}");
        }
        let persistent = v6.virtual_servers.values().map(|v| v.service.netmask);
        assert!(persistent.into_iter().all(|mask| mask == 128));
    }

    #[test]
    fn set_names_of_ipv6_are_kube_proxys() {
        assert_eq!(set_name(CLUSTER_IP, Family::V4), "KUBE-CLUSTER-IP");
        assert_eq!(set_name(CLUSTER_IP, Family::V6), "KUBE-6-CLUSTER-IP");
        assert_eq!(
            set_name(NODE_PORT_LOCAL_SCTP, Family::V6),
            "KUBE-6-NODE-PORT-LOCAL-SCTP-HAS"
        );
        assert!(is_own_set("KUBE-6-LOAD-BALANCER-SOURCE-CID"));
        assert!(is_own_set("KUBE-6-IPVS-TMP-3"));
        assert!(!is_own_set("KUBE-6-SOMETHING-ELSE"));
    }

    fn vs(plan: &Plan, addr: [u8; 4], port: u16) -> &VirtualServer {
        plan.virtual_servers
            .values()
            .find(|v| v.service.key.addr == IpAddr::from(addr) && v.service.key.port == port)
            .unwrap_or_else(|| panic!("no virtual server {addr:?}:{port}:\n{}", describe(plan)))
    }

    #[test]
    fn policies_pick_the_real_servers_as_kube_proxy() {
        let state = fixture(FIXTURE);
        let plan = plan(&state, &settings());
        let ips = |v: &VirtualServer| {
            v.dests
                .iter()
                .map(|(ip, _)| ip.to_string())
                .collect::<Vec<_>>()
        };
        // eTP Local with a local endpoint: only it behind the NodePort and the LB address; the
        // cluster IP has all.
        assert_eq!(ips(vs(&plan, [192, 0, 2, 11], 30081)), ["10.244.1.13"]);
        assert_eq!(ips(vs(&plan, [203, 0, 113, 11], 80)), ["10.244.1.13"]);
        assert_eq!(
            ips(vs(&plan, [10, 96, 0, 21], 80)),
            ["10.244.1.13", "10.244.2.13"]
        );
        // Session affinity: persistent, the affinity timeout.
        let dns = vs(&plan, [10, 96, 0, 53], 53);
        assert_eq!(
            (
                dns.service.flags,
                dns.service.timeout,
                dns.service.key.protocol
            ),
            (FLAG_PERSISTENT, 10800, 17)
        );
        assert!(plan.bind.contains(&IpAddr::from([203, 0, 113, 11])));
        assert!(
            !plan.bind.contains(&IpAddr::from([192, 0, 2, 11])),
            "node addresses stay"
        );
        // The node (192.0.2.11) is inside shop/local's source range 192.0.2.0/24: it may reach
        // the address, whose own address is the source of its connections.
        assert!(plan.no_node_access.is_empty());
        assert!(plan.sets[LOAD_BALANCER_SOURCE_IP].contains("203.0.113.11,tcp:80,203.0.113.11"));
        let outside = Settings {
            node_ips: vec![IpAddr::from([198, 18, 0, 1])],
            ..settings()
        };
        let plan = super::plan(&state, &outside);
        assert!(plan.sets[LOAD_BALANCER_SOURCE_IP].is_empty());
        assert!(
            plan.no_node_access
                .contains(&(IpAddr::from([203, 0, 113, 11]), "tcp", 80))
        );
        let rules = iptables_restore(&plan, &outside);
        assert!(rules.contains(
            "-A KUBE-IPVS-OUT-FILTER -s 203.0.113.11 -m ipvs --vaddr 203.0.113.11 --vproto tcp --vport 80 -j DROP"
        ), "{rules}");
    }

    #[test]
    fn masquerade_without_a_cluster_cidr_or_with_masquerade_all() {
        let state = fixture(FIXTURE);
        let none = Settings {
            cluster_cidr: None,
            ..settings()
        };
        let text = iptables_restore(&plan(&state, &none), &none);
        assert!(
            text.contains("--match-set KUBE-CLUSTER-IP src,dst -j KUBE-MARK-MASQ"),
            "{text}"
        );
        let all = Settings {
            masquerade_all: true,
            ..settings()
        };
        let text = iptables_restore(&plan(&state, &all), &all);
        assert!(
            text.contains("--match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ"),
            "{text}"
        );
        assert!(!text.contains("! -s"), "{text}");
    }

    #[test]
    fn every_set_is_written_even_empty() {
        let text = ipset_restore(&plan(&DesiredState::default(), &settings()));
        for def in SETS {
            assert!(
                text.contains(&format!("create {} {} ", def.name, def.kind)),
                "{text}"
            );
            assert!(def.name.len() <= 31, "{} is too long for ipset", def.name);
        }
        assert!(!text.contains("add "), "{text}");
    }
}
