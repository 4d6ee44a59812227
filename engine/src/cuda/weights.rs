//! The CUDA backend's weights: every tensor in bf16 in one device allocation.
//!
//! The layout is decided from the configuration alone ([`WeightLayout`]), so the memory plan
//! knows the weights' size before anything is read. q/k/v and gate/up are fused as on the CPU
//! (their rows concatenated, since a weight is `[out, in]`); a tied model's vocabulary
//! projection is its embedding table. Tensors are copied from a checkpoint (converted to bf16 on
//! the host when stored in another type) or drawn on the device from a seed.

use std::sync::Arc;

use half::bf16;

use super::device::{DPtr, Device, DeviceBuffer};
use super::kernels::Kernels;
use crate::dtype::DType;
use crate::error::{EngineError, Result};
use crate::model::{ModelConfig, Weights};

/// Tensors start on 256-byte boundaries, as cuBLAS likes its operands.
const ALIGN_BYTES: usize = 256;

/// One fused tensor: its checkpoint parts (name, rows), its row width (1 for a vector), its
/// place.
#[derive(Debug, Clone)]
struct Slot {
    parts: Vec<(String, usize)>,
    cols: usize,
    offset_bytes: usize,
}

impl Slot {
    fn elems(&self) -> usize {
        self.parts.iter().map(|(_, rows)| rows).sum::<usize>() * self.cols
    }

    /// How random weights for this tensor are drawn: norms near 1, the embedding and biases in
    /// [-1, 1), matrices with a fan-in scale (as `model::synthetic` draws them).
    fn random_range(&self) -> (f32, f32) {
        let name = &self.parts[0].0;
        if name.ends_with("norm.weight") {
            (0.9, 1.1)
        } else if name.contains("embed_tokens") || name.ends_with(".bias") {
            (-1.0, 1.0)
        } else {
            let scale = (3.0 / self.cols as f32).sqrt();
            (-scale, scale)
        }
    }
}

/// Where each tensor goes in the weights' allocation.
#[derive(Debug, Clone)]
pub struct WeightLayout {
    slots: Vec<Slot>,
    bytes: usize,
    tied: bool,
    qkv_bias: bool,
}

/// Slots per layer, in order: attention norm, qkv, o, MLP norm, gate/up, down, [qkv bias].
const LAYER_SLOTS: usize = 6;

impl WeightLayout {
    pub fn new(c: &ModelConfig) -> Self {
        let (h, f, q, kv, v) = (
            c.hidden_size,
            c.intermediate_size,
            c.q_dim(),
            c.kv_dim(),
            c.vocab_size,
        );
        let mut specs: Vec<(Vec<(String, usize)>, usize)> =
            vec![(vec![("model.embed_tokens.weight".into(), v)], h)];
        for i in 0..c.num_layers {
            let p = |leaf: &str| format!("model.layers.{i}.{leaf}");
            let qkv = |kind: &str| {
                vec![
                    (p(&format!("self_attn.q_proj.{kind}")), q),
                    (p(&format!("self_attn.k_proj.{kind}")), kv),
                    (p(&format!("self_attn.v_proj.{kind}")), kv),
                ]
            };
            specs.extend([
                (vec![(p("input_layernorm.weight"), h)], 1),
                (qkv("weight"), h),
                (vec![(p("self_attn.o_proj.weight"), h)], q),
                (vec![(p("post_attention_layernorm.weight"), h)], 1),
                (
                    vec![(p("mlp.gate_proj.weight"), f), (p("mlp.up_proj.weight"), f)],
                    h,
                ),
                (vec![(p("mlp.down_proj.weight"), h)], f),
            ]);
            if c.qkv_bias {
                specs.push((qkv("bias"), 1));
            }
        }
        specs.push((vec![("model.norm.weight".into(), h)], 1));
        if !c.tie_word_embeddings {
            specs.push((vec![("lm_head.weight".into(), v)], h));
        }
        let mut bytes = 0;
        let slots = specs
            .into_iter()
            .map(|(parts, cols)| {
                let slot = Slot {
                    parts,
                    cols,
                    offset_bytes: bytes,
                };
                bytes += (slot.elems() * 2).next_multiple_of(ALIGN_BYTES);
                slot
            })
            .collect();
        WeightLayout {
            slots,
            bytes,
            tied: c.tie_word_embeddings,
            qkv_bias: c.qkv_bias,
        }
    }

    /// Bytes of the weights' allocation.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    fn layer_slot(&self, layer: usize, index: usize) -> &Slot {
        let per_layer = LAYER_SLOTS + self.qkv_bias as usize;
        &self.slots[1 + layer * per_layer + index]
    }
}

/// Pointers to one layer's tensors.
#[derive(Debug, Clone, Copy)]
pub struct LayerWeights {
    pub attn_norm: DPtr<bf16>,
    /// `[q_dim + 2·kv_dim, hidden]`.
    pub wqkv: DPtr<bf16>,
    /// `[q_dim + 2·kv_dim]`, or null.
    pub bqkv: DPtr<bf16>,
    /// `[hidden, q_dim]`.
    pub wo: DPtr<bf16>,
    pub ffn_norm: DPtr<bf16>,
    /// `[2·ffn, hidden]`: gate rows, then up.
    pub w_gate_up: DPtr<bf16>,
    /// `[hidden, ffn]`.
    pub w_down: DPtr<bf16>,
}

