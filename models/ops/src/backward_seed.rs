//! The root of a backward pass that starts from a known gradient: [`seed`]`(out, g)` is a scalar
//! whose backward hands `g` to `out` as its gradient, what `(out * g).sum_all()` gives, without
//! that product, its sum over every value and the backward's second product (on a GPU, a sum of
//! a stage's whole output in one block of threads, and two passes over it).
//!
//! Its value is 0, not the sum: only its gradient means anything, and only as the tensor that
//! `backward()` is called on (the root's gradient is 1, which its backward takes as given).

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

/// A scalar to call `backward()` on that makes `g` the gradient of `out` (the same shape and
/// dtype). Its value is 0.
pub fn seed(out: &Tensor, g: &Tensor) -> Result<Tensor> {
    if out.shape() != g.shape() || out.dtype() != g.dtype() {
        candle_core::bail!("backward seed: a gradient {:?} {:?} for a tensor {:?} {:?}", g.dims(), g.dtype(), out.dims(), out.dtype());
    }
    out.apply_op1_arc(std::sync::Arc::new(Box::new(Seed { g: g.detach() })))
}

struct Seed {
    g: Tensor,
}

impl CustomOp1 for Seed {
    fn name(&self) -> &'static str {
        "backward-seed"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![0.0]), Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, _: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        Ok((s.device().zeros_impl(&Shape::from(()), candle_core::DType::F32)?, Shape::from(())))
    }

    /// `g`: the root's gradient is 1 (see the module's comment), so it is not multiplied in,
    /// which would be a pass over `g` (and reading it back from a GPU would make the host wait).
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        if grad_res.rank() != 0 {
            candle_core::bail!("backward seed: a gradient {:?} for a scalar", grad_res.dims());
        }
        Ok(Some(self.g.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    #[test]
    fn hands_the_seed_to_the_tensor_as_the_product_sum_does() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::arange(0f32, 12.0, &dev).unwrap().reshape((3, 4)).unwrap()).unwrap();
        let g = Tensor::arange(0f32, 12.0, &dev).unwrap().affine(0.25, -1.0).unwrap().reshape((3, 4)).unwrap();
        // Through an op, so that the gradient reaching x is the chain rule's, not g itself.
        let y = x.as_tensor().sqr().unwrap();
        let ours = seed(&y, &g).unwrap().backward().unwrap();
        let theirs = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let got: Vec<f32> = ours.get(x.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let want: Vec<f32> = theirs.get(x.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(got, want);
        assert_eq!(seed(&y, &g).unwrap().to_scalar::<f32>().unwrap(), 0.0);
    }

    #[test]
    fn refuses_a_gradient_of_another_shape_or_dtype() {
        let dev = Device::Cpu;
        let x = Var::zeros((2, 3), DType::F32, &dev).unwrap();
        let e = seed(x.as_tensor(), &Tensor::zeros((3, 2), DType::F32, &dev).unwrap()).unwrap_err();
        assert!(e.to_string().contains("backward seed"), "{e}");
        assert!(seed(x.as_tensor(), &Tensor::zeros((2, 3), DType::BF16, &dev).unwrap()).is_err());
    }
}
