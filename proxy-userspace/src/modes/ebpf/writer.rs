//! Writing the desired state into the services and backends maps.
//!
//! Write order keeps every intermediate state valid for packets in flight (after Cilium): new
//! backends, then a frontend's backend slots, then its slot 0 with the new count, then surplus
//! slots are deleted, and only then are the endpoints that left marked draining.
//!
//! A sync runs in two phases, so that its result does not depend on the order of the service
//! ports: first every wanted frontend is programmed, then the frontends nobody wants any more
//! are removed (an address handed from one Service to another stays with the new one). The
//! first phase's writes go in batches that keep the write order (see [`MapWriter::flush`]).
//!
//! Nothing is cut at once: a backend that leaves its service port is kept, flagged draining
//! (established TCP connections stay on it, new connections and UDP go elsewhere), and a removed
//! frontend is kept as a draining head without slots (count 0), so the TCP connections through
//! a deleted Service keep working too. Both go once the endpoint (or frontend) has been gone
//! from the desired state for the drain period; an endpoint still listed but not usable (not
//! ready, terminating) drains for as long as it is listed. An endpoint that comes back within
//! its drain gets its old id back, so its flows are untouched.
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant},
};

use anyhow::{Context, anyhow};
use aya::{
    Ebpf,
    maps::{
        Array, HashMap as BpfHashMap, IterableMap, MapData, MapError,
        lpm_trie::{Key as LpmKey, LpmTrie},
    },
};
use proxy_common::{
    AGENT_STATE_NEXT_BACKEND_ID, BACKEND_DRAINING, Backend, Be32, CONFIG_MAGLEV_TABLE_SIZE,
    MAGLEV_CHUNK, MAP_AGENT_STATE, MAP_BACKENDS, MAP_CONFIG, MAP_MAGLEV, MAP_SERVICES,
    MAP_SOURCE_RANGES, MaglevChunk, SERVICE_DRAINING, SERVICE_EXTERNAL, SERVICE_LOAD_BALANCER,
    SERVICE_MAGLEV, SOURCE_RANGE_FRONTEND_BITS, ServiceKey, ServiceValue, SourceRangeKey,
};

use foldhash::{HashMap, HashSet};

use super::{
    batch, maglev,
    plan::{self, Frontend, FrontendPlan, describe, listed_backends},
};
use crate::{
    dataplane::{NotProgrammable, Scope},
    model::{DesiredState, LbAlgorithm, ServicePortName},
};

/// How long a removed endpoint or Service keeps serving the TCP connections established
/// through it, by default (`--bpf-drain-period`).
pub const DEFAULT_DRAIN_PERIOD: Duration = Duration::from_secs(3600);

/// How the map writer programs: what a change keeps, and how new flows pick backends.
#[derive(Clone, Copy, Debug)]
pub struct WriterConfig {
    /// How long removed endpoints and Services keep their established TCP connections.
    pub drain_period: Duration,
    /// The algorithm of Services without the annotation (`--lb-algorithm`).
    pub lb_algorithm: LbAlgorithm,
    /// Maglev's table size, a prime (`--lb-maglev-table-size`).
    pub maglev_table_size: u32,
}

impl Default for WriterConfig {
    fn default() -> Self {
        Self {
            drain_period: DEFAULT_DRAIN_PERIOD,
            lb_algorithm: LbAlgorithm::Random,
            maglev_table_size: maglev::DEFAULT_TABLE_SIZE,
        }
    }
}

pub struct MapWriter {
    services: BpfHashMap<MapData, ServiceKey, ServiceValue>,
    backends: BpfHashMap<MapData, u32, Backend>,
    services_max: usize,
    backends_max: usize,
    drain_period: Duration,
    lb_algorithm: LbAlgorithm,
    maglev: BpfHashMap<MapData, ServiceKey, MaglevChunk>,
    maglev_table_size: u32,
    /// The pinned tables were made for another table size: rewrite each at its next sync.
    maglev_stale: bool,
    /// What the services map holds, by frontend.
    frontends: HashMap<Frontend, Programmed>,
    /// When the first draining frontend's period ends (None: none drains).
    frontend_expiry: Option<Instant>,
    /// Which frontends each service port put there.
    owners: HashMap<ServicePortName, Vec<Frontend>>,
    /// Entries of the services map, counted (heads, draining ones included, and slots).
    used_slots: usize,
    /// Backend ids of each service port, by endpoint. Ids come from a counter, are not reused
    /// soon, and belong to one port, so the draining flag of an id says whether that endpoint
    /// is still in that port, and a conntrack entry never finds a different backend.
    ids: HashMap<ServicePortName, PortIds>,
    by_id: HashMap<u32, IdState>,
    /// When the first draining backend's period ends (None: none drains for a period).
    backend_expiry: Option<Instant>,
    next_id: u32,
    /// Ids below this may have been handed out (so a restarted agent starts above it). Kept in
    /// `agent_state` and raised a block at a time before an id past it is used, so even an agent
    /// that dies mid-sync never lets its successor reuse one.
    reserved_until: u32,
    agent_state: Array<MapData, u64>,
    source_ranges: LpmTrie<MapData, SourceRangeKey, u8>,
    /// The source ranges written for each frontend.
    ranges: HashMap<Frontend, Vec<(Ipv4Addr, u8)>>,
    /// During a sync's first phase: the writes to the services and backends maps, held back to
    /// be made a batch at a time (see [`Self::flush`]).
    batch: Option<Batch>,
    /// A batch failed and reading the maps back failed too: what is recorded above may not be
    /// what the maps hold, so nothing is written or expired until they are read back.
    unknown: bool,
}

