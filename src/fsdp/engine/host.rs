//! A unit's state in host vectors (see `shards`).
//!
//! A unit's parameters normally share one collective: their chunks are packed rank-major into
//! one buffer (all-gather) and their full gradients likewise (reduce-scatter). For a parameter
//! as large as a vocabulary-sized embedding or head that packing is a second full copy at the
//! worst moment, so such a parameter is all-gathered straight into its own full buffer and its
//! gradient reduce-scattered straight from the gradient tensor, in its own collective. Every
//! rank takes the same decisions in the same (plan) order, so collectives stay matched.

use anyhow::Context;
use candle_core::{DType, Tensor, Var};

use super::shards::{round_through, with_f32_slice, AdamWStep, HostState, StartedGather, UnitCtx, UnitShards, WeightGrad};
use super::{GatherFor, StateBytes, StatePart};
use crate::dist::{Collective, Pending};
use crate::fsdp::optim::{adamw_step, AdamWState};
use crate::fsdp::plan::{ParamLayout, UnitPlan};
use kernels::adamw::sum_of_squares;

/// Parameters with at least this many values (16 MiB in f32) travel alone.
const LARGE_PARAM: usize = 1 << 22;

pub(crate) struct HostShards {
    /// Master chunks, reduced gradient chunks and AdamW moments.
    pub state: HostState,
    /// Full-size gradients of the packed trainable parameters collected during backward, until
    /// reduce-scatter, in the rank-major layout reduce-scatter takes.
    packed_grad: Option<Vec<f32>>,
    /// While the master chunks are lent to the engine's gathered tensors (see `lend`): their
    /// lengths, the vectors in `state.master` being empty meanwhile.
    lent: Option<Vec<usize>>,
    /// A reduce-scatter of the packed gradients still running (see `FsdpOptions::prefetch`).
    reducing: Option<Pending<Vec<f32>>>,
}

impl HostShards {
    /// Zero state for `plan`.
    pub fn zeros(plan: &UnitPlan) -> Self {
        let trained = |p: &ParamLayout| if p.trainable { p.chunk_len() } else { 0 };
        Self {
            state: HostState {
                master: plan.params.iter().map(|p| vec![0.0; p.chunk_len()]).collect(),
                grad: plan.params.iter().map(|p| vec![0.0; trained(p)]).collect(),
                adam: plan.params.iter().map(|p| AdamWState::new(trained(p))).collect(),
            },
            packed_grad: None,
            lent: None,
            reducing: None,
        }
    }

    /// State from its parts (the device storage's copy back).
    pub fn from_state(state: HostState) -> Self {
        Self { state, packed_grad: None, lent: None, reducing: None }
    }

    /// The state itself, which must not be lent out (its master vectors are empty then).
    fn own_state(&self) -> &HostState {
        assert!(self.lent.is_none(), "a unit's master chunks were read while lent to its gathered tensors");
        &self.state
    }
}

/// Most values in one round of a gradient reduce-scattered by rows (8 MiB of f32).
const ROUND_VALUES: usize = 1 << 21;

impl HostShards {
    /// Reduce-scatters parameter `i`'s gradient made by rows, in rounds: round `j` holds, for
    /// every rank, the `j`-th slice of that rank's rows, so that no full-size copy of the
    /// gradient exists (a (vocab, hidden) head or embedding gradient is the largest buffer of a
    /// step otherwise). Every rank runs the same rounds.
    fn add_grad_by_rows(&mut self, cx: &UnitCtx, i: usize, g: &WeightGrad) -> anyhow::Result<()> {
        let p = &cx.plan.params[i];
        let (rows, cols) = g.dims()?;
        anyhow::ensure!(rows * cols == p.numel(), "{}: a gradient of {rows} x {cols} for {} values", p.spec.name, p.numel());
        let shards = cx.shards();
        if shards == 1 {
            return Ok(g.add_rows(0, &mut self.state.grad[i])?);
        }
        let mine = rows / shards;
        let per_round = (ROUND_VALUES / (cols * shards)).clamp(1, mine.max(1));
        for first in (0..mine).step_by(per_round) {
            let n = per_round.min(mine - first);
            let mut round = vec![0f32; shards * n * cols];
            for (k, slice) in round.chunks_mut(n * cols).enumerate() {
                g.add_rows(k * mine + first, slice)?;
            }
            let part = cx.shard.reduce_scatter(&round)?;
            add_into(&mut self.state.grad[i][first * cols..(first + n) * cols], &part);
        }
        Ok(())
    }
}

