//! Eager attention for training off the CPU's fused path (GPUs, and dtypes other than f32): the
//! same forward as composing candle's ops (`q kᵀ · scale + mask`, softmax in f32, `· v`), as
//! one op in the graph with its own backward.
//!
//! Composed from candle's ops, every (batch × heads × T × T) intermediate is a node of the
//! graph, kept until the backward, which gives each one a zeroed gradient tensor to add into.
//! As one op, the graph keeps only q, k, v and the output: on an H200 the 1.1B Llama's step
//! (T = 2048, checkpointed) used 23.0 GiB instead of 26.4, in the same time
//! (`tests/gpu/run.sh bench`). The backward recomputes the probabilities and makes the
//! gradients as `dv = pᵀ dout`, `dp = dout vᵀ`, `ds = p ∘ (dp − rowsum(dout ∘ out))`,
//! `dq = ds k · scale`, `dk = dsᵀ q · scale` (rowsum(dp ∘ p) = rowsum(dout ∘ out),
//! FlashAttention's identity, is a sum over head_dim instead of T).
//!
//! On a GPU (f32 and bf16) the softmax and the backward's `ds` are kernels of our own
//! (`attention_softmax_cuda`): one pass over the scores each instead of candle's scale, mask,
//! casts and softmax (forward) and casts, subtraction and product (backward).

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, D};

/// Attention of `q` (batch, heads, T, d) over `k`, `v` (batch, heads, S, d), all contiguous and
/// of one dtype, with an additive `mask` broadcast to the scores; (batch, heads, T, d).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, scale: f64) -> Result<Tensor> {
    if !q.device().is_cpu() {
        let (b, h, t, _) = q.dims4()?;
        check_gpu_tensor_len(&[b, h, t, k.dim(2)?], "attention scores")?;
    }
    let core = Core { mask: mask.cloned(), scale };
    let out = core.forward(&q.detach(), &k.detach(), &v.detach())?;
    if !(q.track_op() || k.track_op() || v.track_op()) {
        return Ok(out);
    }
    q.apply_op3(k, v, WithGrad { core, out })
}

/// What a GPU tensor too large for candle's kernels says (`fsdp_app::device::is_out_of_memory`
/// counts it: a smaller batch fixes it).
pub const TOO_LARGE_FOR_GPU_KERNELS: &str = "too many values for one GPU tensor";

/// candle's GPU kernels count a tensor's elements in 32 bits: a larger one would fail with the
/// driver's bare "invalid argument". Says which tensor and what to lower instead.
pub fn check_gpu_tensor_len(dims: &[usize], what: &str) -> Result<()> {
    let len: usize = dims.iter().product();
    if len >= 1 << 32 {
        candle_core::bail!(
            "{what} of shape {dims:?} hold {len} values, {TOO_LARGE_FOR_GPU_KERNELS} (candle's kernels index at most 2^32): \
             lower the batch size or the sequence length"
        );
    }
    Ok(())
}

/// What forward and backward share.
struct Core {
    mask: Option<Tensor>,
    scale: f64,
}

impl Core {
    /// Whether the softmax runs as our GPU kernels for scores like `q kᵀ`.
    #[cfg(feature = "cuda")]
    fn on_gpu_kernels(&self, q: &Tensor) -> bool {
        super::attention_softmax_cuda::applies(q.dtype(), q.device(), self.mask.as_ref())
    }

    /// Softmax probabilities in f32, (batch, heads, T, S), composed of candle's ops.
    fn probabilities(&self, q: &Tensor, k: &Tensor) -> Result<Tensor> {
        let scores = (q.matmul(&k.t()?)? * self.scale)?;
        let scores = match &self.mask {
            Some(m) => scores.broadcast_add(m)?,
            None => scores,
        };
        // In f32 like transformers' eager attention.
        candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)
    }

    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.on_gpu_kernels(q) {
            let scores = q.matmul(&k.t()?)?;
            return super::attention_softmax_cuda::forward(&scores, self.mask.as_ref(), self.scale)?.matmul(v);
        }
        self.probabilities(q, k)?.to_dtype(q.dtype())?.matmul(v)
    }

    /// (dq, dk, dv) for `dout`, given the forward's `out`.
    fn backward(&self, q: &Tensor, k: &Tensor, v: &Tensor, out: &Tensor, dout: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let dtype = q.dtype();
        let dout = dout.contiguous()?;
        let delta = (dout.to_dtype(DType::F32)? * out.to_dtype(DType::F32)?)?.sum_keepdim(D::Minus1)?;
        #[cfg(feature = "cuda")]
        if self.on_gpu_kernels(q) {
            use super::attention_softmax_cuda as kernels;
            let scores = q.matmul(&k.t()?)?;
            let p = kernels::forward(&scores, self.mask.as_ref(), self.scale)?;
            let dv = p.t()?.matmul(&dout)?;
            drop(p);
            let dp = dout.matmul(&v.t()?)?;
            // ds · scale, so that the products below need no scaling pass.
            let ds = kernels::backward(&scores, self.mask.as_ref(), self.scale, &dp, &delta)?;
            return Ok((ds.matmul(k)?, ds.t()?.matmul(q)?, dv));
        }
        let p = self.probabilities(q, k)?;
        let dv = p.to_dtype(dtype)?.t()?.matmul(&dout)?;
        let dp = dout.matmul(&v.t()?)?.to_dtype(DType::F32)?;
        let ds = (p * dp.broadcast_sub(&delta)?)?.to_dtype(dtype)?;
        let dq = (ds.matmul(k)? * self.scale)?;
        let dk = (ds.t()?.matmul(q)? * self.scale)?;
        Ok((dq, dk, dv))
    }
}

