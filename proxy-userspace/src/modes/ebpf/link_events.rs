//! The kernel's notifications of network interfaces appearing, changing (a rename, a move
//! into this namespace, going up) and disappearing, and of IPv4 addresses coming and going:
//! rtnetlink's link and IPv4 address groups, read from a NETLINK_ROUTE socket. A few fields of two message types are all we need, so they are read
//! here rather than through a netlink crate.
use std::{
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
};

/// rtnetlink's interface name attribute (`IFLA_IFNAME`, linux/if_link.h).
const IFLA_IFNAME: u16 = 3;
/// rtnetlink's attribute of the bridge (or bond) an interface is a port of (`IFLA_MASTER`).
const IFLA_MASTER: u16 = 10;
/// The flag bits of an attribute's type (`NLA_F_NESTED | NLA_F_NET_BYTEORDER`).
const NLA_FLAGS: u16 = 0xc000;
/// `struct nlmsghdr` and `struct ifinfomsg`.
pub(super) const NLMSG_HDRLEN: usize = 16;
const IFINFOMSG_LEN: usize = 16;
/// Asked for as the socket's receive buffer: a burst of pods starting (a few messages of
/// 1-2 KiB each) must not overflow it. Overflowing loses notifications (ENOBUFS), which the
/// caller makes up for by listing the interfaces again.
const RECEIVE_BUFFER: libc::c_int = 4 << 20;

#[derive(Debug, PartialEq, Eq)]
pub enum LinkEvent {
    /// RTM_NEWLINK: the interface `index` exists and is now called `name` (sent when it
    /// appears, is renamed or moved here, and on other changes such as going up, or joining
    /// or leaving a bridge), a port of `master` if that is set.
    Changed {
        index: u32,
        name: String,
        master: Option<u32>,
    },
    /// RTM_DELLINK: the interface `index` is gone (deleted, or moved to another namespace).
    Removed { index: u32 },
    /// RTM_NEWADDR or RTM_DELADDR: an IPv4 address was added or removed somewhere (the node's
    /// addresses, and so its external interfaces, may have changed).
    Addresses,
}

/// A NETLINK_ROUTE socket subscribed to link notifications.
pub struct LinkEvents {
    fd: OwnedFd,
    buf: Vec<u8>,
}

impl LinkEvents {
    /// Subscribes (in the calling thread's network namespace). Notifications queue from here
    /// on, so an interface listed after this is never missed.
    pub fn subscribe() -> io::Result<Self> {
        let fd = netlink_socket(libc::NETLINK_ROUTE)?;
        // Beyond net.core.rmem_max with CAP_NET_ADMIN (which the agent has); else the default.
        if setsockopt_int(&fd, libc::SO_RCVBUFFORCE, RECEIVE_BUFFER).is_err() {
            let _ = setsockopt_int(&fd, libc::SO_RCVBUF, RECEIVE_BUFFER);
        }
        // SAFETY: sockaddr_nl is plain data; all zeroes is a valid value.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        addr.nl_groups = (libc::RTMGRP_LINK | libc::RTMGRP_IPV4_IFADDR) as u32;
        // SAFETY: bind(2) with a valid sockaddr_nl and its size.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            fd,
            // Link messages are a few KiB; the kernel sends one a datagram.
            buf: vec![0; 64 << 10],
        })
    }

    /// Appends the queued notifications to `out`, without blocking. ENOBUFS (the kernel's
    /// queue overflowed, or a datagram was too long for our buffer) means some were lost: the
    /// socket works on, but the interfaces must be listed again.
    pub fn read(&mut self, out: &mut Vec<LinkEvent>) -> io::Result<()> {
        loop {
            // SAFETY: sockaddr_nl is plain data; all zeroes is a valid value.
            let mut from: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
            let mut from_len = std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t;
            // SAFETY: recvfrom(2) into our buffer, with its length, and a sockaddr_nl.
            let n = unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    self.buf.as_mut_ptr().cast(),
                    self.buf.len(),
                    libc::MSG_DONTWAIT | libc::MSG_TRUNC,
                    (&mut from as *mut libc::sockaddr_nl).cast(),
                    &mut from_len,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.raw_os_error() {
                    Some(libc::EAGAIN) => Ok(()),
                    Some(libc::EINTR) => continue,
                    _ => Err(e),
                };
            }
            let n = n as usize;
            if n > self.buf.len() {
                return Err(io::Error::from_raw_os_error(libc::ENOBUFS));
            }
            // Only the kernel's (port 0); another process could send to our port.
            if from.nl_pid == 0 {
                parse(&self.buf[..n], out);
            }
        }
    }
}

