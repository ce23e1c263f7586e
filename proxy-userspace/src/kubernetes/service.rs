//! Services: which are proxied, and each port's frontends and policies.
use std::{
    num::{NonZeroU16, NonZeroU32},
    sync::Arc,
};

use k8s_openapi::{api::core::v1::Service, apimachinery::pkg::util::intstr::IntOrString};

use super::{
    InvalidObject, SERVICE_PROXY_NAME_LABEL, object_key, parse_ip, parse_ips, port_number,
    protocol_or_tcp,
};
use crate::model::{
    Cidr, LbAlgorithm, NamespacedName, ReducedService, ServicePort, ServicePortName, ServicePorts,
    TargetPort, shared,
};

/// kube-apiserver's default for `sessionAffinityConfig.clientIP.timeoutSeconds` (3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10800;

/// The largest affinity timeout the API accepts (1 day).
const MAX_AFFINITY_TIMEOUT: i32 = 86400;

/// A Service annotation choosing its [`LbAlgorithm`] (`random` or `maglev`).
pub const LB_ALGORITHM_ANNOTATION: &str = "service.kube-proxy-ebpf.io/lb-algorithm";

impl ReducedService {
    /// Reads a Service; errs when it cannot be programmed (the tracker then keeps the last valid
    /// version).
    pub fn parse(svc: &Service) -> Result<Self, InvalidObject> {
        let key = object_key("Service", &svc.metadata)?;
        let ports = parse_service(&key, svc).map_err(|reason| InvalidObject {
            kind: "Service",
            key: key.clone(),
            reason,
        })?;
        Ok(Self {
            key,
            ports,
            skip_reason: service_skip_reason(svc),
        })
    }
}

/// Why `svc` is not proxied, or None if it is. Such services are valid: the tracker treats them as
/// absent, as kube-proxy does.
pub fn service_skip_reason(svc: &Service) -> Option<&'static str> {
    let labels = svc.metadata.labels.as_ref();
    if labels.is_some_and(|l| l.contains_key(SERVICE_PROXY_NAME_LABEL)) {
        return Some(
            "it is labelled service.kubernetes.io/service-proxy-name (another proxy owns it)",
        );
    }
    let Some(spec) = &svc.spec else {
        return Some("it has no spec");
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return Some("it is of type ExternalName (a DNS alias)");
    }
    match cluster_ip_strings(spec).first().map(String::as_str) {
        None | Some("") => Some("it has no cluster IP"),
        Some("None") => Some("it is headless (clusterIP: None)"),
        Some(_) => None,
    }
}

/// spec.clusterIPs when set, else spec.clusterIP: older objects only have the latter.
fn cluster_ip_strings(spec: &k8s_openapi::api::core::v1::ServiceSpec) -> Vec<String> {
    match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ips.clone(),
        _ => spec.cluster_ip.iter().cloned().collect(),
    }
}

