//! LoRA adapters (Hu et al. 2021) as PEFT defines them: a targeted linear layer computes
//! `W x + b + scaling * B (A dropout(x))`, with `A: (r, in)`, `B: (out, r)` and
//! `scaling = alpha / r` (`alpha / sqrt(r)` with rsLoRA).
//!
//! Adapter tensors are named after the module they adapt (`<module>.lora_A.weight`,
//! `<module>.lora_B.weight`); a layer built from a `VarBuilder` that holds them applies them.
//! This module knows nothing about sharding or files.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, Result};
use candle_core::{Module, Tensor};

use crate::config::ModelConfig;
use crate::mode::OpMode;
use crate::multi_lora::RowAdapters;
use crate::quantized::{LinearWeight, QuantizedMatrix};
use crate::tensors::TensorSpec;
use kernels::rng::splitmix64;
use ops::weight_grads::{WeightGradTarget, WeightGrads};

pub use crate::lora_settings::{linear_modules, LoraSettings, LINEAR_MODULES};

/// Adapter tensors of decoder layer `i` for `settings`, in module order.
pub fn layer_adapter_tensors(cfg: &ModelConfig, settings: &LoraSettings, i: usize) -> Vec<TensorSpec> {
    let prefix = format!("model.layers.{i}.");
    linear_modules(cfg)
        .into_iter()
        .filter(|(path, _, _)| path.starts_with(&prefix) && settings.targets_module(path))
        .flat_map(|(path, inp, out)| {
            [
                TensorSpec { name: format!("{path}.lora_A.weight"), shape: vec![settings.r, inp] },
                TensorSpec { name: format!("{path}.lora_B.weight"), shape: vec![out, settings.r] },
            ]
        })
        .collect()
}

pub fn is_adapter_tensor(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")
}

/// Folds every adapter in `weights` into its base weight (`W += scaling * B A`) and removes the
/// adapter tensors: what PEFT's `merge_and_unload` produces.
pub fn merge_into(weights: &mut HashMap<String, Tensor>, settings: &LoraSettings) -> Result<()> {
    let a_names: Vec<String> = weights.keys().filter(|k| k.ends_with(".lora_A.weight")).cloned().collect();
    for a_name in a_names {
        let module = a_name.trim_end_matches(".lora_A.weight");
        let b_name = format!("{module}.lora_B.weight");
        let w_name = format!("{module}.weight");
        let a = weights.remove(&a_name).expect("listed");
        let Some(b) = weights.remove(&b_name) else { bail!("adapter {a_name} has no {b_name}") };
        let Some(w) = weights.get(&w_name) else { bail!("adapter {a_name} adapts {w_name}, which is not here") };
        let delta = (b.to_dtype(candle_core::DType::F32)?.matmul(&a.to_dtype(candle_core::DType::F32)?)? * settings.scaling())?;
        let merged = (w.to_dtype(candle_core::DType::F32)? + delta)?.to_dtype(w.dtype())?;
        weights.insert(w_name, merged);
    }
    Ok(())
}

/// Whether `ops::linear`'s training forms (`linear_heads_to`, `linear_add_to`) run for `t`: f32 on
/// the CPU, or on a GPU whose kernels are on.
pub(crate) fn linear_op_takes(t: &Tensor) -> bool {
    ops::applies(t) || ops::gpu_kernels_take(t)
}

/// Whether `ops::gated_mlp` takes x: f32 on the CPU, or a GPU's kernels.
pub(crate) fn gated_mlp_takes(x: &Tensor) -> bool {
    ops::applies(x) || ops::gated_mlp::gpu_takes(x)
}

/// FNV-1a of a string: a stable id for a module, mixed into its dropout seed.
fn name_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// A linear layer with an optional LoRA adapter (trained, or loaded with the model), and the
/// serving adapters of the batch's rows (`multi_lora`), found by the module's path.
#[derive(Debug, Clone)]
pub struct AdaptedLinear {
    base: LinearWeight,
    adapter: Option<Adapter>,
    /// `model.layers.3.self_attn.q_proj`.
    path: Arc<str>,
    /// Where a training forward's weight gradient goes instead of candle's gradient store
    /// (`ops::weight_grads`), under `{path}.weight`.
    weight_grads: Option<WeightGrads>,
}

