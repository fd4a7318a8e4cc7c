//! `fsdp-app estimate`: per-rank memory of a fine-tuning run from config.json alone (no weights
//! read), broken down the way the engine spends it.
//!
//! Exact parts come from the same unit plan the engine uses (chunk sizes with padding, which
//! parameters train). The rest counts the f32 tensors our code keeps alive at the peak:
//! - gathered weights: FULL_SHARD holds the unit(s) of the running stage (the others are
//!   resharded, their bytes freed even where a kept graph points at them), counted twice for
//!   the moment a gather holds its result and the cut-out parameters; SHARD_GRAD_OP keeps every
//!   unit from its forward to its backward; a shard group of one (one rank, NO_SHARD) computes
//!   on its master chunks, and gathers nothing;
//! - backward of one unit: a full-size gradient of every weight the unit trains (our linear,
//!   embedding and head ops make none for a frozen weight) plus the packed buffer
//!   reduce-scatter sends;
//! - activations: the tensors one decoder layer's training forward keeps (counted from
//!   `models::layers`: norms, projections, rotary, attention scores and probabilities, MLP),
//!   for every layer without activation checkpointing; with it, a fitted number of hidden-size
//!   values per layer and the graph of the one layer being recomputed;
//! - the loss stage: logits and their gradients (a few (batch, seq, vocab) tensors), often the
//!   largest single item for small models with big vocabularies;
//! - the process itself (binary, tokenizer, data) and the allocator's floor: a fitted constant;
//! - with the tcp backend, rank 0 relays the other ranks' collectives and holds their buffers,
//!   and hosts their rendezvous: a fitted constant.

use anyhow::Result;
use models::{ModelConfig, StagedModel};

use crate::fsdp::plan::{plan_units, ShardingStrategy, UnitPlan, WrapPolicy};

/// What the run looks like.
#[derive(Debug, Clone)]
pub struct EstimateInput {
    pub world_size: usize,
    /// Ranks a parameter is sharded over (world size, 1 for NO_SHARD, the group for HYBRID).
    pub shard_size: usize,
    pub strategy: ShardingStrategy,
    pub wrap: WrapPolicy,
    pub activation_checkpointing: bool,
    pub batch_size: usize,
    pub seq_len: usize,
    /// The tcp backend: rank 0 performs the other ranks' collectives on their behalf.
    pub rank0_relays: bool,
    /// LoRA adapters (the base is frozen).
    pub lora: Option<models::LoraSettings>,
}

/// Bytes per rank.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Estimate {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
    pub gathered: u64,
    pub backward: u64,
    /// Transient copies around a unit's weight gradients (see WEIGHT_GRAD_TEMPORARIES).
    pub temporaries: u64,
    pub activations: u64,
    pub loss: u64,
    pub process: u64,
    /// Rank 0 only, tcp backend: buffers of the collectives it relays for the others.
    pub rank0_relay: u64,
    /// Rank 0 only, tcp backend: what hosting the others costs beyond those buffers.
    pub rank0_host: u64,
}

impl Estimate {
    pub fn total(&self) -> u64 {
        self.params
            + self.grads
            + self.optimizer
            + self.gathered
            + self.backward
            + self.temporaries
            + self.activations
            + self.loss
            + self.process
    }

    /// (name, bytes, what it is) rows for the table.
    pub fn rows(&self) -> Vec<(&'static str, u64, &'static str)> {
        vec![
            ("parameters", self.params, "fp32 master chunks (frozen base included)"),
            ("gradients", self.grads, "fp32 chunks of the trained parameters"),
            ("optimizer", self.optimizer, "AdamW exp_avg + exp_avg_sq chunks"),
            ("gathered units", self.gathered, "full weights all-gathered for compute"),
            ("unit backward", self.backward, "one unit's full-size weight gradients + reduce-scatter buffer"),
            ("gradient temporaries", self.temporaries, "transient copies around a unit's weight gradients (measured)"),
            ("activations", self.activations, "decoder-layer tensors kept for backward"),
            ("loss", self.loss, "the fused head and loss's chunk of logits (more at the peak with checkpointing)"),
            ("process", self.process, "binary, tokenizer, data, allocator"),
        ]
    }

