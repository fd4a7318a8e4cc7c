// Runs models/kernels/src/cuda/fused.cu on the CPU (emulate.h) with the launch shapes of
// models/ops/src/fused_cuda.rs, on inputs a test wrote. tests/cuda_emulated.rs builds it with the
// kernel source as `kernel.cu` on the include path and compares the results with the CPU ops.
//
// usage: fused DIR f32|bf16 rms_norm ROWS N EPS      reads x, w, g; writes y, grads ((ROWS + 1) x N)
//        fused DIR f32|bf16 swiglu N                  reads a, b, g; writes y, grads (2N)
//        fused DIR f32|bf16 rope ROWS SEQ HEADS HALF  reads x, cos, sin, g; writes y, grads (g rotated back)
//        fused DIR f32|bf16 cross_entropy ROWS VOCAB  reads x, targets (i64), g (f32); writes loss (f32), grads
//        fused DIR f32|bf16 embedding TOKENS COUNT N VOCAB  reads g, runs (u32); writes grads (f32, VOCAB x N)
// Every file holds raw values of the dtype (bf16 as its bits).

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kernel.cu"

static std::string dir;

template <class T>
static std::vector<T> read_values(const std::string &name, size_t n) {
  std::vector<T> v(n);
  std::string path = dir + "/" + name + ".bin";
  FILE *f = std::fopen(path.c_str(), "rb");
  if (!f || std::fread(v.data(), sizeof(T), n, f) != n) {
    std::fprintf(stderr, "%s: cannot read %zu values\n", path.c_str(), n);
    std::exit(2);
  }
  std::fclose(f);
  return v;
}

template <class T>
static void write_values(const std::string &name, const std::vector<T> &v) {
  std::string path = dir + "/" + name + ".bin";
  FILE *f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(v.data(), sizeof(T), v.size(), f) != v.size()) {
    std::fprintf(stderr, "%s: cannot write\n", path.c_str());
    std::exit(2);
  }
  std::fclose(f);
}

// fused_cuda.rs's launch shapes.
static const unsigned WARPS_PER_BLOCK = 8, BACKWARD_BLOCKS = 1024, ELEMENTWISE_BLOCKS = 4096;
static dim3 blocks(unsigned long long n) { return dim3{(unsigned)n, 1, 1}; }
static dim3 elementwise(unsigned long long n) { return blocks(std::min(std::max((n + 255) / 256, 1ull), (unsigned long long)ELEMENTWISE_BLOCKS)); }

// One dtype's kernels of the source.
#define KERNELS(STRUCT, NAME)                                             \
  struct STRUCT {                                                         \
    static constexpr auto norm_forward = rms_norm_forward_##NAME;         \
    static constexpr auto norm_rows = rms_norm_backward_rows_##NAME;      \
    static constexpr auto norm_weight = rms_norm_backward_weight_##NAME;  \
    static constexpr auto glu_forward = swiglu_forward_##NAME;            \
    static constexpr auto glu_backward = swiglu_backward_##NAME;          \
    static constexpr auto rotate = rope_##NAME;                           \
    static constexpr auto entropy_forward = cross_entropy_forward_##NAME; \
    static constexpr auto entropy_backward = cross_entropy_backward_##NAME; \
    static constexpr auto embedding = embedding_backward_##NAME;          \
  };
KERNELS(Kernels32, f32)
KERNELS(KernelsBf16, bf16)

