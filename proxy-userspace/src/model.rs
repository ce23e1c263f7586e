//! Desired state and change tracking.
//!
//! Sources (the manifest file, the Kubernetes API) report Services and EndpointSlices one object at
//! a time; [`ChangeTracker`] turns them into per-port desired state and remembers which services
//! changed, so a dataplane sync only touches what changed. This follows kube-proxy's
//! `ServiceChangeTracker` / `EndpointsChangeTracker`: for each service with pending changes we keep
//! its inputs as last applied (`previous`) next to the live ones (`current`), and a change that
//! returns a service to its applied inputs is dropped.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::SystemTime;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::{EndpointConditions, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// Links an EndpointSlice to the Service it belongs to (in the slice's namespace).
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Objects with this label are handled by another proxy, as kube-proxy's informers filter them out.
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// Set on the EndpointSlices of headless services, which kube-proxy's informers also filter out.
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";
/// kube-apiserver's default for `sessionAffinityConfig.clientIP.timeoutSeconds` (3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10800;
/// The largest affinity timeout the API accepts (1 day).
const MAX_AFFINITY_TIMEOUT: i32 = 86400;

/// A namespaced object's name. The strings are shared: the tracker, the desired state and a
/// dataplane's bookkeeping each keep copies of the names of every service port, so a copy is a
/// reference count rather than two allocations.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NamespacedName {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl NamespacedName {
    pub fn new(namespace: impl Into<Arc<str>>, name: impl Into<Arc<str>>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for NamespacedName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// The IP protocol number, as it appears in the IP header.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }

    /// The protocol of an optional API field, which the API server defaults to TCP.
    fn parse_or_tcp(value: Option<&str>) -> Result<Self, String> {
        value.map_or(Ok(Protocol::Tcp), str::parse)
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        })
    }
}

impl FromStr for Protocol {
    type Err = String;

    /// Accepts the API's spelling only: "tcp" is rejected by the API server too.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "TCP" => Ok(Protocol::Tcp),
            "UDP" => Ok(Protocol::Udp),
            "SCTP" => Ok(Protocol::Sctp),
            _ => Err(format!("protocol {s:?} is not TCP, UDP or SCTP")),
        }
    }
}

/// One port of one service: the unit that is programmed. Its fields are [`PortName`]'s.
///
/// A shared pointer, 8 bytes: the tracker, the desired state and a dataplane's bookkeeping keep
/// several copies of every service port's name, mostly as map keys, so with tens of thousands
/// of ports the copies' size, not the names', is what counts. Compared, ordered and hashed by
/// value.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortName(Arc<PortName>);

/// What a [`ServicePortName`] names.
#[derive(PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortName {
    pub service: NamespacedName,
    /// The port's name; "" for the single unnamed port a service may have.
    pub port: Arc<str>,
    pub protocol: Protocol,
}

impl std::ops::Deref for ServicePortName {
    type Target = PortName;

    fn deref(&self) -> &PortName {
        &self.0
    }
}

impl fmt::Debug for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServicePortName")
            .field("service", &self.service)
            .field("port", &self.port)
            .field("protocol", &self.protocol)
            .finish()
    }
}

impl ServicePortName {
    pub fn new(service: NamespacedName, port: impl Into<Arc<str>>, protocol: Protocol) -> Self {
        Self(Arc::new(PortName {
            service,
            port: port.into(),
            protocol,
        }))
    }

    /// The smallest name of `service`'s ports, to range over them in a sorted map.
    fn first_of(service: &NamespacedName) -> Self {
        Self::new(service.clone(), "", Protocol::Tcp)
    }
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() {
            write!(f, "{}", self.service)
        } else {
            write!(f, "{}:{}", self.service, self.port)
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TargetPort {
    Number(u16),
    /// A container port name; resolved per endpoint through the EndpointSlice port of the same name.
    Name(String),
}

impl fmt::Display for TargetPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TargetPort::Number(n) => write!(f, "{n}"),
            TargetPort::Name(name) => f.write_str(name),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    /// spec.clusterIPs (or spec.clusterIP), primary family first.
    pub cluster_ips: Vec<IpAddr>,
    pub port: u16,
    pub protocol: Protocol,
    pub target_port: TargetPort,
    pub node_port: Option<u16>,
    pub external_ips: Vec<IpAddr>,
    /// status.loadBalancer.ingress[].ip (hostname-only entries carry no address to program).
    pub load_balancer_ips: Vec<IpAddr>,
    /// Some(seconds) when sessionAffinity is ClientIP.
    pub session_affinity_timeout: Option<u32>,
    /// externalTrafficPolicy is Local and the service is reachable from outside the cluster.
    pub external_traffic_local: bool,
    /// internalTrafficPolicy is Local.
    pub internal_traffic_local: bool,
    /// The Service's [`LB_ALGORITHM_ANNOTATION`], if set (else the agent's `--lb-algorithm`).
    pub lb_algorithm: Option<LbAlgorithm>,
    /// spec.loadBalancerSourceRanges (or kube-proxy's fallback, the
    /// `service.beta.kubernetes.io/load-balancer-source-ranges` annotation) of a LoadBalancer
    /// Service: the only sources its load balancer addresses accept. Empty: any source.
    pub source_ranges: Vec<(IpAddr, u8)>,
    /// spec.healthCheckNodePort, kept only where kube-proxy serves it: LoadBalancer Services
    /// with externalTrafficPolicy Local (see `service_health.rs`). A Service-wide field, on
    /// each of its ports.
    pub health_check_node_port: Option<u16>,
}

/// How new flows pick an endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LbAlgorithm {
    /// At random (kube-proxy's iptables and nftables modes do the same).
    Random,
    /// Maglev consistent hashing of the 5-tuple: the same endpoint for a flow on every node,
    /// and few flows move when an endpoint comes or goes.
    Maglev,
}

/// A Service annotation choosing its [`LbAlgorithm`] (`random` or `maglev`).
pub const LB_ALGORITHM_ANNOTATION: &str = "service.kube-proxy-ebpf.io/lb-algorithm";

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Endpoint {
    pub ip: IpAddr,
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// Shared with the tracker's copy of the slice (and with every port the endpoint serves).
    pub node_name: Option<Arc<str>>,
    pub zone: Option<Arc<str>>,
}

/// What the dataplane should program.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DesiredState {
    /// Shared with the tracker's copy of the Service.
    pub services: BTreeMap<ServicePortName, Arc<ServicePort>>,
    /// Endpoints of the ports in `services`, sorted and de-duplicated by (ip, port). A port
    /// without endpoints has no entry.
    pub endpoints: BTreeMap<ServicePortName, Vec<Endpoint>>,
    /// This node's name: endpoints whose `nodeName` it is are local.
    pub node_name: String,
}

impl DesiredState {
    /// All endpoints of `spn`, ready or not (empty when it has none).
    pub fn endpoints_of(&self, spn: &ServicePortName) -> &[Endpoint] {
        self.endpoints.get(spn).map_or(&[], Vec::as_slice)
    }

