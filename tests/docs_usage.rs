//! The docs' examples run as written. Every command of the `sh` blocks of the command and API
//! pages ([`PAGES`], in that order) runs with bash, unchanged, in a scratch directory laid out as
//! the examples assume (train.jsonl, chat.jsonl, chat.parquet, pairs.jsonl, configs/, ./my-model,
//! model.gguf, target/smollm2-hf), with this build as `fsdp-app` on PATH; a docs page with an
//! `fsdp-app` or `curl` example that is not in [`PAGES`] fails the test.
//!
//! What the test sets around the commands, never in them:
//! - HF_ENDPOINT points at a local Hub (`common::hub`) that holds a tiny model under the id the
//!   Hub example names (the Hub itself is not reachable here);
//! - Open MPI's switches for running as root and more ranks than cores (CI's machine);
//! - the server example runs in the background until the curl examples have been sent to it;
//! - the one edit: the jobs example's placeholder `file-...` becomes the id the upload returned.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::hub::{dir_files, HubServer};
use common::*;
use serde_json::Value;

/// The pages whose examples run, in the order they run: models.md's `fixture` makes the
/// ./tiny-llama the fine-tuning examples train, serve.md's server answers the pages after it.
const PAGES: [&str; 8] =
    ["models.md", "generate.md", "finetune.md", "grpo.md", "serve.md", "responses.md", "anthropic.md", "fine-tuning-jobs.md"];

/// Pages whose examples need what CI's machine lacks (a GPU); docs/gpu.md says how to run them.
const NOT_RUN: [&str; 1] = ["gpu.md"];

fn docs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("docs")
}

/// The `sh` blocks of a markdown page.
fn sh_blocks(page: &str) -> Vec<&str> {
    page.split("```").skip(1).step_by(2).filter_map(|b| b.strip_prefix("sh\n")).collect()
}

/// The commands of the pages' `sh` blocks, each continuation (`\` or an open quote) joined.
fn usage_commands() -> Vec<String> {
    let mut commands = vec![];
    for name in PAGES {
        let page = std::fs::read_to_string(docs_dir().join(name)).unwrap_or_else(|e| panic!("docs/{name}: {e}"));
        let blocks = sh_blocks(&page);
        assert!(!blocks.is_empty(), "docs/{name} has no sh block of examples");
        for block in blocks {
            let mut pending = String::new();
            for line in block.lines() {
                let line = line.trim_end();
                if pending.is_empty() && (line.trim().is_empty() || line.trim_start().starts_with('#')) {
                    continue;
                }
                pending.push_str(line);
                pending.push('\n');
                if line.ends_with('\\') || !is_complete(&pending) {
                    continue;
                }
                commands.push(std::mem::take(&mut pending));
            }
            assert!(pending.is_empty(), "docs/{name}: a block ends inside a command: {pending}");
        }
    }
    commands
}

/// Every docs page with an example of ours is one the test runs.
#[test]
fn every_page_with_examples_is_run() {
    for entry in std::fs::read_dir(docs_dir()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        let page = std::fs::read_to_string(&path).unwrap();
        let ours = |l: &str| l.starts_with("fsdp-app ") || l.starts_with("curl ");
        let has_examples = sh_blocks(&page).iter().any(|b| b.lines().any(ours));
        assert!(
            !has_examples || PAGES.contains(&name.as_str()) || NOT_RUN.contains(&name.as_str()),
            "docs/{name} has examples that tests/docs_usage.rs does not run"
        );
    }
}

/// Whether bash parses `text` as complete commands (no open quote).
fn is_complete(text: &str) -> bool {
    Command::new("bash").args(["-n", "-c", text]).stderr(Stdio::null()).status().expect("bash").success()
}

/// The scratch directory the examples run in.
struct Scratch {
    dir: PathBuf,
    path_var: String,
    hub: String,
}

impl Scratch {
    fn bash(&self, command: &str) -> Command {
        let mut c = Command::new("bash");
        c.args(["-c", command]).current_dir(&self.dir).env("PATH", &self.path_var).env("HF_ENDPOINT", &self.hub);
        c.env("HF_HOME", self.dir.join("hf-home")).env_remove("HF_HUB_OFFLINE").env_remove("HF_TOKEN").env_remove("RUST_BACKTRACE");
        c.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        c.env("OMPI_MCA_rmaps_base_oversubscribe", "1");
        c
    }

