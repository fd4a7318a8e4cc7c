//! A DPO fine-tuning job over the jobs API, against a real server whose job trains in real child
//! processes: OpenAI's DPO rows uploaded (and checked as pairs at upload), `method: {"type":
//! "dpo"}` with beta, the job succeeds with TRL's statistics in its metrics, and its model is
//! served.

mod common;

use common::server::*;
use common::*;
use serde_json::{json, Value};

/// OpenAI's DPO rows: a question, a preferred and a non-preferred answer.
fn openai_pairs() -> String {
    let m = |role: &str, content: &str| json!({"role": role, "content": content});
    (0..8)
        .map(|i| {
            let row = json!({
                "input": {"messages": [m("user", &format!("What is {i} plus {i}?"))]},
                "preferred_output": [m("assistant", &format!("{}", 2 * i))],
                "non_preferred_output": [m("assistant", "I do not know.")],
            });
            format!("{row}\n")
        })
        .collect()
}

#[test]
fn a_dpo_job_trains_on_uploaded_pairs_and_its_model_is_served() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let data = tmp.path().join("data");
    let server = Server::start(&model, &["--data-dir", data.to_str().unwrap()]);
    let (s, pairs) = upload(&server, "pairs.jsonl", openai_pairs().as_bytes());
    assert_eq!(s, 200, "{pairs}");
    // Uploads are checked as pairs: a broken row is named by line.
    let broken = format!("{}{}\n", openai_pairs(), json!({"input": {"messages": []}, "preferred_output": [], "non_preferred_output": []}));
    let (s, e) = upload(&server, "broken.jsonl", broken.as_bytes());
    assert_eq!(s, 400, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().starts_with("Line 9:"), "{e}");
    let (_, sft) = upload(&server, "sft.jsonl", b"{\"prompt\": \"a\", \"completion\": \"b\"}\n");

    let jobs = server.url("/v1/fine_tuning/jobs");
    let request = |file: &Value, method: Value| {
        json!({"model": "tiny", "training_file": file["id"], "suffix": "dpo", "seed": 1, "method": method,
               "fsdp_app": {"world_size": 2, "seq_len": 64}})
    };
    let dpo = |h: Value| json!({"type": "dpo", "dpo": {"hyperparameters": h}});
    // The method and its files must agree; beta is DPO's alone.
    let (s, body, _) = post(&jobs, &request(&sft, dpo(json!({}))).to_string(), None);
    assert_eq!(s, 400, "{body}");
    let e: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((e["error"]["param"].as_str(), e["error"]["code"].as_str()), (Some("training_file"), Some("invalid_file")), "{e}");
    let supervised_beta = json!({"type": "supervised", "supervised": {"hyperparameters": {"beta": 0.1}}});
    let (s, body, _) = post(&jobs, &request(&pairs, supervised_beta).to_string(), None);
    assert!(s == 400 && body.contains("hyperparameters.beta"), "{s} {body}");
    let (s, body, _) = post(&jobs, &request(&pairs, dpo(json!({"beta": 5}))).to_string(), None);
    assert!(s == 400 && body.contains("`beta` must be a number in"), "{s} {body}");

    let job = post_json(&jobs, &request(&pairs, dpo(json!({"beta": 0.2, "n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 50}))));
    assert_eq!(job["method"]["type"], "dpo", "{job}");
    assert_eq!(job["method"]["dpo"]["hyperparameters"]["beta"], 0.2, "{job}");
    let id = job["id"].as_str().unwrap().to_string();
    let done = wait_for_status(&server, &id, &["succeeded", "failed"], 240);
    assert_eq!(done["status"], "succeeded", "{done}");

    // TRL's statistics per step; 8 pairs x 2 epochs in steps of 4 pairs.
    let metrics = std::fs::read_to_string(data.join("jobs").join(&id).join("metrics.jsonl")).unwrap();
    let steps: Vec<Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(steps.len(), 4, "{metrics}");
    assert!((steps[0]["loss"].as_f64().unwrap() - std::f64::consts::LN_2).abs() < 1e-5, "{metrics}");
    for key in ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"] {
        assert!(steps.iter().all(|s| s[key].is_number()), "{key} missing: {metrics}");
    }
    assert!(steps[3]["rewards/margins"].as_f64().unwrap() > 0.0, "the preferred answers gained on the others: {metrics}");

    let ft = done["fine_tuned_model"].as_str().unwrap();
    assert!(ft.starts_with("ft:") && ft.contains(":dpo:"), "{ft}");
    let (tuned, base) = (first_token_logprob(&server, ft), first_token_logprob(&server, "tiny"));
    assert!((tuned - base).abs() > 1e-5, "the DPO model answers as the base: {tuned} {base}");
}
