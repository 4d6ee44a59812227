//! The CPU backend keeps a bf16 checkpoint's matrices in bf16 (half the bytes a decode step
//! reads) and widens each weight exactly before its multiply-add, so its logits are the bits the
//! same checkpoint widened to f32 on disk gives.

mod common;

use std::collections::HashMap;
use std::path::Path;

use engine::DType;
use engine::backend::{Backend, LogitsWanted};
use engine::cpu::{CpuBackend, CpuOptions};
use engine::model::ModelFiles;
use engine::model::synthetic::{self, SyntheticSpec};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

const PAGE: usize = 16;

fn backend(dir: &Path) -> CpuBackend {
    let model = ModelFiles::open(dir).unwrap();
    let options = CpuOptions {
        threads: 2,
        page_tokens: PAGE,
        num_pages: 8,
        int8_inputs: false,
    };
    CpuBackend::load(&model, &options).unwrap()
}

/// Copies the folder `from` into `to` with every tensor widened to f32.
fn widen_to_f32(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e != "safetensors") {
            std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
        }
    }
    let bytes = std::fs::read(from.join("model.safetensors")).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let widened: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), Dtype::BF16, "{name}");
            let mut values = vec![0f32; view.data().len() / 2];
            DType::BF16.decode_into(view.data(), &mut values);
            let mut out = Vec::new();
            DType::F32.encode_into(&values, &mut out);
            (name, view.shape().to_vec(), out)
        })
        .collect();
    let views = widened.iter().map(|(name, shape, data)| {
        (
            name.clone(),
            TensorView::new(Dtype::F32, shape.clone(), data).unwrap(),
        )
    });
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), &to.join("model.safetensors")).unwrap();
}

/// A 37-token prompt in one step, then three decode steps; every logit of every step.
fn logits(backend: &mut CpuBackend) -> Vec<Vec<f32>> {
    let prompt: Vec<u32> = (0..37).map(|i| (i * 31 + 5) % 250 + 3).collect();
    common::run_logits(backend, &prompt, &[7, 99, 12], LogitsWanted::All)
}

#[test]
fn a_bf16_checkpoint_runs_in_bf16_with_the_logits_of_its_f32_widening() {
    let dir = tempfile::tempdir().unwrap();
    let (narrow, wide) = (dir.path().join("bf16"), dir.path().join("f32"));
    let spec = SyntheticSpec {
        dtype: DType::BF16,
        tie_word_embeddings: false,
        ..SyntheticSpec::tiny(5)
    };
    synthetic::write(&narrow, &spec).unwrap();
    widen_to_f32(&narrow, &wide);

    let (mut b16, mut b32) = (backend(&narrow), backend(&wide));
    let (w16, w32) = (b16.memory().weights_bytes, b32.memory().weights_bytes);
    // Every matrix halves; the norms stay f32.
    assert!(
        w16 * 2 < w32 + w32 / 50,
        "bf16 {w16} bytes against f32 {w32}"
    );

    let (got, want) = (logits(&mut b16), logits(&mut b32));
    assert_eq!(got.len(), want.len());
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), w.len());
        let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "step {step}: logits differ from the f32 checkpoint's");
    }
}
