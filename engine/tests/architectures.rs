//! Each supported architecture against its own implementation in Hugging Face transformers:
//! tiny checkpoints that transformers built with random weights and saved
//! (`fixtures/make_tiny_fixtures.py`), Llama with Llama 3.1 RoPE scaling, Qwen2 with q/k/v
//! bias, Mistral with a sliding window of 8 over a 40-token prompt. Logits of every position
//! must match within 1e-4, whole and in chunks.

mod common;

use cache::PageId;
use common::{fixture_path, max_abs_diff};
use engine::backend::{Backend, LogitsWanted, RowPlan, StepPlan};
use engine::cpu::{CpuBackend, CpuOptions};
use engine::model::{Architecture, ModelConfig, RopeScaling, Weights};
use safetensors::SafeTensors;

struct Expected {
    ids: Vec<u32>,
    logits: Vec<f32>,
}

fn expected(dir: &std::path::Path) -> Expected {
    let bytes = std::fs::read(dir.join("logits.safetensors")).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let ids = tensors
        .tensor("ids")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect();
    let logits = tensors
        .tensor("logits")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    Expected { ids, logits }
}

fn check(arch: &str, expect_architecture: Architecture) -> ModelConfig {
    let dir = fixture_path("tiny").join(arch);
    let config = ModelConfig::from_dir(&dir).unwrap();
    assert_eq!(config.architecture, expect_architecture);
    let weights = Weights::open(&dir).unwrap();
    let mut backend = CpuBackend::from_weights(
        config.clone(),
        &weights,
        &CpuOptions {
            threads: 2,
            page_tokens: 4,
            num_pages: 16,
        },
    )
    .unwrap();
    let want = expected(&dir);
    let vocab = config.vocab_size;
    let pages: Vec<PageId> = (0..16).rev().map(PageId).collect();
    for chunk in [want.ids.len(), 7, 1] {
        let mut got = Vec::new();
        for (i, tokens) in want.ids.chunks(chunk).enumerate() {
            let row = RowPlan {
                tokens: tokens.to_vec(),
                start_pos: i * chunk,
                pages: pages.clone(),
                logits: LogitsWanted::All,
            };
            got.extend(backend.step(&StepPlan { rows: vec![row] }).unwrap().logits);
        }
        for pos in 0..want.ids.len() {
            let err = max_abs_diff(
                &got[pos * vocab..(pos + 1) * vocab],
                &want.logits[pos * vocab..(pos + 1) * vocab],
            );
            assert!(
                err < 1e-4,
                "{arch}, chunks of {chunk}: position {pos} max abs error {err}"
            );
        }
    }
    config
}

#[test]
fn llama_with_llama3_rope_scaling_matches_transformers() {
    let config = check("llama", Architecture::Llama);
    assert!(matches!(config.rope_scaling, RopeScaling::Llama3 { .. }));
    assert_eq!(config.rope_theta, 500000.0);
}

#[test]
fn qwen2_with_qkv_bias_matches_transformers() {
    let config = check("qwen2", Architecture::Qwen2);
    assert!(config.qkv_bias);
}

#[test]
fn mistral_with_a_sliding_window_matches_transformers() {
    let config = check("mistral", Architecture::Mistral);
    assert_eq!(config.sliding_window, Some(8));
}
