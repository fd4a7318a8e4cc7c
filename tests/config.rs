//! `finetune --config FILE.yaml`: the presets parse, the file sets flags, flags on the command
//! line win, and nothing unknown or unsupported is silently ignored.

mod common;

use common::*;

#[test]
fn every_preset_parses() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        if e.path().extension().is_some_and(|x| x == "yaml") {
            let s = fsdp_app::train::config_file::load(&e.path()).unwrap_or_else(|err| panic!("{}: {err:#}", e.path().display()));
            assert!(!s.is_empty());
            n += 1;
        }
    }
    assert!(n >= 4, "{n} presets");
}

#[test]
fn the_file_sets_flags_and_the_command_line_wins() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let cfg = tmp.path().join("run.yaml");
    std::fs::write(
        &cfg,
        format!(
            "model_name_or_path: {}\ntrain_file: {}\nfsdp_version: 2\nreshard_after_forward: false\nauto_wrap_policy: TRANSFORMER_BASED_WRAP\n\
             transformer_cls_names_to_wrap: LlamaDecoderLayer\nlearning_rate: 1.0e-3\nlr_scheduler_type: constant\nmax_steps: 3\n\
             per_device_train_batch_size: 2\nmax_seq_length: 16\nworld_size: 2\nshuffle: false\n",
            model.display(),
            reference_dir().join("train-data.jsonl").display()
        ),
    )
    .unwrap();
    let out = tmp.path().join("out");
    let o = run_cli(&["finetune", "--config", cfg.to_str().unwrap(), "--output-dir", out.to_str().unwrap(), "--lr", "5e-4"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("2 rank(s), SHARD_GRAD_OP"), "{}", stderr(&o));
    let rows: Vec<serde_json::Value> =
        std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 3, "max_steps from the file");
    assert!(rows.iter().all(|r| r["lr"] == 5e-4), "--lr on the command line wins: {rows:?}");

    // A layer class that is not the model's is an error, before any weight is read.
    let bad = tmp.path().join("bad.yaml");
    std::fs::write(&bad, std::fs::read_to_string(&cfg).unwrap().replace("LlamaDecoderLayer", "GPT2Block")).unwrap();
    let o = run_cli(&["finetune", "--config", bad.to_str().unwrap(), "--output-dir", tmp.path().join("o2").to_str().unwrap()], &[]);
    assert!(!o.status.success() && stderr(&o).contains("this model's decoder layer is LlamaDecoderLayer"), "{}", stderr(&o));

    // Unknown keys and wrong types name the file and the key.
    let typo = tmp.path().join("typo.yaml");
    std::fs::write(&typo, "learning_rat: 1e-4\n").unwrap();
    let o = run_cli(&["finetune", "--config", typo.to_str().unwrap()], &[]);
    assert!(!o.status.success() && stderr(&o).contains("typo.yaml: unknown key `learning_rat`"), "{}", stderr(&o));
    std::fs::write(&typo, "per_device_train_batch_size: [1]\n").unwrap();
    let o = run_cli(&["finetune", "--config", typo.to_str().unwrap()], &[]);
    assert!(
        !o.status.success() && stderr(&o).contains("typo.yaml: key `per_device_train_batch_size`: expected a value, found a list"),
        "{}",
        stderr(&o)
    );
    // A scalar of the wrong type is named by the flag's own type.
    std::fs::write(&typo, "per_device_train_batch_size: two\n").unwrap();
    let o = run_cli(&["finetune", "--config", typo.to_str().unwrap()], &[]);
    let err = stderr(&o);
    assert!(
        !o.status.success()
            && err.contains("typo.yaml: key `per_device_train_batch_size` (two): invalid type: string \"two\", expected usize"),
        "{err}"
    );
    // Required settings missing from both say where they can come from.
    std::fs::write(&typo, "learning_rate: 1e-4\n").unwrap();
    let o = run_cli(&["finetune", "--config", typo.to_str().unwrap()], &[]);
    assert!(!o.status.success() && stderr(&o).contains("--model is required (or `model_name_or_path` in --config)"), "{}", stderr(&o));
}

