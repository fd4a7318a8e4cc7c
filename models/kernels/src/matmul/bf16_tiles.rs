//! f32 products on AMX-BF16 tiles, both operands rounded to bf16 as they are packed and the
//! sums kept in f32: training's linear products under [`super::with_bf16_products`], what
//! PyTorch's CPU autocast to bf16 computes (oneDNN, on the same tiles). A `tdpbf16ps` is
//! 16 × 16 × 32 multiply-adds; AVX-512's FMA is 16.
//!
//! The loops are BLIS's, as in the f32 packed driver (`packed`): per block of rhs columns and
//! of depth, rhs packed as the tiles' B operand (per 16 columns and 32 depths, 16 rows of 16
//! pairs: depths `2q`, `2q + 1` of each column); per block of lhs rows, lhs packed as the A
//! operand (per 16 rows and 32 depths, the rows' 32 values); then 32 × 32 of dst at a time in
//! four result tiles over the block's depth, a B pair (32 KiB) from L1 against the A block
//! from L2. Unlike `amx_bf16` (bf16 weights, whole tiles only), any shape and any strides:
//! packing pads rows, columns and depth to whole tiles with zeros, and result tiles that cross
//! dst's edge go through a scratch tile. Every value of dst is summed in the same order
//! wherever its tile lies, so a product split by columns among threads gives the same values.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

use half::bf16;

use super::amx::{bf16_pair_lanes, bf16_run, configure_tiles, first_lanes, release_tiles, DEPTH, TILE, TILE_VALUES};
use super::transpose::transpose16;
use super::Strided;
use crate::disjoint::DisjointWrites;
use crate::pool::pool_chunks_mut;

/// Depth of a packed block: a pair of B tiles' columns over it is 32 KiB, within L1.
const KC: usize = 512;
/// Rows of lhs packed at a time: 256 KiB of bf16 at KC, within L2.
const MC: usize = 256;
/// Columns of rhs packed at a time: 1 MiB at KC, half of an AMX Xeon core's L2 (each thread
/// of the 28M Llama's products then packs its columns' lhs once).
const NC: usize = 1024;
/// Rows or columns of dst one block of four result tiles covers.
const PAIR: usize = 2 * TILE;

/// Largest packed lhs (bf16 values) the threads share: the buffer is kept by the calling thread
/// between products, and a vocabulary-wide head's gradient would keep tens of MiB. Larger ones
/// are packed by each thread, a block at a time.
const SHARED_MAX: usize = 8 << 20;

