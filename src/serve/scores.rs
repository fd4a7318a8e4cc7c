//! Relevance from embeddings, as vLLM serves it for an embedding model: `POST /v1/score`
//! (`text_1` against `text_2`) and `POST /v1/rerank` (also `/rerank` and `/v2/rerank`, the paths
//! Jina's API and Cohere's v1 and v2 clients call: `query` against `documents`, sorted, `top_n`).
//! A score is the cosine similarity of the two texts' embeddings (the model's pooling), in
//! [-1, 1]; the texts go through the engine as `/v1/embeddings`' do, one queue place a request.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::body::json_body;
use super::embeddings::{embed_all, embedding_model, inputs};
use super::error::ApiError;
use super::fields::{self, Fields};
use super::ids::{new_id, now_s};
use super::response::with_ignored;
use super::served_model::ServedModel;
use super::state::AppState;
use super::validate;

/// `/v1/score`'s fields.
pub const SCORE_FIELDS: &[&str] = &["model", "text_1", "text_2", "user"];

/// `/v1/rerank`'s fields.
pub const RERANK_FIELDS: &[&str] = &["model", "query", "documents", "top_n", "return_documents", "user"];

pub async fn score(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let (v, model_id, model, ignored) = checked_body(&st, body, SCORE_FIELDS)?;
    let f = Fields::of(&v)?;
    let (first, second) = (inputs(&model, f.value("text_1"), "text_1")?, inputs(&model, f.value("text_2"), "text_2")?);
    // One text against each of the others, or the two lists pairwise (vLLM's pairing).
    let pairs: Vec<(usize, usize)> = match (first.len(), second.len()) {
        (1, n) => (0..n).map(|j| (0, j)).collect(),
        (m, n) if m == n => (0..n).map(|i| (i, i)).collect(),
        (m, n) => {
            let message = format!("`text_1` has {m} texts and `text_2` {n}: give one `text_1`, or as many as `text_2` (scored pairwise).");
            return Err(ApiError::invalid("text_2", message));
        }
    };
    let _admission = super::admission::admit(&st, 1)?;
    let texts: Vec<Vec<u32>> = first.iter().chain(&second).cloned().collect();
    let vectors = embed_all(&st, &model, &texts).await?;
    let (a, b) = vectors.split_at(first.len());
    let data: Vec<Value> = pairs
        .iter()
        .enumerate()
        .map(|(index, &(i, j))| json!({"index": index, "object": "score", "score": cosine(&a[i], &b[j])}))
        .collect();
    let tokens: usize = texts.iter().map(Vec::len).sum();
    let body = json!({"id": new_id("score"), "object": "list", "created": now_s(), "model": model_id, "data": data,
                      "usage": {"prompt_tokens": tokens, "total_tokens": tokens}});
    Ok(with_ignored(Json(body).into_response(), &ignored))
}

pub async fn rerank(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let (v, model_id, model, ignored) = checked_body(&st, body, RERANK_FIELDS)?;
    let f = Fields::of(&v)?;
    let query = f.string("query")?.ok_or_else(|| ApiError::invalid("query", "`query` is required: a string."))?;
    let documents = document_texts(f.value("documents"))?;
    let top_n = f.integer("top_n", 0, i64::MAX)?.map(|n| n as usize).filter(|&n| n > 0).unwrap_or(documents.len());
    let return_documents = f.bool("return_documents")?.unwrap_or(true);
    let query_ids = inputs(&model, Some(&json!(query)), "query")?;
    let document_ids = inputs(&model, Some(&json!(documents)), "documents")?;
    let _admission = super::admission::admit(&st, 1)?;
    let texts: Vec<Vec<u32>> = query_ids.iter().chain(&document_ids).cloned().collect();
    let vectors = embed_all(&st, &model, &texts).await?;
    let mut ranked: Vec<(usize, f32)> = vectors[1..].iter().map(|d| cosine(&vectors[0], d)).enumerate().collect();
    ranked.sort_by(|x, y| y.1.total_cmp(&x.1).then(x.0.cmp(&y.0)));
    let results: Vec<Value> = ranked
        .into_iter()
        .take(top_n)
        .map(|(index, score)| {
            let mut r = json!({"index": index, "relevance_score": score});
            if return_documents {
                r["document"] = json!({"text": documents[index]});
            }
            r
        })
        .collect();
    let tokens: usize = texts.iter().map(Vec::len).sum();
    let body = json!({"id": new_id("rerank"), "model": model_id, "usage": {"total_tokens": tokens}, "results": results});
    Ok(with_ignored(Json(body).into_response(), &ignored))
}

/// The body, its fields checked against `accepted` (`user` a string), the `model` it names, that
/// model (for embedding), and the fields `--lenient` ignored.
type CheckedBody = (Value, String, Arc<ServedModel>, Vec<String>);

fn checked_body(st: &AppState, body: Result<Bytes, BytesRejection>, accepted: &[&str]) -> Result<CheckedBody, ApiError> {
    let v = json_body(body, st.max_body_bytes)?;
    let ignored = fields::check(&v, accepted, "", st.lenient)?;
    let f = Fields::of(&v)?;
    f.string("user")?;
    let model_id = validate::model_id(st, &v)?.to_string();
    let model = embedding_model(st, &model_id)?;
    Ok((v, model_id, model, ignored))
}

/// `documents`: strings, or objects with a `text` (Cohere's v1 and Jina's shape).
fn document_texts(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    const P: &str = "documents";
    let Some(Value::Array(items)) = v.filter(|d| d.as_array().is_some_and(|a| !a.is_empty())) else {
        return Err(ApiError::invalid(P, "`documents` must be a non-empty list of strings (or of {\"text\": ...} objects)."));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, d)| match d {
            Value::String(s) => Ok(s.clone()),
            Value::Object(o) if o.len() == 1 && o.get("text").is_some_and(Value::is_string) => Ok(o["text"].as_str().unwrap().to_string()),
            _ => Err(ApiError::invalid(&format!("{P}[{i}]"), "a document must be a string or {\"text\": \"...\"}.")),
        })
        .collect()
}

/// The cosine similarity of two vectors (0 when either is zero).
fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    match norm(a) * norm(b) {
        n if n > 0.0 => dot / n,
        _ => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosine_is_scale_free_and_documents_take_both_shapes() {
        assert!((cosine(&[1.0, 0.0], &[3.0, 0.0]) - 1.0).abs() < 1e-6);
        assert!((cosine(&[1.0, 0.0], &[0.0, 2.0])).abs() < 1e-6);
        assert!((cosine(&[1.0, 1.0], &[-1.0, -1.0]) + 1.0).abs() < 1e-6);
        assert_eq!(cosine(&[0.0, 0.0], &[1.0, 0.0]), 0.0);
        let docs = json!(["a", {"text": "b"}]);
        assert_eq!(document_texts(Some(&docs)).unwrap(), ["a", "b"]);
        assert_eq!(document_texts(Some(&json!(["a", {"title": "b"}]))).unwrap_err().param.as_deref(), Some("documents[1]"));
        assert_eq!(document_texts(Some(&json!([]))).unwrap_err().param.as_deref(), Some("documents"));
    }
}
