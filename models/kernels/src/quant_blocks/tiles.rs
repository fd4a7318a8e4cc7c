//! Products over the interleaved records (`packed`): a tile is one group of 16 weight rows by
//! `C` activation rows, its 16 x `C` results in registers for the whole row. At each block the
//! group's values are unpacked once and used for all `C` activation rows; each four of an
//! activation row's bytes are broadcast and summed against four values of all 16 rows at once.
//!
//! Three kernels ([`Int8Kernel`]): AVX-512 with VNNI (`tiles_512.rs`: the 16 rows in one
//! register, `vpdpbusd`), and AVX2 (two halves of 8 rows) summing bytes with AVX-VNNI's 256-bit
//! `vpdpbusd` where the CPU has it, else with `vpmaddubsw` + `vpmaddwd` (Q8_0's full-range
//! bytes would saturate `vpmaddubsw`, so there its sign moves onto the activations instead of
//! an offset). Per
//! result, all compute the same exact integer sum of each block and then the same float
//! operations in the same order (`y += (d_w · d_x) · sum`, then `y += m_w · s_x`), so they give
//! the same bits, and a row's result does not depend on how many rows its batch has.

use std::arch::x86_64::*;

use super::packed::{Layout, GROUP};
use super::{BlockFormat, QuantizedRow, BLOCK};
use crate::simd::Int8Kernel;

/// One format's record, for the kernels.
trait Format {
    const LAYOUT: Layout;
    /// Values are whole bytes (Q8_0) rather than nibbles (and fifth bits).
    const EIGHT: bool;
}

macro_rules! format {
    ($name:ident, $eight:expr) => {
        struct $name;
        impl Format for $name {
            const LAYOUT: Layout = Layout::of(BlockFormat::$name);
            const EIGHT: bool = $eight;
        }
    };
}
format!(Q4_0, false);
format!(Q4_1, false);
format!(Q5_0, false);
format!(Q5_1, false);
format!(Q8_0, true);

/// Activation row `x`'s four bytes at value `at` of block `b`, in every 32-bit lane.
#[inline(always)]
pub(super) unsafe fn four_bytes(x: &QuantizedRow, b: usize, at: usize) -> i32 {
    (x.q.as_ptr().add(b * BLOCK + at) as *const i32).read_unaligned()
}

/// The byte-shuffle control that puts byte `byte` of each 32-bit lane in all four of its bytes,
/// and the bits of values `4k..4k + 4` within that byte, one per byte of a lane.
#[inline(always)]
fn fifth_bit_pattern(k: usize) -> (i8, i32) {
    ((k / 2) as i8, (0x0804_0201u32 << (4 * (k % 2))) as i32)
}

const LANE_STARTS: [i8; 16] = [0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12];

/// `with_fifth_bits_512` (`tiles_512.rs`) for 8 rows.
#[inline(always)]
unsafe fn with_fifth_bits_256(v: __m256i, qh: __m256i, k: usize) -> __m256i {
    let (byte, bits) = fifth_bit_pattern(k);
    let starts = _mm_loadu_si128(LANE_STARTS.as_ptr() as *const __m128i);
    let starts = _mm256_broadcastsi128_si256(starts);
    let spread = _mm256_shuffle_epi8(qh, _mm256_add_epi8(starts, _mm256_set1_epi8(byte)));
    let bits = _mm256_set1_epi32(bits);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits);
    _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(16)))
}

/// 8 rows' values `4k..4k + 4` (low nibbles) and `16 + 4k..` (high ones) from a record's chunk
/// `k`, with their fifth bits from the 8 rows' u32s at `qh` where the format has them.
#[inline(always)]
pub(super) unsafe fn nibbles_256(chunk: __m256i, qh: Option<*const u8>, k: usize) -> (__m256i, __m256i) {
    let low = _mm256_set1_epi8(0x0f);
    let (first, second) = (_mm256_and_si256(chunk, low), _mm256_and_si256(_mm256_srli_epi16(chunk, 4), low));
    if let Some(qh) = qh {
        let qh = _mm256_loadu_si256(qh as *const __m256i);
        return (with_fifth_bits_256(first, qh, k), with_fifth_bits_256(second, qh, k + 4));
    }
    (first, second)
}

