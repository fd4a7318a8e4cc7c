//! `cargo bench --bench generation`: greedy generation speed of converted SmolLM2-135M-Instruct
//! (f32, CPU, batch 1, 128 new tokens) for fsdp-app and for transformers on the same files and
//! the same number of threads, in one invocation, printed as a table with the ratio.
//!
//! Then the same prompt and token count beside llama.cpp (llama-cpp-python 0.3.36, built from
//! source for this CPU into target/llama-cpp-venv on first use, ~10 minutes on 2 cores; or
//! FSDP_BENCH_LLAMA_CPP_PYTHON), both reading the same GGUF file in each format llama.cpp users
//! run: f32, f16, Q8_0, Q4_K_M (made from the shipped file by llama.cpp's own quantizer) and the
//! shipped Q4_1, then Q4_K_M, Q5_K_M and Q6_K of a model whose rows the K formats divide
//! (`k_wide_model.rs`; rows "/1024"); decode and prefill tokens/s, their ratios, and each
//! engine's perplexity of tests/data/perplexity.txt. `cargo bench --bench generation -- llama.cpp`
//! runs only that.
//!
//! Then a long answer: 4,000 greedy tokens, tokens/s of the first and the last 200, beside the
//! model's forward alone at the same positions (what the KV cache's growth explains) and what
//! decoding all generated ids at every token (the way before incremental detokenization) costs.
//! `cargo bench --bench generation -- long` runs only that.
//!
//! Environment: FSDP_SMOLLM2_GGUF (else the GGUF the smollm2 test downloaded to target/smollm2),
//! FSDP_BENCH_PYTHON (a Python with torch + transformers; default python3), FSDP_BENCH_FORMATS
//! (a comma-separated subset of the llama.cpp rows), FSDP_BENCH_THREADS
//! (default 2). Without Python+transformers the transformers row says why it is missing.

#[path = "../common/mod.rs"]
mod common;
#[path = "k_wide_model.rs"]
mod k_wide_model;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use fsdp_app::generate::{generate, GenerationOutput, SamplingParams, DEFAULT_MAX_PREFILL_TOKENS};
use fsdp_app::model_files::{load_model, resolve_model};
use fsdp_app::tokenize::{ChatMessage, TextTokenizer};

const NEW_TOKENS: usize = 128;
/// Turns each engine takes per format beside llama.cpp (the fastest is kept).
const ROUNDS: usize = 5;
const PROMPT: &str = "Write a short story about a lighthouse keeper who finds a message in a bottle.";

/// The binary's allocator, as `fsdp-app` declares it (the bench measures what users run).
#[global_allocator]
static ALLOCATOR: fsdp_app::process::Allocator = fsdp_app::process::Allocator;

fn main() -> anyhow::Result<()> {
    let threads: usize = std::env::var("FSDP_BENCH_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(2);
    fsdp_app::process::init(fsdp_app::process::CpuWorkload::Decode, Some(threads))?;
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
    if std::env::args().skip(1).any(|a| a == "llama.cpp") {
        println!("\nCPU vector ISA: {}", common::vector_isa());
        return versus_llama_cpp(&root, tmp.path(), &gguf, &tok, &prompt, threads);
    }
    if std::env::args().skip(1).any(|a| a == "long") {
        println!("\nCPU vector ISA: {}", common::vector_isa());
        return long_answer(&loaded.model, &tok, &prompt);
    }
    // No eos: always exactly NEW_TOKENS tokens, like min_new_tokens on the transformers side.
    let run = || generate(&loaded.model, &tok, &prompt, &HashSet::new(), &params, DEFAULT_MAX_PREFILL_TOKENS, |_| Ok(()));
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
    versus_llama_cpp(&root, tmp.path(), &gguf, &tok, &prompt, threads)?;
    long_answer(&loaded.model, &tok, &prompt)
}

/// A Python with llama-cpp-python built for this CPU: FSDP_BENCH_LLAMA_CPP_PYTHON, or a venv in
/// target/llama-cpp-venv made (and the package compiled, GGML_NATIVE=ON) on first use.
fn llama_cpp_python(root: &Path) -> Result<PathBuf, String> {
    if let Ok(python) = std::env::var("FSDP_BENCH_LLAMA_CPP_PYTHON") {
        return Ok(python.into());
    }
    let env = root.join("target").join("llama-cpp-venv");
    let python = env.join("bin").join("python");
    let run = |c: &mut Command| match c.output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("failed").to_string()),
        Err(e) => Err(e.to_string()),
    };
    if !python.is_file() {
        run(Command::new("python3").args(["-m", "venv"]).arg(&env)).map_err(|e| format!("python3 -m venv: {e}"))?;
    }
    if run(Command::new(&python).args(["-c", "import llama_cpp"])).is_err() {
        eprintln!("building llama-cpp-python 0.3.36 for this CPU into {} (once, ~10 minutes on 2 cores)", env.display());
        run(Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "llama-cpp-python==0.3.36"])
            .env("CMAKE_ARGS", "-DGGML_NATIVE=ON"))
        .map_err(|e| format!("pip install llama-cpp-python: {e}"))?;
    }
    Ok(python)
}

