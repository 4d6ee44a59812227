//! The CUDA backend's weights: every tensor in bf16 in one device allocation.
//!
//! The layout is decided from the configuration alone ([`WeightLayout`]), so the memory plan
//! knows the weights' size before anything is read. q/k/v and gate/up are fused as on the CPU
//! (their rows concatenated, since a weight is `[out, in]`); a tied model's vocabulary
//! projection is its embedding table. Tensors are copied from a checkpoint (converted to bf16 on
//! the host when stored in another type) or drawn on the device from a seed. A tensor-parallel
//! rank holds its shard of each (see [`crate::model::shard`]): row slices of q/k/v, gate/up and
//! the vocabulary projection, column slices of the output and down projections.
//!
//! With FP8 weights (`[engine] quantization = "fp8"`) the four projections of each layer are
//! held as e4m3 with one f32 scale a row (after the row's bytes), quantized on the device from
//! the bf16 values as they load (kernels/fp8.cu); the embedding, the norms, the biases and the
//! vocabulary projection stay bf16.

use std::ops::Range;
use std::sync::Arc;

use half::bf16;

use super::device::{DPtr, Device, DeviceBuffer};
use super::kernels::{Fp8Rows, Kernels, Window};
use crate::dtype::DType;
use crate::error::{EngineError, Result};
use crate::model::{ModelConfig, Shard, Weights};

/// Tensors start on 256-byte boundaries, as cuBLAS likes its operands.
const ALIGN_BYTES: usize = 256;

/// One checkpoint tensor's share of a slot: rows `row0..row0 + rows` of the tensor's
/// `tensor_rows`, and of its columns those the slot holds.
#[derive(Debug, Clone)]
struct Part {
    name: String,
    rows: usize,
    tensor_rows: usize,
    row0: usize,
    /// Where the tensor's rows start in the fused tensor one device holds whole (random weights
    /// are drawn by their place there).
    fused_row0: usize,
}

/// One fused tensor: its checkpoint parts, the columns it holds of each (`col0..col0 + cols`
/// of `full_cols`; a vector has one), its place.
#[derive(Debug, Clone)]
struct Slot {
    parts: Vec<Part>,
    cols: usize,
    col0: usize,
    full_cols: usize,
    offset_bytes: usize,
    /// Held as e4m3, its rows' scales at this offset; `None`: bf16.
    fp8_scales_bytes: Option<usize>,
}

impl Slot {
    fn rows(&self) -> usize {
        self.parts.iter().map(|p| p.rows).sum::<usize>()
    }

    fn elems(&self) -> usize {
        self.rows() * self.cols
    }

