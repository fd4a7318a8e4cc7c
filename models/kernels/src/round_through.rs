//! f32 values rounded through bf16 or f16 in place: what sending them in that dtype does to them
//! (the FSDP engine's gathers and reductions in `--param-dtype` / `--reduce-dtype`). Half's
//! conversions, value by value, were a tenth of a bf16 training step of the 28M Llama (docs/
//! design.md); this runs 8 values an instruction on the pool's threads.

use half::{bf16, f16};

use crate::pool::pool_chunks_mut;
use crate::simd::SimdLevel;

/// The 2-byte dtypes values can be rounded through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    Bf16,
    F16,
}

/// Values a thread rounds at a time: below this the pool's wake-up costs more than it saves.
const PIECE: usize = 1 << 16;

/// Rounds every value of `v` to `half` (to nearest, ties to even, as half's `from_f32`) and
/// back to f32, over the pool's threads.
pub fn round_through(v: &mut [f32], half: Half) {
    let threads = candle_core::utils::get_num_threads().max(1);
    let piece = v.len().div_ceil(threads).max(PIECE);
    let level = SimdLevel::current();
    pool_chunks_mut(v, piece, |_, part| round_at(part, half, level));
}

/// [`round_through`] of one piece on the calling thread, with the kernels of `level`.
fn round_at(v: &mut [f32], half: Half, level: SimdLevel) {
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Avx2 {
        // SAFETY: the level says the CPU has AVX2 and F16C.
        return unsafe { x86::round_avx2(v, half) };
    }
    let _ = level;
    round_scalar(v, half);
}

fn round_scalar(v: &mut [f32], half: Half) {
    match half {
        Half::Bf16 => v.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32()),
        Half::F16 => v.iter_mut().for_each(|x| *x = f16::from_f32(*x).to_f32()),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{round_scalar, Half};

    /// Eight values at a time: bf16 by integer rounding of the bits (NaN kept a quiet NaN, as
    /// half does), f16 by F16C's conversions (to nearest even, subnormals kept).
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn round_avx2(v: &mut [f32], half: Half) {
        let mut chunks = v.chunks_exact_mut(8);
        for c in &mut chunks {
            let x = _mm256_loadu_ps(c.as_ptr());
            let rounded = match half {
                Half::Bf16 => {
                    let bits = _mm256_castps_si256(x);
                    let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
                    let up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
                    let top = _mm256_and_si256(up, _mm256_set1_epi32(0xffff_0000u32 as i32));
                    let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
                    // half's NaN: the top half of the bits with the quiet bit set.
                    let quiet =
                        _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0xffff_0000u32 as i32)), _mm256_set1_epi32(0x0040_0000));
                    _mm256_blendv_ps(_mm256_castsi256_ps(top), _mm256_castsi256_ps(quiet), nan)
                }
                Half::F16 => _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x)),
            };
            _mm256_storeu_ps(c.as_mut_ptr(), rounded);
        }
        round_scalar(chunks.into_remainder(), half);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::signed_values;

    /// Every level gives half's rounding, for ties both ways, values that round to infinity,
    /// subnormals of f32 and of f16, infinities and NaNs, and a remainder past whole vectors.
    #[test]
    fn each_level_rounds_as_half() {
        let mut values: Vec<f32> = signed_values(4099, 5).iter().map(|v| v * 7e4).collect();
        values.extend(signed_values(1000, 6).iter().map(|v| v * 1e-5));
        values.extend([
            0.0f32,
            -0.0,
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0x3f80_1000),
            f32::MAX,
            f32::MIN,
            65520.0,
            f32::MIN_POSITIVE / 3.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
        ]);
        for half in [Half::Bf16, Half::F16] {
            let mut want = values.clone();
            round_scalar(&mut want, half);
            for level in [SimdLevel::Scalar, SimdLevel::Avx2] {
                if level > SimdLevel::detected() {
                    continue;
                }
                let mut got = values.clone();
                round_at(&mut got, half, level);
                for ((g, w), v) in got.iter().zip(&want).zip(&values) {
                    let same = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
                    assert!(same, "{half:?} {level:?} {v:e} ({:#010x}): {g:e} vs half's {w:e}", v.to_bits());
                }
            }
        }
    }

    /// Over the pool, pieces and all, the values of one thread's rounding.
    #[test]
    fn the_pool_rounds_every_piece() {
        let values = signed_values(3 * PIECE + 5, 9);
        let (mut one, mut pooled) = (values.clone(), values);
        round_at(&mut one, Half::Bf16, SimdLevel::current());
        round_through(&mut pooled, Half::Bf16);
        assert_eq!(one, pooled);
    }
}
