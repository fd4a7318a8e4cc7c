//! A conversation with functions (definitions, past calls, their results) rendered into a
//! prompt. The server renders a request this way and the trainer renders a training row this
//! way, so a model fine-tuned on tool calls sees at serving time the prompt it was trained on.
//!
//! A template that reads `tools` gets the definitions, and the history's `tool_calls` and `tool`
//! turns, as transformers' `apply_chat_template(tools=...)` gives them. A template that does
//! not gets the generic format: a system turn listing the functions and asking for
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, past calls written that way in the
//! assistant's turn, results as `<tool_response>` user turns.

use anyhow::Result;
use serde_json::{json, Map, Value};

use super::chat::{python_json, ChatMessage, ChatTemplate};

/// `messages` (with `tools`, `[{"type": "function", "function": {...}}]`, if any) rendered with
/// `template`, as above; `add_generation_prompt` opens the assistant's turn.
pub fn render(
    template: &ChatTemplate,
    messages: &[ChatMessage],
    tools: Option<&Value>,
    add_generation_prompt: bool,
    kwargs: &Map<String, Value>,
) -> Result<String> {
    let has_tool_turns = messages.iter().any(|m| m.tool_calls.is_some() || m.role == "tool");
    if template.takes_tools {
        template.render_with(messages, tools, add_generation_prompt, kwargs)
    } else if tools.is_some() || has_tool_turns {
        template.render_with(&generic_messages(tools, messages), None, add_generation_prompt, kwargs)
    } else {
        template.render_with(messages, None, add_generation_prompt, kwargs)
    }
}

/// A training row's conversation rendered as [`render`] renders a request (no template
/// arguments). A turn's thinking (`reasoning`) that the template would drop is refused: a row
/// that carries it means it to be trained on.
pub fn render_row(template: &ChatTemplate, messages: &[ChatMessage], tools: Option<&Value>, add_generation_prompt: bool) -> Result<String> {
    thinking_is_written(template, messages)?;
    render(template, messages, tools, add_generation_prompt, &Map::new())
}

/// Refuses a training row's thinking that `template` would drop (see [`render_row`]); the jobs
/// API checks uploaded files with it too.
pub fn thinking_is_written(template: &ChatTemplate, messages: &[ChatMessage]) -> Result<()> {
    if !template.takes_reasoning && messages.iter().any(|m| m.reasoning.is_some()) {
        anyhow::bail!(
            "an assistant turn has `reasoning_content` (or `reasoning`), but this model's chat template writes no thinking (it reads \
             neither), so it would not be trained on; put the thinking in the turn's `content` as the model writes it (e.g. \
             `<think>...</think>` before the answer), or leave it out"
        );
    }
    Ok(())
}

/// The generic format's messages: the functions (if any) in a system turn (merged into the
/// first system message, if there is one), past calls as `<tool_call>` text of the assistant's
/// turn, tool results as `<tool_response>` user turns.
pub fn generic_messages(tools: Option<&Value>, messages: &[ChatMessage]) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = vec![];
    for m in messages {
        let mut m = m.clone();
        if let Some(calls) = m.tool_calls.take() {
            for c in calls.as_array().into_iter().flatten() {
                let f = c.get("function").unwrap_or(c);
                // Written as the server's grammar makes the model write a call (Python's separators),
                // so a history's calls and a tuned model's own are the same text.
                let call = python_json(&json!({"name": f["name"], "arguments": f["arguments"]}));
                m.content.push_str(&format!("<tool_call>{call}</tool_call>"));
            }
        }
        if m.role == "tool" {
            m = ChatMessage::new("user", &format!("<tool_response>{}</tool_response>", m.content));
        }
        out.push(m);
    }
    if let Some(definitions) = tools {
        let instructions = instructions(definitions);
        match out.first_mut() {
            Some(first) if first.role == "system" => first.content = format!("{}\n\n{instructions}", first.content),
            _ => out.insert(0, ChatMessage::new("system", &instructions)),
        }
    }
    out
}

/// The system instructions of the generic format: the functions, and how to call them.
fn instructions(definitions: &Value) -> String {
    let mut defs = String::new();
    for d in definitions.as_array().into_iter().flatten() {
        defs.push_str(&python_json(&d["function"]));
        defs.push('\n');
    }
    format!(
        "You may call functions. Their definitions, one JSON object per line:\n{defs}To call one, answer with <tool_call>{{\"name\": NAME, \"arguments\": {{...}}}}</tool_call> (one block per call) and nothing else."
    )
}

