//! Folded layers: a one-token step of a small model in three launches a layer instead of five
//! (kernels/gemv_fold.cu says how), and the matrices they multiply, built on the device from the
//! layer weights at load.
//!
//! A small model's batch-1 step is its launches: SmolLM2-135M's is 155 kernels of ~1.3 µs
//! boundary each and 63 µs of weights at the copy bandwidth. Folding takes it to 96 kernels for
//! twice the weight bytes a step, which such a model can afford and a large one cannot
//! ([`FOLD_MAX_HIDDEN`]): on an H100, +3.5% at 512 positions, +0.4–1.4% at 128, +2% served
//! (BENCHMARKS.md, "Folded layers").

use std::sync::Arc;

use half::bf16;

use super::device::{DPtr, Device, DeviceBuffer};
use super::kernels::Kernels;
use super::weights::{GpuWeights, Matrix};
use crate::error::{EngineError, Result};
use crate::model::ModelConfig;

/// Models of at most this hidden size fold their one-token steps (where the options ask): the
/// folded matrices double a step's weight bytes, which pays only where launches, not bytes,
/// bound the step (SmolLM2's 576, Qwen2.5-0.5B's 896, SmolLM2-360M's 960).
pub const FOLD_MAX_HIDDEN: usize = 1024;

/// One layer's folded matrices (`g` its norms' weights, `'` the next layer's).
#[derive(Debug, Clone, Copy)]
pub struct FoldedLayer {
    /// `[2·ffn + qkv', hidden + q_dim]`: rows `[W_gu·diag(g_ffn) | W_gu·diag(g_ffn)·W_o]`, then
    /// the next layer's `[W_qkv'·diag(g_attn') | W_qkv'·diag(g_attn')·W_o]` (none after the
    /// last layer).
    pub gate_up_qkv: DPtr<bf16>,
    /// `[qkv', ffn]`: `W_qkv'·diag(g_attn')·W_down`; null for the last layer.
    pub qkv_down: DPtr<bf16>,
}

/// Every layer's folded matrices, in one allocation.
pub struct FoldedWeights {
    _memory: DeviceBuffer,
    layers: Vec<FoldedLayer>,
}

/// Elements of layer `layer`'s two folded matrices.
fn layer_elems(c: &ModelConfig, layer: usize) -> (usize, usize) {
    let (h, q, f) = (c.hidden_size, c.q_dim(), c.intermediate_size);
    let next_qkv = if layer + 1 < c.num_layers {
        q + 2 * c.kv_dim()
    } else {
        0
    };
    ((2 * f + next_qkv) * (h + q), next_qkv * f)
}

impl FoldedWeights {
    /// Whether a model of `config`'s shape folds: small enough ([`FOLD_MAX_HIDDEN`]) and every
    /// row a whole number of the kernels' chunks of 8.
    pub fn fits(config: &ModelConfig) -> bool {
        let c = config;
        c.hidden_size <= FOLD_MAX_HIDDEN
            && [c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size]
                .iter()
                .all(|n| n.is_multiple_of(8))
    }

    /// Bytes the folded matrices of a model of `config`'s shape take.
    pub fn bytes(config: &ModelConfig) -> usize {
        (0..config.num_layers)
            .map(|l| {
                let (gate_up, qkv) = layer_elems(config, l);
                (gate_up * 2).next_multiple_of(256) + (qkv * 2).next_multiple_of(256)
            })
            .sum()
    }

    /// Folds `weights` (bf16) on the device.
    pub fn build(
        device: &Arc<Device>,
        kernels: &Kernels,
        config: &ModelConfig,
        weights: &GpuWeights,
    ) -> Result<Self> {
        let c = config;
        let (h, q, f) = (c.hidden_size, c.q_dim(), c.intermediate_size);
        let qkv_width = q + 2 * c.kv_dim();
        let memory = DeviceBuffer::alloc(device, Self::bytes(c), "the folded layer weights")?;
        let bf16_weight = |m: Matrix| match m {
            Matrix::Bf16(w) => Ok(w),
            Matrix::Fp8 { .. } => Err(EngineError::CudaUnavailable(
                "folded layers need bf16 weights".into(),
            )),
        };
        let mut next = memory.ptr::<u8>();
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let w = weights.layer(l);
            let (gate_up_elems, qkv_elems) = layer_elems(c, l);
            let gate_up_qkv: DPtr<bf16> = next.cast();
            next = next.offset((gate_up_elems * 2).next_multiple_of(256));
            let last = l + 1 == c.num_layers;
            let qkv_down: DPtr<bf16> = if last { DPtr::NULL } else { next.cast() };
            next = next.offset((qkv_elems * 2).next_multiple_of(256));
            let stride = h + q;
            let wo = bf16_weight(w.wo)?;
            // Rows `rows` of `a·diag(g)` and `a·diag(g)·W_o` from row `first` on.
            let fold_in = |a: DPtr<bf16>, g: DPtr<bf16>, rows: usize, first: usize| {
                let out = gate_up_qkv.offset(first * stride);
                kernels.fold_weights(a, g, DPtr::NULL, out, (rows, h, h), stride, 0)?;
                kernels.fold_weights(a, g, wo, out, (rows, h, q), stride, h)
            };
            fold_in(bf16_weight(w.w_gate_up)?, w.ffn_norm, 2 * f, 0)?;
            if !last {
                let after = weights.layer(l + 1);
                let wqkv = bf16_weight(after.wqkv)?;
                fold_in(wqkv, after.attn_norm, qkv_width, 2 * f)?;
                let down = bf16_weight(w.w_down)?;
                let rows = (qkv_width, h, f);
                kernels.fold_weights(wqkv, after.attn_norm, down, qkv_down, rows, f, 0)?;
            }
            layers.push(FoldedLayer {
                gate_up_qkv,
                qkv_down,
            });
        }
        device.synchronize()?;
        Ok(FoldedWeights {
            _memory: memory,
            layers,
        })
    }

    pub fn layer(&self, layer: usize) -> FoldedLayer {
        self.layers[layer]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(hidden: usize, heads: usize, kv_heads: usize, ffn: usize) -> ModelConfig {
        let json = format!(
            r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": {hidden},
                "intermediate_size": {ffn}, "num_hidden_layers": 30,
                "num_attention_heads": {heads}, "num_key_value_heads": {kv_heads},
                "vocab_size": 49152, "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-5, "rope_theta": 100000.0}}"#
        );
        ModelConfig::from_json(&json, std::path::Path::new("config.json")).unwrap()
    }

    #[test]
    fn small_models_fold_and_large_ones_do_not() {
        assert!(FoldedWeights::fits(&shape(576, 9, 3, 1536)));
        assert!(FoldedWeights::fits(&shape(896, 14, 2, 4864)));
        assert!(!FoldedWeights::fits(&shape(4096, 32, 8, 14336)));
        assert!(!FoldedWeights::fits(&shape(576, 9, 3, 1540)));
    }

    /// SmolLM2-135M's folded matrices: per layer `[2·1536 + 960, 1152]` (none of the q/k/v
    /// rows after the last layer) and `[960, 1536]` (none after the last).
    #[test]
    fn the_folded_bytes_are_each_layers_two_matrices() {
        let c = shape(576, 9, 3, 1536);
        let per_layer = (4032 * 1152 + 960 * 1536) * 2;
        let last = 3072 * 1152 * 2;
        assert_eq!(FoldedWeights::bytes(&c), 29 * per_layer + last);
    }
}
