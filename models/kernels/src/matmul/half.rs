//! `x · Wᵀ` for f32 activations and f16 / bf16 weights with many rows (a prompt's chunk, a batch
//! past decoding's matrix-vector kernels): the weight rows are widened to f32 a piece at a time
//! into a per-thread buffer that stays in the cache, and each piece runs as an f32 product
//! ([`super::sgemm`]). The whole matrix is never widened: that moved twice its f32 size through
//! memory on every product and held it meanwhile.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::disjoint::DisjointWrites;

/// Weight rows widened at a time (dst columns of one piece): a multiple of every tile's width,
/// and at SmolLM2's width 576 a 288 KiB buffer, within a core's L2.
const PIECE_ROWS: usize = 128;

/// A 2-byte weight type and its exact widening to f32.
pub trait HalfWeight: Copy + Send + Sync {
    fn widen(src: &[Self], dst: &mut [f32]);
}

impl HalfWeight for f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        // half's slice conversion runs F16C where the CPU has it; every f16 is an f32 exactly, so
        // the values do not depend on the instructions.
        src.convert_to_f32_slice(dst)
    }
}

impl HalfWeight for bf16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
}

thread_local! {
    /// This thread's widened piece, kept between products.
    static WIDENED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `x (rows, in) · wᵀ` for w (out, in) of 2-byte values: (rows, out), row-major.
///
/// # Panics
/// When the lengths do not hold whole rows of `in_dim` or `w` not `out_dim` of them.
pub fn product_wt<W: HalfWeight>(x: &[f32], w: &[W], out_dim: usize, in_dim: usize) -> Vec<f32> {
    assert!(in_dim > 0 && x.len().is_multiple_of(in_dim) && w.len() == out_dim * in_dim, "half product: shapes do not match");
    let m = x.len() / in_dim;
    let mut dst = vec![0f32; m * out_dim];
    let out = DisjointWrites::new(&mut dst);
    let pieces = out_dim.div_ceil(PIECE_ROWS);
    candle_core::utils::barrier_pool().execute_chunked(pieces, |range| {
        WIDENED.with(|buf| {
            let mut buf = buf.borrow_mut();
            buf.resize(PIECE_ROWS * in_dim, 0.0);
            for piece in range {
                let rows = piece * PIECE_ROWS..((piece + 1) * PIECE_ROWS).min(out_dim);
                let widened = &mut buf[..rows.len() * in_dim];
                W::widen(&w[rows.start * in_dim..rows.end * in_dim], widened);
                // SAFETY: dst has m × out_dim values; this piece writes columns `rows` of each of
                // its m rows (row stride out_dim) and no other piece writes them; x holds m rows
                // of in_dim and the widened buffer rows.len() rows of in_dim (read transposed:
                // element (i, o) at o · in_dim + i).
                unsafe {
                    super::sgemm(
                        m,
                        rows.len(),
                        in_dim,
                        (out.at(rows.start), 1, out_dim as isize),
                        (x.as_ptr(), 1, in_dim as isize),
                        (widened.as_ptr(), in_dim as isize, 1),
                        0.0,
                        1.0,
                    )
                }
            }
        })
    });
    dst
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Equal to the f32 product of the widened matrix (the same kernels on the same values),
    /// for shapes with a partial last piece, f16 and bf16.
    #[test]
    fn half_products_equal_the_product_of_the_widened_weights() {
        for (m, out_dim, in_dim) in [(7usize, 300usize, 64usize), (64, 128, 96), (1, 5, 32)] {
            let x = crate::rng::signed_values(m * in_dim, 1);
            let w32 = crate::rng::signed_values(out_dim * in_dim, 2);
            let w16: Vec<f16> = w32.iter().map(|&v| f16::from_f32(v)).collect();
            let wb16: Vec<bf16> = w32.iter().map(|&v| bf16::from_f32(v)).collect();
            let widen16: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
            let widenb16: Vec<f32> = wb16.iter().map(|v| v.to_f32()).collect();
            for (got, widened) in [(product_wt(&x, &w16, out_dim, in_dim), widen16), (product_wt(&x, &wb16, out_dim, in_dim), widenb16)] {
                for r in 0..m {
                    for o in 0..out_dim {
                        let want: f32 = (0..in_dim).map(|i| x[r * in_dim + i] * widened[o * in_dim + i]).sum();
                        let g = got[r * out_dim + o];
                        assert!((g - want).abs() <= 1e-4 * (1.0 + want.abs()), "{m}x{out_dim}x{in_dim} ({r}, {o}): {g} vs {want}");
                    }
                }
            }
        }
    }
}
