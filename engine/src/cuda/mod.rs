//! The CUDA backend: the model in bf16 on an NVIDIA GPU, behind the same step interface as the
//! CPU backend.
//!
//! cudarc loads the CUDA libraries at run time, so this module is always compiled and a machine
//! without them fails only when the backend is asked for, with [`EngineError::CudaUnavailable`].
//! Weights are bf16 (q/k/v and gate/up fused); matrix products go through cuBLAS with fp32
//! accumulation, the vocabulary projection writing f32 logits; everything else is our own
//! kernels (`kernels/*.cu`, see [`kernels`]). The KV pool holds bf16 pages in the CPU backend's
//! page geometry. A step's metadata travels in one copy ([`step_meta`]); decode steps replay
//! CUDA graphs captured per batch-size bucket ([`graphs`]), other steps run eagerly. All work is
//! ordered on one stream; a step waits only for its own results.
//!
//! - [`device`]: context, stream, allocations and launches.
//! - [`kernels`]: the typed kernel registry.
//! - [`gemm`]: cuBLAS products.
//! - [`weights`]: the weights' layout and loading (checkpoint or seeded random).
//! - [`memory`]: the memory plan made before allocating.
//! - [`pool`]: the KV pool's bytes.
//! - [`step_meta`]: one step's metadata, packed and spread.
//! - [`forward`]: the forward pass and its workspaces.
//! - [`graphs`]: decode graphs.
//! - [`sample`]: sampling on the device.
//! - [`snapshots`]: snapshot buffers and page copies.
//! - [`collective`], [`tensor_parallel`]: one model over several GPUs, a rank each.

pub mod collective;
pub mod device;
pub mod fold;
pub mod forward;
pub mod fp8;
pub mod gemm;
pub mod graphs;
pub mod kernels;
pub mod memory;
pub mod pool;
pub mod sample;
pub mod snapshots;
pub mod step_meta;
pub mod tensor_parallel;
pub mod weights;

#[cfg(test)]
mod kernel_tests;
#[cfg(test)]
mod sync_probe;

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(name: &str) -> ModelConfig {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../scripts/shapes")
            .join(name);
        ModelConfig::from_json(&std::fs::read_to_string(&path).unwrap(), &path).unwrap()
    }

    #[test]
    fn long_rows_take_the_tensor_core_gemv_without_being_asked() {
        let big = shape("llama-3.1-8b.json");
        assert_eq!(tensor_core_gemv(&big, false), (true, true));
        let small = shape("smollm2-135m.json");
        assert_eq!(tensor_core_gemv(&small, false), (false, true));
        assert_eq!(tensor_core_gemv(&small, true), (true, true));
        // Rows that do not divide into the kernel's chunks keep it off unless asked for.
        let odd = ModelConfig {
            intermediate_size: big.intermediate_size + 8,
            ..big
        };
        assert_eq!(tensor_core_gemv(&odd, false), (false, false));
        assert_eq!(tensor_core_gemv(&odd, true), (true, false));
    }

    #[test]
    fn start_up_tunes_the_decode_buckets_products_that_run_on_cublas() {
        let shapes = |config: &ModelConfig, max_rows| {
            let qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim;
            tuned_products(config, qkv, max_rows, 1, forward::GEMV_MAX_WEIGHT_BYTES)
                .into_iter()
                .map(|(s, p)| (s.tokens, s.in_features, s.out_features, p))
                .collect::<Vec<_>>()
        };
        // The 8B shape: every weight fits the gemv, so one-token steps tune nothing; buckets
        // 2 to 64 tune all four projections.
        let big = shape("llama-3.1-8b.json");
        let got = shapes(&big, 64);
        assert_eq!(got.len(), 6 * 4);
        assert_eq!(got[0], (2, 4096, 6144, 0));
        assert_eq!(got[3], (2, 14336, 4096, 3));
        assert_eq!(got.last(), Some(&(64, 14336, 4096, 3)));
        assert!(got.iter().all(|&(tokens, ..)| tokens > 1 && tokens <= 64));
        // The 70B shape's MLP weights are too large for the gemv: tuned at one token too.
        let huge = shape("llama-3.1-70b.json");
        let one: Vec<_> = shapes(&huge, 256)
            .into_iter()
            .filter(|&(tokens, ..)| tokens == 1)
            .map(|(.., p)| p)
            .collect();
        assert_eq!(one, [2, 3]);
        assert_eq!(shapes(&huge, 256).len(), 2 + 8 * 4);
        // No room for a bucket: nothing to tune.
        assert!(shapes(&big, 0).is_empty());
    }

    fn row(token: u32, start_pos: usize, pages: &[u32]) -> RowPlan {
        RowPlan {
            tokens: vec![token],
            start_pos,
            pages: pages.iter().map(|&p| PageId(p)).collect(),
            logits: crate::backend::LogitsWanted::Last,
        }
    }

    #[test]
    fn a_step_continues_the_last_when_its_rows_are_each_one_position_on() {
        let last = [(40, Some(PageId(7))), (16, Some(PageId(2)))];
        let plan = |rows| StepPlan { rows };
        assert!(continues(
            &last,
            &plan(vec![row(5, 41, &[7, 8, 9]), row(6, 17, &[2, 3])])
        ));
        // Another position, another sequence, a row more or fewer: not a continuation.
        assert!(!continues(
            &last,
            &plan(vec![row(5, 42, &[7, 8, 9]), row(6, 17, &[2, 3])])
        ));
        assert!(!continues(
            &last,
            &plan(vec![row(5, 41, &[4, 8, 9]), row(6, 17, &[2, 3])])
        ));
        assert!(!continues(&last, &plan(vec![row(5, 41, &[7, 8, 9])])));
        assert!(!continues(&[], &plan(vec![row(5, 41, &[7])])));
    }

    #[test]
    fn steps_are_launched_ahead_only_where_nearly_every_step_continues_the_last() {
        // Every step eligible: the policy's part alone.
        let launched = |pattern: &[bool], steps: usize| {
            let mut policy = AheadPolicy::default();
            (0..steps)
                .filter(|&i| {
                    policy.step(pattern[i % pattern.len()]);
                    policy.eligible = true;
                    policy.may()
                })
                .count()
        };
        // One request after another at batch 1, 256 steps each: its prompt's step (rows of
        // many tokens: nothing could run ahead of it), its first decode step (which continues
        // nothing), then decode steps that continue the last. All but a few launch ahead.
        let mut policy = AheadPolicy::default();
        let mut n = 0;
        for _ in 0..8 {
            for i in 0..256 {
                policy.step(i >= 2);
                policy.eligible = i >= 1;
                n += policy.may() as usize;
            }
        }
        assert!(n >= 250 * 8, "{n}");
        assert!(!{
            let mut policy = AheadPolicy::default();
            policy.step(false);
            policy.may()
        });
        // Rows that change every other step, or every tenth: a few while the average (which
        // starts at 1) comes down, then none.
        assert!(launched(&[true, false], 1000) <= 2);
        let mut tenth = vec![true; 10];
        tenth[9] = false;
        assert!(launched(&tenth, 1000) <= 20, "{}", launched(&tenth, 1000));
        assert_eq!(launched(&tenth, 2000), launched(&tenth, 1000));
    }

    #[test]
    fn a_step_run_ahead_is_kept_only_for_the_very_step_it_ran() {
        // Launched after a step at positions 40 and 16: its rows at 41 and 17, on the picks of
        // that step, which were 11 and 12.
        let ahead = Ahead {
            plan: StepPlan {
                rows: vec![
                    row(kernels::FED_TOKEN, 41, &[7, 8, 9]),
                    row(kernels::FED_TOKEN + 1, 17, &[2, 3]),
                ],
            },
            params: vec![1, 2, 3],
            follows: vec![11, 12],
            slot: 1,
            replay: graphs::Replay {
                kernels: 8,
                captured: false,
            },
        };
        let plan = |rows| StepPlan { rows };
        let asked = plan(vec![row(11, 41, &[7, 8, 9]), row(12, 17, &[2, 3])]);
        assert!(ahead.is(&asked, &[1, 2, 3], 16));
        // Pages past the step's positions are not the step's: a row may have gained one.
        let grown = plan(vec![row(11, 41, &[7, 8, 9, 10]), row(12, 17, &[2, 3])]);
        assert!(ahead.is(&grown, &[1, 2, 3], 16));
        // Another token (the host took another pick), position, page, parameter or row count.
        let token = plan(vec![row(11, 41, &[7, 8, 9]), row(13, 17, &[2, 3])]);
        let position = plan(vec![row(11, 42, &[7, 8, 9]), row(12, 17, &[2, 3])]);
        let page = plan(vec![row(11, 41, &[7, 5, 9]), row(12, 17, &[2, 3])]);
        let fewer = plan(vec![row(11, 41, &[7, 8, 9])]);
        assert!(!ahead.is(&token, &[1, 2, 3], 16));
        assert!(!ahead.is(&position, &[1, 2, 3], 16));
        assert!(!ahead.is(&page, &[1, 2, 3], 16));
        assert!(!ahead.is(&fewer, &[1, 2, 3], 16));
        assert!(!ahead.is(&asked, &[1, 2, 4], 16));
        // Before its picks are read it is no step the host can ask for.
        let unread = Ahead {
            follows: Vec::new(),
            ..ahead
        };
        assert!(!unread.is(&asked, &[1, 2, 3], 16));
    }
}

use std::sync::Arc;

use cache::{BackingId, KvGeometry, PageClone, PageCopy, PageId, Tier};
use cudarc::driver::CudaEvent;
pub use policy::PoolSize;
use policy::{
    AdmissionPolicy, CachePolicy, EngineConfig, SnapshotPolicy, SpeculativeConfig,
    SpeculativeMethod,
};

use crate::backend::{Backend, BackendInfo, HostRun, MemoryReport, RowPlan, StepOutput, StepPlan};
use crate::error::{EngineError, Result};
use crate::model::{ModelConfig, ModelFiles, Shard, Weights};
use crate::sampling::Sampler;
use collective::{Collective, Endpoint};
use device::{DPtr, Device, DeviceBuffer, PinnedBuffer};
use fold::FoldedWeights;
use forward::{AttentionMode, Forward, TpForward, Workspace, WorkspaceSizes};
use gemm::Gemm;
use graphs::DecodeGraphs;
use kernels::{AttnShape, Kernels};
use memory::{MemoryPlan, PlanInputs};
use pool::KvPool;
use rayon::prelude::*;
use snapshots::{ArenaSizes, Backings, PoolPages};
use step_meta::{LogitSelection, MetaCapacity, PackRequest, StepLayout, StepMeta};
use weights::{GpuWeights, Matrix, WeightLayout};

