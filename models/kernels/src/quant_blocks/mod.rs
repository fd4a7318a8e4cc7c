//! `x @ Wᵀ` over llama.cpp's 32-value block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): the formats
//! candle has no AVX2 dot product for (Q4_1, Q5_0, Q5_1 run its scalar loop, ~7x slower than
//! llama.cpp) and the two it has, so that all of them share one layout and threading scheme.
//!
//! As in llama.cpp, each row of activations is quantised once to 8 bits per value in blocks of 32
//! (a scale `d` and, for the formats with a minimum, `s = d · Σq`), and every weight block's dot
//! product is an integer one: `Σ w_q · x_q` scaled by `d_w · d_x`, plus `m_w · s_x` for the
//! formats whose values are `d · q + m`. Scales are rounded to f16 where llama.cpp stores them in
//! f16, so both round alike. The weights are repacked at load, 16 rows' blocks interleaved
//! (`packed`), so that the kernels (`tiles`) work on 16 rows at once. The weight rows are split
//! over the threads in groups of 16; every thread runs all of a call's activation rows against
//! its weight rows (decoding's one row and a prompt's many).

mod packed;
#[cfg(target_arch = "x86_64")]
mod tiles;
#[cfg(target_arch = "x86_64")]
mod x86;

use half::f16;

use crate::disjoint::DisjointWrites;
use crate::pool::{for_rows_of_many, pool_map};
use crate::simd::{Int8Kernel, Kernels, SimdLevel};

/// Values per block in every format here.
pub const BLOCK: usize = 32;

/// A block format: its ggml layout (all little endian, f16 scales first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockFormat {
    /// `d: f16, qs: [u8; 16]`: value `d · (nibble - 8)`.
    Q4_0,
    /// `d: f16, m: f16, qs: [u8; 16]`: value `d · nibble + m`.
    Q4_1,
    /// `d: f16, qh: u32, qs: [u8; 16]`: value `d · ((nibble | high bit << 4) - 16)`.
    Q5_0,
    /// `d: f16, m: f16, qh: u32, qs: [u8; 16]`: value `d · (nibble | high bit << 4) + m`.
    Q5_1,
    /// `d: f16, qs: [i8; 32]`: value `d · q`.
    Q8_0,
}

impl BlockFormat {
    /// The format of a GGUF type name (`q4_0`, ...; ggml's own spelling, any case).
    pub fn from_ggml_name(name: &str) -> Option<Self> {
        Some(match name.to_ascii_lowercase().as_str() {
            "q4_0" => Self::Q4_0,
            "q4_1" => Self::Q4_1,
            "q5_0" => Self::Q5_0,
            "q5_1" => Self::Q5_1,
            "q8_0" => Self::Q8_0,
            _ => return None,
        })
    }

    pub const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
        }
    }

    /// Whether values carry a minimum (`d · q + m`), so the dot product needs `s_x`.
    fn has_min(self) -> bool {
        matches!(self, Self::Q4_1 | Self::Q5_1)
    }
}

/// A quantised (out, in) matrix in one of the [`BlockFormat`]s, its blocks interleaved 16 rows
/// at a time (`packed`; the same bytes as the GGUF's blocks).
#[derive(Debug, Clone)]
pub struct BlockMatrix {
    format: BlockFormat,
    rows: usize,
    cols: usize,
    records: Vec<u8>,
}

/// One activation row quantised: per block a scale, `Σq`, `d · Σq` and 32 values.
#[derive(Debug, Clone, Default)]
pub struct QuantizedRow {
    pub d: Vec<f32>,
    pub sum: Vec<i32>,
    pub s: Vec<f32>,
    pub q: Vec<i8>,
}

impl BlockMatrix {
    /// A matrix of `rows` x `cols` values from its blocks as the GGUF stores them.
    pub fn new(format: BlockFormat, rows: usize, cols: usize, bytes: Vec<u8>) -> Result<Self, String> {
        if !cols.is_multiple_of(BLOCK) || bytes.len() != rows * cols / BLOCK * format.block_bytes() {
            return Err(format!("{format:?} matrix {rows}x{cols}: {} bytes do not hold its blocks", bytes.len()));
        }
        Ok(Self { format, rows, cols, records: packed::pack(format, rows, cols, &bytes) })
    }

