// Attention for rows of one new token each (decode), fused with that token's rotary embedding
// and KV append, grouped-query aware, on the tensor cores, and split over the sequence.
//
// A block serves one row, one KV head, up to DECODE_GROUP of the query heads sharing it, and
// one split of the row's positions, so each K and V row is read once for all those heads. The
// heads are the rows of an m16n8k16 A operand (the rest of its 16 rows zero): tiles of
// KEY_TILE positions are gathered into shared memory with prefill attention's loader (the
// next tile's cp.async in flight), each warp takes 16 keys of a tile, and Q·Kᵀ and P·V are a
// few mma.sync a warp, so the block's time is its loads. Every warp keeps its own online
// softmax, merged across the block at the end. (A lane-per-dimension version on the CUDA cores
// spent as long on its shuffles and softmax as on its loads: 62% of the copy bandwidth at batch
// 256, where this one is bound by the loads.)
//
// The new token's q, k and v come straight from the q/k/v projection: the bias is added and q
// and k rotated here (lanes holding dimension i and i + D/2 swap halves with a shuffle), q
// rounded to bf16 as prefill attention reads it. The blocks of the split holding the token's
// position store its k and v into the paged cache first, then read that position like any
// other. Unless `store_kv` is 0: then the rows are a verification's positions of one sequence,
// one row each, whose k and v a rope_kv_append launch stored before this one (a row reads the
// positions of the rows before it, which no block of this launch may be writing).
//
// With one split a block writes the bf16 output. With several, each writes its normalized
// partial output and log-sum-exp, and the last block of a (row, head group) to finish, told by
// an atomic counter it resets, merges them. The launch fixes the most splits (a CUDA graph
// replays one launch shape); each row uses as many as its length warrants, at least
// MIN_SPLIT_KEYS positions each, so one launch serves any context length. A launch of few rows
// runs in clusters (below, CLUSTER_SPLITS): a short row's splits are then one cluster's blocks,
// which merge through each other's shared memory instead.

#define DECODE_WARPS 4
// Most splits a launch may have (the engine's MAX_SPLITS), and the fewest positions a split
// takes: a short row uses fewer splits than launched, whose merge then costs less, and a split
// of 4 tiles keeps a copy in flight behind each one computed (8B, batch 1 × 8,192 positions:
// 6.05 ms a step with splits of 64, 5.02 with 256).
#define MAX_SPLITS 128
#define MIN_SPLIT_KEYS 256
// A short row, whose splits of MIN_SPLIT_KEYS would be too few to hide a tile's latency behind
// another's (SmolLM2 at batch 1 × 512 positions: two splits of four tiles each, one after the
// other), takes up to SHORT_SPLITS splits of at least SHORT_SPLIT_KEYS, as long as the launch
// stays within one block a multiprocessor: the engine launches enough splits to fill the device
// twice over (`DECODE_BLOCKS_PER_MULTIPROCESSOR`), so at most half of them. Measured on the
// H200, tok/s, splits of 256 / up to 8 of 64 without that bound: SmolLM2 batch 1 × 512
// 1,435 / 1,537, batch 8 × 512 8,032 / 8,444; 8B batch 1 × 512 226.4 / 230.8, batch 8 × 512
// 1,664 / 1,583 (the bound keeps the last at two splits). Splits of at least 128 positions
// rather than 64 (two whole tiles: 513 positions made 8 splits of 65, each a tile and a key)
// changed only rows of 65 to 1,024 positions, for the better: 8B batch 1 × 512 decode 4.04 ms
// either way, a verification of 8 there 4.93 → 4.73 ms (its 8 rows' blocks now one wave);
// SmolLM2 batch 1 × 512 0.635 → 0.619 ms.
#ifndef SHORT_SPLITS
#define SHORT_SPLITS 8
#endif
#ifndef SHORT_SPLIT_KEYS
#define SHORT_SPLIT_KEYS 128
#endif
// Query heads per block (rows of the mma's A operand used).
#define DECODE_GROUP 4
// Blocks a multiprocessor must be able to hold (caps the registers a thread may use): three, as
// many as the tiles' shared memory allows.
#ifndef DECODE_MIN_BLOCKS
#define DECODE_MIN_BLOCKS 3
#endif

struct DecodeRow {
    u32 token;  // index of the new token in the step (its q/k/v row and output row)
    u32 pos;    // its position: it attends lo..=pos
    u32 lo;
    u32 begin;  // this split's positions
    u32 end;
    u32 used;   // splits that hold positions of this row; the others have nothing to do
    bool in_cluster;  // the used splits are one cluster's blocks, merged in shared memory
};

