//! The budgeted snapshot store: what is saved, where, what it costs, and what goes when room is
//! needed.
//!
//! Owns the snapshot index (prefix lookup), the per-tier budgets and charges, recency, pins and
//! the save, demotion and restore state machines. It never holds KV bytes and never refers to
//! working-pool pages: every snapshot is backed by its own buffer, named by a [`BackingId`] the
//! engine maps to memory it owns (seed 002: a snapshot that pointed into reusable pool rows
//! restored someone else's bytes). It never depends on the pool; pool pages only appear in the
//! copy plans it hands back.
//!
//! Promises, each tested:
//! - A snapshot's bytes are charged before its buffer exists; a charge that does not fit evicts
//!   unpinned snapshots in eviction order until it does, and one that cannot fit is refused
//!   having evicted and charged nothing.
//! - Recency is by last use: a lookup hit, a restore and a save refresh the snapshot actually
//!   used; a demotion is not a use.
//! - A save is two-phase: `begin_save` charges and reserves, `commit_save` publishes after the
//!   copy succeeded, `abort_save` refunds. An unpublished snapshot is never found, restored or
//!   evicted.
//! - A pinned snapshot (a restore in flight) is never evicted, nor is one an operator kept
//!   (`keep`): a save that would need its room is refused.
//! - A lookup finds the longest prefix a published snapshot covers: a whole snapshot, or,
//!   when snapshots hold KV only (no fixed per-sequence state), the first pages of a longer
//!   one that shares at least its first page with the query (a conversation's earlier turn
//!   whose reply was tokenized otherwise the next time, however short).
//!
//! - A snapshot a restore found corrupt (its frame or a block's checksum did not match, see
//!   [`crate::checksum`]) is dropped as soon as no restore pins it, kept or not, and is never
//!   found again; the request that found it recomputes.
//! - A demoting snapshot stays findable and restorable from its device copy until its host
//!   copy lands: the engine keeps the device backing until it reports the copy, so a demotion
//!   never makes a prefix miss.
//!
//! Snapshot life: `Saving` → `Ready` (↔ pinned while restoring) → evicted, or → `Demoting` (its
//! bytes on their way from the device tier to the host tier, restorable from the device copy)
//! → `Ready` on the host tier.

mod index;
mod sightings;
mod tier;

use std::mem;

use policy::SnapshotPolicy;

use crate::error::CacheError;
use crate::frame::{Frame, FrameKind};
use crate::geometry::{PageId, SnapshotGeometry};
use crate::ids::{BackingId, SlotHandle, SnapshotId};
use crate::plan::{PageCopy, page_copies};
use crate::prefix::PrefixHash;
use index::{PrefixIndex, U64Map};
use sightings::Sightings;
use tier::TierState;
pub use tier::{Tier, TierStats};

/// Where a snapshot is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotState {
    /// Charged, its copy in flight; not findable.
    Saving,
    /// Published: findable, restorable, evictable when unpinned.
    Ready,
    /// Charged to a lower tier, its copy from the tier above in flight; findable and restored
    /// from the copy it leaves.
    Demoting,
    /// Charged to a memory tier, its file being read back from the disk tier; found (so the
    /// requests that want it wait for it), not restorable yet.
    Promoting,
}

/// What the store knows of one snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub id: SnapshotId,
    pub tokens: usize,
    pub pages: usize,
    pub bytes: u64,
    pub tier: Tier,
    pub backing: BackingId,
    pub state: SnapshotState,
    /// While demoting: the backing that still holds its bytes (and that restores read).
    pub demoting_from: Option<BackingId>,
    /// While promoting: the disk file being read back.
    pub promoting_from: Option<BackingId>,
    /// Restores in flight.
    pub pins: u32,
    /// Kept by an operator: never evicted.
    pub kept: bool,
    /// Lookups that found it.
    pub hits: u64,
    /// When a lookup, restore or save last used it.
    pub last_used: std::time::SystemTime,
}

/// A successful lookup: restoring the first `pages` of `snapshot` (all of it, or a head it
/// shares with the query) saves prefilling its `tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LookupHit {
    pub snapshot: SnapshotId,
    pub tokens: usize,
    pub pages: usize,
    pub tier: Tier,
}

/// A charged, unpublished snapshot: the engine copies into `backing`, then hands this back to
/// `commit_save` or `abort_save`. Only the store makes one.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a reservation holds budget until it is committed or aborted"]
pub struct SaveReservation {
    snapshot: SnapshotId,
    backing: BackingId,
    tier: Tier,
    pages: usize,
    bytes: u64,
    geometry: SnapshotGeometry,
}

impl SaveReservation {
    pub fn snapshot(&self) -> SnapshotId {
        self.snapshot
    }
    /// The buffer to allocate and copy into.
    pub fn backing(&self) -> BackingId {
        self.backing
    }
    pub fn tier(&self) -> Tier {
        self.tier
    }
    pub fn pages(&self) -> usize {
        self.pages
    }
    pub fn tokens(&self) -> usize {
        self.pages * self.geometry.kv.page_tokens
    }
    /// Bytes charged, and the size of the buffer to allocate.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The pool pages to copy from: the head of the saving sequence's `page_table`.
    pub fn copies(&self, page_table: &[PageId]) -> Result<Vec<PageCopy>, CacheError> {
        page_copies(self.pages, page_table)
    }

    /// The frame describing this save from `slot`, once the copy's checksum is known.
    pub fn frame(&self, slot: SlotHandle, payload_crc32: u32) -> Frame {
        let position_tokens = self.tokens() as u64;
        Frame::new(
            FrameKind::Save,
            self.snapshot,
            slot,
            position_tokens,
            self.bytes,
            payload_crc32,
            self.geometry,
        )
    }
}

