//! Tensor names, layout and values: GGUF tensors to `model.safetensors`.
//!
//! llama.cpp's converter reorders the rows of `attn_q` and `attn_k` within each head so that
//! rotary pairs sit side by side (interleaved layout); Hugging Face's Llama rotates the two
//! halves of each head instead. [`unpermute_rows`] undoes that reordering.

use std::collections::HashMap;
use std::path::Path;

use indicatif::ProgressBar;
use safetensors::tensor::TensorView;

use super::{LlamaParams, conversion};
use crate::dtype::DType;
use crate::error::{EngineError, Result};
use crate::gguf::{GgufFile, TensorInfo, dequant};
use crate::model::BlockType;

/// The Hugging Face name of a llama GGUF tensor, or `None` for a name it has no counterpart for.
pub fn hf_tensor_name(gguf_name: &str) -> Option<String> {
    let fixed = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(name) = fixed {
        return Some(name.to_string());
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, leaf) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let hf_leaf = match leaf {
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "attn_q.bias" => "self_attn.q_proj.bias",
        "attn_k.bias" => "self_attn.k_proj.bias",
        "attn_v.bias" => "self_attn.v_proj.bias",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf_leaf}"))
}

/// Heads whose rows llama.cpp interleaved, for tensors that need [`unpermute_rows`].
fn permuted_heads(gguf_name: &str, params: &LlamaParams) -> Option<usize> {
    if gguf_name.ends_with(".attn_q.weight") || gguf_name.ends_with(".attn_q.bias") {
        Some(params.heads)
    } else if gguf_name.ends_with(".attn_k.weight") || gguf_name.ends_with(".attn_k.bias") {
        Some(params.kv_heads)
    } else {
        None
    }
}

/// Undoes llama.cpp's rotary row permutation of a `[heads * head_dim, cols]` matrix (of
/// elements, or of rows of quantized blocks: `cols` units a row).
///
/// Within a head of `head_dim` rows, Hugging Face row `half * head_dim/2 + i` was stored at row
/// `2 * i + half`.
pub fn unpermute_rows<T: Copy + Default>(values: &[T], heads: usize, cols: usize) -> Vec<T> {
    let rows = values.len() / cols;
    let head_dim = rows / heads;
    let half_dim = head_dim / 2;
    let mut out = vec![T::default(); values.len()];
    for h in 0..heads {
        for half in 0..2 {
            for i in 0..half_dim {
                let hf_row = h * head_dim + half * half_dim + i;
                let gguf_row = h * head_dim + 2 * i + half;
                out[hf_row * cols..(hf_row + 1) * cols]
                    .copy_from_slice(&values[gguf_row * cols..(gguf_row + 1) * cols]);
            }
        }
    }
    out
}

struct Converted {
    name: String,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
    /// Set when the bytes are the GGUF's blocks, kept.
    blocks: Option<BlockType>,
}

/// Dequantizes one tensor, restores the Hugging Face row order and encodes it as `dtype`; or,
/// with `keep_blocks`, copies a matrix of Q4_1 or Q8_0 blocks as it is, rows reordered.
fn convert_tensor(
    gguf: &GgufFile,
    info: &TensorInfo,
    params: &LlamaParams,
    dtype: DType,
    keep_blocks: bool,
) -> Result<Converted> {
    let name = hf_tensor_name(&info.name).ok_or_else(|| {
        conversion(
            gguf,
            format!("tensor `{}` has no Hugging Face counterpart", info.name),
        )
    })?;
    let bytes = gguf.tensor_bytes(info)?;
    let blocks = BlockType::of_gguf(info.ty).filter(|_| keep_blocks && info.dims.len() == 2);
    if let Some(ty) = blocks {
        let shape = info.shape();
        let row_bytes = shape[1] / 32 * ty.block_bytes();
        let mut kept = bytes.to_vec();
        if let Some(heads) = permuted_heads(&info.name, params) {
            kept = unpermute_rows(&kept, heads, row_bytes);
        }
        return Ok(Converted {
            name,
            dtype: safetensors::Dtype::U8,
            shape: vec![shape[0], row_bytes],
            bytes: kept,
            blocks: Some(ty),
        });
    }
    let mut values = vec![0f32; info.elements() as usize];
    if !dequant::dequantize(info.ty, bytes, &mut values) {
        return Err(EngineError::Tensor {
            path: gguf.path().to_path_buf(),
            name: info.name.clone(),
            reason: format!("quantization type {:?} is not supported", info.ty),
        });
    }
    if let Some(heads) = permuted_heads(&info.name, params) {
        let cols = info.dims[0] as usize;
        let cols = if info.dims.len() == 1 { 1 } else { cols };
        values = unpermute_rows(&values, heads, cols);
    }
    let mut out = Vec::new();
    dtype.encode_into(&values, &mut out);
    Ok(Converted {
        name,
        dtype: dtype.to_safetensors(),
        shape: info.shape(),
        bytes: out,
        blocks: None,
    })
}

