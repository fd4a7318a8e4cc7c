// Runs our CUDA sources as C++ on the CPU, for tests on machines without a GPU: each GPU thread of
// a block is a fiber here (blocks run one after another), `__syncthreads` a barrier of the block,
// warp shuffles and the tensor-core `mma` collectives of 32 threads. Only what our kernels use.
//
// The fibers take turns on one thread, each running until it waits at a barrier: every `mma` and
// shuffle is two barriers of its warp, and as threads (each GPU thread a thread, as this was at
// first) those waits were most of the emulation's time, spent in the OS scheduler. Under
// ThreadSanitizer each fiber is one of its fibers, ordered with the others by the barriers'
// atomics alone, so it reports what it reported of threads: two GPU threads of a block touching
// the same memory with no barrier between them.
//
// The sources take `FSDP_CUDA_EMULATION` to call `emulation::mma` / `emulation::pack` where the GPU
// runs inline PTX. The emulated mma follows the fragment layouts of PTX ISA's "Matrix Fragments
// for mma.m16n8k16 with floating point type" (A row-major 16 x 16, B column-major 16 x 8, C/D
// 16 x 8 in f32); the GPU tests (tests/cuda/kernels.rs) check the same kernels against the CPU there.

#pragma once

#include <sys/mman.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
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
inline dim3 blockIdx, blockDim, gridDim;
namespace emulation {
// The running GPU thread's index (its fiber's, found from the stack it runs on).
inline unsigned running_index();
}  // namespace emulation
#define threadIdx (dim3{emulation::running_index(), 0, 0})

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

// A fiber's wait until `*phase` is no longer `seen`: back to the scheduler, which runs the others
// meanwhile (`launch`).
inline void wait_turn(const std::atomic<unsigned> *phase, unsigned seen);

// A block's or a warp's barrier. Atomics, though the fibers share one thread: for
// ThreadSanitizer they are what orders the fibers (acquiring the phase its last arrival released).
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
    while (!drop && phase_.load(std::memory_order_acquire) == phase) wait_turn(&phase_, phase);
  }
  std::atomic<int> expected_, waiting_;
  std::atomic<unsigned> phase_{0};
};

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
// The running fiber's.
inline AsyncCopies &copies();

inline void copy_async(void *dst, const void *src, size_t bytes, bool valid) {
  require_aligned(dst, bytes, "cp.async's shared-memory destination");
  require_aligned(src, bytes, "cp.async's global source");
  std::memset(dst, 0xff, bytes);
  copies().open.push_back({dst, src, bytes, valid});
}

inline void async_commit() {
  copies().groups.push_back(std::move(copies().open));
  copies().open.clear();
}

