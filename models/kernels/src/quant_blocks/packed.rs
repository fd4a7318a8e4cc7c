//! The weights' layout for the products: the blocks of 16 consecutive rows interleaved, as
//! llama.cpp repacks Q4_0 into its `block_q4_0x8` and candle its K formats, so that one 512-bit
//! `vpdpbusd` (or two 256-bit AVX2 halves) sums four values of 16 rows at once and the 16
//! results land in 16 lanes: the float work per block is a vector for 16 rows, not a horizontal
//! sum per row.
//!
//! A row group's block `b` is one record, records in order of group, then block:
//! - `d`: the 16 rows' f16 scales (32 bytes);
//! - `m`: their f16 minima (32 bytes; Q4_1 and Q5_1);
//! - `qh`: their 32 fifth bits, each row's u32 as stored (64 bytes; Q5_0 and Q5_1);
//! - `qs`: the values as unsigned bytes `u`, in chunks of 64 bytes holding four values of each
//!   row (row `r` at bytes `4r..4r + 4`). Nibble formats: chunk `l` (of 4) holds values
//!   `4l..4l + 4` in its low nibbles and `16 + 4l..` in its high ones, which is each row's own
//!   `qs[4l..4l + 4]`. Q8_0: chunk `k` (of 8) holds values `4k..4k + 4`, each as `q + 128`.
//!
//! A value is `u - OFFSET` (8 for Q4_0, 16 for Q5_0, 128 for Q8_0, 0 with a minimum), so every
//! weight is an unsigned byte against signed activations, as `vpdpbusd` and `vpmaddubsw` take
//! them, and the offset comes back as `OFFSET · Σx` per block. A record has the bytes of the 16
//! blocks it holds: the layout costs no memory. Rows past the last (a group's padding) are zero
//! bytes; their lanes' results are never written out.

use super::{BlockFormat, BLOCK};

/// Rows per group.
pub const GROUP: usize = 16;

/// Where a format's record keeps each part.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Layout {
    /// Bytes of one record.
    pub record: usize,
    pub m: Option<usize>,
    pub qh: Option<usize>,
    pub qs: usize,
    /// What each stored byte is above its value.
    pub offset: i32,
}

impl Layout {
    pub const fn of(format: BlockFormat) -> Self {
        let (min, fifth) = match format {
            BlockFormat::Q4_0 | BlockFormat::Q8_0 => (false, false),
            BlockFormat::Q4_1 => (true, false),
            BlockFormat::Q5_0 => (false, true),
            BlockFormat::Q5_1 => (true, true),
            BlockFormat::Q4_K | BlockFormat::Q5_K | BlockFormat::Q6_K => panic!("the K formats' layout is k_packed's"),
        };
        let m = if min { Some(32) } else { None };
        let qh_at = 32 + if min { 32 } else { 0 };
        let qh = if fifth { Some(qh_at) } else { None };
        let qs = qh_at + if fifth { 64 } else { 0 };
        let offset = match format {
            BlockFormat::Q4_0 => 8,
            BlockFormat::Q5_0 => 16,
            BlockFormat::Q8_0 => 128,
            _ => 0,
        };
        Self { record: GROUP * format.block_bytes(), m, qh, qs, offset }
    }
}

/// Where the GGUF block keeps its minimum, fifth bits and values (its f16 scale is at 0).
pub(super) fn source_offsets(format: BlockFormat) -> (Option<usize>, Option<usize>, usize) {
    match format {
        BlockFormat::Q4_0 => (None, None, 2),
        BlockFormat::Q4_1 => (Some(2), None, 4),
        BlockFormat::Q5_0 => (None, Some(2), 6),
        BlockFormat::Q5_1 => (Some(2), Some(4), 8),
        BlockFormat::Q8_0 => (None, None, 2),
        BlockFormat::Q4_K | BlockFormat::Q5_K | BlockFormat::Q6_K => unreachable!("the K formats' layout is k_packed's"),
    }
}

/// The records of a `rows` x `cols` matrix from its blocks as the GGUF stores them.
pub(crate) fn pack(format: BlockFormat, rows: usize, cols: usize, bytes: &[u8]) -> Vec<u8> {
    let (layout, bb, blocks) = (Layout::of(format), format.block_bytes(), cols / BLOCK);
    let (m_at, qh_at, qs_at) = source_offsets(format);
    let groups = rows.div_ceil(GROUP);
    let mut out = vec![0u8; groups * blocks * layout.record];
    for (i, rec) in out.chunks_exact_mut(layout.record).enumerate() {
        let (g, b) = (i / blocks, i % blocks);
        for r in 0..GROUP.min(rows - g * GROUP) {
            let src = &bytes[((g * GROUP + r) * blocks + b) * bb..][..bb];
            rec[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
            if let (Some(to), Some(from)) = (layout.m, m_at) {
                rec[to + 2 * r..to + 2 * r + 2].copy_from_slice(&src[from..from + 2]);
            }
            if let (Some(to), Some(from)) = (layout.qh, qh_at) {
                rec[to + 4 * r..to + 4 * r + 4].copy_from_slice(&src[from..from + 4]);
            }
            let chunks = if format == BlockFormat::Q8_0 { 8 } else { 4 };
            for c in 0..chunks {
                let (to, from) = (layout.qs + 64 * c + 4 * r, qs_at + 4 * c);
                for j in 0..4 {
                    // Q8_0's signed bytes as `q + 128`: the top bit flipped.
                    rec[to + j] = if format == BlockFormat::Q8_0 { src[from + j] ^ 0x80 } else { src[from + j] };
                }
            }
        }
    }
    out
}

/// Row `r`'s block in a record, in plain code: its 32 values (offset taken off), scale and
/// minimum (0 without one). The scalar product's reading, and the test of [`pack`].
pub(crate) fn row_block(format: BlockFormat, rec: &[u8], r: usize) -> ([i32; BLOCK], f32, f32) {
    let layout = Layout::of(format);
    let f16_at = |at: usize| half::f16::from_le_bytes([rec[at], rec[at + 1]]).to_f32();
    let mut v = [0i32; BLOCK];
    for (i, x) in v.iter_mut().enumerate() {
        let u = if format == BlockFormat::Q8_0 {
            rec[layout.qs + 64 * (i / 4) + 4 * r + i % 4] as i32
        } else {
            let byte = rec[layout.qs + 64 * (i % 16 / 4) + 4 * r + i % 4];
            let nibble = if i < 16 { byte & 0x0f } else { byte >> 4 } as i32;
            let fifth = layout.qh.map_or(0, |qh| {
                let bits = u32::from_le_bytes(rec[qh + 4 * r..qh + 4 * r + 4].try_into().unwrap());
                ((bits >> i) & 1) as i32
            });
            nibble | fifth << 4
        };
        *x = u - layout.offset;
    }
    (v, f16_at(2 * r), layout.m.map_or(0.0, |m| f16_at(m + 2 * r)))
}
