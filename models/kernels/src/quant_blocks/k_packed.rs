//! The K formats (Q4_K, Q5_K, Q6_K: 256-value super-blocks whose sub-blocks each carry a scale
//! of their own) laid out for the products as `packed` lays out the 32-value formats: 16 rows
//! interleaved, so that the kernels sum four values of 8 rows at once and the float work lands
//! in one lane a row.
//!
//! A row group's super-block `s` is one record: the 16 rows' f16 `d` (32 bytes), for Q4_K and
//! Q5_K their f16 `dmin` (32 bytes), then the super-block's 8 blocks of 32 values, each:
//! - Q4_K and Q5_K: `sc` and `m`, each row's 6-bit scale and minimum of the block (a byte a
//!   row: 16 + 16 bytes), for Q5_K `qh` (each row's u32 of fifth bits, as in `packed`), then
//!   `qs` as in `packed` (chunk `l` of 4 holds values `4l..4l + 4` of every row in its low
//!   nibbles and `16 + 4l..` in its high ones, row `r` at bytes `4r..4r + 4`);
//! - Q6_K: `sc`, each row's signed scale of values 0..16 (16 bytes), then of values 16..32
//!   (16 bytes); `qh`, the two top bits of values 0..16 (64 bytes, row `r` at `4r..4r + 4`,
//!   whose byte `i` holds those of values `4l + i` at bits `2l, 2l + 1`), then likewise of
//!   values 16..32 (64 bytes); then `qs` with their four low bits, as above.
//!
//! A value is `d · sc · u - dmin · m` (Q4_K, Q5_K; `u` the 4- or 5-bit value) or
//! `d · sc · (u - 32)` (Q6_K; `u` 6 bits), with its block's (Q6_K: its half block's) `sc`, `m`.
//! The 6-bit scales are unpacked to a byte each at load: a record is 4 bytes a row larger
//! than the GGUF's super-block for Q4_K and Q5_K (148 and 180 bytes against 144 and 176), the
//! same size for Q6_K (210).

use super::packed::GROUP;
use super::{BlockFormat, BLOCK};

/// Values per super-block.
pub const SUPER: usize = 256;
/// Blocks of 32 per super-block.
pub const BLOCKS: usize = SUPER / BLOCK;

/// Where a K format's record keeps each part.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KLayout {
    /// Bytes of one super-block record.
    pub record: usize,
    /// Whether the record has `dmin` (Q4_K, Q5_K) after `d`.
    pub dmin: bool,
    /// Where the first block starts, and bytes of a block.
    pub header: usize,
    pub block: usize,
    /// Within a block: the fifth bits (Q5_K) or two top bits (Q6_K), and the low four bits.
    pub qh: Option<usize>,
    pub qs: usize,
}

impl KLayout {
    pub const fn of(format: BlockFormat) -> Self {
        let (dmin, qh_bytes) = match format {
            BlockFormat::Q4_K => (true, 0),
            BlockFormat::Q5_K => (true, 64),
            BlockFormat::Q6_K => (false, 128),
            _ => panic!("not a K format"),
        };
        let header = if dmin { 64 } else { 32 };
        // The scales (and minima, or second scales): 2 x 16 bytes.
        let qh = if qh_bytes > 0 { Some(32) } else { None };
        let qs = 32 + qh_bytes;
        let block = qs + 4 * 64;
        Self { record: header + BLOCKS * block, dmin, header, block, qh, qs }
    }
}

/// One row's super-block from the GGUF, unpacked: the f16 `d` and `dmin` as stored, each
/// value's unsigned `u`, and the scales (Q6_K: 16, one per 16 values; else 8) and minima.
struct SuperBlock {
    d: [u8; 2],
    dmin: [u8; 2],
    u: [u8; SUPER],
    scales: [i32; 16],
    mins: [i32; BLOCKS],
}

/// ggml's `get_scale_min_k4`: block `j`'s 6-bit scale and minimum from the 12 packed bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (i32, i32) {
    if j < 4 {
        ((q[j] & 63) as i32, (q[j + 4] & 63) as i32)
    } else {
        (((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4)) as i32, ((q[j + 4] >> 4) | ((q[j] >> 6) << 4)) as i32)
    }
}

