//! DPO: preference rows read as TRL reads them, and preference tuning against an independent
//! PyTorch DPO loop.

mod common;

use std::path::Path;

use fsdp_app::fsdp::plan::ShardingStrategy;
use fsdp_app::tokenize::TextTokenizer;
use fsdp_app::train::data::{Sample, TextTools, IGNORE_INDEX};
use fsdp_app::train::dpo::{DpoLossKind, DpoSettings};
use fsdp_app::train::finetune::{run_local, FinetuneConfig};
use fsdp_app::train::preference::load_preference_dataset;

/// (prompt, completion) of a pair sample: the prompt's positions carry no label.
fn split(s: &Sample) -> (Vec<u32>, Vec<u32>) {
    let prompt = s.labels[..s.len].iter().take_while(|&&l| l == IGNORE_INDEX).count();
    (s.input_ids[..prompt].to_vec(), s.input_ids[prompt..s.len].to_vec())
}

/// Every shape of preference row is tokenised to TRL's ids (tests/reference/make_dpo_reference.py
/// ran TRL 1.16's DPOTrainer on the same rows with the same tokenizer and chat template).
#[test]
fn preference_rows_tokenise_as_trl_does() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("llama", tmp.path());
    let read = |name: &str| std::fs::read(model.join(name)).ok();
    let tokenizer = TextTokenizer::from_bytes(&read("tokenizer.json").unwrap(), read("tokenizer_config.json").as_deref(), None).unwrap();
    let cfg = models::ModelConfig::from_json_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let encode = |text: &str, special: bool| tokenizer.encode_with_offsets(text, special);
    let decode = |ids: &[u32]| tokenizer.decode(ids, false);
    let eos = cfg.eos_token_ids.first().copied();
    let tools =
        TextTools { encode: &encode, decode: &decode, template: tokenizer.chat_template.as_ref(), eos_id: eos, pad_id: eos.unwrap() };
    let rows = common::reference_dir().join("dpo-rows.jsonl");
    let data = load_preference_dataset(&rows, &std::fs::read(&rows).unwrap(), 256, false, &tools).unwrap();
    let want = common::reference_json("dpo-tokens.json");
    let want = want.as_array().unwrap();
    assert_eq!(data.samples.len(), 2 * want.len());
    for (i, w) in want.iter().enumerate() {
        let (prompt, chosen) = split(&data.samples[2 * i]);
        let (prompt_r, rejected) = split(&data.samples[2 * i + 1]);
        let line = i + 1;
        assert_eq!(prompt, common::json_ids(&w["prompt_ids"]), "dpo-rows.jsonl:{line}: prompt");
        assert_eq!(prompt_r, prompt, "dpo-rows.jsonl:{line}: the rejected sample's prompt");
        assert_eq!(chosen, common::json_ids(&w["chosen_ids"]), "dpo-rows.jsonl:{line}: chosen");
        assert_eq!(rejected, common::json_ids(&w["rejected_ids"]), "dpo-rows.jsonl:{line}: rejected");
    }
}

/// Bad rows are named by file, line and field.
#[test]
fn bad_preference_rows_name_file_line_and_field() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("llama", tmp.path());
    let read = |name: &str| std::fs::read(model.join(name)).ok();
    let tokenizer = TextTokenizer::from_bytes(&read("tokenizer.json").unwrap(), read("tokenizer_config.json").as_deref(), None).unwrap();
    let encode = |text: &str, special: bool| tokenizer.encode_with_offsets(text, special);
    let decode = |ids: &[u32]| tokenizer.decode(ids, false);
    let tools = TextTools { encode: &encode, decode: &decode, template: tokenizer.chat_template.as_ref(), eos_id: Some(2), pad_id: 2 };
    let path = Path::new("pairs.jsonl");
    let body = b"{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\"}\n{\"prompt\": \"a\", \"chosen\": \"b\"}\n";
    let err = format!("{:#}", load_preference_dataset(path, body, 64, false, &tools).unwrap_err());
    assert!(err.contains("pairs.jsonl:2") && err.contains("needs one of"), "{err}");
    let skipped = load_preference_dataset(path, body, 64, true, &tools).unwrap();
    assert_eq!((skipped.rows, skipped.skipped, skipped.samples.len()), (2, 1, 2));
}

