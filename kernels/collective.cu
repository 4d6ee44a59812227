// Tensor parallelism's exchanges between the ranks of one process, through peer-to-peer memory:
// another GPU's memory over NVLink, or the same GPU's when two ranks share one (tests).
//
// Every rank launches the same sequence of exchanges, each on its own stream. An exchange is a
// read of the peers' buffers between two barriers. At the first, block b of every rank says its
// inputs are ready (kernels earlier on its stream wrote them); between the two, block b reads
// its share of every rank's input; at the second, it says it has finished reading, so that no
// rank overwrites an input a peer still reads. A barrier is numbered by an epoch that each rank
// keeps on its own device, one per block, counted up by the exchange itself: a replayed graph
// needs no new arguments. Block b of a rank only ever waits for block b of its peers, so an
// exchange is TP_BLOCKS independent rendezvous, all launched with TP_BLOCKS blocks.
//
// A peer that never arrives (its rank failed before launching) would hold a barrier forever:
// after TP_TIMEOUT_NS a waiting block gives up, sets `timed_out` (with where it waited) and goes
// on, and the host fails the step and resets every rank's signals and epochs.

#define TP_MAX_RANKS 8
#define TP_BLOCKS 32
#define TP_TIMEOUT_NS 10000000000ull

// The group as one rank sees it, in device memory: every rank's signal area and exchanged
// buffers, rank order.
struct TpPeers {
    // Each [2 phases][TP_BLOCKS][TP_MAX_RANKS] words: slot (phase, b, r) is set by rank r.
    u32* signals[TP_MAX_RANKS];
    // Each rank's sublayer output, bf16, the same shape on every rank.
    const bf16* partials[TP_MAX_RANKS];
    // Each rank's slice of the logits, [rows][vocab / world] f32.
    const float* logits[TP_MAX_RANKS];
};

__device__ __forceinline__ void tp_store_release(u32* at, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(at), "r"(v) : "memory");
}

__device__ __forceinline__ u32 tp_load_acquire(const u32* at) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(at) : "memory");
    return v;
}

__device__ __forceinline__ u64 tp_now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// Block-wide rendezvous of block blockIdx.x of every rank, phase 0 or 1 of exchange `epoch`.
// Everything the block did before it is visible to the peers after it, and the reverse.
__device__ void tp_barrier(const TpPeers* peers, u32 rank, u32 world, u32 phase, u32 epoch,
                           u32* timed_out) {
    __syncthreads();
    if (threadIdx.x < world) {
        u32 peer = threadIdx.x;
        u32 slot = (phase * TP_BLOCKS + blockIdx.x) * TP_MAX_RANKS;
        tp_store_release(peers->signals[peer] + slot + rank, epoch);
        const u32* theirs = peers->signals[rank] + slot + peer;
        u64 start = tp_now_ns();
        u32 seen;
        while ((seen = tp_load_acquire(theirs)) != epoch) {
            if (tp_now_ns() - start > TP_TIMEOUT_NS) {
                // The first to give up says where: the epoch, phase, block, peer, and what
                // the peer's slot held.
                if (atomicCAS(timed_out, 0u, 1u) == 0u) {
                    timed_out[1] = epoch;
                    timed_out[2] = (phase << 24) | (blockIdx.x << 8) | peer;
                    timed_out[3] = seen;
                }
                break;
            }
        }
    }
    __syncthreads();
}

// residual[i] += sum over ranks (in rank order) of partials[rank][i], for `n` elements (a
// multiple of 8). The same additions in the same order on every rank: every rank's residual
// stream stays the same bits.
extern "C" __global__ void tp_all_reduce_add(const TpPeers* __restrict__ peers,
                                             u32* __restrict__ epochs, u32* timed_out,
                                             float* __restrict__ residual, u32 n, u32 rank,
                                             u32 world) {
    pdl_begin();
    u32 epoch = epochs[blockIdx.x] + 1;
    tp_barrier(peers, rank, world, 0, epoch, timed_out);
    for (u32 c = blockIdx.x * blockDim.x + threadIdx.x; c < n / 8; c += gridDim.x * blockDim.x) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (u32 r = 0; r < world; ++r) {
            float v[8];
            unpack8(((const uint4*)peers->partials[r])[c], v);
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[k] += v[k];
        }
        float4* out = (float4*)residual + 2 * c;
        float4 a = out[0], b = out[1];
        out[0] = make_float4(a.x + acc[0], a.y + acc[1], a.z + acc[2], a.w + acc[3]);
        out[1] = make_float4(b.x + acc[4], b.y + acc[5], b.z + acc[6], b.w + acc[7]);
    }
    tp_barrier(peers, rank, world, 1, epoch, timed_out);
    if (threadIdx.x == 0) epochs[blockIdx.x] = epoch;
}

// Rank 0 gathers every rank's slice of `rows` rows of logits ([rows][cols] each) into its
// `logits` ([rows][cols·world]); the other ranks only keep the barriers.
extern "C" __global__ void tp_gather_logits(const TpPeers* __restrict__ peers,
                                            u32* __restrict__ epochs, u32* timed_out,
                                            float* __restrict__ logits, u32 rows, u32 cols,
                                            u32 rank, u32 world) {
    pdl_begin();
    u32 epoch = epochs[blockIdx.x] + 1;
    tp_barrier(peers, rank, world, 0, epoch, timed_out);
    if (rank == 0) {
        u64 per_rank = (u64)rows * cols;
        u64 total = per_rank * world;
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
             i += (u64)gridDim.x * blockDim.x) {
            u32 r = (u32)(i / per_rank);
            u64 within = i - (u64)r * per_rank;
            u64 row = within / cols, col = within - row * cols;
            logits[row * cols * world + (u64)r * cols + col] = peers->logits[r][within];
        }
    }
    tp_barrier(peers, rank, world, 1, epoch, timed_out);
    if (threadIdx.x == 0) epochs[blockIdx.x] = epoch;
}
