//! Where a two-thread product splits its dst columns: in proportion to how fast each thread ran
//! the last products, not in halves.
//!
//! Why: on the 2-core (virtual) machines training runs on, the two cores do not compute equally
//! fast. `perf record` of `finetune` on the 28M Llama (AVX2-only AMD EPYC) counted 11% more gemm
//! microkernel samples on the pool's worker than on the calling thread for the same halves, and
//! the calling thread spent 11% of its samples waiting for the worker at the end of the products
//! (`BarrierGuard::drop`). Smaller pieces taken from a shared cursor would even that out too, but
//! every piece packs the whole left operand again (see `linear::gemm_rows`).

use std::sync::atomic::{AtomicU32, Ordering};

thread_local! {
    /// Whether this thread's products split by measured speed (else in halves).
    static ADAPTS: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };

    /// This thread's share of the columns of the products it calls, as f32 bits: starts at one
    /// half. Per calling thread: ranks run as threads (the `local` backend) share the pool's
    /// worker, and each learns its own ratio to it.
    pub(crate) static CALLER_SHARE: CallerShare = const { CallerShare(AtomicU32::new(0x3f00_0000)) };
}

/// A calling thread's share of the columns, kept across products.
pub(crate) struct CallerShare(AtomicU32);

/// Makes this thread's two-thread products split their columns in halves, as they did before
/// this module. For ranks running as threads of one process (the `local` backend at world > 1):
/// there the two pieces' times measure how the OS slices two cores among the ranks and the
/// pool's worker, not the cores: following them, the 28M model's world-2 bench rows fell to
/// 396 / 395 tokens/s from 445 / 452 with halves (two runs each, AVX2-only Zen 3).
pub fn split_columns_evenly_on_this_thread() {
    ADAPTS.with(|a| a.set(false));
}

/// Whether this thread's products follow the measured speeds.
pub(crate) fn adapts() -> bool {
    ADAPTS.with(|a| a.get())
}

/// Splits are multiples of this many columns: gemm's AVX2 microkernel computes 16 rows of its
/// (transposed) dst at a time, which are 16 of our columns, and a ragged edge runs a slower
/// kernel.
const ALIGN: usize = 16;

/// How far the split may move from halves (a thread that stalled once must not get nothing).
const SHARE_RANGE: (f32, f32) = (0.3, 0.7);

/// Weight of the newest product's speeds in the running share.
const NEWEST: f32 = 0.25;

impl CallerShare {
    /// Columns of an `n`-column product the calling thread computes (the rest go to the worker).
    pub(crate) fn caller_columns(&self, n: usize) -> usize {
        let share = f32::from_bits(self.0.load(Ordering::Relaxed));
        let c = ((n as f32 * share / ALIGN as f32).round() as usize) * ALIGN;
        c.clamp(ALIGN.min(n / 2), n - ALIGN.min(n / 2))
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
        assert_eq!(share.caller_columns(1024), 688, "the 2:1 speeds give 2/3 (683), rounded to 16 columns");
        for _ in 0..50 {
            share.record((100, 1.0), (100, 100.0));
        }
        assert_eq!(share.caller_columns(1000), 704, "70% of 1,000 is 700, rounded to 16 columns");
        assert_eq!(share.caller_columns(20), 10, "a product narrower than two aligned pieces splits in halves");
        for _ in 0..50 {
            share.record((256, 1.0), (256, 1.0));
        }
        assert_eq!(share.caller_columns(512), 256);
    }
}
