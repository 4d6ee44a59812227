//! The typed kernel registry.
//!
//! `kernels/*.cu` are embedded in the binary, appended to `kernels/common.cuh` with `#line`
//! markers (so NVRTC's messages name the right file and line) and compiled as one program, once
//! per process and architecture; the PTX is kept for every later backend. [`Kernels`] loads it
//! into a device's context and exposes one method per kernel, with typed arguments, so nothing
//! outside this file names a kernel or orders its arguments. Launch shapes (grid, threads) are
//! decided here too, from the sizes the caller passes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::CudaFunction;
use cudarc::nvrtc::{CompileOptions, Ptx};
use half::bf16;

use super::device::{Args, DPtr, Device};
use super::gemm::Linear;
use crate::error::{EngineError, Result};

/// The sources, `common.cuh` first.
const SOURCES: [(&str, &str); 16] = [
    ("common.cuh", include_str!("../../../kernels/common.cuh")),
    (
        "embedding.cu",
        include_str!("../../../kernels/embedding.cu"),
    ),
    ("rms_norm.cu", include_str!("../../../kernels/rms_norm.cu")),
    ("silu_mul.cu", include_str!("../../../kernels/silu_mul.cu")),
    ("gemv.cu", include_str!("../../../kernels/gemv.cu")),
    ("gemv_tc.cu", include_str!("../../../kernels/gemv_tc.cu")),
    // Folded layers use the gemv's dot product and rounding.
    (
        "gemv_fold.cu",
        include_str!("../../../kernels/gemv_fold.cu"),
    ),
    ("rope_kv.cu", include_str!("../../../kernels/rope_kv.cu")),
    // Decode attention uses prefill attention's tile loader and tensor-core helpers, and a
    // folded layer's norm scale (gemv_fold.cu).
    (
        "prefill_attention.cu",
        include_str!("../../../kernels/prefill_attention.cu"),
    ),
    (
        "decode_attention.cu",
        include_str!("../../../kernels/decode_attention.cu"),
    ),
    ("sampling.cu", include_str!("../../../kernels/sampling.cu")),
    (
        "page_copy.cu",
        include_str!("../../../kernels/page_copy.cu"),
    ),
    (
        "step_meta.cu",
        include_str!("../../../kernels/step_meta.cu"),
    ),
    (
        "random_init.cu",
        include_str!("../../../kernels/random_init.cu"),
    ),
    (
        "collective.cu",
        include_str!("../../../kernels/collective.cu"),
    ),
    ("fp8.cu", include_str!("../../../kernels/fp8.cu")),
];

/// Head dimensions the attention kernels are instantiated for.
pub const HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// Query rows (token × head pairs) of one prefill attention block (`PREFILL_ROWS`), and its
/// warps for heads of up to 64 (`PREFILL_WARPS`: one m-tile of 16 rows each) and of 128
/// (`PREFILL_WIDE_WARPS`: two m-tiles each, so that every K and V fragment a warp reads from
/// shared memory feeds twice the products; ncu put that traffic at 71% of the L1's throughput
/// with one m-tile a warp, the tensor pipe at 42%), all defined for the kernels by
/// [`program_source`]. Measured on the H200, tok/s, 8,192-token prompt (1,024 in brackets),
/// 2026-12-04, three rounds: 8B shape with 8 warps × 1 m-tile 33,862 / 33,930 / 33,765 (43,352 /
/// 43,314 / 43,924), 4 × 2 34,935 / 34,541 / 34,922 (45,544 / 43,830 / 45,410), 8 × 2 (256 rows,
/// one block a multiprocessor) 34,889 / 34,907 / 34,788 (44,985 / 43,448 / 43,383); the SmolLM2
/// shape (heads of 64) 429,756 (429,821) with 8 × 1, 401,926 (401,168) with 4 × 2, 383,237
/// (359,451) with 8 × 2. Before (2026-11), 8B: 4 × 2 29,838 (40,391); 8 × 1 30,515 (41,925); the
/// 4 × 1 of before, query rows in registers, 27,350–27,810 (39,480–40,031).
const PREFILL_ROWS: usize = 128;
const PREFILL_WARPS: usize = 8;
const PREFILL_WIDE_WARPS: usize = 4;
/// The most positions of one sequence a step writes before its decode attention runs (a
/// verified token and its draft, appended by the kernel before): decode attention copies
/// older keys before waiting for that kernel (`DECODE_FRESH_KEYS` in the kernels), so a
/// verification of more positions is not run as decode rows.
pub const DECODE_FRESH_KEYS: usize = 8;

/// Threads of a prefill attention block for heads of `head_dim`.
fn prefill_threads(head_dim: usize) -> u32 {
    let warps = if head_dim >= 128 {
        PREFILL_WIDE_WARPS
    } else {
        PREFILL_WARPS
    };
    (warps * 32) as u32
}

/// Decode attention launches whose splits are a multiple of this run in clusters of this many
/// blocks (where [`AttnShape::decode_cluster`] says), and a row short enough to take at most
/// that many splits merges them in the cluster's shared memory (`CLUSTER_SPLITS` in
/// decode_attention.cu).
pub const CLUSTER_SPLITS: usize = 8;
/// The most positions a row may have to merge its splits in a cluster (decode_attention.cu's
/// `CLUSTER_SPLITS · MIN_SPLIT_KEYS`).
pub const CLUSTER_ROW_POSITIONS: usize = CLUSTER_SPLITS * 256;

/// Dynamic shared memory of one prefill attention block: its query rows and its K and V tiles.
fn prefill_shared_bytes(head_dim: usize) -> usize {
    PREFILL_ROWS * (head_dim + 8) * 2 + tile_shared_bytes(head_dim)
}

/// Key positions of one prefill attention tile (`KEY_TILE`), and tiles in flight
/// (`PREFILL_STAGES`).
const KEY_TILE: usize = 64;
const PREFILL_STAGES: usize = 2;

/// Dynamic shared memory of one prefill or decode attention block: K and V tiles of every
/// stage, rows padded by 8 elements.
fn tile_shared_bytes(head_dim: usize) -> usize {
    PREFILL_STAGES * 2 * KEY_TILE * (head_dim + 8) * 2
}

/// Decode attention's grids of at least this many blocks a multiprocessor run as many blocks
/// at once as their shared memory allows (three for the 8B's heads of 128); smaller grids ask
/// for the shared memory a block held beside its tiles before those bytes moved into them, so
/// their split counts keep the occupancy they were tuned at. H200, 8B shape, tok/s, three a
/// multiprocessor against two: batch 256 × 512 positions 19,128 / 18,119, batch 256 × 1,024
/// 13,902 / 13,177; but batch 64 × 1,024 7,903 / 8,271 and batch 32 × 8,192 1,965 / 2,159,
/// whose 512 blocks make 1.3 waves of three where they made 1.9 of two.
const DENSE_DECODE_BLOCKS_PER_MULTIPROCESSOR: usize = 12;

/// Dynamic shared memory of a decode attention launch of `blocks` blocks.
fn decode_shared_bytes(head_dim: usize, blocks: usize, multiprocessors: usize) -> usize {
    let tiles = tile_shared_bytes(head_dim);
    if blocks >= DENSE_DECODE_BLOCKS_PER_MULTIPROCESSOR * multiprocessors {
        return tiles;
    }
    // The softmax states of every warp and the query rows (decode_attention.cu).
    let outside = (DECODE_WARPS * DECODE_GROUP * (head_dim + 2)) * 4 + 16 * (head_dim + 8) * 2;
    tiles + outside
}

/// The most tiles of positions a resident decode launch holds a row's K and V in
/// ([`Kernels::decode_attention_resident`]): 1,024 positions. The kernel sizes each warp's
/// score registers by it (decode_attention.cu's `RESIDENT_MAX_TILES`, defined from this).
const RESIDENT_MAX_TILES: usize = 16;

/// Dynamic shared memory of a resident decode block holding `tiles` tiles: their K and V, then
/// 16 query rows (decode_attention.cu).
fn resident_shared_bytes(head_dim: usize, tiles: usize) -> usize {
    tiles * tile_shared_bytes(head_dim) / PREFILL_STAGES + 16 * (head_dim + 8) * 2
}

