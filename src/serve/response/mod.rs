//! Shaping a generation's events into OpenAI's responses: a JSON object once every answer is
//! done, or an SSE stream of chunks (`stream`); both for completions and chat, with logprobs,
//! echo, and function calls read from a chat answer.

mod anthropic;
mod llama_cpp;
mod logprobs;
mod ollama;
mod reader;
mod responses;
mod stream;

use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::admission::Submitted;
use super::engine::Event;
use super::error::ApiError;
use super::fields;
use super::state::AppState;
use super::tools::Tools;
use super::validate::{RequestKind, ValidatedRequest};
use crate::generate::{reasoning, FinishReason, TokenLogprob};
use tokio::sync::mpsc;

/// Admits and submits a validated request, then answers it: every generating route's last step.
pub async fn generate(st: Arc<AppState>, req: ValidatedRequest) -> Result<Response, ApiError> {
    generate_all(st, vec![req]).await
}

/// A batch of prompts (`/v1/completions`' list; one for every other request): admitted together,
/// answered as one response whose choices are numbered prompt by prompt (prompt i's answer j
/// is choice `i * n + j`, as vLLM numbers them).
pub async fn generate_all(st: Arc<AppState>, mut reqs: Vec<ValidatedRequest>) -> Result<Response, ApiError> {
    let submitted = super::admission::submit_all(&st, &mut reqs)?;
    let mut batch = vec![];
    for (req, submitted) in reqs.into_iter().zip(submitted) {
        let submitted = if req.stream { started(&st, submitted).await? } else { submitted };
        batch.push((req, submitted));
    }
    answer(st, batch).await
}

/// Requests answered together, each with its submitted answers.
type Batch = Vec<(ValidatedRequest, Submitted)>;

/// The response to a submitted batch: streamed or whole, in its API's shape. Only completions
/// (OpenAI's and llama.cpp's) come in batches of more than one.
async fn answer(st: Arc<AppState>, mut batch: Batch) -> Result<Response, ApiError> {
    let first = &batch[0].0;
    let (ignored, stream) = (first.ignored.clone(), first.stream);
    let response = match (&first.kind, stream) {
        (RequestKind::Completion { .. } | RequestKind::Chat { .. }, true) => stream::sse(st, batch),
        (RequestKind::Completion { .. } | RequestKind::Chat { .. }, false) => whole(st, batch).await?,
        (RequestKind::LlamaCpp(_), true) => llama_cpp::sse(st, batch),
        (RequestKind::LlamaCpp(_), false) => llama_cpp::whole(st, batch).await?,
        (RequestKind::Responses { .. } | RequestKind::Messages { .. } | RequestKind::Ollama { .. }, _) => {
            assert_eq!(batch.len(), 1, "the Responses, Messages and Ollama APIs take one prompt");
            let (req, submitted) = batch.pop().expect("one request");
            match (&req.kind, stream) {
                (RequestKind::Responses { .. }, true) => responses::sse(st, req, submitted),
                (RequestKind::Responses { .. }, false) => responses::whole(st, req, submitted).await?,
                (RequestKind::Ollama { .. }, true) => ollama::ndjson(st, req, submitted),
                (RequestKind::Ollama { .. }, false) => ollama::whole(st, req, submitted).await?,
                (_, true) => anthropic::sse(st, req, submitted),
                (_, false) => anthropic::whole(st, req, submitted).await?,
            }
        }
    };
    Ok(with_ignored(response, &ignored))
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

/// What a response's `id` and `object` are.
fn names(kind: &RequestKind, chunk: bool) -> (String, &'static str) {
    let id = super::ids::new_id(if kind.is_chat() { "chatcmpl" } else { "cmpl" });
    let object = match (kind.is_chat(), chunk) {
        (true, false) => "chat.completion",
        (true, true) => "chat.completion.chunk",
        (false, _) => "text_completion",
    };
    (id, object)
}

/// A response's token counts, summed over its prompts. `cached_tokens`: prompt tokens whose keys
/// and values came from the prefix cache; `reasoning_tokens`: the answers' thinking, for a
/// model whose thinking is split out (else None).
#[derive(Default, Clone, Copy)]
struct Tally {
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
    reasoning_tokens: Option<usize>,
}

impl Tally {
    /// A request's count before its answers: its prompt (and no thinking yet, if it can think).
    fn of(req: &ValidatedRequest) -> Self {
        Tally { prompt_tokens: req.prompt_ids.len(), reasoning_tokens: req.thinking.map(|_| 0), ..Tally::default() }
    }

    fn add(&mut self, other: Tally) {
        self.prompt_tokens += other.prompt_tokens;
        self.cached_tokens += other.cached_tokens;
        self.completion_tokens += other.completion_tokens;
        if let Some(r) = other.reasoning_tokens {
            *self.reasoning_tokens.get_or_insert(0) += r;
        }
    }

    /// OpenAI's `usage` object.
    fn usage(&self) -> Value {
        let Tally { prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens } = *self;
        let mut u = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens,
               "prompt_tokens_details": {"cached_tokens": cached_tokens}});
        if let Some(r) = reasoning_tokens {
            u["completion_tokens_details"] = json!({"reasoning_tokens": r});
        }
        u
    }
}

