//! Parsing the headers the programs need, and rewriting an address and port with both checksums
//! updated incrementally.
use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use proxy_common::{
    Be16, Be32, CtKey, DROP_REWRITE_FAILED, FragKey, FragValue, IPPROTO_TCP, IPPROTO_UDP, seq_hint,
};

use crate::{family::Family, maps::FRAGMENTS};

/// The packet must be dropped, for this reason (`proxy_common::DROP_*`).
pub struct Drop(pub u32);

/// A helper call failed after the packet may have been partly rewritten.
pub const FAILED: Drop = Drop(DROP_REWRITE_FAILED);

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const IP_TTL_OFF: usize = ETH_HLEN + 8;
/// The byte of the IP header that holds its flags (DF: [`IP_DF`]).
pub const IP_FRAG_FLAGS_OFF: usize = ETH_HLEN + 6;
pub const IP_DF: u8 = 0x40;
pub const IP_CSUM_OFF: usize = ETH_HLEN + 10;
pub const IP_SADDR_OFF: usize = ETH_HLEN + 12;
pub const IP_DADDR_OFF: usize = ETH_HLEN + 16;
/// More-fragments flag and fragment offset.
pub const IP_FRAG_MASK: u16 = 0x3fff;
/// The fragment offset alone: non-zero on every fragment but the first.
pub const IP_FRAG_OFFSET: u16 = 0x1fff;

/// A TCP or UDP packet's flow, and where its L4 header starts (IPv4: `A` is `Be32`).
pub struct Flow<A = Be32> {
    pub key: CtKey<A>,
    /// TCP flags (zero for UDP, and for a fragment after the first).
    pub tcp_flags: u8,
    pub l4_off: usize,
    /// The IP header's total length (host order).
    pub tot_len: u16,
    pub fragment: Fragment,
    /// What ties a datagram's fragments together: the IPv4 header's identification (16 bits),
    /// the IPv6 fragment header's (32), as they are in the packet.
    pub frag_id: u32,
    /// TCP: [`proxy_common::seq_hint`] of the sequence and acknowledgment numbers (zero for UDP).
    pub seq: u16,
    pub ack: u16,
}

/// Where a packet stands in its datagram.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Fragment {
    /// A datagram of its own.
    Whole,
    /// The first fragment: it carries the L4 header.
    First,
    /// A fragment after the first: no L4 header; the key's ports are its first fragment's
    /// (from FRAGMENTS), and only the IP header is rewritten.
    Later,
}

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

/// Longest header run the programs read: Ethernet, IPv4 with options, a TCP header.
const MAX_HDR: usize = ETH_HLEN + 60 + 20;
const IPV4_MIN: usize = ETH_HLEN + 20;

/// Reads a `T` at `p`. Callers have compared `p + size_of::<T>()` with data_end.
#[inline(always)]
pub unsafe fn read<T: Copy>(p: usize) -> T {
    // SAFETY: bounds checked by the caller; packet data has no alignment guarantee.
    unsafe { (p as *const T).read_unaligned() }
}

/// The frame's EtherType (host order), if it has one.
#[inline(always)]
pub fn eth_proto(ctx: &TcContext) -> Option<u16> {
    let (data, end) = (ctx.data(), ctx.data_end());
    let raw: u16 = if data + ETH_HLEN <= end {
        // SAFETY: within the linear data, checked above.
        unsafe { read(data + 12) }
    } else {
        ctx.load(12).ok()?
    };
    Some(u16::from_be(raw))
}

/// Pulls the packet's first `max` bytes (all of it, if shorter) into the linear data, once:
/// headers can sit partly outside it (GRO, some drivers).
#[inline(always)]
pub fn pull_headers(ctx: &TcContext, max: usize) -> Option<()> {
    let wanted = core::cmp::min(ctx.len() as usize, max);
    if ctx.data() + wanted > ctx.data_end() {
        ctx.pull_data(wanted as u32).ok()?;
    }
    Some(())
}

/// The flags and the sequence and acknowledgment hints ([`seq_hint`]) of the TCP header at
/// `l4`, checked to be within the frame with a constant length of its own (older verifiers,
/// 6.1's, lose a variable one).
#[inline(always)]
pub fn tcp_fields(l4: usize, end: usize) -> Option<(u8, u16, u16)> {
    if l4 + 20 > end {
        return None;
    }
    // SAFETY: within l4..l4 + 20, checked above.
    let hint = |at: usize| seq_hint(Be32::from_raw(unsafe { read::<u32>(at) }).get());
    Some((unsafe { read::<u8>(l4 + 13) }, hint(l4 + 4), hint(l4 + 8)))
}

