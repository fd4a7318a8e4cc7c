//! The training objective, kept out of the FSDP engine as torchtitan keeps the loss out of
//! `parallelize`: next-token cross-entropy, summed over the target tokens of a micro-batch
//! (the trainer scales the gradients by 1 / the step's target tokens). The model computes the
//! per-position losses itself when it is given the targets (`StageContext::targets`), as
//! transformers' models return the loss when given labels: on the CPU its head and
//! cross-entropy then run as one op that never holds (positions, vocab) logits.

use std::sync::Arc;

use candle_core::{Result, Tensor};

use crate::train::data::IGNORE_INDEX;

/// Next-token targets of a (rows, width) micro-batch whose labels are aligned with its inputs
/// (the shift happens here, as in transformers): position i predicts label i + 1; the last
/// position of each row predicts nothing.
pub fn next_token_targets(labels: &[i64], rows: usize, width: usize) -> Arc<[i64]> {
    debug_assert_eq!(labels.len(), rows * width);
    (0..rows * width).map(|i| if i % width == width - 1 { IGNORE_INDEX } else { labels[i + 1] }).collect()
}

/// The micro-batch's loss: the sum of the per-position losses the last stage returned.
pub fn summed_token_loss(per_position: &Tensor) -> Result<Tensor> {
    if per_position.rank() != 1 {
        candle_core::bail!(
            "expected per-position losses from the last stage, got shape {:?} (were the targets given?)",
            per_position.dims()
        );
    }
    per_position.sum_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_shift_by_one_within_each_row() {
        let labels = [1, 2, 3, -100, 5, 6];
        assert_eq!(&*next_token_targets(&labels, 2, 3), &[2, 3, -100, 5, 6, -100]);
        let logits = Tensor::zeros((1, 3, 4), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        assert!(summed_token_loss(&logits).unwrap_err().to_string().contains("per-position"));
    }
}
