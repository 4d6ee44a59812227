//! snapserve's actors, HTTP server and metrics.
//!
//! `Engine` (the backend, on its own thread), `KvPool` (the working pool's bookkeeping),
//! `SnapshotStore` (the snapshot index) and `Admission` (queue and scheduler) talk only by
//! messages. Callers submit through [`Handles`] and read their request's own channel. This is
//! the only crate that knows actix.
//!
//! - [`start`]: builds the actors around a backend and returns their [`Handles`].
//! - [`admission`], [`engine`], [`kv_pool`], [`snapshot_store`]: one file per actor, with its
//!   messages.
//! - [`scheduler`]: the scheduling state machine the `Admission` actor drives, pure and tested
//!   without a runtime; [`exchange`]: what it exchanges with the other actors each step.
//! - [`request`], [`error`]: what callers send and receive.
//! - [`http`]: the OpenAI-compatible HTTP API over [`Handles`]; [`metrics`]: its Prometheus
//!   metrics; [`loadtest`]: the client side, for `snapserve loadtest`.

pub mod admission;
pub mod engine;
pub mod error;
pub mod exchange;
pub mod http;
pub mod kv_pool;
mod lines;
pub mod loadtest;
mod mailbox;
pub mod metrics;
pub mod request;
pub mod scheduler;
pub mod snapshot_store;
mod start;

pub use error::ServeError;
pub use request::{
    Completion, Event, FinishReason, GenerateRequest, RequestId, RequestStream, Usage,
    install_stream_inbox,
};
pub use start::{Handles, Parts, ServeConfig, Stats, build, start};
