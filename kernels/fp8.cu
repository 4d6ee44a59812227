// FP8 (e4m3) quantization of bf16 rows, one scale a row: the projection weights at load (a row
// is an output feature) and each projection's input as a step runs (a row is a token). The
// scale is the row's largest magnitude over e4m3's largest finite value (448), so the row's
// largest element becomes ±448; a row of zeros gets scale 1. Elements are rounded to nearest
// even and saturate at ±448 (`.satfinite`); the products then multiply each output by its
// weight row's and its token's scales (cuBLASLt's outer-vector scaling).
//
// One block a row, eight elements a thread at a time in 16-byte loads; `cols` is a multiple
// of 8. The row is read twice, the second time from cache.

#define E4M3_MAX 448.f

// Two floats as one e4m3x2 half-word, `lo` in the low byte (the lower index in memory).
__device__ __forceinline__ u32 pack_e4m3x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    __trap();
    return 0;
#endif
}

__device__ float block_max(float v, float* scratch) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float m = 0.f;
    for (u32 w = 0; w < warps; ++w) m = fmaxf(m, scratch[w]);
    return m;
}

extern "C" __global__ void quantize_rows_e4m3(const bf16* __restrict__ x, unsigned char* __restrict__ q,
                                              float* __restrict__ scales, u32 cols) {
    __shared__ float scratch[32];
    pdl_begin();
    const uint4* in = (const uint4*)(x + (u64)blockIdx.x * cols);
    uint2* out = (uint2*)(q + (u64)blockIdx.x * cols);
    u32 chunks = cols / 8;
    float m = 0.f;
    for (u32 c = threadIdx.x; c < chunks; c += blockDim.x) {
        float v[8];
        unpack8(in[c], v);
#pragma unroll
        for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(v[i]));
    }
    m = block_max(m, scratch);
    float scale = m > 0.f ? m / E4M3_MAX : 1.f;
    float inv = 1.f / scale;
    if (threadIdx.x == 0) scales[blockIdx.x] = scale;
    for (u32 c = threadIdx.x; c < chunks; c += blockDim.x) {
        float v[8];
        unpack8(in[c], v);
        u32 w0 = pack_e4m3x2(v[0] * inv, v[1] * inv) | (pack_e4m3x2(v[2] * inv, v[3] * inv) << 16);
        u32 w1 = pack_e4m3x2(v[4] * inv, v[5] * inv) | (pack_e4m3x2(v[6] * inv, v[7] * inv) << 16);
        out[c] = make_uint2(w0, w1);
    }
}
