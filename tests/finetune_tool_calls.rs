//! Fine-tuning on function calls as OpenAI's fine-tuning files and TRL's tool datasets write
//! them (the row's `tools`, assistant `tool_calls` with `arguments` a JSON string, `tool` turns
//! with the results), then serving the tuned model to a client that sends the same functions:
//! the rows are rendered as the server renders a request, so the served model calls the
//! function for the weather question, answers from the result once it has it, and greets back
//! for "Hi". Once with a template that renders the functions itself (Qwen 2.5's shape), once
//! with one that knows no functions (the server's generic format, as for SmolLM2).

mod common;

use std::path::{Path, PathBuf};

use common::server::*;
use common::tool_models::{tools, Family, GREETING, QUESTION, REPLY};
use common::*;
use serde_json::{json, Value};

const RESULT: &str = "18C and sunny";
const ANSWER: &str = "It is 18C in Paris.";

/// The call the rows teach, as an OpenAI client sends it back in the history.
fn call() -> Value {
    json!([{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}])
}

fn rows() -> String {
    let weather = json!({"messages": [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": null, "tool_calls": call()},
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
        {"role": "assistant", "content": ANSWER}], "tools": tools()});
    let greeting = json!({"messages": [{"role": "user", "content": GREETING}, {"role": "assistant", "content": REPLY}], "tools": tools()});
    format!("{weather}\n{greeting}\n").repeat(4)
}

/// A qwen2 fixture (with `template` as its chat template, if given) fine-tuned on `rows()`.
fn tuned(root: &Path, template: Option<&str>) -> PathBuf {
    let (base, out, data) = (root.join("base"), root.join("tuned"), root.join("rows.jsonl"));
    fixture_with("qwen2", &base, &[("max_position_embeddings", 1024)]);
    if let Some(t) = template {
        std::fs::write(base.join("chat_template.jinja"), t).unwrap();
    }
    std::fs::write(&data, rows()).unwrap();
    let o = run_cli(
        &["finetune", "--model", base.to_str().unwrap(), "--data", data.to_str().unwrap(), "--output-dir", out.to_str().unwrap()]
            .into_iter()
            .chain(["--seq-len", "512", "--max-steps", "150", "--lr", "3e-3", "--lr-scheduler", "cosine"])
            .collect::<Vec<_>>(),
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    out
}

/// The answer's choice and the prompt's length.
fn ask_counted(server: &Server, messages: Value) -> (Value, u64) {
    let body = json!({"model": "tiny", "messages": messages, "tools": tools(), "max_tokens": 200, "temperature": 0});
    let answer = post_json(&server.url("/v1/chat/completions"), &body);
    (answer["choices"][0].clone(), answer["usage"]["prompt_tokens"].as_u64().unwrap())
}

fn ask(server: &Server, messages: Value) -> Value {
    ask_counted(server, messages).0
}

fn check(model: &Path, what: &str) {
    let server = Server::start(model, &[]);
    let question = json!({"role": "user", "content": QUESTION});
    let (first, prompt_tokens) = ask_counted(&server, json!([question]));
    // `/tokenize` renders the functions as the chat endpoint does.
    let counted = post_json(&server.url("/tokenize"), &json!({"model": "tiny", "messages": [question], "tools": tools()}));
    assert_eq!(counted["count"].as_u64(), Some(prompt_tokens), "{what}: {counted}");
    assert_eq!(first["finish_reason"], "tool_calls", "{what}: {first}");
    let made = &first["message"]["tool_calls"][0];
    assert_eq!(made["function"]["name"], "get_weather", "{what}: {first}");
    let args: Value = serde_json::from_str(made["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}), "{what}: {first}");

    // The client runs the function and sends its result back, as an agent loop does.
    let result = json!({"role": "tool", "tool_call_id": made["id"], "content": RESULT});
    let second = ask(&server, json!([question, first["message"], result]));
    assert_eq!((second["message"]["content"].as_str(), second["finish_reason"].as_str()), (Some(ANSWER), Some("stop")), "{what}: {second}");

    let greeting = ask(&server, json!([{"role": "user", "content": GREETING}]));
    assert_eq!(greeting["message"]["content"].as_str(), Some(REPLY), "{what}: {greeting}");
}

#[test]
fn a_model_tuned_on_calls_through_its_templates_tools_calls_and_answers_when_served() {
    let tmp = tempfile::tempdir().unwrap();
    check(&tuned(tmp.path(), Some(Family::Hermes.template())), "Qwen-shaped template");
}

#[test]
fn a_model_whose_template_knows_no_tools_learns_the_servers_generic_call_format() {
    let tmp = tempfile::tempdir().unwrap();
    check(&tuned(tmp.path(), None), "template without tools");
}
