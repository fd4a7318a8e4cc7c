//! llama.cpp's server's answer to `/completion`: one object (`content`, `tokens`, `stop_type` and
//! `stopping_word`, `tokens_predicted`, `tokens_evaluated`, `tokens_cached`,
//! `generation_settings`, `timings`, and `completion_probabilities` with `n_probs`); or, streamed,
//! a `data:` event per piece of text with its token ids (and probabilities), then one with
//! `stop: true` and the whole object's fields, without OpenAI's `[DONE]`, as llama.cpp ends it.
//! A list of prompts is answered with a list of objects, or their events interleaved, each
//! with its prompt's `index`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::reader::{follow, Followed, Read};
use super::Batch;
use crate::generate::{FinishReason, TokenLogprob};
use crate::serve::admission::Submitted;
use crate::serve::error::ApiError;
use crate::serve::state::AppState;
use crate::serve::tool_format::Piece;
use crate::serve::validate::llama_cpp::Echo;
use crate::serve::validate::{RequestKind, ValidatedRequest};
use crate::tokenize::TextTokenizer;

fn echo(req: &ValidatedRequest) -> &Echo {
    match &req.kind {
        RequestKind::LlamaCpp(e) => e,
        _ => unreachable!("a /completion request"),
    }
}

/// How an answer ended and how long its parts took.
struct Ended<'a> {
    finish: FinishReason,
    stop_string: Option<&'a str>,
    completion_tokens: usize,
    cached_tokens: usize,
    /// When the request started, its first token came, and it ended.
    times: (Instant, Option<Instant>, Instant),
}

/// The fields of the whole answer but its text and tokens (the last event of a stream too).
fn final_fields(req: &ValidatedRequest, ended: &Ended, has_new_line: bool) -> Value {
    let e = echo(req);
    let prompt_n = req.prompt_ids.len();
    let stop_type = match (ended.finish, ended.stop_string) {
        (FinishReason::Length, _) => "limit",
        (FinishReason::Stop, Some(_)) => "word",
        (FinishReason::Stop, None) => "eos",
    };
    let truncated = ended.finish == FinishReason::Length && prompt_n + ended.completion_tokens >= req.model.max_total_tokens;
    json!({
        "index": e.index, "content": "", "tokens": [], "id_slot": 0, "stop": true, "model": req.model_id,
        "tokens_predicted": ended.completion_tokens, "tokens_evaluated": prompt_n,
        "generation_settings": e.settings, "prompt": e.prompt, "has_new_line": has_new_line, "truncated": truncated,
        "stop_type": stop_type, "stopping_word": ended.stop_string.unwrap_or(""), "tokens_cached": ended.cached_tokens,
        "timings": timings(prompt_n - ended.cached_tokens.min(prompt_n), ended.cached_tokens, ended.completion_tokens, ended.times),
    })
}

/// The answer as `response_fields` asks for it, as llama.cpp's `json_get_nested_values` does:
/// each path's value (following `a/b` into objects) under the path as its key; a path that leads
/// nowhere is left out.
fn selected(v: Value, fields: Option<&[String]>) -> Value {
    let Some(fields) = fields else { return v };
    let found = |path: &String| path.split('/').try_fold(&v, |at, key| at.as_object()?.get(key)).map(|x| (path.clone(), x.clone()));
    Value::Object(fields.iter().filter_map(found).collect())
}

/// llama.cpp's `timings`: the prompt's part up to the first token (queueing included), the
/// answer's from there to the end.
fn timings(prompt_n: usize, cache_n: usize, predicted_n: usize, (start, first, end): (Instant, Option<Instant>, Instant)) -> Value {
    let first = first.unwrap_or(end);
    let ms = |a: Instant, b: Instant| b.duration_since(a).as_secs_f64() * 1e3;
    let (prompt_ms, predicted_ms) = (ms(start, first), ms(first, end));
    let per = |n: usize, ms: f64| (if n > 0 { ms / n as f64 } else { 0.0 }, if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 });
    let ((ptok, psec), (gtok, gsec)) = (per(prompt_n, prompt_ms), per(predicted_n, predicted_ms));
    json!({"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms, "prompt_per_token_ms": ptok, "prompt_per_second": psec,
           "predicted_n": predicted_n, "predicted_ms": predicted_ms, "predicted_per_token_ms": gtok, "predicted_per_second": gsec})
}

/// `completion_probabilities`: each token with its log-probability and its top alternatives.
fn probabilities(tokenizer: &TextTokenizer, lps: &[TokenLogprob]) -> Value {
    let entry = |id: u32, logprob: f32| {
        let token = tokenizer.decode(&[id], false).unwrap_or_default();
        json!({"id": id, "token": token, "bytes": token.as_bytes(), "logprob": logprob})
    };
    lps.iter()
        .map(|l| {
            let mut e = entry(l.token, l.logprob);
            e["top_logprobs"] = l.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
            e
        })
        .collect()
}

