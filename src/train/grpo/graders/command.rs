//! The command grader: a program of the user's, fed one JSON line per sample on stdin
//! (`{"sample": {"output_text": ...}, "item": {...the data row...}}`) and answering one score
//! per line on stdout, in order. It runs once per step for the step's samples, with a timeout;
//! a crash, a timeout, a missing or unreadable score is an error that names the grader, the
//! command and what went wrong (with the end of its stderr).

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

use super::GradeInput;

/// How long a command grader may take for a step's samples unless told (`timeout_s`).
pub const DEFAULT_TIMEOUT_S: f64 = 60.0;

#[derive(Debug, Clone, PartialEq)]
pub struct CommandGrader {
    /// The program and its arguments (no shell).
    pub argv: Vec<String>,
    pub timeout: Duration,
}

impl CommandGrader {
    pub(super) fn parse(obj: &Map<String, Value>, at: &str) -> Result<Self> {
        let argv: Vec<String> = match obj.get("command") {
            Some(Value::String(s)) => s.split_whitespace().map(str::to_string).collect(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| x.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .with_context(|| format!("{at}.command: a list of strings"))?,
            _ => bail!("{at}.command: required, the program and its arguments (a list of strings, or one string split at spaces)"),
        };
        if argv.is_empty() {
            bail!("{at}.command: empty");
        }
        let timeout_s = match obj.get("timeout_s") {
            None => DEFAULT_TIMEOUT_S,
            Some(v) => {
                v.as_f64().filter(|t| t.is_finite() && *t > 0.0).with_context(|| format!("{at}.timeout_s: a positive number of seconds"))?
            }
        };
        Ok(Self { argv, timeout: Duration::from_secs_f64(timeout_s) })
    }

    fn shown(&self) -> String {
        self.argv.join(" ")
    }

    /// One score per sample.
    pub fn run(&self, name: &str, samples: &[GradeInput]) -> Result<Vec<f64>> {
        let what = || format!("grader {name:?} (`{}`)", self.shown());
        let mut input = Vec::new();
        for s in samples {
            serde_json::to_writer(&mut input, &json!({"sample": {"output_text": s.output_text}, "item": s.item}))?;
            input.push(b'\n');
        }
        let mut child = Command::new(&self.argv[0])
            .args(&self.argv[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("{}: cannot start it", what()))?;
        // Pipes drained on threads: a grader that writes a lot before reading all its input
        // must not deadlock against us.
        let mut stdin = child.stdin.take().expect("piped");
        let writer = std::thread::spawn(move || stdin.write_all(&input));
        let mut stdout = child.stdout.take().expect("piped");
        let out_reader = std::thread::spawn(move || {
            let mut s = String::new();
            stdout.read_to_string(&mut s).map(|_| s)
        });
        let mut stderr = child.stderr.take().expect("piped");
        let err_reader = std::thread::spawn(move || {
            let mut s = Vec::new();
            let _ = stderr.read_to_end(&mut s);
            String::from_utf8_lossy(&s).to_string()
        });
        let start = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if start.elapsed() > self.timeout {
                let _ = child.kill();
                let _ = child.wait();
                bail!("{}: no answer for {} samples within {:.1}s (timeout_s)", what(), samples.len(), self.timeout.as_secs_f64());
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        // A grader that exits without reading its input closes the pipe: its exit status says more.
        let _ = writer.join();
        let stdout = out_reader.join().map_err(|_| anyhow::anyhow!("reading the grader's output"))?.context("the grader's output")?;
        let stderr = err_reader.join().unwrap_or_default();
        if !status.success() {
            let tail: String = stderr.lines().rev().take(5).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
            bail!("{}: exited with {status}{}", what(), if tail.is_empty() { String::new() } else { format!(":\n{tail}") });
        }
        let lines: Vec<&str> = stdout.lines().filter(|l| !l.trim().is_empty()).collect();
        if lines.len() != samples.len() {
            bail!("{}: answered {} score lines for {} samples (one per line, in order)", what(), lines.len(), samples.len());
        }
        lines
            .iter()
            .enumerate()
            .map(|(i, l)| {
                l.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite())
                    .with_context(|| format!("{}: output line {}: {l:?} is not a number", what(), i + 1))
            })
            .collect()
    }
}