    /// The endpoints of `spn` that should receive new connections.
    pub fn ready_endpoints<'a>(
        &'a self,
        spn: &ServicePortName,
    ) -> impl Iterator<Item = &'a Endpoint> + use<'a> {
        self.endpoints_of(spn).iter().filter(|ep| ep.ready)
    }

    /// The endpoints that new connections to `spn` from inside the cluster (pods, and
    /// processes on the node) go to, picked as kube-proxy's `CategorizeEndpoints` does: the
    /// ready ones or, when none is ready, the serving ones that are terminating (KEP-1669, so
    /// that a rollout's last pods keep answering); with internalTrafficPolicy: Local, only
    /// this node's.
    pub fn cluster_endpoints(&self, spn: &ServicePortName) -> Vec<&Endpoint> {
        let local_only = self
            .services
            .get(spn)
            .is_some_and(|sp| sp.internal_traffic_local);
        self.usable_endpoints(spn, local_only)
    }

    /// The endpoints that new connections from outside the node (to a NodePort, LoadBalancer
    /// or external IP) go to: as [`Self::cluster_endpoints`], following the external traffic
    /// policy instead of the internal one.
    pub fn external_endpoints(&self, spn: &ServicePortName) -> Vec<&Endpoint> {
        let local_only = self
            .services
            .get(spn)
            .is_some_and(|sp| sp.external_traffic_local);
        self.usable_endpoints(spn, local_only)
    }

    /// Whether `ep` runs on this node.
    pub fn is_local(&self, ep: &Endpoint) -> bool {
        ep.node_name.as_deref() == Some(self.node_name.as_str())
    }

    /// The ready endpoints of `spn` (only this node's if `local_only`), else the serving
    /// terminating ones.
    pub fn usable_endpoints(&self, spn: &ServicePortName, local_only: bool) -> Vec<&Endpoint> {
        let candidates: Vec<&Endpoint> = self
            .endpoints_of(spn)
            .iter()
            .filter(|ep| !local_only || self.is_local(ep))
            .collect();
        if candidates.iter().any(|ep| ep.ready) {
            candidates.into_iter().filter(|ep| ep.ready).collect()
        } else {
            candidates
                .into_iter()
                .filter(|ep| ep.serving && ep.terminating)
                .collect()
        }
    }
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

/// An endpoint left out of an EndpointSlice whose other endpoints are used, as kube-proxy skips
/// single endpoints it cannot program.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("EndpointSlice {slice}: {reason}; this endpoint is skipped")]
pub struct SkippedEndpoint {
    pub slice: NamespacedName,
    pub reason: String,
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

/// The ports of one service, as parsed from the Service object, sorted by name. A boxed slice
/// rather than a map: most services have one or two ports, and a map's node would take about
/// 2 KiB each. Each port is shared with the desired state.
type ServiceInfo = Box<[(ServicePortName, Arc<ServicePort>)]>;

/// What the tracker keeps of one EndpointSlice: only the fields that reach the desired state, so
/// that comparing two versions says whether anything programmable changed.
#[derive(Debug, PartialEq, Eq)]
struct SliceInfo {
    service: NamespacedName,
    ports: Box<[SlicePort]>,
    endpoints: Box<[SliceEndpoint]>,
}

#[derive(Debug, PartialEq, Eq)]
struct SlicePort {
    name: Arc<str>,
    protocol: Protocol,
    port: u16,
}

#[derive(Debug, PartialEq, Eq)]
struct SliceEndpoint {
    ip: IpAddr,
    ready: bool,
    serving: bool,
    terminating: bool,
    node_name: Option<Arc<str>>,
    zone: Option<Arc<str>>,
}

/// A Service reduced to what the tracker records of it: what a source computes from the object
/// (without holding the tracker) and may keep to compare with the next version.
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceUpdate {
    pub key: NamespacedName,
    /// None: not proxied (`skip_reason` says why); the tracker treats it as deleted.
    ports: Option<Arc<ServiceInfo>>,
    /// Why it is not proxied (see [`service_skip_reason`]).
    pub skip_reason: Option<&'static str>,
}

impl ServiceUpdate {
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
            ports: ports.map(Arc::new),
            skip_reason: service_skip_reason(svc),
        })
    }
}

/// The annotation the EndpointSlice controller sets to the time of the change (a Pod or the
/// Service) that produced the slice's version: where kube-proxy's network programming latency
/// starts.
pub const LAST_CHANGE_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// An EndpointSlice reduced to what the tracker records of it; see [`ServiceUpdate`].
#[derive(Clone, Debug, PartialEq)]
pub struct SliceUpdate {
    pub key: NamespacedName,
    /// None: not proxied (headless, another proxy's, FQDN); the tracker treats it as deleted.
    info: Option<Arc<SliceInfo>>,
    /// The endpoints left out of it.
    skipped: Vec<SkippedEndpoint>,
    /// [`LAST_CHANGE_TRIGGER_TIME`], when the slice has a valid one.
    trigger_time: Option<SystemTime>,
}

impl SliceUpdate {
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
            Some((info, skipped)) => (Some(Arc::new(info)), skipped),
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

/// Everything one service's desired state is computed from. Cloning is cheap (reference counts).
#[derive(Debug, PartialEq)]
struct Inputs {
    service: Option<Arc<ServiceInfo>>,
    slices: Vec<(NamespacedName, Arc<SliceInfo>)>,
}

/// Tracks Services and EndpointSlices and the services changed since the last [`apply`].
///
/// [`apply`]: ChangeTracker::apply
#[derive(Debug, Default)]
pub struct ChangeTracker {
    /// Proxied services; skipped ones (headless, ExternalName...) are absent.
    services: HashMap<NamespacedName, Arc<ServiceInfo>>,
    /// Keyed by the slice's own namespace/name.
    slices: HashMap<NamespacedName, Arc<SliceInfo>>,
    /// Owner service -> its slices, sorted (a service has few). Slices may arrive before their
    /// service, so an entry can exist without a service.
    slices_by_service: HashMap<NamespacedName, Vec<NamespacedName>>,
    /// The endpoints skipped in each slice's current version (slices with none are absent), so
    /// that each is reported once rather than on every update of its slice.
    skipped: HashMap<NamespacedName, Vec<SkippedEndpoint>>,
    /// Services with changes not yet applied -> their inputs as last applied (`previous`); the
    /// live maps above are `current`.
    pending: HashMap<NamespacedName, Inputs>,
    /// The trigger times of the pending changes' slices, by service (see
    /// [`ChangeTracker::take_trigger_times`]).
    trigger_times: HashMap<NamespacedName, Vec<SystemTime>>,
    /// Trigger times before this are ignored: a slice listed at start may carry one from long
    /// ago (kube-proxy's rule). None: every one counts.
    started: Option<SystemTime>,
}

impl ChangeTracker {
    pub fn new() -> Self {
        // In whole seconds, as trigger times are written: a change made in the second the
        // tracker started counts.
        let now = SystemTime::now();
        let into_second = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(std::time::Duration::ZERO, |d| {
                std::time::Duration::from_nanos(d.subsec_nanos().into())
            });
        Self {
            started: Some(now - into_second),
            ..Self::default()
        }
    }

    /// Records the latest version of a Service. A service that is not proxied (see
    /// [`service_skip_reason`]) counts as deleted.
    pub fn update_service(&mut self, svc: &Service) -> Result<(), InvalidObject> {
        self.set_service(&ServiceUpdate::parse(svc)?);
        Ok(())
    }

    /// [`ChangeTracker::update_service`] with the Service already read.
    pub fn set_service(&mut self, update: &ServiceUpdate) {
        let key = &update.key;
        self.change(key, |t| match &update.ports {
            Some(ports) => t.services.insert(key.clone(), Arc::clone(ports)),
            None => t.services.remove(key),
        });
    }

    pub fn delete_service(&mut self, key: &NamespacedName) {
        if self.services.contains_key(key) {
            self.change(key, |t| t.services.remove(key));
        }
    }

    /// Records the latest version of an EndpointSlice. Slices of headless services, slices for
    /// another proxy and FQDN slices count as deleted. Endpoints that cannot be programmed are
    /// left out; the ones not already reported for this slice are returned, to be logged.
    pub fn update_slice(
        &mut self,
        slice: &EndpointSlice,
    ) -> Result<Vec<SkippedEndpoint>, InvalidObject> {
        Ok(self.set_slice(&SliceUpdate::parse(slice)?))
    }

