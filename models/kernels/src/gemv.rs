//! Decoding's matrix-vector product and the dot products under it. With one or a few rows,
//! `x · Wᵀ` reads the whole weight matrix once per token and is bound by memory bandwidth:
//! gemm's blocked kernels are built for large tiles (packing that batch-1 decoding wastes), while
//! a plain dot product per weight row, split over the threads, streams the weights at full
//! speed. `dot` and `axpy` also serve the serving adapters' update by rows and attention.

use crate::disjoint::DisjointWrites;
use crate::gemv_layout::{LayoutChooser, RowLayout, PREFETCH_AHEAD};
use crate::pool::for_rows_of_many;
use crate::simd::SimdLevel;

/// Largest number of rows that take the matrix-vector path.
pub const GEMV_MAX_ROWS: usize = 4;

/// A weight element the matrix-vector kernel reads: f32, or f16 / bf16 widened in registers.
pub trait GemvWeight: Copy + Send + Sync {
    /// The dot products of `x` with the `R` consecutive rows of `w` (each `x.len()` long),
    /// prefetching `next` (the rows this thread reads after them) when it holds as many values
    /// as `w`. Each row's arithmetic does not depend on `R`: the matrix-vector product runs
    /// groups of [`ROW_GROUP`] and single rows where a thread's range ends, and a row's result
    /// must not depend on where the threads' ranges fell.
    fn dot_rows<const R: usize>(x: &[f32], w: &[Self], next: &[Self], level: SimdLevel) -> [f32; R];

    /// The type's choice of row layout, timed on its first products.
    fn layout_chooser() -> &'static LayoutChooser;
}

/// Weight rows the grouped layout reads at once. Four streams from memory at a time can keep
/// more cache-line misses in flight than one row after another (and load x once for four
/// rows): a decoding step streams every weight from DRAM. Whether they do depends on the
/// CPU's memory system, so `gemv_layout` times both walks (docs/design.md, "Decoding's
/// matrix-vector product").
pub const ROW_GROUP: usize = 4;

impl GemvWeight for f32 {
    fn layout_chooser() -> &'static LayoutChooser {
        static CHOOSER: LayoutChooser = LayoutChooser::new();
        &CHOOSER
    }

    fn dot_rows<const R: usize>(x: &[f32], w: &[f32], next: &[f32], level: SimdLevel) -> [f32; R] {
        debug_assert_eq!(w.len(), R * x.len());
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: `usable` never exceeds the CPU's level, every feature of which is present;
            // w holds R rows of x.len() values.
            match level.usable() {
                SimdLevel::Avx512 => return unsafe { x86::dot_rows_avx512(x, w, next) },
                SimdLevel::Avx2 => return unsafe { x86::dot_rows_avx2(x, w, next) },
                SimdLevel::Scalar => {}
            }
        }
        let _ = next;
        std::array::from_fn(|k| dot_scalar(x, &w[k * x.len()..(k + 1) * x.len()]))
    }
}

/// `y[r, o] = dot(x[r, ..], w[o, ..])` for `rows` rows, the weight rows split over the threads.
pub fn gemv_rows<W: GemvWeight>(x: &[f32], rows: usize, w: &[W], out_dim: usize, in_dim: usize, level: SimdLevel) -> Vec<f32> {
    gemv_rows_many(x, rows, &[&w[..out_dim * in_dim]], in_dim, level).remove(0)
}

/// [`gemv_rows`] for several matrices (each `(out_i, in_dim)`, row-major) in one parallel region.
pub fn gemv_rows_many<W: GemvWeight>(x: &[f32], rows: usize, ws: &[&[W]], in_dim: usize, level: SimdLevel) -> Vec<Vec<f32>> {
    let chooser = W::layout_chooser();
    let bytes = ws.iter().map(|w| std::mem::size_of_val(*w)).sum();
    match chooser.layout_for(bytes) {
        (layout, None) => gemv_rows_laid_out(x, rows, ws, in_dim, level, layout),
        (layout, Some(trial)) => {
            let start = std::time::Instant::now();
            let ys = gemv_rows_laid_out(x, rows, ws, in_dim, level, layout);
            chooser.record(trial, start.elapsed());
            ys
        }
    }
}