thread_local! {
    /// This thread's packed blocks (lhs, rhs), kept between products: a fresh buffer per
    /// product would fault its pages in again.
    static PACKED: RefCell<(Vec<u16>, Vec<u16>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    /// The whole packed lhs of the products this thread splits among threads ([`SharedLhs`]).
    static SHARED: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
}

/// A product's lhs packed whole as A tiles, once for all the threads computing pieces of its
/// columns (each of which reads all of it): tile `t` of depth step `s` at
/// `(t · steps + s) · TILE_VALUES`.
struct SharedLhs {
    at: *const u16,
    steps: usize,
}

// SAFETY: the packed values are written before the threads start and only read by them.
unsafe impl Sync for SharedLhs {}

/// `dst (m × n, row-major) = [dst +] lhs (m × k) · rhs (k × n)` with the operands rounded to
/// bf16, split by columns of dst between the pool's threads (the calling thread included); dst
/// is read only when `accumulate`. Matrices as (slice, column stride, row stride).
///
/// # Safety
/// The CPU must have AMX-TILE, AMX-BF16 and AVX-512 F, and Linux must have granted this process
/// the tile state (`simd::Kernels::amx_bf16`). `dst` must have room for m × n values
/// (initialised when `accumulate`) that nothing else uses meanwhile, and the slices must hold
/// the strided matrices they describe (non-negative strides).
pub(crate) unsafe fn product(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    accumulate: bool,
    lhs: (&[f32], isize, isize),
    rhs: (&[f32], isize, isize),
) {
    let threads = candle_core::utils::get_num_threads();
    let width = n.div_ceil(threads.max(1)).next_multiple_of(PAIR);
    let pieces = n.div_ceil(width);
    let lhs_at = (lhs.0.as_ptr(), lhs.1, lhs.2);
    if pieces < 2 {
        return sgemm(m, n, k, (dst, n), lhs_at, (rhs.0.as_ptr(), rhs.1, rhs.2), accumulate, None);
    }
    let steps = k.div_ceil(DEPTH);
    let pair_len = 2 * steps * TILE_VALUES;
    let shared_len = m.div_ceil(PAIR) * pair_len;
    SHARED.with(|buf| {
        let mut buf = buf.borrow_mut();
        let shared = match shared_len <= SHARED_MAX {
            true => {
                if buf.len() < shared_len {
                    *buf = vec![0; shared_len];
                }
                pool_chunks_mut(&mut buf[..shared_len], pair_len, |p, out| {
                    let (rows, first) = (PAIR.min(m - p * PAIR), (p * PAIR) as isize * lhs.2);
                    // SAFETY: rows first.. of lhs are in its slice; out holds a packed tile pair
                    // over the whole depth; the caller vouches for the CPU.
                    unsafe { pack(Operand::A, rows, k, lhs.0.as_ptr().wrapping_offset(first), (lhs.2, lhs.1), out.as_mut_ptr()) }
                });
                Some(SharedLhs { at: buf.as_ptr(), steps })
            }
            false => None,
        };
        // SAFETY: dst has room for m × n values that nothing else uses (the caller's contract).
        let out = unsafe { DisjointWrites::from_raw(dst, m * n) };
        candle_core::utils::barrier_pool().execute_chunked(pieces, |range| {
            for piece in range {
                let columns = piece * width..((piece + 1) * width).min(n);
                let rhs_from = &rhs.0[(columns.start as isize * rhs.1) as usize..];
                // SAFETY: the pieces are disjoint column ranges of dst; rhs's columns from
                // columns.start are in its slice; the caller vouches for the CPU.
                unsafe {
                    let (lhs_at, rhs_at) = ((lhs.0.as_ptr(), lhs.1, lhs.2), (rhs_from.as_ptr(), rhs.1, rhs.2));
                    sgemm(m, columns.len(), k, (out.at(columns.start), n), lhs_at, rhs_at, accumulate, shared.as_ref())
                }
            }
        });
    })
}

/// [`product`] on the calling thread, into a dst whose rows are `dst_rs` apart, lhs's tiles
/// from `shared` when given (which must pack this lhs).
///
/// # Safety
/// As [`product`], for these pointers.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    (dst, dst_rs): (*mut f32, usize),
    lhs: Strided<*const f32>,
    rhs: Strided<*const f32>,
    accumulate: bool,
    shared: Option<&SharedLhs>,
) {
    if super::nothing_to_sum(m, n, k, (dst, dst_rs), accumulate) {
        return;
    }
    let mut packed = PACKED.with(|p| std::mem::take(&mut *p.borrow_mut()));
    let (a_buf, b_buf) = &mut packed;
    let steps_max = KC.min(k).div_ceil(DEPTH);
    let a_len = if shared.is_some() { 0 } else { MC.min(m).next_multiple_of(PAIR) / TILE * steps_max * TILE_VALUES };
    let b_len = NC.min(n).next_multiple_of(PAIR) / TILE * steps_max * TILE_VALUES;
    if a_buf.len() < a_len {
        *a_buf = vec![0; a_len];
    }
    if b_buf.len() < b_len {
        *b_buf = vec![0; b_len];
    }
    let (a, b) = (a_buf.as_mut_ptr(), b_buf.as_mut_ptr());
    configure_tiles();
    for jc in (0..n).step_by(NC) {
        let nc = NC.min(n - jc);
        for pc in (0..k).step_by(KC) {
            let kc = KC.min(k - pc);
            let steps = kc.div_ceil(DEPTH);
            pack(Operand::B, nc, kc, rhs.0.wrapping_offset(pc as isize * rhs.2 + jc as isize * rhs.1), (rhs.1, rhs.2), b);
            // Later depth blocks add to what the first wrote.
            let load_dst = accumulate || pc > 0;
            let b_tile = steps * TILE_VALUES;
            for ic in (0..m).step_by(MC) {
                let mc = MC.min(m - ic);
                // The block's first tile, and how far apart its tiles are.
                let (a_block, a_tile) = match shared {
                    Some(s) => (s.at.add((ic / TILE * s.steps + pc / DEPTH) * TILE_VALUES), s.steps * TILE_VALUES),
                    None => {
                        pack(Operand::A, mc, kc, lhs.0.wrapping_offset(ic as isize * lhs.2 + pc as isize * lhs.1), (lhs.2, lhs.1), a);
                        (a.cast_const(), b_tile)
                    }
                };
                for jp in (0..nc).step_by(PAIR) {
                    let b_pair = (b.add(jp / TILE * b_tile).cast_const(), b_tile);
                    for ip in (0..mc).step_by(PAIR) {
                        let a_pair = (a_block.add(ip / TILE * a_tile), a_tile);
                        let at = dst.add((ic + ip) * dst_rs + jc + jp);
                        four_tiles(steps, a_pair, b_pair, (at, dst_rs), (PAIR.min(mc - ip), PAIR.min(nc - jp)), load_dst);
                    }
                }
            }
        }
    }
    release_tiles();
    PACKED.with(|p| *p.borrow_mut() = packed);
}

