//! Map keys and values shared by the BPF programs and the agent.
//!
//! Every type is `#[repr(C)]` and `bytemuck::Pod`, so the compiler refuses hidden padding: padding
//! is spelled out as fields that must stay zero (hash maps compare keys byte by byte).
//! Fields in network byte order say so in their type (`Be16`, `Be32`).
#![no_std]

use bytemuck::{Pod, Zeroable};

/// A `u16` stored in network byte order.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct Be16(u16);

impl Be16 {
    pub const fn new(host: u16) -> Self {
        Self(host.to_be())
    }
    /// Wraps a value that is already in network byte order (as read from a packet).
    pub const fn from_raw(raw: u16) -> Self {
        Self(raw)
    }
    pub const fn get(self) -> u16 {
        u16::from_be(self.0)
    }
    pub const fn raw(self) -> u16 {
        self.0
    }
}

/// A `u32` (an IPv4 address) stored in network byte order.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct Be32(u32);

impl Be32 {
    pub const fn new(host: u32) -> Self {
        Self(host.to_be())
    }
    pub const fn from_raw(raw: u32) -> Self {
        Self(raw)
    }
    pub const fn get(self) -> u32 {
        u32::from_be(self.0)
    }
    pub const fn raw(self) -> u32 {
        self.0
    }
    pub const fn from_octets(o: [u8; 4]) -> Self {
        Self(u32::from_ne_bytes(o))
    }
    pub const fn octets(self) -> [u8; 4] {
        self.0.to_ne_bytes()
    }
}

/// A 128-bit value (an IPv6 address) stored in network byte order, as four 32-bit words: 4-byte
/// aligned, as the kernel's `in6_addr` and the address fields of packets and socket contexts.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct Be128([u32; 4]);

impl Be128 {
    /// Wraps words that are already in network byte order (as read from a packet).
    pub const fn from_raw(raw: [u32; 4]) -> Self {
        Self(raw)
    }
    pub const fn raw(self) -> [u32; 4] {
        self.0
    }
    pub const fn from_octets(o: [u8; 16]) -> Self {
        const fn word(o: &[u8; 16], i: usize) -> u32 {
            u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]])
        }
        Self([word(&o, 0), word(&o, 4), word(&o, 8), word(&o, 12)])
    }
    pub const fn octets(self) -> [u8; 16] {
        let [a, b, c, d] = self.0;
        let (a, b, c, d) = (
            a.to_ne_bytes(),
            b.to_ne_bytes(),
            c.to_ne_bytes(),
            d.to_ne_bytes(),
        );
        [
            a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3], d[0], d[1],
            d[2], d[3],
        ]
    }
}

/// An IP address of one family in network byte order: the map types that hold addresses are
/// generic over it (`Be32`, their default, for IPv4; `Be128` for IPv6), so that each family has
/// maps of its own with the same layout rules.
pub trait Addr: Copy + Default + Eq + Ord + core::hash::Hash + core::fmt::Debug + Pod {
    /// The address of NodePort frontends: "each node address" (the unspecified address, never
    /// a real one).
    const NODE_PORT: Self;
    /// The source a pod reaching itself through a service is given, so that its replies leave
    /// it (see [`HAIRPIN_ADDR`]).
    const HAIRPIN: Self;
    /// The address folded into 32 bits, for [`flow_hash`].
    fn hash_word(self) -> u32;
    /// This family's form of `ip`, if it is of this family.
    fn from_ip(ip: core::net::IpAddr) -> Option<Self>;
    fn ip(self) -> core::net::IpAddr;
}

impl Addr for Be32 {
    const NODE_PORT: Self = NODE_PORT_ADDR;
    const HAIRPIN: Self = HAIRPIN_ADDR;

    fn hash_word(self) -> u32 {
        self.get()
    }

    fn from_ip(ip: core::net::IpAddr) -> Option<Self> {
        match ip {
            core::net::IpAddr::V4(v4) => Some(Self::from_octets(v4.octets())),
            core::net::IpAddr::V6(_) => None,
        }
    }

    fn ip(self) -> core::net::IpAddr {
        core::net::Ipv4Addr::from(self.octets()).into()
    }
}

impl Addr for Be128 {
    const NODE_PORT: Self = Self([0; 4]);
    const HAIRPIN: Self = HAIRPIN_ADDR6;

    fn hash_word(self) -> u32 {
        let [a, b, c, d] = self.0;
        u32::from_be(a)
            ^ u32::from_be(b).rotate_left(8)
            ^ u32::from_be(c).rotate_left(16)
            ^ u32::from_be(d).rotate_left(24)
    }

    fn from_ip(ip: core::net::IpAddr) -> Option<Self> {
        match ip {
            core::net::IpAddr::V6(v6) => Some(Self::from_octets(v6.octets())),
            core::net::IpAddr::V4(_) => None,
        }
    }

    fn ip(self) -> core::net::IpAddr {
        core::net::Ipv6Addr::from(self.octets()).into()
    }
}

