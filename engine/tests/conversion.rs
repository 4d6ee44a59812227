//! The GGUF to Hugging Face conversion of SmolLM2: converted tensors equal an independent
//! dequantization (the `gguf` Python package, recorded in the fixture) bit for bit, the bf16
//! folder is the f32 folder rounded once, the config says what the GGUF says, and malformed or
//! foreign GGUF files are refused with a clear error.

mod common;

use common::{Fixture, cache_dir, smollm2};
use engine::DType;
use engine::gguf::GgufFile;
use engine::model::{Architecture, ModelConfig, Weights};

fn gguf_path() -> std::path::PathBuf {
    smollm2(DType::F32);
    cache_dir().join("gguf/SmolLM2-135M-Instruct.Q4_1.gguf")
}

#[test]
fn converted_tensors_equal_an_independent_dequantization() {
    let fixture = Fixture::load();
    let weights = Weights::open(&smollm2(DType::F32)).unwrap();
    let names = fixture.dequant_tensors();
    assert!(
        names.iter().any(|n| n.contains("embed_tokens")),
        "Q8_0 is covered"
    );
    assert!(
        names.iter().any(|n| n.contains("q_proj")) && names.iter().any(|n| n.contains("k_proj")),
        "permuted Q4_1 is covered"
    );
    assert!(
        names.iter().any(|n| n.ends_with("norm.weight")),
        "F32 is covered"
    );
    for name in names {
        let rows = fixture.i64s(&format!("dequant/{name}/rows"));
        let expected = fixture.f32s(&format!("dequant/{name}/values"));
        let shape = weights
            .shape(&name)
            .unwrap_or_else(|| panic!("{name} is missing from the converted folder"));
        let cols = *shape.last().unwrap();
        assert_eq!(expected.len(), rows.len() * cols, "{name}");
        let all = weights.load_f32(&name, &shape).unwrap();
        for (k, &row) in rows.iter().enumerate() {
            let row = row as usize;
            let got = &all[row * cols..(row + 1) * cols];
            let want = &expected[k * cols..(k + 1) * cols];
            let same = got
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{name} row {row} differs from the gguf package's dequantization"
            );
        }
    }
}

#[test]
fn bf16_folder_is_the_f32_folder_rounded_once() {
    let f32_weights = Weights::open(&smollm2(DType::F32)).unwrap();
    let bf16_weights = Weights::open(&smollm2(DType::BF16)).unwrap();
    let mut names: Vec<&str> = f32_weights.names().collect();
    names.sort();
    assert_eq!(names.len(), 272);
    for name in names {
        let (_, _, bytes) = f32_weights
            .raw(name, &f32_weights.shape(name).unwrap())
            .unwrap();
        let (_, dtype, rounded) = bf16_weights
            .raw(name, &bf16_weights.shape(name).unwrap())
            .unwrap();
        assert_eq!(dtype, safetensors::Dtype::BF16, "{name}");
        for (f, b) in bytes.chunks_exact(4).zip(rounded.chunks_exact(2)) {
            let want = half::bf16::from_f32(f32::from_le_bytes(f.try_into().unwrap()));
            assert_eq!(want.to_le_bytes(), [b[0], b[1]], "{name}");
        }
    }
}

#[test]
fn config_says_what_the_gguf_says() {
    let config = ModelConfig::from_dir(&smollm2(DType::F32)).unwrap();
    assert_eq!(config.architecture, Architecture::Llama);
    assert_eq!(
        (
            config.num_layers,
            config.hidden_size,
            config.intermediate_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim
        ),
        (30, 576, 1536, 9, 3, 64)
    );
    assert_eq!(
        (config.vocab_size, config.max_position_embeddings),
        (49152, 8192)
    );
    assert_eq!((config.rope_theta, config.rms_norm_eps), (100000.0, 1e-5));
    assert!(config.tie_word_embeddings);
    assert_eq!(
        (config.bos_token_id, config.eos_token_ids.as_slice()),
        (Some(1), &[2][..])
    );
    let gguf = GgufFile::open(&gguf_path()).unwrap();
    let types: Vec<_> = gguf.tensors.iter().map(|t| format!("{:?}", t.ty)).collect();
    assert_eq!(types.iter().filter(|t| *t == "F32").count(), 61);
    assert_eq!(types.iter().filter(|t| *t == "Q4_1").count(), 210);
    assert_eq!(types.iter().filter(|t| *t == "Q8_0").count(), 1);
    assert!(gguf.tensor("output.weight").is_none());
}

#[test]
fn truncated_gguf_files_are_refused_without_panicking() {
    let bytes = std::fs::read(gguf_path()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let header_end = 1_785_664; // where token_embd's data starts
    for len in [
        0,
        3,
        4,
        8,
        23,
        24,
        100,
        10_000,
        1_000_000,
        header_end - 1,
        header_end + 10,
        bytes.len() - 1,
    ] {
        let path = dir.path().join(format!("cut-{len}.gguf"));
        std::fs::write(&path, &bytes[..len]).unwrap();
        let err = GgufFile::open(&path)
            .err()
            .unwrap_or_else(|| panic!("a GGUF cut at {len} bytes was accepted"));
        let message = err.to_string();
        assert!(
            message.contains(&format!("cut-{len}.gguf")) && message.contains("malformed GGUF"),
            "{message}"
        );
    }
}

/// A minimal GGUF v3 file with the given string metadata and no tensors.
fn tiny_gguf(metadata: &[(&str, &str)]) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(0u64.to_le_bytes());
    out.extend((metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        out.extend((key.len() as u64).to_le_bytes());
        out.extend(key.as_bytes());
        out.extend(8u32.to_le_bytes());
        out.extend((value.len() as u64).to_le_bytes());
        out.extend(value.as_bytes());
    }
    out
}

#[test]
fn foreign_architectures_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("phi.gguf");
    std::fs::write(&path, tiny_gguf(&[("general.architecture", "phi3")])).unwrap();
    let gguf = GgufFile::open(&path).unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let err = engine::convert::convert(
        &gguf,
        &out,
        DType::F32,
        false,
        &indicatif::ProgressBar::hidden(),
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("architecture `gguf:phi3` is not supported"),
        "{err}"
    );
}
