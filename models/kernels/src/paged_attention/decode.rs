//! The decode step's attention: one query per head, at the last cached position, over the
//! cached blocks in place. Flash-decoding: the work items are (kv head, run of [`SPLIT`]
//! positions), so the threads share the work evenly however few kv heads there are, and each
//! key and value row is read once for the query heads of its group. Each item keeps, per query
//! head, its scores' max, the sum of their exponentials and the values weighted by those (not
//! yet divided); the items of a head are merged after.

use super::{KvView, BLOCK};
use crate::attend_rows::{add_weighted_rows, scores};
use crate::exp::exp_inplace;
use crate::gemv::axpy;
use crate::pool::for_chunks_mut;
use crate::simd::SimdLevel;

/// Positions per work item.
const SPLIT: usize = 32;

/// `q`: (heads, d), the query of the last cached position. Returns (heads, d).
pub fn attend_one(q: &[f32], heads: usize, kv: &KvView, scale: f32, window: Option<usize>) -> Vec<f32> {
    attend_rows(q, heads, std::slice::from_ref(kv), scale, window)
}

/// A decode step of several sequences at once (serving's streams): `q` (rows, heads, d), row
/// `r` the query of the last position of `kvs[r]`. Returns (rows, heads, d), each row the bits
/// [`attend_one`] gives it alone. All rows' work items share one parallel region, where a
/// region per row left the threads a few items each and a wait between rows.
pub fn attend_rows(q: &[f32], heads: usize, kvs: &[KvView], scale: f32, window: Option<usize>) -> Vec<f32> {
    let Some(first) = kvs.first() else { return vec![] };
    let (d, kv_heads) = (first.head_dim, first.kv_heads);
    assert!(kvs.iter().all(|kv| (kv.head_dim, kv.kv_heads) == (d, kv_heads)), "every row's cache must have one shape");
    let group = heads / kv_heads;
    let level = SimdLevel::current();
    let start = |kv: &KvView| window.map_or(0, |w| kv.len.saturating_sub(w));
    // Row r's items are (kv head, run of SPLIT positions), numbered from `first_item[r]`.
    let runs: Vec<usize> = kvs.iter().map(|kv| (kv.len - start(kv)).div_ceil(SPLIT)).collect();
    let first_item: Vec<usize> = runs.iter().scan(0, |n, &r| Some(std::mem::replace(n, *n + kv_heads * r))).collect();
    let item = group * (d + 2);
    let mut partial = vec![0f32; runs.iter().sum::<usize>() * kv_heads * item];
    for_chunks_mut(&mut partial, item, |i, part| {
        let row = first_item.partition_point(|&f| f <= i) - 1;
        let (kv, runs, i) = (&kvs[row], runs[row], i - first_item[row]);
        let (g, lo) = (i / runs, start(kv) + (i % runs) * SPLIT);
        let m = SPLIT.min(kv.len - lo);
        let mut p = [0f32; SPLIT];
        for (qi, head) in part.chunks_exact_mut(d + 2).enumerate() {
            let q_h = &q[(row * heads + g * group + qi) * d..][..d];
            let p = &mut p[..m];
            for (at, keys, _) in runs_in_blocks(kv.blocks, g, lo, m, d) {
                scores(q_h, keys, scale, &mut p[at..at + keys.len() / d], level);
            }
            let max = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            p.iter_mut().for_each(|s| *s -= max);
            exp_inplace(p);
            let (stats, out_h) = head.split_at_mut(2);
            stats[0] = max;
            stats[1] = p.iter().sum();
            for (at, _, values) in runs_in_blocks(kv.blocks, g, lo, m, d) {
                add_weighted_rows(out_h, &p[at..at + values.len() / d], values, level);
            }
        }
    });
    let mut out = vec![0f32; kvs.len() * heads * d];
    for (row_out, (&runs, &first)) in out.chunks_exact_mut(heads * d).zip(runs.iter().zip(&first_item)) {
        for (h, out_h) in row_out.chunks_exact_mut(d).enumerate() {
            let (g, qi) = (h / group, h % group);
            let head_of = |r: usize| &partial[(first + g * runs + r) * item + qi * (d + 2)..][..d + 2];
            let max = (0..runs).map(|r| head_of(r)[0]).fold(f32::NEG_INFINITY, f32::max);
            let weights: Vec<f32> = (0..runs).map(|r| (head_of(r)[0] - max).exp()).collect();
            let sum: f32 = (0..runs).map(|r| head_of(r)[1] * weights[r]).sum();
            for (r, w) in weights.iter().enumerate() {
                axpy(out_h, w / sum, &head_of(r)[2..], level);
            }
        }
    }
    out
}

/// Positions `lo..lo + m` of kv head `g` as runs of consecutive rows, one per block they fall
/// in: (index of the run's first position among the `m`, its key rows, its value rows).
fn runs_in_blocks<'a>(
    blocks: &'a [(&'a [f32], &'a [f32])],
    g: usize,
    lo: usize,
    m: usize,
    d: usize,
) -> impl Iterator<Item = (usize, &'a [f32], &'a [f32])> + 'a {
    let mut j = lo;
    std::iter::from_fn(move || {
        if j >= lo + m {
            return None;
        }
        let end = (lo + m).min((j / BLOCK + 1) * BLOCK);
        let rows = (g * BLOCK + j % BLOCK) * d..(g * BLOCK + (end - 1) % BLOCK + 1) * d;
        let (keys, values) = blocks[j / BLOCK];
        let run = (j - lo, &keys[rows.clone()], &values[rows]);
        j = end;
        Some(run)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::signed_values;

    /// Rows of different lengths (inside a run, across runs and blocks, none at all), with and
    /// without a window, in one call: each row's result is the bits it gets alone.
    #[test]
    fn rows_together_give_each_rows_result_alone() {
        let (kv_heads, heads, d) = (3, 9, 16);
        let lens = [1usize, 31, 64, 65, 200, 0, 130];
        let block = kv_heads * BLOCK * d;
        let caches: Vec<(Vec<f32>, Vec<f32>)> = lens
            .iter()
            .enumerate()
            .map(|(r, &len)| {
                let blocks = len.div_ceil(BLOCK).max(1);
                (signed_values(blocks * block, 2 * r as u64), signed_values(blocks * block, 2 * r as u64 + 1))
            })
            .collect();
        let tables: Vec<Vec<(&[f32], &[f32])>> =
            caches.iter().map(|(k, v)| k.chunks_exact(block).zip(v.chunks_exact(block)).collect()).collect();
        let kvs: Vec<KvView> = tables.iter().zip(lens).map(|(blocks, len)| KvView { blocks, kv_heads, head_dim: d, len }).collect();
        let q = signed_values(lens.len() * heads * d, 99);
        for window in [None, Some(40), Some(1)] {
            let together = attend_rows(&q, heads, &kvs, 0.25, window);
            for (r, kv) in kvs.iter().enumerate() {
                let alone = attend_one(&q[r * heads * d..][..heads * d], heads, kv, 0.25, window);
                assert_eq!(together[r * heads * d..][..heads * d], alone[..], "row {r} (len {}), window {window:?}", kv.len);
            }
        }
    }
}
