//! `--auto-find-batch-size` (TrainingArguments' flag, Accelerate's `find_executable_batch_size`):
//! the largest micro-batch, among the divisors of `--batch-size`, that fits; the accumulation
//! grows by the same factor, so the global batch, the samples of each step and the losses stay
//! those of the run as asked.
//!
//! - CPU ranks ([`fit`]): running out of host memory kills the process, so the micro-batch is
//!   chosen before anything runs, from its estimated per-rank memory (`fsdp-app estimate`)
//!   against `--max-memory-per-rank`.
//! - GPU ranks ([`fit_by_trial`]): a trial step (forward and backward of a micro-batch of full
//!   `--seq-len` rows, the largest any step can take) runs on the loaded engine; one that runs
//!   out of GPU memory is discarded and retried with half the micro-batch, as Accelerate's
//!   decorator does (two micro-batches when a step accumulates: the second runs beside the
//!   first's gradients). The trial's rows have the same shape on every rank, so every rank runs out
//!   at the same allocation and no rank is left waiting in a collective; later steps are no
//!   larger (rows are cut to their batch's longest), so none of them runs out where the trial
//!   did not. The trial's gradients are dropped: training starts from the loaded weights.

use anyhow::{bail, Result};
use candle_core::Tensor;
use models::StageContext;

use super::bootstrap::Bootstrap;
use super::config::{shard_size, FinetuneConfig};
use super::plan::RunPlan;
use crate::dist::{all_reduce_scalar, ProcessGroups};
use crate::fsdp::engine::FsdpEngine;
use crate::memory::human_bytes;
use crate::train::batch::collate;
use crate::train::data::Sample;
use crate::train::estimate::{estimate, EstimateInput};
use crate::train::loss::{next_token_targets, summed_token_loss};

/// The (micro-batch, accumulation) of examples (rows, or DPO's pairs of rows) of `seq_len`
/// tokens that fits: the flags' without `--auto-find-batch-size` (and on GPUs, where the trial
/// decides later).
pub(super) fn fit(groups: &ProcessGroups, cfg: &FinetuneConfig, boot: &Bootstrap, seq_len: usize) -> Result<(usize, usize)> {
    if !cfg.auto_find_batch_size || cfg.device.is_cuda() {
        return Ok((cfg.batch_size, cfg.grad_accum));
    }
    let world = groups.world.world_size();
    // One budget for every rank: the flag, or rank 0's available memory shared by the ranks of
    // this machine, so that all ranks choose the same micro-batch.
    let mine = match (cfg.max_memory_per_rank, groups.world.rank()) {
        (Some(b), _) => b as f64,
        (None, 0) => available_memory()? as f64 / local_ranks(world) as f64,
        (None, _) => 0.0,
    };
    let budget = match cfg.max_memory_per_rank {
        Some(b) => b as f64,
        None => all_reduce_scalar(groups.world.as_ref(), mine)?,
    };
    let needs = |batch: usize| -> Result<u64> {
        let input = EstimateInput {
            world_size: world,
            shard_size: shard_size(cfg, world),
            strategy: cfg.strategy,
            wrap: cfg.wrap,
            activation_checkpointing: cfg.activation_checkpointing,
            batch_size: batch * boot.data.group,
            seq_len,
            // Rank 0 relays the others' collectives under a launcher: the larger figure holds.
            rank0_relays: world > 1,
            lora: boot.lora.clone(),
        };
        Ok(estimate(boot.staged.as_ref(), &boot.model_cfg, &input)?.rank0_total())
    };
    let asked = cfg.batch_size;
    let mut tried = vec![];
    for micro in (1..=asked).rev().filter(|b| asked.is_multiple_of(*b)) {
        let need = needs(micro)?;
        if need as f64 <= budget {
            let accum = cfg.grad_accum * (asked / micro);
            if groups.world.rank() == 0 && cfg.verbose {
                let why = tried
                    .first()
                    .map(|(b, n): &(usize, u64)| format!("micro-batch {b} needs ~{} per rank", human_bytes(*n)))
                    .unwrap_or_default();
                eprintln!(
                    "auto batch size: budget {} per rank{}; micro-batch {micro} x {} accumulation (~{} per rank), the same {} {} per step",
                    human_bytes(budget as u64),
                    if why.is_empty() { String::new() } else { format!(", {why}") },
                    accum,
                    human_bytes(need),
                    asked * cfg.grad_accum * world,
                    if boot.data.group == 2 { "pairs" } else { "sequences" },
                );
            }
            return Ok((micro, accum));
        }
        tried.push((micro, need));
    }
    let (_, smallest) = tried.last().copied().unwrap_or((1, 0));
    bail!(
        "--auto-find-batch-size: even a micro-batch of 1 needs ~{} per rank (estimate), over the budget of {} \
         (--max-memory-per-rank): shorten --seq-len, add --activation-checkpointing or LoRA, or use more ranks",
        human_bytes(smallest),
        human_bytes(budget as u64)
    )
}