/// The tiles a resident decode block holds within `max_shared` bytes a block (0: none).
fn resident_tiles(head_dim: usize, max_shared: usize) -> usize {
    (1..=RESIDENT_MAX_TILES)
        .take_while(|&tiles| resident_shared_bytes(head_dim, tiles) <= max_shared)
        .last()
        .unwrap_or(0)
}

/// Query heads one prefill attention block serves (`MAX_GROUP`).
const MAX_GROUP: usize = 8;
/// Warps of one decode attention block (`DECODE_WARPS`).
const DECODE_WARPS: usize = 4;
/// Query heads one decode attention block serves (`DECODE_GROUP`).
const DECODE_GROUP: usize = 4;
/// Words of one sampled row's parameters (`SAMPLE_PARAM_WORDS`).
pub const SAMPLE_PARAM_WORDS: usize = 6;
/// Header words of a step's metadata blob (`STEP_HEADER_WORDS`).
pub const STEP_HEADER_WORDS: usize = 8;
/// Marks a token whose logits are not wanted (`NO_ROW`).
pub const NO_ROW: u32 = u32::MAX;

/// Chunks of 8 elements one `add_rms_norm` thread holds (`NORM_CHUNKS`).
const NORM_CHUNKS: usize = 4;

/// The most tokens [`Kernels::gemv`] takes.
pub const GEMV_MAX_TOKENS: usize = 8;
/// The weight rows one gemv block streams (`GEMV_ROWS`), and its threads.
const GEMV_ROWS: usize = 8;
const GEMV_THREADS: u32 = 128;
/// The longest rows a gemv normalizes itself; longer ones are normalized by
/// [`Kernels::add_rms_norm`] first, since each block would read its whole row of the f32
/// stream (4,096 × 4 bytes for an 8B model: a third of the bytes of the eight weight rows it
/// streams).
pub const GEMV_NORM_MAX_IN: usize = 2048;
/// [`Kernels::gemv_tc`] reads rows in chunks of this many elements (`GEMV_TC_CHUNK`): it serves
/// only rows a multiple long.
pub const GEMV_TC_CHUNK: usize = 64;
/// A [`Kernels::gemv_tc`] block: one tile of 8 weight rows (8 outputs, 4 with GLU) for one
/// token, of 16 for several (gemv_tc.cu's R = 2: each token's x read from shared memory feeds
/// two tiles' products), 8 warps.
const GEMV_TC_TILE_ROWS: usize = 8;
const GEMV_TC_WIDE_TILE_ROWS: usize = 16;
const GEMV_TC_THREADS: u32 = 256;
/// The chunks in a warp's ring (gemv_tc.cu's `STAGES`), defined for the kernels by
/// [`program_source`]: for one token, and for several, whose tile rows and x rows take more
/// shared memory a stage (4 keep two blocks a multiprocessor).
const GEMV_TC_STAGES: usize = 5;
const GEMV_TC_WIDE_STAGES: usize = 4;
/// A [`Kernels::gemv_tc`] block's ring (dynamic shared memory): `stages` chunks of each of its
/// 8 warps' `tile_rows` weight rows, 128 bytes a row, and a row for each token's x in the
/// products without a norm.
fn gemv_tc_ring_bytes(normed: bool, tokens: usize, tile_rows: usize, stages: usize) -> usize {
    stages * 8 * 128 * (tile_rows + if normed { 0 } else { tokens })
}
/// The gemv kernels by what they fuse (see gemv.cu), each for at most 1, 2, 4 and 8 tokens.
const GEMV_KERNELS: [&str; 5] = [
    "gemv",
    "gemv_norm",
    "gemv_glu",
    "gemv_norm_glu",
    "gemv_accum",
];

const THREADS: u32 = 256;
const ATTENTION_THREADS: u32 = 128;
const SAMPLE_THREADS: u32 = 1024;

/// Threads for a block that works on `chunks` pieces of one row: whole warps, at most 1024.
fn row_threads(chunks: usize) -> u32 {
    chunks.next_multiple_of(32).clamp(32, 1024) as u32
}

/// Names a folder whose `.cu` / `.cuh` files replace the built-in ones of the same name: kernel
/// work on a machine without cargo (edit a kernel, rerun the same binary).
pub const KERNEL_DIR_ENV: &str = "SNAPSERVE_KERNEL_DIR";

/// The whole program's source, each file after a `#line` marker.
fn program_source() -> Result<String> {
    let dir = std::env::var_os(KERNEL_DIR_ENV).map(std::path::PathBuf::from);
    let mut program = format!(
        "#define PREFILL_ROWS {PREFILL_ROWS}\n#define PREFILL_WARPS {PREFILL_WARPS}\n#define PREFILL_WIDE_WARPS {PREFILL_WIDE_WARPS}\n#define DECODE_FRESH_KEYS {DECODE_FRESH_KEYS}\n#define GEMV_TC_STAGES {GEMV_TC_STAGES}\n#define GEMV_TC_WIDE_STAGES {GEMV_TC_WIDE_STAGES}\n#define RESIDENT_MAX_TILES {RESIDENT_MAX_TILES}\n"
    );
    for (name, text) in SOURCES {
        let text = match &dir {
            Some(dir) if dir.join(name).exists() => {
                let path = dir.join(name);
                tracing::warn!("kernel source {} from {KERNEL_DIR_ENV}", path.display());
                std::fs::read_to_string(&path).map_err(|e| {
                    EngineError::KernelCompile(format!("reading {}: {e}", path.display()))
                })?
            }
            _ => text.to_string(),
        };
        program.push_str(&format!("#line 1 \"{name}\"\n{text}\n"));
    }
    Ok(program)
}

/// Compiles the kernels for `arch` (e.g. `sm_90`), or returns the PTX compiled earlier in this
/// process.
pub fn compile(arch: &str) -> Result<Ptx> {
    static CACHE: OnceLock<Mutex<HashMap<String, Ptx>>> = OnceLock::new();
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .expect("no compile panics while holding the cache");
    if let Some(ptx) = cache.get(arch) {
        return Ok(ptx.clone());
    }
    let options = CompileOptions {
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        name: Some("snapserve_kernels.cu".into()),
        ..Default::default()
    };
    let ptx =
        cudarc::nvrtc::compile_ptx_with_opts(program_source()?, options).map_err(|e| match e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                EngineError::KernelCompile(log.to_string_lossy().into_owned())
            }
            other => EngineError::KernelCompile(other.to_string()),
        })?;
    cache.insert(arch.to_string(), ptx.clone());
    Ok(ptx)
}

/// Every kernel, loaded for one device and one head dimension.
pub struct Kernels {
    embed_tokens: CudaFunction,
    add_rms_norm: CudaFunction,
    silu_mul: CudaFunction,
    silu_mul_e4m3: CudaFunction,
    /// By [`GEMV_KERNELS`], then for at most 1, 2, 4 and 8 tokens.
    gemv: Vec<[CudaFunction; 4]>,
    /// The same with FP8 weights (`w8_` entries).
    gemv_w8: Vec<[CudaFunction; 4]>,
    /// The gemv into f32 rows, one token ([`GemvOutput::F32`]).
    gemv_f32: CudaFunction,
    /// The tensor-core gemv (gemv_tc.cu), by [`GEMV_KERNELS`]: tiles of 8 rows, and of 16.
    gemv_tc: Vec<[CudaFunction; 2]>,
    /// A folded layer's launches (gemv_fold.cu), by [`FoldPhase`], then for 1, 2 and 4 chunks
    /// a lane prefetched.
    gemv_fold: [[CudaFunction; 3]; 2],
    fold_weights: CudaFunction,
    rope_kv_append: CudaFunction,
    decode_attention: CudaFunction,
    decode_attention_resident: CudaFunction,
    /// Tiles of positions the resident decode launch holds a row's K and V in.
    resident_tiles: usize,
    /// Threads of a resident decode block.
    resident_threads: u32,
    prefill_attention: CudaFunction,
    merge_attention_splits: CudaFunction,
    sample_rows: CudaFunction,
    gather_pages: CudaFunction,
    scatter_pages: CudaFunction,
    clone_pages: CudaFunction,
    unpack_step: CudaFunction,
    fill_uniform_bf16: CudaFunction,
    quantize_rows_e4m3: CudaFunction,
    tp_all_reduce_add: CudaFunction,
    tp_gather_logits: CudaFunction,
    device: Arc<Device>,
}