/// What the services map holds for one frontend.
struct Programmed {
    /// Its backend ids, in slot order (none for a draining frontend; [`LOST`] for a slot a
    /// damaged map lost).
    slots: Vec<u32>,
    /// What slot 0 holds.
    head: ServiceValue,
    /// Removed: a draining head without slots until then.
    draining_until: Option<Instant>,
    /// The port that last programmed it: when a Service's address passes to another (a rename
    /// keeping the cluster IP), the old one's removal must not take it away. None: recovered
    /// from the pins and not claimed yet, or draining.
    claim: Option<ServicePortName>,
}

/// Writes held back, in the order they were asked for.
#[derive(Default)]
struct Batch {
    backend_ids: Vec<u32>,
    backends: Vec<Backend>,
    service_keys: Vec<ServiceKey>,
    services: Vec<ServiceValue>,
}

impl Batch {
    /// Writes a batch holds before it is made: enough that system calls cost little, few enough
    /// that the batch costs no memory to speak of.
    const SIZE: usize = 8192;

    fn is_full(&self) -> bool {
        self.backends.len() + self.services.len() >= Self::SIZE
    }

    fn clear(&mut self) {
        self.backend_ids.clear();
        self.backends.clear();
        self.service_keys.clear();
        self.services.clear();
    }
}

/// The backend ids of one service port, by endpoint, sorted: a port has a few endpoints, where a
/// hash map's table would take several times their size (megabytes at 30k Services).
#[derive(Default)]
struct PortIds(Vec<(Backend, u32)>);

impl PortIds {
    fn find(&self, b: &Backend) -> Result<usize, usize> {
        self.0.binary_search_by(|(x, _)| x.cmp(b))
    }

    fn get(&self, b: &Backend) -> Option<u32> {
        self.find(b).ok().map(|i| self.0[i].1)
    }

    fn insert(&mut self, b: Backend, id: u32) {
        match self.find(&b) {
            Ok(i) => self.0[i].1 = id,
            Err(i) => self.0.insert(i, (b, id)),
        }
    }

    fn remove(&mut self, b: &Backend) {
        if let Ok(i) = self.find(b) {
            self.0.remove(i);
        }
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn iter(&self) -> impl Iterator<Item = (Backend, u32)> + '_ {
        self.0.iter().copied()
    }
}

struct IdState {
    backend: Backend,
    /// None: recovered from the pinned maps and not yet claimed by a port.
    owner: Option<ServicePortName>,
    /// Flagged draining in the map: no new flows, established TCP connections stay.
    drain: Option<Drain>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Drain {
    /// While its endpoint is still listed (not ready, or terminating).
    WhileListed,
    /// Until then (its endpoint is gone).
    Until(Instant),
}

/// Makes `first` the earlier of itself and `t`.
fn earliest(first: &mut Option<Instant>, t: Instant) {
    *first = Some(first.map_or(t, |f| f.min(t)));
}

/// Ids reserved in `agent_state` at a time: one map write per this many new backends.
const ID_BLOCK: u32 = 1024;

/// A slot whose id a damaged map lost: never an id (ids start at 1), so it is rewritten.
const LOST: u32 = 0;

impl MapWriter {
    /// Takes the maps out of the loaded object and recovers what an earlier agent left in them
    /// (ids stay stable across restarts, so established flows keep their backend).
    pub fn take_from(ebpf: &mut Ebpf, config: WriterConfig) -> anyhow::Result<Self> {
        maglev::validate_size(config.maglev_table_size)
            .context("--lb-maglev-table-size must be a prime up to 131071 (e.g. 16381)")?;
        let mut take = |name: &str| {
            ebpf.take_map(name)
                .with_context(|| format!("map {name} missing"))
        };
        let services: BpfHashMap<_, ServiceKey, ServiceValue> = take(MAP_SERVICES)?.try_into()?;
        let backends: BpfHashMap<_, u32, Backend> = take(MAP_BACKENDS)?.try_into()?;
        let agent_state: Array<_, u64> = take(MAP_AGENT_STATE)?.try_into()?;
        let maglev: BpfHashMap<_, ServiceKey, MaglevChunk> = take(MAP_MAGLEV)?.try_into()?;
        let source_ranges: LpmTrie<_, SourceRangeKey, u8> = take(MAP_SOURCE_RANGES)?.try_into()?;
        let mut settings: Array<_, u32> = take(MAP_CONFIG)?.try_into()?;
        let pinned_size = settings.get(&CONFIG_MAGLEV_TABLE_SIZE, 0)?;
        settings.set(CONFIG_MAGLEV_TABLE_SIZE, config.maglev_table_size, 0)?;
        let mut maps = Self::recover(
            services,
            backends,
            agent_state,
            maglev,
            source_ranges,
            config,
        )?;
        maps.maglev_stale = pinned_size != 0 && pinned_size != config.maglev_table_size;
        Ok(maps)
    }

