//! `cargo bench --features mpi --bench training`: the FSDP engine's figures.
//!
//! (a) peak RSS of each rank (VmHWM) while fine-tuning a generated 220M Llama (~840 MB of f32
//!     weights) under mpirun at world 1, 2 and 4 (FULL_SHARD with and without activation
//!     checkpointing, SHARD_GRAD_OP, NO_SHARD), next to PyTorch FSDP2 on CPU doing the same job
//!     under torchrun (tests/bench/torch_fsdp2_memory.py), in the same run; then the sharded
//!     checkpoint's save and merge;
//! (b) training tokens/s at world 1 on CPU for a ~28M-parameter Llama (batch 4 x 128 tokens,
//!     2 threads) next to PyTorch + transformers doing the same steps in the same run;
//! (c) the same at world 2 (`local` backend, same global batch), to show the sharding overhead;
//! (d) the small model at world 2 as two processes over the tcp backend (`fsdp-app launch`),
//!     with `--prefetch off` and `on` (collectives on a thread of their own, started a unit
//!     ahead), alternating: what overlapping the collectives with compute does on this CPU.
//!
//! `cargo bench --bench training -- speed` runs only (b), (c) and (d), `-- prefetch` only (d),
//! `-- memory` only (a); `-- bf16` runs (b) with the linear products in bf16 on both sides
//! (`--param-dtype bf16`, AMX-BF16 tiles where the CPU has them; PyTorch's CPU autocast to bf16).
//!
//! Environment: FSDP_BENCH_PYTHON (Python with torch + transformers, torchrun beside it;
//! default python3),
//! FSDP_BENCH_SKIP_MPI=1 to skip (a). Models are generated under target/bench-models once.

#[path = "../common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use fsdp_app::fsdp::optim::Schedule;
use fsdp_app::memory::human_bytes;
use fsdp_app::train::finetune::{run_local, FinetuneConfig};
use serde_json::{json, Value};

const THREADS: usize = 2;
/// Rounds of (fsdp-app, PyTorch), alternating (the SmolLM2 rows and the prefetch rows; the 28M
/// rows, seconds each, take [`SMALL_ROUNDS`]).
const ROUNDS: usize = 5;
/// Rounds of the 28M rows: a step is a third of a second, and the machine's noise moves a round
/// by ±25%, so more of them.
const SMALL_ROUNDS: usize = 9;
/// Steps of each 28M round (its figure the median of steps 2 on).
const SMALL_STEPS: usize = 10;

fn model(root: &Path, name: &str, dims: &[(&str, Value)]) -> anyhow::Result<PathBuf> {
    let dir = root.join(name);
    if !dir.join("config.json").exists() {
        let overrides: Vec<(String, Value)> = dims.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        fsdp_app::fixtures::write_fixture_with("llama", &dir, &overrides)?;
    }
    Ok(dir)
}

fn data(path: &Path, rows: usize, len: usize, vocab: usize) -> anyhow::Result<()> {
    let text: String = (0..rows)
        .map(|i| json!({"input_ids": (0..len).map(|j| (i * 7919 + j * 104_729) % vocab).collect::<Vec<_>>()}).to_string() + "\n")
        .collect();
    std::fs::write(path, text)?;
    Ok(())
}