    /// Rank 0's peak: every rank's, plus what it relays and hosts for the others (tcp backend).
    pub fn rank0_total(&self) -> u64 {
        self.total() + self.rank0_relay + self.rank0_host
    }
}

/// Resident memory no tensor accounts for: the process itself (binary, libraries, tokenizer,
/// thread stacks, data; 35 MiB for a 2-layer, 64-wide model at 16 tokens) and what the
/// allocator keeps at even the smallest shapes: mimalloc never hands freed memory back
/// (`lib.rs`), and a step's short-lived tensors of many sizes leave pages that later sizes do
/// not reuse (with `MIMALLOC_PURGE_DELAY=0` the same runs peak 20-50 MiB lower). Fitted with
/// the factors below on 11 one-rank and 12 two-rank shapes (tests/estimate_fit/). The one-rank
/// runs had two threads on 2 cores; each of the two ranks has one (`fsdp_app::process::cpu_threads`:
/// re-measured when ranks stopped taking two each, which had cost them 10-60 MiB more).
const PROCESS_BYTES: u64 = 53 << 20;

/// Rank 0 of the tcp backend, beyond the buffers it relays: it reads the checkpoint and
/// streams it, hosts the rendezvous and a proxy thread per other rank; fitted (see
/// RESIDENT_PER_COUNTED) on the two-rank runs, where rank 0 peaked 24 MiB below to 68 MiB
/// above rank 1.
const RANK0_HOST_BYTES: u64 = 11 << 20;

/// f32 values one decoder layer's training forward keeps, per token (see `models::layers`):
/// `per_hidden` multiples of the hidden size, `per_inter` of the MLP width, `per_q` of the
/// query width, `per_kv` of the key/value width.
struct LayerCounts {
    per_hidden: f64,
    per_inter: f64,
    per_q: f64,
    per_kv: f64,
}

/// Counted from the training forward's ops (fused RMSNorm, rotary, attention, SwiGLU and
/// linear keep one output each; the attention keeps no (seq, seq) probabilities and reads k/v
/// heads in place): two norms, two residual adds, o_proj and down_proj (hidden); gate, up and
/// their SwiGLU (MLP width); q projection, rotary and the attention output (query width);
/// k projection, rotary and v projection (key/value width).
const LAYER: LayerCounts = LayerCounts { per_hidden: 6.0, per_inter: 3.0, per_q: 3.0, per_kv: 3.0 };

/// What the counted tensors cost in resident memory: the allocator's size classes and the
/// short-lived tensors of the backward (gradient accumulation makes a zero tensor and a sum)
/// add about two fifths. Fitted by least squares with the other constants of this file on 11
/// one-rank full fine-tunes and 12 two-rank LoRA runs with activation checkpointing (hidden
/// 256-1024, 2-32 layers, seq 128-512, vocab 2k-16k): tests/estimate_fit/ has the rows, the
/// scripts that measured them and the fit.
const RESIDENT_PER_COUNTED: f64 = 1.41;

/// The share of LoRA's counted adapter tensors that costs memory at the peak: fitted on ten
/// one-rank LoRA runs without checkpointing (tests/estimate_fit/lora-rank.txt) with the other
/// constants held (counted whole, those runs come out high).
const LORA_RESIDENT_SHARE: f64 = 0.7;

