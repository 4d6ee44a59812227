//! snapserve's cache manager, as pure data structures.
//!
//! The working pool of KV pages (free list, per-slot page tables, slot generations,
//! reservations), the budgeted snapshot store (charges, recency, pins, tiers), prefix hashing and
//! the frames that describe a save or a restore. Everything here is synchronous and owns no KV
//! bytes: the engine holds the bytes, this crate decides where they go. It never knows about
//! actix or CUDA.

pub mod geometry;

pub use geometry::{KvGeometry, PageId};