    fn run(&self, command: &str) -> Output {
        let started = Instant::now();
        let o = self.bash(command).output().expect("bash");
        eprintln!("{:5.1} s  {}", started.elapsed().as_secs_f64(), command.trim());
        assert!(
            o.status.success(),
            "the docs' example failed ({}):\n{command}\nstderr:\n{}\nstdout:\n{}",
            o.status,
            stderr(&o),
            stdout(&o)
        );
        o
    }
}

/// The server example, stopped with SIGTERM (as a process manager would) when the test ends.
struct Background(Child);

impl Drop for Background {
    fn drop(&mut self) {
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.0.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn json_of(o: &Output, command: &str) -> Value {
    serde_json::from_str(stdout(o).trim()).unwrap_or_else(|e| panic!("{command}: not JSON ({e}): {}", stdout(o)))
}

#[test]
fn every_usage_example_in_the_docs_runs_as_written() {
    const TEST: &str = "every_usage_example_in_the_docs_runs_as_written";
    let Some(gguf) = smollm2_gguf_or_skip(TEST) else { return };
    let commands = usage_commands();
    let needs_mpi = commands.iter().any(|c| c.starts_with("mpirun"));
    if needs_mpi && !cfg!(feature = "mpi") {
        return skip_or_fail(TEST, "docs/finetune.md's mpirun example needs a build with --features mpi (README's test command has it)");
    }
    if needs_mpi && Command::new("mpirun").arg("--version").output().is_err() {
        return skip_or_fail(TEST, "docs/finetune.md's mpirun example needs Open MPI's mpirun (apt install openmpi-bin)");
    }
    if Command::new("curl").arg("--version").output().is_err() {
        return skip_or_fail(TEST, "docs/serve.md's server examples use curl (apt install curl)");
    }

    // The scratch directory as the examples assume it.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("work");
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    std::fs::create_dir_all(dir.join("target")).unwrap();
    let alpaca = std::fs::read_to_string(data.join("alpaca.jsonl")).unwrap();
    std::fs::write(dir.join("train.jsonl"), alpaca.repeat(4)).unwrap(); // 40 rows: a batch of 16 fits
    std::fs::copy(data.join("zephyrix-codename.jsonl"), dir.join("chat.jsonl")).unwrap();
    std::fs::copy(data.join("zephyrix-codename.parquet"), dir.join("chat.parquet")).unwrap();
    std::fs::copy(data.join("zephyrix-preferences.jsonl"), dir.join("pairs.jsonl")).unwrap();
    std::fs::copy(data.join("sums.jsonl"), dir.join("sums.jsonl")).unwrap();
    std::fs::copy(data.join("sums-grader.json"), dir.join("grader.json")).unwrap();
    std::os::unix::fs::symlink(Path::new(env!("CARGO_MANIFEST_DIR")).join("configs"), dir.join("configs")).unwrap();
    std::os::unix::fs::symlink(&gguf, dir.join("model.gguf")).unwrap();
    let my_model = fixture("llama", tmp.path());
    std::fs::rename(&my_model, dir.join("my-model")).unwrap();
    let bin_dir = tmp.path().join("bin");
    std::fs::create_dir_all(&bin_dir).unwrap();
    std::os::unix::fs::symlink(bin(), bin_dir.join("fsdp-app")).unwrap();
    let hub_model = fixture("llama", tmp.path());
    let hub = HubServer::start("HuggingFaceTB/SmolLM2-135M-Instruct", dir_files(&hub_model));
    let scratch =
        Scratch { dir, path_var: format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default()), hub: hub.endpoint() };
    // The quick start's conversion, which the server example serves.
    scratch.run("fsdp-app convert --gguf model.gguf --out target/smollm2-hf");

    let mut server: Option<Background> = None;
    let mut file_id: Option<String> = None;
    let mut ran = 0;
    for command in &commands {
        if command.starts_with("fsdp-app serve") {
            let child = scratch.bash(&format!("exec {command}")).stdout(Stdio::null()).stderr(Stdio::inherit()).spawn().unwrap();
            server = Some(Background(child));
            wait_for_health("http://localhost:8000/health", server.as_mut().unwrap());
        } else if command.starts_with("curl") {
            assert!(server.is_some(), "a curl example comes before the server example: {command}");
            let command = match &file_id {
                Some(id) => command.replace("file-...", id),
                None => command.clone(),
            };
            let o = scratch.run(&command);
            check_curl_answer(&command, &o, &mut file_id);
        } else {
            let o = scratch.run(command);
            check_output(&scratch.dir, command, &o);
        }
        ran += 1;
    }
    drop(server);
    assert!(ran >= 22, "only {ran} docs examples ran: did a page's sh block change?");
    assert!(hub.requested_files().contains(&"config.json".to_string()), "the Hub example did not download from the local Hub");
}

fn wait_for_health(url: &str, server: &mut Background) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if ureq::get(url).call().is_ok() {
            return;
        }
        assert!(server.0.try_wait().unwrap().is_none(), "docs/serve.md's serve example exited");
        assert!(Instant::now() < deadline, "docs/serve.md's serve example did not answer {url} within 120 s");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// What each kind of `fsdp-app` example must leave beyond a zero exit: the text or JSON it
/// prints, the directory it writes (a training run's metrics.jsonl with its steps).
fn check_output(dir: &Path, command: &str, o: &Output) {
    let flag_value = |flag: &str| command.split(flag).nth(1).map(|rest| rest.split_whitespace().next().unwrap().to_string());
    if command.contains("--json") {
        let v = json_of(o, command);
        assert!(v["generated_ids"].as_array().is_some_and(|ids| !ids.is_empty()), "{command}: {v}");
    } else if command.starts_with("fsdp-app generate") {
        assert!(!stdout(o).trim().is_empty(), "{command} printed no text");
    } else if command.starts_with("fsdp-app perplexity") {
        let v = json_of(o, command);
        assert!(v["perplexity"].as_f64().is_some_and(|p| p.is_finite() && p > 1.0), "{command}: {v}");
    } else if command.starts_with("fsdp-app estimate") {
        assert!(stdout(o).contains("rank"), "{command}: {}", stdout(o));
    } else if let Some(out) = flag_value(" --output-dir ") {
        let metrics = std::fs::read_to_string(dir.join(&out).join("metrics.jsonl")).unwrap_or_default();
        assert!(metrics.lines().count() > 0, "{command}: no training steps in {out}/metrics.jsonl");
    } else if let Some(out) = flag_value(" --out ") {
        assert!(dir.join(&out).join("config.json").is_file(), "{command}: no {out}/config.json");
    } else {
        panic!("an fsdp-app example this test does not know how to check: {command}");
    }
}

/// The server examples: a stream that ends with [DONE], an uploaded file's id, a created job.
fn check_curl_answer(command: &str, o: &Output, file_id: &mut Option<String>) {
    let text = stdout(o);
    eprintln!("         -> {}", text.chars().take(300).collect::<String>().replace('\n', " "));
    if command.contains("/v1/chat/completions") {
        assert!(text.contains("data: [DONE]") && !text.contains("\"error\""), "{command}:\n{text}");
    } else if command.contains("/v1/responses") {
        let v = json_of(o, command);
        let text = v["output"][0]["content"][0]["text"].as_str().unwrap_or_default();
        assert!(v["object"] == "response" && !text.is_empty(), "{command}: {v}");
    } else if command.contains("/v1/messages") {
        let v = json_of(o, command);
        let text = v["content"][0]["text"].as_str().unwrap_or_default();
        assert!(v["type"] == "message" && !text.is_empty(), "{command}: {v}");
    } else if command.contains("/v1/embeddings") {
        let v = json_of(o, command);
        let n = v["data"].as_array().map_or(0, |d| d.iter().filter(|e| e["embedding"].as_array().is_some_and(|x| !x.is_empty())).count());
        assert!(v["object"] == "list" && n == 2, "{command}: {v}");
    } else if command.contains("/v1/files") {
        let v = json_of(o, command);
        let id = v["id"].as_str().unwrap_or_else(|| panic!("{command}: {v}"));
        *file_id = Some(id.to_string());
    } else if command.contains("/v1/fine_tuning/jobs") {
        let v = json_of(o, command);
        assert!(v["id"].as_str().is_some_and(|id| id.starts_with("ftjob-")) && v["status"] != "failed", "{command}: {v}");
        cancel(v["id"].as_str().unwrap());
    } else {
        panic!("a curl example this test does not know how to check: {command}");
    }
}

/// Cancels docs/fine-tuning-jobs.md's job: training SmolLM2 for two epochs is not this test's business.
fn cancel(id: &str) {
    let r = ureq::post(&format!("http://localhost:8000/v1/fine_tuning/jobs/{id}/cancel")).set("Authorization", "Bearer secret").call();
    assert!(r.is_ok(), "cancelling {id}: {r:?}");
}
