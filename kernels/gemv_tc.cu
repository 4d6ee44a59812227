// Matrix products of at most 8 tokens on the tensor cores, batch-invariant:
// y[t][o] = Σ_i x[t][i] · w[o][i], bf16 weights, f32 accumulation, the same fusions as gemv.cu
// (GEMV_NORM, GEMV_GLU, GEMV_ACCUM; see there).
//
// Why a second gemv: gemv.cu's per-token sums do not depend on the token count either, but on
// the CUDA cores 8 tokens cost 8 multiply-adds a weight, so a verification of 8 positions ran
// at a third of the copy bandwidth (8B shape: 10.5 ms against a decode step's 4.2). Here a
// warp's mma.m16n8k16 multiplies the tokens (rows of A; 8 of its 16 used, absent tokens zero)
// by a tile of 8 weight rows (columns of B), so 1 and 8 tokens cost the same instructions. The
// engine uses it for one-token steps and verifications of up to 8 positions where speculation
// must give the text of one token a step (`CudaOptions::exact_verify`). For one token alone
// it is faster than gemv.cu on long rows and slower on short ones, where a step is its
// launches (H200, batch 1: 8B 4.05 against 4.19 ms a step, SmolLM2 0.623 against 0.579).
//
// A block owns one tile; its GEMV_TC_WARPS warps split the reduction, warp w taking a
// contiguous run of chunks of GEMV_TC_CHUNK elements (chunks · w / WARPS up to the next
// warp's first); the warps' partial tiles are summed through shared memory in warp order.
//
// The weights stream through a ring of GEMV_TC_STAGES chunks a warp in shared memory
// (cp.async, GEMV_TC_STAGES - 1 chunks in flight while one is used), so the loads in flight do
// not cost registers: a block of 8 warps keeps 32 KB of weights coming. Each copy takes 16
// bytes and a warp's copy instruction 128 contiguous bytes of each of 4 rows (lane l: piece
// l % 8 of tile row 4j + l / 8 in copy j); a warp waits for its own copies, then __syncwarp
// before reading what other lanes copied. Stored at piece ^ row, so that the fragment reads
// (8 lanes a 128-byte phase: 2 rows, 4 pieces each) hit distinct banks. Without a norm the
// tokens' x (bf16, as the weights) comes through the ring too, a row a token; with one, x is
// f32 and is loaded into registers two chunks ahead (its norm's pass over the rows has just
// read it). Measured on the H200, 8B batch 1, ms a decode step / a verification of 8: the
// registers-only form (each lane loading its own fragments, 2 chunks in flight) 4.82 / 5.43;
// a ring of each lane's own fragments (64 bytes of a row an instruction) 4.67 / 5.12; warps on
// contiguous runs 4.55 / 5.04; these copies 4.18 / 5.16 (gemv.cu: 4.19 / —); x through the
// ring, 4.05 / 4.91. 4 stages instead of 5: 4.70 / 5.37. Several tokens on tiles of 16 rows
// (R = 2 below, 4 stages: 96 KB, two blocks a multiprocessor), the one-token step unchanged:
// 4.03 / 4.43 (8 rows: 4.04 / 4.66; 16 rows and 3 stages: 4.03 / 4.49).

// The mma's reduction order inside a chunk is free as long as both operands follow it, so a
// lane's fragments are whole 16-byte pieces: lane (g, q) = (lane / 4, lane % 4) takes pieces
// 4j + q (j = 0, 1) of the chunk, of weight row g from the ring and of token g's x from global
// memory (in registers two chunks ahead); a piece's elements 0..3 are k = 2q, 2q+1, 2q+8, 2q+9
// of one mma and 4..7 of the next.
//
// Batch invariance: a token's outputs are summed in one order whatever the token count (the
// chunks, the mma's own order within its row, the warps in order), and the mma's row for one
// token does not depend on the other rows. So a token's product is the same bits alone or
// among 8: a verification's positions are computed exactly as one-token steps are.
// `in` must be a multiple of GEMV_TC_CHUNK; GEMV_NORM reads the rows whole, as gemv.cu does.

