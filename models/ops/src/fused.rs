//! Fused CPU ops that train: each is a candle custom op whose forward is one pass over the data
//! (one output allocation, split over the threads) and whose `bwd` is exact, itself one fused
//! pass. They replace composite chains of candle ops (a temporary tensor per step) on the
//! training path. On other devices, and for dtypes other than f32, callers keep the composite
//! ops (same values; see each op's test against them); RMSNorm, SwiGLU and rope have GPU kernels
//! too (f32, bf16: `fused_cuda`).

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use kernels::pool::{pool_map_new, pool_new, pool_new_halves};

use super::f32_slice;
use kernels::exp::exp_inplace;
use kernels::gemv::dot;
use kernels::simd::SimdLevel;

/// Rows of at least this many values each go to one thread task.
const MIN_TASK: usize = 1 << 14;

fn rows_per_task(row: usize) -> usize {
    (MIN_TASK / row.max(1)).max(1)
}

// ---------------------------------------------------------------- RMSNorm

/// Whether [`rms_norm`] runs for these tensors: f32 on the CPU; f32 or bf16 on a GPU, where the
/// kernels take rows of at most 12,288 values (the backward sums the weight's gradient in a
/// block's shared memory).
pub fn rms_norm_applies(x: &Tensor, w: &Tensor) -> bool {
    let on_gpu = || {
        #[cfg(feature = "cuda")]
        return crate::fused_cuda_takes(x) && w.elem_count() <= crate::fused_cuda::MAX_ROW;
        #[cfg(not(feature = "cuda"))]
        false
    };
    w.dtype() == x.dtype() && (crate::applies(x) || on_gpu())
}

/// `x / sqrt(mean(x^2) + eps) * w` over the last dimension (transformers' `LlamaRMSNorm` in f32).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps: eps as f32 })
}

struct RmsNorm {
    eps: f32,
}

/// 1 / rms of a row, its sum of squares in vector lanes (a plain float sum runs one value at a
/// time).
fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let ss = dot(row, row, SimdLevel::current());
    1.0 / (ss / row.len() as f32 + eps).sqrt()
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout, ws: &CpuStorage, wl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (f32_slice(xs, xl)?, f32_slice(ws, wl)?);
        let n = w.len();
        let per = n * rows_per_task(n);
        let y = pool_new(x.len(), per, |c, ys| {
            let xs = &x[c * per..c * per + ys.len()];
            for (yr, xr) in ys.chunks_mut(n).zip(xs.chunks(n)) {
                let r = inv_rms(xr, self.eps);
                for i in 0..n {
                    yr[i] = xr[i] * r * w[i];
                }
            }
        });
        Ok((CpuStorage::F32(y), xl.shape().clone()))
    }

    /// On a GPU: our kernels (`fused_cuda`), f32 and bf16.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::fused_cuda::rms_norm_forward([(xs, xl), (ws, wl)], self.eps)?, xl.shape().clone()))
    }

    /// With r = 1/rms(x): dx_j = r w_j g_j - r^3 x_j / n * sum_i g_i w_i x_i and
    /// dw_i = sum over rows of g_i x_i r.
    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = rms_norm_grads(x, w, g, self.eps)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// [`rms_norm`]'s backward for x, w and the output's gradient g: (dx, dw), in one pass.
pub(crate) fn rms_norm_grads(x: &Tensor, w: &Tensor, g: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    let g = g.contiguous()?;
    let both = x.apply_op3_no_bwd(w, &g, &RmsNormBackward { eps })?;
    let rows = x.elem_count() / w.elem_count();
    let dx = both.narrow(0, 0, rows)?.reshape(x.shape())?;
    let dw = both.narrow(0, rows, 1)?.reshape(w.shape())?;
    Ok((dx, dw))
}

/// (x, w, g) -> (rows + 1, n): the rows of dx, then dw.
struct RmsNormBackward {
    eps: f32,
}

