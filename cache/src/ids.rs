//! The identifiers that cross actor boundaries: slots, their generations, snapshots and the
//! buffers that back them.
//!
//! Owns only the newtypes and their formatting; it never allocates an id (the pool allocates
//! slot generations, the store allocates snapshot and backing ids).

use std::fmt;

/// Index of one slot of the working pool. Reused: only a [`SlotHandle`] names a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotId(pub u32);

impl SlotId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// How many times a slot has been handed out. 64 bits so that it never wraps in practice and a
/// stale handle can never match again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Generation(pub u64);

impl Generation {
    pub fn next(self) -> Generation {
        Generation(self.0 + 1)
    }
}

/// One sequence's claim on a slot: valid only while the slot's generation still matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotHandle {
    pub slot: SlotId,
    pub generation: Generation,
}

impl fmt::Display for SlotHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "slot {} generation {}", self.slot.0, self.generation.0)
    }
}

/// A snapshot in the store. Never reused within one store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SnapshotId(pub u64);

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "snapshot {}", self.0)
    }
}

/// The buffer holding one snapshot's bytes. The store hands it out; the engine maps it to a
/// device, host or disk allocation it owns. Never reused within one store, so a late copy can
/// never land in someone else's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BackingId(pub u64);

impl fmt::Display for BackingId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "backing {}", self.0)
    }
}
