//! One step's forward pass on the device, as launches on the backend's stream.
//!
//! Embedding, then per layer: the residual add of the previous sublayer fused with RMSNorm, the
//! fused q/k/v projection, rotary embedding fused with the KV append, attention, the output
//! projection, add + norm, the fused gate/up projection, SiLU × up and the down projection;
//! then the last add fused with the final norm, which packs the rows whose logits are wanted,
//! and the vocabulary projection in f32. The residual stream stays f32; everything else is bf16.
//!
//! A projection the gemv kernel serves does its neighbours' work too: the norm before it (for
//! rows of at most [`GEMV_NORM_MAX_IN`], when the stream is up to date), SiLU × up after the
//! gate/up projection, and the residual add after the output and down projections, which then
//! leave no delta for the next norm to add. At batch 1 a layer is five launches instead of
//! eight for SmolLM2, seven for Llama-3.1-8B.
//!
//! With FP8 weights the projections the gemv serves run on its FP8 entries (e4m3 weights, bf16
//! inputs: the same fusions), and the others on cuBLASLt's FP8 product, their input quantized
//! per token (kernels/fp8.cu): by the norm before them and by SiLU × up, which write FP8 rows
//! directly, and by a pass of its own for the output projection's input; the vocabulary
//! projection stays bf16. There is no
//! tensor-core FP8 gemv, so `exact` does not apply to FP8 weights.
//!
//! The pass reads its metadata from fixed device buffers and takes only sizes as arguments, so
//! a decode pass can be captured once per batch size and replayed. It allocates nothing.

use std::sync::Arc;

use half::bf16;

use super::collective::Collective;
use super::device::{DPtr, Device, DeviceBuffer};
use super::fold::FoldedWeights;
use super::gemm::{Gemm, Linear};
use super::kernels::{
    AddRmsNorm, Attention, AttnShape, CLUSTER_ROW_POSITIONS, DecodeAttention, Embed, FOLD_ROWS,
    FoldLaunch, FoldPhase, FoldedQkv, Fp8Rows, GEMV_MAX_TOKENS, GEMV_NORM_MAX_IN, GEMV_TC_CHUNK,
    GemvInput, GemvOutput, Kernels, MetaBuffers, RopeKv, SILU_E4M3_MAX_FFN, Splits,
};
use super::pool::KvPool;
use super::weights::{GpuWeights, Matrix};
use crate::error::Result;
use crate::model::ModelConfig;

/// Decode attention splits each row's positions over at most this many blocks (`MAX_SPLITS` in
/// `kernels/decode_attention.cu`).
pub const MAX_SPLITS: usize = 128;

/// `AttentionMode::Decode::splits` of a resident launch: no split, one block a row and head
/// group holding every position of the row in shared memory
/// ([`Kernels::decode_attention_resident`]).
pub const RESIDENT: usize = 0;

/// Decode steps of at most this many rows take it: one row as long as the launch holds
/// ([`Kernels::resident_positions`]), several none longer than [`RESIDENT_MAX_POSITIONS`].
pub const RESIDENT_MAX_ROWS: usize = 4;

/// Past this many positions a step of several rows, their tiles one after another in one block
/// each, takes longer than the split launch's clusters; a lone row gains up to the launch's
/// capacity. H100, SmolLM2's shape (768 positions a block), eight-warp blocks, tok/s at the 64
/// positions after each, split → resident, medians of three runs (BENCHMARKS: "Eight warps"):
///
/// | positions | batch 1 | batch 2 | batch 4 |
/// |---|---|---|---|
/// | 128 | 1,877 → 2,288 | 2,287 → 2,398 | 4,597 → 4,856 |
/// | 512 | 1,829 → 2,052 | 2,283 → 2,295 | 4,542 → 4,576 |
/// | 576 | 1,832 → 2,021 | 2,282 → 2,280 | 4,547 → 4,524 |
/// | 640 | 1,831 → 1,968 | 2,281 → 2,246 | 4,554 → 4,461 |
/// | 700 | 1,827 → 1,939 | 2,281 → 2,233 | 4,543 → 4,432 |
pub const RESIDENT_MAX_POSITIONS: usize = 576;

/// Whether a decode launch of `rows` rows none past `longest` positions takes the resident
/// launch, which holds rows of up to `capacity` positions.
pub fn takes_resident(rows: usize, longest: usize, capacity: usize) -> bool {
    rows <= RESIDENT_MAX_ROWS
        && longest <= capacity
        && (rows == 1 || longest <= RESIDENT_MAX_POSITIONS)
}

/// Steps of at least this many tokens run their bf16 projections the gemv serves on the
/// tensor-core gemv (rows a multiple of [`GEMV_TC_CHUNK`] long), whatever the model: the
/// CUDA-core gemv's time grows with the tokens where the tensor cores' does not. H100,
/// SmolLM2's shape, tok/s at a context of 128, CUDA-core → tensor-core gemv (BENCHMARKS: "The
/// gemv for steps of two to eight tokens"): batch 2 3,629 → 4,040, batch 4 5,206 → 7,433,
/// batch 8 5,807 → 12,202 (cuBLAS 8,939). A one-token step of a small model keeps the
/// CUDA-core gemv, faster there ([`super::TENSOR_CORE_GEMV_MIN_HIDDEN`]).
pub const TENSOR_CORE_GEMV_MIN_TOKENS: usize = 2;

