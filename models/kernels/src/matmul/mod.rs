//! The one door to matrix products for our own f32 code (the fused linear ops, attention,
//! prefill): `dst = alpha · dst + beta · lhs · rhs` on the calling thread, with the kernels of
//! the level [`SimdLevel::current`] names: our packed driver (`packed`, whose threads can
//! share a packed operand) where the kernel table (`simd::Kernels`) gives the products to it,
//! elsewhere (and for products too small to pack) the gemm crate's.
//!
//! Why not `gemm::gemm` alone: gemm picks its microkernels once, by std's feature detection, with
//! no way to ask for a lower level, so `FSDP_SIMD=avx2` on an AVX-512 machine would still have run
//! every product on AVX-512 tiles. At a forced lower level the AVX2 driver runs exactly as on a
//! CPU without AVX-512, and the scalar level calls gemm-common's public driver
//! (`gemm_basic_generic`) with gemm-f32's scalar microkernels, so one binary measures either
//! kind of machine.
//!
//! Under [`with_bf16_products`] (training with `--param-dtype bf16` on a CPU) the products of
//! [`parallel`]'s entry points round their operands to bf16 on AMX-BF16 tiles (`bf16_tiles`)
//! where the CPU has them, as PyTorch's CPU autocast does.

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod amx_bf16;
#[cfg(target_arch = "x86_64")]
mod bf16_tiles;
pub mod column_split;
pub mod half;
#[cfg(target_arch = "x86_64")]
mod pack;
#[cfg(target_arch = "x86_64")]
mod packed;
pub mod parallel;
#[cfg(target_arch = "x86_64")]
mod rhs_elem;
#[cfg(target_arch = "x86_64")]
mod tiles;
mod transpose;

use gemm_common::gemm::gemm_basic_generic;
use gemm_common::simd::MixedSimd;
use gemm_common::Parallelism;

use crate::simd::SimdLevel;
#[cfg(target_arch = "x86_64")]
use crate::simd::{Kernels, MatmulKernels};

/// An f32 matrix by pointer and (column, row) strides in elements.
pub type Strided<P> = (P, isize, isize);

/// `dst (m × n) = alpha · dst + beta · lhs (m × k) · rhs (k × n)`; `dst` is not read when alpha
/// is 0 (so it may hold anything), on the calling thread (callers own the parallelism).
///
/// # Safety
/// Each matrix's strides must stay inside its allocation for the given sizes; dst must not
/// overlap lhs or rhs. Strides are non-negative.
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    dst: Strided<*mut f32>,
    lhs: Strided<*const f32>,
    rhs: Strided<*const f32>,
    alpha: f32,
    beta: f32,
) {
    sgemm_at(SimdLevel::current(), m, n, k, dst, lhs, rhs, alpha, beta)
}

thread_local! {
    /// Whether this thread's linear products may round their operands to bf16
    /// ([`with_bf16_products`]).
    static BF16_PRODUCTS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with this thread's products through [`parallel`]'s entry points (the linear
/// layers', forward and backward) computed, when `on`, from operands rounded to bf16 with f32
/// sums on AMX-BF16 tiles, where the CPU has them and Linux grants them
/// ([`crate::simd::Kernels::amx_bf16`]); elsewhere they stay f32, as without it: bf16 products
/// without the tiles are slower and less accurate. PyTorch's CPU autocast to bf16 makes the
/// same choice per linear product, and is scoped the same way (per thread). Products run inside
/// the pool's workers (attention's, per head) stay f32.
pub fn with_bf16_products<R>(on: bool, f: impl FnOnce() -> R) -> R {
    /// Puts the thread's previous setting back, also when `f` panics.
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            BF16_PRODUCTS.set(self.0);
        }
    }
    let _restore = Restore(BF16_PRODUCTS.replace(on));
    f()
}

/// Whether [`with_bf16_products`] gives this thread's products to the tiles: all of them, small
/// ones too, so that whether a value was rounded does not depend on how many rows a rank has.
#[cfg(target_arch = "x86_64")]
fn on_bf16_tiles() -> bool {
    BF16_PRODUCTS.get() && Kernels::get().amx_bf16()
}

/// What a product with nothing to sum does, and whether that is all of it: nothing where dst is
/// empty; where the depth is, dst's m × n zeroed (left as it is when accumulating).
///
/// # Safety
/// dst holds m rows of n values, `dst_rs` apart.
#[cfg(target_arch = "x86_64")]
unsafe fn nothing_to_sum(m: usize, n: usize, k: usize, (dst, dst_rs): (*mut f32, usize), accumulate: bool) -> bool {
    if k == 0 && !accumulate {
        for i in 0..m {
            std::ptr::write_bytes(dst.add(i * dst_rs), 0, n);
        }
    }
    m == 0 || n == 0 || k == 0
}

