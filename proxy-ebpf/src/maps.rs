//! The maps, pinned by name so they outlive the agent and the inspect CLI can read them. The sizes
//! here are defaults; the agent sets the real ones at load time (`--bpf-*-max` flags).
use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, ProgramArray},
};
use proxy_common::{
    AGENT_STATE_ENTRIES, AffinityKey, AffinityValue, Backend, Be32, Be128, CONFIG_ENTRIES,
    CT_STATES, CtKey, CtValue, DROPS_ENTRIES, ExternalIface, FAMILY_PROGS_ENTRIES, FRAGMENTS_MAX,
    FragKey, FragKey6, FragValue, HOST_NETNS_ENTRIES, MaglevChunk, ServiceKey, ServiceValue,
    SockRevNatKey, SockRevNatValue, SourceRangeKey, XDP_FAMILY_PROGS_ENTRIES,
};

/// Service slots (slot 0 per service port, slots 1..=n its backends). Not preallocated: most
/// nodes use a small part of it.
#[map(name = "SERVICES")]
pub static SERVICES: HashMap<ServiceKey, ServiceValue> =
    HashMap::pinned(1 << 20, BPF_F_NO_PREALLOC);

#[map(name = "BACKENDS")]
pub static BACKENDS: HashMap<u32, Backend> = HashMap::pinned(1 << 20, BPF_F_NO_PREALLOC);

/// Two entries a flow. LRU: when full, the least recently used flows are forgotten (and their
/// next packet picks a backend again) rather than new flows failing.
#[map(name = "CONNTRACK")]
pub static CONNTRACK: LruHashMap<CtKey, CtValue> = LruHashMap::pinned(1 << 21, 0);

/// The agent's own state, kept beside the maps it describes (the programs never read it):
/// the first backend id never handed out (so ids are not handed out again after a restart while
/// conntrack may still name them) and the layout version of these maps.
#[map(name = "AGENT_STATE")]
pub static AGENT_STATE: Array<u64> = Array::pinned(AGENT_STATE_ENTRIES, 0);

/// Dropped packets by reason (`proxy_common::DROP_*`), and when this CPU last logged one.
#[map(name = "DROPS")]
pub static DROPS: PerCpuArray<u64> = PerCpuArray::pinned(DROPS_ENTRIES, 0);

/// sessionAffinity ClientIP: each client's last backend per frontend (65536 entries, Cilium's
/// default). LRU: when full, the least recently used clients lose their affinity (their next
/// flow picks anew).
#[map(name = "AFFINITY")]
pub static AFFINITY: LruHashMap<AffinityKey, AffinityValue> = LruHashMap::pinned(1 << 16, 0);

/// Host-network sockets sent to a backend in place of a service address (sock.rs): socket
/// cookie and backend -> the service address, for getpeername() and UDP receives. LRU, 65536
/// entries (entries outlive their socket: cookies are never reused, and the least recently
/// used make room).
#[map(name = "SOCK_REVNAT")]
pub static SOCK_REVNAT: LruHashMap<SockRevNatKey, SockRevNatValue> = LruHashMap::pinned(1 << 16, 0);

/// Whose sockets get socket-level translation (sock.rs), written by the agent at start: the
/// cookie of the node's own network namespace ([`proxy_common::HOST_NETNS_COOKIE`]), and
/// whether pods' TCP connections are translated too ([`proxy_common::HOST_NETNS_PODS_TOO`]).
#[map(name = "HOST_NETNS")]
pub static HOST_NETNS: Array<u64> = Array::pinned(HOST_NETNS_ENTRIES, 0);

/// Maglev tables of the frontends that use Maglev, 1024 backend ids a value (keyed by the
/// frontend with `slot` = the chunk). Not preallocated: 4 KiB a value, a 16381 table is 16.
#[map(name = "MAGLEV")]
pub static MAGLEV: HashMap<ServiceKey, MaglevChunk> = HashMap::pinned(1 << 20, BPF_F_NO_PREALLOC);

/// Settings the agent writes at load (`proxy_common::CONFIG_*`).
#[map(name = "CONFIG")]
pub static CONFIG: Array<u32> = Array::pinned(CONFIG_ENTRIES, 0);

/// The node's addresses that NodePorts answer on (`--nodeport-addresses`), and those flows to
/// other nodes' endpoints leave from (`proxy_common::NODE_ADDR_SNAT_ONLY`), written by the
/// agent.
#[map(name = "NODE_ADDRS")]
pub static NODE_ADDRS: HashMap<Be32, u32> = HashMap::pinned(256, 0);

