//! The XDP fast path for packets from outside (see external.rs for the decision). Packets are
//! rewritten in place, with both checksums updated here (XDP has no checksum helpers), and
//! either handed to the stack (a local endpoint) or transmitted at once: back out of the same
//! interface (XDP_TX) or out of another (redirect), after a route lookup.
//!
//! IPv6 packets come to a program of their own ([`try_xdp6`], by tail call) and take the same
//! path, without an IP checksum. A packet that starts a flow goes on to a third program
//! ([`start_flow6`]), which records the flow and hands the packet back: the new-flow path's
//! lookups and the rewrite would not fit one 512-byte stack together.
//!
//! What XDP cannot do it leaves, untouched, to the tc program on the same interface: packets
//! with IP options or IPv6 extension headers, rejects, next hops not resolved yet, TTLs (hop
//! limits) running out, and transmitting where the agent did not allow it
//! (`IFACE_XDP_FORWARD`: on veth in native mode, the peer drops XDP frames unless it has NAPI,
//! and the agent cannot see the peer).
use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_SUCCESS, xdp_action},
    helpers::bpf_redirect,
    programs::XdpContext,
};
use proxy_common::{Be16, Be32, Be128, CtKey, IFACE_XDP_FORWARD, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    external::{self, Verdict},
    maps::EXTERNAL_IFACES,
    packet::{
        self, Drop, ETH_HLEN, ETH_P_IPV6, FAILED, Flow, Fragment, Sum, read, read16, write16,
        write32,
    },
};

const IP: usize = ETH_HLEN;
/// The L4 header of a packet without IP options (the only ones handled here).
const L4: usize = ETH_HLEN + 20;

/// Whether the frame is IPv6 (by its EtherType).
#[inline(always)]
pub fn is_ipv6(ctx: &XdpContext) -> bool {
    let (data, end) = (ctx.data(), ctx.data_end());
    // SAFETY: within the frame, checked first.
    data + ETH_HLEN <= end && u16::from_be(unsafe { read::<u16>(data + 12) }) == ETH_P_IPV6
}

#[inline(always)]
pub fn try_xdp(ctx: &XdpContext) -> Result<u32, Drop> {
    let (data, end) = (ctx.data(), ctx.data_end());
    // The frame's length, read apart from `end`: derived from it, the compiler would drop the
    // parser's pointer bounds check as implied by the length check, and the verifier (which
    // follows only pointer comparisons) would refuse the program.
    // SAFETY: reading a context field.
    let len = unsafe { core::ptr::read_volatile(&(*ctx.ctx).data_end) } as usize - data;
    let Some(flow) = packet::parse_headers(data, end, len) else {
        return Ok(xdp_action::XDP_PASS);
    };
    // Fragments go to tc, which tracks them (FRAGMENTS) and rewrites what each one holds.
    if flow.has_ip_options() || flow.fragment != Fragment::Whole {
        return Ok(xdp_action::XDP_PASS);
    }
    // SAFETY: reading the context's ingress interface.
    let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
    let (src, dst, forward) = match external::decide(ctx, &flow, ingress, true)? {
        Verdict::Pass | Verdict::NewFlow | Verdict::Reject => return Ok(xdp_action::XDP_PASS),
        Verdict::Nat { src, dst, forward } => (src, dst, forward),
    };
    if !forward {
        rewrite(ctx, &flow, src, dst, false)?;
        return Ok(xdp_action::XDP_PASS);
    }
    let mut key = flow.key;
    (key.saddr, key.sport, key.daddr, key.dport) = (src.0, src.1, dst.0, dst.1);
    let (rc, route) = external::route(ctx, &key, flow.tot_len, ingress);
    let egress = route.ifindex;
    if rc as u32 != BPF_FIB_LKUP_RET_SUCCESS || !may_transmit(ingress) || !may_transmit(egress) {
        return Ok(xdp_action::XDP_PASS); // the tc program forwards it
    }
    if data + L4 > end {
        return Err(FAILED);
    }
    // SAFETY: within the bounds checked just above.
    if unsafe { *((data + IP + 8) as *const u8) } <= 1 {
        return Ok(xdp_action::XDP_PASS); // the tc program drops it
    }
    rewrite(ctx, &flow, src, dst, true)?;
    transmit(ctx, &route.dmac, &route.smac, ingress, egress)
}

