//! The iptables mode (`--proxy-mode iptables`) against the real kernel, in the sandbox: the
//! example Services from a pod, from outside through NodePorts (both traffic policies), a
//! Service without endpoints refused, an endpoint change followed, and `--cleanup` leaving no
//! rule behind. The rules themselves are checked by the golden test in
//! proxy-userspace/src/iptables/rules.rs.
use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use proxy_tests::{
    BACKEND_PORT, EXT_IP, NODE1_IP, Netns, Sandbox,
    agent::{AgentRun, AgentSource, edit_manifest, remove_endpoint},
    example::{DNS, FRONT, FRONT_LOCAL_NODE_PORT, FRONT_NODE_PORT, MANIFEST, WEB},
    privileged, tcp_request, udp_request,
};

const ARGS: &[&str] = &[
    "--proxy-mode",
    "iptables",
    "--cluster-cidr",
    "10.244.0.0/16",
];

/// The backend's name and the client address it saw.
fn whoami(from: &Netns, addr: SocketAddr) -> anyhow::Result<(String, SocketAddr)> {
    let reply = tcp_request(from, addr, "whoami")?;
    let (name, peer) = reply
        .split_once(' ')
        .ok_or_else(|| anyhow::anyhow!("not a whoami reply: {reply:?}"))?;
    Ok((name.to_owned(), peer.parse()?))
}

fn names(from: &Netns, addr: SocketAddr, n: usize) -> BTreeSet<String> {
    (0..n)
        .map(|_| {
            whoami(from, addr)
                .unwrap_or_else(|e| panic!("{addr}: {e:#}"))
                .0
        })
        .collect()
}

/// The KUBE- lines of node1's rules in `backend` (both tables).
fn kube_rules(sandbox: &Sandbox, backend: &str) -> String {
    let out = sandbox
        .node("node1")
        .cmd(&format!("iptables-{backend}-save"))
        .output()
        .expect("iptables-save in node1");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("KUBE-"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_iptables_mode_serves_the_example_services_with_legacy_iptables() {
    serves_the_example_services(
        "the_iptables_mode_serves_the_example_services_with_legacy_iptables",
        "legacy",
    );
}

#[test]
fn the_iptables_mode_serves_the_example_services_with_nf_tables() {
    serves_the_example_services(
        "the_iptables_mode_serves_the_example_services_with_nf_tables",
        "nft",
    );
}

/// Everything in the module documentation, with the rules in `backend` (legacy or nft).
fn serves_the_example_services(test: &str, backend: &str) {
    if !privileged(test) {
        return;
    }
    let mut sandbox = Sandbox::build().expect("building the sandbox");
    sandbox.start_backends(BACKEND_PORT).unwrap();
    let args = [ARGS, &["--iptables-backend", backend]].concat();
    let agent = AgentRun::start_with_args(
        &mut sandbox,
        "node1",
        AgentSource::Manifest(MANIFEST),
        0,
        &args,
    )
    .expect("starting the agent in iptables mode");
    let rules = kube_rules(&sandbox, backend);
    for needle in [
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
        "-j MASQUERADE --random-fully",
        "--comment \"demo/web:http cluster IP\"",
    ] {
        assert!(rules.contains(needle), "{needle:?} missing:\n{rules}");
    }

    // From a pod: TCP and UDP cluster IPs, every endpoint in turn, the pod's address kept.
    let client = &sandbox.pod("client").ns;
    assert_eq!(
        names(client, WEB, 30),
        BTreeSet::from(["be1".into(), "be2".into(), "be3".into()])
    );
    let (_, seen) = whoami(client, FRONT).unwrap();
    assert_eq!(
        seen.ip(),
        sandbox.pod("client").ip,
        "a pod's address is not masqueraded"
    );
    let answer = udp_request(client, DNS, "hi").unwrap();
    assert!(answer == "be1" || answer == "be4", "{answer}");

    // From outside: NodePorts. Cluster policy masquerades (the reply must come back this way);
    // Local keeps the client's address.
    let ext = &sandbox.ext;
    let node_port = SocketAddr::new(IpAddr::V4(NODE1_IP), FRONT_NODE_PORT);
    let seen = names(ext, node_port, 20);
    assert_eq!(seen, BTreeSet::from(["be2".into(), "be4".into()]));
    let (name, client_seen) = whoami(
        ext,
        SocketAddr::new(IpAddr::V4(NODE1_IP), FRONT_LOCAL_NODE_PORT),
    )
    .unwrap();
    assert_eq!(
        (name.as_str(), client_seen.ip()),
        ("be3", IpAddr::V4(EXT_IP))
    );

    // An endpoint leaving: the rules follow.
    edit_manifest(&agent.manifest, |objects| {
        remove_endpoint(objects, "web", "10.244.1.13")
    })
    .unwrap();
    let deadline = Instant::now() + proxy_tests::patience(Duration::from_secs(10));
    while kube_rules(&sandbox, backend).contains("demo/web:http -> 10.244.1.13:8080") {
        assert!(
            Instant::now() < deadline,
            "be3 still in the rules:\n{}",
            agent.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        names(client, WEB, 20),
        BTreeSet::from(["be1".into(), "be2".into()])
    );

    // --cleanup: not one rule or chain of ours left.
    agent.stop(&mut sandbox).unwrap();
    agent.cleanup(&sandbox).unwrap();
    let left = kube_rules(&sandbox, backend);
    assert!(left.is_empty(), "left behind:\n{left}");
}
