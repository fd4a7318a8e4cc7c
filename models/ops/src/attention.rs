//! Fused attention for training on CPU: `softmax(q kᵀ · scale + mask) v` as one candle op with an
//! exact backward. q, k and v are read where the projections put them, token-major
//! (batch, seq, heads, head_dim), and the output is written in the layout o_proj takes
//! (batch, seq, heads · head_dim): no transposed copies. Grouped-query heads read their shared
//! k/v head in place (no repeated k/v). Neither pass keeps the (seq, seq) probabilities: each
//! (batch, head) task scores, normalises and multiplies in one (seq, seq) scratch buffer, a block
//! of query rows at a time over the keys the mask lets it see (`query_blocks`), and the
//! backward recomputes the probabilities the same way (FlashAttention's recomputation), so only
//! q, k, v and the output stay alive for backward.

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

use crate::f32_slice;
use kernels::disjoint::DisjointWrites;
use kernels::exp::softmax_row;
use kernels::gemv::dot;
use kernels::matmul::sgemm;
use kernels::simd::SimdLevel;

/// `softmax(q kᵀ · scale + mask) v` for q (batch, seq, heads, head_dim) and k, v (batch, seq,
/// kv_heads, head_dim); `mask` is additive, (seq, seq) or (batch, 1, seq, seq). Returns
/// (batch, seq, heads · head_dim). f32 on the CPU (see [`crate::applies`]).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, scale: f64) -> Result<Tensor> {
    let (b, t, hq, d) = q.dims4()?;
    let (kb, kt, hkv, kd) = k.dims4()?;
    if (kb, kt, kd) != (b, t, d) || v.dims() != k.dims() || hkv == 0 || hq % hkv != 0 {
        candle_core::bail!("attention: q {:?}, k {:?}, v {:?} do not fit together", q.dims(), k.dims(), v.dims());
    }
    let op = Attention::new(b, t, mask, scale)?;
    q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)?.reshape((b, t, hq * d))
}

/// The attention of one call: its scale and mask (the same for the forward and the backward).
/// Also run by `ops::self_attention` on the projections it computes itself.
pub(crate) struct Attention {
    scale: f32,
    /// A constant of the graph (no gradient), contiguous.
    mask: Option<Tensor>,
}

/// Sizes and strides of one call: row `i` of head `h` starts at `q_at(bi, h) + i * q_rs`.
#[derive(Clone, Copy)]
pub(crate) struct Dims {
    pub(crate) b: usize,
    pub(crate) t: usize,
    pub(crate) hq: usize,
    pub(crate) hkv: usize,
    pub(crate) d: usize,
}

impl Dims {
    fn of(q: &[usize], k: &[usize]) -> Self {
        Dims { b: q[0], t: q[1], hq: q[2], hkv: k[2], d: q[3] }
    }
    fn q_at(&self, bi: usize, h: usize) -> usize {
        (bi * self.t * self.hq + h) * self.d
    }
    fn kv_at(&self, bi: usize, g: usize) -> usize {
        (bi * self.t * self.hkv + g) * self.d
    }
    fn q_rs(&self) -> isize {
        (self.hq * self.d) as isize
    }
    fn kv_rs(&self) -> isize {
        (self.hkv * self.d) as isize
    }
}

/// The mask's row for query `i` of batch row `bi`, if there is a mask.
fn mask_row(mask: Option<(&[f32], bool)>, bi: usize, i: usize, t: usize) -> Option<&[f32]> {
    mask.map(|(m, per_row)| {
        let r = if per_row { bi * t + i } else { i };
        &m[r * t..(r + 1) * t]
    })
}

/// Query rows scored together: a block's products span the keys up to its last row's reach
/// (about half the (seq, seq) work under a causal mask).
const QUERY_BLOCK: usize = 32;

