//! A reasoning model's thinking against a real server: a qwen3 fixture fine-tuned by our own
//! `finetune` to think before it answers (`<think> ... </think>`, as Qwen3 writes), served with a
//! chat template that has Qwen3's thinking switch. Its thinking comes back as
//! `reasoning_content` apart from the answer, whole and streamed (split exactly at the tags,
//! whichever tokens they span), counted in `completion_tokens_details.reasoning_tokens`;
//! `enable_thinking: false` renders the no-think prompt; a JSON schema (or vLLM's
//! `structured_outputs`) holds the answer after the thinking, not the thinking;
//! `--reasoning-parser none` leaves the text whole; Anthropic's, the Responses API's and Ollama's
//! shapes of the same.

mod common;

use common::reasoning::{thinking_model, ANSWER, THINKING};
use common::server::*;
use common::*;
use serde_json::{json, Value};

fn chat_body(extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

#[test]
fn thinking_is_split_from_the_answer_whole_and_streamed() {
    let tmp = tempfile::tempdir().unwrap();
    let model = thinking_model(tmp.path());
    let server = Server::start(&model, &[]);
    let url = server.url("/v1/chat/completions");

    let whole = post_json(&url, &chat_body(json!({})));
    let message = &whole["choices"][0]["message"];
    assert_eq!((message["reasoning_content"].as_str(), message["content"].as_str()), (Some(THINKING), Some(ANSWER)), "{whole}");
    assert_eq!(message["reasoning"], message["reasoning_content"], "vLLM's name too");
    let usage = &whole["usage"];
    let reasoning_tokens = usage["completion_tokens_details"]["reasoning_tokens"].as_u64().unwrap();
    assert!(reasoning_tokens > 0 && reasoning_tokens < usage["completion_tokens"].as_u64().unwrap(), "{usage}");

    // Streamed: thinking deltas, then answer deltas, adding up to the whole answer's parts.
    let lines = sse(&url, &chat_body(json!({"stream": true, "stream_options": {"include_usage": true}})));
    let chunks: Vec<Value> = lines[..lines.len() - 1].iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    let part =
        |key: &str| -> String { chunks.iter().filter_map(|c| c["choices"].get(0)?["delta"][key].as_str().map(str::to_string)).collect() };
    assert_eq!((part("reasoning_content"), part("content")), (THINKING.to_string(), ANSWER.to_string()), "{lines:?}");
    assert_eq!(part("reasoning"), THINKING);
    let last_thinking = chunks.iter().rposition(|c| c["choices"].get(0).is_some_and(|ch| ch["delta"]["reasoning_content"].is_string()));
    let first_answer =
        chunks.iter().position(|c| c["choices"].get(0).is_some_and(|ch| ch["delta"]["content"].as_str().is_some_and(|t| !t.is_empty())));
    assert!(last_thinking < first_answer, "thinking comes first: {lines:?}");
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens_details"]["reasoning_tokens"], json!(reasoning_tokens));

    // The template's no-think prompt: no thinking to split out.
    let off = post_json(&url, &chat_body(json!({"chat_template_kwargs": {"enable_thinking": false}})));
    assert!(off["choices"][0]["message"].get("reasoning_content").is_none_or(Value::is_null), "{off}");
    assert!(off["usage"]["prompt_tokens"].as_u64() > whole["usage"]["prompt_tokens"].as_u64(), "the closed think block is in the prompt");

    // A schema holds the answer after the thinking: the model thinks as trained, then writes JSON.
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false});
    let format = json!({"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}, "max_tokens": 60});
    let constrained = post_json(&url, &chat_body(format));
    let message = &constrained["choices"][0]["message"];
    assert_eq!(message["reasoning_content"].as_str(), Some(THINKING), "{constrained}");
    let answer: Value = serde_json::from_str(message["content"].as_str().unwrap().trim()).unwrap_or_else(|e| panic!("{e}: {constrained}"));
    assert!(answer["ok"].is_boolean(), "{answer}");
    // So does vLLM's `structured_outputs` (here a choice, which the answer otherwise is not).
    let chosen = post_json(&url, &chat_body(json!({"structured_outputs": {"choice": ["Goodbye.", "Maybe."]}, "max_tokens": 60})));
    let message = &chosen["choices"][0]["message"];
    assert_eq!(message["reasoning_content"].as_str(), Some(THINKING), "{chosen}");
    assert!(["Goodbye.", "Maybe."].contains(&message["content"].as_str().unwrap().trim()), "{chosen}");

    // A forced call from a reasoning model: the call comes back parsed. (This template renders no
    // tools, so the generic tool prompt changes the prompt and the tiny model does not think
    // here; the grammar's wait for the thinking is shown by the schema above.)
    let tools = json!([{"type": "function", "function": {"name": "greet", "parameters": {"type": "object", "properties": {"loud": {"type": "boolean"}}, "required": ["loud"], "additionalProperties": false}}}]);
    let called = post_json(&url, &chat_body(json!({"tools": tools, "tool_choice": "required", "max_tokens": 80})));
    let message = &called["choices"][0]["message"];
    assert_eq!(message["tool_calls"][0]["function"]["name"], "greet", "{called}");
    let thought = message.get("reasoning_content").is_some_and(|r| !r.is_null());
    assert_eq!(thought, called["usage"]["completion_tokens_details"]["reasoning_tokens"].as_u64() > Some(0), "{called}");
    let args: Value = serde_json::from_str(message["tool_calls"][0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["loud"].is_boolean(), "{args}");
}

#[test]
fn reasoning_parser_none_leaves_the_thinking_in_the_text() {
    let tmp = tempfile::tempdir().unwrap();
    let model = thinking_model(tmp.path());
    let server = Server::start(&model, &["--reasoning-parser", "none"]);
    let whole = post_json(&server.url("/v1/chat/completions"), &chat_body(json!({})));
    let message = &whole["choices"][0]["message"];
    assert_eq!(message["content"].as_str(), Some(format!("<think>{THINKING}</think>{ANSWER}").as_str()), "{whole}");
    assert!(message.get("reasoning_content").is_none() && whole["usage"].get("completion_tokens_details").is_none(), "{whole}");
    let o = run_cli(&["serve", "--model", model.to_str().unwrap(), "--reasoning-parser", "mistral"], &[]);
    assert!(!o.status.success() && stderr(&o).contains("--reasoning-parser"), "{}", stderr(&o));
}

/// The Responses API: the thinking is a `reasoning` item before the message, whole and streamed
/// (`response.reasoning_text.delta` events adding up to it), counted in
/// `output_tokens_details.reasoning_tokens`; output items sent back as input (as the Agents SDK
/// replays them), the reasoning item among them, are taken.
#[test]
fn the_responses_api_returns_the_thinking_as_a_reasoning_item() {
    let tmp = tempfile::tempdir().unwrap();
    let model = thinking_model(tmp.path());
    let server = Server::start(&model, &[]);
    let url = server.url("/v1/responses");
    let body = json!({"model": "tiny", "input": "Hi", "max_output_tokens": 40, "temperature": 0});
    let whole = post_json(&url, &body);
    let output = whole["output"].as_array().unwrap();
    assert_eq!(output.iter().map(|i| i["type"].as_str().unwrap()).collect::<Vec<_>>(), ["reasoning", "message"], "{whole}");
    assert_eq!(output[0]["content"][0], json!({"type": "reasoning_text", "text": THINKING}));
    assert_eq!(output[1]["content"][0]["text"].as_str(), Some(ANSWER));
    assert!(whole["usage"]["output_tokens_details"]["reasoning_tokens"].as_u64() > Some(0), "{whole}");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = ureq::post(&url).set("Content-Type", "application/json").send_string(&streamed.to_string()).unwrap();
    let events: Vec<Value> = std::io::BufRead::lines(std::io::BufReader::new(r.into_reader()))
        .map(Result::unwrap)
        .filter_map(|l| l.strip_prefix("data: ").map(|d| serde_json::from_str(d).unwrap()))
        .collect();
    let deltas = |kind: &str| -> String { events.iter().filter(|e| e["type"] == kind).map(|e| e["delta"].as_str().unwrap()).collect() };
    assert_eq!(deltas("response.reasoning_text.delta"), THINKING);
    assert_eq!(deltas("response.output_text.delta"), ANSWER);
    let done = events.iter().find(|e| e["type"] == "response.completed").expect("completed");
    let kinds_and_texts = |items: &Value| -> Vec<(String, String)> {
        items.as_array().unwrap().iter().map(|i| (i["type"].to_string(), i["content"][0]["text"].to_string())).collect()
    };
    assert_eq!(kinds_and_texts(&done["response"]["output"]), kinds_and_texts(&whole["output"]));

    let mut history = vec![json!({"role": "user", "content": "Hi"})];
    history.extend(output.iter().cloned());
    history.push(json!({"role": "user", "content": "Hi"}));
    let next = post_json(&url, &json!({"model": "tiny", "input": history, "max_output_tokens": 40, "temperature": 0}));
    assert_eq!(next["status"], "completed", "{next}");
}

/// Anthropic's Messages API: thinking off by default (the template's no-think prompt, no thinking
/// block); `thinking: enabled` gives a `thinking` block before the text, whole and streamed
/// (`thinking_delta`s, then its `signature_delta`); `display: omitted` an empty one; a
/// `budget_tokens` below the model's thinking closes it there, and the answer follows.
#[test]
fn the_messages_api_returns_thinking_blocks_and_holds_the_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let model = thinking_model(tmp.path());
    let server = Server::start(&model, &[]);
    let url = server.url("/v1/messages");
    let body = |thinking: Value| {
        let mut b = json!({"model": "tiny", "max_tokens": 40, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]});
        if !thinking.is_null() {
            b["thinking"] = thinking;
        }
        b
    };
    let kinds =
        |m: &Value| -> Vec<String> { m["content"].as_array().unwrap().iter().map(|b| b["type"].as_str().unwrap().to_string()).collect() };

    let off = post_json(&url, &body(Value::Null));
    assert_eq!(kinds(&off), ["text"], "{off}");
    let chat_off = post_json(&server.url("/v1/chat/completions"), &chat_body(json!({"chat_template_kwargs": {"enable_thinking": false}})));
    assert_eq!(off["content"][0]["text"], chat_off["choices"][0]["message"]["content"], "thinking off is the template's no-think prompt");

    let on = post_json(&url, &body(json!({"type": "enabled", "budget_tokens": 30})));
    assert_eq!(
        on["content"],
        json!([{"type": "thinking", "thinking": THINKING, "signature": ""}, {"type": "text", "text": ANSWER}]),
        "{on}"
    );
    let omitted = post_json(&url, &body(json!({"type": "adaptive", "display": "omitted"})));
    assert_eq!(omitted["content"][0], json!({"type": "thinking", "thinking": "", "signature": ""}), "{omitted}");
    assert_eq!(omitted["content"][1]["text"].as_str(), Some(ANSWER));

    let mut streamed = body(json!({"type": "enabled", "budget_tokens": 30}));
    streamed["stream"] = json!(true);
    let events: Vec<Value> = sse(&url, &streamed).iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    let deltas = |kind: &str, key: &str| -> String {
        events.iter().filter(|e| e["delta"]["type"] == kind).map(|e| e["delta"][key].as_str().unwrap()).collect()
    };
    assert_eq!((deltas("thinking_delta", "thinking"), deltas("text_delta", "text")), (THINKING.to_string(), ANSWER.to_string()));
    let at = |pred: &dyn Fn(&Value) -> bool| events.iter().position(pred).unwrap();
    let signature = at(&|e| e["delta"]["type"] == "signature_delta");
    assert!(at(&|e| e["delta"]["type"] == "thinking_delta") < signature, "{events:?}");
    assert!(signature < at(&|e| e["type"] == "content_block_stop") && signature < at(&|e| e["delta"]["type"] == "text_delta"));

    // A budget of 2 tokens: the thinking stops short of the model's, its end is written for it,
    // and the answer follows it.
    let short = post_json(&url, &body(json!({"type": "enabled", "budget_tokens": 2})));
    assert_eq!(kinds(&short), ["thinking", "text"], "{short}");
    let thought = short["content"][0]["thinking"].as_str().unwrap();
    assert!(thought.len() < THINKING.len() && THINKING.starts_with(thought.trim_end()), "{short}");
    assert!(!short["content"][1]["text"].as_str().unwrap().trim().is_empty(), "{short}");
}

