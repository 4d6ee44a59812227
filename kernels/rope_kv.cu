// Rotary embeddings fused with the KV append.
//
// Steps holding prefill tokens use this; a decode step does the same inside its attention
// kernel. For each token of the step: the q/k/v bias is added (Qwen2), q and k heads are rotated by the
// token's position (Hugging Face's rotate_half pairing: i with i + head_dim/2), q is written
// back in place for attention, and k and v go to the token's slot in the layer's paged cache
// ([slot][kv_head][head_dim], slot = page · page_tokens + position mod page_tokens).
// With `write_q` 0 only k and v are stored: a verification's rows, whose attention (the decode
// kernel) rotates q itself.

// grid: (tokens, blocks per token); the blocks of a token share its heads' pairs.
extern "C" __global__ void rope_kv_append(bf16* __restrict__ qkv, const bf16* __restrict__ bias,
                                          const float* __restrict__ inv_freq,
                                          const u32* __restrict__ positions,
                                          const u32* __restrict__ slots,
                                          bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                          u32 heads, u32 kv_heads, u32 head_dim, u32 write_q) {
    pdl_begin();
    u32 t = blockIdx.x, half = head_dim / 2;
    bf16* row = qkv + (u64)t * (heads + 2 * kv_heads) * head_dim;
    float pos = (float)positions[t];
    u64 slot = slots[t];
    u32 rotated = (heads + kv_heads) * half, copied = kv_heads * head_dim;
    u32 first = write_q ? 0 : heads * half;
    for (u32 u = first + blockIdx.y * blockDim.x + threadIdx.x; u < rotated + copied;
         u += gridDim.y * blockDim.x) {
        if (u < rotated) {
            u32 head = u / half, i = u - head * half;
            u32 a = head * head_dim + i, b = a + half;
            float x = bf16_to_f32(row[a]), y = bf16_to_f32(row[b]);
            if (bias) {
                x += bf16_to_f32(bias[a]);
                y += bf16_to_f32(bias[b]);
            }
            float s, c;
            sincosf(pos * inv_freq[i], &s, &c);
            bf16 rx = f32_to_bf16(x * c - y * s), ry = f32_to_bf16(y * c + x * s);
            if (head < heads) {
                row[a] = rx;
                row[b] = ry;
            } else {
                bf16* k = k_cache + (slot * kv_heads + (head - heads)) * head_dim;
                k[i] = rx;
                k[i + half] = ry;
            }
        } else {
            u32 e = u - rotated, at = (heads + kv_heads) * head_dim + e;
            float v = bf16_to_f32(row[at]);
            if (bias) v += bf16_to_f32(bias[at]);
            v_cache[slot * kv_heads * head_dim + e] = f32_to_bf16(v);
        }
    }
}