/// The query rows of batch row `bi` in blocks of [`QUERY_BLOCK`], last block first, each with
/// how many keys it reads: one past the last key any of its rows does not mask out with -inf.
/// Keys past that get probability exactly 0 (exp(-inf)), so leaving them out of the products
/// drops only zero terms (the backward's dk and dv then add up their rows block by block, a
/// rounding apart from one product over all rows). A row that masks out every key reads them
/// all (and gets NaN, as the plain softmax does).
fn query_blocks(mask: Option<(&[f32], bool)>, bi: usize, t: usize) -> Vec<(std::ops::Range<usize>, usize)> {
    let reach = |i: usize| match mask_row(mask, bi, i, t) {
        None => t,
        Some(m) => m.iter().rposition(|&v| v != f32::NEG_INFINITY).map_or(t, |j| j + 1),
    };
    (0..t.div_ceil(QUERY_BLOCK))
        .rev()
        .map(|b| {
            let rows = b * QUERY_BLOCK..t.min((b + 1) * QUERY_BLOCK);
            let keys = rows.clone().map(reach).max().unwrap_or(t);
            (rows, keys)
        })
        .collect()
}

/// Scores of query rows `rows` of head `h` against the first `keys` keys of kv head `g` of
/// batch row `bi` into `p` (t × t, those rows and columns), then each row turned into
/// probabilities: `p[i] = softmax(p[i] · scale + mask[i])` over those keys.
fn probabilities(
    dims: Dims,
    (q, k): (&[f32], &[f32]),
    (bi, h, g): (usize, usize, usize),
    (rows, keys): (&std::ops::Range<usize>, usize),
    mask: Option<(&[f32], bool)>,
    scale: f32,
    p: &mut [f32],
) {
    let t = dims.t;
    // SAFETY: q and k hold these rows (checked shapes), p holds t × t values.
    unsafe {
        sgemm(
            rows.len(),
            keys,
            dims.d,
            (p.as_mut_ptr().add(rows.start * t), 1, t as isize),
            (q.as_ptr().add(dims.q_at(bi, h)).offset(rows.start as isize * dims.q_rs()), 1, dims.q_rs()),
            (k.as_ptr().add(dims.kv_at(bi, g)), dims.kv_rs(), 1),
            0.0,
            1.0,
        );
    }
    for i in rows.clone() {
        softmax_row(&mut p[i * t..i * t + keys], scale, mask_row(mask, bi, i, t).map(|m| &m[..keys]));
    }
}

impl Attention {
    /// For `b` rows of `t` tokens; `mask` (additive) must be (t, t) or (b, 1, t, t).
    pub(crate) fn new(b: usize, t: usize, mask: Option<&Tensor>, scale: f64) -> Result<Self> {
        if let Some(m) = mask {
            if m.dims() != [t, t] && m.dims() != [b, 1, t, t] {
                candle_core::bail!("attention: a mask of shape {:?} for {b} rows of {t} tokens", m.dims());
            }
        }
        Ok(Attention { scale: scale as f32, mask: mask.map(Tensor::contiguous).transpose()? })
    }

    fn mask_data(&self) -> Result<Option<(Vec<f32>, bool)>> {
        match &self.mask {
            None => Ok(None),
            Some(m) => Ok(Some((m.flatten_all()?.to_vec1::<f32>()?, m.rank() == 4))),
        }
    }

    /// The output (b, t, hq · d) of q (b, t, hq, d), k and v (b, t, hkv, d), token-major.
    pub(crate) fn forward(&self, dims: Dims, q: &[f32], k: &[f32], v: &[f32]) -> Result<Vec<f32>> {
        let mask = self.mask_data()?;
        let mask = mask.as_ref().map(|(m, per_row)| (m.as_slice(), *per_row));
        let Dims { b, t, hq, hkv, d } = dims;
        // Not zeroed first: every (batch, head) task overwrites its rows.
        let mut out: Vec<f32> = Vec::with_capacity(b * t * hq * d);
        let dst = DisjointWrites::spare(&mut out, b * t * hq * d);
        let blocks: Vec<_> = (0..b).map(|bi| query_blocks(mask, bi, t)).collect();
        // On candle's barrier pool with the products around it (one pool, not two spinning
        // against each other on the same cores); each thread's range of tasks shares a buffer.
        kernels::pool::on_pool(
            b * hq,
            || vec![0f32; t * t],
            |p, task| {
                let (bi, h) = (task / hq, task % hq);
                let g = h / (hq / hkv);
                for (rows, keys) in &blocks[bi] {
                    probabilities(dims, (q, k), (bi, h, g), (rows, *keys), mask, self.scale, p);
                    // SAFETY: task (bi, h) writes only head h's rows of batch row bi.
                    unsafe {
                        sgemm(
                            rows.len(),
                            d,
                            *keys,
                            (dst.at(dims.q_at(bi, h) + rows.start * dims.q_rs() as usize), 1, dims.q_rs()),
                            (p.as_ptr().add(rows.start * t), 1, t as isize),
                            (v.as_ptr().add(dims.kv_at(bi, g)), 1, dims.kv_rs()),
                            0.0,
                            1.0,
                        );
                    }
                }
            },
        );
        // SAFETY: the tasks above wrote all b × t × hq × d values.
        unsafe { out.set_len(b * t * hq * d) };
        Ok(out)
    }

