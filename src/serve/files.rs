//! OpenAI's Files API for fine-tuning data: `POST /v1/files` (multipart, purpose `fine-tune`,
//! JSONL checked row by row on upload), `GET /v1/files[/{id}[/content]]`, `DELETE /v1/files/{id}`.

use std::sync::Arc;

use axum::extract::{Multipart, Path, State};
use axum::response::IntoResponse;
use axum::Json;
use serde_json::{json, Value};

use super::error::ApiError;
use super::state::AppState;

/// Largest upload (the generation routes keep `--max-body-bytes`).
pub const MAX_UPLOAD_BYTES: usize = 512 << 20;

fn internal(e: anyhow::Error) -> ApiError {
    ApiError::internal(format!("{e:#}"))
}

/// Checks a fine-tuning file: UTF-8 JSONL, every row a shape training reads (chat `messages`,
/// `prompt`/`completion`, `text`, ...). The error names the line.
pub fn validate_jsonl(bytes: &[u8]) -> Result<usize, ApiError> {
    let text = std::str::from_utf8(bytes).map_err(|e| ApiError::invalid("file", format!("The file is not UTF-8 text: {e}.")))?;
    let text = crate::train::data::without_bom(text);
    let mut rows = 0;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value =
            serde_json::from_str(line).map_err(|e| ApiError::invalid("file", format!("Line {}: not valid JSON: {e}.", i + 1)))?;
        let example =
            crate::train::formats::parse_row(&v, true).map_err(|e| ApiError::invalid("file", format!("Line {}: {e:#}.", i + 1)))?;
        if let Some(why) = crate::train::formats::trains_nothing(&example) {
            return Err(
                ApiError::invalid("file", format!("Line {}: this row trains no token: {why}.", i + 1)).with_code("no_trainable_tokens")
            );
        }
        rows += 1;
    }
    if rows == 0 {
        return Err(ApiError::invalid("file", "The file has no rows."));
    }
    Ok(rows)
}

pub async fn upload(
    State(st): State<Arc<AppState>>,
    multipart: Result<Multipart, axum::extract::multipart::MultipartRejection>,
) -> Result<axum::response::Response, ApiError> {
    let mut multipart = multipart.map_err(|e| ApiError::bad_request(format!("Expected a multipart/form-data body: {}", e.body_text())))?;
    let (mut purpose, mut file): (Option<String>, Option<(String, Vec<u8>)>) = (None, None);
    let mut ignored = vec![];
    let malformed = |e: axum::extract::multipart::MultipartError| {
        super::listen::stalled(&e).unwrap_or_else(|| ApiError::bad_request(format!("Malformed multipart body: {e}")))
    };
    while let Some(field) = multipart.next_field().await.map_err(malformed)? {
        match field.name() {
            Some("purpose") => purpose = Some(field.text().await.map_err(|e| ApiError::invalid("purpose", e.to_string()))?),
            Some("file") => {
                let name = field.file_name().unwrap_or("upload.jsonl").to_string();
                let bytes = field.bytes().await.map_err(|e| ApiError::invalid("file", e.to_string()))?;
                file = Some((name, bytes.to_vec()));
            }
            // OpenAI's upload takes `file` and `purpose` only.
            other => {
                let name = other.unwrap_or("(unnamed)").to_string();
                if !st.lenient {
                    return Err(ApiError::invalid(&name, format!("Unrecognized request argument supplied: {name}"))
                        .with_code("unsupported_parameter"));
                }
                ignored.push(name);
            }
        }
    }
    match purpose.as_deref() {
        Some("fine-tune") => {}
        Some(p) => return Err(ApiError::invalid("purpose", format!("purpose {p:?} is not supported; use \"fine-tune\"."))),
        None => return Err(ApiError::invalid("purpose", "`purpose` is required (\"fine-tune\").")),
    }
    let (name, bytes) = file.ok_or_else(|| ApiError::invalid("file", "`file` is required."))?;
    validate_jsonl(&bytes)?;
    // The client's file name is only a label: the stored path is the server's choice.
    let label: String = name.chars().filter(|c| !c.is_control()).take(255).collect();
    let resp = Json(st.store.add_file(&label, "fine-tune", &bytes).map_err(internal)?).into_response();
    Ok(super::response::with_ignored(resp, &ignored))
}

pub async fn list(State(st): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!({"object": "list", "data": st.store.files().map_err(internal)?, "has_more": false})))
}

pub async fn get_one(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    st.store.file(&id).map_err(internal)?.map(Json).ok_or_else(|| ApiError::not_found(format!("No such file: {id}")))
}

pub async fn content(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Result<impl IntoResponse, ApiError> {
    if st.store.file(&id).map_err(internal)?.is_none() {
        return Err(ApiError::not_found(format!("No such file: {id}")));
    }
    let bytes = std::fs::read(st.store.file_path(&id)).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(([(axum::http::header::CONTENT_TYPE, "application/jsonl")], bytes))
}

pub async fn delete(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    if !st.store.delete_file(&id).map_err(internal)? {
        return Err(ApiError::not_found(format!("No such file: {id}")));
    }
    Ok(Json(json!({"id": id, "object": "file", "deleted": true})))
}
