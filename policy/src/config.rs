//! The cache, snapshot, back-off and admission sections of a deployment's TOML file, and their
//! validation into the runtime [`Policies`].
//!
//! Owns the raw serde structs, which refuse unknown keys and fill every missing key with a
//! default, and `validate`, the only way to obtain the runtime structs. A validation error names
//! the offending key as it is spelled in the file. This module never reads the environment and
//! never looks at a device: a pool sized as a fraction of free memory stays a fraction here, and
//! the engine resolves it.

use std::time::Duration;

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
    pub server: ServerConfig,
    pub speculative: SpeculativeConfig,
}

/// How draft tokens are proposed for speculative decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpeculativeMethod {
    /// One token per decode step.
    #[default]
    None,
    /// Continue the latest earlier occurrence of the last few tokens (in the prompt or the
    /// text generated): free, and right when the output copies its input.
    PromptLookup,
}

/// How long each draft is ([`crate::draft_length`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DraftSizing {
    /// As many of the proposed tokens as are expected to add more than they cost, by each
    /// request's acceptance so far and the step time learnt from decode and verify steps
    /// (anchored by the verify steps the warm-up timed).
    #[default]
    ByCost,
    /// Every proposed token, up to `draft_tokens`.
    Whole,
}

/// `[speculative]`: speculative decoding, drafts verified inside the scheduler's steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpeculativeConfig {
    pub method: SpeculativeMethod,
    /// Draft tokens verified with a sequence's last token in one pass (at most 7: a verify
    /// row is at most 8 wide).
    pub draft_tokens: usize,
    /// The shortest and longest n-grams prompt lookup matches. The shortest is 2 by default:
    /// one matching token is weak evidence that the text is copying (in free text nearly every
    /// token occurred before), and drafts proposed from it are mostly refused; on real text
    /// 2 was better than 1 for every prompt replayed (BENCHMARKS.md).
    pub ngram_min: usize,
    pub ngram_max: usize,
    /// Above this many running sequences speculation switches itself off: a busy GPU has no
    /// compute to spare for verifying tokens that may be refused.
    pub max_batch: usize,
    /// How much of each proposal is verified.
    pub draft_sizing: DraftSizing,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        SpeculativeConfig {
            method: SpeculativeMethod::None,
            draft_tokens: 7,
            ngram_min: 2,
            ngram_max: 3,
            max_batch: 8,
            draft_sizing: DraftSizing::ByCost,
        }
    }
}

/// The widest verify row: a sequence's last token and its draft.
pub const MAX_VERIFY_WIDTH: usize = 8;

