// Weights drawn on the device from a seed, for benchmarking model shapes without a checkpoint.
//
// Element i of a tensor is a pure function of (seed, i): a SplitMix64 hash mapped to a uniform
// in [lo, hi), so the same seed gives the same weights on any device and launch shape.

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

extern "C" __global__ void fill_uniform_bf16(bf16* __restrict__ out, u64 n, u64 seed, float lo,
                                             float hi) {
    pdl_begin();
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float u = (float)(splitmix64(seed ^ splitmix64(i)) >> 40) * (1.f / 16777216.f);
        out[i] = f32_to_bf16(lo + (hi - lo) * u);
    }
}
