//! The kernel's IPVS table through generic netlink (family "IPVS", as ipvsadm and kube-proxy's
//! libipvs talk to it): a small typed layer over a raw `NETLINK_GENERIC` socket, both families.
//!
//! Messages are a netlink header, a generic netlink header (command, version 1) and
//! attributes; a service or destination is one nested attribute (`IPVS_CMD_ATTR_SERVICE`,
//! `IPVS_CMD_ATTR_DEST`) holding its own attributes. Changes are acknowledged requests; the
//! tables are read with dumps. The socket belongs to the network namespace of the thread that
//! opened it (IPVS state is per namespace).
use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

use anyhow::Context;

/// The generic netlink family's name and version.
const FAMILY_NAME: &str = "IPVS";
const VERSION: u8 = 1;

// linux/netlink.h
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_MULTI: u16 = 0x2;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLA_TYPE_MASK: u16 = 0x3fff;
const NLA_F_NESTED: u16 = 0x8000;

// linux/genetlink.h
const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;

// linux/ip_vs.h: commands
const CMD_NEW_SERVICE: u8 = 1;
const CMD_SET_SERVICE: u8 = 2;
const CMD_DEL_SERVICE: u8 = 3;
const CMD_GET_SERVICE: u8 = 4;
const CMD_NEW_DEST: u8 = 5;
const CMD_SET_DEST: u8 = 6;
const CMD_DEL_DEST: u8 = 7;
const CMD_GET_DEST: u8 = 8;
const CMD_SET_CONFIG: u8 = 12;

// IPVS_CMD_ATTR_*
const CMD_ATTR_SERVICE: u16 = 1;
const CMD_ATTR_DEST: u16 = 2;
const CMD_ATTR_TIMEOUT_TCP: u16 = 4;
const CMD_ATTR_TIMEOUT_TCP_FIN: u16 = 5;
const CMD_ATTR_TIMEOUT_UDP: u16 = 6;

// IPVS_SVC_ATTR_*
const SVC_ATTR_AF: u16 = 1;
const SVC_ATTR_PROTOCOL: u16 = 2;
const SVC_ATTR_ADDR: u16 = 3;
const SVC_ATTR_PORT: u16 = 4;
const SVC_ATTR_FWMARK: u16 = 5;
const SVC_ATTR_SCHED_NAME: u16 = 6;
const SVC_ATTR_FLAGS: u16 = 7;
const SVC_ATTR_TIMEOUT: u16 = 8;
const SVC_ATTR_NETMASK: u16 = 9;

// IPVS_DEST_ATTR_*
const DEST_ATTR_ADDR: u16 = 1;
const DEST_ATTR_PORT: u16 = 2;
const DEST_ATTR_FWD_METHOD: u16 = 3;
const DEST_ATTR_WEIGHT: u16 = 4;
const DEST_ATTR_U_THRESH: u16 = 5;
const DEST_ATTR_L_THRESH: u16 = 6;
const DEST_ATTR_ACTIVE_CONNS: u16 = 7;
const DEST_ATTR_INACT_CONNS: u16 = 8;
const DEST_ATTR_ADDR_FAMILY: u16 = 11;

/// `IP_VS_SVC_F_PERSISTENT`: a client's connections go to the destination its first went to
/// while its template lives (sessionAffinity ClientIP).
pub const FLAG_PERSISTENT: u32 = 0x1;
/// `IP_VS_SVC_F_HASHED`: set by the kernel on every service in its table; not ours to compare.
const FLAG_HASHED: u32 = 0x2;
/// `IP_VS_CONN_F_MASQ`: destinations are reached by DNAT (kube-proxy's only forwarding method).
const FWD_MASQ: u32 = 0;

/// A virtual server's identity: address, protocol (IP protocol number) and port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceKey {
    pub addr: IpAddr,
    pub protocol: u8,
    pub port: u16,
}

impl std::fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let proto = match self.protocol {
            6 => "TCP",
            17 => "UDP",
            132 => "SCTP",
            _ => "?",
        };
        write!(
            f,
            "{proto} {}",
            std::net::SocketAddr::new(self.addr, self.port)
        )
    }
}

