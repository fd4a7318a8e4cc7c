//! `cargo bench --bench generation`: greedy generation speed of converted SmolLM2-135M-Instruct
//! (f32, CPU, batch 1, 128 new tokens) for fsdp-app and for transformers on the same files and
//! the same number of threads, in one invocation, printed as a table with the ratio.
//!
//! Then a long answer: 4,000 greedy tokens, tokens/s of the first and the last 200, beside the
//! model's forward alone at the same positions (what the KV cache's growth explains) and what
//! decoding all generated ids at every token (the way before incremental detokenization) costs.
//! `cargo bench --bench generation -- long` runs only that.
//!
//! Environment: FSDP_SMOLLM2_GGUF (else the GGUF the smollm2 test downloaded to target/smollm2),
//! FSDP_BENCH_PYTHON (a Python with torch + transformers; default python3), FSDP_BENCH_THREADS
//! (default 2). Without Python+transformers the transformers row says why it is missing.

#[path = "../common/mod.rs"]
mod common;

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Command;

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use fsdp_app::generate::{generate, GenerationOutput, SamplingParams};
use fsdp_app::model_files::{load_model, resolve_model};
use fsdp_app::tokenize::{ChatMessage, TextTokenizer};

const NEW_TOKENS: usize = 128;
const PROMPT: &str = "Write a short story about a lighthouse keeper who finds a message in a bottle.";

