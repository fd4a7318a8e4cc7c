//! The keys and values of a sequence's past positions, and the decode step's attention over
//! them.
//!
//! Each layer keeps its positions in blocks of [`BLOCK`] (one `(kv_heads, BLOCK, head_dim)`
//! tensor each for keys and values), written in place as tokens come. Appending one token is
//! then a copy of that token, where concatenating onto one growing tensor copied the whole cache
//! at every token and layer (with the GQA repeat and a transpose for the matmul, ~5 copies of
//! it per layer and token: at 4,000 tokens SmolLM2 decoded at a fifth of its speed at 200).
//! A decode step (one query) on the CPU in f32 attends over the blocks in place ([`attend`]:
//! per head, scores by dot products, softmax, values summed with axpy, the heads split over
//! the threads); prefill and other devices take the whole cache as tensors ([`all`]).
//!
//! [`attend`]: LayerKvCache::attend
//! [`all`]: LayerKvCache::all

use candle_core::{DType, Device, Result, Tensor};

use crate::config::ModelConfig;
use crate::ops::attend_rows::{add_weighted_rows, scores};
use crate::ops::cpu_f32_values;
use crate::ops::kernels::{axpy, exp_inplace, for_chunks_mut, SimdLevel};

/// Positions per block.
pub const BLOCK: usize = 64;

/// Positions per work item of the decode step's attention.
const SPLIT: usize = 32;

/// One layer's cached keys and values (batch 1).
#[derive(Debug, Default)]
pub struct LayerKvCache {
    /// (keys, values), each (kv_heads, BLOCK, head_dim), contiguous; positions fill them in order.
    blocks: Vec<(Tensor, Tensor)>,
    len: usize,
}

/// A copy that owns its blocks: blocks are written in place, so sharing them would let one
/// cache's new tokens overwrite the other's.
impl Clone for LayerKvCache {
    fn clone(&self) -> Self {
        let copy = |t: &Tensor| t.copy().expect("copying a KV cache block");
        Self { blocks: self.blocks.iter().map(|(k, v)| (copy(k), copy(v))).collect(), len: self.len }
    }
}

impl LayerKvCache {
    pub fn seq_len(&self) -> usize {
        self.len
    }

