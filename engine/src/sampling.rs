//! Sampling: turns one row of logits into the next token.
//!
//! Owns a request's sampling parameters and their validation, the request's RNG, and the token
//! history its penalties need. One [`Sampler`] per request: [`Sampler::sample`] once per step with
//! that step's logits, then [`Sampler::accept`] with the token the engine kept. It never sees
//! text or the tokenizer (stop strings are `stop`'s), and never decides when generation ends:
//! `max_tokens`, `stop_token_ids` and `ignore_eos` are read by the engine's loop.
//!
//! One step, in the order vLLM and Hugging Face use: repetition penalty, presence and frequency
//! penalties; then either argmax (temperature 0) or temperature, top-k, softmax, top-p, min-p and
//! a draw from what is left. Cost per step for a vocabulary of n tokens: penalties O(distinct
//! tokens seen); greedy O(n); sampling O(n), top-k included (a partition, no sort), and top-p
//! too: a quickselect on probability mass, so even a flat distribution never sorts the vocab.
//!
//! Reproducibility: a seeded request draws from ChaCha8 and maps its bits to a uniform float by
//! hand, and ties between equal logits always go to the lowest token id, so the same seed and
//! the same logits give the same tokens on every run, wherever `f32::exp` rounds alike.

use std::cmp::Ordering;
use std::collections::{HashMap, HashSet};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Deserializer, Serialize};

use crate::error::{EngineError, Result};

/// Highest temperature accepted; OpenAI stops at 2, we are lenient but refuse nonsense.
pub const MAX_TEMPERATURE: f32 = 100.0;

/// Most stop strings one request may carry (OpenAI allows 4).
pub const MAX_STOP_STRINGS: usize = 16;

/// The largest bias `logit_bias` may add or take away (OpenAI's range).
pub const MAX_LOGIT_BIAS: f32 = 100.0;

/// Most alternatives `logprobs` may ask for per token (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Top-p's first guess at the nucleus size, and the size below which it sorts instead of
/// partitioning further.
const NUCLEUS_SORT_LEN: usize = 64;

/// How one request picks its tokens, as it arrives from the API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 takes the most likely token (greedy).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the fewest most likely tokens whose probabilities sum to at least `top_p`; 1 disables.
    pub top_p: f32,
    /// Keep tokens at least `min_p` times as likely as the most likely one; 0 disables.
    pub min_p: f32,
    /// Seed of the request's RNG; `None` seeds it from the OS.
    pub seed: Option<u64>,
    /// Subtracted once from the logit of every token already generated (OpenAI semantics).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated (OpenAI semantics).
    pub frequency_penalty: f32,
    /// For every token in the prompt or the output, divides a positive logit and multiplies a
    /// negative one (CTRL / Hugging Face semantics); 1 disables.
    pub repetition_penalty: f32,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Token ids that end generation, besides the model's end-of-sequence tokens.
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation; the matched string is not returned. The API may send one
    /// string or a list.
    #[serde(deserialize_with = "one_or_many_strings")]
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// Added to these tokens' logits before anything else looks at them (OpenAI's
    /// `logit_bias`: -100 bans a token, 100 all but forces it), by token id, ascending.
    pub logit_bias: Vec<(u32, f32)>,
    /// Report each chosen token's log-probability and this many of the likeliest alternatives
    /// (OpenAI's `logprobs`/`top_logprobs`); `None` reports nothing.
    pub logprobs: Option<usize>,
    /// Report the log-probability of each prompt token after the first, given the tokens
    /// before it, with this many of the likeliest alternatives (a completion's `echo` with
    /// `logprobs`): from the model's logits alone, no bias or penalty. `None` reports nothing.
    pub prompt_logprobs: Option<usize>,
    /// The grammar the output follows (structured outputs), compiled when the request was
    /// checked; each sampler starts its own copy.
    #[serde(skip)]
    pub constraint: Option<ConstraintSource>,
}

/// A compiled grammar from which each request's sampler starts a fresh [`TokenConstraint`].
/// Equal only to itself (grammars are not compared).
#[derive(Clone)]
pub struct ConstraintSource(std::sync::Arc<dyn Fn() -> Box<dyn TokenConstraint> + Send + Sync>);

impl ConstraintSource {
    pub fn new(start: impl Fn() -> Box<dyn TokenConstraint> + Send + Sync + 'static) -> Self {
        ConstraintSource(std::sync::Arc::new(start))
    }

    /// A constraint at the grammar's start.
    pub fn start(&self) -> Box<dyn TokenConstraint> {
        (self.0)()
    }
}

impl PartialEq for ConstraintSource {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::fmt::Debug for ConstraintSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConstraintSource")
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            max_tokens: 256,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            ignore_eos: false,
            logit_bias: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            constraint: None,
        }
    }
}

impl SamplingParams {
    /// Whether a pick depends on the tokens picked before it (the penalties): such a request
    /// picks one token per step, each accepted before the next is picked.
    pub fn reads_history(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }

