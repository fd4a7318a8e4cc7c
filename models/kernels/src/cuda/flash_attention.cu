// Flash attention, forward and backward, on the tensor cores (FlashAttention-2's algorithm): the
// scores live in registers a tile at a time and never reach memory. Compiled at run time by NVRTC
// after values.cuh and flash_tiles.cuh, the tile arithmetic (models/ops/src/flash_attention_cuda/
// launches it); a CPU test compiles it as C++ with tests/cuda_emulation/emulate.h, which runs each
// GPU thread as a thread.
//
// Layouts (contiguous, half precision as bits): q, out, dout, dq (batch, heads, T, D); k, v, dk, dv
// (batch, kv_heads, S, D), query head h reading kv head h / (heads / kv_heads) (GQA without
// repeating k and v); or, with token_major, all of them (batch, T or S, heads, D): as the
// projections make them and o_proj reads them, with no transposes between. lse and delta are
// (batch, heads, T) in f32 either way.
//
// A block is four warps; a warp owns 16 rows of the outer matrix (queries for the forward and dq,
// keys for dk and dv; the forward's warps two such groups at head dim 64), its A operand in registers, and walks tiles of the inner one, which the
// block stages in shared memory through cp.async (for_staged_tiles: where two steps' tiles fit, the
// next step's copies run under this step's products; synchronous staging left the warps waiting
// on memory at two blocks an SM). Products are mma.m16n8k16 (f32 accumulators); the C fragment
// of one product is the A fragment of the next (the probabilities rounded to half first), so
// nothing is transposed through memory. The backward is two kernels, dq by query rows and dk, dv
// by key rows (and query head, its shares summed by a third under GQA), each recomputing the
// probabilities from lse: no atomics, the same bits every run.
//   forward: s = q kᵀ, m and l the running max and sum, o += p v;  lse = m + ln l
//   dq:      p = exp(s scale - lse), dp = dout vᵀ, ds = p (dp - delta), dq = ds k scale
//   dk, dv:  pᵀ, dpᵀ = v doutᵀ, dv = pᵀ dout, dk = dsᵀ q scale (summed over the group's heads)
// where delta = rowsum(dout * out), a kernel of its own before them. A query sees key j when
// j <= its position (i + offset) if causal, and position - j < window if window > 0 (masks.rs's
// causal_mask).

struct Shape {
  int t_len, s_len, heads, kv_heads;
  int offset;  // position of query 0 among the keys
  int causal;  // keys after a query's position are hidden
  int window;  // > 0: keys at or before position - window are hidden
  float scale; // on the scores
  int token_major; // q, k, v and their gradients (batch, len, heads, D), else (batch, heads, len, D)
};

// Where head `bh` (batch · heads + head) of a tensor of `heads` heads over `len` positions starts,
// in either layout.
template <int D>
__device__ __forceinline__ long long head_at(long long bh, int heads, int len, const Shape &s) {
  return s.token_major ? ((bh / heads) * len * heads + bh % heads) * D : bh * len * D;
}

// How far apart a head's rows (positions) are, in halves (at most heads · D: an int, which keeps
// the tile loops' offsets 32-bit).
template <int D>
__device__ __forceinline__ int row_stride(int heads, const Shape &s) {
  return s.token_major ? heads * D : D;
}

// The tests joined by & rather than && or early returns, which made a branch, and a point for the
// warp to reconverge, of every value of a masked tile.
__device__ __forceinline__ bool visible(int i, int j, const Shape &s) {
  int pos = i + s.offset;
  return (i < s.t_len) & (j < s.s_len) & (!s.causal | (j <= pos)) & ((s.window <= 0) | (pos - j < s.window));
}

// Whether every query of [i0, i0 + ni) sees every key of [j0, j0 + nj): a tile with no mask to
// apply (visible()'s tests for the last key against the first query's position, and for the
// first key against the last query's).
__device__ __forceinline__ bool all_visible(int i0, int ni, int j0, int nj, const Shape &s) {
  if (i0 + ni > s.t_len || j0 + nj > s.s_len) return false;
  if (s.causal && j0 + nj - 1 > i0 + s.offset) return false;
  if (s.window > 0 && i0 + ni - 1 + s.offset - j0 >= s.window) return false;
  return true;
}

