//! A fine-tuning job's checkpoints and token count, over real HTTP against a real server whose
//! job trains in real child processes: every epoch leaves a checkpoint, the newest three are
//! listed, each is served by the id the listing shows (the last is the final model), one
//! rotated away is gone; `trained_tokens` counts the rows' tokens, not padded positions.

mod common;

use common::server::*;
use common::*;
use serde_json::{json, Value};

/// Token rows of 10, 20, 30 and 40 tokens, every one trained on.
fn token_rows() -> String {
    [10, 20, 30, 40]
        .iter()
        .map(|&n| {
            let ids: Vec<u32> = (0..n).map(|i| 3 + (i * 7 + n) % 90).collect();
            format!("{}\n", json!({"input_ids": ids, "labels": ids}))
        })
        .collect()
}

#[test]
fn a_jobs_epoch_checkpoints_are_listed_and_served_and_trained_tokens_counts_real_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let server = Server::start(&model, &["--data-dir", tmp.path().join("data").to_str().unwrap()]);
    // Token rows of 10, 20, 30 and 40 tokens, every one trained on: 100 tokens an epoch,
    // whatever the order. Padded to --seq-len 64 they would be 256 positions an epoch.
    let rows = token_rows();
    let (s, file) = upload(&server, "tokens.jsonl", rows.as_bytes());
    assert_eq!(s, 200, "{file}");
    // 4 epochs of 2 steps (batch 2): checkpoints at steps 2, 4, 6 and 8, the newest 3 kept.
    let job = post_json(
        &server.url("/v1/fine_tuning/jobs"),
        &json!({"model": "tiny", "training_file": file["id"], "suffix": "ckpt", "seed": 1,
        "hyperparameters": {"n_epochs": 4, "batch_size": 2, "learning_rate_multiplier": 100},
        "fsdp_app": {"world_size": 1, "seq_len": 64}}),
    );
    let id = job["id"].as_str().unwrap().to_string();
    let done = wait_for_status(&server, &id, &["succeeded", "failed"], 240);
    assert_eq!(done["status"], "succeeded", "{done}");
    assert_eq!(done["trained_tokens"], 400, "4 epochs x 100 real tokens: {done}");
    let ft = done["fine_tuned_model"].as_str().unwrap().to_string();

    let listing = get_json(&server.url(&format!("/v1/fine_tuning/jobs/{id}/checkpoints")));
    let ckpts = listing["data"].as_array().unwrap();
    let steps: Vec<i64> = ckpts.iter().map(|c| c["step_number"].as_i64().unwrap()).collect();
    assert_eq!(steps, [8, 6, 4], "newest first, step 2 rotated away: {listing}");
    for c in ckpts {
        let step = c["step_number"].as_i64().unwrap();
        assert_eq!(c["object"], "fine_tuning.job.checkpoint");
        assert_eq!(c["fine_tuning_job_id"], json!(id));
        assert_eq!(c["fine_tuned_model_checkpoint"], json!(format!("{ft}:ckpt-step-{step}")));
        assert_eq!(c["metrics"]["step"], step, "{c}");
        assert!(c["metrics"]["train_loss"].is_number(), "{c}");
    }

    // Each is served by its id: the last one is the final model; the earlier ones are their own
    // weights (merged from the sharded checkpoint), different from the final and the base.
    let ids: Vec<&str> = ckpts.iter().map(|c| c["fine_tuned_model_checkpoint"].as_str().unwrap()).collect();
    // Four clients at once for a checkpoint not merged yet: it is merged once, all get its answer.
    let at_once: Vec<f64> = std::thread::scope(|s| {
        let asks: Vec<_> = (0..4).map(|_| s.spawn(|| first_token_logprob(&server, ids[1]))).collect();
        asks.into_iter().map(|a| a.join().unwrap()).collect()
    });
    assert!(at_once.iter().all(|&x| x == at_once[0]), "{at_once:?}");
    let answer: Vec<f64> = ids.iter().map(|m| first_token_logprob(&server, m)).collect();
    let (final_lp, base_lp) = (first_token_logprob(&server, &ft), first_token_logprob(&server, "tiny"));
    assert_eq!(answer[0], final_lp, "the last checkpoint is the final model");
    for (i, lp) in answer.iter().enumerate().skip(1) {
        assert!(
            (lp - final_lp).abs() > 1e-5 && (lp - base_lp).abs() > 1e-5,
            "{} answers like another model: {answer:?} final {final_lp} base {base_lp}",
            ids[i]
        );
    }
    assert!((answer[1] - answer[2]).abs() > 1e-5, "steps 6 and 4 answer alike: {answer:?}");
    assert_eq!(answer[1], at_once[0]);
    // After a restart, a checkpoint is served as it was (from its merged copy).
    drop(server);
    let server = Server::start(&model, &["--data-dir", tmp.path().join("data").to_str().unwrap()]);
    assert_eq!(first_token_logprob(&server, ids[2]), answer[2]);
    let rotated = format!("{ft}:ckpt-step-2");
    let (s, text, _) = post(
        &server.url("/v1/chat/completions"),
        &json!({"model": rotated, "messages": [{"role": "user", "content": "x"}]}).to_string(),
        None,
    );
    assert_eq!(s, 404, "{text}");
    let err: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(err["error"]["code"], "model_not_found", "{err}");

    // Deleting the fine-tuned model takes its checkpoints with it.
    let deleted = ureq::delete(&server.url(&format!("/v1/models/{ft}"))).call().unwrap();
    assert_eq!(deleted.status(), 200);
    assert_eq!(get_json(&server.url(&format!("/v1/fine_tuning/jobs/{id}/checkpoints")))["data"], json!([]));
    let (s, _, _) = post(
        &server.url("/v1/chat/completions"),
        &json!({"model": ids[1], "messages": [{"role": "user", "content": "x"}]}).to_string(),
        None,
    );
    assert_eq!(s, 404, "a deleted model's checkpoint is not served");
}

