// The fused training ops of `ops::fused` and `ops::cross_entropy` on a GPU, forward and backward:
// RMSNorm, SwiGLU, rope, cross-entropy.
// Compiled at run time by NVRTC (models/ops/src/fused_cuda.rs) after values.cuh.
//
// RMSNorm over rows of n values, one warp per row. As transformers' LlamaRMSNorm (and `ops::fused::rms_norm`'s CPU loop): in f32, r = 1 / sqrt(
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
  long long row = warp_row();
  if (row >= p.rows) return;
  int lane = threadIdx.x % 32;
  const T *xr = x + row * p.n;
  float r = inv_rms(xr, p, lane);
  for (int i = lane; i < p.n; i += 32) store(y, row * p.n + i, load(w, i) * as_held(load(xr, i) * r, x));
}

template <typename T>
__device__ void norm_backward_rows(const T *x, const T *w, const T *g, T *dx, float *dw, Norm p) {
  DYNAMIC_SHARED(float, block_dw);
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

// Values of a 16-byte load, and such loads and stores as f32: an elementwise kernel moving 2 bytes
// a thread and step reaches a fraction of the GPU's memory bandwidth that 16 does.
template <typename T>
struct Pack {
  static const int N = 16 / sizeof(T);
  union {
    uint4 raw;
    T values[N];
  };
  __device__ __forceinline__ void load_from(const T *p, long long i) {
    raw = *reinterpret_cast<const uint4 *>(p + i);
  }
  __device__ __forceinline__ float operator[](int k) const { return load(values, k); }
  __device__ __forceinline__ void set(int k, float v) { store(values, k, v); }
  __device__ __forceinline__ void store_to(T *p, long long i) const { *reinterpret_cast<uint4 *>(p + i) = raw; }
};

// Whether every pointer starts on a 16-byte boundary.
__device__ __forceinline__ bool aligned_16(const void *p) { return ((unsigned long long)p & 15u) == 0; }

// f(i) for the packs of values i .. i + Pack::N - 1 below n / Pack::N * Pack::N, in a grid-stride
// loop, where `aligned` (the same for the whole grid); then g(i) for each value left, one at a
// time (all of them where not aligned).
template <typename T, class F, class G>
__device__ __forceinline__ void elementwise(long long n, bool aligned, F f, G g) {
  const int P = Pack<T>::N;
  long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
  long long packed = aligned ? n / P * P : 0;
  for (long long i = first * P; i < packed; i += stride * P) f(i);
  for (long long i = packed + first; i < n; i += stride) g(i);
}

// SwiGLU, y = silu(a) b with s = sigmoid(a), over n values in a grid-stride loop; silu(a) held in
// the dtype before b multiplies it, as `silu(gate) * up` of candle's ops rounds it in bf16:
//   forward:  y = held(a s) b
//   backward: da = g b s (1 + a (1 - s)), db = g held(a s), written as da's n values, then db's.
// y at a value.
template <typename T>
__device__ __forceinline__ float swiglu_value(float av, float bv) {
  float s = 1.0f / (1.0f + expf(-av));
  return as_held(av * s, (const T *)0) * bv;
}

// (da, db) at a value, from a, b and g there.
template <typename T>
__device__ __forceinline__ float2 swiglu_grads(float av, float bv, float gv) {
  float s = 1.0f / (1.0f + expf(-av));
  return make_float2(gv * bv * s * (1.0f + av * (1.0f - s)), gv * as_held(av * s, (const T *)0));
}

template <typename T>
__device__ void swiglu_forward(const T *a, const T *b, T *y, long long n) {
  elementwise<T>(
      n, aligned_16(a) && aligned_16(b) && aligned_16(y),
      [&](long long i) {
        Pack<T> pa, pb, py;
        pa.load_from(a, i);
        pb.load_from(b, i);
#pragma unroll
        for (int k = 0; k < Pack<T>::N; k++) py.set(k, swiglu_value<T>(pa[k], pb[k]));
        py.store_to(y, i);
      },
      [&](long long i) { store(y, i, swiglu_value<T>(load(a, i), load(b, i))); });
}

template <typename T>
__device__ void swiglu_backward(const T *a, const T *b, const T *g, T *out, long long n) {
  elementwise<T>(
      n, aligned_16(a) && aligned_16(b) && aligned_16(g) && aligned_16(out) && aligned_16(out + n),
      [&](long long i) {
        Pack<T> pa, pb, pg, da, db;
        pa.load_from(a, i);
        pb.load_from(b, i);
        pg.load_from(g, i);
#pragma unroll
        for (int k = 0; k < Pack<T>::N; k++) {
          float2 d = swiglu_grads<T>(pa[k], pb[k], pg[k]);
          da.set(k, d.x);
          db.set(k, d.y);
        }
        da.store_to(out, i);
        db.store_to(out, n + i);
      },
      [&](long long i) {
        float2 d = swiglu_grads<T>(load(a, i), load(b, i), load(g, i));
        store(out, i, d.x);
        store(out, n + i, d.y);
      });
}

// Rotary embedding, halves rotated as transformers' rotate_half: row r of d = 2 half values is
// at position (r / heads) % seq in the (seq, half) tables (heads = 1 for heads-major rows). Each
// product held in the dtype before the sum, as candle's rope_slow rounds it in bf16; sign -1
// rotates back, which is the backward:
//   y_j = held(x_j c_j) + held(-x_{j+half} s_j),  y_{j+half} = held(x_{j+half} c_j) + held(x_j s_j)
struct Rotation {
  long long rows;
  int seq, heads, half;
  float sign;
};

template <typename T>
__device__ void rope(const T *x, const T *cos, const T *sin, T *y, Rotation p) {
  long long n = p.rows * p.half;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    long long row = i / p.half, at = row * 2 * p.half;
    int j = (int)(i % p.half), table = (int)((row / p.heads) % p.seq) * p.half + j;
    float c = load(cos, table), s = p.sign * load(sin, table);
    float x1 = load(x, at + j), x2 = load(x, at + j + p.half);
    store(y, at + j, as_held(x1 * c, x) + as_held(-(x2 * s), x));
    store(y, at + j + p.half, as_held(x2 * c, x) + as_held(x1 * s, x));
  }
}

