//! Checkpoints that survive: resume is bit-identical on the same world size and re-cut for
//! another one; kills during a save, corrupt or missing files and failing ranks never lead to a
//! partial checkpoint being loaded; exports and merges give back the trained weights.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use common::*;

struct Run {
    model: PathBuf,
    data: PathBuf,
}

impl Run {
    fn new(root: &Path) -> Self {
        Run { model: fixture("llama", root), data: reference_dir().join("train-data.jsonl") }
    }

    /// `finetune` with a global batch of 12 on `world` local ranks.
    fn args(&self, out: &Path, world: usize, extra: &[&str]) -> Vec<String> {
        let mut a: Vec<String> = [
            "finetune",
            "--model",
            self.model.to_str().unwrap(),
            "--data",
            self.data.to_str().unwrap(),
            "--output-dir",
            out.to_str().unwrap(),
            "--seq-len",
            "16",
            "--lr",
            "1e-3",
            "--warmup-steps",
            "2",
            "--lr-scheduler",
            "cosine",
            "--seed",
            "7",
            "--weight-decay",
            "0.1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(["--world-size".into(), world.to_string(), "--batch-size".into(), (12 / world).to_string()]);
        if !extra.contains(&"--max-steps") {
            a.extend(["--max-steps".into(), "8".into()]);
        }
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    }

    fn run(&self, out: &Path, world: usize, extra: &[&str]) -> std::process::Output {
        let args = self.args(out, world, extra);
        run_cli(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[])
    }
}

fn ok(o: std::process::Output) -> std::process::Output {
    assert!(o.status.success(), "{}", stderr(&o));
    o
}

fn failed(o: std::process::Output, needles: &[&str]) -> String {
    assert!(!o.status.success(), "expected failure: {}", stderr(&o));
    let e = stderr(&o);
    for n in needles {
        assert!(e.contains(n), "{n:?} not in:\n{e}");
    }
    e
}

fn weights(dir: &Path) -> HashMap<String, Tensor> {
    let mut all = HashMap::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.path().extension().is_some_and(|x| x == "safetensors") {
            all.extend(candle_core::safetensors::load(e.path(), &Device::Cpu).unwrap());
        }
    }
    all
}

fn max_diff(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().map(|(k, t)| (t - &b[k]).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()).fold(0.0, f32::max)
}

#[test]
fn resume_on_the_same_world_size_is_bit_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let r = Run::new(tmp.path());
    let full = tmp.path().join("full");
    ok(r.run(&full, 2, &["--save-steps", "4"]));
    let resumed = tmp.path().join("resumed");
    let ckpt = full.join("checkpoint-4");
    ok(r.run(&resumed, 2, &["--resume-from-checkpoint", ckpt.to_str().unwrap()]));
    let (a, b) = (metric_losses(&full), metric_losses(&resumed));
    assert_eq!(a.len(), 8);
    assert_eq!(b, a[4..].to_vec(), "losses after resuming must be bit-identical");
    // Final weights: byte for byte.
    assert_eq!(std::fs::read(full.join("model.safetensors")).unwrap(), std::fs::read(resumed.join("model.safetensors")).unwrap());
}

#[test]
fn resume_on_another_world_size_recuts_the_chunks() {
    let tmp = tempfile::tempdir().unwrap();
    let r = Run::new(tmp.path());
    for (from, to) in [(4usize, 2usize), (2, 3), (1, 4)] {
        let full = tmp.path().join(format!("full{from}"));
        ok(r.run(&full, from, &["--save-steps", "4"]));
        let resumed = tmp.path().join(format!("resumed{from}to{to}"));
        let ckpt = full.join("checkpoint-4");
        ok(r.run(&resumed, to, &["--resume-from-checkpoint", ckpt.to_str().unwrap()]));
        let (a, b) = (metric_losses(&full), metric_losses(&resumed));
        assert_eq!(b.len(), 4);
        for (x, y) in a[4..].iter().zip(&b) {
            assert!((x - y).abs() / x.abs() < 1e-6, "{from} -> {to}: {:?} vs {b:?}", &a[4..]);
        }
        // The data cursor carried over: step 5 starts the second epoch (48 rows / 12 per step).
        let state: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ckpt.join("trainer_state.json")).unwrap()).unwrap();
        assert_eq!((state["samples_seen"].as_u64(), state["epoch"].as_u64()), (Some(48), Some(1)));
        assert!(max_diff(&weights(&full), &weights(&resumed)) < 1e-5);
    }
}

