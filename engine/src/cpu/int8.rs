//! Products of weights in the GGUF's Q4_1 and Q8_0 blocks with input rows quantized to 8 bits,
//! multiplied in integers, as llama.cpp multiplies the same files.
//!
//! [`super::matmul`] widens every weight to f32 before its multiply-add, which keeps a product
//! bit for bit the product of the dequantized matrix but costs a decode step about twice the
//! instructions it costs here (unpack, widen, scale and offset each weight, then multiply). Here
//! each input row is cut into blocks of 32 values, each block quantized to signed bytes with a
//! scale of its own ([`Q8Rows`]), and a weight block times an input block is 32 byte products
//! summed in integers: `vpmaddubsw` and `vpmaddwd` on AVX2, 32 products an instruction where
//! the f32 path's fused multiply-add has 8.
//!
//! # The arithmetic, exactly
//!
//! An input block `x[0..32]` becomes `d = amax / 127`, `q_j = round(x_j · (127 / amax))`
//! (ties to even, within ±127), `s = d · Σ q_j`; a block of zeros is all zeros. For a weight
//! row and an input row, eight f32 lanes start at zero; for every block `b` in order, lane `l`
//! adds `p_l · (d_w · d_x)` with one fused multiply-add, where `p_l` is the exact integer sum
//! of the four products of values `4l..4l + 4`. The lanes are then summed by the fixed tree
//! of [`reduce8`]; Q4_1 adds `Σ_b m_w · s_x` (its blocks' minima, one fused multiply-add a
//! block, in order) last. Every instruction set computes exactly this, so the result does not
//! depend on the instruction set, the tile an output falls in or the rows beside it: products
//! stay batch-invariant, and a verification's rows are the bits of one-token steps, as
//! [`super::matmul`]'s are.
//!
//! # What it costs, and where it pays
//!
//! Each input value moves by at most half a step of its block's scale, `amax / 254`: products
//! differ from those of the dequantized matrix by about 0.4% of an output's size (the tests
//! bound it). On SmolLM2-135M-Instruct in its Q4_1 blocks the logits move by 0.09–0.37 RMS
//! (logits of RMS 13–17), about 4× what the bf16 conversion of the same file moves them, which
//! is enough to change a near tie: the exact products stay the default and this is
//! `[engine] quantization = "int8"` (`engine/tests/cpu_blocks.rs`, README).
//!
//! Without VNNI a block's products (byte products, their pairwise sums, the conversion and the
//! scaled add) cost about what the f32 path's four fused multiply-adds cost once its weights
//! are widened: the gain is in the instructions and bytes a weight costs where a step is bound
//! by them (decode of a few rows: 2 AVX2 cores, batch 1 +36–42%,
//! batch 2 +65%), and a loss where it is bound by arithmetic (16 rows and more −10%, prefill
//! −15%; BENCHMARKS.md).

use half::f16;
use rayon::prelude::*;

use super::blocks::{BlockQ4_1, BlockQ8_0};
use super::matmul::{Isa, OutPtr};

/// Values a quantized input block holds, as a weight block does.
pub const BLOCK: usize = 32;

/// A weight block type the integer products read.
pub trait IntBlock: Copy + Send + Sync + 'static {
    /// Whether its values are offset by a minimum (`d · q + m`).
    const HAS_MIN: bool;

    fn scale(&self) -> f16;

    /// The minimum `m`, zero for a type without one.
    fn min(&self) -> f16;

    /// The 32 values, one a byte in order, as [`IntBlock::load_avx2`] loads them (a signed
    /// value as its two's-complement byte).
    fn unpack(&self) -> [u8; BLOCK];

    /// The 32 values, one a byte in order (unsigned 0..16 for Q4_1, signed for Q8_0).
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load_avx2(&self) -> std::arch::x86_64::__m256i;

    /// The eight sums `Σ_{j=4l}^{4l+3} q_j · x_j` of values loaded by
    /// [`IntBlock::load_avx2`] with 32 signed bytes `x`, in eight i32 lanes.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_avx2(
        w: std::arch::x86_64::__m256i,
        x: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i;
}

impl IntBlock for BlockQ4_1 {
    const HAS_MIN: bool = true;

    #[inline(always)]
    fn scale(&self) -> f16 {
        self.d
    }

