//! Speculative decoding's draft sources: what proposes the tokens a target model then verifies.
//!
//! A draft source proposes up to `k` tokens to follow a sequence; the target model runs the
//! sequence's last token and the draft in one forward pass (width `k + 1`), and its sampler
//! picks at each drafted position in turn, exactly as it would one step at a time, keeping
//! drafted tokens while its picks agree ([`crate::backend::Backend::step_and_verify`], one rule
//! for every backend: [`crate::backend::verify_row`]). Greedy, that keeps the longest draft prefix
//! equal to the target's argmax, then the target's own token. Sampled, with a deterministic draft
//! such as prompt lookup's (a point mass `q` on the proposed token), it is the rejection rule of
//! speculative sampling (Leviathan et al., Chen et al.): draft token `x` is kept with probability
//! `p(x)`, and at the first refusal the token emitted is distributed as `p` without `x`,
//! renormalised; so the output is distributed exactly as the target's, and a seeded request
//! draws the very same numbers as without drafts. `generate --speculate` runs it for one
//! sequence; the server's scheduler drafts for each decoding request and verifies the drafts
//! inside its batched steps (`[speculative]`).

/// Something that proposes the tokens likely to follow a sequence.
pub trait DraftSource: Send {
    /// Up to `max` tokens proposed to follow `context` (the prompt and the tokens generated so
    /// far); empty when it has no guess.
    fn propose(&mut self, context: &[u32], max: usize) -> Vec<u32>;
}

/// Prompt lookup: finds the latest earlier place where the sequence's last `n` tokens occurred
/// (the longest `n` from `ngram_max` down to `ngram_min` that matches) and proposes the tokens
/// that followed it there. Free, and right whenever the output copies its input: rewriting,
/// summarising or editing a given text, answering with quotes, filling in code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLookup {
    pub ngram_min: usize,
    pub ngram_max: usize,
}

impl DraftSource for PromptLookup {
    fn propose(&mut self, context: &[u32], max: usize) -> Vec<u32> {
        let len = context.len();
        if max == 0 || len < 2 {
            return Vec::new();
        }
        let longest = self.ngram_max.min(len - 1);
        for n in (self.ngram_min.max(1)..=longest).rev() {
            let tail = &context[len - n..];
            // The latest earlier occurrence whose continuation lies inside the context.
            let found = (0..len - n)
                .rev()
                .find(|&start| &context[start..start + n] == tail);
            if let Some(start) = found {
                // What followed the match; where that runs into the end of the context, the
                // proposal goes on by the same period (its own first tokens), so a repeating
                // run is drafted whole.
                let from = start + n;
                let mut proposal = Vec::with_capacity(max);
                for i in 0..max {
                    let at = from + i;
                    proposal.push(if at < len {
                        context[at]
                    } else {
                        proposal[at - len]
                    });
                }
                return proposal;
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lookup_continues_the_latest_match_of_the_longest_ngram() {
        let mut lookup = PromptLookup {
            ngram_min: 1,
            ngram_max: 3,
        };
        // "a b c d a b c" → the trigram "a b c" occurred at 0, followed by "d a b c".
        let context = [1, 2, 3, 4, 1, 2, 3];
        assert_eq!(lookup.propose(&context, 3), vec![4, 1, 2]);
        // Past the end of the context it goes on by the match's period.
        assert_eq!(lookup.propose(&context, 6), vec![4, 1, 2, 3, 4, 1]);
        assert_eq!(lookup.propose(&[8, 5, 5, 5], 4), vec![5, 5, 5, 5]);
        // The latest occurrence wins: "9" was followed by 5 once and by 6 later.
        assert_eq!(lookup.propose(&[9, 5, 9, 6, 9], 1), vec![6]);
        // No earlier occurrence of any n-gram: no draft.
        assert_eq!(lookup.propose(&[1, 2, 3], 4), Vec::<u32>::new());
        assert_eq!(lookup.propose(&[7], 4), Vec::<u32>::new());
        assert_eq!(lookup.propose(&context, 0), Vec::<u32>::new());
    }

    #[test]
    fn prompt_lookup_respects_the_shortest_ngram() {
        let mut lookup = PromptLookup {
            ngram_min: 2,
            ngram_max: 3,
        };
        // Only the unigram "9" repeats; bigrams do not.
        assert_eq!(lookup.propose(&[9, 5, 8, 9], 2), Vec::<u32>::new());
    }
}
