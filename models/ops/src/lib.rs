//! Tensor ops with their backward (the candle-nn role), over the `kernels` crate: each op is one
//! entry point that takes candle tensors, checks whether its fused CPU kernels apply (f32 on the
//! CPU: [`applies`]) and otherwise composes candle's ops, so the model code only says which op
//! it calls.
//!
//! - `fused`: RMSNorm, rope, SwiGLU; `cross_entropy`: rows of logits against targets; `gated_mlp`: an MLP's gate and up products with their
//!   SwiGLU; `attention`: causal/packed attention with an online softmax; `self_attention`:
//!   q/k/v, RoPE and attention as one op (`self_attention_flash`: the same on a GPU's flash
//!   kernels); `linear`: `x · wᵀ` with its backward; `head_loss`: the
//!   head and cross-entropy fused, by rows; `embedding`: the lookup whose weight gradient is
//!   made by rows; `weight_grads`: the sink those ops hand their weight gradients to (no
//!   vocabulary-sized gradient tensor, no zeroed weight-sized one); `backward_seed`: a backward
//!   pass started from a known gradient (a stage's, in the FSDP engine); `residual_sublayer`: a
//!   block's half, `x + f(rms_norm(x)) · W_outᵀ`, as one op;
//! - generation's products and attention: `gemv` (a few rows, f32 / f16 / bf16 weights),
//!   `half_product` (many rows over f16 / bf16 weights),
//!   `quant` (llama.cpp's block formats), `kv_attention` (over the KV cache's blocks in place),
//!   `lora_rows` (the serving adapters' updates of a batch, each on its rows);
//! - `eager_attention`: attention composed of candle's ops for every device, one graph node with
//!   its own backward, whose softmax on a GPU is `attention_softmax_cuda`'s two kernels;
//!   `flash_attention`: attention on a GPU's tensor cores for the masks a model describes (`visibility`: causal,
//!   a window), no scores in memory, forward and backward (`flash_attention_cuda`'s kernels);
//!   `cuda_args`: a GPU tensor as a kernel argument; `fused_cuda`: `fused`'s RMSNorm and SwiGLU on a GPU;
//! - `testing`: what the ops' and the models' tests share (random tensors, finite differences).

pub mod attention;
#[cfg(feature = "cuda")]
mod attention_softmax_cuda;
pub mod backward_seed;
pub mod cross_entropy;
#[cfg(feature = "cuda")]
pub mod cuda_args;
pub mod eager_attention;
pub mod embedding;
pub mod flash_attention;
#[cfg(feature = "cuda")]
mod flash_attention_cuda;
pub mod fused;
#[cfg(feature = "cuda")]
mod fused_cuda;
pub mod gated_mlp;
pub mod gemv;
pub mod half_product;
pub mod head_loss;
pub mod kv_attention;
pub mod linear;
pub mod lora_rows;
pub mod quant;
pub mod residual_sublayer;
pub mod self_attention;
pub mod self_attention_flash;
#[doc(hidden)]
pub mod testing;
pub mod visibility;
pub mod weight_grads;

use candle_core::{CpuStorage, DType, Layout, Result, Tensor};

/// Whether the fused CPU kernels take `x` (f32 on the CPU); other devices and dtypes take
/// candle's composite ops.
pub fn applies(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32
}

/// Whether `x` is on a GPU whose ops take our CUDA kernels (`fused_cuda`: RMSNorm, SwiGLU,
/// rope, cross-entropy; `linear` on cuBLAS for training). `FSDP_CUDA_KERNELS=0` sends them to
/// candle's composed ops instead: to tell which kernel moved a GPU figure, or to get past one
/// that fails on a GPU this machine could not test (flash attention has its own switch).
pub fn gpu_kernels_take(x: &Tensor) -> bool {
    static TURNED_OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    x.device().is_cuda() && !*TURNED_OFF.get_or_init(|| std::env::var("FSDP_CUDA_KERNELS").is_ok_and(|v| v == "0"))
}

/// Whether our CUDA kernels of `fused_cuda` take `x` ([`gpu_kernels_take`]): they are built
/// for f32 and bf16.
pub(crate) fn fused_cuda_takes(x: &Tensor) -> bool {
    cfg!(feature = "cuda") && gpu_kernels_take(x) && matches!(x.dtype(), DType::F32 | DType::BF16)
}

/// The f32 values of a contiguous CPU input of a custom op (every fused op's inputs are).
pub fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s.as_slice::<f32>()?[a..b]),
        None => candle_core::bail!("fused op: the input is not contiguous"),
    }
}

/// The f32 values of a contiguous tensor's storage, which must be on the CPU (for kernels that
/// read tensors in place: `lora_rows`, the KV cache's attention).
pub fn cpu_f32_values<'a>(storage: &'a candle_core::Storage, layout: &Layout) -> Result<&'a [f32]> {
    match storage {
        candle_core::Storage::Cpu(cpu) => f32_slice(cpu, layout),
        _ => candle_core::bail!("a tensor read in place is not on the CPU"),
    }
}
