//! The sampling fields both generation endpoints share (`temperature`, `top_p`, `stop`, `n`,
//! `logprobs`, `stream`, ...), read and range-checked into [`Sampling`]; and `logit_bias`.

use serde_json::Value;

use crate::generate::{ModelDefaults, OutputControls, SamplingParams};
use crate::serve::error::ApiError;
use crate::serve::fields::Fields;

/// The most choices one request may ask for.
pub const MAX_N: usize = 8;
/// The most stop strings (OpenAI's limit).
pub const MAX_STOP: usize = 4;
/// The most `logit_bias` entries.
pub const MAX_LOGIT_BIAS: usize = 1024;

/// The sampling part of a completion or chat request, checked. `params.max_new_tokens` is left
/// 0: the prompt's length decides it (see `validate`).
#[derive(Debug, Clone)]
pub struct Sampling {
    pub max_tokens: Option<usize>,
    pub params: SamplingParams,
    pub n: usize,
    /// Candidates generated, of which the `n` most likely are returned (`n` unless asked).
    pub best_of: usize,
    pub stream: bool,
    pub include_usage: bool,
    pub echo: bool,
}

/// The fields both endpoints share. `chat` picks the chat names (`max_completion_tokens`,
/// `logprobs` as a boolean with `top_logprobs`).
pub fn parse(v: &Value, defaults: &ModelDefaults, chat: bool) -> Result<Sampling, ApiError> {
    let f = Fields::of(v)?;
    let max_tokens = match (f.integer("max_tokens", 1, 1 << 31)?, if chat { f.integer("max_completion_tokens", 1, 1 << 31)? } else { None })
    {
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
        Some(_) => {
            return Err(ApiError::invalid("stop", format!("`stop` must be a non-empty string or a list of up to {MAX_STOP} of them.")))
        }
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
    // vLLM's (and OpenAI's legacy) `best_of`: that many candidates, the `n` most likely returned.
    let best_of = match f.integer("best_of", 1, MAX_N as i64)? {
        None => n,
        Some(b) if (b as usize) < n => return Err(ApiError::invalid("best_of", format!("`best_of` must be at least `n` ({n}), got {b}."))),
        Some(b) if b as usize > n && stream => {
            return Err(ApiError::invalid(
                "best_of",
                "`best_of` greater than `n` cannot be streamed: the best answers are known only at the end.",
            ))
        }
        Some(b) => b as usize,
    };
    let mut params = SamplingParams {
        max_new_tokens: 0,
        temperature,
        top_k,
        top_p,
        repetition_penalty,
        seed: seed.unwrap_or_else(crate::serve::ids::fresh_seed),
        stop,
        min_p,
        presence_penalty,
        frequency_penalty,
        logprobs,
        logit_bias: vec![],
        prompt_logprobs: None,
        output: output_controls(&f, max_tokens)?,
        chain: None,
        penalty_last_n: None,
    };
    params.output.cumulative_logprob = best_of > n;
    // The one check of the sampling settings (the CLI's `generate` makes the same call).
    params.validate().map_err(|e| ApiError::bad_request(format!("{e:#}")))?;
    Ok(Sampling { max_tokens, params, n, best_of, stream, include_usage, echo })
}

/// vLLM's extensions that decide where an answer ends and how its text reads (all but
/// `stop_token_ids`, which needs the vocabulary: [`stop_token_ids`]).
fn output_controls(f: &Fields, max_tokens: Option<usize>) -> Result<OutputControls, ApiError> {
    let min_tokens = f.integer("min_tokens", 0, 1 << 31)?.unwrap_or(0) as usize;
    if let Some(max) = max_tokens.filter(|&m| min_tokens > m) {
        return Err(ApiError::invalid("min_tokens", format!("`min_tokens` ({min_tokens}) must be at most `max_tokens` ({max}).")));
    }
    let defaults = OutputControls::default();
    Ok(OutputControls {
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(defaults.ignore_eos),
        min_tokens,
        stop_token_ids: vec![],
        include_stop_str_in_output: f.bool("include_stop_str_in_output")?.unwrap_or(defaults.include_stop_str_in_output),
        skip_special_tokens: f.bool("skip_special_tokens")?.unwrap_or(defaults.skip_special_tokens),
        spaces_between_special_tokens: f.bool("spaces_between_special_tokens")?.unwrap_or(defaults.spaces_between_special_tokens),
        ..defaults
    })
}

/// vLLM's `stop_token_ids`: token ids in the vocabulary that end the answer.
pub fn stop_token_ids(v: &Value, vocab: usize) -> Result<Vec<u32>, ApiError> {
    const P: &str = "stop_token_ids";
    let Some(ids) = Fields::of(v)?.value(P) else { return Ok(vec![]) };
    let bad = || ApiError::invalid(P, format!("`stop_token_ids` must be a list of token ids in [0, {vocab})."));
    let Value::Array(ids) = ids else { return Err(bad()) };
    super::prompt::token_ids(ids, vocab).ok_or_else(bad)
}

/// `logit_bias`: an object from token ids (as strings, OpenAI's form) to a bias in [-100, 100].
pub fn logit_bias(v: &Value, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    const P: &str = "logit_bias";
    let Some(bias) = Fields::of(v)?.value(P) else { return Ok(vec![]) };
    let Value::Object(map) = bias else {
        return Err(ApiError::invalid(P, "`logit_bias` must be an object from token ids to numbers in [-100, 100]."));
    };
    if map.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(P, format!("`logit_bias` has {} entries; at most {MAX_LOGIT_BIAS}.", map.len())));
    }
    map.iter()
        .map(|(k, b)| {
            let id = k
                .parse::<u32>()
                .ok()
                .filter(|&i| (i as usize) < vocab)
                .ok_or_else(|| ApiError::invalid(P, format!("`logit_bias` key {k:?} is not a token id in [0, {vocab}).")))?;
            let b = b
                .as_f64()
                .filter(|b| (-100.0..=100.0).contains(b))
                .ok_or_else(|| ApiError::invalid(P, format!("`logit_bias` for token {id} must be a number in [-100, 100], got {b}.")))?;
            Ok((id, b as f32))
        })
        .collect()
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
        ] {
            let e = parse(&body, &defaults(), true).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{body}");
        }
        let r = parse(&json!({"model": "m", "max_completion_tokens": 7, "stop": "x", "top_k": -1, "seed": 3}), &defaults(), true).unwrap();
        assert_eq!((r.max_tokens, r.params.stop.clone(), r.params.top_k, r.params.seed), (Some(7), vec!["x".to_string()], None, 3));
        for (bias, ok) in [
            (json!({"5": -100}), true),
            (json!({"50": 1}), false),
            (json!({"x": 1}), false),
            (json!({"5": 101}), false),
            (json!([1]), false),
        ] {
            assert_eq!(logit_bias(&json!({"logit_bias": bias}), 10).is_ok(), ok, "{bias}");
        }
        for body in [json!({"model": "m", "n": 2, "best_of": 1}), json!({"model": "m", "best_of": 3, "stream": true})] {
            assert_eq!(parse(&body, &defaults(), false).unwrap_err().param.as_deref(), Some("best_of"), "{body}");
        }
        let r = parse(&json!({"model": "m", "n": 2, "best_of": 3}), &defaults(), false).unwrap();
        assert_eq!((r.n, r.best_of, r.params.output.cumulative_logprob), (2, 3, true));
        // vLLM's extensions: read, checked, named.
        let r = parse(&json!({"model": "m", "ignore_eos": true, "min_tokens": 3, "max_tokens": 5, "include_stop_str_in_output": true, "skip_special_tokens": false, "spaces_between_special_tokens": false}), &defaults(), true).unwrap();
        let o = r.params.output;
        assert!(o.ignore_eos && o.include_stop_str_in_output && !o.skip_special_tokens && !o.spaces_between_special_tokens);
        assert_eq!(o.min_tokens, 3);
        for (body, param) in [
            (json!({"model": "m", "min_tokens": 6, "max_tokens": 5}), "min_tokens"),
            (json!({"model": "m", "min_tokens": -1}), "min_tokens"),
            (json!({"model": "m", "ignore_eos": "yes"}), "ignore_eos"),
            (json!({"model": "m", "skip_special_tokens": 1}), "skip_special_tokens"),
        ] {
            assert_eq!(parse(&body, &defaults(), true).unwrap_err().param.as_deref(), Some(param), "{body}");
        }
        assert_eq!(stop_token_ids(&json!({"stop_token_ids": [3, 9]}), 10).unwrap(), vec![3, 9]);
        for ids in [json!([10]), json!([-1]), json!(3), json!(["3"])] {
            assert_eq!(stop_token_ids(&json!({"stop_token_ids": ids}), 10).unwrap_err().param.as_deref(), Some("stop_token_ids"));
        }
    }
}