/// A GGUF super-block of `format` (ggml's `block_q4_K`, `block_q5_K`, `block_q6_K`), unpacked as
/// ggml's `dequantize_row_q*_K` reads it.
fn unpack(format: BlockFormat, b: &[u8]) -> SuperBlock {
    let mut sb = SuperBlock { d: [0; 2], dmin: [0; 2], u: [0; SUPER], scales: [0; 16], mins: [0; BLOCKS] };
    match format {
        BlockFormat::Q4_K | BlockFormat::Q5_K => {
            // d, dmin, scales[12], (Q5_K: qh[32]), qs[128].
            sb.d.copy_from_slice(&b[0..2]);
            sb.dmin.copy_from_slice(&b[2..4]);
            for j in 0..BLOCKS {
                (sb.scales[j], sb.mins[j]) = scale_min_k4(j, &b[4..16]);
            }
            let (qh, qs) = if format == BlockFormat::Q5_K { (&b[16..48], &b[48..176]) } else { (&[0u8; 32][..], &b[16..144]) };
            // Each 64 values: 32 bytes, low nibbles first, then high ones; the fifth bit of
            // value `v` is bit `v / 32` of `qh[v % 32]`.
            for j in 0..4 {
                for l in 0..BLOCK {
                    let (byte, high) = (qs[32 * j + l], qh[l] >> (2 * j));
                    sb.u[64 * j + l] = (byte & 0xf) | (high & 1) << 4;
                    sb.u[64 * j + 32 + l] = (byte >> 4) | (high & 2) << 3;
                }
            }
        }
        BlockFormat::Q6_K => {
            // ql[128], qh[64], scales[16] (i8), d.
            let (ql, qh) = (&b[0..128], &b[128..192]);
            for (j, s) in sb.scales.iter_mut().enumerate() {
                *s = b[192 + j] as i8 as i32;
            }
            sb.d.copy_from_slice(&b[208..210]);
            // Each 128 values: 64 bytes of ql and 32 of qh; the four quarters of 32 values take
            // ql[l] low, ql[32 + l] low, ql[l] high, ql[32 + l] high, and qh[l]'s bits 0-1,
            // 2-3, 4-5, 6-7.
            for half in 0..2 {
                let (ql, qh, u) = (&ql[64 * half..], &qh[32 * half..], &mut sb.u[128 * half..]);
                for l in 0..BLOCK {
                    let (first, second, h) = (ql[l], ql[32 + l], qh[l]);
                    u[l] = (first & 0xf) | (h & 3) << 4;
                    u[32 + l] = (second & 0xf) | (h >> 2 & 3) << 4;
                    u[64 + l] = (first >> 4) | (h >> 4 & 3) << 4;
                    u[96 + l] = (second >> 4) | (h >> 6) << 4;
                }
            }
        }
        _ => unreachable!("not a K format"),
    }
    sb
}

/// The records of a `rows` x `cols` matrix from its super-blocks as the GGUF stores them; the
/// row groups on the pool's threads (a model's load unpacks every super-block).
pub(crate) fn pack(format: BlockFormat, rows: usize, cols: usize, bytes: &[u8]) -> Vec<u8> {
    let (layout, supers) = (KLayout::of(format), cols / SUPER);
    let mut out = vec![0u8; rows.div_ceil(GROUP) * supers * layout.record];
    crate::pool::pool_chunks_mut(&mut out, supers * layout.record, |g, group| {
        for (s, rec) in group.chunks_exact_mut(layout.record).enumerate() {
            for r in 0..GROUP.min(rows - g * GROUP) {
                let bb = format.block_bytes();
                let sb = unpack(format, &bytes[((g * GROUP + r) * supers + s) * bb..][..bb]);
                put_row(format, &layout, rec, r, &sb);
            }
        }
    });
    out
}