// f(nt, r, shown) over a warp's fragment (N / 8 x 4 values), `shown` whether query i sees key j
// for (i, j) = at(nt, r). Where the whole tile is visible (`all`, the same for the warp) without
// the per-value test, which in the inner loop costs about as many instructions as the products.
template <int N, class At, class F>
__device__ __forceinline__ void for_fragment(bool all, const Shape &s, At at, F f) {
  if (all) {
#pragma unroll
    for (int nt = 0; nt < N / 8; nt++)
#pragma unroll
      for (int r = 0; r < 4; r++) f(nt, r, true);
  } else {
#pragma unroll
    for (int nt = 0; nt < N / 8; nt++)
#pragma unroll
      for (int r = 0; r < 4; r++) {
        int2 ij = at(nt, r);
        f(nt, r, visible(ij.x, ij.y, s));
      }
  }
}

// The keys [first, end) that queries [m0, m0 + count) may see.
__device__ __forceinline__ int2 key_range(int m0, int count, const Shape &s) {
  int end = s.causal ? min(s.s_len, m0 + count + s.offset) : s.s_len;
  int first = s.window > 0 ? max(0, m0 + s.offset - s.window + 1) : 0;
  return make_int2(first, end);
}

// The queries [first, end) that may see keys [n0, n0 + count).
__device__ __forceinline__ int2 query_range(int n0, int count, const Shape &s) {
  int first = s.causal ? max(0, n0 - s.offset) : 0;
  int end = s.window > 0 ? min(s.t_len, n0 + count - 1 + s.window - s.offset) : s.t_len;
  return make_int2(first, max(first, end));
}

// One tile of a warp's scores (q · k, NEG_INF where hidden) into its rows' running max m and sum l
// (in units of k2 = scale · log2 e; this lane's share of the row) and output o, rescaled as the
// max grows; the scores become the probabilities p = exp2(x k2 - m) that multiply the tile's
// values next. The max is taken over the unscaled scores (k2 > 0 keeps their order), so each
// probability's scaling is one fused multiply-add with its exponent, as FlashAttention-2's is.
template <int N, int D>
__device__ __forceinline__ void online_softmax(float (&sc)[N / 8][4], float k2, float (&m)[2], float (&l)[2], float (&o)[D / 8][4]) {
#pragma unroll
  for (int half = 0; half < 2; half++) {
    float mx = NEG_INF;
#pragma unroll
    for (int nt = 0; nt < N / 8; nt++) mx = fmaxf(mx, fmaxf(sc[nt][2 * half], sc[nt][2 * half + 1]));
    float m_new = fmaxf(m[half], quad_max(mx) * k2);
    // A row that sees nothing yet keeps p = 0 (exp2(-inf - 0)).
    float base = m_new == NEG_INF ? 0.0f : m_new;
    float keep = fast_exp2(m[half] - base), sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < N / 8; nt++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        float p = fast_exp2(fmaf(sc[nt][2 * half + e], k2, -base));
        sc[nt][2 * half + e] = p;
        sum += p;
      }
    l[half] = l[half] * keep + sum;
    m[half] = m_new;
#pragma unroll
    for (int nt = 0; nt < D / 8; nt++) {
      o[nt][2 * half] *= keep;
      o[nt][2 * half + 1] *= keep;
    }
  }
}

// Buffers for the forward's and dq's tiles of N keys and values: two where both steps' fit.
#define KV_BUFFERS(D, N) TILE_BUFFERS(4 * (N) * ((D) + PAD))

// body(n0, k_tile, v_tile) over the N-key tiles that hold keys [keys.x, keys.y), the tiles of
// k and v (rows `ld` apart from kh and vh) staged in shared memory (rows D + PAD apart).
template <int D, int N, class Body>
__device__ __forceinline__ void for_kv_tiles(int2 keys, const half_bits *kh, const half_bits *vh, int ld, int s_len, Body body) {
  const int BUFFERS = KV_BUFFERS(D, N);
  __shared__ uint4 k_raw[BUFFERS][N * (D + PAD) / 8], v_raw[BUFFERS][N * (D + PAD) / 8];
  auto tile = [&](uint4 *raw) { return reinterpret_cast<half_bits *>(raw); };
  for_staged_tiles<BUFFERS>(
      keys.x / N * N, keys.y, N,
      [&](int n0, int b) {
        stage_async<N, D>(tile(k_raw[b]), kh + (long long)n0 * ld, ld, s_len - n0);
        stage_async<N, D>(tile(v_raw[b]), vh + (long long)n0 * ld, ld, s_len - n0);
      },
      [&](int n0, int b) { body(n0, tile(k_raw[b]), tile(v_raw[b])); });
}

