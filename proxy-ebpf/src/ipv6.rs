//! IPv6 packets: their TCP/UDP flow, through extension headers, and the rewrite of an address
//! and port. IPv6 has no header checksum: only the TCP/UDP checksum, whose pseudo-header covers
//! the addresses, is updated. Neighbour discovery, router advertisements and every other
//! ICMPv6 message are no flow: they pass untouched.
use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_UNSPEC},
    helpers::bpf_skb_change_tail,
    programs::TcContext,
};
use proxy_common::{
    Be16, Be32, Be128, CtKey, DROP_NO_ROUTE, FragKey6, FragValue, IPPROTO_TCP, IPPROTO_UDP,
    seq_hint,
};

use crate::{
    icmp::Error,
    maps::FRAGMENTS6,
    packet::{
        Drop, ETH_HLEN, ETH_P_IPV6, End, FAILED, Flow, Fragment, Sum, pull_headers, read, read16,
        send_back, tcp_fields,
    },
    reject,
};

/// The fixed IPv6 header's length, and where it puts the addresses.
const IPV6_HLEN: usize = 40;
const IPV6_MIN: usize = ETH_HLEN + IPV6_HLEN;
const SADDR_OFF: usize = ETH_HLEN + 8;
const DADDR_OFF: usize = ETH_HLEN + 24;

const NEXTHDR_HOP: u8 = 0;
const NEXTHDR_ROUTING: u8 = 43;
const NEXTHDR_FRAGMENT: u8 = 44;
const NEXTHDR_AUTH: u8 = 51;
const NEXTHDR_DEST: u8 = 60;
pub const NEXTHDR_ICMP: u8 = 58;
/// Extension headers walked before the L4 header of a pod's packet; a packet with more passes
/// untouched (RFC 8200 orders them: hop-by-hop, destination options, routing, fragment, then AH
/// and destination options again).
pub const MAX_EXT_HEADERS: usize = 6;
/// The same for packets from outside (one: a fragment header, typically). Their path holds the
/// SNAT port search, and each way through the header walk has the verifier go through that
/// search again: with six, Linux 6.1's verifier gives up (a million instructions).
pub const MAX_EXT_HEADERS_FROM_OUTSIDE: usize = 1;
/// The fragment header's offset field: the offset in 8-byte units, then two reserved bits and
/// the more-fragments flag.
const FRAG_OFFSET_MASK: u16 = 0xfff8;
const FRAG_MORE: u16 = 0x0001;
/// Longest header run pulled into the linear data at once: Ethernet, IPv6, a TCP header (a
/// packet with extension headers is read through the helpers past them).
const MAX_HDR: usize = IPV6_MIN + 20;

