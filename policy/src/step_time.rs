//! How many tokens one engine step may hold so that it ends within `admission.max_step_ms`.
//!
//! Owns a small online model of a step's time, `seconds = fixed + per_token × tokens`, fitted
//! by least squares over the recent steps with exponential forgetting, so that it follows the
//! rising per-token cost of a long prompt's later chunks. It never measures anything itself:
//! the scheduler feeds it each step's token count and the engine's time for it.
//!
//! When the recent steps all had about the same size, the two terms cannot be told apart; the
//! model then charges the whole time per token (`fixed = 0`). That overestimates what a larger
//! step costs, so a step sized from it stays under the limit, and its time teaches the model
//! the slope.
//!
//! A few steps measured before serving may be added as anchors, which never fade (see
//! [`StepTimeModel::anchor`]).
//!
//! Costs: O(1) per observation and per prediction, ten floats of state.

use std::time::Duration;

/// Weight the past keeps at each new observation: about the last ten steps count.
const KEEP: f64 = 0.9;

/// Below this spread of step sizes (standard deviation over mean), the slope is not trusted.
const MIN_RELATIVE_SPREAD: f64 = 0.1;

/// Weighted sums of `1, x, y, x², xy` over observed steps (`x` tokens, `y` seconds).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Sums {
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl Sums {
    fn add(&mut self, keep: f64, x: f64, y: f64) {
        self.w = self.w * keep + 1.0;
        self.x = self.x * keep + x;
        self.y = self.y * keep + y;
        self.xx = self.xx * keep + x * x;
        self.xy = self.xy * keep + x * y;
    }

    fn plus(&self, other: &Sums) -> Sums {
        Sums {
            w: self.w + other.w,
            x: self.x + other.x,
            y: self.y + other.y,
            xx: self.xx + other.xx,
            xy: self.xy + other.xy,
        }
    }
}

/// Whether a step of `tokens` tokens that took `seconds` says anything: empty steps and
/// broken clocks do not.
fn teaches(tokens: usize, seconds: f64) -> bool {
    tokens > 0 && seconds.is_finite() && seconds >= 0.0
}

/// Exponentially weighted sums over the observed steps, and the anchors that never fade.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimeModel {
    recent: Sums,
    anchors: Sums,
}

/// The model's current estimate of a step's time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTimeFit {
    pub fixed_seconds: f64,
    pub per_token_seconds: f64,
}

impl StepTimeFit {
    /// The predicted time of a step of `tokens` tokens.
    pub fn seconds(&self, tokens: usize) -> f64 {
        self.fixed_seconds + self.per_token_seconds * tokens as f64
    }

    /// The most tokens whose predicted time is at most `limit` (0 when even the fixed part
    /// is over it).
    pub fn tokens_within(&self, limit: Duration) -> usize {
        let room = limit.as_secs_f64() - self.fixed_seconds;
        if room <= 0.0 {
            return 0;
        }
        // Rounding must not lose a whole token where the quotient is an integer.
        let tokens = room / self.per_token_seconds * (1.0 + 1e-9);
        if tokens >= usize::MAX as f64 {
            usize::MAX
        } else {
            tokens as usize
        }
    }
}

impl StepTimeModel {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a step of `tokens` tokens that took `seconds`. Empty steps teach nothing.
    pub fn observe(&mut self, tokens: usize, seconds: f64) {
        if teaches(tokens, seconds) {
            self.recent.add(KEEP, tokens as f64, seconds);
        }
    }

    /// Adds a step measured once, before any other (a warm-up's), that never fades: it counts
    /// as one step does when it is new, for good. Steps of sizes the traffic never shows keep
    /// the slope known: a model fed only steps of one size would otherwise charge their whole
    /// time per token, and whoever sizes steps from it would keep choosing that size (a
    /// speculating request verifying one drafted token a step for ever, each extra token
    /// priced at a whole step's time). The steps observed later outweigh the anchors wherever
    /// the two disagree.
    pub fn anchor(&mut self, tokens: usize, seconds: f64) {
        if teaches(tokens, seconds) {
            self.anchors.add(1.0, tokens as f64, seconds);
        }
    }

    /// The fit, once a step has been observed (or anchored).
    pub fn fit(&self) -> Option<StepTimeFit> {
        let m = self.moments()?;
        Some(m.linear().unwrap_or(StepTimeFit {
            fixed_seconds: 0.0,
            per_token_seconds: (m.mean_y / m.mean_x).max(f64::MIN_POSITIVE),
        }))
    }

