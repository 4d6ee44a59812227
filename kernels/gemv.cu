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
// - GEMV_F32: y is f32 rows, the sums unrounded (the vocabulary projection's logits at batch 1:
//   its 56 MB for SmolLM2 read at the weights' L2 priority, `ld_weights`, where cuBLAS's
//   tiles read them at the normal one);
// - GEMV_ACCUM: y is the f32 residual stream; the product, rounded to bf16 as a sublayer's
//   output is, is added to it (each element has one writer, so in place is safe). The element
//   is read before waiting for the kernel before (a programmatic dependent launch), so that the
//   sum is not one more load after the product: the kernel just before a GEMV_ACCUM gemv must
//   not write y (it is attention, or the gate/up product and its SiLU, in every forward pass),
//   and every kernel before that one has finished when this one starts.
//
// With FP8 weights (the `w8_` entries, sm_89 and newer) w holds e4m3 rows, one f32 scale a row
// in `w_scales`: a lane reads two chunks of 8 elements at once (16 bytes, as bf16 rows are
// read), widened exactly (e4m3 → f16 → f32), and each row's sum is multiplied by its scale
// before the rounding and fusions above; x stays bf16 (weights alone in FP8: a small batch's
// product is the weights' bytes).

#define GEMV_WARPS 4
#define GEMV_ROWS 8
#define GEMV_UNROLL 2
#define GEMV_NORM 1
#define GEMV_GLU 2
#define GEMV_ACCUM 4
#define GEMV_F32 8

__device__ __forceinline__ float dot8(uint4 w, const float* x) {
    return bf16x2_lo(w.x) * x[0] + bf16x2_hi(w.x) * x[1] + bf16x2_lo(w.y) * x[2] +
           bf16x2_hi(w.y) * x[3] + bf16x2_lo(w.z) * x[4] + bf16x2_hi(w.z) * x[5] +
           bf16x2_lo(w.w) * x[6] + bf16x2_hi(w.w) * x[7];
}

// Two e4m3 values (the low byte first in memory) as floats, exactly.
__device__ __forceinline__ void e4m3x2_to_f32(u32 pair, float& lo, float& hi) {
#if __CUDA_ARCH__ >= 890
    u32 halves;
    unsigned short bits = (unsigned short)pair, l, h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(bits));
    l = (unsigned short)halves;
    h = (unsigned short)(halves >> 16);
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(l));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(h));
#else
    __trap();
#endif
}

