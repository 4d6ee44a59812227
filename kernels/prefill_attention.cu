// Causal attention over paged KV for rows of several tokens (prefill, chunked prefill, a prompt
// continuing a restored prefix), flash-attention style on the tensor cores.
//
// A block takes one work item (a row and up to PREFILL_ROWS / group of its consecutive query
// tokens), one KV head and up to MAX_GROUP query heads sharing it: its PREFILL_ROWS query rows are
// (token, head) pairs, so grouped heads share every K and V tile. The query rows are copied into
// shared memory once; tiles of 64 key positions are gathered from the row's pages into shared
// memory (cp.async, zero-filled past the end), the next tile's copy in flight while the current
// one is used; each warp runs S = Q·Kᵀ and O += P·V for its m-tiles of 16 query rows with
// bf16 mma.sync (fp32 accumulate, operands read from shared memory by ldmatrix, V transposed on
// the way) and an online softmax in registers. The keys are every position the row's pages hold
// up to the query: a restored prefix and this step's tokens alike (their K and V are appended
// before attention runs).
//
// Few query tokens over a long context (a conversation continued after a restored prefix) make
// too few blocks to fill the device, so the launch may also split each item's key tiles over
// `splits` blocks (grid z). Then each block writes its normalized partial output and its
// log2-sum-exp, and merge_attention_splits combines them into the bf16 output.

// Query rows of a block, and its warps for heads of up to 64 and of 128, each warp taking
// PREFILL_ROWS / 16 / warps m-tiles of 16 rows: the engine defines all three before this file
// (see there what was measured). More rows a block read each K and V tile for more queries;
// more m-tiles a warp feed each K or V fragment it reads from shared memory to more products.
#ifndef PREFILL_ROWS
#define PREFILL_ROWS 128
#endif
#ifndef PREFILL_WARPS
#define PREFILL_WARPS 8
#endif
#ifndef PREFILL_WIDE_WARPS
#define PREFILL_WIDE_WARPS 4
#endif
#define PREFILL_WARPS_FOR(D) ((D) >= 128 ? PREFILL_WIDE_WARPS : PREFILL_WARPS)
#define KEY_TILE 64
// K and V tiles in flight: the kernel's dynamic shared memory is the query rows and
// PREFILL_STAGES · 2 tiles of KEY_TILE × (D + 8) bf16 (the engine's prefill_shared_bytes; decode
// attention uses the tiles alone).
#define PREFILL_STAGES 2
// Blocks a multiprocessor must be able to hold: two of 8 warps cap a thread at 128 registers
// (the kernel wants ~140 unbounded, which would hold one, 8 warps a multiprocessor: the warps
// then wait on their own mma and exp2 latencies); two of 4 warps with two m-tiles each (heads
// of 128), at 255.
#ifndef PREFILL_MIN_BLOCKS
#define PREFILL_MIN_BLOCKS 2
#endif

// Four 8×8 bf16 matrices from shared memory, rows addressed by lanes 0-7, 8-15, 16-23, 24-31.
__device__ __forceinline__ void ldmatrix_x4(u32* r, const bf16* smem) {
    u32 at = (u32)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}

__device__ __forceinline__ void ldmatrix_x2(u32* r, const bf16* smem) {
    u32 at = (u32)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(at));
}

// The same, each matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const bf16* smem) {
    u32 at = (u32)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}

__device__ __forceinline__ u32 window_start(u32 pos, u32 window) {
    return (window != 0 && pos + 1 > window) ? pos + 1 - window : 0;
}

// One query row of the block: where its q lives and which position it sits at.
struct QueryRow {
    bool valid;
    u32 token;  // index in the step
    u32 head;
    u32 pos;
};

__device__ __forceinline__ QueryRow query_row(u32 m, u32 g, u32 n_tok, u32 first_token, u32 first_pos,
                                              u32 head0) {
    QueryRow q;
    u32 t = m / g;
    q.valid = t < n_tok;
    q.token = first_token + t;
    q.head = head0 + m % g;
    q.pos = first_pos + t;
    return q;
}

