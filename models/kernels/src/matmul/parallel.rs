//! Products of our own f32 code over the thread pool: `dst = [dst +] lhs · rhs` split by
//! columns of dst between the pool's threads, the calling thread included. The entry points
//! ([`product`], [`product_add`], [`product_wt`], [`input_grad_sum`]) take row-major slices.

use super::column_split;
use super::{sgemm_piece, with_lhs_shared_by_pieces, SharedLhs};
use crate::disjoint::DisjointWrites;

/// `dst (m × n, row-major) = [dst +] lhs (m × k) · rhs (k × n)`, matrices as (slice, column
/// stride, row stride), over the threads when the product is big enough to pay for them.
/// With `accumulate` false dst is only written, never read.
///
/// The threads are candle's barrier pool, which runs candle's own ops and our attention and
/// decoding kernels, not gemm's rayon parallelism: with two pools on two cores, the pool that
/// just finished spins (up to its spin limit) while the other computes. The product is split by
/// columns of dst (each thread packs only its own part of the weight), one piece per thread of
/// at least [`MIN_PIECE_COLUMNS`]: inside gemm every piece packs all of lhs again. On the packed
/// driver the pieces share one packing of lhs (`matmul::with_lhs_shared_by_pieces`). Figures:
/// docs/design.md, matrix products.
///
/// # Safety
/// `dst` must have room for m × n values (initialised when `accumulate`), and the slices must
/// hold the strided matrices they describe.
unsafe fn gemm_rows(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    accumulate: bool,
    lhs: (&[f32], isize, isize),
    rhs: (&[f32], isize, isize),
) {
    #[cfg(target_arch = "x86_64")]
    if super::on_bf16_tiles() {
        // SAFETY: the tiles run here (on_bf16_tiles); the rest is this function's contract.
        return unsafe { super::bf16_tiles::product(m, n, k, dst, accumulate, lhs, rhs) };
    }
    if lhs.2 == 1 && lhs.1 > 1 && m >= LHS_BLOCK_MIN_ROWS && super::writes_lhs_rows_first(m, n, k) {
        // SAFETY: as this function's; each block's rows of dst are rows of this product's dst.
        return lhs_in_row_blocks(m, k, lhs, |rows, block| unsafe {
            gemm_rows(rows.len(), n, k, dst.add(rows.start * n), accumulate, block, rhs)
        });
    }
    let threads = candle_core::utils::get_num_threads();
    let pieces = threads.min(n / MIN_PIECE_COLUMNS);
    if m * n * k < PARALLEL_MIN_PRODUCT || threads < 2 || pieces < 2 {
        return gemm_piece(m, n, k, dst, n, accumulate, lhs, rhs, None);
    }
    let _inside = column_split::enter_product();
    // Halves (a thread that does not adapt, or a split that could change a column's
    // arithmetic) are the general split below with two pieces.
    let two_adapting = threads == 2 && column_split::adapts() && column_split::splits_exactly(m, n);
    let width = n.div_ceil(pieces);
    let narrowest = if two_adapting { column_split::narrowest(n) } else { n - (pieces - 1) * width };
    with_lhs_shared_by_pieces(m, narrowest, k, (lhs.0.as_ptr(), lhs.1, lhs.2), |shared| {
        if two_adapting {
            return gemm_two_threads(m, n, k, dst, accumulate, lhs, rhs, shared);
        }
        // SAFETY: dst has room for m × n values and nothing else uses them during the product
        // (the caller's contract).
        let out = unsafe { DisjointWrites::from_raw(dst, m * n) };
        candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(width), |range| {
            for piece in range {
                // SAFETY: the pieces are disjoint column ranges of dst (the caller's contract).
                unsafe { gemm_columns(m, n, k, piece * width..((piece + 1) * width).min(n), &out, accumulate, lhs, rhs, shared) }
            }
        });
    })
}

