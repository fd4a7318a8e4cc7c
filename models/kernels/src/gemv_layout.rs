//! How the matrix-vector product walks a thread's weight rows, chosen by timing it on the
//! process's own first decoding products.
//!
//! Two ways to read rows from DRAM: [`RowLayout::Grouped`] reads `ROW_GROUP` rows side by side
//! (x loaded once for them, the next group prefetched), [`RowLayout::OneByOne`] reads one row
//! after another, prefetching the row [`PREFETCH_AHEAD`] rows on. Which streams faster depends on
//! the CPU's memory system, not on its vector ISA: the grouped reads were the faster on a
//! Sapphire Rapids Xeon, and with f16 weights the slower on a Zen 3 EPYC (docs/design.md,
//! "Decoding's matrix-vector product"). Each weight type (f32, f16, bf16) chooses for itself.
//! Both give the same bits (a row's arithmetic does not depend on how many rows are read with
//! it), so the choice changes speed only, and is made by measurement:
//! the first products of a process alternate the layouts (in Thue-Morse order, so a model's
//! repeating pattern of matrix shapes falls on both alike), and once each has run
//! [`TRIALS`] times the one with fewer nanoseconds per weight byte is kept.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::time::Duration;

/// How many rows on the one-row-at-a-time walk prefetches.
pub const PREFETCH_AHEAD: usize = 2;
/// Timed products of each layout before the choice (a SmolLM2 token is ~120 products).
pub const TRIALS: u64 = 120;
/// Products smaller than this are not timed: their time is the threads' start, not the reads.
const TIMED_MIN_BYTES: usize = 64 << 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowLayout {
    Grouped,
    OneByOne,
}

impl RowLayout {
    /// Both, in the order of the chooser's per-layout tallies (a layout's index is its place).
    const ALL: [RowLayout; 2] = [RowLayout::Grouped, RowLayout::OneByOne];

    fn index(self) -> usize {
        Self::ALL.iter().position(|l| *l == self).expect("ALL lists every layout")
    }
}

/// `LayoutChooser::chosen` before the choice; after it, the chosen layout's index + 1.
const UNDECIDED: u8 = 0;

/// The choice for one weight type: undecided while it times both layouts, then fixed.
pub struct LayoutChooser {
    chosen: AtomicU8,
    calls: AtomicU64,
    /// Per layout (grouped, one by one): timed products, their nanoseconds, their bytes.
    runs: [AtomicU64; 2],
    nanos: [AtomicU64; 2],
    bytes: [AtomicU64; 2],
}

/// A product being timed: hand it back to [`LayoutChooser::record`] with its duration.
#[derive(Clone, Copy, Debug)]
pub struct Trial {
    layout: RowLayout,
    bytes: usize,
}

impl LayoutChooser {
    pub const fn new() -> Self {
        Self {
            chosen: AtomicU8::new(UNDECIDED),
            calls: AtomicU64::new(0),
            runs: [AtomicU64::new(0), AtomicU64::new(0)],
            nanos: [AtomicU64::new(0), AtomicU64::new(0)],
            bytes: [AtomicU64::new(0), AtomicU64::new(0)],
        }
    }

    /// The chosen layout, if the trials are over.
    pub fn chosen(&self) -> Option<RowLayout> {
        let code = self.chosen.load(Ordering::Relaxed);
        (code != UNDECIDED).then(|| RowLayout::ALL[code as usize - 1])
    }

    /// The layout for a product over `bytes` of weights, and the trial to record if it is timed.
    pub fn layout_for(&self, bytes: usize) -> (RowLayout, Option<Trial>) {
        if let Some(layout) = self.chosen() {
            return (layout, None);
        }
        if bytes < TIMED_MIN_BYTES {
            return (RowLayout::Grouped, None);
        }
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        let layout = if call.count_ones().is_multiple_of(2) { RowLayout::Grouped } else { RowLayout::OneByOne };
        (layout, Some(Trial { layout, bytes }))
    }

    /// Adds a timed product; after [`TRIALS`] of each layout, keeps the faster per byte.
    pub fn record(&self, trial: Trial, took: Duration) {
        let i = trial.layout.index();
        self.nanos[i].fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        self.bytes[i].fetch_add(trial.bytes as u64, Ordering::Relaxed);
        self.runs[i].fetch_add(1, Ordering::Relaxed);
        if self.runs.iter().all(|r| r.load(Ordering::Relaxed) >= TRIALS) {
            let per_byte = |i: usize| self.nanos[i].load(Ordering::Relaxed) as f64 / self.bytes[i].load(Ordering::Relaxed).max(1) as f64;
            // The first listed wins a tie.
            let faster =
                RowLayout::ALL.into_iter().min_by(|a, b| per_byte(a.index()).total_cmp(&per_byte(b.index()))).expect("two layouts");
            let code = faster.index() as u8 + 1;
            let _ = self.chosen.compare_exchange(UNDECIDED, code, Ordering::Relaxed, Ordering::Relaxed);
        }
    }
}

impl Default for LayoutChooser {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both layouts are tried about equally often, the faster per byte is kept, and small
    /// products are never timed.
    #[test]
    fn the_faster_layout_per_byte_is_kept_after_the_trials() {
        for slow in [RowLayout::Grouped, RowLayout::OneByOne] {
            let chooser = LayoutChooser::new();
            let (small, timed) = chooser.layout_for(1024);
            assert!(small == RowLayout::Grouped && timed.is_none(), "a small product was timed");
            let mut tried = [0u64; 2];
            let mut products = 0;
            while chooser.chosen().is_none() {
                let (layout, trial) = chooser.layout_for(1 << 20);
                let trial = trial.expect("undecided products are timed");
                tried[layout.index()] += 1;
                chooser.record(trial, Duration::from_micros(if layout == slow { 130 } else { 100 }));
                products += 1;
                assert!(products < 4 * TRIALS, "no choice after {products} products");
            }
            assert!(tried.iter().all(|t| (TRIALS..=TRIALS + 2).contains(t)), "tried {tried:?}");
            let fast = if slow == RowLayout::Grouped { RowLayout::OneByOne } else { RowLayout::Grouped };
            assert_eq!(chooser.chosen(), Some(fast));
            assert!(chooser.layout_for(1 << 20).1.is_none(), "decided products are not timed");
        }
    }
}