/// Reads the 5-tuple of an IPv6 TCP/UDP packet, past its extension headers (`MAX_EXT` of them
/// at most). As for IPv4
/// (`packet::parse`): a fragment after the first gets its first fragment's ports from
/// FRAGMENTS6, and anything that is not TCP/UDP (ICMPv6 included), malformed or truncated is
/// `None`: not ours, it passes untouched.
#[inline(always)]
pub fn parse<const MAX_EXT: usize>(ctx: &TcContext) -> Option<Flow<Be128>> {
    let len = ctx.len() as usize;
    pull_headers(ctx, MAX_HDR)?;
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + IPV6_MIN > end {
        return None;
    }
    let eth_proto = Be16::from_raw(unsafe { read::<u16>(data + 12) });
    let ver: u8 = unsafe { read(data + ETH_HLEN) };
    if eth_proto.get() != ETH_P_IPV6 || ver >> 4 != 6 {
        return None;
    }
    let payload_len = Be16::from_raw(unsafe { read::<u16>(data + ETH_HLEN + 4) }).get() as usize;
    let mut next: u8 = unsafe { read(data + ETH_HLEN + 6) };
    let saddr = Be128::from_raw(unsafe { read::<[u32; 4]>(data + SADDR_OFF) });
    let daddr = Be128::from_raw(unsafe { read::<[u32; 4]>(data + DADDR_OFF) });
    // A jumbogram (payload length 0, the length in a hop-by-hop option) is not ours either.
    if payload_len == 0 || len < IPV6_MIN + payload_len {
        return None;
    }
    let mut l4_off = IPV6_MIN;
    // The fragment header's offset field and identification, if there is one (plain
    // variables: an Option's unset payload is a register the verifier refuses to spill).
    let mut fragmented = false;
    let (mut frag_field, mut frag_id) = (0u16, 0u32);
    // Extension headers are rare: read through the helper, whose offset the verifier need not
    // follow.
    for _ in 0..MAX_EXT {
        let ext_len = match next {
            NEXTHDR_HOP | NEXTHDR_ROUTING | NEXTHDR_DEST => {
                let hdr: [u8; 2] = ctx.load(l4_off).ok()?;
                next = hdr[0];
                (usize::from(hdr[1]) + 1) * 8
            }
            NEXTHDR_AUTH => {
                let hdr: [u8; 2] = ctx.load(l4_off).ok()?;
                next = hdr[0];
                (usize::from(hdr[1]) + 2) * 4
            }
            NEXTHDR_FRAGMENT => {
                let hdr: [u8; 8] = ctx.load(l4_off).ok()?;
                next = hdr[0];
                fragmented = true;
                frag_field = u16::from_be_bytes([hdr[2], hdr[3]]);
                frag_id = u32::from_ne_bytes([hdr[4], hdr[5], hdr[6], hdr[7]]);
                8
            }
            _ => break,
        };
        l4_off += ext_len;
    }
    let l4_hdr_len = match next {
        IPPROTO_TCP => 20,
        IPPROTO_UDP => 8,
        _ => return None,
    };
    let tot_len = IPV6_HLEN + payload_len;
    let fragment = if !fragmented {
        Fragment::Whole
    } else if frag_field & FRAG_OFFSET_MASK != 0 {
        Fragment::Later
    } else if frag_field & FRAG_MORE != 0 {
        Fragment::First
    } else {
        // An atomic fragment (RFC 6946: offset 0, no more): a datagram of its own.
        Fragment::Whole
    };
    let mut flow = Flow {
        key: CtKey {
            saddr,
            daddr,
            sport: Be16::new(0),
            dport: Be16::new(0),
            proto: next,
            pad: [0; 3],
        },
        tcp_flags: 0,
        l4_off,
        tot_len: tot_len as u16,
        fragment,
        frag_id,
        seq: 0,
        ack: 0,
    };
    if fragment == Fragment::Later {
        let ports = unsafe { FRAGMENTS6.get(frag_key(&flow)) }?;
        (flow.key.sport, flow.key.dport) = (ports.sport, ports.dport);
        return Some(flow);
    }
    if tot_len < l4_off - ETH_HLEN + l4_hdr_len {
        return None;
    }
    let (sport, dport, tcp_flags, seq, ack) = if l4_off == IPV6_MIN {
        // The usual packet: the L4 header at a constant offset, read in place.
        let l4 = data + IPV6_MIN;
        let port = |at: usize| Be16::from_raw(unsafe { read::<u16>(at) });
        if next == IPPROTO_TCP {
            let (flags, seq, ack) = tcp_fields(l4, end)?;
            (port(l4), port(l4 + 2), flags, seq, ack)
        } else {
            if l4 + 8 > end {
                return None;
            }
            (port(l4), port(l4 + 2), 0, 0, 0)
        }
    } else {
        let hdr: [u8; 14] = if next == IPPROTO_TCP {
            ctx.load(l4_off).ok()?
        } else {
            let udp: [u8; 8] = ctx.load(l4_off).ok()?;
            let mut hdr = [0u8; 14];
            hdr[..8].copy_from_slice(&udp);
            hdr
        };
        let port = |i: usize| Be16::from_raw(u16::from_ne_bytes([hdr[i], hdr[i + 1]]));
        let hint = |i: usize| {
            seq_hint(u32::from_be_bytes([
                hdr[i],
                hdr[i + 1],
                hdr[i + 2],
                hdr[i + 3],
            ]))
        };
        match next {
            IPPROTO_TCP => (port(0), port(2), hdr[13], hint(4), hint(8)),
            _ => (port(0), port(2), 0, 0, 0),
        }
    };
    (flow.key.sport, flow.key.dport) = (sport, dport);
    (flow.tcp_flags, flow.seq, flow.ack) = (tcp_flags, seq, ack);
    if fragment == Fragment::First {
        // A failed insert (memory pressure) leaves the later fragments untranslated.
        let _ = FRAGMENTS6.insert(frag_key(&flow), FragValue { sport, dport }, 0);
    }
    Some(flow)
}

