//! A causal LM seen as a chain of stages, each a pure function of (its parameters, its input):
//! the stages of [`crate::CausalLm`] (see `ends`), built one at a time from given parameters.
//!
//! This is the interface a distributed engine drives without knowing the architecture: it asks
//! which tensors each stage reads, supplies them (gathered from shards, possibly as `Var`s), and
//! calls the stages in order. Stage 0 maps token ids to hidden states, the middle stages are the
//! decoder blocks, the last maps hidden states to logits. Nothing here knows about sharding.

use std::collections::HashMap;

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;

use ops::flash_attention::Visibility;
use ops::weight_grads::{WeightGradTarget, WeightGrads};

use crate::config::ModelConfig;
use crate::ends::{HeadWeight, OutputHead, TokenEmbedding};
use crate::layers::{DecoderLayer, OpMode, PositionInputs, RmsNorm, Rotary};
use crate::lora::{is_adapter_tensor, layer_adapter_tensors, LoraSettings};
use crate::masks::{causal_mask, packed_mask};
use crate::tensors::{expected_tensors, layer_tensors, TensorSpec};

/// Several documents packed into each row: per token, its position inside its document and its
/// document id (0 = padding). Rows are `batch` x `seq`, flattened row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Packing {
    pub positions: Vec<u32>,
    pub segments: Vec<u32>,
}

/// Per-batch inputs every stage sees besides the hidden states.
#[derive(Debug, Clone, Default)]
pub struct StageContext {
    /// Several documents per row (None: one causal sequence per row).
    pub packing: Option<Packing>,
    /// One dropout seed per batch row while training (None: no dropout, as in evaluation).
    pub row_seeds: Option<Vec<u64>>,
    /// Next-token targets per position (row-major, negative where nothing is predicted). Given,
    /// the last stage returns per-position losses instead of logits: on the CPU the head and
    /// the cross-entropy then run as one op that never holds (positions, vocab) logits
    /// (`ops::head_loss`), as transformers' models return the loss when given labels.
    pub targets: Option<std::sync::Arc<[i64]>>,
    /// Given, the CPU training ops of the embedding and the fused head hand their weight's
    /// gradient to it instead of to candle's gradient store (`ops::weight_grads`).
    pub weight_grads: Option<WeightGrads>,
    /// Without targets: the last stage returns the logits of these positions only (row-major
    /// flat indices into the batch), as (positions, vocab), as transformers' `logits_to_keep`:
    /// a GRPO step scores its completions, a fraction of its rows' positions, and the head is
    /// the largest product.
    pub keep_positions: Option<std::sync::Arc<[u32]>>,
    /// Run the layers without their LoRA adapters: the frozen base alone, which is DPO's
    /// reference model in a LoRA run (PEFT's `disable_adapter`), with no second copy of it.
    pub adapters_off: bool,
}

/// What a distributed engine needs from a model.
pub trait StagedModel: Send + Sync {
    /// Every parameter, in a stable order. Tied weights appear once.
    fn parameters(&self) -> Vec<TensorSpec>;
    /// Whether `name` is trained; frozen parameters (a LoRA base) get no gradient or optimizer
    /// state.
    fn trainable(&self, name: &str) -> bool;
    /// Name prefixes of the repeated blocks (for transformer-based wrapping), in order.
    fn block_prefixes(&self) -> Vec<String>;
    fn num_stages(&self) -> usize;
    /// Names of the parameters stage `s` reads.
    fn stage_parameters(&self, s: usize) -> Vec<String>;
    /// Runs stage `s`. `params` holds at least `stage_parameters(s)` by full name; `input` is
    /// token ids (batch, seq) for stage 0 and hidden states for the others. With `ctx.packing`,
    /// tokens attend within their own document and positions restart per document. Training-safe
    /// ops only.
    fn forward_stage(&self, s: usize, params: &HashMap<String, Tensor>, input: &Tensor, ctx: &StageContext) -> Result<Tensor>;
    /// Whether stage `s`'s backward reads its parameters' values. One that does not (an
    /// embedding lookup, whose gradient needs only the ids) lets an engine keep its forward
    /// graph under activation checkpointing (it holds activations only) and leave its
    /// parameters unallocated for the backward.
    fn stage_backward_reads_params(&self, _s: usize) -> bool {
        true
    }
}

