//! GGUF files served with their quantised blocks (`--model FILE.gguf`), in-situ quantisation
//! (`--quantize`), and their quality against llama.cpp's on the same files.
//!
//! Tiny GGUFs of every supported block format (`common::gguf`, written by candle's GGUF writer in
//! llama.cpp's layout) must give the logits of the dense model holding the same (dequantised)
//! weights, up to the activations' 8-bit rounding every quantised kernel does. The real SmolLM2
//! Q4_1 file must generate what llama.cpp generates from it, and the perplexity of every format
//! must be within 1% of llama.cpp's on the same weights, in one window and in windows of 256 (tests/reference/llama-cpp-smollm2.json,
//! made by tests/reference/make_llama_cpp_reference.py with llama-cpp-python 0.3.36).

mod common;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use common::gguf::write_tiny_gguf;
use common::hub::HubServer;
use common::*;
use fsdp_app::model_files::{load_model, resolve_model};

const FORMATS: &[GgmlDType] = &[
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
    GgmlDType::F16,
    GgmlDType::BF16,
    GgmlDType::F32,
];

/// Logits of every position of `ids`, through the cached (serving) path.
fn logits(model: &models::CausalLm, ids: &[u32]) -> Vec<f32> {
    let mut cache = models::KvCache::new(model.config());
    let input = Tensor::new(ids, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let l = model.forward_cached_all(&input, &mut cache, &models::RowAdapters::default()).unwrap();
    l.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[test]
fn every_block_format_gives_the_logits_of_its_dequantised_weights() {
    let Some(smollm2) = smollm2_gguf_or_skip("every_block_format_gives_the_logits_of_its_dequantised_weights") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let ids: Vec<u32> = vec![1, 504, 3458, 282, 4649, 314, 7042, 30, 2, 198, 260, 1234, 42];
    for &format in FORMATS {
        let path = tmp.path().join(format!("tiny-{format:?}.gguf"));
        let reference = write_tiny_gguf(&smollm2, format, &path);
        let loaded = load_model(resolve_model(path.to_str().unwrap(), None).unwrap(), DType::F32, &Device::Cpu).unwrap();
        let dense =
            models::CausalLm::new(&loaded.config, None, candle_nn::VarBuilder::from_tensors(reference, DType::F32, &Device::Cpu)).unwrap();
        let (ours, want) = (logits(&loaded.model, &ids), logits(&dense, &ids));
        let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        let err = ours.iter().zip(&want).fold(0f32, |a, (p, q)| a.max((p - q).abs()));
        // Dense formats compute exactly, but for bf16's prompt products on AMX tiles, which round
        // the activations to bf16; quantised ones round them to 8 bits a block.
        let tolerance = match format {
            GgmlDType::F16 | GgmlDType::F32 => 1e-4,
            GgmlDType::BF16 => 0.01,
            _ => 0.03,
        };
        assert!(scale > 1.0, "{format:?}: logits too small to tell formats apart ({scale})");
        assert!(err <= tolerance * scale, "{format:?}: logits differ by {err} (of {scale})");
    }

    // The CLI runs one: the file's tokenizer and chat template, and what was quantised, said.
    let path = tmp.path().join("tiny-Q4K.gguf");
    let out = run_cli(&["generate", "--model", path.to_str().unwrap(), "--chat", "--prompt", "Hi", "--max-new-tokens", "4", "--json"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    let reference = reference_json("smollm2.json");
    // The chat template of the real file renders the same prompt ids around "Hi" as SmolLM2's.
    assert_eq!(v["prompt_ids"].as_array().unwrap()[..3], reference["cases"][0]["prompt_ids"].as_array().unwrap()[..3]);
    assert!(stderr(&out).contains("15 matrices quantised (15 Q4K)"), "{}", stderr(&out));
    // The K formats on either kernel set, as FSDP_K_BLOCKS says (by default the CPU's choice),
    // said in that line; each generates.
    for (switch, kernels) in [("ours", "our block kernels"), ("candle", "candle's kernels")] {
        let out = run_cli(
            &["generate", "--model", path.to_str().unwrap(), "--prompt", "Hi", "--max-new-tokens", "4", "--json"],
            &[("FSDP_K_BLOCKS", switch)],
        );
        assert!(out.status.success(), "FSDP_K_BLOCKS={switch}: {}", stderr(&out));
        assert!(stderr(&out).contains(&format!("Q4K, Q5K and Q6K on {kernels}")), "FSDP_K_BLOCKS={switch}: {}", stderr(&out));
        let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
        let n = v["generated_ids"].as_array().map_or(0, Vec::len);
        assert!((1..=4).contains(&n), "FSDP_K_BLOCKS={switch}: {v}");
    }

    // Quantised weights compute in f32: another dtype is refused, by name.
    let out = run_cli(&["generate", "--model", path.to_str().unwrap(), "--prompt", "Hi", "--dtype", "f16"], &[]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--dtype") && stderr(&out).contains("stored format"), "{}", stderr(&out));

    // A truncated file is named, not half-loaded.
    let bytes = std::fs::read(&path).unwrap();
    let cut = tmp.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let out = run_cli(&["generate", "--model", cut.to_str().unwrap(), "--prompt", "Hi"], &[]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("cut.gguf"), "{}", stderr(&out));
}

#[test]
fn a_hub_repos_gguf_file_is_downloaded_by_name() {
    let Some(smollm2) = smollm2_gguf_or_skip("a_hub_repos_gguf_file_is_downloaded_by_name") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("tiny.gguf");
    write_tiny_gguf(&smollm2, GgmlDType::Q8_0, &path);
    let files = [("tiny-Q8_0.gguf".to_string(), std::fs::read(&path).unwrap()), ("README.md".to_string(), b"# tiny".to_vec())];
    let server = HubServer::start("acme/tiny-GGUF", files.into_iter().collect());
    let env = [("HF_ENDPOINT", server.endpoint()), ("HF_HOME", tmp.path().join("hf").to_str().unwrap().to_string())];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let args = ["generate", "--model", "acme/tiny-GGUF:tiny-Q8_0.gguf", "--prompt", "Hi", "--max-new-tokens", "3", "--json"];
    let out = run_cli(&args, &env);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(server.requested_files(), vec!["tiny-Q8_0.gguf"]);
    let local = run_cli(&["generate", "--model", path.to_str().unwrap(), "--prompt", "Hi", "--max-new-tokens", "3", "--json"], &[]);
    let ids = |o: &std::process::Output| serde_json::from_str::<serde_json::Value>(stdout(o).trim()).unwrap()["generated_ids"].clone();
    assert_eq!(ids(&out), ids(&local));

    let missing = run_cli(&["generate", "--model", "acme/tiny-GGUF:nope.gguf", "--prompt", "Hi"], &env);
    assert!(!missing.status.success());
    assert!(stderr(&missing).contains("nope.gguf"), "{}", stderr(&missing));
    // A local GGUF name that names no file is said so, not looked for on the Hub.
    let missing = run_cli(&["generate", "--model", "absent.gguf", "--prompt", "Hi"], &env);
    assert!(!missing.status.success());
    assert!(stderr(&missing).contains("absent.gguf: no such GGUF file"), "{}", stderr(&missing));
    assert!(!stderr(&missing).contains("downloading"), "the Hub is not asked: {}", stderr(&missing));
}

/// `fsdp-app perplexity` of the text llama.cpp's reference scored, as JSON.
fn perplexity(model: &str, extra: &[&str]) -> f64 {
    let text = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("data").join("perplexity.txt");
    let out = run_cli(&[&["perplexity", "--model", model, "--file", text.to_str().unwrap()], extra].concat(), &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    v["perplexity"].as_f64().unwrap()
}

#[test]
fn smollm2_formats_match_llama_cpp() {
    let Some(gguf) = smollm2_gguf_or_skip("smollm2_formats_match_llama_cpp") else { return };
    let theirs = reference_json("llama-cpp-smollm2.json");
    let cases = reference_json("smollm2.json")["cases"].as_array().unwrap().clone();
    let near = |fmt: &str, ours: f64| {
        let want = theirs["formats"][fmt]["perplexity"].as_f64().unwrap();
        assert!((ours / want - 1.0).abs() < 0.01, "{fmt}: perplexity {ours} vs llama.cpp's {want}");
    };

    // The shipped Q4_1 file, its blocks as they are: llama.cpp's greedy answers, up to the end or
    // to a near-tie, where the two programs' rounding (llama.cpp keeps an f16 KV cache) may pick
    // differently: there llama.cpp's token must be within 0.25 nats of ours by our own logits.
    let max_new = theirs["new_tokens"].as_u64().unwrap().to_string();
    for (case, want) in cases.iter().zip(theirs["formats"]["q4_1"]["greedy"].as_array().unwrap()) {
        let prompt = case["prompt"].as_str().unwrap();
        let args = [
            "generate",
            "--model",
            gguf.to_str().unwrap(),
            "--chat",
            "--prompt",
            prompt,
            "--max-new-tokens",
            &max_new,
            "--json",
            "--top-logprobs",
            "5",
        ];
        let out = run_cli(&args, &[]);
        assert!(out.status.success(), "{}", stderr(&out));
        let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
        assert_eq!(json_ids(&v["prompt_ids"]), json_ids(&case["prompt_ids"]), "{prompt}: the file's chat template and tokenizer");
        let (mut ours, mut want) = (json_ids(&v["generated_ids"]), json_ids(&want["generated_ids"]));
        // An answer that ended before the cap ended on the end-of-turn token: compare it too,
        // so that ending and going on can be a near-tie like any other pair of tokens.
        let (cap, eos) = (max_new.parse::<usize>().unwrap(), theirs["eos_id"].as_u64().unwrap() as u32);
        for ids in [&mut ours, &mut want] {
            if ids.len() < cap {
                ids.push(eos);
            }
        }
        let agree = ours.iter().zip(&want).take_while(|(a, b)| a == b).count();
        if agree < ours.len().min(want.len()) {
            let at = &v["logprobs"][agree];
            let ours_lp = at["logprob"].as_f64().unwrap();
            let theirs_lp =
                at["top"].as_array().unwrap().iter().find(|e| e[0].as_u64() == Some(want[agree] as u64)).map(|e| e[1].as_f64().unwrap());
            let gap = theirs_lp.map(|lp| ours_lp - lp);
            assert!(gap.is_some_and(|g| g < 0.25), "{prompt}: ours and llama.cpp's greedy ids part at {agree} by {gap:?} nats, not a near-tie\nllama.cpp {want:?}\nours      {ours:?}");
        } else {
            assert_eq!(ours.len(), want.len(), "{prompt}: one stopped early");
        }
    }
    near("q4_1", perplexity(gguf.to_str().unwrap(), &[]));
    // The same text in windows, as `llama-perplexity -c 256` scores a text longer than one context.
    let window = theirs["window"].as_u64().unwrap().to_string();
    let ours = perplexity(gguf.to_str().unwrap(), &["--ctx-size", &window]);
    let want = theirs["formats"]["q4_1"]["window_perplexity"].as_f64().unwrap();
    assert!((ours / want - 1.0).abs() < 0.01, "q4_1 in windows of {window}: perplexity {ours} vs llama.cpp's {want}");

    // Q8_0 quantised at load from the converted f32 weights: the blocks llama.cpp's quantizer
    // writes; f16 and f32 as the converted directory computes them.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("smollm2-f32");
    let conv = run_cli(&["convert", "--gguf", gguf.to_str().unwrap(), "--out", dir.to_str().unwrap(), "--dtype", "f32"], &[]);
    assert!(conv.status.success(), "{}", stderr(&conv));
    let dir = dir.to_str().unwrap();
    near("q8_0", perplexity(dir, &["--quantize", "q8_0"]));
    near("f16", perplexity(dir, &["--dtype", "f16"]));
    near("f32", perplexity(dir, &[]));
}

/// Fine-tuning from a GGUF file trains its weights dequantised to f32 (as transformers
/// dequantises a GGUF it loads to train): the same losses as from the directory `convert` makes
/// of it, the dequantised copy written once into the cache, and a LoRA adapter trained on the
/// file that `generate` then runs over the file's quantised blocks.
#[test]
fn a_gguf_model_fine_tunes_from_its_dequantised_weights() {
    let Some(smollm2) = smollm2_gguf_or_skip("a_gguf_model_fine_tunes_from_its_dequantised_weights") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("tiny-Q8_0.gguf");
    write_tiny_gguf(&smollm2, GgmlDType::Q8_0, &gguf);
    let cache = tmp.path().join("cache");
    let env = [("XDG_CACHE_HOME", cache.to_str().unwrap())];
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("reference").join("train-data.jsonl");
    let finetune = |model: &std::path::Path, out: &str, extra: &[&str]| {
        let out = tmp.path().join(out);
        let mut args = vec!["finetune", "--model", model.to_str().unwrap(), "--data", data.to_str().unwrap()];
        args.extend(["--output-dir", out.to_str().unwrap(), "--max-steps", "3", "--seq-len", "32", "--lr", "1e-3", "--no-shuffle"]);
        args.extend(extra);
        let o = run_cli(&args, &env);
        assert!(o.status.success(), "{}", stderr(&o));
        let losses: Vec<f64> = std::fs::read_to_string(out.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap())
            .collect();
        (o, losses)
    };

    let (first, from_gguf) = finetune(&gguf, "from-gguf", &[]);
    assert!(stderr(&first).contains("dequantising to f32 safetensors for training (once)"), "{}", stderr(&first));
    let converted = tmp.path().join("converted");
    let conv = run_cli(&["convert", "--gguf", gguf.to_str().unwrap(), "--out", converted.to_str().unwrap(), "--dtype", "f32"], &[]);
    assert!(conv.status.success(), "{}", stderr(&conv));
    let (_, from_dir) = finetune(&converted, "from-dir", &[]);
    assert_eq!(from_gguf.len(), 3);
    assert_eq!(from_gguf, from_dir, "the GGUF trains as its converted directory does");
    assert!(from_gguf[2] < from_gguf[0], "the loss falls: {from_gguf:?}");

    // The second run reads the cached copy; a LoRA adapter trained on the file runs over it.
    let (again, _) = finetune(&gguf, "lora", &["--lora"]);
    assert!(!stderr(&again).contains("dequantising"), "{}", stderr(&again));
    let adapter = tmp.path().join("lora");
    let args =
        ["generate", "--model", gguf.to_str().unwrap(), "--adapter", adapter.to_str().unwrap(), "--prompt", "Hi", "--max-new-tokens", "3"];
    let gen = run_cli(&args, &env);
    assert!(gen.status.success(), "{}", stderr(&gen));

    // `estimate` reads the file's config from its metadata.
    let est = run_cli(&["estimate", "--model", gguf.to_str().unwrap(), "--json"], &env);
    assert!(est.status.success(), "{}", stderr(&est));
}
