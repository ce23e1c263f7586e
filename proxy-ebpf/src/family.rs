//! The maps and packet formats of one address family. The programs' logic (ingress.rs,
//! egress.rs, conntrack.rs, lb.rs, frontend.rs) is generic over the address type, which names
//! its family's maps and how its packets are read and rewritten: `Be32` for IPv4 (packet.rs),
//! `Be128` for IPv6 (ipv6.rs). Each family has maps of its own, so that IPv4's keep their size
//! (Cilium's lb4/lb6 split).
use aya_ebpf::{
    bindings::bpf_fib_lookup,
    maps::{HashMap, LpmTrie, LruHashMap},
    programs::TcContext,
};
use proxy_common::{
    Addr, AffinityKey, AffinityValue, Backend, Be16, Be32, Be128, CtKey, CtValue, MaglevChunk,
    ServiceKey, ServiceValue, SourceRangeKey,
};

use crate::{
    icmp, ipv6,
    maps::{
        AFFINITY, AFFINITY6, BACKENDS, BACKENDS6, CONNTRACK, CONNTRACK6, MAGLEV, MAGLEV6,
        NODE_ADDRS, NODE_ADDRS6, SERVICES, SERVICES6, SOURCE_RANGES, SOURCE_RANGES6,
    },
    packet::{self, Drop, End, Flow},
};

pub trait Family: Addr + 'static {
    fn services() -> &'static HashMap<ServiceKey<Self>, ServiceValue>;
    fn backends() -> &'static HashMap<u32, Backend<Self>>;
    fn conntrack() -> &'static LruHashMap<CtKey<Self>, CtValue<Self>>;
    fn affinity() -> &'static LruHashMap<AffinityKey<Self>, AffinityValue>;
    fn maglev() -> &'static HashMap<ServiceKey<Self>, MaglevChunk>;
    fn node_addrs() -> &'static HashMap<Self, u32>;
    fn source_ranges() -> &'static LpmTrie<SourceRangeKey<Self>, u8>;

    /// The TCP or UDP flow of a packet of this family (see [`packet::parse`]).
    fn parse(ctx: &TcContext) -> Option<Flow<Self>>;
    /// Rewrites `flow`'s address and port at `at` with the checksums (see [`Flow::rewrite`]).
    fn rewrite(
        flow: &mut Flow<Self>,
        ctx: &TcContext,
        at: End,
        addr: Self,
        port: Be16,
    ) -> Result<(), Drop>;
    /// A packet of this family going to a pod that is not a TCP or UDP flow: an ICMP error
    /// about one is translated back (icmp.rs).
    fn not_a_flow_to_pod(ctx: &TcContext) -> Result<(), Drop>;
    /// Fills in a route lookup's family and addresses from `key`.
    fn fib_addrs(params: &mut bpf_fib_lookup, key: &CtKey<Self>);
}

/// The map accessors of a family's [`Family`] impl, from its maps in this order.
macro_rules! family_maps {
    ($services:ident, $backends:ident, $conntrack:ident, $affinity:ident, $maglev:ident,
     $node_addrs:ident, $source_ranges:ident) => {
        #[inline(always)]
        fn services() -> &'static HashMap<ServiceKey<Self>, ServiceValue> {
            &$services
        }

        #[inline(always)]
        fn backends() -> &'static HashMap<u32, Backend<Self>> {
            &$backends
        }

        #[inline(always)]
        fn conntrack() -> &'static LruHashMap<CtKey<Self>, CtValue<Self>> {
            &$conntrack
        }

        #[inline(always)]
        fn affinity() -> &'static LruHashMap<AffinityKey<Self>, AffinityValue> {
            &$affinity
        }

        #[inline(always)]
        fn maglev() -> &'static HashMap<ServiceKey<Self>, MaglevChunk> {
            &$maglev
        }

        #[inline(always)]
        fn node_addrs() -> &'static HashMap<Self, u32> {
            &$node_addrs
        }

        #[inline(always)]
        fn source_ranges() -> &'static LpmTrie<SourceRangeKey<Self>, u8> {
            &$source_ranges
        }
    };
}

impl Family for Be32 {
    family_maps!(
        SERVICES,
        BACKENDS,
        CONNTRACK,
        AFFINITY,
        MAGLEV,
        NODE_ADDRS,
        SOURCE_RANGES
    );

    #[inline(always)]
    fn parse(ctx: &TcContext) -> Option<Flow<Self>> {
        packet::parse(ctx)
    }

    #[inline(always)]
    fn rewrite(
        flow: &mut Flow<Self>,
        ctx: &TcContext,
        at: End,
        addr: Self,
        port: Be16,
    ) -> Result<(), Drop> {
        flow.rewrite4(ctx, at, addr, port)
    }

    #[inline(always)]
    fn not_a_flow_to_pod(ctx: &TcContext) -> Result<(), Drop> {
        icmp::to_client(ctx, 0)
    }

    #[inline(always)]
    fn fib_addrs(params: &mut bpf_fib_lookup, key: &CtKey<Self>) {
        params.family = 2; // AF_INET
        params.__bindgen_anon_3.ipv4_src = key.saddr.raw();
        params.__bindgen_anon_4.ipv4_dst = key.daddr.raw();
    }
}

impl Family for Be128 {
    family_maps!(
        SERVICES6,
        BACKENDS6,
        CONNTRACK6,
        AFFINITY6,
        MAGLEV6,
        NODE_ADDRS6,
        SOURCE_RANGES6
    );

    #[inline(always)]
    fn parse(ctx: &TcContext) -> Option<Flow<Self>> {
        ipv6::parse(ctx)
    }

    #[inline(always)]
    fn rewrite(
        flow: &mut Flow<Self>,
        ctx: &TcContext,
        at: End,
        addr: Self,
        port: Be16,
    ) -> Result<(), Drop> {
        ipv6::rewrite(flow, ctx, at, addr, port)
    }

    /// ICMPv6 errors are not translated yet: they pass as they are.
    #[inline(always)]
    fn not_a_flow_to_pod(_ctx: &TcContext) -> Result<(), Drop> {
        Ok(())
    }

    #[inline(always)]
    fn fib_addrs(params: &mut bpf_fib_lookup, key: &CtKey<Self>) {
        params.family = 10; // AF_INET6
        params.__bindgen_anon_3.ipv6_src = key.saddr.raw();
        params.__bindgen_anon_4.ipv6_dst = key.daddr.raw();
    }
}
