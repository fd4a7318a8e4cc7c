//! An f32 matrix product for AVX2 + FMA and AVX-512 in BLIS's shape: both operands packed block
//! by block (read once, in address order), and a register kernel (`tiles`: 6 × 16 on AVX2,
//! 6 × 32 on AVX-512) walking the packed blocks from the caches (an rhs micro-panel from L1, the
//! lhs block from L2).
//!
//! Why not gemm's kernels, which run register tiles of the same size: gemm reads one operand
//! of our products unpacked (its microkernel walks six strided rows of the activations straight
//! from memory), and in training every operand comes from memory (a step's weights and saved
//! activations are several times L3), and packed reads measured faster (docs/design.md; `cargo
//! bench --bench matmul`, its step-sequence rows). And:
//! - the threads computing pieces of one product's columns share one packing of lhs, the operand
//!   every piece reads ([`SharedLhs`]), which they would each pack for themselves;
//! - every value of dst is summed the same way wherever its tile lies (edge tiles run the same
//!   kernel into a scratch tile, the depth blocks are fixed), so a product's values do not depend
//!   on how its columns are split among threads; gemm's change with a piece's size
//!   (`column_split::splits_exactly`).

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU8, Ordering};

use super::pack::{pack_lhs, pack_rhs_for};
pub use super::rhs_elem::RhsElem;
use super::tiles::{Tile, MR, NR_AVX2};
use super::Strided;

/// Depth of a packed block: an rhs micro-panel (KC × NR floats) is 16 KiB at AVX2 (32 KiB at
/// AVX-512) and stays in L1 while the kernel walks the lhs block.
const KC: usize = 256;
/// Rows of lhs packed at a time: MC × KC floats are 144 KiB, within a typical core's L2.
const MC: usize = 144;
/// Columns of rhs packed at a time (KC × NC floats, 4 MiB, in L3): a thread's half of the
/// 28M Llama's head in one block.
const NC: usize = 4096;

/// Products this small run on gemm (packing would cost more than it saves; narrower than the
/// narrowest tile, a product would be all edge).
pub(crate) fn worth_it(m: usize, n: usize, k: usize) -> bool {
    m >= MR && n >= NR_AVX2 && k >= 8 && m * n * k >= 1 << 15
}

/// Largest lhs (values) whose packing the threads share: the shared buffer is kept by the
/// calling thread between products, and a head's backward reads vocabulary-wide gradient rows
/// (SmolLM2's 256 x 49152 would keep 48 MiB). The 28M Llama's largest, its head's 512 x 8192,
/// fits; larger ones are packed by each thread, a block at a time.
const SHARED_MAX: usize = 5 << 20;

/// Whether the threads computing pieces of a product's columns (the narrowest `narrowest`
/// wide) share one packing of its `m × k` lhs.
pub(crate) fn shares_lhs(m: usize, narrowest: usize, k: usize) -> bool {
    worth_it(m, narrowest, k) && m.div_ceil(MR) * MR * k <= SHARED_MAX
}