/// [`gemm_rows`] on two threads: the calling thread's piece is as wide as
/// this thread's [`column_split::CALLER_SHARE`] says, and the pieces' times move that share.
///
/// # Safety
/// As [`gemm_rows`].
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_two_threads(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    accumulate: bool,
    lhs: (&[f32], isize, isize),
    rhs: (&[f32], isize, isize),
    shared: Option<&SharedLhs>,
) {
    let split = column_split::CALLER_SHARE.with(|s| s.caller_columns(n));
    let caller = std::thread::current().id();
    // Per piece: (ran on the calling thread, seconds), filled by whichever thread took it.
    let ran: [std::sync::Mutex<Option<(bool, f64)>>; 2] = Default::default();
    // SAFETY: as in gemm_rows.
    let out = unsafe { DisjointWrites::from_raw(dst, m * n) };
    // The caller starts at once and usually takes piece 0, its share; the worker wakes and takes
    // piece 1. Where one thread took both (the worker slept through, or this runs nested inside
    // the pool), the times say nothing about the other thread and are not recorded.
    candle_core::utils::barrier_pool().execute_chunked(2, |range| {
        for piece in range {
            let columns = if piece == 0 { 0..split } else { split..n };
            let start = std::time::Instant::now();
            // SAFETY: the two pieces are disjoint column ranges of dst (the caller's contract).
            unsafe { gemm_columns(m, n, k, columns, &out, accumulate, lhs, rhs, shared) }
            *ran[piece].lock().unwrap() = Some((std::thread::current().id() == caller, start.elapsed().as_secs_f64()));
        }
    });
    let [a, b] = ran.map(|r| r.into_inner().unwrap());
    if let (Some((a_on_caller, a_secs)), Some((b_on_caller, b_secs))) = (a, b) {
        let (a, b) = ((split, a_secs), (n - split, b_secs));
        match (a_on_caller, b_on_caller) {
            (true, false) => column_split::CALLER_SHARE.with(|s| s.record(a, b)),
            (false, true) => column_split::CALLER_SHARE.with(|s| s.record(b, a)),
            _ => {}
        }
    }
}

/// Columns `columns` of [`gemm_rows`]' product, written into its dst.
///
/// # Safety
/// As [`gemm_rows`]; no other thread writes these columns of dst meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_columns(
    m: usize,
    n: usize,
    k: usize,
    columns: std::ops::Range<usize>,
    out: &DisjointWrites<f32>,
    accumulate: bool,
    lhs: (&[f32], isize, isize),
    rhs: (&[f32], isize, isize),
    shared: Option<&SharedLhs>,
) {
    // More than 64 rows: gemm then sums every block of at least 16 columns the same way whatever
    // its width (`column_split::splits_exactly`), so the blocks do not change a value.
    let wt = rhs.2 == 1 && rhs.1 == k as isize && m > 64 && columns.len() >= 16;
    if shared.is_none() && wt && super::writes_weight_columns_first(m, columns.len(), k) {
        // SAFETY: as this function's; rhs is Wᵀ of a row-major w (n × k), the linear forward.
        return unsafe { gemm_columns_of_wt(m, n, k, columns, out, accumulate, lhs, rhs.0) };
    }
    let rhs_from = (columns.start as isize * rhs.1) as usize;
    // SAFETY: rhs's columns from columns.start are inside its slice (the caller's contract).
    unsafe { gemm_piece(m, columns.len(), k, out.at(columns.start), n, accumulate, lhs, (&rhs.0[rhs_from..], rhs.1, rhs.2), shared) }
}

/// Values of a weight's rows a thread writes out as columns at a time
/// ([`gemm_columns_of_wt`]): 512 KiB, within L2 while gemm reads them (larger blocks ran
/// slower; docs/design.md, matrix products).
const WT_BLOCK_VALUES: usize = 1 << 17;

/// Padding of the block's rows beyond its width: rows a power of two apart are what the block
/// avoids.
const WT_BLOCK_PAD: usize = 16;

thread_local! {
    /// This thread's block of weight columns, kept between products (a fresh buffer per product
    /// would fault its pages in again).
    static WT_BLOCK: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`gemm_columns`] for rhs = `Wᵀ` of a row-major `w` (n × k): the rows of w behind these
