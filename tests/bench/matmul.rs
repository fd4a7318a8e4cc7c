//! `cargo bench --bench matmul`: the training step's matrix products on their own, ours beside
//! the BLAS libraries PyTorch and numpy users run, on this CPU, in one run: for each linear layer
//! shape of the training bench's two models (tokens, in, out), the forward `y = x Wᵀ` and the
//! backward's `dx = dy W` plus `dW = dyᵀ x`, as GFLOP/s:
//! - ours: `ops::linear` (on AVX2 our packed driver, `models/kernels/src/matmul/packed.rs`,
//!   elsewhere the gemm crate's kernels; on candle's barrier pool), the code `finetune` runs
//!   (`FSDP_MATMUL=gemm|packed` picks the kernels of this column instead);
//! - MKL / oneDNN: PyTorch's CPU matmul through autograd (the PyPI wheel), the peer of the
//!   training bench;
//! - OpenBLAS: numpy's `@` (the PyPI wheel ships OpenBLAS).
//!
//! Then a 28M Llama step's products in the order training runs them (every layer's forward and
//! backward, each layer with its own operands, so that they come from memory as in training),
//! with the products on our packed driver (`FSDP_MATMUL=packed`: at AVX-512 too, where gemm's
//! kernels are the default on Intel CPUs) and, in alternating child processes, on gemm's kernels of the same
//! level (`FSDP_MATMUL=gemm`).
//!
//! FSDP_BENCH_PYTHON: a Python with numpy (and torch for the MKL column; default python3).
//! FSDP_BENCH_THREADS: threads for every library (default 2).

#[path = "../common/mod.rs"]
mod common;

use std::process::Command;
use std::time::Instant;

use candle_core::{Device, Tensor};
use serde_json::Value;

const ROUNDS: usize = 15;

/// (tokens, in, out) of every distinct linear layer: the 28M Llama at batch 4 x 128, SmolLM2-135M
/// at batch 2 x 128.
const SHAPES: &[(&str, [usize; 3])] = &[
    ("28M q/k/v/o", [512, 512, 512]),
    ("28M gate/up", [512, 512, 1408]),
    ("28M down", [512, 1408, 512]),
    // q, k and v as one product (one weight of their rows stacked), gate and up likewise: what
    // a fused projection would run instead of three (two) of the rows above.
    ("28M q+k+v", [512, 512, 1536]),
    ("28M gate+up", [512, 512, 2816]),
    ("28M head", [512, 512, 8192]),
    ("135M q/o", [256, 576, 576]),
    ("135M k/v", [256, 576, 192]),
    ("135M gate/up", [256, 576, 1536]),
    ("135M down", [256, 1536, 576]),
    ("135M head", [256, 576, 49152]),
];

