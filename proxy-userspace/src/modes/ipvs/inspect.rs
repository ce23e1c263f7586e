//! The IPVS mode's state as `inspect` rows: the kernel's virtual and real servers (read over
//! generic netlink) give the frontends and their endpoints; kube-proxy's ipsets (`ipset save`)
//! tell what kind each frontend is and its policies, which IPVS itself does not know; the
//! persistence templates in `/proc/net/ip_vs_conn` are the ClientIP affinity.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::{IpAddr, SocketAddr},
};

use anyhow::Context;

use crate::modes::ipvs::{
    netlink::{Dest, FLAG_PERSISTENT, Ipvs, OpenError, Service},
    rules::{
        CLUSTER_IP, EXTERNAL_IP, EXTERNAL_IP_LOCAL, LOAD_BALANCER, LOAD_BALANCER_LOCAL,
        LOAD_BALANCER_SOURCE_CIDR, NODE_PORT_LOCAL_TCP, NODE_PORT_LOCAL_UDP, NODE_PORT_TCP,
        NODE_PORT_UDP, set_name,
    },
};
use crate::{
    model::{Family, Protocol},
    netfilter::conntrack,
    rows::{BackendRow, ClientAffinityRow, Rows, ServiceRow, What, row},
};

/// Every virtual server with its real servers.
pub fn virtual_servers() -> anyhow::Result<Vec<(Service, Vec<Dest>)>> {
    let mut ipvs = match Ipvs::open() {
        Ok(ipvs) => ipvs,
        Err(OpenError::NoIpvs) => anyhow::bail!(
            "this kernel has no IPVS, so no ipvs-mode state to read; pass --proxy-mode to read \
             another mode's"
        ),
        Err(OpenError::Other(e)) => return Err(e),
    };
    let mut out = Vec::new();
    for service in ipvs.services()? {
        let dests = ipvs.dests(&service.key)?;
        out.push((service, dests));
    }
    Ok(out)
}

/// The entries of each set in `text` (`ipset save`).
fn sets(text: &str) -> HashMap<&str, HashSet<&str>> {
    let mut sets: HashMap<&str, HashSet<&str>> = HashMap::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if let (Some("add"), Some(set), Some(entry)) = (words.next(), words.next(), words.next()) {
            sets.entry(set).or_default().insert(entry);
        }
    }
    sets
}

