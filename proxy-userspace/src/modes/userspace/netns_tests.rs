//! The mode as the agent runs it (sync inside `block_in_place` on a multi-thread runtime), in
//! a network namespace of a test thread of its own: real rules, real proxy sockets, real
//! clients on the "node". The node's addresses are 10.0.0.1 and 2001:db8::1 on a veth (the
//! host chains DNAT the node's own traffic to them: a DNAT to 127.0.0.1 loses UDP replies); the
//! endpoints are echo servers on 127.0.0.2 and 127.0.0.3, or on ports of ::1, which the proxy
//! reaches like any other address.
//!
//! They need root (a network namespace, iptables); otherwise they print a loud `SKIPPED`
//! line and return (or fail with `SANDBOX_NO_SKIP=1`, as the sandbox tests).
use std::{
    collections::BTreeSet,
    io::{ErrorKind, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    process::Command,
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Lines},
    net::{
        TcpListener, TcpStream, UdpSocket,
        tcp::{OwnedReadHalf, OwnedWriteHalf},
    },
};

use super::*;
use crate::model::{Cidr, Endpoint, NamespacedName, Placement, ServicePort, TargetPort};
use crate::rows::{Rows, What};

/// Set to 1 to make these tests fail instead of skipping (as the sandbox tests').
const NO_SKIP_ENV: &str = "SANDBOX_NO_SKIP";

fn skip(test: &str, reason: &str) {
    if std::env::var(NO_SKIP_ENV).is_ok_and(|v| v == "1") {
        panic!("{test} cannot run: {reason} ({NO_SKIP_ENV}=1)");
    }
    // Straight to fd 2: `eprintln!` would be captured by the test harness.
    let _ = writeln!(std::io::stderr(), "\nSKIPPED {test}: {reason}\n");
}

/// Whether the tests can run here: root, `ip`, and both iptables backends.
fn privileged(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip(test, "not running as root");
        return false;
    }
    for tool in ["ip", "iptables-legacy-restore", "iptables-nft-restore"] {
        let arg = if tool == "ip" { "-V" } else { "--version" };
        match Command::new(tool).arg(arg).output() {
            Ok(o) if o.status.success() => {}
            Ok(o) => {
                skip(
                    test,
                    &format!("{tool} failed: {}", String::from_utf8_lossy(&o.stderr)),
                );
                return false;
            }
            Err(e) => {
                skip(test, &format!("{tool} unavailable: {e}"));
                return false;
            }
        }
    }
    true
}

/// Runs `body` on a thread of its own in a new network namespace (the thread's, and so its
/// runtime's and children's), with the node's network set up, on a multi-thread runtime.
fn in_namespace<F, Fut>(test: &'static str, body: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    std::thread::spawn(move || {
        // SAFETY: unshare has no memory preconditions; it changes this thread only.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            let e = std::io::Error::last_os_error();
            skip(test, &format!("unshare(CLONE_NEWNET): {e}"));
            return;
        }
        for args in [
            "link set lo up",
            "link add node0 type veth peer name node1",
            "link set node0 up",
            "link set node1 up",
            "addr add 10.0.0.1/24 dev node0",
            "route add default via 10.0.0.2 dev node0",
            "addr add 2001:db8::1/64 dev node0 nodad",
            "-6 route add default via 2001:db8::2 dev node0",
            // A load balancer IP routed to the node, as some clouds do (see the scenario).
            "addr add 203.0.113.11/32 dev lo",
        ] {
            let status = Command::new("ip").args(args.split(' ')).status().unwrap();
            assert!(status.success(), "ip {args}");
        }
        // Built here, after unshare: its threads are created in the namespace.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(body());
        runtime.shutdown_timeout(Duration::from_secs(1));
    })
    .join()
    .unwrap();
}

const NODE: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const NODE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);
const A: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
const B: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);
/// Nothing listens there.
const DEAD: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 4);

