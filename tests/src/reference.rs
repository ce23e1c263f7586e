//! A reference model of the datapath: what the tc programs of `proxy-ebpf` should do to one
//! frame, given what the services and backends maps hold and what conntrack (and the session
//! affinity map) remembers. Written apart from the BPF code (its own parser, its own checksum
//! arithmetic, its own conntrack state machine), from the semantics that ARCHITECTURE.md
//! ("Datapath"), `proxy-common` and the programs' documentation state, so that `tests/fuzz.rs`
//! can send the same frames through both and compare verdicts and bytes.
//!
//! - Both programs read a well-formed IPv4 or IPv6 TCP or UDP packet, or a fragment of one: a
//!   first fragment as a whole packet (its datagram's ports remembered), a later one with its
//!   first fragment's ports (without them it passes unchanged), rewritten in its IP header
//!   only. IPv6 is read through up to six extension headers; a jumbogram, and anything that is
//!   not TCP or UDP after them (ICMPv6, neighbour discovery), is no flow. Anything else passes
//!   unchanged. The families are apart: their own maps (conntrack, affinity, services,
//!   backends with ids of their own), their own hairpin address.
//! - `tc_ingress` (a frame leaving a pod): one to the hairpin address is a pod answering its own
//!   connection through a service: it is turned around (from the service address, to the pod,
//!   Ethernet addresses swapped, redirected) when its flow is live, and dropped otherwise. One to
//!   a service address follows its flow while the flow is live and its backend may keep it;
//!   otherwise it starts a new flow (a later fragment starts none: it passes) on a backend
//!   picked at random from the service's slots
//!   (with session affinity: on the backend of the client's last new flow to that address while
//!   that was within the timeout and the backend takes new flows). The destination becomes the
//!   backend; a pod reaching itself also gets the hairpin address as its source and is
//!   redirected. A service without a backend for a new flow refuses it, as kube-proxy does: the
//!   frame becomes an ICMP (ICMPv6) port unreachable from the service address, sent back to the
//!   pod (but a removed service's, draining, passes as if it were not there, and so does a
//!   packet with IP options or IPv6 extension headers, which that fixed-size answer does not
//!   quote); one whose traffic must stay on the node (internalTrafficPolicy: Local) drops it.
//!   Anything else passes, and a bare SYN forgets the reply entry on its reverse 5-tuple if that
//!   entry's flow is over (the pod now talks to that address directly).
//! - `tc_egress` (a frame to a pod): a reply of a live flow gets the service address back as
//!   its source; a reply entry whose flow is over is forgotten. An ICMP error (destination
//!   unreachable, time exceeded, parameter problem; both IP headers without options) or ICMPv6
//!   error (destination unreachable, packet too big, time exceeded, parameter problem; both
//!   IPv6 headers without extension headers, but for the fragment header of a quoted first
//!   fragment) quoting a live flow's packet as it was sent on to the backend quotes it as the
//!   pod sent it, to the service address (checksums adjusted), and comes from there if the
//!   backend sent it; it refreshes nothing. Everything else passes.
//!
//! Conntrack is keyed as the real one is, two entries a flow, each by the 5-tuple that its
//! direction's packets carry: which packets meet which entry (and which flows share one) is part
//! of the behaviour being modelled. The model cannot predict the programs' random backend
//! choice: [`Model::ingress`] asks its caller which of the candidates was taken, then holds the
//! flow to it. A packet of an established flow meets only its forward entry unless it is a SYN,
//! FIN or RST, the flow is closing, its count of packets is a multiple of 32 (the entries
//! count packets as the kernel's do), or the flow was idle: then it looks at the reply entry
//! too, refreshes it and writes it again if it is not the flow's.
//!
//! Time is the model's own, in whole seconds, advanced only by [`Model::advance`]; an entry is
//! expired when it has been idle for longer than its lifetime. The harness keeps the kernel's
//! clock in step with it (tests/fuzz.rs).
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::Path,
};

use anyhow::{Context, bail};
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use proxy_common::{
    Addr, BACKEND_DRAINING, Backend, Be32, Be128, CT_STATE_CLOSING, CT_STATE_TCP_ESTABLISHED,
    CT_STATE_TCP_HALF_CLOSED, CT_STATE_TCP_OPENING, CT_STATE_UDP, CT_STATES, MAP_BACKENDS,
    MAP_BACKENDS6, MAP_SERVICES, MAP_SERVICES6, SEQ_AHEAD, SEQ_BEHIND, SERVICE_AFFINITY,
    SERVICE_DRAINING, SERVICE_LOCAL_ONLY, ServiceKey, ServiceValue,
};

use crate::programs::{TC_ACT_SHOT, TC_ACT_UNSPEC};

/// The verdict of `bpf_redirect`: the frame leaves through the interface it came in on.
pub const TC_ACT_REDIRECT: u32 = 7;
/// The source given to a pod's packets to itself through a service (and the address its replies
/// go to).
pub const HAIRPIN: Ipv4Addr = Ipv4Addr::new(169, 254, 42, 1);
/// IPv6's: a unique local address with [`HAIRPIN`] in its last 32 bits.
pub const HAIRPIN6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0xa9fe, 0x2a01);
pub const TCP: u8 = 6;
pub const UDP: u8 = 17;

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IP_MIN: usize = 20;
const IPV6_HLEN: usize = 40;
/// Where what follows the fixed IPv6 header starts.
pub const IPV6_END: usize = ETH_HLEN + IPV6_HLEN;
/// IPv6 extension headers (RFC 8200, and AH: RFC 4302).
pub const HOP_BY_HOP: u8 = 0;
pub const ROUTING: u8 = 43;
pub const FRAGMENT: u8 = 44;
pub const AUTH: u8 = 51;
pub const DEST_OPTIONS: u8 = 60;
/// The extension headers the programs walk before they give up on a packet.
const MAX_EXT_HEADERS: usize = 6;
pub const ICMPV6: u8 = 58;
/// Forward packets between two looks at a flow's reply entry (the programs' constant).
const REPLY_CHECK_PACKETS: u32 = 32;
const FIN: u8 = 0x01;
const SYN: u8 = 0x02;
const RST: u8 = 0x04;
const ACK: u8 = 0x10;

/// The hairpin address of `like`'s family.
pub fn hairpin_of(like: IpAddr) -> IpAddr {
    match like {
        IpAddr::V4(_) => HAIRPIN.into(),
        IpAddr::V6(_) => HAIRPIN6.into(),
    }
}

/// A flow's 5-tuple as one direction's packets carry it (both addresses of one family).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tuple {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
}

impl Tuple {
    pub fn reversed(self) -> Self {
        Self {
            src: self.dst,
            dst: self.src,
            sport: self.dport,
            dport: self.sport,
            proto: self.proto,
        }
    }
}

impl std::fmt::Display for Tuple {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let proto = match self.proto {
            TCP => "tcp",
            UDP => "udp",
            _ => "?",
        };
        let (src, dst) = (
            SocketAddr::new(self.src, self.sport),
            SocketAddr::new(self.dst, self.dport),
        );
        write!(f, "{proto} {src} -> {dst}")
    }
}

/// Why a frame is not the datapath's to translate (it passes unchanged).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Skip {
    /// Shorter than an Ethernet and a minimal IPv4 header (IPv6: its fixed header).
    Short,
    /// Neither IPv4 nor IPv6.
    NotIp,
    /// An IP version other than the ethertype's, or an IPv4 header length below 20 bytes.
    BadIpHeader,
    /// A later fragment of a datagram whose first fragment (which has the ports) was not seen;
    /// from [`parse`], any fragment (it reads whole packets only).
    Fragment,
    NotTcpUdp,
    /// IPv6: more extension headers than the programs walk, or one past the frame's end.
    ExtensionHeaders,
    /// The total (IPv6: payload) length cannot hold the headers, or the frame does not hold the
    /// total length; an IPv6 jumbogram.
    BadLength,
}

/// What the model reads from a frame it may translate.
#[derive(Clone, Copy, Debug)]
pub struct Headers {
    pub tuple: Tuple,
    /// The TCP flags byte (zero for UDP).
    pub tcp_flags: u8,
    /// Where the TCP/UDP header starts in the frame (for a later fragment: its data).
    pub l4: usize,
    /// A fragment after the first: no L4 header; the tuple's ports are its first fragment's,
    /// and only the IP header is rewritten.
    pub later: bool,
    /// TCP: the sequence and acknowledgment numbers' 64 KiB units ([`seq_units`]); zero for
    /// UDP and for a later fragment (which has no TCP header).
    pub seq: u16,
    pub ack: u16,
}