/// A snapshot that left a tier to make room. The engine acts on every eviction before it
/// allocates the new save's buffer: it frees `backing`, or, when `demoted_to` is set, copies it
/// there first and frees it once the copy has landed (then the store hears `commit_demotion` or
/// `abort_demotion`). Until then a demoting snapshot is restored from `backing`, so the device
/// tier's memory holds its budget plus the demotions in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Eviction {
    pub snapshot: SnapshotId,
    pub from: Tier,
    pub backing: BackingId,
    pub bytes: u64,
    /// The buffer the snapshot moves to, if it was demoted rather than dropped.
    pub demoted_to: Option<BackingId>,
    /// The tier of `demoted_to`: the host's after the device, the disk's after the last
    /// memory tier.
    pub demoted_tier: Tier,
}

impl Eviction {
    /// A buffer given up outright (no demotion): the engine frees it.
    fn dropped(snapshot: SnapshotId, from: Tier, backing: BackingId, bytes: u64) -> Eviction {
        Eviction {
            snapshot,
            from,
            backing,
            bytes,
            demoted_to: None,
            demoted_tier: from,
        }
    }
}

/// The answer to `begin_save`.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a reservation holds budget until it is committed or aborted"]
pub enum SaveStart {
    /// Charged; copy, then commit or abort. `evictions` made the room.
    Reserved {
        reservation: SaveReservation,
        evictions: Vec<Eviction>,
    },
    /// This prefix is already stored (or being saved); it was refreshed and nothing was charged.
    AlreadyStored(SnapshotId),
    /// A prompt no prefix of which has been seen often enough yet: nothing saved.
    NotSeenEnough,
}

/// A pinned snapshot and the copies that restore it: row `snapshot_page` of `backing` goes to
/// pool page `pool_page`. Hand the snapshot back to `finish_restore` when the copies are done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestorePlan {
    pub snapshot: SnapshotId,
    pub backing: BackingId,
    pub tier: Tier,
    pub tokens: usize,
    /// The chained hash of the last page restored: the backing's frame must name it.
    pub prefix: PrefixHash,
    pub bytes: u64,
    pub copies: Vec<PageCopy>,
    geometry: SnapshotGeometry,
}

impl RestorePlan {
    /// The frame describing this restore into `slot`.
    pub fn frame(&self, slot: SlotHandle, payload_crc32: u32) -> Frame {
        let position_tokens = self.tokens as u64;
        Frame::new(
            FrameKind::Restore,
            self.snapshot,
            slot,
            position_tokens,
            self.bytes,
            payload_crc32,
            self.geometry,
        )
    }
}

/// A snapshot pinned for a restore whose destination pages are not known yet
/// ([`SnapshotStore::pin_restore`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinnedRestore {
    pub snapshot: SnapshotId,
    pub backing: BackingId,
    pub tier: Tier,
    /// Pages restored: the head of the snapshot.
    pub pages: usize,
    /// The chained hash of the last page restored: the backing's frame must name it.
    pub prefix: PrefixHash,
    pub bytes: u64,
    geometry: SnapshotGeometry,
}

impl PinnedRestore {
    pub fn tokens(&self) -> usize {
        self.pages * self.geometry.kv.page_tokens
    }

    /// The copies into the head of `page_table` (the new slot's pages).
    pub fn plan(&self, page_table: &[PageId]) -> Result<RestorePlan, CacheError> {
        Ok(RestorePlan {
            snapshot: self.snapshot,
            backing: self.backing,
            tier: self.tier,
            tokens: self.tokens(),
            prefix: self.prefix,
            bytes: self.bytes,
            copies: page_copies(self.pages, page_table)?,
            geometry: self.geometry,
        })
    }
}

/// The answer to [`SnapshotStore::find`].
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Found {
    /// The longest stored prefix, if any.
    pub hit: Option<LookupHit>,
    /// For a hit in memory: its pin, to be planned into the new slot's pages.
    pub restore: Option<Result<PinnedRestore, CacheError>>,
    /// For a hit on disk, when promotion was asked for: its read back into memory.
    pub promotion: Option<Result<PromotionStart, CacheError>>,
}

/// The answer to [`SnapshotStore::begin_promotion`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromotionStart {
    /// Charged: read `promotion.from` into `promotion.to`, then commit or abort. `evictions`
    /// made the room.
    Started {
        promotion: Promotion,
        evictions: Vec<Eviction>,
    },
    /// Already being read back.
    InFlight,
}

/// A disk snapshot to read back into memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Promotion {
    pub snapshot: SnapshotId,
    /// Its disk file.
    pub from: BackingId,
    /// The memory buffer to allocate and fill.
    pub to: BackingId,
    pub tier: Tier,
    pub bytes: u64,
}

/// A snapshot to write to the disk tier at shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlushCopy {
    pub snapshot: SnapshotId,
    pub from: BackingId,
    pub from_tier: Tier,
    /// The disk file's backing id.
    pub to: BackingId,
    pub kept: bool,
}

/// What [`SnapshotStore::plan_flush`] decided.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlushPlan {
    pub copies: Vec<FlushCopy>,
    /// Older files evicted to make room.
    pub deletions: Vec<Eviction>,
}

/// The store's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreStats {
    pub device: TierStats,
    pub host: TierStats,
    pub disk: TierStats,
    pub hits: u64,
    pub misses: u64,
    /// Snapshots that left a tier to make room, demoted ones included.
    pub evictions: u64,
    pub demotions: u64,
    pub refusals: u64,
    pub saves_committed: u64,
    pub saves_aborted: u64,
    /// Prompt saves not made because no prefix had been seen `save_after_sightings` times.
    pub saves_skipped: u64,
    /// Snapshots dropped because a restore found their bytes or frame corrupt.
    pub corrupt: u64,
    /// Snapshots read back from the disk tier into memory (started).
    pub promotions: u64,
}