// cp.async.wait_group: lands the thread's committed groups but the newest `pending`.
inline void async_wait(size_t pending) {
  while (copies().groups.size() > pending) {
    for (const AsyncCopy &c : copies().groups.front()) c.land();
    copies().groups.pop_front();
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

// Fibers: where each stopped, and its state. Fiber `i` runs GPU thread `i` of the block, on stack
// slot `i` (kept from launch to launch): which fiber runs is known from the stack pointer, so
// that the scheduler writes no "running" variable that every fiber reads (for ThreadSanitizer
// each such write would race with the last fiber's reads).
struct Fiber {
  void *sp = nullptr;           // its stack pointer while another runs
  const void *stack = nullptr;  // lowest address (a fiber's: a guard page below it)
  size_t stack_size = 0;
  void *fake_stack = nullptr;   // AddressSanitizer's, across a switch
#if defined(__SANITIZE_THREAD__)
  void *tsan_fiber = nullptr;
#endif
  // Written by the fiber, read by the scheduler: atomics, for ThreadSanitizer (its fibers'
  // switches to the scheduler order nothing).
  std::atomic<bool> done{false};
  // While it waits at a barrier: the barrier's phase, and the phase it arrived in.
  std::atomic<const std::atomic<unsigned> *> phase{nullptr};
  std::atomic<unsigned> seen{0};
  AsyncCopies copies;

  // The scheduler's look, for every fiber at every switch: left out of ThreadSanitizer's
  // instrumentation (most of its time, otherwise), which needs none of it.
  __attribute__((no_sanitize_thread)) bool runnable() const {
    const std::atomic<unsigned> *p = phase.load(std::memory_order_relaxed);
    return !done.load(std::memory_order_relaxed) && (p == nullptr || p->load(std::memory_order_relaxed) != seen.load(std::memory_order_relaxed));
  }
};
// CUDA's largest block; each slot a guard page, then the stack.
inline constexpr unsigned MAX_THREADS = 1024;
inline constexpr size_t FIBER_STACK = 256 * 1024, GUARD = 4096, SLOT = GUARD + FIBER_STACK;
inline char *stacks = nullptr;  // mapped at the first launch (MAP_NORESERVE: only used pages count)
inline Fiber fibers[MAX_THREADS];
inline Fiber scheduler;  // the launching thread's own stack
inline const std::function<void()> *fiber_body = nullptr;
// Each finished fiber adds one, releasing; the scheduler acquires it once the block is done, so
// that for ThreadSanitizer the next block's fibers come after this block's.
inline std::atomic<unsigned> fibers_finished{0};

// The first of `threads` fibers that can run (`threads`: none).
__attribute__((no_sanitize_thread)) inline unsigned first_runnable(unsigned threads) {
  unsigned i = 0;
  while (i < threads && !fibers[i].runnable()) i++;
  return i;
}

inline unsigned running_index() {
  return static_cast<unsigned>((reinterpret_cast<uintptr_t>(__builtin_frame_address(0)) - reinterpret_cast<uintptr_t>(stacks)) / SLOT);
}
inline Fiber &running_fiber() { return fibers[running_index()]; }
inline AsyncCopies &copies() { return running_fiber().copies; }

// Saves the callee-saved registers and the stack pointer in *from, loads `to`'s and returns
// there (System V x86-64: all else is the caller's to save).
extern "C" void fsdp_emulation_switch(void **from, void *to);
asm(R"(
  .text
  .globl fsdp_emulation_switch
  .type fsdp_emulation_switch, @function
fsdp_emulation_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size fsdp_emulation_switch, .-fsdp_emulation_switch
)");

// From the running stack to `to`'s, telling AddressSanitizer (whose stack checks need to know
// which stack is in use) and ThreadSanitizer (which orders the scheduler's writes before the
// fiber it runs, and nothing of a fiber before what runs after it); `ending`: the running fiber
// never comes back. Neither this nor `fiber_start` is instrumented by AddressSanitizer, so a
// finished fiber's stack keeps no poisoned frame for the next fiber on it.
__attribute__((noinline, no_sanitize_address)) inline void switch_to(Fiber &from, Fiber &to, bool ending = false) {
#if defined(__SANITIZE_THREAD__)
  __tsan_switch_to_fiber(to.tsan_fiber, &from == &scheduler ? 0 : __tsan_switch_to_fiber_no_sync);
#endif
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(ending ? nullptr : &from.fake_stack, to.stack, to.stack_size);
#endif
  fsdp_emulation_switch(&from.sp, to.sp);
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(from.fake_stack, nullptr, nullptr);
#endif
}

// Where a fiber's first switch lands: runs the launch's body, then leaves for good.
__attribute__((noinline, no_sanitize_address)) inline void fiber_start() {
#if defined(__SANITIZE_ADDRESS__)
  // The scheduler's stack, for the switches back to it.
  __sanitizer_finish_switch_fiber(nullptr, &scheduler.stack, &scheduler.stack_size);
#endif
  (*fiber_body)();
  Fiber &self = running_fiber();
  fibers_finished.fetch_add(1, std::memory_order_release);
  self.done.store(true, std::memory_order_relaxed);
  switch_to(self, scheduler, true);
  __builtin_trap();
}

inline void wait_turn(const std::atomic<unsigned> *phase, unsigned seen) {
  Fiber &self = running_fiber();
  self.seen.store(seen, std::memory_order_relaxed);
  self.phase.store(phase, std::memory_order_relaxed);
  switch_to(self, scheduler);
  self.phase.store(nullptr, std::memory_order_relaxed);
}

// Fiber `i`, made ready to start: its stack holding what `fsdp_emulation_switch` pops, zeroed
// registers and `fiber_start` as its return address, so that `fiber_start` begins as a called
// function would (its stack pointer 8 past 16-aligned).
inline void fresh_fiber(unsigned i) {
  if (stacks == nullptr) {
    void *m = mmap(nullptr, MAX_THREADS * SLOT, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) std::abort();
    stacks = static_cast<char *>(m);
    for (unsigned k = 0; k < MAX_THREADS; k++) mprotect(stacks + k * SLOT, GUARD, PROT_NONE);
  }
  Fiber &f = fibers[i];
  f.stack = stacks + i * SLOT + GUARD;
  f.stack_size = FIBER_STACK;
  f.done.store(false, std::memory_order_relaxed);
  f.copies = AsyncCopies{};
#if defined(__SANITIZE_THREAD__)
  // Made once and kept: each switch from the scheduler orders what it did before (the last
  // block's fibers ended, acquired through `fibers_finished`) before what the fiber does next.
  if (f.tsan_fiber == nullptr) f.tsan_fiber = __tsan_create_fiber(0);
#endif
  void **top = reinterpret_cast<void **>(stacks + (i + 1) * SLOT);
  *--top = nullptr;  // fiber_start's caller, never returned to
  *--top = reinterpret_cast<void *>(&fiber_start);
  for (int r = 0; r < 6; r++) *--top = nullptr;  // rbp, rbx, r12-r15
  f.sp = top;
}

// Runs `kernel(args...)` over `grid` blocks of `threads` threads (a multiple of 32) with
// `shared_bytes` of dynamic shared memory, a block at a time, its threads as fibers. The first
// fiber that can run runs, until it waits: so the first warp runs ahead of the others as far as
// the block's barriers let it, and where a barrier is missing (a tile refilled while other warps
// still read it) they read what it wrote. A thread that returns leaves the block's and its warp's
// barriers, as exited GPU threads do. Threads left that all wait are a deadlock (a barrier that
// some thread of the block never reaches: a GPU would hang), reported.
template <class... Params, class... Args>
inline void launch(void (*kernel)(Params...), dim3 grid, unsigned threads, size_t shared_bytes, Args... args) {
#if defined(__SANITIZE_THREAD__)
  // Once: the fibers that end read it after their last release (the switch back).
  if (scheduler.tsan_fiber == nullptr) scheduler.tsan_fiber = __tsan_get_current_fiber();
#endif
  gridDim = grid;
  blockDim = dim3{threads, 1, 1};
  for (unsigned z = 0; z < grid.z; z++)
    for (unsigned y = 0; y < grid.y; y++)
      for (unsigned x = 0; x < grid.x; x++) {
        blockIdx = dim3{x, y, z};
        Block b(threads, shared_bytes);
        block = &b;
        const std::function<void()> body = [&] {
          unsigned i = threadIdx.x;
          kernel(args...);
          async_land_all();
          b.warps[i / 32]->arrived.arrive_and_drop();
          b.all.arrive_and_drop();
        };
        fiber_body = &body;
        if (threads > MAX_THREADS) std::abort();
        for (unsigned i = 0; i < threads; i++) fresh_fiber(i);
        for (unsigned left = threads; left > 0;) {
          unsigned i = first_runnable(threads);
          if (i == threads) {
            std::fprintf(stderr, "deadlock: block (%u, %u, %u): every running thread waits at a barrier\n", x, y, z);
            std::abort();
          }
          Fiber &f = fibers[i];
          switch_to(scheduler, f);
          left -= f.done.load(std::memory_order_relaxed);
        }
        fibers_finished.load(std::memory_order_acquire);
        block = nullptr;
      }
}

}  // namespace emulation
