//! The long-prompt rows of `cargo bench --bench serving` (`-- long` runs only these): a short
//! request sent during a 3,000-token prefill (head of line), one long prompt's time to first
//! token and the server's RSS before, at its peak and after (from /proc, outside the process),
//! `generate` on an 8,191-token prompt (time to first token, peak RSS), and a chat's second
//! turn after a 1,000-token first turn with the prefix cache on and off.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::common;
use super::streams::{peak_rss, start_server};

/// A prompt of exactly `tokens` tokens of SmolLM2's tokenizer (numbered lines of prose, cut),
/// starting with `label`: prompts with different labels share no prefix to cache.
fn prompt_of(dir: &Path, label: &str, tokens: usize) -> anyhow::Result<String> {
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).map_err(anyhow::Error::msg)?;
    let text: String = std::iter::once(format!("{label}. "))
        .chain((0..tokens).map(|i| format!("Line {i}: the harbour log notes the tide, the wind from the west and {} boats. ", i % 17)))
        .take(tokens / 8 + 1)
        .collect();
    let ids = tok.encode(text, false).map_err(anyhow::Error::msg)?.get_ids().to_vec();
    anyhow::ensure!(ids.len() >= tokens, "the generated text has only {} tokens", ids.len());
    tok.decode(&ids[..tokens], false).map_err(anyhow::Error::msg)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// Streams `body` to `url`: (seconds to the first streamed text, usage).
