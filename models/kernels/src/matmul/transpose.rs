//! Rows of a row-major matrix written out as columns: a weight's rows `W[j]` (each `k` long)
//! become the columns of a row-major `k × width` block. gemm packs the weight of a linear
//! layer's forward (`x · Wᵀ`) one value at a time, a strided load and a scalar store each
//! (docs/design.md, matrix products); given the block this writes eight values at a time, its
//! packing is a contiguous copy.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::ops::Range;

use crate::simd::SimdLevel;

/// `out[(p - cols.start) · width + j] = src[(rows.start + j) · row_len + p]` for `j < rows.len()`,
/// `p` in `cols`: the block's rows are `width` apart (at least `rows.len()`; what lies past
/// `rows.len()` is left as it is). `cols` is the whole row (`0..row_len`) for a weight's rows, a
/// window of it for a column-major matrix's rows read out of a wider buffer.
pub(crate) fn rows_as_columns(src: &[f32], row_len: usize, rows: Range<usize>, cols: Range<usize>, width: usize, out: &mut [f32]) {
    rows_as_columns_at(SimdLevel::current(), src, row_len, rows, cols, width, out)
}

/// [`rows_as_columns`] with the kernels of `level` (at most the CPU's).
fn rows_as_columns_at(
    level: SimdLevel,
    src: &[f32],
    row_len: usize,
    rows: Range<usize>,
    cols: Range<usize>,
    width: usize,
    out: &mut [f32],
) {
    let fits = cols.start <= cols.end && cols.end <= row_len && (rows.is_empty() || (rows.end - 1) * row_len + cols.end <= src.len());
    assert!(fits && width >= rows.len() && out.len() >= cols.len() * width, "rows_as_columns: {rows:?} x {cols:?} of {row_len}-wide rows");
    // SAFETY (both): the level is at most what the CPU has (`usable`); the bounds are checked above.
    #[cfg(target_arch = "x86_64")]
    match level.usable() {
        SimdLevel::Avx512 => return unsafe { rows_as_columns_avx512(src, row_len, rows, cols, width, out) },
        SimdLevel::Avx2 => return unsafe { rows_as_columns_avx2(src, row_len, rows, cols, width, out) },
        _ => {}
    }
    rows_as_columns_scalar(src, row_len, rows, cols, width, out, 0, 0);
}

/// The plain loop from row offset `j_from` and column offset `p_from` on (the edges the vector
/// code leaves): every `(p, j)` with `j >= j_from` or `p - cols.start >= p_from`.
#[allow(clippy::too_many_arguments)]
fn rows_as_columns_scalar(
    src: &[f32],
    row_len: usize,
    rows: Range<usize>,
    cols: Range<usize>,
    width: usize,
    out: &mut [f32],
    j_from: usize,
    p_from: usize,
) {
    for j in 0..rows.len() {
        let row = &src[(rows.start + j) * row_len + cols.start..][..cols.len()];
        let p_start = if j >= j_from { 0 } else { p_from };
        for (p, v) in row.iter().enumerate().skip(p_start) {
            out[p * width + j] = *v;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn rows_as_columns_avx2(src: &[f32], row_len: usize, rows: Range<usize>, cols: Range<usize>, width: usize, out: &mut [f32]) {
    let (full_j, full_p) = (rows.len() / 8 * 8, cols.len() / 8 * 8);
    let (s, o) = (src.as_ptr().add(rows.start * row_len + cols.start), out.as_mut_ptr());
    for j in (0..full_j).step_by(8) {
        for p in (0..full_p).step_by(8) {
            let mut v = [_mm256_setzero_ps(); 8];
            for (r, v) in v.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(s.add((j + r) * row_len + p));
            }
            for (pp, t) in transpose8(v).into_iter().enumerate() {
                _mm256_storeu_ps(o.add((p + pp) * width + j), t);
            }
        }
    }
    rows_as_columns_scalar(src, row_len, rows, cols, width, out, full_j, full_p);
}

/// 16 × 16 blocks: each output row's 16 values are one whole 64-byte store (the 8 × 8 blocks
/// of AVX2 write half a line at a time, and their transposes take more shuffles per value).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rows_as_columns_avx512(src: &[f32], row_len: usize, rows: Range<usize>, cols: Range<usize>, width: usize, out: &mut [f32]) {
    let (full_j, full_p) = (rows.len() / 16 * 16, cols.len() / 16 * 16);
    let (s, o) = (src.as_ptr().add(rows.start * row_len + cols.start), out.as_mut_ptr());
    for j in (0..full_j).step_by(16) {
        for p in (0..full_p).step_by(16) {
            let mut v = [_mm512_setzero_ps(); 16];
            for (r, v) in v.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(s.add((j + r) * row_len + p));
            }
            for (pp, t) in transpose16(v).into_iter().enumerate() {
                _mm512_storeu_ps(o.add((p + pp) * width + j), t);
            }
        }
    }
    // The edges (fewer than 16 rows or columns left) as AVX2 does them, 8 at a time and then
    // one at a time: the rows past the last 16, then the columns past the last 16 of the rest.
    if full_j < rows.len() {
        rows_as_columns_avx2(src, row_len, rows.start + full_j..rows.end, cols.clone(), width, &mut out[full_j..]);
    }
    if full_p < cols.len() && full_j > 0 {
        rows_as_columns_avx2(
            src,
            row_len,
            rows.start..rows.start + full_j,
            cols.start + full_p..cols.end,
            width,
            &mut out[full_p * width..],
        );
    }
}

