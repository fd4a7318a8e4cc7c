//! Attention of new positions' queries over a layer's cached blocks, read in place: on the CPU
//! (`kernels::paged_attention`) one query by the decode kernel, more by the tiled prefill; on a
//! GPU one query by `flash_attention`'s decode kernel.

use candle_core::{DType, Device, Result, Tensor};
use kernels::paged_attention::{decode, prefill, KvView};

use crate::cpu_f32_values;

/// Attention of the newest `t` positions' queries `q` (1, heads, t, head_dim) over the first
/// `len` cached positions in `blocks` (keys and values, each (kv_heads, BLOCK, head_dim),
/// contiguous), each query seeing itself and the positions before it (the last `window` of
/// them when set): (1, t, heads · head_dim), token-major. `None` when the call is not for these
/// kernels (not f32 on the CPU nor one query the GPU's decode kernel takes, or a graph to keep):
/// the caller then attends with candle's ops.
pub fn attend(q: &Tensor, blocks: &[(Tensor, Tensor)], len: usize, scale: f64, window: Option<usize>) -> Result<Option<Tensor>> {
    let kv_heads = blocks.first().map(|(k, _)| k.dim(0)).transpose()?;
    if kv_heads.is_some_and(|h| !q.track_op() && crate::flash_attention::decode_applies(q, h)) {
        return crate::flash_attention::decode(q, None, &[(blocks, len)], scale, window).map(Some);
    }
    let cpu_f32 = |t: &Tensor| matches!(t.device(), Device::Cpu) && t.dtype() == DType::F32;
    if !cpu_f32(q) || blocks.first().is_none_or(|(k, _)| !cpu_f32(k)) || q.track_op() {
        return Ok(None);
    }
    let (_, heads, t, d) = q.dims4()?;
    let kv_heads = blocks[0].0.dim(0)?;
    if t > len || heads % kv_heads != 0 {
        candle_core::bail!("KV cache attention: {t} queries of {heads} heads over {len} positions of {kv_heads} kv heads");
    }
    // Read in place: a prompt's queries are megabytes a layer, a copy a pass on one thread.
    let q = q.contiguous()?;
    let (q_storage, q_layout) = q.storage_and_layout();
    let q = cpu_f32_values(&q_storage, q_layout)?;
    let guards: Vec<_> = blocks.iter().map(|(k, v)| (k.storage_and_layout(), v.storage_and_layout())).collect();
    let blocks: Vec<(&[f32], &[f32])> =
        guards.iter().map(|((k, kl), (v, vl))| Ok((cpu_f32_values(k, kl)?, cpu_f32_values(v, vl)?))).collect::<Result<_>>()?;
    let kv = KvView { blocks: &blocks, kv_heads, head_dim: d, len };
    let out = match t {
        1 => decode::attend_one(q, heads, &kv, scale as f32, window),
        _ => prefill::attend_chunk(q, heads, t, &kv, scale as f32, window),
    };
    Ok(Some(Tensor::from_vec(out, (1, t, heads * d), &Device::Cpu)?))
}
