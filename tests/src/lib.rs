//! The sandbox: a small two-node "cluster" made of network namespaces, shared by the
//! end-to-end tests, the demo and the benchmarks (DESIGN.md, "The sandbox").
//!
//! ```text
//! ns ext (192.0.2.100) -- ns fabric: bridge br0 (192.0.2.0/24) -- ns node1 (192.0.2.11), ns node2 (192.0.2.12)
//! node1: pods client 10.244.1.10, be1..be3 10.244.1.11-13    node2: pod be4 10.244.2.11
//! ```
//! Pods are routed (Calico-like): the pod's `eth0` has its /32 and a default route via
//! 10.244.N.1, the address of the node-side veth `veth-<pod>`, where tc programs attach.
//! The machine's default network namespace is never touched; everything is deleted on drop.
//!
//! The backend servers are the `sandbox-backend` binary of this crate (build it with
//! `cargo build -p proxy-tests`; integration tests get it built automatically).

pub mod agent;
pub mod apiserver;
mod client;
pub mod example;
pub mod fixtures;
pub mod image;
pub mod load;
mod netns;
pub mod packet;
pub mod programs;
pub mod rbac;
pub mod reference;
mod sandbox;
pub mod scenarios;
pub mod takeover;

use std::io::Write;
use std::sync::OnceLock;

pub use client::{
    TcpConn, UdpConn, bulk_transfer, client_timeout, http_get, sctp_available, sctp_listener,
    sctp_request, send_raw, spoof_tcp, tcp_request, tcp_session, udp_request, udp_session,
};
pub use netns::{NETNS_DIR, Netns, run};
pub use sandbox::{
    BACKEND_BIN_ENV, BACKEND_PORT, EXT_IP, EXT_IP6, NODE_CIDR, NODE_CIDR6, NODE_IF, NODE1_IP,
    NODE1_IP6, NODE2_IP, NODE2_IP6, NS_PREFIX, POD_CIDR, POD_CIDR6, Pod, SERVICE_CIDR,
    SERVICE_CIDR6, Sandbox, Shape, backend_bin, cleanup_stale, find_bin, netns_list, twin,
    twin_cidr,
};

/// Multiplies the tests' waiting times (a kernel under software emulation is slow):
/// `cargo xtask vm-test` sets it.
pub const TIMEOUT_SCALE_ENV: &str = "SANDBOX_TIMEOUT_SCALE";

/// `base`, scaled by `$SANDBOX_TIMEOUT_SCALE` (default 1).
pub fn patience(base: std::time::Duration) -> std::time::Duration {
    let scale = std::env::var(TIMEOUT_SCALE_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    base * scale
}

/// Set to 1 to make [`privileged`] fail the test instead of skipping it (for CI).
pub const NO_SKIP_ENV: &str = "SANDBOX_NO_SKIP";

/// Returns true when privileged tests can run here (root, the bpf() syscall, `ip netns`
/// and `sysctl` inside a namespace). Otherwise prints a loud `SKIPPED <test>: <reason>`
/// line to stderr and returns false (or panics when `SANDBOX_NO_SKIP=1`).
pub fn privileged(test: &str) -> bool {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    match PROBE.get_or_init(probe) {
        Ok(()) => true,
        Err(reason) => {
            if std::env::var(NO_SKIP_ENV).is_ok_and(|v| v == "1") {
                panic!("{test} cannot run: {reason} ({NO_SKIP_ENV}=1)");
            }
            say_skipped(test, reason);
            false
        }
    }
}

/// Whether this kernel has `feature`; otherwise prints a loud `SKIPPED <test>: ...` line and
/// returns false. A missing optional feature is a degrade the agent reports and the README
/// documents (the part it serves is off), so the test is skipped even with `SANDBOX_NO_SKIP`.
pub fn kernel_has(test: &str, feature: &proxy_userspace::modes::ebpf::features::Feature) -> bool {
    use proxy_userspace::modes::ebpf::features::Features;
    let kernel = Features::of_this_kernel().expect("probing the kernel's features");
    if kernel.has(feature) {
        return true;
    }
    say_skipped(test, &feature.lacking());
    false
}

/// Prints the loud `SKIPPED <test>: <reason>` line.
pub fn say_skipped(test: &str, reason: &str) {
    // Straight to fd 2: `eprintln!` would be captured by the test harness.
    let _ = writeln!(std::io::stderr(), "\nSKIPPED {test}: {reason}\n");
}

fn probe() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not running as root".into());
    }
    probe_bpf()?;
    let name = format!("{NS_PREFIX}{}-probe", std::process::id());
    let ns = Netns::create(&name).map_err(|e| format!("`ip netns` unavailable: {e:#}"))?;
    ns.exec("sysctl", &["-n", "net.ipv4.ip_forward"])
        .map_err(|e| format!("`ip netns exec ... sysctl` unavailable: {e:#}"))?;
    Ok(())
}

/// Creates (and closes) a one-entry BPF array map.
fn probe_bpf() -> Result<(), String> {
    #[repr(C)]
    struct MapCreate {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        rest: [u8; 112],
    }
    let attr = MapCreate {
        map_type: 2, // BPF_MAP_TYPE_ARRAY
        key_size: 4,
        value_size: 4,
        max_entries: 1,
        rest: [0; 112],
    };
    // SAFETY: BPF_MAP_CREATE (0) reads `size` bytes of a valid, zero-padded bpf_attr.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            0,
            &attr as *const MapCreate,
            std::mem::size_of::<MapCreate>() as u32,
        )
    };
    if fd < 0 {
        return Err(format!(
            "bpf() syscall unavailable: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: fd is a file descriptor we just got and own.
    unsafe { libc::close(fd as libc::c_int) };
    Ok(())
}
