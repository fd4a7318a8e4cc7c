// The tile arithmetic of the flash-attention kernels (flash_attention.cu, which NVRTC compiles
// after values.cuh and this): the half formats' tensor-core product and rounding, a warp's A
// fragments from memory, tiles staged in shared memory, the products of a warp's rows with a
// tile (through ldmatrix where the tile is staged) and the writes of a warp's result rows.
// Lane (g, t) = (lane / 4, lane % 4) of a warp holds what PTX's mma.m16n8k16 fragments say.

// WARPS and ROWS are kernels::cuda::FLASH_WARPS and FLASH_ROWS, which the launches read (a test
// holds them equal).
#define WARPS 4
#define ROWS 64          // outer rows of a block: WARPS x 16
#define PAD 8            // halves after each staged row: rows 2 x (D + 8) bytes apart hit distinct banks
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

typedef unsigned short half_bits;

// The half formats: the tensor-core product and the rounding of two f32 into one 32-bit pair
// (round to nearest even; the lower index in the low half). PTX names the format (`bf16`, `f16`).
#ifdef FSDP_CUDA_EMULATION
#define HALF_FORMAT(NAME, PTX, IS_BF16)                                                                       \
  struct NAME {                                                                                               \
    static void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {                        \
      emulation::mma<IS_BF16>(c, a, b0, b1);                                                                  \
    }                                                                                                         \
    static unsigned pack(float lo, float hi) { return emulation::pack<IS_BF16>(lo, hi); }                    \
    static float value(unsigned bits) { return IS_BF16 ? emulation::bf16_value(bits) : emulation::f16_value(bits); } \
  };
#else
// An f16's bits as f32 (NVRTC compiles without cuda_fp16.h).
__device__ __forceinline__ float f16_bits_value(unsigned bits) {
  unsigned short h = (unsigned short)bits;
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
  return r;
}

#define HALF_FORMAT(NAME, PTX, IS_BF16)                                                                       \
  struct NAME {                                                                                               \
    static __device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) { \
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};" \
                   : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                            \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                           \
    }                                                                                                         \
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {                                    \
      unsigned r;                                                                                             \
      asm("cvt.rn." PTX "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));                                   \
      return r;                                                                                               \
    }                                                                                                         \
    static __device__ __forceinline__ float value(unsigned bits) {                                            \
      return IS_BF16 ? __uint_as_float(bits << 16) : f16_bits_value(bits);                                   \
    }                                                                                                         \
  };
#endif

HALF_FORMAT(Bf16, "bf16", true)
HALF_FORMAT(F16, "f16", false)

// 2^x in one instruction of the special-function unit (ex2.approx.ftz: within 2 ulp, a result
// below 2^-126 flushed to 0, 2^-inf = 0). exp2f, compiled without fast math, wraps the same
// instruction in a rescaling for subnormal results: a compare, two conditional multiplies and
// the predicates between them for every probability of the inner loops. A probability below
// 2^-126 is lost beside its row's largest, which is at least 1 / S.
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef FSDP_CUDA_EMULATION
  float r = exp2f(x);
  return r < 1.17549435e-38f ? 0.0f : r;
#else
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#endif
}

// Four 8 x 8 matrices of halves from shared memory in one warp-wide instruction (ldmatrix): lane
// l gives the address of row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned) and receives in
// r[i] the pair that an mma fragment wants of matrix i: row l / 4, columns 2 (l % 4) and + 1; with
// TRANS the matrix's transpose (rows 2 (l % 4) and + 1 of column l / 4). One load where the pairs
// took two 32-bit loads, or four 16-bit ones and the shifts to join them.
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const half_bits *row) {
#ifdef FSDP_CUDA_EMULATION
  emulation::ldmatrix_x4<TRANS>(r, row);
#else
  unsigned at = (unsigned)__cvta_generic_to_shared(row);
  if (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
#endif
}

// Halves (col, col + 1) of row `row` (< 16) of a (rows x D) matrix whose rows are `ld` halves
// apart (D, or heads · D token-major) as one word; 0 past `rows`.
__device__ __forceinline__ unsigned pair_at(const half_bits *m, int ld, int rows, int row, int col) {
  return row < rows ? *reinterpret_cast<const unsigned *>(m + row * ld + col) : 0u;
}

// A fragments (16 x D) of rows 0..15 of `m` (rows `ld` apart; past `rows` read as 0). Lane (g, t) =
// (lane / 4, lane % 4) holds, per 16 columns kk: row g cols 2t, 2t+1; row g+8 the same; then both
// at +8.
template <int D>
__device__ __forceinline__ void load_a(const half_bits *m, int ld, int rows, int lane, unsigned (&a)[D / 16][4]) {
  int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int kk = 0; kk < D / 16; kk++) {
    int c = kk * 16 + 2 * t;
    a[kk][0] = pair_at(m, ld, rows, g, c);
    a[kk][1] = pair_at(m, ld, rows, g + 8, c);
    a[kk][2] = pair_at(m, ld, rows, g, c + 8);
    a[kk][3] = pair_at(m, ld, rows, g + 8, c + 8);
  }
}

