//! Weights kept in a GGUF block format (Q4_0, Q4_K, Q8_0, ...) and the linear layer over them.
//!
//! A model is built from a `VarBuilder` for its dense tensors plus, optionally, a
//! [`QuantizedWeights`] holding some of its matrices quantised: a linear layer (or the LM head)
//! whose weight is there multiplies with it directly (candle's quantised matmul: the activations
//! are quantised to 8 bits per block and the dot products run on the integer blocks, as in
//! llama.cpp), and is never widened to f32. Where the weights came from (a GGUF file, or
//! safetensors quantised at load) is not this module's business.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::Linear;

use kernels::quant_blocks::BlockMatrix;

/// Quantised matrices by their transformers name (`model.layers.0.mlp.up_proj.weight`), each
/// (out, in) like the dense weight it stands for.
#[derive(Debug, Clone, Default)]
pub struct QuantizedWeights(HashMap<String, Arc<QTensor>>);

impl QuantizedWeights {
    pub fn insert(&mut self, name: String, w: QTensor) {
        self.0.insert(name, Arc::new(w));
    }

    pub fn get(&self, name: &str) -> Option<&Arc<QTensor>> {
        self.0.get(name)
    }

    /// Removes `name` for the layer that keeps it: once that layer holds its own copy (repacked
    /// blocks, 2-byte values), the file's copy is freed, so a load holds about one copy of the
    /// model at a time rather than two.
    pub fn take(&mut self, name: &str) -> Option<Arc<QTensor>> {
        self.0.remove(name)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Bytes the quantised blocks take.
    pub fn storage_bytes(&self) -> usize {
        self.0.values().map(|w| w.storage_size_in_bytes()).sum()
    }

    /// Each matrix's block format.
    pub fn dtypes(&self) -> impl Iterator<Item = GgmlDType> + '_ {
        self.0.values().map(|w| w.dtype())
    }

    /// The block format of each matrix, counted (`Q4_1: 210`), for a one-line summary.
    pub fn formats(&self) -> Vec<(String, usize)> {
        let mut counts: HashMap<String, usize> = HashMap::new();
        for w in self.0.values() {
            *counts.entry(format!("{:?}", w.dtype())).or_default() += 1;
        }
        let mut v: Vec<(String, usize)> = counts.into_iter().collect();
        v.sort();
        v
    }
}

/// A stored matrix and the kernel that multiplies with it: ours for the 32-value block formats
/// (`ops::quant`, AVX2 and AVX-512 VNNI for all five), for the K formats where
/// `quant_blocks::k_formats_run_here` says (CPUs without VNNI, or `FSDP_K_BLOCKS=ours`), and
/// for f16 / bf16 (decoding's matrix-vector kernel reads the 2-byte values in place while the
/// activations stay f32); candle's for the rest (the K formats on VNNI and AMX CPUs, which it
/// repacks for those tiles).
#[derive(Debug, Clone)]
pub enum QuantizedMatrix {
    Blocks(Arc<BlockMatrix>),
    Half(Tensor),
    Candle(QMatMul),
}

impl QuantizedMatrix {
    pub fn new(w: &Arc<QTensor>) -> Result<Self> {
        use candle_core::quantized::GgmlDType;
        match w.dtype() {
            GgmlDType::F16 | GgmlDType::BF16 if w.device().is_cpu() => return Ok(Self::Half(half_values(w)?)),
            GgmlDType::F16 => return Ok(Self::Half(w.dequantize_f16(&w.device())?)),
            GgmlDType::BF16 => return Ok(Self::Half(w.dequantize(&w.device())?.to_dtype(DType::BF16)?)),
            _ => {}
        }
        match ops::quant::block_matrix(w)? {
            Some(m) => Ok(Self::Blocks(Arc::new(m))),
            None => Ok(Self::Candle(QMatMul::from_arc(w.clone())?)),
        }
    }

