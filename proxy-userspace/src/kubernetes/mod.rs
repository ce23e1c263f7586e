//! The only code that knows the Kubernetes API's shapes: Services, EndpointSlices and Nodes
//! validated and reduced to what the tracker records of them.
mod service;
mod slice;

use std::net::IpAddr;

use k8s_openapi::{
    api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
        networking::v1::ServiceCIDR,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

pub use self::{
    service::{DEFAULT_AFFINITY_TIMEOUT, LB_ALGORITHM_ANNOTATION, service_skip_reason},
    slice::LAST_CHANGE_TRIGGER_TIME,
};
use crate::model::{
    ChangeTracker, Cidr, NamespacedName, Protocol, ReducedService, ReducedSlice, SkippedEndpoint,
    shared,
};

/// Links an EndpointSlice to the Service it belongs to (in the slice's namespace).
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Objects with this label are handled by another proxy, as kube-proxy's informers filter them out.
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// Set on the EndpointSlices of headless services, which kube-proxy's informers also filter out.
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";

/// The Node label topology hints name zones by.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// What the agent reads of a Node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// Its [`ZONE_LABEL`], for topology hints.
    pub zone: Option<String>,
    /// Its host addresses as kube-proxy's `GetNodeHostIPs` takes them: the first InternalIP
    /// (else ExternalIP) address, then the first of the other family, if any. NodePorts
    /// answer on them with `--nodeport-addresses primary`, and kube-proxy exits to start
    /// again when they change.
    pub addresses: Vec<IpAddr>,
}

impl NodeInfo {
    pub fn of(node: &Node) -> Self {
        let labels = node.metadata.labels.as_ref();
        let listed = node.status.as_ref().and_then(|s| s.addresses.as_ref());
        let of_type = |kind: &'static str| {
            listed
                .into_iter()
                .flatten()
                .filter(move |a| a.type_ == kind)
                .filter_map(|a| a.address.parse::<IpAddr>().ok())
        };
        let all: Vec<IpAddr> = of_type("InternalIP").chain(of_type("ExternalIP")).collect();
        let mut addresses: Vec<IpAddr> = all.first().copied().into_iter().collect();
        if let Some(first) = all.first()
            && let Some(other) = all.iter().find(|ip| ip.is_ipv6() != first.is_ipv6())
        {
            addresses.push(*other);
        }
        Self {
            zone: labels.and_then(|l| l.get(ZONE_LABEL)).cloned(),
            addresses,
        }
    }
}

/// The ranges a ServiceCIDR object allocates cluster IPs from (`spec.cidrs`); a range
/// that does not parse is left out with a warning (the API server validates them).
pub fn service_cidrs_of(object: &ServiceCIDR) -> Vec<Cidr> {
    let name = object.metadata.name.as_deref().unwrap_or_default();
    let cidrs = object.spec.as_ref().and_then(|s| s.cidrs.as_ref());
    cidrs
        .into_iter()
        .flatten()
        .filter_map(|text| match text.parse::<Cidr>() {
            Ok(cidr) => Some(cidr),
            Err(e) => {
                tracing::warn!(service_cidr = name, "skipping the range {text:?}: {e}");
                None
            }
        })
        .collect()
}

/// An object that cannot be programmed. The tracker keeps the last valid version of it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{kind} {}: {reason}", show_key(key))]
pub struct InvalidObject {
    pub kind: &'static str,
    /// The object's namespace and name; the name is empty when that is what is wrong.
    pub key: NamespacedName,
    pub reason: String,
}

fn show_key(key: &NamespacedName) -> String {
    if key.name.is_empty() {
        format!("{}/<no name>", key.namespace)
    } else {
        key.to_string()
    }
}

fn object_key(kind: &'static str, meta: &ObjectMeta) -> Result<NamespacedName, InvalidObject> {
    let key = NamespacedName::new(
        shared(meta.namespace.as_deref().unwrap_or_default()),
        meta.name.as_deref().unwrap_or_default(),
    );
    let missing = if key.name.is_empty() {
        "metadata.name"
    } else if key.namespace.is_empty() {
        "metadata.namespace"
    } else {
        return Ok(key);
    };
    Err(InvalidObject {
        kind,
        key,
        reason: format!("{missing} is missing"),
    })
}

fn parse_ip(field: &str, value: &str) -> Result<IpAddr, String> {
    crate::model::parse_ip_leniently(value)
        .ok_or_else(|| format!("{field}: {value:?} is not an IP address"))
}

fn parse_ips<'a>(
    field: &str,
    values: impl IntoIterator<Item = &'a String>,
) -> Result<Vec<IpAddr>, String> {
    values
        .into_iter()
        .enumerate()
        .map(|(i, value)| parse_ip(&format!("{field}[{i}]"), value))
        .collect()
}

fn port_number(field: &str, value: i32) -> Result<u16, String> {
    u16::try_from(value)
        .ok()
        .filter(|&port| port != 0)
        .ok_or_else(|| format!("{field} {value} is not in 1..=65535"))
}

/// The protocol of an optional API field, which the API server defaults to TCP.
fn protocol_or_tcp(value: Option<&str>) -> Result<Protocol, String> {
    value.map_or(Ok(Protocol::Tcp), str::parse)
}

/// The tracker fed with API objects: each is reduced ([`ReducedService::parse`],
/// [`ReducedSlice::parse`]) and upserted; an object that cannot be programmed is an error, and
/// the tracker keeps its last valid version.
impl ChangeTracker {
    /// A Service; one that is not proxied (see [`service_skip_reason`]) counts as deleted.
    pub fn update_service(&mut self, svc: &Service) -> Result<(), InvalidObject> {
        self.upsert_service(&ReducedService::parse(svc)?);
        Ok(())
    }

    /// An EndpointSlice; see [`ChangeTracker::upsert_slice`].
    pub fn update_slice(
        &mut self,
        slice: &EndpointSlice,
    ) -> Result<Vec<SkippedEndpoint>, InvalidObject> {
        Ok(self.upsert_slice(&ReducedSlice::parse(slice)?))
    }
}
