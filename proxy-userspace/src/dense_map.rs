//! A hash map that keeps its entries in one vector and only their positions in its hash table.
//!
//! A `HashMap` keeps each entry in a bucket of its table, a power of two between 7/16 and 7/8
//! full: 30k entries take 65,536 buckets, so more than half the entry-sized buckets stand empty.
//! The agent's largest tables (the tracker's Services and slices, the map writer's frontends
//! and ports) hold one entry a Service or Service port, of 40 to 64 bytes. Here a slot of the
//! table costs 5 bytes, the table is sized to its entries rather than to a power of two (see
//! [`Positions`]), and the entries' vector grows by a quarter at a time. A lookup follows one more
//! pointer. A removal moves the last entry into its place: the order is not kept (nothing that
//! uses this map relies on one).
use std::{
    borrow::Borrow,
    fmt,
    hash::{BuildHasher, Hash},
    ops::Index,
};

use foldhash::fast::RandomState;

pub struct DenseMap<K, V> {
    entries: Vec<(K, V)>,
    /// Each entry's position in `entries`.
    index: Positions,
    hasher: RandomState,
}

impl<K, V> Default for DenseMap<K, V> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
            index: Positions::default(),
            hasher: RandomState::default(),
        }
    }
}

/// The positions of a [`DenseMap`]'s entries by their keys' hashes: open addressing, a key's
/// position in the first free slot from the one its hash picks (linear probing), the table at
/// most four fifths full and of any size. A removal shifts back the positions after it that
/// would no longer be found, so no tombstones build up. Beside each position, a byte of its
/// key's hash spares most key comparisons. (hashbrown's tables are a power of two in size:
/// 65,536 slots for 30k entries, here 37,501.)
#[derive(Default)]
struct Positions {
    /// [`FREE`] or an entry's position.
    slots: Box<[u32]>,
    /// The low byte of the hash of the key at each slot's position (the high bits pick the
    /// slot, so neighbours share them).
    tags: Box<[u8]>,
    len: usize,
}

/// A slot that holds no position.
const FREE: u32 = u32::MAX;

impl Positions {
    /// The slots `len` positions need: four fifths of them used at most.
    fn slots_for(len: usize) -> usize {
        len + len / 4 + 1
    }

    /// The slot where the probe for `hash` starts.
    fn home(&self, hash: u64) -> usize {
        ((u128::from(hash) * self.slots.len() as u128) >> 64) as usize
    }

    fn next(&self, slot: usize) -> usize {
        if slot + 1 == self.slots.len() {
            0
        } else {
            slot + 1
        }
    }