    /// `x (.., in) · Wᵀ`; `x` must be f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.dtype() != DType::F32 {
            candle_core::bail!("quantised weights compute in f32; the activations are {:?} (load with --dtype f32)", x.dtype());
        }
        let x = x.contiguous()?;
        match self {
            Self::Blocks(m) if x.device().is_cpu() => ops::quant::forward(m, &x),
            Self::Blocks(m) => candle_core::bail!("{:?} blocks are multiplied on the CPU only", m.format()),
            Self::Half(w) => match ops::gemv::gemv_t(&x, w)? {
                Some(y) => Ok(y),
                // A prompt's or a batch's many rows: widened a piece of the weight at a time.
                None if x.device().is_cpu() => ops::half_product::forward(&x, w),
                None => x.broadcast_matmul(&w.to_dtype(DType::F32)?.t()?),
            },
            Self::Candle(w) => w.forward(&x),
        }
    }

    /// [`Self::forward`] for several matrices over the same `x` (q/k/v, gate/up) in one pass,
    /// when they are all 32-value blocks or all 2-byte floats of one dtype and `x` is f32 on the
    /// CPU: the input prepared once (quantised, or packed) and one parallel region for all their
    /// rows. None otherwise (the caller runs them one by one).
    pub fn forward_many(mats: &[&Self], x: &Tensor) -> Result<Option<Vec<Tensor>>> {
        if mats.len() < 2 || !ops::applies(x) {
            return Ok(None);
        }
        let blocks: Option<Vec<&BlockMatrix>> =
            mats.iter().map(|m| if let Self::Blocks(b) = m { Some(b.as_ref()) } else { None }).collect();
        if let Some(blocks) = blocks {
            return ops::quant::forward_many(&blocks, &x.contiguous()?).map(Some);
        }
        let halves: Option<Vec<&Tensor>> = mats.iter().map(|m| if let Self::Half(w) = m { Some(w) } else { None }).collect();
        let Some(halves) = halves.filter(|ws| ws.iter().all(|w| w.dtype() == ws[0].dtype())) else { return Ok(None) };
        match ops::gemv::gemv_t_many(x, &halves)? {
            Some(ys) => Ok(Some(ys)),
            None => ops::half_product::forward_many(x, &halves).map(Some),
        }
    }
}

/// A stored f16 / bf16 matrix on the CPU as a tensor of the same 2-byte values: its bytes
/// copied once. candle's `dequantize` widens to f32 first, which moved and faulted in twice the
/// matrix's size for every matrix of a 2-byte GGUF while it loaded.
fn half_values(w: &QTensor) -> Result<Tensor> {
    use candle_core::quantized::GgmlDType;
    let dtype = match w.dtype() {
        GgmlDType::F16 => DType::F16,
        GgmlDType::BF16 => DType::BF16,
        other => candle_core::bail!("half_values: a {other:?} matrix (f16 or bf16 expected)"),
    };
    Tensor::from_raw_buffer(&w.data()?, dtype, w.shape().dims(), &w.device())
}

/// The matrix of a linear layer: dense (candle `Linear`) or quantised blocks.
#[derive(Debug, Clone)]
pub enum LinearWeight {
    Dense(Linear),
    Quantized { w: QuantizedMatrix, bias: Option<Tensor> },
}

impl LinearWeight {
    /// The quantised weight `name` taken from `quantized` when it is there, else `dense()`.
    pub fn pick(
        quantized: &mut QuantizedWeights,
        name: &str,
        bias: Option<Tensor>,
        dense: impl FnOnce() -> Result<Linear>,
    ) -> Result<Self> {
        match quantized.take(name) {
            Some(w) => Ok(Self::Quantized { w: QuantizedMatrix::new(&w)?, bias }),
            None => dense().map(Self::Dense),
        }
    }

    /// The dense weight, for the paths that need one (training, merging); None when quantised.
    pub fn dense(&self) -> Option<&Linear> {
        match self {
            Self::Dense(l) => Some(l),
            Self::Quantized { .. } => None,
        }
    }