fn frag_key(flow: &Flow<Be128>) -> FragKey6 {
    FragKey6 {
        saddr: flow.key.saddr,
        daddr: flow.key.daddr,
        id: Be32::from_raw(flow.frag_id),
        proto: flow.key.proto,
        pad: [0; 3],
    }
}

/// Rewrites the source or destination address and port of `flow`'s packet, updating the
/// TCP/UDP checksum (its pseudo-header covers the addresses). A fragment after the first has
/// only its address rewritten: its datagram's checksum and ports are in the first.
#[inline(always)]
pub fn rewrite(
    flow: &mut Flow<Be128>,
    ctx: &TcContext,
    at: End,
    addr: Be128,
    port: Be16,
) -> Result<(), Drop> {
    let (old_addr, old_port, addr_off, port_off) = match at {
        End::Source => (flow.key.saddr, flow.key.sport, SADDR_OFF, flow.l4_off),
        End::Destination => (flow.key.daddr, flow.key.dport, DADDR_OFF, flow.l4_off + 2),
    };
    let whole = flow.fragment != Fragment::Later;
    if whole {
        let csum_off = flow.l4_csum_off();
        let l4_flags = if flow.key.proto == IPPROTO_TCP {
            0
        } else {
            BPF_F_MARK_MANGLED_0 as u64
        };
        if old_addr != addr {
            let mut sum = Sum::default();
            let (old, new) = (old_addr.raw(), addr.raw());
            for i in 0..4 {
                sum.replace32(old[i], new[i]);
            }
            // Size 0: the value is a checksum difference, added as it is (the helper knows
            // whether the field holds a full checksum or a pseudo-header sum, see rewrite4).
            ctx.l4_csum_replace(
                csum_off,
                0,
                sum.diff() as u64,
                l4_flags | BPF_F_PSEUDO_HDR as u64,
            )
            .map_err(|_| FAILED)?;
        }
        if old_port != port {
            let (from, to) = (old_port.raw() as u64, port.raw() as u64);
            ctx.l4_csum_replace(csum_off, from, to, l4_flags | 2)
                .map_err(|_| FAILED)?;
            ctx.store(port_off, &port.raw(), 0).map_err(|_| FAILED)?;
        }
    }
    if old_addr != addr {
        // The helpers above may have moved the data: its bounds are read again.
        let (data, end) = (ctx.data(), ctx.data_end());
        if data + IPV6_MIN > end {
            return Err(FAILED);
        }
        // SAFETY: within data..data + IPV6_MIN, checked above.
        unsafe { ((data + addr_off) as *mut [u32; 4]).write_unaligned(addr.raw()) };
    }
    flow.set(at, addr, port);
    Ok(())
}

/// Where the hop limit is.
const HOP_LIMIT_OFF: usize = ETH_HLEN + 7;

/// Takes a hop off a forwarded packet (no checksum covers the hop limit); one that has none
/// left goes no further.
#[inline(always)]
pub fn decrement_hop_limit(ctx: &TcContext) -> Result<(), Drop> {
    let hops: u8 = ctx.load(HOP_LIMIT_OFF).map_err(|_| FAILED)?;
    if hops <= 1 {
        return Err(Drop(DROP_NO_ROUTE));
    }
    ctx.store(HOP_LIMIT_OFF, &(hops - 1), 0).map_err(|_| FAILED)
}

