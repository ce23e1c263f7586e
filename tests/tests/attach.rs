//! New pods are served from their first packet: the agent attaches its programs to a pod's
//! interface as the kernel announces it, not at its next poll, and not after the sync that is
//! running. A pod's first packet to a ClusterIP (typically its first DNS query) is otherwise
//! sent untranslated, and lost.
//!
//! Each pod is added the way CNI plugins do it (the veth made in the pod's namespace, moved to
//! the node under a temporary name, renamed there) and queries the ClusterIP at once: one
//! datagram, one second for the answer, no retry.
use std::{
    fmt::Write as _,
    net::{Ipv4Addr, UdpSocket},
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::Context;
use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData};
use proxy_common::{
    AGENT_STATE_LAYOUT, LAYOUT_VERSION, MAP_AGENT_STATE, MAP_SERVICES, ServiceKey, ServiceValue,
};
use proxy_tests::example::{DNS, MANIFEST as EXAMPLE};
use proxy_tests::{
    BACKEND_PORT, Pod, Sandbox,
    agent::{AgentRun, TestCgroup, agent_bin},
    patience, privileged,
    programs::PrivateBpffs,
};

/// The pod's first query to dns-like, sent once; the backend that answered.
fn first_query(pod: &Pod) -> anyhow::Result<String> {
    pod.ns
        .try_run(|| -> anyhow::Result<String> {
            let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
            socket.connect(DNS)?;
            // Long enough for two neighbour resolution retransmissions (1 s each): the pod and
            // its node-side interface are seconds old, and a fresh sandbox's first contact
            // sometimes waits for one (see `Sandbox::resolve_neighbours`).
            socket.set_read_timeout(Some(patience(Duration::from_secs(3))))?;
            let sent = utc_time_of_day();
            socket.send(b"first\n")?;
            let mut buf = [0; 512];
            let n = socket
                .recv(&mut buf)
                .with_context(|| format!("no answer to the query sent at {sent}"))?;
            Ok(String::from_utf8_lossy(&buf[..n]).trim().to_owned())
        })?
        .with_context(|| format!("the first query of pod {} to {DNS}", pod.name))
}

/// The time of day, as the agent's log shows it (`13:42:28.268228`): a failure's message then
/// says whether the pod's query went before its interface's programs were attached.
fn utc_time_of_day() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let s = now.as_secs() % 86_400;
    format!(
        "{:02}:{:02}:{:02}.{:06}",
        s / 3600,
        s / 60 % 60,
        s % 60,
        now.subsec_micros()
    )
}

fn assert_served(pod: &Pod, log: impl Fn() -> String) {
    match first_query(pod) {
        Ok(answer) => assert!(answer == "be1" || answer == "be4", "{answer}"),
        Err(e) => panic!("{e:#}; agent log:\n{}", log()),
    }
}

/// Every link pinned under `pin_dir` (tcx, kernels 6.6 and later: `tc-<ifindex>-<direction>`)
/// is on an interface `node` still has.
fn assert_pins_of_present_interfaces(sandbox: &Sandbox, node: &str, pin_dir: &Path) {
    let links = sandbox.node(node).ip(&["-o", "link", "show"]).unwrap();
    let present: Vec<&str> = links.lines().filter_map(|l| l.split(':').next()).collect();
    for pin in std::fs::read_dir(pin_dir.join("links")).unwrap() {
        let name = pin.unwrap().file_name().into_string().unwrap();
        let index = name.split('-').nth(1).unwrap_or_default();
        assert!(
            present.contains(&index),
            "pin {name} of a vanished interface; links:\n{links}"
        );
    }
}

#[test]
fn new_pods_are_served_from_their_first_packet() {
    if !privileged("new_pods_are_served_from_their_first_packet") {
        return;
    }
    let mut sandbox = Sandbox::build().expect("building the sandbox");
    sandbox.start_backends(BACKEND_PORT).unwrap();
    let agent = AgentRun::start(&mut sandbox, "node1", EXAMPLE, 3).expect("starting the agent");
    for (name, octet) in [("new1", 21), ("new2", 22), ("new3", 23)] {
        let pod = sandbox.add_pod(name, "node1", octet).unwrap();
        assert_served(pod, || agent.log_text());
    }
    // A pod deleted and made again under the same name: an interface of the same name with
    // another index.
    sandbox.remove_pod("new1").unwrap();
    let pod = sandbox.add_pod("new1", "node1", 21).unwrap();
    assert_served(pod, || agent.log_text());
    // The pins of the deleted interface went with it.
    assert_pins_of_present_interfaces(&sandbox, "node1", agent.bpffs.path());
}

