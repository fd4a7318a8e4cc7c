//! The web pages in real headless Chromium: `tests/web/browser_test.mjs` (playwright-core,
//! installed by npm into target/web-test on first use) drives Debian's chromium against a running
//! server. Without chromium or npm it fails under CI=true and skips (counted) elsewhere;
//! .ci/run installs both.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::*;

fn chromium() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("CHROMIUM") {
        return Ok(p.into());
    }
    for p in ["/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"] {
        if Path::new(p).is_file() {
            return Ok(p.into());
        }
    }
    Err("no chromium (apt-get install chromium, or set CHROMIUM)".into())
}

/// target/web-test with playwright-core installed (once: the tests of this file run in
/// parallel, and two npm installs into one directory fail).
fn playwright() -> Result<PathBuf, String> {
    static INSTALL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = INSTALL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target").join("web-test");
    if dir.join("node_modules").join("playwright-core").is_dir() {
        return Ok(dir);
    }
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let o = Command::new("npm")
        .args(["install", "--silent", "--no-audit", "--no-fund", "--prefix"])
        .arg(&dir)
        .arg("playwright-core@1")
        .output()
        .map_err(|e| format!("npm: {e}"))?;
    if !o.status.success() {
        return Err(format!("npm install playwright-core failed: {}", String::from_utf8_lossy(&o.stderr).trim()));
    }
    Ok(dir)
}

/// Runs `script` (a copy next to the installed playwright-core, which ES modules resolve from
/// the script's own directory) with `env`; its output, asserting it passed.
fn run_browser_script(modules: &Path, script: &str, env: &[(&str, String)], passed: &str) {
    let copy = modules.join(script);
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("web").join(script), &copy).unwrap();
    let out = Command::new("node").arg(&copy).envs(env.iter().map(|(k, v)| (*k, v.as_str()))).output().unwrap();
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && log.contains(passed), "{log}");
}

/// A reasoning model on the chat page: `tests/web/thinking_test.mjs` against a model our
/// `finetune` taught to think (tests/common/reasoning.rs).
#[test]
fn a_reasoning_models_thinking_is_folded_apart_from_its_answer() {
    let (browser, modules) = match (chromium(), playwright()) {
        (Ok(b), Ok(m)) => (b, m),
        (Err(why), _) | (_, Err(why)) => return skip_or_fail("a_reasoning_models_thinking_is_folded_apart_from_its_answer", &why),
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = reasoning::thinking_model(tmp.path());
    let server = server::Server::start(&model, &[]);
    let env = [
        ("BASE", server.url("")),
        ("CHROMIUM", browser.to_string_lossy().to_string()),
        ("THINKING", reasoning::THINKING.to_string()),
        ("ANSWER", reasoning::ANSWER.to_string()),
    ];
    run_browser_script(&modules, "thinking_test.mjs", &env, "browser: thinking checks passed");
}

#[test]
fn the_pages_chat_and_fine_tune_in_headless_chromium() {
    let (browser, modules) = match (chromium(), playwright()) {
        (Ok(b), Ok(m)) => (b, m),
        (Err(why), _) | (_, Err(why)) => return skip_or_fail("the_pages_chat_and_fine_tune_in_headless_chromium", &why),
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let data = tmp.path().join("data");
    // A LoRA adapter served beside the base, for the model picker.
    let adapter = tmp.path().join("adapter");
    let train = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/zephyrix-codename.jsonl");
    let o = run_cli(
        &["finetune", "--model", model.to_str().unwrap(), "--data", train.to_str().unwrap(), "--output-dir", adapter.to_str().unwrap()]
            .into_iter()
            .chain(["--seq-len", "160", "--batch-size", "2", "--max-steps", "1", "--lora"])
            .collect::<Vec<_>>(),
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let lora = format!("web-lora={}", adapter.display());
    let mut server = Command::new(bin())
        .args([
            "serve",
            "--model",
            model.to_str().unwrap(),
            "--port",
            "0",
            "--served-model-name",
            "tiny",
            "--api-key",
            "web-key",
            "--lora",
            &lora,
            "--data-dir",
        ])
        .arg(&data)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(server.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("listening on http://") {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "the server did not start");
    }
    std::thread::spawn(move || for _ in err.lines() {});
    let addr = line.split("http://").nth(1).unwrap().split_whitespace().next().unwrap().to_string();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let env = [
        ("BASE", format!("http://{addr}")),
        ("KEY", "web-key".to_string()),
        ("CHROMIUM", browser.to_string_lossy().to_string()),
        ("TRAIN_FILE", repo.join("tests/data/zephyrix-codename.jsonl").to_string_lossy().to_string()),
        ("PREFERENCE_FILE", repo.join("tests/data/zephyrix-preferences.jsonl").to_string_lossy().to_string()),
        ("PROMPT_FILE", repo.join("tests/data/sums.jsonl").to_string_lossy().to_string()),
    ];
    let passed = std::panic::catch_unwind(|| run_browser_script(&modules, "browser_test.mjs", &env, "browser: all checks passed"));
    let _ = server.kill();
    let _ = server.wait();
    if let Err(e) = passed {
        std::panic::resume_unwind(e);
    }
}
