//! The CPU backend's numeric kernels, in f32.
//!
//! Each entry point is compiled for AVX-512, AVX2+FMA and plain x86-64 (or the host's baseline)
//! and picks the best at run time (`multiversion`), so one binary runs fast on any x86-64 host.
//! The `*_body` helpers are `inline(always)` so they are compiled inside each variant. Loops use
//! independent accumulator lanes instead of relying on float reassociation, which the compiler
//! may not do on its own.
//!
//! Matrix products follow the checkpoint layout: a weight is `[n, k]` row-major and
//! `matmul` computes `x[t, k] · wᵀ`. Few rows (decode) are memory-bound: each weight row is
//! streamed once and dotted with every input row. Many rows (prefill) go to the `gemm` crate.

use multiversion::multiversion;
use rayon::prelude::*;

/// Up to this many input rows, `matmul` streams the weights itself.
const STREAM_ROWS_MAX: usize = 4;
/// Weight rows per parallel task when streaming.
const STREAM_CHUNK: usize = 32;

#[inline(always)]
pub(crate) fn dot_body(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let split = n / 32 * 32;
    let mut acc = [0f32; 32];
    for (ca, cb) in a[..split].chunks_exact(32).zip(b[..split].chunks_exact(32)) {
        for j in 0..32 {
            acc[j] += ca[j] * cb[j];
        }
    }
    let mut tail = 0f32;
    for (x, y) in a[split..].iter().zip(&b[split..]) {
        tail += x * y;
    }
    let mut half = [0f32; 16];
    for j in 0..16 {
        half[j] = acc[j] + acc[j + 16];
    }
    half.iter().sum::<f32>() + tail
}

/// `Σ a[i]·b[i]` over the shorter length.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_body(a, b)
}

/// `y[i] += alpha · x[i]`.
#[inline(always)]
pub(crate) fn axpy_body(y: &mut [f32], alpha: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
}

#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn stream_chunk(x: &[f32], rows: usize, k: usize, w: &[f32], out: &mut [f32]) {
    // `out` is [chunk_rows, rows]: transposed, so each task writes one contiguous block.
    for (j, w_row) in w.chunks_exact(k).enumerate() {
        for t in 0..rows {
            out[j * rows + t] = dot_body(w_row, &x[t * k..(t + 1) * k]);
        }
    }
}

/// `out[t, n] = x[t, k] · w[n, k]ᵀ` on the current rayon pool.
pub fn matmul(x: &[f32], rows: usize, k: usize, w: &[f32], n: usize, out: &mut [f32]) {
    assert_eq!(x.len(), rows * k, "x is [rows, k]");
    assert_eq!(w.len(), n * k, "w is [n, k]");
    assert_eq!(out.len(), rows * n, "out is [rows, n]");
    if rows == 0 || n == 0 {
        return;
    }
    if rows == 1 {
        out.par_chunks_mut(STREAM_CHUNK)
            .zip(w.par_chunks(STREAM_CHUNK * k))
            .for_each(|(o, w)| stream_chunk(x, 1, k, w, o));
    } else if rows <= STREAM_ROWS_MAX {
        let mut transposed = vec![0f32; rows * n];
        transposed
            .par_chunks_mut(STREAM_CHUNK * rows)
            .zip(w.par_chunks(STREAM_CHUNK * k))
            .for_each(|(o, w)| stream_chunk(x, rows, k, w, o));
        for (j, column) in transposed.chunks_exact(rows).enumerate() {
            for (t, &v) in column.iter().enumerate() {
                out[t * n + j] = v;
            }
        }
    } else {
        gemm_rows(x, rows, k, w, n, out);
    }
}

