//! The CPU backend's weights: every tensor decoded to f32 once, q/k/v and gate/up fused.
//!
//! Fusing means one pass over the normalized activations feeds three (or two) projections:
//! the rows of q, k and v (gate and up) are simply concatenated, since a weight is `[out, in]`.

use crate::error::Result;
use crate::model::{ModelConfig, Weights};

pub struct Layer {
    pub attn_norm: Vec<f32>,
    /// `[q_dim + 2·kv_dim, hidden]`: q rows, then k, then v.
    pub wqkv: Vec<f32>,
    pub bqkv: Option<Vec<f32>>,
    /// `[hidden, q_dim]`.
    pub wo: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    /// `[2·ffn, hidden]`: gate rows, then up.
    pub w_gate_up: Vec<f32>,
    /// `[hidden, ffn]`.
    pub w_down: Vec<f32>,
}

pub struct CpuWeights {
    /// `[vocab, hidden]`.
    pub embed: Vec<f32>,
    pub layers: Vec<Layer>,
    pub norm: Vec<f32>,
    /// `[vocab, hidden]`, or `None` when tied to `embed`.
    pub lm_head: Option<Vec<f32>>,
}

impl CpuWeights {
    pub fn load(weights: &Weights, c: &ModelConfig) -> Result<Self> {
        let h = c.hidden_size;
        let layers = (0..c.num_layers)
            .map(|i| load_layer(weights, c, i))
            .collect::<Result<Vec<_>>>()?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(weights.load_f32("lm_head.weight", &[c.vocab_size, h])?)
        };
        Ok(Self {
            embed: weights.load_f32("model.embed_tokens.weight", &[c.vocab_size, h])?,
            layers,
            norm: weights.load_f32("model.norm.weight", &[h])?,
            lm_head,
        })
    }

    pub fn bytes(&self) -> u64 {
        let layer = |l: &Layer| {
            [
                &l.attn_norm,
                &l.wqkv,
                &l.wo,
                &l.ffn_norm,
                &l.w_gate_up,
                &l.w_down,
            ]
            .iter()
            .map(|v| v.len())
            .sum::<usize>()
                + l.bqkv.as_ref().map_or(0, Vec::len)
        };
        let elems = self.embed.len()
            + self.norm.len()
            + self.lm_head.as_ref().map_or(0, Vec::len)
            + self.layers.iter().map(layer).sum::<usize>();
        elems as u64 * 4
    }

    pub fn lm_head(&self) -> &[f32] {
        self.lm_head.as_deref().unwrap_or(&self.embed)
    }
}

/// Loads named tensors of the given row counts into consecutive rows of one buffer.
fn load_stacked(weights: &Weights, parts: &[(String, usize)], cols: usize) -> Result<Vec<f32>> {
    let total: usize = parts.iter().map(|(_, rows)| rows).sum();
    let mut out = vec![0f32; total * cols];
    let mut at = 0;
    for (name, rows) in parts {
        let shape: &[usize] = if cols == 1 { &[*rows] } else { &[*rows, cols] };
        weights.load_f32_into(name, shape, &mut out[at..at + rows * cols])?;
        at += rows * cols;
    }
    Ok(out)
}

fn load_layer(weights: &Weights, c: &ModelConfig, i: usize) -> Result<Layer> {
    let p = |leaf: &str| format!("model.layers.{i}.{leaf}");
    let (h, f) = (c.hidden_size, c.intermediate_size);
    let qkv = |kind: &str| {
        [
            (p(&format!("self_attn.q_proj.{kind}")), c.q_dim()),
            (p(&format!("self_attn.k_proj.{kind}")), c.kv_dim()),
            (p(&format!("self_attn.v_proj.{kind}")), c.kv_dim()),
        ]
    };
    let bqkv = if c.qkv_bias {
        Some(load_stacked(weights, &qkv("bias"), 1)?)
    } else {
        None
    };
    Ok(Layer {
        attn_norm: weights.load_f32(&p("input_layernorm.weight"), &[h])?,
        wqkv: load_stacked(weights, &qkv("weight"), h)?,
        bqkv,
        wo: weights.load_f32(&p("self_attn.o_proj.weight"), &[h, c.q_dim()])?,
        ffn_norm: weights.load_f32(&p("post_attention_layernorm.weight"), &[h])?,
        w_gate_up: load_stacked(
            weights,
            &[(p("mlp.gate_proj.weight"), f), (p("mlp.up_proj.weight"), f)],
            h,
        )?,
        w_down: weights.load_f32(&p("mlp.down_proj.weight"), &[h, f])?,
    })
}
