//! Batch-invariant matrix products: `out[t, n] = x[t, k] · w[n, k]ᵀ`.
//!
//! Every output element is computed the same way whatever the number of rows in the call, the
//! tile it falls in, or the instruction set: 16 lanes, lane `l` accumulating `x[i]·w[i]` with a
//! fused multiply-add for every `i ≡ l (mod 16)` in increasing `i`, the lanes then summed by a
//! fixed pairwise tree, and any tail of `k % 16` elements added in order afterwards. So a
//! sequence's logits do not depend on what else shares its step: decoding alone or in a batch
//! of 64, prefilling in one step or in chunks, restoring a snapshot or recomputing it, all give
//! bit-identical results. The `gemm` crate's blocking changes the summation order with the
//! shape, which would make batched outputs drift from solo ones at near-ties; this is why the
//! CPU backend has its own product.
//!
//! Work is split over the current rayon pool by blocks of weight rows; inside a block, tiles of
//! up to 4 input rows by up to 4 (AVX-512) or 2 (AVX2) weight rows keep their accumulators in
//! registers, so each weight row is read once per 4 input rows.

use half::bf16;
use rayon::prelude::*;

/// A type weights are stored in: one element (f32, bf16) or a block of 32 (the GGUF's Q4_1 and
/// Q8_0). Each weight is widened to f32 exactly before its multiply-add, so a product with
/// narrow or quantized weights is bit-identical to the same product with those weights widened
/// to f32 first: only the bytes read differ.
///
/// Rows are addressed by a pointer to their first unit and elements by their index in the row.
pub trait Weight: Copy + Send + Sync + 'static {
    /// Elements one unit holds; a row's length must be a multiple of it.
    const ELEMENTS: usize;

    /// Element `i` of the row at `row`, widened.
    ///
    /// # Safety
    /// `row` valid for a row holding element `i`.
    unsafe fn get(row: *const Self, i: usize) -> f32;

    /// Elements `i..i + 16` (`i` a multiple of 16) as two registers of eight f32 lanes.
    ///
    /// # Safety
    /// `row` valid for a row holding those elements; the CPU must have AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16_avx2(
        row: *const Self,
        i: usize,
    ) -> (std::arch::x86_64::__m256, std::arch::x86_64::__m256);

    /// Elements `i..i + 32` (`i` a multiple of 32) as four registers of eight f32 lanes; block
    /// types override it to unpack their block once.
    ///
    /// # Safety
    /// As [`Weight::load16_avx2`].
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load32_avx2(row: *const Self, i: usize) -> [std::arch::x86_64::__m256; 4] {
        unsafe {
            let (a, b) = Self::load16_avx2(row, i);
            let (c, d) = Self::load16_avx2(row, i + 16);
            [a, b, c, d]
        }
    }

    /// Elements `i..i + 16` (`i` a multiple of 16) as sixteen f32 lanes.
    ///
    /// # Safety
    /// `row` valid for a row holding those elements; the CPU must have AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(row: *const Self, i: usize) -> std::arch::x86_64::__m512;
}

impl Weight for f32 {
    const ELEMENTS: usize = 1;

