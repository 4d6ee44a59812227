//! Matrix products through cuBLAS: bf16 inputs, fp32 accumulation.
//!
//! Weights are stored as checkpoints store them, row-major `[out, in]`, and activations as
//! row-major `[tokens, in]`, so `y = x · Wᵀ` is, in cuBLAS's column-major terms,
//! `Y[out, tokens] = Wᵀ[out, in] · X[in, tokens]`: one `GemmEx` with the weight transposed.
//! Projections write bf16; the vocabulary projection writes f32 logits. The handle has its own
//! workspace so that calls can be captured into CUDA graphs.
//!
//! cuBLAS's default algorithm serves the skinny products of decode steps poorly (H200, 8B shape,
//! batch 64: the q/k/v projection at 3.1 TB/s, its 96 tiles on 132 multiprocessors, the output
//! projection at 2.5). [`Gemm::tune`] times cuBLASLt's candidate algorithms for the shapes the
//! decode graphs run, once at start-up, and those products then run the fastest one where it
//! beats the default; every other shape (prefill's, whose token counts vary) keeps `GemmEx`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{self, cublasOperation_t, cudaDataType};
use cudarc::cublaslt::{result as lt, sys as lt_sys};
use cudarc::driver::CudaStream;
use half::bf16;

use super::device::{DPtr, Device, DeviceBuffer};
use crate::error::{EngineError, Result};

/// cuBLAS's workspace; 32 MiB is what it asks for on Hopper.
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// cuBLASLt candidates timed for each shape.
const CANDIDATES: usize = 16;
/// A candidate replaces the default only if it is at least this much faster (timing noise).
const TUNED_MIN_GAIN: f64 = 0.03;

pub struct Gemm {
    blas: CudaBlas,
    lt: lt_sys::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    workspace: DeviceBuffer,
    tuned: HashMap<Key, Tuned>,
    /// The FP8 products' descriptors and algorithms, by shape, made on first use.
    fp8: RefCell<HashMap<Key, LtProduct>>,
}

// SAFETY: the cuBLASLt handle and the descriptors in `tuned` are only used through `&self` /
// `&mut self` by the backend that owns this, one thread at a time (the CUDA backend moves
// between threads but is never shared); cuBLASLt handles are not tied to a thread.
unsafe impl Send for Gemm {}

/// The shape of `y[tokens, out] = x[tokens, in] · w[out, in]ᵀ`.
#[derive(Debug, Clone, Copy)]
pub struct Linear {
    pub tokens: usize,
    pub in_features: usize,
    pub out_features: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    tokens: usize,
    in_features: usize,
    out_features: usize,
    f32_out: bool,
}

impl Key {
    fn new(s: Linear, y_type: cudaDataType) -> Self {
        Key {
            tokens: s.tokens,
            in_features: s.in_features,
            out_features: s.out_features,
            f32_out: y_type == cudaDataType::CUDA_R_32F,
        }
    }
}

/// A product's cuBLASLt descriptors and the algorithm it runs: `y[tokens, out] =
/// x[tokens, in] · w[out, in]ᵀ` with the weight transposed by the product.
struct LtProduct {
    desc: lt_sys::cublasLtMatmulDesc_t,
    /// The weight `[in, out]` (column-major, transposed by the product), x `[in, tokens]`, y
    /// `[out, tokens]`.
    layouts: [lt_sys::cublasLtMatrixLayout_t; 3],
    algo: lt_sys::cublasLtMatmulAlgo_t,
}