fn layer_activation_bytes(cfg: &ModelConfig, lora: Option<&models::LoraSettings>, batch: usize, seq: usize) -> f64 {
    let tokens = (batch * seq) as f64;
    let q = (cfg.num_attention_heads * cfg.head_dim) as f64;
    let kv = (cfg.num_key_value_heads * cfg.head_dim) as f64;
    let base =
        LAYER.per_hidden * cfg.hidden_size as f64 + LAYER.per_inter * cfg.intermediate_size as f64 + LAYER.per_q * q + LAYER.per_kv * kv;
    let mut adapters = 0.0;
    if let Some(lora) = lora {
        // Each adapted projection adds B(A x), its scaled copy and the sum (3 outputs), and with
        // dropout the mask and the masked input.
        for (path, inp, out) in models::lora::linear_modules(cfg).into_iter().filter(|(p, _, _)| p.starts_with("model.layers.0.")) {
            if lora.targets_module(&path) {
                adapters += 3.0 * out as f64 + lora.r as f64 + if lora.dropout > 0.0 { 2.0 * inp as f64 } else { 0.0 };
            }
        }
    }
    let per_token = base + LORA_RESIDENT_SHARE * adapters;
    RESIDENT_PER_COUNTED * 4.0 * tokens * per_token
}

/// With activation checkpointing: hidden-size values per token kept for each layer (its input
/// and the gradient handed between recomputed layers; fitted, see RESIDENT_PER_COUNTED).
const AC_HIDDEN_PER_LAYER: f64 = 2.35;

/// With activation checkpointing the loss stage's tensors and the recomputed layers' graphs
/// both count at the peak: the memory the fused head and loss free is kept by the allocator
/// for sizes the layers do not ask for. The loss stage holds about this many (batch, seq,
/// vocab) f32 tensors' worth (fitted, see RESIDENT_PER_COUNTED).
const LOSS_TENSORS_AT_PEAK: f64 = 1.4;

/// Without activation checkpointing the peak comes in the layers' backward, when the fused head
/// and loss (`ops::head_loss`) have long freed their chunk of logits: the loss row counts
/// that chunk, at most this many values (the op's bound).
const LOSS_CHUNK_VALUES: f64 = (8 << 20) as f64;

/// Transient weight-sized buffers of a unit's backward beyond the gradients themselves (the
/// gradient store's zero-and-sum accumulation, the packing for reduce-scatter): about this many
/// copies of the largest weights one backward works on (a layer's projections, or the (vocab,
/// hidden) head). Fitted before the linear layers' gradients went to the trainer's sink (and held
/// as it was in the later fit); it now counts only where the head's gradient comes whole (more
/// tokens than hidden size).
const WEIGHT_GRAD_TEMPORARIES: f64 = 2.9;

