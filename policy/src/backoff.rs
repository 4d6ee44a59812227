//! Per-job back-off after a context-full refusal.
//!
//! Owns the delay schedule (capped exponential with jitter) and the per-job attempt counter.
//! A job that cannot extend backs off alone while the others keep running (no head-of-line
//! blocking); after `max_attempts` retries it is preempted or failed, as configured. This module
//! never sleeps and never owns a random source: the caller passes one in, so tests and replays
//! are deterministic with a seeded generator.

use rand::{Rng, RngExt};
use serde::{Deserialize, Serialize};

/// What happens to a job whose retries are used up (`backoff.on_exhausted`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnExhausted {
    /// Preempt the youngest running job (this one, if none is younger): save its KV to the
    /// snapshot store where there is room, release its pages, requeue it to restore later.
    /// The oldest job thus always progresses.
    #[default]
    Preempt,
    /// Fail the job with a clear error.
    Fail,
}

/// The validated back-off schedule; built by `BackoffConfig::validate`.
#[derive(Debug, Clone, PartialEq)]
pub struct BackoffPolicy {
    pub(crate) base_ms: u64,
    pub(crate) max_ms: u64,
    pub(crate) multiplier: f64,
    pub(crate) jitter: f64,
    pub(crate) max_attempts: u32,
    pub(crate) on_exhausted: OnExhausted,
}

impl BackoffPolicy {
    pub fn base_ms(&self) -> u64 {
        self.base_ms
    }
    pub fn max_ms(&self) -> u64 {
        self.max_ms
    }
    pub fn multiplier(&self) -> f64 {
        self.multiplier
    }
    /// Fraction of a delay that jitter may take off, in `[0, 1]`.
    pub fn jitter(&self) -> f64 {
        self.jitter
    }
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }
    pub fn on_exhausted(&self) -> OnExhausted {
        self.on_exhausted
    }

    /// The delay before retry `attempt` (1-based) before jitter: `base * multiplier^(attempt-1)`,
    /// capped at `max_ms`. Saturates instead of overflowing for large attempts.
    pub fn ceiling_ms(&self, attempt: u32) -> u64 {
        let exponent = attempt.saturating_sub(1).min(i32::MAX as u32) as i32;
        let uncapped = self.base_ms as f64 * self.multiplier.powi(exponent);
        // `as` saturates an infinite or huge float at u64::MAX; the cap then applies.
        (uncapped as u64).min(self.max_ms)
    }
}

/// One job's back-off state: how many retries it has used since it last made progress.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Backoff {
    attempts: u32,
}

/// What the scheduler does with a job that was just refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackoffStep {
    /// Try again after `delay_ms`; this is retry number `attempt` (1-based).
    Retry { attempt: u32, delay_ms: u64 },
    /// Retries are used up: apply `action`.
    Exhausted { attempts: u32, action: OnExhausted },
}

impl Backoff {
    pub fn new() -> Self {
        Backoff::default()
    }

    /// Retries used since the job last made progress.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The job was refused again. Jitter takes a uniformly drawn fraction, at most
    /// `policy.jitter()`, off the ceiling, so concurrent jobs do not retry in lock step and no
    /// delay ever exceeds `max_ms`.
    pub fn on_refused<R: Rng + ?Sized>(
        &mut self,
        policy: &BackoffPolicy,
        rng: &mut R,
    ) -> BackoffStep {
        if self.attempts >= policy.max_attempts {
            return BackoffStep::Exhausted {
                attempts: self.attempts,
                action: policy.on_exhausted,
            };
        }
        self.attempts += 1;
        let ceiling = policy.ceiling_ms(self.attempts) as f64;
        let cut: f64 = rng.random::<f64>() * policy.jitter;
        BackoffStep::Retry {
            attempt: self.attempts,
            delay_ms: (ceiling * (1.0 - cut)).round() as u64,
        }
    }

    /// The job made progress: its next refusal starts the schedule over.
    pub fn on_progress(&mut self) {
        self.attempts = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn policy(jitter: f64, max_attempts: u32) -> BackoffPolicy {
        BackoffPolicy {
            base_ms: 10,
            max_ms: 100,
            multiplier: 2.0,
            jitter,
            max_attempts,
            on_exhausted: OnExhausted::Fail,
        }
    }

    fn delays(policy: &BackoffPolicy, seed: u64) -> Vec<BackoffStep> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut job = Backoff::new();
        (0..policy.max_attempts + 1)
            .map(|_| job.on_refused(policy, &mut rng))
            .collect()
    }

    #[test]
    fn without_jitter_the_schedule_doubles_up_to_the_cap_then_exhausts() {
        let steps = delays(&policy(0.0, 5), 1);
        let retry = |attempt, delay_ms| BackoffStep::Retry { attempt, delay_ms };
        assert_eq!(
            steps,
            vec![
                retry(1, 10),
                retry(2, 20),
                retry(3, 40),
                retry(4, 80),
                retry(5, 100),
                BackoffStep::Exhausted {
                    attempts: 5,
                    action: OnExhausted::Fail
                },
            ]
        );
    }

    #[test]
    fn jitter_stays_within_its_fraction_and_is_reproducible_by_seed() {
        let p = policy(0.5, 6);
        let first = delays(&p, 7);
        assert_eq!(first, delays(&p, 7));
        assert_ne!(first, delays(&p, 8));
        for step in &first[..6] {
            let BackoffStep::Retry { attempt, delay_ms } = *step else {
                panic!("retries come before exhaustion: {step:?}");
            };
            let ceiling = p.ceiling_ms(attempt);
            assert!(
                delay_ms <= ceiling && delay_ms >= ceiling / 2,
                "{delay_ms} vs {ceiling}"
            );
        }
    }

    #[test]
    fn progress_starts_the_schedule_over() {
        let p = policy(0.0, 2);
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let mut job = Backoff::new();
        job.on_refused(&p, &mut rng);
        job.on_refused(&p, &mut rng);
        job.on_progress();
        assert_eq!(
            job.on_refused(&p, &mut rng),
            BackoffStep::Retry {
                attempt: 1,
                delay_ms: 10
            }
        );
    }

    #[test]
    fn ceiling_saturates_for_huge_attempts() {
        assert_eq!(policy(0.0, 1).ceiling_ms(u32::MAX), 100);
    }
}
