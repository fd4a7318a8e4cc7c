//! Quantising a block of activations to 8 bits with AVX2, as llama.cpp's x86 code does (the
//! products are in `tiles`).

use std::arch::x86_64::*;

use super::BLOCK;

/// ggml's AVX2 `quantize_row_q8_1` for one block of 32: writes the 8-bit values to `q` and returns
/// (`d`, `Σq`), `d = max|x| / 127`, the values rounded to nearest, ties to even.
///
/// # Safety
/// The CPU must have AVX2; `x` and `q` must hold 32 values.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    debug_assert!(x.len() >= BLOCK && q.len() >= BLOCK);
    let p = x.as_ptr();
    let v = [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
    let sign = _mm256_set1_ps(-0.0);
    let mut amax = _mm256_andnot_ps(sign, v[0]);
    for vi in &v[1..] {
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, *vi));
    }
    let m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
    let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    let d = m / 127.0;
    let id = _mm256_set1_ps(if m != 0.0 { 127.0 / m } else { 0.0 });
    let round = |x: __m256| _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    let (i0, i1, i2, i3) = (round(v[0]), round(v[1]), round(v[2]), round(v[3]));
    let sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    let s4 = _mm_add_epi32(_mm256_extracti128_si256(sum, 1), _mm256_castsi256_si128(sum));
    let s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    let total = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1)));
    // Packing interleaves the 128-bit lanes; the permute puts the 32 values back in order.
    let packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    let ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, ordered);
    (d, total)
}
