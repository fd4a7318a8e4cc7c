//! Fine-tuning jobs over HTTP against a real server (OpenAI's files + fine_tuning.jobs shapes):
//! a job runs from upload to a served `ft:` model, is cancelled, survives a server restart, and
//! a failed job says why.

mod common;

use std::path::Path;

use common::server::*;
use common::*;
use serde_json::{json, Value};

#[test]
fn fine_tuning_jobs_run_to_a_served_model_persist_and_survive_a_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let data_dir = tmp.path().join("data");
    let chat = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/zephyrix-codename.jsonl")).unwrap();
    // The server's --chat-template (the model's own, marked): jobs train with it and their
    // models carry it.
    let own: Value = serde_json::from_slice(&std::fs::read(model.join("tokenizer_config.json")).unwrap()).unwrap();
    let template = format!("{{# served with --chat-template #}}{}", own["chat_template"].as_str().unwrap());
    let template_file = tmp.path().join("served.jinja");
    std::fs::write(&template_file, &template).unwrap();
    let server = Server::start(&model, &["--data-dir", data_dir.to_str().unwrap(), "--chat-template", template_file.to_str().unwrap()]);

    // Files: validated on upload, listed, read back, deleted.
    let (s, bad) = upload(
        &server,
        "bad.jsonl",
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"assistant\", \"content\": \"y\"}]}\n{\"foo\": 1}\n",
    );
    assert_eq!((s, bad["error"]["param"].as_str()), (400, Some("file")), "{bad}");
    assert!(bad["error"]["message"].as_str().unwrap().starts_with("Line 2:"), "{bad}");
    // A UTF-8 byte-order mark (as Windows editors write it) is read past.
    let (s, bom) = upload(&server, "bom.jsonl", &[b"\xef\xbb\xbf".as_slice(), chat.as_slice()].concat());
    assert_eq!((s, bom["purpose"].as_str()), (200, Some("fine-tune")), "{bom}");
    let (s, file) = upload(&server, "../../etc/passwd", &chat);
    assert_eq!(s, 200, "{file}");
    let file_id = file["id"].as_str().unwrap().to_string();
    assert_eq!(file["bytes"], chat.len());
    let content = ureq::get(&server.url(&format!("/v1/files/{file_id}/content"))).call().unwrap().into_string().unwrap();
    assert_eq!(content.as_bytes(), chat.as_slice());
    assert!(!data_dir.join("etc").exists() && !tmp.path().join("etc").exists(), "a file name is never a path");
    let (_, spare) = upload(&server, "spare.jsonl", &chat);
    let spare_id = spare["id"].as_str().unwrap();
    assert!(ureq::delete(&server.url(&format!("/v1/files/{spare_id}")))
        .call()
        .unwrap()
        .into_string()
        .unwrap()
        .contains("\"deleted\":true"));
    assert!(matches!(ureq::get(&server.url(&format!("/v1/files/{spare_id}"))).call(), Err(ureq::Error::Status(404, _))));

    // A job: Idempotency-Key makes a retried create return the same job.
    let create = json!({"model": "tiny", "training_file": file_id, "suffix": "zephyrix", "seed": 3,
        "hyperparameters": {"n_epochs": 1, "batch_size": 2, "learning_rate_multiplier": 100},
        "fsdp_app": {"world_size": 2, "seq_len": 128, "max_steps": 4}});
    let post_with_key = |body: &Value, key: &str| -> Value {
        let r = ureq::post(&server.url("/v1/fine_tuning/jobs")).set("Idempotency-Key", key).send_string(&body.to_string()).unwrap();
        serde_json::from_str(&r.into_string().unwrap()).unwrap()
    };
    let job = post_with_key(&create, "retry-1");
    let again = post_with_key(&create, "retry-1");
    assert_eq!(job["id"], again["id"]);
    // The same key with other settings is a client error naming the key, not the old job.
    let mut other = create.clone();
    other["seed"] = json!(4);
    match ureq::post(&server.url("/v1/fine_tuning/jobs")).set("Idempotency-Key", "retry-1").send_string(&other.to_string()) {
        Err(ureq::Error::Status(409, r)) => {
            let body: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
            assert_eq!(body["error"]["code"], "idempotency_key_reused", "{body}");
            assert!(body["error"]["message"].as_str().unwrap().contains("retry-1"), "{body}");
        }
        other => panic!("a reused key with another body: {other:?}"),
    }
    let job_id = job["id"].as_str().unwrap().to_string();
    let done = wait_for_status(&server, &job_id, &["succeeded", "failed"], 180);
    assert_eq!(done["status"], "succeeded", "{done}");
    let ft = done["fine_tuned_model"].as_str().unwrap().to_string();
    assert_eq!(ft, format!("ft:tiny:zephyrix:{job_id}"));
    let tuned = data_dir.join("jobs").join(&job_id);
    assert_eq!(std::fs::read_to_string(tuned.join("chat_template.jinja")).unwrap(), template);
    let written: Value = serde_json::from_slice(&std::fs::read(tuned.join("tokenizer_config.json")).unwrap()).unwrap();
    assert!(written.get("chat_template").is_none(), "one template in the tuned model: {written}");
    let events = get_json(&server.url(&format!("/v1/fine_tuning/jobs/{job_id}/events?limit=100")));
    let messages: Vec<&str> = events["data"].as_array().unwrap().iter().map(|e| e["message"].as_str().unwrap()).collect();
    assert!(messages.iter().any(|m| m.starts_with("Step 4: training loss=")), "{messages:?}");
    assert!(events["data"].as_array().unwrap().iter().any(|e| e["type"] == "metrics" && e["data"]["train_loss"].is_number()));
    let ckpts = get_json(&server.url(&format!("/v1/fine_tuning/jobs/{job_id}/checkpoints")));
    assert_eq!(ckpts["data"][0]["step_number"], 4);
    // The fine-tuned model is listed and answers, differently from the base.
    let models = get_json(&server.url("/v1/models"));
    assert!(models["data"].as_array().unwrap().iter().any(|m| m["id"] == json!(ft)), "{models}");
    let (base_lp, ft_lp) = (first_token_logprob(&server, "tiny"), first_token_logprob(&server, &ft));
    assert!((base_lp - ft_lp).abs() > 1e-4, "fine-tuning changed nothing: {base_lp} vs {ft_lp}");

    // A LoRA job is served as its adapter over the base (no merged copy is written); with
    // `fsdp_app.merge` as the merged model. Both answer alike: the same training, two ways.
    let mut lora = create.clone();
    lora["fsdp_app"]["lora"] = json!({"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]});
    lora["suffix"] = json!("lora");
    let mut merged = lora.clone();
    merged["fsdp_app"]["merge"] = json!(true);
    merged["suffix"] = json!("merged");
    let (lora_job, merged_job) =
        (post_json(&server.url("/v1/fine_tuning/jobs"), &lora), post_json(&server.url("/v1/fine_tuning/jobs"), &merged));
    let mut lora_models = vec![];
    for job in [&lora_job, &merged_job] {
        let done = wait_for_status(&server, job["id"].as_str().unwrap(), &["succeeded", "failed"], 180);
        assert_eq!(done["status"], "succeeded", "{done}");
        lora_models.push(done["fine_tuned_model"].as_str().unwrap().to_string());
    }
    let lora_dir = data_dir.join("jobs").join(lora_job["id"].as_str().unwrap());
    assert!(lora_dir.join("adapter_model.safetensors").is_file() && !lora_dir.join("merged").exists(), "an adapter only");
    assert!(data_dir.join("jobs").join(merged_job["id"].as_str().unwrap()).join("merged").join("config.json").is_file());
    let lora_lp = first_token_logprob(&server, &lora_models[0]);
    assert!((lora_lp - first_token_logprob(&server, &lora_models[1])).abs() < 1e-4, "adapter over the base vs merged copy");
    assert!((lora_lp - base_lp).abs() > 1e-4, "the LoRA job changed nothing");
    // Its checkpoint is an adapter too, served by its id.
    let ckpts = get_json(&server.url(&format!("/v1/fine_tuning/jobs/{}/checkpoints", lora_job["id"].as_str().unwrap())));
    let ckpt = ckpts["data"][0]["fine_tuned_model_checkpoint"].as_str().unwrap().to_string();
    assert!((first_token_logprob(&server, &ckpt) - lora_lp).abs() < 1e-4, "the final checkpoint is the final adapter");

    // Cancel stops a running job; list pages newest first.
    let mut long = create.clone();
    long["fsdp_app"]["max_steps"] = json!(100000);
    long["hyperparameters"]["n_epochs"] = json!(50);
    let long_job = post_json(&server.url("/v1/fine_tuning/jobs"), &long);
    let long_id = long_job["id"].as_str().unwrap().to_string();
    wait_for_status(&server, &long_id, &["running"], 60);
    let cancelled = post_json(&server.url(&format!("/v1/fine_tuning/jobs/{long_id}/cancel")), &json!({}));
    assert_eq!(cancelled["status"], "cancelled");
    let (s, text, _) = post(&server.url(&format!("/v1/fine_tuning/jobs/{long_id}/cancel")), "{}", None);
    assert_eq!(s, 400, "{text}");
    let page = get_json(&server.url("/v1/fine_tuning/jobs?limit=2"));
    assert_eq!(page["data"][0]["id"], json!(long_id));
    assert_eq!(page["has_more"], true);
    let rest = get_json(&server.url(&format!("/v1/fine_tuning/jobs?limit=2&after={}", page["data"][1]["id"].as_str().unwrap())));
    assert_eq!((rest["data"][0]["id"].clone(), rest["data"][1]["id"].clone()), (lora_job["id"].clone(), json!(job_id)));
    assert_eq!(rest["has_more"], false);

    // Bad creates are 400s naming the field; unknown ids 404.
    for (body, param) in [
        (json!({"model": "tiny"}), "training_file"),
        (json!({"model": "tiny", "training_file": "file-nope"}), "training_file"),
        (json!({"model": "other", "training_file": file_id}), "model"),
        (json!({"model": "tiny", "training_file": file_id, "hyperparameters": {"n_epochs": 0}}), "hyperparameters.n_epochs"),
        (json!({"model": "tiny", "training_file": file_id, "suffix": "a/b"}), "suffix"),
        (json!({"model": "tiny", "training_file": file_id, "fsdp_app": {"lora": {"targets": ["qkv"]}}}), "fsdp_app.lora.targets"),
    ] {
        let (s, text, _) = post(&server.url("/v1/fine_tuning/jobs"), &body.to_string(), None);
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!((s, v["error"]["param"].as_str()), (400, Some(param)), "{text}");
    }
    assert!(matches!(ureq::get(&server.url("/v1/fine_tuning/jobs/ftjob-nope")).call(), Err(ureq::Error::Status(404, _))));

    // A job running when the server dies is marked failed at the next start; files, jobs and
    // fine-tuned models persist.
    let crash_job = post_json(&server.url("/v1/fine_tuning/jobs"), &long);
    let crash_id = crash_job["id"].as_str().unwrap().to_string();
    wait_for_status(&server, &crash_id, &["running"], 60);
    drop(server); // SIGKILL
    let server = Server::start(&model, &["--data-dir", data_dir.to_str().unwrap()]);
    let crashed = get_json(&server.url(&format!("/v1/fine_tuning/jobs/{crash_id}")));
    assert_eq!(crashed["status"], "failed");
    assert_eq!(crashed["error"]["code"], "server_restarted");
    assert_eq!(get_json(&server.url(&format!("/v1/files/{file_id}")))["id"], json!(file_id));
    assert_eq!(get_json(&server.url(&format!("/v1/fine_tuning/jobs/{job_id}")))["status"], "succeeded");
    assert!((first_token_logprob(&server, &ft) - ft_lp).abs() < 1e-5, "the fine-tuned model is served after a restart");
    assert!((first_token_logprob(&server, &lora_models[0]) - lora_lp).abs() < 1e-5, "the LoRA job's adapter is served after a restart");

    // DELETE a fine-tuned model: gone from the list, its files and its answers; never the base.
    let delete = |id: &str| match ureq::delete(&server.url(&format!("/v1/models/{id}"))).call() {
        Ok(r) => (r.status(), r.into_string().unwrap()),
        Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap()),
        Err(e) => panic!("{e}"),
    };
    assert_eq!(delete("tiny").0, 403);
    let (s, text) = delete(&ft);
    assert_eq!(s, 200, "{text}");
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["deleted"], true);
    let models = get_json(&server.url("/v1/models"));
    assert!(!models["data"].as_array().unwrap().iter().any(|m| m["id"] == json!(ft)), "{models}");
    let (s, _, _) =
        post(&server.url("/v1/chat/completions"), &json!({"model": ft, "messages": [{"role": "user", "content": "x"}]}).to_string(), None);
    assert_eq!(s, 404);
    assert_eq!(delete(&ft).0, 404);
    assert!(!data_dir.join("jobs").join(&job_id).exists(), "the model's files are deleted");
}

