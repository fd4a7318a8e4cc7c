//! Phase 4, the loop: for each step, take this rank's micro-batches, forward + backward each,
//! one optimizer step; then log, and maybe evaluate, save a checkpoint, or export.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use models::StageContext;
use serde_json::json;

use super::bootstrap::Bootstrap;
use super::config::FinetuneConfig;
use super::export::export_result;
use super::grpo_eval;
use super::grpo_step::{self, GrpoState, StepInputs};
use super::metrics_log::{MetricsLog, StepReport};
use super::objective::{Objective, Split};
use super::plan::RunPlan;
use super::step::{dropout_seed, StepOutcome};
use crate::checkpoint::identity::{self, DataCursor};
use crate::checkpoint::sharded::{self, SaveExtras};
use crate::dist::{all_reduce_scalar, ProcessGroups};
use crate::fsdp::engine::FsdpEngine;
use crate::fsdp::optim::lr_multiplier;
use crate::train::data::{epoch_order_grouped, Sample};
use crate::train::dpo::DpoStats;

/// Losses and gradient norms of the steps this process ran.
#[derive(Default)]
pub(super) struct Curve {
    pub losses: Vec<f64>,
    pub grad_norms: Vec<f64>,
}

pub(super) fn train(
    engine: &mut FsdpEngine,
    groups: &ProcessGroups,
    cfg: &FinetuneConfig,
    plan: &RunPlan,
    boot: &Bootstrap,
    objective: &Objective,
) -> Result<Curve> {
    let data = &boot.data;
    let start_step = engine.step as usize;
    let mut log = MetricsLog::open(groups, cfg, plan.total_steps, start_step)?;
    let checkpoint_files = [checkpoint_side_files(cfg, boot)?, objective.checkpoint_files()?].concat();
    let mut curve = Curve::default();
    // The data order is a pure function of (seed, epoch), so the cursor is the step.
    let mut order_epoch = start_step / plan.steps_per_epoch;
    let mut order = epoch_order_grouped(data.samples.len(), data.group, order_epoch, cfg.seed, cfg.shuffle);
    let mut grpo = cfg.grpo.as_ref().map(|_| GrpoState::new(boot)).transpose()?;
    for step in start_step..plan.total_steps {
        let epoch = step / plan.steps_per_epoch;
        if epoch != order_epoch {
            order_epoch = epoch;
            order = epoch_order_grouped(data.samples.len(), data.group, epoch, cfg.seed, cfg.shuffle);
        }
        let start = Instant::now();
        let lr = cfg.lr * lr_multiplier(cfg.schedule, step, cfg.warmup_for(plan.total_steps), plan.total_steps);
        let outcome = match (&cfg.grpo, grpo.as_mut()) {
            (Some(run), Some(state)) => {
                let inputs = StepInputs { groups, cfg, plan, boot, run, order: &order };
                grpo_step::train_step(engine, &inputs, state, (step, lr))
            }
            _ => {
                let micro = micro_batches(groups, plan, &order, step);
                train_step(engine, groups, cfg, plan, objective, &data.samples, &micro, (step, lr))
            }
        };
        let StepOutcome { loss, grad_norm, tokens, metrics } =
            outcome.with_context(|| format!("training step {} ({} x {} rows)", step + 1, plan.grad_accum, plan.micro_batch))?;
        curve.losses.push(loss);
        curve.grad_norms.push(grad_norm);
        log.step(
            groups,
            engine.device(),
            &StepReport { step: step + 1, epoch, loss, lr, grad_norm, tokens, secs: start.elapsed().as_secs_f64(), metrics },
        )?;
        let done = step + 1;
        if cfg.eval_steps.is_some_and(|n| done % n == 0) && done != plan.total_steps {
            let grpo = cfg
                .grpo
                .as_ref()
                .zip(grpo.as_ref())
                .map(|(run, state)| (StepInputs { groups, cfg, plan, boot, run, order: &order }, state));
            run_eval(engine, (groups, plan, boot, objective), grpo, done, &mut log)?;
        }
        if cfg.save_steps.is_some_and(|n| done % n == 0) || (cfg.save_each_epoch && plan.ends_epoch(done)) {
            save_checkpoint(engine, groups, cfg, plan, boot, done, &checkpoint_files)?;
        }
        if cfg.save_full_every.is_some_and(|n| done % n == 0) && done != plan.total_steps {
            export_result(engine, boot, &cfg.output_dir.join(format!("export-{done}")), cfg)?;
        }
    }
    log.finish();
    let grpo = cfg.grpo.as_ref().zip(grpo.as_ref()).map(|(run, state)| (StepInputs { groups, cfg, plan, boot, run, order: &order }, state));
    run_eval(engine, (groups, plan, boot, objective), grpo, plan.total_steps, &mut log)?;
    Ok(curve)
}

