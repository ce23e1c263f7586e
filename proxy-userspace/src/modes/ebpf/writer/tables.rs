//! The side tables a frontend may have: its Maglev table and its source ranges.
use super::*;

/// The source-range trie's key for `range` of frontend `fe`.
pub(super) fn range_key<A: Addr>(
    fe: &Frontend<A>,
    (addr, len): (IpAddr, u8),
) -> LpmKey<SourceRangeKey<A>> {
    LpmKey::new(
        SourceRangeKey::<A>::FRONTEND_BITS + u32::from(len),
        SourceRangeKey {
            addr: fe.addr,
            port: fe.port,
            proto: fe.proto,
            pad: 0,
            // The plan gives each family's writer its own family's ranges.
            source: A::from_ip(addr).unwrap_or_default(),
        },
    )
}

impl<A: FamilyMaps> FamilyWriter<A> {
    /// Writes the Maglev table of `fe` for `backends` (with these `ids`), in chunks.
    pub(super) fn write_maglev(
        &mut self,
        fe: &Frontend<A>,
        backends: &[Backend<A>],
        ids: &[u32],
    ) -> anyhow::Result<()> {
        let members: Vec<maglev::MaglevBackend> = backends
            .iter()
            .zip(ids)
            .map(|(b, id)| maglev::MaglevBackend::new(b.addr.ip(), b.port.get(), *id))
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
        // A larger table of the pinned size leaves chunks past this one's.
        self.remove_maglev_chunks(fe, table.len().div_ceil(MAGLEV_CHUNK))
    }

    pub(super) fn remove_maglev(&mut self, fe: &Frontend<A>) -> anyhow::Result<()> {
        self.remove_maglev_chunks(fe, 0)
    }

    /// Deletes `fe`'s chunks from `first` on, of a table of either size.
    fn remove_maglev_chunks(&mut self, fe: &Frontend<A>, first: usize) -> anyhow::Result<()> {
        let size = self
            .maglev_table_size
            .max(self.maglev_pinned_size.unwrap_or(0));
        for i in first..(size as usize).div_ceil(MAGLEV_CHUNK) {
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

    /// Writes the source ranges `wanted` of `fe`; returns those written before and no longer
    /// wanted (for [`Self::remove_ranges`] once slot 0 is written). Until then `fe` is known
    /// to hold both, so that what a failure leaves in the trie is removed by a later sync.
    pub(super) fn write_ranges(
        &mut self,
        fe: &Frontend<A>,
        wanted: &[(IpAddr, u8)],
    ) -> anyhow::Result<Vec<(IpAddr, u8)>> {
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
    pub(super) fn ranges_written(&mut self, fe: &Frontend<A>, wanted: &[(IpAddr, u8)]) {
        if wanted.is_empty() {
            self.ranges.remove(fe);
        } else {
            self.ranges.insert(*fe, wanted.to_vec());
        }
    }

    pub(super) fn remove_ranges(
        &mut self,
        fe: &Frontend<A>,
        ranges: &[(IpAddr, u8)],
    ) -> anyhow::Result<()> {
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
}
