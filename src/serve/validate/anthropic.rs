//! `POST /v1/messages` (Anthropic's Messages API) read into the chat path's values: `system` and
//! `messages` (text, `tool_use`, `tool_result` and past `thinking` blocks) become the
//! conversation, a final assistant turn the answer's beginning (Anthropic's prefill); `tools` with
//! `input_schema` and `tool_choice` (auto, any, tool, none) become chat's functions;
//! `stop_sequences` chat's `stop`; `thinking` the template's `enable_thinking` and the thinking's
//! budget. `/v1/messages/count_tokens` reads the same body without the sampling fields.

use serde_json::{json, Map, Value};

use crate::serve::error::ApiError;
use crate::serve::fields::{self, Fields};
use crate::tokenize::ChatMessage;

/// What a Messages request asks of a reasoning model's thinking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Thinking {
    /// Anthropic's default (no `thinking`) and `{"type": "disabled"}`: answer without thinking.
    Off,
    /// `{"type": "enabled", "budget_tokens": n}` (`budget`: at most n tokens) or
    /// `{"type": "adaptive"}` (the model decides how long); `display`.
    On { budget: Option<usize>, blocks: ThinkingBlocks },
}

/// What the answer's thinking becomes in the response (`thinking.display`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThinkingBlocks {
    /// Thinking off: nothing (what little a model thinks anyway is left out).
    None,
    /// `summarized` (the default): the whole thinking, in `thinking` blocks (an open model's
    /// thinking is not summarised: it is returned as written).
    Shown,
    /// `omitted`: `thinking` blocks with empty text.
    Omitted,
}

impl Thinking {
    pub fn blocks(self) -> ThinkingBlocks {
        match self {
            Self::Off => ThinkingBlocks::None,
            Self::On { blocks, .. } => blocks,
        }
    }
}

/// The request as chat takes it.
#[derive(Debug)]
pub struct AsChat {
    pub messages: Vec<ChatMessage>,
    /// The text of a final assistant turn, which the answer continues ("" without).
    pub prefill: String,
    /// A chat-shaped body for the fields chat reads (tools, tool_choice, parallel_tool_calls,
    /// max_tokens, stop, sampling, stream).
    pub chat: Value,
    pub thinking: Thinking,
}

/// `/v1/messages`' fields (`count`: `/v1/messages/count_tokens`', which has no sampling).
pub fn accepted(count: bool) -> &'static [&'static str] {
    if count {
        &["model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", "cache_control"]
    } else {
        &[
            "model",
            "messages",
            "system",
            "tools",
            "tool_choice",
            "thinking",
            "max_tokens",
            "stop_sequences",
            "stream",
            "temperature",
            "top_p",
            "top_k",
            "metadata",
            "output_config",
            "cache_control",
            "service_tier",
        ]
    }
}

/// Chat's parameter names in errors, as the Messages API names them.
pub fn rename_param(param: &str) -> String {
    match param {
        "stop" => "stop_sequences".into(),
        "user" => "metadata.user_id".into(),
        "parallel_tool_calls" => "tool_choice.disable_parallel_tool_use".into(),
        p if p.starts_with("tools[") => p.replacen(".function.parameters", ".input_schema", 1).replacen(".function", "", 1),
        p => p.replacen("chat_template_kwargs", "thinking", 1),
    }
}

