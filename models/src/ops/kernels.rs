//! CPU kernels where candle's generic path is slow for our shapes, picked at run time by what the
//! processor has (AVX-512, AVX2 + FMA, or plain code), so one binary runs everywhere.
//! `FSDP_SIMD=avx512|avx2|scalar` forces a lower level (never one the CPU lacks), so tests can
//! compare every path on one machine.
//!
//! The first kernel is decoding's matrix-vector product: with one or a few rows, `x @ W^T` reads
//! the whole weight matrix once per token and is bound by memory bandwidth. gemm's blocked
//! kernels are built for large tiles (packing, AVX-512 tiles that batch-1 decoding wastes); a
//! plain dot product per weight row, split over the threads, streams the weights at full speed.
//! `dot` and `axpy` also serve the serving adapters' update by rows (`lora_rows`).

use std::sync::OnceLock;

use candle_core::{DType, Device, Result, Tensor};

/// Largest number of rows that take the matrix-vector path.
pub const GEMV_MAX_ROWS: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    Scalar,
    /// AVX2 with FMA and F16C (every AVX2 CPU has them).
    Avx2,
    Avx512,
}

impl SimdLevel {
    /// The best level this CPU has.
    pub fn detected() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                return Self::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                return Self::Avx2;
            }
        }
        Self::Scalar
    }

    /// The level in use: `FSDP_SIMD`'s (at most what the CPU has), else the detected one.
    pub fn current() -> Self {
        static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
        *LEVEL.get_or_init(|| {
            let best = Self::detected();
            match std::env::var("FSDP_SIMD").as_deref() {
                Ok("scalar") => Self::Scalar,
                Ok("avx2") => best.min(Self::Avx2),
                _ => best,
            }
        })
    }
}

/// `x @ w^T` for a CPU `x` of shape (.., in) with at most [`GEMV_MAX_ROWS`] rows in all (with
/// f32 weights up to `small_batch::SMALL_BATCH_MAX_ROWS`, by that module's kernel) and a
/// contiguous CPU `w` (out, in), both f32, f16 or bf16 (f16 / bf16 weights are widened in
/// registers, `half_dot`; the activations are taken in f32 and the result returned in `x`'s
/// dtype), when neither needs a gradient; `None` when the call is not for this kernel (the caller
/// then takes candle's matmul).
pub fn gemv_t(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    Ok(gemv_t_many(x, &[w])?.map(|mut ys| ys.remove(0)))
}