// Starts gathering positions k0..k0+KEY_TILE of one KV head into shared memory (one cp.async
// group); rows past `last` are 0. THREADS is the block's size: each thread copies the same 16
// bytes of every row it takes, the loop unrolled. The page ids come from two page-table reads a
// lane, issued together up front (lane L: the tile's pages L and 32 + L) and handed to the rows
// by shuffles: one read a row, each waited for before its copy, made the tile's copies wait on
// a chain of dependent loads.
template <int D, int THREADS>
__device__ __forceinline__ void issue_kv_tile(bf16* ks, bf16* vs, const bf16* k_cache,
                                             const bf16* v_cache, const u32* table, u32 page_tokens,
                                             u32 kv_heads, u32 kvh, u32 k0, u32 last) {
    constexpr int STRIDE = D + 8, CHUNKS = D / 8;
    static_assert(THREADS % CHUNKS == 0, "a thread copies the same part of each row");
    constexpr int ROWS_A_PASS = THREADS / CHUNKS;
    constexpr int PASSES = (KEY_TILE + ROWS_A_PASS - 1) / ROWS_A_PASS;
    // page_tokens is a power of two (the configuration checks it): shifts, not divisions. A
    // tile's KEY_TILE keys span at most 64 pages (one position a page).
    u32 page_shift = __ffs(page_tokens) - 1;
    u32 lane = threadIdx.x & 31, first_page = k0 >> page_shift, last_page = last >> page_shift;
    u32 near = first_page + lane <= last_page ? table[first_page + lane] : 0;
    u32 far = first_page + 32 + lane <= last_page ? table[first_page + 32 + lane] : 0;
    u32 part = threadIdx.x % CHUNKS, key0 = threadIdx.x / CHUNKS;
    const bf16* k_head = k_cache + (u64)kvh * D + part * 8;
    const bf16* v_head = v_cache + (u64)kvh * D + part * 8;
#pragma unroll
    for (int i = 0; i < PASSES; ++i) {
        u32 key = key0 + i * ROWS_A_PASS, k = k0 + key;
        u32 at_page = (k >> page_shift) - first_page;
        u32 from_near = __shfl_sync(0xffffffffu, near, at_page & 31);
        u32 from_far = __shfl_sync(0xffffffffu, far, at_page & 31);
        if constexpr (PASSES * ROWS_A_PASS > KEY_TILE)
            if (key >= KEY_TILE) break;  // small heads: more threads than the tile has chunks
        bf16* kd = ks + key * STRIDE + part * 8;
        bf16* vd = vs + key * STRIDE + part * 8;
        // A row past `last` is zero-filled, its source the head's first row (not read).
        bool copy = k <= last;
        u32 page = copy ? (at_page < 32 ? from_near : from_far) : 0;
        u64 slot = ((u64)page << page_shift) | (copy ? k & (page_tokens - 1) : 0);
        u64 at = slot * kv_heads * D;
        cp_async16_or_zero(kd, k_head + at, copy);
        cp_async16_or_zero(vd, v_head + at, copy);
    }
    asm volatile("cp.async.commit_group;");
}

// S[16 × 8] += Q·Kᵀ for the 8 keys in rows key0..key0 + 7 of a K tile (row stride D + 8), Q
// given as the A fragments of every k-step. Lanes 8i..8i+7 address ldmatrix's matrix i: those
// keys, dimensions (kk + i/2)·16 + (i%2)·8.
template <int D>
__device__ __forceinline__ void score_keys8(float* s, const u32 (*qa)[4], const bf16* ks, u32 key0,
                                            u32 lane) {
    constexpr int STRIDE = D + 8, KS = D / 16;
    s[0] = s[1] = s[2] = s[3] = 0.f;
    const bf16* krow = ks + (key0 + (lane & 7)) * STRIDE + ((lane >> 3) & 1) * 8;
    if constexpr (KS % 2 == 0) {
#pragma unroll
        for (int kk = 0; kk < KS; kk += 2) {
            u32 b[4];
            ldmatrix_x4(b, krow + (kk + (lane >> 4)) * 16);
            mma_bf16(s, qa[kk], b[0], b[1]);
            mma_bf16(s, qa[kk + 1], b[2], b[3]);
        }
    } else {
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            u32 b[2];
            ldmatrix_x2(b, krow + kk * 16);
            mma_bf16(s, qa[kk], b[0], b[1]);
        }
    }
}

