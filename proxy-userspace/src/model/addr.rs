//! Address vocabulary, parsed and named once: IP families, CIDRs, and the addresses of a list
//! in one family.
use std::{
    fmt,
    net::{IpAddr, Ipv4Addr},
    str::FromStr,
};

/// An IP family. kube-proxy runs one proxier per family, and a Service is served in a family
/// only if it has a cluster IP of it; its other addresses, source ranges and endpoints of the
/// other family are not that proxier's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::V4, Family::V6];

    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    /// kube-proxy's name for it (the `ip_family` label of its metrics, `ipFamilies`).
    pub fn name(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }

    /// Whether `ip` is of this family.
    pub fn has(self, ip: IpAddr) -> bool {
        Family::of(ip) == self
    }

    /// The addresses of `ips` of this family, in order.
    pub fn filter(self, ips: &[IpAddr]) -> Vec<IpAddr> {
        ips.iter().copied().filter(|ip| self.has(*ip)).collect()
    }

    /// The family's loopback range (never a NodePort address: CVE-2020-8558).
    pub fn loopback(self) -> Cidr {
        match self {
            Family::V4 => Cidr::v4(Ipv4Addr::new(127, 0, 0, 0), 8),
            Family::V6 => Cidr {
                addr: std::net::Ipv6Addr::LOCALHOST.into(),
                len: 128,
            },
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An address range, like 10.244.0.0/16 or fd00::/64.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cidr {
    pub addr: IpAddr,
    /// The prefix length: at most 32 for IPv4, 128 for IPv6.
    pub len: u8,
}

impl Cidr {
    pub fn v4(addr: Ipv4Addr, len: u8) -> Self {
        debug_assert!(len <= 32);
        Self {
            addr: addr.into(),
            len,
        }
    }

    /// The IPv4 network and prefix length; None for an IPv6 range.
    pub fn as_v4(&self) -> Option<(Ipv4Addr, u8)> {
        match self.addr {
            IpAddr::V4(addr) => Some((addr, self.len)),
            IpAddr::V6(_) => None,
        }
    }

    pub fn family(&self) -> Family {
        Family::of(self.addr)
    }

    /// Whether `ip` is in the range (never across families).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.len)).unwrap_or(0);
                u32::from(ip) & mask == u32::from(net) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.len))
                    .unwrap_or(0);
                u128::from(ip) & mask == u128::from(net) & mask
            }
            _ => false,
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (addr, len) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?} is not a CIDR (like 192.0.2.0/24)"))?;
        let addr = parse_ip_leniently(addr)
            .ok_or_else(|| format!("{s:?}: {addr:?} is not an IP address"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len: u8 = len
            .parse()
            .ok()
            .filter(|len| *len <= max)
            .ok_or_else(|| format!("{s:?}: {len:?} is not a prefix length (0-{max})"))?;
        Ok(Self { addr, len })
    }
}

/// `s` as an IP address, also an IPv4 address with leading zeros (`172.30.0.041`), read as
/// kube-proxy reads it (`netutils.ParseIPSloppy`: decimal, 172.30.0.41), with a warning:
/// objects written before the API server refused such addresses still hold them.
pub fn parse_ip_leniently(s: &str) -> Option<IpAddr> {
    if let Ok(ip) = s.parse() {
        return Some(ip);
    }
    let mut octets = [0u8; 4];
    let mut parts = s.split('.');
    for octet in &mut octets {
        let part = parts.next()?;
        // Digits only (integer parsing would also take a sign), decimal whatever the zeros.
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        *octet = part.parse().ok()?;
    }
    if parts.next().is_some() {
        return None;
    }
    let ip = Ipv4Addr::from(octets);
    tracing::warn!(
        "{s:?} has leading zeros: read as {ip}, as kube-proxy reads it (the API server refuses \
         such addresses now: rewrite it)"
    );
    Some(ip.into())
}

/// The IPv4 addresses of `ips`, in order.
pub fn ipv4(ips: &[IpAddr]) -> Vec<Ipv4Addr> {
    ips.iter()
        .filter_map(|ip| match ip {
            IpAddr::V4(ip) => Some(*ip),
            IpAddr::V6(_) => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leading_zeros_are_read_as_decimal() {
        for (s, want) in [
            ("172.30.0.041", Some("172.30.0.41")),
            ("010.000.001.255", Some("10.0.1.255")),
            ("10.0.0.1", Some("10.0.0.1")),
            ("10.0.0.0256", None),
            ("10.0.0", None),
            ("10.0.0.1.1", None),
            ("10..0.1", None),
            ("10.0.0.0x1", None),
        ] {
            assert_eq!(
                parse_ip_leniently(s),
                want.map(|w| w.parse().unwrap()),
                "{s}"
            );
        }
        let net: Cidr = "010.244.0.0/16".parse().unwrap();
        assert_eq!(net.to_string(), "10.244.0.0/16");
    }

    #[test]
    fn parses_shows_and_contains() {
        let net: Cidr = "10.244.0.0/16".parse().unwrap();
        assert_eq!(net, Cidr::v4(Ipv4Addr::new(10, 244, 0, 0), 16));
        assert_eq!(net.to_string(), "10.244.0.0/16");
        assert!(net.contains("10.244.255.1".parse().unwrap()));
        assert!(!net.contains("10.245.0.1".parse().unwrap()));
        assert!(!net.contains("::1".parse().unwrap()));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("203.0.113.9".parse().unwrap()));
        let v6: Cidr = "fd00::/8".parse().unwrap();
        assert!(v6.contains("fd12::1".parse().unwrap()));
        assert_eq!(v6.as_v4(), None);
        for bad in ["10.0.0.0", "10.0.0.0/33", "x/8", "10.0.0.0/x", "fd00::/129"] {
            let e = bad.parse::<Cidr>().unwrap_err();
            assert!(e.contains(bad.split('/').next().unwrap()), "{e}");
        }
    }
}
