//! Ollama's API, for the programs written against `ollama serve` (the `ollama` Python and
//! JavaScript clients, LangChain's `ChatOllama`, Open WebUI, Continue): `POST /api/chat` and
//! `POST /api/generate` (newline-delimited JSON unless `stream: false`), `POST /api/embed` and
//! the older `POST /api/embeddings`, `GET /api/tags` and `GET /api/ps` (the served models),
//! `POST /api/show` (a model's details, template and capabilities) and `GET /api/version`.
//! The request reading is `validate::ollama`, the answer's shape `response::ollama`; errors are
//! Ollama's `{"error": "..."}` with the status.
//!
//! Ollama names models with a tag; `name:latest` is the served `name`. Managing models
//! (`pull`, `create`, `copy`, `delete`, `push`) is not served: this server serves the models it
//! was started with and the ones it fine-tunes.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::body::json_body;
use super::clock;
use super::error::ApiError;
use super::fields::{self, Fields};
use super::served_model::ServedModel;
use super::state::AppState;
use super::validate;
use super::validate::ollama::{embedding_options, model_name, served_name, Api};
use super::{admission, embeddings, response};

/// The version of Ollama's API these routes follow (`think`, streamed calls, `/api/embed`), which
/// `/api/version` answers: clients check it before using newer fields.
const API_VERSION: &str = "0.12.0";

/// An error in Ollama's shape: `{"error": "message"}`, the parameter named in the message.
pub struct OllamaError(pub ApiError);

impl From<ApiError> for OllamaError {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

impl IntoResponse for OllamaError {
    fn into_response(self) -> Response {
        let e = self.0;
        let mut resp = (e.status, Json(json!({"error": e.message_naming_param()}))).into_response();
        if let Some(s) = e.retry_after {
            resp.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from(s));
        }
        resp
    }
}

