//! The HTTP routes: OpenAI's generation API (`/v1/models`, `/v1/completions`,
//! `/v1/chat/completions`, JSON or SSE), and `/health`, `/metrics`, `/tokenize`, `/detokenize`,
//! `/info`, `/openapi.json`. Bodies are read as bytes and parsed here, so malformed JSON, wrong
//! types and oversized bodies all answer in OpenAI's error shape.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::engine::{Event, Job};
use super::error::ApiError;
use super::fields;
use super::request::{json_body, model_field, parse_common, parse_logit_bias, parse_messages, parse_prompt, parse_response_format, GenerationRequest, Prompt};
use super::{AppState, ServedModel};
use super::tools::{ToolChoice, Tools};
use crate::generate::constraint::OutputFormat;
use crate::generate::TokenLogprob;

pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

pub async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": st.model_objects()}))
}

pub async fn model(State(st): State<Arc<AppState>>, axum::extract::Path(id): axum::extract::Path<String>) -> Result<Json<Value>, ApiError> {
    st.model_objects().into_iter().find(|m| m["id"] == json!(id)).map(Json).ok_or_else(|| ApiError::model_not_found(&id))
}

/// `DELETE /v1/models/{id}`: deletes a fine-tuned model (its files, and its engine once the
/// requests running on it end); the base model cannot be deleted (403, as OpenAI answers).
pub async fn delete_model(State(st): State<Arc<AppState>>, axum::extract::Path(id): axum::extract::Path<String>) -> Result<Json<Value>, ApiError> {
    if id == st.base_id {
        return Err(ApiError::new(StatusCode::FORBIDDEN, "invalid_request_error", format!("`{id}` is the served base model; only fine-tuned models can be deleted.")).with_code("model_not_deletable"));
    }
    let dir = st.store.delete_fine_tuned_model(&id).map_err(|e| ApiError::internal(format!("{e:#}")))?.ok_or_else(|| ApiError::model_not_found(&id))?;
    // The model and its checkpoints (`{id}:ckpt-step-N`), which live in the same directory.
    st.models.write().unwrap().retain(|m, _| m != &id && !super::checkpoints::is_checkpoint_of(m, &id));
    std::fs::remove_dir_all(&dir).or_else(|e| if e.kind() == std::io::ErrorKind::NotFound { Ok(()) } else { Err(e) }).map_err(|e| ApiError::internal(format!("deleting {}: {e}", dir.display())))?;
    Ok(Json(json!({"id": id, "object": "model", "deleted": true})))
}

pub async fn info(State(st): State<Arc<AppState>>) -> Json<Value> {
    let m = st.base();
    Json(json!({
        "model": m.id,
        "max_model_len": m.context,
        "max_input_tokens": m.max_input_tokens,
        "max_total_tokens": m.max_total_tokens,
        "max_concurrent_requests": st.max_concurrent,
        "max_queue": st.max_queue,
        "max_body_bytes": st.max_body_bytes,
        "max_n": super::request::MAX_N,
        "max_stop": super::request::MAX_STOP,
        "sampling_defaults": {
            "temperature": m.defaults.temperature, "top_p": m.defaults.top_p, "top_k": m.defaults.top_k,
            "repetition_penalty": m.defaults.repetition_penalty, "max_tokens_completions": 16,
            "max_tokens_chat": "the rest of the context",
        },
        "chat_template": m.tokenizer.chat_template.is_some(),
        "data_dir_jobs": true,
    }))
}

pub async fn metrics(State(st): State<Arc<AppState>>) -> impl IntoResponse {
    let text = st.metrics.render(st.queued(), st.running());
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}

pub async fn openapi() -> impl IntoResponse {
    ([(axum::http::header::CONTENT_TYPE, "application/json")], super::openapi::SPEC)
}

/// The model a utility request names (`model`, optional), else the base model.
fn model_or_base(st: &AppState, v: &Value) -> Result<Arc<ServedModel>, ApiError> {
    match v.get("model") {
        None | Some(Value::Null) => Ok(st.base()),
        Some(_) => st.model(model_field(v)?),
    }
}