/// Whether a bf16 projection of `shape` the gemv serves runs on the tensor-core one: always
/// where `exact` (its rows then divide: [`Forward::gemv_serves`]), else for steps of several
/// tokens whose rows divide into its chunks.
pub fn takes_tensor_core_gemv(exact: bool, shape: Linear) -> bool {
    exact
        || (shape.tokens >= TENSOR_CORE_GEMV_MIN_TOKENS
            && shape.in_features.is_multiple_of(GEMV_TC_CHUNK))
}

/// FP8 weights have no tensor-core gemv: steps of more tokens than this take cuBLASLt's FP8
/// product rather than the CUDA-core FP8 gemv (the backend caps `gemv_max_tokens` with it).
/// H100, the 8B shape at a context of 512, tok/s with the gemv up to 1 / 4 / 8 tokens
/// (BENCHMARKS: "The gemv for steps of two to eight tokens"): batch 2 402 / 460 / 459, batch 4
/// 809 / 689 / 683, batch 8 1,586 / 1,584 / 894.
pub const FP8_GEMV_MAX_TOKENS: usize = 2;

/// Prefill attention aims for this many blocks per multiprocessor where splitting an item's keys
/// over blocks can make them: too few blocks leave the loads of a long context waiting on
/// latency (8B, 32 new tokens after 32,000 restored: 68.5 ms to first token unsplit, 15 ms).
const BLOCKS_PER_MULTIPROCESSOR: usize = 8;

/// Decode attention aims for one wave: its blocks (69.6 KB of tiles each for a head of 128)
/// fit two to a multiprocessor. Measured on the H200, 8B shape, ms a step at 2 / 4 / 8 a
/// multiprocessor: batch 1 × 32,000 positions 5.93 / 6.72 / 6.84, batch 32 × 8,192 14.85 /
/// 15.01 / 15.35, batch 32 × 512 5.82 / 6.01 / 6.04.
const DECODE_BLOCKS_PER_MULTIPROCESSOR: usize = 2;

/// Prefill attention splits an item's keys over at most this many blocks, each at least
/// `PREFILL_MIN_SPLIT_KEYS` (256) long.
pub const PREFILL_MAX_SPLITS: usize = 64;
const PREFILL_MIN_SPLIT_KEYS: usize = 256;

/// Token × split pairs the split workspaces hold at least, for prefill: 32 new tokens over a
/// long context split 32 ways.
const PREFILL_SPLIT_PAIRS: usize = 1024;

/// The largest weight [`Forward`] multiplies with the gemv kernel. On an H200 (BENCHMARKS.md)
/// the gemv, whose blocks split each row's reduction over their warps, is faster than cuBLAS
/// at batch 1 for every weight of SmolLM2 and of Llama-3.1-8B (224 MiB for its gate/up
/// projection, which it also activates): 8B batch-1 decode 216.3 / 216.9 tok/s with the cut at
/// 64 MiB, 229.2 / 228.4 with every projection through the gemv.
pub const GEMV_MAX_WEIGHT_BYTES: usize = 256 << 20;

/// The sizes the workspaces are allocated for.
#[derive(Debug, Clone, Copy)]
pub struct WorkspaceSizes {
    pub tokens: usize,
    pub rows: usize,
    pub logit_rows: usize,
    /// (row or token) × split pairs the attention split buffers hold, each for every head.
    pub split_pairs: usize,
    /// Room for a projection's input quantized to e4m3 and its tokens' scales (FP8 weights).
    pub fp8: bool,
}

impl WorkspaceSizes {
    /// Bytes of each buffer, in [`Workspace`]'s order.
    fn parts(&self, c: &ModelConfig) -> [usize; 15] {
        let (t, h) = (self.tokens, c.hidden_size);
        let qkv = c.q_dim() + 2 * c.kv_dim();
        let split_rows = self.split_pairs * c.num_heads;
        let widest_in = h.max(c.q_dim()).max(c.intermediate_size);
        let fp8 = self.fp8 as usize;
        [
            t * h * 4,
            t * h * 2,
            t * qkv.max(2 * c.intermediate_size) * 2,
            t * c.q_dim().max(c.intermediate_size) * 2,
            t * h * 2,
            self.logit_rows * c.vocab_size * 4,
            split_rows * c.head_dim * 4,
            split_rows * 4,
            self.rows * c.num_heads * 4,
            fp8 * t * widest_in,
            fp8 * t * 4,
            // A folded one-token step's (fold.rs): two more streams, the raw gate/up and
            // q/k/v, and two sets of a stream's partial sums of squares.
            2 * h * 4,
            (2 * c.intermediate_size + qkv) * 4,
            qkv * 4,
            2 * h.div_ceil(FOLD_ROWS) * 4,
        ]
    }

    pub fn bytes(&self, c: &ModelConfig) -> usize {
        self.parts(c).iter().map(|b| b.next_multiple_of(256)).sum()
    }
}

/// The step's activations. Buffers whose users run one after the other share memory: `wide`
/// holds q/k/v and later gate/up, `narrow` the attention output and later the activation.
pub struct Workspace {
    _memory: DeviceBuffer,
    /// `[tokens, hidden]` f32 residual stream.
    pub x: DPtr<f32>,
    /// `[tokens, hidden]` normalized rows (packed logit rows after the final norm).
    pub normed: DPtr<bf16>,
    pub wide: DPtr<bf16>,
    pub narrow: DPtr<bf16>,
    /// `[tokens, hidden]` a sublayer's output before its residual add.
    pub proj: DPtr<bf16>,
    /// `[logit_rows, vocab]`.
    pub logits: DPtr<f32>,
    pub o_part: DPtr<f32>,
    pub lse_part: DPtr<f32>,
    /// Decode attention's counters of finished splits, zero between launches.
    pub done: DPtr<u32>,
    /// `[tokens, in]` a projection's input in e4m3, and `[tokens]` its scales (FP8 weights).
    pub x8: DPtr<u8>,
    pub x8_scales: DPtr<f32>,
    /// A folded one-token step's buffers (see [`FoldBuffers`]).
    pub fold: FoldBuffers,
    pub sizes: WorkspaceSizes,
}

