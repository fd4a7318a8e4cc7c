//! One GRPO optimizer step: when the step starts a new generation (every `num_iterations`
//! steps), this rank's prompts get their completions from the current policy
//! ([`super::rollouts`]), the graders score them, the rewards of every rank are summed into one
//! vector so each group's advantages (and the logged statistics) see the whole batch, and the
//! old and reference log-probabilities the loss needs are computed; then every micro-batch of
//! completions runs forward and backward under [`grpo_loss`], and the optimizer steps.
//!
//! Each rank holds whole groups (its `--batch-size` prompts per micro-batch, each with its
//! `num_generations` completions); completion `k` of the prompt at place `q` of the global
//! batch samples with a seed of (seed, generation, q·G + k), so a run's rollouts do not depend
//! on the number of ranks, and a resumed run draws what the uninterrupted one drew.

use std::cell::RefCell;
use std::collections::HashSet;
use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use models::{CausalLm, StageContext};
use serde_json::json;

use super::bootstrap::Bootstrap;
use super::config::FinetuneConfig;
use super::plan::RunPlan;
use super::rollouts::{self, Completion, Policy};
use super::step::{dropout_seed, StepOutcome};
use crate::dist::ProcessGroups;
use crate::fsdp::engine::FsdpEngine;
use crate::tokenize::TextTokenizer;
use crate::train::grpo::advantages::{advantages, reward_metrics};
use crate::train::grpo::graders::{GradeInput, Scores};
use crate::train::grpo::loss::{completion_logps, completion_positions, grpo_loss, token_weights, CompletionRow, LossStats, TokenTerms};
use crate::train::grpo::GrpoConfig;

/// Where every N-th step's rollouts are written (`--log-completions-steps`).
pub const ROLLOUTS_FILE: &str = "rollouts.jsonl";

/// What a GRPO run keeps between steps.
pub(super) struct GrpoState {
    tokenizer: TextTokenizer,
    eos: HashSet<u32>,
    pad: u32,
    /// The current generation's rollouts (reused for `num_iterations` steps).
    generation: Option<Generation>,
    /// Full fine-tuning with a KL term: the starting weights, whole, for the reference
    /// log-probabilities (a LoRA run's reference is its base with the adapters off instead).
    reference: Option<CausalLm>,
}

/// The rollouts of one generation on this rank, ready to train on.
struct Generation {
    index: usize,
    /// This rank's micro-batches of completions.
    micro: Vec<Vec<Row>>,
    /// Completion tokens of the global batch (DAPO's normaliser).
    global_tokens: usize,
    /// Prompt and completion tokens of the global batch.
    all_tokens: usize,
    /// Reward and completion statistics, and the generation's timings.
    metrics: Vec<(String, f64)>,
}

struct Row {
    prompt: Vec<u32>,
    completion: Vec<u32>,
    advantage: f64,
    old_logps: Option<Vec<f32>>,
    ref_logps: Option<Vec<f32>>,
}

impl GrpoState {
    pub fn new(boot: &Bootstrap) -> Result<Self> {
        let side = |name: &str| boot.side_file(name);
        let tokenizer = TextTokenizer::from_bytes(
            side("tokenizer.json").context("GRPO decodes its completions for the graders: the model needs a tokenizer.json")?,
            side("tokenizer_config.json"),
            side("chat_template.jinja"),
        )?;
        let mut eos: HashSet<u32> = boot.model_cfg.eos_token_ids.iter().copied().collect();
        if let Some(g) = side("generation_config.json") {
            let v: serde_json::Value = serde_json::from_slice(g).context("generation_config.json")?;
            eos.extend(models::config::token_id_list(&v.get("eos_token_id").cloned()));
        }
        if eos.is_empty() {
            bail!("GRPO's completions end at the model's eos token, and config.json names none (eos_token_id)");
        }
        let pad = boot.model_cfg.pad_token_id.or_else(|| boot.model_cfg.eos_token_ids.first().copied()).unwrap_or(0);
        Ok(Self { tokenizer, eos, pad, generation: None, reference: None })
    }

    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    pub fn eos(&self) -> &HashSet<u32> {
        &self.eos
    }

