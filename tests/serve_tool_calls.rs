//! Native tool calls under `tool_choice: auto`, for each format `--tool-call-parser` reads
//! (Hermes / Qwen `<tool_call>`, Llama 3.1 JSON, Mistral `[TOOL_CALLS]`), against a real server:
//! a fixture whose chat template renders the functions in that family's way, fine-tuned to call
//! the weather function for the weather question and to greet back for "Hi"
//! (`common::tool_models`). The call comes back parsed, whole and streamed (text deltas before a
//! call opens, `tool_calls` deltas after), its arguments held to the function's schema by the
//! lazy grammar; the greeting comes back as text. With Hermes also the Responses API's and the
//! Messages API's streams, Ollama's `/api/chat`, LangChain's `bind_tools` through `ChatOpenAI` and
//! `ChatOllama` (tests/langchain_tools.py), and a call after a reasoning model's thinking.

mod common;

use common::server::*;
use common::tool_models::*;
use common::*;
use serde_json::{json, Value};

fn chat(question: &str, extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": question}], "tools": tools(), "max_tokens": 120, "temperature": 0});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// The streamed chunks' content, and each call's (id, name, arguments).
fn streamed(lines: &[String]) -> (String, Vec<(String, String, String)>, String) {
    let chunks: Vec<Value> = lines[..lines.len() - 1].iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    let (mut content, mut calls, mut finish) = (String::new(), Vec::<(String, String, String)>::new(), String::new());
    for c in chunks.iter().filter_map(|c| c["choices"].get(0)) {
        content += c["delta"]["content"].as_str().unwrap_or_default();
        for t in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let k = t["index"].as_u64().unwrap() as usize;
            if calls.len() == k {
                calls.push((t["id"].as_str().unwrap().into(), t["function"]["name"].as_str().unwrap().into(), String::new()));
            }
            calls[k].2 += t["function"]["arguments"].as_str().unwrap_or_default();
        }
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.into();
        }
    }
    (content, calls, finish)
}

fn check_family(family: Family) -> Server {
    let tmp = tempfile::tempdir().unwrap();
    let model = tool_model(tmp.path(), family, None);
    let server = Server::start(&model, &[]);
    let url = server.url("/v1/chat/completions");
    let what = format!("{family:?}");

    let whole = post_json(&url, &chat(QUESTION, json!({})));
    let choice = &whole["choices"][0];
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(
        (call["function"]["name"].as_str(), choice["finish_reason"].as_str()),
        (Some("get_weather"), Some("tool_calls")),
        "{what}: {whole}"
    );
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}), "{what}: {whole}");
    assert!(choice["message"]["content"].as_str().is_none_or(str::is_empty), "{what}: {whole}");

    let (content, calls, finish) = streamed(&sse(&url, &chat(QUESTION, json!({"stream": true}))));
    assert_eq!((content.as_str(), finish.as_str()), ("", "tool_calls"), "{what}");
    assert_eq!(
        calls.iter().map(|(_, n, a)| (n.as_str(), a.as_str())).collect::<Vec<_>>(),
        [("get_weather", call["function"]["arguments"].as_str().unwrap())],
        "{what}"
    );
    if let Family::Mistral = family {
        // Mistral's template takes back only 9-character alphanumeric call ids.
        let id = &calls[0].0;
        assert!(id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()), "{id}");
    }

    let text = post_json(&url, &chat(GREETING, json!({})));
    assert_eq!(text["choices"][0]["message"]["content"].as_str(), Some(REPLY), "{what}: {text}");
    assert!(text["choices"][0]["message"].get("tool_calls").is_none_or(Value::is_null), "{what}: {text}");
    let (content, calls, finish) = streamed(&sse(&url, &chat(GREETING, json!({"stream": true}))));
    assert_eq!((content.as_str(), calls.len(), finish.as_str()), (REPLY, 0, "stop"), "{what}");
    drop(tmp);
    server
}

