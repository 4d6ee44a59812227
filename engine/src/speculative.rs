//! Speculative decoding's two halves that need no model: proposing draft tokens, and deciding
//! which of them the target model accepts.
//!
//! A draft source proposes up to `k` tokens to follow a sequence; the target model then runs
//! the sequence's last token and the draft in one forward pass (width `k + 1`) and gives the
//! distribution after each. The acceptance rules here turn those distributions into the tokens
//! the request emits:
//!
//! - greedy: the longest draft prefix equal to the target's argmax at each place, then the
//!   target's own argmax after it, so the text is exactly what decoding one token at a time
//!   gives;
//! - sampled: the rejection rule of speculative sampling (Leviathan et al., Chen et al.), which
//!   emits tokens distributed exactly as the target's: draft token `x` is kept with probability
//!   `min(1, p(x) / q(x))`; at the first refusal the token is drawn from the residual
//!   `max(0, p − q)`, renormalised; with every draft token kept one more is drawn from the
//!   target's last distribution. A draft from prompt lookup is deterministic (`q` is a point
//!   mass on the proposed token), so keeping `x` happens with probability `p(x)` and the
//!   residual is `p` with `x` removed.
//!
//! In practice both rules are one: the sampler picks at each drafted position in turn, exactly
//! as it would one step at a time, and a drafted token is kept while the pick equals it
//! ([`crate::backend::Backend::step_and_verify`]). With a deterministic draft that is the
//! rejection rule above, and a seeded request draws the very same numbers as without drafts.
//! `generate --speculate` runs it for one sequence; the server's scheduler drafts for each
//! decoding request and verifies the drafts inside its batched steps (`[speculative]`).

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

/// What a verification step decided for one sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// How many draft tokens were kept, from the front.
    pub accepted: usize,
    /// The token after them: the target's own (a correction or one more).
    pub next: u32,
}

impl Verdict {
    /// The tokens the sequence emits: the kept draft, then `next`.
    pub fn tokens(&self, draft: &[u32]) -> Vec<u32> {
        let mut out = draft[..self.accepted].to_vec();
        out.push(self.next);
        out
    }
}

/// Greedy acceptance. `argmax[i]` is the target's argmax after the sequence's last token and
/// the first `i` draft tokens: `draft.len() + 1` of them.
pub fn accept_greedy(draft: &[u32], argmax: &[u32]) -> Verdict {
    assert_eq!(
        argmax.len(),
        draft.len() + 1,
        "one target choice per draft token and one after them"
    );
    let accepted = draft.iter().zip(argmax).take_while(|(d, t)| d == t).count();
    Verdict {
        accepted,
        next: argmax[accepted],
    }
}

/// Sampled acceptance of a deterministic draft (prompt lookup). `probs[i]` is the target's
/// distribution (after temperature, top-k/top-p: what it would sample from) after the last
/// token and the first `i` draft tokens; `uniform` draws from [0, 1). The emitted tokens are
/// distributed exactly as sampling the target one token at a time.
pub fn accept_sampled(
    draft: &[u32],
    probs: &[Vec<f32>],
    mut uniform: impl FnMut() -> f64,
) -> Verdict {
    assert_eq!(
        probs.len(),
        draft.len() + 1,
        "one target distribution per draft token and one after them"
    );
    for (i, &token) in draft.iter().enumerate() {
        let p = &probs[i];
        let keep = p.get(token as usize).copied().unwrap_or(0.0) as f64;
        if uniform() < keep {
            continue;
        }
        // Refused: the residual max(0, p − q) is p without the proposed token.
        let next = draw(p, Some(token), uniform());
        return Verdict { accepted: i, next };
    }
    let next = draw(&probs[draft.len()], None, uniform());
    Verdict {
        accepted: draft.len(),
        next,
    }
}

