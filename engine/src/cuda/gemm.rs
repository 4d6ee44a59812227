//! Matrix products through cuBLAS: bf16 inputs, fp32 accumulation.
//!
//! Weights are stored as checkpoints store them, row-major `[out, in]`, and activations as
//! row-major `[tokens, in]`, so `y = x · Wᵀ` is, in cuBLAS's column-major terms,
//! `Y[out, tokens] = Wᵀ[out, in] · X[in, tokens]`: one `GemmEx` with the weight transposed.
//! Projections write bf16; the vocabulary projection writes f32 logits. The handle has its own
//! workspace so that calls can be captured into CUDA graphs.

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{self, cublasOperation_t, cudaDataType};
use half::bf16;

use super::device::{DPtr, Device, DeviceBuffer};
use crate::error::Result;

/// cuBLAS's workspace; 32 MiB is what it asks for on Hopper.
pub const WORKSPACE_BYTES: usize = 32 << 20;

pub struct Gemm {
    blas: CudaBlas,
    _workspace: DeviceBuffer,
}

/// The shape of `y[tokens, out] = x[tokens, in] · w[out, in]ᵀ`.
#[derive(Debug, Clone, Copy)]
pub struct Linear {
    pub tokens: usize,
    pub in_features: usize,
    pub out_features: usize,
}

impl Gemm {
    pub fn new(device: &Arc<Device>) -> Result<Self> {
        device.bind()?;
        let blas = CudaBlas::new(device.stream().clone())?;
        let workspace = DeviceBuffer::alloc(device, WORKSPACE_BYTES, "the cuBLAS workspace")?;
        // SAFETY: the workspace outlives the handle (both are fields of `self`, the handle
        // dropped first).
        unsafe {
            sys::cublasSetWorkspace_v2(*blas.handle(), workspace.ptr::<u8>().raw(), WORKSPACE_BYTES)
                .result()?
        };
        Ok(Gemm {
            blas,
            _workspace: workspace,
        })
    }

    /// `y = x · wᵀ` in bf16.
    pub fn linear(&self, x: DPtr<bf16>, w: DPtr<bf16>, y: DPtr<bf16>, shape: Linear) -> Result<()> {
        self.gemm(x, w, y.cast(), cudaDataType::CUDA_R_16BF, shape)
    }

    /// `y = x · wᵀ` with f32 output (the logits).
    pub fn linear_f32(
        &self,
        x: DPtr<bf16>,
        w: DPtr<bf16>,
        y: DPtr<f32>,
        shape: Linear,
    ) -> Result<()> {
        self.gemm(x, w, y.cast(), cudaDataType::CUDA_R_32F, shape)
    }

    fn gemm(
        &self,
        x: DPtr<bf16>,
        w: DPtr<bf16>,
        y: DPtr<u8>,
        y_type: cudaDataType,
        s: Linear,
    ) -> Result<()> {
        let (alpha, beta) = (1f32, 0f32);
        let (m, n, k) = (s.out_features as i32, s.tokens as i32, s.in_features as i32);
        // SAFETY: the callers' buffers hold `[out, in]`, `[tokens, in]` and `[tokens, out]`
        // elements of the stated types.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                m,
                n,
                k,
                (&alpha as *const f32).cast(),
                w.raw(),
                cudaDataType::CUDA_R_16BF,
                k,
                x.raw(),
                cudaDataType::CUDA_R_16BF,
                k,
                (&beta as *const f32).cast(),
                y.raw(),
                y_type,
                m,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }
}