/// Greedy generation of `NEW_TOKENS` after `prompt` (batch 1), fsdp-app beside llama.cpp, for each
/// weight format, both reading the same GGUF file: the shipped Q4_1, and f32, f16, Q8_0,
/// Q4_K_M and bf16 made from it by llama.cpp's own quantizer; then Q4_K_M, Q5_K_M and Q6_K of
/// `k_wide_model`'s model. fsdp-app keeps each file's
/// weights as stored (blocks, or f16 / bf16 read in place) and computes in f32 (a bf16 prompt's
/// products on AMX tiles, where the CPU has them, round the activations to bf16, as llama.cpp's
/// bf16 products do). Then the perplexity of tests/data/perplexity.txt under each, both engines
/// scoring the same ids.
fn versus_llama_cpp(root: &Path, tmp: &Path, gguf: &Path, tok: &TextTokenizer, prompt: &[u32], threads: usize) -> anyhow::Result<()> {
    use fsdp_app::generate::perplexity::perplexity;
    let python = llama_cpp_python(root);
    let script = root.join("tests").join("bench").join("llama_cpp_generate.py");
    let prompt_json = serde_json::to_string(prompt)?;
    let text_ids = tok.encode(&std::fs::read_to_string(root.join("tests").join("data").join("perplexity.txt"))?, true)?;
    let text_ids_json = serde_json::to_string(&text_ids)?;
    println!(
        "\nBeside llama.cpp, the same GGUF files: greedy, batch 1, {threads} threads, prompt {} tokens, {NEW_TOKENS} new tokens (the engines take turns, {ROUNDS} runs each, the fastest kept);",
        prompt.len()
    );
    println!("perplexity of tests/data/perplexity.txt ({} tokens, one window)\n", text_ids.len());
    println!(
        "| weights | llama.cpp decode tok/s | fsdp-app decode tok/s | ratio | llama.cpp prefill tok/s | fsdp-app prefill tok/s | ratio | llama.cpp perplexity | fsdp-app perplexity | difference |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let llama_cpp = |py: &PathBuf, args: &[&str]| -> Result<serde_json::Value, String> {
        let o = Command::new(py).arg(&script).args(args).output().map_err(|e| e.to_string())?;
        let line = String::from_utf8_lossy(&o.stdout).lines().last().unwrap_or("").to_string();
        serde_json::from_str(&line).map_err(|_| String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("no output").to_string())
    };
    // Long prompts' prefill, per format, printed as a second table after the first.
    let long_prompts: Vec<Vec<u32>> = PREFILL_PROMPTS.iter().map(|&n| text_ids.iter().copied().cycle().take(n).collect()).collect();
    let mut prefill_rows = vec![];
    // FSDP_BENCH_FORMATS=f32,q8_0 runs only those rows (a quicker look at one format).
    let wanted = std::env::var("FSDP_BENCH_FORMATS").ok();
    let wanted = |f: &str| wanted.as_deref().is_none_or(|w| w.split(',').any(|x| x.trim() == f));
    // The rows: SmolLM2's shipped Q4_1 as it is, the other formats made from it by llama.cpp's
    // quantizer, and the K formats once more from a model whose rows they divide ("/1024").
    let k_wide = tmp.join("k-wide-f32.gguf");
    let mut rows: Vec<(String, &Path, Option<&str>)> =
        ["f32", "f16", "q8_0", "q4_k_m"].iter().map(|f| (f.to_string(), gguf, Some(*f))).collect();
    rows.push(("q4_1".into(), gguf, None));
    rows.push(("bf16".into(), gguf, Some("bf16")));
    rows.extend(["q4_k_m", "q5_k_m", "q6_k"].iter().map(|f| (format!("{f}/1024"), k_wide.as_path(), Some(*f))));
    for (format, source, to) in rows.into_iter().filter(|(label, ..)| wanted(label)) {
        let format = format.as_str();
        if source == k_wide && !k_wide.exists() {
            k_wide_model::write_k_wide_gguf(gguf, &k_wide)?;
        }
        let file = match to {
            None => Ok(source.to_path_buf()),
            Some(to) => python.clone().and_then(|py| {
                let out = tmp.join(format!("{}.gguf", format.replace('/', "-")));
                let o = Command::new(&py).arg(&script).args(["quantize", source.to_str().unwrap(), out.to_str().unwrap(), to]).output();
                match o {
                    Ok(o) if o.status.success() => Ok(out),
                    Ok(o) => Err(String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("quantize failed").to_string()),
                    Err(e) => Err(e.to_string()),
                }
            }),
        };
        let file = match file {
            Ok(f) => f,
            Err(why) => {
                println!("| {format} | - | - | - | - | - | - | - | - | - |\n(llama.cpp {format}: {why})");
                continue;
            }
        };
        let f = file.to_str().unwrap();
        let model = load_model(resolve_model(f, None)?, DType::F32, &Device::Cpu)?.model;
        let params = SamplingParams::greedy(NEW_TOKENS);
        let run = || generate(&model, tok, prompt, &HashSet::new(), &params, DEFAULT_MAX_PREFILL_TOKENS, |_| Ok(()));
        run()?;
        let num = |v: &Result<serde_json::Value, String>, key: &str| v.as_ref().ok().and_then(|t| t[key].as_f64()).unwrap_or(f64::NAN);
        // The two engines take turns, ROUNDS times, and each keeps its fastest: on a shared
        // machine a neighbour's load then falls on both rather than on whichever ran second.
        // Decode and prefill are kept apart: each engine's fastest of each.
        let (mut theirs, mut ours): (Result<serde_json::Value, String>, Option<GenerationOutput>) = (Err("not run".into()), None);
        let (mut their_best_prefill, mut our_best_ttft) = (f64::NAN, f64::INFINITY);
        for _ in 0..ROUNDS {
            let args = ["run", f, &prompt_json, &NEW_TOKENS.to_string(), &threads.to_string(), "1"];
            let round = python.clone().and_then(|py| llama_cpp(&py, &args));
            their_best_prefill = their_best_prefill.max(num(&round, "prefill_tokens_per_s"));
            if theirs.is_err() || num(&round, "decode_tokens_per_s") > num(&theirs, "decode_tokens_per_s") {
                theirs = round;
            }
            let round = run()?;
            our_best_ttft = our_best_ttft.min(round.time_to_first_token_s);
            if ours.as_ref().is_none_or(|o| round.decode_tokens_per_s > o.decode_tokens_per_s) {
                ours = Some(round);
            }
        }
        let ours = ours.expect("ROUNDS > 0");
        let their_ppl = python.clone().and_then(|py| llama_cpp(&py, &["perplexity", f, &text_ids_json]));
        let our_ppl = perplexity(&model, &text_ids)?.perplexity;
        let (their_decode, their_prefill) = (num(&theirs, "decode_tokens_per_s"), their_best_prefill);
        let their_ppl_v = num(&their_ppl, "perplexity");
        let cell = |x: f64| if x.is_nan() { "-".to_string() } else { format!("{x:.1}") };
        let ratio = |a: f64, b: f64| if b.is_nan() { "-".to_string() } else { format!("{:.2}x", a / b) };
        let (our_decode, our_prefill) = (ours.decode_tokens_per_s, prompt.len() as f64 / our_best_ttft);
        let diff = if their_ppl_v.is_nan() { "-".to_string() } else { format!("{:+.2}%", (our_ppl / their_ppl_v - 1.0) * 100.0) };
        println!(
            "| {format} | {} | {} | {} | {} | {} | {} | {} | {our_ppl:.3} | {diff} |",
            cell(their_decode),
            cell(our_decode),
            ratio(our_decode, their_decode),
            cell(their_prefill),
            cell(our_prefill),
            ratio(our_prefill, their_prefill),
            if their_ppl_v.is_nan() { "-".to_string() } else { format!("{their_ppl_v:.3}") },
        );
        for (what, r) in [("run", &theirs), ("perplexity", &their_ppl)] {
            if let Err(why) = r {
                println!("(llama.cpp {format} {what}: {why})");
            }
        }
        // Prefill of each long prompt: one new token, the engines taking turns, fastest kept.
        let mut row = format!("| {format} |");
        for long in &long_prompts {
            let (mut their_best, mut our_best) = (f64::NAN, f64::NAN);
            let long_json = serde_json::to_string(long)?;
            for _ in 0..PREFILL_ROUNDS {
                let args = ["run", f, &long_json, "1", &threads.to_string(), "1"];
                let round = num(&python.clone().and_then(|py| llama_cpp(&py, &args)), "prefill_tokens_per_s");
                their_best = their_best.max(round); // f64::max skips a NaN (a failed round)
                let once =
                    generate(&model, tok, long, &HashSet::new(), &SamplingParams::greedy(1), DEFAULT_MAX_PREFILL_TOKENS, |_| Ok(()))?;
                let ours = long.len() as f64 / once.time_to_first_token_s;
                our_best = our_best.max(ours);
            }
            row += &format!(" {} | {} | {} |", cell(their_best), cell(our_best), ratio(our_best, their_best));
        }
        prefill_rows.push(row);
    }
    println!("\nPrefill of long prompts (the text's ids repeated; one new token; {PREFILL_ROUNDS} turns each, the fastest kept):\n");
    let mut header = "| weights |".to_string();
    for n in PREFILL_PROMPTS {
        header += &format!(" llama.cpp {n} tok/s | fsdp-app {n} tok/s | ratio |");
    }
    println!("{header}\n|---|{}", "---|---|---|".repeat(PREFILL_PROMPTS.len()));
    for row in prefill_rows {
        println!("{row}");
    }
    Ok(())
}

/// Prompt lengths of the long-prompt prefill table.
const PREFILL_PROMPTS: [usize; 2] = [512, 2048];
/// Turns per engine and length there.
const PREFILL_ROUNDS: usize = 3;

const LONG: usize = 4000;
const WINDOW: usize = 200;

/// Tokens/s of the first and last `WINDOW` of `LONG` greedy tokens: whole steps (forward,
/// sampling, detokenization, stop strings), the forward alone on the same ids, and the old
/// per-token cost of decoding every generated id.
fn long_answer(model: &models::CausalLm, tok: &TextTokenizer, prompt: &[u32]) -> anyhow::Result<()> {
    use fsdp_app::generate::Sequence;
    let mut seq = Sequence::new(model, prompt, &HashSet::new(), &SamplingParams::greedy(LONG))?;
    let mut step_times = Vec::with_capacity(LONG);
    seq.step(model, tok, usize::MAX)?; // the whole prompt in one forward
    while seq.finish_reason().is_none() {
        let t = Instant::now();
        seq.step(model, tok, usize::MAX)?;
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
