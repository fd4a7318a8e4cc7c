//! The SSE stream of a generation: chunks as tokens come, `data: [DONE]` at the end, and an
//! error event then `[DONE]` when the engine fails or the shutdown's grace period ends.
//!
//! Chat streams open with the role; completions with `echo` start with the prompt (with its
//! scores, once they come, when logprobs are asked for). A forced call (`tool_choice` required
//! or a named function) streams as OpenAI and vLLM stream it: a call's first `delta.tool_calls`
//! chunk carries its index, id, type and name as soon as the name is complete, then argument
//! fragments as they are generated (see `call_stream`). An `auto` answer with functions streams
//! its text as `delta.content` until it opens a call in the model's own format, then its calls
//! the same way (see `tool_format`).

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::reader::AnswerReader;
use super::{logprobs, names, Batch, Tally};
use crate::serve::call_stream::CallEvent;
use crate::serve::engine::Event;
use crate::serve::error::ApiError;
use crate::serve::state::AppState;
use crate::serve::tool_format::Piece;
use crate::serve::validate::{RequestKind, ValidatedRequest};

type Sender = mpsc::UnboundedSender<Result<SseEvent, Infallible>>;

/// The stream of a batch's answers (one request's, unless completions got a list of prompts):
/// each request's chunks as they come, its choices numbered after the previous requests', then
/// one usage chunk for them all and `[DONE]`. The first failure ends the whole stream.
pub fn sse(st: Arc<AppState>, batch: Batch) -> Response {
    let (out_tx, out_rx) = mpsc::unbounded_channel();
    let (id, object) = names(&batch[0].0.kind, true);
    let (model, include_usage) = (batch[0].0.model_id.clone(), batch[0].0.include_usage);
    let head = Head { id, object, created: crate::serve::ids::now_s(), model, include_usage };
    let mut streams = JoinSet::new();
    let mut first_index = 0;
    for (req, submitted) in batch {
        let (st, out, head) = (st.clone(), out_tx.clone(), head.clone());
        let n = submitted.answers.len();
        streams.spawn(async move {
            let _admission = submitted.admission;
            Streamer::new(&req, n, out, head, first_index).run(&st, merged(submitted.answers)).await
        });
        first_index += n;
    }
    tokio::spawn(async move {
        let mut tally = Tally::default();
        while let Some(ended) = streams.join_next().await {
            let error = match ended {
                Ok(Ok(counted)) => {
                    tally.add(counted);
                    continue;
                }
                Ok(Err(Stop::ClientGone)) => None,
                Ok(Err(Stop::Failed(e))) => Some(e),
                Err(e) => Some(ApiError::internal(format!("a stream's task ended: {e}"))),
            };
            // Dropping the other requests' receivers cancels their sequences.
            streams.abort_all();
            if let Some(e) = error {
                fail(&st, &out_tx, e);
            }
            return;
        }
        if head.include_usage {
            let _ = out_tx.send(Ok(head.chunk(json!([]), Some(tally.usage()))));
        }
        let _ = out_tx.send(Ok(SseEvent::default().data("[DONE]")));
    });
    Sse::new(UnboundedReceiverStream::new(out_rx)).keep_alive(KeepAlive::default()).into_response()
}

/// One request's answers' events, merged in arrival order, each with its answer's index.
fn merged(answers: Vec<mpsc::UnboundedReceiver<Event>>) -> mpsc::UnboundedReceiver<(usize, Event)> {
    let (merged_tx, merged_rx) = mpsc::unbounded_channel();
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
    merged_rx
}

/// An error event, then `[DONE]`.
fn fail(st: &AppState, out: &Sender, error: ApiError) {
    st.metrics.stream_error();
    let _ = out.send(Ok(SseEvent::default().data(error.body().to_string())));
    let _ = out.send(Ok(SseEvent::default().data("[DONE]")));
}

/// What every chunk of a response repeats.
#[derive(Clone)]
struct Head {
    id: String,
    object: &'static str,
    created: i64,
    /// The `model` the request named.
    model: String,
    include_usage: bool,
}

