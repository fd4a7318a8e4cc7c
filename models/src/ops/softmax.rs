//! Softmax over the last dimension for training on any device (eager attention off the CPU's
//! fused path: GPUs, and other dtypes): candle's one-pass `softmax_last_dim` kernel forward,
//! and the softmax's own backward `dx = y ⊙ (dy − Σ dy ⊙ y)`.
//!
//! candle_nn's trainable `softmax` is five ops over the whole tensor (max, sub, exp, sum, div),
//! and its backward goes through each, `max`'s included (an `eq` over the whole tensor and a
//! cast). The attention scores (batch × heads × T × T) are the largest tensors of a GPU step:
//! on an H200 at T = 2048 those passes were most of a training step's kernel time
//! (tests/gpu/run.sh profile).

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, D};

/// Softmax over the last dimension, with a backward when `x` is in a graph.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    // The fused kernel has no backward: it computes the values, and `WithGrad` puts them in the
    // graph as a function of `x`.
    let y = candle_nn::ops::softmax_last_dim(&x.contiguous()?)?;
    if !x.track_op() {
        return Ok(y);
    }
    x.apply_op2(&y, WithGrad)
}

/// `(x, y) -> y`, whose backward is the softmax's for `y = softmax(x)`.
struct WithGrad;

/// The forward hands back a copy of `y`: the op must return storage of its own. `y` is the
/// kernel's fresh output, so its layout covers its storage from the start.
fn check_whole(l: &Layout) -> Result<()> {
    if !l.is_contiguous() || l.start_offset() != 0 {
        candle_core::bail!("softmax-with-grad: the softmax values are not a whole contiguous tensor");
    }
    Ok(())
}

impl CustomOp2 for WithGrad {
    fn name(&self) -> &'static str {
        "softmax-last-dim-with-grad"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, y: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        check_whole(l)?;
        Ok((y.try_clone(l)?, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        y: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        check_whole(l)?;
        Ok((y.try_clone(l)?, l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dot = (grad * res)?.sum_keepdim(D::Minus1)?;
        Ok((Some((res * grad.broadcast_sub(&dot)?)?), None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    #[test]
    fn values_and_gradient_match_candles_composite_softmax() {
        let dev = Device::Cpu;
        let mut x = Tensor::randn(0f32, 3.0, (2, 3, 5, 7), &dev).unwrap();
        // A causal mask's -inf, as attention has.
        let mask: Vec<f32> = (0..5 * 7).map(|i| if i % 7 > i / 7 + 2 { f32::NEG_INFINITY } else { 0.0 }).collect();
        x = x.broadcast_add(&Tensor::from_vec(mask, (5, 7), &dev).unwrap()).unwrap();
        let w = Tensor::randn(0f32, 1.0, (2, 3, 5, 7), &dev).unwrap();
        let run = |f: &dyn Fn(&Tensor) -> Result<Tensor>| {
            let v = Var::from_tensor(&x).unwrap();
            let y = f(v.as_tensor()).unwrap();
            let grads = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
            (
                y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                grads.get(v.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            )
        };
        let (y, g) = run(&softmax_last_dim);
        let (y_ref, g_ref) = run(&|t| candle_nn::ops::softmax(t, D::Minus1));
        for (a, b) in y.iter().zip(&y_ref).chain(g.iter().zip(&g_ref)) {
            assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{a} vs {b}");
        }
        assert!(g.iter().any(|v| *v != 0.0));
        // Without a graph it is the kernel's output alone.
        let plain = softmax_last_dim(&x.to_dtype(DType::BF16).unwrap()).unwrap();
        assert_eq!(plain.dtype(), DType::BF16);
    }
}