/// `Pod` for map types generic over their address ([`Addr`]), which bytemuck cannot derive:
/// each instance is checked to have no padding (its size is the sum of its fields').
macro_rules! pod {
    ($($ty:ty = $size:expr),* $(,)?) => {$(
        // SAFETY: `#[repr(C)]`, every field `Pod`, and (checked below) no padding.
        unsafe impl Zeroable for $ty {}
        unsafe impl Pod for $ty {}
        const _: () = assert!(size_of::<$ty>() == $size, "padding in a map type");
    )*};
}

pod!(
    ServiceKey<Be32> = 4 + 2 + 2 + 1 + 1 + 2,
    SourceRangeKey<Be32> = 4 + 2 + 1 + 1 + 4,
    AffinityKey<Be32> = 4 + 4 + 2 + 1 + 1,
    Backend<Be32> = 4 + 2 + 1 + 1,
    CtKey<Be32> = 4 + 4 + 2 + 2 + 1 + 3,
    CtValue<Be32> = 4 + 4 + 2 + 1 + 1 + 4 + 8 + 2 + 2 + 4,
    ServiceKey<Be128> = 16 + 2 + 2 + 1 + 1 + 2,
    SourceRangeKey<Be128> = 16 + 2 + 1 + 1 + 16,
    AffinityKey<Be128> = 16 + 16 + 2 + 1 + 1,
    Backend<Be128> = 16 + 2 + 1 + 1,
    CtKey<Be128> = 16 + 16 + 2 + 2 + 1 + 3,
    CtValue<Be128> = 4 + 16 + 2 + 1 + 1 + 16 + 8 + 2 + 2 + 4,
    SockRevNatKey<Be32> = 8 + 4 + 2 + 2,
    SockRevNatValue<Be32> = 4 + 2 + 2,
    SockRevNatKey<Be128> = 8 + 16 + 2 + 2,
    SockRevNatValue<Be128> = 16 + 2 + 2,
);

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;

/// Names of the maps, as pinned under the agent's bpffs directory.
pub const MAP_SERVICES: &str = "SERVICES";
pub const MAP_BACKENDS: &str = "BACKENDS";
pub const MAP_CONNTRACK: &str = "CONNTRACK";
pub const MAP_AGENT_STATE: &str = "AGENT_STATE";
pub const MAP_DROPS: &str = "DROPS";
pub const MAP_AFFINITY: &str = "AFFINITY";
pub const MAP_MAGLEV: &str = "MAGLEV";
pub const MAP_CONFIG: &str = "CONFIG";
pub const MAP_SOCK_REVNAT: &str = "SOCK_REVNAT";
pub const MAP_HOST_NETNS: &str = "HOST_NETNS";
pub const MAP_NODE_ADDRS: &str = "NODE_ADDRS";
pub const MAP_EXTERNAL_IFACES: &str = "EXTERNAL_IFACES";
pub const MAP_SOURCE_RANGES: &str = "SOURCE_RANGES";
pub const MAP_FRAGMENTS: &str = "FRAGMENTS";
pub const MAP_SOURCE_IFACES: &str = "SOURCE_IFACES";
pub const MAP_CT_LIFETIMES: &str = "CT_LIFETIMES";
/// The IPv6 twins of the maps that hold addresses: the same keys and values over [`Be128`].
pub const MAP_SERVICES6: &str = "SERVICES6";
pub const MAP_BACKENDS6: &str = "BACKENDS6";
pub const MAP_CONNTRACK6: &str = "CONNTRACK6";
pub const MAP_AFFINITY6: &str = "AFFINITY6";
pub const MAP_MAGLEV6: &str = "MAGLEV6";
pub const MAP_NODE_ADDRS6: &str = "NODE_ADDRS6";
pub const MAP_SOURCE_RANGES6: &str = "SOURCE_RANGES6";
pub const MAP_FRAGMENTS6: &str = "FRAGMENTS6";
pub const MAP_SOCK_REVNAT6: &str = "SOCK_REVNAT6";
/// The node's primary IPv6 address, [`CONFIG_SNAT_ADDR`]'s twin (one entry; `::` until
/// written).
pub const MAP_PRIMARY_ADDR6: &str = "PRIMARY_ADDR6";
/// The program array the tc programs hand IPv6 packets to (a tail call), by index.
pub const MAP_FAMILY_PROGS: &str = "FAMILY_PROGS";
pub const FAMILY_PROG_INGRESS6: u32 = 0;
pub const FAMILY_PROG_EGRESS6: u32 = 1;
pub const FAMILY_PROG_EXT_INGRESS6: u32 = 2;
pub const FAMILY_PROG_EXT_EGRESS6: u32 = 3;
pub const FAMILY_PROGS_ENTRIES: u32 = 4;
/// The program array `xdp_external` hands IPv6 packets to (XDP programs may tail-call only XDP
/// programs), by index.
pub const MAP_XDP_FAMILY_PROGS: &str = "XDP_FAMILY_PROGS";
pub const XDP_PROG_IPV6: u32 = 0;
/// Where `xdp_external6` sends a packet that starts a flow.
pub const XDP_PROG_NEW_FLOW6: u32 = 1;
pub const XDP_FAMILY_PROGS_ENTRIES: u32 = 2;
/// [`MAP_CONFIG`] index of the Maglev table size (a prime; the same for every frontend).
pub const CONFIG_MAGLEV_TABLE_SIZE: u32 = 0;
/// [`MAP_CONFIG`] index of the address (raw, network byte order) external flows to other nodes'
/// endpoints are sent from when they did not come to a node address (LoadBalancer and
/// external IPs): the node's primary address.
pub const CONFIG_SNAT_ADDR: u32 = 1;
/// [`MAP_CONFIG`] indexes of the first and last source port external flows to other nodes'
/// endpoints are given (`--bpf-snat-port-range`); 0 (never written): [`SNAT_PORT_MIN`] and
/// [`SNAT_PORT_MAX`].
pub const CONFIG_SNAT_PORT_MIN: u32 = 2;
pub const CONFIG_SNAT_PORT_MAX: u32 = 3;
pub const CONFIG_ENTRIES: u32 = 4;
/// [`MAP_HOST_NETNS`] index of the cookie of the node's own network namespace, whose sockets
/// the socket programs translate (0 until the agent wrote it: none).
pub const HOST_NETNS_COOKIE: u32 = 0;
/// [`MAP_HOST_NETNS`] index of whether pods' TCP connections are translated at connect() too
/// (`--bpf-socket-lb all`: 1).
pub const HOST_NETNS_PODS_TOO: u32 = 1;
pub const HOST_NETNS_ENTRIES: u32 = 2;
/// [`MAP_AGENT_STATE`] index of the first backend id never handed out.
pub const AGENT_STATE_NEXT_BACKEND_ID: u32 = 0;
/// [`MAP_AGENT_STATE`] index of the layout version of the pinned maps ([`LAYOUT_VERSION`]).
pub const AGENT_STATE_LAYOUT: u32 = 1;
/// [`MAP_AGENT_STATE`] index of the first IPv6 backend id never handed out (the IPv6 maps have
/// ids of their own).
pub const AGENT_STATE_NEXT_BACKEND_ID6: u32 = 2;
pub const AGENT_STATE_ENTRIES: u32 = 3;
/// The meaning of the pinned maps' contents. Raised whenever a release changes what a key or
/// value means (not only its size), so that an agent never misreads maps an older one left.
/// 2: backend ids per service port, draining backends and frontends. 3: slot 0 flags for
/// local-only, session affinity and Maglev; the affinity, Maglev and config maps. 4: external
/// frontends (NodePort, LoadBalancer, external IPs) with their scope, the NAT fields of
/// conntrack (zero in what layout 3 wrote, which layout 4 reads as it is), local backends.
pub const LAYOUT_VERSION: u64 = 4;

