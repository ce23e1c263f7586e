//! The maps of one address family. The programs' logic (conntrack.rs, lb.rs, frontend.rs) is
//! generic over the address type, which names its family's maps: `Be32` for IPv4. A second
//! family gets maps of its own, so that IPv4's keep their size (Cilium's lb4/lb6 split).
use aya_ebpf::maps::{HashMap, LpmTrie, LruHashMap};
use proxy_common::{
    Addr, AffinityKey, AffinityValue, Backend, Be32, CtKey, CtValue, HAIRPIN_ADDR, MaglevChunk,
    NODE_PORT_ADDR, ServiceKey, ServiceValue, SourceRangeKey,
};

use crate::maps::{AFFINITY, BACKENDS, CONNTRACK, MAGLEV, NODE_ADDRS, SERVICES, SOURCE_RANGES};

pub trait Family: Addr + 'static {
    /// The source a pod reaching itself through a service is given
    /// ([`proxy_common::HAIRPIN_ADDR`]).
    const HAIRPIN: Self;
    /// The address of NodePort frontends ([`proxy_common::NODE_PORT_ADDR`]).
    const NODE_PORT: Self;
    fn services() -> &'static HashMap<ServiceKey<Self>, ServiceValue>;
    fn backends() -> &'static HashMap<u32, Backend<Self>>;
    fn conntrack() -> &'static LruHashMap<CtKey<Self>, CtValue<Self>>;
    fn affinity() -> &'static LruHashMap<AffinityKey<Self>, AffinityValue>;
    fn maglev() -> &'static HashMap<ServiceKey<Self>, MaglevChunk>;
    fn node_addrs() -> &'static HashMap<Self, u32>;
    fn source_ranges() -> &'static LpmTrie<SourceRangeKey<Self>, u8>;
}

impl Family for Be32 {
    const HAIRPIN: Self = HAIRPIN_ADDR;
    const NODE_PORT: Self = NODE_PORT_ADDR;

    #[inline(always)]
    fn services() -> &'static HashMap<ServiceKey<Self>, ServiceValue> {
        &SERVICES
    }

    #[inline(always)]
    fn backends() -> &'static HashMap<u32, Backend<Self>> {
        &BACKENDS
    }

    #[inline(always)]
    fn conntrack() -> &'static LruHashMap<CtKey<Self>, CtValue<Self>> {
        &CONNTRACK
    }

    #[inline(always)]
    fn affinity() -> &'static LruHashMap<AffinityKey<Self>, AffinityValue> {
        &AFFINITY
    }

    #[inline(always)]
    fn maglev() -> &'static HashMap<ServiceKey<Self>, MaglevChunk> {
        &MAGLEV
    }

    #[inline(always)]
    fn node_addrs() -> &'static HashMap<Self, u32> {
        &NODE_ADDRS
    }

    #[inline(always)]
    fn source_ranges() -> &'static LpmTrie<SourceRangeKey<Self>, u8> {
        &SOURCE_RANGES
    }
}