// Launched in clusters (the engine does for heads of up to 64 where a launch has a multiple of
// CLUSTER_SPLITS splits: few rows), a row of at most CLUSTER_SPLITS · MIN_SPLIT_KEYS positions
// takes a split a tile of KEY_TILE keys, up to a cluster's blocks, and the blocks merge through
// each other's shared memory: no partial outputs through global memory, no counter, no last
// block's second round. Every tile of the row is in flight at once. Measured on the H200 in
// BENCHMARKS.md.
#define CLUSTER_SPLITS 8

__device__ __forceinline__ DecodeRow decode_row(const u32* row_start_token, const u32* row_start_pos,
                                               u32 r, u32 window, u32 split, u32 splits, u32 cluster) {
    DecodeRow d;
    d.token = row_start_token[r];
    d.pos = row_start_pos[r];
    d.lo = (window != 0 && d.pos + 1 > window) ? d.pos + 1 - window : 0;
    u32 n = d.pos + 1 - d.lo;
    u32 long_splits = (n + MIN_SPLIT_KEYS - 1) / MIN_SPLIT_KEYS;
    if (cluster > 1 && long_splits <= cluster) {
        d.used = min(cluster, (n + KEY_TILE - 1) / KEY_TILE);
    } else {
        u32 short_splits = min(min((n + SHORT_SPLIT_KEYS - 1) / SHORT_SPLIT_KEYS, SHORT_SPLITS), splits / 2);
        d.used = min(splits, max(long_splits, short_splits));
    }
    d.in_cluster = cluster > 1 && d.used > 1 && d.used <= cluster;
    u32 per = (n + d.used - 1) / d.used;
    d.begin = min(d.lo + split * per, d.pos + 1);
    d.end = min(d.begin + per, d.pos + 1);
    return d;
}

// This lane's 8 dimensions of one head of the new token (`out`, bias added), rotated unless
// `v`. Lanes `half_lanes` apart hold dimensions i and i + D/2; every lane of the warp must call
// this (the rotation's shuffles), `v` or not.
__device__ __forceinline__ void rotate_new_head(const float* cs, const float* sn, u32 half_lanes,
                                                bool low, bool v, float* out) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float other = __shfl_xor_sync(0xffffffffu, out[i], half_lanes);
        if (!v) out[i] = low ? rope_low(out[i], other, cs[i], sn[i]) : rope_high(other, out[i], cs[i], sn[i]);
    }
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
    u32 store_kv;  // 0: the step's k and v are in the cache already (a verification's rows)
    // The launch's rows, as (row, 0) pairs (a prefill step's work items), or null for rows
    // 0..gridDim.z: the rows of one token of a step that also holds prompt chunks, whose q, k
    // and v rope_kv_append has rotated (q in place, bias added) and stored (`q_ready`).
    const u32* row_items;
    u32 q_ready;
    // A folded layer's step (gemv_fold.cu): the raw f32 q/k/v, scaled here by the RMSNorm of
    // the stream whose `hidden / FOLD_ROWS` partial sums of squares are `norm_parts`, and
    // rounded to bf16 as the projection would write them; null: `qkv` holds them.
    const float* qkv_raw;
    const float* norm_parts;
    u32 hidden;
    float eps;
};

