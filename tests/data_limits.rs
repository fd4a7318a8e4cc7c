//! Bad or oversized training rows, as a new user meets them: an oversized row costs memory in
//! proportion to the sequence length, not to its size (peak RSS measured from outside), a text
//! row past the limit and pairs that train nothing are refused by file, line and field, the
//! first bad field is the one named, and the server refuses an oversized row at upload.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::server::*;
use common::*;
use serde_json::json;

/// The peak resident memory of `cmd` (its VmHWM, read from /proc while it runs), and its output.
fn peak_rss(mut cmd: std::process::Command) -> (u64, std::process::Output) {
    let child = cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    let watcher = std::thread::spawn(move || {
        let mut peak = 0u64;
        let deadline = Instant::now() + Duration::from_secs(300);
        while let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
            if let Some(kb) =
                status.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            {
                peak = peak.max(kb * 1024);
            }
            if status.lines().any(|l| l.starts_with("State:") && l.contains("zombie")) || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        peak
    });
    let out = child.wait_with_output().unwrap();
    (watcher.join().unwrap(), out)
}

fn finetune(model: &Path, data: &Path, out: &Path, extra: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new(bin());
    cmd.args(["finetune", "--model", model.to_str().unwrap(), "--data", data.to_str().unwrap(), "--output-dir", out.to_str().unwrap()]);
    cmd.args(["--seq-len", "64", "--max-steps", "1", "--batch-size", "1"]).args(extra).env_remove("RUST_BACKTRACE");
    cmd
}

fn write_rows(path: &Path, rows: &[serde_json::Value]) {
    std::fs::write(path, rows.iter().map(|r| r.to_string() + "\n").collect::<String>()).unwrap();
}

#[test]
fn an_oversized_preference_row_costs_memory_by_the_sequence_length() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let data = tmp.path().join("pairs.jsonl");
    // 32 MB of text in one pair: tokenised whole it took a tiny model's run to gigabytes.
    let huge = "The quick brown fox jumps over the lazy dog. ".repeat(700_000);
    write_rows(
        &data,
        &[
            json!({"prompt": format!("{huge}Question?"), "chosen": format!("Yes. {huge}"), "rejected": "No."}),
            json!({"prompt": "Is the sky blue?", "chosen": "Yes.", "rejected": "No."}),
        ],
    );
    let (peak, out) = peak_rss(finetune(&model, &data, &tmp.path().join("run"), &["--method", "dpo"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The file's bytes and its parsed row are ~100 MB; tokenising 32 MB whole took gigabytes.
    assert!(peak < 600 << 20, "peak RSS {} MiB with a 32 MB row at --seq-len 64", peak >> 20);
}

#[test]
fn rows_that_cannot_train_are_named_by_file_line_and_field() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let refused = |name: &str, rows: &[serde_json::Value], extra: &[&str], must: &[&str]| {
        let data = tmp.path().join(name);
        write_rows(&data, rows);
        let out = finetune(&model, &data, &tmp.path().join("run"), extra).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "{name} was accepted");
        assert_eq!(err.lines().filter(|l| !l.trim().is_empty()).count(), 1, "one line: {err}");
        for m in must {
            assert!(err.contains(m), "{name}: the error should name {m:?}: {err}");
        }
    };
    let good = json!({"prompt": "Is the sky blue?", "chosen": "Yes.", "rejected": "No."});
    let dpo = ["--method", "dpo"];
    refused(
        "same.jsonl",
        &[good.clone(), json!({"prompt": "Hi", "chosen": "Hello.", "rejected": "Hello."})],
        &dpo,
        &["same.jsonl:2", "the same"],
    );
    refused(
        "empty.jsonl",
        &[good.clone(), json!({"prompt": "Hi", "chosen": "  ", "rejected": "No."})],
        &dpo,
        &["empty.jsonl:2", "`chosen` is empty"],
    );
    refused(
        "numbers.jsonl",
        &[json!({"prompt": 1, "chosen": 2, "rejected": 3})],
        &dpo,
        &["numbers.jsonl:1", "field `prompt`", "a string or a list of messages"],
    );
    let text = "word ".repeat(300_000);
    refused("text.jsonl", &[json!({"text": text})], &[], &["text.jsonl:1", "field `text`", "split it"]);
    // Skipped and counted with --skip-bad-rows: the good pair trains.
    let data = tmp.path().join("mixed.jsonl");
    write_rows(&data, &[good.clone(), json!({"prompt": "Hi", "chosen": "Hello.", "rejected": "Hello."}), good]);
    let out = finetune(&model, &data, &tmp.path().join("run2"), &["--method", "dpo", "--skip-bad-rows"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("mixed.jsonl:2") && err.contains("the same"), "the skipped row is named: {err}");
}

#[test]
fn an_oversized_upload_row_is_refused_by_line() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let server = Server::start(&model, &["--data-dir", tmp.path().join("data").to_str().unwrap()]);
    let small = json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}).to_string();
    let big =
        json!({"messages": [{"role": "user", "content": "x".repeat(3 << 20)}, {"role": "assistant", "content": "Hello."}]}).to_string();
    let (status, err) = upload(&server, "big.jsonl", format!("{small}\n{big}\n").as_bytes());
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["code"], "row_too_large", "{err}");
    assert!(err["error"]["message"].as_str().unwrap().starts_with("Line 2: a row of"), "{err}");
    let pairs = format!("{}\n", json!({"prompt": "Hi", "chosen": "Hello.", "rejected": "Hello."}));
    let (status, err) = upload(&server, "same.jsonl", pairs.as_bytes());
    assert_eq!(status, 400, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("the same"), "{err}");
}
