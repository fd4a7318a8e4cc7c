//! The row shapes people bring, read into one of four kinds of example:
//! `text`; `prompt`/`completion`; chat (`messages` with OpenAI roles, ShareGPT `conversations`
//! with `from`/`value`, and Alpaca `instruction`/`input`/`output`); and pre-tokenised
//! `input_ids`/`labels`. Errors name the field.

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::tokenize::ChatMessage;

#[derive(Debug, Clone, PartialEq)]
pub enum Example {
    Text(String),
    PromptCompletion { prompt: String, completion: String },
    Chat(Vec<ChatMessage>),
    Tokens { input_ids: Vec<i64>, labels: Option<Vec<i64>> },
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

pub(super) fn messages(list: &Value, field: &str, role_key: &str, content_key: &str) -> Result<Vec<ChatMessage>> {
    let items = list.as_array().with_context(|| format!("field `{field}` must be a list of messages"))?;
    if items.is_empty() {
        bail!("field `{field}` is empty");
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m.get(role_key).and_then(Value::as_str).with_context(|| format!("{field}[{i}] has no string `{role_key}`"))?;
            let content =
                m.get(content_key).and_then(Value::as_str).with_context(|| format!("{field}[{i}] has no string `{content_key}`"))?;
            let role = match (field, role) {
                // ShareGPT's speaker names.
                ("conversations", "human" | "user") => "user",
                ("conversations", "gpt" | "assistant" | "model" | "chatgpt" | "bing") => "assistant",
                ("conversations", "system") => "system",
                ("conversations", other) => bail!("{field}[{i}].from is {other:?}; expected human, gpt or system"),
                (_, r @ ("system" | "user" | "assistant" | "developer" | "tool")) => r,
                (_, other) => bail!("{field}[{i}].role is {other:?}; expected system, user or assistant"),
            };
            Ok(ChatMessage::new(role, content))
        })
        .collect()
}

/// Why a row trains no token whatever the tokenizer, when it does not: a chat with no
/// assistant turn (what fine-tuning jobs train on), or token rows whose labels are all ignored.
pub fn trains_nothing(e: &Example) -> Option<&'static str> {
    match e {
        Example::Chat(m) if !m.iter().any(|m| m.role == "assistant" && (!m.content.is_empty() || m.tool_calls.is_some())) => {
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
        return Ok(Example::Chat(messages(m, "messages", "role", "content")?));
    }
    if let Some(c) = row.get("conversations") {
        return Ok(Example::Chat(messages(c, "conversations", "from", "value")?));
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
            Example::Chat(vec![ChatMessage::new("user", &user), ChatMessage::new("assistant", output)])
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
        assert_eq!(chat, Example::Chat(vec![ChatMessage::new("user", "a"), ChatMessage::new("assistant", "b")]));
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
}
