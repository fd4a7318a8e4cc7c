//! A tensor collective that was started and may still be running: what lets the FSDP engine
//! start a unit's all-gather before the unit before it runs (FSDP2's prefetch) and leave a
//! reduce-scatter running under the next unit's backward.
//!
//! Backends whose collectives are enqueued on a GPU stream of their own (NCCL) return it
//! running; the others run it at once and hand back the result (`PendingTensor::ready`).

use anyhow::Result;
use candle_core::Tensor;

/// Finishes a started collective: makes its result usable by what runs after it (on a GPU,
/// the compute stream waits for the communication stream; the host does not wait).
pub type Finish = Box<dyn FnOnce() -> Result<Tensor> + Send>;

/// A started tensor collective. [`PendingTensor::wait`] gives its result; dropping it unwaited
/// is safe (the backend's finish runs, so that no buffer the collective reads is freed under
/// it) and the result is lost.
pub struct PendingTensor {
    finish: Option<Finish>,
}

impl PendingTensor {
    /// A collective that already finished.
    pub fn ready(t: Tensor) -> Self {
        Self { finish: Some(Box::new(move || Ok(t))) }
    }

    /// A collective still running; `finish` makes its result usable.
    pub fn running(finish: Finish) -> Self {
        Self { finish: Some(finish) }
    }

    /// The collective's result, usable by whatever is issued after this call.
    pub fn wait(mut self) -> Result<Tensor> {
        let finish = self.finish.take().expect("a pending collective is finished once");
        finish()
    }
}

impl Drop for PendingTensor {
    fn drop(&mut self) {
        if let Some(finish) = self.finish.take() {
            // Its error was the collective's; the caller gave up on the result.
            let _ = finish();
        }
    }
}
