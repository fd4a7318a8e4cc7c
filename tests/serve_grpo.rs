//! Reinforcement fine-tuning jobs over the jobs API (`method: {"type": "reinforcement"}` with a
//! grader), against a real server whose jobs train in real child processes: OpenAI's RFT rows
//! uploaded and checked as prompts, the grader checked at creation (a 400 naming its field, or
//! the file's line that lacks what it reads), events with each step's mean reward, the tuned
//! model served; and SmolLM2 learning a verifiable task through a job.

mod common;

use common::server::*;
use common::*;
use serde_json::{json, Value};

/// OpenAI's reinforcement rows: the prompt as messages, the reference `answer` beside it.
fn rft_rows() -> String {
    (0..8)
        .map(|i| {
            let row = json!({"messages": [{"role": "user", "content": format!("What is {i} plus {i}?")}], "answer": format!("{}", 2 * i)});
            format!("{row}\n")
        })
        .collect()
}

fn string_check() -> Value {
    json!({"type": "string_check", "name": "has_answer", "input": "{{sample.output_text}}", "reference": "{{item.answer}}", "operation": "like"})
}

#[test]
fn a_reinforcement_job_checks_its_grader_trains_and_serves_its_model() {
    let tmp = tempfile::tempdir().unwrap();
    // The llama fixture samples varied text (the others are trained to repeat themselves), so a
    // group's rewards differ and the step moves the weights.
    let model = fixture("llama", tmp.path());
    let data = tmp.path().join("data");
    let server = Server::start(&model, &["--data-dir", data.to_str().unwrap()]);
    let (s, prompts) = upload(&server, "rft.jsonl", rft_rows().as_bytes());
    assert_eq!(s, 200, "{prompts}");
    // A prompt row that ends with the answer is not a prompt: named by line.
    let broken = format!("{}{}\n", rft_rows(), json!({"messages": [{"role": "user", "content": "hi"}], "prompt": "x"}));
    let (s, e) = upload(&server, "broken.jsonl", broken.as_bytes());
    assert!(s == 400 && e["error"]["message"].as_str().unwrap().starts_with("Line 9:"), "{e}");
    let (_, sft) = upload(&server, "sft.jsonl", b"{\"prompt\": \"a\", \"completion\": \"b\"}\n");

    let jobs = server.url("/v1/fine_tuning/jobs");
    let request = |file: &Value, grader: Value, h: Value| {
        json!({"model": "tiny", "training_file": file["id"], "suffix": "rft", "seed": 1,
               "method": {"type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": h}},
               "fsdp_app": {"world_size": 2, "seq_len": 64, "max_completion_length": 8, "max_steps": 2}})
    };
    let refused = |body: Value| {
        let (s, text, _) = post(&jobs, &body.to_string(), None);
        assert_eq!(s, 400, "{text}");
        serde_json::from_str::<Value>(&text).unwrap()["error"].clone()
    };
    let mut bad = string_check();
    bad["operation"] = json!("contains");
    let e = refused(request(&prompts, bad, json!({})));
    assert_eq!(e["param"], "method.reinforcement.grader.operation", "{e}");
    let mut reads_missing = string_check();
    reads_missing["reference"] = json!("{{item.solution}}");
    let e = refused(request(&prompts, reads_missing, json!({})));
    assert!(
        e["message"].as_str().unwrap().contains("Line 1 of the training file") && e["message"].as_str().unwrap().contains("solution"),
        "{e}"
    );
    let e = refused(request(&sft, string_check(), json!({})));
    assert_eq!((e["param"].as_str(), e["code"].as_str()), (Some("training_file"), Some("invalid_file")), "{e}");
    // Evaluation needs a validation file.
    let e = refused(request(&prompts, string_check(), json!({"eval_interval": 5})));
    assert_eq!(e["param"], "hyperparameters.eval_interval", "{e}");
    let e = refused(json!({"model": "tiny", "training_file": prompts["id"], "method": {"type": "reinforcement"}}));
    assert_eq!(e["param"], "method.reinforcement.grader", "{e}");
    // A client must not run programs on the server.
    let inside_multi = json!({"type": "multi", "graders": {"a": string_check(), "b": {"type": "command", "command": ["true"]}}, "calculate_output": "a + b"});
    let e = refused(request(&prompts, inside_multi, json!({})));
    assert!(e["param"] == "method.reinforcement.grader" && e["message"].as_str().unwrap().contains("not accepted over HTTP"), "{e}");

    // Fuzzy similarity: rewards that differ within a group even for the fixture's random text.
    let fuzzy = json!({"type": "text_similarity", "name": "close", "input": "{{sample.output_text}}", "reference": "The answer is {{item.answer}}.",
                       "evaluation_metric": "fuzzy_match"});
    let h = json!({"n_epochs": 1, "batch_size": 2, "compute_multiplier": 0.5, "learning_rate_multiplier": 10, "eval_interval": 1, "eval_samples": 2});
    let mut with_validation = request(&prompts, fuzzy.clone(), h);
    with_validation["validation_file"] = prompts["id"].clone();
    let job = post_json(&jobs, &with_validation);
    assert_eq!(job["method"]["type"], "reinforcement", "{job}");
    assert_eq!(job["method"]["reinforcement"]["grader"], fuzzy, "{job}");
    assert_eq!(job["method"]["reinforcement"]["hyperparameters"]["compute_multiplier"], 0.5, "{job}");
    assert!(job["hyperparameters"].get("grader").is_none(), "{job}");
    let id = job["id"].as_str().unwrap().to_string();
    let done = wait_for_status(&server, &id, &["succeeded", "failed"], 240);
    assert_eq!(done["status"], "succeeded", "{done}");

    // Each step's mean reward, in the events and the run's metrics; 4 completions per prompt.
    let events = get_json(&server.url(&format!("/v1/fine_tuning/jobs/{id}/events?limit=100")));
    let rewards: Vec<&Value> = events["data"].as_array().unwrap().iter().filter(|e| e["data"]["reward"].is_number()).collect();
    assert_eq!(rewards.len(), 2, "{events}");
    assert!(rewards[0]["message"].as_str().unwrap().contains("mean reward="), "{events}");
    // Evaluated on the validation prompts after step 1 and at the end, each sampled twice.
    let evals: Vec<&Value> = events["data"].as_array().unwrap().iter().filter(|e| e["data"]["valid_reward"].is_number()).collect();
    assert_eq!(evals.len(), 2, "{events}");
    assert!(evals[0]["message"].as_str().unwrap().contains("validation mean reward="), "{events}");
    let rollouts = std::fs::read_to_string(data.join("jobs").join(&id).join("rollouts.jsonl")).unwrap();
    assert_eq!(rollouts.lines().count(), 2 * 2 * 4);

    let ft = done["fine_tuned_model"].as_str().unwrap();
    let (tuned, base) = (first_token_logprob(&server, ft), first_token_logprob(&server, "tiny"));
    assert!((tuned - base).abs() > 1e-6, "the tuned model answers as the base: {tuned} {base}; {events}");
}

