//! The CPU backend's weights, q/k/v and gate/up fused. Matrices stay bf16, or in their GGUF's
//! Q4_1 or Q8_0 blocks, where the checkpoint stores them so: a decode step reads half the
//! bytes, or a fifth. bf16 weights are widened to f32 exactly in the products ([`matmul`]), so
//! those are the bits the f32 copy would give; blocks multiply input rows quantized to 8 bits
//! in integers ([`int8`]), as llama.cpp does, within a documented tolerance of the f32 copy.
//! Everything else is decoded to f32 once.
//!
//! Fusing means one pass over the normalized activations feeds three (or two) projections:
//! the rows of q, k and v (gate and up) are simply concatenated, since a weight is `[out, in]`.

use half::bf16;

use super::blocks::{BlockQ4_1, BlockQ8_0};
use super::int8;
use super::matmul::{self, Weight};
use crate::error::Result;
use crate::model::{BlockType, ModelConfig, Weights};

/// A `[rows, cols]` weight matrix in the type it is kept in.
pub enum Matrix {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    Q4_1(Vec<BlockQ4_1>),
    Q8_0(Vec<BlockQ8_0>),
    /// Blocks multiplied by input rows quantized to 8 bits ([`int8`]).
    Int8Q4_1(Vec<BlockQ4_1>),
    Int8Q8_0(Vec<BlockQ8_0>),
}

impl Matrix {
    pub fn bytes(&self) -> usize {
        match self {
            Matrix::F32(w) => std::mem::size_of_val(w.as_slice()),
            Matrix::Bf16(w) => std::mem::size_of_val(w.as_slice()),
            Matrix::Q4_1(w) | Matrix::Int8Q4_1(w) => std::mem::size_of_val(w.as_slice()),
            Matrix::Q8_0(w) | Matrix::Int8Q8_0(w) => std::mem::size_of_val(w.as_slice()),
        }
    }

    /// `out[t, n] = x[t, k] · selfᵀ`: [`matmul::matmul`], or for `Int8` blocks
    /// [`int8::matmul`] (input rows quantized to 8 bits, integer products).
    pub fn matmul(&self, x: &[f32], rows: usize, k: usize, n: usize, out: &mut [f32]) {
        match self {
            Matrix::F32(w) => matmul::matmul(x, rows, k, w, n, out),
            Matrix::Bf16(w) => matmul::matmul(x, rows, k, w, n, out),
            Matrix::Q4_1(w) => matmul::matmul(x, rows, k, w, n, out),
            Matrix::Q8_0(w) => matmul::matmul(x, rows, k, w, n, out),
            Matrix::Int8Q4_1(w) => int8::matmul(x, rows, k, w, n, out),
            Matrix::Int8Q8_0(w) => int8::matmul(x, rows, k, w, n, out),
        }
    }

    /// The same matrix, its blocks (if any) multiplied by 8-bit input rows.
    fn with_int8_inputs(self) -> Matrix {
        match self {
            Matrix::Q4_1(w) => Matrix::Int8Q4_1(w),
            Matrix::Q8_0(w) => Matrix::Int8Q8_0(w),
            m => m,
        }
    }

    fn is_blocks(&self) -> bool {
        matches!(
            self,
            Matrix::Q4_1(_) | Matrix::Q8_0(_) | Matrix::Int8Q4_1(_) | Matrix::Int8Q8_0(_)
        )
    }

    /// Appends row `r` (of `cols`) as f32.
    pub fn extend_row(&self, r: usize, cols: usize, out: &mut Vec<f32>) {
        fn widen<W: Weight>(w: &[W], r: usize, cols: usize, out: &mut Vec<f32>) {
            let row = &w[r * cols / W::ELEMENTS..(r + 1) * cols / W::ELEMENTS];
            // SAFETY: `row` holds exactly `cols` elements.
            out.extend((0..cols).map(|i| unsafe { W::get(row.as_ptr(), i) }));
        }
        match self {
            Matrix::F32(w) => out.extend_from_slice(&w[r * cols..(r + 1) * cols]),
            Matrix::Bf16(w) => widen(w, r, cols, out),
            Matrix::Q4_1(w) | Matrix::Int8Q4_1(w) => widen(w, r, cols, out),
            Matrix::Q8_0(w) | Matrix::Int8Q8_0(w) => widen(w, r, cols, out),
        }
    }
}

pub struct Layer {
    pub attn_norm: Vec<f32>,
    /// `[q_dim + 2·kv_dim, hidden]`: q rows, then k, then v.
    pub wqkv: Matrix,
    pub bqkv: Option<Vec<f32>>,
    /// `[hidden, q_dim]`.
    pub wo: Matrix,
    pub ffn_norm: Vec<f32>,
    /// `[2·ffn, hidden]`: gate rows, then up.
    pub w_gate_up: Matrix,
    /// `[hidden, ffn]`.
    pub w_down: Matrix,
}

pub struct CpuWeights {
    /// `[vocab, hidden]`.
    pub embed: Matrix,
    pub layers: Vec<Layer>,
    pub norm: Vec<f32>,
    /// `[vocab, hidden]`, or `None` when tied to `embed`.
    pub lm_head: Option<Matrix>,
}