/// Reads the 5-tuple of an IPv4 TCP/UDP packet. A fragment after the first gets its first
/// fragment's ports, which that one left in FRAGMENTS; without them (it came first, or the
/// first is long gone) it is `None`, as is anything else not TCP/UDP over IPv4, including
/// malformed or truncated headers: such packets are not ours to rewrite and pass untouched.
#[inline(always)]
pub fn parse(ctx: &TcContext) -> Option<Flow> {
    pull_headers(ctx, MAX_HDR)?;
    let mut flow = parse_headers(ctx.data(), ctx.data_end(), ctx.len() as usize)?;
    if flow.fragment == Fragment::Whole {
        return Some(flow);
    }
    let key = FragKey {
        saddr: flow.key.saddr,
        daddr: flow.key.daddr,
        id: Be16::from_raw(flow.frag_id as u16),
        proto: flow.key.proto,
        pad: 0,
    };
    if flow.fragment == Fragment::First {
        let ports = FragValue {
            sport: flow.key.sport,
            dport: flow.key.dport,
        };
        // A failed insert (memory pressure) leaves the later fragments untranslated.
        let _ = FRAGMENTS.insert(key, ports, 0);
        return Some(flow);
    }
    let ports = unsafe { FRAGMENTS.get(key) }?;
    (flow.key.sport, flow.key.dport) = (ports.sport, ports.dport);
    Some(flow)
}

/// [`parse`] on the linear data `data..end` of a packet of `len` bytes.
///
/// Bounds are checked twice, each as a plain comparison of packet pointers with data_end, the
/// form the verifier follows: once for the fixed headers, once for the L4 header behind the
/// variable-length IP header.
#[inline(always)]
pub fn parse_headers(data: usize, end: usize, len: usize) -> Option<Flow> {
    if data + IPV4_MIN > end {
        return None;
    }
    let eth_proto = Be16::from_raw(unsafe { read::<u16>(data + 12) });
    if eth_proto.get() != ETH_P_IP {
        return None;
    }
    let ip = data + ETH_HLEN;
    let ver_ihl: u8 = unsafe { read(ip) };
    let ihl = ((ver_ihl & 0x0f) as usize) * 4;
    if ver_ihl >> 4 != 4 || ihl < 20 {
        return None;
    }
    let tot_len = Be16::from_raw(unsafe { read::<u16>(ip + 2) }).get() as usize;
    let frag = Be16::from_raw(unsafe { read::<u16>(ip + 6) }).get();
    let ip_id = Be16::from_raw(unsafe { read::<u16>(ip + 4) });
    let l4_proto: u8 = unsafe { read(ip + 9) };
    let saddr = Be32::from_raw(unsafe { read::<u32>(ip + 12) });
    let daddr = Be32::from_raw(unsafe { read::<u32>(ip + 16) });
    let l4_hdr_len = match l4_proto {
        IPPROTO_TCP => 20,
        IPPROTO_UDP => 8,
        _ => return None,
    };
    if frag & IP_FRAG_OFFSET != 0 {
        // A later fragment: its IP header only (the ports are filled in by `parse`).
        if tot_len < ihl || len < ETH_HLEN + tot_len {
            return None;
        }
        let key = CtKey {
            saddr,
            daddr,
            sport: Be16::new(0),
            dport: Be16::new(0),
            proto: l4_proto,
            pad: [0; 3],
        };
        return Some(Flow {
            key,
            tcp_flags: 0,
            l4_off: ETH_HLEN + ihl,
            tot_len: tot_len as u16,
            fragment: Fragment::Later,
            frag_id: ip_id.raw().into(),
            seq: 0,
            ack: 0,
        });
    }
    // The IP header must claim at least the L4 header, and the packet must hold what it claims.
    if tot_len < ihl + l4_hdr_len || len < ETH_HLEN + tot_len {
        return None;
    }
    let l4 = ip + ihl;
    // The whole L4 header (checksum included) must be in the linear data we rewrite.
    if l4 + l4_hdr_len > end {
        return None;
    }
    let key = CtKey {
        saddr,
        daddr,
        sport: Be16::from_raw(unsafe { read::<u16>(l4) }),
        dport: Be16::from_raw(unsafe { read::<u16>(l4 + 2) }),
        proto: l4_proto,
        pad: [0; 3],
    };
    // A check with a constant length of its own: older verifiers (6.1) lose the variable
    // one above.
    let (tcp_flags, seq, ack) = if l4_proto == IPPROTO_TCP {
        tcp_fields(l4, end)?
    } else {
        (0, 0, 0)
    };
    let fragment = match frag & IP_FRAG_MASK != 0 {
        true => Fragment::First,
        false => Fragment::Whole,
    };
    Some(Flow {
        key,
        tcp_flags,
        l4_off: ETH_HLEN + ihl,
        tot_len: tot_len as u16,
        fragment,
        frag_id: ip_id.raw().into(),
        seq,
        ack,
    })
}

