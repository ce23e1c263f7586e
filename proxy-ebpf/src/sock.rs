//! Host-network clients (processes in the node's own network namespace: kubelet probes,
//! host-network pods, the agent itself) reach services by socket-level translation, as Cilium's
//! socket LB does: connect() and sendmsg() to a service address get a backend's address
//! instead, before any packet exists, so the connection is translated once and its packets need
//! no NAT. The choice is recorded per socket, so that recvmsg() and getpeername() show the
//! service address again (a UDP client may check where replies come from).
//!
//! IPv6 sockets reach IPv4 services through IPv4-mapped addresses (`::ffff:10.96.0.1`, what
//! Java's sockets use by default): connect6, recvmsg6 and getpeername6 translate those in the
//! IPv4 maps, exactly as their IPv4 twins do. (An unconnected IPv6 socket's datagram to a
//! mapped address goes through the kernel's IPv4 send path, and so through sendmsg4.)
//!
//! Sockets of the node's own network namespace are translated; pods' TCP connections too with
//! `--bpf-socket-lb all` (Cilium's socket LB for pods), so that their packets need no NAT
//! either. Whatever a pod's socket is not translated for here, the tc programs translate per
//! packet, exactly as they would have: its UDP (a connected socket would keep a gone endpoint;
//! the tc path follows endpoint changes), Services with session affinity (kube-proxy's is by
//! the pod's address, not known at connect()) or loadBalancerSourceRanges (likewise), and
//! connections the tc path refuses or drops (no usable endpoint), which it answers as
//! kube-proxy does.
use aya_ebpf::{
    EbpfContext,
    bindings::bpf_sock_addr,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_ktime_get_ns, bpf_set_retval},
    programs::SockAddrContext,
};
use proxy_common::{
    Be16, Be32, CtKey, DROP_NO_LOCAL_ENDPOINTS, DROP_SOURCE_RANGE, HOST_NETNS_COOKIE,
    HOST_NETNS_PODS_TOO, IPPROTO_TCP, SERVICE_AFFINITY, SERVICE_DRAINING, SERVICE_LOCAL_ONLY,
    SERVICE_SOURCE_RANGES, ServiceValue, SockRevNatKey, SockRevNatValue, flow_hash,
};

use crate::{
    family::Family,
    frontend, lb,
    maps::{DROPS, HOST_NETNS, SOCK_REVNAT},
    packet::Drop,
};

/// The call goes on (with the address as the program left it).
const ALLOW: i32 = 1;
/// The call fails with EPERM, or with what bpf_set_retval set.
const REFUSE: i32 = 0;
/// What a refused connect() or sendmsg() returns (bpf_set_retval takes it negated).
const ECONNREFUSED: i32 = 111;

/// Whether this kernel has `bpf_set_retval` (Linux 5.18), set by the agent at load (a constant
/// of the loaded program: where it is 0 the verifier removes the call as dead code). Without it
/// a refused connect() or sendmsg() fails with EPERM instead of ECONNREFUSED.
#[unsafe(no_mangle)]
static HAS_SET_RETVAL: u8 = 1;

/// The source address of host-network clients for backend selection (their client in the
/// affinity map): at connect() the source is not chosen yet, and to kube-proxy every such
/// client is the node itself. No pod sends from 0.0.0.0, so their entries never mix with pods'.
/// Pods' connections translated here use it too, for Maglev's hash only (their Services have
/// no affinity).
const HOST_CLIENT: Be32 = Be32::new(0);

/// Which address field of the socket context a program reads and writes.
#[derive(Clone, Copy)]
pub enum AddrField {
    /// `user_ip4` (connect4, sendmsg4, recvmsg4, getpeername4).
    Ipv4,
    /// `user_ip6`, when it holds an IPv4-mapped address (connect6, recvmsg6, getpeername6);
    /// any other IPv6 address is left as it is.
    Ipv4Mapped,
}

/// The first three words of an IPv4-mapped IPv6 address (`::ffff:0:0/96`), as the context
/// holds them (network byte order).
const V4_MAPPED_PREFIX: [u32; 3] = [0, 0, u32::from_ne_bytes([0, 0, 0xff, 0xff])];

