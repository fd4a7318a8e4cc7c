//! Phase 4, the loop: for each step, take this rank's micro-batches, forward + backward each,
//! one optimizer step; then log, and maybe evaluate, save a checkpoint, or export.

use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::Tensor;
use models::StageContext;
use serde_json::json;

use super::bootstrap::Bootstrap;
use super::config::FinetuneConfig;
use super::export::export_result;
use super::metrics_log::{MetricsLog, StepReport};
use super::plan::RunPlan;
use crate::checkpoint::identity::{self, DataCursor};
use crate::checkpoint::sharded::{self, SaveExtras};
use crate::dist::{all_reduce_scalar, ProcessGroups};
use crate::fsdp::engine::FsdpEngine;
use crate::fsdp::optim::lr_multiplier;
use crate::train::batch::collate;
use crate::train::data::{epoch_order, Sample};
use crate::train::loss::{next_token_targets, summed_token_loss};

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
) -> Result<Curve> {
    let data = &boot.data;
    let start_step = engine.step as usize;
    let mut log = MetricsLog::open(groups, cfg, plan.total_steps, start_step)?;
    let checkpoint_files = checkpoint_side_files(cfg, boot)?;
    let mut curve = Curve::default();
    // The data order is a pure function of (seed, epoch), so the cursor is the step.
    let mut order_epoch = start_step / plan.steps_per_epoch;
    let mut order = epoch_order(data.samples.len(), order_epoch, cfg.seed, cfg.shuffle);
    for step in start_step..plan.total_steps {
        let epoch = step / plan.steps_per_epoch;
        if epoch != order_epoch {
            order_epoch = epoch;
            order = epoch_order(data.samples.len(), epoch, cfg.seed, cfg.shuffle);
        }
        let start = Instant::now();
        let lr = cfg.lr * lr_multiplier(cfg.schedule, step, cfg.warmup_for(plan.total_steps), plan.total_steps);
        let micro = micro_batches(groups, plan, boot, &order, step);
        let StepOutcome { loss, grad_norm, tokens } = train_step(engine, groups, cfg, plan, &micro, step, lr)?;
        curve.losses.push(loss);
        curve.grad_norms.push(grad_norm);
        log.step(
            groups,
            engine.device(),
            &StepReport { step: step + 1, epoch, loss, lr, grad_norm, tokens, secs: start.elapsed().as_secs_f64() },
        )?;
        let done = step + 1;
        if cfg.eval_steps.is_some_and(|n| done % n == 0) && done != plan.total_steps {
            run_eval(engine, groups, plan, boot, done, &mut log)?;
        }
        if cfg.save_steps.is_some_and(|n| done % n == 0) || (cfg.save_each_epoch && plan.ends_epoch(done)) {
            save_checkpoint(engine, groups, cfg, plan, boot, done, &checkpoint_files)?;
        }
        if cfg.save_full_every.is_some_and(|n| done % n == 0) && done != plan.total_steps {
            export_result(engine, boot, &cfg.output_dir.join(format!("export-{done}")), cfg)?;
        }
    }
    log.finish();
    run_eval(engine, groups, plan, boot, plan.total_steps, &mut log)?;
    Ok(curve)
}

/// This rank's micro-batches of step `step`'s global batch: micro-batch `a` takes, for each
/// rank in turn, `micro_batch` consecutive samples of the epoch's order.
fn micro_batches<'a>(groups: &ProcessGroups, plan: &RunPlan, boot: &'a Bootstrap, order: &[usize], step: usize) -> Vec<Vec<&'a Sample>> {
    let (rank, world) = (groups.world.rank(), plan.world_size);
    let base = (step % plan.steps_per_epoch) * plan.global_batch;
    (0..plan.grad_accum)
        .map(|a| {
            let first = base + (a * world + rank) * plan.micro_batch;
            (first..first + plan.micro_batch).map(|i| &boot.data.samples[order[i]]).collect()
        })
        .collect()
}

/// What one step did, over all ranks.
struct StepOutcome {
    /// Mean token loss of the global batch.
    loss: f64,
    grad_norm: f64,
    /// Real (unpadded) tokens of the global batch: what tokens/s counts.
    tokens: f64,
}

