//! `x · Wᵀ` for f32 activations and f16 / bf16 weights with many rows (a prompt's chunk, a batch
//! past decoding's matrix-vector kernels), a piece of weight rows at a time. Where our packed
//! driver runs a piece, its rows are widened to f32 as they are packed (`packed::RhsElem`) and
//! the pieces share one packing of x; elsewhere (gemm's kernels read f32 only) a piece is widened
//! into a per-thread buffer that stays in the cache and run as an f32 product. The whole matrix
//! is never widened: that moved twice its f32 size through memory on every product and held it
//! meanwhile.

use half::{bf16, f16};

use crate::disjoint::DisjointWrites;
use crate::simd::SimdLevel;

/// Weight rows widened at a time (dst columns of one piece): a multiple of every tile's width,
/// and at SmolLM2's width 576 a 288 KiB buffer, within a core's L2.
const PIECE_ROWS: usize = 128;

/// A 2-byte weight type and its exact widening to f32 (every f16 and bf16 is an f32 exactly, so
/// the values do not depend on the instructions).
pub trait HalfWeight: Copy + Send + Sync {
    /// `src` widened into `dst` (as long) with the instructions of `level` (or the best below
    /// it this CPU has).
    fn widen(src: &[Self], dst: &mut [f32], level: SimdLevel);

    /// `super::sgemm_piece_wt` for this type: the piece's product with the rows widened as
    /// they are packed, if our packed driver runs it (false: nothing done).
    ///
    /// # Safety
    /// As `super::sgemm_piece_wt`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn packed_piece(
        m: usize,
        n: usize,
        k: usize,
        dst: (*mut f32, usize),
        lhs: super::Strided<*const f32>,
        w: *const Self,
        shared: Option<&super::SharedLhs>,
    ) -> bool;

    /// The whole product on tiles of this type's own arithmetic (AMX-BF16 for bf16), if the
    /// kernel table allows them and the shapes fit; None: the widening path runs it.
    fn tiles_product(x: &[f32], ws: &[&[Self]], in_dim: usize) -> Option<Vec<Vec<f32>>>;
}

/// [`HalfWeight`] for a half type: its widening loops at AVX2 and AVX-512 (value by value
/// below), and the packed driver on x86-64 (nothing elsewhere).
macro_rules! half_weight {
    ($elem:ty, $widen_avx512:ident, $widen_avx2:ident, |$x:ident, $ws:ident, $in_dim:ident| $tiles:expr) => {
        impl HalfWeight for $elem {
            fn widen(src: &[Self], dst: &mut [f32], level: SimdLevel) {
                assert_eq!(src.len(), dst.len());
                #[cfg(target_arch = "x86_64")]
                match level.usable() {
                    // SAFETY: `usable` never exceeds the CPU's level; AVX2's includes F16C;
                    // equal lengths.
                    SimdLevel::Avx512 => return unsafe { x86::$widen_avx512(src, dst) },
                    SimdLevel::Avx2 => return unsafe { x86::$widen_avx2(src, dst) },
                    SimdLevel::Scalar => {}
                }
                let _ = level;
                dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
            }

            unsafe fn packed_piece(
                m: usize,
                n: usize,
                k: usize,
                dst: (*mut f32, usize),
                lhs: super::Strided<*const f32>,
                w: *const Self,
                shared: Option<&super::SharedLhs>,
            ) -> bool {
                #[cfg(target_arch = "x86_64")]
                return super::sgemm_piece_wt(m, n, k, dst, lhs, w, shared);
                #[cfg(not(target_arch = "x86_64"))]
                {
                    let _ = (m, n, k, dst, lhs, w, shared);
                    false
                }
            }

            fn tiles_product($x: &[f32], $ws: &[&[Self]], $in_dim: usize) -> Option<Vec<Vec<f32>>> {
                $tiles
            }
        }
    };
}

// f16 has no tiles here (AMX-FP16 is a later Xeon's), and rounding it to bf16 would lose bits.
half_weight!(f16, widen_f16_avx512, widen_f16_avx2, |_x, _ws, _in_dim| None);
half_weight!(bf16, widen_bf16_avx512, widen_bf16_avx2, |x, ws, in_dim| {
    let out_dims: Vec<usize> = ws.iter().map(|w| w.len() / in_dim).collect();
    if !bf16_on_tiles(in_dim, &out_dims) {
        return None;
    }
    // SAFETY: the table allows AMX only where the CPU has AMX-BF16 and AVX-512 and the OS granted
    // the tiles; the shapes fit.
    #[cfg(target_arch = "x86_64")]
    return Some(unsafe { super::amx_bf16::product_wt_many(x, ws, in_dim) });
    #[cfg(not(target_arch = "x86_64"))]
    None
});