impl AddrField {
    /// The IPv4 address in the context's address field, if it holds one.
    #[inline(always)]
    fn addr(self, sa: &bpf_sock_addr) -> Option<Be32> {
        match self {
            AddrField::Ipv4 => Some(Be32::from_raw(read(&sa.user_ip4))),
            AddrField::Ipv4Mapped => {
                let prefix = [
                    read(&sa.user_ip6[0]),
                    read(&sa.user_ip6[1]),
                    read(&sa.user_ip6[2]),
                ];
                (prefix == V4_MAPPED_PREFIX).then(|| Be32::from_raw(read(&sa.user_ip6[3])))
            }
        }
    }

    /// Writes the IPv4 address `addr` into the context's address field (which
    /// [`AddrField::addr`] found holding one).
    #[inline(always)]
    fn set_addr(self, sa: &mut bpf_sock_addr, addr: Be32) {
        match self {
            AddrField::Ipv4 => sa.user_ip4 = addr.raw(),
            AddrField::Ipv4Mapped => sa.user_ip6[3] = addr.raw(),
        }
    }
}

/// connect4 and sendmsg4 (and connect6 for IPv4-mapped addresses, see [`AddrField`]): a TCP or
/// UDP service address of a host-network socket (or a pod's TCP one, see [`client`]) becomes
/// one of the service's backends, picked as the tc path picks one for a new flow (lb.rs).
/// `datagram` (sendmsg4: an unconnected UDP socket's send): the pick is the socket's own, so
/// that its datagrams to one Service go to one backend while the Service's backends stay the
/// same, as a connected socket's do.
#[inline(always)]
pub fn translate(ctx: &SockAddrContext, field: AddrField, datagram: bool) -> i32 {
    match try_translate(ctx, field, datagram) {
        Ok(verdict) => verdict,
        Err(Drop(reason)) => {
            // Counted with the tc path's drops: a refused connect() is this path's drop.
            if let Some(count) = DROPS.get_ptr_mut(reason) {
                // SAFETY: a per-CPU value: no other program touches it while this one runs here.
                unsafe { *count += 1 };
            }
            REFUSE
        }
    }
}

#[inline(always)]
fn try_translate(ctx: &SockAddrContext, field: AddrField, datagram: bool) -> Result<i32, Drop> {
    // SAFETY: the kernel passes a valid context; the fields used are readable (and the
    // address and port writable) for connect4, sendmsg4 and connect6.
    let sa = unsafe { &mut *ctx.sock_addr };
    let Some(vip) = field.addr(sa) else {
        return Ok(ALLOW); // an IPv6 address: not served here
    };
    // Protocol numbers fit a byte; other than TCP and UDP, the lookup below finds nothing.
    let proto = read(&sa.protocol) as u8;
    let vport = port(read(&sa.user_port));
    let Some((svc_key, svc)) = frontend::internal(vip, vport, proto) else {
        return Ok(ALLOW); // not a service
    };
    let host = match client(ctx) {
        Some(Client::Host) => true,
        Some(Client::Pod) if pod_translated(proto, &svc) => false,
        // Left to the tc programs, which translate its packets.
        _ => return Ok(ALLOW),
    };
    // loadBalancerSourceRanges: the connection would leave from the node's primary address
    // (the source is not chosen yet), which must be within them, as with kube-proxy's rules.
    if host && frontend::source_refused(&svc_key, &svc, Be32::primary_addr()) {
        return Err(Drop(DROP_SOURCE_RANGE));
    }
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // The flow as the tc path would see it, but for its source, not chosen yet: the node (see
    // HOST_CLIENT), and the socket's cookie for the port, so that Maglev spreads sockets (and
    // like `datagram`'s pick keeps an unconnected UDP socket's datagrams on one backend).
    let flow = CtKey {
        saddr: HOST_CLIENT,
        daddr: vip,
        sport: Be16::from_raw(cookie as u16),
        dport: vport,
        proto,
        pad: [0; 3],
    };
    let now = unsafe { bpf_ktime_get_ns() };
    let choice = if datagram {
        flow_hash(&flow)
    } else {
        lb::random()
    };
    let picked = match lb::new_flow_backend(&flow, &svc_key, &svc, now, choice) {
        Ok(Some(picked)) => Some(picked),
        // The tc path refuses or drops the pod's SYN as kube-proxy's rules would.
        Ok(None) | Err(_) if !host => return Ok(ALLOW),
        Ok(None) => None,
        Err(drop) => return Err(drop),
    };
    let Some((_, backend)) = picked else {
        if svc.flags & SERVICE_LOCAL_ONLY != 0 {
            // The tc path drops such packets; a socket is told at once instead.
            return Err(Drop(DROP_NO_LOCAL_ENDPOINTS));
        }
        if svc.flags & SERVICE_DRAINING != 0 {
            return Ok(ALLOW); // a removed service: as if it were not there
        }
        // No usable endpoint: refused at once, as kube-proxy's REJECT rules make it (the tc
        // path answers pods with an ICMP port unreachable to the same effect).
        // SAFETY: a read of a constant; a helper with a plain integer argument.
        if unsafe { core::ptr::read_volatile(&HAS_SET_RETVAL) } != 0 {
            unsafe { bpf_set_retval(-ECONNREFUSED) };
        }
        return Ok(REFUSE);
    };
    let key = SockRevNatKey {
        cookie,
        addr: backend.addr,
        port: backend.port,
        pad: 0,
    };
    let value = SockRevNatValue {
        addr: vip,
        port: vport,
        pad: 0,
    };
    // Recorded before the rewrite, so no reply can come before it. LRU: when full, the least
    // recently used sockets lose it (getpeername and UDP receives then show the backend).
    let _ = SOCK_REVNAT.insert(key, value, 0);
    field.set_addr(sa, backend.addr);
    sa.user_port = u32::from(backend.port.raw());
    Ok(ALLOW)
}