#[derive(Debug, Clone)]
enum State {
    /// The strided boundaries of the chain are kept until publication, when the index needs
    /// them.
    Saving {
        boundaries: Box<[PrefixHash]>,
    },
    Ready,
    /// Charged to a lower tier, its bytes still also in `from` (of `from_tier`), the backing a
    /// restore reads until the copy lands.
    Demoting {
        from: BackingId,
        from_tier: Tier,
    },
    /// Charged to a memory tier, its bytes still only in `from`, its disk file, being read.
    Promoting {
        from: BackingId,
    },
}

#[derive(Debug, Clone)]
struct Snapshot {
    end: PrefixHash,
    /// The chained hash of every page: a query that shares only its head is compared here.
    chain: Box<[PrefixHash]>,
    pages: usize,
    bytes: u64,
    tier: Tier,
    backing: BackingId,
    state: State,
    pins: u32,
    last_use: u64,
    kept: bool,
    hits: u64,
    used_at: std::time::SystemTime,
    /// Found corrupt while its demotion ran: never restored, and dropped when the copy ends.
    corrupt: bool,
}

impl Snapshot {
    /// Published (whether or not on its way to another tier) and not found corrupt: a lookup
    /// finds it.
    fn findable(&self) -> bool {
        !matches!(self.state, State::Saving { .. }) && !self.corrupt
    }

    /// Findable and in memory: a restore can read it.
    fn restorable(&self) -> bool {
        self.findable() && self.source().1 != Tier::Disk
    }

    /// The backing a restore (or a promotion) reads, and its tier.
    fn source(&self) -> (BackingId, Tier) {
        match self.state {
            State::Demoting { from, from_tier } => (from, from_tier),
            State::Promoting { from } => (from, Tier::Disk),
            _ => (self.backing, self.tier),
        }
    }

    fn public_state(&self) -> SnapshotState {
        match self.state {
            State::Saving { .. } => SnapshotState::Saving,
            State::Ready => SnapshotState::Ready,
            State::Demoting { .. } => SnapshotState::Demoting,
            State::Promoting { .. } => SnapshotState::Promoting,
        }
    }
}

/// At most this many snapshots sharing a query's deepest stride are compared for the pages
/// after it.
const MAX_HEAD_CANDIDATES: usize = 64;

/// The snapshot store. See the module documentation for what it promises.
#[derive(Debug)]
pub struct SnapshotStore {
    geometry: SnapshotGeometry,
    demote_to_host: bool,
    /// Whether snapshots evicted from the last memory tier are written to the disk tier.
    demote_to_disk: bool,
    tiers: [TierState; 3],
    snapshots: U64Map<SnapshotId, Snapshot>,
    index: PrefixIndex,
    sightings: Sightings,
    /// A prompt's prefix is saved once this many lookups have shown it.
    save_after_sightings: u32,
    /// Logical time of the latest use; stamps recency.
    clock: u64,
    /// The last ids handed out; ids start at 1 and are never reused.
    next_snapshot: u64,
    next_backing: u64,
    counters: Counters,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counters {
    hits: u64,
    misses: u64,
    evictions: u64,
    demotions: u64,
    refusals: u64,
    saves_committed: u64,
    saves_aborted: u64,
    saves_skipped: u64,
    corrupt: u64,
    promotions: u64,
}

impl SnapshotStore {
    pub fn new(geometry: SnapshotGeometry, policy: &SnapshotPolicy) -> SnapshotStore {
        SnapshotStore {
            geometry,
            demote_to_host: policy.demote_to_host(),
            demote_to_disk: policy.demote_to_disk(),
            tiers: [
                TierState::new(
                    Tier::Device,
                    policy.device_budget_bytes(),
                    policy.eviction(),
                ),
                TierState::new(Tier::Host, policy.host_budget_bytes(), policy.eviction()),
                TierState::new(Tier::Disk, policy.disk_budget_bytes(), policy.eviction()),
            ],
            snapshots: U64Map::default(),
            index: PrefixIndex::default(),
            sightings: Sightings::default(),
            save_after_sightings: policy.save_after_sightings(false),
            clock: 0,
            next_snapshot: 0,
            next_backing: 0,
            counters: Counters::default(),
        }
    }

    pub fn geometry(&self) -> SnapshotGeometry {
        self.geometry
    }

    /// Saves a prompt's prefix once this many lookups have shown it (the policy's default is
    /// the CPU's; the server sets the backend's).
    pub fn set_save_after_sightings(&mut self, sightings: u32) {
        self.save_after_sightings = sightings.max(1);
    }

    fn tier(&self, tier: Tier) -> &TierState {
        &self.tiers[tier.index()]
    }

    fn tier_mut(&mut self, tier: Tier) -> &mut TierState {
        &mut self.tiers[tier.index()]
    }

    fn snapshot(&self, id: SnapshotId) -> Result<&Snapshot, CacheError> {
        self.snapshots
            .get(&id)
            .ok_or(CacheError::UnknownSnapshot { snapshot: id })
    }

    /// The snapshot `id` in `expected` state, or why not.
    /// Snapshot `id`, if it is published (ready or demoting).
    fn restorable(&mut self, id: SnapshotId) -> Result<&mut Snapshot, CacheError> {
        let snapshot = self
            .snapshots
            .get_mut(&id)
            .ok_or(CacheError::UnknownSnapshot { snapshot: id })?;
        if !snapshot.restorable() {
            return Err(CacheError::WrongState {
                snapshot: id,
                expected: SnapshotState::Ready,
                found: snapshot.public_state(),
            });
        }
        Ok(snapshot)
    }

