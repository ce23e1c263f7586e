//! Smoke test of the sandbox topology and the backend servers (needs root; skips otherwise).

use std::net::SocketAddr;
use std::time::Instant;

use proxy_tests::{
    BACKEND_PORT, EXT_IP, EXT_IP6, NODE1_IP, NODE1_IP6, Sandbox, Shape, netns_list, privileged,
    tcp_request, tcp_session, udp_request, udp_session,
};

#[test]
fn sandbox_routes_pods_nodes_and_ext() {
    if !privileged("sandbox_routes_pods_nodes_and_ext") {
        return;
    }
    let started = Instant::now();
    let mut sb = Sandbox::build().expect("build sandbox");
    let built = started.elapsed();
    let prefix = sb.prefix.clone();
    assert_eq!(
        netns_list()
            .unwrap()
            .iter()
            .filter(|n| n.starts_with(&format!("{prefix}-")))
            .count(),
        9
    );
    // Wiring: forwarding on nodes, rp_filter off, node-side veths where tc programs go.
    let sysctl = |ns: &proxy_tests::Netns, key: &str| {
        ns.exec("sysctl", &["-n", key]).unwrap().trim().to_string()
    };
    assert_eq!(sysctl(&sb.node1, "net.ipv4.ip_forward"), "1");
    assert_eq!(sysctl(&sb.node2, "net.ipv4.ip_forward"), "1");
    assert_eq!(
        sysctl(&sb.pod("be1").ns, "net.ipv4.conf.eth0.rp_filter"),
        "0"
    );
    assert_eq!(sysctl(&sb.node1, "net.ipv4.conf.veth-be1.rp_filter"), "0");
    assert_eq!(
        sb.host_ifs("node1"),
        ["veth-client", "veth-be1", "veth-be2", "veth-be3"]
    );
    assert_eq!(sb.host_ifs("node2"), ["veth-be4"]);
    for pod in &sb.pods {
        sb.node(&pod.node)
            .ip(&["link", "show", &pod.host_if])
            .unwrap();
    }
    sb.start_backends(BACKEND_PORT).expect("start backends");
    eprintln!(
        "sandbox {prefix}: built in {built:?}, backends up after {:?}",
        started.elapsed()
    );

    let client = &sb.pod("client").ns;
    let be1 = sb.pod("be1").addr(BACKEND_PORT);
    let be4 = sb.pod("be4").addr(BACKEND_PORT);

    // Same node, pod to pod through the node's veths.
    assert_eq!(tcp_request(client, be1, "hello").unwrap(), "be1");
    assert_eq!(udp_request(client, be1, "hello").unwrap(), "be1");
    assert_eq!(tcp_session(client, be1, 3).unwrap(), ["be1"; 3]);
    assert_eq!(udp_session(client, be1, 3).unwrap(), ["be1"; 3]);
    // The backend sees the client's own address.
    let who = tcp_request(client, be1, "whoami").unwrap();
    assert!(who.starts_with("be1 10.244.1.10:"), "{who}");

    // Cross-node: node1 routes 10.244.2.0/24 via node2.
    assert_eq!(tcp_request(client, be4, "hello").unwrap(), "be4");
    assert_eq!(udp_request(client, be4, "hello").unwrap(), "be4");

    // From outside through node1.
    assert_eq!(tcp_request(&sb.ext, be1, "hello").unwrap(), "be1");
    assert_eq!(udp_request(&sb.ext, be4, "hello").unwrap(), "be4");
    let who = udp_request(&sb.ext, be4, "whoami").unwrap();
    assert!(who.starts_with(&format!("be4 {EXT_IP}:")), "{who}");

    // The same over IPv6: the sandbox is dual-stack.
    let (be1_6, be4_6) = (
        sb.pod("be1").addr6(BACKEND_PORT),
        sb.pod("be4").addr6(BACKEND_PORT),
    );
    let who = tcp_request(client, be1_6, "whoami").unwrap();
    assert!(who.starts_with("be1 [fd00:10:244:1::10]:"), "{who}");
    assert_eq!(udp_request(client, be4_6, "hello").unwrap(), "be4");
    let who = udp_request(&sb.ext, be4_6, "whoami").unwrap();
    assert!(who.starts_with(&format!("be4 [{EXT_IP6}]:")), "{who}");

    // Real clients: curl (HTTP mode) through `ip netns exec`.
    let out = client
        .exec(
            "curl",
            &["-sS", "--max-time", "2", &format!("http://{be1}/")],
        )
        .unwrap();
    assert_eq!(out, "be1\n");

    // A stopped backend refuses; a restarted one answers again.
    sb.stop_backend("be2");
    let be2: SocketAddr = sb.pod("be2").addr(BACKEND_PORT);
    let err = tcp_request(&sb.pod("client").ns, be2, "hello").unwrap_err();
    eprintln!("expected error: {err:#}");
    sb.start_backend("be2", BACKEND_PORT).unwrap();
    assert_eq!(
        tcp_request(&sb.pod("client").ns, be2, "hello").unwrap(),
        "be2"
    );

    drop(sb);
    let left: Vec<String> = netns_list()
        .unwrap()
        .into_iter()
        .filter(|n| n.starts_with(&format!("{prefix}-")))
        .collect();
    assert!(left.is_empty(), "namespaces left after drop: {left:?}");
}

