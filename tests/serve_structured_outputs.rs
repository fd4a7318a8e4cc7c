//! vLLM's structured outputs (`structured_outputs`, and the older `guided_*` fields) and
//! llama.cpp's server's `grammar` and `json_schema`, against a real server on SmolLM2: the shape of each answer over HTTP here (so that a failure names the
//! answer), then `tests/structured_outputs_client.py` with the real `openai` client sending them
//! through `extra_body`, as vLLM's docs do.

mod common;

use common::server::*;
use common::*;
use serde_json::{json, Value};

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
        "max_tokens": 40, "temperature": 1.0, "seed": 11});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

#[test]
fn answers_follow_vllms_structured_outputs() {
    let Some(gguf) = smollm2_gguf_or_skip("answers_follow_vllms_structured_outputs") else { return };
    let server = Server::start(&gguf, &[]);
    let url = server.url("/v1/chat/completions");

    // Unconstrained, this prompt's sampled answer is a sentence; a choice holds it to the words.
    let free = post_json(&url, &chat(json!({})));
    let free_text = free["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!["maybe", "certainly"].contains(&free_text), "{free}");
    let chosen = post_json(&url, &chat(json!({"n": 3, "structured_outputs": {"choice": ["maybe", "certainly"]}})));
    for c in chosen["choices"].as_array().unwrap() {
        assert!(["maybe", "certainly"].contains(&c["message"]["content"].as_str().unwrap()), "{chosen}");
        assert_eq!(c["finish_reason"], "stop", "{chosen}");
    }

    // A regex on completions, token ids as the prompt too.
    let completion = |extra: Value| {
        let mut body =
            json!({"model": "tiny", "prompt": "The year the Berlin wall fell:", "max_tokens": 12, "temperature": 1.0, "seed": 2});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        post_json(&server.url("/v1/completions"), &body)
    };
    // response_format on completions too, as vLLM takes it.
    let schema =
        json!({"type": "object", "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 1999}}, "required": ["year"]});
    let json_answer =
        completion(json!({"max_tokens": 20, "response_format": {"type": "json_schema", "json_schema": {"name": "y", "schema": schema}}}));
    let parsed: Value =
        serde_json::from_str(json_answer["choices"][0]["text"].as_str().unwrap()).unwrap_or_else(|e| panic!("{e}: {json_answer}"));
    assert!(parsed["year"].as_i64().is_some_and(|y| (1900..=1999).contains(&y)), "{json_answer}");
    let year = completion(json!({"guided_regex": " 19[0-9]{2}"}));
    let text = year["choices"][0]["text"].as_str().unwrap();
    assert!(text.len() == 5 && text.starts_with(" 19") && text[3..].chars().all(|c| c.is_ascii_digit()), "{year}");

    // A GBNF grammar (llama.cpp's syntax), streamed.
    let gbnf = "root ::= \"The answer is \" (\"yes\" | \"no\") \".\"";
    let lines = sse(&url, &chat(json!({"stream": true, "structured_outputs": {"grammar": gbnf}})));
    let streamed: String = lines[..lines.len() - 1]
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).unwrap()["choices"].get(0)?["delta"]["content"].as_str().map(str::to_string))
        .collect();
    assert!(["The answer is yes.", "The answer is no."].contains(&streamed.as_str()), "{lines:?}");

    // llama.cpp's server's fields: a GBNF `grammar`, a `json_schema`.
    let yes_no = post_json(&url, &chat(json!({"grammar": "root ::= (\"yes\" | \"no\") \"!\""})));
    assert!(["yes!", "no!"].contains(&yes_no["choices"][0]["message"]["content"].as_str().unwrap()), "{yes_no}");
    let schema = json!({"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 2, "maxItems": 2});
    let list = post_json(&url, &chat(json!({"json_schema": schema, "max_tokens": 60})));
    let items: Value = serde_json::from_str(list["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
    assert_eq!(items.as_array().map(|a| a.iter().filter(|s| s.is_string()).count()), Some(2), "{list}");

    // Errors name the field, and the line of a GBNF grammar.
    let refused = |body: Value| {
        let (status, text, _) = post(&url, &body.to_string(), None);
        let e: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(status, 400, "{text}");
        (e["error"]["param"].as_str().unwrap().to_string(), e["error"]["message"].as_str().unwrap().to_string())
    };
    let (param, message) = refused(chat(json!({"structured_outputs": {"grammar": "root ::= a\na ::= \"x\" b"}})));
    assert_eq!(param, "structured_outputs.grammar");
    assert!(message.contains("line 2: no rule is named `b`"), "{message}");
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let (param, _) = refused(chat(json!({"tools": tools, "guided_regex": "a"})));
    assert_eq!(param, "guided_regex", "a regex cannot be an auto answer's alternative to a call");
    let (param, _) = refused(chat(json!({"structured_outputs": {"structural_tag": "{}"}})));
    assert_eq!(param, "structured_outputs.structural_tag");

    let Some(python) = python_or_skip("answers_follow_vllms_structured_outputs", &["openai"]) else { return };
    run_client_script(&python, "structured_outputs_client.py", &server, "", "tiny", &[]);
}