#define GEMV_TC_WARPS 8
#define GEMV_TC_CHUNK 64

#define GEMV_TC_TOKENS 8

// The RMSNorm scale of row `t` of the f32 stream `x` (`tokens` rows), in every thread: the
// block's threads sum fixed slices of each row, then the warps' sums are added in warp order.
__device__ __forceinline__ float gemv_tc_norm_scale(const float* __restrict__ x, u32 tokens, u32 in,
                                                 float eps, u32 t) {
    __shared__ float sums[GEMV_TC_WARPS][GEMV_TC_TOKENS];
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (u32 k = 0; k < tokens; ++k) {
        const float4* row = (const float4*)(x + (u64)k * in);
        float sum = 0.f;
        for (u32 c = threadIdx.x; c < in / 8; c += 32 * GEMV_TC_WARPS) {
            float4 a = row[2 * c], b = row[2 * c + 1];
            sum += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
            sum += b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
        }
        sum = warp_sum(sum);
        if (lane == 0) sums[warp][k] = sum;
    }
    __syncthreads();
    if (t >= tokens) return 0.f;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < GEMV_TC_WARPS; ++i) sum += sums[i][t];
    return rsqrtf(sum / (float)in + eps);
}

// grid: one block of GEMV_TC_WARPS warps per tile of 8·R weight rows (8·R outputs, 4·R with
// GLU); tokens ≤ 8; STAGES chunks in each warp's ring. R = 2 serves several tokens: each x
// fragment then feeds two mma, halving the x bytes read per weight byte (with 8 tokens and
// R = 1, x through the ring is as many bytes as the weights). A token's sums are the same bits
// whatever R and STAGES (the warps' chunks, the mma's order within a row and the warps' order
// do not depend on them), so one-token steps and verifications agree whichever tile each uses.
template <int MODE, int R, int STAGES>
__device__ void gemv_tc(const void* __restrict__ xp, const bf16* __restrict__ w, void* __restrict__ yp,
                     const bf16* __restrict__ norm_w, float eps, u32 tokens, u32 in, u32 out) {
    constexpr bool NORM = MODE & GEMV_NORM, GLU = MODE & GEMV_GLU, ACCUM = MODE & GEMV_ACCUM;
    constexpr u32 ROWS = 8 * R;
    // Outputs a block writes: with GLU, tile rows r and r + ROWS / 2 make output r.
    constexpr u32 OUTS = GLU ? ROWS / 2 : ROWS;
    __shared__ float partial[GEMV_TC_WARPS][GEMV_TC_TOKENS][ROWS];
    // Each warp's ring: [stage][warp][tile row, then token with XRING][16-byte piece ^ row].
    // Without a norm the tokens' x comes through it too (dynamic shared memory: STAGES KB a
    // tile row, as much a token for x).
    constexpr bool XRING = !NORM;
    u32 rrows = XRING ? ROWS + tokens : ROWS;
    extern __shared__ uint4 gemv_tc_ring[];
    auto ring = [&](u32 stage, u32 warp, u32 r, u32 piece) -> uint4& {
        return gemv_tc_ring[((stage * GEMV_TC_WARPS + warp) * rrows + r) * 8 + (piece ^ (r & 7))];
    };
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    u32 o0 = blockIdx.x * OUTS;
    // Tile row r's weight row, clamped into the matrix.
    auto tile_row = [&](u32 r) -> const uint4* {
        u64 row;
        if (GLU) {
            u32 o = min(o0 + r % OUTS, out - 1);
            row = r < OUTS ? o : (u64)out + o;
        } else {
            row = min(o0 + r, out - 1);
        }
        return (const uint4*)(w + row * in);
    };
    const uint4* copy_rows[2 * R];
#pragma unroll
    for (int j = 0; j < 2 * R; ++j) copy_rows[j] = tile_row(4 * j + lane / 8);
    u32 chunks = in / GEMV_TC_CHUNK;
    u32 first = warp * chunks / GEMV_TC_WARPS, mine = (warp + 1) * chunks / GEMV_TC_WARPS - first;
    bool has_token = g < tokens;
    // Starts copying this warp's i-th chunk into stage i % STAGES: its weights, and with XRING
    // the tokens' x. A chunk's copies make one commit group (empty past the end), so that
    // wait_group counts chunks; the prologue's weights join the first group.
    auto copy_chunk = [&](u32 i, bool weights, bool x) {
        if (i >= mine) return;
        u32 piece = lane % 8, s = i % STAGES;
#pragma unroll
        for (int j = 0; j < 2 * R; ++j) {
            u32 r = 4 * j + lane / 8;
            if (weights) cp_async16_weights(&ring(s, warp, r, piece), copy_rows[j] + (first + i) * 8 + piece);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            u32 t = 4 * j + lane / 8;
            if (XRING && x && t < tokens)
                cp_async16(&ring(s, warp, ROWS + t, piece),
                           (const uint4*)((const bf16*)xp + (u64)t * in) + (first + i) * 8 + piece);
        }
    };
    auto commit = [] { asm volatile("cp.async.commit_group;"); };
    // With NORM, token g's f32 x and the norm's weights for the warp's i-th chunk into
    // register slot u.
    uint4 gv[2][2];
    float4 xf[2][2][2];
    auto load_x = [&](int u, u32 i) {
        if constexpr (NORM) {
            if (!has_token || i >= mine) return;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                u32 at = (first + i) * 8 + 4 * j + q;
                const float4* xr = (const float4*)((const float*)xp + (u64)g * in) + 2 * at;
                xf[u][j][0] = xr[0];
                xf[u][j][1] = xr[1];
                gv[u][j] = ((const uint4*)norm_w)[at];
            }
        }
    };
    // Thread t·ROWS + r writes output r of token t (at the end); with ACCUM it reads y there
    // before the wait, as gemv.cu does (the kernel just before never writes y).
    u32 out_t = threadIdx.x / ROWS, out_r = threadIdx.x % ROWS;
    bool writes = out_t < tokens && out_r < OUTS && o0 + out_r < out;
    u64 out_at = (u64)out_t * out + o0 + out_r;
    float y_before = ACCUM && writes ? ((const float*)yp)[out_at] : 0.f;
    // The first weight copies go out before waiting for the kernel before (a programmatic
    // dependent launch): no kernel of a step writes the weights, so they stream during that
    // kernel's last blocks instead of after them. x only after the wait.