fn metrics(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap_or_default().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// SmolLM2-135M-Instruct converted from the GGUF to f32 safetensors (once).
fn smollm2(models_dir: &Path) -> anyhow::Result<PathBuf> {
    let dir = models_dir.join("smollm2-135m-f32");
    if !dir.join("config.json").exists() {
        let gguf = std::env::var("FSDP_SMOLLM2_GGUF")
            .map(PathBuf::from)
            .or_else(|_| common_gguf(models_dir))
            .map_err(|_| anyhow::anyhow!("no SmolLM2 GGUF: set FSDP_SMOLLM2_GGUF or run `cargo test --test smollm2` once"))?;
        fsdp_app::convert::convert_gguf(&gguf, &dir, candle_core::DType::F32)?;
    }
    Ok(dir)
}

/// The GGUF the smollm2 test downloads to target/smollm2.
fn common_gguf(models_dir: &Path) -> Result<PathBuf, ()> {
    let root = models_dir.parent().ok_or(())?.join("smollm2");
    find(&root).ok_or(())
}

fn find(dir: &Path) -> Option<PathBuf> {
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let p = e.path();
        if p.is_dir() {
            if let Some(f) = find(&p) {
                return Some(f);
            }
        } else if p.file_name().is_some_and(|n| n == "SmolLM2-135M-Instruct.Q4_1.gguf") {
            return Some(p);
        }
    }
    None
}