/// What a folded one-token step (fold.rs) keeps between its launches besides `x` and the
/// attention output.
#[derive(Debug, Clone, Copy)]
pub struct FoldBuffers {
    /// The stream rotates over `x` and these (`[hidden]` f32 each): a q/k/v and down launch
    /// reads two of its versions while it writes the third.
    pub streams: [DPtr<f32>; 2],
    /// `[2·ffn + q/k/v width]` f32: the raw gate/up, then the next layer's q/k/v's first part.
    pub gate_up: DPtr<f32>,
    /// `[q/k/v width]` f32 raw q/k/v.
    pub qkv: DPtr<f32>,
    /// Partial sums of squares of the stream after the output projection, then after the down
    /// projection (`hidden / FOLD_ROWS` each).
    pub parts: [DPtr<f32>; 2],
}

impl Workspace {
    pub fn new(device: &Arc<Device>, config: &ModelConfig, sizes: WorkspaceSizes) -> Result<Self> {
        let memory = DeviceBuffer::alloc(device, sizes.bytes(config), "the step workspaces")?;
        let mut next = memory.ptr::<u8>();
        let mut parts = sizes.parts(config).into_iter().map(|bytes| {
            let at = next;
            next = next.offset(bytes.next_multiple_of(256));
            at
        });
        let mut take = || parts.next().expect("one part per buffer");
        let workspace = Workspace {
            x: take().cast(),
            normed: take().cast(),
            wide: take().cast(),
            narrow: take().cast(),
            proj: take().cast(),
            logits: take().cast(),
            o_part: take().cast(),
            lse_part: take().cast(),
            done: take().cast(),
            x8: take(),
            x8_scales: take().cast(),
            fold: {
                let streams = take().cast::<f32>();
                let (gate_up, qkv, parts) = (take().cast(), take().cast(), take().cast::<f32>());
                let part = config.hidden_size.div_ceil(FOLD_ROWS);
                FoldBuffers {
                    streams: [streams, streams.offset(config.hidden_size)],
                    gate_up,
                    qkv,
                    parts: [parts, parts.offset(part)],
                }
            },
            _memory: memory,
            sizes,
        };
        let counters = sizes.rows * config.num_heads;
        device.upload(&vec![0u32; counters], workspace.done)?;
        Ok(workspace)
    }
}

/// How a pass runs attention.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttentionMode {
    /// Every row holds one token; `splits` may be [`RESIDENT`]. With `append_first`, every
    /// token's k and v are stored in one launch before attention, so a row may attend to the
    /// positions of rows before it in the same step: a verification run as one row per position.
    Decode {
        rows: usize,
        splits: usize,
        append_first: bool,
    },
    /// Rows of any length, in work items, their keys split over `splits` blocks each; then
    /// `decode_rows` rows of one token (listed after the items: see
    /// [`super::step_meta::StepLayout::decode_items`]) through decode attention, split
    /// `decode_splits` ways. A decode row among the work items would be a block of
    /// `PREFILL_ROWS` query rows with a group's worth used, each warp reading its whole context.
    Prefill {
        items: usize,
        splits: usize,
        decode_rows: usize,
        decode_splits: usize,
    },
}

/// The parts of the backend a pass uses.
pub struct Forward<'a> {
    pub config: &'a ModelConfig,
    pub weights: &'a GpuWeights,
    pub kernels: &'a Kernels,
    pub gemm: &'a Gemm,
    pub ws: &'a Workspace,
    pub meta: &'a MetaBuffers,
    pub pool: &'a KvPool,
    pub page_tokens: usize,
    /// Steps of at most this many tokens use [`Kernels::gemv`] for their small projections.
    pub gemv_max_tokens: usize,
    /// ... and only for weights of at most this many bytes.
    pub gemv_max_weight_bytes: usize,
    /// Those projections run on the tensor-core gemv, whose sums do not depend on the token
    /// count (see [`super::CudaOptions::exact_verify`] and
    /// [`super::TENSOR_CORE_GEMV_MIN_HIDDEN`]).
    pub exact: bool,
    /// This rank's exchanges, where the model is split over several.
    pub tp: Option<TpForward<'a>>,
    /// One-token steps of one row run folded layers (fold.rs) on these.
    pub folded: Option<&'a FoldedWeights>,
}

/// What a tensor-parallel rank's pass adds: an all-reduce of each sublayer's output into the
/// residual stream, its slice of the logits gathered on rank 0.
#[derive(Clone, Copy)]
pub struct TpForward<'a> {
    pub collective: &'a Collective,
    /// `[logit rows, local_vocab]`, registered with the group.
    pub logits_local: DPtr<f32>,
    pub local_vocab: usize,
}