#[test]
fn the_lora_preset_trains_an_adapter_and_writes_the_merged_model() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let preset = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/lora.yaml");
    let out = tmp.path().join("out");
    let data = reference_dir().join("train-data.jsonl");
    let o = run_cli(
        &[
            "finetune",
            "--config",
            preset.to_str().unwrap(),
            "--model",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--output-dir",
            out.to_str().unwrap(),
            "--max-steps",
            "2",
            "--seq-len",
            "16",
            "--world-size",
            "2",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("lora: r=8 alpha=16 dropout=0.05"), "{}", stderr(&o));
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(cfg["target_modules"].as_array().unwrap().len(), 7);
    assert!(out.join("adapter_model.safetensors").is_file() && out.join("merged/config.json").is_file());
}

/// `finetune --args-file`: the settings the jobs API writes for its children. The file trains
/// exactly like the same flags; another flag beside it, or an unknown key in it, is refused.
#[test]
fn an_args_file_trains_like_the_flags_and_refuses_company() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let data = reference_dir().join("train-data.jsonl");
    let (m, d) = (model.to_str().unwrap(), data.to_str().unwrap());
    let by_flags = tmp.path().join("flags");
    let o = run_cli(
        &[
            "finetune",
            "--model",
            m,
            "--data",
            d,
            "--output-dir",
            by_flags.to_str().unwrap(),
            "--seq-len",
            "16",
            "--batch-size",
            "4",
            "--max-steps",
            "3",
            "--lr",
            "1e-3",
            "--no-shuffle",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));

    let mut args = fsdp_app::train::finetune::FinetuneArgs::defaults();
    let by_file = tmp.path().join("file");
    (args.model, args.data, args.output_dir) = (Some(m.into()), Some(data.clone()), Some(by_file.clone()));
    (args.seq_len, args.batch_size, args.max_steps, args.lr, args.no_shuffle) = (Some(16), 4, Some(3), 1e-3, true);
    let file = tmp.path().join("job.args.json");
    args.write_file(&file).unwrap();
    let o = run_cli(&["finetune", "--args-file", file.to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(metric_losses(&by_file), metric_losses(&by_flags));

    let o = run_cli(&["finetune", "--args-file", file.to_str().unwrap(), "--lr", "1"], &[]);
    assert!(!o.status.success() && stderr(&o).contains("give no other finetune flag"), "{}", stderr(&o));
    let text = std::fs::read_to_string(&file).unwrap().replacen('{', "{\"learning_rat\": 1,", 1);
    std::fs::write(&file, text).unwrap();
    let o = run_cli(&["finetune", "--args-file", file.to_str().unwrap()], &[]);
    assert!(!o.status.success() && stderr(&o).contains("learning_rat") && stderr(&o).contains("job.args.json"), "{}", stderr(&o));
}

/// Accelerate's own files as `accelerate config` writes them (configs/accelerate-fsdp1.yaml,
/// accelerate-fsdp2.yaml: 2 processes, bf16, activation checkpointing), with a TrainingArguments
/// file next to them: a 2-rank fine-tune whose log shows every setting honoured.
#[test]
fn accelerate_files_as_written_launch_a_two_rank_run_that_honours_them() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let data = reference_dir().join("train-data.jsonl");
    let configs = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs");
    let training = tmp.path().join("training.yaml");
    std::fs::write(&training, "learning_rate: 1.0e-3\nper_device_train_batch_size: 2\ngradient_accumulation_steps: 2\nmax_steps: 4\nwarmup_ratio: 0.5\nlogging_steps: 2\ngradient_checkpointing: true\n").unwrap();
    for (name, strategy) in [("accelerate-fsdp1.yaml", "FULL_SHARD"), ("accelerate-fsdp2.yaml", "FULL_SHARD")] {
        let out = tmp.path().join(name);
        let port = free_port();
        let accel = configs.join(name);
        let o = run_cli(
            &[
                "launch",
                "--config",
                accel.to_str().unwrap(),
                "--master-port",
                &port,
                "finetune",
                "--config",
                training.to_str().unwrap(),
                "--model",
                model.to_str().unwrap(),
                "--data",
                data.to_str().unwrap(),
                "--output-dir",
                out.to_str().unwrap(),
                "--seq-len",
                "16",
            ],
            &[],
        );
        let err = stderr(&o);
        assert!(o.status.success(), "{name}: {err}");
        let expected = format!(
            "settings: sharding_strategy {strategy} (reshard_after_forward true), activation_checkpointing true, param_dtype bf16, \
             reduce_dtype bf16, world_size 2, batch 2 per rank x 2 accumulation x 2 ranks = 8 sequences of 16 tokens, lr 1e-3 (Linear, 2 warmup of 4 steps)"
        );
        assert!(err.contains(&expected), "{name}: wanted {expected:?} in\n{err}");
        // logging_steps 2: step lines 2 and 4 only; metrics.jsonl has all four.
        assert!(err.contains("step     2 |") && err.contains("step     4 |") && !err.contains("step     1 |"), "{err}");
        assert_eq!(metric_losses(&out).len(), 4);
    }
}