fn ttft(url: &str, mut body: Value) -> (f64, Value) {
    use std::io::{BufRead, BufReader};
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let start = Instant::now();
    let r = ureq::post(url).send_string(&body.to_string()).expect("request");
    let (mut first, mut usage) = (None, Value::Null);
    for line in BufReader::new(r.into_reader()).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        let c = &v["choices"][0];
        let text = c["text"].as_str().or(c["delta"]["content"].as_str()).unwrap_or("");
        if first.is_none() && !text.is_empty() {
            first = Some(start.elapsed().as_secs_f64());
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    (first.unwrap_or(start.elapsed().as_secs_f64()), usage)
}

fn wait_running(base: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let m = ureq::get(&format!("{base}/metrics")).call().unwrap().into_string().unwrap();
        if m.contains(&format!("fsdp_running_sequences {n}")) {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("no request started");
}

/// Head of line on a fresh server.
fn head_of_line_row(dir: &Path) -> anyhow::Result<()> {
    let (mut child, url) = start_server(dir, &[])?;
    let base = url.trim_end_matches("/v1/completions").to_string();
    ttft(&url, json!({"model": "smollm2", "prompt": "Hello", "max_tokens": 2}));
    let long_prompt = prompt_of(dir, "Log A", 3000)?;
    let long = {
        let url = url.clone();
        std::thread::spawn(move || ttft(&url, json!({"model": "smollm2", "prompt": long_prompt, "max_tokens": 1})))
    };
    wait_running(&base, 1);
    let start = Instant::now();
    let short = ureq::post(&url)
        .send_string(&json!({"model": "smollm2", "prompt": "Hi", "max_tokens": 2, "temperature": 0}).to_string())?
        .into_string()?;
    let short_secs = start.elapsed().as_secs_f64();
    let (long_ttft, _) = long.join().unwrap();
    anyhow::ensure!(short.contains("\"completion_tokens\":2"), "{short}");
    println!("| head of line: a 2-token request sent during a 3,000-token prefill | answered in {short_secs:.2} s (the long prompt's first token: {long_ttft:.1} s) |");

    let _ = child.kill();
    let _ = child.wait();
    Ok(())
}

/// One 4,000-token prompt on a fresh server with `flags`: its time to first token and the
/// server's RSS idle before, at the peak and idle after (the prefix cache keeps the prompt's
/// blocks, up to --kv-cache-memory).
fn long_prompt_row(dir: &Path, flags: &[&str]) -> anyhow::Result<()> {
    let flags: Vec<String> = flags.iter().map(|f| f.to_string()).collect();
    let (mut child, url) = start_server(dir, &flags)?;
    ttft(&url, json!({"model": "smollm2", "prompt": "Hello", "max_tokens": 2}));
    std::thread::sleep(Duration::from_millis(500));
    let idle = common::rss_of(child.id());
    let prompt = prompt_of(dir, "Log B", 4000)?;
    let (secs, usage) = ttft(&url, json!({"model": "smollm2", "prompt": prompt, "max_tokens": 1}));
    let peak = peak_rss(child.id());
    std::thread::sleep(Duration::from_secs(1)); // idle: the engine hands freed memory back
    let after = common::rss_of(child.id());
    println!(
        "| serve {}, a {}-token prompt | first token {secs:.1} s; RSS {:.0} MiB idle before, peak {:.0} MiB, {:.0} MiB idle after ({:+.0}) |",
        if flags.is_empty() { "(default)".to_string() } else { flags.join(" ") },
        usage["prompt_tokens"],
        mib(idle),
        mib(peak),
        mib(after),
        mib(after) - mib(idle)
    );
    let _ = child.kill();
    let _ = child.wait();
    Ok(())
}

/// `fsdp-app generate` on an 8,191-token prompt: its time to first token and, from outside,
/// its peak RSS.
fn generate_row(dir: &Path) -> anyhow::Result<()> {
    let prompt = prompt_of(dir, "Log C", 8191)?;
    let mut child = Command::new(common::bin())
        .args(["generate", "--model", dir.to_str().unwrap(), "--dtype", "f32", "--max-new-tokens", "1", "--prompt"])
        .arg(&prompt)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let pid = child.id();
    let mut peak = 0;
    while child.try_wait()?.is_none() {
        peak = peak.max(peak_rss(pid));
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut out)?;
    let ttft = out.split("time to first token: ").nth(1).and_then(|s| s.split('s').next()).unwrap_or("?");
    let tokens = out.split("prompt tokens: ").nth(1).and_then(|s| s.split(' ').next()).unwrap_or("?");
    println!("| generate, a {tokens}-token prompt | first token {ttft} s; peak RSS {:.0} MiB |", mib(peak));
    Ok(())
}

/// A chat's second turn after a ~1,000-token first turn, with `flags`: (first TTFT, second
/// TTFT, cached tokens of the second).
fn two_turns(dir: &Path, flags: &[String]) -> anyhow::Result<(f64, f64, Value)> {
    let (mut child, url) = start_server(dir, flags)?;
    let chat = url.replace("/v1/completions", "/v1/chat/completions");
    ttft(&chat, json!({"model": "smollm2", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}));
    let system = prompt_of(dir, "Log D", 1000)?;
    let mut messages = json!([{"role": "system", "content": system}, {"role": "user", "content": "Which boats came in?"}]);
    let (first, _) = ttft(&chat, json!({"model": "smollm2", "messages": messages, "max_tokens": 16, "temperature": 0}));
    messages.as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "Several boats came in with the tide."}),
        json!({"role": "user", "content": "And which wind did the log note?"}),
    ]);
    let (second, usage) = ttft(&chat, json!({"model": "smollm2", "messages": messages, "max_tokens": 16, "temperature": 0}));
    let _ = child.kill();
    let _ = child.wait();
    Ok((first, second, usage["prompt_tokens_details"]["cached_tokens"].clone()))
}

fn prefix_cache_rows(dir: &Path) -> anyhow::Result<()> {
    let (first, second, cached) = two_turns(dir, &[])?;
    let (cold_first, cold_second, _) = two_turns(dir, &["--kv-cache-memory".to_string(), "0".to_string()])?;
    println!(
        "| prefix cache: a chat's second turn after a 1,000-token first | first turn {first:.2} s, second {second:.2} s \
         ({:.2} of the first, {cached} tokens cached); without the cache {cold_first:.2} s and {cold_second:.2} s |",
        second / first
    );
    Ok(())
}

pub fn rows(dir: &Path) -> anyhow::Result<()> {
    println!();
    println!("Long prompts (SmolLM2-135M-Instruct f32, prefill in chunks of {} tokens)", fsdp_app::generate::DEFAULT_MAX_PREFILL_TOKENS);
    println!("| row | result |");
    println!("|---|---|");
    head_of_line_row(dir)?;
    long_prompt_row(dir, &[])?;
    long_prompt_row(dir, &["--kv-cache-memory", "0"])?;
    prefix_cache_rows(dir)?;
    generate_row(dir)
}
