//! Writing the desired state into the services and backends maps.
//!
//! Write order keeps every intermediate state valid for packets in flight (after Cilium): new
//! backends, then a frontend's backend slots, then its slot 0 with the new count, then surplus
//! slots are deleted, and only then are the endpoints that left marked draining.
//!
//! A sync runs in two phases, so that its result does not depend on the order of the service
//! ports: first every wanted frontend is programmed, then the frontends nobody wants any more
//! are removed (an address handed from one Service to another stays with the new one). The
//! first phase's writes go in batches that keep the write order; a full batch is written on a
//! thread of its own while the next is prepared (see `FamilyWriter::flush`).
//!
//! Nothing is cut at once: a backend that leaves its service port is kept, flagged draining
//! (established TCP connections stay on it, new connections and UDP go elsewhere), and a removed
//! frontend is kept as a draining head without slots (count 0), so the TCP connections through
//! a deleted Service keep working too. Both go once the endpoint (or frontend) has been gone
//! from the desired state for the drain period; an endpoint still listed but not usable (not
//! ready, terminating) drains for as long as it is listed. An endpoint that comes back within
//! its drain gets its old id back, so its flows are untouched.
mod drain;
mod ids;
mod recover;
mod tables;

use std::{
    collections::BTreeSet,
    fmt,
    net::IpAddr,
    sync::Arc,
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, anyhow};
use aya::{
    Ebpf,
    maps::{
        Array, HashMap as BpfHashMap, IterableMap, Map, MapData, MapError,
        lpm_trie::{Key as LpmKey, LpmTrie},
    },
};
use proxy_common::{
    AGENT_STATE_NEXT_BACKEND_ID, AGENT_STATE_NEXT_BACKEND_ID6, Addr, BACKEND_DRAINING, Backend,
    Be32, Be128, CONFIG_MAGLEV_TABLE_SIZE, IPPROTO_UDP, MAGLEV_CHUNK, MAP_AFFINITY, MAP_AFFINITY6,
    MAP_AGENT_STATE, MAP_BACKENDS, MAP_BACKENDS6, MAP_CONFIG, MAP_CONNTRACK, MAP_CONNTRACK6,
    MAP_MAGLEV, MAP_MAGLEV6, MAP_SERVICES, MAP_SERVICES6, MAP_SOURCE_RANGES, MAP_SOURCE_RANGES6,
    MaglevChunk, SERVICE_DRAINING, SERVICE_EXTERNAL, SERVICE_LOAD_BALANCER, SERVICE_MAGLEV,
    ServiceKey, ServiceValue, SourceRangeKey,
};

use foldhash::{HashMap, HashSet};

use self::{
    drain::{Drain, DrainingId},
    ids::PortIds,
};
use super::{
    batch, maglev,
    plan::{self, Frontend, FrontendPlan, describe, listed_backends},
};
use crate::{
    dataplane::{NotProgrammable, Scope},
    dense_map::DenseMap,
    model::{DesiredState, LbAlgorithm, ServicePortName},
    one_or_many::OneOrMany,
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

/// The maps of one address family the writer programs, by name, and where its next backend id
/// is kept in AGENT_STATE (each family's ids are its own: its conntrack names them).
pub trait FamilyMaps: Addr + Send + 'static {
    const SERVICES: &'static str;
    const BACKENDS: &'static str;
    const MAGLEV: &'static str;
    const SOURCE_RANGES: &'static str;
    const CONNTRACK: &'static str;
    const AFFINITY: &'static str;
    const NEXT_BACKEND_ID: u32;
}

impl FamilyMaps for Be32 {
    const SERVICES: &'static str = MAP_SERVICES;
    const BACKENDS: &'static str = MAP_BACKENDS;
    const MAGLEV: &'static str = MAP_MAGLEV;
    const SOURCE_RANGES: &'static str = MAP_SOURCE_RANGES;
    const CONNTRACK: &'static str = MAP_CONNTRACK;
    const AFFINITY: &'static str = MAP_AFFINITY;
    const NEXT_BACKEND_ID: u32 = AGENT_STATE_NEXT_BACKEND_ID;
}