/// GPU ranks: `plan` with the largest micro-batch whose trial step runs (see the module's
/// comment); unchanged on CPU ranks or without `--auto-find-batch-size`.
pub(super) fn fit_by_trial(
    engine: &mut FsdpEngine,
    groups: &ProcessGroups,
    cfg: &FinetuneConfig,
    boot: &Bootstrap,
    plan: RunPlan,
) -> Result<RunPlan> {
    if !cfg.auto_find_batch_size || !cfg.device.is_cuda() {
        return Ok(plan);
    }
    // Whole examples: a DPO pair's two rows stay in one micro-batch.
    let group = plan.group;
    let asked = plan.micro_batch / group;
    let found = largest_that_runs(asked, |micro| {
        // A step of two or more micro-batches holds the first one's gradients while the second
        // runs: the trial runs two then, as the first real step will.
        let micro_batches = (plan.grad_accum * (asked / micro)).min(2);
        crate::memory::reset_gpu_pool_peak(engine.device());
        let ran_out = match trial_step(engine, cfg, boot, plan.seq_len, micro * group, micro_batches) {
            Ok(()) => false,
            Err(e) if crate::device::is_out_of_memory(&e) => true,
            Err(e) => return Err(e),
        };
        engine.discard_step()?;
        crate::memory::debug_gpu_pool(engine.device(), || "trial discarded".into());
        // One answer for every rank (they all ran out, or none did: the trial's shapes agree).
        let anywhere = all_reduce_scalar(groups.world.as_ref(), f64::from(u8::from(ran_out)))? > 0.0;
        if groups.world.rank() == 0 && cfg.verbose {
            let peak = crate::memory::gpu_pool_peak(engine.device()).map(|b| format!(", peak {} in use", human_bytes(b)));
            eprintln!(
                "auto batch size: {micro_batches} micro-batch(es) of {micro} x {} tokens {}{}",
                plan.seq_len,
                if anywhere { "ran out of GPU memory" } else { "ran" },
                peak.unwrap_or_default()
            );
        }
        Ok(!anywhere)
    })?;
    let Some(micro) = found else {
        bail!(
            "--auto-find-batch-size: even a micro-batch of 1 row of {} tokens runs out of GPU memory: \
             shorten --seq-len, add --activation-checkpointing or LoRA, or use more ranks",
            plan.seq_len
        );
    };
    let out = plan.with_micro_batch(micro * group);
    if groups.world.rank() == 0 && cfg.verbose {
        eprintln!(
            "auto batch size: micro-batch {micro} x {} accumulation fits the GPU, the same {} sequences per step",
            out.grad_accum, out.global_batch
        );
    }
    Ok(out)
}

