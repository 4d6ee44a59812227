//! The snapshot store's prefix index: which snapshot covers which page-aligned prefix.
//!
//! Owns the maps below and the longest-prefix search over them. It never decides whether a
//! snapshot may be used (the store passes that in) and never touches recency or budgets.
//!
//! - `by_end`: every snapshot, in any state, by the hash of its last page; one per prefix, so a
//!   second save of the same prefix is recognised. A hit here is the proof of a match: a chain
//!   hash names its whole prefix.
//! - `boundaries`: every [`STRIDE_PAGES`]-th page boundary of every published snapshot, with
//!   the snapshots that pass through it (`via`, for restoring part of a longer snapshot), its
//!   parent boundary (so a snapshot is unindexed from
//!   its end alone), and how many published snapshots end at each of the next `STRIDE_PAGES`
//!   lengths with this as their deepest boundary (`ends`; `root_ends` for snapshots shorter
//!   than one stride).
//! - `firsts`: every published snapshot by the hash of its first page, for heads shorter than
//!   one stride.
//!
//! Lookup: the boundaries along a query are indexed up to some stride and not after (the set
//! is closed under prefixes), so a binary search finds the deepest shared stride. From there,
//! stride by stride towards the root, `ends` names the only lengths worth probing in `by_end`;
//! the first probe that lands is the longest match.
//!
//! Costs, for a query of n pages and a snapshot of p pages: lookup is O(log(n / STRIDE_PAGES))
//! probes, then one per stride walked back plus one per recorded end length probed, so at
//! worst O(n / STRIDE_PAGES) and usually a handful; publishing or unindexing is
//! O(p / STRIDE_PAGES). Indexing every page instead made a save that evicts a 64-page snapshot
//! among 10,000 cost 16 µs (a cache miss per page boundary); the stride brings it under 2 µs.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

use crate::ids::SnapshotId;
use crate::prefix::PrefixHash;

/// A map keyed by an integer newtype (`u64` ids, `u128` prefix hashes). Prefix hashes are
/// already uniform and snapshot ids are sequential, so a multiply per word spreads both; SipHash's resistance to chosen keys buys nothing.
pub(crate) type U64Map<K, V> = HashMap<K, V, BuildHasherDefault<U64Hasher>>;
pub(crate) type U64Set<K> = HashSet<K, BuildHasherDefault<U64Hasher>>;

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct U64Hasher(u64);

impl Hasher for U64Hasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = (self.0.rotate_left(5) ^ value).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_u128(&mut self, value: u128) {
        self.write_u64(value as u64);
        self.write_u64((value >> 64) as u64);
    }
}

/// Pages between indexed boundaries.
pub(crate) const STRIDE_PAGES: usize = 16;

#[derive(Debug, Clone)]
struct Boundary {
    parent: Option<PrefixHash>,
    /// The published snapshots that pass through it (a set: a popular head has thousands, and
    /// unpublishing one must not scan them).
    via: U64Set<SnapshotId>,
    /// `ends[o]`: published snapshots of `depth + o` pages whose deepest boundary this is.
    ends: [u32; STRIDE_PAGES],
}

#[derive(Debug, Clone, Copy)]
struct End {
    snapshot: SnapshotId,
    /// The last boundary `publish` indexed for this snapshot, where `unpublish` starts.
    deepest_boundary: Option<PrefixHash>,
}

#[derive(Debug)]
pub(crate) struct PrefixIndex {
    by_end: U64Map<PrefixHash, End>,
    boundaries: U64Map<PrefixHash, Boundary>,
    /// `root_ends[o]`: published snapshots of `o` pages (shorter than one stride).
    root_ends: [u32; STRIDE_PAGES],
    /// Published snapshots by their first page.
    firsts: U64Map<PrefixHash, U64Set<SnapshotId>>,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        PrefixIndex {
            by_end: U64Map::default(),
            boundaries: U64Map::default(),
            root_ends: [0; STRIDE_PAGES],
            firsts: U64Map::default(),
        }
    }
}

/// The hashes of the boundaries the index records for `chain`: every `STRIDE_PAGES`-th page.
pub(crate) fn strided(chain: &[PrefixHash]) -> Box<[PrefixHash]> {
    chain
        .iter()
        .skip(STRIDE_PAGES - 1)
        .step_by(STRIDE_PAGES)
        .copied()
        .collect()
}

impl PrefixIndex {
    /// The snapshot, in any state, whose prefix ends with `end`.
    pub(crate) fn ending_at(&self, end: PrefixHash) -> Option<SnapshotId> {
        self.by_end.get(&end).map(|entry| entry.snapshot)
    }

    /// Records that `id` is the snapshot of the prefix ending with `end` (not yet findable).
    pub(crate) fn claim(&mut self, end: PrefixHash, id: SnapshotId) {
        let previous = self.by_end.insert(
            end,
            End {
                snapshot: id,
                deepest_boundary: None,
            },
        );
        debug_assert!(previous.is_none(), "one snapshot per prefix");
    }

    pub(crate) fn unclaim(&mut self, end: PrefixHash) {
        self.by_end.remove(&end);
    }

