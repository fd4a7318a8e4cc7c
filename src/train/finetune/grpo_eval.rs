//! GRPO's evaluation (`--eval-data` / `--eval-split`, every `--eval-steps` and at the end): the
//! evaluation prompts sampled `num_generations_eval` times by the current policy, graded, and
//! logged as TRL's GRPO evaluation logs them: `eval_reward`, `eval_reward_std`, each grader's
//! `eval_rewards/<name>/mean`, and `eval_loss`, the loss of those completions at ratio 1 (the
//! policy term of the `loss_type` over the whole evaluation set, plus the KL term with `--beta`).
//!
//! Each rank samples and scores every world-th prompt with the policy made whole for it, and
//! scores its completions' log-probabilities with that whole model too: no collective besides the
//! gather and one sum, whatever each rank's share.

use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use models::{CausalLm, KvCache, RowAdapters};

use super::grpo_step::{GrpoState, StepInputs};
use super::rollouts::{self, Policy};
use crate::fsdp::engine::FsdpEngine;
use crate::train::grpo::advantages::advantages;
use crate::train::grpo::graders::GradeInput;
use crate::train::grpo::loss::{completion_logps, CompletionRow};
use crate::train::grpo::GrpoLossType;

/// A marker in evaluation seeds, so they never equal a training rollout's.
const EVAL_SEED: u64 = 0xE7A1_0000_0000_0000;

/// `(eval_loss, metrics)` after step `step` (every rank calls it).
pub(super) fn evaluate(engine: &mut FsdpEngine, x: &StepInputs, state: &GrpoState, step: usize) -> Result<(f64, Vec<(String, f64)>)> {
    let (rank, world) = (x.groups.world.rank(), x.groups.world.world_size());
    let settings = &x.run.settings;
    let Some(grader) = &x.run.grader else { bail!("evaluation samples and grades its completions: it needs a grader") };
    let g = settings.eval_generations();
    let start = Instant::now();
    let dtype = if engine.device().is_cpu() { DType::F32 } else { x.cfg.param_dtype };
    let policy = Policy::gather(engine, &x.boot.model_cfg, x.boot.lora.as_ref(), dtype)?;
    let mine: Vec<usize> = (rank..x.boot.data.eval_prompts.len()).step_by(world).collect();
    let prompts: Vec<&[u32]> = mine.iter().map(|&i| x.boot.data.eval_prompts[i].ids.as_slice()).collect();
    let seeds: Vec<u64> = mine.iter().flat_map(|&i| (0..g).map(move |k| EVAL_SEED ^ ((step as u64) << 32) ^ (i * g + k) as u64)).collect();
    let eval_settings = crate::train::grpo::GrpoSettings { num_generations: g, ..settings.clone() };
    let completions = rollouts::sample(&policy, state.tokenizer(), state.eos(), &eval_settings, &prompts, &seeds)?;
    let texts = rollouts::texts(state.tokenizer(), &completions)?;
    let inputs: Vec<GradeInput> =
        (0..completions.len()).map(|j| GradeInput { output_text: &texts[j], item: &x.boot.data.eval_prompts[mine[j / g]].item }).collect();
    let scores = grader.score(&inputs)?;
    // Groups are whole on this rank: their advantages are local.
    let adv = advantages(&scores.total, g, settings.scale_rewards);

    // Per completion: its tokens' summed loss at ratio 1 (−A per token, plus the KL term).
    let (mut token_sum, mut seq_mean_sum, mut tokens) = (0.0, 0.0, 0.0);
    for (j, c) in completions.iter().enumerate() {
        let prompt = prompts[j / g];
        let logps = row_logps(&policy.model, &policy.adapter_rows(), prompt, &c.ids, settings.temperature)?;
        let refs = match (settings.beta > 0.0, state.reference()) {
            (false, _) => None,
            (true, Some(reference)) => Some(row_logps(reference, &RowAdapters::default(), prompt, &c.ids, settings.temperature)?),
            // LoRA: the base without its adapter.
            (true, None) => Some(row_logps(&policy.model, &RowAdapters::default(), prompt, &c.ids, settings.temperature)?),
        };
        let mut sum = 0.0;
        for (t, &lp) in logps.iter().enumerate() {
            let mut l = -adv[j];
            if let Some(r) = &refs {
                let d = (r[t] - lp) as f64;
                l += settings.beta * (d.exp() - d - 1.0);
            }
            sum += l;
        }
        token_sum += sum;
        seq_mean_sum += sum / logps.len().max(1) as f64;
        tokens += logps.len() as f64;
    }
    let n_local = completions.len();
    // The reward, then each grader's: sum and sum of squares.
    let parts = 1 + scores.by_grader.len();
    let mut sums = vec![0f64; 4 + 2 * parts];
    sums[..4].copy_from_slice(&[token_sum, seq_mean_sum, tokens, n_local as f64]);
    for (p, s) in std::iter::once(&scores.total).chain(scores.by_grader.iter().map(|(_, s)| s)).enumerate() {
        sums[4 + 2 * p] = s.iter().sum();
        sums[5 + 2 * p] = s.iter().map(|v| v * v).sum();
    }
    x.groups.world.all_reduce_f64(&mut sums)?;
    let [token_sum, seq_mean_sum, tokens, n] = [sums[0], sums[1], sums[2], sums[3]];
    let loss = match settings.loss_type {
        GrpoLossType::Grpo => seq_mean_sum / n.max(1.0),
        GrpoLossType::Bnpo | GrpoLossType::Dapo => token_sum / tokens.max(1.0),
        GrpoLossType::DrGrpo => token_sum / (n.max(1.0) * settings.max_completion_length as f64),
    };
    let mean_std = |p: usize| {
        let (s, sq) = (sums[4 + 2 * p], sums[5 + 2 * p]);
        let mean = s / n.max(1.0);
        (mean, ((sq - n * mean * mean) / (n - 1.0).max(1.0)).max(0.0).sqrt())
    };
    let (reward, reward_std) = mean_std(0);
    let mut metrics = vec![("reward".to_string(), reward), ("reward_std".to_string(), reward_std)];
    for (p, (name, _)) in scores.by_grader.iter().enumerate() {
        metrics.push((format!("rewards/{name}/mean"), mean_std(1 + p).0));
    }
    metrics.push(("completions/mean_length".to_string(), tokens / n.max(1.0)));
    metrics.push(("time/eval_s".to_string(), start.elapsed().as_secs_f64()));
    Ok((loss, metrics))
}

/// The log-probabilities of `completion`'s tokens after `prompt` under `model` (with
/// `adapters`), no gradient.
fn row_logps(model: &CausalLm, adapters: &RowAdapters, prompt: &[u32], completion: &[u32], temperature: f64) -> Result<Vec<f32>> {
    let ids: Vec<u32> = prompt.iter().chain(completion).copied().collect();
    let mut cache = KvCache::new(model.config());
    let logits = model.forward_cached_all(&Tensor::new(ids.as_slice(), model.device())?.unsqueeze(0)?, &mut cache, adapters)?;
    let start = prompt.len() - 1;
    let row = CompletionRow { row: 0, positions: start..start + completion.len(), tokens: completion.to_vec() };
    let (logps, _) = completion_logps(&logits, &[row], temperature)?;
    Ok(logps.to_vec1::<f32>()?)
}
