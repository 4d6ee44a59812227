// A one-token decode step's layer in three launches instead of five ("folded" layers), for
// models whose batch-1 step is its launches rather than its bytes (SmolLM2-135M: 155 launches
// of ~1.3 µs boundary each against 63 µs of weights at the copy bandwidth).
//
// Two identities make a layer's projections independent of the launches before them:
// - RMSNorm scales a row by one number, so the projection of a normed row is the projection of
//   the raw row by W' = W·diag(g) (the norm's weights folded into the matrix), times that
//   number, which can be applied later by whoever reads the product;
// - the stream a norm reads is the old stream plus the sublayer's projection, so its projection
//   by W' is W'·(old stream) plus (W'·W_sub)·(the sublayer's input): the product of two
//   consecutive projections, computed once at load (`fold_weights` below).
//
// So a layer (layer 0 projects its q/k/v as an unfolded step does) runs:
// - attention, whose q, k and v it scales by the norm of the stream h (below) itself;
// - GUO: "A" rows, the raw gate/up [W_gu' | W_gu'·W_o]·[h ; a] (h the stream before the
//   layer's attention, a its output) and the next layer's q/k/v's first part
//   [W_qkv' | W_qkv'·W_o]·[h ; a], and "B" rows, the output projection h' = h + bf16(W_o·a),
//   each B block also writing the sum of its outputs' squares (the norm's partial sums);
// - QKVD: A rows, the rest of the next layer's raw q/k/v, (W_qkv'·W_down)·s added to GUO's
//   part, and B rows, the down projection h'' = h' + bf16(W_down·s), with their partial sums;
//   every block computes the activation s = silu(bf16(r·gate))·bf16(r·up) from GUO's raw
//   gate/up and the norm scale r of h', rounded as `gemv_glu` rounds them, its exponential and
//   division the fast ones (`__expf`, `__fdividef`: it sits on QKVD's chain after the wait).
// The products W'·W_sub stand for W'·bf16(W_sub·x) (one rounding fewer), and every norm's
// input is no longer rounded to bf16 before its product: the logits differ from an unfolded
// step's by about what bf16 rounding makes (tests: cuda_parity).
//
// GUO's h segment was written two launches before, so it is multiplied before the wait for
// the launch just before (a programmatic dependent launch), and the rest of every row's weights
// loaded; after the wait a block reads only what that launch wrote: GUO the attention output,
// QKVD the raw gate/up, GUO's q/k/v part and the stream h' (GUO takes the q/k/v's h and a
// parts because its launch waits on attention, the longest, whose time covers those weights'
// loads). The stream rotates over three buffers (`Forward::run_folded`). A block holds
// FOLD_ROWS rows of A or of B, its warps splitting each row's chunks of 8 as the CUDA-core
// gemv does.

#define FOLD_WARPS 4
#define FOLD_ROWS 8
#define FOLD_THREADS (32 * FOLD_WARPS)

struct FoldArgs {
    const float* h;         // [hidden] the stream before the layer's attention
    const bf16* a;          // [q_dim] attention's output
    const float* gu;        // QKVD: [2·ffn] GUO's raw gate/up
    const float* gu_parts;  // QKVD: GUO's partial sums of h'² ([hidden / FOLD_ROWS])
    const float* partial;   // QKVD: GUO's part of each A row
    const float* before;    // B rows' stream before: GUO h, QKVD h'
    const bf16* wa;         // A rows, each [hidden | q_dim] (GUO) or [ffn] (QKVD) long
    float* raw;             // A rows' outputs
    const bf16* wb;         // B rows: W_o [hidden][q_dim] or W_down [hidden][ffn]
    float* after;           // B rows' stream after
    float* parts;           // [hidden / FOLD_ROWS] partial sums of after²
    u32 rows_a, hidden, q_dim, ffn;
    float eps;
};

// The RMSNorm scale of a stream of `hidden` elements from its `hidden / 8` partial sums of
// squares, the same bits in every lane of every warp.
__device__ __forceinline__ float folded_norm_scale(const float* parts, u32 hidden, float eps) {
    float sum = 0.f;
    for (u32 i = threadIdx.x & 31; i < hidden / FOLD_ROWS; i += 32) sum += parts[i];
    sum = warp_sum(sum);
    return rsqrtf(sum / (float)hidden + eps);
}

