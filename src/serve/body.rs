//! A request body read as JSON, with OpenAI's errors: 400 for malformed JSON, 413 past
//! `--max-body-bytes`, 408 for a body that stalled (see `listen`).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde_json::Value;

use super::error::ApiError;

/// The body as JSON, or a 400/413 in OpenAI's shape. Bodies over the limit are read to the
/// end first (up to a hard cap), so the client gets the 413 instead of a broken connection.
pub fn json_body(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Value, ApiError> {
    let bytes = body.map_err(|e| {
        if let Some(timeout) = super::listen::stalled(&e) {
            return timeout;
        }
        let status = e.status();
        ApiError::new(status, "invalid_request_error", format!("Could not read the request body: {}", e.body_text()))
    })?;
    if bytes.len() > limit {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("The request body has {} bytes; the limit is {limit} (--max-body-bytes).", bytes.len()),
        ));
    }
    if bytes.is_empty() {
        return Err(ApiError::bad_request("The request body is empty; send a JSON object."));
    }
    let text = std::str::from_utf8(&bytes).map_err(|_| ApiError::bad_request("The request body is not valid UTF-8."))?;
    serde_json::from_str(text).map_err(|e| ApiError::bad_request(format!("The request body is not valid JSON: {e}")))
}
