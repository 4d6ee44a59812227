//! The cache, snapshot, back-off and admission sections of a deployment's TOML file, and their
//! validation into the runtime [`Policies`].
//!
//! Owns the raw serde structs, which refuse unknown keys and fill every missing key with a
//! default, and `validate`, the only way to obtain the runtime structs. A validation error names
//! the offending key as it is spelled in the file. This module never reads the environment and
//! never looks at a device: a pool sized as a fraction of free memory stays a fraction here, and
//! the engine resolves it.

use serde::{Deserialize, Serialize};

use crate::backoff::{BackoffPolicy, OnExhausted};
use crate::error::PolicyError;
use crate::eviction::EvictionKind;
use crate::reservation::ReservationPolicy;

/// Largest page the kernels are written for; pages are powers of two so a position splits into
/// page and offset with a shift and a mask.
pub const MAX_PAGE_TOKENS: usize = 1024;

/// The whole file as far as the cache manager is concerned.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub engine: EngineConfig,
    pub cache: CacheConfig,
    pub snapshots: SnapshotConfig,
    pub backoff: BackoffConfig,
    pub admission: AdmissionConfig,
}

/// Which backend runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// CUDA when a usable GPU is found, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

/// `[engine]`: the backend and the device resources it may take.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    pub backend: BackendKind,
    /// CPU backend threads; 0 takes every core.
    pub threads: usize,
    /// CUDA device ordinal.
    pub device: usize,
    /// Fraction of the GPU's memory snapserve may hold in all: weights, workspaces, the pool
    /// and the device snapshot tier.
    pub gpu_memory_fraction: f64,
    /// Replay decode steps as CUDA graphs.
    pub cuda_graphs: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            backend: BackendKind::Auto,
            threads: 0,
            device: 0,
            gpu_memory_fraction: 0.9,
            cuda_graphs: true,
        }
    }
}

impl EngineConfig {
    pub fn validate(&self) -> Result<EngineConfig, PolicyError> {
        let fraction = self.gpu_memory_fraction;
        require(
            fraction > 0.0 && fraction <= 1.0,
            "engine.gpu_memory_fraction",
            || format!("must be in (0, 1], got {fraction}"),
        )?;
        Ok(self.clone())
    }
}

/// `[cache]`: the working pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Token positions per page.
    pub page_tokens: usize,
    /// Pool size in tokens; exclusive with `pool_memory_fraction`.
    pub pool_tokens: Option<u64>,
    /// Pool size as a fraction of the memory free after the weights are loaded.
    pub pool_memory_fraction: Option<f64>,
    pub reservation: ReservationPolicy,
}

/// `[snapshots]`: the snapshot store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SnapshotConfig {
    pub device_budget_bytes: u64,
    pub host_budget_bytes: u64,
    pub eviction: EvictionKind,
    /// Move a snapshot evicted from the device tier to the host tier when the host has room.
    pub demote_to_host: bool,
    /// Save a snapshot of every prompt once it is prefilled.
    pub save_prompts: bool,
    /// Prompts shorter than this are not saved (their prefill is cheap).
    pub min_save_tokens: usize,
}

/// `[backoff]`: what a job that hit context-full does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BackoffConfig {
    pub base_ms: u64,
    pub max_ms: u64,
    pub multiplier: f64,
    /// Fraction of each delay that jitter may take off, in `[0, 1]`.
    pub jitter: f64,
    pub max_attempts: u32,
    pub on_exhausted: OnExhausted,
}

/// `[admission]`: queue bounds and the per-step token budget.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionConfig {
    /// Requests waiting beyond this are refused with 429.
    pub max_queue: usize,
    /// Sequences running at once; also the number of slots in the working pool.
    pub max_running: usize,
    /// Tokens (prefill chunks plus decode rows) one engine step may process.
    pub step_token_budget: usize,
    /// Decode steps the engine runs per scheduler step when every running sequence is
    /// decoding and nothing waits in the queue, feeding each sampled token back itself. More
    /// than 1 divides the scheduling overhead between engine steps by that much; the cost is
    /// that a request arriving meanwhile waits up to that many steps to be admitted, and a
    /// sequence that stops early holds its pages until the batch's last step.
    pub decode_steps: usize,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            page_tokens: 16,
            pool_tokens: None,
            pool_memory_fraction: None,
            reservation: ReservationPolicy::WorstCase,
        }
    }
}

impl Default for SnapshotConfig {
    fn default() -> Self {
        SnapshotConfig {
            device_budget_bytes: 1 << 30,
            host_budget_bytes: 0,
            eviction: EvictionKind::Lru,
            demote_to_host: false,
            save_prompts: true,
            min_save_tokens: 64,
        }
    }
}