impl LtProduct {
    /// Descriptors for operands of type `operand` and output of `y_type`, f32 accumulation;
    /// no algorithm chosen yet.
    fn new(s: Linear, operand: lt_sys::cudaDataType, y_type: lt_sys::cudaDataType) -> Result<Self> {
        let desc = lt::create_matmul_desc(
            lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lt_sys::cudaDataType::CUDA_R_32F,
        )?;
        let mut product = LtProduct {
            desc,
            layouts: [std::ptr::null_mut(); 3],
            algo: lt_sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        let (m, n, k) = (s.out_features as u64, s.tokens as u64, s.in_features as u64);
        product.layouts = [
            lt::create_matrix_layout(operand, k, m, k as i64)?,
            lt::create_matrix_layout(operand, k, n, k as i64)?,
            lt::create_matrix_layout(y_type, m, n, m as i64)?,
        ];
        // SAFETY: TRANSA is an i32, as cuBLASLt documents it.
        unsafe {
            set_attribute(
                desc,
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &1i32,
            )?
        };
        Ok(product)
    }

    /// Up to `n` algorithms cuBLASLt proposes for the descriptors as they are set, fastest
    /// first by its own estimate, each within the workspace.
    fn candidates(
        &self,
        handle: lt_sys::cublasLtHandle_t,
        n: usize,
    ) -> Result<Vec<lt_sys::cublasLtMatmulAlgo_t>> {
        let pref = lt::create_matmul_pref()?;
        let workspace = WORKSPACE_BYTES;
        let mut results =
            vec![std::mem::MaybeUninit::<lt_sys::cublasLtMatmulHeuristicResult_t>::zeroed(); n];
        let mut count = 0i32;
        let [wl, xl, yl] = self.layouts;
        // SAFETY: the descriptors are live; `results` holds `n` entries.
        let status = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&workspace as *const usize).cast(),
                std::mem::size_of::<usize>(),
            )
            .and_then(|()| {
                lt_sys::cublasLtMatmulAlgoGetHeuristic(
                    handle,
                    self.desc,
                    wl,
                    xl,
                    yl,
                    yl,
                    pref,
                    n as i32,
                    results.as_mut_ptr().cast(),
                    &mut count,
                )
                .result()
            })
        };
        // SAFETY: created above.
        unsafe { lt::destroy_matmul_pref(pref)? };
        status?;
        Ok(results[..count.clamp(0, n as i32) as usize]
            .iter()
            // SAFETY: cuBLASLt wrote the first `count` entries.
            .map(|r| unsafe { r.assume_init() })
            .filter(|r| r.state == lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .filter(|r| r.workspaceSize <= WORKSPACE_BYTES)
            .map(|r| r.algo)
            .collect())
    }

    /// An FP8 product (bf16 output): both operands e4m3, each output scaled by its weight
    /// row's and its token's scales (cuBLASLt's outer-vector scaling, cuBLAS 12.9 and newer on
    /// sm_90), with cuBLASLt's first choice of algorithm; fast accumulation (as inference
    /// engines run FP8 products) unless no algorithm takes it with these scales.
    ///
    /// The scale vectors' addresses are set before the first query: a vector scale mode has
    /// no default (a scalar mode's null pointer means 1), and cuBLASLt answers
    /// `CUBLAS_STATUS_INVALID_VALUE` to a heuristic query without them.
    fn fp8(
        handle: lt_sys::cublasLtHandle_t,
        s: Linear,
        (w_scales, x_scales): (DPtr<f32>, DPtr<f32>),
    ) -> Result<Self> {
        let e4m3 = lt_sys::cudaDataType::CUDA_R_8F_E4M3;
        let mut product = LtProduct::new(s, e4m3, lt_sys::cudaDataType::CUDA_R_16BF)?;
        use lt_sys::cublasLtMatmulDescAttributes_t as Attr;
        let outer =
            lt_sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F as i32;
        // SAFETY: the scale modes are i32s, as cuBLASLt documents them.
        unsafe {
            set_attribute(
                product.desc,
                Attr::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                &outer,
            )?;
            set_attribute(
                product.desc,
                Attr::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                &outer,
            )?;
        }
        product.set_scales(w_scales, x_scales)?;
        let mut refusals = Vec::new();
        for fast in [1i8, 0] {
            // SAFETY: FAST_ACCUM is an i8.
            unsafe { set_attribute(product.desc, Attr::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast)? };
            match product.candidates(handle, 1) {
                Ok(algos) if !algos.is_empty() => {
                    if fast == 0 {
                        tracing::warn!(
                            "cuBLASLt's FP8 products of {s:?} accumulate without fast \
                             accumulation ({})",
                            refusals.join("; ")
                        );
                    }
                    product.algo = algos[0];
                    return Ok(product);
                }
                Ok(_) => refusals.push(format!("fast accumulation {fast}: no algorithm")),
                Err(e) => refusals.push(format!("fast accumulation {fast}: {e}")),
            }
        }
        Err(EngineError::Quantization(format!(
            "cuBLASLt has no FP8 product of {} tokens by [{} x {}] with a scale per row and \
             per token ({}) (README: FP8 weights)",
            s.tokens,
            s.out_features,
            s.in_features,
            refusals.join("; ")
        )))
    }

    /// Points an FP8 product at its weight rows' scales (cuBLASLt's A) and its tokens' (B).
    fn set_scales(&self, w_scales: DPtr<f32>, x_scales: DPtr<f32>) -> Result<()> {
        use lt_sys::cublasLtMatmulDescAttributes_t as Attr;
        let (w_scales, x_scales) = (w_scales.raw(), x_scales.raw());
        // SAFETY: the scale pointers are device addresses (`void *` attributes).
        unsafe {
            set_attribute(
                self.desc,
                Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                &w_scales,
            )?;
            set_attribute(
                self.desc,
                Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                &x_scales,
            )?;
        }
        Ok(())
    }
}

