// Shared by every kernel file: element types, bf16 conversions and block reductions.
//
// The sources are compiled by NVRTC without the CUDA headers, so bf16 travels as its 16 bits
// and is converted with the sm_80 PTX instructions. Every .cu file is appended to this one and
// compiled as a single program (see engine/src/cuda/kernels.rs).

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NO_ROW 0xffffffffu
// Query heads one attention block serves (more per KV head are split over blocks).
#define MAX_GROUP 8
// Words of one sampled row's parameters (sampling.cu).
#define SAMPLE_PARAM_WORDS 6
#define NEG_INF __int_as_float(0xff800000)

// Programmatic dependent launch (sm_90 and newer), called first by every kernel: wait until the
// kernels before it have finished and their writes are visible, then let the next kernel launch.
// The next kernel's blocks are then resident and waiting when this one ends, so a chain of small
// kernels (a decode step at batch 1) loses most of the launch gap between them. Where the launch
// did not ask for it, or before sm_90, both are no-ops.
__device__ __forceinline__ void pdl_begin() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Lets the next kernel launch before this one's wait (its blocks then wait on this kernel's end,
// which waits on the kernel before): for a kernel whose wait is long and whose successor has
// loads to start.
__device__ __forceinline__ void pdl_trigger_early() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Thread block clusters (sm_90 and newer): the blocks of a cluster run at once on one GPC and
// read each other's shared memory. A launch without a cluster is a cluster of one block.
__device__ __forceinline__ u32 cluster_blocks() {
#if __CUDA_ARCH__ >= 900
    u32 n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
#else
    return 1;
#endif
}

// Every thread of every block of the cluster calls this: shared-memory writes before it are
// visible to the cluster's blocks after it.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The float at `p` in the shared memory of the cluster's block of rank `rank`.
__device__ __forceinline__ float cluster_load(const float* p, u32 rank) {
#if __CUDA_ARCH__ >= 900
    u32 local = (u32)__cvta_generic_to_shared(p), remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
#else
    return *p;
#endif
}

__device__ __forceinline__ float bf16_to_f32(bf16 v) {
    return __uint_as_float(((u32)v) << 16);
}

__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// Two floats as one bf16x2 word, `lo` in the low half (the lower index in memory).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float bf16x2_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16x2_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }

// Eight bf16 (one 16-byte load) as floats.
__device__ __forceinline__ void unpack8(uint4 v, float* out) {
    out[0] = bf16x2_lo(v.x); out[1] = bf16x2_hi(v.x);
    out[2] = bf16x2_lo(v.y); out[3] = bf16x2_hi(v.y);
    out[4] = bf16x2_lo(v.z); out[5] = bf16x2_hi(v.z);
    out[6] = bf16x2_lo(v.w); out[7] = bf16x2_hi(v.w);
}

// The 8 bf16 at `at` of `row` as floats, with the same 8 of `bias` added where there is one
// (Qwen2's q/k/v bias): how the prefill's append and decode attention both read a new token.
__device__ __forceinline__ void load8_biased(const bf16* row, const bf16* bias, u32 at, float* out) {
    unpack8(*(const uint4*)(row + at), out);
    if (bias) {
        float b[8];
        unpack8(*(const uint4*)(bias + at), b);
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] += b[i];
    }
}

__device__ __forceinline__ uint4 pack8(const float* v) {
    return make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                      pack_bf16x2(v[6], v[7]));
}

// The rotary embedding of the pair (x, y) = (element i, element i + head_dim / 2) by the angle
// whose cosine and sine are c and s: x·c − y·s and y·c + x·s, rounded the same way wherever a
// kernel rotates (explicit multiply-adds, not left to the compiler's contraction), so the k a
// prefill step appends and the k a decode step appends are the same bits.
__device__ __forceinline__ float rope_low(float x, float y, float c, float s) {
    return __fmaf_rn(x, c, -__fmul_rn(y, s));
}
__device__ __forceinline__ float rope_high(float x, float y, float c, float s) {
    return __fmaf_rn(y, c, __fmul_rn(x, s));
}

// c += a·b on the tensor cores: a 16×16 bf16 tile (row-major fragments), b 16×8 bf16 (column
// fragments), c 16×8 f32. Each element of c is its own row's and column's dot product: the
// other columns of b do not change its bits.
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ u32 warp_sum_u32(u32 v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block, returned to every thread. The order of additions is fixed by the launch
// shape, so a result never changes between runs. `scratch` holds 32 values.
__device__ float block_sum(float v, float* scratch) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.f;
    for (u32 w = 0; w < warps; ++w) total += scratch[w];
    return total;
}

__device__ double block_sum_f64(double v, double* scratch) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum_f64(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double total = 0.0;
    for (u32 w = 0; w < warps; ++w) total += scratch[w];
    return total;
}