// Groups of 16 query rows a warp holds in the forward: two at head dim 64 (a block's 128 rows),
// so each B fragment a warp reads from shared memory feeds two mma; one at 128, where a second
// group's output alone (64 more registers a thread) would spill. flash_attention_cuda's grid
// (kernels::cuda::FLASH_FORWARD_GROUPS_D64, which a test holds to this) and the emulation's
// driver follow it. At head dim 64 a one-group forward is built too (INSTANTIATE_D64_VARIANTS),
// so that a GPU can measure the two against each other without a rebuild.
#define FORWARD_GROUPS_D64 2
#define FORWARD_GROUPS(D) ((D) == 64 ? FORWARD_GROUPS_D64 : 1)

// G groups of 16 query rows a warp. Grid (ceil(T / (64 · G)), batch * heads); 128 threads.
template <class H, int D, int G>
__device__ void flash_forward(const half_bits *q, const half_bits *k, const half_bits *v, half_bits *out, float *lse, Shape s) {
  int bh = blockIdx.y, kvh = (bh / s.heads) * s.kv_heads + (bh % s.heads) / (s.heads / s.kv_heads);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  int m0 = blockIdx.x * ROWS * G, warp_row0 = m0 + warp * 16 * G;
  int q_ld = row_stride<D>(s.heads, s), kv_ld = row_stride<D>(s.kv_heads, s);
  const half_bits *qh = q + head_at<D>(bh, s.heads, s.t_len, s), *kh = k + head_at<D>(kvh, s.kv_heads, s.s_len, s),
                  *vh = v + head_at<D>(kvh, s.kv_heads, s.s_len, s);

  unsigned qa[G][D / 16][4];
  float o[G][D / 8][4], m[G][2], l[G][2];
#pragma unroll
  for (int gi = 0; gi < G; gi++) {
    int row0 = warp_row0 + 16 * gi;
    load_a<D>(qh + (long long)row0 * q_ld, q_ld, s.t_len - row0, lane, qa[gi]);
    zero(o[gi]);
    m[gi][0] = m[gi][1] = NEG_INF;
    l[gi][0] = l[gi][1] = 0.0f;
  }
  const float k2 = s.scale * LOG2E;

  for_kv_tiles<D, ROWS>(key_range(m0, ROWS * G, s), kh, vh, kv_ld, s.s_len, [&](int n0, const half_bits *k_tile, const half_bits *v_tile) {
    float sc[G][ROWS / 8][4];
    times_staged_groups<H, G, ROWS, D>(qa, k_tile, D + PAD, lane, sc);
#pragma unroll
    for (int gi = 0; gi < G; gi++) {
      int row0 = warp_row0 + 16 * gi;
      auto at = [&](int nt, int r) { return make_int2(row0 + g + 8 * (r / 2), n0 + nt * 8 + 2 * t + (r & 1)); };
      for_fragment<ROWS>(all_visible(row0, 16, n0, ROWS, s), s, at,
                         [&](int nt, int r, bool shown) { sc[gi][nt][r] = shown ? sc[gi][nt][r] : NEG_INF; });
      online_softmax<ROWS, D>(sc[gi], k2, m[gi], l[gi], o[gi]);
    }
    accumulate_staged_groups<H, G, ROWS, D>(sc, v_tile, D + PAD, lane, o);
  });

#pragma unroll
  for (int gi = 0; gi < G; gi++) {
    int row0 = warp_row0 + 16 * gi;
    float inv[2];
#pragma unroll
    for (int half = 0; half < 2; half++) {
      float total = quad_sum(l[gi][half]);
      inv[half] = total > 0.0f ? 1.0f / total : 0.0f;
      int i = row0 + g + 8 * half;
      if (t == 0 && i < s.t_len) lse[(long long)bh * s.t_len + i] = total > 0.0f ? (m[gi][half] + log2f(total)) * LN2 : NEG_INF;
    }
    store_rows<H, D>(o[gi], out + head_at<D>(bh, s.heads, s.t_len, s), q_ld, s.t_len, row0, lane, inv[0], inv[1]);
  }
}

