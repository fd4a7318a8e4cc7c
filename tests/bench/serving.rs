//! `cargo bench --bench serving`: `fsdp-app serve` on converted SmolLM2-135M-Instruct (f32, CPU),
//! streaming completions from 1, 4 and 16 concurrent clients: aggregate generated tokens/s and
//! mean / worst time to first token, measured by the clients. Continuous batching should make the
//! aggregate grow with the number of streams.
//!
//! Environment: FSDP_SMOLLM2_GGUF (else the GGUF the smollm2 test downloaded to target/smollm2).

#[path = "../common/mod.rs"]
mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::DType;

const NEW_TOKENS: usize = 64;

fn stream_once(url: &str, i: usize) -> (usize, f64, f64) {
    let body = serde_json::json!({
        "model": "smollm2", "prompt": format!("Story {i}: Once upon a time, in a small village by the sea,"),
        "max_tokens": NEW_TOKENS, "temperature": 0.7, "seed": i, "stream": true, "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    let r = ureq::post(url).send_string(&body.to_string()).expect("request");
    let mut first = None;
    let mut tokens = 0;
    for line in BufReader::new(r.into_reader()).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            break;
        }
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        if first.is_none() && v["choices"].get(0).is_some_and(|c| c["text"].as_str().is_some_and(|t| !t.is_empty())) {
            first = Some(start.elapsed().as_secs_f64());
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            tokens = n as usize;
        }
    }
    (tokens, first.unwrap_or(f64::NAN), start.elapsed().as_secs_f64())
}

fn main() -> anyhow::Result<()> {
    let gguf = common::bench_smollm2_gguf()?;
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("smollm2");
    fsdp_app::convert::convert_gguf(&gguf, &dir, DType::BF16)?;
    let mut child = Command::new(common::bin())
        .args([
            "serve",
            "--model",
            dir.to_str().unwrap(),
            "--port",
            "0",
            "--served-model-name",
            "smollm2",
            "--max-concurrent-requests",
            "16",
            "--max-queue",
            "64",
        ])
        .stderr(Stdio::piped())
        .spawn()?;
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("listening on http://") {
        line.clear();
        if err.read_line(&mut line)? == 0 {
            anyhow::bail!("the server did not start");
        }
    }
    std::thread::spawn(move || for _ in err.lines() {});
    let addr = line.split("http://").nth(1).unwrap().split_whitespace().next().unwrap().to_string();
    let url = format!("http://{addr}/v1/completions");
    stream_once(&url, 0); // warm-up
    println!("fsdp-app serve, SmolLM2-135M-Instruct f32 on CPU, {NEW_TOKENS} new tokens per stream (sampling, temperature 0.7)");
    println!("| streams | aggregate tokens/s | per-stream tokens/s | mean TTFT (s) | max TTFT (s) | wall (s) |");
    println!("|---|---|---|---|---|---|");
    let mut single = 0.0;
    for streams in [1usize, 4, 16] {
        let start = Instant::now();
        let handles: Vec<_> = (0..streams)
            .map(|i| {
                let url = url.clone();
                std::thread::spawn(move || stream_once(&url, 100 + i))
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