    /// A `rows` x `cols` matrix of `format` with random quants, small finite scales and, for the
    /// formats with one, a minimum: the kernels' tests and bench data.
    pub fn random(format: BlockFormat, rows: usize, cols: usize, seed: u64) -> Self {
        Self::new(format, rows, cols, random_blocks(format, rows, cols, seed)).expect("whole blocks")
    }

    pub fn format(&self) -> BlockFormat {
        self.format
    }

    /// Groups of 16 rows (the last one padded).
    fn groups(&self) -> usize {
        self.rows.div_ceil(packed::GROUP)
    }

    /// Records of one group.
    fn group_bytes(&self) -> usize {
        self.cols / BLOCK * packed::Layout::of(self.format).record
    }

    /// (rows, cols): (out, in) of the product.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Row `o`'s product with `x` in plain code (CPUs without AVX2), from the records.
    fn dot_scalar(&self, o: usize, x: &QuantizedRow) -> f32 {
        let record = packed::Layout::of(self.format).record;
        let group = &self.records[o / packed::GROUP * self.group_bytes()..][..self.group_bytes()];
        let mut total = 0f32;
        for (b, rec) in group.chunks_exact(record).enumerate() {
            let (v, d, m) = packed::row_block(self.format, rec, o % packed::GROUP);
            let sum: i32 = v.iter().zip(&x.q[b * BLOCK..(b + 1) * BLOCK]).map(|(a, q)| a * *q as i32).sum();
            total += d * x.d[b] * sum as f32 + m * x.s[b];
        }
        total
    }

    /// `y (m, out) = x (m, in) · Wᵀ`, row-major.
    pub fn multiply(&self, x: &[f32], level: SimdLevel) -> Vec<f32> {
        Self::multiply_many(&[self], x, level).remove(0)
    }

    /// [`Self::multiply`] for several matrices of the same width, in one parallel region.
    pub fn multiply_many(mats: &[&Self], x: &[f32], level: SimdLevel) -> Vec<Vec<f32>> {
        let kernel = (cfg!(target_arch = "x86_64") && level.usable() >= SimdLevel::Avx2).then(|| Kernels::get().int8_at(level));
        Self::multiply_many_on(mats, x, kernel)
    }

    /// [`Self::multiply_many`] on `kernel` (`None`: the plain code), which the CPU must be able
    /// to run ([`Kernels::int8_at`] and [`Int8Kernel::runnable`] give only such kernels).
    fn multiply_many_on(mats: &[&Self], x: &[f32], kernel: Option<Int8Kernel>) -> Vec<Vec<f32>> {
        let cols = mats[0].cols;
        let m = x.len() / cols;
        let with_sum = mats.iter().any(|w| w.format.has_min());
        let row = |r: usize| quantize_row(&x[r * cols..][..cols], with_sum);
        // Several decoding streams' rows quantised by the pool's threads: on the calling thread
        // alone the others waited through it.
        let acts: Vec<QuantizedRow> = if m * cols >= POOLED_QUANTIZE_VALUES { pool_map(m, row) } else { (0..m).map(row).collect() };
        // (m, out) per matrix, row-major, as the caller takes them; not zeroed first (a memset
        // on the calling thread while the others waited): both paths below write every value.
        let mut ys: Vec<Vec<f32>> = mats.iter().map(|w| Vec::with_capacity(m * w.rows)).collect();
        // SAFETY: each buffer has room for its m × rows values.
        let outs: Vec<DisjointWrites<f32>> =
            ys.iter_mut().map(|y| unsafe { DisjointWrites::from_raw(y.as_mut_ptr(), y.capacity()) }).collect();
        let groups: Vec<usize> = mats.iter().map(|w| w.groups()).collect();
        #[cfg(not(target_arch = "x86_64"))]
        let _ = kernel;
        #[cfg(target_arch = "x86_64")]
        if let Some(kernel) = kernel {
            for_rows_of_many(&groups, |i, range| {
                let w = mats[i];
                // SAFETY: the CPU runs `kernel` (the caller's promise); the matrix holds its
                // groups' records of `cols / BLOCK` blocks (made by `new`), the activations as
                // many blocks each; this work item alone writes the columns of its groups' rows.
                unsafe { tiles::product_groups(w.format, kernel, &w.records, range, &acts, (outs[i].at(0), w.rows)) }
            });
            drop(outs);
            return written(ys, mats, m);
        }
        for_rows_of_many(&groups, |i, range| {
            let w = mats[i];
            for g in range {
                for o in g * packed::GROUP..((g + 1) * packed::GROUP).min(w.rows) {
                    for (r, act) in acts.iter().enumerate() {
                        // SAFETY: every (matrix, o, r) is written by exactly one work item,
                        // inside that matrix's buffer.
                        unsafe { *outs[i].at(r * w.rows + o) = w.dot_scalar(o, act) };
                    }
                }
            }
        });
        drop(outs);
        written(ys, mats, m)
    }
}

