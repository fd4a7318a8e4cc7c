//! A Llama attention layer's inside for training on CPU, from its normed input to what o_proj
//! takes: the q, k and v products, RoPE on q and k, and the softmax attention, as one candle op
//! on x. As five ops, candle's backward adds each gradient that reaches q, k and v (before and
//! after RoPE) to a zero tensor first (a memset on the calling thread while the pool waits,
//! then a sum), and x's three gradients, one per product, one after another. Here x's gradient
//! is one buffer (the three products added into it) and q, k, v are never graph nodes (the op
//! keeps them for its backward).
//!
//! The weights are not inputs of the op in candle's graph (a custom op takes three at most):
//! their gradients go to their sinks (`ops::weight_grads`), which is why the op is built only
//! for weights whose gradient has a sink or that train nothing. The values are those of the
//! five ops: the same products, rotation and attention kernels.

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use crate::attention::{Attention, Dims};
use crate::fused::rope_values;
use crate::linear::weight_grad;
use crate::residual_sublayer::Inside;
use crate::weight_grads::WeightGradTarget;
use crate::{cpu_f32_values, f32_slice};
use kernels::matmul::parallel::{input_grad_sum, product_wt};

/// A projection's weight (out, in) and where its gradient goes.
pub type Projection = (Tensor, Option<WeightGradTarget>);

/// `attention(rope(x W_qᵀ), rope(x W_kᵀ), x W_vᵀ)` for x (batch, seq, in): (batch, seq,
/// heads · head_dim), with `heads` (query, kv) heads, RoPE tables `cos`/`sin` (seq, head_dim / 2),
/// an additive `mask` ((seq, seq) or (batch, 1, seq, seq)) and `scale` on the scores. Each weight
/// must send its gradient to a sink or train nothing. f32 on the CPU (see [`crate::applies`]).
pub fn self_attention(
    x: &Tensor,
    projections: [Projection; 3],
    heads: (usize, usize),
    rope: (&Tensor, &Tensor),
    mask: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    x.contiguous()?.apply_op1(SelfAttention::new(x, projections, heads, rope, mask, scale)?)
}

/// [`self_attention`] outside candle's graph, kept for its backward: the inside of the
/// attention's residual sublayer (`residual_sublayer`).
pub fn self_attention_inside(
    x: &Tensor,
    projections: [Projection; 3],
    heads: (usize, usize),
    rope: (&Tensor, &Tensor),
    mask: Option<&Tensor>,
    scale: f64,
) -> Result<Inside> {
    Inside::of_op1(x, SelfAttention::new(x, projections, heads, rope, mask, scale)?)
}

struct SelfAttention {
    projections: [Projection; 3],
    rope: (Tensor, Tensor),
    attention: Attention,
    dims: Dims,
    /// The forward's q and k (rotated) and v, for the backward (which takes them: one backward
    /// per forward, as training runs it).
    saved: Mutex<Option<[Vec<f32>; 3]>>,
}

impl SelfAttention {
    fn new(
        x: &Tensor,
        [q, k, v]: [Projection; 3],
        (hq, hkv): (usize, usize),
        (cos, sin): (&Tensor, &Tensor),
        mask: Option<&Tensor>,
        scale: f64,
    ) -> Result<Self> {
        let (b, t, in_dim) = x.dims3()?;
        let (q_out, k_out) = (q.0.dim(0)?, k.0.dim(0)?);
        let d = q_out.checked_div(hq).unwrap_or(0);
        let fits = |w: &Tensor, out: usize| w.dims() == [out, in_dim];
        if hq == 0 || hkv == 0 || hq % hkv != 0 || q_out != hq * d || !fits(&q.0, q_out) || !fits(&k.0, hkv * d) || !fits(&v.0, k_out) {
            candle_core::bail!(
                "self-attention: weights {:?}, {:?}, {:?} for {hq} query and {hkv} kv heads of an input {:?}",
                q.0.dims(),
                k.0.dims(),
                v.0.dims(),
                x.dims()
            );
        }
        if let Some((w, _)) = [&q, &k, &v].into_iter().find(|(w, to)| w.track_op() && to.is_none()) {
            candle_core::bail!("self-attention: a weight {:?} that trains has no gradient sink", w.dims());
        }
        if cos.dims() != [t, d / 2] || sin.dims() != cos.dims() {
            candle_core::bail!("self-attention: RoPE tables {:?} / {:?} for {t} positions of {d} values", cos.dims(), sin.dims());
        }
        let contiguous = |(w, to): Projection| -> Result<Projection> { Ok((w.contiguous()?, to)) };
        Ok(SelfAttention {
            projections: [contiguous(q)?, contiguous(k)?, contiguous(v)?],
            rope: (cos.contiguous()?, sin.contiguous()?),
            attention: Attention::new(b, t, mask, scale)?,
            dims: Dims { b, t, hq, hkv, d },
            saved: Mutex::new(None),
        })
    }