impl Head {
    fn chunk(&self, choices: Value, usage: Option<Value>) -> SseEvent {
        let mut v = json!({"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": choices});
        if self.include_usage {
            v["usage"] = usage.unwrap_or(Value::Null);
        }
        SseEvent::default().data(v.to_string())
    }
}

/// Why a request's stream ended before its answers did.
enum Stop {
    /// The client is gone: nothing more to send.
    ClientGone,
    /// The engine failed, or the shutdown's grace period ended: the stream ends with the error.
    Failed(ApiError),
}

/// One request's stream: where each of its answers is.
struct Streamer<'a> {
    req: &'a ValidatedRequest,
    out: Sender,
    head: Head,
    /// The choice index of this request's first answer in the response.
    first_index: usize,
    n: usize,
    /// Each answer read as it streams: thinking, text, calls.
    readers: Vec<AnswerReader>,
    /// How many calls each answer has shown.
    shown: Vec<usize>,
    /// Where each completion answer's next token begins in its text (`text_offset`).
    offsets: Vec<usize>,
}

impl<'a> Streamer<'a> {
    fn new(req: &'a ValidatedRequest, n: usize, out: Sender, head: Head, first_index: usize) -> Self {
        let start = match &req.kind {
            RequestKind::Completion { echo: Some(e) } => e.chars().count(),
            _ => 0,
        };
        let readers = (0..n).map(|_| AnswerReader::new(req)).collect();
        let (shown, offsets) = (vec![0; n], vec![start; n]);
        Self { req, out, head, first_index, n, readers, shown, offsets }
    }

    /// Sends a chunk of one choice, given by its answer's index in this request; false when
    /// the client is gone (dropping the receivers then cancels the sequences).
    fn send(&self, mut choice: Value) -> bool {
        let index = choice["index"].as_u64().expect("every choice has its index") as usize;
        choice["index"] = json!(self.first_index + index);
        self.out.send(Ok(self.head.chunk(json!([choice]), None))).is_ok()
    }