impl Forward<'_> {
    /// Runs the layers over `tokens` tokens and leaves the wanted rows, normalized, packed at the
    /// start of `normed`.
    pub fn run(&self, tokens: usize, mode: AttentionMode) -> Result<()> {
        if let (
            Some(folded),
            AttentionMode::Decode {
                rows: 1,
                append_first: false,
                ..
            },
        ) = (self.folded, mode)
            && tokens == 1
            && self.tp.is_none()
        {
            return self.run_folded(folded, mode);
        }
        let h = self.config.hidden_size;
        // A split model's ranks each hold a slice of the vocabulary: each gathers the rows it
        // holds (zeros for the others), and the all-reduce puts every token's row together.
        let split = self.tp.map(|_| (self.ws.proj, self.weights.embed_rows()));
        self.kernels.embed(&Embed {
            table: self.weights.embed(),
            token_ids: self.meta.token_ids,
            residual: self.ws.x,
            tokens,
            hidden: h,
            split,
        })?;
        if let Some(tp) = &self.tp {
            tp.collective.launch(|group| {
                self.kernels
                    .tp_all_reduce_add(&group, self.ws.x, tokens * h)
            })?;
        }
        let mut stream = Stream::Current;
        for layer in 0..self.config.num_layers {
            stream = self.attention_block(layer, tokens, mode, stream)?;
            stream = self.mlp_block(layer, tokens, stream)?;
        }
        self.norm(
            tokens,
            stream,
            self.weights.norm(),
            self.meta.logit_rows,
            None,
        )
    }

    /// [`Forward::run`] for one token in folded layers (kernels/gemv_fold.cu): layer 0's q/k/v
    /// as unfolded, then attention and two launches a layer.
    fn run_folded(&self, folded: &FoldedWeights, mode: AttentionMode) -> Result<()> {
        let c = self.config;
        let (h, q, f) = (c.hidden_size, c.q_dim(), c.intermediate_size);
        let qkv_width = self.shape().qkv_width();
        let fold = &self.ws.fold;
        self.kernels.embed(&Embed {
            table: self.weights.embed(),
            token_ids: self.meta.token_ids,
            residual: self.ws.x,
            tokens: 1,
            hidden: h,
            split: None,
        })?;
        let first = self.weights.layer(0);
        let qkv = Linear {
            tokens: 1,
            in_features: h,
            out_features: qkv_width,
        };
        let input = self.normed_input(Stream::Current, first.attn_norm, first.wqkv, qkv)?;
        self.project(input, first.wqkv, self.ws.wide, qkv)?;
        self.attend(0, 1, mode, None)?;
        let streams = [self.ws.x, fold.streams[0], fold.streams[1]];
        let mut at = 0;
        for layer in 0..c.num_layers {
            let (w, fw) = (self.weights.layer(layer), folded.layer(layer));
            let (stream, after_out, after_down) = (
                streams[at % 3],
                streams[(at + 1) % 3],
                streams[(at + 2) % 3],
            );
            // The last layer's launches are its gate/up, output and down projections alone.
            let next = layer + 1 < c.num_layers;
            let next_rows = if next { qkv_width } else { 0 };
            let launch = FoldLaunch {
                phase: FoldPhase::GateUpOut,
                h: stream,
                a: self.ws.narrow,
                gu: DPtr::NULL,
                gu_parts: DPtr::NULL,
                partial: DPtr::NULL,
                before: stream,
                wa: fw.gate_up_qkv,
                rows_a: 2 * f + next_rows,
                raw: fold.gate_up,
                wb: w.wo.bf16(),
                after: after_out,
                parts: fold.parts[0],
                hidden: h,
                q_dim: q,
                ffn: f,
                eps: c.rms_norm_eps,
            };
            self.kernels.gemv_fold(&launch)?;
            self.kernels.gemv_fold(&FoldLaunch {
                phase: FoldPhase::QkvDown,
                gu: fold.gate_up,
                gu_parts: fold.parts[0],
                partial: fold.gate_up.offset(2 * f),
                before: after_out,
                wa: fw.qkv_down,
                rows_a: next_rows,
                raw: fold.qkv,
                wb: w.w_down.bf16(),
                after: after_down,
                parts: fold.parts[1],
                ..launch
            })?;
            at += 2;
            if next {
                let raw = FoldedQkv {
                    raw: fold.qkv,
                    parts: fold.parts[1],
                    hidden: h,
                    eps: c.rms_norm_eps,
                };
                self.attend(layer + 1, 1, mode, Some(raw))?;
            }
        }
        self.kernels.add_rms_norm(&AddRmsNorm {
            residual: streams[at % 3],
            delta: DPtr::NULL,
            weight: self.weights.norm(),
            out: self.ws.normed,
            out_rows: self.meta.logit_rows,
            e4m3: None,
            tokens: 1,
            hidden: h,
            eps: c.rms_norm_eps,
        })
    }

    /// Projects packed rows `first..first + rows` of `normed` into `logits` rows `0..rows`.
    pub fn logits(&self, first: usize, rows: usize) -> Result<()> {
        let h = self.config.hidden_size;
        if let Some(tp) = &self.tp {
            self.gemm.linear_f32(
                self.ws.normed.offset(first * h),
                self.weights.lm_head(),
                tp.logits_local,
                Linear {
                    tokens: rows,
                    in_features: h,
                    out_features: tp.local_vocab,
                },
            )?;
            return tp.collective.launch(|group| {
                self.kernels
                    .tp_gather_logits(&group, self.ws.logits, rows, tp.local_vocab)
            });
        }
        let shape = Linear {
            tokens: rows,
            in_features: h,
            out_features: self.config.vocab_size,
        };
        let x = self.ws.normed.offset(first * h);
        // One row's logits through the CUDA-core gemv where it serves (a small model's
        // vocabulary: SmolLM2's 56 MB), whose weight loads leave L2 first; cuBLAS's tiles read
        // them at the normal priority, sweeping out what the next step reads again. Not when
        // `exact`: a verification's rows take cuBLAS, and one-token steps must give their bits.
        if rows == 1 && !self.exact && self.gemv_serves(shape) {
            let out = GemvOutput::F32(self.ws.logits);
            return self
                .kernels
                .gemv(GemvInput::Rows(x), self.weights.lm_head(), out, shape);
        }
        self.gemm
            .linear_f32(x, self.weights.lm_head(), self.ws.logits, shape)
    }

    /// Adds a pending delta to the residual stream and writes its RMSNorm into `normed`.
    fn norm(
        &self,
        tokens: usize,
        stream: Stream,
        weight: DPtr<bf16>,
        out_rows: DPtr<u32>,
        e4m3: Option<Fp8Rows>,
    ) -> Result<()> {
        let delta = match stream {
            Stream::Current => DPtr::NULL,
            Stream::Delta => self.ws.proj,
        };
        self.kernels.add_rms_norm(&AddRmsNorm {
            residual: self.ws.x,
            delta,
            weight,
            out: self.ws.normed,
            out_rows,
            e4m3,
            tokens,
            hidden: self.config.hidden_size,
            eps: self.config.rms_norm_eps,
        })
    }

    /// Whether a projection of `shape` runs on our gemv (few tokens, a small weight; for the
    /// tensor-core one, rows a multiple of [`GEMV_TC_CHUNK`] long), where cuBLAS's fixed costs
    /// dominate; cuBLAS otherwise.
    fn gemv_serves(&self, shape: Linear) -> bool {
        let weight_bytes = shape.in_features * shape.out_features * 2;
        shape.tokens <= self.gemv_max_tokens
            && weight_bytes <= self.gemv_max_weight_bytes
            && (!self.exact
                || self.weights.fp8()
                || shape.in_features.is_multiple_of(GEMV_TC_CHUNK))
    }

    /// The gemv this pass uses: the FP8 one for FP8 weights, else the tensor-core one when
    /// `exact` or for steps of several tokens whose rows divide into its chunks
    /// ([`TENSOR_CORE_GEMV_MIN_TOKENS`]), else the CUDA-core one.
    fn gemv(&self, input: GemvInput, w: Matrix, output: GemvOutput, shape: Linear) -> Result<()> {
        match w {
            Matrix::Fp8 { w, scales } => self.kernels.gemv_fp8(input, w, scales, output, shape),
            Matrix::Bf16(w) if takes_tensor_core_gemv(self.exact, shape) => {
                self.kernels.gemv_tc(input, w, output, shape)
            }
            Matrix::Bf16(w) => self.kernels.gemv(input, w, output, shape),
        }
    }

    /// The input of a projection of `shape` by `w` after an RMSNorm with `weight`: fused into
    /// the gemv where it serves, the rows are short and the stream is up to date; else written
    /// to `normed` first, or, for an FP8 product, to `x8` in FP8.
    fn normed_input(
        &self,
        stream: Stream,
        weight: DPtr<bf16>,
        w: Matrix,
        shape: Linear,
    ) -> Result<Input> {
        let served = self.gemv_serves(shape);
        if stream == Stream::Current && served && shape.in_features <= GEMV_NORM_MAX_IN {
            return Ok(Input::Bf16(GemvInput::Normed {
                residual: self.ws.x,
                weight,
                eps: self.config.rms_norm_eps,
            }));
        }
        if !served && matches!(w, Matrix::Fp8 { .. }) {
            self.norm(shape.tokens, stream, weight, DPtr::NULL, Some(self.x8()))?;
            return Ok(Input::Fp8);
        }
        self.norm(shape.tokens, stream, weight, DPtr::NULL, None)?;
        Ok(Input::Bf16(GemvInput::Rows(self.ws.normed)))
    }

    /// The FP8 rows workspace.
    fn x8(&self) -> Fp8Rows {
        Fp8Rows {
            values: self.ws.x8,
            scales: self.ws.x8_scales,
        }
    }

    /// `y = x · wᵀ` into bf16 rows.
    fn project(&self, x: Input, w: Matrix, y: DPtr<bf16>, shape: Linear) -> Result<()> {
        match x {
            Input::Bf16(GemvInput::Rows(_)) | Input::Fp8 if !self.gemv_serves(shape) => {
                self.linear(x, w, y, shape)
            }
            x => self.gemv(x.bf16(), w, GemvOutput::Rows(y), shape),
        }
    }

    /// `y = x · wᵀ` through cuBLAS: bf16, or FP8 with bf16 rows quantized per token first.
    fn linear(&self, x: Input, w: Matrix, y: DPtr<bf16>, shape: Linear) -> Result<()> {
        match (x, w) {
            (Input::Bf16(GemvInput::Rows(x)), Matrix::Bf16(w)) => self.gemm.linear(x, w, y, shape),
            (Input::Bf16(GemvInput::Rows(x)), w @ Matrix::Fp8 { .. }) => {
                self.kernels
                    .quantize_rows_e4m3(x, self.x8(), shape.tokens, shape.in_features)?;
                self.linear(Input::Fp8, w, y, shape)
            }
            (Input::Fp8, Matrix::Fp8 { w, scales }) => {
                let x8 = self.x8();
                self.gemm
                    .linear_fp8(x8.values, x8.scales, w, scales, y, shape)
            }
            (x, w) => unreachable!("no product of {x:?} by {w:?}"),
        }
    }

    /// A sublayer's output projection: added to the residual stream by the gemv where it
    /// serves, else left in `proj` for the next norm to add.
    /// On a rank of a split model the projection is a partial sum over this rank's heads or
    /// columns: it goes to `proj`, and the all-reduce adds every rank's into the stream.
    fn project_out(&self, x: Input, w: Matrix, shape: Linear) -> Result<Stream> {
        if let Some(tp) = &self.tp {
            if self.gemv_serves(shape) {
                let out = GemvOutput::Rows(self.ws.proj);
                self.gemv(x.bf16(), w, out, shape)?;
            } else {
                self.linear(x, w, self.ws.proj, shape)?;
            }
            let elems = shape.tokens * shape.out_features;
            tp.collective
                .launch(|group| self.kernels.tp_all_reduce_add(&group, self.ws.x, elems))?;
            return Ok(Stream::Current);
        }
        if self.gemv_serves(shape) {
            let out = GemvOutput::Accumulate(self.ws.x);
            self.gemv(x.bf16(), w, out, shape)?;
            return Ok(Stream::Current);
        }
        self.linear(x, w, self.ws.proj, shape)?;
        Ok(Stream::Delta)
    }

    fn shape(&self) -> AttnShape {
        AttnShape {
            heads: self.config.num_heads,
            kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            page_tokens: self.page_tokens,
            window: self.config.sliding_window.unwrap_or(0),
        }
    }

    fn attention_block(
        &self,
        layer: usize,
        tokens: usize,
        mode: AttentionMode,
        stream: Stream,
    ) -> Result<Stream> {
        let (c, w) = (self.config, self.weights.layer(layer));
        let shape = self.shape();
        let qkv = Linear {
            tokens,
            in_features: c.hidden_size,
            out_features: shape.qkv_width(),
        };
        let input = self.normed_input(stream, w.attn_norm, w.wqkv, qkv)?;
        self.project(input, w.wqkv, self.ws.wide, qkv)?;
        self.attend(layer, tokens, mode, None)?;
        let out = Linear {
            tokens,
            in_features: c.q_dim(),
            out_features: c.hidden_size,
        };
        self.project_out(Input::Bf16(GemvInput::Rows(self.ws.narrow)), w.wo, out)
    }

    /// Attention of `layer` over the step's q/k/v (in `wide`, or a folded layer's `folded`, for
    /// decode rows only), its output into `narrow`.
    fn attend(
        &self,
        layer: usize,
        tokens: usize,
        mode: AttentionMode,
        folded: Option<FoldedQkv>,
    ) -> Result<()> {
        let w = self.weights.layer(layer);
        let shape = self.shape();
        let (k_cache, v_cache) = (self.pool.cache(layer, false), self.pool.cache(layer, true));
        // Every token's k and v into the cache (and, for prefill attention, its q rotated).
        let append = |write_q: bool| {
            self.kernels.rope_kv_append(&RopeKv {
                qkv: self.ws.wide,
                bias: w.bqkv,
                inv_freq: self.weights.inv_freq(),
                positions: self.meta.positions,
                slots: self.meta.slots,
                k_cache,
                v_cache,
                shape,
                tokens,
                write_q,
            })
        };
        let decode = |store_kv, row_items| DecodeAttention {
            qkv: self.ws.wide,
            bias: w.bqkv,
            inv_freq: self.weights.inv_freq(),
            k_cache,
            v_cache,
            rows: self.meta.rows,
            shape,
            out: self.ws.narrow,
            store_kv,
            row_items,
            folded,
        };
        let split = |splits| Splits {
            splits,
            o_part: self.ws.o_part,
            lse_part: self.ws.lse_part,
            done: self.ws.done,
        };
        match mode {
            AttentionMode::Decode {
                rows,
                splits,
                append_first,
            } => {
                if splits == RESIDENT {
                    assert!(!append_first, "a verification's rows are split");
                    self.kernels
                        .decode_attention_resident(&decode(true, DPtr::NULL), rows)?
                } else {
                    if append_first {
                        append(false)?;
                    }
                    let attention = decode(!append_first, DPtr::NULL);
                    self.kernels
                        .decode_attention(&attention, rows, &split(splits))?
                }
            }
            AttentionMode::Prefill {
                items,
                splits,
                decode_rows,
                decode_splits,
            } => {
                assert!(folded.is_none(), "folded layers run decode rows alone");
                append(true)?;
                let attention = Attention {
                    qkv: self.ws.wide,
                    k_cache,
                    v_cache,
                    rows: self.meta.rows,
                    shape,
                    out: self.ws.narrow,
                };
                self.kernels
                    .prefill_attention(&attention, items, tokens, &split(splits))?;
                // After prefill attention: the merge of its splits writes an output for every
                // token of the step, these rows' among them (from nothing). Their k and v are
                // stored and their q rotated already (the append above).
                if decode_rows > 0 {
                    let attention = decode(false, self.meta.rows.items.offset(2 * items));
                    self.kernels
                        .decode_attention(&attention, decode_rows, &split(decode_splits))?
                }
            }
        }
        Ok(())
    }

    fn mlp_block(&self, layer: usize, tokens: usize, stream: Stream) -> Result<Stream> {
        let (c, w) = (self.config, self.weights.layer(layer));
        let (h, f) = (c.hidden_size, c.intermediate_size);
        let gate_up = Linear {
            tokens,
            in_features: h,
            out_features: 2 * f,
        };
        let input = self.normed_input(stream, w.ffn_norm, w.w_gate_up, gate_up)?;
        let down = Linear {
            tokens,
            in_features: f,
            out_features: h,
        };
        let activated = if self.gemv_serves(gate_up) {
            let out = GemvOutput::Glu(self.ws.narrow);
            self.gemv(input.bf16(), w.w_gate_up, out, gate_up)?;
            Input::Bf16(GemvInput::Rows(self.ws.narrow))
        } else {
            self.project(input, w.w_gate_up, self.ws.wide, gate_up)?;
            let fp8_down = matches!(w.w_down, Matrix::Fp8 { .. }) && !self.gemv_serves(down);
            // FP8 weights' rows are a multiple of 16 long (`check_fp8`), as the kernel needs.
            if fp8_down && f <= SILU_E4M3_MAX_FFN {
                self.kernels
                    .silu_mul_e4m3(self.ws.wide, self.x8(), tokens, f)?;
                Input::Fp8
            } else {
                self.kernels
                    .silu_mul(self.ws.wide, self.ws.narrow, tokens, f)?;
                Input::Bf16(GemvInput::Rows(self.ws.narrow))
            }
        };
        self.project_out(activated, w.w_down, down)
    }
}

