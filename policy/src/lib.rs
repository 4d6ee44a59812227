//! snapserve's configuration and policies.
//!
//! Configuration arrives as TOML, is read into serde structs that refuse unknown keys, and is
//! validated here into the runtime structs the rest of the server is built from. The policies a
//! configuration chooses (eviction, reservation, back-off, admission) live here too, as plain
//! synchronous Rust tested without a runtime. This crate depends on nothing else of ours.
