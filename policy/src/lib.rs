//! snapserve's configuration and policies.
//!
//! Configuration arrives as TOML, is read into serde structs that refuse unknown keys, and is
//! validated here into the runtime structs the rest of the server is built from. The policies a
//! configuration chooses (eviction, reservation, back-off, admission) live here too, as plain
//! synchronous Rust tested without a runtime. This crate depends on nothing else of ours.
//!
//! - [`config`]: the raw TOML sections and their validation into [`Policies`].
//! - [`eviction`]: the order in which unpinned snapshots are given up ([`EvictionPolicy`], [`Lru`]).
//! - [`reservation`]: how many tokens a sequence reserves at admission ([`ReservationPolicy`]).
//! - [`backoff`]: per-job capped exponential back-off with jitter ([`Backoff`]).
//! - [`step_time`]: the learnt time of an engine step, which sizes prompt chunks to
//!   `admission.max_step_ms` ([`StepTimeModel`]).
//! - [`draft_length`]: how many drafted tokens each row of a step verifies, by what a token is
//!   expected to add against what it costs ([`draft_lengths`], [`Acceptance`]).
//! - [`error`]: the crate's one error type, [`PolicyError`].

pub mod backoff;
pub mod config;
pub mod draft_length;
pub mod error;
pub mod eviction;
pub mod reservation;
pub mod step_time;

pub use backoff::{Backoff, BackoffPolicy, BackoffStep, OnExhausted};
pub use config::{
    AdmissionConfig, AdmissionPolicy, BackendKind, BackoffConfig, CacheConfig, CachePolicy, Config,
    DraftSizing, EngineConfig, MAX_VERIFY_WIDTH, Policies, PoolSize, Quantization, ServerConfig,
    ServerPolicy, SnapshotConfig, SnapshotPolicy, SpeculativeConfig, SpeculativeMethod,
};
pub use draft_length::{Acceptance, DraftCost, DraftOffer, draft_lengths};
pub use error::PolicyError;
pub use eviction::{EvictionKind, EvictionPolicy, Lru};
pub use reservation::ReservationPolicy;
pub use step_time::{StepTimeFit, StepTimeModel};
