//! What the loop minimises, one micro-batch at a time: SFT's next-token cross-entropy (a mean
//! over the global batch's target tokens) or DPO's preference loss (a mean over its pairs).
//! The engine runs forward and backward; this module turns the last stage's per-position
//! losses into the micro-batch's loss and keeps the statistics TRL logs.
//!
//! DPO's reference log-probabilities come from one pass over the data before the first step
//! (TRL's `precompute_ref_log_probs`) with the same engine: the starting weights for full
//! fine-tuning, the frozen base with the adapters switched off for LoRA. No second model is
//! held either way, so a DPO run needs the memory of an SFT run. Checkpoints keep them
//! ([`REFERENCE_FILE`]): a resumed run cannot recompute them from trained weights.

use std::cell::RefCell;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use models::StageContext;
use serde::{Deserialize, Serialize};

use super::bootstrap::Bootstrap;
use super::config::FinetuneConfig;
use crate::dist::{root_tries, ProcessGroups};
use crate::fsdp::engine::FsdpEngine;
use crate::train::batch::collate;
use crate::train::data::Sample;
use crate::train::dpo::{dpo_loss, row_logps, DpoSettings, DpoStats};
use crate::train::loss::{next_token_targets, summed_token_loss};

/// A checkpoint's copy of the reference log-probabilities (DPO runs).
pub(super) const REFERENCE_FILE: &str = "dpo_reference_logps.json";

/// The reference model's summed completion log-probability of every training and evaluation
/// sample, by sample index.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct ReferenceLogps {
    pub train: Vec<f32>,
    pub eval: Vec<f32>,
}

pub(super) enum Objective {
    Sft,
    Dpo { settings: DpoSettings, reference: ReferenceLogps },
}

/// Which of the run's sample lists a batch comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Split {
    Train,
    Eval,
}

impl Objective {
    /// The run's objective. DPO's reference log-probabilities are computed now, or read back
    /// from the checkpoint a run resumes from (`resumed`, rank 0's directory).
    pub fn settle(
        engine: &mut FsdpEngine,
        groups: &ProcessGroups,
        cfg: &FinetuneConfig,
        boot: &Bootstrap,
        micro_rows: usize,
        resumed: Option<&Path>,
    ) -> Result<Self> {
        let Some(settings) = cfg.dpo else { return Ok(Self::Sft) };
        let data = &boot.data;
        let reference = if engine.step > 0 {
            let (_, bytes) = root_tries(groups.world.as_ref(), "read the DPO reference log-probabilities", || {
                let dir = resumed.context("a resumed run names its checkpoint")?;
                let path = dir.join(REFERENCE_FILE);
                let bytes = std::fs::read(&path)
                    .with_context(|| format!("{}: cannot read (was the checkpoint written by a --method dpo run?)", path.display()))?;
                Ok(((), bytes))
            })?;
            let reference: ReferenceLogps = serde_json::from_slice(&bytes).context(REFERENCE_FILE)?;
            if reference.train.len() != data.samples.len() || reference.eval.len() != data.eval_samples.len() {
                bail!(
                    "{REFERENCE_FILE}: {} training and {} eval log-probabilities for {} and {} samples of this run's data",
                    reference.train.len(),
                    reference.eval.len(),
                    data.samples.len(),
                    data.eval_samples.len()
                );
            }
            reference
        } else {
            let start = std::time::Instant::now();
            let adapters_off = boot.lora.is_some();
            let reference = ReferenceLogps {
                train: reference_logps(engine, groups, &data.samples, micro_rows, adapters_off)?,
                eval: reference_logps(engine, groups, &data.eval_samples, micro_rows, adapters_off)?,
            };
            if groups.world.rank() == 0 && cfg.verbose {
                let what = if adapters_off { "the base model, adapters off" } else { "the starting weights" };
                eprintln!(
                    "DPO reference: log-probabilities of {} pairs under {what} in {:.1}s",
                    (reference.train.len() + reference.eval.len()) / 2,
                    start.elapsed().as_secs_f64()
                );
            }
            reference
        };
        Ok(Self::Dpo { settings, reference })
    }

    /// What a checkpoint keeps besides the weights (file name, contents).
    pub fn checkpoint_files(&self) -> Result<Vec<(String, Vec<u8>)>> {
        Ok(match self {
            Self::Sft => vec![],
            Self::Dpo { reference, .. } => vec![(REFERENCE_FILE.to_string(), serde_json::to_vec(reference)?)],
        })
    }

