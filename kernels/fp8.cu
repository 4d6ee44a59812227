// FP8 (e4m3) quantization of bf16 rows, one scale a row: the projection weights at load (a row
// is an output feature) and each projection's input as a step runs (a row is a token). The
// scale is the row's largest magnitude over e4m3's largest finite value (448), so the row's
// largest element becomes ±448; a row of zeros gets scale 1. Elements are rounded to nearest
// even and saturate at ±448 (`.satfinite`); the products then multiply each output by its
// weight row's and its token's scales (cuBLASLt's outer-vector scaling).
//
// One block a row, eight elements a thread at a time in 16-byte loads; `cols` is a multiple
// of 8. The row is read twice, the second time from cache. Where the row is computed by a
// kernel that holds it whole (`add_rms_norm`, `silu_mul_e4m3`), that kernel quantizes it the
// same way as it writes it, and this pass is not run (the helpers are in common.cuh).

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
    float scale = e4m3_row_scale(m);
    float inv = 1.f / scale;
    if (threadIdx.x == 0) scales[blockIdx.x] = scale;
    for (u32 c = threadIdx.x; c < chunks; c += blockDim.x) {
        float v[8];
        unpack8(in[c], v);
        out[c] = pack_e4m3x8(v, inv);
    }
}