/// The service's ports, or None when it is not proxied.
fn parse_service(key: &NamespacedName, svc: &Service) -> Result<Option<ServicePorts>, String> {
    if service_skip_reason(svc).is_some() {
        return Ok(None);
    }
    let Some(spec) = &svc.spec else {
        return Ok(None);
    };
    let type_ = spec.type_.as_deref().unwrap_or("ClusterIP");
    if !matches!(type_, "ClusterIP" | "NodePort" | "LoadBalancer") {
        return Err(format!(
            "spec.type {type_:?} is not ClusterIP, NodePort, LoadBalancer or ExternalName"
        ));
    }
    let cluster_ips = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => parse_ips("spec.clusterIPs", ips)?,
        _ => cluster_ip_strings(spec)
            .iter()
            .map(|ip| parse_ip("spec.clusterIP", ip))
            .collect::<Result<_, _>>()?,
    };
    let external_ips = parse_ips("spec.externalIPs", spec.external_ips.iter().flatten())?;
    let load_balancer_ips = svc
        .status
        .as_ref()
        .and_then(|status| status.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .into_iter()
        .flatten()
        .enumerate()
        // ipMode Proxy (KEP-1860): the load balancer proxies, and its traffic arrives for the
        // node's own address; kube-proxy programs only VIP ingresses (the default).
        .filter(|(_, ingress)| ingress.ip_mode.as_deref().is_none_or(|mode| mode == "VIP"))
        .filter_map(|(i, ingress)| Some((i, ingress.ip.as_ref()?)))
        .map(|(i, ip)| parse_ip(&format!("status.loadBalancer.ingress[{i}].ip"), ip))
        .collect::<Result<Vec<_>, _>>()?;

    let session_affinity_timeout = match spec.session_affinity.as_deref() {
        None | Some("None") => None,
        Some("ClientIP") => {
            let timeout = spec
                .session_affinity_config
                .as_ref()
                .and_then(|config| config.client_ip.as_ref())
                .and_then(|client_ip| client_ip.timeout_seconds);
            match timeout {
                None => NonZeroU32::new(DEFAULT_AFFINITY_TIMEOUT),
                Some(t @ 1..=MAX_AFFINITY_TIMEOUT) => NonZeroU32::new(t as u32),
                Some(t) => {
                    return Err(format!(
                        "spec.sessionAffinityConfig.clientIP.timeoutSeconds {t} is not in 1..={MAX_AFFINITY_TIMEOUT}"
                    ));
                }
            }
        }
        Some(other) => {
            return Err(format!(
                "spec.sessionAffinity {other:?} is not None or ClientIP"
            ));
        }
    };
    // As kube-proxy: the external policy only matters for traffic that can come from outside.
    let externally_reachable = type_ != "ClusterIP" || !external_ips.is_empty();
    let external_traffic_local = externally_reachable
        && traffic_policy("spec.externalTrafficPolicy", &spec.external_traffic_policy)?;
    // kube-proxy's NeedsHealthCheck: anywhere else the field is ignored, so not validated.
    let health_check_node_port = match spec.health_check_node_port {
        Some(n) if n != 0 && type_ == "LoadBalancer" && external_traffic_local => {
            NonZeroU16::new(port_number("spec.healthCheckNodePort", n)?)
        }
        _ => None,
    };
    let internal_traffic_local =
        traffic_policy("spec.internalTrafficPolicy", &spec.internal_traffic_policy)?;
    let source_ranges = if type_ == "LoadBalancer" {
        source_ranges(svc)?
    } else {
        Vec::new()
    };
    let lb_algorithm = svc
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(LB_ALGORITHM_ANNOTATION))
        .map(|value| value.parse::<LbAlgorithm>())
        .transpose()
        .map_err(|e| format!("metadata.annotations[{LB_ALGORITHM_ANNOTATION:?}] {e}"))?;

    let mut ports = Vec::new();
    for (i, port) in spec.ports.iter().flatten().enumerate() {
        let name = port.name.clone().unwrap_or_default();
        let at = if name.is_empty() {
            format!("spec.ports[{i}]")
        } else {
            format!("spec.ports[{i}] ({name:?})")
        };
        let number = port_number(&format!("{at}: port"), port.port)?;
        let protocol =
            protocol_or_tcp(port.protocol.as_deref()).map_err(|e| format!("{at}: {e}"))?;
        let target_port = match &port.target_port {
            // The API server defaults targetPort to port.
            None | Some(IntOrString::Int(0)) => TargetPort::Number(number),
            Some(IntOrString::Int(n)) => {
                TargetPort::Number(port_number(&format!("{at}: targetPort"), *n)?)
            }
            Some(IntOrString::String(s)) if s.is_empty() => TargetPort::Number(number),
            // A quoted number would silently become a port name that no endpoint has.
            Some(IntOrString::String(s)) if s.bytes().all(|b| b.is_ascii_digit()) => {
                return Err(format!(
                    "{at}: targetPort {s:?} is a string; write the number without quotes, or use a port name"
                ));
            }
            Some(IntOrString::String(s)) => TargetPort::Name(shared(s)),
        };
        let node_port = match port.node_port {
            None | Some(0) => None,
            Some(n) if type_ == "ClusterIP" => {
                return Err(format!(
                    "{at}: nodePort {n} is set but spec.type is ClusterIP (only NodePort and LoadBalancer services have node ports)"
                ));
            }
            Some(n) => Some(port_number(&format!("{at}: nodePort"), n)?),
        };
        let spn = ServicePortName::new(key.clone(), shared(&name), protocol);
        if ports.iter().any(|(other, _)| *other == spn) {
            return Err(format!(
                "{at}: another port has the same name and protocol ({protocol})"
            ));
        }
        ports.push((
            spn,
            Arc::new(ServicePort {
                cluster_ips: cluster_ips.clone().into(),
                port: number,
                protocol,
                target_port,
                node_port,
                external_ips: external_ips.as_slice().into(),
                load_balancer_ips: load_balancer_ips.as_slice().into(),
                session_affinity_timeout,
                external_traffic_local,
                internal_traffic_local,
                lb_algorithm,
                source_ranges: source_ranges.as_slice().into(),
                health_check_node_port,
            }),
        ));
    }
    ports.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(Some(ports.into()))
}

/// The annotation kube-proxy reads when spec.loadBalancerSourceRanges is empty.
const SOURCE_RANGES_ANNOTATION: &str = "service.beta.kubernetes.io/load-balancer-source-ranges";

/// A LoadBalancer Service's source ranges (CIDRs), from the spec or else the annotation.
fn source_ranges(svc: &Service) -> Result<Vec<Cidr>, String> {
    let from_spec: Vec<String> = svc
        .spec
        .as_ref()
        .and_then(|s| s.load_balancer_source_ranges.clone())
        .unwrap_or_default();
    let (field, values) = if from_spec.is_empty() {
        let annotation = svc
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(SOURCE_RANGES_ANNOTATION))
            .map(|v| {
                v.split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default();
        (
            format!("metadata.annotations[{SOURCE_RANGES_ANNOTATION:?}]"),
            annotation,
        )
    } else {
        ("spec.loadBalancerSourceRanges".to_string(), from_spec)
    };
    values
        .iter()
        .map(|cidr| {
            cidr.trim()
                .parse()
                .map_err(|_| format!("{field}: {cidr:?} is not a CIDR (like 203.0.113.0/24)"))
        })
        .collect()
}

/// True for "Local"; unset means "Cluster".
fn traffic_policy(field: &str, value: &Option<String>) -> Result<bool, String> {
    match value.as_deref() {
        None | Some("Cluster") => Ok(false),
        Some("Local") => Ok(true),
        Some(other) => Err(format!("{field} {other:?} is not Cluster or Local")),
    }
}
