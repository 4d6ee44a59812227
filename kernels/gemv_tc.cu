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
// must give the text of one token a step (`CudaOptions::exact_verify`); gemv.cu stays faster
// for one token alone (H200, batch 1: SmolLM2 0.578 against 0.663 ms a step, 8B 4.20 against
// 4.80).
//
// A block owns one tile; its GEMV_TC_WARPS warps split the reduction in chunks of
// GEMV_TC_CHUNK elements (warp w takes chunks w, w + GEMV_TC_WARPS, ...), GEMV_TC_UNROLL chunks
// in flight, each slot refilled as soon as it is used (its weights and the lane's token's x
// alike); the warps' partial tiles are summed through shared memory in warp order.
//
// The mma's reduction order inside a chunk is free as long as both operands follow it, so a
// lane's loads go straight into fragments: lane (g, q) = (lane / 4, lane % 4) holds
// 8·GEMV_TC_LOADS contiguous elements of the chunk, from 8·GEMV_TC_LOADS·q on, for weight row g
// and token g; each 16-byte piece feeds two mma, its elements 0..3 as k = 2q, 2q+1, 2q+8, 2q+9
// of the first and 4..7 of the second.
//
// Batch invariance: a token's outputs are summed in one order whatever the token count (the
// chunks, the mma's own order within its row, the warps in order), and the mma's row for one
// token does not depend on the other rows. So a token's product is the same bits alone or
// among 8: a verification's positions are computed exactly as one-token steps are.
// `in` must be a multiple of GEMV_TC_CHUNK; GEMV_NORM reads the rows whole, as gemv.cu does.

#define GEMV_TC_WARPS 8
// 16-byte loads a lane makes of its row each chunk, and chunks in flight. Measured on the H200,
// 8B batch 1: a warp reading 64 bytes of each row at a time 6.41 ms a step, 128 bytes 4.80, 256
// bytes 4.43 (but then rows of SmolLM2's 576 do not divide); more chunks in flight was slower.
#define GEMV_TC_LOADS 2
#define GEMV_TC_UNROLL 2
#define GEMV_TC_CHUNK (32 * GEMV_TC_LOADS)
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