impl SpeculativeConfig {
    pub fn validate(&self) -> Result<SpeculativeConfig, PolicyError> {
        require(
            (1..MAX_VERIFY_WIDTH).contains(&self.draft_tokens),
            "speculative.draft_tokens",
            || {
                format!(
                    "must be 1 to {}, got {}",
                    MAX_VERIFY_WIDTH - 1,
                    self.draft_tokens
                )
            },
        )?;
        require(
            self.ngram_min >= 1 && self.ngram_min <= self.ngram_max && self.ngram_max <= 64,
            "speculative.ngram_min",
            || {
                format!(
                    "needs 1 <= ngram_min <= ngram_max <= 64, got {} and {}",
                    self.ngram_min, self.ngram_max
                )
            },
        )?;
        require(self.max_batch >= 1, "speculative.max_batch", || {
            "must be at least 1".to_string()
        })?;
        Ok(self.clone())
    }
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

/// How the GPU holds the projection weights (q/k/v, output, gate/up, down).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Quantization {
    /// bf16, as checkpoints store them (other float types converted).
    #[default]
    None,
    /// FP8 (e4m3) with one scale per weight row, quantized at load; each projection's input
    /// is quantized per token as the step runs. Half the weights' bytes and twice the tensor
    /// cores' bf16 rate (sm_89 and newer), for a small loss of accuracy: an operator's choice,
    /// not the default (README: FP8 weights).
    Fp8,
    /// The CPU backend only, on a folder that keeps the GGUF's Q4_1/Q8_0 blocks (the embedded
    /// model's CPU default): each projection's input rows are quantized to 8 bits in blocks of
    /// 32 and multiplied by the blocks in integers, as llama.cpp does. Decode up to 1.5×
    /// faster, logits within about 2% of the exact products' (which can change a near tie:
    /// README: the CPU's integer products); not the default.
    Int8,
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
    /// On the GPU, launch the next decode step before this one's tokens are read, where it
    /// can only be the same sequences one position on (steady decoding, every row sampled on
    /// the device): the device reads each token from the step before and never waits on the
    /// host between steps. A step launched so and not asked for (a sequence ended, another
    /// joined) is computed for nothing and left unread. Needs `cuda_graphs`; off while drafts
    /// are proposed (`[speculative]`), since the step after a decode step may verify drafts.
    pub run_ahead: bool,
    /// On the GPU, run a small model's (hidden size up to 1,024) decode steps of one sequence
    /// in three launches a layer instead of five: the norms' weights and consecutive
    /// projections multiplied together at load, so the gate/up projection need not wait for the
    /// output projection nor the next q/k/v for the down projection. Twice the layers' weight
    /// bytes on the device; logits within bf16 rounding of the unfolded step's. Off where
    /// `batch_invariant` is on, with FP8 weights, and over several GPUs.
    pub folded_decode: bool,
    /// GPUs one model is split over (tensor parallelism): `device`, `device + 1`, ... unless
    /// `devices` names them. 1 runs on `device` alone.
    pub tensor_parallel: usize,
    /// The ranks' GPUs in rank order (`tensor_parallel` of them); empty: consecutive from
    /// `device`.
    pub devices: Vec<usize>,
    /// On the GPU, compute one-token steps and verifications of up to 8 positions with
    /// batch-invariant kernels, so a sequence decoding alone gets the same bits whether its
    /// tokens were verified together or decoded one a step: speculation's greedy text is then
    /// bit for bit the text of one token a step. Unset: on exactly where `[speculative]` is.
    /// Models of hidden size 4,096 or more decode one token a step on those kernels anyway
    /// (they are the faster there); on a smaller model without speculation, set it to get the
    /// very text a speculating one gives, at 8% more a batch-1 decode step on SmolLM2 (H200,
    /// BENCHMARKS.md).
    pub batch_invariant: Option<bool>,
    /// How the projections run quantized: `fp8` on the GPU, `int8` on the CPU (each backend
    /// refuses the other's).
    pub quantization: Quantization,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            backend: BackendKind::Auto,
            threads: 0,
            device: 0,
            gpu_memory_fraction: 0.9,
            cuda_graphs: true,
            run_ahead: true,
            folded_decode: true,
            tensor_parallel: 1,
            devices: Vec::new(),
            batch_invariant: None,
            quantization: Quantization::None,
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
        let n = self.tensor_parallel;
        require((1..=8).contains(&n), "engine.tensor_parallel", || {
            format!("must be 1 to 8 (GPUs of one host), got {n}")
        })?;
        require(
            self.devices.is_empty() || self.devices.len() == n,
            "engine.devices",
            || {
                format!(
                    "names {} devices for tensor_parallel = {n}: name one per rank or none",
                    self.devices.len()
                )
            },
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
    /// When a request whose prompt was saved or restored finishes, save its prompt and reply
    /// as well, so the next turn of a conversation restores everything before its new
    /// message. (A request whose prompt nobody has shown again leaves nothing behind.)
    pub save_replies: bool,
    /// A file of prefixes to keep from start-up, never evicted: JSON lines, each the body of
    /// `POST /v1/snapshots` (`{"prompt": ...}` or `{"messages": [...]}`).
    pub pin_prompts_file: Option<std::path::PathBuf>,
    /// A prompt's prefix is saved once this many requests have shown it: 1 saves every
    /// prompt, 2 waits for a repeat (the whole prompt) or a shared opening (a prefix at a
    /// 256-token stride boundary). Unset: [`DEFAULT_SAVE_AFTER_SIGHTINGS_GPU`] on a GPU,
    /// where saving competes with the step for the device, and 1 on the CPU, where a save
    /// is a small copy next to the prefill it spares.
    pub save_after_sightings: Option<u32>,
    /// The disk tier's directory: snapshots evicted from memory are written there, one file
    /// each, and the server finds them again after a restart. Unset: no disk tier.
    pub disk_dir: Option<std::path::PathBuf>,
    /// Bytes of snapshot files the disk tier may hold (needed with `disk_dir`).
    pub disk_budget_bytes: u64,
    /// Write a snapshot evicted from the last memory tier to the disk tier (with `disk_dir`).
    pub demote_to_disk: bool,
    /// On a clean shutdown, write every snapshot still in memory to the disk tier (most
    /// recently used first, as many as its budget holds), within the shutdown grace.
    pub flush_to_disk_on_shutdown: bool,
    /// Host bytes for the logits after whole prompts that were saved or restored (4 bytes a
    /// vocabulary entry each, least recently used dropped first): a request that repeats such
    /// a prompt takes its first token from them when its full pages restore, with no forward
    /// pass before it. 0 keeps none.
    pub prompt_logits_bytes: u64,
}

/// The default `snapshots.prompt_logits_bytes`: 256 MiB, the logits of ~500 prompts of a
/// 128k vocabulary.
pub const DEFAULT_PROMPT_LOGITS_BYTES: u64 = 256 << 20;

/// The default `snapshots.save_after_sightings` on a GPU (BENCHMARKS.md says why).
pub const DEFAULT_SAVE_AFTER_SIGHTINGS_GPU: u32 = 2;

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
    /// than 1 divides the scheduling overhead between engine steps by that much. A request
    /// arriving (or cancelled) meanwhile ends the run after the decode step in flight, so it
    /// waits one decode step to be admitted, as with 1; the cost left is that a sequence that
    /// stops early holds its pages, and its caller waits for its end, until the run's last step.
    pub decode_steps: usize,
    /// Plan the next step while the engine runs the one before it: the pool and store
    /// exchanges, the planning and the delivery of tokens overlap the forward pass instead of
    /// following it. A row planned that way starts from the token the step ahead of it picks,
    /// so a request that stops on that token has one decode row computed for nothing. Off
    /// while drafts are proposed (speculative decoding), since a draft is made from known
    /// tokens. It applies with `decode_steps = 1`: several decode steps per scheduler step
    /// are the other way to hide the scheduler's time, and with them steps go one at a time.
    pub overlap_steps: bool,
    /// The longest an engine step should take, in milliseconds: prompt chunks are cut so that
    /// a step's predicted time stays under it (the prediction is learnt from the steps run so
    /// far), which bounds how long a decoding sequence waits behind someone's long prompt.
    /// Unset: [`DEFAULT_MAX_STEP_MS_GPU`] on a GPU, [`DEFAULT_MAX_STEP_MS_CPU`] on the CPU.
    pub max_step_ms: Option<u64>,
}

