//! Where the cluster's Services and EndpointSlices come from: the API server or a manifest.
pub mod api;
pub mod file;
pub mod manifest;