fn best(mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    (0..ROUNDS)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// The flag a child process of [`step_sequence_rows`] runs with.
const STEP_CHILD: &str = "--step-sequence-child";

/// GFLOP/s of a 28M Llama step's linear-layer products (batch 4 x 128), in training's order:
/// per layer, forward then backward (dx and dW) of each projection, 6 layers of their own
/// operands (~150 MB, several times L3); median of 5 steps after one.
fn step_sequence_rate() -> anyhow::Result<f64> {
    let (dev, tokens) = (Device::Cpu, 512);
    let layer = [(512, 512), (512, 512), (512, 512), (512, 512), (512, 1408), (512, 1408), (1408, 512)];
    let mut linears = vec![];
    for _ in 0..6 {
        for (k, n) in layer {
            let x = Tensor::randn(0f32, 1.0, (tokens, k), &dev)?;
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
            let dy = Tensor::randn(0f32, 1.0, (tokens, n), &dev)?;
            linears.push((x, w, dy));
        }
    }
    let flops: f64 = linears.iter().map(|(x, w, _)| 6.0 * (tokens * x.dim(1).unwrap() * w.dim(0).unwrap()) as f64).sum();
    let mut secs = vec![];
    for _ in 0..6 {
        let t = Instant::now();
        for (x, w, dy) in &linears {
            drop(ops::linear::linear(x, w)?);
            drop(ops::linear::linear_grads(x, w, dy)?);
        }
        secs.push(t.elapsed().as_secs_f64());
    }
    secs.remove(0);
    secs.sort_by(f64::total_cmp);
    Ok(flops / secs[secs.len() / 2] / 1e9)
}

/// [`step_sequence_rate`] with our packed driver and with gemm's kernels, in child processes
/// (the choice is made once per process), alternating 5 times.
fn step_sequence_rows(threads: usize) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let rate = |gemm: bool| -> anyhow::Result<f64> {
        let mut cmd = Command::new(&exe);
        cmd.arg(STEP_CHILD).env("FSDP_MATMUL", if gemm { "gemm" } else { "packed" });
        let out = cmd.output()?;
        anyhow::ensure!(out.status.success(), "step sequence child: {}", String::from_utf8_lossy(&out.stderr));
        Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
    };
    let (mut ours, mut gemm) = (vec![], vec![]);
    for _ in 0..5 {
        ours.push(rate(false)?);
        gemm.push(rate(true)?);
    }
    let ratios: Vec<f64> = ours.iter().zip(&gemm).map(|(o, g)| o / g).collect();
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let level = kernels::simd::SimdLevel::current();
    println!("
A 28M Llama step's products in training's order (6 layers of their own operands, forward, dx and dW), {threads} threads, kernels at {level:?}, 5 alternating rounds: GFLOP/s");
    println!(
        "
| products on | GFLOP/s (median) | rounds |
|---|---|---|"
    );
    println!(
        "| fsdp-app's packed driver ({level:?} tile, `FSDP_MATMUL=packed`) | {:.0} | {:?} |",
        median(ours.clone()),
        ours.iter().map(|r| r.round()).collect::<Vec<_>>()
    );
    println!(
        "| gemm's {level:?} kernels (`FSDP_MATMUL=gemm`) | {:.0} | {:?} |",
        median(gemm.clone()),
        gemm.iter().map(|r| r.round()).collect::<Vec<_>>()
    );
    println!(
        "
ours / gemm: {:.2}x (median of the rounds' ratios{})",
        median(ratios),
        if level >= kernels::simd::SimdLevel::Avx2 { "" } else { "; both rows ran gemm's kernels at this level" }
    );
    Ok(())
}

/// The binary's allocator, as `fsdp-app` declares it (the bench measures what users run).
#[global_allocator]
static ALLOCATOR: fsdp_app::process::Allocator = fsdp_app::process::Allocator;

fn main() -> anyhow::Result<()> {
    let threads: usize = std::env::var("FSDP_BENCH_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(2);
    fsdp_app::process::init(fsdp_app::process::finetune_workload(), Some(threads))?;
    if std::env::args().any(|a| a == STEP_CHILD) {
        println!("{}", step_sequence_rate()?);
        return Ok(());
    }
    let dev = Device::Cpu;
    let mut ours = vec![];
    for (_, [m, k, n]) in SHAPES {
        let x = Tensor::randn(0f32, 1.0, (*m, *k), &dev)?;
        let w = Tensor::randn(0f32, 1.0, (*n, *k), &dev)?;
        let dy = Tensor::randn(0f32, 1.0, (*m, *n), &dev)?;
        let fwd = best(|| drop(ops::linear::linear(&x, &w).unwrap()));
        let bwd = best(|| drop(ops::linear::linear_grads(&x, &w, &dy).unwrap()));
        ours.push((fwd, bwd));
    }
    let python = std::env::var("FSDP_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = common::repo_root().join("tests/bench/matmul_peers.py");
    let shapes: Vec<[usize; 3]> = SHAPES.iter().map(|(_, s)| *s).collect();
    let peers = Command::new(&python)
        .arg(&script)
        .args([threads.to_string(), ROUNDS.to_string(), serde_json::to_string(&shapes)?])
        .output()
        .map_err(|e| e.to_string())
        .and_then(|o| match o.status.success() {
            true => serde_json::from_slice::<Value>(&o.stdout).map_err(|e| e.to_string()),
            false => Err(String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("failed").to_string()),
        });

    println!("\nCPU vector ISA: {}", common::vector_isa());
    println!(
        "Training's linear-layer products, f32, {threads} threads, best of {ROUNDS}: GFLOP/s (forward: 2mnk; backward: dx and dW, 4mnk)"
    );
    match &peers {
        Ok(p) => println!(
            "peers: PyTorch {} (MKL / oneDNN, autograd), numpy {} ({})\n",
            p["torch"].as_str().unwrap_or("n/a"),
            p["numpy"].as_str().unwrap_or("?"),
            p["numpy_blas"].as_str().unwrap_or("?")
        ),
        Err(e) => println!("peers: n/a ({e})\n"),
    }
    println!("| layer (tokens x in -> out) | pass | fsdp-app | PyTorch (MKL) | numpy (OpenBLAS) | vs MKL | vs OpenBLAS |");
    println!("|---|---|---|---|---|---|---|");
    for (i, ((name, [m, k, n]), (fwd, bwd))) in SHAPES.iter().zip(&ours).enumerate() {
        let flops = (2 * m * k * n) as f64;
        let row = peers.as_ref().ok().map(|p| &p["shapes"][i]);
        for (pass, ours_s, work, key) in [("forward", fwd, flops, "fwd"), ("backward", bwd, 2.0 * flops, "bwd")] {
            let rate = |s: f64| work / s / 1e9;
            let peer = |lib: &str| row.and_then(|r| r[format!("{lib}_{key}")].as_f64()).map(rate);
            let (mkl, blas) = (peer("torch"), peer("openblas"));
            let cell = |v: Option<f64>| v.map(|g| format!("{g:.0}")).unwrap_or_else(|| "n/a".into());
            let ratio = |v: Option<f64>| v.map(|g| format!("{:.2}x", rate(*ours_s) / g)).unwrap_or_else(|| "n/a".into());
            println!(
                "| {name} ({m} x {k} -> {n}) | {pass} | {:.0} | {} | {} | {} | {} |",
                rate(*ours_s),
                cell(mkl),
                cell(blas),
                ratio(mkl),
                ratio(blas)
            );
        }
    }
    step_sequence_rows(threads)
}
