//! The HTTP routes of the generation API, each only wiring: read the body (`body`), validate it
//! in one pass (`validate`), admit and submit it (`admission`), shape the answer (`response`).
//! Also `/health`, `/metrics`, `/info`, `/openapi.json`, `/tokenize`, `/detokenize`,
//! `/tokenizer_info` and the models list. Files and jobs have their own modules.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::body::json_body;
use super::error::{AnthropicError, ApiError};
use super::response;
use super::state::AppState;
use super::validate;

pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// vLLM's `GET /version`: this server's version.
pub async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

pub async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": st.model_objects()}))
}

pub async fn model(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    st.model_objects().into_iter().find(|m| m["id"] == json!(id)).map(Json).ok_or_else(|| ApiError::model_not_found(&id))
}

/// `DELETE /v1/models/{id}`: deletes a fine-tuned model (its files, and its engine once the
/// requests running on it end); the base model cannot be deleted (403, as OpenAI answers).
pub async fn delete_model(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    if id == st.base_id {
        let message = format!("`{id}` is the served base model; only fine-tuned models can be deleted.");
        return Err(ApiError::new(StatusCode::FORBIDDEN, "invalid_request_error", message).with_code("model_not_deletable"));
    }
    let internal = |e: anyhow::Error| ApiError::internal(format!("{e:#}"));
    let dir = st.store.delete_fine_tuned_model(&id).map_err(internal)?.ok_or_else(|| ApiError::model_not_found(&id))?;
    // The model and its checkpoints (`{id}:ckpt-step-N`), which live in the same directory.
    st.unload_fine_tuned(&id);
    let removed = std::fs::remove_dir_all(&dir).or_else(|e| if e.kind() == std::io::ErrorKind::NotFound { Ok(()) } else { Err(e) });
    removed.map_err(|e| ApiError::internal(format!("deleting {}: {e}", dir.display())))?;
    Ok(Json(json!({"id": id, "object": "model", "deleted": true})))
}

