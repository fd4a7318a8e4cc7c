//! Anthropic's Messages API shape of an answer: a `message` object whose `content` is blocks
//! (`thinking`, `text`, `tool_use`), with `stop_reason` (`end_turn`, `max_tokens`,
//! `stop_sequence` and the `stop_sequence` that matched, `tool_use`) and `usage`; or the event
//! stream Anthropic's SDKs consume: `message_start`, `ping`, per block `content_block_start`,
//! `content_block_delta` (`thinking_delta` and its `signature_delta`, `text_delta`,
//! `input_json_delta`) and `content_block_stop`, then `message_delta` with the stop reason and
//! usage, and `message_stop`. Errors are Anthropic's `error` event. An `auto` answer streams its
//! text until it opens a call in the model's own format, then its calls (`tool_format`).
//!
//! `usage.input_tokens` counts the prompt tokens not read from the prefix cache and
//! `cache_read_input_tokens` those that were, as Anthropic counts them (their sum is
//! `/v1/messages/count_tokens`' answer).

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::reader::{follow, Followed, Read};
use crate::generate::reasoning;
use crate::generate::FinishReason;
use crate::serve::admission::Submitted;
use crate::serve::call_stream::CallEvent;
use crate::serve::engine::Event;
use crate::serve::error::{AnthropicError, ApiError};
use crate::serve::ids;
use crate::serve::state::AppState;
use crate::serve::tool_format::Piece;
use crate::serve::tools::Tools;
use crate::serve::validate::anthropic::ThinkingBlocks;
use crate::serve::validate::{RequestKind, ValidatedRequest};

/// Anthropic's spelling of ids: `msg_...`, `toolu_...`.
fn new_id(prefix: &str) -> String {
    ids::new_id(prefix).replacen('-', "_", 1)
}

fn thinking_blocks(req: &ValidatedRequest) -> ThinkingBlocks {
    match req.kind {
        RequestKind::Messages { thinking, .. } => thinking,
        _ => unreachable!("a messages request"),
    }
}