/// Waits for every prompt's answer: one object, or a list of them for a list of prompts.
pub async fn whole(st: Arc<AppState>, batch: Batch) -> Result<Response, ApiError> {
    let several = batch.len() > 1;
    let mut answers = vec![];
    for (req, submitted) in batch {
        answers.push(answer(&st, &req, submitted).await?);
    }
    Ok(Json(if several { Value::Array(answers) } else { answers.remove(0) }).into_response())
}

/// One prompt's whole answer.
async fn answer(st: &AppState, req: &ValidatedRequest, submitted: Submitted) -> Result<Value, ApiError> {
    let Submitted { admission, mut answers, at: start } = submitted;
    let mut rx = answers.remove(0);
    let answer = super::collect(st, &mut rx).await?;
    drop(admission);
    let e = echo(req);
    let ended = Ended {
        finish: answer.finish,
        stop_string: answer.stop_string.as_deref(),
        completion_tokens: answer.completion_tokens,
        cached_tokens: answer.cached_tokens,
        times: (start, answer.first_token_at, Instant::now()),
    };
    let mut v = final_fields(req, &ended, answer.text.contains('\n'));
    if e.return_tokens {
        v["tokens"] = json!(answer.tokens);
    }
    if e.n_probs > 0 {
        v["completion_probabilities"] = probabilities(&req.model.tokenizer, &answer.logprobs);
    }
    v["content"] = json!(answer.text);
    Ok(selected(v, e.response_fields.as_deref()))
}

type Sender = mpsc::UnboundedSender<Result<SseEvent, Infallible>>;

/// The event stream: every prompt's events as they come, each with its prompt's `index`. The
/// first failure ends it with the error.
pub fn sse(st: Arc<AppState>, batch: Batch) -> Response {
    let (out, out_rx) = mpsc::unbounded_channel();
    let mut streams = JoinSet::new();
    for (req, submitted) in batch {
        let (st, out) = (st.clone(), out.clone());
        streams.spawn(async move { stream(&st, &req, submitted, &out).await });
    }
    tokio::spawn(async move {
        while let Some(ended) = streams.join_next().await {
            let error = match ended {
                Ok(None) => continue,
                Ok(Some(e)) => e,
                Err(e) => ApiError::internal(format!("a stream's task ended: {e}")),
            };
            // Dropping the other prompts' receivers cancels their sequences.
            streams.abort_all();
            st.metrics.stream_error();
            let _ = out.send(Ok(SseEvent::default().data(error.body().to_string())));
            return;
        }
    });
    Sse::new(UnboundedReceiverStream::new(out_rx)).keep_alive(KeepAlive::default()).into_response()
}

/// Streams one prompt's answer: None when it ended (or its client is gone), else the failure.
async fn stream(st: &AppState, req: &ValidatedRequest, submitted: Submitted, out: &Sender) -> Option<ApiError> {
    let Submitted { admission: _admission, mut answers, at: start } = submitted;
    let rx = answers.remove(0);
    let send = |v: Value| out.send(Ok(SseEvent::default().data(v.to_string()))).is_ok();
    let e = echo(req);
    let prompt_n = req.prompt_ids.len();
    let (mut first, mut predicted, mut has_new_line) = (None, 0, false);
    let on_read = |read: Read| {
        let text: String = read.pieces.into_iter().map(|p| if let Piece::Text(t) = p { t } else { String::new() }).collect();
        if text.is_empty() && read.token.is_none() {
            return true;
        }
        first.get_or_insert_with(Instant::now);
        predicted += usize::from(read.token.is_some());
        has_new_line |= text.contains('\n');
        let tokens: Vec<u32> = read.token.into_iter().collect();
        let mut v = json!({"index": e.index, "content": text, "tokens": tokens, "stop": false, "id_slot": 0,
                           "tokens_predicted": predicted, "tokens_evaluated": prompt_n});
        if e.n_probs > 0 {
            v["completion_probabilities"] = probabilities(&req.model.tokenizer, read.logprob.as_slice());
        }
        send(v)
    };
    match follow(st, req, rx, on_read).await {
        Followed::Done(done) => {
            let ended = Ended {
                finish: done.finish,
                stop_string: done.stop_string.as_deref(),
                completion_tokens: done.completion_tokens,
                cached_tokens: done.cached_tokens,
                times: (start, first, Instant::now()),
            };
            send(selected(final_fields(req, &ended, has_new_line), e.response_fields.as_deref()));
            None
        }
        Followed::ClientGone => None,
        Followed::Failed(e) => Some(e),
    }
}
