//! The FSDP step engine: fp32 master chunks per rank, one all-gather per unit before it runs,
//! backward one stage at a time (candle's backward is whole-graph, so each stage's graph is cut
//! at its input), gradients reduce-scattered per unit as soon as the unit's last stage is done,
//! then clipping and AdamW on the chunks.
//!
//! The state lives in one of two places: host vectors (CPU runs, and `--cpu-offload` on a GPU;
//! the collectives take slices and AdamW is a loop) or device tensors (GPU runs; the collectives
//! take tensors and AdamW is tensor operations). The two paths compute the same numbers; a test
//! runs both on CPU.
//!
//! The engine drives any [`StagedModel`]; it never names an architecture.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use models::{Packing, StageContext, StagedModel};

mod collectives;
mod grads;
mod reshard;
mod state;
mod step;

use super::optim::{adamw_step, adamw_step_tensors, clip_coefficient, AdamWConfig, AdamWState, AdamWTensors};
use super::plan::{ShardingStrategy, UnitPlan};
pub use crate::dist::ProcessGroups;


#[derive(Debug, Clone, Copy)]
pub struct FsdpOptions {
    pub strategy: ShardingStrategy,
    pub activation_checkpointing: bool,
    /// dtype the gathered parameters travel in (rounded to it). On a GPU it is also the compute
    /// dtype (FSDP2's `MixedPrecisionPolicy.param_dtype`); on CPU compute stays f32, where bf16
    /// matmuls are slower and no more accurate.
    pub param_dtype: DType,
    /// dtype gradients are reduced in.
    pub reduce_dtype: DType,
}

/// The three per-parameter parts of the state a checkpoint carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatePart {
    Master,
    ExpAvg,
    ExpAvgSq,
}

impl StatePart {
    pub const ALL: [StatePart; 3] = [StatePart::Master, StatePart::ExpAvg, StatePart::ExpAvgSq];

    /// Suffix of the part's tensor names in checkpoint files.
    pub fn suffix(self) -> &'static str {
        match self {
            StatePart::Master => "",
            StatePart::ExpAvg => ".exp_avg",
            StatePart::ExpAvgSq => ".exp_avg_sq",
        }
    }
}

struct UnitState {
    plan: UnitPlan,
    /// This rank's fp32 chunk of each parameter (padded rows included).
    master: Vec<Vec<f32>>,
    /// Accumulated, already reduced gradient chunks (empty for frozen parameters).
    grad: Vec<Vec<f32>>,
    /// AdamW moments (empty for frozen parameters).
    adam: Vec<AdamWState>,
    /// Full parameters while gathered; the trainable ones are variables (`Var`), so that a
    /// forward over them builds the graph backward needs.
    gathered: Option<HashMap<String, Tensor>>,
    /// The gathered tensors' bytes were freed in place (FULL_SHARD between a unit's forward
    /// and its backward, see `reshard`); they are refilled before the unit runs again.
    freed: bool,
    /// Full-size gradients of the trainable parameters collected during backward, until
    /// reduce-scatter, already in the rank-major layout reduce-scatter takes (rank k's chunks of
    /// every trainable parameter, in order).
    full_grad: Option<Vec<f32>>,
    /// The same state on the compute device (see [`DeviceState`]); `None` until first used,
    /// and again after `load_unit_part` replaced the host copy.
    dev: Option<DeviceState>,
    /// With device state: full-size f32 gradients by parameter name until reduce-scatter.
    dev_full_grads: HashMap<String, Tensor>,
}

/// A unit's fp32 state as tensors on the compute device, one per parameter chunk (padded rows
/// included): what GPUs train from, so that a step moves only collectives' data. The host
/// vectors of [`UnitState`] are emptied on upload (no second copy in host memory) and refilled
/// by [`FsdpEngine::sync_host`] when the state is saved or inspected.
struct DeviceState {
    master: Vec<Tensor>,
    /// Reduced gradient, exp_avg and exp_avg_sq of each trainable chunk (`None` when frozen).
    grad: Vec<Option<Tensor>>,
    exp_avg: Vec<Option<Tensor>>,
    exp_avg_sq: Vec<Option<Tensor>>,
}

/// Bytes a rank's buffers hold for the training state (fp32 each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateBytes {
    pub params: usize,
    pub grads: usize,
    pub optimizer: usize,
}

