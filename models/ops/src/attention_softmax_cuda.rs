//! Eager attention's softmax on a GPU as two kernels of our own (`attention_softmax.cu`), one
//! pass each over the (batch × heads × T × S) scores: the forward's `softmax(q kᵀ · scale +
//! mask)` and the backward's `ds = p ∘ (dp − delta) · scale`.
//!
//! Composed from candle's kernels, the 1.1B Llama's step (T = 2048) spent about half its GPU
//! time on passes over score-sized tensors: the scale, the mask added through candle's strided
//! broadcast path, casts to f32 and back, the softmax, and the backward's
//! subtraction, product and casts (`tests/gpu/run.sh profile`, kernels by launch size).
//!
//! The source is `kernels::cuda::ATTENTION_SOFTMAX`, compiled by NVRTC the first time a process needs it.

use crate::cuda_args::values;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, WithDType};
use kernels::cuda::ATTENTION_SOFTMAX as SOURCE;

/// One warp per row; eight rows a block.
const WARPS_PER_BLOCK: u32 = 8;

/// Whether the kernels take these scores: a GPU, f32 or bf16, a mask of the same dtype.
pub fn applies(scores_dtype: DType, device: &candle_core::Device, mask: Option<&Tensor>) -> bool {
    device.is_cuda() && matches!(scores_dtype, DType::F32 | DType::BF16) && mask.is_none_or(|m| m.dtype() == scores_dtype)
}

/// `softmax(scores · scale + mask)` over the last dim of contiguous (batch, heads, T, S)
/// scores, in f32, returned in the scores' dtype.
pub fn forward(scores: &Tensor, mask: Option<&Tensor>, scale: f64) -> Result<Tensor> {
    let mask = broadcast_mask(mask, scores)?;
    scores.contiguous()?.apply_op1_no_bwd(&Kernel(Forward { mask, scale }))
}

/// `p ∘ (dp − delta) · scale` for the p that [`forward`] gives these scores (recomputed), with
/// `delta` (batch, heads, T, 1) in f32; in the scores' dtype.
pub fn backward(scores: &Tensor, mask: Option<&Tensor>, scale: f64, dp: &Tensor, delta: &Tensor) -> Result<Tensor> {
    let mask = broadcast_mask(mask, scores)?;
    if dp.dims() != scores.dims() || dp.dtype() != scores.dtype() || delta.dtype() != DType::F32 {
        candle_core::bail!(
            "attention softmax backward: dp {:?} {:?}, delta {:?} for scores {:?}",
            dp.dims(),
            dp.dtype(),
            delta.dtype(),
            scores.dims()
        );
    }
    let delta = delta.contiguous()?;
    if delta.elem_count() * scores.dim(3)? != scores.elem_count() {
        candle_core::bail!("attention softmax backward: delta {:?} for scores {:?}", delta.dims(), scores.dims());
    }
    dp.contiguous()?.apply_op1_no_bwd(&Kernel(Backward { scores: scores.contiguous()?, mask, delta, scale }))
}

/// The mask as a (batch, heads, T, S) view whose rows are contiguous and S apart (the kernels
/// step over batch and heads by its strides, 0 where it is broadcast).
fn broadcast_mask(mask: Option<&Tensor>, scores: &Tensor) -> Result<Option<Tensor>> {
    let Some(mask) = mask else { return Ok(None) };
    let (_, _, t, s) = scores.dims4()?;
    let rows_fit = |m: &Tensor| {
        let stride = m.stride();
        let n = stride.len();
        m.dims().len() >= 2 && m.dims()[n - 2..] == [t, s] && stride[n - 1] == 1 && (t == 1 || stride[n - 2] == s)
    };
    let mask = if rows_fit(mask) { mask.clone() } else { mask.contiguous()? };
    Ok(Some(mask.broadcast_as(scores.shape())?))
}

/// The kernels' `Rows` (attention_softmax.cu): where each row of scores and of the mask is.
#[repr(C)]
#[derive(Clone, Copy)]
struct Rows {
    rows: i64,
    s_len: i32,
    t_len: i32,
    heads: i32,
    mask_batch_stride: i64,
    mask_head_stride: i64,
    scale: f32,
}

// SAFETY: plain data laid out as the kernels' C struct.
unsafe impl DeviceRepr for Rows {}

