//! Ollama's `POST /api/chat` and `POST /api/generate` read into the OpenAI bodies the chat and
//! completion checks take: `messages` (with `thinking`, `tool_calls` whose arguments are objects,
//! and tool results named by `tool_name`), `tools`, `format` (`"json"` or a JSON schema) as
//! `response_format`, `think` as the template's `enable_thinking`, and the sampling `options`
//! under their OpenAI / vLLM names. `/api/generate` wraps `prompt` (and `system`) in the chat
//! template, or with `raw` sends it as it is, as a completion. Ollama streams unless told not to.

use serde_json::{json, Map, Value};

use crate::serve::error::ApiError;
use crate::serve::fields::{self, Fields};

/// Which of Ollama's generating routes a request came through: what its answer looks like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/api/chat`: the answer as `message` (`content`, `thinking`, `tool_calls`).
    Chat,
    /// `/api/generate`: the answer as `response` (and `thinking`).
    Generate,
}

/// `/api/chat`'s fields.
pub const CHAT: &[&str] = &["model", "messages", "tools", "format", "options", "stream", "keep_alive", "think"];

/// `/api/generate`'s fields.
pub const GENERATE: &[&str] =
    &["model", "prompt", "suffix", "system", "template", "context", "stream", "raw", "format", "images", "options", "keep_alive", "think"];

/// A message's fields.
pub const MESSAGE: &[&str] = &["role", "content", "thinking", "images", "tool_calls", "tool_name"];

/// The sampling options, with the OpenAI (or vLLM) field each becomes.
const SAMPLING: &[(&str, &str)] = &[
    ("temperature", "temperature"),
    ("top_k", "top_k"),
    ("top_p", "top_p"),
    ("min_p", "min_p"),
    ("seed", "seed"),
    ("stop", "stop"),
    ("repeat_penalty", "repetition_penalty"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
];

/// Options that say how Ollama loads and runs a model (its context, batch, GPU layers,
/// threads, memory mapping): this server settles those when it starts (`serve`'s flags), so
/// they change nothing here, and the response's ignored-fields header lists each one sent.
const LOADING: &[&str] = &[
    "num_ctx",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "low_vram",
    "use_mmap",
    "use_mlock",
    "num_thread",
    "numa",
    "vocab_only",
    "f16_kv",
    "logits_all",
    "num_keep",
];

/// Samplers this server does not have, taken only at the value that turns them off.
const OFF_AT: &[(&str, f64)] = &[("typical_p", 1.0), ("tfs_z", 1.0), ("mirostat", 0.0)];

/// An Ollama request as the OpenAI checks take it.
pub struct AsOpenAi {
    /// A chat body, or (`raw`) a completion body: `raw` or `suffix` asked for one.
    pub body: Value,
    pub raw: bool,
    /// What `think` asked: on, off, or the model's own choice.
    pub think: Option<bool>,
    /// Options this server takes without effect (`LOADING`), for the response's header.
    pub loading: Vec<String>,
    /// `options.repeat_last_n`: the penalties' window (-1: the whole context).
    pub repeat_last_n: Option<i64>,
}

/// `/api/chat`'s body.
pub fn chat(v: &Value, lenient: bool) -> Result<(AsOpenAi, Vec<String>), ApiError> {
    let mut ignored = fields::check(v, CHAT, "", lenient)?;
    let f = Fields::of(v)?;
    let mut body = Map::new();
    let Some(Value::Array(turns)) = f.value("messages") else {
        return Err(ApiError::invalid("messages", "`messages` must be a list of {role, content} objects."));
    };
    body.insert("messages".into(), Value::Array(messages(turns, lenient, &mut ignored)?));
    // The `ollama` client sends `tools: []` when it has none.
    if let Some(tools) = f.value("tools").filter(|t| !t.is_null() && t.as_array().is_none_or(|a| !a.is_empty())) {
        body.insert("tools".into(), tools.clone());
    }
    Ok((common(&f, body, false)?, ignored))
}

/// `/api/generate`'s body: a chat of `system` and `prompt`, or with `raw` a completion of
/// `prompt` as it is.
pub fn generate(v: &Value, lenient: bool) -> Result<(AsOpenAi, Vec<String>), ApiError> {
    let ignored = fields::check(v, GENERATE, "", lenient)?;
    let f = Fields::of(v)?;
    let not_here = |k: &str, why: &str| ApiError::invalid(k, format!("`{k}` is not supported by this server (fsdp-app): {why}."));
    if f.string("template")?.is_some_and(|s| !s.is_empty()) {
        return Err(not_here("template", "prompts are rendered with the model's own chat template; send `raw` with the prompt you want"));
    }
    if !list(&f, "context", "")?.is_empty() {
        return Err(not_here("context", "send the conversation to `/api/chat` as messages instead"));
    }
    if !list(&f, "images", "")?.is_empty() {
        return Err(not_here("images", "the served model reads text only"));
    }
    let prompt = f.string("prompt")?.unwrap_or("");
    let raw = f.bool("raw")?.unwrap_or(false);
    let system = f.string("system")?;
    // Fill in the middle: `prompt` is the text before the gap, sent as a completion with the
    // model's FIM tokens around it (as the templates of Ollama's code models do with `.Suffix`).
    let suffix = f.string("suffix")?.filter(|s| !s.is_empty());
    let mut body = Map::new();
    if let Some(suffix) = suffix {
        if raw {
            return Err(ApiError::invalid(
                "raw",
                "`raw` sends `prompt` as it is, and `suffix` lays it out for filling in the middle: send one.",
            ));
        }
        if system.is_some() {
            return Err(ApiError::invalid("system", "`system` goes into the chat template, which `suffix` leaves out."));
        }
        body.insert("prompt".into(), json!(prompt));
        body.insert("suffix".into(), json!(suffix));
    } else if raw {
        if system.is_some() {
            return Err(ApiError::invalid("system", "`system` goes into the chat template, which `raw` leaves out: put it in `prompt`."));
        }
        body.insert("prompt".into(), json!(prompt));
    } else {
        let system = system.map(|s| json!({"role": "system", "content": s}));
        let user = json!({"role": "user", "content": prompt});
        body.insert("messages".into(), Value::Array(system.into_iter().chain([user]).collect()));
    }
    let r = common(&f, body, raw || suffix.is_some())?;
    if r.raw && r.think.is_some() {
        return Err(ApiError::invalid("think", "`think` goes into the chat template, which `raw` and `suffix` leave out."));
    }
    Ok((r, ignored))
}

/// The request's `model`, which every Ollama route requires.
pub fn model_name<'a>(f: &Fields<'a>) -> Result<&'a str, ApiError> {
    f.string("model")?.filter(|m| !m.is_empty()).ok_or_else(|| ApiError::invalid("model", "`model` is required."))
}

