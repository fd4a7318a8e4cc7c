//! The two products of one query's attention over a run of cached positions whose key (value)
//! rows lie one after another: the scores `q · k_j`, and the weighted sum `Σ_j p_j v_j`.
//!
//! Done row by row with `dot` and `axpy`, each 64-wide row paid a call, a horizontal sum and a
//! load and store of the whole output; the AVX2 kernels here take four key rows per pass (one
//! horizontal reduction for four scores) and keep the output in registers across all the value
//! rows (docs/design.md, decoding and attention kernels).

use crate::gemv::{axpy, dot};
use crate::simd::SimdLevel;

/// `scores[j] = scale · (q · rows[j])` for the `scores.len()` rows of `q.len()` values each.
pub fn scores(q: &[f32], rows: &[f32], scale: f32, scores: &mut [f32], level: SimdLevel) {
    let d = q.len();
    debug_assert!(rows.len() >= scores.len() * d);
    #[cfg(target_arch = "x86_64")]
    {
        let level = level.usable();
        if level == SimdLevel::Avx512 && d.is_multiple_of(16) {
            // SAFETY: `usable` never exceeds the CPU's level, whose features the kernels of a
            // level need (AVX-512F, AVX2, FMA); the sizes were checked here.
            return unsafe { x86::scores_avx512(q, rows, scale, scores) };
        }
        if level >= SimdLevel::Avx2 && d.is_multiple_of(8) {
            // SAFETY: as above.
            return unsafe { x86::scores_avx2(q, rows, scale, scores) };
        }
    }
    for (j, s) in scores.iter_mut().enumerate() {
        *s = dot(q, &rows[j * d..(j + 1) * d], level) * scale;
    }
}