// p of a score (already times scale · log2 e) for a row of log-sum-exp `lse2` (in log2 units).
// Only for a query that sees the key: its row then sees a key, so its lse is finite (the
// forward's sum holds its max's 2^0), and rows that see none (lse -inf) take the mask's 0.
__device__ __forceinline__ float prob(float x, float lse2) { return fast_exp2(x - lse2); }

// Keys staged per step by the dq kernel: 32 at D = 128, where 64 made its p and dp spill; 64 at
// D = 64, where a 32-key kernel is built too (INSTANTIATE_D64_VARIANTS: fewer registers, twice the
// steps) for a GPU to measure against it. Each kernel's registers and blocks an SM are in
// docs/gpu.md. Any of them gives the same bits: dq takes the same 16-key chunks in the same order.
#define DQ_KEYS(D) ((D) > 64 ? 32 : 64)

// KN keys staged a step. Grid (ceil(T / 64), batch * heads); 128 threads.
template <class H, int D, int KN>
__device__ void flash_backward_dq(const half_bits *q, const half_bits *k, const half_bits *v, const half_bits *dout,
                                  const float *lse, const float *delta, half_bits *dq, Shape s) {
  int bh = blockIdx.y, kvh = (bh / s.heads) * s.kv_heads + (bh % s.heads) / (s.heads / s.kv_heads);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  int m0 = blockIdx.x * ROWS, row0 = m0 + warp * 16;
  long long rows_at = (long long)bh * s.t_len, q_at = head_at<D>(bh, s.heads, s.t_len, s);
  int q_ld = row_stride<D>(s.heads, s), kv_ld = row_stride<D>(s.kv_heads, s);
  const half_bits *kh = k + head_at<D>(kvh, s.kv_heads, s.s_len, s), *vh = v + head_at<D>(kvh, s.kv_heads, s.s_len, s);

  unsigned qa[D / 16][4], da[D / 16][4];
  load_a<D>(q + q_at + (long long)row0 * q_ld, q_ld, s.t_len - row0, lane, qa);
  load_a<D>(dout + q_at + (long long)row0 * q_ld, q_ld, s.t_len - row0, lane, da);
  float lse2[2], dl[2];
#pragma unroll
  for (int half = 0; half < 2; half++) {
    int i = row0 + g + 8 * half;
    lse2[half] = i < s.t_len ? lse[rows_at + i] * LOG2E : NEG_INF;
    dl[half] = i < s.t_len ? delta[rows_at + i] : 0.0f;
  }
  float acc[D / 8][4];
  zero(acc);
  const float k2 = s.scale * LOG2E;

  for_kv_tiles<D, KN>(key_range(m0, ROWS, s), kh, vh, kv_ld, s.s_len, [&](int n0, const half_bits *k_tile, const half_bits *v_tile) {
    float p[KN / 8][4], dp[KN / 8][4];
    times_staged<H, KN, D>(qa, k_tile, D + PAD, lane, p);
    times_staged<H, KN, D>(da, v_tile, D + PAD, lane, dp);
    auto at = [&](int nt, int r) { return make_int2(row0 + g + 8 * (r / 2), n0 + nt * 8 + 2 * t + (r & 1)); };
    for_fragment<KN>(all_visible(row0, 16, n0, KN, s), s, at, [&](int nt, int r, bool shown) {
      int half = r / 2;
      float pr = shown ? prob(p[nt][r] * k2, lse2[half]) : 0.0f;
      p[nt][r] = pr * (dp[nt][r] - dl[half]);
    });
    accumulate_staged<H, KN, D>(p, k_tile, D + PAD, lane, acc);
  });
  store_rows<H, D>(acc, dq + q_at, q_ld, s.t_len, row0, lane, s.scale, s.scale);
}

// delta = rowsum(dout * out) in f32 for the two backward kernels (FlashAttention's
// preprocessing), over the (batch · heads · T) query rows of dout and out, in delta's (batch,
// heads, T) order: a warp a row, each lane two halves at a time. Grid ceil(rows / WARPS); 128
// threads.
template <class H, int D>
__device__ void flash_backward_delta(const half_bits *dout, const half_bits *out, float *delta, long long rows, Shape s) {
  long long row = (long long)blockIdx.x * WARPS + threadIdx.x / 32;
  if (row >= rows) return;  // the whole warp: its row is one
  long long at = head_at<D>(row / s.t_len, s.heads, s.t_len, s) + (row % s.t_len) * row_stride<D>(s.heads, s);
  int lane = threadIdx.x % 32;
  float sum = 0.0f;
#pragma unroll
  for (int c = 2 * lane; c < D; c += 64) {
    unsigned a = *reinterpret_cast<const unsigned *>(dout + at + c), b = *reinterpret_cast<const unsigned *>(out + at + c);
    sum += H::value(a & 0xffffu) * H::value(b & 0xffffu) + H::value(a >> 16) * H::value(b >> 16);
  }
  sum = warp_sum(sum);
  if (lane == 0) delta[row] = sum;
}

