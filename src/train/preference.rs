//! Preference data for DPO: rows of (prompt, chosen, rejected) in the shapes people have them,
//! tokenised as TRL's `DPOTrainer` tokenises them, cut to `--seq-len`, and laid out as two
//! samples per pair (chosen, then rejected) whose labels mark the completion.
//!
//! Shapes (errors name the field):
//! - TRL's standard rows `{"prompt", "chosen", "rejected"}` of strings: the eos token is appended
//!   to each completion that does not end with it, and the prompt and prompt + completion are
//!   tokenised with the tokenizer's special tokens;
//! - TRL's conversational rows, the same keys holding lists of messages (the prompt rendered with
//!   the chat template and its generation prompt, prompt + completion rendered whole), or only
//!   `chosen` and `rejected`, whose shared leading turns are the prompt (TRL's `extract_prompt`);
//! - OpenAI's DPO rows `{"input": {"messages"}, "preferred_output", "non_preferred_output"}`,
//!   read as the conversational rows they mean;
//! - pre-tokenised `{"prompt_input_ids", "chosen_input_ids", "rejected_input_ids"}`, taken as
//!   they are (eos appended to neither).
//!
//! As in TRL, a completion starts where the tokenised prompt and the tokenised prompt +
//! completion diverge (a template may render the prompt alone differently, and tokens may merge
//! across the boundary).

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::data::{pad, read_rows_bytes, Dataset, Sample, TextTools, IGNORE_INDEX};
use super::formats::{id_list, messages, row_tools, short, string_field};
use super::text_budget;
use crate::tokenize::{tool_prompt, ChatMessage};

/// One preference row as read, before tokenisation.
#[derive(Debug, Clone, PartialEq)]
pub enum PreferenceRow {
    Text {
        prompt: String,
        chosen: String,
        rejected: String,
    },
    /// `tools`: the functions the conversation may call (`formats::row_tools`).
    Chat {
        prompt: Vec<ChatMessage>,
        chosen: Vec<ChatMessage>,
        rejected: Vec<ChatMessage>,
        tools: Option<Value>,
    },
    Tokens {
        prompt: Vec<u32>,
        chosen: Vec<u32>,
        rejected: Vec<u32>,
    },
}

/// A tokenised pair: the shared prompt and each completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairTokens {
    pub prompt: Vec<u32>,
    pub chosen: Vec<u32>,
    pub rejected: Vec<u32>,
}

const SHAPES: &str = "{\"prompt\", \"chosen\", \"rejected\"} (strings or lists of messages), {\"chosen\", \"rejected\"} \
                      (conversations), {\"input\": {\"messages\"}, \"preferred_output\", \"non_preferred_output\"}, or \
                      {\"prompt_input_ids\", \"chosen_input_ids\", \"rejected_input_ids\"}";

pub use super::formats::is_preference_row;

fn token_ids(row: &Value, field: &str) -> Result<Vec<u32>> {
    let ids = id_list(row, field)?.with_context(|| format!("missing field `{field}`"))?;
    if let Some(bad) = ids.iter().find(|&&x| x < 0 || x > u32::MAX as i64) {
        bail!("field `{field}` holds {bad}, not a token id");
    }
    Ok(ids.into_iter().map(|x| x as u32).collect())
}

fn message_list(row: &Value, field: &str) -> Result<Vec<ChatMessage>> {
    messages(row.get(field).with_context(|| format!("missing field `{field}`"))?, field, "role", "content")
}

