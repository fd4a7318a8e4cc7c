//! The optimizer step on this rank's chunks: gradients summed over replicas, global
//! gradient-norm clipping, then AdamW, whichever storage holds the state.

use super::shards::AdamWStep;
use super::*;

impl FsdpEngine {
    /// Ends a step: gradients summed over replicas, global-norm clipping (`max_grad_norm` None
    /// = off), AdamW with learning rate `lr`, gradients zeroed. The norm is before clipping.
    pub fn optimizer_step(&mut self, lr: f64, max_grad_norm: Option<f64>) -> Result<StepStats> {
        self.fresh = false;
        if self.groups.replicate.world_size() > 1 {
            for unit in &mut self.units {
                unit.shards.all_reduce_grads(self.groups.replicate.as_ref())?;
            }
        }
        let mut local_sq = 0.0;
        for unit in &self.units {
            local_sq += unit.shards.grad_sq_sum()?;
        }
        let grad_norm = crate::dist::all_reduce_scalar(self.groups.shard.as_ref(), local_sq)?.sqrt();
        // Clipping scales each gradient as AdamW reads it.
        let clip = max_grad_norm.map(|max| clip_coefficient(grad_norm, max) as f32).filter(|c| *c < 1.0);
        self.step += 1;
        for u in 0..self.units.len() {
            let weight_decay =
                self.units[u].plan.params.iter().map(|p| if self.decay[&p.spec.name] { self.adam.weight_decay } else { 0.0 }).collect();
            let step = AdamWStep { cfg: &self.adam, lr, step: self.step, weight_decay, clip };
            let unit = &mut self.units[u];
            unit.shards.adamw(&unit_ctx(&unit.plan, &self.groups, &self.opts, &self.device), &step)?;
        }
        self.host_stale = true;
        Ok(StepStats { grad_norm, lr })
    }
}

impl FsdpEngine {
    /// Abandons a step that failed part-way (a GPU out of memory): gathered parameters and
    /// collected or reduced gradients are dropped, so the next step starts from the state the
    /// last optimizer step left, as if this one had not begun.
    pub fn discard_step(&mut self) -> Result<()> {
        self.fresh = false;
        for u in 0..self.units.len() {
            self.drop_gathered(u)?;
            self.units[u].shards.discard_grads()?;
        }
        self.host_stale = true;
        Ok(())
    }
}
