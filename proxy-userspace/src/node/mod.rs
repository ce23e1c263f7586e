//! Facts about this node that every mode uses: its interfaces' addresses, the default route,
//! the addresses NodePorts answer on (kube-proxy's `--nodeport-addresses`) and the node's
//! primary address of each family.
use std::{
    ffi::CStr,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    str::FromStr,
};

use anyhow::Context;

use crate::model::{Cidr, Family};

/// `--nodeport-addresses`: CIDRs, or `primary` (the default).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// The node's primary addresses: the Node object's InternalIP and ExternalIP with the API
    /// source; with the manifest source, those of the interface holding the default route.
    Primary,
    /// Every address of the node within one of these ranges (of either family).
    Cidrs(Vec<Cidr>),
}

impl NodePortAddresses {
    /// What the flag says for `family`: its CIDRs of that family, or `primary` when none is
    /// (kube-proxy's `NewNodePortAddresses`).
    pub fn for_family(&self, family: Family) -> NodePortAddresses {
        match self {
            NodePortAddresses::Cidrs(cidrs) => {
                let cidrs: Vec<Cidr> = cidrs
                    .iter()
                    .copied()
                    .filter(|c| c.family() == family)
                    .collect();
                match cidrs.is_empty() {
                    true => NodePortAddresses::Primary,
                    false => NodePortAddresses::Cidrs(cidrs),
                }
            }
            NodePortAddresses::Primary => NodePortAddresses::Primary,
        }
    }
}

impl FromStr for NodePortAddresses {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() || s == "primary" {
            return Ok(Self::Primary);
        }
        let cidrs = s
            .split(',')
            .map(|part| {
                part.trim()
                    .parse()
                    .map_err(|e| format!("{e}, nor \"primary\""))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self::Cidrs(cidrs))
    }
}

/// An address of an interface.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct InterfaceAddr {
    pub interface: String,
    pub addr: IpAddr,
}

impl InterfaceAddr {
    /// The address if IPv4.
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        match self.addr {
            IpAddr::V4(ip) => Some(ip),
            IpAddr::V6(_) => None,
        }
    }
}

/// Every address of this network namespace (IPv4 and IPv6), by interface.
pub fn interface_addresses() -> anyhow::Result<Vec<InterfaceAddr>> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a linked list freed below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(std::io::Error::last_os_error()).context("listing interface addresses");
    }
    let mut out = Vec::new();
    let mut p = list;
    // SAFETY: walking the list getifaddrs returned; every pointer in it is valid or null.
    unsafe {
        while !p.is_null() {
            let entry = &*p;
            let addr = match entry.ifa_addr.as_ref().map(|a| i32::from(a.sa_family)) {
                Some(libc::AF_INET) => {
                    let sin = &*(entry.ifa_addr as *const libc::sockaddr_in);
                    Some(IpAddr::from(Ipv4Addr::from(u32::from_be(
                        sin.sin_addr.s_addr,
                    ))))
                }
                Some(libc::AF_INET6) => {
                    let sin6 = &*(entry.ifa_addr as *const libc::sockaddr_in6);
                    Some(IpAddr::from(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
                }
                _ => None,
            };
            if let Some(addr) = addr {
                out.push(InterfaceAddr {
                    interface: CStr::from_ptr(entry.ifa_name)
                        .to_string_lossy()
                        .into_owned(),
                    addr,
                });
            }
            p = entry.ifa_next;
        }
        libc::freeifaddrs(list);
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// The interfaces of the node's default routes, one a family.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DefaultRoutes {
    pub v4: Option<String>,
    pub v6: Option<String>,
}

impl DefaultRoutes {
    /// This node's (`/proc/net/route`, `/proc/net/ipv6_route`).
    pub fn of_this_node() -> Self {
        let v4 = std::fs::read_to_string("/proc/net/route").unwrap_or_default();
        let v6 = std::fs::read_to_string("/proc/net/ipv6_route").unwrap_or_default();
        Self {
            v4: default_route_in(&v4),
            v6: default_route6_in(&v6),
        }
    }

    /// The interface of `family`'s default route; a family without one takes the other's (a
    /// node's IPv6 network without a default route is most often on its IPv4 uplink, and an
    /// IPv6-only node has no IPv4 default route).
    pub fn of(&self, family: Family) -> Option<&str> {
        let (own, other) = match family {
            Family::V4 => (&self.v4, &self.v6),
            Family::V6 => (&self.v6, &self.v4),
        };
        own.as_deref().or(other.as_deref())
    }

    /// Whether the interface `name` holds a default route (of either family).
    pub fn hold(&self, name: &str) -> bool {
        [&self.v4, &self.v6]
            .into_iter()
            .any(|r| r.as_deref() == Some(name))
    }
}

fn default_route_in(table: &str) -> Option<String> {
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // Iface Destination Gateway Flags RefCnt Use Metric Mask ...
        (fields.len() > 7 && fields[1] == "00000000" && fields[7] == "00000000")
            .then(|| fields[0].to_string())
    })
}

