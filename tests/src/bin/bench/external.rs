//! `cargo xtask bench external`: short TCP connections from outside the cluster (the sandbox's
//! `ext`) through NodePorts, against the same pods reached straight (ext routes the pod network
//! through node1), in one run. Each connection: connect, one request line, its reply, close;
//! several client threads, fixed seconds a round, direct and NodePort rounds interleaved.
use std::{
    net::{IpAddr, SocketAddr},
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    time::{Duration, Instant},
};

use anyhow::Context;
use proxy_tests::{
    BACKEND_PORT, NODE1_IP, Sandbox,
    agent::AgentRun,
    example::{FRONT_LOCAL_NODE_PORT, FRONT_NODE_PORT, MANIFEST},
    tcp_request,
};

pub struct Options {
    pub seconds: f64,
    pub rounds: u32,
    pub threads: u32,
}

/// What is compared: a NodePort and the pods behind it, reached straight.
struct Pair {
    name: &'static str,
    node_port: SocketAddr,
    pods: Vec<SocketAddr>,
}

pub fn run(opts: &Options) -> anyhow::Result<()> {
    if unsafe { libc::geteuid() } != 0 {
        anyhow::bail!(
            "the external benchmark builds network namespaces and loads BPF: run it as root"
        );
    }
    let mut sandbox = Sandbox::build().context("building the sandbox")?;
    sandbox.start_backends(BACKEND_PORT)?;
    let _agent = AgentRun::start(&mut sandbox, "node1", MANIFEST, 5)?;
    // Thousands of connections a second from one address: ext reuses its ports in TIME_WAIT
    // rather than run out of them (its own namespace only).
    let status = sandbox
        .ext
        .cmd("sysctl")
        .args(["-q", "-w", "net.ipv4.tcp_tw_reuse=1"])
        .status()?;
    anyhow::ensure!(status.success(), "sysctl tcp_tw_reuse in ext failed");
    let pod = |name: &str| sandbox.pod(name).addr(BACKEND_PORT);
    let pairs = [
        Pair {
            name: "front-local (eTP Local, be3 on node1)",
            node_port: SocketAddr::new(IpAddr::V4(NODE1_IP), FRONT_LOCAL_NODE_PORT),
            pods: vec![pod("be3")],
        },
        Pair {
            name: "front (eTP Cluster, be2 on node1, be4 on node2)",
            node_port: SocketAddr::new(IpAddr::V4(NODE1_IP), FRONT_NODE_PORT),
            pods: vec![pod("be2"), pod("be4")],
        },
    ];
    println!(
        "short TCP connections from ext, {} threads, {} rounds of {:.1} s each way, interleaved",
        opts.threads, opts.rounds, opts.seconds
    );
    println!(
        "{:<48} {:>14} {:>14} {:>8}",
        "", "direct (conn/s)", "NodePort", "ratio"
    );
    for pair in &pairs {
        let (mut direct, mut through) = (Vec::new(), Vec::new());
        let mut failures = (Failures::default(), Failures::default());
        for round in 0..opts.rounds {
            eprint!("\r  {}: round {}/{} ", pair.name, round + 1, opts.rounds);
            direct.push(rate(&sandbox, &pair.pods, opts, &mut failures.0)?);
            through.push(rate(&sandbox, &[pair.node_port], opts, &mut failures.1)?);
        }
        eprint!("\r{:80}\r", "");
        let (d, t) = (median(&mut direct), median(&mut through));
        println!("{:<48} {:>14.0} {:>14.0} {:>8.2}", pair.name, d, t, t / d);
    }
    println!(
        "medians of the rounds; the ratio is NodePort / direct (1.00: no cost). At these rates \
         ext reuses its ports within seconds, and a server still closing the previous connection \
         on a port may reset one: such rare failures are counted, not hidden."
    );
    Ok(())
}

/// Connections that failed in a measurement, of how many, and the first error.
#[derive(Default)]
struct Failures {
    count: u64,
    of: u64,
    first: String,
}

/// Connections a second from `ext` to `targets` (taken in turn) for `opts.seconds`; failures
/// are added to `failures` (more than 1% fails the benchmark: something is broken).
fn rate(
    sandbox: &Sandbox,
    targets: &[SocketAddr],
    opts: &Options,
    failures: &mut Failures,
) -> anyhow::Result<f64> {
    let done = AtomicU64::new(0);
    let failed = AtomicU64::new(0);
    let first_error = std::sync::Mutex::new(None);
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..opts.threads {
            let (done, failed, stop, first_error) = (&done, &failed, &stop, &first_error);
            let ext = &sandbox.ext;
            s.spawn(move || {
                let mut i = t as usize;
                while !stop.load(Ordering::Relaxed) {
                    match tcp_request(ext, targets[i % targets.len()], "x") {
                        Ok(_) => done.fetch_add(1, Ordering::Relaxed),
                        Err(e) => {
                            first_error.lock().unwrap().get_or_insert(format!("{e:#}"));
                            failed.fetch_add(1, Ordering::Relaxed)
                        }
                    };
                    i += 1;
                }
            });
        }
        std::thread::sleep(Duration::from_secs_f64(opts.seconds));
        stop.store(true, Ordering::Relaxed);
    });
    let (done, failed) = (done.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    failures.count += failed;
    failures.of += done + failed;
    if failures.first.is_empty()
        && let Some(e) = first_error.into_inner().unwrap()
    {
        failures.first = e;
    }
    anyhow::ensure!(
        failures.count * 100 <= failures.of,
        "{} of {} connections to {targets:?} failed, the first: {}",
        failures.count,
        failures.of,
        failures.first
    );
    Ok(done as f64 / started.elapsed().as_secs_f64())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
