//! How many drafted tokens each row of a step verifies (speculative decoding).
//!
//! A drafted token costs the step a token's compute whether it is kept or not, and is worth a
//! token only if the target keeps it. So a draft pays when the tokens it is expected to add
//! are worth more than the time it adds: on a GPU at small batch a verify step of eight tokens
//! costs little more than a decode step (it reads the same weights), and a draft pays even when
//! most of it is refused; on a CPU a step's time grows with its tokens, and a draft that is
//! usually refused makes decoding slower than no draft at all.
//!
//! Each request keeps an [`Acceptance`]: how often the target kept the first drafted token,
//! and how often it kept a drafted token after a kept one, recent verifications counting most,
//! and drifting back toward a prior while its drafts are declined (so that a request whose
//! drafts failed tries again now and then). Position `k` of a draft is then kept with chance
//! about `first × after_kept^k`. [`draft_lengths`] hands out drafted tokens one at a time,
//! always to the row whose next token is most likely kept, and keeps the prefix of that order
//! whose expected tokens per
//! predicted second are highest, no drafts at all included. The scheduler learns the two costs
//! apart from its own steps ([`DraftCost`]): a step without drafts, and a verify step as a
//! line in its tokens. They differ by more than the drafted tokens' compute: a verify step
//! takes another path through the engine (on the H200, SmolLM2's batch-1 decode step is 0.58
//! ms and a verify step of two tokens ~0.9), and one line through both kinds of step read that
//! fixed difference as a per-token cost of ~0.4 ms, declined every draft and never learnt
//! otherwise. Until both are known every row verifies its whole proposal, which is also how
//! they are learnt. The verify line is anchored by steps the warm-up timed
//! ([`crate::StepTimeModel::anchor`]) and read flat where the cost does not grow with the
//! tokens ([`crate::StepTimeModel::fit_or_flat`]): fed only verify steps of two tokens, the
//! line had charged each extra drafted token a whole step's time (0.47 ms on the H200), so
//! every draft stayed one token long.
//!
//! Costs: O(drafted tokens × rows) per step, four floats per request.

use crate::step_time::StepTimeFit;

/// Weight the past keeps at each observation: about the last seven count (seven first tokens,
/// or one whole draft's continuations).
const KEEP: f64 = 0.85;

/// Weight the evidence keeps, against the prior, at each step whose draft was declined.
const DRIFT: f64 = 0.95;

/// A decaying count of drafted tokens the target looked at and kept.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Tally {
    kept: f64,
    looked: f64,
}

impl Tally {
    fn observe(&mut self, kept: bool) {
        self.kept = self.kept * KEEP + f64::from(u8::from(kept));
        self.looked = self.looked * KEEP + 1.0;
    }

    fn drift_to(&mut self, prior: Tally) {
        self.kept = self.kept * DRIFT + prior.kept * (1.0 - DRIFT);
        self.looked = self.looked * DRIFT + prior.looked * (1.0 - DRIFT);
    }

    fn rate(&self) -> f64 {
        self.kept / self.looked
    }
}

/// One request's record of its verifications, recent ones weighing most, in two parts: how
/// often the first drafted token is kept, and how often a drafted token is kept after a kept
/// one. Prompt lookup's drafts are all or nothing: the first token decides whether the text is
/// copying its input here, and once it is, the rest of the draft mostly follows. One rate for
/// every position (a geometric fall-off) makes a draft's later tokens look worthless wherever
/// its first is often refused, and sized drafts too short exactly where copying runs are long.
/// Both parts start from a prior of four kept of five looked at, which fades like any other
/// evidence: a proposal exists only where the context already repeats itself, and a short
/// answer has no time to learn its way up from a cautious start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Acceptance {
    first: Tally,
    after_kept: Tally,
}

const PRIOR: Tally = Tally {
    kept: 4.0,
    looked: 5.0,
};

impl Default for Acceptance {
    fn default() -> Self {
        Acceptance {
            first: PRIOR,
            after_kept: PRIOR,
        }
    }
}