fn default_route6_in(table: &str) -> Option<String> {
    const RTF_UP: u32 = 0x1;
    const RTF_REJECT: u32 = 0x200;
    table.lines().find_map(|line| {
        // Destination, its length, source, its length, next hop, metric, refcnt, use, flags,
        // interface.
        let fields: Vec<&str> = line.split_whitespace().collect();
        let flags = u32::from_str_radix(fields.get(8)?, 16).ok()?;
        let default = fields[0].bytes().all(|b| b == b'0') && fields[1] == "00";
        (default && flags & RTF_UP != 0 && flags & RTF_REJECT == 0 && fields[9] != "lo")
            .then(|| fields[9].to_string())
    })
}

/// The node addresses NodePorts answer on: `spec` applied to the namespace's `addresses`, with
/// `primary` the Node object's addresses (empty without one), else those of each family's
/// default route's interface (`routes`). Per family, as kube-proxy's proxiers: a family no
/// `--nodeport-addresses` CIDR is of answers on its primary address. Loopback addresses are
/// never included: a NodePort on 127.0.0.1 would let any local process (or, with
/// route_localnet, a neighbour) reach services it should not (CVE-2020-8558); nor, for
/// `primary` without a Node object, IPv6 link-local ones.
pub fn node_addresses(
    spec: &NodePortAddresses,
    primary: &[IpAddr],
    routes: &DefaultRoutes,
    addresses: &[InterfaceAddr],
) -> Vec<InterfaceAddr> {
    addresses
        .iter()
        .filter(|a| !a.addr.is_loopback())
        .filter(|a| match spec.for_family(Family::of(a.addr)) {
            NodePortAddresses::Cidrs(cidrs) => cidrs.iter().any(|cidr| cidr.contains(a.addr)),
            NodePortAddresses::Primary if !primary.is_empty() => primary.contains(&a.addr),
            NodePortAddresses::Primary => {
                routes.of(Family::of(a.addr)) == Some(a.interface.as_str())
                    && !is_link_local(a.addr)
            }
        })
        .cloned()
        .collect()
}

/// Whether `ip` is an IPv6 link-local address (fe80::/10): meaningful on one link only.
pub fn is_link_local(ip: IpAddr) -> bool {
    matches!(ip, IpAddr::V6(ip) if ip.segments()[0] & 0xffc0 == 0xfe80)
}

/// The addresses among `addresses` (the node's interfaces) that `spec` selects, with
/// `primary` the Node object's addresses.
pub fn selected_node_ips(
    spec: &NodePortAddresses,
    primary: &[IpAddr],
    addresses: &[InterfaceAddr],
) -> Vec<IpAddr> {
    node_addresses(spec, primary, &DefaultRoutes::of_this_node(), addresses)
        .iter()
        .map(|a| a.addr)
        .collect()
}

/// The node addresses of `family` NodePorts answer on, as the netfilter modes write them;
/// None: every local address of the family (a `--nodeport-addresses` CIDR of the family
/// matching everything, as kube-proxy does).
pub fn node_port_ips(
    spec: &NodePortAddresses,
    family: Family,
    primary: &[IpAddr],
    addresses: &[InterfaceAddr],
) -> Option<Vec<IpAddr>> {
    let spec = spec.for_family(family);
    let every = matches!(&spec, NodePortAddresses::Cidrs(c) if c.iter().any(|cidr| cidr.len == 0));
    (!every).then(|| {
        let mut ips = selected_node_ips(&spec, primary, addresses);
        ips.retain(|ip| family.has(*ip));
        ips
    })
}