impl CustomOp3 for RmsNormBackward {
    fn name(&self) -> &'static str {
        "fused-rms-norm-backward"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w, g) = (f32_slice(xs, xl)?, f32_slice(ws, wl)?, f32_slice(gs, gl)?);
        let n = w.len();
        let rows = x.len() / n;
        let per = n * rows_per_task(n);
        // dx per row, and each task's partial dw, summed after (into the row after dx's).
        let (mut out, partial) = pool_map_new(rows * n, n, per, |c, dxs| {
            let (xs, gs) = (&x[c * per..c * per + dxs.len()], &g[c * per..c * per + dxs.len()]);
            // gw: a row's g ∘ w, whose dot product with x is taken in vector lanes.
            let (mut dw, mut gw) = (vec![0f32; n], vec![0f32; n]);
            for ((dxr, xr), gr) in dxs.chunks_mut(n).zip(xs.chunks(n)).zip(gs.chunks(n)) {
                let r = inv_rms(xr, self.eps);
                for i in 0..n {
                    gw[i] = gr[i] * w[i];
                    dw[i] += gr[i] * xr[i] * r;
                }
                let c = r * r * r * dot(&gw, xr, SimdLevel::current()) / n as f32;
                for j in 0..n {
                    dxr[j] = r * w[j] * gr[j] - c * xr[j];
                }
            }
            dw
        });
        out.resize((rows + 1) * n, 0.0);
        let dw = &mut out[rows * n..];
        for p in partial {
            for i in 0..n {
                dw[i] += p[i];
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((rows + 1, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, rows) = (wl.shape().elem_count(), xl.shape().elem_count() / wl.shape().elem_count().max(1));
        Ok((crate::fused_cuda::rms_norm_backward([(xs, xl), (ws, wl), (gs, gl)], self.eps)?, Shape::from((rows + 1, n))))
    }
}

// ---------------------------------------------------------------- SwiGLU

/// Whether [`swiglu`] runs for these tensors: f32 on the CPU; f32 or bf16 on a GPU.
pub fn swiglu_applies(a: &Tensor, b: &Tensor) -> bool {
    a.dtype() == b.dtype() && (crate::applies(a) || crate::fused_cuda_takes(a))
}

/// `silu(a) * b`, the Llama MLP's gate.
pub fn swiglu(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.contiguous()?.apply_op2(&b.contiguous()?, SwiGlu)
}

struct SwiGlu;

/// Sigmoid of a slice into `out` (through the vectorised exp).
fn sigmoid_into(v: &[f32], out: &mut [f32]) {
    out.iter_mut().zip(v).for_each(|(o, x)| *o = -x);
    exp_inplace(out);
    out.iter_mut().for_each(|o| *o = 1.0 / (1.0 + *o));
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "fused-swiglu"
    }

    fn cpu_fwd(&self, a_s: &CpuStorage, al: &Layout, b_s: &CpuStorage, bl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (a, b) = (f32_slice(a_s, al)?, f32_slice(b_s, bl)?);
        if a.len() != b.len() {
            candle_core::bail!("swiglu: {} vs {} values", a.len(), b.len());
        }
        Ok((CpuStorage::F32(swiglu_values(a, b)), al.shape().clone()))
    }

    /// On a GPU: our kernels (`fused_cuda`), f32 and bf16.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        a_s: &candle_core::CudaStorage,
        al: &Layout,
        b_s: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::fused_cuda::swiglu_forward([(a_s, al), (b_s, bl)])?, al.shape().clone()))
    }

    fn bwd(&self, a: &Tensor, b: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (da, db) = swiglu_backward(a, b, g)?;
        Ok((Some(da), Some(db)))
    }
}

