//! The serving adapters' updates of one linear layer for a whole batch, in one pass (punica's
//! BGMV, on the CPU): for each row r whose adapter is a, `y[r] += s_a · B_a (A_a x[r])`.
//!
//! Candle's composite form costs five ops per adapter group and module (gather the rows, two
//! small matmuls, scale, scatter-add), each a new tensor, the scatter a copy of all of `y`: for
//! 4 adapters on every linear layer of a 30-layer model, some 4,000 small ops per decode step,
//! which cost more than the low-rank arithmetic itself. Here it is one op: `y` is copied once, the
//! rows are split over the threads, and each row reads its adapter's `A` (r, in) and `Bᵀ`
//! (r, out), small enough to stay in cache across the rows that share them.

use candle_core::{DType, Device, Result, Tensor};
use rayon::prelude::*;

use crate::cpu_f32_values;
use kernels::gemv::{axpy, dot};
use kernels::simd::SimdLevel;

/// One adapter's share of a batch: its rows (`None`: every row), its `A` (r, in) and `Bᵀ`
/// (r, out), both contiguous, and its scaling.
pub struct RowsUpdate<'a> {
    pub rows: Option<&'a [u32]>,
    pub a: &'a Tensor,
    pub bt: &'a Tensor,
    pub scaling: f32,
}