/// A TCP server on `addr` answering each line with `NAME:line`, and `NAME:eof` once the
/// client has closed its side.
async fn tcp_echo(addr: SocketAddr, name: &'static str) {
    let listener = TcpListener::bind(addr).await.unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let (read, mut write) = stream.into_split();
                let mut lines = BufReader::new(read).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if write
                        .write_all(format!("{name}:{line}\n").as_bytes())
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                let _ = write.write_all(format!("{name}:eof\n").as_bytes()).await;
            });
        }
    });
}

/// A UDP server on `addr` answering each datagram with `NAME:datagram`.
async fn udp_echo(addr: SocketAddr, name: &'static str) {
    let socket = UdpSocket::bind(addr).await.unwrap();
    tokio::spawn(async move {
        let mut buf = [0; 1500];
        loop {
            let (n, from) = socket.recv_from(&mut buf).await.unwrap();
            let reply = format!("{name}:{}", String::from_utf8_lossy(&buf[..n]));
            let _ = socket.send_to(reply.as_bytes(), from).await;
        }
    });
}

struct Client {
    lines: Lines<BufReader<OwnedReadHalf>>,
    write: OwnedWriteHalf,
}

const WAIT: Duration = Duration::from_secs(5);

impl Client {
    async fn connect(to: SocketAddr) -> std::io::Result<Self> {
        let stream = tokio::time::timeout(WAIT, TcpStream::connect(to))
            .await
            .map_err(|_| std::io::Error::from(ErrorKind::TimedOut))??;
        let (read, write) = stream.into_split();
        Ok(Self {
            lines: BufReader::new(read).lines(),
            write,
        })
    }

    /// Sends a line; the answer, as `server:line`.
    async fn ask(&mut self, line: &str) -> String {
        self.write
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        tokio::time::timeout(WAIT, self.lines.next_line())
            .await
            .expect("an answer in time")
            .unwrap()
            .expect("an answer before EOF")
    }

    /// Closes the sending side; what comes back until the server closes.
    async fn finish(mut self) -> String {
        self.write.shutdown().await.unwrap();
        let mut rest = String::new();
        tokio::time::timeout(WAIT, self.lines.get_mut().read_to_string(&mut rest))
            .await
            .expect("EOF in time")
            .unwrap();
        rest
    }
}

/// The server that answered: `A` of `A:line`.
fn server(answer: &str) -> String {
    answer.split(':').next().unwrap().to_string()
}

/// One question on a new connection to `to`; the server that answered.
async fn served_by(to: SocketAddr) -> String {
    let mut client = Client::connect(to)
        .await
        .unwrap_or_else(|e| panic!("connecting to {to}: {e}"));
    server(&client.ask("hello").await)
}