/// The node's primary address of `family` among `candidates`: the first of the Node object's
/// addresses (`primary`) of the family that is one of them, else the first on the default
/// route's interface, else the first on another interface than the loopback one (whose other
/// addresses are service addresses, such as a load balancer's for DSR); never a loopback or
/// IPv6 link-local one. The userspace mode DNATs the node's own traffic to it (kube-proxy's
/// `hostIP`); the ebpf mode sends flows to other nodes' endpoints from it.
pub fn primary_ip(
    family: Family,
    primary: &[IpAddr],
    default_route: Option<&str>,
    candidates: &[InterfaceAddr],
) -> Option<IpAddr> {
    let usable = |ip: IpAddr| family.has(ip) && !ip.is_loopback() && !is_link_local(ip);
    let held = |ip: &IpAddr| usable(*ip) && candidates.iter().any(|a| a.addr == *ip);
    let not_lo = |a: &&InterfaceAddr| a.interface != "lo" && usable(a.addr);
    let on_default_route = |a: &&InterfaceAddr| Some(a.interface.as_str()) == default_route;
    primary
        .iter()
        .copied()
        .find(held)
        .or_else(|| {
            candidates
                .iter()
                .filter(not_lo)
                .find(on_default_route)
                .map(|a| a.addr)
        })
        .or_else(|| candidates.iter().find(not_lo).map(|a| a.addr))
}

/// [`primary_ip`] of IPv4.
pub fn primary_ipv4(
    primary: &[IpAddr],
    default_route: Option<&str>,
    candidates: &[InterfaceAddr],
) -> Option<Ipv4Addr> {
    match primary_ip(Family::V4, primary, default_route, candidates)? {
        IpAddr::V4(ip) => Some(ip),
        IpAddr::V6(_) => None,
    }
}

/// Whether the interface's frames carry Ethernet headers (ARPHRD_ETHER, or the loopback
/// device's zeroed ones), as the ebpf mode's programs parse them; WireGuard, IPIP and other L3
/// devices do not. Asked of the kernel (SIOCGIFHWADDR), for the same reason as [`driver`].
pub fn has_ethernet_headers(interface: &str) -> bool {
    let Some(req) = interface_ioctl(interface, libc::SIOCGIFHWADDR, |_| {}) else {
        return false;
    };
    // SAFETY: the kernel filled the hardware address member.
    let family = unsafe { req.ifr_ifru.ifru_hwaddr.sa_family };
    family == libc::ARPHRD_ETHER || family == libc::ARPHRD_LOOPBACK
}

/// The interface's driver, as ethtool reports it (ETHTOOL_GDRVINFO). Not from sysfs: /sys shows
/// the interfaces of the namespace it was mounted in, which need not be the agent's.
pub fn driver(interface: &str) -> Option<String> {
    const ETHTOOL_GDRVINFO: u32 = 0x3;
    #[repr(C)]
    struct DrvInfo {
        cmd: u32,
        driver: [u8; 32],
        rest: [u8; 160],
    }
    let mut info = DrvInfo {
        cmd: ETHTOOL_GDRVINFO,
        driver: [0; 32],
        rest: [0; 160],
    };
    let info_ptr: *mut DrvInfo = &mut info;
    // SAFETY (the ioctl): SIOCETHTOOL with an ifreq pointing at a buffer of the size the
    // command writes.
    interface_ioctl(interface, libc::SIOCETHTOOL, |req| {
        req.ifr_ifru.ifru_data = info_ptr.cast();
    })?;
    let end = info.driver.iter().position(|&b| b == 0).unwrap_or(32);
    Some(String::from_utf8_lossy(&info.driver[..end]).into_owned())
}

