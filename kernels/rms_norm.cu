// RMSNorm fused with the residual add that precedes it.
//
// The residual stream stays f32 between layers; a sublayer's bf16 output is added to it here,
// and the normalized row goes out in bf16 for the next matrix product. As Hugging Face's
// Llama: out = (x · rsqrt(mean(x²) + eps)) · weight. Each thread holds up to NORM_CHUNKS
// chunks of 8 elements in registers, all loaded (the weights too) before any is used, so a row
// costs one trip to memory: at batch 1 this kernel is latency, not bandwidth.

#define NORM_CHUNKS 4

// grid: one block per token; block: at least hidden / (8 · NORM_CHUNKS) threads. `delta` may be
// null (nothing to add). `out_rows` may be null (token t writes row t); else token t writes row
// out_rows[t], or nothing for NO_ROW, which packs the rows whose logits are wanted.
//
// With `q` not null the row goes out in FP8 instead, for an FP8 product: each element rounded to
// bf16 as `out` would hold it, then quantized with the row's scale into `q` and `q_scales`
// exactly as `quantize_rows_e4m3` would quantize `out` (fp8.cu), one pass instead of three.
extern "C" __global__ void __launch_bounds__(1024) add_rms_norm(float* __restrict__ residual,
                                        const bf16* __restrict__ delta,
                                        const bf16* __restrict__ weight,
                                        bf16* __restrict__ out,
                                        const u32* __restrict__ out_rows,
                                        unsigned char* __restrict__ q,
                                        float* __restrict__ q_scales,
                                        u32 hidden, float eps) {
    pdl_begin();
    __shared__ float scratch[32];
    u32 t = blockIdx.x, chunks = hidden / 8;
    float4* x = (float4*)(residual + (u64)t * hidden);
    float v[NORM_CHUNKS][8], square_sum = 0.f;
    uint4 w_bits[NORM_CHUNKS];
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; ++c) {
        u32 chunk = threadIdx.x + c * blockDim.x;
        if (chunk >= chunks) continue;
        w_bits[c] = ((const uint4*)weight)[chunk];
        float4 a = x[2 * chunk], b = x[2 * chunk + 1];
        v[c][0] = a.x, v[c][1] = a.y, v[c][2] = a.z, v[c][3] = a.w;
        v[c][4] = b.x, v[c][5] = b.y, v[c][6] = b.z, v[c][7] = b.w;
        if (delta) {
            float d[8];
            unpack8(((const uint4*)(delta + (u64)t * hidden))[chunk], d);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[c][i] += d[i];
            x[2 * chunk] = make_float4(v[c][0], v[c][1], v[c][2], v[c][3]);
            x[2 * chunk + 1] = make_float4(v[c][4], v[c][5], v[c][6], v[c][7]);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) square_sum += v[c][i] * v[c][i];
    }
    square_sum = block_sum(square_sum, scratch);
    u32 row = out_rows ? out_rows[t] : t;
    if (row == NO_ROW) return;
    float scale = rsqrtf(square_sum / (float)hidden + eps);
    // The row in bf16 into `out`, or, for an FP8 product, rounded to bf16 in the registers that
    // held the inputs and then stored in FP8.
    uint4* y = (uint4*)(out + (u64)row * hidden);
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; ++c) {
        u32 chunk = threadIdx.x + c * blockDim.x;
        if (chunk >= chunks) continue;
        float w[8];
        unpack8(w_bits[c], w);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[c][i] = (v[c][i] * scale) * w[i];
        if (!q) {
            y[chunk] = pack8(v[c]);
            continue;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) v[c][i] = bf16_to_f32(f32_to_bf16(v[c][i]));
    }
    if (q) store_row_e4m3<NORM_CHUNKS>(v, chunks, q + (u64)row * hidden, q_scales + row, scratch);
}