/// Whether `p` is gathered and reduce-scattered in its own collective: f32 gradients, and rows
/// that divide evenly over the shards, so that the gradient tensor is already rank-major. With
/// one shard every parameter does: its gradient is then added straight into its chunk, not into
/// a zeroed packed buffer first and out of it again (two passes over every gradient a step).
fn travels_alone(cx: &UnitCtx, p: &ParamLayout) -> bool {
    cx.opts.reduce_dtype == DType::F32 && travels_alone_shape(p.numel(), p.rows, cx.shards())
}

/// Whether a parameter of `numel` values in `rows` rows, sharded over `shards` ranks, travels
/// alone with f32 gradients (`estimate` asks too).
pub fn travels_alone_shape(numel: usize, rows: usize, shards: usize) -> bool {
    shards == 1 || (numel >= LARGE_PARAM && rows.is_multiple_of(shards))
}

/// Offsets of the packed parameters in a rank's segment of the packed buffer (`None` for those
/// that travel alone, and with `grads` for frozen ones), and the segment's length.
fn packed_layout(cx: &UnitCtx, grads: bool) -> (Vec<Option<usize>>, usize) {
    let mut len = 0;
    let offsets = cx
        .plan
        .params
        .iter()
        .map(|p| {
            if travels_alone(cx, p) || (grads && !p.trainable) {
                return None;
            }
            len += p.chunk_len();
            Some(len - p.chunk_len())
        })
        .collect();
    (offsets, len)
}

use kernels::pool::pool_add_into as add_into;

impl UnitShards for HostShards {
    fn gather(&self, cx: &UnitCtx, purpose: GatherFor) -> anyhow::Result<Vec<Tensor>> {
        let dtype = if purpose == GatherFor::Compute { cx.compute_dtype } else { DType::F32 };
        let values = self.gather_for(cx, purpose)?;
        cx.plan.params.iter().zip(values).map(|(p, full)| Ok(compute_tensor(p, full, dtype, cx.device)?)).collect()
    }

    fn gather_values(&self, cx: &UnitCtx) -> anyhow::Result<Vec<Vec<f32>>> {
        self.gather_for(cx, GatherFor::Compute)
    }

    /// Where the shard group runs collectives beside compute (otherwise a gather is started
    /// and finished at once anyway, and one shard lends or copies its chunks).
    fn start_gather(&self, cx: &UnitCtx) -> anyhow::Result<Option<StartedGather>> {
        if cx.shards() == 1 || !cx.shard.overlaps_compute() {
            return Ok(None);
        }
        Ok(Some(self.start_collectives(cx, GatherFor::Compute)?))
    }

    fn finish_gather(&self, cx: &UnitCtx, started: StartedGather) -> anyhow::Result<Vec<Tensor>> {
        let values = cut(cx, started)?;
        cx.plan.params.iter().zip(values).map(|(p, full)| Ok(compute_tensor(p, full, cx.compute_dtype, cx.device)?)).collect()
    }

