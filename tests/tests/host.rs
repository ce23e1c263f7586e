//! Host-network clients (processes in a node's own network namespace) reach services through
//! the socket programs (proxy-ebpf's sock.rs) on a cgroup of the test's own (never the
//! machine's root cgroup): program level (the programs alone, on a namespace with backends on
//! its loopback) and end to end (the agent in the sandbox's node1).
//!
//! Clients are child processes (this test binary again, running only `host_client_child`),
//! moved into the cgroup and a network namespace before they start: a socket belongs to the
//! cgroup of the process that made it.
use std::{
    collections::BTreeSet,
    io::{BufRead, BufReader, Write},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket},
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use proxy_tests::example::{DNS, MANIFEST as EXAMPLE, REMOTE, WEB};
use proxy_tests::{
    BACKEND_PORT, NS_PREFIX, Netns, Sandbox,
    agent::{AgentRun, TestCgroup, edit_manifest, remove_endpoint},
    backend_bin, client_timeout,
    fixtures::SMALL,
    privileged,
    programs::{ExternalSvc, Programs, Svc, add_external_service, add_service, spn},
};
use proxy_userspace::{
    model::{DesiredState, Protocol},
    modes::ebpf::inspect,
    modes::ebpf::{self, cgroup, features},
    source::manifest::Object,
};

/// Makes this binary a client: the operations to run (see [`clients`]).
const CHILD_ENV: &str = "PROXY_TESTS_HOST_CLIENT";
/// Marks the lines of the client's answers on its stdout.
const RESULT: &str = "HOST-CLIENT-RESULT";

/// What a client saw: its own address, its peer (getpeername for connected sockets, the source
/// of the reply for `udp-sendto`) and the reply.
#[derive(Debug)]
struct Answer {
    local: SocketAddr,
    peer: SocketAddr,
    reply: String,
}

impl Answer {
    /// The backend that answered (its pod name).
    fn name(&self) -> &str {
        self.reply.split_whitespace().next().unwrap_or_default()
    }
}

/// Runs `ops` in one client process inside `ns` and `cgroup`, in order; each one's answer, or
/// its error. An op is `tcp` (connect, getpeername, a `whoami` line), `udp` (a connected
/// socket: the same), `udp-sendto` (an unconnected socket: sendto, recvfrom) or
/// `udp-sendto-10` (ten of those from one socket), with the address to use.
fn clients(
    ns: &Netns,
    cgroup: &TestCgroup,
    ops: &[(&str, SocketAddr)],
) -> Vec<Result<Answer, String>> {
    let encoded: Vec<String> = ops
        .iter()
        .map(|(op, addr)| format!("{op} {addr}"))
        .collect();
    let mut cmd = client_command(ns, cgroup, &encoded.join(";"));
    let out = cmd.stdin(Stdio::null()).output().expect("running a client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let answers: Vec<Result<Answer, String>> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix(RESULT))
        .map(|l| parse_answer(l.trim()))
        .collect();
    assert!(
        out.status.success() && answers.len() == ops.len(),
        "the client in {} failed ({}):\n{stdout}\n{}",
        ns.name,
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    answers
}

/// This test binary again, running only `host_client_child` with `ops`, inside `ns` and
/// `cgroup`.
fn client_command(ns: &Netns, cgroup: &TestCgroup, ops: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "host_client_child",
        "--exact",
        "--nocapture",
        "--test-threads",
        "1",
        "-q",
    ])
    .env(CHILD_ENV, ops);
    ns.enter(&mut cmd).unwrap();
    cgroup.enter(&mut cmd).unwrap();
    cmd
}

fn parse_answer(line: &str) -> Result<Answer, String> {
    if let Some(error) = line.strip_prefix("err ") {
        return Err(error.to_owned());
    }
    let mut fields = line.strip_prefix("ok ").expect("ok or err").splitn(3, ' ');
    let mut addr = || fields.next().unwrap().parse::<SocketAddr>().unwrap();
    let (local, peer) = (addr(), addr());
    Ok(Answer {
        local,
        peer,
        reply: fields.next().unwrap_or_default().to_owned(),
    })
}

/// A client process inside a namespace and a cgroup that holds one connected UDP socket: each
/// [`HeldUdp::ask`] sends `whoami` on it and reads the answer (or the error).
struct HeldUdp {
    child: Child,
    answers: BufReader<std::process::ChildStdout>,
}

