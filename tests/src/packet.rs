//! Crafting and checking IPv4 TCP/UDP frames for BPF_PROG_TEST_RUN, and IPv6 ones for raw
//! sockets (the checks below read IPv4 frames only).
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

pub const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPV6_HLEN: usize = 40;
/// IPv6's fragment extension header (its next-header number and its length).
const IPV6_FRAGMENT: u8 = 44;
const IPV6_FRAGMENT_LEN: usize = 8;
pub const TCP: u8 = 6;
pub const UDP: u8 = 17;

/// What a crafted frame carries.
#[derive(Clone, Debug)]
pub struct Spec {
    /// Both of one family.
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// IPv4 options (a multiple of 4 bytes; none for IPv6).
    pub ip_options: Vec<u8>,
    pub payload: Vec<u8>,
    /// TCP flags byte (SYN = 0x02, ACK = 0x10).
    pub tcp_flags: u8,
    /// For UDP: send a zero checksum ("no checksum").
    pub udp_zero_checksum: bool,
    /// TCP sequence and acknowledgment numbers.
    pub seq: u32,
    pub ack: u32,
}

impl Spec {
    pub fn tcp(src: impl Into<IpAddr>, sport: u16, dst: impl Into<IpAddr>, dport: u16) -> Self {
        Self {
            src: src.into(),
            dst: dst.into(),
            sport,
            dport,
            proto: TCP,
            ip_options: Vec::new(),
            payload: b"hello".to_vec(),
            tcp_flags: 0x02,
            udp_zero_checksum: false,
            seq: 1000,
            ack: 0,
        }
    }

    pub fn udp(src: impl Into<IpAddr>, sport: u16, dst: impl Into<IpAddr>, dport: u16) -> Self {
        Self {
            proto: UDP,
            tcp_flags: 0,
            ..Self::tcp(src, sport, dst, dport)
        }
    }

    /// The frame: Ethernet, IPv4 or IPv6, and TCP/UDP, with correct checksums.
    pub fn build(&self) -> Vec<u8> {
        let l4_len = if self.proto == TCP { 20 } else { 8 } + self.payload.len();
        let (mut f, l4_off) = match (self.src, self.dst) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => self.ipv4_header(src, dst, l4_len),
            (IpAddr::V6(src), IpAddr::V6(dst)) => {
                assert!(self.ip_options.is_empty(), "IPv4 options in an IPv6 packet");
                let mut f = frame_header(ETH_P_IPV6, IPV6_HLEN + l4_len);
                let ip = &mut f[ETH_HLEN..];
                ip[0] = 0x60;
                ip[4..6].copy_from_slice(&(l4_len as u16).to_be_bytes());
                ip[6] = self.proto;
                ip[7] = 64;
                ip[8..24].copy_from_slice(&src.octets());
                ip[24..40].copy_from_slice(&dst.octets());
                (f, ETH_HLEN + IPV6_HLEN)
            }
            _ => panic!("{} to {}: two families", self.src, self.dst),
        };
        let l4 = &mut f[l4_off..];
        l4[0..2].copy_from_slice(&self.sport.to_be_bytes());
        l4[2..4].copy_from_slice(&self.dport.to_be_bytes());
        if self.proto == TCP {
            l4[4..8].copy_from_slice(&self.seq.to_be_bytes());
            l4[8..12].copy_from_slice(&self.ack.to_be_bytes());
            l4[12] = 5 << 4;
            l4[13] = self.tcp_flags;
            l4[14..16].copy_from_slice(&65535u16.to_be_bytes());
            l4[20..].copy_from_slice(&self.payload);
        } else {
            l4[4..6].copy_from_slice(&(l4_len as u16).to_be_bytes());
            l4[8..].copy_from_slice(&self.payload);
        }
        fix_checksums(&mut f);
        if self.proto == UDP && self.udp_zero_checksum {
            let off = l4_off + 6;
            f[off..off + 2].copy_from_slice(&[0, 0]);
        }
        f
    }

    /// A frame of Ethernet and IPv4 headers for `l4_len` bytes after them, and where those
    /// start.
    fn ipv4_header(&self, src: Ipv4Addr, dst: Ipv4Addr, l4_len: usize) -> (Vec<u8>, usize) {
        assert!(self.ip_options.len().is_multiple_of(4) && self.ip_options.len() <= 40);
        let ihl = 20 + self.ip_options.len();
        let mut f = frame_header(ETH_P_IP, ihl + l4_len);
        let ip = &mut f[ETH_HLEN..];
        ip[0] = 0x40 | (ihl / 4) as u8;
        ip[2..4].copy_from_slice(&((ihl + l4_len) as u16).to_be_bytes());
        ip[4..6].copy_from_slice(&0x1234u16.to_be_bytes());
        ip[6] = 0x40; // don't fragment
        ip[8] = 64;
        ip[9] = self.proto;
        ip[12..16].copy_from_slice(&src.octets());
        ip[16..20].copy_from_slice(&dst.octets());
        ip[20..ihl].copy_from_slice(&self.ip_options);
        (f, ETH_HLEN + ihl)
    }
}

