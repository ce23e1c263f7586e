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

use anyhow::{Context, anyhow};
use aya::{
    Ebpf,
    maps::{Array, HashMap as BpfHashMap, IterableMap, MapData},
};
use proxy_common::{
    AGENT_STATE_NEXT_BACKEND_ID, Backend, Be16, Be32, MAP_AGENT_STATE, MAP_BACKENDS, MAP_SERVICES,
    ServiceKey, ServiceValue,
};

use crate::{
    dataplane::{NotProgrammable, Scope},
    model::{DesiredState, Protocol, ServicePortName},
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
    /// The port that last programmed each frontend: when a Service's address passes to another
    /// (a rename keeping the cluster IP), the old one's removal must not take it away.
    claims: HashMap<Frontend, ServicePortName>,
    /// Entries of the services map, counted (slot 0 and backend slots).
    used_slots: usize,
    /// Backend ids, and by id the backend with the number of slots referring to it. Ids come
    /// from a counter, not reused soon, so a conntrack entry for a removed backend never finds
    /// a different one.
    ids: HashMap<Backend, u32>,
    by_id: HashMap<u32, (Backend, usize)>,
    next_id: u32,
    /// Ids below this may have been handed out (so a restarted agent starts above it). Kept in
    /// `agent_state` and raised a block at a time before an id past it is used, so even an agent
    /// that dies mid-sync never lets its successor reuse one.
    reserved_until: u32,
    agent_state: Array<MapData, u64>,
}

/// Ids reserved in `agent_state` at a time: one map write per this many new backends.
const ID_BLOCK: u32 = 1024;

impl ServiceMaps {
    /// Takes the maps out of the loaded object and recovers what an earlier agent left in them
    /// (ids stay stable across restarts, so established flows keep their backend).
    pub fn take_from(ebpf: &mut Ebpf) -> anyhow::Result<Self> {
        let mut take = |name: &str| {
            ebpf.take_map(name)
                .with_context(|| format!("map {name} missing"))
        };
        let services: BpfHashMap<_, ServiceKey, ServiceValue> = take(MAP_SERVICES)?.try_into()?;
        let backends: BpfHashMap<_, u32, Backend> = take(MAP_BACKENDS)?.try_into()?;
        let agent_state: Array<_, u64> = take(MAP_AGENT_STATE)?.try_into()?;
        Self::recover(services, backends, agent_state)
    }

