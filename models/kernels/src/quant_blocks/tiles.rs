//! Products over 32-value block formats by register tiles, llamafile's tinyBLAS idea for
//! llama.cpp's formats: a tile of `R` weight rows by `C` activation rows keeps its accumulators
//! in registers; at each block index every weight block is unpacked once and used for all `C`
//! activation rows, and every activation block loaded once for all `R` weight rows. A prompt's
//! product (many activation rows) unpacks each weight block `m / C` times instead of `m` times.
//!
//! Two kernels: AVX2 (eight lanes, bytes summed by `vpmaddubsw` + `vpmaddwd`), and AVX-512 with
//! VNNI (sixteen lanes holding two consecutive blocks, bytes summed by `vpdpbusd`). Every pair's
//! sum is kept as two accumulators, of its even and of its odd blocks, added at the end: the
//! AVX-512 kernel's two halves are exactly those, so both kernels compute the same operations in
//! the same order and give the same bits (the integer sums are exact in both: the weights' bytes
//! are at most 31 unsigned or ±127 signed against ±127 activations, so `vpmaddubsw`'s 16-bit
//! pair sums never saturate). A pair is computed alike in every tile shape, so a row's output
//! does not depend on how many rows its batch has: decoding's one row and a prompt's rows agree
//! bit for bit.

use std::arch::x86_64::*;

use super::x86::{bytes_from_bits_32, bytes_from_nibbles_32, f16_at, hsum};
use super::{BlockFormat, QuantizedRow, BLOCK};

/// One block format's layout, for the tile loop.
trait Format {
    const BYTES: usize;
    /// The block's values are signed (else unsigned with a minimum, `d · q + m`).
    const SIGNED: bool;
    /// The 32 integer values of the block at `b` (before its scale), as bytes.
    unsafe fn values(b: *const u8) -> __m256i;
}

struct Q4_0;
struct Q4_1;
struct Q5_0;
struct Q5_1;
struct Q8_0;

impl Format for Q4_0 {
    const BYTES: usize = 18;
    const SIGNED: bool = true;
    #[inline(always)]
    unsafe fn values(b: *const u8) -> __m256i {
        _mm256_sub_epi8(bytes_from_nibbles_32(b.add(2)), _mm256_set1_epi8(8))
    }
}

impl Format for Q4_1 {
    const BYTES: usize = 20;
    const SIGNED: bool = false;
    #[inline(always)]
    unsafe fn values(b: *const u8) -> __m256i {
        bytes_from_nibbles_32(b.add(4))
    }
}

impl Format for Q5_0 {
    const BYTES: usize = 22;
    const SIGNED: bool = true;
    #[inline(always)]
    unsafe fn values(b: *const u8) -> __m256i {
        // A clear fifth bit means value - 16: set the top nibble (0xf0 | n is n - 16).
        let high = _mm256_andnot_si256(bytes_from_bits_32(b.add(2)), _mm256_set1_epi8(0xf0u8 as i8));
        _mm256_or_si256(bytes_from_nibbles_32(b.add(6)), high)
    }
}

impl Format for Q5_1 {
    const BYTES: usize = 24;
    const SIGNED: bool = false;
    #[inline(always)]
    unsafe fn values(b: *const u8) -> __m256i {
        let high = _mm256_and_si256(bytes_from_bits_32(b.add(4)), _mm256_set1_epi8(0x10));
        _mm256_or_si256(bytes_from_nibbles_32(b.add(8)), high)
    }
}

impl Format for Q8_0 {
    const BYTES: usize = 34;
    const SIGNED: bool = true;
    #[inline(always)]
    unsafe fn values(b: *const u8) -> __m256i {
        _mm256_loadu_si256(b.add(2) as *const __m256i)
    }
}

/// Weight rows x activation rows of the AVX2 kernel's tile (two accumulators a pair: 12 of
/// the 16 registers).
const AVX2_TILE: (usize, usize) = (2, 3);
/// The AVX-512 kernel's (one 16-lane accumulator a pair, of 32 registers).
const AVX512_TILE: (usize, usize) = (4, 3);

