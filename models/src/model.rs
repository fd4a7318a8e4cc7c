//! The whole causal LM: embeddings, decoder layers, final norm, LM head (tied or not).

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;

use crate::config::ModelConfig;
use crate::ends::{HeadWeight, OutputHead, TokenEmbedding};
use crate::kv_cache::{KvCache, LayerKvCache};
use crate::layers::{DecoderLayer, OpMode, PositionInputs, RmsNorm, Rotary};
use crate::masks::causal_mask;
use crate::multi_lora::RowAdapters;
use crate::quantized::{QuantizedMatrix, QuantizedWeights};
use ops::flash_attention::Visibility;

/// The network's stages built once from a checkpoint and chained here: every position at once
/// ([`Self::forward`]), or after a KV cache for generation. The stages are the ones a trainer
/// chains through [`crate::LlamaStages`].
#[derive(Debug, Clone)]
pub struct CausalLm {
    cfg: ModelConfig,
    embed_tokens: TokenEmbedding,
    layers: Vec<DecoderLayer>,
    head: OutputHead,
    rotary: Rotary,
}

impl CausalLm {
    /// The model in `vb`; `lora` adds adapters to the layers it targets (a load option, as
    /// config.json knows nothing of adapters).
    pub fn new(cfg: &ModelConfig, lora: Option<&crate::lora::LoraSettings>, vb: VarBuilder) -> Result<Self> {
        Self::with_quantized(cfg, lora, &mut QuantizedWeights::default(), vb)
    }

