//! The example manifest (`examples/services.yaml`) that the demo and the end-to-end tests run
//! the agent on, its service addresses, and a sandbox with the agent on it.
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use crate::{
    BACKEND_PORT, Sandbox,
    agent::{AgentRun, AgentSource},
    privileged,
};

pub const MANIFEST: &str = include_str!("../../examples/services.yaml");
/// web (TCP): be1, be2, be3 on node1.
pub const WEB: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10)), 80);
/// dns-like (UDP): be1 on node1, be4 on node2.
pub const DNS: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 20)), 53);
/// remote (TCP): be4 on node2.
pub const REMOTE: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 30)), 80);

/// front (LoadBalancer, externalTrafficPolicy Cluster): be2 on node1, be4 on node2.
pub const FRONT: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 40)), 80);
pub const FRONT_NODE_PORT: u16 = 30080;
pub const FRONT_UDP_NODE_PORT: u16 = 30053;
pub const FRONT_LB: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(203, 0, 113, 10)), 80);
pub const FRONT_EXTERNAL_IP: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(198, 51, 100, 10)), 80);
/// front-local (LoadBalancer, externalTrafficPolicy Local): be3 on node1 only.
pub const FRONT_LOCAL_NODE_PORT: u16 = 30081;
pub const FRONT_LOCAL_LB: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(203, 0, 113, 11)), 80);
pub const FRONT_LOCAL_HEALTH_PORT: u16 = 32100;

/// The sandbox with its backends and the agent in node1 on [`MANIFEST`], synced; None (and a
/// loud skip) where privileged tests cannot run.
pub fn cluster(test: &str) -> Option<(Sandbox, AgentRun)> {
    let (sandbox, mut agents) = cluster_on(test, &["node1"], &[])?;
    Some((sandbox, agents.remove(0)))
}

/// The sandbox with its backends and an agent on each of `nodes` on [`MANIFEST`], each with the
/// extra arguments `args`, synced; None (and a loud skip) where privileged tests cannot run.
pub fn cluster_on(test: &str, nodes: &[&str], args: &[&str]) -> Option<(Sandbox, Vec<AgentRun>)> {
    if !privileged(test) {
        return None;
    }
    let mut sandbox = Sandbox::build().expect("building the sandbox");
    sandbox
        .start_backends(BACKEND_PORT)
        .expect("starting the backends");
    let agents = nodes
        .iter()
        .map(|node| {
            AgentRun::start_with_args(&mut sandbox, node, AgentSource::Manifest(MANIFEST), 5, args)
                .expect("starting the agent")
        })
        .collect();
    Some((sandbox, agents))
}
