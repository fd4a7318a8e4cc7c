//! `flash_attention`'s ops on a GPU: the forward kernel as a candle op that keeps the rows'
//! log-sum-exp for its backward, the backward as delta's kernel and two more (dq by query rows;
//! dk and dv by key rows and query head, each kv head's group then summed by a third), and
//! decoding over the KV cache's blocks, from
//! `kernels::cuda::FLASH_ATTENTION`, compiled by NVRTC the first time a process needs it.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CpuStorage, CudaStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType};
use kernels::cuda::FLASH_ATTENTION as SOURCE;

use crate::cuda_args::{contiguous_values, values};
use crate::visibility::Visibility;
use variants::{forward_kernel, DKV, DQ};

mod variants;

/// The kernels' geometry (stated in `kernels::cuda`, where a test holds the source to it): four
/// warps a block, each 16 of the block's 64 query (or key) rows.
const WARPS: usize = kernels::cuda::FLASH_WARPS;
const THREADS: u32 = 32 * WARPS as u32;
const ROWS: usize = kernels::cuda::FLASH_ROWS;

/// The kernels' `Shape`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct KernelShape {
    t_len: i32,
    s_len: i32,
    heads: i32,
    kv_heads: i32,
    offset: i32,
    causal: i32,
    window: i32,
    scale: f32,
    token_major: i32,
}

// SAFETY: plain data laid out as the kernels' C struct.
unsafe impl DeviceRepr for KernelShape {}

/// What the three kernels share: the problem's sizes.
#[derive(Clone, Copy, Debug)]
struct Problem {
    batch: usize,
    head_dim: usize,
    shape: KernelShape,
}

impl Problem {
    /// For q (batch, heads, T, d) and k (batch, kv_heads, S, d), or with `token_major` q (batch,
    /// T, heads, d) and k (batch, S, kv_heads, d).
    fn new(q: &Tensor, k: &Tensor, visibility: Visibility, scale: f64, token_major: bool) -> Result<Self> {
        let Visibility { causal, offset, window } = visibility;
        let ((batch, heads, t, head_dim), (kv_heads, s)) = match token_major {
            false => (q.dims4()?, (k.dim(1)?, k.dim(2)?)),
            true => {
                let (batch, t, heads, head_dim) = q.dims4()?;
                ((batch, heads, t, head_dim), (k.dim(2)?, k.dim(1)?))
            }
        };
        let shape = KernelShape {
            t_len: t as i32,
            s_len: s as i32,
            heads: heads as i32,
            kv_heads: kv_heads as i32,
            offset: offset as i32,
            causal: causal as i32,
            window: window.unwrap_or(0) as i32,
            scale: scale as f32,
            token_major: token_major as i32,
        };
        Ok(Self { batch, head_dim, shape })
    }

    fn query_rows(&self) -> usize {
        self.batch * self.shape.heads as usize * self.shape.t_len as usize
    }

    fn key_rows(&self) -> usize {
        self.batch * self.shape.kv_heads as usize * self.shape.s_len as usize
    }

    /// Blocks over query rows (forward, dq) or key rows (dk, dv), `per_block` a block.
    fn config(&self, rows: i32, heads: i32, per_block: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: ((rows as usize).div_ceil(per_block) as u32, (self.batch * heads as usize) as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn kernel(&self, pass: &str, dtype: DType) -> Result<String> {
        kernel_name(pass, dtype, self.head_dim)
    }
}

/// The kernel `flash_{pass}_{dtype}_d{head_dim}` of the source.
fn kernel_name(pass: &str, dtype: DType, head_dim: usize) -> Result<String> {
    let name = match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => candle_core::bail!("flash attention kernels: no {other:?} version"),
    };
    Ok(format!("flash_{pass}_{name}_d{head_dim}"))
}

/// `$self.$f::<T>($args)` for the half type of `$dtype` (the kernels' two formats).
macro_rules! by_half_dtype {
    ($dtype:expr, $self:ident.$f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::BF16 => $self.$f::<half::bf16>($($arg),*),
            DType::F16 => $self.$f::<half::f16>($($arg),*),
            other => candle_core::bail!("flash attention kernels: no {other:?} version"),
        }
    };
}

/// `flash_attention::attention` (or, `token_major`, `attention_token_major`) on checked inputs.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, visibility: Visibility, scale: f64, token_major: bool) -> Result<Tensor> {
    let (op, [q, k, v]) = Flash::new([q, k, v], visibility, scale, token_major)?;
    if q.track_op() || k.track_op() || v.track_op() {
        q.apply_op3(&k, &v, op)
    } else {
        q.apply_op3_no_bwd(&k, &v, &op)
    }
}

