//! What a request asks the model to continue: completions' `prompt` (text or token ids), chat's
//! `messages`, and chat's `response_format` (the grammar the answer must follow).

use serde_json::Value;

use crate::generate::constraint::OutputFormat;
use crate::serve::error::ApiError;
use crate::serve::fields::{self, Fields};
use crate::serve::served_model::TemplateKwargs;
use crate::tokenize::chat::RENDER_VARIABLES;
use crate::tokenize::ChatMessage;

/// Token ids given as JSON numbers, each in [0, vocab); None when one is not.
pub fn token_ids(list: &[Value], vocab: usize) -> Option<Vec<u32>> {
    list.iter().map(|x| x.as_u64().filter(|&i| (i as usize) < vocab).map(|i| i as u32)).collect()
}

/// Completions' prompt.
#[derive(Debug)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// `prompt` of /v1/completions: one prompt (a string, or a list of token ids) or a batch of them
/// (a list whose items are each a string or a list of token ids), as OpenAI and vLLM take it.
pub fn prompts(v: &Value, vocab: usize) -> Result<Vec<Prompt>, ApiError> {
    texts(Fields::of(v)?.value("prompt"), "prompt", vocab)
}

/// A field that holds one text or a batch of them, as OpenAI's `prompt` and `input` do: a string
/// or a list of token ids is one; a list of strings and token-id lists is one each. `param`
/// names the field in errors, and a batch's item as `param[i]`.
pub fn texts(value: Option<&Value>, param: &str, vocab: usize) -> Result<Vec<Prompt>, ApiError> {
    let ids = |list: &[Value], at: &str| {
        token_ids(list, vocab).ok_or_else(|| ApiError::invalid(at, format!("token ids in `{at}` must be integers in [0, {vocab}).")))
    };
    match value {
        None => Err(ApiError::invalid(param, format!("`{param}` is required."))),
        Some(Value::String(s)) => Ok(vec![Prompt::Text(s.clone())]),
        Some(Value::Array(a)) if a.is_empty() => Err(ApiError::invalid(param, format!("`{param}` must not be an empty list."))),
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => Ok(vec![Prompt::Tokens(ids(a, param)?)]),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let at = format!("{param}[{i}]");
                match item {
                    Value::String(s) => Ok(Prompt::Text(s.clone())),
                    Value::Array(list) if list.iter().all(Value::is_number) => Ok(Prompt::Tokens(ids(list, &at)?)),
                    _ => Err(ApiError::invalid(&at, format!("`{at}` must be a string or a list of token ids."))),
                }
            })
            .collect(),
        Some(_) => Err(ApiError::invalid(param, format!("`{param}` must be a string, a list of token ids, or a list of either."))),
    }
}

/// `prompt` where one prompt is taken (`/tokenize`).
pub fn prompt(v: &Value, vocab: usize) -> Result<Prompt, ApiError> {
    let mut prompts = prompts(v, vocab)?;
    match prompts.len() {
        1 => Ok(prompts.remove(0)),
        n => Err(ApiError::invalid("prompt", format!("`prompt` must be one prompt here, not a batch of {n}."))),
    }
}