    /// [`ChangeTracker::update_slice`] with the EndpointSlice already read.
    pub fn set_slice(&mut self, update: &SliceUpdate) -> Vec<SkippedEndpoint> {
        let key = &update.key;
        let Some(info) = &update.info else {
            self.delete_slice(key);
            return Vec::new();
        };
        let skipped = &update.skipped;
        let reported = self.skipped.remove(key).unwrap_or_default();
        let new: Vec<SkippedEndpoint> = skipped
            .iter()
            .filter(|s| !reported.contains(s))
            .cloned()
            .collect();
        if !skipped.is_empty() {
            self.skipped.insert(key.clone(), skipped.clone());
        }
        let owner = &info.service;
        let old_owner = self
            .slices
            .get(key)
            .map(|old| old.service.clone())
            .filter(|old| old != owner);
        // A relabelled slice leaves its old service: both services change.
        if let Some(old_owner) = &old_owner {
            self.change(old_owner, |t| t.unlink_slice(old_owner, key));
        }
        self.change(owner, |t| {
            let slices = t.slices_by_service.entry(owner.clone()).or_default();
            if let Err(at) = slices.binary_search(key) {
                slices.insert(at, key.clone());
            }
            t.slices.insert(key.clone(), Arc::clone(info));
        });
        if let Some(time) = update.trigger_time
            && self.pending.contains_key(owner)
            && self.started.is_none_or(|started| time >= started)
        {
            self.trigger_times
                .entry(owner.clone())
                .or_default()
                .push(time);
        }
        new
    }

    /// Forgets the slice named `key` (its own namespace/name).
    pub fn delete_slice(&mut self, key: &NamespacedName) {
        self.skipped.remove(key);
        let Some(owner) = self.slices.get(key).map(|s| s.service.clone()) else {
            return;
        };
        self.change(&owner, |t| {
            t.unlink_slice(&owner, key);
            t.slices.remove(key);
        });
    }

    /// The Services the tracker holds (proxied ones, at their last valid version).
    pub fn service_keys(&self) -> Vec<NamespacedName> {
        self.services.keys().cloned().collect()
    }

    /// The EndpointSlices the tracker holds (see [`ChangeTracker::service_keys`]).
    pub fn slice_keys(&self) -> Vec<NamespacedName> {
        self.slices.keys().cloned().collect()
    }

    /// True when some service's inputs differ from those last applied. [`apply`] may still report
    /// nothing when the difference does not reach the desired state (an endpoint moved from one
    /// slice to another, say).
    ///
    /// [`apply`]: ChangeTracker::apply
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The trigger times ([`LAST_CHANGE_TRIGGER_TIME`]) of the slice changes that the last
    /// [`apply`] took, for the network programming latency once they are programmed. Changes
    /// that cancelled out left none.
    ///
    /// [`apply`]: ChangeTracker::apply
    pub fn take_trigger_times(&mut self) -> Vec<SystemTime> {
        let pending = &self.pending;
        let (taken, kept) = std::mem::take(&mut self.trigger_times)
            .into_iter()
            .partition(|(service, _)| !pending.contains_key(service));
        self.trigger_times = kept;
        taken.into_values().flatten().collect()
    }

    /// Applies pending changes to `state`; returns every ServicePortName whose service port or
    /// endpoints changed (added, modified or removed). Changes that cancel out (A->B->A) are
    /// dropped. The work is proportional to the changed services, not to all of them.
    pub fn apply(&mut self, state: &mut DesiredState) -> BTreeSet<ServicePortName> {
        let pending = std::mem::take(&mut self.pending);
        if state.services.is_empty() && state.endpoints.is_empty() {
            return self.apply_fresh(pending.into_keys(), state);
        }
        let mut changed = BTreeSet::new();
        for service in pending.into_keys() {
            let (ports, endpoints) = self.render(&service);
            // `state` holds what was applied last: diffing against it (rather than against the
            // saved inputs) keeps `state` exact whatever it held before.
            sync_range(&mut state.services, &service, ports, &mut changed);
            sync_range(&mut state.endpoints, &service, endpoints, &mut changed);
        }
        changed
    }

    /// [`ChangeTracker::apply`] to an empty state (the first sync): the maps are built at once
    /// from sorted entries, which fills their nodes (inserting one by one leaves them about
    /// two-thirds full: megabytes with tens of thousands of services) and takes less time.
    fn apply_fresh(
        &self,
        services: impl Iterator<Item = NamespacedName>,
        state: &mut DesiredState,
    ) -> BTreeSet<ServicePortName> {
        let (mut ports, mut endpoints) = (Vec::new(), Vec::new());
        for service in services {
            let (p, e) = self.render(&service);
            ports.extend(p);
            endpoints.extend(e);
        }
        let changed = (ports.iter().map(|(spn, _)| spn.clone()))
            .chain(endpoints.iter().map(|(spn, _)| spn.clone()))
            .collect();
        state.services = BTreeMap::from_iter(ports);
        state.endpoints = BTreeMap::from_iter(endpoints);
        changed
    }

    /// Runs `mutate` as a change to `service`: saves its applied inputs the first time it changes,
    /// and drops the pending entry when the change brings it back to them.
    fn change<R>(&mut self, service: &NamespacedName, mutate: impl FnOnce(&mut Self) -> R) {
        if !self.pending.contains_key(service) {
            let previous = self.inputs(service);
            self.pending.insert(service.clone(), previous);
        }
        mutate(self);
        if self.pending.get(service) == Some(&self.inputs(service)) {
            self.pending.remove(service);
            self.trigger_times.remove(service);
        }
    }

    fn unlink_slice(&mut self, owner: &NamespacedName, slice: &NamespacedName) {
        if let Some(slices) = self.slices_by_service.get_mut(owner) {
            slices.retain(|s| s != slice);
            if slices.is_empty() {
                self.slices_by_service.remove(owner);
            }
        }
    }

    fn inputs(&self, service: &NamespacedName) -> Inputs {
        Inputs {
            service: self.services.get(service).cloned(),
            slices: self
                .slices_by_service
                .get(service)
                .into_iter()
                .flatten()
                .map(|name| (name.clone(), Arc::clone(&self.slices[name])))
                .collect(),
        }
    }