#[test]
fn sandboxes_side_by_side_and_cleanup_after_panic() {
    if !privileged("sandboxes_side_by_side_and_cleanup_after_panic") {
        return;
    }
    let a = Sandbox::build().expect("build sandbox a");
    let b = Sandbox::build().expect("build sandbox b");
    assert_ne!(a.prefix, b.prefix);
    let prefix = b.prefix.clone();
    drop(a);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let _b = b;
        panic!("deliberate panic: the sandbox must still be cleaned up");
    }));
    assert!(panicked.is_err());
    let left: Vec<String> = netns_list()
        .unwrap()
        .into_iter()
        .filter(|n| n.starts_with(&format!("{prefix}-")))
        .collect();
    assert!(left.is_empty(), "namespaces left after panic: {left:?}");
}

/// Every node shape carries both families: a pod reaches a pod on its node and on the other
/// node, the node reaches its pods, and a client outside reaches pods of both nodes and the
/// node itself, over IPv4 and IPv6.
#[test]
fn every_shape_routes_both_families() {
    if !privileged("every_shape_routes_both_families") {
        return;
    }
    for shape in Shape::ALL {
        let mut sb = Sandbox::build_shaped(shape).expect("build sandbox");
        sb.start_backends(BACKEND_PORT).expect("start backends");
        let pods = ["be1", "be4"].map(|name| sb.pod(name));
        let client = &sb.pod("client").ns;
        for (family, addr) in [
            (
                "IPv4",
                &(|p: &proxy_tests::Pod| p.addr(BACKEND_PORT))
                    as &dyn Fn(&proxy_tests::Pod) -> SocketAddr,
            ),
            ("IPv6", &|p: &proxy_tests::Pod| p.addr6(BACKEND_PORT)),
        ] {
            for pod in pods {
                for (from, ns) in [("client", client), ("ext", &sb.ext), ("node1", &sb.node1)] {
                    let answer = tcp_request(ns, addr(pod), "hello")
                        .and_then(|_| udp_request(ns, addr(pod), "hello"));
                    assert_eq!(
                        answer.as_deref().ok(),
                        Some(pod.name.as_str()),
                        "{} shape, {family}: {from} to {}: {answer:?}",
                        shape.name(),
                        pod.name
                    );
                }
            }
        }
        // The node's own address answers from outside (NodePorts live there).
        for node in [NODE1_IP.to_string(), NODE1_IP6.to_string()] {
            let out = sb.ext.exec("ping", &["-c1", "-W2", &node]);
            assert!(
                out.is_ok(),
                "{} shape: ext cannot reach {node}: {out:?}",
                shape.name()
            );
        }
    }
}