    fn recover(
        services: BpfHashMap<MapData, ServiceKey, ServiceValue>,
        backends: BpfHashMap<MapData, u32, Backend>,
        agent_state: Array<MapData, u64>,
        maglev: BpfHashMap<MapData, ServiceKey, MaglevChunk>,
        source_ranges: LpmTrie<MapData, SourceRangeKey, u8>,
        config: WriterConfig,
    ) -> anyhow::Result<Self> {
        let mut maps = Self {
            services_max: services.map().info()?.max_entries() as usize,
            backends_max: backends.map().info()?.max_entries() as usize,
            services,
            backends,
            drain_period: config.drain_period,
            lb_algorithm: config.lb_algorithm,
            maglev,
            maglev_table_size: config.maglev_table_size,
            maglev_stale: false,
            frontends: HashMap::default(),
            frontend_expiry: None,
            owners: HashMap::default(),
            used_slots: 0,
            ids: HashMap::default(),
            by_id: HashMap::default(),
            backend_expiry: None,
            next_id: 1,
            reserved_until: 1,
            agent_state,
            ranges: HashMap::default(),
            source_ranges,
            batch: None,
            unknown: false,
        };
        maps.read_back()?;
        Ok(maps)
    }

    /// Makes the writer's record of the maps what they hold, as after a restart: no port claims
    /// anything until the next full sync, which adopts what it still wants and drains the rest.
    fn read_back(&mut self) -> anyhow::Result<()> {
        let now = Instant::now();
        let mut by_id = HashMap::default();
        let mut backend_expiry = None;
        for entry in self.backends.iter() {
            let (id, backend) = entry?;
            // Whose it was is not recorded: a draining one drains for a full period from now.
            let drain = (backend.flags & BACKEND_DRAINING != 0).then(|| {
                earliest(&mut backend_expiry, now + self.drain_period);
                Drain::Until(now + self.drain_period)
            });
            by_id.insert(
                id,
                IdState {
                    backend,
                    owner: None,
                    drain,
                },
            );
        }
        let keys: Vec<ServiceKey> = self.services.keys().collect::<Result<_, _>>()?;
        let mut frontends: HashMap<Frontend, Programmed> = HashMap::default();
        let mut used_slots = 0;
        let mut damaged = 0;
        for key in keys.iter().filter(|k| k.slot == 0) {
            let Ok(head) = self.services.get(key, 0) else {
                continue; // deleted since it was listed
            };
            let draining_until =
                (head.flags & SERVICE_DRAINING != 0).then(|| now + self.drain_period);
            // A lost slot does not stop the recovery: the first sync rewrites it.
            let slots: Vec<u32> = (1..=head.count)
                .map(|slot| {
                    self.services
                        .get(&ServiceKey { slot, ..*key }, 0)
                        .map_or(LOST, |v| v.backend_id)
                })
                .collect();
            if slots.contains(&LOST) {
                damaged += 1;
            }
            used_slots += slots.len() + 1;
            frontends.insert(
                *key,
                Programmed {
                    slots,
                    head,
                    draining_until,
                    claim: None,
                },
            );
        }
        if damaged > 0 {
            tracing::warn!(
                damaged,
                "pinned services lost backend slots; the first sync rewrites them"
            );
        }
        // Slots no head counts: left by an agent stopped halfway through a removal.
        for key in keys.iter().filter(|k| k.slot != 0) {
            let head = ServiceKey { slot: 0, ..*key };
            if frontends
                .get(&head)
                .is_none_or(|p| usize::from(key.slot) > p.slots.len())
            {
                match self.services.remove(key) {
                    Ok(()) | Err(MapError::KeyNotFound) => {}
                    Err(e) => return Err(e).context("deleting an orphaned slot"),
                }
            }
        }
        // Never below an id still in the maps, nor below one handed out before (conntrack may
        // name it although its backend is gone).
        let saved = self.agent_state.get(&AGENT_STATE_NEXT_BACKEND_ID, 0)? as u32;
        let after_max = by_id.keys().max().map_or(1, |m| m.wrapping_add(1));
        let next_id = saved.max(after_max).max(self.next_id).max(1);
        if !frontends.is_empty() {
            tracing::info!(
                frontends = frontends.len(),
                backends = by_id.len(),
                next_id,
                "recovered services from the pinned maps"
            );
        }
        self.ranges = recover_ranges(&self.source_ranges)?;
        self.frontend_expiry = frontends.values().filter_map(|p| p.draining_until).min();
        self.frontends = frontends;
        self.owners.clear();
        self.used_slots = used_slots;
        self.ids.clear();
        self.by_id = by_id;
        self.backend_expiry = backend_expiry;
        self.next_id = next_id;
        self.reserved_until = next_id;
        self.batch = None;
        self.unknown = false;
        Ok(())
    }

