// Attention for rows of one new token each (decode), fused with that token's rotary embedding
// and KV append, grouped-query aware and split over the sequence.
//
// A block serves one row, one KV head, up to DECODE_GROUP of the query heads sharing it, and
// one split of the row's positions, so each K and V row is read once for all those heads.
// Within a warp, D/8 lanes share a key (16 bytes of it each) and the warp covers 32/(D/8) keys
// at a time, two such steps at once, loading the next two while it computes with the current
// ones; every lane group keeps its own online softmax, merged across the warp and then the block
// at the end.
//
// The new token's q, k and v come straight from the q/k/v projection: the bias is added and q
// and k rotated here (lanes holding dimension i and i + D/2 swap halves with a shuffle). The
// blocks of the split holding the token's position store its k and v into the paged cache
// first, then read that position like any other.
//
// With one split a block writes the bf16 output. With several, each writes its normalized
// partial output and log-sum-exp, and the last block of a (row, head group) to finish, told by
// an atomic counter it resets, merges them. The launch fixes the most splits (a CUDA graph
// replays one launch shape); each row uses as many as its length warrants, at least
// MIN_SPLIT_KEYS positions each, so one launch serves any context length.

#define DECODE_WARPS 4
// Most splits a launch may have (the engine's MAX_SPLITS), and the fewest positions a split
// takes: a short row uses fewer splits than launched, whose merge then costs less. One row of
// 32k positions takes 128 splits of 250 to fill an H200's multiprocessors several times over.
#define MAX_SPLITS 128
#define MIN_SPLIT_KEYS 64
// Query heads per block: each costs 16 registers a lane, and occupancy hides memory latency.
#define DECODE_GROUP 4
// Blocks a multiprocessor must be able to hold (caps the registers a thread may use).
#ifndef DECODE_MIN_BLOCKS
#define DECODE_MIN_BLOCKS 4
#endif

struct DecodeRow {
    u32 token;  // index of the new token in the step (its q/k/v row and output row)
    u32 pos;    // its position: it attends lo..=pos
    u32 lo;
    u32 begin;  // this split's positions
    u32 end;
    u32 used;   // splits that hold positions of this row; the others have nothing to do
};

__device__ __forceinline__ DecodeRow decode_row(const u32* row_start_token, const u32* row_start_pos,
                                               u32 window, u32 split, u32 splits) {
    DecodeRow d;
    u32 r = blockIdx.z;
    d.token = row_start_token[r];
    d.pos = row_start_pos[r];
    d.lo = (window != 0 && d.pos + 1 > window) ? d.pos + 1 - window : 0;
    u32 n = d.pos + 1 - d.lo;
    d.used = min(splits, (n + MIN_SPLIT_KEYS - 1) / MIN_SPLIT_KEYS);
    u32 per = (n + d.used - 1) / d.used;
    d.begin = min(d.lo + split * per, d.pos + 1);
    d.end = min(d.begin + per, d.pos + 1);
    return d;
}

// Merges another online-softmax state (m2, l2, acc2) into (m, l, acc); scores are in log2 units.
__device__ __forceinline__ void merge_state(float& m, float& l, float* acc, float m2, float l2,
                                            const float* acc2, int n) {
    float mx = fmaxf(m, m2);
    if (mx == NEG_INF) return;
    float a = exp2f(m - mx), b = exp2f(m2 - mx);
    l = l * a + l2 * b;
    for (int i = 0; i < n; ++i) acc[i] = acc[i] * a + acc2[i] * b;
    m = mx;
}

// This lane's 8 dimensions of one head of the new token: bias added, and rotated unless `v`.
// Lanes `half_lanes` apart hold dimensions i and i + D/2.
__device__ __forceinline__ void new_head(const bf16* row, const bf16* bias, u32 at, const float* cs,
                                         const float* sn, u32 half_lanes, bool low, bool v,
                                         float* out) {
    unpack8(*(const uint4*)(row + at), out);
    if (bias) {
        float b[8];
        unpack8(*(const uint4*)(bias + at), b);
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] += b[i];
    }
    if (v) return;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float other = __shfl_xor_sync(0xffffffffu, out[i], half_lanes);
        out[i] = low ? out[i] * cs[i] - other * sn[i] : out[i] * cs[i] + other * sn[i];
    }
}