/// Where a packet stands in its datagram, and the datagram's identification (IPv4's 16 bits,
/// IPv6's 32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Piece {
    Whole,
    First(u32),
    Later(u32),
}

impl Headers {
    /// The first packet of a TCP connection: SYN without ACK (other bits do not matter).
    pub fn syn_only(&self) -> bool {
        self.tuple.proto == TCP && self.tcp_flags & (SYN | ACK) == SYN
    }

    fn fin(&self) -> bool {
        self.tuple.proto == TCP && self.tcp_flags & FIN != 0
    }

    fn rst(&self) -> bool {
        self.tuple.proto == TCP && self.tcp_flags & RST != 0
    }

    /// Where the TCP or UDP checksum is.
    pub fn l4_checksum_at(&self) -> usize {
        self.l4 + if self.tuple.proto == TCP { 16 } else { 6 }
    }

    /// The L4 header right after the fixed IP header: no IPv4 options, no IPv6 extension
    /// headers.
    pub fn plain(&self) -> bool {
        self.l4
            == match self.tuple.src {
                IpAddr::V4(_) => ETH_HLEN + IP_MIN,
                IpAddr::V6(_) => IPV6_END,
            }
    }
}

/// A TCP sequence number's position in 64 KiB units: its upper half, 0 taken as 1 (an entry's
/// 0 means "not known yet").
fn seq_units(b: &[u8]) -> u16 {
    be16(b).max(1)
}

/// Whether a sequence number at `units` is plausible for a direction last seen at `known`:
/// at most [`SEQ_BEHIND`] units behind it or [`SEQ_AHEAD`] ahead (modulo 2^16); anything while
/// nothing is known.
fn plausible(known: u16, units: u16) -> bool {
    let ahead = (i32::from(units) - i32::from(known)).rem_euclid(1 << 16);
    let signed = if ahead >= 1 << 15 {
        ahead - (1 << 16)
    } else {
        ahead
    };
    known == 0 || (-i32::from(SEQ_BEHIND)..=i32::from(SEQ_AHEAD)).contains(&signed)
}

