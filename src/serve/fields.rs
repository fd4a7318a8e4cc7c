//! Which request fields each endpoint implements, and what happens to the others.
//!
//! OpenAI answers an argument it does not know with 400 ("Unrecognized request argument
//! supplied: foo_bar"). A server that answers 200 and ignores `tools` or `response_format`
//! breaks agent and structured-output code far from the cause, so by default every field we do
//! not implement is a 400 naming it (`param`): OpenAI's parameters we do not implement say so,
//! others get OpenAI's own message. `serve --lenient` ignores them instead and lists them in the
//! response header [`IGNORED_HEADER`], for clients that send noise. A field whose value is
//! `null` counts as absent, as in OpenAI's API.
//!
//! [`Fields`] reads an accepted field with its type and range checked, naming it when wrong.

use serde_json::{Map, Value};

use super::error::ApiError;

/// The response header that lists, under `--lenient`, the fields a request carried and this
/// server ignored (comma-separated).
pub const IGNORED_HEADER: &str = "x-fsdp-app-ignored-params";

/// `/v1/completions`.
pub const COMPLETIONS: &[&str] = &[
    "model",
    "prompt",
    "suffix",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "n",
    "stop",
    "logprobs",
    "echo",
    "logit_bias",
    "user",
    "stream",
    "stream_options",
    "best_of",
    // As chat's (vLLM's completions take it too).
    "response_format",
];

/// `/v1/chat/completions`.
pub const CHAT: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "n",
    "stop",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "user",
    "stream",
    "stream_options",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    // Variables for the chat template (vLLM's and SGLang's), e.g. `enable_thinking`.
    "chat_template_kwargs",
    // vLLM's: the last assistant message is the start of the answer (`validate::prompt::continued_turn`).
    "continue_final_message",
    "add_generation_prompt",
    // Accepted, changing nothing a local server does (see `validate::no_op`).
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "modalities",
    "reasoning_effort",
];

/// vLLM's sampling extensions, which completions and chat accept too (`validate::sampling`).
pub const VLLM_SAMPLING: &[&str] =
    &["ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"];

/// `/v1/responses`.
pub const RESPONSES: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    // Not in OpenAI's Responses API; chat's, for reproducible sampling (clients send it through
    // `extra_body`, as vLLM takes it).
    "seed",
    // Refused unless they change nothing (see `validate::responses`, `validate::no_op`).
    "store",
    "previous_response_id",
    "include",
    "truncation",
    "reasoning",
    "metadata",
    "user",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
];

/// One chat message.
pub const MESSAGE: &[&str] = &["role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content", "reasoning"];

/// `POST /tokenize`: a prompt, or a conversation (with its functions and template arguments)
/// rendered as the chat endpoint renders it.
pub const TOKENIZE: &[&str] = &["model", "prompt", "add_special_tokens", "messages", "chat_template_kwargs", "tools"];

/// `POST /v1/fine_tuning/jobs`.
pub const JOB: &[&str] = &["model", "training_file", "validation_file", "hyperparameters", "suffix", "seed", "method", "fsdp_app"];

/// `fsdp_app` of a job (our extension).
pub const JOB_EXTENSION: &[&str] = &["world_size", "seq_len", "max_steps", "max_completion_length", "lora", "merge"];

/// `fsdp_app.lora` of a job.
pub const JOB_LORA: &[&str] = &["r", "alpha", "dropout", "targets"];

/// Parameters of OpenAI's API this server knows and does not implement: refused as such, not as
/// unknown.
const NOT_IMPLEMENTED: &[&str] = &[
    "suffix",
    "store",
    "metadata",
    "service_tier",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    "verbosity",
    "integrations",
    "name",
    "refusal",
    // vLLM's structured outputs' (`validate::structured`): top-level, and in `structured_outputs`.
    "guided_whitespace_pattern",
    "whitespace_pattern",
    "structural_tag",
];

/// Checks the keys of the object `v` (named `at` in messages: "" for the body, "messages[0]"
/// for a message) against `accepted`. Returns the keys to ignore (`lenient`), or the 400 for
/// the first one that is not accepted.
pub fn check(v: &Value, accepted: &[&str], at: &str, lenient: bool) -> Result<Vec<String>, ApiError> {
    check_lists(v, &[accepted], at, lenient)
}

/// [`check`] against the union of several lists.
pub fn check_lists(v: &Value, accepted: &[&[&str]], at: &str, lenient: bool) -> Result<Vec<String>, ApiError> {
    let Value::Object(map) = v else { return Ok(vec![]) };
    let mut ignored = vec![];
    for (k, val) in map {
        if val.is_null() || accepted.iter().any(|list| list.contains(&k.as_str())) {
            continue;
        }
        let param = if at.is_empty() { k.clone() } else { format!("{at}.{k}") };
        if lenient {
            ignored.push(param);
            continue;
        }
        let message = if NOT_IMPLEMENTED.contains(&k.as_str()) {
            format!(
                "`{param}` is not supported by this server (fsdp-app); remove it, or start the server with --lenient to have it ignored."
            )
        } else {
            format!("Unrecognized request argument supplied: {param}")
        };
        return Err(ApiError::invalid(&param, message).with_code("unsupported_parameter"));
    }
    Ok(ignored)
}

/// A JSON object's fields with typed, named accessors: every wrong type, range or non-finite
/// number is a 400 that names its parameter (a serde derive would answer with serde's messages
/// and miss the ranges).
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

    /// The value of `k`, `null` counting as absent.
    pub fn value(&self, k: &str) -> Option<&'a Value> {
        self.map.get(k).filter(|v| !v.is_null())
    }

    pub fn string(&self, k: &str) -> Result<Option<&'a str>, ApiError> {
        match self.value(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(ApiError::invalid(k, format!("`{k}` must be a string."))),
        }
    }

    pub fn bool(&self, k: &str) -> Result<Option<bool>, ApiError> {
        match self.value(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(ApiError::invalid(k, format!("`{k}` must be a boolean."))),
        }
    }

    /// A finite number in [lo, hi].
    pub fn number(&self, k: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
        match self.value(k) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                let x =
                    n.as_f64().filter(|x| x.is_finite()).ok_or_else(|| ApiError::invalid(k, format!("`{k}` must be a finite number.")))?;
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
        match self.value(k) {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unknown_and_unimplemented_fields_are_named_or_listed() {
        let body = json!({"model": "m", "prompt": "x", "foo_bar": 1});
        let e = check(&body, COMPLETIONS, "", false).unwrap_err();
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("foo_bar")));
        assert!(e.message.contains("Unrecognized request argument supplied: foo_bar"), "{}", e.message);
        let e = check(&json!({"model": "m", "audio": {"voice": "x"}}), CHAT, "", false).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("audio"));
        assert!(e.message.contains("not supported"), "{}", e.message);
        let e = check(&json!({"role": "assistant", "content": "x", "refusal": "no"}), MESSAGE, "messages[2]", false).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[2].refusal"));
        // null is absent; lenient lists instead of refusing.
        assert!(check(&json!({"model": "m", "audio": null}), CHAT, "", false).unwrap().is_empty());
        assert_eq!(check(&body, COMPLETIONS, "", true).unwrap(), vec!["foo_bar".to_string()]);
        assert!(check(&json!({"model": "m", "tools": []}), COMPLETIONS, "", false).is_err(), "completions take no tools");
    }
}