pub fn estimate(model: &dyn StagedModel, cfg: &ModelConfig, input: &EstimateInput) -> Result<Estimate> {
    let plan: Vec<UnitPlan> = plan_units(model, input.wrap, input.shard_size)?;
    let chunk: u64 = plan.iter().map(|u| u.chunk_len as u64).sum();
    let trained_chunk: u64 = plan.iter().map(|u| u.grad_chunk_len as u64).sum();
    let full = |u: &UnitPlan| u.numel() as u64 * 4;
    let trained_full = |u: &UnitPlan| (u.grad_chunk_len * input.shard_size) as u64 * 4;
    let largest = plan.iter().filter(|u| !u.is_root).map(full).max().unwrap_or(0);
    // The most weight one stage reads (a layer, or the head with the final norm).
    let stage_units = (0..model.num_stages()).map(|s| {
        let reads = model.stage_parameters(s);
        plan.iter().filter(|u| u.params.iter().any(|p| reads.contains(&p.spec.name))).map(full).sum::<u64>()
    });
    let gathered = if input.shard_size == 1 {
        // One shard computes on its master chunks themselves (`UnitShards::lend`): no copy.
        0
    } else if input.strategy.reshard_after_forward() {
        2 * stage_units.max().unwrap_or(0)
    } else {
        plan.iter().map(full).sum()
    };
    // Vocabulary-sized weights that travel alone get their gradients as rows, reduce-scattered a
    // round at a time (`ops::weight_grads`): no full-size gradient. The embedding's always;
    // the head's while the logit gradients it keeps instead, (tokens, vocab), are no larger
    // than dW (tokens <= hidden).
    let (vocab, hidden, tokens) = (cfg.vocab_size, cfg.hidden_size, input.batch_size * input.seq_len);
    let vocab_travels_alone = crate::fsdp::engine::travels_alone_shape(vocab * hidden, vocab, input.shard_size);
    let head_names = model.stage_parameters(model.num_stages() - 1);
    let by_rows = |p: &crate::fsdp::plan::ParamLayout| {
        p.rows == vocab && vocab_travels_alone && (tokens <= hidden || !head_names.contains(&p.spec.name))
    };
    let head_by_rows = plan.iter().flat_map(|u| &u.params).filter(|p| p.rows == vocab && head_names.contains(&p.spec.name)).all(by_rows);
    // Backward of the largest unit: full weight gradients (all of its weights but those made
    // by rows) + packed trainable gradients for reduce-scatter + this rank's reduced slice.
    let dense_full = |u: &UnitPlan| u.params.iter().filter(|p| p.trainable && !by_rows(p)).map(|p| p.numel() as u64 * 4).sum::<u64>();
    let dense_trained = |u: &UnitPlan| if u.params.iter().any(by_rows) { dense_full(u) } else { trained_full(u) };
    // With one shard the gradients go straight into the chunks: no packed buffer.
    let packed = |u: &UnitPlan| if input.shard_size == 1 { 0 } else { dense_trained(u) };
    let backward = plan.iter().map(|u| dense_full(u) + packed(u) + dense_trained(u) / input.shard_size as u64).max().unwrap_or(0);
    let temporaries = match input.lora {
        // The frozen base weights' products leave no such temporaries (with them counted, the
        // two-rank LoRA runs of tests/estimate.rs come out high: docs/design.md).
        Some(_) => 0,
        // Every weight gradient then reaches the trainer's sink (`ops::weight_grads`: the
        // linear layers' dense, the head's and embedding's by rows), none through candle's
        // zero-and-sum store (counting them made tests/estimate.rs's wide-and-shallow shape
        // high: docs/design.md).
        None if head_by_rows => 0,
        None => (WEIGHT_GRAD_TEMPORARIES * largest.max(4 * (vocab * hidden) as u64) as f64) as u64,
    };
    let layers = cfg.num_hidden_layers as f64;
    let layer = layer_activation_bytes(cfg, input.lora.as_ref(), input.batch_size, input.seq_len);
    let hidden_in = 4.0 * (input.batch_size * input.seq_len * cfg.hidden_size) as f64;
    let activations = if input.activation_checkpointing {
        // Every stage's input is kept, and what the gradient hand-off between recomputed
        // layers keeps; one layer's graph lives at a time, during its backward.
        AC_HIDDEN_PER_LAYER * layers * hidden_in + layer
    } else {
        // Every layer's graph, plus one layer's worth of gradients during its backward.
        (layers + 1.0) * layer
    };
    let logits = (input.batch_size * input.seq_len * cfg.vocab_size) as f64;
    let loss = 4.0 * if input.activation_checkpointing { LOSS_TENSORS_AT_PEAK * logits } else { logits.min(LOSS_CHUNK_VALUES) };
    Ok(Estimate {
        params: chunk * 4,
        grads: trained_chunk * 4,
        optimizer: trained_chunk * 8,
        gathered,
        backward,
        temporaries,
        activations: activations as u64,
        loss: loss as u64,
        process: PROCESS_BYTES,
        // The proxy of each other rank holds, during the largest all-gather, the decoded request
        // and the gathered result; rank 0's own peak comes elsewhere (the loss stage), so at its
        // peak about one unit-sized buffer per other rank remains (with loading streamed, rank 0
        // peaks close to rank 1 in tests/estimate.rs's two-rank runs).
        rank0_relay: if input.rank0_relays { (input.world_size as u64 - 1) * plan.iter().map(full).max().unwrap_or(0) } else { 0 },
        rank0_host: if input.rank0_relays { RANK0_HOST_BYTES } else { 0 },
    })
}
