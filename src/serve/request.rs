//! Reading and validating generation requests by hand from JSON, so every wrong type, range or
//! non-finite number is a 400 that names its parameter (a derive would answer with serde's
//! messages and miss the ranges).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde_json::{Map, Value};

use super::error::ApiError;
use crate::generate::constraint::OutputFormat;
use crate::generate::{ModelDefaults, SamplingParams};
use crate::tokenize::ChatMessage;

/// The most choices one request may ask for.
pub const MAX_N: usize = 8;
/// The most stop strings (OpenAI's limit).
pub const MAX_STOP: usize = 4;
/// The most `logit_bias` entries.
pub const MAX_LOGIT_BIAS: usize = 1024;

/// What a completion or chat request asks for, checked.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub model: String,
    pub max_tokens: Option<usize>,
    pub params: SamplingParams,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    pub echo: bool,
}

pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Chat(Vec<ChatMessage>),
}

/// A JSON object's fields with typed, named accessors.
pub struct Fields<'a> {
    map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    pub fn of(v: &'a Value) -> Result<Self, ApiError> {
        match v {
            Value::Object(map) => Ok(Self { map }),
            _ => Err(ApiError::bad_request("The request body must be a JSON object.")),
        }
    }

    fn get(&self, k: &str) -> Option<&'a Value> {
        self.map.get(k).filter(|v| !v.is_null())
    }

    pub fn string(&self, k: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(ApiError::invalid(k, format!("`{k}` must be a string."))),
        }
    }

    pub fn bool(&self, k: &str) -> Result<Option<bool>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(ApiError::invalid(k, format!("`{k}` must be a boolean."))),
        }
    }

    /// A finite number in [lo, hi].
    pub fn number(&self, k: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                let x = n.as_f64().filter(|x| x.is_finite()).ok_or_else(|| ApiError::invalid(k, format!("`{k}` must be a finite number.")))?;
                if !(lo..=hi).contains(&x) {
                    return Err(ApiError::invalid(k, format!("`{k}` must be between {lo} and {hi}, got {x}.")));
                }
                Ok(Some(x))
            }
            Some(_) => Err(ApiError::invalid(k, format!("`{k}` must be a number."))),
        }
    }

    /// An integer in [lo, hi].
    pub fn integer(&self, k: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                let x = n.as_i64().ok_or_else(|| ApiError::invalid(k, format!("`{k}` must be an integer between {lo} and {hi}.")))?;
                if !(lo..=hi).contains(&x) {
                    return Err(ApiError::invalid(k, format!("`{k}` must be between {lo} and {hi}, got {x}.")));
                }
                Ok(Some(x))
            }
            Some(_) => Err(ApiError::invalid(k, format!("`{k}` must be an integer."))),
        }
    }

    pub fn value(&self, k: &str) -> Option<&'a Value> {
        self.get(k)
    }
}

/// The `model` field, checked (the model is looked up before the rest is parsed, because the
/// sampling defaults are the model's).
pub fn model_field(v: &Value) -> Result<&str, ApiError> {
    Fields::of(v)?.string("model")?.ok_or_else(|| ApiError::invalid("model", "`model` is required."))
}

