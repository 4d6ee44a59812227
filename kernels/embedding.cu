// Embedding gather: the rows of the step's token ids become the f32 residual stream.

// grid: one block per token; each thread copies chunks of 8 elements (hidden is a multiple of 8).
extern "C" __global__ void embed_tokens(const bf16* __restrict__ table,
                                        const u32* __restrict__ token_ids,
                                        float* __restrict__ residual, u32 hidden) {
    pdl_begin();
    const uint4* row = (const uint4*)(table + (u64)token_ids[blockIdx.x] * hidden);
    float4* out = (float4*)(residual + (u64)blockIdx.x * hidden);
    for (u32 c = threadIdx.x; c < hidden / 8; c += blockDim.x) {
        float v[8];
        unpack8(row[c], v);
        out[2 * c] = make_float4(v[0], v[1], v[2], v[3]);
        out[2 * c + 1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}