/// A virtual server: its identity and how it picks destinations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    pub key: ServiceKey,
    /// The scheduler's name (`rr`, `lc`, `sh`...; the kernel loads `ip_vs_<name>`).
    pub scheduler: String,
    /// `IP_VS_SVC_F_*`, without the kernel's own `HASHED`.
    pub flags: u32,
    /// The persistence timeout in seconds (with [`FLAG_PERSISTENT`]).
    pub timeout: u32,
    /// The persistence granularity: clients are told apart by these bits of their address (a
    /// mask for IPv4, a prefix length for IPv6).
    pub netmask: u32,
}

/// A real server (destination) of a virtual server, as the kernel reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dest {
    pub addr: IpAddr,
    pub port: u16,
    pub weight: u32,
    pub active_conns: u32,
    pub inactive_conns: u32,
}

/// IPVS's idle timeouts in seconds (`ipvsadm --set`); zero leaves the kernel's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Timeouts {
    pub tcp: u32,
    pub tcp_fin: u32,
    pub udp: u32,
}

fn timeout_attrs(t: &Timeouts) -> Attrs {
    let mut a = Attrs::default();
    a.u32(CMD_ATTR_TIMEOUT_TCP, t.tcp)
        .u32(CMD_ATTR_TIMEOUT_TCP_FIN, t.tcp_fin)
        .u32(CMD_ATTR_TIMEOUT_UDP, t.udp);
    a
}

/// Attributes being written: each a header (length, type), the value, padding to 4 bytes.
#[derive(Default)]
struct Attrs(Vec<u8>);

impl Attrs {
    fn put(&mut self, kind: u16, value: &[u8]) -> &mut Self {
        let len = 4 + value.len();
        self.0.extend_from_slice(&(len as u16).to_ne_bytes());
        self.0.extend_from_slice(&kind.to_ne_bytes());
        self.0.extend_from_slice(value);
        self.0.resize(self.0.len().next_multiple_of(4), 0);
        self
    }

    fn u16(&mut self, kind: u16, v: u16) -> &mut Self {
        self.put(kind, &v.to_ne_bytes())
    }

    fn u32(&mut self, kind: u16, v: u32) -> &mut Self {
        self.put(kind, &v.to_ne_bytes())
    }

    /// A port, in network byte order (`__be16`).
    fn port(&mut self, kind: u16, port: u16) -> &mut Self {
        self.put(kind, &port.to_be_bytes())
    }

    /// An address as `union nf_inet_addr` (16 bytes, an IPv4 one first).
    fn addr(&mut self, kind: u16, addr: IpAddr) -> &mut Self {
        let mut bytes = [0u8; 16];
        match addr {
            IpAddr::V4(v4) => bytes[..4].copy_from_slice(&v4.octets()),
            IpAddr::V6(v6) => bytes = v6.octets(),
        }
        self.put(kind, &bytes)
    }

    fn string(&mut self, kind: u16, s: &str) -> &mut Self {
        let mut bytes = s.as_bytes().to_vec();
        bytes.push(0);
        self.put(kind, &bytes)
    }

    fn nested(&mut self, kind: u16, inner: &Attrs) -> &mut Self {
        self.put(kind | NLA_F_NESTED, &inner.0)
    }
}

/// A whole request: netlink header, generic netlink header, attributes.
fn message(family: u16, flags: u16, seq: u32, cmd: u8, attrs: &Attrs) -> Vec<u8> {
    let len = 16 + 4 + attrs.0.len();
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&(len as u32).to_ne_bytes());
    out.extend_from_slice(&family.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.extend_from_slice(&[cmd, VERSION, 0, 0]);
    out.extend_from_slice(&attrs.0);
    out
}

/// The address family number of `addr`.
fn af(addr: IpAddr) -> u16 {
    match addr {
        IpAddr::V4(_) => libc::AF_INET as u16,
        IpAddr::V6(_) => libc::AF_INET6 as u16,
    }
}

