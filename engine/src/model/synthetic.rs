//! Small random-weight checkpoints written as real Hugging Face folders.
//!
//! Tests and benchmarks that need a model of a given shape, but not a trained one, write one
//! here: `config.json`, `model.safetensors` drawn from a seeded generator, a byte-level
//! tokenizer (every byte is a token, plus three ChatML specials) and a ChatML template. The
//! folder goes through the same loader as a downloaded checkpoint.

use std::collections::HashMap;
use std::path::Path;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::tensor::TensorView;
use serde_json::json;

use super::config::Architecture;
use crate::dtype::DType;
use crate::error::{EngineError, Result};

/// The specials come first, then one token per byte.
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
pub const SYNTHETIC_VOCAB: usize = SPECIALS.len() + 256;
const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// The shape and seed of a synthetic checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticSpec {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub max_position_embeddings: usize,
    /// At least [`SYNTHETIC_VOCAB`]; ids past the tokenizer's are never produced by it.
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    pub sliding_window: Option<usize>,
    pub dtype: DType,
    pub seed: u64,
}

impl SyntheticSpec {
    /// A two-layer model small enough for unit-speed tests (hidden 64, 4 heads over 2 KV heads).
    pub fn tiny(seed: u64) -> Self {
        Self {
            architecture: Architecture::Llama,
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            max_position_embeddings: 2048,
            vocab_size: SYNTHETIC_VOCAB,
            tie_word_embeddings: true,
            sliding_window: None,
            dtype: DType::F32,
            seed,
        }
    }

    /// SmolLM2-135M's shape (30 layers, hidden 576, 9 heads over 3 KV heads, vocabulary 49152),
    /// in bf16.
    pub fn smollm2(seed: u64) -> Self {
        Self {
            hidden_size: 576,
            intermediate_size: 1536,
            num_layers: 30,
            num_heads: 9,
            num_kv_heads: 3,
            max_position_embeddings: 8192,
            vocab_size: 49_152,
            dtype: DType::BF16,
            ..Self::tiny(seed)
        }
    }

    fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }
}

/// Writes the folder for `spec` into `dir` (created if missing).
pub fn write(dir: &Path, spec: &SyntheticSpec) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, e))?;
    write_file(&dir.join("config.json"), &config_json(spec))?;
    write_file(&dir.join("tokenizer.json"), &tokenizer_json())?;
    let tokenizer_config =
        json!({ "eos_token": SPECIALS[2], "bos_token": SPECIALS[1], "chat_template": CHATML });
    write_file(
        &dir.join("tokenizer_config.json"),
        &tokenizer_config.to_string(),
    )?;
    write_weights(&dir.join("model.safetensors"), spec)
}

fn write_file(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|e| EngineError::io(path, e))
}

fn config_json(spec: &SyntheticSpec) -> String {
    let architecture = match spec.architecture {
        Architecture::Llama => "LlamaForCausalLM",
        Architecture::Mistral => "MistralForCausalLM",
        Architecture::Qwen2 => "Qwen2ForCausalLM",
    };
    json!({
        "architectures": [architecture],
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "sliding_window": spec.sliding_window,
        "use_sliding_window": spec.sliding_window.is_some(),
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": spec.dtype.torch_name(),
    })
    .to_string()
}

/// GPT-2's byte-to-character table: printable bytes map to themselves, the rest to U+0100...
fn byte_chars() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).expect("a byte value is a char")
            } else {
                next += 1;
                char::from_u32(next - 1).expect("below the surrogates")
            }
        })
        .collect()
}

fn tokenizer_json() -> String {
    let mut vocab = serde_json::Map::new();
    for (id, special) in SPECIALS.iter().enumerate() {
        vocab.insert(special.to_string(), json!(id));
    }
    for (b, c) in byte_chars().into_iter().enumerate() {
        vocab.insert(c.to_string(), json!(SPECIALS.len() + b));
    }
    let added: Vec<_> = SPECIALS
        .iter()
        .enumerate()
        .map(|(id, s)| json!({"id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true },
        "post_processor": null,
        "decoder": { "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true },
        "model": { "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                   "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": [] },
    })
    .to_string()
}

/// Every tensor's name and shape, in Hugging Face's naming.
fn tensor_shapes(spec: &SyntheticSpec) -> Vec<(String, Vec<usize>)> {
    let (h, f, d) = (spec.hidden_size, spec.intermediate_size, spec.head_dim());
    let (q, kv) = (spec.num_heads * d, spec.num_kv_heads * d);
    let mut shapes = vec![
        (
            "model.embed_tokens.weight".to_string(),
            vec![spec.vocab_size, h],
        ),
        ("model.norm.weight".into(), vec![h]),
    ];
    if !spec.tie_word_embeddings {
        shapes.push(("lm_head.weight".into(), vec![spec.vocab_size, h]));
    }
    for i in 0..spec.num_layers {
        let p = |leaf: &str| format!("model.layers.{i}.{leaf}");
        shapes.extend([
            (p("input_layernorm.weight"), vec![h]),
            (p("post_attention_layernorm.weight"), vec![h]),
            (p("self_attn.q_proj.weight"), vec![q, h]),
            (p("self_attn.k_proj.weight"), vec![kv, h]),
            (p("self_attn.v_proj.weight"), vec![kv, h]),
            (p("self_attn.o_proj.weight"), vec![h, q]),
            (p("mlp.gate_proj.weight"), vec![f, h]),
            (p("mlp.up_proj.weight"), vec![f, h]),
            (p("mlp.down_proj.weight"), vec![h, f]),
        ]);
        if spec.architecture == Architecture::Qwen2 {
            shapes.extend([
                (p("self_attn.q_proj.bias"), vec![q]),
                (p("self_attn.k_proj.bias"), vec![kv]),
                (p("self_attn.v_proj.bias"), vec![kv]),
            ]);
        }
    }
    shapes
}

/// Draws a tensor: norms near 1, biases and matrices uniform with a fan-in scale, so
/// activations stay in a realistic range through every layer.
fn draw(rng: &mut ChaCha8Rng, name: &str, shape: &[usize]) -> Vec<f32> {
    let n: usize = shape.iter().product();
    if name.ends_with("norm.weight") {
        return (0..n).map(|_| 1.0 + rng.random_range(-0.1..0.1)).collect();
    }
    let scale = if name.contains("embed_tokens") || name.ends_with(".bias") {
        1.0
    } else {
        (3.0 / shape[1] as f32).sqrt()
    };
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

fn write_weights(path: &Path, spec: &SyntheticSpec) -> Result<()> {
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = tensor_shapes(spec)
        .into_iter()
        .map(|(name, shape)| {
            let mut bytes = Vec::new();
            spec.dtype
                .encode_into(&draw(&mut rng, &name, &shape), &mut bytes);
            (name, shape, bytes)
        })
        .collect();
    let views = tensors.iter().map(|(name, shape, bytes)| {
        let view = TensorView::new(spec.dtype.to_safetensors(), shape.clone(), bytes)
            .expect("shape matches the drawn values");
        (name.clone(), view)
    });
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(|e| EngineError::Tensor {
        path: path.to_path_buf(),
        name: "*".into(),
        reason: e.to_string(),
    })
}
