//! Taking the maps over, and reading back what they hold: at start (an earlier agent's
//! entries, so that ids stay stable and flows keep their backend) and after a failed batch.
use std::os::fd::AsFd;

use super::*;

/// The source ranges the pinned trie holds, by frontend (scope 0: only those have ranges).
pub(super) fn recover_ranges<A: Addr>(
    trie: &LpmTrie<MapData, SourceRangeKey<A>, u8>,
) -> anyhow::Result<HashMap<Frontend<A>, SourceRanges>> {
    let mut out: HashMap<Frontend<A>, SourceRanges> = HashMap::default();
    for key in trie.keys() {
        let key = key.context("listing the source ranges")?;
        let data = key.data();
        let fe = ServiceKey::new(data.addr, data.port, data.proto, 0);
        let len = key
            .prefix_len()
            .saturating_sub(SourceRangeKey::<A>::FRONTEND_BITS) as u8;
        out.entry(fe).or_default().push((data.source.ip(), len));
    }
    Ok(out)
}

/// A handle of its own on the loaded object's array `name`, which stays in the object.
fn shared(ebpf: &Ebpf, name: &str) -> anyhow::Result<Map> {
    let Some(Map::Array(data)) = ebpf.map(name) else {
        return Err(anyhow!("map {name} missing"));
    };
    // A duplicate of its descriptor (opening it by id would need CAP_SYS_ADMIN).
    let fd = data.fd().as_fd().try_clone_to_owned()?;
    Ok(Map::Array(MapData::from_fd(fd)?))
}

impl<A: FamilyMaps> FamilyWriter<A> {
    /// Takes the maps out of the loaded object and recovers what an earlier agent left in them
    /// (ids stay stable across restarts, so established flows keep their backend).
    pub fn take_from(ebpf: &mut Ebpf, config: WriterConfig) -> anyhow::Result<Self> {
        maglev::validate_size(config.maglev_table_size)
            .context("--lb-maglev-table-size must be a prime up to 131071 (e.g. 16381)")?;
        let mut take = |name: &str| {
            ebpf.take_map(name)
                .with_context(|| format!("map {name} missing"))
        };
        let services: BpfHashMap<_, ServiceKey<A>, ServiceValue> = take(A::SERVICES)?.try_into()?;
        let backends: BpfHashMap<_, u32, Backend<A>> = take(A::BACKENDS)?.try_into()?;
        let maglev: BpfHashMap<_, ServiceKey<A>, MaglevChunk> = take(A::MAGLEV)?.try_into()?;
        let source_ranges: LpmTrie<_, SourceRangeKey<A>, u8> =
            take(A::SOURCE_RANGES)?.try_into()?;
        // Shared by both families' writers: a handle of each one's own.
        let agent_state: Array<_, u64> = shared(ebpf, MAP_AGENT_STATE)?.try_into()?;
        let mut settings: Array<_, u32> = shared(ebpf, MAP_CONFIG)?.try_into()?;
        let pinned_size = settings.get(&CONFIG_MAGLEV_TABLE_SIZE, 0)?;
        let stale = pinned_size != 0 && pinned_size != config.maglev_table_size;
        if !stale {
            settings.set(CONFIG_MAGLEV_TABLE_SIZE, config.maglev_table_size, 0)?;
        }
        let mut maps = Self::recover(
            services,
            backends,
            agent_state,
            maglev,
            source_ranges,
            settings,
            config,
        )?;
        maps.maglev_pinned_size = stale.then_some(pinned_size);
        Ok(maps)
    }