/// A direction's entry follows its TCP packet `h`: whether the packet's sequence number is
/// plausible; a plausible one ahead of what the entry knows becomes what it knows.
fn follow_seq(e: &mut Entry, h: &Headers) -> bool {
    if h.tuple.proto != TCP {
        return true;
    }
    if !plausible(e.seq_hint, h.seq) {
        return false;
    }
    let ahead = (i32::from(h.seq) - i32::from(e.seq_hint)).rem_euclid(1 << 16);
    if e.seq_hint == 0 || (1..1 << 15).contains(&ahead) {
        e.seq_hint = h.seq;
    }
    true
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

fn ipv4_at(b: &[u8]) -> IpAddr {
    Ipv4Addr::new(b[0], b[1], b[2], b[3]).into()
}

fn ipv6_at(b: &[u8]) -> IpAddr {
    <[u8; 16]>::try_from(&b[..16]).unwrap().into()
}

fn octets(a: IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// Where the source and destination addresses of `a`'s family are in a frame.
fn addr_offsets(a: IpAddr) -> (usize, usize) {
    match a {
        IpAddr::V4(_) => (ETH_HLEN + 12, ETH_HLEN + 16),
        IpAddr::V6(_) => (ETH_HLEN + 8, ETH_HLEN + 24),
    }
}

/// Reads the headers of an Ethernet frame carrying an unfragmented IPv4 or IPv6 TCP or UDP
/// packet whose headers are all there and consistent; anything else is not the datapath's
/// business. Contents the datapath does not depend on are not judged: checksums, IP options,
/// what extension headers hold, the TCP data offset, the UDP length, bytes after the IP total
/// length (Ethernet padding).
pub fn parse(frame: &[u8]) -> Result<Headers, Skip> {
    match parse_piece(frame)? {
        (h, Piece::Whole) => Ok(h),
        _ => Err(Skip::Fragment),
    }
}

/// [`parse`] of any piece of a datagram: a first fragment is read as a whole packet is; a
/// later one for its IP header only (its ports are zero: its first fragment has them).
pub fn parse_piece(frame: &[u8]) -> Result<(Headers, Piece), Skip> {
    if frame.len() < ETH_HLEN + IP_MIN {
        return Err(Skip::Short);
    }
    match be16(&frame[12..]) {
        ETH_P_IP => parse_ipv4(frame),
        ETH_P_IPV6 => parse_ipv6(frame),
        _ => Err(Skip::NotIp),
    }
}

/// The headers of a whole packet or first fragment from `src` to `dst` whose `proto` header
/// (there, checked) starts at `l4`.
fn whole(frame: &[u8], (src, dst): (IpAddr, IpAddr), proto: u8, l4: usize) -> Headers {
    let tcp = proto == TCP;
    Headers {
        tuple: Tuple {
            src,
            dst,
            sport: be16(&frame[l4..]),
            dport: be16(&frame[l4 + 2..]),
            proto,
        },
        tcp_flags: if tcp { frame[l4 + 13] } else { 0 },
        l4,
        later: false,
        seq: if tcp { seq_units(&frame[l4 + 4..]) } else { 0 },
        ack: if tcp { seq_units(&frame[l4 + 8..]) } else { 0 },
    }
}

/// The headers of a later fragment (its ports to come from its first fragment).
fn later((src, dst): (IpAddr, IpAddr), proto: u8, l4: usize) -> Headers {
    Headers {
        tuple: Tuple {
            src,
            dst,
            sport: 0,
            dport: 0,
            proto,
        },
        tcp_flags: 0,
        l4,
        later: true,
        seq: 0,
        ack: 0,
    }
}

fn parse_ipv4(frame: &[u8]) -> Result<(Headers, Piece), Skip> {
    let ip = &frame[ETH_HLEN..];
    let header_len = usize::from(ip[0] & 0x0f) * 4;
    if ip[0] >> 4 != 4 || header_len < IP_MIN {
        return Err(Skip::BadIpHeader);
    }
    let proto = ip[9];
    let l4_len = match proto {
        TCP => 20,
        UDP => 8,
        _ => return Err(Skip::NotTcpUdp),
    };
    let total = usize::from(be16(&ip[2..]));
    let addrs = (ipv4_at(&ip[12..]), ipv4_at(&ip[16..]));
    let l4 = ETH_HLEN + header_len;
    // More-fragments, or a non-zero offset; don't-fragment and the reserved bit do not matter.
    let (flags, id) = (be16(&ip[6..]), u32::from(be16(&ip[4..])));
    if flags & 0x1fff != 0 {
        if total < header_len || frame.len() < ETH_HLEN + total {
            return Err(Skip::BadLength);
        }
        return Ok((later(addrs, proto, l4), Piece::Later(id)));
    }
    let piece = match flags & 0x2000 != 0 {
        true => Piece::First(id),
        false => Piece::Whole,
    };
    if total < header_len + l4_len || frame.len() < ETH_HLEN + total {
        return Err(Skip::BadLength);
    }
    Ok((whole(frame, addrs, proto, l4), piece))
}

fn parse_ipv6(frame: &[u8]) -> Result<(Headers, Piece), Skip> {
    if frame.len() < IPV6_END {
        return Err(Skip::Short);
    }
    let ip = &frame[ETH_HLEN..];
    if ip[0] >> 4 != 6 {
        return Err(Skip::BadIpHeader);
    }
    let payload = usize::from(be16(&ip[4..]));
    // A jumbogram's length is in a hop-by-hop option: not followed.
    if payload == 0 || frame.len() < IPV6_END + payload {
        return Err(Skip::BadLength);
    }
    let addrs = (ipv6_at(&ip[8..]), ipv6_at(&ip[24..]));
    let (mut next, mut l4) = (ip[6], IPV6_END);
    // The (last) fragment header's offset field and identification.
    let mut fragment = None;
    for _ in 0..MAX_EXT_HEADERS {
        // Within the frame, whatever the payload length says (as the programs' loads).
        let header = |n: usize| frame.get(l4..l4 + n).ok_or(Skip::ExtensionHeaders);
        let len = match next {
            HOP_BY_HOP | ROUTING | DEST_OPTIONS => {
                let h = header(2)?;
                next = h[0];
                (usize::from(h[1]) + 1) * 8
            }
            AUTH => {
                let h = header(2)?;
                next = h[0];
                (usize::from(h[1]) + 2) * 4
            }
            FRAGMENT => {
                let h = header(8)?;
                next = h[0];
                fragment = Some((be16(&h[2..]), u32::from_be_bytes([h[4], h[5], h[6], h[7]])));
                8
            }
            _ => break,
        };
        l4 += len;
    }
    let l4_len = match next {
        TCP => 20,
        UDP => 8,
        HOP_BY_HOP | ROUTING | FRAGMENT | AUTH | DEST_OPTIONS => {
            return Err(Skip::ExtensionHeaders);
        }
        _ => return Err(Skip::NotTcpUdp),
    };
    // The offset (in 8-byte units, then two reserved bits) and more-fragments.
    let piece = match fragment {
        Some((field, id)) if field & 0xfff8 != 0 => {
            return Ok((later(addrs, next, l4), Piece::Later(id)));
        }
        Some((field, id)) if field & 1 != 0 => Piece::First(id),
        // An atomic fragment (offset 0, no more fragments) is a datagram of its own.
        _ => Piece::Whole,
    };
    if IPV6_END + payload < l4 + l4_len {
        return Err(Skip::BadLength);
    }
    Ok((whole(frame, addrs, next, l4), piece))
}

/// A checksum after some of the 16-bit words it covers changed: RFC 1624, eqn. 3,
/// `HC' = ~(~HC + ~m + m')` in one's complement arithmetic, for every word `m` in `removed` and
/// `m'` in `added`.
///
/// One's complement has two zeros. Linux's `csum_replace` (behind the programs' checksum
/// helpers) always adds a non-zero term, so its sum is never +0: a zero result is written as
/// 0x0000, never 0xffff. The same here: a sum of zero, either way written, gives 0x0000.
fn adjust_checksum(old: u16, removed: &[u16], added: &[u16]) -> u16 {
    let mut sum = u32::from(!old);
    sum += removed.iter().map(|w| u32::from(!w)).sum::<u32>();
    sum += added.iter().map(|&w| u32::from(w)).sum::<u32>();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    if sum == 0 { 0 } else { !(sum as u16) }
}

fn words(a: IpAddr) -> Vec<u16> {
    octets(a).chunks(2).map(be16).collect()
}

/// `frame` with the source and destination (address, port) replaced, and the IPv4 header and
/// TCP/UDP checksums adjusted for what changed (the TCP/UDP one covers the addresses through
/// its pseudo-header; IPv6 has no header checksum). A UDP checksum of zero ("none") stays zero,
/// and a UDP checksum that comes out as zero is sent as 0xffff (RFC 768). Nothing changes: the
/// checksums stay as sent.
fn rewrite(frame: &[u8], h: &Headers, src: (IpAddr, u16), dst: (IpAddr, u16)) -> Vec<u8> {
    let t = h.tuple;
    let mut out = frame.to_vec();
    let (mut addr_old, mut addr_new, mut port_old, mut port_new) = (vec![], vec![], vec![], vec![]);
    for ((old_addr, old_port), (new_addr, new_port)) in
        [((t.src, t.sport), src), ((t.dst, t.dport), dst)]
    {
        if old_addr != new_addr {
            addr_old.extend(words(old_addr));
            addr_new.extend(words(new_addr));
        }
        if old_port != new_port {
            port_old.push(old_port);
            port_new.push(new_port);
        }
    }
    let ip_csum = ETH_HLEN + 10;
    if t.src.is_ipv4() && !addr_old.is_empty() {
        let c = adjust_checksum(be16(&out[ip_csum..]), &addr_old, &addr_new);
        out[ip_csum..ip_csum + 2].copy_from_slice(&c.to_be_bytes());
    }
    let (src_at, dst_at) = addr_offsets(t.src);
    for (at, addr) in [(src_at, src.0), (dst_at, dst.0)] {
        let o = octets(addr);
        out[at..at + o.len()].copy_from_slice(&o);
    }
    if h.later {
        return out; // the first fragment carried the ports and the L4 checksum
    }
    let l4_csum = h.l4_checksum_at();
    let old = be16(&out[l4_csum..]);
    let unchanged = addr_old.is_empty() && port_old.is_empty();
    let none = t.proto == UDP && old == 0;
    if !unchanged && !none {
        let removed = [addr_old, port_old].concat();
        let added = [addr_new, port_new].concat();
        let mut c = adjust_checksum(old, &removed, &added);
        if t.proto == UDP && c == 0 {
            c = 0xffff;
        }
        out[l4_csum..l4_csum + 2].copy_from_slice(&c.to_be_bytes());
    }
    out[h.l4..h.l4 + 2].copy_from_slice(&src.1.to_be_bytes());
    out[h.l4 + 2..h.l4 + 4].copy_from_slice(&dst.1.to_be_bytes());
    out
}

/// Where an ICMP error's quoted IP header starts, and what it quotes after it (both headers
/// without options: the only errors the programs translate).
const QUOTED_IP: usize = ETH_HLEN + IP_MIN + 8;
const QUOTED_L4: usize = QUOTED_IP + IP_MIN;
/// The same in an ICMPv6 error (both IPv6 headers without extension headers; a quoted first
/// fragment's L4 header comes after its fragment header).
const QUOTED_IPV6: usize = IPV6_END + 8;
const QUOTED_IPV6_END: usize = QUOTED_IPV6 + IPV6_HLEN;

/// An ICMP error the programs translate.
#[derive(Clone, Copy, Debug)]
pub struct Quote {
    /// The quoted packet's 5-tuple.
    pub tuple: Tuple,
    /// Where the quoted TCP/UDP header starts.
    pub l4: usize,
    /// Where the message ends (what follows is padding).
    pub end: usize,
}

/// The packet an ICMP or ICMPv6 error quotes, if `frame` is one the programs translate.
pub fn parse_icmp_error(frame: &[u8]) -> Option<Quote> {
    match frame.get(12..14).map(be16) {
        Some(ETH_P_IP) => parse_icmpv4_error(frame),
        Some(ETH_P_IPV6) => parse_icmpv6_error(frame),
        _ => None,
    }
}

/// Ethernet, IPv4 without options and unfragmented, ICMP destination unreachable (3), time
/// exceeded (11) or parameter problem (12), quoting an IPv4 header without options of a TCP or
/// UDP packet that is whole or a first fragment, and at least 8 bytes after it, within the IP
/// total length.
fn parse_icmpv4_error(frame: &[u8]) -> Option<Quote> {
    if frame.len() < QUOTED_L4 + 8 {
        return None;
    }
    let (ip, quoted) = (&frame[ETH_HLEN..], &frame[QUOTED_IP..]);
    let end = ETH_HLEN + usize::from(be16(&ip[2..]));
    let error = ip[0] == 0x45
        && (QUOTED_L4 + 8..=frame.len()).contains(&end)
        && be16(&ip[6..]) & 0x3fff == 0
        && ip[9] == 1
        && matches!(ip[IP_MIN], 3 | 11 | 12);
    let about_tcp_udp =
        quoted[0] == 0x45 && be16(&quoted[6..]) & 0x1fff == 0 && matches!(quoted[9], TCP | UDP);
    let tuple = Tuple {
        src: ipv4_at(&quoted[12..]),
        dst: ipv4_at(&quoted[16..]),
        sport: be16(&quoted[IP_MIN..]),
        dport: be16(&quoted[IP_MIN + 2..]),
        proto: quoted[9],
    };
    (error && about_tcp_udp).then_some(Quote {
        tuple,
        l4: QUOTED_L4,
        end,
    })
}

/// Ethernet, IPv6 with ICMPv6 right after its fixed header, an error (types 1 to 4: destination
/// unreachable, packet too big, time exceeded, parameter problem) quoting an IPv6 header with
/// TCP or UDP right after it, or after a fragment header at offset 0, and at least 8 bytes of
/// that, within the payload length.
fn parse_icmpv6_error(frame: &[u8]) -> Option<Quote> {
    if frame.len() < QUOTED_IPV6_END + 8 {
        return None;
    }
    let (ip, quoted) = (&frame[ETH_HLEN..], &frame[QUOTED_IPV6..]);
    let end = IPV6_END + usize::from(be16(&ip[4..]));
    let error = ip[0] >> 4 == 6
        && ip[6] == ICMPV6
        && end <= frame.len()
        && (1..=4).contains(&frame[IPV6_END]);
    let (mut proto, mut l4) = (quoted[6], QUOTED_IPV6_END);
    if proto == FRAGMENT && be16(&frame[l4 + 2..]) & 0xfff8 == 0 {
        (proto, l4) = (frame[l4], l4 + 8);
    }
    let about_tcp_udp = quoted[0] >> 4 == 6 && matches!(proto, TCP | UDP) && end >= l4 + 8;
    if !(error && about_tcp_udp) {
        return None;
    }
    let tuple = Tuple {
        src: ipv6_at(&quoted[8..]),
        dst: ipv6_at(&quoted[24..]),
        sport: be16(&frame[l4..]),
        dport: be16(&frame[l4 + 2..]),
        proto,
    };
    Some(Quote { tuple, l4, end })
}

/// The Internet checksum (RFC 1071) of `data` (an even length).
fn internet_checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data.chunks(2).map(|w| u32::from(be16(w))).sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The answer to `frame` (a packet without IP options or extension headers) when nothing
/// listens at its destination: an ICMP destination unreachable, port unreachable (RFC 792: type
/// 3, code 3; a plain IPv4 header: no id, no flags, TTL 64) or its ICMPv6 twin (RFC 4443: type
/// 1, code 4; hop limit 64), quoting the IP header and the first 8 bytes of what followed it,
/// from that destination back to the source. Ethernet addresses swapped.
fn port_unreachable(frame: &[u8], h: &Headers) -> Vec<u8> {
    let quoted = &frame[ETH_HLEN..h.l4 + 8];
    let (src, dst) = (octets(h.tuple.dst), octets(h.tuple.src));
    let (ethertype, ip, icmp) = match h.tuple.src {
        IpAddr::V4(_) => {
            let mut icmp = vec![3, 3, 0, 0, 0, 0, 0, 0];
            icmp.extend_from_slice(quoted);
            let c = internet_checksum(&icmp);
            icmp[2..4].copy_from_slice(&c.to_be_bytes());
            let mut ip = vec![0u8; IP_MIN];
            ip[0] = 0x45;
            ip[2..4].copy_from_slice(&((IP_MIN + icmp.len()) as u16).to_be_bytes());
            ip[8] = 64;
            ip[9] = 1; // ICMP
            ip[12..16].copy_from_slice(&src);
            ip[16..20].copy_from_slice(&dst);
            let c = internet_checksum(&ip);
            ip[10..12].copy_from_slice(&c.to_be_bytes());
            (ETH_P_IP, ip, icmp)
        }
        IpAddr::V6(_) => {
            let mut icmp = vec![1, 4, 0, 0, 0, 0, 0, 0];
            icmp.extend_from_slice(quoted);
            let mut ip = vec![0u8; IPV6_HLEN];
            ip[0] = 0x60;
            ip[4..6].copy_from_slice(&(icmp.len() as u16).to_be_bytes());
            ip[6] = ICMPV6;
            ip[7] = 64;
            ip[8..24].copy_from_slice(&src);
            ip[24..40].copy_from_slice(&dst);
            // Over the pseudo-header: the addresses, the upper-layer length, the next header.
            let mut covered = ip[8..40].to_vec();
            covered.extend_from_slice(&(icmp.len() as u32).to_be_bytes());
            covered.extend_from_slice(&[0, 0, 0, ICMPV6]);
            covered.extend_from_slice(&icmp);
            let c = internet_checksum(&covered);
            icmp[2..4].copy_from_slice(&c.to_be_bytes());
            (ETH_P_IPV6, ip, icmp)
        }
    };
    let mut out = Vec::with_capacity(ETH_HLEN + ip.len() + icmp.len());
    out.extend_from_slice(&frame[6..12]);
    out.extend_from_slice(&frame[..6]);
    out.extend_from_slice(&ethertype.to_be_bytes());
    out.extend_from_slice(&ip);
    out.extend_from_slice(&icmp);
    out
}

/// Back to the sender: the Ethernet destination and source swap places.
fn swap_macs(frame: &mut [u8]) {
    let (dst, rest) = frame.split_at_mut(6);
    dst.swap_with_slice(&mut rest[..6]);
}

/// A service address: slot 0 of the services map.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Frontend {
    /// The backend ids of slots 1..=count, in slot order (empty for a draining frontend); ids
    /// of the frontend's family.
    pub slots: Vec<u32>,
    /// Removed, kept only for the connections established through it.
    pub draining: bool,
    /// Only this node's endpoints may serve it (internalTrafficPolicy: Local).
    pub local_only: bool,
    /// sessionAffinity ClientIP, with this timeout in seconds.
    pub affinity_secs: Option<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackendEntry {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: u8,
    /// Left its service port: keeps its established TCP connections, takes nothing new.
    pub draining: bool,
}

/// What the services and backends maps of both families hold, as the programs see it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tables {
    /// By (address, port, protocol).
    pub frontends: BTreeMap<(IpAddr, u16, u8), Frontend>,
    /// IPv4's backends, by id.
    pub backends: BTreeMap<u32, BackendEntry>,
    /// IPv6's, by ids of their own.
    pub backends6: BTreeMap<u32, BackendEntry>,
}

impl Tables {
    /// Reads the SERVICES and BACKENDS maps (and their IPv6 twins) pinned in `pin_dir`. Fails
    /// when a frontend counts a slot that is missing or names a backend that is not there: the
    /// map writer never leaves the maps so between two syncs, and the model's pick of a backend
    /// relies on it.
    pub fn read(pin_dir: &Path) -> anyhow::Result<Self> {
        let mut tables = Self::default();
        let (services, backends) = (pin_dir.join(MAP_SERVICES), pin_dir.join(MAP_BACKENDS));
        tables.backends = read_family::<Be32>(&services, &backends, &mut tables.frontends)?;
        let (services, backends) = (pin_dir.join(MAP_SERVICES6), pin_dir.join(MAP_BACKENDS6));
        tables.backends6 = read_family::<Be128>(&services, &backends, &mut tables.frontends)?;
        Ok(tables)
    }

    /// The backends of `like`'s family.
    pub fn backends_of(&self, like: IpAddr) -> &BTreeMap<u32, BackendEntry> {
        match like {
            IpAddr::V4(_) => &self.backends,
            IpAddr::V6(_) => &self.backends6,
        }
    }
}

/// One family's frontends (added to `frontends`) and backends, from the maps pinned at
/// `services` and `backends`.
fn read_family<A: Addr>(
    services: &Path,
    backends: &Path,
    frontends: &mut BTreeMap<(IpAddr, u16, u8), Frontend>,
) -> anyhow::Result<BTreeMap<u32, BackendEntry>> {
    let services: BpfHashMap<_, ServiceKey<A>, ServiceValue> =
        Map::HashMap(MapData::from_pin(services)?).try_into()?;
    let backends_map: BpfHashMap<_, u32, Backend<A>> =
        Map::HashMap(MapData::from_pin(backends)?).try_into()?;
    let mut backends = BTreeMap::new();
    for entry in backends_map.iter() {
        let (id, b) = entry?;
        backends.insert(
            id,
            BackendEntry {
                addr: b.addr.ip(),
                port: b.port.get(),
                proto: b.proto,
                draining: b.flags & BACKEND_DRAINING != 0,
            },
        );
    }
    let entries: BTreeMap<ServiceKey<A>, ServiceValue> =
        services.iter().collect::<Result<_, _>>()?;
    for (key, head) in entries.iter().filter(|(k, _)| k.slot == 0) {
        let fe = (key.addr.ip(), key.port.get(), key.proto);
        let mut slots = Vec::new();
        for slot in 1..=head.count {
            let id = entries
                .get(&ServiceKey { slot, ..*key })
                .with_context(|| format!("{fe:?} counts slot {slot}, which is missing"))?
                .backend_id;
            let Some(b) = backends.get(&id) else {
                bail!("slot {slot} of {fe:?} names backend {id}, which is missing");
            };
            if b.proto != key.proto || b.draining {
                bail!("slot {slot} of {fe:?} names backend {id}, {b:?}");
            }
            slots.push(id);
        }
        let known = SERVICE_DRAINING | SERVICE_LOCAL_ONLY | SERVICE_AFFINITY;
        if head.flags & !known != 0 {
            bail!(
                "{fe:?} has flags {:#x}, which the model does not know",
                head.flags
            );
        }
        frontends.insert(
            fe,
            Frontend {
                slots,
                draining: head.flags & SERVICE_DRAINING != 0,
                local_only: head.flags & SERVICE_LOCAL_ONLY != 0,
                affinity_secs: (head.flags & SERVICE_AFFINITY != 0)
                    .then(|| head.affinity_timeout_secs()),
            },
        );
    }
    Ok(backends)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Keyed client -> service address: the flow itself, naming its backend.
    Forward,
    /// Keyed backend -> client (or -> the hairpin address): what the replies must come from.
    Reply,
}

/// A conntrack entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub direction: Direction,
    pub backend_id: u32,
    /// The service address and port the client used.
    pub vip: IpAddr,
    pub vport: u16,
    /// This direction sent a FIN.
    pub fin: bool,
    /// The flow is over (a RST, or a FIN each way): it lives on for the closing lifetime only,
    /// and is not refreshed.
    pub closing: bool,
    /// Closed by the client's FIN coming last: the backend closed first (and holds the 5-tuple
    /// in TIME_WAIT).
    pub time_wait: bool,
    /// TCP, being opened: no reply yet, or no client packet after the first one (the opening
    /// lifetime).
    pub opening: bool,
    /// TCP: a reply has been seen.
    pub answered: bool,
    /// TCP: a FIN has been seen, the flow is not closed (the half-closed lifetime).
    pub half_closed: bool,
    /// TCP: where this direction's sequence numbers stand, in 64 KiB units (0: not known).
    pub seq_hint: u16,
    /// Model time of the last refresh.
    pub last_seen: u64,
    /// Packets that met the entry (as the kernel counts them: they decide when a forward
    /// packet looks at the reply entry too).
    pub packets: u32,
    /// Refreshed (or written) by a packet since [`Model::clear_refreshed`]. For the harness,
    /// which checks that the kernel's entry was refreshed too, and no other.
    pub refreshed: bool,
    /// Where the flow was sent (not in the kernel's entry; for generating the backend's replies).
    pub backend: (IpAddr, u16),
}

