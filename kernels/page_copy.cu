// Page copies between the working pool and snapshot buffers.
//
// The pool holds, per layer, K then V as [pages_total][page_elems]. A snapshot page is, for
// each layer in order, that page's K block then its V block (the CPU backend's layout), so a
// snapshot is independent of the pool's size and of where its pages were. Snapshot buffers are
// device memory or mapped pinned host memory; either is written by the same kernels. `copies`
// holds (snapshot page, pool page) pairs. Blocks move 16-byte words, and checksum what they move.

// Checksums (cache/src/checksum.rs): the sum of a block is Σ mix(wᵢ ⊕ (i + 1)·φ) mod 2⁶⁴ over
// its 64-bit words. The copies compute it from the values they move, so a check costs no pass
// of its own. `sums` holds one per block of each arena page: page p's at [p · 2 · layers ..].
#define PLACE_STEP 0x9E3779B97F4A7C15ull

__device__ __forceinline__ u64 mix64(u64 x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// The terms of 16-byte word `i` of a block (its 64-bit words 2i and 2i + 1).
__device__ __forceinline__ u64 word_terms(uint4 v, u32 i) {
    u64 lo = (u64)v.x | ((u64)v.y << 32), hi = (u64)v.z | ((u64)v.w << 32);
    return mix64(lo ^ (u64)(2 * (u64)i + 1) * PLACE_STEP) + mix64(hi ^ (u64)(2 * (u64)i + 2) * PLACE_STEP);
}

// The block's total in thread 0 (every thread calls it).
__device__ __forceinline__ u64 block_total(u64 sum) {
    __shared__ u64 partial[32];
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (u32 w = 1; w < blockDim.x / 32; ++w) sum += partial[w];
    }
    return sum;
}

// Copies one block of `words` 16-byte words and returns its sum, in thread 0 (every thread calls
// it): the gather and the scatter differ only in where the block goes and what the sum is for.
__device__ __forceinline__ u64 copy_block(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                          u32 words) {
    u64 sum = 0;
    for (u32 i = threadIdx.x; i < words; i += blockDim.x) {
        uint4 v = src[i];
        dst[i] = v;
        sum += word_terms(v, i);
    }
    return block_total(sum);
}

// Pool pages into snapshot pages, with the sum of every block written. grid: (copies, 2 · layers).
extern "C" __global__ void gather_pages(const uint4* __restrict__ pool, uint4* __restrict__ snapshot,
                                        const u32* __restrict__ copies, u32 pages_total,
                                        u32 page_words, u32 layers, u64* __restrict__ sums) {
    pdl_begin();
    u32 snap_page = copies[2 * blockIdx.x], pool_page = copies[2 * blockIdx.x + 1];
    u32 block = blockIdx.y;  // layer · 2 + (0 for K, 1 for V)
    const uint4* src = pool + ((u64)block * pages_total + pool_page) * page_words;
    uint4* dst = snapshot + ((u64)snap_page * 2 * layers + block) * page_words;
    u64 sum = copy_block(src, dst, page_words);
    if (threadIdx.x == 0) sums[(u64)snap_page * 2 * layers + block] = sum;
}

// The inverse of gather_pages, checking each block read against its stored sum: a mismatch sets
// `*bad`, and the restore is refused by the host (cache/src/checksum.rs). grid: (copies, 2 · layers).
extern "C" __global__ void scatter_pages(const uint4* __restrict__ snapshot, uint4* __restrict__ pool,
                                         const u32* __restrict__ copies, u32 pages_total,
                                         u32 page_words, u32 layers, const u64* __restrict__ sums,
                                         u32* __restrict__ bad) {
    pdl_begin();
    u32 snap_page = copies[2 * blockIdx.x], pool_page = copies[2 * blockIdx.x + 1];
    u32 block = blockIdx.y;
    const uint4* src = snapshot + ((u64)snap_page * 2 * layers + block) * page_words;
    uint4* dst = pool + ((u64)block * pages_total + pool_page) * page_words;
    u64 sum = copy_block(src, dst, page_words);
    if (threadIdx.x == 0 && sum != sums[(u64)snap_page * 2 * layers + block]) *bad = 1;
}

// Copies whole pool pages to other pool pages: `copies` holds (from, to) pairs, no page both a
// source and a target. How a request's other choices take the prompt's KV from the first one.
// grid: (copies, 2 · layers).
extern "C" __global__ void clone_pages(uint4* __restrict__ pool, const u32* __restrict__ copies,
                                       u32 pages_total, u32 page_words) {
    pdl_begin();
    u32 from = copies[2 * blockIdx.x], to = copies[2 * blockIdx.x + 1];
    u64 block = (u64)blockIdx.y * pages_total;
    const uint4* src = pool + (block + from) * page_words;
    uint4* dst = pool + (block + to) * page_words;
    for (u32 i = threadIdx.x; i < page_words; i += blockDim.x) dst[i] = src[i];
}