/// The register tile of our packed driver (`packed`) that products at `level` run on, if
/// the kernel table ([`Kernels::matmul_at`]) gives them to it.
#[cfg(target_arch = "x86_64")]
fn packed_tile(level: SimdLevel) -> Option<Tile> {
    tile_of(Kernels::get().matmul_at(level), level)
}

/// [`packed_tile`] for a product whose lhs has `lhs_rows` rows ([`Kernels::matmul_for`]).
#[cfg(target_arch = "x86_64")]
fn packed_tile_for(level: SimdLevel, lhs_rows: usize) -> Option<Tile> {
    tile_of(Kernels::get().matmul_for(level, lhs_rows), level)
}

/// The tile an `m × n × k` product into a row-major dst runs on at `level`: None where it goes
/// to gemm (the table gives products of this many rows to gemm, or packing would not pay).
#[cfg(target_arch = "x86_64")]
fn packed_tile_of_product(level: SimdLevel, m: usize, n: usize, k: usize) -> Option<Tile> {
    packed::worth_it(m, n, k).then(|| packed_tile_for(level, m)).flatten()
}

/// The packed driver's tile at `level` when the kernel table's `choice` is the packed driver.
#[cfg(target_arch = "x86_64")]
fn tile_of(choice: MatmulKernels, level: SimdLevel) -> Option<Tile> {
    match choice {
        MatmulKernels::Packed => Tile::at(level),
        MatmulKernels::Gemm => None,
    }
}

/// The kernels products at the current level run on, in words (for the benches' tables).
pub fn kernels_in_use() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    match packed_tile(SimdLevel::current()) {
        Some(Tile::Avx2) => return "packed 6x16",
        Some(Tile::Avx512) => return "packed 6x32",
        None => {}
    }
    "gemm"
}

/// Columns of dst the kernels of this thread's products compute at a time, and the narrowest
/// piece they compute without running a whole tile into scratch: a split of a product's columns
/// into pieces that are not multiples of the first runs ragged edges, at the second's grain.
pub fn tile_columns() -> (usize, usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(tile) = packed_tile(SimdLevel::current()) {
        return (tile.nr(), tile.nr());
    }
    // gemm's microkernels compute 16-lane vectors of its (transposed) dst, our columns: four at
    // AVX-512 (64 columns; 16 to 48 run narrower, slower kernels), two of 8 at AVX2.
    #[cfg(target_arch = "x86_64")]
    if SimdLevel::current() == SimdLevel::Avx512 {
        return (64, 16);
    }
    (16, 16)
}

/// Whether a thread's piece of `x · Wᵀ` (`m × n × k`, W row-major with rows `k` long) runs
/// faster with W's rows written out as columns of a row-major block first
/// ([`transpose::rows_as_columns`]) than read as `Wᵀ` in place: where gemm's kernels run it and
/// the rows are a power of two of at least 512 values apart. gemm packs such a weight by
/// reading one value from each of 64 rows at a time; rows a power of two of 2 KiB or more apart
/// fall into the same few L1 sets. At other row lengths gemm's own packing was the faster
/// (docs/design.md, matrix products, has the figures).
pub(crate) fn writes_weight_columns_first(m: usize, n: usize, k: usize) -> bool {
    k >= 512 && k.is_power_of_two() && runs_on_gemm(m, n, k)
}

/// Whether an `m × n × k` product whose lhs is column-major (a weight gradient's `gyᵀ`: rows 1
/// apart, columns a row of gy apart) runs faster with lhs written out as row-major rows first
/// (`parallel::lhs_in_row_blocks`) than read in place: where gemm's kernels run it. gemm packs
/// that operand a few adjacent values from each of its k columns at a time, every column a
/// different cache line, and columns of power-of-two length fall into the same few L1 sets;
/// written out as rows, it packs contiguous runs (docs/design.md, matrix products, has the
/// figures).
pub(crate) fn writes_lhs_rows_first(m: usize, n: usize, k: usize) -> bool {
    k >= 16 && runs_on_gemm(m, n, k)
}

/// Whether [`sgemm`] runs an `m × n × k` product into a row-major dst on gemm's kernels (not on
/// our packed driver, which packs both operands its own way).
fn runs_on_gemm(m: usize, n: usize, k: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if packed_tile_of_product(SimdLevel::current(), m, n, k).is_some() {
        return false;
    }
    let _ = (m, n, k);
    true
}