// O[16 × D] += P·V for the 16 keys in rows key0..key0 + 15 of a V tile, P given as the A
// fragment. V is read transposed: matrix i holds keys key0 + (i%2)·8.., dimensions (n + i/2)·8..
template <int D>
__device__ __forceinline__ void add_values16(float (*o)[4], const u32* pa, const bf16* vs, u32 key0,
                                             u32 lane) {
    constexpr int STRIDE = D + 8, NT = D / 8;
    const bf16* vrow = vs + (key0 + (lane & 7) + ((lane >> 3) & 1) * 8) * STRIDE + (lane >> 4) * 8;
#pragma unroll
    for (int n = 0; n < NT; n += 2) {
        u32 b[4];
        ldmatrix_x4_trans(b, vrow + n * 8);
        mma_bf16(o[n], pa, b[0], b[1]);
        mma_bf16(o[n + 1], pa, b[2], b[3]);
    }
}

// S[mt][8 keys n][4] = Q·Kᵀ over one K tile for this warp's MT m-tiles of 16 query rows. The
// k-steps run outermost so a K fragment (ldmatrix: 16 keys × 16 dimensions, two n-tiles) feeds
// every m-tile; Q fragments come from shared memory, one per m-tile and k-step.
template <int D, int MT>
__device__ __forceinline__ void score_tile(float (*s)[KEY_TILE / 8][4], const bf16* qs,
                                           const bf16* ks, u32 lane) {
    constexpr int STRIDE = D + 8, KS = D / 16;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < KEY_TILE / 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
    const bf16* qrow = qs + ((lane & 7) + ((lane >> 3) & 1) * 8) * STRIDE + (lane >> 4) * 8;
    const bf16* krow = ks + ((lane & 7) + (lane >> 4) * 8) * STRIDE + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        u32 qa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            ldmatrix_x4(qa[mt], qrow + mt * 16 * STRIDE + kk * 16);
#pragma unroll
        for (int n = 0; n < KEY_TILE / 8; n += 2) {
            u32 b[4];
            ldmatrix_x4(b, krow + n * 8 * STRIDE + kk * 16);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_bf16(s[mt][n], qa[mt], b[0], b[1]);
                mma_bf16(s[mt][n + 1], qa[mt], b[2], b[3]);
            }
        }
    }
}

// O[mt] += P[mt]·V over one V tile, P re-packed from the S accumulators (16 keys a k-step); a V
// fragment (transposed ldmatrix) feeds every m-tile.
template <int D, int MT>
__device__ __forceinline__ void add_values_tile(float (*o)[D / 8][4], float (*s)[KEY_TILE / 8][4],
                                                const bf16* vs, u32 lane) {
    constexpr int STRIDE = D + 8, NT = D / 8;
    const bf16* vrow = vs + ((lane & 7) + ((lane >> 3) & 1) * 8) * STRIDE + (lane >> 4) * 8;
#pragma unroll
    for (int j = 0; j < KEY_TILE / 16; ++j) {
        u32 pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            pa[mt][0] = pack_bf16x2(s[mt][2 * j][0], s[mt][2 * j][1]);
            pa[mt][1] = pack_bf16x2(s[mt][2 * j][2], s[mt][2 * j][3]);
            pa[mt][2] = pack_bf16x2(s[mt][2 * j + 1][0], s[mt][2 * j + 1][1]);
            pa[mt][3] = pack_bf16x2(s[mt][2 * j + 1][2], s[mt][2 * j + 1][3]);
        }
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            u32 b[4];
            ldmatrix_x4_trans(b, vrow + j * 16 * STRIDE + n * 8);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_bf16(o[mt][n], pa[mt], b[0], b[1]);
                mma_bf16(o[mt][n + 1], pa[mt], b[2], b[3]);
            }
        }
    }
}

