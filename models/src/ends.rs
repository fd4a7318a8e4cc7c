//! The two ends of the network around its decoder layers: token ids to hidden states
//! ([`TokenEmbedding`]) and hidden states to logits or per-position losses ([`OutputHead`]).
//!
//! Each stage of the network has its forward written once: here for the ends, in `layers` for a
//! decoder layer. [`crate::CausalLm`] holds the stages built once from a checkpoint and chains
//! them (inference, and the uncached forward of every position); [`crate::LlamaStages`] builds
//! one stage at a time from the parameters a distributed engine gathered, and the engine chains
//! them (training).

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Result, Tensor};

use ops::weight_grads::WeightGradTarget;

use crate::layers::{OpMode, RmsNorm};
use crate::quantized::{LinearWeight, QuantizedMatrix};

/// Stage 0: the rows of the (vocab, hidden) table picked by token id.
#[derive(Debug, Clone)]
pub struct TokenEmbedding {
    table: EmbeddingTable,
    /// As transformers' `nn.Embedding(padding_idx=pad_token_id)`: this row gets no gradient.
    pad_token_id: Option<u32>,
}

/// The table: a tensor of the compute dtype, or a GGUF's quantised blocks whose rows are
/// dequantised as tokens pick them (as llama.cpp's `get_rows`): a vocabulary of 128k by 4,096
/// is 2.1 GB in f32 and a quarter of that or less in blocks.
#[derive(Debug, Clone)]
enum EmbeddingTable {
    Dense(Tensor),
    Quantized { blocks: Arc<QTensor>, dtype: DType, device: Device },
}

impl TokenEmbedding {
    pub fn new(table: Tensor, pad_token_id: Option<u32>) -> Self {
        Self { table: EmbeddingTable::Dense(table), pad_token_id }
    }

    /// A table kept in its quantised blocks, rows given in `dtype`: for generation (training
    /// dequantises a GGUF's weights first).
    pub fn quantized(blocks: Arc<QTensor>, dtype: DType, pad_token_id: Option<u32>) -> Self {
        let device = blocks.device();
        Self { table: EmbeddingTable::Quantized { blocks, dtype, device }, pad_token_id }
    }

    pub fn device(&self) -> &Device {
        match &self.table {
            EmbeddingTable::Dense(t) => t.device(),
            EmbeddingTable::Quantized { device, .. } => device,
        }
    }

    /// The dtype of the rows it gives (the model's compute dtype).
    pub fn dtype(&self) -> DType {
        match &self.table {
            EmbeddingTable::Dense(t) => t.dtype(),
            EmbeddingTable::Quantized { dtype, .. } => *dtype,
        }
    }

    /// (ids..., hidden) rows for u32 `ids`. In training on the CPU in f32, or on a GPU whose
    /// kernels take the table, the lookup is `ops::embedding`, whose backward builds the table's
    /// gradient in one buffer and hands it to `grad_to` when given; elsewhere candle's ops, with
    /// the pad row held out of the gradient the same way. Generation takes plain rows.
    pub fn forward(&self, ids: &Tensor, mode: OpMode, grad_to: Option<WeightGradTarget>) -> Result<Tensor> {
        let w = match (&self.table, mode) {
            (EmbeddingTable::Dense(w), _) => w,
            (EmbeddingTable::Quantized { blocks, dtype, .. }, OpMode::Generate) => return blocks.embedding(ids)?.to_dtype(*dtype),
            (EmbeddingTable::Quantized { blocks, .. }, OpMode::Train) => {
                candle_core::bail!("a {:?} embedding table is for generation; training reads a GGUF's weights dequantised", blocks.dtype())
            }
        };
        match mode {
            OpMode::Train if (w.device().is_cpu() && w.dtype() == DType::F32) || ops::embedding::gpu_takes(w) => {
                ops::embedding::embedding(w, ids, self.pad_token_id, grad_to)
            }
            OpMode::Train => ops::embedding::embedding_composed(w, ids, self.pad_token_id),
            OpMode::Generate => ops::embedding::embedding_composed(w, ids, None),
        }
    }
}

/// `lm_head.weight`, dense (with tied embeddings the very same tensor as the embedding table) or
/// quantised (a GGUF's `output.weight`, or its quantised `token_embd.weight` when tied).
#[derive(Debug, Clone)]
pub enum HeadWeight {
    Dense(Tensor),
    Quantized(QuantizedMatrix),
}

/// The last stage: the final RMSNorm, then the LM head.
#[derive(Debug, Clone)]
pub struct OutputHead {
    norm: RmsNorm,
    weight: HeadWeight,
}

impl OutputHead {
    pub fn new(norm: RmsNorm, weight: HeadWeight) -> Self {
        Self { norm, weight }
    }

    /// The final norm of hidden states (what the head multiplies; what embedding models pool).
    pub fn norm(&self, h: &Tensor, mode: OpMode) -> Result<Tensor> {
        self.norm.forward(h, mode)
    }