/// The frontends of `servers`, each with its endpoints and policies; a NodePort once, as
/// `*:port`, though IPVS has one virtual server per node address (of each family).
pub fn services(servers: &[(Service, Vec<Dest>)], ipsets: &str) -> Vec<ServiceRow> {
    let sets = sets(ipsets);
    let mut rows: BTreeMap<(String, &'static str), ServiceRow> = BTreeMap::new();
    for (service, dests) in servers {
        let key = service.key;
        // The sets of the virtual server's family (`KUBE-6-...` for IPv6).
        let family = Family::of(key.addr);
        let set = |name: &str| sets.get(set_name(name, family).as_str());
        let has = |name: &str, entry: &str| set(name).is_some_and(|s| s.contains(entry));
        let protocol = Protocol::from_number(key.protocol).map_or("?", Protocol::name);
        // The sets' spelling: `10.96.0.10,tcp:80`, `fd00::a,tcp:80`.
        let entry = format!("{},{}:{}", key.addr, protocol.to_lowercase(), key.port);
        let frontend = SocketAddr::new(key.addr, key.port).to_string();
        let port = key.port.to_string();
        let (node_ports, local_node_ports) = match protocol {
            "UDP" => (NODE_PORT_UDP, NODE_PORT_LOCAL_UDP),
            _ => (NODE_PORT_TCP, NODE_PORT_LOCAL_TCP),
        };
        let (kind, address, local_only) = if has(CLUSTER_IP, &entry) {
            // internalTrafficPolicy Local leaves only the local real servers: not visible here.
            ("ClusterIP", frontend, false)
        } else if has(LOAD_BALANCER, &entry) {
            let local = has(LOAD_BALANCER_LOCAL, &entry);
            ("LoadBalancer", frontend, local)
        } else if has(EXTERNAL_IP, &entry) {
            let local = has(EXTERNAL_IP_LOCAL, &entry);
            ("ExternalIP", frontend, local)
        } else if has(node_ports, &port) {
            let local = has(local_node_ports, &port);
            ("NodePort", format!("*:{}", key.port), local)
        } else {
            // Not in kube-proxy's sets: someone else's virtual server.
            continue;
        };
        let row = rows.entry((address.clone(), protocol)).or_insert_with(|| {
            let mut r = row(address, protocol, kind);
            r.local_only = local_only;
            r.affinity_timeout_seconds =
                (service.flags & FLAG_PERSISTENT != 0).then_some(service.timeout);
            r.maglev = service.scheduler == "mh";
            r.source_ranges = set(LOAD_BALANCER_SOURCE_CIDR)
                .into_iter()
                .flatten()
                .filter_map(|e| e.strip_prefix(entry.as_str())?.strip_prefix(','))
                .map(str::to_owned)
                .collect();
            r.source_ranges.sort();
            r
        });
        for dest in dests {
            let b = backend_row(dest, protocol);
            if !row.backends.contains(&b) {
                row.backends.push(b);
            }
        }
        row.backends.sort();
    }
    rows.into_values().collect()
}

/// A real server as a row: weight 0 is a terminating endpoint kept for its connections.
fn backend_row(dest: &Dest, protocol: &'static str) -> BackendRow {
    BackendRow {
        id: 0,
        address: SocketAddr::new(dest.addr, dest.port).to_string(),
        protocol,
        draining: dest.weight == 0,
    }
}

/// The endpoints of the frontends `rows` ([`services`]: only kube-proxy's virtual servers),
/// each once.
pub fn backends(rows: &[ServiceRow]) -> Vec<BackendRow> {
    let mut backends: Vec<BackendRow> = rows.iter().flat_map(|r| r.backends.clone()).collect();
    backends.sort();
    backends.dedup();
    backends
}

/// The persistence templates of `text` (`/proc/net/ip_vs_conn`): a client (port 0) sent to a
/// real server by a persistent virtual server, for the seconds left. The kernel writes an
/// IPv4 address in hex, an IPv6 one in full (`fd00:0010:...`).
pub fn affinity(text: &str) -> Vec<ClientAffinityRow> {
    let hex_ip = |s: &str| -> Option<IpAddr> {
        match s.contains(':') {
            true => s.parse().ok(),
            false => Some(std::net::Ipv4Addr::from(u32::from_str_radix(s, 16).ok()?).into()),
        }
    };
    let hex_port = |s: &str| u16::from_str_radix(s, 16).ok();
    let mut rows: Vec<ClientAffinityRow> = text
        .lines()
        .skip(1)
        .filter_map(|line| {
            let w: Vec<&str> = line.split_whitespace().collect();
            // Pro FromIP FPrt ToIP TPrt DestIP DPrt State Expires ...
            let [
                proto,
                from,
                from_port,
                to,
                to_port,
                dest,
                dest_port,
                state,
                expires,
                ..,
            ] = w.as_slice()
            else {
                return None;
            };
            // A template's state is NONE, or ASSURED once a connection used it.
            if !matches!(*state, "NONE" | "ASSURED") || hex_port(from_port)? != 0 {
                return None;
            }
            Some(ClientAffinityRow {
                client: hex_ip(from)?.to_string(),
                service: SocketAddr::new(hex_ip(to)?, hex_port(to_port)?).to_string(),
                protocol: match *proto {
                    "TCP" => "TCP",
                    "UDP" => "UDP",
                    "SCTP" => "SCTP",
                    _ => "?",
                },
                endpoint: SocketAddr::new(hex_ip(dest)?, hex_port(dest_port)?).to_string(),
                expires_seconds: expires.parse().ok(),
            })
        })
        .collect();
    rows.sort();
    rows
}

/// kube-proxy's ipsets (the IPVS mode's), as `ipset save` prints them.
pub(crate) fn ipset_save() -> anyhow::Result<String> {
    crate::command::run("ipset", &["save"], "ipset")
}

/// `what` of the IPVS table and kube-proxy's ipsets.
pub fn read(what: What) -> anyhow::Result<Rows> {
    let frontends = || Ok::<_, anyhow::Error>(services(&virtual_servers()?, &ipset_save()?));
    Ok(match what {
        What::Services => Rows::Services {
            rows: frontends()?,
            ids: false,
        },
        What::Backends => Rows::Backends {
            rows: backends(&frontends()?),
            ids: false,
        },
        What::Conntrack => Rows::Conntrack(conntrack::service_flows(&frontends()?)?),
        What::Affinity => {
            let path = "/proc/net/ip_vs_conn";
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
            Rows::ClientAffinity(affinity(&text))
        }
    })
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::modes::ipvs::netlink::ServiceKey;

    fn server(
        addr: [u8; 4],
        protocol: u8,
        port: u16,
        dests: &[([u8; 4], u16, u32)],
    ) -> (Service, Vec<Dest>) {
        (
            Service {
                key: ServiceKey {
                    addr: Ipv4Addr::from(addr).into(),
                    protocol,
                    port,
                },
                scheduler: "rr".into(),
                flags: 0,
                timeout: 0,
                netmask: 0xffff_ffff,
            },
            dests
                .iter()
                .map(|&(a, port, weight)| Dest {
                    addr: Ipv4Addr::from(a).into(),
                    port,
                    weight,
                    active_conns: 0,
                    inactive_conns: 0,
                })
                .collect(),
        )
    }

    const SETS: &str = "\
create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536
add KUBE-CLUSTER-IP 10.96.0.10,tcp:80
add KUBE-CLUSTER-IP 10.96.0.20,udp:53
create KUBE-LOAD-BALANCER hash:ip,port family inet hashsize 1024 maxelem 65536
add KUBE-LOAD-BALANCER 203.0.113.11,tcp:80
add KUBE-LOAD-BALANCER-LOCAL 203.0.113.11,tcp:80
add KUBE-LOAD-BALANCER-SOURCE-CIDR 203.0.113.11,tcp:80,192.0.2.0/24
add KUBE-EXTERNAL-IP 198.51.100.10,tcp:80
add KUBE-NODE-PORT-TCP 30080
";

    #[test]
    fn frontends_by_kind_from_the_sets() {
        let mut web = server(
            [10, 96, 0, 10],
            6,
            80,
            &[([10, 244, 1, 12], 8080, 1), ([10, 244, 1, 11], 8080, 0)],
        );
        web.0.flags = FLAG_PERSISTENT;
        web.0.timeout = 10800;
        let servers = [
            web,
            server([10, 96, 0, 20], 17, 53, &[]),
            server([203, 0, 113, 11], 6, 80, &[([10, 244, 1, 11], 8080, 1)]),
            server([198, 51, 100, 10], 6, 80, &[([10, 244, 2, 11], 8080, 1)]),
            // One virtual server per node address: one row.
            server([192, 0, 2, 11], 6, 30080, &[([10, 244, 2, 11], 8080, 1)]),
            server([10, 0, 0, 1], 6, 30080, &[([10, 244, 2, 11], 8080, 1)]),
            // Not kube-proxy's.
            server([192, 0, 2, 11], 6, 9999, &[([10, 1, 1, 1], 80, 1)]),
        ];
        let rows = services(&servers, SETS);
        let shown = |b: &BackendRow| {
            format!(
                "{}{}",
                b.address,
                if b.draining { "(draining)" } else { "" }
            )
        };
        // One line a row: address protocol kind [local] backends [sources] [affinity].
        let summary: Vec<String> = rows
            .iter()
            .map(|r| {
                let backends: Vec<String> = r.backends.iter().map(shown).collect();
                format!(
                    "{} {} {}{} [{}] [{}] {:?}",
                    r.address,
                    r.protocol,
                    r.kind,
                    if r.local_only { " local" } else { "" },
                    backends.join(" "),
                    r.source_ranges.join(" "),
                    r.affinity_timeout_seconds,
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                "*:30080 TCP NodePort [10.244.2.11:8080] [] None",
                "10.96.0.10:80 TCP ClusterIP [10.244.1.11:8080(draining) 10.244.1.12:8080] [] Some(10800)",
                "10.96.0.20:53 UDP ClusterIP [] [] None",
                "198.51.100.10:80 TCP ExternalIP [10.244.2.11:8080] [] None",
                "203.0.113.11:80 TCP LoadBalancer local [10.244.1.11:8080] [192.0.2.0/24] None",
            ]
        );
        // The foreign virtual server's real server is not an endpoint.
        let endpoints: Vec<String> = backends(&rows).iter().map(shown).collect();
        assert_eq!(
            endpoints,
            [
                "10.244.1.11:8080",
                "10.244.1.11:8080(draining)",
                "10.244.1.12:8080",
                "10.244.2.11:8080"
            ]
        );
    }

    /// An IPv6 virtual server is found in the IPv6 sets (`KUBE-6-...`), its addresses in
    /// brackets; a NodePort of both families is one row.
    #[test]
    fn ipv6_frontends_from_the_ipv6_sets() {
        let v6 = |s: &str| -> IpAddr { s.parse().unwrap() };
        let server6 = |addr: &str, port, dest: &str| {
            let (mut service, mut dests) = server([0; 4], 6, port, &[([0; 4], 8080, 1)]);
            service.key.addr = v6(addr);
            dests[0].addr = v6(dest);
            (service, dests)
        };
        let sets = format!(
            "{SETS}add KUBE-6-CLUSTER-IP fd00:10:96::a,tcp:80\nadd KUBE-6-NODE-PORT-TCP 30080\n"
        );
        let servers = [
            server6("fd00:10:96::a", 80, "fd00:10:244:1::12"),
            // In the IPv4 sets only: not kube-proxy's IPv6 one.
            server6("fd00:10:96::14", 80, "fd00:10:244:1::12"),
            server6("2001:db8:192:2::11", 30080, "fd00:10:244:2::11"),
            server([192, 0, 2, 11], 6, 30080, &[([10, 244, 2, 11], 8080, 1)]),
        ];
        let rows = services(&servers, &sets);
        let summary: Vec<(String, &str, Vec<String>)> = rows
            .iter()
            .map(|r| {
                let backends = r.backends.iter().map(|b| b.address.clone()).collect();
                (r.address.clone(), r.kind, backends)
            })
            .collect();
        assert_eq!(
            summary,
            [
                (
                    "*:30080".to_owned(),
                    "NodePort",
                    vec![
                        "10.244.2.11:8080".to_owned(),
                        "[fd00:10:244:2::11]:8080".to_owned()
                    ]
                ),
                (
                    "[fd00:10:96::a]:80".to_owned(),
                    "ClusterIP",
                    vec!["[fd00:10:244:1::12]:8080".to_owned()]
                ),
            ]
        );
        let text = "\
Pro FromIP   FPrt ToIP     TPrt DestIP   DPrt State       Expires PEName PEData
TCP fd00:0010:0244:0001:0000:0000:0000:0010 0000 fd00:0010:0096:0000:0000:0000:0000:000a 0050 fd00:0010:0244:0001:0000:0000:0000:0012 1F90 NONE 10795
";
        let rows = affinity(text);
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!(
            (
                rows[0].client.as_str(),
                rows[0].service.as_str(),
                rows[0].endpoint.as_str()
            ),
            (
                "fd00:10:244:1::10",
                "[fd00:10:96::a]:80",
                "[fd00:10:244:1::12]:8080"
            )
        );
    }

    #[test]
    fn affinity_from_persistence_templates() {
        let text = "\
Pro FromIP   FPrt ToIP     TPrt DestIP   DPrt State       Expires PEName PEData
TCP 0AF4010A 0000 0A60000A 0050 0AF4010B 1F90 NONE          10795
TCP 0AF4010C 0000 0A60000A 0050 0AF4010C 1F90 ASSURED       10790
TCP 0AF4010A 9C40 0A60000A 0050 0AF4010B 1F90 ESTABLISHED     899
";
        assert_eq!(
            affinity(text),
            [
                ClientAffinityRow {
                    client: "10.244.1.10".into(),
                    service: "10.96.0.10:80".into(),
                    protocol: "TCP",
                    endpoint: "10.244.1.11:8080".into(),
                    expires_seconds: Some(10795),
                },
                ClientAffinityRow {
                    client: "10.244.1.12".into(),
                    service: "10.96.0.10:80".into(),
                    protocol: "TCP",
                    endpoint: "10.244.1.12:8080".into(),
                    expires_seconds: Some(10790),
                }
            ]
        );
    }
}
