//! Plain-code stand-ins for the AVX-512 instructions of the block formats' 512-bit kernels
//! (`tiles_512.rs`, `k_tiles_512.rs`), each as Intel's manual defines it, under the intrinsics'
//! names: those kernels' sources compiled against these run on any CPU
//! (`tiles::product_groups_on_stand_ins`, `k_tiles::product_groups_on_stand_ins`), so CI
//! machines without AVX-512 check their arithmetic. The registers are byte arrays; nothing
//! here may use AVX-512 itself (no `target_feature`, and `inline(never)` keeps the compiler from
//! vectorising them inside a caller that has it).
#![allow(non_camel_case_types)]
use std::arch::x86_64::{__m128i, __m256i};

#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct __m512i(pub [u8; 64]);
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct __m512(pub [f32; 16]);

fn i32s(a: __m512i) -> [i32; 16] {
    unsafe { std::mem::transmute(a.0) }
}
fn from_i32s(v: [i32; 16]) -> __m512i {
    __m512i(unsafe { std::mem::transmute::<[i32; 16], [u8; 64]>(v) })
}
fn u16s(a: __m512i) -> [u16; 32] {
    unsafe { std::mem::transmute(a.0) }
}
fn from_u16s(v: [u16; 32]) -> __m512i {
    __m512i(unsafe { std::mem::transmute::<[u16; 32], [u8; 64]>(v) })
}
#[inline(never)]
pub fn _mm512_setzero_si512() -> __m512i {
    __m512i([0; 64])
}
#[inline(never)]
pub fn _mm512_setzero_ps() -> __m512 {
    __m512([0.0; 16])
}
#[inline(never)]
pub fn _mm512_set1_epi8(v: i8) -> __m512i {
    __m512i([v as u8; 64])
}
#[inline(never)]
pub fn _mm512_set1_epi32(v: i32) -> __m512i {
    from_i32s([v; 16])
}
#[inline(never)]
pub fn _mm512_set1_ps(v: f32) -> __m512 {
    __m512([v; 16])
}
#[inline(never)]
pub fn _mm512_and_si512(a: __m512i, b: __m512i) -> __m512i {
    __m512i(std::array::from_fn(|i| a.0[i] & b.0[i]))
}
#[inline(never)]
pub fn _mm512_or_si512(a: __m512i, b: __m512i) -> __m512i {
    __m512i(std::array::from_fn(|i| a.0[i] | b.0[i]))
}
#[inline(never)]
pub fn _mm512_srli_epi16(a: __m512i, imm: u32) -> __m512i {
    let v = u16s(a);
    from_u16s(std::array::from_fn(|i| if imm > 15 { 0 } else { v[i] >> imm }))
}
#[inline(never)]
pub fn _mm512_slli_epi16(a: __m512i, imm: u32) -> __m512i {
    let v = u16s(a);
    from_u16s(std::array::from_fn(|i| if imm > 15 { 0 } else { v[i] << imm }))
}
#[inline(never)]
pub unsafe fn _mm512_loadu_si512(p: *const __m512i) -> __m512i {
    __m512i((p as *const [u8; 64]).read_unaligned())
}
#[inline(never)]
pub fn _mm512_dpbusd_epi32(src: __m512i, a: __m512i, b: __m512i) -> __m512i {
    let s = i32s(src);
    from_i32s(std::array::from_fn(|i| {
        let mut t = s[i];
        for j in 0..4 {
            t = t.wrapping_add(a.0[4 * i + j] as i32 * b.0[4 * i + j] as i8 as i32);
        }
        t
    }))
}
#[inline(never)]
pub fn _mm512_mullo_epi32(a: __m512i, b: __m512i) -> __m512i {
    let (a, b) = (i32s(a), i32s(b));
    from_i32s(std::array::from_fn(|i| a[i].wrapping_mul(b[i])))
}
#[inline(never)]
pub fn _mm512_add_epi32(a: __m512i, b: __m512i) -> __m512i {
    let (a, b) = (i32s(a), i32s(b));
    from_i32s(std::array::from_fn(|i| a[i].wrapping_add(b[i])))
}
#[inline(never)]
pub fn _mm512_sub_epi32(a: __m512i, b: __m512i) -> __m512i {
    let (a, b) = (i32s(a), i32s(b));
    from_i32s(std::array::from_fn(|i| a[i].wrapping_sub(b[i])))
}
#[inline(never)]
pub fn _mm512_cvtepi8_epi32(a: __m128i) -> __m512i {
    let b: [u8; 16] = unsafe { std::mem::transmute(a) };
    from_i32s(std::array::from_fn(|i| b[i] as i8 as i32))
}
#[inline(never)]
pub fn _mm512_cvtepu8_epi32(a: __m128i) -> __m512i {
    let b: [u8; 16] = unsafe { std::mem::transmute(a) };
    from_i32s(std::array::from_fn(|i| b[i] as i32))
}
#[inline(never)]
pub fn _mm512_cvtph_ps(a: __m256i) -> __m512 {
    let h: [u16; 16] = unsafe { std::mem::transmute(a) };
    __m512(std::array::from_fn(|i| half::f16::from_bits(h[i]).to_f32()))
}
#[inline(never)]
pub fn _mm512_cvtepi32_ps(a: __m512i) -> __m512 {
    let v = i32s(a);
    __m512(std::array::from_fn(|i| v[i] as f32))
}
#[inline(never)]
pub fn _mm512_mul_ps(a: __m512, b: __m512) -> __m512 {
    __m512(std::array::from_fn(|i| a.0[i] * b.0[i]))
}
#[inline(never)]
pub fn _mm512_fmadd_ps(a: __m512, b: __m512, c: __m512) -> __m512 {
    __m512(std::array::from_fn(|i| a.0[i].mul_add(b.0[i], c.0[i])))
}
#[inline(never)]
pub fn _mm512_fnmadd_ps(a: __m512, b: __m512, c: __m512) -> __m512 {
    __m512(std::array::from_fn(|i| (-a.0[i]).mul_add(b.0[i], c.0[i])))
}
#[inline(never)]
pub unsafe fn _mm512_storeu_ps(p: *mut f32, a: __m512) {
    (p as *mut [f32; 16]).write_unaligned(a.0)
}