    pub(super) fn recover(
        services: BpfHashMap<MapData, ServiceKey<A>, ServiceValue>,
        backends: BpfHashMap<MapData, u32, Backend<A>>,
        agent_state: Array<MapData, u64>,
        maglev: BpfHashMap<MapData, ServiceKey<A>, MaglevChunk>,
        source_ranges: LpmTrie<MapData, SourceRangeKey<A>, u8>,
        settings: Array<MapData, u32>,
        config: WriterConfig,
    ) -> anyhow::Result<Self> {
        let batch_maps = Arc::new(BatchMaps {
            backends: batch::Target::of(&backends).context("the backends map's descriptor")?,
            services: batch::Target::of(&services).context("the services map's descriptor")?,
        });
        let mut maps = Self {
            services_max: services.map().info()?.max_entries() as usize,
            backends_max: backends.map().info()?.max_entries() as usize,
            services,
            backends,
            drain_period: config.drain_period,
            lb_algorithm: config.lb_algorithm,
            maglev,
            maglev_table_size: config.maglev_table_size,
            maglev_pinned_size: None,
            settings,
            udp_departed: false,
            frontends: DenseMap::default(),
            draining_frontends: HashMap::default(),
            frontend_expiry: None,
            used_slots: 0,
            ports: DenseMap::default(),
            ids_in_use: HashSet::default(),
            unclaimed: HashMap::default(),
            draining: HashMap::default(),
            backend_expiry: None,
            next_id: 1,
            reserved_until: 1,
            agent_state,
            ranges: HashMap::default(),
            source_ranges,
            batch: None,
            batch_maps,
            in_flight: None,
            unknown: false,
        };
        maps.read_back()?;
        Ok(maps)
    }

    /// Makes the writer's record of the maps what they hold, as after a restart: no port claims
    /// anything until the next full sync, which adopts what it still wants and drains the rest.
    pub(super) fn read_back(&mut self) -> anyhow::Result<()> {
        let now = Instant::now();
        let mut unclaimed = HashMap::default();
        let mut draining = HashMap::default();
        let backends = batch::entries(&self.backends).context("reading the pinned backends")?;
        for (id, backend) in backends {
            // Whose it was is not recorded: a draining one drains for a full period from now.
            if backend.flags & BACKEND_DRAINING != 0 {
                let drain = Drain::Until(now + self.drain_period);
                draining.insert(id, DrainingId { drain, owner: None });
            }
            unclaimed.insert(id, backend);
        }
        let services: HashMap<ServiceKey<A>, ServiceValue> = batch::entries(&self.services)
            .context("reading the pinned services")?
            .into_iter()
            .collect();
        let mut frontends: DenseMap<Frontend<A>, Programmed> = DenseMap::default();
        let mut draining_frontends = HashMap::default();
        let mut used_slots = 0;
        let mut damaged = 0;
        for (key, &head) in services.iter().filter(|(k, _)| k.slot == 0) {
            if head.flags & SERVICE_DRAINING != 0 {
                draining_frontends.insert(*key, now + self.drain_period);
            }
            // A lost slot does not stop the recovery: the first sync rewrites it.
            let slots: Box<[u32]> = (1..=head.count)
                .map(|slot| {
                    services
                        .get(&ServiceKey { slot, ..*key })
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
        for key in services.keys().filter(|k| k.slot != 0) {
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
        let saved = self.agent_state.get(&A::NEXT_BACKEND_ID, 0)? as u32;
        let after_max = unclaimed.keys().max().map_or(1, |m| m.wrapping_add(1));
        let next_id = saved.max(after_max).max(self.next_id).max(1);
        if !frontends.is_empty() {
            tracing::info!(
                frontends = frontends.len(),
                backends = unclaimed.len(),
                next_id,
                "recovered services from the pinned maps"
            );
        }
        self.ranges = recover_ranges(&self.source_ranges)?;
        self.frontend_expiry = draining_frontends.values().min().copied();
        self.frontends = frontends;
        self.draining_frontends = draining_frontends;
        self.used_slots = used_slots;
        self.ports.clear();
        self.ids_in_use = unclaimed.keys().copied().collect();
        self.unclaimed = unclaimed;
        self.backend_expiry = (!draining.is_empty()).then_some(now + self.drain_period);
        self.draining = draining;
        self.next_id = next_id;
        self.reserved_until = next_id;
        self.batch = None;
        self.unknown = false;
        Ok(())
    }
}
