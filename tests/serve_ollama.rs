//! Ollama's API (`/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`, `/api/tags`,
//! `/api/show`, `/api/ps`, `/api/version`) against a real server: the official `ollama` package
//! from PyPI on SmolLM2 (tests/ollama_client.py), and over plain HTTP what a client library
//! hides: answers equal to the OpenAI routes' for the same request, the newline-delimited
//! stream, the error body, the loading options named in the ignored-fields header.

mod common;

use std::io::{BufRead, BufReader};

use common::server::*;
use common::*;
use serde_json::{json, Value};

#[test]
fn the_official_ollama_python_client_works_against_the_server() {
    let Some(python) = python_or_skip("the_official_ollama_python_client_works_against_the_server", &["ollama"]) else { return };
    let Some(gguf) = smollm2_gguf_or_skip("the_official_ollama_python_client_works_against_the_server") else { return };
    let server = Server::start(&gguf, &["--api-key", "k3y"]);
    run_client_script(&python, "ollama_client.py", &server, "k3y", "tiny", &[]);
}

/// The objects of a newline-delimited JSON answer.
fn ndjson(url: &str, body: &Value) -> Vec<Value> {
    let r = ureq::post(url).set("Content-Type", "application/json").send_string(&body.to_string()).unwrap();
    assert_eq!(r.header("Content-Type"), Some("application/x-ndjson"));
    BufReader::new(r.into_reader()).lines().map(|l| serde_json::from_str(&l.unwrap()).unwrap()).collect()
}

#[test]
fn answers_are_the_openai_routes_answers_in_ollamas_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&fixture_with("qwen2", &tmp.path().join("m"), &[("max_position_embeddings", 1024)]), &[]);
    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]);

    // Chat: the same greedy answer and counts as /v1/chat/completions.
    let openai =
        post_json(&server.url("/v1/chat/completions"), &json!({"model": "tiny", "messages": messages, "max_tokens": 7, "temperature": 0}));
    let options = json!({"temperature": 0, "num_predict": 7});
    let chat = post_json(&server.url("/api/chat"), &json!({"model": "tiny", "messages": messages, "options": options, "stream": false}));
    assert_eq!(chat["message"], json!({"role": "assistant", "content": openai["choices"][0]["message"]["content"]}), "{chat}");
    assert_eq!((&chat["done"], &chat["done_reason"], &chat["model"]), (&json!(true), &json!("length"), &json!("tiny")));
    assert_eq!((&chat["prompt_eval_count"], &chat["eval_count"]), (&openai["usage"]["prompt_tokens"], &json!(7)));
    assert!(
        chat["created_at"].as_str().unwrap().ends_with('Z')
            && chat["total_duration"].as_u64().unwrap() >= chat["eval_duration"].as_u64().unwrap()
    );

    // Streamed (Ollama's default): the pieces add up; only the last object is done, with the counts.
    let parts = ndjson(&server.url("/api/chat"), &json!({"model": "tiny", "messages": messages, "options": options}));
    let (last, pieces) = parts.split_last().unwrap();
    assert!(pieces.iter().all(|p| p["done"] == json!(false) && p.get("done_reason").is_none()), "{parts:?}");
    let text: String = pieces.iter().map(|p| p["message"]["content"].as_str().unwrap()).collect();
    assert_eq!(text, chat["message"]["content"].as_str().unwrap());
    assert_eq!((&last["done"], &last["done_reason"], &last["eval_count"]), (&json!(true), &json!("length"), &json!(7)));

    // Generate: templated, the chat's answer; raw, /v1/completions' answer; both stream the same.
    let gen = |extra: Value| {
        let mut body = json!({"model": "tiny", "prompt": "Hi there", "options": options, "stream": false});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        post_json(&server.url("/api/generate"), &body)
    };
    assert_eq!(gen(json!({"system": "Be brief."}))["response"], chat["message"]["content"]);
    let completion =
        post_json(&server.url("/v1/completions"), &json!({"model": "tiny", "prompt": "Hi there", "max_tokens": 7, "temperature": 0}));
    let raw = gen(json!({"raw": true}));
    assert_eq!(raw["response"], completion["choices"][0]["text"]);
    assert_eq!(raw["prompt_eval_count"], completion["usage"]["prompt_tokens"]);
    let streamed = ndjson(&server.url("/api/generate"), &json!({"model": "tiny", "prompt": "Hi there", "raw": true, "options": options}));
    let text: String = streamed.iter().map(|p| p["response"].as_str().unwrap()).collect();
    assert_eq!(text, raw["response"].as_str().unwrap());
    // Without num_predict an answer may run to the context's end (a completion's default is 16).
    let open = post_json(
        &server.url("/api/generate"),
        &json!({"model": "tiny", "prompt": "Hi there", "raw": true, "stream": false, "options": {"temperature": 0}}),
    );
    let rest = 1024 - completion["usage"]["prompt_tokens"].as_u64().unwrap();
    let to_the_end =
        post_json(&server.url("/v1/completions"), &json!({"model": "tiny", "prompt": "Hi there", "max_tokens": rest, "temperature": 0}));
    assert_eq!(open["response"], to_the_end["choices"][0]["text"]);
    assert!(open["eval_count"].as_u64().unwrap() > 16, "{open}");

    // Options: repeat_penalty and seed reach the sampler as /v1's repetition_penalty and seed do.
    let sampled = json!({"temperature": 1.0, "seed": 5, "repeat_penalty": 1.3, "top_k": 20, "num_predict": 7});
    let ours = post_json(&server.url("/api/chat"), &json!({"model": "tiny", "messages": messages, "options": sampled, "stream": false}));
    let theirs = post_json(
        &server.url("/v1/chat/completions"),
        &json!({"model": "tiny", "messages": messages, "max_tokens": 7, "temperature": 1.0, "seed": 5, "repetition_penalty": 1.3, "top_k": 20}),
    );
    assert_eq!(ours["message"]["content"], theirs["choices"][0]["message"]["content"]);

    // Loading options change nothing and are named in the ignored-fields header.
    let r = ureq::post(&server.url("/api/chat"))
        .send_json(json!({"model": "tiny", "messages": messages, "options": {"num_ctx": 8192, "num_predict": 2}, "stream": false}))
        .unwrap();
    assert_eq!(r.header("x-fsdp-app-ignored-params"), Some("options.num_ctx"));

    // An empty conversation or prompt loads the model: done at once.
    let loaded = post_json(&server.url("/api/generate"), &json!({"model": "tiny:latest"}));
    assert_eq!((&loaded["done"], &loaded["done_reason"], &loaded["response"]), (&json!(true), &json!("load"), &json!("")));
}