/// PyTorch + transformers doing the same steps (tests/bench/torch_train_step.py).
fn torch_run(python: &str, root: &Path, model: &Path, data: &Path, (batch, steps): (usize, usize), bf16: bool) -> Result<Value, String> {
    let o = Command::new(python)
        .arg(root.join("tests").join("bench").join("torch_train_step.py"))
        .arg(model)
        .arg(data)
        .args([batch.to_string(), "128".into(), steps.to_string(), THREADS.to_string()])
        .args(bf16.then_some("bf16"))
        .output();
    match o {
        Ok(o) if o.status.success() => {
            serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().last().unwrap_or("")).map_err(|e| e.to_string())
        }
        Ok(o) => Err(String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("failed").to_string()),
        Err(e) => Err(format!("{python}: {e}")),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn config(model: &Path, data: &Path, out: &Path, world: usize) -> FinetuneConfig {
    FinetuneConfig {
        world_size: world,
        lr: 1e-4,
        batch_size: 4 / world,
        seq_len: Some(128),
        max_steps: Some(6),
        schedule: Schedule::Constant,
        seed: 0,
        shuffle: false,
        ..FinetuneConfig::new(model.to_str().unwrap(), data, out)
    }
}

/// The binary's allocator, as `fsdp-app` declares it (the bench measures what users run).
#[global_allocator]
static ALLOCATOR: fsdp_app::process::Allocator = fsdp_app::process::Allocator;

fn main() -> anyhow::Result<()> {
    fsdp_app::process::init(fsdp_app::process::finetune_workload(), Some(THREADS))?;
    let root = common::repo_root();
    let models_dir = root.join("target").join("bench-models");
    std::fs::create_dir_all(&models_dir)?;
    let tmp = tempfile::tempdir()?;
    let python = std::env::var("FSDP_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let only = |part: &str| std::env::args().skip(1).any(|a| a == part);
    if only("prefetch") {
        let (small, small_data) = small_model(&models_dir, tmp.path())?;
        return prefetch_over_tcp(&small, &small_data, tmp.path());
    }
    if only("bf16") {
        return speed(&root, &models_dir, tmp.path(), &python, true);
    }
    if !only("memory") {
        speed(&root, &models_dir, tmp.path(), &python, false)?;
        forced_avx2_rows()?;
    }
    if !only("speed") {
        memory(&root, &models_dir, tmp.path(), &python)?;
    }
    Ok(())
}

/// What makes both sides run their AVX2 code on an AVX-512 CPU: ours through `FSDP_SIMD` (our
/// kernels and gemm's microkernels), PyTorch's through ATen's dispatch level, MKL's and oneDNN's
/// instruction caps.
const FORCE_AVX2: [(&str, &str); 4] =
    [("FSDP_SIMD", "avx2"), ("ATEN_CPU_CAPABILITY", "avx2"), ("MKL_ENABLE_INSTRUCTIONS", "AVX2"), ("ONEDNN_MAX_CPU_ISA", "AVX2")];

/// On an AVX-512 CPU (and unless FSDP_SIMD already chose a level), the speed rows again with both
/// sides held to AVX2, so an AVX2 machine's figures can be read on this one. A child process:
/// the kernel level is fixed once per process.
fn forced_avx2_rows() -> anyhow::Result<()> {
    use kernels::simd::SimdLevel;
    if SimdLevel::detected() < SimdLevel::Avx512 || std::env::var_os("FSDP_SIMD").is_some() {
        return Ok(());
    }
    println!("\n## The same rows with AVX2 forced on both sides ({})", FORCE_AVX2.map(|(k, v)| format!("{k}={v}")).join(" "));
    let status = Command::new(std::env::current_exe()?).arg("speed").envs(FORCE_AVX2).status()?;
    anyhow::ensure!(status.success(), "the forced-AVX2 run failed: {status}");
    Ok(())
}

/// One model of the speed table: our runs at each world and PyTorch's, alternating.
struct SpeedRun {
    name: String,
    model: PathBuf,
    data: PathBuf,
    batch: usize,
    steps: usize,
    rounds: usize,
    worlds: Vec<usize>,
}

/// One of our rows of the speed table.
struct OurRow {
    world: usize,
    /// Median over the rounds.
    tps: f64,
    /// Median of the rounds' ratios to PyTorch (None when PyTorch did not run every round).
    ratio: Option<f64>,
    /// Our fastest round over PyTorch's fastest (None likewise): noise on this shared machine
    /// only slows a round, so the fastest rounds say what each side does uncontended (as the
    /// generation bench keeps each engine's fastest run).
    fastest_ratio: Option<f64>,
    params: usize,
    losses: Vec<f64>,
}

/// (b) and (c): tokens/s beside PyTorch; with `bf16`, (b) with the linear products in bf16 on
/// both sides.
fn speed(root: &Path, models_dir: &Path, tmp: &Path, python: &str, bf16: bool) -> anyhow::Result<()> {
    // (b) and (c): each model at world 1 (and the small one at world 2), then PyTorch on the
    // same files and rows, alternating.
    let (small, small_data) = small_model(models_dir, tmp)?;
    let mut runs = vec![SpeedRun {
        name: "Llama 28M (vocab 8192, hidden 512, 6 layers)".to_string(),
        model: small.clone(),
        data: small_data.clone(),
        batch: 4,
        steps: SMALL_STEPS,
        rounds: SMALL_ROUNDS,
        worlds: if bf16 { vec![1] } else { vec![1, 2] },
    }];
    match smollm2(models_dir) {
        Ok(dir) => {
            let d = tmp.join("smollm2.jsonl");
            data(&d, 16, 128, 49152)?;
            let name = "SmolLM2-135M (converted from the GGUF, f32)".to_string();
            runs.push(SpeedRun { name, model: dir, data: d, batch: 2, steps: 4, rounds: ROUNDS, worlds: vec![1] });
        }
        Err(e) => println!("SmolLM2 row skipped: {e:#}"),
    }
    for SpeedRun { name, model: dir, data: rows, batch, steps, rounds, worlds } in &runs {
        // Alternating rounds (ours, then PyTorch, again and again): the machine's drift hits
        // both sides alike; each side's figure is the median over its rounds, and the ratio the
        // median of the rounds' own ratios (a slow round on this shared machine then drags
        // both sides of one ratio, not one side of the figure).
        let mut ours: Vec<(usize, Vec<f64>, usize, Vec<f64>)> = worlds.iter().map(|&w| (w, vec![], 0, vec![])).collect();
        let (mut torch, mut torch_rounds) = (Err("not run".to_string()), vec![]);
        for round in 0..*rounds {
            for (world, tps_rounds, params, losses) in ours.iter_mut() {
                let out = tmp.join(format!("{}-w{world}-r{round}", dir.file_name().unwrap().to_string_lossy()));
                let mut c = config(dir, rows, &out, *world);
                (c.batch_size, c.max_steps) = (batch / *world, Some(*steps));
                if bf16 {
                    c.param_dtype = candle_core::DType::BF16;
                }
                let s = run_local(&c)?;
                let tps: Vec<f64> = metrics(&out).iter().skip(1).map(|m| m["tokens_per_s"].as_f64().unwrap()).collect();
                eprintln!("round {round}, world {world}: {tps:.0?}");
                tps_rounds.push(median(tps));
                (*params, *losses) = (s.total_params, s.losses.clone());
            }
            torch = torch_run(python, root, dir, rows, (*batch, *steps), bf16);
            if let Some(t) = torch.as_ref().ok().and_then(|t| t["tokens_per_s"].as_f64()) {
                eprintln!("round {round}, PyTorch: {t:.0}");
                torch_rounds.push(t);
            }
        }
        if let Ok(t) = torch.as_mut() {
            t["tokens_per_s"] = json!(median(torch_rounds.clone()));
        }
        // Each round's ratio to PyTorch's, when PyTorch ran every round.
        let ratios = |rounds: &[f64]| -> Option<Vec<f64>> {
            (torch_rounds.len() == rounds.len()).then(|| rounds.iter().zip(&torch_rounds).map(|(a, b)| a / b).collect())
        };
        let fastest = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
        let spread: Vec<String> =
            ours.first().and_then(|(_, rounds, ..)| ratios(rounds)).unwrap_or_default().iter().map(|r| format!("{r:.2}")).collect();
        let ours: Vec<OurRow> = ours
            .into_iter()
            .map(|(world, rounds, params, losses)| OurRow {
                world,
                tps: median(rounds.clone()),
                ratio: ratios(&rounds).map(median),
                fastest_ratio: ratios(&rounds).map(|_| fastest(&rounds) / fastest(&torch_rounds)),
                params,
                losses,
            })
            .collect();
        println!("\nCPU vector ISA: {}", common::vector_isa());
        let precision = match bf16 {
            true => "f32 weights, bf16 products (--param-dtype bf16; PyTorch: torch.autocast(\"cpu\", torch.bfloat16))",
            false => "f32",
        };
        println!(
            "Training step, {name}, {:.1}M parameters, batch {batch} x 128 tokens, AdamW, {precision}, CPU, {THREADS} threads",
            ours[0].params as f64 / 1e6
        );
        println!("(median of steps 2-{steps}, median of {rounds} alternating rounds, ratio: median of the rounds' ratios; fastest: each side's fastest round; FSDP: FULL_SHARD, one unit per layer, no activation checkpointing)\n");
        // The level our kernels and the products ran at (FSDP_SIMD lowers it), and which
        // kernels ran the products (FSDP_MATMUL picks them).
        let tiles = if bf16 && kernels::simd::Kernels::get().amx_bf16() { ", linear products on AMX-BF16 tiles" } else { "" };
        let isa = format!("{:?}, products {}{tiles}", kernels::simd::SimdLevel::current(), kernels::matmul::kernels_in_use());
        println!("| run | ISA (kernels and matmuls) | tokens/s | vs PyTorch | fastest vs PyTorch's fastest |");
        println!("|---|---|---|---|---|");
        let times = |r: &Option<f64>| r.map(|r| format!("{r:.2}x")).unwrap_or_else(|| "n/a".into());
        for OurRow { world, tps, ratio, fastest_ratio, .. } in &ours {
            println!("| fsdp-app, world {world} (local) | {isa} | {tps:.0} | {} | {} |", times(ratio), times(fastest_ratio));
        }
        match &torch {
            Ok(t) => println!(
                "| PyTorch {} + transformers {} (sdpa), plain (no FSDP) | ATen {}{} | {:.0} | 1.00x | 1.00x |",
                t["torch"].as_str().unwrap_or("?"),
                t["transformers"].as_str().unwrap_or("?"),
                t["isa"].as_str().unwrap_or("?"),
                std::env::var("MKL_ENABLE_INSTRUCTIONS").map(|v| format!(", MKL {v}")).unwrap_or_default(),
                t["tokens_per_s"].as_f64().unwrap_or(0.0)
            ),
            Err(why) => println!("| PyTorch | | n/a: {why} | | |"),
        }
        if !spread.is_empty() {
            println!("\nworld {}'s rounds, each over PyTorch's: {}", ours[0].world, spread.join(" / "));
        }
        if let Ok(t) = &torch {
            let theirs: Vec<f64> = t["losses"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
            let d = ours[0].losses.iter().zip(&theirs).map(|(a, b)| ((a - b) / b).abs()).fold(0.0, f64::max);
            println!("\nsame losses as PyTorch: max relative difference {d:.1e} over {steps} steps");
        }
    }
    if bf16 {
        return Ok(());
    }
    prefetch_over_tcp(&small, &small_data, tmp)
}

/// The 28M Llama of (b)-(d) and its rows.
fn small_model(models_dir: &Path, tmp: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    let small = model(
        models_dir,
        "llama-28m",
        &[
            ("vocab_size", json!(8192)),
            ("hidden_size", json!(512)),
            ("intermediate_size", json!(1408)),
            ("num_hidden_layers", json!(6)),
            ("num_attention_heads", json!(8)),
            ("num_key_value_heads", json!(8)),
            ("head_dim", json!(64)),
            ("rope_scaling", Value::Null),
        ],
    )?;
    let small_data = tmp.join("small.jsonl");
    data(&small_data, 64, 128, 8192)?;
    Ok((small, small_data))
}

/// (d): world 2 as processes over tcp, `--prefetch off` against `on`, alternating rounds.
fn prefetch_over_tcp(model: &Path, data: &Path, tmp: &Path) -> anyhow::Result<()> {
    const STEPS: usize = 12;
    let modes = ["off", "on"];
    // Per mode: each round's median tokens/s (steps 3 on), the last round's peak RSS per rank
    // and losses.
    let mut rounds: Vec<(Vec<f64>, Vec<u64>, Vec<f64>)> = modes.iter().map(|_| (vec![], vec![], vec![])).collect();
    for round in 0..ROUNDS {
        for (mode, (tps, rss, losses)) in modes.iter().zip(rounds.iter_mut()) {
            let out = tmp.join(format!("tcp-prefetch-{mode}-{round}"));
            let run = Command::new(env!("CARGO_BIN_EXE_fsdp-app"))
                .args(["launch", "--nproc-per-node", "2", "--", "finetune", "--backend", "tcp", "--prefetch", mode])
                .args(["--lr", "1e-4", "--lr-scheduler", "constant", "--seq-len", "128", "--batch-size", "2", "--no-shuffle"])
                .arg("--max-steps")
                .arg(STEPS.to_string())
                .arg("--model")
                .arg(model)
                .arg("--data")
                .arg(data)
                .arg("--output-dir")
                .arg(&out)
                .output()?;
            let why = String::from_utf8_lossy(&run.stderr);
            anyhow::ensure!(run.status.success(), "the tcp run with --prefetch {mode} failed: {}\n{why}", run.status);
            let m = metrics(&out);
            tps.push(median(m.iter().skip(2).map(|r| r["tokens_per_s"].as_f64().unwrap()).collect()));
            *rss =
                m.last().map(|r| r["peak_rss_bytes_per_rank"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap()).collect()).unwrap();
            *losses = m.iter().map(|r| r["loss"].as_f64().unwrap()).collect();
            eprintln!("round {round}, tcp, prefetch {mode}: {:.0}", tps.last().unwrap());
        }
    }
    println!("\nCPU vector ISA: {}", common::vector_isa());
    println!("World 2 as two processes over tcp (`fsdp-app launch`), the 28M model, batch 2 x 128 tokens per rank, {STEPS} steps");
    println!("(median of steps 3-{STEPS}, median of {ROUNDS} alternating rounds; ratio: median of the rounds' ratios to --prefetch off)\n");
    println!("| --prefetch | tokens/s | vs off | peak RSS per rank |");
    println!("|---|---|---|---|");
    for (mode, (tps, rss, _)) in modes.iter().zip(&rounds) {
        let ratio = median(tps.iter().zip(&rounds[0].0).map(|(a, b)| a / b).collect());
        let rss: Vec<String> = rss.iter().map(|&b| human_bytes(b)).collect();
        println!("| {mode} | {:.0} | {ratio:.2}x | {} |", median(tps.clone()), rss.join(", "));
    }
    let same = rounds[0].2 == rounds[1].2;
    println!("\nlosses with and without prefetch: {}", if same { "the same bits" } else { "DIFFERENT" });
    Ok(())
}

/// (a): per-rank peak memory under mpirun beside PyTorch FSDP2 under torchrun.
fn memory(root: &Path, models_dir: &Path, tmp: &Path, python: &str) -> anyhow::Result<()> {
    if std::env::var("FSDP_BENCH_SKIP_MPI").is_ok() || !cfg!(feature = "mpi") {
        println!("\n(a) skipped: needs `--features mpi` and mpirun");
        return Ok(());
    }
    let big = model(
        models_dir,
        "llama-220m",
        &[
            ("vocab_size", json!(32000)),
            ("hidden_size", json!(1024)),
            ("intermediate_size", json!(2816)),
            ("num_hidden_layers", json!(12)),
            ("num_attention_heads", json!(16)),
            ("num_key_value_heads", json!(16)),
            ("head_dim", json!(64)),
            ("rope_scaling", Value::Null),
        ],
    )?;
    let weights_bytes: u64 = std::fs::read_dir(&big)?
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    let big_data = tmp.join("big.jsonl");
    data(&big_data, 16, 64, 32000)?;
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_fsdp-app"));
    println!(
        "\n(a) Per-rank peak RSS (VmHWM), fine-tuning a generated Llama with {} of f32 weights (vocab 32000, hidden 1024, 12 layers),",
        human_bytes(weights_bytes)
    );
    println!(
        "seq 64, batch 1 per rank, 3 steps, AdamW, 1 thread per rank; fsdp-app under mpirun (mpi backend), PyTorch FSDP2 under torchrun"
    );
    println!("(gloo, meta init, fully_shard per layer and root, set_model_state_dict(broadcast_from_rank0=True)) in the same run\n");
    println!("| run | world | strategy | activation checkpointing | rank 0 | other ranks (max) | tokens/s |");
    println!("|---|---|---|---|---|---|---|");
    let row = |who: &str, world: usize, strategy: &str, ac: bool, peaks: &[u64], tps: Option<f64>| {
        // MiB, not human_bytes' tenths of a GiB: rank 0 beside the others is a 5% question.
        let mib = |b: &u64| format!("{} MiB", b >> 20);
        let others = peaks.iter().skip(1).max().map(mib).unwrap_or_else(|| "-".into());
        let tps = tps.map(|t| format!("{t:.0}")).unwrap_or_else(|| "n/a".into());
        println!(
            "| {who} | {world} | {strategy} | {} | {} | {others} | {tps} |",
            if ac { "on" } else { "off" },
            peaks.first().map(mib).unwrap_or_default()
        );
    };
    let mut save_log = String::new();
    let mut out_of_saved = PathBuf::new();
    for (world, strategy, ac) in [
        (1usize, "FULL_SHARD", false),
        (2, "FULL_SHARD", false),
        (4, "FULL_SHARD", false),
        (4, "FULL_SHARD", true),
        (4, "SHARD_GRAD_OP", false),
        (4, "NO_SHARD", false),
    ] {
        let out = tmp.join(format!("mpi-{world}-{strategy}-{ac}"));
        let mut cmd = Command::new("mpirun");
        cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", &world.to_string()]).arg(&exe);
        cmd.args(["finetune", "--model", big.to_str().unwrap(), "--data", big_data.to_str().unwrap(), "--output-dir"]).arg(&out);
        cmd.args(["--seq-len", "64", "--batch-size", "1", "--max-steps", "3", "--backend", "mpi", "--sharding-strategy", strategy]);
        if ac {
            // This run also saves a sharded checkpoint (below).
            cmd.args(["--activation-checkpointing", "--save-steps", "3"]);
        }
        let o = cmd.env("RAYON_NUM_THREADS", "1").output()?;
        if !o.status.success() {
            anyhow::bail!("mpirun failed: {}", String::from_utf8_lossy(&o.stderr));
        }
        let m = metrics(&out);
        let last = m.last().unwrap();
        let peaks: Vec<u64> = last["peak_rss_bytes_per_rank"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        let tps = median(m.iter().skip(1).map(|r| r["tokens_per_s"].as_f64().unwrap()).collect());
        row("fsdp-app", world, strategy, ac, &peaks, Some(tps));
        if ac {
            save_log = String::from_utf8_lossy(&o.stderr).to_string();
            out_of_saved = out;
        }
    }
    let torchrun = PathBuf::from(python).with_file_name("torchrun");
    for (world, strategy, ac) in
        [(1usize, "FULL_SHARD", false), (4, "FULL_SHARD", false), (4, "FULL_SHARD", true), (4, "SHARD_GRAD_OP", false)]
    {
        let o = Command::new(&torchrun)
            .args(["--nproc-per-node", &world.to_string(), "--master-port", "29613"])
            .arg(root.join("tests").join("bench").join("torch_fsdp2_memory.py"))
            .arg(&big)
            .arg(&big_data)
            .args(["64", "3", if ac { "1" } else { "0" }, strategy])
            .output();
        // The script prints its measurement as its last stdout line before torch tears the
        // process group down; a rank that crashes in that teardown (gloo's "terminate called
        // without an active exception", seen with torch 2.15) fails torchrun after the fact.
        let measured =
            |o: &std::process::Output| serde_json::from_str::<Value>(String::from_utf8_lossy(&o.stdout).lines().last().unwrap_or("")).ok();
        let parsed = match o {
            Ok(o) if measured(&o).is_some() => measured(&o),
            Ok(o) => {
                println!(
                    "| PyTorch FSDP2 | {world} | {strategy} | {ac} | n/a: {} | | |",
                    String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("failed")
                );
                None
            }
            Err(e) => {
                println!("| PyTorch FSDP2 | {world} | {strategy} | {ac} | n/a: {}: {e} | | |", torchrun.display());
                None
            }
        };
        if let Some(t) = parsed {
            let peaks: Vec<u64> = t["peak_rss_bytes_per_rank"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
            row(&format!("PyTorch {} FSDP2", t["torch"].as_str().unwrap_or("?")), world, strategy, ac, &peaks, t["tokens_per_s"].as_f64());
        }
    }
    let log = save_log;
    let out = out_of_saved;
    let process_peaks: Vec<&str> = log.lines().filter(|l| l.contains("peak RSS of this process")).collect();
    let save_line = log.lines().find(|l| l.starts_with("saved ")).unwrap_or("(no save line)");
    println!("\nSharded checkpoint of the same job (weights + AdamW moments, 4 ranks): {save_line}");
    println!("peak RSS of each process over the whole run (training, save, export):");
    for l in process_peaks {
        println!("  {l}");
    }
    let ckpt = out.join("checkpoint-3");
    let merged = tmp.join("merged");
    let t = std::time::Instant::now();
    let m = Command::new(&exe).arg("merge").arg(&ckpt).arg(&merged).output()?;
    let merge_line = String::from_utf8_lossy(&m.stderr).lines().last().unwrap_or("").to_string();
    println!("merge (one process): {:.1}s wall; {merge_line}", t.elapsed().as_secs_f64());
    Ok(())
}