/// Why a program dropped a packet: the index of its counter in the per-CPU [`MAP_DROPS`] array.
pub const DROP_REWRITE_FAILED: u32 = 0;
/// A packet to a service address found no backend although the service has some: the agent
/// changed the service between two lookups (an update race). Dropped rather than passed on
/// untranslated towards the default route.
pub const DROP_NO_BACKEND: u32 = 1;
/// A packet to the hairpin address without a flow behind it.
pub const DROP_HAIRPIN_WITHOUT_FLOW: u32 = 2;
/// A packet to a service whose traffic policy allows only this node's endpoints, and this node
/// has none (kube-proxy drops these too).
pub const DROP_NO_LOCAL_ENDPOINTS: u32 = 3;
/// A packet to a LoadBalancer address from a source outside its loadBalancerSourceRanges.
pub const DROP_SOURCE_RANGE: u32 = 4;
/// A new external flow to another node's endpoint found no free source port to translate to.
pub const DROP_SNAT_PORTS_EXHAUSTED: u32 = 5;
/// A translated external packet had no route to its new destination.
pub const DROP_NO_ROUTE: u32 = 6;
/// An external packet to be forwarded (not a GRO or GSO one: those are segmented on the way
/// out) is bigger than its egress interface's MTU and may not be fragmented: answered with an
/// ICMP fragmentation needed instead.
pub const DROP_FRAG_NEEDED: u32 = 7;
/// An ICMP error (a reject, a fragmentation needed) this CPU may not send now
/// ([`ICMP_ERRORS_PER_SEC`]): the packet is dropped without one.
pub const DROP_ICMP_RATE_LIMITED: u32 = 8;
/// A pod's packet to a service address from a source that is not routed back through the
/// interface it came in on (a spoofed source; see [`MAP_SOURCE_IFACES`]).
pub const DROP_INVALID_SOURCE: u32 = 9;
pub const DROP_REASONS: u32 = 10;
/// A [`MAP_DROPS`] entry after the counters: when this CPU last logged a drop (logs are rate
/// limited).
pub const DROPS_LAST_LOG: u32 = DROP_REASONS;
/// A [`MAP_DROPS`] entry after the counters: this CPU's ICMP error pace, the time (ns) its
/// next error is due at the steady rate.
pub const DROPS_ICMP_PACE: u32 = DROP_REASONS + 1;
pub const DROPS_ENTRIES: u32 = DROP_REASONS + 2;
/// The ICMP errors the programs send, per CPU: at most this many a second after a burst of
/// [`ICMP_ERRORS_BURST`], as the kernel limits its own (net.ipv4.icmp_msgs_per_sec and
/// icmp_msgs_burst), so that a flood towards a Service without endpoints is not answered in
/// kind.
pub const ICMP_ERRORS_PER_SEC: u64 = 1000;
pub const ICMP_ERRORS_BURST: u64 = 50;
/// Label values of the drop reasons, by index.
pub const DROP_REASON_NAMES: [&str; DROP_REASONS as usize] = [
    "rewrite_failed",
    "no_backend",
    "hairpin_without_flow",
    "no_local_endpoints",
    "source_range",
    "snat_ports_exhausted",
    "no_route",
    "frag_needed",
    "icmp_rate_limited",
    "invalid_source",
];

