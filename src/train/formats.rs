//! The row shapes people bring, read into one of four kinds of example:
//! `text`; `prompt`/`completion`; chat (`messages` with OpenAI roles, ShareGPT `conversations`
//! with `from`/`value`, and Alpaca `instruction`/`input`/`output`); and pre-tokenised
//! `input_ids`/`labels`. Errors name the field.
//!
//! Chat rows in OpenAI's fine-tuning format may teach function calling: assistant turns with
//! `tool_calls` (or the legacy `function_call`), `tool` (or `function`) turns with the results,
//! the row's `tools` (or legacy `functions`), and a `weight` of 0 or 1 per assistant turn (0: the
//! turn is context, not trained on). TRL's tool-calling datasets are the same rows, `tools`
//! sometimes stored as a JSON string.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::tokenize::{tool_prompt, ChatMessage};

#[derive(Debug, Clone, PartialEq)]
pub enum Example {
    Text(String),
    PromptCompletion { prompt: String, completion: String },
    Chat(Chat),
    Tokens { input_ids: Vec<i64>, labels: Option<Vec<i64>> },
}

/// A conversation to train on.
#[derive(Debug, Clone, PartialEq)]
pub struct Chat {
    pub messages: Vec<ChatMessage>,
    /// The functions the conversation may call, `[{"type": "function", "function": {...}}]`,
    /// rendered into the prompt as the server renders a request's `tools`.
    pub tools: Option<Value>,
    /// Assistant turns (indices into `messages`) with `weight` 0: context, not trained on.
    pub untrained: Vec<usize>,
}

impl Chat {
    pub fn new(messages: Vec<ChatMessage>) -> Self {
        Self { messages, tools: None, untrained: vec![] }
    }

    /// The assistant turns trained on, in order.
    pub fn trained_turns(&self) -> impl Iterator<Item = usize> + '_ {
        self.messages.iter().enumerate().filter(|(i, m)| m.role == "assistant" && !self.untrained.contains(i)).map(|(i, _)| i)
    }
}

/// The prompt Alpaca was trained with, for models without a chat template.
pub fn alpaca_prompt(instruction: &str, input: &str) -> String {
    if input.is_empty() {
        format!(
            "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n\
             ### Instruction:\n{instruction}\n\n### Response:\n"
        )
    } else {
        format!(
            "Below is an instruction that describes a task, paired with an input that provides further context. Write a \
             response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n\
             ### Response:\n"
        )
    }
}

pub(super) fn string_field<'a>(row: &'a Value, field: &str) -> Result<&'a str> {
    match row.get(field) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => bail!("field `{field}` must be a string, found {}", short(other)),
        None => bail!("missing field `{field}`"),
    }
}

pub(super) fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 40 {
        format!("{}...", s.chars().take(40).collect::<String>())
    } else {
        s
    }
}

pub(super) fn id_list(row: &Value, field: &str) -> Result<Option<Vec<i64>>> {
    match row.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_i64().with_context(|| format!("field `{field}` must hold integers, found {x}")))
            .collect::<Result<Vec<_>>>()
            .map(Some),
        Some(other) => bail!("field `{field}` must be a list of integers, found {}", short(other)),
    }
}

/// A list of messages (`field`, each with `role_key` and `content_key`) for a prompt or a
/// preference pair, where every assistant turn counts: a `weight` of 0 is refused.
pub(super) fn messages(list: &Value, field: &str, role_key: &str, content_key: &str) -> Result<Vec<ChatMessage>> {
    let (messages, untrained) = weighted_messages(list, field, role_key, content_key)?;
    if let Some(i) = untrained.first() {
        bail!("{field}[{i}].weight is 0, which only supervised chat rows take (here every turn counts)");
    }
    Ok(messages)
}