/// Services to keep the agent's sync busy: `count` ClusterIPs (10.96.128.0 and up) with
/// `endpoints` endpoints each, as multi-document YAML.
fn bulk_services(count: usize, endpoints: usize) -> String {
    let mut out = String::new();
    for i in 0..count {
        let ip = format!("10.96.{}.{}", 128 + i / 256, i % 256);
        let addresses: Vec<String> = (0..endpoints)
            .map(|e| format!("{{addresses: [10.244.{}.{}]}}", 100 + e / 250, 1 + e % 250))
            .collect();
        write!(
            out,
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: bulk-{i}, namespace: bulk}}\n\
             spec: {{clusterIP: {ip}, ports: [{{name: p, port: 80, protocol: TCP, targetPort: 8080}}]}}\n\
             ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {{name: bulk-{i}-1, namespace: bulk, labels: {{kubernetes.io/service-name: bulk-{i}}}}}\n\
             addressType: IPv4\nendpoints: [{}]\nports: [{{name: p, port: 8080, protocol: TCP}}]\n",
            addresses.join(", ")
        )
        .unwrap();
    }
    out
}

/// The agent in node1 on `manifest`, with maps big enough for the bulk services; its log
/// goes to `log`. Returns its pid (the sandbox stops it).
fn spawn_agent(
    sandbox: &mut Sandbox,
    pin_dir: &Path,
    cgroup: &TestCgroup,
    manifest: &Path,
    log: &Path,
) -> u32 {
    let mut cmd = Command::new(agent_bin().unwrap());
    cmd.arg("agent")
        .arg("--bpf-cgroup-path")
        .arg(cgroup.path())
        .arg("--manifest")
        .arg(manifest)
        .arg("--bpf-pin-dir")
        .arg(pin_dir)
        .args(["--min-sync-period", "0s"])
        .args(["--healthz-bind-address", "", "--metrics-bind-address", ""])
        .args([
            "--bpf-services-max",
            "262144",
            "--bpf-backends-max",
            "262144",
        ])
        .args(["--bpf-ct-max", "16384"])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap());
    let node1 = proxy_tests::Netns::open(&sandbox.node1.name);
    sandbox.spawn(&node1, cmd).unwrap()
}

/// The entries of the pinned services map, counted up to `limit`.
fn services_entries(pin_dir: &Path, limit: usize) -> usize {
    let map = MapData::from_pin(pin_dir.join(MAP_SERVICES)).unwrap();
    let map: BpfHashMap<_, ServiceKey, ServiceValue> = Map::HashMap(map).try_into().unwrap();
    map.keys().take(limit).count()
}

