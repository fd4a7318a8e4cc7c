//! Multi-process runs: `fsdp-app launch` starts real processes that join over TCP; they must
//! train exactly like the threads of the local backend, and when one dies or fails the job must
//! end, non-zero, naming the rank, within a bounded time.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn finetune_args<'a>(model: &'a str, out: &'a str, data: &'a str, steps: &'a str) -> Vec<&'a str> {
    finetune_args_batch(model, out, data, steps, "2")
}

fn finetune_args_batch<'a>(model: &'a str, out: &'a str, data: &'a str, steps: &'a str, batch: &'a str) -> Vec<&'a str> {
    vec![
        "finetune", "--model", model, "--data", data, "--output-dir", out, "--seq-len", "16", "--batch-size", batch,
        "--max-steps", steps, "--lr", "1e-3", "--no-shuffle", "--collective-timeout", "60",
    ]
}

#[test]
fn launched_processes_train_like_local_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let data = reference_dir().join("train-data.jsonl");
    let (m, d) = (model.to_str().unwrap(), data.to_str().unwrap());
    let local_out = tmp.path().join("local");
    let mut args = finetune_args(m, local_out.to_str().unwrap(), d, "6");
    args.extend(["--world-size", "2"]);
    let o = run_cli(&args, &[]);
    assert!(o.status.success(), "{}", stderr(&o));

    let launched_out = tmp.path().join("launched");
    let port = free_port();
    let mut args = vec!["launch", "--nproc-per-node", "2", "--master-port", &port, "--"];
    args.extend(finetune_args(m, launched_out.to_str().unwrap(), d, "6"));
    let o = run_cli(&args, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("peak RSS per rank ["), "{}", stderr(&o));
    assert_eq!(metric_losses(&launched_out), metric_losses(&local_out), "same collectives, same order: identical losses");

    // The same processes started by hand with torchrun's variables (as torchrun or srun would).
    let manual_out = tmp.path().join("manual");
    let port = free_port();
    let children: Vec<_> = (0..2)
        .map(|r| {
            Command::new(bin())
                .args(finetune_args(m, manual_out.to_str().unwrap(), d, "6"))
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for c in children {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    assert_eq!(metric_losses(&manual_out), metric_losses(&local_out));
}

/// Pids of the launcher's children, in the order it started them (rank order).
fn children_of(pid: u32) -> Vec<u32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    text.split_whitespace().map(|p| p.parse().unwrap()).collect()
}

#[test]
fn a_killed_rank_ends_the_job_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let data = reference_dir().join("train-data.jsonl");
    let out = tmp.path().join("out");
    let port = free_port();
    let mut args = vec!["launch", "--nproc-per-node", "3", "--master-port", &port, "--grace", "20", "--"];
    // Many steps: the job is still training when rank 1 is killed.
    let (m, o, d) = (model.to_str().unwrap().to_string(), out.to_str().unwrap().to_string(), data.to_str().unwrap().to_string());
    args.extend(finetune_args_batch(&m, &o, &d, "100000", "1"));
    let mut launcher = Command::new(bin()).args(&args).stderr(Stdio::piped()).spawn().unwrap();
    // Wait until training runs (metrics appear), then kill rank 1 with SIGKILL.
    let start = Instant::now();
    while !out.join("metrics.jsonl").exists() || std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().count() < 2 {
        assert!(start.elapsed() < Duration::from_secs(60), "training never started");
        if let Some(status) = launcher.try_wait().unwrap() {
            let mut e = String::new();
            launcher.stderr.take().unwrap().read_to_string(&mut e).unwrap();
            panic!("launcher ended early ({status}): {e}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let kids = children_of(launcher.id());
    assert_eq!(kids.len(), 3, "{kids:?}");
    let killed_at = Instant::now();
    Command::new("kill").args(["-9", &kids[1].to_string()]).status().unwrap();
    let status = loop {
        if let Some(s) = launcher.try_wait().unwrap() {
            break s;
        }
        assert!(killed_at.elapsed() < Duration::from_secs(40), "the job did not end after a rank died");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    launcher.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(!status.success());
    assert!(err.contains("rank 1 was killed by signal 9"), "{err}");
    // The surviving ranks stopped by themselves (well inside the grace period), saying why.
    assert!(killed_at.elapsed() < Duration::from_secs(15), "took {:?}", killed_at.elapsed());
    assert!(err.contains("rank 1's process disconnected"), "{err}");
}

#[test]
fn a_failing_rank_0_stops_the_others() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    // A corrupt weight file: only rank 0 reads it, and the others must hear about it.
    corrupt_header(&model.join("model.safetensors"));
    let data = reference_dir().join("train-data.jsonl");
    let out = tmp.path().join("out");
    let port = free_port();
    let mut args = vec!["launch", "--nproc-per-node", "2", "--master-port", &port, "--"];
    let (m, o, d) = (model.to_str().unwrap().to_string(), out.to_str().unwrap().to_string(), data.to_str().unwrap().to_string());
    args.extend(finetune_args(&m, &o, &d, "2"));
    let start = Instant::now();
    let r = run_cli(&args, &[]);
    assert!(!r.status.success());
    let err = stderr(&r);
    assert!(err.contains("the job failed:") && err.contains("rank 0 exited with code 1"), "{err}");
    assert!(err.contains("model.safetensors: not a valid safetensors file"), "{err}");
    assert!(err.contains("stopped: rank 0 failed"), "rank 1 should say rank 0 failed: {err}");
    assert!(start.elapsed() < Duration::from_secs(20));
}
