//! The language-model head and its cross-entropy as one op for training on CPU: per-position
//! losses of `h (rows, hidden) · Wᵀ (hidden, vocab)` against next-token targets, a chunk of rows
//! at a time, so that no (rows, vocab) logits or logit gradients ever exist. Each chunk's logits
//! live in one scratch buffer (at most [`CHUNK_VALUES`] values), become the losses and, in
//! place, d loss / d logits, which two products turn into the chunk's `dh` and its share of
//! `dW`. The gradients are made in the forward, as Liger's fused linear cross-entropy does, and
//! the backward scales them by the upstream gradient (recomputing only when that gradient is not
//! the same for every position, which the training loss never does).
//!
//! Handing dW to a trainer's sink with fewer rows than hidden units, the op keeps the
//! (rows, vocab) logit gradients instead of the (vocab, hidden) dW, smaller then, and the
//! trainer makes dW from them a range of vocabulary rows at a time (`crate::weight_grads`).

use std::sync::{Arc, Mutex};

use crate::f32_slice;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Storage, Tensor};
use kernels::pool::pool_chunks_mut2;

use crate::weight_grads::{GradRows, WeightGradTarget};
use kernels::exp::{exp_shifted_sum, max_of};
use kernels::matmul::parallel::{product, product_add};

/// Most logits alive at once (32 MiB of f32).
const CHUNK_VALUES: usize = 8 << 20;

/// Per-position `-log softmax(h Wᵀ)[target]` for `h` (rows, hidden) and `w` (vocab, hidden),
/// 0 where the target is negative (ignored): a (rows,) tensor. f32 on the CPU.
/// With `grad_to`, the head's gradient goes there instead of to candle's gradient store (see
/// `crate::weight_grads`).
pub fn head_cross_entropy(h: &Tensor, w: &Tensor, targets: &[i64], grad_to: Option<WeightGradTarget>) -> Result<Tensor> {
    head_cross_entropy_in_chunks(h, w, targets, CHUNK_VALUES, grad_to)
}

/// [`head_cross_entropy`] with at most `chunk_values` logits alive at once.
fn head_cross_entropy_in_chunks(
    h: &Tensor,
    w: &Tensor,
    targets: &[i64],
    chunk_values: usize,
    grad_to: Option<WeightGradTarget>,
) -> Result<Tensor> {
    let (rows, hidden) = h.dims2()?;
    let (vocab, w_hidden) = w.dims2()?;
    if w_hidden != hidden || targets.len() != rows {
        candle_core::bail!("head_cross_entropy: h {:?}, head {:?}, {} targets", h.dims(), w.dims(), targets.len());
    }
    if let Some(t) = targets.iter().find(|&&t| t >= vocab as i64) {
        candle_core::bail!("label {t} is outside the vocabulary ({vocab})");
    }
    let op = HeadCrossEntropy {
        targets: targets.to_vec(),
        chunk_values,
        // Gradients only where a backward can come (not in activation checkpointing's first,
        // graph-less forward, nor in evaluation).
        want_dh: h.track_op(),
        want_dw: w.track_op(),
        saved: Mutex::new(None),
        grad_to,
    };
    h.contiguous()?.apply_op2(&w.contiguous()?, op)
}

struct HeadCrossEntropy {
    targets: Vec<i64>,
    chunk_values: usize,
    want_dh: bool,
    want_dw: bool,
    /// The forward's gradients for an upstream gradient of 1 per position: (dh, dW).
    saved: Mutex<Option<(Vec<f32>, WeightGrad)>>,
    /// Where dW goes instead of candle's gradient store.
    grad_to: Option<WeightGradTarget>,
}

/// What one pass computes: per-position losses and, if asked, the gradients of
/// `Σ weight[r] · loss[r]`.
struct Pass {
    loss: Vec<f32>,
    dh: Vec<f32>,
    dw: WeightGrad,
}

/// The head's weight gradient as a pass leaves it.
enum WeightGrad {
    None,
    /// dW itself, (vocab, hidden).
    Dense(Vec<f32>),
    /// d loss / d logits, (rows, vocab): dW = dlogitsᵀ · h.
    Logits(Vec<f32>),
}

