//! `x · Wᵀ` for f32 activations and stored f16 / bf16 weights (a GGUF's F16 matrices, or
//! safetensors kept in 2 bytes at load), forward only: the op a prompt's chunk and a batch of many
//! streams take (`kernels::matmul::half`), beside `gemv` for a few rows.

use candle_core::{DType, Result, Tensor};

/// `x (.., in)` f32 on the CPU times `w (out, in)` f16 or bf16 on the CPU: (.., out) f32.
pub fn forward(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(forward_many(x, &[w])?.remove(0))
}

/// [`forward`] for several weights of one dtype over the same `x` (q/k/v, gate/up): one
/// parallel region and one packing of `x` for all of them (`kernels::matmul::half::product_wt_many`).
pub fn forward_many(x: &Tensor, ws: &[&Tensor]) -> Result<Vec<Tensor>> {
    let Some(first) = ws.first() else { return Ok(vec![]) };
    let in_dim = first.dim(1)?;
    if !x.device().is_cpu() || x.dtype() != DType::F32 || x.dim(candle_core::D::Minus1)? != in_dim {
        candle_core::bail!("half product: f32 CPU activations of width {in_dim} expected, got {:?} {:?}", x.dtype(), x.shape());
    }
    let mut weights = Vec::with_capacity(ws.len());
    for w in ws {
        let (out_dim, w_in) = w.dims2()?;
        if w_in != in_dim || w.dtype() != first.dtype() {
            candle_core::bail!("half product: a {out_dim}x{w_in} {:?} weight beside {in_dim} columns of {:?}", w.dtype(), first.dtype());
        }
        weights.push(w.contiguous()?);
    }
    let x = x.contiguous()?;
    let (x_storage, x_layout) = x.storage_and_layout();
    let candle_core::Storage::Cpu(x_cpu) = &*x_storage else { candle_core::bail!("half product: the activations are not on the CPU") };
    let xs = &x_cpu.as_slice::<f32>()?[x_layout.start_offset()..x_layout.start_offset() + x.elem_count()];
    let guards: Vec<_> = weights.iter().map(|w| w.storage_and_layout()).collect();
    macro_rules! slices {
        ($t:ty) => {{
            let mut slices: Vec<&[$t]> = Vec::with_capacity(guards.len());
            for ((storage, layout), w) in guards.iter().zip(&weights) {
                let candle_core::Storage::Cpu(cpu) = &**storage else { candle_core::bail!("half product: the weight is not on the CPU") };
                slices.push(&cpu.as_slice::<$t>()?[layout.start_offset()..layout.start_offset() + w.elem_count()]);
            }
            kernels::matmul::half::product_wt_many(xs, &slices, in_dim)
        }};
    }
    let ys = match first.dtype() {
        DType::F16 => slices!(half::f16),
        DType::BF16 => slices!(half::bf16),
        other => candle_core::bail!("half product: a {other:?} weight (f16 or bf16 expected)"),
    };
    drop(guards);
    drop(x_storage);
    ys.into_iter()
        .zip(&weights)
        .map(|(y, w)| {
            let mut shape = x.dims().to_vec();
            *shape.last_mut().expect("x has a last dim") = w.dim(0)?;
            Tensor::from_vec(y, shape, x.device())
        })
        .collect()
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

    /// Several weights in one call give what each gives alone; weights of another width or
    /// dtype are refused by name.
    #[test]
    fn many_weights_equal_each_alone() {
        let dev = Device::Cpu;
        let x = Tensor::from_vec(kernels::rng::signed_values(7 * 64, 4), (7, 64), &dev).unwrap();
        let ws: Vec<Tensor> = [200usize, 48, 130]
            .iter()
            .enumerate()
            .map(|(i, &o)| {
                Tensor::from_vec(kernels::rng::signed_values(o * 64, 5 + i as u64), (o, 64), &dev)
                    .unwrap()
                    .to_dtype(candle_core::DType::F16)
                    .unwrap()
            })
            .collect();
        let refs: Vec<&Tensor> = ws.iter().collect();
        let together = super::forward_many(&x, &refs).unwrap();
        for (got, w) in together.iter().zip(&ws) {
            let alone = super::forward(&x, w).unwrap();
            assert_eq!(got.to_vec2::<f32>().unwrap(), alone.to_vec2::<f32>().unwrap());
        }
        let bf = ws[1].to_dtype(candle_core::DType::BF16).unwrap();
        let err = super::forward_many(&x, &[&ws[0], &bf]).unwrap_err().to_string();
        assert!(err.contains("BF16") && err.contains("F16"), "{err}");
        let narrow = Tensor::zeros((4, 32), candle_core::DType::F16, &dev).unwrap();
        let err = super::forward_many(&x, &[&ws[0], &narrow]).unwrap_err().to_string();
        assert!(err.contains("4x32"), "{err}");
    }
}
