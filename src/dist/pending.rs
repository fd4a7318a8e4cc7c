//! A collective that was started and may still be running: what lets the FSDP engine start a
//! unit's all-gather before the unit before it runs (FSDP2's prefetch) and leave a
//! reduce-scatter running under the next unit's backward.
//!
//! Backends whose collectives are enqueued on a GPU stream of their own (NCCL), or run on a
//! thread of their own (`overlap`), return it running; the others run it at once and hand back
//! the result (`Pending::ready`).

use anyhow::Result;
use candle_core::Tensor;

/// Finishes a started collective: makes its result usable by what runs after it (on a GPU,
/// the compute stream waits for the communication stream and the host does not; on the
/// collectives' thread, the caller waits for the result).
pub type Finish<T> = Box<dyn FnOnce() -> Result<T> + Send>;

/// A started collective. [`Pending::wait`] gives its result; dropping it unwaited is safe (the
/// backend's finish runs, so that no buffer the collective reads is freed under it) and the
/// result is lost.
pub struct Pending<T> {
    finish: Option<Finish<T>>,
}

/// A started tensor collective.
pub type PendingTensor = Pending<Tensor>;

impl<T: Send + 'static> Pending<T> {
    /// A collective that already finished.
    pub fn ready(value: T) -> Self {
        Self { finish: Some(Box::new(move || Ok(value))) }
    }

    /// A collective still running; `finish` makes its result usable.
    pub fn running(finish: Finish<T>) -> Self {
        Self { finish: Some(finish) }
    }
}

impl<T> Pending<T> {
    /// The collective's result, usable by whatever is issued after this call.
    pub fn wait(mut self) -> Result<T> {
        let finish = self.finish.take().expect("a pending collective is finished once");
        finish()
    }
}

impl<T> Drop for Pending<T> {
    fn drop(&mut self) {
        if let Some(finish) = self.finish.take() {
            // Its error was the collective's; the caller gave up on the result.
            let _ = finish();
        }
    }
}