/// Forward + backward of every micro-batch (the loss normalised by the global batch's target
/// tokens, so N ranks give one rank's gradients), then the optimizer step.
fn train_step(
    engine: &mut FsdpEngine,
    groups: &ProcessGroups,
    cfg: &FinetuneConfig,
    plan: &RunPlan,
    micro: &[Vec<&Sample>],
    step: usize,
    lr: f64,
) -> Result<StepOutcome> {
    let (rank, world) = (groups.world.rank(), groups.world.world_size());
    let local_targets: usize = micro.iter().flatten().map(|s| s.target_tokens()).sum();
    let batches: Vec<_> = micro.iter().map(|mb| collate(mb)).collect();
    let local_tokens: usize = batches.iter().map(|b| b.real_tokens).sum();
    let mut counts = [local_targets as f64, local_tokens as f64];
    groups.world.all_reduce_f64(&mut counts)?;
    let [global_targets, tokens] = counts;
    if global_targets == 0.0 {
        bail!("step {step}: the global batch has no target tokens (every label is -100)");
    }
    let mut local_loss = 0.0;
    for (a, batch) in batches.into_iter().enumerate() {
        let input = Tensor::from_vec(batch.input_ids, (batch.rows, batch.width), engine.device())?;
        // Dropout seeds from (seed, step, place in the global batch): the same masks on any
        // number of ranks, and in an activation-checkpointing recompute.
        let first = (a * world + rank) * plan.micro_batch;
        let row_seeds = (first..first + batch.rows).map(|i| dropout_seed(cfg.seed, step, i)).collect();
        let targets = next_token_targets(&batch.labels, batch.rows, batch.width);
        let ctx = StageContext { packing: batch.packing, row_seeds: Some(row_seeds), targets: Some(targets), ..Default::default() };
        local_loss += engine.forward_backward(&input, &ctx, &summed_token_loss, 1.0 / global_targets)?;
    }
    let loss = all_reduce_scalar(groups.world.as_ref(), local_loss)? / global_targets;
    let stats = engine.optimizer_step(lr, cfg.max_grad_norm)?;
    Ok(StepOutcome { loss, grad_norm: stats.grad_norm, tokens })
}

/// The dropout seed of the sample at `place` in step `step`'s global batch.
fn dropout_seed(seed: u64, step: usize, place: usize) -> u64 {
    let mut state = seed ^ ((step as u64) << 32) ^ place as u64;
    models::rng::splitmix64(&mut state)
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

fn run_eval(
    engine: &mut FsdpEngine,
    groups: &ProcessGroups,
    plan: &RunPlan,
    boot: &Bootstrap,
    step: usize,
    log: &mut MetricsLog,
) -> Result<()> {
    if boot.data.eval_samples.is_empty() {
        return Ok(());
    }
    let (loss, ppl) = evaluate(engine, groups, &boot.data.eval_samples, plan.micro_batch, plan.seq_len)?;
    log.eval(step, loss, ppl)
}

/// Mean token loss and perplexity over `samples`, each rank taking every world-th batch. Ranks
/// with no batch left run a fully masked one, so every rank makes the same collectives.
fn evaluate(engine: &mut FsdpEngine, groups: &ProcessGroups, samples: &[Sample], batch: usize, seq_len: usize) -> Result<(f64, f64)> {
    let (rank, world) = (groups.world.rank(), groups.world.world_size());
    let rounds = samples.len().div_ceil(batch * world);
    let (mut loss, mut tokens) = (0.0, 0.0);
    for r in 0..rounds {
        let first = (r * world + rank) * batch;
        let mb: Vec<Sample> = (first..first + batch)
            .map(|i| match samples.get(i) {
                Some(s) => s.clone(),
                None => Sample { input_ids: samples[0].input_ids.clone(), labels: vec![-100; seq_len], len: 0, segments: vec![] },
            })
            .collect();
        let refs: Vec<&Sample> = mb.iter().collect();
        let batch = collate(&refs);
        let input = Tensor::from_vec(batch.input_ids, (batch.rows, batch.width), engine.device())?;
        let ctx = StageContext {
            packing: batch.packing,
            targets: Some(next_token_targets(&batch.labels, batch.rows, batch.width)),
            ..Default::default()
        };
        loss += engine.forward_loss(&input, &ctx, &summed_token_loss)?;
        tokens += mb.iter().map(Sample::target_tokens).sum::<usize>() as f64;
    }
    let mut sums = [loss, tokens];
    groups.world.all_reduce_f64(&mut sums)?;
    let mean = sums[0] / sums[1].max(1.0);
    Ok((mean, mean.exp()))
}
