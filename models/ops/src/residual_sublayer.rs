//! A pre-norm residual sublayer of a decoder block for training, `x + f(rms_norm(x, w)) · W_outᵀ`,
//! as one candle op on (x, w): Llama's attention half (f the q/k/v products, rotations and
//! attention, W_out o_proj) and its MLP half (f the gated MLP, W_out down_proj).
//!
//! Composed of the ops that make it (`fused::rms_norm`, f's op, `linear::linear_add_to`),
//! candle's backward sums the gradient reaching each graph node into a zeroed tensor first: the
//! normed input's, f's output's ((tokens x intermediate) in the MLP) and x's two (the norm's
//! and the residual's). On a GPU those zeroed tensors and sums (`badd`) were a fifth of a
//! batch-8 training step's kernel time (docs/gpu.md). Here the parts run outside the graph and
//! the op keeps them: its backward runs each part's backward in turn, adds x's two gradients
//! in one sum, and the only gradient candle's backward sums is x's, once. The values are those
//! of the composed ops: the same ops run, in the same order.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use crate::fused::{rms_norm, rms_norm_grads};
use crate::linear::LinearAdd;
use crate::weight_grads::WeightGradTarget;

/// Whether the model takes these ops where they apply: `FSDP_SUBLAYER_OPS=0` keeps the composed
/// ops, for comparisons (or to get past a failure on a device this machine could not test).
pub fn enabled() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !*OFF.get_or_init(|| std::env::var("FSDP_SUBLAYER_OPS").is_ok_and(|v| v == "0"))
}

/// The backward of a sublayer's inside: its output's gradient to its input's (its weights'
/// gradients go to their sinks).
type InsideBackward = Box<dyn FnOnce(&Tensor) -> Result<Tensor> + Send + Sync>;

/// A sublayer's inside f run on the normed input outside candle's graph: its output, and its
/// backward, kept for the sublayer's.
pub struct Inside {
    out: Tensor,
    backward: InsideBackward,
}

impl Inside {
    fn new(out: Tensor, backward: impl FnOnce(&Tensor) -> Result<Tensor> + Send + Sync + 'static) -> Self {
        Self { out, backward: Box::new(backward) }
    }

    /// `op` on `x` outside the graph; its backward is the op's own, for x.
    pub(crate) fn of_op1(x: &Tensor, op: impl CustomOp1 + Send + Sync + 'static) -> Result<Self> {
        let op: Arc<Box<dyn CustomOp1 + Send + Sync>> = Arc::new(Box::new(op));
        let x = x.detach().contiguous()?;
        let out = x.apply_op1_arc(op.clone())?;
        Ok(Self::ran_op1(x, out, op))
    }

    /// `op`, which made `out` from `x` outside the graph (by candle or by itself): its backward
    /// is the op's own, for x.
    pub(crate) fn ran_op1(x: Tensor, out: Tensor, op: Arc<Box<dyn CustomOp1 + Send + Sync>>) -> Self {
        let kept = out.clone();
        Self::new(out, move |g| match op.bwd(&x, &kept, g)? {
            Some(dx) => Ok(dx),
            None => candle_core::bail!("{}: no gradient for its input", op.name()),
        })
    }

    /// `op` on x and two weights outside the graph (the weights as the model holds them: the
    /// op's backward asks them whether they train). Their gradients must go to sinks.
    pub(crate) fn of_op3(x: &Tensor, [a, b]: [&Tensor; 2], op: impl CustomOp3 + Send + Sync + 'static) -> Result<Self> {
        let op: Arc<Box<dyn CustomOp3 + Send + Sync>> = Arc::new(Box::new(op));
        let (x, a, b) = (x.detach().contiguous()?, a.contiguous()?, b.contiguous()?);
        let out = x.apply_op3_arc(&a.detach(), &b.detach(), op.clone())?;
        let kept = out.clone();
        Ok(Self::new(out, move |g| match op.bwd(&x, &a, &b, &kept, g)? {
            (Some(dx), None, None) => Ok(dx),
            (None, _, _) => candle_core::bail!("{}: no gradient for its input", op.name()),
            _ => candle_core::bail!("{}: a weight gradient with nowhere to go", op.name()),
        }))
    }
}

