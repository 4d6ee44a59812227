// Next-token choice on the GPU: argmax, or temperature with top-k, top-p and min-p and a draw.
//
// One block of SAMPLE_THREADS per row, over the row's f32 logits. Greedy rows take the largest
// logit (ties to the lowest id, NaN never wins, 0 when nothing is above -inf), as the host
// sampler does. Sampled rows follow the host sampler's order: top-k by logit, softmax weights
// relative to the largest logit, top-p by weight, min-p, then a draw with the uniform the host
// sampler supplied. Each cut is found without sorting: bisection over the ordered bits of the
// cut value, counting (or weighing) what lies above it with fixed-order block reductions, then
// a bisection over token ids among ties, so the kept set is exactly the host's ranking (higher
// value first, then lower id). The draw walks the kept tokens in id order. Every sum has a fixed
// order, so the same logits and uniform always give the same token.
//
// The row's logits are overwritten: first with ranking keys, then with the weights (0 for
// dropped tokens).

#define SAMPLE_THREADS 1024

// Per-row parameters (SAMPLE_PARAM_WORDS): temperature (f32 bits), top_k, top_p (f32 bits),
// min_p (f32 bits), uniform (f64 bits, low word first).

// Float bits mapped so that unsigned order is float order.
__device__ __forceinline__ u32 ordered(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ bool drawable(float v) { return v > NEG_INF; }

struct Best {
    float value;
    u32 token;
};

__device__ __forceinline__ void consider(Best& b, float v, u32 i) {
    if (v > b.value) b.value = v, b.token = i;
}

// Each thread's best, in increasing id order. Rows of a multiple of 4 logits are read as float4,
// four loads in flight at a time: a 128k-token row is one block's work, so latency dominates.
__device__ Best thread_argmax(const float* logits, u32 vocab) {
    Best b = {NEG_INF, NO_ROW};
    if (vocab % 4 != 0) {
        for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) consider(b, logits[i], i);
        return b;
    }
    const float4* v4 = (const float4*)logits;
    u32 n = vocab / 4, stride = blockDim.x;
    for (u32 i = threadIdx.x; i < n; i += 4 * stride) {
        float4 x[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) x[j] = i + j * stride < n ? v4[i + j * stride] : make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            u32 at = 4 * (i + j * stride);
            consider(b, x[j].x, at);
            consider(b, x[j].y, at + 1);
            consider(b, x[j].z, at + 2);
            consider(b, x[j].w, at + 3);
        }
    }
    return b;
}

__device__ Best block_argmax(const float* logits, u32 vocab, float* fs, u32* us) {
    Best b = thread_argmax(logits, vocab);
    for (int o = 16; o > 0; o >>= 1) {
        float v = __shfl_xor_sync(0xffffffffu, b.value, o);
        u32 t = __shfl_xor_sync(0xffffffffu, b.token, o);
        if (v > b.value || (v == b.value && t < b.token)) b.value = v, b.token = t;
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) fs[threadIdx.x >> 5] = b.value, us[threadIdx.x >> 5] = b.token;
    __syncthreads();
    b.value = NEG_INF, b.token = NO_ROW;
    for (u32 w = 0; w < blockDim.x / 32; ++w)
        if (fs[w] > b.value || (fs[w] == b.value && us[w] < b.token)) b.value = fs[w], b.token = us[w];
    if (b.token == NO_ROW) b.token = 0;
    return b;
}

// Float bits of a key written by `ordered`.
__device__ __forceinline__ float unordered(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Replaces each logit, in place, by its ranking key: 0 for tokens that cannot be drawn or fall
// outside the top_k (by value, then lower id), ordered(logit) otherwise.
__device__ void keep_top_k(u32* keys, u32 vocab, u32 top_k, u32* us) {
    const float* logits = (const float*)keys;
    u32 n = 0;
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = logits[i];
        keys[i] = drawable(v) ? ordered(fminf(v, 3.402823466e38f)) : 0u;
        n += drawable(v);
    }
    n = block_sum_u32(n, us);
    if (top_k == 0 || top_k >= n) return;
    u32 lo = 1, hi = 0xffffffffu;  // largest key value with at least top_k keys at or above it
    while (lo < hi) {
        u32 mid = lo + (hi - lo + 1) / 2, c = 0;
        for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) c += keys[i] >= mid;
        if (block_sum_u32(c, us) >= top_k) lo = mid; else hi = mid - 1;
    }
    u32 above = 0;
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) above += keys[i] > lo;
    u32 need = top_k - block_sum_u32(above, us);
    u32 a = 0, b = vocab - 1;  // smallest id cut keeping `need` of the ties
    while (a < b) {
        u32 mid = a + (b - a) / 2, c = 0;
        for (u32 i = threadIdx.x; i <= mid && i < vocab; i += blockDim.x) c += keys[i] == lo;
        if (block_sum_u32(c, us) >= need) b = mid; else a = mid + 1;
    }
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x)
        if (keys[i] < lo || (keys[i] == lo && i > a)) keys[i] = 0;
}