#[test]
fn errors_models_and_embeddings_are_ollamas() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&fixture_with("qwen2", &tmp.path().join("m"), &[("max_position_embeddings", 1024)]), &[]);
    let hi = json!([{"role": "user", "content": "Hi"}]);
    let error = |path: &str, body: Value, status: u16, names: &str| {
        let (s, text, _) = post(&server.url(path), &body.to_string(), None);
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(s, status, "{body}: {text}");
        assert_eq!(v.as_object().unwrap().len(), 1, "Ollama's errors are {{\"error\"}}: {text}");
        assert!(v["error"].as_str().unwrap().contains(names), "{body}: {text}");
    };
    error("/api/chat", json!({"model": "nope", "messages": hi}), 404, "nope");
    error("/api/chat", json!({"messages": hi}), 400, "model");
    error("/api/chat", json!({"model": "tiny", "messages": hi, "options": {"mirostat": 2}}), 400, "options.mirostat");
    error("/api/chat", json!({"model": "tiny", "messages": hi, "options": {"num_predict": 5000}}), 400, "options.num_predict");
    error("/api/chat", json!({"model": "tiny", "messages": hi, "options": {"top_p": "high"}}), 400, "options.top_p");
    error("/api/chat", json!({"model": "tiny", "messages": hi, "format": "yaml"}), 400, "format");
    error("/api/chat", json!({"model": "tiny", "messages": hi, "think": true}), 400, "think");
    error("/api/chat", json!({"model": "tiny", "messages": hi, "stram": false}), 400, "stram");
    error(
        "/api/chat",
        json!({"model": "tiny", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}),
        400,
        "messages[0].images",
    );
    error("/api/generate", json!({"model": "tiny", "prompt": "x", "suffix": "y"}), 400, "suffix");
    error("/api/generate", json!({"model": "tiny", "prompt": "x", "raw": true, "system": "s"}), 400, "system");
    error("/api/generate", json!({"model": "tiny", "prompt": "x", "keep_alive": "soon"}), 400, "keep_alive");
    error("/api/embed", json!({"model": "tiny", "input": "x", "dimensions": 8}), 400, "dimensions");
    error("/api/show", json!({"model": "nope"}), 404, "nope");

    // The model list, show, ps and the version.
    let tags = get_json(&server.url("/api/tags"));
    let tiny = &tags["models"][0];
    assert_eq!((&tiny["name"], &tiny["model"], &tiny["details"]["family"]), (&json!("tiny"), &json!("tiny"), &json!("qwen2")));
    assert!(tiny["modified_at"].as_str().unwrap().ends_with('Z'));
    let shown = post_json(&server.url("/api/show"), &json!({"model": "tiny:latest"}));
    assert_eq!(shown["details"], tiny["details"]);
    assert_eq!(shown["capabilities"], json!(["completion", "tools"]), "qwen2's template takes tools: {shown}");
    assert_eq!(shown["model_info"]["qwen2.context_length"], json!(1024));
    assert!(shown["template"].as_str().unwrap().contains("im_start"));
    assert_eq!(get_json(&server.url("/api/ps"))["models"][0]["context_length"], json!(1024));
    assert!(get_json(&server.url("/api/version"))["version"].is_string());

    // /api/embed: /v1/embeddings' vectors; a text past the context is cut unless truncate is false.
    let theirs = post_json(&server.url("/v1/embeddings"), &json!({"model": "tiny", "input": ["a b", "c"]}));
    let ours = post_json(&server.url("/api/embed"), &json!({"model": "tiny", "input": ["a b", "c"]}));
    for i in 0..2 {
        assert_eq!(ours["embeddings"][i], theirs["data"][i]["embedding"]);
    }
    assert_eq!(ours["prompt_eval_count"], theirs["usage"]["prompt_tokens"]);
    let long: String = (0..1200).map(|i| format!(" w{i}")).collect();
    assert_eq!(post_json(&server.url("/api/embed"), &json!({"model": "tiny", "input": long}))["prompt_eval_count"], json!(1024));
    error("/api/embed", json!({"model": "tiny", "input": long, "truncate": false}), 400, "context");
    // Options settle nothing about an embedding: each is named in the ignored-fields header.
    let r = ureq::post(&server.url("/api/embed"))
        .send_json(json!({"model": "tiny", "input": "c", "options": {"num_ctx": 8192, "temperature": 0}}))
        .unwrap();
    assert_eq!(r.header("x-fsdp-app-ignored-params"), Some("options.num_ctx, options.temperature"));
    error("/api/embed", json!({"model": "tiny", "input": "c", "options": {"nom_ctx": 1}}), 400, "nom_ctx");
    error("/api/embeddings", json!({"model": "tiny", "prompt": "c", "options": 3}), 400, "options");
    // The older route: one vector, not scaled, pointing the same way.
    let old = post_json(&server.url("/api/embeddings"), &json!({"model": "tiny", "prompt": "c"}))["embedding"].clone();
    let old: Vec<f64> = old.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    let norm = old.iter().map(|x| x * x).sum::<f64>().sqrt();
    let unit: Vec<f64> = ours["embeddings"][1].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    assert!(old.iter().zip(&unit).all(|(a, b)| (a / norm - b).abs() < 1e-5));
}