/// Sends a rewritten frame out of `egress` to `dmac` from `smac`: back out of the interface it
/// came in on (`ingress`) or redirected.
#[inline(always)]
fn transmit(
    ctx: &XdpContext,
    dmac: &[u8; 6],
    smac: &[u8; 6],
    ingress: u32,
    egress: u32,
) -> Result<u32, Drop> {
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + ETH_HLEN > end {
        return Err(FAILED);
    }
    // SAFETY: the Ethernet header is within the bounds checked above.
    unsafe {
        core::ptr::copy_nonoverlapping(dmac.as_ptr(), data as *mut u8, 6);
        core::ptr::copy_nonoverlapping(smac.as_ptr(), (data + 6) as *mut u8, 6);
    }
    if egress == ingress {
        return Ok(xdp_action::XDP_TX);
    }
    // SAFETY: a helper with plain integer arguments.
    Ok(unsafe { bpf_redirect(egress, 0) } as u32)
}

#[inline(always)]
fn may_transmit(ifindex: u32) -> bool {
    unsafe { EXTERNAL_IFACES.get(ifindex) }.is_some_and(|i| i.flags & IFACE_XDP_FORWARD != 0)
}

/// Rewrites the addresses and ports of `flow`'s packet to `src` and `dst` (and takes a hop off
/// its TTL when `hop`), updating the IP and L4 checksums incrementally (RFC 1624).
#[inline(always)]
fn rewrite(
    ctx: &XdpContext,
    flow: &Flow,
    src: (Be32, Be16),
    dst: (Be32, Be16),
    hop: bool,
) -> Result<(), Drop> {
    let data = ctx.data();
    let tcp = flow.key.proto == IPPROTO_TCP;
    let l4_csum = l4_checksum_at(ctx, L4, tcp)?;
    let k = &flow.key;
    // The addresses are in both checksums (the L4 one through its pseudo-header).
    let mut addrs = Sum::default();
    addrs.replace32(k.saddr.raw(), src.0.raw());
    addrs.replace32(k.daddr.raw(), dst.0.raw());
    let mut l4 = addrs;
    l4.replace16(k.sport.raw(), src.1.raw());
    l4.replace16(k.dport.raw(), dst.1.raw());
    let mut ip = addrs;
    // SAFETY: every access below is within data..data + L4 + 8 (or + 20 for TCP), checked by
    // l4_checksum_at.
    unsafe {
        if hop {
            let ttl = (data + IP + 8) as *mut u8;
            let old = ((data + IP + 8) as *const u16).read_unaligned();
            *ttl -= 1;
            ip.replace16(old, ((data + IP + 8) as *const u16).read_unaligned());
        }
        write16(data + IP + 10, ip.apply(read16(data + IP + 10)));
        write32(data + IP + 12, src.0.raw());
        write32(data + IP + 16, dst.0.raw());
        write16(data + L4, src.1.raw());
        write16(data + L4 + 2, dst.1.raw());
        write_l4_checksum(l4_csum, l4, tcp);
    }
    Ok(())
}

/// Where the TCP or UDP checksum is of a frame whose L4 header starts at `l4` (a constant), the
/// whole L4 header checked to be in the frame: constant offsets, each checked as the verifier
/// wants.
#[inline(always)]
fn l4_checksum_at(ctx: &XdpContext, l4: usize, tcp: bool) -> Result<usize, Drop> {
    let (data, end) = (ctx.data(), ctx.data_end());
    if tcp {
        if data + l4 + 20 > end {
            return Err(FAILED);
        }
        Ok(data + l4 + 16)
    } else {
        if data + l4 + 8 > end {
            return Err(FAILED);
        }
        Ok(data + l4 + 6)
    }
}