/// The fields both endpoints share. `chat` picks the chat names (`max_completion_tokens`,
/// `logprobs` as a boolean with `top_logprobs`).
pub fn parse_common(v: &Value, defaults: &ModelDefaults, chat: bool) -> Result<GenerationRequest, ApiError> {
    let f = Fields::of(v)?;
    let model = f.string("model")?.ok_or_else(|| ApiError::invalid("model", "`model` is required."))?.to_string();
    let max_tokens = match (f.integer("max_tokens", 1, 1 << 31)?, if chat { f.integer("max_completion_tokens", 1, 1 << 31)? } else { None }) {
        (_, Some(m)) => Some(m as usize),
        (Some(m), None) => Some(m as usize),
        (None, None) => None,
    };
    let temperature = f.number("temperature", 0.0, 2.0)?.unwrap_or(defaults.temperature);
    let top_p = match f.number("top_p", 0.0, 1.0)? {
        Some(p) if p <= 0.0 => return Err(ApiError::invalid("top_p", "`top_p` must be greater than 0 and at most 1.")),
        Some(p) => Some(p),
        None => defaults.top_p,
    };
    // vLLM's convention: -1 (or 0) disables top-k.
    let top_k = match f.integer("top_k", -1, 1 << 20)? {
        Some(k) if k <= 0 => None,
        Some(k) => Some(k as usize),
        None => defaults.top_k,
    };
    let min_p = f.number("min_p", 0.0, 1.0)?;
    let presence_penalty = f.number("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32;
    let frequency_penalty = f.number("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32;
    let repetition_penalty = match f.number("repetition_penalty", 0.0, 10.0)? {
        // Checked as the f32 the sampler uses (5e-324 is > 0 as f64 and 0 as f32).
        Some(p) if p as f32 <= 0.0 => return Err(ApiError::invalid("repetition_penalty", "`repetition_penalty` must be greater than 0.")),
        Some(p) => p as f32,
        None => defaults.repetition_penalty,
    };
    let seed = f.integer("seed", i64::MIN, i64::MAX)?.map(|s| s as u64);
    let n = f.integer("n", 1, MAX_N as i64)?.unwrap_or(1) as usize;
    // best_of = n is n choices; ranking more candidates than are returned is not implemented.
    if let Some(b) = f.integer("best_of", 1, MAX_N as i64)? {
        if b as usize != n {
            return Err(ApiError::invalid("best_of", format!("`best_of` other than `n` ({n}) is not supported by this server.")).with_code("unsupported_parameter"));
        }
    }
    let stop: Vec<String> = match f.value("stop") {
        None => vec![],
        Some(Value::String(s)) if !s.is_empty() => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= MAX_STOP => a
            .iter()
            .map(|x| match x {
                Value::String(s) if !s.is_empty() => Ok(s.clone()),
                _ => Err(ApiError::invalid("stop", "`stop` entries must be non-empty strings.")),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::invalid("stop", format!("`stop` must be a non-empty string or a list of up to {MAX_STOP} of them."))),
    };
    let logprobs = if chat {
        match (f.bool("logprobs")?, f.integer("top_logprobs", 0, 20)?) {
            (Some(true), top) => Some(top.unwrap_or(0) as usize),
            (_, Some(_)) => return Err(ApiError::invalid("top_logprobs", "`top_logprobs` needs `logprobs: true`.")),
            _ => None,
        }
    } else {
        f.integer("logprobs", 0, 20)?.map(|k| k as usize)
    };
    let _user = f.string("user")?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.value("stream_options") {
        None => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(ApiError::invalid("stream_options", "`stream_options.include_usage` must be a boolean.")),
        },
        Some(_) => return Err(ApiError::invalid("stream_options", "`stream_options` must be an object.")),
    };
    if include_usage && !stream {
        return Err(ApiError::invalid("stream_options", "`stream_options` is only allowed with `stream: true`."));
    }
    let echo = if chat { false } else { f.bool("echo")?.unwrap_or(false) };
    let params = SamplingParams {
        max_new_tokens: 0,
        temperature,
        top_k,
        top_p,
        repetition_penalty,
        seed: seed.unwrap_or_else(super::ids::fresh_seed),
        stop,
        min_p,
        presence_penalty,
        frequency_penalty,
        logprobs,
        logit_bias: vec![],
        prompt_logprobs: None,
    };
    // What the engine will check again: a request it would refuse is the client's error, here.
    params.validate().map_err(|e| ApiError::bad_request(format!("{e:#}")))?;
    Ok(GenerationRequest { model, max_tokens, params, n, stream, include_usage, echo })
}

/// `logit_bias`: an object from token ids (as strings, OpenAI's form) to a bias in [-100, 100].
pub fn parse_logit_bias(v: &Value, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    const P: &str = "logit_bias";
    let Some(bias) = Fields::of(v)?.value(P) else { return Ok(vec![]) };
    let Value::Object(map) = bias else { return Err(ApiError::invalid(P, "`logit_bias` must be an object from token ids to numbers in [-100, 100].")) };
    if map.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(P, format!("`logit_bias` has {} entries; at most {MAX_LOGIT_BIAS}.", map.len())));
    }
    map.iter()
        .map(|(k, b)| {
            let id = k.parse::<u32>().ok().filter(|&i| (i as usize) < vocab).ok_or_else(|| ApiError::invalid(P, format!("`logit_bias` key {k:?} is not a token id in [0, {vocab}).")))?;
            let b = b.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| ApiError::invalid(P, format!("`logit_bias` for token {id} must be a number in [-100, 100], got {b}.")))?;
            Ok((id, b as f32))
        })
        .collect()
}

