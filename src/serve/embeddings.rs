//! `POST /v1/embeddings`, as OpenAI's: `input` a string, a list of strings, a list of token ids
//! or a list of lists of token ids (each one text, embedded on its own); `encoding_format`
//! `float` or `base64` (the vector's little-endian f32 bytes, which the `openai` client decodes);
//! `dimensions` only for a Matryoshka model (config.json says which sizes), the vector cut to
//! that size and normalised again, as vLLM does; `user` accepted. The texts go through the
//! model's engine, between its decode steps (`engine::EmbedJob`); the request takes one queue
//! place. A text longer than the model's context is refused with both numbers.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use serde_json::{json, Value};

use super::body::json_body;
use super::engine::EmbedJob;
use super::error::ApiError;
use super::fields::{self, Fields};
use super::response::with_ignored;
use super::served_model::ServedModel;
use super::state::AppState;
use super::validate::{self, Prompt};

/// OpenAI's limit on `input`'s length.
const MAX_INPUTS: usize = 2048;

/// `/v1/embeddings`' fields.
pub const FIELDS: &[&str] = &["model", "input", "encoding_format", "dimensions", "user"];

/// A checked request: the model, each text's ids, the answer's shape, the fields `--lenient`
/// ignored.
struct EmbeddingRequest {
    model: Arc<ServedModel>,
    model_id: String,
    inputs: Vec<Vec<u32>>,
    base64: bool,
    dimensions: Option<usize>,
    ignored: Vec<String>,
}

pub async fn embeddings(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req = read(&st, &json_body(body, st.max_body_bytes)?)?;
    let _admission = super::admission::admit(&st, 1)?;
    let mut data = vec![];
    for (index, mut vector) in pooled_all(&st, &req.model, &req.inputs).await?.into_iter().enumerate() {
        // A Matryoshka model's vector is cut first, then scaled to unit length.
        if let Some(d) = req.dimensions {
            vector.truncate(d);
        }
        crate::embed::normalize(&mut vector);
        let embedding = match req.base64 {
            true => {
                json!(base64::engine::general_purpose::STANDARD.encode(vector.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()))
            }
            false => json!(vector),
        };
        data.push(json!({"object": "embedding", "index": index, "embedding": embedding}));
    }
    let tokens: usize = req.inputs.iter().map(Vec::len).sum();
    let body = json!({"object": "list", "data": data, "model": req.model_id, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}});
    Ok(with_ignored(Json(body).into_response(), &req.ignored))
}

