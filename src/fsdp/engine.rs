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
    pub layout: &'a super::plan::ParamLayout,
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
        let trained_len = |p: &super::plan::ParamLayout| if p.trainable { p.chunk_len() } else { 0 };
        let units = plan
            .into_iter()
            .map(|plan| UnitState {
                master: plan.params.iter().map(|p| vec![0.0; p.chunk_len()]).collect(),
                grad: plan.params.iter().map(|p| vec![0.0; trained_len(p)]).collect(),
                adam: plan.params.iter().map(|p| AdamWState::new(trained_len(p))).collect(),
                plan,
                gathered: None,
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

    /// Refreshes the host copy of the state from the device (before checkpointing or
    /// inspecting it); nothing to do when the state lives in host memory. The device copy
    /// stays the one training uses.
    pub fn sync_host(&mut self) -> Result<()> {
        if !self.host_stale {
            return Ok(());
        }
        for unit in &mut self.units {
            let Some(dev) = &unit.dev else { continue };
            for i in 0..unit.plan.params.len() {
                unit.master[i] = dev.master[i].to_vec1::<f32>()?;
                if let (Some(g), Some(m), Some(v)) = (&dev.grad[i], &dev.exp_avg[i], &dev.exp_avg_sq[i]) {
                    unit.grad[i] = g.to_vec1::<f32>()?;
                    unit.adam[i].exp_avg = m.to_vec1::<f32>()?;
                    unit.adam[i].exp_avg_sq = v.to_vec1::<f32>()?;
                }
            }
        }
        self.host_stale = false;
        Ok(())
    }

    /// Uploads unit `u`'s host state to the device unless it is there already.
    fn ensure_device_state(&mut self, u: usize) -> Result<()> {
        if self.units[u].dev.is_some() {
            return Ok(());
        }
        let dev = &self.device;
        let unit = &self.units[u];
        let upload = |v: &[f32]| Tensor::from_slice(v, v.len(), dev);
        let mut state = DeviceState { master: vec![], grad: vec![], exp_avg: vec![], exp_avg_sq: vec![] };
        for (i, p) in unit.plan.params.iter().enumerate() {
            state.master.push(upload(&unit.master[i])?);
            let trained = |v: &[f32]| -> Result<Option<Tensor>> { Ok(if p.trainable { Some(upload(v)?) } else { None }) };
            state.grad.push(trained(&unit.grad[i])?);
            state.exp_avg.push(trained(&unit.adam[i].exp_avg)?);
            state.exp_avg_sq.push(trained(&unit.adam[i].exp_avg_sq)?);
        }
        let unit = &mut self.units[u];
        unit.dev = Some(state);
        // The device copy is the truth from now on; free the host one.
        for i in 0..unit.plan.params.len() {
            unit.master[i] = Vec::new();
            unit.grad[i] = Vec::new();
            unit.adam[i] = AdamWState::new(0);
        }
        self.host_stale = true;
        Ok(())
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

    /// Bytes this rank's buffers hold now for parameters, gradients and optimizer state, counted
    /// from the buffers themselves (device tensors where the state was uploaded, else the host
    /// vectors), not from the plan: a test of "1/N per rank" must see what is allocated.
    pub fn memory_bytes(&self) -> StateBytes {
        let vecs = |v: &[Vec<f32>]| v.iter().map(|x| x.len() * 4).sum::<usize>();
        let tensors = |v: &mut dyn Iterator<Item = &Tensor>| v.map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum::<usize>();
        let mut b = StateBytes::default();
        for u in &self.units {
            match &u.dev {
                Some(d) => {
                    b.params += tensors(&mut d.master.iter());
                    b.grads += tensors(&mut d.grad.iter().flatten());
                    b.optimizer += tensors(&mut d.exp_avg.iter().chain(&d.exp_avg_sq).flatten());
                }
                None => {
                    b.params += vecs(&u.master);
                    b.grads += vecs(&u.grad);
                    b.optimizer += u.adam.iter().map(|a| (a.exp_avg.len() + a.exp_avg_sq.len()) * 4).sum::<usize>();
                }
            }
        }
        b
    }

    /// Fills unit `u` from rank 0: rank 0 passes every parameter's full values (`Some`), the
    /// others `None`; each rank receives only its chunks (one scatter per unit).
    pub fn load_unit(&mut self, u: usize, full: Option<HashMap<String, Vec<f32>>>) -> Result<()> {
        self.load_unit_part(u, StatePart::Master, full)
    }

    /// Like `load_unit`, for one part of the state (weights, or an AdamW moment of the
    /// trainable parameters).
    pub fn load_unit_part(&mut self, u: usize, part: StatePart, full: Option<HashMap<String, Vec<f32>>>) -> Result<()> {
        let world = &self.groups.world;
        let shard_size = self.groups.shard.world_size();
        let plan = &self.units[u].plan;
        // Moments exist for the trainable parameters only, laid out like their gradients.
        let moments = part != StatePart::Master;
        let buf_len = if moments { plan.grad_chunk_len } else { plan.chunk_len };
        let in_part = |p: &&super::plan::ParamLayout| !moments || p.trainable;
        if buf_len == 0 {
            return Ok(());
        }
        let chunks = match full {
            Some(values) => {
                for p in plan.params.iter().filter(in_part) {
                    let v = values.get(&p.spec.name).with_context(|| format!("missing tensor {}", p.spec.name))?;
                    if v.len() != p.numel() {
                        bail!("tensor {} has {} values, expected {}", p.spec.name, v.len(), p.numel());
                    }
                }
                // World rank r gets shard r % shard_size (replicas share chunks). Built straight
                // from the full values: about one unit of extra memory on rank 0.
                let chunk_for = |k: usize| -> Vec<f32> {
                    let mut buf = Vec::with_capacity(buf_len);
                    for p in plan.params.iter().filter(in_part) {
                        buf.extend(p.chunk_of(&values[&p.spec.name], k));
                    }
                    buf
                };
                Some((0..world.world_size()).map(|r| chunk_for(r % shard_size)).collect())
            }
            None => None,
        };
        let mine = world.scatter(0, chunks)?;
        if self.units[u].dev.is_some() {
            // Loading into a unit that trains from device state: bring the rest of its state
            // back to the host first, then the host copy becomes the truth again.
            self.sync_host()?;
        }
        let unit = &mut self.units[u];
        for (i, p) in unit.plan.params.iter().enumerate() {
            if moments && !p.trainable {
                continue;
            }
            let dst = match part {
                StatePart::Master => &mut unit.master[i],
                StatePart::ExpAvg => &mut unit.adam[i].exp_avg,
                StatePart::ExpAvgSq => &mut unit.adam[i].exp_avg_sq,
            };
            let at = if moments { p.grad_offset } else { p.offset };
            dst.copy_from_slice(&mine[at..at + p.chunk_len()]);
        }
        // The host copy is the truth now; the device copy is rebuilt from it when next used.
        unit.dev = None;
        Ok(())
    }

    /// This rank's chunk of every parameter: (layout, weights, exp_avg, exp_avg_sq), in unit
    /// order; the moments are empty for frozen parameters. What a sharded checkpoint stores.
    /// With device state, `sync_host` must have run since the last step.
    pub fn shard_state(&self) -> Vec<ParamShard<'_>> {
        assert!(!self.host_stale, "shard_state: the host copy is stale; call sync_host first");
        self.units
            .iter()
            .flat_map(|u| {
                u.plan.params.iter().enumerate().map(move |(i, p)| ParamShard {
                    layout: p,
                    weights: u.master[i].as_slice(),
                    exp_avg: u.adam[i].exp_avg.as_slice(),
                    exp_avg_sq: u.adam[i].exp_avg_sq.as_slice(),
                })
            })
            .collect()
    }

    /// All-gathers unit `u` (one collective) into full f32 parameters, built over their own
    /// buffers (no extra copy); the trainable ones are `Var`s.
    fn gather(&self, u: usize, purpose: GatherFor) -> Result<HashMap<String, Tensor>> {
        // Device state, once uploaded, is the truth; before that the host copy is.
        if self.units[u].dev.is_some() {
            return self.gather_on_device(u, purpose);
        }
        let unit = &self.units[u];
        let mut buf: Vec<f32> = Vec::with_capacity(unit.plan.chunk_len);
        for m in &unit.master {
            buf.extend_from_slice(m);
        }
        if purpose == GatherFor::Compute {
            round_through(&mut buf, self.opts.param_dtype);
        }
        let all = self.groups.shard.all_gather(&buf)?;
        drop(buf);
        let shards = self.groups.shard.world_size();
        let mut out = HashMap::new();
        for p in &unit.plan.params {
            let mut full = Vec::with_capacity(p.chunk_len() * shards);
            for k in 0..shards {
                let base = k * unit.plan.chunk_len + p.offset;
                full.extend_from_slice(&all[base..base + p.chunk_len()]);
            }
            full.truncate(p.numel());
            let shape = p.spec.shape.as_slice();
            let dtype = if purpose == GatherFor::Compute { self.compute_dtype() } else { DType::F32 };
            let t = match (p.trainable, dtype) {
                // Straight from the buffer (no copy) in the common f32 case.
                (true, DType::F32) => Var::from_vec(full, shape, &self.device)?.as_tensor().clone(),
                (true, dt) => Var::from_tensor(&Tensor::from_vec(full, shape, &self.device)?.to_dtype(dt)?)?.as_tensor().clone(),
                (false, dt) => Tensor::from_vec(full, shape, &self.device)?.to_dtype(dt)?,
            };
            out.insert(p.spec.name.clone(), t);
        }
        Ok(out)
    }

    /// `gather` from device state: one all-gather of the unit's chunks on the device, the full
    /// parameters cut out of its result there. For compute the chunks are cast to
    /// `param_dtype` before the all-gather, as FSDP2 does: the same values as casting after it
    /// (the cast is elementwise), with half the traffic and half the gathered buffer in bf16.
    fn gather_on_device(&self, u: usize, purpose: GatherFor) -> Result<HashMap<String, Tensor>> {
        let unit = &self.units[u];
        let dev = unit.dev.as_ref().expect("device state");
        let mut flat = Tensor::cat(&dev.master, 0)?;
        let round = purpose == GatherFor::Compute;
        if round && self.opts.param_dtype != DType::F32 {
            flat = flat.to_dtype(self.opts.param_dtype)?;
        }
        let shards = self.groups.shard.world_size();
        // Rank-major: row k is rank k's chunks of every parameter.
        let all = self.groups.shard.all_gather_tensor(&flat)?.reshape((shards, unit.plan.chunk_len))?;
        let dtype = if round { self.compute_dtype() } else { DType::F32 };
        let mut out = HashMap::new();
        for p in &unit.plan.params {
            let full = all.narrow(1, p.offset, p.chunk_len())?.flatten_all()?.narrow(0, 0, p.numel())?;
            let t = full.reshape(p.spec.shape.as_slice())?.to_dtype(dtype)?;
            // `Var::from_tensor` copies: the variable owns its buffer, not a view of `all`.
            let t = if p.trainable { Var::from_tensor(&t)?.as_tensor().clone() } else { t.contiguous()? };
            out.insert(p.spec.name.clone(), t);
        }
        Ok(out)
    }

    /// Full parameters of unit `u` in f32, as stored (for export). Every rank of the shard
    /// group takes part.
    pub fn full_unit(&self, u: usize) -> Result<HashMap<String, Tensor>> {
        Ok(self.gather(u, GatherFor::Export)?.into_iter().map(|(k, v)| (k, v.detach())).collect())
    }

    fn ensure_gathered(&mut self, s: usize) -> Result<()> {
        for &u in &self.stage_units[s].clone() {
            if self.units[u].gathered.is_none() {
                if self.state_on_device {
                    self.ensure_device_state(u)?;
                }
                let vars = self.gather(u, GatherFor::Compute)?;
                self.units[u].gathered = Some(vars);
            }
        }
        Ok(())
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
        let v = logits.dim(D::Minus1)?;
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
        let ctx = StageContext { packing: packing.cloned(), row_seeds: None };
        for s in 0..n {
            self.ensure_gathered(s)?;
            x = self.model.forward_stage(s, &self.stage_params(s, false), &x, &ctx)?;
            for &u in &self.stage_units[s] {
                if self.units[u].plan.last_stage == s && (self.opts.strategy.reshard_after_forward() || self.units[u].plan.is_root) {
                    self.units[u].gathered = None;
                }
            }
        }
        // Units SHARD_GRAD_OP keeps gathered for a backward that will not come.
        for u in &mut self.units {
            u.gathered = None;
        }
        Ok(Self::loss_sum(&x, labels, b, t)?.to_scalar::<f32>()? as f64)
    }

    /// Forward and backward of one micro-batch. Gradients are scaled by `1 / global_tokens`
    /// (the target-token count of the whole step, over all ranks and micro-batches) and end up
    /// reduced into the gradient chunks. `ctx` carries packing and the per-row dropout seeds.
    /// Returns this micro-batch's summed token loss.
    pub fn forward_backward(&mut self, input_ids: &Tensor, labels: &[i64], global_tokens: f64, ctx: &StageContext) -> Result<f64> {
        let (b, t) = input_ids.dims2()?;
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
            // FULL_SHARD frees a unit once its last forward stage ran. Without activation
            // checkpointing the kept graph still references the weights, so this frees the
            // buffer only when the graph goes.
            if ac && self.opts.strategy.reshard_after_forward() {
                for &u in &self.stage_units[s] {
                    if !self.units[u].plan.is_root && self.units[u].plan.last_stage == s {
                        self.units[u].gathered = None;
                    }
                }
            }
        }

        let mut upstream: Option<Tensor> = None;
        let mut loss_sum = 0.0;
        for s in (0..n).rev() {
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
            // A first stage with nothing to train (a frozen embedding) needs no backward.
            if s == 0 && !params.values().any(|t| t.is_variable()) {
                saved[s] = None;
                self.finish_units_starting_at(s)?;
                continue;
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
                (out * g)?.sum_all()?
            };
            let grads = objective.backward()?;
            for (name, param) in &params {
                if !param.is_variable() {
                    continue;
                }
                let Some(g) = grads.get(param) else { continue };
                let u = *self.stage_units[s]
                    .iter()
                    .find(|&&u| self.units[u].plan.params.iter().any(|p| &p.spec.name == name))
                    .expect("parameter has a unit");
                if self.state_on_device {
                    // Summed on the device (a tied weight gets two contributions).
                    let g = g.to_dtype(DType::F32)?.flatten_all()?;
                    let slot = self.units[u].dev_full_grads.entry(name.clone());
                    match slot {
                        std::collections::hash_map::Entry::Occupied(mut e) => {
                            let sum = (e.get() + &g)?;
                            e.insert(sum);
                        }
                        std::collections::hash_map::Entry::Vacant(e) => {
                            e.insert(g);
                        }
                    }
                    continue;
                }
                let shards = self.groups.shard.world_size();
                let unit = &mut self.units[u];
                let p = unit.plan.params.iter().find(|p| &p.spec.name == name).unwrap();
                let packed = unit.full_grad.get_or_insert_with(|| vec![0.0; unit.plan.grad_chunk_len * shards]);
                with_f32_slice(g, |g| {
                    // Rank k's rows of this parameter go to rank k's segment of the packed buffer.
                    for k in 0..shards {
                        let lo = (k * p.chunk_len()).min(g.len());
                        let hi = ((k + 1) * p.chunk_len()).min(g.len());
                        let dst = &mut packed[k * unit.plan.grad_chunk_len + p.grad_offset..][..hi - lo];
                        for (a, b) in dst.iter_mut().zip(&g[lo..hi]) {
                            *a += *b;
                        }
                    }
                })?;
            }
            upstream = match &input_var {
                Some(v) => Some(grads.get(v.as_tensor()).cloned().context("no gradient reached a stage input")?),
                None => None,
            };
            self.finish_units_starting_at(s)?;
        }
        Ok(loss_sum)
    }

    /// After stage `s`'s backward, a unit whose first stage is `s` has all its gradients:
    /// reduce-scatter them and free its gathered weights.
    fn finish_units_starting_at(&mut self, s: usize) -> Result<()> {
        for &u in &self.stage_units[s].clone() {
            if self.units[u].plan.first_stage == s {
                self.reduce_scatter_unit(u)?;
                self.units[u].gathered = None;
            }
        }
        Ok(())
    }

    fn reduce_scatter_unit(&mut self, u: usize) -> Result<()> {
        if self.state_on_device {
            return self.reduce_scatter_unit_on_device(u);
        }
        let unit = &mut self.units[u];
        let Some(mut buf) = unit.full_grad.take() else { return Ok(()) };
        round_through(&mut buf, self.opts.reduce_dtype);
        let mine = self.groups.shard.reduce_scatter(&buf)?;
        drop(buf);
        for (i, p) in unit.plan.params.iter().enumerate() {
            if !p.trainable {
                continue;
            }
            for (a, b) in unit.grad[i].iter_mut().zip(&mine[p.grad_offset..p.grad_offset + p.chunk_len()]) {
                *a += *b;
            }
        }
        Ok(())
    }

    /// `reduce_scatter_unit` with device state: the unit's full gradients packed rank-major on
    /// the device (zero rows for padding and for parameters that got no gradient), one
    /// reduce-scatter, this rank's chunks added to the gradient chunks.
    fn reduce_scatter_unit_on_device(&mut self, u: usize) -> Result<()> {
        let shards = self.groups.shard.world_size();
        let unit = &mut self.units[u];
        if unit.dev_full_grads.is_empty() {
            return Ok(());
        }
        let mut columns = vec![];
        for p in unit.plan.params.iter().filter(|p| p.trainable) {
            let padded = shards * p.chunk_len();
            let col = match unit.dev_full_grads.remove(&p.spec.name) {
                Some(g) if padded > p.numel() => Tensor::cat(&[g, Tensor::zeros(padded - p.numel(), DType::F32, &self.device)?], 0)?,
                Some(g) => g,
                None => Tensor::zeros(padded, DType::F32, &self.device)?,
            };
            columns.push(col.reshape((shards, p.chunk_len()))?);
        }
        unit.dev_full_grads.clear();
        let mut packed = Tensor::cat(&columns, 1)?.flatten_all()?;
        drop(columns);
        if self.opts.reduce_dtype != DType::F32 {
            packed = packed.to_dtype(self.opts.reduce_dtype)?.to_dtype(DType::F32)?;
        }
        let mine = self.groups.shard.reduce_scatter_tensor(&packed)?;
        drop(packed);
        let dev = unit.dev.as_mut().expect("device state of a gathered unit");
        for (i, p) in unit.plan.params.iter().enumerate() {
            if let Some(g) = &mut dev.grad[i] {
                *g = (&*g + mine.narrow(0, p.grad_offset, p.chunk_len())?)?;
            }
        }
        self.host_stale = true;
        Ok(())
    }

    /// `optimizer_step` with device state: the same arithmetic as `adamw_step`, as tensor
    /// operations on the device.
    fn optimizer_step_on_device(&mut self, lr: f64, max_grad_norm: Option<f64>) -> Result<StepStats> {
        for u in 0..self.units.len() {
            self.ensure_device_state(u)?;
        }
        if self.groups.replicate.world_size() > 1 {
            for unit in &mut self.units {
                let dev = unit.dev.as_mut().expect("device state");
                let grads: Vec<Tensor> = dev.grad.iter().flatten().cloned().collect();
                if grads.is_empty() {
                    continue;
                }
                let summed = self.groups.replicate.all_reduce_tensor(&Tensor::cat(&grads, 0)?)?;
                let mut off = 0;
                for g in dev.grad.iter_mut().flatten() {
                    let n = g.dim(0)?;
                    *g = summed.narrow(0, off, n)?.contiguous()?;
                    off += n;
                }
            }
        }
        let mut local_sq = 0f64;
        for unit in &self.units {
            for g in unit.dev.as_ref().expect("device state").grad.iter().flatten() {
                local_sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
            }
        }
        let grad_norm = crate::dist::all_reduce_scalar(self.groups.shard.as_ref(), local_sq)?.sqrt();
        let coef = match max_grad_norm {
            Some(max) => clip_coefficient(grad_norm, max),
            None => 1.0,
        };
        self.step += 1;
        for unit in &mut self.units {
            let dev = unit.dev.as_mut().expect("device state");
            for (i, p) in unit.plan.params.iter().enumerate() {
                let (Some(g), Some(m), Some(v)) = (&mut dev.grad[i], &mut dev.exp_avg[i], &mut dev.exp_avg_sq[i]) else { continue };
                let grad = if coef < 1.0 { g.affine(coef as f32 as f64, 0.0)? } else { g.clone() };
                let wd = if self.decay[&p.spec.name] { self.adam.weight_decay } else { 0.0 };
                let mut moments = AdamWTensors { exp_avg: m.clone(), exp_avg_sq: v.clone() };
                dev.master[i] = adamw_step_tensors(&self.adam, lr, wd, self.step, &dev.master[i], &grad, &mut moments)?;
                (*m, *v) = (moments.exp_avg, moments.exp_avg_sq);
                *g = g.zeros_like()?;
            }
        }
        self.host_stale = true;
        Ok(StepStats { grad_norm, lr })
    }

    /// Ends a step: gradients summed over replicas, global-norm clipping (`max_grad_norm` None
    /// = off), AdamW with learning rate `lr`, gradients zeroed. The norm is before clipping.
    pub fn optimizer_step(&mut self, lr: f64, max_grad_norm: Option<f64>) -> Result<StepStats> {
        if self.state_on_device {
            return self.optimizer_step_on_device(lr, max_grad_norm);
        }
        if self.groups.replicate.world_size() > 1 {
            for unit in &mut self.units {
                let mut buf: Vec<f32> = unit.grad.iter().flatten().copied().collect();
                self.groups.replicate.all_reduce(&mut buf)?;
                let mut off = 0;
                for g in &mut unit.grad {
                    let n = g.len();
                    g.copy_from_slice(&buf[off..off + n]);
                    off += n;
                }
            }
        }
        let local_sq: f64 = self.units.iter().flat_map(|u| u.grad.iter().flatten()).map(|&g| (g as f64) * (g as f64)).sum();
        let grad_norm = crate::dist::all_reduce_scalar(self.groups.shard.as_ref(), local_sq)?.sqrt();
        if let Some(max) = max_grad_norm {
            let coef = clip_coefficient(grad_norm, max) as f32;
            if coef < 1.0 {
                self.units.iter_mut().flat_map(|u| u.grad.iter_mut().flatten()).for_each(|g| *g *= coef);
            }
        }
        self.step += 1;
        for unit in &mut self.units {
            for (i, p) in unit.plan.params.iter().enumerate() {
                if !p.trainable {
                    continue;
                }
                let wd = if self.decay[&p.spec.name] { self.adam.weight_decay } else { 0.0 };
                adamw_step(&self.adam, lr, wd, self.step, &mut unit.master[i], &unit.grad[i], &mut unit.adam[i]);
                unit.grad[i].iter_mut().for_each(|g| *g = 0.0);
            }
        }
        Ok(StepStats { grad_norm, lr })
    }

    /// This rank's current gradient chunks by parameter name (for tests and inspection).
    pub fn grad_chunks(&mut self) -> HashMap<String, Vec<f32>> {
        self.sync_host().expect("copying the state from the device");
        self.units
            .iter()
            .flat_map(|u| u.plan.params.iter().zip(&u.grad).filter(|(p, _)| p.trainable).map(|(p, g)| (p.spec.name.clone(), g.clone())))
            .collect()
    }
}
