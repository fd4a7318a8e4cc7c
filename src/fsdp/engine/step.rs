//! The optimizer step on this rank's chunks: global gradient-norm clipping, then AdamW (a loop
//! over host vectors, or tensor operations on the device).

use super::*;

impl FsdpEngine {
    /// `optimizer_step` with device state: the same arithmetic as `adamw_step`, as tensor
    /// operations on the device.
    pub(super) fn optimizer_step_on_device(&mut self, lr: f64, max_grad_norm: Option<f64>) -> Result<StepStats> {
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
        let local_sq: f64 = self.units.iter().flat_map(|u| u.grad.iter()).map(|g| crate::fsdp::optim::sum_of_squares(g)).sum();
        let grad_norm = crate::dist::all_reduce_scalar(self.groups.shard.as_ref(), local_sq)?.sqrt();
        // Clipping scales each gradient as AdamW reads it.
        let clip = max_grad_norm.map(|max| clip_coefficient(grad_norm, max) as f32).filter(|c| *c < 1.0);
        self.step += 1;
        for unit in &mut self.units {
            for (i, p) in unit.plan.params.iter().enumerate() {
                if !p.trainable {
                    continue;
                }
                let wd = if self.decay[&p.spec.name] { self.adam.weight_decay } else { 0.0 };
                adamw_step(&self.adam, lr, wd, self.step, &mut unit.master[i], &unit.grad[i], &mut unit.adam[i], clip);
                unit.grad[i].fill(0.0);
            }
        }
        Ok(StepStats { grad_norm, lr })
    }
}