/// Key of the services map. Slot 0 holds the service itself ([`ServiceValue::count`] backends);
/// slots 1..=count hold one backend id each (after Cilium's `lb4_key`). A NodePort frontend has
/// address [`NODE_PORT_ADDR`]: it answers on every address in [`MAP_NODE_ADDRS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey<A = Be32> {
    pub addr: A,
    pub port: Be16,
    pub slot: u16,
    pub proto: u8,
    /// [`SCOPE_EXTERNAL`] or [`SCOPE_INTERNAL`].
    pub scope: u8,
    pub pad: [u8; 2],
}

impl<A: Addr> ServiceKey<A> {
    pub const fn new(addr: A, port: Be16, proto: u8, slot: u16) -> Self {
        Self {
            addr,
            port,
            slot,
            proto,
            scope: SCOPE_EXTERNAL,
            pad: [0; 2],
        }
    }

    /// The same frontend's other scope (see [`SERVICE_TWO_SCOPES`]).
    pub const fn with_scope(self, scope: u8) -> Self {
        Self { scope, ..self }
    }
}

/// The address of NodePort frontends: "each node address" (never a real one).
pub const NODE_PORT_ADDR: Be32 = Be32::new(0);
/// [`ServiceKey::scope`]: the frontend as every client sees it (the only scope most have).
pub const SCOPE_EXTERNAL: u8 = 0;
/// [`ServiceKey::scope`]: the endpoints of an externalTrafficPolicy Local frontend for clients
/// inside the cluster (pods and the node), which kube-proxy sends to any endpoint.
pub const SCOPE_INTERNAL: u8 = 1;

/// Value of the services map. In slot 0: `count`, `flags` and, with [`SERVICE_AFFINITY`], the
/// affinity timeout in seconds in `backend_id` ([`ServiceValue::affinity_timeout_secs`]); in
/// slot n: `backend_id`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct ServiceValue {
    pub backend_id: u32,
    pub count: u16,
    pub flags: u16,
}

/// [`ServiceValue::flags`] of slot 0: the frontend was removed (its Service deleted or its
/// address given up) and serves only the TCP connections already established through it,
/// until the agent's drain period ends. It has no slots (count 0).
pub const SERVICE_DRAINING: u16 = 1;
/// [`ServiceValue::flags`] of slot 0: only this node's endpoints may be used
/// (internalTrafficPolicy: Local), and when there are none (count 0) packets are dropped.
pub const SERVICE_LOCAL_ONLY: u16 = 2;
/// [`ServiceValue::flags`] of slot 0: sessionAffinity ClientIP. A client's new flows go to the
/// backend of its last flow to this frontend while that is within the timeout (seconds, held in
/// slot 0's `backend_id`) and the backend still takes new flows.
pub const SERVICE_AFFINITY: u16 = 4;
/// [`ServiceValue::flags`] of slot 0: new flows pick their backend by Maglev consistent hashing
/// of the 5-tuple (the same backend on every node) from the frontend's table in [`MAP_MAGLEV`],
/// instead of at random.
pub const SERVICE_MAGLEV: u16 = 8;
/// [`ServiceValue::flags`] of slot 0: a NodePort, LoadBalancer or external IP frontend (what
/// `inspect` shows; the external programs serve cluster IPs from outside too, as kube-proxy
/// does).
pub const SERVICE_EXTERNAL: u16 = 16;
/// [`ServiceValue::flags`] of slot 0: externalTrafficPolicy Local. This scope holds only the
/// node's endpoints (and drops without them, with [`SERVICE_LOCAL_ONLY`]); clients inside the
/// cluster use the frontend's [`SCOPE_INTERNAL`] entries instead. The client address is kept.
pub const SERVICE_TWO_SCOPES: u16 = 32;
/// [`ServiceValue::flags`] of slot 0: loadBalancerSourceRanges: only sources in
/// [`MAP_SOURCE_RANGES`] for this frontend may use it from outside.
pub const SERVICE_SOURCE_RANGES: u16 = 64;
/// [`ServiceValue::flags`] of slot 0: with [`SERVICE_EXTERNAL`], a load balancer address (not an
/// external IP). Only for what `inspect` shows: the programs treat both alike.
pub const SERVICE_LOAD_BALANCER: u16 = 128;

