//! The change tracker: Services and EndpointSlices in, the desired state and the changed
//! Service ports out.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
    time::SystemTime,
};

// Keyed by object names, looked up several times an object: SipHash was a tenth of a large
// manifest's load. (Seeded at random a process, as std's.)
use foldhash::{HashMap, HashSet};

use crate::{dense_map::DenseMap, kubernetes::NodeInfo, one_or_many::OneOrMany};

use super::{Cidr, DesiredState, Endpoint, NamespacedName, Protocol, ServicePort, ServicePortName};

/// An endpoint left out of an EndpointSlice whose other endpoints are used, as kube-proxy skips
/// single endpoints it cannot program.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("EndpointSlice {slice}: {reason}; this endpoint is skipped")]
pub struct SkippedEndpoint {
    pub slice: NamespacedName,
    pub reason: String,
}

/// The ports of one service, as parsed from the Service object, sorted by name. A list rather
/// than a map: most services have one or two ports, and a map's node would take about 2 KiB
/// each. Each port is shared with the desired state.
pub(crate) type ServicePorts = OneOrMany<(ServicePortName, Arc<ServicePort>)>;

/// What the tracker keeps of one EndpointSlice: only the fields that reach the desired state, so
/// that comparing two versions says whether anything programmable changed. Cloning is cheap
/// (reference counts).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SliceInfo {
    /// The name of the Service it belongs to, in the slice's own namespace. The tracker's copy
    /// is the tracker's own copy of the Service's name when it has one: one string for both.
    pub(crate) service_name: Arc<str>,
    /// Nearly every slice has one port, held in place.
    pub(crate) ports: OneOrMany<SlicePort>,
}

impl SliceInfo {
    /// The Service that the slice named `slice` belongs to.
    fn service(&self, slice: &NamespacedName) -> NamespacedName {
        NamespacedName::new(Arc::clone(&slice.namespace), Arc::clone(&self.service_name))
    }
}

/// A port of an EndpointSlice, with the slice's endpoints as that port's: each with the port's
/// number, sorted and de-duplicated as the desired state holds a Service port's endpoints, so
/// that the state can share them (a Service port's endpoints almost always come from one slice).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SlicePort {
    pub(crate) name: Arc<str>,
    pub(crate) protocol: Protocol,
    pub(crate) endpoints: Arc<[Endpoint]>,
}

impl SlicePort {
    /// The port `name`/`protocol` numbered `port` of a slice of `endpoints` (whose own port is
    /// not read).
    pub(crate) fn new(
        name: Arc<str>,
        protocol: Protocol,
        port: u16,
        endpoints: &[Endpoint],
    ) -> Self {
        let mut endpoints: Vec<Endpoint> = endpoints
            .iter()
            .map(|ep| Endpoint { port, ..ep.clone() })
            .collect();
        dedup_endpoints(&mut endpoints);
        Self {
            name,
            protocol,
            endpoints: endpoints.into(),
        }
    }
}

/// A Service reduced to what the tracker records of it: what a source computes from the object
/// (without holding the tracker) and may keep to compare with the next version.
#[derive(Clone, Debug, PartialEq)]
pub struct ReducedService {
    pub key: NamespacedName,
    /// None: not proxied (`skip_reason` says why); the tracker treats it as deleted.
    pub(crate) ports: Option<ServicePorts>,
    /// Why it is not proxied (see [`crate::kubernetes::service_skip_reason`]).
    pub skip_reason: Option<&'static str>,
}

/// An EndpointSlice reduced to what the tracker records of it; see [`ReducedService`].
#[derive(Clone, Debug, PartialEq)]
pub struct ReducedSlice {
    pub key: NamespacedName,
    /// None: not proxied (headless, another proxy's, FQDN); the tracker treats it as deleted.
    pub(crate) info: Option<SliceInfo>,
    /// The endpoints left out of it.
    pub(crate) skipped: Vec<SkippedEndpoint>,
    /// [`crate::kubernetes::LAST_CHANGE_TRIGGER_TIME`], when the slice has a valid one.
    pub(crate) trigger_time: Option<SystemTime>,
}

/// Everything one service's desired state is computed from. Cloning is cheap (reference counts).
#[derive(Debug, PartialEq)]
struct Inputs {
    service: Option<ServicePorts>,
    slices: Vec<(NamespacedName, SliceInfo)>,
}

/// What the tracker holds under a service's name.
#[derive(Debug, Default)]
struct ServiceEntry {
    /// None: not proxied (headless, ExternalName...), or not known (yet).
    ports: Option<ServicePorts>,
    /// Its slices (by their own namespace/name), sorted: slices may arrive before their
    /// service, so an entry can have slices and no ports. Nearly every service has one.
    slices: OneOrMany<NamespacedName>,
}