/// A list of messages and the assistant turns whose `weight` is 0.
fn weighted_messages(list: &Value, field: &str, role_key: &str, content_key: &str) -> Result<(Vec<ChatMessage>, Vec<usize>)> {
    let items = list.as_array().with_context(|| format!("field `{field}` must be a list of messages"))?;
    if items.is_empty() {
        bail!("field `{field}` is empty");
    }
    let mut untrained = vec![];
    let mut out = vec![];
    for (i, m) in items.iter().enumerate() {
        let role = m.get(role_key).and_then(Value::as_str).with_context(|| format!("{field}[{i}] has no string `{role_key}`"))?;
        let role = match (field, role) {
            // ShareGPT's speaker names.
            ("conversations", "human" | "user") => "user",
            ("conversations", "gpt" | "assistant" | "model" | "chatgpt" | "bing") => "assistant",
            ("conversations", "system") => "system",
            ("conversations", other) => bail!("{field}[{i}].from is {other:?}; expected human, gpt or system"),
            // As the server reads a request's roles (OpenAI's newer name for system; the legacy
            // function-result role).
            (_, "developer") => "system",
            (_, "function") => "tool",
            (_, r @ ("system" | "user" | "assistant" | "tool")) => r,
            (_, other) => bail!("{field}[{i}].role is {other:?}; expected system, user, assistant or tool"),
        };
        let mut message = ChatMessage::new(role, "");
        if role_key == "role" {
            message.tool_calls = tool_calls(m, role, &format!("{field}[{i}]"))?;
            for (key, slot) in [("tool_call_id", &mut message.tool_call_id), ("name", &mut message.name)] {
                match m.get(key) {
                    None | Some(Value::Null) => {}
                    Some(Value::String(s)) => *slot = Some(s.clone()),
                    Some(other) => bail!("{field}[{i}].{key} must be a string, found {}", short(other)),
                }
            }
            // A turn's thinking apart from its content, as the server reads it.
            let object = m.as_object().with_context(|| format!("{field}[{i}] must be an object"))?;
            message.reasoning = crate::tokenize::chat::message_reasoning(object, role)
                .map_err(|(key, why)| anyhow::anyhow!("{field}[{i}].{key}: {why}"))?;
            match m.get("weight") {
                None | Some(Value::Null) => {}
                Some(w) if role == "assistant" && (w == 0 || w == 1) => {
                    if w == 0 {
                        untrained.push(i);
                    }
                }
                Some(other) => bail!("{field}[{i}].weight must be 0 or 1, on an assistant turn; found {}", short(other)),
            }
        }
        message.content = match m.get(content_key) {
            Some(Value::String(s)) => s.clone(),
            // A turn that only calls functions has no text (OpenAI writes null).
            None | Some(Value::Null) if message.tool_calls.is_some() => String::new(),
            _ => bail!("{field}[{i}] has no string `{content_key}`"),
        };
        out.push(message);
    }
    Ok((out, untrained))
}

/// An assistant turn's calls (`tool_calls`, or the legacy single `function_call`) in the form
/// templates take; None for a turn without.
fn tool_calls(m: &Value, role: &str, at: &str) -> Result<Option<Value>> {
    let calls = match (m.get("tool_calls").filter(|c| !c.is_null()), m.get("function_call").filter(|c| !c.is_null())) {
        (None, None) => return Ok(None),
        (Some(_), Some(_)) => bail!("{at} has both `tool_calls` and the legacy `function_call`; give one"),
        (Some(c), None) => (c.clone(), "tool_calls"),
        (None, Some(f)) => (json!([{"type": "function", "function": f}]), "function_call"),
    };
    if role != "assistant" {
        bail!("{at}.{} is on a {role} turn; only assistant turns call functions", calls.1);
    }
    let list = tool_prompt::template_tool_calls(&calls.0).map_err(|e| {
        let inner = if calls.1 == "function_call" { e.at.trim_start_matches("[0].function").to_string() } else { e.at };
        anyhow::anyhow!("{at}.{}{inner}: {}", calls.1, e.message)
    })?;
    Ok(Some(list))
}