/// `messages` of /v1/chat/completions: roles system, user, assistant (and developer, read as
/// system); content a string or a list of text parts (joined with newlines, as vLLM does).
/// Message fields other than [`fields::MESSAGE`] are refused (or, `lenient`, added to
/// `ignored`).
pub fn messages(v: &Value, lenient: bool, ignored: &mut Vec<String>) -> Result<Vec<ChatMessage>, ApiError> {
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
            ignored.extend(fields::check(m, fields::MESSAGE, &param, lenient)?);
            let role = match o.get("role") {
                Some(Value::String(r)) if ["system", "user", "assistant", "developer", "tool"].contains(&r.as_str()) => {
                    if r == "developer" {
                        "system".to_string()
                    } else {
                        r.clone()
                    }
                }
                _ => return Err(ApiError::invalid(&format!("{param}.role"), "`role` must be system, developer, user, assistant or tool.")),
            };
            let tool_calls = match o.get("tool_calls").filter(|c| !c.is_null()) {
                Some(_) if role != "assistant" => {
                    return Err(ApiError::invalid(&format!("{param}.tool_calls"), "only assistant messages carry `tool_calls`."))
                }
                Some(c) => Some(crate::serve::tools::message_tool_calls(c, &format!("{param}.tool_calls"))?),
                None => None,
            };
            let tool_call_id = match (role.as_str(), o.get("tool_call_id")) {
                ("tool", Some(Value::String(id))) => Some(id.clone()),
                ("tool", _) => {
                    return Err(ApiError::invalid(
                        &format!("{param}.tool_call_id"),
                        "a tool message needs `tool_call_id`, the id of the call it answers.",
                    ))
                }
                (_, None | Some(Value::Null)) => None,
                (_, Some(_)) => {
                    return Err(ApiError::invalid(&format!("{param}.tool_call_id"), "only tool messages carry `tool_call_id`."))
                }
            };
            let content = match o.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None if role == "assistant" => String::new(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => Ok(t.to_string()),
                        _ => Err(ApiError::invalid(
                            &format!("{param}.content"),
                            "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported.",
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .join("\n"),
                _ => return Err(ApiError::invalid(&format!("{param}.content"), "`content` must be a string or a list of text parts.")),
            };
            let name = match o.get("name") {
                None | Some(Value::Null) => None,
                Some(Value::String(n)) => Some(n.clone()),
                Some(_) => return Err(ApiError::invalid(&format!("{param}.name"), "`name` must be a string.")),
            };
            let mut message = ChatMessage::new(&role, &content);
            (message.tool_calls, message.tool_call_id, message.name) = (tool_calls, tool_call_id, name);
            // The thinking of an answer sent back (the `openai` client's message object carries it).
            message.reasoning = crate::tokenize::chat::message_reasoning(o, &role)
                .map_err(|(key, why)| ApiError::invalid(&format!("{param}.{key}"), format!("{why}.")))?;
            Ok(message)
        })
        .collect()
}

/// `chat_template_kwargs` (vLLM's and SGLang's): an object of more variables for the chat
/// template (`enable_thinking`, ...); the ones the server sets are refused by name.
pub fn chat_template_kwargs(v: &Value) -> Result<TemplateKwargs, ApiError> {
    const P: &str = "chat_template_kwargs";
    match Fields::of(v)?.value(P) {
        None => Ok(TemplateKwargs::new()),
        Some(Value::Object(map)) => match map.keys().find(|k| RENDER_VARIABLES.contains(&k.as_str())) {
            Some(k) => {
                Err(ApiError::invalid(&format!("{P}.{k}"), format!("`{k}` is set by the server; it cannot be a template argument.")))
            }
            None => Ok(map.clone()),
        },
        Some(_) => Err(ApiError::invalid(P, "`chat_template_kwargs` must be an object of the chat template's variables.")),
    }
}

/// vLLM's `continue_final_message`: the last message, the assistant's, is not a finished turn
/// but the start of the answer, which continues it (a prefill, as an Anthropic request ending
/// with the assistant's turn). Takes that message off `messages` and returns its text ("" when
/// the field is absent or false). `add_generation_prompt` may only be true without it and false
/// with it (vLLM's rule); false alone is refused rather than ignored.
pub fn continued_turn(v: &Value, messages: &mut Vec<ChatMessage>) -> Result<String, ApiError> {
    let f = Fields::of(v)?;
    let continues = f.bool("continue_final_message")?.unwrap_or(false);
    match (continues, f.bool("add_generation_prompt")?) {
        (true, Some(true)) => {
            return Err(ApiError::invalid("add_generation_prompt", "`add_generation_prompt` must be false with `continue_final_message`."))
        }
        (false, Some(false)) => {
            let message = "`add_generation_prompt: false` is supported only with `continue_final_message: true`.";
            return Err(ApiError::invalid("add_generation_prompt", message));
        }
        _ => {}
    }
    if !continues {
        return Ok(String::new());
    }
    match messages.last() {
        Some(m) if m.role == "assistant" && m.tool_calls.is_none() => Ok(messages.pop().expect("a last message").content),
        _ => Err(ApiError::invalid(
            "continue_final_message",
            "`continue_final_message` needs the last message to be the assistant's text, which the answer continues.",
        )),
    }
}

