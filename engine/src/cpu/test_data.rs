//! Deterministic non-zero test data for the CPU kernels' unit tests.

/// `n` values in `[-1, 1]` from an xorshift generator seeded with `seed`.
pub fn pseudo_random(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).max(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s % 20_001) as f32 / 10_000.0 - 1.0
        })
        .collect()
}
