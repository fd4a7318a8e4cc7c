//! RMSNorm on a GPU as kernels of our own (`rms_norm.cu`): the forward one pass over x, the
//! backward one pass over x and the gradient (dx and the weight's gradient together), for
//! `ops::fused::rms_norm`'s op. Composed from candle's ops in f32 (casts, a square, a mean, a
//! square root, a reciprocal, two broadcast products, and their backward) each norm made
//! several passes over activation-sized tensors.
//!
//! The source is `kernels::cuda::RMS_NORM`, compiled by NVRTC the first time a process needs it.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, WithDType};
use kernels::cuda::RMS_NORM as SOURCE;

/// One warp per row; eight rows a block.
const WARPS_PER_BLOCK: u32 = 8;

/// The backward's blocks at most: each sums its rows' weight gradient in shared memory, then
/// adds it into one buffer (fewer blocks, fewer of those adds; enough to fill an H100).
const BACKWARD_BLOCKS: u64 = 1024;

/// Shared memory a block may use without opting in: the backward's weight gradient per block.
const SHARED_BYTES: usize = 48 << 10;

/// The longest rows the kernels take (the backward's per-block weight gradient in f32).
pub(crate) const MAX_ROW: usize = SHARED_BYTES / std::mem::size_of::<f32>();

/// The kernels' `Norm`: rows of n values.
#[repr(C)]
#[derive(Clone, Copy)]
struct Norm {
    rows: i64,
    n: i32,
    eps: f32,
}

// SAFETY: plain data laid out as the kernels' C struct.
unsafe impl DeviceRepr for Norm {}

impl Norm {
    fn new(xl: &Layout, wl: &Layout, eps: f32) -> Result<Self> {
        let n = wl.shape().elem_count();
        if n == 0 || xl.dims().last() != Some(&n) || xl.contiguous_offsets().is_none() || wl.contiguous_offsets().is_none() {
            candle_core::bail!("rms_norm on the GPU: x {:?} and weight {:?} are not contiguous rows of one length", xl.dims(), wl.dims());
        }
        Ok(Self { rows: (xl.shape().elem_count() / n) as i64, n: n as i32, eps })
    }

    fn blocks(&self) -> u64 {
        (self.rows as u64).div_ceil(WARPS_PER_BLOCK as u64)
    }
}

/// `rms_norm_{pass}_{dtype}`.
fn kernel_name(pass: &str, dtype: DType) -> Result<String> {
    match dtype {
        DType::F32 => Ok(format!("rms_norm_{pass}_f32")),
        DType::BF16 => Ok(format!("rms_norm_{pass}_bf16")),
        other => candle_core::bail!("rms_norm kernels: no {other:?} version"),
    }
}

/// The values of a contiguous input from its start.
fn input<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
    let start = l.start_offset();
    Ok(s.as_cuda_slice::<T>()?.slice(start..start + l.shape().elem_count()))
}

/// `w · held(x r)` for rows of x (.., n) and w (n).
pub(crate) fn forward(xs: &CudaStorage, xl: &Layout, ws: &CudaStorage, wl: &Layout, eps: f32) -> Result<CudaStorage> {
    match xs.dtype() {
        DType::F32 => forward_as::<f32>(xs, xl, ws, wl, eps),
        DType::BF16 => forward_as::<half::bf16>(xs, xl, ws, wl, eps),
        other => candle_core::bail!("rms_norm kernels: no {other:?} version"),
    }
}

fn forward_as<T: CudaDType + DeviceRepr + WithDType>(
    xs: &CudaStorage,
    xl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
    eps: f32,
) -> Result<CudaStorage> {
    let p = Norm::new(xl, wl, eps)?;
    let dev = xs.device.clone();
    let (x, w) = (input::<T>(xs, xl)?, input::<T>(ws, wl)?);
    let y = unsafe { dev.alloc::<T>(xl.shape().elem_count())? };
    let func = dev.get_or_load_custom_func(&kernel_name("forward", T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
    let mut args = func.builder();
    args.arg(&x).arg(&w).arg(&y).arg(&p);
    let cfg = LaunchConfig { grid_dim: (p.blocks() as u32, 1, 1), block_dim: (32 * WARPS_PER_BLOCK, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the kernel reads rows × n values of x and n of w and writes rows × n of y, all
    // inside the buffers (Norm::new checked the shapes).
    unsafe { args.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev))
}

/// (rows + 1, n): the rows of dx, then the weight's gradient, for x, w and the gradient g of y.
pub(crate) fn backward(
    xs: &CudaStorage,
    xl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
    gs: &CudaStorage,
    gl: &Layout,
    eps: f32,
) -> Result<CudaStorage> {
    match xs.dtype() {
        DType::F32 => backward_as::<f32>(xs, xl, ws, wl, gs, gl, eps),
        DType::BF16 => backward_as::<half::bf16>(xs, xl, ws, wl, gs, gl, eps),
        other => candle_core::bail!("rms_norm kernels: no {other:?} version"),
    }
}

#[allow(clippy::too_many_arguments)]
fn backward_as<T: CudaDType + DeviceRepr + WithDType>(
    xs: &CudaStorage,
    xl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
    gs: &CudaStorage,
    gl: &Layout,
    eps: f32,
) -> Result<CudaStorage> {
    let p = Norm::new(xl, wl, eps)?;
    if gl.dims() != xl.dims() || gl.contiguous_offsets().is_none() {
        candle_core::bail!("rms_norm backward on the GPU: gradient {:?} for x {:?}", gl.dims(), xl.dims());
    }
    if p.n as usize > MAX_ROW {
        candle_core::bail!("rms_norm backward on the GPU: rows of {} values (at most {MAX_ROW})", p.n);
    }
    let shared = p.n as usize * std::mem::size_of::<f32>();
    let dev = xs.device.clone();
    let (x, w, g) = (input::<T>(xs, xl)?, input::<T>(ws, wl)?, input::<T>(gs, gl)?);
    let out = unsafe { dev.alloc::<T>((p.rows as usize + 1) * p.n as usize)? };
    let dw = dev.alloc_zeros::<f32>(p.n as usize)?;
    let rows = dev.get_or_load_custom_func(&kernel_name("backward_rows", T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
    let mut args = rows.builder();
    args.arg(&x).arg(&w).arg(&g).arg(&out).arg(&dw).arg(&p);
    let cfg = LaunchConfig {
        grid_dim: (p.blocks().min(BACKWARD_BLOCKS) as u32, 1, 1),
        block_dim: (32 * WARPS_PER_BLOCK, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    // SAFETY: reads rows × n values of x and g and n of w; writes the first rows × n values of
    // out and adds into the n of dw, all allocated above; n floats of shared memory per block.
    unsafe { args.launch(cfg) }.w()?;
    let weight = dev.get_or_load_custom_func(&kernel_name("backward_weight", T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
    let mut args = weight.builder();
    args.arg(&dw).arg(&out).arg(&p);
    let cfg = LaunchConfig { grid_dim: ((p.n as u32).div_ceil(256), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: reads the n values of dw, writes out's last row (its values rows × n .. + n).
    unsafe { args.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