/// `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` (vLLM's): serves the PEFT adapter at
/// `lora_path` (under `--lora-dir`) as model `lora_name` over the base.
pub async fn load_lora_adapter(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Json<Value>, ApiError> {
    let v = json_body(body, st.max_body_bytes)?;
    super::fields::check(&v, &["lora_name", "lora_path"], "", false)?;
    let f = super::fields::Fields::of(&v)?;
    let name = f.string("lora_name")?.ok_or_else(|| ApiError::invalid("lora_name", "`lora_name` is required."))?;
    let path = f.string("lora_path")?.ok_or_else(|| ApiError::invalid("lora_path", "`lora_path` is required."))?;
    // The path policy first: with run-time loading off every load is a 403, whatever its name.
    let dir = st.adapters.allowed_path(path)?;
    let taken = |e: anyhow::Error| ApiError::invalid("lora_name", format!("{e:#}"));
    super::adapters::check_adapter_name(name, &st.base_id).map_err(taken)?;
    if st.is_model_id(name)? {
        return Err(ApiError::invalid("lora_name", format!("`{name}` is already a served model's id.")));
    }
    // Reading and checking the tensors takes a moment: off the async workers.
    let registered = tokio::task::block_in_place(|| st.adapters.register(name, &dir));
    registered.map_err(|e| ApiError::invalid("lora_path", format!("{e:#}")))?;
    Ok(Json(json!({"object": "lora_adapter", "id": name, "parent": st.base_id, "root": dir, "loaded": true})))
}

/// `POST /v1/unload_lora_adapter {"lora_name"}` (vLLM's): stops serving the adapter (requests
/// running with it finish); 404 when there is none of that name.
pub async fn unload_lora_adapter(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Json<Value>, ApiError> {
    let v = json_body(body, st.max_body_bytes)?;
    super::fields::check(&v, &["lora_name", "lora_int_id"], "", false)?;
    let name =
        super::fields::Fields::of(&v)?.string("lora_name")?.ok_or_else(|| ApiError::invalid("lora_name", "`lora_name` is required."))?;
    if name.starts_with("ft:") {
        let message = format!("`{name}` is a fine-tuning job's model; delete it with DELETE /v1/models/{name}.");
        return Err(ApiError::invalid("lora_name", message));
    }
    match st.adapters.unregister(name) {
        true => Ok(Json(json!({"object": "lora_adapter", "id": name, "deleted": true}))),
        false => Err(ApiError::model_not_found(name)),
    }
}

pub async fn info(State(st): State<Arc<AppState>>) -> Json<Value> {
    let m = st.base();
    Json(json!({
        "model": m.id,
        "max_model_len": m.max_total_tokens,
        "max_input_tokens": m.max_input_tokens,
        "max_total_tokens": m.max_total_tokens,
        "max_concurrent_requests": st.max_concurrent,
        "max_queue": st.max_queue,
        "max_body_bytes": st.max_body_bytes,
        "max_n": validate::MAX_N,
        "max_stop": validate::MAX_STOP,
        "sampling_defaults": {
            "temperature": m.defaults.temperature, "top_p": m.defaults.top_p, "top_k": m.defaults.top_k,
            "repetition_penalty": m.defaults.repetition_penalty, "max_tokens_completions": validate::DEFAULT_COMPLETION_MAX_TOKENS,
            "max_tokens_chat": "the rest of the context",
        },
        "chat_template": m.tokenizer.chat_template.is_some(),
        "data_dir_jobs": true,
    }))
}

pub async fn metrics(State(st): State<Arc<AppState>>) -> impl IntoResponse {
    let text = st.metrics.render(st.queued(), st.running());
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}

pub async fn openapi() -> impl IntoResponse {
    ([(axum::http::header::CONTENT_TYPE, "application/json")], super::openapi::SPEC)
}

/// vLLM's `/tokenize`, or llama.cpp's when the body has its `content` field.
pub async fn tokenize(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Json<Value>, ApiError> {
    let v = json_body(body, st.max_body_bytes)?;
    if v.get("content").is_some() {
        return super::llama_cpp::tokenize(&st, &v).map(Json);
    }
    let (m, ids) = validate::tokenize(&st, &v)?;
    Ok(Json(json!({"count": ids.len(), "max_model_len": m.max_total_tokens, "tokens": ids})))
}

/// vLLM's `GET /tokenizer_info`: the base model's tokenizer settings, from which
/// lm-evaluation-harness tokenizes through `/tokenize` without a copy of the tokenizer.
pub async fn tokenizer_info(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(st.base().tokenizer.info())
}

pub async fn detokenize(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Json<Value>, ApiError> {
    let (m, ids) = validate::detokenize(&st, &json_body(body, st.max_body_bytes)?)?;
    let text = m.tokenizer.decode(&ids, false).map_err(|e| ApiError::bad_request(format!("{e:#}")))?;
    // vLLM's name of the text, and llama.cpp's.
    Ok(Json(json!({"prompt": text, "content": text})))
}

pub async fn completions(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let reqs = validate::completions(&st, &json_body(body, st.max_body_bytes)?)?;
    response::generate_all(st, reqs).await
}

pub async fn chat_completions(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req = validate::chat(&st, &json_body(body, st.max_body_bytes)?)?;
    response::generate(st, req).await
}

pub async fn responses(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req = validate::responses(&st, &json_body(body, st.max_body_bytes)?)?;
    response::generate(st, req).await
}

/// `POST /v1/messages` (Anthropic's Messages API); errors in Anthropic's shape.
pub async fn messages(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, AnthropicError> {
    let req = json_body(body, st.max_body_bytes).and_then(|v| validate::messages(&st, &v)).map_err(AnthropicError)?;
    response::generate(st, req).await.map_err(AnthropicError)
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens"}` of the prompt `/v1/messages` would run.
pub async fn count_tokens(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Json<Value>, AnthropicError> {
    let n = json_body(body, st.max_body_bytes).and_then(|v| validate::count_tokens(&st, &v)).map_err(AnthropicError)?;
    Ok(Json(json!({"input_tokens": n})))
}

pub async fn not_found() -> ApiError {
    ApiError::not_found("No such route.")
}

pub async fn method_not_allowed() -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "Method not allowed on this route.")
}