    /// Full fine-tuning with a KL term: the starting weights, once the first step has gathered
    /// them.
    pub fn reference(&self) -> Option<&CausalLm> {
        self.reference.as_ref()
    }
}

/// Everything a step reads but does not change.
pub(super) struct StepInputs<'a> {
    pub groups: &'a ProcessGroups,
    pub cfg: &'a FinetuneConfig,
    pub plan: &'a RunPlan,
    pub boot: &'a Bootstrap,
    pub run: &'a GrpoConfig,
    /// The epoch's prompt order.
    pub order: &'a [usize],
}

pub(super) fn train_step(engine: &mut FsdpEngine, x: &StepInputs, state: &mut GrpoState, (step, lr): (usize, f64)) -> Result<StepOutcome> {
    let settings = &x.run.settings;
    let index = step / settings.num_iterations;
    if state.generation.as_ref().is_none_or(|g| g.index != index) {
        // The old rollouts go before the new ones are made, not after.
        state.generation = None;
        state.generation = Some(generate(engine, x, state, index, step)?);
    }
    let generation = state.generation.as_ref().expect("made above");
    let start = Instant::now();
    let world = x.groups.world.world_size();
    let mut stats = LossStats::default();
    for (a, rows) in generation.micro.iter().enumerate() {
        let batch = micro_batch(rows, state.pad, engine.device())?;
        let lengths: Vec<usize> = rows.iter().map(|r| r.completion.len()).collect();
        let terms = TokenTerms {
            advantage: rows.iter().flat_map(|r| std::iter::repeat_n(r.advantage, r.completion.len())).collect(),
            old_logp: concat(rows.iter().map(|r| r.old_logps.as_deref())),
            ref_logp: concat(rows.iter().map(|r| r.ref_logps.as_deref())),
            weight: token_weights(
                settings.loss_type,
                &lengths,
                settings.max_completion_length,
                (x.plan.grad_accum, world),
                generation.global_tokens,
            ),
        };
        let first = (a * world + x.groups.world.rank()) * rows.len();
        let row_seeds = (first..first + rows.len()).map(|i| dropout_seed(x.cfg.seed, step, i)).collect();
        let ctx = StageContext { row_seeds: Some(row_seeds), keep_positions: Some(batch.keep.clone()), ..Default::default() };
        let micro_stats = RefCell::new(LossStats::default());
        let loss = |logits: &Tensor| {
            let (logps, entropy) = completion_logps(logits, &batch.rows, settings.temperature)?;
            let (loss, s) = grpo_loss(settings, &logps, &entropy, &terms)?;
            *micro_stats.borrow_mut() = s;
            Ok(loss)
        };
        engine.forward_backward(&batch.input, &ctx, &loss, 1.0)?;
        stats.add(&micro_stats.into_inner());
    }
    let mut sums = stats.to_vec();
    x.groups.world.all_reduce_f64(&mut sums)?;
    let total = LossStats::from_slice(&sums);
    let optimizer = engine.optimizer_step(lr, x.cfg.max_grad_norm)?;
    let mut metrics = generation.metrics.clone();
    metrics.extend(total.means(settings.beta > 0.0).into_iter().map(|(k, v)| (k.to_string(), v)));
    metrics.push(("time/training_s".to_string(), start.elapsed().as_secs_f64()));
    Ok(StepOutcome { loss: total.loss, grad_norm: optimizer.grad_norm, tokens: generation.all_tokens as f64, metrics })
}

/// Concatenates per-row values, `None` when the rows have none.
fn concat<'a>(rows: impl Iterator<Item = Option<&'a [f32]>>) -> Option<Vec<f32>> {
    rows.map(|r| r.map(<[f32]>::to_vec)).collect::<Option<Vec<_>>>().map(|v| v.concat())
}

/// A micro-batch of (prompt + completion) rows, right-padded, and where each completion is.
struct MicroBatch {
    input: Tensor,
    rows: Vec<CompletionRow>,
    /// The positions whose logits the loss reads.
    keep: std::sync::Arc<[u32]>,
}