    /// (dq, dk, dv) for the output gradient `dout`, given the forward's output `o`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward(
        &self,
        dims: Dims,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        o: &[f32],
        dout: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let mask = self.mask_data()?;
        let mask = mask.as_ref().map(|(m, per_row)| (m.as_slice(), *per_row));
        let Dims { b, t, hq, hkv, d } = dims;
        let n_rep = hq / hkv;
        // Not zeroed first (a memset on this thread while the pool waited): every task writes
        // its heads' dq and its kv head's dk and dv, the first query head of the group's first
        // block of rows without reading them, the others adding.
        let (mut dq, mut dk, mut dv) = (Vec::with_capacity(q.len()), Vec::with_capacity(k.len()), Vec::with_capacity(v.len()));
        let (dq_p, dk_p, dv_p) =
            (DisjointWrites::spare(&mut dq, q.len()), DisjointWrites::spare(&mut dk, k.len()), DisjointWrites::spare(&mut dv, v.len()));
        let (scale, level) = (self.scale, SimdLevel::current());
        let blocks: Vec<_> = (0..b).map(|bi| query_blocks(mask, bi, t)).collect();
        // One task per (batch row, kv head): it alone accumulates that kv head's dk and dv, over
        // the query heads sharing it.
        kernels::pool::on_pool(
            b * hkv,
            || (vec![0f32; t * t], vec![0f32; t * t], vec![0f32; t]),
            |(p, dp, delta), task| {
                let (bi, g) = (task / hkv, task % hkv);
                let (qa, kva) = (|h: usize, i: usize| dims.q_at(bi, h) + i * hq * d, dims.kv_at(bi, g));
                let (q_rs, kv_rs, tt) = (dims.q_rs(), dims.kv_rs(), t as isize);
                let blocks = &blocks[bi];
                // dk and dv: written by the group's first head in its first block, added to after.
                // Keys that block does not reach start at zero.
                let first_reach = blocks.first().map_or(t, |(_, keys)| *keys);
                for j in first_reach..t {
                    // SAFETY: key row j of kv head g of batch row bi, this task's own.
                    unsafe {
                        std::ptr::write_bytes(dk_p.at(kva + j * hkv * d), 0, d);
                        std::ptr::write_bytes(dv_p.at(kva + j * hkv * d), 0, d);
                    }
                }
                for h in g * n_rep..(g + 1) * n_rep {
                    for (n, (rows, keys)) in blocks.iter().enumerate() {
                        let (r, e, at) = (rows.len(), *keys, rows.start * t);
                        let kv_alpha = if h == g * n_rep && n == 0 { 0.0 } else { 1.0 };
                        probabilities(dims, (q, k), (bi, h, g), (rows, e), mask, scale, p);
                        // delta_i = dout_i · o_i: the softmax backward's row term.
                        for i in rows.clone() {
                            let at = qa(h, i);
                            delta[i] = dot(&dout[at..at + d], &o[at..at + d], level);
                        }
                        // SAFETY: this task writes head h's rows of dq (h belongs to group g only)
                        // and kv head g's rows of dk and dv; all other reads are of inputs.
                        unsafe {
                            // dv_g += pᵀ dout_h
                            let dout_h = dout.as_ptr().add(qa(h, rows.start));
                            sgemm(e, d, r, (dv_p.at(kva), 1, kv_rs), (p.as_ptr().add(at), tt, 1), (dout_h, 1, q_rs), kv_alpha, 1.0);
                            // dp = dout_h v_gᵀ
                            sgemm(r, e, d, (dp.as_mut_ptr().add(at), 1, tt), (dout_h, 1, q_rs), (v.as_ptr().add(kva), kv_rs, 1), 0.0, 1.0);
                        }
                        // ds = p ∘ (dp - delta), into p.
                        for i in rows.clone() {
                            let (pr, dpr) = (&mut p[i * t..i * t + e], &dp[i * t..i * t + e]);
                            for (pv, dpv) in pr.iter_mut().zip(dpr) {
                                *pv *= dpv - delta[i];
                            }
                        }
                        // SAFETY: as above: head h's rows of dq and kv head g's rows of dk are
                        // this task's; ds is this task's scratch, q and k are inputs.
                        unsafe {
                            let (ds, q_h) = (p.as_ptr().add(at), q.as_ptr().add(qa(h, rows.start)));
                            // dq_h = scale · ds k_g
                            sgemm(r, d, e, (dq_p.at(qa(h, rows.start)), 1, q_rs), (ds, 1, tt), (k.as_ptr().add(kva), 1, kv_rs), 0.0, scale);
                            // dk_g += scale · dsᵀ q_h
                            sgemm(e, d, r, (dk_p.at(kva), 1, kv_rs), (ds, tt, 1), (q_h, 1, q_rs), kv_alpha, scale);
                        }
                    }
                }
            },
        );
        // SAFETY: the tasks above wrote every value of the three (each (batch row, head) once).
        unsafe {
            dq.set_len(q.len());
            dk.set_len(k.len());
            dv.set_len(v.len());
        }
        Ok((dq, dk, dv))
    }
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "fused-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = Dims::of(ql.dims(), kl.dims());
        let out = self.forward(dims, f32_slice(qs, ql)?, f32_slice(ks, kl)?, f32_slice(vs, vl)?)?;
        Ok((CpuStorage::F32(out), ql.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dims = Dims::of(q.dims(), k.dims());
        let dout = dout.contiguous()?;
        // q, k, v and o are the op's own contiguous inputs and output: read in place.
        let guards = [q, k, v, o, &dout].map(|t| t.storage_and_layout());
        let slice = |i: usize| -> Result<&[f32]> {
            match &*guards[i].0 {
                Storage::Cpu(cpu) => f32_slice(cpu, guards[i].1),
                _ => candle_core::bail!("attention: the backward runs on the CPU"),
            }
        };
        let (dq, dk, dv) = self.backward(dims, slice(0)?, slice(1)?, slice(2)?, slice(3)?, slice(4)?)?;
        drop(guards);
        let dev = q.device();
        Ok((
            Some(Tensor::from_vec(dq, q.shape(), dev)?),
            Some(Tensor::from_vec(dk, k.shape(), dev)?),
            Some(Tensor::from_vec(dv, v.shape(), dev)?),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check_fd, grads, max_rel, rand};
    use candle_core::{DType, Device, Var, D};

    /// What the training path computed before: heads transposed, k/v repeated, scores,
    /// softmax, weighted sum, transposed back.
    fn composite(t: &[Tensor], mask: Option<&Tensor>, scale: f64) -> Result<Tensor> {
        let (b, s, hq, d) = t[0].dims4()?;
        let hkv = t[1].dim(2)?;
        let heads = |x: &Tensor| x.transpose(1, 2)?.contiguous();
        let repeat = |x: Tensor| -> Result<Tensor> { x.unsqueeze(2)?.expand((b, hkv, hq / hkv, s, d))?.reshape((b, hq, s, d)) };
        let (q, k, v) = (heads(&t[0])?, repeat(heads(&t[1])?)?, repeat(heads(&t[2])?)?);
        let scores = (q.matmul(&k.t()?)? * scale)?;
        let scores = match mask {
            Some(m) => scores.broadcast_add(&m.to_dtype(scores.dtype())?)?,
            None => scores,
        };
        let p = candle_nn::ops::softmax(&scores, D::Minus1)?;
        p.matmul(&v)?.transpose(1, 2)?.reshape((b, s, hq * d))
    }

    /// An additive (b, 1, s, s) mask: 0 where `keep(row, i, j)`, else -inf.
    fn mask_of(b: usize, s: usize, keep: impl Fn(usize, usize, usize) -> bool) -> Tensor {
        let values: Vec<f32> = (0..b * s * s)
            .map(|x| match keep(x / (s * s), (x / s) % s, x % s) {
                true => 0.0,
                false => f32::NEG_INFINITY,
            })
            .collect();
        Tensor::from_vec(values, (b, 1, s, s), &Device::Cpu).unwrap()
    }

    /// 5 tokens: one block of query rows; 70: three blocks (32, 32, 6), each reading the keys
    /// up to its last row's reach.
    #[test]
    fn attention_matches_the_composite_ops_and_finite_differences() {
        for s in [5, 70] {
            let (b, hq, hkv, d) = (2, 4, 2, 8);
            let (q, k, v) = (rand(&[b, s, hq, d], 21, 1.5), rand(&[b, s, hkv, d], 22, 1.5), rand(&[b, s, hkv, d], 23, 1.0));
            let probe = rand(&[b, s, hq * d], 24, 1.0);
            let causal = mask_of(1, s, |_, i, j| j <= i).reshape((s, s)).unwrap();
            // Packed rows: row 0 one sequence, row 1 two (positions 0..split and split..), each causal.
            let split = 2 * s / 5;
            let packed = mask_of(b, s, |r, i, j| j <= i && (r == 0 || (i < split) == (j < split)));
            // Keys past `shown` masked from every row: the last block of rows reads only those
            // keys, and the others' gradients must come out zero.
            let shown = 5 * s / 7;
            let prefix = mask_of(b, s, |_, i, j| j <= i && j < shown);
            let scale = 1.0 / (d as f64).sqrt();
            for (name, mask) in [("none", None), ("causal", Some(&causal)), ("packed", Some(&packed)), ("prefix", Some(&prefix))] {
                let inputs = [q.clone(), k.clone(), v.clone()];
                let reference = |t: &[Tensor]| composite(t, mask, scale);
                let got = attention(&q, &k, &v, mask, scale).unwrap();
                let want = reference(&inputs).unwrap();
                assert!(max_rel(&got, &want) < 1e-5, "{s} tokens, {name} mask: {}", max_rel(&got, &want));
                let vars = inputs.each_ref().map(|t| Var::from_tensor(t).unwrap());
                let fused = grads(&vars, &probe, &|t| attention(&t[0], &t[1], &t[2], mask, scale));
                let want = grads(&vars, &probe, &reference);
                for (which, (a, w)) in fused.iter().zip(&want).enumerate() {
                    assert!(max_rel(a, w) < 1e-4, "{s} tokens, {name} mask, input {which}: {}", max_rel(a, w));
                    check_fd(&inputs, which, &probe, a, &reference);
                }
                if name == "prefix" {
                    let hidden_keys = fused[1].narrow(1, shown, s - shown).unwrap();
                    assert_eq!(hidden_keys.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
                }
            }
        }
    }

    #[test]
    fn shapes_that_do_not_fit_are_refused() {
        let q = rand(&[1, 4, 3, 8], 1, 1.0);
        let k = rand(&[1, 4, 2, 8], 2, 1.0);
        assert!(attention(&q, &k, &k, None, 1.0).is_err(), "3 heads cannot share 2 kv heads");
        let bad_mask = Tensor::zeros((3, 3), DType::F32, &Device::Cpu).unwrap();
        let k = rand(&[1, 4, 1, 8], 3, 1.0);
        assert!(attention(&q, &k, &k, Some(&bad_mask), 1.0).is_err());
    }
}