    /// Makes the claimed snapshot of `pages` pages from `first` to `end` findable;
    /// `boundaries` is `strided` of its chain.
    pub(crate) fn publish(
        &mut self,
        first: PrefixHash,
        end: PrefixHash,
        pages: usize,
        boundaries: &[PrefixHash],
    ) {
        let id = self.by_end[&end].snapshot;
        self.firsts.entry(first).or_default().insert(id);
        let mut parent = None;
        for &hash in boundaries {
            let fresh = Boundary {
                parent,
                via: U64Set::default(),
                ends: [0; STRIDE_PAGES],
            };
            self.boundaries.entry(hash).or_insert(fresh).via.insert(id);
            parent = Some(hash);
        }
        self.ends_after(parent)
            .expect("the deepest boundary was just indexed")[pages % STRIDE_PAGES] += 1;
        self.by_end
            .get_mut(&end)
            .expect("a snapshot is claimed before it is published")
            .deepest_boundary = parent;
    }

    /// Reverses `publish` for the snapshot of `pages` pages from `first` to `end`, and
    /// unclaims it.
    pub(crate) fn unpublish(&mut self, first: PrefixHash, end: PrefixHash, pages: usize) {
        let End {
            snapshot: id,
            deepest_boundary: deepest,
        } = *self
            .by_end
            .get(&end)
            .expect("a published snapshot is claimed");
        let starting = self
            .firsts
            .get_mut(&first)
            .expect("a published snapshot is listed by its first page");
        starting.remove(&id);
        if starting.is_empty() {
            self.firsts.remove(&first);
        }
        self.ends_after(deepest)
            .expect("a published snapshot's boundaries are indexed")[pages % STRIDE_PAGES] -= 1;
        let mut next = deepest;
        while let Some(hash) = next {
            let boundary = self.boundaries.get_mut(&hash).expect(
                "every boundary of a published snapshot is indexed until it is unpublished",
            );
            let listed = boundary.via.remove(&id);
            debug_assert!(
                listed,
                "a published snapshot is listed at each of its boundaries"
            );
            next = boundary.parent;
            if boundary.via.is_empty() {
                self.boundaries.remove(&hash);
            }
        }
        self.unclaim(end);
    }

    /// The end counts kept under `boundary` (the root's for `None`). A snapshot of `pages`
    /// pages has its deepest boundary at `pages - pages % STRIDE_PAGES`, so it is counted at
    /// offset `pages % STRIDE_PAGES`.
    fn ends_after(&mut self, boundary: Option<PrefixHash>) -> Option<&mut [u32; STRIDE_PAGES]> {
        match boundary {
            None => Some(&mut self.root_ends),
            Some(hash) => Some(&mut self.boundaries.get_mut(&hash)?.ends),
        }
    }

    /// The published snapshot covering the longest prefix of `query` that `usable` accepts;
    /// `usable` gets the snapshot and the pages it would cover.
    pub(crate) fn longest(
        &self,
        query: &[PrefixHash],
        usable: impl Fn(SnapshotId, usize) -> bool,
    ) -> Option<SnapshotId> {
        (0..=self.shared_strides(query)).rev().find_map(|stride| {
            let ends = match stride {
                0 => &self.root_ends,
                _ => &self.boundaries.get(&query[stride * STRIDE_PAGES - 1])?.ends,
            };
            let lengths = (0..STRIDE_PAGES).rev().filter(|&offset| ends[offset] > 0);
            lengths
                .map(|offset| stride * STRIDE_PAGES + offset)
                .filter(|&pages| pages <= query.len())
                .find_map(|pages| {
                    let id = self.ending_at(query[pages - 1])?;
                    usable(id, pages).then_some(id)
                })
        })
    }

    /// The stride boundaries of `query` that published snapshots pass through, deepest first,
    /// each with its depth in strides and those snapshots: each shares at least that many
    /// strides of pages with `query`, and none from a shallower boundary shares more than the
    /// next stride. Last, at depth 0, the snapshots that share `query`'s first page.
    pub(crate) fn shared_heads<'a>(
        &'a self,
        query: &'a [PrefixHash],
    ) -> impl Iterator<Item = (usize, &'a U64Set<SnapshotId>)> + 'a {
        let strided = (1..=self.shared_strides(query)).rev().map(move |strides| {
            let boundary = &self.boundaries[&query[strides * STRIDE_PAGES - 1]];
            (strides, &boundary.via)
        });
        let first = query
            .first()
            .and_then(|first| self.firsts.get(first))
            .map(|starting| (0, starting));
        strided.chain(first)
    }

    /// How many whole strides of `query` some published snapshot shares: boundary `k` (at page
    /// `k * STRIDE_PAGES`) is indexed for every `k` up to the answer and for none after.
    fn shared_strides(&self, query: &[PrefixHash]) -> usize {
        let indexed = |k: usize| self.boundaries.contains_key(&query[k * STRIDE_PAGES - 1]);
        let (mut shared, mut unshared) = (0, query.len() / STRIDE_PAGES + 1);
        while unshared - shared > 1 {
            let mid = (shared + unshared) / 2;
            if indexed(mid) {
                shared = mid
            } else {
                unshared = mid
            }
        }
        shared
    }

    /// Entries in `by_end`, `boundaries` and `firsts`, and root ends, to check that nothing
    /// leaks.
    #[cfg(test)]
    pub(crate) fn sizes(&self) -> (usize, usize, u32) {
        (
            self.by_end.len(),
            self.boundaries.len() + self.firsts.len(),
            self.root_ends.iter().sum(),
        )
    }
}