impl Drop for LtProduct {
    fn drop(&mut self) {
        // SAFETY: created in `LtProduct::new`, used by nothing else; null layouts were never
        // made.
        unsafe {
            for layout in self.layouts {
                if !layout.is_null() {
                    let _ = lt::destroy_matrix_layout(layout);
                }
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// A tuned bf16 product: its descriptors and kept algorithm, and whether a launch of it has
/// been refused (reported once).
struct Tuned {
    product: LtProduct,
    refused: std::sync::atomic::AtomicBool,
}

/// Sets one cuBLASLt descriptor attribute to `value`.
///
/// # Safety
///
/// `T` must be the attribute's documented type.
unsafe fn set_attribute<T>(
    desc: lt_sys::cublasLtMatmulDesc_t,
    attribute: lt_sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<()> {
    // SAFETY: `value` is a live `T`, of the size passed (the caller vouches for the type).
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attribute,
            (value as *const T).cast(),
            std::mem::size_of::<T>(),
        )?
    };
    Ok(())
}

/// µs a product takes, run on `weights` in turn (every layer's, as a step reads them): two
/// warm-up runs, then at least ten from where the warm-up left off.
fn time_over<W: Copy>(
    device: &Device,
    weights: &[W],
    run: impl Fn(W) -> Result<()>,
) -> Result<f64> {
    const WARM: usize = 2;
    let reps = weights.len().max(10);
    let mut next = weights.iter().cycle();
    for &w in next.by_ref().take(WARM) {
        run(w)?;
    }
    device.synchronize()?;
    let started = Instant::now();
    for &w in next.take(reps) {
        run(w)?;
    }
    device.synchronize()?;
    Ok(started.elapsed().as_secs_f64() * 1e6 / reps as f64)
}

/// What [`Gemm::tune`] found for one shape: µs a product with the default and with the best
/// cuBLASLt candidate (`None`: none ran), and whether that candidate is kept.
#[derive(Debug, Clone, Copy)]
pub struct TuneResult {
    pub shape: Linear,
    pub default_us: f64,
    pub best_us: Option<f64>,
    pub kept: bool,
}

impl Gemm {
    pub fn new(device: &Arc<Device>) -> Result<Self> {
        device.bind()?;
        let blas = CudaBlas::new(device.stream().clone())?;
        let workspace = DeviceBuffer::alloc(device, WORKSPACE_BYTES, "the cuBLAS workspace")?;
        // SAFETY: the workspace outlives the handle (both are fields of `self`, the handle
        // dropped first).
        unsafe {
            sys::cublasSetWorkspace_v2(*blas.handle(), workspace.ptr::<u8>().raw(), WORKSPACE_BYTES)
                .result()?
        };
        Ok(Gemm {
            blas,
            lt: lt::create_handle()?,
            stream: device.stream().clone(),
            workspace,
            tuned: HashMap::new(),
            fp8: RefCell::new(HashMap::new()),
        })
    }

    /// `y = x · wᵀ` in bf16 from e4m3 operands: `x` `[tokens, in]` with a scale a token in
    /// `x_scales`, `w` `[out, in]` with a scale a row in `w_scales` (see
    /// [`super::kernels::Kernels::quantize_rows_e4m3`]). A shape's descriptors are made on its
    /// first product (a host call, safe while a graph is captured) and kept.
    pub fn linear_fp8(
        &self,
        x: DPtr<u8>,
        x_scales: DPtr<f32>,
        w: DPtr<u8>,
        w_scales: DPtr<f32>,
        y: DPtr<bf16>,
        shape: Linear,
    ) -> Result<()> {
        let key = Key::new(shape, cudaDataType::CUDA_R_16BF);
        let mut products = self.fp8.borrow_mut();
        let product = match products.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(LtProduct::fp8(self.lt, shape, (w_scales, x_scales))?)
            }
        };
        product.set_scales(w_scales, x_scales)?;
        self.matmul(product, x, w, y.cast())
    }

    /// `y = x · wᵀ` in bf16.
    pub fn linear(&self, x: DPtr<bf16>, w: DPtr<bf16>, y: DPtr<bf16>, shape: Linear) -> Result<()> {
        self.gemm(x, w, y.cast(), cudaDataType::CUDA_R_16BF, shape)
    }

    /// `y = x · wᵀ` with f32 output (the logits).
    pub fn linear_f32(
        &self,
        x: DPtr<bf16>,
        w: DPtr<bf16>,
        y: DPtr<f32>,
        shape: Linear,
    ) -> Result<()> {
        self.gemm(x, w, y.cast(), cudaDataType::CUDA_R_32F, shape)
    }

    /// [`Gemm::tune`] for FP8 products: for each of `shapes` (bf16 output), on its weights in
    /// turn (e4m3 values and their rows' scales), times cuBLASLt's first choice against its
    /// other candidates and keeps the fastest where it is `TUNED_MIN_GAIN` faster. `x` holds
    /// at least `tokens · in` bytes and `x_scales` `tokens` floats, `y` `tokens · out`
    /// elements; their values do not matter. Not while a graph is captured.
    #[allow(clippy::type_complexity)]
    pub fn tune_fp8(
        &mut self,
        device: &Device,
        shapes: &[(Linear, Vec<(DPtr<u8>, DPtr<f32>)>)],
        (x, x_scales): (DPtr<u8>, DPtr<f32>),
        y: DPtr<bf16>,
    ) -> Result<Vec<TuneResult>> {
        let mut results = Vec::with_capacity(shapes.len());
        for (shape, weights) in shapes {
            let (shape, weights) = (*shape, weights.as_slice());
            assert!(!weights.is_empty(), "no weights to tune {shape:?} on");
            let key = Key::new(shape, cudaDataType::CUDA_R_16BF);
            self.fp8.get_mut().remove(&key);
            // Made with cuBLASLt's first choice, the one an untuned product runs.
            self.linear_fp8(x, x_scales, weights[0].0, weights[0].1, y, shape)?;
            let time = |gemm: &Gemm| {
                time_over(device, weights, |(w, scales)| {
                    gemm.linear_fp8(x, x_scales, w, scales, y, shape)
                })
            };
            let default_us = time(self)?;
            let product = &self.fp8.get_mut()[&key];
            let (first, candidates) = (product.algo, product.candidates(self.lt, CANDIDATES)?);
            let mut best: Option<(f64, lt_sys::cublasLtMatmulAlgo_t)> = None;
            for algo in candidates.into_iter().skip(1) {
                self.fp8.get_mut().get_mut(&key).expect("kept").algo = algo;
                // A candidate cuBLASLt proposes may still refuse to run: skip it.
                let Ok(us) = time(self) else { continue };
                if best.is_none_or(|(b, _)| us < b) {
                    best = Some((us, algo));
                }
            }
            let kept = best.is_some_and(|(us, _)| us < default_us * (1.0 - TUNED_MIN_GAIN));
            let algo = match (kept, best) {
                (true, Some((_, algo))) => algo,
                _ => first,
            };
            self.fp8.get_mut().get_mut(&key).expect("kept").algo = algo;
            results.push(TuneResult {
                shape,
                default_us,
                best_us: best.map(|(us, _)| us),
                kept,
            });
        }
        Ok(results)
    }

    /// Times the default product and cuBLASLt's candidates for each of `shapes` (bf16 output)
    /// on the given operands (`x` of at least `tokens · in` elements, each of the shape's
    /// weights `w` of `out · in`, `y` of `tokens · out`; their values do not matter), and keeps
    /// the fastest candidate of each shape that beats the default by `TUNED_MIN_GAIN`. Not
    /// while a graph is captured.
    ///
    /// A shape's runs go through its weights in turn (every layer's, as a step reads them): on
    /// one layer's weights alone, matrices that fit the L2 cache (an 8B model's q/k/v
    /// projection, 50 MB) are timed from it, which a step never gives them.
    pub fn tune(
        &mut self,
        device: &Device,
        shapes: &[(Linear, Vec<DPtr<bf16>>)],
        x: DPtr<bf16>,
        y: DPtr<bf16>,
    ) -> Result<Vec<TuneResult>> {
        self.tune_keeping(device, shapes, x, y, TUNED_MIN_GAIN)
    }

    /// [`Gemm::tune`], keeping a candidate `min_gain` faster than the default (any with
    /// `f64::NEG_INFINITY`: what the kernel tests use to check the cuBLASLt path).
    pub fn tune_keeping(
        &mut self,
        device: &Device,
        shapes: &[(Linear, Vec<DPtr<bf16>>)],
        x: DPtr<bf16>,
        y: DPtr<bf16>,
        min_gain: f64,
    ) -> Result<Vec<TuneResult>> {
        let bf16_out = cudaDataType::CUDA_R_16BF;
        let mut results = Vec::with_capacity(shapes.len());
        for (shape, weights) in shapes {
            let (shape, weights) = (*shape, weights.as_slice());
            assert!(!weights.is_empty(), "no weights to tune {shape:?} on");
            let key = Key::new(shape, bf16_out);
            self.tuned.remove(&key);
            let default_us = time_over(device, weights, |w| {
                self.gemm_ex(x, w, y.cast(), bf16_out, shape)
            })?;
            let bf16 = lt_sys::cudaDataType::CUDA_R_16BF;
            let mut product = LtProduct::new(shape, bf16, bf16)?;
            let mut best: Option<(f64, lt_sys::cublasLtMatmulAlgo_t)> = None;
            for algo in product.candidates(self.lt, CANDIDATES)? {
                product.algo = algo;
                let run = |w: DPtr<bf16>| self.matmul(&product, x.cast(), w.cast(), y.cast());
                // A candidate cuBLASLt proposes may still refuse to run: skip it.
                let Ok(us) = time_over(device, weights, run) else {
                    continue;
                };
                if best.is_none_or(|(b, _)| us < b) {
                    best = Some((us, algo));
                }
            }
            let kept = best.is_some_and(|(us, _)| us < default_us * (1.0 - min_gain));
            if let (true, Some((_, algo))) = (kept, best) {
                product.algo = algo;
                let refused = Default::default();
                self.tuned.insert(key, Tuned { product, refused });
            }
            results.push(TuneResult {
                shape,
                default_us,
                best_us: best.map(|(us, _)| us),
                kept,
            });
        }
        Ok(results)
    }

    fn gemm(
        &self,
        x: DPtr<bf16>,
        w: DPtr<bf16>,
        y: DPtr<u8>,
        y_type: cudaDataType,
        s: Linear,
    ) -> Result<()> {
        let Some(tuned) = self.tuned.get(&Key::new(s, y_type)) else {
            return self.gemm_ex(x, w, y, y_type, s);
        };
        // Should cuBLASLt refuse to launch an algorithm that tuning ran (a tuned product failed
        // to launch once, in a run of four test backends in one process, cause not found), the
        // product runs on cuBLAS's default, which computes the same product; reported once.
        self.matmul(&tuned.product, x.cast(), w.cast(), y)
            .or_else(|e| {
                if !tuned
                    .refused
                    .swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    tracing::warn!(
                        "the tuned cuBLASLt algorithm for {s:?} did not launch ({e}); that product \
                     runs on cuBLAS's default algorithm instead"
                    );
                }
                self.gemm_ex(x, w, y, y_type, s)
            })
    }