    fn add_grad(&mut self, cx: &UnitCtx, i: usize, grad: Option<WeightGrad>) -> anyhow::Result<()> {
        let p = &cx.plan.params[i];
        let shards = cx.shards();
        if travels_alone(cx, p) {
            match grad.as_ref().map(|g| (g, g.as_dense())) {
                // One shard: the gradient is this rank's chunk.
                Some((_, Some(g))) if shards == 1 => with_f32_slice(g, |g| add_into(&mut self.state.grad[i], g))?,
                Some((_, Some(g))) => {
                    let chunk = with_f32_slice(g, |g| cx.shard.reduce_scatter(g))??;
                    add_into(&mut self.state.grad[i], &chunk);
                }
                Some((g, None)) => self.add_grad_by_rows(cx, i, g)?,
                // Every rank makes the collective, with zeros where no gradient came.
                None if shards > 1 => {
                    let chunk = cx.shard.reduce_scatter(&vec![0.0; p.chunk_len() * shards])?;
                    add_into(&mut self.state.grad[i], &chunk);
                }
                None => {}
            }
            return Ok(());
        }
        let Some(g) = grad else { return Ok(()) };
        let (offsets, seg) = packed_layout(cx, true);
        let at = offsets[i].expect("a trainable packed parameter has an offset");
        let chunk = p.chunk_len();
        let packed = self.packed_grad.get_or_insert_with(|| vec![0.0; seg * shards]);
        // A gradient made by rows whose chunks are whole rows: each rank's rows are made
        // straight into its segment, with no full-size gradient in between.
        if let (None, Ok((rows, cols))) = (g.as_dense(), g.dims()) {
            if chunk.is_multiple_of(cols) {
                let rows_per_rank = chunk / cols;
                for k in 0..shards {
                    let first = k * rows_per_rank;
                    // The last ranks' chunks may be padding past the parameter's rows.
                    let n = rows_per_rank.min(rows.saturating_sub(first));
                    if n > 0 {
                        g.add_rows(first, &mut packed[k * seg + at..][..n * cols])?;
                    }
                }
                return Ok(());
            }
        }
        let g = g.into_tensor(&candle_core::Device::Cpu)?;
        with_f32_slice(&g, |g| {
            // Rank k's rows of this parameter go to rank k's segment of the packed buffer.
            for k in 0..shards {
                let lo = (k * chunk).min(g.len());
                let hi = ((k + 1) * chunk).min(g.len());
                add_into(&mut packed[k * seg + at..][..hi - lo], &g[lo..hi]);
            }
        })
    }

    fn reduce_scatter(&mut self, cx: &UnitCtx) -> anyhow::Result<()> {
        let Some(mut buf) = self.packed_grad.take() else { return Ok(()) };
        round_through(&mut buf, cx.opts.reduce_dtype);
        self.reducing = Some(if cx.shards() == 1 { Pending::ready(buf) } else { cx.shard.start_reduce_scatter_owned(buf)? });
        Ok(())
    }

    fn finish_reduce(&mut self, cx: &UnitCtx) -> anyhow::Result<()> {
        let Some(started) = self.reducing.take() else { return Ok(()) };
        let mine = started.wait()?;
        let (offsets, _) = packed_layout(cx, true);
        for (i, p) in cx.plan.params.iter().enumerate() {
            if let Some(at) = offsets[i] {
                add_into(&mut self.state.grad[i], &mine[at..at + p.chunk_len()]);
            }
        }
        Ok(())
    }

    fn all_reduce_grads(&mut self, replicate: &dyn Collective) -> anyhow::Result<()> {
        let mut buf: Vec<f32> = self.state.grad.iter().flatten().copied().collect();
        if buf.is_empty() {
            return Ok(());
        }
        replicate.all_reduce(&mut buf)?;
        let mut off = 0;
        for g in &mut self.state.grad {
            let n = g.len();
            g.copy_from_slice(&buf[off..off + n]);
            off += n;
        }
        Ok(())
    }

    fn grad_sq_sum(&self) -> anyhow::Result<f64> {
        Ok(self.state.grad.iter().map(|g| sum_of_squares(g)).sum())
    }

    fn discard_grads(&mut self) -> anyhow::Result<()> {
        self.state.grad.iter_mut().for_each(|g| g.fill(0.0));
        self.packed_grad = None;
        self.reducing = None;
        Ok(())
    }