/// Row `r`'s super-block `sb` into its group's record `rec`.
fn put_row(format: BlockFormat, layout: &KLayout, rec: &mut [u8], r: usize, sb: &SuperBlock) {
    rec[2 * r..2 * r + 2].copy_from_slice(&sb.d);
    if layout.dmin {
        rec[32 + 2 * r..32 + 2 * r + 2].copy_from_slice(&sb.dmin);
    }
    for j in 0..BLOCKS {
        let blk = &mut rec[layout.header + j * layout.block..][..layout.block];
        let u = &sb.u[BLOCK * j..BLOCK * (j + 1)];
        if format == BlockFormat::Q6_K {
            blk[r] = sb.scales[2 * j] as i8 as u8;
            blk[16 + r] = sb.scales[2 * j + 1] as i8 as u8;
        } else {
            blk[r] = sb.scales[j] as u8;
            blk[16 + r] = sb.mins[j] as u8;
        }
        for c in 0..4 {
            for i in 0..4 {
                blk[layout.qs + 64 * c + 4 * r + i] = (u[4 * c + i] & 0xf) | (u[16 + 4 * c + i] & 0xf) << 4;
            }
        }
        match (format, layout.qh) {
            (BlockFormat::Q5_K, Some(qh)) => {
                let bits = (0..BLOCK).fold(0u32, |acc, t| acc | (((u[t] >> 4) & 1) as u32) << t);
                blk[qh + 4 * r..qh + 4 * r + 4].copy_from_slice(&bits.to_le_bytes());
            }
            (BlockFormat::Q6_K, Some(qh)) => {
                for (half, at) in [(0, qh), (16, qh + 64)] {
                    for i in 0..4 {
                        blk[at + 4 * r + i] = (0..4).fold(0u8, |acc, l| acc | ((u[half + 4 * l + i] >> 4) & 3) << (2 * l));
                    }
                }
            }
            _ => {}
        }
    }
}

/// Row `r`'s block `j` in a super-block record, in plain code: its 32 values with their
/// scales (`sc · u`, or `sc · (u - 32)` for Q6_K), the super-block's `d`, and the minimum's
/// term `-dmin · m` (0 for Q6_K): the block's dot product with an activation block is then
/// `d · d_x · Σ v q + m · d_x · Σq`. The scalar product's reading, and the test of [`pack`].
pub(crate) fn row_block(format: BlockFormat, rec: &[u8], j: usize, r: usize) -> ([i32; BLOCK], f32, f32) {
    let layout = KLayout::of(format);
    let f16_at = |at: usize| half::f16::from_le_bytes([rec[at], rec[at + 1]]).to_f32();
    let blk = &rec[layout.header + j * layout.block..][..layout.block];
    let mut v = [0i32; BLOCK];
    for (i, x) in v.iter_mut().enumerate() {
        let byte = blk[layout.qs + 64 * (i % 16 / 4) + 4 * r + i % 4];
        let nibble = if i < 16 { byte & 0xf } else { byte >> 4 } as i32;
        *x = match format {
            BlockFormat::Q6_K => {
                let top = (blk[32 + 64 * (i / 16) + 4 * r + i % 4] >> (2 * (i % 16 / 4))) & 3;
                blk[16 * (i / 16) + r] as i8 as i32 * ((nibble | (top as i32) << 4) - 32)
            }
            _ => {
                let fifth = layout.qh.map_or(0, |qh| (u32::from_le_bytes(blk[qh + 4 * r..qh + 4 * r + 4].try_into().unwrap()) >> i) & 1);
                blk[r] as i32 * (nibble | (fifth as i32) << 4)
            }
        };
    }
    let m = if layout.dmin { -(f16_at(32 + 2 * r) * blk[16 + r] as f32) } else { 0.0 };
    (v, f16_at(2 * r), m)
}

/// The 256 values of a GGUF super-block as ggml dequantises them (`d · sc · u - dmin · m` in
/// f32), for tests against the packed reading.
#[cfg(test)]
pub(crate) fn dequantize(format: BlockFormat, b: &[u8]) -> Vec<f32> {
    let sb = unpack(format, b);
    let f = |h: [u8; 2]| half::f16::from_le_bytes(h).to_f32();
    let (d, dmin) = (f(sb.d), f(sb.dmin));
    (0..SUPER)
        .map(|v| match format {
            BlockFormat::Q6_K => d * sb.scales[v / 16] as f32 * (sb.u[v] as i32 - 32) as f32,
            _ => d * sb.scales[v / BLOCK] as f32 * sb.u[v] as f32 - dmin * sb.mins[v / BLOCK] as f32,
        })
        .collect()
}
