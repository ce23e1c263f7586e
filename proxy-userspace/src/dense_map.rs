//! A hash map that keeps its entries in one vector and only their positions in its hash table.
//!
//! A `HashMap` keeps each entry in a bucket of its table, a power of two between 7/16 and 7/8
//! full: 30k entries take 65,536 buckets, so more than half the entry-sized buckets stand empty.
//! The agent's largest tables (the tracker's Services and slices, the map writer's frontends
//! and ports) hold one entry a Service or Service port, of 40 to 64 bytes. Here an empty bucket
//! costs 5 bytes, and the entries' vector grows by a quarter at a time. A lookup follows one
//! more pointer. A removal moves the last entry into its place: the order is not kept (nothing
//! that uses this map relies on one).
use std::{
    borrow::Borrow,
    fmt,
    hash::{BuildHasher, Hash},
    ops::Index,
};

use foldhash::fast::RandomState;
use hashbrown::HashTable;

pub struct DenseMap<K, V> {
    entries: Vec<(K, V)>,
    /// Each entry's position in `entries`.
    index: HashTable<u32>,
    hasher: RandomState,
}

impl<K, V> Default for DenseMap<K, V> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
            index: HashTable::new(),
            hasher: RandomState::default(),
        }
    }
}

impl<K: Hash + Eq, V> DenseMap<K, V> {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The position of `key`'s entry, with `key`'s hash.
    fn find<Q>(&self, key: &Q) -> (u64, Option<usize>)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hasher.hash_one(key);
        let entries = &self.entries;
        let found = self
            .index
            .find(hash, |&i| entries[i as usize].0.borrow() == key);
        (hash, found.map(|&i| i as usize))
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
        let position = u32::try_from(i).expect("fewer than 2^32 entries");
        self.index
            .insert_unique(hash, position, |&j| hasher.hash_one(&entries[j as usize].0));
        self.entries.push((key, value));
        i
    }

    pub fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hasher.hash_one(key);
        let entries = &self.entries;
        let found = (self.index)
            .find_entry(hash, |&i| entries[i as usize].0.borrow() == key)
            .ok()?;
        let i = found.remove().0 as usize;
        let last = self.entries.len() - 1;
        if i != last {
            // The last entry moves to `i`.
            let moved = self.hasher.hash_one(&self.entries[last].0);
            let position = (self.index)
                .find_mut(moved, |&j| j as usize == last)
                .expect("every entry is indexed");
            *position = i as u32;
        }
        Some(self.entries.swap_remove(i).1)
    }

    pub fn clear(&mut self) {
        self.entries.clear();
        self.index.clear();
    }

    /// Drops the entries' growth room (up to a quarter of them), after a bulk load: the next
    /// insert grows it again.
    pub fn shrink_to_fit(&mut self) {
        self.entries.shrink_to_fit();
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
        let dense_bytes = room * 64 + buckets(dense.index.capacity()) * 5;
        let table_bytes = buckets(hash_map.capacity()) * 65;
        assert!(
            dense_bytes * 3 < table_bytes * 2,
            "{dense_bytes} {table_bytes}"
        );
        assert!((0..30_000).all(|i| dense.get(&i) == Some(&[i; 7])));
    }

    #[test]
    fn a_bulk_load_s_growth_room_can_be_dropped() {
        let mut dense: DenseMap<u32, u32> = (0..30_000).map(|i| (i, i)).collect();
        assert!(dense.entries.capacity() > 30_000 * 11 / 10);
        dense.shrink_to_fit();
        assert_eq!(dense.entries.capacity(), 30_000);
        assert!((0..30_000).all(|i| dense.get(&i) == Some(&i)));
        dense.insert(30_000, 0);
        assert_eq!(dense.get(&30_000), Some(&0));
    }
}