    fn adamw(&mut self, cx: &UnitCtx, step: &AdamWStep) -> anyhow::Result<()> {
        anyhow::ensure!(self.lent.is_none(), "AdamW on a unit whose master chunks are lent to its gathered tensors");
        for (i, p) in cx.plan.params.iter().enumerate() {
            if !p.trainable {
                continue;
            }
            adamw_step(
                step.cfg,
                step.lr,
                step.weight_decay[i],
                step.step,
                &mut self.state.master[i],
                &mut self.state.grad[i],
                &mut self.state.adam[i],
                step.clip,
            );
        }
        Ok(())
    }

    fn bytes(&self) -> StateBytes {
        let vecs = |v: &[Vec<f32>]| v.iter().map(|x| x.len() * 4).sum::<usize>();
        StateBytes {
            // Lent master chunks are still this unit's bytes, held by its gathered tensors.
            params: self.lent.as_ref().map(|lens| lens.iter().sum::<usize>() * 4).unwrap_or_else(|| vecs(&self.state.master)),
            grads: vecs(&self.state.grad),
            optimizer: self.state.adam.iter().map(|a| (a.exp_avg.len() + a.exp_avg_sq.len()) * 4).sum(),
        }
    }

    fn load_part(&mut self, cx: &UnitCtx, part: StatePart, chunks: &[f32]) -> anyhow::Result<()> {
        anyhow::ensure!(self.lent.is_none(), "loading a unit whose master chunks are lent to its gathered tensors");
        let moments = part != StatePart::Master;
        for (i, p) in cx.plan.params.iter().enumerate() {
            if moments && !p.trainable {
                continue;
            }
            let dst = match part {
                StatePart::Master => &mut self.state.master[i],
                StatePart::ExpAvg => &mut self.state.adam[i].exp_avg,
                StatePart::ExpAvgSq => &mut self.state.adam[i].exp_avg_sq,
            };
            let at = if moments { p.grad_offset } else { p.offset };
            dst.copy_from_slice(&chunks[at..at + p.chunk_len()]);
        }
        Ok(())
    }

    fn to_host(&self, _: &UnitCtx) -> anyhow::Result<HostState> {
        Ok(self.own_state().clone())
    }

    fn as_host(&self) -> Option<&HostState> {
        Some(self.own_state())
    }

    /// With one shard, f32 values for compute (no `param_dtype` rounding) and the CPU, a
    /// gather's result is the master chunks themselves: they are moved into the gathered
    /// tensors and back (`reshard::take`), where a gather copied them (twice a step under
    /// FULL_SHARD: before the unit's forward and again before its backward) and held the copy
    /// beside them (docs/design.md, FSDP).
    fn lend(&mut self, cx: &UnitCtx) -> Option<Vec<Vec<f32>>> {
        let as_they_stand = cx.shards() == 1
            && cx.device.is_cpu()
            && cx.compute_dtype == DType::F32
            && cx.opts.param_dtype == DType::F32
            && cx.plan.params.iter().all(|p| p.chunk_len() == p.numel());
        if !as_they_stand || self.lent.is_some() {
            return None;
        }
        self.lent = Some(self.state.master.iter().map(Vec::len).collect());
        Some(self.state.master.iter_mut().map(std::mem::take).collect())
    }

    fn give_back(&mut self, values: Vec<Vec<f32>>) -> anyhow::Result<()> {
        let Some(lens) = self.lent.take() else { anyhow::bail!("giving back master chunks that were not lent") };
        let got: Vec<usize> = values.iter().map(Vec::len).collect();
        anyhow::ensure!(got == lens, "master chunks given back with lengths {got:?}, lent with {lens:?}");
        self.state.master = values;
        Ok(())
    }

    fn is_lent(&self) -> bool {
        self.lent.is_some()
    }
}