    /// [`Self::fit`], except where the steps' sizes spread and their time does not grow with
    /// them (a slope of zero read through noise as a negative one): then a flat cost at their
    /// mean time, where [`Self::fit`] charges the whole time per token. Right for pricing a
    /// step's extra tokens (a GPU verifies two tokens or eight in the same time); wrong for
    /// sizing a step under a time limit, which is why [`Self::fit`] stays proportional.
    pub fn fit_or_flat(&self) -> Option<StepTimeFit> {
        let m = self.moments()?;
        if m.spread() && m.covariance <= 0.0 {
            return Some(StepTimeFit {
                fixed_seconds: m.mean_y,
                per_token_seconds: 0.0,
            });
        }
        self.fit()
    }

    /// The fit when the recent steps and the anchors tell the two terms apart: their sizes
    /// spread enough and the line has a positive slope and no negative fixed part. (Where
    /// [`Self::fit`] falls back to charging the whole time per token, this says nothing.)
    pub fn linear(&self) -> Option<StepTimeFit> {
        self.moments()?.linear()
    }

    /// The weighted means, variance and covariance of the recent steps and the anchors
    /// together; `None` before any step.
    fn moments(&self) -> Option<Moments> {
        let s = self.recent.plus(&self.anchors);
        if s.w == 0.0 || s.x <= 0.0 {
            return None;
        }
        let (mean_x, mean_y) = (s.x / s.w, s.y / s.w);
        Some(Moments {
            mean_x,
            mean_y,
            variance: (s.xx / s.w - mean_x * mean_x).max(0.0),
            covariance: s.xy / s.w - mean_x * mean_y,
        })
    }
}

/// What a fit reads from the weighted sums.
struct Moments {
    mean_x: f64,
    mean_y: f64,
    variance: f64,
    covariance: f64,
}

impl Moments {
    /// Whether the step sizes spread enough to tell a slope from a fixed part.
    fn spread(&self) -> bool {
        self.variance.sqrt() >= MIN_RELATIVE_SPREAD * self.mean_x
    }

