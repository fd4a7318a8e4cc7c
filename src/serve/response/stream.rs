//! The SSE stream of a generation: chunks as tokens come, `data: [DONE]` at the end, and an
//! error event then `[DONE]` when the engine fails or the shutdown's grace period ends.
//!
//! Chat streams open with the role; completions with `echo` start with the prompt (with its
//! scores, once they come, when logprobs are asked for). A forced call (`tool_choice` required
//! or a named function) streams as OpenAI and vLLM stream it: a call's first `delta.tool_calls`
//! chunk carries its index, id, type and name as soon as the name is complete, then argument
//! fragments as they are generated (see `call_stream`). An `auto` answer with functions may be
//! text or calls, so it is held until complete, then sent as calls (id and name, then argument
//! fragments) or as text.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::{assistant_message, logprobs, names, usage};
use crate::generate::reasoning::{Split, ThinkSplit};
use crate::serve::admission::Submitted;
use crate::serve::call_stream::{CallEvent, CallStream};
use crate::serve::engine::Event;
use crate::serve::error::ApiError;
use crate::serve::state::AppState;
use crate::serve::tools::{self, Tools};
use crate::serve::validate::{RequestKind, ValidatedRequest};

type Sender = mpsc::UnboundedSender<Result<SseEvent, Infallible>>;

pub fn sse(st: Arc<AppState>, req: ValidatedRequest, submitted: Submitted) -> Response {
    let Submitted { admission, answers } = submitted;
    let n = answers.len();
    let (out_tx, out_rx) = mpsc::unbounded_channel();
    // The answers' events, merged in arrival order.
    let (merged_tx, merged_rx) = mpsc::unbounded_channel::<(usize, Event)>();
    for (index, mut rx) in answers.into_iter().enumerate() {
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
    tokio::spawn(async move {
        let _admission = admission;
        Streamer::new(&req, n, out_tx).run(&st, merged_rx).await;
    });
    Sse::new(UnboundedReceiverStream::new(out_rx)).keep_alive(KeepAlive::default()).into_response()
}

/// One stream's state: where each answer is, and the chunks' common fields.
struct Streamer<'a> {
    req: &'a ValidatedRequest,
    out: Sender,
    id: String,
    object: &'static str,
    created: i64,
    n: usize,
    /// Each answer's text so far, for an `auto` chat answer with functions (held to the end).
    held: Vec<String>,
    /// Each answer's forced calls as they are generated (None unless the choice forces a call),
    /// and how many it has shown.
    calls: Vec<Option<CallStream>>,
    shown: Vec<usize>,
    /// Where each completion answer's next token begins in its text (`text_offset`).
    offsets: Vec<usize>,
    /// Each chat answer's thinking split from its answer, for a reasoning model.
    thinking: Vec<Option<ThinkSplit>>,
}

impl<'a> Streamer<'a> {
    fn new(req: &'a ValidatedRequest, n: usize, out: Sender) -> Self {
        let (id, object) = names(&req.kind, true);
        let start = match &req.kind {
            RequestKind::Completion { echo: Some(e) } => e.chars().count(),
            _ => 0,
        };
        let calls = (0..n).map(|_| forced(req).and_then(Tools::call_stream)).collect();
        let (held, shown, offsets) = (vec![String::new(); n], vec![0; n], vec![start; n]);
        let thinking = (0..n).map(|_| req.thinking.map(|t| ThinkSplit::new(t.inside()))).collect();
        Self { req, out, id, object, created: crate::serve::ids::now_s(), n, held, calls, shown, offsets, thinking }
    }

    fn chunk(&self, choices: Value, usage: Option<Value>) -> SseEvent {
        let mut v = json!({"id": self.id, "object": self.object, "created": self.created, "model": self.req.model_id, "choices": choices});
        if self.req.include_usage {
            v["usage"] = usage.unwrap_or(Value::Null);
        }
        SseEvent::default().data(v.to_string())
    }

