//! The example manifest (`examples/services.yaml`) that the demo and the end-to-end tests run
//! the agent on, its service addresses, and a sandbox with the agent on it.
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use crate::{BACKEND_PORT, Sandbox, agent::AgentRun, privileged};

pub const MANIFEST: &str = include_str!("../../examples/services.yaml");
/// web (TCP): be1, be2, be3 on node1.
pub const WEB: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10)), 80);
/// dns-like (UDP): be1 on node1, be4 on node2.
pub const DNS: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 20)), 53);
/// remote (TCP): be4 on node2.
pub const REMOTE: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 30)), 80);

/// The sandbox with its backends and the agent in node1 on [`MANIFEST`], synced; None (and a
/// loud skip) where privileged tests cannot run.
pub fn cluster(test: &str) -> Option<(Sandbox, AgentRun)> {
    if !privileged(test) {
        return None;
    }
    let mut sandbox = Sandbox::build().expect("building the sandbox");
    sandbox
        .start_backends(BACKEND_PORT)
        .expect("starting the backends");
    let agent = AgentRun::start(&mut sandbox, "node1", MANIFEST, 3).expect("starting the agent");
    Some((sandbox, agent))
}