/// `x + inside(rms_norm(x, norm_weight)) · w_outᵀ` for x (.., hidden), one candle op on x and the
/// norm's weight. `inside` gets the normed x outside the graph and keeps its own backward
/// ([`Inside`]); `w_out` is the output projection's weight (hidden, inner) as the model holds it,
/// with its gradient's sink, which it needs if it trains. x or the norm's weight must be in the
/// graph. Where the fused RMSNorm takes x
/// (`fused::rms_norm_applies`) and `linear::linear_add_to` the product.
pub fn prenorm_residual(
    x: &Tensor,
    norm_weight: &Tensor,
    eps: f64,
    inside: impl FnOnce(&Tensor) -> Result<Inside>,
    (w_out, grad_to): (Tensor, Option<WeightGradTarget>),
) -> Result<Tensor> {
    if w_out.track_op() && grad_to.is_none() {
        candle_core::bail!("residual sublayer: an output weight {:?} that trains has no gradient sink", w_out.dims());
    }
    // Outside the graph the op's backward, which makes every weight's gradient, would never run.
    if !x.track_op() && !norm_weight.track_op() {
        candle_core::bail!("residual sublayer: an input and a norm weight outside the graph (the op is for training)");
    }
    let x = x.contiguous()?;
    let normed = rms_norm(&x.detach(), &norm_weight.detach(), eps)?;
    let inside = inside(&normed)?;
    let op = PrenormResidual {
        eps: eps as f32,
        inside_out: inside.out.contiguous()?,
        backward: Mutex::new(Some(inside.backward)),
        w_out: w_out.contiguous()?,
        grad_to,
    };
    x.apply_op2(&norm_weight.contiguous()?, op)
}

struct PrenormResidual {
    eps: f32,
    /// The inside's output, what W_out multiplies.
    inside_out: Tensor,
    /// The inside's backward, taken by the op's (one backward per forward, as training runs it).
    backward: Mutex<Option<InsideBackward>>,
    w_out: Tensor,
    grad_to: Option<WeightGradTarget>,
}

impl CustomOp2 for PrenormResidual {
    fn name(&self) -> &'static str {
        "prenorm-residual-sublayer"
    }

    /// x + inside · W_outᵀ, by `linear_add_to`'s forward with x as its residual (the inside and
    /// the norm ran before the op joined the graph).
    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        let ((is, il), (ws, wl)) = (self.inside_out.storage_and_layout(), self.w_out.storage_and_layout());
        let (candle_core::Storage::Cpu(is), candle_core::Storage::Cpu(ws)) = (&*is, &*ws) else {
            candle_core::bail!("residual sublayer: the inside's output or W_out is not on the CPU")
        };
        LinearAdd { grad_to: None }.cpu_fwd(is, il, ws, wl, xs, xl)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let ((is, il), (ws, wl)) = (self.inside_out.storage_and_layout(), self.w_out.storage_and_layout());
        let (candle_core::Storage::Cuda(is), candle_core::Storage::Cuda(ws)) = (&*is, &*ws) else {
            candle_core::bail!("residual sublayer: the inside's output or W_out is not on the GPU")
        };
        LinearAdd { grad_to: None }.cuda_fwd(is, il, ws, wl, xs, xl)
    }

    /// The product's backward (W_out's gradient to its sink), the inside's, the norm's, then x's
    /// gradient as the residual's plus the norm's.
    fn bwd(&self, x: &Tensor, w: &Tensor, y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let backward = self.backward.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(backward) = backward else { candle_core::bail!("residual sublayer: a second backward through the same forward") };
        let linear_add = LinearAdd { grad_to: self.grad_to.clone() };
        let d_inside = match linear_add.bwd(&self.inside_out, &self.w_out, x, y, g)? {
            (Some(d), None, _) => d,
            _ => candle_core::bail!("residual sublayer: W_out's gradient with nowhere to go"),
        };
        let d_normed = backward(&d_inside)?;
        drop(d_inside);
        let (dx_norm, dw) = rms_norm_grads(x, w, &d_normed, self.eps)?;
        // x reached the output twice: through the residual (g itself) and through the norm.
        let dx = (g + dx_norm)?;
        Ok((Some(dx), w.track_op().then_some(dw)))
    }
}
