//! The proxy sockets: one per Service port and family (two where the external traffic policy
//! picks other endpoints than the internal one), listening on an ephemeral port of every node
//! address of the family.
//! The iptables rules send the Service's traffic there; the agent opens its own connection to
//! an endpoint and copies the bytes, as kube-proxy's userspace `proxySocket`s did.
//!
//! TCP: each accepted connection is connected to an endpoint ([`connect_with_retries`]), then
//! both directions are copied until both ends have closed (a half-close is passed on). A
//! client for which no endpoint answers is reset.
//!
//! UDP: a "session" per client address (address and port), each with its own connected socket
//! to the endpoint picked for it; replies come back through the Service port's socket, from the
//! node address the client sent to ([`UdpProxySocket`]). A
//! session ends after `udp_timeout` without a datagram in either direction (kube-proxy's
//! `--udp-timeout`), or when the endpoint refuses (ICMP port unreachable); the client's next
//! datagram then opens a new session, to the next endpoint in turn.
//!
//! Closing a proxy socket (the Service port is gone) aborts its task, which closes the socket;
//! TCP connections already proxied carry on (as kube-proxy's did), UDP sessions end (the
//! socket they answer through is closed, as in kube-proxy).
use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::{AsRawFd, RawFd},
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::{
    io::Interest,
    net::{TcpListener, TcpSocket, TcpStream, UdpSocket},
    runtime::Handle,
    task::{AbortHandle, JoinHandle},
};

use super::balancer::{Balancer, connect_with_retries};
use crate::model::{Family, Protocol};

/// The accept backlog of a TCP proxy socket (tokio's default for its listeners).
const BACKLOG: u32 = 1024;
/// The largest UDP payload.
const DATAGRAM: usize = 65_535;

/// What a proxy socket's tasks share with the dataplane.
#[derive(Debug)]
pub struct Shared {
    /// The Service port, for the logs ("ns/name:port", " (external)" for the external
    /// frontends' socket).
    pub name: String,
    /// The endpoint choice; the dataplane replaces its endpoints at each sync.
    pub balancer: Mutex<Balancer>,
}

impl Shared {
    pub fn balancer(&self) -> std::sync::MutexGuard<'_, Balancer> {
        self.balancer.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One open proxy socket. Dropping it closes it.
#[derive(Debug)]
pub struct ProxySocket {
    pub port: u16,
    pub protocol: Protocol,
    pub shared: Arc<Shared>,
    /// The accept (TCP) or receive (UDP) loop, which owns the listening socket.
    task: JoinHandle<()>,
    /// UDP: the sessions, ended with the socket.
    sessions: Option<Arc<Sessions>>,
}

impl ProxySocket {
    /// Opens a proxy socket on an ephemeral port of every address of `family` (0.0.0.0, or
    /// `[::]` for IPv6 only), served on `runtime`. SCTP is not proxied (kube-proxy's userspace
    /// mode did not either).
    pub fn open(
        runtime: &Handle,
        family: Family,
        protocol: Protocol,
        shared: Arc<Shared>,
        udp_timeout: Duration,
    ) -> std::io::Result<Self> {
        let _entered = runtime.enter();
        match protocol {
            Protocol::Tcp => {
                let socket =
                    TcpSocket::from_std_stream(bound(family, socket2::Type::STREAM)?.into());
                let listener = socket.listen(BACKLOG)?;
                let port = listener.local_addr()?.port();
                let task = runtime.spawn(serve_tcp(listener, shared.clone()));
                Ok(Self {
                    port,
                    protocol,
                    shared,
                    task,
                    sessions: None,
                })
            }
            Protocol::Udp => {
                let socket = Arc::new(UdpProxySocket::bind(family)?);
                let port = socket.0.local_addr()?.port();
                let sessions = Arc::new(Sessions::default());
                let task = runtime.spawn(serve_udp(
                    socket,
                    shared.clone(),
                    sessions.clone(),
                    udp_timeout,
                ));
                Ok(Self {
                    port,
                    protocol,
                    shared,
                    task,
                    sessions: Some(sessions),
                })
            }
            Protocol::Sctp => Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "the userspace mode proxies TCP and UDP only",
            )),
        }
    }

    /// Ends the UDP sessions whose endpoint is not in `endpoints` (it left the Service port): the
    /// client's next datagram opens a session to a usable endpoint, as the other modes move
    /// such a flow by deleting its conntrack entry.
    pub fn end_sessions_not_to(&self, endpoints: &[SocketAddr]) {
        let Some(sessions) = &self.sessions else {
            return;
        };
        sessions.lock().retain(|_, session| {
            let keep = endpoints.contains(&session.endpoint);
            if !keep {
                session.task.abort();
            }
            keep
        });
    }

    /// Whether its loop still runs (it ends only by a panic, or when closed).
    pub fn is_running(&self) -> bool {
        !self.task.is_finished()
    }
}