// The last block of a (row, head group) merges the `used` splits' partial outputs (those of the
// launch's z-th row): the splits' weights first (from their log-sum-exps, through shared
// memory), then four output elements a thread, with the partial loads of MERGE_BATCH splits in
// flight at once (a merge of 128 splits reads 256 KB for the 8B shape: one load at a time,
// latency made it the step's largest cost).
#define MERGE_BATCH 16
__device__ void combine_splits(const DecodeArgs& a, u32 z, u32 head0, u32 g, u32 used, u32 token,
                               u32 D) {
    __shared__ float s_w[DECODE_GROUP][MAX_SPLITS];
    for (u32 i = threadIdx.x; i < g * used; i += blockDim.x) {
        u32 h = i / used, s = i % used;
        s_w[h][s] = __ldcg(a.lse_part + ((u64)z * a.heads + head0 + h) * a.splits + s);
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
            (const float4*)(a.o_part + ((u64)z * a.heads + head0 + h) * a.splits * D + d);
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

// The rotation's angles at `pos` of this thread's 8 dimensions (D / 8 threads a head).
template <int D>
__device__ __forceinline__ void rope_angles(u32 pos, const float* inv_freq, float* cs, float* sn) {
    u32 part = threadIdx.x % (D / 8);
#pragma unroll
    for (int i = 0; i < 8; ++i) sincosf((float)pos * inv_freq[(part * 8 + i) % (D / 2)], &sn[i], &cs[i]);
}

// The prologue: lane groups of D/8 threads each take one of the g query heads (head0..), the new
// k (`unit` g) or the new v (g + 1) of KV head `kvh`, from `token`'s q/k/v row: bias added and
// rotated, q rounded to bf16 into rows 0..g of `s_q` (row stride D + 8), rows g..15 zeroed.
// Returns this thread's 8 values packed, for the caller to store k and v where it keeps them.
template <int D>
__device__ __forceinline__ uint4 new_token_heads(const DecodeArgs& a, u32 token, u32 head0, u32 g,
                                                 u32 kvh, const float* cs, const float* sn,
                                                 bf16* s_q, u32& unit) {
    constexpr int LPK = D / 8, STRIDE = D + 8;
    unit = threadIdx.x / LPK;
    u32 part = threadIdx.x % LPK;
    const bf16* tok = a.qkv + (u64)token * (a.heads + 2 * a.kv_heads) * D;
    bool is_v = unit == g + 1;
    u32 col = unit < g ? (head0 + unit) * D : (unit == g ? a.heads + kvh : a.heads + a.kv_heads + kvh) * D;
    if (unit > g + 1) col = 0;  // idle lanes still join the shuffles below
    float x[8];
    bool ready = a.q_ready && unit < g;  // q as rope_kv_append left it: no bias, no turn
    u32 at = col + part * 8;
    if (a.qkv_raw) {
        // The values' loads go out before the norm's partial sums are summed, so that their
        // latencies overlap.
        const float4* raw = (const float4*)(a.qkv_raw + (u64)token * (a.heads + 2 * a.kv_heads) * D + at);
        float4 lo = raw[0], hi = raw[1];
        float b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (a.bias) unpack8(*(const uint4*)(a.bias + at), b);
        float scale = folded_norm_scale(a.norm_parts, a.hidden, a.eps);
        float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = round_bf16(v[i] * scale) + b[i];
    } else {
        load8_biased(tok, ready ? nullptr : a.bias, at, x);
    }
    rotate_new_head(cs, sn, LPK / 2, part < LPK / 2, is_v || ready, x);
    uint4 bits = pack8(x);
    if (unit < g) *(uint4*)(s_q + unit * STRIDE + part * 8) = bits;
    for (u32 i = threadIdx.x; i < (16 - g) * (D / 8); i += blockDim.x)
        *(uint4*)(s_q + (g + i / (D / 8)) * STRIDE + (i % (D / 8)) * 8) = make_uint4(0, 0, 0, 0);
    return bits;
}

// This thread's 8 values of the new k (`unit` g) or v (g + 1) of KV head `kvh` into the paged
// cache at `pos`.
template <int D>
__device__ __forceinline__ void store_new_kv(const DecodeArgs& a, const u32* table, u32 pos,
                                             u32 kvh, u32 unit, u32 g, uint4 bits) {
    u64 slot = (u64)table[pos / a.page_tokens] * a.page_tokens + pos % a.page_tokens;
    bf16* cache = unit == g ? a.k_cache : a.v_cache;
    *(uint4*)(cache + (slot * a.kv_heads + kvh) * D + (threadIdx.x % (D / 8)) * 8) = bits;
}

// One warp's 16 keys k0 + wk.. of a tile in shared memory (K rows `ks`, V rows `vs`, stride
// D + 8), those at or past `end` masked: the query heads' scores (`qa`, the A fragments of every
// k-step), their online softmax (m, l; only the rows of the first half, heads gid < g, matter)
// and P·V added into `o`.
template <int D>
__device__ __forceinline__ void attend_keys16(const u32 (*qa)[4], const bf16* ks, const bf16* vs,
                                              u32 k0, u32 wk, u32 end, float scale_log2, u32 lane,
                                              float& m, float& l, float (*o)[4]) {
    constexpr int NT = D / 8;
    u32 tig = lane & 3;
    float s[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) score_keys8<D>(s[n], qa, ks, wk + n * 8, lane);
    float mx = NEG_INF;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            bool visible = k0 + wk + n * 8 + tig * 2 + e < end;
            s[n][e] = visible ? s[n][e] * scale_log2 : NEG_INF;
            mx = fmaxf(mx, s[n][e]);
        }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    float m_new = fmaxf(m, mx);
    float base = m_new == NEG_INF ? 0.f : m_new;
    float alpha = fast_exp2(m - base), sum = 0.f;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            s[n][e] = fast_exp2(s[n][e] - base);
            sum += s[n][e];
        }
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    l = l * alpha + sum;
    m = m_new;
    u32 pa[4] = {pack_bf16x2(s[0][0], s[0][1]), 0u, pack_bf16x2(s[1][0], s[1][1]), 0u};
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] *= alpha, o[n][1] *= alpha;
    add_values16<D>(o, pa, vs, wk, lane);
}