/// The 16 × 16 transpose of sixteen rows: lane r of output c is lane c of input r (of any
/// 32-bit values: the AMX kernels move bf16 pairs with it).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    // Pairs of rows interleaved, then quads: in each 128-bit lane l, u[4q + c] holds column
    // 4l + c of rows 4q .. 4q + 4.
    let mut t = [_mm512_setzero_ps(); 16];
    for q in 0..8 {
        t[2 * q] = _mm512_unpacklo_ps(r[2 * q], r[2 * q + 1]);
        t[2 * q + 1] = _mm512_unpackhi_ps(r[2 * q], r[2 * q + 1]);
    }
    let mut u = [_mm512_setzero_ps(); 16];
    for q in 0..4 {
        let (a, b) = (4 * q, 4 * q + 2);
        u[4 * q] = _mm512_shuffle_ps::<0x44>(t[a], t[b]);
        u[4 * q + 1] = _mm512_shuffle_ps::<0xEE>(t[a], t[b]);
        u[4 * q + 2] = _mm512_shuffle_ps::<0x44>(t[a + 1], t[b + 1]);
        u[4 * q + 3] = _mm512_shuffle_ps::<0xEE>(t[a + 1], t[b + 1]);
    }
    // Lanes gathered across registers: v[8h + c] holds columns c and c + 8 of rows 8h .. 8h + 8.
    let mut v = [_mm512_setzero_ps(); 16];
    for half in 0..2 {
        for c in 0..4 {
            let (a, b) = (u[8 * half + c], u[8 * half + 4 + c]);
            v[8 * half + c] = _mm512_shuffle_f32x4::<0x88>(a, b);
            v[8 * half + 4 + c] = _mm512_shuffle_f32x4::<0xDD>(a, b);
        }
    }
    let mut w = [_mm512_setzero_ps(); 16];
    for c in 0..8 {
        // v[c] holds columns c (lanes 0, 2) and c + 8 (lanes 1, 3) of rows 0-7, v[8 + c] the
        // same of rows 8-15.
        w[c] = _mm512_shuffle_f32x4::<0x88>(v[c], v[8 + c]);
        w[c + 8] = _mm512_shuffle_f32x4::<0xDD>(v[c], v[8 + c]);
    }
    w
}

/// The 8 × 8 transpose of eight rows: lane r of output j is lane j of input r.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lane r of output c is lane c of input r.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn transpose16_is_the_transpose() {
        if crate::simd::CpuFeatures::detected().best_level() < SimdLevel::Avx512 {
            return;
        }
        let m: Vec<f32> = (0..256).map(|i| i as f32).collect();
        // SAFETY: the CPU has AVX-512 F; m holds 16 rows of 16.
        let t = unsafe { transpose16(std::array::from_fn(|i| _mm512_loadu_ps(m.as_ptr().add(i * 16)))) };
        let mut out = [0f32; 256];
        for (i, row) in t.iter().enumerate() {
            // SAFETY: out has room for 16 rows of 16.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(i * 16), *row) };
        }
        for i in 0..16 {
            for j in 0..16 {
                assert_eq!(out[i * 16 + j], m[j * 16 + i]);
            }
        }
    }

    /// The vector copy writes what the plain loop writes, edges included (rows and depth not
    /// multiples of 8, rows from inside the matrix, a window of each row, a block wider than its
    /// rows), and leaves the padding alone.
    #[test]
    fn rows_become_columns() {
        let (n, k) = (53, 45);
        let src: Vec<f32> = (0..n * k).map(|i| i as f32).collect();
        for (rows, cols, width) in [
            (0..n, 0..k, n),
            (3..30, 0..k, 27),
            (5..21, 0..k, 20),
            (2..n, 3..k - 1, 60),
            (0..9, 17..k, 9),
            (1..49, 2..36, 48),
            (0..32, 0..32, 33),
        ] {
            for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512].into_iter().filter(|l| *l <= SimdLevel::detected()) {
                let mut out = vec![-1.0; cols.len() * width];
                rows_as_columns_at(level, &src, k, rows.clone(), cols.clone(), width, &mut out);
                for p in cols.clone() {
                    for j in 0..width {
                        let want = if j < rows.len() { src[(rows.start + j) * k + p] } else { -1.0 };
                        assert_eq!(out[(p - cols.start) * width + j], want, "{level:?}, rows {rows:?}, cols {cols:?}: ({p}, {j})");
                    }
                }
            }
        }
    }
}
