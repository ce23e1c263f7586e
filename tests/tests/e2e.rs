//! End to end: the sandbox cluster, the agent in node1 on the example manifest, real TCP and UDP
//! clients in the client pod.
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use proxy_tests::{
    BACKEND_PORT, NODE1_IP, Sandbox, TcpConn, UdpConn,
    agent::{AgentRun, Launch, edit_manifest, remove_endpoint, set_conditions},
    example::{DNS, FRONT_NODE_PORT, MANIFEST as EXAMPLE, REMOTE, WEB, cluster},
    privileged, tcp_request, tcp_session, udp_request, udp_session,
};
use proxy_userspace::source::manifest::Object;

/// The backends that answered `n` new TCP connections (or UDP flows) to `addr`.
fn spread(sandbox: &Sandbox, addr: SocketAddr, udp: bool, n: usize) -> BTreeSet<String> {
    let client = &sandbox.pod("client").ns;
    (0..n)
        .map(|i| {
            let r = if udp {
                udp_request(client, addr, "hi")
            } else {
                tcp_request(client, addr, "hi")
            };
            r.unwrap_or_else(|e| panic!("request {i} to {addr}: {e:#}"))
                .trim()
                .to_owned()
        })
        .collect()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

#[test]
fn tcp_and_udp_reach_every_backend_and_flows_stick() {
    let Some((sandbox, agent)) = cluster("tcp_and_udp_reach_every_backend_and_flows_stick") else {
        return;
    };
    assert_eq!(
        spread(&sandbox, WEB, false, 40),
        set(&["be1", "be2", "be3"]),
        "{}",
        agent.log_text()
    );
    assert_eq!(spread(&sandbox, DNS, true, 40), set(&["be1", "be4"]));
    // Across nodes: be4 lives on node2.
    assert_eq!(spread(&sandbox, REMOTE, false, 5), set(&["be4"]));
    let client = &sandbox.pod("client").ns;
    for _ in 0..5 {
        let replies = tcp_session(client, WEB, 10).unwrap();
        assert!(
            replies.windows(2).all(|w| w[0] == w[1]),
            "a TCP connection moved: {replies:?}"
        );
        let replies = udp_session(client, DNS, 10).unwrap();
        assert!(
            replies.windows(2).all(|w| w[0] == w[1]),
            "a UDP flow moved: {replies:?}"
        );
    }
    // kube-proxy's sync metrics.
    let metrics = agent.metrics(&sandbox).unwrap();
    let syncs = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} ")
        })
        .and_then(|n| n.parse::<u64>().ok());
    assert!(syncs.is_some_and(|n| n >= 1), "{metrics}");
    assert!(
        metrics.contains("kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"} 1"),
        "{metrics}"
    );
    // Every Service and EndpointSlice of the manifest came in as a change; none waits.
    for line in [
        "kubeproxy_sync_proxy_rules_service_changes_pending 0",
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line}: {metrics}");
    }
    assert!(
        metrics.lines().any(
            |l| l.starts_with("kubeproxy_sync_proxy_rules_service_changes_total ")
                && !l.ends_with(" 0")
        ),
        "{metrics}"
    );
    // kube-proxy's other paths on the metrics port.
    assert_eq!(agent.metrics_path(&sandbox, "/proxyMode").unwrap(), "ebpf");
    assert_eq!(agent.metrics_path(&sandbox, "/healthz").unwrap(), "ok");

    // inspect, as people and scripts read it, while the agent runs.
    let table = agent.inspect_cli("services", &[]).unwrap();
    assert!(
        table.contains("10.96.0.10:80") && table.contains("10.244.1.13:8080"),
        "{table}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&agent.inspect_cli("conntrack", &["--json"]).unwrap()).unwrap();
    let flows = json.as_array().unwrap();
    assert!(
        flows
            .iter()
            .any(|f| f["service"] == "10.96.0.20:53" && f["protocol"] == "UDP"),
        "{json}"
    );
    assert!(flows.iter().any(|f| f["direction"] == "reply"));
}