#pragma unroll
    for (u32 i = 0; i + 1 < STAGES; ++i) copy_chunk(i, true, false);
    pdl_begin();
#pragma unroll
    for (u32 i = 0; i + 1 < STAGES; ++i) {
        copy_chunk(i, false, true);
        commit();
    }
    load_x(0, 0);
    load_x(1, 1);
    float s = NORM ? gemv_tc_norm_scale((const float*)xp, tokens, in, eps, g) : 0.f;
    float c[R][4] = {};
    for (u32 i0 = 0; i0 < mine; i0 += 2) {
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            u32 i = i0 + u;
            if (i >= mine) break;
            // Chunk i is the oldest of the STAGES - 1 copied groups still counted.
            asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2));
            __syncwarp();
            uint4 wc[R][2], xc[2];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
#pragma unroll
                for (int m = 0; m < R; ++m) wc[m][j] = ring(i % STAGES, warp, 8 * m + g, 4 * j + q);
                xc[j] = make_uint4(0, 0, 0, 0);
                if (has_token) {
                    if (NORM) {
                        float4 a = xf[u][j][0], b = xf[u][j][1];
                        float gw[8];
                        unpack8(gv[u][j], gw);
                        xc[j].x = pack_bf16x2((a.x * s) * gw[0], (a.y * s) * gw[1]);
                        xc[j].y = pack_bf16x2((a.z * s) * gw[2], (a.w * s) * gw[3]);
                        xc[j].z = pack_bf16x2((b.x * s) * gw[4], (b.y * s) * gw[5]);
                        xc[j].w = pack_bf16x2((b.z * s) * gw[6], (b.w * s) * gw[7]);
                    } else {
                        xc[j] = ring(i % STAGES, warp, ROWS + g, 4 * j + q);
                    }
                }
            }
            load_x(u, i + 2);
            // Into the stage chunk i - 1 used: every lane read it before this iteration's
            // __syncwarp.
            copy_chunk(i + STAGES - 1, true, true);
            commit();
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                u32 a0[4] = {xc[j].x, 0u, xc[j].y, 0u};
                u32 a1[4] = {xc[j].z, 0u, xc[j].w, 0u};