pub async fn tokenize(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Json<Value>, ApiError> {
    let v = json_body(body, st.max_body_bytes)?;
    let m = model_or_base(&st, &v)?;
    let ids = if v.get("messages").is_some() {
        m.chat_ids(&parse_messages(&v, st.lenient, &mut vec![])?)?
    } else {
        match parse_prompt(&v, m.vocab)? {
            Prompt::Text(t) => {
                let special = v.get("add_special_tokens").map(|x| x.as_bool().ok_or_else(|| ApiError::invalid("add_special_tokens", "`add_special_tokens` must be a boolean."))).transpose()?;
                m.tokenizer.encode(&t, special.unwrap_or(true)).map_err(|e| ApiError::bad_request(format!("{e:#}")))?
            }
            Prompt::Tokens(ids) => ids,
            Prompt::Chat(_) => unreachable!(),
        }
    };
    Ok(Json(json!({"count": ids.len(), "max_model_len": m.context, "tokens": ids})))
}

pub async fn detokenize(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Json<Value>, ApiError> {
    let v = json_body(body, st.max_body_bytes)?;
    let m = model_or_base(&st, &v)?;
    let ids: Vec<u32> = match v.get("tokens") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_u64().filter(|&i| (i as usize) < m.vocab).map(|i| i as u32))
            .collect::<Option<_>>()
            .ok_or_else(|| ApiError::invalid("tokens", format!("`tokens` must be integers in [0, {}).", m.vocab)))?,
        _ => return Err(ApiError::invalid("tokens", "`tokens` must be a list of token ids.")),
    };
    let text = m.tokenizer.decode(&ids, false).map_err(|e| ApiError::bad_request(format!("{e:#}")))?;
    Ok(Json(json!({"prompt": text})))
}

/// Counts a request's sequences as admitted until dropped (when the response is complete or
/// the client is gone), so the queue bound holds for streams too.
struct Admission(Arc<AppState>, usize);

impl Drop for Admission {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(self.1, Ordering::SeqCst);
    }
}

/// Admits a request of `sequences` sequences (its `n`): each takes a generation slot or a
/// queue place, as n separate requests would.
fn admit(st: &Arc<AppState>, sequences: usize) -> Result<Admission, ApiError> {
    let cap = st.max_concurrent + st.max_queue;
    if sequences > cap {
        return Err(ApiError::invalid("n", format!("`n` = {sequences} is more sequences than this server admits at once ({cap}: --max-concurrent-requests + --max-queue).")));
    }
    st.in_flight
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n + sequences <= cap).then_some(n + sequences))
        .map_err(|_| ApiError::overloaded(1))?;
    Ok(Admission(st.clone(), sequences))
}

pub async fn completions(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let v = json_body(body, st.max_body_bytes)?;
    let ignored = fields::check(&v, fields::COMPLETIONS, "", st.lenient)?;
    let m = st.model(model_field(&v)?)?;
    let mut req = parse_common(&v, &m.defaults, false)?;
    req.params.logit_bias = parse_logit_bias(&v, m.vocab)?;
    let (ids, echo_text) = match parse_prompt(&v, m.vocab)? {
        Prompt::Text(t) => (m.tokenizer.encode(&t, true).map_err(|e| ApiError::bad_request(format!("{e:#}")))?, t),
        Prompt::Tokens(ids) => {
            let t = m.tokenizer.decode(&ids, false).unwrap_or_default();
            (ids, t)
        }
        Prompt::Chat(_) => unreachable!(),
    };
    let echo = req.echo.then_some(echo_text);
    // Echo with logprobs scores the prompt too (OpenAI's shape: the first token's is null).
    if echo.is_some() {
        req.params.prompt_logprobs = req.params.logprobs;
    }
    Ok(with_ignored(run_generation(st, m, req, ids, Kind::Completion { echo }, vec![]).await?, &ignored))
}