/// A call the model writes comes back as Ollama's `tool_calls` (arguments as an object), whole and
/// streamed (in one object before the last). SmolLM2 writes Llama 3.1's bare JSON calls here,
/// held to one by `format`.
#[test]
fn calls_come_back_as_ollamas_tool_calls() {
    let Some(gguf) = smollm2_gguf_or_skip("calls_come_back_as_ollamas_tool_calls") else { return };
    let server = Server::start(&gguf, &["--tool-call-parser", "llama3_json"]);
    let city = json!({"type": "object", "properties": {"city": {"const": "Paris"}}, "required": ["city"]});
    let call =
        json!({"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": city}, "required": ["name", "parameters"]});
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools, "format": call,
                      "options": {"temperature": 0, "num_predict": 60}, "stream": false});
    let whole = post_json(&server.url("/api/chat"), &body);
    let calls = &whole["message"]["tool_calls"];
    assert_eq!(calls[0]["function"]["name"], json!("get_weather"), "{whole}");
    assert_eq!(calls[0]["function"]["arguments"], json!({"city": "Paris"}), "{whole}");
    assert_eq!((&whole["message"]["content"], &whole["done_reason"]), (&json!(""), &json!("stop")));

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let parts = ndjson(&server.url("/api/chat"), &streamed);
    let (last, rest) = parts.split_last().unwrap();
    assert!(last["done"] == json!(true) && last["message"].get("tool_calls").is_none(), "{parts:?}");
    let with_calls: Vec<&Value> = rest.iter().filter(|p| p["message"].get("tool_calls").is_some()).collect();
    assert_eq!(with_calls.len(), 1, "{parts:?}");
    assert_eq!(&with_calls[0]["message"]["tool_calls"][0]["function"], &calls[0]["function"]);
    assert!(rest.iter().all(|p| p["message"]["content"] == json!("")), "a call's text is not content: {parts:?}");
}