// Queries staged per step by the dk/dv kernel: fewer at D = 128, where its warps hold k, v, dk and
// dv (16 x 128 each) in registers. At D = 64 a 32-query kernel is built too
// (INSTANTIATE_D64_VARIANTS): its p and dp take half the registers, so three blocks fit an SM
// instead of two, at twice the steps; a GPU measures which wins.
// Both give the same bits: dk and dv take the same 16-query chunks in the same order.
#define QUERIES(D) ((D) > 64 ? 32 : 64)

// A block per (64 keys, query head): the head's share of dk and dv for its kv head. Without GQA
// that is all of it, written to dk, dv; with GQA each query head's share goes to `partial` in
// f32 ((2, batch, heads, S, D): dk's, then dv's) and flash_backward_dkv_sum adds the group's in
// order: four times the blocks of one per kv head, each walking a quarter of the queries, and the
// same bits every run (no atomics). QN queries staged a step. Grid (ceil(S / 64), batch * heads);
// 128 threads.
template <class H, int D, int QN>
__device__ void flash_backward_dkv(const half_bits *q, const half_bits *k, const half_bits *v, const half_bits *dout,
                                   const float *lse, const float *delta, half_bits *dk, half_bits *dv, float *partial, Shape s) {
  const int BUFFERS = TILE_BUFFERS(QN * (4 * (D + PAD) + 8));
  __shared__ uint4 q_raw[BUFFERS][QN * (D + PAD) / 8], d_raw[BUFFERS][QN * (D + PAD) / 8];
  __shared__ float lse_raw[BUFFERS][QN], delta_raw[BUFFERS][QN];
  int bh = blockIdx.y, b = bh / s.heads, head = bh % s.heads, group = s.heads / s.kv_heads;
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  int n0 = blockIdx.x * ROWS, key0 = n0 + warp * 16;
  long long keys_at = head_at<D>((long long)b * s.kv_heads + head / group, s.kv_heads, s.s_len, s);
  long long rows_at = (long long)bh * s.t_len, q_at = head_at<D>(bh, s.heads, s.t_len, s);
  int q_ld = row_stride<D>(s.heads, s), kv_ld = row_stride<D>(s.kv_heads, s);

  unsigned ka[D / 16][4], va[D / 16][4];
  load_a<D>(k + keys_at + (long long)key0 * kv_ld, kv_ld, s.s_len - key0, lane, ka);
  load_a<D>(v + keys_at + (long long)key0 * kv_ld, kv_ld, s.s_len - key0, lane, va);
  float dk_acc[D / 8][4], dv_acc[D / 8][4];
  zero(dk_acc);
  zero(dv_acc);
  const float k2 = s.scale * LOG2E;

  int2 queries = query_range(n0, ROWS, s);
  // Past the last query, lse and delta stage as 0: visible() hides those rows (p = 0) and their
  // q and dout rows are zeros, so neither reaches a sum.
  auto tile = [&](uint4 *raw) { return reinterpret_cast<half_bits *>(raw); };
  auto issue = [&](int m0, int b) {
    stage_async<QN, D>(tile(q_raw[b]), q + q_at + (long long)m0 * q_ld, q_ld, s.t_len - m0);
    stage_async<QN, D>(tile(d_raw[b]), dout + q_at + (long long)m0 * q_ld, q_ld, s.t_len - m0);
    stage_values_async<QN>(lse_raw[b], lse + rows_at + m0, s.t_len - m0);
    stage_values_async<QN>(delta_raw[b], delta + rows_at + m0, s.t_len - m0);
  };
  for_staged_tiles<BUFFERS>(queries.x / QN * QN, queries.y, QN, issue, [&](int m0, int b) {
    const half_bits *q_tile = tile(q_raw[b]), *d_tile = tile(d_raw[b]);
    const float *lse_tile = lse_raw[b], *delta_tile = delta_raw[b];
    float p[QN / 8][4], dp[QN / 8][4];
    times_staged<H, QN, D>(ka, q_tile, D + PAD, lane, p);
    auto at = [&](int nt, int r) { return make_int2(m0 + nt * 8 + 2 * t + (r & 1), key0 + g + 8 * (r / 2)); };
    for_fragment<QN>(all_visible(m0, QN, key0, 16, s), s, at, [&](int nt, int r, bool shown) {
      int c = nt * 8 + 2 * t + (r & 1);
      p[nt][r] = shown ? prob(p[nt][r] * k2, lse_tile[c] * LOG2E) : 0.0f;
    });
    accumulate_staged<H, QN, D>(p, d_tile, D + PAD, lane, dv_acc);
    times_staged<H, QN, D>(va, d_tile, D + PAD, lane, dp);
#pragma unroll
    for (int nt = 0; nt < QN / 8; nt++)
#pragma unroll
      for (int r = 0; r < 4; r++) p[nt][r] *= dp[nt][r] - delta_tile[nt * 8 + 2 * t + (r & 1)];
    accumulate_staged<H, QN, D>(p, q_tile, D + PAD, lane, dk_acc);
  });
  if (group == 1) {
    store_rows<H, D>(dk_acc, dk + keys_at, kv_ld, s.s_len, key0, lane, s.scale, s.scale);
    store_rows<H, D>(dv_acc, dv + keys_at, kv_ld, s.s_len, key0, lane, 1.0f, 1.0f);
  } else {
    long long shares = (long long)gridDim.y * s.s_len * D, at = (long long)bh * s.s_len * D;
    store_rows_f32<D>(dk_acc, partial + at, s.s_len, key0, lane, s.scale);
    store_rows_f32<D>(dv_acc, partial + shares + at, s.s_len, key0, lane, 1.0f);
  }
}

