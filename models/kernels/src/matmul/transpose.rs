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
    let fits = cols.start <= cols.end && cols.end <= row_len && (rows.is_empty() || (rows.end - 1) * row_len + cols.end <= src.len());
    assert!(fits && width >= rows.len() && out.len() >= cols.len() * width, "rows_as_columns: {rows:?} x {cols:?} of {row_len}-wide rows");
    #[cfg(target_arch = "x86_64")]
    if SimdLevel::current() >= SimdLevel::Avx2 {
        // SAFETY: the level in use is at most what the CPU has; the bounds are checked above.
        return unsafe { rows_as_columns_avx2(src, row_len, rows, cols, width, out) };
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

    /// The vector copy writes what the plain loop writes, edges included (rows and depth not
    /// multiples of 8, rows from inside the matrix, a window of each row, a block wider than its
    /// rows), and leaves the padding alone.
    #[test]
    fn rows_become_columns() {
        let (n, k) = (37, 29);
        let src: Vec<f32> = (0..n * k).map(|i| i as f32).collect();
        for (rows, cols, width) in [(0..n, 0..k, n), (3..30, 0..k, 27), (5..21, 0..k, 20), (2..n, 3..k - 1, 40), (0..9, 17..k, 9)] {
            let mut out = vec![-1.0; cols.len() * width];
            rows_as_columns(&src, k, rows.clone(), cols.clone(), width, &mut out);
            for p in cols.clone() {
                for j in 0..width {
                    let want = if j < rows.len() { src[(rows.start + j) * k + p] } else { -1.0 };
                    assert_eq!(out[(p - cols.start) * width + j], want, "rows {rows:?}, cols {cols:?}: ({p}, {j})");
                }
            }
        }
    }
}
