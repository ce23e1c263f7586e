//! The rows `inspect` prints: every mode's reader returns its programming as these, so one
//! table printer serves them all.
use serde::Serialize;

use crate::model::Protocol;

/// What `inspect` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum What {
    /// Each frontend (cluster IP, NodePort, load balancer IP, external IP) with its endpoints
    /// and policies.
    Services,
    /// The endpoints.
    Backends,
    /// The flows sent to a Service.
    Conntrack,
    /// sessionAffinity ClientIP: which client is sent to which endpoint.
    Affinity,
}

/// What a mode's reader read back.
#[derive(Debug)]
pub enum Rows {
    /// The frontends; `ids`: their backends have ids (the eBPF maps'; the other modes' have
    /// none).
    Services { rows: Vec<ServiceRow>, ids: bool },
    /// The endpoints; `ids` as above.
    Backends { rows: Vec<BackendRow>, ids: bool },
    /// The ebpf mode's conntrack entries.
    Flows(Vec<FlowRow>),
    /// The kernel's conntrack entries of Service flows.
    Conntrack(Vec<ConntrackRow>),
    /// The ebpf mode's affinity entries.
    Affinity(Vec<AffinityRow>),
    /// The affinity the kernel remembers.
    ClientAffinity(Vec<ClientAffinityRow>),
    /// The kernel features the ebpf mode uses, as this node's kernel has them.
    Features(Vec<FeatureRow>),
}

/// One service address with its backends, in slot order.
#[derive(Debug, Serialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServiceRow {
    /// `*:port` for a NodePort (every node address).
    pub address: String,
    pub protocol: &'static str,
    /// ClusterIP, NodePort, LoadBalancer or ExternalIP.
    pub kind: &'static str,
    /// The endpoints of an externalTrafficPolicy Local frontend for clients inside the cluster.
    pub in_cluster_scope: bool,
    pub backends: Vec<BackendRow>,
    /// Removed: serves only the TCP connections already established through it.
    pub draining: bool,
    /// Only this node's endpoints (internalTrafficPolicy: Local on a cluster IP,
    /// externalTrafficPolicy: Local on the others); none: dropped.
    pub local_only: bool,
    /// loadBalancerSourceRanges: the only sources admitted from outside.
    pub source_ranges: Vec<String>,
    /// sessionAffinity ClientIP, with this timeout.
    pub affinity_timeout_seconds: Option<u32>,
    /// New flows pick by Maglev (else at random).
    pub maglev: bool,
}

#[derive(Debug, Serialize, PartialEq, Eq, PartialOrd, Ord, Clone)]
pub struct BackendRow {
    pub id: u32,
    pub address: String,
    pub protocol: &'static str,
    /// Left its service port: keeps its established TCP connections, takes no new flows.
    pub draining: bool,
}

#[derive(Debug, Serialize, PartialEq)]
pub struct FlowRow {
    /// `forward` (client -> service address), `reply` (endpoint -> client), or `netfilter`: a
    /// connection opened through kube-proxy's rules, which netfilter translates to its end
    /// (either 5-tuple; the programs pass its packets).
    pub direction: &'static str,
    pub protocol: &'static str,
    pub source: String,
    pub destination: String,
    /// The service address the flow was sent to.
    pub service: String,
    pub backend_id: u32,
    /// A flow from outside the node (NodePort, LoadBalancer, external IP).
    pub external: bool,
    /// For a flow sent to another node's endpoint: the node address and port it is sent from
    /// (forward entry), or the client it answers (reply entry). For a `netfilter` one: the
    /// other end (the endpoint, or the client).
    pub translated: Option<String>,
    pub packets: u64,
    pub idle_seconds: f64,
    /// A FIN or RST was seen: the entry has the short closing lifetime.
    pub closing: bool,
    /// Where the flow stands: `opening` (TCP, handshake not done), `open`, `half-closed`,
    /// `closing`, or `expired`; each has its lifetime.
    pub state: &'static str,
    /// Past its lifetime: the programs ignore it (the LRU evicts it eventually).
    pub expired: bool,
}

