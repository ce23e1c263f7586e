//! Clients that run inside a namespace, each with a timeout and a clear error.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

use crate::Netns;

/// How long a client waits for the network (2 s, scaled by [`crate::patience`]).
pub fn client_timeout() -> Duration {
    crate::patience(Duration::from_secs(2))
}

fn io_context(e: std::io::Error, what: &str) -> anyhow::Error {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => {
            anyhow::anyhow!("{what}: timed out after {:?}", client_timeout())
        }
        _ => anyhow::Error::new(e).context(what.to_string()),
    }
}

fn with_newline(msg: &str) -> String {
    if msg.ends_with('\n') {
        msg.to_string()
    } else {
        format!("{msg}\n")
    }
}

fn tcp_connect(addr: SocketAddr) -> Result<(TcpStream, BufReader<TcpStream>)> {
    let stream = TcpStream::connect_timeout(&addr, client_timeout())
        .map_err(|e| io_context(e, "connect"))?;
    tcp_ready(stream)
}

/// As [`tcp_connect`], from source port `port` (`None` when it is in use).
fn tcp_connect_from(
    addr: SocketAddr,
    port: u16,
) -> Result<Option<(TcpStream, BufReader<TcpStream>)>> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    let local = match addr {
        SocketAddr::V4(_) => SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)),
        SocketAddr::V6(_) => SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)),
    };
    match socket.bind(&local.into()) {
        Err(e) if e.kind() == ErrorKind::AddrInUse => return Ok(None),
        bound => bound.context("bind")?,
    }
    socket
        .connect_timeout(&addr.into(), client_timeout())
        .map_err(|e| io_context(e, "connect"))?;
    tcp_ready(socket.into()).map(Some)
}

fn tcp_ready(stream: TcpStream) -> Result<(TcpStream, BufReader<TcpStream>)> {
    stream.set_read_timeout(Some(client_timeout()))?;
    stream.set_write_timeout(Some(client_timeout()))?;
    // SCTP sockets have no such option.
    let _ = stream.set_nodelay(true);
    let reader = BufReader::new(stream.try_clone()?);
    Ok((stream, reader))
}

fn tcp_exchange(
    stream: &mut TcpStream,
    reader: &mut BufReader<TcpStream>,
    msg: &str,
) -> Result<String> {
    stream
        .write_all(with_newline(msg).as_bytes())
        .map_err(|e| io_context(e, "send"))?;
    let mut reply = Vec::new();
    reader
        .read_until(b'\n', &mut reply)
        .map_err(|e| io_context(e, "read reply"))?;
    if reply.is_empty() {
        bail!("connection closed without a reply");
    }
    Ok(String::from_utf8_lossy(&reply).trim_end().to_string())
}

/// An SCTP socket (one-to-one style: it connects, reads and writes as a TCP one does), or
/// `None` where this kernel has no SCTP.
fn sctp_socket(addr: SocketAddr) -> Result<Option<socket2::Socket>> {
    let created = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::from(libc::IPPROTO_SCTP)),
    );
    match created {
        Ok(socket) => Ok(Some(socket)),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EPROTONOSUPPORT | libc::ESOCKTNOSUPPORT)
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(e).context("creating an SCTP socket"),
    }
}

/// Why SCTP cannot be used in the current namespace's kernel, if it cannot.
pub fn sctp_available() -> std::result::Result<(), String> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    match sctp_socket(addr) {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(
            "this kernel has no SCTP (the sctp module is neither built in nor \
                         loadable)"
                .into(),
        ),
        Err(e) => Err(format!("{e:#}")),
    }
}

/// An SCTP listener on `addr` (accepting as a TCP one does; IPv6 only for an IPv6 address),
/// or `None` where this kernel has no SCTP.
pub fn sctp_listener(addr: SocketAddr) -> Result<Option<std::net::TcpListener>> {
    let Some(socket) = sctp_socket(addr)? else {
        return Ok(None);
    };
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    socket.set_reuse_address(true)?;
    socket
        .bind(&addr.into())
        .with_context(|| format!("bind SCTP {addr}"))?;
    socket.listen(128)?;
    Ok(Some(socket.into()))
}

