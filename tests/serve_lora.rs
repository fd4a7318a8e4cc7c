//! Multi-LoRA serving: PEFT adapters (three written by `finetune --lora`, one by PEFT itself)
//! served over one base by a real server process, mixed in concurrent batches, loaded and
//! unloaded at run time, evicted and read again; each answer equals `generate` on the adapter's
//! merged model (PEFT's: `generate --adapter`), and the server's RSS is printed with 0, 1 and all
//! adapters loaded.

mod common;

use std::path::{Path, PathBuf};

use common::server::{post, Server};
use common::*;
use serde_json::{json, Value};

const PROMPTS: [&str; 2] = ["The quick brown fox", "Once upon a time"];
const TOKENS: &str = "10";

/// Trains a LoRA adapter on the fixture (`--merge-lora` also writes the merged model); returns
/// the adapter's directory.
fn train_adapter(model: &Path, out: &Path, targets: &str, seed: &str) -> PathBuf {
    let data = reference_dir().join("train-data.jsonl");
    let args = [
        "finetune",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--max-steps",
        "3",
        "--lr",
        "5e-2",
        "--lora-r",
        "4",
        "--lora-alpha",
        "8",
        "--lora-targets",
        targets,
        "--seed",
        seed,
        "--merge-lora",
    ];
    let o = run_cli(&args, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    out.to_path_buf()
}

/// Greedy `generate` of `prompt` on `model` (with `adapter` applied, if given).
fn generate(model: &Path, adapter: Option<&Path>, prompt: &str) -> String {
    let mut args = vec![
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        prompt,
        "--max-new-tokens",
        TOKENS,
        "--temperature",
        "0",
        "--json",
    ];
    if let Some(a) = adapter {
        args.extend(["--adapter", a.to_str().unwrap()]);
    }
    let o = run_cli(&args, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_str::<Value>(&stdout(&o)).unwrap()["text"].as_str().unwrap().to_string()
}

fn complete(server: &Server, model: &str, prompt: &str) -> (u16, Value) {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": TOKENS.parse::<u32>().unwrap(), "temperature": 0});
    let (status, text, _) = post(&server.url("/v1/completions"), &body.to_string(), Some("k"));
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

#[test]
fn adapters_share_one_base_in_mixed_batches_and_load_unload_and_evict_at_run_time() {
    let tmp = tempfile::tempdir().unwrap();
    let base = fixture("llama", tmp.path());
    let adapters = tmp.path().join("adapters");
    let a1 = train_adapter(&base, &adapters.join("a1"), "q_proj,v_proj", "1");
    let a2 = train_adapter(&base, &adapters.join("a2"), "all-linear", "2");
    let a3 = train_adapter(&base, &adapters.join("a3"), "o_proj,down_proj", "3");
    let peft = reference_dir().join("lora-llama");

    // What each model answers alone: the base, each merged model, PEFT's adapter applied.
    let mut expected: Vec<(String, &str, String)> = vec![];
    for p in PROMPTS {
        expected.push(("tiny".into(), p, generate(&base, None, p)));
        for (name, dir) in [("a1", &a1), ("a2", &a2), ("a3", &a3)] {
            expected.push((name.into(), p, generate(&dir.join("merged"), None, p)));
        }
        expected.push(("peft".into(), p, generate(&base, Some(&peft), p)));
    }
    let distinct: std::collections::HashSet<&String> = expected.iter().map(|(_, _, t)| t).collect();
    assert!(distinct.len() >= 6, "the adapters hardly change the answers: {expected:?}");

    let (a1_arg, a2_arg, peft_arg) = (format!("a1={}", a1.display()), format!("a2={}", a2.display()), format!("peft={}", peft.display()));
    let server = Server::start(
        &base,
        &[
            "--api-key",
            "k",
            "--lora",
            &a1_arg,
            "--lora",
            &a2_arg,
            "--lora",
            &peft_arg,
            "--lora-dir",
            adapters.to_str().unwrap(),
            "--max-loras",
            "3",
            "--max-concurrent-requests",
            "16",
        ],
    );
    let rss_three = rss_of(server.child.id());

    // a3 at run time (under --lora-dir); anything outside it, or not an adapter, is refused by name.
    let load = |body: Value| post(&server.url("/v1/load_lora_adapter"), &body.to_string(), Some("k"));
    let (status, text, _) = load(json!({"lora_name": "a3", "lora_path": a3.to_str().unwrap()}));
    assert_eq!(status, 200, "{text}");
    let (status, text, _) = load(json!({"lora_name": "x", "lora_path": peft.to_str().unwrap()}));
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("outside --lora-dir"), "{text}");
    let (status, text, _) = load(json!({"lora_name": "x", "lora_path": base.to_str().unwrap()}));
    assert_eq!(status, 400, "{text}");
    std::fs::create_dir_all(adapters.join("empty")).unwrap();
    let (status, text, _) = load(json!({"lora_name": "x", "lora_path": adapters.join("empty").to_str().unwrap()}));
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("adapter_config.json"), "{text}");
    let (status, text, _) = load(json!({"lora_name": "a1", "lora_path": a1.to_str().unwrap()}));
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("already"), "{text}");
    let (status, _, _) = post(&server.url("/v1/load_lora_adapter"), &json!({"lora_name": "y", "lora_path": "a1"}).to_string(), None);
    assert_eq!(status, 401, "run-time loading is behind the API key");

    // A wrong adapter: a rank that does not fit the base is named with the file.
    let bad = adapters.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(a1.join("adapter_config.json")).unwrap()).unwrap();
    cfg["r"] = json!(6);
    std::fs::write(bad.join("adapter_config.json"), cfg.to_string()).unwrap();
    std::fs::copy(a1.join("adapter_model.safetensors"), bad.join("adapter_model.safetensors")).unwrap();
    let (status, text, _) = load(json!({"lora_name": "bad", "lora_path": bad.to_str().unwrap()}));
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("adapter_model.safetensors") && text.contains("wrong shapes"), "{text}");

    let listed = get_json_with_key(&server.url("/v1/models"));
    let ids: Vec<&str> = listed["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["tiny", "a1", "a2", "a3", "peft"], "{listed}");
    assert!(listed["data"].as_array().unwrap()[1..].iter().all(|m| m["parent"] == "tiny"), "{listed}");

    // Every model and prompt at once, several times over: the base and four adapters (one more
    // than --max-loras keeps, so adapters are evicted and read again while others run) in the
    // same decode batches. Each answer equals its model's alone.
    for round in 0..2 {
        std::thread::scope(|s| {
            let handles: Vec<_> = expected
                .iter()
                .map(|(model, prompt, want)| {
                    let server = &server;
                    s.spawn(move || {
                        let (status, c) = complete(server, model, prompt);
                        assert_eq!(status, 200, "{c}");
                        assert_eq!(c["model"], json!(model));
                        assert_eq!(c["choices"][0]["text"].as_str().unwrap(), want, "round {round}: {model} on {prompt:?}");
                    })
                })
                .collect();
            handles.into_iter().for_each(|h| h.join().unwrap());
        });
    }
    let listed = get_json_with_key(&server.url("/v1/models"));
    let loaded = listed["data"].as_array().unwrap().iter().filter(|m| m["lora"]["loaded"] == true).count();
    assert_eq!(loaded, 3, "--max-loras 3 keeps three in memory: {listed}");

    // Unload, then the name is gone (404 model_not_found), and the others still answer.
    let unload = |name: &str| post(&server.url("/v1/unload_lora_adapter"), &json!({"lora_name": name}).to_string(), Some("k"));
    assert_eq!(unload("a2").0, 200);
    let (status, c) = complete(&server, "a2", PROMPTS[0]);
    assert_eq!((status, c["error"]["code"].clone()), (404, json!("model_not_found")), "{c}");
    assert_eq!(unload("a2").0, 404);
    let (status, c) = complete(&server, "a1", PROMPTS[0]);
    assert_eq!(status, 200);
    assert_eq!(c["choices"][0]["text"].as_str().unwrap(), expected.iter().find(|(m, p, _)| m == "a1" && *p == PROMPTS[0]).unwrap().2);

    // Memory: an adapter costs its tensors, not a model. RSS with none, and with them all.
    let bare = Server::start(&base, &["--api-key", "k"]);
    let _ = complete(&bare, "tiny", PROMPTS[0]);
    // Without --lora-dir nothing is loaded at run time.
    let body = json!({"lora_name": "a3", "lora_path": a3.to_str().unwrap()}).to_string();
    let (status, text, _) = post(&bare.url("/v1/load_lora_adapter"), &body, Some("k"));
    assert_eq!(status, 403, "{text}");
    let rss_none = rss_of(bare.child.id());
    let rss_all = rss_of(server.child.id());
    let size = |d: &Path| std::fs::metadata(d.join("adapter_model.safetensors")).unwrap().len();
    let model_bytes = std::fs::metadata(base.join("model-00001-of-00002.safetensors")).unwrap().len()
        + std::fs::metadata(base.join("model-00002-of-00002.safetensors")).unwrap().len();
    eprintln!(
        "RSS: base alone {} KiB; with 3 adapters at start {} KiB; after the mixed rounds (3 of 4 loaded) {} KiB; adapter files {} / {} / {} / {} bytes; base weights {model_bytes} bytes",
        rss_none / 1024,
        rss_three / 1024,
        rss_all / 1024,
        size(&a1),
        size(&a2),
        size(&a3),
        size(&peft)
    );
}

fn get_json_with_key(url: &str) -> Value {
    let r = ureq::get(url).set("Authorization", "Bearer k").call().unwrap();
    serde_json::from_str(&r.into_string().unwrap()).unwrap()
}