    pub fn sync(&mut self, state: &DesiredState, scope: Scope<'_>) -> anyhow::Result<()> {
        let ports: Vec<ServicePortName> = match scope {
            Scope::All => {
                // Sorted, so that a given state always gets the same ids.
                let mut all: BTreeSet<&ServicePortName> = state.port_names().collect();
                all.extend(self.owners.keys());
                all.extend(self.ids.keys());
                all.into_iter().cloned().collect()
            }
            Scope::Changed(changed) => changed.iter().cloned().collect(),
        };
        if self.unknown {
            self.read_back()
                .context("reading the maps back after a failed batch of writes")?;
        }
        let now = Instant::now();
        let mut errors = Errors::default();
        // Phase 1: every wanted frontend, its writes made in batches.
        self.batch = Some(Batch::default());
        let mut previous = Vec::with_capacity(ports.len());
        for spn in &ports {
            let old = self.owners.remove(spn).unwrap_or_default();
            let mut owned = Vec::new();
            for wanted in plan::frontends(state, spn, self.lb_algorithm) {
                let fe = wanted.fe;
                // Some frontends need their writes made at once: after what is held back.
                let direct = self.writes_directly(&wanted);
                if direct || self.batch.as_ref().is_some_and(Batch::is_full) {
                    self.flush()?;
                }
                let held = if direct { self.batch.take() } else { None };
                let programmed = self.program(spn, &wanted);
                if direct {
                    self.batch = held;
                }
                match programmed {
                    Ok(()) => {
                        owned.push(fe);
                        if let Some(p) = self.frontends.get_mut(&fe) {
                            p.claim = Some(spn.clone());
                        }
                    }
                    Err(e) => {
                        // It keeps serving what it had (also one recovered after a restart,
                        // which no port claimed yet): still ours.
                        let ours = self
                            .frontends
                            .get(&fe)
                            .is_some_and(|p| p.claim.as_ref().is_none_or(|owner| owner == spn));
                        if ours {
                            owned.push(fe);
                        }
                        errors.add(spn, e);
                    }
                }
            }
            previous.push(old);
            if !owned.is_empty() {
                self.owners.insert(spn.clone(), owned);
            }
        }
        self.flush()?;
        self.batch = None;
        // Phase 2: the frontends their ports no longer want, unless another port has them now.
        for (spn, old) in ports.iter().zip(previous) {
            for fe in old {
                let claimed_by = self.frontends.get(&fe).and_then(|p| p.claim.as_ref());
                if claimed_by == Some(spn) && self.owned_by(spn, &fe) {
                    continue; // still wanted
                }
                if claimed_by.is_some_and(|owner| owner != spn) {
                    continue; // another port serves this address now
                }
                if let Err(e) = self.drain_frontend(&fe, now) {
                    // It keeps serving what it had: still ours.
                    self.owners.entry(spn.clone()).or_default().push(fe);
                    errors.add(spn, e);
                }
            }
            if let Err(e) = self.drain_backends(state, spn, now) {
                errors.add(spn, e);
            }
        }
        if matches!(scope, Scope::All) {
            if let Err(e) = self.drain_unclaimed(now) {
                errors.failures.push(format!("recovered entries: {e:#}"));
            }
            if let Err(e) = self.expire(now) {
                errors
                    .failures
                    .push(format!("expiring drained entries: {e:#}"));
            }
            if errors.failures.is_empty() {
                // Every table was written for the current size (or failed and stays stale).
                self.maglev_stale = false;
            }
        }
        errors.into_result(ports.len())
    }

    /// Whether `wanted` needs writes that must follow its slot 0 at once, or more than the
    /// services and backends maps around it: slots to delete (it shrinks; held back, their
    /// deletion could overtake a later write of the same frontend, and would free room only
    /// after the batch), a Maglev table, or source ranges (now, or to remove).
    fn writes_directly(&self, wanted: &FrontendPlan) -> bool {
        let maglev = |head: &ServiceValue| head.flags & SERVICE_MAGLEV != 0;
        let programmed = self.frontends.get(&wanted.fe);
        wanted.backends.len() < programmed.map_or(0, |p| p.slots.len())
            || maglev(&wanted.head)
            || programmed.is_some_and(|p| maglev(&p.head))
            || !wanted.source_ranges.is_empty()
            || self.ranges.contains_key(&wanted.fe)
    }

    /// Makes the writes held back, each kind a system call: the new backends, then the slots
    /// and heads in the order they were asked for. That is the order each frontend needs, so a
    /// failure leaves every frontend serving, with its old backends or its new ones. The writer
    /// then forgets what it had recorded and reads the maps back, and fails the sync: the next
    /// one, a full one, writes what is missing.
    fn flush(&mut self) -> anyhow::Result<()> {
        let Some(mut batch) = self.batch.take() else {
            return Ok(());
        };
        let written = batch::update(&self.backends, &batch.backend_ids, &batch.backends)
            .map_err(|(n, e)| (n, batch.backends.len(), "backends", e))
            .and_then(|()| {
                batch::update(&self.services, &batch.service_keys, &batch.services)
                    .map_err(|(n, e)| (n, batch.services.len(), "service slots", e))
            });
        if let Err((n, of, what, e)) = written {
            let written = n.map_or("some or none".to_owned(), |n| n.to_string());
            let failed = anyhow!("writing {what} ({written} of {of} written): {e}");
            self.unknown = true;
            return Err(match self.read_back() {
                Ok(()) => failed.context("the maps were read back; the next sync rewrites them"),
                Err(again) => {
                    failed.context(format!("reading the maps back failed too: {again:#}"))
                }
            });
        }
        batch.clear();
        self.batch = Some(batch);
        Ok(())
    }

