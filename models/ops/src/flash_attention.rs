//! Attention on a GPU's tensor cores without the (batch × heads × T × S) scores in memory:
//! FlashAttention-2's forward and backward as kernels of our own (`flash_attention_cuda`), for
//! the masks a model can describe instead of materialise (causal, with an offset over a cache and
//! a sliding window), GQA without repeating k and v, bf16 and f16, head dims 64 and 128. The
//! same op serves training (with its backward) and prefill; [`decode`] is one new query per
//! sequence over the KV cache's blocks, every sequence of a decoding step in one launch.
//!
//! Eager attention (`eager_attention`) stays for what this does not take: the CPU, f32, packed
//! rows (whose mask is per document), other head dims.

use candle_core::{DType, Result, Tensor};

pub use crate::visibility::Visibility;

/// The head dims the kernels are built for (`flash_attention.cu`'s instantiations).
pub const HEAD_DIMS: [usize; 2] = [64, 128];

/// Whether [`attention`] takes q (batch, heads, T, d) over `kv_heads` heads of k and v: a GPU
/// (built with the `cuda` feature), bf16 or f16, a head dim of [`HEAD_DIMS`], heads a multiple of
/// kv_heads. `FSDP_FLASH_ATTENTION=0` turns it off (eager attention instead), for comparisons.
pub fn applies(q: &Tensor, kv_heads: usize) -> bool {
    q.dims4().is_ok_and(|(_, heads, _, d)| takes(q, heads, d, kv_heads))
}

/// Whether the kernels take `heads` query and `kv_heads` kv heads of `d` values in tensors of x's
/// device and dtype: [`applies`] before the heads exist (for [`attention_token_major`] too).
pub fn takes(x: &Tensor, heads: usize, d: usize, kv_heads: usize) -> bool {
    static TURNED_OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *TURNED_OFF.get_or_init(|| std::env::var("FSDP_FLASH_ATTENTION").is_ok_and(|v| v == "0"));
    let on = cfg!(feature = "cuda") && !off;
    on && x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && HEAD_DIMS.contains(&d)
        && kv_heads > 0
        && heads.is_multiple_of(kv_heads)
}

/// Attention of q (batch, heads, T, d) over k, v (batch, kv_heads, S, d) with `visibility` and
/// `scale` on the scores: (batch, heads, T, d), with its backward when an input trains. Only
/// where [`applies`] says so.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, visibility: Visibility, scale: f64) -> Result<Tensor> {
    checked(q, k, v, visibility, scale, false)
}

/// [`attention`] over q (batch, T, heads, d) and k, v (batch, S, kv_heads, d), token-major as
/// the projections make them: (batch, T, heads · d), what o_proj reads, with no transposes (nor
/// their copies and backward nodes) on either side. Only where [`takes`] says so.
pub fn attention_token_major(q: &Tensor, k: &Tensor, v: &Tensor, visibility: Visibility, scale: f64) -> Result<Tensor> {
    checked(q, k, v, visibility, scale, true)
}

/// [`attention_token_major`] of inputs whose gradients the caller makes itself: the output and
/// the kept forward, whose [`KeptAttention::backward`] gives (dq, dk, dv) for an output
/// gradient. No node of candle's graph (the inputs are read detached).
pub fn attention_token_major_kept(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    visibility: Visibility,
    scale: f64,
) -> Result<(Tensor, KeptAttention)> {
    check(q, k, v, visibility, true)?;
    #[cfg(feature = "cuda")]
    {
        super::flash_attention_cuda::attention_kept(q, k, v, visibility, scale, true)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = scale;
        unreachable!("takes() is false without the cuda feature")
    }
}

/// A forward of [`attention_token_major_kept`] (`flash_attention_cuda::Kept`; none exists
/// without the `cuda` feature).
#[cfg(feature = "cuda")]
pub use super::flash_attention_cuda::Kept as KeptAttention;

/// A forward of [`attention_token_major_kept`] (none exists without the `cuda` feature).
#[cfg(not(feature = "cuda"))]
pub enum KeptAttention {}

