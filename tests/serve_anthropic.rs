//! Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) against a real server:
//! the official `anthropic` package from PyPI on SmolLM2 (tests/anthropic_client.py: a plain message, a
//! streamed one, stop sequences, a tool-use round trip, count_tokens, errors as its exception
//! classes), and over plain HTTP the details a client library hides: the error body's shape,
//! `x-api-key` beside `Bearer`, the event sequence.

mod common;

use common::server::*;
use common::*;
use serde_json::{json, Value};

/// A qwen2 fixture with a context long enough for the generic tool prompt.
fn model(root: &std::path::Path) -> std::path::PathBuf {
    fixture_with("qwen2", &root.join("m"), &[("max_position_embeddings", 1024)])
}

#[test]
fn the_official_anthropic_python_client_works_against_the_server() {
    let Some(python) = python_or_skip("the_official_anthropic_python_client_works_against_the_server", &["anthropic"]) else {
        return;
    };
    // A real model, whose answers have text to stop in.
    let Some(gguf) = smollm2_gguf_or_skip("the_official_anthropic_python_client_works_against_the_server") else { return };
    let server = Server::start(&gguf, &["--api-key", "k3y"]);
    run_client_script(&python, "anthropic_client.py", &server, "k3y", "tiny", &[]);
}

/// (status, body) of a POST with Anthropic's headers.
fn post_anthropic(url: &str, body: &str, key: &str) -> (u16, Value) {
    let req = ureq::post(url).set("Content-Type", "application/json").set("x-api-key", key).set("anthropic-version", "2023-06-01");
    let (status, text) = match req.send_string(body) {
        Ok(r) => (r.status(), r.into_string().unwrap()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
        Err(e) => panic!("{url}: {e}"),
    };
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
}

#[test]
fn errors_keys_and_events_are_anthropics() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&model(tmp.path()), &["--api-key", "k"]);
    let url = server.url("/v1/messages");
    let body = json!({"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]});

    // x-api-key and Bearer both authenticate, on every route.
    let (status, whole) = post_anthropic(&url, &body.to_string(), "k");
    assert_eq!(status, 200, "{whole}");
    assert_eq!((whole["type"].as_str(), whole["content"][0]["type"].as_str()), (Some("message"), Some("text")));
    assert_eq!(post(&url, &body.to_string(), Some("k")).0, 200);
    assert_eq!(post_anthropic(&server.url("/v1/models"), "", "k").0, 405, "x-api-key passes the key check of OpenAI's routes too");

    // Errors: {"type": "error", "error": {"type", "message"}}, the message naming the field.
    let error = |status: u16, v: &Value, kind: &str, names: &str| {
        assert_eq!((v["type"].as_str(), v["error"]["type"].as_str()), (Some("error"), Some(kind)), "{status}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(names), "{v}");
    };
    let (s, v) = post_anthropic(&url, &body.to_string(), "wrong");
    assert_eq!(s, 401);
    error(s, &v, "authentication_error", "x-api-key");
    let (s, v) = post_anthropic(&url, &json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}).to_string(), "k");
    assert_eq!(s, 400);
    error(s, &v, "invalid_request_error", "max_tokens");
    let (s, v) = post_anthropic(&url, "{not json", "k");
    assert_eq!(s, 400);
    error(s, &v, "invalid_request_error", "JSON");
    let mut bad = body.clone();
    bad["stop_sequences"] = json!([1]);
    let (s, v) = post_anthropic(&url, &bad.to_string(), "k");
    assert_eq!(s, 400);
    error(s, &v, "invalid_request_error", "stop_sequences");
    bad = body.clone();
    bad["inference_geo"] = json!("eu");
    let (s, v) = post_anthropic(&url, &bad.to_string(), "k");
    error(s, &v, "invalid_request_error", "inference_geo");
    let (s, v) = post_anthropic(&server.url("/v1/messages/count_tokens"), &json!({"model": "nope", "messages": []}).to_string(), "k");
    assert_eq!(s, 404);
    error(s, &v, "not_found_error", "nope");

    // The event stream: message_start, ping, the text block, message_delta, message_stop; the
    // deltas add up to the whole answer, and message_delta's usage to its usage.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = ureq::post(&url).set("x-api-key", "k").send_string(&streamed.to_string()).unwrap();
    let lines: Vec<String> = std::io::BufRead::lines(std::io::BufReader::new(r.into_reader())).map(Result::unwrap).collect();
    let events: Vec<(&str, Value)> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("event: "))
        .zip(lines.iter().filter_map(|l| l.strip_prefix("data: ")).map(|d| serde_json::from_str::<Value>(d).unwrap()))
        .collect();
    let kinds: Vec<&str> = events
        .iter()
        .map(|(k, v)| {
            assert_eq!(v["type"].as_str(), Some(*k));
            *k
        })
        .collect();
    assert_eq!(kinds[..3], ["message_start", "ping", "content_block_start"], "{kinds:?}");
    assert_eq!(kinds[kinds.len() - 3..], ["content_block_stop", "message_delta", "message_stop"], "{kinds:?}");
    let text: String =
        events.iter().filter(|(k, _)| *k == "content_block_delta").map(|(_, v)| v["delta"]["text"].as_str().unwrap()).collect();
    assert_eq!(text, whole["content"][0]["text"].as_str().unwrap());
    let delta = &events[events.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], whole["stop_reason"]);
    assert_eq!(delta["usage"]["output_tokens"], whole["usage"]["output_tokens"]);
}
