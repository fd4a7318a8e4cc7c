//! `x · Wᵀ` for bf16 weights on AMX-BF16 tiles (Intel's Xeons since Sapphire Rapids): a prompt's
//! or a batch's rows against a bf16 matrix, 16 × 16 results a tile, each `tdpbf16ps` 16 × 16 × 32
//! multiply-adds into f32, against AVX-512's 16 an FMA.
//!
//! The weight is read in place: its rows are already a tile's A operand (16 rows of 32 values,
//! the row stride the matrix's), so the tiles compute `W · xᵀ`, the results for 16 weight rows
//! (outputs) by 16 activation rows, and those are written transposed into `y`. The activations
//! are rounded to bf16 once per product (round to nearest even, as PyTorch's bf16 linear and
//! llama.cpp's bf16 dot product do) and laid out as the B operand: per 16 activation rows and 32
//! inputs, 16 tile rows of 16 pairs (inputs `2r`, `2r + 1` of each activation row).
//!
//! Every sum runs inside the tiles over the whole depth, so unlike the 32-value block formats
//! (whose per-block scales made every block's sums leave the tiles: docs/design.md) nothing but
//! the final 16 × 16 leaves a tile.

use std::arch::asm;
use std::arch::x86_64::*;

use half::bf16;

use super::amx::{bf16_run, configure_tiles, release_tiles, DEPTH, TILE, TILE_VALUES as B_TILE};
use super::transpose::transpose16;
use crate::disjoint::DisjointWrites;
use crate::pool::{for_rows_of_many, pool_chunks_mut};

/// Whether the tiles take a product of `in_dim` inputs into matrices of `out_dims` rows: whole
/// tiles along both (the weight's rows are read straight into the tiles).
pub fn fits(in_dim: usize, out_dims: &[usize]) -> bool {
    in_dim > 0 && in_dim.is_multiple_of(DEPTH) && out_dims.iter().all(|o| o.is_multiple_of(TILE))
}

/// `x (m, in_dim) · wᵀ` for each `ws[i]` (out_i, in_dim) bf16, row-major: (m, out_i) each, the
/// matrices in one parallel region over their 16-row tiles.
///
/// # Safety
/// The CPU must have AMX-TILE, AMX-BF16 and AVX-512 F, and Linux must have granted this
/// process the tile state (`simd::Kernels::amx_bf16`); the shapes must [`fits`].
pub unsafe fn product_wt_many(x: &[f32], ws: &[&[bf16]], in_dim: usize) -> Vec<Vec<f32>> {
    let out_dims: Vec<usize> = ws.iter().map(|w| w.len() / in_dim).collect();
    debug_assert!(fits(in_dim, &out_dims) && x.len().is_multiple_of(in_dim));
    let m = x.len() / in_dim;
    let packed = pack_activations(x, m, in_dim);
    let mut ys: Vec<Vec<f32>> = out_dims.iter().map(|o| Vec::with_capacity(m * o)).collect();
    let outs: Vec<DisjointWrites<f32>> = ys.iter_mut().zip(&out_dims).map(|(y, o)| DisjointWrites::spare(y, m * o)).collect();
    let tiles: Vec<usize> = out_dims.iter().map(|o| o / TILE).collect();
    for_rows_of_many(&tiles, |i, range| {
        // SAFETY: the caller vouches for the CPU and the grant; `range` is tiles of matrix i,
        // whose rows hold in_dim values each; every (output, activation row) of matrix i is
        // written by the one tile that holds it.
        unsafe { tiles_of(ws[i], in_dim, range, &packed, m, (&outs[i], out_dims[i])) };
    });
    drop(outs);
    for (y, o) in ys.iter_mut().zip(&out_dims) {
        // SAFETY: every tile of every matrix ran (the ranges cover them), each writing its 16
        // outputs of every one of the m rows.
        unsafe { y.set_len(m * o) };
    }
    ys
}

/// x's rows as B tiles, 16 activation rows a group (the last padded with zeros to 32, so the
/// kernel takes groups in pairs): per group and per 32 inputs one tile, whose row `r` holds, for
/// each of the 16 activation rows, inputs `2r` and `2r + 1` rounded to bf16.
unsafe fn pack_activations(x: &[f32], m: usize, in_dim: usize) -> Vec<u16> {
    let groups = m.div_ceil(2 * TILE) * 2;
    let group_len = in_dim / DEPTH * B_TILE;
    let mut packed = vec![0u16; groups * group_len];
    pool_chunks_mut(&mut packed, group_len, |g, group| {
        let rows = (g * TILE..((g + 1) * TILE).min(m)).enumerate();
        for (c, row) in rows {
            let xr = &x[row * in_dim..(row + 1) * in_dim];
            for (s, tile) in group.chunks_exact_mut(B_TILE).enumerate() {
                // SAFETY: the caller vouches for AVX-512; 32 values from `s · 32` are in the row.
                let pairs = unsafe { bf16_pairs(xr.as_ptr().add(s * DEPTH)) };
                for (r, pair) in pairs.iter().enumerate() {
                    tile[(r * TILE + c) * 2] = *pair as u16;
                    tile[(r * TILE + c) * 2 + 1] = (*pair >> 16) as u16;
                }
            }
        }
    });
    packed
}