impl Kernels {
    /// Compiles (once per process) and loads the kernels, the attention ones for `head_dim`.
    pub fn load(device: &Arc<Device>, head_dim: usize) -> Result<Self> {
        if !HEAD_DIMS.contains(&head_dim) {
            return Err(EngineError::CudaUnavailable(format!(
                "head_dim {head_dim} has no attention kernel (supported: {HEAD_DIMS:?})"
            )));
        }
        device.bind()?;
        let module = device.context().load_module(compile(&device.arch())?)?;
        let f = |name: &str| module.load_function(name);
        let prefill_attention = f(&format!("prefill_attention_d{head_dim}"))?;
        device.allow_shared(&prefill_attention, prefill_shared_bytes(head_dim))?;
        let decode_attention = f(&format!("decode_attention_d{head_dim}"))?;
        device.allow_shared(&decode_attention, decode_shared_bytes(head_dim, 0, 1))?;
        let decode_attention_resident = f(&format!("decode_attention_resident_d{head_dim}"))?;
        let resident_tiles = resident_tiles(head_dim, device.max_block_shared);
        // Its block is as many warps as decode_attention.cu's RESIDENT_WARPS, which its launch
        // bounds tell.
        let resident_threads = decode_attention_resident.max_threads_per_block()? as u32;
        if resident_tiles > 0 {
            device.allow_shared(
                &decode_attention_resident,
                resident_shared_bytes(head_dim, resident_tiles),
            )?;
        }
        // The CUDA-core gemv's entries (`prefix` names the FP8 ones), each for at most 1, 2, 4
        // and 8 tokens.
        let gemv_entries = |prefix: &str| -> Result<Vec<[CudaFunction; 4]>> {
            GEMV_KERNELS
                .iter()
                .map(|name| {
                    let entry = |tokens: usize| f(&format!("{prefix}{name}_t{tokens}"));
                    Ok([entry(1)?, entry(2)?, entry(4)?, entry(8)?])
                })
                .collect()
        };
        Ok(Kernels {
            embed_tokens: f("embed_tokens")?,
            add_rms_norm: f("add_rms_norm")?,
            silu_mul: f("silu_mul")?,
            silu_mul_e4m3: f("silu_mul_e4m3")?,
            gemv: gemv_entries("")?,
            gemv_w8: gemv_entries("w8_")?,
            gemv_f32: f("gemv_f32_t1")?,
            gemv_tc: GEMV_KERNELS
                .iter()
                .map(|name| {
                    let normed = name.contains("norm");
                    let ring =
                        |rows, stages| gemv_tc_ring_bytes(normed, GEMV_MAX_TOKENS, rows, stages);
                    let narrow = f(&name.replacen("gemv", "gemv_tc", 1))?;
                    device
                        .allow_dynamic_shared(&narrow, ring(GEMV_TC_TILE_ROWS, GEMV_TC_STAGES))?;
                    // The wide ring (96 KB for 8 tokens) needs the largest shared-memory
                    // carveout for two blocks a multiprocessor.
                    let wide = f(&name.replacen("gemv", "gemv_tc_wide", 1))?;
                    device
                        .allow_shared(&wide, ring(GEMV_TC_WIDE_TILE_ROWS, GEMV_TC_WIDE_STAGES))?;
                    Ok([narrow, wide])
                })
                .collect::<Result<_>>()?,
            gemv_fold: {
                let entries = |name: &str| -> Result<[CudaFunction; 3]> {
                    let entry = |unroll: usize| f(&format!("{name}_u{unroll}"));
                    Ok([entry(1)?, entry(2)?, entry(4)?])
                };
                [entries("gemv_fold_guo")?, entries("gemv_fold_qkvd")?]
            },
            fold_weights: f("fold_weights")?,
            rope_kv_append: f("rope_kv_append")?,
            decode_attention,
            decode_attention_resident,
            resident_tiles,
            resident_threads,
            prefill_attention,
            merge_attention_splits: f("merge_attention_splits")?,
            sample_rows: f("sample_rows")?,
            gather_pages: f("gather_pages")?,
            scatter_pages: f("scatter_pages")?,
            clone_pages: f("clone_pages")?,
            unpack_step: f("unpack_step")?,
            fill_uniform_bf16: f("fill_uniform_bf16")?,
            quantize_rows_e4m3: f("quantize_rows_e4m3")?,
            tp_all_reduce_add: f("tp_all_reduce_add")?,
            tp_gather_logits: f("tp_gather_logits")?,
            device: device.clone(),
        })
    }

    /// Blocks for an elementwise kernel over `n` items: enough to fill the device, no more.
    fn elementwise_blocks(&self, n: usize) -> u32 {
        let wanted = n.div_ceil(THREADS as usize).max(1);
        wanted.min(self.device.multiprocessors as usize * 8) as u32
    }

    /// `residual[t] = table[token_ids[t]]` for `tokens` tokens; with a split table, this
    /// rank's rows (or zeros) into `slice` and zeros into `residual` (see [`Embed::split`]).
    pub fn embed(&self, a: &Embed) -> Result<()> {
        let (slice, rows) = a.split.clone().unwrap_or((DPtr::NULL, 0..0));
        let args = Args::new()
            .ptr(a.table)
            .ptr(a.token_ids)
            .ptr(a.residual)
            .ptr(slice)
            .u32(a.hidden as u32)
            .u32(rows.start as u32)
            .u32(rows.len() as u32);
        let threads = row_threads(a.hidden / 8);
        self.device
            .launch(&self.embed_tokens, (a.tokens as u32, 1, 1), threads, &args)
    }

    /// `residual += delta` (if any), then RMSNorm of each row into `out`.
    pub fn add_rms_norm(&self, a: &AddRmsNorm) -> Result<()> {
        let args = Args::new()
            .ptr(a.residual)
            .ptr(a.delta)
            .ptr(a.weight)
            .ptr(a.out)
            .ptr(a.out_rows)
            .ptr(a.e4m3.map_or(DPtr::NULL, |rows| rows.values))
            .ptr(a.e4m3.map_or(DPtr::NULL, |rows| rows.scales))
            .u32(a.hidden as u32)
            .f32(a.eps);
        // A thread per chunk of 8 elements, up to NORM_CHUNKS chunks each past 1024 threads.
        let threads = row_threads(a.hidden / 8);
        debug_assert!(a.hidden / 8 <= 1024 * NORM_CHUNKS);
        self.device
            .launch(&self.add_rms_norm, (a.tokens as u32, 1, 1), threads, &args)
    }

    /// `out = silu(gate) · up` for rows of `[gate | up]`, `ffn` wide each.
    pub fn silu_mul(
        &self,
        gate_up: DPtr<bf16>,
        out: DPtr<bf16>,
        tokens: usize,
        ffn: usize,
    ) -> Result<()> {
        let args = Args::new()
            .ptr(gate_up)
            .ptr(out)
            .u32(tokens as u32)
            .u32(ffn as u32);
        // A thread takes eight elements at a time where the rows allow it (see the kernel).
        let per_thread = if ffn.is_multiple_of(8) { 8 } else { 1 };
        let blocks = self.elementwise_blocks(tokens * ffn / per_thread);
        self.device
            .launch(&self.silu_mul, (blocks, 1, 1), THREADS, &args)
    }

    /// [`Kernels::silu_mul`] into FP8 rows: each row rounded to bf16 as `silu_mul` writes it,
    /// then quantized as [`Kernels::quantize_rows_e4m3`] would quantize it, in one pass. `ffn`
    /// a multiple of 8 and at most [`SILU_E4M3_MAX_FFN`]. Needs sm_89 or newer.
    pub fn silu_mul_e4m3(
        &self,
        gate_up: DPtr<bf16>,
        out: Fp8Rows,
        tokens: usize,
        ffn: usize,
    ) -> Result<()> {
        assert!(
            ffn.is_multiple_of(8) && ffn <= SILU_E4M3_MAX_FFN,
            "silu_mul_e4m3 takes rows of a multiple of 8 up to {SILU_E4M3_MAX_FFN}, not {ffn}"
        );
        if tokens == 0 {
            return Ok(());
        }
        let args = Args::new()
            .ptr(gate_up)
            .ptr(out.values)
            .ptr(out.scales)
            .u32(ffn as u32);
        let threads = row_threads(ffn / 8);
        self.device
            .launch(&self.silu_mul_e4m3, (tokens as u32, 1, 1), threads, &args)
    }