/// The served model an Ollama name means: Ollama's names carry a tag, `:latest` when none is
/// given, so `name:latest` is the served `name`.
pub fn served_name(name: &str) -> &str {
    name.strip_suffix(":latest").unwrap_or(name)
}

/// What both routes share, added to `body`: `model`, `stream` (on unless turned off),
/// `keep_alive`, `format`, `think` and `options`.
fn common(f: &Fields, mut body: Map<String, Value>, raw: bool) -> Result<AsOpenAi, ApiError> {
    let model = model_name(f)?;
    body.insert("model".into(), json!(served_name(model)));
    body.insert("stream".into(), json!(f.bool("stream")?.unwrap_or(true)));
    keep_alive(f.value("keep_alive"))?;
    match f.value("format") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) if s == "json" => {
            body.insert("response_format".into(), json!({"type": "json_object"}));
        }
        Some(schema @ Value::Object(_)) => {
            body.insert("response_format".into(), json!({"type": "json_schema", "json_schema": {"name": "format", "schema": schema}}));
        }
        Some(_) => return Err(ApiError::invalid("format", "`format` must be \"json\" or a JSON schema object.")),
    }
    let think = match f.value("think") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        // gpt-oss's levels: thinking on, at that effort (its template reads `reasoning_effort`).
        Some(Value::String(level)) if ["low", "medium", "high"].contains(&level.as_str()) => {
            body.insert("chat_template_kwargs".into(), json!({"reasoning_effort": level}));
            Some(true)
        }
        Some(_) => return Err(ApiError::invalid("think", "`think` must be true, false, \"low\", \"medium\" or \"high\".")),
    };
    if let Some(on) = think {
        let kwargs = body.entry("chat_template_kwargs").or_insert_with(|| json!({}));
        kwargs["enable_thinking"] = json!(on);
    }
    let options = match f.value("options") {
        None | Some(Value::Null) => (vec![], None),
        Some(o @ Value::Object(_)) => options(o, &mut body)?,
        Some(_) => return Err(ApiError::invalid("options", "`options` must be an object.")),
    };
    let (loading, repeat_last_n) = options;
    Ok(AsOpenAi { body: Value::Object(body), raw, think, loading, repeat_last_n })
}

