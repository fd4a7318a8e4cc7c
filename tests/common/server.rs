//! A real `fsdp-app serve` process for the server tests, and plain HTTP helpers.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{bin, run_cli, stderr};

pub struct Server {
    pub child: Child,
    base: String,
    _data: Option<tempfile::TempDir>,
}

impl Server {
    /// Starts `fsdp-app serve` on a free port; its data directory is a fresh temporary one
    /// unless `extra` names one.
    pub fn start(model: &Path, extra: &[&str]) -> Server {
        let mut args = vec!["--model", model.to_str().unwrap(), "--served-model-name", "tiny"];
        args.extend_from_slice(extra);
        Self::start_with(&args)
    }

    /// Starts `fsdp-app serve` with `serve_args` (the model among them, as the test writes it)
    /// on a free port, in a fresh temporary data directory unless they name one.
    pub fn start_with(serve_args: &[&str]) -> Server {
        let data = (!serve_args.contains(&"--data-dir")).then(|| tempfile::tempdir().unwrap());
        let data_arg = data.as_ref().map(|d| d.path().to_str().unwrap().to_string());
        let mut args = vec!["serve", "--port", "0"];
        if let Some(d) = &data_arg {
            args.extend(["--data-dir", d.as_str()]);
        }
        args.extend_from_slice(serve_args);
        let mut child = Command::new(bin()).args(&args).stderr(Stdio::piped()).stdout(Stdio::null()).spawn().unwrap();
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !line.contains("listening on http://") {
            line.clear();
            assert!(err.read_line(&mut line).unwrap() > 0 && Instant::now() < deadline, "server did not start: {line}");
        }
        let addr = line.split("http://").nth(1).unwrap().split_whitespace().next().unwrap().to_string();
        // Keep draining stderr so the server never blocks on it.
        std::thread::spawn(move || for _ in err.lines() {});
        Server { child, base: format!("http://{addr}"), _data: data }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A qwen2 model big enough that a long completion takes a while on 2 cores (so a request can
/// hold the only slot), with a 1024-token context.
pub fn slow_model(root: &Path) -> std::path::PathBuf {
    let dir = root.join("slow");
    let o = run_cli(
        &[
            "fixture",
            "--name",
            "qwen2",
            "--out",
            dir.to_str().unwrap(),
            "--set",
            "hidden_size=512",
            "--set",
            "intermediate_size=1536",
            "--set",
            "num_hidden_layers=8",
            "--set",
            "num_attention_heads=8",
            "--set",
            "num_key_value_heads=8",
            "--set",
            "max_position_embeddings=1024",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    dir
}

/// (status, body) of a POST, whatever the status.
pub fn post(url: &str, body: &str, key: Option<&str>) -> (u16, String, Option<String>) {
    let mut req = ureq::post(url).set("Content-Type", "application/json");
    if let Some(k) = key {
        req = req.set("Authorization", &format!("Bearer {k}"));
    }
    match req.send_string(body) {
        Ok(r) => (r.status(), r.into_string().unwrap(), None),
        Err(ureq::Error::Status(code, r)) => {
            let retry = r.header("Retry-After").map(str::to_string);
            (code, r.into_string().unwrap(), retry)
        }
        Err(e) => panic!("{url}: {e}"),
    }
}

pub fn post_json(url: &str, body: &Value) -> Value {
    let (status, text, _) = post(url, &body.to_string(), None);
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

pub fn get_json(url: &str) -> Value {
    serde_json::from_str(&ureq::get(url).call().unwrap().into_string().unwrap()).unwrap()
}

/// The data lines of an SSE response.
pub fn sse(url: &str, body: &Value) -> Vec<String> {
    let r = ureq::post(url).set("Content-Type", "application/json").send_string(&body.to_string()).unwrap();
    assert_eq!(r.header("Content-Type"), Some("text/event-stream"));
    BufReader::new(r.into_reader()).lines().map(Result::unwrap).filter_map(|l| l.strip_prefix("data: ").map(str::to_string)).collect()
}

/// Uploads `bytes` as a fine-tuning file: (status, the answer's JSON).
pub fn upload(server: &Server, filename: &str, bytes: &[u8]) -> (u16, Value) {
    let boundary = "----fsdpappboundary7MA4YWxkTrZu0gW";
    let mut body = format!("--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nfine-tune\r\n").into_bytes();
    body.extend(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\nContent-Type: application/jsonl\r\n\r\n").as_bytes());
    body.extend_from_slice(bytes);
    body.extend(format!("\r\n--{boundary}--\r\n").as_bytes());
    let r =
        ureq::post(&server.url("/v1/files")).set("Content-Type", &format!("multipart/form-data; boundary={boundary}")).send_bytes(&body);
    let (status, text) = match r {
        Ok(r) => (r.status(), r.into_string().unwrap()),
        Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap()),
        Err(e) => panic!("{e}"),
    };
    (status, serde_json::from_str(&text).unwrap())
}

/// The job `id` once its status is one of `want` (polled; fails after `secs`).
pub fn wait_for_status(server: &Server, id: &str, want: &[&str], secs: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let job = get_json(&server.url(&format!("/v1/fine_tuning/jobs/{id}")));
        if want.contains(&job["status"].as_str().unwrap()) {
            return job;
        }
        assert!(Instant::now() < deadline, "job {id} never reached {want:?}: {job}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The log-probability of `model`'s greedy first answer token to a fixed question.
pub fn first_token_logprob(server: &Server, model: &str) -> f64 {
    let r = post_json(
        &server.url("/v1/chat/completions"),
        &json!({"model": model, "messages": [{"role": "user", "content": "What is the codename?"}],
        "max_tokens": 1, "temperature": 0, "logprobs": true}),
    );
    r["choices"][0]["logprobs"]["content"][0]["logprob"].as_f64().unwrap()
}

/// Runs the client script `tests/{script}` with `python` against `server` (BASE_URL, API_KEY,
/// MODEL and `env` in its environment) and asserts that it ends with "all checks passed";
/// returns its output.
pub fn run_client_script(python: &Path, script: &str, server: &Server, key: &str, model: &str, env: &[(&str, &str)]) -> String {
    let out = Command::new(python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join(script))
        .env("BASE_URL", server.url("/v1"))
        .env("API_KEY", key)
        .env("MODEL", model)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{log}");
    assert!(log.contains("all checks passed"), "{log}");
    log
}