/// Steps of up to eight tokens (all the gemv kernels take) use them: one token the CUDA-core
/// gemv for a small model, more the tensor-core one ([`forward::TENSOR_CORE_GEMV_MIN_TOKENS`]).
/// H100, tok/s at a context of 512, cuBLAS → gemv (BENCHMARKS.md, "The gemv for steps of two
/// to eight tokens"): SmolLM2 batch 2 2,238 → 3,963, batch 4 4,523 → 7,608, batch 8 8,706 →
/// 11,303; the 8B shape batch 2 321 → 358, batch 4 637 → 701, batch 8 1,252 → 1,378. FP8
/// weights stop sooner ([`forward::FP8_GEMV_MAX_TOKENS`]).
pub const DEFAULT_GEMV_MAX_TOKENS: usize = 8;
/// From this hidden size on, one-token steps run their small projections on the tensor-core
/// gemv (kernels/gemv_tc.cu) even where batch invariance is not asked for: with rows this long
/// it is the faster of the two (H200, batch 1: the 8B shape 4.05 against 4.19 ms a step), with
/// short ones the slower (SmolLM2, hidden 576: 0.623 against 0.579). A speculating server's
/// one-token steps then give the very bits of one that does not speculate.
pub const TENSOR_CORE_GEMV_MIN_HIDDEN: usize = 4096;

/// How to size and run the CUDA backend.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaOptions {
    pub device: usize,
    /// Ranks the model is split over (tensor parallelism), a GPU each: `device`, `device + 1`,
    /// ... unless `devices` names them.
    pub tensor_parallel: usize,
    /// The ranks' devices, in rank order; empty for consecutive ones from `device`. A device
    /// may be named twice (tests of the exchanges on one GPU).
    pub devices: Vec<usize>,
    /// Share of the device's memory the backend may hold in all.
    pub gpu_memory_fraction: f64,
    pub cuda_graphs: bool,
    pub page_tokens: usize,
    pub pool: PoolSize,
    /// The device snapshot tier's budget; its arena, with room for demotions in flight
    /// ([`device_arena_bytes`]), is allocated at start-up. 0: an arena that grows on demand.
    pub device_snapshot_bytes: u64,
    /// Pinned host memory allocated at start-up for the host snapshot tier. 0: an arena that
    /// grows on demand (nothing is pinned unless used).
    pub host_snapshot_bytes: u64,
    /// The most tokens one step may hold.
    pub max_step_tokens: usize,
    /// The most rows (sequences) one step may hold.
    pub max_rows: usize,
    /// Steps of at most this many tokens (up to [`kernels::GEMV_MAX_TOKENS`]; 0 for none) run
    /// their projections of small weights through our gemv kernel instead of cuBLAS
    pub gemv_max_tokens: usize,
    /// Only weights of at most this many bytes go through the gemv kernel.
    pub gemv_max_weight_bytes: usize,
    /// Verify drafts exactly as one token a step decodes (speculation's greedy text is then the
    /// text without it): steps of at most `gemv_max_tokens` tokens, and a verification's up to
    /// [`kernels::GEMV_MAX_TOKENS`] positions, run their small projections on the tensor-core
    /// gemv (kernels/gemv_tc.cu), whose sums do not depend on the token count, and split each
    /// position's attention as a lone row's. Where rows are long one-token steps run on that
    /// gemv anyway ([`TENSOR_CORE_GEMV_MIN_HIDDEN`]); where they are short it costs them (H200:
    /// SmolLM2 0.579 → 0.623 ms a step; BENCHMARKS.md), so by default it is on where
    /// speculation is (`[engine] batch_invariant`).
    pub exact_verify: bool,
    /// Launch each kernel of a step of at most `gemv_max_tokens` tokens as a programmatic
    /// dependent of the one before, where the device has it (sm_90 and newer): its blocks wait
    /// on the device instead of being launched after. Measured on the H200: SmolLM2 batch 1 ×
    /// 512 1,519 / 1,534 → 1,607 / 1,609 tok/s; at batch 8 it cost 2% (8,352 / 8,336 → 8,193 /
    /// 8,171), so larger steps launch plainly.
    pub programmatic_launch: bool,
    /// Time cuBLASLt's algorithms for the decode graphs' cuBLAS products at start-up and run
    /// the fastest where it beats cuBLAS's default ([`gemm::Gemm::tune`]; a split model keeps
    /// the default).
    pub tune_gemms: bool,
    /// Decode steps of few short rows run attention with each row's whole context in one block's
    /// shared memory, copied before the kernel before ends, instead of split over a cluster of
    /// blocks (see [`kernels::Kernels::decode_attention_resident`]).
    pub resident_decode: bool,
    /// Launch the next decode step before the host reads this one's picks, where it is most
    /// likely the same rows one position on (every row sampled on the device, its next page
    /// held, and nearly every recent step continued the one before: `AheadPolicy`): the
    /// step's tokens are read on the device from the picks of the one before. Kept when the
    /// next step asked for is that one, left unread when it is not. The device then goes from
    /// step to step without waiting on the host (`CudaBackend::launch_ahead`).
    pub run_ahead: bool,
    /// Hold the layers' projections in FP8 (e4m3, a scale a row) and run them as FP8 products
    /// (`[engine] quantization = "fp8"`; Hopper: cuBLASLt takes its per-row scales on sm_90 only).
    pub fp8_weights: bool,
    /// Run one-token steps of one row in folded layers (fold.rs: three launches a layer
    /// instead of five, for twice the weight bytes), where the model is small enough
    /// ([`fold::FOLD_MAX_HIDDEN`]), its weights bf16 and on one device, and `exact_verify` is
    /// off (a folded step's sums are not a verification's).
    pub folded_decode: bool,
}

impl CudaOptions {
    /// Each rank's device.
    pub fn rank_devices(&self) -> Vec<usize> {
        if self.devices.is_empty() {
            (self.device..self.device + self.tensor_parallel).collect()
        } else {
            self.devices.clone()
        }
    }

    /// The options a server configuration asks for.
    pub fn from_policies(
        engine: &EngineConfig,
        cache: &CachePolicy,
        snapshots: &SnapshotPolicy,
        admission: &AdmissionPolicy,
        speculative: &SpeculativeConfig,
    ) -> Self {
        CudaOptions {
            device: engine.device,
            tensor_parallel: engine.tensor_parallel,
            devices: engine.devices.clone(),
            gpu_memory_fraction: engine.gpu_memory_fraction,
            cuda_graphs: engine.cuda_graphs,
            page_tokens: cache.page_tokens(),
            pool: cache.pool(),
            device_snapshot_bytes: snapshots.device_budget_bytes(),
            // Snapshots reach the host tier only by demotion.
            host_snapshot_bytes: if snapshots.demote_to_host() {
                snapshots.host_budget_bytes()
            } else {
                0
            },
            max_step_tokens: admission.step_token_budget(),
            max_rows: admission.max_running(),
            gemv_max_tokens: DEFAULT_GEMV_MAX_TOKENS,
            gemv_max_weight_bytes: forward::GEMV_MAX_WEIGHT_BYTES,
            exact_verify: engine
                .batch_invariant
                .unwrap_or(speculative.method != SpeculativeMethod::None),
            programmatic_launch: true,
            tune_gemms: true,
            resident_decode: true,
            // A step after a decode step may verify drafts instead: one launched ahead
            // would be left unread as often as drafts are proposed.
            run_ahead: engine.run_ahead && speculative.method == SpeculativeMethod::None,
            fp8_weights: engine.quantization == policy::Quantization::Fp8,
            folded_decode: engine.folded_decode,
        }
    }

    /// Options for `tokens` pool positions and steps of up to `max_step_tokens` tokens and
    /// `max_rows` rows (benchmarks and tests).
    pub fn for_tokens(tokens: usize, max_step_tokens: usize, max_rows: usize) -> Self {
        CudaOptions {
            device: 0,
            tensor_parallel: 1,
            devices: Vec::new(),
            gpu_memory_fraction: 0.9,
            cuda_graphs: true,
            page_tokens: 16,
            pool: PoolSize::Tokens(tokens as u64),
            device_snapshot_bytes: 0,
            host_snapshot_bytes: 0,
            max_step_tokens,
            max_rows,
            gemv_max_tokens: DEFAULT_GEMV_MAX_TOKENS,
            gemv_max_weight_bytes: forward::GEMV_MAX_WEIGHT_BYTES,
            exact_verify: false,
            programmatic_launch: true,
            tune_gemms: true,
            resident_decode: true,
            run_ahead: true,
            fp8_weights: false,
            folded_decode: true,
        }
    }
}

/// The products the decode graphs run on cuBLAS, which start-up tunes ([`gemm::Gemm::tune`]):
/// every bucket of at most `max_rows` rows by each projection (0 q/k/v, 1 output, 2 gate/up,
/// 3 down) that the gemv does not serve.
fn tuned_products(
    config: &ModelConfig,
    qkv_width: usize,
    max_rows: usize,
    gemv_max_tokens: usize,
    gemv_max_weight_bytes: usize,
) -> Vec<(gemm::Linear, usize)> {
    let c = config;
    let projections = [
        (c.hidden_size, qkv_width),
        (c.q_dim(), c.hidden_size),
        (c.hidden_size, 2 * c.intermediate_size),
        (c.intermediate_size, c.hidden_size),
    ];
    let mut products = Vec::new();
    for &tokens in graphs::BUCKETS.iter().filter(|&&b| b <= max_rows) {
        for (projection, &(in_features, out_features)) in projections.iter().enumerate() {
            let on_gemv = tokens <= gemv_max_tokens
                && in_features * out_features * 2 <= gemv_max_weight_bytes;
            if !on_gemv {
                let shape = gemm::Linear {
                    tokens,
                    in_features,
                    out_features,
                };
                products.push((shape, projection));
            }
        }
    }
    products
}

/// How a verification step runs (see [`CudaBackend::verify_route`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerifyRoute {
    /// The logits of every wanted row downloaded and picked on the host.
    Host,
    /// A decode step of one row per position, through the decode graphs.
    AsDecode,
    /// One pass, every wanted row picked greedily on the device.
    Wanted,
}

/// A tensor-parallel rank's exchange state.
struct TpState {
    collective: Collective,
    /// This rank's slice of the logits, `[logit rows, vocab / world]`.
    logits_local: DeviceBuffer,
    local_vocab: usize,
}

/// Where the weights come from.
#[derive(Clone, Copy)]
enum WeightSource<'a> {
    Checkpoint(&'a Weights),
    Random { seed: u64 },
}

