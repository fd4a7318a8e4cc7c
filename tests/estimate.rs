//! `fsdp-app estimate` against the peak resident memory of real runs: one rank with the whole
//! graph kept, and two processes (tcp backend under `fsdp-app launch`) training LoRA adapters
//! with activation checkpointing. Within 20% per rank, on the 27M model the estimate's constants
//! were fitted on and on two shapes they never saw (wide-and-shallow, narrow-and-deep).

mod common;

use std::path::Path;

use common::*;

/// A Llama of about 27M parameters with a large vocabulary, so that weights, optimizer state,
/// activations and logits all weigh in: the shape the estimate's constants were fitted on.
const MID: &[(&str, usize)] = &[
    ("hidden_size", 512),
    ("intermediate_size", 1536),
    ("num_hidden_layers", 6),
    ("vocab_size", 8192),
    ("num_attention_heads", 8),
    ("num_key_value_heads", 4),
    ("head_dim", 64),
];
/// Two shapes the constants never saw: wide and shallow (weights and big matmuls), narrow and
/// deep (many layers' activations).
const WIDE_SHALLOW: &[(&str, usize)] = &[
    ("hidden_size", 1024),
    ("intermediate_size", 2816),
    ("num_hidden_layers", 2),
    ("vocab_size", 4096),
    ("num_attention_heads", 16),
    ("num_key_value_heads", 4),
    ("head_dim", 64),
];
const NARROW_DEEP: &[(&str, usize)] = &[
    ("hidden_size", 256),
    ("intermediate_size", 768),
    ("num_hidden_layers", 16),
    ("vocab_size", 2048),
    ("num_attention_heads", 4),
    ("num_key_value_heads", 2),
    ("head_dim", 64),
];