    /// `y = x · wᵀ` for at most [`GEMV_MAX_TOKENS`] tokens (bf16 `[tokens, in]` by
    /// `[out, in]`), with the norm before it or the activation or residual add after it fused
    /// as `input` and `output` say.
    pub fn gemv(
        &self,
        input: GemvInput,
        w: DPtr<bf16>,
        output: GemvOutput,
        shape: Linear,
    ) -> Result<()> {
        self.gemv_cuda_cores(input, (w.cast(), DPtr::NULL), output, shape)
    }

    /// [`Kernels::gemv`] with FP8 weights: `w` e4m3 `[out, in]`, `scales` one f32 a row (see
    /// [`Kernels::quantize_rows_e4m3`]); x stays bf16. Needs sm_89 or newer.
    pub fn gemv_fp8(
        &self,
        input: GemvInput,
        w: DPtr<u8>,
        scales: DPtr<f32>,
        output: GemvOutput,
        shape: Linear,
    ) -> Result<()> {
        self.gemv_cuda_cores(input, (w, scales), output, shape)
    }

    /// The CUDA-core gemv on bf16 weights (`scales` null) or e4m3 ones.
    fn gemv_cuda_cores(
        &self,
        input: GemvInput,
        (w, scales): (DPtr<u8>, DPtr<f32>),
        output: GemvOutput,
        shape: Linear,
    ) -> Result<()> {
        if let GemvOutput::F32(_) = output {
            assert!(
                shape.tokens == 1 && scales.is_null() && matches!(input, GemvInput::Rows(_)),
                "the f32 gemv takes one token's bf16 row by bf16 weights"
            );
            let (function, threads) = (&self.gemv_f32, (GEMV_THREADS, 0));
            let weights = (w, Some(scales));
            return self.launch_gemv(function, GEMV_ROWS, threads, input, weights, output, shape);
        }
        let variant = match shape.tokens {
            1 => 0,
            2 => 1,
            3 | 4 => 2,
            5..=GEMV_MAX_TOKENS => 3,
            n => panic!("gemv takes 1 to {GEMV_MAX_TOKENS} tokens, not {n}"),
        };
        let (kernel, per_block) = gemv_kernel(input, output, GEMV_ROWS);
        let functions = if scales.is_null() {
            &self.gemv
        } else {
            &self.gemv_w8
        };
        self.launch_gemv(
            &functions[kernel][variant],
            per_block,
            (GEMV_THREADS, 0),
            input,
            (w, Some(scales)),
            output,
            shape,
        )
    }

