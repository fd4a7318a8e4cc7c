//! Ollama's shape of an answer: for `/api/chat` a `message` (`content`, `thinking`,
//! `tool_calls` whose arguments are objects), for `/api/generate` a `response` (and
//! `thinking`); streamed as newline-delimited JSON objects with `done: false`, the calls in one
//! object once the answer has ended, then the last object with `done: true`, `done_reason`
//! (`stop`, `length`), the token counts and the durations in nanoseconds. An error while
//! streaming is one `{"error"}` line, as Ollama writes it.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::reader::{follow, Finished, Followed, Read};
use crate::generate::FinishReason;
use crate::serve::admission::Submitted;
use crate::serve::call_stream::CallEvent;
use crate::serve::clock;
use crate::serve::error::ApiError;
use crate::serve::state::AppState;
use crate::serve::tool_format::Piece;
use crate::serve::validate::ollama::Api;
use crate::serve::validate::{RequestKind, ValidatedRequest};

/// The answer so far: its text, its thinking and its calls (name, arguments' text).
#[derive(Default)]
struct Answer {
    content: String,
    thinking: String,
    calls: Vec<(String, String)>,
}

impl Answer {
    /// Takes a piece of the answer: its text and thinking are returned (what a streamed object
    /// carries), its calls kept for the end.
    fn take(&mut self, read: Read) -> (String, String) {
        let mut text = String::new();
        for p in read.pieces {
            match p {
                Piece::Text(t) => text.push_str(&t),
                Piece::Call(CallEvent::Start { name, .. }) => self.calls.push((name, String::new())),
                Piece::Call(CallEvent::Args { fragment, .. }) => {
                    if let Some((_, args)) = self.calls.last_mut() {
                        args.push_str(&fragment);
                    }
                }
            }
        }
        self.content.push_str(&text);
        self.thinking.push_str(&read.reasoning);
        (text, read.reasoning)
    }
}

/// The answer's calls as Ollama writes them (arguments as an object).
fn tool_calls(calls: &[(String, String)]) -> Value {
    let call = |(i, (name, args)): (usize, &(String, String))| {
        let arguments = serde_json::from_str::<Value>(args).unwrap_or_else(|_| json!({}));
        json!({"id": format!("call_{i}"), "function": {"index": i, "name": name, "arguments": arguments}})
    };
    calls.iter().enumerate().map(call).collect()
}

/// The request's `model`, the time, `done: false`, and the answer's part: chat's `message`
/// (with `tool_calls` when given) or generate's `response`.
fn object(req: &ValidatedRequest, content: &str, thinking: &str, calls: Option<Value>) -> Value {
    let mut o = json!({"model": req.model_id, "created_at": clock::rfc3339(SystemTime::now())});
    match api(req) {
        Api::Chat => {
            let mut message = json!({"role": "assistant", "content": content});
            if !thinking.is_empty() {
                message["thinking"] = json!(thinking);
            }
            if let Some(c) = calls {
                message["tool_calls"] = c;
            }
            o["message"] = message;
        }
        Api::Generate => {
            o["response"] = json!(content);
            if !thinking.is_empty() {
                o["thinking"] = json!(thinking);
            }
        }
    }
    o["done"] = json!(false);
    o
}

fn api(req: &ValidatedRequest) -> Api {
    match req.kind {
        RequestKind::Ollama { api, .. } => api,
        _ => unreachable!("an Ollama request"),
    }
}

/// Marks `o` the last object: why the answer ended, its counts and durations (nanoseconds: all
/// from the request's admission, the prompt's up to the first token, the answer's after it).
fn finished(mut o: Value, req: &ValidatedRequest, done: &Finished, (start, first): (Instant, Option<Instant>)) -> Value {
    let end = Instant::now();
    let first = first.unwrap_or(end);
    let ns = |a: Instant, b: Instant| b.duration_since(a).as_nanos() as u64;
    o["done"] = json!(true);
    o["done_reason"] = json!(match done.finish {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    });
    o["total_duration"] = json!(ns(start, end));
    o["load_duration"] = json!(0);
    o["prompt_eval_count"] = json!(req.prompt_ids.len());
    o["prompt_eval_duration"] = json!(ns(start, first));
    o["eval_count"] = json!(done.completion_tokens);
    o["eval_duration"] = json!(ns(first, end));
    o
}

/// Waits for the answer, then one object.
pub async fn whole(st: Arc<AppState>, req: ValidatedRequest, submitted: Submitted) -> Result<Response, ApiError> {
    let Submitted { admission, mut answers, at: start } = submitted;
    let mut first = None;
    let mut answer = Answer::default();
    let followed = follow(&st, &req, answers.remove(0), |read| {
        if read.token.is_some() {
            first.get_or_insert_with(Instant::now);
        }
        answer.take(read);
        true
    })
    .await;
    drop(admission);
    let done = match followed {
        Followed::Done(done) => done,
        Followed::Failed(e) => return Err(e),
        Followed::ClientGone => unreachable!("a whole answer is never given up"),
    };
    let calls = (!answer.calls.is_empty()).then(|| tool_calls(&answer.calls));
    let o = object(&req, &answer.content, &answer.thinking, calls);
    Ok(Json(finished(o, &req, &done, (start, first))).into_response())
}

/// The answer as newline-delimited JSON objects.
pub fn ndjson(st: Arc<AppState>, req: ValidatedRequest, submitted: Submitted) -> Response {
    let Submitted { admission, mut answers, at: start } = submitted;
    let rx = answers.remove(0);
    let (out, lines) = mpsc::unbounded_channel::<Result<Bytes, Infallible>>();
    tokio::spawn(async move {
        let _admission = admission;
        let send = |v: &Value| out.send(Ok(Bytes::from(format!("{v}\n")))).is_ok();
        let mut first = None;
        let mut answer = Answer::default();
        let followed = follow(&st, &req, rx, |read| {
            if read.token.is_some() {
                first.get_or_insert_with(Instant::now);
            }
            let (text, thinking) = answer.take(read);
            (text.is_empty() && thinking.is_empty()) || send(&object(&req, &text, &thinking, None))
        })
        .await;
        match followed {
            Followed::Done(done) => {
                if !answer.calls.is_empty() && !send(&object(&req, "", "", Some(tool_calls(&answer.calls)))) {
                    return;
                }
                send(&finished(object(&req, "", "", None), &req, &done, (start, first)));
            }
            Followed::ClientGone => {}
            Followed::Failed(e) => {
                st.metrics.stream_error();
                send(&json!({"error": e.message_naming_param()}));
            }
        }
    });
    let body = Body::from_stream(UnboundedReceiverStream::new(lines));
    ([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response()
}