/// Reads a context field whole: the verifier refuses narrower loads of some of them, which the
/// compiler would otherwise make where only a byte or two is used.
#[inline(always)]
fn read(field: &u32) -> u32 {
    // SAFETY: a reference to a readable context field.
    unsafe { core::ptr::read_volatile(field) }
}

/// The port of a `user_port` field: network byte order, in its first two bytes.
#[inline(always)]
fn port(field: u32) -> Be16 {
    Be16::from_raw(field as u16)
}

/// Whose socket a socket program sees.
enum Client {
    /// The node's own network namespace's.
    Host,
    /// Another namespace's (a pod's), with `--bpf-socket-lb all`.
    Pod,
}

/// Whose socket this is, if its connections are translated here: a socket of the node's own
/// network namespace, whose cookie the agent wrote into [`HOST_NETNS`] (0, never a namespace's
/// cookie, until it has), or another's if the agent said pods' are translated too.
#[inline(always)]
fn client(ctx: &SockAddrContext) -> Option<Client> {
    let host = HOST_NETNS.get(HOST_NETNS_COOKIE).copied().unwrap_or(0);
    if host == 0 {
        return None;
    }
    if unsafe { bpf_get_netns_cookie(ctx.as_ptr()) } == host {
        return Some(Client::Host);
    }
    let pods_too = HOST_NETNS.get(HOST_NETNS_PODS_TOO).copied().unwrap_or(0) != 0;
    pods_too.then_some(Client::Pod)
}

/// Whether a pod's `proto` connection to the frontend `svc` is translated here (see the
/// module's comment for what is left to the tc programs).
#[inline(always)]
fn pod_translated(proto: u8, svc: &ServiceValue) -> bool {
    proto == IPPROTO_TCP && svc.flags & (SERVICE_AFFINITY | SERVICE_SOURCE_RANGES) == 0
}

/// recvmsg4 and getpeername4 (and their IPv6 twins for IPv4-mapped addresses): a backend
/// address this socket was sent to in place of a service address shows as that service
/// address. The kernel requires these programs to return 1.
#[inline(always)]
pub fn reverse(ctx: &SockAddrContext, field: AddrField) -> i32 {
    // SAFETY: as in try_translate; the address and port are writable for these hooks too.
    let sa = unsafe { &mut *ctx.sock_addr };
    let Some(addr) = field.addr(sa) else {
        return ALLOW;
    };
    let key = SockRevNatKey {
        cookie: unsafe { bpf_get_socket_cookie(ctx.as_ptr()) },
        addr,
        port: port(read(&sa.user_port)),
        pad: 0,
    };
    // SAFETY: plain data, written whole.
    if let Some(service) = unsafe { SOCK_REVNAT.get(key) } {
        field.set_addr(sa, service.addr);
        sa.user_port = u32::from(service.port.raw());
    }
    ALLOW
}