/// `[server]`: the HTTP server's limits on slow or idle clients, and its shutdown.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Seconds SIGTERM lets requests in flight run before it cuts them. Unset: long enough
    /// for a request of the whole context at the decode speed measured at start-up, and at
    /// least [`MIN_SHUTDOWN_GRACE_S`].
    pub shutdown_grace_s: Option<u64>,
    /// Seconds a client has to send a request's whole body once its headers are in.
    pub body_timeout_s: u64,
    /// Seconds a client has to send a request's line and headers.
    pub header_timeout_s: u64,
    /// Seconds an idle keep-alive connection stays open; 0 closes each after one response.
    pub keep_alive_s: u64,
    /// Connections each HTTP worker holds at once; more wait in the kernel's backlog.
    pub max_connections: usize,
    /// Keys a client must present as `Authorization: Bearer KEY`; empty: the API is open.
    /// `snapserve serve --api-key` (or `SNAPSERVE_API_KEY`) adds one.
    pub api_keys: Vec<String>,
    /// Whether `/health` and `/metrics` need a key too (they stay open by default, for load
    /// balancers and Prometheus).
    pub keys_guard_health_and_metrics: bool,
    /// The key of the snapshot admin routes (`/v1/snapshots`); unset, they are off.
    /// `snapserve serve --admin-api-key` (or `SNAPSERVE_ADMIN_API_KEY`) sets it.
    pub admin_api_key: Option<String>,
}

