//! Backend ids: one per endpoint of each service port, from a counter reserved in blocks in
//! `agent_state`, kept while the endpoint is listed or draining.
use super::*;

/// The backend ids of one service port, by endpoint, sorted: a port has a few endpoints, where a
/// hash map's table would take several times their size (megabytes at 30k Services). Boxed, not
/// a `Vec`: no spare room, and 8 bytes less a port (its ids change only with its endpoints).
#[derive(Default)]
pub(super) struct PortIds<A>(Box<[(Backend<A>, u32)]>);

impl<A: Addr> PortIds<A> {
    pub(super) fn find(&self, b: &Backend<A>) -> Result<usize, usize> {
        self.0.binary_search_by(|(x, _)| x.cmp(b))
    }

    pub(super) fn get(&self, b: &Backend<A>) -> Option<u32> {
        self.find(b).ok().map(|i| self.0[i].1)
    }

    pub(super) fn insert(&mut self, b: Backend<A>, id: u32) {
        match self.find(&b) {
            Ok(i) => self.0[i].1 = id,
            Err(i) => {
                let mut ids = Vec::with_capacity(self.0.len() + 1);
                ids.extend_from_slice(&self.0[..i]);
                ids.push((b, id));
                ids.extend_from_slice(&self.0[i..]);
                self.0 = ids.into();
            }
        }
    }

    /// The endpoint of `id` (a linear search: a port has a few).
    pub(super) fn backend_of(&self, id: u32) -> Option<Backend<A>> {
        self.0.iter().find(|(_, i)| *i == id).map(|(b, _)| *b)
    }

    pub(super) fn remove_id(&mut self, id: u32) {
        if self.0.iter().any(|(_, i)| *i == id) {
            self.0 = self.0.iter().copied().filter(|(_, i)| *i != id).collect();
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (Backend<A>, u32)> + '_ {
        self.0.iter().copied()
    }
}

/// Ids reserved in `agent_state` at a time: one map write per this many new backends.
pub(super) const ID_BLOCK: u32 = 1024;

impl<A: FamilyMaps> FamilyWriter<A> {
    /// The id `b` already has in `spn`: its own, or, right after a restart, the id that the
    /// slots `old` of a recovered frontend give that endpoint.
    pub(super) fn id_of(&self, spn: &ServicePortName, old: &[u32], b: &Backend<A>) -> Option<u32> {
        if let Some(id) = self.ports.get(spn).and_then(|port| port.ids.get(b)) {
            return Some(id);
        }
        old.iter().copied().find(|id| {
            (self.unclaimed.get(id))
                .is_some_and(|was| was.flags & BACKEND_DRAINING == 0 && was == b)
        })
    }

    /// The id of endpoint `b` in `spn`: kept (and taken out of draining) when it has one, new
    /// (and written to the backends map) otherwise.
    pub(super) fn acquire(
        &mut self,
        spn: &ServicePortName,
        old: &[u32],
        b: &Backend<A>,
    ) -> anyhow::Result<u32> {
        if let Some(id) = self.id_of(spn, old, b) {
            if self.draining.contains_key(&id) {
                self.write_backend(id, b)?;
                self.draining.remove(&id);
            }
            if self.unclaimed.remove(&id).is_some() {
                self.ports
                    .get_or_insert_with(spn.clone(), Default::default)
                    .ids
                    .insert(*b, id);
            }
            return Ok(id);
        }
        let mut id = self.next_id;
        while id == LOST || self.ids_in_use.contains(&id) {
            id = id.wrapping_add(1);
        }
        if id >= self.reserved_until {
            let until = id.saturating_add(ID_BLOCK);
            self.agent_state
                .set(A::NEXT_BACKEND_ID, u64::from(until), 0)
                .context("reserving backend ids")?;
            self.reserved_until = until;
        }
        self.write_backend(id, b)?;
        self.next_id = id.wrapping_add(1);
        self.ports
            .get_or_insert_with(spn.clone(), Default::default)
            .ids
            .insert(*b, id);
        self.ids_in_use.insert(id);
        Ok(id)
    }

    /// The endpoint of backend `id`, a slot of a frontend `claim` programmed (None: recovered
    /// and not claimed): in the claim's record, or recovered and not claimed yet.
    pub(super) fn backend_of(
        &self,
        claim: Option<&ServicePortName>,
        id: u32,
    ) -> Option<Backend<A>> {
        let claimed = claim.and_then(|spn| self.ports.get(spn)?.ids.backend_of(id));
        claimed.or_else(|| self.unclaimed.get(&id).copied())
    }
}