impl WeightGrad {
    fn scale(&mut self, s: f32) {
        if let WeightGrad::Dense(v) | WeightGrad::Logits(v) = self {
            v.iter_mut().for_each(|x| *x *= s);
        }
    }
}

impl HeadCrossEntropy {
    /// `weight`: the upstream gradient per position (None: 1 everywhere); `grads`: make dh
    /// (and dW if `want_dw`).
    fn run(&self, h: &[f32], w: &[f32], hidden: usize, weight: Option<&[f32]>, grads: bool) -> Pass {
        let (rows, vocab) = (h.len() / hidden, w.len() / hidden);
        // Logit gradients smaller than dW are kept for a sink to make dW from, all rows at once.
        let keep_logits = grads && self.want_dw && self.grad_to.is_some() && rows <= hidden;
        let chunk = if keep_logits { rows.max(1) } else { (self.chunk_values / vocab).clamp(1, rows.max(1)) };
        let mut loss = vec![0f32; rows];
        let mut dh = if grads { Vec::with_capacity(rows * hidden) } else { vec![] };
        let mut dw = (grads && self.want_dw && !keep_logits).then(|| vec![0f32; vocab * hidden]);
        let mut kept = None;
        for first in (0..rows).step_by(chunk) {
            let n = chunk.min(rows - first);
            let hc = &h[first * hidden..(first + n) * hidden];
            // (n, vocab) logits: hc (n, hidden) · Wᵀ, element (i, o) of Wᵀ at o * hidden + i.
            let mut logits = product(n, vocab, hidden, (hc, 1, hidden as isize), (w, hidden as isize, 1));
            let targets = &self.targets[first..first + n];
            pool_chunks_mut2((&mut logits, vocab), (&mut loss[first..first + n], 1), |r, row, l| {
                let l = &mut l[0];
                let t = targets[r];
                if t < 0 {
                    *l = 0.0;
                    row.fill(0.0);
                    return;
                }
                let max = max_of(row);
                let z_target = row[t as usize] - max;
                let sum = exp_shifted_sum(row, max);
                *l = sum.ln() - z_target;
                if grads {
                    // d loss / d logits = softmax - onehot(target), times the upstream weight.
                    let scale = weight.map_or(1.0, |wt| wt[first + r]);
                    let inv = scale / sum;
                    row.iter_mut().for_each(|x| *x *= inv);
                    row[t as usize] -= scale;
                }
            });
            if !grads {
                continue;
            }
            // dh rows: dlogits (n, vocab) · W (vocab, hidden).
            dh.extend_from_slice(&product(n, hidden, vocab, (&logits, 1, vocab as isize), (w, 1, hidden as isize)));
            if keep_logits {
                kept = Some(logits);
                continue;
            }
            // dW += dlogitsᵀ (vocab, n) · hc (n, hidden).
            if let Some(dw) = dw.as_mut() {
                product_add(vocab, hidden, n, dw, (&logits, vocab as isize, 1), (hc, 1, hidden as isize));
            }
        }
        let dw = match (dw, kept) {
            (Some(dw), _) => WeightGrad::Dense(dw),
            (None, Some(logits)) => WeightGrad::Logits(logits),
            (None, None) => WeightGrad::None,
        };
        Pass { loss, dh, dw }
    }
}

/// dW made by rows from the logit gradients: rows `v` of dW = Σ_r dlogits[r, v] · h[r].
#[derive(Debug)]
struct HeadGradRows {
    dlogits: Vec<f32>,
    h: Vec<f32>,
    vocab: usize,
    hidden: usize,
}

impl GradRows for HeadGradRows {
    fn dims(&self) -> (usize, usize) {
        (self.vocab, self.hidden)
    }

    fn add_rows(&self, first: usize, out: &mut [f32]) {
        let (v, h) = (self.vocab, self.hidden);
        let (n, rows) = (out.len() / h, self.h.len() / h);
        // out (n, hidden) += dlogits[:, first..first + n]ᵀ (n, rows) · h (rows, hidden).
        product_add(n, h, rows, out, (&self.dlogits[first..], v as isize, 1), (&self.h, 1, h as isize));
    }
}