/// A row's functions: `tools` (OpenAI's `[{"type": "function", "function": {...}}]`, bare
/// function objects, or either as a JSON string, as datasets store them) or the legacy
/// `functions`. None when the row has none.
pub(super) fn row_tools(row: &Value) -> Result<Option<Value>> {
    let (field, value) = match (row.get("tools").filter(|t| !t.is_null()), row.get("functions").filter(|t| !t.is_null())) {
        (None, None) => return Ok(None),
        (Some(_), Some(_)) => bail!("the row has both `tools` and the legacy `functions`; give one"),
        (Some(t), None) => ("tools", t),
        (None, Some(f)) => ("functions", f),
    };
    let parsed;
    let value = match value {
        Value::String(s) => {
            parsed = serde_json::from_str::<Value>(s).map_err(|e| anyhow::anyhow!("field `{field}` is a string but not JSON: {e}"))?;
            &parsed
        }
        v => v,
    };
    let list = value.as_array().with_context(|| format!("field `{field}` must be a list of function definitions"))?;
    if list.is_empty() {
        return Ok(None);
    }
    let mut out = vec![];
    for (i, t) in list.iter().enumerate() {
        let function = match t.get("function") {
            Some(f) if t.get("type").and_then(Value::as_str) == Some("function") => f,
            Some(_) => bail!("{field}[{i}].type must be \"function\""),
            None => t,
        };
        if !function.get("name").is_some_and(Value::is_string) {
            bail!("{field}[{i}] needs a function with a string `name`");
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Some(Value::Array(out)))
}

/// Why a row trains no token whatever the tokenizer, when it does not: a chat with no
/// assistant turn (what fine-tuning jobs train on), or token rows whose labels are all ignored.
pub fn trains_nothing(e: &Example) -> Option<&'static str> {
    match e {
        Example::Chat(c) if !c.trained_turns().any(|i| !c.messages[i].content.is_empty() || c.messages[i].tool_calls.is_some()) => {
            Some("it has no assistant turn to train on")
        }
        Example::Tokens { labels: Some(l), .. } if l.iter().all(|&x| x < 0) => Some("every label is -100 (ignored)"),
        _ => None,
    }
}

/// Reads one row. `has_template` decides how Alpaca rows are shaped.
pub fn parse_row(row: &Value, has_template: bool) -> Result<Example> {
    if !row.is_object() {
        bail!("row is not a JSON object");
    }
    if is_preference_row(row) {
        bail!("this is a preference row (chosen / rejected); train on preference pairs with --method dpo");
    }
    if row.get("input_ids").is_some() {
        let input_ids = id_list(row, "input_ids")?.context("missing field `input_ids`")?;
        if input_ids.is_empty() {
            bail!("field `input_ids` is empty");
        }
        if let Some(bad) = input_ids.iter().find(|&&x| x < 0 || x > u32::MAX as i64) {
            bail!("field `input_ids` holds {bad}, not a token id");
        }
        let labels = id_list(row, "labels")?;
        if let Some(l) = &labels {
            if l.len() != input_ids.len() {
                bail!("field `labels` has {} entries but `input_ids` has {}", l.len(), input_ids.len());
            }
        }
        return Ok(Example::Tokens { input_ids, labels });
    }
    if let Some(m) = row.get("messages") {
        let (messages, untrained) = weighted_messages(m, "messages", "role", "content")?;
        return Ok(Example::Chat(Chat { messages, tools: row_tools(row)?, untrained }));
    }
    if let Some(c) = row.get("conversations") {
        return Ok(Example::Chat(Chat::new(messages(c, "conversations", "from", "value")?)));
    }
    if row.get("instruction").is_some() {
        let instruction = string_field(row, "instruction")?;
        let input = match row.get("input") {
            None | Some(Value::Null) => "",
            Some(_) => string_field(row, "input")?,
        };
        let output = string_field(row, "output")?;
        return Ok(if has_template {
            let user = if input.is_empty() { instruction.to_string() } else { format!("{instruction}\n\n{input}") };
            Example::Chat(Chat::new(vec![ChatMessage::new("user", &user), ChatMessage::new("assistant", output)]))
        } else {
            Example::PromptCompletion { prompt: alpaca_prompt(instruction, input), completion: output.to_string() }
        });
    }
    if row.get("prompt").is_some() || row.get("completion").is_some() {
        return Ok(Example::PromptCompletion {
            prompt: string_field(row, "prompt")?.to_string(),
            completion: string_field(row, "completion")?.to_string(),
        });
    }
    if row.get("text").is_some() {
        return Ok(Example::Text(string_field(row, "text")?.to_string()));
    }
    let keys: Vec<&String> = row.as_object().unwrap().keys().collect();
    bail!(
        "row has none of the known fields (text; prompt+completion; messages; conversations; instruction+output; \
         input_ids); it has {keys:?}"
    )
}

