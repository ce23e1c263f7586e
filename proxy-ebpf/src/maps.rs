//! The maps, pinned by name so they outlive the agent and the inspect CLI can read them. The sizes
//! here are defaults; the agent sets the real ones at load time (`--bpf-*-max` flags).
use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
};
use proxy_common::{
    AGENT_STATE_ENTRIES, AffinityKey, AffinityValue, Backend, CtKey, CtValue, DROPS_ENTRIES,
    ServiceKey, ServiceValue,
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