/// What we cannot honour is refused before any rank starts, naming the file and the key; two
/// keys that disagree are named with their values.
#[test]
fn deepspeed_files_and_conflicting_pairs_are_refused_by_key() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let ds = tmp.path().join("ds.yaml");
    std::fs::write(
        &ds,
        "compute_environment: LOCAL_MACHINE\ndeepspeed_config:\n  zero_stage: 3\n  offload_optimizer_device: none\ndistributed_type: DEEPSPEED\n\
         mixed_precision: bf16\nnum_machines: 1\nnum_processes: 2\nuse_cpu: false\n",
    )
    .unwrap();
    let o = run_cli(&["launch", "--config", ds.to_str().unwrap(), "finetune", "--model", model.to_str().unwrap()], &[]);
    assert!(!o.status.success() && stderr(&o).contains("ds.yaml: key `deepspeed_config`"), "{}", stderr(&o));
    let both = tmp.path().join("both.yaml");
    std::fs::write(&both, "sharding_strategy: FULL_SHARD\nreshard_after_forward: false\n").unwrap();
    let o = run_cli(&["finetune", "--config", both.to_str().unwrap(), "--model", model.to_str().unwrap()], &[]);
    let err = stderr(&o);
    assert!(
        !o.status.success()
            && err.contains("both.yaml: key `sharding_strategy` (FULL_SHARD)")
            && err.contains("key `reshard_after_forward` (false)"),
        "{err}"
    );
    // Across two files.
    let accel = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/accelerate-fsdp2.yaml");
    let other = tmp.path().join("train.yaml");
    std::fs::write(&other, "gradient_checkpointing: false\n").unwrap();
    let o = run_cli(
        &["finetune", "--config", accel.to_str().unwrap(), "--config", other.to_str().unwrap(), "--model", model.to_str().unwrap()],
        &[],
    );
    let err = stderr(&o);
    assert!(
        !o.status.success()
            && err.contains("key `fsdp_config.fsdp_activation_checkpointing` (true)")
            && err.contains("train.yaml: key `gradient_checkpointing` (false)"),
        "{err}"
    );
}