pub async fn chat_completions(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let v = json_body(body, st.max_body_bytes)?;
    let mut ignored = fields::check(&v, fields::CHAT, "", st.lenient)?;
    let m = st.model(model_field(&v)?)?;
    let mut req = parse_common(&v, &m.defaults, true)?;
    req.params.logit_bias = parse_logit_bias(&v, m.vocab)?;
    let messages = parse_messages(&v, st.lenient, &mut ignored)?;
    let tools = super::tools::parse(&v)?;
    let format = match (parse_response_format(&v, st.lenient, &mut ignored)?, tools.as_ref().and_then(Tools::output_format)) {
        (Some(_), Some(_)) => return Err(ApiError::invalid("response_format", "`response_format` cannot be combined with a `tool_choice` that forces a call.")),
        (Some(f), None) => Some((f, false)),
        (None, f) => f.map(|f| (f, true)),
    };
    let constraints = match &format {
        None => vec![],
        Some((f, from_tools)) => {
            let what = if *from_tools { "tools" } else { "response_format" };
            let grammars = m.grammars.as_ref().map_err(|why| ApiError::invalid(what, format!("Structured output is not available for this model: {why}.")))?;
            let param = match (from_tools, f) {
                (true, _) => "tools",
                (false, OutputFormat::JsonSchema(_)) => "response_format.json_schema.schema",
                (false, OutputFormat::JsonObject) => "response_format",
            };
            // One matcher per choice: each answer walks the grammar on its own.
            (0..req.n).map(|_| grammars.matcher(f)).collect::<anyhow::Result<Vec<_>>>().map_err(|e| ApiError::invalid(param, format!("The schema cannot be used: {e:#}")))?
        }
    };
    let ids = m.chat_ids_with_tools(&messages, tools.as_ref().filter(|t| t.choice != ToolChoice::None))?;
    Ok(with_ignored(run_generation(st, m, req, ids, Kind::Chat { tools }, constraints).await?, &ignored))
}

/// Lists the fields `--lenient` ignored in the response's header (see `fields`).
pub fn with_ignored(mut resp: Response, ignored: &[String]) -> Response {
    if !ignored.is_empty() {
        if let Ok(v) = axum::http::HeaderValue::from_str(&ignored.join(", ")) {
            resp.headers_mut().insert(fields::IGNORED_HEADER, v);
        }
    }
    resp
}

enum Kind {
    Completion { echo: Option<String> },
    /// A chat answer, read for function calls when the request gives functions.
    Chat { tools: Option<Tools> },
}