/// The attributes identifying `key` (`IPVS_SVC_ATTR_AF`, `PROTOCOL`, `ADDR`, `PORT`).
fn service_id(key: &ServiceKey) -> Attrs {
    let mut a = Attrs::default();
    a.u16(SVC_ATTR_AF, af(key.addr))
        .u16(SVC_ATTR_PROTOCOL, u16::from(key.protocol))
        .addr(SVC_ATTR_ADDR, key.addr)
        .port(SVC_ATTR_PORT, key.port);
    a
}

/// The attributes of a whole service, as `IPVS_CMD_NEW_SERVICE`/`SET_SERVICE` need them.
fn service_attrs(svc: &Service) -> Attrs {
    let mut inner = service_id(&svc.key);
    let mut flags = [0u8; 8];
    flags[..4].copy_from_slice(&svc.flags.to_ne_bytes());
    // The mask: every flag is ours to set or clear.
    flags[4..].copy_from_slice(&u32::MAX.to_ne_bytes());
    inner
        .string(SVC_ATTR_SCHED_NAME, &svc.scheduler)
        .put(SVC_ATTR_FLAGS, &flags)
        .u32(SVC_ATTR_TIMEOUT, svc.timeout)
        .u32(SVC_ATTR_NETMASK, svc.netmask);
    let mut outer = Attrs::default();
    outer.nested(CMD_ATTR_SERVICE, &inner);
    outer
}

/// The attributes of a destination of `key`: the service's identity and the destination's.
fn dest_attrs(key: &ServiceKey, addr: IpAddr, port: u16, weight: Option<u32>) -> Attrs {
    let mut dest = Attrs::default();
    dest.addr(DEST_ATTR_ADDR, addr).port(DEST_ATTR_PORT, port);
    if let Some(weight) = weight {
        dest.u32(DEST_ATTR_FWD_METHOD, FWD_MASQ)
            .u32(DEST_ATTR_WEIGHT, weight)
            .u32(DEST_ATTR_U_THRESH, 0)
            .u32(DEST_ATTR_L_THRESH, 0);
    }
    let mut outer = Attrs::default();
    outer
        .nested(CMD_ATTR_SERVICE, &service_id(key))
        .nested(CMD_ATTR_DEST, &dest);
    outer
}

/// Iterates over the attributes in `buf`: (type without the nested/byte-order bits, value).
fn parse_attrs(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if buf.len() < 4 {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([buf[0], buf[1]]));
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            return None;
        }
        let value = &buf[4..len];
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
        Some((kind, value))
    })
}

fn get_u16(v: &[u8]) -> Option<u16> {
    Some(u16::from_ne_bytes(v.get(..2)?.try_into().ok()?))
}

fn get_u32(v: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(v.get(..4)?.try_into().ok()?))
}

fn get_port(v: &[u8]) -> Option<u16> {
    Some(u16::from_be_bytes(v.get(..2)?.try_into().ok()?))
}

/// The `union nf_inet_addr` in `v` as an address of the family numbered `af`.
fn get_addr(v: &[u8], af: u16) -> Option<IpAddr> {
    if af == libc::AF_INET as u16 {
        let b: [u8; 4] = v.get(..4)?.try_into().ok()?;
        Some(Ipv4Addr::from(b).into())
    } else if af == libc::AF_INET6 as u16 {
        let b: [u8; 16] = v.get(..16)?.try_into().ok()?;
        Some(Ipv6Addr::from(b).into())
    } else {
        None
    }
}