/// [`attention`] on inputs that train nothing, the forward kept with its log-sum-exp for a
/// backward the caller runs itself ([`Kept::backward`]): what an op that holds attention
/// inside it (`self_attention_flash`) needs, where the attention is no node of candle's graph.
pub fn attention_kept(q: &Tensor, k: &Tensor, v: &Tensor, visibility: Visibility, scale: f64, token_major: bool) -> Result<(Tensor, Kept)> {
    let (op, [q, k, v]) = Flash::new([&q.detach(), &k.detach(), &v.detach()], visibility, scale, token_major)?;
    let out = q.apply_op3_no_bwd(&k, &v, &op)?;
    Ok((out.clone(), Kept { op, inputs: [q, k, v], out }))
}

/// A forward of [`attention_kept`]: its inputs, output and log-sum-exp.
pub struct Kept {
    op: Flash,
    inputs: [Tensor; 3],
    out: Tensor,
}

impl Kept {
    /// (dq, dk, dv) for `dout`, each in its input's shape; once (the log-sum-exp is taken).
    pub fn backward(&self, dout: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let [q, k, v] = &self.inputs;
        match self.op.bwd(q, k, v, &self.out, dout)? {
            (Some(dq), Some(dk), Some(dv)) => Ok((dq, dk, dv)),
            _ => candle_core::bail!("flash attention: a backward without all three gradients"),
        }
    }
}

/// `x` contiguous from a 16-byte boundary (the kernels stage rows with 16-byte loads). A fresh
/// copy where not (`force_contiguous`: candle's `copy` keeps the layout, offset and strides).
fn aligned(x: &Tensor) -> Result<Tensor> {
    let starts_aligned = x.layout().start_offset() % 8 == 0;
    if x.is_contiguous() && starts_aligned {
        Ok(x.clone())
    } else {
        x.force_contiguous()
    }
}

/// Where a tensor that must be contiguous from a 16-byte boundary starts; `what` names it.
fn start_of(layout: &Layout, what: &str) -> Result<usize> {
    match layout.contiguous_offsets() {
        Some((start, _)) if start % 8 == 0 => Ok(start),
        _ => candle_core::bail!("{what} is not contiguous from a 16-byte boundary"),
    }
}

/// A tensor's values (from its storage and layout), contiguous from a 16-byte boundary.
fn tensor_values<'a, T: CudaDType>(storage: &'a candle_core::Storage, layout: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    values::<T>(storage, start_of(layout, what)?, None, what)
}

/// An input's values, contiguous from a 16-byte boundary.
fn view<'a, T: CudaDType>((storage, layout): (&'a CudaStorage, &Layout), what: &str) -> Result<CudaView<'a, T>> {
    start_of(layout, what)?;
    contiguous_values(storage, layout)
}

/// The forward, keeping each query row's log-sum-exp (f32) for the backward.
struct Flash {
    problem: Problem,
    lse: Mutex<Option<CudaSlice<f32>>>,
}

impl Flash {
    /// The op for q, k and v, and the three as the kernels read them ([`aligned`]).
    fn new([q, k, v]: [&Tensor; 3], visibility: Visibility, scale: f64, token_major: bool) -> Result<(Self, [Tensor; 3])> {
        let (q, k, v) = (aligned(q)?, aligned(k)?, aligned(v)?);
        let op = Flash { problem: Problem::new(&q, &k, visibility, scale, token_major)?, lse: Mutex::new(None) };
        Ok((op, [q, k, v]))
    }

