//! The engine's state on this rank: loading it unit by unit from rank 0, what it weighs, and the
//! host view a checkpoint stores (a copy, refreshed by `sync_host`, when it lives on a device).

use super::shards::HostState;
use super::*;
use crate::fsdp::plan::ParamLayout;

/// Values rank 0 reads and scatters to each rank at a time while streaming a unit (4 MiB of
/// f32): small enough that rank 0's peak stays that of the other ranks (the issue: it held a
/// whole unit, the 128 MiB embedding of a 220M Llama), large enough that the scatters' latency
/// does not show in the load time.
const STREAM_PIECE: usize = 1 << 20;

impl FsdpEngine {
    /// Refreshes the host copy of device-resident state (before checkpointing or inspecting
    /// it); nothing to do when the state lives in host memory. The device copy stays the one
    /// training uses.
    pub fn sync_host(&mut self) -> Result<()> {
        if !self.host_stale {
            return Ok(());
        }
        for u in 0..self.units.len() {
            if self.units[u].shards.as_host().is_some() {
                continue;
            }
            let unit = &self.units[u];
            let copy = unit.shards.to_host(&unit_ctx(&unit.plan, &self.groups, &self.opts, &self.device))?;
            self.units[u].host_copy = Some(copy);
        }
        self.host_stale = false;
        Ok(())
    }

    /// Bytes this rank's buffers hold now for parameters, gradients and optimizer state, counted
    /// from the buffers themselves (device tensors or host vectors), not from the plan: a test
    /// of "1/N per rank" must see what is allocated.
    pub fn memory_bytes(&self) -> StateBytes {
        let mut b = StateBytes::default();
        for u in &self.units {
            let x = u.shards.bytes();
            b.params += x.params;
            b.grads += x.grads;
            b.optimizer += x.optimizer;
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
        self.load_unit_part_from(u, part, full.as_ref().map(|m| m as &dyn ParamSource))
    }

    /// Like `load_unit_part`, rank 0 reading the values from `source` a piece of rows at a time
    /// and scattering each piece before reading the next: beyond its own shard it holds one
    /// piece per rank ([`STREAM_PIECE`] values each), never a whole unit or parameter.
    pub fn load_unit_part_from(&mut self, u: usize, part: StatePart, source: Option<&dyn ParamSource>) -> Result<()> {
        self.fresh = false;
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
        let mut mine = Vec::with_capacity(buf_len);
        // Every rank walks the same (parameter, row piece) sequence from the plan, so the
        // scatters pair up without any other coordination.
        for p in plan.params.iter().filter(in_part) {
            let piece_rows = (STREAM_PIECE / p.row_len.max(1)).max(1);
            let mut at = 0;
            while at < p.chunk_rows {
                let n = piece_rows.min(p.chunk_rows - at);
                // World rank r gets shard r % shard_size (replicas share chunks): its rows of
                // the parameter, zero rows for padding.
                let pieces = match source {
                    Some(source) => Some(
                        (0..world.world_size())
                            .map(|r| {
                                let first = (r % shard_size) * p.chunk_rows + at;
                                let mut buf = Vec::with_capacity(n * p.row_len);
                                source.append_rows(p, first.min(p.rows)..(first + n).min(p.rows), &mut buf)?;
                                buf.resize(n * p.row_len, 0.0);
                                Ok(buf)
                            })
                            .collect::<Result<Vec<_>>>()?,
                    ),
                    None => None,
                };
                mine.extend(world.scatter(0, pieces)?);
                at += n;
            }
        }
        debug_assert_eq!(mine.len(), buf_len);
        let unit = &mut self.units[u];
        unit.shards.load_part(&unit_ctx(&unit.plan, &self.groups, &self.opts, &self.device), part, &mine)?;
        self.host_stale = true;
        Ok(())
    }

    /// The host view of unit `u`'s state: the storage itself, or its copy from `sync_host`.
    fn host_view(&self, u: usize) -> &HostState {
        let unit = &self.units[u];
        match unit.shards.as_host() {
            Some(h) => h,
            None => {
                assert!(!self.host_stale, "the host copy is stale; call sync_host first");
                unit.host_copy.as_ref().expect("sync_host made the host copy")
            }
        }
    }

    /// This rank's chunk of every parameter: (layout, weights, exp_avg, exp_avg_sq), in unit
    /// order; the moments are empty for frozen parameters. What a sharded checkpoint stores.
    /// With device state, `sync_host` must have run since the last change.
    pub fn shard_state(&self) -> Vec<ParamShard<'_>> {
        (0..self.units.len())
            .flat_map(|u| {
                let host = self.host_view(u);
                self.units[u].plan.params.iter().enumerate().map(move |(i, p)| ParamShard {
                    layout: p,
                    weights: host.master[i].as_slice(),
                    exp_avg: host.adam[i].exp_avg.as_slice(),
                    exp_avg_sq: host.adam[i].exp_avg_sq.as_slice(),
                })
            })
            .collect()
    }

    /// This rank's current gradient chunks by parameter name (for tests and inspection).
    pub fn grad_chunks(&mut self) -> HashMap<String, Vec<f32>> {
        self.sync_host().expect("copying the state from the device");
        (0..self.units.len())
            .flat_map(|u| {
                let host = self.host_view(u);
                self.units[u].plan.params.iter().zip(&host.grad).filter(|(p, _)| p.trainable).map(|(p, g)| (p.spec.name.clone(), g.clone()))
            })
            .collect()
    }

    /// Full parameters of unit `u` in f32, as stored (for export). Every rank of the shard
    /// group takes part.
    pub fn full_unit(&self, u: usize) -> Result<HashMap<String, Tensor>> {
        let unit = &self.units[u];
        let tensors = unit.shards.gather(&unit_ctx(&unit.plan, &self.groups, &self.opts, &self.device), GatherFor::Export)?;
        Ok(unit.plan.params.iter().zip(tensors).map(|(p, t)| (p.spec.name.clone(), t.detach())).collect())
    }
}

/// Where rank 0 reads full parameter values from when filling a unit, a range of rows at a
/// time, so that no full parameter need exist in memory (weight files read in place), or a map
/// of full values.
pub trait ParamSource {
    /// Appends rows `rows` of parameter `p` (row-major, f32) to `dst`.
    fn append_rows(&self, p: &ParamLayout, rows: std::ops::Range<usize>, dst: &mut Vec<f32>) -> Result<()>;
}

impl ParamSource for HashMap<String, Vec<f32>> {
    fn append_rows(&self, p: &ParamLayout, rows: std::ops::Range<usize>, dst: &mut Vec<f32>) -> Result<()> {
        let v = self.get(&p.spec.name).with_context(|| format!("missing tensor {}", p.spec.name))?;
        if v.len() != p.numel() {
            bail!("tensor {} has {} values, expected {}", p.spec.name, v.len(), p.numel());
        }
        dst.extend_from_slice(&v[rows.start * p.row_len..rows.end * p.row_len]);
        Ok(())
    }
}
