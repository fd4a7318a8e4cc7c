//! llama.cpp's server's own routes, for the scripts and front ends written against
//! `llama-server`: `POST /completion` (and `/completions`), `POST /infill` (code editors'
//! fill-in-the-middle completion: llama.vim, llama.vscode), `GET /props`, `POST /apply-template`,
//! `POST /embedding` (and `/embeddings`), and `/tokenize` with its `content` field
//! (`routes::tokenize` hands such bodies here). The request reading is `validate::llama_cpp`, the
//! answer's shape `response::llama_cpp`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::body::json_body;
use super::error::ApiError;
use super::fields::{self, Fields};
use super::served_model::ServedModel;
use super::state::AppState;
use super::validate;
use super::validate::llama_cpp as read;
use super::{admission, embeddings, response};

/// The fields of llama.cpp's `/tokenize`.
pub const TOKENIZE: &[&str] = &["content", "add_special", "parse_special", "with_pieces", "model"];

/// The fields of `/embedding` and `/embeddings`.
pub const EMBEDDING: &[&str] = &["content", "input", "embd_normalize", "encoding_format", "model"];

/// The fields of `/apply-template`.
pub const APPLY_TEMPLATE: &[&str] = &["model", "messages", "tools", "chat_template_kwargs"];

/// `POST /completion`: one answer, or for a list of prompts a list of answers (each with its
/// prompt's `index`; streamed, their events interleaved), as llama.cpp's server answers.
pub async fn completion(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let reqs = read::completions(&st, &json_body(body, st.max_body_bytes)?)?;
    response::generate_all(st, reqs).await
}

/// `POST /infill`: `/completion`'s answer to the text that fills the gap between
/// `input_prefix` and `input_suffix` (`validate::infill`); a 400 for a model without FIM tokens.
pub async fn infill(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req = read::infill(&st, &json_body(body, st.max_body_bytes)?)?;
    response::generate_all(st, vec![req]).await
}

/// `POST /embedding` (and `/embeddings`): llama.cpp's own shape, `[{"index", "embedding"}]` with
/// each text's embedding a list of vectors (one here: the pooled state; llama.cpp's per-token
/// lists need `--pooling none`, which this server does not have), scaled as `embd_normalize`
/// says (default 2, unit length).
pub async fn embedding(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let v = json_body(body, st.max_body_bytes)?;
    let ignored = fields::check(&v, EMBEDDING, "", st.lenient)?;
    let f = Fields::of(&v)?;
    let model = embeddings::embedding_model(&st, f.string("model")?.unwrap_or(&st.base_id))?;
    let scale = f.integer("embd_normalize", -1, i32::MAX as i64)?.unwrap_or(2);
    if let Some(format) = f.string("encoding_format")?.filter(|&e| e != "float") {
        let message = format!("`encoding_format` {format:?}: llama.cpp's `/embedding` answers floats; base64 is `/v1/embeddings`'.");
        return Err(ApiError::invalid("encoding_format", message));
    }
    // llama.cpp reads `input` first.
    let (param, content) = match (f.value("input"), f.value("content")) {
        (Some(input), _) => ("input", input),
        (None, Some(content)) => ("content", content),
        (None, None) => return Err(ApiError::invalid("content", "`content` (or `input`) is required.")),
    };
    let texts = embedding_texts(&model, content, param)?;
    let _admission = admission::admit(&st, 1)?;
    let answer: Vec<Value> = embeddings::pooled_all(&st, &model, &texts)
        .await?
        .into_iter()
        .enumerate()
        .map(|(index, mut vector)| {
            crate::embed::normalize_by(&mut vector, scale);
            json!({"index": index, "embedding": [vector]})
        })
        .collect();
    Ok(response::with_ignored(Json(answer).into_response(), &ignored))
}