/// The gradients of `silu(a) * b` for an upstream `g`, by the kernels where [`swiglu`] runs
/// (one pass, one buffer): da = g b s (1 + a (1 - s)) with s = sigmoid(a); db = g a s.
pub(crate) fn swiglu_backward(a: &Tensor, b: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
    let both = a.apply_op3_no_bwd(b, &g.contiguous()?, &SwiGluBackward)?;
    let n = a.elem_count();
    Ok((both.narrow(0, 0, n)?.reshape(a.shape())?, both.narrow(0, n, n)?.reshape(b.shape())?))
}

/// (a, b, g) -> (2n): da then db.
struct SwiGluBackward;

impl CustomOp3 for SwiGluBackward {
    fn name(&self) -> &'static str {
        "fused-swiglu-backward"
    }

    fn cpu_fwd(
        &self,
        a_s: &CpuStorage,
        al: &Layout,
        b_s: &CpuStorage,
        bl: &Layout,
        g_s: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (a, b, g) = (f32_slice(a_s, al)?, f32_slice(b_s, bl)?, f32_slice(g_s, gl)?);
        Ok((CpuStorage::F32(swiglu_grads(a, b, g)), Shape::from(2 * a.len())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        a_s: &candle_core::CudaStorage,
        al: &Layout,
        b_s: &candle_core::CudaStorage,
        bl: &Layout,
        g_s: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::fused_cuda::swiglu_backward([(a_s, al), (b_s, bl), (g_s, gl)])?, Shape::from(2 * al.shape().elem_count())))
    }
}

/// `silu(a) ∘ b` of two slices of the same length, over the pool.
pub(crate) fn swiglu_values(a: &[f32], b: &[f32]) -> Vec<f32> {
    pool_new(a.len(), MIN_TASK, |c, ys| {
        let (as_, bs) = (&a[c * MIN_TASK..c * MIN_TASK + ys.len()], &b[c * MIN_TASK..c * MIN_TASK + ys.len()]);
        sigmoid_into(as_, ys);
        for i in 0..ys.len() {
            ys[i] *= as_[i] * bs[i];
        }
    })
}

/// The gradients of [`swiglu_values`] for its output's gradient `g`: da, then db, in one
/// buffer of 2n. da = g b s (1 + a (1 - s)) with s = sigmoid(a); db = g a s.
pub(crate) fn swiglu_grads(a: &[f32], b: &[f32], g: &[f32]) -> Vec<f32> {
    pool_new_halves(a.len(), MIN_TASK, |c, das, dbs| {
        let off = c * MIN_TASK;
        let mut s = vec![0f32; das.len()];
        sigmoid_into(&a[off..off + das.len()], &mut s);
        for i in 0..das.len() {
            let (av, bv, gv, s) = (a[off + i], b[off + i], g[off + i], s[i]);
            das[i] = gv * bv * s * (1.0 + av * (1.0 - s));
            dbs[i] = gv * av * s;
        }
    })
}

// ---------------------------------------------------------------- rotary embedding

/// Whether [`rope`] runs for x and these tables: f32 on the CPU; f32 or bf16 on a GPU, the tables
/// in x's dtype.
pub fn rope_applies(x: &Tensor, cos: &Tensor) -> bool {
    cos.dtype() == x.dtype() && (crate::applies(x) || crate::fused_cuda_takes(x))
}

/// Rotary embedding of `x` (batch, heads, seq, head_dim) with `cos`/`sin` tables (seq,
/// head_dim / 2), halves rotated as transformers' `rotate_half` does (what candle's `rope_slow`
/// computes, without concatenating the tables at every call).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op3(&cos.contiguous()?, &sin.contiguous()?, Rope { inverse: false, token_major: false })
}

/// [`rope`] for `x` in the projections' token-major layout (batch, seq, heads, head_dim), as
/// `ops::attention::attention` reads it.
pub fn rope_token_major(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op3(&cos.contiguous()?, &sin.contiguous()?, Rope { inverse: false, token_major: true })
}

