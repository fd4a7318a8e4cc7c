//! `POST /v1/responses` read into the chat path's values: `instructions` and `input` (a string,
//! or items: messages, `function_call`, `function_call_output`) become the conversation; flat
//! function `tools` and `tool_choice` become chat's; `text.format` becomes `response_format`;
//! `max_output_tokens` the answer's length. Responses are not stored: `store: true` and
//! `previous_response_id` are refused by name.

use serde_json::{json, Map, Value};

use crate::serve::error::ApiError;
use crate::serve::fields::{self, Fields};
use crate::tokenize::ChatMessage;

/// What the response object repeats of its request (OpenAI's response echoes its settings).
pub struct Echo(pub Map<String, Value>);

/// The request as chat takes it: the conversation, and a chat-shaped body for the fields chat
/// reads (tools, tool_choice, parallel_tool_calls, response_format, sampling).
pub struct AsChat {
    pub messages: Vec<ChatMessage>,
    pub chat: Value,
    pub max_output_tokens: Option<usize>,
    pub echo: Echo,
}

pub fn read(v: &Value, lenient: bool, ignored: &mut Vec<String>) -> Result<AsChat, ApiError> {
    let f = Fields::of(v)?;
    if f.bool("store")? == Some(true) {
        return Err(ApiError::invalid(
            "store",
            "`store: true` is not supported by this server (fsdp-app keeps no responses); send false or leave it out.",
        )
        .with_code("unsupported_parameter"));
    }
    if f.value("previous_response_id").is_some() {
        return Err(ApiError::invalid(
            "previous_response_id",
            "`previous_response_id` is not supported by this server (responses are not stored); send the conversation in `input`.",
        )
        .with_code("unsupported_parameter"));
    }
    match f.value("include") {
        None => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(_) => {
            return Err(ApiError::invalid("include", "`include` is not supported by this server (fsdp-app); leave it out or send [].")
                .with_code("unsupported_parameter"))
        }
    }
    match f.string("truncation")? {
        None | Some("disabled") => {}
        Some(_) => {
            return Err(ApiError::invalid(
                "truncation",
                "only `truncation: \"disabled\"` is supported (a prompt longer than the context is refused).",
            ))
        }
    }
    let effort = match f.value("reasoning") {
        None => None,
        Some(Value::Object(r)) => {
            ignored.extend(fields::check(&Value::Object(r.clone()), &["effort"], "reasoning", lenient)?);
            r.get("effort").filter(|e| !e.is_null()).cloned()
        }
        Some(_) => return Err(ApiError::invalid("reasoning", "`reasoning` must be an object such as {\"effort\": \"low\"}.")),
    };
    let mut messages = vec![];
    if let Some(i) = f.string("instructions")? {
        messages.push(ChatMessage::new("system", i));
    }
    match f.value("input") {
        Some(Value::String(s)) => messages.push(ChatMessage::new("user", s)),
        Some(Value::Array(items)) if !items.is_empty() => {
            for (i, item) in items.iter().enumerate() {
                input_item(item, &format!("input[{i}]"), &mut messages, lenient, ignored)?;
            }
        }
        _ => return Err(ApiError::invalid("input", "`input` must be a string or a non-empty list of items.")),
    }
    let mut chat = Map::new();
    for k in ["model", "temperature", "top_p", "seed", "stream", "user"] {
        if let Some(x) = f.value(k) {
            chat.insert(k.into(), x.clone());
        }
    }
    if let Some(e) = effort {
        chat.insert("reasoning_effort".into(), e);
    }
    // `tools: []` is the Responses API's default (its response objects echo it), and clients send
    // it when no tool is enabled (the Agents SDK does): no functions, and then `auto`, `none` and
    // `parallel_tool_calls` choose nothing. Chat takes the rest (`required` without tools is a 400).
    let tools = f.value("tools").filter(|t| t.as_array().is_none_or(|a| !a.is_empty()));
    if let Some(tools) = tools {
        chat.insert("tools".into(), chat_tools(tools)?);
    }
    if let Some(p) = f.bool("parallel_tool_calls")?.filter(|_| tools.is_some()) {
        chat.insert("parallel_tool_calls".into(), Value::Bool(p));
    }
    if let Some(choice) = f.value("tool_choice").filter(|c| tools.is_some() || !(*c == "auto" || *c == "none")) {
        // `{"type": "function", "name": ...}`: chat's reader takes the flat name too.
        chat.insert("tool_choice".into(), choice.clone());
    }
    if let Some(format) = f.value("text") {
        if let Some(rf) = text_format(format, lenient, ignored)? {
            chat.insert("response_format".into(), rf);
        }
    }
    let max_output_tokens = f.integer("max_output_tokens", 1, 1 << 31)?.map(|n| n as usize);
    let mut echo = Map::new();
    for k in [
        "instructions",
        "metadata",
        "tool_choice",
        "tools",
        "temperature",
        "top_p",
        "max_output_tokens",
        "parallel_tool_calls",
        "text",
        "user",
    ] {
        echo.insert(k.into(), f.value(k).cloned().unwrap_or(Value::Null));
    }
    Ok(AsChat { messages, chat: Value::Object(chat), max_output_tokens, echo: Echo(echo) })
}

