//! Host-network clients (processes in the node's own network namespace: kubelet probes,
//! host-network pods, the agent itself) reach services by socket-level translation, as Cilium's
//! socket LB does: connect() and sendmsg() to a service address get a backend's address
//! instead, before any packet exists, so the connection is translated once and its packets need
//! no NAT. The choice is recorded per socket, so that recvmsg() and getpeername() show the
//! service address again (a UDP client may check where replies come from).
//!
//! IPv6 sockets: connect6, sendmsg6, recvmsg6 and getpeername6 translate IPv6 service
//! addresses in the IPv6 maps (SOCK_REVNAT6 for the reverse), and IPv4 services reached through
//! IPv4-mapped addresses (`::ffff:10.96.0.1`, what Java's sockets use by default) in the IPv4
//! maps, exactly as their IPv4 twins do. (An unconnected IPv6 socket's datagram to a mapped
//! address goes through the kernel's IPv4 send path, and so through sendmsg4.)
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
    maps::LruHashMap,
    programs::SockAddrContext,
};
use proxy_common::{
    Be16, Be32, Be128, CtKey, DROP_NO_LOCAL_ENDPOINTS, DROP_SOURCE_RANGE, HOST_NETNS_COOKIE,
    HOST_NETNS_PODS_TOO, IPPROTO_TCP, SERVICE_AFFINITY, SERVICE_DRAINING, SERVICE_LOCAL_ONLY,
    SERVICE_SOURCE_RANGES, ServiceValue, SockRevNatKey, SockRevNatValue, flow_hash,
};

use crate::{
    family::Family,
    frontend, lb,
    maps::{DROPS, HOST_NETNS, SOCK_REVNAT, SOCK_REVNAT6},
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

/// Which address field of the socket context a program reads and writes.
#[derive(Clone, Copy)]
pub enum AddrField {
    /// `user_ip4` (connect4, sendmsg4, recvmsg4, getpeername4).
    Ipv4,
    /// `user_ip6` (connect6, sendmsg6, recvmsg6, getpeername6).
    Ipv6,
}

/// The first three words of an IPv4-mapped IPv6 address (`::ffff:0:0/96`), as the context
/// holds them (network byte order).
const V4_MAPPED_PREFIX: [u32; 3] = [0, 0, u32::from_ne_bytes([0, 0, 0xff, 0xff])];

/// An address family as the socket programs see it: where its addresses are in the context,
/// and its reverse map.
pub trait SockFamily: Family {
    /// The address of this family in the context's `field`, if it holds one: IPv4 in
    /// `user_ip4` or IPv4-mapped in `user_ip6`; IPv6 in `user_ip6`, not IPv4-mapped.
    fn addr(field: AddrField, sa: &bpf_sock_addr) -> Option<Self>;
    /// Writes `addr` into `field`, which [`SockFamily::addr`] found holding one.
    fn set_addr(field: AddrField, sa: &mut bpf_sock_addr, addr: Self);
    fn revnat() -> &'static LruHashMap<SockRevNatKey<Self>, SockRevNatValue<Self>>;
}

/// The first three words of `user_ip6`.
#[inline(always)]
fn ip6_prefix(sa: &bpf_sock_addr) -> [u32; 3] {
    [
        read(&sa.user_ip6[0]),
        read(&sa.user_ip6[1]),
        read(&sa.user_ip6[2]),
    ]
}

impl SockFamily for Be32 {
    #[inline(always)]
    fn addr(field: AddrField, sa: &bpf_sock_addr) -> Option<Self> {
        match field {
            AddrField::Ipv4 => Some(Be32::from_raw(read(&sa.user_ip4))),
            AddrField::Ipv6 => {
                (ip6_prefix(sa) == V4_MAPPED_PREFIX).then(|| Be32::from_raw(read(&sa.user_ip6[3])))
            }
        }
    }

    #[inline(always)]
    fn set_addr(field: AddrField, sa: &mut bpf_sock_addr, addr: Self) {
        match field {
            AddrField::Ipv4 => sa.user_ip4 = addr.raw(),
            AddrField::Ipv6 => sa.user_ip6[3] = addr.raw(),
        }
    }

    #[inline(always)]
    fn revnat() -> &'static LruHashMap<SockRevNatKey<Self>, SockRevNatValue<Self>> {
        &SOCK_REVNAT
    }
}

impl SockFamily for Be128 {
    #[inline(always)]
    fn addr(field: AddrField, sa: &bpf_sock_addr) -> Option<Self> {
        let prefix = ip6_prefix(sa);
        match field {
            AddrField::Ipv6 if prefix != V4_MAPPED_PREFIX => Some(Be128::from_raw([
                prefix[0],
                prefix[1],
                prefix[2],
                read(&sa.user_ip6[3]),
            ])),
            _ => None,
        }
    }