impl Drop for ProxySocket {
    fn drop(&mut self) {
        self.task.abort();
        if let Some(sessions) = &self.sessions {
            for (_, session) in sessions.lock().drain() {
                session.task.abort();
            }
        }
    }
}

async fn serve_tcp(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        match listener.accept().await {
            Ok((client, peer)) => {
                tokio::spawn(proxy_tcp(client, peer, shared.clone()));
            }
            Err(e) => {
                // Out of file descriptors, mostly: wait for some to be released rather than
                // spin (kube-proxy raised its limit to 64000 and gave up past it).
                tracing::warn!(service = %shared.name, "accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn proxy_tcp(mut client: TcpStream, peer: SocketAddr, shared: Arc<Shared>) {
    let _ = client.set_nodelay(true);
    let connected = connect_with_retries(&shared.balancer, &shared.name, peer.ip(), |ep, _| {
        TcpStream::connect(ep)
    })
    .await;
    let (endpoint, mut upstream) = match connected {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(service = %shared.name, client = %peer, "connection reset: {e}");
            // Closed with a RST: the client learns at once that nothing is there.
            let _ = client.set_zero_linger();
            return;
        }
    };
    let _ = upstream.set_nodelay(true);
    tracing::debug!(service = %shared.name, client = %peer, %endpoint, "proxying a connection");
    match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
        Ok((sent, received)) => tracing::debug!(
            service = %shared.name,
            client = %peer,
            %endpoint,
            sent,
            received,
            "connection closed"
        ),
        Err(e) => tracing::debug!(
            service = %shared.name,
            client = %peer,
            %endpoint,
            "connection ended: {e}"
        ),
    }
}

/// The UDP sessions of one proxy socket, by client address.
#[derive(Debug, Default)]
struct Sessions(Mutex<HashMap<SocketAddr, Session>>);

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, Session>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Debug)]
struct Session {
    /// Tells this session from a later one of the same client.
    id: u64,
    /// Where its datagrams go.
    endpoint: SocketAddr,
    upstream: Arc<UdpSocket>,
    activity: Arc<Activity>,
    task: AbortHandle,
}

/// When a session last carried a datagram, either way.
#[derive(Debug)]
struct Activity {
    start: Instant,
    /// Milliseconds since `start`.
    last: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            last: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.fetch_max(ms, Ordering::Relaxed);
    }

    fn idle(&self) -> Duration {
        self.start
            .elapsed()
            .saturating_sub(Duration::from_millis(self.last.load(Ordering::Relaxed)))
    }
}

async fn serve_udp(
    socket: Arc<UdpProxySocket>,
    shared: Arc<Shared>,
    sessions: Arc<Sessions>,
    timeout: Duration,
) {
    let mut buf = vec![0; DATAGRAM];
    let mut next_id = 0u64;
    loop {
        let (n, client, local) = match socket.recv_from(&mut buf).await {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(service = %shared.name, "receiving a datagram: {e}");
                continue;
            }
        };
        let known = sessions
            .lock()
            .get(&client)
            .map(|s| (s.upstream.clone(), s.activity.clone()));
        let (upstream, activity) = match known {
            Some(known) => known,
            None => {
                next_id += 1;
                let session = (client, local, next_id);
                match open_session(&socket, &shared, &sessions, session, timeout).await {
                    Some(opened) => opened,
                    None => continue,
                }
            }
        };
        activity.touch();
        if let Err(e) = upstream.send(&buf[..n]).await {
            tracing::debug!(service = %shared.name, %client, "forwarding a datagram: {e}");
        }
    }
}

/// A new session (`id`) for `client`, which sent to the node address `local`: a socket
/// connected to the endpoint picked for it, and the task passing the endpoint's replies back
/// from `local`. None: no endpoint (the datagram is dropped).
async fn open_session(
    socket: &Arc<UdpProxySocket>,
    shared: &Arc<Shared>,
    sessions: &Arc<Sessions>,
    (client, local, id): (SocketAddr, IpAddr, u64),
    timeout: Duration,
) -> Option<(Arc<UdpSocket>, Arc<Activity>)> {
    let Some(endpoint) = shared.balancer().next(client.ip(), false, Instant::now()) else {
        tracing::debug!(service = %shared.name, %client, "no endpoints: datagram dropped");
        return None;
    };
    let upstream = async {
        let upstream = UdpSocket::bind(unspecified(Family::of(endpoint.ip()))).await?;
        upstream.connect(endpoint).await?;
        std::io::Result::Ok(upstream)
    };
    let upstream = match upstream.await {
        Ok(u) => Arc::new(u),
        Err(e) => {
            tracing::warn!(service = %shared.name, %client, %endpoint, "connecting to the endpoint failed: {e}");
            return None;
        }
    };
    tracing::debug!(service = %shared.name, %client, %endpoint, "new UDP session");
    let activity = Arc::new(Activity::new());
    // Locked before the session's task starts, so that a task ending at once (a zero
    // timeout) removes its entry only after it is in.
    let mut map = sessions.lock();
    let task = tokio::spawn(udp_session(
        socket.clone(),
        upstream.clone(),
        (client, local),
        activity.clone(),
        timeout,
        shared.clone(),
        sessions.clone(),
        id,
    ));
    map.insert(
        client,
        Session {
            id,
            endpoint,
            upstream: upstream.clone(),
            activity: activity.clone(),
            task: task.abort_handle(),
        },
    );
    drop(map);
    Some((upstream, activity))
}