impl CpuWeights {
    /// Loads the weights; with `int8_inputs`, matrices in blocks multiply input rows quantized
    /// to 8 bits ([`int8`]).
    pub fn load(weights: &Weights, c: &ModelConfig, int8_inputs: bool) -> Result<Self> {
        let mut loaded = Self::load_exact(weights, c)?;
        if int8_inputs {
            loaded.embed = loaded.embed.with_int8_inputs();
            loaded.lm_head = loaded.lm_head.map(Matrix::with_int8_inputs);
            for layer in &mut loaded.layers {
                for m in [
                    &mut layer.wqkv,
                    &mut layer.wo,
                    &mut layer.w_gate_up,
                    &mut layer.w_down,
                ] {
                    *m = std::mem::replace(m, Matrix::F32(Vec::new())).with_int8_inputs();
                }
            }
        }
        Ok(loaded)
    }

    /// Whether any matrix is kept in blocks.
    pub fn has_blocks(&self) -> bool {
        let layers = self
            .layers
            .iter()
            .flat_map(|l| [&l.wqkv, &l.wo, &l.w_gate_up, &l.w_down]);
        layers
            .chain([&self.embed])
            .chain(self.lm_head.as_ref())
            .any(Matrix::is_blocks)
    }

    fn load_exact(weights: &Weights, c: &ModelConfig) -> Result<Self> {
        let h = c.hidden_size;
        let layers = (0..c.num_layers)
            .map(|i| load_layer(weights, c, i))
            .collect::<Result<Vec<_>>>()?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(load_matrix(
                weights,
                &[("lm_head.weight".into(), c.vocab_size)],
                h,
            )?)
        };
        Ok(Self {
            embed: load_matrix(
                weights,
                &[("model.embed_tokens.weight".into(), c.vocab_size)],
                h,
            )?,
            layers,
            norm: weights.load_f32("model.norm.weight", &[h])?,
            lm_head,
        })
    }

    pub fn bytes(&self) -> u64 {
        let layer = |l: &Layer| {
            [&l.wqkv, &l.wo, &l.w_gate_up, &l.w_down]
                .iter()
                .map(|m| m.bytes())
                .sum::<usize>()
                + (l.attn_norm.len() + l.ffn_norm.len() + l.bqkv.as_ref().map_or(0, Vec::len)) * 4
        };
        let bytes = self.embed.bytes()
            + self.norm.len() * 4
            + self.lm_head.as_ref().map_or(0, Matrix::bytes)
            + self.layers.iter().map(layer).sum::<usize>();
        bytes as u64
    }

    pub fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// Named tensors of the given row counts as consecutive rows of one matrix: in blocks of one
/// type when every one is stored in them, bf16 when every one is stored in bf16, else f32.
fn load_matrix(weights: &Weights, parts: &[(String, usize)], cols: usize) -> Result<Matrix> {
    let blocks = parts
        .iter()
        .map(|(name, rows)| weights.blocks(name, &[*rows, cols]))
        .collect::<Result<Vec<_>>>()?;
    if let Some(Some((ty, _))) = blocks.first()
        && blocks.iter().all(|b| b.is_some_and(|(t, _)| t == *ty))
    {
        let bytes: Vec<u8> = blocks
            .iter()
            .flat_map(|b| b.expect("all are blocks").1)
            .copied()
            .collect();
        return Ok(match ty {
            BlockType::Q4_1 => Matrix::Q4_1(BlockQ4_1::parse(&bytes)),
            BlockType::Q8_0 => Matrix::Q8_0(BlockQ8_0::parse(&bytes)),
        });
    }
    if blocks.iter().any(Option::is_some) {
        return Ok(Matrix::F32(load_stacked(weights, parts, cols)?));
    }
    let raw = parts
        .iter()
        .map(|(name, rows)| weights.raw(name, &[*rows, cols]))
        .collect::<Result<Vec<_>>>()?;
    if raw
        .iter()
        .any(|(_, dtype, _)| *dtype != safetensors::Dtype::BF16)
    {
        return Ok(Matrix::F32(load_stacked(weights, parts, cols)?));
    }
    let words = raw.iter().flat_map(|(_, _, bytes)| bytes.chunks_exact(2));
    Ok(Matrix::Bf16(
        words.map(|b| bf16::from_le_bytes([b[0], b[1]])).collect(),
    ))
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
        wqkv: load_matrix(weights, &qkv("weight"), h)?,
        bqkv,
        wo: load_matrix(weights, &[(p("self_attn.o_proj.weight"), h)], c.q_dim())?,
        ffn_norm: weights.load_f32(&p("post_attention_layernorm.weight"), &[h])?,
        w_gate_up: load_matrix(
            weights,
            &[(p("mlp.gate_proj.weight"), f), (p("mlp.up_proj.weight"), f)],
            h,
        )?,
        w_down: load_matrix(weights, &[(p("mlp.down_proj.weight"), h)], f)?,
    })
}