#[test]
fn endpoint_and_service_changes_apply_live() {
    let Some((mut sandbox, agent)) = cluster("endpoint_and_service_changes_apply_live") else {
        return;
    };
    // Flows that must survive the edit: a UDP flow of an untouched service, and a TCP
    // connection to web on a backend that stays.
    let client = proxy_tests::Netns::open(&sandbox.pod("client").ns.name);
    let dns_flow = UdpConn::open(&client, DNS).unwrap();
    let dns_backend = dns_flow.ask("before").unwrap();
    let (mut web_conn, web_backend) = loop {
        let mut conn = TcpConn::open(&client, WEB).unwrap();
        let backend = conn.ask("before").unwrap();
        if backend != "be1" {
            break (conn, backend);
        }
    };

    edit_manifest(&agent.manifest, |objects| {
        remove_endpoint(objects, "web", "10.244.1.11")
    })
    .unwrap();
    agent
        .wait_for(&mut sandbox, "be1 leaving web", |rows| {
            rows.iter()
                .any(|r| r.address == "10.96.0.10:80" && r.backends.len() == 2)
        })
        .unwrap();
    assert_eq!(spread(&sandbox, WEB, false, 30), set(&["be2", "be3"]));
    assert_eq!(
        spread(&sandbox, DNS, true, 30),
        set(&["be1", "be4"]),
        "dns-like must be untouched"
    );
    assert_eq!(
        dns_flow.ask("after").unwrap(),
        dns_backend,
        "the untouched service's flow moved"
    );
    assert_eq!(
        web_conn.ask("after").unwrap(),
        web_backend,
        "a connection to a remaining backend broke"
    );

    // The Service goes away: its address stops answering new connections (it drains: the
    // connections established through it would keep their backend).
    edit_manifest(&agent.manifest, |objects| {
        objects.retain(|o| &*o.key().name != "remote")
    })
    .unwrap();
    agent
        .wait_for(&mut sandbox, "remote deleted", |rows| {
            rows.iter()
                .any(|r| r.address == "10.96.0.30:80" && r.draining)
        })
        .unwrap();
    assert!(
        tcp_request(&client, REMOTE, "hi").is_err(),
        "a deleted service must not answer"
    );

    // An endpoint comes back (the whole example again, replaced by rename).
    let started = Instant::now();
    std::fs::write(agent.manifest.with_extension("new"), EXAMPLE).unwrap();
    std::fs::rename(agent.manifest.with_extension("new"), &agent.manifest).unwrap();
    agent
        .wait_for(&mut sandbox, "the example restored", |rows| {
            rows.iter()
                .any(|r| r.address == "10.96.0.10:80" && r.backends.len() == 3)
                && rows
                    .iter()
                    .any(|r| r.address == "10.96.0.30:80" && !r.draining)
        })
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(
        spread(&sandbox, WEB, false, 40),
        set(&["be1", "be2", "be3"])
    );
    assert_eq!(spread(&sandbox, REMOTE, false, 3), set(&["be4"]));
}

