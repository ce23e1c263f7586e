//! Writing the desired state into the services and backends maps.
//!
//! Write order keeps every intermediate state valid for packets in flight (after Cilium):
//! new backends, then the service's backend slots, then slot 0 with the new count, then surplus
//! slots are deleted, then backends nobody uses any more. Removing a service deletes slot 0
//! first.
use std::{
    collections::{BTreeSet, HashMap, HashSet},
    net::IpAddr,
};

use anyhow::{Context, anyhow, bail};
use aya::{
    Ebpf,
    maps::{HashMap as BpfHashMap, IterableMap, MapData},
};
use proxy_common::{Backend, Be16, Be32, MAP_BACKENDS, MAP_SERVICES, ServiceKey, ServiceValue};

use crate::{
    dataplane::Scope,
    model::{DesiredState, ServicePortName},
};

/// A service address as the datapath matches it: slot 0 of the services map.
pub type Frontend = ServiceKey;

pub struct ServiceMaps {
    services: BpfHashMap<MapData, ServiceKey, ServiceValue>,
    backends: BpfHashMap<MapData, u32, Backend>,
    services_max: usize,
    backends_max: usize,
    /// What the services map holds: each frontend's backend ids, in slot order.
    frontends: HashMap<Frontend, Vec<u32>>,
    /// Which frontends each service port put there.
    owners: HashMap<ServicePortName, Vec<Frontend>>,
    /// Entries of the services map, counted (slot 0 and backend slots).
    used_slots: usize,
    /// Backend ids, and by id the backend with the number of slots referring to it. Ids come
    /// from a counter, not reused soon, so a conntrack entry for a removed backend never finds
    /// a different one.
    ids: HashMap<Backend, u32>,
    by_id: HashMap<u32, (Backend, usize)>,
    next_id: u32,
}

impl ServiceMaps {
    /// Takes the maps out of the loaded object and recovers what an earlier agent left in them
    /// (ids stay stable across restarts, so established flows keep their backend).
    pub fn take_from(ebpf: &mut Ebpf) -> anyhow::Result<Self> {
        let services: BpfHashMap<_, ServiceKey, ServiceValue> = ebpf
            .take_map(MAP_SERVICES)
            .context("services map missing")?
            .try_into()?;
        let backends: BpfHashMap<_, u32, Backend> = ebpf
            .take_map(MAP_BACKENDS)
            .context("backends map missing")?
            .try_into()?;
        Self::recover(services, backends)
    }

    pub fn recover(
        services: BpfHashMap<MapData, ServiceKey, ServiceValue>,
        backends: BpfHashMap<MapData, u32, Backend>,
    ) -> anyhow::Result<Self> {
        let services_max = services.map().info()?.max_entries() as usize;
        let backends_max = backends.map().info()?.max_entries() as usize;
        let mut by_id: HashMap<u32, (Backend, usize)> = HashMap::new();
        for entry in backends.iter() {
            let (id, backend) = entry?;
            by_id.insert(id, (backend, 0));
        }
        let ids = by_id.iter().map(|(id, (b, _))| (*b, *id)).collect();
        let mut frontends = HashMap::new();
        let mut used_slots = 0;
        for key in services.keys() {
            let key = key?;
            if key.slot != 0 {
                continue;
            }
            let count = services.get(&key, 0)?.count;
            let mut slots = Vec::with_capacity(count as usize);
            for slot in 1..=count {
                let id = services.get(&ServiceKey { slot, ..key }, 0)?.backend_id;
                if let Some((_, refs)) = by_id.get_mut(&id) {
                    *refs += 1;
                }
                slots.push(id);
            }
            used_slots += slots.len() + 1;
            frontends.insert(key, slots);
        }
        let next_id = by_id.keys().max().map_or(1, |m| m.wrapping_add(1).max(1));
        if !frontends.is_empty() {
            tracing::info!(
                frontends = frontends.len(),
                backends = by_id.len(),
                "recovered services from the pinned maps"
            );
        }
        Ok(Self {
            services,
            backends,
            services_max,
            backends_max,
            frontends,
            owners: HashMap::new(),
            used_slots,
            ids,
            by_id,
            next_id,
        })
    }