    /// As [`Self::new`], the matrices found in `quantized` kept quantised: the linear layers and
    /// the LM head multiply with their blocks; a quantised embedding table gives its rows
    /// dequantised to the compute dtype as tokens pick them (rows are read one token at a time)
    /// and, when tied, also serves the head quantised.
    pub fn with_quantized(
        cfg: &ModelConfig,
        lora: Option<&crate::lora::LoraSettings>,
        quantized: &mut QuantizedWeights,
        vb: VarBuilder,
    ) -> Result<Self> {
        use crate::tensors::{head_weight_name, EMBED_WEIGHT as EMBED, HEAD_WEIGHT as HEAD};
        // A quantised table stays in its blocks where its rows split into whole blocks (every
        // format llama.cpp writes for a model it can run).
        let (embed_tokens, embed_w) = match quantized.get(EMBED) {
            Some(q) if cfg.hidden_size.is_multiple_of(q.dtype().block_size()) => {
                (TokenEmbedding::quantized(q.clone(), vb.dtype(), cfg.pad_token_id), None)
            }
            Some(q) => {
                let w = q.dequantize(vb.device())?.to_dtype(vb.dtype())?;
                (TokenEmbedding::new(w.clone(), cfg.pad_token_id), Some(w))
            }
            None => {
                let w = vb.get((cfg.vocab_size, cfg.hidden_size), EMBED)?;
                (TokenEmbedding::new(w.clone(), cfg.pad_token_id), Some(w))
            }
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::with_quantized(cfg, lora, quantized, vb.pp(format!("model.layers.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("model.norm"))?;
        let head_name = head_weight_name(cfg);
        let head_weight = match quantized.take(head_name) {
            Some(q) => HeadWeight::Quantized(QuantizedMatrix::new(&q)?),
            None if cfg.tie_word_embeddings => match embed_w {
                Some(w) => HeadWeight::Dense(w),
                None => candle_core::bail!("a tied LM head with a quantised embedding table must be quantised alike"),
            },
            None => HeadWeight::Dense(vb.get((cfg.vocab_size, cfg.hidden_size), HEAD)?),
        };
        let head = OutputHead::new(norm, head_weight);
        Ok(Self { cfg: cfg.clone(), embed_tokens, layers, head, rotary: Rotary::new(cfg) })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &candle_core::Device {
        self.embed_tokens.device()
    }

    pub fn dtype(&self) -> DType {
        self.embed_tokens.dtype()
    }

    fn position_inputs(&self, offset: usize, q_len: usize, mode: OpMode) -> Result<PositionInputs> {
        let dev = self.device();
        let (cos, sin) = self.rotary.tables(offset, q_len, self.dtype(), dev)?;
        let mask = causal_mask(q_len, offset, self.cfg.sliding_window, self.dtype(), dev)?;
        let visibility = Some(Visibility::causal(offset, self.cfg.sliding_window));
        Ok(PositionInputs { cos, sin, mask, visibility, mode, row_seeds: None, adapters: RowAdapters::default() })
    }

    /// Logits at every position, (batch, seq, vocab), no cache: the stages as training runs them
    /// (differentiable ops), chained.
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (_b, t) = input_ids.dims2()?;
        let pos = self.position_inputs(0, t, OpMode::Train)?;
        let mut h = self.embed_tokens.forward(input_ids, OpMode::Train, None)?;
        for layer in &self.layers {
            h = layer.forward(&h, &pos, None)?;
        }
        self.head.logits(&h, OpMode::Train)
    }

    /// Feeds `input_ids` (batch, new_tokens) after the cached positions and returns the logits of
    /// the last new position, (batch, vocab). Uses fused forward-only ops. `adapters`: the
    /// serving adapters of the batch's rows (`RowAdapters::default()` for the base alone).
    pub fn forward_cached(&self, input_ids: &Tensor, cache: &mut KvCache, adapters: &RowAdapters) -> Result<Tensor> {
        let h = self.hidden_cached(input_ids, cache, adapters)?;
        let t = h.dim(1)?;
        self.head.logits(&h.narrow(1, t - 1, 1)?, OpMode::Generate)?.squeeze(1)
    }

    /// Feeds `input_ids` after the cached positions, only to extend the cache (a chunk of a
    /// prompt with more to come: no logits).
    pub fn feed(&self, input_ids: &Tensor, cache: &mut KvCache, adapters: &RowAdapters) -> Result<()> {
        self.hidden_cached(input_ids, cache, adapters).map(drop)
    }

    /// As [`Self::forward_cached`], with the logits of every new position, (batch, new_tokens,
    /// vocab): to score a prompt as it is fed.
    pub fn forward_cached_all(&self, input_ids: &Tensor, cache: &mut KvCache, adapters: &RowAdapters) -> Result<Tensor> {
        let h = self.hidden_cached(input_ids, cache, adapters)?;
        self.head.logits(&h, OpMode::Generate)
    }

    /// The final norm's output at every position of `input_ids`, (batch, seq, hidden): what an
    /// embedding model pools. Forward-only (fused ops); no cache is kept.
    pub fn final_hidden(&self, input_ids: &Tensor) -> Result<Tensor> {
        let mut cache = KvCache::new(&self.cfg);
        let h = self.hidden_cached(input_ids, &mut cache, &RowAdapters::default())?;
        self.head.norm(&h, OpMode::Generate)
    }

    /// The last layer's hidden states of the new positions, the cache extended by them.
    fn hidden_cached(&self, input_ids: &Tensor, cache: &mut KvCache, adapters: &RowAdapters) -> Result<Tensor> {
        let (_b, t) = input_ids.dims2()?;
        let offset = cache.seq_len();
        cache.reserve(t, self.dtype(), self.device())?;
        let (cos, sin) = self.rotary.tables(offset, t, self.dtype(), self.device())?;
        // No mask: each layer's cache masks its own attention (see `Attention::forward`).
        let pos =
            PositionInputs { cos, sin, mask: None, visibility: None, mode: OpMode::Generate, row_seeds: None, adapters: adapters.clone() };
        let mut h = self.embed_tokens.forward(input_ids, OpMode::Generate, None)?;
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
        let dev = self.device();
        let positions: Vec<usize> = caches.iter().map(|c| c.seq_len()).collect();
        for cache in caches.iter_mut() {
            cache.reserve(1, self.dtype(), self.device())?;
        }
        let pos_u32: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        let (cos, sin) = self.rotary.tables_for(&pos_u32, rows, 1, self.dtype(), dev)?;
        let pos =
            PositionInputs { cos, sin, mask: None, visibility: None, mode: OpMode::Generate, row_seeds: None, adapters: adapters.clone() };
        let input = Tensor::new(tokens, dev)?.unsqueeze(1)?;
        let mut h = self.embed_tokens.forward(&input, OpMode::Generate, None)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let mut layer_caches: Vec<&mut LayerKvCache> = caches.iter_mut().map(|c| &mut c.layers[i]).collect();
            h = layer.forward_decode_rows(&h, &pos, &positions, self.cfg.sliding_window, &mut layer_caches)?;
        }
        self.head.logits(&h, OpMode::Generate)?.squeeze(1)
    }
}
