//! The agent: desired state, its sources, and the dataplanes that program it.
pub mod agent;
pub mod dataplane;
pub mod duration;
pub mod ebpf;
pub mod health;
pub mod http;
pub mod inspect;
pub mod iptables;
pub mod maglev;
pub mod manifest;
pub mod metrics;
pub mod model;
pub mod nftables;
pub mod runner;
pub mod service_health;
pub mod source;
pub mod stale_udp;