    #[inline(always)]
    unsafe fn get(row: *const f32, i: usize) -> f32 {
        unsafe { *row.add(i) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16_avx2(
        row: *const f32,
        i: usize,
    ) -> (std::arch::x86_64::__m256, std::arch::x86_64::__m256) {
        use std::arch::x86_64::*;
        unsafe { (_mm256_loadu_ps(row.add(i)), _mm256_loadu_ps(row.add(i + 8))) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(row: *const f32, i: usize) -> std::arch::x86_64::__m512 {
        unsafe { std::arch::x86_64::_mm512_loadu_ps(row.add(i)) }
    }
}

impl Weight for bf16 {
    const ELEMENTS: usize = 1;

    #[inline(always)]
    unsafe fn get(row: *const bf16, i: usize) -> f32 {
        unsafe { (*row.add(i)).to_f32() }
    }

    /// bf16 is the high half of an f32: widen each 16-bit word and shift it up.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16_avx2(
        row: *const bf16,
        i: usize,
    ) -> (std::arch::x86_64::__m256, std::arch::x86_64::__m256) {
        use std::arch::x86_64::{
            _mm_loadu_si128, _mm256_castsi256_ps, _mm256_cvtepu16_epi32, _mm256_slli_epi32,
        };
        unsafe {
            let widen = |p: *const bf16| {
                let words = _mm_loadu_si128(p.cast());
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(words)))
            };
            (widen(row.add(i)), widen(row.add(i + 8)))
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(row: *const bf16, i: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        unsafe {
            let words = _mm256_loadu_si256(row.add(i).cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(words)))
        }
    }
}

const LANES: usize = 16;
/// Weight rows per parallel task.
const BLOCK_ROWS: usize = 96;
/// From this many input rows on, a task widens its quantized weight rows to f32 once and
/// multiplies those: widening in the tiles would repeat it for every pair of input rows.
const WIDEN_FIRST_ROWS: usize = 4;
/// Weight rows widened at a time: 24 rows of 1,536 f32 weights are 144 KiB, under a core's L2
/// (the 96 rows of a task would be 576 KiB, read from L3 once per four input rows).
const WIDEN_PART_ROWS: usize = 24;

thread_local! {
    /// Each thread's widened weight rows, kept between products: a fresh buffer of 24 rows of
    /// 1,536 weights (144 KiB) is above the allocator's threshold for mapping pages of its own,
    /// so allocating one per part mapped, faulted in and unmapped it every time.
    static WIDENED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The instruction set a product runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
    Portable,
}

impl Isa {
    /// The best one this CPU has.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Whether this CPU can run `self`.
    pub fn available(self) -> bool {
        match self {
            Isa::Portable => true,
            Isa::Avx2 => Isa::detect() != Isa::Portable,
            Isa::Avx512 => Isa::detect() == Isa::Avx512,
        }
    }
}

/// Pointers into one tile: `rows` input rows and `cols` weight rows, all `k` long
/// (`w_stride` counts the weight type's units, not elements).
#[derive(Clone, Copy)]
struct Tile<W> {
    x: *const f32,
    w: *const W,
    out: *mut f32,
    k: usize,
    x_stride: usize,
    w_stride: usize,
    out_stride: usize,
    rows: usize,
    cols: usize,
}

impl<W> Tile<W> {
    /// # Safety
    /// `r` and `c` within the tile.
    #[inline(always)]
    unsafe fn x_row(&self, r: usize) -> *const f32 {
        unsafe { self.x.add(r * self.x_stride) }
    }

    /// # Safety
    /// As [`Tile::x_row`].
    #[inline(always)]
    unsafe fn w_row(&self, c: usize) -> *const W {
        unsafe { self.w.add(c * self.w_stride) }
    }

    /// # Safety
    /// As [`Tile::x_row`].
    #[inline(always)]
    unsafe fn out_at(&self, r: usize, c: usize) -> *mut f32 {
        unsafe { self.out.add(r * self.out_stride + c) }
    }
}

/// A raw output pointer shared by tasks that write disjoint columns (here and in
/// [`super::int8`]).
#[derive(Clone, Copy)]
pub(super) struct OutPtr(pub(super) *mut f32);
// SAFETY: tasks write disjoint column ranges of the output (see `matmul_with`,
// `int8::product`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Through a method, so closures capture the `Sync` wrapper rather than its raw field.
    pub(super) fn at(&self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// `out[t, n] = x[t, k] · w[n, k]ᵀ` with the best instruction set available.
pub fn matmul<W: Weight>(x: &[f32], rows: usize, k: usize, w: &[W], n: usize, out: &mut [f32]) {
    matmul_with(Isa::detect(), x, rows, k, w, n, out);
}

/// [`matmul`] with a chosen instruction set, which must be available (tests compare them).
pub fn matmul_with<W: Weight>(
    isa: Isa,
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[W],
    n: usize,
    out: &mut [f32],
) {
    assert!(isa.available(), "{isa:?} is not available on this CPU");
    assert_eq!(x.len(), rows * k, "x is [rows, k]");
    assert_eq!(
        k % W::ELEMENTS,
        0,
        "rows are whole units of the weight type"
    );
    let row_units = k / W::ELEMENTS;
    assert_eq!(w.len(), n * row_units, "w is [n, k]");
    assert_eq!(out.len(), rows * n, "out is [rows, n]");
    let out_ptr = OutPtr(out.as_mut_ptr());
    let widen_first = W::ELEMENTS > 1 && rows >= WIDEN_FIRST_ROWS;
    (0..n.div_ceil(BLOCK_ROWS))
        .into_par_iter()
        .for_each(|block| {
            let (first, last) = (block * BLOCK_ROWS, ((block + 1) * BLOCK_ROWS).min(n));
            if widen_first {
                // A few rows at a time, so the widened rows stay in the core's cache while
                // every input row passes over them.
                WIDENED.with_borrow_mut(|wide| {
                    for part in (first..last).step_by(WIDEN_PART_ROWS) {
                        let end = (part + WIDEN_PART_ROWS).min(last);
                        let units = &w[part * row_units..end * row_units];
                        widen_rows(isa, units, end - part, k, wide);
                        let tile = Tile {
                            x: x.as_ptr(),
                            w: wide.as_ptr(),
                            out: out_ptr.at(part),
                            k,
                            x_stride: k,
                            w_stride: k,
                            out_stride: n,
                            rows,
                            cols: end - part,
                        };
                        // SAFETY: as below, with `wide` holding rows part..end widened.
                        unsafe { run_tiled(isa, tile) };
                    }
                });
                return;
            }
            let tile = Tile {
                x: x.as_ptr(),
                w: w.as_ptr().wrapping_add(first * row_units),
                out: out_ptr.at(first),
                k,
                x_stride: k,
                w_stride: row_units,
                out_stride: n,
                rows,
                cols: last - first,
            };
            // SAFETY: the asserts above bound rows 0..rows of x, rows first..last of w and the
            // matching columns of out; only this task writes columns first..last.
            unsafe { run_tiled(isa, tile) };
        });
}

/// `rows` rows of `k` weights each, widened to f32 (exactly: the values the tiles would use).
fn widen_rows<W: Weight>(isa: Isa, w: &[W], rows: usize, k: usize, out: &mut Vec<f32>) {
    assert_eq!(w.len() * W::ELEMENTS, rows * k, "whole rows");
    // Grown only, never shrunk: products of another width follow, and growing zeroes.
    if out.len() < rows * k {
        out.resize(rows * k, 0.0);
    }
    let out = &mut out[..rows * k];
    let row_units = k / W::ELEMENTS;
    for (r, wide) in out.chunks_exact_mut(k).enumerate() {
        let row = w[r * row_units..].as_ptr();
        match isa {
            // SAFETY: `row` holds `k` elements (asserted above) and AVX2 is available.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 if k.is_multiple_of(LANES) => unsafe {
                x86::widen_avx2(row, wide)
            },
            // SAFETY: as above.
            _ => {
                for (i, v) in wide.iter_mut().enumerate() {
                    *v = unsafe { W::get(row, i) };
                }
            }
        }
    }
}

/// `out[r * out_stride + c] = x_r · w_c` for `rows` vectors of `x` and `cols` vectors of `w`,
/// each `k` long and `*_stride` apart, on this thread, with [`matmul`]'s per-element
/// arithmetic (attention scores use it so they are batch-invariant too).
#[allow(clippy::too_many_arguments)]
pub fn dots(
    isa: Isa,
    x: &[f32],
    x_stride: usize,
    rows: usize,
    w: &[f32],
    w_stride: usize,
    cols: usize,
    k: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    assert!(isa.available(), "{isa:?} is not available on this CPU");
    let fits =
        |len: usize, stride: usize, count: usize| count == 0 || (count - 1) * stride + k <= len;
    assert!(
        fits(x.len(), x_stride, rows) && fits(w.len(), w_stride, cols),
        "vectors lie inside x and w"
    );
    assert!(
        rows == 0 || (rows - 1) * out_stride + cols <= out.len(),
        "out holds every product"
    );
    let tile = Tile {
        x: x.as_ptr(),
        w: w.as_ptr(),
        out: out.as_mut_ptr(),
        k,
        x_stride,
        w_stride,
        out_stride,
        rows,
        cols,
    };
    // SAFETY: the asserts bound every pointer the tiles form.
    unsafe { run_tiled(isa, tile) };
}

/// Splits a block into register tiles and runs each.
///
/// # Safety
/// The block's pointers must be valid for its rows, columns and `k`, and `isa` available.
unsafe fn run_tiled<W: Weight>(isa: Isa, block: Tile<W>) {
    // Input rows and weight rows a tile takes (its register tiles may be smaller).
    let (tile_rows, max_cols) = match isa {
        // 4 × 4 rather than 4 × 6: the 24 accumulators of 4 × 6 plus their operands left LLVM
        // spilling accumulators to the stack inside the loop (BENCHMARKS.md: prefill +60%).
        Isa::Avx512 => (4, 4),
        // Two register tiles of 3 × 2, each weight row's lanes loaded once for three input
        // rows (BENCHMARKS.md: 3 × 2 against 2 × 2).
        Isa::Avx2 => (6, 2),
        Isa::Portable => (4, 1),
    };
    for r in (0..block.rows).step_by(tile_rows) {
        for c in (0..block.cols).step_by(max_cols) {
            let tile = Tile {
                x: unsafe { block.x_row(r) },
                w: unsafe { block.w_row(c) },
                out: unsafe { block.out_at(r, c) },
                rows: (block.rows - r).min(tile_rows),
                cols: (block.cols - c).min(max_cols),
                ..block
            };
            unsafe { run_tile(isa, tile) };
        }
    }
}

/// # Safety
/// The tile's pointers must be valid for its rows, columns and `k`, and `isa` available.
unsafe fn run_tile<W: Weight>(isa: Isa, tile: Tile<W>) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::tile_avx512(tile) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::tile_avx2(tile) },
        _ => unsafe { tile_portable(tile) },
    }
}

