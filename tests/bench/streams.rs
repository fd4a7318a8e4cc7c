//! What the serving benches share: `fsdp-app serve` started on a model, one streamed completion
//! measured by its client, and a process's peak RSS read from outside.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use super::common;

/// New tokens per streamed completion.
pub const NEW_TOKENS: usize = 64;

/// One streamed completion of `model` (sampling, temperature 0.7, seed `i`): its generated
/// tokens, seconds to its first text, and seconds in all.
pub fn stream_once(url: &str, model: &str, i: usize) -> (usize, f64, f64) {
    let body = serde_json::json!({
        "model": model, "prompt": format!("Story {i}: Once upon a time, in a small village by the sea,"),
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

/// The peak resident set (VmHWM) of a process, read from outside.
pub fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb = status.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok());
    kb.unwrap_or(0) * 1024
}

/// `fsdp-app serve` of `dir` with `extra` flags; the child and its completions URL.
pub fn start_server(dir: &Path, extra: &[String]) -> anyhow::Result<(Child, String)> {
    let mut child = Command::new(common::bin())
        .args(["serve", "--model", dir.to_str().unwrap(), "--port", "0", "--served-model-name", "smollm2"])
        .args(["--max-concurrent-requests", "16", "--max-queue", "64"])
        .args(extra)
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
    Ok((child, format!("http://{addr}/v1/completions")))
}
