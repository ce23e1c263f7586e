//! ICMP errors (destination unreachable, fragmentation needed among them; time exceeded;
//! parameter problem) about packets of translated flows, translated back as netfilter does for
//! its RELATED packets: the quoted packet's addresses and ports with its checksums, the ICMP
//! checksum that covers them, and the outer addresses the flow's translation covers. Without
//! it a client never learns a path MTU through a Service (its connection stalls) nor that a UDP
//! endpoint has no listener. The errors are looked up in conntrack, never counted as traffic.
//!
//! Handled at constant offsets: outer and quoted IPv4 headers without options (errors with
//! options pass untranslated; the kernel sends none). ICMPv6 errors the same way, through the
//! family's parse and rewrites (ipv6.rs): IPv6 headers without extension headers, but for the
//! fragment header of a quoted first fragment.
use aya_ebpf::{bindings::TC_ACT_UNSPEC, helpers::bpf_ktime_get_ns, programs::TcContext};
use proxy_common::{Be16, Be32, CT_EXTERNAL, CT_SNAT, CtKey, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    conntrack, external,
    family::Family,
    packet::{
        Drop, ETH_HLEN, ETH_P_IP, End, FAILED, IP_FRAG_MASK, IP_FRAG_OFFSET, Sum, pull_headers,
        read16, write16, write32,
    },
};

pub const IPPROTO_ICMP: u8 = 1;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETERPROB: u8 = 12;

const OUTER_IP: usize = ETH_HLEN;
const ICMP_OFF: usize = OUTER_IP + 20;
const INNER_IP: usize = ICMP_OFF + 8;
const INNER_L4: usize = INNER_IP + 20;
/// An error quotes at least the offending packet's IP header and 8 bytes of its payload: the
/// ports, and a UDP header's checksum.
const MIN_LEN: usize = INNER_L4 + 8;
/// Where a quoted TCP header's checksum ends (quoted only by errors that quote more).
const TCP_CSUM_END: usize = INNER_L4 + 18;

/// An ICMP error quoting a TCP or UDP packet.
pub struct Error<A = Be32> {
    /// The quoted packet's 5-tuple, as it was sent (towards this error's sender).
    pub inner: CtKey<A>,
    pub outer_saddr: A,
    pub outer_daddr: A,
    /// The quote holds the TCP header's checksum.
    pub quotes_tcp_csum: bool,
    /// Where the quoted packet's TCP or UDP header starts (IPv4: always `INNER_L4`; IPv6:
    /// after a fragment header, when the error quotes a first fragment).
    pub inner_l4: usize,
}

impl<A: Family> Error<A> {
    /// Rewrites the quoted packet's `at` end to `addr`:`port`, with the checksums that cover
    /// it (see [`Family::rewrite_quoted`]).
    #[inline(always)]
    pub fn rewrite_inner(
        &mut self,
        ctx: &TcContext,
        at: End,
        addr: A,
        port: Be16,
    ) -> Result<(), Drop> {
        A::rewrite_quoted(self, ctx, at, addr, port)?;
        match at {
            End::Source => (self.inner.saddr, self.inner.sport) = (addr, port),
            End::Destination => (self.inner.daddr, self.inner.dport) = (addr, port),
        }
        Ok(())
    }

    /// Rewrites the error's own `at` address, with the checksums that cover it.
    #[inline(always)]
    pub fn rewrite_outer(&mut self, ctx: &TcContext, at: End, addr: A) -> Result<(), Drop> {
        A::rewrite_error_addr(self, ctx, at, addr)?;
        match at {
            End::Source => self.outer_saddr = addr,
            End::Destination => self.outer_daddr = addr,
        }
        Ok(())
    }
}