fn main() -> anyhow::Result<()> {
    let threads: usize = std::env::var("FSDP_BENCH_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(2);
    // Must be set before candle's thread pool starts.
    fsdp_app::tune_cpu_threads();
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let gguf = common::bench_smollm2_gguf()?;
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("smollm2");
    fsdp_app::convert::convert_gguf(&gguf, &dir, DType::BF16)?;

    let loaded = load_model(resolve_model(dir.to_str().unwrap(), None)?, DType::F32, &Device::Cpu)?;
    let tok = TextTokenizer::load(&loaded.files, loaded.config.vocab_size)?;
    let rendered = tok.chat_template.as_ref().unwrap().render(&[ChatMessage::new("user", PROMPT)], true)?;
    let prompt = tok.encode(&rendered, false)?;
    let params = SamplingParams::greedy(NEW_TOKENS);
    if std::env::args().skip(1).any(|a| a == "long") {
        println!("\nCPU vector ISA: {}", common::vector_isa());
        return long_answer(&loaded.model, &tok, &prompt);
    }
    // No eos: always exactly NEW_TOKENS tokens, like min_new_tokens on the transformers side.
    let run = || generate(&loaded.model, &tok, &prompt, &HashSet::new(), &params, |_| Ok(()));
    run()?; // warm-up
    let ours: Vec<GenerationOutput> = (0..3).map(|_| run()).collect::<anyhow::Result<_>>()?;
    let best = ours.iter().max_by(|a, b| a.decode_tokens_per_s.total_cmp(&b.decode_tokens_per_s)).unwrap();

    let python = std::env::var("FSDP_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = root.join("tests").join("bench").join("transformers_generate.py");
    let theirs = Command::new(&python)
        .arg(&script)
        .arg(&dir)
        .arg(serde_json::to_string(&prompt)?)
        .arg(NEW_TOKENS.to_string())
        .arg(threads.to_string())
        .output();
    let theirs: Result<serde_json::Value, String> = match theirs {
        Ok(o) if o.status.success() => {
            let line = String::from_utf8_lossy(&o.stdout).lines().last().unwrap_or("").to_string();
            serde_json::from_str(&line).map_err(|e| format!("bad output: {e}"))
        }
        Ok(o) => Err(String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("failed").to_string()),
        Err(e) => Err(format!("{python}: {e}")),
    };

    println!("\nCPU vector ISA: {}", common::vector_isa());
    println!("Greedy generation, SmolLM2-135M-Instruct (converted, bf16 files, f32 compute), CPU, {threads} threads,");
    println!("batch 1, prompt {} tokens, {NEW_TOKENS} new tokens\n", prompt.len());
    println!("| engine | time to first token (s) | decode tokens/s | total (s) |");
    println!("|---|---|---|---|");
    println!("| fsdp-app (candle) | {:.3} | {:.1} | {:.2} |", best.time_to_first_token_s, best.decode_tokens_per_s, best.total_s);
    match &theirs {
        Ok(t) => {
            let tps = t["decode_tokens_per_s"].as_f64().unwrap_or(0.0);
            println!(
                "| transformers {} (torch {}) | {:.3} | {:.1} | {:.2} |",
                t["transformers"].as_str().unwrap_or("?"),
                t["torch"].as_str().unwrap_or("?"),
                t["ttft_s"].as_f64().unwrap_or(0.0),
                tps,
                t["total_s"].as_f64().unwrap_or(0.0)
            );
            println!("\nratio fsdp-app / transformers (decode tokens/s): {:.2}x", best.decode_tokens_per_s / tps);
        }
        Err(why) => println!("| transformers | n/a: {why} | | |"),
    }
    grammar_mask_cost(&tok, loaded.config.vocab_size, best.decode_tokens_per_s)?;
    long_answer(&loaded.model, &tok, &prompt)
}

const LONG: usize = 4000;
const WINDOW: usize = 200;

/// Tokens/s of the first and last `WINDOW` of `LONG` greedy tokens: whole steps (forward,
/// sampling, detokenization, stop strings), the forward alone on the same ids, and the old
/// per-token cost of decoding every generated id.
fn long_answer(model: &models::CausalLm, tok: &TextTokenizer, prompt: &[u32]) -> anyhow::Result<()> {
    use fsdp_app::generate::Sequence;
    let mut seq = Sequence::new(model, prompt, &HashSet::new(), &SamplingParams::greedy(LONG))?;
    let mut step_times = Vec::with_capacity(LONG);
    seq.step(model, tok)?; // the prompt
    while seq.finish_reason().is_none() {
        let t = Instant::now();
        seq.step(model, tok)?;
        step_times.push(t.elapsed().as_secs_f64());
    }
    let ids = seq.generated_ids().to_vec();
    let mut cache = models::KvCache::new(model.config());
    model.forward_cached(&Tensor::new(prompt, &Device::Cpu)?.unsqueeze(0)?, &mut cache, &Default::default())?;
    let mut forward_times = Vec::with_capacity(ids.len());
    for &id in &ids[..ids.len() - 1] {
        let t = Instant::now();
        model.forward_cached(&Tensor::new(&[id], &Device::Cpu)?.unsqueeze(0)?, &mut cache, &Default::default())?;
        forward_times.push(t.elapsed().as_secs_f64());
    }
    let full_decode = |n: usize| -> anyhow::Result<f64> {
        let t = Instant::now();
        for _ in 0..5 {
            tok.decode(&ids[..n], true)?;
        }
        Ok(t.elapsed().as_secs_f64() / 5.0)
    };
    let rate = |times: &[f64]| times.len() as f64 / times.iter().sum::<f64>();
    let (first, last) = (|t: &[f64]| rate(&t[..WINDOW]), |t: &[f64]| rate(&t[t.len() - WINDOW..]));
    println!("\nLong answer: {} greedy tokens after a {}-token prompt, batch 1 (tokens/s)", ids.len(), prompt.len());
    println!("| | first {WINDOW} | last {WINDOW} | last / first |");
    println!("|---|---|---|---|");
    for (what, t) in [("whole step (forward, sampling, detokenization)", &step_times), ("forward alone, same ids", &forward_times)] {
        println!("| {what} | {:.1} | {:.1} | {:.2}x |", first(t), last(t), last(t) / first(t));
    }
    println!(
        "decoding all generated ids once (what every token cost before incremental detokenization): {:.2} ms at {WINDOW} ids, {:.2} ms at {}",
        full_decode(WINDOW)? * 1e3,
        full_decode(ids.len())? * 1e3,
        ids.len()
    );
    Ok(())
}

/// What constrained decoding (`response_format`) adds per token: the grammar engine's mask
/// over SmolLM2's 49k-token vocabulary and the token's commit, walked along a valid answer to a
/// JSON schema, next to the decode step it runs beside.
fn grammar_mask_cost(tok: &TextTokenizer, vocab: usize, decode_tokens_per_s: f64) -> anyhow::Result<()> {
    use fsdp_app::generate::constraint::{Grammars, OutputFormat};
    let eos = tok.eos_token.as_deref().and_then(|t| tok.inner.token_to_id(t)).unwrap_or(0);
    let grammars = Grammars::new(&tok.inner.to_string(false).map_err(|e| anyhow::anyhow!("{e}"))?, vocab, eos)?;
    let schema = serde_json::json!({"type": "object", "additionalProperties": false, "required": ["city", "population", "landmarks"],
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}, "landmarks": {"type": "array", "items": {"type": "string"}}}});
    let answer = r#"{"city": "Paris", "population": 2102650, "landmarks": ["Eiffel Tower", "Louvre Museum", "Notre-Dame de Paris", "Arc de Triomphe"]}"#;
    let ids = tok.encode(answer, false)?;
    let mut logits = vec![0f32; vocab];
    let mut times = vec![];
    for round in 0..4 {
        let mut m = grammars.matcher(&OutputFormat::JsonSchema(schema.clone()))?;
        let t = std::time::Instant::now();
        for &id in &ids {
            logits.fill(0.0); // a fresh step's logits
            fsdp_app::generate::constraint::mask_logits(&mut m, &mut logits)?;
            anyhow::ensure!(logits[id as usize].is_finite(), "the grammar refused token {id} of a valid answer");
            m.consume_token(id)?;
        }
        if round > 0 {
            times.push(t.elapsed().as_secs_f64() / ids.len() as f64);
        }
    }
    times.sort_by(f64::total_cmp);
    let per_token = times[times.len() / 2];
    println!(
        "
Constrained decoding (response_format json_schema), SmolLM2's {vocab}-token vocabulary, {} tokens of a valid answer:",
        ids.len()
    );
    println!(
        "grammar mask + commit {:.3} ms/token (median of 3 walks) = {:.1}% of a decode step ({:.1} ms)",
        per_token * 1e3,
        100.0 * per_token * decode_tokens_per_s,
        1e3 / decode_tokens_per_s
    );
    Ok(())
}