// A copy of BYTES (4, 8 or 16) from global to shared memory that bypasses the registers and
// completes in the background (cp.async, sm_80 on): a thread's copies issued since its last
// `async_commit` form a group, and `async_wait<P>` returns once at most P of its groups are still
// in flight. `valid` false writes zeros (the copy's source size 0; `src` must still be an
// address of the tensor). The emulation lands a group's copies at its wait (emulate.h).
template <int BYTES>
__device__ __forceinline__ void copy_async(void *dst, const void *src, bool valid) {
#ifdef FSDP_CUDA_EMULATION
  emulation::copy_async(dst, src, BYTES, valid);
#else
  unsigned at = (unsigned)__cvta_generic_to_shared(dst);
  if (BYTES == 16)  // .cg: the tiles are read once a block, past L1
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(at), "l"(src), "r"(valid ? 16 : 0));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(at), "l"(src), "n"(BYTES), "r"(valid ? BYTES : 0));
#endif
}

__device__ __forceinline__ void async_commit() {
#ifdef FSDP_CUDA_EMULATION
  emulation::async_commit();
#else
  asm volatile("cp.async.commit_group;");
#endif
}

template <int PENDING>
__device__ __forceinline__ void async_wait() {
#ifdef FSDP_CUDA_EMULATION
  emulation::async_wait(PENDING);
#else
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING));
#endif
}

// Starts staging rows 0..N-1 of a (rows x D) matrix (rows `ld` apart; rows >= 1) in `tile` (rows
// D + PAD apart), 16 bytes per copy; rows past `rows` as zeros (so masked products read 0, never
// stale values). Lands by the caller's `async_wait`. Each thread copies the same 16-byte column of
// rows a fixed distance apart, a count known at compile time: unrolled, a copy is an address add
// and the copy, where a loop over a flat index divided each index into row and column (the
// instruction counts are in docs/gpu.md).
template <int N, int D>
__device__ __forceinline__ void stage_async(half_bits *tile, const half_bits *m, int ld, int rows) {
  const int per_row = D / 8, threads = WARPS * 32, rows_apart = threads / per_row;
  static_assert(threads % per_row == 0 && N % rows_apart == 0, "a tile's 16-byte copies share out evenly over the block");
  const int r0 = (int)(threadIdx.x / per_row), c = (int)(threadIdx.x % per_row) * 8;
#pragma unroll
  for (int k = 0; k < N / rows_apart; k++) {
    int r = r0 + k * rows_apart;
    bool in = r < rows;
    copy_async<16>(tile + r * (D + PAD) + c, m + (in ? (long long)r * ld + c : 0), in);
  }
}

// Starts staging values 0..N-1 of an f32 row vector (rows >= 1), zeros past `rows`.
template <int N>
__device__ __forceinline__ void stage_values_async(float *tile, const float *m, int rows) {
  const int threads = WARPS * 32;
#pragma unroll
  for (int k = 0; k < (N + threads - 1) / threads; k++) {
    int i = (int)threadIdx.x + k * threads;
    if (N % threads == 0 || i < N) copy_async<4>(tile + i, m + (i < rows ? i : 0), i < rows);
  }
}

// The tile loops' buffers: two when a step's tiles fit twice in the 48 KB of static shared
// memory (the next step's copies then run under this step's products), else one. `bytes`: one
// step's tiles.
#define TILE_BUFFERS(bytes) (2 * (bytes) <= 48 * 1024 ? 2 : 1)

// The tile loops: body(at, buffer) for at = first, first + step, .. < end, once the tiles that
// issue(at, buffer) stages (starting its copies, not committing them) have landed for the whole
// block. With two buffers the next step's copies are issued before this step's body runs, so they
// arrive under its products; the barrier after the body keeps a buffer from being written while a
// warp still reads it.
template <int BUFFERS, class Issue, class Body>
__device__ __forceinline__ void for_staged_tiles(int first, int end, int step, Issue issue, Body body) {
  if (BUFFERS == 2 && first < end) issue(first, 0);
  async_commit();
  for (int at = first, index = 0; at < end; at += step, index++) {
    int buffer = BUFFERS == 1 ? 0 : index & 1;
    if (BUFFERS == 1) {
      issue(at, 0);
      async_commit();
      async_wait<0>();
    } else {
      if (at + step < end) issue(at + step, buffer ^ 1);
      async_commit();
      async_wait<1>();
    }
    __syncthreads();
    body(at, buffer);
    __syncthreads();
  }
}