/// Runs `req.n` answers to `ids`; `constraints`: one grammar matcher per answer, or none.
async fn run_generation(st: Arc<AppState>, m: Arc<ServedModel>, mut req: GenerationRequest, ids: Vec<u32>, kind: Kind, constraints: Vec<llguidance::Matcher>) -> Result<Response, ApiError> {
    let prompt_tokens = ids.len();
    if prompt_tokens == 0 {
        return Err(ApiError::invalid(if matches!(kind, Kind::Chat { .. }) { "messages" } else { "prompt" }, "The prompt is empty."));
    }
    if prompt_tokens > m.max_input_tokens {
        return Err(ApiError::invalid(
            if matches!(kind, Kind::Chat { .. }) { "messages" } else { "prompt" },
            format!("The prompt has {prompt_tokens} tokens; this server accepts at most {} input tokens.", m.max_input_tokens),
        )
        .with_code("context_length_exceeded"));
    }
    let default_max = match kind {
        Kind::Completion { .. } => 16,
        Kind::Chat { .. } => m.max_total_tokens.saturating_sub(prompt_tokens),
    };
    let max_tokens = req.max_tokens.unwrap_or(default_max);
    if prompt_tokens + max_tokens > m.max_total_tokens || max_tokens == 0 {
        return Err(ApiError::invalid(
            if req.max_tokens.is_some() { "max_tokens" } else { "messages" },
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({prompt_tokens} in the prompt, {max_tokens} for the completion).",
                m.max_total_tokens,
                prompt_tokens + max_tokens
            ),
        )
        .with_code("context_length_exceeded"));
    }
    req.params.max_new_tokens = max_tokens;
    let admission = admit(&st, req.n)?;
    let mut receivers = vec![];
    let mut constraints = constraints.into_iter();
    for i in 0..req.n {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut params = req.params.clone();
        params.seed = params.seed.wrapping_add(i as u64);
        m.engine
            .submit(Job { prompt_ids: ids.clone(), params, constraint: constraints.next(), events: tx, enqueued: Instant::now() })
            .map_err(ApiError::internal)?;
        receivers.push(rx);
    }
    let id = super::ids::new_id(if matches!(kind, Kind::Chat { .. }) { "chatcmpl" } else { "cmpl" });
    let created = super::ids::now_s() as u64;
    let chat = matches!(kind, Kind::Chat { .. });
    let (echo, tools) = match kind {
        Kind::Completion { echo } => (echo, None),
        Kind::Chat { tools } => (None, tools.filter(|t| t.choice != ToolChoice::None)),
    };
    if req.stream {
        let scored_echo = echo.is_some() && req.params.prompt_logprobs.is_some();
        let echo = echo.map(|e| (e, ids, scored_echo));
        return Ok(stream_response(m, admission, receivers, id, created, chat, echo, tools, req.include_usage, prompt_tokens, st));
    }
    let mut choices = vec![];
    let mut completion_tokens = 0;
    for (index, mut rx) in receivers.into_iter().enumerate() {
        let mut text = echo.clone().unwrap_or_default();
        let mut lps: Vec<TokenLogprob> = vec![];
        let mut prompt_lps: Option<Vec<TokenLogprob>> = None;
        let finish = loop {
            let ev = tokio::select! {
                ev = rx.recv() => ev,
                // The shutdown's grace period is over.
                _ = st.shutdown.forced() => return Err(ApiError::shutting_down()),
            };
            match ev {
                Some(Event::PromptLogprobs(v)) => prompt_lps = Some(v),
                Some(Event::Delta { text: t, logprob }) => {
                    text.push_str(&t);
                    lps.extend(logprob);
                }
                Some(Event::Done { finish, completion_tokens: c, .. }) => {
                    completion_tokens += c;
                    break finish;
                }
                // The request was checked before it ran: a failure now is the server's.
                Some(Event::Error(e)) => return Err(ApiError::internal(format!("Generation failed: {e}"))),
                None => return Err(ApiError::internal("the engine dropped the request")),
            }
        };
        let logprobs = req.params.logprobs.map(|_| if chat { m.chat_logprobs_json(&lps) } else { completion_logprobs(&m, &ids, prompt_lps.as_deref(), &lps, echo.as_deref()) });
        choices.push(if chat {
            let (message, finish) = assistant_message(tools.as_ref(), text, json!(finish));
            json!({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish})
        } else {
            json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
        });
    }
    drop(admission);
    let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens});
    let object = if chat { "chat.completion" } else { "text_completion" };
    Ok(Json(json!({"id": id, "object": object, "created": created, "model": m.id, "choices": choices, "usage": usage})).into_response())
}

/// The assistant's message for an answer: its function calls when it makes any (then
/// `finish_reason` "tool_calls" for an answer that ended by itself), else its text.
fn assistant_message(tools: Option<&Tools>, text: String, finish: Value) -> (Value, Value) {
    match tools.and_then(|t| t.calls_in(&text)).filter(|(_, calls)| !calls.is_empty()) {
        Some((content, calls)) => {
            let finish = if finish == "stop" { json!("tool_calls") } else { finish };
            (json!({"role": "assistant", "content": content, "tool_calls": super::tools::calls_json(&calls)}), finish)
        }
        None => (json!({"role": "assistant", "content": text}), finish),
    }
}

