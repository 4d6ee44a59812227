// Page copies between the working pool and snapshot buffers.
//
// The pool holds, per layer, K then V as [pages_total][page_elems]. A snapshot page is, for
// each layer in order, that page's K block then its V block (the CPU backend's layout), so a
// snapshot is independent of the pool's size and of where its pages were. Snapshot buffers are
// device memory or mapped pinned host memory; either is written by the same kernels. `copies`
// holds (snapshot page, pool page) pairs. Blocks move 16-byte words.

// grid: (copies, 2 · layers).
extern "C" __global__ void gather_pages(const uint4* __restrict__ pool, uint4* __restrict__ snapshot,
                                        const u32* __restrict__ copies, u32 pages_total,
                                        u32 page_words, u32 layers) {
    pdl_begin();
    u32 snap_page = copies[2 * blockIdx.x], pool_page = copies[2 * blockIdx.x + 1];
    u32 block = blockIdx.y;  // layer · 2 + (0 for K, 1 for V)
    const uint4* src = pool + ((u64)block * pages_total + pool_page) * page_words;
    uint4* dst = snapshot + ((u64)snap_page * 2 * layers + block) * page_words;
    for (u32 i = threadIdx.x; i < page_words; i += blockDim.x) dst[i] = src[i];
}

// The inverse of gather_pages. grid: (copies, 2 · layers).
extern "C" __global__ void scatter_pages(const uint4* __restrict__ snapshot, uint4* __restrict__ pool,
                                         const u32* __restrict__ copies, u32 pages_total,
                                         u32 page_words, u32 layers) {
    pdl_begin();
    u32 snap_page = copies[2 * blockIdx.x], pool_page = copies[2 * blockIdx.x + 1];
    u32 block = blockIdx.y;
    const uint4* src = snapshot + ((u64)snap_page * 2 * layers + block) * page_words;
    uint4* dst = pool + ((u64)block * pages_total + pool_page) * page_words;
    for (u32 i = threadIdx.x; i < page_words; i += blockDim.x) dst[i] = src[i];
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