    /// The desired state of one service: its ports, and for each port the endpoints of every
    /// slice port with the same name and protocol (this is how named target ports resolve: the
    /// slice carries the number each endpoint uses). Both sorted by port name.
    fn render(&self, service: &NamespacedName) -> Rendered {
        let Some(ports) = self.services.get(service) else {
            return Default::default();
        };
        // Index i holds the endpoints of ports[i].
        let mut endpoints: Vec<Vec<Endpoint>> = vec![Vec::new(); ports.len()];
        for slice_name in self.slices_by_service.get(service).into_iter().flatten() {
            let slice = &self.slices[slice_name];
            for slice_port in &slice.ports {
                let Some(i) = ports.iter().position(|(spn, _)| {
                    spn.port == slice_port.name && spn.protocol == slice_port.protocol
                }) else {
                    continue;
                };
                endpoints[i].extend(slice.endpoints.iter().map(|ep| Endpoint {
                    ip: ep.ip,
                    port: slice_port.port,
                    ready: ep.ready,
                    serving: ep.serving,
                    terminating: ep.terminating,
                    node_name: ep.node_name.clone(),
                    zone: ep.zone.clone(),
                }));
            }
        }
        let endpoints = ports
            .iter()
            .zip(endpoints)
            .filter_map(|((spn, _), mut eps)| {
                dedup_endpoints(&mut eps);
                (!eps.is_empty()).then(|| (spn.clone(), eps))
            })
            .collect();
        (ports.to_vec(), endpoints)
    }
}

/// One service's ports and the endpoints of each port that has some, both sorted by name.
type Rendered = (
    Vec<(ServicePortName, Arc<ServicePort>)>,
    Vec<(ServicePortName, Vec<Endpoint>)>,
);

/// Sorts by (ip, port) and keeps one of each. An endpoint can be listed twice (briefly, while the
/// EndpointSlice controller moves it between slices); the copy that can take traffic wins, so a
/// move never drops a working endpoint.
fn dedup_endpoints(eps: &mut Vec<Endpoint>) {
    eps.sort_by(|a, b| {
        (a.ip, a.port)
            .cmp(&(b.ip, b.port))
            .then(b.ready.cmp(&a.ready))
            .then(b.serving.cmp(&a.serving))
            .then(a.terminating.cmp(&b.terminating))
            .then_with(|| a.cmp(b))
    });
    eps.dedup_by(|later, kept| (later.ip, later.port) == (kept.ip, kept.port));
}

/// Makes `service`'s entries in `map` equal to `wanted` (sorted by name), recording the keys
/// that changed.
fn sync_range<V: PartialEq>(
    map: &mut BTreeMap<ServicePortName, V>,
    service: &NamespacedName,
    wanted: Vec<(ServicePortName, V)>,
    changed: &mut BTreeSet<ServicePortName>,
) {
    let stale: Vec<ServicePortName> = map
        .range(ServicePortName::first_of(service)..)
        .take_while(|(spn, _)| spn.service == *service)
        .filter(|(spn, _)| wanted.binary_search_by(|(w, _)| w.cmp(spn)).is_err())
        .map(|(spn, _)| spn.clone())
        .collect();
    for spn in stale {
        map.remove(&spn);
        changed.insert(spn);
    }
    for (spn, value) in wanted {
        if map.get(&spn) != Some(&value) {
            map.insert(spn.clone(), value);
            changed.insert(spn);
        }
    }
}

/// A string that many objects share (a namespace, a node, zone or port name), kept once
/// however many objects name it. Strings no object uses any more are dropped as the set grows,
/// so it stays within twice the names in use.
fn shared(name: &str) -> Arc<str> {
    #[derive(Default)]
    struct Shared {
        names: HashSet<Arc<str>>,
        /// Its size after the last clean-up.
        kept: usize,
    }
    static SHARED: LazyLock<Mutex<Shared>> = LazyLock::new(Default::default);
    let mut shared = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(name) = shared.names.get(name) {
        return Arc::clone(name);
    }
    if shared.names.len() >= 2 * shared.kept.max(512) {
        shared.names.retain(|name| Arc::strong_count(name) > 1);
        shared.kept = shared.names.len();
    }
    let name = Arc::<str>::from(name);
    shared.names.insert(Arc::clone(&name));
    name
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
    value
        .parse()
        .map_err(|_| format!("{field}: {value:?} is not an IP address"))
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

/// The service's ports, or None when it is not proxied.
fn parse_service(key: &NamespacedName, svc: &Service) -> Result<Option<ServiceInfo>, String> {
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
                None => Some(DEFAULT_AFFINITY_TIMEOUT),
                Some(t @ 1..=MAX_AFFINITY_TIMEOUT) => Some(t as u32),
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
            Some(port_number("spec.healthCheckNodePort", n)?)
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
    let lb_algorithm = match svc
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(LB_ALGORITHM_ANNOTATION))
        .map(String::as_str)
    {
        None => None,
        Some("random") => Some(LbAlgorithm::Random),
        Some("maglev") => Some(LbAlgorithm::Maglev),
        Some(other) => {
            return Err(format!(
                "metadata.annotations[{LB_ALGORITHM_ANNOTATION:?}] {other:?} is not random or maglev"
            ));
        }
    };

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
            Protocol::parse_or_tcp(port.protocol.as_deref()).map_err(|e| format!("{at}: {e}"))?;
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
            Some(IntOrString::String(s)) => TargetPort::Name(s.clone()),
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
                cluster_ips: cluster_ips.clone(),
                port: number,
                protocol,
                target_port,
                node_port,
                external_ips: external_ips.clone(),
                load_balancer_ips: load_balancer_ips.clone(),
                session_affinity_timeout,
                external_traffic_local,
                internal_traffic_local,
                lb_algorithm,
                source_ranges: source_ranges.clone(),
                health_check_node_port,
            }),
        ));
    }
    ports.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(Some(ports.into_boxed_slice()))
}

/// The annotation kube-proxy reads when spec.loadBalancerSourceRanges is empty.
const SOURCE_RANGES_ANNOTATION: &str = "service.beta.kubernetes.io/load-balancer-source-ranges";