    /// Adds the positions of `k` and `v`, each (1, kv_heads, t, head_dim).
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let (b, kv_heads, t, d) = k.dims4()?;
        if b != 1 || v.dims() != k.dims() {
            candle_core::bail!("KV cache: keys {:?} and values {:?} must be (1, kv_heads, t, head_dim) alike", k.dims(), v.dims());
        }
        let mut done = 0;
        while done < t {
            if self.len.is_multiple_of(BLOCK) {
                let zeros = || Tensor::zeros((kv_heads, BLOCK, d), k.dtype(), k.device());
                self.blocks.push((zeros()?, zeros()?));
            }
            let (at, n) = (self.len % BLOCK, (BLOCK - self.len % BLOCK).min(t - done));
            let (bk, bv) = self.blocks.last().expect("pushed above");
            bk.slice_set(&k.narrow(2, done, n)?.squeeze(0)?.contiguous()?, 1, at)?;
            bv.slice_set(&v.narrow(2, done, n)?.squeeze(0)?.contiguous()?, 1, at)?;
            (done, self.len) = (done + n, self.len + n);
        }
        Ok(())
    }

    /// Every cached position's keys and values, (1, kv_heads, len, head_dim) each (a copy).
    pub fn all(&self) -> Result<(Tensor, Tensor)> {
        let part = |i: usize, t: &Tensor| t.narrow(1, 0, (self.len - i * BLOCK).min(BLOCK));
        let keys: Vec<Tensor> = self.blocks.iter().enumerate().map(|(i, (k, _))| part(i, k)).collect::<Result<_>>()?;
        let values: Vec<Tensor> = self.blocks.iter().enumerate().map(|(i, (_, v))| part(i, v)).collect::<Result<_>>()?;
        Ok((Tensor::cat(&keys, 1)?.unsqueeze(0)?, Tensor::cat(&values, 1)?.unsqueeze(0)?))
    }

    /// Attention of one query `q` (1, heads, 1, head_dim), at the last cached position, over the
    /// cached positions it may see (the last `window` of them when a sliding window is set):
    /// (1, heads, 1, head_dim). `None` when the call is not for this kernel (not f32 on the CPU):
    /// the caller then attends over [`LayerKvCache::all`].
    pub fn attend(&self, q: &Tensor, scale: f64, window: Option<usize>) -> Result<Option<Tensor>> {
        let cpu_f32 = |t: &Tensor| matches!(t.device(), Device::Cpu) && t.dtype() == DType::F32;
        if !cpu_f32(q) || self.blocks.first().is_none_or(|(k, _)| !cpu_f32(k)) || q.track_op() {
            return Ok(None);
        }
        let (_, heads, _, d) = q.dims4()?;
        let kv_heads = self.blocks[0].0.dim(0)?;
        let group = heads / kv_heads;
        let start = window.map_or(0, |w| self.len.saturating_sub(w));
        let q = q.flatten_all()?.to_vec1::<f32>()?;
        let guards: Vec<_> = self.blocks.iter().map(|(k, v)| (k.storage_and_layout(), v.storage_and_layout())).collect();
        let blocks: Vec<(&[f32], &[f32])> =
            guards.iter().map(|((k, kl), (v, vl))| Ok((cpu_f32_values(k, kl)?, cpu_f32_values(v, vl)?))).collect::<Result<_>>()?;
        // Flash-decoding: the work items are (kv head, run of SPLIT positions), so the threads
        // share the work evenly however few kv heads there are, and each key and value row is
        // read once for the query heads of its group. Each item keeps, per query head, its
        // scores' max, the sum of their exponentials and the values weighted by those (not yet
        // divided); the items of a head are merged after.
        let level = SimdLevel::current();
        let (n, scale) = (self.len - start, scale as f32);
        let runs = n.div_ceil(SPLIT);
        let item = group * (d + 2);
        let mut partial = vec![0f32; kv_heads * runs * item];
        for_chunks_mut(&mut partial, item, |i, part| {
            let (g, lo) = (i / runs, start + (i % runs) * SPLIT);
            let m = SPLIT.min(self.len - lo);
            let mut p = [0f32; SPLIT];
            for (qi, head) in part.chunks_exact_mut(d + 2).enumerate() {
                let q_h = &q[(g * group + qi) * d..][..d];
                let p = &mut p[..m];
                for (at, keys, _) in runs_in_blocks(&blocks, g, lo, m, d) {
                    scores(q_h, keys, scale, &mut p[at..at + keys.len() / d], level);
                }
                let max = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                p.iter_mut().for_each(|s| *s -= max);
                exp_inplace(p);
                let (stats, out_h) = head.split_at_mut(2);
                stats[0] = max;
                stats[1] = p.iter().sum();
                for (at, _, values) in runs_in_blocks(&blocks, g, lo, m, d) {
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
        Ok(Some(Tensor::from_vec(out, (1, heads, 1, d), &Device::Cpu)?))
    }
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

/// The KV caches of all layers of one sequence.
#[derive(Debug, Clone)]
pub struct KvCache {
    pub layers: Vec<LayerKvCache>,
}

impl KvCache {
    pub fn new(cfg: &ModelConfig) -> Self {
        Self { layers: (0..cfg.num_hidden_layers).map(|_| LayerKvCache::default()).collect() }
    }

    /// Number of positions already cached.
    pub fn seq_len(&self) -> usize {
        self.layers.first().map(LayerKvCache::seq_len).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::rng::random_tensor as data;

    /// softmax(q Kᵀ · scale) V over the visible positions, by candle's ops on `all()`.
    fn by_candle_ops(cache: &LayerKvCache, q: &Tensor, scale: f64, window: Option<usize>) -> Tensor {
        let (k, v) = cache.all().unwrap();
        let (heads, kv_heads) = (q.dim(1).unwrap(), k.dim(1).unwrap());
        let start = window.map_or(0, |w| cache.seq_len().saturating_sub(w));
        let n = cache.seq_len() - start;
        let rep = |t: Tensor| {
            let t = t.narrow(2, start, n).unwrap();
            let (b, g, n, d) = t.dims4().unwrap();
            t.unsqueeze(2).unwrap().expand((b, g, heads / kv_heads, n, d)).unwrap().reshape((b, heads, n, d)).unwrap()
        };
        let scores = (q.matmul(&rep(k).t().unwrap()).unwrap() * scale).unwrap();
        candle_nn::ops::softmax_last_dim(&scores).unwrap().matmul(&rep(v)).unwrap()
    }

    /// Appends in pieces that straddle block boundaries (1, 63, 2, 70, then single tokens), GQA
    /// (6 query heads over 2 kv heads), with and without a sliding window: the in-place kernel
    /// equals candle's ops on the gathered cache, and `all()` returns what was appended.
    #[test]
    fn attend_matches_candle_ops_across_blocks() {
        let (kv_heads, heads, d) = (2, 6, 16);
        let mut cache = LayerKvCache::default();
        let (mut keys, mut seed) = (vec![], 1);
        for t in [1, 63, 2, 70, 1, 1, 1] {
            let (k, v) = (data(&[1, kv_heads, t, d], seed), data(&[1, kv_heads, t, d], seed + 1));
            seed += 2;
            cache.append(&k, &v).unwrap();
            keys.push(k);
            let q = data(&[1, heads, 1, d], seed);
            for window in [None, Some(5), Some(100)] {
                let got = cache.attend(&q, 0.25, window).unwrap().expect("f32 on the CPU takes the kernel");
                let want = by_candle_ops(&cache, &q, 0.25, window);
                let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(diff < 1e-5, "after {} positions, window {window:?}: off by {diff}", cache.seq_len());
            }
        }
        assert_eq!(cache.seq_len(), 139);
        let all_keys = cache.all().unwrap().0;
        let diff = (all_keys - Tensor::cat(&keys, 2).unwrap()).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(diff, 0.0);
        // A clone owns its blocks: what each appends next stays its own.
        let mut copy = cache.clone();
        let (mine, theirs) = (data(&[1, kv_heads, 1, d], 99), data(&[1, kv_heads, 1, d], 98));
        cache.append(&mine, &mine).unwrap();
        copy.append(&theirs, &theirs).unwrap();
        let last = |c: &LayerKvCache| c.all().unwrap().0.narrow(2, 139, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(last(&cache), mine.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        assert_eq!(last(&copy), theirs.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    }
}
