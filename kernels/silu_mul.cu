// The gated MLP's activation: out = silu(gate) · up, where a row of `gate_up` is [gate | up].
//
// Eight elements a thread per iteration, in 16-byte loads and stores, when `ffn` is a multiple
// of 8 (every shape we serve); one at a time otherwise. Both compute each element the same way.

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.f + expf(-g)) * u; }

extern "C" __global__ void silu_mul(const bf16* __restrict__ gate_up, bf16* __restrict__ out,
                                    u32 tokens, u32 ffn) {
    pdl_begin();
    u32 stride = gridDim.x * blockDim.x;
    if (ffn % 8 == 0) {
        u32 chunks = ffn / 8, n = tokens * chunks;
        for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
            u32 t = i / chunks, c = i - t * chunks;
            const uint4* row = (const uint4*)(gate_up + (u64)t * 2 * ffn);
            float g[8], u[8];
            unpack8(row[c], g);
            unpack8(row[chunks + c], u);
            ((uint4*)out)[i] = make_uint4(pack_bf16x2(silu_times(g[0], u[0]), silu_times(g[1], u[1])),
                                          pack_bf16x2(silu_times(g[2], u[2]), silu_times(g[3], u[3])),
                                          pack_bf16x2(silu_times(g[4], u[4]), silu_times(g[5], u[5])),
                                          pack_bf16x2(silu_times(g[6], u[6]), silu_times(g[7], u[7])));
        }
        return;
    }
    u32 n = tokens * ffn;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        u32 t = i / ffn, j = i - t * ffn;
        const bf16* row = gate_up + (u64)t * 2 * ffn;
        out[i] = f32_to_bf16(silu_times(bf16_to_f32(row[j]), bf16_to_f32(row[ffn + j])));
    }
}

// silu_mul for an FP8 product's input: a block a token, each element rounded to bf16 as
// `silu_mul` writes it, then the row quantized into `q` and `q_scales` exactly as
// `quantize_rows_e4m3` would quantize `silu_mul`'s row (fp8.cu). Each thread holds up to
// SILU_E4M3_CHUNKS chunks of 8 between the two passes; `ffn` is a multiple of 8 and at most
// 8 · SILU_E4M3_CHUNKS · blockDim.x.
#define SILU_E4M3_CHUNKS 4

extern "C" __global__ void __launch_bounds__(1024) silu_mul_e4m3(const bf16* __restrict__ gate_up, unsigned char* __restrict__ q,
                                         float* __restrict__ q_scales, u32 ffn) {
    __shared__ float scratch[32];
    pdl_begin();
    u32 t = blockIdx.x, chunks = ffn / 8;
    const uint4* row = (const uint4*)(gate_up + (u64)t * 2 * ffn);
    float v[SILU_E4M3_CHUNKS][8];
#pragma unroll
    for (int c = 0; c < SILU_E4M3_CHUNKS; ++c) {
        u32 chunk = threadIdx.x + c * blockDim.x;
        if (chunk >= chunks) continue;
        float g[8], u[8];
        unpack8(row[chunk], g);
        unpack8(row[chunks + chunk], u);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[c][i] = bf16_to_f32(f32_to_bf16(silu_times(g[i], u[i])));
    }
    store_row_e4m3<SILU_E4M3_CHUNKS>(v, chunks, q + (u64)t * ffn, q_scales + t, scratch);
}