/// Which end of the flow a rewrite changes.
#[derive(Clone, Copy)]
pub enum End {
    Source,
    Destination,
}

impl<A: Family> Flow<A> {
    /// Rewrites the source or destination address and port, updating the checksums that cover
    /// them (IPv4: [`Flow::rewrite4`]; IPv6: `ipv6::rewrite`).
    #[inline(always)]
    pub fn rewrite(&mut self, ctx: &TcContext, at: End, addr: A, port: Be16) -> Result<(), Drop> {
        A::rewrite(self, ctx, at, addr, port)
    }
}

impl<A> Flow<A> {
    /// The TCP flags (zero for UDP).
    pub fn tcp_flags(&self) -> u8 {
        self.tcp_flags
    }

    pub fn fin(&self) -> bool {
        self.tcp_flags & TCP_FIN != 0
    }

    pub fn rst(&self) -> bool {
        self.tcp_flags & TCP_RST != 0
    }

    /// The TCP/UDP checksum's offset.
    pub fn l4_csum_off(&self) -> usize {
        if self.key.proto == IPPROTO_TCP {
            self.l4_off + 16
        } else {
            self.l4_off + 6
        }
    }

    /// The first packet of a TCP connection.
    pub fn syn_only(&self) -> bool {
        self.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    }

    /// Moves the tuple to `addr`:`port` at `end` (after the packet bytes were rewritten).
    pub fn set(&mut self, end: End, addr: A, port: Be16) {
        match end {
            End::Source => (self.key.saddr, self.key.sport) = (addr, port),
            End::Destination => (self.key.daddr, self.key.dport) = (addr, port),
        }
    }

    /// A fragment after the first: it follows its datagram's flow but never starts one.
    pub fn later_fragment(&self) -> bool {
        self.fragment == Fragment::Later
    }
}

impl Flow {
    /// Whether the IPv4 header carries options.
    pub fn has_ip_options(&self) -> bool {
        self.l4_off != IPV4_MIN
    }

    /// Rewrites the source or destination address and port, updating the IP header checksum and
    /// the TCP/UDP checksum (whose pseudo-header covers the addresses). A UDP checksum of zero
    /// means "none" and stays zero.
    #[inline(always)]
    pub fn rewrite4(
        &mut self,
        ctx: &TcContext,
        at: End,
        addr: Be32,
        port: Be16,
    ) -> Result<(), Drop> {
        if self.fragment == Fragment::Later {
            // No L4 header here: its checksum and ports are the first fragment's.
            return self.rewrite_ip_only(ctx, at, addr, port);
        }
        let (old_addr, old_port, addr_off, port_off) = match at {
            End::Source => (self.key.saddr, self.key.sport, IP_SADDR_OFF, self.l4_off),
            End::Destination => (
                self.key.daddr,
                self.key.dport,
                IP_DADDR_OFF,
                self.l4_off + 2,
            ),
        };
        let csum_off = self.l4_csum_off();
        let l4_flags = if self.key.proto == IPPROTO_TCP {
            0
        } else {
            BPF_F_MARK_MANGLED_0 as u64
        };
        // The L4 checksum through the kernel's helper: only it knows whether the field holds a
        // full checksum or, for a packet whose checksum the NIC is to finish (a pod's own, on
        // a veth), the pseudo-header's sum, which a port change does not touch.
        if old_addr != addr {
            let (from, to) = (old_addr.raw() as u64, addr.raw() as u64);
            ctx.l4_csum_replace(csum_off, from, to, l4_flags | BPF_F_PSEUDO_HDR as u64 | 4)
                .map_err(|_| FAILED)?;
        }
        if old_port != port {
            let (from, to) = (old_port.raw() as u64, port.raw() as u64);
            ctx.l4_csum_replace(csum_off, from, to, l4_flags | 2)
                .map_err(|_| FAILED)?;
        }
        if self.has_ip_options() {
            if old_addr != addr {
                ctx.l3_csum_replace(IP_CSUM_OFF, old_addr.raw() as u64, addr.raw() as u64, 4)
                    .map_err(|_| FAILED)?;
                ctx.store(addr_off, &addr.raw(), 0).map_err(|_| FAILED)?;
            }
            if old_port != port {
                ctx.store(port_off, &port.raw(), 0).map_err(|_| FAILED)?;
            }
        } else {
            // The usual packet: the rest written in place, at constant offsets (the helpers
            // above may have moved the data: its bounds are read again).
            let (data, end) = (ctx.data(), ctx.data_end());
            if data + IPV4_MIN + 4 > end {
                return Err(FAILED);
            }
            let mut ip = Sum::default();
            ip.replace32(old_addr.raw(), addr.raw());
            // `port_off` without options, as a constant.
            let port_field = match at {
                End::Source => IPV4_MIN,
                End::Destination => IPV4_MIN + 2,
            };
            // SAFETY: all within data..data + IPV4_MIN + 4, checked above.
            unsafe {
                write16(data + IP_CSUM_OFF, ip.apply(read16(data + IP_CSUM_OFF)));
                write32(data + addr_off, addr.raw());
                write16(data + port_field, port.raw());
            }
        }
        // Keep the tuple current, so a second rewrite computes its checksum deltas right.
        self.set(at, addr, port);
        Ok(())
    }