/// Reads one preference row.
pub fn parse_preference_row(row: &Value) -> Result<PreferenceRow> {
    if !row.is_object() {
        bail!("row is not a JSON object");
    }
    if row.get("prompt_input_ids").is_some() || row.get("chosen_input_ids").is_some() {
        return Ok(PreferenceRow::Tokens {
            prompt: token_ids(row, "prompt_input_ids")?,
            chosen: token_ids(row, "chosen_input_ids")?,
            rejected: token_ids(row, "rejected_input_ids")?,
        });
    }
    if row.get("input").is_some() || row.get("preferred_output").is_some() {
        let input = row.get("input").context("missing field `input`")?;
        if !input.is_object() {
            bail!("field `input` must be an object with `messages`, found {}", short(input));
        }
        let prompt = messages(input.get("messages").context("missing field `input.messages`")?, "input.messages", "role", "content")?;
        return Ok(PreferenceRow::Chat {
            prompt,
            chosen: message_list(row, "preferred_output")?,
            rejected: message_list(row, "non_preferred_output")?,
            tools: row_tools(input)?,
        });
    }
    let (Some(chosen), Some(_)) = (row.get("chosen"), row.get("rejected")) else {
        let keys: Vec<&String> = row.as_object().unwrap().keys().collect();
        bail!("a preference row needs one of {SHAPES}; it has {keys:?}");
    };
    // Each field a string or a list of messages, the first that is neither named.
    for field in ["prompt", "chosen", "rejected"] {
        match row.get(field) {
            None | Some(Value::String(_)) | Some(Value::Array(_)) => {}
            Some(other) => bail!("field `{field}` must be a string or a list of messages, found {}", short(other)),
        }
    }
    if chosen.is_string() {
        return Ok(PreferenceRow::Text {
            prompt: string_field(row, "prompt")?.to_string(),
            chosen: string_field(row, "chosen")?.to_string(),
            rejected: string_field(row, "rejected")?.to_string(),
        });
    }
    let (chosen, rejected) = (message_list(row, "chosen")?, message_list(row, "rejected")?);
    match row.get("prompt") {
        Some(Value::String(_)) => bail!("field `prompt` is a string but `chosen` is a list of messages; give both as messages"),
        Some(_) => Ok(PreferenceRow::Chat { prompt: message_list(row, "prompt")?, chosen, rejected, tools: row_tools(row)? }),
        None => {
            // TRL's extract_prompt: the leading turns both conversations share.
            let shared = chosen.iter().zip(&rejected).take_while(|(a, b)| a == b).count();
            if shared == 0 {
                bail!("`chosen` and `rejected` share no leading turn and there is no `prompt`");
            }
            if shared == chosen.len() || shared == rejected.len() {
                bail!("`chosen` and `rejected` differ in no turn after their shared prompt");
            }
            Ok(PreferenceRow::Chat {
                prompt: chosen[..shared].to_vec(),
                chosen: chosen[shared..].to_vec(),
                rejected: rejected[shared..].to_vec(),
                tools: row_tools(row)?,
            })
        }
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A preference row bounded for `seq_len`: a pair keeps its prompt's end and its completions'
/// starts (`preference::truncate_pair`), so the fields are cut the same way.
pub fn bound_pair(row: &mut PreferenceRow, seq_len: usize) {
    let budget = text_budget::bytes_for(seq_len);
    match row {
        PreferenceRow::Text { prompt, chosen, rejected } => {
            text_budget::keep_end(prompt, budget);
            text_budget::keep_start(chosen, budget);
            text_budget::keep_start(rejected, budget);
        }
        PreferenceRow::Chat { prompt, chosen, rejected, .. } => {
            text_budget::contents(prompt, budget, text_budget::keep_end);
            text_budget::contents(chosen, budget, text_budget::keep_start);
            text_budget::contents(rejected, budget, text_budget::keep_start);
        }
        PreferenceRow::Tokens { .. } => {}
    }
}

/// Refuses a pair that trains nothing: an empty completion (TRL's `chosen`/`rejected` must hold
/// text), or `chosen` equal to `rejected` (their log-ratio difference is zero, so is the
/// gradient), naming the field.
pub fn check_pair(row: &PreferenceRow) -> Result<()> {
    let blank = |t: &str| t.trim().is_empty();
    let silent = |ms: &[ChatMessage]| ms.iter().all(|m| blank(&m.content) && m.tool_calls.is_none());
    let (chosen_empty, rejected_empty, same) = match row {
        PreferenceRow::Text { chosen, rejected, .. } => (blank(chosen), blank(rejected), chosen == rejected),
        PreferenceRow::Chat { chosen, rejected, .. } => (silent(chosen), silent(rejected), chosen == rejected),
        PreferenceRow::Tokens { chosen, rejected, .. } => (chosen.is_empty(), rejected.is_empty(), chosen == rejected),
    };
    if chosen_empty {
        bail!("field `chosen` is empty: a pair needs two completions");
    }
    if rejected_empty {
        bail!("field `rejected` is empty: a pair needs two completions");
    }
    if same {
        bail!("`chosen` and `rejected` are the same: the pair teaches nothing");
    }
    Ok(())
}

/// Tokenises a row as TRL 1.x does (see the module's notes).
pub fn tokenize_pair(row: &PreferenceRow, tools: &TextTools) -> Result<PairTokens> {
    let encode = |text: &str, special: bool| Ok::<_, anyhow::Error>((tools.encode)(text, special)?.0);
    let (prompt, chosen, rejected) = match row {
        PreferenceRow::Tokens { prompt, chosen, rejected } => {
            (prompt.clone(), [prompt.clone(), chosen.clone()].concat(), [prompt.clone(), rejected.clone()].concat())
        }
        PreferenceRow::Text { prompt, chosen, rejected } => {
            let eos = tools.eos_id.context("text preference rows need the model's eos token (eos_token_id in config.json)")?;
            let with_eos = |completion: &str| -> Result<Vec<u32>> {
                let mut ids = encode(&format!("{prompt}{completion}"), true)?;
                if ids.last() != Some(&eos) {
                    ids.push(eos);
                }
                Ok(ids)
            };
            (encode(prompt, true)?, with_eos(chosen)?, with_eos(rejected)?)
        }
        PreferenceRow::Chat { prompt, chosen, rejected, tools: functions } => {
            let template = tools.template.context("conversational preference rows need a chat template, and this model has none")?;
            // As the server renders a request (`tokenize::tool_prompt`): with the functions, calls and results.
            let render = |turns: &[ChatMessage], add_generation_prompt: bool| {
                tool_prompt::render_row(template, turns, functions.as_ref(), add_generation_prompt)
            };
            let whole = |completion: &[ChatMessage]| encode(&render(&[prompt.clone(), completion.to_vec()].concat(), false)?, false);
            (encode(&render(prompt, true)?, false)?, whole(chosen)?, whole(rejected)?)
        }
    };
    let prompt_len = common_prefix(&prompt, &chosen).min(common_prefix(&prompt, &rejected));
    Ok(PairTokens {
        prompt: prompt[..prompt_len].to_vec(),
        chosen: chosen[prompt_len..].to_vec(),
        rejected: rejected[prompt_len..].to_vec(),
    })
}

/// Cuts a pair to `seq_len` tokens per sequence: the prompt first (its end kept, as the part
/// nearest the answer), to what leaves the longer completion whole, but never below half of
/// `seq_len` (or the prompt's own length); then the completions (their start kept). Returns
/// whether anything was cut.
pub fn truncate_pair(pair: &mut PairTokens, seq_len: usize) -> bool {
    let longest = pair.chosen.len().max(pair.rejected.len());
    if pair.prompt.len() + longest <= seq_len {
        return false;
    }
    let keep_prompt = seq_len.saturating_sub(longest).max(pair.prompt.len().min(seq_len / 2));
    pair.prompt.drain(..pair.prompt.len() - keep_prompt);
    let room = seq_len - pair.prompt.len();
    pair.chosen.truncate(room);
    pair.rejected.truncate(room);
    true
}

/// The pair's two samples, chosen first: the prompt's positions carry no label.
pub fn pair_samples(pair: &PairTokens, seq_len: usize, pad_id: u32) -> [Sample; 2] {
    let sample = |completion: &[u32]| {
        let ids = [pair.prompt.as_slice(), completion].concat();
        let labels = ids.iter().enumerate().map(|(i, &t)| if i < pair.prompt.len() { IGNORE_INDEX } else { t as i64 }).collect();
        pad(ids, labels, seq_len, pad_id)
    };
    [sample(&pair.chosen), sample(&pair.rejected)]
}

/// Preference rows of a data file (JSONL, JSON or Parquet) as samples, each pair's chosen
/// sample followed by its rejected one. Bad rows are named by file, line and field (or skipped
/// and counted with `skip_bad_rows`).
pub fn load_preference_dataset(path: &Path, bytes: &[u8], seq_len: usize, skip_bad_rows: bool, tools: &TextTools) -> Result<Dataset> {
    let mut out = Dataset::default();
    for (line, row) in read_rows_bytes(path, bytes)? {
        out.rows += 1;
        let built = (|| -> Result<(PairTokens, bool)> {
            let row = row?;
            let mut parsed = parse_preference_row(&row)?;
            bound_pair(&mut parsed, seq_len);
            check_pair(&parsed)?;
            let mut pair = tokenize_pair(&parsed, tools)?;
            for (name, c) in [("chosen", &pair.chosen), ("rejected", &pair.rejected)] {
                if c.is_empty() {
                    bail!("the {name} completion is empty after tokenisation");
                }
            }
            let cut = truncate_pair(&mut pair, seq_len);
            if pair.chosen == pair.rejected {
                bail!("`chosen` and `rejected` are the same within --seq-len {seq_len}: the pair teaches nothing");
            }
            Ok((pair, cut))
        })();
        match built {
            Ok((pair, cut)) => {
                out.truncated += usize::from(cut);
                out.samples.extend(pair_samples(&pair, seq_len, tools.pad_id));
            }
            Err(e) if skip_bad_rows => {
                out.skipped += 1;
                if out.skipped <= 3 {
                    eprintln!("skipping {}:{line}: {e:#}", path.display());
                }
            }
            Err(e) => return Err(e.context(format!("{}:{line}", path.display()))),
        }
    }
    if out.samples.is_empty() {
        bail!("{}: no usable preference rows ({} rows, {} skipped)", path.display(), out.rows, out.skipped);
    }
    if let Some(i) = out.samples.iter().position(|s| s.target_tokens() == 0) {
        bail!(
            "{}: pair {} has a completion with no token to score (an empty prompt and a one-token completion?)",
            path.display(),
            i / 2 + 1
        );
    }
    out.supervised_tokens = out.samples.iter().map(Sample::target_tokens).sum();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_shape_is_read() {
        let user = |c: &str| ChatMessage::new("user", c);
        let bot = |c: &str| ChatMessage::new("assistant", c);
        assert_eq!(
            parse_preference_row(&json!({"prompt": "p", "chosen": "a", "rejected": "b"})).unwrap(),
            PreferenceRow::Text { prompt: "p".into(), chosen: "a".into(), rejected: "b".into() }
        );
        let chat = PreferenceRow::Chat { prompt: vec![user("q")], chosen: vec![bot("a")], rejected: vec![bot("b")], tools: None };
        let m = |r: &str, c: &str| json!({"role": r, "content": c});
        let trl = json!({"prompt": [m("user", "q")], "chosen": [m("assistant", "a")], "rejected": [m("assistant", "b")]});
        assert_eq!(parse_preference_row(&trl).unwrap(), chat);
        let implicit = json!({"chosen": [m("user", "q"), m("assistant", "a")], "rejected": [m("user", "q"), m("assistant", "b")]});
        assert_eq!(parse_preference_row(&implicit).unwrap(), chat);
        let openai = json!({"input": {"messages": [m("user", "q")]}, "preferred_output": [m("assistant", "a")], "non_preferred_output": [m("assistant", "b")]});
        assert_eq!(parse_preference_row(&openai).unwrap(), chat);
        // OpenAI's preference rows with functions: a call preferred to a text answer.
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        let call = json!({"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]});
        let with_tools = json!({"input": {"messages": [m("user", "q")], "tools": tools}, "preferred_output": [call], "non_preferred_output": [m("assistant", "b")]});
        let PreferenceRow::Chat { chosen, tools: read, .. } = parse_preference_row(&with_tools).unwrap() else { panic!("a chat pair") };
        assert_eq!((read, chosen[0].tool_calls.is_some()), (Some(tools), true));
        let ids = json!({"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": [4, 5]});
        assert_eq!(
            parse_preference_row(&ids).unwrap(),
            PreferenceRow::Tokens { prompt: vec![1, 2], chosen: vec![3], rejected: vec![4, 5] }
        );
    }

    #[test]
    fn errors_name_the_field() {
        let e = |v: Value| format!("{:#}", parse_preference_row(&v).unwrap_err());
        assert!(e(json!({"prompt": "p", "chosen": "a"})).contains("needs one of"));
        assert!(e(json!({"prompt": "p", "chosen": "a", "rejected": 3})).contains("field `rejected` must be a string"));
        assert!(e(json!({"input": {"messages": []}, "preferred_output": []})).contains("`input.messages` is empty"));
        assert!(e(
            json!({"input": {"messages": [{"role": "user", "content": "q"}]}, "preferred_output": [{"role": "assistant", "content": "a"}]})
        )
        .contains("missing field `non_preferred_output`"));
        assert!(e(json!({"prompt_input_ids": [1], "chosen_input_ids": [-2], "rejected_input_ids": [3]}))
            .contains("`chosen_input_ids` holds -2"));
        assert!(e(json!({"text": "x"})).contains("it has [\"text\"]"));
        let m = |r: &str, c: &str| json!({"role": r, "content": c});
        assert!(e(json!({"chosen": [m("user", "q")], "rejected": [m("user", "r")]})).contains("share no leading turn"));
    }

    #[test]
    fn truncation_cuts_the_prompt_first_then_the_completions() {
        let pair = |p: usize, c: usize, r: usize| PairTokens { prompt: (0..p as u32).collect(), chosen: vec![7; c], rejected: vec![8; r] };
        let mut fits = pair(4, 3, 2);
        assert!(!truncate_pair(&mut fits, 8));
        // A long prompt gives way to the completion, its end kept.
        let mut long_prompt = pair(20, 3, 5);
        assert!(truncate_pair(&mut long_prompt, 16));
        assert_eq!((long_prompt.prompt.len(), long_prompt.prompt[0], long_prompt.rejected.len()), (11, 9, 5));
        // Both long: the prompt keeps half, the completions the rest.
        let mut both = pair(20, 30, 2);
        truncate_pair(&mut both, 16);
        assert_eq!((both.prompt.len(), both.chosen.len(), both.rejected.len()), (8, 8, 2));
        // A short prompt stays whole.
        let mut short_prompt = pair(3, 30, 30);
        truncate_pair(&mut short_prompt, 16);
        assert_eq!((short_prompt.prompt.len(), short_prompt.chosen.len()), (3, 13));
        let [c, r] = pair_samples(&short_prompt, 16, 0);
        assert_eq!((c.len, c.target_tokens(), r.labels[2], r.labels[3]), (16, 13, IGNORE_INDEX, 8));
    }

    /// A pair's prompt keeps its end, its completions their starts, each within the budget.
    #[test]
    fn a_huge_pair_is_cut_to_the_budget_keeping_what_truncation_keeps() {
        let mut pair =
            PreferenceRow::Text { prompt: format!("{}END", "p".repeat(1 << 20)), chosen: "c".repeat(1 << 20), rejected: "r".into() };
        bound_pair(&mut pair, 64);
        let PreferenceRow::Text { prompt, chosen, rejected } = pair else { unreachable!() };
        assert!(prompt.ends_with("END") && prompt.len() == text_budget::bytes_for(64), "the prompt keeps its end");
        assert_eq!((chosen.len(), rejected.as_str()), (text_budget::bytes_for(64), "r"));
    }
}
