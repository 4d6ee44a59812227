//! Converts a llama-architecture GGUF file into a Hugging Face model folder.
//!
//! The folder holds `config.json`, `model.safetensors`, `tokenizer.json`,
//! `tokenizer_config.json`, `generation_config.json` and `chat_template.jinja`, so that both
//! snapserve and Hugging Face transformers load it. Quantized tensors are dequantized exactly
//! (see [`crate::gguf::dequant`]) and then stored as f32, or rounded once to bf16/f16.
//!
//! The converter writes only into the folder it is given; making that atomic (a partial folder
//! renamed into place) is the caller's job.

mod hf_files;
mod tensors;

use std::path::Path;

use indicatif::ProgressBar;

use crate::dtype::DType;
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;

pub use tensors::hf_tensor_name;

/// The llama hyper-parameters a GGUF file declares, under the `llama.` prefix.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaParams {
    pub layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub context: usize,
    pub vocab: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub tied_embeddings: bool,
}

impl LlamaParams {
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let arch = gguf.require_str("general.architecture")?;
        if arch != "llama" {
            return Err(EngineError::UnsupportedArchitecture {
                path: gguf.path().to_path_buf(),
                name: format!("gguf:{arch}"),
            });
        }
        let int = |key: &str| {
            gguf.require_u64(&format!("llama.{key}"))
                .map(|v| v as usize)
        };
        let heads = int("attention.head_count")?;
        let hidden = int("embedding_length")?;
        if heads == 0 || hidden % heads != 0 {
            return Err(conversion(
                gguf,
                format!("embedding_length {hidden} is not divisible by {heads} heads"),
            ));
        }
        let vocab = match gguf
            .metadata
            .get("llama.vocab_size")
            .and_then(|v| v.as_u64())
        {
            Some(v) => v as usize,
            None => gguf
                .require("tokenizer.ggml.tokens")?
                .as_array()
                .map_or(0, <[_]>::len),
        };
        Ok(Self {
            layers: int("block_count")?,
            hidden,
            ffn: int("feed_forward_length")?,
            heads,
            kv_heads: int("attention.head_count_kv").unwrap_or(heads),
            head_dim: hidden / heads,
            context: int("context_length")?,
            vocab,
            rope_theta: gguf.require_f32("llama.rope.freq_base").unwrap_or(10_000.0),
            rms_eps: gguf.require_f32("llama.attention.layer_norm_rms_epsilon")?,
            tied_embeddings: gguf.tensor("output.weight").is_none(),
        })
    }
}

/// Writes the Hugging Face folder for `gguf` into `out_dir`, which must exist and be empty.
/// With `keep_blocks`, matrices in Q4_1 or Q8_0 blocks stay in them (see
/// [`crate::model::BlockType`]; only snapserve reads such a folder), the rest is `dtype`.
///
/// `progress` advances by tensor elements converted; its length is set here.
pub fn convert(
    gguf: &GgufFile,
    out_dir: &Path,
    dtype: DType,
    keep_blocks: bool,
    progress: &ProgressBar,
) -> Result<()> {
    let params = LlamaParams::from_gguf(gguf)?;
    tensors::write_safetensors(
        gguf,
        &params,
        dtype,
        keep_blocks,
        &out_dir.join("model.safetensors"),
        progress,
    )?;
    hf_files::write_all(gguf, &params, dtype, out_dir)
}

fn conversion(gguf: &GgufFile, reason: String) -> EngineError {
    EngineError::Conversion {
        path: gguf.path().to_path_buf(),
        reason,
    }
}
