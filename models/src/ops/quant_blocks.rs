//! `x @ Wᵀ` over llama.cpp's 32-value block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) read in place:
//! the formats candle has no AVX2 dot product for (Q4_1, Q5_0, Q5_1 run its scalar loop, ~7x
//! slower than llama.cpp) and the two it has, so that all of them share one threading scheme.
//!
//! As in llama.cpp, each row of activations is quantised once to 8 bits per value in blocks of 32
//! (a scale `d` and, for the formats with a minimum, `s = d · Σq`), and every weight block's dot
//! product is an integer one: `Σ w_q · x_q` scaled by `d_w · d_x`, plus `m_w · s_x` for the
//! formats whose values are `d · q + m`. Scales are rounded to f16 where llama.cpp stores them in
//! f16, so both round alike. The weight rows are split over the threads; every thread runs all
//! of a call's activation rows against its weight rows (decoding's one row and a prompt's many).

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Result, Tensor};
use half::f16;

use super::kernels::{for_rows_of_many, transposed, SharedOut, SimdLevel};

/// Values per block in every format here.
pub const BLOCK: usize = 32;

/// A block format: its ggml layout (all little endian, f16 scales first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockFormat {
    /// `d: f16, qs: [u8; 16]`: value `d · (nibble - 8)`.
    Q4_0,
    /// `d: f16, m: f16, qs: [u8; 16]`: value `d · nibble + m`.
    Q4_1,
    /// `d: f16, qh: u32, qs: [u8; 16]`: value `d · ((nibble | high bit << 4) - 16)`.
    Q5_0,
    /// `d: f16, m: f16, qh: u32, qs: [u8; 16]`: value `d · (nibble | high bit << 4) + m`.
    Q5_1,
    /// `d: f16, qs: [i8; 32]`: value `d · q`.
    Q8_0,
}

impl BlockFormat {
    pub fn of(dtype: GgmlDType) -> Option<Self> {
        Some(match dtype {
            GgmlDType::Q4_0 => Self::Q4_0,
            GgmlDType::Q4_1 => Self::Q4_1,
            GgmlDType::Q5_0 => Self::Q5_0,
            GgmlDType::Q5_1 => Self::Q5_1,
            GgmlDType::Q8_0 => Self::Q8_0,
            _ => return None,
        })
    }

    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
        }
    }

    /// Whether values carry a minimum (`d · q + m`), so the dot product needs `s_x`.
    fn has_min(self) -> bool {
        matches!(self, Self::Q4_1 | Self::Q5_1)
    }
}

/// A quantised (out, in) matrix in one of the [`BlockFormat`]s, its blocks as the GGUF stores
/// them.
#[derive(Debug, Clone)]
pub struct BlockMatrix {
    format: BlockFormat,
    rows: usize,
    cols: usize,
    bytes: Vec<u8>,
}

/// One activation row quantised: per block a scale, `d · Σq` and 32 values.
#[derive(Debug, Clone, Default)]
pub struct QuantizedRow {
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub q: Vec<i8>,
}

impl BlockMatrix {
    /// `w`'s blocks when its format is one of ours (None otherwise: candle's kernels take it).
    pub fn from_qtensor(w: &QTensor) -> Result<Option<Self>> {
        let Some(format) = BlockFormat::of(w.dtype()) else { return Ok(None) };
        if !matches!(w.device(), Device::Cpu) {
            return Ok(None);
        }
        let (rows, cols) = w.shape().dims2()?;
        let bytes = w.data()?.into_owned();
        if cols % BLOCK != 0 || bytes.len() != rows * cols / BLOCK * format.block_bytes() {
            candle_core::bail!("{format:?} matrix {rows}x{cols}: {} bytes do not hold its blocks", bytes.len());
        }
        Ok(Some(Self { format, rows, cols, bytes }))
    }

    pub fn format(&self) -> BlockFormat {
        self.format
    }