// grid: one block of GEMV_TC_WARPS warps per tile (8 outputs, 4 with GLU); tokens ≤ 8.
template <int MODE>
__device__ void gemv_tc(const void* __restrict__ xp, const bf16* __restrict__ w, void* __restrict__ yp,
                     const bf16* __restrict__ norm_w, float eps, u32 tokens, u32 in, u32 out) {
    constexpr bool NORM = MODE & GEMV_NORM, GLU = MODE & GEMV_GLU, ACCUM = MODE & GEMV_ACCUM;
    // Outputs a block writes: with GLU, tile rows r and r + 4 make output r.
    constexpr u32 OUTS = GLU ? 4 : 8;
    __shared__ float partial[GEMV_TC_WARPS][GEMV_TC_TOKENS][8];
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    u32 o0 = blockIdx.x * OUTS;
    // This lane's weight row (tile row g), clamped into the matrix.
    u64 wrow;
    if (GLU) {
        u32 o = min(o0 + (g & 3), out - 1);
        wrow = g < 4 ? o : (u64)out + o;
    } else {
        wrow = min(o0 + g, out - 1);
    }
    const uint4* row = (const uint4*)(w + wrow * in);
    u32 chunks = in / GEMV_TC_CHUNK;
    u32 mine = chunks > warp ? (chunks - warp + GEMV_TC_WARPS - 1) / GEMV_TC_WARPS : 0;
    bool has_token = g < tokens;
    // GEMV_TC_UNROLL slots, each a chunk's weights and this lane's token's x (f32 and the norm's
    // weights with NORM), refilled as soon as used: the x loads are in flight with the
    // weights', not waited on chunk by chunk. Lane q of a row holds 16·GEMV_TC_LOADS contiguous
    // bytes of the chunk, so a warp reads each of its rows 64·GEMV_TC_LOADS bytes at a time.
    uint4 wv[GEMV_TC_UNROLL][GEMV_TC_LOADS], xv[GEMV_TC_UNROLL][GEMV_TC_LOADS], gv[GEMV_TC_UNROLL][GEMV_TC_LOADS];
    float4 xf[GEMV_TC_UNROLL][GEMV_TC_LOADS][2];
    // uint4 index of this lane's j-th load of chunk `ch` in a row.
    auto idx = [&](u32 ch, int j) { return ch * (GEMV_TC_CHUNK / 8) + q * GEMV_TC_LOADS + j; };
    auto load_w = [&](int u, u32 ch) {
#pragma unroll
        for (int j = 0; j < GEMV_TC_LOADS; ++j) wv[u][j] = __ldg(row + idx(ch, j));
    };
    auto load_x = [&](int u, u32 ch) {
        if (!has_token) return;
#pragma unroll
        for (int j = 0; j < GEMV_TC_LOADS; ++j) {
            if (NORM) {
                const float4* xr = (const float4*)((const float*)xp + (u64)g * in) + 2 * idx(ch, j);
                xf[u][j][0] = xr[0];
                xf[u][j][1] = xr[1];
                gv[u][j] = ((const uint4*)norm_w)[idx(ch, j)];
            } else {
                xv[u][j] = ((const uint4*)((const bf16*)xp + (u64)g * in))[idx(ch, j)];
            }
        }
    };
    // The first weight loads go out before waiting for the kernel before (a programmatic
    // dependent launch): no kernel of a step writes the weights, so they stream during that
    // kernel's last blocks instead of after them. x, and y for ACCUM, only after the wait.
#pragma unroll
    for (int u = 0; u < GEMV_TC_UNROLL; ++u)
        if (u < mine) load_w(u, warp + GEMV_TC_WARPS * u);
    pdl_begin();
#pragma unroll
    for (int u = 0; u < GEMV_TC_UNROLL; ++u)
        if (u < mine) load_x(u, warp + GEMV_TC_WARPS * u);
    float s = NORM ? gemv_tc_norm_scale((const float*)xp, tokens, in, eps, g) : 0.f;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    for (u32 i0 = 0; i0 < mine; i0 += GEMV_TC_UNROLL) {
#pragma unroll
        for (int u = 0; u < GEMV_TC_UNROLL; ++u) {
            u32 i = i0 + u;
            if (i >= mine) break;
            uint4 wc[GEMV_TC_LOADS], xc[GEMV_TC_LOADS];
#pragma unroll
            for (int j = 0; j < GEMV_TC_LOADS; ++j) {
                wc[j] = wv[u][j];
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
                        xc[j] = xv[u][j];
                    }
                }
            }
            if (i + GEMV_TC_UNROLL < mine) {
                u32 next = warp + GEMV_TC_WARPS * (i + GEMV_TC_UNROLL);
                load_w(u, next);
                load_x(u, next);
            }
#pragma unroll
            for (int j = 0; j < GEMV_TC_LOADS; ++j) {
                u32 a0[4] = {xc[j].x, 0u, xc[j].y, 0u};
                mma_bf16(c, a0, wc[j].x, wc[j].y);
                u32 a1[4] = {xc[j].z, 0u, xc[j].w, 0u};
                mma_bf16(c, a1, wc[j].z, wc[j].w);
            }
        }
    }
    // c[0], c[1]: token g by tile rows 2q and 2q + 1 (c[2], c[3] are tokens 8.., none).
    partial[warp][g][2 * q] = c[0];
    partial[warp][g][2 * q + 1] = c[1];
    __syncthreads();
    // Thread t·8 + r writes output r of token t, summing over the warps in order.
    u32 t = threadIdx.x / 8, r = threadIdx.x % 8;
    if (t >= tokens || r >= OUTS || o0 + r >= out) return;
    float v[2];
#pragma unroll
    for (int k = 0; k < (GLU ? 2 : 1); ++k) {
        v[k] = 0.f;
#pragma unroll
        for (int i = 0; i < GEMV_TC_WARPS; ++i) v[k] += partial[i][t][r + 4 * k];
    }
    u64 at = (u64)t * out + o0 + r;
    if (GLU) {
        float gate = bf16_to_f32(f32_to_bf16(v[0])), up = bf16_to_f32(f32_to_bf16(v[1]));
        ((bf16*)yp)[at] = f32_to_bf16(gate / (1.f + expf(-gate)) * up);
    } else if (ACCUM) {
        ((float*)yp)[at] += bf16_to_f32(f32_to_bf16(v[0]));
    } else {
        ((bf16*)yp)[at] = f32_to_bf16(v[0]);
    }
}

#define GEMV_TC_ENTRY(NAME, MODE)                                                                 \
    extern "C" __global__ void __launch_bounds__(GEMV_TC_WARPS * 32)                                 \
        NAME(const void* x, const bf16* w, void* y, const bf16* norm_w, float eps, u32 tokens,     \
             u32 in, u32 out) {                                                                   \
        gemv_tc<MODE>(x, w, y, norm_w, eps, tokens, in, out);                                     \
    }
GEMV_TC_ENTRY(gemv_tc, 0)
GEMV_TC_ENTRY(gemv_tc_norm, GEMV_NORM)
GEMV_TC_ENTRY(gemv_tc_glu, GEMV_GLU)
GEMV_TC_ENTRY(gemv_tc_norm_glu, GEMV_NORM | GEMV_GLU)
GEMV_TC_ENTRY(gemv_tc_accum, GEMV_ACCUM)