impl FamilyMaps for Be128 {
    const SERVICES: &'static str = MAP_SERVICES6;
    const BACKENDS: &'static str = MAP_BACKENDS6;
    const MAGLEV: &'static str = MAP_MAGLEV6;
    const SOURCE_RANGES: &'static str = MAP_SOURCE_RANGES6;
    const CONNTRACK: &'static str = MAP_CONNTRACK6;
    const AFFINITY: &'static str = MAP_AFFINITY6;
    const NEXT_BACKEND_ID: u32 = AGENT_STATE_NEXT_BACKEND_ID6;
}

/// The writer of both families' maps: a Service port's IPv4 frontends and endpoints go to the
/// IPv4 maps, its IPv6 ones to the IPv6 maps, as kube-proxy runs one proxier a family.
pub struct MapWriter {
    v4: FamilyWriter<Be32>,
    v6: FamilyWriter<Be128>,
}

impl MapWriter {
    /// Takes both families' maps out of the loaded object (see [`FamilyWriter::take_from`]).
    pub fn take_from(ebpf: &mut Ebpf, config: WriterConfig) -> anyhow::Result<Self> {
        Ok(Self {
            v4: FamilyWriter::take_from(ebpf, config)?,
            v6: FamilyWriter::take_from(ebpf, config)?,
        })
    }

    /// Programs `scope` of `state` in both families' maps; one family's failure does not stop
    /// the other's.
    pub fn sync(&mut self, state: &DesiredState, scope: Scope<'_>) -> anyhow::Result<()> {
        let v4 = self.v4.sync(state, scope);
        let v6 = self.v6.sync(state, scope);
        match (v4, v6) {
            (Ok(()), r) | (r, Ok(())) => r,
            (Err(a), Err(b)) => {
                let message = format!("IPv4: {a:#}; IPv6: {b:#}");
                match a.is::<NotProgrammable>() && b.is::<NotProgrammable>() {
                    true => Err(NotProgrammable(message).into()),
                    false => Err(anyhow!(message)),
                }
            }
        }
    }

    /// Whether a UDP endpoint of either family has left a service port since
    /// [`Self::udp_departures_handled`].
    pub fn udp_departed(&self) -> bool {
        self.v4.udp_departed || self.v6.udp_departed
    }

    pub fn udp_departures_handled(&mut self) {
        self.v4.udp_departed = false;
        self.v6.udp_departed = false;
    }

    /// Every (frontend address, port, endpoint address, port) of UDP through which new flows
    /// may go now, both families: a NodePort's frontend address is unspecified.
    pub fn udp_routes(&self) -> HashSet<(IpAddr, u16, IpAddr, u16)> {
        let mut routes = self.v4.udp_routes();
        routes.extend(self.v6.udp_routes());
        routes
    }

    /// Ends the drains whose period is over, in both families (one's failure does not stop
    /// the other's).
    pub(crate) fn expire(&mut self, now: Instant) -> anyhow::Result<()> {
        let v4 = self.v4.expire(now);
        let v6 = self.v6.expire(now);
        v4.and(v6)
    }
}

/// A frontend's source ranges (address and prefix length), of its family.
type SourceRanges = Vec<(IpAddr, u8)>;