    /// Checks every parameter against its range; the error names the first bad one.
    pub fn validate(&self) -> Result<()> {
        check_closed("temperature", self.temperature, 0.0, MAX_TEMPERATURE)?;
        let top_p_ok = self.top_p > 0.0 && self.top_p <= 1.0;
        check_f32("top_p", self.top_p, top_p_ok, "(0, 1]")?;
        check_closed("min_p", self.min_p, 0.0, 1.0)?;
        check_closed("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        check_closed("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        let repetition = self.repetition_penalty;
        let repetition_ok = repetition > 0.0 && repetition.is_finite();
        check_f32("repetition_penalty", repetition, repetition_ok, "(0, inf)")?;
        if self.max_tokens == 0 {
            let reason = "must be at least 1, got 0".to_owned();
            return Err(invalid("max_tokens", reason));
        }
        if let Some((token, bias)) = self
            .logit_bias
            .iter()
            .find(|(_, bias)| !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(bias))
        {
            let reason = format!(
                "biases must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], token {token} has {bias}"
            );
            return Err(invalid("logit_bias", reason));
        }
        if let Some(top) = self.logprobs.filter(|&top| top > MAX_TOP_LOGPROBS) {
            let reason = format!("at most {MAX_TOP_LOGPROBS} alternatives, got {top}");
            return Err(invalid("top_logprobs", reason));
        }
        self.validate_stop()
    }

    fn validate_stop(&self) -> Result<()> {
        if self.stop.len() > MAX_STOP_STRINGS {
            let reason = format!(
                "at most {MAX_STOP_STRINGS} stop strings are allowed, got {}",
                self.stop.len()
            );
            return Err(invalid("stop", reason));
        }
        if let Some(index) = self.stop.iter().position(String::is_empty) {
            let reason = format!("stop strings must not be empty, entry {index} is");
            return Err(invalid("stop", reason));
        }
        Ok(())
    }
}

/// NaN is in no range, so it is refused with the rest.
fn check_closed(name: &'static str, value: f32, min: f32, max: f32) -> Result<()> {
    if (min..=max).contains(&value) {
        return Ok(());
    }
    Err(invalid(
        name,
        format!("must be in [{min}, {max}], got {value}"),
    ))
}

fn check_f32(name: &'static str, value: f32, ok: bool, range: &str) -> Result<()> {
    if ok {
        return Ok(());
    }
    Err(invalid(name, format!("must be in {range}, got {value}")))
}

fn invalid(name: &'static str, reason: String) -> EngineError {
    EngineError::InvalidSampling { name, reason }
}

/// OpenAI's `stop` is a string, a list of strings, or null.
fn one_or_many_strings<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match Option::<OneOrMany>::deserialize(deserializer)? {
        None => Vec::new(),
        Some(OneOrMany::One(stop)) => vec![stop],
        Some(OneOrMany::Many(stops)) => stops,
    })
}

/// A token still in the running, with its logit and later its unnormalised probability.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Candidate {
    token: u32,
    score: f32,
}

/// The log-probabilities of one chosen token, from the logits after biases and penalties and
/// before temperature, filters and any grammar's mask (OpenAI's definition; vLLM's default).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// The likeliest tokens with theirs, most likely first, ties to the lower id.
    pub top: Vec<(u32, f32)>,
}

/// Restricts which tokens may come next: a grammar the output must follow. The sampler masks
/// the logits with it before each pick and tells it the pick.
pub trait TokenConstraint: Send + std::fmt::Debug {
    /// Works out which tokens may come next, if not already known; a backend calls it while the
    /// device computes the logits, so the work overlaps the step.
    fn prepare(&mut self) -> std::result::Result<(), String>;
    /// Sets the logit of every token that may not come next to -inf.
    fn mask(&mut self, logits: &mut [f32]) -> std::result::Result<(), String>;
    /// Advances past the picked token.
    fn commit(&mut self, token: u32) -> std::result::Result<(), String>;
    /// The allowed set as a bitmask (bit `t % 32` of word `t / 32` set: token `t` may come
    /// next), for a backend that masks on its device; `None` when this constraint cannot
    /// say it so (the host then masks the logits itself).
    fn mask_words(&mut self) -> std::result::Result<Option<&[u32]>, String> {
        Ok(None)
    }
    /// Whether [`TokenConstraint::mask_words`] answers with a bitmask.
    fn has_mask_words(&self) -> bool {
        false
    }
}

/// Picks one request's tokens: its parameters, its RNG and the history its penalties read.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Distinct prompt tokens; filled only when the repetition penalty is on.
    prompt_tokens: HashSet<u32>,
    /// How many times each token has been generated so far.
    output_counts: HashMap<u32, u32>,
    /// Scratch for the stochastic path, kept so a 150k vocabulary is not reallocated per token.
    candidates: Vec<Candidate>,
    /// The grammar the output follows, if any.
    constraint: Option<Box<dyn TokenConstraint>>,
    /// Log-probabilities of the picks since the last [`Sampler::take_logprobs`], when asked for.
    logprobs: Vec<TokenLogprobs>,
    /// Why the constraint failed; the request ends with this error.
    failure: Option<String>,
    /// Keep a copy of the next pick's logits as they came from the model
    /// ([`Sampler::keep_next_logits`]), and the copy once made.
    keep_next: bool,
    kept: Option<Vec<f32>>,
}

impl Sampler {
    /// A sampler for one request. `params` should have passed [`SamplingParams::validate`]; out
    /// of range values are not re-checked here.
    pub fn new(params: &SamplingParams, prompt_tokens: &[u32]) -> Self {
        let rng = match params.seed {
            Some(seed) => ChaCha8Rng::seed_from_u64(seed),
            None => rand::make_rng(),
        };
        let prompt_tokens = if params.repetition_penalty == 1.0 {
            HashSet::new()
        } else {
            prompt_tokens.iter().copied().collect()
        };
        Self {
            params: params.clone(),
            rng,
            prompt_tokens,
            output_counts: HashMap::new(),
            candidates: Vec::new(),
            constraint: params.constraint.as_ref().map(ConstraintSource::start),
            logprobs: Vec::new(),
            failure: None,
            keep_next: false,
            kept: None,
        }
    }

    /// Asks for a copy of the logits the next pick is made from, as the model gave them
    /// (before biases, penalties and the grammar): the logits after a prompt, kept so that a
    /// repeat of the prompt takes its first token without a forward pass. The next pick is
    /// then made on the host ([`Sampler::needs_host`]), where the row is whole, and so is
    /// every pick until [`Sampler::take_kept_logits`].
    pub fn keep_next_logits(&mut self) {
        self.keep_next = true;
        self.kept = None;
    }