/// A client of a service address with session affinity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Client {
    pub client: IpAddr,
    pub vip: IpAddr,
    pub vport: u16,
    pub proto: u8,
}

impl Client {
    /// The client of the flow `t` (client -> service address).
    pub fn of(t: &Tuple) -> Self {
        Self {
            client: t.src,
            vip: t.dst,
            vport: t.dport,
            proto: t.proto,
        }
    }
}

/// The backend a client of a service address with session affinity sticks to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Affinity {
    pub backend_id: u32,
    /// Model time of the client's last new flow that went to it.
    pub last_used: u64,
    /// As [`Entry::refreshed`].
    pub refreshed: bool,
}

/// A backend a new flow may be given: one named in a slot of its service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub id: u32,
    pub addr: IpAddr,
    pub port: u16,
}

/// What the model decided for one frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Event {
    /// Passed unchanged: not a packet to translate.
    Skipped(Skip),
    /// Passed unchanged: ingress, to no service address.
    NotService,
    /// Passed unchanged: to a removed service (draining) without a live flow, or to a service
    /// without backends but with IP options or IPv6 extension headers (not refused).
    NoBackend,
    /// Dropped: to a service whose traffic stays on the node, with no endpoint here.
    NoLocalEndpoint,
    /// Ingress: to a service without backends: answered with an ICMP (ICMPv6) port unreachable.
    Rejected,
    /// Ingress: a new flow, sent to a backend.
    NewFlow,
    /// Ingress: a packet of a live flow, sent to its backend.
    Established,
    /// Egress: passed unchanged, not a reply of a live flow.
    NoReply,
    /// Egress: a reply, from the service address again.
    ReverseNat,
    /// Egress: an ICMP (ICMPv6) error about a live flow's packet, quoting it as sent to the
    /// service.
    IcmpTranslated,
    /// Egress: an ICMP error about no live flow, passed unchanged.
    IcmpUnrelated,
    /// Ingress: a datagram's later fragment to a service whose flow is not live: passed
    /// unchanged (it never starts one).
    FragmentWithoutFlow,
    /// Ingress: a pod's reply to itself through a service, turned around and redirected.
    HairpinReply,
    /// Ingress: to the hairpin address without a live flow behind it: dropped.
    HairpinDrop,
}