// Each warp's softmax state for the g heads into shared memory at `states`, for the block's
// merge of its WARPS warps: s_m [warp][head], s_l likewise, then s_acc [warp][head][D]. Returns
// s_m; the caller waits for every warp before reading.
template <int D, int WARPS>
__device__ __forceinline__ float* store_warp_states(float* states, u32 g, float m, float l,
                                                    const float (*o)[4]) {
    constexpr int NT = D / 8;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gid = lane >> 2, tig = lane & 3;
    float* s_m = states;
    float* s_l = s_m + WARPS * DECODE_GROUP;
    float* s_acc = s_l + WARPS * DECODE_GROUP;
    if (gid < g) {
        if (tig == 0) s_m[warp * DECODE_GROUP + gid] = m, s_l[warp * DECODE_GROUP + gid] = l;
        float* acc = s_acc + (warp * DECODE_GROUP + gid) * D + tig * 2;
#pragma unroll
        for (int n = 0; n < NT; ++n) acc[n * 8] = o[n][0], acc[n * 8 + 1] = o[n][1];
    }
    return s_m;
}

// Thread's merge of the block's warps' states for output element d of head h (states as
// `store_warp_states` left them): the normalized output, and the log-sum-exp's parts.
template <int D, int WARPS>
__device__ __forceinline__ void merge_warp_states(const float* s_m, u32 h, u32 d, float& mt,
                                                  float& lt, float& ot) {
    const float* s_l = s_m + WARPS * DECODE_GROUP;
    const float* s_acc = s_l + WARPS * DECODE_GROUP;
    // The largest maximum first, then every warp's weight from it: independent exponentials,
    // not a chain of pairwise merges.
    mt = NEG_INF, lt = 0.f, ot = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mt = fmaxf(mt, s_m[w * DECODE_GROUP + h]);
    if (mt == NEG_INF) return;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        u32 at = w * DECODE_GROUP + h;
        float b = exp2f(s_m[at] - mt);
        lt += s_l[at] * b;
        ot += s_acc[at * D + d] * b;
    }
}

