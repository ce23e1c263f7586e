//! What the netfilter modes' rules share: kube-proxy's masquerade mark and chain-name hash, and
//! the settings the iptables and nftables rules are rendered with.
use std::net::IpAddr;

use crate::{
    model::{Cidr, Family},
    node::{self, NodePortAddresses},
};

/// The mark that asks for masquerading (kube-proxy's default bit 14).
pub const MASQ_MARK: &str = "0x4000";

/// The flags the iptables, nftables and IPVS modes share (kube-proxy's).
#[derive(Clone, Debug)]
pub struct NetfilterConfig {
    /// `--cluster-cidr`: at most one range a family.
    pub cluster_cidrs: Vec<Cidr>,
    /// `--masquerade-all`.
    pub masquerade_all: bool,
    /// `--nodeport-addresses`, and the Node object's addresses for `primary`.
    pub node_port_addresses: NodePortAddresses,
    pub primary: Vec<IpAddr>,
}

impl NetfilterConfig {
    /// The settings the rules of `family` are rendered with, on this node now.
    pub fn settings(&self, family: Family) -> anyhow::Result<Settings> {
        Ok(Settings {
            family,
            cluster_cidr: self.cluster_cidr(family),
            masquerade_all: self.masquerade_all,
            node_port_addresses: node::node_port_ips(
                &self.node_port_addresses,
                family,
                &self.primary,
                &node::interface_addresses()?,
            ),
            node_ips: family.filter(&self.primary),
        })
    }

    /// The `--cluster-cidr` range of `family`, if any.
    pub fn cluster_cidr(&self, family: Family) -> Option<Cidr> {
        self.cluster_cidrs
            .iter()
            .copied()
            .find(|c| c.family() == family)
    }
}

/// What the iptables and nftables rules of one family depend on besides the state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub family: Family,
    /// `--cluster-cidr` (its range of the family): traffic from outside it to a cluster IP is masqueraded, and traffic
    /// from inside it to an externalTrafficPolicy Local frontend short-circuits to any endpoint.
    pub cluster_cidr: Option<Cidr>,
    /// `--masquerade-all`: every connection to a cluster IP is masqueraded.
    pub masquerade_all: bool,
    /// The node addresses NodePorts answer on; None: every local address (`addrtype LOCAL`,
    /// `fib daddr type local`).
    pub node_port_addresses: Option<Vec<IpAddr>>,
    /// The node's own (primary) addresses of the family: see
    /// [`Settings::admits_load_balancer_ips`].
    pub node_ips: Vec<IpAddr>,
}

impl Settings {
    /// The settings of `family` with no flag given: no cluster CIDR, NodePorts on every local
    /// address.
    pub fn defaults(family: Family) -> Self {
        Self {
            family,
            cluster_cidr: None,
            masquerade_all: false,
            node_port_addresses: None,
            node_ips: Vec::new(),
        }
    }

    /// Whether a load balancer frontend with these source ranges also admits its own load
    /// balancer addresses as sources (kube-proxy's `allowFromNode`): when the ranges hold a
    /// node address, the node may reach the load balancer, and a node reaching its own VIP
    /// loops back with the VIP as source.
    pub fn admits_load_balancer_ips(&self, ranges: &[Cidr]) -> bool {
        ranges
            .iter()
            .any(|range| self.node_ips.iter().any(|ip| range.contains(*ip)))
    }
}

/// The loadBalancerSourceRanges of the frontend at `address` (`ip:port`) among the sources its
/// firewall admits (`sources`): all but its own address, which
/// [`Settings::admits_load_balancer_ips`] adds.
pub fn source_ranges_of(address: &str, mut sources: Vec<String>) -> Vec<String> {
    if let Some((ip, _)) = address.rsplit_once(':') {
        sources.retain(|s| s != ip && *s != format!("{ip}/32"));
    }
    sources
}

/// The first 16 characters of the base32 (RFC 4648) encoding of the SHA-256 of `text`.
pub(crate) fn hash16(text: &str) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let digest = ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
    let bytes = digest.as_ref();
    // 16 characters of 5 bits: the first 80 bits, i.e. 10 bytes.
    let bits = bytes[..10]
        .iter()
        .fold(0u128, |acc, b| (acc << 8) | u128::from(*b));
    (0..16)
        .map(|i| ALPHABET[((bits >> (75 - 5 * i)) & 31) as usize] as char)
        .collect()
}