/// What is wrong with a message's `tool_calls`: where (after the field's own name, e.g.
/// `[0].function.name`) and why.
#[derive(Debug)]
pub struct CallsError {
    pub at: String,
    pub message: String,
}

/// A message's `tool_calls` as OpenAI writes them (`arguments` a JSON string; an object is
/// taken too, as chat datasets store them), checked, in the form templates take:
/// `[{"type": "function", "id"?, "function": {"name", "arguments": {...}}}]`.
pub fn template_tool_calls(calls: &Value) -> Result<Value, CallsError> {
    let error = |at: String, message: &str| CallsError { at, message: message.to_string() };
    let Value::Array(list) = calls else { return Err(error(String::new(), "`tool_calls` must be a list.")) };
    let mut out = vec![];
    for (i, c) in list.iter().enumerate() {
        let f = c
            .get("function")
            .filter(|f| f.is_object())
            .ok_or_else(|| error(format!("[{i}]"), "each tool call needs `function` {name, arguments}."))?;
        let name =
            f.get("name").and_then(Value::as_str).ok_or_else(|| error(format!("[{i}].function.name"), "`name` must be a string."))?;
        let args = match f.get("arguments") {
            Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                .map_err(|e| CallsError { at: format!("[{i}].function.arguments"), message: format!("`arguments` is not JSON: {e}") })?,
            Some(o @ Value::Object(_)) => o.clone(),
            _ => return Err(error(format!("[{i}].function.arguments"), "`arguments` must be a JSON string.")),
        };
        let mut call = Map::new();
        call.insert("type".into(), json!("function"));
        if let Some(id) = c.get("id") {
            call.insert("id".into(), id.clone());
        }
        call.insert("function".into(), json!({"name": name, "arguments": args}));
        out.push(Value::Object(call));
    }
    Ok(Value::Array(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
    }

    #[test]
    fn the_generic_format_lists_the_functions_and_writes_history_as_text() {
        let mut assistant = ChatMessage::new("assistant", "");
        let calls =
            json!([{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]);
        assistant.tool_calls = Some(template_tool_calls(&calls).unwrap());
        let mut result = ChatMessage::new("tool", "18C");
        result.tool_call_id = Some("call_1".into());
        let out = generic_messages(Some(&weather()), &[ChatMessage::new("user", "weather?"), assistant, result]);
        assert_eq!(out[0].role, "system");
        assert!(out[0].content.contains("get_weather") && out[0].content.contains("<tool_call>"));
        assert_eq!(out[2].content, "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>");
        assert_eq!((out[3].role.as_str(), out[3].content.as_str()), ("user", "<tool_response>18C</tool_response>"));
    }

    #[test]
    fn calls_are_checked_and_their_arguments_become_objects() {
        let object = json!([{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]);
        let from_string = json!([{"type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]);
        assert_eq!(template_tool_calls(&object).unwrap(), template_tool_calls(&from_string).unwrap());
        let e = template_tool_calls(&json!([{"function": {"name": "f", "arguments": "{bad"}}])).unwrap_err();
        assert_eq!(e.at, "[0].function.arguments");
        assert_eq!(template_tool_calls(&json!([{"function": {"arguments": "{}"}}])).unwrap_err().at, "[0].function.name");
        assert_eq!(template_tool_calls(&json!({"function": {}})).unwrap_err().at, "");
    }

    #[test]
    fn a_template_reading_tools_gets_them_and_one_that_does_not_gets_the_generic_format() {
        let native = ChatTemplate::new(
            "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments | tojson }}{% endif %};{% endfor %}",
            None,
            None,
        )
        .unwrap();
        let plain = ChatTemplate::new("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}", None, None).unwrap();
        let mut call = ChatMessage::new("assistant", "");
        call.tool_calls =
            Some(template_tool_calls(&json!([{"function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}])).unwrap());
        let messages = [ChatMessage::new("user", "weather?"), call];
        let none = Map::new();
        assert_eq!(
            render(&native, &messages, Some(&weather()), false, &none).unwrap(),
            "[get_weather]user:weather?;assistant:{\"city\": \"Oslo\"};"
        );
        let generic = render(&plain, &messages, Some(&weather()), false, &none).unwrap();
        assert!(generic.starts_with("system:You may call functions."), "{generic}");
        assert!(
            generic.ends_with("assistant:<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}</tool_call>;"),
            "{generic}"
        );
        assert_eq!(render(&plain, &messages[..1], None, false, &none).unwrap(), "user:weather?;");
    }
}
