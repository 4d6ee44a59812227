// Matrix products of few rows (decode at small batch): y[t][o] = Σ_i x[t][i] · w[o][i], bf16
// weights, f32 accumulation.
//
// cuBLAS serves these shapes with tiles built for many rows, splitting long reductions over
// blocks and merging them in a second kernel; here every block owns GEMV_ROWS weight rows for
// all tokens and streams them once, 16 bytes a lane, GEMV_UNROLL loads per row in flight, its
// warps splitting the reduction and summing it through shared memory: enough blocks and loads in
// flight for long rows and few outputs (Llama-3.1-8B's down projection: 4,096 rows of 14,336),
// and each chunk of x read once a block for all its rows. One launch, no merge.
// `in` must be a multiple of 8.
//
// At batch 1 a small model's step is its launches, so the gemv also does the work of the
// kernels around it (MODE, a sum of the flags below):
// - GEMV_NORM: x is the f32 residual stream and the product's input is its RMSNorm with
//   `norm_w`, computed by every block (for short rows: a block reads x whole), rounded to bf16
//   as `add_rms_norm` writes it;
// - GEMV_GLU: w is [gate; up] (2·out rows); a block takes gate rows o.. and up rows out + o..
//   and writes silu(gate) · up, each rounded to bf16 first as `silu_mul` reads them;
// - GEMV_ACCUM: y is the f32 residual stream; the product, rounded to bf16 as a sublayer's
//   output is, is added to it (each element has one writer, so in place is safe). The element
//   is read before waiting for the kernel before (a programmatic dependent launch), so that the
//   sum is not one more load after the product: the kernel just before a GEMV_ACCUM gemv must
//   not write y (it is attention, or the gate/up product and its SiLU, in every forward pass),
//   and every kernel before that one has finished when this one starts.

#define GEMV_WARPS 4
#define GEMV_ROWS 8
#define GEMV_UNROLL 2
#define GEMV_NORM 1
#define GEMV_GLU 2
#define GEMV_ACCUM 4

__device__ __forceinline__ float dot8(uint4 w, const float* x) {
    return bf16x2_lo(w.x) * x[0] + bf16x2_hi(w.x) * x[1] + bf16x2_lo(w.y) * x[2] +
           bf16x2_hi(w.y) * x[3] + bf16x2_lo(w.z) * x[4] + bf16x2_hi(w.z) * x[5] +
           bf16x2_lo(w.w) * x[6] + bf16x2_hi(w.w) * x[7];
}

__device__ __forceinline__ float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

// The RMSNorm scale of each of `tokens` rows of the f32 stream `x`, in every thread: the
// block's warps sum the chunks they will read again for the product, then share the sums.
template <int TOKENS>
__device__ __forceinline__ void gemv_norm_scales(const float* __restrict__ x, u32 tokens, u32 in,
                                                 float eps, float* scale) {
    __shared__ float sums[GEMV_WARPS][TOKENS];
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
        if (t >= tokens) break;
        const float4* row = (const float4*)(x + (u64)t * in);
        float sum = 0.f;
        for (u32 c = threadIdx.x; c < in / 8; c += 32 * GEMV_WARPS) {
            float4 a = row[2 * c], b = row[2 * c + 1];
            sum += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
            sum += b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
        }
        sum = warp_sum(sum);
        if (lane == 0) sums[warp][t] = sum;
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
        if (t >= tokens) break;
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < GEMV_WARPS; ++i) sum += sums[i][t];
        scale[t] = rsqrtf(sum / (float)in + eps);
    }
}