/// `out += Σ_j weights[j] · rows[j]` for rows of `out.len()` values each.
pub fn add_weighted_rows(out: &mut [f32], weights: &[f32], rows: &[f32], level: SimdLevel) {
    let d = out.len();
    debug_assert!(rows.len() >= weights.len() * d);
    #[cfg(target_arch = "x86_64")]
    {
        let level = level.usable();
        if level == SimdLevel::Avx512 && d.is_multiple_of(16) {
            // SAFETY: as in `scores`.
            return unsafe { x86::add_weighted_rows_avx512(out, weights, rows) };
        }
        if level >= SimdLevel::Avx2 && d.is_multiple_of(8) {
            // SAFETY: as in `scores`.
            return unsafe { x86::add_weighted_rows_avx2(out, weights, rows) };
        }
    }
    for (j, &w) in weights.iter().enumerate() {
        axpy(out, w, &rows[j * d..(j + 1) * d], level);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Four rows a pass, in four accumulators, then one reduction for the four sums.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scores_avx2(q: &[f32], rows: &[f32], scale: f32, scores: &mut [f32]) {
        let (d, m) = (q.len(), scores.len());
        let (pq, pr) = (q.as_ptr(), rows.as_ptr());
        let mut j = 0;
        while j + 4 <= m {
            let mut acc = [_mm256_setzero_ps(); 4];
            for i in (0..d).step_by(8) {
                let qv = _mm256_loadu_ps(pq.add(i));
                for (r, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm256_fmadd_ps(qv, _mm256_loadu_ps(pr.add((j + r) * d + i)), *acc);
                }
            }
            // hadd(hadd(a0, a1), hadd(a2, a3)) holds each row's sum split over the two halves.
            let t = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
            let sums = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
            _mm_storeu_ps(scores.as_mut_ptr().add(j), _mm_mul_ps(sums, _mm_set1_ps(scale)));
            j += 4;
        }
        while j < m {
            let mut acc = _mm256_setzero_ps();
            for i in (0..d).step_by(8) {
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(pq.add(i)), _mm256_loadu_ps(pr.add(j * d + i)), acc);
            }
            let half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            let pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
            let sum = _mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1));
            scores[j] = _mm_cvtss_f32(sum) * scale;
            j += 1;
        }
    }

    /// `add_weighted_rows` at one level: the output in registers, 8 vectors of `$lanes` values
    /// at a time, across all the rows; then one vector at a time.
    macro_rules! add_weighted_rows {
        ($name:ident, $features:literal, $lanes:literal, $load:ident, $store:ident, $fma:ident, $splat:ident) => {
            #[target_feature(enable = $features)]
            pub unsafe fn $name(out: &mut [f32], weights: &[f32], rows: &[f32]) {
                /// `out[c..c + lanes·W] += Σ_j weights[j] · rows[j][c..c + lanes·W]`.
                #[inline(always)]
                unsafe fn columns<const W: usize>(out: &mut [f32], weights: &[f32], rows: &[f32], c: usize) {
                    let d = out.len();
                    let (po, pr) = (out.as_mut_ptr().add(c), rows.as_ptr().add(c));
                    let mut acc = [$splat(0.0); W];
                    for (v, acc) in acc.iter_mut().enumerate() {
                        *acc = $load(po.add($lanes * v));
                    }
                    for (j, &w) in weights.iter().enumerate() {
                        let wv = $splat(w);
                        for (v, acc) in acc.iter_mut().enumerate() {
                            *acc = $fma(wv, $load(pr.add(j * d + $lanes * v)), *acc);
                        }
                    }
                    for (v, acc) in acc.iter().enumerate() {
                        $store(po.add($lanes * v), *acc);
                    }
                }
                let d = out.len();
                let mut c = 0;
                while c + 8 * $lanes <= d {
                    columns::<8>(out, weights, rows, c);
                    c += 8 * $lanes;
                }
                while c < d {
                    columns::<1>(out, weights, rows, c);
                    c += $lanes;
                }
            }
        };
    }

    add_weighted_rows!(add_weighted_rows_avx2, "avx2,fma", 8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_fmadd_ps, _mm256_set1_ps);
    add_weighted_rows!(
        add_weighted_rows_avx512,
        "avx512f,avx2,fma",
        16,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_fmadd_ps,
        _mm512_set1_ps
    );

    /// Eight rows a pass in 16-lane accumulators; each folded to eight lanes, then the AVX2
    /// reduction of four rows twice, its two halves' sums put side by side for one store.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn scores_avx512(q: &[f32], rows: &[f32], scale: f32, scores: &mut [f32]) {
        let (d, m) = (q.len(), scores.len());
        let (pq, pr) = (q.as_ptr(), rows.as_ptr());
        let mut j = 0;
        while j + 8 <= m {
            let mut acc = [_mm512_setzero_ps(); 8];
            for i in (0..d).step_by(16) {
                let qv = _mm512_loadu_ps(pq.add(i));
                for (r, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm512_fmadd_ps(qv, _mm512_loadu_ps(pr.add((j + r) * d + i)), *acc);
                }
            }
            // The upper eight lanes through the f64 view: `extractf32x8` would need AVX-512DQ.
            let f =
                acc.map(|a| _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)))));
            // As in `scores_avx2`: each 128-bit half of t0 holds a part of rows 0-3's sums, t1's
            // of rows 4-7's; adding the low halves to the high ones gives the eight sums in order.
            let t0 = _mm256_hadd_ps(_mm256_hadd_ps(f[0], f[1]), _mm256_hadd_ps(f[2], f[3]));
            let t1 = _mm256_hadd_ps(_mm256_hadd_ps(f[4], f[5]), _mm256_hadd_ps(f[6], f[7]));
            let sums = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(t0, t1), _mm256_permute2f128_ps::<0x31>(t0, t1));
            _mm256_storeu_ps(scores.as_mut_ptr().add(j), _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
            j += 8;
        }
        while j < m {
            let mut acc = _mm512_setzero_ps();
            for i in (0..d).step_by(16) {
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(pq.add(i)), _mm512_loadu_ps(pr.add(j * d + i)), acc);
            }
            scores[j] = _mm512_reduce_add_ps(acc) * scale;
            j += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::rng::signed_values as data;

    /// Every level this CPU has gives the row-by-row results, for row counts with and without a
    /// tail of the four- and eight-row passes and widths with and without a tail of 64 (128 at
    /// AVX-512), and widths AVX-512 leaves to AVX2 (not a multiple of 16).
    #[test]
    fn kernels_match_row_by_row() {
        let best = SimdLevel::detected();
        for (d, m) in [(64, 1), (64, 7), (64, 19), (128, 32), (48, 9), (80, 17), (256, 8), (72, 5), (8, 4), (12, 3)] {
            let (q, rows) = (data(d, 1), data(m * d, 2));
            let want_s: Vec<f32> = (0..m).map(|j| q.iter().zip(&rows[j * d..]).map(|(a, b)| a * b).sum::<f32>() * 0.125).collect();
            let weights = data(m, 3);
            let start = data(d, 4);
            let want_o: Vec<f32> = (0..d).map(|i| start[i] + (0..m).map(|j| weights[j] * rows[j * d + i]).sum::<f32>()).collect();
            for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512].into_iter().filter(|l| *l <= best) {
                let mut s = vec![0f32; m];
                scores(&q, &rows, 0.125, &mut s, level);
                let mut o = start.clone();
                add_weighted_rows(&mut o, &weights, &rows, level);
                for (got, want) in [(&s, &want_s), (&o, &want_o)] {
                    let worst = got.iter().zip(want.iter()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(worst < 1e-5 * (d as f32), "{level:?} d {d} m {m}: off by {worst}");
                }
            }
        }
    }
}