template <int D>
__device__ void decode_attention(const DecodeArgs& a) {
    constexpr int STRIDE = D + 8, KS = D / 16, NT = D / 8, TILE = KEY_TILE * STRIDE;
    constexpr int WARP_KEYS = KEY_TILE / DECODE_WARPS;  // 16: one mma k-step of P·V
    __shared__ bool s_last;
    // [stage][K, V][TILE]. What the block keeps outside the loop over tiles lives in the same
    // bytes, so three blocks fit a multiprocessor: the query rows in stage 1 until the first
    // copy into it, the warps' softmax states in stage 0 after the last tile.
    extern __shared__ __align__(16) bf16 decode_tiles[];
    bf16* s_q = decode_tiles + 2 * TILE;

    u32 group = a.heads / a.kv_heads, chunks = (group + DECODE_GROUP - 1) / DECODE_GROUP;
    u32 kvh = blockIdx.y / chunks, chunk = blockIdx.y % chunks;
    u32 head0 = kvh * group + chunk * DECODE_GROUP;
    u32 g = min((u32)DECODE_GROUP, group - chunk * DECODE_GROUP);
    // Row r of the step is the launch's z-th: the split workspaces and counters go by z.
    u32 split = blockIdx.x, z = blockIdx.z, r = a.row_items ? a.row_items[2 * z] : z;
    u32 cluster = cluster_blocks();
    DecodeRow row = decode_row(a.row_start_token, a.row_start_pos, r, a.window, split, a.splits, cluster);
    if (split >= row.used) {
        pdl_begin();
        // A block of the merging cluster with no positions still meets its barriers.
        if (row.in_cluster && split < cluster) {
            cluster_sync();
            cluster_sync();
        }
        return;
    }
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32* table = a.page_table + (u64)r * a.table_stride;

    // The first tile's copy goes out before waiting for the kernel before (a programmatic
    // dependent launch) when none of its keys can have been written since the step began: this
    // kernel stores the row's own key and value below, and a verification's k/v append (the
    // kernel before it then) writes the DECODE_FRESH_KEYS positions up to the row's. Older
    // keys were written by earlier steps, and the page table by the step's first kernel.
    // (Copying a first tile holding the row's own position without it, and putting the new k
    // and v into shared memory from the prologue's registers, measured no faster: BENCHMARKS.)
    u32 first_end = min(row.begin + KEY_TILE, row.end);
    bool early = first_end + DECODE_FRESH_KEYS <= row.pos + 1;
    if (early)
        issue_kv_tile<D, DECODE_WARPS * 32>(decode_tiles, decode_tiles + TILE, a.k_cache,
                                            a.v_cache, table, a.page_tokens, a.kv_heads, kvh,
                                            row.begin, row.end - 1);
    // The rotation's angles need only the position (the step's first kernel wrote it) and the
    // frequencies. Heads of up to 64 compute them before the wait, overlapping the kernel before
    // (their step is a chain of latencies: SmolLM2 batch 1 +2.5%, BENCHMARKS.md); heads of 128
    // after it: held through the first tile's copy they took 168 registers a thread, not 160,
    // for no gain on the 8B shape.
    float cs[8], sn[8];
    if constexpr (D <= 64) rope_angles<D>(row.pos, a.inv_freq, cs, sn);
    pdl_begin();
    if constexpr (D > 64) rope_angles<D>(row.pos, a.inv_freq, cs, sn);

    // Prologue: lane groups of D/8 threads each take one of the g query heads (rotated, rounded
    // to bf16 into the rows of s_q), the new k (rotated) or the new v. The blocks of the split
    // holding the token's position store k and v into the paged cache before any tile is read;
    // every head group's block stores the same bytes, so their order does not matter.
    {
        u32 unit;
        uint4 bits = new_token_heads<D>(a, row.token, head0, g, kvh, cs, sn, s_q, unit);
        if (a.store_kv && unit >= g && unit <= g + 1 && row.begin <= row.pos && row.pos < row.end)
            store_new_kv<D>(a, table, row.pos, kvh, unit, g, bits);
    }
    __syncthreads();

    // The query heads as the A operand of m16n8k16 (rows g..15 zero), for every k-step.
    u32 qa[KS][4];
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
        ldmatrix_x4(qa[kk], s_q + ((lane & 7) + ((lane >> 3) & 1) * 8) * STRIDE + kk * 16 + (lane >> 4) * 8);
    __syncthreads();  // every warp has its q before stage 1 is overwritten

    // Tiles of KEY_TILE keys go through shared memory as in prefill attention, the next one's
    // copy in flight; each warp takes 16 keys of a tile with its own online softmax, so the
    // whole tile's scores and P·V are a few tensor-core instructions a warp.
    float o[NT][4], m = NEG_INF, l = 0.f;
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    u32 n_tiles = (row.end - row.begin + KEY_TILE - 1) / KEY_TILE;
    if (!early)
        issue_kv_tile<D, DECODE_WARPS * 32>(decode_tiles, decode_tiles + TILE, a.k_cache,
                                            a.v_cache, table, a.page_tokens, a.kv_heads, kvh,
                                            row.begin, row.end - 1);
    for (u32 t = 0; t < n_tiles; ++t) {
        u32 k0 = row.begin + t * KEY_TILE;
        const bf16* ks = decode_tiles + (t % PREFILL_STAGES) * 2 * TILE;
        const bf16* vs = ks + TILE;
        if (t + 1 < n_tiles) {
            bf16* next = decode_tiles + ((t + 1) % PREFILL_STAGES) * 2 * TILE;
            issue_kv_tile<D, DECODE_WARPS * 32>(next, next + TILE, a.k_cache, a.v_cache, table,
                                                a.page_tokens, a.kv_heads, kvh, k0 + KEY_TILE,
                                                row.end - 1);
            asm volatile("cp.async.wait_group 1;");
        } else {
            asm volatile("cp.async.wait_group 0;");
        }
        __syncthreads();
        attend_keys16<D>(qa, ks, vs, k0, warp * WARP_KEYS, row.end, a.scale_log2, lane, m, l, o);
        __syncthreads();
    }
    if (n_tiles == 0) {  // the loop's last barrier did not run: let the first copy land
        asm volatile("cp.async.wait_group 0;");
        __syncthreads();
    }
    const float* s_m = store_warp_states<D, DECODE_WARPS>((float*)decode_tiles, g, m, l, o);
    __syncthreads();
    // This split's normalized output and log-sum-exp, for the cluster's merge.
    static_assert(D <= 128, "s_split_o holds heads of up to 128");
    __shared__ float s_split_o[DECODE_GROUP][128], s_split_lse[DECODE_GROUP];
    for (u32 idx = threadIdx.x; idx < g * D; idx += blockDim.x) {
        u32 h = idx / D, d = idx % D;
        float mt, lt, ot;
        merge_warp_states<D, DECODE_WARPS>(s_m, h, d, mt, lt, ot);
        float o = lt > 0.f ? ot / lt : 0.f;
        u32 head = head0 + h;
        if (row.in_cluster) {
            s_split_o[h][d] = o;
            if (d == 0) s_split_lse[h] = lt > 0.f ? mt + log2f(lt) : NEG_INF;
        } else if (row.used == 1) {
            a.out[(u64)row.token * a.heads * D + (u64)head * D + d] = f32_to_bf16(o);
        } else {
            u64 slot = ((u64)z * a.heads + head) * a.splits + split;
            a.o_part[slot * D + d] = o;
            if (d == 0) a.lse_part[slot] = lt > 0.f ? mt + log2f(lt) : NEG_INF;
        }
    }
    if (row.in_cluster) {
        // The used splits are ranks 0..used-1 of this cluster (splits 0..CLUSTER_SPLITS-1 of the
        // row): each block writes every used-th output element, weighing the splits in order.
        cluster_sync();
        for (u32 idx = split + row.used * threadIdx.x; idx < g * D; idx += row.used * blockDim.x) {
            u32 h = idx / D, d = idx % D;
            float lse[CLUSTER_SPLITS], part[CLUSTER_SPLITS], mx = NEG_INF;
#pragma unroll
            for (u32 s = 0; s < CLUSTER_SPLITS; ++s) {
                if (s < row.used) {
                    lse[s] = cluster_load(&s_split_lse[h], s);
                    part[s] = cluster_load(&s_split_o[h][d], s);
                    mx = fmaxf(mx, lse[s]);
                }
            }
            float sum = 0.f, acc = 0.f;
#pragma unroll
            for (u32 s = 0; s < CLUSTER_SPLITS; ++s) {
                if (s < row.used) {
                    float w = lse[s] == NEG_INF ? 0.f : exp2f(lse[s] - mx);
                    sum += w;
                    acc += w * part[s];
                }
            }
            a.out[(u64)row.token * a.heads * D + (u64)(head0 + h) * D + d] =
                f32_to_bf16(sum > 0.f ? acc / sum : 0.f);
        }
        cluster_sync();  // no block leaves while another reads its shared memory
        return;
    }
    if (row.used == 1) return;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        u32* counter = a.done + (u64)z * gridDim.y + blockIdx.y;
        s_last = atomicAdd(counter, 1u) == row.used - 1;
        if (s_last) *counter = 0;
    }
    __syncthreads();
    if (s_last) {
        __threadfence();
        combine_splits(a, z, head0, g, row.used, row.token, D);
    }
}

