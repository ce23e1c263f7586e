//! The process and build metrics every Kubernetes component exports beside its own (the Go
//! client's process collector and component-base's `kubernetes_build_info`), read from
//! `/proc/self` at each scrape.
use std::fmt::Write as _;

use crate::serve::metrics::single;

/// Appends the `process_*` families and `kubernetes_build_info`. A field that cannot be read
/// leaves its family out rather than reporting a wrong value.
pub fn render(out: &mut String) {
    let stat = std::fs::read_to_string("/proc/self/stat").ok();
    // The fields after the command (which may hold spaces), numbered as in proc(5) from 3.
    let fields: Vec<&str> = stat
        .as_deref()
        .and_then(|s| s.rsplit_once(") "))
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let field = |n: usize| -> Option<f64> { fields.get(n - 3)?.parse().ok() };
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as f64;
    let gauge = |name, help| (name, help, "gauge");
    if let (Some(user), Some(system)) = (field(14), field(15)) {
        single(
            out,
            (
                "process_cpu_seconds_total",
                "Total user and system CPU time spent in seconds.",
                "counter",
            ),
            "",
            (user + system) / ticks,
        );
    }
    if let Some(vsize) = field(23) {
        let help = "Virtual memory size in bytes.";
        single(out, gauge("process_virtual_memory_bytes", help), "", vsize);
    }
    if let Some(rss) = field(24) {
        let help = "Resident memory size in bytes.";
        single(
            out,
            gauge("process_resident_memory_bytes", help),
            "",
            rss * page,
        );
    }
    let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("btime ")?.trim().parse::<f64>().ok())
    });
    if let (Some(boot), Some(start)) = (boot, field(22)) {
        let help = "Start time of the process since unix epoch in seconds.";
        single(
            out,
            gauge("process_start_time_seconds", help),
            "",
            boot + start / ticks,
        );
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        let help = "Number of open file descriptors.";
        single(out, gauge("process_open_fds", help), "", fds.count() as f64);
    }
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    // "Max open files            1024                 524288               files": the soft
    // limit; "unlimited" is reported as the largest 64-bit value, as the Go collector does.
    let soft_limit = |name: &str| -> Option<f64> {
        let value = limits.lines().find_map(|l| l.strip_prefix(name))?;
        match value.split_whitespace().next()? {
            "unlimited" => Some(u64::MAX as f64),
            n => n.parse().ok(),
        }
    };
    if let Some(max) = soft_limit("Max open files") {
        let help = "Maximum number of open file descriptors.";
        single(out, gauge("process_max_fds", help), "", max);
    }
    if let Some(max) = soft_limit("Max address space") {
        let help = "Maximum amount of virtual memory available in bytes.";
        single(
            out,
            gauge("process_virtual_memory_max_bytes", help),
            "",
            max,
        );
    }
    let version = env!("CARGO_PKG_VERSION");
    let mut parts = version.split('.');
    let (major, minor) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let name = "kubernetes_build_info";
    crate::serve::metrics::header(
        out,
        name,
        "A metric with a constant '1' value labeled by major, minor, git version, git commit, \
         git tree state, build date, Go version, and compiler from which Kubernetes was built, \
         and platform on which it is running. Here: this agent's version, built by rustc",
        "gauge",
    );
    let _ = writeln!(
        out,
        "{name}{{build_date=\"\",compiler=\"rustc\",git_commit=\"\",git_tree_state=\"\",\
         git_version=\"v{version}-kube-proxy-ebpf\",go_version=\"\",major=\"{major}\",\
         minor=\"{minor}\",platform=\"linux/{}\"}} 1",
        platform_arch()
    );
}

/// The architecture as Go names it (GOARCH), for the `platform` label.
fn platform_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}