    fn snapshot_in(
        &mut self,
        id: SnapshotId,
        expected: SnapshotState,
    ) -> Result<&mut Snapshot, CacheError> {
        let snapshot = self
            .snapshots
            .get_mut(&id)
            .ok_or(CacheError::UnknownSnapshot { snapshot: id })?;
        let found = snapshot.public_state();
        if found != expected {
            return Err(CacheError::WrongState {
                snapshot: id,
                expected,
                found,
            });
        }
        Ok(snapshot)
    }

    /// Advances the logical clock that stamps uses.
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Records a use of a published snapshot now.
    fn touch(&mut self, id: SnapshotId) {
        let now = self.tick();
        let snapshot = self
            .snapshots
            .get_mut(&id)
            .expect("only stored snapshots are touched");
        snapshot.used_at = std::time::SystemTime::now();
        match snapshot.state {
            State::Ready => {
                snapshot.last_use = now;
                let tier = snapshot.tier;
                self.tier_mut(tier).order.touch(&id, now);
            }
            // Joins its new tier's order with this recency when its copy lands.
            State::Demoting { .. } | State::Promoting { .. } => snapshot.last_use = now,
            State::Saving { .. } => {}
        }
    }

    /// Starts saving the prefix `chain` into `tier`: charges its bytes, evicting unpinned
    /// snapshots in eviction order as needed, and reserves a backing buffer. Refused, having
    /// changed nothing, if it cannot fit.
    pub fn begin_save(
        &mut self,
        chain: &[PrefixHash],
        tier: Tier,
    ) -> Result<SaveStart, CacheError> {
        let end = *chain.last().ok_or(CacheError::EmptyPrefix)?;
        if let Some(existing) = self.index.ending_at(end) {
            self.touch(existing);
            return Ok(SaveStart::AlreadyStored(existing));
        }
        let bytes = self.geometry.bytes_for_pages(chain.len());
        let snapshots = &self.snapshots;
        let planned = self.tier(tier).plan_room(bytes, |id| {
            let victim = &snapshots[&id];
            (victim.pins == 0 && !victim.kept).then_some(victim.bytes)
        });
        let victims = planned.inspect_err(|_| self.counters.refusals += 1)?;
        let mut evictions = Vec::new();
        for victim in victims {
            self.evict(victim, &mut evictions);
        }
        let reservation = self.reserve(chain, tier, bytes);
        Ok(SaveStart::Reserved {
            reservation,
            evictions,
        })
    }

    /// Starts saving a prompt's prefix, as `begin_save` does, but only as much of `chain` as
    /// `save_after_sightings` lookups have shown: the whole prompt once it repeated, else the
    /// longest opening it shares with earlier prompts at a stride boundary, else nothing
    /// (`NotSeenEnough`, counted). A lookup of the prompt itself counts as one sighting.
    pub fn begin_prompt_save(
        &mut self,
        chain: &[PrefixHash],
        tier: Tier,
    ) -> Result<SaveStart, CacheError> {
        let pages = match self.save_after_sightings {
            1 => chain.len(),
            at_least => self.sightings.seen_pages(chain, at_least),
        };
        if pages == 0 {
            self.counters.saves_skipped += 1;
            return Ok(SaveStart::NotSeenEnough);
        }
        self.begin_save(&chain[..pages], tier)
    }

    fn reserve(&mut self, chain: &[PrefixHash], tier: Tier, bytes: u64) -> SaveReservation {
        self.next_snapshot += 1;
        let snapshot = SnapshotId(self.next_snapshot);
        let backing = self.new_backing();
        let end = *chain.last().expect("begin_save refuses an empty chain");
        self.index.claim(end, snapshot);
        self.tier_mut(tier).charge(bytes);
        let state = State::Saving {
            boundaries: index::strided(chain),
        };
        let pages = chain.len();
        let record = Snapshot {
            end,
            chain: chain.into(),
            pages,
            bytes,
            tier,
            backing,
            state,
            pins: 0,
            last_use: 0,
            kept: false,
            hits: 0,
            used_at: std::time::SystemTime::now(),
            corrupt: false,
        };
        self.snapshots.insert(snapshot, record);
        SaveReservation {
            snapshot,
            backing,
            tier,
            pages,
            bytes,
            geometry: self.geometry,
        }
    }

    fn new_backing(&mut self) -> BackingId {
        self.next_backing += 1;
        BackingId(self.next_backing)
    }

    /// Takes `id` out of its tier: demoted to the next tier when the policy allows and it fits
    /// there, dropped otherwise. The device demotes to the host when the host has room without
    /// evicting (or, with a disk tier, by sending the host's own victims on to disk); the last
    /// memory tier demotes to the disk, whose least recent files make room.
    fn evict(&mut self, id: SnapshotId, evictions: &mut Vec<Eviction>) {
        let snapshot = &self.snapshots[&id];
        let (from, backing, bytes) = (snapshot.tier, snapshot.backing, snapshot.bytes);
        let tier = self.tier_mut(from);
        tier.order.remove(&id);
        tier.refund(bytes);
        self.counters.evictions += 1;
        let target = self.demotion_target(from, bytes);
        // The room's own evictions come first: the engine frees or moves them before it fills
        // this one's new buffer.
        let demoted_to = target.filter(|&to| self.make_room(to, bytes, evictions));
        let demoted_to = match demoted_to {
            Some(to) => Some((self.demote(id, to), to)),
            None => {
                self.forget(id);
                None
            }
        };
        evictions.push(Eviction {
            snapshot: id,
            from,
            backing,
            bytes,
            demoted_to: demoted_to.map(|(b, _)| b),
            demoted_tier: demoted_to.map_or(from, |(_, t)| t),
        });
    }

    /// The tier a snapshot evicted from `from` moves to, if the policy moves it.
    fn demotion_target(&self, from: Tier, bytes: u64) -> Option<Tier> {
        match from {
            Tier::Device if self.demote_to_host => {
                let fits = self.tier(Tier::Host).room_bytes() >= bytes;
                (fits || self.demote_to_disk).then_some(Tier::Host)
            }
            Tier::Device | Tier::Host if self.demote_to_disk => Some(Tier::Disk),
            _ => None,
        }
    }

