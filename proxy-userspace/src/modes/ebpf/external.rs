//! The node's external side: the addresses NodePorts answer on (kube-proxy's
//! `--nodeport-addresses`), the interfaces that carry them (where the XDP and external tc
//! programs attach) and how XDP runs there (`--xdp-mode`).
use std::{
    ffi::CStr,
    net::{IpAddr, Ipv4Addr},
    str::FromStr,
};

use anyhow::Context;

/// `--nodeport-addresses`: CIDRs, or `primary` (the default).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// The node's primary addresses: the Node object's InternalIP and ExternalIP with the API
    /// source; with the manifest source, those of the interface holding the default route.
    Primary,
    /// Every address of the node within one of these (IPv4) ranges.
    Cidrs(Vec<(Ipv4Addr, u8)>),
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
            let (addr, len) = part.split_once('/').ok_or_else(|| {
                format!("{part:?} is not a CIDR (like 192.0.2.0/24) nor \"primary\"")
            })?;
            let len: u8 = len
                .parse()
                .map_err(|_| format!("{part:?}: the prefix length is not a number"))?;
            match addr.parse::<IpAddr>() {
                Ok(IpAddr::V4(a)) if len <= 32 => cidrs.push((a, len)),
                // kube-proxy takes both families; the datapath serves IPv4 for now.
                Ok(IpAddr::V6(_)) if len <= 128 => {
                    tracing::warn!(cidr = part, "IPv6 node port addresses are not served yet")
                }
                Ok(_) => return Err(format!("{part:?}: the prefix length is too long")),
                Err(_) => return Err(format!("{part:?}: {addr:?} is not an IP address")),
            }
        }
        Ok(Self::Cidrs(cidrs))
    }
}

/// `--bpf-snat-port-range`: the source ports external flows to other nodes' endpoints are
/// given, `FIRST-LAST`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnatPorts {
    pub first: u16,
    pub last: u16,
}

impl Default for SnatPorts {
    fn default() -> Self {
        Self {
            first: proxy_common::SNAT_PORT_MIN,
            last: proxy_common::SNAT_PORT_MAX,
        }
    }
}

impl std::fmt::Display for SnatPorts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

impl FromStr for SnatPorts {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let range =
            |first: &str, last: &str| Some((first.trim().parse().ok()?, last.trim().parse().ok()?));
        let (first, last): (u16, u16) = s
            .split_once('-')
            .and_then(|(a, b)| range(a, b))
            .ok_or_else(|| format!("{s:?} is not a port range like 1024-29999"))?;
        if first == 0 || last < first {
            return Err(format!(
                "{s:?}: the range must be FIRST-LAST with 0 < FIRST <= LAST"
            ));
        }
        Ok(Self { first, last })
    }
}

impl SnatPorts {
    /// A warning if the range overlaps `ephemeral` (the node's ip_local_port_range, "FIRST
    /// LAST"): a translated flow could then take the 5-tuple of a connection the node itself
    /// opened to an endpoint, and that connection's replies would be taken for the flow's.
    pub fn ephemeral_overlap(&self, ephemeral: &str) -> Option<String> {
        let mut bounds = ephemeral.split_whitespace().map(str::parse::<u16>);
        let (Some(Ok(first)), Some(Ok(last))) = (bounds.next(), bounds.next()) else {
            return None;
        };
        (self.first <= last && first <= self.last).then(|| {
            format!(
                "--bpf-snat-port-range {self} overlaps the node's ephemeral ports \
                 (net.ipv4.ip_local_port_range {first}-{last}): a connection the node opens to \
                 an endpoint may collide with a translated flow; choose a range outside it"
            )
        })
    }
}

/// How the external programs run (`--xdp-mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum XdpMode {
    /// In the driver (the fastest; falls back to generic where the driver has no XDP).
    Native,
    /// In the stack, after the socket buffer is made (works on every interface).
    Generic,
    /// No XDP: the same logic as a tc ingress program only.
    Tc,
}

