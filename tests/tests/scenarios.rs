//! The scenario suite (`proxy_tests::scenarios`) in every mode that runs here on every node
//! shape, one test each; every test rewrites `docs/parity.md` from the results of all.
use std::sync::Mutex;

use proxy_tests::{
    BACKEND_PORT, Sandbox, Shape,
    agent::{AgentRun, AgentSource},
    example::{MANIFEST, WEB},
    privileged,
    scenarios::{self, Stack},
    tcp_request,
};

/// Runs the suite in `mode` with pods wired as `shape` on the Services of `stack`, then writes
/// the parity tables (even when scenarios failed: the tables show which).
fn suite(test: &str, mode: &str, shape: Shape, stack: Stack) {
    static TABLE: Mutex<()> = Mutex::new(());
    let result = std::panic::catch_unwind(|| scenarios::run(test, mode, shape, stack));
    {
        let _one_writer = TABLE.lock().unwrap_or_else(|e| e.into_inner());
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/parity.md");
        std::fs::write(&path, scenarios::render_parity()).expect("writing docs/parity.md");
    }
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

/// One test a mode and shape: routed pods (`<mode>`), bridged (`<mode>_bridge`), named as the
/// AWS VPC CNI names them (`<mode>_eni`), bridged behind a VXLAN overlay (`<mode>_overlay`),
/// and named after the pod on multi-homed nodes (`<mode>_multihomed`), on IPv4 Services; for
/// the modes that serve IPv6, on IPv6 (`_ipv6`) and dual-stack (`_dual_stack`) Services too;
/// the others (the IPVS and userspace modes' shapes but routed) on dual-stack Services with
/// routed pods.
/// The IPVS ones are skipped (loudly) where the kernel has no IPVS: `cargo xtask vm-test` runs
/// them.
macro_rules! suites {
    ($stack:ident; $($mode:literal: $($test:ident $shape:ident),*;)*) => {$($(
        #[test]
        fn $test() {
            let test = concat!("scenarios::", stringify!($test));
            suite(test, $mode, Shape::$shape, Stack::$stack);
        }
    )*)*};
}

suites! {
    Ipv6;
    "ebpf": ebpf_ipv6 Routed, ebpf_bridge_ipv6 Bridge, ebpf_eni_ipv6 Eni,
        ebpf_overlay_ipv6 Overlay, ebpf_multihomed_ipv6 MultiHomed;
    "iptables-legacy": iptables_legacy_ipv6 Routed, iptables_legacy_bridge_ipv6 Bridge,
        iptables_legacy_eni_ipv6 Eni, iptables_legacy_overlay_ipv6 Overlay,
        iptables_legacy_multihomed_ipv6 MultiHomed;
    "iptables-nft": iptables_nft_ipv6 Routed, iptables_nft_bridge_ipv6 Bridge,
        iptables_nft_eni_ipv6 Eni, iptables_nft_overlay_ipv6 Overlay,
        iptables_nft_multihomed_ipv6 MultiHomed;
    "nftables": nftables_ipv6 Routed, nftables_bridge_ipv6 Bridge, nftables_eni_ipv6 Eni,
        nftables_overlay_ipv6 Overlay, nftables_multihomed_ipv6 MultiHomed;
    "ipvs": ipvs_ipv6 Routed;
    "userspace": userspace_ipv6 Routed, userspace_bridge_ipv6 Bridge, userspace_eni_ipv6 Eni,
        userspace_overlay_ipv6 Overlay, userspace_multihomed_ipv6 MultiHomed;
}

suites! {
    DualStack;
    "ebpf": ebpf_dual_stack Routed, ebpf_bridge_dual_stack Bridge, ebpf_eni_dual_stack Eni,
        ebpf_overlay_dual_stack Overlay, ebpf_multihomed_dual_stack MultiHomed;
    "ipvs": ipvs_dual_stack Routed;
    "userspace": userspace_dual_stack Routed;
    "iptables-legacy": iptables_legacy_dual_stack Routed, iptables_legacy_bridge_dual_stack Bridge,
        iptables_legacy_eni_dual_stack Eni, iptables_legacy_overlay_dual_stack Overlay,
        iptables_legacy_multihomed_dual_stack MultiHomed;
    "iptables-nft": iptables_nft_dual_stack Routed, iptables_nft_bridge_dual_stack Bridge,
        iptables_nft_eni_dual_stack Eni, iptables_nft_overlay_dual_stack Overlay,
        iptables_nft_multihomed_dual_stack MultiHomed;
    "nftables": nftables_dual_stack Routed, nftables_bridge_dual_stack Bridge,
        nftables_eni_dual_stack Eni, nftables_overlay_dual_stack Overlay,
        nftables_multihomed_dual_stack MultiHomed;
}

suites! {
    Ipv4;
    "ebpf": ebpf Routed, ebpf_bridge Bridge, ebpf_eni Eni, ebpf_overlay Overlay,
        ebpf_multihomed MultiHomed;
    "iptables-legacy": iptables_legacy Routed, iptables_legacy_bridge Bridge,
        iptables_legacy_eni Eni, iptables_legacy_overlay Overlay,
        iptables_legacy_multihomed MultiHomed;
    "iptables-nft": iptables_nft Routed, iptables_nft_bridge Bridge, iptables_nft_eni Eni,
        iptables_nft_overlay Overlay, iptables_nft_multihomed MultiHomed;
    "nftables": nftables Routed, nftables_bridge Bridge, nftables_eni Eni,
        nftables_overlay Overlay, nftables_multihomed MultiHomed;
    "ipvs": ipvs Routed, ipvs_bridge Bridge, ipvs_eni Eni, ipvs_overlay Overlay,
        ipvs_multihomed MultiHomed;
    "userspace": userspace Routed, userspace_bridge Bridge, userspace_eni Eni,
        userspace_overlay Overlay, userspace_multihomed MultiHomed;
}

/// `--proxy-mode auto` where the BPF programs cannot load (a services map of 0 entries makes
/// the kernel refuse it): the agent says why and serves with the nftables mode, leaving no
/// BPF pins behind.
#[test]
fn auto_mode_falls_back_to_nftables_where_ebpf_cannot_load() {
    if !privileged("auto_mode_falls_back_to_nftables_where_ebpf_cannot_load") {
        return;
    }
    let mut sandbox = Sandbox::build().expect("building the sandbox");
    sandbox.start_backends(BACKEND_PORT).unwrap();
    let agent = AgentRun::start_with_args(
        &mut sandbox,
        "node1",
        AgentSource::Manifest(MANIFEST),
        0,
        &["--proxy-mode", "auto", "--bpf-services-max", "0"],
    )
    .expect("the agent in auto mode");
    let log = agent.log_text();
    assert!(
        log.contains("the ebpf mode cannot run here")
            && log.contains("using the first mode that works here")
            && log.contains("mode=\"nftables\""),
        "{log}"
    );
    let answer = tcp_request(&sandbox.pod("client").ns, WEB, "hi").unwrap();
    assert!(["be1", "be2", "be3"].contains(&answer.as_str()), "{answer}");
    let metrics = agent.metrics(&sandbox).unwrap();
    assert!(
        metrics.contains("kubeproxy_proxy_mode{mode=\"nftables\",requested=\"auto\"} 1")
            && metrics.contains(
                "kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family=\"IPv4\"} 0"
            )
            && !metrics.contains("iptables_restore_failures"),
        "{metrics}"
    );
    assert_eq!(
        agent.metrics_path(&sandbox, "/proxyMode").unwrap(),
        "nftables"
    );
    let pins: Vec<_> = std::fs::read_dir(agent.bpffs.path())
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                // The kernel's own files in a bpffs root.
                .filter(|name| !name.ends_with(".debug"))
                .collect()
        })
        .unwrap_or_default();
    assert!(
        pins.is_empty(),
        "pins left by the failed ebpf start: {pins:?}"
    );
}