#[test]
fn a_service_without_endpoints_is_refused_at_once() {
    let Some((mut sandbox, agent)) = cluster("a_service_without_endpoints_is_refused_at_once")
    else {
        return;
    };
    // remote (TCP) and dns-like (UDP) lose their endpoints (their EndpointSlices go); the
    // Services stay.
    edit_manifest(&agent.manifest, |objects| {
        objects.retain(|o| {
            !matches!(o, Object::EndpointSlice(_))
                || !["remote-m4b8d", "dns-like-q9fzt"].contains(&&*o.key().name)
        })
    })
    .unwrap();
    agent
        .wait_for(
            &mut sandbox,
            "remote and dns-like without endpoints",
            |rows| {
                [REMOTE, DNS].iter().all(|addr| {
                    rows.iter().any(|r| {
                        r.address == addr.to_string() && r.backends.is_empty() && !r.draining
                    })
                })
            },
        )
        .unwrap();
    let client = &sandbox.pod("client").ns;
    let (tcp, udp, took) = client.run(|| {
        let started = Instant::now();
        let tcp = std::net::TcpStream::connect_timeout(&REMOTE, Duration::from_secs(5));
        let udp = std::net::UdpSocket::bind("0.0.0.0:0").and_then(|socket| {
            socket.connect(DNS)?;
            socket.set_read_timeout(Some(Duration::from_secs(5)))?;
            socket.send(b"hi")?;
            socket.recv(&mut [0u8; 64])
        });
        (tcp.map(|_| ()), udp.map(|_| ()), started.elapsed())
    });
    let refused = std::io::ErrorKind::ConnectionRefused;
    assert_eq!(tcp.map_err(|e| e.kind()), Err(refused), "TCP");
    assert_eq!(udp.map_err(|e| e.kind()), Err(refused), "UDP");
    assert!(took < Duration::from_secs(1), "refused after {took:?}");
}

#[test]
fn affinity_local_traffic_and_terminating_endpoints_apply_end_to_end() {
    let Some((mut sandbox, agent)) =
        cluster("affinity_local_traffic_and_terminating_endpoints_apply_end_to_end")
    else {
        return;
    };
    // web gets sessionAffinity ClientIP; dns-like (be1 on node1, be4 on node2) gets
    // internalTrafficPolicy Local; the client pod is on node1.
    edit_manifest(&agent.manifest, |objects| {
        for object in objects.iter_mut() {
            let Object::Service(svc) = object else {
                continue;
            };
            let spec = svc.spec.get_or_insert_default();
            match svc.metadata.name.as_deref() {
                Some("web") => spec.session_affinity = Some("ClientIP".into()),
                Some("dns-like") => spec.internal_traffic_policy = Some("Local".into()),
                _ => {}
            }
        }
    })
    .unwrap();
    agent
        .wait_for(&mut sandbox, "the policies", |rows| {
            rows.iter()
                .any(|r| r.address == WEB.to_string() && r.affinity_timeout_seconds == Some(10800))
                && rows
                    .iter()
                    .any(|r| r.address == DNS.to_string() && r.local_only)
        })
        .unwrap();
    let web = spread(&sandbox, WEB, false, 20);
    assert_eq!(
        web.len(),
        1,
        "affinity: one backend for the client, got {web:?}"
    );
    assert_eq!(
        spread(&sandbox, DNS, true, 20),
        set(&["be1"]),
        "node1's endpoint only"
    );

    // A rollout's end: every web endpoint terminating but still serving. They keep answering
    // new connections (and affinity holds) rather than the service refusing.
    let syncs = || agent.log_text().matches("sync done").count();
    let before = syncs();
    edit_manifest(&agent.manifest, |objects| {
        for ip in ["10.244.1.11", "10.244.1.12", "10.244.1.13"] {
            set_conditions(objects, "web", ip, false, true, true);
        }
    })
    .unwrap();
    agent
        .wait_for(&mut sandbox, "web terminating", |_| syncs() > before)
        .unwrap();
    assert_eq!(spread(&sandbox, WEB, false, 10), web);
    let affinity = agent.inspect_cli("affinity", &[]).unwrap();
    assert!(affinity.contains("10.244.1.10"), "{affinity}");
}