/// A zeroed frame of `ip_len` bytes after an Ethernet header of `ethertype` (from
/// 02:00:00:00:00:01 to 02:00:00:00:00:02).
fn frame_header(ethertype: u16, ip_len: usize) -> Vec<u8> {
    let mut f = vec![0u8; ETH_HLEN + ip_len];
    f[0..6].copy_from_slice(&[0x02, 0, 0, 0, 0, 2]);
    f[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 1]);
    f[12..14].copy_from_slice(&ethertype.to_be_bytes());
    f
}

/// Whether `frame` carries IPv6.
fn is_ipv6(frame: &[u8]) -> bool {
    u16::from_be_bytes([frame[12], frame[13]]) == ETH_P_IPV6
}

fn sum16(data: &[u8], mut acc: u32) -> u32 {
    for chunk in data.chunks(2) {
        let word = if chunk.len() == 2 {
            u16::from_be_bytes([chunk[0], chunk[1]])
        } else {
            (chunk[0] as u16) << 8
        };
        acc += word as u32;
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc >> 16 != 0 {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

fn ihl(frame: &[u8]) -> usize {
    ((frame[ETH_HLEN] & 0x0f) as usize) * 4
}

/// Checks an ICMP port unreachable about `offending` (a frame sent from a pod), as the programs
/// build it when they reject: from the offending packet's destination to its source, both
/// checksums right, quoting its IP header and the first 8 bytes after it; MACs swapped.
pub fn assert_port_unreachable(frame: &[u8], offending: &[u8]) {
    assert_unreachable(frame, offending, ICMP_PORT_UNREACH, 0);
}

/// [`assert_port_unreachable`] for any destination unreachable `code`, with `mtu` in the
/// header's second half (fragmentation needed's next-hop MTU; zero for other codes).
pub fn assert_unreachable(frame: &[u8], offending: &[u8], code: u8, mtu: u16) {
    let ihl = ihl(offending);
    assert_eq!(frame.len(), ETH_HLEN + 20 + 8 + ihl + 8, "reply length");
    assert_eq!(
        (&frame[0..6], &frame[6..12]),
        (&offending[6..12], &offending[0..6]),
        "back to the sender"
    );
    let ip = &frame[ETH_HLEN..];
    let off = &offending[ETH_HLEN..];
    assert_eq!(ip[0], 0x45);
    assert_eq!(ip[9], 1, "ICMP");
    assert_eq!(
        u16::from_be_bytes([ip[2], ip[3]]) as usize,
        frame.len() - ETH_HLEN
    );
    assert_eq!(&ip[12..16], &off[16..20], "from the service address");
    assert_eq!(&ip[16..20], &off[12..16], "to the client");
    assert_eq!(
        u16::from_be_bytes([ip[10], ip[11]]),
        ip_checksum(frame),
        "IP checksum"
    );
    let icmp = &ip[20..];
    assert_eq!(
        (icmp[0], icmp[1]),
        (ICMP_DEST_UNREACH, code),
        "destination unreachable, its code"
    );
    assert_eq!(u16::from_be_bytes([icmp[6], icmp[7]]), mtu, "next-hop MTU");
    assert_eq!(fold(sum16(icmp, 0)), 0, "ICMP checksum");
    assert_eq!(&icmp[8..], &off[..ihl + 8], "the quote");
}

/// The IPv4 header checksum that the frame's header should carry.
pub fn ip_checksum(frame: &[u8]) -> u16 {
    let mut hdr = frame[ETH_HLEN..ETH_HLEN + ihl(frame)].to_vec();
    hdr[10] = 0;
    hdr[11] = 0;
    fold(sum16(&hdr, 0))
}

/// The TCP/UDP checksum that the frame's L4 header should carry (over the pseudo-header).
pub fn l4_checksum(frame: &[u8]) -> u16 {
    let ip = &frame[ETH_HLEN..];
    let (proto, l4_off, l4_end, addrs) = if is_ipv6(frame) {
        let len = u16::from_be_bytes([ip[4], ip[5]]) as usize;
        (ip[6], IPV6_HLEN, IPV6_HLEN + len, &ip[8..40])
    } else {
        let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
        (ip[9], ihl(frame), total, &ip[12..20])
    };
    let mut seg = ip[l4_off..l4_end].to_vec();
    let csum_off = if proto == TCP { 16 } else { 6 };
    seg[csum_off] = 0;
    seg[csum_off + 1] = 0;
    let c = fold(sum16(&seg, pseudo_sum(addrs, proto, seg.len())));
    // UDP sends an all-zero result as all ones (zero means "no checksum").
    if proto == UDP && c == 0 { 0xffff } else { c }
}

/// The sum of the pseudo-header over `addrs` (source and destination) for `len` bytes of
/// `proto` (IPv4's and IPv6's sum alike: the length's width does not change it).
fn pseudo_sum(addrs: &[u8], proto: u8, len: usize) -> u32 {
    let mut pseudo = addrs.to_vec();
    pseudo.extend_from_slice(&[0, proto]);
    pseudo.extend_from_slice(&(len as u16).to_be_bytes());
    sum16(&pseudo, 0)
}

fn fix_checksums(f: &mut [u8]) {
    let (l4_off, proto) = if is_ipv6(f) {
        (ETH_HLEN + IPV6_HLEN, f[ETH_HLEN + 6])
    } else {
        let ip = ip_checksum(f);
        f[ETH_HLEN + 10..ETH_HLEN + 12].copy_from_slice(&ip.to_be_bytes());
        (ETH_HLEN + ihl(f), f[ETH_HLEN + 9])
    };
    let off = l4_off + if proto == TCP { 16 } else { 6 };
    let l4 = l4_checksum(f);
    f[off..off + 2].copy_from_slice(&l4.to_be_bytes());
}

/// The fields a test checks after the program ran.
#[derive(Debug, PartialEq, Eq)]
pub struct Seen {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub sport: u16,
    pub dport: u16,
    /// The checksums as carried in the frame.
    pub ip_csum: u16,
    pub l4_csum: u16,
}

pub fn read(frame: &[u8]) -> Seen {
    let ip = &frame[ETH_HLEN..];
    let l4 = &ip[ihl(frame)..];
    let csum_off = if ip[9] == TCP { 16 } else { 6 };
    Seen {
        src: Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]),
        dst: Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]),
        sport: u16::from_be_bytes([l4[0], l4[1]]),
        dport: u16::from_be_bytes([l4[2], l4[3]]),
        ip_csum: u16::from_be_bytes([ip[10], ip[11]]),
        l4_csum: u16::from_be_bytes([l4[csum_off], l4[csum_off + 1]]),
    }
}