__device__ __forceinline__ uint4 pack8(const float* v) {
    return make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                      pack_bf16x2(v[6], v[7]));
}

struct DecodeArgs {
    const bf16* qkv;
    const bf16* bias;
    const float* inv_freq;
    bf16* k_cache;
    bf16* v_cache;
    const u32* page_table;
    u32 table_stride;
    const u32* row_start_token;
    const u32* row_start_pos;
    u32 heads, kv_heads, page_tokens, window;
    float scale_log2;
    bf16* out;
    float* o_part;
    float* lse_part;
    u32* done;
    u32 splits;
};

// The last block of a (row, head group) merges the `used` splits' partial outputs: the splits'
// weights first (from their log-sum-exps, through shared memory), then four output elements a
// thread, with the partial loads of MERGE_BATCH splits in flight at once (a merge of 128 splits
// reads 256 KB for the 8B shape: one load at a time, latency made it the step's largest cost).
#define MERGE_BATCH 16
__device__ void combine_splits(const DecodeArgs& a, u32 r, u32 head0, u32 g, u32 used, u32 token,
                               u32 D) {
    __shared__ float s_w[DECODE_GROUP][MAX_SPLITS];
    for (u32 i = threadIdx.x; i < g * used; i += blockDim.x) {
        u32 h = i / used, s = i % used;
        s_w[h][s] = __ldcg(a.lse_part + ((u64)r * a.heads + head0 + h) * a.splits + s);
    }
    __syncthreads();
    if (threadIdx.x < g) {
        float* w = s_w[threadIdx.x];
        float mx = NEG_INF, sum = 0.f;
        for (u32 s = 0; s < used; ++s) mx = fmaxf(mx, w[s]);
        for (u32 s = 0; s < used; ++s) sum += w[s] == NEG_INF ? 0.f : exp2f(w[s] - mx);
        for (u32 s = 0; s < used; ++s) w[s] = w[s] == NEG_INF ? 0.f : exp2f(w[s] - mx) / sum;
    }
    __syncthreads();
    u32 quads = D / 4;
    for (u32 idx = threadIdx.x; idx < g * quads; idx += blockDim.x) {
        u32 h = idx / quads, d = (idx % quads) * 4;
        const float4* o =
            (const float4*)(a.o_part + ((u64)r * a.heads + head0 + h) * a.splits * D + d);
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (u32 s0 = 0; s0 < used; s0 += MERGE_BATCH) {
            float4 part[MERGE_BATCH];
#pragma unroll
            for (u32 j = 0; j < MERGE_BATCH; ++j)
                if (s0 + j < used) part[j] = __ldcg(o + (s0 + j) * quads);
#pragma unroll
            for (u32 j = 0; j < MERGE_BATCH; ++j) {
                if (s0 + j < used) {
                    float w = s_w[h][s0 + j];
                    acc.x += w * part[j].x, acc.y += w * part[j].y;
                    acc.z += w * part[j].z, acc.w += w * part[j].w;
                }
            }
        }
        bf16* dst = a.out + (u64)token * a.heads * D + (u64)(head0 + h) * D + d;
        *(uint2*)dst = make_uint2(pack_bf16x2(acc.x, acc.y), pack_bf16x2(acc.z, acc.w));
    }
}

