//! A unit's state as tensors on the compute device, one per parameter chunk (padded rows
//! included): what GPUs train from, so that a step moves only collectives' data (see `shards`).

use candle_core::{DType, Tensor, Var};

use super::shards::{AdamWStep, HostState, StartedGather, UnitCtx, UnitShards, WeightGrad};
use super::{GatherFor, StateBytes, StatePart};
use crate::dist::{Collective, PendingTensor};
use crate::fsdp::optim::{adamw_step_tensors, AdamWState, AdamWTensors};

pub(super) struct DeviceShards {
    master: Vec<Tensor>,
    /// Reduced gradient, exp_avg and exp_avg_sq of each trainable chunk (`None` when frozen).
    grad: Vec<Option<Tensor>>,
    exp_avg: Vec<Option<Tensor>>,
    exp_avg_sq: Vec<Option<Tensor>>,
    /// Full-size f32 gradients collected during backward, until reduce-scatter (summed when a
    /// tied weight gets two contributions).
    full_grads: Vec<Option<Tensor>>,
    /// A reduce-scatter of this unit's gradients still running (see `FsdpOptions::prefetch`).
    reducing: Option<PendingTensor>,
}

impl DeviceShards {
    /// State on `cx.device`: host state uploaded, or with `None` zeros made there (no host
    /// values to move).
    pub fn new(host: Option<&HostState>, cx: &UnitCtx) -> anyhow::Result<Self> {
        // Part `part` of parameter `i`'s state, from `host` when given: 0 its master chunk,
        // 1 its gradient, 2 and 3 its moments.
        let chunk = |i: usize, part: usize, n: usize| match host {
            Some(h) => {
                let v = [&h.master[i], &h.grad[i], &h.adam[i].exp_avg, &h.adam[i].exp_avg_sq][part];
                Tensor::from_slice(v, v.len(), cx.device)
            }
            None => Tensor::zeros(n, DType::F32, cx.device),
        };
        let mut s = Self { master: vec![], grad: vec![], exp_avg: vec![], exp_avg_sq: vec![], full_grads: vec![], reducing: None };
        for (i, p) in cx.plan.params.iter().enumerate() {
            s.master.push(chunk(i, 0, p.chunk_len())?);
            let trained = |part| p.trainable.then(|| chunk(i, part, p.chunk_len())).transpose();
            s.grad.push(trained(1)?);
            s.exp_avg.push(trained(2)?);
            s.exp_avg_sq.push(trained(3)?);
            s.full_grads.push(None);
        }
        Ok(s)
    }
}

impl DeviceShards {
    /// The unit's chunks in one flat buffer, for the all-gather. For compute they are cast to
    /// `param_dtype` before it, as FSDP2 does: the same values as casting after it (the cast is
    /// elementwise), with half the traffic and half the gathered buffer in bf16.
    fn packed_chunks(&self, cx: &UnitCtx, purpose: GatherFor) -> candle_core::Result<Tensor> {
        match purpose == GatherFor::Compute && cx.opts.param_dtype != DType::F32 {
            // Each chunk cast, then the halves packed: one pass over the f32 chunks, not two.
            true => Tensor::cat(&self.master.iter().map(|m| m.to_dtype(cx.opts.param_dtype)).collect::<candle_core::Result<Vec<_>>>()?, 0),
            false => Tensor::cat(&self.master, 0),
        }
    }
}

/// The full parameters cut out of a unit's all-gathered chunks (rank-major: row k is rank k's
/// chunks of every parameter), in plan order, for compute (the compute dtype, trainable ones
/// as `Var`s) or as stored.
fn unpack(cx: &UnitCtx, all: Tensor, purpose: GatherFor) -> anyhow::Result<Vec<Tensor>> {
    let all = all.reshape((cx.shards(), cx.plan.chunk_len))?;
    let dtype = if purpose == GatherFor::Compute { cx.compute_dtype } else { DType::F32 };
    let mut out = Vec::with_capacity(cx.plan.params.len());
    for p in &cx.plan.params {
        let full = all.narrow(1, p.offset, p.chunk_len())?.flatten_all()?.narrow(0, 0, p.numel())?;
        let t = full.reshape(p.spec.shape.as_slice())?.to_dtype(dtype)?;
        // `Var::from_tensor` copies: the variable owns its buffer, not a view of `all`.
        out.push(if p.trainable { Var::from_tensor(&t)?.as_tensor().clone() } else { t.contiguous()? });
    }
    Ok(out)
}