// Mask, scale and the online softmax of one m-tile's two rows of this thread (shared by a
// quad) over a tile of scores; rescales that m-tile's output. `whole`: every query row of the
// block sees every key of the tile, so no mask. The running maximum `m` is kept in scaled
// (log2) units and found over the raw scores (the scale is positive), so a weight is one FMA
// and one ex2; the output is rescaled only where some row of the warp has a new maximum (a
// factor of exactly 1 elsewhere, which changes no bit), most tiles after the first few.
template <int D>
__device__ __forceinline__ void softmax_tile(float (*s)[4], float (*o)[4], float* m, float* l,
                                             const QueryRow* rows, u32 k0, bool whole, u32 window,
                                             float scale_log2, u32 tig) {
    constexpr int NT = D / 8;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const QueryRow& q = rows[half];
        u32 lo = window_start(q.pos, window);
        float mx = NEG_INF;
#pragma unroll
        for (int n = 0; n < KEY_TILE / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                u32 key = k0 + n * 8 + tig * 2 + e;
                bool visible = whole || (q.valid && key <= q.pos && key >= lo);
                float v = visible ? s[n][half * 2 + e] : NEG_INF;
                s[n][half * 2 + e] = v;
                mx = fmaxf(mx, v);
            }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float m_new = fmaxf(m[half], mx * scale_log2);
        float base = m_new == NEG_INF ? 0.f : m_new;
        float alpha = fast_exp2(m[half] - base), sum = 0.f;
#pragma unroll
        for (int n = 0; n < KEY_TILE / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float p = fast_exp2(fmaf(s[n][half * 2 + e], scale_log2, -base));
                s[n][half * 2 + e] = p;
                sum += p;
            }
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        l[half] = l[half] * alpha + sum;
        m[half] = m_new;
        if (__any_sync(0xffffffffu, alpha != 1.f)) {
#pragma unroll
            for (int n = 0; n < NT; ++n) o[n][half * 2] *= alpha, o[n][half * 2 + 1] *= alpha;
        }
    }
}

// Starts copying the block's PREFILL_ROWS query rows into shared memory (rows past the item
// are 0); committed with the first K/V tile's group.
template <int D>
__device__ __forceinline__ void issue_q_tile(bf16* qs, const bf16* qkv, u32 qkv_stride, u32 g,
                                             u32 n_tok, u32 first_token, u32 head0) {
    constexpr int STRIDE = D + 8, CHUNKS = D / 8;
    for (u32 c = threadIdx.x; c < PREFILL_ROWS * CHUNKS; c += blockDim.x) {
        u32 m = c / CHUNKS, part = c % CHUNKS, t = m / g;
        bf16* dst = qs + m * STRIDE + part * 8;
        if (t < n_tok)
            cp_async16(dst, qkv + (u64)(first_token + t) * qkv_stride + (u64)(head0 + m % g) * D + part * 8);
        else
            *(uint4*)dst = make_uint4(0, 0, 0, 0);
    }
}

