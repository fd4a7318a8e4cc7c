//! `fsdp-app serve` as a real process, spoken to over real HTTP: answers equal `generate`'s,
//! streams equal the JSON answers and end in `data: [DONE]`, every bad request is a 4xx in
//! OpenAI's error shape (never a 5xx), a full queue answers 429 with Retry-After, and a client
//! that disconnects frees its slot.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::server::*;
use common::*;
use serde_json::{json, Value};

#[test]
fn answers_equal_generate_and_streams_equal_the_json_answers() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let server = Server::start(&model, &[]);
    let models = get_json(&server.url("/v1/models"));
    assert_eq!(models["data"][0]["id"], "tiny");

    // Greedy completion == `fsdp-app generate` on the same prompt.
    let c = post_json(
        &server.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}),
    );
    let g = run_cli(
        &[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "The quick brown fox",
            "--max-new-tokens",
            "12",
            "--temperature",
            "0",
            "--json",
        ],
        &[],
    );
    let g: Value = serde_json::from_str(&stdout(&g)).unwrap();
    assert_eq!(c["choices"][0]["text"], g["text"]);
    assert_eq!(c["object"], "text_completion");
    assert_eq!(c["usage"]["completion_tokens"].as_u64().unwrap() as usize, g["generated_ids"].as_array().unwrap().len());

    // Chat: the streamed deltas add up to the JSON answer; the stream ends in [DONE] after the
    // usage chunk.
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 10, "temperature": 0});
    let full = post_json(&server.url("/v1/chat/completions"), &body);
    assert_eq!(full["object"], "chat.completion");
    assert_eq!(full["choices"][0]["message"]["role"], "assistant");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let lines = sse(&server.url("/v1/chat/completions"), &streamed);
    assert_eq!(lines.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = lines[..lines.len() - 1].iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    let text: String = chunks.iter().filter_map(|c| c["choices"].get(0).and_then(|ch| ch["delta"]["content"].as_str())).collect();
    assert_eq!(text, full["choices"][0]["message"]["content"].as_str().unwrap());
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], full["choices"][0]["finish_reason"]);
    assert_eq!(chunks.last().unwrap()["usage"], full["usage"]);
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));

    // Sampling with a seed is reproducible; n gives n choices; a stop string ends the text.
    let sampled = json!({"model": "tiny", "prompt": "abc", "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "seed": 7, "n": 3, "min_p": 0.05, "presence_penalty": 0.5});
    let a = post_json(&server.url("/v1/completions"), &sampled);
    let b = post_json(&server.url("/v1/completions"), &sampled);
    assert_eq!(a["choices"], b["choices"]);
    assert_eq!(a["choices"].as_array().unwrap().len(), 3);
    let first = g["text"].as_str().unwrap();
    if let Some(stop) = first.get(3..5).filter(|s| !s.trim().is_empty() && first.is_char_boundary(3) && first.is_char_boundary(5)) {
        let s = post_json(
            &server.url("/v1/completions"),
            &json!({"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "stop": [stop]}),
        );
        assert_eq!(s["choices"][0]["finish_reason"], "stop");
        assert_eq!(s["choices"][0]["text"].as_str().unwrap(), &first[..first.find(stop).unwrap()]);
    }

    // Logprobs: the sampled token's, and top alternatives sorted, with the sampled one among them for greedy.
    let lp = post_json(
        &server.url("/v1/chat/completions"),
        &json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0, "logprobs": true, "top_logprobs": 3}),
    );
    let content = lp["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert!(!content.is_empty());
    for t in content {
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert!((top[0]["logprob"].as_f64().unwrap() - t["logprob"].as_f64().unwrap()).abs() < 1e-5, "greedy picks the most likely: {t}");
        assert!(t["logprob"].as_f64().unwrap() <= 0.0);
    }

    // tokenize / detokenize round trip; info and metrics answer.
    let tk = post_json(&server.url("/tokenize"), &json!({"prompt": "hello world", "add_special_tokens": false}));
    let dt = post_json(&server.url("/detokenize"), &json!({"tokens": tk["tokens"]}));
    assert_eq!(dt["prompt"], "hello world");
    assert_eq!(tk["count"], tk["tokens"].as_array().unwrap().len());
    let info = get_json(&server.url("/info"));
    assert_eq!(info["max_model_len"], 256);
    let metrics = ureq::get(&server.url("/metrics")).call().unwrap().into_string().unwrap();
    for m in [
        "fsdp_requests_total{status=\"200\"}",
        "fsdp_time_to_first_token_seconds_bucket",
        "fsdp_inter_token_latency_seconds_count",
        "fsdp_generated_tokens_total",
        "fsdp_queue_size",
        "fsdp_running_sequences",
    ] {
        assert!(metrics.contains(m), "{m} missing:\n{metrics}");
    }
    let spec = get_json(&server.url("/openapi.json"));
    assert!(spec["paths"]["/v1/chat/completions"].is_object());
}

/// `generate` and `serve` decide a model's defaults in one place (generate::ModelDefaults): with
/// a generation_config that samples (and names no top_k, so transformers' 50 applies), the same
/// seed gives the same tokens from both; so do explicit sampling settings.
#[test]
fn generate_and_serve_sample_the_same_tokens_for_the_same_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    std::fs::write(
        model.join("generation_config.json"),
        r#"{"bos_token_id": 0, "eos_token_id": 2, "do_sample": true, "temperature": 0.9}"#,
    )
    .unwrap();
    let server = Server::start(&model, &[]);
    let m = model.to_str().unwrap();
    for (request, flags) in [
        (json!({"seed": 7}), vec!["--seed", "7"]),
        (
            json!({"seed": 11, "temperature": 1.3, "top_p": 0.8, "top_k": 20}),
            vec!["--seed", "11", "--temperature", "1.3", "--top-p", "0.8", "--top-k", "20"],
        ),
    ] {
        let mut body = json!({"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 24});
        body.as_object_mut().unwrap().extend(request.as_object().unwrap().clone());
        let c = post_json(&server.url("/v1/completions"), &body);
        let mut args = vec!["generate", "--model", m, "--prompt", "The quick brown fox", "--max-new-tokens", "24", "--json"];
        args.extend(flags);
        let g = run_cli(&args, &[]);
        assert!(g.status.success(), "{}", stderr(&g));
        let g: Value = serde_json::from_str(&stdout(&g)).unwrap();
        assert_eq!(c["choices"][0]["text"], g["text"], "{request}");
        assert_eq!(c["usage"]["completion_tokens"].as_u64().unwrap() as usize, g["generated_ids"].as_array().unwrap().len(), "{request}");
    }
    // The defaults the server reports are the ones both used.
    let info = get_json(&server.url("/info"));
    assert_eq!(
        (info["sampling_defaults"]["temperature"].as_f64(), info["sampling_defaults"]["top_k"].as_u64()),
        (Some(0.9), Some(50)),
        "{info}"
    );
}

#[test]
fn bad_requests_get_openai_errors_and_never_a_5xx() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let server = Server::start(&model, &["--api-key", "sekret", "--max-body-bytes", "100000"]);
    let key = Some("sekret");
    let chat = server.url("/v1/chat/completions");
    let comp = server.url("/v1/completions");
    let msgs = json!([{"role": "user", "content": "hi"}]);
    #[allow(clippy::type_complexity)] // a table of cases, one column each
    let cases: Vec<(String, String, u16, Option<&str>, Option<&str>)> = vec![
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "temperature": 3}).to_string(), 400, Some("temperature"), None),
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "temperature": "warm"}).to_string(), 400, Some("temperature"), None),
        (chat.clone(), r#"{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e39}"#.to_string(), 400, Some("temperature"), None),
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "max_tokens": -5}).to_string(), 400, Some("max_tokens"), None),
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "max_tokens": 10_000_000_000u64}).to_string(), 400, Some("max_tokens"), None),
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "top_p": 0}).to_string(), 400, Some("top_p"), None),
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "stop": ["a", "b", "c", "d", "e"]}).to_string(), 400, Some("stop"), None),
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "n": 1000}).to_string(), 400, Some("n"), None),
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "top_logprobs": 50, "logprobs": true}).to_string(), 400, Some("top_logprobs"), None),
        (chat.clone(), json!({"model": "tiny", "messages": []}).to_string(), 400, Some("messages"), None),
        (chat.clone(), json!({"model": "tiny", "messages": "hi"}).to_string(), 400, Some("messages"), None),
        (chat.clone(), json!({"model": "tiny", "messages": [{"role": "user", "content": 5}]}).to_string(), 400, Some("messages[0].content"), None),
        (chat.clone(), json!({"model": "nope", "messages": msgs}).to_string(), 404, Some("model"), Some("model_not_found")),
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "max_tokens": 300}).to_string(), 400, Some("max_tokens"), Some("context_length_exceeded")),
        (comp.clone(), json!({"model": "tiny", "prompt": "x".repeat(2000)}).to_string(), 400, Some("prompt"), Some("context_length_exceeded")),
        (comp.clone(), json!({"model": "tiny", "prompt": [1, 2, 99999999]}).to_string(), 400, Some("prompt"), None),
        (comp.clone(), json!({"model": "tiny", "prompt": {"a": 1}}).to_string(), 400, Some("prompt"), None),
        (comp.clone(), "{not json".to_string(), 400, None, None),
        (comp.clone(), "".to_string(), 400, None, None),
        (comp.clone(), "[1, 2, 3]".to_string(), 400, None, None),
        (comp.clone(), "null".to_string(), 400, None, None),
        (comp.clone(), json!({"model": "tiny", "prompt": "x", "max_tokens": 5, "padding": "y".repeat(200_000)}).to_string(), 413, None, None),
        (comp.clone(), json!({"model": "tiny", "prompt": "z".repeat(10 << 20)}).to_string(), 413, None, None),
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "max_tokens": 4, "temperature": -1}).to_string(), 400, Some("temperature"), None),
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "seed": 1e300}).to_string(), 400, Some("seed"), None),
        (server.url("/v1/nothing"), "{}".to_string(), 404, None, None),
        (server.url("/detokenize"), json!({"tokens": [-1]}).to_string(), 400, Some("tokens"), None),
        // Fields this server does not implement are refused by name, never ignored.
        (comp.clone(), json!({"model": "tiny", "prompt": "x", "foo_bar": 1}).to_string(), 400, Some("foo_bar"), Some("unsupported_parameter")),
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}).to_string(), 400, Some("tool_choice"), None),
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "tools": [{"type": "retrieval"}]}).to_string(), 400, Some("tools[0].type"), None),
        (chat.clone(), json!({"model": "tiny", "messages": [{"role": "tool", "content": "18C"}]}).to_string(), 400, Some("messages[0].tool_call_id"), None),
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "store": true}).to_string(), 400, Some("store"), Some("unsupported_parameter")),
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "response_format": {"type": "xml"}}).to_string(), 400, Some("response_format.type"), None),
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nosuchtype"}}}}}}).to_string(), 400, Some("response_format.json_schema.schema"), None),
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}).to_string(), 400, Some("response_format.json_schema.name"), None),
        // A message's `name` is accepted (tests/openai_client.py); `refusal` is not implemented.
        (chat.clone(), json!({"model": "tiny", "messages": [{"role": "assistant", "content": "hi", "refusal": "no"}]}).to_string(), 400, Some("messages[0].refusal"), Some("unsupported_parameter")),
        (server.url("/v1/responses"), json!({"model": "tiny", "input": "x", "previous_response_id": "resp_1"}).to_string(), 400, Some("previous_response_id"), Some("unsupported_parameter")),
        (server.url("/v1/responses"), json!({"model": "tiny", "input": [{"type": "function_call_output", "output": "x"}]}).to_string(), 400, Some("input[0].call_id"), None),
        // An output must answer a call earlier in the input (OpenAI answers 400 too).
        (server.url("/v1/responses"), json!({"model": "tiny", "input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}).to_string(), 400, Some("input[0].call_id"), None),
        (server.url("/v1/responses"), json!({"model": "tiny", "input": [{"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}, {"type": "function_call_output", "call_id": "call_9", "output": "x"}]}).to_string(), 400, Some("input[1].call_id"), None),
        (server.url("/v1/responses"), json!({"model": "tiny", "input": "x", "max_output_tokens": 100000}).to_string(), 400, Some("max_output_tokens"), None),
        (comp.clone(), json!({"model": "tiny", "prompt": "x", "suffix": "y"}).to_string(), 400, Some("suffix"), Some("unsupported_parameter")),
        (comp.clone(), json!({"model": "tiny", "prompt": "x", "n": 2, "best_of": 1}).to_string(), 400, Some("best_of"), None),
        (chat.clone(), json!({"model": "tiny", "messages": msgs, "best_of": 2}).to_string(), 400, Some("best_of"), Some("unsupported_parameter")),
        (comp.clone(), json!({"model": "tiny", "prompt": "x", "logit_bias": {"99999999": 5}}).to_string(), 400, Some("logit_bias"), None),
        (comp.clone(), json!({"model": "tiny", "prompt": "x", "logit_bias": {"3": 500}}).to_string(), 400, Some("logit_bias"), None),
        (server.url("/v1/fine_tuning/jobs"), json!({"model": "tiny", "training_file": "file-x", "integrations": [{"type": "wandb"}]}).to_string(), 400, Some("integrations"), Some("unsupported_parameter")),
    ];
    for (url, body, status, param, code) in cases {
        let (got, text, _) = post(&url, &body, key);
        assert_eq!(got, status, "{url} {}: {text}", &body[..body.len().min(120)]);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        assert!(v["error"]["message"].is_string() && v["error"]["type"].is_string(), "{text}");
        assert_eq!(v["error"]["param"].as_str(), param, "{text}");
        if let Some(c) = code {
            assert_eq!(v["error"]["code"], c, "{text}");
        }
    }
    // The context error gives both counts.
    let (_, text, _) = post(&chat, &json!({"model": "tiny", "messages": msgs, "max_tokens": 300}).to_string(), key);
    assert!(text.contains("maximum context length is 256 tokens") && text.contains("300 for the completion"), "{text}");
    // Non-UTF-8 body.
    let r = ureq::post(&comp).set("Authorization", "Bearer sekret").send_bytes(&[0xff, 0xfe, 0x00]);
    assert!(matches!(r, Err(ureq::Error::Status(400, _))));
    // Wrong and missing keys: 401; /health needs none.
    for k in [None, Some("wrong"), Some("sekre")] {
        let (s, text, _) = post(&chat, &json!({"model": "tiny", "messages": msgs}).to_string(), k);
        assert_eq!(s, 401, "{text}");
    }
    assert!(matches!(ureq::get(&server.url("/v1/models")).call(), Err(ureq::Error::Status(401, _))));
    assert_eq!(ureq::get(&server.url("/health")).call().unwrap().status(), 200);
    // Still serving.
    let (s, text, _) = post(&chat, &json!({"model": "tiny", "messages": msgs, "max_tokens": 2}).to_string(), key);
    assert_eq!(s, 200, "{text}");
}

#[test]
fn a_full_queue_answers_429_and_a_disconnected_client_frees_its_slot() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = slow_model(tmp.path());
    let server = Server::start(&dir, &["--max-concurrent-requests", "1", "--max-queue", "0"]);
    let url = server.url("/v1/completions");
    let long = json!({"model": "tiny", "prompt": "count", "max_tokens": 900, "temperature": 0, "stream": true});
    let (reader, _) = first_chunk(&url, &long);
    // The one slot is taken: the next request is refused at once.
    let (status, text, retry) = post(&url, &json!({"model": "tiny", "prompt": "x", "max_tokens": 2}).to_string(), None);
    assert_eq!(status, 429, "{text}");
    assert!(retry.is_some(), "Retry-After header");
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["error"]["type"], "rate_limit_error");
    // Hang up mid-stream: the sequence is dropped at its next step and the slot frees.
    drop(reader);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, text, _) = post(&url, &json!({"model": "tiny", "prompt": "x", "max_tokens": 2}).to_string(), None);
        if status == 200 {
            break;
        }
        assert_eq!(status, 429, "{text}");
        assert!(Instant::now() < deadline, "the slot was never freed");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut metrics = String::new();
    ureq::get(&server.url("/metrics")).call().unwrap().into_reader().read_to_string(&mut metrics).unwrap();
    assert!(metrics.contains("fsdp_cancelled_sequences_total 1"), "{metrics}");
    assert!(metrics.contains("fsdp_requests_total{status=\"429\"}"), "{metrics}");
}

/// A streamed request's answer, read up to its first chunk (that line, and the reader).
fn first_chunk(url: &str, body: &Value) -> (BufReader<Box<dyn std::io::Read + Send + Sync + 'static>>, String) {
    let resp = ureq::post(url).send_string(&body.to_string()).unwrap();
    let mut reader = BufReader::new(resp.into_reader());
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        reader.read_line(&mut line).unwrap();
    }
    (reader, line)
}

/// `--max-queue-wait`: behind a long request holding the only slot, a queued request is answered
/// 429 with Retry-After once it has waited that long, whole or streamed (a stream's 200 comes
/// only once it runs), and the long request runs on.
#[test]
fn a_request_queued_past_max_queue_wait_is_answered_429() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = slow_model(tmp.path());
    let server = Server::start(&dir, &["--max-concurrent-requests", "1", "--max-queue-wait", "1.5"]);
    let url = server.url("/v1/completions");
    let long = json!({"model": "tiny", "prompt": "count", "max_tokens": 900, "temperature": 0, "ignore_eos": true, "stream": true});
    let (mut reader, mut line) = first_chunk(&url, &long);
    for stream in [false, true] {
        let start = Instant::now();
        let body = json!({"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": stream});
        let (status, text, retry) = post(&url, &body.to_string(), None);
        let waited = start.elapsed();
        assert_eq!(status, 429, "stream {stream}: {text}");
        assert!(waited >= Duration::from_millis(1500) && waited < Duration::from_secs(10), "answered after {waited:?}");
        assert!(retry.as_deref().and_then(|r| r.parse::<u64>().ok()).is_some_and(|r| r >= 1), "Retry-After: {retry:?}");
        let error = &serde_json::from_str::<Value>(&text).unwrap()["error"];
        assert!(error["type"] == "rate_limit_error" && error["message"].as_str().unwrap().contains("waited"), "{text}");
    }
    // The long request ran on meanwhile.
    line.clear();
    reader.read_line(&mut line).unwrap();
    let mut next = String::new();
    reader.read_line(&mut next).unwrap();
    assert!(line.starts_with("data: {") || next.starts_with("data: {"), "{line:?} {next:?}");
    let mut metrics = String::new();
    ureq::get(&server.url("/metrics")).call().unwrap().into_reader().read_to_string(&mut metrics).unwrap();
    assert!(metrics.contains("fsdp_queue_timeouts_total 2"), "{metrics}");
}

#[test]
fn the_official_openai_python_client_works_against_the_server() {
    let Some(python) = python_or_skip("the_official_openai_python_client_works_against_the_server", &["openai", "jsonschema"]) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = slow_model(tmp.path());
    let server = Server::start(&dir, &["--api-key", "k3y", "--max-concurrent-requests", "1", "--max-queue", "0"]);
    let train = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/zephyrix-codename.jsonl");
    run_client_script(
        &python,
        "openai_client.py",
        &server,
        "k3y",
        "tiny",
        &[("LONG_TOKENS", "900"), ("TRAIN_FILE", train.to_str().unwrap())],
    );
}

#[test]
fn schemathesis_finds_no_server_error_in_the_openapi_spec() {
    let Some(python) = python_or_skip("schemathesis_finds_no_server_error_in_the_openapi_spec", &["schemathesis"]) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    let server = Server::start(&model, &["--api-key", "k"]);
    let st = python.parent().unwrap().join("schemathesis");
    let out = Command::new(st)
        .args([
            "run",
            &server.url("/openapi.json"),
            "--checks",
            "not_a_server_error",
            "-H",
            "Authorization: Bearer k",
            "--max-examples",
            "40",
            "--seed",
            "1",
        ])
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{log}");
    assert!(log.contains("passed") && !log.contains("failed,"), "{log}");
}

#[test]
fn sixty_four_streaming_clients_for_30_seconds_get_answers_or_429_and_memory_stays_bounded() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2", tmp.path());
    // A small prefix cache: it fills within the first seconds (one block per distinct request),
    // so growth after that is a leak, not the cache doing its job.
    let server = Server::start(&model, &["--max-concurrent-requests", "8", "--max-queue", "16", "--kv-cache-memory", "8"]);
    let url = server.url("/v1/chat/completions");
    let rss_start = rss_of(server.child.id());
    let stop_at = Instant::now() + Duration::from_secs(30);
    let workers: Vec<_> = (0..64)
        .map(|w| {
            let url = url.clone();
            std::thread::spawn(move || {
                let (mut ok, mut limited, mut hung_up) = (0, 0, 0);
                let mut i = 0u64;
                while Instant::now() < stop_at {
                    i += 1;
                    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": format!("client {w} request {i}")}],
                                      "max_tokens": 48, "temperature": 0.8, "seed": i, "stream": true});
                    match ureq::post(&url).send_string(&body.to_string()) {
                        Ok(r) => {
                            let mut lines = BufReader::new(r.into_reader()).lines();
                            if (w + i as usize).is_multiple_of(4) {
                                // Hang up after the first event.
                                let _ = lines.next();
                                hung_up += 1;
                                continue;
                            }
                            let all: Vec<String> = lines.map(Result::unwrap).filter(|l| l.starts_with("data: ")).collect();
                            assert_eq!(all.last().map(String::as_str), Some("data: [DONE]"), "client {w}: {all:?}");
                            ok += 1;
                        }
                        Err(ureq::Error::Status(429, r)) => {
                            assert!(r.header("Retry-After").is_some());
                            limited += 1;
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        Err(e) => panic!("client {w}: {e}"),
                    }
                }
                (ok, limited, hung_up)
            })
        })
        .collect();
    // The server's memory, sampled every 100 ms while the clients are at it (not after).
    let pid = server.child.id();
    let sampler = std::thread::spawn(move || {
        let mut samples = vec![];
        while Instant::now() < stop_at {
            samples.push(rss_of(pid));
            std::thread::sleep(Duration::from_millis(100));
        }
        samples
    });
    let (mut ok, mut limited, mut hung_up) = (0, 0, 0);
    for h in workers {
        let (a, b, c) = h.join().unwrap();
        ok += a;
        limited += b;
        hung_up += c;
    }
    let samples = sampler.join().unwrap();
    let peak = samples.iter().copied().max().unwrap_or(0);
    // The second half of the load may not sit higher than the first: a leak grows with requests.
    let (first, second) = samples.split_at(samples.len() / 2);
    let (first_peak, second_peak) = (first.iter().max().copied().unwrap_or(0), second.iter().max().copied().unwrap_or(0));
    eprintln!(
        "64 clients, 30 s: {ok} complete streams, {hung_up} hung up, {limited} x 429; RSS {} MiB at start, peak {} MiB \
         ({} samples during the load; first half peak {} MiB, second half {} MiB)",
        rss_start >> 20,
        peak >> 20,
        samples.len(),
        first_peak >> 20,
        second_peak >> 20
    );
    assert!(ok > 64 && limited > 0, "{ok} answers, {limited} refusals");
    assert!(samples.len() >= 200, "only {} memory samples during 30 s of load", samples.len());
    assert!(peak < rss_start + (200 << 20), "memory grew from {rss_start} to {peak} during the load");
    assert!(second_peak < first_peak + (32 << 20), "memory kept growing under load: {} -> {} MiB", first_peak >> 20, second_peak >> 20);
    // Every slot comes back: nothing running or queued once the clients are gone.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = ureq::get(&server.url("/metrics")).call().unwrap().into_string().unwrap();
        if m.contains("fsdp_running_sequences 0") && m.contains("fsdp_queue_size 0") {
            assert!(!m.contains("status=\"5"), "a 5xx was answered:\n{m}");
            break;
        }
        assert!(Instant::now() < deadline, "slots still taken:\n{m}");
        std::thread::sleep(Duration::from_millis(100));
    }
}