impl Acceptance {
    /// Records a verification of a `drafted`-token draft of which the first `kept` were kept:
    /// the first token looked at, then each one after a kept one up to the first refusal.
    pub fn observe(&mut self, drafted: usize, kept: usize) {
        if drafted == 0 {
            return;
        }
        self.first.observe(kept > 0);
        let looked_after = kept.saturating_sub(1) + usize::from(kept > 0 && kept < drafted);
        for i in 0..looked_after {
            self.after_kept.observe(i + 1 < kept);
        }
    }

    /// Records a step where its draft was not worth verifying: the estimates drift back
    /// toward the prior, so a request whose drafts were refused tries again after a while (its
    /// text may have turned to copying its input), and keeps trying seldom if they still are.
    pub fn declined(&mut self) {
        self.first.drift_to(PRIOR);
        self.after_kept.drift_to(PRIOR);
    }

    /// The estimated chance that the first drafted token is kept.
    pub fn first(&self) -> f64 {
        self.first.rate()
    }

    /// The estimated chance that a drafted token is kept when the one before it was.
    pub fn after_kept(&self) -> f64 {
        self.after_kept.rate()
    }

    /// The offer of a draft of `proposed` tokens.
    pub fn offer(&self, proposed: usize) -> DraftOffer {
        DraftOffer {
            first: self.first(),
            after_kept: self.after_kept(),
            proposed,
        }
    }
}

/// A row of the step that has a draft to offer: drafted token `k` (from 0) is kept with
/// chance `first × after_kept^k`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftOffer {
    /// Its request's [`Acceptance::first`].
    pub first: f64,
    /// Its request's [`Acceptance::after_kept`].
    pub after_kept: f64,
    /// Tokens its draft proposes.
    pub proposed: usize,
}

/// What a step costs with and without drafts, as the scheduler has learnt it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftCost {
    /// The step as planned, without drafts.
    pub plain_seconds: f64,
    /// A step that verifies drafts, by its tokens (drafted ones included).
    pub verify: StepTimeFit,
}

