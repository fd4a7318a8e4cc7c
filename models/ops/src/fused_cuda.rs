//! `ops::fused`'s RMSNorm, SwiGLU and rope on a GPU as kernels of our own (`fused.cu`): RMSNorm's
//! forward one pass over x, its backward one pass over x and the gradient (dx and the weight's
//! gradient together); SwiGLU's forward and backward one pass each; rope one pass, the backward
//! the same kernel rotating back; cross-entropy a block of threads per row each way
//! (`ops::cross_entropy`). Composed from candle's ops
//! (RMSNorm in f32: casts, a square, a mean, a square root, a reciprocal, two broadcast products;
//! SwiGLU: silu, then a product; and their backwards) each made several passes over
//! activation-sized tensors.
//!
//! The source is `kernels::cuda::FUSED`, compiled by NVRTC the first time a process needs it.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Tensor, WithDType};
use kernels::cuda::FUSED as SOURCE;

use crate::cuda_args::contiguous_values;

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

/// `$f::<T>(args)` for the dtype's T (f32 or bf16), or an error naming `$op`.
macro_rules! by_dtype {
    ($dtype:expr, $op:literal, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            other => candle_core::bail!("{} kernels: no {other:?} version", $op),
        }
    };
}

/// `{op}_{pass}_{dtype}`.
fn kernel_name(op_pass: &str, dtype: DType) -> Result<String> {
    match dtype {
        DType::F32 => Ok(format!("{op_pass}_f32")),
        DType::BF16 => Ok(format!("{op_pass}_bf16")),
        other => candle_core::bail!("{op_pass}: no {other:?} kernel"),
    }
}

/// A kernel's inputs: each one's storage and layout.
pub(crate) type Inputs<'a, const N: usize> = [(&'a CudaStorage, &'a Layout); N];

/// `w · held(x r)` for rows of x (.., n) and w (n).
pub(crate) fn rms_norm_forward(inputs: Inputs<2>, eps: f32) -> Result<CudaStorage> {
    by_dtype!(inputs[0].0.dtype(), "rms_norm", rms_norm_forward_as(inputs, eps))
}