/// `keep_alive`: how long Ollama keeps the model loaded after the request. This server keeps
/// its models loaded while it runs, so any duration is taken; a malformed one is refused.
fn keep_alive(v: Option<&Value>) -> Result<(), ApiError> {
    let ok = match v {
        None | Some(Value::Null | Value::Number(_)) => true,
        Some(Value::String(s)) => s.is_empty() || s.parse::<f64>().is_ok() || is_duration(s.strip_prefix('-').unwrap_or(s)),
        Some(_) => false,
    };
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid("keep_alive", "`keep_alive` must be a number of seconds or a duration such as \"5m\" or \"1h30m\"."))
    }
}

/// Whether `s` is a Go duration without its sign: numbers each followed by a unit (`1h30m`).
fn is_duration(mut s: &str) -> bool {
    const UNITS: &[&str] = &["ns", "us", "µs", "ms", "s", "m", "h"];
    if s.is_empty() {
        return false;
    }
    while !s.is_empty() {
        let digits = s.len() - s.trim_start_matches(|c: char| c.is_ascii_digit() || c == '.').len();
        let unit = s[digits..].len() - s[digits..].trim_start_matches(|c: char| !c.is_ascii_digit() && c != '.').len();
        if digits == 0 || s[..digits].parse::<f64>().is_err() || !UNITS.contains(&&s[digits..digits + unit]) {
            return false;
        }
        s = &s[digits + unit..];
    }
    true
}

/// `options` into `body`'s sampling fields; the loading options sent, by name, and
/// `repeat_last_n` (which chat's body has no field for).
fn options(o: &Value, body: &mut Map<String, Value>) -> Result<(Vec<String>, Option<i64>), ApiError> {
    let f = Fields::of(o)?;
    let Value::Object(map) = o else { unreachable!("an object") };
    let mut loading = vec![];
    for (k, x) in map {
        let at = format!("options.{k}");
        if let Some((_, ours)) = SAMPLING.iter().find(|(theirs, _)| theirs == k) {
            if !x.is_null() {
                body.insert(ours.to_string(), x.clone());
            }
        } else if let Some((_, off)) = OFF_AT.iter().find(|(name, _)| name == k) {
            if f.number(k, f64::MIN, f64::MAX)?.is_some_and(|v| v != *off) {
                return Err(ApiError::invalid(
                    &at,
                    format!("`{at}` is not supported by this server (fsdp-app); send {off} (off) or leave it out."),
                ));
            }
        } else if LOADING.contains(&k.as_str()) {
            loading.push(at);
        } else if !matches!(k.as_str(), "num_predict" | "repeat_last_n" | "penalize_newline") {
            return Err(ApiError::invalid(&at, format!("unknown option `{k}`.")));
        }
    }
    // -1: no limit, -2: up to the context's end (the same here: generation stops there).
    match f.integer("num_predict", -2, 1 << 31)? {
        Some(0) => {
            return Err(ApiError::invalid(
                "options.num_predict",
                "`options.num_predict` 0 asks for no answer: ask for at least 1 token, or -1 for no limit.",
            ))
        }
        Some(n) if n > 0 => {
            body.insert("max_tokens".into(), json!(n));
        }
        _ => {}
    }
    if f.bool("penalize_newline")? == Some(true) {
        return Err(ApiError::invalid(
            "options.penalize_newline",
            "`options.penalize_newline` is not supported by this server (fsdp-app): newlines are penalised like any token.",
        ));
    }
    Ok((loading, f.integer("repeat_last_n", -1, i64::MAX)?))
}

/// `options` of `/api/embed` and `/api/embeddings`: Ollama's options, each named in the
/// ignored-fields header (sampling and loading settle nothing about an embedding here); an
/// unknown one is refused, as on the generating routes.
pub fn embedding_options(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let Some(o) = v.filter(|o| !o.is_null()) else { return Ok(vec![]) };
    let Value::Object(map) = o else { return Err(ApiError::invalid("options", "`options` must be an object.")) };
    let known = |k: &str| {
        SAMPLING.iter().any(|(theirs, _)| *theirs == k)
            || OFF_AT.iter().any(|(name, _)| *name == k)
            || LOADING.contains(&k)
            || ["num_predict", "repeat_last_n", "penalize_newline"].contains(&k)
    };
    map.keys()
        .map(|k| match known(k) {
            true => Ok(format!("options.{k}")),
            false => Err(ApiError::invalid(&format!("options.{k}"), format!("unknown option `{k}`."))),
        })
        .collect()
}