#[derive(Debug, Clone)]
struct Adapter {
    a: Tensor,
    b: Tensor,
    scaling: f64,
    dropout: f64,
    module_id: u64,
}

impl AdaptedLinear {
    /// The module at `path`, without an adapter of its own.
    pub fn plain(base: LinearWeight, path: &str) -> Self {
        Self { base, adapter: None, path: path.into(), weight_grads: None }
    }

    /// `base` plus the adapter `a` (r, in), `b` (out, r) of the module at `path`.
    pub fn with_adapter(base: LinearWeight, a: Tensor, b: Tensor, settings: &LoraSettings, path: &str) -> Self {
        let adapter = Adapter { a, b, scaling: settings.scaling(), dropout: settings.dropout, module_id: name_hash(path) };
        Self { base, adapter: Some(adapter), path: path.into(), weight_grads: None }
    }

    /// `row_seeds`: one dropout seed per batch row in training (None: no dropout, as in eval).
    /// `rows`: the serving adapters of the batch's rows (empty in training).
    pub fn forward(&self, x: &Tensor, mode: OpMode, row_seeds: Option<&[u64]>, rows: &RowAdapters) -> Result<Tensor, candle_core::Error> {
        let y = self.forward_own(x, mode, row_seeds)?;
        match rows.is_empty() {
            true => Ok(y),
            false => rows.apply(&self.path, x, y),
        }
    }

    /// `self.forward(x, ..)` as (.., heads, out / heads). Training a plain dense layer on the
    /// CPU or a GPU, one op (`ops::linear::linear_heads_to`: no reshape node in the backward).
    pub fn forward_heads(
        &self,
        x: &Tensor,
        heads: usize,
        mode: OpMode,
        row_seeds: Option<&[u64]>,
        rows: &RowAdapters,
    ) -> Result<Tensor, candle_core::Error> {
        if let Some(w) = self.plain_weight_where(x, mode, rows, linear_op_takes(x)) {
            return ops::linear::linear_heads_to(x, w, heads, self.weight_grad_target());
        }
        let y = self.forward(x, mode, row_seeds, rows)?;
        let mut dims = y.dims().to_vec();
        let out = dims.pop().unwrap_or(1);
        dims.extend([heads, out / heads]);
        y.reshape(dims)
    }

    /// `residual + self.forward(x, ..)`, the block's residual connection. Training a plain
    /// dense layer on the CPU or a GPU, one op (`ops::linear::linear_add_to`, whose backward makes
    /// fewer tensors); otherwise the layer, then the sum.
    pub fn forward_add(
        &self,
        x: &Tensor,
        residual: &Tensor,
        mode: OpMode,
        row_seeds: Option<&[u64]>,
        rows: &RowAdapters,
    ) -> Result<Tensor, candle_core::Error> {
        let residual_fits = linear_op_takes(residual) && residual.dtype() == x.dtype();
        if let Some(w) = self.plain_weight_where(x, mode, rows, linear_op_takes(x)).filter(|_| residual_fits) {
            return ops::linear::linear_add_to(x, w, residual, self.weight_grad_target());
        }
        residual + self.forward(x, mode, row_seeds, rows)?
    }

    /// The dense weight and where its gradient goes, when this is a plain dense layer training
    /// on the CPU whose weight gradient has a sink or that trains nothing: an op may then keep
    /// the weight outside candle's graph (`ops::self_attention`).
    pub fn weight_with_sink(&self, x: &Tensor, mode: OpMode, rows: &RowAdapters) -> Option<(Tensor, Option<WeightGradTarget>)> {
        self.weight_with_sink_where(x, mode, rows, ops::applies(x))
    }

    /// [`Self::weight_with_sink`] where `ours` says whether the op in question runs for x (a
    /// GPU's flash kernels: `ops::self_attention_flash`).
    pub fn weight_with_sink_where(
        &self,
        x: &Tensor,
        mode: OpMode,
        rows: &RowAdapters,
        ours: bool,
    ) -> Option<(Tensor, Option<WeightGradTarget>)> {
        let w = self.plain_weight_where(x, mode, rows, ours)?;
        let to = self.weight_grad_target();
        (to.is_some() || !w.track_op()).then(|| (w.clone(), to))
    }

