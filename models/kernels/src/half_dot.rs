//! Dot products of f32 activations with f16 / bf16 weight rows, the weights widened to f32 in
//! registers (F16C's `vcvtph2ps`; bf16 is the top half of an f32, so a shift), never copied to an
//! f32 matrix: decoding reads half the bytes of f32 weights. What the matrix-vector kernel
//! (`kernels::gemv_t`) calls for f16 and bf16 weights.

use half::{bf16, f16};

use crate::gemv::GemvWeight;
use crate::gemv_layout::LayoutChooser;
use crate::simd::SimdLevel;

/// [`GemvWeight`] for a half type: its x86 kernels at AVX2 and above, widening value by value
/// below.
macro_rules! half_weight {
    ($elem:ty, $dot_rows:ident, $dot_rows_avx512:ident) => {
        impl GemvWeight for $elem {
            fn dot_rows<const R: usize>(x: &[f32], w: &[Self], next: &[Self], level: SimdLevel) -> [f32; R] {
                debug_assert_eq!(w.len(), R * x.len());
                #[cfg(target_arch = "x86_64")]
                {
                    // SAFETY: `usable` never exceeds the CPU's level; AVX2's includes F16C and
                    // FMA, AVX-512's all of AVX2's; w holds R rows of x.len() values.
                    match level.usable() {
                        SimdLevel::Avx512 => return unsafe { x86::$dot_rows_avx512(x, w, next) },
                        SimdLevel::Avx2 => return unsafe { x86::$dot_rows(x, w, next) },
                        SimdLevel::Scalar => {}
                    }
                }
                let _ = next;
                std::array::from_fn(|k| {
                    let row = &w[k * x.len()..(k + 1) * x.len()];
                    x.iter().zip(row).map(|(a, b)| a * b.to_f32()).sum()
                })
            }

            fn layout_chooser() -> &'static LayoutChooser {
                static CHOOSER: LayoutChooser = LayoutChooser::new();
                &CHOOSER
            }
        }
    };
}

half_weight!(f16, dot_f16_rows, dot_f16_rows_avx512);
half_weight!(bf16, dot_bf16_rows, dot_bf16_rows_avx512);

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::{bf16, f16};

    /// `R` rows at once (as the f32 kernel: one accumulator of `$lanes` lanes per row, x loaded
    /// once for all), prefetching `next`'s rows when it holds as many. AVX-512 widens 16 values
    /// an instruction where AVX2 widens 8: on Zen 4 the AVX2 loop read f16 rows below the speed
    /// the memory gives (docs/design.md, "f16 and bf16 rows widened 16 at a time at AVX-512").
    /// `avx2` and `avx512` name the vector width; its operations are stated once, in its arm.
    macro_rules! dot_rows_widened {
        (avx2 $name:ident, $elem:ty, $features:literal, |$p:ident| $widen:expr) => {
            dot_rows_widened!(@ $name, $elem, $features, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps,
                |$p| $widen, |v| sum_lanes_avx2(v));
        };
        (avx512 $name:ident, $elem:ty, $features:literal, |$p:ident| $widen:expr) => {
            dot_rows_widened!(@ $name, $elem, $features, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps,
                |$p| $widen, |v| _mm512_reduce_add_ps(v));
        };
        (@ $name:ident, $elem:ty, $features:literal, $lanes:literal, $zero:ident, $load:ident, $fma:ident,
         |$p:ident| $widen:expr, |$v:ident| $sum:expr) => {
            #[target_feature(enable = $features)]
            pub unsafe fn $name<const R: usize>(x: &[f32], w: &[$elem], next: &[$elem]) -> [f32; R] {
                let d = x.len();
                let (px, pw, pn) = (x.as_ptr(), w.as_ptr() as *const u16, next.as_ptr() as *const u16);
                let widen = |$p: *const u16| $widen;
                let prefetch = next.len() == w.len();
                let mut acc = [$zero(); R];
                let mut i = 0;
                while i + $lanes <= d {
                    // A 64-byte line holds 32 half values: one prefetch per row and line.
                    if prefetch && i % 32 == 0 {
                        for k in 0..R {
                            _mm_prefetch::<_MM_HINT_T0>(pn.add(k * d + i) as *const i8);
                        }
                    }
                    let xv = $load(px.add(i));
                    for (k, acc) in acc.iter_mut().enumerate() {
                        *acc = $fma(xv, widen(pw.add(k * d + i)), *acc);
                    }
                    i += $lanes;
                }
                // A loop, not `array::from_fn`: a closure does not inherit the target features,
                // so its intrinsics became calls, once per row.
                let mut sums = [0f32; R];
                for (k, sum) in sums.iter_mut().enumerate() {
                    let $v = acc[k];
                    *sum = $sum;
                    for j in i..d {
                        *sum += x[j] * w[k * d + j].to_f32();
                    }
                }
                sums
            }
        };
    }

    /// The sum of an AVX2 accumulator's eight lanes, in lane order.
    #[inline(always)]
    unsafe fn sum_lanes_avx2(v: __m256) -> f32 {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), v);
        lanes.iter().sum()
    }

    dot_rows_widened!(avx2 dot_f16_rows, f16, "avx2,fma,f16c", |p| _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)));
    dot_rows_widened!(avx512 dot_f16_rows_avx512, f16, "avx512f,avx2,fma,f16c", |p| _mm512_cvtph_ps(_mm256_loadu_si256(
        p as *const __m256i
    )));
    // bf16 is the top half of an f32: widen to 32 bits and shift into place.
    dot_rows_widened!(avx2 dot_bf16_rows, bf16, "avx2,fma", |p| _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)),
        16
    )));
    dot_rows_widened!(avx512 dot_bf16_rows_avx512, bf16, "avx512f,avx2,fma", |p| _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i)),
        16
    )));
}
