//! The register kernels of the packed matrix product (`packed`): each computes one MR × NR
//! tile of dst from a packed lhs micro-panel (MR values per depth step) and a packed rhs
//! micro-panel (NR values per depth step), in the caches. One per vector width:
//! - [`Tile::Avx2`]: 6 × 16, two 8-lane vectors per row (12 accumulators + 2 rhs + 1 broadcast
//!   of the 16 ymm registers);
//! - [`Tile::Avx512`]: 6 × 32, two 16-lane vectors per row (15 of the 32 zmm registers: 12
//!   accumulators keep both FMA ports busy through their 4-cycle latency).
//!
//! Both have the same rows, so lhs is packed (and shared among threads) the same way at either
//! width, and both add each dst value's products in depth order with the same roundings: a
//! product's bits do not depend on the width that computed it.

use std::arch::x86_64::*;

use crate::simd::SimdLevel;

/// Rows of dst one kernel call computes, one broadcast lhs value each.
pub(crate) const MR: usize = 6;
/// Columns of dst the AVX2 kernel computes: two 8-lane vectors.
pub(crate) const NR_AVX2: usize = 2 * <__m256 as Lanes>::LANES;
/// Columns of dst the AVX-512 kernel computes: two 16-lane vectors.
pub(crate) const NR_AVX512: usize = 2 * <__m512 as Lanes>::LANES;

/// Depth steps per trip of a kernel's loop (faster than one step per trip; docs/design.md).
/// Each accumulator still adds its products in depth order, so the sums are the same.
const UNROLL: usize = 4;

/// Which register kernel computes the tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tile {
    Avx2,
    Avx512,
}

impl Tile {
    /// The kernel of a SIMD level (at most the CPU's: a tile exists only where the CPU runs
    /// it); None at the levels the packed product does not run at.
    pub(crate) fn at(level: SimdLevel) -> Option<Tile> {
        match level.usable() {
            SimdLevel::Avx2 => Some(Tile::Avx2),
            SimdLevel::Avx512 => Some(Tile::Avx512),
            _ => None,
        }
    }

    /// Columns of dst one kernel call computes (a multiple of 8).
    pub(crate) fn nr(self) -> usize {
        match self {
            Tile::Avx2 => NR_AVX2,
            Tile::Avx512 => NR_AVX512,
        }
    }

    /// dst tile `(rows, cols)` (at most MR × nr) = [dst +] beta · Σ_p a[p] ⊗ b[p], a packed MR
    /// per depth step, b nr per depth step; dst (rows `dst_rs` apart) is read only when
    /// `load_dst`.
    ///
    /// # Safety
    /// The CPU must have the tile's instructions; a and b must hold kc depth steps; dst must
    /// hold the tile.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(crate) unsafe fn kernel(
        self,
        kc: usize,
        a: *const f32,
        b: *const f32,
        dst: *mut f32,
        dst_rs: usize,
        tile: (usize, usize),
        load_dst: bool,
        beta: f32,
    ) {
        match self {
            Tile::Avx2 => kernel_avx2(kc, a, b, dst, dst_rs, tile, load_dst, beta),
            Tile::Avx512 => kernel_avx512(kc, a, b, dst, dst_rs, tile, load_dst, beta),
        }
    }
}

/// The 6 × 16 kernel on 8-lane vectors.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel_avx2(
    kc: usize,
    a: *const f32,
    b: *const f32,
    dst: *mut f32,
    dst_rs: usize,
    tile: (usize, usize),
    load_dst: bool,
    beta: f32,
) {
    kernel_on::<__m256>(kc, a, b, dst, dst_rs, tile, load_dst, beta)
}

/// The 6 × 32 kernel on 16-lane vectors.
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel_avx512(
    kc: usize,
    a: *const f32,
    b: *const f32,
    dst: *mut f32,
    dst_rs: usize,
    tile: (usize, usize),
    load_dst: bool,
    beta: f32,
) {
    kernel_on::<__m512>(kc, a, b, dst, dst_rs, tile, load_dst, beta)
}

/// The operations a kernel needs of one vector register of f32 lanes. Every method is inlined
/// into the `target_feature` function that calls the kernel, which is what lets the intrinsics
/// inline (a closure in their place, a function of its own without the features, was
/// slower).
trait Lanes: Copy {
    const LANES: usize;
    unsafe fn zero() -> Self;
    unsafe fn load(at: *const f32) -> Self;
    unsafe fn store(self, at: *mut f32);
    /// The value at `at` in every lane.
    unsafe fn splat(at: *const f32) -> Self;
    /// `self · b + c` in one rounding.
    unsafe fn mul_add(self, b: Self, c: Self) -> Self;
    unsafe fn mul(self, b: Self) -> Self;
}