/// `response_format` of chat: `text` (no constraint), `json_object`, or `json_schema` with
/// `{name, schema, strict, description}`. The schema is enforced whether or not `strict` is set
/// (a looser promise would be one more thing that silently differs). Unknown keys inside are
/// refused, or listed in `ignored` under `lenient`.
pub fn response_format(v: &Value, lenient: bool, ignored: &mut Vec<String>) -> Result<Option<OutputFormat>, ApiError> {
    const P: &str = "response_format";
    let Some(rf) = Fields::of(v)?.value(P) else { return Ok(None) };
    if !rf.is_object() {
        return Err(ApiError::invalid(P, "`response_format` must be an object such as {\"type\": \"json_object\"}."));
    }
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => {
            ignored.extend(fields::check(rf, &["type"], P, lenient)?);
            Ok(None)
        }
        Some("json_object") => {
            ignored.extend(fields::check(rf, &["type"], P, lenient)?);
            Ok(Some(OutputFormat::JsonObject))
        }
        Some("json_schema") => {
            ignored.extend(fields::check(rf, &["type", "json_schema"], P, lenient)?);
            const J: &str = "response_format.json_schema";
            let Some(js) = rf.get("json_schema").filter(|j| j.is_object()) else {
                return Err(ApiError::invalid(J, "`response_format.json_schema` must be an object with `name` and `schema`."));
            };
            ignored.extend(fields::check(js, &["name", "schema", "strict", "description"], J, lenient)?);
            let f = Fields::of(js)?;
            let name = f.string("name").map_err(|_| ApiError::invalid(&format!("{J}.name"), "`name` must be a string."))?;
            if !name.is_some_and(|n| !n.is_empty() && n.len() <= 64 && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'))
            {
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn bad_messages_are_named_and_text_parts_joined() {
        let e = messages(&json!({"messages": [{"role": "wizard", "content": "x"}]}), false, &mut vec![]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let parts = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]});
        assert_eq!(messages(&parts, false, &mut vec![]).unwrap()[0].content, "a\nb");
        assert_eq!(prompt(&json!({"prompt": [1, 99]}), 10).err().unwrap().param.as_deref(), Some("prompt"));
    }

    /// OpenAI's four shapes of `prompt`; a batch item that is neither a string nor ids in the
    /// vocabulary is named by its index.
    #[test]
    fn prompts_come_one_or_as_a_batch() {
        let shapes = |p: Value| prompts(&json!({"prompt": p}), 10);
        let kinds = |p: Value| shapes(p).unwrap().iter().map(|p| matches!(p, Prompt::Text(_))).collect::<Vec<_>>();
        assert_eq!(kinds(json!("a")), [true]);
        assert_eq!(kinds(json!([1, 2])), [false]);
        assert_eq!(kinds(json!(["a", "b"])), [true, true]);
        assert_eq!(kinds(json!([[1], [2, 3], "c"])), [false, false, true]);
        let Prompt::Tokens(ids) = &shapes(json!([[4, 5]])).unwrap()[0] else { panic!("ids expected") };
        assert_eq!(ids, &[4, 5]);
        let param = |p: Value| shapes(p).unwrap_err().param;
        assert_eq!(param(json!([])).as_deref(), Some("prompt"));
        assert_eq!(param(json!(["a", [1, 10]])).as_deref(), Some("prompt[1]"));
        assert_eq!(param(json!(["a", 3])).as_deref(), Some("prompt[1]"));
        assert_eq!(param(json!([["a"]])).as_deref(), Some("prompt[0]"));
        assert_eq!(param(json!({"text": "a"})).as_deref(), Some("prompt"));
        assert_eq!(prompt(&json!({"prompt": ["a", "b"]}), 10).err().unwrap().param.as_deref(), Some("prompt"));
    }

    /// An answer's message sent back as the `openai` client sends it: `reasoning_content` (or
    /// vLLM's `reasoning`) is the turn's thinking.
    #[test]
    fn an_assistant_turns_thinking_is_read_under_either_name() {
        let read = |m: Value| messages(&json!({"messages": [{"role": "user", "content": "Hi"}, m]}), false, &mut vec![]);
        let answer = json!({"role": "assistant", "content": "Hello", "refusal": null, "tool_calls": null, "reasoning_content": "greet"});
        assert_eq!(read(answer).unwrap()[1].reasoning.as_deref(), Some("greet"));
        let both = json!({"role": "assistant", "content": "Hello", "reasoning": "greet", "reasoning_content": "greet"});
        assert_eq!(read(both).unwrap()[1].reasoning.as_deref(), Some("greet"));
        let param = |m: Value| read(m).unwrap_err().param;
        assert_eq!(
            param(json!({"role": "assistant", "content": "x", "reasoning": "a", "reasoning_content": "b"})).as_deref(),
            Some("messages[1].reasoning")
        );
        assert_eq!(
            param(json!({"role": "user", "content": "x", "reasoning_content": "a"})).as_deref(),
            Some("messages[1].reasoning_content")
        );
        assert_eq!(param(json!({"role": "assistant", "content": "x", "reasoning": 3})).as_deref(), Some("messages[1].reasoning"));
    }
}
