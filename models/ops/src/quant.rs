//! `x · Wᵀ` over llama.cpp's block formats as a tensor op: a `QTensor` in one of the formats
//! `kernels::quant_blocks` runs (the 32-value ones and the K formats Q4_K, Q5_K, Q6_K) becomes
//! its [`BlockMatrix`], and products over one input run all of them in one parallel region.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Result, Tensor};
use kernels::quant_blocks::{self, BlockFormat, BlockMatrix};
use kernels::simd::SimdLevel;

/// `w`'s blocks when its format is one the block kernels run here (None otherwise: candle's
/// kernels take it).
pub fn block_matrix(w: &QTensor) -> Result<Option<BlockMatrix>> {
    match block_format(w.dtype()) {
        Some(format) if !format.is_k() || quant_blocks::k_formats_run_here(SimdLevel::current()) => blocks_of(w, format),
        _ => Ok(None),
    }
}

/// `w`'s blocks in `format` (its own), on the CPU.
fn blocks_of(w: &QTensor, format: BlockFormat) -> Result<Option<BlockMatrix>> {
    if !matches!(w.device(), Device::Cpu) {
        return Ok(None);
    }
    let (rows, cols) = w.shape().dims2()?;
    BlockMatrix::new(format, rows, cols, w.data()?.into_owned()).map(Some).map_err(candle_core::Error::Msg)
}

/// Whether `dtype` is one of the K formats the block kernels take (Q4_K, Q5_K, Q6_K): those
/// whose kernels, ours or candle's, depend on the CPU and `FSDP_K_BLOCKS` ([`block_matrix`]).
pub fn is_k_format(dtype: GgmlDType) -> bool {
    block_format(dtype).is_some_and(BlockFormat::is_k)
}

fn block_format(dtype: GgmlDType) -> Option<BlockFormat> {
    Some(match dtype {
        GgmlDType::Q4_0 => BlockFormat::Q4_0,
        GgmlDType::Q4_1 => BlockFormat::Q4_1,
        GgmlDType::Q5_0 => BlockFormat::Q5_0,
        GgmlDType::Q5_1 => BlockFormat::Q5_1,
        GgmlDType::Q8_0 => BlockFormat::Q8_0,
        GgmlDType::Q4K => BlockFormat::Q4_K,
        GgmlDType::Q5K => BlockFormat::Q5_K,
        GgmlDType::Q6K => BlockFormat::Q6_K,
        _ => return None,
    })
}

/// `x (.., in) · Wᵀ`: (.., out), f32 on the CPU.
pub fn forward(w: &BlockMatrix, x: &Tensor) -> Result<Tensor> {
    Ok(forward_many(&[w], x)?.remove(0))
}