// Eight e4m3 weights (the low word's low byte first) against eight x values.
__device__ __forceinline__ float dot8_e4m3(uint4 w, const float* x) {
    float v[8];
    e4m3x2_to_f32(w.x, v[0], v[1]);
    e4m3x2_to_f32(w.x >> 16, v[2], v[3]);
    e4m3x2_to_f32(w.y, v[4], v[5]);
    e4m3x2_to_f32(w.y >> 16, v[6], v[7]);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += v[i] * x[i];
    return sum;
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
template <int TOKENS, int MODE, bool W8>
__device__ void gemv(const void* __restrict__ xp, const void* __restrict__ w, void* __restrict__ yp,
                     const bf16* __restrict__ norm_w, float eps, u32 tokens, u32 in, u32 out,
                     const float* __restrict__ w_scales) {
    constexpr bool NORM = MODE & GEMV_NORM, GLU = MODE & GEMV_GLU, ACCUM = MODE & GEMV_ACCUM;
    constexpr bool F32 = MODE & GEMV_F32;
    // Outputs a block writes: with GLU, rows o and out + o make output o.
    constexpr int OUTS = GLU ? GEMV_ROWS / 2 : GEMV_ROWS;
    __shared__ float partial[GEMV_WARPS][GEMV_ROWS][TOKENS];
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 o0 = blockIdx.x * OUTS;
    if (o0 >= out) {
        pdl_begin();
        return;
    }
    // A chunk of 8 elements: 16 bytes of bf16, 8 of e4m3.
    constexpr u32 CHUNK_BYTES = W8 ? 8 : 16;
    const unsigned char* rows[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
        u32 o = min(o0 + (GLU ? r % OUTS : r), out - 1);
        u64 row = GLU && r >= OUTS ? (u64)out + o : o;
        rows[r] = (const unsigned char*)w + row * in * (CHUNK_BYTES / 8);
    }
    // The block's warps share the rows: lane l of warp w reads unit w·32 + l, then one block
    // width further on, so a block streams contiguous 2 KB of each row at a time. A unit is a
    // chunk of 8 elements (16 bytes of bf16), or with e4m3 two adjacent chunks (16 bytes).
    constexpr u32 STRIDE = 32 * GEMV_WARPS;
    constexpr u32 PER = W8 ? 2 : 1;
    u32 chunks = in / 8, units = (chunks + PER - 1) / PER;
    constexpr int UNROLL = GEMV_UNROLL;
    uint4 wv[GEMV_ROWS][UNROLL], gv[UNROLL][PER];
    auto load = [&](u32 c0) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            u32 n = c0 + STRIDE * u, c = n * PER;
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) {
                if (c >= chunks) {
                    wv[r][u] = make_uint4(0, 0, 0, 0);
                } else if (W8 && c + 1 >= chunks) {
                    uint2 v = ld_weights2(rows[r] + (u64)c * CHUNK_BYTES);
                    wv[r][u] = make_uint4(v.x, v.y, 0, 0);
                } else {
                    wv[r][u] = ld_weights(rows[r] + (u64)c * CHUNK_BYTES);
                }
            }
            if (NORM)
#pragma unroll
                for (int h = 0; h < PER; ++h)
                    gv[u][h] = c + h < chunks ? __ldg((const uint4*)norm_w + c + h)
                                              : make_uint4(0, 0, 0, 0);
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
    for (u32 c0 = warp * 32 + lane; c0 < units; c0 += STRIDE * UNROLL) {
        if (c0 != warp * 32 + lane) load(c0);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
            for (int h = 0; h < PER; ++h) {
                u32 c = (c0 + STRIDE * u) * PER + h;
                if (c >= chunks) break;
                float g[8];
                if (NORM) unpack8(gv[u][h], g);
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
                    for (int r = 0; r < GEMV_ROWS; ++r) {
                        uint4 w = wv[r][u];
                        acc[r][t] += W8 ? dot8_e4m3(h ? make_uint4(w.z, w.w, 0, 0) : w, xv)
                                        : dot8(w, xv);
                    }
                }
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
        if (W8) v[k] *= w_scales[k ? out + o0 + o : o0 + o];
    }
    if (GLU) {
        float gate = round_bf16(v[0]), up = round_bf16(v[1]);
        ((bf16*)yp)[at] = f32_to_bf16(gate / (1.f + expf(-gate)) * up);
    } else if (ACCUM) {
        ((float*)yp)[at] = y_before + round_bf16(v[0]);
    } else if (F32) {
        ((float*)yp)[at] = v[0];
    } else {
        ((bf16*)yp)[at] = f32_to_bf16(v[0]);
    }
}

// `w_scales` is read by the `w8_` entries only (null for the others).
#define GEMV_ENTRY(NAME, T, MODE, W8)                                                             \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                 \
        NAME##_t##T(const void* x, const void* w, void* y, const bf16* norm_w, float eps,          \
                    u32 tokens, u32 in, u32 out, const float* w_scales) {                         \
        gemv<T, MODE, W8>(x, w, y, norm_w, eps, tokens, in, out, w_scales);                       \
    }
#define GEMV_ENTRIES(NAME, MODE)                                                                  \
    GEMV_ENTRY(NAME, 1, MODE, false)                                                              \
    GEMV_ENTRY(NAME, 2, MODE, false)                                                              \
    GEMV_ENTRY(NAME, 4, MODE, false)                                                              \
    GEMV_ENTRY(NAME, 8, MODE, false)                                                              \
    GEMV_ENTRY(w8_##NAME, 1, MODE, true)                                                          \
    GEMV_ENTRY(w8_##NAME, 2, MODE, true)                                                          \
    GEMV_ENTRY(w8_##NAME, 4, MODE, true)                                                          \
    GEMV_ENTRY(w8_##NAME, 8, MODE, true)
GEMV_ENTRIES(gemv, 0)
GEMV_ENTRIES(gemv_norm, GEMV_NORM)
GEMV_ENTRIES(gemv_glu, GEMV_GLU)
GEMV_ENTRIES(gemv_norm_glu, GEMV_NORM | GEMV_GLU)
GEMV_ENTRIES(gemv_accum, GEMV_ACCUM)
GEMV_ENTRY(gemv_f32, 1, GEMV_F32, false)