// dk and dv (in the layout of k and v) from flash_backward_dkv's per-query-head shares: each kv
// head's group summed in head order, rounded to half once. A thread per two values (i counts them
// in (batch, kv_heads, S, D) order, the shares'); grid ceil(values / 256); 128 threads.
template <class H, int D>
__device__ void flash_backward_dkv_sum(const float *partial, half_bits *dk, half_bits *dv, long long values, Shape s) {
  long long i = 2 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= values) return;
  int group = s.heads / s.kv_heads;
  long long per_head = (long long)s.s_len * D, bkv = i / per_head, within = i % per_head;
  long long first = ((bkv / s.kv_heads) * s.heads + (bkv % s.kv_heads) * group) * per_head + within, shares = values * group;
  float k0 = 0.0f, k1 = 0.0f, v0 = 0.0f, v1 = 0.0f;
  for (int h = 0; h < group; h++) {
    float2 a = *reinterpret_cast<const float2 *>(partial + first + h * per_head);
    float2 c = *reinterpret_cast<const float2 *>(partial + shares + first + h * per_head);
    k0 += a.x, k1 += a.y, v0 += c.x, v1 += c.y;
  }
  long long at = head_at<D>(bkv, s.kv_heads, s.s_len, s) + within / D * row_stride<D>(s.kv_heads, s) + within % D;
  *reinterpret_cast<unsigned *>(dk + at) = H::pack(k0, k1);
  *reinterpret_cast<unsigned *>(dv + at) = H::pack(v0, v1);
}

// Decoding: one new query per sequence over its cached keys and values, kept in blocks of
// CACHE_BLOCK positions ((kv_heads, CACHE_BLOCK, D) each, models::kv_cache) that a table lists:
// the key blocks' addresses (`max_blocks` a sequence), the value blocks' likewise, then each
// sequence's length (the new position last); one upload a layer. With k_new and
// v_new ((sequences, kv_heads, D)), the kernel first writes them at the new position (the cache
// only counted it): one launch instead of two copies per sequence. A block of threads per
// (sequence, kv head, 16 of its query heads): those heads are the rows of the A fragment, each
// warp walks every fourth cache block from global memory with its own running max, sum and
// output, and the four are merged through shared memory. Grid (sequences, kv_heads,
// ceil(group / 16)); 128 threads. (Blocks of one kv head write the same new values: no race.)
// CACHE_BLOCK is kernels::paged_attention::BLOCK, the KV cache's (a test holds them equal).
#define CACHE_BLOCK 64