    /// [`Flow::rewrite`] of a fragment after the first: the address and the IP checksum (the
    /// tuple's port changes only in the flow's key, as the first fragment's did).
    #[inline(always)]
    fn rewrite_ip_only(
        &mut self,
        ctx: &TcContext,
        at: End,
        addr: Be32,
        port: Be16,
    ) -> Result<(), Drop> {
        let (old_addr, addr_off) = match at {
            End::Source => (self.key.saddr, IP_SADDR_OFF),
            End::Destination => (self.key.daddr, IP_DADDR_OFF),
        };
        if old_addr != addr {
            ctx.l3_csum_replace(IP_CSUM_OFF, old_addr.raw() as u64, addr.raw() as u64, 4)
                .map_err(|_| FAILED)?;
            ctx.store(addr_off, &addr.raw(), 0).map_err(|_| FAILED)?;
        }
        self.set(at, addr, port);
        Ok(())
    }
}

/// Sends the packet back out of the interface it came in on (a hairpin), bypassing the
/// routing and reverse-path checks that a link-local or service source would fail: the
/// Ethernet addresses are swapped, so the frame goes back to its sender.
#[inline(always)]
pub fn bounce(ctx: &TcContext) -> Result<i32, Drop> {
    let macs: [u8; 12] = ctx.load(0).map_err(|_| FAILED)?;
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    ctx.store(0, &swapped, 0).map_err(|_| FAILED)?;
    Ok(send_back(ctx))
}

/// Redirects the packet out of the interface it came in on.
#[inline(always)]
pub fn send_back(ctx: &TcContext) -> i32 {
    // SAFETY: reading the context's ifindex; bpf_redirect has no memory arguments.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    unsafe { aya_ebpf::helpers::bpf_redirect(ifindex, 0) as i32 }
}

/// A checksum update in progress: the one's complement sum of the removed words, negated, and
/// of the added ones (the byte order does not matter to a one's complement sum, as long as
/// every word is read the same way).
#[derive(Clone, Copy, Default)]
pub struct Sum(u32);

impl Sum {
    pub fn replace16(&mut self, old: u16, new: u16) {
        self.0 += u32::from(!old) + u32::from(new);
    }

    pub fn replace32(&mut self, old: u32, new: u32) {
        self.replace16(old as u16, new as u16);
        self.replace16((old >> 16) as u16, (new >> 16) as u16);
    }

    /// The update as a checksum difference (a 32-bit one's complement sum), for
    /// `bpf_l4_csum_replace` with size 0.
    pub fn diff(self) -> u32 {
        self.0
    }

    /// The checksum `check` with this update applied.
    pub fn apply(self, check: u16) -> u16 {
        let mut sum = u64::from(!check) + u64::from(self.0);
        sum = (sum & 0xffff) + (sum >> 16);
        sum = (sum & 0xffff) + (sum >> 16);
        sum = (sum & 0xffff) + (sum >> 16);
        !(sum as u16)
    }
}

/// The raw (network order) 16 bits at `p`. Callers have checked `p + 2` against data_end.
#[inline(always)]
pub unsafe fn read16(p: usize) -> u16 {
    unsafe { (p as *const u16).read_unaligned() }
}

/// Writes raw 16 bits at `p`, checked as for [`read16`].
#[inline(always)]
pub unsafe fn write16(p: usize, v: u16) {
    unsafe { (p as *mut u16).write_unaligned(v) }
}

/// Writes raw 32 bits at `p`, checked as for [`read16`].
#[inline(always)]
pub unsafe fn write32(p: usize, v: u32) {
    unsafe { (p as *mut u32).write_unaligned(v) }
}