#[test]
fn checkpoints_of_another_model_or_batch_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let r = Run::new(tmp.path());
    let full = tmp.path().join("full");
    ok(r.run(&full, 1, &["--save-steps", "4", "--max-steps", "4"]));
    let ckpt = full.join("checkpoint-4");
    let other = Run { model: fixture("qwen3", &tmp.path().join("q")), data: r.data.clone() };
    failed(
        other.run(&tmp.path().join("x"), 1, &["--resume-from-checkpoint", ckpt.to_str().unwrap()]),
        &["saved from another model or config", "architectures", "head_dim: checkpoint 16 vs model 32"],
    );
    failed(
        r.run(&tmp.path().join("y"), 1, &["--resume-from-checkpoint", ckpt.to_str().unwrap(), "--grad-accum", "2"]),
        &["global batch of 12", "this run has 24"],
    );
}

/// A checkpoint remembers its tokenizer, its training file (size + SHA-256) and the data cursor:
/// resuming with another file, another tokenizer or a cut of the data that moves the cursor is
/// refused by name; `--resume-allow-changed` lets a deliberate change through, saying so.
#[test]
fn resuming_with_other_data_or_tokenizer_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let r = Run::new(tmp.path());
    let full = tmp.path().join("full");
    ok(r.run(&full, 1, &["--save-steps", "4", "--max-steps", "4"]));
    let ckpt = full.join("checkpoint-4");
    let ckpt_s = ckpt.to_str().unwrap();
    let state: serde_json::Value = serde_json::from_slice(&std::fs::read(ckpt.join("trainer_state.json")).unwrap()).unwrap();
    let bytes = std::fs::read(&r.data).unwrap();
    assert_eq!(state["data"]["bytes"].as_u64(), Some(bytes.len() as u64), "{state}");
    assert_eq!(state["data"]["cursor"], serde_json::json!({"epoch": 1, "batch_in_epoch": 0}), "{state}");

    // The same file, unchanged: resumes (and the same steps go on).
    ok(r.run(&tmp.path().join("same"), 1, &["--resume-from-checkpoint", ckpt_s, "--max-steps", "6"]));

    // One token of one row changed: same size, other hash.
    let edited = tmp.path().join("edited.jsonl");
    let text = String::from_utf8(bytes).unwrap().replacen("[3, 10, 17", "[4, 10, 17", 1);
    std::fs::write(&edited, text).unwrap();
    let other_data = Run { model: r.model.clone(), data: edited };
    let resume = ["--resume-from-checkpoint", ckpt_s, "--max-steps", "6"];
    failed(
        other_data.run(&tmp.path().join("d1"), 1, &resume),
        &["was trained on other data", "edited.jsonl", "--resume-allow-changed data"],
    );
    let o = ok(other_data.run(&tmp.path().join("d2"), 1, &[&resume[..], &["--resume-allow-changed", "data"]].concat()));
    assert!(stderr(&o).contains("resuming anyway"), "{}", stderr(&o));

    // Another tokenizer.json next to the same config and weights.
    let model2 = tmp.path().join("model2");
    std::fs::create_dir_all(&model2).unwrap();
    for e in std::fs::read_dir(&r.model).unwrap().flatten() {
        std::fs::copy(e.path(), model2.join(e.file_name())).unwrap();
    }
    let tok = std::fs::read_to_string(model2.join("tokenizer.json")).unwrap();
    std::fs::write(model2.join("tokenizer.json"), format!("{tok}\n")).unwrap();
    let other_tok = Run { model: model2, data: r.data.clone() };
    failed(other_tok.run(&tmp.path().join("t1"), 1, &resume), &["another tokenizer", "--resume-allow-changed tokenizer"]);
    ok(other_tok.run(&tmp.path().join("t2"), 1, &[&resume[..], &["--resume-allow-changed", "tokenizer"]].concat()));

    // The same file cut otherwise (a quarter held out): 3 steps an epoch instead of 4, so step 4
    // would be batch 1 of epoch 1 instead of batch 0.
    failed(
        r.run(&tmp.path().join("c1"), 1, &[&resume[..], &["--eval-split", "0.25"]].concat()),
        &["data cursor", "epoch 1, batch 0", "epoch 1, batch 1"],
    );
}

