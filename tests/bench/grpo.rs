//! `cargo bench --bench grpo`: GRPO's rollouts beside `fsdp-app serve` on the same model
//! (SmolLM2-135M-Instruct converted from the PyPI GGUF, CPU), in one run on one machine:
//!
//! (a) generated tokens/s of 16 concurrent streams of 64 tokens from `serve` (sampling,
//!     temperature 0.7), and of a GRPO step's rollouts (2 prompts x 8 completions of at most 64
//!     tokens, the same temperature), LoRA and full fine-tuning: the ratio is what making the
//!     policy whole and sampling in the trainer costs against the serving engine;
//! (b) the step's time split: gathering the policy, generation, scoring, old/reference
//!     log-probabilities, training (medians of steps 2 and 3; step 1 warms up);
//! (c) peak RSS (VmHWM, read from outside) of the GRPO run beside an SFT run of the same model
//!     on 16 rows of the same length (prompt + 64 tokens), LoRA and full.
//!
//! Environment: FSDP_SMOLLM2_GGUF (else the GGUF the smollm2 test downloaded to target/smollm2).

#[path = "../common/mod.rs"]
mod common;
#[path = "streams.rs"]
mod streams;

use std::io::BufReader;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use streams::{peak_rss, start_server, stream_once, NEW_TOKENS};

const STREAMS: usize = 16;

/// The prompts `serve`'s streams and the GRPO rollouts continue (`streams::stream_once`'s).
fn prompt(i: usize) -> String {
    format!("Story {i}: Once upon a time, in a small village by the sea,")
}

/// Aggregate generated tokens/s of `STREAMS` concurrent streams from `serve` of `dir`.
fn serve_streams(dir: &Path) -> anyhow::Result<f64> {
    let (mut child, url) = start_server(dir, &[])?;
    stream_once(&url, "smollm2", 0); // warm-up
    let start = Instant::now();
    let handles: Vec<_> = (0..STREAMS)
        .map(|i| {
            let url = url.clone();
            std::thread::spawn(move || stream_once(&url, "smollm2", 100 + i).0)
        })
        .collect();
    let tokens: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    let rate = tokens as f64 / start.elapsed().as_secs_f64();
    let _ = child.kill();
    let _ = child.wait();
    Ok(rate)
}

/// Runs `fsdp-app finetune ARGS` to the end; its peak RSS (VmHWM, polled from outside).
fn finetune(args: &[&str]) -> anyhow::Result<u64> {
    let mut child = Command::new(common::bin()).arg("finetune").args(args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn()?;
    let pid = child.id();
    let err = child.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut BufReader::new(err), &mut s);
        s
    });
    let mut peak = 0;
    let status = loop {
        peak = peak.max(peak_rss(pid));
        if let Some(s) = child.try_wait()? {
            break s;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let log = log.join().unwrap();
    anyhow::ensure!(status.success(), "finetune {args:?} failed:\n{log}");
    Ok(peak)
}

fn metrics(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn main() -> anyhow::Result<()> {
    let gguf = common::bench_smollm2_gguf()?;
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("smollm2");
    fsdp_app::convert::convert_gguf(&gguf, &dir, candle_core::DType::BF16)?;
    println!("CPU vector ISA: {}", common::vector_isa());
    let served = serve_streams(&dir)?;

    let prompts = tmp.path().join("prompts.jsonl");
    std::fs::write(
        &prompts,
        (0..8).map(|i| format!("{}\n", json!({"prompt": prompt(i), "opening": "Once upon a time"}))).collect::<String>(),
    )?;
    let grader = tmp.path().join("grader.json");
    std::fs::write(&grader, json!({"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "{{item.opening}}", "evaluation_metric": "rouge_l"}).to_string())?;
    // SFT rows as long as a rollout's: the prompt and 64 tokens of text.
    let sft = tmp.path().join("sft.jsonl");
    let story = "the fishermen mended their nets and told stories of the sea ".repeat(5);
    std::fs::write(&sft, (0..16).map(|i| format!("{}\n", json!({"prompt": prompt(i), "completion": story}))).collect::<String>())?;

    let (p, g, s) = (prompts.to_str().unwrap(), grader.to_str().unwrap(), sft.to_str().unwrap());
    let model = dir.to_str().unwrap();
    let mut rows = vec![];
    for lora in [true, false] {
        let tag = if lora { "lora" } else { "full" };
        let out = tmp.path().join(format!("grpo-{tag}"));
        let mut args = vec!["--method", "grpo", "--model", model, "--data", p, "--grader", g, "--output-dir", out.to_str().unwrap()];
        args.extend(["--num-generations", "8", "--max-completion-length", "64", "--temperature", "0.7", "--batch-size", "2"]);
        args.extend(["--max-steps", "3", "--seq-len", "96", "--lr", "1e-5"]);
        if lora {
            args.extend(["--lora-r", "16", "--lora-alpha", "32"]);
        }
        let grpo_peak = finetune(&args)?;
        let sft_out = tmp.path().join(format!("sft-{tag}"));
        let mut sft_args = vec!["--model", model, "--data", s, "--output-dir", sft_out.to_str().unwrap(), "--batch-size", "16"];
        sft_args.extend(["--max-steps", "3", "--seq-len", "96", "--lr", "1e-5"]);
        if lora {
            sft_args.extend(["--lora-r", "16", "--lora-alpha", "32"]);
        }
        let sft_peak = finetune(&sft_args)?;
        rows.push((tag, metrics(&out), grpo_peak, sft_peak));
    }

    println!("\n(a) generated tokens/s: {STREAMS} streams from `serve` beside a GRPO step's 2 prompts x 8 completions (at most {NEW_TOKENS} tokens, temperature 0.7)");
    println!("| what | tokens/s | vs serve |");
    println!("|---|---|---|");
    println!("| serve, {STREAMS} streams of {NEW_TOKENS} tokens | {served:.1} | 1.00x |");
    for (tag, m, _, _) in &rows {
        let rates: Vec<f64> = m[1..]
            .iter()
            .map(|r| r["completions/mean_length"].as_f64().unwrap() * STREAMS as f64 / r["time/generation_s"].as_f64().unwrap())
            .collect();
        let rate = median(rates);
        let len = median(m[1..].iter().map(|r| r["completions/mean_length"].as_f64().unwrap()).collect());
        println!("| GRPO rollouts, {tag} (mean completion {len:.0} tokens) | {rate:.1} | {:.2}x |", rate / served);
    }
    println!("\n(b) a GRPO step's time split (s, median of steps 2-3)");
    println!("| run | gather | generation | scoring | logps | training | step |");
    println!("|---|---|---|---|---|---|---|");
    for (tag, m, _, _) in &rows {
        let t = |k: &str| median(m[1..].iter().map(|r| r[k].as_f64().unwrap()).collect());
        println!(
            "| {tag} | {:.2} | {:.2} | {:.3} | {:.2} | {:.2} | {:.2} |",
            t("time/gather_s"),
            t("time/generation_s") - t("time/gather_s"),
            t("time/scoring_s"),
            t("time/logps_s"),
            t("time/training_s"),
            t("step_s")
        );
    }
    println!("\n(c) peak RSS (VmHWM) of the run, GRPO (2 x 8 rollouts per step) beside SFT (16 rows of the same length)");
    println!("| run | GRPO (MiB) | SFT (MiB) | GRPO / SFT |");
    println!("|---|---|---|---|");
    for (tag, _, grpo, sft) in &rows {
        println!("| {tag} | {:.0} | {:.0} | {:.2}x |", mib(*grpo), mib(*sft), *grpo as f64 / *sft as f64);
    }
    Ok(())
}
