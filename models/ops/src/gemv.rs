//! `x · Wᵀ` for a few rows (decoding) as a tensor op: the entry point that chooses the
//! matrix-vector kernels (`kernels::gemv`, `kernels::small_batch`) where they apply and says
//! `None` where candle's matmul should run.

use candle_core::{DType, Device, Result, Tensor};
use kernels::gemv::{gemv_rows_many, GEMV_MAX_ROWS};
use kernels::simd::SimdLevel;
use kernels::small_batch::{self, SMALL_BATCH_MAX_ROWS};

/// `x @ w^T` for a CPU `x` of shape (.., in) with at most [`GEMV_MAX_ROWS`] rows in all (with
/// f32 weights up to `small_batch::SMALL_BATCH_MAX_ROWS`, by that module's kernel) and a
/// contiguous CPU `w` (out, in), both f32, f16 or bf16 (f16 / bf16 weights are widened in
/// registers, `half_dot`; the activations are taken in f32 and the result returned in `x`'s
/// dtype), when neither needs a gradient; `None` when the call is not for this kernel (the caller
/// then takes candle's matmul).
pub fn gemv_t(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    Ok(gemv_t_many(x, &[w])?.map(|mut ys| ys.remove(0)))
}

/// [`gemv_t`] for several matrices of one dtype over the same `x` (q/k/v, gate/up): their rows
/// are one parallel region instead of one each.
pub fn gemv_t_many(x: &Tensor, ws: &[&Tensor]) -> Result<Option<Vec<Tensor>>> {
    let in_dim = x.dim(candle_core::D::Minus1)?;
    let rows = x.elem_count() / in_dim;
    let float = |t: &Tensor| matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16);
    let weight_ok = |w: &Tensor| {
        matches!(w.device(), Device::Cpu)
            && float(w)
            && w.dtype() == ws[0].dtype()
            && w.rank() == 2
            && w.is_contiguous()
            && !w.track_op()
            && w.dim(1).is_ok_and(|d| d == in_dim)
    };
    // A few more rows with f32 weights: `small_batch`, which also reads each weight once.
    let small_batch = rows > GEMV_MAX_ROWS && rows <= SMALL_BATCH_MAX_ROWS && ws[0].dtype() == DType::F32;
    let eligible = matches!(x.device(), Device::Cpu)
        && float(x)
        && (rows <= GEMV_MAX_ROWS || small_batch)
        && !x.track_op()
        && ws.iter().all(|w| weight_ok(w));
    if !eligible {
        return Ok(None);
    }
    let xs = x.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let guards: Vec<_> = ws.iter().map(|w| w.storage_and_layout()).collect();
    let mut cpus = vec![];
    for (storage, layout) in &guards {
        let candle_core::Storage::Cpu(cpu) = &**storage else { return Ok(None) };
        cpus.push((cpu, layout.start_offset()));
    }
    let out_dims: Vec<usize> = ws.iter().map(|w| w.dim(0)).collect::<Result<_>>()?;
    let level = SimdLevel::current();
    macro_rules! run {
        ($t:ty) => {{
            let slices: Vec<&[$t]> = cpus
                .iter()
                .zip(&out_dims)
                .map(|((cpu, start), out)| Ok(&cpu.as_slice::<$t>()?[*start..start + out * in_dim]))
                .collect::<Result<_>>()?;
            gemv_rows_many(&xs, rows, &slices, in_dim, level)
        }};
    }
    let ys = match ws[0].dtype() {
        DType::F16 => run!(half::f16),
        DType::BF16 => run!(half::bf16),
        _ if small_batch => {
            let slices: Vec<&[f32]> = cpus
                .iter()
                .zip(&out_dims)
                .map(|((cpu, start), out)| Ok(&cpu.as_slice::<f32>()?[*start..start + out * in_dim]))
                .collect::<Result<_>>()?;
            small_batch::rows_many(&xs, rows, &slices, in_dim, level)
        }
        _ => run!(f32),
    };
    drop(guards);
    ys.into_iter()
        .zip(out_dims)
        .map(|(y, out)| {
            let mut dims = x.dims().to_vec();
            *dims.last_mut().unwrap() = out;
            Tensor::from_vec(y, dims, &Device::Cpu)?.to_dtype(x.dtype())
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    use kernels::rng::signed_values as data;

    /// Several matrices in one region (q/k/v-like, sizes that make the threads' ranges span
    /// two matrices) give what each gives alone, bit for bit.
    #[test]
    fn many_matrices_match_one_at_a_time() {
        let (rows, inp) = (2, 96);
        let x = Tensor::from_vec(data(rows * inp, 5), (rows, inp), &Device::Cpu).unwrap();
        let ws: Vec<Tensor> = [(37, 6), (1, 7), (130, 8)]
            .map(|(out, seed)| Tensor::from_vec(data(out * inp, seed), (out, inp), &Device::Cpu).unwrap())
            .into();
        let together = gemv_t_many(&x, &ws.iter().collect::<Vec<_>>()).unwrap().unwrap();
        for (w, got) in ws.iter().zip(together) {
            let alone = gemv_t(&x, w).unwrap().unwrap();
            assert_eq!(got.to_vec2::<f32>().unwrap(), alone.to_vec2::<f32>().unwrap());
        }
    }

    /// The entry point takes a 1-row f32 product, and returns x's dtype for half weights.
    #[test]
    fn small_products_take_the_gemv_path() {
        let y = gemv_t(
            &Tensor::from_vec(data(576, 3), (1, 1, 576), &Device::Cpu).unwrap(),
            &Tensor::from_vec(data(576 * 9, 4), (9, 576), &Device::Cpu).unwrap(),
        )
        .unwrap()
        .expect("a 1-row f32 product takes the gemv path");
        assert_eq!(y.dims(), &[1, 1, 9]);
        let x = Tensor::from_vec(data(3 * 77, 1), (3, 77), &Device::Cpu).unwrap();
        for dtype in [DType::F16, DType::BF16] {
            let w = Tensor::from_vec(data(9 * 77, 2), (9, 77), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let y = gemv_t(&x.to_dtype(dtype).unwrap(), &w).unwrap().expect("half weights take the gemv path");
            assert_eq!(y.dtype(), dtype);
        }
    }
}