pub(crate) use transpose::rows_as_columns;

#[cfg(target_arch = "x86_64")]
pub use packed::SharedLhs;
#[cfg(target_arch = "x86_64")]
use tiles::Tile;
/// Nothing to share off x86-64 (no packed driver there).
#[cfg(not(target_arch = "x86_64"))]
pub enum SharedLhs {}

/// Runs `f` with lhs (m × k) packed once for the threads that compute pieces of a product's
/// columns (each at least `narrowest` wide), where those pieces run on our packed driver
/// and lhs is not too large to keep packed whole; with None elsewhere (each piece then packs
/// what it reads itself).
///
/// # Safety
/// As [`sgemm`] for lhs, which must outlive `f`.
pub unsafe fn with_lhs_shared_by_pieces<R>(
    m: usize,
    narrowest: usize,
    k: usize,
    lhs: Strided<*const f32>,
    f: impl FnOnce(Option<&SharedLhs>) -> R,
) -> R {
    #[cfg(target_arch = "x86_64")]
    if packed_tile_for(SimdLevel::current(), m).is_some() && packed::shares_lhs(m, narrowest, k) {
        return SharedLhs::with(m, k, lhs, |shared| f(Some(shared)));
    }
    let _ = (m, narrowest, k, lhs);
    f(None)
}

/// [`sgemm`] of one piece of a product's columns into a row-major dst (`dst_rs` apart), with
/// lhs's packed blocks from `shared` when given (from [`with_lhs_shared_by_pieces`] for this
/// lhs); dst is read only when `accumulate`.
///
/// # Safety
/// As [`sgemm`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm_piece(
    m: usize,
    n: usize,
    k: usize,
    (dst, dst_rs): (*mut f32, usize),
    lhs: Strided<*const f32>,
    rhs: Strided<*const f32>,
    accumulate: bool,
    shared: Option<&SharedLhs>,
) {
    match shared {
        #[cfg(target_arch = "x86_64")]
        Some(shared) => {
            // A shared packing exists only where the level's products run on a packed tile.
            let tile = packed_tile_for(SimdLevel::current(), m).expect("with_lhs_shared_by_pieces shares only for a packed tile");
            packed::sgemm(tile, m, n, k, dst, dst_rs, lhs, rhs, accumulate, 1.0, Some(shared))
        }
        _ => sgemm(m, n, k, (dst, 1, dst_rs as isize), lhs, rhs, if accumulate { 1.0 } else { 0.0 }, 1.0),
    }
}

/// [`sgemm_piece`] of `x · Wᵀ` for a row-major `w` (n × k) of 2-byte values, widened to f32
/// while our packed driver packs it, where that driver runs this product; false (nothing done)
/// where gemm's kernels would, which read f32 only (the caller then widens the rows itself).
///
/// # Safety
/// As [`sgemm_piece`], with rhs the (k × n) `Wᵀ` read in place from `w`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sgemm_piece_wt<T: packed::RhsElem>(
    m: usize,
    n: usize,
    k: usize,
    (dst, dst_rs): (*mut f32, usize),
    lhs: Strided<*const f32>,
    w: *const T,
    shared: Option<&SharedLhs>,
) -> bool {
    let level = SimdLevel::current();
    // The choice `sgemm_piece` makes: the shared packing's tile, else the product's own.
    let tile = match shared {
        Some(_) => packed_tile_for(level, m),
        None => packed_tile_of_product(level, m, n, k),
    };
    match tile {
        Some(tile) => {
            packed::sgemm(tile, m, n, k, dst, dst_rs, lhs, (w, k as isize, 1), false, 1.0, shared);
            true
        }
        None => false,
    }
}