/// 32 f32 values from `at` rounded to bf16 (to nearest, ties to even; NaN stays NaN), as 16
/// pairs: pair `p` holds value `2p` in its low half and `2p + 1` in its high half.
#[target_feature(enable = "avx512f")]
unsafe fn bf16_pairs(at: *const f32) -> [u32; 16] {
    let both = bf16_run(_mm512_loadu_ps(at), _mm512_loadu_ps(at.add(16)));
    let mut pairs = [0u32; 16];
    _mm512_storeu_si512(pairs.as_mut_ptr() as *mut __m512i, both);
    pairs
}

/// Activation groups whose packed values fit this in L2 (1 MiB, half of an AMX Xeon core's): a
/// run of groups is taken against all of a thread's weight tiles before the next, so the weight
/// tiles read each group from L2 rather than L3 (a 2,048-token prompt's packed activations are
/// 2.4 MB at SmolLM2's width).
const GROUPS_BYTES: usize = 1 << 20;

/// The tiles `tiles` (16 rows each) of `w` against every activation group: two weight tiles
/// by two activation groups at a time (four result tiles), one weight tile by two where the
/// range leaves one.
///
/// # Safety
/// As [`product_wt_many`]; `out` has room for `m × out_dim` values, of which this writes the
/// columns of `tiles`.
#[target_feature(enable = "avx512f")]
unsafe fn tiles_of(
    w: &[bf16],
    in_dim: usize,
    tiles: std::ops::Range<usize>,
    packed: &[u16],
    m: usize,
    (out, out_dim): (&DisjointWrites<f32>, usize),
) {
    let steps = in_dim / DEPTH;
    let group_len = steps * B_TILE;
    let row_bytes = in_dim * 2;
    let groups = m.div_ceil(TILE);
    let run = (GROUPS_BYTES / (group_len * 2)).max(2) / 2 * 2;
    configure_tiles();
    for first in (0..groups).step_by(run) {
        let mut t = tiles.start;
        while t < tiles.end {
            let pair = t + 1 < tiles.end;
            let a = w.as_ptr().add(t * TILE * in_dim) as *const u8;
            for g in (first..(first + run).min(groups)).step_by(2) {
                let b = packed.as_ptr().add(g * group_len) as *const u8;
                asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
                for s in 0..steps {
                    let (a0, b0) = (a.add(s * DEPTH * 2), b.add(s * B_TILE * 2));
                    let b1 = b0.add(group_len * 2);
                    // A lone last weight tile is loaded as both: tiles 2 and 3 repeat 0 and 1
                    // and are not written out.
                    let a1 = if pair { a0.add(TILE * row_bytes) } else { a0 };
                    asm!(
                        "tileloadd tmm4, [{a0} + {sa}*1]",
                        "tileloadd tmm5, [{a1} + {sa}*1]",
                        "tileloadd tmm6, [{b0} + {sb}*1]",
                        "tileloadd tmm7, [{b1} + {sb}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        a0 = in(reg) a0,
                        a1 = in(reg) a1,
                        b0 = in(reg) b0,
                        b1 = in(reg) b1,
                        sa = in(reg) row_bytes,
                        sb = in(reg) 64usize,
                        options(nostack, readonly),
                    );
                }
                let mut results = Results([0f32; 4 * TILE * TILE]);
                let r = results.0.as_mut_ptr();
                asm!(
                    "tilestored [{r0} + {s}*1], tmm0",
                    "tilestored [{r1} + {s}*1], tmm1",
                    "tilestored [{r2} + {s}*1], tmm2",
                    "tilestored [{r3} + {s}*1], tmm3",
                    r0 = in(reg) r,
                    r1 = in(reg) r.add(TILE * TILE),
                    r2 = in(reg) r.add(2 * TILE * TILE),
                    r3 = in(reg) r.add(3 * TILE * TILE),
                    s = in(reg) 64usize,
                    options(nostack),
                );
                // Tile k = (weight tile k / 2, group k % 2) holds outputs (t + k / 2) · 16 + i
                // (its rows) of activation rows (g + k % 2) · 16 + c (its columns).
                for k in 0..if pair { 4 } else { 2 } {
                    let columns = transposed(r.add(k * TILE * TILE));
                    let rows = (g + k % 2) * TILE..((g + k % 2 + 1) * TILE).min(m);
                    for (c, row) in rows.enumerate() {
                        _mm512_storeu_ps(out.at(row * out_dim + (t + k / 2) * TILE), columns[c]);
                    }
                }
            }
            t += if pair { 2 } else { 1 };
        }
    }
    release_tiles();
}

