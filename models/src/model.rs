//! The whole causal LM: embeddings, decoder layers, final norm, LM head (tied or not).

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Embedding, VarBuilder};

use crate::config::ModelConfig;
use crate::kv_cache::{KvCache, LayerKvCache};
use crate::layers::{causal_mask, DecoderLayer, OpMode, PositionInputs, RmsNorm, Rotary};
use crate::multi_lora::RowAdapters;

#[derive(Debug, Clone)]
pub struct CausalLm {
    cfg: ModelConfig,
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// `lm_head.weight`; with tied embeddings this is the very same tensor as the embedding table.
    lm_head: Tensor,
    rotary: Rotary,
}

impl CausalLm {
    /// The model in `vb`; `lora` adds adapters to the layers it targets (a load option, as
    /// config.json knows nothing of adapters).
    pub fn new(cfg: &ModelConfig, lora: Option<&crate::lora::LoraSettings>, vb: VarBuilder) -> Result<Self> {
        let embed_w = vb.get((cfg.vocab_size, cfg.hidden_size), "model.embed_tokens.weight")?;
        let embed_tokens = Embedding::new(embed_w.clone(), cfg.hidden_size);
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::new(cfg, lora, vb.pp(format!("model.layers.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("model.norm"))?;
        let lm_head = if cfg.tie_word_embeddings { embed_w } else { vb.get((cfg.vocab_size, cfg.hidden_size), "lm_head.weight")? };
        Ok(Self { cfg: cfg.clone(), embed_tokens, layers, norm, lm_head, rotary: Rotary::new(cfg) })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &candle_core::Device {
        self.lm_head.device()
    }

    pub fn dtype(&self) -> DType {
        self.lm_head.dtype()
    }

    fn position_inputs(&self, offset: usize, q_len: usize, mode: OpMode) -> Result<PositionInputs> {
        let dev = self.lm_head.device();
        let (cos, sin) = self.rotary.tables(offset, q_len, self.dtype(), dev)?;
        let mask = causal_mask(q_len, offset, self.cfg.sliding_window, self.dtype(), dev)?;
        Ok(PositionInputs { cos, sin, mask, mode, row_seeds: None, adapters: RowAdapters::default() })
    }

    fn logits(&self, h: &Tensor) -> Result<Tensor> {
        // Decoding's last positions: the head is the largest matrix, read once per token.
        match crate::ops::kernels::gemv_t(h, &self.lm_head)? {
            Some(logits) => Ok(logits),
            None => h.broadcast_matmul(&self.lm_head.t()?),
        }
    }

    /// Logits at every position, (batch, seq, vocab), no cache. Uses only differentiable ops, so it
    /// is the training forward.
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (_b, t) = input_ids.dims2()?;
        let pos = self.position_inputs(0, t, OpMode::Train)?;
        let mut h = self.embed_tokens.forward(input_ids)?;
        for layer in &self.layers {
            h = layer.forward(&h, &pos, None)?;
        }
        let h = self.norm.forward(&h, OpMode::Train)?;
        self.logits(&h)
    }

    /// Feeds `input_ids` (batch, new_tokens) after the cached positions and returns the logits of
    /// the last new position, (batch, vocab). Uses fused forward-only ops. `adapters`: the
    /// serving adapters of the batch's rows (`RowAdapters::default()` for the base alone).
    pub fn forward_cached(&self, input_ids: &Tensor, cache: &mut KvCache, adapters: &RowAdapters) -> Result<Tensor> {
        let h = self.hidden_cached(input_ids, cache, adapters)?;
        let t = h.dim(1)?;
        let h = self.norm.forward(&h.narrow(1, t - 1, 1)?, OpMode::Generate)?;
        self.logits(&h)?.squeeze(1)
    }

    /// As [`Self::forward_cached`], with the logits of every new position, (batch, new_tokens,
    /// vocab): to score a prompt as it is fed.
    pub fn forward_cached_all(&self, input_ids: &Tensor, cache: &mut KvCache, adapters: &RowAdapters) -> Result<Tensor> {
        let h = self.hidden_cached(input_ids, cache, adapters)?;
        let h = self.norm.forward(&h, OpMode::Generate)?;
        self.logits(&h)
    }

    /// The last layer's hidden states of the new positions, the cache extended by them.
    fn hidden_cached(&self, input_ids: &Tensor, cache: &mut KvCache, adapters: &RowAdapters) -> Result<Tensor> {
        let (_b, t) = input_ids.dims2()?;
        let offset = cache.seq_len();
        let pos = PositionInputs { adapters: adapters.clone(), ..self.position_inputs(offset, t, OpMode::Generate)? };
        let mut h = self.embed_tokens.forward(input_ids)?;
        for (layer, layer_cache) in self.layers.iter().zip(cache.layers.iter_mut()) {
            h = layer.forward(&h, &pos, Some(layer_cache))?;
        }
        Ok(h)
    }

    /// One new token for each of several independent sequences, each with its own cache (which
    /// may hold a different number of positions): logits (rows, vocab). The projections and the
    /// MLP run as one batched matmul over the rows, which is where serving many streams at once
    /// gains over running them one by one; each row's adapter (in `adapters`) adds its update
    /// to its own rows only.
    pub fn forward_decode_rows(&self, tokens: &[u32], caches: &mut [&mut KvCache], adapters: &RowAdapters) -> Result<Tensor> {
        let rows = tokens.len();
        if caches.len() != rows {
            candle_core::bail!("{rows} tokens for {} caches", caches.len());
        }
        let dev = self.lm_head.device();
        let positions: Vec<usize> = caches.iter().map(|c| c.seq_len()).collect();
        let pos_u32: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        let (cos, sin) = self.rotary.tables_for(&pos_u32, rows, 1, self.dtype(), dev)?;
        let pos = PositionInputs { cos, sin, mask: None, mode: OpMode::Generate, row_seeds: None, adapters: adapters.clone() };
        let input = Tensor::new(tokens, dev)?.unsqueeze(1)?;
        let mut h = self.embed_tokens.forward(&input)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let mut layer_caches: Vec<&mut LayerKvCache> = caches.iter_mut().map(|c| &mut c.layers[i]).collect();
            h = layer.forward_decode_rows(&h, &pos, &positions, self.cfg.sliding_window, &mut layer_caches)?;
        }
        let h = self.norm.forward(&h, OpMode::Generate)?;
        self.logits(&h)?.squeeze(1)
    }
}
