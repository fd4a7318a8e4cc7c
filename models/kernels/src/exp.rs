//! e^x for softmaxes (attention, the loss): Cephes' polynomial, branch-free, with AVX2 and
//! AVX-512 loops that give the scalar function's bits; and the rest of a softmax row in vector
//! lanes (its max, e^(x - max) with their sum, an attention row's scale and mask), which as
//! plain loops ran one value at a time (a float max or sum does not vectorise on its own).

use crate::simd::SimdLevel;

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
        // SAFETY: the current level never exceeds the CPU's (its features are all present).
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
    {
        // SAFETY: the current level never exceeds the CPU's (its features are all present).
        match SimdLevel::current() {
            SimdLevel::Avx512 => return unsafe { x86::exp_shifted_sum_avx512(x, shift) },
            SimdLevel::Avx2 => return unsafe { x86::exp_shifted_sum_avx2(x, shift) },
            SimdLevel::Scalar => {}
        }
    }
    x.iter_mut().fold(0.0, |sum, v| {
        *v = exp_f32(*v - shift);
        sum + *v
    })
}

/// The largest value of `x`, NaN ignored as `f32::max` ignores it (-inf for none): a softmax
/// row's shift, in vector lanes (the max is exact in any order).
pub fn max_of(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the current level never exceeds the CPU's (its features are all present).
        match SimdLevel::current() {
            SimdLevel::Avx512 => return unsafe { x86::max_avx512(x) },
            SimdLevel::Avx2 => return unsafe { x86::max_avx2(x) },
            SimdLevel::Scalar => {}
        }
    }
    x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// The index of the largest value of `x`, the first one where several are equal: candle's
/// `argmax` (which keeps the first value unless a later one is larger, so a NaN first value
/// stays, and later NaNs are passed over), in two vector passes: the max ([`max_of`]), then
/// where it first occurs. Greedy decoding takes it over the vocabulary every token, on the
/// calling thread while the pool's other threads wait, where candle's loop went one value at
/// a time (docs/design.md, "greedy's argmax in vector passes"). None for an empty `x`.
pub fn argmax(x: &[f32]) -> Option<usize> {
    match x.first() {
        None => None,
        Some(first) if first.is_nan() => Some(0),
        Some(_) => {
            let max = max_of(x);
            // 16 at a time, so the search runs in vector compares until the block holding it.
            let block = x.chunks(16).position(|c| c.contains(&max)).expect("the max is one of the values");
            let within = x[block * 16..].iter().position(|v| *v == max).expect("the block holds the max");
            Some(block * 16 + within)
        }
    }
}

/// A row of attention scores made probabilities in place: `row = softmax(row · scale + mask)`
/// (an additive mask of the row's length). Three passes, each a vector loop: the scaled, masked
/// scores and their max; e^(s - max) and their sum ([`exp_shifted_sum`]); the division. The
/// max ignores NaN as `f32::max` does; a row masked out in full comes out NaN, as the plain
/// softmax's does.
pub fn softmax_row(row: &mut [f32], scale: f32, mask: Option<&[f32]>) {
    if let Some(m) = mask {
        assert_eq!(m.len(), row.len(), "softmax_row: a mask of another length");
    }
    let max = scaled_max(row, scale, mask);
    let inv = 1.0 / exp_shifted_sum(row, max);
    row.iter_mut().for_each(|s| *s *= inv);
}

/// `row[j] = row[j] · scale + mask[j]` (a multiply, then an add: the same roundings at every
/// level), returning their max.
fn scaled_max(row: &mut [f32], scale: f32, mask: Option<&[f32]>) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the current level never exceeds the CPU's (its features are all present).
        match SimdLevel::current() {
            SimdLevel::Avx512 => return unsafe { x86::scaled_max_avx512(row, scale, mask) },
            SimdLevel::Avx2 => return unsafe { x86::scaled_max_avx2(row, scale, mask) },
            SimdLevel::Scalar => {}
        }
    }
    scaled_max_scalar(row, scale, mask, f32::NEG_INFINITY)
}

