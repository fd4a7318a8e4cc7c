//! The Responses API's shape of an answer: output items (an assistant `message` with its
//! `output_text`, `function_call`s), the `response` object with `usage`, and the typed event
//! stream the official client and the Agents SDK consume (`response.created`,
//! `response.output_item.added`, `response.output_text.delta`,
//! `response.function_call_arguments.delta`/`.done`, `response.output_item.done`,
//! `response.completed`, each with its `sequence_number`). A reasoning model's thinking is a
//! `reasoning` item before the answer's (`response.reasoning_text.delta`/`.done` as it streams).

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
use crate::serve::error::ApiError;
use crate::serve::ids;
use crate::serve::state::AppState;
use crate::serve::tool_format::{Piece, ToolFormat};
use crate::serve::tools::Tools;
use crate::serve::validate::{RequestKind, ValidatedRequest};

/// An id with OpenAI's spelling for response objects (`resp_...`, `msg_...`, `fc_...`).
fn item_id(prefix: &str) -> String {
    ids::new_id(prefix).replacen('-', "_", 1)
}

fn tools_of(req: &ValidatedRequest) -> Option<&Tools> {
    req.kind.tools()
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
}

fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "reasoning", "id": id, "status": status, "summary": [], "content": [{"type": "reasoning_text", "text": text}]})
}

fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": arguments, "status": status})
}

/// The items of a finished answer: its calls (and any text outside them), else its text; a forced
/// call's grammar text is never a message.
fn output_items(tools: Option<&Tools>, text: &str) -> Vec<Value> {
    match tools.and_then(|t| t.calls_in(text)).filter(|(_, calls)| !calls.is_empty()) {
        Some((outside, calls)) => {
            let message = outside.map(|t| message_item(&item_id("msg"), &t, "completed"));
            let calls = calls
                .iter()
                .map(|c| call_item(&item_id("fc"), &tools.map(Tools::new_call_id).unwrap_or_default(), &c.name, &c.arguments, "completed"));
            message.into_iter().chain(calls).collect()
        }
        None if tools.is_some_and(Tools::forces_call) => vec![],
        None => vec![message_item(&item_id("msg"), text, "completed")],
    }
}

/// How an answer ended: why, its tokens, its prompt's cached tokens and its thinking's tokens.
type Finish = (FinishReason, usize, usize, usize);

/// The `response` object: `output` so far, `finish` when done (None: in progress).
fn response_object(req: &ValidatedRequest, id: &str, created: i64, output: Vec<Value>, finish: Option<Finish>) -> Value {
    let RequestKind::Responses { echo, .. } = &req.kind else { unreachable!("a responses request") };
    let e = |k: &str| echo.0.get(k).cloned().unwrap_or(Value::Null);
    let or = |k: &str, default: Value| Some(e(k)).filter(|v| !v.is_null()).unwrap_or(default);
    let (status, incomplete, usage) = match finish {
        None => ("in_progress", Value::Null, Value::Null),
        Some((reason, completion, cached, reasoning)) => {
            let prompt = req.prompt_ids.len();
            let usage = json!({"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
                               "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": prompt + completion});
            match reason {
                FinishReason::Length => ("incomplete", json!({"reason": "max_output_tokens"}), usage),
                FinishReason::Stop => ("completed", Value::Null, usage),
            }
        }
    };
    json!({
        "id": id, "object": "response", "created_at": created, "status": status, "error": null, "incomplete_details": incomplete,
        "instructions": e("instructions"), "max_output_tokens": e("max_output_tokens"), "model": req.model_id, "output": output,
        "parallel_tool_calls": or("parallel_tool_calls", json!(true)), "previous_response_id": null,
        "reasoning": {"effort": null, "summary": null}, "store": false, "temperature": or("temperature", json!(req.params.temperature)),
        "text": or("text", json!({"format": {"type": "text"}})), "tool_choice": or("tool_choice", json!("auto")),
        "tools": or("tools", json!([])), "top_p": or("top_p", json!(req.params.top_p.unwrap_or(1.0))), "truncation": "disabled",
        "usage": usage, "user": e("user"), "metadata": or("metadata", json!({})),
    })
}