    /// [`Kernels::gemv`] on the tensor cores (gemv_tc.cu): each token's outputs are the same bits
    /// whatever the token count, at the same cost for 1 to [`GEMV_MAX_TOKENS`] tokens. Rows
    /// must be a multiple of [`GEMV_TC_CHUNK`] long.
    pub fn gemv_tc(
        &self,
        input: GemvInput,
        w: DPtr<bf16>,
        output: GemvOutput,
        shape: Linear,
    ) -> Result<()> {
        assert!(
            (1..=GEMV_MAX_TOKENS).contains(&shape.tokens),
            "gemv takes 1 to {GEMV_MAX_TOKENS} tokens, not {}",
            shape.tokens
        );
        assert!(shape.in_features.is_multiple_of(GEMV_TC_CHUNK));
        let normed = matches!(input, GemvInput::Normed { .. });
        let (tile_rows, stages, wide) = if shape.tokens > 1 {
            (GEMV_TC_WIDE_TILE_ROWS, GEMV_TC_WIDE_STAGES, 1)
        } else {
            (GEMV_TC_TILE_ROWS, GEMV_TC_STAGES, 0)
        };
        let (kernel, per_block) = gemv_kernel(input, output, tile_rows);
        let ring = gemv_tc_ring_bytes(normed, shape.tokens, tile_rows, stages);
        self.launch_gemv(
            &self.gemv_tc[kernel][wide],
            per_block,
            (GEMV_TC_THREADS, ring as u32),
            input,
            (w.cast(), None),
            output,
            shape,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_gemv(
        &self,
        function: &CudaFunction,
        per_block: usize,
        (threads, shared_bytes): (u32, u32),
        input: GemvInput,
        (w, w_scales): (DPtr<u8>, Option<DPtr<f32>>),
        output: GemvOutput,
        shape: Linear,
    ) -> Result<()> {
        let outputs = match output {
            GemvOutput::Glu(_) => shape.out_features / 2,
            _ => shape.out_features,
        };
        let args = match input {
            GemvInput::Rows(x) => Args::new().ptr(x).ptr(w),
            GemvInput::Normed { residual, .. } => Args::new().ptr(residual).ptr(w),
        };
        let args = match output {
            GemvOutput::Rows(y) | GemvOutput::Glu(y) => args.ptr(y),
            GemvOutput::Accumulate(y) | GemvOutput::F32(y) => args.ptr(y),
        };
        let (norm_weight, eps) = match input {
            GemvInput::Rows(_) => (DPtr::NULL, 0.0),
            GemvInput::Normed { weight, eps, .. } => (weight, eps),
        };
        let args = args
            .ptr(norm_weight)
            .f32(eps)
            .u32(shape.tokens as u32)
            .u32(shape.in_features as u32)
            .u32(outputs as u32);
        // The CUDA-core gemv's last parameter (null for bf16 weights); the tensor-core one has
        // none.
        let args = match w_scales {
            Some(scales) => args.ptr(scales),
            None => args,
        };
        let blocks = outputs.div_ceil(per_block) as u32;
        self.device
            .launch_with_shared(function, (blocks, 1, 1), threads, shared_bytes, &args)
    }

    /// One phase of a folded layer (gemv_fold.cu): `rows_a` rows of `wa` into `raw`, and
    /// the `hidden` rows of `wb` added to the stream `before` into `after`, with their partial
    /// sums of squares into `parts`.
    pub fn gemv_fold(&self, f: &FoldLaunch) -> Result<()> {
        let post_chunks = match f.phase {
            FoldPhase::GateUpOut => f.q_dim,
            FoldPhase::QkvDown => f.ffn,
        } / 8;
        let unroll = match post_chunks.div_ceil(FOLD_THREADS as usize) {
            0 | 1 => 0,
            2 => 1,
            _ => 2,
        };
        let args = Args::new()
            .ptr(f.h)
            .ptr(f.a)
            .ptr(f.gu)
            .ptr(f.gu_parts)
            .ptr(f.partial)
            .ptr(f.before)
            .ptr(f.wa)
            .ptr(f.raw)
            .ptr(f.wb)
            .ptr(f.after)
            .ptr(f.parts)
            .u32(f.rows_a as u32)
            .u32(f.hidden as u32)
            .u32(f.q_dim as u32)
            .u32(f.ffn as u32)
            .f32(f.eps);
        let blocks = f.rows_a.div_ceil(FOLD_ROWS) + f.hidden / FOLD_ROWS;
        let function = &self.gemv_fold[f.phase as usize][unroll];
        self.device
            .launch(function, (blocks as u32, 1, 1), FOLD_THREADS, &args)
    }

    /// Columns `col0..col0 + n` of the `rows` rows of a folded matrix (`out_stride` elements a
    /// row): `a·diag(g)·b` with `b` `[k, n]`, or `a·diag(g)` itself where `b` is null (`n` =
    /// `k`); `a` is `[rows, k]` (gemv_fold.cu's `fold_weights`).
    #[allow(clippy::too_many_arguments)]
    pub fn fold_weights(
        &self,
        a: DPtr<bf16>,
        g: DPtr<bf16>,
        b: DPtr<bf16>,
        out: DPtr<bf16>,
        (rows, k, n): (usize, usize, usize),
        out_stride: usize,
        col0: usize,
    ) -> Result<()> {
        let args = Args::new()
            .ptr(a)
            .ptr(g)
            .ptr(b)
            .ptr(out)
            .u32(k as u32)
            .u32(n as u32)
            .u32(out_stride as u32)
            .u32(col0 as u32);
        let grid = (n.div_ceil(THREADS as usize) as u32, rows as u32, 1);
        self.device
            .launch_with_shared(&self.fold_weights, grid, THREADS, (k * 4) as u32, &args)
    }

    /// Bias, rotary embedding of q and k, and the append of k and v to the paged cache.
    pub fn rope_kv_append(&self, a: &RopeKv) -> Result<()> {
        let s = &a.shape;
        let args = Args::new()
            .ptr(a.qkv)
            .ptr(a.bias)
            .ptr(a.inv_freq)
            .ptr(a.positions)
            .ptr(a.slots)
            .ptr(a.k_cache)
            .ptr(a.v_cache)
            .u32(s.heads as u32)
            .u32(s.kv_heads as u32)
            .u32(s.head_dim as u32)
            .u32(a.write_q as u32);
        // One thread per 8 rotated pairs or 8 copied v elements; a token's blocks share them.
        let q_heads = if a.write_q { s.heads } else { 0 };
        let units = ((q_heads + s.kv_heads) * s.head_dim / 2 + s.kv_heads * s.head_dim) / 8;
        let grid = (a.tokens as u32, units.div_ceil(THREADS as usize) as u32, 1);
        self.device
            .launch(&self.rope_kv_append, grid, THREADS, &args)
    }

    /// Blocks a decode attention cluster has for `shape` on this device (1: none).
    pub fn decode_cluster(&self, shape: &AttnShape) -> usize {
        if self.device.has_clusters() {
            shape.decode_cluster()
        } else {
            1
        }
    }

    /// Attention of rows holding one new token each, whose bias, rotary embedding and KV append
    /// it does too, over `split.splits` splits of each row's positions.
    pub fn decode_attention(&self, a: &DecodeAttention, rows: usize, split: &Splits) -> Result<()> {
        let s = &a.shape;
        let args = decode_args(a)
            .ptr(split.o_part)
            .ptr(split.lse_part)
            .ptr(split.done)
            .u32(split.splits as u32)
            .u32(a.store_kv as u32)
            .ptr(a.row_items)
            .u32((a.row_items.addr() != 0) as u32);
        let args = folded_args(args, a.folded);
        let grid = (
            split.splits as u32,
            s.decode_blocks_per_row() as u32,
            rows as u32,
        );
        let blocks = split.splits * s.decode_blocks_per_row() * rows;
        let multiprocessors = self.device.multiprocessors as usize;
        let shared = decode_shared_bytes(s.head_dim, blocks, multiprocessors) as u32;
        let cluster = self.decode_cluster(s);
        let cluster = if split.splits.is_multiple_of(cluster) {
            cluster as u32
        } else {
            1
        };
        self.device.launch_clustered(
            &self.decode_attention,
            grid,
            ATTENTION_THREADS,
            shared,
            cluster,
            &args,
        )
    }

    /// The longest row (in positions) [`Kernels::decode_attention_resident`] takes.
    pub fn resident_positions(&self) -> usize {
        self.resident_tiles * KEY_TILE
    }

    /// Attention of rows holding one new token each, at most [`Kernels::resident_positions`]
    /// long, whose bias, rotary embedding and KV append it does too: one block a row and head
    /// group, every earlier position copied into shared memory before the wait for the kernel
    /// before (decode_attention.cu). `a.row_items` must be null and `a.store_kv` set.
    pub fn decode_attention_resident(&self, a: &DecodeAttention, rows: usize) -> Result<()> {
        assert!(a.store_kv && a.row_items.addr() == 0 && self.resident_tiles > 0);
        let s = &a.shape;
        let args = folded_args(decode_args(a).u32(self.resident_tiles as u32), a.folded);
        let grid = (1, s.decode_blocks_per_row() as u32, rows as u32);
        let shared = resident_shared_bytes(s.head_dim, self.resident_tiles) as u32;
        self.device.launch_with_shared(
            &self.decode_attention_resident,
            grid,
            self.resident_threads,
            shared,
            &args,
        )
    }

    /// Causal attention over `items` work items (see [`AttnShape::prefill_tile_tokens`]) of a
    /// step of `tokens` tokens. With `split.splits` above 1 each item's keys are split over that
    /// many blocks whose partial outputs (`[tokens][heads][splits]`) a second launch merges;
    /// `split.done` is not used.
    pub fn prefill_attention(
        &self,
        a: &Attention,
        items: usize,
        tokens: usize,
        split: &Splits,
    ) -> Result<()> {
        let s = &a.shape;
        let args = Args::new()
            .ptr(a.qkv)
            .u32(s.qkv_width() as u32)
            .ptr(a.k_cache)
            .ptr(a.v_cache)
            .ptr(a.rows.page_table)
            .u32(a.rows.table_stride as u32)
            .ptr(a.rows.start_token)
            .ptr(a.rows.start_pos)
            .ptr(a.rows.len)
            .ptr(a.rows.items)
            .u32(s.heads as u32)
            .u32(s.kv_heads as u32)
            .u32(s.page_tokens as u32)
            .u32(s.window as u32)
            .f32(s.scale_log2())
            .ptr(a.out)
            .u32(split.splits as u32)
            .ptr(split.o_part)
            .ptr(split.lse_part);
        let grid = (
            items as u32,
            s.prefill_blocks_per_item() as u32,
            split.splits as u32,
        );
        let shared = prefill_shared_bytes(s.head_dim) as u32;
        self.device.launch_with_shared(
            &self.prefill_attention,
            grid,
            prefill_threads(s.head_dim),
            shared,
            &args,
        )?;
        if split.splits == 1 {
            return Ok(());
        }
        let args = Args::new()
            .ptr(split.o_part)
            .ptr(split.lse_part)
            .ptr(a.out)
            .u32(s.heads as u32)
            .u32(s.head_dim as u32)
            .u32(split.splits as u32);
        let grid = (tokens as u32, s.heads as u32, 1);
        let threads = s.head_dim.min(ATTENTION_THREADS as usize) as u32;
        self.device
            .launch(&self.merge_attention_splits, grid, threads, &args)
    }

    /// Picks a token for each of `rows` rows of `vocab` logits (overwritten), with the
    /// parameters at `params` (`SAMPLE_PARAM_WORDS` words a row), among the tokens `mask`
    /// allows (`vocab.div_ceil(32)` bitmask words a row; [`DPtr::NULL`]: all).
    pub fn sample_rows(
        &self,
        logits: DPtr<f32>,
        vocab: usize,
        params: DPtr<u32>,
        picks: Picks,
        mask: DPtr<u32>,
        rows: usize,
    ) -> Result<()> {
        let args = Args::new()
            .ptr(logits)
            .u32(vocab as u32)
            .ptr(params)
            .ptr(picks.host)
            .ptr(mask)
            .ptr(picks.fed)
            .ptr(picks.slot)
            .u32(picks.stride as u32);
        self.device.launch(
            &self.sample_rows,
            (rows as u32, 1, 1),
            SAMPLE_THREADS,
            &args,
        )
    }

    /// Copies pool pages into snapshot pages (`gather`) or back (`!gather`).
    pub fn copy_pages(&self, a: &PageCopies, gather: bool) -> Result<()> {
        let (func, from, to) = if gather {
            (&self.gather_pages, a.pool, a.snapshot)
        } else {
            (&self.scatter_pages, a.snapshot, a.pool)
        };
        let mut args = Args::new()
            .ptr(from)
            .ptr(to)
            .ptr(a.copies)
            .u32(a.pages_total as u32)
            .u32((a.page_bytes / 16) as u32)
            .u32(a.layers as u32)
            .ptr(a.sums);
        if !gather {
            args = args.ptr(a.bad);
        }
        let grid = (a.count as u32, 2 * a.layers as u32, 1);
        self.device.launch(func, grid, THREADS, &args)
    }

    /// Copies pool pages onto other pool pages: `a.copies` holds `a.count` (from, to) pairs
    /// (`a.snapshot` is unused).
    pub fn clone_pages(&self, a: &PageCopies) -> Result<()> {
        let args = Args::new()
            .ptr(a.pool)
            .ptr(a.copies)
            .u32(a.pages_total as u32)
            .u32((a.page_bytes / 16) as u32);
        let grid = (a.count as u32, 2 * a.layers as u32, 1);
        self.device.launch(&self.clone_pages, grid, THREADS, &args)
    }

    /// Spreads a step's metadata blob into its typed buffers.
    pub fn unpack_step(&self, blob: DPtr<u32>, to: &MetaBuffers) -> Result<()> {
        let args = Args::new()
            .ptr(blob)
            .ptr(to.token_ids)
            .ptr(to.positions)
            .ptr(to.slots)
            .ptr(to.logit_rows)
            .ptr(to.rows.start_token)
            .ptr(to.rows.start_pos)
            .ptr(to.rows.len)
            .ptr(to.rows.page_table)
            .u32(to.rows.table_stride as u32)
            .ptr(to.rows.items)
            .ptr(to.sample_params)
            .ptr(to.fed_tokens)
            .ptr(to.picks_slot);
        let blocks = self.device.multiprocessors;
        self.device
            .launch(&self.unpack_step, (blocks, 1, 1), THREADS, &args)
    }

    /// Fills `n` bf16 values with uniform draws in `[lo, hi)`, a pure function of `seed`.
    pub fn fill_uniform(
        &self,
        out: DPtr<bf16>,
        n: usize,
        seed: u64,
        range: (f32, f32),
    ) -> Result<()> {
        let whole = Window {
            rows: 1,
            cols: n,
            row0: 0,
            col0: 0,
            full_cols: n,
        };
        self.fill_uniform_window(out, whole, seed, range)
    }

    /// `residual += Σ partials` over every rank of `group`, for `elems` elements (a multiple of
    /// 8): each rank's `partials` buffer is the one it registered with the group.
    pub fn tp_all_reduce_add(
        &self,
        group: &GroupArgs,
        residual: DPtr<f32>,
        elems: usize,
    ) -> Result<()> {
        debug_assert!(elems.is_multiple_of(8));
        let args = Args::new()
            .ptr(group.table)
            .ptr(group.epochs)
            .ptr(group.timed_out)
            .ptr(residual)
            .u32(elems as u32)
            .u32(group.rank as u32)
            .u32(group.world as u32);
        self.device.launch(
            &self.tp_all_reduce_add,
            (TP_BLOCKS, 1, 1),
            TP_THREADS,
            &args,
        )
    }

    /// Rank 0 gathers `rows` rows of every rank's `cols` logits (the buffers registered with the
    /// group) into `logits`, `cols · world` wide; every rank calls it.
    pub fn tp_gather_logits(
        &self,
        group: &GroupArgs,
        logits: DPtr<f32>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let args = Args::new()
            .ptr(group.table)
            .ptr(group.epochs)
            .ptr(group.timed_out)
            .ptr(logits)
            .u32(rows as u32)
            .u32(cols as u32)
            .u32(group.rank as u32)
            .u32(group.world as u32);
        self.device
            .launch(&self.tp_gather_logits, (TP_BLOCKS, 1, 1), TP_THREADS, &args)
    }

    /// Quantizes `rows` bf16 rows of `cols` elements (a multiple of 8) into FP8 rows `out`
    /// (kernels/fp8.cu). Needs sm_89 or newer.
    pub fn quantize_rows_e4m3(
        &self,
        x: DPtr<bf16>,
        out: Fp8Rows,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        assert!(
            cols.is_multiple_of(8),
            "quantized rows are a multiple of 8 long, not {cols}"
        );
        if rows == 0 {
            return Ok(());
        }
        let args = Args::new()
            .ptr(x)
            .ptr(out.values)
            .ptr(out.scales)
            .u32(cols as u32);
        self.device.launch(
            &self.quantize_rows_e4m3,
            (rows as u32, 1, 1),
            row_threads(cols / 8),
            &args,
        )
    }

    /// The `window` of a tensor [`Kernels::fill_uniform`] would draw whole: the same values.
    pub fn fill_uniform_window(
        &self,
        out: DPtr<bf16>,
        window: Window,
        seed: u64,
        range: (f32, f32),
    ) -> Result<()> {
        let args = Args::new()
            .ptr(out)
            .u64(window.rows as u64)
            .u64(window.cols as u64)
            .u64(window.row0 as u64)
            .u64(window.col0 as u64)
            .u64(window.full_cols as u64)
            .u64(seed)
            .f32(range.0)
            .f32(range.1);
        let blocks = self.elementwise_blocks(window.rows * window.cols);
        self.device
            .launch(&self.fill_uniform_bf16, (blocks, 1, 1), THREADS, &args)
    }
}

/// A window of a row-major tensor `full_cols` wide: `rows` × `cols` from (`row0`, `col0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub rows: usize,
    pub cols: usize,
    pub row0: usize,
    pub col0: usize,
    pub full_cols: usize,
}

/// Blocks of every tensor-parallel exchange (`TP_BLOCKS` in `kernels/collective.cu`).
pub const TP_BLOCKS: u32 = 32;
const TP_THREADS: u32 = 512;

/// What one rank's exchange kernels need of its group (see [`super::collective`]).
#[derive(Debug, Clone, Copy)]
pub struct GroupArgs {
    /// The group's `TpPeers` table on this rank's device.
    pub table: DPtr<u8>,
    /// This rank's epoch per block.
    pub epochs: DPtr<u32>,
    /// Set by a block that waited too long for a peer.
    pub timed_out: DPtr<u32>,
    pub rank: usize,
    pub world: usize,
}

/// Arguments of [`Kernels::embed`].
pub struct Embed {
    pub table: DPtr<bf16>,
    pub token_ids: DPtr<u32>,
    pub residual: DPtr<f32>,
    pub tokens: usize,
    pub hidden: usize,
    /// On a rank of a split model: where its bf16 slice of each token's row goes, and the
    /// vocabulary rows its table holds.
    pub split: Option<(DPtr<bf16>, std::ops::Range<usize>)>,
}

/// What a gemv reads.
#[derive(Debug, Clone, Copy)]
pub enum GemvInput {
    /// bf16 rows, `[tokens, in]`.
    Rows(DPtr<bf16>),
    /// The RMSNorm with `weight` of the f32 residual stream `[tokens, in]`, computed on the fly
    /// as [`Kernels::add_rms_norm`] would write it.
    Normed {
        residual: DPtr<f32>,
        weight: DPtr<bf16>,
        eps: f32,
    },
}

/// What a gemv writes.
#[derive(Debug, Clone, Copy)]
pub enum GemvOutput {
    /// bf16 rows, `[tokens, out]`.
    Rows(DPtr<bf16>),
    /// The weight's rows are `[gate; up]`: `silu(gate) · up` as bf16 rows `[tokens, out / 2]`,
    /// as [`Kernels::silu_mul`] would write it.
    Glu(DPtr<bf16>),
    /// The product, rounded to bf16, added to the f32 residual stream `[tokens, out]`.
    Accumulate(DPtr<f32>),
    /// f32 rows `[1, out]`, the sums unrounded (the logits of one token): the CUDA-core gemv
    /// on bf16 weights only.
    F32(DPtr<f32>),
}

/// Rows in FP8: `values` e4m3 `[rows, cols]`, `scales` one f32 a row (row `r` is
/// `values[r] · scales[r]`), as [`Kernels::quantize_rows_e4m3`] writes them.
#[derive(Debug, Clone, Copy)]
pub struct Fp8Rows {
    pub values: DPtr<u8>,
    pub scales: DPtr<f32>,
}

/// The widest row [`Kernels::silu_mul_e4m3`] holds (`SILU_E4M3_CHUNKS` chunks of 8 a thread,
/// 1,024 threads).
pub const SILU_E4M3_MAX_FFN: usize = 4 * 8 * 1024;

/// Arguments of [`Kernels::add_rms_norm`]; `delta` and `out_rows` may be [`DPtr::NULL`]. With
/// `e4m3`, the normalized rows go there in FP8 (as [`Kernels::quantize_rows_e4m3`] would
/// quantize what `out` would hold) and `out` is not written.
pub struct AddRmsNorm {
    pub residual: DPtr<f32>,
    pub delta: DPtr<bf16>,
    pub weight: DPtr<bf16>,
    pub out: DPtr<bf16>,
    pub out_rows: DPtr<u32>,
    pub e4m3: Option<Fp8Rows>,
    pub tokens: usize,
    pub hidden: usize,
    pub eps: f32,
}

/// The attention geometry of a model and its KV pages.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub page_tokens: usize,
    /// Sliding window in positions; 0 for none.
    pub window: usize,
}

