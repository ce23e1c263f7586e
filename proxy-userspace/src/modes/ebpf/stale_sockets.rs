//! Host-network UDP sockets connected to an endpoint that has left their Service are told, as
//! Cilium terminates them. The socket programs rewrite a connected socket's destination to the
//! endpoint at connect() (sock.rs), so no later map change moves it: without this, its
//! datagrams would go on to the gone endpoint until the application reconnects. The sockets
//! the programs sent somewhere are in SOCK_REVNAT (cookie and endpoint -> service address);
//! those whose endpoint no longer serves that address are destroyed through NETLINK_SOCK_DIAG's
//! SOCK_DESTROY (`ss -K`'s request; the kernel needs CONFIG_INET_DIAG_DESTROY, which Debian's
//! and the major distributions' kernels have): the kernel disconnects such a socket, so the
//! application's next receive fails with ECONNABORTED (a send, with EDESTADDRREQ), and
//! connecting again picks a serving endpoint. TCP connections are left to drain, as the tc
//! path leaves them. Both families: IPv4 sockets and IPv6 ones (SOCK_REVNAT6; those connected
//! to an IPv4-mapped service address are in SOCK_REVNAT, their peer listed as IPv4-mapped).
use std::{
    io,
    net::{IpAddr, Ipv6Addr},
    os::fd::OwnedFd,
    path::Path,
};

use anyhow::Context;
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use foldhash::HashSet;
use proxy_common::{
    Addr, Be32, Be128, IPPROTO_UDP, MAP_SOCK_REVNAT, MAP_SOCK_REVNAT6, SockRevNatKey,
    SockRevNatValue,
};

use super::link_events::{
    NLMSG_HDRLEN, align4, error_of, netlink_socket, receive, send, u16_at, u32_at,
};

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
/// `struct inet_diag_sockid`: ports, addresses, interface, cookie.
const SOCKID_LEN: usize = 48;
/// `struct inet_diag_req_v2`: family, protocol, extensions, pad, states, the socket id.
const REQUEST_LEN: usize = 8 + SOCKID_LEN;
/// `struct inet_diag_msg` up to the end of its socket id: family, state, timer, retransmits.
const MESSAGE_ID_AT: usize = 4;
/// A dump's message flag: the table changed during the dump.
const NLM_F_DUMP_INTR: u16 = 0x10;
/// A connected UDP socket's state, as sock_diag reports it.
const TCP_ESTABLISHED: u32 = 1;

/// What the UDP routes of the services map are: (frontend address, port, endpoint address,
/// port), a NodePort's address unspecified ([`super::MapWriter::udp_routes`]).
pub type UdpRoutes = HashSet<(IpAddr, u16, IpAddr, u16)>;

/// The kernel cannot destroy sockets (no CONFIG_INET_DIAG_DESTROY): nothing to retry.
#[derive(Debug, thiserror::Error)]
#[error(
    "this kernel cannot destroy sockets (CONFIG_INET_DIAG_DESTROY is not set): host-network UDP \
     sockets connected to a Service keep sending to an endpoint that left until they reconnect"
)]
pub struct Unsupported;

/// Destroys this network namespace's connected UDP sockets that the socket programs sent to
/// an endpoint no longer in `routes` for the service address they asked for; how many. A
/// socket that cannot be destroyed is skipped (and named in the error, once the others are
/// done), one closed meanwhile ignored.
pub fn terminate(pin_dir: &Path, routes: &UdpRoutes) -> anyhow::Result<usize> {
    let stale = stale_sockets(pin_dir, routes)?;
    if stale.is_empty() {
        return Ok(0);
    }
    let fd = netlink_socket(libc::NETLINK_SOCK_DIAG).context("a NETLINK_SOCK_DIAG socket")?;
    let (mut destroyed, mut failed) = (0, Vec::new());
    let mut sockets = Vec::new();
    for family in [libc::AF_INET, libc::AF_INET6] {
        sockets.extend(
            connected_udp_sockets(&fd, family as u8)
                .context("listing the UDP sockets (sock_diag)")?,
        );
    }
    for socket in sockets {
        if !stale.contains(&(socket.cookie, socket.peer)) {
            continue;
        }
        match destroy(&fd, &socket) {
            Ok(()) => destroyed += 1,
            // Closed meanwhile.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => return Err(Unsupported.into()),
            Err(e) => failed.push(format!("{}:{}: {e}", socket.peer.0, socket.peer.1)),
        }
    }
    if !failed.is_empty() {
        anyhow::bail!(
            "{destroyed} destroyed, {} not (SOCK_DESTROY): {}",
            failed.len(),
            failed.join("; ")
        );
    }
    Ok(destroyed)
}