/// The DPO run of make_dpo_training_reference.py: its shared settings (8 steps of 4 pairs, seq
/// 16, lr 1e-3, ...) with `kind` and beta 0.1.
fn dpo_config(model: &Path, out: &Path, kind: DpoLossKind) -> FinetuneConfig {
    FinetuneConfig {
        data: common::reference_dir().join("dpo-train-pairs.jsonl"),
        max_steps: Some(8),
        dpo: Some(DpoSettings { beta: 0.1, loss: kind }),
        ..common::reference_training_config(model, out)
    }
}

/// The metrics.jsonl step rows' `key` values.
fn metric(dir: &Path, key: &str) -> Vec<f64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r.get("eval_loss").is_none())
        .map(|r| r[key].as_f64().unwrap_or_else(|| panic!("no {key} in {r}")))
        .collect()
}

/// Losses, gradient norms and TRL's statistics of a run against the reference's `name` run:
/// losses and norms within 1e-4 relative, statistics (rewards near 0) within 1e-4 absolute.
fn check_against_reference(run: &fsdp_app::train::finetune::RunSummary, name: &str, what: &str) {
    let reference = common::reference_json("dpo-llama.json");
    let want = |k: &str| -> Vec<f64> { reference[name][k].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect() };
    let rel = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1e-12)).fold(0.0, f64::max);
    assert_eq!(run.losses.len(), 8, "{what}");
    let d = rel(&run.losses, &want("loss"));
    assert!(d < 1e-4, "{what}: losses differ from PyTorch's by {d} relative\n{:?}\n{:?}", run.losses, want("loss"));
    let d = rel(&run.grad_norms, &want("grad_norm"));
    assert!(d < 1e-4, "{what}: gradient norms differ by {d} relative\n{:?}\n{:?}", run.grad_norms, want("grad_norm"));
    for key in ["rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"] {
        let ours = metric(&run.output_dir, key);
        let theirs = want(key);
        let d = ours.iter().zip(&theirs).map(|(a, b)| (a - b).abs() / b.abs().max(1.0)).fold(0.0, f64::max);
        assert!(d < 1e-4, "{what}: {key} differs by {d}\n{ours:?}\n{theirs:?}");
    }
}

/// Full-parameter DPO follows the independent PyTorch loop (a frozen copy as the reference) at
/// worlds 1 and 2, with and without activation checkpointing; the first step loses log 2.
#[test]
fn full_dpo_matches_pytorch_at_worlds_1_and_2() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("llama", tmp.path());
    for (world, ac) in [(1usize, false), (2, false), (2, true)] {
        let mut c = dpo_config(&model, &tmp.path().join(format!("sigmoid-{world}-{ac}")), DpoLossKind::Sigmoid);
        c.world_size = world;
        c.batch_size = 4 / world;
        c.activation_checkpointing = ac;
        let run = run_local(&c).unwrap();
        assert!((run.losses[0] - std::f64::consts::LN_2).abs() < 1e-6, "step 1's loss {} is not log 2", run.losses[0]);
        check_against_reference(&run, "sigmoid", &format!("world {world}, activation checkpointing {ac}"));
    }
}

/// TRL's other two losses, IPO (log-probabilities averaged over tokens) and hinge.
#[test]
fn ipo_and_hinge_match_pytorch() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("llama", tmp.path());
    for (kind, name) in [(DpoLossKind::Ipo, "ipo"), (DpoLossKind::Hinge, "hinge")] {
        let run = run_local(&dpo_config(&model, &tmp.path().join(name), kind)).unwrap();
        check_against_reference(&run, name, name);
    }
}

