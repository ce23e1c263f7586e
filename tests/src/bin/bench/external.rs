//! `cargo xtask bench external`: short TCP connections from outside the cluster (the sandbox's
//! `ext`) through NodePorts, against the same pods reached straight (ext routes the pod network
//! through node1), in one run. Each connection: connect, one request line, its reply, close;
//! several client threads, fixed seconds a round, direct and NodePort rounds interleaved.
use std::net::{IpAddr, SocketAddr};

use anyhow::Context;
use proxy_tests::{
    BACKEND_PORT, NODE1_IP, Sandbox,
    agent::AgentRun,
    example::{FRONT_LOCAL_NODE_PORT, FRONT_NODE_PORT, MANIFEST},
};

use crate::connections::{self, Failures, Load, median};

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
            let load = Load {
                seconds: opts.seconds,
                threads: opts.threads,
            };
            let ext = &sandbox.ext;
            direct.push(connections::measure(ext, &pair.pods, load, &mut failures.0)?.rate);
            through.push(connections::measure(ext, &[pair.node_port], load, &mut failures.1)?.rate);
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