/// Conntrack details of a decision, for coverage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Note {
    /// An established TCP connection stayed on its draining backend.
    DrainKept,
    /// A flow left its draining backend (a SYN, or UDP).
    DrainLeft,
    /// The flow's backend is gone (or now of another protocol).
    BackendGone,
    /// The flow had expired.
    Expired,
    /// A bare SYN on a closed flow's 5-tuple: a new flow.
    Reopened,
    /// A closed flow's packet: followed, not refreshed.
    ClosedFollowed,
    /// This packet closed its flow.
    Closed,
    /// A TCP packet whose sequence number is out of its direction's window: it refreshed the
    /// flow and changed nothing else.
    OutOfWindow,
    /// The reply entry (evicted, deleted, or taken by another flow) was written again.
    ReplyRewritten,
    /// A reply entry without a live flow was deleted.
    ReplyForgotten,
    /// A bare SYN to a non-service address deleted the reply entry of a finished flow on its
    /// reverse 5-tuple.
    DirectSynForgot,
    /// A new flow went to the backend its client sticks to (session affinity).
    AffinityKept,
    /// The backend a client stuck to was not kept (its last new flow too long ago, or the
    /// backend gone or draining).
    AffinityLapsed,
    /// A new flow was picked a backend at random and its client now sticks to it.
    AffinityNew,
    /// A datagram's later fragment, with its first fragment's ports.
    LaterFragment,
}

#[derive(Clone, Debug)]
pub struct Outcome {
    pub verdict: u32,
    pub frame: Vec<u8>,
    pub event: Event,
    /// The frame was translated for a pod reaching itself (source set to [`HAIRPIN`] or
    /// [`HAIRPIN6`]).
    pub hairpin: bool,
    pub notes: Vec<Note>,
}

impl Outcome {
    fn pass(frame: &[u8], event: Event, notes: Vec<Note>) -> Self {
        Self {
            verdict: TC_ACT_UNSPEC,
            frame: frame.to_vec(),
            event,
            hairpin: false,
            notes,
        }
    }
}

/// The state an entry's lifetime is that of (`CT_LIFETIMES`' index).
fn lifetime_state(e: &Entry, proto: u8) -> u32 {
    if e.closing {
        CT_STATE_CLOSING
    } else if proto != TCP {
        CT_STATE_UDP
    } else if e.opening {
        CT_STATE_TCP_OPENING
    } else if e.half_closed {
        CT_STATE_TCP_HALF_CLOSED
    } else {
        CT_STATE_TCP_ESTABLISHED
    }
}

/// Where the backend's replies to the flow `t` come from and go to: to the client, or, when
/// the client is the backend itself, to the hairpin address its packets were given.
fn reply_tuple(t: &Tuple, backend: (IpAddr, u16)) -> Tuple {
    Tuple {
        src: backend.0,
        dst: if backend.0 == t.src {
            hairpin_of(t.src)
        } else {
            t.src
        },
        sport: backend.1,
        dport: t.sport,
        proto: t.proto,
    }
}

/// A backend for a new flow to `fe`, at random among its slots: `pick` says which one the
/// program took. None when there is none; `Err` with the candidates when `pick` says none of
/// them.
fn random_backend(
    tables: &Tables,
    h: &Headers,
    fe: &Frontend,
    pick: impl FnOnce(&Headers, &[Candidate]) -> Option<usize>,
) -> Result<Option<Candidate>, Vec<Candidate>> {
    let candidates: Vec<Candidate> = fe
        .slots
        .iter()
        .map(|id| {
            let b = tables.backends_of(h.tuple.dst)[id];
            Candidate {
                id: *id,
                addr: b.addr,
                port: b.port,
            }
        })
        .collect();
    if candidates.is_empty() {
        return Ok(None);
    }
    match pick(h, &candidates) {
        Some(i) => Ok(Some(candidates[i])),
        None => Err(candidates),
    }
}