    #[inline(always)]
    fn min(&self) -> f16 {
        self.m
    }

    fn unpack(&self) -> [u8; BLOCK] {
        std::array::from_fn(|j| {
            let byte = self.qs[j % 16];
            if j < 16 { byte & 0x0f } else { byte >> 4 }
        })
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load_avx2(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        unsafe {
            let packed = _mm_loadu_si128(self.qs.as_ptr().cast());
            // Low nibbles are values 0..16, high nibbles 16..32.
            let both = _mm256_set_m128i(_mm_srli_epi16::<4>(packed), packed);
            _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot_avx2(
        w: std::arch::x86_64::__m256i,
        x: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // Unsigned values times signed bytes: pairs of at most 2 · 15 · 127 fit an i16.
        unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)) }
    }
}

impl IntBlock for BlockQ8_0 {
    const HAS_MIN: bool = false;

    #[inline(always)]
    fn scale(&self) -> f16 {
        self.d
    }

    #[inline(always)]
    fn min(&self) -> f16 {
        f16::ZERO
    }

    fn unpack(&self) -> [u8; BLOCK] {
        self.qs.map(|v| v as u8)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load_avx2(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        unsafe { _mm256_loadu_si256(self.qs.as_ptr().cast()) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot_avx2(
        w: std::arch::x86_64::__m256i,
        x: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // Signed times signed as |w| times x with w's sign: pairs of at most 2 · 128 · 127 fit
        // an i16 (input values stay within ±127).
        unsafe {
            let magnitudes = _mm256_sign_epi8(w, w);
            let signed = _mm256_sign_epi8(x, w);
            _mm256_madd_epi16(
                _mm256_maddubs_epi16(magnitudes, signed),
                _mm256_set1_epi16(1),
            )
        }
    }
}

/// Input rows quantized in blocks of [`BLOCK`] values: each block's signed bytes, its scale
/// `d` and `s = d · Σ q`.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Q8Rows {
    pub values: Vec<i8>,
    pub scales: Vec<f32>,
    pub sums: Vec<f32>,
}

impl Q8Rows {
    /// Quantizes `x` (whole rows of `k`, `k` a multiple of [`BLOCK`]) into `self`, reusing its
    /// buffers, on `isa`, which must be available.
    pub fn quantize_with(&mut self, isa: Isa, x: &[f32], k: usize) {
        assert!(isa.available(), "{isa:?} is not available on this CPU");
        assert!(k.is_multiple_of(BLOCK), "rows are whole blocks");
        assert!(x.len().is_multiple_of(k.max(1)), "x is whole rows");
        let blocks = x.len() / BLOCK;
        self.values.resize(x.len(), 0);
        self.scales.resize(blocks, 0.0);
        self.sums.resize(blocks, 0.0);
        let parts = x
            .chunks_exact(BLOCK)
            .zip(self.values.chunks_exact_mut(BLOCK))
            .zip(self.scales.iter_mut().zip(self.sums.iter_mut()));
        for ((x, q), (d, s)) in parts {
            let x: &[f32; BLOCK] = x.try_into().expect("a block");
            let q: &mut [i8; BLOCK] = q.try_into().expect("a block");
            (*d, *s) = match isa {
                // SAFETY: AVX2 is available (asserted above).
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 | Isa::Avx512 => unsafe { x86::quantize_block(x, q) },
                _ => quantize_block(x, q),
            };
        }
    }
}

/// One block: its values into `q`; returns `(d, s)`.
fn quantize_block(x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> (f32, f32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        q.fill(0);
        return (0.0, 0.0);
    }
    let inverse = 127.0 / amax;
    let mut total = 0i32;
    for (q, &v) in q.iter_mut().zip(x) {
        // Within ±127 already (|v| ≤ amax); the clamp only states it.
        let r = (v * inverse).round_ties_even().clamp(-127.0, 127.0) as i32;
        *q = r as i8;
        total += r;
    }
    let d = amax / 127.0;
    (d, d * total as f32)
}

thread_local! {
    /// The calling thread's quantized input rows, kept between products.
    static QUANTIZED: std::cell::RefCell<Q8Rows> = std::cell::RefCell::new(Q8Rows::default());
    /// Each worker's unpacked weight rows, kept between products.
    static UNPACKED: std::cell::RefCell<Unpacked> = std::cell::RefCell::new(Unpacked::default());
}

/// Weight rows per parallel task.
const TASK_ROWS: usize = 96;
/// From this many input rows on, a task unpacks its weight blocks once (values a byte each,
/// scales and minima in f32) and its tiles read those; below, the tiles unpack each block as
/// they read it, once for every three input rows. Measured on 2 AVX2 cores (SmolLM2, decode
/// tok/s unpacking from 4 / 8 rows / never): batch 4 85 / 104 / 104, batch 8 105 / 107 / 111,
/// batch 16 126 (from 8) / 117 (never), prefill of 512 tokens 172 / 180 / 135.
const UNPACK_FIRST_ROWS: usize = 12;
/// Weight rows unpacked at a time: 32 rows of 1,536 values are 48 KiB, in a core's L2.
const UNPACK_PART_ROWS: usize = 32;

/// `out[t, n] = x[t, k] · w[n, k]ᵀ` with `x` quantized, on the best instruction set.
pub fn matmul<B: IntBlock>(x: &[f32], rows: usize, k: usize, w: &[B], n: usize, out: &mut [f32]) {
    matmul_with(Isa::detect(), x, rows, k, w, n, out);
}

/// [`matmul`] on a chosen instruction set, which must be available (tests compare them).
pub fn matmul_with<B: IntBlock>(
    isa: Isa,
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[B],
    n: usize,
    out: &mut [f32],
) {
    assert!(isa.available(), "{isa:?} is not available on this CPU");
    assert_eq!(x.len(), rows * k, "x is [rows, k]");
    assert!(k.is_multiple_of(BLOCK), "rows are whole blocks");
    assert_eq!(w.len() * BLOCK, n * k, "w is [n, k]");
    assert_eq!(out.len(), rows * n, "out is [rows, n]");
    if rows == 0 || n == 0 {
        return;
    }
    QUANTIZED.with_borrow_mut(|q| {
        q.quantize_with(isa, x, k);
        product(isa, q, rows, k, w, n, out);
    });
}

/// The product over rows already quantized.
fn product<B: IntBlock>(
    isa: Isa,
    x: &Q8Rows,
    rows: usize,
    k: usize,
    w: &[B],
    n: usize,
    out: &mut [f32],
) {
    let blocks = k / BLOCK;
    assert_eq!(x.values.len(), rows * k, "x is [rows, k]");
    let out_ptr = OutPtr(out.as_mut_ptr());
    let unpack_first = rows >= UNPACK_FIRST_ROWS;
    (0..n.div_ceil(TASK_ROWS)).into_par_iter().for_each(|task| {
        let (first, last) = (task * TASK_ROWS, ((task + 1) * TASK_ROWS).min(n));
        if !unpack_first {
            let tile = Tile {
                x,
                w: &w[first * blocks..last * blocks],
                out: out_ptr.at(first),
                blocks,
                out_stride: n,
                rows,
                cols: last - first,
            };
            // SAFETY: the asserts above bound every row of x and w the tile reads, and
            // columns first..last of out, which only this task writes.
            unsafe { run(isa, tile) };
            return;
        }
        UNPACKED.with_borrow_mut(|unpacked| {
            for part in (first..last).step_by(UNPACK_PART_ROWS) {
                let end = (part + UNPACK_PART_ROWS).min(last);
                unpacked.fill(&w[part * blocks..end * blocks], blocks);
                // SAFETY: as above, for columns part..end.
                unsafe { run_unpacked::<B>(isa, x, unpacked, out_ptr.at(part), n, rows) };
            }
        });
    });
}

/// `rows` quantized input rows by `cols` weight rows of `blocks` blocks each.
struct Tile<'a, B> {
    x: &'a Q8Rows,
    /// Weight rows, `blocks` blocks apart.
    w: &'a [B],
    out: *mut f32,
    blocks: usize,
    out_stride: usize,
    rows: usize,
    cols: usize,
}

/// Weight rows unpacked: `values` row by row, `scales` by row then block, `mins` (Q4_1) by
/// block then row, so that a vector of them is eight rows' minima of one block.
#[derive(Default)]
struct Unpacked {
    values: Vec<u8>,
    scales: Vec<f32>,
    mins: Vec<f32>,
    rows: usize,
    blocks: usize,
}

impl Unpacked {
    fn fill<B: IntBlock>(&mut self, w: &[B], blocks: usize) {
        let rows = w.len() / blocks;
        (self.rows, self.blocks) = (rows, blocks);
        self.values.resize(w.len() * BLOCK, 0);
        self.scales.resize(w.len(), 0.0);
        self.mins.resize(if B::HAS_MIN { w.len() } else { 0 }, 0.0);
        for (c, row) in w.chunks_exact(blocks).enumerate() {
            for (b, block) in row.iter().enumerate() {
                let at = c * blocks + b;
                self.values[at * BLOCK..(at + 1) * BLOCK].copy_from_slice(&block.unpack());
                self.scales[at] = block.scale().to_f32();
                if B::HAS_MIN {
                    self.mins[b * rows + c] = block.min().to_f32();
                }
            }
        }
    }
}

/// # Safety
/// `tile.out` must be valid for its rows and columns `out_stride` apart.
unsafe fn run<B: IntBlock>(isa: Isa, tile: Tile<'_, B>) {
    match isa {
        // AVX-512 machines have AVX2; the 256-bit products are what every x86 machine runs.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => unsafe { x86::run(tile) },
        _ => unsafe { run_portable(tile) },
    }
}

/// `rows` input rows by the unpacked weight rows, into `out` (`out_stride` apart).
///
/// # Safety
/// `out` must be valid for `rows` rows of `w.rows` outputs, `out_stride` apart.
unsafe fn run_unpacked<B: IntBlock>(
    isa: Isa,
    x: &Q8Rows,
    w: &Unpacked,
    out: *mut f32,
    out_stride: usize,
    rows: usize,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => unsafe { x86::run_unpacked::<B>(x, w, out, out_stride, rows) },
        _ => unsafe { run_unpacked_portable::<B>(x, w, out, out_stride, rows) },
    }
}

