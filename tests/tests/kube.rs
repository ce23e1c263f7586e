//! The Kubernetes source against the stand-in API server: the kube-rs watchers in-process
//! (sync gate, add/update/delete, slices, 410 re-list, server down), then the whole agent in the
//! sandbox driven through the API (traffic, deletion, health, 403, RBAC coverage).
use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddr, TcpListener},
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use proxy_tests::{
    BACKEND_PORT, NODE1_IP, Sandbox,
    agent::{AgentRun, AgentSource},
    apiserver::{self, ApiServer},
    privileged, rbac, tcp_request,
};
use proxy_userspace::{
    model::{ChangeTracker, DesiredState, NamespacedName, Protocol, ServicePortName},
    serve::healthz::ProxyHealth,
    source,
    sync::{RunnerConfig, SyncRunner},
};

/// The source running on its own runtime, and the state it has produced so far.
struct Watching {
    runtime: tokio::runtime::Runtime,
    tracker: Arc<Mutex<ChangeTracker>>,
    synced: Arc<AtomicBool>,
    state: DesiredState,
    _dir: TempDir,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Watching {
    fn start(api: &ApiServer, test: &str) -> Self {
        let dir =
            TempDir(std::env::temp_dir().join(format!("kube-src-{}-{test}", std::process::id())));
        std::fs::create_dir_all(&dir.0).unwrap();
        let kubeconfig = dir.0.join("kubeconfig");
        api.kubeconfig(&kubeconfig).unwrap();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let client = runtime
            .block_on(source::api::client(Some(&kubeconfig)))
            .unwrap();
        let tracker = Arc::new(Mutex::new(ChangeTracker::new()));
        // No runner: these tests read the tracker directly.
        let (_runner, handle) = SyncRunner::new(RunnerConfig {
            min_interval: Duration::ZERO,
            max_interval: Duration::from_secs(60),
            retry_interval: Duration::from_secs(1),
        });
        let (tx, rx) = tokio::sync::oneshot::channel();
        let synced = Arc::new(AtomicBool::new(false));
        let flag = synced.clone();
        runtime.spawn(async move {
            if rx.await.is_ok() {
                flag.store(true, Ordering::SeqCst);
            }
        });
        let health = Arc::new(ProxyHealth::new(Duration::from_secs(60)));
        runtime.spawn(source::api::run(
            client,
            "node1".into(),
            tracker.clone(),
            handle,
            health,
            tx,
        ));
        Self {
            runtime,
            tracker,
            synced,
            state: DesiredState::new("node1"),
            _dir: dir,
        }
    }

    /// Applies what the source produced until `ok` holds (10 s at most).
    fn wait(&mut self, what: &str, ok: impl Fn(&DesiredState) -> bool) {
        let deadline = Instant::now() + proxy_tests::patience(Duration::from_secs(10));
        loop {
            self.tracker.lock().unwrap().apply(&mut self.state);
            if ok(&self.state) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; state: {:#?}",
                self.state
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Watching {
    fn drop(&mut self) {
        // Don't wait for the watch streams.
        let runtime = std::mem::replace(
            &mut self.runtime,
            tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap(),
        );
        runtime.shutdown_background();
    }
}

fn spn(name: &str, port: &str) -> ServicePortName {
    ServicePortName::new(NamespacedName::new("default", name), port, Protocol::Tcp)
}

fn ips(state: &DesiredState, spn: &ServicePortName) -> BTreeSet<String> {
    state
        .endpoints_of(spn)
        .iter()
        .map(|e| e.ip.to_string())
        .collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

const HTTP: (&str, u16, &str) = ("http", 8080, "TCP");

fn web() -> serde_json::Value {
    apiserver::service("default", "web", "10.96.0.10", &[("http", 80, "TCP", 8080)])
}

#[test]
fn nothing_is_synced_before_services_and_slices_are_both_listed() {
    let api = ApiServer::start().unwrap();
    api.apply(web());
    api.forbid("endpointslices", true);
    let w = Watching::start(&api, "gate");
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        !w.synced.load(Ordering::SeqCst),
        "synced before the EndpointSlices were listed"
    );
    api.forbid("endpointslices", false);
    let deadline = Instant::now() + proxy_tests::patience(Duration::from_secs(15));
    while !w.synced.load(Ordering::SeqCst) {
        assert!(
            Instant::now() < deadline,
            "never synced after the slices became readable"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// This node's zone comes from its Node object's label, and follows it: topology hints then
/// give the node the endpoints hinted for its zone.
#[test]
fn the_nodes_zone_label_steers_topology_hints() {
    let api = ApiServer::start().unwrap();
    let mut w = Watching::start(&api, "zone");
    let web_http = spn("web", "http");
    let cluster = |s: &DesiredState| -> BTreeSet<String> {
        s.cluster_endpoints(&web_http)
            .iter()
            .map(|ep| ep.ip.to_string())
            .collect()
    };
    api.apply(web());
    let mut slice = apiserver::endpoint_slice(
        "default",
        "web-a",
        "web",
        &[
            ("10.244.1.11", true, Some("node1")),
            ("10.244.2.11", true, Some("node2")),
        ],
        &[HTTP],
    );
    for (i, zone) in ["zone-a", "zone-b"].into_iter().enumerate() {
        slice["endpoints"][i]["hints"] = serde_json::json!({"forZones": [{"name": zone}]});
    }
    api.apply(slice);
    let all = set(&["10.244.1.11", "10.244.2.11"]);
    w.wait("both endpoints: no zone yet", |s| cluster(s) == all);
    let mut node = apiserver::node("node1", "192.0.2.11");
    node["metadata"]["labels"]["topology.kubernetes.io/zone"] = serde_json::json!("zone-b");
    api.apply(node.clone());
    w.wait("zone-b's endpoint", |s| cluster(s) == set(&["10.244.2.11"]));
    node["metadata"]["labels"]["topology.kubernetes.io/zone"] = serde_json::json!("zone-a");
    api.apply(node);
    w.wait("zone-a's endpoint", |s| cluster(s) == set(&["10.244.1.11"]));
}

#[test]
fn services_and_slices_are_added_updated_merged_and_deleted() {
    let api = ApiServer::start().unwrap();
    let mut w = Watching::start(&api, "crud");
    let web_http = spn("web", "http");
    api.apply(web());
    api.apply(apiserver::endpoint_slice(
        "default",
        "web-a",
        "web",
        &[("10.244.1.11", true, Some("node1"))],
        &[HTTP],
    ));
    w.wait("web with one endpoint", |s| {
        ips(s, &web_http) == set(&["10.244.1.11"])
    });
    assert_eq!(
        w.state.port(&web_http).unwrap().cluster_ips,
        ["10.96.0.10".parse::<std::net::IpAddr>().unwrap()].into()
    );

    // A second slice (and a duplicate endpoint across slices), an update, a not-ready endpoint.
    api.apply(apiserver::endpoint_slice(
        "default",
        "web-b",
        "web",
        &[
            ("10.244.1.12", true, Some("node1")),
            ("10.244.1.11", true, Some("node1")),
            ("10.244.2.11", false, Some("node2")),
        ],
        &[HTTP],
    ));
    w.wait("slices merged", |s| {
        ips(s, &web_http) == set(&["10.244.1.11", "10.244.1.12", "10.244.2.11"])
    });
    let ready: BTreeSet<String> = w
        .state
        .ready_endpoints(&web_http)
        .map(|e| e.ip.to_string())
        .collect();
    assert_eq!(ready, set(&["10.244.1.11", "10.244.1.12"]));

    // The service's port changes.
    api.apply(apiserver::service(
        "default",
        "web",
        "10.96.0.10",
        &[("http", 8000, "TCP", 8080)],
    ));
    w.wait("port updated", |s| {
        s.port(&web_http).is_some_and(|p| p.port == 8000)
    });

    // A slice changes owner: its endpoints move to the other service.
    api.apply(apiserver::service(
        "default",
        "api",
        "10.96.0.11",
        &[("http", 80, "TCP", 8080)],
    ));
    api.apply(apiserver::endpoint_slice(
        "default",
        "web-a",
        "api",
        &[("10.244.1.11", true, None)],
        &[HTTP],
    ));
    let api_http = spn("api", "http");
    w.wait("slice moved", |s| {
        ips(s, &api_http) == set(&["10.244.1.11"]) && ips(s, &web_http).len() == 3
    });
    api.delete("EndpointSlice", Some("default"), "web-b");
    w.wait("web without endpoints", |s| ips(s, &web_http).is_empty());

    // Headless Services are not proxied.
    api.apply(apiserver::service(
        "default",
        "headless",
        "None",
        &[("http", 80, "TCP", 8080)],
    ));
    api.delete("Service", Some("default"), "web");
    w.wait("web deleted", |s| !s.contains(&web_http));
    assert!(!w.state.contains(&spn("headless", "http")));
}

#[test]
fn a_relist_after_410_deletes_what_went_missing() {
    let api = ApiServer::start().unwrap();
    let mut w = Watching::start(&api, "relist");
    api.apply(web());
    api.apply(apiserver::service(
        "default",
        "gone",
        "10.96.0.12",
        &[("http", 80, "TCP", 8080)],
    ));
    w.wait("both services", |s| s.port_count() == 2);
    // While the client is cut off, a Service is deleted and the history compacted: the watch
    // cannot resume (410), so the watcher must list again and notice the deletion.
    api.set_down(true);
    api.delete("Service", Some("default"), "gone");
    api.compact();
    std::thread::sleep(Duration::from_millis(300));
    api.set_down(false);
    w.wait("the deletion seen through the re-list", |s| {
        s.port_count() == 1 && s.contains(&spn("web", "http"))
    });
    assert!(
        api.requests()
            .iter()
            .filter(|r| r.resource == "services" && r.verb == "list")
            .count()
            >= 2
    );
}

#[test]
fn an_unreachable_api_server_keeps_the_last_state() {
    let api = ApiServer::start().unwrap();
    let mut w = Watching::start(&api, "down");
    api.apply(web());
    api.apply(apiserver::endpoint_slice(
        "default",
        "web-a",
        "web",
        &[("10.244.1.11", true, None)],
        &[HTTP],
    ));
    w.wait("web", |s| ips(s, &spn("web", "http")).len() == 1);
    api.set_down(true);
    std::thread::sleep(Duration::from_secs(2));
    w.wait("nothing lost while down", |s| {
        ips(s, &spn("web", "http")).len() == 1
    });
    api.set_down(false);
    api.apply(apiserver::service(
        "default",
        "later",
        "10.96.0.13",
        &[("http", 80, "TCP", 8080)],
    ));
    w.wait("changes flow again", |s| s.contains(&spn("later", "http")));
}

#[test]
fn the_agent_serves_services_created_through_the_api() {
    if !privileged("the_agent_serves_services_created_through_the_api") {
        return;
    }
    let mut sandbox = Sandbox::build().unwrap();
    sandbox.start_backends(BACKEND_PORT).unwrap();
    let api = api_on_node1(&sandbox);
    // A second address on the default route's interface: the Node object names only the first,
    // so NodePorts answer there alone (without the Node, both would be taken).
    sandbox
        .node1
        .ip(&["addr", "add", "192.0.2.111/24", "dev", "eth0"])
        .unwrap();
    // A health check node port something else holds on the node.
    let squatter = sandbox
        .node1
        .try_run(|| TcpListener::bind((Ipv4Addr::UNSPECIFIED, 32199)))
        .unwrap()
        .unwrap();
    let agent = AgentRun::start_from(&mut sandbox, "node1", AgentSource::Api(&api), 0).unwrap();
    // kube-proxy's Events: it started, on its Node.
    let starting = eventually_event(&api, "Starting");
    assert_eq!(starting["regarding"]["kind"], "Node", "{starting}");
    assert_eq!(starting["regarding"]["name"], "node1", "{starting}");
    assert_eq!(starting["type"], "Normal", "{starting}");
    assert_eq!(starting["reportingController"], "kube-proxy", "{starting}");
    assert_eq!(starting["reportingInstance"], "node1", "{starting}");
    assert_eq!(starting["action"], "StartKubeProxy", "{starting}");
    let mut lb = apiserver::service("demo", "lb", "10.96.0.30", &[("http", 80, "TCP", 8080)]);
    lb["spec"]["type"] = "LoadBalancer".into();
    lb["spec"]["externalTrafficPolicy"] = "Local".into();
    lb["spec"]["healthCheckNodePort"] = 32199.into();
    lb["spec"]["ports"][0]["nodePort"] = 30091.into();
    api.apply(lb);
    let failed = eventually_event(&api, "FailedToStartServiceHealthcheck");
    assert_eq!(failed["regarding"]["kind"], "Service", "{failed}");
    assert_eq!(failed["regarding"]["namespace"], "demo", "{failed}");
    assert_eq!(failed["regarding"]["name"], "lb", "{failed}");
    assert_eq!(failed["metadata"]["namespace"], "demo", "{failed}");
    assert_eq!(failed["type"], "Warning", "{failed}");
    assert!(
        failed["note"].as_str().unwrap().contains("port 32199"),
        "{failed}"
    );
    drop(squatter);
    api.delete("Service", Some("demo"), "lb");

    let mut web = apiserver::service("demo", "web", "10.96.0.10", &[("http", 80, "TCP", 8080)]);
    web["spec"]["type"] = "NodePort".into();
    web["spec"]["ports"][0]["nodePort"] = 30090.into();
    api.apply(web);
    api.apply(apiserver::endpoint_slice(
        "demo",
        "web-1",
        "web",
        &[
            ("10.244.1.11", true, Some("node1")),
            ("10.244.1.12", true, Some("node1")),
            ("10.244.2.11", true, Some("node2")),
        ],
        &[HTTP],
    ));
    agent
        .wait_for(&mut sandbox, "web programmed", |rows| {
            rows.iter()
                .any(|r| r.address == "10.96.0.10:80" && r.backends.len() == 3)
        })
        .unwrap();
    let vip = SocketAddr::from((Ipv4Addr::new(10, 96, 0, 10), 80));
    let client = &sandbox.pod("client").ns;
    let seen: BTreeSet<String> = (0..40)
        .map(|_| tcp_request(client, vip, "hi").unwrap().trim().to_owned())
        .collect();
    assert_eq!(seen, set(&["be1", "be2", "be4"]));
    // The slice's change reached the datapath: kube-proxy's network programming latency has it
    // (its trigger time has second precision: at most a few seconds here).
    let metrics = agent.metrics(&sandbox).unwrap();
    let count = metric_value(
        &metrics,
        "kubeproxy_network_programming_duration_seconds_count{ip_family=\"IPv4\"}",
    );
    let sum = metric_value(
        &metrics,
        "kubeproxy_network_programming_duration_seconds_sum{ip_family=\"IPv4\"}",
    );
    assert!(count >= 1.0 && sum < 5.0 * count, "{metrics}");
    // The NodePort, from outside, on the Node object's address only.
    let log = agent.log_text();
    assert!(
        log.contains("addresses=192.0.2.11 (eth0)") && !log.contains("192.0.2.111"),
        "NodePorts should answer on the Node's InternalIP alone:\n{log}"
    );
    let node_port = SocketAddr::from((NODE1_IP, 30090));
    let answer = tcp_request(&sandbox.ext, node_port, "hi").unwrap();
    assert!(seen.contains(answer.trim()), "{answer}");

    let (code, body) = agent.healthz(&sandbox, "/healthz").unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("\"nodeEligible\": true") && body.contains("lastUpdated"),
        "{body}"
    );
    assert_eq!(agent.healthz(&sandbox, "/livez").unwrap().0, 200);

    api.delete("Service", Some("demo"), "web");
    agent
        .wait_for(&mut sandbox, "web removed (draining)", |rows| {
            rows.iter().all(|r| r.draining)
        })
        .unwrap();
    assert!(
        tcp_request(&sandbox.pod("client").ns, vip, "hi").is_err(),
        "a deleted Service must not answer"
    );

    // Losing the permission to list Services: the log says which, nothing is deleted.
    api.apply(apiserver::service(
        "demo",
        "kept",
        "10.96.0.20",
        &[("http", 80, "TCP", 8080)],
    ));
    api.apply(apiserver::endpoint_slice(
        "demo",
        "kept-1",
        "kept",
        &[("10.244.1.13", true, None)],
        &[HTTP],
    ));
    agent
        .wait_for(&mut sandbox, "kept programmed", |rows| {
            rows.iter().filter(|r| !r.draining).count() == 1
        })
        .unwrap();
    api.forbid("services", true);
    api.compact();
    let deadline = Instant::now() + proxy_tests::patience(Duration::from_secs(15));
    while !agent
        .log_text()
        .contains("must allow list and watch on services")
    {
        assert!(
            Instant::now() < deadline,
            "no 403 hint in the log:\n{}",
            agent.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let kept = SocketAddr::from((Ipv4Addr::new(10, 96, 0, 20), 80));
    assert_eq!(
        tcp_request(&sandbox.pod("client").ns, kept, "hi")
            .unwrap()
            .trim(),
        "be3"
    );

    // Every request the agent made is one the deployed ClusterRole allows.
    let role = rbac::load_cluster_role(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/kube-proxy-ebpf.yaml"
    ))
    .unwrap();
    let requests = api.requests();
    assert!(
        requests
            .iter()
            .any(|r| r.resource == "nodes" && r.verb == "watch"),
        "{requests:#?}"
    );
    for r in requests.iter().filter(|r| !r.resource.is_empty()) {
        assert!(
            rbac::rbac_allows(&role, &r.verb, &r.group, &r.resource),
            "the ClusterRole does not allow {r:?}"
        );
    }

    // The Node's address changes: the agent exits, as kube-proxy does, to start again with it.
    api.apply(apiserver::node("node1", "192.0.2.111"));
    let status = agent.wait_for_exit(&mut sandbox).unwrap();
    let log = agent.log_text();
    assert!(
        !status.success()
            && log.contains("the Node's addresses changed from [192.0.2.11] to [192.0.2.111]"),
        "{status}: {log}"
    );
}

/// The stand-in API server on node1's loopback, where the agent runs, holding node1's Node.
fn api_on_node1(sandbox: &Sandbox) -> ApiServer {
    let listener = sandbox
        .node1
        .try_run(|| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
        .unwrap()
        .unwrap();
    let api = ApiServer::start_with_listener(listener).unwrap();
    api.apply(apiserver::node("node1", &NODE1_IP.to_string()));
    api
}

/// The first Event with `reason` the agent posted (waiting for it, 10 s at most).
fn eventually_event(api: &ApiServer, reason: &str) -> serde_json::Value {
    let deadline = Instant::now() + proxy_tests::patience(Duration::from_secs(10));
    loop {
        if let Some(event) = api.events().into_iter().find(|e| e["reason"] == reason) {
            return event;
        }
        assert!(
            Instant::now() < deadline,
            "no {reason} Event: {:#?}",
            api.events()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The value of the sample named `name` (with its labels, if any) in a Prometheus text page.
fn metric_value(page: &str, name: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{page}"))
}

/// The health server's port is taken (by kube-proxy, still running, say): the start fails with
/// what to do, and kube-proxy's Event says so on the Node.
#[test]
fn a_taken_health_port_fails_the_start_with_an_event() {
    if !privileged("a_taken_health_port_fails_the_start_with_an_event") {
        return;
    }
    let mut sandbox = Sandbox::build().unwrap();
    let api = api_on_node1(&sandbox);
    let _kube_proxy = sandbox
        .node1
        .try_run(|| TcpListener::bind((Ipv4Addr::LOCALHOST, 10256)))
        .unwrap()
        .unwrap();
    let Err(e) = AgentRun::start_from(&mut sandbox, "node1", AgentSource::Api(&api), 0) else {
        panic!("the agent started on a taken health port");
    };
    assert!(
        format!("{e:#}").contains("is kube-proxy still running on this node?"),
        "{e:#}"
    );
    let event = eventually_event(&api, "FailedToStartProxierHealthcheck");
    assert_eq!(event["regarding"]["kind"], "Node", "{event}");
    assert_eq!(event["type"], "Warning", "{event}");
    assert!(
        event["note"].as_str().unwrap().contains("127.0.0.1:10256"),
        "{event}"
    );
}

/// The ServiceCIDR objects the API serves reach the nftables mode, which drops traffic to the
/// unallocated cluster IPs in them, as kube-proxy's does; a range deleted is dropped no more.
#[test]
fn service_cidrs_from_the_api_drop_unallocated_cluster_ips() {
    if !privileged("service_cidrs_from_the_api_drop_unallocated_cluster_ips") {
        return;
    }
    let mut sandbox = Sandbox::build().unwrap();
    sandbox.start_backends(BACKEND_PORT).unwrap();
    let api = api_on_node1(&sandbox);
    let extra = [
        "--proxy-mode",
        "nftables",
        "--cluster-cidr",
        "10.244.0.0/16",
    ];
    let agent = AgentRun::start_with_args(&mut sandbox, "node1", AgentSource::Api(&api), 0, &extra)
        .unwrap();
    let check_chain = |sandbox: &Sandbox| -> String {
        sandbox
            .node1
            .try_run(|| {
                std::process::Command::new("nft")
                    .args(["list", "chain", "ip", "kube-proxy", "cluster-ips-check"])
                    .output()
            })
            .unwrap()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap()
    };
    let drops = |text: &str| text.contains("ip daddr 10.96.0.0/16 drop");
    assert!(!drops(&check_chain(&sandbox)), "no ServiceCIDR yet");
    api.apply(serde_json::json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "ServiceCIDR",
        "metadata": {"name": "kubernetes"},
        "spec": {"cidrs": ["10.96.0.0/16", "fd00:10:96::/112"]},
    }));
    let deadline = Instant::now() + proxy_tests::patience(Duration::from_secs(10));
    while !drops(&check_chain(&sandbox)) {
        assert!(
            Instant::now() < deadline,
            "no drop rule: {}\n{}",
            check_chain(&sandbox),
            agent.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    api.delete("ServiceCIDR", None, "kubernetes");
    let deadline = Instant::now() + proxy_tests::patience(Duration::from_secs(10));
    while drops(&check_chain(&sandbox)) {
        assert!(Instant::now() < deadline, "the drop rule stays");
        std::thread::sleep(Duration::from_millis(50));
    }
}