    /// RoPE over token-major rows of `heads` heads, by the negative angles when `inverse`.
    fn rotate(&self, x: &[f32], heads: usize, inverse: bool) -> Result<Vec<f32>> {
        let (cos, sin) = (self.rope.0.storage_and_layout(), self.rope.1.storage_and_layout());
        let tables = (cpu_f32_values(&cos.0, cos.1)?, cpu_f32_values(&sin.0, sin.1)?);
        let Dims { t, d, .. } = self.dims;
        rope_values(x, tables, (t, d), |row| (row / heads) % t, inverse)
    }

    fn in_dim(&self) -> usize {
        self.projections[0].0.dims()[1]
    }
}

impl CustomOp1 for SelfAttention {
    fn name(&self) -> &'static str {
        "fused-self-attention"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(xs, xl)?;
        let Dims { b, t, hq, hkv, d } = self.dims;
        let in_dim = self.in_dim();
        let project = |(w, _): &Projection| -> Result<Vec<f32>> {
            let (ws, wl) = w.storage_and_layout();
            Ok(product_wt(x, cpu_f32_values(&ws, wl)?, w.dims()[0], in_dim))
        };
        let [pq, pk, pv] = &self.projections;
        let q = self.rotate(&project(pq)?, hq, false)?;
        let k = self.rotate(&project(pk)?, hkv, false)?;
        let v = project(pv)?;
        let out = self.attention.forward(self.dims, &q, &k, &v)?;
        *self.saved.lock().expect("the self-attention's saved projections") = Some([q, k, v]);
        Ok((CpuStorage::F32(out), Shape::from((b, t, hq * d))))
    }

    fn bwd(&self, x: &Tensor, out: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let Some([q, k, v]) = self.saved.lock().expect("the self-attention's saved projections").take() else {
            candle_core::bail!("self-attention: a second backward through the same forward")
        };
        let Dims { b, t, hq, hkv, .. } = self.dims;
        let g = g.contiguous()?;
        let (dq, dk, dv) = {
            let ((os, ol), (gs, gl)) = (out.storage_and_layout(), g.storage_and_layout());
            self.attention.backward(self.dims, &q, &k, &v, cpu_f32_values(&os, ol)?, cpu_f32_values(&gs, gl)?)?
        };
        drop((q, k, v));
        let grads = [self.rotate(&dq, hq, true)?, self.rotate(&dk, hkv, true)?, dv];
        drop((dq, dk));
        // dx = dq · W_q + dk · W_k + dv · W_v, into one buffer.
        let (rows, in_dim) = (b * t, self.in_dim());
        let dx = {
            let weights = self.projections.each_ref().map(|(w, _)| w.storage_and_layout());
            let mut terms = Vec::with_capacity(3);
            for (((storage, layout), (w, _)), gy) in weights.iter().zip(&self.projections).zip(&grads) {
                terms.push((gy.as_slice(), cpu_f32_values(storage, layout)?, w.dims()[0]));
            }
            input_grad_sum(rows, in_dim, &terms)
        };
        let dx = Tensor::from_vec(dx, x.shape(), x.device())?;
        // The weights' gradients to their sinks (`self_attention` took only weights with one
        // or that train nothing, so none comes back for candle's store).
        for ((w, to), gy) in self.projections.iter().zip(grads) {
            let gy = Tensor::from_vec(gy, (rows, w.dims()[0]), x.device())?;
            if weight_grad(x, w, gy, to.as_ref())?.is_some() {
                candle_core::bail!("self-attention: a weight gradient with nowhere to go");
            }
        }
        Ok(Some(dx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::attention;
    use crate::fused::rope_token_major;
    use crate::linear::linear_heads_to;
    use crate::testing::{grads, max_rel, rand};
    use crate::weight_grads::WeightGrads;
    use candle_core::{Device, Var};

    const HEADS: (usize, usize) = (4, 2);

    /// RoPE tables for `t` positions of head_dim 8.
    fn tables(t: usize) -> (Tensor, Tensor) {
        let angles: Vec<f32> = (0..t * 4).map(|i| (i / 4) as f32 / 10f32.powf((i % 4) as f32 / 2.0)).collect();
        let angles = Tensor::from_vec(angles, (t, 4), &Device::Cpu).unwrap();
        (angles.cos().unwrap(), angles.sin().unwrap())
    }

    /// The five ops it replaces: three products in heads, RoPE on q and k, the attention.
    fn five_ops(t: &[Tensor], rope: &(Tensor, Tensor), mask: &Tensor) -> Result<Tensor> {
        let q = rope_token_major(&linear_heads_to(&t[0], &t[1], HEADS.0, None)?, &rope.0, &rope.1)?;
        let k = rope_token_major(&linear_heads_to(&t[0], &t[2], HEADS.1, None)?, &rope.0, &rope.1)?;
        let v = linear_heads_to(&t[0], &t[3], HEADS.1, None)?;
        attention(&q, &k, &v, Some(mask), 0.3)
    }

    /// Forward bits, x's gradient and each weight's gradient (through its sink) against the
    /// five ops' under candle's backward, at 40 tokens (two blocks of query rows) with a
    /// causal mask.
    #[test]
    fn matches_the_five_ops() {
        let (b, t, hidden) = (2, 40, 24);
        let x = rand(&[b, t, hidden], 71, 1.0);
        let ws = [rand(&[32, hidden], 72, 0.4), rand(&[16, hidden], 73, 0.4), rand(&[16, hidden], 74, 0.4)];
        let rope = tables(t);
        let mask = Tensor::from_vec(
            (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect::<Vec<f32>>(),
            (t, t),
            &Device::Cpu,
        )
        .unwrap();
        let probe = rand(&[b, t, 32], 75, 1.0);
        let vars = [&x, &ws[0], &ws[1], &ws[2]].map(|t| Var::from_tensor(t).unwrap());
        let want = grads(&vars, &probe, &|t| five_ops(t, &rope, &mask));

        let sink = WeightGrads::new();
        let names = ["q", "k", "v"];
        let projections =
            [1, 2, 3].map(|i| (vars[i].as_tensor().clone(), Some(WeightGradTarget { sink: sink.clone(), name: names[i - 1].into() })));
        let out = self_attention(vars[0].as_tensor(), projections, HEADS, (&rope.0, &rope.1), Some(&mask), 0.3).unwrap();
        let plain = five_ops(&vars.each_ref().map(|v| v.as_tensor().clone()), &rope, &mask).unwrap();
        assert_eq!(max_rel(&out, &plain), 0.0, "not the five ops' values");
        let loss = (out * &probe).unwrap().sum_all().unwrap();
        let store = loss.backward().unwrap();
        assert!(max_rel(store.get(vars[0].as_tensor()).unwrap(), &want[0]) < 1e-5);
        for (i, name) in names.iter().enumerate() {
            assert!(store.get(vars[i + 1].as_tensor()).is_none(), "{name}: a gradient in candle's store");
            let got = sink.take(name).expect("deposited").into_tensor(&Device::Cpu).unwrap();
            assert!(max_rel(&got, &want[i + 1]) < 1e-5, "{name}: {}", max_rel(&got, &want[i + 1]));
        }
        assert!(loss.backward().is_err(), "the forward's projections were taken by the first backward");
    }

    /// A weight that trains with no sink would lose its gradient: refused, as are shapes that do
    /// not fit; a weight that trains nothing needs no sink.
    #[test]
    fn refuses_what_it_cannot_run() {
        let (x, rope) = (rand(&[1, 6, 24], 81, 1.0), tables(6));
        let ws = [rand(&[32, 24], 82, 0.4), rand(&[16, 24], 83, 0.4), rand(&[16, 24], 84, 0.4)];
        let frozen = ws.clone().map(|w| (w, None));
        assert!(self_attention(&x, frozen.clone(), HEADS, (&rope.0, &rope.1), None, 0.3).is_ok());
        let mut trains = frozen.clone();
        trains[1].0 = Var::from_tensor(&ws[1]).unwrap().as_tensor().clone();
        assert!(self_attention(&x, trains, HEADS, (&rope.0, &rope.1), None, 0.3).is_err(), "k trains with no sink");
        assert!(self_attention(&x, frozen.clone(), (3, 2), (&rope.0, &rope.1), None, 0.3).is_err(), "3 heads over 2 kv heads");
        let short = tables(5);
        assert!(self_attention(&x, frozen, HEADS, (&short.0, &short.1), None, 0.3).is_err(), "tables for 5 positions");
    }
}
