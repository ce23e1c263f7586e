//! The switch from kube-proxy's rules to the ebpf mode on a running node: connections opened
//! through Services while a netfilter mode served (the iptables and nftables modes write
//! kube-proxy's own layout) keep their endpoints and never break, while traffic flows on them.
use std::{
    net::{IpAddr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, ensure};

use crate::{
    NODE1_IP, Sandbox, Shape, TcpConn,
    agent::{AgentRun, Launch},
    example::{FRONT_NODE_PORT, REMOTE, WEB},
    privileged,
    scenarios::{self, Stack, World},
    tcp_request,
};

/// A connection kept open across the switch, and the endpoint that must keep answering it.
struct Held {
    what: String,
    conn: TcpConn,
    endpoint: &'static str,
}

/// The connections [`hold`] opens, all translated on node1.
const HELD_ON_NODE1: usize = 7;

/// How often each held connection is asked while the agents switch.
const ASK_EVERY: Duration = Duration::from_millis(20);

/// Runs both nodes' agents in the mode `from` (a scenario suite's mode id), opens connections
/// through ClusterIPs (from a pod, to local and remote endpoints; from the node itself) and a
/// NodePort (from outside, to a local and a remote endpoint), then switches both agents to the
/// ebpf mode while every connection is asked, again and again, who answers it.
pub fn from(test: &str, from: &str) {
    from_launched(test, from, Launch::Process);
}

/// [`from`], with the agents run as `launch` says.
pub fn from_launched(test: &str, from: &str, launch: Launch) {
    if !privileged(test) {
        return;
    }
    let World {
        mut sandbox,
        mut agents,
        ..
    } = World::start_launched(scenarios::mode(from), Shape::Routed, Stack::Ipv4, launch);
    let held = hold(&sandbox).expect("opening the connections");
    let result = switch(&mut sandbox, &mut agents, held);
    if let Err(e) = result {
        let logs: String = agents.iter().map(|a| a.log_text()).collect();
        let kernel = sandbox.node("node1").exec("conntrack", &["-L"]);
        let programs = agents[0].inspect_cli("conntrack", &[]);
        panic!(
            "{test}: {e:#}\nnode1's conntrack: {kernel:?}\nnode1's programs' conntrack: \
             {programs:?}\nagent logs:\n{logs}"
        );
    }
}

fn hold(sandbox: &Sandbox) -> Result<Vec<Held>> {
    let client = &sandbox.pod("client").ns;
    let node_port = SocketAddr::new(IpAddr::V4(NODE1_IP), FRONT_NODE_PORT);
    let mut held = Vec::new();
    let mut open = |what: &str, from, addr, endpoint| -> Result<()> {
        held.push(Held {
            what: what.to_owned(),
            conn: TcpConn::open_to(from, addr, endpoint)?,
            endpoint,
        });
        Ok(())
    };
    for endpoint in ["be1", "be2", "be3"] {
        open(
            &format!("pod -> ClusterIP -> {endpoint}"),
            client,
            WEB,
            endpoint,
        )?;
    }
    open("pod -> ClusterIP -> be4 (node2)", client, REMOTE, "be4")?;
    open(
        "node1 -> ClusterIP -> be1",
        sandbox.node("node1"),
        WEB,
        "be1",
    )?;
    open("outside -> NodePort -> be2", &sandbox.ext, node_port, "be2")?;
    open(
        "outside -> NodePort -> be4 (node2)",
        &sandbox.ext,
        node_port,
        "be4",
    )?;
    assert_eq!(held.len(), HELD_ON_NODE1);
    Ok(held)
}

/// Switches every agent to the ebpf mode while a thread asks each held connection every
/// [`ASK_EVERY`]; then checks every answer came from the connection's own endpoint and that
/// new connections are served.
fn switch(sandbox: &mut Sandbox, agents: &mut [AgentRun], held: Vec<Held>) -> Result<()> {
    let done = Arc::new(AtomicBool::new(false));
    let asker = {
        let done = done.clone();
        std::thread::spawn(move || ask_until(held, &done))
    };
    let switched = (|| -> Result<()> {
        // Traffic flows before the switch, then for a while after it.
        std::thread::sleep(Duration::from_millis(500));
        for agent in agents.iter_mut() {
            agent.stop(sandbox)?;
            agent.switch_mode(sandbox, scenarios::mode("ebpf").args)?;
        }
        std::thread::sleep(Duration::from_secs(2));
        Ok(())
    })();
    done.store(true, Ordering::Relaxed);
    let asked = asker.join().expect("the asking thread panicked");
    switched?;
    let asked = asked?;
    ensure!(asked > 0, "no connection was asked");
    // Each connection node1 saw translated is left to netfilter, by both of its 5-tuples.
    let flows = agents[0].inspect_cli("conntrack", &["--json"])?;
    let rows: Vec<serde_json::Value> = serde_json::from_str(&flows)?;
    let kept = rows
        .iter()
        .filter(|r| r["direction"] == "netfilter")
        .count();
    ensure!(
        kept == 2 * HELD_ON_NODE1,
        "node1 left {kept} entries to netfilter: {flows}"
    );
    // New connections go through the programs.
    let client = &sandbox.pod("client").ns;
    for _ in 0..10 {
        tcp_request(client, WEB, "hi").context("a new connection after the switch")?;
    }
    Ok(())
}

/// Asks every connection in turn until `done`: how many times each was asked; the first
/// connection that failed or answered from another endpoint is the error.
fn ask_until(mut held: Vec<Held>, done: &AtomicBool) -> Result<usize> {
    let mut rounds = 0;
    let started = Instant::now();
    while !done.load(Ordering::Relaxed) {
        for h in &mut held {
            let answer = h
                .conn
                .ask("hi")
                .with_context(|| format!("{}, {:?} into the run", h.what, started.elapsed()))?;
            ensure!(
                answer == h.endpoint,
                "{}: answered by {answer}, {:?} into the run",
                h.what,
                started.elapsed()
            );
        }
        rounds += 1;
        std::thread::sleep(ASK_EVERY);
    }
    Ok(rounds)
}