/// The addresses and ports of a TCP/UDP frame of either family (IPv6: without extension
/// headers): source, source port, destination, destination port.
pub fn tuple(frame: &[u8]) -> (IpAddr, u16, IpAddr, u16) {
    if !is_ipv6(frame) {
        let seen = read(frame);
        return (seen.src.into(), seen.sport, seen.dst.into(), seen.dport);
    }
    let ip = &frame[ETH_HLEN..];
    let addr = |at: usize| IpAddr::from(<[u8; 16]>::try_from(&ip[at..at + 16]).unwrap());
    let port = |at: usize| u16::from_be_bytes([ip[at], ip[at + 1]]);
    (addr(8), port(IPV6_HLEN), addr(24), port(IPV6_HLEN + 2))
}

/// Panics unless both checksums in `frame` are what a full recomputation gives (a UDP zero
/// checksum is accepted when `udp_zero` says the sender used none). IPv6 has no header
/// checksum: only the L4 one (a frame without extension headers).
pub fn assert_checksums(frame: &[u8], udp_zero: bool) {
    if is_ipv6(frame) {
        let off = ETH_HLEN + IPV6_HLEN + if frame[ETH_HLEN + 6] == TCP { 16 } else { 6 };
        let carried = u16::from_be_bytes([frame[off], frame[off + 1]]);
        assert_eq!(carried, l4_checksum(frame), "L4 checksum wrong");
        return;
    }
    let seen = read(frame);
    assert_eq!(
        seen.ip_csum,
        ip_checksum(frame),
        "IPv4 header checksum wrong"
    );
    if udp_zero {
        assert_eq!(seen.l4_csum, 0, "a zero UDP checksum must stay zero");
    } else {
        assert_eq!(seen.l4_csum, l4_checksum(frame), "L4 checksum wrong");
    }
}