impl XdpMode {
    /// The flag's value for it (as logged).
    pub fn name(self) -> &'static str {
        match self {
            XdpMode::Native => "native",
            XdpMode::Generic => "generic",
            XdpMode::Tc => "tc",
        }
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
                cidrs.iter().any(|(net, len)| within(a.addr, *net, *len))
            }
            NodePortAddresses::Primary if !primary.is_empty() => {
                primary.contains(&IpAddr::V4(a.addr))
            }
            NodePortAddresses::Primary => default_route == Some(a.interface.as_str()),
        })
        .cloned()
        .collect()
}

fn within(addr: Ipv4Addr, net: Ipv4Addr, len: u8) -> bool {
    let mask = if len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(len))
    };
    u32::from(addr) & mask == u32::from(net) & mask
}

/// Whether XDP may transmit (XDP_TX, redirect) on `interface` in `mode`: always in generic
/// mode (the stack transmits); in native mode not on veth, whose peer drops XDP frames unless
/// it has NAPI (an XDP program, or GRO on), which the agent cannot see from here (the peer is
/// in another namespace). There the XDP program leaves such packets to the tc program, which
/// forwards them as socket buffers.
pub fn xdp_may_transmit(mode: XdpMode, interface: &str) -> bool {
    match mode {
        XdpMode::Generic => true,
        XdpMode::Native => driver(interface).as_deref() != Some("veth"),
        XdpMode::Tc => false,
    }
}

/// The interface's driver, as ethtool reports it (ETHTOOL_GDRVINFO). Not from sysfs: /sys shows
/// the interfaces of the namespace it was mounted in, which need not be the agent's.
fn driver(interface: &str) -> Option<String> {
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
    // SAFETY: ifreq is plain data; all zeroes is valid.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    let name = interface.as_bytes();
    if name.len() >= req.ifr_name.len() {
        return None;
    }
    for (dst, src) in req.ifr_name.iter_mut().zip(name) {
        *dst = *src as libc::c_char;
    }
    req.ifr_ifru.ifru_data = (&mut info as *mut DrvInfo).cast();
    // SAFETY: a datagram socket for the ioctl, closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: SIOCETHTOOL with an ifreq pointing at a buffer of the size the command writes.
    let r = unsafe { libc::ioctl(fd, libc::SIOCETHTOOL, &mut req) };
    unsafe { libc::close(fd) };
    if r < 0 {
        return None;
    }
    let end = info.driver.iter().position(|&b| b == 0).unwrap_or(32);
    Some(String::from_utf8_lossy(&info.driver[..end]).into_owned())
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
    fn snat_ports_parse_and_check_the_ephemeral_range() {
        let ports: SnatPorts = "1024-29999".parse().unwrap();
        assert_eq!(ports, SnatPorts::default());
        assert_eq!(ports.to_string(), "1024-29999");
        assert_eq!(
            " 61000 - 65535".parse(),
            Ok(SnatPorts {
                first: 61000,
                last: 65535
            })
        );
        for bad in ["", "1024", "0-100", "200-100", "1-70000", "a-b"] {
            assert!(bad.parse::<SnatPorts>().is_err(), "{bad:?} accepted");
        }
        assert_eq!(ports.ephemeral_overlap("32768\t60999\n"), None);
        let wide = ports.ephemeral_overlap("1024 65535").expect("overlap");
        assert!(wide.contains("1024-65535"), "{wide}");
        let edge = SnatPorts {
            first: 60999,
            last: 65535,
        };
        assert!(edge.ephemeral_overlap("32768 60999").is_some());
        assert_eq!(ports.ephemeral_overlap("garbage"), None);
    }

    #[test]
    fn parses_the_flag() {
        assert_eq!("".parse(), Ok(NodePortAddresses::Primary));
        assert_eq!("primary".parse(), Ok(NodePortAddresses::Primary));
        assert_eq!(
            "192.0.2.0/24, 10.0.0.1/32".parse(),
            Ok(NodePortAddresses::Cidrs(vec![
                ("192.0.2.0".parse().unwrap(), 24),
                ("10.0.0.1".parse().unwrap(), 32)
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
    fn finds_the_default_route() {
        let table = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                     eth1\t0002000A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
                     eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n";
        assert_eq!(default_route_in(table).as_deref(), Some("eth0"));
        assert_eq!(default_route_in("Iface\tDestination\n"), None);
    }
}