/// Key of [`MAP_SOURCE_RANGES`] (an LPM trie): a frontend, then a source prefix. The prefix
/// length counts the bits of the frontend fields ([`SourceRangeKey::FRONTEND_BITS`]) plus the
/// source prefix's own.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SourceRangeKey<A = Be32> {
    pub addr: A,
    pub port: Be16,
    pub proto: u8,
    pub pad: u8,
    pub source: A,
}

impl<A> SourceRangeKey<A> {
    /// Bits of the key before its source address.
    pub const FRONTEND_BITS: u32 = (size_of::<A>() as u32 + 4) * 8;
}

/// [`ExternalIface::flags`]: XDP may transmit out of this interface (XDP_TX, redirect). Not
/// set where that could lose packets (see the agent's `xdp.rs`): the XDP program then leaves
/// such packets to the tc program.
pub const IFACE_XDP_FORWARD: u32 = 1;

/// Value of [`MAP_EXTERNAL_IFACES`] (keyed by ifindex): an interface with the external tc
/// programs (and XDP, where it carries NodePort addresses).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct ExternalIface {
    pub flags: u32,
    /// The address flows sent on to another node's endpoint leave from when the route to the
    /// endpoint goes out of this interface (its own, as netfilter's MASQUERADE picks), so that
    /// the replies come back to it; 0: none (the flow leaves from the NodePort's address, or
    /// CONFIG_SNAT_ADDR).
    pub snat_addr: Be32,
    /// The same for IPv6 flows (`::`: none; then the NodePort's address, or PRIMARY_ADDR6).
    pub snat_addr6: Be128,
}

/// [`MAP_NODE_ADDRS`] value flag: an address of the node NodePorts do not answer on, held only
/// as the [`ExternalIface::snat_addr`] of its interface (its packets may be replies to such
/// flows). Without it (0), NodePorts answer there.
pub const NODE_ADDR_SNAT_ONLY: u32 = 1;

/// The default source ports external flows to other nodes' endpoints are translated to: below
/// the NodePort range and Linux's ephemeral range (32768-60999), so that a translated flow
/// never takes the 5-tuple of a connection the node itself opened to that endpoint; and wide,
/// because a port is held per endpoint while its flow lives (and a little after, see
/// [`SNAT_CLOSE_GRACE_NS`]).
pub const SNAT_PORT_MIN: u16 = 1024;
pub const SNAT_PORT_MAX: u16 = 29999;
/// How long the port of a translated flow that closed stays taken, so that the flow's last
/// packets (the final ACK, a retransmitted FIN) still reach the endpoint on it.
pub const SNAT_CLOSE_GRACE_NS: u64 = 1_000_000_000;
/// How long the port of a translated flow that the endpoint closed first stays taken: the
/// endpoint holds the 5-tuple in TIME_WAIT that long (Linux's TCP_TIMEWAIT_LEN), and a new
/// connection on it from another client could be refused there.
pub const SNAT_TIME_WAIT_NS: u64 = 60_000_000_000;

/// Entries of a Maglev table per [`MAP_MAGLEV`] value: a table of size M is stored in
/// ceil(M / 1024) values keyed by the frontend with `slot` = the chunk's index.
pub const MAGLEV_CHUNK: usize = 1024;

/// Part of a frontend's Maglev table: backend ids.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct MaglevChunk {
    pub ids: [u32; MAGLEV_CHUNK],
}

/// The hash of a flow that picks its Maglev table entry: a fixed function of the 5-tuple as the
/// client sent it, so that every node picks the same backend for it.
#[inline(always)]
pub fn flow_hash<A: Addr>(key: &CtKey<A>) -> u32 {
    let ports = (u32::from(key.sport.get()) << 16) | u32::from(key.dport.get());
    let mut h = key.saddr.hash_word() ^ key.daddr.hash_word().rotate_left(16);
    h = h.wrapping_mul(0x9e37_79b1) ^ ports;
    h = h.wrapping_mul(0x85eb_ca6b) ^ u32::from(key.proto);
    // murmur3's finalizer: every input bit reaches every output bit.
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// [`Backend::flags`]: the endpoint left its service port (not ready, terminating, or gone from
/// the EndpointSlice). Established TCP connections stay on it; a SYN, and any UDP packet, picks
/// a usable backend instead.
pub const BACKEND_DRAINING: u8 = 1;
/// [`Backend::flags`]: the endpoint runs on this node (external flows to it keep their client
/// address; to others they are sent from the node).
pub const BACKEND_LOCAL: u8 = 2;

impl ServiceValue {
    /// Slot 0 of a service port.
    pub const fn head(count: u16, flags: u16, affinity_timeout_secs: u32) -> Self {
        Self {
            backend_id: affinity_timeout_secs,
            count,
            flags,
        }
    }

    pub const fn affinity_timeout_secs(&self) -> u32 {
        self.backend_id
    }
}

/// Key of the affinity map: a client of a frontend (sessionAffinity: ClientIP).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AffinityKey<A = Be32> {
    pub client: A,
    pub vip: A,
    pub vport: Be16,
    pub proto: u8,
    pub pad: u8,
}