    /// The copy [`Sampler::keep_next_logits`] asked for, if a pick was made since: the logits
    /// of the first pick after the request. Picks go back to the device after this.
    pub fn take_kept_logits(&mut self) -> Option<Vec<f32>> {
        self.keep_next = false;
        self.kept.take()
    }

    /// The same sampler with its output held to `constraint`.
    pub fn constrained(self, constraint: Box<dyn TokenConstraint>) -> Self {
        Sampler {
            constraint: Some(constraint),
            ..self
        }
    }

    /// Whether only the host can pick this sampler's tokens: penalties and biases need its
    /// history and maps, logprobs the whole row of logits, and so do grammars that give no
    /// bitmask (those that do are masked on the device: [`Sampler::device_mask`]).
    pub fn needs_host(&self) -> bool {
        let p = &self.params;
        self.keep_next
            || p.repetition_penalty != 1.0
            || p.presence_penalty != 0.0
            || p.frequency_penalty != 0.0
            || !p.logit_bias.is_empty()
            || p.logprobs.is_some()
            || self
                .constraint
                .as_ref()
                .is_some_and(|c| !c.has_mask_words())
    }

    /// The bitmask of the tokens the grammar allows next, for a device that applies it before
    /// its own pick; the pick then goes to [`Sampler::commit_device_pick`]. `None` without a
    /// grammar, or once it failed (the request is ending).
    pub fn device_mask(&mut self) -> Option<&[u32]> {
        self.prepare();
        if self.failure.is_some() {
            return None;
        }
        let words = match self.constraint.as_mut()?.mask_words() {
            Ok(words) => words?,
            Err(e) => {
                self.failure = Some(e);
                return None;
            }
        };
        if words.iter().all(|&w| w == 0) {
            self.failure = Some("the grammar allows no token here".into());
            return None;
        }
        // Reborrowed: the checks above needed the sampler mutably.
        self.constraint.as_mut()?.mask_words().ok().flatten()
    }

    /// Tells the grammar the token the device picked under [`Sampler::device_mask`].
    pub fn commit_device_pick(&mut self, token: u32) {
        if let Some(constraint) = &mut self.constraint
            && self.failure.is_none()
            && let Err(e) = constraint.commit(token)
        {
            self.failure = Some(e);
        }
    }

    /// Lets the constraint work out the next step's mask now (overlapping the device's work).
    pub fn prepare(&mut self) {
        if let Some(constraint) = &mut self.constraint
            && self.failure.is_none()
            && let Err(e) = constraint.prepare()
        {
            self.failure = Some(e);
        }
    }

    /// The log-probabilities recorded since the last call, one per pick, in order.
    pub fn take_logprobs(&mut self) -> Vec<TokenLogprobs> {
        std::mem::take(&mut self.logprobs)
    }

    /// Why the output could not follow its grammar, once that happened.
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from one step's logits, which it overwrites (biases and penalties
    /// applied).
    ///
    /// Panics on an empty row: the backend always returns one logit per vocabulary entry.
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        assert!(!logits.is_empty(), "sampling needs at least one logit");
        if self.keep_next && self.kept.is_none() {
            self.kept = Some(logits.to_vec());
        }
        self.apply_penalties(logits);
        let scored = self.params.logprobs.map(|top| scores(logits, top));
        self.apply_constraint(logits);
        let token = self.pick(logits);
        if let Some((normaliser, top)) = scored {
            self.logprobs.push(TokenLogprobs {
                token,
                logprob: logits[token as usize] - normaliser,
                top,
            });
        }
        if let Some(constraint) = &mut self.constraint
            && self.failure.is_none()
            && let Err(e) = constraint.commit(token)
        {
            self.failure = Some(e);
        }
        token
    }

    fn pick(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature == 0.0 {
            return argmax(logits);
        }
        self.fill_candidates(logits);
        keep_top_k(&mut self.candidates, self.params.top_k);
        to_weights(&mut self.candidates, self.params.temperature);
        keep_nucleus(&mut self.candidates, self.params.top_p);
        keep_min_p(&mut self.candidates, self.params.min_p);
        let uniform = uniform_f64(&mut self.rng);
        // Nothing left only when no logit is above -inf: there is no distribution to draw from.
        draw(&self.candidates, uniform).unwrap_or_else(|| argmax(logits))
    }

    /// Masks what the grammar forbids. A grammar that fails, or forbids everything, records
    /// why: the request ends with that error, and this pick is never delivered.
    fn apply_constraint(&mut self, logits: &mut [f32]) {
        let Some(constraint) = &mut self.constraint else {
            return;
        };
        if self.failure.is_some() {
            return;
        }
        match constraint.mask(logits) {
            Ok(()) if logits.iter().any(|&l| l > f32::NEG_INFINITY) => {}
            Ok(()) => self.failure = Some("the grammar allows no token here".into()),
            Err(e) => self.failure = Some(e),
        }
    }

    /// Draws the uniform the next stochastic pick uses, for a backend that applies the filters
    /// and draws on its own device: the request's RNG advances exactly as [`Sampler::sample`]
    /// would advance it, so a seeded request stays reproducible.
    pub fn draw_uniform(&mut self) -> f64 {
        uniform_f64(&mut self.rng)
    }

    /// Records a generated token, for the penalties of later steps.
    pub fn accept(&mut self, token: u32) {
        // Only the penalties read the history; greedy and plain sampling skip the map.
        if self.reads_history() {
            *self.output_counts.entry(token).or_insert(0) += 1;
        }
    }

    /// Whether a device's own pick (its filters, drawing with [`Sampler::draw_uniform`]) is
    /// this sampler's pick: nothing only the host can apply, and no grammar.
    pub fn samples_on_device(&self) -> bool {
        !self.needs_host() && self.constraint.is_none()
    }

    /// [`Sampler::samples_on_device`], and greedy.
    pub fn greedy_on_device(&self) -> bool {
        self.params.temperature == 0.0 && self.samples_on_device()
    }

    /// Where the request's random stream stands (in words drawn).
    pub fn draw_position(&self) -> u128 {
        self.rng.get_word_pos()
    }

    /// Puts the random stream back at `position` (of [`Sampler::draw_position`]): uniforms drawn
    /// for picks that were then not made (a verification's positions past a refusal) are
    /// drawn again for the next picks, as without speculation.
    pub fn rewind_draws(&mut self, position: u128) {
        self.rng.set_word_pos(position);
    }

    /// Whether a pick depends on the tokens [`Sampler::accept`] recorded (penalties): such a
    /// sampler picks one token per step, each accepted before the next is picked.
    pub fn reads_history(&self) -> bool {
        self.params.reads_history()
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let params = &self.params;
        for &(token, bias) in &params.logit_bias {
            if let Some(logit) = logits.get_mut(token as usize) {
                *logit += bias;
            }
        }
        // Ids past the end of the row (tokens a tokenizer added beyond the model's vocabulary)
        // have no logit to penalise.
        if params.repetition_penalty != 1.0 {
            let output_only = self
                .output_counts
                .keys()
                .filter(|t| !self.prompt_tokens.contains(t));
            for &token in self.prompt_tokens.iter().chain(output_only) {
                if let Some(logit) = logits.get_mut(token as usize) {
                    *logit = repetition_penalized(*logit, params.repetition_penalty);
                }
            }
        }
        if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
            for (&token, &count) in &self.output_counts {
                if let Some(logit) = logits.get_mut(token as usize) {
                    *logit -= params.presence_penalty + params.frequency_penalty * count as f32;
                }
            }
        }
    }

    fn fill_candidates(&mut self, logits: &[f32]) {
        self.candidates.clear();
        // NaN and -inf can never be drawn; +inf is clamped so weights stay finite.
        let drawable = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| **l > f32::NEG_INFINITY);
        self.candidates
            .extend(drawable.map(|(token, &logit)| Candidate {
                token: token as u32,
                score: logit.min(f32::MAX),
            }));
    }
}