/// A projection's input as the pass holds it.
#[derive(Debug, Clone, Copy)]
enum Input {
    /// bf16 rows, or the norm the gemv computes on the fly.
    Bf16(GemvInput),
    /// FP8 rows in `x8`, for cuBLASLt's FP8 product.
    Fp8,
}

impl Input {
    /// The input for a gemv, which reads bf16: FP8 rows are made only for cuBLASLt's products.
    fn bf16(self) -> GemvInput {
        match self {
            Input::Bf16(x) => x,
            Input::Fp8 => unreachable!("FP8 rows only for a projection cuBLASLt computes"),
        }
    }
}

/// Where the residual stream stands between sublayers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stream {
    /// `x` holds every sublayer's output so far.
    Current,
    /// The last sublayer's output waits in `proj`, for the next norm to add.
    Delta,
}

/// Splits for decode attention over `rows` rows: enough blocks to fill the device
/// `DECODE_BLOCKS_PER_MULTIPROCESSOR` times over, at most [`MAX_SPLITS`]. Each row uses fewer
/// where it is short (see the kernel), so a launch shape serves every context length.
///
/// With clusters of `cluster` blocks (1: none; see [`AttnShape::decode_cluster`]), where a
/// multiple of `cluster` is at most an eighth fewer, the launch takes that many, so that it runs
/// in clusters and its short rows merge their splits in shared memory (see the kernel); fewer
/// splits keep long rows within the one wave.
pub fn decode_splits(
    multiprocessors: usize,
    rows: usize,
    blocks_per_row: usize,
    cluster: usize,
) -> usize {
    let splits = (DECODE_BLOCKS_PER_MULTIPROCESSOR * multiprocessors)
        .div_ceil((rows * blocks_per_row).max(1))
        .clamp(1, MAX_SPLITS);
    let clustered = splits / cluster * cluster;
    if clustered > 0 && (splits - clustered) * 8 <= splits {
        clustered
    } else {
        splits
    }
}