/// The service in the attributes of one `GET_SERVICE` reply; None for what this layer does not
/// handle (firewall-mark services).
fn parse_service(attrs: &[u8]) -> Option<Service> {
    let (_, inner) = parse_attrs(attrs).find(|(k, _)| *k == CMD_ATTR_SERVICE)?;
    let (mut af, mut protocol, mut addr, mut port, mut fwmark) = (None, None, None, None, 0);
    let mut svc = Service {
        key: ServiceKey {
            addr: Ipv4Addr::UNSPECIFIED.into(),
            protocol: 0,
            port: 0,
        },
        scheduler: String::new(),
        flags: 0,
        timeout: 0,
        netmask: 0,
    };
    for (kind, v) in parse_attrs(inner) {
        match kind {
            SVC_ATTR_AF => af = get_u16(v),
            SVC_ATTR_PROTOCOL => protocol = get_u16(v),
            SVC_ATTR_ADDR => addr = Some(v),
            SVC_ATTR_PORT => port = get_port(v),
            SVC_ATTR_FWMARK => fwmark = get_u32(v).unwrap_or(0),
            SVC_ATTR_SCHED_NAME => {
                let end = v.iter().position(|b| *b == 0).unwrap_or(v.len());
                svc.scheduler = String::from_utf8_lossy(&v[..end]).into_owned();
            }
            SVC_ATTR_FLAGS => svc.flags = get_u32(v).unwrap_or(0) & !FLAG_HASHED,
            SVC_ATTR_TIMEOUT => svc.timeout = get_u32(v).unwrap_or(0),
            SVC_ATTR_NETMASK => svc.netmask = get_u32(v).unwrap_or(0),
            _ => {}
        }
    }
    if fwmark != 0 {
        return None;
    }
    svc.key = ServiceKey {
        addr: get_addr(addr?, af?)?,
        protocol: u8::try_from(protocol?).ok()?,
        port: port?,
    };
    Some(svc)
}

/// The destination in the attributes of one `GET_DEST` reply of a service of the family
/// numbered `af` (the destination's own, where the kernel says it, wins).
fn parse_dest(attrs: &[u8], mut af: u16) -> Option<Dest> {
    let (_, inner) = parse_attrs(attrs).find(|(k, _)| *k == CMD_ATTR_DEST)?;
    let (mut addr, mut port) = (None, None);
    let mut dest = Dest {
        addr: Ipv4Addr::UNSPECIFIED.into(),
        port: 0,
        weight: 0,
        active_conns: 0,
        inactive_conns: 0,
    };
    for (kind, v) in parse_attrs(inner) {
        match kind {
            DEST_ATTR_ADDR => addr = Some(v),
            DEST_ATTR_ADDR_FAMILY => af = get_u16(v).unwrap_or(af),
            DEST_ATTR_PORT => port = get_port(v),
            DEST_ATTR_WEIGHT => dest.weight = get_u32(v).unwrap_or(0),
            DEST_ATTR_ACTIVE_CONNS => dest.active_conns = get_u32(v).unwrap_or(0),
            DEST_ATTR_INACT_CONNS => dest.inactive_conns = get_u32(v).unwrap_or(0),
            _ => {}
        }
    }
    dest.addr = get_addr(addr?, af)?;
    dest.port = port?;
    Some(dest)
}

/// One message of a reply: its type, flags, sequence number and payload (after the netlink
/// header).
struct Reply<'a> {
    kind: u16,
    flags: u16,
    seq: u32,
    payload: &'a [u8],
}

fn parse_replies(mut buf: &[u8]) -> impl Iterator<Item = Reply<'_>> {
    std::iter::from_fn(move || {
        if buf.len() < 16 {
            return None;
        }
        let len = u32::from_ne_bytes(buf[..4].try_into().ok()?) as usize;
        if len < 16 || len > buf.len() {
            return None;
        }
        let reply = Reply {
            kind: u16::from_ne_bytes([buf[4], buf[5]]),
            flags: u16::from_ne_bytes([buf[6], buf[7]]),
            seq: u32::from_ne_bytes(buf[8..12].try_into().ok()?),
            payload: &buf[16..len],
        };
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
        Some(reply)
    })
}

/// A generic netlink socket talking to the IPVS family.
pub struct Ipvs {
    fd: OwnedFd,
    family: u16,
    seq: u32,
}

/// Why IPVS cannot be used here.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("the kernel has no IPVS (the generic netlink family \"IPVS\" is unknown)")]
    NoIpvs,
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