/// [`gemv_t`] for several matrices of one dtype over the same `x` (q/k/v, gate/up): their rows
/// are one parallel region instead of one each.
pub fn gemv_t_many(x: &Tensor, ws: &[&Tensor]) -> Result<Option<Vec<Tensor>>> {
    let in_dim = x.dim(candle_core::D::Minus1)?;
    let rows = x.elem_count() / in_dim;
    let float = |t: &Tensor| matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16);
    let weight_ok = |w: &Tensor| {
        matches!(w.device(), Device::Cpu)
            && float(w)
            && w.dtype() == ws[0].dtype()
            && w.rank() == 2
            && w.is_contiguous()
            && !w.track_op()
            && w.dim(1).is_ok_and(|d| d == in_dim)
    };
    // A few more rows with f32 weights: `small_batch`, which also reads each weight once.
    let small_batch = rows > GEMV_MAX_ROWS && rows <= super::small_batch::SMALL_BATCH_MAX_ROWS && ws[0].dtype() == DType::F32;
    let eligible = matches!(x.device(), Device::Cpu)
        && float(x)
        && (rows <= GEMV_MAX_ROWS || small_batch)
        && !x.track_op()
        && ws.iter().all(|w| weight_ok(w));
    if !eligible {
        return Ok(None);
    }
    let xs = x.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let guards: Vec<_> = ws.iter().map(|w| w.storage_and_layout()).collect();
    let mut cpus = vec![];
    for (storage, layout) in &guards {
        let candle_core::Storage::Cpu(cpu) = &**storage else { return Ok(None) };
        cpus.push((cpu, layout.start_offset()));
    }
    let out_dims: Vec<usize> = ws.iter().map(|w| w.dim(0)).collect::<Result<_>>()?;
    let level = SimdLevel::current();
    macro_rules! run {
        ($t:ty) => {{
            let slices: Vec<&[$t]> = cpus
                .iter()
                .zip(&out_dims)
                .map(|((cpu, start), out)| Ok(&cpu.as_slice::<$t>()?[*start..start + out * in_dim]))
                .collect::<Result<_>>()?;
            gemv_rows_many(&xs, rows, &slices, in_dim, level)
        }};
    }
    let ys = match ws[0].dtype() {
        DType::F16 => run!(half::f16),
        DType::BF16 => run!(half::bf16),
        _ if small_batch => {
            let slices: Vec<&[f32]> = cpus
                .iter()
                .zip(&out_dims)
                .map(|((cpu, start), out)| Ok(&cpu.as_slice::<f32>()?[*start..start + out * in_dim]))
                .collect::<Result<_>>()?;
            super::small_batch::rows_many(&xs, rows, &slices, in_dim, level)
        }
        _ => run!(f32),
    };
    drop(guards);
    ys.into_iter()
        .zip(out_dims)
        .map(|(y, out)| {
            let mut dims = x.dims().to_vec();
            *dims.last_mut().unwrap() = out;
            Tensor::from_vec(y, dims, &Device::Cpu)?.to_dtype(x.dtype())
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// A weight element the matrix-vector kernel reads: f32, or f16 / bf16 widened in registers.
pub trait GemvWeight: Copy + Send + Sync {
    /// `Σ x[i] · w[i]` at `level` (which the caller has checked the CPU supports).
    fn dot(x: &[f32], w: &[Self], level: SimdLevel) -> f32;
}

impl GemvWeight for f32 {
    fn dot(x: &[f32], w: &[f32], level: SimdLevel) -> f32 {
        dot(x, w, level)
    }
}

/// `y[r, o] = dot(x[r, ..], w[o, ..])` for `rows` rows, the weight rows split over the threads.
pub fn gemv_rows<W: GemvWeight>(x: &[f32], rows: usize, w: &[W], out_dim: usize, in_dim: usize, level: SimdLevel) -> Vec<f32> {
    gemv_rows_many(x, rows, &[&w[..out_dim * in_dim]], in_dim, level).remove(0)
}

/// [`gemv_rows`] for several matrices (each `(out_i, in_dim)`, row-major) in one parallel region.
fn gemv_rows_many<W: GemvWeight>(x: &[f32], rows: usize, ws: &[&[W]], in_dim: usize, level: SimdLevel) -> Vec<Vec<f32>> {
    let out_dims: Vec<usize> = ws.iter().map(|w| w.len() / in_dim).collect();
    // (out, rows) per matrix: each weight row's results together.
    let mut yts: Vec<Vec<f32>> = out_dims.iter().map(|o| vec![0f32; o * rows]).collect();
    let outs: Vec<SharedOut> = yts.iter_mut().map(|yt| SharedOut(yt.as_mut_ptr())).collect();
    for_rows_of_many(&out_dims, |i, range| {
        for o in range {
            let wrow = &ws[i][o * in_dim..(o + 1) * in_dim];
            for r in 0..rows {
                // SAFETY: every (matrix, o, r) is written by exactly one work item, inside that
                // matrix's buffer.
                unsafe { *outs[i].at(o * rows + r) = W::dot(&x[r * in_dim..(r + 1) * in_dim], wrow, level) };
            }
        }
    });
    drop(outs);
    yts.into_iter().zip(out_dims).map(|(yt, o)| transposed(yt, o, rows)).collect()
}

/// Runs `f` over ranges of `0..n` weight rows on candle's barrier pool, which its own ops use:
/// the calling thread works too, and the others spin briefly between decoding's ~200 products a
/// token instead of sleeping in the kernel (rayon's idle threads cost a quarter of a token's time
/// in `sched_yield` on 2 cores), and decoding runs on one pool, not two competing for the cores.
pub(crate) fn for_weight_rows(n: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    candle_core::utils::barrier_pool().execute_chunked(n, f)
}

/// [`for_weight_rows`] over the rows of several matrices (`rows[i]` each) as one region:
/// `f(i, range)` for the rows `range` of matrix `i`.
pub(crate) fn for_rows_of_many(rows: &[usize], f: impl Fn(usize, std::ops::Range<usize>) + Sync) {
    let starts: Vec<usize> = rows.iter().scan(0, |acc, r| Some(std::mem::replace(acc, *acc + r))).collect();
    for_weight_rows(rows.iter().sum(), |range| {
        // The part of `range` inside each matrix (a range may span two).
        for (i, (&start, &n)) in starts.iter().zip(rows).enumerate() {
            let (lo, hi) = (range.start.max(start), range.end.min(start + n));
            if lo < hi {
                f(i, lo - start..hi - start);
            }
        }
    });
}

/// Runs `f(i, chunk)` over the `chunk`-sized pieces of `out` on the same pool as
/// [`for_weight_rows`] (decoding's per-head attention).
pub(crate) fn for_chunks_mut(out: &mut [f32], chunk: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let base = SharedOut(out.as_mut_ptr());
    for_weight_rows(out.len() / chunk, |range| {
        for i in range {
            // SAFETY: the pieces are disjoint and inside `out`, which outlives the pool's work.
            f(i, unsafe { std::slice::from_raw_parts_mut(base.at(i * chunk), chunk) });
        }
    });
}

/// (out, rows) results as (rows, out).
pub(crate) fn transposed(yt: Vec<f32>, out_dim: usize, rows: usize) -> Vec<f32> {
    if rows == 1 {
        return yt;
    }
    let mut y = vec![0f32; rows * out_dim];
    for o in 0..out_dim {
        for r in 0..rows {
            y[r * out_dim + o] = yt[o * rows + r];
        }
    }
    y
}

/// An output buffer written by several threads at disjoint indices.
pub(crate) struct SharedOut(pub *mut f32);
// SAFETY: the threads write disjoint elements (each caller's contract), and the buffer outlives
// the parallel region.
unsafe impl Sync for SharedOut {}
impl SharedOut {
    /// # Safety
    /// `i` must be inside the buffer and written by no other thread.
    pub(crate) unsafe fn at(&self, i: usize) -> *mut f32 {
        self.0.add(i)
    }
}

/// Dot product at `level` (which the caller has checked the CPU supports).
pub fn dot(a: &[f32], b: &[f32], level: SimdLevel) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `level` never exceeds what `SimdLevel::detected` found on this CPU.
        match level {
            SimdLevel::Avx512 => return unsafe { x86::dot_avx512(a, b) },
            SimdLevel::Avx2 => return unsafe { x86::dot_avx2(a, b) },
            SimdLevel::Scalar => {}
        }
    }
    let _ = level;
    dot_scalar(a, b)
}