/// Each text's embedding at unit length, in order (the caller holds a queue place).
pub(super) async fn embed_all(st: &AppState, model: &ServedModel, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, ApiError> {
    let mut vectors = pooled_all(st, model, inputs).await?;
    vectors.iter_mut().for_each(|v| crate::embed::normalize(v));
    Ok(vectors)
}

/// Each text's pooled vector, not scaled, in order, from the model's engine (the caller holds a
/// queue place).
pub(super) async fn pooled_all(st: &AppState, model: &ServedModel, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, ApiError> {
    let mut replies = vec![];
    for ids in inputs {
        let (reply, rx) = tokio::sync::oneshot::channel();
        model.engine.submit_embed(EmbedJob { ids: ids.clone(), pooling: model.pooling, reply }).map_err(ApiError::internal)?;
        replies.push(rx);
    }
    let mut vectors = vec![];
    for rx in replies {
        let vector = tokio::select! {
            v = rx => v.map_err(|_| ApiError::internal("the engine dropped the request"))?,
            _ = st.shutdown.forced() => return Err(ApiError::shutting_down()),
        };
        vectors.push(vector.map_err(|e| ApiError::internal(format!("Embedding failed: {e}")))?);
    }
    Ok(vectors)
}

/// The model `model_id` names, for embedding: the base model behind it, not an adapter.
pub(super) fn embedding_model(st: &AppState, model_id: &str) -> Result<Arc<ServedModel>, ApiError> {
    let (model, adapter) = st.target(model_id)?;
    if adapter.is_some() {
        return Err(ApiError::invalid("model", format!("`{model_id}` is a LoRA adapter; embeddings come from the base model alone.")));
    }
    Ok(model)
}

fn read(st: &AppState, v: &Value) -> Result<EmbeddingRequest, ApiError> {
    let ignored = fields::check(v, FIELDS, "", st.lenient)?;
    let f = Fields::of(v)?;
    let model_id = validate::model_id(st, v)?;
    let model = embedding_model(st, model_id)?;
    f.string("user")?;
    let base64 = match f.string("encoding_format")? {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => return Err(ApiError::invalid("encoding_format", format!("`encoding_format` {other:?}: use float or base64."))),
    };
    let dimensions = f.integer("dimensions", 1, 1 << 20)?.map(|d| d as usize);
    if let Some(d) = dimensions {
        check_dimensions(&model, d)?;
    }
    let inputs = inputs(&model, f.value("input"), "input")?;
    Ok(EmbeddingRequest { model, model_id: model_id.to_string(), inputs, base64, dimensions, ignored })
}

/// `dimensions` for a Matryoshka model: one of its sizes (any up to the full one when it lists
/// none); refused by name for every other model.
pub(super) fn check_dimensions(model: &ServedModel, d: usize) -> Result<(), ApiError> {
    let full = model.config.hidden_size;
    match &model.matryoshka {
        None => Err(ApiError::invalid(
            "dimensions",
            format!(
                "`{}` does not support `dimensions` (its config.json has no matryoshka_dimensions); its embeddings have {full}.",
                model.id
            ),
        )),
        Some(sizes) if sizes.is_empty() && d <= full => Ok(()),
        Some(sizes) if sizes.contains(&d) => Ok(()),
        Some(sizes) => {
            let allowed = if sizes.is_empty() { format!("at most {full}") } else { format!("one of {sizes:?}") };
            Err(ApiError::invalid("dimensions", format!("`dimensions` {d}: this model's sizes are {allowed}.")))
        }
    }
}

/// The texts of field `param` (`input`: a string, a list of strings, a list of token ids or a
/// list of lists of them) as token ids, one list per text, each within the model's context.
pub(super) fn inputs(model: &ServedModel, input: Option<&Value>, param: &str) -> Result<Vec<Vec<u32>>, ApiError> {
    inputs_within(model, input, param, false)
}

/// [`inputs`], with a text longer than the context cut to it (`truncate`, Ollama's default)
/// instead of refused.
pub(super) fn inputs_within(model: &ServedModel, input: Option<&Value>, param: &str, truncate: bool) -> Result<Vec<Vec<u32>>, ApiError> {
    let texts = validate::texts(input, param, model.vocab)?;
    let several = texts.len() > 1;
    let mut texts = texts
        .into_iter()
        .enumerate()
        .map(|(i, text)| {
            let at = if several { format!("{param}[{i}]") } else { param.to_string() };
            match text {
                Prompt::Text(t) if !t.is_empty() => model.tokenizer.encode(&t, true).map_err(|e| ApiError::bad_request(format!("{e:#}"))),
                Prompt::Tokens(ids) if !ids.is_empty() => Ok(ids),
                _ => Err(ApiError::invalid(&at, format!("`{at}` must not be empty."))),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    if texts.len() > MAX_INPUTS {
        return Err(ApiError::invalid(param, format!("`{param}` has {} texts; at most {MAX_INPUTS} per request.", texts.len())));
    }
    for (i, ids) in texts.iter_mut().enumerate() {
        if truncate {
            ids.truncate(model.context);
        }
        if ids.len() > model.context {
            let message = format!("{param}[{i}] has {} tokens; this model's context is {} tokens.", ids.len(), model.context);
            return Err(ApiError::invalid(param, message).with_code("context_length_exceeded"));
        }
    }
    Ok(texts)
}