/// Waits for the answer, then the whole `response` object.
pub async fn whole(st: Arc<AppState>, req: ValidatedRequest, submitted: Submitted) -> Result<Response, ApiError> {
    let Submitted { admission, mut answers, .. } = submitted;
    let mut rx = answers.remove(0);
    let answer = super::collect(&st, &mut rx).await?;
    drop(admission);
    let (thinking, text) = match req.thinking {
        Some(t) => reasoning::split(&answer.text, t.inside()),
        None => (None, answer.text),
    };
    let thought = thinking.map(|t| reasoning_item(&item_id("rs"), &t, "completed"));
    let output = thought.into_iter().chain(output_items(tools_of(&req), &text)).collect();
    let finish = Some((answer.finish, answer.completion_tokens, answer.cached_tokens, answer.reasoning_tokens));
    Ok(Json(response_object(&req, &item_id("resp"), ids::now_s(), output, finish)).into_response())
}

/// The typed event stream.
pub fn sse(st: Arc<AppState>, req: ValidatedRequest, submitted: Submitted) -> Response {
    let Submitted { admission, mut answers, .. } = submitted;
    let rx = answers.remove(0);
    let (out_tx, out_rx) = mpsc::unbounded_channel::<Result<SseEvent, Infallible>>();
    tokio::spawn(async move {
        let _admission = admission;
        let format = req.model.tool_format;
        let mut s = Streamer { out: out_tx, seq: 0, id: item_id("resp"), created: ids::now_s(), items: vec![], format };
        s.run(&st, &req, rx).await;
    });
    Sse::new(UnboundedReceiverStream::new(out_rx)).keep_alive(KeepAlive::default()).into_response()
}

/// An output item being streamed.
enum Item {
    Reasoning { id: String, text: String },
    Message { id: String, text: String },
    Call { id: String, call_id: String, name: String, arguments: String },
}

/// The answer's open message and thinking items.
struct Answer {
    message: Option<usize>,
    thinking: Option<usize>,
}

struct Streamer {
    out: mpsc::UnboundedSender<Result<SseEvent, Infallible>>,
    seq: u64,
    id: String,
    created: i64,
    items: Vec<Item>,
    /// The model's call format (call ids take its form).
    format: ToolFormat,
}

impl Streamer {
    /// Sends event `kind` with `fields` (its `type` and `sequence_number` added); false when the
    /// client is gone.
    fn send(&mut self, kind: &str, mut fields: Value) -> bool {
        fields["type"] = json!(kind);
        fields["sequence_number"] = json!(self.seq);
        self.seq += 1;
        self.out.send(Ok(SseEvent::default().event(kind).data(fields.to_string()))).is_ok()
    }

    fn fail(&mut self, st: &AppState, e: ApiError) {
        st.metrics.stream_error();
        let body = e.body();
        self.send("error", json!({"code": body["error"]["code"], "message": body["error"]["message"], "param": body["error"]["param"]}));
    }

    fn item_json(item: &Item, status: &str) -> Value {
        match item {
            Item::Reasoning { id, text } => reasoning_item(id, text, status),
            Item::Message { id, text } => message_item(id, text, status),
            Item::Call { id, call_id, name, arguments } => call_item(id, call_id, name, arguments, status),
        }
    }

