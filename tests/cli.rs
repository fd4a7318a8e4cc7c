//! The command line as a user meets it: help, generate's streaming and JSON output, stop strings,
//! and one clear error line (naming the file) for every kind of bad input.

mod common;

use std::path::Path;

use common::*;

fn assert_clean_error(out: &std::process::Output, must_contain: &[&str]) {
    assert!(!out.status.success(), "expected failure, got success: {}", stdout(out));
    let err = stderr(out);
    assert!(!err.contains("panicked") && !err.contains("Stack backtrace"), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one error line expected, got:\n{err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    for s in must_contain {
        assert!(err.contains(s), "error should mention {s:?}: {err}");
    }
}

fn gen(dir: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["generate", "--model", dir.to_str().unwrap(), "--prompt", "The quick brown"];
    args.extend_from_slice(extra);
    run_cli(&args, &[])
}

#[test]
fn help_lists_exactly_the_working_subcommands() {
    let out = run_cli(&["--help"], &[]);
    assert!(out.status.success());
    let text = stdout(&out);
    let listed: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(listed, vec!["generate", "perplexity", "convert", "finetune", "merge", "launch", "fixture", "serve", "estimate", "help"]);
    for sub in ["generate", "perplexity", "convert", "finetune", "merge", "launch", "fixture", "serve", "estimate"] {
        let h = run_cli(&[sub, "--help"], &[]);
        assert!(h.status.success());
        assert!(stdout(&h).contains("Usage: fsdp-app"), "{sub}");
    }
    assert!(stdout(&run_cli(&["generate", "--help"], &[])).contains("--repetition-penalty"));
}

#[test]
fn streamed_text_equals_json_text_and_figures_are_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture("llama", tmp.path());
    let streamed = gen(&dir, &["--max-new-tokens", "12"]);
    assert!(streamed.status.success(), "{}", stderr(&streamed));
    let report = stderr(&streamed);
    for field in ["prompt tokens:", "generated tokens: 12", "time to first token:", "tokens/s", "peak RSS:"] {
        assert!(report.contains(field), "missing {field}: {report}");
    }
    let json = gen(&dir, &["--max-new-tokens", "12", "--json"]);
    assert!(json.status.success());
    let v: serde_json::Value = serde_json::from_str(stdout(&json).trim()).unwrap();
    assert_eq!(stdout(&streamed).trim_end_matches('\n'), v["text"].as_str().unwrap());
    assert_eq!(v["finish_reason"], "length");
    assert_eq!(v["generated_ids"].as_array().unwrap().len(), 12);
    assert!(v["prompt_ids"].as_array().unwrap().len() >= 2);
    assert!(v["peak_rss_bytes"].as_u64().unwrap() > 0);
    assert!(v["decode_tokens_per_s"].as_f64().unwrap() > 0.0);

    // A stop string cut out of the middle of that text ends generation there, with reason "stop".
    let text = v["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let stopped = gen(&dir, &["--max-new-tokens", "12", "--json", "--stop", &stop]);
    let s: serde_json::Value = serde_json::from_str(stdout(&stopped).trim()).unwrap();
    assert_eq!(s["finish_reason"], "stop");
    assert_eq!(s["text"].as_str().unwrap(), &text[..text.find(&stop).unwrap()]);

    // Sampling with a seed is reproducible; chat mode renders the template.
    let a = gen(&dir, &["--max-new-tokens", "8", "--json", "--temperature", "0.9", "--top-p", "0.9", "--top-k", "40", "--seed", "7"]);
    let b = gen(&dir, &["--max-new-tokens", "8", "--json", "--temperature", "0.9", "--top-p", "0.9", "--top-k", "40", "--seed", "7"]);
    let ids = |o: &std::process::Output| serde_json::from_str::<serde_json::Value>(stdout(o).trim()).unwrap()["generated_ids"].clone();
    assert_eq!(ids(&a), ids(&b));
    assert_ne!(ids(&a), serde_json::json!(v["generated_ids"].as_array().unwrap()[..8]), "sampling should differ from greedy");
    let chat = gen(&dir, &["--chat", "--system", "Be brief.", "--max-new-tokens", "3", "--json"]);
    assert!(chat.status.success(), "{}", stderr(&chat));
    // --chat-template: this template writes the user's text alone, so the prompt is the plain one.
    let own = gen(&dir, &["--chat", "--chat-template", "{{ messages[-1].content }}", "--max-new-tokens", "1", "--json"]);
    let plain = gen(&dir, &["--max-new-tokens", "1", "--json"]);
    let prompt = |o: &std::process::Output| serde_json::from_str::<serde_json::Value>(stdout(o).trim()).unwrap()["prompt_ids"].clone();
    assert_eq!(prompt(&own), prompt(&plain), "{}", stderr(&own));
    assert_ne!(prompt(&own), prompt(&chat));
}

#[test]
fn bad_sampling_values_are_rejected_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture("qwen2", tmp.path());
    assert_clean_error(&gen(&dir, &["--top-p", "1.5"]), &["--top-p"]);
    assert_clean_error(&gen(&dir, &["--temperature=-1"]), &["--temperature"]);
    assert_clean_error(&gen(&dir, &["--dtype", "f64"]), &["--dtype"]);
}

#[test]
fn bad_model_directories_give_one_clear_line_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();

    // Missing directory.
    assert_clean_error(&gen(&root.join("nope"), &[]), &["nope", "does not exist"]);

    // Missing config field.
    let d = fixture("qwen2", &root.join("a"));
    let cfg = d.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("hidden_size");
    std::fs::write(&cfg, v.to_string()).unwrap();
    assert_clean_error(&gen(&d, &[]), &["config.json", "hidden_size"]);

    // Unsupported architecture lists the supported ones.
    v["hidden_size"] = 64.into();
    v["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
    std::fs::write(&cfg, v.to_string()).unwrap();
    assert_clean_error(&gen(&d, &[]), &["GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3ForCausalLM"]);

    // Corrupt safetensors header.
    let d = fixture("qwen2", &root.join("b"));
    corrupt_header(&d.join("model.safetensors"));
    assert_clean_error(&gen(&d, &[]), &["model.safetensors", "not a valid safetensors"]);

    // Truncated data.
    let d = fixture("qwen2", &root.join("c"));
    let w = d.join("model.safetensors");
    let bytes = std::fs::read(&w).unwrap();
    std::fs::write(&w, &bytes[..bytes.len() - 100]).unwrap();
    assert_clean_error(&gen(&d, &[]), &["model.safetensors", "not a valid safetensors"]);

    // Missing tokenizer.
    let d = fixture("qwen2", &root.join("d"));
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    assert_clean_error(&gen(&d, &[]), &["tokenizer.json"]);

    // Mis-shaped tensors are named, with both shapes.
    let d = fixture("qwen2", &root.join("e"));
    let cfg = d.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v["vocab_size"] = 100.into();
    std::fs::write(&cfg, v.to_string()).unwrap();
    assert_clean_error(&gen(&d, &[]), &["model.embed_tokens.weight", "[384, 64]", "[100, 64]"]);

    // Missing and unexpected tensors are listed by name.
    let d = fixture("llama", &root.join("f"));
    let idx = d.join("model.safetensors.index.json");
    std::fs::remove_file(d.join("model-00002-of-00002.safetensors")).unwrap();
    assert_clean_error(&gen(&d, &[]), &["model.safetensors.index.json", "model-00002-of-00002.safetensors", "missing"]);
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&idx).unwrap()).unwrap();
    v["weight_map"].as_object_mut().unwrap().retain(|_, f| f == "model-00001-of-00002.safetensors");
    std::fs::write(&idx, v.to_string()).unwrap();
    assert_clean_error(&gen(&d, &[]), &["missing tensors", "model.layers.1.input_layernorm.weight", "(and 3 more)"]);

    // Pickle-only directory: refused with the reason and the way out.
    let p = root.join("pickled");
    std::fs::create_dir_all(&p).unwrap();
    std::fs::copy(fixture("qwen3", &root.join("g")).join("config.json"), p.join("config.json")).unwrap();
    std::fs::write(p.join("pytorch_model.bin"), b"not really").unwrap();
    assert_clean_error(&gen(&p, &[]), &["pytorch_model.bin", "arbitrary code", "safetensors"]);
}

