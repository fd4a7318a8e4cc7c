//! `x · Wᵀ` for f32 activations and stored f16 / bf16 weights (a GGUF's F16 matrices, or
//! safetensors kept in 2 bytes at load), forward only: the op a prompt's chunk and a batch of many
//! streams take (`kernels::matmul::half`), beside `gemv` for a few rows.

use candle_core::{DType, Result, Tensor};

/// `x (.., in)` f32 on the CPU times `w (out, in)` f16 or bf16 on the CPU: (.., out) f32.
pub fn forward(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (out_dim, in_dim) = w.dims2()?;
    if !x.device().is_cpu() || x.dtype() != DType::F32 || x.dim(candle_core::D::Minus1)? != in_dim {
        candle_core::bail!("half product: f32 CPU activations of width {in_dim} expected, got {:?} {:?}", x.dtype(), x.shape());
    }
    let mut shape = x.dims().to_vec();
    *shape.last_mut().expect("x has a last dim") = out_dim;
    let xs = x.flatten_all()?.to_vec1::<f32>()?;
    let w = w.contiguous()?;
    let (storage, layout) = w.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else { candle_core::bail!("half product: the weight is not on the CPU") };
    let range = layout.start_offset()..layout.start_offset() + out_dim * in_dim;
    let y = match w.dtype() {
        DType::F16 => kernels::matmul::half::product_wt(&xs, &cpu.as_slice::<half::f16>()?[range], out_dim, in_dim),
        DType::BF16 => kernels::matmul::half::product_wt(&xs, &cpu.as_slice::<half::bf16>()?[range], out_dim, in_dim),
        other => candle_core::bail!("half product: a {other:?} weight (f16 or bf16 expected)"),
    };
    drop(storage);
    Tensor::from_vec(y, shape, x.device())
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    /// The op equals candle's matmul on the widened weight, for a (batch, seq, in) input.
    #[test]
    fn equals_the_matmul_of_the_widened_weight() {
        let dev = Device::Cpu;
        let x = Tensor::from_vec(kernels::rng::signed_values(2 * 9 * 64, 1), (2, 9, 64), &dev).unwrap();
        let w32 = Tensor::from_vec(kernels::rng::signed_values(200 * 64, 2), (200, 64), &dev).unwrap();
        for dtype in [candle_core::DType::F16, candle_core::DType::BF16] {
            let w = w32.to_dtype(dtype).unwrap();
            let want = x.broadcast_matmul(&w.to_dtype(candle_core::DType::F32).unwrap().t().unwrap()).unwrap();
            let got = super::forward(&x, &w).unwrap();
            assert_eq!(got.dims(), want.dims());
            let err = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(err < 1e-4, "{dtype:?}: {err}");
        }
    }
}
