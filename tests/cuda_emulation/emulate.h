// Runs our CUDA sources as C++ on the CPU, for tests on machines without a GPU: each GPU thread of
// a block is a thread here (blocks run one after another), `__syncthreads` a barrier of the block,
// warp shuffles and the tensor-core `mma` collectives of 32 threads. Only what our kernels use.
//
// The sources take `FSDP_CUDA_EMULATION` to call `emulation::mma` / `emulation::pack` where the GPU
// runs inline PTX. The emulated mma follows the fragment layouts of PTX ISA's "Matrix Fragments
// for mma.m16n8k16 with floating point type" (A row-major 16 x 16, B column-major 16 x 8, C/D
// 16 x 8 in f32); the GPU tests (tests/cuda/kernels.rs) check the same kernels against the CPU there.

#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define FSDP_CUDA_EMULATION 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx;
inline dim3 blockIdx, blockDim, gridDim;

// CUDA's vector types with CUDA's alignment, so that the driver's sanitizer
// (-fsanitize=alignment) fails a misaligned load or store of one as the GPU would.
struct alignas(8) float2 {
  float x, y;
};
struct alignas(8) int2 {
  int x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
using std::max;
using std::min;

template <class To, class From>
inline To bits_as(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To r;
  std::memcpy(&r, &v, sizeof r);
  return r;
}
inline float __uint_as_float(unsigned u) { return bits_as<float>(u); }
inline float __int_as_float(int u) { return bits_as<float>(u); }
inline unsigned __float_as_uint(float f) { return bits_as<unsigned>(f); }
inline int __float_as_int(float f) { return bits_as<int>(f); }

namespace emulation {

struct alignas(16) uint4_storage {
  unsigned words[4];
};

#if defined(__SANITIZE_THREAD__)
// Under ThreadSanitizer, a barrier of atomics alone: std::barrier's waits go through a mutex
// shared by unrelated waiters, which orders the threads for the sanitizer beyond what a barrier
// does and hides the data races it is there to find (a missing __syncthreads).
class Barrier {
 public:
  explicit Barrier(int threads) : expected_(threads), waiting_(threads) {}
  void arrive_and_wait() { arrive(false); }
  void arrive_and_drop() { arrive(true); }