/// This rank's micro-batches of step `step`'s global batch, as sample indices: micro-batch `a`
/// takes, for each rank in turn, `micro_batch` consecutive samples of the epoch's order (whole
/// examples: the order keeps a pair's samples together and micro-batches hold whole pairs).
fn micro_batches(groups: &ProcessGroups, plan: &RunPlan, order: &[usize], step: usize) -> Vec<Vec<usize>> {
    let (rank, world) = (groups.world.rank(), plan.world_size);
    let base = (step % plan.steps_per_epoch) * plan.global_batch;
    (0..plan.grad_accum)
        .map(|a| {
            let first = base + (a * world + rank) * plan.micro_batch;
            order[first..first + plan.micro_batch].to_vec()
        })
        .collect()
}

/// Forward + backward of every micro-batch (the loss normalised by the global batch's target
/// tokens or pairs, so N ranks give one rank's gradients), then the optimizer step.
#[allow(clippy::too_many_arguments)]
fn train_step(
    engine: &mut FsdpEngine,
    groups: &ProcessGroups,
    cfg: &FinetuneConfig,
    plan: &RunPlan,
    objective: &Objective,
    samples: &[Sample],
    micro: &[Vec<usize>],
    (step, lr): (usize, f64),
) -> Result<StepOutcome> {
    let (rank, world) = (groups.world.rank(), groups.world.world_size());
    let rows: Vec<&Sample> = micro.iter().flatten().map(|&i| &samples[i]).collect();
    let local_tokens: usize = rows.iter().map(|s| s.len).sum();
    let mut counts = [objective.normaliser(&rows), local_tokens as f64];
    groups.world.all_reduce_f64(&mut counts)?;
    let [normaliser, tokens] = counts;
    if normaliser == 0.0 {
        bail!("step {step}: the global batch has no target tokens (every label is -100)");
    }
    let (mut local_loss, mut stats) = (0.0, DpoStats::default());
    for (a, indices) in micro.iter().enumerate() {
        // Dropout seeds from (seed, step, place in the global batch): the same masks on any
        // number of ranks, and in an activation-checkpointing recompute.
        let first = (a * world + rank) * plan.micro_batch;
        let row_seeds = (first..first + indices.len()).map(|i| dropout_seed(cfg.seed, step, i)).collect();
        let ctx = StageContext { row_seeds: Some(row_seeds), ..Default::default() };
        local_loss += objective.run_micro_batch(engine, samples, (Split::Train, indices), ctx, Some(1.0 / normaliser), &mut stats)?;
        crate::memory::debug_gpu_pool(engine.device(), || format!("step {} after micro-batch {a}", step + 1));
    }
    let loss = all_reduce_scalar(groups.world.as_ref(), local_loss)? / normaliser;
    let metrics = reduce_stats(groups, objective, stats)?.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    let stats = engine.optimizer_step(lr, cfg.max_grad_norm)?;
    crate::memory::debug_gpu_pool(engine.device(), || format!("step {} after the optimizer", step + 1));
    Ok(StepOutcome { loss, grad_norm: stats.grad_norm, tokens, metrics })
}

/// DPO's statistics summed over the ranks, as TRL's means (`prefix` before each name: `eval_`
/// for evaluations); nothing for SFT.
fn reduce_stats(groups: &ProcessGroups, objective: &Objective, s: DpoStats) -> Result<Vec<(&'static str, f64)>> {
    if matches!(objective, Objective::Sft) {
        return Ok(vec![]);
    }
    let mut sums = [s.pairs as f64, s.rewards_chosen, s.rewards_rejected, s.accurate as f64, s.logps_chosen, s.logps_rejected];
    groups.world.all_reduce_f64(&mut sums)?;
    let total = DpoStats {
        pairs: sums[0] as usize,
        rewards_chosen: sums[1],
        rewards_rejected: sums[2],
        accurate: sums[3] as usize,
        logps_chosen: sums[4],
        logps_rejected: sums[5],
    };
    Ok(total.means())
}

/// The model's side files, plus (LoRA) the adapter settings, so `fsdp-app merge` can fold the
/// adapter of a checkpoint in.
fn checkpoint_side_files(cfg: &FinetuneConfig, boot: &Bootstrap) -> Result<Vec<(String, Vec<u8>)>> {
    let mut files = boot.side_files.clone();
    if let Some(lora) = &boot.lora {
        let config = crate::model_files::adapter::adapter_config_json(lora, &cfg.model);
        files.push((crate::model_files::adapter::ADAPTER_CONFIG.to_string(), serde_json::to_vec_pretty(&config)?));
    }
    Ok(files)
}