/// The AVX2 kernel: `out[r][c] = Σ w_r · x_c` over `blocks` blocks for the `R` weight rows
/// starting at `w[r]` and the `C` activation rows `x[c]`.
#[inline(always)]
unsafe fn tile_avx2<F: Format, const R: usize, const C: usize>(w: [*const u8; R], x: [&QuantizedRow; C], blocks: usize) -> [[f32; C]; R] {
    // [parity][r][c]: the even blocks' and the odd blocks' sums.
    let mut acc = [[[_mm256_setzero_ps(); C]; R]; 2];
    let mut mins = [[[0f32; C]; R]; 2];
    for i in 0..blocks {
        let p = i & 1;
        let mut ys = [_mm256_setzero_si256(); C];
        let mut dx = [0f32; C];
        for c in 0..C {
            ys[c] = _mm256_loadu_si256(x[c].q.as_ptr().add(i * BLOCK) as *const __m256i);
            dx[c] = *x[c].d.get_unchecked(i);
        }
        for r in 0..R {
            let b = w[r].add(i * F::BYTES);
            let values = F::values(b);
            let dw = f16_at(b);
            // Signed weights: their sign moves onto the activations, so one side is unsigned.
            let u = if F::SIGNED { _mm256_sign_epi8(values, values) } else { values };
            for c in 0..C {
                let s = if F::SIGNED { _mm256_sign_epi8(ys[c], values) } else { ys[c] };
                let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(u, s)));
                acc[p][r][c] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx[c]), sums, acc[p][r][c]);
            }
            if !F::SIGNED {
                let m = f16_at(b.add(2));
                for c in 0..C {
                    mins[p][r][c] += m * *x[c].s.get_unchecked(i);
                }
            }
        }
    }
    let mut out = [[0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            out[r][c] = hsum(_mm256_add_ps(acc[0][r][c], acc[1][r][c])) + (mins[0][r][c] + mins[1][r][c]);
        }
    }
    out
}

/// Two f32s as sixteen lanes: `a` in the low eight, `b` in the high eight.
#[inline(always)]
unsafe fn halves(a: f32, b: f32) -> __m512 {
    _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(a), _mm512_set1_ps(b))
}

/// The AVX-512 kernel, two blocks a step (the low lanes block `i`, the high ones block `i + 1`):
/// the same results as [`tile_avx2`].
#[inline(always)]
unsafe fn tile_avx512<F: Format, const R: usize, const C: usize>(w: [*const u8; R], x: [&QuantizedRow; C], blocks: usize) -> [[f32; C]; R] {
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let mut mins = [[[0f32; C]; R]; 2];
    let mut i = 0;
    while i < blocks {
        // A last block alone: its partner's lanes are zero (zero sums, zero scale).
        let two = i + 1 < blocks;
        let mut ys = [_mm512_setzero_si512(); C];
        let mut dx = [_mm512_setzero_ps(); C];
        for c in 0..C {
            let q = x[c].q.as_ptr().add(i * BLOCK);
            ys[c] =
                if two { _mm512_loadu_si512(q as *const __m512i) } else { _mm512_zextsi256_si512(_mm256_loadu_si256(q as *const __m256i)) };
            dx[c] = halves(*x[c].d.get_unchecked(i), if two { *x[c].d.get_unchecked(i + 1) } else { 0.0 });
        }
        for r in 0..R {
            let b = w[r].add(i * F::BYTES);
            let low = F::values(b);
            let high = if two { F::values(b.add(F::BYTES)) } else { _mm256_setzero_si256() };
            let values = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high);
            let dw = halves(f16_at(b), if two { f16_at(b.add(F::BYTES)) } else { 0.0 });
            // Signed weights: |w| against the activations negated where w is negative (where w
            // is zero the product is zero either way), as `vpsignb` does on AVX2.
            let negative = if F::SIGNED { _mm512_movepi8_mask(values) } else { 0 };
            let u = if F::SIGNED { _mm512_abs_epi8(values) } else { values };
            for c in 0..C {
                let s = if F::SIGNED { _mm512_mask_sub_epi8(ys[c], negative, _mm512_setzero_si512(), ys[c]) } else { ys[c] };
                let sums = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s));
                acc[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx[c]), sums, acc[r][c]);
            }
            if !F::SIGNED {
                for (p, block) in [i, i + 1].into_iter().enumerate().take(if two { 2 } else { 1 }) {
                    let m = f16_at(w[r].add(block * F::BYTES + 2));
                    for c in 0..C {
                        mins[p][r][c] += m * *x[c].s.get_unchecked(block);
                    }
                }
            }
        }
        i += 2;
    }
    let mut out = [[0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            let a = acc[r][c];
            let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
            out[r][c] = hsum(_mm256_add_ps(_mm512_castps512_ps256(a), high)) + (mins[0][r][c] + mins[1][r][c]);
        }
    }
    out
}

