// Weights drawn on the device from a seed, for benchmarking model shapes without a checkpoint.
//
// Element i of a tensor (row-major) is a pure function of (seed, i): a SplitMix64 hash mapped to a uniform
// in [lo, hi), so the same seed gives the same weights on any device and launch shape.

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// `out` is the window of `rows` × `cols` at (`row0`, `col0`) of a tensor `full_cols` wide, so a
// tensor-parallel rank draws exactly its slice of the tensor one device would draw whole.
extern "C" __global__ void fill_uniform_bf16(bf16* __restrict__ out, u64 rows, u64 cols,
                                             u64 row0, u64 col0, u64 full_cols, u64 seed,
                                             float lo, float hi) {
    pdl_begin();
    u64 n = rows * cols;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        u64 r = i / cols, c = i - r * cols;
        u64 at = (row0 + r) * full_cols + col0 + c;
        float u = (float)(splitmix64(seed ^ splitmix64(at)) >> 40) * (1.f / 16777216.f);
        out[i] = f32_to_bf16(lo + (hi - lo) * u);
    }
}