    pub fn sync(&mut self, state: &DesiredState, scope: Scope<'_>) -> anyhow::Result<()> {
        let ports: Vec<ServicePortName> = match scope {
            Scope::All => {
                // Sorted, so that a given state always gets the same ids.
                let mut all: BTreeSet<&ServicePortName> = state.services.keys().collect();
                all.extend(self.owners.keys());
                all.into_iter().cloned().collect()
            }
            Scope::Changed(changed) => changed.iter().cloned().collect(),
        };
        let mut failures = Vec::new();
        for spn in &ports {
            if let Err(e) = self.sync_port(state, spn) {
                failures.push(format!("{spn}: {e:#}"));
            }
        }
        if matches!(scope, Scope::All) {
            // Frontends recovered from the pinned maps that no service claims any more.
            let owned: HashSet<Frontend> = self.owners.values().flatten().copied().collect();
            let stale: Vec<Frontend> = self
                .frontends
                .keys()
                .filter(|f| !owned.contains(f))
                .copied()
                .collect();
            for fe in stale {
                if let Err(e) = self.remove_frontend(&fe) {
                    failures.push(format!("stale frontend {}: {e:#}", describe(&fe)));
                }
            }
            // Recovered backends no slot refers to.
            let unused: Vec<u32> = self
                .by_id
                .iter()
                .filter(|(_, (_, refs))| *refs == 0)
                .map(|(id, _)| *id)
                .collect();
            for id in unused {
                self.by_id.get_mut(&id).expect("listed above").1 = 1;
                if let Err(e) = self.release(id) {
                    failures.push(format!("unused backend {id}: {e:#}"));
                }
            }
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(anyhow!(
                "{} of {} service ports not programmed: {}",
                failures.len(),
                ports.len(),
                failures.join("; ")
            ))
        }
    }

    fn sync_port(&mut self, state: &DesiredState, spn: &ServicePortName) -> anyhow::Result<()> {
        let desired = desired_frontends(state, spn);
        let old = self.owners.remove(spn).unwrap_or_default();
        let mut result = Ok(());
        let mut programmed = Vec::with_capacity(desired.len());
        for (fe, backends) in &desired {
            match self.program(fe, backends) {
                Ok(()) => programmed.push(*fe),
                Err(e) => result = Err(e),
            }
        }
        for fe in old
            .iter()
            .filter(|fe| !desired.iter().any(|(d, _)| d == *fe))
        {
            if let Err(e) = self.remove_frontend(fe) {
                result = Err(e);
            }
        }
        // A frontend that failed keeps whatever it had before, so it stays owned.
        for fe in old {
            if self.frontends.contains_key(&fe) && !programmed.contains(&fe) {
                programmed.push(fe);
            }
        }
        if !programmed.is_empty() {
            self.owners.insert(spn.clone(), programmed);
        }
        result
    }

    /// Makes `fe` send to `backends`, in that slot order.
    fn program(&mut self, fe: &Frontend, backends: &[Backend]) -> anyhow::Result<()> {
        let old: Vec<u32> = self.frontends.get(fe).cloned().unwrap_or_default();
        // Refuse before writing anything if the maps cannot hold the result.
        let had = if self.frontends.contains_key(fe) {
            old.len() + 1
        } else {
            0
        };
        let new_slots = (backends.len() + 1).saturating_sub(had);
        if self.used_slots + new_slots > self.services_max {
            bail!(
                "services map full ({} of {} entries used, {} more needed): raise --bpf-services-max",
                self.used_slots,
                self.services_max,
                new_slots
            );
        }
        let new_backends = backends
            .iter()
            .filter(|b| !self.ids.contains_key(b))
            .count();
        if self.ids.len() + new_backends > self.backends_max {
            bail!(
                "backends map full ({} of {} entries used, {} more needed): raise --bpf-backends-max",
                self.ids.len(),
                self.backends_max,
                new_backends
            );
        }
        let mut ids = Vec::with_capacity(backends.len());
        for b in backends {
            ids.push(self.acquire(b)?);
        }
        for (i, id) in ids.iter().enumerate() {
            if old.get(i) != Some(id) {
                let key = ServiceKey {
                    slot: i as u16 + 1,
                    ..*fe
                };
                self.services
                    .insert(
                        key,
                        ServiceValue {
                            backend_id: *id,
                            count: 0,
                            flags: 0,
                        },
                        0,
                    )
                    .with_context(|| format!("writing slot {} of {}", i + 1, describe(fe)))?;
            }
        }
        if old.len() != ids.len() || !self.frontends.contains_key(fe) {
            let head = ServiceValue {
                backend_id: 0,
                count: ids.len() as u16,
                flags: 0,
            };
            self.services
                .insert(fe, head, 0)
                .with_context(|| format!("writing {}", describe(fe)))?;
        }
        for slot in ids.len() + 1..=old.len() {
            self.remove_slot(&ServiceKey {
                slot: slot as u16,
                ..*fe
            })?;
        }
        self.used_slots = self.used_slots + ids.len() + 1 - had;
        self.frontends.insert(*fe, ids);
        for id in old {
            self.release(id)?;
        }
        Ok(())
    }

