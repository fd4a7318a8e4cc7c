//! Cross-entropy of rows of logits against targets, as one op with its backward (f32 on the
//! CPU; f32 and bf16 on a GPU, `fused_cuda`'s kernels, in f32 inside as transformers upcasts the
//! logits): the forward needs each row's max and log-sum-exp, the backward recomputes softmax
//! row by row, so neither keeps (rows, vocab) log-probabilities, and on a GPU no f32 copy of the
//! logits exists.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use kernels::exp::{exp_inplace, exp_shifted_sum, max_of};
use kernels::pool::pool_new;

use crate::f32_slice;

/// Whether [`cross_entropy_rows`] takes these logits: f32 on the CPU; f32 or bf16 on a GPU.
pub fn applies(logits: &Tensor) -> bool {
    crate::applies(logits) || crate::fused_cuda_takes(logits)
}

/// Per-row `-log softmax(logits)[target]` of (rows, vocab) logits, 0 for rows whose target is
/// negative (ignored). Neither pass keeps the (rows, vocab) log-probabilities: the forward
/// needs each row's max and log-sum-exp, the backward recomputes softmax row by row.
pub fn cross_entropy_rows(logits: &Tensor, targets: &[i64]) -> Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    if targets.len() != rows {
        candle_core::bail!("cross_entropy_rows: {} targets for {rows} rows", targets.len());
    }
    if let Some(t) = targets.iter().find(|&&t| t >= vocab as i64) {
        candle_core::bail!("label {t} is outside the vocabulary ({vocab})");
    }
    logits.contiguous()?.apply_op1(CrossEntropy { targets: targets.to_vec() })
}

struct CrossEntropy {
    targets: Vec<i64>,
}

/// The log-sum-exp of a row (`scratch`: a buffer of the row's length).
fn row_lse(row: &[f32], scratch: &mut [f32]) -> f32 {
    let max = max_of(row);
    scratch.copy_from_slice(row);
    max + exp_shifted_sum(scratch, max).ln()
}

impl CustomOp1 for CrossEntropy {
    fn name(&self) -> &'static str {
        "fused-cross-entropy"
    }

    /// On a GPU: our kernel (`fused_cuda`), f32 and bf16 logits, losses in f32.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::fused_cuda::cross_entropy_forward([(s, l)], &self.targets)?, Shape::from(self.targets.len())))
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s, l)?;
        let rows = self.targets.len();
        let vocab = x.len() / rows.max(1);
        // Pieces of rows sharing one scratch row.
        const ROWS: usize = 8;
        let loss = pool_new(rows, ROWS, |c, ls| {
            let mut scratch = vec![0f32; vocab];
            for (i, l) in ls.iter_mut().enumerate() {
                let r = c * ROWS + i;
                let (row, t) = (&x[r * vocab..(r + 1) * vocab], self.targets[r]);
                *l = if t < 0 { 0.0 } else { row_lse(row, &mut scratch) - row[t as usize] };
            }
        });
        Ok((CpuStorage::F32(loss), Shape::from(rows)))
    }

    /// d logits[r, j] = g[r] * (softmax(logits[r])_j - [j == target_r]); 0 for ignored rows.
    /// Each row's log-sum-exp comes back from its loss (loss + logits[target]).
    fn bwd(&self, logits: &Tensor, loss: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let g_and_loss = Tensor::stack(&[&g.contiguous()?, loss], 0)?;
        Ok(Some(logits.apply_op2_no_bwd(&g_and_loss, &CrossEntropyBackward { targets: self.targets.clone() })?))
    }
}

struct CrossEntropyBackward {
    targets: Vec<i64>,
}

impl CustomOp2 for CrossEntropyBackward {
    fn name(&self) -> &'static str {
        "fused-cross-entropy-backward"
    }

    /// On a GPU: our kernel (`fused_cuda`), d logits in the logits' dtype.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::fused_cuda::cross_entropy_backward([(s, l), (gs, gl)], &self.targets)?, l.shape().clone()))
    }

    /// `gl` holds (2, rows): the upstream gradient, then the forward's losses.
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout, gs: &CpuStorage, gl: &Layout) -> Result<(CpuStorage, Shape)> {
        let rows = self.targets.len();
        let (x, gl_) = (f32_slice(s, l)?, f32_slice(gs, gl)?);
        let (g, loss) = gl_.split_at(rows);
        let vocab = x.len() / rows.max(1);
        // Ignored rows keep their zeros.
        let dx = pool_new(x.len(), vocab, |r, dr| {
            let row = &x[r * vocab..(r + 1) * vocab];
            let t = self.targets[r];
            if t < 0 {
                return;
            }
            let lse = loss[r] + row[t as usize];
            dr.iter_mut().zip(row).for_each(|(d, v)| *d = v - lse);
            exp_inplace(dr);
            dr.iter_mut().for_each(|d| *d *= g[r]);
            dr[t as usize] -= g[r];
        });
        Ok((CpuStorage::F32(dx), l.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check_fd, grads, max_rel, rand};
    use candle_core::{Device, Var, D};

    #[test]
    fn cross_entropy_matches_log_softmax_and_finite_differences() {
        let logits = rand(&[6, 50], 7, 5.0);
        let targets = [3i64, -100, 49, 0, 17, -100];
        let probe = rand(&[6], 8, 1.0);
        let composite = |t: &[Tensor]| -> Result<Tensor> {
            let lp = candle_nn::ops::log_softmax(&t[0], D::Minus1)?;
            let idx = Tensor::from_vec(targets.iter().map(|&t| t.max(0) as u32).collect::<Vec<_>>(), (6, 1), &Device::Cpu)?;
            let mask = Tensor::from_vec(targets.iter().map(|&t| if t < 0 { 0.0 } else { 1.0 }).collect::<Vec<f32>>(), 6, &Device::Cpu)?
                .to_dtype(t[0].dtype())?;
            lp.gather(&idx, 1)?.squeeze(1)?.neg()? * mask
        };
        let got = cross_entropy_rows(&logits, &targets).unwrap();
        assert!(max_rel(&got, &composite(std::slice::from_ref(&logits)).unwrap()) < 1e-5);
        let var = [Var::from_tensor(&logits).unwrap()];
        let fused = grads(&var, &probe, &|t| cross_entropy_rows(&t[0], &targets));
        let reference = grads(&var, &probe, &composite);
        assert!(max_rel(&fused[0], &reference[0]) < 1e-4);
        check_fd(&[logits], 0, &probe, &fused[0], &composite);
        assert!(cross_entropy_rows(&rand(&[2, 4], 9, 1.0), &[4, 0]).is_err());
    }
}