/// The log of the softmax's normaliser over `logits` (their log-sum-exp, summed in f64) and the
/// `top` largest logits as log-probabilities, largest first, ties to the lower id. One pass;
/// the kept list is short, so inserting into it costs little.
/// `token`'s log-probability under `logits` (a softmax over them, nothing applied) and the
/// `top` likeliest tokens with theirs: how a prompt's tokens are scored.
pub fn token_logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let (normaliser, top) = scores(logits, top);
    let logprob = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&logit| logit - normaliser);
    TokenLogprobs {
        token,
        logprob,
        top,
    }
}

fn scores(logits: &[f32], top: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return (0.0, Vec::new());
    }
    let max = max.min(f32::MAX);
    // f32 exponentials (twice as fast as f64's), summed in f32 a short run at a time and in
    // f64 across runs, so a 150k vocabulary loses no precision to the sum.
    let sum: f64 = logits
        .chunks(64)
        .map(|run| {
            let run: f32 = run.iter().map(|&l| (l.min(f32::MAX) - max).exp()).sum();
            f64::from(run)
        })
        .sum();
    let normaliser = max + sum.ln() as f32;
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (token, &logit) in logits.iter().enumerate() {
            let full = best.len() == top;
            if full && logit <= best[top - 1].1 || logit.is_nan() {
                continue;
            }
            let at = best.partition_point(|&(_, l)| l >= logit);
            best.insert(at, (token as u32, logit));
            best.truncate(top);
        }
    }
    for entry in &mut best {
        entry.1 -= normaliser;
    }
    (normaliser, best)
}

/// Index of the largest logit. Ties go to the lowest id and NaN never wins; 0 when no logit is
/// above -inf.
///
/// Two passes that vectorise, the maximum over sixteen lanes and then the first position
/// holding it, instead of one scan whose compares form a single dependency chain: 10-19×
/// faster over a 49k-128k vocabulary on this project's machines; short rows take the scan.
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    if logits.len() < 4 * LANES {
        return argmax_scan(logits);
    }
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (best, &logit) in lanes.iter_mut().zip(chunk) {
            *best = if logit > *best { logit } else { *best };
        }
    }
    let max = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |max, &v| if v > max { v } else { max });
    if max == f32::NEG_INFINITY {
        return 0;
    }
    for (c, chunk) in logits.chunks(LANES).enumerate() {
        if chunk.iter().fold(false, |any, &v| any | (v == max)) {
            let offset = chunk
                .iter()
                .position(|&v| v == max)
                .expect("the chunk holds it");
            return (c * LANES + offset) as u32;
        }
    }
    unreachable!("the maximum is one of the logits")
}

fn argmax_scan(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_logit = f32::NEG_INFINITY;
    for (token, &logit) in logits.iter().enumerate() {
        if logit > best_logit {
            best = token;
            best_logit = logit;
        }
    }
    best as u32
}

/// CTRL's penalty: always moves the logit towards "less likely" for a penalty above 1.
fn repetition_penalized(logit: f32, penalty: f32) -> f32 {
    if logit > 0.0 {
        logit / penalty
    } else {
        logit * penalty
    }
}

/// Higher score first, then lower id, so every filter agrees with [`argmax`] on ties.
/// Candidates hold no NaN, which makes this a total order.
fn rank(a: &Candidate, b: &Candidate) -> Ordering {
    let by_score = b.score.partial_cmp(&a.score).unwrap_or(Ordering::Equal);
    by_score.then(a.token.cmp(&b.token))
}

fn keep_top_k(candidates: &mut Vec<Candidate>, top_k: usize) {
    if top_k == 0 || top_k >= candidates.len() {
        return;
    }
    candidates.select_nth_unstable_by(top_k - 1, rank);
    candidates.truncate(top_k);
}

