// The AVX512-VNNI K-format kernel, included by two modules of `k_tiles`: one with
// `std::arch`'s intrinsics (what models run), one (tests) with plain-code stand-ins for them
// (`avx512_stand_ins`), so that every CI machine checks this arithmetic, AVX-512 or not. Each
// includer brings the names used here.

/// `k_tiles::groups_avx512`'s body (inlined into it, so that its features reach it).
#[inline(always)]
pub(super) unsafe fn groups_512<F: KFormat>(w: &[u8], groups: std::ops::Range<usize>, x: &[QuantizedRow], (y, rows): (*mut f32, usize)) {
    let supers = x.first().map_or(0, |r| r.d.len() / BLOCKS);
    let group_bytes = supers * F::LAYOUT.record;
    debug_assert!(w.len() >= groups.end * group_bytes);
    for g in groups {
        let rec0 = w.as_ptr().add(g * group_bytes);
        by_tiles!(4, x, |c0, xs| {
            for (k, v) in tile_512::<F, _>(rec0, supers, xs).iter().enumerate() {
                let mut values = [0f32; GROUP];
                _mm512_storeu_ps(values.as_mut_ptr(), *v);
                put(y, rows, c0 + k, g * GROUP, &values);
            }
        });
    }
}

/// [`tile_256`](super::tile_256) with AVX512-VNNI: the group's 16 rows in one register.
#[inline(always)]
unsafe fn tile_512<F: KFormat, const C: usize>(rec0: *const u8, supers: usize, x: [&QuantizedRow; C]) -> [__m512; C] {
    let l = F::LAYOUT;
    let mut y = [_mm512_setzero_ps(); C];
    let (low, three) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(3));
    for s in 0..supers {
        let rec = rec0.add(s * l.record);
        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(rec as *const __m256i));
        let dmin = if l.dmin { _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(32) as *const __m256i)) } else { _mm512_setzero_ps() };
        for j in 0..BLOCKS {
            let b = BLOCKS * s + j;
            let blk = rec.add(l.header + j * l.block);
            let mut sums = [_mm512_setzero_si512(); C];
            let mut raw = [[_mm512_setzero_si512(); 2]; C];
            macro_rules! load {
                ($at:expr) => {
                    _mm512_loadu_si512(blk.add($at) as *const __m512i)
                };
            }
            if F::FORMAT == BlockFormat::Q6_K {
                let qh = l.qh.unwrap_or(0);
                let (mut top0, mut top1) = (load!(qh), load!(qh + 64));
                for k in 0..4 {
                    let chunk = load!(l.qs + 64 * k);
                    let first = _mm512_or_si512(_mm512_and_si512(chunk, low), _mm512_slli_epi16(_mm512_and_si512(top0, three), 4));
                    let second = _mm512_and_si512(_mm512_srli_epi16(chunk, 4), low);
                    let second = _mm512_or_si512(second, _mm512_slli_epi16(_mm512_and_si512(top1, three), 4));
                    (top0, top1) = (_mm512_srli_epi16(top0, 2), _mm512_srli_epi16(top1, 2));
                    for c in 0..C {
                        let (lo, hi) = (_mm512_set1_epi32(four_bytes(x[c], b, 4 * k)), _mm512_set1_epi32(four_bytes(x[c], b, 16 + 4 * k)));
                        raw[c][0] = _mm512_dpbusd_epi32(raw[c][0], first, lo);
                        raw[c][1] = _mm512_dpbusd_epi32(raw[c][1], second, hi);
                    }
                }
                let sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(blk as *const __m128i));
                let sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(blk.add(16) as *const __m128i));
                for c in 0..C {
                    let q0 = *x[c].half.get_unchecked(b);
                    let q1 = *x[c].sum.get_unchecked(b) - q0;
                    let first = _mm512_mullo_epi32(sc0, _mm512_sub_epi32(raw[c][0], _mm512_set1_epi32(32 * q0)));
                    let second = _mm512_mullo_epi32(sc1, _mm512_sub_epi32(raw[c][1], _mm512_set1_epi32(32 * q1)));
                    sums[c] = _mm512_add_epi32(first, second);
                }
            } else {
                for k in 0..4 {
                    let chunk = load!(l.qs + 64 * k);
                    let (mut first, mut second) = (_mm512_and_si512(chunk, low), _mm512_and_si512(_mm512_srli_epi16(chunk, 4), low));
                    if let Some(at) = l.qh {
                        let qh = load!(at);
                        first = with_fifth_bits_512(first, qh, k);
                        second = with_fifth_bits_512(second, qh, k + 4);
                    }
                    for c in 0..C {
                        let (lo, hi) = (_mm512_set1_epi32(four_bytes(x[c], b, 4 * k)), _mm512_set1_epi32(four_bytes(x[c], b, 16 + 4 * k)));
                        raw[c][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(raw[c][0], first, lo), second, hi);
                    }
                }
                let sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(blk as *const __m128i));
                for c in 0..C {
                    sums[c] = _mm512_mullo_epi32(sc, raw[c][0]);
                }
            }
            for c in 0..C {
                y[c] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(*x[c].d.get_unchecked(b))), _mm512_cvtepi32_ps(sums[c]), y[c]);
            }
            if l.dmin {
                let m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(blk.add(16) as *const __m128i)));
                let mw = _mm512_mul_ps(dmin, m);
                for c in 0..C {
                    let s = *x[c].d.get_unchecked(b) * *x[c].sum.get_unchecked(b) as f32;
                    y[c] = _mm512_fnmadd_ps(mw, _mm512_set1_ps(s), y[c]);
                }
            }
        }
    }
    y
}