pub fn read(v: &Value, count: bool, lenient: bool, ignored: &mut Vec<String>) -> Result<AsChat, ApiError> {
    let f = Fields::of(v)?;
    let mut messages = vec![];
    match f.value("system") {
        None => {}
        Some(Value::String(s)) => messages.push(ChatMessage::new("system", s)),
        Some(Value::Array(blocks)) => {
            let text = blocks
                .iter()
                .enumerate()
                .map(|(i, b)| text_block(b, &format!("system[{i}]"), lenient, ignored))
                .collect::<Result<Vec<_>, _>>()?;
            messages.push(ChatMessage::new("system", &text.join("\n")));
        }
        Some(_) => return Err(ApiError::invalid("system", "`system` must be a string or a list of text blocks.")),
    }
    let Some(Value::Array(turns)) = f.value("messages") else {
        return Err(ApiError::invalid("messages", "`messages` must be a non-empty list of {role, content} objects."));
    };
    if turns.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` must not be empty."));
    }
    let mut prefill = String::new();
    for (i, turn) in turns.iter().enumerate() {
        let at = format!("messages[{i}]");
        ignored.extend(fields::check(turn, &["role", "content"], &at, lenient)?);
        let last = i + 1 == turns.len();
        match turn.get("role").and_then(Value::as_str) {
            Some("user") => user_turn(turn.get("content"), &at, &mut messages, lenient, ignored)?,
            Some("assistant") => {
                let m = assistant_turn(turn.get("content"), &at, lenient, ignored)?;
                if last {
                    if m.tool_calls.is_some() {
                        return Err(ApiError::invalid(
                            &at,
                            "the last message cannot be the assistant's tool_use: answer it with a user turn of tool_result blocks.",
                        ));
                    }
                    if m.reasoning.is_some() {
                        return Err(ApiError::invalid(
                            &at,
                            "the last message, the answer's beginning, cannot hold thinking blocks: the answer's thinking is written by the model.",
                        ));
                    }
                    // Anthropic's prefill: the answer continues this text (trailing whitespace
                    // is refused there; here it is trimmed, which tokenises the same way).
                    prefill = m.content.trim_end().to_string();
                } else {
                    messages.push(m);
                }
            }
            _ => return Err(ApiError::invalid(&format!("{at}.role"), "`role` must be user or assistant (the system prompt is `system`).")),
        }
    }
    let mut chat = Map::new();
    let mut copy = |from: &str, to: &str| {
        if let Some(x) = f.value(from) {
            chat.insert(to.into(), x.clone());
        }
    };
    copy("model", "model");
    if !count {
        for k in ["max_tokens", "temperature", "top_p", "top_k", "stream"] {
            copy(k, k);
        }
        copy("stop_sequences", "stop");
        if f.value("max_tokens").is_none() {
            return Err(ApiError::invalid("max_tokens", "`max_tokens` is required."));
        }
        match f.value("metadata") {
            None => {}
            Some(m @ Value::Object(o)) => {
                ignored.extend(fields::check(m, &["user_id"], "metadata", lenient)?);
                if let Some(u) = o.get("user_id").filter(|u| !u.is_null()) {
                    chat.insert("user".into(), u.clone());
                }
            }
            Some(_) => return Err(ApiError::invalid("metadata", "`metadata` must be an object such as {\"user_id\": \"...\"}.")),
        }
    }
    if let Some(tools) = f.value("tools").filter(|t| t.as_array().is_none_or(|a| !a.is_empty())) {
        chat.insert("tools".into(), chat_tools(tools, lenient, ignored)?);
        if let Some(choice) = f.value("tool_choice") {
            let (choice, parallel) = tool_choice(choice, lenient, ignored)?;
            chat.insert("tool_choice".into(), choice);
            chat.insert("parallel_tool_calls".into(), json!(parallel));
        }
    } else if let Some(choice) = f.value("tool_choice") {
        if choice.get("type").and_then(Value::as_str) != Some("none") {
            return Err(ApiError::invalid("tool_choice", "`tool_choice` needs `tools`."));
        }
    }
    if let Some(config) = f.value("output_config") {
        output_config(config, &mut chat, lenient, ignored)?;
    }
    if !f.value("cache_control").is_none_or(Value::is_object) {
        return Err(ApiError::invalid("cache_control", "`cache_control` must be an object such as {\"type\": \"ephemeral\"}."));
    }
    if !count {
        f.string("service_tier")?;
    }
    let thinking = thinking(f.value("thinking"), f.integer("max_tokens", 1, 1 << 31)?, lenient, ignored)?;
    chat.insert("chat_template_kwargs".into(), json!({"enable_thinking": thinking != Thinking::Off}));
    Ok(AsChat { messages, prefill, chat: Value::Object(chat), thinking })
}

/// A `{"type": "text", "text"}` block's text (`cache_control` is accepted: the prefix cache keeps
/// every prompt's blocks for the next request that starts alike, marked or not).
fn text_block(b: &Value, at: &str, lenient: bool, ignored: &mut Vec<String>) -> Result<String, ApiError> {
    if b.get("type").and_then(Value::as_str) != Some("text") {
        return Err(ApiError::invalid(&format!("{at}.type"), "here only text blocks ({\"type\": \"text\", \"text\": ...}) are supported."));
    }
    ignored.extend(fields::check(b, &["type", "text", "cache_control"], at, lenient)?);
    b.get("text")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| ApiError::invalid(&format!("{at}.text"), "`text` must be a string."))
}

/// A content's blocks, or one text block for a string.
fn blocks<'a>(content: Option<&'a Value>, at: &str) -> Result<Vec<(String, &'a Value)>, ApiError> {
    match content {
        Some(Value::String(_)) => Ok(vec![(format!("{at}.content"), content.expect("a string"))]),
        Some(Value::Array(list)) => Ok(list.iter().enumerate().map(|(j, b)| (format!("{at}.content[{j}]"), b)).collect()),
        _ => Err(ApiError::invalid(&format!("{at}.content"), "`content` must be a string or a list of content blocks.")),
    }
}

/// A user turn: its `tool_result` blocks become tool turns (before its text, as Anthropic has
/// them first), its text blocks one user turn.
fn user_turn(
    content: Option<&Value>,
    at: &str,
    out: &mut Vec<ChatMessage>,
    lenient: bool,
    ignored: &mut Vec<String>,
) -> Result<(), ApiError> {
    let mut text = vec![];
    for (here, b) in blocks(content, at)? {
        if let Value::String(s) = b {
            text.push(s.clone());
            continue;
        }
        match b.get("type").and_then(Value::as_str) {
            Some("tool_result") => {
                ignored.extend(fields::check(b, &["type", "tool_use_id", "content", "is_error", "cache_control"], &here, lenient)?);
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::invalid(&format!("{here}.tool_use_id"), "`tool_use_id` must be a string."))?;
                // A result answers a call earlier in the conversation, as Anthropic requires.
                let mut calls = out.iter().filter_map(|m| m.tool_calls.as_ref()).filter_map(Value::as_array).flatten();
                if !calls.any(|c| c["id"] == id) {
                    let message =
                        format!("tool_result block(s) provided for tool_use_id {id:?}, which no earlier assistant tool_use block has.");
                    return Err(ApiError::invalid(&format!("{here}.tool_use_id"), message));
                }
                let result = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts
                        .iter()
                        .enumerate()
                        .map(|(k, p)| text_block(p, &format!("{here}.content[{k}]"), lenient, ignored))
                        .collect::<Result<Vec<_>, _>>()?
                        .join("\n"),
                    Some(_) => {
                        return Err(ApiError::invalid(&format!("{here}.content"), "`content` must be a string or a list of text blocks."))
                    }
                };
                // No chat template has an error flag on tool turns: the model reads it in the text.
                let is_error = match b.get("is_error") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(e)) => *e,
                    Some(_) => return Err(ApiError::invalid(&format!("{here}.is_error"), "`is_error` must be a boolean.")),
                };
                let mut m = ChatMessage::new("tool", &if is_error { format!("Error: {result}") } else { result });
                m.tool_call_id = Some(id.to_string());
                out.push(m);
            }
            Some("text") => text.push(text_block(b, &here, lenient, ignored)?),
            other => return Err(unsupported_block(&here, other, "text and tool_result")),
        }
    }
    if !text.is_empty() {
        out.push(ChatMessage::new("user", &text.join("\n")));
    }
    Ok(())
}

/// An assistant turn: its text, its `tool_use` blocks as calls, its `thinking` blocks as the
/// turn's thinking (the template decides whether a past turn's thinking is shown again: Qwen3's
/// keeps it within a turn's tool calls, as Anthropic asks clients to send it back there).
/// `redacted_thinking` holds no text to render.
fn assistant_turn(content: Option<&Value>, at: &str, lenient: bool, ignored: &mut Vec<String>) -> Result<ChatMessage, ApiError> {
    let (mut text, mut calls, mut thinking) = (vec![], vec![], vec![]);
    for (here, b) in blocks(content, at)? {
        if let Value::String(s) = b {
            text.push(s.clone());
            continue;
        }
        match b.get("type").and_then(Value::as_str) {
            Some("text") => text.push(text_block(b, &here, lenient, ignored)?),
            Some("tool_use") => {
                ignored.extend(fields::check(b, &["type", "id", "name", "input", "cache_control"], &here, lenient)?);
                let string = |k: &str| {
                    b.get(k)
                        .and_then(Value::as_str)
                        .ok_or_else(|| ApiError::invalid(&format!("{here}.{k}"), format!("`{k}` must be a string.")))
                };
                let (id, name) = (string("id")?, string("name")?);
                let input = b
                    .get("input")
                    .filter(|i| i.is_object())
                    .ok_or_else(|| ApiError::invalid(&format!("{here}.input"), "`input` must be an object."))?;
                calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input}}));
            }
            Some("thinking") => {
                ignored.extend(fields::check(b, &["type", "thinking", "signature"], &here, lenient)?);
                let t = b
                    .get("thinking")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::invalid(&format!("{here}.thinking"), "`thinking` must be a string."))?;
                thinking.push(t.to_string());
            }
            Some("redacted_thinking") => {
                ignored.extend(fields::check(b, &["type", "data"], &here, lenient)?);
            }
            other => return Err(unsupported_block(&here, other, "text, tool_use and thinking")),
        }
    }
    let mut m = ChatMessage::new("assistant", &text.join("\n"));
    m.tool_calls = (!calls.is_empty()).then(|| Value::Array(calls));
    m.reasoning = (!thinking.is_empty()).then(|| thinking.join("\n"));
    Ok(m)
}

fn unsupported_block(at: &str, kind: Option<&str>, supported: &str) -> ApiError {
    let what = kind
        .map(|k| format!("content blocks of type {k:?} are not supported"))
        .unwrap_or_else(|| "each content block needs a `type`".into());
    ApiError::invalid(&format!("{at}.type"), format!("{what} (this turn takes {supported} blocks)."))
}

/// Anthropic's tools (`{name, description, input_schema}`, type `custom` or none) as chat's
/// function tools.
fn chat_tools(tools: &Value, lenient: bool, ignored: &mut Vec<String>) -> Result<Value, ApiError> {
    let Value::Array(list) = tools else {
        return Err(ApiError::invalid("tools", "`tools` must be a list of {name, description, input_schema}."));
    };
    let converted = list
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let at = format!("tools[{i}]");
            match t.get("type").and_then(Value::as_str) {
                None | Some("custom") => {}
                Some(other) => {
                    return Err(ApiError::invalid(
                        &format!("{at}.type"),
                        format!("server tools ({other:?}) are not supported; give client tools {{name, description, input_schema}}."),
                    ))
                }
            }
            ignored.extend(fields::check(t, &["type", "name", "description", "input_schema", "cache_control"], &at, lenient)?);
            let schema =
                t.get("input_schema").ok_or_else(|| ApiError::invalid(&format!("{at}.input_schema"), "`input_schema` is required."))?;
            let mut function = json!({"name": t.get("name").cloned().unwrap_or(Value::Null), "parameters": schema});
            if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
                function["description"] = d.clone();
            }
            Ok(json!({"type": "function", "function": function}))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Value::Array(converted))
}

/// `tool_choice` as chat's, and whether several calls may come at once.
fn tool_choice(choice: &Value, lenient: bool, ignored: &mut Vec<String>) -> Result<(Value, bool), ApiError> {
    const P: &str = "tool_choice";
    let kind = choice.get("type").and_then(Value::as_str);
    let accepted: &[&str] =
        if kind == Some("tool") { &["type", "name", "disable_parallel_tool_use"] } else { &["type", "disable_parallel_tool_use"] };
    ignored.extend(fields::check(choice, accepted, P, lenient)?);
    let parallel = match choice.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(d)) => !d,
        Some(_) => {
            return Err(ApiError::invalid(&format!("{P}.disable_parallel_tool_use"), "`disable_parallel_tool_use` must be a boolean."))
        }
    };
    let chat = match kind {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name = choice
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid(&format!("{P}.name"), "`name` must name one of the tools."))?;
            json!({"type": "function", "function": {"name": name}})
        }
        _ => return Err(ApiError::invalid(&format!("{P}.type"), "`tool_choice.type` must be auto, any, tool or none.")),
    };
    Ok((chat, parallel))
}

/// `thinking`: `{"type": "enabled", "budget_tokens"}`, `{"type": "adaptive"}` (each with
/// `display`) or `{"type": "disabled"}` (the default); a budget must leave room for the answer
/// (below `max_tokens`, as Anthropic requires; its minimum of 1,024 is its models', not ours).
fn thinking(v: Option<&Value>, max_tokens: Option<i64>, lenient: bool, ignored: &mut Vec<String>) -> Result<Thinking, ApiError> {
    const P: &str = "thinking";
    let Some(t) = v else { return Ok(Thinking::Off) };
    let kind = t.get("type").and_then(Value::as_str);
    let accepted: &[&str] = match kind {
        Some("enabled") => &["type", "budget_tokens", "display"],
        Some("adaptive") => &["type", "display"],
        _ => &["type"],
    };
    ignored.extend(fields::check(t, accepted, P, lenient)?);
    let blocks = match Fields::of(t)?.string("display").map_err(|e| ApiError { param: Some(format!("{P}.display")), ..e })? {
        None | Some("summarized") => ThinkingBlocks::Shown,
        Some("omitted") => ThinkingBlocks::Omitted,
        Some(_) => return Err(ApiError::invalid(&format!("{P}.display"), "`thinking.display` must be summarized or omitted.")),
    };
    match kind {
        Some("disabled") => Ok(Thinking::Off),
        Some("adaptive") => Ok(Thinking::On { budget: None, blocks }),
        Some("enabled") => {
            let budget = Fields::of(t)?
                .integer("budget_tokens", 1, 1 << 31)
                .map_err(|e| ApiError { param: Some(format!("{P}.budget_tokens")), ..e })?
                .ok_or_else(|| ApiError::invalid(&format!("{P}.budget_tokens"), "`budget_tokens` is required when thinking is enabled."))?;
            if let Some(max) = max_tokens.filter(|&m| budget >= m) {
                let message = format!(
                    "`max_tokens` ({max}) must be greater than `thinking.budget_tokens` ({budget}): the answer follows the thinking."
                );
                return Err(ApiError::invalid(&format!("{P}.budget_tokens"), message));
            }
            Ok(Thinking::On { budget: Some(budget as usize), blocks })
        }
        Some("between_tools") => {
            Err(ApiError::invalid(&format!("{P}.type"), "`between_tools` thinking is not supported; use enabled, adaptive or disabled."))
        }
        _ => Err(ApiError::invalid(&format!("{P}.type"), "`thinking.type` must be enabled, adaptive or disabled.")),
    }
}

/// `output_config`: `format` (a JSON schema the answer follows: chat's `response_format`) and
/// `effort`, which changes nothing here (open reasoning models have thinking on or off, no
/// effort levels; as chat's `reasoning_effort`).
fn output_config(v: &Value, chat: &mut Map<String, Value>, lenient: bool, ignored: &mut Vec<String>) -> Result<(), ApiError> {
    const P: &str = "output_config";
    if !v.is_object() {
        return Err(ApiError::invalid(
            P,
            "`output_config` must be an object such as {\"format\": {\"type\": \"json_schema\", \"schema\": {...}}}.",
        ));
    }
    ignored.extend(fields::check(v, &["effort", "format"], P, lenient)?);
    match Fields::of(v)?.string("effort").map_err(|e| ApiError { param: Some(format!("{P}.effort")), ..e })? {
        None | Some("low" | "medium" | "high" | "xhigh" | "max") => {}
        Some(other) => {
            return Err(ApiError::invalid(&format!("{P}.effort"), format!("`effort` {other:?}: use low, medium, high, xhigh or max.")))
        }
    }
    if let Some(format) = v.get("format").filter(|f| !f.is_null()) {
        ignored.extend(fields::check(format, &["type", "schema"], &format!("{P}.format"), lenient)?);
        if format.get("type").and_then(Value::as_str) != Some("json_schema") {
            return Err(ApiError::invalid(&format!("{P}.format.type"), "`format.type` must be json_schema."));
        }
        let schema = format.get("schema").cloned().unwrap_or(Value::Null);
        chat.insert("response_format".into(), json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_ok(v: Value) -> AsChat {
        read(&v, false, false, &mut vec![]).unwrap()
    }

    #[test]
    fn a_tool_round_trip_becomes_chat_turns() {
        let r = read_ok(json!({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}], "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny", "is_error": false}, {"type": "text", "text": "And?"}]},
        ], "tools": [{"name": "weather", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
           "stop_sequences": ["##"]}));
        let roles: Vec<&str> = r.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!((r.messages[2].content.as_str(), r.messages[2].reasoning.as_deref()), ("Let me look.", Some("hm")));
        assert_eq!(r.messages[2].tool_calls.as_ref().unwrap()[0]["function"]["arguments"]["city"], "Paris");
        assert_eq!(r.messages[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(
            (r.chat["tool_choice"].clone(), r.chat["parallel_tool_calls"].clone(), r.chat["stop"].clone()),
            (json!("required"), json!(false), json!(["##"]))
        );
        assert_eq!(r.chat["tools"][0]["function"]["parameters"], json!({"type": "object"}));
        assert_eq!((r.thinking, r.chat["chat_template_kwargs"]["enable_thinking"].clone()), (Thinking::Off, json!(false)));
    }

    #[test]
    fn mistakes_are_named_as_the_messages_api_names_them() {
        let err = |v: Value| read(&v, false, false, &mut vec![]).unwrap_err().param.unwrap();
        let base = |extra: Value| {
            let mut v = json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
            v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            v
        };
        assert_eq!(err(json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})), "max_tokens");
        assert_eq!(
            err(base(json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]}))),
            "messages[0].content[0].tool_use_id"
        );
        assert_eq!(
            err(base(json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}))),
            "messages[0].content[0].type"
        );
        assert_eq!(err(base(json!({"thinking": {"type": "enabled", "budget_tokens": 8}}))), "thinking.budget_tokens");
        assert_eq!(err(base(json!({"tools": [{"type": "web_search_20250305", "name": "s"}]}))), "tools[0].type");
        assert_eq!(err(base(json!({"tool_choice": {"type": "any"}}))), "tool_choice");
        assert_eq!(err(base(json!({"messages": [{"role": "system", "content": "x"}]}))), "messages[0].role");
        let thinking = json!([{"type": "thinking", "thinking": 5, "signature": ""}]);
        let turns =
            json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": thinking}, {"role": "user", "content": "go"}]);
        assert_eq!(err(base(json!({"messages": turns}))), "messages[1].content[0].thinking");
        let prefill = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": ""}]}]);
        assert_eq!(err(base(json!({"messages": prefill}))), "messages[1]");
        assert_eq!(rename_param("stop"), "stop_sequences");
        assert_eq!(rename_param("tools[1].function.parameters"), "tools[1].input_schema");
    }

    #[test]
    fn a_final_assistant_turn_is_the_answers_beginning() {
        let r = read_ok(json!({"model": "m", "max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 4},
            "messages": [{"role": "user", "content": "JSON please"}, {"role": "assistant", "content": "{\"a\": "}]}));
        assert_eq!((r.messages.len(), r.prefill.as_str()), (1, "{\"a\":"));
        assert_eq!(
            (r.thinking, r.chat["chat_template_kwargs"]["enable_thinking"].clone()),
            (Thinking::On { budget: Some(4), blocks: ThinkingBlocks::Shown }, json!(true))
        );
    }
}