template <int D>
__device__ void prefill_attention(const bf16* __restrict__ qkv, u32 qkv_stride,
                                  const bf16* __restrict__ k_cache,
                                  const bf16* __restrict__ v_cache,
                                  const u32* __restrict__ page_table, u32 table_stride,
                                  const u32* __restrict__ row_start_token,
                                  const u32* __restrict__ row_start_pos,
                                  const u32* __restrict__ row_len, const u32* __restrict__ items,
                                  u32 heads, u32 kv_heads, u32 page_tokens, u32 window,
                                  float scale_log2, bf16* __restrict__ out, u32 splits,
                                  float* __restrict__ o_part, float* __restrict__ lse_part) {
    constexpr int WARPS = PREFILL_WARPS_FOR(D), MT = PREFILL_ROWS / (16 * WARPS);
    static_assert(MT * 16 * WARPS == PREFILL_ROWS, "the warps' m-tiles cover the block's rows");
    constexpr int STRIDE = D + 8, NT = D / 8, TILE = KEY_TILE * STRIDE;
    // [Q: PREFILL_ROWS rows][stage][K, V][TILE]
    extern __shared__ __align__(16) bf16 prefill_tiles[];
    bf16* q_tile = prefill_tiles;
    bf16* kv_tiles = prefill_tiles + PREFILL_ROWS * STRIDE;

    u32 group = heads / kv_heads, chunks = (group + MAX_GROUP - 1) / MAX_GROUP;
    u32 kvh = blockIdx.y / chunks, chunk = blockIdx.y % chunks;
    u32 head0 = kvh * group + chunk * MAX_GROUP;
    u32 g = min((u32)MAX_GROUP, group - chunk * MAX_GROUP);
    u32 tile_tokens = PREFILL_ROWS / min(group, (u32)MAX_GROUP);
    u32 r = items[2 * blockIdx.x], q0 = items[2 * blockIdx.x + 1];
    u32 n_tok = min(tile_tokens, row_len[r] - q0);
    u32 first_token = row_start_token[r] + q0, first_pos = row_start_pos[r] + q0;
    u32 last_pos = first_pos + n_tok - 1;
    const u32* table = page_table + (u64)r * table_stride;

    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gid = lane >> 2, tig = lane & 3;
    // This warp's m-tiles: query rows warp·16·MT + mt·16 + (gid, gid + 8). An m-tile without a
    // valid row (a short item's) computes like the others and writes nothing: a branch around
    // its products, uniform as it is, made the compiler fence every ldmatrix and mma with a
    // warp sync (a quarter of the loop's instructions).
    QueryRow rows[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        u32 m0 = (warp * MT + mt) * 16;
        rows[mt][0] = query_row(m0 + gid, g, n_tok, first_token, first_pos, head0);
        rows[mt][1] = query_row(m0 + gid + 8, g, n_tok, first_token, first_pos, head0);
    }
    float o[MT][NT][4], m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m[mt][0] = m[mt][1] = NEG_INF;
        l[mt][0] = l[mt][1] = 0.f;
#pragma unroll
        for (int n = 0; n < NT; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
    }

    // This block's whole tiles of the item's keys.
    u32 keys_lo = window_start(first_pos, window);
    u32 tiles = (last_pos - keys_lo) / KEY_TILE + 1, per = (tiles + splits - 1) / splits;
    u32 keys_begin = keys_lo + blockIdx.z * per * KEY_TILE;
    u32 keys_end = min(keys_begin + per * KEY_TILE, last_pos + 1);
    u32 n_tiles = keys_end > keys_begin ? (keys_end - keys_begin + KEY_TILE - 1) / KEY_TILE : 0;
    if (n_tiles > 0) {
        issue_q_tile<D>(q_tile, qkv, qkv_stride, g, n_tok, first_token, head0);
        issue_kv_tile<D, WARPS * 32>(kv_tiles, kv_tiles + TILE, k_cache, v_cache, table,
                                             page_tokens, kv_heads, kvh, keys_begin, last_pos);
    }
    const bf16* qs = q_tile + warp * MT * 16 * STRIDE;
    for (u32 t = 0; t < n_tiles; ++t) {
        u32 k0 = keys_begin + t * KEY_TILE;
        const bf16* ks = kv_tiles + (t % PREFILL_STAGES) * 2 * TILE;
        const bf16* vs = ks + TILE;
        // The stage the next tile goes to was last read in the iteration before this one,
        // which every warp has left (the barrier at its end).
        if (t + 1 < n_tiles) {
            bf16* next = kv_tiles + ((t + 1) % PREFILL_STAGES) * 2 * TILE;
            issue_kv_tile<D, WARPS * 32>(next, next + TILE, k_cache, v_cache, table,
                                                 page_tokens, kv_heads, kvh, k0 + KEY_TILE, last_pos);
            asm volatile("cp.async.wait_group 1;");
        } else {
            asm volatile("cp.async.wait_group 0;");
        }
        __syncthreads();
        float s[MT][KEY_TILE / 8][4];
        score_tile<D, MT>(s, qs, ks, lane);
        bool whole = k0 + KEY_TILE <= first_pos + 1 && k0 >= window_start(last_pos, window);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            softmax_tile<D>(s[mt], o[mt], m[mt], l[mt], rows[mt], k0, whole, window, scale_log2,
                            tig);
        add_values_tile<D, MT>(o, s, vs, lane);
        __syncthreads();
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const QueryRow& q = rows[mt][half];
            if (!q.valid) continue;
            float inv = l[mt][half] > 0.f ? 1.f / l[mt][half] : 0.f;
            if (splits == 1) {
                bf16* dst = out + (u64)q.token * heads * D + (u64)q.head * D + tig * 2;
#pragma unroll
                for (int n = 0; n < NT; ++n)
                    *(u32*)(dst + n * 8) =
                        pack_bf16x2(o[mt][n][half * 2] * inv, o[mt][n][half * 2 + 1] * inv);
            } else {
                u64 slot = ((u64)q.token * heads + q.head) * splits + blockIdx.z;
                float* dst = o_part + slot * D + tig * 2;
#pragma unroll
                for (int n = 0; n < NT; ++n)
                    *(float2*)(dst + n * 8) =
                        make_float2(o[mt][n][half * 2] * inv, o[mt][n][half * 2 + 1] * inv);
                if (tig == 0)
                    lse_part[slot] = l[mt][half] > 0.f ? m[mt][half] + log2f(l[mt][half]) : NEG_INF;
            }
        }
}