/// Decode attention blocks a multiprocessor holds at once, at least (`DECODE_MIN_BLOCKS` in
/// decode_attention.cu).
const DECODE_RESIDENT_BLOCKS: usize = 3;

/// [`decode_splits`] for rows of at most `longest` positions. Rows short enough to merge
/// their splits in a cluster ([`CLUSTER_ROW_POSITIONS`]) use at most a cluster's blocks
/// whatever the launch has (`decode_row` in decode_attention.cu), and merge them in shared
/// memory only when the launch runs in clusters (its splits a multiple of the cluster's
/// blocks). So a launch of only such rows takes a cluster of splits exactly, as long as its
/// blocks fit the device in one wave, and no more than a cluster past that: a lone row's sums
/// are the same without the blocks that found nothing to do, and a few rows that split over
/// more blocks, or fewer, than a cluster, merging through global memory, merge in clusters
/// instead. H200, SmolLM2's shape × 512 positions, tok/s: batch 4 and 8 +8.5% (22 and 11
/// splits → 8), batch 12 and 16 +4% (4 and 6 → 8); at batch 24 and 32, two waves of
/// clusters measured −13% against 3 and 2 splits, which they keep (BENCHMARKS.md). The rows
/// of such a launch never use the split workspaces (their merge is in the cluster).
pub fn decode_splits_within(
    multiprocessors: usize,
    rows: usize,
    blocks_per_row: usize,
    cluster: usize,
    longest: usize,
) -> usize {
    let splits = decode_splits(multiprocessors, rows, blocks_per_row, cluster);
    if cluster == 1 || longest > CLUSTER_ROW_POSITIONS {
        splits
    } else if rows * blocks_per_row * cluster <= DECODE_RESIDENT_BLOCKS * multiprocessors {
        cluster
    } else {
        splits.min(cluster)
    }
}