    /// This rank's share of what the global batch's loss is divided by: its target tokens
    /// (SFT's token mean) or its pairs (DPO's pair mean).
    pub fn normaliser(&self, samples: &[&Sample]) -> f64 {
        match self {
            Self::Sft => samples.iter().map(|s| s.target_tokens()).sum::<usize>() as f64,
            Self::Dpo { .. } => (samples.len() / 2) as f64,
        }
    }

    /// Forward (and with `grad_scale`, backward) of the micro-batch of samples `indices` of
    /// `split`; returns its summed loss and adds DPO's statistics to `stats`.
    pub fn run_micro_batch(
        &self,
        engine: &mut FsdpEngine,
        samples: &[Sample],
        (split, indices): (Split, &[usize]),
        ctx: StageContext,
        grad_scale: Option<f64>,
        stats: &mut DpoStats,
    ) -> Result<f64> {
        let rows: Vec<&Sample> = indices.iter().map(|&i| &samples[i]).collect();
        let batch = collate(&rows);
        let input = Tensor::from_vec(batch.input_ids, (batch.rows, batch.width), engine.device())?;
        let ctx = StageContext { packing: batch.packing, targets: Some(next_token_targets(&batch.labels, batch.rows, batch.width)), ..ctx };
        let run = |engine: &mut FsdpEngine, loss: crate::fsdp::engine::LossFn| match grad_scale {
            Some(scale) => engine.forward_backward(&input, &ctx, loss, scale),
            None => engine.forward_loss(&input, &ctx, loss),
        };
        match self {
            Self::Sft => run(engine, &summed_token_loss),
            Self::Dpo { settings, reference } => {
                let reference = match split {
                    Split::Train => &reference.train,
                    Split::Eval => &reference.eval,
                };
                let reference: Vec<f32> = indices.iter().map(|&i| reference[i]).collect();
                let lengths: Vec<usize> = rows.iter().map(|s| s.target_tokens()).collect();
                let batch_stats = RefCell::new(DpoStats::default());
                let loss = |per_position: &Tensor| {
                    let (loss, s) = dpo_loss(settings.loss, settings.beta, &row_logps(per_position, rows.len())?, &reference, &lengths)?;
                    *batch_stats.borrow_mut() = s;
                    Ok(loss)
                };
                let value = run(engine, &loss)?;
                stats.add(&batch_stats.into_inner());
                Ok(value)
            }
        }
    }
}

/// Every sample's summed completion log-probability under the engine's current weights (with
/// `adapters_off`, the base alone), each rank taking every world-th micro-batch and the ranks
/// summing their (otherwise zero) entries.
fn reference_logps(
    engine: &mut FsdpEngine,
    groups: &ProcessGroups,
    samples: &[Sample],
    micro_rows: usize,
    adapters_off: bool,
) -> Result<Vec<f32>> {
    let (rank, world) = (groups.world.rank(), groups.world.world_size());
    let mut out = vec![0f64; samples.len()];
    if samples.is_empty() {
        return Ok(vec![]);
    }
    let rounds = samples.len().div_ceil(micro_rows * world);
    for r in 0..rounds {
        let first = (r * world + rank) * micro_rows;
        // Ranks past the end run a fully masked row, so every rank makes the same collectives.
        let mine: Vec<usize> = (first..(first + micro_rows).min(samples.len())).collect();
        let masked =
            Sample { input_ids: samples[0].input_ids.clone(), labels: vec![-100; samples[0].labels.len()], len: 0, segments: vec![] };
        let rows: Vec<&Sample> = if mine.is_empty() { vec![&masked] } else { mine.iter().map(|&i| &samples[i]).collect() };
        let batch = collate(&rows);
        let input = Tensor::from_vec(batch.input_ids, (batch.rows, batch.width), engine.device())?;
        let ctx = StageContext {
            packing: batch.packing,
            targets: Some(next_token_targets(&batch.labels, batch.rows, batch.width)),
            adapters_off,
            ..Default::default()
        };
        let logps = RefCell::new(vec![]);
        let keep = |per_position: &Tensor| {
            let l = row_logps(per_position, rows.len())?;
            *logps.borrow_mut() = l.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
            l.sum_all()
        };
        engine.forward_loss(&input, &ctx, &keep)?;
        for (&i, &v) in mine.iter().zip(logps.borrow().iter()) {
            out[i] = v as f64;
        }
    }
    groups.world.all_reduce_f64(&mut out)?;
    Ok(out.into_iter().map(|v| v as f32).collect())
}