// grid: ceil(out / outputs a block) blocks of GEMV_WARPS warps; TOKENS ≥ tokens.
template <int TOKENS, int MODE>
__device__ void gemv(const void* __restrict__ xp, const bf16* __restrict__ w, void* __restrict__ yp,
                     const bf16* __restrict__ norm_w, float eps, u32 tokens, u32 in, u32 out) {
    constexpr bool NORM = MODE & GEMV_NORM, GLU = MODE & GEMV_GLU, ACCUM = MODE & GEMV_ACCUM;
    // Outputs a block writes: with GLU, rows o and out + o make output o.
    constexpr int OUTS = GLU ? GEMV_ROWS / 2 : GEMV_ROWS;
    __shared__ float partial[GEMV_WARPS][GEMV_ROWS][TOKENS];
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 o0 = blockIdx.x * OUTS;
    if (o0 >= out) {
        pdl_begin();
        return;
    }
    const uint4* rows[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
        u32 o = min(o0 + (GLU ? r % OUTS : r), out - 1);
        u64 row = GLU && r >= OUTS ? (u64)out + o : o;
        rows[r] = (const uint4*)(w + row * in);
    }
    // The block's warps share the rows: lane l of warp w reads chunks w·32 + l, then one block
    // width further on, so a block streams contiguous 2 KB of each row at a time.
    constexpr u32 STRIDE = 32 * GEMV_WARPS;
    u32 chunks = in / 8;
    uint4 wv[GEMV_ROWS][GEMV_UNROLL], gv[GEMV_UNROLL];
    auto load = [&](u32 c0) {
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            u32 c = c0 + STRIDE * u;
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) wv[r][u] = c < chunks ? __ldg(rows[r] + c) : make_uint4(0, 0, 0, 0);
            if (NORM) gv[u] = c < chunks ? __ldg((const uint4*)norm_w + c) : make_uint4(0, 0, 0, 0);
        }
    };
    // Thread t·OUTS + o writes output o of token t (at the end); with ACCUM it reads y there
    // now (see the top).
    u32 o = threadIdx.x % OUTS, t = threadIdx.x / OUTS;
    bool writes = t < tokens && t < TOKENS && o0 + o < out;
    u64 at = (u64)t * out + o0 + o;
    float y_before = ACCUM && writes ? ((const float*)yp)[at] : 0.f;
    // The first loads go out before waiting for the kernel before (a programmatic dependent
    // launch): no kernel of a step writes the weights or the norm's, so they stream during that
    // kernel's last blocks instead of after them. x only after the wait.
    load(warp * 32 + lane);
    pdl_begin();
    float scale[TOKENS];
    if (NORM) gemv_norm_scales<TOKENS>((const float*)xp, tokens, in, eps, scale);
    float acc[GEMV_ROWS][TOKENS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) acc[r][t] = 0.f;
    for (u32 c0 = warp * 32 + lane; c0 < chunks; c0 += STRIDE * GEMV_UNROLL) {
        if (c0 != warp * 32 + lane) load(c0);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            u32 c = c0 + STRIDE * u;
            if (c >= chunks) break;
            float g[8];
            if (NORM) unpack8(gv[u], g);
#pragma unroll
            for (int t = 0; t < TOKENS; ++t) {
                if (t >= tokens) break;
                float xv[8];
                if (NORM) {
                    const float4* row = (const float4*)((const float*)xp + (u64)t * in) + 2 * c;
                    float4 a = row[0], b = row[1];
                    float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                    for (int i = 0; i < 8; ++i) xv[i] = round_bf16((v[i] * scale[t]) * g[i]);
                } else {
                    unpack8(((const uint4*)((const bf16*)xp + (u64)t * in))[c], xv);
                }
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; ++r) acc[r][t] += dot8(wv[r][u], xv);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) {
            float v = warp_sum(acc[r][t]);
            if (lane == 0) partial[warp][r][t] = v;
        }
    __syncthreads();
    // Thread t·OUTS + o writes output o of token t, summing over the warps in a fixed order.
    if (!writes) return;
    float v[2];
#pragma unroll
    for (int k = 0; k < (GLU ? 2 : 1); ++k) {
        v[k] = 0.f;
#pragma unroll
        for (int i = 0; i < GEMV_WARPS; ++i) v[k] += partial[i][o + k * OUTS][t];
    }
    if (GLU) {
        float gate = round_bf16(v[0]), up = round_bf16(v[1]);
        ((bf16*)yp)[at] = f32_to_bf16(gate / (1.f + expf(-gate)) * up);
    } else if (ACCUM) {
        ((float*)yp)[at] = y_before + round_bf16(v[0]);
    } else {
        ((bf16*)yp)[at] = f32_to_bf16(v[0]);
    }
}

#define GEMV_ENTRY(NAME, T, MODE)                                                                 \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                 \
        NAME##_t##T(const void* x, const bf16* w, void* y, const bf16* norm_w, float eps,          \
                    u32 tokens, u32 in, u32 out) {                                                \
        gemv<T, MODE>(x, w, y, norm_w, eps, tokens, in, out);                                     \
    }
#define GEMV_ENTRIES(NAME, MODE)                                                                  \
    GEMV_ENTRY(NAME, 1, MODE)                                                                     \
    GEMV_ENTRY(NAME, 2, MODE)                                                                     \
    GEMV_ENTRY(NAME, 4, MODE)                                                                     \
    GEMV_ENTRY(NAME, 8, MODE)
GEMV_ENTRIES(gemv, 0)
GEMV_ENTRIES(gemv_norm, GEMV_NORM)
GEMV_ENTRIES(gemv_glu, GEMV_GLU)
GEMV_ENTRIES(gemv_norm_glu, GEMV_NORM | GEMV_GLU)
GEMV_ENTRIES(gemv_accum, GEMV_ACCUM)