impl StateBytes {
    pub fn total(&self) -> usize {
        self.params + self.grads + self.optimizer
    }
}

/// This rank's chunk of one parameter, as a sharded checkpoint stores it.
pub struct ParamShard<'a> {
    pub layout: &'a crate::fsdp::plan::ParamLayout,
    pub weights: &'a [f32],
    /// AdamW moments (empty for frozen parameters).
    pub exp_avg: &'a [f32],
    pub exp_avg_sq: &'a [f32],
}

/// What a gather is for: compute (rounded to `param_dtype`, the compute dtype) or reading the
/// stored f32 values (export).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GatherFor {
    Compute,
    Export,
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy)]
pub struct StepStats {
    pub grad_norm: f64,
    pub lr: f64,
}

pub struct FsdpEngine {
    model: Arc<dyn StagedModel>,
    units: Vec<UnitState>,
    /// Units read by each stage.
    stage_units: Vec<Vec<usize>>,
    groups: ProcessGroups,
    opts: FsdpOptions,
    device: Device,
    adam: AdamWConfig,
    /// Parameters that get weight decay.
    decay: HashMap<String, bool>,
    /// Master weights, gradients and moments live on `device` (GPUs) instead of in host vectors.
    state_on_device: bool,
    /// The device state changed since the host mirror was last refreshed.
    host_stale: bool,
    pub step: u64,
}

/// Runs `f` on a contiguous f32 CPU tensor's values without copying them (copying otherwise).
fn with_f32_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((a, b))) = (&*storage, layout.contiguous_offsets()) {
            if let Ok(values) = cpu.as_slice::<f32>() {
                return Ok(f(&values[a..b]));
            }
        }
    }
    Ok(f(&t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?))
}

/// Rounds values through `dtype` (what sending them in that dtype does to them).
fn round_through(v: &mut [f32], dtype: DType) {
    match dtype {
        DType::BF16 => v.iter_mut().for_each(|x| *x = half::bf16::from_f32(*x).to_f32()),
        DType::F16 => v.iter_mut().for_each(|x| *x = half::f16::from_f32(*x).to_f32()),
        _ => {}
    }
}

impl FsdpEngine {
    /// An engine whose master chunks are zero until `load_unit` fills them.
    pub fn new(
        model: Arc<dyn StagedModel>,
        plan: Vec<UnitPlan>,
        groups: ProcessGroups,
        opts: FsdpOptions,
        adam: AdamWConfig,
        weight_decay_all: bool,
    ) -> Result<Self> {
        let mut stage_units = vec![vec![]; model.num_stages()];
        for (s, su) in stage_units.iter_mut().enumerate() {
            let names = model.stage_parameters(s);
            for (u, unit) in plan.iter().enumerate() {
                if unit.params.iter().any(|p| names.contains(&p.spec.name)) {
                    su.push(u);
                }
            }
        }
        // transformers' Trainer: no decay for biases and norm weights (the 1-D parameters).
        let decay = plan
            .iter()
            .flat_map(|u| u.params.iter())
            .map(|p| (p.spec.name.clone(), weight_decay_all || p.spec.shape.len() >= 2))
            .collect();
        let trained_len = |p: &crate::fsdp::plan::ParamLayout| if p.trainable { p.chunk_len() } else { 0 };
        let units = plan
            .into_iter()
            .map(|plan| UnitState {
                master: plan.params.iter().map(|p| vec![0.0; p.chunk_len()]).collect(),
                grad: plan.params.iter().map(|p| vec![0.0; trained_len(p)]).collect(),
                adam: plan.params.iter().map(|p| AdamWState::new(trained_len(p))).collect(),
                plan,
                gathered: None,
                freed: false,
                full_grad: None,
                dev: None,
                dev_full_grads: HashMap::new(),
            })
            .collect();
        Ok(Self {
            model,
            units,
            stage_units,
            groups,
            opts,
            device: Device::Cpu,
            adam,
            decay,
            state_on_device: false,
            host_stale: false,
            step: 0,
        })
    }

    /// Runs the units on `device` (default: CPU). On a GPU the fp32 master chunks, gradients
    /// and AdamW moments move there too (see `with_cpu_offload`).
    pub fn with_device(mut self, device: Device) -> Self {
        self.state_on_device = !device.is_cpu();
        self.device = device;
        self
    }

