//! Weights in the GGUF's own quantized blocks (Q4_1, Q8_0), multiplied without dequantizing the
//! matrix: each block is widened to f32 in registers, weight by weight, exactly as
//! [`crate::gguf::dequant`] decodes it, so a product is bit-identical to the same product over
//! the dequantized f32 matrix while a decode step reads 0.75 (Q4_1) or 1.125 (Q8_0) bytes a
//! weight instead of 2 (bf16) or 4.
//!
//! In memory a block is the file's bytes (its scale and minimum still f16, widened by F16C
//! where they are used): a decode step is bound by the bytes it reads.
//!
//! Why the widening is exact either way: a scale has 11 significant bits and a quantized value
//! at most 8, so `d · q` is exact in f32 and a fused `d · q + m` rounds once, as llama.cpp's
//! separate multiply and add do.

use half::f16;

use super::matmul::Weight;

/// 32 weights `d · q + m`, `q` in 0..16: the low nibbles of `qs` hold weights 0..16, the high
/// nibbles 16..32.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub(super) d: f16,
    pub(super) m: f16,
    pub(super) qs: [u8; 16],
}

/// 32 weights `d · q`, `q` a signed byte.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub(super) d: f16,
    pub(super) qs: [i8; 32],
}

/// Bytes of one block in a GGUF file.
pub const Q4_1_FILE_BYTES: usize = 20;
pub const Q8_0_FILE_BYTES: usize = 34;

fn half_at(bytes: &[u8], at: usize) -> f16 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]])
}

impl BlockQ4_1 {
    /// The blocks of `bytes`, in a GGUF file's layout (f16 scale, f16 minimum, 16 bytes).
    pub fn parse(bytes: &[u8]) -> Vec<Self> {
        assert_eq!(bytes.len() % Q4_1_FILE_BYTES, 0, "whole blocks");
        bytes
            .chunks_exact(Q4_1_FILE_BYTES)
            .map(|b| BlockQ4_1 {
                d: half_at(b, 0),
                m: half_at(b, 2),
                qs: b[4..20].try_into().expect("16 bytes"),
            })
            .collect()
    }
}

impl BlockQ8_0 {
    /// The blocks of `bytes`, in a GGUF file's layout (f16 scale, 32 signed bytes).
    pub fn parse(bytes: &[u8]) -> Vec<Self> {
        assert_eq!(bytes.len() % Q8_0_FILE_BYTES, 0, "whole blocks");
        bytes
            .chunks_exact(Q8_0_FILE_BYTES)
            .map(|b| BlockQ8_0 {
                d: half_at(b, 0),
                qs: std::array::from_fn(|j| b[2 + j] as i8),
            })
            .collect()
    }
}

impl Weight for BlockQ4_1 {
    const ELEMENTS: usize = 32;

    #[inline(always)]
    unsafe fn get(row: *const Self, i: usize) -> f32 {
        let block = unsafe { &*row.add(i / 32) };
        let j = i % 32;
        let q = if j < 16 {
            block.qs[j] & 0x0f
        } else {
            block.qs[j - 16] >> 4
        };
        block.d.to_f32().mul_add(f32::from(q), block.m.to_f32())
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16_avx2(row: *const Self, i: usize) -> (x86::__m256, x86::__m256) {
        use std::arch::x86_64::*;
        unsafe {
            let block = &*row.add(i / 32);
            let nibbles = x86::nibbles(block, i);
            let (d, m) = (x86::widen8(block.d), x86::widen8(block.m));
            let widen = |bytes: __m128i| {
                _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), m)
            };
            (widen(nibbles), widen(_mm_unpackhi_epi64(nibbles, nibbles)))
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load32_avx2(row: *const Self, i: usize) -> [x86::__m256; 4] {
        use std::arch::x86_64::*;
        unsafe {
            let block = &*row.add(i / 32);
            let packed = _mm_loadu_si128(block.qs.as_ptr().cast());
            let mask = _mm_set1_epi8(0x0f);
            let (low, high) = (
                _mm_and_si128(packed, mask),
                _mm_and_si128(_mm_srli_epi16::<4>(packed), mask),
            );
            let (d, m) = (x86::widen8(block.d), x86::widen8(block.m));
            let widen = |bytes: __m128i| {
                _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), m)
            };
            [
                widen(low),
                widen(_mm_unpackhi_epi64(low, low)),
                widen(high),
                widen(_mm_unpackhi_epi64(high, high)),
            ]
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(row: *const Self, i: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        unsafe {
            let block = &*row.add(i / 32);
            let q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x86::nibbles(block, i)));
            _mm512_fmadd_ps(x86::widen16(block.d), q, x86::widen16(block.m))
        }
    }
}

