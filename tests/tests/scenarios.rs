//! The scenario suite (`proxy_tests::scenarios`) in every mode that runs here, one test each;
//! every test rewrites `docs/parity.md` from the results of all modes.
use std::sync::Mutex;

use proxy_tests::scenarios;

/// Runs the suite in `mode`, then writes the parity table (even when scenarios failed: the table
/// shows which).
fn suite(test: &str, mode: &str) {
    static TABLE: Mutex<()> = Mutex::new(());
    let result = std::panic::catch_unwind(|| scenarios::run(test, mode));
    {
        let _one_writer = TABLE.lock().unwrap_or_else(|e| e.into_inner());
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/parity.md");
        std::fs::write(&path, scenarios::render_parity()).expect("writing docs/parity.md");
    }
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

#[test]
fn ebpf() {
    suite("scenarios::ebpf", "ebpf");
}

#[test]
fn iptables_legacy() {
    suite("scenarios::iptables_legacy", "iptables-legacy");
}

#[test]
fn iptables_nft() {
    suite("scenarios::iptables_nft", "iptables-nft");
}

#[test]
fn nftables() {
    suite("scenarios::nftables", "nftables");
}

/// Skipped (loudly) where the kernel has no IPVS: `cargo xtask vm-test` runs it.
#[test]
fn ipvs() {
    suite("scenarios::ipvs", "ipvs");
}

/// `--proxy-mode auto` where the BPF programs cannot load (a services map of 0 entries makes
/// the kernel refuse it): the agent says why and serves with the nftables mode, leaving no
/// BPF pins behind.
#[test]
fn auto_mode_falls_back_to_nftables_where_ebpf_cannot_load() {
    use proxy_tests::{
        BACKEND_PORT, Sandbox,
        agent::{AgentRun, AgentSource},
        example::{MANIFEST, WEB},
        privileged, tcp_request,
    };
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

#[test]
fn userspace() {
    suite("scenarios::userspace", "userspace");
}