#[test]
fn corrupt_or_missing_files_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let r = Run::new(tmp.path());
    let full = tmp.path().join("full");
    ok(r.run(&full, 2, &["--save-steps", "4", "--max-steps", "4"]));
    let ckpt = full.join("checkpoint-4");
    let shard = ckpt.join("shard-00001-of-00002.safetensors");
    let original = std::fs::read(&shard).unwrap();
    let mut flipped = original.clone();
    let n = flipped.len();
    flipped[n - 10] ^= 0xFF;
    std::fs::write(&shard, &flipped).unwrap();
    let e = failed(
        r.run(&tmp.path().join("a"), 2, &["--resume-from-checkpoint", ckpt.to_str().unwrap()]),
        &["shard-00001-of-00002.safetensors", "SHA-256 mismatch"],
    );
    assert!(!e.contains("panicked"));
    std::fs::remove_file(&shard).unwrap();
    failed(
        r.run(&tmp.path().join("b"), 2, &["--resume-from-checkpoint", ckpt.to_str().unwrap()]),
        &["not a complete checkpoint", "shard-00001-of-00002.safetensors is missing"],
    );
    // `latest` skips it (saying why) and, with nothing else there, says so.
    failed(r.run(&full, 2, &["--resume-from-checkpoint", "latest"]), &["skipping", "no complete checkpoint under"]);
    // merge names what is missing too.
    let m = run_cli(&["merge", ckpt.to_str().unwrap(), tmp.path().join("m").to_str().unwrap()], &[]);
    failed(m, &["shard-00001-of-00002.safetensors is missing"]);
    std::fs::remove_file(ckpt.join("manifest.json")).unwrap();
    let m = run_cli(&["merge", ckpt.to_str().unwrap(), tmp.path().join("m").to_str().unwrap()], &[]);
    failed(m, &["not a complete checkpoint: manifest.json is missing"]);
}

#[test]
fn a_save_that_fails_on_one_rank_fails_on_all_and_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let r = Run::new(tmp.path());
    let out = tmp.path().join("out");
    let args = r.args(&out, 2, &["--save-steps", "2"]);
    let o = run_cli(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[("FSDP_FAULT_SAVE_FAIL_RANK", "1")]);
    failed(o, &["checkpoint 2 not saved: writing failed on rank(s) [1]"]);
    let left: Vec<String> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect();
    assert!(left.iter().all(|n| !n.contains("checkpoint")), "{left:?}");
}

fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect()
}

#[test]
fn killed_while_saving_then_resume_latest_takes_the_last_complete_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let r = Run::new(tmp.path());
    for kill_all in [true, false] {
        let out = tmp.path().join(format!("out-{kill_all}"));
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
        let mut args = vec!["launch".to_string(), "--nproc-per-node".into(), "2".into(), "--master-port".into(), port, "--".into()];
        args.extend(r.args(&out, 2, &["--save-steps", "2"]).into_iter().filter(|a| a != "--world-size"));
        // Drop the "2" that followed --world-size.
        let pos = args.iter().position(|a| a == "--batch-size").unwrap();
        args.remove(pos - 1);
        let mut launcher =
            Command::new(bin()).args(&args).env("FSDP_FAULT_PAUSE_IN_SAVE_MS", "3000").stderr(Stdio::piped()).spawn().unwrap();
        // checkpoint-2 completes after its pause; kill while checkpoint-4 is being saved.
        let start = Instant::now();
        while !(out.join("checkpoint-2").join("manifest.json").exists() && out.join(".checkpoint-4.tmp").exists()) {
            assert!(start.elapsed() < Duration::from_secs(60), "saves never happened");
            std::thread::sleep(Duration::from_millis(20));
        }
        let kids = children_of(launcher.id());
        let victims: Vec<u32> = if kill_all { kids.clone() } else { vec![kids[1]] };
        for v in victims {
            Command::new("kill").args(["-9", &v.to_string()]).status().unwrap();
        }
        if kill_all {
            let _ = launcher.kill();
        }
        let status = launcher.wait().unwrap();
        assert!(!status.success());
        assert!(!out.join("checkpoint-4").exists(), "a checkpoint without its manifest must not appear");
        // Resume from `latest`: checkpoint-2, never the partial one.
        let o = ok(r.run(&out, 2, &["--resume-from-checkpoint", "latest"]));
        assert!(stderr(&o).contains("resumed from") && stderr(&o).contains("checkpoint-2 at step 2"), "{}", stderr(&o));
        assert!(out.join("checkpoint-8").join("manifest.json").exists() || out.join("model.safetensors").exists());
    }
}