    fn forward<T: CudaDType + DeviceRepr + WithDType>(&self, [q, k, v]: [(&CudaStorage, &Layout); 3]) -> Result<CudaStorage> {
        let p = &self.problem;
        let dev = q.0.device.clone();
        let (q, k, v) = (view::<T>(q, "flash attention: q")?, view::<T>(k, "flash attention: k")?, view::<T>(v, "flash attention: v")?);
        let out = unsafe { dev.alloc::<T>(p.query_rows() * p.head_dim)? };
        let lse = unsafe { dev.alloc::<f32>(p.query_rows())? };
        let (pass, rows) = forward_kernel(p.head_dim)?;
        let func = dev.get_or_load_custom_func(&p.kernel(pass, T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
        let mut args = func.builder();
        args.arg(&q).arg(&k).arg(&v).arg(&out).arg(&lse).arg(&p.shape);
        // SAFETY: q, k and v hold the rows `Problem` counts (their shapes made it); out and lse
        // are allocated for them above.
        unsafe { args.launch(p.config(p.shape.t_len, p.shape.heads, rows)) }.w()?;
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(lse);
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }

    /// rowsum(dout ∘ out), FlashAttention's delta: one f32 per query row, by a kernel (composed,
    /// it was two casts of both to f32, a product and a sum, each a pass).
    fn delta<T: CudaDType + DeviceRepr + WithDType>(&self, dout: &Tensor, out: &Tensor) -> Result<CudaSlice<f32>> {
        let p = &self.problem;
        let (dout_storage, dout_layout) = dout.storage_and_layout();
        let (out_storage, out_layout) = out.storage_and_layout();
        let dout = tensor_values::<T>(&dout_storage, dout_layout, "flash attention: dout")?;
        let out = tensor_values::<T>(&out_storage, out_layout, "flash attention: out")?;
        let dev = match &*dout_storage {
            candle_core::Storage::Cuda(s) => s.device.clone(),
            _ => candle_core::bail!("flash attention: dout is not on the GPU"),
        };
        let rows = p.query_rows();
        let delta = unsafe { dev.alloc::<f32>(rows)? };
        let func = dev.get_or_load_custom_func(&p.kernel("backward_delta", T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
        let mut args = func.builder();
        let n = rows as i64;
        args.arg(&dout).arg(&out).arg(&delta).arg(&n).arg(&p.shape);
        let config = LaunchConfig { grid_dim: (rows.div_ceil(WARPS) as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: dout and out hold `rows` rows of head_dim values (the forward's shapes), delta
        // is allocated for one value a row.
        unsafe { args.launch(config) }.w()?;
        Ok(delta)
    }
}

impl CustomOp3 for Flash {
    fn name(&self) -> &'static str {
        "flash-attention"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("flash attention runs on a GPU only")
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let inputs = [(q, ql), (k, kl), (v, vl)];
        let out = by_half_dtype!(q.dtype(), self.forward(inputs))?;
        // Token-major, the heads of a position are one row: (batch, T, heads · d).
        let shape = match (self.problem.shape.token_major != 0, ql.dims()) {
            (true, &[b, t, h, d]) => Shape::from((b, t, h * d)),
            _ => ql.shape().clone(),
        };
        Ok((out, shape))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = self.lse.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(lse) = lse else { candle_core::bail!("flash attention: a backward without its forward's log-sum-exp (or a second one)") };
        let dout = aligned(dout)?;
        let delta = by_half_dtype!(dout.dtype(), self.delta(&dout, out))?;
        let pass = Backward { problem: self.problem, lse: &lse, dout: &dout, delta: &delta };
        let (q, k, v) = (q.detach(), k.detach(), v.detach());
        let dq = q.apply_op3_no_bwd(&k, &v, &Gradient { pass: &pass, of_queries: true })?;
        let dkv = q.apply_op3_no_bwd(&k, &v, &Gradient { pass: &pass, of_queries: false })?;
        Ok((Some(dq), Some(dkv.get(0)?), Some(dkv.get(1)?)))
    }
}

/// What both backward kernels read besides q, k and v.
struct Backward<'a> {
    problem: Problem,
    lse: &'a CudaSlice<f32>,
    dout: &'a Tensor,
    delta: &'a CudaSlice<f32>,
}

/// dq (batch, heads, T, d), or dk and dv stacked (2, batch, kv_heads, S, d).
struct Gradient<'a> {
    pass: &'a Backward<'a>,
    of_queries: bool,
}

impl Gradient<'_> {
    fn run<T: CudaDType + DeviceRepr + WithDType>(&self, [q, k, v]: [(&CudaStorage, &Layout); 3]) -> Result<CudaStorage> {
        let p = &self.pass.problem;
        let dev = q.0.device.clone();
        let (q, k, v) = (view::<T>(q, "flash attention: q")?, view::<T>(k, "flash attention: k")?, view::<T>(v, "flash attention: v")?);
        let (dout_storage, dout_layout) = self.pass.dout.storage_and_layout();
        let dout = tensor_values::<T>(&dout_storage, dout_layout, "flash attention: dout")?;
        // dk and dv: blocks by (key tile, query head); under GQA each head's share goes to
        // `partial` (f32, (2, batch, heads, S, d)) and a second kernel sums each group's.
        let gqa = p.shape.heads != p.shape.kv_heads;
        let (pass, len, config) = if self.of_queries {
            (DQ.kernel(p.head_dim)?, p.query_rows() * p.head_dim, p.config(p.shape.t_len, p.shape.heads, ROWS))
        } else {
            (DKV.kernel(p.head_dim)?, 2 * p.key_rows() * p.head_dim, p.config(p.shape.s_len, p.shape.heads, ROWS))
        };
        let grads = unsafe { dev.alloc::<T>(len)? };
        let partial = match !self.of_queries && gqa {
            true => Some(unsafe { dev.alloc::<f32>(2 * p.batch * p.shape.heads as usize * p.shape.s_len as usize * p.head_dim)? }),
            false => None,
        };
        let func = dev.get_or_load_custom_func(&p.kernel(pass, T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
        let dv = grads.slice(len / 2..);
        {
            let mut args = func.builder();
            args.arg(&q).arg(&k).arg(&v).arg(&dout).arg(self.pass.lse).arg(self.pass.delta);
            let no_partial: u64 = 0;
            if self.of_queries {
                args.arg(&grads);
            } else {
                args.arg(&grads).arg(&dv);
                match &partial {
                    Some(partial) => args.arg(partial),
                    None => args.arg(&no_partial),
                };
            }
            args.arg(&p.shape);
            // SAFETY: the inputs hold the rows `Problem` counts, lse and delta one value per query
            // row (the forward's and `bwd`'s), and `grads` and `partial` are allocated for what
            // the kernel writes (without GQA it reads no `partial`: a null pointer).
            unsafe { args.launch(config) }.w()?;
        }
        if let Some(partial) = &partial {
            let values = (len / 2) as i64;
            let sum = dev.get_or_load_custom_func(&p.kernel("backward_dkv_sum", T::DTYPE)?, SOURCE.module, SOURCE.ptx()?)?;
            let mut args = sum.builder();
            args.arg(partial).arg(&grads).arg(&dv).arg(&values).arg(&p.shape);
            let config = LaunchConfig {
                grid_dim: ((len / 4).div_ceil(THREADS as usize) as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: `partial` holds every query head's share (the launch above wrote them all),
            // and dk, dv `values` values each.
            unsafe { args.launch(config) }.w()?;
        }
        drop(dv);
        Ok(CudaStorage::wrap_cuda_slice(grads, dev))
    }
}

impl CustomOp3 for Gradient<'_> {
    fn name(&self) -> &'static str {
        if self.of_queries {
            "flash-attention-dq"
        } else {
            "flash-attention-dkv"
        }
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("flash attention runs on a GPU only")
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let inputs = [(q, ql), (k, kl), (v, vl)];
        let grads = by_half_dtype!(q.dtype(), self.run(inputs))?;
        let shape = if self.of_queries {
            ql.shape().clone()
        } else {
            let mut dims = vec![2];
            dims.extend(kl.dims());
            Shape::from(dims)
        };
        Ok((grads, shape))
    }
}

/// Positions per cache block: the KV cache's (models::kv_cache), flash_attention.cu's
/// CACHE_BLOCK (a test in `kernels::cuda` holds them equal).
pub const CACHE_BLOCK: usize = kernels::paged_attention::BLOCK;

/// The decode kernel's `Decode`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct DecodeShape {
    heads: i32,
    kv_heads: i32,
    max_blocks: i32,
    window: i32,
    scale: f32,
}

// SAFETY: plain data laid out as the kernel's C struct.
unsafe impl DeviceRepr for DecodeShape {}

/// One new query per sequence, q (sequences, heads, 1, d), over each sequence's cached blocks
/// ((keys, values), each (kv_heads, CACHE_BLOCK, d)) and length, `new` keys and values written at
/// the last position first: (sequences, 1, heads · d). `flash_attention::decode` checked the
/// problem; this checks the blocks.
pub fn decode(
    q: &Tensor,
    new: Option<(&Tensor, &Tensor)>,
    (caches, kv_heads): (&[(&[(Tensor, Tensor)], usize)], usize),
    scale: f64,
    window: Option<usize>,
) -> Result<Tensor> {
    let (rows, heads, _, d) = q.dims4()?;
    for (r, (blocks, len)) in caches.iter().enumerate() {
        let fits = |t: &Tensor| t.dims() == [kv_heads, CACHE_BLOCK, d] && t.dtype() == q.dtype() && t.device().same_device(q.device());
        if blocks.len() < len.div_ceil(CACHE_BLOCK) || *len == 0 || !blocks.iter().all(|(k, v)| fits(k) && fits(v)) {
            candle_core::bail!("flash decode: sequence {r} has {} cache blocks for {len} positions, not ({kv_heads}, {CACHE_BLOCK}, {d}) of q's dtype and device", blocks.len());
        }
    }
    let new = match new {
        Some((k, v)) => {
            let want = [rows, kv_heads, 1, d];
            if k.dims() != want || v.dims() != want || k.dtype() != q.dtype() || v.dtype() != q.dtype() {
                candle_core::bail!("flash decode: new keys {:?} and values {:?} for {want:?} of q's dtype", k.dims(), v.dims());
            }
            Some((aligned(k)?, aligned(v)?))
        }
        None => None,
    };
    let max_blocks = caches.iter().map(|(_, len)| len.div_ceil(CACHE_BLOCK)).max().unwrap_or(0);
    let shape = DecodeShape {
        heads: heads as i32,
        kv_heads: kv_heads as i32,
        max_blocks: max_blocks as i32,
        window: window.unwrap_or(0) as i32,
        scale: scale as f32,
    };
    aligned(q)?.apply_op1_no_bwd(&Decode { caches, new: new.as_ref(), shape, rows, head_dim: d })
}

struct Decode<'a> {
    caches: &'a [(&'a [(Tensor, Tensor)], usize)],
    /// Keys and values to write at each sequence's last position first.
    new: Option<&'a (Tensor, Tensor)>,
    shape: DecodeShape,
    rows: usize,
    head_dim: usize,
}

impl Decode<'_> {
    /// The kernel's table: the device addresses of each sequence's key blocks, `max_blocks`
    /// entries a sequence (0 past its blocks), the value blocks' likewise, then the lengths.
    fn table<T: CudaDType>(&self, stream: &candle_core::cuda_backend::cudarc::driver::CudaStream) -> Result<Vec<u64>> {
        let width = self.shape.max_blocks as usize;
        let entries = self.rows * width;
        let mut table = vec![0u64; 2 * entries + self.rows];
        let address = |t: &Tensor| -> Result<u64> {
            let (storage, layout) = t.storage_and_layout();
            let view = tensor_values::<T>(&storage, layout, "flash decode: a cache block")?;
            let (ptr, _record) = view.device_ptr(stream);
            Ok(ptr)
        };
        for (r, (blocks, len)) in self.caches.iter().enumerate() {
            for (b, (k, v)) in blocks.iter().take(len.div_ceil(CACHE_BLOCK)).enumerate() {
                table[r * width + b] = address(k)?;
                table[entries + r * width + b] = address(v)?;
            }
            table[2 * entries + r] = *len as u64;
        }
        Ok(table)
    }