/// The frames the attack scenarios send from raw sockets (tests/src/packet.rs, `send_raw`) are
/// ones the kernel takes, in both families: a UDP datagram sent in two fragments reaches its
/// socket whole (IP header, fragment header and UDP checksum right), a SYN to a listener is
/// answered, and ICMP errors are counted as such; no checksum error anywhere. A spoofed
/// packet the kernel dropped for a bad checksum would make `spoofed-teardown` pass for nothing.
#[test]
fn raw_frames_of_both_families_are_taken_by_the_kernel() {
    use proxy_tests::packet::{self, Spec};
    use proxy_tests::send_raw;
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpListener, UdpSocket};

    if !privileged("raw_frames_of_both_families_are_taken_by_the_kernel") {
        return;
    }
    let name = format!("{}{}-raw", proxy_tests::NS_PREFIX, std::process::id());
    let ns = proxy_tests::Netns::create(&name).unwrap();
    ns.ip(&["link", "set", "lo", "up"]).unwrap();
    // Counters of the namespace's /proc/net/snmp ("Tcp: InSegs ...", a names line and a
    // values line) and /proc/net/snmp6 ("Icmp6InDestUnreachs 1").
    let counters = || -> std::collections::BTreeMap<String, u64> {
        let mut all = std::collections::BTreeMap::new();
        let snmp = ns.exec("cat", &["/proc/net/snmp"]).unwrap();
        let lines: Vec<&str> = snmp.lines().collect();
        for pair in lines.chunks(2) {
            let (mut names, values) = (pair[0].split_whitespace(), pair[1].split_whitespace());
            let group = names.next().unwrap().trim_end_matches(':').to_owned();
            for (name, value) in names.zip(values.skip(1)) {
                all.insert(format!("{group}{name}"), value.parse().unwrap_or(0));
            }
        }
        let snmp6 = ns.exec("cat", &["/proc/net/snmp6"]).unwrap();
        for line in snmp6.lines() {
            let mut fields = line.split_whitespace();
            if let (Some(name), Some(value)) = (fields.next(), fields.next()) {
                all.insert(name.to_owned(), value.parse().unwrap_or(0));
            }
        }
        all
    };
    for lo in [
        IpAddr::from(Ipv4Addr::LOCALHOST),
        Ipv6Addr::LOCALHOST.into(),
    ] {
        // Each ICMP error sent, the counter it must raise, and the family's checksum errors.
        let (errors, checksum_errors) = match lo {
            IpAddr::V4(_) => (
                [
                    (
                        packet::ICMP_DEST_UNREACH,
                        packet::ICMP_PORT_UNREACH,
                        "IcmpInDestUnreachs",
                    ),
                    (
                        packet::ICMP_DEST_UNREACH,
                        packet::ICMP_FRAG_NEEDED,
                        "IcmpInDestUnreachs",
                    ),
                ],
                "IcmpInCsumErrors",
            ),
            IpAddr::V6(_) => (
                [
                    (
                        packet::ICMPV6_DEST_UNREACH,
                        packet::ICMPV6_PORT_UNREACH,
                        "Icmp6InDestUnreachs",
                    ),
                    (packet::ICMPV6_PACKET_TOO_BIG, 0, "Icmp6InPktTooBigs"),
                ],
                "Icmp6InCsumErrors",
            ),
        };
        let udp = ns.run(|| UdpSocket::bind((lo, 0))).unwrap();
        udp.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let datagram = Spec {
            payload: (0..64).collect(),
            ..Spec::udp(lo, 40000, lo, udp.local_addr().unwrap().port())
        };
        let (first, later) = packet::fragments(&datagram.build(), 16);
        send_raw(&ns, [first, later].into_iter()).unwrap();
        let mut buf = [0u8; 256];
        let n = udp.recv(&mut buf).expect("the fragmented datagram");
        assert_eq!(&buf[..n], &datagram.payload[..], "{lo}: the datagram");

        let listener = ns.run(|| TcpListener::bind((lo, 0))).unwrap();
        let syn = Spec::tcp(lo, 40001, lo, listener.local_addr().unwrap().port());
        let before = counters();
        send_raw(&ns, [syn.build()].into_iter()).unwrap();
        for (kind, code, _) in errors {
            let error = packet::icmp_error(lo, kind, code, &syn.build(), 8);
            send_raw(&ns, [error].into_iter()).unwrap();
        }
        let after = counters();
        let grew = |name: &str| after[name].saturating_sub(before[name]);
        assert!(grew("TcpOutSegs") >= 1, "{lo}: the SYN was not answered");
        for (_, _, name) in errors {
            assert!(grew(name) >= 1, "{lo}: {name} did not count the error");
        }
        for name in ["TcpInCsumErrors", "UdpInCsumErrors", checksum_errors] {
            assert_eq!(after[name], 0, "{lo}: {name}");
        }
    }
}