/// A LoadBalancer Service's source ranges (CIDRs), from the spec or else the annotation.
fn source_ranges(svc: &Service) -> Result<Vec<(IpAddr, u8)>, String> {
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
            let bad = || format!("{field}: {cidr:?} is not a CIDR (like 203.0.113.0/24)");
            let (addr, len) = cidr.trim().split_once('/').ok_or_else(bad)?;
            let addr: IpAddr = addr.parse().map_err(|_| bad())?;
            let len: u8 = len.parse().map_err(|_| bad())?;
            let max = if addr.is_ipv4() { 32 } else { 128 };
            if len > max {
                return Err(bad());
            }
            Ok((addr, len))
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
    let service = match labels.and_then(|l| l.get(SERVICE_NAME_LABEL)) {
        Some(name) if !name.is_empty() => NamespacedName::new(key.namespace.clone(), name.as_str()),
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
        ports.push(SlicePort {
            name: shared(port.name.as_deref().unwrap_or_default()),
            protocol: Protocol::parse_or_tcp(port.protocol.as_deref())
                .map_err(|e| format!("{at}: {e}"))?,
            port: port_number(&format!("{at}: port"), number)?,
        });
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
        endpoints.push(SliceEndpoint {
            ip,
            ready: condition(|c| c.ready).unwrap_or(true),
            serving: condition(|c| c.serving).unwrap_or(true),
            terminating: condition(|c| c.terminating).unwrap_or(false),
            node_name: ep.node_name.as_deref().map(shared),
            zone: ep.zone.as_deref().map(shared),
        });
    }
    let info = SliceInfo {
        service,
        ports: ports.into_boxed_slice(),
        endpoints: endpoints.into_boxed_slice(),
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn service(yaml: &str) -> Service {
        serde_yaml::from_str(yaml).expect("test Service must deserialize")
    }

    fn slice(yaml: &str) -> EndpointSlice {
        serde_yaml::from_str(yaml).expect("test EndpointSlice must deserialize")
    }

    fn nn(ns: &str, name: &str) -> NamespacedName {
        NamespacedName::new(ns, name)
    }

    fn spn(name: &str, port: &str, protocol: Protocol) -> ServicePortName {
        ServicePortName::new(nn("default", name), port, protocol)
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    const WEB: &str = "
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.10
  ports:
  - {name: http, port: 80, targetPort: http}
  - {name: metrics, port: 9090, protocol: TCP, targetPort: 9091}
";

    /// A slice of default/`service` with port "http" 8080/TCP; `endpoints` is YAML for its
    /// endpoints list.
    fn slice_of(service: &str, name: &str, address_type: &str, endpoints: &str) -> EndpointSlice {
        slice(&format!(
            "
metadata:
  name: {name}
  namespace: default
  labels: {{kubernetes.io/service-name: {service}}}
addressType: {address_type}
ports:
- {{name: http, port: 8080, protocol: TCP}}
endpoints: {endpoints}
"
        ))
    }

    fn web_slice(name: &str, ips: &[&str]) -> EndpointSlice {
        let endpoints: Vec<String> = ips
            .iter()
            .map(|ip| format!("{{addresses: [\"{ip}\"]}}"))
            .collect();
        slice_of("web", name, "IPv4", &format!("[{}]", endpoints.join(", ")))
    }

    fn applied(tracker: &mut ChangeTracker, state: &mut DesiredState) -> Vec<String> {
        tracker
            .apply(state)
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    fn endpoint_ips(state: &DesiredState, spn: &ServicePortName) -> Vec<String> {
        state
            .endpoints_of(spn)
            .iter()
            .map(|ep| format!("{}:{}", ep.ip, ep.port))
            .collect()
    }

    /// `web_slice` with a last-change-trigger-time annotation.
    fn triggered_slice(name: &str, ips: &[&str], at: SystemTime) -> EndpointSlice {
        let mut slice = web_slice(name, ips);
        let at = k8s_openapi::jiff::Timestamp::try_from(at).unwrap();
        slice.metadata.annotations =
            Some([(LAST_CHANGE_TRIGGER_TIME.to_string(), at.to_string())].into());
        slice
    }

    #[test]
    fn trigger_times_of_applied_slice_changes_are_handed_out_once() {
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        let now = SystemTime::now();
        let later = now + Duration::from_secs(1);
        // Before the tracker started (a slice listed at start): not counted.
        let old = now - Duration::from_secs(3600);
        tracker
            .update_slice(&triggered_slice("web-1", &["10.244.1.11"], old))
            .unwrap();
        tracker.apply(&mut state);
        assert!(tracker.take_trigger_times().is_empty());

        tracker
            .update_slice(&triggered_slice("web-1", &["10.244.1.12"], now))
            .unwrap();
        tracker
            .update_slice(&triggered_slice("web-2", &["10.244.1.13"], later))
            .unwrap();
        // Not applied yet: kept for the sync that will take the change.
        assert!(tracker.take_trigger_times().is_empty());
        tracker.apply(&mut state);
        let mut taken = tracker.take_trigger_times();
        taken.sort();
        // The annotation has second precision here (RFC 3339 as the controller writes it).
        let secs = |t: &SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs();
        assert_eq!(
            taken.iter().map(secs).collect::<Vec<_>>(),
            [secs(&now), secs(&later)]
        );
        assert!(tracker.take_trigger_times().is_empty(), "handed out twice");

        // A change undone before it was applied programs nothing: no latency to report.
        tracker
            .update_slice(&triggered_slice("web-2", &["10.244.1.14"], later))
            .unwrap();
        tracker
            .update_slice(&triggered_slice("web-2", &["10.244.1.13"], later))
            .unwrap();
        tracker.apply(&mut state);
        assert!(tracker.take_trigger_times().is_empty());
        // A slice without the annotation (or with a malformed one) has none.
        let mut bad = web_slice("web-2", &["10.244.1.15"]);
        bad.metadata.annotations = Some(
            [(
                LAST_CHANGE_TRIGGER_TIME.to_string(),
                "yesterday".to_string(),
            )]
            .into(),
        );
        tracker.update_slice(&bad).unwrap();
        tracker.apply(&mut state);
        assert!(tracker.take_trigger_times().is_empty());
    }

    #[test]
    fn display() {
        assert_eq!(
            spn("web", "http", Protocol::Tcp).to_string(),
            "default/web:http"
        );
        assert_eq!(spn("web", "", Protocol::Udp).to_string(), "default/web");
        assert_eq!(Protocol::Sctp.to_string(), "SCTP");
        assert_eq!(Protocol::Udp.number(), 17);
    }

    #[test]
    fn add_update_delete_service() {
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        tracker.update_service(&service(WEB)).unwrap();
        assert!(tracker.has_pending());
        assert_eq!(
            applied(&mut tracker, &mut state),
            ["default/web:http", "default/web:metrics"]
        );
        assert!(!tracker.has_pending());
        let http = &state.services[&spn("web", "http", Protocol::Tcp)];
        assert_eq!(http.cluster_ips, [ip("10.96.0.10")]);
        assert_eq!(http.port, 80);
        assert_eq!(http.target_port, TargetPort::Name("http".into()));
        assert_eq!(http.session_affinity_timeout, None);
        let metrics = &state.services[&spn("web", "metrics", Protocol::Tcp)];
        assert_eq!(metrics.target_port, TargetPort::Number(9091));

        // Changing one port reports only that port.
        tracker
            .update_service(&service(&WEB.replace("port: 9090", "port: 9100")))
            .unwrap();
        assert_eq!(applied(&mut tracker, &mut state), ["default/web:metrics"]);
        assert_eq!(
            state.services[&spn("web", "metrics", Protocol::Tcp)].port,
            9100
        );

        tracker.delete_service(&nn("default", "web"));
        assert_eq!(
            applied(&mut tracker, &mut state),
            ["default/web:http", "default/web:metrics"]
        );
        assert_eq!(state, DesiredState::default());
        // Deleting what is not there is no change.
        tracker.delete_service(&nn("default", "web"));
        assert!(!tracker.has_pending());
    }

    #[test]
    fn service_fields() {
        let svc = service(
            "
metadata: {name: lb, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.5
  clusterIPs: [10.96.0.5, 'fd00::5']
  externalIPs: [192.0.2.50]
  externalTrafficPolicy: Local
  internalTrafficPolicy: Local
  sessionAffinity: ClientIP
  ports:
  - {port: 53, protocol: UDP, nodePort: 30053}
status:
  loadBalancer:
    ingress: [{ip: 203.0.113.7}, {hostname: lb.example.com}]
",
        );
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        tracker.update_service(&svc).unwrap();
        tracker.apply(&mut state);
        let port = &state.services[&spn("lb", "", Protocol::Udp)];
        assert_eq!(port.cluster_ips, [ip("10.96.0.5"), ip("fd00::5")]);
        assert_eq!(port.target_port, TargetPort::Number(53));
        assert_eq!(port.node_port, Some(30053));
        assert_eq!(port.external_ips, [ip("192.0.2.50")]);
        assert_eq!(port.load_balancer_ips, [ip("203.0.113.7")]);
        assert_eq!(
            port.session_affinity_timeout,
            Some(DEFAULT_AFFINITY_TIMEOUT)
        );
        assert!(port.external_traffic_local);
        assert!(port.internal_traffic_local);

        // externalTrafficPolicy means nothing for a service nothing outside can reach.
        let cluster_only = service(
            "
metadata: {name: internal, namespace: default}
spec: {clusterIP: 10.96.0.6, externalTrafficPolicy: Local, ports: [{port: 80}]}
",
        );
        tracker.update_service(&cluster_only).unwrap();
        tracker.apply(&mut state);
        assert!(!state.services[&spn("internal", "", Protocol::Tcp)].external_traffic_local);
    }

    #[test]
    fn cancelling_changes_are_dropped() {
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        tracker.update_service(&service(WEB)).unwrap();
        tracker
            .update_slice(&web_slice("web-1", &["10.244.1.11"]))
            .unwrap();
        tracker.apply(&mut state);

        // A -> B -> A.
        tracker
            .update_service(&service(&WEB.replace("10.96.0.10", "10.96.0.11")))
            .unwrap();
        tracker
            .update_slice(&web_slice("web-1", &["10.244.1.12"]))
            .unwrap();
        assert!(tracker.has_pending());
        tracker.update_service(&service(WEB)).unwrap();
        tracker
            .update_slice(&web_slice("web-1", &["10.244.1.11"]))
            .unwrap();
        assert!(!tracker.has_pending());
        assert!(tracker.apply(&mut state).is_empty());

        // Add then delete before any apply.
        tracker
            .update_slice(&web_slice("web-2", &["10.244.1.13"]))
            .unwrap();
        tracker.delete_slice(&nn("default", "web-2"));
        assert!(!tracker.has_pending());

        // An endpoint moving between slices changes no port.
        tracker
            .update_slice(&web_slice("web-2", &["10.244.1.11"]))
            .unwrap();
        tracker.delete_slice(&nn("default", "web-1"));
        assert!(tracker.has_pending());
        assert!(tracker.apply(&mut state).is_empty());
        assert_eq!(
            endpoint_ips(&state, &spn("web", "http", Protocol::Tcp)),
            ["10.244.1.11:8080"]
        );
    }

    #[test]
    fn services_that_are_not_proxied() {
        let cases = [
            ("headless", "spec: {clusterIP: None, ports: [{port: 80}]}"),
            ("no-ip", "spec: {ports: [{port: 80}]}"),
            (
                "alias",
                "spec: {type: ExternalName, externalName: example.com, ports: [{port: 80}]}",
            ),
            (
                "other-proxy",
                "  labels: {service.kubernetes.io/service-proxy-name: foo}\nspec: {clusterIP: 10.96.0.9, ports: [{port: 80}]}",
            ),
        ];
        for (name, rest) in cases {
            let svc = service(&format!(
                "metadata:\n  name: {name}\n  namespace: default\n{rest}"
            ));
            assert!(service_skip_reason(&svc).is_some(), "{name}");
            let mut tracker = ChangeTracker::new();
            tracker.update_service(&svc).unwrap();
            assert!(!tracker.has_pending(), "{name} must not be proxied");
        }

        // A proxied service that becomes headless is removed.
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        tracker.update_service(&service(WEB)).unwrap();
        tracker.apply(&mut state);
        tracker
            .update_service(&service(&WEB.replace("10.96.0.10", "None")))
            .unwrap();
        assert_eq!(applied(&mut tracker, &mut state).len(), 2);
        assert!(state.services.is_empty());
    }

    #[test]
    fn slices_are_merged_and_deduplicated() {
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        tracker.update_service(&service(WEB)).unwrap();
        tracker.apply(&mut state);
        tracker
            .update_slice(&web_slice("web-1", &["10.244.1.12", "10.244.1.11"]))
            .unwrap();
        tracker
            .update_slice(&web_slice("web-2", &["10.244.1.11", "10.244.2.11"]))
            .unwrap();
        assert_eq!(applied(&mut tracker, &mut state), ["default/web:http"]);
        let http = spn("web", "http", Protocol::Tcp);
        assert_eq!(
            endpoint_ips(&state, &http),
            ["10.244.1.11:8080", "10.244.1.12:8080", "10.244.2.11:8080"]
        );
        assert_eq!(state.ready_endpoints(&http).count(), 3);
        // "metrics" has no slice port of that name, so no endpoints.
        assert!(
            state
                .endpoints_of(&spn("web", "metrics", Protocol::Tcp))
                .is_empty()
        );

        // Removing one copy of the duplicate keeps the endpoint.
        tracker
            .update_slice(&web_slice("web-1", &["10.244.1.12"]))
            .unwrap();
        assert!(tracker.apply(&mut state).is_empty());
        tracker.delete_slice(&nn("default", "web-2"));
        assert_eq!(applied(&mut tracker, &mut state), ["default/web:http"]);
        assert_eq!(endpoint_ips(&state, &http), ["10.244.1.12:8080"]);
    }

    #[test]
    fn duplicate_prefers_the_ready_copy() {
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        tracker.update_service(&service(WEB)).unwrap();
        let not_ready = "[{addresses: [10.244.1.11], conditions: {ready: false}}]";
        tracker
            .update_slice(&slice_of("web", "web-1", "IPv4", not_ready))
            .unwrap();
        tracker
            .update_slice(&web_slice("web-2", &["10.244.1.11"]))
            .unwrap();
        tracker.apply(&mut state);
        let eps = state.endpoints_of(&spn("web", "http", Protocol::Tcp));
        assert_eq!(eps.len(), 1);
        assert!(eps[0].ready);
    }

    #[test]
    fn slices_before_their_service() {
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        tracker
            .update_slice(&web_slice("web-1", &["10.244.1.11"]))
            .unwrap();
        assert!(tracker.apply(&mut state).is_empty());
        assert!(state.endpoints.is_empty());
        tracker.update_service(&service(WEB)).unwrap();
        assert_eq!(
            applied(&mut tracker, &mut state),
            ["default/web:http", "default/web:metrics"]
        );
        assert_eq!(
            endpoint_ips(&state, &spn("web", "http", Protocol::Tcp)),
            ["10.244.1.11:8080"]
        );
        // Deleting the service removes its endpoints from the state but not from the tracker.
        tracker.delete_service(&nn("default", "web"));
        tracker.apply(&mut state);
        assert_eq!(state, DesiredState::default());
        tracker.update_service(&service(WEB)).unwrap();
        tracker.apply(&mut state);
        assert_eq!(state.endpoints.len(), 1);
    }

    #[test]
    fn slice_changes_owner() {
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        tracker.update_service(&service(WEB)).unwrap();
        tracker
            .update_service(&service(
                &WEB.replace("name: web", "name: api")
                    .replace("10.96.0.10", "10.96.0.11"),
            ))
            .unwrap();
        tracker
            .update_slice(&web_slice("shared", &["10.244.1.11"]))
            .unwrap();
        tracker.apply(&mut state);
        assert_eq!(state.endpoints.len(), 1);

        let relabelled = slice_of("api", "shared", "IPv4", "[{addresses: [10.244.1.11]}]");
        tracker.update_slice(&relabelled).unwrap();
        assert_eq!(
            applied(&mut tracker, &mut state),
            ["default/api:http", "default/web:http"]
        );
        assert_eq!(
            endpoint_ips(&state, &spn("api", "http", Protocol::Tcp)),
            ["10.244.1.11:8080"]
        );
        assert!(
            state
                .endpoints_of(&spn("web", "http", Protocol::Tcp))
                .is_empty()
        );

        // Deleting it now affects the new owner only.
        tracker.delete_slice(&nn("default", "shared"));
        assert_eq!(applied(&mut tracker, &mut state), ["default/api:http"]);
        assert!(state.endpoints.is_empty());
    }

    #[test]
    fn unnamed_slice_ports_match_only_the_unnamed_service_port() {
        // As kube-proxy: slice ports match service ports by name, and "" (or no name) is a name.
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        let single = "
metadata: {name: single, namespace: default}
spec: {clusterIP: 10.96.0.30, ports: [{port: 80, targetPort: 8080}]}
";
        tracker.update_service(&service(single)).unwrap();
        tracker.update_service(&service(WEB)).unwrap();
        for owner in ["single", "web"] {
            tracker
                .update_slice(&slice(&format!(
                    "
metadata: {{name: {owner}-1, namespace: default, labels: {{kubernetes.io/service-name: {owner}}}}}
addressType: IPv4
ports:
- {{port: 8080}}
- {{name: '', port: 8081, protocol: UDP}}
- {{name: http, port: 8082}}
endpoints: [{{addresses: [10.244.1.11]}}]
"
                )))
                .unwrap();
        }
        tracker.apply(&mut state);
        assert_eq!(
            endpoint_ips(&state, &spn("single", "", Protocol::Tcp)),
            ["10.244.1.11:8080"]
        );
        // The unnamed slice ports lend no endpoints to the named ports of "web".
        assert_eq!(
            endpoint_ips(&state, &spn("web", "http", Protocol::Tcp)),
            ["10.244.1.11:8082"]
        );
        assert_eq!(state.endpoints.len(), 2, "{:?}", state.endpoints.keys());
    }

    #[test]
    fn named_ports_resolve_per_slice() {
        // Two pod versions name the same port differently numbered: each slice carries its own.
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        tracker
            .update_service(&service(
                "
metadata: {name: dns, namespace: default}
spec:
  clusterIP: 10.96.0.20
  ports:
  - {name: dns, port: 53, protocol: UDP, targetPort: dns}
  - {name: dns-tcp, port: 53, protocol: TCP, targetPort: dns-tcp}
",
            ))
            .unwrap();
        for (name, ip, port) in [("v1", "10.244.1.11", 5353), ("v2", "10.244.1.12", 8053)] {
            tracker
                .update_slice(&slice(&format!(
                    "
metadata: {{name: dns-{name}, namespace: default, labels: {{kubernetes.io/service-name: dns}}}}
addressType: IPv4
ports:
- {{name: dns, port: {port}, protocol: UDP}}
- {{name: dns-tcp, port: {port}, protocol: TCP}}
- {{name: dns, port: 1, protocol: TCP}}
endpoints: [{{addresses: [{ip}]}}]
"
                )))
                .unwrap();
        }
        tracker.apply(&mut state);
        let udp = spn("dns", "dns", Protocol::Udp);
        assert_eq!(
            endpoint_ips(&state, &udp),
            ["10.244.1.11:5353", "10.244.1.12:8053"]
        );
        // The TCP port named "dns" matches no service port (wrong protocol) and is ignored.
        assert_eq!(
            endpoint_ips(&state, &spn("dns", "dns-tcp", Protocol::Tcp)),
            ["10.244.1.11:5353", "10.244.1.12:8053"]
        );
        assert_eq!(state.endpoints.len(), 2);
    }

    #[test]
    fn invalid_objects_keep_the_previous_version() {
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        tracker.update_service(&service(WEB)).unwrap();
        tracker
            .update_slice(&web_slice("web-1", &["10.244.1.11"]))
            .unwrap();
        tracker.apply(&mut state);
        let before = state.clone();

        let bad_services = [
            (
                WEB.replace("port: 9090", "port: 0"),
                r#"Service default/web: spec.ports[1] ("metrics"): port 0 is not in 1..=65535"#,
            ),
            (
                WEB.replace("10.96.0.10", "10.96.0.300"),
                r#"Service default/web: spec.clusterIP: "10.96.0.300" is not an IP address"#,
            ),
            (
                WEB.replace("protocol: TCP", "protocol: tcp"),
                r#"Service default/web: spec.ports[1] ("metrics"): protocol "tcp" is not TCP, UDP or SCTP"#,
            ),
            (
                WEB.replace("targetPort: 9091", "targetPort: '9091'"),
                r#"Service default/web: spec.ports[1] ("metrics"): targetPort "9091" is a string; write the number without quotes, or use a port name"#,
            ),
            (
                WEB.replace("name: web, ", ""),
                "Service default/<no name>: metadata.name is missing",
            ),
            (
                WEB.replace(", namespace: default", ""),
                "Service /web: metadata.namespace is missing",
            ),
        ];
        for (yaml, message) in bad_services {
            let err = tracker.update_service(&service(&yaml)).unwrap_err();
            assert_eq!(err.to_string(), message);
        }

        let good = "
metadata:
  name: web-1
  namespace: default
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: ['10.244.1.11']}]
";
        let bad_slices = [
            (
                good.replace("port: 8080", "port: 70000"),
                "EndpointSlice default/web-1: ports[0]: port 70000 is not in 1..=65535",
            ),
            (
                good.replace("kubernetes.io/service-name", "app"),
                "EndpointSlice default/web-1: metadata.labels has no kubernetes.io/service-name, so it belongs to no Service",
            ),
            (
                good.replace("IPv4", "IPv5"),
                r#"EndpointSlice default/web-1: addressType "IPv5" is not IPv4, IPv6 or FQDN"#,
            ),
        ];
        for (yaml, message) in bad_slices {
            let err = tracker.update_slice(&slice(&yaml)).unwrap_err();
            assert_eq!(err.to_string(), message);
        }
        assert!(!tracker.has_pending());
        assert!(tracker.apply(&mut state).is_empty());
        assert_eq!(state, before);
    }

    #[test]
    fn a_bad_endpoint_skips_only_itself() {
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        tracker.update_service(&service(WEB)).unwrap();
        tracker.apply(&mut state);
        let endpoints = |extra: &str| {
            format!(
                "[{{addresses: [10.244.1.11]}}, {{addresses: ['10.244.1.x']}}, {{addresses: ['fd00::1']}}, {{addresses: []}}{extra}]"
            )
        };
        let bad = slice_of("web", "web-1", "IPv4", &endpoints(""));
        let skipped: Vec<String> = tracker
            .update_slice(&bad)
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            skipped,
            [
                r#"EndpointSlice default/web-1: endpoints[1].addresses[0]: "10.244.1.x" is not an IP address; this endpoint is skipped"#,
                "EndpointSlice default/web-1: endpoints[2].addresses[0]: fd00::1 does not match addressType IPv4; this endpoint is skipped",
                "EndpointSlice default/web-1: endpoints[3]: addresses is empty; this endpoint is skipped",
            ]
        );
        assert_eq!(applied(&mut tracker, &mut state), ["default/web:http"]);
        let http = spn("web", "http", Protocol::Tcp);
        assert_eq!(endpoint_ips(&state, &http), ["10.244.1.11:8080"]);

        // Reported once: the same slice again (a re-list, a resync) reports nothing, and neither
        // does a change that adds no new problem.
        assert!(tracker.update_slice(&bad).unwrap().is_empty());
        assert!(tracker.apply(&mut state).is_empty());
        let grown = slice_of(
            "web",
            "web-1",
            "IPv4",
            &endpoints(", {addresses: [10.244.1.12]}"),
        );
        assert!(tracker.update_slice(&grown).unwrap().is_empty());
        assert_eq!(applied(&mut tracker, &mut state), ["default/web:http"]);
        assert_eq!(
            endpoint_ips(&state, &http),
            ["10.244.1.11:8080", "10.244.1.12:8080"]
        );

        // A slice deleted and added again is new: its problems are reported again.
        tracker.delete_slice(&nn("default", "web-1"));
        assert_eq!(tracker.update_slice(&bad).unwrap().len(), 3);
    }

    #[test]
    fn condition_defaults() {
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        tracker.update_service(&service(WEB)).unwrap();
        tracker
            .update_slice(&slice(
                "
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- addresses: [10.244.1.11]
  nodeName: node1
  zone: zone-a
- addresses: [10.244.1.12]
  conditions: {ready: false}
- addresses: [10.244.1.13]
  conditions: {ready: false, serving: true, terminating: true}
- addresses: [10.244.1.14]
  conditions: {serving: false}
",
            ))
            .unwrap();
        tracker.apply(&mut state);
        let http = spn("web", "http", Protocol::Tcp);
        let eps = state.endpoints_of(&http);
        assert_eq!(
            eps[0],
            Endpoint {
                ip: ip("10.244.1.11"),
                port: 8080,
                ready: true,
                serving: true,
                terminating: false,
                node_name: Some("node1".into()),
                zone: Some("zone-a".into()),
            }
        );
        // As kube-proxy reads them: an unset serving is true whatever ready says.
        assert_eq!(
            (eps[1].ready, eps[1].serving, eps[1].terminating),
            (false, true, false)
        );
        assert_eq!(
            (eps[2].ready, eps[2].serving, eps[2].terminating),
            (false, true, true)
        );
        assert_eq!(
            (eps[3].ready, eps[3].serving, eps[3].terminating),
            (true, false, false)
        );
        let ready: Vec<_> = state.ready_endpoints(&http).map(|ep| ep.ip).collect();
        assert_eq!(ready, [ip("10.244.1.11"), ip("10.244.1.14")]);
    }

    #[test]
    fn ipv6_slices_are_kept_and_fqdn_ignored() {
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        tracker.update_service(&service(WEB)).unwrap();
        tracker
            .update_slice(&web_slice("web-v4", &["10.244.1.11"]))
            .unwrap();
        let v6 = slice_of(
            "web",
            "web-v6",
            "IPv6",
            "[{addresses: ['fd00:10:244:1::11']}]",
        );
        tracker.update_slice(&v6).unwrap();
        let fqdn = slice_of(
            "web",
            "web-fqdn",
            "FQDN",
            "[{addresses: [web.example.com]}]",
        );
        tracker.update_slice(&fqdn).unwrap();
        tracker.apply(&mut state);
        assert_eq!(
            endpoint_ips(&state, &spn("web", "http", Protocol::Tcp)),
            ["10.244.1.11:8080", "fd00:10:244:1::11:8080"]
        );
    }

    #[test]
    fn headless_slices_are_ignored() {
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        tracker.update_service(&service(WEB)).unwrap();
        tracker
            .update_slice(&web_slice("web-1", &["10.244.1.11"]))
            .unwrap();
        tracker.apply(&mut state);
        let headless = slice(
            "
metadata:
  name: web-1
  namespace: default
  labels: {kubernetes.io/service-name: web, service.kubernetes.io/headless: ''}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: [10.244.1.11]}]
",
        );
        tracker.update_slice(&headless).unwrap();
        assert_eq!(applied(&mut tracker, &mut state), ["default/web:http"]);
        assert!(state.endpoints.is_empty());
    }

    #[test]
    fn apply_repairs_a_fresh_state() {
        // apply diffs against the state it is given, so a rebuilt state gets everything changed.
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        tracker.update_service(&service(WEB)).unwrap();
        tracker.apply(&mut state);
        state.services.insert(
            spn("web", "stale", Protocol::Tcp),
            state.services[&spn("web", "http", Protocol::Tcp)].clone(),
        );
        tracker
            .update_service(&service(&WEB.replace("port: 9090", "port: 9100")))
            .unwrap();
        assert_eq!(
            applied(&mut tracker, &mut state),
            ["default/web:metrics", "default/web:stale"]
        );
        assert_eq!(state.services.len(), 2);
    }

    #[test]
    fn cluster_endpoints_fall_back_to_terminating_and_follow_the_internal_policy() {
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState {
            node_name: "node1".into(),
            ..DesiredState::default()
        };
        tracker.update_service(&service(WEB)).unwrap();
        let web_slice = |conditions: [&str; 3]| {
            slice(&format!(
                "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: default
  labels: {{kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
- {{addresses: [10.244.1.11], nodeName: node1, conditions: {}}}
- {{addresses: [10.244.2.11], nodeName: node2, conditions: {}}}
- {{addresses: [10.244.2.12], nodeName: node2, conditions: {}}}
",
                conditions[0], conditions[1], conditions[2]
            ))
        };
        let http = spn("web", "http", Protocol::Tcp);
        let ips = |state: &DesiredState| -> Vec<String> {
            state
                .cluster_endpoints(&http)
                .iter()
                .map(|ep| ep.ip.to_string())
                .collect()
        };
        const READY: &str = "{ready: true}";
        const TERMINATING: &str = "{ready: false, serving: true, terminating: true}";
        const GONE: &str = "{ready: false, serving: false, terminating: true}";
        // Ready endpoints win over terminating ones.
        tracker
            .update_slice(&web_slice([TERMINATING, READY, GONE]))
            .unwrap();
        tracker.apply(&mut state);
        assert_eq!(ips(&state), ["10.244.2.11"]);
        // None ready: the serving terminating ones.
        tracker
            .update_slice(&web_slice([TERMINATING, GONE, TERMINATING]))
            .unwrap();
        tracker.apply(&mut state);
        assert_eq!(ips(&state), ["10.244.1.11", "10.244.2.12"]);
        // internalTrafficPolicy: Local: this node's only, with the same fallback.
        let local = |state: &mut DesiredState| {
            Arc::make_mut(state.services.get_mut(&http).unwrap()).internal_traffic_local = true;
        };
        local(&mut state);
        assert_eq!(ips(&state), ["10.244.1.11"]);
        tracker
            .update_slice(&web_slice([GONE, READY, READY]))
            .unwrap();
        tracker.apply(&mut state);
        local(&mut state);
        assert!(ips(&state).is_empty(), "no usable local endpoint");
    }

    #[test]
    fn updates_keep_only_what_reaches_the_state() {
        // A source compares updates to see whether an object changed: a label, an annotation or
        // a pod reference does not count; a port or a condition does.
        let base = ServiceUpdate::parse(&service(WEB)).unwrap();
        let labelled = WEB.replace(
            "name: web, namespace: default",
            "name: web, namespace: default, labels: {app: web}, annotations: {a: b}",
        );
        assert_eq!(ServiceUpdate::parse(&service(&labelled)).unwrap(), base);
        let moved = WEB.replace("port: 9090", "port: 9100");
        assert_ne!(ServiceUpdate::parse(&service(&moved)).unwrap(), base);
        let headless = ServiceUpdate::parse(&service(&WEB.replace("10.96.0.10", "None"))).unwrap();
        assert_eq!(
            headless.skip_reason,
            Some("it is headless (clusterIP: None)")
        );
        assert_ne!(headless, base);

        let endpoints =
            |extra: &str| format!("[{{addresses: [10.244.1.11], nodeName: node1{extra}}}]");
        let base = SliceUpdate::parse(&slice_of("web", "web-1", "IPv4", &endpoints(""))).unwrap();
        let pod = ", targetRef: {kind: Pod, name: web-abc}, hostname: web-abc";
        let same = slice_of("web", "web-1", "IPv4", &endpoints(pod));
        assert_eq!(SliceUpdate::parse(&same).unwrap(), base);
        let not_ready = endpoints(", conditions: {ready: false}");
        let changed = slice_of("web", "web-1", "IPv4", &not_ready);
        assert_ne!(SliceUpdate::parse(&changed).unwrap(), base);

        // Applying an update is the same as applying the object.
        let mut by_object = ChangeTracker::new();
        let mut by_update = ChangeTracker::new();
        by_object.update_service(&service(WEB)).unwrap();
        by_object.update_slice(&changed).unwrap();
        by_update.set_service(&ServiceUpdate::parse(&service(WEB)).unwrap());
        by_update.set_slice(&SliceUpdate::parse(&changed).unwrap());
        let (mut a, mut b) = (DesiredState::default(), DesiredState::default());
        assert_eq!(by_object.apply(&mut a), by_update.apply(&mut b));
        assert_eq!(a, b);
    }

    #[test]
    fn names_are_shared_not_copied() {
        // The state's copies of a service's names and of an endpoint's node name point at the
        // tracker's strings: a large cluster holds each name once.
        let mut tracker = ChangeTracker::new();
        let mut state = DesiredState::default();
        tracker.update_service(&service(WEB)).unwrap();
        tracker
            .update_slice(&slice_of(
                "web",
                "web-1",
                "IPv4",
                "[{addresses: [10.244.1.11], nodeName: node1}]",
            ))
            .unwrap();
        tracker.apply(&mut state);
        let (spn, port) = state.services.first_key_value().unwrap();
        let (ep_spn, eps) = state.endpoints.first_key_value().unwrap();
        assert!(Arc::ptr_eq(&spn.service.name, &ep_spn.service.name));
        assert_eq!(std::mem::size_of::<ServicePortName>(), 8);
        assert_eq!(port.port, 80);
        let again = state.clone();
        let node = eps[0].node_name.as_ref().unwrap();
        let copy = again.endpoints[ep_spn][0].node_name.as_ref().unwrap();
        assert!(Arc::ptr_eq(node, copy));
        assert_eq!(&**node, "node1");
    }

    #[test]
    fn shared_names_are_kept_once_and_dropped_unused() {
        let used = shared("test-node-used");
        assert!(Arc::ptr_eq(&used, &shared("test-node-used")));
        let unused = Arc::downgrade(&shared("test-node-unused"));
        for i in 0..5000 {
            shared(&format!("test-node-filler-{i}"));
        }
        assert!(unused.upgrade().is_none(), "an unused name is dropped");
        assert!(Arc::ptr_eq(&used, &shared("test-node-used")));
    }

    #[test]
    fn a_fresh_state_is_built_as_incrementally() {
        let build = |seeded: bool| {
            let mut tracker = ChangeTracker::new();
            for i in 0..50 {
                let svc = WEB
                    .replace("name: web", &format!("name: web{i}"))
                    .replace("10.96.0.10", &format!("10.96.1.{i}"));
                tracker.update_service(&service(&svc)).unwrap();
                let endpoints = format!("[{{addresses: [10.244.1.{i}], nodeName: node{i}}}]");
                let slice = slice_of(&format!("web{i}"), &format!("web{i}-1"), "IPv4", &endpoints);
                tracker.update_slice(&slice).unwrap();
            }
            let mut state = DesiredState::default();
            // Another service's entry: the state is not fresh, so it is updated port by port.
            let seed = spn("seed", "", Protocol::Tcp);
            if seeded {
                state.endpoints.insert(seed.clone(), Vec::new());
            }
            let changed = tracker.apply(&mut state);
            state.endpoints.remove(&seed);
            (state, changed)
        };
        let (fresh, changed) = build(false);
        assert_eq!((fresh.services.len(), fresh.endpoints.len()), (100, 50));
        assert_eq!(changed.len(), 100);
        assert_eq!((fresh, changed), build(true));
    }
}
