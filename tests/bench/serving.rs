//! `cargo bench --bench serving`: `fsdp-app serve` on converted SmolLM2-135M-Instruct (f32, CPU),
//! streaming completions from 1, 4 and 16 concurrent clients: aggregate generated tokens/s and
//! mean / worst time to first token, measured by the clients. Continuous batching should make the
//! aggregate grow with the number of streams. Then multi-LoRA: the server's RSS (VmRSS, from
//! outside) with 0, 1 and 8 adapters (r 16 on every linear layer) loaded, and 16 streams spread
//! over 4 adapters beside 16 on the base alone, with PEFT's default adapters (r 8 on q_proj and
//! v_proj) and with the r 16 all-linear ones.
//!
//! The streams table runs twice: on the converted f32 model and on the shipped Q4_1 GGUF as it is.
//! Then the long-prompt rows (`serving_long`).
//!
//! `cargo bench --bench serving -- streams` runs only the two streams tables; `-- lora` only the multi-LoRA throughput rows (for profiling
//! the server: `perf record -g -p <its pid>`); `-- long` only the long-prompt rows.
//!
//! Environment: FSDP_SMOLLM2_GGUF (else the GGUF the smollm2 test downloaded to target/smollm2).

#[path = "../common/mod.rs"]
mod common;
#[path = "serving_long.rs"]
mod serving_long;
#[path = "streams.rs"]
mod streams;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::DType;
use streams::{start_server, stream_once, NEW_TOKENS};