impl HeldUdp {
    fn open(ns: &Netns, cgroup: &TestCgroup, addr: SocketAddr) -> Self {
        let mut child = client_command(ns, cgroup, &format!("{HELD_UDP} {addr}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting a client");
        let answers = BufReader::new(child.stdout.take().unwrap());
        Self { child, answers }
    }

    fn ask(&mut self) -> Result<Answer, String> {
        writeln!(self.child.stdin.as_mut().unwrap(), "ask").expect("asking the client");
        let mut line = String::new();
        while !line.starts_with(RESULT) {
            line.clear();
            let n = self
                .answers
                .read_line(&mut line)
                .expect("the client's answer");
            assert!(n > 0, "the client ended");
        }
        parse_answer(line[RESULT.len()..].trim())
    }
}

impl Drop for HeldUdp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// [`HeldUdp`]'s client: one connected socket, asked once per line on stdin.
const HELD_UDP: &str = "udp-held";

/// The client process ([`clients`], [`HeldUdp`]); without its environment variable, a test
/// that passes.
#[test]
fn host_client_child() {
    let Ok(ops) = std::env::var(CHILD_ENV) else {
        return;
    };
    if let Some(addr) = ops.strip_prefix(HELD_UDP) {
        let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
        socket.set_read_timeout(Some(client_timeout())).unwrap();
        socket.connect(addr.trim()).unwrap();
        for _ in std::io::stdin().lines() {
            let mut buf = [0u8; 1500];
            let answer = socket
                .send(b"whoami\n")
                .and_then(|_| socket.recv(&mut buf))
                .and_then(|n| Ok((n, socket.local_addr()?, socket.peer_addr()?)));
            match answer {
                Ok((n, local, peer)) => {
                    let reply = String::from_utf8_lossy(&buf[..n]);
                    println!("{RESULT} ok {local} {peer} {}", reply.trim());
                }
                Err(e) => println!("{RESULT} err {e}"),
            }
        }
        return;
    }
    for op in ops.split(';') {
        let (kind, addr) = op.split_once(' ').expect("an op and an address");
        let line = match client_op(kind, addr.parse().expect("an address")) {
            Ok(a) => format!("ok {} {} {}", a.local, a.peer, a.reply),
            Err(e) => format!("err {e:#}"),
        };
        println!("{RESULT} {line}");
    }
}

fn client_op(kind: &str, addr: SocketAddr) -> anyhow::Result<Answer> {
    let timeout = client_timeout();
    if kind == "tcp" {
        let stream = TcpStream::connect_timeout(&addr, timeout)?;
        stream.set_read_timeout(Some(timeout))?;
        (&stream).write_all(b"whoami\n")?;
        let mut reply = String::new();
        BufReader::new(&stream).read_line(&mut reply)?;
        return Ok(Answer {
            local: stream.local_addr()?,
            peer: stream.peer_addr()?,
            reply: reply.trim().to_owned(),
        });
    }
    // An IPv6 socket for an IPv6 address (an IPv4-mapped one included), as Java opens them.
    let socket = match addr {
        SocketAddr::V4(_) => UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?,
        SocketAddr::V6(_) => UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0))?,
    };
    socket.set_read_timeout(Some(timeout))?;
    let mut buf = [0u8; 1500];
    let (n, peer) = match kind {
        "udp" => {
            socket.connect(addr)?;
            socket.send(b"whoami\n")?;
            (socket.recv(&mut buf)?, socket.peer_addr()?)
        }
        "udp-sendto" => {
            socket.send_to(b"whoami\n", addr)?;
            socket.recv_from(&mut buf)?
        }
        // Ten datagrams from one socket: the backends that answered, comma-separated.
        "udp-sendto-10" => {
            let mut names = BTreeSet::new();
            let mut peer = addr;
            for _ in 0..10 {
                socket.send_to(b"whoami\n", addr)?;
                let (n, from) = socket.recv_from(&mut buf)?;
                let reply = String::from_utf8_lossy(&buf[..n]).into_owned();
                names.insert(
                    reply
                        .split_whitespace()
                        .next()
                        .unwrap_or_default()
                        .to_owned(),
                );
                peer = from;
            }
            let names: Vec<String> = names.into_iter().collect();
            return Ok(Answer {
                local: socket.local_addr()?,
                peer,
                reply: names.join(","),
            });
        }
        _ => anyhow::bail!("unknown client op {kind}"),
    };
    Ok(Answer {
        local: socket.local_addr()?,
        peer,
        reply: String::from_utf8_lossy(&buf[..n]).trim().to_owned(),
    })
}

/// The answers of `ops`, all of which must have succeeded.
fn ok(answers: Vec<Result<Answer, String>>) -> Vec<Answer> {
    answers
        .into_iter()
        .enumerate()
        .map(|(i, a)| a.unwrap_or_else(|e| panic!("client op {i}: {e}")))
        .collect()
}

/// Whether the tc programs saw `answer`'s flow to `service`: a forward conntrack entry (in the
/// maps pinned in `pin_dir`) from the client's address and port to the Service.
fn through_tc(pin_dir: &Path, answer: &Answer, service: SocketAddr) -> bool {
    inspect::conntrack(pin_dir).unwrap().iter().any(|f| {
        f.direction == "forward"
            && f.source == answer.local.to_string()
            && f.destination == service.to_string()
    })
}

