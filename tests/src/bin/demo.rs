//! `cargo xtask demo`: the agent in the sandbox cluster on the example manifest, driven by
//! real clients (curl) from the client pod, from node1 itself (host network) and from outside
//! the cluster (NodePorts, a load balancer address, an external IP), with a live endpoint
//! change, session affinity and `inspect`. `--proxy-mode` runs it in another of the agent's
//! modes (those of the scenario suite: ebpf, iptables-legacy, iptables-nft, nftables,
//! userspace).
//!
//! Needs root and BPF; exits non-zero (with the agent log) if any step fails.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use proxy_tests::agent::{AgentRun, AgentSource, edit_manifest, remove_endpoint};
use proxy_tests::example::{DNS, MANIFEST as EXAMPLE, REMOTE, WEB};
use proxy_tests::scenarios::{self, Mode};
use proxy_tests::{BACKEND_PORT, EXT_IP, NODE_CIDR, NODE1_IP, NODE2_IP, Sandbox};
use proxy_userspace::source::manifest::Object;

/// Service names as in the manifest (the datapath only knows addresses).
const SERVICES: &[(&str, SocketAddr)] = &[("web", WEB), ("dns-like", DNS), ("remote", REMOTE)];

#[derive(Parser)]
struct Args {
    /// The agent's mode, as the scenario suite names them (docs/parity.md).
    #[arg(long, default_value = "ebpf", value_parser = scenarios::parse_mode)]
    proxy_mode: &'static Mode,
}