/// Columns `rows` of `y` (m x out_dim, row-major: one activation row's results together) for
/// the weight rows `rows` of `w` (`row_bytes` each) against every activation row of `x`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (and AVX-512 F, BW, VL and VNNI when `avx512`); `w`
/// must hold `rows.end` rows of `x[0].d.len()` blocks of `format`; `y` must have room for
/// `x.len() * out_dim` values, of which this call writes columns `rows` alone.
pub unsafe fn product_rows(
    format: BlockFormat,
    avx512: bool,
    w: &[u8],
    row_bytes: usize,
    rows: std::ops::Range<usize>,
    x: &[QuantizedRow],
    (y, out_dim): (*mut f32, usize),
) {
    macro_rules! run {
        ($f:ty) => {
            if avx512 {
                rows_avx512::<$f>(w, row_bytes, rows, x, (y, out_dim))
            } else {
                rows_avx2::<$f>(w, row_bytes, rows, x, (y, out_dim))
            }
        };
    }
    match format {
        BlockFormat::Q4_0 => run!(Q4_0),
        BlockFormat::Q4_1 => run!(Q4_1),
        BlockFormat::Q5_0 => run!(Q5_0),
        BlockFormat::Q5_1 => run!(Q5_1),
        BlockFormat::Q8_0 => run!(Q8_0),
    }
}

/// [`product_rows`]' loop over one kernel's tiles: whole tiles, then the rows left over in tiles
/// of one. A macro, so that each kernel's target features reach the tile code it inlines.
macro_rules! tiled {
    ($tile:ident, $f:ty, $shape:expr, $w:expr, $row_bytes:expr, $rows:expr, $x:expr, $y:expr) => {{
        const R: usize = $shape.0;
        const C: usize = $shape.1;
        let (w, row_bytes, rows, x, (y, out_dim)): (&[u8], usize, std::ops::Range<usize>, &[QuantizedRow], (*mut f32, usize)) =
            ($w, $row_bytes, $rows, $x, $y);
        let m = x.len();
        let blocks = x.first().map_or(0, |r| r.d.len());
        debug_assert!(w.len() >= rows.end * row_bytes && row_bytes == blocks * <$f>::BYTES);
        let row = |o: usize| w.as_ptr().add(o * row_bytes);
        let put = |o: usize, c: usize, v: f32| *y.add(c * out_dim + o) = v;
        let mut o = rows.start;
        while o < rows.end {
            let r_here = if rows.end - o >= R { R } else { 1 };
            let mut c = 0;
            while c < m {
                let c_here = if m - c >= C { C } else { 1 };
                match (r_here, c_here) {
                    (R, C) => {
                        let out = $tile::<$f, R, C>(std::array::from_fn(|r| row(o + r)), std::array::from_fn(|k| &x[c + k]), blocks);
                        for (r, line) in out.iter().enumerate() {
                            for (k, &v) in line.iter().enumerate() {
                                put(o + r, c + k, v);
                            }
                        }
                    }
                    (R, _) => {
                        let out = $tile::<$f, R, 1>(std::array::from_fn(|r| row(o + r)), [&x[c]], blocks);
                        for (r, line) in out.iter().enumerate() {
                            put(o + r, c, line[0]);
                        }
                    }
                    (_, C) => {
                        let out = $tile::<$f, 1, C>([row(o)], std::array::from_fn(|k| &x[c + k]), blocks);
                        for (k, &v) in out[0].iter().enumerate() {
                            put(o, c + k, v);
                        }
                    }
                    _ => put(o, c, $tile::<$f, 1, 1>([row(o)], [&x[c]], blocks)[0][0]),
                }
                c += c_here;
            }
            o += r_here;
        }
    }};
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_avx2<F: Format>(w: &[u8], row_bytes: usize, rows: std::ops::Range<usize>, x: &[QuantizedRow], y: (*mut f32, usize)) {
    tiled!(tile_avx2, F, AVX2_TILE, w, row_bytes, rows, x, y)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn rows_avx512<F: Format>(w: &[u8], row_bytes: usize, rows: std::ops::Range<usize>, x: &[QuantizedRow], y: (*mut f32, usize)) {
    tiled!(tile_avx512, F, AVX512_TILE, w, row_bytes, rows, x, y)
}
