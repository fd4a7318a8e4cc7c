//! Building blocks of a Llama-family decoder: RMSNorm, rotary embeddings, attention, MLP.
//!
//! Every op has two forms. `OpMode::Train` uses only ops that have a backward pass in candle
//! (several fused candle ops silently have none: `rope`, `rms_norm`, `softmax_last_dim`).
//! `OpMode::Generate` uses the fused ones, whose forward output is the same, for speed: ours
//! (`ops::fused`, on the CPU pool's threads) where they take the tensors, else candle's.

use candle_core::{DType, Device, Result, Tensor, D};
use candle_nn::{linear_b, VarBuilder};

use crate::config::{ModelConfig, RopeScaling};
use crate::kv_cache::LayerKvCache;
use crate::lora::{AdaptedLinear, LoraSettings};
use crate::masks::causal_mask;
pub use crate::mode::OpMode;
use crate::multi_lora::RowAdapters;
use crate::quantized::{LinearWeight, QuantizedWeights};
use ops::flash_attention::Visibility;
use ops::self_attention::Projection;
use ops::weight_grads::WeightGrads;

mod sublayers;

/// RMSNorm computed in f32 like transformers' `LlamaRMSNorm`, cast back, then scaled.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn new(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Self { weight: vb.get(size, "weight")?, eps })
    }

    pub fn forward(&self, x: &Tensor, mode: OpMode) -> Result<Tensor> {
        match mode {
            _ if fused_ops_for(mode, x.device()) && ops::fused::rms_norm_applies(x, &self.weight) => {
                ops::fused::rms_norm(x, &self.weight, self.eps)
            }
            OpMode::Generate => candle_nn::ops::rms_norm(x, &self.weight, self.eps as f32),
            OpMode::Train => {
                let xf = x.to_dtype(DType::F32)?;
                let inv_rms = (xf.sqr()?.mean_keepdim(D::Minus1)? + self.eps)?.sqrt()?.recip()?;
                xf.broadcast_mul(&inv_rms)?.to_dtype(x.dtype())?.broadcast_mul(&self.weight)
            }
        }
    }
}

/// Whether `mode` on `device` takes `ops::fused`'s RMSNorm and rotary (where they take the
/// tensors): training always (candle-nn's fused ones have no backward); generation on the CPU,
/// where candle-nn's run on rayon's pool, whose threads then spin against the matrix products'
/// pool for the same cores (docs/design.md, "One pool").
fn fused_ops_for(mode: OpMode, device: &Device) -> bool {
    mode == OpMode::Train || device.is_cpu()
}

/// Rotary embedding frequencies, with the rope scaling of the config applied.
#[derive(Debug, Clone)]
pub struct Rotary {
    inv_freq: Vec<f64>,
}

impl Rotary {
    pub fn new(cfg: &ModelConfig) -> Self {
        let dim = cfg.head_dim;
        // transformers computes the base frequencies in f32; do the same so tables match bit for bit
        // as far as possible.
        let base: Vec<f64> = (0..dim / 2).map(|i| (1.0f32 / (cfg.rope_theta as f32).powf((2 * i) as f32 / dim as f32)) as f64).collect();
        let inv_freq = match &cfg.rope_scaling {
            RopeScaling::Default => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let old = *original_max_position_embeddings as f64;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        };
        Self { inv_freq }
    }

    /// cos and sin tables of shape (seq_len, head_dim / 2) for positions offset..offset+seq_len.
    pub fn tables(&self, offset: usize, seq_len: usize, dtype: DType, dev: &Device) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(seq_len * half);
        let mut sin = Vec::with_capacity(seq_len * half);
        for p in offset..offset + seq_len {
            for &f in &self.inv_freq {
                // f32 product like transformers, then cos/sin.
                let angle = (p as f32 * f as f32) as f64;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let cos = Tensor::from_vec(cos, (seq_len, half), dev)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (seq_len, half), dev)?.to_dtype(dtype)?;
        Ok((cos, sin))
    }
}