template <bool QKVD, int UNROLL>
__device__ void gemv_fold(const FoldArgs& p) {
    __shared__ float partial[FOLD_WARPS][FOLD_ROWS];
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
    u32 blocks_a = (p.rows_a + FOLD_ROWS - 1) / FOLD_ROWS;
    bool is_a = blockIdx.x < blocks_a;
    u32 o0 = (is_a ? blockIdx.x : blockIdx.x - blocks_a) * FOLD_ROWS;
    u32 rows = is_a ? p.rows_a : p.hidden;
    u32 hc = p.hidden / 8, qc = p.q_dim / 8, fc = p.ffn / 8;
    // A GUO A row's chunks multiplied before the wait, then every row's after it.
    u32 pre = is_a && !QKVD ? hc : 0, post = QKVD ? fc : qc;
    const uint4* w[FOLD_ROWS];
#pragma unroll
    for (int r = 0; r < FOLD_ROWS; ++r) {
        u32 o = min(o0 + r, rows - 1);
        w[r] = (const uint4*)((is_a ? p.wa : p.wb) + (u64)o * (pre + post) * 8) + pre;
    }
    float acc[FOLD_ROWS];
#pragma unroll
    for (int r = 0; r < FOLD_ROWS; ++r) acc[r] = 0.f;
    for (u32 c = tid; c < pre; c += FOLD_THREADS) {
        float xv[8];
        if (c < hc) {
            float4 lo = ((const float4*)p.h)[2 * c], hi = ((const float4*)p.h)[2 * c + 1];
            xv[0] = lo.x, xv[1] = lo.y, xv[2] = lo.z, xv[3] = lo.w;
            xv[4] = hi.x, xv[5] = hi.y, xv[6] = hi.z, xv[7] = hi.w;
        } else {
            unpack8(((const uint4*)p.a)[c - hc], xv);
        }
#pragma unroll
        for (int r = 0; r < FOLD_ROWS; ++r) acc[r] += dot8(ld_weights(w[r] - pre + c), xv);
    }
    uint4 wv[FOLD_ROWS][UNROLL];
    auto load = [&](u32 c0) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            u32 c = c0 + FOLD_THREADS * u;
#pragma unroll
            for (int r = 0; r < FOLD_ROWS; ++r)
                wv[r][u] = c < post ? ld_weights(w[r] + c) : make_uint4(0, 0, 0, 0);
        }
    };
    load(tid);
    bool writes = tid < FOLD_ROWS && o0 + tid < rows;
    // What a writer adds its sum to: GUO's stream before is two launches old; QKVD's, and its
    // A rows' GUO part, the launch just before wrote.
    float before = 0.f;
    if (!QKVD && !is_a && writes) before = p.before[o0 + tid];
    // GUO waits on attention, the layer's longest launch: QKVD's blocks launch meanwhile and
    // load their weights (their own wait covers GUO).
    if (!QKVD) pdl_trigger_early();
    pdl_begin();
    if (QKVD && writes) before = is_a ? p.partial[o0 + tid] : p.before[o0 + tid];
    // QKVD: the first chunks' raw gate/up loaded before the norm's partial sums are summed, so
    // that the two loads' latencies overlap.
    float4 gate_up[UNROLL][4];
    if (QKVD)
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            u32 c = tid + FOLD_THREADS * u;
            if (c >= post) break;
            const float4* g = (const float4*)(p.gu + c * 8);
            const float4* up = (const float4*)(p.gu + p.ffn + c * 8);
            gate_up[u][0] = g[0], gate_up[u][1] = g[1], gate_up[u][2] = up[0], gate_up[u][3] = up[1];
        }
    float scale = QKVD ? folded_norm_scale(p.gu_parts, p.hidden, p.eps) : 0.f;
    for (u32 c0 = tid; c0 < post; c0 += FOLD_THREADS * UNROLL) {
        if (c0 != tid) load(c0);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            u32 c = c0 + FOLD_THREADS * u;
            if (c >= post) break;
            float xv[8];
            if (QKVD) {
                if (c0 != tid) {
                    const float4* g = (const float4*)(p.gu + c * 8);
                    const float4* up = (const float4*)(p.gu + p.ffn + c * 8);
                    gate_up[u][0] = g[0], gate_up[u][1] = g[1], gate_up[u][2] = up[0], gate_up[u][3] = up[1];
                }
                float4 g0 = gate_up[u][0], g1 = gate_up[u][1], u0 = gate_up[u][2], u1 = gate_up[u][3];
                float gs[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
                float us[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    float gate = round_bf16(gs[i] * scale), upv = round_bf16(us[i] * scale);
                    xv[i] = round_bf16(__fdividef(gate, 1.f + __expf(-gate)) * upv);
                }
            } else {
                unpack8(((const uint4*)p.a)[c], xv);
            }
#pragma unroll
            for (int r = 0; r < FOLD_ROWS; ++r) acc[r] += dot8(wv[r][u], xv);
        }
    }
