//! The cache crate's one error type.
//!
//! Every variant is a refusal the caller can act on (back off, queue, fail the request, drop a
//! frame); none means the cache is broken. Broken invariants are `expect`s with the reason they
//! cannot happen. Mapping these to HTTP statuses is the actors' job, done in one place there.

use crate::geometry::SnapshotGeometry;
use crate::ids::{SlotHandle, SnapshotId};
use crate::store::{SnapshotState, Tier};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    // The working pool.
    /// The handle's slot was released or reused since the handle was issued.
    #[error("{handle} is stale: the slot was released or reused")]
    StaleSlot { handle: SlotHandle },
    #[error("all {max_slots} slots are in use")]
    NoFreeSlot { max_slots: usize },
    /// The pool cannot give a sequence the pages it needs now; back off and retry.
    #[error("context full: needed {needed_pages} pages, {free_pages} available")]
    ContextFull {
        needed_pages: usize,
        free_pages: usize,
    },
    /// The sequence could never fit, however empty the pool: retrying cannot help.
    #[error("sequence needs {needed_pages} pages but the pool has {total_pages}")]
    LargerThanPool {
        needed_pages: usize,
        total_pages: usize,
    },
    /// Growing past the prompt + max_tokens the sequence was admitted with.
    #[error("sequence limit is {limit_tokens} tokens, asked for {requested_tokens}")]
    SlotLimit {
        limit_tokens: usize,
        requested_tokens: usize,
    },
    #[error("cannot truncate to {requested_tokens} tokens: the sequence holds {held_tokens}")]
    TruncateBeyondEnd {
        held_tokens: usize,
        requested_tokens: usize,
    },

    // The snapshot store.
    #[error("a snapshot covers at least one full page")]
    EmptyPrefix,
    /// Larger than the tier's whole budget: refused without evicting anything.
    #[error("a {bytes}-byte snapshot exceeds the {tier} budget of {budget_bytes} bytes")]
    SnapshotTooLarge {
        tier: Tier,
        bytes: u64,
        budget_bytes: u64,
    },
    /// Would fit the budget, but pinned and kept snapshots hold too much of it: refused without
    /// evicting.
    #[error(
        "{tier} tier cannot make room for {needed_bytes} bytes: at most {reclaimable_bytes} reclaimable"
    )]
    OverBudget {
        tier: Tier,
        needed_bytes: u64,
        reclaimable_bytes: u64,
    },
    #[error("{snapshot} is not in the store")]
    UnknownSnapshot { snapshot: SnapshotId },
    #[error("{snapshot} is {found:?}, expected {expected:?}")]
    WrongState {
        snapshot: SnapshotId,
        expected: SnapshotState,
        found: SnapshotState,
    },
    #[error("{snapshot} is on disk: promote it to memory before restoring it")]
    OnDisk { snapshot: SnapshotId },
    #[error("{snapshot} has no restore in flight")]
    NotPinned { snapshot: SnapshotId },
    #[error("{snapshot} has a restore in flight")]
    Pinned { snapshot: SnapshotId },
    #[error("a {snapshot_pages}-page snapshot does not fit a {table_pages}-page page table")]
    ShortPageTable {
        snapshot_pages: usize,
        table_pages: usize,
    },
    #[error(
        "cannot restore {asked_pages} pages of {snapshot}, which has {snapshot_pages} \
         (a head needs at least one page and a snapshot without fixed state)"
    )]
    RestoreLength {
        snapshot: SnapshotId,
        asked_pages: usize,
        snapshot_pages: usize,
    },

    // Frames.
    #[error("frame truncated: needed {needed} bytes, got {found}")]
    FrameTruncated { needed: usize, found: usize },
    #[error("frame followed by stray bytes: expected {expected}, got {found}")]
    FrameTrailingBytes { expected: usize, found: usize },
    #[error("not a frame: magic {found:?}")]
    FrameMagic { found: [u8; 4] },
    #[error("unsupported frame version {found}")]
    FrameVersion { found: u16 },
    #[error("frame declares {declared} header bytes, version 1 has {expected}")]
    FrameHeaderLength { declared: u16, expected: u16 },
    #[error("frame header checksum {stored:#010x} does not match its contents ({computed:#010x})")]
    FrameHeaderChecksum { stored: u32, computed: u32 },
    #[error("frame field {field} has an invalid value {value}")]
    FrameField { field: &'static str, value: u64 },
    #[error(
        "frame covers tokens {base_tokens}..{position_tokens}, not a whole number of {page_tokens}-token pages"
    )]
    FrameRange {
        base_tokens: u64,
        position_tokens: u64,
        page_tokens: u64,
    },
    #[error("frame declares {declared} payload bytes, its geometry gives {expected:?}")]
    FrameByteLength {
        declared: u64,
        expected: Option<u64>,
    },
    #[error("frame geometry {frame:?} is not this model's {expected:?}")]
    FrameGeometry {
        frame: Box<SnapshotGeometry>,
        expected: Box<SnapshotGeometry>,
    },
    #[error("payload is {found} bytes, its frame declares {declared}")]
    PayloadLength { declared: u64, found: u64 },
    #[error("payload checksum {computed:#010x} does not match its frame's {stored:#010x}")]
    PayloadChecksum { stored: u32, computed: u32 },

    // Snapshot files.
    #[error(
        "snapshot file of another model (fingerprint {found:#034x}, this one {expected:#034x})"
    )]
    FileModel { found: u128, expected: u128 },
    #[error("snapshot file is {found} bytes, its header declares {declared}")]
    FileLength { declared: u64, found: u64 },
    #[error("snapshot file's page hashes or block sums are corrupt")]
    FileTables,
    #[error("block {block} of the snapshot's payload does not match its sum")]
    BlockChecksum { block: usize },
}