async fn udp_ask(socket: &UdpSocket, line: &str) -> String {
    socket.send(line.as_bytes()).await.unwrap();
    let mut buf = [0; 1500];
    let n = tokio::time::timeout(WAIT, socket.recv(&mut buf))
        .await
        .unwrap_or_else(|_| panic!("no UDP answer to {line}"))
        .unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

fn spn(name: &str, protocol: Protocol) -> ServicePortName {
    ServicePortName::new(NamespacedName::new("test", name), "p", protocol)
}

fn service(cluster_ip: [u8; 4], port: u16, protocol: Protocol) -> ServicePort {
    ServicePort {
        cluster_ips: [IpAddr::from(cluster_ip)].into(),
        port,
        protocol,
        target_port: TargetPort::Number(8080),
        node_port: None,
        external_ips: Box::default(),
        load_balancer_ips: Box::default(),
        session_affinity_timeout: None,
        external_traffic_local: false,
        internal_traffic_local: false,
        lb_algorithm: None,
        source_ranges: Box::default(),
        health_check_node_port: None,
    }
}

fn endpoints(addrs: &[(impl Into<IpAddr> + Copy, u16)]) -> Vec<Endpoint> {
    addrs
        .iter()
        .map(|(ip, port)| Endpoint {
            ip: (*ip).into(),
            port: *port,
            ready: true,
            serving: true,
            terminating: false,
            placement: Placement::shared(Some("node1"), None),
        })
        .collect()
}

fn sync(dp: &mut UserspaceDataplane, state: &DesiredState, scope: Scope<'_>) {
    tokio::task::block_in_place(|| dp.sync(state, scope)).unwrap();
}

/// How many UDP conntrack entries of `family` are redirected to the proxy port `port`.
fn udp_flows(family: &str, port: u16) -> usize {
    let listed = Command::new("conntrack")
        .args([
            "-L",
            "-f",
            family,
            "-p",
            "udp",
            "--dst-nat",
            "--reply-port-src",
        ])
        .arg(port.to_string())
        .output()
        .expect("conntrack (the conntrack package)");
    String::from_utf8_lossy(&listed.stdout).lines().count()
}

fn vip(last: u8, port: u16) -> SocketAddr {
    SocketAddr::from(([10, 96, 0, last], port))
}

#[test]
fn proxies_services_in_a_network_namespace() {
    const TEST: &str = "modes::userspace::netns_tests::proxies_services_in_a_network_namespace";
    if !privileged(TEST) {
        return;
    }
    in_namespace(TEST, scenario);
}

async fn scenario() {
    for (ip, name) in [(A, "A"), (B, "B")] {
        tcp_echo((ip, 8080).into(), name).await;
        udp_echo((ip, 5353).into(), name).await;
    }
    let udp_timeout = Duration::from_millis(500);
    let mut dp = UserspaceDataplane::new(UserspaceConfig {
        backend: Backend::Legacy,
        node_port_addresses: NodePortAddresses::Primary,
        primary: vec![IpAddr::V4(NODE)],
        udp_timeout,
    })
    .unwrap();
    assert!(!installed());

    let mut state = DesiredState::new("node1");
    let both = endpoints(&[(A, 8080), (B, 8080)]);
    let rr = spn("rr", Protocol::Tcp);
    let mut port = service([10, 96, 0, 10], 80, Protocol::Tcp);
    port.node_port = Some(30080);
    state.insert_port(rr.clone(), port);
    state.set_endpoints(rr.clone(), both.clone());
    let sticky = spn("sticky", Protocol::Tcp);
    let mut port = service([10, 96, 0, 11], 80, Protocol::Tcp);
    port.session_affinity_timeout = std::num::NonZeroU32::new(60);
    state.insert_port(sticky.clone(), port);
    state.set_endpoints(sticky.clone(), both.clone());
    let retry = spn("retry", Protocol::Tcp);
    state.insert_port(retry.clone(), service([10, 96, 0, 12], 80, Protocol::Tcp));
    state.set_endpoints(retry.clone(), endpoints(&[(A, 8080), (DEAD, 8080)]));
    let empty = spn("empty", Protocol::Tcp);
    state.insert_port(empty.clone(), service([10, 96, 0, 13], 80, Protocol::Tcp));
    // Load balancer IPs open to the node's own range, and closed to it.
    for (name, last, range) in [
        ("lb-open", 10, [10, 0, 0, 0]),
        ("lb-closed", 11, [192, 0, 2, 0]),
    ] {
        let lb = spn(name, Protocol::Tcp);
        let mut port = service([10, 96, 0, 20 + last], 80, Protocol::Tcp);
        port.load_balancer_ips = [IpAddr::from([203, 0, 113, last])].into();
        port.source_ranges = [Cidr::v4(range.into(), 24)].into();
        state.insert_port(lb.clone(), port);
        state.set_endpoints(lb, both.clone());
    }
    let dns = spn("dns", Protocol::Udp);
    state.insert_port(dns.clone(), service([10, 96, 0, 53], 53, Protocol::Udp));
    state.set_endpoints(dns.clone(), endpoints(&[(A, 5353), (B, 5353)]));
    sync(&mut dp, &state, Scope::All);
    assert!(installed());

    // Round robin: the endpoints in turn, for the cluster IP and the NodePort alike.
    let mut turns = Vec::new();
    for _ in 0..4 {
        turns.push(served_by(vip(10, 80)).await);
    }
    turns.push(served_by((NODE, 30080).into()).await);
    assert!(
        turns.windows(2).all(|w| w[0] != w[1]),
        "round robin alternates: {turns:?}"
    );

    // ClientIP affinity: every connection of this client to the same endpoint.
    let mut held = BTreeSet::new();
    for _ in 0..4 {
        held.insert(served_by(vip(11, 80)).await);
    }
    assert_eq!(held.len(), 1, "affinity: {held:?}");

    // One endpoint refuses: its turns are retried on the other, at once.
    let started = Instant::now();
    for _ in 0..4 {
        assert_eq!(served_by(vip(12, 80)).await, "A");
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "no timeouts waited"
    );

    // No endpoints: refused at once.
    let started = Instant::now();
    match Client::connect(vip(13, 80)).await {
        Err(e) => assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}"),
        Ok(_) => panic!("a Service without endpoints accepted a connection"),
    }
    assert!(started.elapsed() < Duration::from_secs(1));

    // loadBalancerSourceRanges: the node (10.0.0.1) is within the first only.
    served_by(SocketAddr::from(([203, 0, 113, 10], 80))).await;
    // Dropped: no answer. (Without the drop it would reach the server on the address.)
    tcp_echo(SocketAddr::from(([203, 0, 113, 11], 80)), "X").await;
    let closed = TcpStream::connect(SocketAddr::from(([203, 0, 113, 11], 80)));
    assert!(
        matches!(
            tokio::time::timeout(Duration::from_secs(1), closed).await,
            Err(_) | Ok(Err(_))
        ),
        "a source outside loadBalancerSourceRanges got through"
    );

    // UDP: a session per client, kept while it is active, ended after the idle timeout;
    // each new session takes the next endpoint.
    let c1 = UdpSocket::bind((NODE, 0)).await.unwrap();
    c1.connect(vip(53, 53)).await.unwrap();
    let first = server(&udp_ask(&c1, "one").await);
    assert_eq!(
        udp_ask(&c1, "two").await,
        format!("{first}:two"),
        "same session"
    );
    tokio::time::sleep(udp_timeout + Duration::from_millis(300)).await;
    let second = server(&udp_ask(&c1, "three").await);
    assert_ne!(first, second, "a new session, the next endpoint");
    let c2 = UdpSocket::bind((NODE, 0)).await.unwrap();
    c2.connect(vip(53, 53)).await.unwrap();
    assert_eq!(server(&udp_ask(&c2, "x").await), first, "the next in turn");
    assert_eq!(
        server(&udp_ask(&c1, "four").await),
        second,
        "c1 kept its own"
    );

    // An endpoint change keeps the proxy port and the established connections.
    let ports = dp.proxy_ports(Family::V4, &rr).unwrap();
    let mut established = Client::connect(vip(10, 80)).await.unwrap();
    let kept = server(&established.ask("before").await);
    let other = if kept == "A" { B } else { A };
    state.set_endpoints(rr.clone(), endpoints(&[(other, 8080)]));
    sync(
        &mut dp,
        &state,
        Scope::Changed(&BTreeSet::from([rr.clone()])),
    );
    assert_eq!(
        dp.proxy_ports(Family::V4, &rr),
        Some(ports),
        "the same proxy port"
    );
    assert_eq!(established.ask("after").await, format!("{kept}:after"));
    let other_name = if kept == "A" { "B" } else { "A" };
    for _ in 0..3 {
        assert_eq!(served_by(vip(10, 80)).await, other_name);
    }
    // A half-close goes through: the server sees EOF, answers, and closes.
    assert_eq!(established.finish().await, format!("{kept}:eof\n"));

    // The Service port goes: its socket closes, its proxied connections carry on.
    let mut survivor = Client::connect(vip(10, 80)).await.unwrap();
    survivor.ask("before").await;
    state.remove_port(&rr);
    sync(
        &mut dp,
        &state,
        Scope::Changed(&BTreeSet::from([rr.clone()])),
    );
    assert_eq!(dp.proxy_ports(Family::V4, &rr), None);
    let deadline = Instant::now() + WAIT;
    loop {
        match TcpStream::connect((NODE, ports.internal)).await {
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => break,
            _ if Instant::now() > deadline => panic!("the proxy port stayed open"),
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    assert_eq!(
        survivor.ask("after").await,
        format!("{other_name}:after"),
        "a proxied connection outlives its Service port"
    );

    // A full sync with nothing left closes every socket and empties the chains.
    let proxied: Vec<_> = state.port_names().cloned().collect();
    let ports: Vec<ProxyPorts> = proxied
        .iter()
        .map(|spn| dp.proxy_ports(Family::V4, spn).unwrap())
        .collect();
    let dns_port = dp.proxy_ports(Family::V4, &dns).unwrap().internal;
    assert!(
        udp_flows("ipv4", dns_port) > 0,
        "the UDP clients' flows are tracked"
    );
    sync(&mut dp, &DesiredState::default(), Scope::All);
    assert!(
        proxied
            .iter()
            .all(|spn| dp.proxy_ports(Family::V4, spn).is_none())
    );
    // The UDP flows redirected to the closed socket are forgotten: their next datagram meets
    // the rules as they are now.
    assert_eq!(udp_flows("ipv4", dns_port), 0);
    let saved = Command::new("iptables-legacy-save").output().unwrap();
    let saved = String::from_utf8_lossy(&saved.stdout);
    assert!(!saved.contains("--to-ports"), "{saved}");
    assert!(!saved.contains("test/"), "{saved}");
    drop(dp);
    // Nothing listens on the proxy ports any more.
    tokio::time::sleep(Duration::from_millis(100)).await;
    for p in ports {
        if let Ok(stream) = TcpStream::connect((NODE, p.internal)).await {
            panic!("proxy port {} still open: {stream:?}", p.internal);
        }
    }

    cleanup().unwrap();
    assert!(!installed());
    let saved = Command::new("iptables-legacy-save").output().unwrap();
    let saved = String::from_utf8_lossy(&saved.stdout);
    assert!(!saved.contains("KUBE-"), "{saved}");
}

#[test]
fn proxies_ipv6_services_in_a_network_namespace() {
    const TEST: &str =
        "modes::userspace::netns_tests::proxies_ipv6_services_in_a_network_namespace";
    if !privileged(TEST) {
        return;
    }
    in_namespace(TEST, ipv6_scenario);
}

/// Each family's proxy sockets and rules: a dual-stack Service port reaches the endpoints of
/// the family its client used, and UDP replies leave from the IPv6 address the client sent to.
async fn ipv6_scenario() {
    let (a6, b6) = ((Ipv6Addr::LOCALHOST, 8081), (Ipv6Addr::LOCALHOST, 8082));
    tcp_echo((A, 8080).into(), "A").await;
    tcp_echo(a6.into(), "A6").await;
    tcp_echo(b6.into(), "B6").await;
    udp_echo((Ipv6Addr::LOCALHOST, 5353).into(), "D6").await;
    let mut dp = UserspaceDataplane::new(UserspaceConfig {
        backend: Backend::Nft,
        node_port_addresses: NodePortAddresses::Primary,
        primary: vec![IpAddr::V4(NODE), IpAddr::V6(NODE6)],
        udp_timeout: DEFAULT_UDP_TIMEOUT,
    })
    .unwrap();
    assert_eq!(dp.families(), Family::ALL);

    let vip6 = |last: u16, port: u16| {
        SocketAddr::from((Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, last), port))
    };
    let mut state = DesiredState::new("node1");
    let dual = spn("dual", Protocol::Tcp);
    let mut port = service([10, 96, 0, 10], 80, Protocol::Tcp);
    port.cluster_ips = [port.cluster_ips[0], vip6(10, 80).ip()].into();
    port.node_port = Some(30080);
    state.insert_port(dual.clone(), port);
    let mut both = endpoints(&[(A, 8080)]);
    both.extend(endpoints(&[a6, b6]));
    state.set_endpoints(dual.clone(), both);
    let dns = spn("dns", Protocol::Udp);
    let mut port = service([10, 96, 0, 53], 53, Protocol::Udp);
    port.cluster_ips = [vip6(53, 53).ip()].into();
    state.insert_port(dns.clone(), port);
    state.set_endpoints(dns.clone(), endpoints(&[(Ipv6Addr::LOCALHOST, 5353)]));
    sync(&mut dp, &state, Scope::All);

    // IPv4 clients reach the IPv4 endpoint, IPv6 clients the IPv6 ones, in turn.
    for _ in 0..2 {
        assert_eq!(served_by(vip(10, 80)).await, "A");
    }
    let mut turns = BTreeSet::new();
    for _ in 0..2 {
        turns.insert(served_by(vip6(10, 80)).await);
    }
    assert_eq!(turns, BTreeSet::from(["A6".to_owned(), "B6".to_owned()]));
    let node_port = served_by((NODE6, 30080).into()).await;
    assert!(node_port.ends_with('6'), "{node_port}");
    assert!(dp.proxy_ports(Family::V6, &dual).is_some());
    // An IPv6-only Service port has no IPv4 socket.
    assert_eq!(dp.proxy_ports(Family::V4, &dns), None);

    // UDP: the reply comes back from the address the client sent to.
    let client = UdpSocket::bind((NODE6, 0)).await.unwrap();
    client.connect(vip6(53, 53)).await.unwrap();
    assert_eq!(udp_ask(&client, "q").await, "D6:q");
    let dns_port = dp.proxy_ports(Family::V6, &dns).unwrap().internal;
    assert!(udp_flows("ipv6", dns_port) > 0);

    // inspect reads both families' rules.
    let Rows::Services { rows, .. } = inspect::read(What::Services).unwrap() else {
        panic!("not service rows");
    };
    let addresses: Vec<&str> = rows.iter().map(|r| r.address.as_str()).collect();
    for want in ["10.96.0.10:80", "[fd00:10:96::a]:80", "[fd00:10:96::35]:53"] {
        assert!(addresses.contains(&want), "no {want} in {addresses:?}");
    }

    // The UDP Service port goes: its IPv6 flows are forgotten.
    state.remove_port(&dns);
    sync(
        &mut dp,
        &state,
        Scope::Changed(&BTreeSet::from([dns.clone()])),
    );
    assert_eq!(udp_flows("ipv6", dns_port), 0);
    drop(dp);
    cleanup().unwrap();
    assert!(!installed());
}

#[test]
fn cleanup_removes_the_rules_of_both_backends() {
    const TEST: &str = "modes::userspace::netns_tests::cleanup_removes_the_rules_of_both_backends";
    if !privileged(TEST) {
        return;
    }
    in_namespace(TEST, || async {
        let state = crate::testing::fixture(crate::testing::SERVICES);
        for backend in Backend::ALL {
            let mut dp = UserspaceDataplane::new(UserspaceConfig {
                backend,
                node_port_addresses: NodePortAddresses::Primary,
                primary: Vec::new(),
                udp_timeout: DEFAULT_UDP_TIMEOUT,
            })
            .unwrap();
            sync(&mut dp, &state, Scope::All);
            // Six chains in each family (IPv6's empty: the fixture is IPv4's).
            assert_eq!(held(backend), 12, "{}", backend.name());
            let nat = Command::new(backend.tool("iptables-save"))
                .args(["-t", "nat"])
                .output()
                .unwrap();
            let nat = String::from_utf8_lossy(&nat.stdout);
            // The node's address is where host traffic goes. (Found as the only one not on
            // lo: /proc/net/route is the process's namespace, not this thread's.)
            assert!(nat.contains("-j DNAT --to-destination 10.0.0.1:"), "{nat}");
            // A second full sync adds no second jump.
            sync(&mut dp, &state, Scope::All);
            let nat = Command::new(backend.tool("iptables-save"))
                .args(["-t", "nat"])
                .output()
                .unwrap();
            let nat = String::from_utf8_lossy(&nat.stdout);
            assert_eq!(nat.matches("-j KUBE-PORTALS-CONTAINER").count(), 1, "{nat}");
        }
        cleanup().unwrap();
        assert!(!installed());
        for t in Backend::ALL.into_iter().flat_map(tables_of) {
            let saved = Command::new(t.tool("iptables-save")).output().unwrap();
            let saved = String::from_utf8_lossy(&saved.stdout);
            assert!(
                !saved.contains("KUBE-"),
                "{}: {saved}",
                t.tool("iptables-save")
            );
        }
        cleanup().unwrap();
    });
}