/// `x · Wᵢᵀ` for several matrices over the same input (q/k/v, gate/up): the input is quantised
/// once and all their rows are one parallel region.
pub fn forward_many(mats: &[&BlockMatrix], x: &Tensor) -> Result<Vec<Tensor>> {
    let (rows, cols) = mats[0].dims();
    if !matches!(x.device(), Device::Cpu) || x.dtype() != DType::F32 || x.dim(candle_core::D::Minus1)? != cols {
        candle_core::bail!("{:?} matrix {rows}x{cols}: input {:?} {:?} on {:?}", mats[0].format(), x.dims(), x.dtype(), x.device());
    }
    if let Some(m) = mats.iter().find(|m| m.dims().1 != cols) {
        let (r, c) = m.dims();
        candle_core::bail!("products over one input: a {r}x{c} matrix beside {cols} columns");
    }
    let xs = x.flatten_all()?.to_vec1::<f32>()?;
    let ys = BlockMatrix::multiply_many(mats, &xs, SimdLevel::current());
    ys.into_iter()
        .zip(mats)
        .map(|(y, m)| {
            let mut dims = x.dims().to_vec();
            *dims.last_mut().unwrap() = m.dims().0;
            Tensor::from_vec(y, dims, &Device::Cpu)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::random_tensor;
    use kernels::quant_blocks::{quantize_row_at, BLOCK};

    /// Every format, both levels, against the dense product of the dequantised weights.
    #[test]
    fn block_products_match_dequantized_weights_at_every_level() {
        let levels: Vec<SimdLevel> = [SimdLevel::Scalar, SimdLevel::Avx2].into_iter().filter(|l| *l <= SimdLevel::detected()).collect();
        let formats = [
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ];
        for dtype in formats {
            // Widths of whole blocks: 32 values, or a K format's 256.
            let shapes = if dtype.block_size() == 256 {
                [(1, 256, 40), (3, 512, 70), (37, 256, 33)]
            } else {
                [(1, 64, 40), (3, 576, 70), (37, 96, 33)]
            };
            for (m, inp, out) in shapes {
                let w = random_tensor(&[out, inp], 11);
                let x = random_tensor(&[m, inp], 12);
                let q = QTensor::quantize(&w, dtype).unwrap();
                let dense = x.matmul(&q.dequantize(&Device::Cpu).unwrap().t().unwrap()).unwrap().flatten_all().unwrap();
                let dense = dense.to_vec1::<f32>().unwrap();
                let mat = blocks_of(&q, block_format(dtype).unwrap()).unwrap().unwrap();
                let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let scale = dense.iter().fold(0f32, |a, v| a.max(v.abs()));
                let mut by_level = vec![];
                for &level in &levels {
                    let y = mat.multiply(&xs, level);
                    let err = y.iter().zip(&dense).fold(0f32, |a, (p, q)| a.max((p - q).abs()));
                    // The activations' own 8-bit rounding is the only difference.
                    assert!(err <= 0.02 * scale, "{dtype:?} {m}x{inp}x{out} {level:?}: error {err} of {scale}");
                    by_level.push(y);
                }
                for y in &by_level[1..] {
                    let diff = y.iter().zip(&by_level[0]).fold(0f32, |a, (p, q)| a.max((p - q).abs()));
                    assert!(diff <= 1e-4 * scale, "{dtype:?}: levels differ by {diff}");
                }
            }
        }
    }

    /// ggml's definition of the product, in f64: the dequantised weights times the activations
    /// quantised to 8 bits per block of 32 (ggml's `quantize_row_q8_0` / `q8_1`) and dequantised.
    /// For the K formats, candle's dequantising (a port of ggml's) checks our reading of their
    /// super-blocks; there ggml quantises the activations to 256-value Q8_K blocks, which we do
    /// not (32-value blocks: finer, and one quantised input for every format of a model).
    /// Not candle's quantised matmul: on AVX-512 VNNI CPUs candle 0.11 quantises the activations
    /// to 256-value Q8_K blocks instead, a different (coarser) product that ggml never computes.
    #[test]
    fn block_products_match_ggmls_definition() {
        for dtype in [
            GgmlDType::Q4_0,
            GgmlDType::Q8_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ] {
            let w = random_tensor(&[48, 512], 3);
            let x = random_tensor(&[2, 512], 4);
            let q = QTensor::quantize(&w, dtype).unwrap();
            let mat = blocks_of(&q, block_format(dtype).unwrap()).unwrap().unwrap();
            let ours = forward(&mat, &x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let wd = q.dequantize(&candle_core::Device::Cpu).unwrap().to_vec2::<f32>().unwrap();
            let mut want = vec![];
            for xr in x.to_vec2::<f32>().unwrap() {
                let qx = quantize_row_at(&xr, false, SimdLevel::Scalar);
                let xd: Vec<f64> = qx.q.iter().enumerate().map(|(i, &v)| qx.d[i / BLOCK] as f64 * v as f64).collect();
                want.extend(wd.iter().map(|wr| wr.iter().zip(&xd).map(|(&a, &b)| a as f64 * b).sum::<f64>()));
            }
            let scale = want.iter().fold(0f64, |a, v| a.max(v.abs()));
            let diff = ours.iter().zip(&want).fold(0f64, |a, (&p, &q)| a.max((p as f64 - q).abs()));
            // The same integer sums; f32 sums differ, and for the formats with a minimum (Q4_1,
            // Q5_1) ggml rounds each activation block's sum to f16 (a relative 5e-4 at most).
            let tolerance = if matches!(dtype, GgmlDType::Q4_1 | GgmlDType::Q5_1) { 1e-3 } else { 1e-4 };
            assert!(diff <= tolerance * scale, "{dtype:?}: {diff} of {scale}");
        }
    }
}