    /// Evicts from `tier` (moving victims further down where the policy allows) until `bytes`
    /// fit; false, having evicted nothing, when they cannot.
    fn make_room(&mut self, tier: Tier, bytes: u64, evictions: &mut Vec<Eviction>) -> bool {
        let snapshots = &self.snapshots;
        let victims = self.tier(tier).plan_room(bytes, |id| {
            let victim = &snapshots[&id];
            (victim.pins == 0 && !victim.kept).then_some(victim.bytes)
        });
        match victims {
            Ok(victims) => {
                for victim in victims {
                    self.evict(victim, evictions);
                }
                true
            }
            Err(_) => false,
        }
    }

    /// Moves an evicted snapshot to `to`; until its copy lands it is restored from where it
    /// was.
    fn demote(&mut self, id: SnapshotId, to: Tier) -> BackingId {
        let backing = self.new_backing();
        let snapshot = self.snapshots.get_mut(&id).expect("a victim is stored");
        let from_tier = mem::replace(&mut snapshot.tier, to);
        let from = mem::replace(&mut snapshot.backing, backing);
        snapshot.state = State::Demoting { from, from_tier };
        let bytes = snapshot.bytes;
        self.tier_mut(to).charge(bytes);
        self.counters.demotions += 1;
        backing
    }

    /// Drops `id` from the records and the index; refunding its charge is the caller's job.
    fn forget(&mut self, id: SnapshotId) -> Snapshot {
        let snapshot = self
            .snapshots
            .remove(&id)
            .expect("only stored snapshots are forgotten");
        match snapshot.state {
            State::Saving { .. } => self.index.unclaim(snapshot.end),
            State::Ready | State::Demoting { .. } | State::Promoting { .. } => self
                .index
                .unpublish(snapshot.chain[0], snapshot.end, snapshot.pages),
        }
        snapshot
    }

    /// The copy into the reservation's buffer succeeded: publish the snapshot. A save is a use.
    pub fn commit_save(&mut self, reservation: SaveReservation) -> Result<SnapshotId, CacheError> {
        let id = reservation.snapshot;
        let now = self.tick();
        let snapshot = self.snapshot_in(id, SnapshotState::Saving)?;
        let State::Saving { boundaries } = mem::replace(&mut snapshot.state, State::Ready) else {
            unreachable!("snapshot_in checked the state");
        };
        snapshot.last_use = now;
        let (tier, end, pages, first) = (
            snapshot.tier,
            snapshot.end,
            snapshot.pages,
            snapshot.chain[0],
        );
        self.index.publish(first, end, pages, &boundaries);
        self.tier_mut(tier).order.insert(id, now);
        self.counters.saves_committed += 1;
        Ok(id)
    }

    /// The copy failed: refund the charge and forget the snapshot, leaving no trace.
    pub fn abort_save(&mut self, reservation: SaveReservation) -> Result<(), CacheError> {
        let id = reservation.snapshot;
        self.snapshot_in(id, SnapshotState::Saving)?;
        let snapshot = self.forget(id);
        self.tier_mut(snapshot.tier).refund(snapshot.bytes);
        self.counters.saves_aborted += 1;
        Ok(())
    }

    /// A demotion's copy landed: the snapshot is findable again, on the host tier, keeping the
    /// recency of its last real use. One found corrupt meanwhile is dropped instead, and its
    /// new buffer handed back to be freed.
    pub fn commit_demotion(&mut self, id: SnapshotId) -> Result<Vec<Eviction>, CacheError> {
        let snapshot = self.snapshot_in(id, SnapshotState::Demoting)?;
        let tier = snapshot.tier;
        if snapshot.corrupt {
            let (backing, bytes) = (snapshot.backing, snapshot.bytes);
            self.forget(id);
            self.tier_mut(tier).refund(bytes);
            return Ok(vec![Eviction::dropped(id, tier, backing, bytes)]);
        }
        snapshot.state = State::Ready;
        let last_use = snapshot.last_use;
        // Found while demoting, it was used since: its last use counts.
        self.tier_mut(tier).order.insert(id, last_use);
        Ok(Vec::new())
    }

    /// A demotion's copy failed: the snapshot is gone and its new tier's charge refunded.
    pub fn abort_demotion(&mut self, id: SnapshotId) -> Result<(), CacheError> {
        self.snapshot_in(id, SnapshotState::Demoting)?;
        let snapshot = self.forget(id);
        self.tier_mut(snapshot.tier).refund(snapshot.bytes);
        Ok(())
    }

    /// A restore of `id` read bytes whose checksum or frame did not match: the snapshot is
    /// dropped and refunded, kept or not, once no restore pins it; the buffers to free are
    /// handed back. One still demoting is only marked, never found again, and dropped when its
    /// copy ends ([`SnapshotStore::commit_demotion`]).
    pub fn drop_corrupt(&mut self, id: SnapshotId) -> Result<Vec<Eviction>, CacheError> {
        let snapshot = self
            .snapshots
            .get_mut(&id)
            .ok_or(CacheError::UnknownSnapshot { snapshot: id })?;
        if snapshot.pins > 0 {
            return Err(CacheError::Pinned { snapshot: id });
        }
        match snapshot.state {
            State::Ready => {
                let (tier, backing, bytes) = (snapshot.tier, snapshot.backing, snapshot.bytes);
                self.forget(id);
                let tier_state = self.tier_mut(tier);
                tier_state.order.remove(&id);
                tier_state.refund(bytes);
                self.counters.corrupt += 1;
                Ok(vec![Eviction::dropped(id, tier, backing, bytes)])
            }
            State::Demoting { .. } | State::Promoting { .. } => {
                if !snapshot.corrupt {
                    snapshot.corrupt = true;
                    self.counters.corrupt += 1;
                }
                Ok(Vec::new())
            }
            State::Saving { .. } => Err(CacheError::WrongState {
                snapshot: id,
                expected: SnapshotState::Ready,
                found: SnapshotState::Saving,
            }),
        }
    }

