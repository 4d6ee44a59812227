//! The policy crate's one error type.
//!
//! Every configuration failure names the key it is about, spelled as in the TOML file
//! (`backoff.max_ms`), so an operator can fix the file without reading our source.

/// A configuration that could not be read or is not acceptable.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// The text is not TOML, has a value of the wrong type, or has a key we do not know.
    #[error("configuration could not be read: {0}")]
    Parse(#[from] toml::de::Error),
    /// A value that parsed but is out of range or contradicts another value.
    #[error("{key} {reason}")]
    Invalid { key: &'static str, reason: String },
}

impl PolicyError {
    pub(crate) fn invalid(key: &'static str, reason: impl Into<String>) -> Self {
        PolicyError::Invalid {
            key,
            reason: reason.into(),
        }
    }

    /// The configuration key this error is about, when it is about one.
    pub fn key(&self) -> Option<&'static str> {
        match self {
            PolicyError::Parse(_) => None,
            PolicyError::Invalid { key, .. } => Some(key),
        }
    }
}
