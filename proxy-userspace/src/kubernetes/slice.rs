//! EndpointSlices: the endpoints of a Service, with their conditions and topology.
use std::{net::IpAddr, sync::Arc, time::SystemTime};

use k8s_openapi::api::discovery::v1::{EndpointConditions, EndpointSlice};

use super::{
    HEADLESS_LABEL, InvalidObject, SERVICE_NAME_LABEL, SERVICE_PROXY_NAME_LABEL, object_key,
    parse_ip, port_number, protocol_or_tcp,
};
use crate::model::{
    Endpoint, Hints, NamespacedName, Placement, ReducedSlice, SkippedEndpoint, SliceInfo,
    SlicePort, shared,
};

/// The annotation the EndpointSlice controller sets to the time of the change (a Pod or the
/// Service) that produced the slice's version: where kube-proxy's network programming latency
/// starts.
pub const LAST_CHANGE_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

impl ReducedSlice {
    /// Reads an EndpointSlice; errs when it cannot be programmed at all. Endpoints that cannot
    /// be programmed are left out (and listed, to be reported).
    pub fn parse(slice: &EndpointSlice) -> Result<Self, InvalidObject> {
        let key = object_key("EndpointSlice", &slice.metadata)?;
        let parsed = parse_slice(&key, slice).map_err(|reason| InvalidObject {
            kind: "EndpointSlice",
            key: key.clone(),
            reason,
        })?;
        let (info, skipped) = match parsed {
            Some((info, skipped)) => (Some(info), skipped),
            None => (None, Vec::new()),
        };
        let trigger_time = slice
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(LAST_CHANGE_TRIGGER_TIME))
            .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
            .map(SystemTime::from);
        Ok(Self {
            key,
            info,
            skipped,
            trigger_time,
        })
    }
}

/// The slice's programmable content and the endpoints left out of it, or None when it must not
/// be proxied.
fn parse_slice(
    key: &NamespacedName,
    slice: &EndpointSlice,
) -> Result<Option<(SliceInfo, Vec<SkippedEndpoint>)>, String> {
    let labels = slice.metadata.labels.as_ref();
    let has = |label| labels.is_some_and(|l| l.contains_key(label));
    if has(SERVICE_PROXY_NAME_LABEL) || has(HEADLESS_LABEL) {
        return Ok(None);
    }
    let service_name: Arc<str> = match labels.and_then(|l| l.get(SERVICE_NAME_LABEL)) {
        Some(name) if !name.is_empty() => name.as_str().into(),
        _ => {
            return Err(format!(
                "metadata.labels has no {SERVICE_NAME_LABEL}, so it belongs to no Service"
            ));
        }
    };
    let want_v4 = match slice.address_type.as_str() {
        "IPv4" => true,
        "IPv6" => false,
        // Names cannot be programmed into a dataplane; kube-proxy ignores them too.
        "FQDN" => return Ok(None),
        "" => return Err("addressType is missing (IPv4, IPv6 or FQDN)".to_owned()),
        other => return Err(format!("addressType {other:?} is not IPv4, IPv6 or FQDN")),
    };

    let mut ports = Vec::new();
    for (i, port) in slice.ports.iter().flatten().enumerate() {
        let at = format!("ports[{i}]");
        // No number means "all ports" in the API; kube-proxy skips such ports, and so do we.
        let Some(number) = port.port else { continue };
        ports.push((
            shared(port.name.as_deref().unwrap_or_default()),
            protocol_or_tcp(port.protocol.as_deref()).map_err(|e| format!("{at}: {e}"))?,
            port_number(&format!("{at}: port"), number)?,
        ));
    }

    let mut endpoints = Vec::new();
    let mut skipped = Vec::new();
    for (i, ep) in slice.endpoints.iter().flatten().enumerate() {
        let ip = match endpoint_ip(i, ep, want_v4) {
            Ok(ip) => ip,
            Err(reason) => {
                skipped.push(SkippedEndpoint {
                    slice: key.clone(),
                    reason,
                });
                continue;
            }
        };
        let condition =
            |get: fn(&EndpointConditions) -> Option<bool>| ep.conditions.as_ref().and_then(get);
        // kube-proxy's reading of unset conditions: ready and serving true, terminating false.
        endpoints.push(Endpoint {
            ip,
            // Each port's own, below.
            port: 0,
            ready: condition(|c| c.ready).unwrap_or(true),
            serving: condition(|c| c.serving).unwrap_or(true),
            terminating: condition(|c| c.terminating).unwrap_or(false),
            placement: Placement::shared(ep.node_name.as_deref(), hints(ep.hints.as_ref())),
        });
    }
    let info = SliceInfo {
        service_name,
        ports: (ports.into_iter())
            .map(|(name, protocol, port)| SlicePort::new(name, protocol, port, &endpoints))
            .collect::<Vec<_>>()
            .into(),
    };
    Ok(Some((info, skipped)))
}

/// The address of endpoint `i` of a slice of the family `want_v4` says.
fn endpoint_ip(
    i: usize,
    ep: &k8s_openapi::api::discovery::v1::Endpoint,
    want_v4: bool,
) -> Result<IpAddr, String> {
    // The API defines no meaning for addresses after the first, and kube-proxy ignores them.
    let Some(address) = ep.addresses.first() else {
        return Err(format!("endpoints[{i}]: addresses is empty"));
    };
    let at = format!("endpoints[{i}].addresses[0]");
    let ip = parse_ip(&at, address)?;
    if ip.is_ipv4() != want_v4 {
        let family = if want_v4 { "IPv4" } else { "IPv6" };
        return Err(format!("{at}: {ip} does not match addressType {family}"));
    }
    Ok(ip)
}

/// An endpoint's topology hints, sorted (so that a reordering is no change); None without any.
fn hints(hints: Option<&k8s_openapi::api::discovery::v1::EndpointHints>) -> Option<Hints> {
    let hints = hints?;
    let zones = sorted_names(hints.for_zones.iter().flatten().map(|z| &z.name));
    let nodes = sorted_names(hints.for_nodes.iter().flatten().map(|n| &n.name));
    (!zones.is_empty() || !nodes.is_empty()).then_some(Hints { zones, nodes })
}

fn sorted_names<'a>(names: impl Iterator<Item = &'a String>) -> Vec<Arc<str>> {
    let mut names: Vec<Arc<str>> = names.map(|n| shared(n)).collect();
    names.sort();
    names.dedup();
    names
}
