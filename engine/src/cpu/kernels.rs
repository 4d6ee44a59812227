//! The CPU backend's numeric kernels, in f32.
//!
//! Each entry point is compiled for AVX-512, AVX2+FMA and plain x86-64 (or the host's baseline)
//! and picks the best at run time (`multiversion`), so one binary runs fast on any x86-64 host.
//! The `*_body` helpers are `inline(always)` so they are compiled inside each variant. Loops use
//! independent accumulator lanes instead of relying on float reassociation, which the compiler
//! may not do on its own.
//!
//! Matrix products live in [`super::matmul`]; everything here works on one row at a time, so
//! its results never depend on what else is in the step.

use multiversion::multiversion;

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

/// `e^x` to about one ulp, as straight-line arithmetic the compiler vectorizes (the libm call
/// it replaces dominated softmax). Inputs below -87.3 give the smallest normal float, not 0.
#[inline(always)]
pub(crate) fn exp_body(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.7);
    let n = (x * LOG2_E + 0.5).floor();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p = 1.987_569_1e-4f32;
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
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
    use crate::cpu::test_data::pseudo_random;

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
    fn exp_is_within_two_ulps_of_libm() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp_body(x), x.exp());
            let ulps = (got.to_bits() as i64 - want.to_bits() as i64).abs();
            assert!(ulps <= 2, "exp({x}) = {got}, libm {want}");
            x += 0.0137;
        }
        assert_eq!(exp_body(0.0), 1.0);
        assert!(exp_body(-1e30) > 0.0 && exp_body(-1e30) < 1e-37);
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
