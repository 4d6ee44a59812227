//! How many lookups have shown each prompt prefix, for the save policy: a prompt's prefix is
//! worth a snapshot once `save_after_sightings` requests have shown it, so traffic whose
//! prompts never repeat costs an entry here per prompt, not a copy of its KV.
//!
//! Owns a bounded map from chain hash to sighting count, the least recently seen forgotten
//! first. A lookup records the end of its chain and every [`STRIDE_PAGES`]-th page boundary
//! along it, the places the index can restore from: a repeated prompt is seen at its end, a
//! shared opening (a system prompt, a document asked several questions) at the boundaries its
//! requests share. It never decides anything itself; the store asks it how much of a chain has
//! been seen often enough.
//!
//! Costs: O(n / STRIDE_PAGES) map operations to record or to ask about an n-page chain.

use std::hash::BuildHasherDefault;
use std::num::NonZeroUsize;

use lru::LruCache;

use super::index::{STRIDE_PAGES, U64Hasher};
use crate::prefix::PrefixHash;

/// Prefixes remembered: 4 MB or so, the prompts of a busy hour.
const CAPACITY: usize = 1 << 16;

#[derive(Debug)]
pub(crate) struct Sightings {
    counts: LruCache<PrefixHash, u32, BuildHasherDefault<U64Hasher>>,
}

impl Default for Sightings {
    fn default() -> Self {
        Sightings::with_capacity(CAPACITY)
    }
}

/// The page counts at which a chain of `pages` pages is recorded: each stride boundary, and
/// its end.
fn recorded_lengths(pages: usize) -> impl DoubleEndedIterator<Item = usize> {
    let boundaries = (STRIDE_PAGES..pages).step_by(STRIDE_PAGES);
    boundaries.chain((pages > 0).then_some(pages))
}

impl Sightings {
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        let capacity = NonZeroUsize::new(capacity).expect("a capacity of at least one");
        Sightings {
            counts: LruCache::with_hasher(capacity, BuildHasherDefault::default()),
        }
    }

    /// One more request has shown `chain`.
    pub(crate) fn record(&mut self, chain: &[PrefixHash]) {
        for pages in recorded_lengths(chain.len()) {
            let count = self.counts.get_or_insert_mut(chain[pages - 1], || 0);
            *count = count.saturating_add(1);
        }
    }

    /// The longest recorded prefix of `chain`, in pages, that `at_least` requests have shown;
    /// 0 when none has.
    pub(crate) fn seen_pages(&self, chain: &[PrefixHash], at_least: u32) -> usize {
        recorded_lengths(chain.len())
            .rev()
            .find(|&pages| {
                self.counts
                    .peek(&chain[pages - 1])
                    .is_some_and(|&count| count >= at_least)
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(seed: u64, pages: usize) -> Vec<PrefixHash> {
        (0..pages as u64)
            .map(|p| PrefixHash(u128::from(seed << 32 | p)))
            .collect()
    }

    #[test]
    fn a_repeated_prompt_is_seen_at_its_end() {
        let mut sightings = Sightings::default();
        let prompt = chain(1, 5);
        sightings.record(&prompt);
        assert_eq!(sightings.seen_pages(&prompt, 2), 0);
        assert_eq!(sightings.seen_pages(&prompt, 1), 5);
        sightings.record(&prompt);
        assert_eq!(sightings.seen_pages(&prompt, 2), 5);
        assert_eq!(
            sightings.seen_pages(&prompt[..4], 1),
            0,
            "not a recorded length"
        );
    }

    #[test]
    fn a_shared_opening_is_seen_at_the_boundaries_its_requests_share() {
        let mut sightings = Sightings::default();
        let opening = chain(7, 40);
        let mut first = opening.clone();
        first.extend(chain(8, 3));
        let mut second = opening.clone();
        second.extend(chain(9, 6));
        sightings.record(&first);
        sightings.record(&second);
        // Both passed pages 16 and 32; each ends elsewhere.
        assert_eq!(sightings.seen_pages(&second, 2), 32);
        assert_eq!(sightings.seen_pages(&second, 1), 46);
        assert_eq!(sightings.seen_pages(&second, 3), 0);
    }

    #[test]
    fn the_least_recently_seen_are_forgotten_first() {
        let mut sightings = Sightings::with_capacity(2);
        let (a, b, c) = (chain(1, 1), chain(2, 1), chain(3, 1));
        sightings.record(&a);
        sightings.record(&b);
        sightings.record(&a);
        sightings.record(&c);
        assert_eq!(sightings.seen_pages(&a, 2), 1);
        assert_eq!(sightings.seen_pages(&b, 1), 0, "b was the least recent");
        assert_eq!(sightings.seen_pages(&c, 1), 1);
        assert_eq!(sightings.seen_pages(&[], 1), 0);
    }
}
