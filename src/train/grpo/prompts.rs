//! GRPO's data: prompts, each with the row's other fields for the graders (`{{item.FIELD}}`).
//!
//! - TRL's rows: `{"prompt": "text"}` or `{"prompt": [{"role", "content"}, ...]}` (rendered by
//!   the chat template with the generation prompt), plus any fields (`answer`, ...);
//! - OpenAI's reinforcement fine-tuning rows: `{"messages": [...], <reference fields>}`, the
//!   messages being the prompt (they end before the assistant's turn);
//! - pre-tokenised prompts: `{"prompt_input_ids": [...]}`, as DPO's pre-tokenised pairs.
//!
//! JSONL, JSON and Parquet files, as for SFT; a bad row is named by file, line and field.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};

use crate::train::data::{read_rows_bytes, TextTools};
use crate::train::formats::{messages, row_tools};

/// One prompt of the data and the fields its graders may read.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptRow {
    pub ids: Vec<u32>,
    /// The row without its prompt field.
    pub item: Value,
}

/// The prompts of a data file, each at most `max_prompt_tokens` tokens (a longer one is a bad
/// row: cutting it would change the question the graders check the answer to).
pub fn load_prompts(
    path: &Path,
    bytes: &[u8],
    tools: &TextTools,
    max_prompt_tokens: usize,
    skip_bad_rows: bool,
    check_item: &dyn Fn(&Value) -> Result<()>,
) -> Result<(Vec<PromptRow>, usize)> {
    let mut out = vec![];
    let mut skipped = 0;
    for (line, row) in read_rows_bytes(path, bytes)? {
        let built = row.and_then(|row| prompt_row(row, tools, max_prompt_tokens)).and_then(|p| check_item(&p.item).map(|_| p));
        match built {
            Ok(p) => out.push(p),
            Err(e) if skip_bad_rows => {
                skipped += 1;
                if skipped <= 3 {
                    eprintln!("skipping {}:{line}: {e:#}", path.display());
                }
            }
            Err(e) => return Err(e.context(format!("{}:{line}", path.display()))),
        }
    }
    if out.is_empty() {
        bail!("{}: no usable prompt rows ({skipped} skipped)", path.display());
    }
    Ok((out, skipped))
}

/// The fields that hold a row's prompt; the rest is its `item`.
const PROMPT_FIELDS: [&str; 3] = ["prompt", "messages", "prompt_input_ids"];

/// Whether `row` is a prompt for reinforcement fine-tuning rather than an SFT or DPO example: a
/// `prompt` without `completion` (or `chosen`), `prompt_input_ids` alone, or `messages` that end
/// before the assistant's turn.
pub fn is_prompt_row(row: &Value) -> bool {
    let has = |k: &str| row.get(k).is_some();
    let messages_end_before_an_answer = row
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| m.last())
        .is_some_and(|m| m.get("role").and_then(Value::as_str) != Some("assistant"));
    (has("prompt") && !has("completion") && !has("chosen"))
        || (has("prompt_input_ids") && !has("chosen_input_ids"))
        || messages_end_before_an_answer
}

/// Checks a prompt row's shape without a tokenizer (what an upload can check).
pub fn check_prompt_row(row: &Value) -> Result<()> {
    let given: Vec<&str> = PROMPT_FIELDS.into_iter().filter(|k| row.get(*k).is_some()).collect();
    match given.as_slice() {
        ["prompt"] => match &row["prompt"] {
            Value::String(s) if !s.is_empty() => Ok(()),
            list @ Value::Array(_) => messages(list, "prompt", "role", "content").map(drop),
            _ => bail!("field `prompt` must be a non-empty string or a list of messages"),
        },
        ["messages"] => messages(&row["messages"], "messages", "role", "content").map(drop),
        ["prompt_input_ids"] => serde_json::from_value::<Vec<u32>>(row["prompt_input_ids"].clone())
            .map(drop)
            .context("field `prompt_input_ids` must be a list of token ids"),
        [] => bail!("needs `prompt`, `messages` or `prompt_input_ids`"),
        _ => bail!("give one of `prompt`, `messages` and `prompt_input_ids`"),
    }
}

/// The row without its prompt: what its graders read as `item`.
pub fn item_of(row: &Value) -> Value {
    let mut item = row.clone();
    if let Some(m) = item.as_object_mut() {
        for k in PROMPT_FIELDS {
            m.remove(k);
        }
    }
    item
}