impl Rotary {
    /// cos and sin tables of shape (batch, seq, head_dim / 2) for explicit per-token positions
    /// (packed sequences restart their positions at each document).
    pub fn tables_for(&self, positions: &[u32], batch: usize, seq: usize, dtype: DType, dev: &Device) -> Result<(Tensor, Tensor)> {
        let max = positions.iter().copied().max().unwrap_or(0) as usize + 1;
        let (cos, sin) = self.tables(0, max, DType::F32, dev)?;
        let idx = Tensor::from_vec(positions.to_vec(), positions.len(), dev)?;
        let half = self.inv_freq.len();
        let pick = |t: &Tensor| -> Result<Tensor> { t.index_select(&idx, 0)?.reshape((batch, seq, half))?.to_dtype(dtype) };
        Ok((pick(&cos)?, pick(&sin)?))
    }
}

/// Rotary embedding with per-row tables (batch, seq, head_dim / 2), rotate-half layout: the
/// fused op where each row has one position (decoding; the same values, one pass), else built
/// from differentiable ops.
fn rope_rows(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = x.dims4()?;
    if t == 1 && ops::fused::rope_applies(x, cos) {
        // One position a row (decoding): the rows are token-major (1, b, h, d), the tables (b, d / 2).
        let tables = |c: &Tensor| c.reshape((b, d / 2));
        return ops::fused::rope_token_major(&x.reshape((1, b, h, d))?, &tables(cos)?, &tables(sin)?)?.reshape((b, h, 1, d));
    }
    let cos = Tensor::cat(&[cos, cos], D::Minus1)?.unsqueeze(1)?;
    let sin = Tensor::cat(&[sin, sin], D::Minus1)?.unsqueeze(1)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
}

/// Inputs shared by all layers of one forward call.
pub struct PositionInputs {
    /// (seq, head_dim / 2), or (batch, seq, head_dim / 2) for packed rows.
    pub cos: Tensor,
    pub sin: Tensor,
    /// Additive mask (q_len, kv_len), or (batch, 1, q_len, kv_len) for packed rows, with -inf where
    /// attention is not allowed; None when every key is visible (single-token decode without a
    /// sliding window).
    pub mask: Option<Tensor>,
    /// What `mask` says as a rule (causal, offset, window), for attention that masks as it goes
    /// (`ops::flash_attention`); None for masks no rule says (packed rows).
    pub visibility: Option<Visibility>,
    pub mode: OpMode,
    /// One LoRA-dropout seed per batch row while training; None disables dropout.
    pub row_seeds: Option<Vec<u64>>,
    /// The serving adapters of the rows (none in training).
    pub adapters: RowAdapters,
}

/// A linear layer at `vb`'s prefix, its weight from `quantized` when that holds it, with the
/// LoRA adapter of `lora` when that targets it (its `lora_A`/`lora_B` tensors must then be in
/// `vb`).
fn adapted_linear(
    lora: Option<&LoraSettings>,
    quantized: &mut QuantizedWeights,
    (inp, out): (usize, usize),
    bias: bool,
    vb: VarBuilder,
) -> Result<AdaptedLinear> {
    let path = vb.prefix();
    let quantized_bias = match bias && quantized.get(&format!("{path}.weight")).is_some() {
        true => Some(vb.get(out, "bias")?),
        false => None,
    };
    let base = LinearWeight::pick(quantized, &format!("{path}.weight"), quantized_bias, || linear_b(inp, out, bias, vb.clone()))?;
    match lora {
        Some(lora) if lora.targets_module(&path) => {
            let a = vb.get((lora.r, inp), "lora_A.weight")?;
            let b = vb.get((out, lora.r), "lora_B.weight")?;
            Ok(AdaptedLinear::with_adapter(base, a, b, lora, &path))
        }
        _ => Ok(AdaptedLinear::plain(base, &path)),
    }
}

/// The attention [`Attention::path`] picks for a pass.
enum AttentionPath {
    TokenMajor,
    Flash(Visibility),
    HeadsMajor,
}

#[derive(Debug, Clone)]
pub struct Attention {
    q_proj: AdaptedLinear,
    k_proj: AdaptedLinear,
    v_proj: AdaptedLinear,
    o_proj: AdaptedLinear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    /// Mistral's sliding window: a query sees at most this many positions, itself included.
    window: Option<usize>,
}

