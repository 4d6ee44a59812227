//! How much of the working pool a sequence is promised when it is admitted.
//!
//! Owns the choice between the two reservation policies of DESIGN.md and the arithmetic of what
//! each reserves. It never touches the pool: `cache::PagePool` does the accounting with the
//! number this module returns.

use serde::{Deserialize, Serialize};

/// What a sequence reserves at admission (`cache.reservation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReservationPolicy {
    /// Reserve prompt + `max_tokens` up front: an admitted sequence never runs dry, at the
    /// price of admitting fewer sequences.
    #[default]
    WorstCase,
    /// Reserve nothing: pages are taken as the sequence grows, and a sequence that finds the
    /// pool empty gets `ContextFull` and backs off.
    Optimistic,
}

impl ReservationPolicy {
    /// Tokens to reserve when a sequence with this prompt and generation limit is admitted.
    pub fn tokens_at_admission(self, prompt_tokens: usize, max_new_tokens: usize) -> usize {
        match self {
            ReservationPolicy::WorstCase => prompt_tokens + max_new_tokens,
            ReservationPolicy::Optimistic => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worst_case_reserves_prompt_and_generation_optimistic_nothing() {
        assert_eq!(
            ReservationPolicy::WorstCase.tokens_at_admission(100, 28),
            128
        );
        assert_eq!(
            ReservationPolicy::Optimistic.tokens_at_admission(100, 28),
            0
        );
    }
}