/// Switching a node from one mode to another leaves nothing of the previous one: each agent
/// starts on what the one before it left (stopped, as a rollout stops it), serves, and the
/// state of every other mode is gone by then (ebpf pins, legacy and nf_tables iptables chains,
/// the nftables table, the userspace chains).
#[test]
fn switching_modes_leaves_nothing_of_the_previous_one() {
    if !privileged("switching_modes_leaves_nothing_of_the_previous_one") {
        return;
    }
    let mut sandbox = Sandbox::build().expect("building the sandbox");
    sandbox.start_backends(BACKEND_PORT).unwrap();
    // What each mode leaves in node1 when it stops, as the tools list it.
    let node = sandbox.node("node1").name.clone();
    let listed = |program: &str, args: &[&str]| -> String {
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", &node, program])
            .args(args)
            .output()
            .expect(program);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let left = |mode: &str, pin_dir: &std::path::Path| -> bool {
        match mode {
            "ebpf" => pin_dir.join(proxy_common::MAP_SERVICES).exists(),
            "iptables-legacy" => {
                listed("iptables-legacy-save", &["-t", "nat"]).contains(":KUBE-SVC-")
            }
            "iptables-nft" => listed("iptables-nft-save", &["-t", "nat"]).contains(":KUBE-SVC-"),
            "nftables" => listed("nft", &["list", "tables"]).contains("kube-proxy"),
            _ => ["iptables-legacy-save", "iptables-nft-save"]
                .iter()
                .any(|save| listed(save, &["-t", "nat"]).contains(":KUBE-PORTALS-CONTAINER")),
        }
    };
    // ebpf first and last: its pins are what the others remove, and it removes theirs.
    let sequence = [
        "ebpf",
        "iptables-legacy",
        "nftables",
        "userspace",
        "iptables-nft",
        "ebpf",
    ];
    let mut first: Option<AgentRun> = None;
    let mut previous: Option<&str> = None;
    for id in sequence {
        let mode = scenarios::parse_mode(id).unwrap();
        // The other modes look for the first (ebpf) agent's pins; an ebpf agent uses its own
        // pin directory, which its start waits on.
        let pin_dir = first
            .as_ref()
            .filter(|_| id != "ebpf")
            .map(|a| a.bpffs.path().to_owned());
        let mut args: Vec<&str> = mode.args.to_vec();
        let pin_dir_text = pin_dir.as_ref().map(|p| p.display().to_string());
        if let Some(p) = &pin_dir_text {
            args.extend(["--bpf-pin-dir", p]);
        }
        let agent = AgentRun::start_with_args(
            &mut sandbox,
            "node1",
            AgentSource::Manifest(MANIFEST),
            // The ebpf agent's start waits for its maps to hold a service.
            1,
            &args,
        )
        .unwrap_or_else(|e| panic!("starting the {id} agent: {e:#}"));
        let pin_dir = pin_dir.unwrap_or_else(|| agent.bpffs.path().to_owned());
        if let Some(before) = previous.filter(|before| *before != id) {
            assert!(
                !left(before, &pin_dir),
                "the {id} agent left the {before} mode's state:\n{}",
                agent.log_text()
            );
        }
        let answer = tcp_request(&sandbox.pod("client").ns, WEB, "hi")
            .unwrap_or_else(|e| panic!("web through the {id} mode: {e:#}"));
        assert!(
            ["be1", "be2", "be3"].contains(&answer.as_str()),
            "{id}: {answer}"
        );
        agent.stop(&mut sandbox).unwrap();
        assert!(
            left(id, &pin_dir),
            "the {id} agent left nothing to switch from"
        );
        // The agents of a node share a log file, which each appends to: the next one's start
        // must not be read from this one's lines.
        std::fs::remove_file(&agent.log).unwrap();
        previous = Some(id);
        if first.is_none() {
            first = Some(agent);
        }
    }
    first.unwrap().cleanup(&sandbox).unwrap();
}
