//! CPU ops with exact backward, for training (and the decode kernels): each is a candle custom
//! op whose forward is one pass over the data and whose `bwd` is itself a fused pass. The model
//! code (`layers`, `lora`, `model`, `staged`) calls them where [`applies`] says they do, and
//! candle's composite ops elsewhere (other devices and dtypes).
//!
//! - `fused`: RMSNorm, rope, SwiGLU; `gated_mlp`: an MLP's gate and up products with their SwiGLU;
//!   `attention`: causal/packed attention with an online softmax; `self_attention`: q/k/v, RoPE and
//!   attention as one op;
//!   `linear`: `x · wᵀ` with its backward (every f32 product through `matmul`, gemm's kernels at
//!   the level `FSDP_SIMD` allows); `head_loss`: the head and cross-entropy fused, by rows;
//!   `embedding`: the lookup whose weight gradient is made by rows;
//! - `weight_grads`: the sink those two and the linear layers hand their weight gradients to
//!   (no vocabulary-sized gradient tensor, no zeroed weight-sized one); `kernels`:
//!   run-time-dispatched SIMD kernels (decode gemv, exp), with `half_dot` for f16 / bf16 weights;
//! - `attend_rows`: the decode step's attention products over a run of cached rows;
//! - `lora_rows`: the serving adapters' updates of a batch, each on its rows, in one pass;
//! - `quant_blocks`: `x · Wᵀ` over llama.cpp's 32-value block formats (Q4_0 ... Q8_0), in place;
//! - `eager_attention`: the one op here for every device: attention composed of candle's ops,
//!   as one graph node with its own backward (training on a GPU), whose softmax on a GPU is
//!   `attention_softmax_cuda`'s two kernels; `runtime_cuda`: what our GPU kernels (those and the
//!   trainer's AdamW) share, their NVRTC compilation and their tensors as kernel arguments.

pub mod attend_rows;
pub mod attention;
#[cfg(feature = "cuda")]
mod attention_softmax_cuda;
mod column_split;
pub use column_split::split_columns_evenly_on_this_thread;
pub mod eager_attention;
pub mod embedding;
pub mod fused;
pub mod gated_mlp;
pub mod half_dot;
pub mod head_loss;
pub mod kernels;
pub mod linear;
pub mod lora_rows;
pub mod matmul;
pub mod pool;
pub mod quant_blocks;
#[cfg(target_arch = "x86_64")]
mod quant_blocks_x86;
#[cfg(feature = "cuda")]
pub mod runtime_cuda;
pub mod self_attention;
#[cfg(target_arch = "x86_64")]
mod sgemm_packed;
#[cfg(target_arch = "x86_64")]
mod sgemm_tiles;
pub mod small_batch;
pub mod weight_grads;

use candle_core::{CpuStorage, DType, Layout, Result, Tensor};

pub fn applies(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32
}

/// The f32 values of a contiguous CPU input of a custom op (every fused op's inputs are).
pub(crate) fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s.as_slice::<f32>()?[a..b]),
        None => candle_core::bail!("fused op: the input is not contiguous"),
    }
}

/// The f32 values of a contiguous tensor's storage, which must be on the CPU (for kernels that
/// read tensors in place: `lora_rows`, the KV cache's attention).
pub(crate) fn cpu_f32_values<'a>(storage: &'a candle_core::Storage, layout: &Layout) -> Result<&'a [f32]> {
    match storage {
        candle_core::Storage::Cpu(cpu) => f32_slice(cpu, layout),
        _ => candle_core::bail!("a tensor read in place is not on the CPU"),
    }
}