impl CustomOp2 for HeadCrossEntropy {
    fn name(&self) -> &'static str {
        "fused-head-cross-entropy"
    }

    fn cpu_fwd(&self, hs: &CpuStorage, hl: &Layout, ws: &CpuStorage, wl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (h, w) = (f32_slice(hs, hl)?, f32_slice(ws, wl)?);
        let hidden = hl.dims()[1];
        let grads = self.want_dh || self.want_dw;
        let pass = self.run(h, w, hidden, None, grads);
        if grads {
            *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some((pass.dh, pass.dw));
        }
        let rows = pass.loss.len();
        Ok((CpuStorage::F32(pass.loss), Shape::from(rows)))
    }

    fn bwd(&self, h: &Tensor, w: &Tensor, _loss: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g: Vec<f32> = g.flatten_all()?.to_vec1()?;
        // The training loss weighs every position alike (sum / target count): then the
        // forward's gradients, scaled, are exact. Ignored positions have zero gradient anyway.
        let counted: Vec<f32> = g.iter().zip(&self.targets).filter(|(_, &t)| t >= 0).map(|(&x, _)| x).collect();
        let uniform = counted.first().copied().filter(|s| counted.iter().all(|x| x == s));
        let saved = self.saved.lock().unwrap_or_else(|e| e.into_inner()).take();
        let (dh, dw) = match (uniform.or(counted.is_empty().then_some(0.0)), saved) {
            (Some(s), Some((mut dh, mut dw))) => {
                dh.iter_mut().for_each(|x| *x *= s);
                dw.scale(s);
                (dh, dw)
            }
            _ => {
                // Recompute with the upstream gradient as per-position weights.
                let (hg, hl) = h.storage_and_layout();
                let (wg, wl) = w.storage_and_layout();
                let (Storage::Cpu(hc), Storage::Cpu(wc)) = (&*hg, &*wg) else {
                    candle_core::bail!("head_cross_entropy: the backward runs on the CPU")
                };
                let pass = self.run(f32_slice(hc, hl)?, f32_slice(wc, wl)?, hl.dims()[1], Some(&g), true);
                (pass.dh, pass.dw)
            }
        };
        let (vocab, hidden) = w.dims2()?;
        let dw = match dw {
            WeightGrad::Logits(dlogits) => {
                let t = self.grad_to.as_ref().expect("logit gradients are kept only for a sink");
                let h = h.flatten_all()?.to_vec1::<f32>()?;
                t.sink.add_rows(&t.name, Arc::new(HeadGradRows { dlogits, h, vocab, hidden }))?;
                None
            }
            WeightGrad::Dense(dw) if self.want_dw => Some(Tensor::from_vec(dw, w.shape(), w.device())?),
            _ => None,
        };
        let dh = Tensor::from_vec(dh, h.shape(), h.device())?;
        match (dw, &self.grad_to) {
            (Some(dw), Some(t)) => {
                t.sink.add(&t.name, dw)?;
                Ok((Some(dh), None))
            }
            (dw, _) => Ok((Some(dh), dw)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check_fd, grads, max_rel, rand};
    use candle_core::Var;

    /// The head as a matmul, then log-softmax over the (rows, vocab) logits (any float dtype,
    /// so finite differences can run it in f64).
    fn composite(t: &[Tensor], targets: &[i64]) -> Result<Tensor> {
        let dev = t[0].device();
        let lp = candle_nn::ops::log_softmax(&t[0].matmul(&t[1].t()?)?, candle_core::D::Minus1)?;
        let idx = Tensor::from_vec(targets.iter().map(|&t| t.max(0) as u32).collect::<Vec<_>>(), (targets.len(), 1), dev)?;
        let mask = Tensor::from_vec(targets.iter().map(|&t| if t < 0 { 0f32 } else { 1.0 }).collect::<Vec<_>>(), targets.len(), dev)?;
        lp.gather(&idx, 1)?.squeeze(1)?.neg()? * mask.to_dtype(t[0].dtype())?
    }

    #[test]
    fn head_cross_entropy_matches_the_composite_ops_and_finite_differences() {
        let (h, w) = (rand(&[9, 16], 41, 1.0), rand(&[37, 16], 42, 0.7));
        let targets = [3i64, -100, 36, 0, 17, -100, 5, 5, 20];
        let inputs = [h.clone(), w.clone()];
        let reference = |t: &[Tensor]| composite(t, &targets);
        // One chunk of all rows, and chunks of 2 rows (dW summed over five chunks).
        for chunk in [CHUNK_VALUES, 2 * 37] {
            let fused_loss = |t: &[Tensor]| head_cross_entropy_in_chunks(&t[0], &t[1], &targets, chunk, None);
            assert!(max_rel(&fused_loss(&inputs).unwrap(), &reference(&inputs).unwrap()) < 1e-5);
            // A uniform upstream gradient (the training loss: a sum over positions, scaled)
            // takes the forward's gradients; a per-position one recomputes.
            let uniform = Tensor::full(0.25f32, 9, &candle_core::Device::Cpu).unwrap();
            for probe in [uniform, rand(&[9], 43, 1.0)] {
                let vars = inputs.each_ref().map(|t| Var::from_tensor(t).unwrap());
                let fused = grads(&vars, &probe, &fused_loss);
                let want = grads(&vars, &probe, &reference);
                for (which, (a, b)) in fused.iter().zip(&want).enumerate() {
                    assert!(max_rel(a, b) < 1e-4, "chunk {chunk}, input {which}: {}", max_rel(a, b));
                    check_fd(&inputs, which, &probe, a, &reference);
                }
            }
        }
        assert!(head_cross_entropy(&h, &w, &[37; 9], None).unwrap_err().to_string().contains("outside the vocabulary"));
    }

    /// Through a sink, with fewer rows than hidden units: the sink gets dW as rows made from the
    /// kept logit gradients (no (vocab, hidden) buffer), equal to the composite ops' dW, for a
    /// uniform and a per-position upstream gradient.
    #[test]
    fn a_sink_gets_the_head_gradient_by_rows() {
        use crate::weight_grads::WeightGrads;
        let (h, w) = (rand(&[5, 16], 51, 1.0), rand(&[37, 16], 52, 0.7));
        let targets = [3i64, -100, 36, 0, 17];
        for probe in [Tensor::full(0.5f32, 5, &candle_core::Device::Cpu).unwrap(), rand(&[5], 53, 1.0)] {
            let vars = [h.clone(), w.clone()].map(|t| Var::from_tensor(&t).unwrap());
            let want = grads(&vars, &probe, &|t: &[Tensor]| composite(t, &targets));
            let sink = WeightGrads::new();
            let target = WeightGradTarget { sink: sink.clone(), name: "lm_head.weight".into() };
            let loss = head_cross_entropy(vars[0].as_tensor(), vars[1].as_tensor(), &targets, Some(target)).unwrap();
            let g = (loss * &probe).unwrap().sum_all().unwrap().backward().unwrap();
            assert!(g.get(vars[1].as_tensor()).is_none(), "dW goes to the sink, not to candle");
            assert!(max_rel(g.get(vars[0].as_tensor()).unwrap(), &want[0]) < 1e-4);
            let dw = sink.take("lm_head.weight").unwrap();
            assert!(dw.as_dense().is_none(), "kept as logit gradients");
            assert!(max_rel(&dw.clone().into_tensor(&candle_core::Device::Cpu).unwrap(), &want[1]) < 1e-4);
            // Rows 10..20 alone.
            let mut part = vec![0f32; 10 * 16];
            dw.add_rows(10, &mut part).unwrap();
            let expected = want[1].narrow(0, 10, 10).unwrap().flatten_all().unwrap();
            assert!(max_rel(&Tensor::new(part.as_slice(), &candle_core::Device::Cpu).unwrap(), &expected) < 1e-4);
        }
    }

    #[test]
    fn a_frozen_head_gets_no_gradient() {
        let (h, w) = (rand(&[4, 8], 45, 1.0), rand(&[11, 8], 46, 1.0));
        let hv = Var::from_tensor(&h).unwrap();
        let g = head_cross_entropy(hv.as_tensor(), &w, &[1, 2, -100, 10], None).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(g.get(&w).is_none() && g.get(hv.as_tensor()).is_some());
    }
}