    /// The published snapshot covering the longest prefix of `chain`: a whole snapshot, or the
    /// head of a longer one (see the module's promises). A hit is a use.
    /// The lookup is also a sighting of `chain` for the save policy.
    pub fn lookup_longest(&mut self, chain: &[PrefixHash]) -> Option<LookupHit> {
        if self.save_after_sightings > 1 {
            self.sightings.record(chain);
        }
        let snapshots = &self.snapshots;
        let whole = self.index.longest(chain, |id, pages| {
            let snapshot = &snapshots[&id];
            snapshot.findable() && snapshot.pages == pages
        });
        let mut best = whole.map(|id| (id, snapshots[&id].pages));
        // A head of a snapshot with fixed per-sequence state would restore state of the
        // wrong position: only KV-only snapshots lend their heads.
        let heads_usable = self.geometry.fixed_state_bytes == 0;
        for (strides, via) in self.index.shared_heads(chain).filter(|_| heads_usable) {
            // Each shares `start` pages; a few are compared page by page for the rest, which
            // bounds a lookup however many snapshots share a popular head.
            let start = strides * index::STRIDE_PAGES;
            let reach = (start + index::STRIDE_PAGES - 1).min(chain.len());
            if best.is_some_and(|(_, whole)| whole >= reach) {
                break;
            }
            let mut head: Option<(SnapshotId, usize)> = None;
            for &id in via.iter().take(MAX_HEAD_CANDIDATES) {
                let snapshot = &snapshots[&id];
                if !snapshot.findable() {
                    continue;
                }
                let more = chain[start..]
                    .iter()
                    .zip(&snapshot.chain[start..])
                    .take_while(|(a, b)| a == b)
                    .count();
                if head.is_none_or(|(_, pages)| start + more > pages) {
                    head = Some((id, start + more));
                }
            }
            // The deepest boundary with a usable snapshot has the longest head.
            if let Some((id, pages)) = head {
                if best.is_none_or(|(_, whole)| pages > whole) {
                    best = Some((id, pages));
                }
                break;
            }
        }
        let Some((id, pages)) = best else {
            self.counters.misses += 1;
            return None;
        };
        self.counters.hits += 1;
        self.snapshots.get_mut(&id).expect("a hit is stored").hits += 1;
        self.touch(id);
        let snapshot = &self.snapshots[&id];
        let tokens = pages * self.geometry.kv.page_tokens;
        Some(LookupHit {
            snapshot: id,
            tokens,
            pages,
            tier: snapshot.source().1,
        })
    }

    /// Pins snapshot `id` and plans the restore of its first `pages` pages (a lookup hit's)
    /// into the head of `page_table` (the new slot's pages). A restore is a use. Call
    /// `finish_restore` when the copies are done or failed.
    pub fn begin_restore(
        &mut self,
        id: SnapshotId,
        pages: usize,
        page_table: &[PageId],
    ) -> Result<RestorePlan, CacheError> {
        let pinned = self.pin_restore(id, pages)?;
        pinned.plan(page_table).inspect_err(|_| {
            self.unpin(id);
        })
    }

    /// Pins snapshot `id` for the restore of its first `pages` pages (a lookup hit's), before
    /// the pages it goes to are known: [`PinnedRestore::plan`] pairs them once they are. A
    /// restore is a use. Call `finish_restore` when the copies are done or failed, or the
    /// restore is given up.
    pub fn pin_restore(
        &mut self,
        id: SnapshotId,
        pages: usize,
    ) -> Result<PinnedRestore, CacheError> {
        let geometry = self.geometry;
        let found = self.snapshot(id)?;
        if found.findable() && found.source().1 == Tier::Disk {
            return Err(CacheError::OnDisk { snapshot: id });
        }
        let snapshot = self.restorable(id)?;
        let partial = pages < snapshot.pages;
        if pages == 0 || pages > snapshot.pages || (partial && geometry.fixed_state_bytes > 0) {
            return Err(CacheError::RestoreLength {
                snapshot: id,
                asked_pages: pages,
                snapshot_pages: snapshot.pages,
            });
        }
        snapshot.pins += 1;
        let (backing, tier) = snapshot.source();
        let bytes = if partial {
            geometry.bytes_for_pages(pages)
        } else {
            snapshot.bytes
        };
        let prefix = snapshot.chain[pages - 1];
        self.touch(id);
        Ok(PinnedRestore {
            snapshot: id,
            backing,
            tier,
            pages,
            prefix,
            bytes,
            geometry,
        })
    }

    /// A request's whole dealing with the store before it is admitted, in one call: the
    /// longest stored prefix of `chain` ([`SnapshotStore::lookup_longest`]), pinned for its
    /// restore when it is in memory, or, when it is on disk and `promote` is set, on its way
    /// back into memory ([`SnapshotStore::begin_promotion`]).
    pub fn find(&mut self, chain: &[PrefixHash], promote: bool) -> Found {
        let Some(hit) = self.lookup_longest(chain) else {
            return Found::default();
        };
        let mut found = Found {
            hit: Some(hit),
            ..Found::default()
        };
        if hit.tier == Tier::Disk {
            if promote {
                found.promotion = Some(self.begin_promotion(hit.snapshot));
            }
        } else {
            found.restore = Some(self.pin_restore(hit.snapshot, hit.pages));
        }
        found
    }

    fn unpin(&mut self, id: SnapshotId) {
        if let Some(snapshot) = self.snapshots.get_mut(&id) {
            snapshot.pins = snapshot.pins.saturating_sub(1);
        }
    }