/// Proof that GRPO learns: SmolLM2-135M-Instruct (converted from the PyPI GGUF), asked for the
/// sum of two digits "with the number only" (tests/data/sums.jsonl), rarely answers with a bare
/// number; graded by tests/data/sums-grader.json (half for that format, a JSON-schema check, half
/// for the right sum), a LoRA job of 16 steps of 2 prompts x 4 completions raises the mean reward
/// in its events well above where it started (the format is what a model this size learns in so
/// few steps). The rollouts come from the job's own engine. Without the GGUF it fails under
/// CI=true and skips (counted) elsewhere.
#[test]
fn a_reinforcement_job_teaches_smollm2_a_verifiable_task() {
    let Some(gguf) = smollm2_gguf_or_skip("a_reinforcement_job_teaches_smollm2_a_verifiable_task") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("smollm2");
    let conv = run_cli(&["convert", "--gguf", gguf.to_str().unwrap(), "--out", base.to_str().unwrap()], &[]);
    assert!(conv.status.success(), "{}", stderr(&conv));
    let jobs_dir = tmp.path().join("serve-data");
    let server = Server::start(&base, &["--data-dir", jobs_dir.to_str().unwrap()]);
    let data = repo_root().join("tests").join("data");
    let (s, file) = upload(&server, "sums.jsonl", &std::fs::read(data.join("sums.jsonl")).unwrap());
    assert_eq!(s, 200, "{file}");
    let grader: Value = serde_json::from_str(&std::fs::read_to_string(data.join("sums-grader.json")).unwrap()).unwrap();
    let job = post_json(
        &server.url("/v1/fine_tuning/jobs"),
        &json!({"model": "tiny", "training_file": file["id"], "seed": 42,
                "method": {"type": "reinforcement", "reinforcement": {"grader": grader,
                    "hyperparameters": {"batch_size": 2, "compute_multiplier": 0.5, "learning_rate_multiplier": 10}}},
                "fsdp_app": {"seq_len": 80, "max_completion_length": 8, "max_steps": 16, "lora": {"r": 16, "alpha": 32}}}),
    );
    let id = job["id"].as_str().unwrap().to_string();
    let done = wait_for_status(&server, &id, &["succeeded", "failed"], 900);
    assert_eq!(done["status"], "succeeded", "{done}");
    let events = get_json(&server.url(&format!("/v1/fine_tuning/jobs/{id}/events?limit=100")));
    let mut reward: Vec<(u64, f64)> = events["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| Some((e["data"]["step"].as_u64()?, e["data"]["reward"].as_f64()?)))
        .collect();
    reward.sort_by_key(|(s, _)| *s);
    let reward: Vec<f64> = reward.into_iter().map(|(_, r)| r).collect();
    assert_eq!(reward.len(), 16, "{events}");
    let mean = |r: &[f64]| r.iter().sum::<f64>() / r.len() as f64;
    let (first, last) = (mean(&reward[..4]), mean(&reward[12..]));
    assert!(last >= 0.3 && last >= first + 0.2, "the mean reward should rise well above its start: {reward:?}");
    // TRL's metrics in every step's row; every completion of every step with its reward.
    let out = jobs_dir.join("jobs").join(&id);
    let rows: Vec<Value> =
        std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    for key in
        ["reward_std", "frac_reward_zero_std", "rewards/bare_number/mean", "rewards/correct/mean", "entropy", "completions/mean_length"]
    {
        assert!(rows.iter().all(|r| r[key].is_number()), "metrics.jsonl rows lack {key}");
    }
    assert_eq!(std::fs::read_to_string(out.join("rollouts.jsonl")).unwrap().lines().count(), 16 * 2 * 4);
}