/// Waits for every answer of every prompt, then one JSON object.
async fn whole(st: Arc<AppState>, batch: Batch) -> Result<Response, ApiError> {
    let (id, object) = names(&batch[0].0.kind, false);
    let model_id = batch[0].0.model_id.clone();
    let (mut choices, mut tally) = (vec![], Tally::default());
    for (req, submitted) in batch {
        let (more, counted) = choices_of(&st, &req, submitted, choices.len()).await?;
        choices.extend(more);
        tally.add(counted);
    }
    let response =
        json!({"id": id, "object": object, "created": super::ids::now_s(), "model": model_id, "choices": choices, "usage": tally.usage()});
    Ok(Json(response).into_response())
}

/// One request's choices, numbered from `first_index`, once all its answers are done.
async fn choices_of(
    st: &AppState,
    req: &ValidatedRequest,
    submitted: Submitted,
    first_index: usize,
) -> Result<(Vec<Value>, Tally), ApiError> {
    let Submitted { admission, answers, .. } = submitted;
    let tokenizer = &req.model.tokenizer;
    let (echo, tools) = match &req.kind {
        RequestKind::Completion { echo } => (echo.as_deref(), None),
        RequestKind::LlamaCpp(_) | RequestKind::Ollama { .. } => unreachable!("llama.cpp's and Ollama's routes answer in their own shapes"),
        RequestKind::Chat { tools } | RequestKind::Responses { tools, .. } | RequestKind::Messages { tools, .. } => (None, tools.as_ref()),
    };
    let mut collected = vec![];
    for mut rx in answers {
        collected.push(collect(st, &mut rx).await?);
    }
    if req.best_of > req.n {
        // vLLM's best_of: the n answers of highest cumulative log-probability, most likely first.
        collected.sort_by(|a, b| b.cumulative_logprob.total_cmp(&a.cumulative_logprob));
        collected.truncate(req.n);
    }
    let mut choices = vec![];
    let mut tally = Tally::of(req);
    for (i, answer) in collected.into_iter().enumerate() {
        let index = first_index + i;
        let Collected {
            text: answer,
            logprobs: lps,
            prompt_logprobs: prompt_lps,
            finish,
            completion_tokens: c,
            cached_tokens: cached,
            reasoning_tokens: r,
            ..
        } = answer;
        tally.completion_tokens += c;
        tally.reasoning_tokens = tally.reasoning_tokens.map(|t| t + r);
        // The answers share the prompt: its cached part is counted once.
        tally.cached_tokens = tally.cached_tokens.max(cached);
        let text = format!("{}{answer}", echo.unwrap_or_default());
        let logprobs = req.params.logprobs.map(|_| match req.kind {
            RequestKind::Completion { .. } => logprobs::completion(tokenizer, &req.prompt_ids, prompt_lps.as_deref(), &lps, echo),
            _ => logprobs::chat(tokenizer, &lps),
        });
        choices.push(if req.kind.is_chat() {
            // A reasoning model's thinking apart; tools read the answer after it.
            let (reasoning, text) = match req.thinking {
                Some(t) => reasoning::split(&text, t.inside()),
                None => (None, text),
            };
            let (mut message, finish) = assistant_message(tools, text, json!(finish));
            if let Some(r) = reasoning {
                // Under both names: DeepSeek's `reasoning_content`, which most clients read, and
                // `reasoning`, which vLLM writes now (clients written for it read only that).
                (message["reasoning_content"], message["reasoning"]) = (json!(r), json!(r));
            }
            json!({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish})
        } else {
            json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
        });
    }
    drop(admission);
    Ok((choices, tally))
}

/// One answer, whole: its text, scores and how it ended.
pub(super) struct Collected {
    pub text: String,
    /// The sampled tokens, an eos token not among them.
    pub tokens: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    /// The prompt's scores (completions' `echo` with `logprobs`).
    pub prompt_logprobs: Option<Vec<TokenLogprob>>,
    pub finish: FinishReason,
    pub completion_tokens: usize,
    /// Prompt tokens taken from the prefix cache.
    pub cached_tokens: usize,
    /// The sampled tokens' summed log-probability (when the request ranks answers, else 0).
    pub cumulative_logprob: f64,
    /// Tokens of its thinking (0 without).
    pub reasoning_tokens: usize,
    /// The stop string that ended it, if one did.
    pub stop_string: Option<String>,
    /// When its first token came (None: it had none).
    pub first_token_at: Option<std::time::Instant>,
}