/// The shortest default shutdown grace, in seconds.
pub const MIN_SHUTDOWN_GRACE_S: u64 = 120;

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
            save_replies: true,
            pin_prompts_file: None,
            save_after_sightings: None,
            disk_dir: None,
            disk_budget_bytes: 0,
            demote_to_disk: true,
            flush_to_disk_on_shutdown: true,
            prompt_logits_bytes: DEFAULT_PROMPT_LOGITS_BYTES,
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
            overlap_steps: true,
            max_step_ms: None,
        }
    }
}

/// The default `admission.max_step_ms` on a GPU, and on the CPU, where a step's fixed cost
/// (reading every weight once) is a larger share (BENCHMARKS.md has the measurements).
pub const DEFAULT_MAX_STEP_MS_GPU: u64 = 100;
pub const DEFAULT_MAX_STEP_MS_CPU: u64 = 250;

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            shutdown_grace_s: None,
            body_timeout_s: 30,
            header_timeout_s: 5,
            keep_alive_s: 5,
            max_connections: 4_096,
            api_keys: Vec::new(),
            keys_guard_health_and_metrics: false,
            admin_api_key: None,
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
    save_replies: bool,
    pin_prompts_file: Option<std::path::PathBuf>,
    save_after_sightings: Option<u32>,
    disk_dir: Option<std::path::PathBuf>,
    disk_budget_bytes: u64,
    demote_to_disk: bool,
    flush_to_disk_on_shutdown: bool,
    prompt_logits_bytes: u64,
}

impl SnapshotPolicy {
    /// Host bytes for the logits after repeated prompts (0 without prompt saves).
    pub fn prompt_logits_bytes(&self) -> u64 {
        if self.save_prompts {
            self.prompt_logits_bytes
        } else {
            0
        }
    }
    /// The disk tier's directory, if there is a disk tier.
    pub fn disk_dir(&self) -> Option<&std::path::Path> {
        self.disk_dir.as_deref()
    }
    /// The disk tier's budget: 0 without a disk tier.
    pub fn disk_budget_bytes(&self) -> u64 {
        if self.disk_dir.is_some() {
            self.disk_budget_bytes
        } else {
            0
        }
    }
    pub fn demote_to_disk(&self) -> bool {
        self.disk_dir.is_some() && self.demote_to_disk
    }
    pub fn flush_to_disk_on_shutdown(&self) -> bool {
        self.disk_dir.is_some() && self.flush_to_disk_on_shutdown
    }
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
    pub fn save_replies(&self) -> bool {
        self.save_replies
    }
    pub fn pin_prompts_file(&self) -> Option<&std::path::Path> {
        self.pin_prompts_file.as_deref()
    }
    /// The configured sightings before a prompt is saved, or the backend's default.
    pub fn save_after_sightings(&self, on_gpu: bool) -> u32 {
        self.save_after_sightings.unwrap_or(if on_gpu {
            DEFAULT_SAVE_AFTER_SIGHTINGS_GPU
        } else {
            1
        })
    }
}

/// Validated `[admission]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionPolicy {
    max_queue: usize,
    max_running: usize,
    step_token_budget: usize,
    decode_steps: usize,
    overlap_steps: bool,
    max_step: Option<Duration>,
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
    pub fn overlap_steps(&self) -> bool {
        self.overlap_steps
    }
    /// The configured step time limit, or the default for the backend.
    pub fn max_step(&self, on_gpu: bool) -> Duration {
        self.max_step.unwrap_or(Duration::from_millis(if on_gpu {
            DEFAULT_MAX_STEP_MS_GPU
        } else {
            DEFAULT_MAX_STEP_MS_CPU
        }))
    }
}

/// Validated `[server]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerPolicy {
    api_keys: Vec<String>,
    keys_guard_health_and_metrics: bool,
    admin_api_key: Option<String>,
    shutdown_grace: Option<Duration>,
    body_timeout: Duration,
    header_timeout: Duration,
    keep_alive: Duration,
    max_connections: usize,
}

