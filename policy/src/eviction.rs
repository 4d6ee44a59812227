//! The order in which unpinned snapshots are given up when a new one needs room.
//!
//! Owns the [`EvictionPolicy`] trait and its one implementation today, [`Lru`]. A policy only
//! orders keys from the use events it is told about; it never decides whether a key may be
//! evicted (pins, in-flight copies) and never frees anything — the snapshot store does both.
//!
//! Uses are stamped with the store's logical clock rather than observed in call order, so a
//! snapshot that moves between tiers keeps its true place: recency is by last use (seed 002),
//! and a demotion is not a use.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Debug;
use std::hash::Hash;

use serde::{Deserialize, Serialize};

/// An order over keys, fed with use events, that names the next victim first.
pub trait EvictionPolicy<K>: Send + Debug {
    /// Adds `key`, last used at `last_use` on the caller's clock. Re-adding a key moves it.
    fn insert(&mut self, key: K, last_use: u64);
    /// Records a use of `key` at `now`; unknown keys are ignored.
    fn touch(&mut self, key: &K, now: u64);
    /// Forgets `key`; unknown keys are ignored.
    fn remove(&mut self, key: &K);
    /// Every key, the first to evict first.
    fn candidates(&self) -> Box<dyn Iterator<Item = &K> + '_>;
    /// Number of keys held.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The eviction policy a configuration names (`snapshots.eviction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictionKind {
    /// Least recently used first.
    #[default]
    Lru,
}

impl EvictionKind {
    /// A fresh, empty policy of this kind.
    pub fn build<K>(self) -> Box<dyn EvictionPolicy<K>>
    where
        K: Ord + Hash + Clone + Send + Debug + 'static,
    {
        match self {
            EvictionKind::Lru => Box::new(Lru::new()),
        }
    }
}

/// Least-recently-used order: the key with the oldest last use goes first; equal stamps fall
/// back to key order, so the order is deterministic.
///
/// Cost: `insert`, `touch` and `remove` are O(log n); the first candidate is O(log n).
#[derive(Debug, Clone, Default)]
pub struct Lru<K> {
    by_use: BTreeSet<(u64, K)>,
    last_use: HashMap<K, u64>,
}

impl<K: Ord + Hash + Clone> Lru<K> {
    pub fn new() -> Self {
        Lru {
            by_use: BTreeSet::new(),
            last_use: HashMap::new(),
        }
    }
}

impl<K: Ord + Hash + Clone + Send + Debug> EvictionPolicy<K> for Lru<K> {
    fn insert(&mut self, key: K, last_use: u64) {
        if let Some(old) = self.last_use.insert(key.clone(), last_use) {
            self.by_use.remove(&(old, key.clone()));
        }
        self.by_use.insert((last_use, key));
    }

    fn touch(&mut self, key: &K, now: u64) {
        if self.last_use.contains_key(key) {
            self.insert(key.clone(), now);
        }
    }

    fn remove(&mut self, key: &K) {
        if let Some(old) = self.last_use.remove(key) {
            self.by_use.remove(&(old, key.clone()));
        }
    }

    fn candidates(&self) -> Box<dyn Iterator<Item = &K> + '_> {
        Box::new(self.by_use.iter().map(|(_, key)| key))
    }

    fn len(&self) -> usize {
        self.last_use.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(policy: &dyn EvictionPolicy<u32>) -> Vec<u32> {
        policy.candidates().copied().collect()
    }

    #[test]
    fn lru_evicts_oldest_last_use_first() {
        let mut lru = EvictionKind::Lru.build::<u32>();
        lru.insert(1, 10);
        lru.insert(2, 11);
        lru.insert(3, 12);
        lru.touch(&1, 13);
        assert_eq!(order(lru.as_ref()), vec![2, 3, 1]);
    }

    #[test]
    fn lru_places_a_key_by_its_stamp_not_by_when_it_arrived() {
        let mut lru = Lru::new();
        lru.insert(1, 20);
        lru.insert(2, 5);
        assert_eq!(order(&lru), vec![2, 1]);
    }

    #[test]
    fn lru_ignores_unknown_keys_and_forgets_removed_ones() {
        let mut lru = Lru::new();
        lru.insert(1, 1);
        lru.insert(2, 2);
        lru.touch(&9, 3);
        lru.remove(&9);
        lru.remove(&1);
        assert_eq!(order(&lru), vec![2]);
        assert_eq!(lru.len(), 1);
        lru.insert(2, 7);
        assert_eq!(lru.len(), 1);
        assert_eq!(order(&lru), vec![2]);
    }

    #[test]
    fn lru_breaks_equal_stamps_by_key() {
        let mut lru = Lru::new();
        lru.insert(5, 1);
        lru.insert(3, 1);
        assert_eq!(order(&lru), vec![3, 5]);
    }
}