/// columns written out as a row-major block first (`matmul::writes_weight_columns_first` says
/// why), a block at a time, each block's product then read from it.
///
/// # Safety
/// As [`gemm_columns`].
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_columns_of_wt(
    m: usize,
    n: usize,
    k: usize,
    columns: std::ops::Range<usize>,
    out: &DisjointWrites<f32>,
    accumulate: bool,
    lhs: (&[f32], isize, isize),
    w: &[f32],
) {
    let block = (WT_BLOCK_VALUES / k).max(64);
    WT_BLOCK.with(|buf| {
        let mut buf = buf.borrow_mut();
        let mut from = columns.start;
        while from < columns.end {
            // Blocks of `block` columns, the last one taking a remainder narrower than 16 with it.
            let to = match (from + block).min(columns.end) {
                to if columns.end - to < 16 => columns.end,
                to => to,
            };
            let rows = from..to;
            let (width, stride) = (rows.len(), rows.len() + WT_BLOCK_PAD);
            if buf.len() < k * stride {
                buf.resize(k * stride, 0.0);
            }
            super::rows_as_columns(w, k, rows, 0..k, stride, &mut buf);
            // SAFETY: these columns of dst are this thread's (the caller's contract); buf holds
            // the block, k rows `stride` apart.
            unsafe { gemm_piece(m, width, k, out.at(from), n, accumulate, lhs, (&buf[..], 1, stride as isize), None) }
            from = to;
        }
    })
}

/// Values of a column-major lhs written out as row-major rows at a time
/// ([`lhs_in_row_blocks`]): 4 MiB, a linear layer's whole `gyᵀ` at the bench models' sizes; a
/// vocabulary-wide head's in a few blocks, so that the buffer kept between products stays small.
const LHS_BLOCK_VALUES: usize = 1 << 20;

/// Fewest rows of a block of [`lhs_in_row_blocks`]: the kernel table gives products of fewer to
/// the packed driver (`simd::Kernels::matmul_for`), and gemm sums a product of more than 64 rows
/// the same way whatever their number (`column_split::splits_exactly`), so a block of at least
/// this many computes each value of dst as the whole product would.
const LHS_BLOCK_MIN_ROWS: usize = crate::simd::PACKED_BELOW_ROWS;
const _: () = assert!(LHS_BLOCK_MIN_ROWS > 64);

