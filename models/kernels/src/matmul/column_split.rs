//! Where a two-thread product splits its dst columns: in proportion to how fast each thread ran
//! the last products, not in halves.
//!
//! Why: on the 2-core (virtual) machines training runs on, the two cores do not compute equally
//! fast, and the calling thread waited for the worker at the end of each product
//! (`BarrierGuard::drop`; the profile in docs/design.md, matrix products). Smaller pieces taken
//! from a shared cursor would even that out too, but every piece packs the whole left operand
//! again (see `parallel::gemm_rows`).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

thread_local! {
    /// This thread's share of the columns of the products it calls, as f32 bits: starts at one
    /// half. Per calling thread: ranks run as threads (the `local` backend) share the pool's
    /// worker, and each learns its own ratio to it.
    pub(crate) static CALLER_SHARE: CallerShare = const { CallerShare(AtomicU32::new(0x3f00_0000)) };
}

/// A calling thread's share of the columns, kept across products.
pub(crate) struct CallerShare(AtomicU32);

/// Threads inside a pooled product now.
static CALLERS: AtomicUsize = AtomicUsize::new(0);

/// Whether two threads were ever inside products at the same time: from then on every product of
/// the process splits in halves.
static SHARED_POOL: AtomicBool = AtomicBool::new(false);

/// A thread's presence inside a pooled product, from [`enter_product`] to its drop.
pub(crate) struct InProduct;

/// Marks this thread as inside a product. Where it finds another one already inside, the process
/// stops adapting for good: several callers (ranks run as threads of one process, the `local` backend
/// at world > 1) share the pool's worker, the two pieces' times then measure how the OS slices
/// the cores among them, not the cores, and following them was slower (docs/design.md, matrix
/// products). The kernels see this themselves, so no caller has to say it.
pub(crate) fn enter_product() -> InProduct {
    if CALLERS.fetch_add(1, Ordering::AcqRel) > 0 {
        SHARED_POOL.store(true, Ordering::Release);
    }
    InProduct
}

