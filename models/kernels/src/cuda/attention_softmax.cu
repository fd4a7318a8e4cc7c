// The softmax of eager attention on a GPU, forward and backward, one warp per row of scores.
// Compiled at run time by NVRTC (models/ops/src/attention_softmax_cuda.rs) after values.cuh
// (no header of CUDA's: bf16 values are handled as their bits).
//
// Row r of the scores (rows = batch * heads * T, each S long) belongs to query t = r % T of
// (batch, head) = (r / T / heads, r / T % heads). x = score * scale + mask, in f32, like
// `softmax(to_f32(q kᵀ · scale + mask))` composed from candle's ops, without the rounding of
// the scaled and masked scores to the compute dtype that composition does.
//   forward:  p = exp(x - max) / sum, written in the scores' dtype.
//   backward: ds = p * (dp - delta) * scale, p recomputed in f32 from the scores (the row's
//             max and sum again: a row is a few KB, so the passes after the first read it from
//             the cache, not memory); delta = rowsum(dout * out), f32 per row.
// A row masked everywhere (max = -inf) has p = 0 (composition gives NaN there).

// Where a row lives: its scores and its mask row (mask strides over batch and head may be 0:
// a broadcast mask; its rows are S apart).
struct Rows {
  long long rows;
  int s_len, t_len, heads;
  long long mask_batch_stride, mask_head_stride;
  float scale;
};

template <typename T>
__device__ __forceinline__ const T *mask_row(const T *mask, const Rows &g, long long row) {
  if (!mask) return 0;
  long long bh = row / g.t_len, t = row % g.t_len;
  return mask + (bh / g.heads) * g.mask_batch_stride + (bh % g.heads) * g.mask_head_stride + t * g.s_len;
}

template <typename T>
__device__ __forceinline__ float logit(const T *x, const T *m, int j, float scale) {
  return load(x, j) * scale + (m ? load(m, j) : 0.0f);
}

// (max, 1 / sum) of row `row`'s x, for the calling warp.
template <typename T>
__device__ __forceinline__ float2 row_stats(const T *x, const T *m, const Rows &g, int lane) {
  float mx = NEG_INF;
  for (int j = lane; j < g.s_len; j += 32) mx = fmaxf(mx, logit(x, m, j, g.scale));
  mx = warp_max(mx);
  float sum = 0.0f;
  if (mx != NEG_INF)
    for (int j = lane; j < g.s_len; j += 32) sum += expf(logit(x, m, j, g.scale) - mx);
  sum = warp_sum(sum);
  return make_float2(mx, sum > 0.0f ? 1.0f / sum : 0.0f);
}

template <typename T>
__device__ __forceinline__ float probability(const T *x, const T *m, int j, const Rows &g, float2 stats) {
  return stats.x == NEG_INF ? 0.0f : expf(logit(x, m, j, g.scale) - stats.x) * stats.y;
}

template <typename T>
__device__ void softmax_forward(const T *scores, const T *mask, T *probs, Rows g) {
  long long row = warp_row();
  if (row >= g.rows) return;
  int lane = threadIdx.x % 32;
  const T *x = scores + row * g.s_len;
  const T *m = mask_row(mask, g, row);
  float2 stats = row_stats(x, m, g, lane);
  for (int j = lane; j < g.s_len; j += 32) store(probs, row * g.s_len + j, probability(x, m, j, g, stats));
}

template <typename T>
__device__ void softmax_backward(const T *scores, const T *mask, const T *dp, const float *delta, T *ds, Rows g) {
  long long row = warp_row();
  if (row >= g.rows) return;
  int lane = threadIdx.x % 32;
  const T *x = scores + row * g.s_len;
  const T *m = mask_row(mask, g, row);
  float2 stats = row_stats(x, m, g, lane);
  float d = delta[row];
  for (int j = lane; j < g.s_len; j += 32) {
    long long i = row * g.s_len + j;
    store(ds, i, probability(x, m, j, g, stats) * (load(dp, i) - d) * g.scale);
  }
}

#define INSTANTIATE(NAME, T)                                                                                        \
  extern "C" __global__ void attention_softmax_forward_##NAME(const T *scores, const T *mask, T *probs, Rows g) {  \
    softmax_forward<T>(scores, mask, probs, g);                                                                    \
  }                                                                                                                \
  extern "C" __global__ void attention_softmax_backward_##NAME(const T *scores, const T *mask, const T *dp,        \
                                                               const float *delta, T *ds, Rows g) {               \
    softmax_backward<T>(scores, mask, dp, delta, ds, g);                                                           \
  }

INSTANTIATE(f32, float)
INSTANTIATE(bf16, bf16_t)