// Keeps the nucleus: the fewest weights, by rank, whose mass reaches top_p of the total.
__device__ void keep_top_p(float* w, u32 vocab, float top_p, double* ds) {
    double total = 0.0;
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) total += w[i];
    double target = (double)top_p * block_sum_f64(total, ds);
    u32 lo = 1, hi = 0x7f800000u;  // weights are finite and >= 0, so their bits are ordered
    while (lo < hi) {
        u32 mid = lo + (hi - lo + 1) / 2;
        double mass = 0.0;
        for (u32 i = threadIdx.x; i < vocab; i += blockDim.x)
            if (__float_as_uint(w[i]) >= mid) mass += w[i];
        if (block_sum_f64(mass, ds) >= target) lo = mid; else hi = mid - 1;
    }
    double above = 0.0;
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x)
        if (__float_as_uint(w[i]) > lo) above += w[i];
    double need = target - block_sum_f64(above, ds);
    u32 a = 0, b = vocab - 1;
    while (a < b) {
        u32 mid = a + (b - a) / 2;
        double mass = 0.0;
        for (u32 i = threadIdx.x; i <= mid && i < vocab; i += blockDim.x)
            if (__float_as_uint(w[i]) == lo) mass += w[i];
        if (block_sum_f64(mass, ds) >= need) b = mid; else a = mid + 1;
    }
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
        u32 bits = __float_as_uint(w[i]);
        if (bits < lo || (bits == lo && i > a)) w[i] = 0.f;
    }
}

// Draws a kept token with probability proportional to its weight, walking ids in order: each
// thread owns a contiguous range, prefix sums over threads find the range holding the cut.
__device__ u32 draw(const float* w, u32 vocab, double uniform, double* ds, u32* us) {
    u32 per = (vocab + blockDim.x - 1) / blockDim.x;
    u32 begin = min(threadIdx.x * per, vocab), end = min(begin + per, vocab);
    double mine = 0.0;
    u32 last_kept = 0;
    bool any = false;
    for (u32 i = begin; i < end; ++i)
        if (w[i] > 0.f) mine += w[i], last_kept = i, any = true;
    __syncthreads();
    ds[threadIdx.x] = mine;
    us[threadIdx.x] = any ? last_kept + 1 : 0;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        u32 last = 0;
        for (u32 t = 0; t < blockDim.x; ++t) total += ds[t], last = max(last, us[t]);
        double threshold = uniform * total, before = 0.0;
        u32 pick = last == 0 ? 0 : last - 1;  // `uniform * total` may round up to the total
        for (u32 t = 0; t < blockDim.x; ++t) {
            if (before + ds[t] > threshold) {
                double mass = before;
                u32 b = min(t * per, vocab), e = min(b + per, vocab);
                for (u32 i = b; i < e; ++i) {
                    mass += w[i];
                    if (w[i] > 0.f && mass > threshold) { pick = i; break; }
                }
                break;
            }
            before += ds[t];
        }
        us[0] = pick;
    }
    __syncthreads();
    return us[0];
}

// grid: one block per sampled row; `logits` row i is sampled with params row i. `mask`, when
// not null, holds a bitmask of ceil(vocab / 32) words per row (bit t of word t / 32 set: token
// t may come next, a grammar's verdict); other tokens' logits become -inf first. The picks go to
// `tokens` (page-locked host memory the host reads) and to `fed` (device memory), from which
// the next step's `unpack_step` takes the tokens of rows that follow these picks. With `slot` not
// null the picks go to `tokens + *slot * stride`: a step's slot of the host's picks buffer, which
// its metadata names (a decode graph that samples is replayed for either slot).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows(float* __restrict__ logits, u32 vocab, const u32* __restrict__ params,
                u32* __restrict__ tokens, const u32* __restrict__ mask, u32* __restrict__ fed,
                const u32* __restrict__ slot, u32 stride) {
    pdl_begin();
    if (slot != nullptr) tokens += *slot * stride;
    __shared__ float fs[32];
    __shared__ u32 us[SAMPLE_THREADS];
    __shared__ double ds[SAMPLE_THREADS];
    float* row = logits + (u64)blockIdx.x * vocab;
    if (mask != nullptr) {
        const u32* allowed = mask + (u64)blockIdx.x * ((vocab + 31) / 32);
        for (u32 i = threadIdx.x; i < vocab; i += blockDim.x)
            if (!((allowed[i >> 5] >> (i & 31)) & 1u)) row[i] = NEG_INF;
        __syncthreads();
    }
    const u32* p = params + blockIdx.x * SAMPLE_PARAM_WORDS;
    float temperature = __uint_as_float(p[0]), top_p = __uint_as_float(p[2]);
    float min_p = __uint_as_float(p[3]);
    double uniform = __hiloint2double((int)p[5], (int)p[4]);
    Best best = block_argmax(row, vocab, fs, us);
    if (temperature == 0.f || best.value == NEG_INF) {
        if (threadIdx.x == 0) tokens[blockIdx.x] = fed[blockIdx.x] = best.token;
        return;
    }
    u32* keys = (u32*)row;
    keep_top_k(keys, vocab, p[1], us);
    float max = fminf(best.value, 3.402823466e38f);
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x)
        row[i] = keys[i] != 0 ? expf((unordered(keys[i]) - max) / temperature) : 0.f;
    if (top_p < 1.f) keep_top_p(row, vocab, top_p, ds);
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x)
        if (!(row[i] > 0.f && row[i] >= min_p)) row[i] = 0.f;
    u32 token = draw(row, vocab, uniform, ds, us);
    if (threadIdx.x == 0) tokens[blockIdx.x] = fed[blockIdx.x] = token;
}
