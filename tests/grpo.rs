//! GRPO: the loss against TRL's written out in PyTorch on teacher-forced completions
//! (tests/reference/make_grpo_reference.py), graders against the libraries they follow, and a
//! whole run that samples, grades and writes its rollouts.

mod common;

use std::path::Path;

use fsdp_app::train::finetune::{run_local, FinetuneConfig};
use fsdp_app::train::grpo::graders::{bleu, fuzzy_match, rouge};
use fsdp_app::train::grpo::{GivenRollouts, GrpoConfig, GrpoLossType, GrpoSettings};
use serde_json::Value;

/// The rows the reference trained on, and its fixed completions and rewards.
fn given_rollouts() -> GivenRollouts {
    let text = std::fs::read_to_string(common::reference_dir().join("grpo-rows.jsonl")).unwrap();
    let rows: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    GivenRollouts {
        completions: rows.iter().map(|r| serde_json::from_value(r["completions"].clone()).unwrap()).collect(),
        rewards: rows.iter().map(|r| serde_json::from_value(r["rewards"].clone()).unwrap()).collect(),
    }
}

/// A run of the reference's settings (see the script's docstring) for `name`.
fn reference_run(
    model: &Path,
    out: &Path,
    (loss_type, beta, mu, eps, eps_high): (GrpoLossType, f64, usize, f64, f64),
    world: usize,
) -> FinetuneConfig {
    let settings = GrpoSettings {
        num_generations: 4,
        max_completion_length: 6,
        temperature: 0.7,
        epsilon: eps,
        epsilon_high: eps_high,
        num_iterations: mu,
        beta,
        loss_type,
        log_completions_steps: 0,
        ..GrpoSettings::default()
    };
    FinetuneConfig {
        data: common::reference_dir().join("grpo-rows.jsonl"),
        max_steps: Some(4 * mu),
        batch_size: 2 / world,
        world_size: world,
        grpo: Some(GrpoConfig { settings, grader: None, given: Some(given_rollouts()) }),
        ..common::reference_training_config(model, out)
    }
}

fn metric(dir: &Path, key: &str) -> Vec<f64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|r| r.get(key).and_then(Value::as_f64).unwrap_or(0.0))
        .collect()
}

/// Loss and gradient norm within 1e-4 (relative, absolute below 1), TRL's statistics within 1e-4.
fn check(run: &fsdp_app::train::finetune::RunSummary, name: &str, what: &str) {
    let reference = common::reference_json("grpo-llama.json");
    let want = |k: &str| -> Vec<f64> { reference[name][k].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect() };
    let diff = |a: &[f64], b: &[f64]| {
        assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
        a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0, f64::max)
    };
    let d = diff(&run.losses, &want("loss"));
    assert!(d < 1e-4, "{what}: losses differ from PyTorch's by {d}\n{:?}\n{:?}", run.losses, want("loss"));
    let d = diff(&run.grad_norms, &want("grad_norm"));
    assert!(d < 1e-4, "{what}: gradient norms differ by {d}\n{:?}\n{:?}", run.grad_norms, want("grad_norm"));
    for key in [
        "entropy",
        "kl",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "reward",
        "reward_std",
        "frac_reward_zero_std",
    ] {
        let (ours, theirs) = (metric(&run.output_dir, key), want(key));
        let d = diff(&ours, &theirs);
        assert!(d < 1e-4, "{what}: {key} differs by {d}\n{ours:?}\n{theirs:?}");
    }
}