fn micro_batch(rows: &[Row], pad: u32, device: &candle_core::Device) -> Result<MicroBatch> {
    let width = rows.iter().map(|r| r.prompt.len() + r.completion.len()).max().unwrap_or(1);
    let mut ids = Vec::with_capacity(rows.len() * width);
    let mut placed = Vec::with_capacity(rows.len());
    for (i, r) in rows.iter().enumerate() {
        ids.extend_from_slice(&r.prompt);
        ids.extend_from_slice(&r.completion);
        ids.resize((i + 1) * width, pad);
        // Position p's logits predict token p + 1.
        let start = r.prompt.len() - 1;
        placed.push(CompletionRow { row: i, positions: start..start + r.completion.len(), tokens: r.completion.clone() });
    }
    let keep = completion_positions(&placed, width)?.into();
    Ok(MicroBatch { input: Tensor::from_vec(ids, (rows.len(), width), device)?, rows: placed, keep })
}

/// This rank's prompts of generation `index`, in micro-batch order: (place in the global
/// batch, data row).
fn my_prompts(x: &StepInputs, index: usize) -> Vec<(usize, usize)> {
    let (rank, world) = (x.groups.world.rank(), x.plan.world_size);
    let batches_per_epoch = x.plan.steps_per_epoch / x.run.settings.num_iterations;
    let base = (index % batches_per_epoch) * x.plan.global_batch;
    (0..x.plan.grad_accum)
        .flat_map(|a| {
            let first = (a * world + rank) * x.plan.micro_batch;
            (first..first + x.plan.micro_batch).map(move |q| (q, x.order[base + q]))
        })
        .collect()
}

/// The sampling seed of the completion at `slot` (place in the global batch × G + k) of rollout
/// batch `generation`: a function of the run's seed and the completion's place only.
fn rollout_seed(seed: u64, generation: usize, slot: usize) -> u64 {
    let mut state = seed ^ ((generation as u64) << 32) ^ (slot as u64).wrapping_mul(0x9E37_79B9);
    kernels::rng::splitmix64(&mut state)
}