#[test]
fn inspect_works_after_the_agent_stopped_and_bad_input_is_skipped() {
    let Some((mut sandbox, agent)) =
        cluster("inspect_works_after_the_agent_stopped_and_bad_input_is_skipped")
    else {
        return;
    };
    // An invalid Service next to valid ones: reported by name, the rest still programmed.
    let broken = format!(
        "{EXAMPLE}\n---\napiVersion: v1\nkind: Service\nmetadata: {{name: broken, namespace: demo}}\n\
         spec: {{clusterIP: 10.96.0.99, ports: [{{port: 70000, protocol: TCP}}]}}\n"
    );
    std::fs::write(agent.manifest.with_extension("new"), broken).unwrap();
    std::fs::rename(agent.manifest.with_extension("new"), &agent.manifest).unwrap();
    let deadline = Instant::now() + proxy_tests::patience(Duration::from_secs(10));
    while !agent.log_text().contains("broken") {
        assert!(
            Instant::now() < deadline,
            "the invalid Service was not reported:\n{}",
            agent.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        spread(&sandbox, WEB, false, 30),
        set(&["be1", "be2", "be3"])
    );

    sandbox.stop(agent.pid).unwrap();
    let table = agent.inspect_cli("services", &[]).unwrap();
    assert!(
        table.contains("10.96.0.30:80") && !table.contains("10.96.0.99"),
        "{table}"
    );
    let backends = agent.inspect_cli("backends", &["--json"]).unwrap();
    let backends: serde_json::Value = serde_json::from_str(&backends).unwrap();
    // web 3, dns-like 2, remote 1, front 4 (two ports, two endpoints), front-local 1.
    assert_eq!(backends.as_array().unwrap().len(), 11, "{backends}");
}

#[test]
fn an_agent_restart_keeps_flows_and_cleanup_removes_everything() {
    let Some((mut sandbox, mut agent)) =
        cluster("an_agent_restart_keeps_flows_and_cleanup_removes_everything")
    else {
        return;
    };
    let client = proxy_tests::Netns::open(&sandbox.pod("client").ns.name);
    let mut web_conn = TcpConn::open(&client, WEB).unwrap();
    let web_backend = web_conn.ask("before").unwrap();
    let dns_flow = UdpConn::open(&client, DNS).unwrap();
    let dns_backend = dns_flow.ask("before").unwrap();

    // No agent: the programs stay attached and keep serving from the pinned maps.
    agent.stop(&mut sandbox).unwrap();
    assert_eq!(web_conn.ask("agent gone").unwrap(), web_backend);
    assert_eq!(
        spread(&sandbox, WEB, false, 30),
        set(&["be1", "be2", "be3"])
    );

    // A new agent swaps its programs in where the old ones were; flows carry on.
    agent.start_again(&mut sandbox).unwrap();
    assert_eq!(web_conn.ask("agent back").unwrap(), web_backend);
    assert_eq!(dns_flow.ask("agent back").unwrap(), dns_backend);
    assert_eq!(
        spread(&sandbox, WEB, false, 30),
        set(&["be1", "be2", "be3"])
    );
    let log = agent.log_text();
    assert!(
        log.contains("recovered services from the pinned maps"),
        "{log}"
    );

    // Going back to kube-proxy: stop the agent and clean up; the ClusterIP is gone for good.
    agent.stop(&mut sandbox).unwrap();
    agent.cleanup(&sandbox).unwrap();
    // The kernel releases a link shortly after its last pin goes.
    let deadline = Instant::now() + proxy_tests::patience(Duration::from_secs(2));
    while tcp_request(&client, WEB, "hi").is_ok() {
        assert!(Instant::now() < deadline, "the programs must be detached");
        std::thread::sleep(Duration::from_millis(20));
    }
    let attached = sandbox.node1.exec("bpftool", &["net"]).unwrap();
    assert!(
        !attached.contains("tc_ingress") && !attached.contains("tc_egress"),
        "{attached}"
    );
    // The external programs too: no XDP on node1's eth0, and its NodePort is not served.
    let eth0 = sandbox.node1.ip(&["link", "show", "eth0"]).unwrap();
    assert!(!eth0.contains("prog/xdp"), "{eth0}");
    let node_port = SocketAddr::new(IpAddr::V4(NODE1_IP), FRONT_NODE_PORT);
    assert!(tcp_request(&sandbox.ext, node_port, "hi").is_err());
    let left: Vec<_> = std::fs::read_dir(agent.bpffs.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|name| !name.to_string_lossy().ends_with(".debug")) // the kernel's own
        .collect();
    assert!(left.is_empty(), "pins left behind: {left:?}");
}

#[test]
fn a_pod_reaches_itself_through_its_service() {
    if !privileged("a_pod_reaches_itself_through_its_service") {
        return;
    }
    let mut sandbox = Sandbox::build().expect("building the sandbox");
    sandbox
        .start_backends(BACKEND_PORT)
        .expect("starting the backends");
    // The client pod serves too, and is one of the endpoints of `self`.
    sandbox.start_backend("client", BACKEND_PORT).unwrap();
    let manifest = format!(
        "{EXAMPLE}\n---\napiVersion: v1\nkind: Service\nmetadata: {{name: self, namespace: demo}}\n\
         spec: {{clusterIP: 10.96.0.40, ports: [{{name: p, port: 80, protocol: TCP, targetPort: 8080}}, \
         {{name: u, port: 80, protocol: UDP, targetPort: 8080}}]}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: self-1, namespace: demo, labels: {{kubernetes.io/service-name: self}}}}\n\
         addressType: IPv4\nendpoints: [{{addresses: [10.244.1.10]}}, {{addresses: [10.244.1.11]}}]\n\
         ports: [{{name: p, port: 8080, protocol: TCP}}, {{name: u, port: 8080, protocol: UDP}}]\n"
    );
    let _agent = AgentRun::start(&mut sandbox, "node1", &manifest, 5).expect("starting the agent");
    let own = SocketAddr::from((Ipv4Addr::new(10, 96, 0, 40), 80));
    assert_eq!(spread(&sandbox, own, false, 30), set(&["be1", "client"]));
    assert_eq!(spread(&sandbox, own, true, 30), set(&["be1", "client"]));
    let client = &sandbox.pod("client").ns;
    for _ in 0..5 {
        let replies = tcp_session(client, own, 5).unwrap();
        assert!(replies.windows(2).all(|w| w[0] == w[1]), "{replies:?}");
    }
}

/// The pin directory stays locked for as long as the agent runs (not only while it starts): a
/// second agent on the same pins is refused, says why, and removes nothing of the first's.
#[test]
fn a_second_agent_on_the_same_pins_is_refused_while_the_first_runs() {
    let Some((sandbox, agent)) =
        cluster("a_second_agent_on_the_same_pins_is_refused_while_the_first_runs")
    else {
        return;
    };
    let mut second = std::process::Command::new(proxy_tests::agent::agent_bin().unwrap());
    second
        .args(["agent", "--proxy-mode", "ebpf", "--manifest"])
        .arg(&agent.manifest)
        .arg("--bpf-pin-dir")
        .arg(agent.bpffs.path())
        .arg("--bpf-cgroup-path")
        .arg(agent.cgroup.path())
        .args(["--healthz-bind-address", "", "--metrics-bind-address", ""]);
    proxy_tests::Netns::open(&sandbox.node1.name)
        .enter(&mut second)
        .unwrap();
    let mut child = second
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "the second agent is running on the first's pins: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the second agent ran: {log}");
    assert!(log.contains("another agent is using"), "{log}");
    let answer = tcp_request(&sandbox.pod("client").ns, WEB, "hi").unwrap();
    assert!(
        answer.starts_with("be"),
        "the first agent still serves: {answer}"
    );
}