impl Drop for InProduct {
    fn drop(&mut self) {
        CALLERS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Whether products follow the measured speeds.
pub(crate) fn adapts() -> bool {
    !SHARED_POOL.load(Ordering::Acquire)
}

/// Splits are multiples of the register tile's width where that keeps them within
/// [`WHOLE_TILE_SLACK`] of the measured share, else of the narrowest edge the kernels compute
/// (`matmul::tile_columns`): a ragged edge runs a whole tile into scratch for part of it, or a
/// slower kernel. Where the two are equal, every split is of whole tiles.
fn aligns() -> (usize, usize) {
    super::tile_columns()
}

/// How far from the measured share (a fraction of the columns) a split of whole tiles may fall
/// and still be taken over a finer one: a share that wanders around one half by noise would
/// otherwise give both pieces edges most of the time (gemm's AVX-512 edge kernels, 16 to 48 of
/// its 64 columns, took 4-5% of a 28M step's profile).
const WHOLE_TILE_SLACK: f32 = 0.04;

/// How far the split may move from halves (a thread that stalled once must not get nothing).
const SHARE_RANGE: (f32, f32) = (0.3, 0.7);

/// Weight of the newest product's speeds in the running share.
const NEWEST: f32 = 0.25;

/// Columns of an `n`-column product a calling thread with `share` computes.
fn columns_at(share: f32, n: usize) -> usize {
    let (tile, edge) = aligns();
    let ideal = n as f32 * share;
    let at = |align: usize| ((ideal / align as f32).round() as usize * align).clamp(align.min(n / 2), n - align.min(n / 2));
    match at(tile) {
        whole if (whole as f32 - ideal).abs() <= WHOLE_TILE_SLACK * n as f32 => whole,
        _ => at(edge),
    }
}

/// Whether every split the share can give computes each column of a `rows`-row, `n`-column
/// product with the same arithmetic, so that its values do not depend on the split. gemm
/// (gemm-common 0.19's `gemm_basic_generic`) sums a piece `w` columns wide differently by its
/// size: with horizontal dot-product kernels when `w × rows <= 256`, and over k in blocks of
/// 512 instead of its cache-derived block when `w <= 64` and `rows <= 64`. Where a piece could
/// cross those lines, a column could change by an ulp from one product to the next: two
/// forwards of the same weights, 5 tokens through 160-column products, gave logits 1e-6 apart
/// while other threads computed (tests/checkpoint.rs failed on it once). Such products split
/// in halves, always the same.
pub(crate) fn splits_exactly(rows: usize, n: usize) -> bool {
    let narrowest = narrowest(n);
    narrowest * rows > 256 && (narrowest > 64 || rows > 64)
}

/// The narrowest piece a split of `n` columns can give either thread.
pub(crate) fn narrowest(n: usize) -> usize {
    columns_at(SHARE_RANGE.0, n).min(n - columns_at(SHARE_RANGE.1, n))
}

impl CallerShare {
    /// Columns of an `n`-column product the calling thread computes (the rest go to the worker).
    pub(crate) fn caller_columns(&self, n: usize) -> usize {
        columns_at(f32::from_bits(self.0.load(Ordering::Relaxed)), n)
    }

    /// After a product whose two pieces ran on different threads: `(columns, seconds)` of the calling
    /// thread's piece and of the worker's moves the share toward their speeds' ratio.
    pub(crate) fn record(&self, caller: (usize, f64), worker: (usize, f64)) {
        let speed = |(cols, secs): (usize, f64)| cols as f64 / secs.max(1e-9);
        let (c, w) = (speed(caller), speed(worker));
        let newest = (c / (c + w)) as f32;
        let share = f32::from_bits(self.0.load(Ordering::Relaxed));
        let next = ((1.0 - NEWEST) * share + NEWEST * newest).clamp(SHARE_RANGE.0, SHARE_RANGE.1);
        self.0.store(next.to_bits(), Ordering::Relaxed);
    }

    /// Sets the share (tests: products at a given split).
    #[cfg(test)]
    pub(crate) fn set(&self, share: f32) {
        self.0.store(share.to_bits(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Once two threads are inside products at the same time, neither adapts, then or after.
    #[test]
    fn threads_that_meet_inside_a_product_split_in_halves() {
        let both_inside = std::sync::Barrier::new(2);
        std::thread::scope(|scope| {
            for _ in 0..2 {
                scope.spawn(|| {
                    let inside = enter_product();
                    both_inside.wait();
                    drop(inside);
                    assert!(!adapts());
                    drop(enter_product());
                    assert!(!adapts());
                });
            }
        });
    }

    /// The split stays aligned and inside the product, and follows the measured speeds within
    /// its bounds: a worker twice as slow moves columns to the caller, never past 70%.
    #[test]
    fn the_split_follows_the_threads_speeds() {
        let share = CallerShare(AtomicU32::new(0.5f32.to_bits()));
        let c = share.caller_columns(512);
        assert!(c == 256, "{c}");
        for _ in 0..50 {
            share.record((256, 1.0), (256, 2.0));
        }
        let want = match aligns().0 {
            16 => 688,
            32 => 672,
            _ => 704,
        };
        assert_eq!(share.caller_columns(1024), want, "the 2:1 speeds give 2/3 (683), rounded to whole tiles of {:?}", aligns());
        for _ in 0..50 {
            share.record((100, 1.0), (100, 100.0));
        }
        assert_eq!(share.caller_columns(1000), 704, "70% of 1,000 is 700, rounded to {:?} columns (16, 32 or 64 alike)", aligns());
        assert_eq!(share.caller_columns(20), 10, "a product narrower than two aligned pieces splits in halves");
        for _ in 0..50 {
            share.record((256, 1.0), (256, 1.0));
        }
        assert_eq!(share.caller_columns(512), 256);
    }

    /// A share within the slack of a split of whole tiles takes it; one further off takes the
    /// edge grain (on 8 tiles, whole splits are 12.5% apart).
    #[test]
    fn whole_tiles_win_within_the_slack() {
        let (tile, edge) = aligns();
        let n = 8 * tile;
        assert_eq!(columns_at(0.53, n), 4 * tile, "0.53 of {n}: 3% from halves");
        let fine = ((0.56 * n as f32 / edge as f32).round() as usize) * edge;
        assert_eq!(columns_at(0.56, n), fine, "0.56 of {n}: 6% from halves");
        assert!(tile == edge || !fine.is_multiple_of(tile), "{fine} of {n} is whole tiles of {tile}");
    }

    /// Where `splits_exactly` says so, every split the share can give produces the same bits as
    /// halves (both pieces through gemm as `linear` runs them), and some product it refuses
    /// does differ by split: the line it draws is where gemm's arithmetic changes.
    #[test]
    fn a_product_is_the_same_at_every_split_it_allows() {
        use crate::matmul::sgemm;
        let mut refused_differ = false;
        for (m, n, k) in
            [(5usize, 160usize, 64usize), (5, 160, 576), (40, 160, 576), (64, 96, 576), (65, 160, 576), (8, 1536, 576), (300, 512, 64)]
        {
            let lhs: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 1.7).collect();
            let w: Vec<f32> = (0..k * n).map(|i| ((i * 104_729 % 997) as f32 / 997.0 - 0.5) * 0.3).collect();
            // x · wᵀ for w (n, k), as the linear layers call it, in two column pieces.
            let split_at = |s: f32| {
                let split = columns_at(s, n);
                let mut dst = vec![0f32; m * n];
                for (lo, hi) in [(0, split), (split, n)] {
                    // SAFETY: columns lo..hi of dst (rows n apart) and rows lo..hi of w are inside
                    // their buffers.
                    unsafe {
                        sgemm(
                            m,
                            hi - lo,
                            k,
                            (dst.as_mut_ptr().add(lo), 1, n as isize),
                            (lhs.as_ptr(), 1, k as isize),
                            (w.as_ptr().add(lo * k), k as isize, 1),
                            0.0,
                            1.0,
                        )
                    }
                }
                dst.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            let halves = split_at(0.5);
            let differ = [SHARE_RANGE.0, 0.4, 0.6, SHARE_RANGE.1].iter().any(|&s| split_at(s) != halves);
            if splits_exactly(m, n) {
                assert!(!differ, "({m}, {n}, {k}): a split changed the product");
            } else {
                refused_differ |= differ;
            }
        }
        assert!(refused_differ, "no refused product differed by split: the line is drawn in the wrong place");
    }
}
