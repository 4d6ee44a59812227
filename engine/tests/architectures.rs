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
            int8_inputs: false,
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

/// Speculative decoding over a sliding window (issue 14, item 4). A verification row (a
/// sequence's last token and seven drafted ones, one row of a step) appends the KV of its eight
/// positions in the same pass that reads the window's history where it lies, in the sequence's
/// pages: there is no copy of that history to stage, so the append is the pass's one cache
/// write. Into pages a previous sequence left full of other bytes, it writes exactly the bytes
/// eight one-token steps write, and gives exactly their logits.
#[test]
fn a_verification_row_over_a_sliding_window_writes_what_one_token_steps_write() {
    use cache::{BackingId, PageCopy, Tier};
    let dir = fixture_path("tiny").join("mistral");
    let config = ModelConfig::from_dir(&dir).unwrap();
    assert_eq!(config.sliding_window, Some(8));
    let weights = Weights::open(&dir).unwrap();
    let options = CpuOptions {
        threads: 2,
        page_tokens: 4,
        num_pages: 16,
        int8_inputs: false,
    };
    let ids = expected(&dir).ids;
    assert!(ids.len() >= 28);
    // Reused storage: the pages in an order a fresh pool would not hand out.
    let pages: Vec<PageId> = [9, 2, 14, 5, 0, 11, 7, 3].map(PageId).to_vec();
    let row = |tokens: &[u32], start_pos: usize, logits| RowPlan {
        tokens: tokens.to_vec(),
        start_pos,
        pages: pages.clone(),
        logits,
    };
    let step = |backend: &mut CpuBackend, row: RowPlan| {
        backend.step(&StepPlan { rows: vec![row] }).unwrap().logits
    };
    let run = |one_token_steps: bool| {
        let mut backend = CpuBackend::from_weights(config.clone(), &weights, &options).unwrap();
        // Another sequence's KV first, in the same pages.
        let other: Vec<u32> = ids.iter().rev().take(28).copied().collect();
        step(&mut backend, row(&other, 0, LogitsWanted::None));
        // The sequence's 20 tokens past the window, then its last token and seven drafted.
        step(&mut backend, row(&ids[..20], 0, LogitsWanted::None));
        let logits = if one_token_steps {
            (20..28)
                .flat_map(|pos| {
                    step(
                        &mut backend,
                        row(&ids[pos..pos + 1], pos, LogitsWanted::Last),
                    )
                })
                .collect::<Vec<f32>>()
        } else {
            step(&mut backend, row(&ids[20..28], 20, LogitsWanted::All))
        };
        let geometry = backend.info().geometry;
        let copies: Vec<PageCopy> = pages[..7]
            .iter()
            .enumerate()
            .map(|(row, &pool_page)| PageCopy {
                snapshot_page: row as u32,
                pool_page,
            })
            .collect();
        let bytes = 7 * geometry.page_bytes() as u64;
        backend
            .alloc_backing(BackingId(1), Tier::Host, bytes)
            .unwrap();
        backend.save_pages(BackingId(1), &copies).unwrap();
        (logits, backend.read_backing(BackingId(1)).unwrap())
    };
    let (verified, verified_kv) = run(false);
    let (stepped, stepped_kv) = run(true);
    assert_eq!(verified.len(), 8 * config.vocab_size);
    assert!(
        verified
            .iter()
            .zip(&stepped)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "the verification's logits are the one-token steps'"
    );
    assert_eq!(verified_kv.len(), stepped_kv.len());
    assert!(
        verified_kv == stepped_kv,
        "the same KV bytes, all 28 positions"
    );
}
