// What every source of ours starts with (kernels::cuda puts it before each one: NVRTC compiles
// a source without CUDA's headers): bf16 values as their bits, loads and stores in f32, warp sums.

typedef unsigned short bf16_t;

#define NEG_INF __int_as_float(0xff800000u)

// A block's shared memory sized at launch (the C++ emulation of tests/cuda_emulation hands out
// its own buffer: `extern __shared__` has no C++ spelling).
#ifdef FSDP_CUDA_EMULATION
#define DYNAMIC_SHARED(T, NAME) T *NAME = emulation::dynamic_shared<T>()
#else
#define DYNAMIC_SHARED(T, NAME) extern __shared__ T NAME[]
#endif

__device__ __forceinline__ float load(const float *p, long long i) { return p[i]; }
__device__ __forceinline__ float load(const bf16_t *p, long long i) { return __uint_as_float(((unsigned int)p[i]) << 16); }

__device__ __forceinline__ void store(float *p, long long i, float v) { p[i] = v; }
// Round to nearest even, as candle's casts do; a NaN stays a (quiet) NaN.
__device__ __forceinline__ void store(bf16_t *p, long long i, float v) {
  unsigned int u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    p[i] = (bf16_t)((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  p[i] = (bf16_t)(u >> 16);
}

// The row of the calling warp where each warp of the grid takes one row.
__device__ __forceinline__ long long warp_row() { return (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; }

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}


// v as a T holds it: rounded to bf16 (nearest even) and back, or v itself.
__device__ __forceinline__ float as_held(float v, const float *) { return v; }
__device__ __forceinline__ float as_held(float v, const bf16_t *) {
  bf16_t b;
  store(&b, 0, v);
  return load(&b, 0);
}
