//! Element types of weights on disk and in memory.

use std::fmt;
use std::str::FromStr;

/// A floating-point element type snapserve reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }

    /// The name Hugging Face's `config.json` uses in `torch_dtype`.
    pub fn torch_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
        }
    }

    pub fn to_safetensors(self) -> safetensors::Dtype {
        match self {
            DType::F32 => safetensors::Dtype::F32,
            DType::F16 => safetensors::Dtype::F16,
            DType::BF16 => safetensors::Dtype::BF16,
        }
    }

    pub fn from_safetensors(dtype: safetensors::Dtype) -> Option<Self> {
        match dtype {
            safetensors::Dtype::F32 => Some(DType::F32),
            safetensors::Dtype::F16 => Some(DType::F16),
            safetensors::Dtype::BF16 => Some(DType::BF16),
            _ => None,
        }
    }

    /// Appends `values` rounded to this type (round to nearest even) as little-endian bytes.
    pub fn encode_into(self, values: &[f32], out: &mut Vec<u8>) {
        out.reserve(values.len() * self.size_bytes());
        match self {
            DType::F32 => values.iter().for_each(|v| out.extend(v.to_le_bytes())),
            DType::F16 => values
                .iter()
                .for_each(|&v| out.extend(half::f16::from_f32(v).to_le_bytes())),
            DType::BF16 => values
                .iter()
                .for_each(|&v| out.extend(half::bf16::from_f32(v).to_le_bytes())),
        }
    }

    /// Decodes little-endian elements of this type into `out` (same element count).
    pub fn decode_into(self, bytes: &[u8], out: &mut [f32]) {
        assert_eq!(
            bytes.len(),
            out.len() * self.size_bytes(),
            "caller checked the byte length"
        );
        match self {
            DType::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            DType::F16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            DType::BF16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(DType::F32),
            "f16" | "float16" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            other => Err(format!(
                "unknown dtype `{other}` (expected f32, f16 or bf16)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_and_decodes_back() {
        let values = [1.0f32, 1.0 + 1.0 / 256.0, -3.5, 1e-5];
        let mut bytes = Vec::new();
        DType::BF16.encode_into(&values, &mut bytes);
        let mut back = [0f32; 4];
        DType::BF16.decode_into(&bytes, &mut back);
        assert_eq!(back[0], 1.0);
        // Exactly halfway between two bf16 values: ties go to the even mantissa (1.0).
        assert_eq!(back[1], 1.0);
        assert_eq!(back[2], -3.5);
        assert_eq!(back[3], half::bf16::from_f32(1e-5).to_f32());
    }

    #[test]
    fn parses_names() {
        assert_eq!("bfloat16".parse::<DType>(), Ok(DType::BF16));
        assert!("int8".parse::<DType>().unwrap_err().contains("int8"));
    }
}
