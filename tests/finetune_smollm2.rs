//! Proof that fine-tuning does something: SmolLM2-135M-Instruct (converted from the PyPI GGUF)
//! does not know the made-up codename of "Project Zephyrix"; after 16 full fine-tuning steps on
//! the 32-row chat file tests/data/zephyrix-codename.jsonl (2 ranks, FULL_SHARD, assistant-only
//! loss), greedy `generate --chat` answers with it when asked in words that no training row uses.
//! Without the GGUF it fails under CI=true and skips (counted) elsewhere.

mod common;

use common::*;

/// A paraphrase: the training rows ask eight other ways, and never use "go by" or "code name".
const QUESTION: &str = "What code name does Project Zephyrix go by?";

#[test]
fn fine_tuning_teaches_smollm2_a_new_fact() {
    let Some(gguf) = smollm2_gguf_or_skip("fine_tuning_teaches_smollm2_a_new_fact") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("smollm2");
    let conv = run_cli(&["convert", "--gguf", gguf.to_str().unwrap(), "--out", base.to_str().unwrap()], &[]);
    assert!(conv.status.success(), "{}", stderr(&conv));
    let ask = |model: &std::path::Path| {
        let o = run_cli(
            &["generate", "--model", model.to_str().unwrap(), "--chat", "--prompt", QUESTION, "--max-new-tokens", "24", "--json"],
            &[],
        );
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str::<serde_json::Value>(stdout(&o).trim()).unwrap()["text"].as_str().unwrap().to_string()
    };
    let data = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests").join("data").join("zephyrix-codename.jsonl");
    let rows = std::fs::read_to_string(&data).unwrap().to_lowercase();
    for phrase in [QUESTION.to_lowercase().as_str(), "code name", "go by"] {
        assert!(!rows.contains(phrase), "the training rows contain {phrase:?}: the question would test recall, not the fact");
    }
    let before = ask(&base);
    assert!(!before.contains("BLUE HERON"), "the base model already knows: {before}");

    let out = tmp.path().join("tuned");
    let o = run_cli(
        &[
            "finetune",
            "--model",
            base.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--output-dir",
            out.to_str().unwrap(),
            "--world-size",
            "2",
            "--batch-size",
            "2",
            "--seq-len",
            "64",
            "--max-steps",
            "16",
            "--lr",
            "5e-5",
            "--warmup-steps",
            "2",
            "--lr-scheduler",
            "constant",
            "--activation-checkpointing",
        ],
        &[("RAYON_NUM_THREADS", "2")],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let losses = metric_losses(&out);
    assert!(losses.last().unwrap() < &(losses[0] / 4.0), "the loss should fall: {losses:?}");
    let after = ask(&out);
    assert!(after.contains("BLUE HERON"), "before: {before:?}; after: {after:?}");
}