fn names<'a>(answers: impl IntoIterator<Item = &'a Answer>) -> BTreeSet<String> {
    answers.into_iter().map(|a| a.name().to_owned()).collect()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn sa(ip: Ipv4Addr, port: u16) -> SocketAddr {
    (ip, port).into()
}

/// The programs attached to the cgroup at `path` itself, as bpftool lists them.
fn attached(path: &Path) -> usize {
    let out = Command::new("bpftool")
        .args(["-j", "cgroup", "show"])
        .arg(path)
        .output()
        .expect("running bpftool");
    assert!(out.status.success(), "bpftool: {out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    if text.trim().is_empty() {
        return 0; // bpftool prints nothing for a cgroup without programs
    }
    let list: serde_json::Value = serde_json::from_str(&text).expect("bpftool's JSON");
    list.as_array().expect("a list").len()
}

// ---- program level: the socket programs on a namespace of their own ----

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 5, 1);
/// A TCP service without endpoints.
const EMPTY: Ipv4Addr = Ipv4Addr::new(10, 96, 5, 2);
/// internalTrafficPolicy Local, no local endpoint.
const LOCAL: Ipv4Addr = Ipv4Addr::new(10, 96, 5, 3);
/// sessionAffinity ClientIP.
const STICKY: Ipv4Addr = Ipv4Addr::new(10, 96, 5, 4);
/// A deleted service (a draining frontend).
const GONE: Ipv4Addr = Ipv4Addr::new(10, 96, 5, 5);

/// The socket programs attached to a cgroup of their own, translating the sockets of `ns` (a
/// namespace with only a loopback, and no route to any service address), whose backends `a`
/// (port 8081) and `b` (8082) run on its loopback; `other` is a namespace like it, with a
/// backend `other` on 8081.
struct Lab {
    programs: Programs,
    cgroup: TestCgroup,
    ns: Netns,
    other: Netns,
    backends: Vec<Child>,
}