impl Attention {
    pub fn new(cfg: &ModelConfig, lora: Option<&LoraSettings>, quantized: &mut QuantizedWeights, vb: VarBuilder) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let q_out = cfg.num_attention_heads * d;
        let kv_out = cfg.num_key_value_heads * d;
        let (q_norm, k_norm) = if cfg.qk_norm {
            (Some(RmsNorm::new(d, cfg.rms_norm_eps, vb.pp("q_norm"))?), Some(RmsNorm::new(d, cfg.rms_norm_eps, vb.pp("k_norm"))?))
        } else {
            (None, None)
        };
        Ok(Self {
            q_proj: adapted_linear(lora, quantized, (h, q_out), cfg.qkv_bias, vb.pp("q_proj"))?,
            k_proj: adapted_linear(lora, quantized, (h, kv_out), cfg.qkv_bias, vb.pp("k_proj"))?,
            v_proj: adapted_linear(lora, quantized, (h, kv_out), cfg.qkv_bias, vb.pp("v_proj"))?,
            o_proj: adapted_linear(lora, quantized, (q_out, h), cfg.o_bias, vb.pp("o_proj"))?,
            q_norm,
            k_norm,
            num_heads: cfg.num_attention_heads,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim: d,
            window: cfg.sliding_window,
        })
    }

    /// `residual + attention(x)`: the sum is o_proj's (`AdaptedLinear::forward_add`), the
    /// attention the one [`Self::path`] picks.
    pub fn forward(&self, x: &Tensor, residual: &Tensor, pos: &PositionInputs, cache: Option<&mut LayerKvCache>) -> Result<Tensor> {
        let out = match self.path(x, pos, cache.is_some()) {
            AttentionPath::TokenMajor => self.attend_token_major(x, pos)?,
            AttentionPath::Flash(visibility) => self.attend_flash(x, pos, visibility)?,
            AttentionPath::HeadsMajor => self.attend_heads(x, pos, cache)?,
        };
        self.o_proj.forward_add(&out, residual, pos.mode, pos.row_seeds.as_deref(), &pos.adapters)
    }

    /// Which attention runs for x: training's token-major ones on the CPU in f32 or on a GPU's
    /// flash kernels, else (generation with its cache, other devices and dtypes) heads-major.
    fn path(&self, x: &Tensor, pos: &PositionInputs, cached: bool) -> AttentionPath {
        let training = pos.mode == OpMode::Train && !cached && pos.cos.rank() == 2;
        let fused =
            training && ops::applies(x) && pos.cos.dtype() == DType::F32 && pos.mask.as_ref().is_none_or(|m| m.dtype() == DType::F32);
        match (fused, self.flash_token_major(x, pos).filter(|_| training)) {
            (true, _) => AttentionPath::TokenMajor,
            (false, Some(visibility)) => AttentionPath::Flash(visibility),
            (false, None) => AttentionPath::HeadsMajor,
        }
    }

    fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    /// Training's attention on the CPU, token-major all the way: rotary and attention read the
    /// projections in place and the attention writes what o_proj takes (see `ops::attention`);
    /// with no q/k norms and weights whose gradients have sinks, one op from x to o_proj's input
    /// (`ops::self_attention`).
    fn attend_token_major(&self, x: &Tensor, pos: &PositionInputs) -> Result<Tensor> {
        if let Some(projections) = self.one_op_projections(x, pos, ops::applies(x)) {
            let heads = (self.num_heads, self.num_kv_heads);
            return ops::self_attention::self_attention(x, projections, heads, (&pos.cos, &pos.sin), pos.mask.as_ref(), self.scale());
        }
        let (q, k, v) = self.token_major_qkv(x, pos)?;
        ops::attention::attention(&q, &k, &v, pos.mask.as_ref(), self.scale())
    }

    /// Training's attention on the GPU's flash kernels, token-major: with no q/k norms and
    /// weights whose gradients have sinks (and x in the graph where one trains), one op from x
    /// to o_proj's input (`ops::self_attention_flash`), else the products, rotations and
    /// attention as ops of their own.
    fn attend_flash(&self, x: &Tensor, pos: &PositionInputs, visibility: Visibility) -> Result<Tensor> {
        if let Some(projections) = self.one_op_projections(x, pos, true) {
            let trains = projections.iter().any(|(w, _)| w.track_op());
            if (x.track_op() || !trains) && ops::self_attention_flash::enabled() {
                let heads = (self.num_heads, self.num_kv_heads);
                return ops::self_attention_flash::self_attention(x, projections, heads, (&pos.cos, &pos.sin), visibility, self.scale());
            }
        }
        let (q, k, v) = self.token_major_qkv(x, pos)?;
        ops::flash_attention::attention_token_major(&q, &k, &v, visibility, self.scale())
    }

    /// q, k and v's weights with their sinks where the attention can run as one op from x (CPU:
    /// `ops::self_attention`, GPU: `ops::self_attention_flash`): no q/k norms, and each a plain
    /// dense weight whose gradient has a sink or that trains nothing (`ours` as
    /// `AdaptedLinear::weight_with_sink_where` takes it).
    fn one_op_projections(&self, x: &Tensor, pos: &PositionInputs, ours: bool) -> Option<[Projection; 3]> {
        if self.q_norm.is_some() || self.k_norm.is_some() {
            return None;
        }
        let [q, k, v] = [&self.q_proj, &self.k_proj, &self.v_proj].map(|p| p.weight_with_sink_where(x, pos.mode, &pos.adapters, ours));
        Some([q?, k?, v?])
    }

    /// Where training's attention runs on the GPU's flash kernels token-major (the projections'
    /// (b, t, heads, d) rows rotated in place and read by the kernels, which write what o_proj
    /// takes: no transposes, their copies or their backward nodes): the mask the model states as
    /// a rule (not packed rows') and rotary tables the rope kernel takes.
    fn flash_token_major(&self, x: &Tensor, pos: &PositionInputs) -> Option<Visibility> {
        let kernels =
            ops::flash_attention::takes(x, self.num_heads, self.head_dim, self.num_kv_heads) && ops::fused::rope_applies(x, &pos.cos);
        pos.visibility.filter(|vis| kernels && (!vis.causal || vis.offset == 0))
    }

    /// q, k (rotated) and v token-major, (b, t, heads, head_dim), with q/k norms where the
    /// architecture has them.
    fn token_major_qkv(&self, x: &Tensor, pos: &PositionInputs) -> Result<(Tensor, Tensor, Tensor)> {
        let seeds = pos.row_seeds.as_deref();
        let tokens = |proj: &AdaptedLinear, n: usize, norm: &Option<RmsNorm>| -> Result<Tensor> {
            let y = proj.forward_heads(x, n, pos.mode, seeds, &pos.adapters)?;
            match norm {
                Some(norm) => norm.forward(&y, pos.mode),
                None => Ok(y),
            }
        };
        let q = ops::fused::rope_token_major(&tokens(&self.q_proj, self.num_heads, &self.q_norm)?, &pos.cos, &pos.sin)?;
        let k = ops::fused::rope_token_major(&tokens(&self.k_proj, self.num_kv_heads, &self.k_norm)?, &pos.cos, &pos.sin)?;
        let v = tokens(&self.v_proj, self.num_kv_heads, &None)?;
        Ok((q, k, v))
    }

    /// q, k (rotated) and v heads-major, (b, heads, t, head_dim), with q/k norms where the
    /// architecture has them.
    fn heads_qkv(&self, x: &Tensor, pos: &PositionInputs) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let [q, k, v]: [Tensor; 3] = AdaptedLinear::forward_shared(
            &[&self.q_proj, &self.k_proj, &self.v_proj],
            x,
            pos.mode,
            pos.row_seeds.as_deref(),
            &pos.adapters,
        )?
        .try_into()
        .expect("three products");
        let heads = |y: Tensor, n: usize, norm: &Option<RmsNorm>| -> Result<Tensor> {
            let y = y.reshape((b, t, n, self.head_dim))?;
            let y = match norm {
                Some(norm) => norm.forward(&y, pos.mode)?,
                None => y,
            };
            y.transpose(1, 2)?.contiguous()
        };
        let q = heads(q, self.num_heads, &self.q_norm)?;
        let k = heads(k, self.num_kv_heads, &self.k_norm)?;
        let v = heads(v, self.num_kv_heads, &None)?;
        let (q, k) = match pos.mode {
            _ if pos.cos.rank() == 3 => (rope_rows(&q, &pos.cos, &pos.sin)?, rope_rows(&k, &pos.cos, &pos.sin)?),
            _ if fused_ops_for(pos.mode, q.device()) && ops::fused::rope_applies(&q, &pos.cos) => {
                (ops::fused::rope(&q, &pos.cos, &pos.sin)?, ops::fused::rope(&k, &pos.cos, &pos.sin)?)
            }
            OpMode::Train => {
                (candle_nn::rotary_emb::rope_slow(&q, &pos.cos, &pos.sin)?, candle_nn::rotary_emb::rope_slow(&k, &pos.cos, &pos.sin)?)
            }
            OpMode::Generate => {
                (candle_nn::rotary_emb::rope(&q, &pos.cos, &pos.sin)?, candle_nn::rotary_emb::rope(&k, &pos.cos, &pos.sin)?)
            }
        };
        Ok((q, k, v))
    }

    /// The heads-major attention, (b, t, heads · head_dim): with a cache, over its positions (in
    /// place where its kernels apply, else as tensors masked here); without, over these.
    fn attend_heads(&self, x: &Tensor, pos: &PositionInputs, cache: Option<&mut LayerKvCache>) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (q, k, v) = self.heads_qkv(x, pos)?;
        let (mut mask, mut visibility) = (pos.mask.clone(), pos.visibility);
        let (k, v) = match cache {
            Some(cache) => {
                cache.append(&k, &v)?;
                if let Some(out) = cache.attend(&q, self.scale(), self.window)? {
                    return Ok(out);
                }
                // Other devices and dtypes: the whole cache as tensors, masked here (the
                // in-place kernels need no mask, so the model builds none for a cached pass).
                mask = causal_mask(t, cache.seq_len() - t, self.window, q.dtype(), q.device())?;
                visibility = Some(Visibility::causal(cache.seq_len() - t, self.window));
                cache.all()?
            }
            None => (k, v),
        };
        let s = k.dim(2)?;
        let flash = visibility.filter(|vis| (!vis.causal || vis.offset + t == s) && ops::flash_attention::applies(&q, self.num_kv_heads));
        if let Some(visibility) = flash {
            // k and v as they are: the kernels read each kv head for its group of query heads.
            let out = ops::flash_attention::attention(&q, &k, &v, visibility, self.scale())?;
            return out.transpose(1, 2)?.reshape((b, t, self.num_heads * self.head_dim));
        }
        let n_rep = self.num_heads / self.num_kv_heads;
        let (k, v) = (repeat_kv(k, n_rep)?, repeat_kv(v, n_rep)?);
        // One op in a training graph, with its own backward (see ops::eager_attention).
        let out = ops::eager_attention::attention(&q.contiguous()?, &k.contiguous()?, &v.contiguous()?, mask.as_ref(), self.scale())?;
        out.transpose(1, 2)?.reshape((b, t, self.num_heads * self.head_dim))
    }

    /// One new token for each of several independent sequences: `x` is (rows, 1, hidden), row
    /// r continues the sequence cached in `caches[r]` at position `positions[r]`. Projections
    /// run batched over the rows (where batching pays on any device); attention runs per row
    /// over that row's own cache. `pos.cos`/`pos.sin` are (rows, 1, head_dim / 2).
    pub fn forward_decode_rows(
        &self,
        x: &Tensor,
        pos: &PositionInputs,
        positions: &[usize],
        window: Option<usize>,
        caches: &mut [&mut LayerKvCache],
    ) -> Result<Tensor> {
        let (cos, sin, adapters) = (&pos.cos, &pos.sin, &pos.adapters);
        let (rows, t, _) = x.dims3()?;
        let d = self.head_dim;
        let [q, k, v]: [Tensor; 3] =
            AdaptedLinear::forward_shared(&[&self.q_proj, &self.k_proj, &self.v_proj], x, OpMode::Generate, None, adapters)?
                .try_into()
                .expect("three products");
        let heads = |y: Tensor, n: usize, norm: &Option<RmsNorm>| -> Result<Tensor> {
            let y = y.reshape((rows, t, n, d))?;
            let y = match norm {
                Some(norm) => norm.forward(&y, OpMode::Generate)?,
                None => y,
            };
            y.transpose(1, 2)?.contiguous()
        };
        let q = rope_rows(&heads(q, self.num_heads, &self.q_norm)?, cos, sin)?;
        let k = rope_rows(&heads(k, self.num_kv_heads, &self.k_norm)?, cos, sin)?;
        let v = heads(v, self.num_kv_heads, &None)?;
        let scale = 1.0 / (d as f64).sqrt();
        if ops::flash_attention::decode_applies(&q, self.num_kv_heads) {
            // On a GPU, every row in one kernel over the caches' blocks, which writes the new
            // position there too.
            for cache in caches.iter_mut() {
                cache.grow((self.num_kv_heads, d), k.dtype(), k.device())?;
            }
            let tables: Vec<(&[(Tensor, Tensor)], usize)> = caches.iter().map(|c| (c.blocks(), c.seq_len())).collect();
            let out = ops::flash_attention::decode(&q, Some((&k, &v)), &tables, scale, window)?;
            return self.o_proj.forward(&out, OpMode::Generate, None, adapters);
        }
        for (r, cache) in caches.iter_mut().enumerate() {
            cache.append(&k.narrow(0, r, 1)?, &v.narrow(0, r, 1)?)?;
        }
        // On the CPU in f32, every row in one parallel region over the caches' blocks.
        let tables: Vec<(&[(Tensor, Tensor)], usize)> = caches.iter().map(|c| (c.blocks(), c.seq_len())).collect();
        if let Some(out) = ops::kv_attention::attend_rows(&q, &tables, scale, window)? {
            return self.o_proj.forward(&out, OpMode::Generate, None, adapters);
        }
        let mut outs = Vec::with_capacity(rows);
        for (r, cache) in caches.iter().enumerate() {
            if let Some(out) = cache.attend(&q.narrow(0, r, 1)?, scale, window)? {
                outs.push(out);
                continue;
            }
            let (kr, vr) = cache.all()?;
            let n_rep = self.num_heads / self.num_kv_heads;
            let kr = repeat_kv(kr, n_rep)?;
            let vr = repeat_kv(vr, n_rep)?;
            let scores = (q.narrow(0, r, 1)?.matmul(&kr.t()?)? * scale)?;
            let scores = match causal_mask(1, positions[r], window, scores.dtype(), scores.device())? {
                Some(mask) => scores.broadcast_add(&mask)?,
                None => scores,
            };
            let probs = candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?.to_dtype(q.dtype())?;
            outs.push(probs.matmul(&vr.contiguous()?)?.transpose(1, 2)?.reshape((1, t, self.num_heads * d))?);
        }
        let out = Tensor::cat(&outs, 0)?;
        self.o_proj.forward(&out, OpMode::Generate, None, adapters)
    }
}