/// Passes the endpoint's replies to `client`, from `local`, until the session has been idle for
/// `timeout`.
#[allow(clippy::too_many_arguments)]
async fn udp_session(
    socket: Arc<UdpProxySocket>,
    upstream: Arc<UdpSocket>,
    (client, local): (SocketAddr, IpAddr),
    activity: Arc<Activity>,
    timeout: Duration,
    shared: Arc<Shared>,
    sessions: Arc<Sessions>,
    id: u64,
) {
    let mut buf = vec![0; DATAGRAM];
    loop {
        let left = timeout.saturating_sub(activity.idle());
        if left.is_zero() {
            tracing::debug!(service = %shared.name, %client, "UDP session idle: closed");
            break;
        }
        match tokio::time::timeout(left, upstream.recv(&mut buf)).await {
            // Not necessarily idle: the client may have sent meanwhile; looked at again.
            Err(_) => continue,
            Ok(Ok(n)) => {
                activity.touch();
                if let Err(e) = socket.send_from(&buf[..n], local, client).await {
                    tracing::debug!(service = %shared.name, %client, "replying: {e}");
                    break;
                }
            }
            Ok(Err(e)) => {
                // ECONNREFUSED: the endpoint has nothing on its port any more.
                tracing::debug!(service = %shared.name, %client, "UDP session ended: {e}");
                break;
            }
        }
    }
    let mut sessions = sessions.lock();
    if sessions.get(&client).is_some_and(|s| s.id == id) {
        sessions.remove(&client);
    }
}

/// Port 0 of every address of `family`.
fn unspecified(family: Family) -> SocketAddr {
    match family {
        Family::V4 => (Ipv4Addr::UNSPECIFIED, 0).into(),
        Family::V6 => (Ipv6Addr::UNSPECIFIED, 0).into(),
    }
}