impl UnitShards for DeviceShards {
    /// One all-gather of the unit's chunks on the device, the full parameters cut out of its
    /// result there (`unpack`).
    fn gather(&self, cx: &UnitCtx, purpose: GatherFor) -> anyhow::Result<Vec<Tensor>> {
        let all = cx.shard.all_gather_tensor(&self.packed_chunks(cx, purpose)?)?;
        unpack(cx, all, purpose)
    }

    fn start_gather(&self, cx: &UnitCtx) -> anyhow::Result<Option<StartedGather>> {
        Ok(Some(StartedGather::Tensor(cx.shard.start_all_gather_tensor(&self.packed_chunks(cx, GatherFor::Compute)?)?)))
    }

    fn finish_gather(&self, cx: &UnitCtx, started: StartedGather) -> anyhow::Result<Vec<Tensor>> {
        let StartedGather::Tensor(all) = started else { anyhow::bail!("device storage finishing a gather host storage started") };
        unpack(cx, all.wait()?, GatherFor::Compute)
    }

    fn gather_values(&self, cx: &UnitCtx) -> anyhow::Result<Vec<Vec<f32>>> {
        self.gather(cx, GatherFor::Compute)?.iter().map(|t| Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)).collect()
    }

    fn add_grad(&mut self, cx: &UnitCtx, i: usize, grad: Option<WeightGrad>) -> anyhow::Result<()> {
        let Some(g) = grad else { return Ok(()) };
        let g = g.into_tensor(cx.device)?.to_device(cx.device)?.to_dtype(DType::F32)?.flatten_all()?;
        self.full_grads[i] = Some(match self.full_grads[i].take() {
            Some(prev) => (prev + g)?,
            None => g,
        });
        Ok(())
    }

    /// The unit's full gradients packed rank-major on the device (zero rows for padding and
    /// for parameters that got no gradient), one reduce-scatter, this rank's chunks added to
    /// the gradient chunks.
    fn reduce_scatter(&mut self, cx: &UnitCtx) -> anyhow::Result<()> {
        if self.full_grads.iter().all(Option::is_none) {
            return Ok(());
        }
        let shards = cx.shards();
        let mut columns = vec![];
        for (i, p) in cx.plan.params.iter().enumerate() {
            if !p.trainable {
                continue;
            }
            let padded = shards * p.chunk_len();
            let col = match self.full_grads[i].take() {
                Some(g) if padded > p.numel() => Tensor::cat(&[g, Tensor::zeros(padded - p.numel(), DType::F32, cx.device)?], 0)?,
                Some(g) => g,
                None => Tensor::zeros(padded, DType::F32, cx.device)?,
            };
            columns.push(col.reshape((shards, p.chunk_len()))?);
        }
        let mut packed = Tensor::cat(&columns, 1)?.flatten_all()?;
        drop(columns);
        if cx.opts.reduce_dtype != DType::F32 {
            packed = packed.to_dtype(cx.opts.reduce_dtype)?.to_dtype(DType::F32)?;
        }
        self.reducing = Some(cx.shard.start_reduce_scatter_tensor(&packed)?);
        Ok(())
    }

    fn finish_reduce(&mut self, cx: &UnitCtx) -> anyhow::Result<()> {
        let Some(started) = self.reducing.take() else { return Ok(()) };
        let mine = started.wait()?;
        for (i, p) in cx.plan.params.iter().enumerate() {
            if let Some(g) = &mut self.grad[i] {
                *g = (&*g + mine.narrow(0, p.grad_offset, p.chunk_len())?)?;
            }
        }
        Ok(())
    }

    fn all_reduce_grads(&mut self, replicate: &dyn Collective) -> anyhow::Result<()> {
        let grads: Vec<Tensor> = self.grad.iter().flatten().cloned().collect();
        if grads.is_empty() {
            return Ok(());
        }
        let summed = replicate.all_reduce_tensor(&Tensor::cat(&grads, 0)?)?;
        let mut off = 0;
        for g in self.grad.iter_mut().flatten() {
            let n = g.dim(0)?;
            *g = summed.narrow(0, off, n)?.contiguous()?;
            off += n;
        }
        Ok(())
    }

    /// Σ g² over the unit's gradient chunks, each chunk's sum in f32 and their total in f64
    /// like the host path, read back once per unit.
    fn grad_sq_sum(&self) -> anyhow::Result<f64> {
        let sums = self.grad.iter().flatten().map(sq_sum).collect::<candle_core::Result<Vec<_>>>()?;
        if sums.is_empty() {
            return Ok(0.0);
        }
        Ok(Tensor::stack(&sums, 0)?.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?)
    }

    fn discard_grads(&mut self) -> anyhow::Result<()> {
        for g in self.grad.iter_mut().flatten() {
            *g = g.zeros_like()?;
        }
        self.full_grads.iter_mut().for_each(|g| *g = None);
        self.reducing = None;
        Ok(())
    }

    /// The same arithmetic as the host loop, as tensor operations on the device.
    fn adamw(&mut self, cx: &UnitCtx, step: &AdamWStep) -> anyhow::Result<()> {
        for i in 0..cx.plan.params.len() {
            let (Some(g), Some(m), Some(v)) = (&mut self.grad[i], &mut self.exp_avg[i], &mut self.exp_avg_sq[i]) else { continue };
            // On a GPU, one kernel (the moments are this chunk's own: updated in place).
            #[cfg(feature = "cuda")]
            if g.device().is_cuda() {
                let (lr, wd) = (step.lr, step.weight_decay[i]);
                self.master[i] = crate::fsdp::adamw_cuda::adamw_step(step.cfg, lr, wd, step.step, step.clip, &self.master[i], g, m, v)?;
                *g = g.zeros_like()?;
                continue;
            }
            let grad = match step.clip {
                Some(c) => g.affine(c as f64, 0.0)?,
                None => g.clone(),
            };
            let mut moments = AdamWTensors { exp_avg: m.clone(), exp_avg_sq: v.clone() };
            self.master[i] = adamw_step_tensors(step.cfg, step.lr, step.weight_decay[i], step.step, &self.master[i], &grad, &mut moments)?;
            (*m, *v) = (moments.exp_avg, moments.exp_avg_sq);
            *g = g.zeros_like()?;
        }
        Ok(())
    }

    fn bytes(&self) -> StateBytes {
        let sum = |v: &mut dyn Iterator<Item = &Tensor>| v.map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum::<usize>();
        StateBytes {
            params: sum(&mut self.master.iter()),
            grads: sum(&mut self.grad.iter().flatten()),
            optimizer: sum(&mut self.exp_avg.iter().chain(&self.exp_avg_sq).flatten()),
        }
    }

    fn load_part(&mut self, cx: &UnitCtx, part: StatePart, chunks: &[f32]) -> anyhow::Result<()> {
        let moments = part != StatePart::Master;
        for (i, p) in cx.plan.params.iter().enumerate() {
            if moments && !p.trainable {
                continue;
            }
            let at = if moments { p.grad_offset } else { p.offset };
            let t = Tensor::from_slice(&chunks[at..at + p.chunk_len()], p.chunk_len(), cx.device)?;
            match part {
                StatePart::Master => self.master[i] = t,
                StatePart::ExpAvg => self.exp_avg[i] = Some(t),
                StatePart::ExpAvgSq => self.exp_avg_sq[i] = Some(t),
            }
        }
        Ok(())
    }

    fn to_host(&self, cx: &UnitCtx) -> anyhow::Result<HostState> {
        let host = |t: &Option<Tensor>| -> anyhow::Result<Vec<f32>> {
            Ok(match t {
                Some(t) => t.to_vec1::<f32>()?,
                None => vec![],
            })
        };
        let mut master = vec![];
        let mut grad = vec![];
        let mut adam = vec![];
        for i in 0..cx.plan.params.len() {
            master.push(self.master[i].to_vec1::<f32>()?);
            grad.push(host(&self.grad[i])?);
            adam.push(AdamWState { exp_avg: host(&self.exp_avg[i])?, exp_avg_sq: host(&self.exp_avg_sq[i])? });
        }
        Ok(HostState { master, grad, adam })
    }

    fn as_host(&self) -> Option<&HostState> {
        None
    }
}

/// Values per row when [`sq_sum`] sums a chunk by rows.
const SUM_ROW: usize = 1024;

/// Σ g² of a chunk as a scalar tensor on its device. candle sums a whole tensor in one block of
/// GPU threads, a large share of the GPU bench's kernel time (docs/gpu.md); summed by rows of
/// [`SUM_ROW`] first, the work spreads over many blocks.
fn sq_sum(g: &Tensor) -> candle_core::Result<Tensor> {
    let sq = g.flatten_all()?.sqr()?;
    let n = sq.elem_count();
    let full = n / SUM_ROW * SUM_ROW;
    let rows = match full {
        0 => Tensor::zeros((), DType::F32, sq.device())?,
        _ => sq.narrow(0, 0, full)?.reshape((full / SUM_ROW, SUM_ROW))?.sum(1)?.sum_all()?,
    };
    match full < n {
        true => rows + sq.narrow(0, full, n - full)?.sum_all()?,
        false => Ok(rows),
    }
}
