//! The engine's state on this rank: loading it unit by unit from rank 0, where it lives (host
//! vectors or device tensors) and what it weighs, and the view a checkpoint stores.

use super::*;

impl FsdpEngine {
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
    pub(super) fn ensure_device_state(&mut self, u: usize) -> Result<()> {
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
        let in_part = |p: &&crate::fsdp::plan::ParamLayout| !moments || p.trainable;
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

    /// This rank's current gradient chunks by parameter name (for tests and inspection).
    pub fn grad_chunks(&mut self) -> HashMap<String, Vec<f32>> {
        self.sync_host().expect("copying the state from the device");
        self.units
            .iter()
            .flat_map(|u| u.plan.params.iter().zip(&u.grad).filter(|(p, _)| p.trainable).map(|(p, g)| (p.spec.name.clone(), g.clone())))
            .collect()
    }
}