/// The writer of one address family's maps (`A`: `Be32` for IPv4, `Be128` for IPv6).
pub struct FamilyWriter<A: FamilyMaps> {
    services: BpfHashMap<MapData, ServiceKey<A>, ServiceValue>,
    backends: BpfHashMap<MapData, u32, Backend<A>>,
    services_max: usize,
    backends_max: usize,
    drain_period: Duration,
    lb_algorithm: LbAlgorithm,
    maglev: BpfHashMap<MapData, ServiceKey<A>, MaglevChunk>,
    maglev_table_size: u32,
    /// The size the pinned tables were made for, while it is not `maglev_table_size`: the
    /// programs index with it (the CONFIG map) until a full sync has rewritten every table,
    /// which then writes the new size. Until then the old tables serve as they are (also
    /// while the API server is unreachable); a table rewritten meanwhile is read with the old
    /// size, so its new flows may pick other endpoints than other nodes' (never a wrong one).
    maglev_pinned_size: Option<u32>,
    /// The programs' CONFIG map.
    settings: Array<MapData, u32>,
    /// A UDP endpoint has left a service port since [`Self::udp_departures_handled`].
    udp_departed: bool,
    /// What the services map holds, by frontend.
    frontends: DenseMap<Frontend<A>, Programmed>,
    /// The removed frontends (draining heads without slots) and when each goes. Apart from
    /// `frontends`: few drain at a time, and a time in each entry would make them all larger.
    draining_frontends: HashMap<Frontend<A>, Instant>,
    /// When the first draining frontend's period ends (None: none drains).
    frontend_expiry: Option<Instant>,
    /// Entries of the services map, counted (heads, draining ones included, and slots).
    used_slots: usize,
    /// What each service port put in the maps.
    ports: DenseMap<ServicePortName, PortState<A>>,
    /// Every id the backends map holds. Their endpoints are in the ports' [`PortState::ids`],
    /// or in `unclaimed`: a table of ids alone takes 5 bytes a slot, with the endpoints 13
    /// (IPv4) or 25 (IPv6).
    ids_in_use: HashSet<u32>,
    /// The ids recovered from the pinned maps that no port has claimed yet, with the endpoint
    /// each had there.
    unclaimed: HashMap<u32, Backend<A>>,
    /// The ids flagged draining in the map (no new flows, established TCP connections stay):
    /// apart from the others for the same reason as `draining_frontends`.
    draining: HashMap<u32, DrainingId>,
    /// When the first draining backend's period ends (None: none drains for a period).
    backend_expiry: Option<Instant>,
    next_id: u32,
    /// Ids below this may have been handed out (so a restarted agent starts above it). Kept in
    /// `agent_state` and raised a block at a time before an id past it is used, so even an agent
    /// that dies mid-sync never lets its successor reuse one.
    reserved_until: u32,
    agent_state: Array<MapData, u64>,
    source_ranges: LpmTrie<MapData, SourceRangeKey<A>, u8>,
    /// The source ranges written for each frontend.
    ranges: HashMap<Frontend<A>, SourceRanges>,
    /// During a sync's first phase: the writes to the services and backends maps, held back to
    /// be made a batch at a time (see [`Self::flush`]).
    batch: Option<Batch<A>>,
    /// The services and backends maps, for the thread that makes a full batch's writes.
    batch_maps: Arc<BatchMaps<A>>,
    /// The full batch that thread is writing while the next one is prepared.
    in_flight: Option<JoinHandle<Result<(), BatchFailed>>>,
    /// A batch failed and reading the maps back failed too: what is recorded above may not be
    /// what the maps hold, so nothing is written or expired until they are read back.
    unknown: bool,
}

/// What one service port put in the maps (an entry goes when it holds nothing).
#[derive(Default)]
struct PortState<A> {
    /// The frontends.
    frontends: OneOrMany<Frontend<A>>,
    /// The backend ids of its endpoints. Ids come from a counter, are not reused soon, and
    /// belong to one port, so the draining flag of an id says whether that endpoint is still
    /// in that port, and a conntrack entry never finds a different backend.
    ids: PortIds<A>,
}

/// What the services map holds for one frontend.
struct Programmed {
    /// Its backend ids, in slot order (none for a draining frontend; [`LOST`] for a slot a
    /// damaged map lost).
    slots: Box<[u32]>,
    /// What slot 0 holds.
    head: ServiceValue,
    /// The port that last programmed it: when a Service's address passes to another (a rename
    /// keeping the cluster IP), the old one's removal must not take it away. None: recovered
    /// from the pins and not claimed yet, or draining.
    claim: Option<ServicePortName>,
}

/// Writes held back, in the order they were asked for.
#[derive(Default)]
struct Batch<A> {
    backend_ids: Vec<u32>,
    backends: Vec<Backend<A>>,
    service_keys: Vec<ServiceKey<A>>,
    services: Vec<ServiceValue>,
}