/// `response_format` of chat: `text` (no constraint), `json_object`, or `json_schema` with
/// `{name, schema, strict, description}`. The schema is enforced whether or not `strict` is set
/// (a looser promise would be one more thing that silently differs). Unknown keys inside are
/// refused, or listed in `ignored` under `lenient`.
pub fn parse_response_format(v: &Value, lenient: bool, ignored: &mut Vec<String>) -> Result<Option<OutputFormat>, ApiError> {
    const P: &str = "response_format";
    let Some(rf) = Fields::of(v)?.value(P) else { return Ok(None) };
    if !rf.is_object() {
        return Err(ApiError::invalid(P, "`response_format` must be an object such as {\"type\": \"json_object\"}."));
    }
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => {
            ignored.extend(super::fields::check(rf, &["type"], P, lenient)?);
            Ok(None)
        }
        Some("json_object") => {
            ignored.extend(super::fields::check(rf, &["type"], P, lenient)?);
            Ok(Some(OutputFormat::JsonObject))
        }
        Some("json_schema") => {
            ignored.extend(super::fields::check(rf, &["type", "json_schema"], P, lenient)?);
            const J: &str = "response_format.json_schema";
            let Some(js) = rf.get("json_schema").filter(|j| j.is_object()) else {
                return Err(ApiError::invalid(J, "`response_format.json_schema` must be an object with `name` and `schema`."));
            };
            ignored.extend(super::fields::check(js, &["name", "schema", "strict", "description"], J, lenient)?);
            let f = Fields::of(js)?;
            let name = f.string("name").map_err(|_| ApiError::invalid(&format!("{J}.name"), "`name` must be a string."))?;
            if !name.is_some_and(|n| !n.is_empty() && n.len() <= 64 && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')) {
                return Err(ApiError::invalid(&format!("{J}.name"), "`name` is required: 1 to 64 letters, digits, '_' or '-'."));
            }
            f.bool("strict").map_err(|_| ApiError::invalid(&format!("{J}.strict"), "`strict` must be a boolean."))?;
            f.string("description").map_err(|_| ApiError::invalid(&format!("{J}.description"), "`description` must be a string."))?;
            match f.value("schema") {
                Some(schema @ Value::Object(_)) => Ok(Some(OutputFormat::JsonSchema(schema.clone()))),
                _ => Err(ApiError::invalid(&format!("{J}.schema"), "`schema` must be a JSON schema object.")),
            }
        }
        _ => Err(ApiError::invalid(&format!("{P}.type"), "`response_format.type` must be text, json_object or json_schema.")),
    }
}

/// `prompt` of /v1/completions: a string, or a list of token ids.
pub fn parse_prompt(v: &Value, vocab: usize) -> Result<Prompt, ApiError> {
    let f = Fields::of(v)?;
    match f.value("prompt") {
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => Ok(Prompt::Text(a[0].as_str().unwrap().to_string())),
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => {
            let ids = a
                .iter()
                .map(|x| x.as_u64().filter(|&i| (i as usize) < vocab).map(|i| i as u32))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| ApiError::invalid("prompt", format!("token ids in `prompt` must be integers in [0, {vocab}).")))?;
            Ok(Prompt::Tokens(ids))
        }
        None => Err(ApiError::invalid("prompt", "`prompt` is required.")),
        Some(_) => Err(ApiError::invalid("prompt", "`prompt` must be a string or a list of token ids (one prompt per request).")),
    }
}