    /// How random weights for this tensor are drawn: norms near 1, the embedding and biases in
    /// [-1, 1), matrices with a fan-in scale (as `model::synthetic` draws them).
    fn random_range(&self) -> (f32, f32) {
        let name = &self.parts[0].name;
        if name.ends_with("norm.weight") {
            (0.9, 1.1)
        } else if name.contains("embed_tokens") || name.ends_with(".bias") {
            (-1.0, 1.0)
        } else {
            let scale = (3.0 / self.full_cols as f32).sqrt();
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
    /// The vocabulary rows this rank holds, of the embedding and the projection alike.
    vocab: Range<usize>,
    fp8: bool,
}

/// Slots per layer, in order: attention norm, qkv, o, MLP norm, gate/up, down, [qkv bias].
const LAYER_SLOTS: usize = 6;

/// A tensor's rows `range` of `total`, at `fused_row0` in its fused tensor.
fn part(name: String, total: usize, range: Range<usize>, fused_row0: usize) -> Part {
    Part {
        name,
        rows: range.len(),
        tensor_rows: total,
        row0: range.start,
        fused_row0,
    }
}

impl WeightLayout {
    /// The tensors rank `shard` holds of a model of `c` (all of them for [`Shard::WHOLE`]), the
    /// layers' projections in e4m3 where `fp8`.
    pub fn new(c: &ModelConfig, shard: Shard, fp8: bool) -> Self {
        let (h, f, q, kv, v, d) = (
            c.hidden_size,
            c.intermediate_size,
            c.q_dim(),
            c.kv_dim(),
            c.vocab_size,
            c.head_dim,
        );
        let heads = shard.heads(c);
        let (q_rows, kv_rows) = (
            heads.start * d..heads.end * d,
            shard.kv_heads(c).start * d..shard.kv_heads(c).end * d,
        );
        let mlp = shard.mlp(c);
        let whole = |name: String, rows: usize| vec![part(name, rows, 0..rows, 0)];
        // (parts, columns held, full columns, a projection)
        let vocab = shard.vocab(c);
        let mut specs: Vec<(Vec<Part>, Range<usize>, usize, bool)> = vec![(
            vec![part(
                "model.embed_tokens.weight".into(),
                v,
                vocab.clone(),
                0,
            )],
            0..h,
            h,
            false,
        )];
        for i in 0..c.num_layers {
            let p = |leaf: &str| format!("model.layers.{i}.{leaf}");
            let qkv = |kind: &str| {
                vec![
                    part(p(&format!("self_attn.q_proj.{kind}")), q, q_rows.clone(), 0),
                    part(
                        p(&format!("self_attn.k_proj.{kind}")),
                        kv,
                        kv_rows.clone(),
                        q,
                    ),
                    part(
                        p(&format!("self_attn.v_proj.{kind}")),
                        kv,
                        kv_rows.clone(),
                        q + kv,
                    ),
                ]
            };
            specs.extend([
                (whole(p("input_layernorm.weight"), h), 0..1, 1, false),
                (qkv("weight"), 0..h, h, true),
                (
                    whole(p("self_attn.o_proj.weight"), h),
                    q_rows.clone(),
                    q,
                    true,
                ),
                (
                    whole(p("post_attention_layernorm.weight"), h),
                    0..1,
                    1,
                    false,
                ),
                (
                    vec![
                        part(p("mlp.gate_proj.weight"), f, mlp.clone(), 0),
                        part(p("mlp.up_proj.weight"), f, mlp.clone(), f),
                    ],
                    0..h,
                    h,
                    true,
                ),
                (whole(p("mlp.down_proj.weight"), h), mlp.clone(), f, true),
            ]);
            if c.qkv_bias {
                specs.push((qkv("bias"), 0..1, 1, false));
            }
        }
        specs.push((whole("model.norm.weight".into(), h), 0..1, 1, false));
        if !c.tie_word_embeddings {
            specs.push((
                vec![part("lm_head.weight".into(), v, vocab.clone(), 0)],
                0..h,
                h,
                false,
            ));
        }
        let mut bytes = 0;
        let slots = specs
            .into_iter()
            .map(|(parts, cols, full_cols, projection)| {
                let mut slot = Slot {
                    parts,
                    cols: cols.len(),
                    col0: cols.start,
                    full_cols,
                    offset_bytes: bytes,
                    fp8_scales_bytes: None,
                };
                if fp8 && projection {
                    bytes += slot.elems().next_multiple_of(ALIGN_BYTES);
                    slot.fp8_scales_bytes = Some(bytes);
                    bytes += (slot.rows() * 4).next_multiple_of(ALIGN_BYTES);
                } else {
                    bytes += (slot.elems() * 2).next_multiple_of(ALIGN_BYTES);
                }
                slot
            })
            .collect();
        WeightLayout {
            slots,
            bytes,
            tied: c.tie_word_embeddings,
            qkv_bias: c.qkv_bias,
            vocab,
            fp8,
        }
    }

    /// Elements of the largest tensor held in e4m3 (0 for none): the bf16 staging its values
    /// pass through on the device.
    fn largest_fp8_elems(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| s.fp8_scales_bytes.is_some())
            .map(Slot::elems)
            .max()
            .unwrap_or(0)
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

/// A projection's weight, `[out, in]`.
#[derive(Debug, Clone, Copy)]
pub enum Matrix {
    Bf16(DPtr<bf16>),
    /// e4m3 values and one f32 scale a row: row `r` is `w[r] · scales[r]`.
    Fp8 {
        w: DPtr<u8>,
        scales: DPtr<f32>,
    },
}

impl Matrix {
    /// The bf16 weight. Only paths that FP8 weights never take ask (the gemv kernels, GEMM
    /// tuning): an FP8 weight there is a bug.
    pub fn bf16(self) -> DPtr<bf16> {
        match self {
            Matrix::Bf16(w) => w,
            Matrix::Fp8 { .. } => panic!("an FP8 weight where a bf16 one is needed"),
        }
    }
}

/// Pointers to one layer's tensors.
#[derive(Debug, Clone, Copy)]
pub struct LayerWeights {
    pub attn_norm: DPtr<bf16>,
    /// `[q_dim + 2·kv_dim, hidden]`.
    pub wqkv: Matrix,
    /// `[q_dim + 2·kv_dim]`, or null.
    pub bqkv: DPtr<bf16>,
    /// `[hidden, q_dim]`.
    pub wo: Matrix,
    pub ffn_norm: DPtr<bf16>,
    /// `[2·ffn, hidden]`: gate rows, then up.
    pub w_gate_up: Matrix,
    /// `[hidden, ffn]`.
    pub w_down: Matrix,
}

/// The weights on the device, and the rotary frequencies.
pub struct GpuWeights {
    layout: WeightLayout,
    memory: DeviceBuffer,
    inv_freq: DeviceBuffer,
}

impl GpuWeights {
    /// Allocates rank `shard`'s weights (the projections in e4m3 where `fp8`) and copies them
    /// from a checkpoint.
    pub fn load(
        device: &Arc<Device>,
        kernels: &Kernels,
        config: &ModelConfig,
        shard: Shard,
        fp8: bool,
        checkpoint: &Weights,
    ) -> Result<Self> {
        let weights = Self::alloc(device, config, shard, fp8)?;
        let fp8_staging = weights.fp8_staging(device)?;
        let (mut staging, mut window) = (Vec::new(), Vec::new());
        for slot in &weights.layout.slots {
            let mut at = weights.bf16_destination(slot, fp8_staging.as_ref());
            for part in &slot.parts {
                let shape: &[usize] = if slot.full_cols == 1 {
                    &[part.tensor_rows]
                } else {
                    &[part.tensor_rows, slot.full_cols]
                };
                let bytes = bf16_bytes(checkpoint, &part.name, shape, &mut staging)?;
                let held = held_bytes(bytes, part, slot, &mut window);
                device.upload(held, at)?;
                at = at.offset(held.len());
            }
            weights.quantize(kernels, slot, fp8_staging.as_ref())?;
        }
        device.synchronize()?;
        Ok(weights)
    }

    /// The device buffer the bf16 values of a tensor held in e4m3 pass through, if any is.
    fn fp8_staging(&self, device: &Arc<Device>) -> Result<Option<DeviceBuffer>> {
        let elems = self.layout.largest_fp8_elems();
        (elems > 0)
            .then(|| DeviceBuffer::alloc(device, elems * 2, "FP8 weights' bf16 staging"))
            .transpose()
    }

    /// Where `slot`'s bf16 values are written: its place, or the staging they are quantized
    /// from if it is held in e4m3.
    fn bf16_destination(&self, slot: &Slot, staging: Option<&DeviceBuffer>) -> DPtr<u8> {
        match staging {
            Some(bf16) if slot.fp8_scales_bytes.is_some() => bf16.ptr(),
            _ => self.memory.ptr::<u8>().offset(slot.offset_bytes),
        }
    }

    /// Quantizes `slot`'s bf16 values from `staging` into its place, if it is held in e4m3.
    fn quantize(
        &self,
        kernels: &Kernels,
        slot: &Slot,
        staging: Option<&DeviceBuffer>,
    ) -> Result<()> {
        let (Some(scales), Some(staging)) = (slot.fp8_scales_bytes, staging) else {
            return Ok(());
        };
        let base = self.memory.ptr::<u8>();
        let out = Fp8Rows {
            values: base.offset(slot.offset_bytes),
            scales: base.offset(scales).cast(),
        };
        kernels.quantize_rows_e4m3(staging.ptr(), out, slot.rows(), slot.cols)
    }

    /// Allocates rank `shard`'s weights and draws them on the device from `seed`: each value
    /// is the one a single device would draw at its place in the whole model.
    pub fn random(
        device: &Arc<Device>,
        kernels: &Kernels,
        config: &ModelConfig,
        shard: Shard,
        fp8: bool,
        seed: u64,
    ) -> Result<Self> {
        let weights = Self::alloc(device, config, shard, fp8)?;
        let fp8_staging = weights.fp8_staging(device)?;
        for (i, slot) in weights.layout.slots.iter().enumerate() {
            let tensor_seed = seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let mut at = weights
                .bf16_destination(slot, fp8_staging.as_ref())
                .cast::<bf16>();
            for part in &slot.parts {
                let window = Window {
                    rows: part.rows,
                    cols: slot.cols,
                    row0: part.fused_row0 + part.row0,
                    col0: slot.col0,
                    full_cols: slot.full_cols,
                };
                kernels.fill_uniform_window(at, window, tensor_seed, slot.random_range())?;
                at = at.offset(part.rows * slot.cols);
            }
            weights.quantize(kernels, slot, fp8_staging.as_ref())?;
        }
        device.synchronize()?;
        Ok(weights)
    }

    fn alloc(device: &Arc<Device>, config: &ModelConfig, shard: Shard, fp8: bool) -> Result<Self> {
        let layout = WeightLayout::new(config, shard, fp8);
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

    /// Whether the projections are held in e4m3.
    pub fn fp8(&self) -> bool {
        self.layout.fp8
    }

    /// `[vocab / world, hidden]`: this rank's rows of the embedding table (`embed_rows`).
    pub fn embed(&self) -> DPtr<bf16> {
        self.at(&self.layout.slots[0])
    }

    /// The vocabulary rows this rank holds (every row on one device).
    pub fn embed_rows(&self) -> Range<usize> {
        self.layout.vocab.clone()
    }

    /// The final norm.
    pub fn norm(&self) -> DPtr<bf16> {
        let index = self.layout.slots.len() - 1 - !self.layout.tied as usize;
        self.at(&self.layout.slots[index])
    }

    /// `[vocab / world, hidden]`, this rank's rows of the vocabulary projection: its rows of the
    /// embedding table when the model ties them.
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
        let matrix = |index| {
            let slot = self.layout.layer_slot(layer, index);
            match slot.fp8_scales_bytes {
                None => Matrix::Bf16(self.at(slot)),
                Some(scales) => Matrix::Fp8 {
                    w: self.memory.ptr::<u8>().offset(slot.offset_bytes),
                    scales: self.memory.ptr::<u8>().offset(scales).cast(),
                },
            }
        };
        LayerWeights {
            attn_norm: slot(0),
            wqkv: matrix(1),
            wo: matrix(2),
            ffn_norm: slot(3),
            w_gate_up: matrix(4),
            w_down: matrix(5),
            bqkv: if self.layout.qkv_bias {
                slot(LAYER_SLOTS)
            } else {
                DPtr::NULL
            },
        }
    }
}

/// The bytes of `part`'s rows and `slot`'s columns in a tensor's bf16 `bytes`: a slice where
/// the slot holds whole rows, else gathered into `window`.
fn held_bytes<'a>(bytes: &'a [u8], part: &Part, slot: &Slot, window: &'a mut Vec<u8>) -> &'a [u8] {
    let row_bytes = slot.full_cols * 2;
    if slot.cols == slot.full_cols {
        return &bytes[part.row0 * row_bytes..(part.row0 + part.rows) * row_bytes];
    }
    window.clear();
    for r in part.row0..part.row0 + part.rows {
        let start = r * row_bytes + slot.col0 * 2;
        window.extend_from_slice(&bytes[start..start + slot.cols * 2]);
    }
    window
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

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ModelConfig {
        let json = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 32, "max_position_embeddings": 128,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": false}"#;
        ModelConfig::from_json(json, std::path::Path::new("config.json")).unwrap()
    }

    /// A tensor of `rows` × `cols` bf16 whose element (r, c) holds the value r·cols + c.
    fn numbered(rows: usize, cols: usize) -> Vec<u8> {
        (0..rows * cols)
            .flat_map(|i| (i as u16).to_le_bytes())
            .collect()
    }

    fn values(bytes: &[u8]) -> Vec<u16> {
        bytes
            .chunks(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect()
    }

    /// Every element each rank's slots hold, as the numbered checkpoint tensors give them.
    fn held(c: &ModelConfig, shard: Shard) -> Vec<Vec<u16>> {
        let layout = WeightLayout::new(c, shard, false);
        let mut window = Vec::new();
        layout
            .slots
            .iter()
            .map(|slot| {
                let mut out = Vec::new();
                for part in &slot.parts {
                    let bytes = numbered(part.tensor_rows, slot.full_cols);
                    out.extend(values(held_bytes(&bytes, part, slot, &mut window)));
                }
                out
            })
            .collect()
    }

    #[test]
    fn the_ranks_shards_put_together_are_the_whole_tensors() {
        let c = config();
        let whole = held(&c, Shard::WHOLE);
        let ranks: Vec<_> = (0..2)
            .map(|rank| held(&c, Shard { rank, world: 2 }))
            .collect();
        let (q, kv, h, f) = (c.q_dim(), c.kv_dim(), c.hidden_size, c.intermediate_size);
        // Slots: embed, attn norm, qkv, o, mlp norm, gate/up, down, final norm, lm head.
        assert_eq!(whole.len(), 9);
        for (i, (a, b)) in ranks[0].iter().zip(&ranks[1]).enumerate() {
            let joined: Vec<u16> = match i {
                // Replicated: the norms.
                1 | 4 | 7 => {
                    assert_eq!(a, b, "slot {i} is the same on every rank");
                    a.clone()
                }
                // qkv rows: [q0 k0 v0] and [q1 k1 v1] make [q0 q1 k0 k1 v0 v1].
                2 => {
                    let (qh, kh) = (q / 2 * h, kv / 2 * h);
                    [
                        &a[..qh],
                        &b[..qh],
                        &a[qh..qh + kh],
                        &b[qh..qh + kh],
                        &a[qh + kh..],
                        &b[qh + kh..],
                    ]
                    .concat()
                }
                // Columns: each row is rank 0's half then rank 1's.
                3 | 6 => {
                    let half = a.len() / h;
                    (0..h)
                        .flat_map(|r| {
                            [&a[r * half..(r + 1) * half], &b[r * half..(r + 1) * half]].concat()
                        })
                        .collect()
                }
                // gate/up rows: [g0 u0] and [g1 u1] make [g0 g1 u0 u1].
                5 => {
                    let g = f / 2 * h;
                    [&a[..g], &b[..g], &a[g..], &b[g..]].concat()
                }
                // The embedding's and the vocabulary projection's rows.
                0 | 8 => [a.as_slice(), b.as_slice()].concat(),
                _ => unreachable!(),
            };
            assert_eq!(joined, whole[i], "slot {i}");
        }
        let bytes = |s: Shard| WeightLayout::new(&c, s, false).bytes();
        assert!(bytes(Shard { rank: 0, world: 2 }) < bytes(Shard::WHOLE));
    }

    #[test]
    fn fp8_layouts_hold_each_projection_in_a_byte_an_element_and_a_scale_a_row() {
        let c = config();
        let bf16 = WeightLayout::new(&c, Shard::WHOLE, false);
        let fp8 = WeightLayout::new(&c, Shard::WHOLE, true);
        assert_eq!(bf16.slots.len(), fp8.slots.len());
        assert!(bf16.slots.iter().all(|s| s.fp8_scales_bytes.is_none()));
        let mut end = 0;
        let mut projections = 0;
        for (i, slot) in fp8.slots.iter().enumerate() {
            assert!(slot.offset_bytes >= end, "slot {i} overlaps the one before");
            assert_eq!(slot.offset_bytes % ALIGN_BYTES, 0);
            end = match slot.fp8_scales_bytes {
                Some(scales) => {
                    projections += 1;
                    assert!(scales >= slot.offset_bytes + slot.elems());
                    assert_eq!(scales % ALIGN_BYTES, 0);
                    scales + slot.rows() * 4
                }
                None => slot.offset_bytes + slot.elems() * 2,
            };
        }
        assert!(end <= fp8.bytes());
        // The four projections of each layer; the embedding, norms and lm_head stay bf16.
        assert_eq!(projections, 4 * c.num_layers);
        let (h, f, q, kv) = (c.hidden_size, c.intermediate_size, c.q_dim(), c.kv_dim());
        let projection_elems = (q + 2 * kv) * h + h * q + 2 * f * h + h * f;
        // Each projection's elements (multiples of 256 here) take a byte instead of two, and
        // its scales take their rows' aligned f32s.
        let scales: usize = fp8
            .slots
            .iter()
            .filter(|s| s.fp8_scales_bytes.is_some())
            .map(|s| (s.rows() * 4).next_multiple_of(ALIGN_BYTES))
            .sum();
        assert_eq!(
            bf16.bytes() - fp8.bytes(),
            c.num_layers * projection_elems - scales
        );
        assert_eq!(fp8.largest_fp8_elems(), 2 * f * h);
        assert_eq!(bf16.largest_fp8_elems(), 0);
    }
}
