//! snapserve's actors, HTTP server and metrics.
//!
//! `Engine` (the backend, on its own thread), `KvPool` (the working pool's bookkeeping),
//! `SnapshotStore` (the snapshot index) and `Admission` (queue and scheduler) talk only by
//! messages; the HTTP handlers validate a request, submit it to `Admission` and read the
//! request's own token channel. This is the only crate that knows actix.
