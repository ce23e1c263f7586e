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
