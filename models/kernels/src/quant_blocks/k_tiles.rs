//! Products over the K formats' records (`k_packed`), as `tiles` runs the 32-value formats: a
//! tile is 8 weight rows (half a group) by `C` activation rows (3 or 4), the results in
//! registers for the whole row. Activations are quantised as for the other formats (a scale per 32 values),
//! so a model mixing K and 32-value formats quantises each input once.
//!
//! Each block's integer sum `Σ sc · u · q` is exact: `vpmaddubsw` sums pairs of the unsigned
//! values against the signed activations (at most 2 · 63 · 127, within 16 bits), and
//! `vpmaddwd` against each row's scale (in both halves of a 32-bit lane) widens and scales
//! them at once. Q6_K's offset of 32 comes back as `32 · (sc₀ · Σq₀ + sc₁ · Σq₁)` from the
//! activations' half-block sums. The float work then matches the plain code's reading
//! (`k_packed::row_block`): `y += (d · d_x) · sum`, then `y -= (dmin · m) · (d_x · Σq)`.
//!
//! With `vpdpbusd` (AVX-VNNI at 256 bits, AVX512-VNNI at 512: 16 rows a register) a block's
//! bytes are summed unscaled, 4 a lane, and the block's sum is then multiplied by each row's
//! scale (`vpmulld`): the same exact integer, so every kernel gives the same bits
//! ([`Int8Kernel`]).

use std::arch::x86_64::*;

use super::k_packed::{KLayout, BLOCKS};
use super::packed::GROUP;
use super::tiles::{four_bytes, nibbles_256, put};
use super::{BlockFormat, QuantizedRow};
use crate::simd::Int8Kernel;

/// One K format's record, for the kernel.
trait KFormat {
    const FORMAT: BlockFormat;
    const LAYOUT: KLayout = KLayout::of(Self::FORMAT);
    /// Tiles of four activation rows rather than three on `vpmaddubsw`: Q5_K's and Q6_K's weights
    /// cost more to unpack (fifth or top bits), which a fourth row shares; Q4_K's do not gain
    /// from it.
    const FOUR_ROWS: bool;
}

macro_rules! k_format {
    ($name:ident, $format:ident, $four_rows:expr) => {
        struct $name;
        impl KFormat for $name {
            const FORMAT: BlockFormat = BlockFormat::$format;
            const FOUR_ROWS: bool = $four_rows;
        }
    };
}
k_format!(Q4K, Q4_K, false);
k_format!(Q5K, Q5_K, true);
k_format!(Q6K, Q6_K, true);

/// 8 rows' unsigned byte scales at `p`, each in both 16-bit halves of its row's lane.
#[inline(always)]
unsafe fn scale_pairs_u8(p: *const u8) -> __m256i {
    let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
    _mm256_or_si256(v, _mm256_slli_epi32(v, 16))
}

/// [`scale_pairs_u8`] for signed bytes.
#[inline(always)]
unsafe fn scale_pairs_i8(p: *const u8) -> __m256i {
    let v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i));
    _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v, 16))
}

/// 8 rows' unsigned byte scales at `p`, a 32-bit lane each (for `vpmulld`).
#[inline(always)]
unsafe fn scales_u8(p: *const u8) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))
}

/// [`scales_u8`] for signed bytes.
#[inline(always)]
unsafe fn scales_i8(p: *const u8) -> __m256i {
    _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i))
}

/// Q6_K's four low bits `v` with each byte's next two top bits (`top`'s bits 0-1) in bits 4-5;
/// the 16-bit shift moves no bit across bytes once `three` has masked them.
#[inline(always)]
unsafe fn with_top_bits(v: __m256i, top: __m256i, three: __m256i) -> __m256i {
    _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(top, three), 4))
}