/// The datapath model: the maps as last read, conntrack, session affinity, and the time.
#[derive(Clone, Debug, Default)]
pub struct Model {
    tables: Tables,
    conntrack: BTreeMap<Tuple, Entry>,
    affinity: BTreeMap<Client, Affinity>,
    /// Datagrams sent in fragments (source, destination, protocol, identification), of either
    /// family: the ports of their first fragment.
    fragments: BTreeMap<(IpAddr, IpAddr, u8, u32), (u16, u16)>,
    /// What `CT_LIFETIMES` holds, by state (0: the default).
    lifetimes: [u64; CT_STATES as usize],
    now: u64,
}

impl Model {
    pub fn new(tables: Tables) -> Self {
        Self {
            tables,
            ..Self::default()
        }
    }

    /// The harness wrote `ns` as `state`'s lifetime in `CT_LIFETIMES`.
    pub fn set_ct_lifetime(&mut self, state: u32, ns: u64) {
        self.lifetimes[state as usize] = ns;
    }

    /// Datagrams whose first fragment's ports are remembered: IPv4's, IPv6's.
    pub fn fragments_remembered(&self) -> [usize; 2] {
        let v6 = self.fragments.keys().filter(|k| k.0.is_ipv6()).count();
        [self.fragments.len() - v6, v6]
    }

    /// The maps changed (the agent synced).
    pub fn set_tables(&mut self, tables: Tables) {
        self.tables = tables;
    }

    pub fn tables(&self) -> &Tables {
        &self.tables
    }

    pub fn conntrack(&self) -> &BTreeMap<Tuple, Entry> {
        &self.conntrack
    }

    pub fn affinity(&self) -> &BTreeMap<Client, Affinity> {
        &self.affinity
    }

    pub fn now(&self) -> u64 {
        self.now
    }

    /// Lets `secs` seconds pass.
    pub fn advance(&mut self, secs: u64) {
        self.now += secs;
    }

    /// Entries idle longer than `max` seconds are taken as idle `max`: the test can only move the
    /// kernel's record of a last use back to the boot, and must not ask the model for more. Both
    /// agree on everything as long as `max` is past every lifetime that matters.
    pub fn cap_idle(&mut self, max: u64) {
        let oldest = self.now.saturating_sub(max);
        for e in self.conntrack.values_mut() {
            e.last_seen = e.last_seen.max(oldest);
        }
        for a in self.affinity.values_mut() {
            a.last_used = a.last_used.max(oldest);
        }
    }

    pub fn clear_refreshed(&mut self) {
        for e in self.conntrack.values_mut() {
            e.refreshed = false;
        }
        for a in self.affinity.values_mut() {
            a.refreshed = false;
        }
    }

    fn live(&self, e: &Entry, proto: u8) -> bool {
        let state = lifetime_state(e, proto);
        let ns = proxy_common::ct_lifetime_ns(state, self.lifetimes[state as usize]);
        self.now - e.last_seen <= ns / 1_000_000_000
    }

    /// Whether `reverse` holds the reply entry of a flow that is over: its forward entry (from
    /// the client, `reverse`'s destination, to the service address) gone, another flow's,
    /// closing or expired. An open flow's SYN may be seen again after its translation.
    fn reply_of_finished_flow(&self, reverse: &Tuple) -> bool {
        let Some(r) = self.conntrack.get(reverse) else {
            return false;
        };
        if r.direction != Direction::Reply {
            return false;
        }
        let forward = Tuple {
            src: reverse.dst,
            dst: r.vip,
            sport: reverse.dport,
            dport: r.vport,
            proto: reverse.proto,
        };
        !self.conntrack.get(&forward).is_some_and(|f| {
            f.direction == Direction::Forward
                && f.backend_id == r.backend_id
                && !f.closing
                && self.live(f, reverse.proto)
        })
    }

    /// [`parse_piece`] as the programs read a frame: a first fragment's ports are remembered for
    /// its datagram, and a later fragment gets them (without them it is skipped).
    fn read(&mut self, frame: &[u8]) -> Result<Headers, Skip> {
        let (mut h, piece) = parse_piece(frame)?;
        let t = h.tuple;
        match piece {
            Piece::Whole => {}
            Piece::First(id) => {
                self.fragments
                    .insert((t.src, t.dst, t.proto, id), (t.sport, t.dport));
            }
            Piece::Later(id) => {
                let ports = self.fragments.get(&(t.src, t.dst, t.proto, id));
                (h.tuple.sport, h.tuple.dport) = *ports.ok_or(Skip::Fragment)?;
            }
        }
        Ok(h)
    }

    /// `tc_ingress` on `frame`. For a new flow, `pick` is given the candidates (the backends in
    /// the service's slots) and says which one the program took; `Err` with the candidates when
    /// it says none of them.
    pub fn ingress(
        &mut self,
        frame: &[u8],
        pick: impl FnOnce(&Headers, &[Candidate]) -> Option<usize>,
    ) -> Result<Outcome, Vec<Candidate>> {
        let h = match self.read(frame) {
            Ok(h) => h,
            Err(why) => return Ok(Outcome::pass(frame, Event::Skipped(why), vec![])),
        };
        let t = h.tuple;
        let mut notes = Vec::new();
        if h.later {
            notes.push(Note::LaterFragment);
        }
        if t.dst == hairpin_of(t.src) {
            // The pod is both ends: its reply goes back to itself, from the service address.
            let pod = t.src;
            return Ok(match self.reply_of_live_flow(&h, pod, &mut notes) {
                Some(vip) => {
                    let mut out = rewrite(frame, &h, vip, (pod, t.dport));
                    swap_macs(&mut out);
                    Outcome {
                        verdict: TC_ACT_REDIRECT,
                        frame: out,
                        event: Event::HairpinReply,
                        hairpin: true,
                        notes,
                    }
                }
                // Routed on, it would leave the node with a link-local destination.
                None => Outcome {
                    verdict: TC_ACT_SHOT,
                    frame: frame.to_vec(),
                    event: Event::HairpinDrop,
                    hairpin: true,
                    notes,
                },
            });
        }
        let Some(fe) = self
            .tables
            .frontends
            .get(&(t.dst, t.dport, t.proto))
            .cloned()
        else {
            let reverse = t.reversed();
            if h.syn_only() && self.reply_of_finished_flow(&reverse) {
                self.conntrack.remove(&reverse);
                notes.push(Note::DirectSynForgot);
            }
            return Ok(Outcome::pass(frame, Event::NotService, notes));
        };
        let (backend, event) = match self.follow_flow(&h, &mut notes) {
            Some(backend) => (backend, Event::Established),
            None if h.later => return Ok(Outcome::pass(frame, Event::FragmentWithoutFlow, notes)),
            None => {
                let chosen = match fe.affinity_secs {
                    Some(timeout) => self.sticky_backend(&h, &fe, timeout, pick, &mut notes)?,
                    None => random_backend(&self.tables, &h, &fe, pick)?,
                };
                let Some(c) = chosen else {
                    return Ok(self.no_backend(frame, &h, &fe, notes));
                };
                self.record(&h, c);
                ((c.addr, c.port), Event::NewFlow)
            }
        };
        let hairpin = backend.0 == t.src;
        let src = if hairpin {
            // Its reply would otherwise never leave the pod: it must come to a foreign address.
            (hairpin_of(t.src), t.sport)
        } else {
            (t.src, t.sport)
        };
        let mut out = rewrite(frame, &h, src, backend);
        let verdict = if hairpin {
            swap_macs(&mut out);
            TC_ACT_REDIRECT
        } else {
            TC_ACT_UNSPEC
        };
        Ok(Outcome {
            verdict,
            frame: out,
            event,
            hairpin,
            notes,
        })
    }

