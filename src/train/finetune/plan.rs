//! The run's shape, settled once after bootstrap and before the engine is built: how many ranks,
//! how long a row, how many rows per micro-batch and micro-batches per step, and what that makes
//! of the data (the global batch, steps per epoch, steps in all). Every later phase reads these
//! from the plan, never from the flags they came from.
//!
//! One exception, where only a GPU can answer: `--auto-find-batch-size` on GPUs tries micro-
//! batches on the loaded engine (`auto_batch::fit_by_trial`), and the plan it returns takes a
//! smaller micro-batch with a larger accumulation (the same global batch, so the same steps).

use anyhow::{bail, Result};

use super::bootstrap::Bootstrap;
use super::config::FinetuneConfig;
use crate::dist::ProcessGroups;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunPlan {
    pub world_size: usize,
    /// Tokens per row: `--seq-len`, or its default for the model's context (see
    /// `train::settle_seq_len`).
    pub seq_len: usize,
    /// Rows per rank per micro-batch (with DPO twice the pairs: each pair is two rows).
    pub micro_batch: usize,
    /// Rows per example (1, or 2 for DPO's pairs): batches hold whole examples.
    pub group: usize,
    /// Micro-batches accumulated per optimizer step.
    pub grad_accum: usize,
    /// Rows per optimizer step over all ranks and micro-batches.
    pub global_batch: usize,
    pub steps_per_epoch: usize,
    /// `--max-steps`, else every epoch's steps.
    pub total_steps: usize,
}

impl RunPlan {
    /// The plan of this run on `groups`, in micro-batches of `micro_batch` examples (rows, or
    /// pairs with DPO) accumulated `grad_accum` times (the flags', or what `auto_batch::fit`
    /// found).
    pub(super) fn settle(
        groups: &ProcessGroups,
        cfg: &FinetuneConfig,
        boot: &Bootstrap,
        (micro_batch, grad_accum): (usize, usize),
    ) -> Result<Self> {
        let world_size = groups.world.world_size();
        let group = boot.data.group;
        let micro_batch = micro_batch * group;
        let global_batch = micro_batch * world_size * grad_accum;
        let samples = boot.data.samples.len();
        // GRPO trains `num_iterations` steps on each batch of prompts.
        let iterations = cfg.grpo.as_ref().map_or(1, |g| g.settings.num_iterations);
        let steps_per_epoch = samples / global_batch * iterations;
        if steps_per_epoch == 0 {
            let what = match (group, cfg.grpo.is_some()) {
                (_, true) => "prompts",
                (2, _) => "pairs",
                _ => "samples",
            };
            bail!(
                "{}: {} {what} of {} tokens, fewer than one global batch of {} (batch size {} x {world_size} ranks x {} accumulation)",
                cfg.data.display(),
                samples / group,
                boot.seq_len,
                global_batch / group,
                cfg.batch_size,
                cfg.grad_accum
            );
        }
        let total_steps = cfg.max_steps.unwrap_or(steps_per_epoch * cfg.epochs);
        Ok(Self { world_size, seq_len: boot.seq_len, micro_batch, group, grad_accum, global_batch, steps_per_epoch, total_steps })
    }

    /// The same global batch in micro-batches of `micro` rows (a divisor of the current one), the
    /// accumulation grown by the same factor.
    pub fn with_micro_batch(&self, micro: usize) -> Self {
        Self { micro_batch: micro, grad_accum: self.grad_accum * (self.micro_batch / micro), ..self.clone() }
    }

    /// Whether step `done` (1-based) ends an epoch.
    pub fn ends_epoch(&self, done: usize) -> bool {
        done.is_multiple_of(self.steps_per_epoch)
    }
}