/// One `input` item into the conversation.
fn input_item(item: &Value, at: &str, messages: &mut Vec<ChatMessage>, lenient: bool, ignored: &mut Vec<String>) -> Result<(), ApiError> {
    let Value::Object(o) = item else { return Err(ApiError::invalid(at, format!("`{at}` must be an object."))) };
    let kind = o.get("type").and_then(Value::as_str).unwrap_or("message");
    let string = |k: &str| -> Result<String, ApiError> {
        o.get(k)
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| ApiError::invalid(&format!("{at}.{k}"), format!("`{k}` must be a string.")))
    };
    match kind {
        "message" => {
            ignored.extend(fields::check(item, &["type", "role", "content", "id", "status", "name"], at, lenient)?);
            let role = match o.get("role").and_then(Value::as_str) {
                Some(r @ ("user" | "assistant" | "system")) => r,
                Some("developer") => "system",
                _ => return Err(ApiError::invalid(&format!("{at}.role"), "`role` must be user, assistant, system or developer.")),
            };
            let content = match o.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .enumerate()
                    .map(|(j, p)| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("input_text" | "output_text" | "text"), Some(t)) => Ok(t.to_string()),
                        _ => Err(ApiError::invalid(
                            &format!("{at}.content[{j}]"),
                            "only text parts (input_text, output_text) are supported.",
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .join("\n"),
                _ => return Err(ApiError::invalid(&format!("{at}.content"), "`content` must be a string or a list of text parts.")),
            };
            let name = o.get("name").and_then(Value::as_str).map(str::to_string);
            match messages.last_mut() {
                // The answer after a reasoning item: the same assistant turn.
                Some(m)
                    if role == "assistant"
                        && m.role == "assistant"
                        && m.reasoning.is_some()
                        && m.content.is_empty()
                        && m.tool_calls.is_none() =>
                {
                    (m.content, m.name) = (content, name)
                }
                _ => {
                    let mut m = ChatMessage::new(role, &content);
                    m.name = name;
                    messages.push(m);
                }
            }
        }
        "function_call" => {
            ignored.extend(fields::check(item, &["type", "call_id", "name", "arguments", "id", "status"], at, lenient)?);
            let (call_id, name, arguments) = (string("call_id")?, string("name")?, string("arguments")?);
            let arguments: Value = serde_json::from_str(&arguments)
                .map_err(|e| ApiError::invalid(&format!("{at}.arguments"), format!("`arguments` is not JSON: {e}")))?;
            let call = json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}});
            // Calls that follow an assistant turn (or each other) belong to it.
            match messages.last_mut() {
                Some(m) if m.role == "assistant" => {
                    m.tool_calls.get_or_insert_with(|| json!([])).as_array_mut().expect("a list").push(call)
                }
                _ => {
                    let mut m = ChatMessage::new("assistant", "");
                    m.tool_calls = Some(json!([call]));
                    messages.push(m);
                }
            }
        }
        "function_call_output" => {
            ignored.extend(fields::check(item, &["type", "call_id", "output", "id", "status"], at, lenient)?);
            let (output, call_id) = (string("output")?, string("call_id")?);
            // An output answers a call earlier in `input` (no responses are stored to hold it),
            // as OpenAI requires: one that answers nothing is the caller's mistake.
            let mut calls = messages.iter().filter_map(|m| m.tool_calls.as_ref()).filter_map(Value::as_array).flatten();
            if !calls.any(|c| c["id"] == call_id.as_str()) {
                return Err(ApiError::invalid(
                    &format!("{at}.call_id"),
                    format!("No tool call found for function call output with call_id {call_id:?}: a function_call item with it must come earlier in `input`."),
                ));
            }
            let mut m = ChatMessage::new("tool", &output);
            m.tool_call_id = Some(call_id);
            messages.push(m);
        }
        // A reasoning item of an earlier answer, sent back as clients replay output items (the
        // Agents SDK does): the thinking of the assistant turn its message or calls that follow
        // make (the template decides whether a past turn's thinking is shown again). Its text is
        // `content`'s reasoning_text parts, else `summary`'s; `encrypted_content` holds none.
        "reasoning" => {
            ignored.extend(fields::check(item, &["type", "id", "summary", "content", "encrypted_content", "status"], at, lenient)?);
            let texts = |key: &str, kind: &str| -> Result<Vec<String>, ApiError> {
                let parts = match o.get(key) {
                    None | Some(Value::Null) => return Ok(vec![]),
                    Some(Value::Array(parts)) => parts,
                    Some(_) => return Err(ApiError::invalid(&format!("{at}.{key}"), format!("`{key}` must be a list of {kind} parts."))),
                };
                parts
                    .iter()
                    .enumerate()
                    .map(|(j, p)| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some(t), Some(text)) if t == kind => Ok(text.to_string()),
                        _ => Err(ApiError::invalid(
                            &format!("{at}.{key}[{j}]"),
                            format!("each part must be {{\"type\": \"{kind}\", \"text\": ...}}."),
                        )),
                    })
                    .collect()
            };
            let (content, summary) = (texts("content", "reasoning_text")?, texts("summary", "summary_text")?);
            let thinking = if content.is_empty() { summary } else { content };
            if !thinking.is_empty() {
                let mut m = ChatMessage::new("assistant", "");
                m.reasoning = Some(thinking.join("\n"));
                messages.push(m);
            }
        }
        other => {
            return Err(ApiError::invalid(
                &format!("{at}.type"),
                format!("input items of type {other:?} are not supported (message, function_call, function_call_output, reasoning)."),
            ))
        }
    }
    Ok(())
}

