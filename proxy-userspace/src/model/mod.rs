//! What the cluster wants, with no I/O and no API types: the names of things, the Service ports
//! and their endpoints, the desired state the dataplanes program, and the tracker that builds it.
//!
//! Sources (the manifest file, the Kubernetes API) report Services and EndpointSlices one object
//! at a time, reduced by [`crate::kubernetes`]; [`ChangeTracker`] turns them into per-port desired
//! state and remembers which services changed, so a dataplane sync only touches what changed.
//! This follows kube-proxy's `ServiceChangeTracker` / `EndpointsChangeTracker`: for each service
//! with pending changes we keep its inputs as last applied (`previous`) next to the live ones
//! (`current`), and a change that returns a service to its applied inputs is dropped.
mod addr;
mod names;
mod service;
mod state;
mod tracker;

pub use addr::{Cidr, Family, ipv4, parse_ip_leniently};
pub(crate) use names::shared;
pub use names::{NamespacedName, PortName, Protocol, ServicePortName};
pub use service::{Endpoint, Hints, LbAlgorithm, Placement, ServicePort, TargetPort};
pub use state::DesiredState;
pub use tracker::{ChangeTracker, ReducedService, ReducedSlice, SkippedEndpoint};
pub(crate) use tracker::{ServicePorts, SliceInfo, SlicePort};

#[cfg(test)]
mod tests;
