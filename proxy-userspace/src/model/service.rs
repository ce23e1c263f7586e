//! A Service port and its endpoints, as the desired state holds them.
use std::{
    fmt,
    net::{IpAddr, Ipv4Addr},
    num::{NonZeroU16, NonZeroU32},
    str::FromStr,
    sync::{Arc, LazyLock, Mutex, PoisonError},
};

use crate::one_or_many::OneOrMany;

use super::{
    Cidr, Family, Protocol,
    names::{Interner, shared},
};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TargetPort {
    Number(u16),
    /// A container port name; resolved per endpoint through the EndpointSlice port of the same name.
    Name(Arc<str>),
}

impl fmt::Display for TargetPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TargetPort::Number(n) => write!(f, "{n}"),
            TargetPort::Name(name) => f.write_str(name),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    /// spec.clusterIPs (or spec.clusterIP), primary family first.
    pub cluster_ips: OneOrMany<IpAddr>,
    pub port: u16,
    pub protocol: Protocol,
    pub target_port: TargetPort,
    pub node_port: Option<u16>,
    pub external_ips: Box<[IpAddr]>,
    /// status.loadBalancer.ingress[].ip (hostname-only entries carry no address to program).
    pub load_balancer_ips: Box<[IpAddr]>,
    /// Some(seconds) when sessionAffinity is ClientIP.
    pub session_affinity_timeout: Option<NonZeroU32>,
    /// externalTrafficPolicy is Local and the service is reachable from outside the cluster.
    pub external_traffic_local: bool,
    /// internalTrafficPolicy is Local.
    pub internal_traffic_local: bool,
    /// The Service's [`crate::kubernetes::LB_ALGORITHM_ANNOTATION`], if set (else the agent's `--lb-algorithm`).
    pub lb_algorithm: Option<LbAlgorithm>,
    /// spec.loadBalancerSourceRanges (or kube-proxy's fallback, the
    /// `service.beta.kubernetes.io/load-balancer-source-ranges` annotation) of a LoadBalancer
    /// Service: the only sources its load balancer addresses accept. Empty: any source.
    pub source_ranges: Box<[Cidr]>,
    /// spec.healthCheckNodePort, kept only where kube-proxy serves it: LoadBalancer Services
    /// with externalTrafficPolicy Local (see `serve/health_check_ports.rs`). A Service-wide field, on
    /// each of its ports.
    pub health_check_node_port: Option<NonZeroU16>,
}

/// How new flows pick an endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LbAlgorithm {
    /// At random (kube-proxy's iptables and nftables modes do the same).
    Random,
    /// Maglev consistent hashing of the 5-tuple: the same endpoint for a flow on every node,
    /// and few flows move when an endpoint comes or goes.
    Maglev,
}

impl LbAlgorithm {
    /// Every algorithm, by the name the flag and the annotation give it.
    pub const NAMES: [(&str, LbAlgorithm); 2] = [
        ("random", LbAlgorithm::Random),
        ("maglev", LbAlgorithm::Maglev),
    ];

    /// What it does, in one line (for `--help`).
    pub fn about(self) -> &'static str {
        match self {
            LbAlgorithm::Random => {
                "at random (kube-proxy's iptables and nftables modes do the same)"
            }
            LbAlgorithm::Maglev => {
                "Maglev consistent hashing of the 5-tuple: the same endpoint for a flow on every \
                 node, and few flows move when an endpoint comes or goes"
            }
        }
    }
}

impl FromStr for LbAlgorithm {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::NAMES
            .iter()
            .find(|(name, _)| *name == s)
            .map(|(_, algorithm)| *algorithm)
            .ok_or_else(|| format!("{s:?} is not random or maglev"))
    }
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Endpoint {
    pub ip: IpAddr,
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// Its node and topology hints (None: neither), shared with every endpoint that has the
    /// same ones.
    pub placement: Option<Arc<Placement>>,
}

/// Where an endpoint runs (`nodeName`) and where its EndpointSlice would have it used (its
/// topology hints). A cluster has few of these and tens of thousands of endpoints: each is kept
/// once ([`Placement::shared`]), and an endpoint is 32 bytes, where with the two in it it was 48.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Placement {
    pub node_name: Option<Arc<str>>,
    pub hints: Option<Hints>,
}

impl Placement {
    /// The shared placement on `node_name` with `hints`; None with neither.
    pub fn shared(node_name: Option<&str>, hints: Option<Hints>) -> Option<Arc<Placement>> {
        static PLACEMENTS: LazyLock<Mutex<Interner<Placement>>> = LazyLock::new(Default::default);
        if node_name.is_none() && hints.is_none() {
            return None;
        }
        let placement = Placement {
            node_name: node_name.map(shared),
            hints,
        };
        let mut placements = PLACEMENTS.lock().unwrap_or_else(PoisonError::into_inner);
        Some(placements.intern(&placement, |p| Arc::new(p.clone())))
    }
}

/// Where an EndpointSlice controller would have an endpoint used (topology-aware routing:
/// `trafficDistribution` PreferClose / PreferSameZone / PreferSameNode, or the
/// `service.kubernetes.io/topology-mode` annotation, which it turns into these).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Hints {
    pub zones: Vec<Arc<str>>,
    pub nodes: Vec<Arc<str>>,
}

impl ServicePort {
    /// Whether the port is served in `family`: it has a cluster IP of it (kube-proxy's rule;
    /// its other addresses of the family are served with it).
    pub fn in_family(&self, family: Family) -> bool {
        self.cluster_ips.iter().any(|ip| family.has(*ip))
    }
}

impl Endpoint {
    pub fn node_name(&self) -> Option<&str> {
        self.placement.as_ref()?.node_name.as_deref()
    }

    pub fn hints(&self) -> Option<&Hints> {
        self.placement.as_ref()?.hints.as_ref()
    }

    /// Its address if IPv4 (the datapaths serve IPv4 for now).
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        match self.ip {
            IpAddr::V4(ip) => Some(ip),
            IpAddr::V6(_) => None,
        }
    }
}