/// `y += a · x` at `level` (which the caller has checked the CPU supports).
pub fn axpy(y: &mut [f32], a: f32, x: &[f32], level: SimdLevel) {
    debug_assert_eq!(y.len(), x.len());
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `level` never exceeds what `SimdLevel::detected` found on this CPU.
        match level {
            SimdLevel::Avx512 => return unsafe { x86::axpy_avx512(y, a, x) },
            SimdLevel::Avx2 => return unsafe { x86::axpy_avx2(y, a, x) },
            SimdLevel::Scalar => {}
        }
    }
    let _ = level;
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

/// Eight partial sums, as the vector kernels keep, so the three levels round alike.
fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `exp_f32` on 16 lanes, written out: compiled from `exp_f32`, the loop converted the
    /// exponent to an integer one lane at a time (compares and conditional moves for the
    /// saturating cast), and e^x took 2.5% of a 28M Llama training step on a Zen 4.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn exp_avx512(x: &mut [f32]) {
        let whole = x.len() / 16 * 16;
        let p = x.as_mut_ptr();
        for i in (0..whole).step_by(16) {
            _mm512_storeu_ps(p.add(i), exp16(_mm512_loadu_ps(p.add(i))));
        }
        x[whole..].iter_mut().for_each(|v| *v = super::exp_f32(*v));
    }

    /// [`exp8`]'s operations on 16 lanes, in the same order with the same roundings.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn exp16(x: __m512) -> __m512 {
        let c = _mm512_set1_ps;
        // max/min return their second operand for NaN: a NaN stays NaN through the polynomial.
        let xc = _mm512_min_ps(c(88.7), _mm512_max_ps(c(-87.3), x));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(_mm512_add_ps(
            _mm512_mul_ps(xc, c(std::f32::consts::LOG2_E)),
            c(0.5),
        ));
        let z = _mm512_sub_ps(_mm512_sub_ps(xc, _mm512_mul_ps(n, c(0.693_359_4))), _mm512_mul_ps(n, c(-2.121_944_4e-4)));
        let mut poly = c(1.987_569_1e-4);
        for k in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5e-1] {
            poly = _mm512_add_ps(_mm512_mul_ps(poly, z), c(k));
        }
        let y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(poly, z), z), z), c(1.0));
        let exponent = _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127));
        let scaled = _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32::<23>(exponent)));
        // 0 below the range (and for -inf, a masked score).
        _mm512_maskz_mov_ps(!_mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, c(-87.3)), scaled)
    }

    /// `exp_f32` on 8 lanes, written out: the compiler leaves the loop over `exp_f32` half
    /// scalar on AVX2 (the saturating f32 -> i32 cast of the exponent), which made e^x a tenth of
    /// a long prompt's attention time.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_avx2(x: &mut [f32]) {
        let whole = x.len() / 8 * 8;
        let p = x.as_mut_ptr();
        for i in (0..whole).step_by(8) {
            _mm256_storeu_ps(p.add(i), exp8(_mm256_loadu_ps(p.add(i))));
        }
        x[whole..].iter_mut().for_each(|v| *v = super::exp_f32(*v));
    }

    /// `x[i] = e^(x[i] - shift)`, returning their sum (8 partial sums, then the tail's).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_shifted_sum_avx2(x: &mut [f32], shift: f32) -> f32 {
        let whole = x.len() / 8 * 8;
        let p = x.as_mut_ptr();
        let (shift8, mut sum8) = (_mm256_set1_ps(shift), _mm256_setzero_ps());
        for i in (0..whole).step_by(8) {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), shift8));
            _mm256_storeu_ps(p.add(i), e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), sum8);
        let mut sum = lanes.iter().sum::<f32>();
        for v in &mut x[whole..] {
            *v = super::exp_f32(*v - shift);
            sum += *v;
        }
        sum
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp8(x: __m256) -> __m256 {
        let c = _mm256_set1_ps;
        // max/min return their second operand for NaN: a NaN stays NaN through the polynomial.
        let xc = _mm256_min_ps(c(88.7), _mm256_max_ps(c(-87.3), x));
        let n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(xc, c(std::f32::consts::LOG2_E)), c(0.5)));
        let z = _mm256_sub_ps(_mm256_sub_ps(xc, _mm256_mul_ps(n, c(0.693_359_4))), _mm256_mul_ps(n, c(-2.121_944_4e-4)));
        let mut poly = c(1.987_569_1e-4);
        // Multiplies and adds as `exp_f32` rounds them (no FMA), so every level gives its bits.
        for k in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5e-1] {
            poly = _mm256_add_ps(_mm256_mul_ps(poly, z), c(k));
        }
        let y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(poly, z), z), z), c(1.0));
        let exponent = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
        let scaled = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(exponent)));
        // 0 below the range (and for -inf, a masked score).
        _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(x, c(-87.3)), scaled)
    }

    /// `y += a · x`, the plain loop compiled for each level (the compiler vectorises it with FMA).
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn axpy_avx512(y: &mut [f32], a: f32, x: &[f32]) {
        y.iter_mut().zip(x).for_each(|(y, x)| *y = a.mul_add(*x, *y));
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy_avx2(y: &mut [f32], a: f32, x: &[f32]) {
        y.iter_mut().zip(x).for_each(|(y, x)| *y = a.mul_add(*x, *y));
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i + 64 <= n {
            for (k, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i + 16 * k)), _mm512_loadu_ps(pb.add(i + 16 * k)), *acc);
            }
            i += 64;
        }
        while i + 16 <= n {
            acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc[0]);
            i += 16;
        }
        let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        let mut s = _mm512_reduce_add_ps(sum);
        while i < n {
            s += *pa.add(i) * *pb.add(i);
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (k, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8 * k)), _mm256_loadu_ps(pb.add(i + 8 * k)), *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc[0]);
            i += 8;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
        let mut s: f32 = lanes.iter().sum();
        while i < n {
            s += *pa.add(i) * *pb.add(i);
            i += 1;
        }
        s
    }
}

