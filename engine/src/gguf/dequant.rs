//! Dequantization of GGUF tensor data to f32, bit-for-bit as llama.cpp's reference decoders
//! compute it (scale and minimum widened from f16, one multiply and one add per element, no
//! fused multiply-add).
//!
//! Blocks are 32 elements: Q8_0 is an f16 scale and 32 signed bytes; Q4_0 an f16 scale and 16
//! bytes of nibbles offset by 8; Q4_1 an f16 scale, an f16 minimum and 16 bytes of nibbles. In
//! the 4-bit types the low nibbles hold elements 0..16 and the high nibbles elements 16..32.

use half::{bf16, f16};

use super::TensorType;

/// Decodes `bytes` of type `ty` into `out`, which must hold exactly the tensor's elements.
///
/// Returns `false` (leaving `out` unspecified) for a type that has no decoder; the caller names
/// the tensor in its error. Lengths are the caller's invariant: `GgufFile::tensor_bytes` already
/// checked that `bytes` holds whole blocks for `out.len()` elements.
pub fn dequantize(ty: TensorType, bytes: &[u8], out: &mut [f32]) -> bool {
    match ty {
        TensorType::F32 => decode_scalar(bytes, out, 4, |b| {
            f32::from_le_bytes([b[0], b[1], b[2], b[3]])
        }),
        TensorType::F16 => {
            decode_scalar(bytes, out, 2, |b| f16::from_le_bytes([b[0], b[1]]).to_f32())
        }
        TensorType::BF16 => decode_scalar(bytes, out, 2, |b| {
            bf16::from_le_bytes([b[0], b[1]]).to_f32()
        }),
        TensorType::Q8_0 => decode_blocks(bytes, out, 34, q8_0_block),
        TensorType::Q4_0 => decode_blocks(bytes, out, 18, q4_0_block),
        TensorType::Q4_1 => decode_blocks(bytes, out, 20, q4_1_block),
        TensorType::Other(_) => return false,
    }
    true
}

fn decode_scalar(bytes: &[u8], out: &mut [f32], width: usize, f: impl Fn(&[u8]) -> f32) {
    assert_eq!(
        bytes.len(),
        out.len() * width,
        "tensor_bytes checked the length"
    );
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(width)) {
        *o = f(b);
    }
}

fn decode_blocks(bytes: &[u8], out: &mut [f32], block_bytes: usize, f: fn(&[u8], &mut [f32])) {
    assert_eq!(
        bytes.len() / block_bytes * 32,
        out.len(),
        "tensor_bytes checked the length"
    );
    for (block, o) in bytes
        .chunks_exact(block_bytes)
        .zip(out.chunks_exact_mut(32))
    {
        f(block, o);
    }
}

fn half_at(block: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([block[at], block[at + 1]]).to_f32()
}

fn q8_0_block(block: &[u8], out: &mut [f32]) {
    let d = half_at(block, 0);
    for (o, &q) in out.iter_mut().zip(&block[2..34]) {
        *o = f32::from(q as i8) * d;
    }
}

fn q4_0_block(block: &[u8], out: &mut [f32]) {
    let d = half_at(block, 0);
    let (lo, hi) = out.split_at_mut(16);
    for (j, &q) in block[2..18].iter().enumerate() {
        lo[j] = f32::from((q & 0x0f) as i8 - 8) * d;
        hi[j] = f32::from((q >> 4) as i8 - 8) * d;
    }
}

fn q4_1_block(block: &[u8], out: &mut [f32]) {
    let d = half_at(block, 0);
    let m = half_at(block, 2);
    let (lo, hi) = out.split_at_mut(16);
    for (j, &q) in block[4..20].iter().enumerate() {
        lo[j] = f32::from(q & 0x0f) * d + m;
        hi[j] = f32::from(q >> 4) * d + m;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block_header(d: f32, m: Option<f32>) -> Vec<u8> {
        let mut b = f16::from_f32(d).to_le_bytes().to_vec();
        if let Some(m) = m {
            b.extend(f16::from_f32(m).to_le_bytes());
        }
        b
    }

    #[test]
    fn q4_1_low_nibbles_then_high_nibbles() {
        let mut block = block_header(0.5, Some(-1.0));
        block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut out = [0f32; 32];
        assert!(dequantize(TensorType::Q4_1, &block, &mut out));
        for j in 0..16 {
            assert_eq!(out[j], j as f32 * 0.5 - 1.0);
            assert_eq!(out[16 + j], (15 - j) as f32 * 0.5 - 1.0);
        }
    }

    #[test]
    fn q8_0_is_signed() {
        let mut block = block_header(0.25, None);
        block.extend((0..32).map(|j: i32| ((j - 16) as i8) as u8));
        let mut out = [0f32; 32];
        assert!(dequantize(TensorType::Q8_0, &block, &mut out));
        for (j, &v) in out.iter().enumerate() {
            assert_eq!(v, (j as f32 - 16.0) * 0.25);
        }
    }

    #[test]
    fn q4_0_is_offset_by_eight() {
        let mut block = block_header(2.0, None);
        block.extend([0x0fu8; 16]);
        block[2] = 0x80;
        let mut out = [0f32; 32];
        assert!(dequantize(TensorType::Q4_0, &block, &mut out));
        assert_eq!(out[0], -16.0);
        assert_eq!(out[16], 0.0);
        assert_eq!(out[1], 14.0);
        assert_eq!(out[17], -16.0);
    }

    #[test]
    fn unknown_type_is_refused() {
        assert!(!dequantize(TensorType::Other(12), &[], &mut []));
    }
}
