//! A Llama attention layer's inside for training on a GPU, from its normed input to what o_proj
//! takes, as one candle op on x: the q, k and v products (cuBLAS, token-major), RoPE on q and k
//! (our kernel) and flash attention (our kernels, `flash_attention`). As six ops (three
//! products, two rotations, the attention) candle's backward adds the gradient that reaches each
//! of q, k, v and the rotated q and k to a zeroed tensor first, (tokens x hidden) or (tokens x
//! kv width) each: on the H200 those sums (`badd_bf16`) were a fifth of a batch-8 step's kernel
//! time (docs/gpu.md). Here x's gradient is the only tensor candle's backward sums: q, k and v
//! are never graph nodes (the op keeps them, with the attention's log-sum-exp, for its
//! backward), and the weights' gradients go to their sinks, as in the CPU's `self_attention`.
//! The values are those of the six ops: the same products, rotation and kernels.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use crate::flash_attention::{attention_token_major_kept, KeptAttention, Visibility};
use crate::fused::{rope_token_major, rope_token_major_inverse};
use crate::linear::{input_grad_by_matmul, linear_heads_to, weight_grad};
use crate::residual_sublayer::Inside;
use crate::self_attention::Projection;

/// Whether the model takes this op where it applies: `FSDP_FLASH_SELF_ATTENTION=0` keeps the six
/// ops instead, for comparisons on a GPU.
pub fn enabled() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !*OFF.get_or_init(|| std::env::var("FSDP_FLASH_SELF_ATTENTION").is_ok_and(|v| v == "0"))
}

/// `flash_attention::attention_token_major(rope(x W_qᵀ), rope(x W_kᵀ), x W_vᵀ)` for x (batch,
/// seq, in) on a GPU: (batch, seq, heads · head_dim), with `heads` (query, kv) heads, RoPE tables
/// `cos`/`sin` (seq, head_dim / 2), `visibility` and `scale` on the scores. Each weight must send
/// its gradient to a sink or train nothing, and x must be in the graph where a weight trains
/// (else the op would never run its backward). Where the flash kernels take x and rope's kernel
/// the tables (the caller checks: `flash_attention::takes`, `fused::rope_applies`).
pub fn self_attention(
    x: &Tensor,
    projections: [Projection; 3],
    heads: (usize, usize),
    rope: (&Tensor, &Tensor),
    visibility: Visibility,
    scale: f64,
) -> Result<Tensor> {
    check(x, &projections, heads)?;
    if projections.iter().any(|(w, _)| w.track_op()) && !x.track_op() {
        candle_core::bail!(
            "flash self-attention: weights that train over an input outside the graph (their gradients would never be made)"
        );
    }
    let (out, op) = FlashSelfAttention::run(x, projections, heads, rope, visibility, scale)?;
    if !x.track_op() {
        return Ok(out);
    }
    *op.out.lock().unwrap_or_else(|e| e.into_inner()) = Some(out);
    x.apply_op1(op)
}

/// [`self_attention`] outside candle's graph, kept for its backward: the inside of the
/// attention's residual sublayer (`residual_sublayer`), which runs this backward itself. Each
/// weight that trains needs a sink.
pub fn self_attention_inside(
    x: &Tensor,
    projections: [Projection; 3],
    heads: (usize, usize),
    rope: (&Tensor, &Tensor),
    visibility: Visibility,
    scale: f64,
) -> Result<Inside> {
    check(x, &projections, heads)?;
    let (out, op) = FlashSelfAttention::run(x, projections, heads, rope, visibility, scale)?;
    Ok(Inside::ran_op1(x.detach(), out, Arc::new(Box::new(op))))
}

/// The weights' shapes fit the heads and x, and each weight that trains has a sink.
fn check(x: &Tensor, projections: &[Projection; 3], (hq, hkv): (usize, usize)) -> Result<()> {
    let [q, k, v] = projections;
    let (_, _, in_dim) = x.dims3()?;
    let q_out = q.0.dim(0)?;
    let d = q_out.checked_div(hq).unwrap_or(0);
    let fits = |w: &Tensor, out: usize| w.dims() == [out, in_dim];
    if hq == 0 || hkv == 0 || hq % hkv != 0 || q_out != hq * d || !fits(&q.0, q_out) || !fits(&k.0, hkv * d) || !fits(&v.0, hkv * d) {
        candle_core::bail!(
            "flash self-attention: weights {:?}, {:?}, {:?} for {hq} query and {hkv} kv heads of an input {:?}",
            q.0.dims(),
            k.0.dims(),
            v.0.dims(),
            x.dims()
        );
    }
    if let Some((w, _)) = projections.iter().find(|(w, to)| w.track_op() && to.is_none()) {
        candle_core::bail!("flash self-attention: a weight {:?} that trains has no gradient sink", w.dims());
    }
    Ok(())
}