/// The (row × split) pairs decode attention needs for any batch of at most `rows` rows (with
/// clusters a launch takes no more splits than without).
pub fn decode_split_pairs(multiprocessors: usize, rows: usize, blocks_per_row: usize) -> usize {
    (1..=rows)
        .map(|r| r * decode_splits(multiprocessors, r, blocks_per_row, 1))
        .max()
        .unwrap_or(0)
}

/// The split workspaces' size: decode's need, a batch-invariant verification's (up to
/// [`GEMV_MAX_TOKENS`] positions, each split as a lone row is), and room for prefill's.
pub fn split_pairs(multiprocessors: usize, rows: usize, blocks_per_row: usize) -> usize {
    decode_split_pairs(multiprocessors, rows, blocks_per_row)
        .max(rows.min(GEMV_MAX_TOKENS) * decode_splits(multiprocessors, 1, blocks_per_row, 1))
        .max(PREFILL_SPLIT_PAIRS)
}

/// Key splits for a prefill launch of `blocks` blocks over `tokens` tokens whose longest row
/// ends at `longest`: one unless the blocks are too few to fill the device, never more than
/// the workspaces hold (`pairs` token × split pairs) or than the keys warrant.
pub fn prefill_splits(
    multiprocessors: usize,
    blocks: usize,
    tokens: usize,
    longest: usize,
    pairs: usize,
) -> usize {
    let wanted = (BLOCKS_PER_MULTIPROCESSOR * multiprocessors).div_ceil(blocks.max(1));
    let room = pairs / tokens.max(1);
    wanted
        .min(longest.div_ceil(PREFILL_MIN_SPLIT_KEYS))
        .min(room)
        .clamp(1, PREFILL_MAX_SPLITS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_splits_fill_the_device_and_fit_the_workspace() {
        // An H200 (132 multiprocessors), the 8B shape (8 blocks a row).
        assert_eq!(decode_splits(132, 1, 8, 1), 33);
        assert_eq!(decode_splits(132, 32, 8, 1), 2);
        assert_eq!(decode_splits(132, 256, 8, 1), 1);
        // One KV head: as many splits as a launch may have.
        assert_eq!(decode_splits(132, 1, 1, 1), MAX_SPLITS);
        // In clusters of 8: a multiple of 8 where it is at most an eighth fewer.
        assert_eq!(decode_splits(132, 1, 8, 8), 32);
        assert_eq!(decode_splits(132, 4, 8, 8), 8);
        assert_eq!(decode_splits(132, 1, 3, 8), 88);
        assert_eq!(decode_splits(132, 3, 3, 8), 30);
        let pairs = decode_split_pairs(132, 256, 8);
        for rows in 1..=256 {
            for cluster in [1, 8] {
                assert!(rows * decode_splits(132, rows, 8, cluster) <= pairs);
            }
        }
        assert!(pairs <= 256 + 33);
    }

    #[test]
    fn steps_of_several_tokens_take_the_tensor_core_gemv() {
        let shape = |tokens, in_features| Linear {
            tokens,
            in_features,
            out_features: 576,
        };
        // SmolLM2's rows (576, 1,536) divide into chunks of 64: one token on the CUDA cores,
        // more on the tensor cores, and every count where `exact`.
        assert!(!takes_tensor_core_gemv(false, shape(1, 576)));
        assert!(takes_tensor_core_gemv(false, shape(2, 576)));
        assert!(takes_tensor_core_gemv(false, shape(8, 1536)));
        assert!(takes_tensor_core_gemv(true, shape(1, 576)));
        // Rows that do not divide stay on the CUDA cores.
        assert!(!takes_tensor_core_gemv(false, shape(4, 584)));
    }

    #[test]
    fn few_short_rows_take_the_resident_launch() {
        // SmolLM2's heads hold 768 positions a block (12 tiles): a lone row takes it up to
        // there, several up to the cut.
        assert!(takes_resident(1, 1, 768));
        assert!(takes_resident(1, 768, 768));
        assert!(!takes_resident(1, 769, 768));
        assert!(takes_resident(4, RESIDENT_MAX_POSITIONS, 768));
        assert!(!takes_resident(2, RESIDENT_MAX_POSITIONS + 1, 768));
        assert!(!takes_resident(RESIDENT_MAX_ROWS + 1, 64, 768));
        // A launch that holds fewer positions (heads of 128: 384) or none.
        assert!(!takes_resident(1, 300, 256));
        assert!(!takes_resident(1, 1, 0));
        // A verification asks with no bound on its rows' length.
        assert!(!takes_resident(1, usize::MAX, 768));
    }

    #[test]
    fn short_rows_take_a_cluster_of_splits_at_most() {
        // SmolLM2's shape (3 blocks a row) in clusters of 8: a lone short row launches 8 splits
        // instead of 88, 8 short rows one cluster each instead of 11 splits through global
        // memory, 16 instead of 6; a row past the cluster's reach keeps the launch of before.
        let short = CLUSTER_ROW_POSITIONS;
        assert_eq!(decode_splits_within(132, 1, 3, 8, short), 8);
        assert_eq!(decode_splits_within(132, 1, 3, 8, short + 1), 88);
        assert_eq!(decode_splits_within(132, 8, 3, 8, 512), 8);
        assert_eq!(decode_splits_within(132, 8, 3, 8, short + 1), 11);
        assert_eq!(decode_splits_within(132, 16, 3, 8, 512), 8);
        assert_eq!(decode_splits_within(132, 16, 3, 8, short + 1), 6);
        // Past one wave of clusters the launch keeps its fewer splits; without clusters, no
        // change.
        assert_eq!(decode_splits_within(132, 17, 3, 8, 512), 6);
        assert_eq!(decode_splits_within(132, 32, 3, 8, 512), 3);
        assert_eq!(decode_splits_within(132, 1, 8, 1, 512), 33);
    }

    #[test]
    fn prefill_splits_only_where_blocks_are_few() {
        // 32 new tokens after 32,000 restored: 2 items × 8 blocks.
        assert_eq!(prefill_splits(132, 16, 32, 32_032, 1024), 32);
        // A fresh 8k prompt fills the device by itself.
        assert_eq!(prefill_splits(132, 512 * 8, 8192, 8192, 1024), 1);
        // A short context is not split finer than its keys.
        assert_eq!(prefill_splits(132, 8, 5, 300, 1024), 2);
        // Nor beyond the workspaces.
        assert_eq!(prefill_splits(132, 16, 512, 32_512, 1024), 2);
    }
}
