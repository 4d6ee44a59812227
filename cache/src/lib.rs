//! snapserve's cache manager, as pure data structures.
//!
//! The working pool of KV pages (free list, per-slot page tables, slot generations,
//! reservations), the budgeted snapshot store (charges, recency, pins, tiers), prefix hashing and
//! the frames that describe a save or a restore. Everything here is synchronous and owns no KV
//! bytes: the engine holds the bytes, this crate decides where they go. It never knows about
//! actix or CUDA.
//!
//! - [`geometry`]: the KV shape and the byte sizes derived from it.
//! - [`ids`]: slot, generation, snapshot and backing identifiers.
//! - [`pool`]: the working pool ([`PagePool`]).
//! - [`prefix`]: chained page hashes ([`PrefixHasher`]).
//! - [`logits`]: the logits after repeated whole prompts ([`PromptLogits`]).
//! - [`store`]: the snapshot store ([`SnapshotStore`]).
//! - [`plan`]: page copies between snapshots and the pool.
//! - [`checksum`]: the block sums every copy of snapshot bytes is checked by.
//! - [`frame`]: the validated record of a save or restore ([`Frame`]).
//! - [`snapshot_file`]: the disk tier's self-checking file format.
//! - [`error`]: the crate's one error type, [`CacheError`].

pub mod checksum;
pub mod error;
pub mod frame;
pub mod geometry;
pub mod ids;
pub mod logits;
pub mod plan;
pub mod pool;
pub mod prefix;
pub mod snapshot_file;
pub mod store;

pub use error::CacheError;
pub use frame::{FRAME_LEN, Frame, FrameKind, payload_crc32};
pub use geometry::{KvGeometry, PageId, SnapshotGeometry};
pub use ids::{BackingId, Generation, SlotHandle, SlotId, SnapshotId};
pub use logits::{PromptLogits, PromptLogitsStats};
pub use plan::{PageClone, PageCopy, page_clones};
pub use pool::{PagePool, PoolConfig, PoolStats};
pub use prefix::{PrefixHash, PrefixHasher, PrefixSalt};
pub use store::{
    Eviction, FlushCopy, FlushPlan, Found, LookupHit, PinnedRestore, Promotion, PromotionStart,
    RestorePlan, SaveReservation, SaveStart, SnapshotInfo, SnapshotState, SnapshotStore,
    StoreStats, Tier, TierStats,
};