/// A held answer as stream deltas: its text, then per call its id and name, then its arguments
/// in fragments that concatenate to the JSON.
fn held_answer_deltas(message: &Value) -> Vec<Value> {
    let mut out = vec![];
    if let Some(text) = message["content"].as_str().filter(|t| !t.is_empty()) {
        out.push(json!({"content": text}));
    }
    for (k, call) in message["tool_calls"].as_array().into_iter().flatten().enumerate() {
        out.push(json!({"tool_calls": [{"index": k, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"], "arguments": ""}}]}));
        let args: Vec<char> = call["function"]["arguments"].as_str().unwrap_or_default().chars().collect();
        for piece in args.chunks(16) {
            out.push(json!({"tool_calls": [{"index": k, "function": {"arguments": piece.iter().collect::<String>()}}]}));
        }
    }
    out
}

/// Completions' `logprobs`: with `echo`, the prompt's tokens first (scored by `prompt`, the
/// first one null), then the generated ones; `text_offset` in characters of the returned text.
fn completion_logprobs(m: &ServedModel, prompt_ids: &[u32], prompt: Option<&[TokenLogprob]>, generated: &[TokenLogprob], echo: Option<&str>) -> Value {
    let start = echo.map_or(0, |e| e.chars().count());
    let gen: Vec<(u32, Option<&TokenLogprob>)> = generated.iter().map(|l| (l.token, Some(l))).collect();
    let (mut out, _) = m.completion_logprobs_json(&gen, start, false);
    if let (Some(_), Some(scored)) = (echo, prompt) {
        let (mut all, _) = m.completion_logprobs_json(&prompt_entries(prompt_ids, scored), 0, true);
        for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            let tail = out[key].as_array().cloned().unwrap_or_default();
            all[key].as_array_mut().expect("an array").extend(tail);
        }
        out = all;
    }
    out
}

/// The prompt's tokens with their scores (`scored[i]` scores token i + 1).
fn prompt_entries<'a>(prompt_ids: &[u32], scored: &'a [TokenLogprob]) -> Vec<(u32, Option<&'a TokenLogprob>)> {
    prompt_ids.iter().enumerate().map(|(i, &id)| (id, i.checked_sub(1).and_then(|j| scored.get(j)))).collect()
}

#[allow(clippy::too_many_arguments)]
fn stream_response(
    m: Arc<ServedModel>,
    admission: Admission,
    receivers: Vec<mpsc::UnboundedReceiver<Event>>,
    id: String,
    created: u64,
    chat: bool,
    // Completions' echo: the prompt text, its ids, and whether its chunk waits for the
    // prompt's scores.
    echo: Option<(String, Vec<u32>, bool)>,
    // A chat answer with functions is held until it is complete, then sent as OpenAI's
    // `delta.tool_calls` chunks (name, then argument fragments) when it is a call, else as text.
    tools: Option<Tools>,
    include_usage: bool,
    prompt_tokens: usize,
    st: Arc<AppState>,
) -> Response {
    let mut held = vec![String::new(); receivers.len()];
    let (out_tx, out_rx) = mpsc::unbounded_channel::<Result<SseEvent, Infallible>>();
    let (merged_tx, mut merged_rx) = mpsc::unbounded_channel::<(usize, Event)>();
    let n = receivers.len();
    for (index, mut rx) in receivers.into_iter().enumerate() {
        let merged = merged_tx.clone();
        tokio::spawn(async move {
            while let Some(ev) = rx.recv().await {
                let done = !matches!(ev, Event::Delta { .. } | Event::PromptLogprobs(_));
                if merged.send((index, ev)).is_err() || done {
                    break;
                }
            }
        });
    }
    drop(merged_tx);
    let model_id = m.id.clone();
    tokio::spawn(async move {
        let _admission = admission;
        let object = if chat { "chat.completion.chunk" } else { "text_completion" };
        let chunk = |choices: Value, usage: Option<Value>| {
            let mut v = json!({"id": id, "object": object, "created": created, "model": model_id, "choices": choices});
            if include_usage {
                v["usage"] = usage.unwrap_or(Value::Null);
            }
            SseEvent::default().data(v.to_string())
        };
        // Chat streams open with the role; completions with `echo` start with the prompt (with
        // its scores, once they come, when logprobs are asked for).
        let start = echo.as_ref().map_or(0, |(e, _, _)| e.chars().count());
        let mut offsets = vec![start; n];
        for index in 0..n {
            let first = if chat {
                Some(json!([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]))
            } else {
                echo.as_ref().filter(|(_, _, scored)| !scored).map(|(e, _, _)| json!([{"index": index, "text": e, "logprobs": null, "finish_reason": null}]))
            };
            if let Some(c) = first {
                if out_tx.send(Ok(chunk(c, None))).is_err() {
                    return;
                }
            }
        }
        let mut finished = 0;
        let mut completion_tokens = 0;
        loop {
            let (index, ev) = tokio::select! {
                got = merged_rx.recv() => match got {
                    Some(got) => got,
                    None => break,
                },
                // The shutdown's grace period is over: end the stream properly.
                _ = st.shutdown.forced() => {
                    st.metrics.stream_error();
                    let _ = out_tx.send(Ok(SseEvent::default().data(ApiError::shutting_down().body().to_string())));
                    let _ = out_tx.send(Ok(SseEvent::default().data("[DONE]")));
                    return;
                }
            };
            let choice = match ev {
                Event::PromptLogprobs(scored) => {
                    let Some((e, ids, _)) = &echo else { continue };
                    let (lp, _) = m.completion_logprobs_json(&prompt_entries(ids, &scored), 0, true);
                    json!({"index": index, "text": e, "logprobs": lp, "finish_reason": null})
                }
                Event::Delta { text, logprob } => {
                    let lp = logprob.map(|l| {
                        if chat {
                            m.chat_logprobs_json(&[l])
                        } else {
                            let (v, next) = m.completion_logprobs_json(&[(l.token, Some(&l))], offsets[index], false);
                            offsets[index] = next;
                            v
                        }
                    });
                    if chat && tools.is_some() {
                        held[index].push_str(&text);
                        if lp.is_none() {
                            continue;
                        }
                        json!({"index": index, "delta": {}, "logprobs": lp, "finish_reason": null})
                    } else if chat {
                        json!({"index": index, "delta": {"content": text}, "logprobs": lp, "finish_reason": null})
                    } else {
                        json!({"index": index, "text": text, "logprobs": lp, "finish_reason": null})
                    }
                }
                Event::Done { finish, completion_tokens: c, .. } => {
                    finished += 1;
                    completion_tokens += c;
                    if let (true, Some(t)) = (chat, &tools) {
                        let (message, finish) = assistant_message(Some(t), std::mem::take(&mut held[index]), json!(finish));
                        for delta in held_answer_deltas(&message) {
                            if out_tx.send(Ok(chunk(json!([{"index": index, "delta": delta, "logprobs": null, "finish_reason": null}]), None))).is_err() {
                                return;
                            }
                        }
                        json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish})
                    } else if chat {
                        json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish})
                    } else {
                        json!({"index": index, "text": "", "logprobs": null, "finish_reason": finish})
                    }
                }
                Event::Error(e) => {
                    st.metrics.stream_error();
                    let _ = out_tx.send(Ok(SseEvent::default().data(ApiError::internal(format!("Generation failed: {e}")).body().to_string())));
                    let _ = out_tx.send(Ok(SseEvent::default().data("[DONE]")));
                    return;
                }
            };
            if out_tx.send(Ok(chunk(json!([choice]), None))).is_err() {
                return; // the client went away: dropping the receivers cancels the sequences
            }
            if finished == n {
                break;
            }
        }
        if include_usage {
            let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens});
            let _ = out_tx.send(Ok(chunk(json!([]), Some(usage))));
        }
        let _ = out_tx.send(Ok(SseEvent::default().data("[DONE]")));
    });
    Sse::new(UnboundedReceiverStream::new(out_rx)).keep_alive(KeepAlive::default()).into_response()
}

pub async fn not_found() -> ApiError {
    ApiError::not_found("No such route.")
}

pub async fn method_not_allowed() -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "Method not allowed on this route.")
}