/// kube-proxy's DaemonSet with only the image changed: the binary started as `kube-proxy
/// --config=<kubeadm's config.conf> --hostname-override=node1` (the mode set in the file, in
/// the nftables mode and the default one) and kube-proxy flags beside it, with this agent's
/// --manifest as the source. It serves, names each flag without effect once, and exits when the
/// file changes (as kube-proxy does: its DaemonSet then starts it again with the new file).
#[test]
fn kube_proxys_command_line_and_config_file_run_the_agent() {
    const TEST: &str = "kube_proxys_command_line_and_config_file_run_the_agent";
    if !privileged(TEST) {
        return;
    }
    let kubeadm = include_str!("../../proxy-userspace/src/kube_proxy/testdata/kubeadm.conf");
    for mode in ["nftables", ""] {
        let mut sandbox = Sandbox::build().expect("building the sandbox");
        sandbox.start_backends(BACKEND_PORT).unwrap();
        let config = kubeadm.replace("mode: \"\"", &format!("mode: \"{mode}\""));
        let extra = [
            "--v=2",
            "--detect-local-mode=NodeCIDR",
            "--iptables-sync-period=30s",
        ];
        let agent = AgentRun::start_as_kube_proxy(
            &mut sandbox,
            "node1",
            EXAMPLE,
            &config,
            &extra,
            Launch::Process,
        )
        .expect("starting the agent as kube-proxy");
        let log = agent.log_text();
        let dataplane = match mode {
            "" => "ebpf dataplane loaded",
            _ => "nftables dataplane ready",
        };
        assert!(log.contains(dataplane), "mode {mode:?}: {log}");
        assert_eq!(
            log.matches("--detect-local-mode is kube-proxy's and has no effect here")
                .count(),
            1,
            "{log}"
        );
        assert!(log.contains("--iptables-sync-period is ignored"), "{log}");
        let client = &sandbox.pod("client").ns;
        let answer = tcp_request(client, WEB, "hi").expect("web through the agent");
        assert!(answer.starts_with("be"), "{answer}");

        let changed = config.replace("verbosity: 0", "verbosity: 4");
        std::fs::write(agent.config_file(), changed).unwrap();
        let status = agent.wait_for_exit(&mut sandbox).unwrap();
        assert!(!status.success(), "{status}");
        assert!(
            agent.log_text().contains("config.conf changed: exiting"),
            "{}",
            agent.log_text()
        );
    }
}