 private:
  void arrive(bool drop) {
    unsigned phase = phase_.load(std::memory_order_acquire);
    if (drop) expected_.fetch_sub(1, std::memory_order_acq_rel);
    if (waiting_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      waiting_.store(expected_.load(std::memory_order_acquire), std::memory_order_release);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    while (!drop && phase_.load(std::memory_order_acquire) == phase) std::this_thread::yield();
  }
  std::atomic<int> expected_, waiting_;
  std::atomic<unsigned> phase_{0};
};
#else
using Barrier = std::barrier<>;
#endif

// What one warp's collectives exchange: each lane's words, then a barrier of the 32.
struct Warp {
  Barrier arrived{32};
  unsigned words[32][8];
};

struct Block {
  Block(unsigned threads, size_t shared_bytes) : all(threads), warps(threads / 32), shared((shared_bytes + 15) / 16) {
    for (auto &w : warps) w = std::make_unique<Warp>();
  }
  Barrier all;
  std::vector<std::unique_ptr<Warp>> warps;
  // The launch's dynamic shared memory (16-byte aligned).
  std::vector<uint4_storage> shared;
};

inline Block *block = nullptr;

// `extern __shared__ T name[]` (values.cuh's DYNAMIC_SHARED).
template <class T>
inline T *dynamic_shared() {
  return reinterpret_cast<T *>(block->shared.data());
}

inline unsigned thread_index() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
inline Warp &warp() { return *block->warps[thread_index() / 32]; }
inline unsigned lane() { return thread_index() % 32; }

// Every lane puts `n` words, all see all; `read` runs between the two barriers.
template <class Read>
inline void exchange(const unsigned *mine, int n, Read read) {
  Warp &w = warp();
  std::memcpy(w.words[lane()], mine, n * sizeof(unsigned));
  w.arrived.arrive_and_wait();
  read(w.words);
  w.arrived.arrive_and_wait();
}

inline float bf16_value(unsigned h) { return __uint_as_float(h << 16); }

inline float f16_value(unsigned h) {
  unsigned sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) return (sign ? -1.0f : 1.0f) * std::ldexp((float)man, -24);
  return __uint_as_float(sign | ((exp + 112) << 23) | (man << 13));
}

// Round to nearest even.
inline unsigned bf16_bits(float v) {
  unsigned u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

inline unsigned f16_bits(float v) {
  unsigned u = __float_as_uint(v), sign = (u >> 16) & 0x8000u;
  float a = std::fabs(v);
  if (std::isnan(v)) return sign | 0x7e00u;
  if (a >= 65520.0f) return sign | 0x7c00u;
  if (a < 6.103515625e-05f) return sign | (unsigned)std::nearbyint(a * 16777216.0f);  // subnormal: units of 2^-24
  unsigned e = (unsigned)std::ilogb(a);                                               // 2^e <= a < 2^(e+1)
  float m = std::nearbyint(std::ldexp(a, 10 - (int)e));                             // 1024 .. 2048, ties to even
  return sign | ((((int)e + 15) << 10) + ((unsigned)m - 1024));                     // m = 2048 carries into the exponent
}

template <bool Bf16>
inline unsigned pack(float lo, float hi) {
  return Bf16 ? bf16_bits(lo) | (bf16_bits(hi) << 16) : f16_bits(lo) | (f16_bits(hi) << 16);
}

// c (16 x 8) += a (16 x 16) · b (16 x 8): lane (g, t) = (lane / 4, lane % 4) holds a's rows g and
// g+8, columns 2t, 2t+1 (registers 0, 1) and 2t+8, 2t+9 (2, 3); b's column g, rows 2t, 2t+1 (0) and
// 2t+8, 2t+9 (1); c's rows g (0, 1) and g+8 (2, 3), columns 2t, 2t+1. Lower index in the low half.
template <bool Bf16>
inline void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  unsigned mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  auto value = [](unsigned word, int high) { return Bf16 ? bf16_value(high ? word >> 16 : word & 0xffffu) : f16_value(high ? word >> 16 : word & 0xffffu); };
  unsigned g = lane() / 4, t = lane() % 4;
  exchange(mine, 6, [&](const unsigned (*words)[8]) {
    auto a_at = [&](int row, int k) { return value(words[(row % 8) * 4 + (k % 8) / 2][row / 8 + 2 * (k / 8)], k % 2); };
    auto b_at = [&](int k, int n) { return value(words[n * 4 + (k % 8) / 2][4 + k / 8], k % 2); };
    for (int i = 0; i < 4; i++) {
      int row = g + 8 * (i / 2), col = 2 * t + i % 2;
      float sum = 0.0f;
      for (int k = 0; k < 16; k++) sum += a_at(row, k) * b_at(k, col);
      c[i] += sum;
    }
  });
}

// Stops the emulation where the GPU would fault: `p` not on an `bytes` boundary.
inline void require_aligned(const void *p, size_t bytes, const char *what) {
  if (reinterpret_cast<uintptr_t>(p) % bytes != 0) {
    std::fprintf(stderr, "misaligned address: %s at %p is not on a %zu-byte boundary\n", what, p, bytes);
    std::abort();
  }
}

// cp.async as the GPU runs it, not at once: a copy may land at any time until the issuing
// thread's wait_group retires its group, so its destination reads as NaN (all bits set, in bf16,
// f16 and f32) until then, and a read that comes before the wait (or before the barrier behind it,
// for other threads) sees that instead of stale or fresh values.
struct AsyncCopy {
  void *dst;
  const void *src;
  size_t bytes;
  bool valid;  // false: zeros (a source size of 0)
  void land() const { valid ? (void)std::memcpy(dst, src, bytes) : (void)std::memset(dst, 0, bytes); }
};
struct AsyncCopies {
  std::vector<AsyncCopy> open;               // issued since the thread's last commit_group
  std::deque<std::vector<AsyncCopy>> groups; // committed, oldest first
};
inline thread_local AsyncCopies async_copies;

inline void copy_async(void *dst, const void *src, size_t bytes, bool valid) {
  require_aligned(dst, bytes, "cp.async's shared-memory destination");
  require_aligned(src, bytes, "cp.async's global source");
  std::memset(dst, 0xff, bytes);
  async_copies.open.push_back({dst, src, bytes, valid});
}

inline void async_commit() {
  async_copies.groups.push_back(std::move(async_copies.open));
  async_copies.open.clear();
}

// cp.async.wait_group: lands the thread's committed groups but the newest `pending`.
inline void async_wait(size_t pending) {
  while (async_copies.groups.size() > pending) {
    for (const AsyncCopy &c : async_copies.groups.front()) c.land();
    async_copies.groups.pop_front();
  }
}

// A GPU thread's copies still in flight when it exits land all the same.
inline void async_land_all() {
  async_commit();
  async_wait(0);
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l's `row` is row l % 8 of matrix l / 8
// (8 halves); r[i] gets matrix i's row l / 4, columns 2 (l % 4) and + 1, or with TRANS its
// column l / 4, rows 2 (l % 4) and + 1 (the lower index in the low half).
template <bool TRANS>
inline void ldmatrix_x4(unsigned (&r)[4], const unsigned short *row) {
  require_aligned(row, 16, "an ldmatrix row");
  unsigned mine[2];
  std::memcpy(mine, &row, sizeof row);
  unsigned l = lane();
  exchange(mine, 2, [&](const unsigned (*words)[8]) {
    auto row_of = [&](unsigned matrix, unsigned i) {
      const unsigned short *p;
      std::memcpy(&p, words[matrix * 8 + i], sizeof p);
      return p;
    };
    for (unsigned m = 0; m < 4; m++) {
      unsigned lo, hi;
      if (TRANS) {
        lo = row_of(m, 2 * (l % 4))[l / 4];
        hi = row_of(m, 2 * (l % 4) + 1)[l / 4];
      } else {
        lo = row_of(m, l / 4)[2 * (l % 4)];
        hi = row_of(m, l / 4)[2 * (l % 4) + 1];
      }
      r[m] = lo | (hi << 16);
    }
  });
}

}  // namespace emulation

inline void __syncthreads() { emulation::block->all.arrive_and_wait(); }

inline float atomicAdd(float *at, float v) { return std::atomic_ref<float>(*at).fetch_add(v); }

template <class T>
inline T shuffle(T v, unsigned (*source)(unsigned lane, int arg), int arg) {
  static_assert(sizeof(T) == 4);
  unsigned mine = bits_as<unsigned>(v), got = 0;
  emulation::exchange(&mine, 1, [&](const unsigned (*words)[8]) { got = words[source(emulation::lane(), arg)][0]; });
  return bits_as<T>(got);
}

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
  return shuffle(v, [](unsigned lane, int m) { return lane ^ (unsigned)m; }, mask);
}

template <class T>
inline T __shfl_sync(unsigned, T v, int src) {
  return shuffle(v, [](unsigned, int s) { return (unsigned)s; }, src);
}

namespace emulation {

// Runs `kernel(args...)` over `grid` blocks of `threads` threads (a multiple of 32) with
// `shared_bytes` of dynamic shared memory, a block at a time. A thread that returns leaves the
// block's and its warp's barriers, as exited GPU threads do.
template <class... Params, class... Args>
inline void launch(void (*kernel)(Params...), dim3 grid, unsigned threads, size_t shared_bytes, Args... args) {
  gridDim = grid;
  blockDim = dim3{threads, 1, 1};
  for (unsigned z = 0; z < grid.z; z++)
    for (unsigned y = 0; y < grid.y; y++)
      for (unsigned x = 0; x < grid.x; x++) {
        blockIdx = dim3{x, y, z};
        Block b(threads, shared_bytes);
        block = &b;
        std::vector<std::thread> running;
        for (unsigned i = 0; i < threads; i++)
          running.emplace_back([&, i] {
            threadIdx = dim3{i, 0, 0};
            kernel(args...);
            async_land_all();
            b.warps[i / 32]->arrived.arrive_and_drop();
            b.all.arrive_and_drop();
          });
        for (auto &t : running) t.join();
        block = nullptr;
      }
}

}  // namespace emulation
