//! `--auto-find-batch-size` (TrainingArguments' flag, Accelerate's `find_executable_batch_size`):
//! the largest micro-batch, among the divisors of `--batch-size`, whose estimated per-rank memory
//! (`fsdp-app estimate`, from config.json and the run's settings) fits `--max-memory-per-rank`;
//! the accumulation grows by the same factor, so the global batch, the samples of each step and
//! the losses stay those of the run as asked.

use anyhow::{bail, Result};

use super::bootstrap::Bootstrap;
use super::config::{shard_size, FinetuneConfig};
use crate::dist::{all_reduce_scalar, ProcessGroups};
use crate::memory::human_bytes;
use crate::train::estimate::{estimate, EstimateInput};

/// `cfg` with the micro-batch that fits (unchanged without `--auto-find-batch-size`).
pub(super) fn fit(
    groups: &ProcessGroups,
    cfg: &FinetuneConfig,
    boot: &Bootstrap,
) -> Result<FinetuneConfig> {
    let mut out = cfg.clone();
    if !cfg.auto_find_batch_size {
        return Ok(out);
    }
    if cfg.device.is_cuda() {
        bail!(
            "--auto-find-batch-size on GPUs (retrying a step that ran out of memory) is not implemented; \
             choose --batch-size with `fsdp-app estimate`, or train on CPU ranks"
        );
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
            shard_size: shard_size(cfg),
            strategy: cfg.strategy,
            wrap: cfg.wrap,
            activation_checkpointing: cfg.activation_checkpointing,
            batch_size: batch,
            seq_len: cfg.seq_len(),
            // Rank 0 relays the others' collectives under a launcher: the larger figure holds.
            rank0_relays: world > 1,
            lora: boot.lora.clone(),
        };
        Ok(estimate(boot.staged.as_ref(), &boot.model_cfg, &input)?.rank0_total())
    };
    let asked = cfg.batch_size;
    let mut tried = vec![];
    for micro in (1..=asked).rev().filter(|b| asked % b == 0) {
        let need = needs(micro)?;
        if need as f64 <= budget {
            out.batch_size = micro;
            out.grad_accum = cfg.grad_accum * (asked / micro);
            if groups.world.rank() == 0 && cfg.verbose {
                let why = tried
                    .first()
                    .map(|(b, n): &(usize, u64)| {
                        format!("micro-batch {b} needs ~{} per rank", human_bytes(*n))
                    })
                    .unwrap_or_default();
                eprintln!(
                    "auto batch size: budget {} per rank{}; micro-batch {micro} x {} accumulation (~{} per rank), the same {} sequences per step",
                    human_bytes(budget as u64),
                    if why.is_empty() { String::new() } else { format!(", {why}") },
                    out.grad_accum,
                    human_bytes(need),
                    asked * cfg.grad_accum * world,
                );
            }
            return Ok(out);
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

/// MemAvailable of /proc/meminfo, in bytes.
fn available_memory() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo")?;
    let kib = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .ok_or_else(|| {
            anyhow::anyhow!("/proc/meminfo has no MemAvailable: give --max-memory-per-rank")
        })?;
    Ok(kib * 1024)
}

/// Ranks sharing this machine: LOCAL_WORLD_SIZE under a launcher, else all (threads).
fn local_ranks(world: usize) -> usize {
    std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(world)
}