/// Rollout batch `index` on this rank (made at step `step`): sampled (or given), graded, its
/// advantages and the log-probabilities the loss needs.
fn generate(engine: &mut FsdpEngine, x: &StepInputs, state: &mut GrpoState, index: usize, step: usize) -> Result<Generation> {
    let settings = &x.run.settings;
    let g = settings.num_generations;
    let mine = my_prompts(x, index);
    let prompts: Vec<&[u32]> = mine.iter().map(|&(_, d)| x.boot.data.prompts[d].ids.as_slice()).collect();
    let dtype = if engine.device().is_cpu() { DType::F32 } else { x.cfg.param_dtype };
    let needs_whole_reference = settings.beta > 0.0 && x.boot.lora.is_none() && state.reference.is_none();
    if needs_whole_reference && engine.step > 0 {
        bail!("a resumed full fine-tuning run with --beta > 0 has no starting weights for its reference model; resume is supported with --beta 0 or LoRA");
    }

    let start = Instant::now();
    // One gather serves the sampling and, at the first step, the reference: the starting
    // weights, whose tensors the reference keeps (shared, not copied) once the policy is dropped.
    let policy = match x.run.given.is_none() || needs_whole_reference {
        true => Some(Policy::gather(engine, &x.boot.model_cfg, x.boot.lora.as_ref(), dtype)?),
        false => None,
    };
    if needs_whole_reference {
        state.reference = policy.as_ref().map(|p| p.model.clone());
    }
    let gather_s = start.elapsed().as_secs_f64();
    let completions: Vec<Completion> = match (&x.run.given, &policy) {
        (Some(given), _) => mine
            .iter()
            .flat_map(|&(_, d)| given.completions[d].iter())
            .map(|ids| Completion { truncated: !ids.last().is_some_and(|t| state.eos.contains(t)), ids: ids.clone() })
            .collect(),
        (None, Some(policy)) => {
            let seeds: Vec<u64> = mine.iter().flat_map(|&(q, _)| (0..g).map(move |k| rollout_seed(x.cfg.seed, index, q * g + k))).collect();
            rollouts::sample(policy, &state.tokenizer, &state.eos, settings, &prompts, &seeds)?
        }
        (None, None) => unreachable!("a run without given rollouts gathers its policy"),
    };
    drop(policy);
    let generation_s = start.elapsed().as_secs_f64();

    let start = Instant::now();
    let texts = rollouts::texts(&state.tokenizer, &completions)?;
    let scores = match (&x.run.given, &x.run.grader) {
        (Some(given), _) => Scores { total: mine.iter().flat_map(|&(_, d)| given.rewards[d].iter().copied()).collect(), by_grader: vec![] },
        (None, Some(grader)) => {
            let inputs: Vec<GradeInput> = (0..completions.len())
                .map(|j| GradeInput { output_text: &texts[j], item: &x.boot.data.prompts[mine[j / g].1].item })
                .collect();
            grader.score(&inputs)?
        }
        (None, None) => bail!("a GRPO run needs a grader (--grader FILE)"),
    };
    let scoring_s = start.elapsed().as_secs_f64();

    // Every rank's rewards, per-grader scores, completion lengths, truncations and prompt
    // lengths in one vector, each rank filling its completions' slots.
    let n = x.plan.global_batch * g;
    let graders = scores.by_grader.len();
    let parts = 4 + graders;
    let mut all = vec![0f64; parts * n];
    for (j, c) in completions.iter().enumerate() {
        let slot = mine[j / g].0 * g + j % g;
        all[slot] = scores.total[j];
        for (p, (_, s)) in scores.by_grader.iter().enumerate() {
            all[(1 + p) * n + slot] = s[j];
        }
        all[(1 + graders) * n + slot] = c.ids.len() as f64;
        all[(2 + graders) * n + slot] = f64::from(u8::from(c.truncated));
        // The prompt once per group.
        if j % g == 0 {
            all[(3 + graders) * n + slot] = prompts[j / g].len() as f64;
        }
    }
    x.groups.world.all_reduce_f64(&mut all)?;
    let part = |p: usize| &all[p * n..(p + 1) * n];
    let rewards = part(0);
    let lengths = part(1 + graders);
    let truncated = part(2 + graders);
    let prompt_tokens: f64 = part(3 + graders).iter().sum();
    let advantages = advantages(rewards, g, settings.scale_rewards);

    let mut metrics: Vec<(String, f64)> =
        reward_metrics(rewards, g, settings.scale_rewards).into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    for (p, (name, _)) in scores.by_grader.iter().enumerate() {
        let s = part(1 + p);
        let mean = s.iter().sum::<f64>() / n as f64;
        let std = (s.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n.max(2) - 1) as f64).sqrt();
        metrics.push((format!("rewards/{name}/mean"), mean));
        metrics.push((format!("rewards/{name}/std"), std));
        if let Some((_, t)) = x.run.grader.as_ref().and_then(|gr| gr.pass_thresholds().into_iter().find(|(n2, _)| n2 == name)) {
            metrics.push((format!("rewards/{name}/pass_rate"), s.iter().filter(|v| **v >= t).count() as f64 / n as f64));
        }
    }
    let max_len = lengths.iter().copied().fold(0.0, f64::max);
    let min_len = lengths.iter().copied().fold(f64::INFINITY, f64::min);
    metrics.extend([
        ("completions/mean_length".to_string(), lengths.iter().sum::<f64>() / n as f64),
        ("completions/min_length".to_string(), min_len),
        ("completions/max_length".to_string(), max_len),
        ("completions/clipped_ratio".to_string(), truncated.iter().sum::<f64>() / n as f64),
        ("time/gather_s".to_string(), gather_s),
        ("time/generation_s".to_string(), generation_s),
        ("time/scoring_s".to_string(), scoring_s),
    ]);

    let micro_prompts = x.plan.micro_batch;
    let mut micro: Vec<Vec<Row>> = vec![];
    for (a, chunk) in completions.chunks(micro_prompts * g).enumerate() {
        micro.push(
            chunk
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let j = a * micro_prompts * g + i;
                    Row {
                        prompt: prompts[j / g].to_vec(),
                        completion: c.ids.clone(),
                        advantage: advantages[mine[j / g].0 * g + j % g],
                        old_logps: None,
                        ref_logps: None,
                    }
                })
                .collect(),
        );
    }
    let start = Instant::now();
    if settings.num_iterations > 1 {
        for rows in &mut micro {
            let logps = engine_logps(engine, rows, state.pad, settings.temperature, false)?;
            for (r, l) in rows.iter_mut().zip(logps) {
                r.old_logps = Some(l);
            }
        }
    }
    if settings.beta > 0.0 {
        for rows in &mut micro {
            let logps = match &state.reference {
                Some(model) => model_logps(model, rows, state.pad, settings.temperature)?,
                None => engine_logps(engine, rows, state.pad, settings.temperature, true)?,
            };
            for (r, l) in rows.iter_mut().zip(logps) {
                r.ref_logps = Some(l);
            }
        }
    }
    metrics.push(("time/logps_s".to_string(), start.elapsed().as_secs_f64()));
    if settings.log_completions_steps > 0 && (step + 1).is_multiple_of(settings.log_completions_steps) {
        log_rollouts(x, &state.tokenizer, step, (&mine, g), &texts, &scores, &advantages)?;
    }
    let global_tokens = lengths.iter().sum::<f64>() as usize;
    Ok(Generation { index, micro, global_tokens, all_tokens: global_tokens + prompt_tokens as usize, metrics })
}

