//! Hub downloads for real: a small HTTP server (`common::hub`) serves fixture files under the Hub's
//! URL scheme, and the real hf-hub client inside `fsdp-app` downloads from it through HF_ENDPOINT.

mod common;

use common::hub::*;
use common::*;

#[test]
fn downloads_through_hf_endpoint_then_works_offline_from_the_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let model_dir = fixture("llama", tmp.path());
    let mut files = dir_files(&model_dir);
    // Files a model repo often carries that we must not fetch.
    files.insert("pytorch_model.bin".into(), vec![0u8; 64]);
    files.insert("README.md".into(), b"# tiny".to_vec());
    let server = HubServer::start("acme/tiny-llama", files);
    let hf_home = tmp.path().join("hf-home");
    let hf_home_s = hf_home.to_str().unwrap();
    let endpoint = server.endpoint();
    let args = ["generate", "--model", "acme/tiny-llama", "--prompt", "The quick brown", "--max-new-tokens", "6", "--json"];

    let online = run_cli(&args, &[("HF_ENDPOINT", &endpoint), ("HF_HOME", hf_home_s), ("HF_TOKEN", "hf_test_token")]);
    assert!(online.status.success(), "{}", stderr(&online));
    let out: serde_json::Value = serde_json::from_str(stdout(&online).trim()).unwrap();
    assert_eq!(out["generated_ids"].as_array().unwrap().len(), 6);

    // Only what a model needs was fetched: config, index, the shards it lists, tokenizer files.
    let requested = server.requested_files();
    assert_eq!(
        requested,
        vec![
            "chat_template.jinja", // optional, asked and absent (404)
            "config.json",
            "generation_config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "modules.json",            // optional (sentence-transformers' pooling), absent
            "special_tokens_map.json", // optional, absent
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    );
    // HF_TOKEN travels as a bearer token.
    assert!(server.log.lock().unwrap().iter().all(|(_, auth)| auth.as_deref() == Some("Bearer hf_test_token")));

    // The Python client's cache layout under HF_HOME/hub.
    let repo_cache = hf_home.join("hub").join("models--acme--tiny-llama");
    assert_eq!(std::fs::read_to_string(repo_cache.join("refs").join("main")).unwrap().trim(), COMMIT);
    let snapshot = repo_cache.join("snapshots").join(COMMIT);
    assert!(snapshot.join("config.json").exists());
    assert!(std::fs::read_dir(repo_cache.join("blobs")).unwrap().count() >= 7);

    // Offline, with the server gone: the cache alone is enough, and gives the same tokens.
    drop(server);
    let offline = run_cli(&args, &[("HF_HUB_OFFLINE", "1"), ("HF_HOME", hf_home_s), ("HF_ENDPOINT", "http://127.0.0.1:9")]);
    assert!(offline.status.success(), "{}", stderr(&offline));
    let out2: serde_json::Value = serde_json::from_str(stdout(&offline).trim()).unwrap();
    assert_eq!(out2["generated_ids"], out["generated_ids"]);
    assert!(stderr(&offline).contains("offline"), "{}", stderr(&offline));

    // Offline and not cached: a clear error naming the repo.
    let missing = run_cli(&["generate", "--model", "acme/other", "--prompt", "x"], &[("HF_HUB_OFFLINE", "1"), ("HF_HOME", hf_home_s)]);
    assert!(!missing.status.success());
    let err = stderr(&missing);
    assert!(err.contains("acme/other") && err.contains("HF_HUB_OFFLINE"), "{err}");
}