pub struct CudaBackend {
    /// The model as this rank computes it ([`Shard::local`]): the whole model on one GPU.
    config: ModelConfig,
    shard: Shard,
    /// A rank's end of the exchanges, where the model is split.
    tp: Option<TpState>,
    gemv_max_tokens: usize,
    gemv_max_weight_bytes: usize,
    exact_verify: bool,
    /// Whether the small projections run on the tensor-core gemv: where `exact_verify` asks
    /// for it, and where it is the faster one ([`TENSOR_CORE_GEMV_MIN_HIDDEN`]).
    tensor_core_gemv: bool,
    /// [`CudaOptions::resident_decode`].
    resident_decode: bool,
    programmatic_launch: bool,
    info: BackendInfo,
    plan: MemoryPlan,
    graphs: Option<DecodeGraphs>,
    /// What the last step's graph replay ran, if it replayed one.
    last_replay: Option<graphs::Replay>,
    /// Kernels the last sampled step launched, where all were counted.
    last_step_kernels: Option<usize>,
    /// What start-up's GEMM tuning found, in a line ([`CudaBackend::tune_gemms`]).
    gemm_tuning: Option<String>,
    /// The rows of logits a step's host-sampled rows are picked from, kept between steps.
    host_logits: Vec<f32>,
    /// The sampling kernel's picks, written by the device straight into page-locked host
    /// memory: the host reads them once the step's event has passed, with no copy to queue and
    /// no driver staging of a pageable download. Two slots of `picks_stride` words, each with
    /// its event: a step launched ahead writes the one its predecessor does not (a step's
    /// metadata names its slot, so a graph that samples serves both).
    picks: PinnedBuffer,
    picks_stride: usize,
    picked: [CudaEvent; 2],
    /// [`CudaOptions::run_ahead`].
    run_ahead: bool,
    /// The decode step launched ahead of the host's asking for it, if one is in flight.
    ahead: Option<Ahead>,
    /// Steps launched ahead so far: kept (the step asked for next), and left unread.
    ahead_kept: u64,
    ahead_dropped: u64,
    /// When the next step may be launched ahead.
    ahead_policy: AheadPolicy,
    /// Where each row of the last sampled step started, and its first page: whether a step
    /// continues it ([`continues`]).
    last_sampled: Vec<(usize, Option<PageId>)>,
    /// Grammars' bitmasks of a step, a row each, and the device buffer they go to.
    host_masks: Vec<u32>,
    masks: Option<DeviceBuffer>,
    backings: Backings,
    meta: StepMeta,
    ws: Workspace,
    pool: KvPool,
    weights: GpuWeights,
    /// The folded layers' matrices, where one-token steps fold ([`CudaOptions::folded_decode`]).
    folded: Option<FoldedWeights>,
    gemm: Gemm,
    kernels: Kernels,
    device: Arc<Device>,
}

impl CudaBackend {
    /// Loads `model`'s weights onto the GPU.
    pub fn load(model: &ModelFiles, options: &CudaOptions) -> Result<Self> {
        let weights = Weights::open(&model.dir)?;
        Self::from_weights(model.config.clone(), &weights, options)
    }

    /// A model of `config` with the checkpoint's weights.
    pub fn from_weights(
        config: ModelConfig,
        weights: &Weights,
        options: &CudaOptions,
    ) -> Result<Self> {
        if options.tensor_parallel > 1 {
            return Err(EngineError::TensorParallel(
                "a split model is built by tensor_parallel::TensorParallel".into(),
            ));
        }
        Self::build(
            config,
            options,
            WeightSource::Checkpoint(weights),
            Shard::WHOLE,
            None,
        )
    }

    /// A model of `config`'s shape with weights drawn on the GPU from `seed`.
    pub fn random(config: ModelConfig, seed: u64, options: &CudaOptions) -> Result<Self> {
        Self::build(
            config,
            options,
            WeightSource::Random { seed },
            Shard::WHOLE,
            None,
        )
    }

    /// Rank `shard` of `model` on `options.device` (the whole model for [`Shard::WHOLE`]).
    fn build(
        model: ModelConfig,
        options: &CudaOptions,
        source: WeightSource,
        shard: Shard,
        fence: Option<Arc<collective::HostFence>>,
    ) -> Result<Self> {
        check_options(options)?;
        let config = shard.local(&model);
        if !config.hidden_size.is_multiple_of(8) {
            return Err(EngineError::CudaUnavailable(format!(
                "hidden_size {} is not a multiple of 8, which the CUDA kernels read 8 at a time",
                config.hidden_size
            )));
        }
        let device = Device::open(options.device)?;
        if options.fp8_weights {
            check_fp8(&config, device.compute_capability)?;
        }
        let kernels = Kernels::load(&device, config.head_dim)?;
        let geometry = KvGeometry {
            layers: config.num_layers,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            page_tokens: options.page_tokens,
            dtype_bytes: 2,
        };
        let (capacity, sizes) = step_sizes(&config, options, device.multiprocessors as usize);
        let (tensor_core_gemv, rows_divide) = tensor_core_gemv(&config, options.exact_verify);
        if options.exact_verify && options.fp8_weights {
            tracing::warn!(
                "batch_invariant with FP8 weights: the projections run on cuBLASLt, whose sums \
                 depend on the token count, so a verification's text may part from one token a \
                 step's near a tie"
            );
        }
        if options.exact_verify && !rows_divide {
            let rows = [config.hidden_size, config.q_dim(), config.intermediate_size];
            tracing::warn!(
                "batch_invariant: rows of {rows:?} elements are not all a multiple of {}; \
                 those projections run on cuBLAS, so a verification's text may part from one \
                 token a step's near a tie",
                kernels::GEMV_TC_CHUNK
            );
        }
        let folds = options.folded_decode
            && !options.exact_verify
            && !options.fp8_weights
            && shard.is_whole()
            && options.gemv_max_tokens >= 1
            && FoldedWeights::fits(&config);
        let plan = MemoryPlan::new(&PlanInputs {
            device_name: device.name.clone(),
            total_bytes: device.total_bytes,
            free_bytes: device.free_bytes()?,
            gpu_memory_fraction: options.gpu_memory_fraction,
            weights_bytes: (WeightLayout::new(&model, shard, options.fp8_weights).bytes()
                + if folds {
                    FoldedWeights::bytes(&config)
                } else {
                    0
                }) as u64,
            workspace_bytes: (sizes.bytes(&config) + capacity.bytes()) as u64,
            snapshot_bytes: device_arena_bytes(options.device_snapshot_bytes),
            pool: options.pool,
            page_bytes: geometry.page_bytes() as u64,
            page_tokens: options.page_tokens,
            min_pages: geometry.pages_for(options.max_step_tokens),
        })?;
        let weights = match source {
            WeightSource::Checkpoint(w) => {
                GpuWeights::load(&device, &kernels, &model, shard, options.fp8_weights, w)?
            }
            WeightSource::Random { seed } => {
                GpuWeights::random(&device, &kernels, &model, shard, options.fp8_weights, seed)?
            }
        };
        let folded = if folds {
            let started = std::time::Instant::now();
            let folded = FoldedWeights::build(&device, &kernels, &config, &weights)?;
            tracing::info!(
                "one-sequence decode steps run folded layers: {} MiB of folded weights, built                  in {:.2} s",
                FoldedWeights::bytes(&config) >> 20,
                started.elapsed().as_secs_f64()
            );
            Some(folded)
        } else {
            None
        };
        let tp = if shard.is_whole() {
            None
        } else {
            let local_vocab = shard.vocab(&model).len();
            Some(TpState {
                collective: Collective::new(&device, shard, fence)?,
                logits_local: DeviceBuffer::alloc(
                    &device,
                    sizes.logit_rows * local_vocab * 4,
                    "this rank's logits",
                )?,
                local_vocab,
            })
        };
        let pool = KvPool::new(&device, geometry, plan.pool_pages)?;
        let info = BackendInfo {
            name: "cuda",
            geometry,
            num_pages: plan.pool_pages,
            vocab_size: config.vocab_size,
            max_positions: config.max_position_embeddings,
        };
        let picks = PinnedBuffer::alloc(&device, 2 * sizes.rows * 4, "the sampled tokens")?;
        let picked = [
            device.context().new_event(None)?,
            device.context().new_event(None)?,
        ];
        let mut backend = CudaBackend {
            picks,
            picks_stride: sizes.rows,
            picked,
            run_ahead: options.run_ahead,
            ahead: None,
            ahead_kept: 0,
            ahead_dropped: 0,
            ahead_policy: AheadPolicy::default(),
            last_sampled: Vec::new(),
            meta: StepMeta::new(&device, capacity, options.page_tokens, pool.spare_page())?,
            ws: Workspace::new(&device, &config, sizes)?,
            gemm: Gemm::new(&device)?,
            graphs: options.cuda_graphs.then(DecodeGraphs::default),
            last_replay: None,
            last_step_kernels: None,
            gemm_tuning: None,
            host_logits: Vec::new(),
            host_masks: Vec::new(),
            masks: None,
            backings: Backings::new(
                &device,
                ArenaSizes {
                    device_bytes: device_arena_bytes(options.device_snapshot_bytes),
                    host_bytes: options.host_snapshot_bytes,
                },
                geometry.page_bytes(),
                2 * config.num_layers,
            )?,
            pool,
            weights,
            folded,
            kernels,
            device,
            gemv_max_tokens: options.gemv_max_tokens.min(if options.fp8_weights {
                forward::FP8_GEMV_MAX_TOKENS
            } else {
                kernels::GEMV_MAX_TOKENS
            }),
            gemv_max_weight_bytes: options.gemv_max_weight_bytes,
            exact_verify: options.exact_verify,
            tensor_core_gemv,
            resident_decode: options.resident_decode,
            programmatic_launch: options.programmatic_launch,
            config,
            shard,
            tp,
            info,
            plan,
        };
        if options.tune_gemms && backend.tp.is_none() {
            backend.tune_gemms()?;
        }
        Ok(backend)
    }