/// [`scaled_max`] one value at a time, from a running max `max` (the vector loops' tails).
fn scaled_max_scalar(row: &mut [f32], scale: f32, mask: Option<&[f32]>, mut max: f32) -> f32 {
    for (j, v) in row.iter_mut().enumerate() {
        *v = *v * scale + mask.map_or(0.0, |m| m[j]);
        max = max.max(*v);
    }
    max
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `exp_f32` on 16 lanes, written out: compiled from `exp_f32`, the loop converted the
    /// exponent to an integer one lane at a time (compares and conditional moves for the
    /// saturating cast), a visible share of a training step (docs/design.md).
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

    /// [`exp_shifted_sum_avx2`] 16 lanes at a time, each half added to the same 8 partial sums
    /// in the order the AVX2 loop adds them: the same bits.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn exp_shifted_sum_avx512(x: &mut [f32], shift: f32) -> f32 {
        let whole = x.len() / 16 * 16;
        let p = x.as_mut_ptr();
        let (shift16, mut sum8) = (_mm512_set1_ps(shift), _mm256_setzero_ps());
        for i in (0..whole).step_by(16) {
            let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p.add(i)), shift16));
            _mm512_storeu_ps(p.add(i), e);
            sum8 = _mm256_add_ps(sum8, _mm512_castps512_ps256(e));
            sum8 = _mm256_add_ps(sum8, _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(e))));
        }
        exp_shifted_sum_from(&mut x[whole..], shift, sum8)
    }

    /// `x[i] = e^(x[i] - shift)`, returning their sum (8 partial sums, then the tail's).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_shifted_sum_avx2(x: &mut [f32], shift: f32) -> f32 {
        exp_shifted_sum_from(x, shift, _mm256_setzero_ps())
    }

    /// [`exp_shifted_sum_avx2`] continuing from partial sums `sum8`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp_shifted_sum_from(x: &mut [f32], shift: f32, mut sum8: __m256) -> f32 {
        let whole = x.len() / 8 * 8;
        let p = x.as_mut_ptr();
        let shift8 = _mm256_set1_ps(shift);
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

    /// [`super::max_of`] 16 lanes at a time (`max(x, acc)` keeps acc where x is NaN).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn max_avx512(x: &[f32]) -> f32 {
        let whole = x.len() / 16 * 16;
        let mut acc = _mm512_set1_ps(f32::NEG_INFINITY);
        for i in (0..whole).step_by(16) {
            acc = _mm512_max_ps(_mm512_loadu_ps(x.as_ptr().add(i)), acc);
        }
        let mut lanes = [0f32; 16];
        _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
        lanes.iter().chain(&x[whole..]).fold(f32::NEG_INFINITY, |a, b| a.max(*b))
    }

    /// [`super::max_of`] 8 lanes at a time.
    #[target_feature(enable = "avx2")]
    pub unsafe fn max_avx2(x: &[f32]) -> f32 {
        let whole = x.len() / 8 * 8;
        let mut acc = _mm256_set1_ps(f32::NEG_INFINITY);
        for i in (0..whole).step_by(8) {
            acc = _mm256_max_ps(_mm256_loadu_ps(x.as_ptr().add(i)), acc);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        lanes.iter().chain(&x[whole..]).fold(f32::NEG_INFINITY, |a, b| a.max(*b))
    }

    /// [`super::scaled_max`] 16 lanes at a time. `max(s, acc)` keeps acc where s is NaN, as
    /// `f32::max` ignores NaN.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn scaled_max_avx512(row: &mut [f32], scale: f32, mask: Option<&[f32]>) -> f32 {
        let whole = row.len() / 16 * 16;
        let (p, scale16, mut acc) = (row.as_mut_ptr(), _mm512_set1_ps(scale), _mm512_set1_ps(f32::NEG_INFINITY));
        for i in (0..whole).step_by(16) {
            let mut s = _mm512_mul_ps(_mm512_loadu_ps(p.add(i)), scale16);
            if let Some(m) = mask {
                s = _mm512_add_ps(s, _mm512_loadu_ps(m.as_ptr().add(i)));
            }
            _mm512_storeu_ps(p.add(i), s);
            acc = _mm512_max_ps(s, acc);
        }
        let mut lanes = [0f32; 16];
        _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
        let max = lanes.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b));
        super::scaled_max_scalar(&mut row[whole..], scale, mask.map(|m| &m[whole..]), max)
    }

    /// [`super::scaled_max`] 8 lanes at a time (see [`scaled_max_avx512`]).
    #[target_feature(enable = "avx2")]
    pub unsafe fn scaled_max_avx2(row: &mut [f32], scale: f32, mask: Option<&[f32]>) -> f32 {
        let whole = row.len() / 8 * 8;
        let (p, scale8, mut acc) = (row.as_mut_ptr(), _mm256_set1_ps(scale), _mm256_set1_ps(f32::NEG_INFINITY));
        for i in (0..whole).step_by(8) {
            let mut s = _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), scale8);
            if let Some(m) = mask {
                s = _mm256_add_ps(s, _mm256_loadu_ps(m.as_ptr().add(i)));
            }
            _mm256_storeu_ps(p.add(i), s);
            acc = _mm256_max_ps(s, acc);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        let max = lanes.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b));
        super::scaled_max_scalar(&mut row[whole..], scale, mask.map(|m| &m[whole..]), max)
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
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::rng::signed_values as data;

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

    /// Rows of 1 to 1,000 scores, with and without a mask (-inf at every third key): the
    /// softmax of the scaled, masked scores to f64's within 1e-6; each vector loop of the
    /// passes this CPU can run gives the scalar max pass's bits and the AVX2 sum's (AVX-512
    /// adds its halves in AVX2's order); a row masked out in full, or with a NaN score, is NaN.
    #[test]
    fn softmax_rows_match_f64_and_agree_across_levels() {
        for n in [1, 7, 8, 16, 31, 33, 128, 1000] {
            let scores: Vec<f32> = data(n, 11).iter().map(|v| v * 8.0).collect();
            let masked: Vec<f32> = (0..n).map(|j| if j % 3 == 2 { f32::NEG_INFINITY } else { j as f32 * 0.01 }).collect();
            for mask in [None, Some(&masked[..])] {
                let s: Vec<f64> = (0..n).map(|j| (scores[j] * 0.125 + mask.map_or(0.0, |m| m[j])) as f64).collect();
                let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = s.iter().map(|v| (v - max).exp()).sum();
                let mut got = scores.clone();
                softmax_row(&mut got, 0.125, mask);
                for (j, g) in got.iter().enumerate() {
                    let want = (s[j] - max).exp() / total;
                    assert!((*g as f64 - want).abs() <= 1e-6 * want + 1e-30, "{n} scores, key {j}: {g} vs {want}");
                }
                #[cfg(target_arch = "x86_64")]
                if SimdLevel::detected() >= SimdLevel::Avx2 {
                    let mut want = scores.clone();
                    let want_max = scaled_max_scalar(&mut want, 0.125, mask, f32::NEG_INFINITY);
                    let mut want_exp = want.clone();
                    // SAFETY: the CPU has AVX2 and FMA (checked above).
                    let want_sum = unsafe { x86::exp_shifted_sum_avx2(&mut want_exp, want_max) };
                    type MaxLoop = unsafe fn(&mut [f32], f32, Option<&[f32]>) -> f32;
                    type SumLoop = unsafe fn(&mut [f32], f32) -> f32;
                    let loops: [(SimdLevel, MaxLoop, SumLoop); 2] = [
                        (SimdLevel::Avx2, x86::scaled_max_avx2, x86::exp_shifted_sum_avx2),
                        (SimdLevel::Avx512, x86::scaled_max_avx512, x86::exp_shifted_sum_avx512),
                    ];
                    for (level, max_loop, sum_loop) in loops.into_iter().filter(|(l, _, _)| *l <= SimdLevel::detected()) {
                        let mut row = scores.clone();
                        // SAFETY: the CPU has the level's instructions.
                        let max = unsafe { max_loop(&mut row, 0.125, mask) };
                        assert_eq!((max.to_bits(), bits(&row)), (want_max.to_bits(), bits(&want)), "{level:?}, {n} scores: the max pass");
                        // SAFETY: as above.
                        let sum = unsafe { sum_loop(&mut row, max) };
                        assert_eq!(
                            (sum.to_bits(), bits(&row)),
                            (want_sum.to_bits(), bits(&want_exp)),
                            "{level:?}, {n} scores: e^x and the sum"
                        );
                    }
                }
            }
        }
        let mut all_masked = vec![1.0f32; 20];
        softmax_row(&mut all_masked, 1.0, Some(&[f32::NEG_INFINITY; 20]));
        assert!(all_masked.iter().all(|v| v.is_nan()), "{all_masked:?}");
        let mut with_nan = vec![1.0f32; 20];
        with_nan[17] = f32::NAN;
        softmax_row(&mut with_nan, 1.0, None);
        assert!(with_nan.iter().all(|v| v.is_nan()), "{with_nan:?}");
    }

    /// The index candle's argmax gives, over rows with ties, signed zeros, infinities and NaN
    /// (first, inside, everywhere), at every length to 70 and at a vocabulary's.
    #[test]
    fn argmax_is_candles() {
        let candle = |x: &[f32]| {
            let t = candle_core::Tensor::from_slice(x, x.len(), &candle_core::Device::Cpu).unwrap();
            t.argmax(0).unwrap().to_scalar::<u32>().unwrap() as usize
        };
        let mut rows: Vec<Vec<f32>> = (1..70).map(|n| data(n, 7).iter().map(|v| (v * 6.0).round()).collect()).collect();
        rows.push(data(49_152, 3));
        for n in [1usize, 5, 17, 40] {
            let mut x: Vec<f32> = data(n, 11).iter().map(|v| v - 2.0).collect();
            rows.push(x.clone());
            x[0] = f32::NAN;
            rows.push(x.clone());
            x[0] = -0.0;
            x[n - 1] = 0.0;
            rows.push(x.clone());
            x[n / 2] = f32::NAN;
            rows.push(x.clone());
            x[n / 3] = f32::INFINITY;
            x[n - 1] = f32::INFINITY;
            rows.push(x.clone());
            rows.push(vec![f32::NAN; n]);
            rows.push(vec![f32::NEG_INFINITY; n]);
        }
        for x in &rows {
            assert_eq!(argmax(x), Some(candle(x)), "{x:?}");
        }
        assert_eq!(argmax(&[]), None);
    }

    /// The max of rows of every length to 70 (NaN and -inf among them), at every level this
    /// CPU has: `f32::max`'s fold, which ignores NaN.
    #[test]
    fn max_of_is_the_folds_max_on_every_level() {
        for n in 0..70 {
            let mut x: Vec<f32> = data(n, 13).iter().map(|v| v * 9.0 - 20.0).collect();
            if n > 3 {
                (x[n / 2], x[n - 1]) = (f32::NAN, f32::NEG_INFINITY);
            }
            let want = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max_of(&x).to_bits(), want.to_bits(), "{n} values");
            #[cfg(target_arch = "x86_64")]
            {
                type MaxLoop = unsafe fn(&[f32]) -> f32;
                let loops: [(SimdLevel, MaxLoop); 2] = [(SimdLevel::Avx2, x86::max_avx2), (SimdLevel::Avx512, x86::max_avx512)];
                for (level, max_loop) in loops.into_iter().filter(|(l, _)| *l <= SimdLevel::detected()) {
                    // SAFETY: the CPU has the level's instructions.
                    assert_eq!(unsafe { max_loop(&x) }.to_bits(), want.to_bits(), "{level:?}, {n} values");
                }
            }
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
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