/// Whether a bf16 product of `in_dim` inputs into matrices of `out_dims` rows runs on AMX tiles,
/// where the activations are rounded to bf16 (elsewhere they stay f32 against the widened
/// weights).
pub fn bf16_on_tiles(in_dim: usize, out_dims: &[usize]) -> bool {
    #[cfg(target_arch = "x86_64")]
    return crate::simd::Kernels::get().amx_bf16() && super::amx_bf16::fits(in_dim, out_dims);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (in_dim, out_dims);
        false
    }
}

/// The widening loops, the conversion inline: half's slice conversion calls a function for
/// every 8 values, and was a fifth of an f16 prompt's profile (docs/design.md).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::{bf16, f16};

    /// A loop over `src` in vectors of `$lanes`, the last values one by one.
    macro_rules! widen_loop {
        ($name:ident, $elem:ty, $features:literal, $lanes:literal, |$p:ident, $q:ident| $step:expr) => {
            #[target_feature(enable = $features)]
            pub unsafe fn $name(src: &[$elem], dst: &mut [f32]) {
                let n = src.len().min(dst.len());
                let (s, d) = (src.as_ptr() as *const u16, dst.as_mut_ptr());
                let mut i = 0;
                while i + $lanes <= n {
                    let ($p, $q) = (s.add(i), d.add(i));
                    $step;
                    i += $lanes;
                }
                for i in i..n {
                    *d.add(i) = src[i].to_f32();
                }
            }
        };
    }

    widen_loop!(widen_f16_avx512, f16, "avx512f,avx2,f16c", 16, |p, q| _mm512_storeu_ps(
        q,
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    ));
    widen_loop!(widen_f16_avx2, f16, "avx2,f16c", 8, |p, q| _mm256_storeu_ps(q, _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))));
    // bf16 is the top half of an f32.
    widen_loop!(widen_bf16_avx512, bf16, "avx512f,avx2", 16, |p, q| _mm512_storeu_ps(
        q,
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i))))
    ));
    widen_loop!(widen_bf16_avx2, bf16, "avx2", 8, |p, q| _mm256_storeu_ps(
        q,
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i))))
    ));
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
    assert_eq!(w.len(), out_dim * in_dim, "half product: the weight is not {out_dim} rows of {in_dim}");
    product_wt_many(x, &[w], in_dim).remove(0)
}