/// (b, kv_heads, t, d) -> (b, kv_heads * n_rep, t, d), each kv head repeated for its query group.
fn repeat_kv(x: Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(x);
    }
    let (b, kvh, t, d) = x.dims4()?;
    x.unsqueeze(2)?.expand((b, kvh, n_rep, t, d))?.reshape((b, kvh * n_rep, t, d))
}

#[derive(Debug, Clone)]
pub struct Mlp {
    gate_proj: AdaptedLinear,
    up_proj: AdaptedLinear,
    down_proj: AdaptedLinear,
}

impl Mlp {
    pub fn new(cfg: &ModelConfig, lora: Option<&LoraSettings>, quantized: &mut QuantizedWeights, vb: VarBuilder) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let mut lin = |a, b, name: &str| adapted_linear(lora, quantized, (a, b), cfg.mlp_bias, vb.pp(name));
        Ok(Self { gate_proj: lin(h, i, "gate_proj")?, up_proj: lin(h, i, "up_proj")?, down_proj: lin(i, h, "down_proj")? })
    }

    /// `residual + mlp(x)`: the sum is down_proj's (`AdaptedLinear::forward_add`).
    pub fn forward(&self, x: &Tensor, residual: &Tensor, pos: &PositionInputs) -> Result<Tensor> {
        let seeds = pos.row_seeds.as_deref();
        let h = match AdaptedLinear::swiglu_in_training(&self.gate_proj, &self.up_proj, x, pos.mode, &pos.adapters)? {
            Some(h) => h,
            None => {
                let [gate, up]: [Tensor; 2] =
                    AdaptedLinear::forward_shared(&[&self.gate_proj, &self.up_proj], x, pos.mode, seeds, &pos.adapters)?
                        .try_into()
                        .expect("two products");
                match ops::fused::swiglu_applies(&gate, &up) {
                    true => ops::fused::swiglu(&gate, &up)?,
                    false => (candle_nn::ops::silu(&gate)? * up)?,
                }
            }
        };
        self.down_proj.forward_add(&h, residual, pos.mode, seeds, &pos.adapters)
    }
}