    /// A new flow to `fe`, which has none of its backends to give it.
    fn no_backend(&self, frame: &[u8], h: &Headers, fe: &Frontend, notes: Vec<Note>) -> Outcome {
        if fe.local_only {
            return Outcome {
                verdict: TC_ACT_SHOT,
                frame: frame.to_vec(),
                event: Event::NoLocalEndpoint,
                hairpin: false,
                notes,
            };
        }
        if fe.draining || !h.plain() {
            return Outcome::pass(frame, Event::NoBackend, notes);
        }
        Outcome {
            verdict: TC_ACT_REDIRECT,
            frame: port_unreachable(frame, h),
            event: Event::Rejected,
            hairpin: false,
            notes,
        }
    }

    /// Session affinity: the backend the client of `h` sticks to while its last new flow to
    /// `fe` is at most `timeout` seconds ago and the backend takes new flows (it exists and is
    /// not draining); otherwise a random one, which the client sticks to from now on.
    fn sticky_backend(
        &mut self,
        h: &Headers,
        fe: &Frontend,
        timeout: u32,
        pick: impl FnOnce(&Headers, &[Candidate]) -> Option<usize>,
        notes: &mut Vec<Note>,
    ) -> Result<Option<Candidate>, Vec<Candidate>> {
        let t = h.tuple;
        let client = Client::of(&t);
        if let Some(a) = self.affinity.get(&client)
            && self.now - a.last_used <= u64::from(timeout)
            && let Some(b) = self.tables.backends_of(t.dst).get(&a.backend_id)
            && !b.draining
            && b.proto == t.proto
        {
            let c = Candidate {
                id: a.backend_id,
                addr: b.addr,
                port: b.port,
            };
            let a = self.affinity.get_mut(&client).unwrap();
            a.last_used = self.now;
            a.refreshed = true;
            notes.push(Note::AffinityKept);
            return Ok(Some(c));
        }
        if self.affinity.contains_key(&client) {
            notes.push(Note::AffinityLapsed);
        }
        let chosen = random_backend(&self.tables, h, fe, pick)?;
        if let Some(c) = chosen {
            let a = Affinity {
                backend_id: c.id,
                last_used: self.now,
                refreshed: true,
            };
            self.affinity.insert(client, a);
            notes.push(Note::AffinityNew);
        }
        Ok(chosen)
    }

    /// `tc_egress` on `frame`.
    pub fn egress(&mut self, frame: &[u8]) -> Outcome {
        let h = match self.read(frame) {
            Ok(h) => h,
            Err(_) if let Some(quote) = parse_icmp_error(frame) => {
                return self.icmp_error(frame, quote);
            }
            Err(why) => return Outcome::pass(frame, Event::Skipped(why), vec![]),
        };
        let t = h.tuple;
        let mut notes = Vec::new();
        if h.later {
            notes.push(Note::LaterFragment);
        }
        match self.reply_of_live_flow(&h, t.dst, &mut notes) {
            Some(vip) => Outcome {
                verdict: TC_ACT_UNSPEC,
                frame: rewrite(frame, &h, vip, (t.dst, t.dport)),
                event: Event::ReverseNat,
                hairpin: false,
                notes,
            },
            None => Outcome::pass(frame, Event::NoReply, notes),
        }
    }

    /// `tc_egress` on an ICMP or ICMPv6 error quoting a pod's packet as the node sent it on.
    fn icmp_error(&self, frame: &[u8], quote: Quote) -> Outcome {
        let quoted = quote.tuple;
        let reply = quoted.reversed();
        let service = self.conntrack.get(&reply).and_then(|r| {
            let forward = Tuple {
                src: reply.dst,
                dst: r.vip,
                sport: reply.dport,
                dport: r.vport,
                proto: reply.proto,
            };
            let f = self.conntrack.get(&forward)?;
            let live = r.direction == Direction::Reply
                && f.direction == Direction::Forward
                && f.backend_id == r.backend_id
                && self.live(f, reply.proto);
            live.then_some((r.vip, r.vport))
        });
        let Some((vip, vport)) = service else {
            return Outcome::pass(frame, Event::IcmpUnrelated, vec![]);
        };
        let mut out = frame.to_vec();
        let put = |out: &mut Vec<u8>, at: usize, word: u16| {
            out[at..at + 2].copy_from_slice(&word.to_be_bytes());
        };
        let v4 = vip.is_ipv4();
        let (old_addr, old_port) = (quoted.dst, quoted.dport);
        // The ICMP checksum covers every quoted word changed, checksums included; the quoted
        // L4 checksum covers the address (pseudo-header) and the port.
        let mut removed = [words(old_addr), vec![old_port]].concat();
        let mut added = [words(vip), vec![vport]].concat();
        let covered_by_l4 = removed.len();
        if v4 {
            let ip_csum = QUOTED_IP + 10;
            let old = be16(&out[ip_csum..]);
            let new = adjust_checksum(old, &words(old_addr), &words(vip));
            put(&mut out, ip_csum, new);
            (removed, added) = ([removed, vec![old]].concat(), [added, vec![new]].concat());
        }
        let l4_csum = match quoted.proto {
            UDP => Some(quote.l4 + 6),
            _ if quote.end >= quote.l4 + 18 => Some(quote.l4 + 16),
            _ => None,
        };
        let old = l4_csum.map(|at| be16(&out[at..]));
        if let (Some(at), Some(old)) = (l4_csum, old)
            && !(quoted.proto == UDP && old == 0)
        {
            let n = covered_by_l4;
            let mut new = adjust_checksum(old, &removed[..n], &added[..n]);
            if quoted.proto == UDP && new == 0 {
                new = 0xffff;
            }
            put(&mut out, at, new);
            (removed, added) = ([removed, vec![old]].concat(), [added, vec![new]].concat());
        }
        let quoted_dst = match vip {
            IpAddr::V4(_) => QUOTED_IP + 16,
            IpAddr::V6(_) => QUOTED_IPV6 + 24,
        };
        let o = octets(vip);
        out[quoted_dst..quoted_dst + o.len()].copy_from_slice(&o);
        put(&mut out, quote.l4 + 2, vport);
        let (src_at, _) = addr_offsets(vip);
        let from_endpoint = out[src_at..src_at + o.len()] == octets(old_addr);
        if from_endpoint {
            out[src_at..src_at + o.len()].copy_from_slice(&o);
            if v4 {
                let c = adjust_checksum(be16(&out[ETH_HLEN + 10..]), &words(old_addr), &words(vip));
                put(&mut out, ETH_HLEN + 10, c);
            } else {
                // ICMPv6's checksum covers the error's own addresses (pseudo-header).
                removed.extend(words(old_addr));
                added.extend(words(vip));
            }
        }
        let icmp_csum = if v4 {
            ETH_HLEN + IP_MIN + 2
        } else {
            IPV6_END + 2
        };
        let c = adjust_checksum(be16(&out[icmp_csum..]), &removed, &added);
        put(&mut out, icmp_csum, c);
        Outcome {
            verdict: TC_ACT_UNSPEC,
            frame: out,
            event: Event::IcmpTranslated,
            hairpin: false,
            notes: vec![],
        }
    }

    /// The backend of the live flow `h` belongs to, if that backend may keep it; the flow's
    /// entries are refreshed (and its reply entry written again if it is not the flow's).
    fn follow_flow(&mut self, h: &Headers, notes: &mut Vec<Note>) -> Option<(IpAddr, u16)> {
        let t = h.tuple;
        let e = self.conntrack.get(&t)?;
        if e.direction != Direction::Forward {
            return None;
        }
        if !self.live(e, t.proto) {
            notes.push(Note::Expired);
            return None;
        }
        // A new connection on the 5-tuple of a closed one.
        if e.closing && h.syn_only() {
            notes.push(Note::Reopened);
            return None;
        }
        let id = e.backend_id;
        let backends = self.tables.backends_of(t.dst);
        let Some(b) = backends.get(&id).filter(|b| b.proto == t.proto) else {
            notes.push(Note::BackendGone);
            return None;
        };
        let backend = (b.addr, b.port);
        if b.draining {
            // Only established TCP connections outlive their endpoint's removal.
            if t.proto == UDP || h.syn_only() {
                notes.push(Note::DrainLeft);
                return None;
            }
            notes.push(Note::DrainKept);
        }
        // Most packets of a busy flow meet only its forward entry (the kernel's `reply_due`).
        let e = &self.conntrack[&t];
        let reply_due = h.tcp_flags & (SYN | FIN | RST) != 0
            || e.closing
            || e.opening
            || e.packets.is_multiple_of(REPLY_CHECK_PACKETS)
            || self.now > e.last_seen;
        if !reply_due {
            let e = self.conntrack.get_mut(&t).unwrap();
            e.packets += 1;
            e.last_seen = self.now;
            e.refreshed = true;
            follow_seq(e, h);
            return Some(backend);
        }
        let reply = reply_tuple(&t, backend);
        let reply_ours = self
            .conntrack
            .get(&reply)
            .is_some_and(|r| r.direction == Direction::Reply && r.backend_id == id);
        self.touch(&t, reply_ours.then_some(&reply), h, notes);
        if !reply_ours {
            // Evicted, deleted, or another flow's: the flow's replies need it back. It carries
            // whether the flow is over, not the forward direction's FIN.
            let forward = self.conntrack[&t].clone();
            self.conntrack.insert(
                reply,
                Entry {
                    direction: Direction::Reply,
                    fin: false,
                    packets: 0,
                    seq_hint: 0,
                    ..forward
                },
            );
            notes.push(Note::ReplyRewritten);
        }
        Some(backend)
    }