/// Every loss type, with and without the KL term (the reference a frozen copy of the starting
/// weights), with μ = 1 and 2 (the second step's ratios away from 1, clipped), on one rank and
/// on two, against the PyTorch loss. bnpo normalises each rank's tokens, as TRL does on two
/// processes: two ranks have their own reference runs.
#[test]
fn every_loss_type_with_and_without_kl_at_mu_1_and_2_matches_trls_loss_at_worlds_1_and_2() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("llama", tmp.path());
    let kinds =
        [("grpo", GrpoLossType::Grpo), ("bnpo", GrpoLossType::Bnpo), ("dr_grpo", GrpoLossType::DrGrpo), ("dapo", GrpoLossType::Dapo)];
    for (name, kind) in kinds {
        for beta in [0.0, 0.04] {
            for mu in [1, 2] {
                for world in [1, 2] {
                    let base = if kind == GrpoLossType::Bnpo && world == 2 { "bnpo_world2" } else { name };
                    let reference = format!("{base}{}{}", if beta > 0.0 { "_kl" } else { "" }, if mu == 2 { "_mu2" } else { "" });
                    let (eps, eps_high) = if mu == 1 { (0.2, 0.2) } else { (0.01, 0.015) };
                    let out = tmp.path().join(format!("{reference}-{world}"));
                    let run = run_local(&reference_run(&model, &out, (kind, beta, mu, eps, eps_high), world)).unwrap();
                    check(&run, &reference, &format!("{name}, beta {beta}, num_iterations {mu}, world {world}"));
                }
            }
        }
    }
}

/// LoRA: the adapter trains, the reference is the base with the adapters off.
#[test]
fn lora_grpo_matches_trls_loss() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("llama", tmp.path());
    for world in [1, 2] {
        let out = tmp.path().join(format!("lora-{world}"));
        let mut cfg = reference_run(&model, &out, (GrpoLossType::Dapo, 0.04, 2, 0.01, 0.015), world);
        cfg.adapter = Some(common::reference_dir().join("lora-llama"));
        let run = run_local(&cfg).unwrap();
        check(&run, "lora_dapo_kl_mu2", &format!("LoRA at world {world}"));
    }
}

/// text_similarity's metrics equal rapidfuzz's, sacrebleu's and rouge-score's
/// (tests/reference/make_grader_reference.py).
#[test]
fn similarity_metrics_match_the_python_libraries() {
    let rows = common::reference_json("grader-similarity.json");
    for row in rows.as_array().unwrap() {
        let (out, reference) = (row["output"].as_str().unwrap(), row["reference"].as_str().unwrap());
        let ours = [
            ("fuzzy_match", fuzzy_match(out, reference)),
            ("bleu", bleu(out, reference)),
            ("rouge_1", rouge(out, reference, Some(1))),
            ("rouge_2", rouge(out, reference, Some(2))),
            ("rouge_l", rouge(out, reference, None)),
        ];
        for (name, v) in ours {
            let want = row[name].as_f64().unwrap();
            assert!((v - want).abs() < 1e-9, "{name}({out:?}, {reference:?}) = {v}, the library says {want}");
        }
    }
}

/// Text prompts for the tiny fixture, each with the `answer` its grader reads.
fn sum_prompts(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("prompts.jsonl");
    let rows: String = (0..8).map(|i| format!("{{\"prompt\": \"{} + {} =\", \"answer\": \"{}\"}}\n", i, i + 1, 2 * i + 1)).collect();
    std::fs::write(&path, rows).unwrap();
    path
}