// Cross-entropy of rows of `vocab` logits in f32 (transformers upcasts the logits), a block of
// threads per row:
//   forward:  loss = lse(x) - x[t], 0 where t < 0
//   backward: dx_j = g (exp(x_j - lse) - [j == t]), 0 where t < 0, with lse = loss + x[t]
// (the forward's loss and the upstream gradient g come as g_and_loss: (2, rows)).
struct Entropy {
  long long rows;
  int vocab;
};

// The max (MAX) or sum of v over the block.
template <bool MAX>
__device__ __forceinline__ float block_all(float v) {
  __shared__ float part[32];
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  v = MAX ? warp_max(v) : warp_sum(v);
  __syncthreads();  // the last call's readers are done with part
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = lane < (int)(blockDim.x / 32) ? part[lane] : (MAX ? NEG_INF : 0.0f);
  return MAX ? warp_max(v) : warp_sum(v);
}

template <typename T>
__device__ void cross_entropy_forward(const T *x, const long long *targets, float *loss, Entropy p) {
  long long row = blockIdx.x, t = targets[row];
  const T *xr = x + row * p.vocab;
  float mx = NEG_INF;
  for (int j = threadIdx.x; j < p.vocab; j += blockDim.x) mx = fmaxf(mx, load(xr, j));
  mx = block_all<true>(mx);
  float sum = 0.0f;
  for (int j = threadIdx.x; j < p.vocab; j += blockDim.x) sum += expf(load(xr, j) - mx);
  sum = block_all<false>(sum);
  if (threadIdx.x == 0) loss[row] = t < 0 ? 0.0f : mx + logf(sum) - load(xr, t);
}

template <typename T>
__device__ void cross_entropy_backward(const T *x, const long long *targets, const float *g_and_loss, T *dx, Entropy p) {
  long long row = blockIdx.x, t = targets[row], at = row * p.vocab;
  float g = t < 0 ? 0.0f : g_and_loss[row], lse = t < 0 ? 0.0f : g_and_loss[p.rows + row] + load(x, at + t);
  for (int j = threadIdx.x; j < p.vocab; j += blockDim.x)
    store(dx, at + j, t < 0 ? 0.0f : g * (expf(load(x, at + j) - lse) - (j == t ? 1.0f : 0.0f)));
}

// The embedding table's gradient (f32 rows of n values) from the upstream gradient g (tokens x n)
// of a lookup, without atomics (the same bits every run): the host sorts the tokens by id, and each
// distinct id's run of them, order[starts[r]] .. order[starts[r + 1] - 1], is summed in that order
// into row rows[r] (the caller zeroes the rest). `runs` is (order, starts, rows) in one buffer of
// tokens + 2 * count + 1 values. Grid (count, ceil(n / blockDim.x)).
template <typename T>
__device__ void embedding_backward(const T *g, const unsigned *runs, float *dw, int tokens, int count, int n) {
  int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= n) return;
  const unsigned *order = runs, *starts = runs + tokens, *rows = starts + count + 1;
  unsigned r = blockIdx.x;
  float sum = 0.0f;
  for (unsigned j = starts[r]; j < starts[r + 1]; j++) sum += load(g, (long long)order[j] * n + c);
  dw[(long long)rows[r] * n + c] = sum;
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
  }                                                                                                              \
  extern "C" __global__ void embedding_backward_##NAME(const T *g, const unsigned *runs, float *dw, int tokens,  \
                                                       int count, int n) {                                       \
    embedding_backward<T>(g, runs, dw, tokens, count, n);                                                        \
  }                                                                                                              \
  extern "C" __global__ void swiglu_forward_##NAME(const T *a, const T *b, T *y, long long n) {                    \
    swiglu_forward<T>(a, b, y, n);                                                                               \
  }                                                                                                              \
  extern "C" __global__ void swiglu_backward_##NAME(const T *a, const T *b, const T *g, T *out, long long n) {     \
    swiglu_backward<T>(a, b, g, out, n);                                                                         \
  }                                                                                                              \
  extern "C" __global__ void rope_##NAME(const T *x, const T *cos, const T *sin, T *y, Rotation p) {              \
    rope<T>(x, cos, sin, y, p);                                                                                  \
  }                                                                                                              \
  extern "C" __global__ void cross_entropy_forward_##NAME(const T *x, const long long *targets, float *loss,      \
                                                          Entropy p) {                                           \
    cross_entropy_forward<T>(x, targets, loss, p);                                                               \
  }                                                                                                              \
  extern "C" __global__ void cross_entropy_backward_##NAME(const T *x, const long long *targets,                 \
                                                           const float *g_and_loss, T *dx, Entropy p) {          \
    cross_entropy_backward<T>(x, targets, g_and_loss, dx, p);                                                    \
  }

INSTANTIATE(f32, float)
INSTANTIATE(bf16, bf16_t)