const ICMPV6_HLEN: usize = 8;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PORT_UNREACH: u8 = 4;
const ICMPV6_PKT_TOOBIG: u8 = 2;
/// The smallest MTU an IPv6 link may have (RFC 8200): a packet too big never names less.
const IPV6_MIN_MTU: u32 = 1280;
/// What the reject quotes of the offending packet besides its IPv6 header.
const QUOTED_L4: usize = 8;
/// What a packet too big quotes besides the IPv6 header (the packet is at least 1280 bytes
/// long): room for a fragment header and the ports behind it, so that the sender of a
/// fragmented datagram finds its socket. (RFC 4443 asks for as much as fits in 1280 bytes; the
/// answer's buffers live on the stack, and Linux needs no more.)
const QUOTED_TOO_BIG: usize = 16;
const ICMP_OFF: usize = IPV6_MIN;
const QUOTE_OFF: usize = ICMP_OFF + ICMPV6_HLEN;

/// Turns the packet into an ICMPv6 port unreachable (RFC 4443) from its destination (the
/// service address) to its source, and sends it back, as `reject::reject` does for IPv4. A
/// packet with extension headers passes untouched (its quote would not fit this fixed layout).
/// A function of its own: its buffers need not share the stack frame of the flow's lookups.
#[inline(never)]
pub fn reject(ctx: &TcContext) -> Result<i32, Drop> {
    let next: u8 = ctx.load(ETH_HLEN + 6).map_err(|_| FAILED)?;
    if next != IPPROTO_TCP && next != IPPROTO_UDP {
        return Ok(TC_ACT_UNSPEC);
    }
    answer::<QUOTED_L4>(ctx, ICMPV6_DEST_UNREACH, ICMPV6_PORT_UNREACH, 0)
}

/// Turns the packet into an ICMPv6 packet too big with the next hop's `mtu` (RFC 8201's path
/// MTU discovery; 0, from a kernel whose route lookup does not give it: the minimum), as
/// [`reject`] does.
#[inline(never)]
pub fn too_big(ctx: &TcContext, mtu: u16) -> Result<i32, Drop> {
    answer::<QUOTED_TOO_BIG>(ctx, ICMPV6_PKT_TOOBIG, 0, u32::from(mtu).max(IPV6_MIN_MTU))
}

/// The ICMPv6 error `kind`, `code` (with `word` after the checksum: the MTU of a packet too
/// big) answering the packet, quoting its IPv6 header and the `N` bytes after it, sent back to
/// its source.
#[inline(always)]
fn answer<const N: usize>(ctx: &TcContext, kind: u8, code: u8, word: u32) -> Result<i32, Drop> {
    reject::pace()?;
    let eth = reject::reply_eth(ctx, ETH_P_IPV6)?;
    let offending: [u8; IPV6_HLEN] = ctx.load(ETH_HLEN).map_err(|_| FAILED)?;
    let l4: [u8; N] = ctx.load(IPV6_MIN).map_err(|_| FAILED)?;
    let reply_len = QUOTE_OFF + IPV6_HLEN + N;
    // SAFETY: the helper takes the context's skb and plain integers.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, reply_len as u32, 0) } != 0 {
        return Err(FAILED);
    }
    let payload_len = (reply_len - IPV6_MIN) as u16;
    // From the offending packet's destination to its source.
    let mut addrs = [0u8; 32];
    addrs[..16].copy_from_slice(&offending[24..40]);
    addrs[16..].copy_from_slice(&offending[8..24]);
    let mut ip = [0u8; IPV6_HLEN];
    ip[0] = 0x60;
    ip[4..6].copy_from_slice(&payload_len.to_be_bytes());
    ip[6] = NEXTHDR_ICMP;
    ip[7] = 64; // hop limit
    ip[8..].copy_from_slice(&addrs);
    let mut icmp = [0u8; ICMPV6_HLEN];
    icmp[0] = kind;
    icmp[1] = code;
    icmp[4..].copy_from_slice(&word.to_be_bytes());
    // The pseudo-header: both addresses, the upper-layer length and next header.
    let pseudo = reject::sum_words(&addrs) + u32::from(payload_len) + u32::from(NEXTHDR_ICMP);
    let csum = reject::checksum(
        pseudo + reject::sum_words(&icmp) + reject::sum_words(&offending) + reject::sum_words(&l4),
    );
    icmp[2..4].copy_from_slice(&csum.to_be_bytes());
    ctx.store(0, &eth, 0).map_err(|_| FAILED)?;
    ctx.store(ETH_HLEN, &ip, 0).map_err(|_| FAILED)?;
    ctx.store(ICMP_OFF, &icmp, 0).map_err(|_| FAILED)?;
    ctx.store(QUOTE_OFF, &offending, 0).map_err(|_| FAILED)?;
    ctx.store(QUOTE_OFF + IPV6_HLEN, &l4, 0)
        .map_err(|_| FAILED)?;
    Ok(send_back(ctx))
}

