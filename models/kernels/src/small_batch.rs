//! `x Wᵀ` for a batch of decoding rows (5 to [`SMALL_BATCH_MAX_ROWS`]: one token each of that
//! many sequences) with f32 weights.
//!
//! gemm packs the whole weight matrix on every call; with 16 rows the packing copies as many
//! bytes as the product reads, most of a 16-stream serving profile. Here each thread
//! takes a run of weight rows, and for a block of them that stays in L1 it computes every batch
//! row's dot products, three weight rows by four batch rows at a time (7 loads for 12 FMAs),
//! so the weights are read from memory once per step and never copied.

use crate::attend_rows::scores;
use crate::disjoint::DisjointWrites;
use crate::pool::for_rows_of_many;
use crate::simd::SimdLevel;

/// The largest batch this path takes (more rows: gemm, whose packing then pays for itself).
pub const SMALL_BATCH_MAX_ROWS: usize = 32;

/// Batch rows a pass of the AVX2 kernel.
const X_ROWS: usize = 4;

/// Most weight rows per block.
const BLOCK_ROWS: usize = 32;

/// Bytes of weight rows per block: the block stays in L1 (32 KiB here) while every pair of
/// batch rows passes over it; from L2, its four loads a step were at L2's bandwidth.
const BLOCK_BYTES: usize = 20 << 10;

/// Weight rows per block for rows of `in_dim` values: a multiple of 3 (the kernel's tile).
fn block_rows(in_dim: usize) -> usize {
    (BLOCK_BYTES / (4 * in_dim)).clamp(3, BLOCK_ROWS) / 3 * 3
}