/// The ICMP error `ctx` holds, if it is one about a TCP or UDP packet.
#[inline(always)]
pub fn parse(ctx: &TcContext) -> Option<Error> {
    pull_headers(ctx, TCP_CSUM_END)?;
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + MIN_LEN > end {
        return None;
    }
    // SAFETY (every read): within data..data + MIN_LEN, checked above.
    let word = |off: usize| Be16::from_raw(unsafe { read16(data + off) }).get();
    let byte = |off: usize| unsafe { ((data + off) as *const u8).read() };
    // The message ends where the IP header says (what follows is padding), within the frame.
    let end_of_message = ETH_HLEN + word(OUTER_IP + 2) as usize;
    let outer_ok = word(12) == ETH_P_IP
        && byte(OUTER_IP) == 0x45
        && end_of_message >= MIN_LEN
        && end_of_message <= ctx.len() as usize
        && word(OUTER_IP + 6) & IP_FRAG_MASK == 0
        && byte(OUTER_IP + 9) == IPPROTO_ICMP;
    let kind = byte(ICMP_OFF);
    let error =
        kind == ICMP_DEST_UNREACH || kind == ICMP_TIME_EXCEEDED || kind == ICMP_PARAMETERPROB;
    let proto = byte(INNER_IP + 9);
    // The quoted packet is a whole one or a first fragment: either has its ports.
    let inner_ok = byte(INNER_IP) == 0x45
        && word(INNER_IP + 6) & IP_FRAG_OFFSET == 0
        && (proto == IPPROTO_TCP || proto == IPPROTO_UDP);
    if !(outer_ok && error && inner_ok) {
        return None;
    }
    let addr =
        |off: usize| Be32::from_raw(unsafe { ((data + off) as *const u32).read_unaligned() });
    let port = |off: usize| Be16::from_raw(unsafe { read16(data + off) });
    Some(Error {
        inner: CtKey {
            saddr: addr(INNER_IP + 12),
            daddr: addr(INNER_IP + 16),
            sport: port(INNER_L4),
            dport: port(INNER_L4 + 2),
            proto,
            pad: [0; 3],
        },
        outer_saddr: addr(OUTER_IP + 12),
        outer_daddr: addr(OUTER_IP + 16),
        quotes_tcp_csum: end_of_message >= TCP_CSUM_END,
        inner_l4: INNER_L4,
    })
}

/// Rewrites the quoted packet's `at` end to `addr`:`port`, with its IP checksum, its TCP or
/// UDP checksum where quoted (a UDP checksum of zero stays zero), and the ICMP checksum.
#[inline(always)]
pub fn rewrite_quoted(
    error: &Error,
    ctx: &TcContext,
    at: End,
    addr: Be32,
    port: Be16,
) -> Result<(), Drop> {
    let (old_addr, old_port) = match at {
        End::Source => (error.inner.saddr, error.inner.sport),
        End::Destination => (error.inner.daddr, error.inner.dport),
    };
    let (addr_field, port_field) = match at {
        End::Source => (INNER_IP + 12, INNER_L4),
        End::Destination => (INNER_IP + 16, INNER_L4 + 2),
    };
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + MIN_LEN > end {
        return Err(FAILED);
    }
    // The ICMP checksum covers every quoted byte changed here, checksums included.
    let mut icmp = Sum::default();
    let mut ip = Sum::default();
    ip.replace32(old_addr.raw(), addr.raw());
    // The quoted L4 checksum: its pseudo-header holds the address, its header the port.
    let mut l4 = ip;
    l4.replace16(old_port.raw(), port.raw());
    icmp.replace32(old_addr.raw(), addr.raw());
    icmp.replace16(old_port.raw(), port.raw());
    // SAFETY (every access): within data..data + MIN_LEN, checked above; the TCP checksum
    // within data..data + TCP_CSUM_END, checked before it.
    unsafe {
        let old = read16(data + INNER_IP + 10);
        let new = ip.apply(old);
        icmp.replace16(old, new);
        write16(data + INNER_IP + 10, new);
        if error.inner.proto == IPPROTO_UDP {
            let old = read16(data + INNER_L4 + 6);
            if old != 0 {
                let new = match l4.apply(old) {
                    0 => 0xffff,
                    sum => sum,
                };
                icmp.replace16(old, new);
                write16(data + INNER_L4 + 6, new);
            }
        } else if error.quotes_tcp_csum && data + TCP_CSUM_END <= end {
            let old = read16(data + INNER_L4 + 16);
            let new = l4.apply(old);
            icmp.replace16(old, new);
            write16(data + INNER_L4 + 16, new);
        }
        write32(data + addr_field, addr.raw());
        write16(data + port_field, port.raw());
        write16(data + ICMP_OFF + 2, icmp.apply(read16(data + ICMP_OFF + 2)));
    }
    Ok(())
}