/// Waits until the log at `log` says `what` (polling every millisecond: the caller acts on it).
fn wait_for_log(log: &Path, what: &str, within: Duration) -> String {
    let deadline = Instant::now() + patience(within);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains(what) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "no {what:?} in the agent's log:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The large node: a restarted agent's cold sync of many services holds the dataplane
/// for a while, and a pod started meanwhile must not wait for it.
#[test]
fn a_new_pod_is_served_while_a_long_sync_runs() {
    if !privileged("a_new_pod_is_served_while_a_long_sync_runs") {
        return;
    }
    let mut sandbox = Sandbox::build().expect("building the sandbox");
    sandbox.start_backends(BACKEND_PORT).unwrap();
    let bpffs = PrivateBpffs::new().unwrap();
    let cgroup = TestCgroup::new().unwrap();
    let dir = tempdir(&sandbox.prefix);
    let manifest = dir.join("services.yaml");
    let log = dir.join("agent.log");

    // The example's services first, so that dns-like is in the (pinned) maps before the
    // restarted agent's long sync starts, and stays there throughout.
    std::fs::write(&manifest, EXAMPLE).unwrap();
    let pid = spawn_agent(&mut sandbox, bpffs.path(), &cgroup, &manifest, &log);
    wait_for_log(&log, "full sync done", Duration::from_secs(10));
    sandbox.stop(pid).unwrap();
    let before = services_entries(bpffs.path(), usize::MAX);

    // Restarted with many more services: its first (full) sync writes them all, holding the
    // dataplane for a second or so. The new pod comes up once that sync has begun writing.
    // (Under software emulation, where everything is slower, fewer services do.)
    let slowness = patience(Duration::from_secs(1)).as_secs().max(1) as usize;
    let bulk = bulk_services(20_000 / slowness, 4);
    std::fs::write(&manifest, format!("{EXAMPLE}\n{bulk}")).unwrap();
    let log2 = dir.join("agent2.log");
    spawn_agent(&mut sandbox, bpffs.path(), &cgroup, &manifest, &log2);
    wait_for_log(&log2, "ebpf dataplane loaded", Duration::from_secs(60));
    let deadline = Instant::now() + patience(Duration::from_secs(30));
    while services_entries(bpffs.path(), before + 1) <= before {
        assert!(Instant::now() < deadline, "the sync did not start");
        std::thread::sleep(Duration::from_millis(1));
    }
    let pod = sandbox.add_pod("new1", "node1", 21).unwrap();
    let read_log = || std::fs::read_to_string(&log2).unwrap_or_default();
    assert_served(pod, read_log);

    // It was served during the sync, not by chance after it.
    let text = wait_for_log(&log2, "full sync done", Duration::from_secs(60));
    let attached = text
        .lines()
        .position(|l| l.contains("attached tc programs") && l.contains("veth-new1"))
        .unwrap_or_else(|| panic!("veth-new1 not attached:\n{text}"));
    let synced = text.lines().position(|l| l.contains("full sync done"));
    assert!(
        synced.is_some_and(|synced| attached < synced),
        "the sync ended before the pod came up: make it longer\n{text}"
    );
    drop(sandbox);
    let _ = std::fs::remove_dir_all(&dir);
}

/// An upgrade whose maps are of another layout (here: a newer agent's, so that every pin is
/// recreated): the programs serving keep their own maps until the new agent's first sync has
/// filled the new ones, and only then do the new programs take over. Pods are served all
/// along.
#[test]
fn recreated_maps_are_filled_before_the_programs_take_over() {
    if !privileged("recreated_maps_are_filled_before_the_programs_take_over") {
        return;
    }
    let mut sandbox = Sandbox::build().expect("building the sandbox");
    sandbox.start_backends(BACKEND_PORT).unwrap();
    let bpffs = PrivateBpffs::new().unwrap();
    let cgroup = TestCgroup::new().unwrap();
    let dir = tempdir(&format!("{}-upgrade", sandbox.prefix));
    let manifest = dir.join("services.yaml");
    let log = dir.join("agent.log");
    std::fs::write(&manifest, EXAMPLE).unwrap();
    let pid = spawn_agent(&mut sandbox, bpffs.path(), &cgroup, &manifest, &log);
    wait_for_log(&log, "full sync done", Duration::from_secs(10));
    sandbox.stop(pid).unwrap();
    {
        let data = MapData::from_pin(bpffs.path().join(MAP_AGENT_STATE)).unwrap();
        let mut state: Array<_, u64> = Map::Array(data).try_into().unwrap();
        state
            .set(AGENT_STATE_LAYOUT, LAYOUT_VERSION + 1, 0)
            .unwrap();
    }

    // Many services, so that the first sync takes a while.
    let slowness = patience(Duration::from_secs(1)).as_secs().max(1) as usize;
    let bulk = bulk_services(20_000 / slowness, 4);
    std::fs::write(&manifest, format!("{EXAMPLE}\n{bulk}")).unwrap();
    let log2 = dir.join("agent2.log");
    spawn_agent(&mut sandbox, bpffs.path(), &cgroup, &manifest, &log2);
    let read_log = || std::fs::read_to_string(&log2).unwrap_or_default();
    wait_for_log(&log2, "maps were recreated", Duration::from_secs(60));
    let deadline = Instant::now() + patience(Duration::from_secs(30));
    while services_entries(bpffs.path(), 1) == 0 {
        assert!(Instant::now() < deadline, "the sync did not start");
        std::thread::sleep(Duration::from_millis(1));
    }
    // During the sync: the old programs, on their old maps.
    let client = sandbox.pod("client");
    assert_served(client, read_log);
    assert!(
        !read_log().contains("programs attached"),
        "the new programs took over before the query: make the sync longer\n{}",
        read_log()
    );
    let text = wait_for_log(&log2, "full sync done", Duration::from_secs(60));
    let attached = text
        .find("programs attached")
        .expect("the programs attached");
    let loaded = text.find("maps were recreated").unwrap();
    assert!(loaded < attached, "{text}");
    // The new programs, on the new maps.
    assert_served(sandbox.pod("client"), read_log);
    drop(sandbox);
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempdir(prefix: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("{prefix}-attach"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