struct Decode {
  int heads, kv_heads, max_blocks;
  int window;  // > 0: only the last `window` positions are seen
  float scale;
};

template <class H, int D>
__device__ void flash_decode(const half_bits *q, const half_bits *k_new, const half_bits *v_new, const unsigned long long *table,
                             half_bits *out, Decode s) {
  __shared__ float m_s[WARPS][16], l_s[WARPS][16], o_s[WARPS][16][D];
  int seq = blockIdx.x, kvh = blockIdx.y, group = s.heads / s.kv_heads, head0 = blockIdx.z * 16;
  int rows = min(16, group - head0);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  long long entries = (long long)gridDim.x * s.max_blocks;
  const unsigned long long *k_blocks = table, *v_blocks = table + entries;
  int len = (int)table[2 * entries + seq], first = s.window > 0 ? max(0, len - s.window) : 0;
  long long q_row = (long long)seq * s.heads + kvh * group + head0;
  if (k_new) {
    int p = len - 1;
    long long at = (long long)seq * s.max_blocks + p / CACHE_BLOCK, row = ((long long)kvh * CACHE_BLOCK + p % CACHE_BLOCK) * D;
    long long from = ((long long)seq * s.kv_heads + kvh) * D;
    half_bits *kb = reinterpret_cast<half_bits *>(k_blocks[at]) + row, *vb = reinterpret_cast<half_bits *>(v_blocks[at]) + row;
    for (int i = threadIdx.x; i < D; i += WARPS * 32) {
      kb[i] = k_new[from + i];
      vb[i] = v_new[from + i];
    }
    __syncthreads();
  }

  unsigned qa[D / 16][4];
  load_a<D>(q + q_row * D, D, rows, lane, qa);
  float o[D / 8][4];
  zero(o);
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
  const float k2 = s.scale * LOG2E;
  for (int b = first / CACHE_BLOCK + warp; b * CACHE_BLOCK < len; b += WARPS) {
    long long at = (long long)seq * s.max_blocks + b, head_at = (long long)kvh * CACHE_BLOCK * D;
    const half_bits *kb = reinterpret_cast<const half_bits *>(k_blocks[at]) + head_at;
    const half_bits *vb = reinterpret_cast<const half_bits *>(v_blocks[at]) + head_at;
    float sc[CACHE_BLOCK / 8][4];
    times_rows<H, CACHE_BLOCK, D>(qa, kb, D, lane, sc);
#pragma unroll
    for (int nt = 0; nt < CACHE_BLOCK / 8; nt++)
#pragma unroll
      for (int r = 0; r < 4; r++) {
        int j = b * CACHE_BLOCK + nt * 8 + 2 * t + (r & 1);
        sc[nt][r] = j >= first && j < len ? sc[nt][r] : NEG_INF;
      }
    online_softmax<CACHE_BLOCK, D>(sc, k2, m, l, o);
    accumulate<H, CACHE_BLOCK, D, true>(sc, vb, D, lane, o, len - b * CACHE_BLOCK);
  }

#pragma unroll
  for (int half = 0; half < 2; half++) {
    float total = quad_sum(l[half]);
    if (t == 0) {
      m_s[warp][g + 8 * half] = m[half];
      l_s[warp][g + 8 * half] = total;
    }
#pragma unroll
    for (int nt = 0; nt < D / 8; nt++)
#pragma unroll
      for (int e = 0; e < 2; e++) o_s[warp][g + 8 * half][nt * 8 + 2 * t + e] = o[nt][2 * half + e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rows * D / 2; i += WARPS * 32) {
    int row = i / (D / 2), c = (i % (D / 2)) * 2;
    float mx = NEG_INF;
    for (int w = 0; w < WARPS; w++) mx = fmaxf(mx, m_s[w][row]);
    float base = mx == NEG_INF ? 0.0f : mx, total = 0.0f, o0 = 0.0f, o1 = 0.0f;
    for (int w = 0; w < WARPS; w++) {
      float f = fast_exp2(m_s[w][row] - base);
      total += l_s[w][row] * f;
      o0 += o_s[w][row][c] * f;
      o1 += o_s[w][row][c + 1] * f;
    }
    float inv = total > 0.0f ? 1.0f / total : 0.0f;
    *reinterpret_cast<unsigned *>(out + (q_row + row) * D + c) = H::pack(o0 * inv, o1 * inv);
  }
}

#define INSTANTIATE(NAME, H, D)                                                                                       \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                            \
      flash_forward_##NAME##_d##D(const half_bits *q, const half_bits *k, const half_bits *v, half_bits *out,          \
                                  float *lse, Shape s) {                                                              \
    flash_forward<H, D, FORWARD_GROUPS(D)>(q, k, v, out, lse, s);                                                     \
  }                                                                                                                   \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                            \
      flash_backward_delta_##NAME##_d##D(const half_bits *dout, const half_bits *out, float *delta, long long rows,      \
                                         Shape s) {                                                                   \
    flash_backward_delta<H, D>(dout, out, delta, rows, s);                                                            \
  }                                                                                                                   \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                            \
      flash_backward_dq_##NAME##_d##D(const half_bits *q, const half_bits *k, const half_bits *v,                    \
                                      const half_bits *dout, const float *lse, const float *delta, half_bits *dq,     \
                                      Shape s) {                                                                      \
    flash_backward_dq<H, D, DQ_KEYS(D)>(q, k, v, dout, lse, delta, dq, s);                                            \
  }                                                                                                                   \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                            \
      flash_backward_dkv_##NAME##_d##D(const half_bits *q, const half_bits *k, const half_bits *v,                   \
                                       const half_bits *dout, const float *lse, const float *delta, half_bits *dk,    \
                                       half_bits *dv, float *partial, Shape s) {                                      \
    flash_backward_dkv<H, D, QUERIES(D)>(q, k, v, dout, lse, delta, dk, dv, partial, s);                              \
  }                                                                                                                   \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                            \
      flash_backward_dkv_sum_##NAME##_d##D(const float *partial, half_bits *dk, half_bits *dv, long long values,      \
                                           Shape s) {                                                                 \
    flash_backward_dkv_sum<H, D>(partial, dk, dv, values, s);                                                         \
  }                                                                                                                   \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                            \
      flash_decode_##NAME##_d##D(const half_bits *q, const half_bits *k_new, const half_bits *v_new,                  \
                                 const unsigned long long *table, half_bits *out, Decode s) {                         \
    flash_decode<H, D>(q, k_new, v_new, table, out, s);                                                               \
  }