/// The fixed reduction of 16 lanes: halves, then quarters, then pairs.
#[inline(always)]
fn reduce_lanes(lanes: &[f32; LANES]) -> f32 {
    let mut v = *lanes;
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            v[l] += v[l + width];
        }
        width /= 2;
    }
    v[0]
}

/// Adds the `k % 16` trailing products, in order, to a reduced sum.
///
/// # Safety
/// `x` and `w` must be valid for `k` elements.
#[inline(always)]
unsafe fn add_tail<W: Weight>(mut sum: f32, x: *const f32, w: *const W, k: usize) -> f32 {
    for i in k / LANES * LANES..k {
        sum = unsafe { (*x.add(i)).mul_add(W::get(w, i), sum) };
    }
    sum
}

/// The reference implementation of the per-element arithmetic, one element at a time.
///
/// # Safety
/// As [`run_tile`].
unsafe fn tile_portable<W: Weight>(t: Tile<W>) {
    for r in 0..t.rows {
        for c in 0..t.cols {
            let (x, w) = unsafe { (t.x_row(r), t.w_row(c)) };
            let mut lanes = [0f32; LANES];
            for base in (0..t.k / LANES * LANES).step_by(LANES) {
                for (l, lane) in lanes.iter_mut().enumerate() {
                    let wl = unsafe { W::get(w, base + l) };
                    *lane = unsafe { (*x.add(base + l)).mul_add(wl, *lane) };
                }
            }
            unsafe { *t.out_at(r, c) = add_tail(reduce_lanes(&lanes), x, w, t.k) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{LANES, Tile, Weight, add_tail};

    /// [`super::reduce_lanes`]'s tree on eight lanes already folded (`l + 8` into `l`).
    ///
    /// `inline(always)` rather than `target_feature`: a vector argument to a call that is not
    /// inlined goes through memory, which would pin the accumulators to the stack.
    ///
    /// # Safety
    /// The CPU must have AVX.
    #[inline(always)]
    unsafe fn reduce8(v: __m256) -> f32 {
        unsafe {
            let quarters = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let pairs = _mm_add_ps(quarters, _mm_movehl_ps(quarters, quarters));
            _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)))
        }
    }

    /// [`super::reduce_lanes`]'s tree on one AVX-512 register.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[inline(always)]
    unsafe fn reduce16(v: __m512) -> f32 {
        unsafe {
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
            reduce8(_mm256_add_ps(_mm512_castps512_ps256(v), hi))
        }
    }

    /// Widens one row of weights into `out` (its length a multiple of 16), 16 at a time.
    ///
    /// # Safety
    /// `row` valid for `out.len()` elements; the CPU must have AVX2.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn widen_avx2<W: Weight>(row: *const W, out: &mut [f32]) {
        unsafe {
            for (i, chunk) in out.chunks_exact_mut(LANES).enumerate() {
                let (lo, hi) = W::load16_avx2(row, i * LANES);
                _mm256_storeu_ps(chunk.as_mut_ptr(), lo);
                _mm256_storeu_ps(chunk.as_mut_ptr().add(8), hi);
            }
        }
    }

    /// AVX-512: one register holds the 16 lanes of an element.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile_avx512<W: Weight>(t: Tile<W>) {
        unsafe {
            match (t.rows, t.cols) {
                (4, 4) => tile512::<W, 4, 4>(t),
                (3, 4) => tile512::<W, 3, 4>(t),
                (2, 4) => tile512::<W, 2, 4>(t),
                (1, 4) => tile512::<W, 1, 4>(t),
                (r, c) => {
                    for row in 0..r {
                        for col in 0..c {
                            let one = Tile {
                                x: t.x_row(row),
                                w: t.w_row(col),
                                out: t.out_at(row, col),
                                rows: 1,
                                cols: 1,
                                ..t
                            };
                            tile512::<W, 1, 1>(one);
                        }
                    }
                }
            }
        }
    }

    // Indexed loops over the const dimensions unroll into named registers; iterator chains
    // here produced worse code.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn tile512<W: Weight, const R: usize, const C: usize>(t: Tile<W>) {
        unsafe {
            let (x, xs, w, ws, k) = (t.x, t.x_stride, t.w, t.w_stride, t.k);
            let mut acc = [[_mm512_setzero_ps(); C]; R];
            let mut i = 0;
            while i + LANES <= k {
                let mut wv = [_mm512_setzero_ps(); C];
                for c in 0..C {
                    wv[c] = W::load16(w.add(c * ws), i);
                }
                for r in 0..R {
                    let xv = _mm512_loadu_ps(x.add(r * xs + i));
                    for c in 0..C {
                        acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
                    }
                }
                i += LANES;
            }
            // Spill once, in a loop small enough to unroll: reading `acc` by index in a loop
            // that stays rolled would keep it in memory and store every accumulator after
            // every multiply-add in the loop above.
            let mut spilled = [[[0f32; LANES]; C]; R];
            for r in 0..R {
                for c in 0..C {
                    _mm512_storeu_ps(spilled[r][c].as_mut_ptr(), acc[r][c]);
                }
            }
            for r in 0..R {
                for c in 0..C {
                    let sum = reduce16(_mm512_loadu_ps(spilled[r][c].as_ptr()));
                    *t.out_at(r, c) = add_tail(sum, x.add(r * xs), w.add(c * ws), k);
                }
            }
        }
    }

    /// AVX2 with FMA: two registers hold lanes 0..8 and 8..16 of an element. With several input
    /// rows, tiles of 3 × 2 elements keep their 12 accumulators in registers (with the five
    /// operands of a step, 15 of the 16), so a weight row loaded once serves three input rows
    /// (BENCHMARKS.md: 2 × 2 tiles gave prefill 1.2-2× on 2 AVX2 cores, 3 × 2 another
    /// 15-25%); one input row (decode) runs element by element, which measured faster than a
    /// 1 × 2 tile.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile_avx2<W: Weight>(t: Tile<W>) {
        unsafe {
            if t.rows == 1 && W::ELEMENTS == 32 {
                // A block a step: its header and values are unpacked once.
                for c in 0..t.cols {
                    let (x, w) = (t.x, t.w_row(c));
                    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    for base in (0..t.k).step_by(32) {
                        let [w0, w1, w2, w3] = W::load32_avx2(w, base);
                        lo = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(base)), w0, lo);
                        hi = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(base + 8)), w1, hi);
                        lo = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(base + 16)), w2, lo);
                        hi = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(base + 24)), w3, hi);
                    }
                    *t.out_at(0, c) = reduce8(_mm256_add_ps(lo, hi));
                }
                return;
            }
            if t.rows == 1 {
                for c in 0..t.cols {
                    let (x, w) = (t.x, t.w_row(c));
                    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    for base in (0..t.k / LANES * LANES).step_by(LANES) {
                        let (wlo, whi) = W::load16_avx2(w, base);
                        lo = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(base)), wlo, lo);
                        hi = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(base + 8)), whi, hi);
                    }
                    *t.out_at(0, c) = add_tail(reduce8(_mm256_add_ps(lo, hi)), x, w, t.k);
                }
                return;
            }
            for r in (0..t.rows).step_by(3) {
                for c in (0..t.cols).step_by(2) {
                    let part = Tile {
                        x: t.x_row(r),
                        w: t.w_row(c),
                        out: t.out_at(r, c),
                        rows: (t.rows - r).min(3),
                        cols: (t.cols - c).min(2),
                        ..t
                    };
                    match (part.rows, part.cols) {
                        (3, 2) => tile256::<W, 3, 2>(part),
                        (3, 1) => tile256::<W, 3, 1>(part),
                        (2, 2) => tile256::<W, 2, 2>(part),
                        (2, 1) => tile256::<W, 2, 1>(part),
                        (1, 2) => tile256::<W, 1, 2>(part),
                        _ => tile256::<W, 1, 1>(part),
                    }
                }
            }
        }
    }

    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn tile256<W: Weight, const R: usize, const C: usize>(t: Tile<W>) {
        unsafe {
            let (x, xs, w, ws, k) = (t.x, t.x_stride, t.w, t.w_stride, t.k);
            let mut lo = [[_mm256_setzero_ps(); C]; R];
            let mut hi = [[_mm256_setzero_ps(); C]; R];
            let mut i = 0;
            while i + LANES <= k {
                let mut wlo = [_mm256_setzero_ps(); C];
                let mut whi = [_mm256_setzero_ps(); C];
                for c in 0..C {
                    (wlo[c], whi[c]) = W::load16_avx2(w.add(c * ws), i);
                }
                for r in 0..R {
                    let xlo = _mm256_loadu_ps(x.add(r * xs + i));
                    let xhi = _mm256_loadu_ps(x.add(r * xs + i + 8));
                    for c in 0..C {
                        lo[r][c] = _mm256_fmadd_ps(xlo, wlo[c], lo[r][c]);
                        hi[r][c] = _mm256_fmadd_ps(xhi, whi[c], hi[r][c]);
                    }
                }
                i += LANES;
            }
            // Folded and spilled once, as in `tile512`, so the loop above keeps its
            // accumulators in registers.
            let mut spilled = [[[0f32; 8]; C]; R];
            for r in 0..R {
                for c in 0..C {
                    _mm256_storeu_ps(
                        spilled[r][c].as_mut_ptr(),
                        _mm256_add_ps(lo[r][c], hi[r][c]),
                    );
                }
            }
            for r in 0..R {
                for c in 0..C {
                    let sum = reduce8(_mm256_loadu_ps(spilled[r][c].as_ptr()));
                    *t.out_at(r, c) = add_tail(sum, x.add(r * xs), w.add(c * ws), k);
                }
            }
        }
    }
}