/// e^x in f32 (Cephes' `expf`: within 2 ulp), branch-free so that loops over it vectorise;
/// 0 below -87.3 (where f32 underflows) and for -inf (masked attention scores).
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.3, 88.7);
    let n = (xc * LOG2E + 0.5).floor();
    let z = xc - n * C1 - n * C2;
    let p = ((((1.987_569_1e-4 * z + 1.398_199_9e-3) * z + 8.333_452e-3) * z + 4.166_579_6e-2) * z + 1.666_666_5e-1) * z + 5e-1;
    let y = p * z * z + z + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < -87.3 {
        0.0
    } else {
        y * scale
    }
}

/// `x[i] = e^x[i]` at the best level this CPU has.
pub fn exp_inplace(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the level never exceeds what the CPU has.
        match SimdLevel::current() {
            SimdLevel::Avx512 => return unsafe { x86::exp_avx512(x) },
            SimdLevel::Avx2 => return unsafe { x86::exp_avx2(x) },
            SimdLevel::Scalar => {}
        }
    }
    x.iter_mut().for_each(|v| *v = exp_f32(*v));
}

/// `x[i] = e^(x[i] - shift)`, returning their sum (in an order of its own): a softmax row's
/// weights and their total in one pass.
pub fn exp_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if SimdLevel::current() >= SimdLevel::Avx2 {
        // SAFETY: the CPU has AVX2 and FMA (every AVX-512 one does too).
        return unsafe { x86::exp_shifted_sum_avx2(x, shift) };
    }
    x.iter_mut().fold(0.0, |sum, v| {
        *v = exp_f32(*v - shift);
        sum + *v
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut r = crate::rng::SplitMix64(seed);
        (0..n).map(|_| r.next_signed()).collect()
    }

    /// Several matrices in one region (q/k/v-like, sizes that make the threads' ranges span
    /// two matrices) give what each gives alone, bit for bit.
    #[test]
    fn many_matrices_match_one_at_a_time() {
        let (rows, inp) = (2, 96);
        let x = Tensor::from_vec(data(rows * inp, 5), (rows, inp), &Device::Cpu).unwrap();
        let ws: Vec<Tensor> = [(37, 6), (1, 7), (130, 8)]
            .map(|(out, seed)| Tensor::from_vec(data(out * inp, seed), (out, inp), &Device::Cpu).unwrap())
            .into();
        let together = gemv_t_many(&x, &ws.iter().collect::<Vec<_>>()).unwrap().unwrap();
        for (w, got) in ws.iter().zip(together) {
            let alone = gemv_t(&x, w).unwrap().unwrap();
            assert_eq!(got.to_vec2::<f32>().unwrap(), alone.to_vec2::<f32>().unwrap());
        }
    }

    /// Every level this CPU has gives candle's matmul, for odd sizes (tails) and 1-4 rows.
    #[test]
    fn every_level_matches_candle_matmul() {
        let best = SimdLevel::detected();
        for (rows, inp, out) in [(1, 576, 1536), (3, 77, 130), (4, 1000, 65), (2, 15, 3)] {
            let x = Tensor::from_vec(data(rows * inp, 1), (rows, inp), &Device::Cpu).unwrap();
            let w = Tensor::from_vec(data(out * inp, 2), (out, inp), &Device::Cpu).unwrap();
            let want: Vec<f32> = x.matmul(&w.t().unwrap()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let (xs, ws) = (x.flatten_all().unwrap().to_vec1::<f32>().unwrap(), w.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512].into_iter().filter(|l| *l <= best) {
                let got = gemv_rows(&xs, rows, &ws, out, inp, level);
                // Relative to the scale of a sum of `inp` products (different summation orders).
                let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs() / (b.abs() + (inp as f32).sqrt())).fold(0f32, f32::max);
                assert!(worst < 1e-5, "{level:?} rows {rows} in {inp} out {out}: off by {worst}");
            }
        }
        let y = gemv_t(
            &Tensor::from_vec(data(576, 3), (1, 1, 576), &Device::Cpu).unwrap(),
            &Tensor::from_vec(data(576 * 9, 4), (9, 576), &Device::Cpu).unwrap(),
        )
        .unwrap()
        .expect("a 1-row f32 product takes the gemv path");
        assert_eq!(y.dims(), &[1, 1, 9]);
    }

    /// f16 and bf16 weights (widened in registers) give candle's f32 matmul of the same values,
    /// on every level, for odd sizes; and gemv_t returns x's dtype.
    #[test]
    fn half_weights_match_candle_matmul_on_every_level() {
        let best = SimdLevel::detected();
        for (rows, inp, out) in [(1, 576, 130), (3, 77, 9), (4, 1000, 65), (2, 15, 3)] {
            let x = Tensor::from_vec(data(rows * inp, 1), (rows, inp), &Device::Cpu).unwrap();
            let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for dtype in [DType::F16, DType::BF16] {
                let w = Tensor::from_vec(data(out * inp, 2), (out, inp), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
                let want: Vec<f32> =
                    x.matmul(&w.to_dtype(DType::F32).unwrap().t().unwrap()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
                for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512].into_iter().filter(|l| *l <= best) {
                    let got = match dtype {
                        DType::F16 => gemv_rows(&xs, rows, &w.flatten_all().unwrap().to_vec1::<half::f16>().unwrap(), out, inp, level),
                        _ => gemv_rows(&xs, rows, &w.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap(), out, inp, level),
                    };
                    let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs() / (b.abs() + (inp as f32).sqrt())).fold(0f32, f32::max);
                    assert!(worst < 1e-5, "{dtype:?} {level:?} rows {rows} in {inp} out {out}: off by {worst}");
                }
                let y = gemv_t(&x.to_dtype(dtype).unwrap(), &w).unwrap().expect("half weights take the gemv path");
                assert_eq!(y.dtype(), dtype);
            }
        }
    }

    #[test]
    fn axpy_agrees_on_every_level() {
        let (x, y0) = (data(1003, 5), data(1003, 6));
        for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512].into_iter().filter(|l| *l <= SimdLevel::detected()) {
            let mut y = y0.clone();
            axpy(&mut y, -0.75, &x, level);
            for i in 0..y.len() {
                let want = y0[i] as f64 - 0.75 * x[i] as f64;
                assert!((y[i] as f64 - want).abs() < 1e-6, "{level:?} at {i}: {} vs {want}", y[i]);
            }
        }
    }

    #[test]
    fn exp_is_within_two_ulp_on_every_level() {
        let xs: Vec<f32> = (0..20001).map(|i| -90.0 + i as f32 * 0.0089).chain([f32::NEG_INFINITY, -1e-30, 0.0, 1e-30]).collect();
        let mut got = xs.clone();
        exp_inplace(&mut got);
        for (x, y) in xs.iter().zip(&got) {
            let want = (*x as f64).exp();
            if want < 1e-37 {
                assert!(*y < 1e-37, "e^{x} = {y}");
                continue;
            }
            let rel = ((*y as f64 - want) / want).abs();
            assert!(rel < 2.5e-7, "e^{x}: {y} vs {want} ({rel:e})");
            assert_eq!(*y, exp_f32(*x), "the vector loop and the scalar function agree at {x}");
        }
        let mut nan = [f32::NAN; 9];
        exp_inplace(&mut nan);
        assert!(nan.iter().all(|v| v.is_nan()), "NaN stays NaN: {nan:?}");
        // Each vector loop this CPU can run, not only the current level's: the same bits as
        // the scalar function, NaN kept in full vectors too.
        #[cfg(target_arch = "x86_64")]
        {
            type ExpLoop = unsafe fn(&mut [f32]);
            let loops: [(SimdLevel, ExpLoop); 2] = [(SimdLevel::Avx2, x86::exp_avx2), (SimdLevel::Avx512, x86::exp_avx512)];
            for (level, exp) in loops.into_iter().filter(|(l, _)| *l <= SimdLevel::detected()) {
                let mut got = xs.clone();
                let mut nan = [f32::NAN; 33];
                // SAFETY: the CPU has the level's instructions.
                unsafe {
                    exp(&mut got);
                    exp(&mut nan);
                }
                for (x, y) in xs.iter().zip(&got) {
                    assert_eq!(y.to_bits(), exp_f32(*x).to_bits(), "{level:?} at {x}");
                }
                assert!(nan.iter().all(|v| v.is_nan()), "{level:?}: NaN stays NaN: {nan:?}");
            }
        }
    }

    #[test]
    fn shifted_exp_sums_what_it_writes() {
        for n in [0, 5, 8, 64, 67] {
            let x0: Vec<f32> = data(n, 9).iter().map(|v| v * 10.0).collect();
            let mut x = x0.clone();
            let sum = exp_shifted_sum(&mut x, 3.0);
            let want: f64 = x0.iter().map(|v| (*v as f64 - 3.0).exp()).sum();
            assert!((sum as f64 - want).abs() <= 1e-6 * want.max(1.0), "{n}: {sum} vs {want}");
            for (a, b) in x.iter().zip(&x0) {
                assert_eq!(*a, exp_f32(b - 3.0));
            }
        }
    }
}
