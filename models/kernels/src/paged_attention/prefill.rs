//! Attention of a chunk of new positions (a prompt, or a piece of one) over the cached blocks,
//! tiled with an online softmax (FlashAttention's forward on the CPU): a work item is one query
//! head and a tile of [`Q_TILE`] of the chunk's positions; it walks the key blocks its positions
//! may see, scoring one (tile × block) piece at a time with a small matrix product and folding
//! it into running per-row maxima, sums and weighted values. Nothing of size (chunk × context)
//! exists at any time: an item holds a (Q_TILE × BLOCK) piece of scores and its own output rows,
//! so an 8,000-token prompt attends in a few megabytes where the whole score matrix of one
//! layer was 2.4 GB.

use super::{KvView, BLOCK};
use crate::disjoint::DisjointWrites;
use crate::exp::{exp_f32, exp_shifted_sum};
use crate::matmul::sgemm;
use crate::pool::for_weight_rows;

/// Query positions per work item.
pub const Q_TILE: usize = 64;

/// `q`: the chunk's queries, (heads, t, d) head-major; they are the last `t` of `kv.len` cached
/// positions. Returns the attention output token-major, (t, heads · d), what o_proj takes.
/// `window`: a query sees at most this many positions, itself included.
pub fn attend_chunk(q: &[f32], heads: usize, t: usize, kv: &KvView, scale: f32, window: Option<usize>) -> Vec<f32> {
    let d = kv.head_dim;
    let group = heads / kv.kv_heads;
    let tiles = t.div_ceil(Q_TILE);
    let first = kv.len - t;
    let width = heads * d;
    // Item (h, tile) owns the rows of its tile in head h's columns of `out`: it attends into a
    // zeroed tile of its own (in cache) and copies the finished rows there. The whole output
    // zeroed up front, and a head-major buffer gathered token-major after, were each a pass over
    // (t × heads · d) on the calling thread alone while the pool's other threads waited.
    let mut out: Vec<f32> = Vec::with_capacity(t * width);
    let dst = DisjointWrites::spare(&mut out, t * width);
    for_weight_rows(heads * tiles, |items| {
        let mut tile_out = vec![0f32; Q_TILE * d];
        for item in items {
            let (h, tile) = (item / tiles, item % tiles);
            let rows = (t - tile * Q_TILE).min(Q_TILE);
            let q_rows = &q[(h * t + tile * Q_TILE) * d..][..rows * d];
            let positions = first + tile * Q_TILE..first + tile * Q_TILE + rows;
            let tile_out = &mut tile_out[..rows * d];
            tile_out.fill(0.0);
            attend_tile(q_rows, positions, h / group, kv, scale, window, tile_out);
            for (i, row) in tile_out.chunks_exact(d).enumerate() {
                let at = (tile * Q_TILE + i) * width + h * d;
                assert!(at + d <= dst.len());
                // SAFETY: row (tile · Q_TILE + i), columns h·d.., belong to item (h, tile) only;
                // written through a pointer, as the buffer's places start uninitialised.
                unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), dst.at(at), d) };
            }
        }
    });
    // SAFETY: the items cover every (row, head) once, and each wrote its d values above.
    unsafe { out.set_len(t * width) };
    out
}

/// The first position query position `p` may see.
fn first_visible(p: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| (p + 1).saturating_sub(w))
}

/// One tile: `q_rows` (rows × d) at `positions`, kv head `g`, into `out` (rows × d).
fn attend_tile(
    q_rows: &[f32],
    positions: std::ops::Range<usize>,
    g: usize,
    kv: &KvView,
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
) {
    let d = kv.head_dim;
    let rows = positions.len();
    let (mut max, mut sum) = ([f32::NEG_INFINITY; Q_TILE], [0f32; Q_TILE]);
    let mut s = [0f32; Q_TILE * BLOCK];
    // The scale goes into the queries once, not into every score (for head_dim 64 or 256 it is
    // a power of two, so the scores are the same bits either way).
    let q_rows: Vec<f32> = q_rows.iter().map(|x| x * scale).collect();
    let (lo, hi) = (first_visible(positions.start, window), positions.end);
    for b in lo / BLOCK..hi.div_ceil(BLOCK) {
        let (keys, values) = kv.blocks[b];
        let cols = (hi - b * BLOCK).min(BLOCK);
        let (k, v) = (&keys[g * BLOCK * d..], &values[g * BLOCK * d..]);
        // s (rows × cols) = q_rows · kᵀ.
        // SAFETY: q_rows holds rows × d values, the block's rows of head g hold BLOCK × d, and s
        // Q_TILE × BLOCK.
        unsafe {
            sgemm(
                rows,
                cols,
                d,
                (s.as_mut_ptr(), 1, cols as isize),
                (q_rows.as_ptr(), 1, d as isize),
                (k.as_ptr(), d as isize, 1),
                0.0,
                1.0,
            );
        }
        for (i, p) in positions.clone().enumerate() {
            let row = &mut s[i * cols..(i + 1) * cols];
            // The keys of this block row i sees: from its window's start to itself.
            let start = first_visible(p, window).saturating_sub(b * BLOCK).min(cols);
            let end = (p + 1).saturating_sub(b * BLOCK).min(cols);
            row[..start].fill(0.0);
            row[end.max(start)..].fill(0.0);
            if start >= end {
                // Nothing of this block visible to row i: weight 0, nothing to rescale.
                continue;
            }
            let visible = &mut row[start..end];
            let block_max = visible.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
            let new_max = max[i].max(block_max);
            let block_sum = exp_shifted_sum(visible, new_max);
            let correction = exp_f32(max[i] - new_max);
            sum[i] = sum[i] * correction + block_sum;
            max[i] = new_max;
            if correction != 1.0 {
                out[i * d..(i + 1) * d].iter_mut().for_each(|o| *o *= correction);
            }
        }
        // out (rows × d) += s (rows × cols) · v (cols × d).
        // SAFETY: as above; v's rows of head g hold BLOCK × d values.
        unsafe {
            sgemm(rows, d, cols, (out.as_mut_ptr(), 1, d as isize), (s.as_ptr(), 1, cols as isize), (v.as_ptr(), 1, d as isize), 1.0, 1.0);
        }
    }
    for (i, o) in out.chunks_exact_mut(d).enumerate() {
        let inv = 1.0 / sum[i];
        o.iter_mut().for_each(|x| *x *= inv);
    }
}