    /// Sends a chunk of one choice; false when the client is gone (dropping the receivers then
    /// cancels the sequences).
    fn send(&self, choice: Value) -> bool {
        self.out.send(Ok(self.chunk(json!([choice]), None))).is_ok()
    }

    /// An error event, then `[DONE]`.
    fn fail(&self, st: &AppState, error: ApiError) {
        st.metrics.stream_error();
        let _ = self.out.send(Ok(SseEvent::default().data(error.body().to_string())));
        let _ = self.out.send(Ok(SseEvent::default().data("[DONE]")));
    }

    /// An `auto` answer with functions: held to the end.
    fn holds_calls(&self) -> bool {
        matches!(&self.req.kind, RequestKind::Chat { tools: Some(t) } if !t.forces_call())
    }

    async fn run(mut self, st: &AppState, mut events: mpsc::UnboundedReceiver<(usize, Event)>) {
        for index in 0..self.n {
            let first = match &self.req.kind {
                RequestKind::Chat { .. } => {
                    Some(json!({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))
                }
                // Scored echo waits for the prompt's scores.
                RequestKind::Completion { echo: Some(e) } if self.req.params.prompt_logprobs.is_none() => {
                    Some(json!({"index": index, "text": e, "logprobs": null, "finish_reason": null}))
                }
                RequestKind::Completion { .. } => None,
                RequestKind::Responses { .. } | RequestKind::Messages { .. } => {
                    unreachable!("/v1/responses and /v1/messages stream their own events (response::responses, response::anthropic)")
                }
            };
            if first.is_some_and(|c| !self.send(c)) {
                return;
            }
        }
        let (mut finished, mut completion_tokens, mut cached_tokens, mut reasoning_tokens) = (0, 0, 0, 0);
        loop {
            let (index, ev) = tokio::select! {
                got = events.recv() => match got {
                    Some(got) => got,
                    None => break,
                },
                // The shutdown's grace period is over: end the stream properly.
                _ = st.shutdown.forced() => return self.fail(st, ApiError::shutting_down()),
            };
            let choice = match ev {
                Event::PromptLogprobs(scored) => {
                    let RequestKind::Completion { echo: Some(e) } = &self.req.kind else { continue };
                    let (lp, _) = logprobs::completion_entries(
                        &self.req.model.tokenizer,
                        &logprobs::prompt_entries(&self.req.prompt_ids, &scored),
                        0,
                        true,
                    );
                    json!({"index": index, "text": e, "logprobs": lp, "finish_reason": null})
                }
                Event::Delta { text, logprob } => {
                    let Some(text) = self.past_thinking(index, text, false) else { return };
                    if text.is_empty() && logprob.is_none() {
                        continue;
                    }
                    match self.delta(index, text, logprob) {
                        Some(c) => c,
                        None => continue,
                    }
                }
                Event::Done { finish, completion_tokens: c, cached_tokens: cached, reasoning_tokens: r, .. } => {
                    finished += 1;
                    completion_tokens += c;
                    cached_tokens = cached_tokens.max(cached);
                    reasoning_tokens += r;
                    // What the split held back: no tag can complete any more.
                    let Some(rest) = self.past_thinking(index, String::new(), true) else { return };
                    if !rest.is_empty() {
                        if let Some(c) = self.delta(index, rest, None) {
                            if !self.send(c) {
                                return;
                            }
                        }
                    }
                    match self.end(index, json!(finish)) {
                        Some(c) => c,
                        None => return,
                    }
                }
                ev @ (Event::Error(_) | Event::QueueTimeout { .. }) => return self.fail(st, super::failure(&ev)),
            };
            if !self.send(choice) {
                return;
            }
            if finished == self.n {
                break;
            }
        }
        if self.req.include_usage {
            let reasoning = self.req.thinking.map(|_| reasoning_tokens);
            let _ = self
                .out
                .send(Ok(self.chunk(json!([]), Some(usage(self.req.prompt_ids.len(), cached_tokens, completion_tokens, reasoning)))));
        }
        let _ = self.out.send(Ok(SseEvent::default().data("[DONE]")));
    }

    /// For a reasoning model's answer: sends the thinking in `text` (with `end`, in what was
    /// held back: the answer is over) as a `delta.reasoning_content` chunk and returns the
    /// answer's part; `text` itself otherwise. None when the client is gone.
    fn past_thinking(&mut self, index: usize, text: String, end: bool) -> Option<String> {
        let Some(t) = self.thinking[index].as_mut() else { return Some(text) };
        let Split { reasoning, content } = if end { t.finish() } else { t.push(&text) };
        if !reasoning.is_empty() {
            let chunk = json!({"index": index, "delta": {"reasoning_content": reasoning}, "logprobs": null, "finish_reason": null});
            if !self.send(chunk) {
                return None;
            }
        }
        Some(content)
    }

    /// The chunk of a token (None: nothing to send now, the text being held).
    fn delta(&mut self, index: usize, text: String, logprob: Option<crate::generate::TokenLogprob>) -> Option<Value> {
        let tokenizer = &self.req.model.tokenizer;
        let chat = self.req.kind.is_chat();
        let lp = logprob.map(|l| {
            if chat {
                logprobs::chat(tokenizer, &[l])
            } else {
                let (v, next) = logprobs::completion_entries(tokenizer, &[(l.token, Some(&l))], self.offsets[index], false);
                self.offsets[index] = next;
                v
            }
        });
        if let Some(calls) = self.calls[index].as_mut() {
            for event in calls.push(&text) {
                let delta = match event {
                    CallEvent::Start { index: k, name } => {
                        self.shown[index] += 1;
                        json!({"tool_calls": [{"index": k, "id": tools::new_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}]})
                    }
                    CallEvent::Args { index: k, fragment } => json!({"tool_calls": [{"index": k, "function": {"arguments": fragment}}]}),
                };
                if !self.send(json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": null})) {
                    return None;
                }
            }
            return lp.map(|lp| json!({"index": index, "delta": {}, "logprobs": lp, "finish_reason": null}));
        }
        if self.holds_calls() {
            self.held[index].push_str(&text);
            return lp.map(|lp| json!({"index": index, "delta": {}, "logprobs": lp, "finish_reason": null}));
        }
        Some(if chat {
            json!({"index": index, "delta": {"content": text}, "logprobs": lp, "finish_reason": null})
        } else {
            json!({"index": index, "text": text, "logprobs": lp, "finish_reason": null})
        })
    }

    /// The last chunk of an answer, after its held text or calls (None: the client is gone).
    fn end(&mut self, index: usize, finish: Value) -> Option<Value> {
        match &self.req.kind {
            RequestKind::Chat { tools: Some(t) } if t.forces_call() => {
                let finish = if self.shown[index] > 0 && finish == "stop" { json!("tool_calls") } else { finish };
                Some(json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish}))
            }
            RequestKind::Chat { tools: Some(t) } => {
                let (message, finish) = assistant_message(Some(t), std::mem::take(&mut self.held[index]), finish);
                for delta in held_answer_deltas(&message) {
                    if !self.send(json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": null})) {
                        return None;
                    }
                }
                Some(json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish}))
            }
            RequestKind::Chat { tools: None } => Some(json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish})),
            RequestKind::Completion { .. } => Some(json!({"index": index, "text": "", "logprobs": null, "finish_reason": finish})),
            RequestKind::Responses { .. } | RequestKind::Messages { .. } => {
                unreachable!("/v1/responses and /v1/messages stream their own events (response::responses, response::anthropic)")
            }
        }
    }
}

/// The request's functions when its choice forces a call.
fn forced(req: &ValidatedRequest) -> Option<&Tools> {
    match &req.kind {
        RequestKind::Chat { tools: Some(t) } if t.forces_call() => Some(t),
        _ => None,
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