thread_local! {
    /// This thread's packed blocks (lhs, rhs), kept between products: a fresh buffer per
    /// product would fault its pages in again.
    static PACKED: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    /// The whole packed lhs of the products this thread splits among threads ([`SharedLhs`]).
    static SHARED_PACKED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// A product's lhs packed once for all the threads computing pieces of its columns: every
/// piece reads all of lhs, and each thread packing its own copy moved lhs from memory twice.
///
/// Each (depth, rows) block is packed by the first thread that needs it. A thread that needs a
/// block another thread is packing packs a later block meanwhile, so the packing is shared
/// out and nobody waits on a thread that is not running: only a claimed block is waited for,
/// and its claimer is packing it.
pub struct SharedLhs {
    m: usize,
    k: usize,
    lhs: Strided<*const f32>,
    packed: *mut f32,
    /// Per block, in the order the driver visits them (depth-major): 0 not packed, 1 being
    /// packed, 2 packed.
    states: Vec<AtomicU8>,
    row_blocks: usize,
}

// SAFETY: lhs is only read; each block of `packed` is written by the one thread that claimed
// it and read only after its state says packed (release / acquire).
unsafe impl Sync for SharedLhs {}

impl SharedLhs {
    /// Runs `f` with a shared packing of `lhs` (m × k) in this thread's buffer.
    ///
    /// # Safety
    /// As [`sgemm`] for lhs; the CPU must have AVX2 and FMA.
    pub(crate) unsafe fn with<R>(m: usize, k: usize, lhs: Strided<*const f32>, f: impl FnOnce(&SharedLhs) -> R) -> R {
        SHARED_PACKED.with(|buf| {
            let mut buf = buf.borrow_mut();
            let len = m.div_ceil(MR) * MR * k;
            if buf.len() < len {
                *buf = vec![0.0; len];
            }
            let row_blocks = m.div_ceil(MC);
            let states = (0..k.div_ceil(KC) * row_blocks).map(|_| AtomicU8::new(0)).collect();
            f(&SharedLhs { m, k, lhs, packed: buf.as_mut_ptr(), states, row_blocks })
        })
    }

    /// Where block `b` starts in the packed buffer, and its (rows, depth, first row, first depth).
    fn block_at(&self, b: usize) -> (usize, (usize, usize, usize, usize)) {
        let (depth_block, row_block) = (b / self.row_blocks, b % self.row_blocks);
        let (pc, ic) = (depth_block * KC, row_block * MC);
        let (kc, mc) = (KC.min(self.k - pc), MC.min(self.m - ic));
        (pc * self.m.div_ceil(MR) * MR + ic * kc, (mc, kc, ic, pc))
    }

    /// # Safety
    /// Only by the thread that claimed block `b`.
    unsafe fn pack(&self, b: usize) {
        let (at, (mc, kc, ic, pc)) = self.block_at(b);
        let src = self.lhs.0.offset(ic as isize * self.lhs.2 + pc as isize * self.lhs.1);
        pack_lhs(mc, kc, src, self.lhs.1, self.lhs.2, self.packed.add(at));
        self.states[b].store(2, Ordering::Release);
    }

    fn claim(&self, b: usize) -> bool {
        self.states[b].compare_exchange(0, 1, Ordering::Acquire, Ordering::Acquire).is_ok()
    }

    /// The packed block of rows `ic..` at depth `pc..`, packing it (or waiting for it) first.
    ///
    /// # Safety
    /// As [`SharedLhs::with`].
    unsafe fn block(&self, pc: usize, ic: usize) -> *const f32 {
        let b = pc / KC * self.row_blocks + ic / MC;
        loop {
            match self.states[b].load(Ordering::Acquire) {
                2 => break,
                0 if self.claim(b) => self.pack(b),
                0 => {}
                _ => match (b + 1..self.states.len()).find(|&c| self.states[c].load(Ordering::Relaxed) == 0 && self.claim(c)) {
                    Some(c) => self.pack(c),
                    None => std::hint::spin_loop(),
                },
            }
        }
        self.packed.add(self.block_at(b).0)
    }
}

/// `dst (m × n, rows `dst_rs` apart, columns adjacent) = [dst +] beta · lhs (m × k) · rhs (k × n)`,
/// on the calling thread; dst is not read unless `accumulate`. With `shared`, lhs's packed
/// blocks come from there (which must pack this lhs), shared with the threads computing other
/// columns of the same product.
///
/// # Safety
/// The CPU must have the tile's instructions (and AVX2, FMA and F16C, for the packing). The strided
/// matrices must stay inside their allocations; dst must not overlap lhs or rhs. Strides are
/// non-negative.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sgemm<T: RhsElem>(
    tile: Tile,
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    lhs: Strided<*const f32>,
    rhs: Strided<*const T>,
    accumulate: bool,
    beta: f32,
    shared: Option<&SharedLhs>,
) {
    debug_assert!(shared.is_none_or(|s| (s.m, s.k, s.lhs) == (m, k, lhs)));
    if super::nothing_to_sum(m, n, k, (dst, dst_rs), accumulate) {
        return;
    }
    PACKED.with(|packed| {
        let mut packed = packed.borrow_mut();
        let (a_buf, b_buf) = &mut *packed;
        let a_len = MC.div_ceil(MR) * MR * KC;
        let nr = tile.nr();
        let b_len = NC.div_ceil(nr) * nr * KC;
        if a_buf.len() < a_len {
            *a_buf = vec![0.0; a_len];
        }
        if b_buf.len() < b_len {
            *b_buf = vec![0.0; b_len];
        }
        let (a_pack, b_pack) = (a_buf.as_mut_ptr(), b_buf.as_mut_ptr());
        if m <= MC && rhs.2 == 1 {
            return by_panels(tile, m, n, k, dst, dst_rs, lhs, rhs, accumulate, beta, shared, (a_pack, b_pack));
        }
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            for pc in (0..k).step_by(KC) {
                let kc = KC.min(k - pc);
                let src = rhs.0.offset(pc as isize * rhs.2 + jc as isize * rhs.1);
                pack_rhs_for(tile, kc, nc, src, rhs.1, rhs.2, b_pack);
                // Later depth blocks add to what the first wrote.
                let load_dst = accumulate || pc > 0;
                for ic in (0..m).step_by(MC) {
                    let mc = MC.min(m - ic);
                    let a_pack = lhs_block(shared, lhs, (ic, mc), (pc, kc), a_pack);
                    for q in 0..nc.div_ceil(nr) {
                        let cols = nr.min(nc - q * nr);
                        for i in 0..mc.div_ceil(MR) {
                            let rows = MR.min(mc - i * MR);
                            tile.kernel(
                                kc,
                                a_pack.add(i * MR * kc),
                                b_pack.add(q * nr * kc),
                                dst.add((ic + i * MR) * dst_rs + jc + q * nr),
                                dst_rs,
                                (rows, cols),
                                load_dst,
                                beta,
                            );
                        }
                    }
                }
            }
        }
    })
}