    /// Unpins a snapshot pinned by `begin_restore` or `pin_restore`.
    pub fn finish_restore(&mut self, id: SnapshotId) -> Result<(), CacheError> {
        let snapshot = self.restorable(id)?;
        if snapshot.pins == 0 {
            return Err(CacheError::NotPinned { snapshot: id });
        }
        snapshot.pins -= 1;
        Ok(())
    }

    /// Drops a published, unpinned snapshot (its buffer was lost or found corrupt) and refunds
    /// it. Returns the backing for the engine to free.
    pub fn discard(&mut self, id: SnapshotId) -> Result<BackingId, CacheError> {
        let snapshot = self.snapshot_in(id, SnapshotState::Ready)?;
        if snapshot.pins > 0 {
            return Err(CacheError::Pinned { snapshot: id });
        }
        let snapshot = self.forget(id);
        let tier = self.tier_mut(snapshot.tier);
        tier.order.remove(&id);
        tier.refund(snapshot.bytes);
        Ok(snapshot.backing)
    }

    /// Starts reading a disk snapshot back into memory (the host tier where it has a budget,
    /// else the device's): charges it there, making room as a save does, and names the new
    /// buffer. Until [`SnapshotStore::commit_promotion`] it is found but not restorable, so
    /// requests wait for it. One already on its way answers `InFlight`.
    pub fn begin_promotion(&mut self, id: SnapshotId) -> Result<PromotionStart, CacheError> {
        let snapshot = self.snapshot(id)?;
        match (snapshot.state.clone(), snapshot.tier) {
            (State::Promoting { .. }, _) => return Ok(PromotionStart::InFlight),
            (State::Ready, Tier::Disk) if !snapshot.corrupt => {}
            _ => {
                return Err(CacheError::WrongState {
                    snapshot: id,
                    expected: SnapshotState::Ready,
                    found: snapshot.public_state(),
                });
            }
        }
        let (from, bytes) = (snapshot.backing, snapshot.bytes);
        let to_tier = if self.tier(Tier::Host).budget_bytes() > 0 {
            Tier::Host
        } else {
            Tier::Device
        };
        // Not a victim of the room it needs.
        let disk = self.tier_mut(Tier::Disk);
        disk.order.remove(&id);
        let planned = {
            let snapshots = &self.snapshots;
            self.tier(to_tier).plan_room(bytes, |victim| {
                let victim = &snapshots[&victim];
                (victim.pins == 0 && !victim.kept).then_some(victim.bytes)
            })
        };
        let victims = match planned {
            Ok(victims) => victims,
            Err(e) => {
                let last_use = self.snapshots[&id].last_use;
                self.tier_mut(Tier::Disk).order.insert(id, last_use);
                self.counters.refusals += 1;
                return Err(e);
            }
        };
        let mut evictions = Vec::new();
        for victim in victims {
            self.evict(victim, &mut evictions);
        }
        let to = self.new_backing();
        self.tier_mut(to_tier).charge(bytes);
        let snapshot = self.snapshots.get_mut(&id).expect("checked above");
        snapshot.tier = to_tier;
        snapshot.backing = to;
        snapshot.state = State::Promoting { from };
        self.counters.promotions += 1;
        Ok(PromotionStart::Started {
            promotion: Promotion {
                snapshot: id,
                from,
                to,
                tier: to_tier,
                bytes,
            },
            evictions,
        })
    }

    /// A promotion's read landed, checked: the snapshot is restorable from memory, and its disk
    /// file (handed back) is to be deleted, its charge refunded.
    pub fn commit_promotion(&mut self, id: SnapshotId) -> Result<Vec<Eviction>, CacheError> {
        let snapshot = self.snapshot_in(id, SnapshotState::Promoting)?;
        let State::Promoting { from } = snapshot.state else {
            unreachable!("snapshot_in checked the state");
        };
        snapshot.state = State::Ready;
        let (tier, bytes, last_use) = (snapshot.tier, snapshot.bytes, snapshot.last_use);
        self.tier_mut(tier).order.insert(id, last_use);
        self.tier_mut(Tier::Disk).refund(bytes);
        Ok(vec![Eviction::dropped(id, Tier::Disk, from, bytes)])
    }

    /// A promotion failed. A file found corrupt (`corrupt`) is gone with its snapshot, both
    /// charges refunded, and handed back to be deleted; otherwise (the read could not run) the
    /// snapshot stays on disk, findable, and only the memory charge is refunded. The engine
    /// frees the memory buffer it had allocated either way.
    pub fn abort_promotion(
        &mut self,
        id: SnapshotId,
        corrupt: bool,
    ) -> Result<Vec<Eviction>, CacheError> {
        let snapshot = self.snapshot_in(id, SnapshotState::Promoting)?;
        let State::Promoting { from } = snapshot.state else {
            unreachable!("snapshot_in checked the state");
        };
        if !corrupt {
            let (tier, bytes, last_use) = (snapshot.tier, snapshot.bytes, snapshot.last_use);
            snapshot.tier = Tier::Disk;
            snapshot.backing = from;
            snapshot.state = State::Ready;
            self.tier_mut(tier).refund(bytes);
            self.tier_mut(Tier::Disk).order.insert(id, last_use);
            return Ok(Vec::new());
        }
        let snapshot = self.forget(id);
        self.tier_mut(snapshot.tier).refund(snapshot.bytes);
        self.tier_mut(Tier::Disk).refund(snapshot.bytes);
        self.counters.corrupt += 1;
        Ok(vec![Eviction::dropped(
            id,
            Tier::Disk,
            from,
            snapshot.bytes,
        )])
    }