/// The fixed sum of eight lanes: `l + 4` into `l`, then `l + 2`, then lane 1 into lane 0.
#[inline(always)]
fn reduce8(v: [f32; 8]) -> f32 {
    let q: [f32; 4] = std::array::from_fn(|l| v[l] + v[l + 4]);
    let p = [q[0] + q[2], q[1] + q[3]];
    p[0] + p[1]
}

/// The reference: one output at a time, the arithmetic of the module's documentation.
///
/// # Safety
/// As [`run`].
unsafe fn run_portable<B: IntBlock>(t: Tile<'_, B>) {
    for r in 0..t.rows {
        for c in 0..t.cols {
            let row = &t.w[c * t.blocks..(c + 1) * t.blocks];
            let one = |b: usize| {
                let block = &row[b];
                (block.unpack(), block.scale().to_f32(), block.min().to_f32())
            };
            let sum = output(t.x, r, t.blocks, B::HAS_MIN, one);
            unsafe { *t.out.add(r * t.out_stride + c) = sum };
        }
    }
}

/// The reference on unpacked weights.
///
/// # Safety
/// As [`run_unpacked`].
unsafe fn run_unpacked_portable<B: IntBlock>(
    x: &Q8Rows,
    w: &Unpacked,
    out: *mut f32,
    out_stride: usize,
    rows: usize,
) {
    let nb = w.blocks;
    for r in 0..rows {
        for c in 0..w.rows {
            let one = |b: usize| {
                let at = c * nb + b;
                let values: [u8; BLOCK] = w.values[at * BLOCK..(at + 1) * BLOCK]
                    .try_into()
                    .expect("a block");
                let min = if B::HAS_MIN {
                    w.mins[b * w.rows + c]
                } else {
                    0.0
                };
                (values, w.scales[at], min)
            };
            let sum = output(x, r, nb, B::HAS_MIN, one);
            unsafe { *out.add(r * out_stride + c) = sum };
        }
    }
}