/// The interfaces with the external programs (by ifindex): what XDP may do there, and the
/// address flows leaving by them are sent from.
#[map(name = "EXTERNAL_IFACES")]
pub static EXTERNAL_IFACES: HashMap<u32, ExternalIface> = HashMap::pinned(256, 0);

/// loadBalancerSourceRanges: frontend and allowed source prefix -> 1 (never preallocated).
#[map(name = "SOURCE_RANGES")]
pub static SOURCE_RANGES: LpmTrie<SourceRangeKey, u8> = LpmTrie::pinned(1 << 16, 0);

/// The ports of datagrams sent in fragments, from their first fragment, for the fragments after
/// it (which carry none): they follow the first one's translation. LRU: a datagram whose
/// fragments are long done makes room.
#[map(name = "FRAGMENTS")]
pub static FRAGMENTS: LruHashMap<FragKey, FragValue> = LruHashMap::pinned(FRAGMENTS_MAX, 0);

/// Interfaces whose packets' sources are validated (source.rs): ifindex -> the interface the
/// route back to a valid source goes out of (itself, or the bridge it is a port of). Written
/// by the agent for pod interfaces and uplinks (`--bpf-source-validation`).
#[map(name = "SOURCE_IFACES")]
pub static SOURCE_IFACES: HashMap<u32, u32> = HashMap::pinned(1 << 16, BPF_F_NO_PREALLOC);

/// Each flow state's lifetime in nanoseconds, indexed by [`proxy_common::CT_STATE_TCP_ESTABLISHED`]
/// and the rest; 0: the default. Written by the agent from its flags before any program is
/// attached; a map of its own so that changing it never recreates another.
#[map(name = "CT_LIFETIMES")]
pub static CT_LIFETIMES: Array<u64> = Array::pinned(CT_STATES, 0);

// The IPv6 twins of the maps above (family.rs), of the same sizes (the agent sets them from the
// same flags).

#[map(name = "SERVICES6")]
pub static SERVICES6: HashMap<ServiceKey<Be128>, ServiceValue> =
    HashMap::pinned(1 << 20, BPF_F_NO_PREALLOC);

#[map(name = "BACKENDS6")]
pub static BACKENDS6: HashMap<u32, Backend<Be128>> = HashMap::pinned(1 << 20, BPF_F_NO_PREALLOC);

#[map(name = "CONNTRACK6")]
pub static CONNTRACK6: LruHashMap<CtKey<Be128>, CtValue<Be128>> = LruHashMap::pinned(1 << 21, 0);

#[map(name = "AFFINITY6")]
pub static AFFINITY6: LruHashMap<AffinityKey<Be128>, AffinityValue> =
    LruHashMap::pinned(1 << 16, 0);

#[map(name = "MAGLEV6")]
pub static MAGLEV6: HashMap<ServiceKey<Be128>, MaglevChunk> =
    HashMap::pinned(1 << 20, BPF_F_NO_PREALLOC);

#[map(name = "NODE_ADDRS6")]
pub static NODE_ADDRS6: HashMap<Be128, u32> = HashMap::pinned(256, 0);

#[map(name = "SOURCE_RANGES6")]
pub static SOURCE_RANGES6: LpmTrie<SourceRangeKey<Be128>, u8> = LpmTrie::pinned(1 << 16, 0);

#[map(name = "FRAGMENTS6")]
pub static FRAGMENTS6: LruHashMap<FragKey6, FragValue> = LruHashMap::pinned(FRAGMENTS_MAX, 0);

#[map(name = "SOCK_REVNAT6")]
pub static SOCK_REVNAT6: LruHashMap<SockRevNatKey<Be128>, SockRevNatValue<Be128>> =
    LruHashMap::pinned(1 << 16, 0);

/// The node's primary IPv6 address (CONFIG_SNAT_ADDR's twin), written by the agent.
#[map(name = "PRIMARY_ADDR6")]
pub static PRIMARY_ADDR6: Array<Be128> = Array::pinned(1, 0);

/// The IPv6 programs the tc programs tail-call into (`proxy_common::FAMILY_PROG_*`), filled by
/// the agent at load. Pinned as the rest: the kernel empties a program array once no process
/// or pin holds it, and the attached programs outlive the agent.
#[map(name = "FAMILY_PROGS")]
pub static FAMILY_PROGS: ProgramArray = ProgramArray::pinned(FAMILY_PROGS_ENTRIES, 0);

/// The IPv6 XDP programs (`proxy_common::XDP_PROG_*`), filled by the agent at load, as
/// FAMILY_PROGS is for the tc programs.
#[map(name = "XDP_FAMILY_PROGS")]
pub static XDP_FAMILY_PROGS: ProgramArray = ProgramArray::pinned(XDP_FAMILY_PROGS_ENTRIES, 0);