/// [`sgemm`] for an lhs of one row block (`m <= MC`: a prompt's chunk, a batch of streams) and
/// an rhs whose columns run along the depth (a weight `W` read as `Wᵀ` in place): each panel
/// of rhs is packed and used at once, and the next panel's rows are prefetched while the
/// kernels run on this one. Packing every panel of a block first read the weight from memory
/// with no arithmetic to hide it behind; with one row block, each panel is used once either
/// way, so the order changes no value (docs/design.md, "Short prompts").
///
/// # Safety
/// As [`sgemm`]; the buffers hold a packed row block and a packed panel.
#[allow(clippy::too_many_arguments)]
unsafe fn by_panels<T: RhsElem>(
    tile: Tile,
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    lhs: Strided<*const f32>,
    rhs: Strided<*const T>,
    accumulate: bool,
    beta: f32,
    shared: Option<&SharedLhs>,
    (a_pack, b_pack): (*mut f32, *mut f32),
) {
    let nr = tile.nr();
    let row_tiles = m.div_ceil(MR);
    let values_per_line = 64 / std::mem::size_of::<T>();
    for pc in (0..k).step_by(KC) {
        let kc = KC.min(k - pc);
        let a_pack = lhs_block(shared, lhs, (0, m), (pc, kc), a_pack);
        // Later depth blocks add to what the first wrote.
        let load_dst = accumulate || pc > 0;
        let lines_per_column = kc.div_ceil(values_per_line);
        for j in (0..n).step_by(nr) {
            let cols = nr.min(n - j);
            let column = |c: usize| rhs.0.offset(c as isize * rhs.1 + pc as isize);
            pack_rhs_for(tile, kc, cols, column(j), rhs.1, 1, b_pack);
            // The next panel's cache lines, a share before each row tile's kernel, walked by a
            // cursor: a division per line (the column and the line in it) cost a third of the
            // kernels' time on a short prompt's products.
            let next_lines = nr.min(n.saturating_sub(j + nr)) * lines_per_column;
            let mut next = NextLines { column: column(j + nr), column_stride: rhs.1, line: 0, lines_per_column, values_per_line };
            for i in 0..row_tiles {
                next.prefetch(next_lines * (i + 1) / row_tiles - next_lines * i / row_tiles);
                let rows = MR.min(m - i * MR);
                tile.kernel(kc, a_pack.add(i * MR * kc), b_pack, dst.add(i * MR * dst_rs + j), dst_rs, (rows, cols), load_dst, beta);
            }
        }
    }
}

/// A cursor over the cache lines of rhs's next panel in [`by_panels`]: column by column, each
/// column's lines in address order.
struct NextLines<T> {
    column: *const T,
    column_stride: isize,
    /// The next line's index in `column`.
    line: usize,
    lines_per_column: usize,
    values_per_line: usize,
}