/// Turns logits into softmax weights relative to the most likely candidate, which gets exactly
/// 1; normalising is left to whoever needs sums.
fn to_weights(candidates: &mut [Candidate], temperature: f32) {
    let max = candidates
        .iter()
        .map(|c| c.score)
        .fold(f32::NEG_INFINITY, f32::max);
    for candidate in candidates {
        candidate.score = ((candidate.score - max) / temperature).exp();
    }
}

/// Keeps the nucleus: the fewest most likely candidates whose mass reaches `top_p`, at least one.
/// Real nuclei are usually small, so the first round partitions off the top few; after that it
/// is a quickselect on mass, each round splitting the undecided range in half and keeping the
/// half holding the cut. Either way O(n), even for a flat distribution; only the last few
/// candidates are sorted. The kept candidates are left in no particular (but fixed) order.
fn keep_nucleus(candidates: &mut Vec<Candidate>, top_p: f32) {
    if top_p >= 1.0 || candidates.is_empty() {
        return;
    }
    let target = f64::from(top_p) * mass(candidates);
    // The cut lies in (kept, end]; candidates[..kept] outrank all others and weigh kept_mass.
    let (mut kept, mut end, mut kept_mass) = (0, candidates.len(), 0.0);
    let mut split_len = NUCLEUS_SORT_LEN;
    while end - kept > NUCLEUS_SORT_LEN {
        let split = kept + split_len;
        candidates[kept..end].select_nth_unstable_by(split_len - 1, rank);
        let upper_mass = mass(&candidates[kept..split]);
        if kept_mass + upper_mass >= target {
            end = split;
        } else {
            kept = split;
            kept_mass += upper_mass;
        }
        split_len = (end - kept) / 2;
    }
    let undecided = &mut candidates[kept..end];
    undecided.sort_unstable_by(rank);
    // None only when summing in another order left the mass a hair under the target.
    let len = nucleus_len(undecided, target - kept_mass).unwrap_or(undecided.len());
    candidates.truncate(kept + len);
}

fn mass(candidates: &[Candidate]) -> f64 {
    candidates.iter().map(|c| f64::from(c.score)).sum()
}

/// Length of the shortest prefix of `sorted` whose mass reaches `target`, if any.
fn nucleus_len(sorted: &[Candidate], target: f64) -> Option<usize> {
    let mut mass = 0.0;
    for (index, candidate) in sorted.iter().enumerate() {
        mass += f64::from(candidate.score);
        if mass >= target {
            return Some(index + 1);
        }
    }
    None
}

/// Keeps candidates with p >= min_p × p_max. Weights are relative to the most likely candidate
/// (weight 1), so that is weight >= min_p. Weights that underflowed to 0 go too: they can never
/// be drawn.
fn keep_min_p(candidates: &mut Vec<Candidate>, min_p: f32) {
    candidates.retain(|c| c.score > 0.0 && c.score >= min_p);
}

/// Draws a token with probability proportional to its weight; `uniform` is in [0, 1).
fn draw(candidates: &[Candidate], uniform: f64) -> Option<u32> {
    let threshold = uniform * mass(candidates);
    let mut mass = 0.0;
    for candidate in candidates {
        mass += f64::from(candidate.score);
        if mass > threshold {
            return Some(candidate.token);
        }
    }
    // `uniform * mass` can round up to the whole mass.
    candidates.last().map(|c| c.token)
}