#[test]
fn hermes_calls_come_back_parsed_in_every_api_and_through_langchain() {
    let server = check_family(Family::Hermes);

    // The Responses API: a function_call item whose streamed arguments add up.
    let body = json!({"model": "tiny", "input": QUESTION, "tools": [{"type": "function", "name": "get_weather", "description": "Current weather of a city",
        "parameters": tools()[0]["function"]["parameters"]}], "max_output_tokens": 120, "temperature": 0, "stream": true});
    let events: Vec<Value> = sse(&server.url("/v1/responses"), &body).iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    let args: String =
        events.iter().filter(|e| e["type"] == "response.function_call_arguments.delta").map(|e| e["delta"].as_str().unwrap()).collect();
    let done = events.iter().find(|e| e["type"] == "response.completed").expect("completed");
    assert_eq!(done["response"]["output"][0]["type"], "function_call", "{done}");
    assert_eq!((done["response"]["output"][0]["name"].as_str(), args.as_str()), (Some("get_weather"), r#"{"city": "Paris"}"#));

    // The Messages API: a tool_use block whose input_json_deltas add up.
    let body = json!({"model": "tiny", "max_tokens": 120, "temperature": 0, "stream": true, "messages": [{"role": "user", "content": QUESTION}],
        "tools": [{"name": "get_weather", "description": "Current weather of a city", "input_schema": tools()[0]["function"]["parameters"]}]});
    let events: Vec<Value> = sse(&server.url("/v1/messages"), &body).iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    let start = events.iter().find(|e| e["type"] == "content_block_start").expect("a block");
    assert_eq!((start["content_block"]["type"].as_str(), start["content_block"]["name"].as_str()), (Some("tool_use"), Some("get_weather")));
    let input: String =
        events.iter().filter(|e| e["delta"]["type"] == "input_json_delta").map(|e| e["delta"]["partial_json"].as_str().unwrap()).collect();
    let delta = events.iter().find(|e| e["type"] == "message_delta").unwrap();
    assert_eq!((input.as_str(), delta["delta"]["stop_reason"].as_str()), (r#"{"city": "Paris"}"#, Some("tool_use")));

    // Ollama's /api/chat: the call in one object before the last, its arguments an object.
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "tools": tools(), "options": {"temperature": 0, "num_predict": 120}});
    let r = ureq::post(&server.url("/api/chat")).send_json(body).unwrap();
    let parts: Vec<Value> =
        std::io::BufRead::lines(std::io::BufReader::new(r.into_reader())).map(|l| serde_json::from_str(&l.unwrap()).unwrap()).collect();
    let calls: Vec<&Value> = parts.iter().filter_map(|p| p["message"]["tool_calls"].as_array()).flatten().collect();
    assert_eq!(calls.len(), 1, "{parts:?}");
    assert_eq!(calls[0]["function"], json!({"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}));
    assert!(parts.iter().all(|p| p["message"]["content"] == json!("")), "a call's text is not content: {parts:?}");

    let packages = ["langchain-openai:langchain_openai", "langchain-ollama:langchain_ollama"];
    let Some(python) = python_or_skip("hermes_calls_come_back_parsed_in_every_api_and_through_langchain", &packages) else {
        return;
    };
    let tools = tools().to_string();
    for client in ["openai", "ollama"] {
        run_client_script(
            &python,
            "langchain_tools.py",
            &server,
            "none",
            "tiny",
            &[("TOOLS", &tools), ("QUESTION", QUESTION), ("REPLY", REPLY), ("CLIENT", client)],
        );
    }
}

#[test]
fn llama3_json_calls_come_back_parsed() {
    check_family(Family::Llama3);
}

#[test]
fn mistral_calls_come_back_parsed() {
    check_family(Family::Mistral);
}

/// A reasoning model thinks, then calls: the thinking is split out and the grammar, which waits
/// for the thinking to end, holds the call that follows.
#[test]
fn a_call_after_the_thinking_comes_back_parsed() {
    const THOUGHT: &str = "\nthe user wants the weather\n";
    let tmp = tempfile::tempdir().unwrap();
    let model = tool_model(tmp.path(), Family::Hermes, Some(THOUGHT));
    let server = Server::start(&model, &["--reasoning-parser", "qwen3"]);
    let url = server.url("/v1/chat/completions");
    let whole = post_json(&url, &chat(QUESTION, json!({})));
    let message = &whole["choices"][0]["message"];
    assert_eq!(message["reasoning_content"].as_str(), Some(THOUGHT), "{whole}");
    assert_eq!(message["tool_calls"][0]["function"]["arguments"].as_str(), Some(r#"{"city": "Paris"}"#), "{whole}");
    let lines = sse(&url, &chat(QUESTION, json!({"stream": true})));
    let chunks: Vec<Value> = lines[..lines.len() - 1].iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    let thought: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["reasoning_content"].as_str()).collect();
    let (content, calls, finish) = streamed(&lines);
    assert_eq!((thought.as_str(), content.as_str(), finish.as_str()), (THOUGHT, "", "tool_calls"));
    assert_eq!(calls.iter().map(|(_, n, a)| (n.as_str(), a.as_str())).collect::<Vec<_>>(), [("get_weather", r#"{"city": "Paris"}"#)]);
}