/// Rewrites the error's own `at` address, with the IP checksum (ICMP's has no pseudo-header).
#[inline(always)]
pub fn rewrite_error_addr(error: &Error, ctx: &TcContext, at: End, addr: Be32) -> Result<(), Drop> {
    let (old, field) = match at {
        End::Source => (error.outer_saddr, OUTER_IP + 12),
        End::Destination => (error.outer_daddr, OUTER_IP + 16),
    };
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + MIN_LEN > end {
        return Err(FAILED);
    }
    let mut ip = Sum::default();
    ip.replace32(old.raw(), addr.raw());
    // SAFETY: within data..data + MIN_LEN, checked above.
    unsafe {
        write16(data + OUTER_IP + 10, ip.apply(read16(data + OUTER_IP + 10)));
        write32(data + field, addr.raw());
    }
    Ok(())
}

/// An ICMP error on its way to a translated flow's client: a pod (tc egress of its interface),
/// or with `CT_EXTERNAL` in `flags` a client outside (tc egress of an external interface). It
/// quotes a packet as the node sent it on to the endpoint; the client sent it to the service
/// address, and an error from the endpoint itself comes from there too.
#[inline(always)]
pub fn to_client<A: Family>(ctx: &TcContext, flags: u8) -> Result<(), Drop> {
    let Some(mut error) = A::icmp_error(ctx) else {
        return Ok(());
    };
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(reply) = conntrack::related_to_reply(&conntrack::reversed(&error.inner), flags, now)
    else {
        return Ok(());
    };
    let endpoint = error.inner.daddr;
    error.rewrite_inner(ctx, End::Destination, reply.vip, reply.vport)?;
    if error.outer_saddr == endpoint {
        error.rewrite_outer(ctx, End::Source, reply.vip)?;
    }
    Ok(())
}

/// An ICMP error from outside (tc ingress of an external interface; XDP leaves ICMP to tc).
/// About a packet this node sent to another node's endpoint from a node address: back to the
/// client, quoting the packet as the client sent it, from the service address. About a reply
/// the node sent to an external client from the service address: on to the endpoint, quoting
/// the reply as the endpoint sent it (through the stack to a local endpoint, forwarded from
/// the node address to a remote one).
#[inline(always)]
pub fn from_outside<A: Family>(ctx: &TcContext) -> Result<i32, Drop> {
    let Some(mut error) = A::icmp_error(ctx) else {
        return Ok(TC_ACT_UNSPEC);
    };
    let now = unsafe { bpf_ktime_get_ns() };
    let reversed = conntrack::reversed(&error.inner);
    if let Some(reply) = conntrack::related_to_reply(&reversed, CT_EXTERNAL | CT_SNAT, now) {
        let (client, service) = ((reply.nat_addr, reply.nat_port), (reply.vip, reply.vport));
        error.rewrite_inner(ctx, End::Source, client.0, client.1)?;
        error.rewrite_inner(ctx, End::Destination, service.0, service.1)?;
        error.rewrite_outer(ctx, End::Destination, client.0)?;
        error.rewrite_outer(ctx, End::Source, service.0)?;
        return forward(ctx, &error);
    }
    let Some((flow, endpoint)) = conntrack::related_to_forward(&reversed, now) else {
        return Ok(TC_ACT_UNSPEC);
    };
    error.rewrite_inner(ctx, End::Source, endpoint.addr, endpoint.port)?;
    error.rewrite_outer(ctx, End::Destination, endpoint.addr)?;
    if flow.flags & CT_SNAT == 0 {
        return Ok(TC_ACT_UNSPEC);
    }
    error.rewrite_inner(ctx, End::Destination, flow.nat_addr, flow.nat_port)?;
    error.rewrite_outer(ctx, End::Source, flow.nat_addr)?;
    forward(ctx, &error)
}

/// Sends the rewritten error on by a route lookup, as the external programs forward.
#[inline(always)]
fn forward<A: Family>(ctx: &TcContext, error: &Error<A>) -> Result<i32, Drop> {
    let key = CtKey {
        saddr: error.outer_saddr,
        daddr: error.outer_daddr,
        sport: Be16::new(0),
        dport: Be16::new(0),
        proto: A::ICMP,
        pad: [0; 3],
    };
    external::forward_tc(ctx, &key)
}
