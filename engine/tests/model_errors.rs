//! A missing or corrupt folder, config, tokenizer or tensor gives a clear error naming what is
//! wrong, and an unsupported architecture is refused by name. The folders are small synthetic
//! checkpoints written by the test and then broken on purpose.

use std::path::Path;

use engine::cpu::{CpuBackend, CpuOptions};
use engine::model::synthetic::{self, SyntheticSpec};
use engine::model::{ModelFiles, Weights};

fn tiny_folder() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    synthetic::write(dir.path(), &SyntheticSpec::tiny(7)).unwrap();
    dir
}

fn load(dir: &Path) -> Result<(), String> {
    let model = ModelFiles::open(dir).map_err(|e| e.to_string())?;
    CpuBackend::load(&model, &CpuOptions::for_tokens(64))
        .map(drop)
        .map_err(|e| e.to_string())
}

fn edit_config(dir: &Path, from: &str, to: &str) {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains(from), "config.json has {from}");
    std::fs::write(&path, text.replace(from, to)).unwrap();
}

#[test]
fn the_synthetic_folder_loads() {
    let dir = tiny_folder();
    load(dir.path()).unwrap();
}

#[test]
fn a_missing_folder_is_named() {
    let err = load(Path::new("/nonexistent/model")).unwrap_err();
    assert_eq!(
        err,
        "/nonexistent/model: not a usable model folder: no such directory"
    );
}

#[test]
fn a_missing_config_is_named() {
    let dir = tiny_folder();
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(
        err.contains("config.json") && err.contains("No such file"),
        "{err}"
    );
}

#[test]
fn a_corrupt_config_is_named() {
    let dir = tiny_folder();
    std::fs::write(dir.path().join("config.json"), "{\"hidden_size\": 64,").unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(err.contains("config.json") && err.contains("EOF"), "{err}");
}

#[test]
fn a_bad_config_value_names_the_key() {
    let dir = tiny_folder();
    edit_config(
        dir.path(),
        "\"num_key_value_heads\":2",
        "\"num_key_value_heads\":3",
    );
    let err = load(dir.path()).unwrap_err();
    assert!(
        err.contains("`num_key_value_heads`: 3 does not divide 4 heads"),
        "{err}"
    );
}

#[test]
fn an_unsupported_architecture_is_refused_by_name() {
    let dir = tiny_folder();
    edit_config(dir.path(), "LlamaForCausalLM", "GPT2LMHeadModel");
    let err = load(dir.path()).unwrap_err();
    assert!(
        err.contains("architecture `GPT2LMHeadModel` is not supported"),
        "{err}"
    );
}

#[test]
fn a_missing_tokenizer_is_named() {
    let dir = tiny_folder();
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(
        err.ends_with("not a usable model folder: tokenizer.json is missing"),
        "{err}"
    );
}

#[test]
fn a_corrupt_tokenizer_is_named() {
    let dir = tiny_folder();
    std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": 3}").unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(err.contains("tokenizer.json: tokenizer:"), "{err}");
}

#[test]
fn missing_weights_are_named() {
    let dir = tiny_folder();
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(
        err.contains("neither model.safetensors nor model.safetensors.index.json"),
        "{err}"
    );
}

#[test]
fn a_corrupt_safetensors_file_is_named() {
    let dir = tiny_folder();
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(
        err.contains("model.safetensors") && err.contains("not a valid safetensors file"),
        "{err}"
    );
}

#[test]
fn a_missing_tensor_is_named() {
    let dir = tiny_folder();
    // Untie the embeddings: the loader now needs lm_head.weight, which the file lacks.
    edit_config(
        dir.path(),
        "\"tie_word_embeddings\":true",
        "\"tie_word_embeddings\":false",
    );
    let err = load(dir.path()).unwrap_err();
    assert!(
        err.contains("tensor `lm_head.weight`: missing from the checkpoint"),
        "{err}"
    );
}

#[test]
fn a_tensor_of_the_wrong_shape_is_named() {
    let dir = tiny_folder();
    edit_config(
        dir.path(),
        "\"intermediate_size\":128",
        "\"intermediate_size\":96",
    );
    let err = load(dir.path()).unwrap_err();
    assert!(
        err.contains(
            "tensor `model.layers.0.mlp.gate_proj.weight`: shape [128, 64], expected [96, 64]"
        ),
        "{err}"
    );
}

#[test]
fn a_shard_index_naming_an_absent_tensor_is_named() {
    let dir = tiny_folder();
    let index = r#"{"weight_map": {"model.norm.weight": "model.safetensors", "model.extra.weight": "model.safetensors"}}"#;
    std::fs::write(dir.path().join("model.safetensors.index.json"), index).unwrap();
    let err = Weights::open(dir.path()).err().unwrap().to_string();
    assert!(
        err.contains(
            "tensor `model.extra.weight`: listed in model.safetensors.index.json but absent"
        ),
        "{err}"
    );
}
