//! One step of many sequences: the decoding ones as one batched forward, the others (prompts
//! being fed, finished ones) each their own.

use std::sync::Arc;

use anyhow::Result;
use models::{CausalLm, KvCache, RowAdapters, ServingAdapter};

use super::{Sequence, SequenceStep};
use crate::tokenize::TextTokenizer;

/// Prompt tokens the oldest prompt being fed gets in a step even when the decoding sequences
/// take the whole budget: a long prompt keeps moving under any load.
pub const MIN_PREFILL_TOKENS: usize = 32;

/// One step for every sequence in `seqs`, in at most `max_batched_tokens` tokens (vLLM's
/// `max_num_batched_tokens`, decodes first): one decode step for every sequence that
/// `is_decoding`, batched through `CausalLm::forward_decode_rows`; then the prompts being fed,
/// oldest first (`seqs` is in arrival order), a chunk each of what budget is left (the first
/// at least [`MIN_PREFILL_TOKENS`]); a prompt left without budget this step waits (an empty
/// step). Finished sequences take their own `step`. Results come in the order of `seqs`.
pub fn step_all(
    model: &CausalLm,
    tokenizer: &TextTokenizer,
    seqs: &mut [&mut Sequence],
    max_batched_tokens: usize,
) -> Vec<Result<SequenceStep>> {
    let decoding: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].is_decoding()).collect();
    let mut out: Vec<Option<Result<SequenceStep>>> = (0..seqs.len()).map(|_| None).collect();
    if decoding.len() > 1 {
        let tokens: Vec<u32> = decoding.iter().map(|&i| seqs[i].pending[0]).collect();
        let batched = {
            let per_row: Vec<Option<&Arc<ServingAdapter>>> = decoding.iter().map(|&i| seqs[i].adapter.as_ref()).collect();
            let adapters = RowAdapters::of_rows(&per_row, model.device());
            let mut caches: Vec<&mut KvCache> = seqs.iter_mut().filter(|q| q.is_decoding()).map(|q| &mut q.cache).collect();
            adapters.and_then(|a| Ok(model.forward_decode_rows(&tokens, &mut caches, &a)?))
        };
        match batched {
            Ok(logits) => {
                for (row, &i) in decoding.iter().enumerate() {
                    out[i] = Some(logits.get(row).map_err(anyhow::Error::from).and_then(|l| seqs[i].accept(l, tokenizer)));
                }
            }
            Err(e) => {
                let msg = format!("{e:#}");
                for &i in &decoding {
                    out[i] = Some(Err(anyhow::anyhow!("batched decode: {msg}")));
                }
            }
        }
    }
    let mut budget = max_batched_tokens.saturating_sub(decoding.len());
    let mut first_prompt = true;
    for (i, slot) in out.iter_mut().enumerate() {
        if slot.is_some() {
            continue;
        }
        let feeding = seqs[i].prompt_tokens_to_feed();
        if feeding <= 1 {
            // A single decode step or a finished sequence.
            *slot = Some(seqs[i].step(model, tokenizer, usize::MAX));
            continue;
        }
        let n = if first_prompt { budget.max(MIN_PREFILL_TOKENS) } else { budget };
        first_prompt = false;
        if n == 0 {
            *slot = Some(Ok(SequenceStep::default()));
            continue;
        }
        *slot = Some(seqs[i].step(model, tokenizer, n));
        budget = budget.saturating_sub(n.min(feeding));
    }
    out.into_iter().map(Option::unwrap).collect()
}