    /// Registers a snapshot found in the disk tier at start-up, published and ready to be
    /// promoted; call in order of last use, oldest first. Refused when the disk budget cannot
    /// hold it beside those adopted before.
    pub fn adopt_disk(
        &mut self,
        chain: &[PrefixHash],
        kept: bool,
    ) -> Result<(SnapshotId, BackingId), CacheError> {
        let end = *chain.last().ok_or(CacheError::EmptyPrefix)?;
        if let Some(existing) = self.index.ending_at(end) {
            return Err(CacheError::WrongState {
                snapshot: existing,
                expected: SnapshotState::Ready,
                found: SnapshotState::Ready,
            });
        }
        let bytes = self.geometry.bytes_for_pages(chain.len());
        if bytes > self.tier(Tier::Disk).room_bytes() {
            let disk = self.tier(Tier::Disk);
            return Err(CacheError::OverBudget {
                tier: Tier::Disk,
                needed_bytes: bytes,
                reclaimable_bytes: disk.room_bytes(),
            });
        }
        let reservation = self.reserve(chain, Tier::Disk, bytes);
        let (id, backing) = (reservation.snapshot, reservation.backing);
        self.commit_save(reservation)?;
        self.counters.saves_committed -= 1;
        self.snapshots.get_mut(&id).expect("just saved").kept = kept;
        Ok((id, backing))
    }

    /// What a clean shutdown writes to the disk tier: the snapshots in memory, most recently
    /// used first, each charged to the disk (older files evicted to make room) as long as one
    /// fits. The records are not changed otherwise: the process is ending.
    pub fn plan_flush(&mut self) -> FlushPlan {
        let mut candidates: Vec<(u64, SnapshotId)> = self
            .snapshots
            .iter()
            .filter(|(_, s)| matches!(s.state, State::Ready) && s.tier != Tier::Disk && !s.corrupt)
            .map(|(&id, s)| (s.last_use, id))
            .collect();
        candidates.sort_unstable_by(|a, b| b.cmp(a));
        let mut plan = FlushPlan::default();
        for (_, id) in candidates {
            let bytes = self.snapshots[&id].bytes;
            let mut evictions = Vec::new();
            if !self.make_room(Tier::Disk, bytes, &mut evictions) {
                break;
            }
            plan.deletions.extend(evictions);
            self.tier_mut(Tier::Disk).charge(bytes);
            let to = self.new_backing();
            let snapshot = &self.snapshots[&id];
            plan.copies.push(FlushCopy {
                snapshot: id,
                from: snapshot.backing,
                from_tier: snapshot.tier,
                to,
                kept: snapshot.kept,
            });
        }
        plan
    }

    /// What the store knows of snapshot `id`.
    pub fn info(&self, id: SnapshotId) -> Result<SnapshotInfo, CacheError> {
        let snapshot = self.snapshot(id)?;
        Ok(SnapshotInfo {
            id,
            tokens: snapshot.pages * self.geometry.kv.page_tokens,
            pages: snapshot.pages,
            bytes: snapshot.bytes,
            tier: snapshot.tier,
            backing: snapshot.backing,
            state: snapshot.public_state(),
            demoting_from: match snapshot.state {
                State::Demoting { from, .. } => Some(from),
                _ => None,
            },
            promoting_from: match snapshot.state {
                State::Promoting { from } => Some(from),
                _ => None,
            },
            pins: snapshot.pins,
            kept: snapshot.kept,
            hits: snapshot.hits,
            last_used: snapshot.used_at,
        })
    }

    /// Keeps snapshot `id` (saving or published) until [`SnapshotStore::discard`]: it is never
    /// evicted, so its tier's other snapshots share what it leaves of the budget.
    pub fn keep(&mut self, id: SnapshotId) -> Result<(), CacheError> {
        self.snapshots
            .get_mut(&id)
            .ok_or(CacheError::UnknownSnapshot { snapshot: id })?
            .kept = true;
        Ok(())
    }

    /// Starts saving `chain` as [`SnapshotStore::begin_save`] does, the snapshot kept from the
    /// start; an equal prefix already stored is kept instead. Refused when it does not fit
    /// beside the snapshots that must stay.
    pub fn begin_kept_save(
        &mut self,
        chain: &[PrefixHash],
        tier: Tier,
    ) -> Result<SaveStart, CacheError> {
        let start = self.begin_save(chain, tier)?;
        let id = match &start {
            SaveStart::Reserved { reservation, .. } => reservation.snapshot,
            SaveStart::AlreadyStored(id) => *id,
            SaveStart::NotSeenEnough => unreachable!("begin_save has no sightings"),
        };
        self.keep(id)?;
        Ok(start)
    }

    /// Every stored snapshot, in no particular order.
    pub fn snapshot_ids(&self) -> impl Iterator<Item = SnapshotId> + '_ {
        self.snapshots.keys().copied()
    }

    /// The published snapshots of `tier`, the next victim first.
    pub fn eviction_order(&self, tier: Tier) -> Vec<SnapshotId> {
        self.tier(tier).order.candidates().copied().collect()
    }

    pub fn stats(&self) -> StoreStats {
        let c = self.counters;
        let mut tiers = [
            self.tier(Tier::Device).stats(),
            self.tier(Tier::Host).stats(),
            self.tier(Tier::Disk).stats(),
        ];
        for snapshot in self.snapshots.values().filter(|s| s.kept) {
            tiers[snapshot.tier.index()].kept_bytes += snapshot.bytes;
        }
        let [device, host, disk] = tiers;
        StoreStats {
            device,
            host,
            disk,
            hits: c.hits,
            misses: c.misses,
            evictions: c.evictions,
            demotions: c.demotions,
            refusals: c.refusals,
            saves_committed: c.saves_committed,
            saves_aborted: c.saves_aborted,
            saves_skipped: c.saves_skipped,
            corrupt: c.corrupt,
            promotions: c.promotions,
        }
    }
}

#[cfg(test)]
mod tests;