impl AsFd for LinkEvents {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// A netlink socket of `protocol` (NETLINK_ROUTE, NETLINK_SOCK_DIAG).
pub(super) fn netlink_socket(protocol: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the fd is owned below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            protocol,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a new descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends `msg` to the kernel on the netlink socket `fd` (unbound and unconnected).
pub(super) fn send(fd: &OwnedFd, msg: &[u8]) -> io::Result<()> {
    // SAFETY: send(2) of our buffer.
    if unsafe { libc::send(fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// One datagram from the netlink socket `fd` into `buf`: the part of it received.
pub(super) fn receive<'a>(fd: &OwnedFd, buf: &'a mut [u8]) -> io::Result<&'a [u8]> {
    loop {
        // SAFETY: recv(2) into our buffer, with its length.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n >= 0 {
            return Ok(&buf[..n as usize]);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// The error an NLMSG_ERROR message's body carries (0: an acknowledgment).
pub(super) fn error_of(body: &[u8]) -> io::Result<()> {
    let errno = body
        .get(0..4)
        .map(|b| i32::from_ne_bytes(b.try_into().unwrap()))
        .ok_or_else(|| io::Error::other("a truncated netlink error"))?;
    match errno {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(-e)),
    }
}

/// The interface the interface `index` is a port of (a bridge, a bond), asked of the kernel
/// (RTM_GETLINK): `None` if it is a port of none.
pub fn master(index: u32) -> io::Result<Option<u32>> {
    let fd = netlink_socket(libc::NETLINK_ROUTE)?;
    let mut request = [0u8; NLMSG_HDRLEN + IFINFOMSG_LEN];
    request[0..4].copy_from_slice(&((NLMSG_HDRLEN + IFINFOMSG_LEN) as u32).to_ne_bytes());
    request[4..6].copy_from_slice(&libc::RTM_GETLINK.to_ne_bytes());
    request[6..8].copy_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    request[NLMSG_HDRLEN + 4..NLMSG_HDRLEN + 8].copy_from_slice(&index.to_ne_bytes());
    send(&fd, &request)?;
    let mut buf = vec![0u8; 64 << 10];
    let reply = receive(&fd, &mut buf)?;
    if reply.len() < NLMSG_HDRLEN + IFINFOMSG_LEN {
        return Err(io::Error::other("short RTM_GETLINK reply"));
    }
    if u16_at(reply, 4) == libc::NLMSG_ERROR as u16 {
        error_of(&reply[NLMSG_HDRLEN..])?;
        return Err(io::Error::other("an acknowledgment instead of the link"));
    }
    let len = (u32_at(reply, 0) as usize).min(reply.len());
    Ok(master_of(&attributes(
        &reply[NLMSG_HDRLEN + IFINFOMSG_LEN..len],
    )))
}

fn setsockopt_int(fd: &OwnedFd, option: libc::c_int, value: libc::c_int) -> io::Result<()> {
    // SAFETY: setsockopt(2) with a c_int value and its size.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

pub(super) fn align4(len: usize) -> usize {
    (len + 3) & !3
}

pub(super) fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}

pub(super) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The link notifications among the netlink messages of one datagram.
fn parse(mut buf: &[u8], out: &mut Vec<LinkEvent>) {
    while buf.len() >= NLMSG_HDRLEN {
        let len = u32_at(buf, 0) as usize;
        if len < NLMSG_HDRLEN || len > buf.len() {
            return;
        }
        if let Some(event) = parse_link(u16_at(buf, 4), &buf[NLMSG_HDRLEN..len]) {
            out.push(event);
        }
        buf = &buf[align4(len).min(buf.len())..];
    }
}

/// An RTM_NEWLINK or RTM_DELLINK message body (`struct ifinfomsg`, then attributes), or an
/// address notification.
fn parse_link(kind: u16, body: &[u8]) -> Option<LinkEvent> {
    if kind == libc::RTM_NEWADDR || kind == libc::RTM_DELADDR {
        return Some(LinkEvent::Addresses);
    }
    if !(kind == libc::RTM_NEWLINK || kind == libc::RTM_DELLINK) || body.len() < IFINFOMSG_LEN {
        return None;
    }
    // A bridge also sends these about its ports (family AF_BRIDGE), with RTM_DELLINK when a
    // port merely leaves the bridge: only the interface's own (AF_UNSPEC) count.
    if body[0] != libc::AF_UNSPEC as u8 {
        return None;
    }
    let index = u32_at(body, 4);
    if kind == libc::RTM_DELLINK {
        return Some(LinkEvent::Removed { index });
    }
    let attrs = attributes(&body[IFINFOMSG_LEN..]);
    let name = attrs.iter().find(|(kind, _)| *kind == IFLA_IFNAME)?.1;
    let name = name.split(|&b| b == 0).next().unwrap_or_default();
    Some(LinkEvent::Changed {
        index,
        name: String::from_utf8_lossy(name).into_owned(),
        master: master_of(&attrs),
    })
}

/// The netlink attributes (type without its flag bits, payload) in `attrs`, up to the first
/// malformed one.
fn attributes(mut attrs: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while attrs.len() >= 4 {
        let len = u16_at(attrs, 0) as usize;
        if len < 4 || len > attrs.len() {
            break;
        }
        out.push((u16_at(attrs, 2) & !NLA_FLAGS, &attrs[4..len]));
        attrs = &attrs[align4(len).min(attrs.len())..];
    }
    out
}

/// The IFLA_MASTER of a link message's attributes.
fn master_of(attrs: &[(u16, &[u8])]) -> Option<u32> {
    attrs
        .iter()
        .find(|(kind, value)| *kind == IFLA_MASTER && value.len() >= 4)
        .map(|(_, value)| u32_at(value, 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A netlink message: header, ifinfomsg, attributes (type, payload).
    fn message(kind: u16, family: u8, index: u32, attrs: &[(u16, &[u8])]) -> Vec<u8> {
        let mut body = vec![family, 0, 0, 0];
        body.extend(index.to_ne_bytes());
        body.extend([0; 8]); // flags, change
        for (kind, payload) in attrs {
            body.extend((4 + payload.len() as u16).to_ne_bytes());
            body.extend(kind.to_ne_bytes());
            body.extend(*payload);
            body.resize(align4(body.len()), 0);
        }
        let mut msg = ((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes().to_vec();
        msg.extend(kind.to_ne_bytes());
        msg.extend([0; 10]); // flags, seq, pid
        msg.extend(body);
        msg
    }

    #[test]
    fn link_notifications() {
        let mtu = 1500u32.to_ne_bytes();
        let mut datagram = message(
            libc::RTM_NEWLINK,
            0,
            7,
            &[
                (4, &mtu),
                (IFLA_IFNAME, b"veth-a\0"),
                (IFLA_MASTER, &3u32.to_ne_bytes()),
            ],
        );
        // Two messages in one datagram; the second is another kind of message.
        datagram.extend(message(libc::RTM_NEWROUTE, 0, 7, &[]));
        let mut out = Vec::new();
        parse(&datagram, &mut out);
        parse(&message(libc::RTM_DELLINK, 0, 7, &[]), &mut out);
        // A bridge port's notifications are not the interface's.
        parse(&message(libc::RTM_DELLINK, 7, 8, &[]), &mut out);
        // Truncated: ignored, not a panic.
        parse(&datagram[..datagram.len() - 40], &mut out);
        parse(&datagram[..10], &mut out);
        // An address added (its body is not read).
        parse(&message(libc::RTM_NEWADDR, 2, 7, &[]), &mut out);
        assert_eq!(
            out,
            [
                LinkEvent::Changed {
                    index: 7,
                    name: "veth-a".into(),
                    master: Some(3),
                },
                LinkEvent::Removed { index: 7 },
                LinkEvent::Addresses,
            ]
        );
    }
}
