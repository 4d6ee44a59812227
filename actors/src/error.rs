//! The actors' one error type: why a request was refused or why it failed.
//!
//! Every variant is something a caller can see and act on, and carries a stable machine code;
//! the HTTP status is decided from the code in one place (the server). Values are `Clone` so a
//! failure can be delivered on a request's channel and logged.

use std::time::Duration;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ServeError {
    /// The queue is full; try again after `retry_after`.
    #[error("the server is overloaded; retry after {} ms", retry_after.as_millis())]
    Overloaded { retry_after: Duration },

    /// The request can never run as given.
    #[error("invalid request: {0}")]
    Invalid(String),

    /// More sequences (prompts × `n`) than the queue can ever hold at once.
    #[error("invalid request: {}", too_many(*prompts, *n, *max_queue))]
    TooManyChoices {
        prompts: usize,
        n: usize,
        max_queue: usize,
    },

    /// A prefix to keep could not be saved: it does not fit beside the snapshots that must
    /// stay, or its copy failed.
    #[error("the prefix was not kept: {0}")]
    NotKept(String),

    /// The scheduler has stopped.
    #[error("the server is shutting down")]
    ShuttingDown,

    /// Cancelled by whoever holds the request's id ([`crate::Handles::cancel`]).
    #[error("the request was cancelled")]
    Cancelled,

    /// The backend failed a step this request was part of.
    #[error("the engine failed: {0}")]
    Engine(String),

    /// The output could not follow the request's grammar (`response_format`, a forced tool
    /// call): the grammar engine failed or allowed no token.
    #[error("the output could not follow its grammar: {0}")]
    Grammar(String),

    /// The pool had no room for the request's next tokens after every back-off attempt.
    #[error(
        "context full: needed {needed_pages} more pages, {free_pages} available, after {attempts} attempts"
    )]
    ContextFull {
        needed_pages: usize,
        free_pages: usize,
        attempts: u32,
    },
}

impl ServeError {
    /// A stable identifier for clients and metrics.
    pub fn code(&self) -> &'static str {
        match self {
            ServeError::Overloaded { .. } => "overloaded",
            ServeError::Invalid(_) | ServeError::TooManyChoices { .. } => "validation",
            ServeError::ShuttingDown => "shutting_down",
            ServeError::Cancelled => "cancelled",
            ServeError::Engine(_) => "engine_error",
            ServeError::NotKept(_) => "snapshot_refused",
            ServeError::Grammar(_) => "grammar_error",
            ServeError::ContextFull { .. } => "context_full",
        }
    }
}

fn too_many(prompts: usize, n: usize, max_queue: usize) -> String {
    let asked = match prompts {
        1 => format!("n is {n}"),
        _ => format!(
            "{prompts} prompts with n = {n} are {} sequences",
            prompts * n
        ),
    };
    format!("{asked}; this server queues at most {max_queue} requests")
}