fn rms_norm_forward_as<T: CudaDType + DeviceRepr + WithDType>([(xs, xl), (ws, wl)]: Inputs<2>, eps: f32) -> Result<CudaStorage> {
    let p = Norm::new(xl, wl, eps)?;
    let dev = xs.device.clone();
    let (x, w) = (contiguous_values::<T>(xs, xl)?, contiguous_values::<T>(ws, wl)?);
    let y = unsafe { dev.alloc::<T>(xl.shape().elem_count())? };
    let func = dev.get_or_load_custom_func(&kernel_name("rms_norm_forward", T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
    let mut args = func.builder();
    args.arg(&x).arg(&w).arg(&y).arg(&p);
    let cfg = LaunchConfig { grid_dim: (p.blocks() as u32, 1, 1), block_dim: (32 * WARPS_PER_BLOCK, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the kernel reads rows × n values of x and n of w and writes rows × n of y, all
    // inside the buffers (Norm::new checked the shapes).
    unsafe { args.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev))
}

/// (rows + 1, n): the rows of dx, then the weight's gradient, for x, w and the gradient g of y.
pub(crate) fn rms_norm_backward(inputs: Inputs<3>, eps: f32) -> Result<CudaStorage> {
    by_dtype!(inputs[0].0.dtype(), "rms_norm", rms_norm_backward_as(inputs, eps))
}

fn rms_norm_backward_as<T: CudaDType + DeviceRepr + WithDType>([(xs, xl), (ws, wl), (gs, gl)]: Inputs<3>, eps: f32) -> Result<CudaStorage> {
    let p = Norm::new(xl, wl, eps)?;
    if gl.dims() != xl.dims() || gl.contiguous_offsets().is_none() {
        candle_core::bail!("rms_norm backward on the GPU: gradient {:?} for x {:?}", gl.dims(), xl.dims());
    }
    if p.n as usize > MAX_ROW {
        candle_core::bail!("rms_norm backward on the GPU: rows of {} values (at most {MAX_ROW})", p.n);
    }
    let shared = p.n as usize * std::mem::size_of::<f32>();
    let dev = xs.device.clone();
    let (x, w, g) = (contiguous_values::<T>(xs, xl)?, contiguous_values::<T>(ws, wl)?, contiguous_values::<T>(gs, gl)?);
    let out = unsafe { dev.alloc::<T>((p.rows as usize + 1) * p.n as usize)? };
    let dw = dev.alloc_zeros::<f32>(p.n as usize)?;
    let rows = dev.get_or_load_custom_func(&kernel_name("rms_norm_backward_rows", T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
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
    let weight = dev.get_or_load_custom_func(&kernel_name("rms_norm_backward_weight", T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
    let mut args = weight.builder();
    args.arg(&dw).arg(&out).arg(&p);
    let cfg = LaunchConfig { grid_dim: ((p.n as u32).div_ceil(256), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: reads the n values of dw, writes out's last row (its values rows × n .. + n).
    unsafe { args.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// The embedding table's gradient, (vocab, n) in f32, for the upstream gradient `g` (tokens, n)
/// of a lookup: `embedding_backward` sums each id's rows in token order as `runs` lists them (the
/// tokens sorted by id, `ops::embedding::id_runs`: no atomics, the same bits every run); rows no
/// run names are zeros.
pub(crate) fn embedding_backward(g: &Tensor, (runs, count): &(Vec<u32>, usize), vocab: usize) -> Result<Tensor> {
    let g = g.contiguous()?;
    let n = g.dim(candle_core::D::Minus1)?;
    let tokens = g.elem_count() / n.max(1);
    let rows = runs.get(tokens + count + 1..).unwrap_or(&[]);
    let outside = |v: &[u32], end: usize| v.iter().any(|&x| x as usize >= end);
    if runs.len() != tokens + 2 * count + 1 || outside(&runs[..tokens], tokens) || outside(rows, vocab) {
        candle_core::bail!("embedding backward on the GPU: runs of {} values for a gradient {:?} under {vocab} ids", runs.len(), g.dims());
    }
    let (gs, gl) = g.storage_and_layout();
    let candle_core::Storage::Cuda(gs) = &*gs else { candle_core::bail!("embedding backward: the gradient is not on the GPU") };
    let dw = by_dtype!(g.dtype(), "embedding", embedding_backward_as(gs, gl, (runs, *count), tokens, vocab))?;
    Ok(Tensor::from_storage(candle_core::Storage::Cuda(dw), (vocab, n), candle_core::op::BackpropOp::none(), false))
}

fn embedding_backward_as<T: CudaDType + DeviceRepr + WithDType>(
    gs: &CudaStorage,
    gl: &Layout,
    (runs, count): (&[u32], usize),
    tokens: usize,
    vocab: usize,
) -> Result<CudaStorage> {
    let n = *gl.dims().last().expect("checked: g has rows");
    let dev = gs.device.clone();
    let dw = dev.alloc_zeros::<f32>(vocab * n)?;
    if count > 0 {
        let g = contiguous_values::<T>(gs, gl)?;
        let runs = dev.clone_htod(runs)?;
        let func = dev.get_or_load_custom_func(&kernel_name("embedding_backward", T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
        let mut args = func.builder();
        let (tokens, count, n32) = (tokens as i32, count as i32, n as i32);
        args.arg(&g).arg(&runs).arg(&dw).arg(&tokens).arg(&count).arg(&n32);
        let cfg = LaunchConfig { grid_dim: (count as u32, (n as u32).div_ceil(256), 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: `runs` holds tokens + 2 count + 1 values (`id_runs`), every order entry a row of g
        // (tokens x n) and every row id under vocab (both checked), so the kernel reads inside g and
        // writes inside dw (vocab x n).
        unsafe { args.launch(cfg) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(dw, dev))
}

/// Blocks of the elementwise kernels' grid-stride loops at most (enough to fill an H100).
const ELEMENTWISE_BLOCKS: u64 = 4096;

fn elementwise_config(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u64).div_ceil(256).clamp(1, ELEMENTWISE_BLOCKS) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Checks that SwiGLU's inputs are contiguous and of one length: that length.
fn swiglu_len(layouts: &[&Layout]) -> Result<usize> {
    let n = layouts[0].shape().elem_count();
    if layouts.iter().any(|l| l.shape().elem_count() != n || l.contiguous_offsets().is_none()) {
        candle_core::bail!(
            "swiglu on the GPU: inputs {:?} are not contiguous and of one length",
            layouts.iter().map(|l| l.dims()).collect::<Vec<_>>()
        );
    }
    Ok(n)
}

/// `silu(a) b`.
pub(crate) fn swiglu_forward(inputs: Inputs<2>) -> Result<CudaStorage> {
    by_dtype!(inputs[0].0.dtype(), "swiglu", swiglu_forward_as(inputs))
}

fn swiglu_forward_as<T: CudaDType + DeviceRepr + WithDType>([(a_s, al), (b_s, bl)]: Inputs<2>) -> Result<CudaStorage> {
    let n = swiglu_len(&[al, bl])?;
    let dev = a_s.device.clone();
    let (a, b) = (contiguous_values::<T>(a_s, al)?, contiguous_values::<T>(b_s, bl)?);
    let y = unsafe { dev.alloc::<T>(n)? };
    let func = dev.get_or_load_custom_func(&kernel_name("swiglu_forward", T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
    let mut args = func.builder();
    let len = n as i64;
    args.arg(&a).arg(&b).arg(&y).arg(&len);
    // SAFETY: reads n values of a and b, writes n of y (swiglu_len checked the lengths).
    unsafe { args.launch(elementwise_config(n)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev))
}

/// (2n): da, then db, for a, b and the gradient g of `silu(a) b`.
pub(crate) fn swiglu_backward(inputs: Inputs<3>) -> Result<CudaStorage> {
    by_dtype!(inputs[0].0.dtype(), "swiglu", swiglu_backward_as(inputs))
}

fn swiglu_backward_as<T: CudaDType + DeviceRepr + WithDType>([(a_s, al), (b_s, bl), (g_s, gl)]: Inputs<3>) -> Result<CudaStorage> {
    let n = swiglu_len(&[al, bl, gl])?;
    let dev = a_s.device.clone();
    let (a, b, g) = (contiguous_values::<T>(a_s, al)?, contiguous_values::<T>(b_s, bl)?, contiguous_values::<T>(g_s, gl)?);
    let out = unsafe { dev.alloc::<T>(2 * n)? };
    let func = dev.get_or_load_custom_func(&kernel_name("swiglu_backward", T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
    let mut args = func.builder();
    let len = n as i64;
    args.arg(&a).arg(&b).arg(&g).arg(&out).arg(&len);
    // SAFETY: reads n values of a, b and g, writes the 2n of out (lengths checked above).
    unsafe { args.launch(elementwise_config(n)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// The kernel's `Rotation`: rows of 2 half values, row r at position (r / heads) % seq.
#[repr(C)]
#[derive(Clone, Copy)]
struct Rotation {
    rows: i64,
    seq: i32,
    heads: i32,
    half: i32,
    sign: f32,
}

// SAFETY: plain data laid out as the kernel's C struct.
unsafe impl DeviceRepr for Rotation {}

/// Rows of x rotated by the angles of the (seq, half) tables, `heads` consecutive rows sharing a
/// position (1 for heads-major rows); by the negative angles when `inverse` (the backward).
pub(crate) fn rope(inputs: Inputs<3>, (seq, heads): (usize, usize), inverse: bool) -> Result<CudaStorage> {
    by_dtype!(inputs[0].0.dtype(), "rope", rope_as(inputs, (seq, heads), inverse))
}

fn rope_as<T: CudaDType + DeviceRepr + WithDType>(
    [(xs, xl), (cs, cl), (ss, sl)]: Inputs<3>,
    (seq, heads): (usize, usize),
    inverse: bool,
) -> Result<CudaStorage> {
    let d = xl.dims().last().copied().unwrap_or(0);
    let half = d / 2;
    let contiguous = [xl, cl, sl].iter().all(|l| l.contiguous_offsets().is_some());
    if d % 2 != 0 || !contiguous || cl.shape().elem_count() != seq * half || sl.dims() != cl.dims() || cs.dtype() != xs.dtype() {
        candle_core::bail!(
            "rope on the GPU: x {:?}, tables {:?} / {:?} for {seq} positions (contiguous, of x's dtype)",
            xl.dims(),
            cl.dims(),
            sl.dims()
        );
    }
    let n = xl.shape().elem_count();
    let p = Rotation {
        rows: (n / d.max(1)) as i64,
        seq: seq as i32,
        heads: heads as i32,
        half: half as i32,
        sign: if inverse { -1.0 } else { 1.0 },
    };
    let dev = xs.device.clone();
    let (x, cos, sin) = (contiguous_values::<T>(xs, xl)?, contiguous_values::<T>(cs, cl)?, contiguous_values::<T>(ss, sl)?);
    let y = unsafe { dev.alloc::<T>(n)? };
    let func = dev.get_or_load_custom_func(&kernel_name("rope", T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
    let mut args = func.builder();
    args.arg(&x).arg(&cos).arg(&sin).arg(&y).arg(&p);
    // SAFETY: reads the n values of x and seq × half of each table, writes the n of y (checked above).
    unsafe { args.launch(elementwise_config(n / 2)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev))
}

/// Threads per row of the cross-entropy kernels.
const ENTROPY_THREADS: u32 = 256;

/// The kernels' `Entropy`: rows of `vocab` logits.
#[repr(C)]
#[derive(Clone, Copy)]
struct Entropy {
    rows: i64,
    vocab: i32,
}

// SAFETY: plain data laid out as the kernels' C struct.
unsafe impl DeviceRepr for Entropy {}

impl Entropy {
    fn new(logits: &Layout, targets: &[i64]) -> Result<Self> {
        let rows = targets.len();
        match logits.dims() {
            [r, vocab] if *r == rows && logits.contiguous_offsets().is_some() && i32::try_from(*vocab).is_ok() => {
                Ok(Self { rows: rows as i64, vocab: *vocab as i32 })
            }
            dims => candle_core::bail!("cross-entropy on the GPU: logits {dims:?} (contiguous) for {rows} targets"),
        }
    }

    fn config(&self) -> LaunchConfig {
        LaunchConfig { grid_dim: (self.rows as u32, 1, 1), block_dim: (ENTROPY_THREADS, 1, 1), shared_mem_bytes: 0 }
    }
}

/// The targets on the device.
fn upload_targets(dev: &candle_core::CudaDevice, targets: &[i64]) -> Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<i64>> {
    let mut on_device = unsafe { dev.alloc::<i64>(targets.len().max(1))? };
    if !targets.is_empty() {
        dev.memcpy_htod(targets, &mut on_device)?;
    }
    Ok(on_device)
}

/// Per-row losses (f32) of (rows, vocab) logits against `targets` (0 where negative).
pub(crate) fn cross_entropy_forward(inputs: Inputs<1>, targets: &[i64]) -> Result<CudaStorage> {
    by_dtype!(inputs[0].0.dtype(), "cross-entropy", cross_entropy_forward_as(inputs, targets))
}

fn cross_entropy_forward_as<T: CudaDType + DeviceRepr + WithDType>([(xs, xl)]: Inputs<1>, targets: &[i64]) -> Result<CudaStorage> {
    let p = Entropy::new(xl, targets)?;
    let dev = xs.device.clone();
    let x = contiguous_values::<T>(xs, xl)?;
    let on_device = upload_targets(&dev, targets)?;
    let loss = unsafe { dev.alloc::<f32>(targets.len())? };
    let func = dev.get_or_load_custom_func(&kernel_name("cross_entropy_forward", T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
    let mut args = func.builder();
    args.arg(&x).arg(&on_device).arg(&loss).arg(&p);
    // SAFETY: reads rows × vocab logits (Entropy::new checked the shape) and one target a row,
    // writes one loss a row.
    unsafe { args.launch(p.config()) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(loss, dev))
}

/// d logits, in the logits' dtype, for `g_and_loss` (2, rows) in f32: the upstream gradient of
/// each row's loss, then the forward's losses.
pub(crate) fn cross_entropy_backward(inputs: Inputs<2>, targets: &[i64]) -> Result<CudaStorage> {
    by_dtype!(inputs[0].0.dtype(), "cross-entropy", cross_entropy_backward_as(inputs, targets))
}

fn cross_entropy_backward_as<T: CudaDType + DeviceRepr + WithDType>(
    [(xs, xl), (gs, gl)]: Inputs<2>,
    targets: &[i64],
) -> Result<CudaStorage> {
    let p = Entropy::new(xl, targets)?;
    if gl.shape().elem_count() != 2 * targets.len() || gl.contiguous_offsets().is_none() {
        candle_core::bail!("cross-entropy backward on the GPU: gradient and losses {:?} for {} rows", gl.dims(), targets.len());
    }
    let dev = xs.device.clone();
    let (x, g_and_loss) = (contiguous_values::<T>(xs, xl)?, contiguous_values::<f32>(gs, gl)?);
    let on_device = upload_targets(&dev, targets)?;
    let dx = unsafe { dev.alloc::<T>(xl.shape().elem_count())? };
    let func = dev.get_or_load_custom_func(&kernel_name("cross_entropy_backward", T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
    let mut args = func.builder();
    args.arg(&x).arg(&on_device).arg(&g_and_loss).arg(&dx).arg(&p);
    // SAFETY: reads rows × vocab logits, one target a row and the 2 × rows gradients and losses
    // (checked above), writes rows × vocab values of dx.
    unsafe { args.launch(p.config()) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(dx, dev))
}
