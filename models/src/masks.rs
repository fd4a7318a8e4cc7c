//! The additive attention masks: causal (with an optional sliding window) and packed rows.

use candle_core::{DType, Device, Result, Tensor};

/// Builds the causal (optionally sliding-window) additive mask for queries at positions
/// `offset..offset+q_len` over keys `0..offset+q_len`.
pub fn causal_mask(q_len: usize, offset: usize, window: Option<usize>, dtype: DType, dev: &Device) -> Result<Option<Tensor>> {
    let kv_len = offset + q_len;
    let blocked = |i: usize, j: usize| {
        let qpos = offset + i;
        j > qpos || window.is_some_and(|w| qpos - j.min(qpos) >= w)
    };
    let any_blocked = (0..q_len).any(|i| (0..kv_len).any(|j| blocked(i, j)));
    if !any_blocked {
        return Ok(None);
    }
    let data: Vec<f32> = (0..q_len).flat_map(|i| (0..kv_len).map(move |j| if blocked(i, j) { f32::NEG_INFINITY } else { 0.0 })).collect();
    Tensor::from_vec(data, (q_len, kv_len), dev)?.to_dtype(dtype).map(Some)
}

/// Additive mask (batch, 1, seq, seq) for packed rows: a token sees earlier tokens of its own
/// document only (segment ids per token; 0 marks padding, which sees only itself).
pub fn packed_mask(segments: &[u32], batch: usize, seq: usize, window: Option<usize>, dtype: DType, dev: &Device) -> Result<Tensor> {
    let mut data = Vec::with_capacity(batch * seq * seq);
    for b in 0..batch {
        let seg = &segments[b * seq..(b + 1) * seq];
        for i in 0..seq {
            for j in 0..seq {
                let visible = j <= i && (seg[i] == seg[j] && (seg[i] != 0 || i == j)) && window.is_none_or(|w| i - j < w);
                data.push(if visible { 0.0f32 } else { f32::NEG_INFINITY });
            }
        }
    }
    Tensor::from_vec(data, (batch, 1, seq, seq), dev)?.to_dtype(dtype)
}
