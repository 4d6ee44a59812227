//! The logits after whole prompts that repeat, so a repeat's first token needs no forward pass.
//!
//! A snapshot holds a prompt's KV page by page, but its first token also needs the logits
//! after the prompt's last token, which the KV does not give without running that token (a
//! forward pass that reads every weight: ~4 ms on an 8B model whatever the prompt). This keeps
//! those logits for prompts seen more than once, keyed by [`crate::PrefixHasher::whole`]: a
//! request whose prompt is here and whose full pages restore takes its first token from them,
//! and computes its prompt's partial last page with its second token instead of before its
//! first (one forward pass fewer, and no forward pass at all before the first token).
//!
//! Rows are charged by their bytes (`4 × vocabulary` each) against their own budget, the
//! least recently used dropped first; they hold no KV, so losing one only costs the forward
//! pass it would have saved.

use std::sync::Arc;

use lru::LruCache;

use crate::PrefixHash;

/// A byte-budgeted, least-recently-used map of whole-prompt keys to their logits (unbounded in
/// rows, bounded in bytes).
#[derive(Debug)]
pub struct PromptLogits {
    rows: LruCache<PrefixHash, Arc<[f32]>>,
    budget_bytes: u64,
    held_bytes: u64,
    counters: PromptLogitsStats,
}

/// What the map did since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptLogitsStats {
    /// Rows kept, and rows dropped to make room for newer ones.
    pub kept: u64,
    pub dropped: u64,
    /// Lookups that found a row.
    pub hits: u64,
    pub rows: usize,
    pub bytes: u64,
}

impl PromptLogits {
    /// Holds at most `budget_bytes` of logits; 0 keeps nothing.
    pub fn new(budget_bytes: u64) -> Self {
        PromptLogits {
            rows: LruCache::unbounded(),
            budget_bytes,
            held_bytes: 0,
            counters: PromptLogitsStats::default(),
        }
    }

    /// Whether a row of `vocab` logits can be kept at all.
    pub fn keeps(&self, vocab: usize) -> bool {
        row_bytes(vocab) <= self.budget_bytes
    }

    /// Keeps `logits` under `key`, dropping the least recently used rows until it fits;
    /// refused (nothing dropped) when one row is larger than the whole budget.
    pub fn insert(&mut self, key: PrefixHash, logits: Arc<[f32]>) -> bool {
        let bytes = row_bytes(logits.len());
        if bytes > self.budget_bytes {
            return false;
        }
        if let Some(old) = self.rows.pop(&key) {
            self.held_bytes -= row_bytes(old.len());
        }
        while self.held_bytes + bytes > self.budget_bytes {
            let (_, old) = self
                .rows
                .pop_lru()
                .expect("held bytes above zero mean a row is held");
            self.held_bytes -= row_bytes(old.len());
            self.counters.dropped += 1;
        }
        self.rows.put(key, logits);
        self.held_bytes += bytes;
        self.counters.kept += 1;
        true
    }

    /// The row kept under `key`, now the most recently used.
    pub fn get(&mut self, key: &PrefixHash) -> Option<Arc<[f32]>> {
        let row = self.rows.get(key).cloned();
        self.counters.hits += row.is_some() as u64;
        row
    }

    /// Whether a row is kept under `key`, without using it.
    pub fn contains(&self, key: &PrefixHash) -> bool {
        self.rows.contains(key)
    }

    pub fn stats(&self) -> PromptLogitsStats {
        PromptLogitsStats {
            rows: self.rows.len(),
            bytes: self.held_bytes,
            ..self.counters
        }
    }
}

fn row_bytes(vocab: usize) -> u64 {
    (vocab * std::mem::size_of::<f32>()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(value: f32, vocab: usize) -> Arc<[f32]> {
        vec![value; vocab].into()
    }

    #[test]
    fn rows_beyond_the_budget_drop_the_least_recently_used() {
        let mut kept = PromptLogits::new(3 * 40);
        for k in 0..3 {
            assert!(kept.insert(PrefixHash(k), row(k as f32, 10)));
        }
        assert!(
            kept.get(&PrefixHash(0)).is_some(),
            "0 is now the most recent"
        );
        assert!(kept.insert(PrefixHash(3), row(3.0, 10)));
        assert!(!kept.contains(&PrefixHash(1)), "1 was the least recent");
        assert!(kept.contains(&PrefixHash(0)));
        let stats = kept.stats();
        assert_eq!((stats.rows, stats.bytes, stats.dropped), (3, 120, 1));
        assert_eq!(kept.get(&PrefixHash(3)).unwrap()[0], 3.0);
    }

    #[test]
    fn a_row_larger_than_the_budget_is_refused_without_dropping_others() {
        let mut kept = PromptLogits::new(100);
        assert!(kept.insert(PrefixHash(1), row(1.0, 20)));
        assert!(!kept.keeps(26));
        assert!(!kept.insert(PrefixHash(2), row(2.0, 26)));
        assert!(kept.contains(&PrefixHash(1)));
        assert!(
            !PromptLogits::new(0).keeps(1),
            "a budget of 0 keeps nothing"
        );
    }

    #[test]
    fn keeping_a_key_again_replaces_its_row_and_its_charge() {
        let mut kept = PromptLogits::new(80);
        assert!(kept.insert(PrefixHash(1), row(1.0, 10)));
        assert!(kept.insert(PrefixHash(1), row(2.0, 20)));
        assert_eq!(kept.stats().bytes, 80);
        assert_eq!(kept.stats().dropped, 0);
        assert_eq!(kept.get(&PrefixHash(1)).unwrap().len(), 20);
    }
}