    /// A new flow `t` to `c`: both of its entries.
    fn record(&mut self, h: &Headers, c: Candidate) {
        let t = &h.tuple;
        let entry = Entry {
            direction: Direction::Forward,
            backend_id: c.id,
            vip: t.dst,
            vport: t.dport,
            fin: false,
            closing: false,
            time_wait: false,
            opening: t.proto == TCP,
            answered: false,
            half_closed: false,
            seq_hint: h.seq,
            last_seen: self.now,
            packets: 1,
            refreshed: true,
            backend: (c.addr, c.port),
        };
        let reply = Entry {
            direction: Direction::Reply,
            packets: 0,
            seq_hint: 0,
            ..entry.clone()
        };
        self.conntrack
            .insert(reply_tuple(t, (c.addr, c.port)), reply);
        self.conntrack.insert(*t, entry);
    }

    /// For a packet of `h` (a backend's, to `client`): the service address and port to put back
    /// as its source, if it is a reply of a live flow. A reply entry that is not (its flow
    /// expired, went to another backend, or is gone) is deleted.
    fn reply_of_live_flow(
        &mut self,
        h: &Headers,
        client: IpAddr,
        notes: &mut Vec<Note>,
    ) -> Option<(IpAddr, u16)> {
        let t = h.tuple;
        let r = self.conntrack.get(&t)?;
        if r.direction != Direction::Reply {
            return None;
        }
        let (vip, vport, id) = (r.vip, r.vport, r.backend_id);
        let forward = Tuple {
            src: client,
            dst: vip,
            sport: t.dport,
            dport: vport,
            proto: t.proto,
        };
        let live = self.conntrack.get(&forward).is_some_and(|f| {
            f.direction == Direction::Forward && f.backend_id == id && self.live(f, t.proto)
        });
        if !live {
            self.conntrack.remove(&t);
            notes.push(Note::ReplyForgotten);
            return None;
        }
        self.touch(&t, Some(&forward), h, notes);
        Some((vip, vport))
    }

    /// A packet of the flow went the way of the entry `this` (`other`: the flow's entry the other
    /// way, when known). A flow has one lifetime: both entries are refreshed. A RST, or a FIN
    /// from each side, closes the flow; a closed flow is not refreshed any more.
    fn touch(&mut self, this: &Tuple, other: Option<&Tuple>, h: &Headers, notes: &mut Vec<Note>) {
        let now = self.now;
        let e = self.conntrack.get_mut(this).expect("touching an entry");
        e.packets += 1;
        if e.closing {
            notes.push(Note::ClosedFollowed);
            return;
        }
        e.last_seen = now;
        e.refreshed = true;
        // A sequence number out of its direction's window (a blind spoofer's) changes nothing.
        if !follow_seq(e, h) {
            if let Some(other) = other {
                let o = self.conntrack.get_mut(other).expect("touching an entry");
                o.last_seen = now;
                o.refreshed = true;
            }
            notes.push(Note::OutOfWindow);
            return;
        }
        e.fin |= h.fin();
        let (this_fin, forward) = (e.fin, e.direction == Direction::Forward);
        // The handshake and half-closes are the flow's: both entries follow them. The client
        // ends the opening only by acknowledging what the backend sent.
        let answered = !forward;
        let acknowledges = match other {
            Some(o) if h.tuple.proto == TCP => plausible(self.conntrack[o].seq_hint, h.ack),
            _ => true,
        };
        let e = self.conntrack.get_mut(this).unwrap();
        let opened = forward && e.answered && acknowledges;
        let half_closed = h.fin();
        let follow = |e: &mut Entry| {
            e.answered |= answered;
            e.opening &= !opened;
            e.half_closed |= half_closed;
        };
        follow(e);
        let mut closed = h.rst();
        let mut time_wait = false;
        if let Some(other) = other {
            let o = self.conntrack.get_mut(other).expect("touching an entry");
            o.last_seen = now;
            o.refreshed = true;
            follow(o);
            closed |= this_fin && o.fin;
            time_wait = closed && !h.rst() && forward;
            o.closing |= closed;
            o.time_wait |= time_wait;
        }
        if closed {
            let e = self.conntrack.get_mut(this).unwrap();
            e.closing = true;
            e.time_wait |= time_wait;
            notes.push(Note::Closed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::{self, Spec};

    #[test]
    fn adjusted_checksums_equal_recomputed_ones() {
        let v4 = [[10, 244, 1, 10], [10, 96, 0, 10], [10, 244, 2, 11]].map(Ipv4Addr::from);
        let v6 = ["fd00:10:244:1::10", "fd00:10:96::10", "fd00:10:244:2::11"]
            .map(|a| a.parse::<Ipv6Addr>().unwrap());
        let families: [[IpAddr; 3]; 2] = [v4.map(IpAddr::from), v6.map(IpAddr::from)];
        for [client, vip, backend] in families {
            for sport in [1, 40000, 65535] {
                for spec in [
                    Spec::tcp(client, sport, vip, 80),
                    Spec::udp(client, sport, vip, 80),
                ] {
                    let frame = spec.build();
                    let h = parse(&frame).unwrap();
                    let out = rewrite(&frame, &h, (client, sport), (backend, 8080));
                    packet::assert_checksums(&out, false);
                    let (_, _, dst, dport) = packet::tuple(&out);
                    assert_eq!((dst, dport), (backend, 8080));
                }
            }
        }
    }

    #[test]
    fn ipv6_is_read_through_extension_headers() {
        let client: Ipv6Addr = "fd00:10:244:1::10".parse().unwrap();
        let vip: Ipv6Addr = "fd00:10:96::10".parse().unwrap();
        let mut frame = Spec::udp(client, 40000, vip, 53).build();
        // Hop-by-hop options (padding), then an atomic fragment: a datagram of its own.
        let hop_by_hop = [FRAGMENT, 0, 1, 4, 0, 0, 0, 0];
        let fragment = [UDP, 0, 0, 0, 0, 0, 0, 0];
        frame.splice(IPV6_END..IPV6_END, hop_by_hop.into_iter().chain(fragment));
        frame[ETH_HLEN + 6] = HOP_BY_HOP;
        frame[ETH_HLEN + 5] += 16;
        let h = parse(&frame).unwrap();
        assert_eq!(
            (h.l4, h.tuple.sport, h.tuple.dport),
            (IPV6_END + 16, 40000, 53)
        );
        // More fragments: the first of a datagram.
        frame[IPV6_END + 8 + 3] = 1;
        let (_, piece) = parse_piece(&frame).unwrap();
        assert_eq!(piece, Piece::First(0));
        // A jumbogram is not followed.
        frame[ETH_HLEN + 4..ETH_HLEN + 6].fill(0);
        assert_eq!(parse_piece(&frame).unwrap_err(), Skip::BadLength);
    }

    #[test]
    fn a_zero_sum_is_written_as_zero() {
        // 0x1234 replaced by itself: the checksum of an all-zero sum stays in one form.
        assert_eq!(adjust_checksum(0xffff, &[0x1234], &[0x1234]), 0);
        assert_eq!(adjust_checksum(0x0000, &[0x1234], &[0x1234]), 0);
        assert_eq!(adjust_checksum(0xabcd, &[0x1234], &[0x1234]), 0xabcd);
    }
}