#[test]
fn tokenizer_larger_than_the_vocabulary_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let d = fixture("qwen2", tmp.path());
    // Swap in a tokenizer with more tokens than the model has embedding rows.
    let tok_path = d.join("tokenizer.json");
    let mut tok: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&tok_path).unwrap()).unwrap();
    let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
    for i in 0..100 {
        let id = 384 + i;
        vocab.insert(format!("extra{i}"), id.into());
    }
    std::fs::write(&tok_path, tok.to_string()).unwrap();
    let out = gen(&d, &[]);
    assert_clean_error(&out, &["tokenizer.json", "484 tokens", "vocab_size is 384"]);
}

#[test]
fn convert_refuses_what_is_not_gguf_and_leaves_nothing_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let bogus = tmp.path().join("bogus.gguf");
    std::fs::write(&bogus, b"definitely not gguf").unwrap();
    let out_dir = tmp.path().join("out");
    let out = run_cli(&["convert", "--gguf", bogus.to_str().unwrap(), "--out", out_dir.to_str().unwrap()], &[]);
    assert_clean_error(&out, &["bogus.gguf", "not a valid GGUF"]);
    assert!(!out_dir.exists());
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers.len(), 1, "{leftovers:?}");
    let missing = run_cli(&["convert", "--gguf", "/nonexistent/x.gguf", "--out", out_dir.to_str().unwrap()], &[]);
    assert_clean_error(&missing, &["/nonexistent/x.gguf"]);
}