/// With the manifest source, this node's Node object in the file gives its addresses, as the
/// API's would: NodePorts answer on them alone (`--nodeport-addresses primary`); when they
/// change, the agent exits to start again with them, as kube-proxy does.
#[test]
fn the_manifests_node_gives_the_node_addresses() {
    if !privileged("the_manifests_node_gives_the_node_addresses") {
        return;
    }
    let mut sandbox = Sandbox::build().expect("building the sandbox");
    sandbox
        .start_backends(BACKEND_PORT)
        .expect("starting the backends");
    // A second address on the default route's interface, which the Node does not name.
    sandbox
        .node1
        .ip(&["addr", "add", "192.0.2.111/24", "dev", "eth0"])
        .unwrap();
    let node = |address: &str| {
        format!(
            "\n---\napiVersion: v1\nkind: Node\nmetadata: {{name: node1}}\n\
             status: {{addresses: [{{type: InternalIP, address: {address}}}, \
             {{type: Hostname, address: node1}}]}}\n"
        )
    };
    let manifest = format!("{EXAMPLE}{}", node(&NODE1_IP.to_string()));
    let agent = AgentRun::start(&mut sandbox, "node1", &manifest, 5).expect("starting the agent");
    let log = agent.log_text();
    assert!(
        log.contains("addresses=192.0.2.11 (eth0)") && !log.contains("192.0.2.111"),
        "NodePorts should answer on the Node's InternalIP alone:\n{log}"
    );
    let answer = tcp_request(
        &sandbox.ext,
        SocketAddr::from((NODE1_IP, FRONT_NODE_PORT)),
        "hi",
    );
    assert!(answer.is_ok(), "{answer:?}");
    edit_manifest(&agent.manifest, |objects| {
        for object in objects.iter_mut() {
            if let Object::Node(n) = object {
                let status = n.status.as_mut().unwrap();
                status.addresses.as_mut().unwrap()[0].address = "192.0.2.111".into();
            }
        }
    })
    .unwrap();
    let status = agent.wait_for_exit(&mut sandbox).unwrap();
    let log = agent.log_text();
    assert!(
        !status.success()
            && log.contains("the Node's addresses changed from [192.0.2.11] to [192.0.2.111]"),
        "{status}: {log}"
    );
}