/// The texts of `/embedding`'s `content` (or `input`, named by `param`): what `/v1/embeddings`
/// takes (a string, a list of them, a list of ids or of lists of ids), and llama.cpp's mixed lists
/// of ids and strings, each one text.
fn embedding_texts(model: &ServedModel, v: &Value, param: &str) -> Result<Vec<Vec<u32>>, ApiError> {
    let mixed = |x: &Value| x.as_array().is_some_and(|a| a.iter().any(Value::is_string) && a.iter().any(Value::is_number));
    let as_ids = |x: &Value, at: &str| read::mixed_ids(model, x.as_array().expect("a mixed list"), at).map(|ids| json!(ids));
    let resolved = match v {
        x if mixed(x) => as_ids(x, param)?,
        Value::Array(items) => Value::Array(
            items
                .iter()
                .enumerate()
                .map(|(i, x)| if mixed(x) { as_ids(x, &format!("{param}[{i}]")) } else { Ok(x.clone()) })
                .collect::<Result<_, _>>()?,
        ),
        x => x.clone(),
    };
    embeddings::inputs(model, Some(&resolved), param)
}

/// `GET /props`: the settings `/completion` runs with when a request gives none, the context,
/// the slots (sequences generated at once) and the chat template.
pub async fn props(State(st): State<Arc<AppState>>) -> Json<Value> {
    let m = st.base();
    let template = m.tokenizer.chat_template.as_ref().map_or("", |t| t.source.as_str());
    let params = json!({
        "n_predict": -1, "seed": u32::MAX, "temperature": read::DEFAULT_TEMPERATURE, "top_k": read::DEFAULT_TOP_K,
        "top_p": read::DEFAULT_TOP_P, "min_p": read::DEFAULT_MIN_P, "typical_p": 1.0, "repeat_last_n": read::DEFAULT_REPEAT_LAST_N,
        "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
        "mirostat": 0, "stop": [], "max_tokens": -1, "n_keep": 0, "ignore_eos": false, "stream": false, "n_probs": 0, "min_keep": 0,
        "grammar": "", "samplers": read::default_samplers(),
    });
    Json(json!({
        "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": m.max_total_tokens, "speculative": false, "is_processing": false, "params": params},
        "total_slots": st.max_concurrent,
        "model_path": m.id,
        "chat_template": template,
        "modalities": {"vision": false, "audio": false},
        "build_info": format!("fsdp-app {}", env!("CARGO_PKG_VERSION")),
        "is_sleeping": false,
    }))
}

/// `POST /apply-template`: `{"prompt"}`, the conversation as the chat template renders it with
/// the assistant's turn opened (what `/completion` would then continue).
pub async fn apply_template(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Json<Value>, ApiError> {
    let v = json_body(body, st.max_body_bytes)?;
    fields::check(&v, APPLY_TEMPLATE, "", false)?;
    if v.get("messages").is_none() {
        return Err(ApiError::invalid("messages", "`messages` is required."));
    }
    let (m, ids) = validate::tokenize(&st, &v)?;
    Ok(Json(json!({"prompt": m.tokenizer.decode(&ids, false).unwrap_or_default()})))
}

/// llama.cpp's `/tokenize`: `{"tokens": [ids]}`, or `[{"id", "piece"}]` `with_pieces` (a piece
/// that is not whole UTF-8 as its bytes). `add_special` defaults to false, as there.
pub fn tokenize(st: &AppState, v: &Value) -> Result<Value, ApiError> {
    fields::check(v, TOKENIZE, "", false)?;
    let f = Fields::of(v)?;
    let content = f.string("content")?.ok_or_else(|| ApiError::invalid("content", "`content` is required."))?;
    if f.bool("parse_special")? == Some(false) {
        return Err(ApiError::invalid(
            "parse_special",
            "`parse_special: false` is not supported: special tokens' texts are always read as the tokens.",
        ));
    }
    let model = match f.string("model")? {
        Some(id) => st.target(id)?.0,
        None => st.base(),
    };
    let ids = model
        .tokenizer
        .encode(content, f.bool("add_special")?.unwrap_or(false))
        .map_err(|e| ApiError::invalid("content", format!("{e:#}")))?;
    if !f.bool("with_pieces")?.unwrap_or(false) {
        return Ok(json!({"tokens": ids}));
    }
    let pieces: Vec<Value> = ids
        .iter()
        .map(|&id| {
            let bytes = match &model.grammars {
                Ok(g) => g.token_bytes(id),
                Err(_) => model.tokenizer.decode(&[id], false).unwrap_or_default().into_bytes(),
            };
            let piece = String::from_utf8(bytes.clone()).map_or_else(|_| json!(bytes), |s| json!(s));
            json!({"id": id, "piece": piece})
        })
        .collect();
    Ok(json!({"tokens": pieces}))
}
