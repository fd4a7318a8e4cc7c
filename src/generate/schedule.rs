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
    // The rest of the sequences: single decode steps and finished ones take their own step;
    // prompts share what is left of the budget.
    let mut prompts = vec![];
    for (i, slot) in out.iter_mut().enumerate() {
        if slot.is_none() {
            match seqs[i].prompt_tokens_to_feed() {
                0 | 1 => *slot = Some(seqs[i].step(model, tokenizer, usize::MAX)),
                n => prompts.push((i, n)),
            }
        }
    }
    // A prompt alone may take the whole budget; beside other sequences the prompts take at most
    // half (vLLM's long-prefill threshold), so the others' steps stay short: a decoding
    // stream's next token, or a newly arrived short prompt, waits for half a chunk, not a whole.
    let budget = max_batched_tokens.saturating_sub(decoding.len());
    let budget = if seqs.len() > 1 { budget.div_ceil(2) } else { budget };
    for (i, n) in prefill_shares(&prompts, budget) {
        out[i] = Some(match n {
            0 => Ok(SequenceStep::default()),
            n => seqs[i].step(model, tokenizer, n),
        });
    }
    out.into_iter().map(Option::unwrap).collect()
}

/// Each prompt's tokens this step, for `prompts` as (index, tokens left to feed) in arrival
/// order and `budget` tokens: the oldest gets at least [`MIN_PREFILL_TOKENS`] (a long prompt
/// keeps moving under any load), then the shortest go first, so a short request sent during a
/// long prefill is answered after one step, not after the whole long prompt (head-of-line
/// blocking), and the long prompt takes the rest.
fn prefill_shares(prompts: &[(usize, usize)], budget: usize) -> Vec<(usize, usize)> {
    let Some(&(oldest, oldest_left)) = prompts.first() else { return vec![] };
    let reserved = MIN_PREFILL_TOKENS.min(oldest_left);
    let mut left = budget.saturating_sub(reserved);
    let mut by_length: Vec<(usize, usize)> = prompts.to_vec();
    by_length.sort_by_key(|&(_, n)| n);
    by_length
        .into_iter()
        .map(|(i, n)| {
            let extra = if i == oldest { reserved } else { 0 };
            let take = (n - extra).min(left);
            left -= take;
            (i, take + extra)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_prompts_go_first_and_the_oldest_always_moves() {
        // A long prompt (3,000 left) and a short one (10): the short is fed whole.
        assert_eq!(prefill_shares(&[(0, 3000), (1, 10)], 256), vec![(1, 10), (0, 246)]);
        // No budget left after the decode steps: the oldest still gets its minimum.
        assert_eq!(prefill_shares(&[(0, 3000), (1, 10)], 0), vec![(1, 0), (0, MIN_PREFILL_TOKENS)]);
        // The oldest is short: it takes what it has left, no more.
        assert_eq!(prefill_shares(&[(2, 5), (0, 900), (1, 400)], 300), vec![(2, 5), (1, 295), (0, 0)]);
        assert_eq!(prefill_shares(&[], 300), vec![]);
    }
}