/// The search of [`fit_by_trial`]: `asked` first, then half of the last one tried (rounded down
/// to a divisor of `asked`, so the accumulation stays whole), until `runs(micro)` says it ran;
/// None when not even 1 did.
fn largest_that_runs(asked: usize, mut runs: impl FnMut(usize) -> Result<bool>) -> Result<Option<usize>> {
    let mut micro = asked;
    loop {
        if runs(micro)? {
            return Ok(Some(micro));
        }
        if micro == 1 {
            return Ok(None);
        }
        micro = (1..=micro / 2).rev().find(|b| asked.is_multiple_of(*b)).unwrap_or(1);
    }
}

/// Forward and backward of `micro_batches` micro-batches of `micro` rows of `--seq-len` tokens,
/// every token a target, as a training step would run them (packed rows when the run packs).
fn trial_step(
    engine: &mut FsdpEngine,
    cfg: &FinetuneConfig,
    boot: &Bootstrap,
    len: usize,
    micro: usize,
    micro_batches: usize,
) -> Result<()> {
    let token = boot.model_cfg.eos_token_ids.first().copied().unwrap_or(0);
    // Two documents per row when packing, so the trial builds the packed attention layout too.
    let segments = if cfg.packing { (0..len).map(|i| 1 + u32::from(i >= len / 2)).collect() } else { vec![] };
    let row = Sample { input_ids: vec![token; len], labels: vec![i64::from(token); len], len, segments };
    let rows: Vec<&Sample> = (0..micro).map(|_| &row).collect();
    let batch = collate(&rows);
    let input = Tensor::from_vec(batch.input_ids, (batch.rows, batch.width), engine.device())?;
    let targets = next_token_targets(&batch.labels, batch.rows, batch.width);
    let ctx =
        StageContext { packing: batch.packing, row_seeds: Some(vec![cfg.seed; batch.rows]), targets: Some(targets), ..Default::default() };
    for a in 0..micro_batches {
        engine.forward_backward(&input, &ctx, &summed_token_loss, 1.0 / (micro * len) as f64)?;
        crate::memory::debug_gpu_pool(engine.device(), || format!("trial of {micro} rows, after micro-batch {a}"));
    }
    Ok(())
}

/// MemAvailable of /proc/meminfo, in bytes.
fn available_memory() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo")?;
    let kib = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .ok_or_else(|| anyhow::anyhow!("/proc/meminfo has no MemAvailable: give --max-memory-per-rank"))?;
    Ok(kib * 1024)
}

/// Ranks sharing this machine: LOCAL_WORLD_SIZE under a launcher, else all (threads).
fn local_ranks(world: usize) -> usize {
    std::env::var("LOCAL_WORLD_SIZE").ok().and_then(|v| v.parse().ok()).filter(|n| *n > 0).unwrap_or(world)
}

#[cfg(test)]
mod tests {
    use super::largest_that_runs;

    /// The micro-batches tried, and the one found, when every micro-batch up to `fits` runs.
    fn search(asked: usize, fits: usize) -> (Vec<usize>, Option<usize>) {
        let mut tried = vec![];
        let found = largest_that_runs(asked, |m| {
            tried.push(m);
            Ok(m <= fits)
        })
        .unwrap();
        (tried, found)
    }

    #[test]
    fn halves_to_a_divisor_of_the_batch_until_one_runs() {
        assert_eq!(search(64, 64), (vec![64], Some(64)));
        assert_eq!(search(64, 12), (vec![64, 32, 16, 8], Some(8)));
        assert_eq!(search(12, 5), (vec![12, 6, 3], Some(3)));
        assert_eq!(search(12, 0), (vec![12, 6, 3, 1], None));
        assert_eq!(search(7, 2), (vec![7, 1], Some(1)));
        let failed = largest_that_runs(8, |_| anyhow::bail!("a NCCL error")).unwrap_err();
        assert_eq!(failed.to_string(), "a NCCL error", "an error that is not out of memory ends the search");
    }
}