/// A full parameter's values as the tensor a unit computes with: in `dtype`, a `Var` when it
/// trains (so that a forward over it builds the graph backward needs).
pub(super) fn compute_tensor(p: &ParamLayout, full: Vec<f32>, dtype: DType, device: &candle_core::Device) -> candle_core::Result<Tensor> {
    let shape = p.spec.shape.as_slice();
    Ok(match (p.trainable, dtype) {
        // Straight from the buffer (no copy) in the common f32 case.
        (true, DType::F32) => Var::from_vec(full, shape, device)?.as_tensor().clone(),
        (true, dt) => Var::from_tensor(&Tensor::from_vec(full, shape, device)?.to_dtype(dt)?)?.as_tensor().clone(),
        (false, dt) => Tensor::from_vec(full, shape, device)?.to_dtype(dt)?,
    })
}

impl HostShards {
    /// All-gathers the unit's chunks (one collective for the packed parameters, one for each
    /// that travels alone) and cuts the result into the full parameters, in plan order.
    fn gather_for(&self, cx: &UnitCtx, purpose: GatherFor) -> anyhow::Result<Vec<Vec<f32>>> {
        // A shard group of one rank holds every parameter whole: one copy each, not one into
        // the packed buffer and another out of it.
        if cx.shards() == 1 {
            let own = |(m, p): (&Vec<f32>, &ParamLayout)| {
                let mut full = kernels::pool::pool_to_vec(&m[..p.numel()]);
                round_for(&mut full, cx, purpose);
                full
            };
            return Ok(self.own_state().master.iter().zip(&cx.plan.params).map(own).collect());
        }
        cut(cx, self.start_collectives(cx, purpose)?)
    }

    /// Starts the unit's all-gathers: the packed chunks' (when any parameter is packed), then
    /// each that travels alone, straight into its own buffer, in plan order.
    fn start_collectives(&self, cx: &UnitCtx, purpose: GatherFor) -> anyhow::Result<StartedGather> {
        let state = self.own_state();
        let (offsets, seg) = packed_layout(cx, false);
        let mut started = vec![];
        if seg > 0 {
            let mut buf: Vec<f32> = Vec::with_capacity(seg);
            for (m, at) in state.master.iter().zip(&offsets) {
                if at.is_some() {
                    buf.extend_from_slice(m);
                }
            }
            round_for(&mut buf, cx, purpose);
            started.push(cx.shard.start_all_gather_owned(buf)?);
        }
        for (m, at) in state.master.iter().zip(&offsets) {
            if at.is_none() {
                let mut mine = m.clone();
                round_for(&mut mine, cx, purpose);
                started.push(cx.shard.start_all_gather_owned(mine)?);
            }
        }
        Ok(StartedGather::Host(started))
    }
}

/// Rounds values gathered for compute through `param_dtype` (what they travel in).
fn round_for(v: &mut [f32], cx: &UnitCtx, purpose: GatherFor) {
    if purpose == GatherFor::Compute {
        round_through(v, cx.opts.param_dtype);
    }
}

/// The full parameters, in plan order, out of the gathers [`HostShards::start_collectives`]
/// started: rank k's chunk of a packed parameter sits in rank k's segment of the packed
/// result; one that travels alone is its own result (rank-major chunks of whole rows are the
/// rows).
fn cut(cx: &UnitCtx, started: StartedGather) -> anyhow::Result<Vec<Vec<f32>>> {
    let StartedGather::Host(started) = started else { anyhow::bail!("host storage finishing a gather device storage started") };
    let (offsets, seg) = packed_layout(cx, false);
    let mut started = started.into_iter();
    let mut next = || started.next().context("fewer gathers than the unit's layout")?.wait();
    let all = if seg > 0 { next()? } else { vec![] };
    let mut out = Vec::with_capacity(cx.plan.params.len());
    for (i, p) in cx.plan.params.iter().enumerate() {
        let mut full = match offsets[i] {
            Some(at) => {
                let mut full = Vec::with_capacity(p.chunk_len() * cx.shards());
                for k in 0..cx.shards() {
                    full.extend_from_slice(&all[k * seg + at..][..p.chunk_len()]);
                }
                full
            }
            None => next()?,
        };
        full.truncate(p.numel());
        out.push(full);
    }
    Ok(out)
}