impl Default for BackoffConfig {
    fn default() -> Self {
        BackoffConfig {
            base_ms: 10,
            max_ms: 2_000,
            multiplier: 2.0,
            jitter: 0.25,
            max_attempts: 8,
            on_exhausted: OnExhausted::Preempt,
        }
    }
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            max_queue: 256,
            max_running: 32,
            step_token_budget: 2_048,
            decode_steps: 1,
        }
    }
}

/// How big the working pool is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PoolSize {
    Tokens(u64),
    /// Fraction, in `(0, 1]`, of the memory free after the weights are loaded.
    MemoryFraction(f64),
}

/// Validated `[cache]`.
#[derive(Debug, Clone, PartialEq)]
pub struct CachePolicy {
    page_tokens: usize,
    pool: PoolSize,
    reservation: ReservationPolicy,
}

impl CachePolicy {
    pub fn page_tokens(&self) -> usize {
        self.page_tokens
    }
    pub fn pool(&self) -> PoolSize {
        self.pool
    }
    pub fn reservation(&self) -> ReservationPolicy {
        self.reservation
    }
}

/// Validated `[snapshots]`.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotPolicy {
    device_budget_bytes: u64,
    host_budget_bytes: u64,
    eviction: EvictionKind,
    demote_to_host: bool,
    save_prompts: bool,
    min_save_tokens: usize,
}

impl SnapshotPolicy {
    pub fn device_budget_bytes(&self) -> u64 {
        self.device_budget_bytes
    }
    pub fn host_budget_bytes(&self) -> u64 {
        self.host_budget_bytes
    }
    pub fn eviction(&self) -> EvictionKind {
        self.eviction
    }
    pub fn demote_to_host(&self) -> bool {
        self.demote_to_host
    }
    pub fn save_prompts(&self) -> bool {
        self.save_prompts
    }
    pub fn min_save_tokens(&self) -> usize {
        self.min_save_tokens
    }
}

/// Validated `[admission]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionPolicy {
    max_queue: usize,
    max_running: usize,
    step_token_budget: usize,
    decode_steps: usize,
}

impl AdmissionPolicy {
    pub fn max_queue(&self) -> usize {
        self.max_queue
    }
    pub fn max_running(&self) -> usize {
        self.max_running
    }
    pub fn step_token_budget(&self) -> usize {
        self.step_token_budget
    }
    pub fn decode_steps(&self) -> usize {
        self.decode_steps
    }
}

/// Everything the cache manager and the scheduler are built from.
#[derive(Debug, Clone, PartialEq)]
pub struct Policies {
    pub engine: EngineConfig,
    pub cache: CachePolicy,
    pub snapshots: SnapshotPolicy,
    pub backoff: BackoffPolicy,
    pub admission: AdmissionPolicy,
}

impl Policies {
    /// Parses and validates a TOML document.
    pub fn from_toml(text: &str) -> Result<Policies, PolicyError> {
        Config::from_toml(text)?.validate()
    }
}

impl Config {
    /// Parses a TOML document; unknown keys and wrong types are errors, missing keys default.
    pub fn from_toml(text: &str) -> Result<Config, PolicyError> {
        Ok(toml::from_str(text)?)
    }

    pub fn validate(&self) -> Result<Policies, PolicyError> {
        Ok(Policies {
            engine: self.engine.validate()?,
            cache: self.cache.validate()?,
            snapshots: self.snapshots.validate()?,
            backoff: self.backoff.validate()?,
            admission: self.admission.validate()?,
        })
    }
}

fn require(
    holds: bool,
    key: &'static str,
    reason: impl FnOnce() -> String,
) -> Result<(), PolicyError> {
    if holds {
        Ok(())
    } else {
        Err(PolicyError::invalid(key, reason()))
    }
}

impl CacheConfig {
    pub fn validate(&self) -> Result<CachePolicy, PolicyError> {
        let page_tokens = self.page_tokens;
        require(
            page_tokens.is_power_of_two() && page_tokens <= MAX_PAGE_TOKENS,
            "cache.page_tokens",
            || format!("must be a power of two from 1 to {MAX_PAGE_TOKENS}, got {page_tokens}"),
        )?;
        Ok(CachePolicy {
            page_tokens,
            pool: self.pool_size()?,
            reservation: self.reservation,
        })
    }