    /// `silu(gate(x)) ∘ up(x)`, a Llama MLP's first half, as one op (`ops::gated_mlp`, whose
    /// backward makes fewer tensors) when both layers are plain dense ones training on the CPU
    /// or on a GPU whose kernels take x; None otherwise (the caller runs the layers, then the
    /// SwiGLU).
    pub fn swiglu_in_training(
        gate: &AdaptedLinear,
        up: &AdaptedLinear,
        x: &Tensor,
        mode: OpMode,
        rows: &RowAdapters,
    ) -> Result<Option<Tensor>, candle_core::Error> {
        let ours = gated_mlp_takes(x);
        match (gate.plain_weight_where(x, mode, rows, ours), up.plain_weight_where(x, mode, rows, ours)) {
            (Some(w_gate), Some(w_up)) if w_gate.dims() == w_up.dims() => {
                let grad_to = [gate.weight_grad_target(), up.weight_grad_target()];
                ops::gated_mlp::swiglu_linear_to(x, w_gate, w_up, grad_to).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// Several layers over the same input (q/k/v, gate/up), each as [`Self::forward`]: when
    /// every one keeps its weight in 32-value blocks or in 2-byte floats, their products are one
    /// pass ([`QuantizedMatrix::forward_many`]: one parallel region instead of one per layer), as
    /// are decoding's matrix-vector products with dense weights; otherwise one by one.
    pub fn forward_shared(
        layers: &[&AdaptedLinear],
        x: &Tensor,
        mode: OpMode,
        row_seeds: Option<&[u64]>,
        rows: &RowAdapters,
    ) -> Result<Vec<Tensor>, candle_core::Error> {
        let quantized: Option<Vec<(&QuantizedMatrix, Option<&Tensor>)>> = layers
            .iter()
            .map(|l| match &l.base {
                LinearWeight::Quantized { w, bias } => Some((w, bias.as_ref())),
                _ => None,
            })
            .collect();
        let quantized_products = match &quantized {
            Some(q) => QuantizedMatrix::forward_many(&q.iter().map(|(w, _)| *w).collect::<Vec<_>>(), x)?,
            None => None,
        };
        let dense: Option<Vec<&candle_nn::Linear>> = layers.iter().map(|l| l.base.dense()).collect();
        let (products, biases): (Vec<Tensor>, Vec<Option<&Tensor>>) = match (quantized_products, dense) {
            (Some(ys), _) => (ys, quantized.iter().flatten().map(|(_, b)| *b).collect()),
            // Decoding with dense weights: the matrix-vector kernel, all rows in one region.
            (_, Some(dense)) if layers.len() > 1 && mode == OpMode::Generate => {
                let ws: Vec<&Tensor> = dense.iter().map(|l| l.weight()).collect();
                match ops::gemv::gemv_t_many(x, &ws)? {
                    Some(ys) => (ys, dense.iter().map(|l| l.bias()).collect()),
                    None => return layers.iter().map(|l| l.forward(x, mode, row_seeds, rows)).collect(),
                }
            }
            _ => return layers.iter().map(|l| l.forward(x, mode, row_seeds, rows)).collect(),
        };
        layers
            .iter()
            .zip(products)
            .zip(biases)
            .map(|((layer, y), bias)| {
                let y = match bias {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                };
                let y = layer.add_own_adapter(x, y, mode, row_seeds)?;
                match rows.is_empty() {
                    true => Ok(y),
                    false => rows.apply(&layer.path, x, y),
                }
            })
            .collect()
    }

    /// Hands the base weight's gradient to `sink` in training (see the field).
    pub fn send_weight_grads_to(&mut self, sink: Option<WeightGrads>) {
        self.weight_grads = sink;
    }

    /// The dense weight, when this layer is only `x · wᵀ` in a training forward (no bias, no
    /// adapter of its own or of the batch's rows) and `ours` says the op in question runs for x
    /// (the CPU's f32 only, or a GPU's too): the case our fused training ops cover.
    fn plain_weight_where(&self, x: &Tensor, mode: OpMode, rows: &RowAdapters, ours: bool) -> Option<&Tensor> {
        match (&self.base, &self.adapter) {
            (LinearWeight::Dense(base), None)
                if mode == OpMode::Train && rows.is_empty() && base.bias().is_none() && ours && base.weight().dtype() == x.dtype() =>
            {
                Some(base.weight())
            }
            _ => None,
        }
    }

    /// Where training sends the base weight's gradient, if somewhere other than candle's store.
    fn weight_grad_target(&self) -> Option<WeightGradTarget> {
        self.weight_grads.clone().map(|sink| WeightGradTarget { sink, name: format!("{}.weight", self.path) })
    }

    fn forward_own(&self, x: &Tensor, mode: OpMode, row_seeds: Option<&[u64]>) -> Result<Tensor, candle_core::Error> {
        let base = match &self.base {
            LinearWeight::Dense(base) => base,
            LinearWeight::Quantized { w, bias } => {
                let y = LinearWeight::forward_quantized(w, bias.as_ref(), x)?;
                return self.add_own_adapter(x, y, mode, row_seeds);
            }
        };
        // Decoding's few rows take the matrix-vector kernel. Training on the CPU, and a prompt's
        // many rows: our linear op (its backward computes only the gradients that exist; its
        // threads are the pool the other kernels use, not a second one). Training on a GPU: the
        // same op on cuBLAS (dW one product, not a sum through a transposed view of W). Else
        // candle's matmul.
        let ours = ops::applies(x) && base.weight().dtype() == x.dtype();
        let on_gpu = ops::gpu_kernels_take(x) && base.weight().dtype() == x.dtype();
        let product = match mode == OpMode::Train && (ours || on_gpu) {
            true => Some(ops::linear::linear_to(x, base.weight(), self.weight_grad_target())?),
            false => match ops::gemv::gemv_t(x, base.weight())? {
                None if ours => Some(ops::linear::linear(x, base.weight())?),
                other => other,
            },
        };
        let y = match product {
            Some(y) => match base.bias() {
                Some(b) => y.broadcast_add(b)?,
                None => y,
            },
            None => base.forward(x)?,
        };
        self.add_own_adapter(x, y, mode, row_seeds)
    }

    /// `y + scaling · B (A dropout(x))` with the layer's own adapter, if it has one.
    fn add_own_adapter(&self, x: &Tensor, y: Tensor, mode: OpMode, row_seeds: Option<&[u64]>) -> Result<Tensor, candle_core::Error> {
        let Some(ad) = &self.adapter else { return Ok(y) };
        let x = match row_seeds {
            Some(seeds) if mode == OpMode::Train && ad.dropout > 0.0 => {
                let mask = dropout_mask(x.dims(), seeds, ad.module_id, ad.dropout, x.device())?.to_dtype(x.dtype())?;
                (x * mask)?
            }
            _ => x.clone(),
        };
        let delta = x.broadcast_matmul(&ad.a.t()?)?.broadcast_matmul(&ad.b.t()?)?;
        y + (delta * ad.scaling)?
    }
}

/// Inverted-dropout mask (0 or 1/(1-p)) for an input of `dims` whose first dimension is the
/// batch: row r's mask depends only on (`seeds[r]`, the module), so a recomputed forward and any
/// split of the batch over ranks see the same mask.
fn dropout_mask(dims: &[usize], seeds: &[u64], module_id: u64, p: f64, dev: &candle_core::Device) -> candle_core::Result<Tensor> {
    let rows = dims[0];
    if seeds.len() != rows {
        candle_core::bail!("{} dropout seeds for a batch of {rows}", seeds.len());
    }
    let per_row: usize = dims[1..].iter().product();
    let keep = 1.0 / (1.0 - p) as f32;
    let threshold = (p * (1u64 << 53) as f64) as u64;
    let mut data = Vec::with_capacity(rows * per_row);
    for &seed in seeds {
        let mut state = seed ^ module_id.rotate_left(17);
        for _ in 0..per_row {
            let u = splitmix64(&mut state) >> 11;
            data.push(if u < threshold { 0.0 } else { keep });
        }
    }
    Tensor::from_vec(data, dims, dev)
}

/// PEFT's default initialisation: A ~ kaiming_uniform(a = sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)),
/// B = 0, so a fresh adapter leaves the model unchanged.
pub fn init_adapter(spec: &TensorSpec, seed: u64) -> Vec<f32> {
    let n: usize = spec.shape.iter().product();
    if spec.name.ends_with(".lora_B.weight") {
        return vec![0.0; n];
    }
    let bound = 1.0 / (spec.shape[1] as f64).sqrt();
    let mut state = seed ^ name_hash(&spec.name);
    (0..n)
        .map(|_| {
            let u = (splitmix64(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
            ((2.0 * u - 1.0) * bound) as f32
        })
        .collect()
}