/// A LoRA adapter for the model in `model_dir` with `settings` (random non-zero weights: the work
/// of a trained one), written in PEFT's format to `out`.
fn random_adapter(model_dir: &Path, out: &Path, settings: &models::LoraSettings, seed: u64) -> anyhow::Result<PathBuf> {
    let cfg = fsdp_app::model_files::read_model_config(&model_dir.join("config.json"))?;
    let mut state = seed;
    let mut tensors = std::collections::HashMap::new();
    for spec in (0..cfg.num_hidden_layers).flat_map(|i| models::lora::layer_adapter_tensors(&cfg, settings, i)) {
        let n: usize = spec.shape.iter().product();
        let values: Vec<f32> =
            (0..n).map(|_| ((kernels::rng::splitmix64(&mut state) >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.02).collect();
        tensors.insert(spec.name.clone(), candle_core::Tensor::from_vec(values, spec.shape.as_slice(), &candle_core::Device::Cpu)?);
    }
    fsdp_app::model_files::adapter::write_adapter(out, &tensors, settings, "smollm2")
}

/// Aggregate tokens/s of `streams` concurrent streams, stream i on `models[i % len]`.
fn aggregate(url: &str, streams: usize, models: &[&str]) -> f64 {
    let start = Instant::now();
    let handles: Vec<_> = (0..streams)
        .map(|i| {
            let (url, model) = (url.to_string(), models[i % models.len()].to_string());
            std::thread::spawn(move || stream_once(&url, &model, 100 + i))
        })
        .collect();
    let tokens: usize = handles.into_iter().map(|h| h.join().unwrap().0).sum();
    tokens as f64 / start.elapsed().as_secs_f64()
}

fn lora_flags(adapters: &[PathBuf]) -> Vec<String> {
    adapters.iter().enumerate().flat_map(|(i, a)| ["--lora".to_string(), format!("lora{i}={}", a.display())]).collect()
}

/// 16 streams on the base alone, then 16 spread over the first 4 of `adapters`, on one server.
fn mixed_throughput(dir: &Path, adapters: &[PathBuf], what: &str) -> anyhow::Result<()> {
    let (mut child, url) = start_server(dir, &lora_flags(&adapters[..4]))?;
    let names = ["lora0", "lora1", "lora2", "lora3"];
    for m in names.iter().chain(["smollm2"].iter()) {
        stream_once(&url, m, 0); // warm-up, every adapter loaded
    }
    let base = aggregate(&url, 16, &["smollm2"]);
    let mixed = aggregate(&url, 16, &names);
    println!("| {what} | {base:.1} | {mixed:.1} | {:.2}x |", mixed / base);
    let _ = child.kill();
    let _ = child.wait();
    Ok(())
}

/// RSS with 0, 1 and 8 of the `heavy` adapters loaded.
fn multi_lora_memory(dir: &Path, heavy: &[PathBuf]) -> anyhow::Result<()> {
    let adapter_bytes = std::fs::metadata(heavy[0].join("adapter_model.safetensors"))?.len();
    println!();
    println!("multi-LoRA: adapters r 16 on all linear layers ({:.1} MiB each on disk, f32)", adapter_bytes as f64 / (1 << 20) as f64);
    println!("| adapters loaded | server RSS after one request each (MiB) | over the base alone (MiB) |");
    println!("|---|---|---|");
    let mut base_rss = 0.0;
    for n in [0usize, 1, 8] {
        let (mut child, url) = start_server(dir, &lora_flags(&heavy[..n]))?;
        stream_once(&url, "smollm2", 0);
        for i in 0..n {
            stream_once(&url, &format!("lora{i}"), i);
        }
        let rss = common::rss_of(child.id()) as f64 / (1 << 20) as f64;
        if n == 0 {
            base_rss = rss;
        }
        println!("| {n} | {rss:.0} | {:+.0} |", rss - base_rss);
        let _ = child.kill();
        let _ = child.wait();
    }
    Ok(())
}

/// Throughput with `light` (PEFT's default shape) and `heavy` adapters, each beside the base.
fn multi_lora_throughput(dir: &Path, heavy: &[PathBuf], light: &[PathBuf]) -> anyhow::Result<()> {
    println!();
    println!("| adapters | 16 streams on the base (tokens/s) | 16 streams over 4 adapters (tokens/s) | ratio |");
    println!("|---|---|---|---|");
    mixed_throughput(dir, light, "r 8, q_proj,v_proj (PEFT's default)")?;
    mixed_throughput(dir, heavy, "r 16, all linear layers")?;
    Ok(())
}

/// 8 adapters r 16 on every linear layer and 4 of PEFT's default shape, written under `root`.
fn bench_adapters(dir: &Path, root: &Path) -> anyhow::Result<(Vec<PathBuf>, Vec<PathBuf>)> {
    let heavy_settings = models::LoraSettings { r: 16, alpha: 32.0, targets: vec!["all-linear".into()], ..Default::default() };
    let heavy = (0..8)
        .map(|i| random_adapter(dir, &root.join(format!("heavy{i}")), &heavy_settings, i as u64 + 1))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let light = (0..4)
        .map(|i| random_adapter(dir, &root.join(format!("light{i}")), &models::LoraSettings::default(), i as u64 + 11))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok((heavy, light))
}

/// Aggregate tokens/s and time to first token of 1, 4 and 16 concurrent streams on `model` (a
/// directory or a GGUF file), as a table.
fn streams_table(model: &Path, weights: &str) -> anyhow::Result<()> {
    let (mut child, url) = start_server(model, &[])?;
    stream_once(&url, "smollm2", 0); // warm-up
    println!("\nfsdp-app serve, SmolLM2-135M-Instruct {weights} on CPU, {NEW_TOKENS} new tokens per stream (sampling, temperature 0.7)");
    println!("| streams | aggregate tokens/s | per-stream tokens/s | mean TTFT (s) | max TTFT (s) | wall (s) |");
    println!("|---|---|---|---|---|---|");
    let mut single = 0.0;
    for streams in [1usize, 4, 16] {
        let start = Instant::now();
        let handles: Vec<_> = (0..streams)
            .map(|i| {
                let url = url.clone();
                std::thread::spawn(move || stream_once(&url, "smollm2", 100 + i))
            })
            .collect();
        let results: Vec<(usize, f64, f64)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let wall = start.elapsed().as_secs_f64();
        let tokens: usize = results.iter().map(|r| r.0).sum();
        let aggregate = tokens as f64 / wall;
        if streams == 1 {
            single = aggregate;
        }
        let ttfts: Vec<f64> = results.iter().map(|r| r.1).collect();
        println!(
            "| {streams} | {aggregate:.1} ({:.2}x) | {:.1} | {:.3} | {:.3} | {wall:.1} |",
            aggregate / single,
            aggregate / streams as f64,
            ttfts.iter().sum::<f64>() / streams as f64,
            ttfts.iter().copied().fold(0.0, f64::max)
        );
    }
    let _ = child.kill();
    let _ = child.wait();
    std::thread::sleep(Duration::from_millis(10));
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let gguf = common::bench_smollm2_gguf()?;
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("smollm2");
    fsdp_app::convert::convert_gguf(&gguf, &dir, DType::BF16)?;
    if std::env::args().skip(1).any(|a| a == "long") {
        println!("CPU vector ISA: {}", common::vector_isa());
        return serving_long::rows(&dir);
    }
    if std::env::args().skip(1).any(|a| a == "lora") {
        println!("CPU vector ISA: {}", common::vector_isa());
        let (heavy, light) = bench_adapters(&dir, tmp.path())?;
        return multi_lora_throughput(&dir, &heavy, &light);
    }
    println!("CPU vector ISA: {}", common::vector_isa());
    streams_table(&dir, "f32")?;
    // The same streams over the shipped Q4_1 file as it is (its int8 block products).
    streams_table(&gguf, "Q4_1 GGUF")?;
    if std::env::args().skip(1).any(|a| a == "streams") {
        return Ok(());
    }
    serving_long::rows(&dir)?;
    let (heavy, light) = bench_adapters(&dir, tmp.path())?;
    multi_lora_memory(&dir, &heavy)?;
    multi_lora_throughput(&dir, &heavy, &light)
}
