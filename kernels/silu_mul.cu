// The gated MLP's activation: out = silu(gate) · up, where a row of `gate_up` is [gate | up].

extern "C" __global__ void silu_mul(const bf16* __restrict__ gate_up, bf16* __restrict__ out,
                                    u32 tokens, u32 ffn) {
    pdl_begin();
    u32 n = tokens * ffn;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        u32 t = i / ffn, j = i - t * ffn;
        const bf16* row = gate_up + (u64)t * 2 * ffn;
        float g = bf16_to_f32(row[j]), u = bf16_to_f32(row[ffn + j]);
        out[i] = f32_to_bf16(g / (1.f + expf(-g)) * u);
    }
}
