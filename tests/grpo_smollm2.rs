//! Proof that GRPO learns: SmolLM2-135M-Instruct (converted from the PyPI GGUF) with a LoRA
//! adapter, asked for the sum of two digits "with the number only" (tests/data/sums.jsonl),
//! rarely answers with a bare number; graded by tests/data/sums-grader.json (half for that
//! format, a JSON-schema check, half for the right sum), 16 GRPO steps of 2 prompts x 4
//! completions raise its mean reward well above where it started (the format is what a model
//! this size learns in so few steps). The rollouts come from the run's own
//! engine; every step's are in OUTPUT/rollouts.jsonl. Without the GGUF it fails under CI=true
//! and skips (counted) elsewhere.

mod common;

use common::*;

#[test]
fn grpo_raises_smollm2s_reward_on_a_verifiable_task() {
    let Some(gguf) = smollm2_gguf_or_skip("grpo_raises_smollm2s_reward_on_a_verifiable_task") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("smollm2");
    let conv = run_cli(&["convert", "--gguf", gguf.to_str().unwrap(), "--out", base.to_str().unwrap()], &[]);
    assert!(conv.status.success(), "{}", stderr(&conv));
    let data = repo_root().join("tests").join("data");
    let out = tmp.path().join("grpo");
    let o = run_cli(
        &[
            "finetune",
            "--method",
            "grpo",
            "--model",
            base.to_str().unwrap(),
            "--data",
            data.join("sums.jsonl").to_str().unwrap(),
            "--grader",
            data.join("sums-grader.json").to_str().unwrap(),
            "--output-dir",
            out.to_str().unwrap(),
            "--num-generations",
            "4",
            "--max-completion-length",
            "8",
            "--batch-size",
            "2",
            "--max-steps",
            "16",
            "--seq-len",
            "80",
            "--lora-r",
            "16",
            "--lora-alpha",
            "32",
            "--lr",
            "2e-3",
            "--lr-scheduler",
            "constant",
        ],
        &[("RAYON_NUM_THREADS", "2")],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let rows: Vec<serde_json::Value> =
        std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let reward: Vec<f64> = rows.iter().map(|r| r["reward"].as_f64().unwrap()).collect();
    assert_eq!(reward.len(), 16);
    let mean = |r: &[f64]| r.iter().sum::<f64>() / r.len() as f64;
    let (first, last) = (mean(&reward[..4]), mean(&reward[12..]));
    assert!(last >= 0.3 && last >= first + 0.2, "the mean reward should rise well above its start: {reward:?}");
    for key in
        ["reward_std", "frac_reward_zero_std", "rewards/bare_number/mean", "rewards/correct/mean", "entropy", "completions/mean_length"]
    {
        assert!(rows.iter().all(|r| r[key].is_number()), "metrics.jsonl rows lack {key}");
    }
    // Every completion of every step, with its reward.
    let rollouts = std::fs::read_to_string(out.join("rollouts.jsonl")).unwrap();
    assert_eq!(rollouts.lines().count(), 16 * 2 * 4);
    assert!(out.join("adapter_model.safetensors").is_file());
}