    /// Times cuBLASLt's algorithms for the products the decode graphs run on cuBLAS (every
    /// bucket's, on every layer's weights in turn) and keeps the faster ones ([`Gemm::tune`]).
    fn tune_gemms(&mut self) -> Result<()> {
        let layers: Vec<_> = (0..self.config.num_layers)
            .map(|l| self.weights.layer(l))
            .collect();
        let weights: [Vec<Matrix>; 4] = [
            layers.iter().map(|w| w.wqkv).collect(),
            layers.iter().map(|w| w.wo).collect(),
            layers.iter().map(|w| w.w_gate_up).collect(),
            layers.iter().map(|w| w.w_down).collect(),
        ];
        let shapes: Vec<(gemm::Linear, Vec<Matrix>)> = tuned_products(
            &self.config,
            self.attn_shape().qkv_width(),
            self.ws.sizes.rows.min(self.ws.sizes.logit_rows),
            self.gemv_max_tokens,
            self.gemv_max_weight_bytes,
        )
        .into_iter()
        .map(|(shape, projection)| (shape, weights[projection].clone()))
        .collect();
        let Some(tokens) = shapes.iter().map(|(s, _)| s.tokens).max() else {
            return Ok(());
        };
        let widest = |f: fn(&gemm::Linear) -> usize| shapes.iter().map(|(s, _)| f(s)).max();
        let x_elems = tokens * widest(|s| s.in_features).unwrap_or(0);
        let y_elems = tokens * widest(|s| s.out_features).unwrap_or(0);
        let x = DeviceBuffer::alloc(&self.device, x_elems * 2, "GEMM tuning input")?;
        let y = DeviceBuffer::alloc(&self.device, y_elems * 2, "GEMM tuning output")?;
        let started = std::time::Instant::now();
        let results = if self.weights.fp8() {
            let fp8 = |ws: &[Matrix]| -> Vec<(DPtr<u8>, DPtr<f32>)> {
                ws.iter()
                    .map(|w| match *w {
                        Matrix::Fp8 { w, scales } => (w, scales),
                        Matrix::Bf16(_) => unreachable!("FP8 weights hold every projection so"),
                    })
                    .collect()
            };
            let shapes: Vec<_> = shapes.iter().map(|(s, ws)| (*s, fp8(ws))).collect();
            // The inputs' bytes (e4m3) in the first half of `x`, their scales after.
            let scales = x.ptr::<u8>().offset(x_elems).cast();
            self.gemm
                .tune_fp8(&self.device, &shapes, (x.ptr(), scales), y.ptr())?
        } else {
            let bf16 = |ws: &[Matrix]| ws.iter().map(|w| w.bf16()).collect();
            let shapes: Vec<(gemm::Linear, Vec<DPtr<half::bf16>>)> =
                shapes.iter().map(|(s, ws)| (*s, bf16(ws))).collect();
            self.gemm.tune(&self.device, &shapes, x.ptr(), y.ptr())?
        };
        let (mut default_us, mut tuned_us) = (0.0, 0.0);
        for r in &results {
            default_us += r.default_us;
            tuned_us += match (r.kept, r.best_us) {
                (true, Some(best)) => best,
                _ => r.default_us,
            };
            tracing::debug!(
                "GEMM {} x {} -> {}: default {:.1} µs, best cuBLASLt candidate {:?} µs{}",
                r.shape.tokens,
                r.shape.in_features,
                r.shape.out_features,
                r.default_us,
                r.best_us.map(|us| (us * 10.0).round() / 10.0),
                if r.kept { ", kept" } else { "" }
            );
        }
        let (what, default) = if self.weights.fp8() {
            ("FP8 decode products", "cuBLASLt's first choice")
        } else {
            ("decode products on cuBLASLt", "cuBLAS's default")
        };
        let summary = format!(
            "tuned {} of {} {what} in {:.2} s: one of each together {:.0} µs with {default}, \
             {:.0} µs as run",
            results.iter().filter(|r| r.kept).count(),
            results.len(),
            started.elapsed().as_secs_f64(),
            default_us,
            tuned_us
        );
        tracing::info!("{summary}");
        self.gemm_tuning = Some(summary);
        Ok(())
    }

    /// This rank's entry in its group's table, if the model is split.
    fn endpoint(&self) -> Option<Endpoint> {
        let tp = self.tp.as_ref()?;
        Some(tp.collective.endpoint(self.ws.proj, tp.logits_local.ptr()))
    }

    /// Gives this rank its group's table.
    fn connect(&self, endpoints: &[Endpoint]) -> Result<()> {
        self.device.bind()?;
        match &self.tp {
            Some(tp) => tp.collective.connect(&self.device, endpoints),
            None => Ok(()),
        }
    }

    /// Waits for the queued work (an exchange waiting for a rank that failed gives up in
    /// time), then zeroes the exchanges' state.
    fn reset_exchanges(&mut self) -> Result<()> {
        self.device.bind()?;
        self.device.synchronize()?;
        match &self.tp {
            Some(tp) => tp.collective.reset(&self.device),
            None => Ok(()),
        }
    }

    /// Where an exchange gave up waiting for a peer since the last reset, if one did, and the
    /// exchanges this rank has run.
    fn exchange_state(&self) -> Result<(Option<String>, u32)> {
        let ran = match &self.tp {
            Some(tp) => tp.collective.exchanges(&self.device)?,
            None => 0,
        };
        Ok((self.exchange_timeout()?, ran))
    }

    /// Where an exchange gave up waiting for a peer since the last reset, if one did: what
    /// every step checks (one small download), the rest only for the error.
    fn exchange_timeout(&self) -> Result<Option<String>> {
        match &self.tp {
            Some(tp) => tp.collective.timeout(&self.device),
            None => Ok(None),
        }
    }