/// [`product_wt`] for several matrices over the same x (q/k/v, gate/up), each `ws[i]` holding
/// whole rows of `in_dim`: their pieces are one parallel region with one packing of x, where
/// one product each packed x again and waited at its end for the thread with the last piece
/// (a 192-row k or v matrix is two pieces of unequal width).
///
/// # Panics
/// When the lengths do not hold whole rows of `in_dim`.
pub fn product_wt_many<W: HalfWeight>(x: &[f32], ws: &[&[W]], in_dim: usize) -> Vec<Vec<f32>> {
    let whole_rows = |len: usize| len.is_multiple_of(in_dim);
    assert!(in_dim > 0 && whole_rows(x.len()) && ws.iter().all(|w| whole_rows(w.len())), "half product: shapes do not match");
    if let Some(ys) = W::tiles_product(x, ws, in_dim) {
        return ys;
    }
    let m = x.len() / in_dim;
    let out_dims: Vec<usize> = ws.iter().map(|w| w.len() / in_dim).collect();
    // Every matrix's pieces in one list: (matrix, its rows).
    let pieces: Vec<(usize, std::ops::Range<usize>)> = out_dims
        .iter()
        .enumerate()
        .flat_map(|(i, &out)| (0..out.div_ceil(PIECE_ROWS)).map(move |p| (i, p * PIECE_ROWS..((p + 1) * PIECE_ROWS).min(out))))
        .collect();
    let mut dsts: Vec<Vec<f32>> = out_dims.iter().map(|out| Vec::with_capacity(m * out)).collect();
    let Some(narrowest) = pieces.iter().map(|(_, rows)| rows.len()).min().filter(|_| m > 0) else {
        return out_dims.iter().map(|out| vec![0f32; m * out]).collect();
    };
    let outs: Vec<DisjointWrites<f32>> = dsts.iter_mut().zip(&out_dims).map(|(d, out)| DisjointWrites::spare(d, m * out)).collect();
    let level = SimdLevel::current();
    let lhs = || (x.as_ptr(), 1, in_dim as isize);
    let pieces_of = |shared: Option<&super::SharedLhs>| {
        candle_core::utils::barrier_pool().execute_chunked(pieces.len(), |range| {
            WIDENED.with(|buf| {
                for (i, rows) in pieces[range].iter().cloned() {
                    let (w, out_dim) = (ws[i], out_dims[i]);
                    // SAFETY: matrix i's dst has room for m × out_dim values; columns `rows` of
                    // each row are this piece's, which no other piece writes, and every column
                    // of every row is some piece's (written before `set_len` below).
                    let piece_dst = unsafe { (outs[i].at(rows.start), out_dim) };
                    // SAFETY: as below, with w's rows `rows` read in place.
                    if unsafe { W::packed_piece(m, rows.len(), in_dim, piece_dst, lhs(), w[rows.start * in_dim..].as_ptr(), shared) } {
                        continue;
                    }
                    let mut buf = buf.borrow_mut();
                    buf.resize(PIECE_ROWS * in_dim, 0.0);
                    let widened = &mut buf[..rows.len() * in_dim];
                    W::widen(&w[rows.start * in_dim..rows.end * in_dim], widened, level);
                    // SAFETY: as above for dst (row stride out_dim, not read: accumulate is
                    // false); x holds m rows of in_dim and the widened buffer rows.len() rows of
                    // in_dim (read transposed: element (i, o) at o · in_dim + i); `shared` packs
                    // this x.
                    unsafe {
                        super::sgemm_piece(m, rows.len(), in_dim, piece_dst, lhs(), (widened.as_ptr(), in_dim as isize, 1), false, shared)
                    }
                }
            })
        })
    };
    // Every piece reads all of x: on our packed driver the threads share one packing of it.
    // SAFETY: x holds m rows of in_dim and outlives the product.
    unsafe { super::with_lhs_shared_by_pieces(m, narrowest, in_dim, lhs(), pieces_of) };
    drop(outs);
    for (dst, out) in dsts.iter_mut().zip(&out_dims) {
        // SAFETY: the pieces wrote all m × out values of each matrix (see above).
        unsafe { dst.set_len(m * out) };
    }
    dsts
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every f16 and bf16 value widens to what `to_f32` gives, at every level this CPU has
    /// (NaNs to NaNs), over lengths with and without a partial last vector.
    #[test]
    fn widening_is_exact_at_every_level() {
        let levels = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512];
        let bits: Vec<u16> = (0..=u16::MAX).collect();
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        for level in levels.into_iter().filter(|l| *l <= SimdLevel::detected()) {
            for len in [bits.len(), 37, 16, 7] {
                let (h, b): (Vec<f16>, Vec<bf16>) = bits[..len].iter().map(|&u| (f16::from_bits(u), bf16::from_bits(u))).unzip();
                let mut out = vec![0f32; len];
                f16::widen(&h, &mut out, level);
                assert!(h.iter().zip(&out).all(|(v, o)| same(v.to_f32(), *o)), "f16 at {level:?}, {len} values");
                bf16::widen(&b, &mut out, level);
                assert!(b.iter().zip(&out).all(|(v, o)| same(v.to_f32(), *o)), "bf16 at {level:?}, {len} values");
            }
        }
    }

    /// Several matrices in one region give each the bits of its own product (the pieces are
    /// the same), with rows not a multiple of a piece, a matrix of no rows, and no x rows.
    #[test]
    fn products_in_one_region_equal_each_alone() {
        let in_dim = 96;
        let outs = [300usize, 0, 192, 17];
        let ws: Vec<Vec<f16>> = outs
            .iter()
            .enumerate()
            .map(|(i, o)| crate::rng::signed_values(o * in_dim, 3 + i as u64).into_iter().map(f16::from_f32).collect())
            .collect();
        let slices: Vec<&[f16]> = ws.iter().map(|w| w.as_slice()).collect();
        for m in [0usize, 5, 46] {
            let x = crate::rng::signed_values(m * in_dim, 9);
            let together = product_wt_many(&x, &slices, in_dim);
            assert_eq!(together.len(), outs.len());
            for ((got, w), &out) in together.iter().zip(&slices).zip(&outs) {
                let alone = product_wt(&x, w, out, in_dim);
                assert_eq!(got.len(), m * out);
                assert!(got.iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits()), "{m} rows, {out} outputs");
            }
        }
    }

    /// Equal to the f32 product of the widened matrix (the same kernels on the same values),
    /// for shapes with a partial last piece, f16 and bf16; for bf16 on AMX tiles, of the
    /// activations rounded to bf16.
    #[test]
    fn half_products_equal_the_product_of_the_widened_weights() {
        for (m, out_dim, in_dim) in [(7usize, 300usize, 64usize), (64, 128, 96), (1, 5, 32)] {
            let x = crate::rng::signed_values(m * in_dim, 1);
            let w32 = crate::rng::signed_values(out_dim * in_dim, 2);
            let w16: Vec<f16> = w32.iter().map(|&v| f16::from_f32(v)).collect();
            let wb16: Vec<bf16> = w32.iter().map(|&v| bf16::from_f32(v)).collect();
            let widen16: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
            let widenb16: Vec<f32> = wb16.iter().map(|v| v.to_f32()).collect();
            let x_bf16: Vec<f32> = match bf16_on_tiles(in_dim, &[out_dim]) {
                true => x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
                false => x.clone(),
            };
            let cases = [(product_wt(&x, &w16, out_dim, in_dim), widen16, &x), (product_wt(&x, &wb16, out_dim, in_dim), widenb16, &x_bf16)];
            for (got, widened, x) in cases {
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