    fn recover(
        mut services: BpfHashMap<MapData, ServiceKey, ServiceValue>,
        backends: BpfHashMap<MapData, u32, Backend>,
        agent_state: Array<MapData, u64>,
    ) -> anyhow::Result<Self> {
        let services_max = services.map().info()?.max_entries() as usize;
        let backends_max = backends.map().info()?.max_entries() as usize;
        let mut by_id: HashMap<u32, (Backend, usize)> = HashMap::new();
        for entry in backends.iter() {
            let (id, backend) = entry?;
            by_id.insert(id, (backend, 0));
        }
        let ids = by_id.iter().map(|(id, (b, _))| (*b, *id)).collect();
        let keys: Vec<ServiceKey> = services.keys().collect::<Result<_, _>>()?;
        let mut frontends = HashMap::new();
        let mut used_slots = 0;
        for key in keys.iter().filter(|k| k.slot == 0) {
            let count = services.get(key, 0)?.count;
            let mut slots = Vec::with_capacity(count as usize);
            for slot in 1..=count {
                let id = services.get(&ServiceKey { slot, ..*key }, 0)?.backend_id;
                if let Some((_, refs)) = by_id.get_mut(&id) {
                    *refs += 1;
                }
                slots.push(id);
            }
            used_slots += slots.len() + 1;
            frontends.insert(*key, slots);
        }
        // Slots no head counts: left by an agent stopped halfway through a removal.
        for key in keys.iter().filter(|k| k.slot != 0) {
            let head = ServiceKey { slot: 0, ..*key };
            if frontends
                .get(&head)
                .is_none_or(|slots: &Vec<u32>| usize::from(key.slot) > slots.len())
            {
                match services.remove(key) {
                    Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                    Err(e) => return Err(e).context("deleting an orphaned slot"),
                }
            }
        }
        // Never below an id still in the maps, nor below one handed out before (conntrack may
        // name it although its backend is gone).
        let saved = agent_state.get(&AGENT_STATE_NEXT_BACKEND_ID, 0)? as u32;
        let after_max = by_id.keys().max().map_or(1, |m| m.wrapping_add(1));
        let next_id = saved.max(after_max).max(1);
        if !frontends.is_empty() {
            tracing::info!(
                frontends = frontends.len(),
                backends = by_id.len(),
                next_id,
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
            claims: HashMap::new(),
            used_slots,
            ids,
            by_id,
            next_id,
            reserved_until: next_id,
            agent_state,
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
        let (mut failures, mut unprogrammable) = (Vec::new(), Vec::new());
        for spn in &ports {
            if let Err(e) = self.sync_port(state, spn) {
                match e.downcast_ref::<NotProgrammable>() {
                    Some(_) => unprogrammable.push(format!("{spn}: {e:#}")),
                    None => failures.push(format!("{spn}: {e:#}")),
                }
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
        if !failures.is_empty() {
            failures.extend(unprogrammable);
            Err(anyhow!(
                "{} of {} service ports not programmed: {}",
                failures.len(),
                ports.len(),
                failures.join("; ")
            ))
        } else if !unprogrammable.is_empty() {
            Err(NotProgrammable(format!(
                "{} of {} service ports cannot be programmed as configured: {}",
                unprogrammable.len(),
                ports.len(),
                unprogrammable.join("; ")
            ))
            .into())
        } else {
            Ok(())
        }
    }

    fn sync_port(&mut self, state: &DesiredState, spn: &ServicePortName) -> anyhow::Result<()> {
        let desired = desired_frontends(state, spn);
        let old = self.owners.remove(spn).unwrap_or_default();
        let mut result = Ok(());
        let mut owned = Vec::with_capacity(desired.len());
        for (fe, backends) in &desired {
            match self.program(fe, backends) {
                Ok(()) => {
                    owned.push(*fe);
                    self.claims.insert(*fe, spn.clone());
                }
                Err(e) => result = Err(e),
            }
        }
        for fe in old
            .iter()
            .filter(|fe| !desired.iter().any(|(d, _)| d == *fe))
        {
            if self.claims.get(fe).is_some_and(|owner| owner != spn) {
                continue; // another port serves this address now
            }
            if let Err(e) = self.remove_frontend(fe) {
                result = Err(e);
            }
        }
        // A frontend that could not be updated (or removed) keeps what it had, so it stays
        // owned: also one recovered from the pinned maps after a restart, which no port owned.
        let kept = old.into_iter().chain(desired.iter().map(|(fe, _)| *fe));
        for fe in kept {
            let ours = self.claims.get(&fe).is_none_or(|owner| owner == spn);
            if ours && self.frontends.contains_key(&fe) && !owned.contains(&fe) {
                owned.push(fe);
            }
        }
        if !owned.is_empty() {
            self.owners.insert(spn.clone(), owned);
        }
        result
    }

    /// Makes `fe` send to `backends`, in that slot order. On failure, the maps keep serving
    /// what `fe` had before.
    fn program(&mut self, fe: &Frontend, backends: &[Backend]) -> anyhow::Result<()> {
        if backends.len() > usize::from(u16::MAX) {
            return Err(NotProgrammable(format!(
                "{} endpoints; a service port can have at most {} in the datapath",
                backends.len(),
                u16::MAX
            ))
            .into());
        }
        let old: Vec<u32> = self.frontends.get(fe).cloned().unwrap_or_default();
        let had = if self.frontends.contains_key(fe) {
            old.len() + 1
        } else {
            0
        };
        // Refuse before writing anything if the maps cannot hold the result.
        let new_slots = (backends.len() + 1).saturating_sub(had);
        if self.used_slots + new_slots > self.services_max {
            return Err(NotProgrammable(format!(
                "services map full ({} of {} entries used, {} more needed): raise \
                 --bpf-services-max (a map already pinned keeps its size until its pin is removed)",
                self.used_slots, self.services_max, new_slots
            ))
            .into());
        }
        let new_backends = backends
            .iter()
            .filter(|b| !self.ids.contains_key(b))
            .count();
        if self.by_id.len() + new_backends > self.backends_max {
            return Err(NotProgrammable(format!(
                "backends map full ({} of {} entries used, {} more needed): raise \
                 --bpf-backends-max (a map already pinned keeps its size until its pin is removed)",
                self.by_id.len(),
                self.backends_max,
                new_backends
            ))
            .into());
        }
        let mut ids = Vec::with_capacity(backends.len());
        for b in backends {
            match self.acquire(b) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    self.release_all(&ids);
                    return Err(e);
                }
            }
        }
        if let Err(e) = self.write_slots(fe, &old, &ids, had > 0) {
            self.restore_slots(fe, &old, &ids);
            self.release_all(&ids);
            return Err(e);
        }
        // The new backends are live from here on.
        self.used_slots = self.used_slots + ids.len() + 1 - had;
        self.frontends.insert(*fe, ids.clone());
        let mut result = Ok(());
        for slot in ids.len() + 1..=old.len() {
            if let Err(e) = self.remove_slot(&ServiceKey {
                slot: slot as u16,
                ..*fe
            }) {
                result = Err(e); // an orphan slot beyond the count: unseen by packets
            }
        }
        for id in old {
            if let Err(e) = self.release(id) {
                result = Err(e);
            }
        }
        result
    }

    /// Writes the backend slots that differ from `old`, then slot 0 with the new count.
    fn write_slots(
        &mut self,
        fe: &Frontend,
        old: &[u32],
        ids: &[u32],
        existed: bool,
    ) -> anyhow::Result<()> {
        for (i, id) in ids.iter().enumerate() {
            if old.get(i) != Some(id) {
                let key = ServiceKey {
                    slot: i as u16 + 1,
                    ..*fe
                };
                let value = ServiceValue {
                    backend_id: *id,
                    count: 0,
                    flags: 0,
                };
                self.services
                    .insert(key, value, 0)
                    .with_context(|| format!("writing slot {} of {}", i + 1, describe(fe)))?;
            }
        }
        if old.len() != ids.len() || !existed {
            let head = ServiceValue {
                backend_id: 0,
                count: ids.len() as u16,
                flags: 0,
            };
            self.services
                .insert(fe, head, 0)
                .with_context(|| format!("writing {}", describe(fe)))?;
        }
        Ok(())
    }

    /// After a failed [`Self::write_slots`]: puts `old` back into the slots the head counts and
    /// deletes the ones beyond it (best effort: the maps are failing already).
    fn restore_slots(&mut self, fe: &Frontend, old: &[u32], ids: &[u32]) {
        for (i, id) in ids.iter().enumerate() {
            let key = ServiceKey {
                slot: i as u16 + 1,
                ..*fe
            };
            let restored = match old.get(i) {
                Some(old_id) if old_id != id => self
                    .services
                    .insert(
                        key,
                        ServiceValue {
                            backend_id: *old_id,
                            count: 0,
                            flags: 0,
                        },
                        0,
                    )
                    .map_err(anyhow::Error::from),
                Some(_) => Ok(()),
                None => self.remove_slot(&key),
            };
            if let Err(e) = restored {
                tracing::warn!("restoring slot {} of {}: {e:#}", i + 1, describe(fe));
            }
        }
    }

    fn release_all(&mut self, ids: &[u32]) {
        for id in ids {
            if let Err(e) = self.release(*id) {
                tracing::warn!("releasing backend {id}: {e:#}");
            }
        }
    }

    fn remove_frontend(&mut self, fe: &Frontend) -> anyhow::Result<()> {
        let Some(ids) = self.frontends.get(fe).cloned() else {
            return Ok(());
        };
        self.remove_slot(fe)?;
        self.claims.remove(fe);
        // Packets no longer see the service; what follows is cleanup (slots left by a failure
        // here are invisible, and the next agent start deletes them).
        self.frontends.remove(fe);
        self.used_slots -= ids.len() + 1;
        let mut result = Ok(());
        for slot in 1..=ids.len() {
            if let Err(e) = self.remove_slot(&ServiceKey {
                slot: slot as u16,
                ..*fe
            }) {
                result = Err(e);
            }
        }
        for id in ids {
            if let Err(e) = self.release(id) {
                result = Err(e);
            }
        }
        result
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
        if id >= self.reserved_until {
            let until = id.saturating_add(ID_BLOCK);
            self.agent_state
                .set(AGENT_STATE_NEXT_BACKEND_ID, u64::from(until), 0)
                .context("reserving backend ids")?;
            self.reserved_until = until;
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
        // Recovered maps may hold the same backend under two ids; keep the other's entry.
        if self.ids.get(&backend) == Some(&id) {
            self.ids.remove(&backend);
        }
        self.by_id.remove(&id);
        match self.backends.remove(&id) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(e).with_context(|| format!("deleting backend {id}")),
        }
    }
}

/// The frontends a service port should have, each with its backends. IPv4 TCP and UDP only
/// for now: IPv6 addresses and SCTP ports are kept in the model and skipped here (the programs
/// could not match them).
pub fn desired_frontends(
    state: &DesiredState,
    spn: &ServicePortName,
) -> Vec<(Frontend, Vec<Backend>)> {
    let Some(sp) = state
        .services
        .get(spn)
        .filter(|sp| sp.protocol != Protocol::Sctp)
    else {
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
