// Matrix products of few rows (decode at small batch): y[t][o] = Σ_i x[t][i] · w[o][i], bf16
// inputs and output, f32 accumulation.
//
// cuBLAS serves these shapes with tiles built for many rows, splitting long reductions over
// blocks and merging them in a second kernel; here every warp owns GEMV_ROWS output rows for
// all tokens and streams their weight rows once, 16 bytes a lane, GEMV_UNROLL loads per row in
// flight, reading x through L1 (every warp of a block reads the same x). One launch, no merge.
// `in` must be a multiple of 8.

#define GEMV_WARPS 4
#define GEMV_ROWS 2
#define GEMV_UNROLL 4

__device__ __forceinline__ float dot8(uint4 w, const float* x) {
    return bf16x2_lo(w.x) * x[0] + bf16x2_hi(w.x) * x[1] + bf16x2_lo(w.y) * x[2] +
           bf16x2_hi(w.y) * x[3] + bf16x2_lo(w.z) * x[4] + bf16x2_hi(w.z) * x[5] +
           bf16x2_lo(w.w) * x[6] + bf16x2_hi(w.w) * x[7];
}

// grid: ceil(out / (GEMV_WARPS · GEMV_ROWS)) blocks of GEMV_WARPS warps; TOKENS ≥ tokens.
template <int TOKENS>
__device__ void gemv(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* __restrict__ y,
                     u32 tokens, u32 in, u32 out) {
    u32 lane = threadIdx.x & 31;
    u32 row0 = (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * GEMV_ROWS;
    if (row0 >= out) return;
    const uint4* rows[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) rows[r] = (const uint4*)(w + (u64)min(row0 + r, out - 1) * in);
    float acc[GEMV_ROWS][TOKENS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) acc[r][t] = 0.f;
    u32 chunks = in / 8;
    for (u32 c0 = lane; c0 < chunks; c0 += 32 * GEMV_UNROLL) {
        uint4 wv[GEMV_ROWS][GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            u32 c = c0 + 32 * u;
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) wv[r][u] = c < chunks ? __ldg(rows[r] + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            u32 c = c0 + 32 * u;
            if (c >= chunks) break;
#pragma unroll
            for (int t = 0; t < TOKENS; ++t) {
                if (t >= tokens) break;
                float xv[8];
                unpack8(((const uint4*)(x + (u64)t * in))[c], xv);
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; ++r) acc[r][t] += dot8(wv[r][u], xv);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) {
            float v = warp_sum(acc[r][t]);
            if (lane == 0 && t < tokens && row0 + r < out) y[(u64)t * out + row0 + r] = f32_to_bf16(v);
        }
    }
}

#define GEMV_ENTRY(T)                                                                             \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                 \
        gemv_t##T(const bf16* x, const bf16* w, bf16* y, u32 tokens, u32 in, u32 out) {           \
        gemv<T>(x, w, y, tokens, in, out);                                                        \
    }
GEMV_ENTRY(1)
GEMV_ENTRY(2)
GEMV_ENTRY(4)
GEMV_ENTRY(8)