INSTANTIATE(bf16, Bf16, 64)
INSTANTIATE(bf16, Bf16, 128)
INSTANTIATE(f16, F16, 64)
INSTANTIATE(f16, F16, 128)

// The variants at head dim 64 that a switch launches instead (ops' flash_attention_cuda/
// variants.rs): the forward with one group of 16 rows a warp (blocks of 64 rows), dq staging 32
// keys a step and dk/dv staging 32 queries a step. The last two are for three blocks an SM, so
// their launch bounds ask for it: at most 168 registers a thread (64K / (3 x 128), in steps of
// 8); left to itself, ptxas gave dk/dv 170, which fits two.
#define INSTANTIATE_D64_VARIANTS(NAME, H)                                                                             \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                            \
      flash_forward_one_group_##NAME##_d64(const half_bits *q, const half_bits *k, const half_bits *v, half_bits *out, \
                                           float *lse, Shape s) {                                                     \
    flash_forward<H, 64, 1>(q, k, v, out, lse, s);                                                                    \
  }                                                                                                                   \
  extern "C" __global__ void __launch_bounds__(WARPS * 32, 3)                                                         \
      flash_backward_dq_k32_##NAME##_d64(const half_bits *q, const half_bits *k, const half_bits *v,                  \
                                         const half_bits *dout, const float *lse, const float *delta, half_bits *dq,  \
                                         Shape s) {                                                                   \
    flash_backward_dq<H, 64, 32>(q, k, v, dout, lse, delta, dq, s);                                                   \
  }                                                                                                                   \
  extern "C" __global__ void __launch_bounds__(WARPS * 32, 3)                                                         \
      flash_backward_dkv_q32_##NAME##_d64(const half_bits *q, const half_bits *k, const half_bits *v,                 \
                                          const half_bits *dout, const float *lse, const float *delta, half_bits *dk, \
                                          half_bits *dv, float *partial, Shape s) {                                   \
    flash_backward_dkv<H, 64, 32>(q, k, v, dout, lse, delta, dk, dv, partial, s);                                     \
  }

INSTANTIATE_D64_VARIANTS(bf16, Bf16)
INSTANTIATE_D64_VARIANTS(f16, F16)