#pragma unroll
                for (int m = 0; m < R; ++m) {
                    mma_bf16(c[m], a0, wc[m][j].x, wc[m][j].y);
                    mma_bf16(c[m], a1, wc[m][j].z, wc[m][j].w);
                }
            }
        }
    }
    asm volatile("cp.async.wait_group 0;");
    // c[m][0], c[m][1]: token g by tile rows 8m + 2q and 8m + 2q + 1 (c[m][2], c[m][3] are
    // tokens 8.., none).
#pragma unroll
    for (int m = 0; m < R; ++m) {
        partial[warp][g][8 * m + 2 * q] = c[m][0];
        partial[warp][g][8 * m + 2 * q + 1] = c[m][1];
    }
    __syncthreads();
    // Summing over the warps in order.
    if (!writes) return;
    float v[2];
#pragma unroll
    for (int k = 0; k < (GLU ? 2 : 1); ++k) {
        v[k] = 0.f;
#pragma unroll
        for (int i = 0; i < GEMV_TC_WARPS; ++i) v[k] += partial[i][out_t][out_r + OUTS * k];
    }
    if (GLU) {
        float gate = bf16_to_f32(f32_to_bf16(v[0])), up = bf16_to_f32(f32_to_bf16(v[1]));
        ((bf16*)yp)[out_at] = f32_to_bf16(gate / (1.f + expf(-gate)) * up);
    } else if (ACCUM) {
        ((float*)yp)[out_at] = y_before + bf16_to_f32(f32_to_bf16(v[0]));
    } else {
        ((bf16*)yp)[out_at] = f32_to_bf16(v[0]);
    }
}

#define GEMV_TC_ENTRY(NAME, MODE, R, STAGES)                                                      \
    extern "C" __global__ void __launch_bounds__(GEMV_TC_WARPS * 32)                                 \
        NAME(const void* x, const bf16* w, void* y, const bf16* norm_w, float eps, u32 tokens,     \
             u32 in, u32 out) {                                                                   \
        gemv_tc<MODE, R, STAGES>(x, w, y, norm_w, eps, tokens, in, out);                          \
    }
// One token: tiles of 8 rows. Several: tiles of 16. GEMV_TC_STAGES and GEMV_TC_WIDE_STAGES
// come from the host (kernels.rs), which sizes the rings.
GEMV_TC_ENTRY(gemv_tc, 0, 1, GEMV_TC_STAGES)
GEMV_TC_ENTRY(gemv_tc_norm, GEMV_NORM, 1, GEMV_TC_STAGES)
GEMV_TC_ENTRY(gemv_tc_glu, GEMV_GLU, 1, GEMV_TC_STAGES)
GEMV_TC_ENTRY(gemv_tc_norm_glu, GEMV_NORM | GEMV_GLU, 1, GEMV_TC_STAGES)
GEMV_TC_ENTRY(gemv_tc_accum, GEMV_ACCUM, 1, GEMV_TC_STAGES)
GEMV_TC_ENTRY(gemv_tc_wide, 0, 2, GEMV_TC_WIDE_STAGES)
GEMV_TC_ENTRY(gemv_tc_wide_norm, GEMV_NORM, 2, GEMV_TC_WIDE_STAGES)
GEMV_TC_ENTRY(gemv_tc_wide_glu, GEMV_GLU, 2, GEMV_TC_WIDE_STAGES)
GEMV_TC_ENTRY(gemv_tc_wide_norm_glu, GEMV_NORM | GEMV_GLU, 2, GEMV_TC_WIDE_STAGES)
GEMV_TC_ENTRY(gemv_tc_wide_accum, GEMV_ACCUM, 2, GEMV_TC_WIDE_STAGES)