    /// Seconds one of `count` all-reduces of `tokens` rows of the hidden state takes, captured
    /// in one graph and replayed `replays` times, every rank at once (rank 0's clock). The
    /// residual stream and sublayer output they use are scratch between steps.
    fn time_all_reduces(&mut self, tokens: usize, count: usize, replays: usize) -> Result<f64> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let tp = self
            .tp
            .as_ref()
            .ok_or_else(|| EngineError::TensorParallel("the model is not split".into()))?;
        self.device.bind()?;
        let elems = tokens.min(self.ws.sizes.tokens) * self.config.hidden_size;
        let stream = self.device.stream();
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        let recorded = (0..count).try_for_each(|_| {
            tp.collective
                .launch(|group| self.kernels.tp_all_reduce_add(&group, self.ws.x, elems))
        });
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        recorded?;
        let graph = graph?.expect("a capture that recorded launches yields a graph");
        let launch = || tp.collective.fenced(|| Ok(graph.launch()?));
        launch()?;
        self.device.synchronize()?;
        let started = std::time::Instant::now();
        (0..replays).try_for_each(|_| launch())?;
        self.device.synchronize()?;
        let each = started.elapsed().as_secs_f64() / (replays * count) as f64;
        match tp.collective.timeout(&self.device)? {
            Some(timeout) => Err(EngineError::TensorParallel(timeout)),
            None => Ok(each),
        }
    }

    /// Whether this backend's results are the step's: the whole model, or rank 0 of a split
    /// one (which gathers the logits). The other ranks only keep their part of the exchanges.
    fn leads(&self) -> bool {
        self.shard.rank == 0
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// What the backend holds on the device, as planned at start-up.
    pub fn memory_plan(&self) -> &MemoryPlan {
        &self.plan
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Waits until the snapshot tiers' memory is allocated: the host tier's is pinned in the
    /// background after start-up (tests that need it at once).
    pub fn wait_for_snapshot_arenas(&mut self) {
        self.backings.wait_until_allocated();
    }

    fn attn_shape(&self) -> AttnShape {
        attn_shape(&self.config, self.info.geometry.page_tokens)
    }

    /// Whether one-token steps of one row run folded layers ([`CudaOptions::folded_decode`]).
    pub fn folds(&self) -> bool {
        self.folded.is_some()
    }

    fn forward(&self) -> Forward<'_> {
        self.forward_with_gemv(self.gemv_max_tokens)
    }

    /// Whether a verification of `positions` rows computes each exactly as a step of that one
    /// token would: every projection a one-token step sends to the gemv goes there too (the
    /// tensor-core one, whose sums do not depend on the token count: see gemv_tc.cu), and
    /// attention splits each position as a lone row. Then greedy text is the same with
    /// speculation on and off.
    fn verify_invariant(&self, positions: usize) -> bool {
        self.exact_verify && self.gemv_max_tokens >= 1 && positions <= kernels::GEMV_MAX_TOKENS
    }

    /// Decode attention's splits and the gemv's token limit for a decode step of `rows` rows
    /// none of which reaches past `longest` positions; `invariant` (see
    /// [`CudaBackend::verify_invariant`]) splits each row as a lone one (the kernel divides a
    /// row's keys by the launch's splits, `decode_row` in decode_attention.cu, so each position
    /// merges the partial sums it would decoded alone) and sends every small projection to the
    /// gemv.
    fn decode_launch(&self, rows: usize, longest: usize, invariant: bool) -> (usize, usize) {
        if invariant {
            (self.decode_splits(1, usize::MAX), kernels::GEMV_MAX_TOKENS)
        } else {
            (self.decode_splits(rows, longest), self.gemv_max_tokens)
        }
    }

    /// Decode attention's splits for a launch of `rows` rows none of which reaches past
    /// `longest` positions ([`forward::decode_splits_within`]).
    /// Few rows short enough to fit the resident launch take it ([`forward::RESIDENT`]), unless
    /// verifications must be the bits of one-token steps (they split every row).
    fn decode_splits(&self, rows: usize, longest: usize) -> usize {
        if self.resident_decode
            && !self.exact_verify
            && forward::takes_resident(rows, longest, self.kernels.resident_positions())
        {
            return forward::RESIDENT;
        }
        forward::decode_splits_within(
            self.device.multiprocessors as usize,
            rows,
            self.attn_shape().decode_blocks_per_row(),
            self.decode_cluster(),
            longest,
        )
    }

    /// Blocks a decode attention cluster has on this device (1: none).
    fn decode_cluster(&self) -> usize {
        self.kernels.decode_cluster(&self.attn_shape())
    }

    /// The forward pass with steps of at most `gemv_max_tokens` tokens on the gemv.
    fn forward_with_gemv(&self, gemv_max_tokens: usize) -> Forward<'_> {
        Forward {
            config: &self.config,
            weights: &self.weights,
            kernels: &self.kernels,
            gemm: &self.gemm,
            ws: &self.ws,
            meta: self.meta.buffers(),
            pool: &self.pool,
            page_tokens: self.info.geometry.page_tokens,
            gemv_max_tokens,
            gemv_max_weight_bytes: self.gemv_max_weight_bytes,
            exact: self.tensor_core_gemv,
            folded: self.folded.as_ref(),
            tp: self.tp.as_ref().map(|tp| TpForward {
                collective: &tp.collective,
                logits_local: tp.logits_local.ptr(),
                local_vocab: tp.local_vocab,
            }),
        }
    }

    /// Runs a step's layers. Returns how it was packed and whether the logits of its packed rows
    /// are already projected (a replayed graph does that too, and with `picks` its sampling
    /// as well, into that slot of the picks buffer).
    fn execute(
        &mut self,
        plan: &StepPlan,
        select: LogitSelection,
        sample_params: &[u32],
        picks: Option<usize>,
    ) -> Result<(StepLayout, bool)> {
        let decode = plan.rows.iter().all(|r| r.tokens.len() == 1);
        let max_rows = self.ws.sizes.rows.min(self.ws.sizes.logit_rows);
        let bucket =
            graphs::bucket(plan.rows.len(), max_rows).filter(|_| decode && self.graphs.is_some());
        // A graph keeps the launches it was captured with, and runs its bucket's rows (padding
        // included): a replayed step launches as its bucket's size does.
        let small = bucket.unwrap_or(plan.total_tokens()) <= self.gemv_max_tokens;
        self.device
            .set_programmatic_launch(self.programmatic_launch && small);
        if let Some(bucket) = bucket {
            return self.replay_decode(plan, bucket, sample_params, false, picks);
        }
        let item_tokens = if decode {
            0
        } else {
            self.attn_shape().prefill_tile_tokens()
        };
        let layout = self.meta.load(
            &self.kernels,
            &PackRequest {
                plan,
                select,
                pad_rows_to: 0,
                item_tokens,
                decode_rows_apart: true,
                sample_params,
                picks_slot: 0,
            },
        )?;
        let shape = self.attn_shape();
        let multiprocessors = self.device.multiprocessors as usize;
        let mode = if decode {
            AttentionMode::Decode {
                rows: layout.rows,
                splits: self.decode_splits(layout.rows, longest_row(plan)),
                append_first: false,
            }
        } else {
            // The rows of one token go to decode attention (listed after the work items).
            let longest = plan
                .rows
                .iter()
                .filter(|r| r.tokens.len() > 1)
                .map(|r| r.end_pos())
                .max()
                .unwrap_or(0);
            AttentionMode::Prefill {
                items: layout.items,
                splits: forward::prefill_splits(
                    multiprocessors,
                    layout.items * shape.prefill_blocks_per_item(),
                    layout.tokens,
                    longest,
                    self.ws.sizes.split_pairs,
                ),
                decode_rows: layout.decode_items,
                decode_splits: forward::decode_splits(
                    multiprocessors,
                    layout.decode_items,
                    shape.decode_blocks_per_row(),
                    self.decode_cluster(),
                ),
            }
        };
        self.forward().run(layout.tokens, mode)?;
        Ok((layout, false))
    }

    /// A decode step through the graph of `bucket` rows: the unpacking of its metadata (copied
    /// before), layers and logits of every row, and with `picks` the sampling of every row
    /// into that slot of the picks buffer (a graph of its own). With `append_first`, a graph
    /// of its own stores every row's k and v before each layer's attention (rows that are one
    /// sequence's verified positions).
    fn replay_decode(
        &mut self,
        plan: &StepPlan,
        bucket: usize,
        sample_params: &[u32],
        append_first: bool,
        picks: Option<usize>,
    ) -> Result<(StepLayout, bool)> {
        // The graph samples its padding rows too: greedily.
        let mut padded = Vec::new();
        let sample_params = if picks.is_some() {
            padded.extend_from_slice(sample_params);
            padded.resize(bucket * kernels::SAMPLE_PARAM_WORDS, 0);
            &padded
        } else {
            sample_params
        };
        let layout = self.meta.stage(&PackRequest {
            plan,
            select: LogitSelection::LastOfEachRow,
            pad_rows_to: bucket,
            item_tokens: 0,
            decode_rows_apart: false,
            sample_params,
            picks_slot: picks.unwrap_or(0),
        })?;
        // A decode step of rows short enough to merge in clusters takes a cluster's splits, and
        // so a graph of its own; a verification keeps the splits of before.
        let longest = if append_first {
            usize::MAX
        } else {
            longest_row(plan)
        };
        let (splits, gemv_max_tokens) = self.decode_launch(
            bucket,
            longest,
            append_first && self.verify_invariant(bucket),
        );
        // Out of `self` while replaying, so that `forward()` can borrow the rest of it.
        let mut graphs = self.graphs.take().expect("only called with graphs on");
        let forward = self.forward_with_gemv(gemv_max_tokens);
        let key = graphs::key(bucket, append_first, splits, picks.is_some());
        let (meta, kernels, sampled) = (&self.meta, &self.kernels, self.picks_out());
        let mut replay = || {
            graphs.replay(&self.device, key, || {
                meta.unpack(kernels)?;
                forward.run(
                    bucket,
                    AttentionMode::Decode {
                        rows: bucket,
                        splits,
                        append_first,
                    },
                )?;
                forward.logits(0, bucket)?;
                if picks.is_some() {
                    kernels.sample_rows(
                        self.ws.logits,
                        self.config.vocab_size,
                        meta.buffers().sample_params,
                        sampled,
                        DPtr::NULL,
                        bucket,
                    )?;
                }
                Ok(())
            })
        };
        // A split model's graph launch is an exchange's too (see `collective::HostFence`).
        let replayed = match &self.tp {
            Some(tp) => tp.collective.fenced(replay),
            None => replay(),
        };
        self.graphs = Some(graphs);
        self.last_replay = Some(replayed?);
        Ok((layout, true))
    }

    /// A verification whose rows are each a token and its draft, run as a decode step of one
    /// row per position (every k and v stored first, so each position attends to those before
    /// it), through the decode graphs, every position picked on the device: each row's picks
    /// up to its first refusal. A sampled row draws a uniform for every position, then puts its
    /// random stream back after the picks it made, so it draws exactly what one token a step
    /// would. Only where [`CudaBackend::verify_route`] says the rows fit one decode step.
    fn verify_as_decode(
        &mut self,
        plan: &StepPlan,
        samplers: &mut [Option<&mut Sampler>],
        drafts: &[usize],
    ) -> Result<Vec<Vec<u32>>> {
        let rows: usize = plan.rows.iter().map(|row| row.tokens.len()).sum();
        let max_rows = self.ws.sizes.rows.min(self.ws.sizes.logit_rows);
        let positions = StepPlan {
            rows: plan
                .rows
                .iter()
                .flat_map(|row| {
                    row.tokens.iter().enumerate().map(|(k, &token)| RowPlan {
                        tokens: vec![token],
                        start_pos: row.start_pos + k,
                        pages: row.pages.clone(),
                        logits: crate::backend::LogitsWanted::Last,
                    })
                })
                .collect(),
        };
        // Each sampler's stream position after the uniform of each of its positions.
        let mut params = Vec::with_capacity(rows * kernels::SAMPLE_PARAM_WORDS);
        let mut drawn: Vec<Vec<u128>> = Vec::with_capacity(plan.rows.len());
        for (row, sampler) in plan.rows.iter().zip(samplers.iter_mut()) {
            let mut after = Vec::with_capacity(row.tokens.len());
            for _ in 0..row.tokens.len() {
                match sampler {
                    Some(sampler) => {
                        sample::push_params(sampler, &mut params);
                        after.push(sampler.draw_position());
                    }
                    None => sample::push_greedy(&mut params),
                }
            }
            drawn.push(after);
        }
        let invariant = self.verify_invariant(rows);
        let bucket = graphs::bucket(rows, max_rows).filter(|_| self.graphs.is_some());
        // As `execute`: a replayed graph launches as its bucket's size does.
        let small = bucket.unwrap_or(rows) <= self.gemv_max_tokens || invariant;
        self.device
            .set_programmatic_launch(self.programmatic_launch && small);
        self.last_replay = None;
        // A graph is captured the first time its bucket verifies; if that fails (another
        // thread's call into the driver can break a capture), the step runs eagerly and the
        // next one captures again.
        let replayed =
            bucket.map(|bucket| self.replay_decode(&positions, bucket, &params, true, None));
        if let Some(Err(e)) = &replayed {
            tracing::warn!("a verification graph could not run, so this step runs without: {e}");
        }
        if !matches!(replayed, Some(Ok(_))) {
            let layout = self.meta.load(
                &self.kernels,
                &PackRequest {
                    plan: &positions,
                    select: LogitSelection::LastOfEachRow,
                    pad_rows_to: 0,
                    item_tokens: 0,
                    decode_rows_apart: false,
                    sample_params: &params,
                    picks_slot: 0,
                },
            )?;
            let (splits, gemv_max_tokens) = self.decode_launch(layout.rows, usize::MAX, invariant);
            let forward = self.forward_with_gemv(gemv_max_tokens);
            forward.run(
                layout.tokens,
                AttentionMode::Decode {
                    rows: layout.rows,
                    splits,
                    append_first: true,
                },
            )?;
            forward.logits(0, rows)?;
        }
        let picked = self.pick_on_device(rows)?;
        let mut next = 0;
        let mut picks = Vec::with_capacity(plan.rows.len());
        for (((row, sampler), &drafted), after) in plan
            .rows
            .iter()
            .zip(samplers.iter_mut())
            .zip(drafts)
            .zip(&drawn)
        {
            let at = &picked[next..next + row.tokens.len()];
            next += row.tokens.len();
            picks.push(match sampler {
                Some(sampler) => {
                    let made = crate::backend::verify_row(row, drafted, |k| at[k]);
                    sampler.rewind_draws(after[made.len() - 1]);
                    made
                }
                None => Vec::new(),
            });
        }
        Ok(picks)
    }

    /// Picks from logit rows `0..rows` on the device, with the step's sample parameters (no
    /// grammar masks), and reads the picks.
    fn pick_on_device(&mut self, rows: usize) -> Result<Vec<u32>> {
        if !self.leads() {
            return Ok(vec![0; rows]);
        }
        self.sample_into(DPtr::NULL, rows)?;
        self.read_picks(0, rows)
    }

    /// Where the sampling kernel writes a step's picks: the slot its metadata names.
    fn picks_out(&self) -> kernels::Picks {
        let buffers = self.meta.buffers();
        kernels::Picks {
            host: self.picks.ptr(),
            fed: buffers.fed_tokens,
            slot: buffers.picks_slot,
            stride: self.picks_stride,
        }
    }

    /// Picks from logit rows `0..rows` with the step's sample parameters, among what `mask`
    /// allows ([`DPtr::NULL`]: everything), into the picks slot of a step not replayed with its
    /// sampling (slot 0), and records its event.
    fn sample_into(&mut self, mask: DPtr<u32>, rows: usize) -> Result<()> {
        self.kernels.sample_rows(
            self.ws.logits,
            self.config.vocab_size,
            self.meta.buffers().sample_params,
            self.picks_out(),
            mask,
            rows,
        )?;
        self.mark_picked(0)
    }

    /// Records that the picks of slot `slot` are queued.
    fn mark_picked(&mut self, slot: usize) -> Result<()> {
        Ok(self.picked[slot].record(self.device.stream())?)
    }

    /// Waits for the step that picked into slot `slot`, then reads its `rows` picks.
    fn read_picks(&mut self, slot: usize, rows: usize) -> Result<Vec<u32>> {
        self.picked[slot].synchronize()?;
        let at = slot * self.picks_stride;
        Ok(self.picks.as_mut_slice::<u32>()[at..at + rows].to_vec())
    }

    /// Waits for a step launched ahead that no one asked for, if one is in flight: the step
    /// asked for instead starts after it, and its buffers are free again.
    fn settle(&mut self) -> Result<()> {
        if self.ahead.take().is_some() {
            self.ahead_dropped += 1;
            self.device.synchronize()?;
        }
        Ok(())
    }

    /// Downloads logit rows `first..first + rows` (projecting them first unless `projected`).
    fn download_logits(
        &self,
        first: usize,
        rows: usize,
        projected: bool,
        out: &mut [f32],
    ) -> Result<()> {
        if !projected {
            self.forward().logits(first, rows)?;
        }
        if !self.leads() {
            return Ok(());
        }
        let vocab = self.config.vocab_size;
        self.device
            .download(self.ws.logits, &mut out[..rows * vocab])
    }

    fn step_logits(&mut self, plan: &StepPlan) -> Result<StepOutput> {
        let (layout, projected) = self.execute(plan, LogitSelection::Wanted, &[], None)?;
        let vocab = self.config.vocab_size;
        if !self.leads() {
            // The same projections (and exchanges) as rank 0's, whose results it keeps.
            if !projected {
                let chunk = self.ws.sizes.logit_rows;
                for first in (0..layout.logit_rows).step_by(chunk) {
                    let rows = chunk.min(layout.logit_rows - first);
                    self.forward().logits(first, rows)?;
                }
            }
            return Ok(StepOutput {
                vocab_size: vocab,
                ..StepOutput::default()
            });
        }
        let mut row_ranges = Vec::with_capacity(plan.rows.len());
        let mut next = 0;
        for row in &plan.rows {
            row_ranges.push(next..next + row.logit_rows());
            next += row.logit_rows();
        }
        let mut logits = vec![0f32; next * vocab];
        if projected {
            // A graph projected the last token of every row: keep the rows that asked.
            let mut all = vec![0f32; plan.rows.len() * vocab];
            self.download_logits(0, plan.rows.len(), true, &mut all)?;
            for (r, range) in row_ranges.iter().enumerate() {
                if !range.is_empty() {
                    logits[range.start * vocab..range.end * vocab]
                        .copy_from_slice(&all[r * vocab..(r + 1) * vocab]);
                }
            }
        } else {
            let chunk = self.ws.sizes.logit_rows;
            for first in (0..layout.logit_rows).step_by(chunk) {
                let rows = chunk.min(layout.logit_rows - first);
                self.download_logits(first, rows, false, &mut logits[first * vocab..])?;
            }
        }
        self.device.synchronize()?;
        Ok(StepOutput {
            vocab_size: vocab,
            logits,
            row_ranges,
        })
    }

    /// Gathers pool pages into a backing (`save`) or scatters it back.
    fn copy_pages(&mut self, backing: BackingId, copies: &[PageCopy], save: bool) -> Result<()> {
        self.device.bind()?;
        let pool = pool_pages(&self.pool, &self.info, &self.config);
        self.backings
            .copy_pages(&self.kernels, &pool, backing, copies, save)
    }
}

