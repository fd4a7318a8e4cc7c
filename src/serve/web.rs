//! The web pages (`web/`), compiled into the binary: `/` (chat playground) and `/finetune`
//! (upload data, start a job, watch its events and loss, chat with the result). The pages hold
//! no data; the API calls they make carry the key the user types, kept in the browser.

use axum::http::header;
use axum::response::IntoResponse;

const INDEX: &str = include_str!("../../web/index.html");
const FINETUNE: &str = include_str!("../../web/finetune.html");
const APP_JS: &str = include_str!("../../web/app.js");
const APP_CSS: &str = include_str!("../../web/app.css");

/// Paths served without an API key: the static pages themselves.
pub const PUBLIC_PATHS: &[&str] = &["/", "/finetune", "/web/app.js", "/web/app.css"];

pub async fn index() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], INDEX)
}

pub async fn finetune() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], FINETUNE)
}

pub async fn app_js() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/javascript; charset=utf-8")], APP_JS)
}

pub async fn app_css() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], APP_CSS)
}