// Few short rows (the engine's resident launch: rows of at most `max_tiles` tiles, one token
// each, their k and v stored here): a block serves a whole row for one KV head's group, every
// earlier position of the row copied into shared memory before waiting for the kernel before,
// the row's own k and v put there from the prologue's registers, and the tiles computed from
// shared memory, merged across the warps: no split, no merge between blocks, no load after the
// wait but the new q/k/v. A short row's attention is then a chain of the prologue and the
// products, where a cluster of splits spends ~3 µs after its prologue on loads, barriers and
// the merge (BENCHMARKS.md, "A short row's attention in one block").
//
// A tile's 64 keys are RESIDENT_LANES warps' 16 each, as in decode_attention; the block has
// RESIDENT_WARPS warps, so each set of four takes every other tile. H100, SmolLM2's shape,
// batch 1, tok/s after contexts of 128 / 384 / 512 (BENCHMARKS.md, "Eight warps"): 4 warps
// 2,212 / 1,970 / 1,827, 8 warps 2,233 / 2,117 / 2,036, 16 warps 2,092 / 1,996 / 1,926 (the
// merge of more warps and the copies' issue cost more than the shorter chain saves). A warp
// scores all its tiles before one softmax over them (no online softmax step a tile: the
// products overlap), and the prologue's loads go out before the copies are waited for: SmolLM2
// batch 1 × 512 +5% (BENCHMARKS.md, "Weights marked first out of L2").
//
// Dynamic shared memory: `max_tiles` K and V tiles, then the query rows.
#ifndef RESIDENT_WARPS
#define RESIDENT_WARPS 8
#endif
#define RESIDENT_LANES 4
// RESIDENT_MAX_TILES, the most tiles a resident block holds, comes from the engine.
template <int D>
__device__ void decode_attention_resident(const DecodeArgs& a, u32 max_tiles) {
    constexpr int STRIDE = D + 8, KS = D / 16, NT = D / 8, TILE = KEY_TILE * STRIDE;
    // Each tile's keys are split over RESIDENT_LANES warps (16 keys each), and each of the
    // RESIDENT_WARPS / RESIDENT_LANES sets of warps takes every so-many-th tile.
    constexpr int LANES = RESIDENT_LANES, SETS = RESIDENT_WARPS / RESIDENT_LANES;
    constexpr int WARP_KEYS = KEY_TILE / LANES;
    extern __shared__ __align__(16) bf16 decode_tiles[];
    bf16* s_q = decode_tiles + 2 * TILE * max_tiles;

    u32 group = a.heads / a.kv_heads, chunks = (group + DECODE_GROUP - 1) / DECODE_GROUP;
    u32 kvh = blockIdx.y / chunks, chunk = blockIdx.y % chunks;
    u32 head0 = kvh * group + chunk * DECODE_GROUP;
    u32 g = min((u32)DECODE_GROUP, group - chunk * DECODE_GROUP);
    u32 r = blockIdx.z, token = a.row_start_token[r], pos = a.row_start_pos[r];
    u32 lo = (a.window != 0 && pos + 1 > a.window) ? pos + 1 - a.window : 0;
    u32 n_tiles = min((pos - lo) / KEY_TILE + 1, max_tiles);
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32* table = a.page_table + (u64)r * a.table_stride;

    // Every tile, the row's own position included (stale there until the prologue writes it):
    // earlier steps wrote the others, the step's first kernel the page table.
    for (u32 t = 0; t < n_tiles; ++t) {
        bf16* ks = decode_tiles + t * 2 * TILE;
        issue_kv_tile<D, RESIDENT_WARPS * 32>(ks, ks + TILE, a.k_cache, a.v_cache, table,
                                              a.page_tokens, a.kv_heads, kvh, lo + t * KEY_TILE, pos);
    }
    float cs[8], sn[8];
    if constexpr (D <= 64) rope_angles<D>(pos, a.inv_freq, cs, sn);
    pdl_begin();
    if constexpr (D > 64) rope_angles<D>(pos, a.inv_freq, cs, sn);
    // Prologue, as decode_attention's: q heads rotated into s_q (past the tiles, so before the
    // copies land: the new q/k/v's loads overlap their tail), then, once every copy has landed
    // (the row's own slot among them), k and v stored into the paged cache and into the row's
    // slot of the tiles.
    {
        u32 unit;
        uint4 bits = new_token_heads<D>(a, token, head0, g, kvh, cs, sn, s_q, unit);
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads();
        if (unit == g || unit == g + 1) {
            store_new_kv<D>(a, table, pos, kvh, unit, g, bits);
            u32 rel = pos - lo;
            bf16* tile = decode_tiles + (rel / KEY_TILE) * 2 * TILE + (unit == g ? 0 : TILE);
            *(uint4*)(tile + (rel % KEY_TILE) * STRIDE + (threadIdx.x % (D / 8)) * 8) = bits;
        }
    }
    __syncthreads();
    u32 qa[KS][4];
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
        ldmatrix_x4(qa[kk], s_q + ((lane & 7) + ((lane >> 3) & 1) * 8) * STRIDE + kk * 16 + (lane >> 4) * 8);

    // A warp's tiles are independent until the softmax: all their scores first (products that
    // overlap), one maximum and one sum, then P·V, instead of a chain of online-softmax steps
    // a tile.
    constexpr int WARP_TILES = RESIDENT_MAX_TILES / SETS;
    u32 t0 = warp / LANES, wk = (warp % LANES) * WARP_KEYS, tig = lane & 3;
    float sc[WARP_TILES][2][2], m = NEG_INF, l = 0.f;
#pragma unroll
    for (int j = 0; j < WARP_TILES; ++j) {
        u32 t = t0 + j * SETS;
        float s[2][4] = {};
        if (t < n_tiles)
#pragma unroll
            for (int n = 0; n < 2; ++n) score_keys8<D>(s[n], qa, decode_tiles + t * 2 * TILE, wk + n * 8, lane);
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                bool visible = t < n_tiles && lo + t * KEY_TILE + wk + n * 8 + tig * 2 + e <= pos;
                sc[j][n][e] = visible ? s[n][e] * a.scale_log2 : NEG_INF;
                m = fmaxf(m, sc[j][n][e]);
            }
    }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    float base = m == NEG_INF ? 0.f : m;
