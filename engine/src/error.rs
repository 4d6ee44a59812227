//! The engine's one error type.
//!
//! Every variant is a failure a user can cause or fix (a bad folder, a corrupt file, a bad
//! parameter) and names what is wrong; broken invariants are `expect`s at their site instead.

use std::path::PathBuf;

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("invalid sampling parameter `{name}`: {reason}")]
    InvalidSampling { name: &'static str, reason: String },
}

impl EngineError {
    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}