/// `POST /api/chat`.
pub async fn chat(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, OllamaError> {
    generating(st, body, Api::Chat).await
}

/// `POST /api/generate`.
pub async fn generate(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, OllamaError> {
    generating(st, body, Api::Generate).await
}

async fn generating(st: Arc<AppState>, body: Result<Bytes, BytesRejection>, api: Api) -> Result<Response, OllamaError> {
    let v = json_body(body, st.max_body_bytes)?;
    // Nothing to answer (no prompt, no messages): Ollama's way of loading a model. It is loaded.
    // A `suffix` alone is a gap to fill at the start of a file (Ollama answers it as a load).
    let blank = |k: &str| v.get(k).is_none_or(|p| p.as_str() == Some(""));
    let empty = match api {
        Api::Chat => v.get("messages").and_then(Value::as_array).is_some_and(Vec::is_empty),
        Api::Generate => blank("prompt") && blank("suffix"),
    };
    if empty {
        let model = model_name(&Fields::of(&v)?)?;
        st.target(served_name(model))?;
        let mut o = json!({"model": model, "created_at": clock::rfc3339(SystemTime::now()), "done": true, "done_reason": "load"});
        match api {
            Api::Chat => o["message"] = json!({"role": "assistant", "content": ""}),
            Api::Generate => o["response"] = json!(""),
        }
        return Ok(Json(o).into_response());
    }
    let req = validate::ollama(&st, &v, api)?;
    req.model.check_generates()?;
    Ok(response::generate(st, req).await?)
}

/// `POST /api/embed`: `input` a string or a list of them, each embedded at unit length;
/// `truncate` (default true) cuts a text longer than the context, else it is refused;
/// `dimensions` as `/v1/embeddings`' (Matryoshka models).
pub async fn embed(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, OllamaError> {
    let start = std::time::Instant::now();
    let v = json_body(body, st.max_body_bytes)?;
    let mut ignored = fields::check(&v, &["model", "input", "truncate", "dimensions", "options", "keep_alive"], "", st.lenient)?;
    let f = Fields::of(&v)?;
    ignored.extend(embedding_options(f.value("options"))?);
    let name = model_name(&f)?;
    let model = embeddings::embedding_model(&st, served_name(name))?;
    let truncate = f.bool("truncate")?.unwrap_or(true);
    let dimensions = f.integer("dimensions", 1, 1 << 20)?.map(|d| d as usize);
    if let Some(d) = dimensions {
        embeddings::check_dimensions(&model, d)?;
    }
    let inputs = embeddings::inputs_within(&model, f.value("input"), "input", truncate)?;
    let _admission = admission::admit(&st, 1)?;
    let mut vectors = embeddings::pooled_all(&st, &model, &inputs).await?;
    for v in &mut vectors {
        // As `/v1/embeddings`: a Matryoshka model's vector cut first, then scaled to unit length.
        if let Some(d) = dimensions {
            v.truncate(d);
        }
        crate::embed::normalize(v);
    }
    let tokens: usize = inputs.iter().map(Vec::len).sum();
    let body = json!({"model": name, "embeddings": vectors, "total_duration": start.elapsed().as_nanos() as u64, "load_duration": 0,
                      "prompt_eval_count": tokens});
    Ok(response::with_ignored(Json(body).into_response(), &ignored))
}

/// `POST /api/embeddings` (Ollama's first embedding route): one `prompt`, `{"embedding"}`
/// not scaled, as Ollama answers there.
pub async fn embeddings(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, OllamaError> {
    let v = json_body(body, st.max_body_bytes)?;
    let mut ignored = fields::check(&v, &["model", "prompt", "options", "keep_alive"], "", st.lenient)?;
    let f = Fields::of(&v)?;
    ignored.extend(embedding_options(f.value("options"))?);
    let name = model_name(&f)?;
    let model = embeddings::embedding_model(&st, served_name(name))?;
    let prompt = f.string("prompt")?.ok_or_else(|| ApiError::invalid("prompt", "`prompt` must be a string."))?;
    let inputs = embeddings::inputs(&model, Some(&json!(prompt)), "prompt")?;
    let _admission = admission::admit(&st, 1)?;
    let vector = embeddings::pooled_all(&st, &model, &inputs).await?.remove(0);
    Ok(response::with_ignored(Json(json!({"embedding": vector})).into_response(), &ignored))
}

/// `GET /api/tags`: every model this server answers to, Ollama's way.
pub async fn tags(State(st): State<Arc<AppState>>) -> Json<Value> {
    let base = st.base();
    let models: Vec<Value> = st.model_objects().iter().map(|m| listed(&base, m)).collect();
    Json(json!({"models": models}))
}

/// `GET /api/ps`: the models loaded now (all of them, for as long as the server runs).
pub async fn ps(State(st): State<Arc<AppState>>) -> Json<Value> {
    let base = st.base();
    let forever = clock::rfc3339(UNIX_EPOCH + Duration::from_secs(253_402_300_799));
    let models: Vec<Value> = st
        .model_objects()
        .iter()
        .map(|m| {
            let mut o = listed(&base, m);
            o["expires_at"] = json!(forever);
            o["size_vram"] = json!(0);
            o["context_length"] = json!(base.max_total_tokens);
            o
        })
        .collect();
    Json(json!({"models": models}))
}

/// An entry of `/api/tags` for the model object `m` of `/v1/models` (a fine-tuned model or an
/// adapter shares the base's architecture).
fn listed(base: &ServedModel, m: &Value) -> Value {
    let id = m["id"].as_str().unwrap_or_default();
    let created = UNIX_EPOCH + Duration::from_secs(m["created"].as_u64().unwrap_or(base.created));
    let mut d = details(base);
    if id != base.id {
        d["parent_model"] = json!(base.id);
    }
    json!({"name": id, "model": id, "modified_at": clock::rfc3339(created), "details": d})
}

/// `details`: the architecture's family, the parameters' count, the stored precision.
fn details(m: &ServedModel) -> Value {
    let c = &m.config;
    let family = format!("{:?}", c.architecture).to_lowercase();
    let mut d = json!({"parent_model": "", "family": family, "families": [family], "parameter_size": parameter_size(parameters(m))});
    // GGML's names for the stored precision, as Ollama lists it.
    if let Some(dtype) = &c.stored_dtype {
        let level = match dtype.as_str() {
            "float32" => "F32",
            "float16" => "F16",
            "bfloat16" => "BF16",
            other => other,
        };
        d["quantization_level"] = json!(level.to_uppercase());
    }
    d
}

/// The model's weights, counted from its configuration (biases and norms included).
fn parameters(m: &ServedModel) -> usize {
    let c = &m.config;
    let (q, kv) = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim);
    let attention = c.hidden_size * (q + 2 * kv) + q * c.hidden_size;
    let biases = if c.qkv_bias { q + 2 * kv } else { 0 } + if c.o_bias { c.hidden_size } else { 0 };
    let mlp = 3 * c.hidden_size * c.intermediate_size + if c.mlp_bias { 2 * c.intermediate_size + c.hidden_size } else { 0 };
    let norms = 2 * c.hidden_size + if c.qk_norm { 2 * c.head_dim } else { 0 };
    let embeddings = c.vocab_size * c.hidden_size * if c.tie_word_embeddings || c.headless { 1 } else { 2 };
    c.num_hidden_layers * (attention + biases + mlp + norms) + embeddings + c.hidden_size
}

/// Ollama's `parameter_size`: `135M`, `1.1B`.
fn parameter_size(n: usize) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.1}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.0}M", n as f64 / 1e6),
        n => format!("{:.0}K", n as f64 / 1e3),
    }
}