    /// The slot of the position of a key hashing to `hash` that `is_key` accepts.
    fn find(&self, hash: u64, mut is_key: impl FnMut(u32) -> bool) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let tag = hash as u8;
        let mut slot = self.home(hash);
        loop {
            match self.slots[slot] {
                FREE => return None,
                position if self.tags[slot] == tag && is_key(position) => return Some(slot),
                _ => slot = self.next(slot),
            }
        }
    }

    /// Adds `position`, of a key hashing to `hash` that is not in the index. When the table is
    /// full it is made a quarter larger than it needs to be, `rehash` giving each position's hash.
    fn insert(&mut self, hash: u64, position: u32, rehash: impl Fn(u32) -> u64) {
        if Self::slots_for(self.len + 1) > self.slots.len() {
            let len = self.len + 1;
            self.resize(Self::slots_for(len + len / 4 + 8), rehash);
        }
        self.place(hash, position);
        self.len += 1;
    }

    fn place(&mut self, hash: u64, position: u32) {
        let mut slot = self.home(hash);
        while self.slots[slot] != FREE {
            slot = self.next(slot);
        }
        self.slots[slot] = position;
        self.tags[slot] = hash as u8;
    }

    /// Rebuilds the table with `size` slots.
    fn resize(&mut self, size: usize, rehash: impl Fn(u32) -> u64) {
        let old = std::mem::replace(&mut self.slots, vec![FREE; size].into());
        self.tags = vec![0; size].into();
        for position in old.iter().copied().filter(|&p| p != FREE) {
            self.place(rehash(position), position);
        }
    }

    /// Frees slot `hole`, then moves back into it each following position whose probe starts
    /// at or before the hole (it would stop there and miss it), up to the next free slot.
    fn remove(&mut self, mut hole: usize, rehash: impl Fn(u32) -> u64) {
        self.slots[hole] = FREE;
        self.len -= 1;
        let size = self.slots.len();
        let mut slot = self.next(hole);
        while self.slots[slot] != FREE {
            let home = self.home(rehash(self.slots[slot]));
            // Distances walked back from `slot`, around the end of the table.
            if (slot + size - home) % size >= (slot + size - hole) % size {
                self.slots[hole] = self.slots[slot];
                self.tags[hole] = self.tags[slot];
                self.slots[slot] = FREE;
                hole = slot;
            }
            slot = self.next(slot);
        }
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

impl<K: Hash + Eq, V> DenseMap<K, V> {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The slot of the table that holds `key`'s position, with `key`'s hash.
    fn find_slot<Q>(&self, key: &Q) -> (u64, Option<usize>)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hasher.hash_one(key);
        let entries = &self.entries;
        let found = self
            .index
            .find(hash, |i| entries[i as usize].0.borrow() == key);
        (hash, found)
    }

    /// The position of `key`'s entry, with `key`'s hash.
    fn find<Q>(&self, key: &Q) -> (u64, Option<usize>)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (hash, slot) = self.find_slot(key);
        (hash, slot.map(|slot| self.index.slots[slot] as usize))
    }

    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (_, i) = self.find(key);
        i.map(|i| &self.entries[i].1)
    }

    pub fn get_mut<Q>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (_, i) = self.find(key);
        i.map(|i| &mut self.entries[i].1)
    }

    pub fn contains_key<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.find(key).1.is_some()
    }

    /// Sets `key`'s value; returns the one it replaced.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        match self.find(&key) {
            (_, Some(i)) => Some(std::mem::replace(&mut self.entries[i].1, value)),
            (hash, None) => {
                self.push(hash, key, value);
                None
            }
        }
    }

    /// `key`'s value, inserted from `make` if it had none.
    pub fn get_or_insert_with(&mut self, key: K, make: impl FnOnce() -> V) -> &mut V {
        self.entry_or_insert_with(key, make).1
    }

    /// [`DenseMap::get_or_insert_with`], with the key the map holds (which may be an equal key
    /// inserted before `key`).
    pub fn entry_or_insert_with(&mut self, key: K, make: impl FnOnce() -> V) -> (&K, &mut V) {
        let i = match self.find(&key) {
            (_, Some(i)) => i,
            (hash, None) => self.push(hash, key, make()),
        };
        let (key, value) = &mut self.entries[i];
        (key, value)
    }

    /// Adds an entry whose key is not in the map yet; returns its position.
    fn push(&mut self, hash: u64, key: K, value: V) -> usize {
        let i = self.entries.len();
        if i == self.entries.capacity() {
            // A quarter more, where a `Vec` would double.
            self.entries.reserve_exact(i / 4 + 4);
        }
        let (entries, hasher) = (&self.entries, &self.hasher);
        let position = u32::try_from(i)
            .ok()
            .filter(|&p| p != FREE)
            .expect("fewer than 2^32 - 1 entries");
        self.index
            .insert(hash, position, |j| hasher.hash_one(&entries[j as usize].0));
        self.entries.push((key, value));
        i
    }

    pub fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let slot = self.find_slot(key).1?;
        let i = self.index.slots[slot] as usize;
        let (entries, hasher) = (&self.entries, &self.hasher);
        (self.index).remove(slot, |j| hasher.hash_one(&entries[j as usize].0));
        let last = self.entries.len() - 1;
        if i != last {
            // The last entry moves to `i`.
            let moved = self.hasher.hash_one(&self.entries[last].0);
            let slot = (self.index)
                .find(moved, |j| j as usize == last)
                .expect("every entry is indexed");
            self.index.slots[slot] = i as u32;
        }
        Some(self.entries.swap_remove(i).1)
    }

    pub fn clear(&mut self) {
        self.entries.clear();
        self.index.clear();
    }

    /// Drops the growth room of the entries and of the table (up to a quarter of each), after
    /// a bulk load: the next insert grows them again. A map with no room to drop is left as it
    /// is (the map writer calls this at every full sync).
    pub fn shrink_to_fit(&mut self) {
        self.entries.shrink_to_fit();
        let (entries, hasher) = (&self.entries, &self.hasher);
        let size = Positions::slots_for(entries.len());
        if self.index.slots.len() > size {
            (self.index).resize(size, |j| hasher.hash_one(&entries[j as usize].0));
        }
    }

    /// Entries it has room for beyond those it holds.
    #[cfg(test)]
    pub(crate) fn spare_room(&self) -> usize {
        self.entries.capacity() - self.entries.len()
    }
}

impl<K, V> DenseMap<K, V> {
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.entries.iter().map(|(k, v)| (k, v))
    }

    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.entries.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.entries.iter().map(|(_, v)| v)
    }
}

impl<K: Hash + Eq + Borrow<Q>, Q: Hash + Eq + ?Sized, V> Index<&Q> for DenseMap<K, V> {
    type Output = V;

    /// Panics when `key` is not in the map, as a `HashMap` does.
    fn index(&self, key: &Q) -> &V {
        self.get(key).expect("a key in the map")
    }
}

impl<'a, K, V> IntoIterator for &'a DenseMap<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = std::iter::Map<std::slice::Iter<'a, (K, V)>, fn(&'a (K, V)) -> (&'a K, &'a V)>;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.iter().map(|(k, v)| (k, v))
    }
}

impl<K: Hash + Eq, V> Extend<(K, V)> for DenseMap<K, V> {
    fn extend<I: IntoIterator<Item = (K, V)>>(&mut self, entries: I) {
        for (k, v) in entries {
            self.insert(k, v);
        }
    }
}