/// LoRA DPO: the reference is the base with the adapters switched off (PEFT's
/// `disable_adapter()`), here with a starting adapter whose lora_B is not zero, so the policy
/// starts away from the reference.
#[test]
fn lora_dpo_matches_peft_with_adapters_off_as_the_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("llama", tmp.path());
    for world in [1usize, 2] {
        let mut c = dpo_config(&model, &tmp.path().join(format!("lora-{world}")), DpoLossKind::Sigmoid);
        c.adapter = Some(common::reference_dir().join("lora-llama"));
        c.world_size = world;
        c.batch_size = 4 / world;
        let run = run_local(&c).unwrap();
        assert!((run.losses[0] - std::f64::consts::LN_2).abs() > 1e-3, "the starting adapter moves the policy off the reference");
        check_against_reference(&run, "lora_sigmoid", &format!("LoRA, world {world}"));
    }
}

/// A DPO run resumed from its checkpoint (on another world size, with an eval split) continues
/// as if never stopped: the reference log-probabilities come back from the checkpoint (they
/// cannot be recomputed from trained weights).
#[test]
fn resuming_a_dpo_run_continues_it_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("llama", tmp.path());
    let mut straight = dpo_config(&model, &tmp.path().join("straight"), DpoLossKind::Sigmoid);
    (straight.max_steps, straight.save_steps, straight.eval_split) = (Some(6), Some(3), Some(0.125));
    let first = run_local(&straight).unwrap();
    let checkpoint = tmp.path().join("straight").join("checkpoint-3");
    assert!(checkpoint.join("dpo_reference_logps.json").is_file());
    let resumed = FinetuneConfig {
        world_size: 2,
        batch_size: 2,
        output_dir: tmp.path().join("resumed"),
        resume_from: Some(checkpoint.to_string_lossy().to_string()),
        ..straight.clone()
    };
    let second = run_local(&resumed).unwrap();
    let d = second.losses.iter().zip(&first.losses[3..]).map(|(a, b)| (a - b).abs() / b.abs()).fold(0.0, f64::max);
    assert!(d < 1e-5, "resumed losses {:?} vs {:?}", second.losses, &first.losses[3..]);
    let evals = |dir: &Path| -> Vec<f64> {
        let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        text.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["eval_rewards/margins"].as_f64()).collect()
    };
    let (a, b) = (evals(&tmp.path().join("straight")), evals(&tmp.path().join("resumed")));
    assert!(!a.is_empty() && (a.last().unwrap() - b.last().unwrap()).abs() < 1e-6, "eval margins {a:?} vs {b:?}");

    // A checkpoint without the reference (an SFT run's) is refused by name.
    std::fs::remove_file(checkpoint.join("dpo_reference_logps.json")).unwrap();
    let again = FinetuneConfig { output_dir: tmp.path().join("again"), ..resumed };
    let err = format!("{:#}", run_local(&again).unwrap_err());
    assert!(err.contains("dpo_reference_logps.json"), "{err}");
}

/// Flags that do not fit DPO are refused by name, before anything loads.
#[test]
fn dpo_refuses_what_it_cannot_honour() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("llama", tmp.path());
    let run = |extra: &[&str]| {
        let out = tmp.path().join("out");
        let pairs = common::reference_dir().join("dpo-train-pairs.jsonl");
        let mut args =
            vec!["finetune", "--model", model.to_str().unwrap(), "--data", pairs.to_str().unwrap(), "--output-dir", out.to_str().unwrap()];
        args.extend_from_slice(extra);
        let o = common::run_cli(&args, &[]);
        assert!(!o.status.success(), "{extra:?} was accepted");
        common::stderr(&o)
    };
    assert!(run(&["--method", "dpo", "--packing"]).contains("--packing cannot be used with --method dpo"));
    assert!(run(&["--method", "dpo", "--dpo-loss", "kto"]).contains("sigmoid, hinge or ipo"));
    assert!(run(&["--method", "dpo", "--dpo-beta", "0"]).contains("--dpo-beta must be a positive number"));
    assert!(run(&["--dpo-beta", "0.2"]).contains("apply to --method dpo"));
    assert!(run(&["--method", "ppo"]).contains("use sft, dpo or grpo"));
    // Preference rows under SFT say what to do.
    assert!(run(&["--max-steps", "1"]).contains("--method dpo"));
}