    /// A call event as a `delta.tool_calls` chunk of answer `index` (the call's first carries
    /// its id, type and name).
    fn call_chunk(&mut self, index: usize, event: CallEvent) -> Value {
        let delta = match event {
            CallEvent::Start { index: k, name } => {
                self.shown[index] += 1;
                let id = self.req.model.tool_format.call_id();
                json!({"tool_calls": [{"index": k, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]})
            }
            CallEvent::Args { index: k, fragment } => json!({"tool_calls": [{"index": k, "function": {"arguments": fragment}}]}),
        };
        json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": null})
    }

    /// Sends an `auto` answer's pieces: text as content, calls as tool_calls; false when the
    /// client is gone.
    fn send_pieces(&mut self, index: usize, pieces: Vec<Piece>) -> bool {
        pieces.into_iter().all(|p| {
            let chunk = match p {
                Piece::Text(t) => json!({"index": index, "delta": {"content": t}, "logprobs": null, "finish_reason": null}),
                Piece::Call(e) => self.call_chunk(index, e),
            };
            self.send(chunk)
        })
    }

    /// Streams the answers until they are done: their token counts, or why they stopped.
    async fn run(mut self, st: &AppState, mut events: mpsc::UnboundedReceiver<(usize, Event)>) -> Result<Tally, Stop> {
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
                RequestKind::Responses { .. } | RequestKind::Messages { .. } | RequestKind::LlamaCpp(_) | RequestKind::Ollama { .. } => {
                    unreachable!(
                        "/v1/responses, /v1/messages and /completion stream their own events (response::responses, anthropic, llama_cpp)"
                    )
                }
            };
            if first.is_some_and(|c| !self.send(c)) {
                return Err(Stop::ClientGone);
            }
        }
        let mut tally = Tally::of(self.req);
        let mut finished = 0;
        loop {
            let (index, ev) = tokio::select! {
                got = events.recv() => match got {
                    Some(got) => got,
                    None => break,
                },
                // The shutdown's grace period is over: end the stream properly.
                _ = st.shutdown.forced() => return Err(Stop::Failed(ApiError::shutting_down())),
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
                Event::Delta { text, logprob, .. } => {
                    let read = self.readers[index].push(text);
                    if !self.send_reasoning(index, read.reasoning) {
                        return Err(Stop::ClientGone);
                    }
                    match self.delta(index, read.pieces, logprob) {
                        Some(c) => c,
                        None => continue,
                    }
                }
                Event::Done { finish, completion_tokens: c, cached_tokens: cached, reasoning_tokens: r, .. } => {
                    finished += 1;
                    tally.completion_tokens += c;
                    // The answers share the prompt: its cached part is counted once.
                    tally.cached_tokens = tally.cached_tokens.max(cached);
                    tally.reasoning_tokens = tally.reasoning_tokens.map(|t| t + r);
                    // What the reader held back: no tag or call opening can complete any more.
                    let read = self.readers[index].finish();
                    if !self.send_reasoning(index, read.reasoning) {
                        return Err(Stop::ClientGone);
                    }
                    if let Some(c) = self.delta(index, read.pieces, None) {
                        if !self.send(c) {
                            return Err(Stop::ClientGone);
                        }
                    }
                    match self.end(index, json!(finish)) {
                        Some(c) => c,
                        None => return Err(Stop::ClientGone),
                    }
                }
                ev @ (Event::Error(_) | Event::QueueTimeout { .. }) => return Err(Stop::Failed(super::failure(&ev))),
            };
            if !self.send(choice) {
                return Err(Stop::ClientGone);
            }
            if finished == self.n {
                break;
            }
        }
        Ok(tally)
    }

    /// Sends a reasoning model's thinking as a delta chunk, under both of the whole answer's
    /// names (`reasoning_content`, `reasoning`; none when empty); false when the client is gone.
    fn send_reasoning(&mut self, index: usize, reasoning: String) -> bool {
        let delta = json!({"reasoning_content": reasoning, "reasoning": reasoning});
        reasoning.is_empty() || self.send(json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": null}))
    }

    /// The chunk of a token's pieces (None: nothing more to send now). One piece of text is one
    /// chunk with the token's log-probabilities; calls (and text beside them) go out as their own
    /// chunks, the log-probabilities after them.
    fn delta(&mut self, index: usize, pieces: Vec<Piece>, logprob: Option<crate::generate::TokenLogprob>) -> Option<Value> {
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
        let lp_only = |lp: Option<Value>| lp.map(|lp| json!({"index": index, "delta": {}, "logprobs": lp, "finish_reason": null}));
        match &pieces[..] {
            [] if chat => lp_only(lp),
            [] => lp.map(|lp| json!({"index": index, "text": "", "logprobs": lp, "finish_reason": null})),
            [Piece::Text(text)] if chat => Some(json!({"index": index, "delta": {"content": text}, "logprobs": lp, "finish_reason": null})),
            [Piece::Text(text)] => Some(json!({"index": index, "text": text, "logprobs": lp, "finish_reason": null})),
            _ => {
                if !self.send_pieces(index, pieces) {
                    return None;
                }
                lp_only(lp)
            }
        }
    }

    /// The last chunk of an answer, after its held text or calls (None: the client is gone).
    fn end(&mut self, index: usize, finish: Value) -> Option<Value> {
        match &self.req.kind {
            RequestKind::Chat { tools: Some(t) } if t.forces_call() => {
                let finish = if self.shown[index] > 0 && finish == "stop" { json!("tool_calls") } else { finish };
                Some(json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish}))
            }
            RequestKind::Chat { tools: Some(_) } => {
                let finish = if self.shown[index] > 0 && finish == "stop" { json!("tool_calls") } else { finish };
                Some(json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish}))
            }
            RequestKind::Chat { tools: None } => Some(json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish})),
            RequestKind::Completion { .. } => Some(json!({"index": index, "text": "", "logprobs": null, "finish_reason": finish})),
            RequestKind::Responses { .. } | RequestKind::Messages { .. } | RequestKind::LlamaCpp(_) | RequestKind::Ollama { .. } => {
                unreachable!(
                    "/v1/responses, /v1/messages and /completion stream their own events (response::responses, anthropic, llama_cpp)"
                )
            }
        }
    }
}