fn model_of_shape(root: &Path, name: &str, shape: &[(&str, usize)]) -> std::path::PathBuf {
    let dir = root.join(name);
    let sets: Vec<String> = shape.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mut args = vec!["fixture", "--name", "llama", "--out", dir.to_str().unwrap()];
    for s in &sets {
        args.extend(["--set", s.as_str()]);
    }
    let o = run_cli(&args, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    dir
}

fn data(root: &Path) -> std::path::PathBuf {
    let p = root.join("rows.jsonl");
    let rows: Vec<String> = (0..16)
        .map(|i| {
            let ids: Vec<u32> = (0..256).map(|j| (i * 7 + j * 13) % 384).collect();
            serde_json::json!({"input_ids": ids, "labels": ids}).to_string()
        })
        .collect();
    std::fs::write(&p, rows.join("\n")).unwrap();
    p
}

fn estimate(model: &Path, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["estimate", "--model", model.to_str().unwrap(), "--json"];
    all.extend_from_slice(args);
    let o = run_cli(&all, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_str(&stdout(&o)).unwrap()
}

fn measured_per_rank(out: &Path) -> Vec<f64> {
    let last = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().last().unwrap().to_string();
    let row: serde_json::Value = serde_json::from_str(&last).unwrap();
    row["peak_rss_bytes_per_rank"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// Prints the comparison and collects a failure (all cases are reported before the test fails).
fn check_close(failures: &mut Vec<String>, what: &str, estimated: f64, measured: f64) {
    let ratio = estimated / measured;
    eprintln!(
        "{what}: estimated {:.1} MiB, measured {:.1} MiB ({:+.1}%)",
        estimated / 1048576.0,
        measured / 1048576.0,
        (ratio - 1.0) * 100.0
    );
    if !(0.8..=1.2).contains(&ratio) {
        failures.push(format!("{what}: estimate {estimated} vs measured peak {measured} (ratio {ratio:.3})"));
    }
}

#[test]
fn the_estimate_is_within_20_percent_of_measured_peaks() {
    let tmp = tempfile::tempdir().unwrap();
    let rows = data(tmp.path());
    let common = ["--data", rows.to_str().unwrap(), "--max-steps", "2", "--lr", "1e-4", "--batch-size", "2", "--seq-len", "256"];
    let mut failures = vec![];

    // One rank, full fine-tuning, every layer's graph kept: on each shape.
    for (name, shape) in [("mid", MID), ("wide-shallow", WIDE_SHALLOW), ("narrow-deep", NARROW_DEEP)] {
        let model = model_of_shape(tmp.path(), name, shape);
        let out = tmp.path().join(format!("{name}-one"));
        let mut args = vec!["finetune", "--model", model.to_str().unwrap(), "--output-dir", out.to_str().unwrap()];
        args.extend_from_slice(&common);
        let o = run_cli(&args, &[]);
        assert!(o.status.success(), "{}", stderr(&o));
        let e = estimate(&model, &["--batch-size", "2", "--seq-len", "256"]);
        check_close(&mut failures, &format!("{name}: 1 rank, full"), e["total"].as_f64().unwrap(), measured_per_rank(&out)[0]);
    }
    // Two processes, LoRA on every projection, activation checkpointing: on two shapes.
    for name in ["mid", "narrow-deep"] {
        let model = tmp.path().join(name);
        let out = tmp.path().join(format!("{name}-two"));
        let lora = ["--activation-checkpointing", "--lora-r", "8", "--lora-targets", "all-linear"];
        let port = free_port();
        let mut args = vec![
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            &port,
            "--",
            "finetune",
            "--model",
            model.to_str().unwrap(),
            "--output-dir",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(&common);
        args.extend_from_slice(&lora);
        let o = run_cli(&args, &[]);
        assert!(o.status.success(), "{}", stderr(&o));
        let mut eargs = vec!["--world-size", "2", "--batch-size", "2", "--seq-len", "256"];
        eargs.extend_from_slice(&lora);
        let e = estimate(&model, &eargs);
        let measured = measured_per_rank(&out);
        check_close(&mut failures, &format!("{name}: 2 ranks, LoRA, rank 0"), e["rank0_total"].as_f64().unwrap(), measured[0]);
        check_close(&mut failures, &format!("{name}: 2 ranks, LoRA, rank 1"), e["total"].as_f64().unwrap(), measured[1]);
        // LoRA keeps gradients and optimizer state (two moments) for the adapters only.
        let (grads, optimizer, params) =
            (e["gradients"].as_f64().unwrap(), e["optimizer"].as_f64().unwrap(), e["parameters"].as_f64().unwrap());
        assert!(optimizer == 2.0 * grads && grads * 8.0 < params, "{name}: gradients {grads}, optimizer {optimizer}, parameters {params}");
    }
    assert!(failures.is_empty(), "estimates off by more than 20%:\n{}", failures.join("\n"));
}

#[test]
fn estimate_reads_only_config_json_and_names_bad_settings() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    // No weights at all: the estimate does not need them.
    for e in std::fs::read_dir(&model).unwrap().flatten() {
        if e.path().extension().is_some_and(|x| x == "safetensors") {
            std::fs::remove_file(e.path()).unwrap();
        }
    }
    let o = run_cli(&["estimate", "--model", model.to_str().unwrap(), "--world-size", "4"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    for row in ["parameters", "gradients", "optimizer", "gathered units", "activations", "total", "rank 0 relay"] {
        assert!(stdout(&o).contains(row), "{row} missing:\n{}", stdout(&o));
    }
    let o = run_cli(&["estimate", "--model", model.to_str().unwrap(), "--lora-targets", "qkv"], &[]);
    assert!(!o.status.success() && stderr(&o).contains("matches no module"), "{}", stderr(&o));
    let o = run_cli(&["estimate", "--model", model.to_str().unwrap(), "--sharding-strategy", "HYBRID_SHARD", "--world-size", "4"], &[]);
    assert!(!o.status.success() && stderr(&o).contains("--shard-group-size"), "{}", stderr(&o));
}
