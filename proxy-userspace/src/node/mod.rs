//! Facts about this node that every mode uses: its interfaces' addresses, the default route,
//! the addresses NodePorts answer on (kube-proxy's `--nodeport-addresses`) and the node's
//! primary IPv4 address.
use std::{
    ffi::CStr,
    net::{IpAddr, Ipv4Addr},
    str::FromStr,
};

use anyhow::Context;

use crate::model::{Cidr, ipv4};

/// `--nodeport-addresses`: CIDRs, or `primary` (the default).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// The node's primary addresses: the Node object's InternalIP and ExternalIP with the API
    /// source; with the manifest source, those of the interface holding the default route.
    Primary,
    /// Every address of the node within one of these (IPv4) ranges.
    Cidrs(Vec<Cidr>),
}

impl FromStr for NodePortAddresses {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() || s == "primary" {
            return Ok(Self::Primary);
        }
        let mut cidrs = Vec::new();
        for part in s.split(',').map(str::trim) {
            let cidr: Cidr = part.parse().map_err(|e| format!("{e}, nor \"primary\""))?;
            match cidr.addr {
                IpAddr::V4(_) => cidrs.push(cidr),
                // kube-proxy takes both families; the datapath serves IPv4 for now.
                IpAddr::V6(_) => {
                    tracing::warn!(cidr = part, "IPv6 node port addresses are not served yet")
                }
            }
        }
        Ok(Self::Cidrs(cidrs))
    }
}

/// An IPv4 address of an interface.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct InterfaceAddr {
    pub interface: String,
    pub addr: Ipv4Addr,
}

/// Every IPv4 address of this network namespace, by interface.
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
            if !entry.ifa_addr.is_null() && i32::from((*entry.ifa_addr).sa_family) == libc::AF_INET
            {
                let sin = &*(entry.ifa_addr as *const libc::sockaddr_in);
                out.push(InterfaceAddr {
                    interface: CStr::from_ptr(entry.ifa_name)
                        .to_string_lossy()
                        .into_owned(),
                    addr: Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
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

/// The interface of the IPv4 default route, from `/proc/net/route` (None without one).
pub fn default_route_interface() -> Option<String> {
    let table = std::fs::read_to_string("/proc/net/route").ok()?;
    default_route_in(&table)
}

fn default_route_in(table: &str) -> Option<String> {
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // Iface Destination Gateway Flags RefCnt Use Metric Mask ...
        (fields.len() > 7 && fields[1] == "00000000" && fields[7] == "00000000")
            .then(|| fields[0].to_string())
    })
}

/// The node addresses NodePorts answer on: `spec` applied to the namespace's `addresses`, with
/// `primary` the Node object's addresses (empty with the manifest source) and `default_route`
/// the interface of the default route. Loopback addresses are never included: a NodePort on
/// 127.0.0.1 would let any local process (or, with route_localnet, a neighbour) reach
/// services it should not (CVE-2020-8558).
pub fn node_addresses(
    spec: &NodePortAddresses,
    primary: &[IpAddr],
    default_route: Option<&str>,
    addresses: &[InterfaceAddr],
) -> Vec<InterfaceAddr> {
    addresses
        .iter()
        .filter(|a| !a.addr.is_loopback())
        .filter(|a| match spec {
            NodePortAddresses::Cidrs(cidrs) => {
                cidrs.iter().any(|cidr| cidr.contains(a.addr.into()))
            }
            NodePortAddresses::Primary if !primary.is_empty() => {
                primary.contains(&IpAddr::V4(a.addr))
            }
            NodePortAddresses::Primary => default_route == Some(a.interface.as_str()),
        })
        .cloned()
        .collect()
}

/// The addresses among `addresses` (the node's interfaces) that `spec` selects, with
/// `primary` the Node object's addresses.
pub fn selected_node_ips(
    spec: &NodePortAddresses,
    primary: &[IpAddr],
    addresses: &[InterfaceAddr],
) -> Vec<Ipv4Addr> {
    let default_route = default_route_interface();
    node_addresses(spec, primary, default_route.as_deref(), addresses)
        .iter()
        .map(|a| a.addr)
        .collect()
}

/// The node addresses NodePorts answer on, as the netfilter modes write them; None: every
/// local address (a `--nodeport-addresses` CIDR matching everything, as kube-proxy does).
pub fn node_port_ips(
    spec: &NodePortAddresses,
    primary: &[IpAddr],
    addresses: &[InterfaceAddr],
) -> Option<Vec<Ipv4Addr>> {
    let every = matches!(spec, NodePortAddresses::Cidrs(c) if c.iter().any(|cidr| cidr.len == 0));
    (!every).then(|| selected_node_ips(spec, primary, addresses))
}

/// The node's primary IPv4 address among `candidates`: the first of the Node object's
/// addresses (`primary`) that is one of them, else the first on the default route's interface,
/// else the first on another interface than the loopback one (whose other addresses are
/// service addresses, such as a load balancer's for DSR). The userspace mode DNATs the node's
/// own traffic to it (kube-proxy's `hostIP`); the ebpf mode sends flows to other nodes'
/// endpoints from it.
pub fn primary_ipv4(
    primary: &[IpAddr],
    default_route: Option<&str>,
    candidates: &[InterfaceAddr],
) -> Option<Ipv4Addr> {
    let held = |ip: &Ipv4Addr| !ip.is_loopback() && candidates.iter().any(|a| a.addr == *ip);
    let not_lo = |a: &&InterfaceAddr| a.interface != "lo" && !a.addr.is_loopback();
    ipv4(primary)
        .into_iter()
        .find(held)
        .or_else(|| {
            candidates
                .iter()
                .filter(not_lo)
                .find(|a| Some(a.interface.as_str()) == default_route)
                .map(|a| a.addr)
        })
        .or_else(|| candidates.iter().find(not_lo).map(|a| a.addr))
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
            "192.0.2.0/24, 10.0.0.1/32".parse(),
            Ok(NodePortAddresses::Cidrs(vec![
                Cidr::v4(Ipv4Addr::new(192, 0, 2, 0), 24),
                Cidr::v4(Ipv4Addr::new(10, 0, 0, 1), 32)
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
            node_addresses(&spec.parse().unwrap(), &primary, default, &all)
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
    fn finds_the_default_route() {
        let table = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                     eth1\t0002000A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
                     eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n";
        assert_eq!(default_route_in(table).as_deref(), Some("eth0"));
        assert_eq!(default_route_in("Iface\tDestination\n"), None);
    }
}