/// `messages` as chat's: each assistant call gets an id, and a tool result the id of the call it
/// answers (the oldest one unanswered of its `tool_name`, or of any name without one).
fn messages(turns: &[Value], lenient: bool, ignored: &mut Vec<String>) -> Result<Vec<Value>, ApiError> {
    let mut unanswered: Vec<(String, String)> = vec![];
    let mut out = vec![];
    for (i, turn) in turns.iter().enumerate() {
        let at = format!("messages[{i}]");
        ignored.extend(fields::check(turn, MESSAGE, &at, lenient)?);
        // A field's own error names it under its message.
        let under = |e: ApiError| match e.param.as_deref() {
            Some(p) if !p.starts_with("messages[") => ApiError { param: Some(format!("{at}.{p}")), ..e },
            _ => e,
        };
        out.push(message(turn, i, &mut unanswered).map_err(under)?);
    }
    Ok(out)
}

/// Message `i`, its calls added to `unanswered` (name, id), or the call it answers taken from it.
fn message(turn: &Value, i: usize, unanswered: &mut Vec<(String, String)>) -> Result<Value, ApiError> {
    let at = format!("messages[{i}]");
    let f = Fields::of(turn).map_err(|_| ApiError::invalid(&at, format!("`{at}` must be a {{role, content}} object.")))?;
    let role = f.string("role")?.ok_or_else(|| ApiError::invalid("role", "`role` is required."))?;
    if !list(&f, "images", "")?.is_empty() {
        return Err(ApiError::invalid("images", "the served model reads text only."));
    }
    let mut m = json!({"role": role, "content": f.string("content")?.unwrap_or("")});
    match role {
        "assistant" => {
            if let Some(t) = f.string("thinking")?.filter(|t| !t.is_empty()) {
                m["reasoning_content"] = json!(t);
            }
            let calls = list(&f, "tool_calls", "")?.iter().enumerate().map(|(j, c)| {
                let at = format!("tool_calls[{j}].function");
                let name = c
                    .pointer("/function/name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::invalid(&format!("{at}.name"), "a call needs its function's `name`."))?;
                let args = match c.pointer("/function/arguments") {
                    None | Some(Value::Null) => "{}".to_string(),
                    Some(Value::String(s)) => s.clone(),
                    Some(a @ Value::Object(_)) => a.to_string(),
                    Some(_) => return Err(ApiError::invalid(&format!("{at}.arguments"), "a call's `arguments` must be an object.")),
                };
                let id = format!("call_{i}_{j}");
                unanswered.push((name.to_string(), id.clone()));
                Ok(json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}))
            });
            let calls = calls.collect::<Result<Vec<_>, ApiError>>()?;
            if !calls.is_empty() {
                m["tool_calls"] = Value::Array(calls);
            }
        }
        "tool" => {
            let name = f.string("tool_name")?;
            let k = unanswered.iter().position(|(n, _)| name.is_none_or(|name| n == name));
            let (called, id) = match k {
                Some(k) => unanswered.remove(k),
                None => (name.unwrap_or("tool").to_string(), format!("call_{i}")),
            };
            m["tool_call_id"] = json!(id);
            m["name"] = json!(called);
        }
        _ => {}
    }
    Ok(m)
}

/// List field `key` of the object at `at` (empty when left out or null); anything else is refused.
fn list<'a>(f: &Fields<'a>, key: &str, at: &str) -> Result<&'a [Value], ApiError> {
    match f.value(key) {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(a)) => Ok(a),
        Some(_) => {
            let name = if at.is_empty() { key.to_string() } else { format!("{at}.{key}") };
            Err(ApiError::invalid(&name, format!("`{name}` must be a list.")))
        }
    }
}