/// `(q, k, v) -> out` with `out` computed already: the op puts it in the graph.
struct WithGrad {
    core: Core,
    out: Tensor,
}

/// `copy(storage, layout)` of `out`, which must be a whole contiguous tensor (it is the
/// forward's fresh result): the op must return storage of its own, so it returns a copy.
fn copy_of<S>(out: &Tensor, copy: impl FnOnce(&candle_core::Storage, &Layout) -> Result<S>) -> Result<S> {
    let (storage, layout) = out.storage_and_layout();
    if !layout.is_contiguous() || layout.start_offset() != 0 {
        candle_core::bail!("eager attention: its output is not a whole contiguous tensor");
    }
    copy(&storage, layout)
}

impl CustomOp3 for WithGrad {
    fn name(&self) -> &'static str {
        "eager-attention"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        copy_of(&self.out, |storage, layout| match storage {
            candle_core::Storage::Cpu(s) => Ok((s.try_clone(layout)?, layout.shape().clone())),
            _ => candle_core::bail!("eager attention: inputs on the CPU, output elsewhere"),
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        copy_of(&self.out, |storage, layout| match storage {
            candle_core::Storage::Cuda(s) => Ok((s.try_clone(layout)?, layout.shape().clone())),
            _ => candle_core::bail!("eager attention: inputs on a GPU, output elsewhere"),
        })
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dq, dk, dv) = self.core.backward(&q.detach(), &k.detach(), &v.detach(), res, grad)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Values and gradients of q, k and v as candle's composed ops give them, in f32 and bf16,
    /// with a causal mask and without.
    #[test]
    fn matches_candles_composed_attention() {
        let dev = Device::Cpu;
        let (b, h, t, d) = (2, 3, 6, 8);
        let scale = 1.0 / (d as f64).sqrt();
        let mask: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
        let mask = Tensor::from_vec(mask, (t, t), &dev).unwrap();
        let composed = |q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>| -> Result<Tensor> {
            let s = (q.matmul(&k.t()?)? * scale)?;
            let s = match mask {
                Some(m) => s.broadcast_add(m)?,
                None => s,
            };
            candle_nn::ops::softmax(&s.to_dtype(DType::F32)?, D::Minus1)?.to_dtype(q.dtype())?.matmul(v)
        };
        let w = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            // The model makes its mask in the compute dtype.
            let mask = mask.to_dtype(dtype).unwrap();
            for mask in [Some(&mask), None] {
                let inputs: Vec<Tensor> = (0..3).map(|_| Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap()).collect();
                let run = |f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>| {
                    let vars: Vec<Var> = inputs.iter().map(|x| Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap()).collect();
                    let out = f(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor()).unwrap();
                    let loss = (out.to_dtype(DType::F32).unwrap() * &w).unwrap().sum_all().unwrap();
                    let grads = loss.backward().unwrap();
                    let mut all = vec![out];
                    all.extend(vars.iter().map(|v| grads.get(v.as_tensor()).unwrap().clone()));
                    all.iter().map(|t| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect::<Vec<_>>()
                };
                let ours = run(&|q, k, v| attention(q, k, v, mask, scale));
                let theirs = run(&|q, k, v| composed(q, k, v, mask));
                for (what, (a, e)) in ["out", "dq", "dk", "dv"].iter().zip(ours.iter().zip(&theirs)) {
                    let (diff, norm) = a.iter().zip(e).fold((0f32, 0f32), |(d, n), (x, y)| (d + (x - y).powi(2), n + y * y));
                    let rel = (diff / norm.max(1e-12)).sqrt();
                    assert!(rel < tol, "{dtype:?} mask {}: {what} differs by {rel}", mask.is_some());
                }
            }
        }
    }
}