/// How many of each offer's tokens to verify, in order: `tokens` is what the step holds without
/// drafts, `sampled` how many tokens it picks without drafts (its rows that sample).
pub fn draft_lengths(
    offers: &[DraftOffer],
    tokens: usize,
    sampled: usize,
    cost: Option<DraftCost>,
) -> Vec<usize> {
    let Some(cost) = cost.filter(|cost| cost.plain_seconds > 0.0) else {
        return offers.iter().map(|offer| offer.proposed).collect();
    };
    let mut lengths = vec![0; offers.len()];
    // The next token of each row: its chance of being kept.
    let mut next: Vec<f64> = offers.iter().map(|offer| offer.first).collect();
    let mut expected = sampled.max(1) as f64;
    // Which row took each token handed out, and the best prefix of those (yield per second).
    let mut order = Vec::new();
    let mut best = (expected / cost.plain_seconds, 0);
    loop {
        let pick = (0..offers.len())
            .filter(|&i| lengths[i] < offers[i].proposed)
            .max_by(|&a, &b| next[a].total_cmp(&next[b]));
        let Some(i) = pick else { break };
        expected += next[i];
        lengths[i] += 1;
        next[i] *= offers[i].after_kept;
        order.push(i);
        // A step with drafts is never cheaper than the same step without.
        let seconds = cost
            .verify
            .seconds(tokens + order.len())
            .max(cost.plain_seconds);
        if expected / seconds > best.0 {
            best = (expected / seconds, order.len());
        }
    }
    let mut lengths = vec![0; offers.len()];
    for &i in &order[..best.1] {
        lengths[i] += 1;
    }
    lengths
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fit(fixed_ms: f64, per_token_ms: f64) -> StepTimeFit {
        StepTimeFit {
            fixed_seconds: fixed_ms / 1e3,
            per_token_seconds: per_token_ms / 1e3,
        }
    }

    /// One line through steps with and without drafts, the plain step holding `tokens`.
    fn linear(fixed_ms: f64, per_token_ms: f64, tokens: usize) -> Option<DraftCost> {
        let verify = fit(fixed_ms, per_token_ms);
        Some(DraftCost {
            plain_seconds: verify.seconds(tokens),
            verify,
        })
    }

    /// An offer whose every drafted token the target keeps with chance `rate` after a kept one
    /// (one rate for every position).
    fn offer(rate: f64, proposed: usize) -> DraftOffer {
        DraftOffer {
            first: rate,
            after_kept: rate,
            proposed,
        }
    }

    #[test]
    fn without_a_cost_every_proposal_is_verified_whole() {
        let offers = [offer(0.1, 7), offer(0.9, 3)];
        assert_eq!(draft_lengths(&offers, 2, 2, None), vec![7, 3]);
    }

    #[test]
    fn a_cheap_token_is_verified_even_when_seldom_kept() {
        // A GPU at batch 1: a verify step of 8 costs ~1.1 decode steps.
        let lengths = draft_lengths(&[offer(0.5, 7)], 1, 1, linear(4.3, 0.07, 1));
        assert!(lengths[0] >= 4, "{lengths:?}");
        assert_eq!(
            draft_lengths(&[offer(0.95, 7)], 1, 1, linear(4.3, 0.07, 1)),
            vec![7]
        );
    }

    #[test]
    fn a_costly_token_is_verified_only_when_likely_kept() {
        // Two CPU cores: every token of a step adds a sixth of a decode step.
        let cost = linear(15.0, 2.5, 1);
        assert_eq!(draft_lengths(&[offer(0.1, 7)], 1, 1, cost), vec![0]);
        let likely = draft_lengths(&[offer(0.85, 7)], 1, 1, cost)[0];
        assert!((3..=7).contains(&likely), "{likely}");
        let less = draft_lengths(&[offer(0.6, 7)], 1, 1, cost)[0];
        assert!(less < likely && less >= 1, "{less} against {likely}");
    }

    #[test]
    fn each_kept_token_is_worth_what_the_step_yields() {
        // The chosen length maximizes expected tokens per second for one row.
        let cost = linear(15.0, 2.5, 1);
        for rate in [0.3, 0.5, 0.7, 0.8, 0.9, 0.97] {
            let chosen = draft_lengths(&[offer(rate, 7)], 1, 1, cost)[0];
            let per_second = |d: usize| {
                let tokens: f64 = (0..=d).map(|k| rate.powi(k as i32)).sum();
                tokens / cost.unwrap().verify.seconds(1 + d)
            };
            let best = (0..=7).max_by(|&a, &b| per_second(a).total_cmp(&per_second(b)));
            assert_eq!(Some(chosen), best, "rate {rate}");
        }
    }

    #[test]
    fn a_verify_step_s_own_fixed_cost_is_weighed_against_the_whole_draft() {
        // SmolLM2 on the H200 at batch 1: a decode step 0.58 ms, a verify step 0.9 ms and
        // ~15 µs a token. One drafted token does not pay for the verify path; a draft likely
        // kept does, whole; a draft seldom kept does not at any length.
        let c = DraftCost {
            plain_seconds: 0.58e-3,
            verify: fit(0.87, 0.015),
        };
        let cost = Some(c);
        assert_eq!(draft_lengths(&[offer(0.9, 7)], 1, 1, cost), vec![7]);
        assert!(draft_lengths(&[offer(0.6, 7)], 1, 1, cost)[0] >= 5);
        assert_eq!(draft_lengths(&[offer(0.2, 7)], 1, 1, cost), vec![0]);
        // Each length's yield per second, against the chosen one's.
        for rate in [0.2, 0.4, 0.5, 0.6, 0.9] {
            let chosen = draft_lengths(&[offer(rate, 7)], 1, 1, cost)[0];
            let per_second = |d: usize| {
                let tokens: f64 = (0..=d).map(|k| rate.powi(k as i32)).sum();
                let seconds = if d == 0 {
                    c.plain_seconds
                } else {
                    c.verify.seconds(1 + d).max(c.plain_seconds)
                };
                tokens / seconds
            };
            let best = (0..=7).max_by(|&a, &b| per_second(a).total_cmp(&per_second(b)));
            assert_eq!(Some(chosen), best, "rate {rate}");
        }
    }

    #[test]
    fn tokens_go_to_the_rows_most_likely_to_keep_them() {
        let lengths = draft_lengths(
            &[offer(0.3, 7), offer(0.9, 7), offer(0.6, 7)],
            3,
            3,
            linear(15.0, 1.0, 3),
        );
        assert!(
            lengths[1] > lengths[2] && lengths[2] > lengths[0],
            "{lengths:?}"
        );
        assert_eq!(
            draft_lengths(&[offer(0.9, 2)], 1, 1, linear(15.0, 1.0, 1)),
            vec![2]
        );
    }

    #[test]
    fn acceptance_follows_recent_verifications() {
        let mut a = Acceptance::default();
        assert!((a.first() - 0.8).abs() < 1e-12 && (a.after_kept() - 0.8).abs() < 1e-12);
        for _ in 0..10 {
            a.observe(7, 7);
        }
        assert!(a.first() > 0.9 && a.after_kept() > 0.9, "{a:?}");
        for _ in 0..10 {
            a.observe(4, 0);
        }
        assert!(a.first() < 0.4, "{a:?}");
        assert!(
            a.after_kept() > 0.9,
            "refusals of a first token teach nothing after it"
        );
        let before = a;
        a.observe(0, 0);
        assert_eq!(a, before, "no draft, nothing learnt");
        // Declined drafts: back toward the prior, slowly.
        let low = a.first();
        a.declined();
        assert!(
            a.first() > low && a.first() < low + 0.05,
            "{low} {}",
            a.first()
        );
        for _ in 0..200 {
            a.declined();
        }
        assert!((a.first() - 0.8).abs() < 1e-3, "{a:?}");
        assert!((a.after_kept() - 0.8).abs() < 1e-3, "{a:?}");
    }

    #[test]
    fn a_kept_run_teaches_the_rate_after_a_kept_token() {
        // Three kept of seven, the fourth refused: three looked at after a kept one (positions
        // 1, 2 and 3), two of them kept.
        let mut a = Acceptance {
            first: Tally {
                kept: 0.0,
                looked: 0.0,
            },
            after_kept: Tally {
                kept: 0.0,
                looked: 0.0,
            },
        };
        a.observe(7, 3);
        assert_eq!(
            a.first,
            Tally {
                kept: 1.0,
                looked: 1.0
            }
        );
        let weight = KEEP * KEEP + KEEP + 1.0;
        assert!((a.after_kept.looked - weight).abs() < 1e-12, "{a:?}");
        assert!(
            (a.after_kept.kept - (KEEP * KEEP + KEEP)).abs() < 1e-12,
            "{a:?}"
        );
        // A whole draft kept: nothing refused, six looked at after a kept one.
        let mut whole = Acceptance::default();
        whole.observe(7, 7);
        assert!(whole.after_kept() > 0.8);
    }

    #[test]
    fn all_or_nothing_drafts_are_verified_whole() {
        // Prompt lookup on a rewrite: a third of the drafts start right, and those mostly run
        // to their end. On the H200's costs the whole draft pays; a rate shared by every
        // position (the pooled one such drafts show, ~0.45) would have verified less of it.
        let cost = Some(DraftCost {
            plain_seconds: 0.58e-3,
            verify: fit(0.87, 0.015),
        });
        let copying = DraftOffer {
            first: 0.35,
            after_kept: 0.95,
            proposed: 7,
        };
        assert_eq!(draft_lengths(&[copying], 1, 1, cost), vec![7]);
        assert_eq!(draft_lengths(&[offer(0.35, 7)], 1, 1, cost), vec![0]);
        // On two CPU cores, where each token costs a sixth of a step, fewer and only the
        // likelier ones.
        let cpu = linear(15.0, 2.5, 1);
        let rarely = DraftOffer {
            first: 0.1,
            ..copying
        };
        assert_eq!(draft_lengths(&[rarely], 1, 1, cpu), vec![0]);
        let often = DraftOffer {
            first: 0.8,
            ..copying
        };
        assert_eq!(draft_lengths(&[often], 1, 1, cpu), vec![7]);
    }
}