/// One SCTP association from inside `from`: sends `msg` as a line, returns the reply line.
pub fn sctp_request(from: &Netns, addr: SocketAddr, msg: &str) -> Result<String> {
    from.try_run(|| -> Result<String> {
        let socket = sctp_socket(addr)?.context("this kernel has no SCTP")?;
        socket
            .connect_timeout(&addr.into(), client_timeout())
            .map_err(|e| io_context(e, "connect"))?;
        let (mut stream, mut reader) = tcp_ready(socket.into())?;
        tcp_exchange(&mut stream, &mut reader, msg)
    })
    .and_then(|r| r)
    .with_context(|| format!("SCTP {addr} from {}", from.name))
}

/// One TCP connection from inside `from`: sends `msg` as a line, returns the reply line
/// (a sandbox backend answers with its pod name; `whoami` gets "<name> <client ip:port>").
pub fn tcp_request(from: &Netns, addr: SocketAddr, msg: &str) -> Result<String> {
    from.try_run(|| {
        let (mut stream, mut reader) = tcp_connect(addr)?;
        tcp_exchange(&mut stream, &mut reader, msg)
    })
    .and_then(|r| r)
    .with_context(|| format!("TCP {addr} from {}", from.name))
}

/// One TCP connection from inside `from`, `lines` request lines, one reply line each
/// (to show that a flow sticks to one backend).
pub fn tcp_session(from: &Netns, addr: SocketAddr, lines: usize) -> Result<Vec<String>> {
    let mut conn = TcpConn::open(from, addr)?;
    (0..lines)
        .map(|i| {
            conn.ask(&format!("request {i}"))
                .with_context(|| format!("request {} of {lines}", i + 1))
        })
        .collect()
}

/// A TCP connection made from inside a namespace and kept open, to ask over it later (a
/// socket stays in the namespace it was created in, whichever thread uses it).
pub struct TcpConn {
    stream: TcpStream,
    reader: BufReader<TcpStream>,
    label: String,
}

impl TcpConn {
    pub fn open(from: &Netns, addr: SocketAddr) -> Result<Self> {
        let label = format!("TCP connection {addr} from {}", from.name);
        let (stream, reader) = from
            .try_run(|| tcp_connect(addr))
            .and_then(|r| r)
            .with_context(|| label.clone())?;
        Ok(Self {
            stream,
            reader,
            label,
        })
    }

    /// A connection from `from` to `addr` that the endpoint `want` answers (its name, asked):
    /// new ones until it does, at most 100, each from a source port drawn at random. IPVS
    /// gives a new connection the real server of an earlier one on the same 5-tuple, which an
    /// attacker scenario's flood leaves many of, and the kernel's own choice of port for
    /// successive connections is every other port: the flood's round robin may have given all
    /// of those one real server.
    pub fn open_to(from: &Netns, addr: SocketAddr, want: &str) -> Result<Self> {
        let label = format!("TCP connection {addr} from {}", from.name);
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |t| t.subsec_nanos() | 1);
        let mut random = Xorshift(seed);
        for _ in 0..100 {
            let port = 32768 + (random.next() % (61000 - 32768)) as u16;
            let Some((stream, reader)) = from
                .try_run(|| tcp_connect_from(addr, port))
                .and_then(|r| r)
                .with_context(|| format!("{label}, source port {port}"))?
            else {
                continue;
            };
            let mut conn = Self {
                stream,
                reader,
                label: label.clone(),
            };
            if conn.ask("hi")? == want {
                return Ok(conn);
            }
        }
        bail!("{addr}: {want} never answered from {}", from.name)
    }

    /// The connection's own address and port.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.stream.local_addr()?)
    }

    /// Sends `msg` as a line; the reply line.
    pub fn ask(&mut self, msg: &str) -> Result<String> {
        tcp_exchange(&mut self.stream, &mut self.reader, msg).with_context(|| self.label.clone())
    }
}

fn udp_socket(addr: SocketAddr) -> Result<UdpSocket> {
    let bind: SocketAddr = if addr.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(bind).context("bind")?;
    // Connected: replies from any other source (e.g. a backend address that was not
    // reverse-NATed back to the service address) are dropped, and show up as a timeout.
    socket.connect(addr).context("connect")?;
    socket.set_read_timeout(Some(client_timeout()))?;
    Ok(socket)
}