impl<A: Addr> Batch<A> {
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

    /// Makes the writes, each kind a system call: the new backends, then the slots and heads
    /// in the order they were asked for.
    fn write(&self, maps: &BatchMaps<A>) -> Result<(), BatchFailed> {
        let failed = |what, of| {
            move |(written, error)| BatchFailed {
                what,
                written,
                of,
                error,
            }
        };
        batch::update(&maps.backends, &self.backend_ids, &self.backends)
            .map_err(failed("backends", self.backends.len()))?;
        batch::update(&maps.services, &self.service_keys, &self.services)
            .map_err(failed("service slots", self.services.len()))
    }
}

/// The maps a [`Batch`] writes.
struct BatchMaps<A> {
    backends: batch::Target<u32, Backend<A>>,
    services: batch::Target<ServiceKey<A>, ServiceValue>,
}

/// The write of a [`Batch`] that the kernel refused.
struct BatchFailed {
    what: &'static str,
    /// How many of its writes of that kind the kernel made (None: it did not say).
    written: Option<usize>,
    of: usize,
    error: std::io::Error,
}

impl fmt::Display for BatchFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let written = self
            .written
            .map_or("some or none".to_owned(), |n| n.to_string());
        let (what, of, error) = (self.what, self.of, &self.error);
        write!(f, "writing {what} ({written} of {of} written): {error}")
    }
}

/// A slot whose id a damaged map lost: never an id (ids start at 1), so it is rewritten.
const LOST: u32 = 0;

impl<A: FamilyMaps> FamilyWriter<A> {
    /// Every (frontend address, port, endpoint address, port) of UDP through which new flows
    /// may go now: a NodePort's frontend address is unspecified.
    fn udp_routes(&self) -> HashSet<(IpAddr, u16, IpAddr, u16)> {
        let mut routes = HashSet::default();
        // Every port's ids, made only for a slot whose id neither its claim's record nor
        // `unclaimed` holds: a frontend whose reprogramming failed halfway keeps slots whose ids
        // the failed port took (out of `unclaimed` after a restart, or as new ids).
        let mut every_port: Option<HashMap<u32, Backend<A>>> = None;
        for (fe, programmed) in &self.frontends {
            if fe.proto != IPPROTO_UDP {
                continue;
            }
            for &id in &programmed.slots {
                if id == LOST || self.draining.contains_key(&id) {
                    continue;
                }
                let b = self.backend_of(programmed.claim.as_ref(), id).or_else(|| {
                    let every_port = every_port.get_or_insert_with(|| {
                        (self.ports.values())
                            .flat_map(|port| port.ids.iter().map(|(b, id)| (id, b)))
                            .collect()
                    });
                    every_port.get(&id).copied()
                });
                if let Some(b) = b {
                    routes.insert((fe.addr.ip(), fe.port.get(), b.addr.ip(), b.port.get()));
                }
            }
        }
        routes
    }