fn tool_use(name: &str, arguments: &str) -> Value {
    // The grammar wrote the arguments of a forced call; an `auto` call's were read as JSON.
    let input = serde_json::from_str::<Value>(arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": new_id("toolu"), "name": name, "input": input})
}

/// The blocks of an answer's text after its thinking: its calls (and any text outside them), else
/// its text; a forced call's grammar text is never a text block.
fn answer_blocks(tools: Option<&Tools>, text: &str) -> Vec<Value> {
    match tools.and_then(|t| t.calls_in(text)).filter(|(_, calls)| !calls.is_empty()) {
        Some((outside, calls)) => {
            let text = outside.filter(|t| !t.trim().is_empty()).map(|t| json!({"type": "text", "text": t}));
            text.into_iter().chain(calls.iter().map(|c| tool_use(&c.name, &c.arguments))).collect()
        }
        None if tools.is_some_and(Tools::forces_call) => vec![],
        None => vec![json!({"type": "text", "text": text})],
    }
}

/// `stop_reason` and `stop_sequence`.
fn stop_reason(finish: FinishReason, called: bool, stop_string: Option<&str>) -> (&'static str, Value) {
    match (finish, stop_string) {
        (FinishReason::Length, _) => ("max_tokens", Value::Null),
        _ if called => ("tool_use", Value::Null),
        (FinishReason::Stop, Some(s)) => ("stop_sequence", json!(s)),
        (FinishReason::Stop, None) => ("end_turn", Value::Null),
    }
}

fn usage(prompt_tokens: usize, cached_tokens: usize, output_tokens: usize) -> Value {
    json!({"input_tokens": prompt_tokens - cached_tokens.min(prompt_tokens), "cache_creation_input_tokens": 0,
           "cache_read_input_tokens": cached_tokens, "output_tokens": output_tokens})
}

fn message_object(req: &ValidatedRequest, id: &str, content: Vec<Value>, stop: (Value, Value), usage: Value) -> Value {
    json!({"id": id, "type": "message", "role": "assistant", "model": req.model_id, "content": content,
           "stop_reason": stop.0, "stop_sequence": stop.1, "usage": usage})
}

/// Waits for the answer, then the whole message.
pub async fn whole(st: Arc<AppState>, req: ValidatedRequest, submitted: Submitted) -> Result<Response, ApiError> {
    let Submitted { admission, mut answers, .. } = submitted;
    let mut rx = answers.remove(0);
    let answer = super::collect(&st, &mut rx).await?;
    drop(admission);
    let (thinking, text) = match req.thinking {
        Some(t) => reasoning::split(&answer.text, t.inside()),
        None => (None, answer.text),
    };
    let thought = match thinking_blocks(&req) {
        ThinkingBlocks::None => None,
        ThinkingBlocks::Shown => thinking,
        ThinkingBlocks::Omitted => thinking.map(|_| String::new()),
    };
    let thought = thought.map(|t| json!({"type": "thinking", "thinking": t, "signature": ""}));
    let blocks = answer_blocks(req.kind.tools(), &text);
    let called = blocks.iter().any(|b| b["type"] == "tool_use");
    let (reason, sequence) = stop_reason(answer.finish, called, answer.stop_string.as_deref());
    let usage = usage(req.prompt_ids.len(), answer.cached_tokens, answer.completion_tokens);
    let content = thought.into_iter().chain(blocks).collect();
    Ok(Json(message_object(&req, &new_id("msg"), content, (json!(reason), sequence), usage)).into_response())
}

/// The event stream.
pub fn sse(st: Arc<AppState>, req: ValidatedRequest, submitted: Submitted) -> Response {
    let Submitted { admission, mut answers, .. } = submitted;
    let rx = answers.remove(0);
    let (out_tx, out_rx) = mpsc::unbounded_channel::<Result<SseEvent, Infallible>>();
    tokio::spawn(async move {
        let _admission = admission;
        let mut s = Streamer { out: out_tx, blocks: 0, open: None, called: false };
        s.run(&st, &req, rx).await;
    });
    Sse::new(UnboundedReceiverStream::new(out_rx)).keep_alive(KeepAlive::default()).into_response()
}

/// The kind of block being streamed.
#[derive(Clone, Copy, PartialEq)]
enum Open {
    Thinking,
    Text,
    ToolUse,
}

struct Streamer {
    out: mpsc::UnboundedSender<Result<SseEvent, Infallible>>,
    /// Blocks opened so far (the next one's index).
    blocks: usize,
    open: Option<Open>,
    called: bool,
}

impl Streamer {
    /// Sends event `kind` with `fields` (its `type` added); false when the client is gone.
    fn send(&mut self, kind: &str, mut fields: Value) -> bool {
        fields["type"] = json!(kind);
        self.out.send(Ok(SseEvent::default().event(kind).data(fields.to_string()))).is_ok()
    }

    fn fail(&mut self, st: &AppState, e: ApiError) {
        st.metrics.stream_error();
        self.send("error", AnthropicError(e).body());
    }

    /// Closes the open block (a thinking block gets its signature first: the SDKs expect one).
    fn close(&mut self) -> bool {
        let Some(kind) = self.open.take() else { return true };
        let index = self.blocks - 1;
        if kind == Open::Thinking && !self.delta_at(index, json!({"type": "signature_delta", "signature": ""})) {
            return false;
        }
        self.send("content_block_stop", json!({"index": index}))
    }

    /// Opens `block` of `kind` after closing the open one.
    fn start(&mut self, kind: Open, block: Value) -> bool {
        if !self.close() {
            return false;
        }
        self.called |= kind == Open::ToolUse;
        let index = self.blocks;
        self.blocks += 1;
        self.open = Some(kind);
        self.send("content_block_start", json!({"index": index, "content_block": block}))
    }

    fn delta_at(&mut self, index: usize, delta: Value) -> bool {
        self.send("content_block_delta", json!({"index": index, "delta": delta}))
    }

    /// More of a thinking or text block: continues the open one of that kind, else opens one.
    fn write(&mut self, kind: Open, piece: &str) -> bool {
        if piece.is_empty() {
            return true;
        }
        if self.open != Some(kind) {
            let block = match kind {
                Open::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                _ => json!({"type": "text", "text": ""}),
            };
            if !self.start(kind, block) {
                return false;
            }
        }
        let delta = match kind {
            Open::Thinking => json!({"type": "thinking_delta", "thinking": piece}),
            _ => json!({"type": "text_delta", "text": piece}),
        };
        self.delta_at(self.blocks - 1, delta)
    }

    /// One piece of the answer: thinking into a thinking block (when shown), its text and calls
    /// into text and `tool_use` blocks. False when the client is gone.
    fn piece(&mut self, thinking: ThinkingBlocks, read: Read) -> bool {
        let thought = match thinking {
            ThinkingBlocks::Shown => self.write(Open::Thinking, &read.reasoning),
            ThinkingBlocks::Omitted if !read.reasoning.is_empty() && self.open != Some(Open::Thinking) => {
                self.start(Open::Thinking, json!({"type": "thinking", "thinking": "", "signature": ""}))
            }
            ThinkingBlocks::Omitted | ThinkingBlocks::None => true,
        };
        thought && self.pieces(read.pieces)
    }

    /// Text into a text block, calls into `tool_use` blocks (their input as `input_json_delta`s).
    fn pieces(&mut self, pieces: Vec<Piece>) -> bool {
        pieces.into_iter().all(|p| match p {
            Piece::Call(CallEvent::Start { name, .. }) => {
                self.start(Open::ToolUse, json!({"type": "tool_use", "id": new_id("toolu"), "name": name, "input": {}}))
            }
            Piece::Call(CallEvent::Args { fragment, .. }) => {
                self.delta_at(self.blocks - 1, json!({"type": "input_json_delta", "partial_json": fragment}))
            }
            Piece::Text(text) => self.write(Open::Text, &text),
        })
    }

    async fn run(&mut self, st: &AppState, req: &ValidatedRequest, rx: mpsc::UnboundedReceiver<Event>) {
        let id = new_id("msg");
        let start = message_object(req, &id, vec![], (Value::Null, Value::Null), usage(req.prompt_ids.len(), 0, 0));
        if !(self.send("message_start", json!({"message": start})) && self.send("ping", json!({}))) {
            return;
        }
        let show = thinking_blocks(req);
        let done = match follow(st, req, rx, |read| self.piece(show, read)).await {
            Followed::Done(done) => done,
            Followed::ClientGone => return,
            Followed::Failed(e) => return self.fail(st, e),
        };
        let (finish, output_tokens, cached_tokens, stop_string) =
            (done.finish, done.completion_tokens, done.cached_tokens, done.stop_string);
        if !self.close() {
            return;
        }
        let (reason, sequence) = stop_reason(finish, self.called, stop_string.as_deref());
        let usage = usage(req.prompt_ids.len(), cached_tokens, output_tokens);
        let _ = self.send("message_delta", json!({"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage}))
            && self.send("message_stop", json!({}));
    }
}