template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
}

// acc (16 x N) = a (16 x D) · tileᵀ, the tile's N rows (`stride` halves apart) as the columns.
// acc[nt] holds columns nt*8 + 2t, +1 of rows g (0, 1) and g+8 (2, 3).
template <class H, int N, int D>
__device__ __forceinline__ void times_rows(const unsigned (&a)[D / 16][4], const half_bits *tile, int stride, int lane, float (&acc)[N / 8][4]) {
  int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < N / 8; nt++) {
    acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    const half_bits *row = tile + (nt * 8 + g) * stride + 2 * t;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
      unsigned b0 = *reinterpret_cast<const unsigned *>(row + kk * 16);
      unsigned b1 = *reinterpret_cast<const unsigned *>(row + kk * 16 + 8);
      H::mma(acc[nt], a[kk], b0, b1);
    }
  }
}

// times_rows over a tile staged in shared memory (rows `stride` halves apart, 16-byte aligned)
// for G groups of 16 rows a warp (a[g], acc[g]): one ldmatrix holds the B fragments of two
// column tiles at one k step, each feeding the G groups' products (an ldmatrix.x4 costs the SM's
// shared memory about what two mma cost its tensor cores, so with one group shared memory alone
// held them to half). Two column tiles a load, not two k steps of one, so that the two products a
// load feeds are independent: two k steps of one tile are a chain of dependent mma, which ptxas
// issued back to back, each waiting out the last one's latency. Each accumulator sums its k steps
// in order.
template <class H, int G, int N, int D>
__device__ __forceinline__ void times_staged_groups(const unsigned (&a)[G][D / 16][4], const half_bits *tile, int stride, int lane,
                                                    float (&acc)[G][N / 8][4]) {
  static_assert(N % 16 == 0, "column tiles go in pairs");
#pragma unroll
  for (int nt = 0; nt < N / 8; nt += 2) {
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
      for (int j = 0; j < 2; j++) acc[g][nt + j][0] = acc[g][nt + j][1] = acc[g][nt + j][2] = acc[g][nt + j][3] = 0.0f;
    // Matrix i = lane / 8: rows (nt + i / 2) * 8 .. +7, columns kk*16 + 8 (i % 2) .. +7 (b0, b1 of
    // nt, then of nt + 1): each ldmatrix feeds two independent accumulators.
    const half_bits *row = tile + (nt * 8 + (lane >> 4) * 8 + (lane & 7)) * stride + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
      unsigned b[4];
      ldmatrix_x4<false>(b, row + kk * 16);
#pragma unroll
      for (int g = 0; g < G; g++) {
        H::mma(acc[g][nt], a[g][kk], b[0], b[1]);
        H::mma(acc[g][nt + 1], a[g][kk], b[2], b[3]);
      }
    }
  }
}

// times_staged_groups for one group of 16 rows.
template <class H, int N, int D>
__device__ __forceinline__ void times_staged(const unsigned (&a)[D / 16][4], const half_bits *tile, int stride, int lane, float (&acc)[N / 8][4]) {
  times_staged_groups<H, 1, N, D>(reinterpret_cast<const unsigned(&)[1][D / 16][4]>(a), tile, stride, lane,
                                  reinterpret_cast<float(&)[1][N / 8][4]>(acc));
}

// accumulate over a tile staged in shared memory (rows `stride` halves apart, 16-byte aligned,
// zero-filled past the rows staged) for G groups of 16 rows a warp (p[g], out[g]): the B
// fragments of two column steps in one transposing ldmatrix, each feeding the G groups' products.
template <class H, int G, int N, int D>
__device__ __forceinline__ void accumulate_staged_groups(const float (&p)[G][N / 8][4], const half_bits *tile, int stride, int lane,
                                                         float (&out)[G][D / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < N / 16; kk++) {
    unsigned a[G][4];
#pragma unroll
    for (int g = 0; g < G; g++) {
      a[g][0] = H::pack(p[g][2 * kk][0], p[g][2 * kk][1]);
      a[g][1] = H::pack(p[g][2 * kk][2], p[g][2 * kk][3]);
      a[g][2] = H::pack(p[g][2 * kk + 1][0], p[g][2 * kk + 1][1]);
      a[g][3] = H::pack(p[g][2 * kk + 1][2], p[g][2 * kk + 1][3]);
    }
    // Matrix i = lane / 8: rows kk*16 + 8 (i % 2) .. +7, columns (nt + i / 2) * 8 .. +7 (b0, b1 of
    // nt, then of nt + 1).
    const half_bits *row = tile + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * stride + (lane >> 4) * 8;
#pragma unroll
    for (int nt = 0; nt < D / 8; nt += 2) {
      unsigned b[4];
      ldmatrix_x4<true>(b, row + nt * 8);
#pragma unroll
      for (int g = 0; g < G; g++) {
        H::mma(out[g][nt], a[g], b[0], b[1]);
        H::mma(out[g][nt + 1], a[g], b[2], b[3]);
      }
    }
  }
}