    /// `true`: keep master chunks, gradients and moments in host memory, as FSDP2's
    /// `CPUOffloadPolicy` does (a unit's parameters go to the device when gathered, its
    /// gradients come back when reduce-scattered, AdamW runs on the CPU). `false`: keep them on
    /// the device, as tensors (on CPU this runs the GPU's code path, for tests).
    pub fn with_cpu_offload(mut self, offload: bool) -> Self {
        self.state_on_device = !offload;
        self
    }


    pub fn device(&self) -> &Device {
        &self.device
    }

    /// dtype the units compute in: `param_dtype` on a GPU, f32 on CPU.
    fn compute_dtype(&self) -> DType {
        if self.device.is_cpu() {
            DType::F32
        } else {
            self.opts.param_dtype
        }
    }

    pub fn units(&self) -> impl Iterator<Item = &UnitPlan> {
        self.units.iter().map(|u| &u.plan)
    }

    pub fn groups(&self) -> &ProcessGroups {
        &self.groups
    }


    /// Gathers the units stage `s` reads, or refills those whose bytes were freed.
    fn ensure_gathered(&mut self, s: usize) -> Result<()> {
        for &u in &self.stage_units[s].clone() {
            if self.units[u].gathered.is_none() {
                if self.state_on_device {
                    self.ensure_device_state(u)?;
                }
                let vars = self.gather(u, GatherFor::Compute)?;
                self.units[u].gathered = Some(vars);
            } else if self.units[u].freed {
                self.refill(u)?;
            }
        }
        Ok(())
    }

    /// Frees unit `u`'s gathered parameters until it runs again. On the CPU their bytes go and
    /// the tensors stay (a kept graph points at them; see `reshard`). On a GPU the tensors are
    /// dropped, which frees them when no graph holds them (activation checkpointing, or after
    /// a backward); a forward graph kept without checkpointing still holds them there.
    fn reshard(&mut self, u: usize) -> Result<()> {
        let unit = &mut self.units[u];
        let Some(params) = &unit.gathered else { return Ok(()) };
        if !self.device.is_cpu() {
            unit.gathered = None;
            return Ok(());
        }
        if !unit.freed {
            for t in params.values() {
                reshard::free(t)?;
            }
            unit.freed = true;
        }
        Ok(())
    }

    /// Refills unit `u`'s freed tensors in place from a new all-gather.
    fn refill(&mut self, u: usize) -> Result<()> {
        let values = self.gather_full_values(u)?;
        let unit = &mut self.units[u];
        let params = unit.gathered.as_ref().expect("a freed unit keeps its tensors");
        for (p, v) in unit.plan.params.iter().zip(values) {
            reshard::refill(&params[&p.spec.name], v)?;
        }
        unit.freed = false;
        Ok(())
    }

    /// Whether a unit read by stage `s` can be resharded after the stage's forward: FULL_SHARD,
    /// the next stage does not read it, and `s` is not the last stage (its backward follows at
    /// once, so FSDP2 and torchtitan keep the last unit gathered).
    fn reshard_after_forward(&self, u: usize, s: usize) -> bool {
        self.opts.strategy.reshard_after_forward() && s + 1 < self.model.num_stages() && !self.stage_units[s + 1].contains(&u)
    }

    /// Whether stage `s` has a parameter to train.
    fn stage_trains(&self, s: usize) -> bool {
        let wanted = self.model.stage_parameters(s);
        self.stage_units[s].iter().any(|&u| self.units[u].plan.params.iter().any(|p| p.trainable && wanted.contains(&p.spec.name)))
    }