    fn run<T: CudaDType + DeviceRepr + WithDType>(&self, q: &CudaStorage, layout: &Layout) -> Result<CudaStorage> {
        let dev = q.device.clone();
        let q = view::<T>((q, layout), "flash decode: q")?;
        let stream = dev.cuda_stream();
        let host = self.table::<T>(&stream)?;
        let mut table = unsafe { dev.alloc::<u64>(host.len())? };
        dev.memcpy_htod(&host, &mut table)?;
        let out = unsafe { dev.alloc::<T>(self.rows * self.shape.heads as usize * self.head_dim)? };
        let func = dev.get_or_load_custom_func(&kernel_name("decode", T::DTYPE, self.head_dim)?, SOURCE.module, SOURCE.ptx()?)?;
        let group = (self.shape.heads / self.shape.kv_heads) as u32;
        let config = LaunchConfig {
            grid_dim: (self.rows as u32, self.shape.kv_heads as u32, group.div_ceil(16)),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let new_storage = self.new.map(|(k, v)| (k.storage_and_layout(), v.storage_and_layout()));
        let new_values = match &new_storage {
            Some(((ks, kl), (vs, vl))) => {
                Some((tensor_values::<T>(ks, kl, "flash decode: new keys")?, tensor_values::<T>(vs, vl, "flash decode: new values")?))
            }
            None => None,
        };
        let none = 0u64;
        let mut args = func.builder();
        args.arg(&q);
        match &new_values {
            Some((k, v)) => args.arg(k).arg(v),
            None => args.arg(&none).arg(&none),
        };
        args.arg(&table).arg(&out).arg(&self.shape);
        // SAFETY: the tables list, per sequence, blocks of (kv_heads, CACHE_BLOCK, d) values that
        // `decode` checked and the caches keep alive; the kernel writes the new keys and values
        // (sequences × kv_heads × d each, checked) at each last position inside them, reads the
        // positions under each length and writes the rows × heads × d values of `out`.
        unsafe { args.launch(config) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
}

impl candle_core::CustomOp1 for Decode<'_> {
    fn name(&self) -> &'static str {
        "flash-decode"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("flash decode runs on a GPU only")
    }

    fn cuda_fwd(&self, q: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let out = by_half_dtype!(q.dtype(), self.run(q, layout))?;
        Ok((out, Shape::from((self.rows, 1, self.shape.heads as usize * self.head_dim))))
    }
}