/// A mask register: a bit per byte.
pub type __mmask64 = u64;

#[inline(never)]
pub fn _mm512_add_epi8(a: __m512i, b: __m512i) -> __m512i {
    __m512i(std::array::from_fn(|i| a.0[i].wrapping_add(b.0[i])))
}
/// `vbroadcasti32x4`: the 16 bytes in each 128-bit lane.
#[inline(never)]
pub fn _mm512_broadcast_i32x4(a: __m128i) -> __m512i {
    let b: [u8; 16] = unsafe { std::mem::transmute(a) };
    __m512i(std::array::from_fn(|i| b[i % 16]))
}
/// `vpshufb`: within each 128-bit lane, byte `i` is the lane's byte at `b[i]`'s low 4 bits, or
/// 0 where `b[i]`'s top bit is set.
#[inline(never)]
pub fn _mm512_shuffle_epi8(a: __m512i, b: __m512i) -> __m512i {
    __m512i(std::array::from_fn(|i| if b.0[i] & 0x80 != 0 { 0 } else { a.0[(i / 16) * 16 + (b.0[i] & 0x0f) as usize] }))
}
/// `vptestmb`: bit `i` set where bytes `i` of `a` and `b` share a set bit.
#[inline(never)]
pub fn _mm512_test_epi8_mask(a: __m512i, b: __m512i) -> __mmask64 {
    (0..64).filter(|&i| a.0[i] & b.0[i] != 0).fold(0, |m, i| m | 1 << i)
}
/// `vpaddb` under a mask: `a + b` where `k`'s bit is set, else `src`.
#[inline(never)]
pub fn _mm512_mask_add_epi8(src: __m512i, k: __mmask64, a: __m512i, b: __m512i) -> __m512i {
    __m512i(std::array::from_fn(|i| if k >> i & 1 != 0 { a.0[i].wrapping_add(b.0[i]) } else { src.0[i] }))
}