pub(super) fn write_safetensors(
    gguf: &GgufFile,
    params: &LlamaParams,
    dtype: DType,
    keep_blocks: bool,
    path: &Path,
    progress: &ProgressBar,
) -> Result<()> {
    check_required_tensors(gguf, params)?;
    progress.set_length(gguf.tensors.iter().map(TensorInfo::elements).sum());
    let mut converted = Vec::with_capacity(gguf.tensors.len());
    for info in &gguf.tensors {
        converted.push(convert_tensor(gguf, info, params, dtype, keep_blocks)?);
        progress.inc(info.elements());
    }
    let views = converted
        .iter()
        .map(|c| {
            let view = TensorView::new(c.dtype, c.shape.clone(), &c.bytes)
                .expect("shape and byte length come from the same tensor");
            (c.name.clone(), view)
        })
        .collect::<Vec<_>>();
    let mut metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    for c in &converted {
        if let Some(ty) = c.blocks {
            metadata.insert(
                format!("{}{}", BlockType::METADATA_PREFIX, c.name),
                ty.name().to_string(),
            );
        }
    }
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(|e| EngineError::Tensor {
        path: path.to_path_buf(),
        name: "*".into(),
        reason: e.to_string(),
    })
}

fn check_required_tensors(gguf: &GgufFile, params: &LlamaParams) -> Result<()> {
    let mut required = vec![
        "token_embd.weight".to_string(),
        "output_norm.weight".to_string(),
    ];
    for layer in 0..params.layers {
        for leaf in [
            "attn_norm",
            "ffn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ] {
            required.push(format!("blk.{layer}.{leaf}.weight"));
        }
    }
    match required.iter().find(|name| gguf.tensor(name).is_none()) {
        Some(missing) => Err(conversion(
            gguf,
            format!("required tensor `{missing}` is missing"),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_hugging_face() {
        assert_eq!(
            hf_tensor_name("blk.12.attn_output.weight").as_deref(),
            Some("model.layers.12.self_attn.o_proj.weight")
        );
        assert_eq!(
            hf_tensor_name("token_embd.weight").as_deref(),
            Some("model.embed_tokens.weight")
        );
        assert_eq!(hf_tensor_name("blk.x.attn_q.weight"), None);
        assert_eq!(hf_tensor_name("rope_freqs.weight"), None);
    }

    /// llama.cpp's permutation, written out independently: view as
    /// [heads, 2, head_dim/2, cols], swap the middle axes.
    fn permute_like_llama_cpp(values: &[f32], heads: usize, cols: usize) -> Vec<f32> {
        let head_dim = values.len() / cols / heads;
        let half_dim = head_dim / 2;
        let mut out = Vec::with_capacity(values.len());
        for h in 0..heads {
            for i in 0..half_dim {
                for half in 0..2 {
                    let row = h * head_dim + half * half_dim + i;
                    out.extend_from_slice(&values[row * cols..(row + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        let (heads, head_dim, cols) = (3, 8, 5);
        let original: Vec<f32> = (0..heads * head_dim * cols).map(|v| v as f32).collect();
        let permuted = permute_like_llama_cpp(&original, heads, cols);
        assert_ne!(permuted, original);
        assert_eq!(unpermute_rows(&permuted, heads, cols), original);
    }
}