/// Tracks Services and EndpointSlices and the services changed since the last [`apply`].
///
/// [`apply`]: ChangeTracker::apply
#[derive(Debug, Default)]
pub struct ChangeTracker {
    /// Services by name: the ports of the proxied ones, and the slices of each. One table for
    /// both, as kube-proxy nests its slice cache under the Service: a service and its slices
    /// are looked up together, and a table's spare room costs per entry.
    services: DenseMap<NamespacedName, ServiceEntry>,
    /// Keyed by the slice's own namespace/name.
    slices: DenseMap<NamespacedName, SliceInfo>,
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
    /// The Node objects known, by name: their `topology.kubernetes.io/zone` label.
    node_zones: HashMap<Arc<str>, Option<Arc<str>>>,
    /// Their addresses (see [`NodeInfo::addresses`]).
    node_addresses: HashMap<Arc<str>, Vec<IpAddr>>,
    /// A Node changed since the last [`ChangeTracker::apply`].
    nodes_changed: bool,
    /// The ServiceCIDR objects' ranges, by name.
    service_cidrs: HashMap<Arc<str>, Vec<Cidr>>,
    /// A ServiceCIDR changed since the last [`ChangeTracker::apply`].
    service_cidrs_changed: bool,
    /// Service and EndpointSlice events received (see [`ChangeTracker::change_counts`]).
    service_changes: ChangeCount,
    slice_changes: ChangeCount,
}

/// Events of one kind received: in all, and the objects changed since the last
/// [`ChangeTracker::apply`].
#[derive(Debug, Default)]
struct ChangeCount {
    total: u64,
    pending: HashSet<NamespacedName>,
}

impl ChangeCount {
    fn record(&mut self, key: &NamespacedName) {
        self.total += 1;
        if !self.pending.contains(key) {
            self.pending.insert(key.clone());
        }
    }
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

    /// Whether the tracker holds this version of the Service already (one not proxied: when it
    /// holds none), so that a source reading it again need not keep its own copy to know.
    pub fn holds_service(&self, update: &ReducedService) -> bool {
        self.ports_of(&update.key) == update.ports.as_ref()
    }

    /// Whether the tracker holds this version of the EndpointSlice already (see
    /// [`ChangeTracker::holds_service`]), its skipped endpoints included.
    pub fn holds_slice(&self, update: &ReducedSlice) -> bool {
        let skipped = self.skipped.get(&update.key).map_or(&[][..], Vec::as_slice);
        self.slices.get(&update.key) == update.info.as_ref() && skipped == update.skipped
    }

    /// Whether the tracker holds this version of the Node already.
    pub fn holds_node(&self, name: &str, info: &NodeInfo) -> bool {
        let zone = info.zone.as_deref().filter(|z| !z.is_empty());
        self.node_zones
            .get(name)
            .is_some_and(|z| z.as_deref() == zone)
            && self.node_addresses.get(name) == Some(&info.addresses)
    }

    /// Whether the tracker holds these ranges of the ServiceCIDR `name` already.
    pub fn holds_service_cidr(&self, name: &str, cidrs: &[Cidr]) -> bool {
        self.service_cidrs.get(name).is_some_and(|c| c == cidrs)
    }

    /// Records the latest version of a Service. One that is not proxied counts as deleted.
    pub fn upsert_service(&mut self, update: &ReducedService) {
        let key = &update.key;
        self.service_changes.record(key);
        self.change(key, |t| t.set_ports(key, update.ports.clone()));
    }

    pub fn delete_service(&mut self, key: &NamespacedName) {
        self.service_changes.record(key);
        if self.ports_of(key).is_some() {
            self.change(key, |t| t.set_ports(key, None));
        }
    }

    /// The ports of the proxied service `key`.
    fn ports_of(&self, key: &NamespacedName) -> Option<&ServicePorts> {
        self.services.get(key)?.ports.as_ref()
    }

    fn set_ports(&mut self, key: &NamespacedName, ports: Option<ServicePorts>) {
        match ports {
            Some(ports) => {
                self.services
                    .get_or_insert_with(key.clone(), Default::default)
                    .ports = Some(ports)
            }
            None => self.edit_entry(key, |entry| entry.ports = None),
        }
    }

    /// Runs `edit` on the entry of `service`, if it has one, and drops the entry if that
    /// leaves it empty.
    fn edit_entry(&mut self, service: &NamespacedName, edit: impl FnOnce(&mut ServiceEntry)) {
        if let Some(entry) = self.services.get_mut(service) {
            edit(entry);
            if entry.ports.is_none() && entry.slices.is_empty() {
                self.services.remove(service);
            }
        }
    }