thread_local! {
    /// This thread's block of lhs rows, kept between products (as [`WT_BLOCK`]).
    static LHS_ROWS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f(rows, block)` for blocks of the rows of a column-major lhs (m × k: rows 1 apart,
/// columns `lhs.1` apart; a weight gradient's `gyᵀ`), each block written out first as
/// row-major rows (`matmul::writes_lhs_rows_first` says why) by the pool's threads.
fn lhs_in_row_blocks(m: usize, k: usize, lhs: (&[f32], isize, isize), mut f: impl FnMut(std::ops::Range<usize>, (&[f32], isize, isize))) {
    // Rows padded past k: rows a power of two of 2 KiB or more apart share a few L1 sets.
    let width = k + WT_BLOCK_PAD;
    let block = (LHS_BLOCK_VALUES / width / 64 * 64).max(LHS_BLOCK_MIN_ROWS);
    LHS_ROWS.with(|buf| {
        let mut buf = buf.borrow_mut();
        let mut from = 0;
        while from < m {
            // The last block takes a remainder too small to be a block of its own.
            let to = match (from + block).min(m) {
                to if m - to < LHS_BLOCK_MIN_ROWS => m,
                to => to,
            };
            if buf.len() < (to - from) * width {
                buf.resize((to - from) * width, 0.0);
            }
            let out = &mut buf[..(to - from) * width];
            let half = (to - from).div_ceil(2);
            crate::pool::pool_chunks_mut(out, half * width, |c, piece| {
                let first = from + c * half;
                super::rows_as_columns(lhs.0, lhs.1 as usize, 0..k, first..first + piece.len() / width, width, piece);
            });
            f(from..to, (out, 1, width as isize));
            from = to;
        }
    })
}

/// Products smaller than this (m · n · k) run on the calling thread.
const PARALLEL_MIN_PRODUCT: usize = 1 << 15;

/// Fewest dst columns one thread's piece of a product gets.
const MIN_PIECE_COLUMNS: usize = 48;

/// One thread's `dst (m × n, rows `dst_row_stride` apart) = [dst +] lhs · rhs`, lhs's packed
/// blocks from `shared` when given (shared with the threads computing the other columns).
///
/// # Safety
/// As [`gemm_rows`].
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_piece(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_row_stride: usize,
    accumulate: bool,
    lhs: (&[f32], isize, isize),
    rhs: (&[f32], isize, isize),
    shared: Option<&SharedLhs>,
) {
    sgemm_piece(m, n, k, (dst, dst_row_stride), (lhs.0.as_ptr(), lhs.1, lhs.2), (rhs.0.as_ptr(), rhs.1, rhs.2), accumulate, shared)
}

/// `lhs (m × k) · rhs (k × n)` as a new (m × n) buffer (see [`gemm_rows`] for the layout).
pub fn product(m: usize, n: usize, k: usize, lhs: (&[f32], isize, isize), rhs: (&[f32], isize, isize)) -> Vec<f32> {
    // Not zeroed first: the product overwrites every element (it does not read dst).
    let mut dst: Vec<f32> = Vec::with_capacity(m * n);
    // SAFETY: dst has room for m × n values, all of which gemm writes before the length is set;
    // the callers pass slices holding the matrices they describe.
    unsafe {
        gemm_rows(m, n, k, dst.as_mut_ptr(), false, lhs, rhs);
        dst.set_len(m * n);
    }
    dst
}

/// `x (rows, in) · wᵀ` for w (out, in): (rows, out), the forward of a linear layer.
pub fn product_wt(x: &[f32], w: &[f32], out_dim: usize, in_dim: usize) -> Vec<f32> {
    // wᵀ is (in, out): element (i, o) at o * in + i.
    product(x.len() / in_dim, out_dim, in_dim, (x, 1, in_dim as isize), (w, in_dim as isize, 1))
}

/// `Σ gy (rows, out) · w (out, in)` over `terms` of (gy, w, out): the (rows, in) gradient of an
/// input that several products read, made in one buffer (each product after the first added
/// into it) rather than as one tensor per product that candle's backward then sums.
pub fn input_grad_sum(rows: usize, in_dim: usize, terms: &[(&[f32], &[f32], usize)]) -> Vec<f32> {
    let mut dx: Vec<f32> = Vec::new();
    for (n, &(gy, w, out_dim)) in terms.iter().enumerate() {
        let (lhs, rhs) = ((gy, 1, out_dim as isize), (w, 1, in_dim as isize));
        match n {
            0 => dx = product(rows, in_dim, out_dim, lhs, rhs),
            _ => product_add(rows, in_dim, out_dim, &mut dx, lhs, rhs),
        }
    }
    dx
}

/// `dst (m × n) += lhs (m × k) · rhs (k × n)` into an existing row-major buffer.
pub fn product_add(m: usize, n: usize, k: usize, dst: &mut [f32], lhs: (&[f32], isize, isize), rhs: (&[f32], isize, isize)) {
    assert_eq!(dst.len(), m * n);
    // SAFETY: dst holds m × n initialised values; the slices hold the matrices they describe.
    unsafe { gemm_rows(m, n, k, dst.as_mut_ptr(), true, lhs, rhs) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A piece of `x · Wᵀ` made from blocks of W's rows written out as columns gives gemm's
    /// bits for the piece read in place, over several blocks and a narrow remainder that joins
    /// the last one.
    #[test]
    fn a_linear_forward_from_weight_columns_is_the_product_read_in_place() {
        let (m, k) = (96, 512);
        let block = WT_BLOCK_VALUES / k;
        let n = 2 * block + 10;
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 1.7).collect();
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 104_729 % 997) as f32 / 997.0 - 0.5) * 0.3).collect();
        let (lhs, rhs) = ((&x[..], 1, k as isize), (&w[..], k as isize, 1));
        let mut in_place = vec![0f32; m * n];
        // SAFETY: dst is m × n; x and w hold the matrices the strides describe.
        unsafe { gemm_piece(m, n, k, in_place.as_mut_ptr(), n, false, lhs, rhs, None) };
        for columns in [0..n, 16..n - 16] {
            let mut blocks = vec![0f32; m * n];
            // SAFETY: as above; these columns of dst go to this call only.
            unsafe { gemm_columns_of_wt(m, n, k, columns.clone(), &DisjointWrites::from_raw(blocks.as_mut_ptr(), m * n), false, lhs, &w) };
            for i in 0..m {
                for j in columns.clone() {
                    assert_eq!(blocks[i * n + j].to_bits(), in_place[i * n + j].to_bits(), "columns {columns:?}: ({i}, {j})");
                }
            }
        }
        let want: f64 = (0..k).map(|p| x[5 * k + p] as f64 * w[7 * k + p] as f64).sum();
        assert!((in_place[5 * n + 7] as f64 - want).abs() < 1e-4, "{} vs {want}", in_place[5 * n + 7]);
    }

    /// Products split between two threads at any share of the columns (the bounds and the
    /// middle) equal the plain sum over k, with and without accumulating into dst.
    #[test]
    fn a_product_split_at_any_share_is_the_plain_product() {
        let (m, n, k) = (64, 200, 40);
        let lhs: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0).collect();
        let rhs: Vec<f32> = (0..k * n).map(|i| ((i * 5 % 11) as f32 - 5.0) / 5.0).collect();
        let want: Vec<f32> = (0..m * n).map(|e| (0..k).map(|p| lhs[e / n * k + p] * rhs[p * n + e % n]).sum()).collect();
        for share in [0.3, 0.5, 0.7] {
            column_split::CALLER_SHARE.with(|s| s.set(share));
            let got = product(m, n, k, (&lhs, 1, k as isize), (&rhs, 1, n as isize));
            let mut twice = got.clone();
            product_add(m, n, k, &mut twice, (&lhs, 1, k as isize), (&rhs, 1, n as isize));
            for e in 0..m * n {
                assert!((got[e] - want[e]).abs() < 1e-4, "share {share}, ({}, {}): {} vs {}", e / n, e % n, got[e], want[e]);
                assert!((twice[e] - 2.0 * want[e]).abs() < 2e-4, "share {share}, accumulated ({}, {})", e / n, e % n);
            }
        }
    }

    /// A column-major lhs comes out as row-major blocks that cover its rows once, in order, each
    /// of at least `LHS_BLOCK_MIN_ROWS` rows (a remainder joins the last block), read from a
    /// window of a wider buffer as a weight gradient's `gyᵀ` is.
    #[test]
    fn a_column_major_lhs_comes_out_in_row_blocks() {
        let (m, k, cs) = (1000, 2048, 1030);
        let src: Vec<f32> = (0..k * cs).map(|i| i as f32).collect();
        let lhs = (&src[7..], cs as isize, 1);
        let mut seen = vec![];
        lhs_in_row_blocks(m, k, lhs, |rows, (block, one, width)| {
            assert_eq!(one, 1);
            for i in rows.clone() {
                for p in 0..k {
                    assert_eq!(block[(i - rows.start) * width as usize + p], src[7 + p * cs + i], "row {i}, column {p}");
                }
            }
            seen.push(rows);
        });
        let width = k + WT_BLOCK_PAD;
        let block = LHS_BLOCK_VALUES / width / 64 * 64;
        assert_eq!(seen, [0..block, block..m], "blocks of {block} rows");
        assert!(m - block >= LHS_BLOCK_MIN_ROWS && m - 2 * block < LHS_BLOCK_MIN_ROWS);
    }

    /// A weight gradient's product, lhs read column-major (`gyᵀ` in place), gives the bits of
    /// the same product from a row-major copy of lhs, over several row blocks, with and
    /// without accumulating; and the plain sum to rounding.
    #[test]
    fn a_column_major_lhs_gives_the_bits_of_its_row_major_copy() {
        let (m, n, k) = (1000, 96, 2048);
        let gy: Vec<f32> = (0..k * m).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 1.3).collect();
        let x: Vec<f32> = (0..k * n).map(|i| ((i * 104_729 % 997) as f32 / 997.0 - 0.5) * 0.7).collect();
        let gy_t: Vec<f32> = (0..m * k).map(|e| gy[e % k * m + e / k]).collect();
        let (column_major, row_major, x) = ((&gy[..], m as isize, 1), (&gy_t[..], 1, k as isize), (&x[..], 1, n as isize));
        let got = product(m, n, k, column_major, x);
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            product(m, n, k, row_major, x).iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        let (mut twice, mut twice_rows) = (got.clone(), got.clone());
        product_add(m, n, k, &mut twice, column_major, x);
        product_add(m, n, k, &mut twice_rows, row_major, x);
        assert!(twice.iter().zip(&twice_rows).all(|(a, b)| a.to_bits() == b.to_bits()));
        for (i, j) in [(0, 0), (517, 33), (999, 95)] {
            let want: f64 = (0..k).map(|p| gy[p * m + i] as f64 * x.0[p * n + j] as f64).sum();
            assert!((got[i * n + j] as f64 - want).abs() < 1e-3, "({i}, {j}): {} vs {want}", got[i * n + j]);
        }
    }
}
