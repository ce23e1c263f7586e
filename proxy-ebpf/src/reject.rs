//! Answering a packet with an ICMP destination unreachable from where it was sent to, as the
//! kernel would: a packet to a service port without endpoints gets a port unreachable from the
//! service address at once, as kube-proxy does, so the pod's connect() (or its next UDP
//! receive) fails in milliseconds instead of after a timeout; a packet from outside too big for
//! the interface it would be forwarded out of, and not to be fragmented, gets a fragmentation
//! needed with that interface's MTU, so the client's path MTU discovery works through a
//! NodePort.
//!
//! The packet itself becomes the answer: cut to the size of the reply, rewritten, and sent
//! back out of the interface it came in on (no routing, so no reverse-path check on the
//! service address as a source). Answers are paced per CPU as the kernel paces its own ICMP
//! errors ([`ICMP_ERRORS_PER_SEC`]); a packet beyond that is dropped unanswered, counted.
use aya_ebpf::{
    bindings::TC_ACT_UNSPEC,
    helpers::{bpf_ktime_get_ns, bpf_skb_change_tail},
    programs::TcContext,
};
use proxy_common::{
    DROP_ICMP_RATE_LIMITED, DROPS_ICMP_PACE, ICMP_ERRORS_BURST, ICMP_ERRORS_PER_SEC,
};

use crate::{
    maps::DROPS,
    packet::{self, Drop, ETH_HLEN, ETH_P_IP, FAILED, Flow},
};

const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
const ICMP_FRAG_NEEDED: u8 = 4;
const IPV4_HLEN: usize = 20;
const ICMP_HLEN: usize = 8;
/// What an ICMP error quotes of the offending packet besides its IP header (RFC 792).
const QUOTED_L4: usize = 8;
const IP_OFF: usize = ETH_HLEN;
const ICMP_OFF: usize = IP_OFF + IPV4_HLEN;
const QUOTE_OFF: usize = ICMP_OFF + ICMP_HLEN;
const REPLY_LEN: usize = QUOTE_OFF + IPV4_HLEN + QUOTED_L4;

/// Turns `flow`'s packet into an ICMP port unreachable from its destination (the service
/// address) to its source, and sends it back. A packet with IP options passes untouched (its
/// quote would not fit this fixed layout; such packets are rare).
#[inline(always)]
pub fn reject(ctx: &TcContext, flow: &Flow) -> Result<i32, Drop> {
    unreachable(ctx, flow, ICMP_PORT_UNREACH, 0)
}

/// Turns `flow`'s packet into an ICMP fragmentation needed (RFC 1191) with the next hop's
/// `mtu`, from its destination to its source, and sends it back. With IP options: passes.
#[inline(always)]
pub fn frag_needed(ctx: &TcContext, flow: &Flow, mtu: u16) -> Result<i32, Drop> {
    unreachable(ctx, flow, ICMP_FRAG_NEEDED, mtu)
}

#[inline(always)]
fn unreachable(ctx: &TcContext, flow: &Flow, code: u8, mtu: u16) -> Result<i32, Drop> {
    if flow.has_ip_options() {
        return Ok(TC_ACT_UNSPEC);
    }
    pace()?;
    let eth = reply_eth(ctx, ETH_P_IP)?;
    let offending: [u8; IPV4_HLEN] = ctx.load(IP_OFF).map_err(|_| FAILED)?;
    let l4: [u8; QUOTED_L4] = ctx.load(IP_OFF + IPV4_HLEN).map_err(|_| FAILED)?;
    // SAFETY: the helper takes the context's skb and plain integers.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, REPLY_LEN as u32, 0) } != 0 {
        return Err(FAILED);
    }
    let mut ip = [0u8; IPV4_HLEN];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((REPLY_LEN - ETH_HLEN) as u16).to_be_bytes());
    ip[8] = 64; // TTL
    ip[9] = 1; // ICMP
    ip[12..16].copy_from_slice(&offending[16..20]);
    ip[16..20].copy_from_slice(&offending[12..16]);
    let csum = checksum(sum_words(&ip));
    ip[10..12].copy_from_slice(&csum.to_be_bytes());
    let mut icmp = [0u8; ICMP_HLEN];
    icmp[0] = ICMP_DEST_UNREACH;
    icmp[1] = code;
    icmp[6..8].copy_from_slice(&mtu.to_be_bytes());
    let csum = checksum(sum_words(&icmp) + sum_words(&offending) + sum_words(&l4));
    icmp[2..4].copy_from_slice(&csum.to_be_bytes());
    ctx.store(0, &eth, 0).map_err(|_| FAILED)?;
    ctx.store(IP_OFF, &ip, 0).map_err(|_| FAILED)?;
    ctx.store(ICMP_OFF, &icmp, 0).map_err(|_| FAILED)?;
    ctx.store(QUOTE_OFF, &offending, 0).map_err(|_| FAILED)?;
    ctx.store(QUOTE_OFF + IPV4_HLEN, &l4, 0)
        .map_err(|_| FAILED)?;
    Ok(packet::send_back(ctx))
}

/// The Ethernet header of an answer to the packet in `ctx`: back to its sender, of
/// `ethertype`.
#[inline(always)]
pub fn reply_eth(ctx: &TcContext, ethertype: u16) -> Result<[u8; ETH_HLEN], Drop> {
    let macs: [u8; 12] = ctx.load(0).map_err(|_| FAILED)?;
    let mut eth = [0u8; ETH_HLEN];
    eth[..6].copy_from_slice(&macs[6..]);
    eth[6..12].copy_from_slice(&macs[..6]);
    eth[12..].copy_from_slice(&ethertype.to_be_bytes());
    Ok(eth)
}

/// Whether this CPU may send an ICMP error now; a packet that may not have one is dropped.
#[inline(always)]
pub fn pace() -> Result<(), Drop> {
    match icmp_error_due() {
        true => Ok(()),
        false => Err(Drop(DROP_ICMP_RATE_LIMITED)),
    }
}

/// Whether this CPU may send an ICMP error now: a pace of [`ICMP_ERRORS_PER_SEC`] with
/// [`ICMP_ERRORS_BURST`] ahead of it allowed (a token bucket kept as the time the next error is
/// due).
#[inline(always)]
fn icmp_error_due() -> bool {
    let Some(pace) = DROPS.get_ptr_mut(DROPS_ICMP_PACE) else {
        return true;
    };
    const INTERVAL_NS: u64 = 1_000_000_000 / ICMP_ERRORS_PER_SEC;
    // SAFETY: a per-CPU value: no other program touches it while this one runs here.
    let pace = unsafe { &mut *pace };
    let now = unsafe { bpf_ktime_get_ns() };
    let due = core::cmp::max(*pace, now);
    if due - now > ICMP_ERRORS_BURST * INTERVAL_NS {
        return false;
    }
    *pace = due + INTERVAL_NS;
    true
}

/// The one's-complement sum of `bytes` as big-endian 16-bit words (an even length).
#[inline(always)]
pub fn sum_words<const N: usize>(bytes: &[u8; N]) -> u32 {
    let mut sum = 0u32;
    let mut i = 0;
    while i + 1 < N {
        sum += u32::from(u16::from_be_bytes([bytes[i], bytes[i + 1]]));
        i += 2;
    }
    sum
}

#[inline(always)]
pub fn checksum(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}