impl Ipvs {
    /// Opens a socket in the calling thread's network namespace and resolves the family (the
    /// kernel loads `ip_vs` for it if it can).
    pub fn open() -> Result<Self, OpenError> {
        // SAFETY: plain socket(2); the descriptor is owned below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_GENERIC,
            )
        };
        if fd < 0 {
            return Err(anyhow::Error::from(io::Error::last_os_error())
                .context("opening a generic netlink socket")
                .into());
        }
        // SAFETY: fd is a new descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut ipvs = Ipvs {
            fd,
            family: GENL_ID_CTRL,
            seq: 0,
        };
        let mut attrs = Attrs::default();
        attrs.string(CTRL_ATTR_FAMILY_NAME, FAMILY_NAME);
        let replies = match ipvs.request(CTRL_CMD_GETFAMILY, NLM_F_ACK, &attrs) {
            Ok(r) => r,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Err(OpenError::NoIpvs),
            Err(e) => {
                return Err(anyhow::Error::from(e)
                    .context("resolving the generic netlink family IPVS")
                    .into());
            }
        };
        let family = replies
            .iter()
            .flat_map(|r| parse_attrs(r))
            .find(|(k, _)| *k == CTRL_ATTR_FAMILY_ID)
            .and_then(|(_, v)| get_u16(v))
            .context("the kernel's reply about the IPVS family has no id")?;
        ipvs.family = family;
        Ok(ipvs)
    }

    /// Sends one request (acknowledged, or a dump) and collects the attributes of the replies
    /// (after their generic netlink header).
    fn request(&mut self, cmd: u8, flags: u16, attrs: &Attrs) -> io::Result<Vec<Vec<u8>>> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let msg = message(self.family, NLM_F_REQUEST | flags, seq, cmd, attrs);
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as u16;
        // SAFETY: msg and addr outlive the call; the lengths are theirs.
        let sent = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                0,
                (&raw const addr).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: buf is writable for its length.
            let n =
                unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            for reply in parse_replies(&buf[..n as usize]) {
                if reply.seq != seq {
                    continue;
                }
                match reply.kind {
                    NLMSG_ERROR => {
                        let code = reply
                            .payload
                            .get(..4)
                            .map_or(0, |b| i32::from_ne_bytes(b.try_into().unwrap()));
                        if code != 0 {
                            return Err(io::Error::from_raw_os_error(-code));
                        }
                        return Ok(out);
                    }
                    NLMSG_DONE => return Ok(out),
                    _ => {
                        if let Some(attrs) = reply.payload.get(4..) {
                            out.push(attrs.to_vec());
                        }
                        // A reply that is neither part of a dump nor followed by an ack (a
                        // request without NLM_F_ACK) would end here; ours all ask for one.
                        if !dump && reply.flags & NLM_F_MULTI == 0 && flags & NLM_F_ACK == 0 {
                            return Ok(out);
                        }
                    }
                }
            }
        }
    }

    fn change(&mut self, cmd: u8, attrs: &Attrs) -> io::Result<()> {
        self.request(cmd, NLM_F_ACK, attrs).map(drop)
    }

    /// Every virtual server of the namespace, both families (firewall-mark ones left out).
    pub fn services(&mut self) -> anyhow::Result<Vec<Service>> {
        let replies = self
            .request(CMD_GET_SERVICE, NLM_F_DUMP, &Attrs::default())
            .context("listing the IPVS services")?;
        Ok(replies.iter().filter_map(|r| parse_service(r)).collect())
    }

    /// The destinations of `key`.
    pub fn dests(&mut self, key: &ServiceKey) -> anyhow::Result<Vec<Dest>> {
        let mut attrs = Attrs::default();
        attrs.nested(CMD_ATTR_SERVICE, &service_id(key));
        let replies = self
            .request(CMD_GET_DEST, NLM_F_DUMP, &attrs)
            .with_context(|| format!("listing the destinations of IPVS service {key}"))?;
        let family = af(key.addr);
        Ok(replies
            .iter()
            .filter_map(|r| parse_dest(r, family))
            .collect())
    }

    pub fn add_service(&mut self, svc: &Service) -> anyhow::Result<()> {
        self.change(CMD_NEW_SERVICE, &service_attrs(svc))
            .map_err(|e| scheduler_hint(e, &svc.scheduler))
            .with_context(|| format!("adding IPVS service {}", svc.key))
    }

    pub fn update_service(&mut self, svc: &Service) -> anyhow::Result<()> {
        self.change(CMD_SET_SERVICE, &service_attrs(svc))
            .map_err(|e| scheduler_hint(e, &svc.scheduler))
            .with_context(|| format!("updating IPVS service {}", svc.key))
    }

    pub fn delete_service(&mut self, key: &ServiceKey) -> anyhow::Result<()> {
        let mut attrs = Attrs::default();
        attrs.nested(CMD_ATTR_SERVICE, &service_id(key));
        self.change(CMD_DEL_SERVICE, &attrs)
            .with_context(|| format!("deleting IPVS service {key}"))
    }

    /// Adds the destination `addr:port` to `key` with `weight`, or sets the weight of the one
    /// there (`update`).
    pub fn put_dest(
        &mut self,
        key: &ServiceKey,
        addr: IpAddr,
        port: u16,
        weight: u32,
        update: bool,
    ) -> anyhow::Result<()> {
        let cmd = if update { CMD_SET_DEST } else { CMD_NEW_DEST };
        self.change(cmd, &dest_attrs(key, addr, port, Some(weight)))
            .with_context(|| format!("setting destination {addr}:{port} of IPVS service {key}"))
    }

    pub fn delete_dest(&mut self, key: &ServiceKey, addr: IpAddr, port: u16) -> anyhow::Result<()> {
        self.change(CMD_DEL_DEST, &dest_attrs(key, addr, port, None))
            .with_context(|| format!("deleting destination {addr}:{port} of IPVS service {key}"))
    }

    /// Sets the idle timeouts (the kernel keeps those given as zero).
    pub fn set_timeouts(&mut self, t: &Timeouts) -> anyhow::Result<()> {
        self.change(CMD_SET_CONFIG, &timeout_attrs(t))
            .context("setting the IPVS timeouts")
    }
}