/// The working pool as snapshot and clone copies see it.
fn pool_pages<'a>(pool: &'a KvPool, info: &BackendInfo, config: &ModelConfig) -> PoolPages<'a> {
    PoolPages {
        pool,
        pages: info.num_pages,
        page_bytes: info.geometry.page_bytes(),
        layers: config.num_layers,
    }
}

/// The device snapshot arena for a tier of `budget` bytes: an eighth more, so that the sources
/// of demotions still copying to the host do not crowd out the saves that evicted them.
pub fn device_arena_bytes(budget: u64) -> u64 {
    budget + budget / 8
}

fn check_options(o: &CudaOptions) -> Result<()> {
    if o.page_tokens == 0 || o.max_step_tokens == 0 || o.max_rows == 0 {
        return Err(EngineError::InvalidStep(format!(
            "CUDA backend options must be positive: {o:?}"
        )));
    }
    Ok(())
}

/// The step capacity and workspace sizes `options` ask for.
/// Whether a model's small projections run on the tensor-core gemv (kernels/gemv_tc.cu): where
/// batch invariance is asked for (`exact_verify`), or where its rows are long enough to make it
/// the faster one ([`TENSOR_CORE_GEMV_MIN_HIDDEN`]) and all divide into its chunks; and whether
/// they all do. A projection whose rows do not divide goes to cuBLAS, whose sums depend on the
/// token count.
fn tensor_core_gemv(config: &ModelConfig, exact_verify: bool) -> (bool, bool) {
    let rows = [config.hidden_size, config.q_dim(), config.intermediate_size];
    let rows_divide = rows
        .iter()
        .all(|r| r.is_multiple_of(kernels::GEMV_TC_CHUNK));
    let faster = rows_divide && config.hidden_size >= TENSOR_CORE_GEMV_MIN_HIDDEN;
    (exact_verify || faster, rows_divide)
}

/// Whether FP8 weights can serve `config` on a device of compute capability `cc`: e4m3 needs
/// sm_89 or newer, and cuBLASLt's FP8 products rows whose bytes are a multiple of 16.
fn check_fp8(config: &ModelConfig, cc: (i32, i32)) -> Result<()> {
    if cc < (8, 9) {
        return Err(EngineError::Quantization(format!(
            "quantization = \"fp8\" needs a GPU of compute capability 8.9 or newer (Ada, \
             Hopper); this one is {}.{}",
            cc.0, cc.1
        )));
    }
    let rows = [
        ("hidden_size", config.hidden_size),
        ("the attention's q width", config.q_dim()),
        ("intermediate_size", config.intermediate_size),
    ];
    if let Some((name, n)) = rows.iter().find(|(_, n)| !n.is_multiple_of(16)) {
        return Err(EngineError::Quantization(format!(
            "quantization = \"fp8\" needs rows whose length is a multiple of 16; {name} is {n}"
        )));
    }
    Ok(())
}

fn step_sizes(
    config: &ModelConfig,
    options: &CudaOptions,
    multiprocessors: usize,
) -> (MetaCapacity, WorkspaceSizes) {
    let rows = options.max_rows.min(options.max_step_tokens);
    let capacity = MetaCapacity {
        tokens: options
            .max_step_tokens
            .max(graphs::bucket(rows, usize::MAX).unwrap_or(rows)),
        rows: graphs::bucket(rows, usize::MAX).unwrap_or(rows),
        table_stride: config.max_position_embeddings.div_ceil(options.page_tokens),
    };
    let sizes = WorkspaceSizes {
        tokens: capacity.tokens,
        rows: capacity.rows,
        // Logits of every row at once (sampling, decode graphs); longer requests are chunked.
        logit_rows: capacity.rows.max(256).min(capacity.tokens),
        split_pairs: forward::split_pairs(
            multiprocessors,
            capacity.rows,
            attn_shape(config, options.page_tokens).decode_blocks_per_row(),
        ),
        fp8: options.fp8_weights,
    };
    (capacity, sizes)
}

fn attn_shape(config: &ModelConfig, page_tokens: usize) -> AttnShape {
    AttnShape {
        heads: config.num_heads,
        kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
        page_tokens,
        window: config.sliding_window.unwrap_or(0),
    }
}

impl Backend for CudaBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn step(&mut self, plan: &StepPlan) -> Result<StepOutput> {
        self.device.bind()?;
        self.settle()?;
        self.last_sampled.clear();
        plan.validate(&self.info)?;
        if plan.rows.is_empty() {
            return Ok(StepOutput {
                vocab_size: self.config.vocab_size,
                ..StepOutput::default()
            });
        }
        self.step_logits(plan)
    }

    fn step_and_sample(
        &mut self,
        plan: &StepPlan,
        samplers: &mut [Option<&mut Sampler>],
    ) -> Result<Vec<Option<u32>>> {
        assert_eq!(plan.rows.len(), samplers.len(), "one sampler slot per row");
        self.last_step_kernels = None;
        self.device.bind()?;
        plan.validate(&self.info)?;
        if plan.rows.is_empty() {
            return Ok(Vec::new());
        }
        self.sample_step(plan, samplers)
    }

    /// Rows whose samplers the device serves are verified on the device, as a decode step of
    /// one row per position through the decode graphs where the rows are tokens and their
    /// drafts; only the picks come back, not every row's logits. Anything else picks on the
    /// host.
    fn step_and_verify(
        &mut self,
        plan: &StepPlan,
        samplers: &mut [Option<&mut Sampler>],
        drafts: &[usize],
    ) -> Result<Vec<Vec<u32>>> {
        crate::backend::check_verify(plan, samplers, drafts)?;
        self.last_step_kernels = None;
        self.device.bind()?;
        self.settle()?;
        self.last_sampled.clear();
        plan.validate(&self.info)?;
        match self.verify_route(plan, samplers, drafts) {
            VerifyRoute::Host => crate::backend::verify_on_host(self, plan, samplers, drafts),
            VerifyRoute::AsDecode => self.verify_as_decode(plan, samplers, drafts),
            VerifyRoute::Wanted => self.verify_wanted(plan, samplers, drafts),
        }
    }

    fn last_step_kernels(&self) -> Option<usize> {
        self.last_step_kernels
    }

    fn start_up_notes(&self) -> Vec<String> {
        let fp8 = self.weights.fp8().then(|| {
            format!(
                "projections in FP8 (e4m3, a scale a weight row and a token): weights {:.2} GiB",
                self.weights.bytes() as f64 / (1u64 << 30) as f64
            )
        });
        fp8.into_iter()
            .chain(self.gemm_tuning.iter().cloned())
            .collect()
    }

    fn last_step_captured(&self) -> bool {
        self.last_replay.is_some_and(|replay| replay.captured)
    }

    fn steps_run_ahead(&self) -> (u64, u64) {
        (self.ahead_kept, self.ahead_dropped)
    }

    fn alloc_backing(&mut self, backing: BackingId, tier: Tier, bytes: u64) -> Result<()> {
        self.device.bind()?;
        self.backings.alloc(backing, tier, bytes)
    }

    fn free_backing(&mut self, backing: BackingId) -> Result<()> {
        self.device.bind()?;
        self.backings.free(backing)
    }

    fn save_pages(&mut self, backing: BackingId, copies: &[PageCopy]) -> Result<()> {
        self.copy_pages(backing, copies, true)
    }

    fn restore_pages(&mut self, backing: BackingId, copies: &[PageCopy]) -> Result<()> {
        self.copy_pages(backing, copies, false)
    }

    fn clone_pages(&mut self, clones: &[PageClone]) -> Result<()> {
        self.device.bind()?;
        let pool = pool_pages(&self.pool, &self.info, &self.config);
        self.backings.clone_pages(&self.kernels, &pool, clones)
    }

    fn copy_backing(&mut self, from: BackingId, to: BackingId) -> Result<()> {
        self.device.bind()?;
        self.backings.start_copy(from, to)
    }

    fn finished_copies(&mut self, wait: bool) -> Vec<(BackingId, Result<()>)> {
        if let Err(e) = self.device.bind() {
            tracing::error!("binding the device to poll copies: {e}");
        }
        self.backings.finished_copies(wait)
    }

    fn backing_ids(&self) -> Vec<BackingId> {
        self.backings.ids()
    }

    fn restore_verdicts(&mut self) -> Result<Vec<bool>> {
        self.device.bind()?;
        self.backings.restore_verdicts()
    }

    fn backing_sums(&mut self, backing: BackingId) -> Result<Vec<u64>> {
        self.device.bind()?;
        self.backings.sums(backing)
    }

    fn set_backing_sums(&mut self, backing: BackingId, sums: &[u64]) -> Result<()> {
        self.device.bind()?;
        self.backings.set_sums(backing, sums)
    }

    fn host_runs(&mut self, backing: BackingId) -> Result<Vec<HostRun>> {
        self.backings.host_runs(backing)
    }

    fn read_backing(&mut self, backing: BackingId) -> Result<Vec<u8>> {
        self.device.bind()?;
        self.backings.read(backing)
    }

    fn flip_byte(&mut self, backing: BackingId, offset: u64, mask: u8) -> Result<()> {
        self.device.bind()?;
        self.backings.flip_byte(backing, offset, mask)
    }

    fn memory_plans(&self) -> Vec<String> {
        vec![self.plan.to_string()]
    }

    fn memory(&self) -> MemoryReport {
        MemoryReport {
            // The folded layers' copies are weights too.
            weights_bytes: self.weights.bytes()
                + self
                    .folded
                    .as_ref()
                    .map_or(0, |_| FoldedWeights::bytes(&self.config) as u64),
            pool_bytes: self.pool.bytes(),
            device_snapshot_bytes: self.backings.tier_bytes(Tier::Device),
            host_snapshot_bytes: self.backings.tier_bytes(Tier::Host),
            backings: self.backings.count(),
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Buffers are freed next: nothing queued may still use them.
        self.device.wait_idle();
    }
}