impl Rows {
    fn new(shape: &Shape, mask: Option<&Tensor>, scale: f64) -> Result<Self> {
        let (_, h, t, s) = shape.dims4()?;
        let (mask_batch_stride, mask_head_stride) = match mask {
            Some(m) => (m.stride()[0] as i64, m.stride()[1] as i64),
            None => (0, 0),
        };
        Ok(Self {
            rows: (shape.elem_count() / s) as i64,
            s_len: s as i32,
            t_len: t as i32,
            heads: h as i32,
            mask_batch_stride,
            mask_head_stride,
            scale: scale as f32,
        })
    }

    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: ((self.rows as u64).div_ceil(WARPS_PER_BLOCK as u64) as u32, 1, 1),
            block_dim: (32 * WARPS_PER_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// The kernel `attention_softmax_{pass}_{dtype}` of the source.
fn kernel_name(pass: &str, dtype: DType) -> Result<String> {
    let suffix = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        other => candle_core::bail!("attention softmax kernels: no {other:?} version"),
    };
    Ok(format!("attention_softmax_{pass}_{suffix}"))
}

fn contiguous_from_start(layout: &Layout, what: &str) -> Result<usize> {
    match layout.contiguous_offsets() {
        Some((start, _)) => Ok(start),
        None => candle_core::bail!("attention softmax: {what} is not contiguous"),
    }
}

/// One of the two kernels, run on its input's storage.
trait Pass: Send + Sync {
    const NAME: &'static str;
    fn run<T: CudaDType + DeviceRepr + WithDType>(&self, input: &CudaStorage, layout: &Layout) -> Result<CudaStorage>;
}

/// A [`Pass`] as a candle op, run for its input's dtype.
struct Kernel<P>(P);

impl<P: Pass> CustomOp1 for Kernel<P> {
    fn name(&self) -> &'static str {
        P::NAME
    }

    fn cpu_fwd(&self, _: &candle_core::CpuStorage, _: &Layout) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("attention softmax kernels run on a GPU only")
    }

    fn cuda_fwd(&self, input: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let out = match input.dtype() {
            DType::F32 => self.0.run::<f32>(input, layout)?,
            DType::BF16 => self.0.run::<half::bf16>(input, layout)?,
            other => candle_core::bail!("attention softmax kernels: no {other:?} version"),
        };
        Ok((out, layout.shape().clone()))
    }
}

struct Forward {
    mask: Option<Tensor>,
    scale: f64,
}

impl Pass for Forward {
    const NAME: &'static str = "attention-softmax";

    fn run<T: CudaDType + DeviceRepr + WithDType>(&self, scores: &CudaStorage, layout: &Layout) -> Result<CudaStorage> {
        let dev = scores.device.clone();
        let rows = Rows::new(layout.shape(), self.mask.as_ref(), self.scale)?;
        let scores = scores.as_cuda_slice::<T>()?.slice(contiguous_from_start(layout, "the scores")?..);
        let mask_storage = self.mask.as_ref().map(|m| m.storage_and_layout());
        let mask = mask_storage.as_ref().map(|(s, l)| values::<T>(s, l.start_offset(), None, "attention softmax: the mask")).transpose()?;
        let probs = unsafe { dev.alloc::<T>(layout.shape().elem_count())? };
        let func = dev.get_or_load_custom_func(&kernel_name("forward", T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
        let mut args = func.builder();
        let no_mask = 0u64;
        args.arg(&scores);
        match &mask {
            Some(view) => args.arg(view),
            None => args.arg(&no_mask),
        };
        args.arg(&probs).arg(&rows);
        // SAFETY: the kernel reads rows × S scores (and mask rows inside the mask's storage)
        // and writes rows × S values of `probs`, all allocated above.
        unsafe { args.launch(rows.launch_config()) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(probs, dev))
    }
}

struct Backward {
    scores: Tensor,
    mask: Option<Tensor>,
    delta: Tensor,
    scale: f64,
}

impl Pass for Backward {
    const NAME: &'static str = "attention-softmax-backward";

    fn run<T: CudaDType + DeviceRepr + WithDType>(&self, dp: &CudaStorage, layout: &Layout) -> Result<CudaStorage> {
        let dev = dp.device.clone();
        let rows = Rows::new(layout.shape(), self.mask.as_ref(), self.scale)?;
        let dp = dp.as_cuda_slice::<T>()?.slice(contiguous_from_start(layout, "dp")?..);
        let (scores_storage, scores_layout) = self.scores.storage_and_layout();
        let scores =
            values::<T>(&scores_storage, contiguous_from_start(scores_layout, "the scores")?, None, "attention softmax: the scores")?;
        let (delta_storage, delta_layout) = self.delta.storage_and_layout();
        let delta = values::<f32>(&delta_storage, contiguous_from_start(delta_layout, "delta")?, None, "attention softmax: delta")?;
        let mask_storage = self.mask.as_ref().map(|m| m.storage_and_layout());
        let mask = mask_storage.as_ref().map(|(s, l)| values::<T>(s, l.start_offset(), None, "attention softmax: the mask")).transpose()?;
        let ds = unsafe { dev.alloc::<T>(layout.shape().elem_count())? };
        let func = dev.get_or_load_custom_func(&kernel_name("backward", T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
        let mut args = func.builder();
        let no_mask = 0u64;
        args.arg(&scores);
        match &mask {
            Some(view) => args.arg(view),
            None => args.arg(&no_mask),
        };
        args.arg(&dp).arg(&delta).arg(&ds).arg(&rows);
        // SAFETY: as for the forward; delta holds one value per row (checked in `backward`).
        unsafe { args.launch(rows.launch_config()) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(ds, dev))
    }
}
