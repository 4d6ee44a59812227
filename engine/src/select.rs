//! Which backend runs a model: the configuration's choice (`[engine] backend`), where `auto`
//! means CUDA when a usable GPU is found and the CPU otherwise.
//!
//! Only the absence of a usable GPU (no driver, no device, too old a device) sends `auto` to
//! the CPU; any other CUDA failure, such as a model that does not fit, is reported as is.

pub use policy::BackendKind;

use crate::backend::Backend;
use crate::cpu::{CpuBackend, CpuOptions};
use crate::cuda::device::Device;
use crate::cuda::tensor_parallel::TensorParallel;
use crate::cuda::{CudaBackend, CudaOptions};
use crate::error::{EngineError, Result};
use crate::model::{ModelConfig, ModelFiles};

/// A backend kind with `auto` decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolved {
    Cpu,
    Cuda,
}

/// Decides `auto` by opening CUDA device `device`; `cuda` is kept even where that fails, so
/// that loading reports why.
pub fn resolve(kind: BackendKind, device: usize) -> Resolved {
    match kind {
        BackendKind::Cpu => Resolved::Cpu,
        BackendKind::Cuda => Resolved::Cuda,
        BackendKind::Auto => match Device::open(device) {
            Ok(_) => Resolved::Cuda,
            Err(e) => {
                tracing::info!("using the CPU backend: {e}");
                Resolved::Cpu
            }
        },
    }
}

/// Loads `model` on the backend `kind` resolves to.
pub fn load(
    model: &ModelFiles,
    kind: BackendKind,
    cpu: &CpuOptions,
    cuda: &CudaOptions,
) -> Result<Box<dyn Backend>> {
    let resolved = resolve(kind, cuda.device);
    if resolved == Resolved::Cpu && cuda.fp8_weights {
        return Err(EngineError::Quantization(
            "quantization = \"fp8\" runs on the CUDA backend only (no usable GPU was found, or \
             `[engine] backend` is \"cpu\"); leave it unset for the CPU"
                .into(),
        ));
    }
    if resolved == Resolved::Cuda && cpu.int8_inputs {
        return Err(EngineError::Quantization(
            "quantization = \"int8\" runs on the CPU backend only (it multiplies the GGUF's \
             blocks, which the GPU decodes to bf16 at load): set `[engine] backend = \"cpu\"`, or \
             use \"fp8\" on the GPU"
                .into(),
        ));
    }
    if resolved == Resolved::Cpu && cuda.tensor_parallel > 1 {
        return Err(EngineError::TensorParallel(format!(
            "tensor_parallel = {} splits the model over GPUs: it needs the CUDA backend",
            cuda.tensor_parallel
        )));
    }
    match resolved {
        Resolved::Cpu => Ok(Box::new(CpuBackend::load(model, cpu)?)),
        Resolved::Cuda => match load_cuda(model, cuda) {
            Ok(backend) => Ok(backend),
            Err(EngineError::CudaUnavailable(reason)) if kind == BackendKind::Auto => {
                tracing::info!("using the CPU backend: {reason}");
                Ok(Box::new(CpuBackend::load(model, cpu)?))
            }
            Err(e) => Err(e),
        },
    }
}

/// `model` on the GPU, or split over `cuda.tensor_parallel` GPUs; the memory plan logged (a
/// rank's each).
pub fn load_cuda(model: &ModelFiles, cuda: &CudaOptions) -> Result<Box<dyn Backend>> {
    let backend: Box<dyn Backend> = if cuda.tensor_parallel > 1 {
        Box::new(TensorParallel::load(model, cuda)?)
    } else {
        Box::new(CudaBackend::load(model, cuda)?)
    };
    log_start_up(backend.as_ref());
    Ok(backend)
}

/// A model of `config`'s shape with weights drawn on the GPU from `seed`, on one GPU or split
/// over `cuda.tensor_parallel` (the same weights either way).
pub fn random_cuda(config: ModelConfig, seed: u64, cuda: &CudaOptions) -> Result<Box<dyn Backend>> {
    let backend: Box<dyn Backend> = if cuda.tensor_parallel > 1 {
        Box::new(TensorParallel::random(config, seed, cuda)?)
    } else {
        Box::new(CudaBackend::random(config, seed, cuda)?)
    };
    log_start_up(backend.as_ref());
    Ok(backend)
}

/// The memory plan (a rank's each) and what start-up found, in the log.
fn log_start_up(backend: &dyn Backend) {
    for line in backend
        .memory_plans()
        .iter()
        .chain(&backend.start_up_notes())
    {
        tracing::info!("{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_cpu_and_auto_follows_the_machine() {
        assert_eq!(resolve(BackendKind::Cpu, 0), Resolved::Cpu);
        let expected = if Device::open(0).is_ok() {
            Resolved::Cuda
        } else {
            Resolved::Cpu
        };
        assert_eq!(resolve(BackendKind::Auto, 0), expected);
    }

    #[test]
    fn cuda_without_a_gpu_says_why() {
        if let Err(e) = Device::open(0) {
            assert!(e.to_string().starts_with("no usable CUDA device:"), "{e}");
        }
    }

    #[test]
    fn fp8_weights_on_the_cpu_are_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let spec = crate::model::synthetic::SyntheticSpec::tiny(3);
        crate::model::synthetic::write(dir.path(), &spec).unwrap();
        let model = ModelFiles::open(dir.path()).unwrap();
        let cuda = CudaOptions {
            fp8_weights: true,
            ..CudaOptions::for_tokens(64, 64, 1)
        };
        let err = load(&model, BackendKind::Cpu, &CpuOptions::for_tokens(64), &cuda)
            .err()
            .expect("FP8 on the CPU is refused");
        assert!(
            err.to_string()
                .starts_with("quantization: quantization = \"fp8\" runs on the CUDA backend"),
            "{err}"
        );
    }
}
