//! The FSDP step engine: fp32 master chunks per rank, one all-gather per unit before it runs,
//! backward one stage at a time (candle's backward is whole-graph, so each stage's graph is cut
//! at its input), gradients reduce-scattered per unit as soon as the unit's last stage is done,
//! then clipping and AdamW on the chunks.
//!
//! Where each unit's state lives (host vectors or device tensors) is one storage abstraction
//! with two implementations (`shards`, `host`, `device`); the engine drives it without asking
//! which. The engine drives any [`StagedModel`] and takes the loss from the caller: it never
//! names an architecture or a loss.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use models::{StageContext, StagedModel};

mod device;
mod host;
#[cfg(test)]
mod lend_tests;
mod reshard;
mod shards;
mod state;
mod step;
mod unit;

use self::shards::{UnitCtx, WeightGrad};
use self::unit::{Gathered, UnitState};
use super::optim::{clip_coefficient, AdamWConfig};
use super::plan::{ShardingStrategy, UnitPlan};
pub use crate::dist::ProcessGroups;
pub use host::travels_alone_shape;
pub use state::ParamSource;

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
    /// Start the all-gather of the units the next stage reads before this stage runs, in the
    /// forward and in the backward, and leave a unit's reduce-scatter running under the next
    /// stage's backward (FSDP2's implicit prefetch): where collectives run beside compute
    /// (`Collective::overlaps_compute`, NCCL's stream), the communication hides under
    /// compute, for one more unit's parameters (and one more unit's gradients) at a time.
    pub prefetch: bool,
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

/// Turns the last stage's output into a micro-batch's loss (a scalar), as the trainer defines
/// it: the engine knows no loss.
pub type LossFn<'a> = &'a dyn Fn(&Tensor) -> candle_core::Result<Tensor>;

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
    /// The state changed since `sync_host` last copied device state to the host.
    host_stale: bool,
    /// Nothing was loaded or trained yet: every unit's state is zeros (what `with_device` may
    /// make on the device itself instead of uploading).
    fresh: bool,
    pub step: u64,
}