/// Chat's and completions' parameter names in errors, as Ollama's request names them.
pub fn rename_param(param: &str) -> String {
    match param {
        "max_tokens" => "options.num_predict".into(),
        "repetition_penalty" => "options.repeat_penalty".into(),
        "response_format" => "format".into(),
        "chat_template_kwargs" => "think".into(),
        p if SAMPLING.iter().any(|(_, ours)| *ours == p) => format!("options.{}", SAMPLING.iter().find(|(_, o)| *o == p).unwrap().0),
        p => p.replacen(".reasoning_content", ".thinking", 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_become_openai_sampling_and_loading_options_are_named() {
        let v = json!({"model": "m:latest", "messages": [{"role": "user", "content": "hi"}], "format": "json", "think": false,
                       "options": {"temperature": 0, "num_predict": 5, "repeat_penalty": 1.1, "stop": ["x"], "num_ctx": 4096, "seed": 3}});
        let (r, ignored) = chat(&v, false).unwrap();
        assert!(ignored.is_empty());
        assert_eq!(r.loading, ["options.num_ctx"]);
        let b = &r.body;
        assert_eq!((&b["model"], &b["stream"], &b["max_tokens"], &b["temperature"]), (&json!("m"), &json!(true), &json!(5), &json!(0)));
        assert_eq!((&b["repetition_penalty"], &b["stop"], &b["seed"]), (&json!(1.1), &json!(["x"]), &json!(3)));
        assert_eq!(b["response_format"], json!({"type": "json_object"}));
        assert_eq!(b["chat_template_kwargs"], json!({"enable_thinking": false}));
        let bad = |o: Value| chat(&json!({"model": "m", "messages": [], "options": o}), false).err().unwrap().param;
        assert_eq!(bad(json!({"mirostat": 2})).as_deref(), Some("options.mirostat"));
        assert_eq!(bad(json!({"num_predict": 0})).as_deref(), Some("options.num_predict"));
        assert_eq!(bad(json!({"temprature": 1})).as_deref(), Some("options.temprature"));
        assert_eq!(rename_param("top_k"), "options.top_k");
    }

    #[test]
    fn calls_get_ids_and_results_answer_them_by_name() {
        let turns = json!([
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "a", "arguments": {"x": 1}}}, {"function": {"name": "b", "arguments": {}}}]},
            {"role": "tool", "content": "B", "tool_name": "b"},
            {"role": "tool", "content": "A"},
        ]);
        let m = messages(turns.as_array().unwrap(), false, &mut vec![]).unwrap();
        assert_eq!(m[1]["tool_calls"][0]["function"], json!({"name": "a", "arguments": "{\"x\":1}"}));
        assert_eq!((&m[2]["tool_call_id"], &m[2]["name"]), (&json!("call_1_1"), &json!("b")));
        assert_eq!((&m[3]["tool_call_id"], &m[3]["name"]), (&json!("call_1_0"), &json!("a")));
        let refused =
            |turn: Value| messages(&[json!({"role": "user", "content": "x"}), turn], false, &mut vec![]).err().unwrap().param.unwrap();
        assert_eq!(refused(json!({"role": "assistant", "tool_calls": "x"})), "messages[1].tool_calls");
        assert_eq!(refused(json!({"role": "assistant", "tool_calls": [{"function": {}}]})), "messages[1].tool_calls[0].function.name");
        assert_eq!(refused(json!({"role": "user", "content": 5})), "messages[1].content");
        assert_eq!(refused(json!({"content": "x"})), "messages[1].role");
    }

    #[test]
    fn generate_is_a_chat_unless_raw_or_filling_in_the_middle() {
        let (r, _) = generate(&json!({"model": "m", "prompt": "p", "system": "s", "stream": false}), false).unwrap();
        assert_eq!(r.body["messages"], json!([{"role": "system", "content": "s"}, {"role": "user", "content": "p"}]));
        let (r, _) = generate(&json!({"model": "m", "prompt": "p", "raw": true}), false).unwrap();
        assert!(r.raw && r.body["prompt"] == "p" && r.body.get("messages").is_none());
        // `suffix`: a completion that fills in the middle; with `raw`, `system` or `think`, refused.
        let (r, _) = generate(&json!({"model": "m", "prompt": "p", "suffix": "s"}), false).unwrap();
        assert!(r.raw && r.body["prompt"] == "p" && r.body["suffix"] == "s");
        let (r, _) = generate(&json!({"model": "m", "prompt": "p", "suffix": ""}), false).unwrap();
        assert!(!r.raw, "an empty suffix is none, as Ollama reads it");
        for (k, x) in [("raw", json!(true)), ("system", json!("s")), ("think", json!(true))] {
            let e = generate(&json!({"model": "m", "prompt": "p", "suffix": "s", k: x}), false).err().unwrap();
            assert_eq!(e.param.as_deref(), Some(k));
        }
        for (k, x) in [("template", json!("t")), ("context", json!([1])), ("images", json!(["i"])), ("images", json!("i"))] {
            let e = generate(&json!({"model": "m", "prompt": "p", k: x}), false).err().unwrap();
            assert_eq!(e.param.as_deref(), Some(k));
        }
        assert!(generate(&json!({"model": "m", "prompt": "p", "keep_alive": "5x"}), false).is_err());
        for good in ["-1m", "1h30m", "0", "2.5s", ""] {
            assert!(generate(&json!({"model": "m", "prompt": "p", "keep_alive": good}), false).is_ok(), "{good}");
        }
        for bad in ["5x", "m", "1h30", "soon"] {
            assert!(generate(&json!({"model": "m", "prompt": "p", "keep_alive": bad}), false).is_err(), "{bad}");
        }
    }
}