/// [`rope_token_major`]'s backward: x rotated by the negative angles, with no backward of its
/// own (for ops that run their backward themselves, `self_attention_flash`).
pub(crate) fn rope_token_major_inverse(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &Rope { inverse: true, token_major: true })
}

/// `inverse` rotates by the negative angle: the backward of a rotation is its inverse.
/// `token_major`: x is (batch, seq, heads, head_dim), else (batch, heads, seq, head_dim).
struct Rope {
    inverse: bool,
    token_major: bool,
}

impl Rope {
    /// Positions, rows sharing a position, and head dim of an x of `dims`.
    fn geometry(&self, dims: &[usize]) -> Result<(usize, usize, usize)> {
        match (self.token_major, dims) {
            (true, [_, t, h, d]) => Ok((*t, *h, *d)),
            (false, [.., t, d]) => Ok((*t, 1, *d)),
            _ => candle_core::bail!("rope: unexpected shape {dims:?}"),
        }
    }
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "fused-rope"
    }

    /// On a GPU: our kernel (`fused_cuda`), f32 and bf16.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        cs: &candle_core::CudaStorage,
        cl: &Layout,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (seq, heads, _) = self.geometry(xl.dims())?;
        Ok((crate::fused_cuda::rope([(xs, xl), (cs, cl), (ss, sl)], (seq, heads), self.inverse)?, xl.shape().clone()))
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        cs: &CpuStorage,
        cl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, cos, sin) = (f32_slice(xs, xl)?, f32_slice(cs, cl)?, f32_slice(ss, sl)?);
        // Rows of head_dim values; `heads` consecutive rows share a position when token-major.
        let (seq, heads, d) = self.geometry(xl.dims())?;
        let position = |row: usize| if self.token_major { (row / heads) % seq } else { row % seq };
        Ok((CpuStorage::F32(rope_values(x, (cos, sin), (seq, d), position, self.inverse)?), xl.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dx = g.contiguous()?.apply_op3_no_bwd(cos, sin, &Rope { inverse: !self.inverse, token_major: self.token_major })?;
        Ok((Some(dx), None, None))
    }
}

