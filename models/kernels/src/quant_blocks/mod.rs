//! `x @ Wᵀ` over llama.cpp's block formats: the 32-value ones (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0),
//! which candle has no AVX2 dot product for (Q4_1, Q5_0, Q5_1 run its scalar loop, ~7x slower
//! than llama.cpp) or no interleaved one, and the K formats of 256-value super-blocks (Q4_K,
//! Q5_K, Q6_K: `k_packed`, `k_tiles`), so that all of them share one layout and threading scheme
//! and a model mixing them (a Q4_K_M file) quantises each input once.
//!
//! As in llama.cpp, each row of activations is quantised once to 8 bits per value in blocks of 32
//! (a scale `d` and, for the formats with a minimum, `s = d · Σq`), and every weight block's dot
//! product is an integer one: `Σ w_q · x_q` scaled by `d_w · d_x`, plus `m_w · s_x` for the
//! formats whose values are `d · q + m`. Scales are rounded to f16 where llama.cpp stores them in
//! f16, so both round alike. The weights are repacked at load, 16 rows' blocks interleaved
//! (`packed`), so that the kernels (`tiles`) work on 16 rows at once. The weight rows are split
//! over the threads in groups of 16; every thread runs all of a call's activation rows against
//! its weight rows (decoding's one row and a prompt's many).

/// Tiles of `C` activation rows of `x` while there are as many, then one at a time: `tile(c,
/// rows)` for each. A macro, so that each kernel's target features reach the tile code.
macro_rules! by_tiles {
    ($c:expr, $x:expr, |$c0:ident, $xs:ident| $tile:expr) => {{
        let x: &[QuantizedRow] = $x;
        let mut $c0 = 0;
        while $c0 < x.len() {
            if x.len() - $c0 >= $c {
                let $xs: [&QuantizedRow; $c] = std::array::from_fn(|k| &x[$c0 + k]);
                $tile;
                $c0 += $c;
            } else {
                let $xs = [&x[$c0]];
                $tile;
                $c0 += 1;
            }
        }
    }};
}

#[cfg(all(test, target_arch = "x86_64"))]
mod avx512_stand_ins;
mod k_packed;
#[cfg(target_arch = "x86_64")]
mod k_tiles;
mod packed;
#[cfg(target_arch = "x86_64")]
mod tiles;
#[cfg(target_arch = "x86_64")]
mod x86;

use half::f16;

use crate::disjoint::DisjointWrites;
use crate::pool::{for_rows_of_many, pool_map};
use crate::simd::{Int8Kernel, Kernels, SimdLevel};

/// Values per block in every format here (a K format's super-block holds 8).
pub const BLOCK: usize = 32;

/// A block format: its ggml layout (all little endian, f16 scales first but in Q6_K), named
/// as ggml names them.
#[allow(non_camel_case_types)]
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
    /// 256 values: `d, dmin: f16, scales: [u8; 12], qs: [u8; 128]`: eight blocks of 32, each
    /// value `d · sc · nibble - dmin · m` with its block's 6-bit `sc` and `m`.
    Q4_K,
    /// Q4_K with `qh: [u8; 32]` before `qs`: fifth bits.
    Q5_K,
    /// 256 values: `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`: value
    /// `d · sc · (u - 32)`, `u` 6 bits, with its 16 values' `sc`.
    Q6_K,
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
            "q4_k" => Self::Q4_K,
            "q5_k" => Self::Q5_K,
            "q6_k" => Self::Q6_K,
            _ => return None,
        })
    }

    /// Bytes of one GGUF block ([`Self::block_values`] values).
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q4_K => 144,
            Self::Q5_K => 176,
            Self::Q6_K => 210,
        }
    }

    /// Values of one GGUF block: 32, or a K format's 256.
    pub const fn block_values(self) -> usize {
        if self.is_k() {
            k_packed::SUPER
        } else {
            BLOCK
        }
    }

    /// A K format (256-value super-blocks).
    pub const fn is_k(self) -> bool {
        matches!(self, Self::Q4_K | Self::Q5_K | Self::Q6_K)
    }

    /// Whether values carry a minimum (`d · q + m`), so the dot product needs `s_x` (rounded
    /// to f16, as llama.cpp's `q8_1` keeps it; the K formats' minima take `d_x · Σq` in f32, as
    /// its `q8_K` sums are exact).
    fn has_min(self) -> bool {
        matches!(self, Self::Q4_1 | Self::Q5_1)
    }

    /// Bytes of a row group's records along one row of `cols` values.
    fn group_bytes(self, cols: usize) -> usize {
        if self.is_k() {
            cols / k_packed::SUPER * k_packed::KLayout::of(self).record
        } else {
            cols / BLOCK * packed::Layout::of(self).record
        }
    }
}

/// Whether the K formats should run on these kernels at `level` rather than on candle's
/// ([`Kernels::k_blocks_ours`]; never below AVX2, where ours are plain code).
pub fn k_formats_run_here(level: SimdLevel) -> bool {
    cfg!(target_arch = "x86_64") && level.usable() >= SimdLevel::Avx2 && Kernels::get().k_blocks_ours(level)
}

/// A quantised (out, in) matrix in one of the [`BlockFormat`]s, its blocks interleaved 16 rows
/// at a time (`packed`: the same bytes as the GGUF's blocks; `k_packed`: the K formats' 6-bit
/// scales a byte each).
#[derive(Debug, Clone)]
pub struct BlockMatrix {
    format: BlockFormat,
    rows: usize,
    cols: usize,
    records: Vec<u8>,
}