/// Whether a row looks like a preference row (any of the shapes' keys), so a wrong `--method`
/// can be named instead of a missing field.
pub fn is_preference_row(row: &Value) -> bool {
    ["chosen", "rejected", "preferred_output", "non_preferred_output", "prompt_input_ids", "chosen_input_ids"]
        .iter()
        .any(|k| row.get(k).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_shape_is_recognised() {
        assert_eq!(parse_row(&json!({"text": "hi"}), false).unwrap(), Example::Text("hi".into()));
        assert_eq!(
            parse_row(&json!({"prompt": "2+2=", "completion": "4"}), false).unwrap(),
            Example::PromptCompletion { prompt: "2+2=".into(), completion: "4".into() }
        );
        let chat =
            parse_row(&json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}), true).unwrap();
        assert_eq!(chat, Example::Chat(Chat::new(vec![ChatMessage::new("user", "a"), ChatMessage::new("assistant", "b")])));
        let sharegpt =
            parse_row(&json!({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}), true).unwrap();
        assert_eq!(sharegpt, chat);
        let alpaca = parse_row(&json!({"instruction": "a", "input": "", "output": "b"}), true).unwrap();
        assert_eq!(alpaca, chat);
        match parse_row(&json!({"instruction": "Add", "input": "2 2", "output": "4"}), false).unwrap() {
            Example::PromptCompletion { prompt, completion } => {
                assert!(prompt.contains("### Input:\n2 2") && completion == "4");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn errors_name_the_field() {
        let e = |v: Value| format!("{:#}", parse_row(&v, true).unwrap_err());
        assert!(e(json!({"messages": [{"role": "user"}]})).contains("messages[0] has no string `content`"));
        assert!(e(json!({"conversations": [{"from": "robot", "value": "x"}]})).contains("conversations[0].from is \"robot\""));
        assert!(e(json!({"prompt": "x"})).contains("missing field `completion`"));
        assert!(e(json!({"text": 3})).contains("field `text` must be a string"));
        assert!(e(json!({"foo": 1})).contains("none of the known fields"));
        assert!(e(json!({"input_ids": [1, 2], "labels": [1]})).contains("`labels` has 1 entries"));
    }

    #[test]
    fn function_calling_rows_read_as_openai_and_trl_write_them() {
        let chat = |v: Value| match parse_row(&v, true).unwrap() {
            Example::Chat(c) => c,
            other => panic!("{other:?}"),
        };
        let function = json!({"name": "add", "parameters": {"type": "object"}});
        let call = json!({"type": "function", "function": {"name": "add", "arguments": {"a": 1}}});
        let openai = chat(json!({"messages": [{"role": "user", "content": "1+?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "1"}, {"role": "assistant", "content": "1", "weight": 0}],
            "tools": [{"type": "function", "function": function}]}));
        assert_eq!(openai.messages[1].tool_calls, Some(json!([{"type": "function", "id": "c", "function": call["function"]}])));
        assert_eq!((openai.messages[1].content.as_str(), openai.messages[2].tool_call_id.as_deref()), ("", Some("c")));
        assert_eq!((openai.untrained.clone(), openai.trained_turns().collect::<Vec<_>>()), (vec![3], vec![1]));
        assert_eq!(openai.tools, Some(json!([{"type": "function", "function": function}])));
        // TRL's datasets: tools as a JSON string of bare functions; the legacy shapes.
        let trl =
            chat(json!({"messages": [{"role": "user", "content": "1+?"}, {"role": "assistant", "content": "", "tool_calls": [call]}],
            "tools": json!([function]).to_string()}));
        assert_eq!((trl.tools, trl.messages[1].tool_calls.clone()), (openai.tools.clone(), Some(json!([call]))));
        let legacy = chat(json!({"messages": [{"role": "user", "content": "1+?"},
            {"role": "assistant", "content": null, "function_call": {"name": "add", "arguments": "{\"a\": 1}"}},
            {"role": "function", "name": "add", "content": "1"}], "functions": [function]}));
        assert_eq!((legacy.tools, legacy.messages[1].tool_calls.clone()), (openai.tools, Some(json!([call]))));
        assert_eq!((legacy.messages[2].role.as_str(), legacy.messages[2].name.as_deref()), ("tool", Some("add")));

        let e = |v: Value| format!("{:#}", parse_row(&v, true).unwrap_err());
        let with = |m: Value, tools: Value| json!({"messages": [{"role": "user", "content": "q"}, m], "tools": tools});
        let bad_args = json!({"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{oops"}}]});
        assert!(e(with(bad_args, json!(null))).contains("messages[1].tool_calls[0].function.arguments: `arguments` is not JSON"));
        let on_user = json!({"role": "user", "content": "x", "tool_calls": [call]});
        assert!(e(with(on_user, json!(null))).contains("messages[1].tool_calls is on a user turn"));
        let bad_legacy = json!({"role": "assistant", "function_call": {"arguments": "{}"}});
        assert!(e(with(bad_legacy, json!(null))).contains("messages[1].function_call.name: `name` must be a string"));
        let no_content = json!({"role": "assistant", "content": null});
        assert!(e(with(no_content, json!(null))).contains("messages[1] has no string `content`"));
        let weight = |w: Value| json!({"role": "assistant", "content": "a", "weight": w});
        assert!(e(with(weight(json!(0.5)), json!(null))).contains("messages[1].weight must be 0 or 1"));
        let answer = json!({"role": "assistant", "content": "a"});
        assert!(e(with(answer.clone(), json!("[{oops"))).contains("field `tools` is a string but not JSON"));
        assert!(e(with(answer.clone(), json!([{"type": "retrieval"}]))).contains("tools[0] needs a function with a string `name`"));
        assert!(e(with(answer.clone(), json!([{"type": "code", "function": function}]))).contains("tools[0].type must be \"function\""));
        // A turn of weight 0 is for supervised chat rows; elsewhere every turn counts.
        let prompt = json!([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0}]);
        assert!(format!("{:#}", messages(&prompt, "prompt", "role", "content").unwrap_err()).contains("prompt[1].weight is 0"));
        // An answer of calls only still trains; one whose only answer has weight 0 trains nothing.
        assert_eq!(trains_nothing(&Example::Chat(chat(with(json!({"role": "assistant", "tool_calls": [call]}), json!(null))))), None);
        assert!(trains_nothing(&Example::Chat(chat(with(weight(json!(0)), json!(null))))).is_some());
    }

    #[test]
    fn a_turns_thinking_reads_under_either_name() {
        let row = |m: Value| json!({"messages": [{"role": "user", "content": "q"}, m]});
        let thinking = |v: Value| match parse_row(&v, true).unwrap() {
            Example::Chat(c) => c.messages[1].reasoning.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(thinking(row(json!({"role": "assistant", "content": "a", "reasoning_content": "t"}))), Some("t".into()));
        assert_eq!(
            thinking(row(json!({"role": "assistant", "content": "a", "reasoning": "t", "reasoning_content": "t"}))),
            Some("t".into())
        );
        assert_eq!(thinking(row(json!({"role": "assistant", "content": "a", "reasoning_content": null}))), None);
        let e = |m: Value| format!("{:#}", parse_row(&row(m), true).unwrap_err());
        assert!(e(json!({"role": "assistant", "content": "a", "reasoning": "t", "reasoning_content": "u"}))
            .contains("messages[1].reasoning: `reasoning` differs from `reasoning_content`"));
        assert!(e(json!({"role": "user", "content": "a", "reasoning_content": "t"}))
            .contains("messages[1].reasoning_content: only assistant messages carry `reasoning_content`"));
        assert!(e(json!({"role": "assistant", "content": "a", "reasoning": ["t"]}))
            .contains("messages[1].reasoning: `reasoning` must be a string"));
    }
}