fn udp_exchange(socket: &UdpSocket, msg: &str) -> Result<String> {
    socket
        .send(with_newline(msg).as_bytes())
        .map_err(|e| io_context(e, "send"))?;
    let mut buf = [0u8; 65536];
    // A signal to the test process (a child exiting) interrupts the wait: wait again.
    let received = loop {
        match socket.recv(&mut buf) {
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            received => break received,
        }
    };
    let n = received.map_err(|e| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => anyhow::anyhow!(
            "no reply within {:?} (a reply from another source address \
             than the one sent to is dropped by the connected socket)",
            client_timeout()
        ),
        _ => anyhow::Error::new(e).context("receive"),
    })?;
    Ok(String::from_utf8_lossy(&buf[..n]).trim_end().to_string())
}

/// One UDP datagram from inside `from`; returns the reply.
pub fn udp_request(from: &Netns, addr: SocketAddr, msg: &str) -> Result<String> {
    from.try_run(|| udp_exchange(&udp_socket(addr)?, msg))
        .and_then(|r| r)
        .with_context(|| format!("UDP {addr} from {}", from.name))
}

/// `n` datagrams from one socket (same source port), one reply each.
pub fn udp_session(from: &Netns, addr: SocketAddr, n: usize) -> Result<Vec<String>> {
    let conn = UdpConn::open(from, addr)?;
    (0..n)
        .map(|i| {
            conn.ask(&format!("request {i}"))
                .with_context(|| format!("datagram {} of {n}", i + 1))
        })
        .collect()
}

/// A UDP socket made from inside a namespace and kept: every datagram has the same source
/// port, so they are one flow.
pub struct UdpConn {
    socket: UdpSocket,
    label: String,
}

impl UdpConn {
    pub fn open(from: &Netns, addr: SocketAddr) -> Result<Self> {
        let label = format!("UDP flow {addr} from {}", from.name);
        let socket = from
            .try_run(|| udp_socket(addr))
            .and_then(|r| r)
            .with_context(|| label.clone())?;
        Ok(Self { socket, label })
    }

    pub fn ask(&self, msg: &str) -> Result<String> {
        udp_exchange(&self.socket, msg).with_context(|| self.label.clone())
    }
}

/// One HTTP/1.1 GET from inside `from`: the status code and the body.
pub fn http_get(from: &Netns, addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    let response = from
        .try_run(move || -> Result<String> {
            let (mut stream, _) = tcp_connect(addr)?;
            stream.write_all(request.as_bytes())?;
            let mut out = String::new();
            stream
                .read_to_string(&mut out)
                .map_err(|e| io_context(e, "read response"))?;
            Ok(out)
        })
        .and_then(|r| r)
        .with_context(|| format!("GET http://{addr}{path} from {}", from.name))?;
    let code = response
        .split_whitespace()
        .nth(1)
        .context("empty response")?
        .parse()?;
    let body = response
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_owned();
    Ok((code, body))
}

/// How many bytes a bulk transfer sends each way: 50 MB, less where timeouts are scaled (in
/// the VM, whose emulated CPU is many times slower).
fn bulk_bytes() -> u64 {
    let scale = crate::patience(Duration::from_secs(1)).as_secs().max(1);
    (50 << 20) / scale
}

/// A bulk transfer through `addr` answered by the endpoint `want` (new connections until that endpoint
/// answers, at most 30): [`bulk_bytes`] sent while the endpoint echoes them, every byte
/// compared as it comes back.
pub fn bulk_transfer(from: &Netns, addr: SocketAddr, want: &str) -> Result<()> {
    let n = bulk_bytes();
    // A pattern the reader regenerates: xorshift, so that a shifted or corrupted stream shows.
    fn pattern(i: u64) -> u8 {
        let mut x = (i / 8).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> ((i % 8) * 8)) as u8
    }
    from.run(|| {
        let patience = crate::patience(Duration::from_secs(30));
        for _ in 0..30 {
            let stream = TcpStream::connect_timeout(&addr, client_timeout())?;
            stream.set_read_timeout(Some(patience))?;
            stream.set_write_timeout(Some(patience))?;
            let mut reader = BufReader::new(stream.try_clone()?);
            (&stream).write_all(format!("bulk {n}\n").as_bytes())?;
            let mut name = String::new();
            reader
                .read_line(&mut name)
                .context("reading the endpoint's name")?;
            if name.trim() != want {
                continue;
            }
            let mut writer = stream.try_clone()?;
            let sender = std::thread::spawn(move || -> std::io::Result<()> {
                let mut buf = vec![0u8; 1 << 16];
                let mut i = 0u64;
                while i < n {
                    let len = buf.len().min((n - i) as usize);
                    for (k, b) in buf[..len].iter_mut().enumerate() {
                        *b = pattern(i + k as u64);
                    }
                    writer.write_all(&buf[..len])?;
                    i += len as u64;
                }
                Ok(())
            });
            let mut buf = vec![0u8; 1 << 16];
            let mut i = 0u64;
            while i < n {
                let got = reader.read(&mut buf).context("reading the echo")?;
                ensure!(got > 0, "{addr}: the echo ended after {i} of {n} bytes");
                if let Some(k) = (0..got).find(|&k| buf[k] != pattern(i + k as u64)) {
                    bail!("{addr}: byte {} of the echo differs", i + k as u64);
                }
                i += got as u64;
            }
            sender
                .join()
                .map_err(|_| anyhow::anyhow!("the sender panicked"))?
                .context("sending")?;
            return Ok(());
        }
        bail!("{addr}: {want} never answered")
    })
}