impl Lanes for __m256 {
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> Self {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(at: *const f32) -> Self {
        _mm256_loadu_ps(at)
    }
    #[inline(always)]
    unsafe fn store(self, at: *mut f32) {
        _mm256_storeu_ps(at, self)
    }
    #[inline(always)]
    unsafe fn splat(at: *const f32) -> Self {
        _mm256_broadcast_ss(&*at)
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        _mm256_fmadd_ps(self, b, c)
    }
    #[inline(always)]
    unsafe fn mul(self, b: Self) -> Self {
        _mm256_mul_ps(self, b)
    }
}

impl Lanes for __m512 {
    const LANES: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> Self {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(at: *const f32) -> Self {
        _mm512_loadu_ps(at)
    }
    #[inline(always)]
    unsafe fn store(self, at: *mut f32) {
        _mm512_storeu_ps(at, self)
    }
    #[inline(always)]
    unsafe fn splat(at: *const f32) -> Self {
        _mm512_set1_ps(*at)
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        _mm512_fmadd_ps(self, b, c)
    }
    #[inline(always)]
    unsafe fn mul(self, b: Self) -> Self {
        _mm512_mul_ps(self, b)
    }
}

/// The kernel on vectors `V`: MR × 2 accumulators, a tile 2 · `V::LANES` columns wide.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel_on<V: Lanes>(
    kc: usize,
    a: *const f32,
    b: *const f32,
    dst: *mut f32,
    dst_rs: usize,
    (rows, cols): (usize, usize),
    load_dst: bool,
    beta: f32,
) {
    let nr = 2 * V::LANES;
    prefetch_rows(dst, dst_rs, rows, nr);
    let mut acc = [[V::zero(); 2]; MR];
    let (mut a, mut b) = (a, b);
    let mut left = kc;
    while left >= UNROLL {
        for u in 0..UNROLL {
            depth_step(&mut acc, a.add(u * MR), b.add(u * nr));
        }
        a = a.add(UNROLL * MR);
        b = b.add(UNROLL * nr);
        left -= UNROLL;
    }
    for _ in 0..left {
        depth_step(&mut acc, a, b);
        a = a.add(MR);
        b = b.add(nr);
    }
    let beta = V::splat(&beta);
    if rows == MR && cols == nr {
        for (r, acc) in acc.iter().enumerate() {
            store_row(acc, dst.add(r * dst_rs), load_dst, beta);
        }
        return;
    }
    // An edge tile: the same sums, then only the tile's part of dst is touched.
    let mut tile = [0.0f32; MR * NR_AVX512]; // room for the widest tile
    for (r, acc) in acc.iter().enumerate().take(rows) {
        let (at, t) = (dst.add(r * dst_rs), tile.as_mut_ptr().add(r * nr));
        if load_dst {
            std::ptr::copy_nonoverlapping(at, t, cols);
        }
        store_row(acc, t, load_dst, beta);
        std::ptr::copy_nonoverlapping(t, at, cols);
    }
}

/// `acc[r] += a[r] ⊗ b` for the MR lhs values at `a` and the 2 · `V::LANES` rhs values at `b`.
#[inline(always)]
unsafe fn depth_step<V: Lanes>(acc: &mut [[V; 2]; MR], a: *const f32, b: *const f32) {
    let b0 = V::load(b);
    let b1 = V::load(b.add(V::LANES));
    for (r, acc) in acc.iter_mut().enumerate() {
        let ar = V::splat(a.add(r));
        acc[0] = ar.mul_add(b0, acc[0]);
        acc[1] = ar.mul_add(b1, acc[1]);
    }
}

/// One row of a tile into dst: `dst + beta · acc` in one rounding (with beta 1, exactly
/// dst + acc), or `beta · acc`.
#[inline(always)]
unsafe fn store_row<V: Lanes>(acc: &[V; 2], at: *mut f32, load_dst: bool, beta: V) {
    for (half, acc) in acc.iter().enumerate() {
        let at = at.add(half * V::LANES);
        let value = if load_dst { acc.mul_add(beta, V::load(at)) } else { acc.mul(beta) };
        value.store(at);
    }
}

/// dst's rows are read (or written) after a kernel's loop: ask for their `nr` columns' cache
/// lines now, behind the sums.
#[inline(always)]
unsafe fn prefetch_rows(dst: *mut f32, dst_rs: usize, rows: usize, nr: usize) {
    for r in 0..rows {
        let at = dst.add(r * dst_rs);
        _mm_prefetch::<_MM_HINT_T0>(at as *const i8);
        if nr > 16 {
            _mm_prefetch::<_MM_HINT_T0>(at.add(16) as *const i8);
        }
        _mm_prefetch::<_MM_HINT_T0>(at.add(nr - 1) as *const i8);
    }
}