    /// `x (.., in) · Wᵀ`: (.., out), f32 on the CPU.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(Self::forward_many(&[self], x)?.remove(0))
    }

    /// `x · Wᵢᵀ` for several matrices over the same input (q/k/v, gate/up): the input is
    /// quantised once and all their rows are one parallel region.
    pub fn forward_many(mats: &[&Self], x: &Tensor) -> Result<Vec<Tensor>> {
        let cols = mats[0].cols;
        if !matches!(x.device(), Device::Cpu) || x.dtype() != DType::F32 || x.dim(candle_core::D::Minus1)? != cols {
            candle_core::bail!(
                "{:?} matrix {}x{cols}: input {:?} {:?} on {:?}",
                mats[0].format,
                mats[0].rows,
                x.dims(),
                x.dtype(),
                x.device()
            );
        }
        if let Some(m) = mats.iter().find(|m| m.cols != cols) {
            candle_core::bail!("products over one input: a {}x{} matrix beside {cols} columns", m.rows, m.cols);
        }
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let ys = Self::multiply_many(mats, &xs, SimdLevel::current());
        ys.into_iter()
            .zip(mats)
            .map(|(y, m)| {
                let mut dims = x.dims().to_vec();
                *dims.last_mut().unwrap() = m.rows;
                Tensor::from_vec(y, dims, &Device::Cpu)
            })
            .collect()
    }

    /// `y (m, out) = x (m, in) · Wᵀ`, row-major.
    pub fn multiply(&self, x: &[f32], level: SimdLevel) -> Vec<f32> {
        Self::multiply_many(&[self], x, level).remove(0)
    }

    /// [`Self::multiply`] for several matrices of the same width, in one parallel region.
    fn multiply_many(mats: &[&Self], x: &[f32], level: SimdLevel) -> Vec<Vec<f32>> {
        let cols = mats[0].cols;
        let m = x.len() / cols;
        let with_sum = mats.iter().any(|w| w.format.has_min());
        let acts: Vec<QuantizedRow> = x.chunks_exact(cols).map(|row| quantize_row(row, with_sum)).collect();
        // (out, m) per matrix: each weight row's results together.
        let mut yts: Vec<Vec<f32>> = mats.iter().map(|w| vec![0f32; w.rows * m]).collect();
        let outs: Vec<SharedOut> = yts.iter_mut().map(|yt| SharedOut(yt.as_mut_ptr())).collect();
        let rows: Vec<usize> = mats.iter().map(|w| w.rows).collect();
        for_rows_of_many(&rows, |i, range| {
            let w = mats[i];
            let row_bytes = cols / BLOCK * w.format.block_bytes();
            for o in range {
                let wrow = &w.bytes[o * row_bytes..(o + 1) * row_bytes];
                for (r, act) in acts.iter().enumerate() {
                    // SAFETY: every (matrix, o, r) is written by exactly one work item, inside
                    // that matrix's buffer.
                    unsafe { *outs[i].at(o * m + r) = dot(w.format, wrow, act, level) };
                }
            }
        });
        drop(outs);
        yts.into_iter().zip(mats).map(|(yt, w)| transposed(yt, w.rows, m)).collect()
    }
}

/// f32 through f16 and back: llama.cpp keeps the activations' scales in f16.
fn via_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// ggml's `quantize_row_q8_0` / `q8_1`: per block `d = max|x| / 127`, `q = round(x / d)` (ties
/// to even, as its AVX2 code rounds), `s = d · Σq` when `with_sum`.
pub fn quantize_row(x: &[f32], with_sum: bool) -> QuantizedRow {
    quantize_row_at(x, with_sum, SimdLevel::current())
}

fn quantize_row_at(x: &[f32], with_sum: bool, level: SimdLevel) -> QuantizedRow {
    let blocks = x.len() / BLOCK;
    let mut row = QuantizedRow { d: Vec::with_capacity(blocks), s: Vec::with_capacity(blocks), q: vec![0; x.len()] };
    for (block, q) in x.chunks_exact(BLOCK).zip(row.q.chunks_exact_mut(BLOCK)) {
        let (d, sum) = quantize_block(block, q, level);
        row.d.push(via_f16(d));
        row.s.push(if with_sum { via_f16(d * sum as f32) } else { 0.0 });
    }
    row
}

/// One block of 32: its 8-bit values into `q`; returns (`d`, `Σq`).
fn quantize_block(x: &[f32], q: &mut [i8], level: SimdLevel) -> (f32, i32) {
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Avx2 {
        // SAFETY: the level is at most what the CPU has; both slices hold one block.
        return unsafe { super::quant_blocks_x86::quantize_block(x, q) };
    }
    let _ = level;
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0;
    for (q, v) in q.iter_mut().zip(x) {
        *q = (v * id).round_ties_even() as i8;
        sum += *q as i32;
    }
    (d, sum)
}

