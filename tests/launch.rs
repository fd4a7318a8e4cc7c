//! Multi-process runs: `fsdp-app launch` starts real processes that join over TCP; they must
//! train exactly like the threads of the local backend, and when one dies or fails the job must
//! end, non-zero, naming the rank, within a bounded time.

mod common;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn finetune_args<'a>(model: &'a str, out: &'a str, data: &'a str, steps: &'a str) -> Vec<&'a str> {
    finetune_args_batch(model, out, data, steps, "2")
}

fn finetune_args_batch<'a>(model: &'a str, out: &'a str, data: &'a str, steps: &'a str, batch: &'a str) -> Vec<&'a str> {
    vec![
        "finetune",
        "--model",
        model,
        "--data",
        data,
        "--output-dir",
        out,
        "--seq-len",
        "16",
        "--batch-size",
        batch,
        "--max-steps",
        steps,
        "--lr",
        "1e-3",
        "--no-shuffle",
        "--collective-timeout",
        "60",
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

    // With prefetch the collectives run on a thread of their own, started a unit ahead: still
    // the same collectives in the same order on both ranks, the same losses.
    let prefetch_out = tmp.path().join("prefetch");
    let port = free_port();
    let mut args = vec!["launch", "--nproc-per-node", "2", "--master-port", &port, "--"];
    args.extend(finetune_args(m, prefetch_out.to_str().unwrap(), d, "6"));
    args.extend(["--prefetch", "on"]);
    let o = run_cli(&args, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(metric_losses(&prefetch_out), metric_losses(&local_out), "prefetch: identical losses");

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

/// Rank 0 finishes a successful run before the others have heard the last barrier's reply
/// (its proxies answer late here): it must wait for them, not exit and close their sockets.
#[test]
fn rank_0_waits_for_the_others_to_hear_the_last_barrier() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let data = reference_dir().join("train-data.jsonl");
    let out = tmp.path().join("out");
    let port = free_port();
    let mut args = vec!["launch", "--nproc-per-node", "2", "--master-port", &port, "--"];
    let (m, o, d) = (model.to_str().unwrap().to_string(), out.to_str().unwrap().to_string(), data.to_str().unwrap().to_string());
    args.extend(finetune_args(&m, &o, &d, "1"));
    let r = run_cli(&args, &[("FSDP_FAULT_SLOW_BARRIER_REPLY_MS", "1500")]);
    assert!(r.status.success(), "{}", stderr(&r));
    assert!(out.join("model.safetensors").exists() || out.join("model.safetensors.index.json").exists());
}

/// torchrun's own flags, as existing launch scripts spell them, start the same job.
#[test]
fn torchrun_flags_launch_as_torchrun_takes_them() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let data = reference_dir().join("train-data.jsonl");
    let (m, d) = (model.to_str().unwrap().to_string(), data.to_str().unwrap().to_string());
    let outs: Vec<String> =
        ["underscores", "standalone", "endpoint"].iter().map(|n| tmp.path().join(n).to_str().unwrap().to_string()).collect();
    let (port, port2) = (free_port(), free_port());
    let endpoint = format!("127.0.0.1:{port2}");
    let flag_sets: [Vec<&str>; 3] = [
        // Underscores, the command last without `--` (as torchrun takes its script).
        vec![
            "--nproc_per_node",
            "2",
            "--nnodes",
            "1",
            "--node_rank",
            "0",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            &port,
            "--max_restarts",
            "0",
        ],
        vec!["--standalone", "--nproc-per-node", "2", "--"],
        vec!["--rdzv-backend", "static", "--rdzv_endpoint", &endpoint, "--nproc_per_node", "2"],
    ];
    for (flags, out) in flag_sets.iter().zip(&outs) {
        let mut args = vec!["launch"];
        args.extend(flags.iter().copied());
        args.extend(finetune_args(&m, out, &d, "2"));
        let o = run_cli(&args, &[]);
        assert!(o.status.success(), "{flags:?}: {}", stderr(&o));
    }
    let losses = metric_losses(Path::new(&outs[0]));
    assert_eq!(losses.len(), 2);
    for out in &outs[1..] {
        assert_eq!(metric_losses(Path::new(out)), losses, "{out}");
    }
    // What torchrun does and we do not is refused before any rank starts, naming the flag.
    let refused: [(&[&str], &str); 5] = [
        (&["--nproc_per_node", "2", "--max-restarts", "3"], "--max-restarts 3"),
        (&["--nproc_per_node", "2", "--standalone", "--nnodes", "2"], "--standalone is one node"),
        (&["--nproc_per_node", "2", "--rdzv-endpoint", "nohost"], "--rdzv-endpoint nohost"),
        (&["--nproc_per_node", "2", "--nnodes", "2", "--rdzv-backend", "c10d"], "dynamic rendezvous"),
        (&["--nproc_per_node", "gpu"], "no GPU is visible"),
    ];
    for (flags, expected) in refused {
        let mut args = vec!["launch"];
        args.extend(flags.iter().copied());
        args.extend(["finetune", "--model", &m]);
        let o = run_cli(&args, &[("CUDA_VISIBLE_DEVICES", "")]);
        assert!(!o.status.success() && stderr(&o).contains(expected), "{flags:?}: {}", stderr(&o));
    }
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

/// "123.4 MiB" (crate::memory::human_bytes) back to bytes.
fn parse_bytes(s: &str) -> f64 {
    let (v, unit) = s.trim().split_once(' ').unwrap_or((s, "B"));
    let scale = match unit {
        "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1048576.0,
        "GiB" => 1073741824.0,
        other => panic!("unit {other:?}"),
    };
    v.parse::<f64>().unwrap() * scale
}

/// Each rank's peak RSS as the launcher read it from the kernel when reaping the rank (`wait4`).
fn launcher_peaks(stderr: &str) -> Vec<f64> {
    let line = stderr.lines().find(|l| l.starts_with("launch: peak RSS per rank")).unwrap_or_else(|| panic!("no peak RSS line:\n{stderr}"));
    line.split_once("): ").unwrap().1.split(", ").map(|r| parse_bytes(r.splitn(3, ' ').nth(2).unwrap())).collect()
}

/// FULL_SHARD's promise measured from outside: every rank process of a 2- and a 4-rank run holds
/// about 1/N of the fp32 weights + gradients + AdamW moments that one process holds alone, with
/// and without activation checkpointing, and stays under the bound of issue 17 (state share +
/// two units + activations + 150 MiB, plus the tcp relay on rank 0). The
/// model (26M parameters, 8 layers, small vocabulary) is built so that this state (16 bytes a
/// parameter, ~410 MiB) dwarfs what a process needs besides; its size is counted from the
/// safetensors file, not from the engine's plan.
#[test]
fn each_rank_process_holds_a_1_over_n_share_of_the_training_state() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    let o = run_cli(
        &[
            "fixture",
            "--name",
            "llama",
            "--out",
            model.to_str().unwrap(),
            "--set",
            "hidden_size=512",
            "--set",
            "intermediate_size=1408",
            "--set",
            "num_hidden_layers=8",
            "--set",
            "vocab_size=512",
            "--set",
            "num_attention_heads=8",
            "--set",
            "num_key_value_heads=8",
            "--set",
            "head_dim=64",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let params: usize = std::fs::read_dir(&model)
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .flat_map(|e| candle_core::safetensors::load(e.path(), &candle_core::Device::Cpu).unwrap().into_values())
        .map(|t| t.elem_count())
        .sum();
    let state = params as f64 * 16.0;
    let data = tmp.path().join("rows.jsonl");
    let rows: Vec<String> = (0..8)
        .map(|i| {
            let ids: Vec<u32> = (0..16).map(|j| (i * 7 + j * 13) % 500).collect();
            serde_json::json!({"input_ids": ids, "labels": ids}).to_string()
        })
        .collect();
    std::fs::write(&data, rows.join("\n")).unwrap();

    let peaks = |n: usize, ac: bool| -> Vec<f64> {
        let out = tmp.path().join(format!("out{n}-{ac}"));
        let (port, nproc, batch) = (free_port(), n.to_string(), (4 / n).to_string());
        let mut args = vec!["launch", "--nproc-per-node", &nproc, "--master-port", &port, "--"];
        args.extend(finetune_args_batch(model.to_str().unwrap(), out.to_str().unwrap(), data.to_str().unwrap(), "2", &batch));
        args.extend(["--sharding-strategy", "FULL_SHARD"]);
        if ac {
            args.push("--activation-checkpointing");
        }
        let o = run_cli(&args, &[("RAYON_NUM_THREADS", "1")]);
        assert!(o.status.success(), "{}", stderr(&o));
        let p = launcher_peaks(&stderr(&o));
        assert_eq!(p.len(), n);
        p
    };
    let mib = |b: f64| b / 1048576.0;
    let one = peaks(1, true)[0];
    assert!(one > state, "one process peaked at {:.0} MiB, below the {:.0} MiB of state it must hold", mib(one), mib(state));
    // FULL_SHARD reshards after every unit's forward with and without activation checkpointing.
    let runs: Vec<(usize, bool, Vec<f64>)> =
        [(2usize, true), (4, true), (4, false)].into_iter().map(|(n, ac)| (n, ac, peaks(n, ac))).collect();
    eprintln!("state {:.0} MiB; world 1: peak {:.0} MiB", mib(state), mib(one));
    for (n, ac, p) in &runs {
        for (r, peak) in p.iter().enumerate() {
            eprintln!(
                "world {n}, activation checkpointing {ac}, rank {r}: peak {:.0} MiB, {:.0} MiB below one process",
                mib(*peak),
                mib(one - peak)
            );
        }
    }
    // The largest unit (a decoder layer) in f32, and the bound at world 4: a rank holds
    // its state share, at most two gathered units, the activations (a few MiB at 16 tokens),
    // and the process (150 MiB). Rank 0 also relays the tcp backend's collectives: two buffers
    // of a unit per other rank at most (see src/dist/tcp.rs).
    let layer = 4.0 * (4 * 512 * 512 + 3 * 512 * 1408) as f64;
    for (n, ac, p) in &runs {
        for (r, &peak) in p.iter().enumerate() {
            let relay = if r == 0 { 2.0 * (*n as f64 - 1.0) * layer } else { 0.0 };
            let bound = state / *n as f64 + 2.0 * layer + (16 << 20) as f64 + (150 << 20) as f64 + relay;
            assert!(
                peak <= bound,
                "world {n}, activation checkpointing {ac}, rank {r}: peak RSS {:.0} MiB above the bound of {:.0} MiB (state share {:.0}, two units {:.0}, relay {:.0})",
                mib(peak),
                mib(bound),
                mib(state / *n as f64),
                mib(2.0 * layer),
                mib(relay)
            );
        }
    }
    // Rank 0 also reads the checkpoint (a tensor at a time) and relays the tcp backend's
    // collectives: it may carry up to the weights file's size more than the others.
    let file_bytes: f64 = std::fs::read_dir(&model)
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .map(|e| e.metadata().unwrap().len() as f64)
        .sum();
    for (n, _, p) in runs {
        for (r, peak) in p.into_iter().enumerate() {
            let saved = one - peak;
            let ideal = state * (1.0 - 1.0 / n as f64) - if r == 0 { file_bytes } else { 0.0 };
            assert!(
                saved > 0.85 * ideal,
                "world {n}, rank {r}: peak RSS {:.0} MiB is only {:.0} MiB below one process's {:.0} MiB; a 1/{n} share of the \
                 {:.0} MiB state would save {:.0} MiB",
                mib(peak),
                mib(saved),
                mib(one),
                mib(state),
                mib(ideal)
            );
        }
    }
}