/// The sockets (cookie) and endpoints they were sent to that do not serve the service address
/// the socket asked for any more, of both families' maps (an older agent's pins may have no
/// IPv6 one).
fn stale_sockets(pin_dir: &Path, routes: &UdpRoutes) -> anyhow::Result<HashSet<(u64, Peer)>> {
    let mut stale = HashSet::default();
    stale_of::<Be32>(pin_dir, MAP_SOCK_REVNAT, routes, &mut stale)?;
    if pin_dir.join(MAP_SOCK_REVNAT6).exists() {
        stale_of::<Be128>(pin_dir, MAP_SOCK_REVNAT6, routes, &mut stale)?;
    }
    Ok(stale)
}

/// [`stale_sockets`] of one family's map, `name`.
fn stale_of<A: Addr + aya::Pod>(
    pin_dir: &Path,
    name: &str,
    routes: &UdpRoutes,
    stale: &mut HashSet<(u64, Peer)>,
) -> anyhow::Result<()> {
    let path = pin_dir.join(name);
    let data = MapData::from_pin(&path)
        .with_context(|| format!("opening the pinned map {}", path.display()))?;
    let revnat: BpfHashMap<MapData, SockRevNatKey<A>, SockRevNatValue<A>> =
        Map::LruHashMap(data).try_into()?;
    for entry in revnat.iter() {
        // An entry evicted while we walk: the others are still read.
        let Ok((key, service)) = entry else { continue };
        let endpoint = (key.addr.ip(), key.port.get());
        let served =
            |addr: IpAddr| routes.contains(&(addr, service.port.get(), endpoint.0, endpoint.1));
        // A NodePort's frontend is any node address.
        if !served(service.addr.ip()) && !served(A::NODE_PORT.ip()) {
            stale.insert((key.cookie(), endpoint));
        }
    }
    Ok(())
}

/// A socket's peer: address (IPv4 for an IPv6 socket's IPv4-mapped one) and port.
type Peer = (IpAddr, u16);

/// A connected UDP socket as sock_diag lists it.
struct DiagSocket {
    /// Its `inet_diag_sockid`, as the kernel gave it (SOCK_DESTROY takes it back whole).
    id: [u8; SOCKID_LEN],
    /// AF_INET or AF_INET6.
    family: u8,
    cookie: u64,
    peer: Peer,
}

/// A sock_diag request for UDP sockets of `family` in `states` (a bit per state), of socket
/// `id`.
fn request(kind: u16, flags: u16, family: u8, states: u32, id: &[u8; SOCKID_LEN]) -> Vec<u8> {
    let len = NLMSG_HDRLEN + REQUEST_LEN;
    let mut msg = vec![0u8; len];
    msg[0..4].copy_from_slice(&(len as u32).to_ne_bytes());
    msg[4..6].copy_from_slice(&kind.to_ne_bytes());
    msg[6..8].copy_from_slice(&flags.to_ne_bytes());
    let body = &mut msg[NLMSG_HDRLEN..];
    body[0] = family;
    body[1] = IPPROTO_UDP;
    body[4..8].copy_from_slice(&states.to_ne_bytes());
    body[8..].copy_from_slice(id);
    msg
}

fn short() -> io::Error {
    io::Error::other("a truncated sock_diag message")
}