/// The AVX2 kernel: [`tile_avx512`] for half `h` of the group (its rows `8h..8h + 8`), its bytes
/// summed by AVX-VNNI's `vpdpbusd` when `VNNI`, else by `vpmaddubsw` + `vpmaddwd`.
#[inline(always)]
unsafe fn tile_avx2<F: Format, const C: usize, const VNNI: bool>(
    rec0: *const u8,
    h: usize,
    blocks: usize,
    x: [&QuantizedRow; C],
) -> [__m256; C] {
    let l = F::LAYOUT;
    let mut y = [_mm256_setzero_ps(); C];
    let ones = _mm256_set1_epi16(1);
    for b in 0..blocks {
        let rec = rec0.add(b * l.record);
        let mut sums = [_mm256_setzero_si256(); C];
        macro_rules! load {
            ($at:expr) => {
                _mm256_loadu_si256(rec.add($at + 32 * h) as *const __m256i)
            };
        }
        if F::EIGHT && VNNI {
            for k in 0..8 {
                let w = load!(l.qs + 64 * k);
                for c in 0..C {
                    sums[c] = _mm256_dpbusd_avx_epi32(sums[c], w, _mm256_set1_epi32(four_bytes(x[c], b, 4 * k)));
                }
            }
        } else if F::EIGHT {
            for k in 0..8 {
                // `u - 128` is the signed value; |w| against x with w's sign, as llama.cpp does.
                let w = _mm256_xor_si256(load!(l.qs + 64 * k), _mm256_set1_epi8(-128));
                let magnitude = _mm256_sign_epi8(w, w);
                for c in 0..C {
                    let signed_x = _mm256_sign_epi8(_mm256_set1_epi32(four_bytes(x[c], b, 4 * k)), w);
                    sums[c] = _mm256_add_epi32(sums[c], _mm256_madd_epi16(ones, _mm256_maddubs_epi16(magnitude, signed_x)));
                }
            }
        } else {
            for k in 0..4 {
                let (first, second) = nibbles_256(load!(l.qs + 64 * k), l.qh.map(|at| rec.add(at + 32 * h)), k);
                for c in 0..C {
                    let (lo, hi) = (_mm256_set1_epi32(four_bytes(x[c], b, 4 * k)), _mm256_set1_epi32(four_bytes(x[c], b, 16 + 4 * k)));
                    if VNNI {
                        sums[c] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(sums[c], first, lo), second, hi);
                        continue;
                    }
                    let a = _mm256_maddubs_epi16(first, lo);
                    let z = _mm256_maddubs_epi16(second, hi);
                    sums[c] = _mm256_add_epi32(sums[c], _mm256_madd_epi16(ones, _mm256_add_epi16(a, z)));
                }
            }
        }
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(rec.add(16 * h) as *const __m128i));
        // Q8_0's signs were applied above without VNNI: no offset to take off.
        let offset = if F::EIGHT && !VNNI { 0 } else { l.offset };
        for c in 0..C {
            let sum = _mm256_sub_epi32(sums[c], _mm256_set1_epi32(offset * *x[c].sum.get_unchecked(b)));
            y[c] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(*x[c].d.get_unchecked(b))), _mm256_cvtepi32_ps(sum), y[c]);
        }
        if let Some(m) = l.m {
            let mw = _mm256_cvtph_ps(_mm_loadu_si128(rec.add(m + 16 * h) as *const __m128i));
            for c in 0..C {
                y[c] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*x[c].s.get_unchecked(b)), y[c]);
            }
        }
    }
    y
}

/// Columns of row groups `groups` of `y` (m x `rows`, row-major: one activation row's results
/// together) from the records `w` (`blocks` a group) against every activation row of `x`.
///
/// # Safety
/// The CPU must have `kernel`'s features ([`Int8Kernel`]); `w`
/// must hold `groups.end` groups of `blocks` records of `format`, each row of `x` `blocks`
/// blocks; `y` must have room for `x.len() * rows` values, of which this call writes the
/// columns of its groups alone.
pub unsafe fn product_groups(
    format: BlockFormat,
    kernel: Int8Kernel,
    w: &[u8],
    groups: std::ops::Range<usize>,
    x: &[QuantizedRow],
    (y, rows): (*mut f32, usize),
) {
    macro_rules! run {
        ($f:ty) => {
            match kernel {
                Int8Kernel::Avx512Vnni => groups_avx512::<$f>(w, groups, x, (y, rows)),
                Int8Kernel::AvxVnni => groups_avxvnni::<$f>(w, groups, x, (y, rows)),
                Int8Kernel::Avx2 => groups_avx2::<$f>(w, groups, x, (y, rows)),
            }
        };
    }
    match format {
        BlockFormat::Q4_0 => run!(Q4_0),
        BlockFormat::Q4_1 => run!(Q4_1),
        BlockFormat::Q5_0 => run!(Q5_0),
        BlockFormat::Q5_1 => run!(Q5_1),
        BlockFormat::Q8_0 => run!(Q8_0),
        BlockFormat::Q4_K | BlockFormat::Q5_K | BlockFormat::Q6_K => unreachable!("the K formats run on k_tiles"),
    }
}

