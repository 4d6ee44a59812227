//! The CPU backend runs a folder converted with `--keep-blocks` on the GGUF's own Q4_1 and Q8_0
//! blocks (a fifth of the bf16 bytes a decode step reads) and widens each weight exactly before
//! its multiply-add, so on the real SmolLM2 its logits are the bits of the f32 conversion of the
//! same GGUF. With `quantization = "int8"` it multiplies the blocks by input rows quantized to
//! 8 bits instead, as llama.cpp does: close to those logits, not their bits.

mod common;

use engine::DType;
use engine::backend::{Backend, LogitsWanted};
use engine::cpu::{CpuBackend, CpuOptions};
use engine::fetch::{self, FetchOptions};
use engine::model::{BlockType, ModelFiles, Weights};

fn backend(dir: &std::path::Path) -> CpuBackend {
    load(dir, false).unwrap()
}

fn load(dir: &std::path::Path, int8_inputs: bool) -> engine::Result<CpuBackend> {
    let model = ModelFiles::open(dir).unwrap();
    let options = CpuOptions {
        threads: 2,
        page_tokens: 16,
        num_pages: 8,
        int8_inputs,
    };
    CpuBackend::load(&model, &options)
}

/// A 40-token prompt in one step, then three decode steps; the last position's logits each.
fn logits(backend: &mut CpuBackend) -> Vec<Vec<f32>> {
    let prompt: Vec<u32> = (0..40).map(|i| (i * 977 + 13) % 49_000 + 3).collect();
    common::run_logits(backend, &prompt, &[7, 990, 12], LogitsWanted::Last)
}

#[test]
fn smollm2_in_its_gguf_blocks_gives_the_logits_of_its_f32_conversion() {
    let wide = common::smollm2(DType::F32);
    let options = FetchOptions {
        keep_blocks: true,
        ..FetchOptions::new(common::cache_dir(), DType::F32)
    };
    let blocks = fetch::fetch(&fetch::SMOLLM2, &options).unwrap();
    assert_ne!(blocks, wide);

    let weights = Weights::open(&blocks).unwrap();
    let kinds = |name: &str, shape: &[usize]| weights.blocks(name, shape).unwrap().map(|b| b.0);
    assert_eq!(
        kinds("model.layers.0.mlp.down_proj.weight", &[576, 1536]),
        Some(BlockType::Q4_1)
    );
    assert_eq!(
        kinds("model.embed_tokens.weight", &[49_152, 576]),
        Some(BlockType::Q8_0)
    );
    assert_eq!(kinds("model.norm.weight", &[576]), None);
    // Decoded on request, as the CUDA backend reads them: every tensor has the f32
    // conversion's values.
    let f32_weights = Weights::open(&wide).unwrap();
    let mut names: Vec<&str> = f32_weights.names().collect();
    names.sort_unstable();
    assert_eq!(names.len(), 2 + 30 * 9, "SmolLM2's tensors");
    for name in names {
        let shape = f32_weights.shape(name).unwrap();
        assert_eq!(
            weights.load_f32(name, &shape).unwrap(),
            f32_weights.load_f32(name, &shape).unwrap(),
            "{name}"
        );
    }

    let (mut narrow, mut full) = (backend(&blocks), backend(&wide));
    let (bytes, wide_bytes) = (narrow.memory().weights_bytes, full.memory().weights_bytes);
    assert!(
        bytes * 4 < wide_bytes,
        "blocks {bytes} bytes against f32 {wide_bytes}"
    );
    // The blocks multiply input rows quantized to 8 bits (`engine::cpu::int8`): close to the
    // f32 conversion's logits, not its bits. Measured (2026-12-05): RMS differences of 0.09 to
    // 0.37 against logits of RMS 13 to 17, the worst 0.79; the bf16 conversion of the same
    // file differs from the f32 one by 0.02 to 0.09.
    let (got, want) = (logits(&mut narrow), logits(&mut full));
    assert_eq!(got.len(), want.len());
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), w.len());
        let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "step {step}: logits differ from the f32 conversion's");
    }

    // Integer products (`engine::cpu::int8`). Measured (2026-12-05): RMS differences of 0.09
    // to 0.37 against logits of RMS 13 to 17, the worst 0.79, where the bf16 conversion of the
    // same file differs from the f32 one by 0.02 to 0.09.
    let got = logits(&mut load(&blocks, true).unwrap());
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), w.len());
        let diffs: Vec<f32> = g.iter().zip(w).map(|(a, b)| (a - b).abs()).collect();
        let worst = diffs.iter().copied().fold(0f32, f32::max);
        let rms = (diffs.iter().map(|d| d * d).sum::<f32>() / diffs.len() as f32).sqrt();
        let size = (w.iter().map(|v| v * v).sum::<f32>() / w.len() as f32).sqrt();
        assert!(
            rms < 0.04 * size && worst < 1.5,
            "step {step}: int8 logits off by {rms} RMS (worst {worst}) against logits of {size}"
        );
        assert_eq!(
            argmax(g),
            argmax(w),
            "step {step}: int8 picks another top token"
        );
    }
    // A folder without blocks has nothing to multiply in integers: refused, with the reason.
    let err = load(&wide, true)
        .err()
        .expect("int8 on an f32 folder is refused");
    assert!(err.to_string().contains("--keep-blocks"), "{err}");
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i)
        .expect("a vocabulary")
}