// Combines the key splits of prefill attention: block (token, head), a thread per dimension.
extern "C" __global__ void merge_attention_splits(const float* __restrict__ o_part,
                                                  const float* __restrict__ lse_part,
                                                  bf16* __restrict__ out, u32 heads, u32 head_dim,
                                                  u32 splits) {
    pdl_begin();
    u64 slot = (u64)blockIdx.x * heads + blockIdx.y;
    const float* lse = lse_part + slot * splits;
    float mx = NEG_INF;
    for (u32 s = 0; s < splits; ++s) mx = fmaxf(mx, lse[s]);
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float sum = 0.f, acc = 0.f;
        for (u32 s = 0; s < splits; ++s) {
            float w = lse[s] == NEG_INF ? 0.f : exp2f(lse[s] - mx);
            sum += w;
            acc += w * o_part[(slot * splits + s) * head_dim + d];
        }
        out[slot * head_dim + d] = f32_to_bf16(sum > 0.f ? acc / sum : 0.f);
    }
}

#define PREFILL_ENTRY(D)                                                                          \
    extern "C" __global__ void __launch_bounds__(PREFILL_WARPS_FOR(D) * 32, PREFILL_MIN_BLOCKS)   \
        prefill_attention_d##D(const bf16* qkv, u32 qkv_stride, const bf16* k_cache,              \
                               const bf16* v_cache, const u32* page_table, u32 table_stride,      \
                               const u32* row_start_token, const u32* row_start_pos,              \
                               const u32* row_len, const u32* items, u32 heads, u32 kv_heads,     \
                               u32 page_tokens, u32 window, float scale_log2, bf16* out,          \
                               u32 splits, float* o_part, float* lse_part) {                      \
        pdl_begin();                                                                               \
        prefill_attention<D>(qkv, qkv_stride, k_cache, v_cache, page_table, table_stride,         \
                             row_start_token, row_start_pos, row_len, items, heads, kv_heads,     \
                             page_tokens, window, scale_log2, out, splits, o_part, lse_part);     \
    }
PREFILL_ENTRY(16)
PREFILL_ENTRY(32)
PREFILL_ENTRY(64)
PREFILL_ENTRY(128)
