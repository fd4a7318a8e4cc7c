//! AVX2 dot products of one weight row in a 32-value block format with one activation row
//! quantised to 8 bits (`quant_blocks`), llama.cpp's `ggml_vec_dot_*_q8_*` for x86: the 32 weight
//! values of a block are unpacked to bytes (nibbles, plus the fifth bits of Q5), multiplied with
//! the activations' bytes in pairs (`vpmaddubsw`, which needs one unsigned side: signed weights
//! go through `vpsignb`), summed to eight i32 lanes and scaled in f32.

use std::arch::x86_64::*;

use super::{BlockFormat, QuantizedRow, BLOCK};

/// An f16 at `p` (unaligned) as f32, by F16C.
#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    let bits = (p as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// 16 bytes of nibbles to 32 bytes 0..15: low nibbles first (values 0..15), then high ones.
#[inline(always)]
unsafe fn bytes_from_nibbles_32(p: *const u8) -> __m256i {
    let tmp = _mm_loadu_si128(p as *const __m128i);
    let bytes = _mm256_insertf128_si256(_mm256_castsi128_si256(tmp), _mm_srli_epi16(tmp, 4), 1);
    _mm256_and_si256(_mm256_set1_epi8(0x0f), bytes)
}

/// The 32 bits at `p` as 32 bytes, 0xff where the bit is set.
#[inline(always)]
unsafe fn bytes_from_bits_32(p: *const u8) -> __m256i {
    let x32 = (p as *const u32).read_unaligned() as i32;
    let shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x32), shuffle);
    let bit_mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    _mm256_cmpeq_epi8(_mm256_or_si256(bytes, bit_mask), _mm256_set1_epi64x(-1))
}

/// Unsigned bytes times signed bytes, summed in pairs and then fours: eight f32 lanes.
#[inline(always)]
unsafe fn mul_sum_us8_pairs(ax: __m256i, sy: __m256i) -> __m256 {
    let dot = _mm256_maddubs_epi16(ax, sy);
    _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), dot))
}

/// Signed bytes times signed bytes (the sign moved onto `y`, so one side is unsigned).
#[inline(always)]
unsafe fn mul_sum_i8_pairs(x: __m256i, y: __m256i) -> __m256 {
    mul_sum_us8_pairs(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
}

#[inline(always)]
unsafe fn hsum(x: __m256) -> f32 {
    let r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)))
}

/// The loop over a row's blocks for one format: `$pairs` gives a block's eight lane sums from the
/// block's bytes `$b` and the activations `$y`; `$min` its minimum term (0 without one). Two
/// blocks per iteration into two accumulators, so consecutive blocks' multiply-adds do not wait
/// on each other.
macro_rules! block_loop {
    ($w:expr, $x:expr, $bytes:expr, |$b:ident, $y:ident, $i:ident| $pairs:expr, $min:expr) => {{
        let mut acc = [_mm256_setzero_ps(); 2];
        let mut mins = [0f32; 2];
        let n = $x.d.len();
        let mut start = 0;
        while start < n {
            for k in 0..2 {
                let $i = start + k;
                if $i < n {
                    let $b = $w.as_ptr().add($i * $bytes);
                    let $y = _mm256_loadu_si256($x.q.as_ptr().add($i * BLOCK) as *const __m256i);
                    let scale = _mm256_set1_ps(f16_at($b) * *$x.d.get_unchecked($i));
                    acc[k] = _mm256_fmadd_ps(scale, $pairs, acc[k]);
                    mins[k] += $min;
                }
            }
            start += 2;
        }
        hsum(_mm256_add_ps(acc[0], acc[1])) + mins[0] + mins[1]
    }};
}

/// `Σ w · x` for one row: `w` holds `x.d.len()` blocks of `format`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `w` must hold `x.d.len()` whole blocks and `x.q` 32
/// values per block.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot(format: BlockFormat, w: &[u8], x: &QuantizedRow) -> f32 {
    debug_assert_eq!(w.len(), x.d.len() * format.block_bytes());
    debug_assert_eq!(x.q.len(), x.d.len() * BLOCK);
    let bytes = format.block_bytes();
    match format {
        BlockFormat::Q4_0 => block_loop!(
            w,
            x,
            bytes,
            |b, y, i| mul_sum_i8_pairs(_mm256_sub_epi8(bytes_from_nibbles_32(b.add(2)), _mm256_set1_epi8(8)), y),
            0.0
        ),
        BlockFormat::Q4_1 => block_loop!(w, x, bytes, |b, y, i| mul_sum_us8_pairs(bytes_from_nibbles_32(b.add(4)), y), {
            f16_at(b.add(2)) * *x.s.get_unchecked(i)
        }),
        BlockFormat::Q5_0 => block_loop!(
            w,
            x,
            bytes,
            |b, y, i| {
                // A clear fifth bit means value - 16: set the top nibble (0xf0 | n is n - 16).
                let high = _mm256_andnot_si256(bytes_from_bits_32(b.add(2)), _mm256_set1_epi8(0xf0u8 as i8));
                mul_sum_i8_pairs(_mm256_or_si256(bytes_from_nibbles_32(b.add(6)), high), y)
            },
            0.0
        ),
        BlockFormat::Q5_1 => block_loop!(
            w,
            x,
            bytes,
            |b, y, i| {
                let high = _mm256_and_si256(bytes_from_bits_32(b.add(4)), _mm256_set1_epi8(0x10));
                mul_sum_us8_pairs(_mm256_or_si256(bytes_from_nibbles_32(b.add(8)), high), y)
            },
            f16_at(b.add(2)) * *x.s.get_unchecked(i)
        ),
        BlockFormat::Q8_0 => {
            block_loop!(w, x, bytes, |b, y, i| mul_sum_i8_pairs(_mm256_loadu_si256(b.add(2) as *const __m256i), y), 0.0)
        }
    }
}

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