template <int D>
__device__ void decode_attention(const DecodeArgs& a) {
    constexpr int LPK = D / 8;     // lanes per key
    constexpr int KPW = 32 / LPK;  // keys per warp step
    constexpr int STEP = DECODE_WARPS * KPW;
    __shared__ float s_m[DECODE_WARPS][DECODE_GROUP], s_l[DECODE_WARPS][DECODE_GROUP];
    __shared__ float s_acc[DECODE_WARPS][DECODE_GROUP][D];
    __shared__ bool s_last;

    u32 group = a.heads / a.kv_heads, chunks = (group + DECODE_GROUP - 1) / DECODE_GROUP;
    u32 kvh = blockIdx.y / chunks, chunk = blockIdx.y % chunks;
    u32 head0 = kvh * group + chunk * DECODE_GROUP;
    u32 g = min((u32)DECODE_GROUP, group - chunk * DECODE_GROUP);
    u32 split = blockIdx.x, r = blockIdx.z;
    DecodeRow row = decode_row(a.row_start_token, a.row_start_pos, a.window, split, a.splits);
    if (split >= row.used) return;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane / LPK, part = lane % LPK;

    float cs[8], sn[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) sincosf((float)row.pos * a.inv_freq[(part * 8 + i) % (D / 2)], &sn[i], &cs[i]);
    bool low = part < LPK / 2;
    const bf16* tok = a.qkv + (u64)row.token * (a.heads + 2 * a.kv_heads) * D;
    float q[DECODE_GROUP][8], acc[DECODE_GROUP][8], m[DECODE_GROUP], l[DECODE_GROUP];
#pragma unroll
    for (int h = 0; h < DECODE_GROUP; ++h) {
        m[h] = NEG_INF;
        l[h] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[h][i] = 0.f, q[h][i] = 0.f;
        if (h < g) {
            new_head(tok, a.bias, (head0 + h) * D + part * 8, cs, sn, LPK / 2, low, false, q[h]);
#pragma unroll
            for (int i = 0; i < 8; ++i) q[h][i] *= a.scale_log2;
        }
    }
    // The new token's k and v, rounded as the cache will hold them, stored before any block
    // reads its position. Every head group's block of the split holding it stores the same
    // bytes, so the order among blocks does not matter; the barrier orders this block's reads.
    float kc[8], vc[8];
    new_head(tok, a.bias, (a.heads + kvh) * D + part * 8, cs, sn, LPK / 2, low, false, kc);
    new_head(tok, a.bias, (a.heads + a.kv_heads + kvh) * D + part * 8, cs, sn, LPK / 2, low, true, vc);
    const u32* table = a.page_table + (u64)r * a.table_stride;
    // Pages hold a power of two of positions in every shipped configuration: shifts then.
    bool pow2 = (a.page_tokens & (a.page_tokens - 1)) == 0;
    u32 page_shift = __ffs(a.page_tokens) - 1;
    auto at = [&](u32 k) {
        u32 page = pow2 ? k >> page_shift : k / a.page_tokens;
        u32 within = pow2 ? k & (a.page_tokens - 1) : k % a.page_tokens;
        u64 slot = (u64)table[page] * a.page_tokens + within;
        return (slot * a.kv_heads + kvh) * D + part * 8;
    };
    if (row.begin <= row.pos && row.pos < row.end && warp == 0 && sub == 0) {
        *(uint4*)(a.k_cache + at(row.pos)) = pack8(kc);
        *(uint4*)(a.v_cache + at(row.pos)) = pack8(vc);
    }
    __syncthreads();
    // A lane group takes two keys a step, STEP apart, and loads the next two while it computes
    // with these: both keys' scores are folded into the online softmax at once.
    uint4 k_ring[2] = {}, v_ring[2] = {};
    auto fetch = [&](u32 k, uint4& kb, uint4& vb) {
        if (k < row.end) {
            kb = *(const uint4*)(a.k_cache + at(k));
            vb = *(const uint4*)(a.v_cache + at(k));
        }
    };
    u32 first = row.begin + warp * KPW + sub;
    fetch(first, k_ring[0], v_ring[0]);
    fetch(first + STEP, k_ring[1], v_ring[1]);
    for (u32 k0 = row.begin + warp * KPW; k0 < row.end; k0 += 2 * STEP) {
        u32 k = k0 + sub;
        float kf[2][8], vf[2][8];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            unpack8(k_ring[i], kf[i]);
            unpack8(v_ring[i], vf[i]);
            fetch(k + (2 + i) * STEP, k_ring[i], v_ring[i]);
        }
        bool valid[2] = {k < row.end, k + STEP < row.end};
#pragma unroll
        for (int h = 0; h < DECODE_GROUP; ++h) {
            float sc[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                sc[i] = 0.f;
#pragma unroll
                for (int j = 0; j < 8; ++j) sc[i] += q[h][j] * kf[i][j];
#pragma unroll
                for (int o = LPK / 2; o > 0; o >>= 1) sc[i] += __shfl_xor_sync(0xffffffffu, sc[i], o);
                if (!valid[i]) sc[i] = NEG_INF;
            }
            float mx = fmaxf(m[h], fmaxf(sc[0], sc[1]));
            if (mx == NEG_INF) continue;
            float al = exp2f(m[h] - mx), p0 = exp2f(sc[0] - mx), p1 = exp2f(sc[1] - mx);
            l[h] = l[h] * al + p0 + p1;
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[h][j] = acc[h][j] * al + p0 * vf[0][j] + p1 * vf[1][j];
            m[h] = mx;
        }
    }
    // Merge the lane groups of the warp: lanes with the same `part` hold the same dimensions.
