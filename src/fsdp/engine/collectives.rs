//! The unit's collectives: all-gather of its parameter chunks before it runs (or for export),
//! reduce-scatter of its gradients once its backward is done.

use super::*;

impl FsdpEngine {
    /// All-gathers unit `u` (one collective) into full f32 parameters, built over their own
    /// buffers (no extra copy); the trainable ones are `Var`s.
    pub(super) fn gather(&self, u: usize, purpose: GatherFor) -> Result<HashMap<String, Tensor>> {
        // Device state, once uploaded, is the truth; before that the host copy is.
        if self.units[u].dev.is_some() {
            return self.gather_on_device(u, purpose);
        }
        let values = self.gather_host_values(u, purpose)?;
        let mut out = HashMap::new();
        for (p, full) in self.units[u].plan.params.iter().zip(values) {
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

    /// The full values of unit `u`'s parameters for compute, in plan order, as one f32 vector
    /// each: what a freed unit is refilled with.
    pub(super) fn gather_full_values(&self, u: usize) -> Result<Vec<Vec<f32>>> {
        if self.units[u].dev.is_none() {
            return self.gather_host_values(u, GatherFor::Compute);
        }
        let gathered = self.gather_on_device(u, GatherFor::Compute)?;
        let plan = &self.units[u].plan;
        plan.params.iter().map(|p| Ok(gathered[&p.spec.name].flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)).collect()
    }

    /// All-gathers unit `u`'s host chunks (one collective for the packed parameters, one for
    /// each that travels alone, see `grads.rs`) and cuts the result into the full parameters,
    /// in plan order.
    fn gather_host_values(&self, u: usize, purpose: GatherFor) -> Result<Vec<Vec<f32>>> {
        let unit = &self.units[u];
        let shards = self.groups.shard.world_size();
        let round = |v: &mut Vec<f32>| {
            if purpose == GatherFor::Compute {
                round_through(v, self.opts.param_dtype);
            }
        };
        let (offsets, seg) = self.packed_layout(u, false);
        let mut buf: Vec<f32> = Vec::with_capacity(seg);
        for (m, at) in unit.master.iter().zip(&offsets) {
            if at.is_some() {
                buf.extend_from_slice(m);
            }
        }
        round(&mut buf);
        // A shard group of one rank gathers its own chunk: no collective.
        let all = if shards == 1 || seg == 0 { buf } else { self.groups.shard.all_gather(&buf)? };
        let mut out = Vec::with_capacity(unit.plan.params.len());
        for (i, p) in unit.plan.params.iter().enumerate() {
            let mut full = match offsets[i] {
                Some(at) => {
                    let mut full = Vec::with_capacity(p.chunk_len() * shards);
                    for k in 0..shards {
                        full.extend_from_slice(&all[k * seg + at..][..p.chunk_len()]);
                    }
                    full
                }
                // Straight into its own buffer: rank-major chunks of whole rows are the rows.
                None => {
                    let mut mine = unit.master[i].clone();
                    round(&mut mine);
                    if shards == 1 {
                        mine
                    } else {
                        self.groups.shard.all_gather(&mine)?
                    }
                }
            };
            full.truncate(p.numel());
            out.push(full);
        }
        Ok(out)
    }

    /// `gather` from device state: one all-gather of the unit's chunks on the device, the full
    /// parameters cut out of its result there. For compute the chunks are cast to
    /// `param_dtype` before the all-gather, as FSDP2 does: the same values as casting after it
    /// (the cast is elementwise), with half the traffic and half the gathered buffer in bf16.
    pub(super) fn gather_on_device(&self, u: usize, purpose: GatherFor) -> Result<HashMap<String, Tensor>> {
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

    /// Reduce-scatters unit `u`'s packed gradients (those of the parameters that do not travel
    /// alone) and adds this rank's chunks to its gradient chunks.
    pub(super) fn reduce_scatter_unit(&mut self, u: usize) -> Result<()> {
        if self.state_on_device {
            return self.reduce_scatter_unit_on_device(u);
        }
        let (offsets, _) = self.packed_layout(u, true);
        let unit = &mut self.units[u];
        let Some(mut buf) = unit.full_grad.take() else { return Ok(()) };
        round_through(&mut buf, self.opts.reduce_dtype);
        let mine = if self.groups.shard.world_size() == 1 { buf } else { self.groups.shard.reduce_scatter(&buf)? };
        for (i, p) in unit.plan.params.iter().enumerate() {
            let Some(at) = offsets[i] else { continue };
            for (a, b) in unit.grad[i].iter_mut().zip(&mine[at..at + p.chunk_len()]) {
                *a += *b;
            }
        }
        Ok(())
    }

    /// `reduce_scatter_unit` with device state: the unit's full gradients packed rank-major on
    /// the device (zero rows for padding and for parameters that got no gradient), one
    /// reduce-scatter, this rank's chunks added to the gradient chunks.
    pub(super) fn reduce_scatter_unit_on_device(&mut self, u: usize) -> Result<()> {
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
}
