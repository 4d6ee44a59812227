//! Every configuration shipped in `configs/` parses and validates.

#[test]
fn every_shipped_config_is_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let text = std::fs::read_to_string(&path).unwrap();
            policy::Policies::from_toml(&text)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            checked += 1;
        }
    }
    assert!(checked >= 3, "found {checked} configs in {}", dir.display());
}

/// `gpu-fp8.toml` is `gpu.toml` with FP8 projections and nothing else changed, so the two
/// serve the same way but for the weights' format.
#[test]
fn the_fp8_config_is_the_gpu_config_with_fp8_projections() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
    let read = |name: &str| {
        let text = std::fs::read_to_string(dir.join(name)).unwrap();
        policy::Policies::from_toml(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let (gpu, mut fp8) = (read("gpu.toml"), read("gpu-fp8.toml"));
    assert_eq!(gpu.engine.quantization, policy::Quantization::None);
    assert_eq!(fp8.engine.quantization, policy::Quantization::Fp8);
    fp8.engine.quantization = policy::Quantization::None;
    assert_eq!(fp8, gpu);
}
