//! The element types a packed product's rhs may hold (f32, and 2-byte weights widened as they
//! are packed), and how the packing loads each.

use std::arch::x86_64::*;

use half::{bf16, f16};

/// A value of rhs as the packing reads it: f32, or a 2-byte weight widened to f32 on its way
/// into the packed panels (the weight is never widened as a whole matrix first: a prompt's
/// product over f16 weights then read every weight once, not three times).
pub trait RhsElem: Copy {
    /// Eight values from `at` (adjacent) as f32. Inlined into the packing, which has AVX2, FMA
    /// and F16C.
    unsafe fn load8(at: *const Self) -> __m256;
    fn to_f32(self) -> f32;
}

impl RhsElem for f32 {
    #[inline(always)]
    unsafe fn load8(at: *const Self) -> __m256 {
        _mm256_loadu_ps(at)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl RhsElem for f16 {
    #[inline(always)]
    unsafe fn load8(at: *const Self) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i))
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl RhsElem for bf16 {
    /// bf16 is the top half of an f32.
    #[inline(always)]
    unsafe fn load8(at: *const Self) -> __m256 {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(at as *const __m128i))))
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}