    /// Writes backend `id`, or holds the write back for [`Self::flush`].
    fn write_backend(&mut self, id: u32, b: &Backend) -> anyhow::Result<()> {
        match &mut self.batch {
            Some(batch) => {
                batch.backend_ids.push(id);
                batch.backends.push(*b);
                Ok(())
            }
            None => self
                .backends
                .insert(id, b, 0)
                .with_context(|| format!("writing backend {id}")),
        }
    }

    /// Writes `value` at `key` in the services map, or holds the write back.
    fn write_service(&mut self, key: ServiceKey, value: ServiceValue) -> anyhow::Result<()> {
        match &mut self.batch {
            Some(batch) => {
                batch.service_keys.push(key);
                batch.services.push(value);
                Ok(())
            }
            None => self
                .services
                .insert(key, value, 0)
                .with_context(|| match key.slot {
                    0 => format!("writing {}", describe(&key)),
                    slot => format!("writing slot {slot} of {}", describe(&key)),
                }),
        }
    }

    fn owned_by(&self, spn: &ServicePortName, fe: &Frontend) -> bool {
        self.owners.get(spn).is_some_and(|o| o.contains(fe))
    }

    /// Makes `wanted.fe` send to `wanted.backends` (the endpoints of `spn`), in that slot order,
    /// with `wanted.head` (its flags) in slot 0, admitting only its source ranges if it has
    /// some. On failure, the maps keep serving what the frontend had before.
    fn program(&mut self, spn: &ServicePortName, wanted: &FrontendPlan) -> anyhow::Result<()> {
        let (fe, head, backends) = (&wanted.fe, wanted.head, wanted.backends.as_slice());
        if backends.len() > usize::from(u16::MAX) {
            return Err(NotProgrammable(format!(
                "{} endpoints; a service port can have at most {} in the datapath",
                backends.len(),
                u16::MAX
            ))
            .into());
        }
        let programmed = self.frontends.get(fe);
        let old: Vec<u32> = programmed.map(|p| p.slots.clone()).unwrap_or_default();
        let had_head = programmed.map(|p| p.head);
        let existed = programmed.is_some();
        // Refuse before writing anything if the maps cannot hold the result.
        let new_slots =
            (backends.len() + 1).saturating_sub(if existed { old.len() + 1 } else { 0 });
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
            .filter(|b| self.id_of(spn, &old, b).is_none())
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
            // A new id that is not written yet is simply never used: no undo needed.
            ids.push(self.acquire(spn, &old, b)?);
        }
        let head = ServiceValue {
            count: ids.len() as u16,
            ..head
        };
        let had_maglev = had_head.is_some_and(|h| h.flags & SERVICE_MAGLEV != 0);
        let maglev = head.flags & SERVICE_MAGLEV != 0;
        if maglev && (!had_maglev || old != ids || self.maglev_stale) {
            // Before slot 0 points new flows at it; ids no longer in it only lose new flows.
            self.write_maglev(fe, backends, &ids)?;
        }
        // Before slot 0 turns the check on; ranges no longer wanted go after it.
        let stale_ranges = self.write_ranges(fe, &wanted.source_ranges)?;
        if let Err(e) = self.write_slots(fe, &old, &ids, had_head, head) {
            self.restore_slots(fe, &old, &ids);
            return Err(e);
        }
        // The new slots are live from here on.
        self.used_slots = self.used_slots + ids.len() + 1 - if existed { old.len() + 1 } else { 0 };
        let programmed = self.frontends.entry(*fe).or_insert_with(|| Programmed {
            slots: Vec::new(),
            head,
            draining_until: None,
            claim: None,
        });
        programmed.slots.clone_from(&ids);
        programmed.head = head;
        programmed.draining_until = None;
        self.remove_ranges(fe, &stale_ranges)?;
        self.ranges_written(fe, &wanted.source_ranges);
        if had_maglev && !maglev {
            self.remove_maglev(fe)?;
        }
        for slot in ids.len() + 1..=old.len() {
            let key = ServiceKey {
                slot: slot as u16,
                ..*fe
            };
            // An orphan slot beyond the count is unseen by packets: the failure is only noted.
            self.remove_slot(&key)?;
        }
        Ok(())
    }

    /// The id `b` already has in `spn`: its own, or, right after a restart, the id that the
    /// slots `old` of a recovered frontend give that endpoint.
    fn id_of(&self, spn: &ServicePortName, old: &[u32], b: &Backend) -> Option<u32> {
        if let Some(id) = self.ids.get(spn).and_then(|ids| ids.get(b)) {
            return Some(id);
        }
        old.iter().copied().find(|id| {
            self.by_id.get(id).is_some_and(|s| {
                s.owner.is_none() && s.backend.flags & BACKEND_DRAINING == 0 && s.backend == *b
            })
        })
    }