/// `y` plus each update on its rows, for f32 CPU tensors outside autograd; `None` when the call
/// is not for this kernel (another device or dtype: the caller then takes candle's ops).
/// `x` is (batch, .., in) and `y` (batch, .., out); update rows index the batch dimension.
pub fn add_lora_rows(x: &Tensor, y: &Tensor, updates: &[RowsUpdate]) -> Result<Option<Tensor>> {
    let cpu_f32 = |t: &Tensor| matches!(t.device(), Device::Cpu) && t.dtype() == DType::F32 && !t.track_op();
    if !cpu_f32(x) || !cpu_f32(y) || !updates.iter().all(|u| cpu_f32(u.a) && cpu_f32(u.bt)) {
        return Ok(None);
    }
    let (in_dim, out_dim) = (x.dim(candle_core::D::Minus1)?, y.dim(candle_core::D::Minus1)?);
    let flat_rows = x.elem_count() / in_dim;
    if y.elem_count() != flat_rows * out_dim || x.dim(0)? != y.dim(0)? {
        candle_core::bail!("lora rows: x {:?} and y {:?} do not pair up", x.dims(), y.dims());
    }
    // Positions per batch item (a prompt's tokens): update row r covers flat rows r*per..(r+1)*per.
    let per_item = flat_rows / x.dim(0)?;
    let mut update_of = vec![None; flat_rows];
    for (u, update) in updates.iter().enumerate() {
        if update.a.dims() != [update.bt.dim(0)?, in_dim] || update.bt.dims() != [update.a.dim(0)?, out_dim] {
            candle_core::bail!("lora rows: A {:?} and Bᵀ {:?} do not fit {in_dim} -> {out_dim}", update.a.dims(), update.bt.dims());
        }
        let items: Box<dyn Iterator<Item = usize>> = match update.rows {
            Some(rows) => Box::new(rows.iter().map(|&r| r as usize)),
            None => Box::new(0..x.dim(0)?),
        };
        for item in items {
            update_of[item * per_item..(item + 1) * per_item].iter_mut().for_each(|slot| *slot = Some(u));
        }
    }

    let x = x.contiguous()?;
    let mut out = y.flatten_all()?.to_vec1::<f32>()?;
    // The weights are read in place (no copy): hold every storage's read lock for the pass.
    let (a_guards, bt_guards): (Vec<_>, Vec<_>) = updates.iter().map(|u| (u.a.storage_and_layout(), u.bt.storage_and_layout())).unzip();
    let weights: Vec<(&[f32], &[f32], f32)> = a_guards
        .iter()
        .zip(&bt_guards)
        .zip(updates)
        .map(|(((a, a_layout), (bt, bt_layout)), u)| Ok((cpu_f32_values(a, a_layout)?, cpu_f32_values(bt, bt_layout)?, u.scaling)))
        .collect::<Result<_>>()?;
    let (x_storage, x_layout) = x.storage_and_layout();
    let xs = cpu_f32_values(&x_storage, x_layout)?;
    let level = SimdLevel::current();
    out.par_chunks_mut(out_dim).zip(xs.par_chunks(in_dim)).zip(update_of.par_iter()).for_each(|((y_row, x_row), u)| {
        let Some(u) = *u else { return };
        let (a, bt, scaling) = weights[u];
        for (a_k, bt_k) in a.chunks_exact(in_dim).zip(bt.chunks_exact(out_dim)) {
            axpy(y_row, scaling * dot(x_row, a_k, level), bt_k, level);
        }
    });
    Ok(Some(Tensor::from_vec(out, y.shape(), &Device::Cpu)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testing::random_tensor as data;

    /// `y[rows] += s · (x[rows] Aᵀ) B`, by candle's own ops.
    fn by_candle_ops(x: &Tensor, y: &Tensor, rows: &[u32], a: &Tensor, bt: &Tensor, s: f64) -> Tensor {
        let idx = Tensor::new(rows, &Device::Cpu).unwrap();
        let delta =
            (x.index_select(&idx, 0).unwrap().broadcast_matmul(&a.t().unwrap()).unwrap().broadcast_matmul(bt).unwrap() * s).unwrap();
        y.index_add(&idx, &delta, 0).unwrap()
    }

    /// Three adapters of different ranks over some rows of a 7-row batch (rows 5 and 6 take the
    /// base alone), odd sizes for the vector tails, against gather / matmul / scatter-add.
    #[test]
    fn matches_candle_ops_group_by_group() {
        let (inp, out) = (37, 70);
        let x = data(&[7, 1, inp], 1);
        let y = data(&[7, 1, out], 2);
        let adapters: Vec<(Vec<u32>, Tensor, Tensor, f32)> = [(vec![0, 3], 4, 0.5), (vec![1], 16, 2.0), (vec![2, 4], 1, 1.0)]
            .into_iter()
            .enumerate()
            .map(|(i, (rows, r, s))| (rows, data(&[r, inp], 10 + i as u64), data(&[r, out], 20 + i as u64), s))
            .collect();
        let updates: Vec<RowsUpdate> =
            adapters.iter().map(|(rows, a, bt, s)| RowsUpdate { rows: Some(rows), a, bt, scaling: *s }).collect();
        let got = add_lora_rows(&x, &y, &updates).unwrap().expect("f32 on the CPU takes the kernel");
        let mut want = y.clone();
        for (rows, a, bt, s) in &adapters {
            want = by_candle_ops(&x, &want, rows, a, bt, *s as f64);
        }
        let diff = (got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-5, "off by {diff}");
        let base_rows = |t: &Tensor| t.narrow(0, 5, 2).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(base_rows(&want), base_rows(&y), "rows without an adapter keep the base output");
    }

    /// One adapter for every row of a prompt (batch 2 x 3 positions).
    #[test]
    fn every_row_of_a_prompt() {
        let x = data(&[2, 3, 16], 3);
        let y = data(&[2, 3, 24], 4);
        let (a, bt) = (data(&[8, 16], 5), data(&[8, 24], 6));
        let got = add_lora_rows(&x, &y, &[RowsUpdate { rows: None, a: &a, bt: &bt, scaling: 0.25 }]).unwrap().unwrap();
        let want = (&y + (x.broadcast_matmul(&a.t().unwrap()).unwrap().broadcast_matmul(&bt).unwrap() * 0.25).unwrap()).unwrap();
        let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-5, "off by {diff}");
    }

    #[test]
    fn other_dtypes_are_left_to_candle() {
        let x = data(&[2, 4], 7).to_dtype(DType::BF16).unwrap();
        let y = data(&[2, 4], 8).to_dtype(DType::BF16).unwrap();
        let (a, bt) = (data(&[2, 4], 9), data(&[2, 4], 10));
        assert!(add_lora_rows(&x, &y, &[RowsUpdate { rows: None, a: &a, bt: &bt, scaling: 1.0 }]).unwrap().is_none());
    }
}
