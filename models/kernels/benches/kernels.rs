//! `cargo bench -p kernels`: each CPU kernel family on its own, at every SIMD level this CPU has,
//! on the shapes of SmolLM2-135M (hidden 576, MLP 1536, 9 heads of 64 over 3 kv heads): time per
//! call (best of several rounds) and the level's speed over the scalar reference.
//!
//! Each level runs in a child process of this binary with `FSDP_SIMD` set, so that the kernels
//! that read the process's table (matrix products, attention, AdamW) run at that level as in
//! `finetune` and `serve`. Threads: candle's pool, `RAYON_NUM_THREADS` when set, else all cores.
//! How to read and compare with the peers' benches: docs/benchmarks.md.

use std::process::Command;
use std::time::Instant;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::Module;
use half::{bf16, f16};
use kernels::paged_attention::{self, KvView};
use kernels::quant_blocks::{BlockFormat, BlockMatrix};
use kernels::rng::signed_values;
use kernels::simd::{CpuFeatures, Kernels, SimdLevel};

/// Set in the children: the level they measure.
const CHILD: &str = "KERNELS_BENCH_CHILD";
const ROUNDS: usize = 20;

const HIDDEN: usize = 576;
const MLP: usize = 1536;
const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const CONTEXT: usize = 1024;
const VOCAB: usize = 49152;