/// Activation values (rows × columns) from which a product's rows are quantised on the pool.
const POOLED_QUANTIZE_VALUES: usize = 4096;

/// [`BlockMatrix::multiply_many_on`]'s outputs, once every value of each is written: their
/// lengths set.
fn written(mut ys: Vec<Vec<f32>>, mats: &[&BlockMatrix], m: usize) -> Vec<Vec<f32>> {
    for (y, w) in ys.iter_mut().zip(mats) {
        // SAFETY: the caller wrote all m × rows values (each group's rows for every activation
        // row), within the capacity the buffer was made with.
        unsafe { y.set_len(m * w.rows) };
    }
    ys
}

/// GGUF blocks of `format` for a `rows` x `cols` matrix: random quants, small finite scales and,
/// for the formats with one, a minimum.
fn random_blocks(format: BlockFormat, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut state = seed;
    let mut bytes = vec![0u8; rows * cols / BLOCK * format.block_bytes()];
    for b in bytes.chunks_exact_mut(format.block_bytes()) {
        b.iter_mut().for_each(|x| *x = crate::rng::splitmix64(&mut state) as u8);
        let scale = 0.002 + (crate::rng::splitmix64(&mut state) % 100) as f32 * 1e-4;
        b[..2].copy_from_slice(&f16::from_f32(scale).to_le_bytes());
        if format.has_min() {
            b[2..4].copy_from_slice(&f16::from_f32(-8.0 * scale).to_le_bytes());
        }
        if format == BlockFormat::Q8_0 {
            // ggml's quantiser never writes -128 (values are rounded within ±127).
            b[2..].iter_mut().filter(|x| **x == 0x80).for_each(|x| *x = 0x81);
        }
    }
    bytes
}

/// f32 through f16 and back: llama.cpp keeps the activations' scales in f16.
fn via_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// ggml's `quantize_row_q8_0` / `q8_1`: per block `d = max|x| / 127`, `q = round(x / d)` (ties
/// to even, as its AVX2 code rounds), `s = d · Σq` when `with_sum`.
pub fn quantize_row(x: &[f32], with_sum: bool) -> QuantizedRow {
    quantize_row_at(x, with_sum, SimdLevel::current())
}

pub fn quantize_row_at(x: &[f32], with_sum: bool, level: SimdLevel) -> QuantizedRow {
    let blocks = x.len() / BLOCK;
    let mut row =
        QuantizedRow { d: Vec::with_capacity(blocks), sum: Vec::with_capacity(blocks), s: Vec::with_capacity(blocks), q: vec![0; x.len()] };
    for (block, q) in x.chunks_exact(BLOCK).zip(row.q.chunks_exact_mut(BLOCK)) {
        let (d, sum) = quantize_block(block, q, level);
        row.d.push(via_f16(d));
        row.sum.push(sum);
        row.s.push(if with_sum { via_f16(d * sum as f32) } else { 0.0 });
    }
    row
}

/// One block of 32: its 8-bit values into `q`; returns (`d`, `Σq`).
fn quantize_block(x: &[f32], q: &mut [i8], level: SimdLevel) -> (f32, i32) {
    #[cfg(target_arch = "x86_64")]
    if level.usable() >= SimdLevel::Avx2 {
        // SAFETY: `usable` never exceeds the CPU's level (AVX2's: AVX2, FMA, F16C); both slices
        // hold one block.
        return unsafe { x86::quantize_block(x, q) };
    }
    let _ = level;
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0;
    for (q, v) in q.iter_mut().zip(x) {
        *q = (v * id).round_ties_even() as i8;
        sum += *q as i32;
    }
    (d, sum)
}