/// A LoRA job's checkpoints are its adapter at each epoch: the earlier ones are written as PEFT
/// adapters (not merged models) on first use and served over the base; deleting the job's model
/// stops serving them.
#[test]
fn a_lora_jobs_checkpoints_are_served_as_adapters_over_the_base() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let data = tmp.path().join("data");
    let server = Server::start(&model, &["--data-dir", data.to_str().unwrap()]);
    let rows = token_rows();
    let (_, file) = upload(&server, "tokens.jsonl", rows.as_bytes());
    let job = post_json(
        &server.url("/v1/fine_tuning/jobs"),
        &json!({"model": "tiny", "training_file": file["id"], "suffix": "lora", "seed": 1,
        "hyperparameters": {"n_epochs": 3, "batch_size": 2, "learning_rate_multiplier": 20},
        "fsdp_app": {"world_size": 1, "seq_len": 64, "lora": {"r": 4, "alpha": 8}}}),
    );
    let id = job["id"].as_str().unwrap().to_string();
    let done = wait_for_status(&server, &id, &["succeeded", "failed"], 240);
    assert_eq!(done["status"], "succeeded", "{done}");
    let ft = done["fine_tuned_model"].as_str().unwrap().to_string();
    let listing = get_json(&server.url(&format!("/v1/fine_tuning/jobs/{id}/checkpoints")));
    let ids: Vec<String> =
        listing["data"].as_array().unwrap().iter().map(|c| c["fine_tuned_model_checkpoint"].as_str().unwrap().into()).collect();
    assert_eq!(ids.len(), 3, "{listing}");
    let answer: Vec<f64> = ids.iter().map(|m| first_token_logprob(&server, m)).collect();
    let (final_lp, base_lp) = (first_token_logprob(&server, &ft), first_token_logprob(&server, "tiny"));
    assert_eq!(answer[0], final_lp, "the last checkpoint is the final adapter");
    assert!((answer[1] - final_lp).abs() > 1e-5 && (answer[1] - base_lp).abs() > 1e-5, "{answer:?} {final_lp} {base_lp}");
    let written = data.join("jobs").join(&id).join("served");
    let step_dirs: Vec<_> = std::fs::read_dir(&written).unwrap().map(|e| e.unwrap().path()).collect();
    assert!(!step_dirs.is_empty(), "nothing written for the earlier checkpoints");
    for d in &step_dirs {
        assert!(d.join("adapter_config.json").is_file() && !d.join("config.json").exists(), "{} is not an adapter", d.display());
    }
    let deleted = ureq::delete(&server.url(&format!("/v1/models/{ft}"))).call().unwrap();
    assert_eq!(deleted.status(), 200);
    let (s, _, _) = post(
        &server.url("/v1/chat/completions"),
        &json!({"model": ids[1], "messages": [{"role": "user", "content": "x"}]}).to_string(),
        None,
    );
    assert_eq!(s, 404, "a deleted LoRA model's checkpoint adapter is not served");
}