/// The shortest API key accepted: a guessable key is no key.
pub const MIN_API_KEY_LEN: usize = 8;

impl ServerPolicy {
    /// The keys a request must present one of; empty when the API is open.
    pub fn api_keys(&self) -> &[String] {
        &self.api_keys
    }

    pub fn keys_guard_health_and_metrics(&self) -> bool {
        self.keys_guard_health_and_metrics
    }

    /// The admin routes' key, if they are on.
    pub fn admin_api_key(&self) -> Option<&str> {
        self.admin_api_key.as_deref()
    }

    /// Sets the admin key from outside the configuration file, under the API keys' rule.
    pub fn set_admin_api_key(&mut self, key: String) -> Result<(), PolicyError> {
        require(key.len() >= MIN_API_KEY_LEN, "--admin-api-key", || {
            format!("must be at least {MIN_API_KEY_LEN} characters")
        })?;
        self.admin_api_key = Some(key);
        Ok(())
    }

    /// Adds a key given outside the configuration file (the command line), under the same
    /// rule as the file's.
    pub fn add_api_key(&mut self, key: String) -> Result<(), PolicyError> {
        require(key.len() >= MIN_API_KEY_LEN, "--api-key", || {
            format!("must be at least {MIN_API_KEY_LEN} characters")
        })?;
        self.api_keys.push(key);
        Ok(())
    }

    /// The configured grace, or the default for a server whose longest request generates
    /// `max_tokens` tokens at `decode_step` each: that time with half again for a busy batch,
    /// and never under [`MIN_SHUTDOWN_GRACE_S`].
    pub fn shutdown_grace(&self, max_tokens: usize, decode_step: Duration) -> Duration {
        self.shutdown_grace.unwrap_or_else(|| {
            let needed = decode_step.mul_f64(max_tokens as f64 * 1.5);
            needed
                .max(Duration::from_secs(MIN_SHUTDOWN_GRACE_S))
                .min(Duration::from_secs(MAX_SHUTDOWN_GRACE_S))
        })
    }
    pub fn body_timeout(&self) -> Duration {
        self.body_timeout
    }
    pub fn header_timeout(&self) -> Duration {
        self.header_timeout
    }
    pub fn keep_alive(&self) -> Duration {
        self.keep_alive
    }
    pub fn max_connections(&self) -> usize {
        self.max_connections
    }
}

/// The longest default shutdown grace, in seconds: an hour.
const MAX_SHUTDOWN_GRACE_S: u64 = 3_600;