/// Runs the interface ioctl `request` on `interface`, its ifreq named and then set up by
/// `prepare`: the ifreq as the kernel left it, or None if the name is too long or the call
/// failed.
fn interface_ioctl(
    interface: &str,
    request: libc::Ioctl,
    prepare: impl FnOnce(&mut libc::ifreq),
) -> Option<libc::ifreq> {
    // SAFETY: ifreq is plain data; all zeroes is valid.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    let name = interface.as_bytes();
    if name.len() >= req.ifr_name.len() {
        return None;
    }
    for (dst, src) in req.ifr_name.iter_mut().zip(name) {
        *dst = *src as libc::c_char;
    }
    prepare(&mut req);
    // SAFETY: a datagram socket for the ioctl, closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the callers' requests take an ifreq, whose pointers (if any) they keep valid.
    let r = unsafe { libc::ioctl(fd, request, &mut req) };
    unsafe { libc::close(fd) };
    (r >= 0).then_some(req)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(interface: &str, addr: &str) -> InterfaceAddr {
        InterfaceAddr {
            interface: interface.into(),
            addr: addr.parse().unwrap(),
        }
    }

    #[test]
    fn parses_the_flag() {
        assert_eq!("".parse(), Ok(NodePortAddresses::Primary));
        assert_eq!("primary".parse(), Ok(NodePortAddresses::Primary));
        assert_eq!(
            "192.0.2.0/24, 10.0.0.1/32, fd00::/8".parse(),
            Ok(NodePortAddresses::Cidrs(vec![
                Cidr::v4(Ipv4Addr::new(192, 0, 2, 0), 24),
                Cidr::v4(Ipv4Addr::new(10, 0, 0, 1), 32),
                "fd00::/8".parse().unwrap(),
            ]))
        );
        for bad in ["192.0.2.0", "192.0.2.0/33", "x/24", "192.0.2.0/x"] {
            let e = bad.parse::<NodePortAddresses>().unwrap_err();
            assert!(e.contains(bad.split('/').next().unwrap()), "{e}");
        }
    }

    #[test]
    fn selects_node_addresses() {
        let all = [
            a("eth0", "192.0.2.11"),
            a("eth1", "198.51.100.7"),
            a("lo", "127.0.0.1"),
            a("veth-x", "10.244.1.1"),
        ];
        let pick = |spec: &str, primary: &[&str], default: Option<&str>| {
            let primary: Vec<IpAddr> = primary.iter().map(|p| p.parse().unwrap()).collect();
            let routes = DefaultRoutes {
                v4: default.map(str::to_owned),
                v6: None,
            };
            node_addresses(&spec.parse().unwrap(), &primary, &routes, &all)
                .into_iter()
                .map(|a| a.addr.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(pick("primary", &[], Some("eth0")), ["192.0.2.11"]);
        assert_eq!(
            pick("primary", &["198.51.100.7"], Some("eth0")),
            ["198.51.100.7"]
        );
        assert!(pick("primary", &[], None).is_empty());
        assert_eq!(
            pick("192.0.2.0/24,198.51.100.0/24", &[], None),
            ["192.0.2.11", "198.51.100.7"]
        );
        // Never loopback, even when asked for.
        assert_eq!(
            pick("0.0.0.0/0", &[], None),
            ["192.0.2.11", "198.51.100.7", "10.244.1.1"]
        );
    }

    /// Each family on its own, as kube-proxy's proxiers: CIDRs of one family leave the other
    /// on its primary address; `primary` without a Node object never takes a link-local one.
    #[test]
    fn selects_node_addresses_per_family() {
        let all = [
            a("eth0", "192.0.2.11"),
            a("eth0", "2001:db8:192:2::11"),
            a("eth0", "fe80::1"),
            a("eth1", "2001:db8:51::7"),
            a("lo", "::1"),
        ];
        let pick = |spec: &str, primary: &[&str]| {
            let primary: Vec<IpAddr> = primary.iter().map(|p| p.parse().unwrap()).collect();
            let routes = DefaultRoutes {
                v4: Some("eth0".into()),
                v6: None,
            };
            node_addresses(&spec.parse().unwrap(), &primary, &routes, &all)
                .into_iter()
                .map(|a| a.addr.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(pick("primary", &[]), ["192.0.2.11", "2001:db8:192:2::11"]);
        assert_eq!(
            pick("primary", &["192.0.2.11", "2001:db8:51::7"]),
            ["192.0.2.11", "2001:db8:51::7"]
        );
        assert_eq!(
            pick("2001:db8::/32", &[]),
            ["192.0.2.11", "2001:db8:192:2::11", "2001:db8:51::7"]
        );
        assert_eq!(
            pick("::/0", &[]),
            [
                "192.0.2.11",
                "2001:db8:192:2::11",
                "fe80::1",
                "2001:db8:51::7"
            ]
        );
        assert_eq!(pick("10.0.0.0/8", &[]), ["2001:db8:192:2::11"]);
        // Without a Node object, each family's default route's interface (IPv6's on eth1).
        let routes = DefaultRoutes {
            v4: Some("eth0".into()),
            v6: Some("eth1".into()),
        };
        let picked: Vec<String> = node_addresses(&NodePortAddresses::Primary, &[], &routes, &all)
            .into_iter()
            .map(|a| a.addr.to_string())
            .collect();
        assert_eq!(picked, ["192.0.2.11", "2001:db8:51::7"]);
        let every = "0.0.0.0/0".parse().unwrap();
        assert_eq!(node_port_ips(&every, Family::V4, &[], &all), None);
        assert_eq!(
            node_port_ips(
                &every,
                Family::V6,
                &["2001:db8:51::7".parse().unwrap()],
                &all
            ),
            Some(vec!["2001:db8:51::7".parse().unwrap()])
        );
    }

    #[test]
    fn the_primary_ipv4_is_a_held_node_address_else_the_default_routes() {
        let a = |interface: &str, addr: [u8; 4]| InterfaceAddr {
            interface: interface.into(),
            addr: addr.into(),
        };
        let addresses = [
            a("eth0", [192, 0, 2, 11]),
            a("eth1", [198, 51, 100, 7]),
            a("lo", [127, 0, 0, 1]),
            a("lo", [203, 0, 113, 10]),
        ];
        let ip = |o: [u8; 4]| IpAddr::V4(o.into());
        // The Node's first IPv4 address held here (an ExternalIP NATed by a cloud is not).
        assert_eq!(
            primary_ipv4(
                &[ip([203, 0, 113, 1]), ip([198, 51, 100, 7])],
                Some("eth0"),
                &addresses
            ),
            Some(Ipv4Addr::new(198, 51, 100, 7))
        );
        assert_eq!(
            primary_ipv4(&[], Some("eth1"), &addresses),
            Some(Ipv4Addr::new(198, 51, 100, 7))
        );
        assert_eq!(
            primary_ipv4(&[], None, &addresses),
            Some(Ipv4Addr::new(192, 0, 2, 11))
        );
        // Never the loopback interface's.
        assert_eq!(primary_ipv4(&[], Some("lo"), &addresses[2..]), None);
        assert_eq!(primary_ipv4(&[], None, &addresses[2..]), None);
    }

    #[test]
    fn the_primary_ipv6_is_never_link_local() {
        let a = |interface: &str, addr: &str| InterfaceAddr {
            interface: interface.into(),
            addr: addr.parse().unwrap(),
        };
        let addresses = [
            a("eth0", "192.0.2.11"),
            a("eth0", "fe80::1"),
            a("eth0", "2001:db8::11"),
            a("lo", "::1"),
        ];
        let v6 = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        assert_eq!(
            primary_ip(Family::V6, &[], Some("eth0"), &addresses),
            v6("2001:db8::11")
        );
        // The Node's IPv4 address is no IPv6 one.
        let node = ["192.0.2.11".parse().unwrap()];
        assert_eq!(
            primary_ip(Family::V6, &node, None, &addresses),
            v6("2001:db8::11")
        );
        assert_eq!(primary_ip(Family::V6, &[], None, &addresses[..2]), None);
    }

    #[test]
    fn finds_the_default_route() {
        let table = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                     eth1\t0002000A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
                     eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n";
        // A family without a default route takes the other's.
        let routes = DefaultRoutes {
            v4: Some("eth0".into()),
            v6: None,
        };
        assert_eq!(routes.of(Family::V6), Some("eth0"));
        assert!(routes.hold("eth0") && !routes.hold("eth1"));
        let routes = DefaultRoutes {
            v4: None,
            v6: Some("eth1".into()),
        };
        assert_eq!(routes.of(Family::V4), Some("eth1"));
        assert_eq!(default_route_in(table).as_deref(), Some("eth0"));
        assert_eq!(default_route_in("Iface\tDestination\n"), None);
        let table6 = "fd00000000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001 eth1\n\
                      00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00200200 lo\n\
                      00000000000000000000000000000000 00 00000000000000000000000000000000 00 20010db8000000000000000000000001 00000400 00000001 00000000 00000003 eth0\n";
        assert_eq!(default_route6_in(table6).as_deref(), Some("eth0"));
        assert_eq!(
            default_route6_in(
                &table6[..table6
                    .rfind("0000000000000000000000000000000 00 0")
                    .unwrap()]
            ),
            None
        );
    }
}
