// The AVX-512 kernel of the 32-value formats, and the fifth-bit step the K formats' kernel
// shares, included by two modules of `tiles`: one with `std::arch`'s intrinsics (what models
// run), one (tests) with plain-code stand-ins for them (`avx512_stand_ins`), so that every CI
// machine checks this arithmetic, AVX-512 or not. Each includer brings the names used here.

/// 16 rows' values `4k..4k + 4` (`k` of 8) with their fifth bits from `qh` (each row's u32).
#[inline(always)]
pub(crate) unsafe fn with_fifth_bits_512(v: __m512i, qh: __m512i, k: usize) -> __m512i {
    let (byte, bits) = fifth_bit_pattern(k);
    let starts = _mm512_broadcast_i32x4(_mm_loadu_si128(LANE_STARTS.as_ptr() as *const __m128i));
    let spread = _mm512_shuffle_epi8(qh, _mm512_add_epi8(starts, _mm512_set1_epi8(byte)));
    let set = _mm512_test_epi8_mask(spread, _mm512_set1_epi32(bits));
    _mm512_mask_add_epi8(v, set, v, _mm512_set1_epi8(16))
}

/// `tiles::groups_avx512`'s body (inlined into it, so that its features reach it).
#[inline(always)]
pub(super) unsafe fn groups_512<F: Format>(w: &[u8], groups: std::ops::Range<usize>, x: &[QuantizedRow], (y, rows): (*mut f32, usize)) {
    let blocks = x.first().map_or(0, |r| r.d.len());
    let group_bytes = blocks * F::LAYOUT.record;
    debug_assert!(w.len() >= groups.end * group_bytes);
    for g in groups {
        let rec0 = w.as_ptr().add(g * group_bytes);
        by_tiles!(4, x, |c0, xs| {
            for (k, v) in tile_avx512::<F, _>(rec0, blocks, xs).iter().enumerate() {
                let mut values = [0f32; GROUP];
                _mm512_storeu_ps(values.as_mut_ptr(), *v);
                put(y, rows, c0 + k, g * GROUP, &values);
            }
        });
    }
}

/// The AVX-512 kernel: the 16 rows of the group whose records start at `rec0` against the `C`
/// activation rows `x`, over `blocks` blocks.
#[inline(always)]
unsafe fn tile_avx512<F: Format, const C: usize>(rec0: *const u8, blocks: usize, x: [&QuantizedRow; C]) -> [__m512; C] {
    let l = F::LAYOUT;
    let mut y = [_mm512_setzero_ps(); C];
    let low = _mm512_set1_epi8(0x0f);
    for b in 0..blocks {
        let rec = rec0.add(b * l.record);
        let mut sums = [_mm512_setzero_si512(); C];
        // Macros, not closures, here and in `tile_avx2`: a closure has no target features, and
        // where it is not inlined (the test profile) each `vpdpbusd` in it became a call.
        macro_rules! add {
            ($w:expr, $at:expr) => {{
                let w = $w;
                for c in 0..C {
                    sums[c] = _mm512_dpbusd_epi32(sums[c], w, _mm512_set1_epi32(four_bytes(x[c], b, $at)));
                }
            }};
        }
        if F::EIGHT {
            for k in 0..8 {
                add!(_mm512_loadu_si512(rec.add(l.qs + 64 * k) as *const __m512i), 4 * k);
            }
        } else {
            for k in 0..4 {
                let chunk = _mm512_loadu_si512(rec.add(l.qs + 64 * k) as *const __m512i);
                let (mut first, mut second) = (_mm512_and_si512(chunk, low), _mm512_and_si512(_mm512_srli_epi16(chunk, 4), low));
                if let Some(at) = l.qh {
                    let qh = _mm512_loadu_si512(rec.add(at) as *const __m512i);
                    first = with_fifth_bits_512(first, qh, k);
                    second = with_fifth_bits_512(second, qh, k + 4);
                }
                add!(first, 4 * k);
                add!(second, 16 + 4 * k);
            }
        }
        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(rec as *const __m256i));
        for c in 0..C {
            let sum = _mm512_sub_epi32(sums[c], _mm512_set1_epi32(l.offset * *x[c].sum.get_unchecked(b)));
            y[c] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(*x[c].d.get_unchecked(b))), _mm512_cvtepi32_ps(sum), y[c]);
        }
        if let Some(m) = l.m {
            let mw = _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(m) as *const __m256i));
            for c in 0..C {
                y[c] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*x[c].s.get_unchecked(b)), y[c]);
            }
        }
    }
    y
}