impl Weight for BlockQ8_0 {
    const ELEMENTS: usize = 32;

    #[inline(always)]
    unsafe fn get(row: *const Self, i: usize) -> f32 {
        let block = unsafe { &*row.add(i / 32) };
        f32::from(block.qs[i % 32]) * block.d.to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16_avx2(row: *const Self, i: usize) -> (x86::__m256, x86::__m256) {
        use std::arch::x86_64::*;
        unsafe {
            let block = &*row.add(i / 32);
            let bytes = _mm_loadu_si128(block.qs.as_ptr().add(i % 32).cast());
            let d = x86::widen8(block.d);
            let widen =
                |bytes: __m128i| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d);
            (widen(bytes), widen(_mm_unpackhi_epi64(bytes, bytes)))
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(row: *const Self, i: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        unsafe {
            let block = &*row.add(i / 32);
            let bytes = _mm_loadu_si128(block.qs.as_ptr().add(i % 32).cast());
            _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)),
                x86::widen16(block.d),
            )
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    pub use std::arch::x86_64::__m256;
    use std::arch::x86_64::*;

    use half::f16;

    use super::BlockQ4_1;

    /// An f16 widened into eight f32 lanes.
    ///
    /// # Safety
    /// The CPU must have AVX and F16C.
    #[inline(always)]
    pub unsafe fn widen8(h: f16) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_set1_epi16(h.to_bits() as i16)) }
    }

    /// An f16 widened into sixteen f32 lanes.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[inline(always)]
    pub unsafe fn widen16(h: f16) -> __m512 {
        unsafe { _mm512_cvtph_ps(_mm256_set1_epi16(h.to_bits() as i16)) }
    }

    /// The 16 quantized values of weights `i..i + 16` of a Q4_1 block (`i % 32` is 0 or 16),
    /// one a byte.
    ///
    /// # Safety
    /// The CPU must have SSE2.
    #[inline(always)]
    pub unsafe fn nibbles(block: &BlockQ4_1, i: usize) -> __m128i {
        unsafe {
            let packed = _mm_loadu_si128(block.qs.as_ptr().cast());
            let packed = if i.is_multiple_of(32) {
                packed
            } else {
                _mm_srli_epi16::<4>(packed)
            };
            _mm_and_si128(packed, _mm_set1_epi8(0x0f))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::matmul::assert_widening_exact;
    use crate::cpu::test_data::{dequantized, file_blocks, pseudo_random};
    use crate::gguf::TensorType;

    /// A product over blocks gives the bits of the product over the dequantized f32 matrix, on
    /// every instruction set, for one input row (decode) and several (prefill tiles).
    fn check_bits<W: Weight>(ty: TensorType, parse: fn(&[u8]) -> Vec<W>) {
        let (k, n) = (32 * 7, 13);
        let bytes = file_blocks(ty, n * k / 32, 11);
        let (blocks, widened) = (parse(&bytes), dequantized(ty, &bytes, n * k));
        for rows in [1, 2, 5] {
            let x = pseudo_random(rows * k, 12 + rows as u32);
            assert_widening_exact(&x, rows, k, &blocks, &widened, n, &format!("{ty:?}"));
        }
    }

    #[test]
    fn q4_1_products_give_the_bits_of_their_dequantized_matrix() {
        check_bits(TensorType::Q4_1, BlockQ4_1::parse);
    }

    #[test]
    fn q8_0_products_give_the_bits_of_their_dequantized_matrix() {
        check_bits(TensorType::Q8_0, BlockQ8_0::parse);
    }

    #[test]
    fn single_weights_are_the_dequantizers_values() {
        let bytes = file_blocks(TensorType::Q4_1, 3, 21);
        let (blocks, widened) = (
            BlockQ4_1::parse(&bytes),
            dequantized(TensorType::Q4_1, &bytes, 96),
        );
        for (i, want) in widened.iter().enumerate() {
            assert_eq!(unsafe { BlockQ4_1::get(blocks.as_ptr(), i) }, *want, "{i}");
        }
        let bytes = file_blocks(TensorType::Q8_0, 3, 22);
        let (blocks, widened) = (
            BlockQ8_0::parse(&bytes),
            dequantized(TensorType::Q8_0, &bytes, 96),
        );
        for (i, want) in widened.iter().enumerate() {
            assert_eq!(unsafe { BlockQ8_0::get(blocks.as_ptr(), i) }, *want, "{i}");
        }
    }
}