fn gemm_rows(x: &[f32], rows: usize, k: usize, w: &[f32], n: usize, out: &mut [f32]) {
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the asserts in `matmul` bound every index gemm touches: dst is [rows, n] with
    // row stride n, lhs is [rows, k] with row stride k, rhs (wᵀ) is [k, n] read from w[n, k]
    // with column stride k.
    unsafe {
        gemm::gemm(
            rows,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// Root-mean-square normalization of each `width`-wide row of `x`, scaled by `weight`, as
/// Hugging Face's Llama computes it: `(x · rsqrt(mean(x²) + eps)) · weight`.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len();
    for (row, out_row) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let mean_square = dot_body(row, row) / width as f32;
        let scale = 1.0 / (mean_square + eps).sqrt();
        for ((o, &v), &w) in out_row.iter_mut().zip(row).zip(weight) {
            *o = (v * scale) * w;
        }
    }
}

/// `out[i] = silu(gate[i]) · up[i]` for each row, where a row of `gate_up` is `[gate | up]`.
pub fn silu_mul(gate_up: &[f32], ffn: usize, out: &mut [f32]) {
    for (row, out_row) in gate_up.chunks_exact(2 * ffn).zip(out.chunks_exact_mut(ffn)) {
        let (gate, up) = row.split_at(ffn);
        for ((o, &g), &u) in out_row.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    }
}

/// Rotates one head in place by the angles whose cosines and sines are given, pairing
/// dimension `i` with `i + head_dim/2` (Hugging Face's `rotate_half` layout).
pub fn rope_head(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = head.len() / 2;
    let (lo, hi) = head.split_at_mut(half);
    for i in 0..half {
        let (a, b) = (lo[i], hi[i]);
        lo[i] = a * cos[i] - b * sin[i];
        hi[i] = b * cos[i] + a * sin[i];
    }
}

/// In-place `x[i] += y[i]`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo_random(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn reference(x: &[f32], rows: usize, k: usize, w: &[f32], n: usize) -> Vec<f64> {
        let mut out = vec![0f64; rows * n];
        for t in 0..rows {
            for j in 0..n {
                out[t * n + j] = (0..k)
                    .map(|i| x[t * k + i] as f64 * w[j * k + i] as f64)
                    .sum();
            }
        }
        out
    }

    #[test]
    fn matmul_matches_reference_on_every_path() {
        let (k, n) = (77, 45);
        let w = pseudo_random(n * k, 1);
        for rows in [1, 3, STREAM_ROWS_MAX, STREAM_ROWS_MAX + 1, 19] {
            let x = pseudo_random(rows * k, rows as u32 + 7);
            let mut out = vec![f32::NAN; rows * n];
            matmul(&x, rows, k, &w, n, &mut out);
            let want = reference(&x, rows, k, &w, n);
            for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (got as f64 - want).abs() < 1e-4,
                    "rows {rows} element {i}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn dot_handles_lengths_around_the_lane_width() {
        for len in [0, 1, 31, 32, 33, 64, 100] {
            let a = pseudo_random(len, 3);
            let b = pseudo_random(len, 4);
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-5, "len {len}");
        }
    }

    #[test]
    fn rms_norm_normalizes_each_row() {
        let x = [3.0, 4.0, 1.0, 1.0];
        let mut out = [0f32; 4];
        rms_norm(&x, &[1.0, 2.0], 0.0, &mut out);
        let scale = 1.0 / (12.5f32).sqrt();
        assert_eq!(out[..2], [3.0 * scale, (4.0 * scale) * 2.0]);
        assert_eq!(out[2..], [1.0, 2.0]);
    }

    #[test]
    fn rope_rotates_pairs_of_halves() {
        let mut head = [1.0, 2.0, 3.0, 4.0];
        let angle = std::f32::consts::FRAC_PI_2;
        rope_head(&mut head, &[angle.cos(), 1.0], &[angle.sin(), 0.0]);
        let expected = [-3.0, 2.0, 1.0, 4.0];
        for (g, e) in head.iter().zip(expected) {
            assert!((g - e).abs() < 1e-6, "{head:?}");
        }
    }

    #[test]
    fn silu_mul_gates_up() {
        let mut out = [0f32; 2];
        silu_mul(&[0.0, 2.0, 5.0, 3.0], 2, &mut out);
        assert_eq!(out[0], 0.0);
        assert!((out[1] - 2.0 / (1.0 + (-2.0f32).exp()) * 3.0).abs() < 1e-6);
    }
}
