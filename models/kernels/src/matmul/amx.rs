//! What the two AMX-BF16 kernels share (`amx_bf16`: bf16 weights at inference; `bf16_tiles`: f32
//! products with operands rounded to bf16, in training): the tile configuration, f32 values
//! rounded to bf16 in AVX-512 registers, and a 16 × 16 transposition of 32-bit lanes.

use std::arch::asm;
use std::arch::x86_64::*;

/// Rows of a tile, and the 4-byte pairs (or f32 values) in one of its 64-byte rows.
pub(super) const TILE: usize = 16;
/// Inputs a tile product consumes: a tile row's 64 bytes of bf16.
pub(super) const DEPTH: usize = 32;
/// bf16 values in one tile of operands (1 KiB).
pub(super) const TILE_VALUES: usize = TILE * DEPTH;

/// The tile configuration every thread loads before its tiles: eight tiles of 16 rows of 64
/// bytes (both kernels: tmm0-3 results, tmm4-5 and tmm6-7 the two operands).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    bytes_per_row: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// Loads [`CONFIG`] on this thread (before its first tile instruction).
///
/// # Safety
/// The CPU must have AMX-TILE and Linux must have granted this process the tile state
/// (`simd::Kernels::amx_bf16`).
#[inline(always)]
pub(super) unsafe fn configure_tiles() {
    asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const TileConfig, options(nostack, readonly));
}

/// Releases this thread's tiles after its last tile instruction (their state is then not saved
/// at every context switch).
///
/// # Safety
/// As [`configure_tiles`].
#[inline(always)]
pub(super) unsafe fn release_tiles() {
    asm!("tilerelease", options(nostack, nomem));
}

/// 16 f32 values rounded to bf16 (to nearest, ties to even; NaN stays a quiet NaN), each in
/// the low half of its 32-bit lane (the high half zero): half's `bf16::from_f32`, subnormals
/// kept, where `vcvtne2ps2bf16` would flush them.
#[inline(always)]
pub(super) unsafe fn bf16_bits(v: __m512) -> __m512i {
    let bits = _mm512_castps_si512(v);
    let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0))
}

/// Lane `c` of the result holds `even[c]` rounded to bf16 in its low half and `odd[c]` in its
/// high half: one tile row of an operand laid out in pairs along the depth.
#[inline(always)]
pub(super) unsafe fn bf16_pair_lanes(even: __m512, odd: __m512) -> __m512i {
    _mm512_or_si512(bf16_bits(even), _mm512_slli_epi32::<16>(bf16_bits(odd)))
}

/// 32 adjacent f32 values (the first 16 in `low`) rounded to bf16, in order: 16 pairs, pair `p`
/// holding value `2p` in its low half and `2p + 1` in its high half.
#[inline(always)]
pub(super) unsafe fn bf16_run(low: __m512, high: __m512) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(bf16_bits(low))), _mm512_cvtepi32_epi16(bf16_bits(high)))
}

/// The transpose of a 16 × 16 matrix of 32-bit lanes held a row a register: interleaving pairs
/// of rows' values, then pairs of pairs, gives each 128-bit lane a 4 × 4 block transposed;
/// moving lanes then gathers each column's four blocks.
#[inline(always)]
pub(super) unsafe fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // u[4g + c] holds, in lane L, column 4L + c of rows 4g..4g + 4.
    let mut u = [_mm512_setzero_ps(); 16];
    let pd = _mm512_castps_pd;
    for g in 0..4 {
        let (t0, t1, t2, t3) = (pd(t[4 * g]), pd(t[4 * g + 1]), pd(t[4 * g + 2]), pd(t[4 * g + 3]));
        u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
        u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
        u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
        u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
    }
    let mut columns = [_mm512_setzero_ps(); 16];
    for c in 0..4 {
        let low = _mm512_shuffle_f32x4::<0b01_00_01_00>(u[c], u[4 + c]);
        let high = _mm512_shuffle_f32x4::<0b11_10_11_10>(u[c], u[4 + c]);
        let low2 = _mm512_shuffle_f32x4::<0b01_00_01_00>(u[8 + c], u[12 + c]);
        let high2 = _mm512_shuffle_f32x4::<0b11_10_11_10>(u[8 + c], u[12 + c]);
        columns[c] = _mm512_shuffle_f32x4::<0b10_00_10_00>(low, low2);
        columns[4 + c] = _mm512_shuffle_f32x4::<0b11_01_11_01>(low, low2);
        columns[8 + c] = _mm512_shuffle_f32x4::<0b10_00_10_00>(high, high2);
        columns[12 + c] = _mm512_shuffle_f32x4::<0b11_01_11_01>(high, high2);
    }
    columns
}

/// Lanes `0..n` set (n ≤ 16): a masked load's or store's first n values.
#[inline(always)]
pub(super) fn first_lanes(n: usize) -> __mmask16 {
    if n >= 16 {
        0xffff
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::{CpuFeatures, SimdLevel};

    #[test]
    fn transpose16_is_the_transpose() {
        if CpuFeatures::detected().best_level() < SimdLevel::Avx512 {
            return;
        }
        let m: Vec<f32> = (0..256).map(|i| i as f32).collect();
        // SAFETY: the CPU has AVX-512 F; m holds 16 rows of 16.
        let t = unsafe { transpose16(std::array::from_fn(|i| _mm512_loadu_ps(m.as_ptr().add(i * 16)))) };
        let mut out = [0f32; 256];
        for (i, row) in t.iter().enumerate() {
            // SAFETY: out has room for 16 rows of 16.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(i * 16), *row) };
        }
        for i in 0..16 {
            for j in 0..16 {
                assert_eq!(out[i * 16 + j], m[j * 16 + i]);
            }
        }
    }
}
