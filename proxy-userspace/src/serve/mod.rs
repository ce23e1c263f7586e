//! The agent's HTTP side: healthz and livez, the Services' health-check node ports, metrics.
pub mod health_check_ports;
pub mod healthz;
pub mod http;
pub mod metrics;
mod process;
