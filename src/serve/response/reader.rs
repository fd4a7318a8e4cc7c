//! One answer read as it streams, the same way for every API's stream: a reasoning model's
//! thinking split out, a forced call read as its grammar writes it, an `auto` answer's text and
//! calls in the model's own format (`tool_format`). Each API turns what comes out (thinking, text,
//! call events) into its own events.

use tokio::sync::mpsc;

use crate::generate::reasoning::{Split, ThinkSplit};
use crate::generate::{FinishReason, TokenLogprob};
use crate::serve::call_stream::CallStream;
use crate::serve::engine::Event;
use crate::serve::error::ApiError;
use crate::serve::state::AppState;
use crate::serve::tool_format::{NativeCalls, Piece};
use crate::serve::tools::Tools;
use crate::serve::validate::ValidatedRequest;

/// What a piece of the answer holds: its thinking, then its text and calls; and the token that
/// brought it, scored, where the request asked for scores.
pub struct Read {
    pub reasoning: String,
    pub pieces: Vec<Piece>,
    /// The token this piece came with (None: text released at the answer's end).
    pub token: Option<u32>,
    pub logprob: Option<TokenLogprob>,
}

pub struct AnswerReader {
    split: Option<ThinkSplit>,
    calls: Option<CallStream>,
    native: Option<NativeCalls>,
}

impl AnswerReader {
    pub fn new(req: &ValidatedRequest) -> Self {
        let tools = req.kind.tools();
        Self {
            split: req.thinking.map(|t| ThinkSplit::new(t.inside())),
            calls: tools.and_then(Tools::call_stream),
            native: tools.and_then(Tools::auto_stream),
        }
    }

    /// The next piece of the answer's text.
    pub fn push(&mut self, text: String) -> Read {
        let split = match self.split.as_mut() {
            Some(s) => s.push(&text),
            None => Split { reasoning: String::new(), content: text },
        };
        self.answer(split, false)
    }

    /// What was held back, at the answer's end.
    pub fn finish(&mut self) -> Read {
        let split = self.split.as_mut().map(ThinkSplit::finish).unwrap_or_default();
        self.answer(split, true)
    }

    fn answer(&mut self, split: Split, end: bool) -> Read {
        let text = split.content;
        let mut pieces = match (self.calls.as_mut(), self.native.as_mut()) {
            (Some(c), _) => c.push(&text).into_iter().map(Piece::Call).collect(),
            (None, Some(n)) => n.push(&text),
            (None, None) if text.is_empty() => vec![],
            (None, None) => vec![Piece::Text(text)],
        };
        if end {
            pieces.extend(self.native.as_mut().map(NativeCalls::finish).unwrap_or_default());
        }
        Read { reasoning: split.reasoning, pieces, token: None, logprob: None }
    }
}

/// How an answer ended: why, its tokens, its prompt's cached tokens, its thinking's tokens, and the
/// stop string that ended it.
pub struct Finished {
    pub finish: FinishReason,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    pub reasoning_tokens: usize,
    pub stop_string: Option<String>,
}

/// How following an answer ended.
pub enum Followed {
    Done(Finished),
    /// `on_read` said the client is gone: dropping the receiver cancels the answer.
    ClientGone,
    /// The engine failed, the request timed out in the queue, or the shutdown's grace ended.
    Failed(ApiError),
}

/// Follows one answer's events, handing each piece to `on_read` (false: the client is gone).
pub async fn follow(
    st: &AppState,
    req: &ValidatedRequest,
    mut rx: mpsc::UnboundedReceiver<Event>,
    mut on_read: impl FnMut(Read) -> bool,
) -> Followed {
    let mut reader = AnswerReader::new(req);
    loop {
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            _ = st.shutdown.forced() => return Followed::Failed(ApiError::shutting_down()),
        };
        match ev {
            Some(Event::Delta { text, token, logprob }) => {
                let read = Read { token, logprob, ..reader.push(text) };
                if !on_read(read) {
                    return Followed::ClientGone;
                }
            }
            Some(Event::PromptLogprobs(_)) => {}
            Some(Event::Done { finish, completion_tokens, cached_tokens, reasoning_tokens, stop_string, .. }) => {
                if !on_read(reader.finish()) {
                    return Followed::ClientGone;
                }
                return Followed::Done(Finished { finish, completion_tokens, cached_tokens, reasoning_tokens, stop_string });
            }
            Some(ev @ (Event::Error(_) | Event::QueueTimeout { .. })) => return Followed::Failed(super::failure(&ev)),
            None => return Followed::Failed(ApiError::internal("the engine dropped the request")),
        }
    }
}