#[test]
fn exports_and_merges_give_the_trained_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let r = Run::new(tmp.path());
    let out = tmp.path().join("out");
    ok(r.run(&out, 2, &["--save-steps", "8", "--save-full-every", "4", "--max-shard-size", "100KB", "--save-total-limit", "1"]));
    // Small shards: several files and an index, loadable as a model.
    assert!(out.join("model.safetensors.index.json").exists());
    assert!(out.join("export-4").join("config.json").exists());
    let dirs: Vec<String> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect();
    assert_eq!(dirs.iter().filter(|d| d.starts_with("checkpoint-")).count(), 1, "{dirs:?}");
    let merged = tmp.path().join("merged");
    let m = ok(run_cli(&["merge", out.join("checkpoint-8").to_str().unwrap(), merged.to_str().unwrap()], &[]));
    assert!(stderr(&m).contains("peak RSS"));
    assert_eq!(max_diff(&weights(&out), &weights(&merged)), 0.0, "export and merge hold the same trained weights");
    // The export loads and gives the same logits as the merged checkpoint.
    let ids = Tensor::new(&[[1u32, 5, 9, 200, 17]], &Device::Cpu).unwrap();
    let logits = |d: &Path| {
        let m = fsdp_app::model_files::load_model(
            fsdp_app::model_files::resolve_model(d.to_str().unwrap(), None).unwrap(),
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        m.model.forward(&ids).unwrap()
    };
    let d = (logits(&out) - logits(&merged)).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(d, 0.0);
    // bf16 merge.
    let m16 = tmp.path().join("merged16");
    ok(run_cli(&["merge", out.join("checkpoint-8").to_str().unwrap(), m16.to_str().unwrap(), "--dtype", "bf16"], &[]));
    assert!(weights(&m16).values().all(|t| t.dtype() == DType::BF16));
    // Its config says so, or transformers would load the tensors upcast to the old dtype.
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(m16.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16", "{config}");
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(merged.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "float32", "{config}");
}

/// The steps of a run's metrics.jsonl rows, in file order (evaluation rows included).
fn metric_steps(dir: &Path) -> Vec<u64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect()
}

/// Ctrl-C while checkpoint-4 is being saved: the run exits 130 naming checkpoint-2 and the flag
/// that resumes from it; resuming from `latest` leaves one metrics.jsonl row per step (the rows
/// of steps 3 and 4, written before the interrupt, are replaced by the resumed run's) and the
/// losses of a run that was never interrupted.
#[test]
fn interrupted_run_says_where_to_resume_and_the_resumed_log_has_each_step_once() {
    let tmp = tempfile::tempdir().unwrap();
    let r = Run::new(tmp.path());
    let full = tmp.path().join("full");
    ok(r.run(&full, 2, &["--save-steps", "2"]));
    let out = tmp.path().join("out");
    let run = Command::new(bin())
        .args(r.args(&out, 2, &["--save-steps", "2"]))
        .env("FSDP_FAULT_PAUSE_IN_SAVE_MS", "3000")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !(out.join("checkpoint-2").join("manifest.json").exists() && out.join(".checkpoint-4.tmp").exists()) {
        assert!(start.elapsed() < Duration::from_secs(60), "the saves never happened");
        std::thread::sleep(Duration::from_millis(20));
    }
    Command::new("kill").args(["-INT", &run.id().to_string()]).status().unwrap();
    let o = run.wait_with_output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(130), "{err}");
    let checkpoint = out.join("checkpoint-2");
    assert!(err.contains("SIGINT") && err.contains(&format!("--resume-from-checkpoint {}", checkpoint.display())), "{err}");
    assert_eq!(metric_steps(&out), vec![1, 2, 3, 4], "the interrupted run logged steps 3 and 4 after its checkpoint");
    ok(r.run(&out, 2, &["--resume-from-checkpoint", "latest"]));
    assert_eq!(metric_steps(&out), (1..=8).collect::<Vec<_>>());
    assert_eq!(metric_losses(&out), metric_losses(&full), "the resumed run continues the uninterrupted one");
}