impl Drop for Lab {
    fn drop(&mut self) {
        for child in &mut self.backends {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Lab {
    fn new(test: &str) -> Option<Lab> {
        if !privileged(test) || !proxy_tests::kernel_has(test, &features::NETNS_COOKIE) {
            return None;
        }
        let name = |role: &str| format!("{NS_PREFIX}{}-{test:.20}-{role}", std::process::id());
        let mut lab = Lab {
            programs: Programs::load(SMALL).expect("loading the BPF programs"),
            cgroup: TestCgroup::new().expect("a cgroup for the test"),
            ns: Netns::create(&name("host")).unwrap(),
            other: Netns::create(&name("other")).unwrap(),
            backends: Vec::new(),
        };
        for (ns, backend, port) in [
            (&lab.ns, "a", 8081),
            (&lab.ns, "b", 8082),
            (&lab.other, "other", 8081),
        ] {
            ns.ip(&["link", "set", "lo", "up"]).unwrap();
            let mut cmd = Command::new(backend_bin().unwrap());
            cmd.args(["--name", backend, "--port", &port.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null());
            ns.enter(&mut cmd).unwrap();
            lab.backends.push(cmd.spawn().unwrap());
            wait_listening(ns, port);
        }
        let cookie = lab.ns.run(cgroup::own_netns_cookie).unwrap();
        cgroup::attach(
            &mut lab.programs.ebpf,
            lab.cgroup.path(),
            lab.programs.bpffs.path(),
            cookie,
            cgroup::SocketLb::HostNetwork,
        )
        .expect("attaching the socket programs");
        Some(lab)
    }

    fn clients(&self, ops: &[(&str, SocketAddr)]) -> Vec<Result<Answer, String>> {
        clients(&self.ns, &self.cgroup, ops)
    }
}

fn wait_listening(ns: &Netns, port: u16) {
    let deadline = Instant::now() + proxy_tests::patience(Duration::from_secs(10));
    while !ns.run(|| TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok()) {
        assert!(Instant::now() < deadline, "no backend on port {port}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The lab's services: TCP and UDP on [`VIP`] (backends a and b), and one of each kind the
/// socket path treats apart.
fn lab_state() -> DesiredState {
    let mut state = DesiredState::new("node1");
    let (a, b) = ((Ipv4Addr::LOCALHOST, 8081), (Ipv4Addr::LOCALHOST, 8082));
    let mut add = |name, vip, port, protocol, endpoints: &[(Ipv4Addr, u16)]| {
        add_service(
            &mut state,
            &Svc {
                name,
                vip,
                port,
                protocol,
                endpoints,
            },
        )
    };
    add("web", VIP, 80, Protocol::Tcp, &[a, b]);
    add("dns", VIP, 53, Protocol::Udp, &[a, b]);
    let empty = add("empty", EMPTY, 80, Protocol::Tcp, &[]);
    let local = add("local", LOCAL, 80, Protocol::Tcp, &[a]);
    let sticky = add("sticky", STICKY, 80, Protocol::Tcp, &[a, b]);
    add("gone", GONE, 80, Protocol::Tcp, &[a, b]);
    state.set_endpoints(empty.clone(), Vec::new());
    // Its endpoint has no node: not local.
    state.port_mut(&local).unwrap().internal_traffic_local = true;
    state.port_mut(&sticky).unwrap().session_affinity_timeout = std::num::NonZeroU32::new(3600);
    state
}

#[test]
fn program_translates_host_sockets_at_connect_and_back() {
    let Some(mut lab) = Lab::new("program_translates_host_sockets_at_connect_and_back") else {
        return;
    };
    let mut state = lab_state();
    lab.programs.program(&state).unwrap();
    // "gone" deleted: its frontend drains.
    let gone = spn("gone", Protocol::Tcp);
    state.remove_port(&gone);
    lab.programs.program(&state).unwrap();

    let (web, dns) = (sa(VIP, 80), sa(VIP, 53));
    let mut ops = vec![("tcp", web); 20];
    ops.extend([("udp", dns); 20]);
    ops.extend([("udp-sendto", dns); 5]);
    let answers = ok(lab.clients(&ops));
    for (answer, (op, addr)) in answers.iter().zip(&ops) {
        // getpeername, and where UDP replies come from: the service address.
        assert_eq!(answer.peer, *addr, "{op}: {answer:?}");
        // The backend saw the client's own address: nothing was NATed on the way.
        assert!(
            answer.reply.ends_with(&answer.local.port().to_string()),
            "{answer:?}"
        );
    }
    assert_eq!(names(&answers[..20]), set(&["a", "b"]), "TCP");
    assert_eq!(names(&answers[20..40]), set(&["a", "b"]), "UDP");
    // An unconnected socket's datagrams to a Service go to one backend; sockets spread.
    let sockets = ok(lab.clients(&[("udp-sendto-10", dns); 20]));
    for socket in &sockets {
        assert!(
            !socket.reply.contains(','),
            "one socket, several backends: {socket:?}"
        );
    }
    assert_eq!(names(&sockets), set(&["a", "b"]), "unconnected UDP sockets");

    // sessionAffinity: one backend for every connection.
    let sticky = ok(lab.clients(&[("tcp", sa(STICKY, 80)); 10]));
    assert_eq!(names(&sticky).len(), 1, "{sticky:?}");

    // Refused at once, as kube-proxy's REJECT: a service without endpoints (connect() and a
    // UDP send); left as it is (so unreachable here: no route): a deleted one; refused too:
    // internalTrafficPolicy Local without a local endpoint.
    let refused = lab.clients(&[
        ("tcp", sa(EMPTY, 80)),
        ("tcp", sa(GONE, 80)),
        ("tcp", sa(LOCAL, 80)),
    ]);
    let e = refused[0].as_ref().expect_err("refused");
    assert!(e.contains("refused"), "{e}");
    let e = refused[1].as_ref().expect_err("no translation");
    assert!(e.contains("unreachable"), "{e}");
    let e = refused[2].as_ref().expect_err("refused");
    assert!(e.contains("not permitted"), "{e}");

    // Not translated: a socket of another namespace in the same cgroup (its own backend on
    // 8081 would answer if it were), and a socket of the namespace outside the cgroup.
    let other = clients(
        &lab.other,
        &lab.cgroup,
        &[("tcp", web), ("tcp", sa(Ipv4Addr::LOCALHOST, 8081))],
    );
    let e = other[0].as_ref().expect_err("another namespace: untouched");
    assert!(e.contains("unreachable"), "{e}");
    assert_eq!(other[1].as_ref().unwrap().name(), "other");
    let outside = lab
        .ns
        .run(|| TcpStream::connect_timeout(&web, client_timeout()));
    assert!(
        outside.is_err(),
        "a socket outside the cgroup was translated"
    );
}

/// IPv6 sockets reach IPv4 services through IPv4-mapped addresses (`::ffff:10.96.5.1`, Java's
/// default), with the same translation and the same mapped service address shown back.
#[test]
fn ipv6_sockets_reach_ipv4_services_through_mapped_addresses() {
    let Some(mut lab) = Lab::new("ipv6_sockets_reach_ipv4_services_through_mapped_addresses")
    else {
        return;
    };
    lab.programs.program(&lab_state()).unwrap();
    let mapped = |ip: Ipv4Addr, port| SocketAddr::from((ip.to_ipv6_mapped(), port));
    let (web, dns) = (mapped(VIP, 80), mapped(VIP, 53));
    let mut ops = vec![("tcp", web); 12];
    ops.extend([("udp", dns); 12]);
    ops.extend([("udp-sendto", dns); 12]);
    let answers = ok(lab.clients(&ops));
    for (answer, (op, addr)) in answers.iter().zip(&ops) {
        assert!(
            answer.local.is_ipv6(),
            "{op}: not an IPv6 socket: {answer:?}"
        );
        assert_eq!(answer.peer, *addr, "{op}: {answer:?}");
        assert!(
            answer.reply.ends_with(&answer.local.port().to_string()),
            "{answer:?}"
        );
    }
    for (i, op) in ["tcp", "udp", "udp-sendto"].iter().enumerate() {
        let some = &answers[i * 12..(i + 1) * 12];
        assert!(names(some).is_subset(&set(&["a", "b"])), "{op}: {some:?}");
    }
    assert_eq!(names(&answers), set(&["a", "b"]), "{answers:?}");
    // A service without endpoints is refused at once here too.
    let refused = lab.clients(&[("tcp", mapped(EMPTY, 80))]);
    let e = refused[0].as_ref().expect_err("refused");
    assert!(e.contains("refused"), "{e}");
}

/// loadBalancerSourceRanges hold for host-network clients too, as kube-proxy's firewall does:
/// their connection would leave from the node's primary address, which must be within them.
/// The cluster IP stays open.
#[test]
fn host_clients_are_held_to_load_balancer_source_ranges() {
    let Some(mut lab) = Lab::new("host_clients_are_held_to_load_balancer_source_ranges") else {
        return;
    };
    let lb = Ipv4Addr::new(198, 51, 100, 10);
    let mut state = DesiredState::new("node1");
    add_external_service(
        &mut state,
        &ExternalSvc {
            name: "ranged",
            cluster_ip: VIP,
            port: 80,
            protocol: Protocol::Tcp,
            node_port: None,
            load_balancer_ips: &[lb],
            external_ips: &[],
            external_traffic_local: false,
            source_ranges: &[(Ipv4Addr::new(192, 168, 0, 0), 24)],
            endpoints: &[(Ipv4Addr::LOCALHOST, 8081, "node1")],
        },
    );
    lab.programs.program(&state).unwrap();
    for (primary, allowed) in [
        (Ipv4Addr::new(192, 168, 0, 10), true),
        (Ipv4Addr::new(192, 168, 1, 10), false),
    ] {
        lab.programs.set_node_addrs(&[primary], primary);
        let answers = lab.clients(&[("tcp", sa(lb, 80)), ("tcp", sa(VIP, 80))]);
        assert_eq!(answers[1].as_ref().map(Answer::name), Ok("a"), "{primary}");
        if allowed {
            assert_eq!(answers[0].as_ref().map(Answer::name), Ok("a"), "{primary}");
        } else {
            let e = answers[0].as_ref().expect_err("refused");
            assert!(e.contains("not permitted"), "{primary}: {e}");
        }
    }
}

#[test]
fn program_links_are_replaced_in_place_and_removed_by_cleanup() {
    let Some(mut lab) = Lab::new("program_links_are_replaced_in_place_and_removed_by_cleanup")
    else {
        return;
    };
    lab.programs.program(&lab_state()).unwrap();
    let web = sa(VIP, 80);
    assert_eq!(attached(lab.cgroup.path()), cgroup::SOCK_PROGRAMS.len());

    // A restarted agent: the programs loaded again on the pinned maps, attached in place of
    // the old ones (which go when this process closes them).
    let pin_dir = lab.programs.bpffs.path().to_owned();
    let mut again = ebpf::load(&pin_dir, SMALL).unwrap().ebpf;
    let cookie = lab.ns.run(cgroup::own_netns_cookie).unwrap();
    cgroup::attach(
        &mut again,
        lab.cgroup.path(),
        &pin_dir,
        cookie,
        cgroup::SocketLb::HostNetwork,
    )
    .unwrap();
    drop(again);
    assert_eq!(attached(lab.cgroup.path()), cgroup::SOCK_PROGRAMS.len());
    let answers = ok(lab.clients(&[("tcp", web), ("udp-sendto", sa(VIP, 53))]));
    assert_eq!(answers[0].peer, web);
    assert_eq!(answers[1].peer, sa(VIP, 53));

    // `agent --cleanup`'s part: nothing attached any more, and nothing translated.
    let removed = cgroup::detach_all(&pin_dir).unwrap();
    assert_eq!(removed, cgroup::SOCK_PROGRAMS.len());
    // The kernel releases a link whose last reference went in a work item: soon, not at once.
    let deadline = std::time::Instant::now() + proxy_tests::patience(Duration::from_secs(2));
    while attached(lab.cgroup.path()) != 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(attached(lab.cgroup.path()), 0);
    assert!(!pin_dir.join(cgroup::LINKS_DIR).exists());
    let e = lab
        .clients(&[("tcp", web)])
        .remove(0)
        .expect_err("detached");
    assert!(e.contains("unreachable"), "{e}");
}

#[test]
fn cgroup2_is_mounted_on_an_empty_directory_only() {
    if !privileged("cgroup2_is_mounted_on_an_empty_directory_only") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("{NS_PREFIX}{}-cgroup2", std::process::id()));
    let _ = std::fs::remove_dir(&dir);
    cgroup::ensure(&dir).unwrap();
    assert!(cgroup::is_cgroup2(&dir).unwrap());
    cgroup::ensure(&dir).unwrap(); // already there: nothing to do
    proxy_userspace::modes::ebpf::bpffs::unmount(&dir).unwrap();
    // A directory with something in it is never mounted over (a cgroup v1 /sys/fs/cgroup).
    std::fs::write(dir.join("file"), "").unwrap();
    let e = cgroup::ensure(&dir).unwrap_err();
    assert!(
        format!("{e:#}").contains("not a cgroup2 directory"),
        "{e:#}"
    );
    assert!(!cgroup::is_cgroup2(&dir).unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---- end to end: the agent in the sandbox ----

#[test]
fn host_network_clients_reach_services() {
    if !privileged("host_network_clients_reach_services")
        || !proxy_tests::kernel_has(
            "host_network_clients_reach_services",
            &features::NETNS_COOKIE,
        )
    {
        return;
    }
    let mut sandbox = Sandbox::build().expect("building the sandbox");
    sandbox.start_backends(BACKEND_PORT).unwrap();
    let mut agent = AgentRun::start(&mut sandbox, "node1", EXAMPLE, 3).expect("the agent");
    let node1 = Netns::open(&sandbox.node1.name);
    let host = |agent: &AgentRun, ops: &[(&str, SocketAddr)]| clients(&node1, &agent.cgroup, ops);

    let mut ops = vec![("tcp", WEB); 30];
    ops.extend([("tcp", REMOTE); 3]);
    ops.extend([("udp", DNS); 20]);
    ops.extend([("udp-sendto", DNS); 5]);
    let answers = ok(host(&agent, &ops));
    for (answer, (op, addr)) in answers.iter().zip(&ops) {
        assert_eq!(answer.peer, *addr, "{op}: {answer:?}\n{}", agent.log_text());
    }
    assert_eq!(names(&answers[..30]), set(&["be1", "be2", "be3"]));
    // be4 lives on node2.
    assert_eq!(names(&answers[30..33]), set(&["be4"]));
    assert_eq!(names(&answers[33..53]), set(&["be1", "be4"]));
    // Translated at connect(): no conntrack entry for any of these flows.
    let flows = inspect::conntrack(agent.bpffs.path()).unwrap();
    for answer in &answers[..33] {
        let local = answer.local.to_string();
        assert!(
            !flows
                .iter()
                .any(|f| f.source == local || f.destination == local),
            "a host flow went through conntrack: {answer:?}"
        );
    }

    // Other namespaces in the same cgroup are left alone: the external client's connection
    // to the service address is not translated at its connect() but on node1, where ext
    // routes the service range (its flow is in node1's conntrack with the service address);
    // so is a pod's, by the tc programs, once.
    let ext = Netns::open(&sandbox.ext.name);
    let be1 = sa(Ipv4Addr::new(10, 244, 1, 11), BACKEND_PORT);
    let from_ext = ok(clients(&ext, &agent.cgroup, &[("tcp", WEB), ("tcp", be1)]));
    assert_eq!(from_ext[1].name(), "be1");
    let pod = Netns::open(&sandbox.pod("client").ns.name);
    let from_pod = ok(clients(&pod, &agent.cgroup, &[("tcp", WEB)])).remove(0);
    assert_eq!(from_pod.peer, WEB);
    for (who, answer) in [("ext", &from_ext[0]), ("the pod", &from_pod)] {
        assert!(
            through_tc(agent.bpffs.path(), answer, WEB),
            "{who}'s flow did not reach node1's programs with the service address"
        );
    }

    // The programs outlive the agent, and a restarted agent replaces them in place.
    agent.stop(&mut sandbox).unwrap();
    assert_eq!(ok(host(&agent, &[("tcp", WEB)]))[0].peer, WEB);
    agent.start_again(&mut sandbox).unwrap();
    assert_eq!(attached(agent.cgroup.path()), cgroup::SOCK_PROGRAMS.len());
    assert_eq!(ok(host(&agent, &[("udp-sendto", DNS)]))[0].peer, DNS);

    // `agent --cleanup`: nothing attached to the cgroup any more.
    agent.stop(&mut sandbox).unwrap();
    agent.cleanup(&sandbox).unwrap();
    assert_eq!(attached(agent.cgroup.path()), 0);
    assert!(
        host(&agent, &[("tcp", WEB)])[0].is_err(),
        "translated after cleanup"
    );
}

/// `--bpf-socket-lb all`: a pod's TCP connections are sent to an endpoint at connect() too
/// (no conntrack entry, getpeername still shows the Service), while what the socket programs
/// leave to the tc programs goes through them as before: the pod's UDP, a Service with session
/// affinity (kept by the pod's address), and a Service with no endpoint, refused by the tc
/// programs' ICMP error as kube-proxy refuses it (on every kernel, bpf_set_retval or not).
#[test]
fn pods_tcp_connections_are_translated_at_connect_with_socket_lb_all() {
    const TEST: &str = "pods_tcp_connections_are_translated_at_connect_with_socket_lb_all";
    if !privileged(TEST) || !proxy_tests::kernel_has(TEST, &features::NETNS_COOKIE) {
        return;
    }
    let mut sandbox = Sandbox::build().expect("building the sandbox");
    sandbox.start_backends(BACKEND_PORT).unwrap();
    let agent = AgentRun::start_with_args(
        &mut sandbox,
        "node1",
        proxy_tests::agent::AgentSource::Manifest(EXAMPLE),
        3,
        &["--bpf-socket-lb", "all"],
    )
    .expect("the agent");
    let pod = Netns::open(&sandbox.pod("client").ns.name);
    let from_pod = |ops: &[(&str, SocketAddr)]| clients(&pod, &agent.cgroup, ops);
    let through_tc = |answer: &Answer, service| through_tc(agent.bpffs.path(), answer, service);

    let mut ops = vec![("tcp", WEB); 30];
    ops.extend([("tcp", REMOTE); 3]);
    let answers = ok(from_pod(&ops));
    for (answer, (_, addr)) in answers.iter().zip(&ops) {
        assert_eq!(answer.peer, *addr, "{answer:?}\n{}", agent.log_text());
        assert!(
            !through_tc(answer, *addr),
            "translated per packet: {answer:?}"
        );
    }
    assert_eq!(names(&answers[..30]), set(&["be1", "be2", "be3"]));
    assert_eq!(names(&answers[30..]), set(&["be4"]));

    let udp = ok(from_pod(&[("udp", DNS)])).remove(0);
    assert_eq!(udp.peer, DNS);
    assert!(
        through_tc(&udp, DNS),
        "the pod's UDP was not left to the tc programs"
    );

    let mut set_web = |edit: &dyn Fn(&mut Object)| {
        let before = agent.syncs();
        edit_manifest(&agent.manifest, |objects| objects.iter_mut().for_each(edit)).unwrap();
        agent.wait_for_sync_after(&mut sandbox, before).unwrap();
    };
    set_web(&|object| {
        if let Object::Service(svc) = object
            && svc.metadata.name.as_deref() == Some("web")
        {
            svc.spec.get_or_insert_default().session_affinity = Some("ClientIP".into());
        }
    });
    let sticky = ok(from_pod(&[("tcp", WEB); 5]));
    assert_eq!(names(&sticky).len(), 1, "{sticky:?}");
    assert!(
        sticky.iter().all(|a| through_tc(a, WEB)),
        "affinity was not left to tc"
    );

    set_web(&|object| {
        if let Object::EndpointSlice(slice) = object
            && slice
                .metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with("web"))
        {
            slice.endpoints = Some(Vec::new());
        }
    });
    let refused = from_pod(&[("tcp", WEB)])
        .remove(0)
        .expect_err("no endpoint");
    assert!(refused.contains("os error 111"), "{refused}");
}

/// A host-network UDP socket connected to a Service whose endpoint leaves is told (the agent
/// destroys it: its next send or receive fails), and connecting again reaches an endpoint still there.
/// Without that, its datagrams would go on to the gone endpoint, which here still answers.
#[test]
fn a_connected_udp_socket_is_told_when_its_endpoint_leaves() {
    const TEST: &str = "a_connected_udp_socket_is_told_when_its_endpoint_leaves";
    if !privileged(TEST) || !proxy_tests::kernel_has(TEST, &features::NETNS_COOKIE) {
        return;
    }
    let mut sandbox = Sandbox::build().expect("building the sandbox");
    sandbox.start_backends(BACKEND_PORT).unwrap();
    let agent = AgentRun::start(&mut sandbox, "node1", EXAMPLE, 3).expect("the agent");
    let node1 = Netns::open(&sandbox.node1.name);
    let mut held = HeldUdp::open(&node1, &agent.cgroup, DNS);
    let first = held.ask().expect("the first answer");
    assert_eq!(first.peer, DNS);
    // An unconnected socket's datagrams follow the endpoints by themselves; only connected
    // ones need telling.
    let (gone, stays) = match first.name() {
        "be1" => ("10.244.1.11", "be4"),
        _ => ("10.244.2.11", "be1"),
    };
    let before = agent.syncs();
    edit_manifest(&agent.manifest, |o| remove_endpoint(o, "dns-like", gone)).unwrap();
    agent.wait_for_sync_after(&mut sandbox, before).unwrap();
    if agent.log_text().contains("cannot destroy sockets") {
        proxy_tests::say_skipped(
            TEST,
            "the kernel cannot destroy sockets (CONFIG_INET_DIAG_DESTROY)",
        );
        return;
    }
    let told = held.ask();
    assert!(
        // The kernel disconnects it: a send fails with EDESTADDRREQ, a receive waiting then
        // with ECONNABORTED.
        told.as_ref()
            .is_err_and(|e| e.contains("os error 89") || e.contains("os error 103")),
        "the socket still works: {told:?}\n{}",
        agent.log_text()
    );
    assert!(
        agent
            .log_text()
            .contains("destroyed host-network UDP sockets")
    );
    let again = ok(clients(&node1, &agent.cgroup, &[("udp", DNS); 5]));
    assert_eq!(names(&again), set(&[stays]));
}

/// The BPF program types among a process's open file descriptors (fdinfo's `prog_type`).
fn program_types(pid: u32) -> Vec<u32> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fdinfo")).unwrap();
    fds.flatten()
        .filter_map(|fd| std::fs::read_to_string(fd.path()).ok())
        .filter_map(|info| {
            let line = info.lines().find(|l| l.starts_with("prog_type:"))?;
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .collect()
}

/// `--bpf-cgroup-path ''`: the agent loads no socket program (it could not be attached anyway)
/// and pods are served all the same; with a path it holds all of them.
#[test]
fn an_empty_cgroup_path_loads_no_socket_program() {
    const BPF_PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;
    let test = "an_empty_cgroup_path_loads_no_socket_program";
    if !privileged(test) || !proxy_tests::kernel_has(test, &features::NETNS_COOKIE) {
        return;
    }
    let mut sandbox = Sandbox::build().expect("building the sandbox");
    sandbox.start_backends(BACKEND_PORT).unwrap();
    let sock_programs = |agent: &AgentRun| {
        program_types(agent.pid)
            .into_iter()
            .filter(|t| *t == BPF_PROG_TYPE_CGROUP_SOCK_ADDR)
            .count()
    };
    let with_path = AgentRun::start(&mut sandbox, "node1", EXAMPLE, 3).expect("the agent");
    assert_eq!(sock_programs(&with_path), cgroup::SOCK_PROGRAMS.len());
    with_path.stop(&mut sandbox).unwrap();
    with_path.cleanup(&sandbox).unwrap();

    let agent = AgentRun::start_with_args(
        &mut sandbox,
        "node1",
        proxy_tests::agent::AgentSource::Manifest(EXAMPLE),
        3,
        &["--bpf-cgroup-path", ""],
    )
    .expect("the agent without a cgroup path");
    assert_eq!(sock_programs(&agent), 0, "{}", agent.log_text());
    assert!(
        agent
            .log_text()
            .contains("host-network clients do not reach services")
    );
    let pod = &sandbox.pod("client").ns;
    let answer = proxy_tests::tcp_request(pod, WEB, "hi").unwrap();
    assert!(["be1", "be2", "be3"].contains(&answer.as_str()), "{answer}");
}

/// What the agent says of its kernel: `/metrics` has `kubeproxy_bpf_kernel_feature` for every
/// feature, 1 where this kernel has it, and `inspect features` lists the same, as the probes
/// found them (on a kernel lacking some, as in the VM, the zeros show).
#[test]
fn the_agent_reports_its_kernel_features() {
    if !privileged("the_agent_reports_its_kernel_features") {
        return;
    }
    let mut sandbox = Sandbox::build().expect("building the sandbox");
    sandbox.start_backends(BACKEND_PORT).unwrap();
    let agent = AgentRun::start(&mut sandbox, "node1", EXAMPLE, 3).expect("the agent");
    let kernel = features::Features::of_this_kernel().unwrap();
    let metrics = agent.metrics(&sandbox).unwrap();
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&agent.inspect_cli("features", &["--json"]).unwrap()).unwrap();
    assert_eq!(rows.len(), features::ALL.len(), "{rows:?}");
    for (feature, row) in features::ALL.iter().zip(&rows) {
        let has = kernel.has(feature);
        let line = format!(
            "kubeproxy_bpf_kernel_feature{{feature=\"{}\",since=\"{}\"}} {}",
            feature.name,
            feature.kernel,
            u8::from(has)
        );
        assert!(metrics.contains(&line), "{line} not in\n{metrics}");
        assert_eq!(
            (
                row["feature"].as_str(),
                row["since"].as_str(),
                row["present"].as_bool()
            ),
            (Some(feature.name), Some(feature.kernel), Some(has)),
            "{row}"
        );
    }
}