/// [`sgemm`] with the kernels of `level` (the detected one or lower).
///
/// # Safety
/// As [`sgemm`]; `level` must not exceed [`SimdLevel::detected`].
#[allow(clippy::too_many_arguments)]
unsafe fn sgemm_at(
    level: SimdLevel,
    m: usize,
    n: usize,
    k: usize,
    dst: Strided<*mut f32>,
    lhs: Strided<*const f32>,
    rhs: Strided<*const f32>,
    alpha: f32,
    beta: f32,
) {
    debug_assert!([dst.1, dst.2, lhs.1, lhs.2, rhs.1, rhs.2].iter().all(|s| *s >= 0));
    #[cfg(target_arch = "x86_64")]
    if alpha == 0.0 || alpha == 1.0 {
        if dst.1 == 1 {
            if let Some(tile) = packed_tile_of_product(level, m, n, k) {
                return packed::sgemm(tile, m, n, k, dst.0, dst.2 as usize, lhs, rhs, alpha != 0.0, beta, None);
            }
        }
        // A column-major dst is the row-major dstᵀ = rhsᵀ · lhsᵀ.
        if dst.2 == 1 {
            if let Some(tile) = packed_tile_of_product(level, n, m, k) {
                let (lhs_t, rhs_t) = ((rhs.0, rhs.2, rhs.1), (lhs.0, lhs.2, lhs.1));
                return packed::sgemm(tile, n, m, k, dst.0, dst.1 as usize, lhs_t, rhs_t, alpha != 0.0, beta, None);
            }
        }
    }
    let read_dst = alpha != 0.0;
    if level >= SimdLevel::detected() || !cfg!(target_arch = "x86_64") {
        gemm::gemm(
            m,
            n,
            k,
            dst.0,
            dst.1,
            dst.2,
            read_dst,
            lhs.0,
            lhs.1,
            lhs.2,
            rhs.0,
            rhs.1,
            rhs.2,
            alpha,
            beta,
            false,
            false,
            false,
            Parallelism::None,
        );
        return;
    }
    // gemm's own first step: its microkernels walk dst by columns, so a row-major dst is
    // computed as the transposed product (dstᵀ = rhsᵀ · lhsᵀ).
    let (m, n, dst, lhs, rhs) = if dst.1.abs() < dst.2.abs() {
        (n, m, (dst.0, dst.2, dst.1), (rhs.0, rhs.2, rhs.1), (lhs.0, lhs.2, lhs.1))
    } else {
        (m, n, dst, lhs, rhs)
    };
    // gemm's generic driver on one microkernel family, `lanes` f32 values a register.
    macro_rules! driver {
        ($simd:expr, $ukr:path, $lanes:literal) => {{
            use $ukr as ukr;
            gemm_basic_generic::<_, f32, $lanes, { ukr::MR_DIV_N * $lanes }, { ukr::NR }, { ukr::MR_DIV_N }, { ukr::H_M }, { ukr::H_N }>(
                $simd,
                m,
                n,
                k,
                dst.0,
                dst.1,
                dst.2,
                read_dst,
                lhs.0,
                lhs.1,
                lhs.2,
                rhs.0,
                rhs.1,
                rhs.2,
                alpha,
                beta,
                false,
                false,
                false,
                |a, b, c| a * b + c,
                &ukr::UKR,
                &ukr::H_UKR,
                false,
                Parallelism::None,
            )
        }};
    }
    #[cfg(target_arch = "x86_64")]
    if level == SimdLevel::Avx2 {
        let simd = <gemm_common::simd::V3 as MixedSimd<f32, f32, f32, f32>>::try_new().expect("SimdLevel::current never exceeds the CPU");
        return driver!(simd, gemm_f32::microkernel::fma::f32, 8);
    }
    let simd = <gemm_common::simd::Scalar as MixedSimd<f32, f32, f32, f32>>::try_new().expect("plain code runs everywhere");
    driver!(simd, gemm_f32::microkernel::scalar::f32, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every level's product (the detected one through gemm's dispatch, the lower ones through
    /// the generic driver) against an f64 reference, on a row-major and a column-major dst.
    #[test]
    fn each_level_computes_the_product() {
        let (m, n, k) = (37, 29, 51);
        let lhs: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0).collect();
        let rhs: Vec<f32> = (0..k * n).map(|i| ((i * 5 % 11) as f32 - 5.0) / 5.0).collect();
        let want = |i: usize, j: usize| (0..k).map(|p| lhs[i * k + p] as f64 * rhs[p * n + j] as f64).sum::<f64>();
        for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512] {
            if level > SimdLevel::detected() {
                continue;
            }
            for row_major in [true, false] {
                let mut dst = vec![1.0f32; m * n];
                let (cs, rs) = if row_major { (1, n as isize) } else { (m as isize, 1) };
                // SAFETY: all three matrices are dense with the strides given.
                unsafe {
                    sgemm_at(
                        level,
                        m,
                        n,
                        k,
                        (dst.as_mut_ptr(), cs, rs),
                        (lhs.as_ptr(), 1, k as isize),
                        (rhs.as_ptr(), 1, n as isize),
                        1.0,
                        2.0,
                    )
                };
                for i in 0..m {
                    for j in 0..n {
                        let got = dst[(i as isize * rs + j as isize * cs) as usize] as f64;
                        let expected = 1.0 + 2.0 * want(i, j);
                        assert!((got - expected).abs() < 1e-4, "{level:?} row_major {row_major} ({i}, {j}): {got} vs {expected}");
                    }
                }
            }
        }
    }
}