/// A non-blocking socket of `type_` bound to an ephemeral port of every address of `family`;
/// an IPv6 one takes IPv6 only (the IPv4 rules send to the IPv4 socket).
fn bound(family: Family, type_: socket2::Type) -> std::io::Result<socket2::Socket> {
    let addr = unspecified(family);
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), type_, None)?;
    if family == Family::V6 {
        socket.set_only_v6(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    Ok(socket)
}

/// A UDP proxy socket (bound to every address of its family) that learns which node address
/// each datagram was sent to (IP_PKTINFO, IPV6_PKTINFO) and answers from it. Left to the route,
/// the answer would leave from the address of the interface the route to the client goes out
/// of, which on a multi-homed node need not be the one the client sent to (nor the one the
/// REDIRECT rule's conntrack entry expects): the client would drop it.
#[derive(Debug)]
struct UdpProxySocket(UdpSocket);

impl UdpProxySocket {
    fn bind(family: Family) -> std::io::Result<Self> {
        let socket = bound(family, socket2::Type::DGRAM)?;
        let (level, name) = match family {
            Family::V4 => (libc::IPPROTO_IP, libc::IP_PKTINFO),
            Family::V6 => (libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO),
        };
        let on: libc::c_int = 1;
        // SAFETY: an int option of the socket's own descriptor.
        let rc = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                level,
                name,
                (&on as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self(UdpSocket::from_std(socket.into())?))
    }

    /// A datagram: its length, its sender, and the node address it was sent to.
    async fn recv_from(&self, buf: &mut [u8]) -> std::io::Result<(usize, SocketAddr, IpAddr)> {
        let fd = self.0.as_raw_fd();
        self.0
            .async_io(Interest::READABLE, || recv_with_destination(fd, buf))
            .await
    }

    /// Sends `buf` to `to` from the node address `from`.
    async fn send_from(&self, buf: &[u8], from: IpAddr, to: SocketAddr) -> std::io::Result<()> {
        let fd = self.0.as_raw_fd();
        self.0
            .async_io(Interest::WRITABLE, || send_from(fd, buf, from, to))
            .await
    }
}

/// A message header for one buffer (`iov`) from or to the socket address at `peer` (of
/// `peer_len` bytes), without control messages; all must outlive the call it is given to.
fn message(
    peer: *mut libc::c_void,
    peer_len: libc::socklen_t,
    iov: &mut libc::iovec,
) -> libc::msghdr {
    // SAFETY: a plain C struct; all zeroes is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = peer;
    msg.msg_namelen = peer_len;
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg
}

/// Room for one IP_PKTINFO or IPV6_PKTINFO control message, aligned as the kernel writes it.
#[repr(C, align(8))]
struct PktInfoSpace([u8; 64]);

fn recv_with_destination(
    fd: RawFd,
    buf: &mut [u8],
) -> std::io::Result<(usize, SocketAddr, IpAddr)> {
    let mut control = PktInfoSpace([0; 64]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut local = None;
    // SAFETY: try_init hands a zeroed address buffer and its length to fill; every pointer in
    // msg outlives the recvmsg call; the control messages are walked within msg_controllen.
    let (n, from) = unsafe {
        socket2::SockAddr::try_init(|storage, len| {
            let mut msg = message(storage.cast(), *len, &mut iov);
            msg.msg_control = control.0.as_mut_ptr().cast();
            msg.msg_controllen = control.0.len();
            let n = libc::recvmsg(fd, &mut msg, 0);
            if n < 0 {
                return Err(std::io::Error::last_os_error());
            }
            *len = msg.msg_namelen;
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                match ((*cmsg).cmsg_level, (*cmsg).cmsg_type) {
                    (libc::IPPROTO_IP, libc::IP_PKTINFO) => {
                        let info =
                            (libc::CMSG_DATA(cmsg) as *const libc::in_pktinfo).read_unaligned();
                        local = Some(Ipv4Addr::from(u32::from_be(info.ipi_addr.s_addr)).into());
                    }
                    (libc::IPPROTO_IPV6, libc::IPV6_PKTINFO) => {
                        let info =
                            (libc::CMSG_DATA(cmsg) as *const libc::in6_pktinfo).read_unaligned();
                        local = Some(Ipv6Addr::from(info.ipi6_addr.s6_addr).into());
                    }
                    _ => {}
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
            Ok(n as usize)
        })?
    };
    let client = from
        .as_socket()
        .ok_or_else(|| std::io::Error::other("a datagram from a non-IP address"))?;
    let local = local.unwrap_or_else(|| unspecified(Family::of(client.ip())).ip());
    Ok((n, client, local))
}

fn send_from(fd: RawFd, buf: &[u8], from: IpAddr, to: SocketAddr) -> std::io::Result<()> {
    let to = socket2::SockAddr::from(to);
    let mut control = PktInfoSpace([0; 64]);
    let mut iov = libc::iovec {
        iov_base: buf.as_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    let mut msg = message(to.as_ptr() as *mut libc::c_void, to.len(), &mut iov);
    // SAFETY: CMSG_SPACE and the header written within the control buffer's size.
    unsafe {
        let (level, type_, len) = match from {
            _ if from.is_unspecified() => (0, 0, 0),
            IpAddr::V4(_) => (
                libc::IPPROTO_IP,
                libc::IP_PKTINFO,
                size_of::<libc::in_pktinfo>(),
            ),
            IpAddr::V6(_) => (
                libc::IPPROTO_IPV6,
                libc::IPV6_PKTINFO,
                size_of::<libc::in6_pktinfo>(),
            ),
        };
        if len > 0 {
            msg.msg_control = control.0.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(len as u32) as usize;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = level;
            (*cmsg).cmsg_type = type_;
            (*cmsg).cmsg_len = libc::CMSG_LEN(len as u32) as usize;
            match from {
                IpAddr::V4(from) => {
                    let info = libc::in_pktinfo {
                        ipi_ifindex: 0,
                        ipi_spec_dst: libc::in_addr {
                            s_addr: u32::from(from).to_be(),
                        },
                        ipi_addr: libc::in_addr { s_addr: 0 },
                    };
                    (libc::CMSG_DATA(cmsg) as *mut libc::in_pktinfo).write_unaligned(info);
                }
                IpAddr::V6(from) => {
                    let info = libc::in6_pktinfo {
                        ipi6_addr: libc::in6_addr {
                            s6_addr: from.octets(),
                        },
                        ipi6_ifindex: 0,
                    };
                    (libc::CMSG_DATA(cmsg) as *mut libc::in6_pktinfo).write_unaligned(info);
                }
            }
        }
    }
    // SAFETY: msg describes valid buffers.
    let n = unsafe { libc::sendmsg(fd, &msg, 0) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