    /// Opens an item (and a message's text part); returns its output index.
    fn open(&mut self, item: Item) -> Option<usize> {
        let index = self.items.len();
        let mut added = Self::item_json(&item, "in_progress");
        if let Item::Reasoning { .. } = &item {
            added["content"] = json!([]);
        }
        if let Item::Message { id, .. } = &item {
            added["content"] = json!([]);
            let part = json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
            let id = id.clone();
            self.items.push(item);
            let ok = self.send("response.output_item.added", json!({"output_index": index, "item": added}))
                && self
                    .send("response.content_part.added", json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}));
            return ok.then_some(index);
        }
        self.items.push(item);
        self.send("response.output_item.added", json!({"output_index": index, "item": added})).then_some(index)
    }

    /// More text of item `index` (a message's text or a call's arguments).
    fn delta(&mut self, index: usize, piece: &str) -> bool {
        match &mut self.items[index] {
            Item::Reasoning { id, text } => {
                text.push_str(piece);
                let id = id.clone();
                self.send(
                    "response.reasoning_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "delta": piece}),
                )
            }
            Item::Message { id, text } => {
                text.push_str(piece);
                let id = id.clone();
                self.send(
                    "response.output_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "delta": piece, "logprobs": []}),
                )
            }
            Item::Call { id, arguments, .. } => {
                arguments.push_str(piece);
                let id = id.clone();
                self.send("response.function_call_arguments.delta", json!({"item_id": id, "output_index": index, "delta": piece}))
            }
        }
    }

    /// Closes every item opened, in order.
    fn close_all(&mut self) -> bool {
        for index in 0..self.items.len() {
            let done = Self::item_json(&self.items[index], "completed");
            let ok = match &self.items[index] {
                Item::Reasoning { id, text } => {
                    let (id, text) = (id.clone(), text.clone());
                    self.send(
                        "response.reasoning_text.done",
                        json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                    )
                }
                Item::Message { id, text } => {
                    let part = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                    let (id, text) = (id.clone(), text.clone());
                    self.send(
                        "response.output_text.done",
                        json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
                    ) && self
                        .send("response.content_part.done", json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}))
                }
                Item::Call { id, arguments, .. } => {
                    let (id, arguments) = (id.clone(), arguments.clone());
                    self.send(
                        "response.function_call_arguments.done",
                        json!({"item_id": id, "output_index": index, "arguments": arguments}),
                    )
                }
            };
            if !(ok && self.send("response.output_item.done", json!({"output_index": index, "item": done}))) {
                return false;
            }
        }
        true
    }

    /// One piece of the answer: its thinking into the reasoning item, its text and calls into
    /// the message and call items. False when the client is gone.
    fn answer_piece(&mut self, a: &mut Answer, read: Read) -> bool {
        if !read.reasoning.is_empty() {
            let index = match a.thinking {
                Some(i) => Some(i),
                None => self.open(Item::Reasoning { id: item_id("rs"), text: String::new() }),
            };
            a.thinking = index;
            if !index.is_some_and(|i| self.delta(i, &read.reasoning)) {
                return false;
            }
        }
        self.pieces(a, read.pieces)
    }

    /// Text into the message item (opened on its first text), calls into call items. False when
    /// the client is gone.
    fn pieces(&mut self, a: &mut Answer, pieces: Vec<Piece>) -> bool {
        pieces.into_iter().all(|p| match p {
            Piece::Call(CallEvent::Start { name, .. }) => {
                let call_id = self.format.call_id();
                self.open(Item::Call { id: item_id("fc"), call_id, name, arguments: String::new() }).is_some()
            }
            Piece::Call(CallEvent::Args { index, fragment }) => {
                let at = self.items.iter().enumerate().filter(|(_, i)| matches!(i, Item::Call { .. })).nth(index).map(|(k, _)| k);
                at.is_some_and(|k| self.delta(k, &fragment))
            }
            Piece::Text(text) if text.is_empty() => true,
            Piece::Text(text) => {
                let index = match a.message {
                    Some(i) => Some(i),
                    None => self.open(Item::Message { id: item_id("msg"), text: String::new() }),
                };
                a.message = index;
                index.is_some_and(|i| self.delta(i, &text))
            }
        })
    }

    async fn run(&mut self, st: &AppState, req: &ValidatedRequest, rx: mpsc::UnboundedReceiver<Event>) {
        let start = response_object(req, &self.id, self.created, vec![], None);
        if !(self.send("response.created", json!({"response": start})) && self.send("response.in_progress", json!({"response": start}))) {
            return;
        }
        let mut answer = Answer { message: None, thinking: None };
        let done = match follow(st, req, rx, |read| self.answer_piece(&mut answer, read)).await {
            Followed::Done(done) => done,
            Followed::ClientGone => return,
            Followed::Failed(e) => return self.fail(st, e),
        };
        let finish = (done.finish, done.completion_tokens, done.cached_tokens, done.reasoning_tokens);
        if !self.close_all() {
            return;
        }
        let output = self.items.iter().map(|i| Self::item_json(i, "completed")).collect();
        let done = response_object(req, &self.id, self.created, output, Some(finish));
        let kind = if finish.0 == FinishReason::Length { "response.incomplete" } else { "response.completed" };
        self.send(kind, json!({"response": done}));
    }
}
