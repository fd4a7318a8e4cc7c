//! `cargo bench --features cuda,nccl --bench gpu` (or the binary tests/gpu/build-cuda.sh carries to
//! the GPU machine, run by tests/gpu/run.sh bench): the GPU figures, each next to PyTorch on the
//! same GPU in the same run.
//!
//! (a) fine-tuning tokens/s and MFU of a ~1.1B-parameter Llama (random weights, bf16 compute,
//!     fp32 master, seq 2048, activation checkpointing) at batch 1 and 8, one rank through the
//!     NCCL backend, next to PyTorch FSDP2 (`fully_shard` per decoder layer, MixedPrecisionPolicy
//!     bf16/fp32, world size 1) on the same model directory and data, with the two loss curves'
//!     largest relative difference;
//! (b) greedy generation tokens/s at batch 1 and 16 (bf16, 128 new tokens after a 128-token
//!     prompt) next to transformers' `generate`;
//! (c) with the argument `flash`, only the flash-attention kernels, forward and backward, each
//!     variant of ours beside PyTorch's `scaled_dot_product_attention` (gpu_flash.rs).
//!
//! MFU = tokens/s x (6 x parameters without the input embedding + 12 x layers x hidden x seq)
//! / peak, the PaLM paper's count (activation recomputation not counted); peak = the GPU's bf16
//! dense figure, FSDP_GPU_PEAK_TFLOPS (default 989.4, H100 SXM and H200).
//!
//! Environment: FSDP_BENCH_PYTHON (a Python with torch + transformers; default python3),
//! FSDP_BENCH_DIR (where the model is generated; default a temporary directory),
//! FSDP_BENCH_STEPS (training steps, default 8; the first 2 are warm-up),
//! FSDP_BENCH_NO_PREFETCH_ROW=1 (batch 1 again with `--prefetch off`).

mod gpu_flash;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::Context;
use candle_core::{DType, Device};
use fsdp_app::fsdp::optim::Schedule;
use fsdp_app::generate::{step_all, SamplingParams, Sequence, DEFAULT_MAX_PREFILL_TOKENS};
use fsdp_app::model_files::{load_model, resolve_model};
use fsdp_app::tokenize::TextTokenizer;
use serde_json::{json, Value};

const SEQ: usize = 2048;
const VOCAB: usize = 32000;
const HIDDEN: usize = 2048;
const LAYERS: usize = 16;
const PROMPT: usize = 128;
const NEW_TOKENS: usize = 128;
/// The training rows' batch sizes (batch 8: where the GPU can be kept busy).
const BATCHES: [usize; 2] = [1, 8];

fn python_json(python: &str, script: &Path, args: &[String]) -> Result<Value, String> {
    let mut cmd = Command::new(python);
    cmd.arg(script).args(args);
    python_json_from(cmd)
}