/// [`gemv_rows_many`] reading each thread's weight rows in `layout`.
fn gemv_rows_laid_out<W: GemvWeight>(
    x: &[f32],
    rows: usize,
    ws: &[&[W]],
    in_dim: usize,
    level: SimdLevel,
    layout: RowLayout,
) -> Vec<Vec<f32>> {
    let out_dims: Vec<usize> = ws.iter().map(|w| w.len() / in_dim).collect();
    // (out, rows) per matrix: each weight row's results together. Not zeroed first: every place
    // is written below (a decoding step's outputs are a few thousand floats, ~200 times a token).
    let mut yts: Vec<Vec<f32>> = out_dims.iter().map(|o| Vec::with_capacity(o * rows)).collect();
    let outs: Vec<DisjointWrites<f32>> = yts.iter_mut().zip(&out_dims).map(|(yt, o)| DisjointWrites::spare(yt, o * rows)).collect();
    for_rows_of_many(&out_dims, |i, range| {
        let w = ws[i];
        let mut o = range.start;
        while layout == RowLayout::Grouped && o + ROW_GROUP <= range.end {
            let group = &w[o * in_dim..(o + ROW_GROUP) * in_dim];
            // The group after this one (or this one again at the matrix's end) is fetched
            // while this one is read.
            let after = (o + ROW_GROUP).min(out_dims[i] - ROW_GROUP);
            let next = &w[after * in_dim..(after + ROW_GROUP) * in_dim];
            for r in 0..rows {
                let sums = W::dot_rows::<ROW_GROUP>(&x[r * in_dim..(r + 1) * in_dim], group, if r == 0 { next } else { &[] }, level);
                for (k, sum) in sums.into_iter().enumerate() {
                    // SAFETY: every (matrix, o, r) is written by exactly one work item, inside
                    // that matrix's buffer.
                    unsafe { *outs[i].at((o + k) * rows + r) = sum };
                }
            }
            o += ROW_GROUP;
        }
        for o in o..range.end {
            let wrow = &w[o * in_dim..(o + 1) * in_dim];
            let ahead = (o + PREFETCH_AHEAD).min(out_dims[i] - 1);
            let next = if layout == RowLayout::OneByOne { &w[ahead * in_dim..(ahead + 1) * in_dim] } else { &[] };
            for r in 0..rows {
                let [sum] = W::dot_rows::<1>(&x[r * in_dim..(r + 1) * in_dim], wrow, if r == 0 { next } else { &[] }, level);
                // SAFETY: as above.
                unsafe { *outs[i].at(o * rows + r) = sum };
            }
        }
    });
    drop(outs);
    for (yt, o) in yts.iter_mut().zip(&out_dims) {
        // SAFETY: the loop above wrote each of the o * rows places (every row o of the matrix
        // falls in exactly one range, and each of its `rows` results is written).
        unsafe { yt.set_len(o * rows) };
    }
    yts.into_iter().zip(out_dims).map(|(yt, o)| transposed(yt, o, rows)).collect()
}

/// Dot product at `level` (which the caller has checked the CPU supports).
pub fn dot(a: &[f32], b: &[f32], level: SimdLevel) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `usable` never exceeds the CPU's level, every feature of which is present.
        match level.usable() {
            SimdLevel::Avx512 => return unsafe { x86::dot_avx512(a, b) },
            SimdLevel::Avx2 => return unsafe { x86::dot_avx2(a, b) },
            SimdLevel::Scalar => {}
        }
    }
    let _ = level;
    dot_scalar(a, b)
}

/// `y += a · x` at `level` (which the caller has checked the CPU supports).
pub fn axpy(y: &mut [f32], a: f32, x: &[f32], level: SimdLevel) {
    debug_assert_eq!(y.len(), x.len());
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `usable` never exceeds the CPU's level, every feature of which is present.
        match level.usable() {
            SimdLevel::Avx512 => return unsafe { x86::axpy_avx512(y, a, x) },
            SimdLevel::Avx2 => return unsafe { x86::axpy_avx2(y, a, x) },
            SimdLevel::Scalar => {}
        }
    }
    let _ = level;
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