    /// The id of endpoint `b` in `spn`: kept (and taken out of draining) when it has one, new
    /// (and written to the backends map) otherwise.
    fn acquire(&mut self, spn: &ServicePortName, old: &[u32], b: &Backend) -> anyhow::Result<u32> {
        if let Some(id) = self.id_of(spn, old, b) {
            if self.by_id[&id].drain.is_some() {
                self.write_backend(id, b)?;
            }
            let state = self.by_id.get_mut(&id).expect("ids and by_id agree");
            state.drain = None;
            if state.owner.is_none() {
                state.owner = Some(spn.clone());
                self.ids.entry(spn.clone()).or_default().insert(*b, id);
            }
            return Ok(id);
        }
        let mut id = self.next_id;
        while id == LOST || self.by_id.contains_key(&id) {
            id = id.wrapping_add(1);
        }
        if id >= self.reserved_until {
            let until = id.saturating_add(ID_BLOCK);
            self.agent_state
                .set(AGENT_STATE_NEXT_BACKEND_ID, u64::from(until), 0)
                .context("reserving backend ids")?;
            self.reserved_until = until;
        }
        self.write_backend(id, b)?;
        self.next_id = id.wrapping_add(1);
        self.ids.entry(spn.clone()).or_default().insert(*b, id);
        self.by_id.insert(
            id,
            IdState {
                backend: *b,
                owner: Some(spn.clone()),
                drain: None,
            },
        );
        Ok(id)
    }

    /// Writes the Maglev table of `fe` for `backends` (with these `ids`), in chunks.
    fn write_maglev(
        &mut self,
        fe: &Frontend,
        backends: &[Backend],
        ids: &[u32],
    ) -> anyhow::Result<()> {
        let members: Vec<maglev::MaglevBackend> = backends
            .iter()
            .zip(ids)
            .map(|(b, id)| {
                maglev::MaglevBackend::new(
                    IpAddr::V4(Ipv4Addr::from(b.addr.octets())),
                    b.port.get(),
                    *id,
                )
            })
            .collect();
        let table = maglev::table(&members, self.maglev_table_size)?;
        for (i, part) in table.chunks(MAGLEV_CHUNK).enumerate() {
            let mut chunk = MaglevChunk {
                ids: [LOST; MAGLEV_CHUNK],
            };
            chunk.ids[..part.len()].copy_from_slice(part);
            self.maglev
                .insert(
                    ServiceKey {
                        slot: i as u16,
                        ..*fe
                    },
                    chunk,
                    0,
                )
                .with_context(|| {
                    format!(
                        "writing the Maglev table of {} (the MAGLEV map holds 1048576 chunks of \
                         1024 entries)",
                        describe(fe)
                    )
                })?;
        }
        Ok(())
    }

