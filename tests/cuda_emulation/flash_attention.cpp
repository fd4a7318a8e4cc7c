// Runs models/kernels/src/cuda/flash_attention.cu on the CPU (emulate.h): the forward, then the
// backward's delta and both gradient kernels, on inputs a test wrote. tests/cuda_emulated.rs builds it with the kernel
// source as `kernel.cu` on the include path and compares the results with the CPU's attention.
//
// usage: flash_attention DIR bf16|f16 D BATCH HEADS KV_HEADS T S OFFSET CAUSAL WINDOW SCALE TOKEN_MAJOR
// reads DIR/{q,k,v,dout}.bin (half bits; with TOKEN_MAJOR 1 as (batch, len, heads, D)), writes
// DIR/{out,dq,dk,dv}.bin (half bits, in the same layout) and DIR/lse.bin (f32).
//        flash_attention DIR decode bf16|f16 D HEADS KV_HEADS WINDOW SCALE APPEND LEN...
// one sequence per LEN: reads DIR/q.bin (sequences x heads x D) and each sequence's cache blocks
// DIR/k<r>.bin, DIR/v<r>.bin (ceil(LEN / 64) blocks of kv_heads x 64 x D), with APPEND 1 also
// DIR/k_new.bin, DIR/v_new.bin (sequences x kv_heads x D) for the kernel to write at each last
// position; writes DIR/out.bin and (APPEND 1) the blocks back to DIR/k<r>.out, DIR/v<r>.out.

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kernel.cu"

using Bits = std::vector<unsigned short>;

static std::vector<char> read_file(const std::string &path, size_t bytes) {
  std::vector<char> data(bytes);
  FILE *f = std::fopen(path.c_str(), "rb");
  if (!f || std::fread(data.data(), 1, bytes, f) != bytes) {
    std::fprintf(stderr, "%s: cannot read %zu bytes\n", path.c_str(), bytes);
    std::exit(2);
  }
  std::fclose(f);
  return data;
}

template <class T>
static std::vector<T> read_values(const std::string &path, size_t n) {
  auto bytes = read_file(path, n * sizeof(T));
  std::vector<T> v(n);
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

template <class T>
static void write_values(const std::string &path, const std::vector<T> &v) {
  FILE *f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(v.data(), sizeof(T), v.size(), f) != v.size()) {
    std::fprintf(stderr, "%s: cannot write\n", path.c_str());
    std::exit(2);
  }
  std::fclose(f);
}

struct Kernels {
  void (*forward)(const half_bits *, const half_bits *, const half_bits *, half_bits *, float *, Shape);
  void (*delta)(const half_bits *, const half_bits *, float *, long long, Shape);
  void (*dq)(const half_bits *, const half_bits *, const half_bits *, const half_bits *, const float *, const float *, half_bits *, Shape);
  void (*dkv)(const half_bits *, const half_bits *, const half_bits *, const half_bits *, const float *, const float *, half_bits *, half_bits *,
              float *, Shape);
  void (*dkv_sum)(const float *, half_bits *, half_bits *, long long, Shape);
};