/// The Llama family as stages: embeddings, one stage per decoder layer, final norm + LM head.
/// With `lora`, each layer's adapter tensors belong to its stage and only they train.
pub struct LlamaStages {
    cfg: ModelConfig,
    lora: Option<LoraSettings>,
    rotary: Rotary,
    /// The last unpacked batch's rotary tables and causal mask: every layer, forward and
    /// recomputed, asks for the same ones, and they are made on the host (a 2048-token mask is
    /// 4M values, uploaded to a GPU each time otherwise).
    positions: std::sync::Mutex<Option<(PositionsKey, PositionTensors)>>,
}

/// (tokens, dtype, device) of cached [`PositionTensors`].
type PositionsKey = (usize, DType, candle_core::Device);
/// cos, sin and the causal mask (None when nothing is masked).
type PositionTensors = (Tensor, Tensor, Option<Tensor>);

impl LlamaStages {
    pub fn new(cfg: &ModelConfig, lora: Option<LoraSettings>) -> Self {
        Self { cfg: cfg.clone(), lora, rotary: Rotary::new(cfg), positions: Default::default() }
    }

    /// Rotary tables and causal mask for `t` unpacked tokens (see the field).
    fn unpacked_positions(&self, t: usize, dtype: DType, dev: &candle_core::Device) -> Result<PositionTensors> {
        let mut cached = self.positions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(((k_t, k_dtype, k_dev), v)) = cached.as_ref() {
            // The same device object, not only the same ordinal: two rank threads sharing a
            // GPU each have their own.
            if (*k_t, *k_dtype) == (t, dtype) && k_dev.same_device(dev) {
                return Ok(v.clone());
            }
        }
        let (cos, sin) = self.rotary.tables(0, t, dtype, dev)?;
        let made = (cos, sin, causal_mask(t, 0, self.cfg.sliding_window, dtype, dev)?);
        *cached = Some(((t, dtype, dev.clone()), made.clone()));
        Ok(made)
    }

    fn head_weight_name(&self) -> &'static str {
        crate::tensors::head_weight_name(&self.cfg)
    }

    fn vb(params: &HashMap<String, Tensor>, names: &[String], like: &Tensor) -> VarBuilder<'static> {
        // `from_tensors` casts to the given dtype; keep each tensor's own dtype and device.
        let map: HashMap<String, Tensor> = names.iter().filter_map(|n| params.get(n).map(|t| (n.clone(), t.clone()))).collect();
        VarBuilder::from_tensors(map, like.dtype(), like.device())
    }
}

impl StagedModel for LlamaStages {
    fn parameters(&self) -> Vec<TensorSpec> {
        let mut params = expected_tensors(&self.cfg);
        if let Some(lora) = &self.lora {
            // Each layer's adapters right after its base tensors.
            for i in (0..self.cfg.num_hidden_layers).rev() {
                let last = format!("model.layers.{i}.");
                let at = params.iter().rposition(|t| t.name.starts_with(&last)).expect("layer tensors") + 1;
                let adapters = layer_adapter_tensors(&self.cfg, lora, i);
                params.splice(at..at, adapters);
            }
        }
        params
    }

    fn trainable(&self, name: &str) -> bool {
        self.lora.is_none() || is_adapter_tensor(name)
    }

    fn block_prefixes(&self) -> Vec<String> {
        (0..self.cfg.num_hidden_layers).map(|i| format!("model.layers.{i}.")).collect()
    }

    fn num_stages(&self) -> usize {
        self.cfg.num_hidden_layers + 2
    }

