//! Attention over a sequence's cached keys and values in place, block by block: a decode step's
//! one query by flash-decoding ([`decode`]), a prompt's chunk of queries by tiles with an online
//! softmax ([`prefill`]), neither ever holding a (queries × context) score matrix.

pub mod decode;
pub mod prefill;

/// Positions per block of the cache (the layout these kernels read; the KV cache allocates it).
pub const BLOCK: usize = 64;

/// A layer's cached blocks read in place: `blocks[b]` holds positions `b·BLOCK..`, keys and
/// values each (kv_heads, BLOCK, head_dim); `len` positions are filled.
pub struct KvView<'a> {
    pub blocks: &'a [(&'a [f32], &'a [f32])],
    pub kv_heads: usize,
    pub head_dim: usize,
    pub len: usize,
}