fn save_checkpoint(
    engine: &mut FsdpEngine,
    groups: &ProcessGroups,
    cfg: &FinetuneConfig,
    plan: &RunPlan,
    boot: &Bootstrap,
    done: usize,
    side_files: &[(String, Vec<u8>)],
) -> Result<()> {
    let t = Instant::now();
    let data = &boot.data;
    let trainer_state = json!({
        "step": done, "epoch": done / plan.steps_per_epoch, "samples_seen": done * plan.global_batch,
        "global_batch": plan.global_batch, "seed": cfg.seed, "shuffle": cfg.shuffle,
        "lr_schedule": {"type": format!("{:?}", cfg.schedule).to_lowercase(), "base_lr": cfg.lr,
                        "warmup_steps": cfg.warmup_for(plan.total_steps), "total_steps": plan.total_steps},
        // The only randomness in training is the data order, a function of (seed, epoch).
        "rng": {"shuffle_seed": cfg.seed},
        // Rank 0 writes the trainer state; only it knows the data's identity.
        "data": data.identity.as_ref().map(|i| identity::data_state(i, &DataCursor::at(done, data.samples.len(), plan.steps_per_epoch))),
    });
    let extras = SaveExtras { trainer_state, side_files, strategy: cfg.strategy.as_str().to_string(), total_limit: cfg.save_total_limit };
    let dir = sharded::save(engine, groups, &cfg.output_dir, &extras)?;
    if groups.world.rank() == 0 && cfg.verbose {
        eprintln!("saved {} in {:.2}s", dir.display(), t.elapsed().as_secs_f64());
    }
    Ok(())
}

/// An evaluation after step `step`, if the run has evaluation data: SFT's and DPO's on samples,
/// GRPO's (`grpo`: its inputs and state) on prompts.
fn run_eval(
    engine: &mut FsdpEngine,
    (groups, plan, boot, objective): (&ProcessGroups, &RunPlan, &Bootstrap, &Objective),
    grpo: Option<(StepInputs, &GrpoState)>,
    step: usize,
    log: &mut MetricsLog,
) -> Result<()> {
    if let Some((inputs, state)) = grpo {
        if boot.data.eval_prompts.is_empty() {
            return Ok(());
        }
        let (loss, metrics) = grpo_eval::evaluate(engine, &inputs, state, step)?;
        return log.eval(step, loss, None, &metrics);
    }
    if boot.data.eval_samples.is_empty() {
        return Ok(());
    }
    let (loss, metrics) = evaluate(engine, groups, objective, &boot.data.eval_samples, plan.micro_batch)?;
    let metrics: Vec<(String, f64)> = metrics.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    // Perplexity is a token loss's: SFT's.
    let perplexity = matches!(objective, Objective::Sft).then(|| loss.exp());
    log.eval(step, loss, perplexity, &metrics)
}

/// Mean loss over `samples` (and DPO's statistics), each rank taking every world-th batch of
/// whole examples. Ranks with no batch left run a fully masked one, so every rank makes the
/// same collectives.
fn evaluate(
    engine: &mut FsdpEngine,
    groups: &ProcessGroups,
    objective: &Objective,
    samples: &[Sample],
    batch: usize,
) -> Result<(f64, Vec<(&'static str, f64)>)> {
    let (rank, world) = (groups.world.rank(), groups.world.world_size());
    let rounds = samples.len().div_ceil(batch * world);
    let (mut loss, mut stats) = (0.0, DpoStats::default());
    let mut rows: Vec<&Sample> = vec![];
    let masked = Sample { input_ids: samples[0].input_ids.clone(), labels: vec![-100; samples[0].labels.len()], len: 0, segments: vec![] };
    for r in 0..rounds {
        let first = (r * world + rank) * batch;
        let mine: Vec<usize> = (first..(first + batch).min(samples.len())).collect();
        rows.extend(mine.iter().map(|&i| &samples[i]));
        loss += match mine.is_empty() {
            // A fully masked row: no loss, no pair, the same collectives as the other ranks'.
            true => Objective::Sft.run_micro_batch(
                engine,
                std::slice::from_ref(&masked),
                (Split::Eval, &[0]),
                Default::default(),
                None,
                &mut stats,
            )?,
            false => objective.run_micro_batch(engine, samples, (Split::Eval, &mine), Default::default(), None, &mut stats)?,
        };
    }
    let mut sums = [loss, objective.normaliser(&rows)];
    groups.world.all_reduce_f64(&mut sums)?;
    let metrics = reduce_stats(groups, objective, stats)?;
    Ok((sums[0] / sums[1].max(1.0), metrics))
}