/// A build without CUDA (the default, and CI's) says how to get a GPU build, names the flag,
/// and writes nothing; a bad --device value is named before anything runs.
#[cfg(not(feature = "cuda"))]
/// A bad `FSDP_MATMUL`, `FSDP_SIMD` or `FSDP_K_BLOCKS` is refused before any work, by name and with the values
/// it takes, in one line even with RUST_BACKTRACE=1 set (as many users have), and nothing is
/// written.
#[test]
fn a_bad_kernel_setting_is_refused_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model");
    let settings = [
        ("FSDP_MATMUL", "blas", "`gemm` or `packed`"),
        ("FSDP_SIMD", "avx-512", "`avx2` or `scalar`"),
        ("FSDP_K_BLOCKS", "ggml", "`ours` or `candle`"),
    ];
    for (var, value, takes) in settings {
        let o = run_cli(&["fixture", "--name", "llama", "--out", out.to_str().unwrap()], &[(var, value), ("RUST_BACKTRACE", "1")]);
        assert_clean_error(&o, &[var, value, takes]);
        assert!(!out.exists(), "the fixture was written despite {var}={value}");
    }
}

#[test]
fn gpu_flags_on_a_cpu_build_give_one_clear_line() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture("llama", tmp.path());
    let data = reference_dir().join("train-data.jsonl");
    let out_dir = tmp.path().join("out");
    let finetune = |extra: &[&str]| {
        let mut args = vec!["finetune", "--model", dir.to_str().unwrap(), "--data", data.to_str().unwrap()];
        args.extend_from_slice(&["--output-dir", out_dir.to_str().unwrap(), "--seq-len", "16", "--max-steps", "1"]);
        args.extend_from_slice(extra);
        run_cli(&args, &[])
    };
    assert_clean_error(&finetune(&["--device", "cuda"]), &["--device cuda:0", "built without CUDA", "tests/gpu/build-cuda.sh"]);
    assert_clean_error(&finetune(&["--device", "cuda", "--backend", "nccl"]), &["--backend nccl", "tests/gpu/build-cuda.sh"]);
    assert_clean_error(&finetune(&["--device", "tpu"]), &["--device \"tpu\"", "cpu, cuda or cuda:N"]);
    assert!(!out_dir.exists() || std::fs::read_dir(&out_dir).unwrap().next().is_none(), "a failed start left files behind");
    assert_clean_error(&gen(&dir, &["--device", "cuda:1"]), &["--device cuda:1", "built without CUDA"]);
    let data_dir = tmp.path().join("serve-data");
    let serve = run_cli(
        &["serve", "--model", dir.to_str().unwrap(), "--port", "0", "--data-dir", data_dir.to_str().unwrap(), "--device", "cuda"],
        &[],
    );
    assert_clean_error(&serve, &["--device cuda:0", "built without CUDA"]);
}