/// One weight row's dot product with one quantised activation row, at `level`.
fn dot(format: BlockFormat, w: &[u8], x: &QuantizedRow, level: SimdLevel) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Avx2 {
        // SAFETY: the level is at most what the CPU has (Avx2 includes FMA and F16C); `w` holds
        // whole blocks and `x` as many blocks of 32 (both checked by the callers).
        return unsafe { super::quant_blocks_x86::dot(format, w, x) };
    }
    let _ = level;
    dot_scalar(format, w, x)
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The 32 integer values of a weight block (before its scale and minimum), in order.
pub(crate) fn block_values(format: BlockFormat, b: &[u8]) -> [i32; BLOCK] {
    let mut v = [0i32; BLOCK];
    let nibbles = |qs: &[u8], v: &mut [i32; BLOCK]| {
        for j in 0..16 {
            v[j] = (qs[j] & 0x0f) as i32;
            v[j + 16] = (qs[j] >> 4) as i32;
        }
    };
    match format {
        BlockFormat::Q4_0 => {
            nibbles(&b[2..18], &mut v);
            v.iter_mut().for_each(|x| *x -= 8);
        }
        BlockFormat::Q4_1 => nibbles(&b[4..20], &mut v),
        BlockFormat::Q5_0 | BlockFormat::Q5_1 => {
            let (qh_at, qs_at) = if format == BlockFormat::Q5_0 { (2, 6) } else { (4, 8) };
            let qh = u32::from_le_bytes(b[qh_at..qh_at + 4].try_into().unwrap());
            nibbles(&b[qs_at..qs_at + 16], &mut v);
            for (j, x) in v.iter_mut().enumerate() {
                *x |= (((qh >> j) & 1) << 4) as i32;
                if format == BlockFormat::Q5_0 {
                    *x -= 16;
                }
            }
        }
        BlockFormat::Q8_0 => {
            for j in 0..BLOCK {
                v[j] = b[2 + j] as i8 as i32;
            }
        }
    }
    v
}

/// The plain-code dot product (any CPU; the reference the vector one is tested against).
fn dot_scalar(format: BlockFormat, w: &[u8], x: &QuantizedRow) -> f32 {
    let bb = format.block_bytes();
    let mut total = 0f32;
    for (i, b) in w.chunks_exact(bb).enumerate() {
        let v = block_values(format, b);
        let sumi: i32 = v.iter().zip(&x.q[i * BLOCK..(i + 1) * BLOCK]).map(|(a, b)| a * *b as i32).sum();
        total += f16_at(b, 0) * x.d[i] * sumi as f32;
        if format.has_min() {
            total += f16_at(b, 2) * x.s[i];
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every format, both levels, against the dense product of the dequantised weights.
    #[test]
    fn block_products_match_dequantized_weights_at_every_level() {
        let levels: Vec<SimdLevel> = [SimdLevel::Scalar, SimdLevel::Avx2].into_iter().filter(|l| *l <= SimdLevel::detected()).collect();
        for dtype in [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q5_1, GgmlDType::Q8_0] {
            for (m, inp, out) in [(1, 64, 40), (3, 576, 70), (37, 96, 33)] {
                let w = crate::rng::random_tensor(&[out, inp], 11);
                let x = crate::rng::random_tensor(&[m, inp], 12);
                let q = QTensor::quantize(&w, dtype).unwrap();
                let dense = x.matmul(&q.dequantize(&Device::Cpu).unwrap().t().unwrap()).unwrap().flatten_all().unwrap();
                let dense = dense.to_vec1::<f32>().unwrap();
                let mat = BlockMatrix::from_qtensor(&q).unwrap().unwrap();
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

    /// The vector quantiser rounds exactly as the plain one.
    #[test]
    fn activation_quantisation_is_the_same_at_every_level() {
        let x = crate::rng::random_tensor(&[4 * BLOCK], 5).flatten_all().unwrap().to_vec1::<f32>().unwrap();
        // Ties and zeros too: values on the half steps of a block whose max is 127.
        let mut ties: Vec<f32> = (0..BLOCK).map(|i| i as f32 - 15.5).collect();
        ties[0] = 127.0;
        let zeros = vec![0f32; BLOCK];
        for input in [x, ties, zeros] {
            let plain = quantize_row_at(&input, true, SimdLevel::Scalar);
            let best = quantize_row_at(&input, true, SimdLevel::detected());
            assert_eq!((plain.d, plain.s, plain.q), (best.d, best.s, best.q));
        }
    }

    /// ggml's definition of the product, in f64: the dequantised weights times the activations
    /// quantised to 8 bits per block of 32 (ggml's `quantize_row_q8_0` / `q8_1`) and dequantised.
    /// Not candle's quantised matmul: on AVX-512 VNNI CPUs candle 0.11 quantises the activations
    /// to 256-value Q8_K blocks instead, a different (coarser) product that ggml never computes.
    #[test]
    fn block_products_match_ggmls_definition() {
        for dtype in [GgmlDType::Q4_0, GgmlDType::Q8_0, GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q5_1] {
            let w = crate::rng::random_tensor(&[48, 256], 3);
            let x = crate::rng::random_tensor(&[2, 256], 4);
            let q = QTensor::quantize(&w, dtype).unwrap();
            let mat = BlockMatrix::from_qtensor(&q).unwrap().unwrap();
            let ours = mat.forward(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
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