    /// The product through cuBLASLt with `product`'s descriptors and algorithm (any scale
    /// pointers set on them already).
    fn matmul(&self, product: &LtProduct, x: DPtr<u8>, w: DPtr<u8>, y: DPtr<u8>) -> Result<()> {
        let (alpha, beta) = (1f32, 0f32);
        let [wl, xl, yl] = product.layouts;
        // SAFETY: the layouts describe the callers' buffers (see `tune`, `gemm` and
        // `linear_fp8`); the workspace is this handle's and the stream is the device's, the
        // cuBLAS handle's too.
        unsafe {
            lt::matmul(
                self.lt,
                product.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                w.raw() as *const _,
                wl,
                x.raw() as *const _,
                xl,
                y.raw() as *const _,
                yl,
                y.raw() as *mut _,
                yl,
                &product.algo,
                self.workspace.ptr::<u8>().raw() as *mut _,
                WORKSPACE_BYTES,
                self.stream.cu_stream() as *mut _,
            )?;
        }
        Ok(())
    }

    fn gemm_ex(
        &self,
        x: DPtr<bf16>,
        w: DPtr<bf16>,
        y: DPtr<u8>,
        y_type: cudaDataType,
        s: Linear,
    ) -> Result<()> {
        let (alpha, beta) = (1f32, 0f32);
        let (m, n, k) = (s.out_features as i32, s.tokens as i32, s.in_features as i32);
        // SAFETY: the callers' buffers hold `[out, in]`, `[tokens, in]` and `[tokens, out]`
        // elements of the stated types.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                m,
                n,
                k,
                (&alpha as *const f32).cast(),
                w.raw(),
                cudaDataType::CUDA_R_16BF,
                k,
                x.raw(),
                cudaDataType::CUDA_R_16BF,
                k,
                (&beta as *const f32).cast(),
                y.raw(),
                y_type,
                m,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        self.tuned.clear();
        self.fp8.get_mut().clear();
        // SAFETY: created in `Gemm::new`; its descriptors were dropped just above.
        unsafe {
            let _ = lt::destroy_handle(self.lt);
        }
    }
}
