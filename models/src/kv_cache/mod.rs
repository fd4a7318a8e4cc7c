//! The keys and values of a sequence's past positions, and attention over them in place.
//!
//! Each layer keeps its positions in blocks of [`BLOCK`] (one `(kv_heads, BLOCK, head_dim)`
//! tensor each for keys and values), written in place as tokens come. Appending one token is
//! then a copy of that token, where concatenating onto one growing tensor copied the whole cache
//! at every token and layer (with the GQA repeat and a transpose for the matmul, ~5 copies of
//! it per layer and token: at 4,000 tokens SmolLM2 decoded at a fifth of its speed at 200).
//! On the CPU in f32 queries attend over the blocks in place ([`attend`]): a decode step's one
//! query by flash-decoding, a prompt's chunk of queries by tiles with an online softmax
//! (`ops::kv_attention`), neither ever holding a (queries × context) score matrix; on a GPU one
//! query attends over the blocks in place too (`ops::flash_attention`'s decode kernel). Other
//! devices, dtypes and prompts take the whole cache as tensors ([`all`]).
//!
//! [`attend`]: LayerKvCache::attend
//! [`all`]: LayerKvCache::all

use std::collections::VecDeque;

use candle_core::{DType, Device, Result, Shape, Tensor};

use crate::config::ModelConfig;

/// Positions per block (the layout the attention kernels read).
pub use kernels::paged_attention::BLOCK;

/// One layer's cached keys and values (batch 1).
#[derive(Debug, Default)]
pub struct LayerKvCache {
    /// (keys, values), each (kv_heads, BLOCK, head_dim), contiguous; positions fill them in order.
    blocks: Vec<(Tensor, Tensor)>,
    len: usize,
    /// Blocks made ready by [`KvCache::reserve`] (views of one allocation per block for all
    /// layers), taken in order as positions need them.
    ready: VecDeque<(Tensor, Tensor)>,
}

/// A copy that owns the block it may still write: a partly filled last block is written in
/// place as tokens come, so sharing it would let one cache's new tokens overwrite the other's.
/// Full blocks are never written again and are shared (tensors are reference-counted).
impl Clone for LayerKvCache {
    fn clone(&self) -> Self {
        let full = self.len / BLOCK;
        let copy = |t: &Tensor| t.copy().expect("copying a KV cache block");
        let blocks = self.blocks.iter().enumerate().map(|(i, (k, v))| if i < full { (k.clone(), v.clone()) } else { (copy(k), copy(v)) });
        Self { blocks: blocks.collect(), len: self.len, ready: VecDeque::new() }
    }
}

/// One full block's positions in every layer, shared between caches (prefix caching): per
/// layer (keys, values), each (kv_heads, BLOCK, head_dim). Never written again.
#[derive(Debug, Clone)]
pub struct SharedBlock {
    layers: Vec<(Tensor, Tensor)>,
}

impl SharedBlock {
    /// Memory its tensors hold.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes()).sum()
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
            self.open_block((kv_heads, d), k.dtype(), k.device())?;
            let (at, n) = (self.len % BLOCK, (BLOCK - self.len % BLOCK).min(t - done));
            let (bk, bv) = self.blocks.last().expect("pushed above");
            bk.slice_set(&k.narrow(2, done, n)?.squeeze(0)?.contiguous()?, 1, at)?;
            bv.slice_set(&v.narrow(2, done, n)?.squeeze(0)?.contiguous()?, 1, at)?;
            (done, self.len) = (done + n, self.len + n);
        }
        Ok(())
    }

    /// Counts one more position without writing it, its block made ready: for a kernel that
    /// writes the position's keys and values into [`Self::blocks`] itself (a GPU's decoding).
    pub fn grow(&mut self, (kv_heads, head_dim): (usize, usize), dtype: DType, device: &Device) -> Result<()> {
        self.open_block((kv_heads, head_dim), dtype, device)?;
        self.len += 1;
        Ok(())
    }

    /// A new block when the next position starts one: a ready block of this shape, else zeros.
    fn open_block(&mut self, (kv_heads, d): (usize, usize), dtype: DType, device: &Device) -> Result<()> {
        if !self.len.is_multiple_of(BLOCK) {
            return Ok(());
        }
        let fits = |(rk, _): &(Tensor, Tensor)| rk.dims() == [kv_heads, BLOCK, d] && rk.dtype() == dtype;
        let block = match self.ready.pop_front() {
            Some(block) if fits(&block) => block,
            _ => {
                let zeros = || Tensor::zeros((kv_heads, BLOCK, d), dtype, device);
                (zeros()?, zeros()?)
            }
        };
        self.blocks.push(block);
        Ok(())
    }

    /// The blocks of keys and values, each (kv_heads, BLOCK, head_dim), positions in order.
    pub fn blocks(&self) -> &[(Tensor, Tensor)] {
        &self.blocks
    }

    /// Every cached position's keys and values, (1, kv_heads, len, head_dim) each (a copy).
    pub fn all(&self) -> Result<(Tensor, Tensor)> {
        let part = |i: usize, t: &Tensor| t.narrow(1, 0, (self.len - i * BLOCK).min(BLOCK));
        let keys: Vec<Tensor> = self.blocks.iter().enumerate().map(|(i, (k, _))| part(i, k)).collect::<Result<_>>()?;
        let values: Vec<Tensor> = self.blocks.iter().enumerate().map(|(i, (_, v))| part(i, v)).collect::<Result<_>>()?;
        Ok((Tensor::cat(&keys, 1)?.unsqueeze(0)?, Tensor::cat(&values, 1)?.unsqueeze(0)?))
    }

    /// Attention of the newest `t` positions' queries `q` (1, heads, t, head_dim) over the
    /// cached positions each may see (itself and those before it; the last `window` of them
    /// when a sliding window is set): (1, t, heads · head_dim), token-major. `None` when the call
    /// is not for these kernels (f32 on the CPU; one query in bf16 or f16 on a GPU): the caller
    /// then attends over [`LayerKvCache::all`]. One query takes a decode kernel, more the tiled
    /// prefill.
    pub fn attend(&self, q: &Tensor, scale: f64, window: Option<usize>) -> Result<Option<Tensor>> {
        ops::kv_attention::attend(q, &self.blocks, self.len, scale, window)
    }
}