    #[inline(always)]
    fn set_addr(_field: AddrField, sa: &mut bpf_sock_addr, addr: Self) {
        // Word by word at constant offsets from the context: the verifier refuses a store
        // through a pointer derived from it, which a whole-array copy may become.
        let [a, b, c, d] = addr.raw();
        // SAFETY: writable fields of the context.
        unsafe {
            core::ptr::write_volatile(&mut sa.user_ip6[0], a);
            core::ptr::write_volatile(&mut sa.user_ip6[1], b);
            core::ptr::write_volatile(&mut sa.user_ip6[2], c);
            core::ptr::write_volatile(&mut sa.user_ip6[3], d);
        }
    }

    #[inline(always)]
    fn revnat() -> &'static LruHashMap<SockRevNatKey<Self>, SockRevNatValue<Self>> {
        &SOCK_REVNAT6
    }
}

/// Whether the context's `user_ip6` holds an IPv4-mapped address (served by the IPv4 maps).
#[inline(always)]
pub fn ipv4_mapped(ctx: &SockAddrContext) -> bool {
    // SAFETY: the kernel passes a valid context, whose `user_ip6` IPv6 hooks may read.
    ip6_prefix(unsafe { &*ctx.sock_addr }) == V4_MAPPED_PREFIX
}

/// connect4 and sendmsg4, connect6 and sendmsg6 (IPv4-mapped addresses in the IPv4 maps, see
/// [`SockFamily`]): a TCP or UDP service address of a host-network socket (or a pod's TCP one,
/// see [`client`]) becomes one of the service's backends, picked as the tc path picks one for a
/// new flow (lb.rs).
/// `datagram` (sendmsg4: an unconnected UDP socket's send): the pick is the socket's own, so
/// that its datagrams to one Service go to one backend while the Service's backends stay the
/// same, as a connected socket's do.
#[inline(always)]
pub fn translate<A: SockFamily>(ctx: &SockAddrContext, field: AddrField, datagram: bool) -> i32 {
    match try_translate::<A>(ctx, field, datagram) {
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
fn try_translate<A: SockFamily>(
    ctx: &SockAddrContext,
    field: AddrField,
    datagram: bool,
) -> Result<i32, Drop> {
    // SAFETY: the kernel passes a valid context; the fields used are readable (and the
    // address and port writable) for connect4, sendmsg4, connect6 and sendmsg6.
    let sa = unsafe { &mut *ctx.sock_addr };
    let Some(vip) = A::addr(field, sa) else {
        return Ok(ALLOW); // an address of the other family: not served here
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
    if host && frontend::source_refused(&svc_key, &svc, A::primary_addr()) {
        return Err(Drop(DROP_SOURCE_RANGE));
    }
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // The flow as the tc path would see it, but for its source, not chosen yet: the node (the
    // unspecified address: at connect() the source is not chosen yet, and to kube-proxy every
    // such client is the node itself; no pod sends from it, so the affinity entries of such
    // clients never mix with pods'), and the socket's cookie for the port, so that Maglev
    // spreads sockets (and like `datagram`'s pick keeps an unconnected UDP socket's datagrams on
    // one backend).
    let flow = CtKey {
        saddr: A::default(),
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
    let key = SockRevNatKey::new(cookie, backend.addr, backend.port);
    let value = SockRevNatValue {
        addr: vip,
        port: vport,
        pad: 0,
    };
    // Recorded before the rewrite, so no reply can come before it. LRU: when full, the least
    // recently used sockets lose it (getpeername and UDP receives then show the backend).
    let _ = A::revnat().insert(key, value, 0);
    A::set_addr(field, sa, backend.addr);
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

/// recvmsg4 and getpeername4, recvmsg6 and getpeername6: a backend
/// address this socket was sent to in place of a service address shows as that service
/// address. The kernel requires these programs to return 1.
#[inline(always)]
pub fn reverse<A: SockFamily>(ctx: &SockAddrContext, field: AddrField) -> i32 {
    // SAFETY: as in try_translate; the address and port are writable for these hooks too.
    let sa = unsafe { &mut *ctx.sock_addr };
    let Some(addr) = A::addr(field, sa) else {
        return ALLOW;
    };
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let key = SockRevNatKey::new(cookie, addr, port(read(&sa.user_port)));
    // SAFETY: plain data, written whole.
    if let Some(service) = unsafe { A::revnat().get(key) } {
        A::set_addr(field, sa, service.addr);
        sa.user_port = u32::from(service.port.raw());
    }
    ALLOW
}
