//! Perplexity of a text under a model, as llama.cpp's `llama-perplexity` reports it: `exp` of the
//! mean negative log-likelihood of the tokens scored. One window ([`perplexity`]): every token
//! after the first, each scored with all the tokens before it. Windows of a context size
//! ([`perplexity_windows`], for texts longer than one context): the text cut into consecutive
//! windows, each evaluated on its own (its first token replaced by BOS where the tokenizer adds
//! one) and only its second half scored, so every scored token sees at least half a window.
//! What `fsdp-app perplexity` prints, and how the quality of a quantised format is measured beside
//! f32's and beside llama.cpp's on the same file.

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use models::{CausalLm, KvCache, RowAdapters};

/// Positions fed per forward pass: the logits of one chunk (chunk × vocab f32) are what memory
/// holds at once; the KV cache carries the context across chunks.
const CHUNK: usize = 256;

/// What [`perplexity`] measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Perplexity {
    pub perplexity: f64,
    /// Tokens scored (all but the first).
    pub scored_tokens: usize,
    pub mean_nll: f64,
    /// Windows evaluated (1 for [`perplexity`]).
    pub windows: usize,
    /// Their size in tokens (None: one window of the whole text).
    pub ctx_size: Option<usize>,
}

/// The perplexity of `ids` under `model`, in one window (at most the model's context).
///
/// # Errors
/// With fewer than 2 tokens, or more than the model's context (take [`perplexity_windows`]).
pub fn perplexity(model: &CausalLm, ids: &[u32]) -> Result<Perplexity> {
    let context = model.config().max_position_embeddings;
    if ids.len() < 2 {
        bail!("perplexity needs at least 2 tokens, the text has {}", ids.len());
    }
    if ids.len() > context {
        bail!("the text has {} tokens, more than the model's context of {context}: score it in windows (--ctx-size)", ids.len());
    }
    let nll = summed_nll(model, ids, 0)?;
    let scored = ids.len() - 1;
    Ok(Perplexity {
        perplexity: (nll / scored as f64).exp(),
        scored_tokens: scored,
        mean_nll: nll / scored as f64,
        windows: 1,
        ctx_size: None,
    })
}

/// The perplexity of `ids` in windows of `ctx` tokens as `llama-perplexity -c ctx` computes it:
/// `ids.len() / ctx` whole windows (the tokens after the last whole one are not read), each fed
/// from an empty cache with its first token replaced by `bos` when given, the positions from
/// `ctx / 2` on scored.
pub fn perplexity_windows(model: &CausalLm, ids: &[u32], ctx: usize, bos: Option<u32>) -> Result<Perplexity> {
    let context = model.config().max_position_embeddings;
    if ctx < 4 || ctx > context {
        bail!("--ctx-size {ctx}: expected 4 to the model's context ({context})");
    }
    if ids.len() < 2 * ctx {
        bail!("--ctx-size {ctx}: the text has {} tokens, and windows of {ctx} need at least {} (two windows)", ids.len(), 2 * ctx);
    }
    let windows = ids.len() / ctx;
    let first = ctx / 2;
    let mut nll = 0f64;
    for w in 0..windows {
        let mut window = ids[w * ctx..(w + 1) * ctx].to_vec();
        if let Some(bos) = bos {
            window[0] = bos;
        }
        nll += summed_nll(model, &window, first)?;
    }
    let scored = windows * (ctx - 1 - first);
    let mean_nll = nll / scored as f64;
    Ok(Perplexity { perplexity: mean_nll.exp(), scored_tokens: scored, mean_nll, windows, ctx_size: Some(ctx) })
}

/// `Σ -log p(ids[j + 1] | ids[..=j])` for `j` from `first` on, fed from an empty cache in chunks.
fn summed_nll(model: &CausalLm, ids: &[u32], first: usize) -> Result<f64> {
    let mut cache = KvCache::new(model.config());
    let mut nll = 0f64;
    for (c, chunk) in ids.chunks(CHUNK).enumerate() {
        let input = Tensor::new(chunk, model.device())?.unsqueeze(0)?;
        let logits = model.forward_cached_all(&input, &mut cache, &RowAdapters::default())?;
        let rows = logits.squeeze(0)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        for (j, row) in rows.iter().enumerate() {
            let at = c * CHUNK + j;
            let Some(&next) = ids.get(at + 1) else { break };
            if at < first {
                continue;
            }
            // log-softmax in f64: the scale of the sum does not drift over a long vocabulary.
            let max = row.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v)) as f64;
            let log_z = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
            nll += log_z - row[next as usize] as f64;
        }
    }
    Ok(nll)
}