/// Ollama's `/api/chat` and `/api/generate`: the thinking in `thinking`, whole and streamed;
/// `think: false` is the template's no-think prompt.
#[test]
fn ollamas_api_returns_the_thinking_apart() {
    let tmp = tempfile::tempdir().unwrap();
    let model = thinking_model(tmp.path());
    let server = Server::start(&model, &[]);
    let body = |extra: Value| {
        let mut b =
            json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "options": {"temperature": 0, "num_predict": 40}});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let whole = post_json(&server.url("/api/chat"), &body(json!({"stream": false, "think": true})));
    assert_eq!(whole["message"], json!({"role": "assistant", "content": ANSWER, "thinking": THINKING}), "{whole}");
    let r = ureq::post(&server.url("/api/chat")).send_json(body(json!({}))).unwrap();
    let parts: Vec<Value> =
        std::io::BufRead::lines(std::io::BufReader::new(r.into_reader())).map(|l| serde_json::from_str(&l.unwrap()).unwrap()).collect();
    let joined = |key: &str| -> String { parts.iter().filter_map(|p| p["message"][key].as_str()).collect() };
    assert_eq!((joined("thinking"), joined("content")), (THINKING.to_string(), ANSWER.to_string()), "{parts:?}");

    let off = post_json(&server.url("/api/chat"), &body(json!({"stream": false, "think": false})));
    let chat_off = post_json(&server.url("/v1/chat/completions"), &chat_body(json!({"chat_template_kwargs": {"enable_thinking": false}})));
    assert_eq!(off["message"]["content"], chat_off["choices"][0]["message"]["content"], "{off}");
    assert_eq!(off["message"].get("thinking"), chat_off["choices"][0]["message"].get("reasoning_content").filter(|r| !r.is_null()));

    let gen = post_json(
        &server.url("/api/generate"),
        &json!({"model": "tiny", "prompt": "Hi", "stream": false, "options": {"temperature": 0, "num_predict": 40}}),
    );
    assert_eq!((&gen["thinking"], &gen["response"]), (&json!(THINKING), &json!(ANSWER)), "{gen}");
}