/// A client's affinity to a backend (sessionAffinity ClientIP).
#[derive(Debug, Serialize, PartialEq)]
pub struct AffinityRow {
    pub client: String,
    pub service: String,
    pub protocol: &'static str,
    pub backend_id: u32,
    pub idle_seconds: f64,
}

/// A flow the kernel's conntrack table holds (the nftables, iptables and userspace modes).
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct ConntrackRow {
    /// Always `forward`: the kernel's entry holds both directions.
    pub direction: &'static str,
    pub protocol: &'static str,
    pub source: String,
    /// The frontend the client sent the flow to.
    pub destination: String,
    /// The service address it matched (`*:port` for a NodePort).
    pub service: String,
    /// A flow to a NodePort, load balancer or external IP.
    pub external: bool,
    /// Where the flow was sent: the endpoint (in the userspace mode, the proxy port).
    pub translated: String,
    /// Packets from the client; None unless the kernel counts them
    /// (`net.netfilter.nf_conntrack_acct`).
    pub packets: Option<u64>,
    /// TCP's state; for UDP, `replied` or `unreplied`.
    pub state: String,
    /// The seconds the kernel keeps the entry without traffic.
    pub expires_seconds: u64,
}

/// A client's affinity to an endpoint, as the kernel remembers it (nftables, iptables modes).
#[derive(Debug, Serialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct ClientAffinityRow {
    pub client: String,
    /// The Service port, as kube-proxy names it (`namespace/name:port`).
    pub service: String,
    pub protocol: &'static str,
    pub endpoint: String,
    /// The seconds until it is forgotten; None where the kernel does not say (iptables).
    pub expires_seconds: Option<u64>,
}

/// A kernel feature the ebpf mode uses.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct FeatureRow {
    pub feature: &'static str,
    /// The mainline release that brought it.
    pub since: &'static str,
    /// This node's kernel has it.
    pub present: bool,
    /// What the ebpf mode does without it (`required`: it does not load).
    pub without: &'static str,
}

/// A row without endpoints or policies yet.
pub(crate) fn row(address: String, protocol: &'static str, kind: &'static str) -> ServiceRow {
    ServiceRow {
        address,
        protocol,
        kind,
        in_cluster_scope: false,
        backends: Vec::new(),
        draining: false,
        local_only: false,
        source_ranges: Vec::new(),
        affinity_timeout_seconds: None,
        maglev: false,
    }
}

/// An endpoint as a row lists it (ids are the eBPF maps'; none here).
pub(crate) fn backend(address: String, protocol: &'static str) -> BackendRow {
    BackendRow {
        id: 0,
        address,
        protocol,
        draining: false,
    }
}

/// A protocol as netfilter's tools print it (its name or number), as the rows spell it.
pub(crate) fn protocol(name: &str) -> &'static str {
    Protocol::from_tool(name).map_or("?", Protocol::name)
}

/// A source range as the rows show it: `10.0.0.1` as `10.0.0.1/32`, `fd00::1` as
/// `fd00::1/128`.
pub(crate) fn range(addr: &str) -> String {
    match (addr.contains('/'), addr.contains(':')) {
        (true, _) => addr.to_owned(),
        (false, false) => format!("{addr}/32"),
        (false, true) => format!("{addr}/128"),
    }
}

/// The rows of each family's rules together, sorted: a frontend in several (a NodePort is in
/// each family's) as one row with the endpoints of all.
pub(crate) fn merge_families(mut rows: Vec<ServiceRow>) -> Vec<ServiceRow> {
    rows.sort();
    let mut merged: Vec<ServiceRow> = Vec::new();
    for row in rows {
        match merged.last_mut() {
            Some(last) if (&last.address, last.protocol) == (&row.address, row.protocol) => {
                last.backends.extend(row.backends);
            }
            _ => merged.push(row),
        }
    }
    merged
}

/// An address and port as the rows show them: `10.0.0.1:80`, `[fd00::1]:80`.
pub(crate) fn host_port(addr: &str, port: u16) -> String {
    match addr.contains(':') {
        true => format!("[{addr}]:{port}"),
        false => format!("{addr}:{port}"),
    }
}
