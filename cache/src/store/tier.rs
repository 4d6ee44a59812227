//! One tier of the snapshot store: its budget, what is charged against it, and its eviction
//! order.
//!
//! Owns the budget arithmetic and the choice of victims in eviction order. It never decides
//! whether a snapshot may go (the store says which are pinned) and never frees bytes.

use std::fmt;

use policy::{EvictionKind, EvictionPolicy};

use crate::error::CacheError;
use crate::ids::SnapshotId;

/// Where a snapshot's buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Accelerator memory: restores are fastest.
    Device,
    /// Host memory (pinned where the backend can): slower restores, usually a bigger budget.
    Host,
    /// Files in a directory: kept across restarts; read back into memory (promoted) before a
    /// restore.
    Disk,
}

impl Tier {
    pub(crate) fn index(self) -> usize {
        match self {
            Tier::Device => 0,
            Tier::Host => 1,
            Tier::Disk => 2,
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        })
    }
}

/// A tier's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierStats {
    pub budget_bytes: u64,
    pub charged_bytes: u64,
    /// Snapshots charged here, published or not.
    pub snapshots: usize,
    /// Bytes of the snapshots kept here (never evicted): what the others cannot have.
    pub kept_bytes: u64,
}

#[derive(Debug)]
pub(crate) struct TierState {
    tier: Tier,
    budget_bytes: u64,
    charged_bytes: u64,
    snapshots: usize,
    /// Published snapshots only: one being saved or moved in is never a victim.
    pub(crate) order: Box<dyn EvictionPolicy<SnapshotId>>,
}

impl TierState {
    pub(crate) fn new(tier: Tier, budget_bytes: u64, eviction: EvictionKind) -> TierState {
        TierState {
            tier,
            budget_bytes,
            charged_bytes: 0,
            snapshots: 0,
            order: eviction.build(),
        }
    }

    pub(crate) fn budget_bytes(&self) -> u64 {
        self.budget_bytes
    }

    /// Bytes that can be charged without evicting anything.
    pub(crate) fn room_bytes(&self) -> u64 {
        self.budget_bytes - self.charged_bytes
    }

    pub(crate) fn charge(&mut self, bytes: u64) {
        assert!(
            bytes <= self.room_bytes(),
            "a charge is planned to fit before it is made"
        );
        self.charged_bytes += bytes;
        self.snapshots += 1;
    }

    pub(crate) fn refund(&mut self, bytes: u64) {
        self.charged_bytes -= bytes;
        self.snapshots -= 1;
    }

    /// The victims, in eviction order, whose bytes make room for `bytes`; `evictable_bytes`
    /// gives a candidate's size, or `None` when it must stay (pinned). Changes nothing: if the
    /// charge cannot fit even after every evictable snapshot goes, it is refused.
    pub(crate) fn plan_room(
        &self,
        bytes: u64,
        evictable_bytes: impl Fn(SnapshotId) -> Option<u64>,
    ) -> Result<Vec<SnapshotId>, CacheError> {
        if bytes > self.budget_bytes {
            let (tier, budget_bytes) = (self.tier, self.budget_bytes);
            return Err(CacheError::SnapshotTooLarge {
                tier,
                bytes,
                budget_bytes,
            });
        }
        let mut room = self.room_bytes();
        let mut victims = Vec::new();
        for &candidate in self.order.candidates() {
            if room >= bytes {
                break;
            }
            if let Some(freed) = evictable_bytes(candidate) {
                room += freed;
                victims.push(candidate);
            }
        }
        if room < bytes {
            let tier = self.tier;
            return Err(CacheError::OverBudget {
                tier,
                needed_bytes: bytes,
                reclaimable_bytes: room,
            });
        }
        Ok(victims)
    }

    pub(crate) fn stats(&self) -> TierStats {
        TierStats {
            budget_bytes: self.budget_bytes,
            charged_bytes: self.charged_bytes,
            snapshots: self.snapshots,
            kept_bytes: 0,
        }
    }
}