impl AttnShape {
    /// Width of a row of the fused q/k/v projection.
    pub fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Query tokens of one prefill attention work item.
    pub fn prefill_tile_tokens(&self) -> usize {
        PREFILL_ROWS / self.group().min(MAX_GROUP)
    }

    /// Prefill attention blocks per work item and split: one per KV head and group of query
    /// heads.
    pub fn prefill_blocks_per_item(&self) -> usize {
        self.kv_heads * self.group().div_ceil(MAX_GROUP)
    }

    /// Decode attention blocks per row and split: one per KV head and group of query heads.
    pub fn decode_blocks_per_row(&self) -> usize {
        self.kv_heads * self.group().div_ceil(DECODE_GROUP)
    }

    /// Blocks a decode attention cluster has where the device runs clusters: [`CLUSTER_SPLITS`]
    /// for heads of up to 64, else 1 (none). Measured on the H200 (BENCHMARKS.md), clusters
    /// against the merge through global memory: SmolLM2 batch 1 × 512 +9% tok/s; the 8B shape
    /// (heads of 128, two blocks a multiprocessor) batch 1 +0.8% at 512 positions, −0.7% at
    /// 4,096, batch 4 × 512 −3.3%, and a verification of 8 (2,048 blocks, 256 clusters to
    /// place) 5% slower a step.
    pub fn decode_cluster(&self) -> usize {
        if self.head_dim <= 64 {
            CLUSTER_SPLITS
        } else {
            1
        }
    }

