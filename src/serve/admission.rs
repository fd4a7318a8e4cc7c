//! Admission into the bounded queue, and handing a validated request's answers to its model's
//! engine. Each of a request's `n` answers takes a generation slot or a queue place, as n
//! separate requests would; a full queue is 429 with `Retry-After`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;

use super::engine::{Event, Job};
use super::error::ApiError;
use super::state::AppState;
use super::validate::ValidatedRequest;
use crate::generate::reasoning::PromptThinking;

/// Counts a request's sequences as admitted until dropped (when the response is complete or the
/// client is gone), so the queue bound holds for streams too.
pub struct Admission(Arc<AppState>, usize);

impl Admission {
    /// Moves `places` of this admission into one of their own, released when it is dropped.
    fn split_off(&mut self, places: usize) -> Admission {
        self.1 -= places;
        Admission(self.0.clone(), places)
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(self.1, Ordering::SeqCst);
    }
}

/// A request's answers on their way: one event channel per answer, and its place in the queue.
pub struct Submitted {
    pub admission: Admission,
    pub answers: Vec<mpsc::UnboundedReceiver<Event>>,
    /// When the answers were submitted: the start of the timings the APIs report (a stream's
    /// first event is awaited before its response begins).
    pub at: std::time::Instant,
}

/// Takes `places` in the queue, or answers 429 when they are not free.
pub fn admit(st: &Arc<AppState>, places: usize) -> Result<Admission, ApiError> {
    let cap = st.max_concurrent + st.max_queue;
    st.in_flight
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n + places <= cap).then_some(n + places))
        .map_err(|_| ApiError::overloaded(1))?;
    Ok(Admission(st.clone(), places))
}

/// Admits every request's answers at once (a batch of prompts is admitted whole or not at all),
/// then submits each: one `Submitted` per request, each holding its own places.
pub fn submit_all(st: &Arc<AppState>, reqs: &mut [ValidatedRequest]) -> Result<Vec<Submitted>, ApiError> {
    let mut all = admit(st, reqs.iter().map(|r| r.best_of).sum())?;
    reqs.iter_mut()
        .map(|req| Ok(Submitted { admission: all.split_off(req.best_of), answers: send(req)?, at: std::time::Instant::now() }))
        .collect()
}

/// Submits `req`'s `best_of` answers (answer i seeded `seed + i`, each with its own grammar
/// matcher, which it takes from `req`) to its model's engine.
fn send(req: &mut ValidatedRequest) -> Result<Vec<mpsc::UnboundedReceiver<Event>>, ApiError> {
    let mut constraints = std::mem::take(&mut req.constraints).into_iter();
    let tools = req.kind.tools();
    let mut answers = vec![];
    for i in 0..req.best_of {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut params = req.params.clone();
        params.seed = params.seed.wrapping_add(i as u64);
        let job = Job {
            prompt_ids: req.prompt_ids.clone(),
            params,
            constraint: constraints.next(),
            stop_when: tools.and_then(|t| t.repeat_watch()),
            adapter: req.adapter.clone(),
            cache_key: req.cache_key.clone(),
            thinking: req.thinking.filter(|t| *t != PromptThinking::Closed).map(PromptThinking::inside),
            events: tx,
            enqueued: Instant::now(),
        };
        req.model.engine.submit(job).map_err(ApiError::internal)?;
        answers.push(rx);
    }
    Ok(answers)
}