    fn remove_maglev(&mut self, fe: &Frontend) -> anyhow::Result<()> {
        let chunks = (self.maglev_table_size as usize).div_ceil(MAGLEV_CHUNK);
        for i in 0..chunks {
            match self.maglev.remove(&ServiceKey {
                slot: i as u16,
                ..*fe
            }) {
                Ok(()) | Err(MapError::KeyNotFound) => {}
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("deleting the Maglev table of {}", describe(fe)));
                }
            }
        }
        Ok(())
    }

    /// Writes the backend slots that differ from `old`, then slot 0 if it changed from
    /// `old_head`.
    fn write_slots(
        &mut self,
        fe: &Frontend,
        old: &[u32],
        ids: &[u32],
        old_head: Option<ServiceValue>,
        head: ServiceValue,
    ) -> anyhow::Result<()> {
        for (i, id) in ids.iter().enumerate() {
            if old.get(i) != Some(id) {
                let key = ServiceKey {
                    slot: i as u16 + 1,
                    ..*fe
                };
                self.write_service(key, slot_value(*id))?;
            }
        }
        if old_head != Some(head) {
            self.write_service(*fe, head)?;
        }
        Ok(())
    }

    /// Writes the source ranges `wanted` of `fe`; returns those written before and no longer
    /// wanted (for [`Self::remove_ranges`] once slot 0 is written). Until then `fe` is known
    /// to hold both, so that what a failure leaves in the trie is removed by a later sync.
    fn write_ranges(
        &mut self,
        fe: &Frontend,
        wanted: &[(Ipv4Addr, u8)],
    ) -> anyhow::Result<Vec<(Ipv4Addr, u8)>> {
        if wanted.is_empty() && !self.ranges.contains_key(fe) {
            return Ok(Vec::new()); // most frontends: none wanted, none held
        }
        let held = self.ranges.entry(*fe).or_default();
        let stale = held
            .iter()
            .filter(|r| !wanted.contains(r))
            .copied()
            .collect();
        for range in wanted {
            if held.contains(range) {
                continue;
            }
            self.source_ranges
                .insert(&range_key(fe, *range), 1, 0)
                .with_context(|| {
                    format!(
                        "writing source range {}/{} of {}",
                        range.0,
                        range.1,
                        describe(fe)
                    )
                })?;
            held.push(*range);
        }
        Ok(stale)
    }

    /// After slot 0 and [`Self::remove_ranges`]: `fe` holds `wanted` only.
    fn ranges_written(&mut self, fe: &Frontend, wanted: &[(Ipv4Addr, u8)]) {
        if wanted.is_empty() {
            self.ranges.remove(fe);
        } else {
            self.ranges.insert(*fe, wanted.to_vec());
        }
    }

    fn remove_ranges(&mut self, fe: &Frontend, ranges: &[(Ipv4Addr, u8)]) -> anyhow::Result<()> {
        for range in ranges {
            match self.source_ranges.remove(&range_key(fe, *range)) {
                Ok(()) | Err(MapError::KeyNotFound) => {}
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!(
                            "deleting source range {}/{} of {}",
                            range.0,
                            range.1,
                            describe(fe)
                        )
                    });
                }
            }
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
                    .insert(key, slot_value(*old_id), 0)
                    .map_err(anyhow::Error::from),
                Some(_) => Ok(()),
                None => self.remove_slot(&key),
            };
            if let Err(e) = restored {
                tracing::warn!("restoring slot {} of {}: {e:#}", i + 1, describe(fe));
            }
        }
    }

    /// Turns `fe` into a draining head: no new flows, established TCP connections through it
    /// keep their (draining) backends until the drain period ends.
    fn drain_frontend(&mut self, fe: &Frontend, now: Instant) -> anyhow::Result<()> {
        let Some(programmed) = self.frontends.get(fe) else {
            return Ok(());
        };
        let (slots, old_head) = (programmed.slots.len(), programmed.head);
        // Established flows from outside still find it (the programs for outside traffic look
        // only at external frontends).
        let external = old_head.flags & (SERVICE_EXTERNAL | SERVICE_LOAD_BALANCER);
        let head = ServiceValue::head(0, SERVICE_DRAINING | external, 0);
        self.services
            .insert(fe, head, 0)
            .with_context(|| format!("writing {}", describe(fe)))?;
        // Recorded once its ranges and Maglev table are gone: a failure there is retried.
        let ranges = self.ranges.get(fe).cloned().unwrap_or_default();
        self.remove_ranges(fe, &ranges)?;
        self.ranges.remove(fe);
        if old_head.flags & SERVICE_MAGLEV != 0 {
            self.remove_maglev(fe)?;
        }
        // Packets no longer see the slots; what follows is cleanup (slots left by a failure
        // here are invisible, and the next agent start deletes them).
        let programmed = self.frontends.get_mut(fe).expect("read above");
        programmed.slots.clear();
        programmed.head = head;
        programmed.claim = None;
        let until = *programmed
            .draining_until
            .get_or_insert(now + self.drain_period);
        earliest(&mut self.frontend_expiry, until);
        self.used_slots -= slots;
        for slot in 1..=slots {
            self.remove_slot(&ServiceKey {
                slot: slot as u16,
                ..*fe
            })?;
        }
        Ok(())
    }

    /// Flags the ids of `spn` that no slot of its frontends uses as draining: until the
    /// endpoint has been gone from the state for the drain period.
    fn drain_backends(
        &mut self,
        state: &DesiredState,
        spn: &ServicePortName,
        now: Instant,
    ) -> anyhow::Result<()> {
        let Some(ids) = self.ids.get(spn) else {
            return Ok(());
        };
        let in_slots: HashSet<u32> = self
            .owners
            .get(spn)
            .into_iter()
            .flatten()
            .filter_map(|fe| self.frontends.get(fe))
            .flat_map(|p| &p.slots)
            .copied()
            .collect();
        let listed: HashSet<Backend> = listed_backends(state, spn).into_iter().collect();
        let leaving: Vec<(Backend, u32)> = ids
            .iter()
            .filter(|(_, id)| !in_slots.contains(id))
            .collect();
        for (b, id) in leaving {
            let previous = self.by_id[&id].drain;
            let drain = match previous {
                _ if listed.contains(&b) => Drain::WhileListed,
                Some(Drain::Until(until)) => Drain::Until(until),
                _ => Drain::Until(now + self.drain_period),
            };
            if previous.is_none() {
                self.flag_draining(id, b)?;
            }
            if let Drain::Until(until) = drain {
                earliest(&mut self.backend_expiry, until);
            }
            self.by_id.get_mut(&id).expect("ids and by_id agree").drain = Some(drain);
        }
        Ok(())
    }

    /// After the first full sync since a restart: what the pinned maps held that no port
    /// claimed drains for a period from now (a Service deleted while no agent ran).
    fn drain_unclaimed(&mut self, now: Instant) -> anyhow::Result<()> {
        let claimed: HashSet<Frontend> = self.owners.values().flatten().copied().collect();
        let stale: Vec<Frontend> = self
            .frontends
            .iter()
            .filter(|(fe, p)| !claimed.contains(fe) && p.draining_until.is_none())
            .map(|(fe, _)| *fe)
            .collect();
        for fe in stale {
            self.drain_frontend(&fe, now)?;
        }
        let unclaimed: Vec<(u32, Backend)> = self
            .by_id
            .iter()
            .filter(|(_, s)| s.owner.is_none() && s.drain.is_none())
            .map(|(id, s)| (*id, s.backend))
            .collect();
        for (id, b) in unclaimed {
            self.flag_draining(id, b)?;
            let until = now + self.drain_period;
            earliest(&mut self.backend_expiry, until);
            self.by_id.get_mut(&id).expect("listed above").drain = Some(Drain::Until(until));
        }
        Ok(())
    }

    /// Marks backend `id` (endpoint `b`) draining in the map: no new flows, established TCP
    /// connections stay.
    fn flag_draining(&mut self, id: u32, b: Backend) -> anyhow::Result<()> {
        let flagged = Backend {
            flags: b.flags | BACKEND_DRAINING,
            ..b
        };
        self.backends
            .insert(id, flagged, 0)
            .with_context(|| format!("flagging backend {id} draining"))
    }

    /// Deletes the draining frontends and backends whose drain period is over.
    pub(crate) fn expire(&mut self, now: Instant) -> anyhow::Result<()> {
        if self.unknown {
            return Ok(()); // the next sync reads the maps back first
        }
        // The frontends are walked only when one may be due (every second otherwise).
        if self.frontend_expiry.is_some_and(|first| first <= now) {
            let mut done = Vec::new();
            self.frontend_expiry = None;
            for (fe, p) in &self.frontends {
                match p.draining_until {
                    Some(until) if until <= now => done.push(*fe),
                    Some(until) => earliest(&mut self.frontend_expiry, until),
                    None => {}
                }
            }
            for fe in done {
                if let Err(e) = self.remove_slot(&fe) {
                    self.frontend_expiry = Some(now);
                    return Err(e);
                }
                self.frontends.remove(&fe);
                self.used_slots -= 1;
            }
        }
        if self.backend_expiry.is_none_or(|first| first > now) {
            return Ok(());
        }
        let mut done = Vec::new();
        self.backend_expiry = None;
        for (id, s) in &self.by_id {
            match s.drain {
                Some(Drain::Until(until)) if until <= now => done.push(*id),
                Some(Drain::Until(until)) => earliest(&mut self.backend_expiry, until),
                _ => {}
            }
        }
        for id in done {
            match self.backends.remove(&id) {
                Ok(()) | Err(MapError::KeyNotFound) => {}
                Err(e) => {
                    self.backend_expiry = Some(now);
                    return Err(e).with_context(|| format!("deleting backend {id}"));
                }
            }
            if let Some(IdState {
                backend,
                owner: Some(owner),
                ..
            }) = self.by_id.remove(&id)
                && let Some(ids) = self.ids.get_mut(&owner)
            {
                ids.remove(&backend);
                if ids.is_empty() {
                    self.ids.remove(&owner);
                }
            }
        }
        Ok(())
    }

    fn remove_slot(&mut self, key: &ServiceKey) -> anyhow::Result<()> {
        match self.services.remove(key) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(e) => {
                Err(e).with_context(|| format!("deleting slot {} of {}", key.slot, describe(key)))
            }
        }
    }
}