/// ENOENT from adding a service means the scheduler is unknown: say which module provides it.
fn scheduler_hint(e: io::Error, scheduler: &str) -> anyhow::Error {
    if e.raw_os_error() == Some(libc::ENOENT) {
        anyhow::anyhow!(
            "{e}: the kernel has no IPVS scheduler {scheduler:?} (module ip_vs_{scheduler})"
        )
    } else {
        e.into()
    }
}

/// Whether IPVS is loaded in the calling thread's network namespace, without loading it
/// (`/proc/net/ip_vs` exists once the module is in).
pub fn loaded() -> bool {
    std::path::Path::new("/proc/thread-self/net/ip_vs").exists()
}

/// Checks a reply's length makes sense (used by the tests).
#[cfg(test)]
fn check_len(msg: &[u8]) -> anyhow::Result<()> {
    let len = u32::from_ne_bytes(msg[..4].try_into()?) as usize;
    anyhow::ensure!(len == msg.len(), "length {len} != {}", msg.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> ServiceKey {
        ServiceKey {
            addr: Ipv4Addr::new(10, 96, 0, 10).into(),
            protocol: 6,
            port: 80,
        }
    }

    /// `IPVS_CMD_NEW_SERVICE` for TCP 10.96.0.10:80, rr, persistent for 10800 s, byte by byte
    /// (x86's little-endian host order; ports in network order).
    #[test]
    fn new_service_encodes_as_the_kernel_expects() {
        let svc = Service {
            key: key(),
            scheduler: "rr".into(),
            flags: FLAG_PERSISTENT,
            timeout: 10800,
            netmask: 0xffff_ffff,
        };
        let msg = message(
            0x22,
            NLM_F_REQUEST | NLM_F_ACK,
            7,
            CMD_NEW_SERVICE,
            &service_attrs(&svc),
        );
        check_len(&msg).unwrap();
        #[rustfmt::skip]
        let want: &[u8] = &[
            // nlmsghdr: length 104, type 0x22, flags REQUEST|ACK, seq 7, pid 0
            104, 0, 0, 0, 0x22, 0, 5, 0, 7, 0, 0, 0, 0, 0, 0, 0,
            // genlmsghdr: cmd NEW_SERVICE, version 1
            1, 1, 0, 0,
            // IPVS_CMD_ATTR_SERVICE, nested: 4 + 80 bytes
            84, 0, 1, 0x80,
            // AF = AF_INET
            6, 0, 1, 0, 2, 0, 0, 0,
            // PROTOCOL = 6
            6, 0, 2, 0, 6, 0, 0, 0,
            // ADDR = 10.96.0.10 as nf_inet_addr
            20, 0, 3, 0, 10, 96, 0, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            // PORT = 80, big-endian
            6, 0, 4, 0, 0, 80, 0, 0,
            // SCHED_NAME = "rr\0"
            7, 0, 6, 0, b'r', b'r', 0, 0,
            // FLAGS = {PERSISTENT, mask all}
            12, 0, 7, 0, 1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff,
            // TIMEOUT = 10800 (0x2a30)
            8, 0, 8, 0, 0x30, 0x2a, 0, 0,
            // NETMASK
            8, 0, 9, 0, 0xff, 0xff, 0xff, 0xff,
        ];
        assert_eq!(msg, want);
    }

    #[test]
    fn dest_encodes_as_the_kernel_expects() {
        let ep = Ipv4Addr::new(10, 244, 1, 11).into();
        let attrs = dest_attrs(&key(), ep, 8080, Some(1));
        #[rustfmt::skip]
        let want: &[u8] = &[
            // the service's identity
            48, 0, 1, 0x80,
            6, 0, 1, 0, 2, 0, 0, 0,
            6, 0, 2, 0, 6, 0, 0, 0,
            20, 0, 3, 0, 10, 96, 0, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            6, 0, 4, 0, 0, 80, 0, 0,
            // IPVS_CMD_ATTR_DEST
            64, 0, 2, 0x80,
            20, 0, 1, 0, 10, 244, 1, 11, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            // PORT = 8080 (0x1f90)
            6, 0, 2, 0, 0x1f, 0x90, 0, 0,
            // FWD_METHOD = masq
            8, 0, 3, 0, 0, 0, 0, 0,
            // WEIGHT = 1
            8, 0, 4, 0, 1, 0, 0, 0,
            // U_THRESH, L_THRESH = 0
            8, 0, 5, 0, 0, 0, 0, 0,
            8, 0, 6, 0, 0, 0, 0, 0,
        ];
        assert_eq!(attrs.0, want);
        let delete = dest_attrs(&key(), ep, 8080, None);
        assert_eq!(
            &delete.0[48..52],
            &[32, 0, 2, 0x80],
            "address and port only"
        );
    }

    #[test]
    fn timeouts_encode() {
        let t = Timeouts {
            tcp: 900,
            tcp_fin: 0,
            udp: 300,
        };
        #[rustfmt::skip]
        let want: &[u8] = &[
            8, 0, 4, 0, 0x84, 0x03, 0, 0,
            8, 0, 5, 0, 0, 0, 0, 0,
            8, 0, 6, 0, 0x2c, 0x01, 0, 0,
        ];
        assert_eq!(timeout_attrs(&t).0, want);
    }

    /// A `GET_SERVICE` dump reply as the kernel writes it (with statistics and the HASHED flag),
    /// and a firewall-mark service, which is skipped.
    #[test]
    fn service_replies_decode() {
        let mut inner = service_id(&key());
        inner
            .string(SVC_ATTR_SCHED_NAME, "sh")
            .put(SVC_ATTR_FLAGS, &[3, 0, 0, 0, 0xff, 0xff, 0xff, 0xff])
            .u32(SVC_ATTR_TIMEOUT, 300)
            .u32(SVC_ATTR_NETMASK, 0xffff_ffff)
            .nested(10, Attrs::default().u32(1, 5));
        let mut outer = Attrs::default();
        outer.nested(CMD_ATTR_SERVICE, &inner);
        assert_eq!(
            parse_service(&outer.0),
            Some(Service {
                key: key(),
                scheduler: "sh".into(),
                flags: FLAG_PERSISTENT,
                timeout: 300,
                netmask: 0xffff_ffff,
            })
        );
        let mut fwmark = Attrs::default();
        fwmark.u16(SVC_ATTR_AF, 2).u32(SVC_ATTR_FWMARK, 9);
        let mut outer = Attrs::default();
        outer.nested(CMD_ATTR_SERVICE, &fwmark);
        assert_eq!(parse_service(&outer.0), None);
    }

    #[test]
    fn dest_replies_decode() {
        #[rustfmt::skip]
        let reply: &[u8] = &[
            56, 0, 2, 0x80,
            20, 0, 1, 0, 10, 244, 1, 11, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            6, 0, 2, 0, 0x1f, 0x90, 0, 0,
            8, 0, 4, 0, 0, 0, 0, 0,
            8, 0, 7, 0, 3, 0, 0, 0,
            8, 0, 8, 0, 2, 0, 0, 0,
        ];
        assert_eq!(
            parse_dest(reply, libc::AF_INET as u16),
            Some(Dest {
                addr: Ipv4Addr::new(10, 244, 1, 11).into(),
                port: 8080,
                weight: 0,
                active_conns: 3,
                inactive_conns: 2,
            })
        );
    }

    /// An IPv6 virtual server and destination: AF_INET6, the whole 16 bytes of each address,
    /// and back.
    #[test]
    fn ipv6_encodes_and_decodes() {
        let vip: IpAddr = "fd00:10:96::a".parse().unwrap();
        let key = ServiceKey {
            addr: vip,
            protocol: 17,
            port: 53,
        };
        let id = service_id(&key);
        #[rustfmt::skip]
        let want: &[u8] = &[
            // AF = AF_INET6 (10)
            6, 0, 1, 0, 10, 0, 0, 0,
            6, 0, 2, 0, 17, 0, 0, 0,
            20, 0, 3, 0, 0xfd, 0, 0, 0x10, 0, 0x96, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x0a,
            6, 0, 4, 0, 0, 53, 0, 0,
        ];
        assert_eq!(id.0, want);
        let mut inner = id;
        inner
            .string(SVC_ATTR_SCHED_NAME, "rr")
            .u32(SVC_ATTR_NETMASK, 128);
        let mut outer = Attrs::default();
        outer.nested(CMD_ATTR_SERVICE, &inner);
        let parsed = parse_service(&outer.0).unwrap();
        assert_eq!((parsed.key, parsed.netmask), (key, 128));

        let ep: IpAddr = "fd00:10:244:1::11".parse().unwrap();
        let attrs = dest_attrs(&key, ep, 5353, Some(1));
        let parsed = parse_dest(&attrs.0, libc::AF_INET6 as u16).unwrap();
        assert_eq!((parsed.addr, parsed.port), (ep, 5353));
    }

    /// Several messages in one datagram: an ack's error code and the end of a dump.
    #[test]
    fn replies_split_and_errors_decode() {
        #[rustfmt::skip]
        let buf: &[u8] = &[
            // NLMSG_ERROR, seq 3, error -EEXIST (-17), then the request's header
            36, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0,
            0xef, 0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            // NLMSG_DONE, seq 4
            20, 0, 0, 0, 3, 0, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ];
        let replies: Vec<_> = parse_replies(buf).collect();
        assert_eq!(replies.len(), 2);
        assert_eq!((replies[0].kind, replies[0].seq), (NLMSG_ERROR, 3));
        assert_eq!(
            i32::from_ne_bytes(replies[0].payload[..4].try_into().unwrap()),
            -libc::EEXIST
        );
        assert_eq!(
            (replies[1].kind, replies[1].flags),
            (NLMSG_DONE, NLM_F_MULTI)
        );
    }
}