/// A uniform draw in [0, 1) from the top 53 bits. Done by hand so the mapping from RNG output to
/// float is fixed by this code, not by a library version.
fn uniform_f64(rng: &mut ChaCha8Rng) -> f64 {
    const SCALE: f64 = 1.0 / (1u64 << 53) as f64;
    (rng.next_u64() >> 11) as f64 * SCALE
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            seed: Some(42),
            ..SamplingParams::default()
        }
    }

    #[test]
    fn logprobs_are_the_log_softmax_after_biases_and_before_temperature() {
        let params = SamplingParams {
            temperature: 0.0,
            logprobs: Some(2),
            logit_bias: vec![(3, 1.0)],
            ..params(0.0)
        };
        let mut sampler = Sampler::new(&params, &[]);
        // Probabilities after the bias: 1/8, 1/8, 1/4, 1/2.
        let ln = |x: f32| x.ln();
        let mut logits = vec![ln(1.0), ln(1.0), ln(2.0), ln(4.0) - 1.0];
        assert_eq!(sampler.sample(&mut logits), 3);
        let recorded = sampler.take_logprobs();
        assert_eq!(recorded.len(), 1);
        let lp = &recorded[0];
        assert_eq!(lp.token, 3);
        assert!((lp.logprob - ln(0.5)).abs() < 1e-6, "{lp:?}");
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![3, 2]);
        assert!((lp.top[1].1 - ln(0.25)).abs() < 1e-6, "{lp:?}");
        assert!(sampler.take_logprobs().is_empty(), "taken once");
        // A temperature changes the draw, not the reported distribution.
        let hot = SamplingParams {
            temperature: 5.0,
            ..params.clone()
        };
        let mut sampler = Sampler::new(&hot, &[]);
        let mut logits = vec![ln(1.0), ln(1.0), ln(2.0), ln(4.0) - 1.0];
        let token = sampler.sample(&mut logits);
        let lp = &sampler.take_logprobs()[0];
        let expected = [ln(0.125), ln(0.125), ln(0.25), ln(0.5)][token as usize];
        assert!((lp.logprob - expected).abs() < 1e-6, "{lp:?}");
    }

    #[test]
    fn top_logprobs_break_ties_to_the_lower_id_and_skip_nan() {
        let mut sampler = Sampler::new(
            &SamplingParams {
                logprobs: Some(3),
                ..params(0.0)
            },
            &[],
        );
        let mut logits = vec![1.0, f32::NAN, 2.0, 1.0, 1.0, 0.5];
        sampler.sample(&mut logits);
        let lp = &sampler.take_logprobs()[0];
        assert_eq!(
            lp.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![2, 0, 3]
        );
    }

    /// Allows only even token ids, and counts what it was told.
    #[derive(Debug, Default)]
    struct EvenOnly {
        committed: Vec<u32>,
    }

    impl TokenConstraint for EvenOnly {
        fn prepare(&mut self) -> std::result::Result<(), String> {
            Ok(())
        }
        fn mask(&mut self, logits: &mut [f32]) -> std::result::Result<(), String> {
            for (i, l) in logits.iter_mut().enumerate() {
                if i % 2 == 1 {
                    *l = f32::NEG_INFINITY;
                }
            }
            Ok(())
        }
        fn commit(&mut self, token: u32) -> std::result::Result<(), String> {
            self.committed.push(token);
            Ok(())
        }
    }

    #[test]
    fn a_constraint_masks_every_pick_and_forces_the_host() {
        let mut sampler =
            Sampler::new(&params(1.0), &[]).constrained(Box::new(EvenOnly::default()));
        assert!(sampler.needs_host());
        for _ in 0..50 {
            let mut logits = vec![0.0, 3.0, 0.0, 3.0, 0.5, 3.0];
            assert_eq!(sampler.sample(&mut logits) % 2, 0);
        }
        assert!(sampler.failure().is_none());
        assert!(!Sampler::new(&params(1.0), &[]).needs_host());
    }

    /// Forbids everything.
    #[derive(Debug)]
    struct Nothing;

    impl TokenConstraint for Nothing {
        fn prepare(&mut self) -> std::result::Result<(), String> {
            Ok(())
        }
        fn mask(&mut self, logits: &mut [f32]) -> std::result::Result<(), String> {
            logits.fill(f32::NEG_INFINITY);
            Ok(())
        }
        fn commit(&mut self, _: u32) -> std::result::Result<(), String> {
            Ok(())
        }
    }

    #[test]
    fn a_constraint_that_allows_nothing_is_a_failure_not_a_pick_from_nothing() {
        let mut sampler = Sampler::new(&params(0.0), &[]).constrained(Box::new(Nothing));
        let mut logits = vec![0.0, 1.0];
        sampler.sample(&mut logits);
        assert_eq!(sampler.failure(), Some("the grammar allows no token here"));
    }

    /// Logits whose softmax is exactly the given probabilities (up to rounding).
    fn logits_of(probabilities: &[f32]) -> Vec<f32> {
        probabilities.iter().map(|p| p.ln()).collect()
    }

    /// Tokens seen in `draws` samples from fixed logits.
    fn tokens_drawn(params: &SamplingParams, logits: &[f32], draws: usize) -> BTreeSet<u32> {
        let mut sampler = Sampler::new(params, &[]);
        (0..draws)
            .map(|_| sampler.sample(&mut logits.to_vec()))
            .collect()
    }

    fn counts_drawn(params: &SamplingParams, logits: &[f32], draws: usize) -> Vec<usize> {
        let mut sampler = Sampler::new(params, &[]);
        let mut counts = vec![0; logits.len()];
        for _ in 0..draws {
            counts[sampler.sample(&mut logits.to_vec()) as usize] += 1;
        }
        counts
    }

    fn candidates(weights: &[f32]) -> Vec<Candidate> {
        let scores = weights.iter().enumerate();
        scores
            .map(|(token, &score)| Candidate {
                token: token as u32,
                score,
            })
            .collect()
    }

    fn tokens(candidates: &[Candidate]) -> Vec<u32> {
        candidates.iter().map(|c| c.token).collect()
    }

    #[test]
    fn argmax_takes_lowest_id_on_ties_and_skips_nan() {
        assert_eq!(argmax(&[0.1, 2.0, -1.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -3.0, -2.0]), 2);
        assert_eq!(argmax(&[-1.0, f32::INFINITY, f32::INFINITY]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NAN]), 0);
    }

    proptest::proptest! {
        #[test]
        fn argmax_agrees_with_one_scan(
            logits in proptest::collection::vec(
                proptest::prop_oneof![
                    -4.0f32..4.0,
                    proptest::strategy::Just(1.0f32),
                    proptest::strategy::Just(f32::NAN),
                    proptest::strategy::Just(f32::NEG_INFINITY),
                    proptest::strategy::Just(f32::INFINITY),
                ],
                0..300,
            )
        ) {
            proptest::prop_assert_eq!(argmax(&logits), argmax_scan(&logits));
        }
    }

    #[test]
    fn greedy_picks_argmax() {
        let mut sampler = Sampler::new(&params(0.0), &[]);
        assert_eq!(sampler.sample(&mut [0.5, 3.0, 2.9, -1.0]), 1);
        assert_eq!(sampler.sample(&mut [7.0, 3.0, 7.0, -1.0]), 0);
    }

    #[test]
    fn logit_bias_shifts_logits_before_anything_else() {
        let biased = SamplingParams {
            logit_bias: vec![(2, 1.0), (3, -100.0), (9, 50.0)],
            ..params(0.0)
        };
        let mut sampler = Sampler::new(&biased, &[]);
        let mut logits = [0.5, 3.0, 2.9, 40.0];
        // Token 3 leads until banned; 2 overtakes 1 by its bias; 9 has no logit to shift.
        assert_eq!(sampler.sample(&mut logits), 2);
        assert_eq!(logits, [0.5, 3.0, 3.9, -60.0]);
        let tokens = tokens_drawn(
            &SamplingParams {
                temperature: 1.0,
                ..biased
            },
            &[0.0; 4],
            200,
        );
        assert!(!tokens.contains(&3), "{tokens:?}");
    }

    #[test]
    fn logit_bias_is_checked_against_its_range() {
        let out_of_range = SamplingParams {
            logit_bias: vec![(1, 100.0), (2, -100.5)],
            ..params(0.0)
        };
        let error = out_of_range.validate().unwrap_err().to_string();
        assert!(
            error.contains("logit_bias") && error.contains("token 2"),
            "{error}"
        );
        let edges = SamplingParams {
            logit_bias: vec![(1, 100.0), (2, -100.0)],
            ..params(0.0)
        };
        edges.validate().unwrap();
    }

    #[test]
    fn top_k_one_matches_greedy_at_any_temperature() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for temperature in [0.01, 0.5, 1.0, 2.0, 100.0] {
            let top_one = SamplingParams {
                top_k: 1,
                ..params(temperature)
            };
            let mut sampler = Sampler::new(&top_one, &[]);
            for _ in 0..50 {
                let logits: Vec<f32> = (0..1000).map(|_| uniform_f64(&mut rng) as f32).collect();
                assert_eq!(sampler.sample(&mut logits.clone()), argmax(&logits));
            }
        }
    }

    #[test]
    fn top_k_keeps_the_k_largest() {
        let mut kept = candidates(&[0.1, 0.4, 0.3, 0.4, 0.2]);
        keep_top_k(&mut kept, 3);
        kept.sort_unstable_by(rank);
        assert_eq!(tokens(&kept), [1, 3, 2]);

        let logits = logits_of(&[0.1, 0.4, 0.3, 0.15, 0.05]);
        let top_two = SamplingParams {
            top_k: 2,
            ..params(1.0)
        };
        assert_eq!(
            tokens_drawn(&top_two, &logits, 2000),
            BTreeSet::from([1, 2])
        );
    }

    #[test]
    fn nucleus_is_the_fewest_tokens_reaching_top_p() {
        let mut kept = candidates(&[0.05, 0.5, 0.15, 0.3]);
        keep_nucleus(&mut kept, 0.75);
        assert_eq!(tokens(&kept), [1, 3]);

        let mut kept = candidates(&[0.05, 0.5, 0.15, 0.3]);
        keep_nucleus(&mut kept, 0.4);
        assert_eq!(tokens(&kept), [1]);
    }

    #[test]
    fn nucleus_of_a_flat_distribution_breaks_ties_by_lowest_id() {
        let mut kept = candidates(&[1.0; 1000]);
        keep_nucleus(&mut kept, 0.5);
        kept.sort_unstable_by(rank);
        assert_eq!(tokens(&kept), (0..500).collect::<Vec<u32>>());
    }

    proptest::proptest! {
        /// Weights are multiples of 1/8, so every sum is exact and the nucleus is unambiguous.
        #[test]
        fn nucleus_matches_a_full_sort(
            eighths in proptest::collection::vec(0u8..=8, 1..400),
            top_p in 0.01f32..1.0,
        ) {
            let weights: Vec<f32> = eighths.iter().map(|&e| f32::from(e) / 8.0).collect();
            let mut sorted = candidates(&weights);
            sorted.sort_unstable_by(rank);
            let target = f64::from(top_p) * mass(&sorted);
            let len = nucleus_len(&sorted, target).unwrap_or(sorted.len());
            let mut kept = candidates(&weights);
            keep_nucleus(&mut kept, top_p);
            kept.sort_unstable_by(rank);
            proptest::prop_assert_eq!(tokens(&kept), tokens(&sorted[..len]));
        }
    }

    #[test]
    fn top_p_draws_only_from_the_nucleus() {
        let logits = logits_of(&[0.5, 0.3, 0.15, 0.05]);
        let expected = [(0.4, vec![0]), (0.75, vec![0, 1]), (0.85, vec![0, 1, 2])];
        for (top_p, nucleus) in expected {
            let nucleus_params = SamplingParams {
                top_p,
                ..params(1.0)
            };
            let drawn = tokens_drawn(&nucleus_params, &logits, 2000);
            assert_eq!(drawn, BTreeSet::from_iter(nucleus), "top_p {top_p}");
        }
    }

    #[test]
    fn min_p_keeps_tokens_within_a_ratio_of_the_most_likely() {
        let mut kept = candidates(&[0.3, 1.0, 0.1, 0.6]);
        keep_min_p(&mut kept, 0.5);
        assert_eq!(tokens(&kept), [1, 3]);

        let logits = logits_of(&[0.5, 0.3, 0.15, 0.05]);
        let expected = [(0.25, vec![0, 1, 2]), (0.5, vec![0, 1]), (1.0, vec![0])];
        for (min_p, kept) in expected {
            let min_p_params = SamplingParams {
                min_p,
                ..params(1.0)
            };
            let drawn = tokens_drawn(&min_p_params, &logits, 2000);
            assert_eq!(drawn, BTreeSet::from_iter(kept), "min_p {min_p}");
        }
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
        let penalised = SamplingParams {
            repetition_penalty: 2.0,
            ..params(0.0)
        };
        let mut sampler = Sampler::new(&penalised, &[0, 1, 1]);
        sampler.accept(2);
        sampler.accept(2);
        sampler.accept(9);
        let mut logits = [2.0, -1.0, 4.0, 3.0, -2.0];
        sampler.apply_penalties(&mut logits);
        assert_eq!(logits, [1.0, -2.0, 2.0, 3.0, -2.0]);
    }

    #[test]
    fn presence_and_frequency_penalties_count_only_generated_tokens() {
        let penalised = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..params(0.0)
        };
        let mut sampler = Sampler::new(&penalised, &[0, 3]);
        for token in [1, 1, 2, 9] {
            sampler.accept(token);
        }
        let mut logits = [1.0, 1.0, 1.0, 1.0];
        sampler.apply_penalties(&mut logits);
        assert_eq!(logits, [1.0, 0.0, 0.25, 1.0]);
    }

    #[test]
    fn penalties_are_applied_before_greedy_choice() {
        let penalised = SamplingParams {
            frequency_penalty: 1.0,
            ..params(0.0)
        };
        let mut sampler = Sampler::new(&penalised, &[]);
        sampler.accept(0);
        assert_eq!(sampler.sample(&mut [1.5, 1.0]), 1);
    }

    #[test]
    fn kept_logits_are_the_first_pick_s_as_the_model_gave_them() {
        let biased = SamplingParams {
            logit_bias: vec![(0, 10.0)],
            ..params(0.0)
        };
        let mut sampler = Sampler::new(&biased, &[]);
        let mut greedy = Sampler::new(&params(0.0), &[]);
        assert!(!greedy.needs_host());
        greedy.keep_next_logits();
        assert!(
            greedy.needs_host(),
            "a kept pick is made where the row is whole"
        );
        assert_eq!(greedy.sample(&mut [0.5, 2.0, 1.0]), 1);
        assert_eq!(greedy.sample(&mut [3.0, 2.0, 1.0]), 0);
        assert_eq!(greedy.take_kept_logits(), Some(vec![0.5, 2.0, 1.0]));
        assert!(!greedy.needs_host());
        assert_eq!(greedy.take_kept_logits(), None);
        sampler.keep_next_logits();
        assert_eq!(
            sampler.sample(&mut [0.5, 2.0, 1.0]),
            0,
            "the bias applies to the pick"
        );
        assert_eq!(
            sampler.take_kept_logits(),
            Some(vec![0.5, 2.0, 1.0]),
            "but not to the copy"
        );
    }

    #[test]
    fn same_seed_draws_the_same_tokens() {
        let logits = logits_of(&[0.2, 0.3, 0.1, 0.4]);
        let run = |seed| {
            let mut sampler = Sampler::new(
                &SamplingParams {
                    seed: Some(seed),
                    ..params(0.8)
                },
                &[],
            );
            (0..64)
                .map(|_| sampler.sample(&mut logits.clone()))
                .collect::<Vec<u32>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        assert_eq!(run(42)[..12], [3, 3, 1, 3, 1, 0, 1, 3, 3, 1, 2, 3]);
    }

    #[test]
    fn empirical_frequencies_match_softmax() {
        let logits = [1.0, 2.0, 3.0];
        for temperature in [1.0f32, 2.0] {
            let weights = logits.map(|l: f32| (l / temperature).exp());
            let total: f32 = weights.iter().sum();
            let counts = counts_drawn(&params(temperature), &logits, 20_000);
            for (count, weight) in counts.iter().zip(weights) {
                let observed = *count as f32 / 20_000.0;
                let expected = weight / total;
                assert!(
                    (observed - expected).abs() < 0.015,
                    "{observed} vs {expected}"
                );
            }
        }
    }

    #[test]
    fn nothing_drawable_falls_back_to_token_zero() {
        let mut sampler = Sampler::new(&params(1.0), &[]);
        assert_eq!(sampler.sample(&mut [f32::NAN, f32::NEG_INFINITY]), 0);
        assert_eq!(sampler.sample(&mut [f32::NEG_INFINITY, f32::INFINITY]), 1);
    }

    #[test]
    fn defaults_are_valid() {
        SamplingParams::default().validate().unwrap();
    }

    #[test]
    fn validate_names_the_bad_field_and_its_range() {
        let cases = [
            (
                SamplingParams {
                    temperature: -0.1,
                    ..Default::default()
                },
                "`temperature`: must be in [0, 100], got -0.1",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..Default::default()
                },
                "`temperature`: must be in [0, 100], got NaN",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..Default::default()
                },
                "`top_p`: must be in (0, 1], got 0",
            ),
            (
                SamplingParams {
                    min_p: 1.5,
                    ..Default::default()
                },
                "`min_p`: must be in [0, 1], got 1.5",
            ),
            (
                SamplingParams {
                    presence_penalty: 2.5,
                    ..Default::default()
                },
                "`presence_penalty`: must be in [-2, 2], got 2.5",
            ),
            (
                SamplingParams {
                    frequency_penalty: -3.0,
                    ..Default::default()
                },
                "`frequency_penalty`: must be in [-2, 2], got -3",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..Default::default()
                },
                "`repetition_penalty`: must be in (0, inf), got 0",
            ),
            (
                SamplingParams {
                    max_tokens: 0,
                    ..Default::default()
                },
                "`max_tokens`: must be at least 1, got 0",
            ),
            (
                SamplingParams {
                    stop: vec!["x".into(); 17],
                    ..Default::default()
                },
                "`stop`: at most 16 stop strings are allowed, got 17",
            ),
            (
                SamplingParams {
                    stop: vec!["x".into(), String::new()],
                    ..Default::default()
                },
                "`stop`: stop strings must not be empty, entry 1 is",
            ),
        ];
        for (bad, message) in cases {
            let error = bad.validate().unwrap_err().to_string();
            assert_eq!(error, format!("invalid sampling parameter {message}"));
        }
    }

    #[test]
    fn deserializes_partial_requests_and_stop_as_string_or_list() {
        let one: SamplingParams =
            serde_json::from_str(r#"{"temperature": 0.7, "stop": "\n"}"#).unwrap();
        let expected = SamplingParams {
            temperature: 0.7,
            stop: vec!["\n".into()],
            ..Default::default()
        };
        assert_eq!(one, expected);
        let many: SamplingParams = serde_json::from_str(r#"{"stop": ["a", "b"]}"#).unwrap();
        assert_eq!(many.stop, ["a", "b"]);
        let none: SamplingParams = serde_json::from_str(r#"{"stop": null}"#).unwrap();
        assert_eq!(none, SamplingParams::default());
    }
}