__device__ u32 block_sum_u32(u32 v, u32* scratch) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum_u32(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    u32 total = 0;
    for (u32 w = 0; w < warps; ++w) total += scratch[w];
    return total;
}

// The largest value of `v` over the block, returned to every thread. `scratch` holds 32 values.
__device__ float block_max(float v, float* scratch) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float m = 0.f;
    for (u32 w = 0; w < warps; ++w) m = fmaxf(m, scratch[w]);
    return m;
}

// FP8 (e4m3) rows, one scale a row (fp8.cu says how the scale is chosen): e4m3's largest finite
// value, and a row's scale from its largest magnitude (1 for a row of zeros).
#define E4M3_MAX 448.f
__device__ __forceinline__ float e4m3_row_scale(float largest) {
    return largest > 0.f ? largest / E4M3_MAX : 1.f;
}

// Two floats as one e4m3x2 half-word, `lo` in the low byte (the lower index in memory): rounded
// to nearest even, saturated at ±448. Needs sm_89 or newer.
__device__ __forceinline__ u32 pack_e4m3x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    __trap();
    return 0;
#endif
}

// Eight floats times `inv` (a row's 1 / scale) as eight e4m3 bytes: what every kernel writing
// FP8 rows stores, so that fused and separate quantization give the same bytes.
__device__ __forceinline__ uint2 pack_e4m3x8(const float* v, float inv) {
    u32 w0 = pack_e4m3x2(v[0] * inv, v[1] * inv) | (pack_e4m3x2(v[2] * inv, v[3] * inv) << 16);
    u32 w1 = pack_e4m3x2(v[4] * inv, v[5] * inv) | (pack_e4m3x2(v[6] * inv, v[7] * inv) << 16);
    return make_uint2(w0, w1);
}

// A row the block holds in registers, CHUNKS chunks of 8 a thread (chunk `threadIdx.x + c ·
// blockDim.x` of `chunks`), its values already rounded to bf16, stored in FP8: the row's scale
// into `*scale`, its e4m3 bytes into `q`, as quantize_rows_e4m3 (fp8.cu) stores a bf16 row.
// Every thread of the block calls it.
template <int CHUNKS>
__device__ __forceinline__ void store_row_e4m3(const float (&v)[CHUNKS][8], u32 chunks,
                                               unsigned char* q, float* scale, float* scratch) {
    float largest = 0.f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        if (threadIdx.x + c * blockDim.x >= chunks) continue;
#pragma unroll
        for (int i = 0; i < 8; ++i) largest = fmaxf(largest, fabsf(v[c][i]));
    }
    float row_scale = e4m3_row_scale(block_max(largest, scratch));
    float inv = 1.f / row_scale;
    if (threadIdx.x == 0) *scale = row_scale;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        u32 chunk = threadIdx.x + c * blockDim.x;
        if (chunk < chunks) ((uint2*)q)[chunk] = pack_e4m3x8(v[c], inv);
    }
}

// 2^x with the multi-function unit's own instruction, subnormal results flushed to zero (what
// exp2f costs beyond it is handling those: softmax weights that small round to nothing in bf16
// and in an f32 sum anyway). exp2(-inf) is 0.
__device__ __forceinline__ float fast_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// Weights a decode step reads once (the gemvs' rows): loaded past L1 and marked first to leave
// L2, so that what the steps read again stays there: the KV cache above all, which a batch-1
// step of a small model otherwise reads from DRAM again behind every layer's weights (SmolLM2
// at batch 1 × 512: +21%, BENCHMARKS.md, "Weights marked first out of L2").
__device__ __forceinline__ u64 evict_first_policy() {
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}
__device__ __forceinline__ uint4 ld_weights(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "l"(evict_first_policy()));
    return v;
}
__device__ __forceinline__ uint2 ld_weights2(const void* p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;"
        : "=r"(v.x), "=r"(v.y)
        : "l"(p), "l"(evict_first_policy()));
    return v;
}

// Starts copying 16 bytes from global to shared memory (L2 only); waited for with
// cp.async.commit_group / wait_group.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    u32 dst = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem));
}

// The same for weights a step reads once (`ld_weights`).
__device__ __forceinline__ void cp_async16_weights(void* smem, const void* gmem) {
    u32 dst = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem),
                 "l"(evict_first_policy()));
}

// The same, or 16 zero bytes where `copy` is false (nothing is read from `gmem` then, but it
// must still be a valid address): no branch around the copy.
__device__ __forceinline__ void cp_async16_or_zero(void* smem, const void* gmem, bool copy) {
    u32 dst = (u32)__cvta_generic_to_shared(smem);
    u32 bytes = copy ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(bytes));
}