/// Writes `values` (the group starting at row `o`, 16 of them) into activation row `c`'s
/// results, those past the matrix's last row left out.
#[inline(always)]
pub(super) unsafe fn put(y: *mut f32, rows: usize, c: usize, o: usize, values: &[f32]) {
    let n = values.len().min(rows - o);
    std::ptr::copy_nonoverlapping(values.as_ptr(), y.add(c * rows + o), n);
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn groups_avx512<F: Format>(w: &[u8], groups: std::ops::Range<usize>, x: &[QuantizedRow], out: (*mut f32, usize)) {
    avx512::groups_512::<F>(w, groups, x, out)
}

/// The AVX-512 kernel (`tiles_512.rs`) on the CPU's instructions.
pub(super) mod avx512 {
    use super::{fifth_bit_pattern, four_bytes, put, Format, QuantizedRow, GROUP, LANE_STARTS};
    use std::arch::x86_64::*;
    include!("tiles_512.rs");
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn groups_avx2<F: Format>(w: &[u8], groups: std::ops::Range<usize>, x: &[QuantizedRow], out: (*mut f32, usize)) {
    groups_256::<F, false>(w, groups, x, out)
}

#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn groups_avxvnni<F: Format>(w: &[u8], groups: std::ops::Range<usize>, x: &[QuantizedRow], out: (*mut f32, usize)) {
    groups_256::<F, true>(w, groups, x, out)
}

/// The body of the two AVX2 kernels (inlined into each, so that their features reach it).
#[inline(always)]
unsafe fn groups_256<F: Format, const VNNI: bool>(
    w: &[u8],
    groups: std::ops::Range<usize>,
    x: &[QuantizedRow],
    (y, rows): (*mut f32, usize),
) {
    let blocks = x.first().map_or(0, |r| r.d.len());
    let group_bytes = blocks * F::LAYOUT.record;
    debug_assert!(w.len() >= groups.end * group_bytes);
    for g in groups {
        let rec0 = w.as_ptr().add(g * group_bytes);
        // A last group's second half may be all padding.
        let halves = if g * GROUP + 8 < rows { 2 } else { 1 };
        by_tiles!(3, x, |c0, xs| {
            for h in 0..halves {
                for (k, v) in tile_avx2::<F, _, VNNI>(rec0, h, blocks, xs).iter().enumerate() {
                    let mut values = [0f32; 8];
                    _mm256_storeu_ps(values.as_mut_ptr(), *v);
                    put(y, rows, c0 + k, g * GROUP + 8 * h, &values);
                }
            }
        });
    }
}

/// [`product_groups`] of the AVX-512 kernel on its instructions' stand-ins, on any CPU.
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
        BlockFormat::Q4_0 => avx512_stand_ins::groups_512::<Q4_0>(w, groups, x, out),
        BlockFormat::Q4_1 => avx512_stand_ins::groups_512::<Q4_1>(w, groups, x, out),
        BlockFormat::Q5_0 => avx512_stand_ins::groups_512::<Q5_0>(w, groups, x, out),
        BlockFormat::Q5_1 => avx512_stand_ins::groups_512::<Q5_1>(w, groups, x, out),
        BlockFormat::Q8_0 => avx512_stand_ins::groups_512::<Q8_0>(w, groups, x, out),
        BlockFormat::Q4_K | BlockFormat::Q5_K | BlockFormat::Q6_K => unreachable!("the K formats run on k_tiles"),
    }
}

/// The AVX-512 kernel (`tiles_512.rs`) on plain-code stand-ins for its instructions
/// (`avx512_stand_ins`), so that CI machines without AVX-512 test its arithmetic too.
#[cfg(test)]
pub(super) mod avx512_stand_ins {
    use super::super::avx512_stand_ins::*;
    use super::{fifth_bit_pattern, four_bytes, put, Format, QuantizedRow, GROUP, LANE_STARTS};
    use std::arch::x86_64::{__m128i, __m256i, _mm256_loadu_si256, _mm_loadu_si128};
    include!("tiles_512.rs");
}