/// `y_i (rows, out_i) = x (rows, in_dim) · W_iᵀ` for each `W_i` (out_i, in_dim), row-major, in
/// one parallel region.
pub fn rows_many(x: &[f32], rows: usize, ws: &[&[f32]], in_dim: usize, level: SimdLevel) -> Vec<Vec<f32>> {
    let out_dims: Vec<usize> = ws.iter().map(|w| w.len() / in_dim).collect();
    let mut ys: Vec<Vec<f32>> = out_dims.iter().map(|o| vec![0f32; o * rows]).collect();
    let outs: Vec<DisjointWrites<f32>> = ys.iter_mut().map(|y| DisjointWrites::new(y)).collect();
    let block_rows = block_rows(in_dim);
    for_rows_of_many(&out_dims, |i, range| {
        let mut dots = [0f32; X_ROWS * BLOCK_ROWS];
        let mut o0 = range.start;
        while o0 < range.end {
            let o1 = (o0 + block_rows).min(range.end);
            let block = &ws[i][o0 * in_dim..o1 * in_dim];
            let n = o1 - o0;
            let mut r = 0;
            #[cfg(target_arch = "x86_64")]
            if let Some(kernel) = x86::Kernel::at(level, in_dim) {
                // The next block comes from memory while this one is read from L1: each pass
                // over this block prefetches its share of the next.
                let next = &ws[i][o1 * in_dim..(o1 + block_rows).min(range.end) * in_dim];
                let passes = rows / X_ROWS;
                let share = next.len().div_ceil(passes.max(1));
                // X_ROWS batch rows at a time by the tiled kernel; the rest below.
                while r + X_ROWS <= rows {
                    let (two, out) = (&mut dots[..X_ROWS * n], &outs[i]);
                    let pass = r / X_ROWS;
                    let prefetch = &next[(pass * share).min(next.len())..((pass + 1) * share).min(next.len())];
                    // SAFETY: `Kernel::at` checked the CPU and in_dim; x holds rows × in_dim
                    // values, the block n × in_dim, `two` X_ROWS × n.
                    unsafe { kernel.run(&x[r * in_dim..(r + X_ROWS) * in_dim], block, in_dim, two, prefetch) };
                    for k in 0..X_ROWS {
                        // SAFETY: (matrix i, row r + k, columns o0..o1) is written by this work
                        // item alone, inside matrix i's (rows × out_i) buffer.
                        let at = (r + k) * out_dims[i] + o0;
                        unsafe { out.piece(at..at + n) }.copy_from_slice(&two[k * n..(k + 1) * n]);
                    }
                    r += X_ROWS;
                }
            }
            for r in r..rows {
                let dots = &mut dots[..n];
                scores(&x[r * in_dim..(r + 1) * in_dim], block, 1.0, dots, level);
                // SAFETY: as above.
                let at = r * out_dims[i] + o0;
                unsafe { outs[i].piece(at..at + n) }.copy_from_slice(dots);
            }
            o0 = o1;
        }
    });
    drop(outs);
    ys
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::X_ROWS;
    use crate::simd::SimdLevel;

    /// Weight rows a pass.
    const W_ROWS: usize = 3;

    /// The tiled kernel of a level: its vectors' width, and in_dim a multiple of it.
    #[derive(Clone, Copy)]
    pub enum Kernel {
        Avx2,
        Avx512,
    }

    impl Kernel {
        /// The widest kernel `level` allows for rows of `in_dim` values, if any.
        pub fn at(level: SimdLevel, in_dim: usize) -> Option<Kernel> {
            match level.usable() {
                SimdLevel::Avx512 if in_dim.is_multiple_of(16) => Some(Kernel::Avx512),
                SimdLevel::Avx512 | SimdLevel::Avx2 if in_dim.is_multiple_of(8) => Some(Kernel::Avx2),
                _ => None,
            }
        }

        /// [`rows_avx2`] / [`rows_avx512`].
        ///
        /// # Safety
        /// As theirs; `self` came from [`Kernel::at`] for this `d`.
        pub unsafe fn run(self, x: &[f32], w: &[f32], d: usize, out: &mut [f32], prefetch: &[f32]) {
            match self {
                Kernel::Avx2 => rows_avx2(x, w, d, out, prefetch),
                Kernel::Avx512 => rows_avx512(x, w, d, out, prefetch),
            }
        }
    }

    /// `out[k · n + j] = x_k · w_j` for the [`X_ROWS`] rows `x_k` of `x` and the `n` rows `w_j`
    /// of `w` (`d` values each, a multiple of `$lanes`): three weight rows by four batch rows a
    /// pass, twelve accumulators, seven loads for twelve FMAs. Meanwhile it prefetches
    /// `prefetch` into the caches, one 64-byte line per step.
    macro_rules! rows_kernel {
        ($name:ident, $features:literal, $lanes:literal, $zero:ident, $load:ident, $fma:ident, |$v:ident| $sum:expr) => {
            #[target_feature(enable = $features)]
            pub unsafe fn $name(x: &[f32], w: &[f32], d: usize, out: &mut [f32], prefetch: &[f32]) {
                let n = w.len() / d;
                let (px, pw) = (x.as_ptr(), w.as_ptr());
                let (mut line, lines) = (0, prefetch.len().div_ceil(16));
                let mut fetch_line = || {
                    if line < lines {
                        _mm_prefetch::<_MM_HINT_T0>(prefetch.as_ptr().add(line * 16) as *const i8);
                        line += 1;
                    }
                };
                let mut j = 0;
                while j + W_ROWS <= n {
                    let mut acc = [[$zero(); W_ROWS]; X_ROWS];
                    for i in (0..d).step_by($lanes) {
                        fetch_line();
                        let wv = [0, 1, 2].map(|c| $load(pw.add((j + c) * d + i)));
                        for (k, acc) in acc.iter_mut().enumerate() {
                            let xv = $load(px.add(k * d + i));
                            for c in 0..W_ROWS {
                                acc[c] = $fma(xv, wv[c], acc[c]);
                            }
                        }
                    }
                    for (k, acc) in acc.iter().enumerate() {
                        for c in 0..W_ROWS {
                            let $v = acc[c];
                            out[k * n + j + c] = $sum;
                        }
                    }
                    j += W_ROWS;
                }
                for j in j..n {
                    for k in 0..X_ROWS {
                        let mut acc = $zero();
                        for i in (0..d).step_by($lanes) {
                            acc = $fma($load(px.add(k * d + i)), $load(pw.add(j * d + i)), acc);
                        }
                        let $v = acc;
                        out[k * n + j] = $sum;
                    }
                }
            }
        };
    }

    rows_kernel!(rows_avx512, "avx512f", 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps, |v| _mm512_reduce_add_ps(v));
    rows_kernel!(rows_avx2, "avx2,fma", 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, |v| {
        let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let h = _mm_hadd_ps(h, h);
        _mm_cvtss_f32(_mm_hadd_ps(h, h))
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each level's kernel (AVX-512 where in_dim is a multiple of 16, the AVX2 one at a multiple
    /// of 8, the plain dot products elsewhere) gives the plain dot products.
    #[test]
    fn every_row_and_matrix_matches_plain_dot_products() {
        let mut seed = 7u64;
        let mut data = |n: usize| -> Vec<f32> {
            (0..n).map(|_| (crate::rng::splitmix64(&mut seed) >> 40) as f32 / (1u64 << 24) as f32 - 0.5).collect()
        };
        let levels = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512];
        for (rows, in_dim) in [(13, 72), (16, 80), (5, 36)] {
            let x = data(rows * in_dim);
            let (w1, w2) = (data(70 * in_dim), data(5 * in_dim));
            for level in levels.into_iter().filter(|l| *l <= SimdLevel::detected()) {
                let ys = rows_many(&x, rows, &[&w1, &w2], in_dim, level);
                for (w, y) in [(&w1, &ys[0]), (&w2, &ys[1])] {
                    let out = w.len() / in_dim;
                    for r in 0..rows {
                        for o in 0..out {
                            let want: f64 = (0..in_dim).map(|k| x[r * in_dim + k] as f64 * w[o * in_dim + k] as f64).sum();
                            let got = y[r * out + o] as f64;
                            assert!((got - want).abs() < 1e-5, "{level:?}, in {in_dim}, row {r}, column {o}: {got} vs {want}");
                        }
                    }
                }
            }
        }
    }
}