impl CudaBackend {
    /// Where a verification runs: every rank of a split model takes rank 0's route.
    pub fn verify_route(
        &self,
        plan: &StepPlan,
        samplers: &[Option<&mut Sampler>],
        drafts: &[usize],
    ) -> VerifyRoute {
        let logit_rows: usize = plan.rows.iter().map(RowPlan::logit_rows).sum();
        let on_device = samplers.iter().flatten().all(|s| s.samples_on_device());
        let greedy = samplers.iter().flatten().all(|s| s.greedy_on_device());
        let max_rows = self.ws.sizes.rows.min(self.ws.sizes.logit_rows);
        if plan.rows.is_empty() || !on_device || logit_rows > max_rows {
            return VerifyRoute::Host;
        }
        // Rows that are each a token and its draft, all fitting one decode step, no longer
        // than decode attention allows fresh keys.
        let shaped = plan.rows.iter().zip(drafts).all(|(row, &drafted)| {
            row.tokens.len() == drafted + 1 && row.tokens.len() <= kernels::DECODE_FRESH_KEYS
        });
        let rows: usize = plan.rows.iter().map(|row| row.tokens.len()).sum();
        if shaped && rows <= max_rows {
            VerifyRoute::AsDecode
        } else if greedy {
            VerifyRoute::Wanted
        } else {
            VerifyRoute::Host
        }
    }

    /// The first `rows` logit rows the last step left on the device (a verification's
    /// positions, in order). For tests that compare a verification with one-token steps.
    #[doc(hidden)]
    pub fn last_logits(&self, rows: usize) -> Result<Vec<f32>> {
        let mut out = vec![0f32; rows * self.config.vocab_size];
        self.device.synchronize()?;
        self.device.download(self.ws.logits, &mut out)?;
        Ok(out)
    }

    /// A rank other than 0 of a split model runs the passes of rank 0's verification.
    pub fn follow_verify(
        &mut self,
        plan: &StepPlan,
        drafts: &[usize],
        route: VerifyRoute,
    ) -> Result<()> {
        self.device.bind()?;
        plan.validate(&self.info)?;
        let mut none: Vec<Option<&mut Sampler>> = (0..plan.rows.len()).map(|_| None).collect();
        match route {
            VerifyRoute::Host => self.step(plan).map(drop),
            VerifyRoute::AsDecode => self.verify_as_decode(plan, &mut none, drafts).map(drop),
            VerifyRoute::Wanted => self.verify_wanted(plan, &mut none, drafts).map(drop),
        }
    }

    /// A greedy verification of rows of any shape: every wanted row's logits picked on the
    /// device.
    fn verify_wanted(
        &mut self,
        plan: &StepPlan,
        samplers: &mut [Option<&mut Sampler>],
        drafts: &[usize],
    ) -> Result<Vec<Vec<u32>>> {
        let logit_rows: usize = plan.rows.iter().map(RowPlan::logit_rows).sum();
        let mut params = Vec::with_capacity(logit_rows * kernels::SAMPLE_PARAM_WORDS);
        (0..logit_rows).for_each(|_| sample::push_greedy(&mut params));
        let (layout, projected) = self.execute(plan, LogitSelection::Wanted, &params, None)?;
        if projected {
            return Err(EngineError::InvalidStep(
                "a verification step ran as a decode graph".into(),
            ));
        }
        self.forward().logits(0, layout.logit_rows)?;
        let picked = self.pick_on_device(layout.logit_rows)?;
        let mut next = 0;
        let mut picks = Vec::with_capacity(plan.rows.len());
        for ((row, sampler), &drafted) in plan.rows.iter().zip(samplers.iter()).zip(drafts) {
            let rows = &picked[next..next + row.logit_rows()];
            next += row.logit_rows();
            picks.push(match sampler {
                Some(_) => {
                    crate::backend::verify_row(row, drafted, |k| rows[rows.len() - 1 - drafted + k])
                }
                None => Vec::new(),
            });
        }
        Ok(picks)
    }

    /// Queues the upload of the step's grammar bitmasks (every word set for rows without one)
    /// when any device-sampled row has a grammar; says which rows do.
    fn upload_masks(&mut self, samplers: &mut [Option<&mut Sampler>]) -> Result<Vec<bool>> {
        let words = self.config.vocab_size.div_ceil(32);
        let mut masked = vec![false; samplers.len()];
        let mut any = false;
        self.host_masks.clear();
        for (r, sampler) in samplers.iter_mut().enumerate() {
            let device_mask = sampler
                .as_mut()
                .filter(|s| !s.needs_host())
                .and_then(|s| s.device_mask());
            let start = self.host_masks.len();
            if let Some(mask) = device_mask {
                self.host_masks
                    .extend_from_slice(&mask[..mask.len().min(words)]);
                masked[r] = true;
                any = true;
            }
            self.host_masks.resize(start + words, u32::MAX);
        }
        if !any {
            return Ok(masked);
        }
        let bytes = self.host_masks.len() * 4;
        if self.masks.as_ref().is_none_or(|b| b.bytes() < bytes) {
            self.masks = Some(DeviceBuffer::alloc(&self.device, bytes, "grammar masks")?);
        }
        let buffer = self.masks.as_ref().expect("allocated above");
        self.device.upload(&self.host_masks, buffer.ptr())?;
        Ok(masked)
    }

    /// Notes where `plan`'s rows start, and whether it continues the last sampled step: the
    /// same rows (by their first page), each one position on.
    fn note_sampled(&mut self, plan: &StepPlan) {
        self.ahead_policy.step(continues(&self.last_sampled, plan));
        self.last_sampled.clear();
        self.last_sampled.extend(
            plan.rows
                .iter()
                .map(|row| (row.start_pos, row.pages.first().copied())),
        );
    }

    /// Whether the step after `plan` may be launched before its picks are read
    /// ([`CudaOptions::run_ahead`]): steady decoding, where the next step is most likely the
    /// same rows again ([`AheadPolicy`]), every row one token picked on the device with its
    /// next position's page held, and that step's graph captured.
    fn may_run_ahead(&mut self, plan: &StepPlan, samplers: &[Option<&mut Sampler>]) -> bool {
        let eligible = self.could_run_ahead(plan, samplers);
        self.ahead_policy.eligible = eligible;
        eligible && self.ahead_policy.may()
    }

    /// Whether the step after `plan` could be launched ahead, whatever the policy says.
    fn could_run_ahead(&self, plan: &StepPlan, samplers: &[Option<&mut Sampler>]) -> bool {
        let Some(graphs) = self.graphs.as_ref() else {
            return false;
        };
        if !self.run_ahead || self.tp.is_some() {
            return false;
        }
        let max_rows = self.ws.sizes.rows.min(self.ws.sizes.logit_rows);
        let Some(bucket) = graphs::bucket(plan.rows.len(), max_rows) else {
            return false;
        };
        let pt = self.info.geometry.page_tokens;
        let rows_go_on = plan.rows.iter().all(|row| {
            row.tokens.len() == 1
                && row.end_pos() < self.info.max_positions
                && row.pages.len() > row.end_pos() / pt
        });
        let on_device = samplers
            .iter()
            .all(|s| s.as_ref().is_some_and(|s| s.samples_on_device()));
        let (splits, _) = self.decode_launch(bucket, longest_row(plan) + 1, false);
        rows_go_on && on_device && graphs.has(graphs::key(bucket, false, splits, true))
    }

    /// Launches the step after `plan`, before `plan`'s picks are read: its rows one position
    /// on, each taking its token from `plan`'s pick on the device, picked into buffer `slot`.
    /// The samplers' uniforms for it are drawn and put back, so the step asked for next draws
    /// the same ones and [`Ahead::is`] can compare parameters.
    fn launch_ahead(
        &mut self,
        plan: &StepPlan,
        samplers: &mut [Option<&mut Sampler>],
        slot: usize,
    ) -> Result<()> {
        let next = StepPlan {
            rows: plan
                .rows
                .iter()
                .enumerate()
                .map(|(r, row)| RowPlan {
                    tokens: vec![kernels::FED_TOKEN + r as u32],
                    start_pos: row.start_pos + 1,
                    pages: row.pages.clone(),
                    logits: crate::backend::LogitsWanted::Last,
                })
                .collect(),
        };
        let mut params = Vec::with_capacity(samplers.len() * kernels::SAMPLE_PARAM_WORDS);
        for sampler in samplers.iter_mut().flatten() {
            let at = sampler.draw_position();
            sample::push_params(sampler, &mut params);
            sampler.rewind_draws(at);
        }
        self.last_replay = None;
        let (_, projected) =
            self.execute(&next, LogitSelection::LastOfEachRow, &params, Some(slot))?;
        assert!(projected, "a step run ahead replays a decode graph");
        let replay = self
            .last_replay
            .expect("a step run ahead replays a decode graph");
        self.mark_picked(slot)?;
        self.ahead = Some(Ahead {
            plan: next,
            params,
            follows: Vec::new(),
            slot,
            replay,
        });
        Ok(())
    }