    /// Logits (..., vocab) of hidden states (..., hidden).
    pub fn logits(&self, h: &Tensor, mode: OpMode) -> Result<Tensor> {
        let h = self.norm.forward(h, mode)?;
        let head = match &self.weight {
            HeadWeight::Dense(head) => head,
            HeadWeight::Quantized(w) => return LinearWeight::forward_quantized(w, None, &h),
        };
        match mode {
            // One product over all rows, forward and backward (no per-row weight gradients).
            OpMode::Train if ops::applies(&h) && head.dtype() == h.dtype() => ops::linear::linear(&h, head),
            OpMode::Train => h.broadcast_matmul(&head.t()?),
            // Decoding's last positions: the head is the largest matrix, read once per token.
            OpMode::Generate => match ops::gemv::gemv_t(&h, head)? {
                Some(logits) => Ok(logits),
                None => h.broadcast_matmul(&head.t()?),
            },
        }
    }

    /// Training's end: `-log softmax(logits)[target]` per position of (batch, seq, hidden)
    /// states, f32, 0 where the target is negative (`targets` row-major). On the CPU the head
    /// and the cross-entropy run as one op that never holds (positions, vocab) logits
    /// (`ops::head_loss`), handing the head's gradient to `grad_to` when given; on a GPU the
    /// cross-entropy is one op over the logits (`ops::cross_entropy`).
    pub fn losses(&self, h: &Tensor, targets: &[i64], grad_to: Option<WeightGradTarget>) -> Result<Tensor> {
        if let HeadWeight::Dense(head) = &self.weight {
            let normed = self.norm.forward(h, OpMode::Train)?;
            if ops::applies(&normed) && head.dtype() == normed.dtype() {
                let (b, t, hidden) = normed.dims3()?;
                return ops::head_loss::head_cross_entropy(&normed.reshape((b * t, hidden))?, head, targets, grad_to);
            }
        }
        let logits = self.logits(h, OpMode::Train)?;
        if logits.device().is_cuda() && ops::cross_entropy::applies(&logits) {
            // One pass each way over the logits in their dtype (no f32 copy of them).
            let (b, t, vocab) = logits.dims3()?;
            return ops::cross_entropy::cross_entropy_rows(&logits.reshape((b * t, vocab))?, targets);
        }
        per_position_loss(&logits, targets)
    }
}

/// `-log softmax(logits)[target]` per position of (batch, seq, vocab) logits, in f32 (as
/// transformers' loss upcasts), 0 where the target is negative: the composite form of
/// `ops::head_loss` for other devices and dtypes.
fn per_position_loss(logits: &Tensor, targets: &[i64]) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    if targets.len() != b * t {
        candle_core::bail!("{} targets for {} positions", targets.len(), b * t);
    }
    if let Some(l) = targets.iter().find(|&&l| l >= v as i64) {
        candle_core::bail!("label {l} is outside the vocabulary ({v})");
    }
    let dev = logits.device();
    let log_probs = candle_nn::ops::log_softmax(&logits.reshape((b * t, v))?.to_dtype(DType::F32)?, candle_core::D::Minus1)?;
    let index = Tensor::from_vec(targets.iter().map(|&l| l.max(0) as u32).collect::<Vec<_>>(), (b * t, 1), dev)?;
    let mask = Tensor::from_vec(targets.iter().map(|&l| if l < 0 { 0f32 } else { 1.0 }).collect::<Vec<_>>(), b * t, dev)?;
    log_probs.gather(&index, 1)?.squeeze(1)?.neg()? * mask
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::GgmlDType;

    use super::*;

    /// A table kept in blocks gives, for generation, the rows of its dequantised table (in the
    /// compute dtype, for ids of any shape), and refuses training by name.
    #[test]
    fn a_quantized_table_gives_its_dequantized_rows() {
        let table = ops::testing::random_tensor(&[40, 64], 1);
        let ids = Tensor::new(&[[3u32, 0, 39], [7, 7, 12]], &Device::Cpu).unwrap();
        for format in [GgmlDType::Q8_0, GgmlDType::Q4_1, GgmlDType::F16] {
            let q = Arc::new(QTensor::quantize(&table, format).unwrap());
            let dense = TokenEmbedding::new(q.dequantize(&Device::Cpu).unwrap(), None);
            let blocks = TokenEmbedding::quantized(q, DType::F32, None);
            assert_eq!((blocks.dtype(), blocks.device().is_cpu()), (DType::F32, true));
            let rows = |e: &TokenEmbedding| e.forward(&ids, OpMode::Generate, None).unwrap();
            let (got, want) = (rows(&blocks), rows(&dense));
            assert_eq!(got.dims(), [2, 3, 64]);
            assert_eq!(
                got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                "{format:?}"
            );
            let e = blocks.forward(&ids, OpMode::Train, None).unwrap_err().to_string();
            assert!(e.contains("embedding table is for generation"), "{e}");
        }
    }
}
