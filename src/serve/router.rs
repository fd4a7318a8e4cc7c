//! The route table, and the middleware every request passes: the API key (when one is set) and
//! the shutdown's 503, and the request counter of `/metrics`.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use super::error::{AnthropicError, ApiError};
use super::state::AppState;
use super::{embeddings, files, jobs, llama_cpp, ollama, routes, scores, web};

/// How far past --max-body-bytes a body is still read, to answer 413 cleanly (see `body`).
const READ_PAST_LIMIT: usize = 32 << 20;

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(routes::health))
        .route("/v1/health", get(routes::health))
        .route("/version", get(routes::version))
        .route("/", get(web::index))
        .route("/finetune", get(web::finetune))
        .route("/web/app.js", get(web::app_js))
        .route("/web/app.css", get(web::app_css))
        .route("/metrics", get(routes::metrics))
        .route("/info", get(routes::info))
        .route("/openapi.json", get(routes::openapi))
        .route("/tokenize", post(routes::tokenize))
        .route("/detokenize", post(routes::detokenize))
        .route("/tokenizer_info", get(routes::tokenizer_info))
        .route("/v1/models", get(routes::models))
        .route("/models", get(routes::models))
        .route("/v1/models/{id}", get(routes::model).delete(routes::delete_model))
        .route("/v1/completions", post(routes::completions))
        .route("/completion", post(llama_cpp::completion))
        .route("/completions", post(llama_cpp::completion))
        .route("/infill", post(llama_cpp::infill))
        .route("/props", get(llama_cpp::props))
        .route("/apply-template", post(llama_cpp::apply_template))
        .route("/v1/chat/completions", post(routes::chat_completions))
        .route("/chat/completions", post(routes::chat_completions))
        .route("/v1/responses", post(routes::responses))
        .route("/v1/messages", post(routes::messages))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/embedding", post(llama_cpp::embedding))
        .route("/embeddings", post(llama_cpp::embedding))
        .route("/v1/score", post(scores::score))
        .route("/score", post(scores::score))
        .route("/v1/rerank", post(scores::rerank))
        .route("/rerank", post(scores::rerank))
        .route("/v2/rerank", post(scores::rerank))
        .route("/reranking", post(scores::rerank))
        .route("/v1/reranking", post(scores::rerank))
        .route("/v1/messages/count_tokens", post(routes::count_tokens))
        .route("/api/chat", post(ollama::chat))
        .route("/api/generate", post(ollama::generate))
        .route("/api/embed", post(ollama::embed))
        .route("/api/embeddings", post(ollama::embeddings))
        .route("/api/tags", get(ollama::tags))
        .route("/api/ps", get(ollama::ps))
        .route("/api/show", post(ollama::show))
        .route("/api/version", get(ollama::version))
        .route("/v1/load_lora_adapter", post(routes::load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(routes::unload_lora_adapter))
        .route("/v1/files", post(files::upload).get(files::list).layer(DefaultBodyLimit::disable()))
        .route("/v1/files/{id}", get(files::get_one).delete(files::delete))
        .route("/v1/files/{id}/content", get(files::content))
        .route("/v1/fine_tuning/jobs", post(jobs::api::create).get(jobs::api::list))
        .route("/v1/fine_tuning/jobs/{id}", get(jobs::api::get_one))
        .route("/v1/fine_tuning/jobs/{id}/cancel", post(jobs::api::cancel))
        .route("/v1/fine_tuning/jobs/{id}/events", get(jobs::api::events))
        .route("/v1/fine_tuning/jobs/{id}/checkpoints", get(jobs::api::checkpoints))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(DefaultBodyLimit::max(state.max_body_bytes.saturating_add(READ_PAST_LIMIT)))
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth))
        .with_state(state)
}

/// Constant-time comparison, so response timing says nothing about the key.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() != b.len()) as u8;
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

/// The key a request carries: `Authorization: Bearer <key>` (OpenAI's clients), else
/// `x-api-key: <key>` (Anthropic's).
fn given_key(req: &Request) -> &str {
    let header = |name| req.headers().get(name).and_then(|v: &axum::http::HeaderValue| v.to_str().ok());
    header(axum::http::header::AUTHORIZATION.as_str()).and_then(|v| v.strip_prefix("Bearer ")).or_else(|| header("x-api-key")).unwrap_or("")
}

/// Routes without the key, as llama.cpp's and vLLM's: the health checks.
const HEALTH_PATHS: &[&str] = &["/health", "/v1/health"];

/// Every route but the health checks and the static pages needs the key when one is set (see
/// `given_key`). Anthropic's routes answer in Anthropic's error shape.
async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let anthropic = req.uri().path().starts_with("/v1/messages");
    let shaped = |e: ApiError| if anthropic { AnthropicError(e).into_response() } else { e.into_response() };
    // Draining: requests on connections still open get 503 (the listener is closed).
    if st.shutdown.begun() {
        let resp = shaped(ApiError::shutting_down());
        st.metrics.request(resp.status().as_u16());
        return resp;
    }
    if let Some(key) = &st.api_key {
        let path = req.uri().path();
        if !HEALTH_PATHS.contains(&path) && !web::PUBLIC_PATHS.contains(&path) && !same_secret(given_key(&req).as_bytes(), key.as_bytes()) {
            let resp = shaped(ApiError::unauthorized());
            st.metrics.request(resp.status().as_u16());
            return resp;
        }
    }
    let resp = next.run(req).await;
    st.metrics.request(resp.status().as_u16());
    resp
}