/// The JSON line a peer script prints last, or the end of what it printed to stderr.
fn python_json_from(mut cmd: Command) -> Result<Value, String> {
    match cmd.output() {
        Ok(o) if o.status.success() => {
            serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().last().unwrap_or("")).map_err(|e| e.to_string())
        }
        Ok(o) => Err(String::from_utf8_lossy(&o.stderr).lines().rev().take(3).collect::<Vec<_>>().join(" | ")),
        Err(e) => Err(format!("{:?}: {e}", cmd.get_program())),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Model FLOPs per trained token (PaLM appendix B).
fn flops_per_token(params_without_embedding: f64) -> f64 {
    6.0 * params_without_embedding + 12.0 * (LAYERS * HIDDEN * SEQ) as f64
}

/// An error on one line, its causes included (for a table cell).
fn one_line(e: &anyhow::Error) -> String {
    format!("{e:#}").replace(['\n', '|'], " ")
}

/// Ours at one batch size: one rank under a launcher's environment, NCCL backend, like
/// `fsdp-app launch --nproc-per-node 1 -- finetune --device cuda --param-dtype bf16 ...`. The
/// model's parameter count and each step's metrics.
fn train_ours(model: &Path, data: &Path, root: &Path, batch: usize, prefetch: bool, steps: usize) -> anyhow::Result<(usize, Vec<Value>)> {
    let out = root.join(format!("ours-out-{batch}-{prefetch}"));
    let _ = std::fs::remove_dir_all(&out);
    let cfg = fsdp_app::train::finetune::FinetuneConfig {
        lr: 1e-5,
        batch_size: batch,
        seq_len: Some(SEQ),
        max_steps: Some(steps),
        schedule: Schedule::Constant,
        shuffle: false,
        activation_checkpointing: true,
        param_dtype: DType::BF16,
        reduce_dtype: DType::F32,
        device: fsdp_app::device::DeviceSpec::Cuda(Some(0)),
        backend: if cfg!(feature = "nccl") { fsdp_app::train::finetune::Backend::Nccl } else { fsdp_app::train::finetune::Backend::Local },
        verbose: true,
        prefetch: Some(prefetch),
        ..fsdp_app::train::finetune::FinetuneConfig::new(model.to_str().unwrap(), data, &out)
    };
    let env = fsdp_app::dist::env::DistEnv {
        rank: 0,
        world_size: 1,
        local_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port(),
        launcher: "torchrun",
    };
    let summary = fsdp_app::train::finetune::run(&cfg, cfg!(feature = "nccl").then_some(&env))?.context("no rank 0 summary")?;
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl"))?.lines().map(serde_json::from_str).collect::<Result<_, _>>()?;
    Ok((summary.total_params, metrics))
}

/// Our greedy decoding of `model` on the GPU, warmed up (the first use of each kernel compiles
/// its PTX): a function from a batch size to decode tokens/s over all its sequences.
fn generation(model: &Path) -> anyhow::Result<impl Fn(usize) -> anyhow::Result<f64>> {
    let dev = Device::new_cuda(0)?;
    let loaded = load_model(resolve_model(model.to_str().unwrap(), None)?, DType::BF16, &dev)?;
    let tok = TextTokenizer::load(&loaded.files, loaded.config.vocab_size)?;
    let prompt: Vec<u32> = (0..PROMPT).map(|j| ((j * 104_729 + 17) % VOCAB) as u32).collect();
    let params = SamplingParams::greedy(NEW_TOKENS);
    let run = move |batch: usize| -> anyhow::Result<f64> {
        let mut seqs: Vec<Sequence> =
            (0..batch).map(|_| Sequence::new(&loaded.model, &prompt, &HashSet::new(), &params)).collect::<anyhow::Result<_>>()?;
        // Prefill (not timed), then the decode steps.
        {
            let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
            for r in step_all(&loaded.model, &tok, &mut refs, DEFAULT_MAX_PREFILL_TOKENS) {
                r?;
            }
        }
        let start = Instant::now();
        let mut tokens = 0;
        while seqs.iter().any(|s| s.finish_reason().is_none()) {
            let mut refs: Vec<&mut Sequence> = seqs.iter_mut().filter(|s| s.finish_reason().is_none()).collect();
            for r in step_all(&loaded.model, &tok, &mut refs, DEFAULT_MAX_PREFILL_TOKENS) {
                r?;
                tokens += 1;
            }
        }
        Ok(tokens as f64 / start.elapsed().as_secs_f64())
    };
    run(2)?;
    Ok(run)
}

fn main() -> anyhow::Result<()> {
    let python = std::env::var("FSDP_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    // `flash`: (c) alone (tests/gpu/run.sh kernels); `flash-variant`: one of its processes.
    let mode = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    if mode.as_deref() == Some("flash-variant") {
        return gpu_flash::variant();
    }
    let peak = std::env::var("FSDP_GPU_PEAK_TFLOPS").ok().and_then(|v| v.parse::<f64>().ok()).unwrap_or(989.4) * 1e12;
    let steps: usize = std::env::var("FSDP_BENCH_STEPS").ok().and_then(|v| v.parse().ok()).unwrap_or(8);
    let scripts = {
        let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests").join("bench");
        if built.exists() {
            built
        } else {
            PathBuf::from("tests").join("bench")
        }
    };
    if mode.as_deref() == Some("flash") {
        let failures = gpu_flash::run(&python, &scripts)?;
        anyhow::ensure!(failures == 0, "{failures} of the flash rows failed (above)");
        return Ok(());
    }
    let tmp = tempfile::tempdir()?;
    let root = std::env::var("FSDP_BENCH_DIR").map(PathBuf::from).unwrap_or_else(|_| tmp.path().to_path_buf());
    let model = root.join("llama-1b");
    if !model.join("config.json").exists() {
        let dims = [
            ("vocab_size", json!(VOCAB)),
            ("hidden_size", json!(HIDDEN)),
            ("intermediate_size", json!(8192)),
            ("num_hidden_layers", json!(LAYERS)),
            ("num_attention_heads", json!(32)),
            ("num_key_value_heads", json!(8)),
            ("head_dim", json!(64)),
            ("max_position_embeddings", json!(4096)),
            ("rope_scaling", Value::Null),
            ("tie_word_embeddings", json!(false)),
        ];
        let overrides: Vec<(String, Value)> = dims.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        fsdp_app::fixtures::write_fixture_with("llama", &model, &overrides)?;
    }
    let data = root.join("train-2048.jsonl");
    let rows = BATCHES.iter().max().unwrap() * steps;
    let text: String = (0..rows)
        .map(|i| json!({"input_ids": (0..SEQ).map(|j| (i * 7919 + j * 104_729) % VOCAB).collect::<Vec<_>>()}).to_string() + "\n")
        .collect();
    std::fs::write(&data, text)?;

    // A row that fails (a kernel error, out of memory) prints its error in the table and the
    // other rows still run: a lent GPU's minutes are few, and one failure should not hide the
    // other figures. The bench exits non-zero at the end if any row failed.
    let mut failures = 0;
    let mut trained: Vec<(usize, bool, anyhow::Result<(usize, Vec<Value>)>, Result<Value, String>)> = vec![];
    // Each batch with the engine's prefetch (NCCL's default); with FSDP_BENCH_NO_PREFETCH_ROW=1
    // batch 1 again without it (the overlap of collectives with compute, before and after, in
    // the same run; off by default: `run.sh all` must fit a lent machine's call).
    let ab = std::env::var("FSDP_BENCH_NO_PREFETCH_ROW").is_ok_and(|v| v == "1");
    let runs = BATCHES.iter().map(|&b| (b, true)).chain(ab.then_some((BATCHES[0], false)));
    for (batch, prefetch) in runs {
        let ours = train_ours(&model, &data, &root, batch, prefetch, steps);
        // PyTorch once per batch (the row without prefetch is compared with the same run).
        let torch = match trained.iter().find(|(b, _, _, _)| *b == batch) {
            Some((_, _, _, torch)) => Clone::clone(torch),
            None => python_json(
                &python,
                &scripts.join("torch_gpu_train.py"),
                &[model.display().to_string(), data.display().to_string(), SEQ.to_string(), steps.to_string(), batch.to_string()],
            ),
        };
        trained.push((batch, prefetch, ours, torch));
    }

    let params = trained.iter().find_map(|(_, _, ours, _)| ours.as_ref().ok().map(|(p, _)| *p as f64)).unwrap_or(0.0);
    let fpt = flops_per_token(params - (VOCAB * HIDDEN) as f64);
    println!("\n(a) Fine-tuning, Llama {:.2}B parameters (random), batch x {SEQ} tokens, bf16 compute, fp32 master + AdamW,", params / 1e9);
    println!("    activation checkpointing on, 1 GPU; median of steps 3-{steps}; MFU against {:.0} TFLOPS bf16 dense\n", peak / 1e12);
    println!("| batch | fsdp-app (nccl, world 1) tokens/s | MFU | PyTorch FSDP2 fully_shard tokens/s | MFU | ratio | losses: largest relative difference | GPU memory: ours / PyTorch |");
    println!("|---|---|---|---|---|---|---|---|");
    for (batch, prefetch, ours, torch) in &trained {
        let batch = if *prefetch { batch.to_string() } else { format!("{batch} (no prefetch)") };
        let metrics = match ours {
            Ok((_, metrics)) => metrics,
            Err(why) => {
                failures += 1;
                println!("| {batch} | failed: {} | | | | | | |", one_line(why));
                continue;
            }
        };
        let ours_tps = median(metrics.iter().skip(2).map(|m| m["tokens_per_s"].as_f64().unwrap_or(0.0)).collect());
        let mfu = |tps: f64| format!("{:.1}%", 100.0 * tps * fpt / peak);
        let ours_gpu = metrics.last().and_then(|m| m["gpu_memory_bytes_per_rank"][0].as_f64()).unwrap_or(0.0) / (1u64 << 30) as f64;
        match torch {
            Ok(t) => {
                let tps = t["tokens_per_s"].as_f64().unwrap_or(0.0);
                let theirs: Vec<f64> = t["losses"].as_array().map(|l| l.iter().filter_map(Value::as_f64).collect()).unwrap_or_default();
                let ours: Vec<f64> = metrics.iter().filter_map(|m| m["loss"].as_f64()).collect();
                let loss_diff = ours.iter().zip(&theirs).map(|(a, b)| ((a - b) / b).abs()).fold(0.0, f64::max);
                println!(
                    "| {batch} | {ours_tps:.0} | {} | {tps:.0} ({}) | {} | {:.2}x | {loss_diff:.1e} over {} steps | {ours_gpu:.1} / {:.1} GiB |",
                    mfu(ours_tps),
                    t["torch"].as_str().unwrap_or("?"),
                    mfu(tps),
                    ours_tps / tps,
                    ours.len().min(theirs.len()),
                    t["peak_gpu_gib"].as_f64().unwrap_or(0.0)
                );
            }
            Err(why) => println!("| {batch} | {ours_tps:.0} | {} | n/a: {why} | | | | {ours_gpu:.1} GiB / |", mfu(ours_tps)),
        }
    }
    println!(
        "\nGPU memory: ours in use at the last step's end (driver: allocations + pools), PyTorch's peak allocated. \
         Losses are each step's mean token loss, ours against PyTorch's on the same weights and rows."
    );

    // (b) generation.
    println!(
        "\n(b) Greedy generation, same model, bf16, {PROMPT}-token prompt, {NEW_TOKENS} new tokens; decode tokens/s (all sequences)\n"
    );
    println!("| batch | fsdp-app | transformers | ratio |");
    println!("|---|---|---|---|");
    let rows = [1usize, 16];
    match generation(&model) {
        Err(why) => {
            failures += rows.len();
            println!("| {rows:?} | failed: {} | | |", one_line(&why));
        }
        Ok(run) => {
            for batch in rows {
                let ours = match (0..3).map(|_| run(batch)).collect::<anyhow::Result<Vec<_>>>() {
                    Ok(rounds) => median(rounds),
                    Err(why) => {
                        failures += 1;
                        println!("| {batch} | failed: {} | | |", one_line(&why));
                        continue;
                    }
                };
                let theirs = python_json(
                    &python,
                    &scripts.join("transformers_gpu_generate.py"),
                    &[model.display().to_string(), batch.to_string(), PROMPT.to_string(), NEW_TOKENS.to_string()],
                );
                match theirs {
                    Ok(t) => {
                        let tps = t["decode_tokens_per_s"].as_f64().unwrap_or(0.0);
                        println!("| {batch} | {ours:.0} | {tps:.0} | {:.2}x |", ours / tps);
                    }
                    Err(why) => println!("| {batch} | {ours:.0} | n/a: {why} | |"),
                }
            }
        }
    }
    if failures > 0 {
        anyhow::bail!("{failures} of the bench's rows failed (above)");
    }
    Ok(())
}