fn main() -> ExitCode {
    let args = Args::parse();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("demo: must run as root (it creates network namespaces and loads BPF programs)");
        return ExitCode::FAILURE;
    }
    // Also probes bpf() and `ip netns`; prints the reason when they are unavailable.
    if !proxy_tests::privileged("demo") {
        eprintln!("demo: cannot run here: BPF or `ip netns` is unavailable (see above)");
        return ExitCode::FAILURE;
    }
    let started = Instant::now();
    match run(args.proxy_mode) {
        Ok(()) => {
            println!("\nDemo finished in {}.", ms(started.elapsed()));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("\nDEMO FAILED: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(mode: &'static Mode) -> Result<()> {
    let t = step("Building the sandbox cluster (network namespaces)");
    let mut sandbox = Sandbox::build()?;
    println!("    built in {}", ms(t.elapsed()));
    print_topology(&sandbox);

    let t = step(&format!(
        "Starting the backends and the agent ({} mode) on examples/services.yaml",
        mode.id
    ));
    sandbox.start_backends(BACKEND_PORT)?;
    println!("    backends listening on :{BACKEND_PORT} (TCP+UDP) in every pod but client");
    println!("    agent starting in node1, waiting for its first sync ...");
    let agent = start_agent(&mut sandbox, "node1", mode)?;
    println!("    agent pid {} synced in {}", agent.pid, ms(t.elapsed()));
    // Past this point the agent runs: any failure comes with its log.
    let result = tour(&mut sandbox, &agent, mode);
    if result.is_err() {
        eprintln!("\n---- agent log ({}) ----", agent.log.display());
        eprintln!("{}", agent.log_text());
    }
    result?;

    let t = step("Tearing down");
    let status = sandbox.stop(agent.pid)?;
    let prefix = sandbox.prefix.clone();
    drop(agent);
    drop(sandbox);
    let left = proxy_tests::netns_list()?
        .into_iter()
        .filter(|n| n.starts_with(&format!("{prefix}-")))
        .count();
    println!("    agent stopped ({status}); namespaces, backends and bpffs removed");
    if left != 0 {
        bail!("{left} namespaces of {prefix} are still there");
    }
    println!("    done in {}", ms(t.elapsed()));
    Ok(())
}

/// The agent in `node` on the example manifest, in `mode`, synced.
fn start_agent(sandbox: &mut Sandbox, node: &str, mode: &Mode) -> Result<AgentRun> {
    AgentRun::start_with_args(
        sandbox,
        node,
        AgentSource::Manifest(EXAMPLE),
        SERVICES.len(),
        mode.args,
    )
}

/// Steps 3-7, with the agent running.
fn tour(sandbox: &mut Sandbox, agent: &AgentRun, mode: &Mode) -> Result<()> {
    // What the agent programmed, read back from the mode's own state.
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&agent.inspect_cli("services", &["--json"])?)?;
    println!("    services programmed (proxy-userspace inspect services --json):");
    for (name, addr) in SERVICES {
        let row = rows
            .iter()
            .find(|r| r["address"] == addr.to_string())
            .with_context(|| format!("{name} {addr} is not programmed"))?;
        let backends: Vec<String> = row["backends"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|b| pod_of(sandbox, b["address"].as_str().unwrap_or_default()))
            .collect();
        println!(
            "      {name:<9} {addr}/{:<4} -> {}",
            row["protocol"].as_str().unwrap_or_default(),
            backends.join(", ")
        );
    }

    step("Load balancing: real clients in the client pod");
    let spread = curl_spread(sandbox, "http://10.96.0.10/", 30)?;
    check_spread("web", &spread, &["be1", "be2", "be3"])?;
    let spread = udp_spread(sandbox, DNS, 20)?;
    check_spread("dns-like", &spread, &["be1", "be4"])?;
    println!("    cross-node: remote's only backend, be4, lives on node2");
    let spread = curl_spread(sandbox, "http://10.96.0.30/", 5)?;
    check_spread("remote", &spread, &["be4"])?;

    step("A connection sticks to its backend (5 requests over one TCP connection)");
    let client = &sandbox.pod("client").ns;
    for i in 1..=3 {
        let replies = proxy_tests::tcp_session(client, WEB, 5)?;
        println!("    connection {i}: {}", replies.join(" "));
        if replies.windows(2).any(|w| w[0] != w[1]) {
            bail!("connection {i} moved between backends: {replies:?}");
        }
    }

    step("Live change: removing be1 (10.244.1.11) from web in the manifest");
    let t = Instant::now();
    let syncs = agent.syncs();
    edit_manifest(&agent.manifest, |objects| {
        remove_endpoint(objects, "web", "10.244.1.11")
    })?;
    println!("    manifest rewritten; waiting for the agent's sync ...");
    agent.wait_for_sync_after(sandbox, syncs)?;
    println!("    node updated {} after the edit", ms(t.elapsed()));
    let spread = curl_spread(sandbox, "http://10.96.0.10/", 30)?;
    check_spread("web", &spread, &["be2", "be3"])?;

    step("A process on node1 itself (host network, e.g. the kubelet) reaches the services");
    if mode.id == "ebpf" {
        println!(
            "    socket programs on the agent's cgroup send its connect() to an endpoint: no NAT"
        );
    }
    let spread = curl_spread_from(&host_client(sandbox, agent), "http://10.96.0.10/", 20)?;
    check_spread("web from node1", &spread, &["be2", "be3"])?;
    let spread = curl_spread_from(&host_client(sandbox, agent), "http://10.96.0.30/", 3)?;
    check_spread("remote from node1", &spread, &["be4"])?;

    step("Session affinity: web gets sessionAffinity ClientIP in the manifest");
    let syncs = agent.syncs();
    edit_manifest(&agent.manifest, |objects| {
        for object in objects.iter_mut() {
            if let Object::Service(svc) = object
                && svc.metadata.name.as_deref() == Some("web")
            {
                svc.spec.get_or_insert_default().session_affinity = Some("ClientIP".into());
            }
        }
    })?;
    agent.wait_for_sync_after(sandbox, syncs)?;
    let spread = curl_spread(sandbox, "http://10.96.0.10/", 20)?;
    check_one("web from the client pod", &spread)?;
    let spread = curl_spread_from(&host_client(sandbox, agent), "http://10.96.0.10/", 20)?;
    check_one("web from node1", &spread)?;
    inspect(agent, "affinity", usize::MAX);

    external_clients(sandbox, mode)?;

    inspect(agent, "services", usize::MAX);
    inspect(agent, "conntrack", 10);
    Ok(())
}

/// Prints `proxy-userspace inspect <what>` (its first `max_lines`), or why the mode has none.
fn inspect(agent: &AgentRun, what: &str, max_lines: usize) {
    step(&format!("proxy-userspace inspect {what}"));
    match agent.inspect_cli(what, &[]) {
        Ok(text) => print_indented(&text, max_lines),
        Err(e) => println!("    {e:#}"),
    }
}

/// Clients outside the cluster (ext, the node network's router) reach the LoadBalancer Services
/// through NodePorts on both nodes, the load balancer address and an external IP.
fn external_clients(sandbox: &mut Sandbox, mode: &Mode) -> Result<()> {
    step("Traffic from outside: curl in ext to NodePorts, a load balancer address, an external IP");
    println!("    an agent on node2 too");
    if mode.id == "ebpf" {
        println!("    XDP on each node's eth0 translates before the stack");
    }
    let _node2 = start_agent(sandbox, "node2", mode)?;
    let ext = &sandbox.ext;
    let from_ext = || Ok(ext.cmd("curl"));
    for (what, url) in [
        ("NodePort on node1", format!("http://{NODE1_IP}:30080/")),
        ("NodePort on node2", format!("http://{NODE2_IP}:30080/")),
        (
            "load balancer 203.0.113.10",
            "http://203.0.113.10/".to_owned(),
        ),
        (
            "external IP 198.51.100.10",
            "http://198.51.100.10/".to_owned(),
        ),
    ] {
        let spread = curl_spread_from(&from_ext, &url, 12)?;
        check_spread(&format!("front via {what}"), &spread, &["be2", "be4"])?;
    }
    println!("    who the backends saw (externalTrafficPolicy Cluster):");
    let mut seen = BTreeMap::new();
    for _ in 0..20 {
        let answer = curl_once(&from_ext, &format!("http://{NODE1_IP}:30080/whoami"))?;
        let name = answer
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_owned();
        seen.entry(name).or_insert(answer);
    }
    for answer in seen.values() {
        let endpoint = match answer.starts_with("be2") {
            true => "node1's own endpoint",
            false => "node2's endpoint",
        };
        let source = match answer.contains(&EXT_IP.to_string()) {
            true => "the client's address",
            false => "node1's address (replies come back through it)",
        };
        println!("      {answer:<28} {endpoint}: {source}");
    }

    step("externalTrafficPolicy Local: front-local (be3, on node1 only)");
    let answer = curl_once(&from_ext, &format!("http://{NODE1_IP}:30081/whoami"))?;
    if mode
        .not_applicable
        .iter()
        .any(|(s, _)| *s == "client-address-kept-local")
    {
        println!("    via node1: {answer}   (a proxy: the endpoint sees node1, not the client)");
    } else {
        println!("    via node1: {answer}   (the client's own address, no translation)");
        if !answer.contains(&EXT_IP.to_string()) {
            bail!("front-local via node1 did not keep the client address: {answer}");
        }
    }
    let via_node2 = ext
        .cmd("curl")
        .args([
            "-sS",
            "--max-time",
            "1",
            &format!("http://{NODE2_IP}:30081/"),
        ])
        .output()?;
    if via_node2.status.success() {
        bail!("front-local answered via node2, which has no local endpoint");
    }
    println!("    via node2: no answer (no local endpoint there: dropped, as kube-proxy does)");
    for (node, ip) in [("node1", NODE1_IP), ("node2", NODE2_IP)] {
        let out = ext
            .cmd("curl")
            .args(["-s", "--max-time", "2", "-w", " -> HTTP %{http_code}"])
            .arg(format!("http://{ip}:32100/"))
            .output()?;
        println!(
            "    health check on {node} (what a cloud load balancer asks): {}",
            String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    Ok(())
}

/// One curl run: its output.
fn curl_once(curl: &dyn Fn() -> Result<std::process::Command>, url: &str) -> Result<String> {
    let out = curl()?
        .args(["-sS", "--max-time", "2", url])
        .output()
        .context("running curl")?;
    if !out.status.success() {
        bail!(
            "curl {url} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn print_topology(sandbox: &Sandbox) {
    println!("    ext {EXT_IP} -- bridge {NODE_CIDR} -- node1 {NODE1_IP}, node2 {NODE2_IP}");
    for node in ["node1", "node2"] {
        let pods: Vec<String> = sandbox
            .pods
            .iter()
            .filter(|p| p.node == node)
            .map(|p| format!("{} {}", p.name, p.ip))
            .collect();
        println!("    {node} pods: {}", pods.join(", "));
    }
}

/// `n` curl runs from the client pod (each a new connection); counts the answering backends.
fn curl_spread(sandbox: &Sandbox, url: &str, n: usize) -> Result<BTreeMap<String, usize>> {
    let client = &sandbox.pod("client").ns;
    curl_spread_from(&|| Ok(client.cmd("curl")), url, n)
}

/// A curl command in node1's network namespace, in the cgroup whose sockets the agent's socket
/// programs see: a host-network client.
fn host_client<'a>(
    sandbox: &'a Sandbox,
    agent: &'a AgentRun,
) -> impl Fn() -> Result<std::process::Command> + 'a {
    move || {
        let mut cmd = proxy_tests::Netns::open(&sandbox.node("node1").name).cmd("curl");
        agent.cgroup.enter(&mut cmd)?;
        Ok(cmd)
    }
}

/// `n` curl runs of commands from `curl` (each a new connection); counts the answering
/// backends.
fn curl_spread_from(
    curl: &dyn Fn() -> Result<std::process::Command>,
    url: &str,
    n: usize,
) -> Result<BTreeMap<String, usize>> {
    let t = Instant::now();
    progress(&format!("    curl -sS --max-time 2 {url}  x{n} "));
    let mut counts = BTreeMap::new();
    for i in 1..=n {
        let out = curl()?
            .args(["-sS", "--max-time", "2", url])
            .output()
            .context("running curl")?;
        if !out.status.success() {
            println!();
            bail!(
                "curl {url} (request {i}) failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        *counts
            .entry(String::from_utf8_lossy(&out.stdout).trim().to_string())
            .or_default() += 1;
        progress(".");
    }
    println!(" {}", ms(t.elapsed()));
    Ok(counts)
}

/// `n` UDP datagrams from the client pod, each from a new socket (a new flow).
fn udp_spread(sandbox: &Sandbox, addr: SocketAddr, n: usize) -> Result<BTreeMap<String, usize>> {
    let client = &sandbox.pod("client").ns;
    let t = Instant::now();
    progress(&format!("    UDP datagram to {addr}  x{n} "));
    let mut counts = BTreeMap::new();
    for _ in 0..n {
        let reply = proxy_tests::udp_request(client, addr, "hi")?;
        *counts.entry(reply).or_default() += 1;
        progress(".");
    }
    println!(" {}", ms(t.elapsed()));
    Ok(counts)
}

/// Prints a histogram of `counts` and fails unless exactly `expected` answered.
fn check_spread(service: &str, counts: &BTreeMap<String, usize>, expected: &[&str]) -> Result<()> {
    for (name, count) in counts {
        println!("      {name:<6} {:<30} {count}", "█".repeat(*count));
    }
    let seen: Vec<&str> = counts.keys().map(String::as_str).collect();
    if seen != expected {
        bail!("{service}: expected answers from {expected:?}, got {counts:?}");
    }
    Ok(())
}

/// Prints a histogram of `counts` and fails unless exactly one backend answered.
fn check_one(what: &str, counts: &BTreeMap<String, usize>) -> Result<()> {
    for (name, count) in counts {
        println!("      {name:<6} {:<30} {count}", "█".repeat(*count));
    }
    if counts.len() != 1 {
        bail!("{what}: expected one backend for every connection, got {counts:?}");
    }
    Ok(())
}

/// The pod name of a backend address `ip:port` (or the address itself).
fn pod_of(sandbox: &Sandbox, address: &str) -> String {
    let ip = address.split(':').next().unwrap_or_default();
    sandbox
        .pods
        .iter()
        .find(|p| p.ip.to_string() == ip)
        .map_or_else(|| address.to_string(), |p| p.name.clone())
}

fn print_indented(text: &str, max_lines: usize) {
    let lines: Vec<&str> = text.lines().collect();
    for line in lines.iter().take(max_lines) {
        println!("    {line}");
    }
    if lines.len() > max_lines {
        println!("    ... ({} more lines)", lines.len() - max_lines);
    }
}

/// Prints a `==> title` header (bold on a terminal) and returns when the step started.
fn step(title: &str) -> Instant {
    if std::io::stdout().is_terminal() {
        println!("\n\x1b[1m==> {title}\x1b[0m");
    } else {
        println!("\n==> {title}");
    }
    Instant::now()
}

/// Prints without a newline, flushed, so progress shows while we wait.
fn progress(text: &str) {
    print!("{text}");
    let _ = std::io::stdout().flush();
}

fn ms(d: Duration) -> String {
    format!("{} ms", d.as_millis())
}
