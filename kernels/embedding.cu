// Embedding gather: the rows of the step's token ids become the f32 residual stream.

// grid: one block per token; each thread copies chunks of 8 elements (hidden is a multiple of 8).
// With `slice` null the table is whole. Otherwise it holds vocabulary rows `row0..row0 + rows`
// (one rank's of a split model): the token's row goes to `slice` as bf16 if this rank holds
// it, zeros if not, and the residual is zeroed, for the all-reduce to add every rank's slice.
extern "C" __global__ void embed_tokens(const bf16* __restrict__ table,
                                        const u32* __restrict__ token_ids,
                                        float* __restrict__ residual, bf16* __restrict__ slice,
                                        u32 hidden, u32 row0, u32 rows) {
    pdl_begin();
    const u32 id = token_ids[blockIdx.x] - row0;
    const uint4* row = (const uint4*)(table + (u64)id * hidden);
    float4* out = (float4*)(residual + (u64)blockIdx.x * hidden);
    if (slice == nullptr) {
        for (u32 c = threadIdx.x; c < hidden / 8; c += blockDim.x) {
            float v[8];
            unpack8(row[c], v);
            out[2 * c] = make_float4(v[0], v[1], v[2], v[3]);
            out[2 * c + 1] = make_float4(v[4], v[5], v[6], v[7]);
        }
        return;
    }
    // Unsigned: ids below row0 wrap past `rows`.
    const bool held = id < rows;
    uint4* mine = (uint4*)(slice + (u64)blockIdx.x * hidden);
    for (u32 c = threadIdx.x; c < hidden / 8; c += blockDim.x) {
        mine[c] = held ? row[c] : make_uint4(0u, 0u, 0u, 0u);
        out[2 * c] = make_float4(0.f, 0.f, 0.f, 0.f);
        out[2 * c + 1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
}
