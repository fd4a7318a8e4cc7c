//! Attention of new positions' queries over a layer's cached blocks, read in place: on the CPU
//! (`kernels::paged_attention`) one query by the decode kernel, more by the tiled prefill; on a
//! GPU one query by `flash_attention`'s decode kernel.

use candle_core::{DType, Device, Layout, Result, StorageRef, Tensor};
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
    if !cpu_kernels_apply(q, std::iter::once(blocks)) {
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
    let guards = BlockGuards::of(blocks);
    let blocks = guards.slices()?;
    let kv = KvView { blocks: &blocks, kv_heads, head_dim: d, len };
    let out = match t {
        1 => decode::attend_one(q, heads, &kv, scale as f32, window),
        _ => prefill::attend_chunk(q, heads, t, &kv, scale as f32, window),
    };
    Ok(Some(Tensor::from_vec(out, (1, t, heads * d), &Device::Cpu)?))
}

/// A decode step of several sequences on the CPU in f32: row `r` of `q` (rows, heads, 1,
/// head_dim) is the query of the last of the `caches[r].1` positions cached in `caches[r].0`
/// (as [`attend`] takes them), all rows attended in one parallel region: (rows, 1, heads ·
/// head_dim), each row as [`attend`] gives it alone. `None` when the call is not for this kernel
/// (not f32 on the CPU, or a graph to keep): the caller then attends row by row.
pub fn attend_rows(q: &Tensor, caches: &[(&[(Tensor, Tensor)], usize)], scale: f64, window: Option<usize>) -> Result<Option<Tensor>> {
    if !cpu_kernels_apply(q, caches.iter().map(|&(blocks, _)| blocks)) {
        return Ok(None);
    }
    let (rows, heads, t, d) = q.dims4()?;
    if t != 1 || rows != caches.len() {
        candle_core::bail!("KV cache attention of rows: queries {:?} for {} caches, one query a row", q.dims(), caches.len());
    }
    let kv_heads = caches[0].0[0].0.dim(0)?;
    if let Some((_, len)) = caches.iter().find(|(blocks, len)| *len == 0 || blocks[0].0.dims() != caches[0].0[0].0.dims()) {
        candle_core::bail!("KV cache attention of rows: a cache of {len} positions, or of another block shape than the first's");
    }
    if heads % kv_heads != 0 {
        candle_core::bail!("KV cache attention of rows: {heads} heads over {kv_heads} kv heads");
    }
    let q = q.contiguous()?;
    let (q_storage, q_layout) = q.storage_and_layout();
    let q = cpu_f32_values(&q_storage, q_layout)?;
    let guards: Vec<BlockGuards> = caches.iter().map(|(blocks, _)| BlockGuards::of(blocks)).collect();
    let slices: Vec<Vec<(&[f32], &[f32])>> = guards.iter().map(BlockGuards::slices).collect::<Result<_>>()?;
    let kvs: Vec<KvView> = slices.iter().zip(caches).map(|(blocks, &(_, len))| KvView { blocks, kv_heads, head_dim: d, len }).collect();
    let out = decode::attend_rows(q, heads, &kvs, scale as f32, window);
    Ok(Some(Tensor::from_vec(out, (rows, 1, heads * d), &Device::Cpu)?))
}

/// Whether the CPU kernels take `q` over `caches` (each a layer's cached blocks): f32 on the
/// CPU, at least one block in each cache, and no graph to keep.
fn cpu_kernels_apply<'a>(q: &Tensor, mut caches: impl Iterator<Item = &'a [(Tensor, Tensor)]>) -> bool {
    let cpu_f32 = |t: &Tensor| matches!(t.device(), Device::Cpu) && t.dtype() == DType::F32;
    !q.track_op() && cpu_f32(q) && caches.all(|blocks| blocks.first().is_some_and(|(k, _)| cpu_f32(k)))
}

/// The storages of a layer's cached blocks, held while the kernels read them in place.
struct BlockGuards<'a>(Vec<StorageGuards<'a>>);

type StorageGuards<'a> = ((StorageRef<'a>, &'a Layout), (StorageRef<'a>, &'a Layout));

impl<'a> BlockGuards<'a> {
    fn of(blocks: &'a [(Tensor, Tensor)]) -> Self {
        Self(blocks.iter().map(|(k, v)| (k.storage_and_layout(), v.storage_and_layout())).collect())
    }

    /// Each block's keys and values as f32 slices.
    fn slices(&self) -> Result<Vec<(&[f32], &[f32])>> {
        self.0.iter().map(|((k, kl), (v, vl))| Ok((cpu_f32_values(k, kl)?, cpu_f32_values(v, vl)?))).collect()
    }
}