/// `--auto-find-batch-size` with a budget between what micro-batches of 2 and 4 need: it takes
/// 2 with twice the accumulation, and trains exactly the run asked for (same global batch, same
/// losses); a budget nothing fits is refused with both figures.
#[test]
fn auto_batch_size_fits_the_budget_and_keeps_the_loss_curve() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let m = model.to_str().unwrap();
    let data = reference_dir().join("train-data.jsonl");
    let needs = |batch: &str| -> f64 {
        let o = run_cli(&["estimate", "--model", m, "--world-size", "2", "--batch-size", batch, "--seq-len", "16", "--json"], &[]);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str::<serde_json::Value>(&stdout(&o)).unwrap()["rank0_total"].as_f64().unwrap()
    };
    let (two, four) = (needs("2"), needs("4"));
    assert!(two < four);
    let budget = format!("{}", ((two + four) / 2.0) as u64);
    let run = |name: &str, extra: &[&str]| {
        let out = tmp.path().join(name);
        let mut args = vec![
            "finetune",
            "--model",
            m,
            "--data",
            data.to_str().unwrap(),
            "--output-dir",
            out.to_str().unwrap(),
            "--world-size",
            "2",
            "--seq-len",
            "16",
            "--max-steps",
            "4",
            "--lr",
            "1e-3",
            "--no-shuffle",
        ];
        args.extend_from_slice(extra);
        let o = run_cli(&args, &[]);
        (o.status.success(), stderr(&o), out)
    };
    let (ok, err, fixed) = run("fixed", &["--batch-size", "4"]);
    assert!(ok, "{err}");
    let (ok, err, auto) = run("auto", &["--batch-size", "4", "--auto-find-batch-size", "--max-memory-per-rank", &budget]);
    assert!(ok, "{err}");
    assert!(err.contains("micro-batch 2 x 2 accumulation") && err.contains("the same 8 sequences per step"), "{err}");
    let (a, b) = (metric_losses(&fixed), metric_losses(&auto));
    assert_eq!(a.len(), 4);
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "fixed {a:?} vs auto {b:?}");
    }
    let (ok, err, _) = run("none", &["--batch-size", "4", "--auto-find-batch-size", "--max-memory-per-rank", "1MB"]);
    assert!(!ok && err.contains("even a micro-batch of 1 needs") && err.contains("over the budget of"), "{err}");
}

/// No --seq-len: 512, or the model's context when shorter (the fixture's is 256), in `finetune`
/// and `estimate` alike; a longer one is refused naming both numbers, before anything is written.
#[test]
fn seq_len_defaults_to_the_context_when_shorter_and_longer_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let m = model.to_str().unwrap();
    let data = reference_dir().join("train-data.jsonl");
    let estimate = |extra: &[&str]| {
        let mut args = vec!["estimate", "--model", m, "--world-size", "2"];
        args.extend_from_slice(extra);
        run_cli(&args, &[])
    };
    let o = estimate(&[]);
    assert!(o.status.success() && stdout(&o).contains("batch 1 x seq 256"), "{}{}", stdout(&o), stderr(&o));
    let o = estimate(&["--seq-len", "4096"]);
    assert!(!o.status.success() && stderr(&o).contains("--seq-len 4096") && stderr(&o).contains("context (256 tokens"), "{}", stderr(&o));

    let finetune = |name: &str, extra: &[&str]| {
        let out = tmp.path().join(name);
        let mut args =
            vec!["finetune", "--model", m, "--data", data.to_str().unwrap(), "--output-dir", out.to_str().unwrap(), "--max-steps", "1"];
        args.extend_from_slice(extra);
        (run_cli(&args, &[]), out)
    };
    let (o, _) = finetune("default", &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("sequences of 256 tokens"), "{}", stderr(&o));
    let (o, out) = finetune("long", &["--seq-len", "4096"]);
    let err = stderr(&o);
    assert!(!o.status.success() && err.contains("--seq-len 4096") && err.contains("context (256 tokens"), "{err}");
    assert!(!out.exists() || std::fs::read_dir(&out).unwrap().next().is_none(), "a refused run left files behind");
}

/// `--eval-steps` with no evaluation data would evaluate nothing: refused naming both flags,
/// before anything is written.
#[test]
fn eval_steps_without_eval_data_is_refused_naming_both_flags() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let data = reference_dir().join("train-data.jsonl");
    let out = tmp.path().join("out");
    let args = [
        "finetune",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
        "--eval-steps",
        "2",
    ];
    let o = run_cli(&args, &[]);
    let err = stderr(&o);
    assert!(!o.status.success() && err.contains("--eval-steps 2") && err.contains("--eval-data") && err.contains("--eval-split"), "{err}");
    assert!(!out.exists(), "a refused run left files behind");
    // With eval data it runs.
    let o = run_cli(&[&args[..], &["--eval-split", "0.25", "--max-steps", "2", "--seq-len", "16"]].concat(), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
}
