//! Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP
//! status the `openai` client maps to its exception classes (400 BadRequestError, 401
//! AuthenticationError, 404 NotFoundError, 429 RateLimitError).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds, for 429.
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// The message with the parameter it is about in front (`param: message`) unless it names
    /// it already: for the APIs whose errors have no field for the parameter.
    pub fn message_naming_param(&self) -> String {
        match &self.param {
            Some(p) if !self.message.contains(p.as_str()) => format!("{p}: {}", self.message),
            _ => self.message.clone(),
        }
    }

    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), kind, param: None, code: None, retry_after: None }
    }

    /// 400 for a request parameter, naming it.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self { param: Some(param.to_string()), ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message) }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message).with_code("not_found")
    }

    pub fn model_not_found(model: &str) -> Self {
        Self {
            param: Some("model".into()),
            ..Self::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("The model `{model}` does not exist."))
        }
        .with_code("model_not_found")
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "Incorrect or missing API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`).",
        )
        .with_code("invalid_api_key")
    }

    pub fn overloaded(retry_after: u64) -> Self {
        Self {
            retry_after: Some(retry_after),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "The server is at its request limit; retry later.")
                .with_code("rate_limit_exceeded")
        }
    }

    /// 503 while the server shuts down (see `shutdown`).
    pub fn shutting_down() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "The server is shutting down; retry on another instance or after it restarts.",
        )
        .with_code("server_shutting_down")
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

/// The error in Anthropic's shape (`/v1/messages`): `{"type": "error", "error": {"type",
/// "message"}}`, the type Anthropic gives the status, the parameter named in the message (as
/// Anthropic's own messages name it: `messages.0.content: ...`).
pub struct AnthropicError(pub ApiError);

impl AnthropicError {
    pub fn body(&self) -> serde_json::Value {
        let e = &self.0;
        let kind = match e.status.as_u16() {
            400 | 405 | 422 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            _ => "api_error",
        };
        json!({"type": "error", "error": {"type": kind, "message": e.message_naming_param()}})
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        let mut resp = (self.0.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.0.retry_after {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}