pub const ICMP: u8 = 1;
pub const ICMP_DEST_UNREACH: u8 = 3;
pub const ICMP_FRAG_NEEDED: u8 = 4;
pub const ICMP_PORT_UNREACH: u8 = 3;
pub const ICMP_TIME_EXCEEDED: u8 = 11;

pub const ICMPV6: u8 = 58;
pub const ICMPV6_DEST_UNREACH: u8 = 1;
pub const ICMPV6_PORT_UNREACH: u8 = 4;
pub const ICMPV6_PACKET_TOO_BIG: u8 = 2;

/// An ICMP error of `kind` and `code` from `from` to the source of `quoted` (a frame as
/// [`Spec::build`] makes it), quoting its IP header and `quote_len` bytes after it (8, the least
/// a router sends; Linux quotes as much as fits), as a router or host sends it: correct IP and
/// ICMP checksums, the quoted packet left as it was (its checksums cover all of it). For
/// fragmentation needed, the next hop's MTU is 1400. An IPv6 `quoted` gets an ICMPv6 error
/// (`kind` and `code` ICMPv6's; packet too big's MTU 1400 too).
pub fn icmp_error(
    from: impl Into<IpAddr>,
    kind: u8,
    code: u8,
    quoted: &[u8],
    quote_len: usize,
) -> Vec<u8> {
    let from = match from.into() {
        IpAddr::V4(from) => from,
        IpAddr::V6(from) => return icmpv6_error(from, kind, code, quoted, quote_len),
    };
    let inner = &quoted[ETH_HLEN..];
    let quote = &inner[..(ihl(quoted) + quote_len).min(inner.len())];
    let mut f = frame_header(ETH_P_IP, 20 + 8 + quote.len());
    f[0..12].rotate_left(6); // from the quoted packet's receiver
    let total = (f.len() - ETH_HLEN) as u16;
    let ip = &mut f[ETH_HLEN..];
    ip[0] = 0x45;
    ip[1] = 0xc0; // internetwork control, as Linux sends its errors
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    ip[4..6].copy_from_slice(&0x4321u16.to_be_bytes());
    ip[8] = 64;
    ip[9] = ICMP;
    ip[12..16].copy_from_slice(&from.octets());
    ip[16..20].copy_from_slice(&inner[12..16]);
    let icmp = &mut ip[20..];
    icmp[0] = kind;
    icmp[1] = code;
    if (kind, code) == (ICMP_DEST_UNREACH, ICMP_FRAG_NEEDED) {
        icmp[6..8].copy_from_slice(&1400u16.to_be_bytes());
    }
    icmp[8..].copy_from_slice(quote);
    let csum = fold(sum16(icmp, 0));
    icmp[2..4].copy_from_slice(&csum.to_be_bytes());
    let csum = ip_checksum(&f);
    f[ETH_HLEN + 10..ETH_HLEN + 12].copy_from_slice(&csum.to_be_bytes());
    f
}

