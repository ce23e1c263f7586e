//! Draining: removed frontends and leaving endpoints keep their established TCP connections
//! for the drain period, then go.
use super::*;

/// How long a backend id flagged draining stays.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Drain {
    /// While its endpoint is still listed (not ready, or terminating).
    WhileListed,
    /// Until then (its endpoint is gone).
    Until(Instant),
}

/// A backend id flagged draining.
pub(super) struct DrainingId {
    pub(super) drain: Drain,
    /// The port whose id it is, to forget it there when it goes; None: recovered from the
    /// pinned maps, and no port claimed it.
    pub(super) owner: Option<ServicePortName>,
}

/// Makes `first` the earlier of itself and `t`.
pub(super) fn earliest(first: &mut Option<Instant>, t: Instant) {
    *first = Some(first.map_or(t, |f| f.min(t)));
}

impl<A: FamilyMaps> FamilyWriter<A> {
    /// Turns `fe` into a draining head: no new flows, established TCP connections through it
    /// keep their (draining) backends until the drain period ends.
    pub(super) fn drain_frontend(&mut self, fe: &Frontend<A>, now: Instant) -> anyhow::Result<()> {
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
        programmed.slots = Box::default();
        programmed.head = head;
        programmed.claim = None;
        let until = *(self.draining_frontends)
            .entry(*fe)
            .or_insert(now + self.drain_period);
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
    pub(super) fn drain_backends(
        &mut self,
        state: &DesiredState,
        spn: &ServicePortName,
        now: Instant,
    ) -> anyhow::Result<()> {
        let Some(port) = self.ports.get(spn) else {
            return Ok(());
        };
        let in_slots: HashSet<u32> = (port.frontends.iter())
            .filter_map(|fe| self.frontends.get(fe))
            .flat_map(|p| &p.slots)
            .copied()
            .collect();
        let listed: HashSet<Backend<A>> = listed_backends(state, spn).into_iter().collect();
        let leaving: Vec<(Backend<A>, u32)> = (port.ids.iter())
            .filter(|(_, id)| !in_slots.contains(id))
            .collect();
        for (b, id) in leaving {
            let previous = self.draining.get(&id).map(|d| d.drain);
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
            let owner = Some(spn.clone());
            self.draining.insert(id, DrainingId { drain, owner });
        }
        Ok(())
    }

    /// After the first full sync since a restart: what the pinned maps held that no port
    /// claimed drains for a period from now (a Service deleted while no agent ran).
    pub(super) fn drain_unclaimed(&mut self, now: Instant) -> anyhow::Result<()> {
        let claimed: HashSet<Frontend<A>> = (self.ports.values())
            .flat_map(|port| port.frontends.iter().copied())
            .collect();
        let stale: Vec<Frontend<A>> = self
            .frontends
            .keys()
            .filter(|fe| !claimed.contains(fe) && !self.draining_frontends.contains_key(fe))
            .copied()
            .collect();
        for fe in stale {
            self.drain_frontend(&fe, now)?;
        }
        let unclaimed: Vec<(u32, Backend<A>)> = (self.unclaimed.iter())
            .filter(|(id, _)| !self.draining.contains_key(id))
            .map(|(id, b)| (*id, *b))
            .collect();
        for (id, b) in unclaimed {
            self.flag_draining(id, b)?;
            let until = now + self.drain_period;
            earliest(&mut self.backend_expiry, until);
            let drain = Drain::Until(until);
            self.draining.insert(id, DrainingId { drain, owner: None });
        }
        Ok(())
    }

    /// Marks backend `id` (endpoint `b`) draining in the map: no new flows, established TCP
    /// connections stay.
    pub(super) fn flag_draining(&mut self, id: u32, b: Backend<A>) -> anyhow::Result<()> {
        self.udp_departed |= b.proto == IPPROTO_UDP;
        let flagged = Backend {
            flags: b.flags | BACKEND_DRAINING,
            ..b
        };
        self.backends
            .insert(id, flagged, 0)
            .with_context(|| format!("flagging backend {id} draining"))
    }

    /// Deletes the draining frontends and backends whose drain period is over.
    pub(super) fn expire(&mut self, now: Instant) -> anyhow::Result<()> {
        if self.unknown {
            return Ok(()); // the next sync reads the maps back first
        }
        // The frontends are walked only when one may be due (every second otherwise).
        if self.frontend_expiry.is_some_and(|first| first <= now) {
            let mut done = Vec::new();
            self.frontend_expiry = None;
            for (fe, &until) in &self.draining_frontends {
                match until <= now {
                    true => done.push(*fe),
                    false => earliest(&mut self.frontend_expiry, until),
                }
            }
            for fe in done {
                if let Err(e) = self.remove_slot(&fe) {
                    self.frontend_expiry = Some(now);
                    return Err(e);
                }
                self.frontends.remove(&fe);
                self.draining_frontends.remove(&fe);
                self.used_slots -= 1;
            }
        }
        if self.backend_expiry.is_none_or(|first| first > now) {
            return Ok(());
        }
        let mut done = Vec::new();
        self.backend_expiry = None;
        for (id, draining) in &self.draining {
            match draining.drain {
                Drain::Until(until) if until <= now => done.push(*id),
                Drain::Until(until) => earliest(&mut self.backend_expiry, until),
                Drain::WhileListed => {}
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
            self.ids_in_use.remove(&id);
            self.unclaimed.remove(&id);
            let owner = self.draining.remove(&id).and_then(|d| d.owner);
            if let Some(owner) = owner
                && let Some(port) = self.ports.get_mut(&owner)
            {
                port.ids.remove_id(id);
                self.tidy(&owner);
            }
        }
        Ok(())
    }
}