/// Value of the affinity map: the backend the client's last new flow went to, and when.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct AffinityValue {
    pub backend_id: u32,
    pub pad: u32,
    pub last_used_ns: u64,
}

/// Key of [`MAP_FRAGMENTS`]: an IPv4 datagram sent in fragments, as each of its fragments'
/// headers names it (RFC 791: source, destination, protocol and identification).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct FragKey {
    pub saddr: Be32,
    pub daddr: Be32,
    pub id: Be16,
    pub proto: u8,
    pub pad: u8,
}

/// Value of [`MAP_FRAGMENTS`]: the ports the datagram's first fragment carried, which the
/// fragments after it lack.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct FragValue {
    pub sport: Be16,
    pub dport: Be16,
}

/// Key of [`MAP_FRAGMENTS6`]: an IPv6 datagram sent in fragments, as each fragment names it
/// (RFC 8200: source, destination, and the fragment header's identification).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct FragKey6 {
    pub saddr: Be128,
    pub daddr: Be128,
    pub id: Be32,
    pub proto: u8,
    pub pad: [u8; 3],
}

/// Datagrams in fragments remembered at once ([`MAP_FRAGMENTS`], LRU; Cilium's default size).
pub const FRAGMENTS_MAX: u32 = 8192;

/// Key of [`MAP_SOCK_REVNAT`] (and [`MAP_SOCK_REVNAT6`] over [`Be128`]): a host-network socket
/// (its cookie, unique for the boot) and the backend the socket programs sent it to. The
/// cookie in two 32-bit halves, as in memory (so that the IPv6 key has no padding).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNatKey<A = Be32> {
    cookie: [u32; 2],
    pub addr: A,
    pub port: Be16,
    pub pad: u16,
}

impl<A> SockRevNatKey<A> {
    pub fn new(cookie: u64, addr: A, port: Be16) -> Self {
        Self {
            cookie: bytemuck::cast(cookie),
            addr,
            port,
            pad: 0,
        }
    }

    pub fn cookie(&self) -> u64 {
        bytemuck::cast(self.cookie)
    }
}

/// Value of [`MAP_SOCK_REVNAT`] (and [`MAP_SOCK_REVNAT6`]): the service address the socket
/// asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNatValue<A = Be32> {
    pub addr: A,
    pub port: Be16,
    pub pad: u16,
}

/// A backend: where a service's traffic is sent. Keyed by a `u32` id in the backends map. Ids
/// belong to one service port (two services sharing a pod have two ids for it), so that the
/// draining flag says whether the endpoint is still in that service.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend<A = Be32> {
    pub addr: A,
    pub port: Be16,
    pub proto: u8,
    pub flags: u8,
}

/// A flow's 5-tuple as it appears in a packet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CtKey<A = Be32> {
    pub saddr: A,
    pub daddr: A,
    pub sport: Be16,
    pub dport: Be16,
    pub proto: u8,
    pub pad: [u8; 3],
}

/// Conntrack entry direction: a client's packets to the service address, or the backend's replies.
pub const CT_FORWARD: u8 = 1;
pub const CT_REPLY: u8 = 2;
/// Conntrack entry "direction" of a flow the kernel's netfilter translates: a connection opened
/// through kube-proxy's rules before the programs took over (the agent writes these from the
/// kernel's conntrack table, keyed by each direction's 5-tuple). Its packets pass untouched, so
/// that netfilter's NAT binding keeps it on its endpoint; a bare SYN on its 5-tuple is a new
/// connection, which the programs serve.
pub const CT_NETFILTER: u8 = 3;