#pragma unroll
    for (int o = LPK; o < 32; o <<= 1) {
#pragma unroll
        for (int h = 0; h < DECODE_GROUP; ++h) {
            if (h >= g) continue;
            float m2 = __shfl_xor_sync(0xffffffffu, m[h], o);
            float l2 = __shfl_xor_sync(0xffffffffu, l[h], o);
            float acc2[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) acc2[i] = __shfl_xor_sync(0xffffffffu, acc[h][i], o);
            merge_state(m[h], l[h], acc[h], m2, l2, acc2, 8);
        }
    }
    if (sub == 0) {
        for (u32 h = 0; h < g; ++h) {
            if (part == 0) s_m[warp][h] = m[h], s_l[warp][h] = l[h];
#pragma unroll
            for (int i = 0; i < 8; ++i) s_acc[warp][h][part * 8 + i] = acc[h][i];
        }
    }
    __syncthreads();
    for (u32 idx = threadIdx.x; idx < g * D; idx += blockDim.x) {
        u32 h = idx / D, d = idx % D;
        float mt = NEG_INF, lt = 0.f, ot = 0.f;
        for (int w = 0; w < DECODE_WARPS; ++w) merge_state(mt, lt, &ot, s_m[w][h], s_l[w][h], &s_acc[w][h][d], 1);
        float o = lt > 0.f ? ot / lt : 0.f;
        u32 head = head0 + h;
        if (row.used == 1) {
            a.out[(u64)row.token * a.heads * D + (u64)head * D + d] = f32_to_bf16(o);
        } else {
            u64 slot = ((u64)r * a.heads + head) * a.splits + split;
            a.o_part[slot * D + d] = o;
            if (d == 0) a.lse_part[slot] = lt > 0.f ? mt + log2f(lt) : NEG_INF;
        }
    }
    if (row.used == 1) return;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        u32* counter = a.done + (u64)r * gridDim.y + blockIdx.y;
        s_last = atomicAdd(counter, 1u) == row.used - 1;
        if (s_last) *counter = 0;
    }
    __syncthreads();
    if (s_last) {
        __threadfence();
        combine_splits(a, r, head0, g, row.used, row.token, D);
    }
}

#define DECODE_ENTRY(D)                                                                           \
    extern "C" __global__ void __launch_bounds__(DECODE_WARPS * 32, DECODE_MIN_BLOCKS)          \
        decode_attention_d##D(                                                                    \
            const bf16* qkv, const bf16* bias, const float* inv_freq, bf16* k_cache, bf16* v_cache,   \
        const u32* page_table, u32 table_stride, const u32* row_start_token,                      \
        const u32* row_start_pos, u32 heads, u32 kv_heads, u32 page_tokens, u32 window,           \
        float scale_log2, bf16* out, float* o_part, float* lse_part, u32* done, u32 splits) {      \
        DecodeArgs a = {qkv,     bias,           inv_freq,      k_cache, v_cache,                 \
                        page_table, table_stride, row_start_token, row_start_pos, heads,           \
                        kv_heads, page_tokens,   window,        scale_log2, out,                   \
                        o_part,  lse_part,       done,          splits};                           \
        decode_attention<D>(a);                                                                   \
    }
DECODE_ENTRY(16)
DECODE_ENTRY(32)
DECODE_ENTRY(64)
DECODE_ENTRY(128)