/// The source-range trie's key for `range` of frontend `fe`.
fn range_key(fe: &Frontend, (addr, len): (Ipv4Addr, u8)) -> LpmKey<SourceRangeKey> {
    LpmKey::new(
        SOURCE_RANGE_FRONTEND_BITS + u32::from(len),
        SourceRangeKey {
            addr: fe.addr,
            port: fe.port,
            proto: fe.proto,
            pad: 0,
            source: Be32::from_octets(addr.octets()),
        },
    )
}

/// The source ranges the pinned trie holds, by frontend (scope 0: only those have ranges).
fn recover_ranges(
    trie: &LpmTrie<MapData, SourceRangeKey, u8>,
) -> anyhow::Result<HashMap<Frontend, Vec<(Ipv4Addr, u8)>>> {
    let mut out: HashMap<Frontend, Vec<(Ipv4Addr, u8)>> = HashMap::default();
    for key in trie.keys() {
        let key = key.context("listing the source ranges")?;
        let data = key.data();
        let fe = ServiceKey::new(data.addr, data.port, data.proto, 0);
        let len = key.prefix_len().saturating_sub(SOURCE_RANGE_FRONTEND_BITS) as u8;
        out.entry(fe)
            .or_default()
            .push((Ipv4Addr::from(data.source.octets()), len));
    }
    Ok(out)
}

fn slot_value(backend_id: u32) -> ServiceValue {
    ServiceValue {
        backend_id,
        count: 0,
        flags: 0,
    }
}

/// What went wrong in one sync, by kind.
#[derive(Default)]
struct Errors {
    failures: Vec<String>,
    unprogrammable: Vec<String>,
}

impl Errors {
    fn add(&mut self, spn: &ServicePortName, e: anyhow::Error) {
        match e.downcast_ref::<NotProgrammable>() {
            Some(_) => self.unprogrammable.push(format!("{spn}: {e:#}")),
            None => self.failures.push(format!("{spn}: {e:#}")),
        }
    }

    fn into_result(mut self, ports: usize) -> anyhow::Result<()> {
        if !self.failures.is_empty() {
            let n = self.failures.len();
            self.failures.extend(self.unprogrammable);
            Err(anyhow!(
                "{n} of {ports} service ports not programmed: {}",
                self.failures.join("; ")
            ))
        } else if !self.unprogrammable.is_empty() {
            Err(NotProgrammable(format!(
                "{} of {ports} service ports cannot be programmed as configured: {}",
                self.unprogrammable.len(),
                self.unprogrammable.join("; ")
            ))
            .into())
        } else {
            Ok(())
        }
    }
}
