//! The CUDA backend against Hugging Face transformers' own GPU forward: checkpoints written by
//! transformers (`fixtures/make_hf_gpu_fixtures.py`, run on the GPU machine into
//! `$SNAPSERVE_HF_GPU_FIXTURES`) load in snapserve, and their logits match transformers' within
//! bf16 tolerance: snapserve is as close to transformers' f32 forward as transformers' own bf16
//! forward is (bf16 rounding differs between the two, so neither matches the other exactly). Run on the GPU machine with
//! `SNAPSERVE_HF_GPU_FIXTURES=DIR cargo test --release -p engine --test cuda_hf_parity -- --ignored --nocapture`.

use std::path::{Path, PathBuf};

mod common;

use cache::PageId;
use common::difference;
use engine::backend::{Backend, LogitsWanted, RowPlan, StepPlan};
use engine::cuda::{CudaBackend, CudaOptions};
use engine::model::{ModelConfig, Weights};
use engine::sampling::{Sampler, SamplingParams, argmax};
use safetensors::SafeTensors;

struct Reference {
    prompt: Vec<u32>,
    /// transformers' bf16 forward.
    logits: Vec<f32>,
    /// transformers' f32 forward of the same weights.
    exact: Vec<f32>,
    greedy: Vec<u32>,
}

fn read_reference(dir: &Path) -> Reference {
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let words = |name: &str| -> Vec<u32> {
        let data = tensors.tensor(name).unwrap().data().to_vec();
        data.chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    Reference {
        prompt: words("prompt"),
        logits: words("logits").into_iter().map(f32::from_bits).collect(),
        exact: words("logits_f32")
            .into_iter()
            .map(f32::from_bits)
            .collect(),
        greedy: words("greedy"),
    }
}

fn fixtures() -> Vec<PathBuf> {
    let root = std::env::var_os("SNAPSERVE_HF_GPU_FIXTURES")
        .expect("set SNAPSERVE_HF_GPU_FIXTURES to the folder make_hf_gpu_fixtures.py wrote");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("reference.safetensors").exists())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no fixtures found");
    dirs
}

/// snapserve's greedy continuation of the prompt, 16 tokens.
fn greedy(backend: &mut CudaBackend, prompt: &[u32], pages: &[PageId]) -> Vec<u32> {
    let (mut input, mut start, mut out) = (prompt.to_vec(), 0, Vec::new());
    for _ in 0..16 {
        let plan = StepPlan {
            rows: vec![RowPlan {
                tokens: input.clone(),
                start_pos: start,
                pages: pages.to_vec(),
                logits: LogitsWanted::Last,
            }],
        };
        let mut sampler = Sampler::new(&SamplingParams::default(), &[]);
        let next = backend
            .step_and_sample(&plan, &mut [Some(&mut sampler)])
            .unwrap()[0]
            .unwrap();
        start += input.len();
        input = vec![next];
        out.push(next);
    }
    out
}

#[test]
#[ignore = "needs a CUDA device and fixtures written by transformers on it"]
fn transformers_checkpoints_match_transformers_gpu_logits() {
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let config = ModelConfig::from_dir(&dir).unwrap();
        let weights = Weights::open(&dir).unwrap();
        let options = CudaOptions::for_tokens(4096, 512, 4);
        let mut backend = CudaBackend::from_weights(config, &weights, &options).unwrap();
        let reference = read_reference(&dir);
        let pages: Vec<PageId> = (0..8).map(|i| PageId(2 * i + 1)).collect();
        let plan = StepPlan {
            rows: vec![RowPlan {
                tokens: reference.prompt.clone(),
                start_pos: 0,
                pages: pages.clone(),
                logits: LogitsWanted::All,
            }],
        };
        let got = backend.step(&plan).unwrap();
        let (max, rel) = difference(&reference.logits, &got.logits);
        let ours = difference(&reference.exact, &got.logits).1;
        let theirs = difference(&reference.exact, &reference.logits).1;
        let vocab = got.vocab_size;
        let argmax_agree = reference
            .logits
            .chunks(vocab)
            .zip(got.logits.chunks(vocab))
            .filter(|(w, g)| argmax(w) == argmax(g))
            .count();
        let continuation = greedy(&mut backend, &reference.prompt, &pages);
        let same = continuation
            .iter()
            .zip(&reference.greedy)
            .take_while(|(a, b)| a == b)
            .count();
        println!(
            "{name}: against transformers bf16: max abs error {max:.4}, relative RMS {rel:.2e}, argmax agrees at {argmax_agree}/{} positions, greedy continuation agrees for {same}/16 tokens; against transformers f32: snapserve {ours:.2e}, transformers bf16 {theirs:.2e}",
            reference.prompt.len()
        );
        assert!(
            ours <= (1.5 * theirs).max(1e-2),
            "{name}: {ours} from f32, transformers' bf16 is {theirs}"
        );
        assert!(
            rel < 5e-2,
            "{name}: relative RMS {rel} from transformers' bf16"
        );
    }
}
