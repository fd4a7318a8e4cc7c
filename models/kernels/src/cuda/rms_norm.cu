// RMSNorm over rows of n values on a GPU, forward and backward, one warp per row. Compiled at
// run time by NVRTC (models/ops/src/rms_norm_cuda.rs) after values.cuh.
//
// As transformers' LlamaRMSNorm (and `ops::fused::rms_norm`'s CPU loop): in f32, r = 1 / sqrt(
// mean(x^2) + eps), the normalised value x r held in the dtype (rounded to bf16 for bf16
// tensors) before the weight multiplies it:
//   forward:  y = w * held(x r)
//   backward: dx_j = r w_j g_j - r^3 x_j / n * sum_i g_i w_i x_i;  dw_i = sum over rows g_i held(x_i r)
// The backward's rows go to warps in a grid-stride loop; each block sums its rows' dw in shared
// memory (n floats), then adds it into an f32 buffer, which a last kernel writes out in the
// dtype after the rows of dx.

struct Norm {
  long long rows;
  int n;
  float eps;
};

template <typename T>
__device__ __forceinline__ float inv_rms(const T *x, const Norm &p, int lane) {
  float ss = 0.0f;
  for (int i = lane; i < p.n; i += 32) {
    float v = load(x, i);
    ss += v * v;
  }
  return 1.0f / sqrtf(warp_sum(ss) / p.n + p.eps);
}

template <typename T>
__device__ void norm_forward(const T *x, const T *w, T *y, Norm p) {
  long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= p.rows) return;
  int lane = threadIdx.x % 32;
  const T *xr = x + row * p.n;
  float r = inv_rms(xr, p, lane);
  for (int i = lane; i < p.n; i += 32) store(y, row * p.n + i, load(w, i) * as_held(load(xr, i) * r, x));
}

template <typename T>
__device__ void norm_backward_rows(const T *x, const T *w, const T *g, T *dx, float *dw, Norm p) {
  extern __shared__ float block_dw[];
  for (int i = threadIdx.x; i < p.n; i += blockDim.x) block_dw[i] = 0.0f;
  __syncthreads();
  int warps = blockDim.x / 32, lane = threadIdx.x % 32;
  for (long long row = (long long)blockIdx.x * warps + threadIdx.x / 32; row < p.rows; row += (long long)gridDim.x * warps) {
    const T *xr = x + row * p.n, *gr = g + row * p.n;
    float r = inv_rms(xr, p, lane);
    float dot = 0.0f;
    for (int i = lane; i < p.n; i += 32) {
      float xv = load(xr, i), gv = load(gr, i);
      dot += gv * load(w, i) * xv;
      atomicAdd(&block_dw[i], gv * as_held(xv * r, x));
    }
    float c = r * r * r * warp_sum(dot) / p.n;
    for (int i = lane; i < p.n; i += 32) store(dx, row * p.n + i, r * load(w, i) * load(gr, i) - c * load(xr, i));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < p.n; i += blockDim.x) atomicAdd(&dw[i], block_dw[i]);
}

// The summed dw in the dtype, as row `rows` of the backward's output.
template <typename T>
__device__ void norm_backward_weight(const float *dw, T *out, Norm p) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < p.n) store(out, p.rows * p.n + i, dw[i]);
}

#define INSTANTIATE(NAME, T)                                                                                      \
  extern "C" __global__ void rms_norm_forward_##NAME(const T *x, const T *w, T *y, Norm p) {                     \
    norm_forward<T>(x, w, y, p);                                                                                 \
  }                                                                                                              \
  extern "C" __global__ void rms_norm_backward_rows_##NAME(const T *x, const T *w, const T *g, T *out, float *dw, \
                                                          Norm p) {                                              \
    norm_backward_rows<T>(x, w, g, out, dw, p);                                                                  \
  }                                                                                                              \
  extern "C" __global__ void rms_norm_backward_weight_##NAME(const float *dw, T *out, Norm p) {                   \
    norm_backward_weight<T>(dw, out, p);                                                                         \
  }

INSTANTIATE(f32, float)
INSTANTIATE(bf16, bf16_t)