/// Rows `8h..8h + 8` of the group whose records start at `rec0` against the `C` activation rows
/// `x`, over `supers` super-blocks; bytes summed by AVX-VNNI's `vpdpbusd` when `VNNI`, else by
/// `vpmaddubsw` + `vpmaddwd`.
#[inline(always)]
unsafe fn tile_256<F: KFormat, const C: usize, const VNNI: bool>(
    rec0: *const u8,
    h: usize,
    supers: usize,
    x: [&QuantizedRow; C],
) -> [__m256; C] {
    let l = F::LAYOUT;
    let mut y = [_mm256_setzero_ps(); C];
    let (low, three) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(3));
    for s in 0..supers {
        let rec = rec0.add(s * l.record);
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(rec.add(16 * h) as *const __m128i));
        // The super-block's dmin, once for its 8 blocks (Q6_K has none).
        let dmin = if l.dmin { _mm256_cvtph_ps(_mm_loadu_si128(rec.add(32 + 16 * h) as *const __m128i)) } else { _mm256_setzero_ps() };
        for j in 0..BLOCKS {
            let b = BLOCKS * s + j;
            let blk = rec.add(l.header + j * l.block);
            let mut sums = [_mm256_setzero_si256(); C];
            // VNNI: the block's bytes summed unscaled (Q6_K's half blocks apart: [0] values
            // 0..16, [1] 16..32; the other formats all in [0]).
            let mut raw = [[_mm256_setzero_si256(); 2]; C];
            macro_rules! load {
                ($at:expr) => {
                    _mm256_loadu_si256(blk.add($at + 32 * h) as *const __m256i)
                };
            }
            if F::FORMAT == BlockFormat::Q6_K {
                // A lane's scale for `vpmulld` (VNNI), else in both its 16-bit halves.
                let (sc0, sc1) = if VNNI {
                    (scales_i8(blk.add(8 * h)), scales_i8(blk.add(16 + 8 * h)))
                } else {
                    (scale_pairs_i8(blk.add(8 * h)), scale_pairs_i8(blk.add(16 + 8 * h)))
                };
                let qh = l.qh.unwrap_or(0);
                let (mut top0, mut top1) = (load!(qh), load!(qh + 64));
                for k in 0..4 {
                    let chunk = load!(l.qs + 64 * k);
                    let first = with_top_bits(_mm256_and_si256(chunk, low), top0, three);
                    let second = with_top_bits(_mm256_and_si256(_mm256_srli_epi16(chunk, 4), low), top1, three);
                    (top0, top1) = (_mm256_srli_epi16(top0, 2), _mm256_srli_epi16(top1, 2));
                    for c in 0..C {
                        let (lo, hi) = (_mm256_set1_epi32(four_bytes(x[c], b, 4 * k)), _mm256_set1_epi32(four_bytes(x[c], b, 16 + 4 * k)));
                        if VNNI {
                            raw[c][0] = _mm256_dpbusd_avx_epi32(raw[c][0], first, lo);
                            raw[c][1] = _mm256_dpbusd_avx_epi32(raw[c][1], second, hi);
                            continue;
                        }
                        let a = _mm256_madd_epi16(sc0, _mm256_maddubs_epi16(first, lo));
                        let z = _mm256_madd_epi16(sc1, _mm256_maddubs_epi16(second, hi));
                        sums[c] = _mm256_add_epi32(sums[c], _mm256_add_epi32(a, z));
                    }
                }
                if VNNI {
                    // sc₀ · (Σ u q - 32 Σq₀) + sc₁ · (…₁): the offset taken off each half's sum.
                    for c in 0..C {
                        let q0 = *x[c].half.get_unchecked(b);
                        let q1 = *x[c].sum.get_unchecked(b) - q0;
                        let first = _mm256_mullo_epi32(sc0, _mm256_sub_epi32(raw[c][0], _mm256_set1_epi32(32 * q0)));
                        let second = _mm256_mullo_epi32(sc1, _mm256_sub_epi32(raw[c][1], _mm256_set1_epi32(32 * q1)));
                        sums[c] = _mm256_add_epi32(first, second);
                    }
                } else {
                    // The offset: 32 · (sc₀ · Σq₀ + sc₁ · Σq₁), the two scales in a lane's halves.
                    let sc01 = _mm256_blend_epi16::<0xaa>(sc0, sc1);
                    for c in 0..C {
                        let q0 = *x[c].half.get_unchecked(b);
                        let q1 = *x[c].sum.get_unchecked(b) - q0;
                        let halves = _mm256_set1_epi32((q0 & 0xffff) | (q1 << 16));
                        sums[c] = _mm256_sub_epi32(sums[c], _mm256_slli_epi32(_mm256_madd_epi16(sc01, halves), 5));
                    }
                }
            } else {
                let sc = if VNNI { scales_u8(blk.add(8 * h)) } else { scale_pairs_u8(blk.add(8 * h)) };
                for k in 0..4 {
                    let (first, second) = nibbles_256(load!(l.qs + 64 * k), l.qh.map(|at| blk.add(at + 32 * h)), k);
                    for c in 0..C {
                        let (lo, hi) = (_mm256_set1_epi32(four_bytes(x[c], b, 4 * k)), _mm256_set1_epi32(four_bytes(x[c], b, 16 + 4 * k)));
                        if VNNI {
                            raw[c][0] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(raw[c][0], first, lo), second, hi);
                            continue;
                        }
                        // Both halves of the block share its scale: the pairs' sums (at most
                        // 4 · 31 · 127) added before the scaling.
                        let pairs = _mm256_add_epi16(_mm256_maddubs_epi16(first, lo), _mm256_maddubs_epi16(second, hi));
                        sums[c] = _mm256_add_epi32(sums[c], _mm256_madd_epi16(sc, pairs));
                    }
                }
                if VNNI {
                    for c in 0..C {
                        sums[c] = _mm256_mullo_epi32(sc, raw[c][0]);
                    }
                }
            }
            for c in 0..C {
                y[c] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(*x[c].d.get_unchecked(b))), _mm256_cvtepi32_ps(sums[c]), y[c]);
            }
            if l.dmin {
                let m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(blk.add(16 + 8 * h) as *const __m128i)));
                let mw = _mm256_mul_ps(dmin, m);
                for c in 0..C {
                    let s = *x[c].d.get_unchecked(b) * *x[c].sum.get_unchecked(b) as f32;
                    y[c] = _mm256_fnmadd_ps(mw, _mm256_set1_ps(s), y[c]);
                }
            }
        }
    }
    y
}