fn main() {
    if std::env::var_os(CHILD).is_some() {
        return measure_this_level();
    }
    let features = CpuFeatures::detected();
    println!("CPU: {}", cpu_model());
    println!(
        "features: avx2 {} fma {} f16c {} avx512f {} avx512_vnni {} avx_vnni {} amx_bf16 {}; best level {:?}",
        features.avx2,
        features.fma,
        features.f16c,
        features.avx512f,
        features.avx512vnni,
        features.avxvnni,
        features.amx_bf16,
        features.best_level()
    );
    // Each FSDP_SIMD value this CPU can run: the levels, AVX2 with AVX-VNNI where it has that
    // (only the int8 block products differ there), and `best` where AMX tiles are granted (only
    // the bf16 products differ there from `avx512`).
    let best = features.best_level();
    let columns_run = [
        ("scalar", true),
        ("avx2", best >= SimdLevel::Avx2),
        ("avx2-vnni", best >= SimdLevel::Avx2 && features.avxvnni),
        ("avx512", best >= SimdLevel::Avx512),
        ("best", best >= SimdLevel::Avx512 && features.amx_bf16),
    ];
    // Per switch value: its rows in the order measured.
    let mut columns: Vec<(&str, Vec<(String, f64)>)> = vec![];
    for name in columns_run.iter().filter(|(_, runs)| *runs).map(|(name, _)| *name) {
        let out = Command::new(std::env::current_exe().expect("own path"))
            .env(CHILD, "1")
            .env("FSDP_SIMD", name)
            .output()
            .expect("running the bench at one level");
        assert!(out.status.success(), "level {name}: {}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout);
        for note in stdout.lines().filter(|l| l.starts_with('#')) {
            println!("{name}: {}", note.trim_start_matches("# "));
        }
        let rows = stdout
            .lines()
            .filter_map(|l| l.split_once('\t'))
            .map(|(k, v)| (k.to_string(), v.parse::<f64>().expect("microseconds")))
            .collect();
        columns.push((name, rows));
    }
    print!("\n{:<44}", "kernel (µs per call, best of 20)");
    for (name, _) in &columns {
        print!("{name:>10}");
    }
    println!("{:>12}", "best/scalar");
    for (i, (row, scalar)) in columns[0].1.iter().enumerate() {
        print!("{row:<44}");
        let mut best = *scalar;
        for (_, col) in &columns {
            let us = col[i].1;
            best = best.min(us);
            print!("{us:>10.1}");
        }
        println!("{:>11.2}x", scalar / best);
    }
}

/// The child: every kernel at the level `FSDP_SIMD` chose, one `name\tmicroseconds` line each.
fn measure_this_level() {
    let level = SimdLevel::current();
    let row = |name: &str, us: f64| println!("{name}\t{us}");
    let kernels = Kernels::get();

    // Training's products: x (256 tokens) · Wᵀ through the process's matrix kernels.
    let x = signed_values(256 * HIDDEN, 1);
    let w = signed_values(MLP * HIDDEN, 2);
    println!("# f32 products on {:?} kernels ({})", kernels.matmul(), kernels::matmul::kernels_in_use());
    row(&format!("matmul 256x{HIDDEN}x{MLP}"), best_us(|| drop(kernels::matmul::parallel::product_wt(&x, &w, MLP, HIDDEN))));
    // The backward's products of that layer, operands read in place: `dx = dy · W` (W row-major)
    // and `dW = dyᵀ · x` (dy transposed as lhs).
    let dy = signed_values(256 * MLP, 17);
    let dx = || drop(kernels::matmul::parallel::product(256, HIDDEN, MLP, (&dy, 1, MLP as isize), (&w, 1, HIDDEN as isize)));
    row(&format!("matmul dx 256x{MLP}x{HIDDEN}"), best_us(dx));
    let dw = || drop(kernels::matmul::parallel::product(MLP, HIDDEN, 256, (&dy, MLP as isize, 1), (&x, 1, HIDDEN as isize)));
    row(&format!("matmul dW {MLP}x256x{HIDDEN}"), best_us(dw));
    // A short prompt's products (one row block: the weight's panels packed as they are used).
    let x46 = signed_values(46 * HIDDEN, 16);
    row(&format!("matmul 46x{HIDDEN}x{MLP}"), best_us(|| drop(kernels::matmul::parallel::product_wt(&x46, &w, MLP, HIDDEN))));
    // The same under training's bf16 products (AMX-BF16 tiles at `best`; f32 elsewhere).
    let bf16_products = || kernels::matmul::with_bf16_products(true, || drop(kernels::matmul::parallel::product_wt(&x, &w, MLP, HIDDEN)));
    row(&format!("matmul 256x{HIDDEN}x{MLP}, bf16 products"), best_us(bf16_products));

    // Decoding's products of one row, per weight dtype.
    let x1 = signed_values(HIDDEN, 3);
    row(&format!("gemv f32 1x{HIDDEN}x{MLP}"), best_us(|| drop(kernels::gemv::gemv_rows(&x1, 1, &w, MLP, HIDDEN, level))));
    let w16: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
    row(&format!("gemv f16 1x{HIDDEN}x{MLP}"), best_us(|| drop(kernels::gemv::gemv_rows(&x1, 1, &w16, MLP, HIDDEN, level))));
    let wb16: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    row(&format!("gemv bf16 1x{HIDDEN}x{MLP}"), best_us(|| drop(kernels::gemv::gemv_rows(&x1, 1, &wb16, MLP, HIDDEN, level))));
    // A decoding step streams every weight from DRAM: the same product over a matrix no cache
    // holds (SmolLM2's LM head four times over, 453 MB), where the kernel's reading pattern shows.
    let tall = 4 * VOCAB;
    let w_tall = signed_values(tall * HIDDEN, 8);
    row(&format!("gemv f32 1x{HIDDEN}x{tall} (DRAM)"), best_us(|| drop(kernels::gemv::gemv_rows(&x1, 1, &w_tall, tall, HIDDEN, level))));
    let w_tall16: Vec<f16> = w_tall.iter().map(|&v| f16::from_f32(v)).collect();
    drop(w_tall);
    row(&format!("gemv f16 1x{HIDDEN}x{tall} (DRAM)"), best_us(|| drop(kernels::gemv::gemv_rows(&x1, 1, &w_tall16, tall, HIDDEN, level))));
    drop(w_tall16);
    let x64 = signed_values(64 * HIDDEN, 5);
    row(&format!("half product f16 64x{HIDDEN}x{MLP}"), best_us(|| drop(kernels::matmul::half::product_wt(&x64, &w16, MLP, HIDDEN))));
    // bf16 weights (a bf16 GGUF, `--quantize bf16`): 16 streams' rows, a prompt's 64 and 512.
    let x512 = signed_values(512 * HIDDEN, 14);
    let x16b = signed_values(16 * HIDDEN, 15);
    row(&format!("half product bf16 16x{HIDDEN}x{MLP}"), best_us(|| drop(kernels::matmul::half::product_wt(&x16b, &wb16, MLP, HIDDEN))));
    row(&format!("half product bf16 64x{HIDDEN}x{MLP}"), best_us(|| drop(kernels::matmul::half::product_wt(&x64, &wb16, MLP, HIDDEN))));
    row(&format!("half product bf16 512x{HIDDEN}x{MLP}"), best_us(|| drop(kernels::matmul::half::product_wt(&x512, &wb16, MLP, HIDDEN))));
    let x4 = signed_values(4 * HIDDEN, 4);
    row(&format!("small batch f32 4x{HIDDEN}x{MLP}"), best_us(|| drop(kernels::small_batch::rows_many(&x4, 4, &[&w], HIDDEN, level))));
    let x16 = signed_values(16 * HIDDEN, 6);
    row(&format!("small batch f32 16x{HIDDEN}x{MLP}"), best_us(|| drop(kernels::small_batch::rows_many(&x16, 16, &[&w], HIDDEN, level))));

    // Quantised weights: a decode step's one row, 16 streams' rows and a prompt's 64.
    for format in [BlockFormat::Q4_0, BlockFormat::Q4_1, BlockFormat::Q5_0, BlockFormat::Q8_0] {
        let q = BlockMatrix::random(format, MLP, HIDDEN, 13);
        row(&format!("{format:?} 1x{HIDDEN}x{MLP}"), best_us(|| drop(q.multiply(&x1, level))));
        row(&format!("{format:?} 16x{HIDDEN}x{MLP}"), best_us(|| drop(q.multiply(&x16, level))));
        row(&format!("{format:?} 64x{HIDDEN}x{MLP}"), best_us(|| drop(q.multiply(&x64, level))));
    }
    // The K formats on the MLP's down product (rows of 1536, which their 256-value super-blocks
    // divide), ours beside candle's quantised matmul on the same blocks (which repacks them for
    // its own AVX2, VNNI and AMX tiles, whatever the level).
    let wd = signed_values(HIDDEN * MLP, 18);
    let wd = candle_core::Tensor::from_vec(wd, (HIDDEN, MLP), &candle_core::Device::Cpu).expect("tensor");
    for (format, dtype) in [(BlockFormat::Q4_K, GgmlDType::Q4K), (BlockFormat::Q5_K, GgmlDType::Q5K), (BlockFormat::Q6_K, GgmlDType::Q6K)] {
        let blocks = QTensor::quantize(&wd, dtype).expect("quantise");
        let ours = BlockMatrix::new(format, HIDDEN, MLP, blocks.data().expect("blocks").into_owned()).expect("whole blocks");
        let theirs = QMatMul::from_qtensor(blocks).expect("candle's matmul");
        for m in [1, 16, 64] {
            let x = signed_values(m * MLP, 19);
            row(&format!("{format:?} {m}x{MLP}x{HIDDEN}"), best_us(|| drop(ours.multiply(&x, level))));
            let xt = candle_core::Tensor::from_vec(x, (m, MLP), &candle_core::Device::Cpu).expect("tensor");
            row(&format!("{format:?} {m}x{MLP}x{HIDDEN}, candle"), best_us(|| drop(theirs.forward(&xt).expect("candle's product"))));
        }
    }

    // Attention over a 1,024-position cache: one decode query, a 64-query prompt chunk.
    let kv_block = KV_HEADS * paged_attention::BLOCK * HEAD_DIM;
    let (keys, values) =
        (signed_values(CONTEXT / paged_attention::BLOCK * kv_block, 6), signed_values(CONTEXT / paged_attention::BLOCK * kv_block, 7));
    let blocks: Vec<(&[f32], &[f32])> = keys.chunks_exact(kv_block).zip(values.chunks_exact(kv_block)).collect();
    let kv = KvView { blocks: &blocks, kv_heads: KV_HEADS, head_dim: HEAD_DIM, len: CONTEXT };
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    let q1 = signed_values(HEADS * HEAD_DIM, 8);
    row(
        &format!("attention decode, {CONTEXT} cached"),
        best_us(|| drop(paged_attention::decode::attend_one(&q1, HEADS, &kv, scale, None))),
    );
    let q64 = signed_values(HEADS * 64 * HEAD_DIM, 9);
    row(
        &format!("attention prefill 64 of {CONTEXT}"),
        best_us(|| drop(paged_attention::prefill::attend_chunk(&q64, HEADS, 64, &kv, scale, None))),
    );

    // The optimizer over a 1M-value shard.
    let n = 1 << 20;
    let (mut p, mut g, mut m, mut v) = (signed_values(n, 10), signed_values(n, 11), vec![0f32; n], vec![0f32; n]);
    let k = kernels::adamw::AdamWConstants::new(0.9, 0.999, 1e-8, 1e-3, 0.01, 1, None);
    row("adamw update 1M", best_us(|| kernels::adamw::update(k, &mut p, &mut g, &mut m, &mut v)));
    let mut e = signed_values(n, 12);
    row("exp 1M", best_us(|| kernels::exp::exp_inplace(&mut e)));
}

/// Best time of [`ROUNDS`] calls after three warm-ups, in microseconds.
fn best_us(mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    (0..ROUNDS)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        })
        .fold(f64::INFINITY, f64::min)
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string()))
        .unwrap_or_else(|| "unknown".into())
}