/// Responses' flat function tools as chat's `{"type": "function", "function": {...}}`.
fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let Value::Array(list) = tools else { return Err(ApiError::invalid("tools", "`tools` must be a list of function tools.")) };
    let converted = list
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let at = format!("tools[{i}]");
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ApiError::invalid(&format!("{at}.type"), "only tools of type \"function\" are supported."));
            }
            fields::check(t, &["type", "name", "description", "parameters", "strict"], &at, false)?;
            let mut function = t.as_object().cloned().unwrap_or_default();
            function.remove("type");
            Ok(json!({"type": "function", "function": function}))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Value::Array(converted))
}

/// `text.format` as chat's `response_format` (None for plain text).
fn text_format(text: &Value, lenient: bool, ignored: &mut Vec<String>) -> Result<Option<Value>, ApiError> {
    let Value::Object(t) = text else {
        return Err(ApiError::invalid("text", "`text` must be an object such as {\"format\": {\"type\": \"text\"}}."));
    };
    ignored.extend(fields::check(text, &["format"], "text", lenient)?);
    let Some(format) = t.get("format").filter(|f| !f.is_null()) else { return Ok(None) };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            ignored.extend(fields::check(format, &["type", "name", "schema", "strict", "description"], "text.format", lenient)?);
            let mut schema = format.as_object().cloned().unwrap_or_default();
            schema.remove("type");
            Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
        }
        _ => Err(ApiError::invalid("text.format.type", "`text.format.type` must be text, json_object or json_schema.")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_tools_are_no_tools_and_what_needs_tools_still_fails() {
        let read_chat = |extra: Value| {
            let mut v = json!({"model": "m", "input": "hi"});
            v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            read(&v, false, &mut vec![]).map(|r| r.chat)
        };
        let chat = read_chat(json!({"tools": [], "tool_choice": "auto", "parallel_tool_calls": true})).unwrap();
        assert_eq!(chat, json!({"model": "m"}));
        // `required` with no tools reaches chat's reader, which refuses it by name.
        assert_eq!(read_chat(json!({"tools": [], "tool_choice": "required"})).unwrap()["tool_choice"], "required");
        assert_eq!(
            read_chat(json!({"tools": [], "parallel_tool_calls": "yes"})).unwrap_err().param.as_deref(),
            Some("parallel_tool_calls")
        );
        let tool = json!([{"type": "function", "name": "f", "parameters": {"type": "object"}}]);
        let chat = read_chat(json!({"tools": tool, "tool_choice": "auto", "parallel_tool_calls": false, "seed": 3})).unwrap();
        assert_eq!(
            (chat["tool_choice"].clone(), chat["parallel_tool_calls"].clone(), chat["seed"].clone()),
            (json!("auto"), json!(false), json!(3))
        );
        assert_eq!(chat["tools"][0]["function"]["name"], "f");
    }

    /// Output items sent back as input: a reasoning item is the thinking of the assistant turn
    /// its message or calls make.
    #[test]
    fn a_replayed_reasoning_item_is_its_turns_thinking() {
        let read_input = |input: Value| read(&json!({"model": "m", "input": input}), false, &mut vec![]).map(|r| r.messages);
        let thought =
            |text: &str| json!({"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": text}]});
        let messages = read_input(json!([
            {"role": "user", "content": "Weather?"},
            thought("look it up"),
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            thought("say it"),
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
            {"role": "user", "content": "Thanks"},
        ]))
        .unwrap();
        let turns: Vec<(&str, &str, Option<&str>, bool)> =
            messages.iter().map(|m| (m.role.as_str(), m.content.as_str(), m.reasoning.as_deref(), m.tool_calls.is_some())).collect();
        assert_eq!(
            turns,
            [
                ("user", "Weather?", None, false),
                ("assistant", "", Some("look it up"), true),
                ("tool", "sunny", None, false),
                ("assistant", "Sunny.", Some("say it"), false),
                ("user", "Thanks", None, false)
            ]
        );
        // A summary stands in for the text; an encrypted item holds none.
        let summary = json!({"type": "reasoning", "summary": [{"type": "summary_text", "text": "short"}]});
        let reply = json!({"role": "assistant", "content": "Hi."});
        assert_eq!(read_input(json!([summary, reply.clone()])).unwrap()[0].reasoning.as_deref(), Some("short"));
        let encrypted = json!({"type": "reasoning", "summary": [], "encrypted_content": "gAAA"});
        assert_eq!(read_input(json!([encrypted, reply])).unwrap()[0].reasoning, None);
        let bad = json!({"type": "reasoning", "content": [{"type": "output_text", "text": "x"}]});
        assert_eq!(read_input(json!([bad])).unwrap_err().param.as_deref(), Some("input[0].content[0]"));
    }
}
