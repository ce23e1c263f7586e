//! The desired state: every Service port and its endpoints, and which endpoints a frontend
//! sends to.
use std::{collections::BTreeMap, sync::Arc};

use super::{Cidr, Endpoint, Hints, ServicePort, ServicePortName};

/// What the dataplane should program. Read through its methods: the modes do not depend on
/// how it is kept.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DesiredState {
    /// Shared with the tracker's copy of the Service.
    pub(super) services: BTreeMap<ServicePortName, Arc<ServicePort>>,
    /// Endpoints of the ports in `services`, sorted and de-duplicated by (ip, port). A port
    /// without endpoints has no entry. Shared with the tracker's copy of the EndpointSlice
    /// when they all come from one.
    pub(super) endpoints: BTreeMap<ServicePortName, Arc<[Endpoint]>>,
    /// This node's name: endpoints whose `nodeName` it is are local.
    node_name: String,
    /// This node's zone (its Node's `topology.kubernetes.io/zone` label), for topology hints.
    pub(super) node_zone: Option<Arc<str>>,
    /// The ranges cluster IPs are allocated from (the ServiceCIDR objects'), sorted.
    pub(super) service_cidrs: Vec<Cidr>,
}

impl DesiredState {
    /// An empty state for the node `node_name`.
    pub fn new(node_name: impl Into<String>) -> Self {
        Self {
            node_name: node_name.into(),
            ..Self::default()
        }
    }

    /// This node's name: endpoints whose `nodeName` it is are local.
    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// The ranges cluster IPs are allocated from (the ServiceCIDR objects'), sorted; empty
    /// when none is known.
    pub fn service_cidrs(&self) -> &[Cidr] {
        &self.service_cidrs
    }

