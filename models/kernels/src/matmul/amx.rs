//! What the two AMX-BF16 kernels share (`amx_bf16`: bf16 weights at inference; `bf16_tiles`: f32
//! products with operands rounded to bf16, in training): the tile configuration and f32 values
//! rounded to bf16 in AVX-512 registers (the 16 × 16 transposition they use is `transpose`'s).

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

/// Lanes `0..n` set (n ≤ 16): a masked load's or store's first n values.
#[inline(always)]
pub(super) fn first_lanes(n: usize) -> __mmask16 {
    if n >= 16 {
        0xffff
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}