    fn stage_parameters(&self, s: usize) -> Vec<String> {
        let last = self.num_stages() - 1;
        if s == 0 {
            vec![crate::tensors::EMBED_WEIGHT.to_string()]
        } else if s == last {
            vec!["model.norm.weight".to_string(), self.head_weight_name().to_string()]
        } else {
            let mut names: Vec<String> = layer_tensors(&self.cfg, s - 1).into_iter().map(|t| t.name).collect();
            if let Some(lora) = &self.lora {
                names.extend(layer_adapter_tensors(&self.cfg, lora, s - 1).into_iter().map(|t| t.name));
            }
            names
        }
    }

    fn stage_backward_reads_params(&self, s: usize) -> bool {
        // The embedding's gradient (ours and candle's index_select) is built from the ids and
        // the upstream gradient alone.
        s != 0
    }

    fn forward_stage(&self, s: usize, params: &HashMap<String, Tensor>, input: &Tensor, ctx: &StageContext) -> Result<Tensor> {
        let last = self.num_stages() - 1;
        let get = |name: &str| params.get(name).cloned().ok_or_else(|| candle_core::Error::Msg(format!("stage {s} needs {name}")));
        let grad_to = |name: &str| ctx.weight_grads.clone().map(|sink| WeightGradTarget { sink, name: name.to_string() });
        if s == 0 {
            let name = crate::tensors::EMBED_WEIGHT;
            return TokenEmbedding::new(get(name)?, self.cfg.pad_token_id).forward(input, OpMode::Train, grad_to(name));
        }
        let names = self.stage_parameters(s);
        let like = get(&names[0])?;
        if s == last {
            let norm_vb = Self::vb(params, &names, &like);
            let norm = RmsNorm::new(self.cfg.hidden_size, self.cfg.rms_norm_eps, norm_vb.pp("model.norm"))?;
            let head_name = self.head_weight_name();
            let head = OutputHead::new(norm, HeadWeight::Dense(get(head_name)?));
            return match (&ctx.targets, &ctx.keep_positions) {
                (Some(targets), _) => head.losses(input, targets, grad_to(head_name)),
                (None, Some(keep)) => {
                    let (b, t, hidden) = input.dims3()?;
                    let index = Tensor::from_slice(keep, keep.len(), input.device())?;
                    let kept = input.reshape((b * t, hidden))?.index_select(&index, 0)?.unsqueeze(0)?;
                    head.logits(&kept, OpMode::Train)?.squeeze(0)
                }
                (None, None) => head.logits(input, OpMode::Train),
            };
        }
        let layer_vb = Self::vb(params, &names, &like);
        let lora = if ctx.adapters_off { None } else { self.lora.as_ref() };
        let mut layer = DecoderLayer::new(&self.cfg, lora, layer_vb.pp(format!("model.layers.{}", s - 1)))?;
        layer.send_weight_grads_to(ctx.weight_grads.clone());
        let (b, t, _h) = input.dims3()?;
        let dtype = if input.dtype() == DType::U32 { like.dtype() } else { input.dtype() };
        let (cos, sin, mask, visibility) = match &ctx.packing {
            None => {
                let (cos, sin, mask) = self.unpacked_positions(t, dtype, input.device())?;
                (cos, sin, mask, Some(Visibility::causal(0, self.cfg.sliding_window)))
            }
            Some(p) => {
                let (cos, sin) = self.rotary.tables_for(&p.positions, b, t, dtype, input.device())?;
                (cos, sin, Some(packed_mask(&p.segments, b, t, self.cfg.sliding_window, dtype, input.device())?), None)
            }
        };
        let pos = PositionInputs {
            cos,
            sin,
            mask,
            visibility,
            mode: OpMode::Train,
            row_seeds: ctx.row_seeds.clone(),
            adapters: Default::default(),
        };
        layer.forward(input, &pos, None)
    }
}