/// The CPU kernels pick AVX-512, AVX2 or plain code at run time; `FSDP_SIMD` forces a lower
/// level. Every level this machine has generates the same greedy tokens (decoding takes the
/// matrix-vector kernel at every step).
#[test]
fn every_simd_level_generates_the_same_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture("llama", tmp.path());
    let ids = |level: &str| {
        let o = run_cli(
            &[
                "generate",
                "--model",
                dir.to_str().unwrap(),
                "--prompt",
                "The quick brown fox",
                "--max-new-tokens",
                "24",
                "--temperature",
                "0",
                "--json",
            ],
            &[("FSDP_SIMD", level)],
        );
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
        v["generated_ids"].clone()
    };
    let best = ids("best");
    assert_eq!(best.as_array().map(Vec::len), Some(24));
    for level in ["avx2", "scalar"] {
        assert_eq!(ids(level), best, "FSDP_SIMD={level}");
    }
}

/// Training at every level this machine has: the matrix products then run gemm's AVX-512, AVX2
/// or plain kernels (`ops::matmul`) and our own ops the same level's code; the losses of
/// a few steps agree to rounding with those of the best level.
#[test]
fn every_simd_level_trains_to_the_same_losses() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture("llama", tmp.path());
    let data = tmp.path().join("rows.jsonl");
    let rows: Vec<String> = (0..8)
        .map(|i| serde_json::json!({ "input_ids": (0..48).map(|j| (i * 5 + j * 3) % 60).collect::<Vec<u32>>() }).to_string())
        .collect();
    std::fs::write(&data, rows.join("\n")).unwrap();
    let losses = |(var, level): (&str, &str)| {
        let out = tmp.path().join(format!("out-{var}-{level}"));
        let o = run_cli(
            &[
                "finetune",
                "--model",
                dir.to_str().unwrap(),
                "--data",
                data.to_str().unwrap(),
                "--output-dir",
                out.to_str().unwrap(),
                "--batch-size",
                "2",
                "--max-steps",
                "3",
                "--lr",
                "1e-3",
            ],
            &[(var, level)],
        );
        assert!(o.status.success(), "{var}={level}: {}", stderr(&o));
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        metrics.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["loss"].as_f64()).collect::<Vec<f64>>()
    };
    let best = losses(("FSDP_SIMD", "best"));
    assert_eq!(best.len(), 3, "{best:?}");
    // The lower levels, then the best level's products on each set of kernels (`FSDP_MATMUL`:
    // on an AVX-512 machine, gemm's and our packed driver's AVX-512 tile).
    for setting in [("FSDP_SIMD", "avx2"), ("FSDP_SIMD", "scalar"), ("FSDP_MATMUL", "gemm"), ("FSDP_MATMUL", "packed")] {
        let got = losses(setting);
        assert_eq!(got.len(), best.len());
        for (step, (a, b)) in got.iter().zip(&best).enumerate() {
            assert!(((a - b) / b).abs() < 1e-5, "{}={}, step {}: loss {a} vs {b}", setting.0, setting.1, step + 1);
        }
    }
}