/// Waits for an answer's events until it is done; an engine failure (the request was checked
/// before it ran) is the server's error, and so is the end of the shutdown's grace period.
pub(super) async fn collect(st: &AppState, rx: &mut mpsc::UnboundedReceiver<Event>) -> Result<Collected, ApiError> {
    let (mut text, mut tokens, mut logprobs, mut prompt_logprobs) = (String::new(), vec![], vec![], None);
    let mut first_token_at = None;
    loop {
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            _ = st.shutdown.forced() => return Err(ApiError::shutting_down()),
        };
        match ev {
            Some(Event::PromptLogprobs(v)) => prompt_logprobs = Some(v),
            Some(Event::Delta { text: t, token, logprob }) => {
                first_token_at.get_or_insert_with(std::time::Instant::now);
                text.push_str(&t);
                tokens.extend(token);
                logprobs.extend(logprob);
            }
            Some(Event::Done { finish, completion_tokens, cached_tokens, cumulative_logprob, reasoning_tokens, stop_string, .. }) => {
                let (c, cached) = (completion_tokens, cached_tokens);
                let (cumulative_logprob, reasoning_tokens) = (cumulative_logprob, reasoning_tokens);
                return Ok(Collected {
                    text,
                    tokens,
                    logprobs,
                    prompt_logprobs,
                    finish,
                    completion_tokens: c,
                    cached_tokens: cached,
                    cumulative_logprob,
                    reasoning_tokens,
                    stop_string,
                    first_token_at,
                });
            }
            Some(ev @ (Event::Error(_) | Event::QueueTimeout { .. })) => return Err(failure(&ev)),
            None => return Err(ApiError::internal("the engine dropped the request")),
        }
    }
}

/// What an answer that ended without running to its end reports: the engine's failure (500), or
/// a wait in the queue past `--max-queue-wait` (429, retry after as long again: the queue was
/// that slow to move).
pub(super) fn failure(ev: &Event) -> ApiError {
    match ev {
        Event::QueueTimeout { waited } => {
            let message = format!("The request waited {:.0} s in the queue for a generation slot; retry later.", waited.as_secs_f64());
            ApiError { message, ..ApiError::overloaded(waited.as_secs().max(1)) }
        }
        Event::Error(e) => ApiError::internal(format!("Generation failed: {e}")),
        _ => ApiError::internal("the engine ended an answer without a reason"),
    }
}

/// Waits until every answer has left the queue (its first event), putting that event back: a
/// stream's status is sent with its first chunk, so a request the queue times out must be
/// answered 429 before it, not as an error inside a 200 stream.
async fn started(st: &AppState, mut submitted: Submitted) -> Result<Submitted, ApiError> {
    for rx in &mut submitted.answers {
        let first = tokio::select! {
            ev = rx.recv() => ev.ok_or_else(|| ApiError::internal("the engine dropped the request"))?,
            _ = st.shutdown.forced() => return Err(ApiError::shutting_down()),
        };
        if matches!(first, Event::QueueTimeout { .. }) {
            return Err(failure(&first));
        }
        let (tx, again) = mpsc::unbounded_channel();
        let _ = tx.send(first);
        let mut rest = std::mem::replace(rx, again);
        tokio::spawn(async move {
            while let Some(ev) = rest.recv().await {
                if tx.send(ev).is_err() {
                    break;
                }
            }
        });
    }
    Ok(submitted)
}

/// The assistant's message for an answer: its function calls when it makes any (then
/// `finish_reason` "tool_calls" for an answer that ended by itself), else its text; a forced
/// call's grammar text is never content (cut before any call completed: no content, no calls).
fn assistant_message(tools: Option<&Tools>, text: String, finish: Value) -> (Value, Value) {
    match tools.and_then(|t| Some((t, t.calls_in(&text)?))).filter(|(_, (_, calls))| !calls.is_empty()) {
        Some((t, (content, calls))) => {
            let finish = if finish == "stop" { json!("tool_calls") } else { finish };
            (json!({"role": "assistant", "content": content, "tool_calls": t.calls_json(&calls)}), finish)
        }
        None if tools.is_some_and(Tools::forces_call) => (json!({"role": "assistant", "content": null}), finish),
        None => (json!({"role": "assistant", "content": text}), finish),
    }
}