/// One activation row quantised: per block a scale, `Σq`, `Σq` of its first 16 values (Q6_K's
/// scales are per 16), `d · Σq` and 32 values.
#[derive(Debug, Clone, Default)]
pub struct QuantizedRow {
    pub d: Vec<f32>,
    pub sum: Vec<i32>,
    pub half: Vec<i32>,
    pub s: Vec<f32>,
    pub q: Vec<i8>,
}

impl BlockMatrix {
    /// A matrix of `rows` x `cols` values from its blocks as the GGUF stores them.
    pub fn new(format: BlockFormat, rows: usize, cols: usize, bytes: Vec<u8>) -> Result<Self, String> {
        let values = format.block_values();
        if !cols.is_multiple_of(values) || bytes.len() != rows * cols / values * format.block_bytes() {
            return Err(format!("{format:?} matrix {rows}x{cols}: {} bytes do not hold its blocks of {values} values", bytes.len()));
        }
        let records = if format.is_k() { k_packed::pack(format, rows, cols, &bytes) } else { packed::pack(format, rows, cols, &bytes) };
        Ok(Self { format, rows, cols, records })
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
        self.format.group_bytes(self.cols)
    }

    /// (rows, cols): (out, in) of the product.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Row `o`'s product with `x` in plain code (CPUs without AVX2), from the records.
    fn dot_scalar(&self, o: usize, x: &QuantizedRow) -> f32 {
        let group = &self.records[o / packed::GROUP * self.group_bytes()..][..self.group_bytes()];
        let r = o % packed::GROUP;
        let mut total = 0f32;
        let mut add = |b: usize, (v, d, m): ([i32; BLOCK], f32, f32), s: f32| {
            let sum: i32 = v.iter().zip(&x.q[b * BLOCK..(b + 1) * BLOCK]).map(|(a, q)| a * *q as i32).sum();
            total += d * x.d[b] * sum as f32 + m * s;
        };
        if self.format.is_k() {
            let record = k_packed::KLayout::of(self.format).record;
            for (s, rec) in group.chunks_exact(record).enumerate() {
                for j in 0..k_packed::BLOCKS {
                    let b = s * k_packed::BLOCKS + j;
                    add(b, k_packed::row_block(self.format, rec, j, r), x.d[b] * x.sum[b] as f32);
                }
            }
        } else {
            for (b, rec) in group.chunks_exact(packed::Layout::of(self.format).record).enumerate() {
                add(b, packed::row_block(self.format, rec, r), x.s[b]);
            }
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
                unsafe {
                    if w.format.is_k() {
                        k_tiles::product_groups(w.format, kernel, &w.records, range, &acts, (outs[i].at(0), w.rows))
                    } else {
                        tiles::product_groups(w.format, kernel, &w.records, range, &acts, (outs[i].at(0), w.rows))
                    }
                }
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

/// The product of `w` with activation rows `acts` (m x rows, row-major) on its format's
/// AVX512-VNNI kernel's source over the plain-code stand-ins for its instructions
/// (`avx512_stand_ins`): the tests check that kernel's arithmetic on any CPU.
#[cfg(all(test, target_arch = "x86_64"))]
fn product_on_avx512_stand_ins(w: &BlockMatrix, acts: &[QuantizedRow]) -> Vec<f32> {
    let mut y = vec![f32::NAN; acts.len() * w.rows];
    let out = (y.as_mut_ptr(), w.rows);
    // SAFETY: the records are `w`'s groups (made by `new`) for rows of `w.cols` values, as the
    // activation rows are; `y` holds m x rows values. The stand-ins need no CPU feature.
    unsafe {
        if w.format.is_k() {
            k_tiles::product_groups_on_stand_ins(w.format, &w.records, 0..w.groups(), acts, out)
        } else {
            tiles::product_groups_on_stand_ins(w.format, &w.records, 0..w.groups(), acts, out)
        }
    }
    y
}

/// GGUF blocks of `format` for a `rows` x `cols` matrix: random quants, small finite scales and,
/// for the formats with one, a minimum.
fn random_blocks(format: BlockFormat, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut state = seed;
    let mut bytes = vec![0u8; rows * cols / format.block_values() * format.block_bytes()];
    for b in bytes.chunks_exact_mut(format.block_bytes()) {
        b.iter_mut().for_each(|x| *x = crate::rng::splitmix64(&mut state) as u8);
        let scale = 0.002 + (crate::rng::splitmix64(&mut state) % 100) as f32 * 1e-4;
        match format {
            // d and dmin (the minima are subtracted).
            BlockFormat::Q4_K | BlockFormat::Q5_K => {
                b[..2].copy_from_slice(&f16::from_f32(scale / 32.0).to_le_bytes());
                b[2..4].copy_from_slice(&f16::from_f32(scale / 4.0).to_le_bytes());
                continue;
            }
            BlockFormat::Q6_K => {
                b[208..].copy_from_slice(&f16::from_f32(scale / 64.0).to_le_bytes());
                continue;
            }
            _ => {}
        }
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
    let mut row = QuantizedRow {
        d: Vec::with_capacity(blocks),
        sum: Vec::with_capacity(blocks),
        half: Vec::with_capacity(blocks),
        s: Vec::with_capacity(blocks),
        q: vec![0; x.len()],
    };
    for (block, q) in x.chunks_exact(BLOCK).zip(row.q.chunks_exact_mut(BLOCK)) {
        let (d, sum) = quantize_block(block, q, level);
        row.d.push(via_f16(d));
        row.sum.push(sum);
        row.half.push(q[..BLOCK / 2].iter().map(|&v| v as i32).sum());
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
mod tests;