struct FlashSelfAttention {
    /// The weights as the model holds them (whether each trains) and their sinks.
    projections: [Projection; 3],
    rope: (Tensor, Tensor),
    /// The attention's output, made before the op joined the graph; its forward hands it out.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    out: Mutex<Option<Tensor>>,
    /// The attention's forward, its inputs and log-sum-exp, for the backward (which takes it:
    /// one backward per forward, as training runs it).
    kept: Mutex<Option<KeptAttention>>,
}

impl FlashSelfAttention {
    /// The three products, the rotations and the attention outside the graph: the output and
    /// the op that keeps what its backward needs.
    fn run(
        x: &Tensor,
        projections: [Projection; 3],
        (hq, hkv): (usize, usize),
        (cos, sin): (&Tensor, &Tensor),
        visibility: Visibility,
        scale: f64,
    ) -> Result<(Tensor, Self)> {
        let xd = x.detach();
        let project = |(w, _): &Projection, heads: usize| linear_heads_to(&xd, &w.detach(), heads, None);
        let qr = rope_token_major(&project(&projections[0], hq)?, cos, sin)?;
        let kr = rope_token_major(&project(&projections[1], hkv)?, cos, sin)?;
        let v = project(&projections[2], hkv)?;
        let (out, kept) = attention_token_major_kept(&qr, &kr, &v, visibility, scale)?;
        let op = Self { projections, rope: (cos.detach(), sin.detach()), out: Mutex::new(None), kept: Mutex::new(Some(kept)) };
        Ok((out, op))
    }
}

impl CustomOp1 for FlashSelfAttention {
    fn name(&self) -> &'static str {
        "fused-self-attention-flash"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("flash self-attention runs on a GPU only (the CPU's is `self_attention`)")
    }

    /// The output made in [`self_attention`], copied into the op's own storage (candle's op
    /// hands back storage it owns).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, _: &candle_core::CudaStorage, _: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let out = self.out.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(out) = out else { candle_core::bail!("flash self-attention: a second forward of one op") };
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            candle_core::Storage::Cuda(s) => Ok((s.try_clone(layout)?, out.shape().clone())),
            _ => candle_core::bail!("flash self-attention: the attention's output is not on the GPU"),
        }
    }

    /// The attention's backward (dq, dk, dv), RoPE's inverse on dq and dk, then x's gradient as
    /// one sum of the three products and each weight's gradient to its sink.
    fn bwd(&self, x: &Tensor, _out: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        // The kept forward (its q, k, v and log-sum-exp) goes once its gradients are made.
        let (dq, dk, dv) = match self.kept.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(kept) => kept.backward(g)?,
            None => candle_core::bail!("flash self-attention: a second backward through the same forward"),
        };
        let (cos, sin) = &self.rope;
        let grads = [rope_token_major_inverse(&dq, cos, sin)?, rope_token_major_inverse(&dk, cos, sin)?, dv];
        drop((dq, dk));
        let x = x.detach();
        let (b, t, _) = x.dims3()?;
        let mut dx: Option<Tensor> = None;
        for ((w, to), gy) in self.projections.iter().zip(grads) {
            // (b, t, heads, head_dim) as the product's (b, t, out).
            let gy = gy.reshape((b, t, w.dim(0)?))?;
            let part = input_grad_by_matmul(&gy, &w.detach(), x.dims())?;
            dx = Some(match dx {
                None => part,
                Some(sum) => (sum + part)?,
            });
            if weight_grad(&x, w, gy, to.as_ref())?.is_some() {
                candle_core::bail!("flash self-attention: a weight gradient with nowhere to go");
            }
        }
        Ok(dx)
    }
}