    /// Stage `s`'s parameters: the gathered tensors themselves (graph-building), or detached
    /// views (no graph).
    fn stage_params(&self, s: usize, with_graph: bool) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for &u in &self.stage_units[s] {
            for (k, v) in self.units[u].gathered.as_ref().expect("gathered") {
                out.insert(k.clone(), if with_graph { v.clone() } else { v.detach() });
            }
        }
        let wanted = self.model.stage_parameters(s);
        out.retain(|k, _| wanted.contains(k));
        out
    }

    /// Sum of token losses of one micro-batch, labels already aligned with inputs (the shift
    /// happens here, as in transformers); -100 is ignored.
    fn loss_sum(logits: &Tensor, labels: &[i64], b: usize, t: usize) -> Result<Tensor> {
        // Per-position losses: the model ran its head and the loss together (targets given).
        if logits.rank() == 1 {
            return Ok(logits.sum_all()?);
        }
        let v = logits.dim(D::Minus1)?;
        if models::fused::applies(logits) {
            // Every position, the last of each row ignored: no copy of the logits, and no
            // (rows, vocab) log-probabilities kept for backward.
            let targets: Vec<i64> = (0..b * t).map(|i| if i % t == t - 1 { -100 } else { labels[i + 1] }).collect();
            return Ok(models::fused::cross_entropy_rows(&logits.reshape((b * t, v))?, &targets)?.sum_all()?);
        }
        // In f32 whatever the compute dtype, as transformers' loss upcasts the logits.
        let logits = logits.narrow(1, 0, t - 1)?.reshape((b * (t - 1), v))?.to_dtype(DType::F32)?;
        let mut targets = Vec::with_capacity(b * (t - 1));
        let mut mask = Vec::with_capacity(b * (t - 1));
        for row in 0..b {
            for j in 1..t {
                let l = labels[row * t + j];
                let valid = l >= 0;
                if valid && l as usize >= v {
                    bail!("label {l} is outside the vocabulary ({v})");
                }
                targets.push(if valid { l as u32 } else { 0 });
                mask.push(if valid { 1f32 } else { 0.0 });
            }
        }
        let n = targets.len();
        let targets = Tensor::from_vec(targets, (n, 1), logits.device())?;
        let mask = Tensor::from_vec(mask, n, logits.device())?;
        let log_probs = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let picked = log_probs.gather(&targets, 1)?.squeeze(1)?;
        Ok((picked * mask)?.sum_all()?.neg()?)
    }

    /// Forward only (evaluation): the summed token loss of one micro-batch. Units are gathered
    /// and freed as in training; no graph is built and no gradient is touched.
    pub fn forward_loss(&mut self, input_ids: &Tensor, labels: &[i64], packing: Option<&Packing>) -> Result<f64> {
        let (b, t) = input_ids.dims2()?;
        let n = self.model.num_stages();
        let mut x = input_ids.clone();
        let ctx = StageContext { packing: packing.cloned(), ..Default::default() };
        for s in 0..n {
            self.ensure_gathered(s)?;
            x = self.model.forward_stage(s, &self.stage_params(s, false), &x, &ctx)?;
            // No graph: a unit no later stage reads can go now.
            for u in self.stage_units[s].clone() {
                if self.units[u].plan.last_stage == s && self.opts.strategy.reshard_after_forward() {
                    self.units[u].gathered = None;
                } else if self.reshard_after_forward(u, s) {
                    self.reshard(u)?;
                }
            }
        }
        // Units SHARD_GRAD_OP keeps gathered for a backward that will not come.
        for u in &mut self.units {
            (u.gathered, u.freed) = (None, false);
        }
        Ok(Self::loss_sum(&x, labels, b, t)?.to_scalar::<f32>()? as f64)
    }

    /// Forward and backward of one micro-batch. Gradients are scaled by `1 / global_tokens`
    /// (the target-token count of the whole step, over all ranks and micro-batches) and end up
    /// reduced into the gradient chunks. `ctx` carries packing and the per-row dropout seeds.
    /// Returns this micro-batch's summed token loss.
    pub fn forward_backward(&mut self, input_ids: &Tensor, labels: &[i64], global_tokens: f64, ctx: &StageContext) -> Result<f64> {
        let (b, t) = input_ids.dims2()?;
        // On the CPU in f32 the model's last stage takes the next-token targets and returns
        // per-position losses, its head and loss fused (no (positions, vocab) logits), and the
        // embedding and head hand their weight gradients to a sink, not to candle's store.
        let weight_grads = models::weight_grads::WeightGrads::new();
        let with_targets;
        let ctx = if self.device.is_cpu() && self.compute_dtype() == DType::F32 {
            let targets: Vec<i64> = (0..b * t).map(|i| if i % t == t - 1 { -100 } else { labels[i + 1] }).collect();
            with_targets = StageContext { targets: Some(targets.into()), weight_grads: Some(weight_grads.clone()), ..ctx.clone() };
            &with_targets
        } else {
            ctx
        };
        let n = self.model.num_stages();
        let ac = self.opts.activation_checkpointing;
        let mut inputs: Vec<Tensor> = Vec::with_capacity(n);
        let mut saved: Vec<Option<(Tensor, Option<Var>)>> = (0..n).map(|_| None).collect();
        let mut x = input_ids.clone();
        for s in 0..n {
            self.ensure_gathered(s)?;
            inputs.push(x.clone());
            if ac {
                // No Var anywhere: candle builds no graph.
                x = self.model.forward_stage(s, &self.stage_params(s, false), &x, ctx)?;
            } else {
                let input_var = if s == 0 { None } else { Some(Var::from_tensor(&x)?) };
                let inp = input_var.as_ref().map(|v| v.as_tensor().clone()).unwrap_or_else(|| x.clone());
                let out = self.model.forward_stage(s, &self.stage_params(s, true), &inp, ctx)?;
                x = out.detach();
                saved[s] = Some((out, input_var));
            }
            // FULL_SHARD frees a unit after its forward, with or without a kept graph.
            for u in self.stage_units[s].clone() {
                if self.reshard_after_forward(u, s) {
                    self.reshard(u)?;
                }
            }
        }

        let mut upstream: Option<Tensor> = None;
        let mut loss_sum = 0.0;
        for s in (0..n).rev() {
            // A first stage with nothing to train (a frozen embedding) needs no backward, and
            // its units no gather.
            if s == 0 && !self.stage_trains(0) {
                saved[s] = None;
                self.finish_units_after_backward(s)?;
                continue;
            }
            self.ensure_gathered(s)?;
            // The stage's parameters are the gathered tensors themselves: with activation
            // checkpointing the stage is recomputed over them (its forward built no graph).
            let wanted = self.model.stage_parameters(s);
            let mut params: HashMap<String, Tensor> = HashMap::new();
            for &u in &self.stage_units[s] {
                for (k, v) in self.units[u].gathered.as_ref().expect("gathered") {
                    if wanted.contains(k) {
                        params.insert(k.clone(), v.clone());
                    }
                }
            }
            let (out, input_var) = if ac {
                let input_var = if s == 0 { None } else { Some(Var::from_tensor(&inputs[s])?) };
                let inp = input_var.as_ref().map(|v| v.as_tensor().clone()).unwrap_or_else(|| inputs[s].clone());
                (self.model.forward_stage(s, &params, &inp, ctx)?, input_var)
            } else {
                saved[s].take().expect("saved stage")
            };
            let objective = if s == n - 1 {
                let ls = Self::loss_sum(&out, labels, b, t)?;
                loss_sum = ls.to_scalar::<f32>()? as f64;
                (ls / global_tokens)?
            } else {
                let g = upstream.take().context("missing upstream gradient")?;
                (&out * g)?.sum_all()?
            };
            let mut grads = objective.backward()?;
            drop(out);
            // The graph has done its work: drop it (and what its ops saved, such as the fused
            // head's weight gradient) before the gradients are packed, and drop each gradient
            // once packed, so that a large unit's backward holds one gradient copy at a time.
            drop(objective);
            let upstream_grad = match &input_var {
                Some(v) => Some(grads.remove(v.as_tensor()).context("no gradient reached a stage input")?),
                None => None,
            };
            if self.state_on_device {
                self.take_stage_grads_device(s, &params, &mut grads, &weight_grads)?;
            } else {
                self.take_stage_grads_host(s, &params, &mut grads, &weight_grads)?;
            }
            if let Some(name) = weight_grads.names().first() {
                bail!("stage {s} left a gradient for {name}, which it does not read");
            }
            upstream = upstream_grad;
            drop(grads);
            self.finish_units_after_backward(s)?;
        }
        Ok(loss_sum)
    }

    /// After stage `s`'s backward, a unit whose first stage is `s` has all its gradients:
    /// reduce-scatter them and drop its gathered weights. Under FULL_SHARD, a unit an earlier
    /// stage reads again (a tied embedding) is resharded until that stage's backward.
    fn finish_units_after_backward(&mut self, s: usize) -> Result<()> {
        for u in self.stage_units[s].clone() {
            if self.units[u].plan.first_stage == s {
                self.reduce_scatter_unit(u)?;
                (self.units[u].gathered, self.units[u].freed) = (None, false);
            } else if self.opts.strategy.reshard_after_forward() && !self.stage_units[s - 1].contains(&u) {
                self.reshard(u)?;
            }
        }
        Ok(())
    }

}
