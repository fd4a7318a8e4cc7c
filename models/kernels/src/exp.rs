//! e^x for softmaxes (attention, the loss): Cephes' polynomial, branch-free, with AVX2 and
//! AVX-512 loops that give the scalar function's bits.

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
    if SimdLevel::current() >= SimdLevel::Avx2 {
        // SAFETY: the current level is at least AVX2, so the CPU has AVX2 and FMA.
        return unsafe { x86::exp_shifted_sum_avx2(x, shift) };
    }
    x.iter_mut().fold(0.0, |sum, v| {
        *v = exp_f32(*v - shift);
        sum + *v
    })
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