/// Eight partial sums, as the vector kernels keep, so the three levels round alike.
fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// (out, rows) results as (rows, out).
fn transposed(yt: Vec<f32>, out_dim: usize, rows: usize) -> Vec<f32> {
    if rows == 1 {
        return yt;
    }
    let mut y = vec![0f32; rows * out_dim];
    for o in 0..out_dim {
        for r in 0..rows {
            y[r * out_dim + o] = yt[o * rows + r];
        }
    }
    y
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `y += a · x`, the plain loop compiled for each level (the compiler vectorises it with FMA).
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn axpy_avx512(y: &mut [f32], a: f32, x: &[f32]) {
        y.iter_mut().zip(x).for_each(|(y, x)| *y = a.mul_add(*x, *y));
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy_avx2(y: &mut [f32], a: f32, x: &[f32]) {
        y.iter_mut().zip(x).for_each(|(y, x)| *y = a.mul_add(*x, *y));
    }

    /// `R` rows: one `$lanes`-lane accumulator per row over the vectors of x, the tail (x.len()
    /// not a multiple of the lanes) by scalars; one prefetch of each of `next`'s rows per vector.
    macro_rules! dot_rows {
        ($name:ident, $features:literal, $lanes:literal, $zero:ident, $load:ident, $fma:ident, |$v:ident| $sum:expr) => {
            #[target_feature(enable = $features)]
            pub unsafe fn $name<const R: usize>(x: &[f32], w: &[f32], next: &[f32]) -> [f32; R] {
                let d = x.len();
                let (px, pw, pn) = (x.as_ptr(), w.as_ptr(), next.as_ptr());
                let prefetch = next.len() == w.len();
                let mut acc = [$zero(); R];
                let mut i = 0;
                while i + $lanes <= d {
                    if prefetch {
                        for k in 0..R {
                            _mm_prefetch::<_MM_HINT_T0>(pn.add(k * d + i) as *const i8);
                        }
                    }
                    let xv = $load(px.add(i));
                    for (k, acc) in acc.iter_mut().enumerate() {
                        *acc = $fma(xv, $load(pw.add(k * d + i)), *acc);
                    }
                    i += $lanes;
                }
                // A loop, not `array::from_fn`: a closure does not inherit the target features.
                let mut sums = [0f32; R];
                for (k, sum) in sums.iter_mut().enumerate() {
                    let $v = acc[k];
                    *sum = $sum;
                    for j in i..d {
                        *sum += x[j] * w[k * d + j];
                    }
                }
                sums
            }
        };
    }

    dot_rows!(dot_rows_avx512, "avx512f", 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps, |v| _mm512_reduce_add_ps(v));
    dot_rows!(dot_rows_avx2, "avx2,fma", 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, |v| {
        let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let h = _mm_hadd_ps(h, h);
        _mm_cvtss_f32(_mm_hadd_ps(h, h))
    });

    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i + 64 <= n {
            for (k, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i + 16 * k)), _mm512_loadu_ps(pb.add(i + 16 * k)), *acc);
            }
            i += 64;
        }
        while i + 16 <= n {
            acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc[0]);
            i += 16;
        }
        let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        let mut s = _mm512_reduce_add_ps(sum);
        while i < n {
            s += *pa.add(i) * *pb.add(i);
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (k, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8 * k)), _mm256_loadu_ps(pb.add(i + 8 * k)), *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc[0]);
            i += 8;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
        let mut s: f32 = lanes.iter().sum();
        while i < n {
            s += *pa.add(i) * *pb.add(i);
            i += 1;
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};

    use crate::rng::signed_values as data;

    /// Every level this CPU has gives candle's matmul, for odd sizes (tails) and 1-4 rows.
    #[test]
    fn every_level_matches_candle_matmul() {
        let best = SimdLevel::detected();
        for (rows, inp, out) in [(1, 576, 1536), (3, 77, 130), (4, 1000, 65), (2, 15, 3)] {
            let x = Tensor::from_vec(data(rows * inp, 1), (rows, inp), &Device::Cpu).unwrap();
            let w = Tensor::from_vec(data(out * inp, 2), (out, inp), &Device::Cpu).unwrap();
            let want: Vec<f32> = x.matmul(&w.t().unwrap()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let (xs, ws) = (x.flatten_all().unwrap().to_vec1::<f32>().unwrap(), w.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512].into_iter().filter(|l| *l <= best) {
                let got = gemv_rows(&xs, rows, &ws, out, inp, level);
                // Relative to the scale of a sum of `inp` products (different summation orders).
                let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs() / (b.abs() + (inp as f32).sqrt())).fold(0f32, f32::max);
                assert!(worst < 1e-5, "{level:?} rows {rows} in {inp} out {out}: off by {worst}");
            }
        }
    }

    /// f16 and bf16 weights (widened in registers) give candle's f32 matmul of the same values,
    /// on every level, for odd sizes.
    #[test]
    fn half_weights_match_candle_matmul_on_every_level() {
        let best = SimdLevel::detected();
        for (rows, inp, out) in [(1, 576, 130), (3, 77, 9), (4, 1000, 65), (2, 15, 3)] {
            let x = Tensor::from_vec(data(rows * inp, 1), (rows, inp), &Device::Cpu).unwrap();
            let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for dtype in [DType::F16, DType::BF16] {
                let w = Tensor::from_vec(data(out * inp, 2), (out, inp), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
                let want: Vec<f32> =
                    x.matmul(&w.to_dtype(DType::F32).unwrap().t().unwrap()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
                for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512].into_iter().filter(|l| *l <= best) {
                    let got = match dtype {
                        DType::F16 => gemv_rows(&xs, rows, &w.flatten_all().unwrap().to_vec1::<half::f16>().unwrap(), out, inp, level),
                        _ => gemv_rows(&xs, rows, &w.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap(), out, inp, level),
                    };
                    let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs() / (b.abs() + (inp as f32).sqrt())).fold(0f32, f32::max);
                    assert!(worst < 1e-5, "{dtype:?} {level:?} rows {rows} in {inp} out {out}: off by {worst}");
                }
            }
        }
    }

    /// A row's result is the same bits in a group of four as alone (the matrix-vector product
    /// runs both, as the threads' ranges fall), for each weight type, level and a tail length.
    #[test]
    fn a_row_gives_the_same_bits_in_a_group_and_alone() {
        fn check<W: GemvWeight + std::fmt::Debug>(w: &[W], x: &[f32], level: SimdLevel) {
            let d = x.len();
            let group = W::dot_rows::<ROW_GROUP>(x, w, w, level);
            for (k, sum) in group.iter().enumerate() {
                let [alone] = W::dot_rows::<1>(x, &w[k * d..(k + 1) * d], &[], level);
                assert_eq!(sum.to_bits(), alone.to_bits(), "{level:?} d {d} row {k}: {sum} vs {alone}");
            }
        }
        for d in [576, 77] {
            let (x, w) = (data(d, 11), data(ROW_GROUP * d, 12));
            for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512].into_iter().filter(|l| *l <= SimdLevel::detected()) {
                check(&w, &x, level);
                check(&w.iter().map(|&v| half::f16::from_f32(v)).collect::<Vec<_>>(), &x, level);
                check(&w.iter().map(|&v| half::bf16::from_f32(v)).collect::<Vec<_>>(), &x, level);
            }
        }
    }

    /// Both row layouts give the same bits (the layout is chosen by timing, so it must change
    /// speed only), for each weight type, level, row count and a matrix that ends mid-group.
    #[test]
    fn both_row_layouts_give_the_same_bits() {
        fn check<W: GemvWeight>(x: &[f32], rows: usize, w: &[W], d: usize, level: SimdLevel) {
            let grouped = gemv_rows_laid_out(x, rows, &[w, &w[..5 * d]], d, level, RowLayout::Grouped);
            let one_by_one = gemv_rows_laid_out(x, rows, &[w, &w[..5 * d]], d, level, RowLayout::OneByOne);
            let lens = |ys: &Vec<Vec<f32>>| ys.iter().map(Vec::len).collect::<Vec<_>>();
            assert_eq!(lens(&grouped), lens(&one_by_one), "{level:?} rows {rows} d {d}");
            assert_eq!(lens(&grouped), [rows * w.len() / d, rows * 5]);
            for (g, o) in grouped.iter().flatten().zip(one_by_one.iter().flatten()) {
                assert_eq!(g.to_bits(), o.to_bits(), "{level:?} rows {rows} d {d}: {g} vs {o}");
            }
        }
        for (d, out) in [(576, 131), (77, 10)] {
            let w = data(out * d, 21);
            let (wh, wb): (Vec<half::f16>, Vec<half::bf16>) = w.iter().map(|&v| (half::f16::from_f32(v), half::bf16::from_f32(v))).unzip();
            for rows in [1, 3] {
                let x = data(rows * d, 22);
                for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512].into_iter().filter(|l| *l <= SimdLevel::detected()) {
                    check(&x, rows, &w, d, level);
                    check(&x, rows, &wh, d, level);
                    check(&x, rows, &wb, d, level);
                }
            }
        }
    }

    #[test]
    fn axpy_agrees_on_every_level() {
        let (x, y0) = (data(1003, 5), data(1003, 6));
        for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512].into_iter().filter(|l| *l <= SimdLevel::detected()) {
            let mut y = y0.clone();
            axpy(&mut y, -0.75, &x, level);
            for i in 0..y.len() {
                let want = y0[i] as f64 - 0.75 * x[i] as f64;
                assert!((y[i] as f64 - want).abs() < 1e-6, "{level:?} at {i}: {} vs {want}", y[i]);
            }
        }
    }
}