/// One output of input row `r` by a weight row whose block `b` is `block(b)`: its values one a
/// byte, its scale and minimum. The module documentation's arithmetic, spelled out.
fn output(
    x: &Q8Rows,
    r: usize,
    nb: usize,
    has_min: bool,
    block: impl Fn(usize) -> ([u8; BLOCK], f32, f32),
) -> f32 {
    let mut lanes = [0f32; 8];
    let mut mins = 0f32;
    for b in 0..nb {
        let (values, d, m) = block(b);
        let at = r * nb + b;
        let xq = &x.values[at * BLOCK..(at + 1) * BLOCK];
        let scale = d * x.scales[at];
        for (l, lane) in lanes.iter_mut().enumerate() {
            let p: i32 = (4 * l..4 * l + 4)
                .map(|j| {
                    // Q4_1's values are unsigned nibbles, Q8_0's signed bytes.
                    let w = if has_min {
                        i32::from(values[j])
                    } else {
                        i32::from(values[j] as i8)
                    };
                    w * i32::from(xq[j])
                })
                .sum();
            *lane = (p as f32).mul_add(scale, *lane);
        }
        if has_min {
            mins = m.mul_add(x.sums[at], mins);
        }
    }
    let sum = reduce8(lanes);
    if has_min { sum + mins } else { sum }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{BLOCK, IntBlock, Q8Rows, Tile, Unpacked, reduce8};

    /// One block of inputs quantized (`super::quantize_block`'s arithmetic: the product by
    /// `127 / amax` rounds to even in `vcvtps2dq`, as `round_ties_even` does).
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantize_block(x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> (f32, f32) {
        unsafe {
            let p = x.as_ptr();
            let v = [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ];
            let sign = _mm256_set1_ps(-0.0);
            let abs = |v: __m256| _mm256_andnot_ps(sign, v);
            let m = _mm256_max_ps(
                _mm256_max_ps(abs(v[0]), abs(v[1])),
                _mm256_max_ps(abs(v[2]), abs(v[3])),
            );
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
            if amax == 0.0 {
                q.fill(0);
                return (0.0, 0.0);
            }
            let inverse = _mm256_set1_ps(127.0 / amax);
            let i = v.map(|v| _mm256_cvtps_epi32(_mm256_mul_ps(v, inverse)));
            let total =
                _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
            let t4 = _mm_add_epi32(
                _mm256_castsi256_si128(total),
                _mm256_extracti128_si256(total, 1),
            );
            let t2 = _mm_add_epi32(t4, _mm_unpackhi_epi64(t4, t4));
            let total = _mm_cvtsi128_si32(t2) + _mm_extract_epi32(t2, 1);
            // Packing interleaves the 128-bit halves; the permutation puts values in order.
            let words = _mm256_packs_epi32(i[0], i[1]);
            let words2 = _mm256_packs_epi32(i[2], i[3]);
            let bytes = _mm256_packs_epi16(words, words2);
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            _mm256_storeu_si256(
                q.as_mut_ptr().cast(),
                _mm256_permutevar8x32_epi32(bytes, order),
            );
            let d = amax / 127.0;
            (d, d * total as f32)
        }
    }

    /// One input row (decode): tiles of one row by four weight rows, each block unpacked as it
    /// is read. A few rows: three by two.
    ///
    /// # Safety
    /// As [`super::run`]; the CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn run<B: IntBlock>(t: Tile<'_, B>) {
        unsafe {
            let (tile_rows, tile_cols) = if t.rows == 1 { (1, 4) } else { (3, 2) };
            for r in (0..t.rows).step_by(tile_rows) {
                for c in (0..t.cols).step_by(tile_cols) {
                    let rows = (t.rows - r).min(tile_rows);
                    let cols = (t.cols - c).min(tile_cols);
                    match (rows, cols) {
                        (1, 4) => tile::<B, 1, 4>(&t, r, c),
                        (1, 3) => tile::<B, 1, 3>(&t, r, c),
                        (3, 2) => tile::<B, 3, 2>(&t, r, c),
                        (2, 2) => tile::<B, 2, 2>(&t, r, c),
                        (3, 1) => tile::<B, 3, 1>(&t, r, c),
                        (2, 1) => tile::<B, 2, 1>(&t, r, c),
                        (1, 2) => tile::<B, 1, 2>(&t, r, c),
                        _ => tile::<B, 1, 1>(&t, r, c),
                    }
                }
            }
        }
    }

    /// An f16 widened exactly (F16C).
    #[inline(always)]
    unsafe fn widen(h: half::f16) -> f32 {
        unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h.to_bits())))) }
    }

    /// Input rows `r..r + R` by weight rows `c..c + C`.
    // Indexed loops over the const dimensions unroll into named registers.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn tile<B: IntBlock, const R: usize, const C: usize>(
        t: &Tile<'_, B>,
        r: usize,
        c: usize,
    ) {
        unsafe {
            let nb = t.blocks;
            let w = t.w.as_ptr().add(c * nb);
            let xv = t.x.values.as_ptr().add(r * nb * BLOCK);
            let xd = t.x.scales.as_ptr().add(r * nb);
            let xs = t.x.sums.as_ptr().add(r * nb);
            let mut acc = [[_mm256_setzero_ps(); C]; R];
            let mut mins = [[0f32; C]; R];
            for b in 0..nb {
                let mut wq = [_mm256_setzero_si256(); C];
                let mut wd = [0f32; C];
                let mut wm = [0f32; C];
                for j in 0..C {
                    let block = &*w.add(j * nb + b);
                    wq[j] = block.load_avx2();
                    wd[j] = widen(block.scale());
                    if B::HAS_MIN {
                        wm[j] = widen(block.min());
                    }
                }
                for i in 0..R {
                    let at = i * nb + b;
                    let x = _mm256_loadu_si256(xv.add(at * BLOCK).cast());
                    let d = *xd.add(at);
                    for j in 0..C {
                        let p = _mm256_cvtepi32_ps(B::dot_avx2(wq[j], x));
                        acc[i][j] = _mm256_fmadd_ps(p, _mm256_set1_ps(wd[j] * d), acc[i][j]);
                        if B::HAS_MIN {
                            mins[i][j] = wm[j].mul_add(*xs.add(at), mins[i][j]);
                        }
                    }
                }
            }
            for i in 0..R {
                for j in 0..C {
                    let mut lanes = [0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), acc[i][j]);
                    let mut sum = reduce8(lanes);
                    if B::HAS_MIN {
                        sum += mins[i][j];
                    }
                    *t.out.add((r + i) * t.out_stride + c + j) = sum;
                }
            }
        }
    }

    /// Input rows by unpacked weight rows in tiles of three by two, then the minima's terms,
    /// eight weight rows a vector.
    ///
    /// # Safety
    /// As [`super::run_unpacked`]; the CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn run_unpacked<B: IntBlock>(
        x: &Q8Rows,
        w: &Unpacked,
        out: *mut f32,
        out_stride: usize,
        rows: usize,
    ) {
        unsafe {
            for r in (0..rows).step_by(3) {
                for c in (0..w.rows).step_by(2) {
                    match ((rows - r).min(3), (w.rows - c).min(2)) {
                        (3, 2) => unpacked_tile::<B, 3, 2>(x, w, out, out_stride, r, c),
                        (2, 2) => unpacked_tile::<B, 2, 2>(x, w, out, out_stride, r, c),
                        (1, 2) => unpacked_tile::<B, 1, 2>(x, w, out, out_stride, r, c),
                        (3, 1) => unpacked_tile::<B, 3, 1>(x, w, out, out_stride, r, c),
                        (2, 1) => unpacked_tile::<B, 2, 1>(x, w, out, out_stride, r, c),
                        _ => unpacked_tile::<B, 1, 1>(x, w, out, out_stride, r, c),
                    }
                }
            }
            if !B::HAS_MIN {
                return;
            }
            // `sum + Σ_b m · s`, the minima's sum a fused multiply-add a block in order, for
            // eight weight rows at once.
            let (nb, n) = (w.blocks, w.rows);
            for r in 0..rows {
                let s = x.sums.as_ptr().add(r * nb);
                let o = out.add(r * out_stride);
                let mut c = 0;
                while c + 8 <= n {
                    let mut m = _mm256_setzero_ps();
                    for b in 0..nb {
                        let mins = _mm256_loadu_ps(w.mins.as_ptr().add(b * n + c));
                        m = _mm256_fmadd_ps(mins, _mm256_set1_ps(*s.add(b)), m);
                    }
                    _mm256_storeu_ps(o.add(c), _mm256_add_ps(_mm256_loadu_ps(o.add(c)), m));
                    c += 8;
                }
                for c in c..n {
                    let mut m = 0f32;
                    for b in 0..nb {
                        m = w.mins[b * n + c].mul_add(*s.add(b), m);
                    }
                    *o.add(c) += m;
                }
            }
        }
    }

    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn unpacked_tile<B: IntBlock, const R: usize, const C: usize>(
        x: &Q8Rows,
        w: &Unpacked,
        out: *mut f32,
        out_stride: usize,
        r: usize,
        c: usize,
    ) {
        unsafe {
            let nb = w.blocks;
            let k = nb * BLOCK;
            let wv = w.values.as_ptr().add(c * k);
            let wd = w.scales.as_ptr().add(c * nb);
            let xv = x.values.as_ptr().add(r * k);
            let xd = x.scales.as_ptr().add(r * nb);
            let mut acc = [[_mm256_setzero_ps(); C]; R];
            for b in 0..nb {
                let mut wq = [_mm256_setzero_si256(); C];
                let mut d = [_mm256_setzero_ps(); C];
                for j in 0..C {
                    wq[j] = _mm256_loadu_si256(wv.add(j * k + b * BLOCK).cast());
                    d[j] = _mm256_set1_ps(*wd.add(j * nb + b));
                }
                for i in 0..R {
                    let xq = _mm256_loadu_si256(xv.add(i * k + b * BLOCK).cast());
                    let dx = _mm256_set1_ps(*xd.add(i * nb + b));
                    for j in 0..C {
                        let p = _mm256_cvtepi32_ps(B::dot_avx2(wq[j], xq));
                        acc[i][j] = _mm256_fmadd_ps(p, _mm256_mul_ps(d[j], dx), acc[i][j]);
                    }
                }
            }
            for i in 0..R {
                for j in 0..C {
                    let mut lanes = [0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), acc[i][j]);
                    *out.add((r + i) * out_stride + c + j) = reduce8(lanes);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::test_data::{dequantized, file_blocks, pseudo_random};
    use crate::gguf::TensorType;

    fn isas() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|i| i.available())
            .collect()
    }

    /// A float64 product of `x` by the dequantized weights.
    fn reference(x: &[f32], rows: usize, k: usize, w: &[f32], n: usize) -> Vec<f64> {
        let mut out = vec![0f64; rows * n];
        for r in 0..rows {
            for c in 0..n {
                out[r * n + c] = (0..k)
                    .map(|i| f64::from(x[r * k + i]) * f64::from(w[c * k + i]))
                    .sum();
            }
        }
        out
    }

    /// Against the dequantized matrix in float64: within a small share of the outputs' size;
    /// every instruction set gives the same bits; every row alone gives its bits in a batch.
    fn check<B: IntBlock>(ty: TensorType, parse: fn(&[u8]) -> Vec<B>) {
        let (k, n) = (BLOCK * 18, 203);
        let bytes = file_blocks(ty, n * k / BLOCK, 31);
        let (w, wide) = (parse(&bytes), dequantized(ty, &bytes, n * k));
        for rows in [1, 2, 3, 4, 7, UNPACK_FIRST_ROWS + 1] {
            let x = pseudo_random(rows * k, 40 + rows as u32);
            let want = reference(&x, rows, k, &wide, n);
            let scale = (want.iter().map(|v| v * v).sum::<f64>() / want.len() as f64).sqrt();
            let mut first: Option<Vec<f32>> = None;
            for isa in isas() {
                let mut out = vec![f32::NAN; rows * n];
                matmul_with(isa, &x, rows, k, &w, n, &mut out);
                let errors: Vec<f64> = out
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| (f64::from(*g) - w).abs())
                    .collect();
                let worst = errors.iter().copied().fold(0f64, f64::max);
                let rms = (errors.iter().map(|e| e * e).sum::<f64>() / errors.len() as f64).sqrt();
                // Each input moves by up to half a step of amax / 127, uniformly: about 0.4%
                // of a uniform input's size, and so of an output's.
                assert!(
                    rms < 0.006 * scale && worst < 0.025 * scale,
                    "{ty:?} {isa:?} rows {rows}: off by {rms} (worst {worst}) against outputs \
                     of {scale}"
                );
                match &first {
                    None => first = Some(out),
                    Some(f) => {
                        let same = f.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{ty:?} rows {rows}: {isa:?} gives other bits");
                    }
                }
            }
            let batched = first.expect("the portable path runs everywhere");
            for r in 0..rows {
                let mut alone = vec![0f32; n];
                matmul(&x[r * k..(r + 1) * k], 1, k, &w, n, &mut alone);
                let row = &batched[r * n..(r + 1) * n];
                let same = row
                    .iter()
                    .zip(&alone)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{ty:?}: row {r} of {rows} differs from its product alone"
                );
            }
        }
    }

    #[test]
    fn q4_1_products_stay_close_and_batch_invariant() {
        check(TensorType::Q4_1, BlockQ4_1::parse);
    }

    #[test]
    fn q8_0_products_stay_close_and_batch_invariant() {
        check(TensorType::Q8_0, BlockQ8_0::parse);
    }

    #[test]
    fn input_blocks_quantize_to_their_largest_value() {
        // Block 0: a spread with its largest magnitude negative. Block 1: a scale of exactly
        // one (amax 127), so halves show the rounding: ties go to even.
        let mut x: Vec<f32> = (0..32).map(|i| (i as f32 - 20.0) * 0.25).collect();
        x.extend([127.0, 2.5, 3.5, -2.5, -0.4]);
        x.resize(96, 0.0);
        let mut q = Q8Rows::default();
        q.quantize_with(Isa::detect(), &x, 96);
        assert_eq!(q.scales, [5.0 / 127.0, 1.0, 0.0]);
        assert_eq!(
            q.values[0], -127,
            "the largest magnitude is the end of the range"
        );
        assert_eq!(&q.values[32..37], &[127, 2, 4, -2, 0]);
        assert!(q.values[64..].iter().all(|&v| v == 0), "a block of zeros");
        assert_eq!(q.sums[1], 131.0);
        assert_eq!(q.sums[2], 0.0);
        let total: i32 = q.values[..32].iter().map(|&v| i32::from(v)).sum();
        assert_eq!(q.sums[0], q.scales[0] * total as f32);
        for (b, block) in x.chunks_exact(BLOCK).enumerate() {
            for (j, v) in block.iter().enumerate() {
                let back = f32::from(q.values[b * BLOCK + j]) * q.scales[b];
                assert!((back - v).abs() <= q.scales[b] * 0.5 + 1e-6, "{b} {j}");
            }
        }
    }

    #[test]
    fn every_instruction_set_quantizes_to_the_same_bytes() {
        let mut x = pseudo_random(32 * 40, 77);
        x[32..64].fill(0.0);
        x[70] = 1e-30;
        for (i, v) in x[96..128].iter_mut().enumerate() {
            // With a largest value of 127 the step is 1: halves are the rounding's ties.
            *v = (i as f32 - 16.0) * 0.5;
        }
        x[127] = 127.0;
        let mut first: Option<Q8Rows> = None;
        for isa in isas() {
            let mut q = Q8Rows::default();
            q.quantize_with(isa, &x, 32 * 8);
            match &first {
                None => first = Some(q),
                Some(f) => assert_eq!(f, &q, "{isa:?}"),
            }
        }
    }

    #[test]
    fn the_largest_products_do_not_saturate() {
        // Q8_0 values of -128 (the one value without a positive twin) and inputs of ±127:
        // pairs of 2 · 128 · 127 must not clip in the 16-bit step.
        let mut bytes = Vec::new();
        bytes.extend(f16::from_f32(1.0).to_le_bytes());
        bytes.extend([0x80u8; 32]);
        let w = BlockQ8_0::parse(&bytes);
        let x = vec![-1.0f32; 32];
        for isa in isas() {
            let mut out = [0f32];
            matmul_with(isa, &x, 1, 32, &w, 1, &mut out);
            assert!((out[0] - 4096.0).abs() < 1e-2, "{isa:?}: {}", out[0]);
        }
        // Q4_1's largest value, 15, against +127.
        let mut bytes = Vec::new();
        bytes.extend(f16::from_f32(1.0).to_le_bytes());
        bytes.extend(f16::from_f32(0.0).to_le_bytes());
        bytes.extend([0xffu8; 16]);
        let w = BlockQ4_1::parse(&bytes);
        let x = vec![2.0f32; 32];
        for isa in isas() {
            let mut out = [0f32];
            matmul_with(isa, &x, 1, 32, &w, 1, &mut out);
            assert!((out[0] - 960.0).abs() < 1e-3, "{isa:?}: {}", out[0]);
        }
    }
}