    fn linear(&self) -> Option<StepTimeFit> {
        if !self.spread() {
            return None;
        }
        let slope = self.covariance / self.variance;
        let fixed = self.mean_y - slope * self.mean_x;
        // Else noise, or a cost that is not linear in the tokens.
        (slope > 0.0 && fixed >= 0.0).then_some(StepTimeFit {
            fixed_seconds: fixed,
            per_token_seconds: slope,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn nothing_observed_gives_no_fit() {
        let mut model = StepTimeModel::new();
        assert_eq!(model.fit(), None);
        model.observe(0, 1.0);
        assert_eq!(model.fit(), None);
    }

    #[test]
    fn linear_steps_are_recovered_exactly() {
        let mut model = StepTimeModel::new();
        for tokens in [1, 40, 7, 300, 2, 128] {
            model.observe(tokens, 0.02 + 0.003 * tokens as f64);
        }
        let fit = model.fit().unwrap();
        assert!(close(fit.fixed_seconds, 0.02), "{fit:?}");
        assert!(close(fit.per_token_seconds, 0.003), "{fit:?}");
        assert_eq!(model.linear(), Some(fit));
        assert_eq!(fit.tokens_within(Duration::from_millis(250)), 76);
        assert_eq!(fit.tokens_within(Duration::from_millis(10)), 0);
    }

    #[test]
    fn steps_of_one_size_charge_the_whole_time_per_token() {
        let mut model = StepTimeModel::new();
        for _ in 0..5 {
            model.observe(4, 0.02);
        }
        let fit = model.fit().unwrap();
        assert_eq!(fit.fixed_seconds, 0.0);
        assert!(close(fit.per_token_seconds, 0.005));
        assert_eq!(model.linear(), None, "a slope it cannot know");
    }

    #[test]
    fn a_negative_slope_falls_back_to_the_proportional_reading() {
        let mut model = StepTimeModel::new();
        model.observe(10, 0.5);
        model.observe(100, 0.1);
        let fit = model.fit().unwrap();
        assert_eq!(fit.fixed_seconds, 0.0);
        assert_eq!(model.linear(), None);
        // The weighted means: the older step counts 0.9.
        let expected = (0.9 * 0.5 + 0.1) / (0.9 * 10.0 + 100.0);
        assert!(close(fit.per_token_seconds, expected), "{fit:?}");
    }

    /// A scheduler that sizes each step from the model and feeds back the true time reaches
    /// steps just under the limit, from a start that overestimates or underestimates.
    #[test]
    fn sizing_steps_from_the_model_converges_under_the_limit() {
        let truth = |tokens: usize| 0.022 + 0.0027 * tokens as f64;
        let limit = Duration::from_millis(250);
        let best = ((0.25 - 0.022) / 0.0027) as usize;
        for start in [1, 16, 4_000] {
            let mut model = StepTimeModel::new();
            model.observe(start, truth(start));
            let mut tokens = start;
            for _ in 0..12 {
                tokens = model.fit().unwrap().tokens_within(limit).max(1);
                model.observe(tokens, truth(tokens));
            }
            assert!(
                tokens <= best && tokens + best / 20 >= best,
                "{start}: {tokens}"
            );
        }
    }

    /// Later chunks of a long prompt cost more per token (attention over a longer context: on
    /// SmolLM2 the per-token cost triples over 8k positions, about 1% a chunk); the forgetting
    /// follows them.
    #[test]
    fn a_rising_cost_is_followed() {
        let limit = Duration::from_millis(250);
        let mut model = StepTimeModel::new();
        let mut tokens = 64;
        let mut per_token = 0.002;
        for _ in 0..100 {
            model.observe(tokens, 0.02 + per_token * tokens as f64);
            tokens = model.fit().unwrap().tokens_within(limit).max(1);
            per_token *= 1.01;
        }
        let actual = 0.02 + per_token * tokens as f64;
        assert!(actual < 0.25 * 1.15, "{tokens} tokens take {actual} s");
    }

    /// Verify steps on the H200 (SmolLM2): 0.87 ms and 15 µs a token. Anchored at two, four
    /// and eight tokens, a model then fed only steps of two tokens keeps a slope near the true
    /// one instead of charging 0.45 ms a token.
    #[test]
    fn anchors_keep_the_slope_when_every_step_has_one_size() {
        let truth = |tokens: usize| 0.87e-3 + 0.015e-3 * tokens as f64;
        let mut model = StepTimeModel::new();
        for tokens in [2, 4, 8] {
            model.anchor(tokens, truth(tokens));
        }
        for _ in 0..500 {
            model.observe(2, truth(2));
        }
        let fit = model.linear().expect("the anchors spread the sizes");
        assert!(close(fit.per_token_seconds, 0.015e-3), "{fit:?}");
        assert!(close(fit.fixed_seconds, 0.87e-3), "{fit:?}");
        // Without them: the whole time per token.
        let mut bare = StepTimeModel::new();
        for _ in 0..500 {
            bare.observe(2, truth(2));
        }
        assert!(bare.fit().unwrap().per_token_seconds > 0.4e-3);
        // Steps that disagree with the anchors outweigh them: the same sizes, twice the time.
        for tokens in [2, 4, 8].repeat(20) {
            model.observe(tokens, 2.0 * truth(tokens));
        }
        let fit = model.linear().unwrap();
        assert!(fit.seconds(8) > 1.7 * truth(8), "{fit:?}");
    }

    #[test]
    fn a_flat_cost_is_read_as_flat_where_asked() {
        // Verify steps of 2, 4 and 8 tokens all ~0.93 ms, the noise making the slope negative.
        let mut model = StepTimeModel::new();
        for (tokens, ms) in [(2, 0.936), (4, 0.931), (8, 0.929)] {
            model.anchor(tokens, ms * 1e-3);
        }
        assert_eq!(model.linear(), None);
        assert_eq!(
            model.fit().unwrap().fixed_seconds,
            0.0,
            "sizing stays proportional"
        );
        let flat = model.fit_or_flat().unwrap();
        assert_eq!(flat.per_token_seconds, 0.0);
        assert!((flat.seconds(8) - 0.932e-3).abs() < 1e-6, "{flat:?}");
        // A rising cost is the linear fit; one size only, the proportional reading.
        let mut rising = StepTimeModel::new();
        rising.observe(2, 1e-3);
        rising.observe(8, 2e-3);
        assert_eq!(rising.fit_or_flat(), rising.linear());
        let mut one = StepTimeModel::new();
        one.observe(2, 1e-3);
        assert_eq!(one.fit_or_flat(), one.fit());
    }
}