/// Rows of `d` values of `x` rotated by the angles of their positions (`position(row)`, under
/// `seq`) in the (seq, d / 2) tables; by the negative angles when `inverse`. Over the pool,
/// `seq` rows a task.
pub(crate) fn rope_values(
    x: &[f32],
    (cos, sin): (&[f32], &[f32]),
    (seq, d): (usize, usize),
    position: impl Fn(usize) -> usize + Sync,
    inverse: bool,
) -> Result<Vec<f32>> {
    let half = d / 2;
    if cos.len() != seq * half || sin.len() != cos.len() {
        candle_core::bail!("rope: tables of {} values for {seq} positions of {half}", cos.len());
    }
    let sign = if inverse { -1.0f32 } else { 1.0 };
    let per = d * seq;
    Ok(pool_new(x.len(), per, |c, ys| {
        let xs = &x[c * per..c * per + ys.len()];
        for (r, (yr, xr)) in ys.chunks_mut(d).zip(xs.chunks(d)).enumerate() {
            let p = position(c * seq + r);
            let (co, s) = (&cos[p * half..(p + 1) * half], &sin[p * half..(p + 1) * half]);
            for i in 0..half {
                let (x1, x2, si) = (xr[i], xr[i + half], sign * s[i]);
                yr[i] = x1 * co[i] - x2 * si;
                yr[i + half] = x2 * co[i] + x1 * si;
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check_fd, grads, max_rel, rand};
    use candle_core::{Var, D};

    /// RMSNorm as composite candle ops (what the training path used before).
    fn rms_norm_composite(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
        let inv = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
        x.broadcast_mul(&inv)?.broadcast_mul(w)
    }

    #[test]
    fn rms_norm_matches_the_composite_op_and_finite_differences() {
        let (x, w) = (rand(&[3, 5, 64], 1, 2.0), rand(&[64], 2, 1.0));
        let probe = rand(&[3, 5, 64], 3, 1.0);
        assert!(max_rel(&rms_norm(&x, &w, 1e-6).unwrap(), &rms_norm_composite(&x, &w, 1e-6).unwrap()) < 1e-5);
        let vars = [Var::from_tensor(&x).unwrap(), Var::from_tensor(&w).unwrap()];
        let fused = grads(&vars, &probe, &|t| rms_norm(&t[0], &t[1], 1e-6));
        let composite = grads(&vars, &probe, &|t| rms_norm_composite(&t[0], &t[1], 1e-6));
        for (a, b) in fused.iter().zip(&composite) {
            assert!(max_rel(a, b) < 1e-4, "{}", max_rel(a, b));
        }
        for (which, grad) in fused.iter().enumerate() {
            check_fd(&[x.clone(), w.clone()], which, &probe, grad, &|t| rms_norm_composite(&t[0], &t[1], 1e-6));
        }
    }

    #[test]
    fn swiglu_matches_the_composite_op_and_finite_differences() {
        let (a, b) = (rand(&[2, 7, 96], 4, 4.0), rand(&[2, 7, 96], 5, 2.0));
        let probe = rand(&[2, 7, 96], 6, 1.0);
        let composite = |t: &[Tensor]| candle_nn::ops::silu(&t[0])? * &t[1];
        assert!(max_rel(&swiglu(&a, &b).unwrap(), &composite(&[a.clone(), b.clone()]).unwrap()) < 1e-5);
        let vars = [Var::from_tensor(&a).unwrap(), Var::from_tensor(&b).unwrap()];
        let fused = grads(&vars, &probe, &|t| swiglu(&t[0], &t[1]));
        let reference = grads(&vars, &probe, &composite);
        for (x, y) in fused.iter().zip(&reference) {
            assert!(max_rel(x, y) < 1e-4, "{}", max_rel(x, y));
        }
        for (which, grad) in fused.iter().enumerate() {
            check_fd(&[a.clone(), b.clone()], which, &probe, grad, &composite);
        }
    }

    #[test]
    fn rope_matches_rope_slow_and_finite_differences() {
        let x = rand(&[2, 3, 5, 16], 10, 2.0);
        let (cos, sin) = (rand(&[5, 8], 11, 1.0), rand(&[5, 8], 12, 1.0));
        let probe = rand(&[2, 3, 5, 16], 13, 1.0);
        let composite = |t: &[Tensor]| candle_nn::rotary_emb::rope_slow(&t[0], &cos.to_dtype(t[0].dtype())?, &sin.to_dtype(t[0].dtype())?);
        assert!(max_rel(&rope(&x, &cos, &sin).unwrap(), &composite(std::slice::from_ref(&x)).unwrap()) < 1e-5);
        let var = [Var::from_tensor(&x).unwrap()];
        let fused = grads(&var, &probe, &|t| rope(&t[0], &cos, &sin));
        let reference = grads(&var, &probe, &composite);
        assert!(max_rel(&fused[0], &reference[0]) < 1e-5);
        check_fd(std::slice::from_ref(&x), 0, &probe, &fused[0], &composite);
        // Token-major (batch, seq, heads, head_dim): the same rotation, transposed.
        let xt = x.transpose(1, 2).unwrap().contiguous().unwrap();
        let want = rope(&x, &cos, &sin).unwrap().transpose(1, 2).unwrap();
        assert!(max_rel(&rope_token_major(&xt, &cos, &sin).unwrap(), &want) < 1e-6);
        let var = [Var::from_tensor(&xt).unwrap()];
        let probe_t = probe.transpose(1, 2).unwrap().contiguous().unwrap();
        let token_major = grads(&var, &probe_t, &|t| rope_token_major(&t[0], &cos, &sin));
        assert!(max_rel(&token_major[0], &fused[0].transpose(1, 2).unwrap()) < 1e-6);
    }
}