/// ICMPv6 errors (RFC 4443: destination unreachable, packet too big, time exceeded, parameter
/// problem; informational messages are 128 and up).
const ICMPV6_ERROR_MAX: u8 = 4;
const ERROR_ICMP: usize = IPV6_MIN;
const ERROR_INNER: usize = ERROR_ICMP + ICMPV6_HLEN;
const ERROR_INNER_L4: usize = ERROR_INNER + IPV6_HLEN;
/// An error quotes at least the offending packet's IPv6 header and 8 bytes of its payload
/// (for a fragment, its fragment header; then 8 more bytes are needed for its ports).
const ERROR_MIN_LEN: usize = ERROR_INNER_L4 + 8;
const FRAG_HLEN: usize = 8;

/// The ICMPv6 error `ctx` holds, if it is one about a TCP or UDP packet (icmp.rs): both IPv6
/// headers without extension headers, but for the fragment header of a quoted first fragment
/// (a packet too big about a fragmented datagram quotes one). Any other passes untranslated.
#[inline(always)]
pub fn icmp_error(ctx: &TcContext) -> Option<Error<Be128>> {
    let len = ctx.len() as usize;
    pull_headers(ctx, ERROR_MIN_LEN)?;
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + ERROR_MIN_LEN > end {
        return None;
    }
    // SAFETY (every read): within data..data + ERROR_MIN_LEN, checked above.
    let word = |off: usize| Be16::from_raw(unsafe { read16(data + off) }).get();
    let byte = |off: usize| unsafe { read::<u8>(data + off) };
    // The message ends where the IPv6 header says (what follows is padding), within the frame.
    let end_of_message = IPV6_MIN + word(ETH_HLEN + 4) as usize;
    let outer_ok = word(12) == ETH_P_IPV6
        && byte(ETH_HLEN) >> 4 == 6
        && byte(ETH_HLEN + 6) == NEXTHDR_ICMP
        && end_of_message <= len;
    let kind = byte(ERROR_ICMP);
    let mut proto = byte(ERROR_INNER + 6);
    let mut inner_l4 = ERROR_INNER_L4;
    if proto == NEXTHDR_FRAGMENT && word(ERROR_INNER_L4 + 2) & FRAG_OFFSET_MASK == 0 {
        proto = byte(ERROR_INNER_L4);
        inner_l4 += FRAG_HLEN;
    }
    let inner_ok = byte(ERROR_INNER) >> 4 == 6
        && (proto == IPPROTO_TCP || proto == IPPROTO_UDP)
        && end_of_message >= inner_l4 + 8;
    if !(outer_ok && (1..=ICMPV6_ERROR_MAX).contains(&kind) && inner_ok) {
        return None;
    }
    let addr = |off: usize| Be128::from_raw(unsafe { read::<[u32; 4]>(data + off) });
    let ports: [u16; 2] = ctx.load(inner_l4).ok()?;
    Some(Error {
        inner: CtKey {
            saddr: addr(ERROR_INNER + 8),
            daddr: addr(ERROR_INNER + 24),
            sport: Be16::from_raw(ports[0]),
            dport: Be16::from_raw(ports[1]),
            proto,
            pad: [0; 3],
        },
        outer_saddr: addr(SADDR_OFF),
        outer_daddr: addr(DADDR_OFF),
        quotes_tcp_csum: end_of_message >= inner_l4 + 18,
        inner_l4,
    })
}