/// A process held to fewer CPUs than the machine has (taskset here; numactl, a Slurm or MPI
/// binding, a container's cpuset alike) runs one thread per CPU it may use: candle alone counts
/// the machine's cores and puts them all on the allowed ones, where they take turns (a 16-core
/// Xeon pinned to 2 ran a step 8x slower). Rank processes a launcher starts on the machine share
/// those CPUs. The settings line says how many threads ran.
#[test]
fn finetune_runs_one_thread_per_cpu_it_may_use() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture("llama", tmp.path());
    let data = reference_dir().join("train-data.jsonl");
    // The thread counts on the settings lines of `taskset -c <cpus> fsdp-app <launch>finetune`.
    let threads = |cpus: &str, launch: &[&str]| -> Vec<usize> {
        let out = tmp.path().join(format!("out-{cpus}-{}", launch.join(" ")));
        let finetune =
            ["finetune", "--model", dir.to_str().unwrap(), "--data", data.to_str().unwrap(), "--output-dir", out.to_str().unwrap()];
        let o = std::process::Command::new("taskset")
            .args(["-c", cpus])
            .arg(bin())
            .args(launch)
            .args(finetune)
            .args(["--max-steps", "1"])
            .env_remove("RAYON_NUM_THREADS")
            .env_remove("CANDLE_NUM_THREADS")
            .output()
            .expect("taskset (util-linux)");
        let err = stderr(&o);
        assert!(o.status.success(), "{err}");
        let counts: Vec<usize> = err
            .lines()
            .filter(|l| l.contains("settings:"))
            .map(|l| {
                l.split("device cpu (")
                    .nth(1)
                    .and_then(|s| s.split(' ').next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_else(|| panic!("{l}"))
            })
            .collect();
        assert!(!counts.is_empty(), "no settings line:\n{err}");
        counts
    };
    assert_eq!(threads("0", &[]), [1], "pinned to one CPU");
    if std::thread::available_parallelism().unwrap().get() < 2 {
        return skip_or_fail("finetune_runs_one_thread_per_cpu_it_may_use", "two launched ranks on two CPUs need a machine with two");
    }
    // Two ranks on two CPUs take one each (rank 0 prints the settings line); a lone rank both.
    assert_eq!(threads("0,1", &["launch", "--nproc-per-node", "2", "--"]), [1], "two ranks on two CPUs");
    assert_eq!(threads("0,1", &["launch", "--nproc-per-node", "1", "--"]), [2], "one rank on two CPUs");
}

#[test]
fn perplexity_scores_long_texts_in_windows_and_names_a_bad_window() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let write = |name: &str, words: usize| {
        let path = tmp.path().join(name);
        std::fs::write(&path, (0..words).map(|i| format!("word{} ", i % 37)).collect::<String>()).unwrap();
        path
    };
    let (short, long) = (write("short.txt", 20), write("long.txt", 400));
    let score = |text: &Path, extra: &[&str]| {
        run_cli(&[&["perplexity", "--model", model.to_str().unwrap(), "--file", text.to_str().unwrap()], extra].concat(), &[])
    };
    let json = |o: &std::process::Output| -> serde_json::Value {
        assert!(o.status.success(), "{}", stderr(o));
        serde_json::from_str(stdout(o).trim()).unwrap()
    };
    let whole = json(&score(&short, &[]));
    assert_eq!(
        (whole["windows"].as_u64(), whole["ctx_size"].as_u64()),
        (Some(1), None),
        "a text within the context is one window: {whole}"
    );
    // Longer than the fixture's context of 256: windows of the context, unasked.
    let default = json(&score(&long, &[]));
    let per_context = default["windows"].as_u64().unwrap();
    assert!(per_context >= 2 && default["ctx_size"] == 256 && default["scored_tokens"].as_u64() == Some(per_context * 127), "{default}");
    let windowed = json(&score(&long, &["--ctx-size", "64"]));
    let windows = windowed["windows"].as_u64().unwrap();
    assert!(windows >= 4 * per_context && windows < 4 * (per_context + 1), "{windowed} beside {default}");
    assert_eq!(windowed["scored_tokens"].as_u64(), Some(windows * 31), "the second half of each window: {windowed}");
    assert!(windowed["perplexity"].as_f64().unwrap().is_finite());
    assert_clean_error(&score(&long, &["--ctx-size", "2"]), &["--ctx-size 2"]);
    assert_clean_error(&score(&short, &["--ctx-size", "64"]), &["--ctx-size 64", "two windows"]);
}