/// The weights on the device, and the rotary frequencies.
pub struct GpuWeights {
    layout: WeightLayout,
    memory: DeviceBuffer,
    inv_freq: DeviceBuffer,
}

impl GpuWeights {
    /// Allocates the weights and copies them from a checkpoint.
    pub fn load(device: &Arc<Device>, config: &ModelConfig, checkpoint: &Weights) -> Result<Self> {
        let weights = Self::alloc(device, config)?;
        let base = weights.memory.ptr::<u8>();
        let mut staging = Vec::new();
        for slot in &weights.layout.slots {
            let mut at = base.offset(slot.offset_bytes);
            for (name, rows) in &slot.parts {
                let shape: &[usize] = if slot.cols == 1 {
                    &[*rows]
                } else {
                    &[*rows, slot.cols]
                };
                let bytes = bf16_bytes(checkpoint, name, shape, &mut staging)?;
                device.upload(bytes, at)?;
                at = at.offset(bytes.len());
            }
        }
        device.synchronize()?;
        Ok(weights)
    }

    /// Allocates the weights and draws them on the device from `seed`.
    pub fn random(
        device: &Arc<Device>,
        kernels: &Kernels,
        config: &ModelConfig,
        seed: u64,
    ) -> Result<Self> {
        let weights = Self::alloc(device, config)?;
        let base = weights.memory.ptr::<u8>();
        for (i, slot) in weights.layout.slots.iter().enumerate() {
            let tensor_seed = seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let at = base.offset(slot.offset_bytes).cast();
            kernels.fill_uniform(at, slot.elems(), tensor_seed, slot.random_range())?;
        }
        device.synchronize()?;
        Ok(weights)
    }

    fn alloc(device: &Arc<Device>, config: &ModelConfig) -> Result<Self> {
        let layout = WeightLayout::new(config);
        let memory = DeviceBuffer::alloc(device, layout.bytes(), "the weights")?;
        let inv_freq = DeviceBuffer::alloc(device, config.head_dim / 2 * 4, "rope frequencies")?;
        device.upload(&config.rope_inv_freq(), inv_freq.ptr())?;
        Ok(GpuWeights {
            layout,
            memory,
            inv_freq,
        })
    }

    fn at(&self, slot: &Slot) -> DPtr<bf16> {
        self.memory.ptr::<u8>().offset(slot.offset_bytes).cast()
    }

    pub fn bytes(&self) -> u64 {
        self.layout.bytes() as u64
    }

    /// `[vocab, hidden]`.
    pub fn embed(&self) -> DPtr<bf16> {
        self.at(&self.layout.slots[0])
    }

    /// The final norm.
    pub fn norm(&self) -> DPtr<bf16> {
        let index = self.layout.slots.len() - 1 - !self.layout.tied as usize;
        self.at(&self.layout.slots[index])
    }

    /// `[vocab, hidden]`: the embedding table when the model ties them.
    pub fn lm_head(&self) -> DPtr<bf16> {
        if self.layout.tied {
            self.embed()
        } else {
            self.at(self.layout.slots.last().expect("a model has tensors"))
        }
    }

    pub fn inv_freq(&self) -> DPtr<f32> {
        self.inv_freq.ptr()
    }

    pub fn layer(&self, layer: usize) -> LayerWeights {
        let slot = |index| self.at(self.layout.layer_slot(layer, index));
        LayerWeights {
            attn_norm: slot(0),
            wqkv: slot(1),
            wo: slot(2),
            ffn_norm: slot(3),
            w_gate_up: slot(4),
            w_down: slot(5),
            bqkv: if self.layout.qkv_bias {
                slot(LAYER_SLOTS)
            } else {
                DPtr::NULL
            },
        }
    }
}

/// The bf16 bytes of a checkpoint tensor: its own bytes when stored in bf16, else converted
/// into `staging` (quantized blocks decoded first).
fn bf16_bytes<'a>(
    checkpoint: &'a Weights,
    name: &str,
    shape: &[usize],
    staging: &'a mut Vec<u8>,
) -> Result<&'a [u8]> {
    if checkpoint.blocks(name, shape)?.is_some() {
        let values = checkpoint.load_f32(name, shape)?;
        staging.clear();
        DType::BF16.encode_into(&values, staging);
        return Ok(staging);
    }
    let (path, dtype, bytes) = checkpoint.raw(name, shape)?;
    let dtype = DType::from_safetensors(dtype).ok_or_else(|| EngineError::Tensor {
        path: path.to_path_buf(),
        name: name.into(),
        reason: format!("dtype {dtype:?} is not supported (f32, f16, bf16 are)"),
    })?;
    if dtype == DType::BF16 {
        return Ok(bytes);
    }
    let mut values = vec![0f32; shape.iter().product()];
    dtype.decode_into(bytes, &mut values);
    staging.clear();
    DType::BF16.encode_into(&values, staging);
    Ok(staging)
}