/// The one's complement difference of replacing the address `old` with `new`.
#[inline(always)]
fn addr_sum(old: Be128, new: Be128) -> Sum {
    let mut sum = Sum::default();
    let (old, new) = (old.raw(), new.raw());
    for i in 0..4 {
        sum.replace32(old[i], new[i]);
    }
    sum
}

/// Rewrites the quoted packet's `at` end of `error` to `addr`:`port`, with its TCP or UDP
/// checksum where quoted (its pseudo-header holds the address) and the ICMPv6 checksum, which
/// covers every quoted byte changed. Through the helpers: the quoted L4 header's place varies.
#[inline(always)]
pub fn rewrite_quoted(
    error: &Error<Be128>,
    ctx: &TcContext,
    at: End,
    addr: Be128,
    port: Be16,
) -> Result<(), Drop> {
    rewrite_quoted_to(error, ctx, at, &(addr, port))
}

/// [`rewrite_quoted`] in a function of its own (its arguments packed: a call takes at most
/// five).
#[inline(never)]
fn rewrite_quoted_to(
    error: &Error<Be128>,
    ctx: &TcContext,
    at: End,
    &(addr, port): &(Be128, Be16),
) -> Result<(), Drop> {
    let l4 = error.inner_l4;
    let (old_addr, old_port, addr_field, port_field) = match at {
        End::Source => (error.inner.saddr, error.inner.sport, ERROR_INNER + 8, l4),
        End::Destination => (
            error.inner.daddr,
            error.inner.dport,
            ERROR_INNER + 24,
            l4 + 2,
        ),
    };
    let mut l4_sum = addr_sum(old_addr, addr);
    l4_sum.replace16(old_port.raw(), port.raw());
    let mut icmp = l4_sum;
    let udp = error.inner.proto == IPPROTO_UDP;
    let csum_off = if udp { l4 + 6 } else { l4 + 16 };
    if udp || error.quotes_tcp_csum {
        let old: u16 = ctx.load(csum_off).map_err(|_| FAILED)?;
        // A UDP checksum of zero means "none" and stays so; a computed zero is sent as ones.
        if !udp || old != 0 {
            let new = match l4_sum.apply(old) {
                0 if udp => 0xffff,
                sum => sum,
            };
            icmp.replace16(old, new);
            ctx.store(csum_off, &new, 0).map_err(|_| FAILED)?;
        }
    }
    ctx.store(addr_field, &addr.raw(), 0).map_err(|_| FAILED)?;
    ctx.store(port_field, &port.raw(), 0).map_err(|_| FAILED)?;
    let check: u16 = ctx.load(ERROR_ICMP + 2).map_err(|_| FAILED)?;
    ctx.store(ERROR_ICMP + 2, &icmp.apply(check), 0)
        .map_err(|_| FAILED)
}

/// Rewrites `error`'s own `at` address, with the ICMPv6 checksum (its pseudo-header holds it).
#[inline(never)]
pub fn rewrite_error_addr(
    error: &Error<Be128>,
    ctx: &TcContext,
    at: End,
    addr: Be128,
) -> Result<(), Drop> {
    let (old, field) = match at {
        End::Source => (error.outer_saddr, SADDR_OFF),
        End::Destination => (error.outer_daddr, DADDR_OFF),
    };
    let check: u16 = ctx.load(ERROR_ICMP + 2).map_err(|_| FAILED)?;
    ctx.store(ERROR_ICMP + 2, &addr_sum(old, addr).apply(check), 0)
        .map_err(|_| FAILED)?;
    ctx.store(field, &addr.raw(), 0).map_err(|_| FAILED)
}