/// `messages` of /v1/chat/completions: roles system, user, assistant (and developer, read as
/// system); content a string or a list of text parts (joined with newlines, as vLLM does).
/// Message fields other than `role` and `content` are refused (or, `lenient`, added to
/// `ignored`).
pub fn parse_messages(v: &Value, lenient: bool, ignored: &mut Vec<String>) -> Result<Vec<ChatMessage>, ApiError> {
    let f = Fields::of(v)?;
    let Some(Value::Array(items)) = f.value("messages") else {
        return Err(ApiError::invalid("messages", "`messages` must be a non-empty list of {role, content} objects."));
    };
    if items.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` must not be empty."));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let param = format!("messages[{i}]");
            let Value::Object(o) = m else { return Err(ApiError::invalid(&param, format!("`{param}` must be an object."))) };
            ignored.extend(super::fields::check(m, super::fields::MESSAGE, &param, lenient)?);
            let role = match o.get("role") {
                Some(Value::String(r)) if ["system", "user", "assistant", "developer", "tool"].contains(&r.as_str()) => {
                    if r == "developer" { "system".to_string() } else { r.clone() }
                }
                _ => return Err(ApiError::invalid(&format!("{param}.role"), "`role` must be system, developer, user, assistant or tool.")),
            };
            let tool_calls = match o.get("tool_calls").filter(|c| !c.is_null()) {
                Some(_) if role != "assistant" => return Err(ApiError::invalid(&format!("{param}.tool_calls"), "only assistant messages carry `tool_calls`.")),
                Some(c) => Some(super::tools::message_tool_calls(c, &format!("{param}.tool_calls"))?),
                None => None,
            };
            let tool_call_id = match (role.as_str(), o.get("tool_call_id")) {
                ("tool", Some(Value::String(id))) => Some(id.clone()),
                ("tool", _) => return Err(ApiError::invalid(&format!("{param}.tool_call_id"), "a tool message needs `tool_call_id`, the id of the call it answers.")),
                (_, None | Some(Value::Null)) => None,
                (_, Some(_)) => return Err(ApiError::invalid(&format!("{param}.tool_call_id"), "only tool messages carry `tool_call_id`.")),
            };
            let content = match o.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None if role == "assistant" => String::new(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => Ok(t.to_string()),
                        _ => Err(ApiError::invalid(&format!("{param}.content"), "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported.")),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .join("\n"),
                _ => return Err(ApiError::invalid(&format!("{param}.content"), "`content` must be a string or a list of text parts.")),
            };
            let mut message = ChatMessage::new(&role, &content);
            (message.tool_calls, message.tool_call_id) = (tool_calls, tool_call_id);
            Ok(message)
        })
        .collect()
}

/// The body as JSON, or a 400/413 in OpenAI's shape. Bodies over the limit are read to the
/// end first (up to a hard cap), so the client gets the 413 instead of a broken connection.
pub fn json_body(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Value, ApiError> {
    let bytes = body.map_err(|e| {
        if let Some(timeout) = super::listen::stalled(&e) {
            return timeout;
        }
        let status = e.status();
        ApiError::new(status, "invalid_request_error", format!("Could not read the request body: {}", e.body_text()))
    })?;
    if bytes.len() > limit {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("The request body has {} bytes; the limit is {limit} (--max-body-bytes).", bytes.len()),
        ));
    }
    if bytes.is_empty() {
        return Err(ApiError::bad_request("The request body is empty; send a JSON object."));
    }
    let text = std::str::from_utf8(&bytes).map_err(|_| ApiError::bad_request("The request body is not valid UTF-8."))?;
    serde_json::from_str(text).map_err(|e| ApiError::bad_request(format!("The request body is not valid JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn defaults() -> ModelDefaults {
        ModelDefaults::decide(None, &[])
    }

    #[test]
    fn every_bad_parameter_is_named() {
        for (body, param) in [
            (json!({"model": "m", "temperature": 2.5}), "temperature"),
            (json!({"model": "m", "temperature": "hot"}), "temperature"),
            (json!({"model": "m", "top_p": 0}), "top_p"),
            (json!({"model": "m", "max_tokens": -1}), "max_tokens"),
            (json!({"model": "m", "max_tokens": 1.5}), "max_tokens"),
            (json!({"model": "m", "n": 100}), "n"),
            (json!({"model": "m", "stop": ["a", "b", "c", "d", "e"]}), "stop"),
            (json!({"model": "m", "stop": [""]}), "stop"),
            (json!({"model": "m", "presence_penalty": 3}), "presence_penalty"),
            (json!({"model": "m", "repetition_penalty": 5e-324}), "repetition_penalty"),
            (json!({"model": "m", "seed": "x"}), "seed"),
            (json!({"model": "m", "stream_options": {"include_usage": true}}), "stream_options"),
            (json!({"temperature": 1}), "model"),
        ] {
            let e = parse_common(&body, &defaults(), true).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{body}");
        }
        let r = parse_common(&json!({"model": "m", "max_completion_tokens": 7, "stop": "x", "top_k": -1, "seed": 3}), &defaults(), true).unwrap();
        assert_eq!((r.max_tokens, r.params.stop.clone(), r.params.top_k, r.params.seed), (Some(7), vec!["x".to_string()], None, 3));
        let e = parse_messages(&json!({"messages": [{"role": "wizard", "content": "x"}]}), false, &mut vec![]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let parts = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]});
        assert_eq!(parse_messages(&parts, false, &mut vec![]).unwrap()[0].content, "a\nb");
        for (bias, ok) in [(json!({"5": -100}), true), (json!({"50": 1}), false), (json!({"x": 1}), false), (json!({"5": 101}), false), (json!([1]), false)] {
            assert_eq!(parse_logit_bias(&json!({"logit_bias": bias}), 10).is_ok(), ok, "{bias}");
        }
        let e = parse_common(&json!({"model": "m", "n": 2, "best_of": 3}), &defaults(), false).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("best_of"));
    }
}
