//! Perplexity of a text under a model, as llama.cpp's `llama-perplexity` reports it for one
//! window: `exp` of the mean negative log-likelihood of every token after the first, each scored
//! with all the tokens before it. What `fsdp-app perplexity` prints, and how the quality of a
//! quantised format is measured beside f32's and beside llama.cpp's on the same file.

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
}

/// The perplexity of `ids` under `model`, in one window (at most the model's context).
pub fn perplexity(model: &CausalLm, ids: &[u32]) -> Result<Perplexity> {
    let context = model.config().max_position_embeddings;
    if ids.len() < 2 {
        bail!("perplexity needs at least 2 tokens, the text has {}", ids.len());
    }
    if ids.len() > context {
        bail!("the text has {} tokens, more than the model's context of {context}", ids.len());
    }
    let mut cache = KvCache::new(model.config());
    let mut nll = 0f64;
    for (c, chunk) in ids.chunks(CHUNK).enumerate() {
        let input = Tensor::new(chunk, model.device())?.unsqueeze(0)?;
        let logits = model.forward_cached_all(&input, &mut cache, &RowAdapters::default())?;
        let rows = logits.squeeze(0)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        for (j, row) in rows.iter().enumerate() {
            let Some(&next) = ids.get(c * CHUNK + j + 1) else { break };
            // log-softmax in f64: the scale of the sum does not drift over a long vocabulary.
            let max = row.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v)) as f64;
            let log_z = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
            nll += log_z - row[next as usize] as f64;
        }
    }
    let scored = ids.len() - 1;
    let mean_nll = nll / scored as f64;
    Ok(Perplexity { perplexity: mean_nll.exp(), scored_tokens: scored, mean_nll })
}
