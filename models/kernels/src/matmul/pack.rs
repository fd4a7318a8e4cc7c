//! Packing for the packed driver (`packed.rs`): blocks of lhs and rhs copied into the order its
//! register tiles read them (micro-panels of MR rows / NR columns, depth-major), widening
//! 2-byte weights to f32 on the way.

use std::arch::x86_64::*;

use super::rhs_elem::RhsElem;
use super::tiles::{Tile, MR, NR_AVX2, NR_AVX512};
use super::transpose::transpose8;

/// Source rows read at a time where the copy runs along them, across every panel: panel by
/// panel, each of a panel's p read a different row (a different page, mostly) for a few values,
/// an order the hardware prefetchers do not follow.
const ROWS_AT_ONCE: usize = 8;

/// Calls `copy(panel, p)` for each of `panels` full panels and each depth p < `kc`, in
/// [`ROWS_AT_ONCE`]'s order: a group of source rows (depths) at a time across every panel.
#[inline(always)]
fn by_row_groups(kc: usize, panels: usize, mut copy: impl FnMut(usize, usize)) {
    for p0 in (0..kc).step_by(ROWS_AT_ONCE) {
        for panel in 0..panels {
            for p in p0..(p0 + ROWS_AT_ONCE).min(kc) {
                copy(panel, p);
            }
        }
    }
}

/// [`pack_rhs`] at `tile`'s panel width, as a constant: the copy loops unroll (a run-time width
/// was slower).
///
/// # Safety
/// As [`pack_rhs`].
pub(super) unsafe fn pack_rhs_for<T: RhsElem>(tile: Tile, kc: usize, nc: usize, src: *const T, cs: isize, rs: isize, out: *mut f32) {
    match tile {
        Tile::Avx2 => pack_rhs::<NR_AVX2, T>(kc, nc, src, cs, rs, out),
        Tile::Avx512 => pack_rhs::<NR_AVX512, T>(kc, nc, src, cs, rs, out),
    }
}

/// Packs an `mc × kc` block of lhs (element (i, p) at `i·rs + p·cs`) as micro-panels of MR
/// rows: panel i holds, for each p, rows 6i..6i+6 (zeros past the block's rows).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn pack_lhs(mc: usize, kc: usize, src: *const f32, cs: isize, rs: isize, out: *mut f32) {
    // Columns run along the rows (a transposed gradient): each p's 6 values are adjacent, and
    // the full panels are copied a few source rows at a time across all of them.
    let full = if rs == 1 { mc / MR } else { 0 };
    by_row_groups(kc, full, |i, p| {
        std::ptr::copy_nonoverlapping(src.add(i * MR).offset(p as isize * cs), out.add(i * MR * kc + p * MR), MR)
    });
    for i in full..mc.div_ceil(MR) {
        let rows = MR.min(mc - i * MR);
        let (s, o) = (src.offset((i * MR) as isize * rs), out.add(i * MR * kc));
        let mut p = 0;
        if rows == MR && cs == 1 {
            // Rows run along p: transpose 8 × 8 blocks (rows 6 and 7 repeat row 5), storing 8
            // lanes per p of which the next p's store overwrites the last 2; the block's last p
            // stores its 6 only (past it may be another thread's block), as 4 + 2 lanes: a
            // masked store (`vmaskmovps`) is microcoded on AMD (docs/design.md).
            while p + 8 <= kc {
                let mut v = [_mm256_setzero_ps(); 8];
                for (r, v) in v.iter_mut().enumerate() {
                    *v = _mm256_loadu_ps(s.offset(r.min(MR - 1) as isize * rs + p as isize));
                }
                let t = transpose8(v);
                for (pp, t) in t.iter().enumerate().take(7) {
                    _mm256_storeu_ps(o.add((p + pp) * MR), *t);
                }
                let last = o.add((p + 7) * MR);
                _mm_storeu_ps(last, _mm256_castps256_ps128(t[7]));
                _mm_storel_pd(last.add(4).cast(), _mm_castps_pd(_mm256_extractf128_ps::<1>(t[7])));
                p += 8;
            }
        }
        for p in p..kc {
            for r in 0..MR {
                *o.add(p * MR + r) = if r < rows { *s.offset(r as isize * rs + p as isize * cs) } else { 0.0 };
            }
        }
    }
}

/// Packs a `kc × nc` block of rhs (element (p, j) at `p·rs + j·cs`) as micro-panels of `NR` (the
/// tile's width, a multiple of 8) columns: panel q holds, for each p, columns NR·q..NR·q+NR
/// (zeros past the block's columns).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_rhs<const NR: usize, T: RhsElem>(kc: usize, nc: usize, src: *const T, cs: isize, rs: isize, out: *mut f32) {
    // Rows run along the columns (a row-major operand): the full panels are copied a few rows
    // at a time across all of them.
    let full = if cs == 1 { nc / NR } else { 0 };
    by_row_groups(kc, full, |q, p| {
        let (row, o) = (src.add(q * NR).offset(p as isize * rs), out.add(q * NR * kc + p * NR));
        for v in (0..NR).step_by(8) {
            _mm256_storeu_ps(o.add(v), T::load8(row.add(v)));
        }
    });
    for q in full..nc.div_ceil(NR) {
        let cols = NR.min(nc - q * NR);
        let (s, o) = (src.offset((q * NR) as isize * cs), out.add(q * NR * kc));
        let mut p = 0;
        if cols == NR && rs == 1 {
            // Columns run along p (a transposed weight): transpose 8 × 8 blocks.
            while p + 8 <= kc {
                for part in (0..NR).step_by(8) {
                    let mut v = [_mm256_setzero_ps(); 8];
                    for (j, v) in v.iter_mut().enumerate() {
                        *v = T::load8(s.offset((part + j) as isize * cs + p as isize));
                    }
                    for (pp, t) in transpose8(v).into_iter().enumerate() {
                        _mm256_storeu_ps(o.add((p + pp) * NR + part), t);
                    }
                }
                p += 8;
            }
        }
        for p in p..kc {
            for j in 0..NR {
                *o.add(p * NR + j) = if j < cols { (*s.offset(p as isize * rs + j as isize * cs)).to_f32() } else { 0.0 };
            }
        }
    }
}
