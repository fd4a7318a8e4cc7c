//! One unit's share of the training state on this rank: fp32 master chunks, reduced gradient
//! chunks and AdamW moments, and what a step does with them (all-gather, gradient collection,
//! reduce-scatter, AdamW). Two implementations, picked once per engine:
//! - `HostShards` (host.rs): host vectors (CPU runs, and `--cpu-offload` on a
//!   GPU, as FSDP2's `CPUOffloadPolicy`); collectives take slices, AdamW is a vectorised loop;
//! - `DeviceShards` (device.rs): tensors on the compute device (GPU runs);
//!   collectives take tensors, AdamW is tensor operations, a step moves only collectives' data.
//!
//! Both compute the same numbers; a test runs both on the CPU. The engine drives either through
//! [`UnitShards`] and never asks which it has.

use candle_core::{DType, Device, Tensor};

use super::{FsdpOptions, GatherFor, StateBytes, StatePart};
use crate::dist::{Collective, Pending, PendingTensor};
use crate::fsdp::optim::{AdamWConfig, AdamWState};
use crate::fsdp::plan::UnitPlan;
pub(super) use ops::weight_grads::WeightGrad;

/// What a unit's storage needs to know to act: its plan, its shard group, the run's options.
pub(super) struct UnitCtx<'a> {
    pub plan: &'a UnitPlan,
    pub shard: &'a dyn Collective,
    pub opts: &'a FsdpOptions,
    pub device: &'a Device,
    /// dtype the units compute in (`param_dtype` on a GPU, f32 on the CPU).
    pub compute_dtype: DType,
}

impl UnitCtx<'_> {
    pub fn shards(&self) -> usize {
        self.shard.world_size()
    }
}

/// One optimizer step's settings, per unit.
pub(super) struct AdamWStep<'a> {
    pub cfg: &'a AdamWConfig,
    pub lr: f64,
    /// Counting from 1.
    pub step: u64,
    /// Weight decay of each parameter of the unit, in plan order.
    pub weight_decay: Vec<f64>,
    /// Gradient-clipping coefficient (None: no clipping this step).
    pub clip: Option<f32>,
}

pub(super) trait UnitShards: Send {
    /// All-gathers the unit: its full parameters in plan order, for compute (rounded to
    /// `param_dtype`, in the compute dtype, trainable ones as `Var`s) or as stored (export).
    fn gather(&self, cx: &UnitCtx, purpose: GatherFor) -> anyhow::Result<Vec<Tensor>>;

    /// Starts the unit's all-gather for compute, where this storage can leave it running
    /// while other work is issued (see `FsdpOptions::prefetch`); None where it cannot.
    fn start_gather(&self, cx: &UnitCtx) -> anyhow::Result<Option<StartedGather>>;

    /// What [`UnitShards::gather`] for compute returns, from a gather `start_gather` started.
    fn finish_gather(&self, cx: &UnitCtx, started: StartedGather) -> anyhow::Result<Vec<Tensor>>;

    /// The full parameters for compute as f32 vectors, in plan order: what a freed unit is
    /// refilled with (see `reshard`).
    fn gather_values(&self, cx: &UnitCtx) -> anyhow::Result<Vec<Vec<f32>>>;

    /// Takes parameter `i`'s gradient from a stage's backward (`None`: this backward gave it
    /// none), whole or made by rows. Every rank calls it for the same parameters in the same
    /// order, since some storage reduce-scatters here.
    fn add_grad(&mut self, cx: &UnitCtx, i: usize, grad: Option<WeightGrad>) -> anyhow::Result<()>;

    /// After the unit's backward: starts the reduce-scatter of what `add_grad` collected;
    /// [`UnitShards::finish_reduce`] adds this rank's chunks to the gradient chunks (at once,
    /// or a unit later with `FsdpOptions::prefetch`).
    fn reduce_scatter(&mut self, cx: &UnitCtx) -> anyhow::Result<()>;

    /// Finishes the reduce-scatter `reduce_scatter` started, if any.
    fn finish_reduce(&mut self, cx: &UnitCtx) -> anyhow::Result<()>;

    /// Sums the gradient chunks over the replicas (NO_SHARD, HYBRID_SHARD).
    fn all_reduce_grads(&mut self, replicate: &dyn Collective) -> anyhow::Result<()>;

    /// Sum of squares of this rank's gradient chunks (for the global norm).
    fn grad_sq_sum(&self) -> anyhow::Result<f64>;

    /// Drops the gradients of a step that will not finish (collected and reduced alike), as if
    /// it had not started.
    fn discard_grads(&mut self) -> anyhow::Result<()>;

    /// AdamW on every trainable chunk, then the gradients zeroed.
    fn adamw(&mut self, cx: &UnitCtx, step: &AdamWStep) -> anyhow::Result<()>;

    /// Bytes held for parameters, gradients and optimizer state, counted from the buffers.
    fn bytes(&self) -> StateBytes;

    /// Replaces one part of the state with this rank's `chunks` (laid out as the plan's per-rank
    /// buffer of that part: `offset` for weights, `grad_offset` for moments).
    fn load_part(&mut self, cx: &UnitCtx, part: StatePart, chunks: &[f32]) -> anyhow::Result<()>;

    /// The state as host vectors: a copy of host storage's, or a fresh download from the device.
    fn to_host(&self, cx: &UnitCtx) -> anyhow::Result<HostState>;

    /// The host storage's own vectors, if this is host storage.
    fn as_host(&self) -> Option<&HostState>;

    /// Moves the full parameters for compute out of the storage, in plan order, without a
    /// copy, where they are its master chunks as they stand (see `HostShards`'s): the engine's
    /// gathered tensors then hold the only copy until [`UnitShards::give_back`]. None where a
    /// gather must make them.
    fn lend(&mut self, _cx: &UnitCtx) -> Option<Vec<Vec<f32>>> {
        None
    }

    /// Takes back, in plan order, what [`UnitShards::lend`] moved out.
    fn give_back(&mut self, _values: Vec<Vec<f32>>) -> anyhow::Result<()> {
        anyhow::bail!("this storage lends nothing")
    }

    /// Whether the master chunks are lent out now (between `lend` and `give_back`).
    fn is_lent(&self) -> bool {
        false
    }
}

/// A unit's all-gather that `start_gather` started: its collectives in flight, read back by the
/// storage that started them.
pub(super) enum StartedGather {
    /// The unit's chunks gathered as one tensor (device storage).
    Tensor(PendingTensor),
    /// The packed chunks' gather (when any parameter is packed), then one gather for each
    /// parameter that travels alone, in plan order (host storage).
    Host(Vec<Pending<Vec<f32>>>),
}

/// A unit's state as host vectors: what host storage computes on, what a checkpoint stores, and
/// what moves between host and device.
#[derive(Clone)]
pub(super) struct HostState {
    /// This rank's fp32 chunk of each parameter (padded rows included).
    pub master: Vec<Vec<f32>>,
    /// Accumulated, already reduced gradient chunks (empty for frozen parameters).
    pub grad: Vec<Vec<f32>>,
    /// AdamW moments (empty for frozen parameters).
    pub adam: Vec<AdamWState>,
}

/// Runs `f` on a contiguous f32 CPU tensor's values without copying them (copying otherwise).
pub(super) fn with_f32_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> anyhow::Result<R> {
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
pub(super) fn round_through(v: &mut [f32], dtype: DType) {
    use kernels::round_through::{round_through, Half};
    match dtype {
        DType::BF16 => round_through(v, Half::Bf16),
        DType::F16 => round_through(v, Half::F16),
        _ => {}
    }
}
