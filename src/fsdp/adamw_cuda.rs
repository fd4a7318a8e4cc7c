//! AdamW of a chunk on its GPU as one kernel (`adamw.cu`): the host loop's arithmetic in one pass
//! over the chunk. As candle tensor operations the step made 15 passes over chunk-sized tensors
//! (scales, sums, a square, a root, a quotient), about a quarter of the 1.1B Llama bench's GPU
//! time (`tests/gpu/run.sh profile`).
//!
//! The source is compiled by NVRTC the first time a process needs it (`kernels::cuda::ADAMW`),
//! with no contracted multiply-adds.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use kernels::cuda::ADAMW as SOURCE;
use ops::cuda_args::values;

use super::optim::AdamWConfig;
use kernels::adamw::AdamWConstants;

const THREADS_PER_BLOCK: u32 = 256;

/// One AdamW step of an f32 chunk on its GPU, `step` counting from 1, `clip` multiplied into
/// the gradient as it is read (as `optim::adamw_step` does): returns the new parameters and
/// updates `exp_avg` and `exp_avg_sq` in place (they must be the chunk's own, shared with no
/// other tensor).
#[allow(clippy::too_many_arguments)]
pub fn adamw_step(
    cfg: &AdamWConfig,
    lr: f64,
    weight_decay: f64,
    step: u64,
    clip: Option<f32>,
    param: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
) -> Result<Tensor> {
    let n = param.elem_count();
    for (what, t) in [("gradient", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)] {
        if t.elem_count() != n || t.dtype() != DType::F32 || !t.is_contiguous() {
            candle_core::bail!("AdamW on a GPU: the {what} {:?} {:?} for an f32 chunk of {n}", t.dims(), t.dtype());
        }
    }
    let k = AdamWConstants::new(cfg.beta1, cfg.beta2, cfg.eps, lr, weight_decay, step, clip);
    let step = Step {
        constants: Constants {
            n: n as i64,
            decay: k.decay.unwrap_or(1.0),
            b2: k.b2,
            one_minus_b1: k.one_minus_b1,
            one_minus_b2: k.one_minus_b2,
            step_size: k.step_size,
            bc2_sqrt: k.bc2_sqrt,
            eps: k.eps,
            clip: k.clip.unwrap_or(1.0),
            has_decay: k.decay.is_some() as i32,
            has_clip: k.clip.is_some() as i32,
        },
        grad: grad.clone(),
        exp_avg: exp_avg.clone(),
        exp_avg_sq: exp_avg_sq.clone(),
    };
    param.contiguous()?.apply_op1_no_bwd(&step)
}

/// The kernel's `AdamW` struct (adamw.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct Constants {
    n: i64,
    decay: f32,
    b2: f32,
    one_minus_b1: f32,
    one_minus_b2: f32,
    step_size: f32,
    bc2_sqrt: f32,
    eps: f32,
    clip: f32,
    has_decay: i32,
    has_clip: i32,
}

// SAFETY: plain data laid out as the kernel's C struct.
unsafe impl DeviceRepr for Constants {}

struct Step {
    constants: Constants,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

impl CustomOp1 for Step {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn cpu_fwd(&self, _: &candle_core::CpuStorage, _: &Layout) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("the AdamW kernel runs on a GPU only")
    }

    fn cuda_fwd(&self, param: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = param.device().clone();
        let n = self.constants.n as usize;
        let param = param.as_cuda_slice::<f32>()?.slice(layout.start_offset()..layout.start_offset() + n);
        let (grad, grad_layout) = self.grad.storage_and_layout();
        let (m, m_layout) = self.exp_avg.storage_and_layout();
        let (v, v_layout) = self.exp_avg_sq.storage_and_layout();
        let (grad, m, v) = (
            values::<f32>(&grad, grad_layout.start_offset(), Some(n), "AdamW: the gradient")?,
            values::<f32>(&m, m_layout.start_offset(), Some(n), "AdamW: exp_avg")?,
            values::<f32>(&v, v_layout.start_offset(), Some(n), "AdamW: exp_avg_sq")?,
        );
        let out = unsafe { dev.alloc::<f32>(n)? };
        let func = dev.get_or_load_custom_func("adamw_f32", SOURCE.module, SOURCE.ptx()?)?;
        let mut args = func.builder();
        args.arg(&param).arg(&grad).arg(&m).arg(&v).arg(&out).arg(&self.constants);
        let blocks = (n as u64).div_ceil(THREADS_PER_BLOCK as u64).clamp(1, i32::MAX as u64) as u32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS_PER_BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the kernel reads n values of param and grad, reads and writes n of each moment
        // (checked n long and contiguous in `adamw_step`) and writes the n of `out`.
        unsafe { args.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), layout.shape().clone()))
    }
}