/// `POST /api/show {"model"}`: the model's details, its chat template, its architecture's
/// sizes (`model_info`, GGUF's key names) and what it can do (`capabilities`).
pub async fn show(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Json<Value>, OllamaError> {
    let v = json_body(body, st.max_body_bytes)?;
    fields::check(&v, &["model", "name", "verbose"], "", false)?;
    let name = match (v.get("model"), v.get("name")) {
        (Some(Value::String(m)), _) | (None, Some(Value::String(m))) if !m.is_empty() => m.as_str(),
        _ => return Err(ApiError::invalid("model", "`model` is required.").into()),
    };
    let m = st.target(served_name(name))?.0;
    let object = st.model_objects().into_iter().find(|o| o["id"] == json!(served_name(name)));
    let listed = listed(&st.base(), &object.unwrap_or_else(|| m.object()));
    let c = &m.config;
    let family = listed["details"]["family"].as_str().unwrap_or_default().to_string();
    let template = m.tokenizer.chat_template.as_ref().map_or("", |t| t.source.as_str());
    let mut capabilities = vec![];
    if m.generates {
        // Functions are offered to every model: in its template's own way, else in a prompt of
        // this server's (`tools`).
        capabilities.extend(["completion", "tools"]);
        if m.splits_reasoning {
            capabilities.push("thinking");
        }
        // `suffix`: its vocabulary has the tokens to fill in the middle.
        if m.fim.is_ok() {
            capabilities.push("insert");
        }
    } else {
        capabilities.push("embedding");
    }
    let info = json!({
        "general.architecture": family, "general.parameter_count": parameters(&m),
        format!("{family}.context_length"): m.max_total_tokens, format!("{family}.embedding_length"): c.hidden_size,
        format!("{family}.block_count"): c.num_hidden_layers, format!("{family}.feed_forward_length"): c.intermediate_size,
        format!("{family}.attention.head_count"): c.num_attention_heads, format!("{family}.attention.head_count_kv"): c.num_key_value_heads,
        format!("{family}.vocab_size"): c.vocab_size,
    });
    Ok(Json(json!({"modelfile": "", "parameters": "", "template": template, "details": listed["details"], "model_info": info,
                   "capabilities": capabilities, "modified_at": listed["modified_at"]})))
}

/// `GET /api/version`.
pub async fn version() -> Json<Value> {
    Json(json!({"version": API_VERSION}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_sizes_read_as_ollama_writes_them() {
        assert_eq!(parameter_size(134_515_008), "135M");
        assert_eq!(parameter_size(1_100_048_384), "1.1B");
        assert_eq!(parameter_size(28_000), "28K");
    }
}