/// What unit storage needs to act, from the engine's disjoint fields (so that a unit's storage
/// can be borrowed mutably beside it).
fn unit_ctx<'a>(plan: &'a UnitPlan, groups: &'a ProcessGroups, opts: &'a FsdpOptions, device: &'a Device) -> UnitCtx<'a> {
    // On the CPU compute stays f32: bf16 tensors would run candle's elementwise ops per value
    // through conversions. Only the linear products round to bf16 (`bf16_products`).
    let compute_dtype = if device.is_cpu() { DType::F32 } else { opts.param_dtype };
    UnitCtx { plan, shard: groups.shard.as_ref(), opts, device, compute_dtype }
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
        let decay =
            plan.iter().flat_map(|u| u.params.iter()).map(|p| (p.spec.name.clone(), weight_decay_all || p.spec.shape.len() >= 2)).collect();
        let units = plan
            .into_iter()
            .map(|plan| UnitState { shards: Box::new(host::HostShards::zeros(&plan)), plan, host_copy: None, gathered: Gathered::No })
            .collect();
        Ok(Self { model, units, stage_units, groups, opts, device: Device::Cpu, adam, decay, host_stale: false, fresh: true, step: 0 })
    }

    /// Runs the units on `device` (default: CPU), with the fp32 master chunks, gradients and
    /// AdamW moments as tensors on it (`state_on_device`, what GPUs train from; on the CPU this
    /// runs the GPU's code path, for tests) or in host vectors (CPU runs, and `--cpu-offload`
    /// on a GPU as FSDP2's `CPUOffloadPolicy`: a unit's parameters go to the device when
    /// gathered, its gradients come back when reduce-scattered, AdamW runs on the CPU).
    ///
    /// On an engine fresh from [`Self::new`] (nothing loaded or trained: its state all zeros)
    /// device state is made on the device: uploading the host's zeros moved four times the
    /// master weights' bytes (weights, gradients, both moments) before loading moved the
    /// weights again.
    pub fn with_device(mut self, device: Device, state_on_device: bool) -> Result<Self> {
        self.device = device;
        self.place_state(state_on_device)?;
        Ok(self)
    }

    /// Moves every unit's state to device tensors or to host vectors.
    fn place_state(&mut self, on_device: bool) -> Result<()> {
        for unit in &mut self.units {
            let cx = unit_ctx(&unit.plan, &self.groups, &self.opts, &self.device);
            match (on_device, unit.shards.as_host()) {
                // A fresh engine's state is zeros: made on the device, not uploaded.
                (true, Some(host)) => unit.shards = Box::new(device::DeviceShards::new((!self.fresh).then_some(host), &cx)?),
                (false, None) => unit.shards = Box::new(host::HostShards::from_state(unit.shards.to_host(&cx)?)),
                _ => {}
            }
            unit.host_copy = None;
        }
        self.host_stale = true;
        Ok(())
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn units(&self) -> impl Iterator<Item = &UnitPlan> {
        self.units.iter().map(|u| &u.plan)
    }

    pub fn groups(&self) -> &ProcessGroups {
        &self.groups
    }

    /// Gathers the units stage `s` reads, or refills those whose bytes were freed.
    fn ensure_gathered(&mut self, s: usize) -> Result<()> {
        self.gather_stage(s, true)
    }

    /// As [`Self::ensure_gathered`], but with `refill` false a freed unit stays freed (its
    /// tensors are there for the graph, their values are not needed).
    fn gather_stage(&mut self, s: usize, refill: bool) -> Result<()> {
        for &u in &self.stage_units[s].clone() {
            if let Some(started) = self.units[u].gathered.take_started() {
                let unit = &mut self.units[u];
                let cx = unit_ctx(&unit.plan, &self.groups, &self.opts, &self.device);
                let tensors = unit.shards.finish_gather(&cx, started)?;
                let named = unit.plan.params.iter().map(|p| p.spec.name.clone()).zip(tensors).collect();
                unit.gathered = Gathered::Full(named);
            } else if matches!(self.units[u].gathered, Gathered::No) {
                let unit = &mut self.units[u];
                let cx = unit_ctx(&unit.plan, &self.groups, &self.opts, &self.device);
                let tensors = match unit.shards.lend(&cx) {
                    Some(values) => {
                        let tensors =
                            unit.plan.params.iter().zip(values).map(|(p, v)| host::compute_tensor(p, v, cx.compute_dtype, cx.device));
                        tensors.collect::<candle_core::Result<Vec<_>>>()?
                    }
                    None => unit.shards.gather(&cx, GatherFor::Compute)?,
                };
                let named = unit.plan.params.iter().map(|p| p.spec.name.clone()).zip(tensors).collect();
                self.units[u].gathered = Gathered::Full(named);
            } else if matches!(self.units[u].gathered, Gathered::Freed(_)) && refill {
                self.refill(u)?;
            }
        }
        Ok(())
    }

    /// Starts the all-gather of the units stage `s` reads that are not gathered (see
    /// `FsdpOptions::prefetch`), where their storage can start one.
    fn prefetch(&mut self, s: usize) -> Result<()> {
        if !self.opts.prefetch || s >= self.stage_units.len() {
            return Ok(());
        }
        for &u in &self.stage_units[s].clone() {
            let unit = &mut self.units[u];
            if matches!(unit.gathered, Gathered::No) {
                let cx = unit_ctx(&unit.plan, &self.groups, &self.opts, &self.device);
                if let Some(started) = unit.shards.start_gather(&cx)? {
                    unit.gathered = Gathered::Coming(started);
                }
            }
        }
        Ok(())
    }

    /// Frees unit `u`'s gathered parameters until it runs again. On the CPU their bytes go and
    /// the tensors stay (a kept graph points at them; see `reshard`). On a GPU the tensors are
    /// dropped, which frees them when no graph holds them (activation checkpointing, or after
    /// a backward); see `reshard_before_backward` for when a forward graph is kept there.
    fn reshard(&mut self, u: usize) -> Result<()> {
        if !self.device.is_cpu() {
            return self.drop_gathered(u);
        }
        let unit = &mut self.units[u];
        let Gathered::Full(params) = &unit.gathered else { return Ok(()) };
        if unit.shards.is_lent() {
            unit.return_lent()?;
        } else {
            for t in params.values() {
                reshard::free(t)?;
            }
        }
        unit.gathered = match std::mem::replace(&mut unit.gathered, Gathered::No) {
            Gathered::Full(t) => Gathered::Freed(t),
            other => other,
        };
        Ok(())
    }

    /// Drops unit `u`'s gathered tensors, the master chunks they hold going back first.
    fn drop_gathered(&mut self, u: usize) -> Result<()> {
        let unit = &mut self.units[u];
        if unit.shards.is_lent() {
            unit.return_lent()?;
        }
        unit.gathered = Gathered::No;
        Ok(())
    }

    /// Refills unit `u`'s freed tensors in place from a new all-gather (or the master chunks
    /// lent again).
    fn refill(&mut self, u: usize) -> Result<()> {
        let unit = &mut self.units[u];
        let cx = unit_ctx(&unit.plan, &self.groups, &self.opts, &self.device);
        let values = match unit.shards.lend(&cx) {
            Some(values) => values,
            None => unit.shards.gather_values(&cx)?,
        };
        let Gathered::Freed(params) = std::mem::replace(&mut unit.gathered, Gathered::No) else {
            anyhow::bail!("refilling unit {u}, which is not freed");
        };
        for (p, v) in unit.plan.params.iter().zip(values) {
            reshard::refill(&params[&p.spec.name], v)?;
        }
        unit.gathered = Gathered::Full(params);
        Ok(())
    }

    /// Whether a unit read by stage `s` can be resharded after the stage's forward: FULL_SHARD,
    /// the next stage does not read it, and `s` is not the last stage (its backward follows at
    /// once, so FSDP2 and torchtitan keep the last unit gathered).
    fn reshard_after_forward(&self, u: usize, s: usize) -> bool {
        self.opts.strategy.reshard_after_forward() && s + 1 < self.model.num_stages() && !self.stage_units[s + 1].contains(&u)
    }

    /// Whether a unit can be resharded while a backward that reads it is still to come. On the
    /// CPU always: its bytes go, its tensors stay for a kept graph. On a GPU only with
    /// activation checkpointing (every stage is recomputed there, so no graph is kept):
    /// without it, the forward graph holds the gathered tensors, dropping ours frees nothing,
    /// and the backward must take the gradients of those very tensors, not of a new gather.
    fn reshard_before_backward(&self) -> bool {
        self.device.is_cpu() || self.opts.activation_checkpointing
    }

    /// Whether activation checkpointing recomputes stage `s` in its backward. A stage whose
    /// backward reads no parameter (an embedding) keeps its forward graph instead where the
    /// engine can free the parameters' bytes under it (the CPU; see `reshard`): the graph then
    /// holds activations only, and the backward needs no gather.
    fn recomputes(&self, s: usize) -> bool {
        self.model.stage_backward_reads_params(s) || !self.device.is_cpu()
    }

    /// Whether stage `s`'s backward runs (and gathers its units): all but a first stage with
    /// nothing to train (a frozen embedding), whose gradient no one needs.
    fn backward_runs(&self, s: usize) -> bool {
        s > 0 || self.stage_trains(0)
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
            for (k, v) in self.units[u].gathered.tensors().expect("the stage's units are gathered") {
                out.insert(k.clone(), if with_graph { v.clone() } else { v.detach() });
            }
        }
        let wanted = self.model.stage_parameters(s);
        out.retain(|k, _| wanted.contains(k));
        out
    }

    /// Forward only (evaluation): the summed token loss of one micro-batch. Units are gathered
    /// and freed as in training; no graph is built and no gradient is touched.
    pub fn forward_loss(&mut self, input_ids: &Tensor, ctx: &StageContext, loss: LossFn) -> Result<f64> {
        kernels::matmul::with_bf16_products(self.bf16_products(), || self.forward_loss_in(input_ids, ctx, loss))
    }

    /// Whether the linear layers' products run in bf16: on the CPU, where compute stays f32
    /// (`unit_ctx`), bf16 parameters ask for PyTorch's CPU autocast, products of bf16-rounded
    /// operands with f32 sums, which the kernels run on AMX-BF16 tiles where the CPU has them
    /// (and in f32 elsewhere).
    fn bf16_products(&self) -> bool {
        self.device.is_cpu() && self.opts.param_dtype == DType::BF16
    }

    fn forward_loss_in(&mut self, input_ids: &Tensor, ctx: &StageContext, loss: LossFn) -> Result<f64> {
        self.fresh = false;
        let n = self.model.num_stages();
        let mut x = input_ids.clone();
        // `s` names the stage in several of the engine's calls, not only an index into `saved`.
        #[allow(clippy::needless_range_loop)]
        for s in 0..n {
            self.ensure_gathered(s)?;
            self.prefetch(s + 1)?;
            x = self.model.forward_stage(s, &self.stage_params(s, false), &x, ctx)?;
            // No graph: a unit no later stage reads can go now.
            for u in self.stage_units[s].clone() {
                if self.units[u].plan.last_stage == s && self.opts.strategy.reshard_after_forward() {
                    self.drop_gathered(u)?;
                } else if self.reshard_after_forward(u, s) {
                    self.reshard(u)?;
                }
            }
        }
        // Units SHARD_GRAD_OP keeps gathered for a backward that will not come.
        for u in 0..self.units.len() {
            self.drop_gathered(u)?;
        }
        Ok(loss(&x)?.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64)
    }

    /// Forward and backward of one micro-batch: `loss` turns the last stage's output into the
    /// micro-batch's loss, whose gradients, times `grad_scale`, end up reduced into the gradient
    /// chunks (the trainer passes 1 / the step's target tokens over all ranks and
    /// micro-batches). `ctx` carries what the model's stages take (packing, dropout seeds,
    /// targets). Returns the value of `loss`.
    pub fn forward_backward(&mut self, input_ids: &Tensor, ctx: &StageContext, loss: LossFn, grad_scale: f64) -> Result<f64> {
        let bf16 = self.bf16_products();
        kernels::matmul::with_bf16_products(bf16, || self.forward_backward_in(input_ids, ctx, loss, grad_scale))
    }

    fn forward_backward_in(&mut self, input_ids: &Tensor, ctx: &StageContext, loss: LossFn, grad_scale: f64) -> Result<f64> {
        self.fresh = false;
        // Ops that can (the embedding and the fused head, on the CPU) hand their weight
        // gradients to this sink instead of candle's gradient store.
        let weight_grads = ops::weight_grads::WeightGrads::new();
        let ctx = &StageContext { weight_grads: Some(weight_grads.clone()), ..ctx.clone() };
        let n = self.model.num_stages();
        let ac = self.opts.activation_checkpointing;
        let mut inputs: Vec<Tensor> = Vec::with_capacity(n);
        let mut saved: Vec<Option<(Tensor, Option<Var>)>> = (0..n).map(|_| None).collect();
        let mut x = input_ids.clone();
        // `s` names the stage in several of the engine's calls, not only an index into `saved`.
        #[allow(clippy::needless_range_loop)]
        for s in 0..n {
            self.ensure_gathered(s)?;
            self.prefetch(s + 1)?;
            inputs.push(x.clone());
            if ac && self.recomputes(s) {
                // No Var anywhere: candle builds no graph.
                x = self.model.forward_stage(s, &self.stage_params(s, false), &x, ctx)?;
            } else {
                let input_var = if s == 0 { None } else { Some(Var::from_tensor(&x)?) };
                let inp = input_var.as_ref().map(|v| v.as_tensor().clone()).unwrap_or_else(|| x.clone());
                let out = self.model.forward_stage(s, &self.stage_params(s, true), &inp, ctx)?;
                x = out.detach();
                saved[s] = Some((out, input_var));
            }
            // FULL_SHARD frees a unit after its forward (see `reshard_before_backward`).
            for u in self.stage_units[s].clone() {
                if self.reshard_after_forward(u, s) && self.reshard_before_backward() {
                    self.reshard(u)?;
                }
            }
        }

        let mut upstream: Option<Tensor> = None;
        let mut loss_sum = 0.0;
        for s in (0..n).rev() {
            // A first stage with nothing to train (a frozen embedding) needs no backward, and
            // its units no gather.
            if !self.backward_runs(s) {
                saved[s] = None;
                self.finish_units_after_backward(s)?;
                continue;
            }
            let recompute = ac && self.recomputes(s);
            // A kept graph whose backward reads no parameter needs their tensors, not their
            // values: freed ones stay freed.
            self.gather_stage(s, recompute || self.model.stage_backward_reads_params(s))?;
            if s > 0 && self.backward_runs(s - 1) {
                self.prefetch(s - 1)?;
            }
            // The stage's parameters are the gathered tensors themselves: with activation
            // checkpointing the stage is recomputed over them (its forward built no graph).
            let wanted = self.model.stage_parameters(s);
            let mut params: HashMap<String, Tensor> = HashMap::new();
            for &u in &self.stage_units[s] {
                for (k, v) in self.units[u].gathered.tensors().expect("the stage's units are gathered") {
                    if wanted.contains(k) {
                        params.insert(k.clone(), v.clone());
                    }
                }
            }
            let (out, input_var) = if recompute {
                let input_var = if s == 0 { None } else { Some(Var::from_tensor(&inputs[s])?) };
                let inp = input_var.as_ref().map(|v| v.as_tensor().clone()).unwrap_or_else(|| inputs[s].clone());
                (self.model.forward_stage(s, &params, &inp, ctx)?, input_var)
            } else {
                saved[s].take().expect("saved stage")
            };
            let objective = if s == n - 1 {
                let l = loss(&out)?;
                loss_sum = l.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64;
                (l * grad_scale)?
            } else {
                let g = upstream.take().context("missing upstream gradient")?;
                ops::backward_seed::seed(&out, &g)?
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
            // Units whose backward is done free their gathered bytes before their gradients are
            // reduced: some are made only now, a range of rows at a time (see
            // `ops::weight_grads`), and need the weights no more.
            for u in self.stage_units[s].clone() {
                if self.units[u].plan.first_stage == s {
                    self.reshard(u)?;
                }
            }
            self.take_stage_grads(s, &params, &mut grads, &weight_grads)?;
            if let Some(name) = weight_grads.names().first() {
                bail!("stage {s} left a gradient for {name}, which it does not read");
            }
            upstream = upstream_grad;
            drop(grads);
            self.finish_units_after_backward(s)?;
        }
        self.finish_reductions()?;
        Ok(loss_sum)
    }

    /// Finishes the reduce-scatters still running (see `FsdpOptions::prefetch`): their chunks
    /// added to the gradient chunks.
    fn finish_reductions(&mut self) -> Result<()> {
        for unit in &mut self.units {
            let cx = unit_ctx(&unit.plan, &self.groups, &self.opts, &self.device);
            unit.shards.finish_reduce(&cx)?;
        }
        Ok(())
    }

    /// After stage `s`'s backward, a unit whose first stage is `s` has all its gradients:
    /// reduce-scatter them and drop its gathered weights. Under FULL_SHARD, a unit an earlier
    /// stage reads again (a tied embedding) is resharded until that stage's backward.
    fn finish_units_after_backward(&mut self, s: usize) -> Result<()> {
        for u in self.stage_units[s].clone() {
            if self.units[u].plan.first_stage == s {
                // One reduce-scatter left running at a time (with prefetch; else none): the
                // one before ends here.
                self.finish_reductions()?;
                let unit = &mut self.units[u];
                unit.shards.reduce_scatter(&unit_ctx(&unit.plan, &self.groups, &self.opts, &self.device))?;
                if !self.opts.prefetch {
                    self.finish_reductions()?;
                }
                self.drop_gathered(u)?;
                self.host_stale = true;
            } else if self.opts.strategy.reshard_after_forward() && !self.stage_units[s - 1].contains(&u) && self.reshard_before_backward()
            {
                self.reshard(u)?;
            }
        }
        Ok(())
    }

    /// Hands stage `s`'s weight gradients to the units' storage, in plan order (the same on
    /// every rank: some storage reduce-scatters as it takes them), each taken from the stage's
    /// weight-gradient sink where the model's op put it, else from candle's gradient store,
    /// and dropped once handed over.
    fn take_stage_grads(
        &mut self,
        s: usize,
        params: &HashMap<String, Tensor>,
        grads: &mut candle_core::backprop::GradStore,
        sink: &ops::weight_grads::WeightGrads,
    ) -> Result<()> {
        for u in self.stage_units[s].clone() {
            let unit = &mut self.units[u];
            let cx = unit_ctx(&unit.plan, &self.groups, &self.opts, &self.device);
            for (i, p) in unit.plan.params.iter().enumerate() {
                let Some(param) = params.get(&p.spec.name).filter(|t| t.is_variable()) else { continue };
                let g = sink.take(&p.spec.name).or_else(|| grads.remove(param).map(WeightGrad::dense));
                unit.shards.add_grad(&cx, i, g)?;
            }
        }
        Ok(())
    }
}