/// Everything the cache manager and the scheduler are built from.
#[derive(Debug, Clone, PartialEq)]
pub struct Policies {
    pub engine: EngineConfig,
    pub cache: CachePolicy,
    pub snapshots: SnapshotPolicy,
    pub backoff: BackoffPolicy,
    pub admission: AdmissionPolicy,
    pub server: ServerPolicy,
    pub speculative: SpeculativeConfig,
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
        require(
            self.engine.tensor_parallel == 1 || self.snapshots.disk_dir.is_none(),
            "snapshots.disk_dir",
            || "the disk snapshot tier does not run with engine.tensor_parallel > 1 yet".into(),
        )?;
        Ok(Policies {
            engine: self.engine.validate()?,
            cache: self.cache.validate()?,
            snapshots: self.snapshots.validate()?,
            backoff: self.backoff.validate()?,
            admission: self.admission.validate()?,
            server: self.server.validate()?,
            speculative: self.speculative.validate()?,
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
        require(
            self.save_after_sightings != Some(0),
            "snapshots.save_after_sightings",
            || "must be at least 1".to_string(),
        )?;
        require(
            self.disk_dir.is_none() || self.disk_budget_bytes > 0,
            "snapshots.disk_budget_bytes",
            || "must be above 0 when snapshots.disk_dir is set".to_string(),
        )?;
        Ok(SnapshotPolicy {
            device_budget_bytes: self.device_budget_bytes,
            host_budget_bytes: self.host_budget_bytes,
            eviction: self.eviction,
            demote_to_host: self.demote_to_host,
            save_prompts: self.save_prompts,
            min_save_tokens: self.min_save_tokens,
            save_replies: self.save_replies,
            pin_prompts_file: self.pin_prompts_file.clone(),
            save_after_sightings: self.save_after_sightings,
            disk_dir: self.disk_dir.clone(),
            disk_budget_bytes: self.disk_budget_bytes,
            demote_to_disk: self.demote_to_disk,
            flush_to_disk_on_shutdown: self.flush_to_disk_on_shutdown,
            prompt_logits_bytes: self.prompt_logits_bytes,
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
        require(self.max_step_ms != Some(0), "admission.max_step_ms", || {
            "must be at least 1".to_string()
        })?;
        Ok(AdmissionPolicy {
            max_queue: self.max_queue,
            max_running: self.max_running,
            step_token_budget: self.step_token_budget,
            decode_steps: self.decode_steps,
            overlap_steps: self.overlap_steps,
            max_step: self.max_step_ms.map(Duration::from_millis),
        })
    }
}

impl ServerConfig {
    pub fn validate(&self) -> Result<ServerPolicy, PolicyError> {
        if let Some(grace) = self.shutdown_grace_s {
            require(grace >= 1, "server.shutdown_grace_s", || {
                "must be at least 1".to_string()
            })?;
        }
        for (key, seconds) in [
            ("server.body_timeout_s", self.body_timeout_s),
            ("server.header_timeout_s", self.header_timeout_s),
        ] {
            require(seconds >= 1, key, || "must be at least 1".to_string())?;
        }
        require(self.max_connections >= 1, "server.max_connections", || {
            "must be at least 1".to_string()
        })?;
        require(
            self.api_keys.iter().all(|k| k.len() >= MIN_API_KEY_LEN),
            "server.api_keys",
            || format!("each key must be at least {MIN_API_KEY_LEN} characters"),
        )?;
        require(
            self.admin_api_key
                .as_ref()
                .is_none_or(|k| k.len() >= MIN_API_KEY_LEN),
            "server.admin_api_key",
            || format!("must be at least {MIN_API_KEY_LEN} characters"),
        )?;
        Ok(ServerPolicy {
            api_keys: self.api_keys.clone(),
            keys_guard_health_and_metrics: self.keys_guard_health_and_metrics,
            admin_api_key: self.admin_api_key.clone(),
            shutdown_grace: self.shutdown_grace_s.map(Duration::from_secs),
            body_timeout: Duration::from_secs(self.body_timeout_s),
            header_timeout: Duration::from_secs(self.header_timeout_s),
            keep_alive: Duration::from_secs(self.keep_alive_s),
            max_connections: self.max_connections,
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

    #[test]
    fn tensor_parallel_names_one_device_a_rank_and_no_disk_tier() {
        let policies =
            Policies::from_toml("[engine]\ntensor_parallel = 2\ndevices = [1, 0]\n").unwrap();
        assert_eq!(policies.engine.tensor_parallel, 2);
        assert_eq!(policies.engine.devices, [1, 0]);
        assert_eq!(Policies::from_toml("").unwrap().engine.tensor_parallel, 1);
        assert_eq!(
            invalid_key("[engine]\ntensor_parallel = 0\n"),
            "engine.tensor_parallel"
        );
        assert_eq!(
            invalid_key("[engine]\ntensor_parallel = 16\n"),
            "engine.tensor_parallel"
        );
        assert_eq!(
            invalid_key("[engine]\ntensor_parallel = 2\ndevices = [0]\n"),
            "engine.devices"
        );
        assert_eq!(
            invalid_key(
                "[engine]\ntensor_parallel = 2\n[snapshots]\ndisk_dir = \"/tmp/s\"\ndisk_budget_bytes = 1000\n"
            ),
            "snapshots.disk_dir"
        );
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
        assert_eq!(
            policies.admission.max_step(true),
            Duration::from_millis(100)
        );
        assert_eq!(
            policies.admission.max_step(false),
            Duration::from_millis(250)
        );
        assert!(
            policies
                .server
                .shutdown_grace(8192, Duration::from_millis(1))
                == Duration::from_secs(120)
        );
    }

    #[test]
    fn the_server_section_reads_its_keys_and_the_grace_follows_the_decode_speed() {
        let p = Policies::from_toml(
            "[server]\nbody_timeout_s = 7\nkeep_alive_s = 0\n[admission]\nmax_step_ms = 40\n",
        )
        .unwrap();
        assert_eq!(p.server.body_timeout(), Duration::from_secs(7));
        assert_eq!(p.server.keep_alive(), Duration::ZERO);
        assert_eq!(p.admission.max_step(true), Duration::from_millis(40));
        // 8,192 tokens at 25 ms, with half again: 307.2 s.
        let grace = p.server.shutdown_grace(8192, Duration::from_millis(25));
        assert_eq!(grace, Duration::from_millis(307_200));
        let p = Policies::from_toml("[server]\nshutdown_grace_s = 9\n").unwrap();
        assert_eq!(
            p.server.shutdown_grace(8192, Duration::from_millis(25)),
            Duration::from_secs(9)
        );
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
        assert_eq!(
            invalid_key("[admission]\nmax_step_ms = 0"),
            "admission.max_step_ms"
        );
        assert_eq!(
            invalid_key("[server]\nbody_timeout_s = 0"),
            "server.body_timeout_s"
        );
        assert_eq!(
            invalid_key("[server]\nshutdown_grace_s = 0"),
            "server.shutdown_grace_s"
        );
        assert_eq!(
            invalid_key("[server]\napi_keys = [\"sk-long-enough\", \"short\"]"),
            "server.api_keys"
        );
    }

    #[test]
    fn api_keys_come_from_the_file_and_the_command_line() {
        let mut policies =
            Policies::from_toml("[server]\napi_keys = [\"sk-from-the-file\"]\n").unwrap();
        assert!(!policies.server.keys_guard_health_and_metrics());
        policies
            .server
            .add_api_key("sk-from-the-flag".into())
            .unwrap();
        assert_eq!(
            policies.server.api_keys(),
            ["sk-from-the-file", "sk-from-the-flag"]
        );
        let error = policies.server.add_api_key("short".into()).unwrap_err();
        assert!(error.to_string().contains("--api-key"), "{error}");
        assert!(
            Policies::from_toml("")
                .unwrap()
                .server
                .api_keys()
                .is_empty()
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

    #[test]
    fn speculative_decoding_is_off_by_default_and_its_bounds_are_checked() {
        let p = Policies::from_toml("").unwrap();
        assert_eq!(p.speculative.method, SpeculativeMethod::None);
        let p = Policies::from_toml(
            "[speculative]\nmethod = \"prompt_lookup\"\ndraft_tokens = 5\nngram_max = 4\n",
        )
        .unwrap();
        assert_eq!(
            (
                p.speculative.method,
                p.speculative.draft_tokens,
                p.speculative.ngram_max
            ),
            (SpeculativeMethod::PromptLookup, 5, 4)
        );
        assert_eq!(p.speculative.draft_sizing, DraftSizing::ByCost);
        let whole = Policies::from_toml("[speculative]\ndraft_sizing = \"whole\"\n").unwrap();
        assert_eq!(whole.speculative.draft_sizing, DraftSizing::Whole);
        for bad in [
            "draft_tokens = 8",
            "draft_tokens = 0",
            "ngram_min = 3\nngram_max = 2",
            "max_batch = 0",
            "method = \"medusa\"",
        ] {
            let err = Policies::from_toml(&format!("[speculative]\n{bad}\n"));
            assert!(err.is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn quantization_is_asked_for_by_name_and_off_by_default() {
        let p = Config::from_toml("").unwrap();
        assert_eq!(p.engine.quantization, Quantization::None);
        let p = Config::from_toml("[engine]\nquantization = \"fp8\"\n").unwrap();
        assert_eq!(p.engine.quantization, Quantization::Fp8);
        let p = Config::from_toml("[engine]\nquantization = \"int8\"\n").unwrap();
        assert_eq!(p.engine.quantization, Quantization::Int8);
        let err = Config::from_toml("[engine]\nquantization = \"int4\"\n").unwrap_err();
        assert!(err.to_string().contains("int4"), "{err}");
    }
}