    pub fn sync(&mut self, state: &DesiredState, scope: Scope<'_>) -> anyhow::Result<()> {
        let ports: Vec<ServicePortName> = match scope {
            Scope::All => {
                // Sorted, so that a given state always gets the same ids.
                let mut all: BTreeSet<&ServicePortName> = state.port_names().collect();
                all.extend(self.ports.keys());
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
            let old = (self.ports.get_mut(spn))
                .map(|port| std::mem::take(&mut port.frontends))
                .unwrap_or_default();
            let mut owned = Vec::new();
            for wanted in plan::frontends::<A>(state, spn, self.lb_algorithm) {
                let fe = wanted.fe;
                // Some frontends need their writes made at once: after what is held back.
                let direct = self.writes_directly(&wanted);
                if direct {
                    self.flush()?;
                } else if self.batch.as_ref().is_some_and(Batch::is_full) {
                    self.flush_behind()?;
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
                self.ports
                    .get_or_insert_with(spn.clone(), Default::default)
                    .frontends = owned.into();
            }
            self.tidy(spn);
        }
        self.flush()?;
        self.batch = None;
        // Phase 2: the frontends their ports no longer want, unless another port has them now.
        for (spn, old) in ports.iter().zip(previous) {
            for &fe in old.iter() {
                let claimed_by = self.frontends.get(&fe).and_then(|p| p.claim.as_ref());
                if claimed_by == Some(spn) && self.owned_by(spn, &fe) {
                    continue; // still wanted
                }
                if claimed_by.is_some_and(|owner| owner != spn) {
                    continue; // another port serves this address now
                }
                if let Err(e) = self.drain_frontend(&fe, now) {
                    // It keeps serving what it had: still ours.
                    let port = self.ports.get_or_insert_with(spn.clone(), Default::default);
                    let mut frontends = std::mem::take(&mut port.frontends).into_vec();
                    frontends.push(fe);
                    port.frontends = frontends.into();
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
            // Claimed or draining now: the set of a restart's every id is not kept.
            self.unclaimed.shrink_to_fit();
            // A full sync follows a bulk load (the first, a restart's), after which the tables
            // hardly grow: their growth room goes.
            self.frontends.shrink_to_fit();
            self.ports.shrink_to_fit();
            if let Err(e) = self.expire(now) {
                errors
                    .failures
                    .push(format!("expiring drained entries: {e:#}"));
            }
            // Every port written (one refused keeps its old table): every table is of the new
            // size, which the programs then use.
            let all_written = errors.failures.is_empty() && errors.unprogrammable.is_empty();
            if all_written
                && self.maglev_pinned_size.is_some()
                && let Err(e) =
                    self.settings
                        .set(CONFIG_MAGLEV_TABLE_SIZE, self.maglev_table_size, 0)
            {
                errors
                    .failures
                    .push(format!("writing the Maglev table size: {e:#}"));
            } else if all_written {
                self.maglev_pinned_size = None;
            }
        }
        errors.into_result(ports.len())
    }

    /// Whether `wanted` needs writes that must follow its slot 0 at once, or more than the
    /// services and backends maps around it: slots to delete (it shrinks; held back, their
    /// deletion could overtake a later write of the same frontend, and would free room only
    /// after the batch), a Maglev table, or source ranges (now, or to remove).
    fn writes_directly(&self, wanted: &FrontendPlan<A>) -> bool {
        let maglev = |head: &ServiceValue| head.flags & SERVICE_MAGLEV != 0;
        let programmed = self.frontends.get(&wanted.fe);
        wanted.backends.len() < programmed.map_or(0, |p| p.slots.len())
            || maglev(&wanted.head)
            || programmed.is_some_and(|p| maglev(&p.head))
            || !wanted.source_ranges.is_empty()
            || self.ranges.contains_key(&wanted.fe)
    }

    /// Makes the writes held back: those of the batch being written on a thread of its own
    /// first, then the rest, each kind a system call (the new backends, then the slots and heads
    /// in the order they were asked for). That is the order each frontend needs, so a failure
    /// leaves every frontend serving, with its old backends or its new ones. The writer then
    /// forgets what it had recorded and reads the maps back, and fails the sync: the next one,
    /// a full one, writes what is missing.
    fn flush(&mut self) -> anyhow::Result<()> {
        self.landed()?;
        let Some(mut batch) = self.batch.take() else {
            return Ok(());
        };
        let written = batch.write(&self.batch_maps);
        self.settle(written)?;
        batch.clear();
        self.batch = Some(batch);
        Ok(())
    }

    /// [`Self::flush`], but the writes held back are made on a thread of their own while this
    /// one prepares the next batch (the kernel's inserts are half of a first sync's time).
    fn flush_behind(&mut self) -> anyhow::Result<()> {
        self.landed()?;
        if self.batch.is_none() {
            return Ok(());
        }
        let maps = Arc::clone(&self.batch_maps);
        let (hand_over, handed) = std::sync::mpsc::channel::<Batch<A>>();
        let spawned = std::thread::Builder::new()
            .name("map-writes".into())
            .spawn(move || handed.recv().map_or(Ok(()), |batch| batch.write(&maps)));
        let Ok(thread) = spawned else {
            // No thread to be had (a process limit, say): written here.
            return self.flush();
        };
        let batch = self.batch.replace(Batch::default()).expect("checked above");
        match hand_over.send(batch) {
            Ok(()) => self.in_flight = Some(thread),
            // Not expected: the thread waits for the batch.
            Err(std::sync::mpsc::SendError(batch)) => {
                self.batch = Some(batch);
                return self.flush();
            }
        }
        Ok(())
    }

    /// Waits for the batch being written on its own thread.
    fn landed(&mut self) -> anyhow::Result<()> {
        let Some(thread) = self.in_flight.take() else {
            return Ok(());
        };
        let written = thread
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        self.settle(written)
    }

    /// After a batch's writes: on failure, what was recorded is read back from the maps, and
    /// nothing more is held back (the sync fails).
    fn settle(&mut self, written: Result<(), BatchFailed>) -> anyhow::Result<()> {
        let Err(failed) = written else {
            return Ok(());
        };
        self.batch = None;
        self.unknown = true;
        let failed = anyhow!("{failed}");
        Err(match self.read_back() {
            Ok(()) => failed.context("the maps were read back; the next sync rewrites them"),
            Err(again) => failed.context(format!("reading the maps back failed too: {again:#}")),
        })
    }

    /// Writes backend `id`, or holds the write back for [`Self::flush`].
    fn write_backend(&mut self, id: u32, b: &Backend<A>) -> anyhow::Result<()> {
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
    fn write_service(&mut self, key: ServiceKey<A>, value: ServiceValue) -> anyhow::Result<()> {
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

    fn owned_by(&self, spn: &ServicePortName, fe: &Frontend<A>) -> bool {
        self.ports
            .get(spn)
            .is_some_and(|p| p.frontends.contains(fe))
    }

    /// Drops the entry of `spn` if it holds nothing.
    fn tidy(&mut self, spn: &ServicePortName) {
        if self
            .ports
            .get(spn)
            .is_some_and(|port| port.frontends.is_empty() && port.ids.is_empty())
        {
            self.ports.remove(spn);
        }
    }

    /// Makes `wanted.fe` send to `wanted.backends` (the endpoints of `spn`), in that slot order,
    /// with `wanted.head` (its flags) in slot 0, admitting only its source ranges if it has
    /// some. On failure, the maps keep serving what the frontend had before.
    fn program(&mut self, spn: &ServicePortName, wanted: &FrontendPlan<A>) -> anyhow::Result<()> {
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
        let old: Vec<u32> = programmed.map(|p| p.slots.to_vec()).unwrap_or_default();
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
        if self.ids_in_use.len() + new_backends > self.backends_max {
            return Err(NotProgrammable(format!(
                "backends map full ({} of {} entries used, {} more needed): raise \
                 --bpf-backends-max (a map already pinned keeps its size until its pin is removed)",
                self.ids_in_use.len(),
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
        if maglev && (!had_maglev || old != ids || self.maglev_pinned_size.is_some()) {
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
        let programmed = self.frontends.get_or_insert_with(*fe, || Programmed {
            slots: Box::default(),
            head,
            claim: None,
        });
        programmed.slots = ids.as_slice().into();
        programmed.head = head;
        self.draining_frontends.remove(fe);
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

    /// Writes the backend slots that differ from `old`, then slot 0 if it changed from
    /// `old_head`.
    fn write_slots(
        &mut self,
        fe: &Frontend<A>,
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

    /// After a failed [`Self::write_slots`]: puts `old` back into the slots the head counts and
    /// deletes the ones beyond it (best effort: the maps are failing already).
    fn restore_slots(&mut self, fe: &Frontend<A>, old: &[u32], ids: &[u32]) {
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

    fn remove_slot(&mut self, key: &ServiceKey<A>) -> anyhow::Result<()> {
        match self.services.remove(key) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(e) => {
                Err(e).with_context(|| format!("deleting slot {} of {}", key.slot, describe(key)))
            }
        }
    }
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
