//! Which backend runs a model: the configuration's choice (`[engine] backend`), where `auto`
//! means CUDA when a usable GPU is found and the CPU otherwise.
//!
//! Only the absence of a usable GPU (no driver, no device, too old a device) sends `auto` to
//! the CPU; any other CUDA failure, such as a model that does not fit, is reported as is.

pub use policy::BackendKind;

use crate::backend::Backend;
use crate::cpu::{CpuBackend, CpuOptions};
use crate::cuda::device::Device;
use crate::cuda::{CudaBackend, CudaOptions};
use crate::error::{EngineError, Result};
use crate::model::ModelFiles;

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
    match resolve(kind, cuda.device) {
        Resolved::Cpu => Ok(Box::new(CpuBackend::load(model, cpu)?)),
        Resolved::Cuda => match CudaBackend::load(model, cuda) {
            Ok(backend) => {
                tracing::info!("{}", backend.memory_plan());
                Ok(Box::new(backend))
            }
            Err(EngineError::CudaUnavailable(reason)) if kind == BackendKind::Auto => {
                tracing::info!("using the CPU backend: {reason}");
                Ok(Box::new(CpuBackend::load(model, cpu)?))
            }
            Err(e) => Err(e),
        },
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
}
