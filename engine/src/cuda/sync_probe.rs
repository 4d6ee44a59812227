//! What a kernel boundary costs in a replayed graph (BENCHMARKS.md, "Where SmolLM2's batch-1
//! step goes, kernel by kernel"): a chain of 150 small dependent kernels launched plainly, as
//! programmatic dependents waiting on the grid before (`griddepcontrol.wait`, what the engine
//! does), and as programmatic dependents polling a counter the blocks before bump (what a
//! megakernel's fine-grained synchronization would do between kernels). Each kernel reads a
//! vector the one before wrote, so the three must give the same values.

use std::time::Instant;

use cudarc::driver::sys;

use super::device::{Args, DPtr, Device, DeviceBuffer};
use super::graphs::capture;

const SRC: &str = r#"
__device__ __forceinline__ void prefetch(const float* w, float4 r[4]) {
    const float4* wb = (const float4*)(w + (size_t)blockIdx.x * blockDim.x * 16);
    for (int i = 0; i < 4; ++i) r[i] = w ? __ldg(wb + threadIdx.x + i * blockDim.x) : make_float4(0.f, 0.f, 0.f, 0.f);
}
__device__ __forceinline__ void work(const float* in, float* out, unsigned n, float4 r[4]) {
    __shared__ float part[32];
    float s = 0.f;
    for (unsigned i = threadIdx.x; i < n; i += blockDim.x) s += __ldcg(in + i);
    for (int i = 0; i < 4; ++i) s += (r[i].x + r[i].y + r[i].z + r[i].w) * 1e-3f;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x < 16) {
        float t = 0.f;
        for (unsigned i = 0; i < blockDim.x / 32; ++i) t += part[i];
        __stcg(out + blockIdx.x * 16 + threadIdx.x, t * 1e-3f + (float)threadIdx.x);
    }
}
extern "C" __global__ void chain_wait(const float* w, const float* in, float* out, unsigned n) {
    float4 r[4];
    prefetch(w, r);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
    work(in, out, n, r);
}
extern "C" __global__ void chain_flag(const float* w, const float* in, float* out, unsigned n,
                                      unsigned* flags, unsigned idx, unsigned target) {
    float4 r[4];
    prefetch(w, r);
    asm volatile("griddepcontrol.launch_dependents;" :::);
    if (threadIdx.x == 0 && idx > 0) {
        unsigned v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flags + idx - 1) : "memory");
        } while (v < target);
    }
    __syncthreads();
    work(in, out, n, r);
    __syncthreads();
    if (threadIdx.x == 0)
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(flags + idx) : "memory");
}
"#;

#[test]
#[ignore = "needs a CUDA device"]
fn a_kernel_chain_computes_the_same_by_grid_wait_and_by_counters() {
    let device = Device::open(0).unwrap();
    let options = cudarc::nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture={}", device.arch())],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(SRC, options).unwrap();
    let module = device.context().load_module(ptx).unwrap();
    let wait = module.load_function("chain_wait").unwrap();
    let flag = module.load_function("chain_flag").unwrap();
    let kernels = 150u32;
    for &(blocks, threads, pre) in &[
        (24u32, 256u32, true),
        (24, 256, false),
        (64, 256, true),
        (64, 256, false),
        (72, 256, true),
        (120, 256, true),
        (132, 128, true),
        (132, 256, true),
        (132, 256, false),
        (132, 512, true),
        (264, 128, true),
        (264, 256, true),
        (384, 256, true),
        (384, 256, false),
        (396, 128, true),
        (528, 256, false),
    ] {
        let n = 576u32;
        let stride = (blocks * 16).max(n);
        let wbytes = blocks as usize * threads as usize * 64;
        let w = DeviceBuffer::alloc(&device, wbytes, "w").unwrap();
        let bufs = DeviceBuffer::alloc(&device, (kernels as usize + 1) * stride as usize * 4, "x")
            .unwrap();
        let flags = DeviceBuffer::alloc(&device, kernels as usize * 4, "flags").unwrap();
        let init: Vec<f32> = (0..(kernels + 1) * stride)
            .map(|i| (i % 7) as f32)
            .collect();
        let wv: Vec<f32> = (0..wbytes / 4).map(|i| (i % 5) as f32).collect();
        device.upload(&wv, w.ptr()).unwrap();
        let wp = if pre { w.ptr::<f32>() } else { DPtr::NULL };
        let x = |k: u32| -> DPtr<f32> { bufs.ptr::<f32>().offset((k * stride) as usize) };
        let mut results = Vec::new();
        let mut line = format!(
            "{blocks:4} blocks x {threads:3} threads, {:5} KB of weights a kernel:",
            if pre { wbytes / 1024 } else { 0 }
        );
        for mode in ["plain", "pdl-wait", "pdl-flags"] {
            device.upload(&init, bufs.ptr()).unwrap();
            device.set_programmatic_launch(mode != "plain");
            let graph = capture(&device, || {
                // SAFETY: flags holds `kernels` words.
                unsafe {
                    sys::cuMemsetD32Async(
                        flags.ptr::<u32>().addr(),
                        0,
                        kernels as usize,
                        device.stream().cu_stream(),
                    )
                }
                .result()?;
                for k in 0..kernels {
                    if mode == "pdl-flags" {
                        let args = Args::new()
                            .ptr(wp)
                            .ptr(x(k))
                            .ptr(x(k + 1))
                            .u32(n)
                            .ptr(flags.ptr::<u32>())
                            .u32(k)
                            .u32(blocks);
                        device.launch(&flag, (blocks, 1, 1), threads, &args)?;
                    } else {
                        let args = Args::new().ptr(wp).ptr(x(k)).ptr(x(k + 1)).u32(n);
                        device.launch(&wait, (blocks, 1, 1), threads, &args)?;
                    }
                }
                Ok(())
            })
            .unwrap();
            for _ in 0..20 {
                graph.launch().unwrap();
            }
            device.synchronize().unwrap();
            let replays = 300;
            let began = Instant::now();
            for _ in 0..replays {
                graph.launch().unwrap();
            }
            device.synchronize().unwrap();
            let us = began.elapsed().as_secs_f64() * 1e6 / replays as f64;
            line += &format!("  {mode} {:.2}", us / kernels as f64);
            let mut last = vec![0f32; n as usize];
            device.download(x(kernels), &mut last).unwrap();
            results.push(last);
        }
        println!("{line} µs a kernel");
        assert_eq!(
            results[0], results[1],
            "{line}: the programmatic chain differs"
        );
        assert_eq!(results[0], results[2], "{line}: the counter chain differs");
    }
    device.set_programmatic_launch(true);
}