/// Each row's completion log-probabilities under the engine's weights (the base alone with
/// `adapters_off`), no gradient.
fn engine_logps(engine: &mut FsdpEngine, rows: &[Row], pad: u32, temperature: f64, adapters_off: bool) -> Result<Vec<Vec<f32>>> {
    let batch = micro_batch(rows, pad, engine.device())?;
    let ctx = StageContext { adapters_off, keep_positions: Some(batch.keep.clone()), ..Default::default() };
    let out = RefCell::new(vec![]);
    let keep = |logits: &Tensor| {
        let (logps, _) = completion_logps(logits, &batch.rows, temperature)?;
        *out.borrow_mut() = logps.to_vec1::<f32>()?;
        logps.sum_all()
    };
    engine.forward_loss(&batch.input, &ctx, &keep)?;
    Ok(split_rows(out.into_inner(), rows))
}

/// As [`engine_logps`], from a whole model on this rank.
fn model_logps(model: &CausalLm, rows: &[Row], pad: u32, temperature: f64) -> Result<Vec<Vec<f32>>> {
    let batch = micro_batch(rows, pad, model.device())?;
    let logits = model.forward(&batch.input)?;
    let (logps, _) = completion_logps(&logits, &batch.rows, temperature)?;
    Ok(split_rows(logps.to_vec1::<f32>()?, rows))
}

fn split_rows(mut flat: Vec<f32>, rows: &[Row]) -> Vec<Vec<f32>> {
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let rest = flat.split_off(r.completion.len());
        out.push(std::mem::replace(&mut flat, rest));
    }
    out
}

/// Appends the step's rollouts (every rank's) to OUTPUT/rollouts.jsonl on rank 0.
fn log_rollouts(
    x: &StepInputs,
    tokenizer: &TextTokenizer,
    step: usize,
    (mine, g): (&[(usize, usize)], usize),
    texts: &[String],
    scores: &Scores,
    advantages: &[f64],
) -> Result<()> {
    let mut lines = String::new();
    for (j, text) in texts.iter().enumerate() {
        let (q, d) = mine[j / g];
        let slot = q * g + j % g;
        let by_grader: serde_json::Map<String, serde_json::Value> =
            scores.by_grader.iter().map(|(n, s)| (n.clone(), json!(s[j]))).collect();
        let row = json!({
            "step": step + 1, "place": slot, "row": d + 1,
            "prompt": tokenizer.decode(&x.boot.data.prompts[d].ids, false)?, "completion": text,
            "reward": scores.total[j], "advantage": advantages[slot], "graders": by_grader,
        });
        lines += &format!("{row}\n");
    }
    let all = x.groups.world.all_gather_bytes(lines.into_bytes())?;
    if x.groups.world.rank() == 0 {
        let path = x.cfg.output_dir.join(ROLLOUTS_FILE);
        let mut f =
            std::fs::OpenOptions::new().create(true).append(true).open(&path).with_context(|| format!("opening {}", path.display()))?;
        for part in all {
            f.write_all(&part)?;
        }
    }
    Ok(())
}