    fn remove_frontend(&mut self, fe: &Frontend) -> anyhow::Result<()> {
        let Some(ids) = self.frontends.get(fe).cloned() else {
            return Ok(());
        };
        self.remove_slot(fe)?;
        for slot in 1..=ids.len() {
            self.remove_slot(&ServiceKey {
                slot: slot as u16,
                ..*fe
            })?;
        }
        self.frontends.remove(fe);
        self.used_slots -= ids.len() + 1;
        for id in ids {
            self.release(id)?;
        }
        Ok(())
    }

    fn remove_slot(&mut self, key: &ServiceKey) -> anyhow::Result<()> {
        match self.services.remove(key) {
            Ok(()) => Ok(()),
            Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(e) => {
                Err(e).with_context(|| format!("deleting slot {} of {}", key.slot, describe(key)))
            }
        }
    }

    /// The id of `b`, written to the backends map if new; counts one more slot using it.
    fn acquire(&mut self, b: &Backend) -> anyhow::Result<u32> {
        if let Some(id) = self.ids.get(b) {
            self.by_id.get_mut(id).expect("ids and by_id agree").1 += 1;
            return Ok(*id);
        }
        let mut id = self.next_id;
        while id == 0 || self.by_id.contains_key(&id) {
            id = id.wrapping_add(1);
        }
        self.backends
            .insert(id, b, 0)
            .with_context(|| format!("writing backend {id}"))?;
        self.next_id = id.wrapping_add(1);
        self.ids.insert(*b, id);
        self.by_id.insert(id, (*b, 1));
        Ok(id)
    }

    /// One slot fewer uses `id`; the backend is deleted when none does.
    fn release(&mut self, id: u32) -> anyhow::Result<()> {
        let Some((backend, refs)) = self.by_id.get_mut(&id) else {
            return Ok(());
        };
        *refs = refs.saturating_sub(1);
        if *refs > 0 {
            return Ok(());
        }
        let backend = *backend;
        self.ids.remove(&backend);
        self.by_id.remove(&id);
        match self.backends.remove(&id) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(e).with_context(|| format!("deleting backend {id}")),
        }
    }
}

/// The frontends a service port should have, each with its backends. IPv4 only for now:
/// IPv6 addresses are kept in the model and skipped here.
pub fn desired_frontends(
    state: &DesiredState,
    spn: &ServicePortName,
) -> Vec<(Frontend, Vec<Backend>)> {
    let Some(sp) = state.services.get(spn) else {
        return Vec::new();
    };
    let proto = sp.protocol.number();
    let backends: Vec<Backend> = state
        .ready_endpoints(spn)
        .filter_map(|ep| match ep.ip {
            IpAddr::V4(ip) => Some(Backend {
                addr: Be32::from_octets(ip.octets()),
                port: Be16::new(ep.port),
                proto,
                flags: 0,
            }),
            IpAddr::V6(_) => None,
        })
        .collect();
    sp.cluster_ips
        .iter()
        .filter_map(|ip| match ip {
            IpAddr::V4(ip) => Some((
                ServiceKey::new(Be32::from_octets(ip.octets()), Be16::new(sp.port), proto, 0),
                backends.clone(),
            )),
            IpAddr::V6(_) => None,
        })
        .collect()
}

fn describe(key: &ServiceKey) -> String {
    let [a, b, c, d] = key.addr.octets();
    format!(
        "{a}.{b}.{c}.{d}:{}/{}",
        key.port.get(),
        crate::inspect::proto_name(key.proto)
    )
}