impl<T> NextLines<T> {
    /// Prefetches the next `lines` lines into L1.
    ///
    /// # Safety
    /// The lines must lie in rhs.
    #[inline(always)]
    unsafe fn prefetch(&mut self, lines: usize) {
        for _ in 0..lines {
            _mm_prefetch::<_MM_HINT_T0>(self.column.add(self.line * self.values_per_line).cast());
            self.line += 1;
            if self.line == self.lines_per_column {
                (self.line, self.column) = (0, self.column.offset(self.column_stride));
            }
        }
    }
}

/// The packed lhs block of rows `ic..ic + mc` and depths `pc..pc + kc`: from `shared` when
/// given, else packed into `a_pack`.
///
/// # Safety
/// As [`sgemm`] for lhs; `a_pack` holds a packed row block.
unsafe fn lhs_block(
    shared: Option<&SharedLhs>,
    lhs: Strided<*const f32>,
    (ic, mc): (usize, usize),
    (pc, kc): (usize, usize),
    a_pack: *mut f32,
) -> *const f32 {
    match shared {
        Some(shared) => shared.block(pc, ic),
        None => {
            pack_lhs(mc, kc, lhs.0.offset(ic as isize * lhs.2 + pc as isize * lhs.1), lhs.1, lhs.2, a_pack);
            a_pack.cast_const()
        }
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;
    use crate::simd::SimdLevel;

    /// The tiles this CPU can run.
    fn tiles() -> Vec<Tile> {
        [SimdLevel::Avx2, SimdLevel::Avx512].into_iter().filter(|l| *l <= SimdLevel::detected()).filter_map(Tile::at).collect()
    }

    /// Every layout training uses (row-major, transposed operands), edge tiles in each
    /// direction, several depth blocks, accumulate and a beta, against an f64 reference.
    #[test]
    fn the_packed_product_equals_the_reference() {
        for tile in tiles() {
            the_product_equals_the_reference_with(tile);
        }
    }

    fn the_product_equals_the_reference_with(tile: Tile) {
        for &(m, n, k) in &[(6, 16, 8), (37, 29, 51), (46, 70, 600), (150, 70, 600), (13, 4100, 9), (300, 33, 257)] {
            let lhs: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0).collect();
            let rhs: Vec<f32> = (0..k * n).map(|i| ((i * 5 % 11) as f32 - 5.0) / 5.0).collect();
            for lhs_row_major in [true, false] {
                for rhs_row_major in [true, false] {
                    let l = if lhs_row_major { (1, k as isize) } else { (m as isize, 1) };
                    let r = if rhs_row_major { (1, n as isize) } else { (k as isize, 1) };
                    let at_l = |i: usize, p: usize| lhs[(i as isize * l.1 + p as isize * l.0) as usize] as f64;
                    let at_r = |p: usize, j: usize| rhs[(p as isize * r.1 + j as isize * r.0) as usize] as f64;
                    for (accumulate, beta) in [(false, 1.0f32), (true, 1.0), (true, 0.5)] {
                        let dst_rs = n + 3;
                        let mut dst = vec![2.0f32; m * dst_rs];
                        // SAFETY: every matrix is dense with the strides given; AVX2 checked above.
                        unsafe {
                            sgemm(
                                tile,
                                m,
                                n,
                                k,
                                dst.as_mut_ptr(),
                                dst_rs,
                                (lhs.as_ptr(), l.0, l.1),
                                (rhs.as_ptr(), r.0, r.1),
                                accumulate,
                                beta,
                                None,
                            )
                        };
                        for i in 0..m {
                            for j in 0..dst_rs {
                                let got = dst[i * dst_rs + j] as f64;
                                let want = if j >= n {
                                    2.0
                                } else {
                                    (if accumulate { 2.0 } else { 0.0 })
                                        + beta as f64 * (0..k).map(|p| at_l(i, p) * at_r(p, j)).sum::<f64>()
                                };
                                assert!(
                                    (got - want).abs() < 1e-3,
                                    "{tile:?} ({m}, {n}, {k}) lhs row-major {lhs_row_major} rhs row-major {rhs_row_major} acc {accumulate} ({i}, {j}): {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// A 2-byte rhs, widened as it is packed, gives the bits of the f32 product of its widened
    /// values, in both layouts the packing reads (rows along p, and the transposed weight) and
    /// with edge panels, at every tile.
    #[test]
    fn a_half_rhs_widened_while_packed_is_its_f32_product() {
        for tile in tiles() {
            for &(m, n, k) in &[(7, 300, 64), (45, 128, 576), (13, 37, 300)] {
                let lhs: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 1.7).collect();
                let w: Vec<f32> = (0..k * n).map(|i| ((i * 104_729 % 997) as f32 / 997.0 - 0.5) * 0.3).collect();
                let w16: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
                let wb16: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
                let (w16_f32, wb16_f32): (Vec<f32>, Vec<f32>) = w16.iter().zip(&wb16).map(|(a, b)| (a.to_f32(), b.to_f32())).unzip();
                let l = (lhs.as_ptr(), 1, k as isize);
                // (column stride, row stride) of rhs: a row-major (k × n), and Wᵀ of a row-major (n × k).
                for (cs, rs) in [(1, n as isize), (k as isize, 1)] {
                    let product = |run: &dyn Fn(*mut f32)| {
                        let mut dst = vec![0f32; m * n];
                        run(dst.as_mut_ptr());
                        dst
                    };
                    // SAFETY: dense matrices with these strides; the CPU runs the tile.
                    let want16 = product(&|d| unsafe { sgemm(tile, m, n, k, d, n, l, (w16_f32.as_ptr(), cs, rs), false, 1.0, None) });
                    let got16 = product(&|d| unsafe { sgemm(tile, m, n, k, d, n, l, (w16.as_ptr(), cs, rs), false, 1.0, None) });
                    let wantb16 = product(&|d| unsafe { sgemm(tile, m, n, k, d, n, l, (wb16_f32.as_ptr(), cs, rs), false, 1.0, None) });
                    let gotb16 = product(&|d| unsafe { sgemm(tile, m, n, k, d, n, l, (wb16.as_ptr(), cs, rs), false, 1.0, None) });
                    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same(&got16, &want16), "{tile:?} f16 ({m}, {n}, {k}) strides ({cs}, {rs})");
                    assert!(same(&gotb16, &wantb16), "{tile:?} bf16 ({m}, {n}, {k}) strides ({cs}, {rs})");
                }
            }
        }
    }

    /// Threads computing column pieces from one shared packing of lhs (several depth and row
    /// blocks, so that blocks are claimed, packed ahead and waited for) give the bits of one
    /// thread packing its own, at any number of pieces, with either tile: the AVX-512 tile's
    /// product is the AVX2 tile's, bit for bit.
    #[test]
    fn pieces_sharing_the_packed_lhs_give_the_one_thread_product() {
        let tiles = tiles();
        if tiles.is_empty() {
            return;
        }
        let (m, n, k) = (300, 200, 700);
        let lhs: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 1.7).collect();
        let rhs: Vec<f32> = (0..k * n).map(|i| ((i * 104_729 % 997) as f32 / 997.0 - 0.5) * 0.3).collect();
        let (l, r) = ((lhs.as_ptr(), 1, k as isize), (rhs.as_ptr(), 1, n as isize));
        let mut want = vec![0f32; m * n];
        // SAFETY: dense matrices with these strides; the CPU runs the tile.
        unsafe { sgemm(tiles[0], m, n, k, want.as_mut_ptr(), n, l, r, false, 1.0, None) };
        for (tile, pieces) in tiles.iter().flat_map(|t| [(*t, 1), (*t, 2), (*t, 3)]) {
            for _ in 0..20 {
                let mut got = vec![0f32; m * n];
                let dst = crate::disjoint::DisjointWrites::new(&mut got);
                let width = n.div_ceil(pieces);
                // SAFETY: as above; each thread writes its own columns of dst.
                unsafe {
                    SharedLhs::with(m, k, l, |shared| {
                        std::thread::scope(|scope| {
                            for piece in 0..pieces {
                                let (lo, hi) = (piece * width, ((piece + 1) * width).min(n));
                                let (dst, lhs, rhs) = (&dst, &lhs, &rhs);
                                scope.spawn(move || {
                                    let (l, r) = ((lhs.as_ptr(), 1, k as isize), (rhs.as_ptr().add(lo), 1, n as isize));
                                    sgemm(tile, m, hi - lo, k, dst.at(lo), n, l, r, false, 1.0, Some(shared))
                                });
                            }
                        })
                    })
                };
                assert!(
                    got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{tile:?}, {pieces} pieces: not the one-thread {:?} product",
                    tiles[0]
                );
            }
        }
    }
}
