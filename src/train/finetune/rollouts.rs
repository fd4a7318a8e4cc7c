//! GRPO's rollouts on this rank: the policy made whole from the engine's shards, then its
//! completions of this rank's prompts sampled by the serving engine's step ([`step_all`]:
//! decodes batched across every sequence), each group's prompt prefilled once and its keys and
//! values copied to the group's completions (full blocks shared, the last one copied).
//!
//! Making the policy whole: every unit is all-gathered in turn (the export path, so every rank
//! takes part) into one model on each rank, built for generation and dropped after it; the
//! run's peak memory grows by one unsharded copy of the weights during generation. A LoRA
//! policy is the base plus its adapter served through the per-request adapter path (never
//! merged), so the rollouts use exactly the adapter being trained.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;
use models::{CausalLm, KvCache, RowAdapters, ServingAdapter};

use crate::fsdp::engine::FsdpEngine;
use crate::generate::{step_all, SamplingParams, Sequence, DEFAULT_MAX_PREFILL_TOKENS};
use crate::tokenize::TextTokenizer;
use crate::train::grpo::GrpoSettings;

/// The policy as it is now, whole on this rank, ready to generate.
pub(super) struct Policy {
    pub model: CausalLm,
    /// A LoRA run's adapter (the base in `model`).
    pub adapter: Option<Arc<ServingAdapter>>,
}

impl Policy {
    /// Gathers every unit (a collective: every rank calls it) into a model on this rank that
    /// computes in `dtype`.
    pub fn gather(engine: &FsdpEngine, cfg: &models::ModelConfig, lora: Option<&models::LoraSettings>, dtype: DType) -> Result<Self> {
        let mut base = HashMap::new();
        let mut adapter = HashMap::new();
        for u in 0..engine.units().count() {
            for (name, t) in engine.full_unit(u)? {
                match models::lora::is_adapter_tensor(&name) {
                    true => adapter.insert(name, t),
                    false => base.insert(name, t),
                };
            }
        }
        let device = engine.device().clone();
        let model =
            CausalLm::new(cfg, None, VarBuilder::from_tensors(base, dtype, &device)).context("building the policy for generation")?;
        let adapter = match lora {
            // The engine's adapter names are the serving path's (`<module>.lora_A.weight`).
            Some(settings) => Some(Arc::new(ServingAdapter::new("policy", settings, adapter, dtype, &device)?)),
            None => None,
        };
        Ok(Self { model, adapter })
    }
}

impl Policy {
    /// The adapter for every row of a forward (none for full fine-tuning).
    pub fn adapter_rows(&self) -> RowAdapters {
        RowAdapters::all(self.adapter.as_ref())
    }
}

/// One sampled completion.
#[derive(Debug, Clone)]
pub(super) struct Completion {
    /// The generated ids, with the eos token that ended them (TRL trains on it too).
    pub ids: Vec<u32>,
    /// Ended by the length limit rather than eos.
    pub truncated: bool,
}

/// `G` completions of each prompt, in prompt order (a prompt's completions consecutive);
/// completion `j` of the list samples with `seeds[j]`.
pub(super) fn sample(
    policy: &Policy,
    tokenizer: &TextTokenizer,
    eos: &HashSet<u32>,
    settings: &GrpoSettings,
    prompts: &[&[u32]],
    seeds: &[u64],
) -> Result<Vec<Completion>> {
    let g = settings.num_generations;
    let params = |seed| SamplingParams {
        max_new_tokens: settings.max_completion_length,
        temperature: settings.temperature,
        top_p: Some(settings.top_p),
        top_k: settings.top_k,
        seed,
        ..SamplingParams::greedy(settings.max_completion_length)
    };
    let model = &policy.model;
    let new_seq = |prompt: &[u32], seed| -> Result<Sequence> {
        let mut seq = Sequence::new(model, prompt, eos, &params(seed))?;
        if let Some(a) = &policy.adapter {
            seq.adapt(a.clone());
        }
        Ok(seq)
    };
    // Each prompt but its last token is fed once; the group's completions start from a copy of
    // those keys and values, and their first step (the last prompt token) is already a batched
    // decode.
    let mut all = Vec::with_capacity(prompts.len() * g);
    for (p, prompt) in prompts.iter().enumerate() {
        let shared = match prompt.len() {
            0 | 1 => None,
            n => Some(prefill(policy, &prompt[..n - 1])?),
        };
        for k in 0..g {
            let mut seq = new_seq(prompt, seeds[p * g + k])?;
            if let Some(cache) = &shared {
                seq.start_after(cache)?;
            }
            all.push(seq);
        }
    }
    run(model, tokenizer, &mut all, |s| s.finish_reason().is_none())?;
    Ok(all
        .iter()
        .map(|s| {
            let mut ids = s.generated_ids().to_vec();
            ids.extend(s.eos_token());
            Completion { truncated: s.eos_token().is_none(), ids }
        })
        .collect())
}

/// The keys and values of `tokens` under the policy, fed in chunks.
fn prefill(policy: &Policy, tokens: &[u32]) -> Result<KvCache> {
    let model = &policy.model;
    let mut cache = KvCache::new(model.config());
    let adapters = RowAdapters::all(policy.adapter.as_ref());
    for chunk in tokens.chunks(DEFAULT_MAX_PREFILL_TOKENS) {
        model.feed(&Tensor::new(chunk, model.device())?.unsqueeze(0)?, &mut cache, &adapters)?;
    }
    Ok(cache)
}

/// Steps every sequence for which `going` holds, batched, until none does.
fn run(model: &CausalLm, tokenizer: &TextTokenizer, seqs: &mut [Sequence], going: impl Fn(&Sequence) -> bool) -> Result<()> {
    loop {
        let mut live: Vec<&mut Sequence> = seqs.iter_mut().filter(|s| going(s)).collect();
        if live.is_empty() {
            return Ok(());
        }
        // Every live sequence decodes in one batched forward; prompts share what is left.
        let budget = live.len() + DEFAULT_MAX_PREFILL_TOKENS * 4;
        for r in step_all(model, tokenizer, &mut live, budget) {
            r?;
        }
    }
}

/// Each completion's text as the graders see it (special tokens left out, as TRL decodes).
pub(super) fn texts(tokenizer: &TextTokenizer, completions: &[Completion]) -> Result<Vec<String>> {
    completions.iter().map(|c| tokenizer.decode(&c.ids, true)).collect()
}