/// A YAML file with TRL's DPOConfig names (`beta`, `loss_type`) and Axolotl's `rl: dpo`: IPO's
/// first step, where policy = reference, loses (1 / (2 beta))^2 = 6.25 at beta 0.2.
#[test]
fn dpo_settings_come_from_trl_and_axolotl_key_names() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("llama", tmp.path());
    let yaml = tmp.path().join("dpo.yaml");
    std::fs::write(&yaml, "rl: dpo\nbeta: 0.2\nloss_type: ipo\nper_device_train_batch_size: 2\nmax_steps: 1\nmax_length: 16\n").unwrap();
    let out = tmp.path().join("out");
    let pairs = common::reference_dir().join("dpo-train-pairs.jsonl");
    let o = common::run_cli(
        &[
            "finetune",
            "--config",
            yaml.to_str().unwrap(),
            "--model",
            model.to_str().unwrap(),
            "--data",
            pairs.to_str().unwrap(),
            "--output-dir",
            out.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", common::stderr(&o));
    // The log's settings line says what the run took from the file.
    assert!(common::stderr(&o).contains("method dpo (beta 0.2, loss ipo, 2 pairs per step)"), "{}", common::stderr(&o));
    let loss = common::metric_losses(&out)[0];
    assert!((loss - 6.25).abs() < 1e-4, "step 1's IPO loss at beta 0.2 is {loss}");
}

/// Gradient accumulation, SHARD_GRAD_OP and `--auto-find-batch-size` (in pairs: a budget
/// between what 2 and 4 pairs need per rank) train the same DPO run as the plain one.
#[test]
fn accumulation_strategies_and_auto_batch_keep_the_dpo_run() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("llama", tmp.path());
    let plain = run_local(&dpo_config(&model, &tmp.path().join("plain"), DpoLossKind::Sigmoid)).unwrap();
    let needs = |rows: &str| -> f64 {
        let m = model.to_str().unwrap();
        let o = common::run_cli(&["estimate", "--model", m, "--world-size", "2", "--batch-size", rows, "--seq-len", "16", "--json"], &[]);
        serde_json::from_str::<serde_json::Value>(&common::stdout(&o)).unwrap()["rank0_total"].as_f64().unwrap()
    };
    // Rows: 2 pairs are 4 rows, 1 pair 2.
    let budget = ((needs("2") + needs("4")) / 2.0) as usize;
    type Change = Box<dyn Fn(&mut FinetuneConfig)>;
    let variants: [(&str, Change); 3] = [
        ("accumulation", Box::new(|c| (c.world_size, c.batch_size, c.grad_accum) = (2, 1, 2))),
        ("shard-grad-op", Box::new(|c| (c.world_size, c.batch_size, c.strategy) = (2, 2, ShardingStrategy::ShardGradOp))),
        (
            "auto-batch",
            Box::new(move |c| (c.world_size, c.batch_size, c.auto_find_batch_size, c.max_memory_per_rank) = (2, 2, true, Some(budget))),
        ),
    ];
    for (name, change) in variants {
        let mut c = dpo_config(&model, &tmp.path().join(name), DpoLossKind::Sigmoid);
        change(&mut c);
        let run = run_local(&c).unwrap();
        let d = run.losses.iter().zip(&plain.losses).map(|(a, b)| (a - b).abs() / b.abs()).fold(0.0, f64::max);
        assert!(d < 1e-5, "{name}: {:?} vs {:?}", run.losses, plain.losses);
    }
}