/// [`CtValue::flags`]: the flow is over (a RST, or a FIN from each side); its entries now live
/// [`CT_LIFETIME_CLOSING_NS`].
pub const CT_CLOSING: u8 = 1;
/// [`CtValue::flags`]: this entry's direction sent a FIN (a half-close keeps the flow open).
pub const CT_FIN: u8 = 2;
/// [`CtValue::flags`]: a flow from outside the node through an external frontend.
pub const CT_EXTERNAL: u8 = 4;
/// [`CtValue::flags`]: with [`CT_EXTERNAL`], sent to another node's endpoint from a node
/// address and port ([`CtValue::nat_addr`]); its reply entry is keyed to that address.
pub const CT_SNAT: u8 = 8;
/// [`CtValue::flags`]: with [`CT_CLOSING`], the backend sent the first FIN: it now holds the
/// flow's 5-tuple in TIME_WAIT (see [`SNAT_TIME_WAIT_NS`]).
pub const CT_TIME_WAIT: u8 = 16;
/// [`CtValue::flags`], TCP: the connection is being opened: no reply yet, or no packet from
/// the client after the first reply (netfilter's SYN_SENT and SYN_RECV); it lives
/// [`CT_LIFETIME_OPENING_NS`], so that unanswered SYNs (a flood, a vanished client) free their
/// entries and SNAT ports in a minute. Set when the flow is recorded (entries of older releases
/// lack it: established).
pub const CT_OPENING: u8 = 32;
/// [`CtValue::flags`], TCP: a reply has been seen; the client's next packet ends
/// [`CT_OPENING`].
pub const CT_ANSWERED: u8 = 64;
/// [`CtValue::flags`], TCP: one side has sent a FIN and the other not yet (netfilter's
/// FIN_WAIT and CLOSE_WAIT): the flow lives [`CT_LIFETIME_HALF_CLOSED_NS`].
pub const CT_HALF_CLOSED: u8 = 128;
/// What a flow's two entries share of their flags (the rest is each direction's own).
pub const CT_FLOW_FLAGS: u8 =
    CT_CLOSING | CT_EXTERNAL | CT_SNAT | CT_TIME_WAIT | CT_OPENING | CT_ANSWERED | CT_HALF_CLOSED;
/// The source address of hairpin packets (a pod reaching itself through a service), so that
/// its replies leave the pod and can be translated back; such a flow's reply entry is keyed
/// pod -> this address. Link-local, never a pod's (Cilium uses the same).
pub const HAIRPIN_ADDR: Be32 = Be32::from_octets([169, 254, 42, 1]);
/// The IPv6 hairpin source: a unique local address (fd00::/8, with 169.254.42.1 in it) rather
/// than a link-local one, which a pod would resolve as a neighbour instead of sending it to its
/// default route, as it sends [`HAIRPIN_ADDR`].
pub const HAIRPIN_ADDR6: Be128 =
    Be128::from_octets([0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 169, 254, 42, 1]);

/// The states a flow's lifetime depends on ([`CtValue::state`]): each is an index of
/// [`MAP_CT_LIFETIMES`], which holds its lifetime in nanoseconds as the agent's flags set it
/// (0, not written: the default below). A packet in either direction refreshes both of a flow's
/// entries; expired entries are ignored by the programs (a packet on such a 5-tuple starts a new
/// flow) and evicted by the LRU.
pub const CT_STATE_TCP_ESTABLISHED: u32 = 0;
/// TCP, [`CT_OPENING`].
pub const CT_STATE_TCP_OPENING: u32 = 1;
/// TCP, [`CT_HALF_CLOSED`].
pub const CT_STATE_TCP_HALF_CLOSED: u32 = 2;
/// Either protocol, [`CT_CLOSING`].
pub const CT_STATE_CLOSING: u32 = 3;
/// UDP, not closing.
pub const CT_STATE_UDP: u32 = 4;
pub const CT_STATES: u32 = 5;

/// The default lifetimes. An open TCP flow: kube-proxy's default
/// `--conntrack-tcp-timeout-established`, which it gives netfilter's ESTABLISHED.
pub const CT_LIFETIME_TCP_NS: u64 = 24 * 3600 * 1_000_000_000;
pub const CT_LIFETIME_UDP_NS: u64 = 60 * 1_000_000_000;
pub const CT_LIFETIME_CLOSING_NS: u64 = 10 * 1_000_000_000;
/// A TCP flow being opened ([`CT_OPENING`]): Cilium's SYN lifetime (netfilter's SYN_SENT is two
/// minutes).
pub const CT_LIFETIME_OPENING_NS: u64 = 60 * 1_000_000_000;
/// A half-closed TCP flow ([`CT_HALF_CLOSED`]): kube-proxy's `--conntrack-tcp-timeout-close-wait`
/// default, which it gives netfilter's CLOSE_WAIT.
pub const CT_LIFETIME_HALF_CLOSED_NS: u64 = 3600 * 1_000_000_000;

/// The lifetime of [`CT_STATE_*`](CT_STATE_TCP_ESTABLISHED) `state`: `configured` (its
/// [`MAP_CT_LIFETIMES`] value), or its default where that is 0.
#[inline(always)]
pub const fn ct_lifetime_ns(state: u32, configured: u64) -> u64 {
    if configured != 0 {
        return configured;
    }
    match state {
        CT_STATE_TCP_OPENING => CT_LIFETIME_OPENING_NS,
        CT_STATE_TCP_HALF_CLOSED => CT_LIFETIME_HALF_CLOSED_NS,
        CT_STATE_CLOSING => CT_LIFETIME_CLOSING_NS,
        CT_STATE_UDP => CT_LIFETIME_UDP_NS,
        _ => CT_LIFETIME_TCP_NS,
    }
}