    /// Records the latest version of an EndpointSlice. One that is not proxied (of a headless
    /// service, another proxy's, FQDN) counts as deleted. Of the endpoints left out of it, those
    /// not already reported for this slice are returned, to be logged.
    pub fn upsert_slice(&mut self, update: &ReducedSlice) -> Vec<SkippedEndpoint> {
        let key = &update.key;
        // One not proxied is not counted (kube-proxy's informers never see it), unless it
        // was proxied before: then it is gone.
        let Some(info) = &update.info else {
            self.delete_slice(key);
            return Vec::new();
        };
        self.slice_changes.record(key);
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
        let owner = &info.service(key);
        let old_owner = self
            .slices
            .get(key)
            .map(|old| old.service(key))
            .filter(|old| old != owner);
        // A relabelled slice leaves its old service: both services change.
        if let Some(old_owner) = &old_owner {
            self.change(old_owner, |t| t.unlink_slice(old_owner, key));
        }
        self.change(owner, |t| {
            let (service, entry) = t
                .services
                .entry_or_insert_with(owner.clone(), Default::default);
            entry.slices.insert_sorted(key);
            let info = SliceInfo {
                service_name: Arc::clone(&service.name),
                ports: info.ports.clone(),
            };
            t.slices.insert(key.clone(), info);
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
        let Some(owner) = self.slices.get(key).map(|s| s.service(key)) else {
            return;
        };
        self.slice_changes.record(key);
        self.change(&owner, |t| {
            t.unlink_slice(&owner, key);
            t.slices.remove(key);
        });
    }

    /// kube-proxy's change counts: the Service events received and the Services changed
    /// since the last [`ChangeTracker::apply`], then the same for EndpointSlices.
    pub fn change_counts(&self) -> [(u64, usize); 2] {
        [&self.service_changes, &self.slice_changes].map(|c| (c.total, c.pending.len()))
    }

    /// The Services the tracker holds (proxied ones, at their last valid version).
    pub fn service_keys(&self) -> Vec<NamespacedName> {
        (self.services.iter())
            .filter(|(_, entry)| entry.ports.is_some())
            .map(|(key, _)| key.clone())
            .collect()
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
        !self.pending.is_empty() || self.nodes_changed || self.service_cidrs_changed
    }

    /// Records a Node's zone (its `topology.kubernetes.io/zone` label: this node's decides
    /// which endpoints topology hints give it) and addresses.
    pub fn upsert_node(&mut self, name: &str, info: &NodeInfo) {
        let zone = info
            .zone
            .as_deref()
            .filter(|z| !z.is_empty())
            .map(Arc::from);
        if self.node_zones.get(name) != Some(&zone) {
            self.node_zones.insert(name.into(), zone);
            self.nodes_changed = true;
        }
        if self.node_addresses.get(name) != Some(&info.addresses) {
            self.node_addresses
                .insert(name.into(), info.addresses.clone());
            // Nothing to program, but the sync after it tells the agent (see agent.rs).
            self.nodes_changed = true;
        }
    }

    pub fn delete_node(&mut self, name: &str) {
        self.nodes_changed |= self.node_zones.remove(name).is_some();
        self.node_addresses.remove(name);
    }

    /// Records the ranges of the ServiceCIDR object `name`.
    pub fn upsert_service_cidr(&mut self, name: &str, cidrs: Vec<Cidr>) {
        if self.service_cidrs.get(name) != Some(&cidrs) {
            self.service_cidrs.insert(name.into(), cidrs);
            self.service_cidrs_changed = true;
        }
    }

    pub fn delete_service_cidr(&mut self, name: &str) {
        self.service_cidrs_changed |= self.service_cidrs.remove(name).is_some();
    }

    /// The names of the ServiceCIDR objects known.
    pub fn service_cidr_keys(&self) -> Vec<NamespacedName> {
        self.service_cidrs
            .keys()
            .map(|name| NamespacedName::new("", Arc::clone(name)))
            .collect()
    }

    /// The addresses of the Node called `name`, when it is known.
    pub fn node_addresses(&self, name: &str) -> Option<&[IpAddr]> {
        self.node_addresses.get(name).map(Vec::as_slice)
    }

    /// The names of the Nodes known.
    pub fn node_keys(&self) -> Vec<NamespacedName> {
        self.node_zones
            .keys()
            .map(|name| NamespacedName::new("", Arc::clone(name)))
            .collect()
    }

    /// Gives `state` its node's zone; when it changed, every Service port's endpoints may
    /// have (topology hints): their names join `changed`.
    fn apply_node_zone(
        &mut self,
        state: &mut DesiredState,
        changed: &mut BTreeSet<ServicePortName>,
    ) {
        if !std::mem::take(&mut self.nodes_changed) {
            return;
        }
        let zone = self.node_zones.get(state.node_name()).cloned().flatten();
        if state.node_zone != zone {
            state.node_zone = zone;
            changed.extend(state.services.keys().cloned());
        }
    }

    /// The trigger times ([`crate::kubernetes::LAST_CHANGE_TRIGGER_TIME`]) of the slice changes that the last
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
        self.service_changes.pending = HashSet::default();
        self.slice_changes.pending = HashSet::default();
        let mut changed = if state.services.is_empty() && state.endpoints.is_empty() {
            // After a first load the tables hardly grow: their growth room goes.
            self.services.shrink_to_fit();
            self.slices.shrink_to_fit();
            self.apply_fresh(pending.into_keys(), state)
        } else {
            let mut changed = BTreeSet::new();
            for service in pending.into_keys() {
                let (ports, endpoints) = self.render(&service);
                // `state` holds what was applied last: diffing against it (rather than against
                // the saved inputs) keeps `state` exact whatever it held before.
                sync_range(&mut state.services, &service, ports, &mut changed);
                sync_range(&mut state.endpoints, &service, endpoints, &mut changed);
            }
            changed
        };
        self.apply_node_zone(state, &mut changed);
        if std::mem::take(&mut self.service_cidrs_changed) {
            let mut cidrs: Vec<Cidr> = self.service_cidrs.values().flatten().copied().collect();
            cidrs.sort();
            cidrs.dedup();
            state.service_cidrs = cidrs;
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
            let applied = self.pending.remove(service).expect("just read");
            // Equal, but the applied versions are what the desired state shares: kept.
            if let Some(ports) = applied.service {
                self.set_ports(service, Some(ports));
            }
            self.slices.extend(applied.slices);
            self.trigger_times.remove(service);
        }
    }

    fn unlink_slice(&mut self, owner: &NamespacedName, slice: &NamespacedName) {
        self.edit_entry(owner, |entry| {
            entry.slices.remove_sorted(slice);
        });
    }

    /// How many services and slices the tracker holds anything of.
    #[cfg(test)]
    pub(super) fn entries(&self) -> usize {
        self.services.len() + self.slices.len()
    }

    /// Entries its tables have room for beyond those they hold.
    #[cfg(test)]
    pub(super) fn spare_room(&self) -> usize {
        self.services.spare_room() + self.slices.spare_room()
    }

    /// What the tracker records of the slice `slice`.
    #[cfg(test)]
    pub(super) fn slice_record(&self, slice: &NamespacedName) -> Option<&SliceInfo> {
        self.slices.get(slice)
    }

    /// The names of `service`'s slices.
    fn slices_of(&self, service: &NamespacedName) -> &[NamespacedName] {
        self.services
            .get(service)
            .map_or(&[], |entry| &entry.slices)
    }

    fn inputs(&self, service: &NamespacedName) -> Inputs {
        Inputs {
            service: self.ports_of(service).cloned(),
            slices: (self.slices_of(service).iter())
                .map(|name| (name.clone(), self.slices[name].clone()))
                .collect(),
        }
    }

    /// The desired state of one service: its ports, and for each port the endpoints of every
    /// slice port with the same name and protocol (this is how named target ports resolve: the
    /// slice carries the number each endpoint uses). Both sorted by port name.
    fn render(&self, service: &NamespacedName) -> Rendered {
        let Some(ports) = self.ports_of(service) else {
            return Default::default();
        };
        // Index i holds the endpoints of ports[i], by slice port.
        let mut parts: Vec<Vec<&Arc<[Endpoint]>>> = vec![Vec::new(); ports.len()];
        for slice_name in self.slices_of(service) {
            let slice = &self.slices[slice_name];
            for slice_port in slice.ports.iter() {
                let Some(i) = ports.iter().position(|(spn, _)| {
                    spn.port == slice_port.name && spn.protocol == slice_port.protocol
                }) else {
                    continue;
                };
                parts[i].push(&slice_port.endpoints);
            }
        }
        let endpoints = ports
            .iter()
            .zip(parts)
            .filter_map(|((spn, _), parts)| {
                let endpoints = match parts[..] {
                    // Shared with the slice: no copy.
                    [one] => Arc::clone(one),
                    _ => {
                        let mut eps: Vec<Endpoint> =
                            parts.iter().flat_map(|p| p.iter()).cloned().collect();
                        dedup_endpoints(&mut eps);
                        eps.into()
                    }
                };
                (!endpoints.is_empty()).then(|| (spn.clone(), endpoints))
            })
            .collect();
        (ports.to_vec(), endpoints)
    }
}

/// One service's ports and the endpoints of each port that has some, both sorted by name.
type Rendered = (
    Vec<(ServicePortName, Arc<ServicePort>)>,
    Vec<(ServicePortName, Arc<[Endpoint]>)>,
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
            changed.insert(spn.clone());
        }
        // Even when equal: the state then shares what the tracker holds now, not a copy it let go.
        map.insert(spn, value);
    }
}