/// One transformer block. Constructible on its own from a VarBuilder over just its tensors
/// (`input_layernorm`, `self_attn.*`, `post_attention_layernorm`, `mlp.*`), which is how the
/// FSDP engine rebuilds a block from gathered weights.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    /// Its linear layers hand their weight gradients to `sink` in training instead of candle's
    /// gradient store (`ops::weight_grads`).
    pub fn send_weight_grads_to(&mut self, sink: Option<WeightGrads>) {
        let a = &mut self.self_attn;
        let m = &mut self.mlp;
        for l in [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj, &mut m.gate_proj, &mut m.up_proj, &mut m.down_proj] {
            l.send_weight_grads_to(sink.clone());
        }
    }
}

impl DecoderLayer {
    /// The layer at `vb`; `lora` adds the adapters it targets (their tensors must be in `vb`).
    pub fn new(cfg: &ModelConfig, lora: Option<&LoraSettings>, vb: VarBuilder) -> Result<Self> {
        Self::with_quantized(cfg, lora, &mut QuantizedWeights::default(), vb)
    }

    /// As [`Self::new`], the matrices found in `quantized` (by full name) kept quantised.
    pub fn with_quantized(
        cfg: &ModelConfig,
        lora: Option<&LoraSettings>,
        quantized: &mut QuantizedWeights,
        vb: VarBuilder,
    ) -> Result<Self> {
        Ok(Self {
            input_layernorm: RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("input_layernorm"))?,
            self_attn: Attention::new(cfg, lora, quantized, vb.pp("self_attn"))?,
            post_attention_layernorm: RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("post_attention_layernorm"))?,
            mlp: Mlp::new(cfg, lora, quantized, vb.pp("mlp"))?,
        })
    }

    pub fn forward(&self, x: &Tensor, pos: &PositionInputs, cache: Option<&mut LayerKvCache>) -> Result<Tensor> {
        if cache.is_none() {
            if let Some(out) = self.forward_as_sublayers(x, pos)? {
                return Ok(out);
            }
        }
        self.forward_op_by_op(x, pos, cache)
    }

    /// The block's ops one by one.
    fn forward_op_by_op(&self, x: &Tensor, pos: &PositionInputs, cache: Option<&mut LayerKvCache>) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x, pos.mode)?;
        let x = self.self_attn.forward(&h, x, pos, cache)?;
        let h = self.post_attention_layernorm.forward(&x, pos.mode)?;
        self.mlp.forward(&h, &x, pos)
    }

    /// One decode step for several independent sequences (see `Attention::forward_decode_rows`).
    pub fn forward_decode_rows(
        &self,
        x: &Tensor,
        pos: &PositionInputs,
        positions: &[usize],
        window: Option<usize>,
        caches: &mut [&mut LayerKvCache],
    ) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x, OpMode::Generate)?;
        let x = (x + self.self_attn.forward_decode_rows(&h, pos, positions, window, caches)?)?;
        let h = self.post_attention_layernorm.forward(&x, OpMode::Generate)?;
        self.mlp.forward(&h, &x, pos)
    }
}