/// Which operand a packing lays out: an A tile holds a line (a row of lhs) per tile row, a B
/// tile a pair of depths per tile row (a column of rhs per 32-bit lane).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Operand {
    A,
    B,
}

/// Packs `lines` lines (rows of lhs, or columns of rhs) of `kc` depths, line `l`'s depth `d` at
/// `l·line_stride + d·depth_stride`, as tiles of `operand`: tile `t` of depth step `s` at
/// `(t · steps + s) · TILE_VALUES`, over lines `16t..16t + 16` and depths `32s..32s + 32`, each
/// line's depths rounded to bf16 as 16 pairs (the even depth in the low half). An A tile's row
/// `r` is line `16t + r`'s pairs; a B tile's row `q` is pair `q` of each line. Lines are padded
/// to a multiple of 32 and depth to one of 32 with zeros.
///
/// # Safety
/// As [`product`]; `out` has room for the packed lines.
#[target_feature(enable = "avx512f")]
unsafe fn pack(operand: Operand, lines: usize, kc: usize, src: *const f32, (line_stride, depth_stride): (isize, isize), out: *mut u16) {
    let steps = kc.div_ceil(DEPTH);
    for t in 0..lines.next_multiple_of(PAIR) / TILE {
        let count = lines.saturating_sub(t * TILE).min(TILE);
        for s in 0..steps {
            let tile = out.add((t * steps + s) * TILE_VALUES);
            let depth = (kc - s * DEPTH).min(DEPTH);
            let at = src.wrapping_offset((t * TILE) as isize * line_stride + (s * DEPTH) as isize * depth_stride);
            if count == 0 {
                std::ptr::write_bytes(tile, 0, TILE_VALUES);
                continue;
            }
            // A register a line (its pairs), or a register a pair (its lanes the lines).
            let mut rows = [_mm512_setzero_ps(); TILE];
            let by_line = if depth_stride == 1 {
                let (low, high) = (first_lanes(depth), first_lanes(depth.saturating_sub(16)));
                for (l, row) in rows.iter_mut().enumerate().take(count) {
                    let line = at.wrapping_offset(l as isize * line_stride);
                    *row =
                        _mm512_castsi512_ps(bf16_run(_mm512_maskz_loadu_ps(low, line), _mm512_maskz_loadu_ps(high, line.wrapping_add(16))));
                }
                true
            } else if line_stride == 1 {
                for (q, row) in rows.iter_mut().enumerate() {
                    let even = run_or_zero(at, 2 * q, depth, depth_stride, count);
                    *row = _mm512_castsi512_ps(bf16_pair_lanes(even, run_or_zero(at, 2 * q + 1, depth, depth_stride, count)));
                }
                false
            } else {
                for l in 0..TILE {
                    for d in 0..DEPTH {
                        let value = match l < count && d < depth {
                            true => bf16::from_f32(*at.offset(l as isize * line_stride + d as isize * depth_stride)).to_bits(),
                            false => 0,
                        };
                        let place = match operand {
                            Operand::A => l * DEPTH + d,
                            Operand::B => d / 2 * DEPTH + 2 * l + d % 2,
                        };
                        *tile.add(place) = value;
                    }
                }
                continue;
            };
            if by_line != (operand == Operand::A) {
                rows = transpose16(rows);
            }
            for (r, row) in rows.iter().enumerate() {
                _mm512_storeu_ps(tile.add(r * DEPTH).cast(), *row);
            }
        }
    }
}

/// The `lanes` values of run `d` (`d · stride` from `at`, the values adjacent), zeros past them
/// and for runs at or past `runs`.
#[inline(always)]
unsafe fn run_or_zero(at: *const f32, d: usize, runs: usize, stride: isize, lanes: usize) -> __m512 {
    match d < runs {
        true => _mm512_maskz_loadu_ps(first_lanes(lanes), at.wrapping_offset(d as isize * stride)),
        false => _mm512_setzero_ps(),
    }
}

