//! Deterministic non-zero test data for the CPU kernels' unit tests.

use half::f16;

use crate::gguf::{TensorType, dequant};

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

/// GGUF bytes of `blocks` blocks of `ty` (Q4_1 or Q8_0) with scales, minima and values drawn
/// from `seed`.
pub fn file_blocks(ty: TensorType, blocks: usize, seed: u32) -> Vec<u8> {
    let noise = pseudo_random(blocks * 34, seed);
    let mut bytes = Vec::new();
    for b in 0..blocks {
        let r = &noise[b * 34..];
        bytes.extend(f16::from_f32(r[0] * 0.05).to_le_bytes());
        match ty {
            TensorType::Q4_1 => {
                bytes.extend(f16::from_f32(r[1] * 0.3).to_le_bytes());
                bytes.extend((0..16).map(|j| ((r[2 + j].abs() * 1e4) as u32 % 256) as u8));
            }
            TensorType::Q8_0 => {
                bytes.extend((0..32).map(|j| ((r[2 + j].abs() * 1e4) as u32 % 256) as u8));
            }
            _ => unreachable!("only the two block types"),
        }
    }
    bytes
}

/// What the GGUF dequantizer makes of `bytes`.
pub fn dequantized(ty: TensorType, bytes: &[u8], elements: usize) -> Vec<f32> {
    let mut out = vec![0f32; elements];
    assert!(dequant::dequantize(ty, bytes, &mut out));
    out
}