#pragma unroll
    for (int j = 0; j < WARP_TILES; ++j)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                sc[j][n][e] = fast_exp2(sc[j][n][e] - base);
                l += sc[j][n][e];
            }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
#pragma unroll
    for (int j = 0; j < WARP_TILES; ++j) {
        u32 t = t0 + j * SETS;
        if (t >= n_tiles) break;
        u32 pa[4] = {pack_bf16x2(sc[j][0][0], sc[j][0][1]), 0u, pack_bf16x2(sc[j][1][0], sc[j][1][1]), 0u};
        add_values16<D>(o, pa, decode_tiles + t * 2 * TILE + TILE, wk, lane);
    }
    __syncthreads();  // every warp is done with the tiles: their first holds the warps' states
    const float* s_m = store_warp_states<D, RESIDENT_WARPS>((float*)decode_tiles, g, m, l, o);
    __syncthreads();
    for (u32 idx = threadIdx.x; idx < g * D; idx += blockDim.x) {
        u32 h = idx / D, d = idx % D;
        float mt, lt, ot;
        merge_warp_states<D, RESIDENT_WARPS>(s_m, h, d, mt, lt, ot);
        a.out[(u64)token * a.heads * D + (u64)(head0 + h) * D + d] = f32_to_bf16(lt > 0.f ? ot / lt : 0.f);
    }
}