#pragma unroll
    for (int r = 0; r < FOLD_ROWS; ++r) {
        float v = warp_sum(acc[r]);
        if (lane == 0) partial[warp][r] = v;
    }
    __syncthreads();
    if (warp != 0) return;
    float v = 0.f;
    if (tid < FOLD_ROWS)
#pragma unroll
        for (int i = 0; i < FOLD_WARPS; ++i) v += partial[i][tid];
    if (is_a) {
        if (writes) p.raw[o0 + tid] = before + v;
        return;
    }
    float y = writes ? before + round_bf16(v) : 0.f;
    if (writes) p.after[o0 + tid] = y;
    float squares = warp_sum(y * y);
    if (lane == 0) p.parts[o0 / FOLD_ROWS] = squares;
}

#define FOLD_ENTRY(NAME, QKVD, UNROLL)                                                            \
    extern "C" __global__ void __launch_bounds__(FOLD_THREADS)                                    \
        NAME##_u##UNROLL(const float* h, const bf16* a, const float* gu, const float* gu_parts,  \
                         const float* partial, const float* before, const bf16* wa, float* raw,   \
                         const bf16* wb, float* after, float* parts, u32 rows_a, u32 hidden,      \
                         u32 q_dim, u32 ffn, float eps) {                                         \
        FoldArgs p = {h,  a,     gu,    gu_parts, partial, before, wa,  raw,                      \
                      wb, after, parts, rows_a,   hidden,  q_dim,  ffn, eps};                     \
        gemv_fold<QKVD, UNROLL>(p);                                                               \
    }
FOLD_ENTRY(gemv_fold_guo, false, 1)
FOLD_ENTRY(gemv_fold_guo, false, 2)
FOLD_ENTRY(gemv_fold_guo, false, 4)
FOLD_ENTRY(gemv_fold_qkvd, true, 1)
FOLD_ENTRY(gemv_fold_qkvd, true, 2)
FOLD_ENTRY(gemv_fold_qkvd, true, 4)

// Builds a folded matrix's columns col0..col0 + n of rows 0..gridDim.y: with `b` ([k][n]),
// out[o][col0 + j] = bf16(Σ_i a[o][i]·g[i]·b[i][j]) summed in f32; without (n = k),
// out[o][col0 + j] = bf16(a[o][j]·g[j]). `a` is [rows][k]; dynamic shared memory k floats.
extern "C" __global__ void fold_weights(const bf16* a, const bf16* g, const bf16* b, bf16* out,
                                        u32 k, u32 n, u32 out_stride, u32 col0) {
    extern __shared__ float s_row[];
    u32 o = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    for (u32 i = threadIdx.x; i < k; i += blockDim.x)
        s_row[i] = bf16_to_f32(a[(u64)o * k + i]) * bf16_to_f32(g[i]);
    __syncthreads();
    if (j >= n) return;
    float sum;
    if (b) {
        sum = 0.f;
        for (u32 i = 0; i < k; ++i) sum += s_row[i] * bf16_to_f32(b[(u64)i * n + j]);
    } else {
        sum = s_row[j];
    }
    out[(u64)o * out_stride + col0 + j] = f32_to_bf16(sum);
}