/// The 16 columns of a row-major 16 × 16 tile at `at`.
#[target_feature(enable = "avx512f")]
unsafe fn transposed(at: *const f32) -> [__m512; 16] {
    transpose16(std::array::from_fn(|i| _mm512_loadu_ps(at.add(i * TILE))))
}

/// Four result tiles' values, where `tilestored` writes them.
#[repr(C, align(64))]
struct Results([f32; 4 * TILE * TILE]);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::signed_values;
    use crate::simd::{CpuFeatures, SimdLevel};

    /// Whether this CPU and OS run the tiles (whatever the switches say).
    fn tiles_run_here() -> bool {
        let f = CpuFeatures::detected();
        f.amx_bf16 && f.best_level() == SimdLevel::Avx512
    }

    /// The activations' rounding is half's `bf16::from_f32` (to nearest, ties to even) for
    /// every kind of value: ties both ways, the largest finite values (which round to infinity),
    /// subnormals, infinities and NaNs.
    #[test]
    fn activations_round_as_bf16_from_f32() {
        if CpuFeatures::detected().best_level() < SimdLevel::Avx512 {
            return;
        }
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            f32::from_bits(0x3f80_8000), // a tie, rounding down to even
            f32::from_bits(0x3f81_8000), // a tie, rounding up to even
            f32::from_bits(0x3f80_8001),
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE / 3.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
        ];
        let mut values: Vec<f32> = signed_values(4096, 21).iter().map(|v| v * 1e3).collect();
        values.extend(specials);
        values.resize(values.len().next_multiple_of(DEPTH), 0.5);
        for chunk in values.chunks_exact(DEPTH) {
            // SAFETY: the CPU has AVX-512 F; the chunk holds 32 values.
            let pairs = unsafe { bf16_pairs(chunk.as_ptr()) };
            for (p, pair) in pairs.iter().enumerate() {
                for (e, got) in [*pair as u16, (*pair >> 16) as u16].into_iter().enumerate() {
                    let v = chunk[2 * p + e];
                    let want = bf16::from_f32(v);
                    let same = got == want.to_bits() || (v.is_nan() && bf16::from_bits(got).is_nan());
                    assert!(same, "{v:e} ({:#010x}): {got:#06x}, half gives {:#06x}", v.to_bits(), want.to_bits());
                }
            }
        }
    }

    /// The tiles' product equals the product of the bf16-rounded activations and the weights
    /// summed in f64 (to f32's rounding of the sums), for shapes with activation rows short of a
    /// tile, of a pair of tiles, and many; an odd number of weight tiles; several matrices;
    /// more activation groups than one run in L2 takes (700 rows of 1,536).
    #[test]
    fn tiles_equal_the_rounded_activations_product() {
        if !tiles_run_here() {
            return;
        }
        let shapes = [
            (1usize, vec![16usize], 32usize),
            (17, vec![48, 16, 32], 64),
            (70, vec![80], 576),
            (5, vec![16, 16], 1536),
            (700, vec![48], 1536),
        ];
        for (m, outs, in_dim) in shapes {
            let x = signed_values(m * in_dim, 1);
            let ws: Vec<Vec<bf16>> = outs
                .iter()
                .enumerate()
                .map(|(i, o)| signed_values(o * in_dim, 2 + i as u64).into_iter().map(bf16::from_f32).collect())
                .collect();
            let slices: Vec<&[bf16]> = ws.iter().map(|w| w.as_slice()).collect();
            assert!(fits(in_dim, &outs));
            // SAFETY: the CPU and OS run the tiles (checked above); the shapes fit.
            let ys = unsafe { product_wt_many(&x, &slices, in_dim) };
            let xr: Vec<f64> = x.iter().map(|&v| bf16::from_f32(v).to_f64()).collect();
            for ((y, w), &out) in ys.iter().zip(&ws).zip(&outs) {
                assert_eq!(y.len(), m * out);
                for r in 0..m {
                    for o in 0..out {
                        let terms = (0..in_dim).map(|i| xr[r * in_dim + i] * w[o * in_dim + i].to_f64());
                        let (want, size) = terms.fold((0f64, 0f64), |(s, a), t| (s + t, a + t.abs()));
                        let got = y[r * out + o] as f64;
                        assert!((got - want).abs() <= 1e-6 * size + 1e-30, "{m}x{out}x{in_dim} ({r}, {o}): {got} vs {want}");
                    }
                }
            }
        }
    }

    /// Only whole tiles fit: the inputs a multiple of 32 and every matrix's rows of 16.
    #[test]
    fn only_whole_tiles_fit() {
        assert!(fits(576, &[576, 192, 192]) && fits(32, &[16]));
        assert!(!fits(48, &[16]) && !fits(64, &[16, 200]) && !fits(0, &[16]));
    }
}