impl<A> CtValue<A> {
    /// Which lifetime this entry of protocol `proto` lives by ([`CT_STATE_TCP_ESTABLISHED`]...).
    #[inline(always)]
    pub fn state(&self, proto: u8) -> u32 {
        if self.flags & CT_CLOSING != 0 {
            CT_STATE_CLOSING
        } else if proto != IPPROTO_TCP {
            CT_STATE_UDP
        } else if self.flags & CT_OPENING != 0 {
            CT_STATE_TCP_OPENING
        } else if self.flags & CT_HALF_CLOSED != 0 {
            CT_STATE_TCP_HALF_CLOSED
        } else {
            CT_STATE_TCP_ESTABLISHED
        }
    }

    /// Whether this entry, last used at `last_seen_ns`, has been idle longer than `lifetime_ns`
    /// at `now`.
    #[inline(always)]
    pub fn idle_past(&self, now: u64, lifetime_ns: u64) -> bool {
        now.saturating_sub(self.last_seen_ns) > lifetime_ns
    }
}

/// [`CtValue::seq_hint`] of a TCP sequence number: its top 16 bits (64 KiB units), never 0
/// (which means not known).
#[inline(always)]
pub const fn seq_hint(seq: u32) -> u16 {
    let hint = (seq >> 16) as u16;
    if hint == 0 { 1 } else { hint }
}

/// How far behind and ahead of a direction's [`CtValue::seq_hint`] its next sequence numbers
/// may plausibly be, in 64 KiB units: a sender's RST and FIN carry its next sequence number,
/// at or just past the highest the programs saw (they see all it sends; data lost before an
/// external interface puts a little ahead). A blind guess is plausible once in about 6500
/// (netfilter's window tracking is of that order, a window of a few MiB).
pub const SEQ_BEHIND: i16 = 1;
pub const SEQ_AHEAD: i16 = 8;

/// Whether a sequence number of hint `hint` is plausible for a direction whose entry holds
/// `known` (always, while that is 0: not known).
#[inline(always)]
pub const fn seq_plausible(known: u16, hint: u16) -> bool {
    let diff = hint.wrapping_sub(known) as i16;
    known == 0 || (diff >= -SEQ_BEHIND && diff <= SEQ_AHEAD)
}

/// A conntrack entry. Each flow has two: the forward entry (keyed by client -> service address)
/// names the backend; the reply entry (keyed by backend -> client) names the service address the
/// reply must appear to come from.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtValue<A = Be32> {
    /// Forward: the chosen backend. Reply: the backend the flow was sent to.
    pub backend_id: u32,
    /// The service address and port the client used: what replies are rewritten to.
    pub vip: A,
    pub vport: Be16,
    /// [`CT_FORWARD`], [`CT_REPLY`] or [`CT_NETFILTER`].
    pub direction: u8,
    /// [`CT_CLOSING`], [`CT_FIN`], [`CT_EXTERNAL`], [`CT_SNAT`], [`CT_TIME_WAIT`],
    /// [`CT_OPENING`], [`CT_ANSWERED`], [`CT_HALF_CLOSED`].
    pub flags: u8,
    /// External flows: forward, the node address and port the flow is sent from
    /// ([`CT_SNAT`]); reply, the client's address and port. Zero otherwise.
    pub nat_addr: A,
    /// `bpf_ktime_get_ns()` of the last packet seen in this direction.
    pub last_seen_ns: u64,
    pub nat_port: Be16,
    /// TCP: where this direction's sequence numbers stand, as [`seq_hint`] of the highest
    /// plausible one seen (0: not known yet). A RST or FIN changes the flow only when its
    /// sequence number is plausible ([`seq_plausible`]): a blind spoofer must guess it.
    pub seq_hint: u16,
    /// Packets seen in this direction (not atomic: a statistic, not an accounting record).
    pub packets: u32,
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: all of these are `bytemuck::Pod`: no padding, every bit pattern valid. The
    // generic ones over every `Addr` of this crate (`Be32`, `Be128`), whose instances `pod!`
    // checks.
    unsafe impl<A: Addr> aya::Pod for ServiceKey<A> {}
    unsafe impl aya::Pod for ServiceValue {}
    unsafe impl<A: Addr> aya::Pod for Backend<A> {}
    unsafe impl<A: Addr> aya::Pod for CtKey<A> {}
    unsafe impl<A: Addr> aya::Pod for CtValue<A> {}
    unsafe impl aya::Pod for ExternalIface {}
    unsafe impl<A: Addr> aya::Pod for AffinityKey<A> {}
    unsafe impl aya::Pod for AffinityValue {}
    unsafe impl aya::Pod for MaglevChunk {}
    unsafe impl<A: Addr> aya::Pod for SockRevNatKey<A> {}
    unsafe impl<A: Addr> aya::Pod for SockRevNatValue<A> {}
    unsafe impl<A: Addr> aya::Pod for SourceRangeKey<A> {}
    unsafe impl aya::Pod for Be32 {}
    unsafe impl aya::Pod for Be128 {}
}