/// Sends, from a raw socket inside `from` (as a pod with the default `CAP_NET_RAW` can), a
/// bare TCP segment with each of `flags` to `dst` from each of `sources` (address and port),
/// each with a sequence number drawn at random (a blind attacker's): a spoofed teardown or
/// reopening of whatever connection a source has, or a flood. The segments sent.
pub fn spoof_tcp(
    from: &Netns,
    sources: impl Iterator<Item = (IpAddr, u16)> + Send,
    dst: SocketAddr,
    flags: &[u8],
) -> Result<usize> {
    let mut random = Xorshift(0x9e37_79b9);
    let segments = sources.flat_map(move |(src, port)| {
        flags
            .iter()
            .map(|&tcp_flags| crate::packet::Spec {
                tcp_flags,
                seq: random.next(),
                payload: Vec::new(),
                ..crate::packet::Spec::tcp(src, port, dst.ip(), dst.port())
            })
            .map(|spec| spec.build())
            .collect::<Vec<_>>()
    });
    send_raw(from, segments).with_context(|| format!("spoofing segments to {dst}"))
}

/// A xorshift generator: numbers as a blind guess would draw them.
pub struct Xorshift(pub u32);

impl Xorshift {
    pub fn next(&mut self) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 17;
        self.0 ^= self.0 << 5;
        self.0
    }
}

/// Sends each of `frames` (as [`crate::packet::Spec::build`] makes them: the Ethernet header
/// is left off) from a raw socket inside `from`, its IP header as it is (any source, any
/// fragment fields), to its destination address; IPv4 and IPv6 frames alike. The packets sent.
pub fn send_raw(from: &Netns, frames: impl Iterator<Item = Vec<u8>> + Send) -> Result<usize> {
    from.try_run(|| -> Result<usize> {
        // One raw socket a family, made when first needed. IPPROTO_RAW: the packet's own IP
        // header goes out as it is (in both families).
        let mut sockets: [Option<socket2::Socket>; 2] = [None, None];
        let mut sent = 0;
        for frame in frames {
            let packet = &frame[crate::packet::ETH_HLEN..];
            let (index, domain, to) = match packet[0] >> 4 {
                4 => {
                    let dst = <[u8; 4]>::try_from(&packet[16..20]).unwrap();
                    (0, socket2::Domain::IPV4, SocketAddr::from((dst, 0)))
                }
                _ => {
                    let dst = <[u8; 16]>::try_from(&packet[24..40]).unwrap();
                    (1, socket2::Domain::IPV6, SocketAddr::from((dst, 0)))
                }
            };
            if sockets[index].is_none() {
                let raw = socket2::Socket::new(
                    domain,
                    socket2::Type::RAW,
                    Some(libc::IPPROTO_RAW.into()),
                )
                .context("a raw socket")?;
                sockets[index] = Some(raw);
            }
            let socket = sockets[index].as_ref().unwrap();
            socket
                .send_to(packet, &to.into())
                .with_context(|| format!("sending a raw packet to {}", to.ip()))?;
            sent += 1;
        }
        Ok(sent)
    })?
    .with_context(|| format!("sending raw packets from {}", from.name))
}
