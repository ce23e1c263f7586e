//! The desired state: every Service port and its endpoints, and which endpoints a frontend
//! sends to.
use std::{collections::BTreeMap, sync::Arc};

use super::{Endpoint, ServicePort, ServicePortName};

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