/// [`icmp_error`] about an IPv6 packet: an ICMPv6 error.
fn icmpv6_error(from: Ipv6Addr, kind: u8, code: u8, quoted: &[u8], quote_len: usize) -> Vec<u8> {
    let inner = &quoted[ETH_HLEN..];
    assert!(is_ipv6(quoted), "an ICMPv6 error about an IPv4 packet");
    let quote = &inner[..(IPV6_HLEN + quote_len).min(inner.len())];
    let icmp_len = 8 + quote.len();
    let mut f = frame_header(ETH_P_IPV6, IPV6_HLEN + icmp_len);
    f[0..12].rotate_left(6); // from the quoted packet's receiver
    let ip = &mut f[ETH_HLEN..];
    ip[0] = 0x60;
    ip[4..6].copy_from_slice(&(icmp_len as u16).to_be_bytes());
    ip[6] = ICMPV6;
    ip[7] = 64;
    ip[8..24].copy_from_slice(&from.octets());
    ip[24..40].copy_from_slice(&inner[8..24]);
    let icmp = &mut ip[IPV6_HLEN..];
    icmp[0] = kind;
    icmp[1] = code;
    if kind == ICMPV6_PACKET_TOO_BIG {
        icmp[4..8].copy_from_slice(&1400u32.to_be_bytes());
    }
    icmp[8..].copy_from_slice(quote);
    let addrs = f[ETH_HLEN + 8..ETH_HLEN + 40].to_vec();
    let icmp = &mut f[ETH_HLEN + IPV6_HLEN..];
    let csum = fold(sum16(icmp, pseudo_sum(&addrs, ICMPV6, icmp_len)));
    icmp[2..4].copy_from_slice(&csum.to_be_bytes());
    f
}

/// Panics unless `frame` is `want` (an ICMP error as [`icmp_error`] builds it) in every byte
/// after the Ethernet header, naming the first field that differs. Both frames' checksums are
/// recomputed first, so a wrong checksum is named as such.
pub fn assert_icmp_error(frame: &[u8], want: &[u8]) {
    assert_eq!(frame.len(), want.len(), "length");
    assert_eq!(
        ip_checksum(frame).to_be_bytes(),
        frame[ETH_HLEN + 10..ETH_HLEN + 12],
        "outer IP checksum"
    );
    let icmp = &frame[ETH_HLEN + 20..];
    assert_eq!(fold(sum16(icmp, 0)), 0, "ICMP checksum");
    let fields = [
        ("outer source", ETH_HLEN + 12..ETH_HLEN + 16),
        ("outer destination", ETH_HLEN + 16..ETH_HLEN + 20),
        ("quoted IP checksum", ETH_HLEN + 38..ETH_HLEN + 40),
        ("quoted source", ETH_HLEN + 40..ETH_HLEN + 44),
        ("quoted destination", ETH_HLEN + 44..ETH_HLEN + 48),
        ("quoted ports", ETH_HLEN + 48..ETH_HLEN + 52),
        (
            "quoted L4 header",
            ETH_HLEN + 52..frame.len().min(ETH_HLEN + 68),
        ),
        ("the whole packet", ETH_HLEN..frame.len()),
    ];
    for (what, range) in fields {
        assert_eq!(frame[range.clone()], want[range], "{what}");
    }
}

/// What forwarding does to a frame's IP header: one hop off its TTL, the checksum updated.
pub fn hop(frame: &mut [u8]) {
    frame[ETH_HLEN + 8] -= 1;
    set_ip_checksum(frame);
}