    /// Every Service port, in name order.
    pub fn ports(&self) -> impl Iterator<Item = (&ServicePortName, &ServicePort)> + '_ {
        self.services.iter().map(|(spn, port)| (spn, &**port))
    }

    /// The Service ports that have endpoints, with them, in name order.
    pub fn endpoints(&self) -> impl Iterator<Item = (&ServicePortName, &[Endpoint])> + '_ {
        self.endpoints.iter().map(|(spn, eps)| (spn, &**eps))
    }

    /// The names of every Service port, in order.
    pub fn port_names(&self) -> impl Iterator<Item = &ServicePortName> + '_ {
        self.services.keys()
    }

    pub fn port(&self, spn: &ServicePortName) -> Option<&ServicePort> {
        self.services.get(spn).map(|port| &**port)
    }

    pub fn contains(&self, spn: &ServicePortName) -> bool {
        self.services.contains_key(spn)
    }

    /// How many Service ports there are.
    pub fn port_count(&self) -> usize {
        self.services.len()
    }

    /// Adds (or replaces) a Service port; its endpoints are kept.
    pub fn insert_port(&mut self, spn: ServicePortName, port: ServicePort) {
        self.services.insert(spn, Arc::new(port));
    }

    /// Removes a Service port and its endpoints.
    pub fn remove_port(&mut self, spn: &ServicePortName) {
        self.services.remove(spn);
        self.endpoints.remove(spn);
    }

    /// Keeps the Service ports `keep` says yes to (and their endpoints).
    pub fn retain_ports(&mut self, mut keep: impl FnMut(&ServicePortName) -> bool) {
        self.services.retain(|spn, _| keep(spn));
        let services = &self.services;
        self.endpoints.retain(|spn, _| services.contains_key(spn));
    }

    /// A copy holding only the Service ports `keep` says yes to, with their endpoints (the
    /// ports are shared, not copied).
    pub fn only(&self, keep: impl Fn(&ServicePortName) -> bool) -> Self {
        Self {
            services: (self.services.iter())
                .filter(|(spn, _)| keep(spn))
                .map(|(spn, port)| (spn.clone(), Arc::clone(port)))
                .collect(),
            endpoints: (self.endpoints.iter())
                .filter(|(spn, _)| keep(spn))
                .map(|(spn, eps)| (spn.clone(), Arc::clone(eps)))
                .collect(),
            node_name: self.node_name.clone(),
            node_zone: self.node_zone.clone(),
            service_cidrs: self.service_cidrs.clone(),
        }
    }

    /// A Service port to change in place (copied first if the tracker shares it).
    pub fn port_mut(&mut self, spn: &ServicePortName) -> Option<&mut ServicePort> {
        self.services.get_mut(spn).map(Arc::make_mut)
    }

    /// Sets the endpoints of `spn` (none: it has no entry).
    pub fn set_endpoints(&mut self, spn: ServicePortName, endpoints: Vec<Endpoint>) {
        if endpoints.is_empty() {
            self.endpoints.remove(&spn);
        } else {
            self.endpoints.insert(spn, endpoints.into());
        }
    }

    /// Changes the endpoints of `spn` with `edit` (none left: it has no entry).
    pub fn edit_endpoints(&mut self, spn: &ServicePortName, edit: impl FnOnce(&mut Vec<Endpoint>)) {
        let mut endpoints = self.endpoints_of(spn).to_vec();
        edit(&mut endpoints);
        self.set_endpoints(spn.clone(), endpoints);
    }

    /// All endpoints of `spn`, ready or not (empty when it has none).
    pub fn endpoints_of(&self, spn: &ServicePortName) -> &[Endpoint] {
        self.endpoints.get(spn).map_or(&[], |eps| eps)
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
    /// ready ones (those topology hints give this node, if they do) or, when none is ready,
    /// the serving ones that are terminating (KEP-1669, so that a rollout's last pods keep
    /// answering); with internalTrafficPolicy: Local, only this node's.
    pub fn cluster_endpoints(&self, spn: &ServicePortName) -> Vec<&Endpoint> {
        let local_only = self.port(spn).is_some_and(|sp| sp.internal_traffic_local);
        self.usable_endpoints(spn, local_only)
    }

    /// The endpoints that new connections from outside the node (to a NodePort, LoadBalancer
    /// or external IP) go to: as [`Self::cluster_endpoints`], following the external traffic
    /// policy instead of the internal one.
    pub fn external_endpoints(&self, spn: &ServicePortName) -> Vec<&Endpoint> {
        let local_only = self.port(spn).is_some_and(|sp| sp.external_traffic_local);
        self.usable_endpoints(spn, local_only)
    }

    /// Whether `spn` has a Local internal (first) and external (second) traffic policy whose
    /// traffic has nowhere to go: no usable endpoint on this node (kube-proxy's
    /// `kubeproxy_sync_proxy_rules_no_local_endpoints_total`).
    pub fn lacks_local_endpoints(&self, spn: &ServicePortName) -> [bool; 2] {
        let Some(sp) = self.port(spn) else {
            return [false; 2];
        };
        [
            sp.internal_traffic_local && self.cluster_endpoints(spn).is_empty(),
            sp.external_traffic_local && self.external_endpoints(spn).is_empty(),
        ]
    }

    /// Whether `ep` runs on this node.
    pub fn is_local(&self, ep: &Endpoint) -> bool {
        ep.node_name() == Some(self.node_name.as_str())
    }

    /// The ready endpoints of `spn` (only this node's if `local_only`, else those topology
    /// hints give this node), else the serving terminating ones.
    pub fn usable_endpoints(&self, spn: &ServicePortName, local_only: bool) -> Vec<&Endpoint> {
        let candidates: Vec<&Endpoint> = self
            .endpoints_of(spn)
            .iter()
            .filter(|ep| !local_only || self.is_local(ep))
            .collect();
        if candidates.iter().any(|ep| ep.ready) {
            let ready = candidates.into_iter().filter(|ep| ep.ready).collect();
            match local_only {
                true => ready,
                false => self.by_topology(ready),
            }
        } else {
            candidates
                .into_iter()
                .filter(|ep| ep.serving && ep.terminating)
                .collect()
        }
    }

    /// kube-proxy's topology-aware routing of the ready endpoints `ready`: when every one has
    /// node hints and some are for this node, those; else when every one has zone hints and
    /// some are for this node's zone, those; else all (hints that would leave this node
    /// nothing, or that only some endpoints carry, are ignored, as kube-proxy ignores them).
    fn by_topology<'a>(&self, ready: Vec<&'a Endpoint>) -> Vec<&'a Endpoint> {
        let hinted =
            |of: fn(&Hints) -> &[Arc<str>], want: Option<&str>| -> Option<Vec<&'a Endpoint>> {
                let want = want?;
                let all_hinted = ready
                    .iter()
                    .all(|ep| ep.hints().is_some_and(|h| !of(h).is_empty()));
                let chosen: Vec<&'a Endpoint> = ready
                    .iter()
                    .copied()
                    .filter(|ep| {
                        ep.hints()
                            .is_some_and(|h| of(h).iter().any(|n| &**n == want))
                    })
                    .collect();
                (all_hinted && !chosen.is_empty()).then_some(chosen)
            };
        hinted(|h| &h.nodes, Some(&self.node_name))
            .or_else(|| hinted(|h| &h.zones, self.node_zone.as_deref()))
            .unwrap_or(ready)
    }
}