/// Values a thread zeroes at a time when a CPU block is made (64 KiB).
const ZEROING_PIECE: usize = 1 << 14;

/// The KV caches of all layers of one sequence.
#[derive(Debug, Clone)]
pub struct KvCache {
    pub layers: Vec<LayerKvCache>,
    /// The shape of a block ([`Self::reserve`]).
    kv_heads: usize,
    head_dim: usize,
}

impl KvCache {
    pub fn new(cfg: &ModelConfig) -> Self {
        let layers = (0..cfg.num_hidden_layers).map(|_| LayerKvCache::default()).collect();
        Self { layers, kv_heads: cfg.num_key_value_heads, head_dim: cfg.head_dim }
    }

    /// A cache whose first positions are `blocks` (BLOCK positions each, in order), shared with
    /// whoever else holds them, not copied.
    pub fn from_shared(cfg: &ModelConfig, blocks: &[SharedBlock]) -> Result<Self> {
        if let Some(b) = blocks.iter().find(|b| b.layers.len() != cfg.num_hidden_layers) {
            candle_core::bail!("a shared KV block of {} layers for a model of {}", b.layers.len(), cfg.num_hidden_layers);
        }
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| LayerKvCache {
                blocks: blocks.iter().map(|b| b.layers[i].clone()).collect(),
                len: blocks.len() * BLOCK,
                ready: VecDeque::new(),
            })
            .collect();
        Ok(Self { layers, kv_heads: cfg.num_key_value_heads, head_dim: cfg.head_dim })
    }

    /// Makes blocks ready for `new` more positions in every layer, each block one allocation
    /// for all layers' keys and values: a block kept by a prefix cache then holds whole pages
    /// of memory, where per-layer blocks (a few KiB each) interleaved with those of other
    /// sequences kept partly used allocator pages alive after their neighbours were freed (an
    /// idle server stayed ~100 MiB above its cache's budget). Layers take them as they append.
    pub fn reserve(&mut self, new: usize, dtype: DType, device: &Device) -> Result<()> {
        let Some(first) = self.layers.first() else { return Ok(()) };
        let have = first.blocks.len() + first.ready.len();
        let need = (first.len + new).div_ceil(BLOCK).saturating_sub(have);
        let shape = Shape::from((self.layers.len(), 2, self.kv_heads, BLOCK, self.head_dim));
        for _ in 0..need {
            let all = match (dtype, device) {
                // Zeroed by the pool's threads, each its piece: a new block is megabytes of
                // fresh pages, whose first touches (page faults) the calling thread otherwise
                // took alone while the others waited for the step's next product.
                (DType::F32, Device::Cpu) => {
                    Tensor::from_vec(kernels::pool::pool_new(shape.elem_count(), ZEROING_PIECE, |_, _| {}), shape.clone(), device)?
                }
                _ => Tensor::zeros(shape.clone(), dtype, device)?,
            };
            for (i, layer) in self.layers.iter_mut().enumerate() {
                let kv = all.get(i)?;
                layer.ready.push_back((kv.get(0)?, kv.get(1)?));
            }
        }
        Ok(())
    }

    /// Blocks every one of whose BLOCK positions is cached.
    pub fn full_blocks(&self) -> usize {
        self.seq_len() / BLOCK
    }

    /// Full block `b` (< [`Self::full_blocks`]) of every layer, shared.
    pub fn shared_block(&self, b: usize) -> SharedBlock {
        assert!(b < self.full_blocks(), "block {b} of a cache with {} full blocks", self.full_blocks());
        SharedBlock { layers: self.layers.iter().map(|l| l.blocks[b].clone()).collect() }
    }

    /// Number of positions already cached.
    pub fn seq_len(&self) -> usize {
        self.layers.first().map(LayerKvCache::seq_len).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    use ops::testing::random_tensor as data;

    /// `grow` counts a position and opens its block when it starts one, writing nothing: what
    /// was appended stays, and the new block is there for a kernel to write.
    #[test]
    fn grow_counts_a_position_and_opens_its_block() {
        let dev = Device::Cpu;
        let (kv_heads, d) = (2, 4);
        let mut cache = LayerKvCache::default();
        let (k, v) = (data(&[1, kv_heads, BLOCK - 1, d], 1), data(&[1, kv_heads, BLOCK - 1, d], 2));
        cache.append(&k, &v).unwrap();
        cache.grow((kv_heads, d), DType::F32, &dev).unwrap();
        assert_eq!((cache.seq_len(), cache.blocks().len()), (BLOCK, 1));
        cache.grow((kv_heads, d), DType::F32, &dev).unwrap();
        assert_eq!((cache.seq_len(), cache.blocks().len()), (BLOCK + 1, 2));
        assert_eq!(cache.blocks()[1].0.dims(), [kv_heads, BLOCK, d]);
        let (all_k, _) = cache.all().unwrap();
        let kept = all_k.narrow(2, 0, BLOCK - 1).unwrap();
        assert_eq!(kept.flatten_all().unwrap().to_vec1::<f32>().unwrap(), k.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    }

    /// softmax(q Kᵀ · scale + mask) V for the newest `t` positions' queries q (1, heads, t, d),
    /// by candle's ops on `all()` with the model's causal mask: (1, t, heads · d).
    fn by_candle_ops(cache: &LayerKvCache, q: &Tensor, scale: f64, window: Option<usize>) -> Tensor {
        let (k, v) = cache.all().unwrap();
        let (_, heads, t, d) = q.dims4().unwrap();
        let kv_heads = k.dim(1).unwrap();
        let rep = |x: Tensor| {
            let (b, g, n, d) = x.dims4().unwrap();
            x.unsqueeze(2).unwrap().expand((b, g, heads / kv_heads, n, d)).unwrap().reshape((b, heads, n, d)).unwrap()
        };
        let scores = (q.matmul(&rep(k).t().unwrap()).unwrap() * scale).unwrap();
        let scores = match crate::masks::causal_mask(t, cache.seq_len() - t, window, DType::F32, &Device::Cpu).unwrap() {
            Some(mask) => scores.broadcast_add(&mask).unwrap(),
            None => scores,
        };
        let out = candle_nn::ops::softmax_last_dim(&scores).unwrap().matmul(&rep(v)).unwrap();
        out.transpose(1, 2).unwrap().reshape((1, t, heads * d)).unwrap()
    }

    /// Prompts fed in chunks of several sizes (one query, within a tile, across tiles and
    /// blocks), GQA, with and without a sliding window: the tiled kernel equals candle's ops
    /// with the causal mask, for every query of every chunk.
    #[test]
    fn chunks_attend_as_candle_ops_with_the_causal_mask() {
        let (kv_heads, heads, d) = (3, 9, 64);
        for chunks in [&[200][..], &[1, 63, 2, 130], &[64, 64, 5], &[7, 1, 150]] {
            let (mut cache, mut seed) = (LayerKvCache::default(), 10);
            for &t in chunks {
                let (k, v) = (data(&[1, kv_heads, t, d], seed), data(&[1, kv_heads, t, d], seed + 1));
                let q = (data(&[1, heads, t, d], seed + 2) * 3.0).unwrap();
                seed += 3;
                cache.append(&k, &v).unwrap();
                for window in [None, Some(5), Some(100)] {
                    let got = cache.attend(&q, 0.125, window).unwrap().expect("f32 on the CPU takes the kernel");
                    let want = by_candle_ops(&cache, &q, 0.125, window);
                    let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                    assert!(
                        diff < 1e-5,
                        "chunks {chunks:?}, {t} queries after {} positions, window {window:?}: off by {diff}",
                        cache.seq_len()
                    );
                }
            }
        }
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