#[test]
fn hf_hub_cache_overrides_hf_home_and_revision_is_used() {
    let tmp = tempfile::tempdir().unwrap();
    let model_dir = fixture("qwen2", tmp.path());
    let server = HubServer::start("acme/tiny-qwen", dir_files(&model_dir));
    let cache = tmp.path().join("explicit-cache");
    let out = run_cli(
        &["generate", "--model", "acme/tiny-qwen", "--revision", "v1.0", "--prompt", "Hi", "--max-new-tokens", "2"],
        &[
            ("HF_ENDPOINT", &server.endpoint()),
            ("HF_HOME", tmp.path().join("unused").to_str().unwrap()),
            ("HF_HUB_CACHE", cache.to_str().unwrap()),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(server.log.lock().unwrap().iter().all(|(p, _)| p.starts_with("/acme/tiny-qwen/resolve/v1.0/")));
    assert!(cache.join("models--acme--tiny-qwen").join("refs").join("v1.0").exists());
    assert!(!tmp.path().join("unused").exists());
}

#[test]
fn a_repo_with_only_pickle_weights_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model_dir = fixture("qwen2", tmp.path());
    let mut files = dir_files(&model_dir);
    files.remove("model.safetensors");
    files.insert("pytorch_model.bin".into(), vec![0u8; 64]);
    let server = HubServer::start("acme/pickled", files);
    let out = run_cli(
        &["generate", "--model", "acme/pickled", "--prompt", "Hi"],
        &[("HF_ENDPOINT", &server.endpoint()), ("HF_HOME", tmp.path().join("h").to_str().unwrap())],
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("pickle") && err.contains("acme/pickled"), "{err}");
    assert!(!server.requested_files().contains(&"pytorch_model.bin".to_string()));
}

#[test]
fn training_data_comes_from_a_hub_dataset_repo() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let data = std::fs::read(reference_dir().join("train-data.jsonl")).unwrap();
    let server = HubServer::start("datasets/acme/tokens", [("train.jsonl".to_string(), data)].into_iter().collect());
    let hf_home = tmp.path().join("hf");
    let run = |out: &str, env: &[(&str, &str)]| {
        run_cli(
            &[
                "finetune",
                "--model",
                model.to_str().unwrap(),
                "--data",
                "hf://datasets/acme/tokens/train.jsonl",
                "--output-dir",
                tmp.path().join(out).to_str().unwrap(),
                "--seq-len",
                "16",
                "--batch-size",
                "2",
                "--max-steps",
                "2",
                "--world-size",
                "2",
            ],
            env,
        )
    };
    let o = run("a", &[("HF_ENDPOINT", &server.endpoint()), ("HF_HOME", hf_home.to_str().unwrap())]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("data: 48 rows"), "{}", stderr(&o));
    // Downloaded once (by rank 0), into the Python client's dataset cache layout.
    assert_eq!(server.requested_files(), vec!["train.jsonl"]);
    assert!(hf_home.join("hub").join("datasets--acme--tokens").join("refs").join("main").exists());
    drop(server);
    let o = run("b", &[("HF_HUB_OFFLINE", "1"), ("HF_HOME", hf_home.to_str().unwrap())]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = run("c", &[("HF_HUB_OFFLINE", "1"), ("HF_HOME", tmp.path().join("empty").to_str().unwrap())]);
    assert!(!o.status.success() && stderr(&o).contains("train.jsonl"), "{}", stderr(&o));
}

#[test]
fn parquet_chat_data_from_a_hub_dataset_repo_trains_like_its_jsonl_twin() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let data_dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let parquet = std::fs::read(data_dir.join("zephyrix-codename.parquet")).unwrap();
    // The layout `datasets` pushes: data/train-00000-of-00001.parquet.
    let server = HubServer::start("datasets/acme/chat", [("data/train-00000-of-00001.parquet".to_string(), parquet)].into_iter().collect());
    let run = |out: &str, data: &str| {
        let o = run_cli(
            &[
                "finetune",
                "--model",
                model.to_str().unwrap(),
                "--data",
                data,
                "--output-dir",
                tmp.path().join(out).to_str().unwrap(),
                "--seq-len",
                "128",
                "--batch-size",
                "2",
                "--max-steps",
                "2",
                "--world-size",
                "2",
                "--no-shuffle",
            ],
            &[("HF_ENDPOINT", &server.endpoint()), ("HF_HOME", tmp.path().join("hf").to_str().unwrap())],
        );
        assert!(o.status.success(), "{}", stderr(&o));
        (stderr(&o), metric_losses(&tmp.path().join(out)))
    };
    let (log, from_parquet) = run("pq", "hf://datasets/acme/chat/data/train-00000-of-00001.parquet");
    assert!(log.contains("trained-on tokens"), "{log}");
    let (_, from_jsonl) = run("js", data_dir.join("zephyrix-codename.jsonl").to_str().unwrap());
    assert_eq!(from_parquet, from_jsonl, "the same rows give the same run");
}