/// Asserts that a product over `w` gives, on every instruction set this CPU has, the bits of
/// the same product over `widened` (the same weights as f32).
#[cfg(test)]
pub(crate) fn assert_widening_exact<W: Weight>(
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[W],
    widened: &[f32],
    n: usize,
    label: &str,
) {
    for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|isa| isa.available())
    {
        let (mut narrow, mut wide) = (vec![f32::NAN; rows * n], vec![f32::NAN; rows * n]);
        matmul_with(isa, x, rows, k, w, n, &mut narrow);
        matmul_with(isa, x, rows, k, widened, n, &mut wide);
        assert!(
            narrow
                .iter()
                .zip(&wide)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{label}, {rows} rows, {isa:?}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::test_data::pseudo_random;

    fn product(isa: Isa, x: &[f32], rows: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; rows * n];
        matmul_with(isa, x, rows, k, w, n, &mut out);
        out
    }

    #[test]
    fn matches_a_float64_reference() {
        let (rows, k, n) = (9, 203, 211);
        let (x, w) = (pseudo_random(rows * k, 1), pseudo_random(n * k, 2));
        let out = product(Isa::detect(), &x, rows, k, &w, n);
        for t in 0..rows {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|i| x[t * k + i] as f64 * w[j * k + i] as f64)
                    .sum();
                let got = out[t * n + j] as f64;
                assert!(
                    (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "[{t}, {j}]: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn every_row_is_bit_identical_to_its_product_alone() {
        let (rows, k, n) = (11, 576, 197);
        let (x, w) = (pseudo_random(rows * k, 3), pseudo_random(n * k, 4));
        let batched = product(Isa::detect(), &x, rows, k, &w, n);
        for t in 0..rows {
            let alone = product(Isa::detect(), &x[t * k..(t + 1) * k], 1, k, &w, n);
            assert!(
                alone
                    .iter()
                    .zip(&batched[t * n..(t + 1) * n])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "row {t}"
            );
        }
    }

    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        let (rows, k, n) = (7, 150, 101);
        let (x, w) = (pseudo_random(rows * k, 5), pseudo_random(n * k, 6));
        let reference = product(Isa::Portable, &x, rows, k, &w, n);
        for isa in [Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|isa| isa.available())
        {
            let out = product(isa, &x, rows, k, &w, n);
            assert!(
                out.iter()
                    .zip(&reference)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{isa:?} differs from portable"
            );
        }
    }

    #[test]
    fn bf16_weights_give_the_bits_of_their_f32_widening() {
        let (rows, k, n) = (6, 203, 37);
        let x = pseudo_random(rows * k, 7);
        let w: Vec<bf16> = pseudo_random(n * k, 8)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let widened: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        assert_widening_exact(&x, rows, k, &w, &widened, n, "bf16");
    }

    #[test]
    fn empty_products_write_nothing() {
        let mut out: Vec<f32> = Vec::new();
        matmul(&[], 0, 4, &[0f32; 8], 2, &mut out);
        matmul::<f32>(&[0.0; 4], 1, 4, &[], 0, &mut out);
    }
}