/// A job that fails at run time says why: the training's own first error (here: no token of
/// the file is trained on), as the job's error and as an event, not "rank 0 exited with code 1".
#[test]
fn a_failed_job_says_why() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let server = Server::start(&model, &[]);
    // Chat rows with no assistant turn train nothing: refused at upload, the line named.
    let rows = b"{\"messages\": [{\"role\": \"user\", \"content\": \"hello\"}, {\"role\": \"assistant\", \"content\": \"hi\"}]}\n{\"messages\": [{\"role\": \"user\", \"content\": \"again\"}]}\n";
    let (s, err) = upload(&server, "user-only.jsonl", rows);
    assert_eq!(s, 400, "{err}");
    let message = err["error"]["message"].as_str().unwrap();
    assert!(message.contains("Line 2") && message.contains("no assistant turn"), "{err}");
    // Token ids outside the vocabulary are refused at upload too (tests/serve_files.rs). What the
    // upload cannot judge fails the job at run time, and the job says why: one row cannot fill a
    // global batch of 4.
    let rows = b"{\"input_ids\": [1, 2, 3, 4], \"labels\": [1, 2, 3, 4]}\n";
    let (s, file) = upload(&server, "one-row.jsonl", rows);
    assert_eq!(s, 200, "{file}");
    // A sequence longer than the model's context is refused, both numbers named.
    let (s, text, _) = post(
        &server.url("/v1/fine_tuning/jobs"),
        &json!({"model": "tiny", "training_file": file["id"], "fsdp_app": {"seq_len": 4096}}).to_string(),
        None,
    );
    assert_eq!(s, 400, "{text}");
    assert!(text.contains("fsdp_app.seq_len") && text.contains("4096") && text.contains("256"), "{text}");
    let job = post_json(
        &server.url("/v1/fine_tuning/jobs"),
        &json!({"model": "tiny", "training_file": file["id"], "hyperparameters": {"batch_size": 4},
        "fsdp_app": {"world_size": 1, "seq_len": 64, "max_steps": 1}}),
    );
    let id = job["id"].as_str().unwrap();
    let done = wait_for_status(&server, id, &["failed", "succeeded"], 120);
    assert_eq!(done["status"], "failed", "{done}");
    let message = done["error"]["message"].as_str().unwrap();
    assert!(message.contains("fewer than one global batch of 4") && !message.contains("exited with"), "{done}");
    let events = get_json(&server.url(&format!("/v1/fine_tuning/jobs/{id}/events")));
    assert!(events["data"].as_array().unwrap().iter().any(|e| e["message"].as_str().unwrap().contains("global batch")), "{events}");
}