template <class T, class K>
static int run(const std::string &op, char **args, int count) {
  auto arg = [&](int i) { return std::atoll(args[i]); };
  if (op == "rms_norm" && count == 3) {
    Norm p{arg(0), (int)arg(1), (float)std::atof(args[2])};
    size_t n = (size_t)p.rows * p.n;
    auto x = read_values<T>("x", n), w = read_values<T>("w", p.n), g = read_values<T>("g", n);
    std::vector<T> y(n), grads(n + p.n);
    std::vector<float> dw(p.n, 0.0f);
    unsigned long long row_blocks = (p.rows + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK;
    emulation::launch(K::norm_forward, blocks(row_blocks), 32 * WARPS_PER_BLOCK, 0, x.data(), w.data(), y.data(), p);
    emulation::launch(K::norm_rows, blocks(std::min(row_blocks, (unsigned long long)BACKWARD_BLOCKS)), 32 * WARPS_PER_BLOCK, p.n * sizeof(float),
                      x.data(), w.data(), g.data(), grads.data(), dw.data(), p);
    emulation::launch(K::norm_weight, blocks((p.n + 255) / 256), 256, 0, dw.data(), grads.data(), p);
    write_values("y", y);
    write_values("grads", grads);
  } else if (op == "swiglu" && count == 1) {
    long long n = arg(0);
    auto a = read_values<T>("a", n), b = read_values<T>("b", n), g = read_values<T>("g", n);
    std::vector<T> y(n), grads(2 * n);
    emulation::launch(K::glu_forward, elementwise(n), 256, 0, a.data(), b.data(), y.data(), n);
    emulation::launch(K::glu_backward, elementwise(n), 256, 0, a.data(), b.data(), g.data(), grads.data(), n);
    write_values("y", y);
    write_values("grads", grads);
  } else if (op == "rope" && count == 4) {
    Rotation p{arg(0), (int)arg(1), (int)arg(2), (int)arg(3), 1.0f};
    size_t n = (size_t)p.rows * 2 * p.half, table = (size_t)p.seq * p.half;
    auto x = read_values<T>("x", n), cos = read_values<T>("cos", table), sin = read_values<T>("sin", table), g = read_values<T>("g", n);
    std::vector<T> y(n), grads(n);
    emulation::launch(K::rotate, elementwise(n / 2), 256, 0, x.data(), cos.data(), sin.data(), y.data(), p);
    p.sign = -1.0f;
    emulation::launch(K::rotate, elementwise(n / 2), 256, 0, g.data(), cos.data(), sin.data(), grads.data(), p);
    write_values("y", y);
    write_values("grads", grads);
  } else if (op == "cross_entropy" && count == 2) {
    Entropy p{arg(0), (int)arg(1)};
    size_t n = (size_t)p.rows * p.vocab;
    auto x = read_values<T>("x", n);
    auto targets = read_values<long long>("targets", p.rows);
    auto g = read_values<float>("g", p.rows);
    std::vector<float> loss(p.rows), g_and_loss(2 * p.rows);
    std::vector<T> grads(n);
    emulation::launch(K::entropy_forward, blocks(p.rows), 256, 0, x.data(), targets.data(), loss.data(), p);
    std::copy(g.begin(), g.end(), g_and_loss.begin());
    std::copy(loss.begin(), loss.end(), g_and_loss.begin() + p.rows);
    emulation::launch(K::entropy_backward, blocks(p.rows), 256, 0, x.data(), targets.data(), g_and_loss.data(), grads.data(), p);
    write_values("loss", loss);
    write_values("grads", grads);
  } else if (op == "embedding" && count == 4) {
    int tokens = (int)arg(0), runs_count = (int)arg(1), n = (int)arg(2);
    long long vocab = arg(3);
    auto g = read_values<T>("g", (size_t)tokens * n);
    auto runs = read_values<unsigned>("runs", (size_t)tokens + 2 * runs_count + 1);
    std::vector<float> dw((size_t)vocab * n, 0.0f);
    emulation::launch(K::embedding, dim3{(unsigned)runs_count, (unsigned)(n + 255) / 256, 1}, 256, 0, g.data(), runs.data(), dw.data(), tokens,
                      runs_count, n);
    write_values("grads", dw);
  } else {
    std::fprintf(stderr, "unknown op or arguments: %s\n", op.c_str());
    return 2;
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s DIR f32|bf16 OP ARGS...\n", argv[0]);
    return 2;
  }
  dir = argv[1];
  std::string dtype = argv[2], op = argv[3];
  if (dtype == "f32") return run<float, Kernels32>(op, argv + 4, argc - 4);
  if (dtype == "bf16") return run<bf16_t, KernelsBf16>(op, argv + 4, argc - 4);
  std::fprintf(stderr, "no kernels for %s\n", dtype.c_str());
  return 2;
}
