//! Where a stage's weight gradients go after its backward, and which parameters travel alone.
//!
//! A unit's parameters normally share one collective: their chunks are packed rank-major into
//! one buffer (all-gather) and their full gradients likewise (reduce-scatter). For a parameter
//! as large as a vocabulary-sized embedding or head that packing is a second full copy at the
//! worst moment, so such a parameter is all-gathered straight into its own full buffer and its
//! gradient reduce-scattered straight from the gradient tensor, in its own collective. Every
//! rank takes the same decisions in the same (plan) order, so collectives stay matched.
//!
//! A gradient comes from candle's gradient store, or from the stage's weight-gradient sink
//! where the model's op put it (`models::weight_grads`: the embedding and the fused head).

use candle_core::backprop::GradStore;
use models::weight_grads::WeightGrads;

use super::*;
use crate::fsdp::plan::ParamLayout;

/// Parameters with at least this many values (16 MiB in f32) travel alone.
const LARGE_PARAM: usize = 1 << 22;

impl FsdpEngine {
    /// Whether parameter `p` is gathered and reduce-scattered in its own collective (host
    /// state, f32 gradients, rows that divide evenly over the shards so that the gradient
    /// tensor is already in rank-major order).
    pub(super) fn travels_alone(&self, p: &ParamLayout) -> bool {
        !self.state_on_device
            && self.opts.reduce_dtype == DType::F32
            && p.numel() >= LARGE_PARAM
            && p.rows % self.groups.shard.world_size() == 0
    }

    /// Offsets of the packed parameters in a rank's segment of the packed buffer (`None` for
    /// those that travel alone, and with `grads` for frozen ones), and the segment's length.
    pub(super) fn packed_layout(&self, u: usize, grads: bool) -> (Vec<Option<usize>>, usize) {
        let mut len = 0;
        let offsets = self.units[u]
            .plan
            .params
            .iter()
            .map(|p| {
                if self.travels_alone(p) || (grads && !p.trainable) {
                    return None;
                }
                len += p.chunk_len();
                Some(len - p.chunk_len())
            })
            .collect();
        (offsets, len)
    }

    /// Takes stage `s`'s weight gradients out of `grads` (host state): a parameter that travels
    /// alone is reduce-scattered now, the others are added to their unit's packed buffer, which
    /// `reduce_scatter_unit` sends once the unit's backward is complete. Each gradient is
    /// dropped as soon as it is used.
    pub(super) fn take_stage_grads_host(&mut self, s: usize, params: &HashMap<String, Tensor>, grads: &mut GradStore, sink: &WeightGrads) -> Result<()> {
        let shards = self.groups.shard.world_size();
        for u in self.stage_units[s].clone() {
            let (offsets, seg) = self.packed_layout(u, true);
            for i in 0..self.units[u].plan.params.len() {
                let p = &self.units[u].plan.params[i];
                let Some(param) = params.get(&p.spec.name).filter(|t| t.is_variable()) else { continue };
                let g = sink.take(&p.spec.name).or_else(|| grads.remove(param));
                if self.travels_alone(p) {
                    let add = |dst: &mut Vec<f32>, src: &[f32]| dst.iter_mut().zip(src).for_each(|(a, b)| *a += *b);
                    match &g {
                        // One shard: the gradient is this rank's chunk.
                        Some(g) if shards == 1 => with_f32_slice(g, |g| add(&mut self.units[u].grad[i], g))?,
                        Some(g) => {
                            let chunk = with_f32_slice(g, |g| self.groups.shard.reduce_scatter(g))??;
                            add(&mut self.units[u].grad[i], &chunk);
                        }
                        // Every rank makes the collective, with zeros where no gradient came.
                        None if shards > 1 => {
                            let chunk = self.groups.shard.reduce_scatter(&vec![0.0; p.chunk_len() * shards])?;
                            add(&mut self.units[u].grad[i], &chunk);
                        }
                        None => {}
                    }
                    continue;
                }
                let Some(g) = g else { continue };
                let at = offsets[i].expect("a trainable packed parameter has an offset");
                let chunk = p.chunk_len();
                let unit = &mut self.units[u];
                let packed = unit.full_grad.get_or_insert_with(|| vec![0.0; seg * shards]);
                with_f32_slice(&g, |g| {
                    // Rank k's rows of this parameter go to rank k's segment of the packed buffer.
                    for k in 0..shards {
                        let lo = (k * chunk).min(g.len());
                        let hi = ((k + 1) * chunk).min(g.len());
                        for (a, b) in packed[k * seg + at..][..hi - lo].iter_mut().zip(&g[lo..hi]) {
                            *a += *b;
                        }
                    }
                })?;
            }
        }
        Ok(())
    }


    /// With device state: stage `s`'s weight gradients summed on the device by parameter (a
    /// tied weight gets two contributions) until `reduce_scatter_unit_on_device`.
    pub(super) fn take_stage_grads_device(&mut self, s: usize, params: &HashMap<String, Tensor>, grads: &mut GradStore, sink: &WeightGrads) -> Result<()> {
        for u in self.stage_units[s].clone() {
            for i in 0..self.units[u].plan.params.len() {
                let name = self.units[u].plan.params[i].spec.name.clone();
                let Some(param) = params.get(&name).filter(|t| t.is_variable()) else { continue };
                let Some(g) = sink.take(&name).or_else(|| grads.remove(param)) else { continue };
                let g = g.to_dtype(DType::F32)?.flatten_all()?;
                let sums = &mut self.units[u].dev_full_grads;
                let sum = match sums.remove(&name) {
                    Some(prev) => (prev + g)?,
                    None => g,
                };
                sums.insert(name, sum);
            }
        }
        Ok(())
    }
}