fn sampled_run(model: &Path, data: &Path, out: &Path) -> FinetuneConfig {
    let grader = fsdp_app::train::grpo::graders::Grader::from_json(&serde_json::json!({
        "type": "multi",
        "graders": {
            "close": {"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "{{item.answer}}", "evaluation_metric": "fuzzy_match", "pass_threshold": 0.5},
            "has": {"type": "string_check", "input": "{{sample.output_text}}", "reference": "{{item.answer}}", "operation": "like"}
        },
        "calculate_output": "close + has"
    }))
    .unwrap();
    let settings = GrpoSettings { num_generations: 4, max_completion_length: 6, ..GrpoSettings::default() };
    FinetuneConfig {
        data: data.to_path_buf(),
        max_steps: Some(4),
        batch_size: 2,
        seq_len: Some(16),
        grpo: Some(GrpoConfig { settings, grader: Some(grader), given: None }),
        ..common::reference_training_config(model, out)
    }
}

/// A sampled run: TRL's metrics in every step's row, every rollout in rollouts.jsonl with the
/// reward its graders gave; the same rollouts on two ranks as on one (seeds by place in the
/// global batch); and a run resumed from its step-2 checkpoint samples what the uninterrupted run
/// sampled and ends where it ended.
#[test]
fn sampled_runs_log_their_rollouts_and_resume_on_the_same_seeds() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("llama", tmp.path());
    let data = sum_prompts(tmp.path());
    let mut straight = sampled_run(&model, &data, &tmp.path().join("straight"));
    straight.save_steps = Some(2);
    let first = run_local(&straight).unwrap();
    let dir = tmp.path().join("straight");
    let rows: Vec<Value> =
        std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 4);
    for key in [
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "rewards/multi/mean",
        "rewards/close/mean",
        "rewards/close/pass_rate",
        "rewards/has/std",
        "completions/mean_length",
        "completions/clipped_ratio",
        "entropy",
        "clip_ratio/region_mean",
        "time/generation_s",
        "time/training_s",
    ] {
        assert!(rows.iter().all(|r| r[key].is_number()), "no {key} in {}", rows[0]);
    }
    let rollouts = |dir: &Path| -> Vec<Value> {
        std::fs::read_to_string(dir.join("rollouts.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let logged = rollouts(&dir);
    assert_eq!(logged.len(), 4 * 2 * 4);
    for step in 1..=4 {
        let of_step: Vec<&Value> = logged.iter().filter(|r| r["step"] == step).collect();
        let mean = of_step.iter().map(|r| r["reward"].as_f64().unwrap()).sum::<f64>() / of_step.len() as f64;
        assert!((mean - rows[step - 1]["reward"].as_f64().unwrap()).abs() < 1e-9, "step {step}: the logged rewards' mean");
        for r in &of_step {
            let g = &r["graders"];
            assert!((g["close"].as_f64().unwrap() + g["has"].as_f64().unwrap() - r["reward"].as_f64().unwrap()).abs() < 1e-12, "{r}");
        }
    }
    let by_place = |v: &[Value]| {
        let mut v: Vec<(u64, u64, String)> = v
            .iter()
            .map(|r| (r["step"].as_u64().unwrap(), r["place"].as_u64().unwrap(), r["completion"].as_str().unwrap().to_string()))
            .collect();
        v.sort();
        v
    };

    // Two ranks: each samples its own prompts, with the seeds of their places.
    let two = FinetuneConfig { world_size: 2, batch_size: 1, save_steps: None, ..sampled_run(&model, &data, &tmp.path().join("two")) };
    run_local(&two).unwrap();
    let (one_rank, two_ranks) = (by_place(&logged), by_place(&rollouts(&tmp.path().join("two"))));
    assert_eq!(one_rank[..8], two_ranks[..8], "the first step's rollouts differ between one rank and two");

    let resumed = FinetuneConfig {
        output_dir: tmp.path().join("resumed"),
        resume_from: Some(dir.join("checkpoint-2").to_string_lossy().to_string()),
        ..straight.clone()
    };
    let second = run_local(&resumed).unwrap();
    assert_eq!(second.losses, first.losses[2..], "resumed losses");
    let later: Vec<_> = one_rank.iter().filter(|r| r.0 > 2).cloned().collect();
    assert_eq!(by_place(&rollouts(&tmp.path().join("resumed"))), later, "the resumed run sampled other completions");
}

/// Flags that do not fit GRPO, or GRPO's flags without it, are refused by name.
#[test]
fn grpo_refuses_what_it_cannot_honour() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("llama", tmp.path());
    let data = sum_prompts(tmp.path());
    let grader = tmp.path().join("grader.yaml");
    std::fs::write(&grader, "type: string_check\ninput: \"{{sample.output_text}}\"\nreference: \"{{item.answer}}\"\noperation: like\n")
        .unwrap();
    let run = |extra: &[&str]| {
        let out = tmp.path().join("out");
        let mut args =
            vec!["finetune", "--model", model.to_str().unwrap(), "--data", data.to_str().unwrap(), "--output-dir", out.to_str().unwrap()];
        args.extend_from_slice(extra);
        let o = common::run_cli(&args, &[]);
        assert!(!o.status.success(), "{extra:?} was accepted");
        common::stderr(&o)
    };
    let g = grader.to_str().unwrap();
    for (extra, says) in [
        (vec!["--num-generations", "4"], "--num-generations applies to --method grpo"),
        (vec!["--method", "grpo"], "needs --grader FILE"),
        (vec!["--method", "grpo", "--grader", g, "--num-generations", "1"], "--num-generations must be at least 2"),
        (vec!["--method", "grpo", "--grader", g, "--loss-type", "ppo"], "--loss-type \"ppo\""),
        (vec!["--method", "grpo", "--grader", g, "--packing"], "--packing cannot be used with --method grpo"),
        (
            vec!["--method", "grpo", "--grader", g, "--eval-split", "0.2", "--num-generations-eval", "1"],
            "--num-generations-eval must be at least 2",
        ),
        (vec!["--method", "grpo", "--grader", g, "--num-iterations", "2", "--save-steps", "3"], "--save-steps 3"),
        (vec!["--method", "grpo", "--grader", data.to_str().unwrap()], "--grader"),
    ] {
        let err = run(&extra);
        assert!(err.contains(says), "{extra:?}: {err}");
    }
    // A row without the field the grader reads is named by file and line.
    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"prompt\": \"1 + 1 =\", \"answer\": \"2\"}\n{\"prompt\": \"2 + 2 =\", \"solution\": \"4\"}\n").unwrap();
    let out = tmp.path().join("bad-out");
    let o = common::run_cli(
        &[
            "finetune",
            "--method",
            "grpo",
            "--grader",
            g,
            "--max-completion-length",
            "8",
            "--model",
            model.to_str().unwrap(),
            "--data",
            bad.to_str().unwrap(),
            "--output-dir",
            out.to_str().unwrap(),
        ],
        &[],
    );
    let err = common::stderr(&o);
    assert!(!o.status.success() && err.contains("bad.jsonl:2") && err.contains("no field `answer`"), "{err}");
}

