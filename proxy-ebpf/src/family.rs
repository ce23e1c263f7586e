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
    Addr, AffinityKey, AffinityValue, Backend, Be16, Be32, Be128, CONFIG_SNAT_ADDR, CtKey, CtValue,
    DROP_FRAG_NEEDED, ExternalIface, MaglevChunk, ServiceKey, ServiceValue, SourceRangeKey,
};

use crate::{
    icmp,
    ingress::Action,
    ipv6,
    maps::{
        AFFINITY, AFFINITY6, BACKENDS, BACKENDS6, CONFIG, CONNTRACK, CONNTRACK6, MAGLEV, MAGLEV6,
        NODE_ADDRS, NODE_ADDRS6, PRIMARY_ADDR6, SERVICES, SERVICES6, SOURCE_RANGES, SOURCE_RANGES6,
    },
    packet::{self, Drop, End, FAILED, Flow, IP_CSUM_OFF, IP_DF, IP_FRAG_FLAGS_OFF, IP_TTL_OFF},
    reject,
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
    /// [`Family::parse`] of a packet from outside (IPv6: fewer extension headers, see
    /// `ipv6::MAX_EXT_HEADERS_FROM_OUTSIDE`).
    fn parse_from_outside(ctx: &TcContext) -> Option<Flow<Self>>;
    /// Rewrites `flow`'s address and port at `at` with the checksums (see [`Flow::rewrite`]).
    fn rewrite(
        flow: &mut Flow<Self>,
        ctx: &TcContext,
        at: End,
        addr: Self,
        port: Be16,
    ) -> Result<(), Drop>;
    /// The family's ICMP protocol number (ICMP, ICMPv6).
    const ICMP: u8;
    /// The ICMP error the packet is, if it is one about a TCP or UDP packet (icmp.rs).
    fn icmp_error(ctx: &TcContext) -> Option<icmp::Error<Self>>;
    /// Rewrites `error`'s quoted packet's `at` end to `addr`:`port`, with every checksum that
    /// covers it (the quoted ones where quoted, the ICMP one).
    fn rewrite_quoted(
        error: &icmp::Error<Self>,
        ctx: &TcContext,
        at: End,
        addr: Self,
        port: Be16,
    ) -> Result<(), Drop>;
    /// Rewrites `error`'s own `at` address, with the checksums that cover it.
    fn rewrite_error_addr(
        error: &icmp::Error<Self>,
        ctx: &TcContext,
        at: End,
        addr: Self,
    ) -> Result<(), Drop>;
    /// Fills in a route lookup's family and addresses from `key`.
    fn fib_addrs(params: &mut bpf_fib_lookup, key: &CtKey<Self>);

    /// The address flows sent out of `iface` to other nodes' endpoints leave from (unspecified:
    /// none of this family).
    fn snat_addr(iface: &ExternalIface) -> Self;
    /// The node's primary address of this family (unspecified until the agent wrote it).
    fn primary_addr() -> Self;
    /// Whether the packet may not be fragmented on its way (IPv4's DF; IPv6 routers never
    /// fragment).
    fn dont_fragment(ctx: &TcContext) -> Result<bool, Drop>;
    /// Takes a hop off a forwarded packet (TTL, hop limit); one that has none left goes no
    /// further.
    fn decrement_hops(ctx: &TcContext) -> Result<(), Drop>;
    /// `flow`'s packet is too big for the next hop's `mtu`: counted as dropped and answered
    /// with a fragmentation needed at once (IPv4), or left to the caller (IPv6:
    /// `Action::TooBig`, whose answer needs a frame of its own; main.rs counts it there).
    fn too_big(ctx: &TcContext, flow: Flow<Self>, mtu: u16) -> Result<Action<Self>, Drop>;
    /// A packet from outside that is no TCP or UDP flow: an ICMP error about one translated at
    /// once (IPv4), or left to the caller as `too_big` leaves it (IPv6).
    fn not_a_flow_from_outside(ctx: &TcContext) -> Result<Action<Self>, Drop>;
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
    fn parse_from_outside(ctx: &TcContext) -> Option<Flow<Self>> {
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

    const ICMP: u8 = icmp::IPPROTO_ICMP;

    #[inline(always)]
    fn icmp_error(ctx: &TcContext) -> Option<icmp::Error<Self>> {
        icmp::parse(ctx)
    }

    #[inline(always)]
    fn rewrite_quoted(
        error: &icmp::Error<Self>,
        ctx: &TcContext,
        at: End,
        addr: Self,
        port: Be16,
    ) -> Result<(), Drop> {
        icmp::rewrite_quoted(error, ctx, at, addr, port)
    }

    #[inline(always)]
    fn rewrite_error_addr(
        error: &icmp::Error<Self>,
        ctx: &TcContext,
        at: End,
        addr: Self,
    ) -> Result<(), Drop> {
        icmp::rewrite_error_addr(error, ctx, at, addr)
    }

    #[inline(always)]
    fn fib_addrs(params: &mut bpf_fib_lookup, key: &CtKey<Self>) {
        params.family = 2; // AF_INET
        params.__bindgen_anon_3.ipv4_src = key.saddr.raw();
        params.__bindgen_anon_4.ipv4_dst = key.daddr.raw();
    }

    #[inline(always)]
    fn snat_addr(iface: &ExternalIface) -> Self {
        iface.snat_addr
    }

    #[inline(always)]
    fn primary_addr() -> Self {
        Be32::from_raw(CONFIG.get(CONFIG_SNAT_ADDR).copied().unwrap_or(0))
    }

    #[inline(always)]
    fn dont_fragment(ctx: &TcContext) -> Result<bool, Drop> {
        let flags: u8 = ctx.load(IP_FRAG_FLAGS_OFF).map_err(|_| FAILED)?;
        Ok(flags & IP_DF != 0)
    }

    #[inline(always)]
    fn decrement_hops(ctx: &TcContext) -> Result<(), Drop> {
        let word: [u8; 2] = ctx.load(IP_TTL_OFF).map_err(|_| FAILED)?;
        if word[0] <= 1 {
            return Err(Drop(proxy_common::DROP_NO_ROUTE));
        }
        let new = [word[0] - 1, word[1]];
        let (from, to) = (u16::from_ne_bytes(word), u16::from_ne_bytes(new));
        ctx.l3_csum_replace(IP_CSUM_OFF, from as u64, to as u64, 2)
            .map_err(|_| FAILED)?;
        ctx.store(IP_TTL_OFF, &new, 0).map_err(|_| FAILED)
    }

    #[inline(always)]
    fn too_big(ctx: &TcContext, flow: Flow<Self>, mtu: u16) -> Result<Action<Self>, Drop> {
        crate::count_drop(ctx, DROP_FRAG_NEEDED);
        reject::frag_needed(ctx, &flow, mtu).map(Action::Verdict)
    }

    #[inline(always)]
    fn not_a_flow_from_outside(ctx: &TcContext) -> Result<Action<Self>, Drop> {
        icmp::from_outside::<Self>(ctx).map(Action::Verdict)
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
        ipv6::parse::<{ ipv6::MAX_EXT_HEADERS }>(ctx)
    }

    #[inline(always)]
    fn parse_from_outside(ctx: &TcContext) -> Option<Flow<Self>> {
        ipv6::parse::<{ ipv6::MAX_EXT_HEADERS_FROM_OUTSIDE }>(ctx)
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

    const ICMP: u8 = ipv6::NEXTHDR_ICMP;

    #[inline(always)]
    fn icmp_error(ctx: &TcContext) -> Option<icmp::Error<Self>> {
        ipv6::icmp_error(ctx)
    }

    #[inline(always)]
    fn rewrite_quoted(
        error: &icmp::Error<Self>,
        ctx: &TcContext,
        at: End,
        addr: Self,
        port: Be16,
    ) -> Result<(), Drop> {
        ipv6::rewrite_quoted(error, ctx, at, addr, port)
    }

    #[inline(always)]
    fn rewrite_error_addr(
        error: &icmp::Error<Self>,
        ctx: &TcContext,
        at: End,
        addr: Self,
    ) -> Result<(), Drop> {
        ipv6::rewrite_error_addr(error, ctx, at, addr)
    }

    #[inline(always)]
    fn fib_addrs(params: &mut bpf_fib_lookup, key: &CtKey<Self>) {
        params.family = 10; // AF_INET6
        params.__bindgen_anon_3.ipv6_src = key.saddr.raw();
        params.__bindgen_anon_4.ipv6_dst = key.daddr.raw();
    }

    #[inline(always)]
    fn snat_addr(iface: &ExternalIface) -> Self {
        iface.snat_addr6
    }

    #[inline(always)]
    fn primary_addr() -> Self {
        PRIMARY_ADDR6.get(0).copied().unwrap_or_default()
    }

    #[inline(always)]
    fn dont_fragment(_ctx: &TcContext) -> Result<bool, Drop> {
        Ok(true)
    }

    #[inline(always)]
    fn decrement_hops(ctx: &TcContext) -> Result<(), Drop> {
        ipv6::decrement_hop_limit(ctx)
    }

    #[inline(always)]
    fn too_big(_ctx: &TcContext, flow: Flow<Self>, mtu: u16) -> Result<Action<Self>, Drop> {
        Ok(Action::TooBig(flow, mtu))
    }

    #[inline(always)]
    fn not_a_flow_from_outside(_ctx: &TcContext) -> Result<Action<Self>, Drop> {
        Ok(Action::IcmpFromOutside)
    }
}