#define KERNELS(NAME, D) \
  Kernels{flash_forward_##NAME##_d##D, flash_backward_delta_##NAME##_d##D, flash_backward_dq_##NAME##_d##D, flash_backward_dkv_##NAME##_d##D, \
          flash_backward_dkv_sum_##NAME##_d##D}

static int decode_main(int argc, char **argv) {
  std::string dir = argv[1], dtype = argv[3];
  int d = std::atoi(argv[4]), heads = std::atoi(argv[5]), kv_heads = std::atoi(argv[6]);
  Decode s{heads, kv_heads, 0, std::atoi(argv[7]), (float)std::atof(argv[8])};
  bool append = std::atoi(argv[9]) != 0;
  std::vector<int> lens;
  for (int i = 10; i < argc; i++) lens.push_back(std::atoi(argv[i]));
  int seqs = (int)lens.size();
  for (int len : lens) s.max_blocks = std::max(s.max_blocks, (len + CACHE_BLOCK - 1) / CACHE_BLOCK);
  auto q = read_values<half_bits>(dir + "/q.bin", (size_t)seqs * heads * d);
  std::vector<Bits> k(seqs), v(seqs);
  size_t entries = (size_t)seqs * s.max_blocks;
  std::vector<unsigned long long> table(2 * entries + seqs, 0);
  size_t block = (size_t)kv_heads * CACHE_BLOCK * d;
  for (int r = 0; r < seqs; r++) {
    int blocks = (lens[r] + CACHE_BLOCK - 1) / CACHE_BLOCK;
    k[r] = read_values<half_bits>(dir + "/k" + std::to_string(r) + ".bin", blocks * block);
    v[r] = read_values<half_bits>(dir + "/v" + std::to_string(r) + ".bin", blocks * block);
    for (int b = 0; b < blocks; b++) {
      table[(size_t)r * s.max_blocks + b] = (unsigned long long)(k[r].data() + b * block);
      table[entries + (size_t)r * s.max_blocks + b] = (unsigned long long)(v[r].data() + b * block);
    }
    table[2 * entries + r] = (unsigned long long)lens[r];
  }
  decltype(&flash_decode_bf16_d64) kernel;
  if (dtype == "bf16" && d == 64) kernel = flash_decode_bf16_d64;
  else if (dtype == "bf16" && d == 128) kernel = flash_decode_bf16_d128;
  else if (dtype == "f16" && d == 64) kernel = flash_decode_f16_d64;
  else if (dtype == "f16" && d == 128) kernel = flash_decode_f16_d128;
  else {
    std::fprintf(stderr, "no decode kernel for %s, head dim %d\n", dtype.c_str(), d);
    return 2;
  }
  Bits k_new, v_new;
  if (append) {
    k_new = read_values<half_bits>(dir + "/k_new.bin", (size_t)seqs * kv_heads * d);
    v_new = read_values<half_bits>(dir + "/v_new.bin", (size_t)seqs * kv_heads * d);
  }
  Bits out((size_t)seqs * heads * d);
  unsigned head_chunks = (unsigned)((heads / kv_heads + 15) / 16);
  const half_bits *kn = append ? k_new.data() : nullptr, *vn = append ? v_new.data() : nullptr;
  emulation::launch(kernel, dim3{(unsigned)seqs, (unsigned)kv_heads, head_chunks}, WARPS * 32, 0, q.data(), kn, vn, table.data(), out.data(),
                    s);
  write_values(dir + "/out.bin", out);
  for (int r = 0; r < seqs && append; r++) {
    write_values(dir + "/k" + std::to_string(r) + ".out", k[r]);
    write_values(dir + "/v" + std::to_string(r) + ".out", v[r]);
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc > 2 && std::string(argv[2]) == "decode") return decode_main(argc, argv);
  if (argc != 14 && argc != 15) {
    std::fprintf(stderr, "usage: %s DIR bf16|f16 D BATCH HEADS KV_HEADS T S OFFSET CAUSAL WINDOW SCALE TOKEN_MAJOR [VARIANTS]\n", argv[0]);
    return 2;
  }
  // VARIANTS 1: the kernels at head dim 64 that a switch launches instead run too, and must give
  // the default's bits: the forward with one group of 16 rows a warp (FSDP_FLASH_FORWARD_GROUPS=1;
  // each query row's arithmetic is the same, the tiles a wider block adds being masked for it),
  // dq staging 32 keys a step (FSDP_FLASH_DQ_KEYS=32) and dk/dv 32 queries
  // (FSDP_FLASH_DKV_QUERIES=32): the same 16-key or 16-query chunks summed in the same order.
  bool variants = argc == 15 && std::atoi(argv[14]) != 0;
  std::string dir = argv[1], dtype = argv[2];
  int d = std::atoi(argv[3]), batch = std::atoi(argv[4]);
  Shape s{std::atoi(argv[7]), std::atoi(argv[8]), std::atoi(argv[5]), std::atoi(argv[6]), std::atoi(argv[9]), std::atoi(argv[10]), std::atoi(argv[11]),
          (float)std::atof(argv[12]), std::atoi(argv[13])};
  Kernels k;
  if (dtype == "bf16" && d == 64) k = KERNELS(bf16, 64);
  else if (dtype == "bf16" && d == 128) k = KERNELS(bf16, 128);
  else if (dtype == "f16" && d == 64) k = KERNELS(f16, 64);
  else if (dtype == "f16" && d == 128) k = KERNELS(f16, 128);
  else {
    std::fprintf(stderr, "no kernels for %s, head dim %d\n", dtype.c_str(), d);
    return 2;
  }
  if (variants && d != 64) {
    std::fprintf(stderr, "the variant kernels are built at head dim 64 only, not %d\n", d);
    return 2;
  }
  size_t rows = (size_t)batch * s.heads * s.t_len, kv_rows = (size_t)batch * s.kv_heads * s.s_len;
  auto q = read_values<half_bits>(dir + "/q.bin", rows * d), dout = read_values<half_bits>(dir + "/dout.bin", rows * d);
  auto kk = read_values<half_bits>(dir + "/k.bin", kv_rows * d), v = read_values<half_bits>(dir + "/v.bin", kv_rows * d);
  Bits out(rows * d), dq(rows * d), dk(kv_rows * d), dv(kv_rows * d);
  std::vector<float> lse(rows), delta(rows);

  const unsigned threads = WARPS * 32, rows_per_block = ROWS;
  dim3 queries{(unsigned)(s.t_len + rows_per_block - 1) / rows_per_block, (unsigned)(batch * s.heads), 1};
  dim3 keys{(unsigned)(s.s_len + rows_per_block - 1) / rows_per_block, (unsigned)(batch * s.heads), 1};
  // The forward's blocks hold FORWARD_GROUPS(d) times the rows (a warp 16 of them per group).
  const unsigned forward_rows = rows_per_block * FORWARD_GROUPS(d);
  dim3 forward_queries{(unsigned)(s.t_len + forward_rows - 1) / forward_rows, (unsigned)(batch * s.heads), 1};
  emulation::launch(k.forward, forward_queries, threads, 0, q.data(), kk.data(), v.data(), out.data(), lse.data(), s);
  if (variants) {
    auto forward = dtype == "bf16" ? flash_forward_one_group_bf16_d64 : flash_forward_one_group_f16_d64;
    Bits out1(rows * d);
    std::vector<float> lse1(rows);
    emulation::launch(forward, queries, threads, 0, q.data(), kk.data(), v.data(), out1.data(), lse1.data(), s);
    for (size_t i = 0; i < rows * d; i++)
      if (out1[i] != out[i]) {
        std::fprintf(stderr, "one-group forward: out[%zu] %04x, two groups %04x\n", i, (unsigned)out1[i], (unsigned)out[i]);
        return 3;
      }
    if (std::memcmp(lse1.data(), lse.data(), rows * sizeof(float)) != 0) {
      std::fprintf(stderr, "one-group forward: log-sum-exp bits differ from two groups'\n");
      return 3;
    }
  }
  emulation::launch(k.delta, dim3{(unsigned)((rows + WARPS - 1) / WARPS), 1, 1}, threads, 0, dout.data(), out.data(), delta.data(), (long long)rows, s);
  emulation::launch(k.dq, queries, threads, 0, q.data(), kk.data(), v.data(), dout.data(), lse.data(), delta.data(), dq.data(), s);
  if (variants) {
    Bits dq32(rows * d);
    auto dq_k32 = dtype == "bf16" ? flash_backward_dq_k32_bf16_d64 : flash_backward_dq_k32_f16_d64;
    emulation::launch(dq_k32, queries, threads, 0, q.data(), kk.data(), v.data(), dout.data(), lse.data(), delta.data(), dq32.data(), s);
    if (dq32 != dq) {
      std::fprintf(stderr, "32-key dq: bits differ from 64 keys'\n");
      return 3;
    }
  }
  // As the op launches them: with GQA each query head's share in f32 (NaN until written), then
  // their sums.
  bool gqa = s.heads != s.kv_heads;
  auto dkv = [&](decltype(k.dkv) kernel, Bits &dk, Bits &dv) {
    std::vector<float> partial(gqa ? 2 * rows / s.t_len * s.s_len * d : 0, std::nanf(""));
    emulation::launch(kernel, keys, threads, 0, q.data(), kk.data(), v.data(), dout.data(), lse.data(), delta.data(), dk.data(), dv.data(),
                      gqa ? partial.data() : nullptr, s);
    if (gqa) {
      long long values = (long long)kv_rows * d;
      emulation::launch(k.dkv_sum, dim3{(unsigned)((values / 2 + threads - 1) / threads), 1, 1}, threads, 0, partial.data(), dk.data(),
                        dv.data(), values, s);
    }
  };
  dkv(k.dkv, dk, dv);
  if (variants) {
    Bits dk32(kv_rows * d), dv32(kv_rows * d);
    dkv(dtype == "bf16" ? flash_backward_dkv_q32_bf16_d64 : flash_backward_dkv_q32_f16_d64, dk32, dv32);
    if (dk32 != dk || dv32 != dv) {
      std::fprintf(stderr, "32-query dk/dv: bits differ from 64 queries'\n");
      return 3;
    }
  }
  write_values(dir + "/out.bin", out);
  write_values(dir + "/lse.bin", lse);
  write_values(dir + "/dq.bin", dq);
  write_values(dir + "/dk.bin", dk);
  write_values(dir + "/dv.bin", dv);
  return 0;
}
