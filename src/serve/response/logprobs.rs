//! `logprobs` in OpenAI's two shapes: completions' parallel lists (`tokens`, `token_logprobs`,
//! `top_logprobs`, `text_offset`) and chat's `content` entries (`token`, `logprob`, `bytes`,
//! `top_logprobs`).

use serde_json::{json, Value};

use crate::generate::TokenLogprob;
use crate::tokenize::TextTokenizer;

/// Completions' `logprobs` for tokens scored or not (`None`: the prompt's first token, which
/// nothing before it scores): `text_offset` counts characters of the returned text, from `start`
/// (where the first of these tokens begins in it). Returns the object and where the next token
/// would begin. Prompt tokens are shown with special tokens as "" (they are not in the echoed
/// prompt text); generated ones as decoded.
pub fn completion_entries(
    tokenizer: &TextTokenizer,
    tokens: &[(u32, Option<&TokenLogprob>)],
    start: usize,
    prompt: bool,
) -> (Value, usize) {
    let text = |id: u32| tokenizer.decode(&[id], prompt).unwrap_or_default();
    let mut offset = start;
    let (mut strings, mut offsets, mut lps, mut tops) = (vec![], vec![], vec![], vec![]);
    for (id, lp) in tokens {
        let t = text(*id);
        offsets.push(offset);
        offset += t.chars().count();
        strings.push(t);
        lps.push(lp.map(|l| json!(l.logprob)).unwrap_or(Value::Null));
        let top = |l: &TokenLogprob| {
            Value::Object(l.top.iter().map(|(id, lp)| (tokenizer.decode(&[*id], false).unwrap_or_default(), json!(lp))).collect())
        };
        tops.push(lp.map(top).unwrap_or(Value::Null));
    }
    (json!({"tokens": strings, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}), offset)
}

/// Completions' `logprobs` of a whole answer: with `echo`, the prompt's tokens first (scored by
/// `prompt`, the first one null), then the generated ones.
pub fn completion(
    tokenizer: &TextTokenizer,
    prompt_ids: &[u32],
    prompt: Option<&[TokenLogprob]>,
    generated: &[TokenLogprob],
    echo: Option<&str>,
) -> Value {
    let start = echo.map_or(0, |e| e.chars().count());
    let gen: Vec<(u32, Option<&TokenLogprob>)> = generated.iter().map(|l| (l.token, Some(l))).collect();
    let (mut out, _) = completion_entries(tokenizer, &gen, start, false);
    if let (Some(_), Some(scored)) = (echo, prompt) {
        let (mut all, _) = completion_entries(tokenizer, &prompt_entries(prompt_ids, scored), 0, true);
        for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            let tail = out[key].as_array().cloned().unwrap_or_default();
            all[key].as_array_mut().expect("an array").extend(tail);
        }
        out = all;
    }
    out
}

/// The prompt's tokens with their scores (`scored[i]` scores token i + 1).
pub fn prompt_entries<'a>(prompt_ids: &[u32], scored: &'a [TokenLogprob]) -> Vec<(u32, Option<&'a TokenLogprob>)> {
    prompt_ids.iter().enumerate().map(|(i, &id)| (id, i.checked_sub(1).and_then(|j| scored.get(j)))).collect()
}

/// Chat's `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
pub fn chat(tokenizer: &TextTokenizer, lps: &[TokenLogprob]) -> Value {
    let text = |id: u32| tokenizer.decode(&[id], false).unwrap_or_default();
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let t = text(l.token);
            let top: Vec<Value> = l
                .top
                .iter()
                .map(|(id, lp)| {
                    let s = text(*id);
                    json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})
                })
                .collect();
            json!({"token": t, "logprob": l.logprob, "bytes": t.as_bytes(), "top_logprobs": top})
        })
        .collect();
    json!({"content": content})
}
