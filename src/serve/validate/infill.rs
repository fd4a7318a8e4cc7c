//! Requests that fill in the middle (`tokenize::fim`): OpenAI's and Ollama's `suffix` on a
//! completion (the prompt is the text before the gap), and llama.cpp's `/infill` (`input_prefix`,
//! `input_suffix`, `input_extra` files of context and `prompt`, the start of the answer).

use axum::http::StatusCode;
use serde_json::Value;

use super::Prompt;
use crate::serve::error::ApiError;
use crate::serve::fields::Fields;
use crate::serve::served_model::ServedModel;
use crate::tokenize::fim::{self, ContextFile, FimTokens, Parts, Window};

/// `/infill`'s fields besides `/completion`'s.
pub const INFILL_FIELDS: &[&str] = &["input_prefix", "input_suffix", "input_extra"];

/// A FIM prompt and the tokens that end its answer besides the model's end-of-sequence ones
/// (`FimTokens::ends`: the request's stop tokens).
pub struct FimPrompt {
    pub ids: Vec<u32>,
    pub ends: Vec<u32>,
}

/// The FIM prompt of a completion with `suffix` (OpenAI's, llama-cpp-python's order: the
/// tokenizer's start, `<prefix>` prompt `<suffix>` suffix `<middle>`). `param` names the field
/// in the refusal of a model without FIM tokens.
pub fn around(model: &ServedModel, prefix: Prompt, suffix: &str, param: &str) -> Result<FimPrompt, ApiError> {
    let fim = model.fim.as_ref().map_err(|missing| {
        let message =
            format!("`{param}` needs a model trained to fill in the middle; `{}` is not one (its vocabulary: {missing})", model.id);
        ApiError::invalid(param, message).with_code("unsupported_parameter")
    })?;
    let prefix = match prefix {
        Prompt::Text(t) => text(model, &t, "prompt")?,
        Prompt::Tokens(ids) => ids,
    };
    let parts = Parts { start: start(model)?, prefix, suffix: text(model, suffix, param)?, ..Parts::default() };
    Ok(FimPrompt { ids: fim::prompt(fim, parts, None), ends: fim.ends() })
}

/// `/infill`'s prompt, cut as llama.cpp's server cuts it (`fim::Window`).
pub fn llama_cpp(model: &ServedModel, f: &Fields) -> Result<FimPrompt, ApiError> {
    let fim = tokens(model)?;
    let required = |k: &str| f.string(k)?.ok_or_else(|| ApiError::invalid(k, format!("`{k}` is required.")));
    let (prefix, suffix) = (required("input_prefix")?, required("input_suffix")?);
    let prompt = f.string("prompt")?.unwrap_or("");
    let files = context_files(f.value("input_extra"))?;
    let context = fim::context(&model.tokenizer, fim, &files).map_err(|e| ApiError::invalid("input_extra", format!("{e:#}")))?;
    let parts = Parts {
        start: start(model)?,
        prefix: text(model, prefix, "input_prefix")?,
        suffix: text(model, suffix, "input_suffix")?,
        prompt: text(model, prompt, "prompt")?,
        context,
    };
    let window = Window { window: fim::INFILL_WINDOW, context_len: model.max_total_tokens };
    Ok(FimPrompt { ids: fim::prompt(fim, parts, Some(window)), ends: fim.ends() })
}

/// The FIM tokens, or llama.cpp's refusal of `/infill` for a model without them, in its words
/// and error type, as a 400 (llama.cpp answers 501: the request, not the server, is what
/// cannot be served).
fn tokens(model: &ServedModel) -> Result<&FimTokens, ApiError> {
    model.fim.as_ref().map_err(|missing| {
        ApiError::new(StatusCode::BAD_REQUEST, "not_supported_error", format!("Infill is not supported by this model: {missing}"))
    })
}

/// `input_extra`: a list of `{"filename", "text"}` (filename optional), each a file of context.
fn context_files(v: Option<&Value>) -> Result<Vec<ContextFile>, ApiError> {
    const P: &str = "input_extra";
    let Some(v) = v else { return Ok(vec![]) };
    let Some(items) = v.as_array() else {
        return Err(ApiError::invalid(P, "`input_extra` must be a list of {\"filename\": string, \"text\": string}."));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let at = format!("{P}[{i}]");
            let Value::Object(o) = item else { return Err(ApiError::invalid(&at, format!("`{at}` must be an object."))) };
            // llama.vim stamps each chunk with the `time` it was picked; it does not change the prompt.
            if let Some(k) = o.keys().find(|k| !["filename", "text", "time"].contains(&k.as_str())) {
                return Err(ApiError::invalid(&format!("{at}.{k}"), format!("`{at}` takes `filename`, `text` and `time` only.")));
            }
            if o.get("time").is_some_and(|t| !t.is_number() && !t.is_null()) {
                return Err(ApiError::invalid(&format!("{at}.time"), "`time` must be a number."));
            }
            let text = match o.get("text") {
                Some(Value::String(t)) => t.clone(),
                _ => return Err(ApiError::invalid(&format!("{at}.text"), "`text` is required: a string.")),
            };
            let name = match o.get("filename") {
                None | Some(Value::Null) => fim::DEFAULT_FILE_NAME.to_string(),
                Some(Value::String(n)) => n.clone(),
                Some(_) => return Err(ApiError::invalid(&format!("{at}.filename"), "`filename` must be a string.")),
            };
            Ok(ContextFile { name, text })
        })
        .collect()
}

/// A part's text as tokens, without the tokenizer's start (it comes once, before the prefix).
fn text(model: &ServedModel, s: &str, param: &str) -> Result<Vec<u32>, ApiError> {
    model.tokenizer.encode(s, false).map_err(|e| ApiError::invalid(param, format!("{e:#}")))
}

/// What the tokenizer puts before a text (a BOS token, or nothing), as llama.cpp adds it when
/// the vocabulary says to.
fn start(model: &ServedModel) -> Result<Vec<u32>, ApiError> {
    model.tokenizer.encode("", true).map_err(|e| ApiError::internal(format!("{e:#}")))
}
