//! The CPU's attention as the GPU kernels' tests (tests/cuda/, tests/cuda_emulated.rs) take
//! it for reference.

use candle_core::{DType, Device, Result, Tensor};

/// Eager attention on the CPU in f32 of q (batch, heads, T, d) over k, v (batch, kv_heads, S, d),
/// each kv head repeated for its group of query heads, under the model's causal mask (queries at
/// the end of the keys, with `window`) when `causal`: (batch, heads, T, d). Differentiable.
pub fn reference_attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, window: Option<usize>, scale: f64) -> Result<Tensor> {
    let (b, h, t, d) = q.dims4()?;
    let (_, hkv, s, _) = k.dims4()?;
    let repeat = |x: &Tensor| x.to_dtype(DType::F32)?.unsqueeze(2)?.broadcast_as((b, hkv, h / hkv, s, d))?.reshape((b, h, s, d));
    let mask = if causal { models::masks::causal_mask(t, s - t, window, DType::F32, &Device::Cpu)? } else { None };
    ops::eager_attention::attention(&q.to_dtype(DType::F32)?, &repeat(k)?, &repeat(v)?, mask.as_ref(), scale)
}
