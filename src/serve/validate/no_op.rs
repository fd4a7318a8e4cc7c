//! Fields clients send that change nothing a local server does, accepted so that agent libraries
//! work unchanged (LangChain, the OpenAI Agents SDK and the official client send several by
//! default), but checked: a value that would ask for something we do not do is still a 400
//! naming it.
//!
//! - `store`: `false` (nothing is kept); `true` asks OpenAI to keep the completion for its
//!   dashboard, which a local server has not: refused.
//! - `metadata` (an object of strings), `service_tier`, `safety_identifier` (strings):
//!   bookkeeping of OpenAI's platform. `prompt_cache_key` (a string) is checked here and used as
//!   the prefix cache's eviction hint (`generate::prefix_cache`).
//! - `modalities`: `["text"]` only (audio output is not implemented).
//! - `reasoning_effort` (`minimal`, `low`, `medium`, `high`): open reasoning models have no
//!   effort levels, only thinking on or off (`chat_template_kwargs`), so the answer is the same
//!   at every level (as vLLM treats it for such models).
//! - `user` is read with the sampling fields; a message's `name` goes to the chat template.

use serde_json::Value;

use crate::serve::error::ApiError;
use crate::serve::fields::Fields;

/// Checks the no-op fields of a chat (or responses) body.
pub fn check(v: &Value) -> Result<(), ApiError> {
    let f = Fields::of(v)?;
    if f.bool("store")? == Some(true) {
        return Err(ApiError::invalid(
            "store",
            "`store: true` is not supported by this server (fsdp-app keeps no completions or responses); send false or leave it out.",
        )
        .with_code("unsupported_parameter"));
    }
    for k in ["service_tier", "prompt_cache_key", "safety_identifier", "user"] {
        f.string(k)?;
    }
    match f.value("metadata") {
        None => {}
        Some(Value::Object(m)) if m.values().all(Value::is_string) => {}
        Some(_) => return Err(ApiError::invalid("metadata", "`metadata` must be an object of string values.")),
    }
    match f.value("modalities") {
        None => {}
        Some(Value::Array(m)) if m.iter().all(|x| x == "text") => {}
        Some(_) => {
            return Err(ApiError::invalid("modalities", "only `[\"text\"]` output is supported by this server (fsdp-app).")
                .with_code("unsupported_parameter"))
        }
    }
    match f.string("reasoning_effort")? {
        None | Some("minimal" | "low" | "medium" | "high") => Ok(()),
        Some(other) => {
            Err(ApiError::invalid("reasoning_effort", format!("`reasoning_effort` {other:?}: use minimal, low, medium or high.")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn no_op_fields_are_accepted_and_what_would_change_the_answer_is_named() {
        let ok = json!({"store": false, "metadata": {"run": "a"}, "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "u1",
                        "modalities": ["text"], "reasoning_effort": "low", "user": "me"});
        assert!(check(&ok).is_ok());
        for (body, param) in [
            (json!({"store": true}), "store"),
            (json!({"modalities": ["text", "audio"]}), "modalities"),
            (json!({"metadata": {"n": 1}}), "metadata"),
            (json!({"reasoning_effort": "extreme"}), "reasoning_effort"),
            (json!({"service_tier": 3}), "service_tier"),
        ] {
            assert_eq!(check(&body).unwrap_err().param.as_deref(), Some(param), "{body}");
        }
    }
}
