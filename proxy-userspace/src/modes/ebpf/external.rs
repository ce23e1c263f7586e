//! The ebpf mode's external side: how XDP runs on the interfaces carrying the node addresses
//! (`--xdp-mode`, where the XDP and external tc programs attach; the addresses are
//! [`crate::node`]'s) and the source ports of flows sent on to other nodes
//! (`--bpf-snat-port-range`).
use std::str::FromStr;

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

/// Whether XDP may transmit (XDP_TX, redirect) on `interface` in `mode`: always in generic
/// mode (the stack transmits); in native mode not on veth, whose peer drops XDP frames unless
/// it has NAPI (an XDP program, or GRO on), which the agent cannot see from here (the peer is
/// in another namespace). There the XDP program leaves such packets to the tc program, which
/// forwards them as socket buffers.
pub fn xdp_may_transmit(mode: XdpMode, interface: &str) -> bool {
    match mode {
        XdpMode::Generic => true,
        XdpMode::Native => crate::node::driver(interface).as_deref() != Some("veth"),
        XdpMode::Tc => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
