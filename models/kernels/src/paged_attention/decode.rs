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
    let (d, kv_heads, len, blocks) = (kv.head_dim, kv.kv_heads, kv.len, kv.blocks);
    let group = heads / kv_heads;
    let start = window.map_or(0, |w| len.saturating_sub(w));
    let level = SimdLevel::current();
    let runs = (len - start).div_ceil(SPLIT);
    let item = group * (d + 2);
    let mut partial = vec![0f32; kv_heads * runs * item];
    for_chunks_mut(&mut partial, item, |i, part| {
        let (g, lo) = (i / runs, start + (i % runs) * SPLIT);
        let m = SPLIT.min(len - lo);
        let mut p = [0f32; SPLIT];
        for (qi, head) in part.chunks_exact_mut(d + 2).enumerate() {
            let q_h = &q[(g * group + qi) * d..][..d];
            let p = &mut p[..m];
            for (at, keys, _) in runs_in_blocks(blocks, g, lo, m, d) {
                scores(q_h, keys, scale, &mut p[at..at + keys.len() / d], level);
            }
            let max = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            p.iter_mut().for_each(|s| *s -= max);
            exp_inplace(p);
            let (stats, out_h) = head.split_at_mut(2);
            stats[0] = max;
            stats[1] = p.iter().sum();
            for (at, _, values) in runs_in_blocks(blocks, g, lo, m, d) {
                add_weighted_rows(out_h, &p[at..at + values.len() / d], values, level);
            }
        }
    });
    let mut out = vec![0f32; heads * d];
    for (h, out_h) in out.chunks_exact_mut(d).enumerate() {
        let (g, qi) = (h / group, h % group);
        let head_of = |r: usize| &partial[(g * runs + r) * item + qi * (d + 2)..][..d + 2];
        let max = (0..runs).map(|r| head_of(r)[0]).fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f32> = (0..runs).map(|r| (head_of(r)[0] - max).exp()).collect();
        let sum: f32 = (0..runs).map(|r| head_of(r)[1] * weights[r]).sum();
        for (r, w) in weights.iter().enumerate() {
            axpy(out_h, w / sum, &head_of(r)[2..], level);
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