    fn pool_size(&self) -> Result<PoolSize, PolicyError> {
        match (self.pool_tokens, self.pool_memory_fraction) {
            (Some(_), Some(_)) => Err(PolicyError::invalid(
                "cache.pool_tokens",
                "and cache.pool_memory_fraction are exclusive; set one",
            )),
            (Some(tokens), None) => {
                let page = self.page_tokens as u64;
                require(tokens >= page, "cache.pool_tokens", || {
                    format!(
                        "must hold at least one page (cache.page_tokens = {page}), got {tokens}"
                    )
                })?;
                Ok(PoolSize::Tokens(tokens))
            }
            (None, Some(fraction)) => {
                require(
                    fraction > 0.0 && fraction <= 1.0,
                    "cache.pool_memory_fraction",
                    || format!("must be in (0, 1], got {fraction}"),
                )?;
                Ok(PoolSize::MemoryFraction(fraction))
            }
            (None, None) => Ok(PoolSize::MemoryFraction(0.9)),
        }
    }
}

impl SnapshotConfig {
    pub fn validate(&self) -> Result<SnapshotPolicy, PolicyError> {
        require(
            !self.demote_to_host || self.host_budget_bytes > 0,
            "snapshots.demote_to_host",
            || "needs snapshots.host_budget_bytes > 0".to_string(),
        )?;
        Ok(SnapshotPolicy {
            device_budget_bytes: self.device_budget_bytes,
            host_budget_bytes: self.host_budget_bytes,
            eviction: self.eviction,
            demote_to_host: self.demote_to_host,
            save_prompts: self.save_prompts,
            min_save_tokens: self.min_save_tokens,
        })
    }
}

impl BackoffConfig {
    pub fn validate(&self) -> Result<BackoffPolicy, PolicyError> {
        let (base, max) = (self.base_ms, self.max_ms);
        require(base >= 1, "backoff.base_ms", || {
            "must be at least 1".to_string()
        })?;
        require(max >= base, "backoff.max_ms", || {
            format!("must be >= backoff.base_ms ({base}), got {max}")
        })?;
        let multiplier = self.multiplier;
        require(
            multiplier.is_finite() && multiplier >= 1.0,
            "backoff.multiplier",
            || format!("must be a finite number >= 1, got {multiplier}"),
        )?;
        let jitter = self.jitter;
        require((0.0..=1.0).contains(&jitter), "backoff.jitter", || {
            format!("must be in [0, 1], got {jitter}")
        })?;
        require(self.max_attempts >= 1, "backoff.max_attempts", || {
            "must be at least 1".to_string()
        })?;
        Ok(BackoffPolicy {
            base_ms: base,
            max_ms: max,
            multiplier,
            jitter,
            max_attempts: self.max_attempts,
            on_exhausted: self.on_exhausted,
        })
    }
}

/// The most decode steps one scheduler step may hand the engine.
pub const MAX_DECODE_STEPS: usize = 64;