/// Evaluation on held-out prompts (`--eval-split`, every step and at the end, two ranks): TRL's
/// eval metrics in the eval rows, the mean reward within the graders' range.
#[test]
fn evaluation_samples_and_grades_the_held_out_prompts() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("llama", tmp.path());
    let data = sum_prompts(tmp.path());
    let out = tmp.path().join("eval");
    let mut cfg = sampled_run(&model, &data, &out);
    (cfg.world_size, cfg.batch_size, cfg.max_steps, cfg.eval_split, cfg.eval_steps) = (2, 1, Some(2), Some(0.25), Some(1));
    cfg.grpo.as_mut().unwrap().settings.num_generations_eval = Some(3);
    run_local(&cfg).unwrap();
    let rows: Vec<Value> =
        std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let evals: Vec<&Value> = rows.iter().filter(|r| r.get("eval_loss").is_some()).collect();
    assert_eq!(evals.len(), 2, "an evaluation after step 1 and at the end: {rows:?}");
    for e in evals {
        let reward = e["eval_reward"].as_f64().unwrap();
        assert!((0.0..=2.0).contains(&reward) && e["eval_loss"].as_f64().unwrap().is_finite(), "{e}");
        for key in ["eval_reward_std", "eval_rewards/close/mean", "eval_rewards/has/mean", "eval_completions/mean_length"] {
            assert!(e[key].is_number(), "no {key} in {e}");
        }
        assert!(e["eval_completions/mean_length"].as_f64().unwrap() <= 6.0, "{e}");
    }
}