/// A past answer's thinking, sent back as each API's clients send it, reaches the template (this
/// one writes every turn's): chat's `reasoning_content` (the `openai` client's message object)
/// and vLLM's `reasoning`, Anthropic's `thinking` blocks, the Responses API's reasoning items;
/// the same tokens each way. The `openai` and `anthropic` clients send their answers back
/// (tests/reasoning_client.py).
#[test]
fn a_past_answers_thinking_reaches_the_template_from_every_api() {
    let tmp = tempfile::tempdir().unwrap();
    let model = thinking_model(tmp.path());
    let server = Server::start(&model, &[]);
    let hi = json!({"role": "user", "content": "Hi"});
    let chat_prompt = |answer: Value| {
        let body = json!({"model": "tiny", "messages": [hi, answer, hi], "chat_template_kwargs": {"enable_thinking": false}});
        post_json(&server.url("/tokenize"), &body)["tokens"].clone()
    };
    let text = |ids: &Value| post_json(&server.url("/detokenize"), &json!({"tokens": ids}))["prompt"].as_str().unwrap().to_string();
    let plain = chat_prompt(json!({"role": "assistant", "content": ANSWER}));
    let thought = chat_prompt(json!({"role": "assistant", "content": ANSWER, "reasoning_content": THINKING, "refusal": null}));
    assert!(text(&thought).contains(&format!("<|im_start|>assistant\n<think>{THINKING}</think>{ANSWER}<|im_end|>")), "{}", text(&thought));
    assert_eq!(chat_prompt(json!({"role": "assistant", "content": ANSWER, "reasoning": THINKING})), thought);
    let added = thought.as_array().unwrap().len() - plain.as_array().unwrap().len();

    // Anthropic's count_tokens (thinking off: the same no-think prompt as above).
    let count = |answer: Value| {
        let body = json!({"model": "tiny", "messages": [hi, {"role": "assistant", "content": answer}, hi]});
        post_json(&server.url("/v1/messages/count_tokens"), &body)["input_tokens"].as_u64().unwrap() as usize
    };
    let text_block = json!({"type": "text", "text": ANSWER});
    let thinking_block = json!({"type": "thinking", "thinking": THINKING, "signature": ""});
    assert_eq!(count(json!([thinking_block, text_block])) - count(json!([text_block])), added);
    assert_eq!(count(json!([text_block])), plain.as_array().unwrap().len());

    // The Responses API's input items (its prompt opens the thinking: the counts differ from
    // the above by the same amount).
    let input_tokens = |items: Vec<Value>| {
        let input: Vec<Value> = [vec![hi.clone()], items, vec![hi.clone()]].concat();
        let body = json!({"model": "tiny", "input": input, "max_output_tokens": 1});
        post_json(&server.url("/v1/responses"), &body)["usage"]["input_tokens"].as_u64().unwrap() as usize
    };
    let message = json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ANSWER}]});
    let reasoning = json!({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": THINKING}]});
    assert_eq!(input_tokens(vec![reasoning, message.clone()]) - input_tokens(vec![message]), added);

    // A bad one is named.
    let conflict = json!({"model": "tiny", "max_tokens": 1,
        "messages": [hi, {"role": "assistant", "content": ANSWER, "reasoning": "a", "reasoning_content": "b"}, hi]});
    let (status, body, _) = post(&server.url("/v1/chat/completions"), &conflict.to_string(), None);
    let param = serde_json::from_str::<Value>(&body).unwrap()["error"]["param"].clone();
    assert_eq!((status, param), (400, json!("messages[1].reasoning")), "{body}");

    let Some(python) = python_or_skip("a_past_answers_thinking_reaches_the_template_from_every_api", &["openai", "anthropic"]) else {
        return;
    };
    run_client_script(&python, "reasoning_client.py", &server, "", "tiny", &[("THINKING", THINKING)]);
}