impl AdmissionConfig {
    pub fn validate(&self) -> Result<AdmissionPolicy, PolicyError> {
        require(self.max_queue >= 1, "admission.max_queue", || {
            "must be at least 1".to_string()
        })?;
        require(self.max_running >= 1, "admission.max_running", || {
            "must be at least 1".to_string()
        })?;
        // Every running sequence decodes one token per step; a smaller budget starves some.
        let (budget, running) = (self.step_token_budget, self.max_running);
        require(budget >= running, "admission.step_token_budget", || {
            format!("must be >= admission.max_running ({running}), got {budget}")
        })?;
        let steps = self.decode_steps;
        require(
            (1..=MAX_DECODE_STEPS).contains(&steps),
            "admission.decode_steps",
            || format!("must be between 1 and {MAX_DECODE_STEPS}, got {steps}"),
        )?;
        Ok(AdmissionPolicy {
            max_queue: self.max_queue,
            max_running: self.max_running,
            step_token_budget: self.step_token_budget,
            decode_steps: self.decode_steps,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_section_reads_and_checks_the_memory_fraction() {
        let policies =
            Policies::from_toml("[engine]\nbackend = \"cuda\"\ngpu_memory_fraction = 0.5\n")
                .unwrap();
        assert_eq!(policies.engine.backend, BackendKind::Cuda);
        assert_eq!(policies.engine.gpu_memory_fraction, 0.5);
        let err = Policies::from_toml("[engine]\ngpu_memory_fraction = 1.5\n").unwrap_err();
        assert!(
            err.to_string().contains("engine.gpu_memory_fraction"),
            "{err}"
        );
        assert!(Policies::from_toml("[engine]\nbackend = \"tpu\"\n").is_err());
    }

    fn invalid_key(text: &str) -> &'static str {
        let err = Policies::from_toml(text).expect_err("configuration should be refused");
        err.key()
            .unwrap_or_else(|| panic!("expected a key in {err}"))
    }

    #[test]
    fn an_empty_file_gives_the_defaults() {
        let policies = Policies::from_toml("").expect("defaults are valid");
        assert_eq!(policies.cache.page_tokens(), 16);
        assert_eq!(policies.cache.pool(), PoolSize::MemoryFraction(0.9));
        assert_eq!(policies.cache.reservation(), ReservationPolicy::WorstCase);
        assert_eq!(policies.snapshots.device_budget_bytes(), 1 << 30);
        assert_eq!(policies.backoff.on_exhausted(), OnExhausted::Preempt);
        assert_eq!(policies.admission.max_running(), 32);
    }

    #[test]
    fn every_section_reads_its_keys() {
        let text = r#"
            [cache]
            page_tokens = 32
            pool_tokens = 65536
            reservation = "optimistic"
            [snapshots]
            device_budget_bytes = 1000
            host_budget_bytes = 2000
            eviction = "lru"
            demote_to_host = true
            [backoff]
            base_ms = 5
            max_ms = 50
            multiplier = 3.0
            jitter = 0.0
            max_attempts = 2
            on_exhausted = "fail"
            [admission]
            max_queue = 10
            max_running = 4
            step_token_budget = 512
        "#;
        let p = Policies::from_toml(text).expect("valid");
        assert_eq!(p.cache.pool(), PoolSize::Tokens(65536));
        assert_eq!(p.cache.reservation(), ReservationPolicy::Optimistic);
        assert!(p.snapshots.demote_to_host());
        assert_eq!(p.snapshots.host_budget_bytes(), 2000);
        assert_eq!(p.backoff.ceiling_ms(2), 15);
        assert_eq!(p.backoff.on_exhausted(), OnExhausted::Fail);
        assert_eq!(p.admission.step_token_budget(), 512);
    }

    #[test]
    fn unknown_keys_and_values_are_refused() {
        for text in [
            "[cache]\npage_token = 16",
            "[cache]\nreservation = \"hopeful\"",
            "[snapshots]\neviction = \"random\"",
            "[backoff]\non_exhausted = \"retry\"",
            "[server]\nport = 1",
        ] {
            let err = Policies::from_toml(text).expect_err(text);
            assert!(matches!(err, PolicyError::Parse(_)), "{text}: {err}");
        }
    }

    #[test]
    fn validation_errors_name_the_key() {
        assert_eq!(
            invalid_key("[cache]\npage_tokens = 12"),
            "cache.page_tokens"
        );
        assert_eq!(
            invalid_key("[cache]\npage_tokens = 2048"),
            "cache.page_tokens"
        );
        assert_eq!(
            invalid_key("[cache]\npool_tokens = 100\npool_memory_fraction = 0.5"),
            "cache.pool_tokens"
        );
        assert_eq!(invalid_key("[cache]\npool_tokens = 8"), "cache.pool_tokens");
        assert_eq!(
            invalid_key("[cache]\npool_memory_fraction = 1.5"),
            "cache.pool_memory_fraction"
        );
        assert_eq!(
            invalid_key("[snapshots]\ndemote_to_host = true"),
            "snapshots.demote_to_host"
        );
        assert_eq!(invalid_key("[backoff]\nbase_ms = 0"), "backoff.base_ms");
        assert_eq!(
            invalid_key("[backoff]\nbase_ms = 100\nmax_ms = 50"),
            "backoff.max_ms"
        );
        assert_eq!(
            invalid_key("[backoff]\nmultiplier = 0.5"),
            "backoff.multiplier"
        );
        assert_eq!(invalid_key("[backoff]\njitter = 1.5"), "backoff.jitter");
        assert_eq!(
            invalid_key("[backoff]\nmax_attempts = 0"),
            "backoff.max_attempts"
        );
        assert_eq!(
            invalid_key("[admission]\nmax_queue = 0"),
            "admission.max_queue"
        );
        assert_eq!(
            invalid_key("[admission]\nmax_running = 0"),
            "admission.max_running"
        );
        assert_eq!(
            invalid_key("[admission]\nmax_running = 64\nstep_token_budget = 32"),
            "admission.step_token_budget"
        );
        assert_eq!(
            invalid_key("[admission]\ndecode_steps = 0"),
            "admission.decode_steps"
        );
        assert_eq!(
            invalid_key("[admission]\ndecode_steps = 65"),
            "admission.decode_steps"
        );
    }

    #[test]
    fn the_message_says_the_key_and_the_rule() {
        let err = Policies::from_toml("[backoff]\nbase_ms = 100\nmax_ms = 50").unwrap_err();
        assert_eq!(
            err.to_string(),
            "backoff.max_ms must be >= backoff.base_ms (100), got 50"
        );
    }
}