    /// `x Wᵀ (+ b)` with quantised weights. Activations must be f32 (the quantised kernels take
    /// f32 and quantise it per block themselves).
    pub fn forward_quantized(w: &QuantizedMatrix, bias: Option<&Tensor>, x: &Tensor) -> Result<Tensor> {
        let y = w.forward(x)?;
        match bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;
    use candle_core::Device;

    /// Quantised products agree with the dense product of the dequantised weights (up to the
    /// activations' own 8-bit quantisation), for decode's one row and a prompt's many.
    #[test]
    fn quantized_linear_matches_its_dequantized_weights() {
        let dev = Device::Cpu;
        for dtype in [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q6K] {
            for (rows, inp, out) in [
                (1, 256, 64),
                (5, 512, 96),
                (37, 768, 192),
                (1, 576, 192),
                (37, 576, 1536),
                (1, 1536, 576),
                (1, 576, 49152),
                (3, 576, 49152),
            ] {
                if inp % dtype.block_size() != 0 {
                    continue;
                }
                let w = ops::testing::random_tensor(&[out, inp], 7);
                let x = ops::testing::random_tensor(&[1, rows, inp], 8);
                let q = QTensor::quantize(&w, dtype).unwrap();
                let dense = x.broadcast_matmul(&q.dequantize(&dev).unwrap().t().unwrap()).unwrap();
                let y = LinearWeight::forward_quantized(&QuantizedMatrix::new(&Arc::new(q)).unwrap(), None, &x).unwrap();
                let err = (y - &dense).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                let scale = dense.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(err <= 0.02 * scale, "{dtype:?} {rows}x{inp}x{out}: max error {err} of {scale}");
            }
        }
    }

    /// A stored f16 / bf16 matrix keeps its values bit for bit, in its own dtype and shape.
    #[test]
    fn half_matrices_keep_their_stored_values() {
        let dev = Device::Cpu;
        let w = ops::testing::random_tensor(&[48, 64], 3);
        for (stored, dtype) in [(GgmlDType::F16, DType::F16), (GgmlDType::BF16, DType::BF16)] {
            let q = QTensor::quantize(&w, stored).unwrap();
            let QuantizedMatrix::Half(got) = QuantizedMatrix::new(&Arc::new(q)).unwrap() else {
                panic!("{stored:?} is not kept in 2 bytes")
            };
            let want = w.to_dtype(dtype).unwrap();
            assert_eq!((got.dtype(), got.dims()), (dtype, want.dims()));
            let bits = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(bits(&got), bits(&want), "{stored:?}");
            assert!(got.device().same_device(&dev));
        }
    }

    /// Several matrices in one pass give what each gives alone: 2-byte weights at decoding's
    /// row counts and a prompt's, blocks at a prompt's; matrices of mixed kinds are left to
    /// the caller (None).
    #[test]
    fn matrices_in_one_pass_equal_each_alone() {
        let half = |out: usize, seed: u64| {
            let w = ops::testing::random_tensor(&[out, 256], seed);
            QuantizedMatrix::new(&Arc::new(QTensor::quantize(&w, GgmlDType::F16).unwrap())).unwrap()
        };
        let block = |out: usize, seed: u64| {
            let w = ops::testing::random_tensor(&[out, 256], seed);
            QuantizedMatrix::new(&Arc::new(QTensor::quantize(&w, GgmlDType::Q8_0).unwrap())).unwrap()
        };
        let halves = [half(96, 1), half(32, 2), half(32, 3)];
        let blocks = [block(96, 4), block(64, 5)];
        for rows in [1, 3, 46] {
            let x = ops::testing::random_tensor(&[1, rows, 256], 6);
            for mats in [halves.iter().collect::<Vec<_>>(), blocks.iter().collect()] {
                let together = QuantizedMatrix::forward_many(&mats, &x).unwrap().expect("one kind of matrix");
                for (got, m) in together.iter().zip(&mats) {
                    let alone = m.forward(&x).unwrap();
                    assert_eq!(
                        got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        alone.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        "{rows} rows"
                    );
                }
            }
            assert!(QuantizedMatrix::forward_many(&[&halves[0], &blocks[0]], &x).unwrap().is_none());
        }
    }
}