/// Result tiles' values where `tilestored` writes them and `tileloadd` reads them.
#[repr(C, align(64))]
struct Scratch([f32; 4 * TILE * TILE]);

/// dst's `rows × cols` (each at most 32) at `at` `[+]=` two A tiles (rows) by two B tiles
/// (columns) over `steps` depth steps: result tile `2i + j` is A tile `i` by B tile `j`. Tiles
/// wholly inside dst are loaded and stored in place; the others through a scratch tile.
///
/// # Safety
/// As [`sgemm`]; `a` and `b` are pairs of packed tiles (the first tile's steps adjacent, the
/// second the given number of values after the first), and dst's rows × cols at `at` are this
/// thread's.
#[target_feature(enable = "avx512f")]
unsafe fn four_tiles(
    steps: usize,
    (a, a_second): (*const u16, usize),
    (b, b_second): (*const u16, usize),
    (at, dst_rs): (*mut f32, usize),
    (rows, cols): (usize, usize),
    load_dst: bool,
) {
    // Not zeroed: a value of a tile outside dst sums garbage into itself only, and is not
    // written out.
    let mut scratch = std::mem::MaybeUninit::<Scratch>::uninit();
    let scratch = scratch.as_mut_ptr() as *mut f32;
    let whole = rows == PAIR && cols == PAIR;
    // Where tile 2i + j is read and written, and its row stride in bytes.
    let (place, stride): ([*mut f32; 4], usize) = match whole {
        true => (std::array::from_fn(|t| at.add((t / 2) * TILE * dst_rs + (t % 2) * TILE)), dst_rs * 4),
        false => (std::array::from_fn(|t| scratch.add(t * TILE * TILE)), TILE * 4),
    };
    // The part of tile t inside dst: (rows, columns).
    let inside = |t: usize| (rows.saturating_sub((t / 2) * TILE).min(TILE), cols.saturating_sub((t % 2) * TILE).min(TILE));
    if load_dst && !whole {
        for (t, &tile) in place.iter().enumerate() {
            let (r_in, c_in) = inside(t);
            for r in 0..r_in {
                let from = at.add(((t / 2) * TILE + r) * dst_rs + (t % 2) * TILE);
                _mm512_storeu_ps(tile.add(r * TILE), _mm512_maskz_loadu_ps(first_lanes(c_in), from));
            }
        }
    }
    if load_dst {
        asm!(
            "tileloadd tmm0, [{p0} + {s}*1]",
            "tileloadd tmm1, [{p1} + {s}*1]",
            "tileloadd tmm2, [{p2} + {s}*1]",
            "tileloadd tmm3, [{p3} + {s}*1]",
            p0 = in(reg) place[0],
            p1 = in(reg) place[1],
            p2 = in(reg) place[2],
            p3 = in(reg) place[3],
            s = in(reg) stride,
            options(nostack, readonly),
        );
    } else {
        asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
    }
    for s in 0..steps {
        let (a0, b0) = (a.add(s * TILE_VALUES), b.add(s * TILE_VALUES));
        asm!(
            "tileloadd tmm4, [{a0} + {s}*1]",
            "tileloadd tmm5, [{a1} + {s}*1]",
            "tileloadd tmm6, [{b0} + {s}*1]",
            "tileloadd tmm7, [{b1} + {s}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            a0 = in(reg) a0,
            a1 = in(reg) a0.add(a_second),
            b0 = in(reg) b0,
            b1 = in(reg) b0.add(b_second),
            s = in(reg) 64usize,
            options(nostack, readonly),
        );
    }
    asm!(
        "tilestored [{p0} + {s}*1], tmm0",
        "tilestored [{p1} + {s}*1], tmm1",
        "tilestored [{p2} + {s}*1], tmm2",
        "tilestored [{p3} + {s}*1], tmm3",
        p0 = in(reg) place[0],
        p1 = in(reg) place[1],
        p2 = in(reg) place[2],
        p3 = in(reg) place[3],
        s = in(reg) stride,
        options(nostack),
    );
    if !whole {
        for (t, &tile) in place.iter().enumerate() {
            let (r_in, c_in) = inside(t);
            for r in 0..r_in {
                let to = at.add(((t / 2) * TILE + r) * dst_rs + (t % 2) * TILE);
                _mm512_mask_storeu_ps(to, first_lanes(c_in), _mm512_loadu_ps(tile.add(r * TILE)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::signed_values;
    use crate::simd::Kernels;

    /// `lhs · rhs` of the bf16-rounded operands summed in f64, for dst value (i, j).
    fn rounded_product(lhs: (&[f32], isize, isize), rhs: (&[f32], isize, isize), k: usize, i: usize, j: usize) -> (f64, f64) {
        let r = |v: f32| bf16::from_f32(v).to_f64();
        let terms = (0..k).map(|p| {
            r(lhs.0[(i as isize * lhs.2 + p as isize * lhs.1) as usize]) * r(rhs.0[(p as isize * rhs.2 + j as isize * rhs.1) as usize])
        });
        terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()))
    }

    /// The tiles' product equals the product of the rounded operands (to f32's rounding of the
    /// sums) for every layout training's products take (row-major and column-major lhs,
    /// row-major rhs and a weight read as Wᵀ), and strides neither; shapes short of a tile,
    /// ragged in every dimension, and over several blocks of rows, columns and depth
    /// (MC, NC, KC); written and accumulated; on one thread and split by columns over the pool.
    #[test]
    fn tiles_equal_the_rounded_operands_product() {
        if !Kernels::get().amx_bf16() {
            return;
        }
        let shapes = [(16, 16, 32), (17, 33, 45), (70, 100, 300), (300, 40, 1100), (40, 1100, 64), (33, 530, 530)];
        for (si, &(m, n, k)) in shapes.iter().enumerate() {
            for layout in 0..5 {
                // (lhs column stride, row stride), (rhs column stride, row stride), sizes padded
                // for the layout with no unit stride.
                let (lhs_s, rhs_s) = match layout {
                    0 => ((1, k), (1, n)),
                    1 => ((m, 1), (1, n)),
                    2 => ((1, k), (k, 1)),
                    3 => ((m, 1), (k, 1)),
                    _ => ((2, 2 * k + 1), (3, 3 * n + 2)),
                };
                let lhs = signed_values(m * k * 4 + 8, 3 + si as u64);
                let rhs = signed_values(k * n * 4 + 8, 4 + si as u64);
                let lhs = (&lhs[..], lhs_s.0 as isize, lhs_s.1 as isize);
                let rhs = (&rhs[..], rhs_s.0 as isize, rhs_s.1 as isize);
                for accumulate in [false, true] {
                    let start: Vec<f32> = (0..m * n).map(|i| (i % 7) as f32 - 3.0).collect();
                    let mut dst = start.clone();
                    // SAFETY: the CPU and OS run the tiles (checked above); dst holds m × n
                    // values; the slices hold the strided matrices.
                    unsafe { product(m, n, k, dst.as_mut_ptr(), accumulate, lhs, rhs) };
                    for i in 0..m {
                        for j in 0..n {
                            let (want, size) = rounded_product(lhs, rhs, k, i, j);
                            let want = want + if accumulate { start[i * n + j] as f64 } else { 0.0 };
                            let got = dst[i * n + j] as f64;
                            let what = format!("{m}x{n}x{k} layout {layout} accumulate {accumulate} ({i}, {j})");
                            assert!((got - want).abs() <= 1e-6 * (size + 3.0), "{what}: {got} vs {want}");
                        }
                    }
                }
            }
        }
    }

    /// A product split by columns among threads gives the bits of the whole product on one
    /// thread: every value is summed in the same order wherever its tile lies.
    #[test]
    fn a_split_gives_the_unsplit_bits() {
        if !Kernels::get().amx_bf16() {
            return;
        }
        let (m, n, k) = (50, 200, 700);
        let (lhs, rhs) = (signed_values(m * k, 1), signed_values(k * n, 2));
        let mut whole = vec![0f32; m * n];
        // SAFETY: as in the test above.
        unsafe { sgemm(m, n, k, (whole.as_mut_ptr(), n), (lhs.as_ptr(), 1, k as isize), (rhs.as_ptr(), 1, n as isize), false, None) };
        for split in [16, 37, 100] {
            let mut parts = vec![0f32; m * n];
            for (from, to) in [(0, split), (split, n)] {
                let (dst, rhs) = (parts.as_mut_ptr().wrapping_add(from), rhs.as_ptr().wrapping_add(from));
                // SAFETY: columns from..to of dst and rhs.
                unsafe { sgemm(m, to - from, k, (dst, n), (lhs.as_ptr(), 1, k as isize), (rhs, 1, n as isize), false, None) };
            }
            assert!(whole.iter().zip(&parts).all(|(a, b)| a.to_bits() == b.to_bits()), "split at {split}");
        }
    }
}