/// Writes the IPv4 header checksum the frame's header should carry (after a test changed it).
pub fn set_ip_checksum(frame: &mut [u8]) {
    let csum = ip_checksum(frame);
    frame[ETH_HLEN + 10..ETH_HLEN + 12].copy_from_slice(&csum.to_be_bytes());
}

/// `frame` (a packet as [`Spec::build`] makes it) in two fragments, as a router cuts
/// it: the first with `cut` bytes of what follows its IP header (a multiple of 8) and
/// more-fragments set, the later one with the rest at that offset; both with `frame`'s IP
/// header otherwise (IPv4: don't-fragment cleared, their own lengths and IP checksums; IPv6:
/// a fragment header after it).
pub fn fragments(frame: &[u8], cut: usize) -> (Vec<u8>, Vec<u8>) {
    assert!(cut.is_multiple_of(8));
    if is_ipv6(frame) {
        return ipv6_fragments(frame, cut);
    }
    let header_len = ihl(frame);
    let total = u16::from_be_bytes([frame[ETH_HLEN + 2], frame[ETH_HLEN + 3]]) as usize;
    assert!(
        header_len + cut < total,
        "nothing left for a second fragment"
    );
    let piece = |data: std::ops::Range<usize>, flags: u16| {
        let data = ETH_HLEN + header_len + data.start..ETH_HLEN + header_len + data.end;
        let mut f = frame[..ETH_HLEN + header_len].to_vec();
        f.extend_from_slice(&frame[data.clone()]);
        let len = (header_len + data.len()) as u16;
        f[ETH_HLEN + 2..ETH_HLEN + 4].copy_from_slice(&len.to_be_bytes());
        f[ETH_HLEN + 6..ETH_HLEN + 8].copy_from_slice(&flags.to_be_bytes());
        let c = ip_checksum(&f);
        f[ETH_HLEN + 10..ETH_HLEN + 12].copy_from_slice(&c.to_be_bytes());
        f
    };
    (
        piece(0..cut, 0x2000),
        piece(cut..total - header_len, (cut / 8) as u16),
    )
}

/// [`fragments`] of an IPv6 packet (no extension headers), identification 0x1234.
fn ipv6_fragments(frame: &[u8], cut: usize) -> (Vec<u8>, Vec<u8>) {
    let header_end = ETH_HLEN + IPV6_HLEN;
    let data = &frame[header_end..];
    assert!(cut < data.len(), "nothing left for a second fragment");
    let proto = frame[ETH_HLEN + 6];
    let piece = |data: &[u8], offset_and_more: u16| {
        let mut f = frame[..header_end].to_vec();
        let len = (IPV6_FRAGMENT_LEN + data.len()) as u16;
        f[ETH_HLEN + 4..ETH_HLEN + 6].copy_from_slice(&len.to_be_bytes());
        f[ETH_HLEN + 6] = IPV6_FRAGMENT;
        f.extend_from_slice(&[proto, 0]);
        f.extend_from_slice(&offset_and_more.to_be_bytes());
        f.extend_from_slice(&0x1234u32.to_be_bytes());
        f.extend_from_slice(data);
        f
    };
    (
        piece(&data[..cut], 1),
        piece(&data[cut..], (cut / 8) as u16 * 8),
    )
}

/// Sets the IP identification of `frame` (IPv4: the checksum follows; IPv6: a fragment's, in
/// its fragment header).
pub fn set_ip_id(frame: &mut [u8], id: u16) {
    if is_ipv6(frame) {
        assert_eq!(frame[ETH_HLEN + 6], IPV6_FRAGMENT, "not a fragment");
        let at = ETH_HLEN + IPV6_HLEN + 4;
        frame[at..at + 4].copy_from_slice(&u32::from(id).to_be_bytes());
        return;
    }
    frame[ETH_HLEN + 4..ETH_HLEN + 6].copy_from_slice(&id.to_be_bytes());
    set_ip_checksum(frame);
}