/// Every connected UDP socket of `family` of this network namespace.
fn connected_udp_sockets(fd: &OwnedFd, family: u8) -> io::Result<Vec<DiagSocket>> {
    let dump = request(
        SOCK_DIAG_BY_FAMILY,
        (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16,
        family,
        1 << TCP_ESTABLISHED,
        &[0; SOCKID_LEN],
    );
    send(fd, &dump)?;
    let mut buf = vec![0u8; 64 << 10];
    let mut out = Vec::new();
    loop {
        let mut part = receive(fd, &mut buf)?;
        while part.len() >= NLMSG_HDRLEN {
            let len = u32_at(part, 0) as usize;
            if len < NLMSG_HDRLEN || len > part.len() {
                return Err(short());
            }
            let body = &part[NLMSG_HDRLEN..len];
            // The kernel's table changed while it listed it: some sockets may be missing.
            if u16_at(part, 6) & NLM_F_DUMP_INTR != 0 {
                return Err(io::Error::other("the listing was interrupted by changes"));
            }
            match u16_at(part, 4) {
                t if t == libc::NLMSG_DONE as u16 => {
                    error_of(body)?;
                    return Ok(out);
                }
                t if t == libc::NLMSG_ERROR as u16 => {
                    error_of(body)?;
                    return Ok(out);
                }
                SOCK_DIAG_BY_FAMILY => out.push(parse(body).ok_or_else(short)?),
                _ => {}
            }
            part = &part[align4(len).min(part.len())..];
        }
    }
}

/// An `inet_diag_msg`'s socket.
fn parse(body: &[u8]) -> Option<DiagSocket> {
    let id: [u8; SOCKID_LEN] = body
        .get(MESSAGE_ID_AT..MESSAGE_ID_AT + SOCKID_LEN)?
        .try_into()
        .ok()?;
    // Family first; in the id: source port, destination port, source and destination (16
    // bytes each, an IPv4 one in the first 4), interface, cookie (two 32-bit halves, low
    // first).
    let family = *body.first()?;
    let dport = u16::from_be_bytes([id[2], id[3]]);
    let dst: [u8; 16] = id[20..36].try_into().ok()?;
    let dst = match i32::from(family) {
        libc::AF_INET => IpAddr::from([dst[0], dst[1], dst[2], dst[3]]),
        _ => Ipv6Addr::from(dst).to_canonical(),
    };
    let cookie = u64::from(u32_at(&id, 40)) | (u64::from(u32_at(&id, 44)) << 32);
    Some(DiagSocket {
        id,
        family,
        cookie,
        peer: (dst, dport),
    })
}

/// SOCK_DESTROY of `socket`, waiting for the kernel's answer.
fn destroy(fd: &OwnedFd, socket: &DiagSocket) -> io::Result<()> {
    let msg = request(
        SOCK_DESTROY,
        (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16,
        socket.family,
        u32::MAX,
        &socket.id,
    );
    send(fd, &msg)?;
    let mut buf = vec![0u8; 4096];
    let reply = receive(fd, &mut buf)?;
    if reply.len() < NLMSG_HDRLEN + 4 || u16_at(reply, 4) != libc::NLMSG_ERROR as u16 {
        return Err(short());
    }
    error_of(&reply[NLMSG_HDRLEN..])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `inet_diag_msg` as the kernel writes it: the peer's port and address, the cookie's
    /// halves low first.
    #[test]
    fn a_listed_socket_is_read_as_the_kernel_writes_it() {
        let mut body = vec![0u8; 72];
        body[0] = libc::AF_INET as u8;
        body[1] = TCP_ESTABLISHED as u8;
        let id = &mut body[MESSAGE_ID_AT..MESSAGE_ID_AT + SOCKID_LEN];
        id[0..2].copy_from_slice(&40000u16.to_be_bytes());
        id[2..4].copy_from_slice(&53u16.to_be_bytes());
        id[4..8].copy_from_slice(&[192, 168, 0, 1]);
        id[20..24].copy_from_slice(&[10, 244, 1, 53]);
        id[40..44].copy_from_slice(&0x89ab_cdefu32.to_ne_bytes());
        id[44..48].copy_from_slice(&0x0123_4567u32.to_ne_bytes());
        let socket = parse(&body).unwrap();
        assert_eq!(socket.peer, (IpAddr::from([10, 244, 1, 53]), 53));
        assert_eq!(socket.cookie, 0x0123_4567_89ab_cdef);
        assert_eq!(
            &socket.id[..],
            &body[MESSAGE_ID_AT..MESSAGE_ID_AT + SOCKID_LEN]
        );
    }

    /// An IPv6 socket's peer; one connected to an IPv4-mapped address is listed as IPv4 (as
    /// SOCK_REVNAT names its endpoint).
    #[test]
    fn an_ipv6_socket_s_peer_is_read_with_mapped_addresses_as_ipv4() {
        let mut body = vec![0u8; 72];
        body[0] = libc::AF_INET6 as u8;
        let peer: Ipv6Addr = "fd00:10:244:1::35".parse().unwrap();
        body[MESSAGE_ID_AT + 2..MESSAGE_ID_AT + 4].copy_from_slice(&53u16.to_be_bytes());
        body[MESSAGE_ID_AT + 20..MESSAGE_ID_AT + 36].copy_from_slice(&peer.octets());
        let socket = parse(&body).unwrap();
        assert_eq!(
            (socket.family, socket.peer),
            (libc::AF_INET6 as u8, (peer.into(), 53))
        );
        let mapped = "::ffff:10.244.1.53".parse::<Ipv6Addr>().unwrap();
        body[MESSAGE_ID_AT + 20..MESSAGE_ID_AT + 36].copy_from_slice(&mapped.octets());
        assert_eq!(
            parse(&body).unwrap().peer,
            (IpAddr::from([10, 244, 1, 53]), 53)
        );
    }
}