/// Applies `update` to the TCP or UDP checksum at `at`.
///
/// # Safety
/// `at` and the byte after it are within the packet, checked against data_end.
#[inline(always)]
unsafe fn write_l4_checksum(at: usize, update: Sum, tcp: bool) {
    // SAFETY: as the caller says.
    unsafe {
        let check = read16(at);
        // A UDP checksum of zero means "none" and stays so; a computed zero is sent as ones.
        if tcp || check != 0 {
            let new = update.apply(check);
            write16(at, if !tcp && new == 0 { 0xffff } else { new });
        }
    }
}

/// The IPv6 header's length, and where the L4 header of a packet without extension headers (the
/// only ones handled here) starts.
const IPV6_HLEN: usize = 40;
const L4_6: usize = ETH_HLEN + IPV6_HLEN;
/// Where the hop limit is.
const HOP_LIMIT: usize = ETH_HLEN + 7;

/// What `xdp_external6` does with a packet.
pub enum Xdp6 {
    /// Return this action.
    Action(u32),
    /// The packet starts a flow: `xdp_new_flow6` starts it, then hands the packet back.
    NewFlow,
}

/// [`try_xdp`] of an IPv6 packet (`xdp_external6`), for established flows. A function of its
/// own, so that a drop's log call (main.rs) is not stacked below its frame.
#[inline(never)]
pub fn try_xdp6(ctx: &XdpContext) -> Result<Xdp6, Drop> {
    try_established6(ctx).map(|action| match action {
        NEW_FLOW => Xdp6::NewFlow,
        action => Xdp6::Action(action),
    })
}

/// Not an XDP action: [`try_established6`]'s word for a packet that starts a flow.
const NEW_FLOW: u32 = u32::MAX;

/// `xdp_new_flow6`: starts the flow `ctx`'s packet opens (records it in conntrack, as tc's
/// path does); true when the packet should go back to `xdp_external6`, which now finds the
/// flow. A rejected or passed packet goes to tc (false). A function of its own, as
/// [`try_xdp6`].
#[inline(never)]
pub fn start_flow6(ctx: &XdpContext) -> Result<bool, Drop> {
    let (data, end) = (ctx.data(), ctx.data_end());
    // SAFETY: reading a context field (read apart from `end`, as in try_xdp).
    let len = unsafe { core::ptr::read_volatile(&(*ctx.ctx).data_end) } as usize - data;
    let Some(flow) = parse6(data, end, len) else {
        return Ok(false);
    };
    // SAFETY: reading the context's ingress interface.
    let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
    Ok(matches!(
        external::decide(ctx, &flow, ingress, true)?,
        Verdict::Nat { .. }
    ))
}

#[inline(always)]
fn try_established6(ctx: &XdpContext) -> Result<u32, Drop> {
    let (data, end) = (ctx.data(), ctx.data_end());
    // SAFETY: reading a context field (read apart from `end`, as in try_xdp).
    let len = unsafe { core::ptr::read_volatile(&(*ctx.ctx).data_end) } as usize - data;
    let Some(flow) = parse6(data, end, len) else {
        return Ok(xdp_action::XDP_PASS);
    };
    // SAFETY: reading the context's ingress interface.
    let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
    let (src, dst, forward) = match external::decide(ctx, &flow, ingress, false)? {
        Verdict::NewFlow => return Ok(NEW_FLOW),
        Verdict::Pass | Verdict::Reject => return Ok(xdp_action::XDP_PASS),
        Verdict::Nat { src, dst, forward } => (src, dst, forward),
    };
    if !forward {
        rewrite6(ctx, &flow, &(src, dst), false)?;
        return Ok(xdp_action::XDP_PASS);
    }
    let mut key = flow.key;
    (key.saddr, key.sport, key.daddr, key.dport) = (src.0, src.1, dst.0, dst.1);
    let (rc, route) = external::route(ctx, &key, flow.tot_len, ingress);
    let egress = route.ifindex;
    if rc as u32 != BPF_FIB_LKUP_RET_SUCCESS || !may_transmit(ingress) || !may_transmit(egress) {
        return Ok(xdp_action::XDP_PASS); // the tc program forwards it (or answers it)
    }
    if data + L4_6 > end {
        return Err(FAILED);
    }
    // SAFETY: within the bounds checked just above.
    if unsafe { read::<u8>(data + HOP_LIMIT) } <= 1 {
        return Ok(xdp_action::XDP_PASS); // the tc program drops it
    }
    rewrite6(ctx, &flow, &(src, dst), true)?;
    transmit(ctx, &route.dmac, &route.smac, ingress, egress)
}