/// Draws from `p` (with `without` removed and the rest renormalised) by inverting its
/// cumulative sum at `u`.
fn draw(p: &[f32], without: Option<u32>, u: f64) -> u32 {
    let weight = |i: usize| {
        if Some(i as u32) == without {
            0.0
        } else {
            p[i].max(0.0) as f64
        }
    };
    let total: f64 = (0..p.len()).map(weight).sum();
    if total <= 0.0 {
        // Nothing left (p was a point mass on the refused token, which cannot be refused
        // then): the most probable token.
        return crate::sampling::argmax(p);
    }
    let target = u * total;
    let mut acc = 0.0;
    let mut last = 0;
    for i in 0..p.len() {
        let w = weight(i);
        if w > 0.0 {
            acc += w;
            last = i;
            if target < acc {
                return i as u32;
            }
        }
    }
    last as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};

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

    #[test]
    fn greedy_acceptance_keeps_the_agreeing_prefix_then_the_target_s_token() {
        let draft = [5, 6, 7];
        assert_eq!(
            accept_greedy(&draft, &[5, 6, 9, 1]),
            Verdict {
                accepted: 2,
                next: 9
            }
        );
        assert_eq!(
            accept_greedy(&draft, &[5, 6, 7, 8]).tokens(&draft),
            vec![5, 6, 7, 8]
        );
        assert_eq!(accept_greedy(&draft, &[1, 6, 7, 8]).tokens(&draft), vec![1]);
        assert_eq!(accept_greedy(&[], &[4]).tokens(&[]), vec![4]);
    }

    /// The first emitted token, and the second when the first was a kept draft token, follow
    /// the target's distributions exactly: checked over 200,000 seeded trials against the
    /// exact probabilities, within 4.5 standard errors.
    #[test]
    fn sampled_acceptance_emits_the_target_s_distribution() {
        let p0 = vec![0.1f32, 0.5, 0.3, 0.1];
        let p1 = vec![0.25f32, 0.25, 0.4, 0.1];
        let p2 = vec![0.7f32, 0.1, 0.1, 0.1];
        let draft = [1u32, 2];
        let probs = vec![p0.clone(), p1.clone(), p2];
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let trials = 200_000;
        let mut first = [0usize; 4];
        let mut second_after_1 = [0usize; 4];
        let mut after_1 = 0;
        let mut kept = [0usize; 3];
        for _ in 0..trials {
            let verdict = accept_sampled(&draft, &probs, || rng.random::<f64>());
            kept[verdict.accepted] += 1;
            let tokens = verdict.tokens(&draft);
            first[tokens[0] as usize] += 1;
            if tokens[0] == 1 {
                after_1 += 1;
                second_after_1[tokens[1] as usize] += 1;
            }
        }
        let check = |counts: &[usize; 4], n: usize, p: &[f32]| {
            for (i, (&c, &pi)) in counts.iter().zip(p).enumerate() {
                let pi = pi as f64;
                let se = (pi * (1.0 - pi) / n as f64).sqrt();
                let got = c as f64 / n as f64;
                assert!(
                    (got - pi).abs() < 4.5 * se,
                    "token {i}: {got:.4} against {pi:.4} (se {se:.5})"
                );
            }
        };
        check(&first, trials, &p0);
        check(&second_after_1, after_1, &p1);
        // Draft token 1 is kept with p0(1) = 0.5, then token 2 with p1(2) = 0.4.
        let kept_both = kept[2] as f64 / trials as f64;
        assert!((kept_both - 0.2).abs() < 0.01, "{kept_both}");
    }

    #[test]
    fn a_point_mass_on_the_draft_is_always_kept() {
        let probs = vec![vec![0.0, 1.0], vec![1.0, 0.0]];
        let mut u = [0.999_999, 0.3].into_iter();
        let verdict = accept_sampled(&[1], &probs, || u.next().unwrap());
        assert_eq!(verdict.tokens(&[1]), vec![1, 0]);
    }
}