impl<K: Hash + Eq, V> FromIterator<(K, V)> for DenseMap<K, V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(entries: I) -> Self {
        let mut map = Self::default();
        map.extend(entries);
        map
    }
}

impl<K: fmt::Debug, V: fmt::Debug> fmt::Debug for DenseMap<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// Random inserts, replacements and removals, with a `HashMap` as the oracle: after each
    /// step both hold the same entries, and every key is found where it is.
    #[test]
    fn holds_what_a_hash_map_holds() {
        let mut dense = DenseMap::default();
        let mut oracle = HashMap::new();
        // A small key range, so that keys come back after their removal.
        let mut random = 0x2545_f491_4f6c_dd1d_u64;
        for step in 0..20_000u32 {
            random ^= random << 13;
            random ^= random >> 7;
            random ^= random << 17;
            let key = format!("k{}", random % 3000);
            match random >> 60 {
                0..6 => assert_eq!(dense.insert(key.clone(), step), oracle.insert(key, step)),
                6..8 => {
                    let made = *dense.get_or_insert_with(key.clone(), || step);
                    assert_eq!(made, *oracle.entry(key).or_insert(step));
                }
                _ => assert_eq!(dense.remove(key.as_str()), oracle.remove(&key)),
            }
            assert_eq!(dense.len(), oracle.len());
        }
        for (k, v) in dense.iter() {
            assert_eq!(oracle.get(k), Some(v));
        }
        for (k, v) in &oracle {
            assert_eq!(dense.get(k.as_str()), Some(v));
            assert!(dense.contains_key(k.as_str()));
        }
        assert_eq!(dense.get("absent"), None);
        dense.clear();
        assert!(dense.is_empty() && dense.get("k1").is_none());
    }

    /// 30k entries of 64 bytes take under two thirds of the memory of a `HashMap`'s table.
    #[test]
    fn room_grows_by_a_quarter() {
        let dense: DenseMap<u64, [u64; 7]> = (0..30_000).map(|i| (i, [i; 7])).collect();
        let hash_map: HashMap<u64, [u64; 7]> = (0..30_000).map(|i| (i, [i; 7])).collect();
        let room = dense.entries.capacity();
        assert!(room < 30_000 * 5 / 4, "{room}");
        // A table's buckets (7/8 of which it fills at most) hold an entry, or a position, and
        // a control byte each.
        let buckets = |capacity: usize| capacity / 7 * 8;
        let dense_bytes = room * 64 + dense.index.slots.len() * 5;
        let table_bytes = buckets(hash_map.capacity()) * 65;
        assert!(
            dense_bytes * 3 < table_bytes * 2,
            "{dense_bytes} {table_bytes}"
        );
        assert!((0..30_000).all(|i| dense.get(&i) == Some(&[i; 7])));
    }

    /// At the table's fullest (four fifths, after `shrink_to_fit`), a key removed and another
    /// added at each step, long runs of taken slots wrapping around the table's end: every key
    /// is still found, and none that is gone.
    #[test]
    fn a_full_table_finds_every_key_through_removals() {
        let mut dense: DenseMap<u64, u64> = (0..1000).map(|k| (k, k)).collect();
        dense.shrink_to_fit();
        assert_eq!(dense.index.slots.len(), 1251);
        let mut present: Vec<u64> = (0..1000).collect();
        let mut random = 0x9e37_79b9_7f4a_7c15_u64;
        for step in 0..20_000u64 {
            random ^= random << 13;
            random ^= random >> 7;
            random ^= random << 17;
            let gone = present.swap_remove((random % 1000) as usize);
            assert_eq!(dense.remove(&gone), Some(gone));
            assert_eq!(dense.get(&gone), None);
            let new = 1000 + step;
            dense.insert(new, new);
            present.push(new);
            if step % 1000 == 0 {
                assert!(present.iter().all(|k| dense.get(k) == Some(k)));
            }
        }
        assert_eq!(
            dense.index.slots.len(),
            1251,
            "no growth at a constant size"
        );
        assert!(present.iter().all(|k| dense.get(k) == Some(k)));
        assert_eq!(dense.len(), 1000);
    }

    #[test]
    fn a_bulk_load_s_growth_room_can_be_dropped() {
        let mut dense: DenseMap<u32, u32> = (0..30_000).map(|i| (i, i)).collect();
        assert!(dense.entries.capacity() > 30_000 * 11 / 10);
        dense.shrink_to_fit();
        assert_eq!(dense.entries.capacity(), 30_000);
        // 5 bytes a slot, and a slot for each entry and a quarter more: 183 KiB, where a
        // power-of-two table's 65,536 slots took 320.
        assert_eq!(dense.index.slots.len(), 37_501);
        // Nothing to drop: the table is not built again.
        let table = dense.index.slots.as_ptr();
        dense.shrink_to_fit();
        assert_eq!(dense.index.slots.as_ptr(), table);
        assert!((0..30_000).all(|i| dense.get(&i) == Some(&i)));
        dense.insert(30_000, 0);
        assert_eq!(dense.get(&30_000), Some(&0));
    }
}