#[cfg(not(feature = "cuda"))]
impl KeptAttention {
    /// (dq, dk, dv) for `dout`.
    pub fn backward(&self, _dout: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        match *self {}
    }
}

fn checked(q: &Tensor, k: &Tensor, v: &Tensor, visibility: Visibility, scale: f64, token_major: bool) -> Result<Tensor> {
    check(q, k, v, visibility, token_major)?;
    #[cfg(feature = "cuda")]
    {
        super::flash_attention_cuda::attention(q, k, v, visibility, scale, token_major)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (scale, token_major);
        unreachable!("takes() is false without the cuda feature")
    }
}

/// The problem as the kernels take it, or an error naming what they do not take.
fn check(q: &Tensor, k: &Tensor, v: &Tensor, visibility: Visibility, token_major: bool) -> Result<()> {
    let ((b, t, h, d), (kb, s, kvh, kd)) = match token_major {
        true => (q.dims4()?, k.dims4()?),
        false => {
            let ((b, h, t, d), (kb, kvh, s, kd)) = (q.dims4()?, k.dims4()?);
            ((b, t, h, d), (kb, s, kvh, kd))
        }
    };
    if !takes(q, h, d, kvh) || (kb, kd) != (b, d) || v.dims() != k.dims() || k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        candle_core::bail!(
            "flash attention: q {:?} {:?}, k {:?} {:?}, v {:?} {:?} on {:?} (a GPU, bf16 or f16, head dim {HEAD_DIMS:?}, \
             heads a multiple of kv heads; token-major {token_major})",
            q.dims(),
            q.dtype(),
            k.dims(),
            k.dtype(),
            v.dims(),
            v.dtype(),
            q.device().location()
        );
    }
    if visibility.causal && visibility.offset + t != s {
        candle_core::bail!("flash attention: {t} causal queries at offset {} over {s} keys", visibility.offset);
    }
    let fits = |n: usize| i32::try_from(n).is_ok();
    if !fits(b * h * t.max(s)) || !fits(visibility.offset) || !fits(visibility.window.unwrap_or(0)) {
        candle_core::bail!("flash attention: q {:?} over {s} keys is too large for the kernels' 32-bit counts", q.dims());
    }
    Ok(())
}

/// Whether [`decode`] takes q (sequences, heads, 1, d) over caches of `kv_heads` heads: where
/// [`applies`] does, one position a sequence.
pub fn decode_applies(q: &Tensor, kv_heads: usize) -> bool {
    q.dims4().is_ok_and(|(_, _, t, _)| t == 1) && applies(q, kv_heads)
}

/// One new query per sequence, q (sequences, heads, 1, d), over each sequence's cached blocks,
/// where [`decode_applies`]: (sequences, 1, heads · d). `caches` holds per sequence its blocks
/// ((keys, values), each (kv_heads, 64, d), `models::kv_cache`'s layout) and its length, the new
/// position last; with `new` ((sequences, kv_heads, 1, d) keys and values) the kernel writes the
/// new position first (the caches counted it without writing it). `window` as the model's sliding
/// window.
pub fn decode(
    q: &Tensor,
    new: Option<(&Tensor, &Tensor)>,
    caches: &[(&[(Tensor, Tensor)], usize)],
    scale: f64,
    window: Option<usize>,
) -> Result<Tensor> {
    let kv_heads = caches.first().and_then(|(blocks, _)| blocks.first()).map(|(k, _)| k.dim(0)).transpose()?.unwrap_or(0);
    if !decode_applies(q, kv_heads) || q.dim(0)? != caches.len() {
        candle_core::bail!(
            "flash decode: q {:?} {:?} on {:?} over {} caches of {kv_heads} kv heads (a GPU, bf16 or f16, head dim {HEAD_DIMS:?}, one position)",
            q.dims(),
            q.dtype(),
            q.device().location(),
            caches.len()
        );
    }
    #[cfg(feature = "cuda")]
    {
        super::flash_attention_cuda::decode(q, new, (caches, kv_heads), scale, window)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (new, scale, window);
        unreachable!("applies() is false without the cuda feature")
    }
}