#[cfg(test)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The 32 integer values of a GGUF weight block (before its scale and minimum), in order.
#[cfg(test)]
fn block_values(format: BlockFormat, b: &[u8]) -> [i32; BLOCK] {
    let (_, qh_at, qs_at) = packed::source_offsets(format);
    let mut v = [0i32; BLOCK];
    if format == BlockFormat::Q8_0 {
        for (j, x) in v.iter_mut().enumerate() {
            *x = b[qs_at + j] as i8 as i32;
        }
        return v;
    }
    // Low nibbles are values 0..16, high ones 16..32; then the fifth bits and the offsets.
    let qh = qh_at.map_or(0, |at| u32::from_le_bytes(b[at..at + 4].try_into().unwrap()));
    for (j, x) in v.iter_mut().enumerate() {
        let nibble = if j < 16 { b[qs_at + j] & 0x0f } else { b[qs_at + j - 16] >> 4 } as i32;
        *x = nibble | (((qh >> j) & 1) << 4) as i32;
    }
    let offset = match format {
        BlockFormat::Q4_0 => 8,
        BlockFormat::Q5_0 => 16,
        _ => 0,
    };
    v.iter_mut().for_each(|x| *x -= offset);
    v
}

/// The dot product of a row of GGUF blocks, in plain code: the definition the packed products
/// are tested against.
#[cfg(test)]
fn dot_gguf(format: BlockFormat, w: &[u8], x: &QuantizedRow) -> f32 {
    let bb = format.block_bytes();
    let mut total = 0f32;
    for (i, b) in w.chunks_exact(bb).enumerate() {
        let v = block_values(format, b);
        let sumi: i32 = v.iter().zip(&x.q[i * BLOCK..(i + 1) * BLOCK]).map(|(a, b)| a * *b as i32).sum();
        total += f16_at(b, 0) * x.d[i] * sumi as f32;
        if format.has_min() {
            total += f16_at(b, 2) * x.s[i];
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMATS: [BlockFormat; 5] = [BlockFormat::Q4_0, BlockFormat::Q4_1, BlockFormat::Q5_0, BlockFormat::Q5_1, BlockFormat::Q8_0];

    /// The plain code and every int8 kernel this CPU runs.
    fn every_kernel() -> Vec<Option<Int8Kernel>> {
        std::iter::once(None).chain(Int8Kernel::runnable().into_iter().map(Some)).collect()
    }

    /// On every kernel, every format and tile shape (rows and activation rows that fill whole
    /// tiles and ones that leave remainders) agrees with the plain dot product of each pair.
    #[test]
    fn block_products_match_the_plain_code_on_every_kernel() {
        for format in FORMATS {
            // Whole groups of 16 rows and a padded last one (or only that); a half group; tiles of
            // activation rows and remainders.
            for (rows, m) in [(9usize, 1usize), (8, 3), (37, 7), (4, 2), (32, 9)] {
                let cols = 4 * BLOCK;
                let blocks = random_blocks(format, rows, cols, 7 + rows as u64);
                let w = BlockMatrix::new(format, rows, cols, blocks.clone()).unwrap();
                let x = crate::rng::signed_values(m * cols, 3 + m as u64);
                let acts: Vec<QuantizedRow> =
                    x.chunks_exact(cols).map(|r| quantize_row_at(r, format.has_min(), SimdLevel::Scalar)).collect();
                let row_bytes = cols / BLOCK * format.block_bytes();
                for kernel in every_kernel() {
                    let y = BlockMatrix::multiply_many_on(&[&w], &x, kernel).remove(0);
                    for c in 0..m {
                        for o in 0..rows {
                            let want = dot_gguf(format, &blocks[o * row_bytes..(o + 1) * row_bytes], &acts[c]);
                            let got = y[c * rows + o];
                            assert!(
                                (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                                "{format:?} {kernel:?} {rows}x{m}: ({c}, {o}) {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Weights at their largest and smallest values against activations at ±127: the kernels'
    /// 16-bit partial sums (`vpmaddubsw`'s pairs, Q8_0's within 2 · 127 · 127 of the limit, and
    /// the 5-bit formats' two pairs added before widening) do not saturate, so the products
    /// still equal the plain code's.
    #[test]
    fn the_largest_values_do_not_saturate_the_partial_sums() {
        let (rows, cols) = (32, 8 * BLOCK);
        // Activation rows quantising to +127, -127 and alternating ±127 in every block.
        let mut x = vec![1.0f32; cols];
        x.extend(vec![-1.0f32; cols]);
        x.extend((0..cols).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 }));
        for format in FORMATS {
            let mut blocks = random_blocks(format, rows, cols, 3);
            let (_, qh_at, qs_at) = packed::source_offsets(format);
            let largest = if format == BlockFormat::Q8_0 { 0x7f } else { 0xff };
            // Even rows at the format's largest values, odd rows at its smallest.
            for (i, b) in blocks.chunks_exact_mut(format.block_bytes()).enumerate() {
                let bits = if (i / (cols / BLOCK)).is_multiple_of(2) { largest } else { largest ^ 0xfe };
                let from = qh_at.unwrap_or(qs_at);
                b[from..].iter_mut().for_each(|v| *v = bits);
            }
            let w = BlockMatrix::new(format, rows, cols, blocks.clone()).unwrap();
            let acts: Vec<QuantizedRow> = x.chunks_exact(cols).map(|r| quantize_row_at(r, format.has_min(), SimdLevel::Scalar)).collect();
            assert!(acts.iter().all(|a| a.q.iter().all(|q| q.abs() == 127)));
            let row_bytes = cols / BLOCK * format.block_bytes();
            for kernel in every_kernel() {
                let y = BlockMatrix::multiply_many_on(&[&w], &x, kernel).remove(0);
                for (c, act) in acts.iter().enumerate() {
                    for o in 0..rows {
                        let want = dot_gguf(format, &blocks[o * row_bytes..(o + 1) * row_bytes], act);
                        let got = y[c * rows + o];
                        assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "{format:?} {kernel:?}: ({c}, {o}) {got} vs {want}");
                    }
                }
            }
        }
    }

    /// A row's result is the same bits alone and inside a prompt's batch (every tile computes
    /// each pair alike), and the same on every int8 kernel: `vpdpbusd` at 512 and 256 bits and
    /// `vpmaddubsw` (each that this CPU runs; CI's kinds differ in which).
    #[test]
    fn a_rows_result_does_not_depend_on_its_batch_or_the_int8_instructions() {
        let (cols, rows) = (6 * BLOCK, 27);
        let kernels = Int8Kernel::runnable();
        for format in FORMATS {
            let w = BlockMatrix::random(format, rows, cols, 5);
            let x = crate::rng::signed_values(7 * cols, 9);
            let on = |x: &[f32], k| BlockMatrix::multiply_many_on(&[&w], x, Some(k)).remove(0);
            for &kernel in &kernels {
                let batch = on(&x, kernel);
                for c in 0..7 {
                    let alone = on(&x[c * cols..(c + 1) * cols], kernel);
                    assert_eq!(alone, batch[c * rows..(c + 1) * rows], "{format:?} {kernel:?}: row {c}");
                }
                assert_eq!(batch, on(&x, kernels[0]), "{format:?}: {kernel:?} and {:?} differ", kernels[0]);
            }
        }
    }

    /// The vector quantiser rounds exactly as the plain one.
    #[test]
    fn activation_quantisation_is_the_same_at_every_level() {
        let x = crate::rng::signed_values(4 * BLOCK, 5);
        // Ties and zeros too: values on the half steps of a block whose max is 127.
        let mut ties: Vec<f32> = (0..BLOCK).map(|i| i as f32 - 15.5).collect();
        ties[0] = 127.0;
        let zeros = vec![0f32; BLOCK];
        for input in [x, ties, zeros] {
            let plain = quantize_row_at(&input, true, SimdLevel::Scalar);
            let best = quantize_row_at(&input, true, SimdLevel::detected());
            assert_eq!((plain.d, plain.sum, plain.s, plain.q), (best.d, best.sum, best.s, best.q));
        }
    }
}