// accumulate_staged_groups for one group of 16 rows.
template <class H, int N, int D>
__device__ __forceinline__ void accumulate_staged(const float (&p)[N / 8][4], const half_bits *tile, int stride, int lane, float (&out)[D / 8][4]) {
  accumulate_staged_groups<H, 1, N, D>(reinterpret_cast<const float(&)[1][N / 8][4]>(p), tile, stride, lane,
                                       reinterpret_cast<float(&)[1][D / 8][4]>(out));
}

// out (16 x D) += p (16 x N, f32 in C fragments, rounded to half here) · tile (N x D, rows
// `stride` halves apart). BOUNDED: the tile's rows from `rows` on read as 0 (they may hold
// anything, and p = 0 times a NaN would still be NaN); a staged tile is zero-filled already.
template <class H, int N, int D, bool BOUNDED = false>
__device__ __forceinline__ void accumulate(const float (&p)[N / 8][4], const half_bits *tile, int stride, int lane, float (&out)[D / 8][4],
                                           int rows = N) {
  int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int kk = 0; kk < N / 16; kk++) {
    unsigned a[4] = {H::pack(p[2 * kk][0], p[2 * kk][1]), H::pack(p[2 * kk][2], p[2 * kk][3]),
                     H::pack(p[2 * kk + 1][0], p[2 * kk + 1][1]), H::pack(p[2 * kk + 1][2], p[2 * kk + 1][3])};
    int r = kk * 16 + 2 * t;
    const half_bits *r0 = tile + r * stride + g;
    bool in[4] = {!BOUNDED || r < rows, !BOUNDED || r + 1 < rows, !BOUNDED || r + 8 < rows, !BOUNDED || r + 9 < rows};
#pragma unroll
    for (int nt = 0; nt < D / 8; nt++) {
      const half_bits *c = r0 + nt * 8;
      unsigned b0 = (in[0] ? (unsigned)c[0] : 0u) | ((in[1] ? (unsigned)c[stride] : 0u) << 16);
      unsigned b1 = (in[2] ? (unsigned)c[8 * stride] : 0u) | ((in[3] ? (unsigned)c[9 * stride] : 0u) << 16);
      H::mma(out[nt], a, b0, b1);
    }
  }
}

// Sum over the four lanes that share a row (lanes 4g .. 4g+3).
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// Writes rows g and g+8 of a warp's (16 x D) f32 result, times `scale`, to rows `row0 + ..` of a
// (rows x D) half matrix whose rows are `ld` apart.
template <class H, int D>
__device__ __forceinline__ void store_rows(const float (&acc)[D / 8][4], half_bits *m, int ld, int rows, int row0, int lane, float scale0,
                                           float scale8) {
  int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < D / 8; nt++) {
    int c = nt * 8 + 2 * t;
    if (row0 + g < rows)
      *reinterpret_cast<unsigned *>(m + (long long)(row0 + g) * ld + c) = H::pack(acc[nt][0] * scale0, acc[nt][1] * scale0);
    if (row0 + g + 8 < rows)
      *reinterpret_cast<unsigned *>(m + (long long)(row0 + g + 8) * ld + c) = H::pack(acc[nt][2] * scale8, acc[nt][3] * scale8);
  }
}

// Rows g and g+8 of a warp's (16 x D) f32 result, times `scale`, to rows `row0 + ..` of a
// (rows x D) f32 matrix.
template <int D>
__device__ __forceinline__ void store_rows_f32(const float (&acc)[D / 8][4], float *m, int rows, int row0, int lane, float scale) {
  int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < D / 8; nt++) {
    int c = nt * 8 + 2 * t;
    if (row0 + g < rows) *reinterpret_cast<float2 *>(m + (long long)(row0 + g) * D + c) = make_float2(acc[nt][0] * scale, acc[nt][1] * scale);
    if (row0 + g + 8 < rows)
      *reinterpret_cast<float2 *>(m + (long long)(row0 + g + 8) * D + c) = make_float2(acc[nt][2] * scale, acc[nt][3] * scale);
  }
}