/// Columns of row groups `groups` of `y` (m x `rows`, row-major) from the records `w` of a K
/// `format` against every activation row of `x`: `tiles::product_groups` for these formats.
///
/// # Safety
/// The CPU must have `kernel`'s features ([`Int8Kernel`]); `w` must hold `groups.end` groups of
/// records of `format` for rows of `x`'s width, each row of `x` whole super-blocks; `y` must
/// have room for `x.len() * rows` values, of which this call writes the columns of its groups
/// alone.
pub unsafe fn product_groups(
    format: BlockFormat,
    kernel: Int8Kernel,
    w: &[u8],
    groups: std::ops::Range<usize>,
    x: &[QuantizedRow],
    out: (*mut f32, usize),
) {
    macro_rules! run {
        ($f:ty) => {
            match kernel {
                Int8Kernel::Avx512Vnni => groups_avx512::<$f>(w, groups, x, out),
                Int8Kernel::AvxVnni => groups_avxvnni::<$f>(w, groups, x, out),
                Int8Kernel::Avx2 => groups_avx2::<$f>(w, groups, x, out),
            }
        };
    }
    match format {
        BlockFormat::Q4_K => run!(Q4K),
        BlockFormat::Q5_K => run!(Q5K),
        BlockFormat::Q6_K => run!(Q6K),
        _ => unreachable!("{format:?} is not a K format"),
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn groups_avx512<F: KFormat>(w: &[u8], groups: std::ops::Range<usize>, x: &[QuantizedRow], out: (*mut f32, usize)) {
    avx512::groups_512::<F>(w, groups, x, out)
}

/// The AVX512-VNNI kernel (`k_tiles_512.rs`) on the CPU's instructions.
mod avx512 {
    use super::super::tiles::avx512::with_fifth_bits_512;
    use super::{four_bytes, put, BlockFormat, KFormat, QuantizedRow, BLOCKS, GROUP};
    use std::arch::x86_64::*;
    include!("k_tiles_512.rs");
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn groups_avx2<F: KFormat>(w: &[u8], groups: std::ops::Range<usize>, x: &[QuantizedRow], out: (*mut f32, usize)) {
    groups_256::<F, false>(w, groups, x, out)
}

#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn groups_avxvnni<F: KFormat>(w: &[u8], groups: std::ops::Range<usize>, x: &[QuantizedRow], out: (*mut f32, usize)) {
    groups_256::<F, true>(w, groups, x, out)
}

/// The body of the two 256-bit kernels (inlined into each, so that their features reach it).
#[inline(always)]
unsafe fn groups_256<F: KFormat, const VNNI: bool>(
    w: &[u8],
    groups: std::ops::Range<usize>,
    x: &[QuantizedRow],
    (y, rows): (*mut f32, usize),
) {
    let supers = x.first().map_or(0, |r| r.d.len() / BLOCKS);
    let group_bytes = supers * F::LAYOUT.record;
    debug_assert!(w.len() >= groups.end * group_bytes);
    for g in groups {
        let rec0 = w.as_ptr().add(g * group_bytes);
        // A last group's second half may be all padding.
        let halves = if g * GROUP + 8 < rows { 2 } else { 1 };
        macro_rules! tiles_of {
            ($c:expr) => {
                by_tiles!($c, x, |c0, xs| {
                    for h in 0..halves {
                        for (k, v) in tile_256::<F, _, VNNI>(rec0, h, supers, xs).iter().enumerate() {
                            let mut values = [0f32; 8];
                            _mm256_storeu_ps(values.as_mut_ptr(), *v);
                            put(y, rows, c0 + k, g * GROUP + 8 * h, &values);
                        }
                    }
                })
            };
        }
        // With VNNI a row's work is fewer instructions and more accumulators (two a row for
        // Q6_K's half blocks): three rows keep them in the 16 registers.
        if F::FOUR_ROWS && !VNNI {
            tiles_of!(4);
        } else {
            tiles_of!(3);
        }
    }
}

/// [`product_groups`] of the AVX512-VNNI kernel on its instructions' stand-ins, on any CPU.
///
/// # Safety
/// As [`product_groups`], but for the CPU's features.
#[cfg(test)]
pub unsafe fn product_groups_on_stand_ins(
    format: BlockFormat,
    w: &[u8],
    groups: std::ops::Range<usize>,
    x: &[QuantizedRow],
    out: (*mut f32, usize),
) {
    match format {
        BlockFormat::Q4_K => avx512_stand_ins::groups_512::<Q4K>(w, groups, x, out),
        BlockFormat::Q5_K => avx512_stand_ins::groups_512::<Q5K>(w, groups, x, out),
        BlockFormat::Q6_K => avx512_stand_ins::groups_512::<Q6K>(w, groups, x, out),
        _ => unreachable!("{format:?} is not a K format"),
    }
}

/// The AVX512-VNNI kernel (`k_tiles_512.rs`) on plain-code stand-ins for its instructions
/// (`avx512_stand_ins`), so that CI machines without AVX-512 test its arithmetic too.
#[cfg(test)]
mod avx512_stand_ins {
    use super::super::avx512_stand_ins::*;
    use super::super::tiles::avx512_stand_ins::with_fifth_bits_512;
    use super::{four_bytes, put, BlockFormat, KFormat, QuantizedRow, BLOCKS, GROUP};
    use std::arch::x86_64::{__m128i, __m256i, _mm256_loadu_si256, _mm_loadu_si128};
    include!("k_tiles_512.rs");
}