    /// The step asked for is the one launched ahead: launches the one after it in turn where
    /// it may, then waits for this one's picks.
    fn finish_ahead(
        &mut self,
        plan: &StepPlan,
        samplers: &mut [Option<&mut Sampler>],
        ahead: Ahead,
    ) -> Result<Vec<Option<u32>>> {
        self.ahead_kept += 1;
        self.last_replay = Some(ahead.replay);
        self.last_step_kernels = Some(ahead.replay.kernels);
        let picked = self.run_ahead_then_read(plan, samplers, ahead.slot)?;
        Ok(picked.into_iter().map(Some).collect())
    }

    /// Launches the step after `plan` ahead where it may, then waits for `plan`'s picks (in
    /// slot `slot`) and gives them to that step as the tokens it runs on.
    fn run_ahead_then_read(
        &mut self,
        plan: &StepPlan,
        samplers: &mut [Option<&mut Sampler>],
        slot: usize,
    ) -> Result<Vec<u32>> {
        // What this step replayed, not the step launched ahead.
        let replay = self.last_replay;
        if self.may_run_ahead(plan, samplers) {
            self.launch_ahead(plan, samplers, 1 - slot)?;
        }
        self.last_replay = replay;
        let picked = self.read_picks(slot, plan.rows.len())?;
        if let Some(next) = &mut self.ahead {
            next.follows.clone_from(&picked);
        }
        Ok(picked)
    }

    /// A step whose decode graph sampled every row into picks slot 0: launches the next step
    /// ahead where it may, then waits for the picks.
    fn sampled_in_graph(
        &mut self,
        plan: &StepPlan,
        samplers: &mut [Option<&mut Sampler>],
    ) -> Result<Vec<Option<u32>>> {
        self.mark_picked(0)?;
        // The graph holds every kernel of the step (cuBLAS's too), unless it was captured now.
        self.last_step_kernels = self
            .last_replay
            .filter(|replay| !replay.captured)
            .map(|replay| replay.kernels);
        let picked = self.run_ahead_then_read(plan, samplers, 0)?;
        Ok(samplers
            .iter()
            .zip(picked)
            .map(|(s, token)| s.as_ref().map(|_| token))
            .collect())
    }

    /// One step whose rows' next tokens are picked on the device where their samplers allow,
    /// from the downloaded logits where they do not.
    fn sample_step(
        &mut self,
        plan: &StepPlan,
        samplers: &mut [Option<&mut Sampler>],
    ) -> Result<Vec<Option<u32>>> {
        let mut params = Vec::with_capacity(samplers.len() * kernels::SAMPLE_PARAM_WORDS);
        for (row, sampler) in plan.rows.iter().zip(samplers.iter_mut()) {
            if sampler.is_some() && row.logits == crate::backend::LogitsWanted::None {
                return Err(EngineError::InvalidStep(
                    "a row has a sampler but asks for no logits".into(),
                ));
            }
            match sampler {
                Some(s) if !s.needs_host() => sample::push_params(s, &mut params),
                _ => sample::push_greedy(&mut params),
            }
        }
        let rows = plan.rows.len();
        self.note_sampled(plan);
        let page_tokens = self.info.geometry.page_tokens;
        if let Some(ahead) = self.ahead.take_if(|a| a.is(plan, &params, page_tokens)) {
            return self.finish_ahead(plan, samplers, ahead);
        }
        self.settle()?;
        let launches = self.device.launches();
        self.last_replay = None;
        // Rows all picked on the device, none through a grammar's mask: a decode graph samples
        // them too.
        let in_graph = self.tp.is_none()
            && samplers
                .iter()
                .all(|s| s.as_ref().is_none_or(|s| s.samples_on_device()));
        let picks = in_graph.then_some(0);
        let (_, projected) = self.execute(plan, LogitSelection::LastOfEachRow, &params, picks)?;
        if projected && in_graph {
            return self.sampled_in_graph(plan, samplers);
        }
        self.ahead_policy.eligible = false;
        if !projected {
            self.forward().logits(0, rows)?;
        }
        if !self.leads() {
            return Ok(vec![None; rows]);
        }
        // The device computes the logits meanwhile: grammars work out their masks now, one
        // row per core.
        samplers
            .par_iter_mut()
            .flatten()
            .for_each(|sampler| sampler.prepare());
        let vocab = self.config.vocab_size;
        let host_rows = samplers
            .iter()
            .rposition(|s| s.as_ref().is_some_and(|s| s.needs_host()))
            .map_or(0, |last| last + 1);
        let mut host_picks = Vec::new();
        if host_rows > 0 {
            // One download for every row up to the last host row's logits, or one per host
            // row where they are few among many (a prompt's first pick keeping its logits in
            // a batch of decodes), then one row per core.
            self.host_logits.resize(host_rows * vocab, 0.0);
            let wanted: Vec<usize> = (0..host_rows)
                .filter(|&r| samplers[r].as_ref().is_some_and(|s| s.needs_host()))
                .collect();
            if wanted.len() * 4 < host_rows {
                for &r in &wanted {
                    self.device.download(
                        self.ws.logits.offset(r * vocab),
                        &mut self.host_logits[r * vocab..(r + 1) * vocab],
                    )?;
                }
            } else {
                self.device
                    .download(self.ws.logits, &mut self.host_logits[..host_rows * vocab])?;
            }
            host_picks = samplers[..host_rows]
                .par_iter_mut()
                .zip(self.host_logits.par_chunks_mut(vocab))
                .enumerate()
                .filter_map(|(r, (sampler, logits))| {
                    let sampler = sampler.as_mut().filter(|s| s.needs_host())?;
                    Some((r, sampler.sample(logits)))
                })
                .collect();
        }
        let masked = self.upload_masks(samplers)?;
        let mask = match (&self.masks, masked.iter().any(|&m| m)) {
            (Some(buffer), true) => buffer.ptr(),
            _ => DPtr::NULL,
        };
        self.sample_into(mask, rows)?;
        // cuBLAS's kernels are counted only inside a graph.
        self.last_step_kernels = self
            .last_replay
            .filter(|replay| !replay.captured)
            .map(|replay| replay.kernels + self.device.launches() - launches);
        let mut picked = self.read_picks(0, rows)?;
        host_picks.into_iter().for_each(|(r, t)| picked[r] = t);
        for ((sampler, &token), _) in samplers
            .iter_mut()
            .zip(&picked)
            .zip(&masked)
            .filter(|(_, m)| **m)
        {
            if let Some(sampler) = sampler {
                sampler.commit_device_pick(token);
            }
        }
        Ok(samplers
            .iter()
            .zip(picked)
            .map(|(s, token)| s.as_ref().map(|_| token))
            .collect())
    }
}

/// A decode step launched before the host asked for it ([`CudaOptions::run_ahead`]).
struct Ahead {
    /// The step as launched: each row's token is [`kernels::FED_TOKEN`] + its row, the pick of
    /// that row of the step before.
    plan: StepPlan,
    /// The rows' sampling parameters, uniforms included.
    params: Vec<u32>,
    /// The picks of the step before, once read: the tokens this step ran on.
    follows: Vec<u32>,
    /// Its picks slot and event.
    slot: usize,
    /// Its graph's replay, which holds every kernel of the step.
    replay: graphs::Replay,
}

impl Ahead {
    /// Whether `plan`, sampled with `params`, is this step: its rows' tokens are the picks it
    /// read, at the positions, pages and parameters it ran with.
    fn is(&self, plan: &StepPlan, params: &[u32], page_tokens: usize) -> bool {
        plan.rows.len() == self.plan.rows.len()
            && self.follows.len() == plan.rows.len()
            && params == self.params
            && plan
                .rows
                .iter()
                .zip(&self.plan.rows)
                .zip(&self.follows)
                .all(|((row, ran), &token)| {
                    let pages = row.end_pos().div_ceil(page_tokens);
                    row.tokens == [token]
                        && row.start_pos == ran.start_pos
                        && row.pages.get(..pages) == ran.pages.get(..pages)
                })
    }
}

/// When a step may be launched ahead. A step left unread costs the device a whole step, and
/// one kept saves only the host's gap between two (~2–5% of a small step, less of a large
/// one), so it pays only where nearly every step continues the one before. The policy keeps a
/// moving average of how often a step after which one could have been launched ahead was
/// followed by its continuation (every such step counts, launched ahead or not, so it
/// recovers where it stopped launching), and launches after a step that continued its
/// predecessor while that average is at least [`AheadPolicy::MIN_RATE`]: one sequence
/// decoding launches all but two or three steps of each request; rows that change every few
/// steps (sequences ending and joining at a high rate) launch none.
#[derive(Debug, Clone, Copy)]
struct AheadPolicy {
    /// Whether the last sampled step could have had its successor launched ahead.
    eligible: bool,
    /// Whether the last sampled step continued the one before it.
    continued: bool,
    /// Moving average of `continued` after eligible steps, over about the last
    /// 1 / [`AheadPolicy::WEIGHT`] of them.
    rate: f32,
}

impl Default for AheadPolicy {
    fn default() -> Self {
        AheadPolicy {
            eligible: false,
            continued: false,
            rate: 1.0,
        }
    }
}

impl AheadPolicy {
    const WEIGHT: f32 = 1.0 / 32.0;
    const MIN_RATE: f32 = 0.97;

    /// A sampled step, and whether it continued the one before.
    fn step(&mut self, continued: bool) {
        self.continued = continued;
        if self.eligible {
            self.rate += (continued as u8 as f32 - self.rate) * Self::WEIGHT;
        }
    }

    fn may(&self) -> bool {
        self.continued && self.rate >= Self::MIN_RATE
    }
}

/// Whether `plan` continues a step whose rows started at `last` (position and first page):
/// the same rows, each one position on.
fn continues(last: &[(usize, Option<PageId>)], plan: &StepPlan) -> bool {
    last.len() == plan.rows.len()
        && plan.rows.iter().zip(last).all(|(row, &(start, first))| {
            row.start_pos == start + 1 && row.pages.first().copied() == first
        })
}

/// The last position any row of `plan` reaches, plus one.
fn longest_row(plan: &StepPlan) -> usize {
    plan.rows.iter().map(|r| r.end_pos()).max().unwrap_or(0)
}