    /// Softmax scale in log2 units: the kernels use `exp2`.
    fn scale_log2(&self) -> f32 {
        std::f32::consts::LOG2_E / (self.head_dim as f32).sqrt()
    }
}

/// Arguments of [`Kernels::rope_kv_append`]; `bias` may be [`DPtr::NULL`].
pub struct RopeKv {
    pub qkv: DPtr<bf16>,
    pub bias: DPtr<bf16>,
    pub inv_freq: DPtr<f32>,
    pub positions: DPtr<u32>,
    pub slots: DPtr<u32>,
    pub k_cache: DPtr<bf16>,
    pub v_cache: DPtr<bf16>,
    pub shape: AttnShape,
    pub tokens: usize,
    /// Write the rotated q back in place (for prefill attention); else only k and v.
    pub write_q: bool,
}

/// The per-row metadata the attention kernels read.
#[derive(Debug, Clone, Copy)]
pub struct RowBuffers {
    pub start_token: DPtr<u32>,
    pub start_pos: DPtr<u32>,
    pub len: DPtr<u32>,
    /// `[rows][table_stride]` page ids.
    pub page_table: DPtr<u32>,
    pub table_stride: usize,
    /// Prefill work items: (row, first token within the row) pairs.
    pub items: DPtr<u32>,
}

/// Every typed buffer a step's metadata is spread into.
#[derive(Debug, Clone, Copy)]
pub struct MetaBuffers {
    pub token_ids: DPtr<u32>,
    pub positions: DPtr<u32>,
    pub slots: DPtr<u32>,
    pub logit_rows: DPtr<u32>,
    pub rows: RowBuffers,
    pub sample_params: DPtr<u32>,
    /// The last sampled step's picks, a row each, on the device: where a step launched ahead
    /// of the host reading them takes its tokens from ([`FED_TOKEN`]).
    pub fed_tokens: DPtr<u32>,
    /// One word: which slot of the host's picks buffer this step's picks go to.
    pub picks_slot: DPtr<u32>,
}

/// Where [`Kernels::sample_rows`] writes its picks, a row each: for the host (page-locked
/// memory it reads), and on the device, for a step launched ahead to take its tokens from.
/// With `slot` not null the host's go `*slot * stride` words into `host` (the step's slot,
/// which its metadata names: [`MetaBuffers::picks_slot`]).
#[derive(Debug, Clone, Copy)]
pub struct Picks {
    pub host: DPtr<u32>,
    pub fed: DPtr<u32>,
    pub slot: DPtr<u32>,
    pub stride: usize,
}

/// A token id of a step's plan that stands for the pick of row `id - FED_TOKEN` of the sampled
/// step before it, read on the device (`FED_TOKEN` in kernels/step_meta.cu).
pub const FED_TOKEN: u32 = 1 << 31;

/// Arguments of [`Kernels::decode_attention`]; `bias` may be [`DPtr::NULL`].
pub struct DecodeAttention {
    /// The new tokens' q/k/v projections, before bias and rotation.
    pub qkv: DPtr<bf16>,
    pub bias: DPtr<bf16>,
    pub inv_freq: DPtr<f32>,
    pub k_cache: DPtr<bf16>,
    pub v_cache: DPtr<bf16>,
    pub rows: RowBuffers,
    pub shape: AttnShape,
    pub out: DPtr<bf16>,
    /// Store each row's k and v into the cache (else a launch before stored them).
    pub store_kv: bool,
    /// The launch's rows as `(row, 0)` pairs (the decode rows a prefill step lists after its
    /// work items, [`super::step_meta::StepLayout::decode_items`]), whose q `rope_kv_append`
    /// rotated in place; [`DPtr::NULL`] for the step's rows `0..` with q as projected.
    pub row_items: DPtr<u32>,
    /// A folded layer's raw q/k/v (then `qkv` is not read): see [`FoldedQkv`].
    pub folded: Option<FoldedQkv>,
}

/// The q/k/v of a folded layer's step (gemv_fold.cu): f32 `[qkv width]` products of the stream
/// before its norm, which decode attention scales by the norm of that stream (from `parts`,
/// its `hidden / FOLD_ROWS` partial sums of squares) and rounds to bf16 before the bias.
#[derive(Debug, Clone, Copy)]
pub struct FoldedQkv {
    pub raw: DPtr<f32>,
    pub parts: DPtr<f32>,
    pub hidden: usize,
    pub eps: f32,
}

/// The arguments both decode attention kernels end with: a folded layer's q/k/v, or nulls.
fn folded_args(args: Args, folded: Option<FoldedQkv>) -> Args {
    let f = folded.unwrap_or(FoldedQkv {
        raw: DPtr::NULL,
        parts: DPtr::NULL,
        hidden: 0,
        eps: 0.0,
    });
    args.ptr(f.raw).ptr(f.parts).u32(f.hidden as u32).f32(f.eps)
}

/// Rows a folded layer's block holds (gemv_fold.cu's `FOLD_ROWS`), and its threads.
pub const FOLD_ROWS: usize = 8;
const FOLD_THREADS: u32 = 128;

/// The two launches of a folded layer besides attention (gemv_fold.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FoldPhase {
    /// The raw gate/up, and the next layer's raw q/k/v's first part, from the stream and
    /// attention's output; the output projection.
    GateUpOut = 0,
    /// The rest of the next layer's raw q/k/v, from the activation; the down projection.
    QkvDown = 1,
}

/// Arguments of [`Kernels::gemv_fold`] (gemv_fold.cu's `FoldArgs`).
#[derive(Debug, Clone, Copy)]
pub struct FoldLaunch {
    pub phase: FoldPhase,
    pub h: DPtr<f32>,
    pub a: DPtr<bf16>,
    pub gu: DPtr<f32>,
    pub gu_parts: DPtr<f32>,
    /// QKVD: GUO's part of each A row's sum.
    pub partial: DPtr<f32>,
    pub before: DPtr<f32>,
    pub wa: DPtr<bf16>,
    pub rows_a: usize,
    pub raw: DPtr<f32>,
    pub wb: DPtr<bf16>,
    pub after: DPtr<f32>,
    pub parts: DPtr<f32>,
    pub hidden: usize,
    pub q_dim: usize,
    pub ffn: usize,
    pub eps: f32,
}

/// The arguments both decode attention kernels start with, in their order (decode_attention.cu).
fn decode_args(a: &DecodeAttention) -> Args {
    let s = &a.shape;
    Args::new()
        .ptr(a.qkv)
        .ptr(a.bias)
        .ptr(a.inv_freq)
        .ptr(a.k_cache)
        .ptr(a.v_cache)
        .ptr(a.rows.page_table)
        .u32(a.rows.table_stride as u32)
        .ptr(a.rows.start_token)
        .ptr(a.rows.start_pos)
        .u32(s.heads as u32)
        .u32(s.kv_heads as u32)
        .u32(s.page_tokens as u32)
        .u32(s.window as u32)
        .f32(s.scale_log2())
        .ptr(a.out)
}

