// Rotary embeddings fused with the KV append.
//
// Steps holding prefill tokens use this; a decode step does the same inside its attention
// kernel. For each token of the step: the q/k/v bias is added (Qwen2), q and k heads are rotated by the
// token's position (Hugging Face's rotate_half pairing: i with i + head_dim/2), q is written
// back in place for attention, and k and v go to the token's slot in the layer's paged cache
// ([slot][kv_head][head_dim], slot = page · page_tokens + position mod page_tokens).
// With `write_q` 0 only k and v are stored: a verification's rows, whose attention (the decode
// kernel) rotates q itself.

// grid: (tokens, blocks per token); the blocks of a token share its heads' work, a thread taking
// 8 consecutive pairs (or v elements) in 16-byte loads and stores. A token's sin and cos, the
// same for every head, are computed once a block into shared memory (head_dim ≤ 256, a multiple
// of 16): each pair's rotation is the decode kernel's arithmetic (sincosf of the same product,
// rope_low / rope_high), so the bits are those its own rotation gives a one-token step. One pair a
// thread with its own sincosf took 157 µs a layer for an 8B prefill of 8,192 tokens.
#define ROPE_MAX_HALF 128
extern "C" __global__ void rope_kv_append(bf16* __restrict__ qkv, const bf16* __restrict__ bias,
                                          const float* __restrict__ inv_freq,
                                          const u32* __restrict__ positions,
                                          const u32* __restrict__ slots,
                                          bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                          u32 heads, u32 kv_heads, u32 head_dim, u32 write_q) {
    __shared__ float2 rot[ROPE_MAX_HALF];
    pdl_begin();
    u32 t = blockIdx.x, half = head_dim / 2, vecs = half / 8;
    bf16* row = qkv + (u64)t * (heads + 2 * kv_heads) * head_dim;
    float pos = (float)positions[t];
    for (u32 i = threadIdx.x; i < half; i += blockDim.x) {
        float sn, cs;
        sincosf(pos * inv_freq[i], &sn, &cs);
        rot[i] = make_float2(sn, cs);
    }
    __syncthreads();
    u64 slot = slots[t];
    // Work units of 8 elements: rotated pairs of q then k heads, then v.
    u32 rotated = (heads + kv_heads) * vecs, copied = kv_heads * head_dim / 8;
    u32 first = write_q ? 0 : heads * vecs;
    for (u32 u = first + blockIdx.y * blockDim.x + threadIdx.x; u < rotated + copied;
         u += gridDim.y * blockDim.x) {
        if (u < rotated) {
            u32 head = u / vecs, i0 = (u - head * vecs) * 8;
            u32 a = head * head_dim + i0, b = a + half;
            float x[8], y[8];
            load8_biased(row, bias, a, x);
            load8_biased(row, bias, b, y);
            float rx[8], ry[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                float2 r = rot[i0 + j];
                rx[j] = rope_low(x[j], y[j], r.y, r.x);
                ry[j] = rope_high(x[j], y[j], r.y, r.x);
            }
            uint4 px = pack8(rx), py = pack8(ry);
            if (head < heads) {
                *(uint4*)(row + a) = px;
                *(uint4*)(row + b) = py;
            } else {
                bf16* k = k_cache + (slot * kv_heads + (head - heads)) * head_dim;
                *(uint4*)(k + i0) = px;
                *(uint4*)(k + i0 + half) = py;
            }
        } else {
            u32 e = (u - rotated) * 8, at = (heads + kv_heads) * head_dim + e;
            float v[8];
            load8_biased(row, bias, at, v);
            *(uint4*)(v_cache + slot * kv_heads * head_dim + e) = pack8(v);
        }
    }
}
