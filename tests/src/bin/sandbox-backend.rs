//! The backend server of the sandbox pods: answers with its name over TCP and UDP (and SCTP
//! where the kernel has it).
//!
//! `sandbox-backend --name be1 --port 8080`
//! - UDP: replies `<name>\n` to each datagram.
//! - TCP: if the first line is an HTTP request, answers `HTTP/1.1 200 OK` with body
//!   `<name>\n` and closes (so curl works); otherwise answers `<name>\n` to each line until
//!   EOF (so nc works and one connection can ask many times).
//! - A request `whoami` (UDP datagram, TCP line or HTTP path `/whoami`) gets
//!   `<name> <client ip>:<client port>` instead: the source address the backend sees.
//! - A UDP datagram or TCP line starting with `echo ` gets `<name> ` and itself back: a big
//!   request gets as big an answer (fragmented both ways over UDP).
//! - SCTP (one-to-one sockets, on the same port) answers as TCP does, lines only.
//! - A TCP line `bulk <n>` gets `<name>\n`, then the next `n` bytes the client sends echoed
//!   back as they come, then the connection closes: a bulk transfer both ways, checked by the
//!   client.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};

use anyhow::{Context, Result};
use clap::Parser;

#[derive(Parser)]
#[command(about = "Sandbox backend: answers with its name over TCP and UDP")]
struct Args {
    /// The name to answer with (the pod name).
    #[arg(long)]
    name: String,
    /// TCP and UDP port.
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Addresses to bind, one socket of each protocol per address; an IPv6 one takes IPv6
    /// only (`--bind 0.0.0.0 --bind ::` for both families, each on sockets of its own).
    #[arg(long, default_value = "0.0.0.0")]
    bind: Vec<IpAddr>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let name: &'static str = Box::leak(args.name.into_boxed_str());
    let mut listeners = Vec::new();
    // UDP first: once TCP accepts connections on the last address, everything is ready.
    for &ip in &args.bind {
        let addr = SocketAddr::new(ip, args.port);
        let udp: UdpSocket = bound(addr, socket2::Type::DGRAM)
            .with_context(|| format!("bind UDP {addr}"))?
            .into();
        std::thread::spawn(move || serve_udp(udp, name));
        if let Some(sctp) = proxy_tests::sctp_listener(addr)? {
            std::thread::spawn(move || {
                for stream in sctp.incoming().flatten() {
                    std::thread::spawn(move || serve_tcp(stream, name));
                }
            });
        }
    }
    for &ip in &args.bind {
        let addr = SocketAddr::new(ip, args.port);
        let tcp = bound(addr, socket2::Type::STREAM).with_context(|| format!("bind TCP {addr}"))?;
        tcp.listen(1024)?;
        listeners.push(TcpListener::from(tcp));
    }
    let accept = move |tcp: TcpListener| {
        for stream in tcp.incoming() {
            match stream {
                Ok(stream) => {
                    std::thread::spawn(move || {
                        let _ = serve_tcp(stream, name);
                    });
                }
                Err(e) => eprintln!("sandbox-backend {name}: accept: {e}"),
            }
        }
    };
    let last = listeners.pop().context("no address to bind")?;
    for tcp in listeners {
        std::thread::spawn(move || accept(tcp));
    }
    accept(last);
    Ok(())
}

/// A socket of `kind` bound to `addr` (IPv6 only for an IPv6 address).
fn bound(addr: SocketAddr, kind: socket2::Type) -> std::io::Result<socket2::Socket> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), kind, None)?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    if kind == socket2::Type::STREAM {
        socket.set_reuse_address(true)?;
    }
    socket.bind(&addr.into())?;
    Ok(socket)
}

fn answer(name: &str, request: &[u8], peer: SocketAddr) -> String {
    if request.trim_ascii() == b"whoami" {
        format!("{name} {}\n", canonical(peer))
    } else if request.starts_with(b"echo ") {
        format!(
            "{name} {}\n",
            String::from_utf8_lossy(request.trim_ascii_end())
        )
    } else {
        format!("{name}\n")
    }
}

/// Shows IPv4-mapped IPv6 peers (dual-stack sockets) as IPv4.
fn canonical(peer: SocketAddr) -> SocketAddr {
    SocketAddr::new(peer.ip().to_canonical(), peer.port())
}

fn serve_udp(socket: UdpSocket, name: &str) {
    let mut buf = vec![0u8; 65536];
    loop {
        match socket.recv_from(&mut buf) {
            Ok((n, peer)) => {
                if let Err(e) = socket.send_to(answer(name, &buf[..n], peer).as_bytes(), peer) {
                    eprintln!("sandbox-backend {name}: UDP reply to {peer}: {e}");
                }
            }
            Err(e) => eprintln!("sandbox-backend {name}: UDP receive: {e}"),
        }
    }
}

const HTTP_METHODS: &[&[u8]] = &[
    b"GET ",
    b"HEAD ",
    b"POST ",
    b"PUT ",
    b"DELETE ",
    b"OPTIONS ",
    b"PATCH ",
];

fn serve_tcp(mut stream: TcpStream, name: &str) -> std::io::Result<()> {
    let peer = stream.peer_addr()?;
    // SCTP sockets have no such option.
    let _ = stream.set_nodelay(true);
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = Vec::new();
    if reader.read_until(b'\n', &mut line)? == 0 {
        return Ok(());
    }
    if HTTP_METHODS.iter().any(|m| line.starts_with(m)) {
        return serve_http(stream, reader, &line, name, peer);
    }
    if let Some(n) = line.strip_prefix(b"bulk ") {
        let n: u64 = String::from_utf8_lossy(n).trim().parse().unwrap_or(0);
        stream.write_all(format!("{name}\n").as_bytes())?;
        std::io::copy(&mut (&mut reader).take(n), &mut stream)?;
        return stream.shutdown(std::net::Shutdown::Write);
    }
    loop {
        stream.write_all(answer(name, &line, peer).as_bytes())?;
        line.clear();
        if reader.read_until(b'\n', &mut line)? == 0 {
            return Ok(());
        }
    }
}

fn serve_http(
    mut stream: TcpStream,
    mut reader: BufReader<TcpStream>,
    request_line: &[u8],
    name: &str,
    peer: SocketAddr,
) -> std::io::Result<()> {
    let request_line = String::from_utf8_lossy(request_line);
    let mut parts = request_line.split_whitespace();
    let method = parts.next().unwrap_or_default();
    let path = parts.next().unwrap_or("/");
    // Headers up to the empty line; keep Content-Length to drain a request body.
    let mut content_length = 0usize;
    let mut header = Vec::new();
    loop {
        header.clear();
        if reader.read_until(b'\n', &mut header)? == 0 {
            break;
        }
        let text = String::from_utf8_lossy(&header);
        let text = text.trim();
        if text.is_empty() {
            break;
        }
        if let Some((key, value)) = text.split_once(':')
            && key.trim().eq_ignore_ascii_case("content-length")
        {
            content_length = value.trim().parse().unwrap_or(0);
        }
    }
    std::io::copy(
        &mut (&mut reader).take(content_length as u64),
        &mut std::io::sink(),
    )?;

    let body = answer(name, path.trim_start_matches('/').as_bytes(), peer);
    let mut response = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if method != "HEAD" {
        response.push_str(&body);
    }
    stream.write_all(response.as_bytes())?;
    stream.shutdown(std::net::Shutdown::Write)
}