/// Arguments of [`Kernels::prefill_attention`].
pub struct Attention {
    pub qkv: DPtr<bf16>,
    pub k_cache: DPtr<bf16>,
    pub v_cache: DPtr<bf16>,
    pub rows: RowBuffers,
    pub shape: AttnShape,
    pub out: DPtr<bf16>,
}

/// How attention splits each row's (decode) or work item's (prefill) positions, and where
/// partial results go.
pub struct Splits {
    pub splits: usize,
    /// `[rows or tokens][heads][splits][head_dim]` normalized partial outputs.
    pub o_part: DPtr<f32>,
    /// `[rows or tokens][heads][splits]` log2-sum-exp of each split.
    pub lse_part: DPtr<f32>,
    /// `[rows][decode blocks per row]` counters of finished splits, zero between launches.
    pub done: DPtr<u32>,
}

/// Arguments of [`Kernels::copy_pages`].
pub struct PageCopies {
    pub pool: DPtr<u8>,
    pub snapshot: DPtr<u8>,
    /// `count` (snapshot page, pool page) pairs.
    pub copies: DPtr<u32>,
    pub count: usize,
    pub pages_total: usize,
    /// Bytes of one page of one layer's K (or V).
    pub page_bytes: usize,
    pub layers: usize,
    /// The block sums of the snapshot's arena chunk (written by a gather, checked by a
    /// scatter); unused by clones.
    pub sums: DPtr<u64>,
    /// Set by a scatter that read a block whose sum does not match.
    pub bad: DPtr<u32>,
}

/// The kernel of [`GEMV_KERNELS`] for `input` and `output`, and the outputs one block writes
/// when it streams `rows` weight rows (with GLU, rows o and out + o make output o).
fn gemv_kernel(input: GemvInput, output: GemvOutput, rows: usize) -> (usize, usize) {
    let normed = matches!(input, GemvInput::Normed { .. });
    match (normed, output) {
        (false, GemvOutput::Rows(_)) => (0, rows),
        (true, GemvOutput::Rows(_)) => (1, rows),
        (false, GemvOutput::Glu(_)) => (2, rows / 2),
        (true, GemvOutput::Glu(_)) => (3, rows / 2),
        (false, GemvOutput::Accumulate(_)) => (4, rows),
        (true, GemvOutput::Accumulate(_)) => {
            panic!("no gemv adds the product of a normed input to the residual stream")
        }
        (_, GemvOutput::F32(_)) => panic!("only the CUDA-core gemv writes f32 rows, unnormed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC needs no GPU: on a machine with its library (`pip download nvidia-cuda-nvrtc`,
    /// its `lib` folder on `LD_LIBRARY_PATH`) the whole program compiles for sm_90, and with
    /// `SNAPSERVE_PTX_OUT=FILE` the PTX is written there for `ptxas --gpu-name sm_90` (the
    /// nvcc wheel's) to assemble: kernel edits checked before a GPU is lent.
    #[test]
    #[ignore = "needs libnvrtc on the library path (no GPU)"]
    fn the_program_compiles_for_sm_90_without_a_gpu() {
        let ptx = compile("sm_90").expect("the kernels compile");
        let text = ptx.to_src();
        for kernel in [
            "quantize_rows_e4m3",
            "silu_mul",
            "silu_mul_e4m3",
            "add_rms_norm",
            "decode_attention",
        ] {
            assert!(
                text.contains(&format!(".entry {kernel}")),
                "{kernel} missing"
            );
        }
        if let Some(path) = std::env::var_os("SNAPSERVE_PTX_OUT") {
            std::fs::write(path, text).unwrap();
        }
    }

    #[test]
    fn only_dense_decode_grids_pack_three_blocks_a_multiprocessor() {
        // An H200: 132 multiprocessors, 228 KiB of shared memory each (1 KiB of it reserved
        // per block). The 8B's heads of 128: 8 blocks a row.
        let (sms, per_sm, reserved) = (132, 228 * 1024, 1024);
        let fits = |bytes: usize| per_sm / (bytes + reserved);
        let dense = decode_shared_bytes(128, 256 * 8, sms);
        assert_eq!(dense, tile_shared_bytes(128));
        assert_eq!(fits(dense), 3);
        // Batch 64 or 32 rows long enough for two splits: the bytes the block used to hold.
        for blocks in [64 * 8, 32 * 8 * 2] {
            let small = decode_shared_bytes(128, blocks, sms);
            assert_eq!(small, tile_shared_bytes(128) + 16 * 130 * 4 + 16 * 136 * 2);
            assert_eq!(fits(small), 2);
        }
        // The kernel is allowed the larger of the two.
        assert!(decode_shared_bytes(128, 0, 1) >= dense);
    }

    /// Each `__global__` function's parameters, by name, as its source declares them (macro
    /// line continuations removed; `__launch_bounds__(...)` skipped).
    fn kernel_parameters(source: &str) -> Vec<(String, usize)> {
        let source = source.replace("\\\n", " ");
        let bytes = source.as_bytes();
        // The index just past the parenthesis matching the one at `open`.
        let close = |open: usize| {
            let mut depth = 0;
            for (i, &c) in bytes.iter().enumerate().skip(open) {
                match c {
                    b'(' => depth += 1,
                    b')' if depth == 1 => return i + 1,
                    b')' => depth -= 1,
                    _ => {}
                }
            }
            panic!("an unclosed parenthesis in a kernel's declaration");
        };
        let mut kernels = Vec::new();
        for (at, _) in source.match_indices("__global__") {
            let mut from = at + "__global__".len();
            loop {
                let open = from + source[from..].find('(').expect("a parameter list");
                let name = source[from..open]
                    .split_whitespace()
                    .last()
                    .unwrap_or("")
                    .to_string();
                let end = close(open);
                if name == "__launch_bounds__" {
                    from = end;
                    continue;
                }
                let list = &source[open + 1..end - 1];
                let mut depth = 0i32;
                let mut count = usize::from(!list.trim().is_empty());
                for c in list.chars() {
                    match c {
                        '(' | '<' | '[' => depth += 1,
                        ')' | '>' | ']' => depth -= 1,
                        ',' if depth == 0 => count += 1,
                        _ => {}
                    }
                }
                kernels.push((name, count));
                break;
            }
        }
        kernels
    }

    /// A launch packs at most `MAX_ARGS` arguments and finds out only on the GPU: a kernel
    /// declared with more fails here, on any machine.
    #[test]
    fn every_kernel_takes_no_more_arguments_than_a_launch_packs() {
        let max = super::super::device::MAX_ARGS;
        let mut seen = 0;
        for (file, source) in super::SOURCES {
            for (name, count) in kernel_parameters(source) {
                seen += 1;
                assert!(
                    count <= max,
                    "{file}: kernel {name} takes {count} arguments; a launch packs at most {max}"
                );
            }
        }
        assert!(
            seen >= 17,
            "found only {seen} kernels: the parser missed some"
        );
        // The parser itself, on a declaration shaped like the macros' and one over the limit.
        let probe = "extern \"C\" __global__ void __launch_bounds__(4 * 32) \\\n    k(const T<a, b>* x, u32 n) {}\n\
                     __global__ void wide(int a, int b, int c, int d, int e, int f, int g, int h, \
                     int i, int j, int k, int l, int m, int n, int o, int p, int q, int r, int s, \
                     int t, int u, int v, int w, int x, int y) {}";
        assert_eq!(
            kernel_parameters(probe),
            vec![("k".to_string(), 2), ("wide".to_string(), 25)]
        );
    }

    /// Runs where NVRTC is installed, GPU or not: a syntax check of every kernel. With
    /// `PTX_OUT=FILE` the PTX is written there, for `ptxas -v` to report registers and spills.
    #[test]
    #[ignore = "needs NVRTC (libnvrtc on the library path)"]
    fn kernels_compile_for_hopper() {
        let ptx = super::compile("sm_90").unwrap();
        if let Some(path) = std::env::var_os("PTX_OUT") {
            std::fs::write(path, ptx.to_src()).unwrap();
        }
    }
}
