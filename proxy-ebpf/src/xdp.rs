//! The XDP fast path for packets from outside (see external.rs for the decision). Packets are
//! rewritten in place, with both checksums updated here (XDP has no checksum helpers), and
//! either handed to the stack (a local endpoint) or transmitted at once: back out of the same
//! interface (XDP_TX) or out of another (redirect), after a route lookup.
//!
//! What XDP cannot do it leaves, untouched, to the tc program on the same interface: packets
//! with IP options, rejects, next hops not resolved yet, TTLs running out, and transmitting
//! where the agent did not allow it (`IFACE_XDP_FORWARD`: on veth in native mode, the peer
//! drops XDP frames unless it has NAPI, and the agent cannot see the peer).
use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_SUCCESS, xdp_action},
    helpers::bpf_redirect,
    programs::XdpContext,
};
use proxy_common::{Be16, Be32, IFACE_XDP_FORWARD, IPPROTO_TCP};

use crate::{
    external::{self, Verdict},
    maps::EXTERNAL_IFACES,
    packet::{self, Drop, ETH_HLEN, FAILED, Flow, Fragment, Sum, read16, write16, write32},
};

const IP: usize = ETH_HLEN;
/// The L4 header of a packet without IP options (the only ones handled here).
const L4: usize = ETH_HLEN + 20;

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
    let (src, dst, forward) = match external::decide(ctx, &flow, ingress)? {
        Verdict::Pass | Verdict::Reject => return Ok(xdp_action::XDP_PASS),
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
    // SAFETY: the Ethernet header is within the bounds checked above.
    unsafe {
        core::ptr::copy_nonoverlapping(route.dmac.as_ptr(), data as *mut u8, 6);
        core::ptr::copy_nonoverlapping(route.smac.as_ptr(), (data + 6) as *mut u8, 6);
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
    let (data, end) = (ctx.data(), ctx.data_end());
    let tcp = flow.key.proto == IPPROTO_TCP;
    // Constant offsets, each checked as the verifier wants: the whole L4 header is there.
    let l4_csum = if tcp {
        if data + L4 + 20 > end {
            return Err(FAILED);
        }
        data + L4 + 16
    } else {
        if data + L4 + 8 > end {
            return Err(FAILED);
        }
        data + L4 + 6
    };
    let k = &flow.key;
    // The addresses are in both checksums (the L4 one through its pseudo-header).
    let mut addrs = Sum::default();
    addrs.replace32(k.saddr.raw(), src.0.raw());
    addrs.replace32(k.daddr.raw(), dst.0.raw());
    let mut l4 = addrs;
    l4.replace16(k.sport.raw(), src.1.raw());
    l4.replace16(k.dport.raw(), dst.1.raw());
    let mut ip = addrs;
    // SAFETY: every access below is within data..data + L4 + 8 (or + 20 for TCP), checked above.
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
        let check = read16(l4_csum);
        // A UDP checksum of zero means "none" and stays so; a computed zero is sent as ones.
        if tcp || check != 0 {
            let new = l4.apply(check);
            write16(l4_csum, if !tcp && new == 0 { 0xffff } else { new });
        }
    }
    Ok(())
}