fn prompt_row(row: Value, tools: &TextTools, max_prompt_tokens: usize) -> Result<PromptRow> {
    let Value::Object(mut fields) = row else { bail!("a row must be an object with a `prompt` or `messages` field") };
    if let Some(ids) = fields.remove("prompt_input_ids") {
        if fields.contains_key("prompt") || fields.contains_key("messages") {
            bail!("give `prompt_input_ids` (pre-tokenised), `prompt` or `messages`, one of them");
        }
        let ids: Vec<u32> = serde_json::from_value(ids).context("field `prompt_input_ids` must be a list of token ids")?;
        return finish(ids, fields, max_prompt_tokens);
    }
    // The functions a conversational prompt may call (they stay in the row for the graders too).
    let functions = row_tools(&serde_json::json!({"tools": fields.get("tools"), "functions": fields.get("functions")}))?;
    let ids = match (fields.remove("prompt"), fields.remove("messages")) {
        (Some(_), Some(_)) => bail!("give `prompt` (TRL's rows) or `messages` (OpenAI's), not both"),
        (Some(Value::String(text)), None) => {
            if text.is_empty() {
                bail!("field `prompt` is empty");
            }
            (tools.encode)(&text, true)?.0
        }
        (Some(list @ Value::Array(_)), None) => chat_prompt(&list, "prompt", functions.as_ref(), tools)?,
        (Some(_), None) => bail!("field `prompt` must be a string or a list of messages"),
        (None, Some(list)) => chat_prompt(&list, "messages", functions.as_ref(), tools)?,
        (None, None) => bail!("needs `prompt` (a string or messages), `messages` (OpenAI's reinforcement rows) or `prompt_input_ids`"),
    };
    finish(ids, fields, max_prompt_tokens)
}

fn finish(ids: Vec<u32>, fields: Map<String, Value>, max_prompt_tokens: usize) -> Result<PromptRow> {
    if ids.is_empty() {
        bail!("the prompt is empty after tokenisation");
    }
    if ids.len() > max_prompt_tokens {
        bail!(
            "the prompt has {} tokens; with --max-completion-length the rows hold at most {max_prompt_tokens} (raise --seq-len)",
            ids.len()
        );
    }
    Ok(PromptRow { ids, item: Value::Object(fields) })
}

fn chat_prompt(list: &Value, field: &str, functions: Option<&Value>, tools: &TextTools) -> Result<Vec<u32>> {
    let turns = messages(list, field, "role", "content")?;
    if turns.last().is_some_and(|m| m.role == "assistant") {
        bail!("field `{field}` ends with an assistant message; the prompt ends where the model's answer begins");
    }
    let template = tools.template.context("conversational prompts need a chat template, and this model has none")?;
    // As the server renders a request with these functions (`tool_prompt`), so rollouts see the
    // prompt the served model will.
    let text = crate::tokenize::tool_prompt::render_row(template, &turns, functions, true)?;
    Ok((tools.encode)(&text, false)?.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(s: &str, _special: bool) -> Result<crate::tokenize::IdsWithOffsets> {
        Ok((s.bytes().map(u32::from).collect(), s.char_indices().map(|(i, c)| (i, i + c.len_utf8())).collect()))
    }

    fn decode(ids: &[u32]) -> Result<String> {
        Ok(ids.iter().map(|&i| i as u8 as char).collect())
    }

    #[test]
    fn prompts_keep_their_other_fields_and_bad_rows_are_named() {
        let tools = TextTools { encode: &bytes, decode: &decode, template: None, eos_id: Some(0), pad_id: 0 };
        let body = b"{\"prompt\": \"2+2=\", \"answer\": \"4\"}\n{\"prompt\": \"a much longer prompt\"}\n";
        let (rows, skipped) = load_prompts(Path::new("p.jsonl"), body, &tools, 8, true, &|_| Ok(())).unwrap();
        assert_eq!((rows.len(), skipped), (1, 1));
        assert_eq!(rows[0].ids, b"2+2=".iter().map(|&b| b as u32).collect::<Vec<_>>());
        assert_eq!(rows[0].item, serde_json::json!({"answer": "4"}));
        let err = format!("{:#}", load_prompts(Path::new("p.jsonl"), body, &tools, 8, false, &|_| Ok(())).unwrap_err());
        assert!(err.contains("p.jsonl:2") && err.contains("20 tokens"), "{err}");
        let chat = b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"answer\": 1}\n";
        let err = format!("{:#}", load_prompts(Path::new("c.jsonl"), chat, &tools, 8, false, &|_| Ok(())).unwrap_err());
        assert!(err.contains("c.jsonl:1") && err.contains("chat template"), "{err}");
        // A conversational prompt's functions are rendered into it, as the server renders them.
        let template = crate::tokenize::ChatTemplate::new(
            "{% for t in tools %}({{ t.function.name }}){% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}",
            None,
            None,
        )
        .unwrap();
        let with_template = TextTools { template: Some(&template), ..tools };
        let calls = b"{\"prompt\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": [{\"name\": \"f\"}]}\n";
        let (rows, _) = load_prompts(Path::new("t.jsonl"), calls, &with_template, 16, false, &|_| Ok(())).unwrap();
        assert_eq!(rows[0].ids, b"(f)hi".iter().map(|&b| b as u32).collect::<Vec<_>>());
        let neither = b"{\"question\": \"x\"}\n";
        let err = format!("{:#}", load_prompts(Path::new("n.jsonl"), neither, &tools, 8, false, &|_| Ok(())).unwrap_err());
        assert!(err.contains("n.jsonl:1") && err.contains("needs `prompt`"), "{err}");
    }
}