#define DECODE_RESIDENT_ENTRY(D)                                                                  \
    extern "C" __global__ void __launch_bounds__(RESIDENT_WARPS * 32, 1)                         \
        decode_attention_resident_d##D(                                                           \
            const bf16* qkv, const bf16* bias, const float* inv_freq, bf16* k_cache, bf16* v_cache,   \
            const u32* page_table, u32 table_stride, const u32* row_start_token,                  \
            const u32* row_start_pos, u32 heads, u32 kv_heads, u32 page_tokens, u32 window,       \
            float scale_log2, bf16* out, u32 max_tiles, const float* qkv_raw,                     \
            const float* norm_parts, u32 hidden, float eps) {                                     \
        DecodeArgs a = {};                                                                        \
        a.qkv_raw = qkv_raw, a.norm_parts = norm_parts, a.hidden = hidden, a.eps = eps;          \
        a.qkv = qkv, a.bias = bias, a.inv_freq = inv_freq, a.k_cache = k_cache;                  \
        a.v_cache = v_cache, a.page_table = page_table, a.table_stride = table_stride;           \
        a.row_start_token = row_start_token, a.row_start_pos = row_start_pos, a.heads = heads;   \
        a.kv_heads = kv_heads, a.page_tokens = page_tokens, a.window = window;                   \
        a.scale_log2 = scale_log2, a.out = out;                                                   \
        decode_attention_resident<D>(a, max_tiles);                                               \
    }
DECODE_RESIDENT_ENTRY(16)
DECODE_RESIDENT_ENTRY(32)
DECODE_RESIDENT_ENTRY(64)
DECODE_RESIDENT_ENTRY(128)

#define DECODE_ENTRY(D)                                                                           \
    extern "C" __global__ void __launch_bounds__(DECODE_WARPS * 32, DECODE_MIN_BLOCKS)          \
        decode_attention_d##D(                                                                    \
            const bf16* qkv, const bf16* bias, const float* inv_freq, bf16* k_cache, bf16* v_cache,   \
        const u32* page_table, u32 table_stride, const u32* row_start_token,                      \
        const u32* row_start_pos, u32 heads, u32 kv_heads, u32 page_tokens, u32 window,           \
        float scale_log2, bf16* out, float* o_part, float* lse_part, u32* done, u32 splits,       \
        u32 store_kv, const u32* row_items, u32 q_ready, const float* qkv_raw,                   \
        const float* norm_parts, u32 hidden, float eps) {                                          \
        DecodeArgs a = {qkv,     bias,           inv_freq,      k_cache, v_cache,                 \
                        page_table, table_stride, row_start_token, row_start_pos, heads,           \
                        kv_heads, page_tokens,   window,        scale_log2, out,                   \
                        o_part,  lse_part,       done,          splits,        store_kv,           \
                        row_items, q_ready,      qkv_raw,       norm_parts,    hidden, eps};       \
        decode_attention<D>(a);                                                                   \
    }
DECODE_ENTRY(16)
DECODE_ENTRY(32)
DECODE_ENTRY(64)
DECODE_ENTRY(128)