/// The TCP or UDP flow of an IPv6 packet without extension headers (any other passes to tc).
#[inline(always)]
fn parse6(data: usize, end: usize, len: usize) -> Option<Flow<Be128>> {
    if data + L4_6 > end {
        return None;
    }
    // SAFETY (every read): within data..data + L4_6, checked above, or the L4 header checked
    // below.
    let eth_proto = Be16::from_raw(unsafe { read::<u16>(data + 12) });
    if eth_proto.get() != ETH_P_IPV6 || unsafe { read::<u8>(data + ETH_HLEN) } >> 4 != 6 {
        return None;
    }
    let payload_len = Be16::from_raw(unsafe { read::<u16>(data + ETH_HLEN + 4) }).get() as usize;
    let proto: u8 = unsafe { read(data + ETH_HLEN + 6) };
    let l4_hdr_len = match proto {
        IPPROTO_TCP => 20,
        IPPROTO_UDP => 8,
        _ => return None,
    };
    // The header must claim at least the L4 header (a jumbogram's 0 does not), and the packet
    // hold what it claims.
    if payload_len < l4_hdr_len || len < L4_6 + payload_len {
        return None;
    }
    let l4 = data + L4_6;
    // Constant lengths, each checked as the verifier wants.
    let (tcp_flags, seq, ack) = if proto == IPPROTO_TCP {
        packet::tcp_fields(l4, end)?
    } else {
        if l4 + 8 > end {
            return None;
        }
        (0, 0, 0)
    };
    Some(Flow {
        key: CtKey {
            saddr: Be128::from_raw(unsafe { read::<[u32; 4]>(data + ETH_HLEN + 8) }),
            daddr: Be128::from_raw(unsafe { read::<[u32; 4]>(data + ETH_HLEN + 24) }),
            sport: Be16::from_raw(unsafe { read16(l4) }),
            dport: Be16::from_raw(unsafe { read16(l4 + 2) }),
            proto,
            pad: [0; 3],
        },
        tcp_flags,
        l4_off: L4_6,
        tot_len: (IPV6_HLEN + payload_len) as u16,
        fragment: Fragment::Whole,
        frag_id: 0,
        seq,
        ack,
    })
}

/// [`rewrite`] of an IPv6 packet: no IP checksum, the hop limit taken off when `hop`.
#[inline(always)]
fn rewrite6(
    ctx: &XdpContext,
    flow: &Flow<Be128>,
    &(src, dst): &((Be128, Be16), (Be128, Be16)),
    hop: bool,
) -> Result<(), Drop> {
    let data = ctx.data();
    let tcp = flow.key.proto == IPPROTO_TCP;
    let l4_csum = l4_checksum_at(ctx, L4_6, tcp)?;
    let k = &flow.key;
    let mut l4 = Sum::default();
    for (old, new) in [(k.saddr, src.0), (k.daddr, dst.0)] {
        let (old, new) = (old.raw(), new.raw());
        for i in 0..4 {
            l4.replace32(old[i], new[i]);
        }
    }
    l4.replace16(k.sport.raw(), src.1.raw());
    l4.replace16(k.dport.raw(), dst.1.raw());
    // SAFETY: every access below is within data..data + L4_6 + 8 (or + 20 for TCP), checked by
    // l4_checksum_at.
    unsafe {
        if hop {
            *((data + HOP_LIMIT) as *mut u8) -= 1;
        }
        ((data + ETH_HLEN + 8) as *mut [u32; 4]).write_unaligned(src.0.raw());
        ((data + ETH_HLEN + 24) as *mut [u32; 4]).write_unaligned(dst.0.raw());
        write16(data + L4_6, src.1.raw());
        write16(data + L4_6 + 2, dst.1.raw());
        write_l4_checksum(l4_csum, l4, tcp);
    }
    Ok(())
}
