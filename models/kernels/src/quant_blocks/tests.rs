//! The block products against plain definitions, on every kernel this CPU runs.

use super::*;

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The 32 integer values of a GGUF weight block (before its scale and minimum), in order.
fn block_values(format: BlockFormat, b: &[u8]) -> [i32; BLOCK] {
    let (_, qh_at, qs_at) = packed::source_offsets(format);
    let mut v = [0i32; BLOCK];
    if format == BlockFormat::Q8_0 {
        for (j, x) in v.iter_mut().enumerate() {
            *x = b[qs_at + j] as i8 as i32;
        }
        return v;
    }
    // Low nibbles are values 0..16, high ones 16..32; then the fifth bits and the offsets.
    let qh = qh_at.map_or(0, |at| u32::from_le_bytes(b[at..at + 4].try_into().unwrap()));
    for (j, x) in v.iter_mut().enumerate() {
        let nibble = if j < 16 { b[qs_at + j] & 0x0f } else { b[qs_at + j - 16] >> 4 } as i32;
        *x = nibble | (((qh >> j) & 1) << 4) as i32;
    }
    let offset = match format {
        BlockFormat::Q4_0 => 8,
        BlockFormat::Q5_0 => 16,
        _ => 0,
    };
    v.iter_mut().for_each(|x| *x -= offset);
    v
}

/// The dot product of a row of GGUF blocks, in plain code: the definition the packed products
/// are tested against. For the K formats, the weights as ggml dequantises them against the
/// activations' values (`d_x · q`), summed in f64.
fn dot_gguf(format: BlockFormat, w: &[u8], x: &QuantizedRow) -> f32 {
    let bb = format.block_bytes();
    if format.is_k() {
        let weights = w.chunks_exact(bb).flat_map(|b| k_packed::dequantize(format, b));
        return weights.enumerate().map(|(i, w)| w as f64 * x.d[i / BLOCK] as f64 * x.q[i] as f64).sum::<f64>() as f32;
    }
    let mut total = 0f32;
    for (i, b) in w.chunks_exact(bb).enumerate() {
        let v = block_values(format, b);
        let sumi: i32 = v.iter().zip(&x.q[i * BLOCK..(i + 1) * BLOCK]).map(|(a, b)| a * *b as i32).sum();
        total += f16_at(b, 0) * x.d[i] * sumi as f32;
        if format.has_min() {
            total += f16_at(b, 2) * x.s[i];
        }
    }
    total
}

const FORMATS: [BlockFormat; 8] = [
    BlockFormat::Q4_0,
    BlockFormat::Q4_1,
    BlockFormat::Q5_0,
    BlockFormat::Q5_1,
    BlockFormat::Q8_0,
    BlockFormat::Q4_K,
    BlockFormat::Q5_K,
    BlockFormat::Q6_K,
];

/// A row width of `blocks` 32-value blocks, or of two super-blocks for a K format.
fn width(format: BlockFormat, blocks: usize) -> usize {
    if format.is_k() {
        2 * k_packed::SUPER
    } else {
        blocks * BLOCK
    }
}

/// The plain code and every int8 kernel this CPU runs.
fn every_kernel() -> Vec<Option<Int8Kernel>> {
    std::iter::once(None).chain(Int8Kernel::runnable().into_iter().map(Some)).collect()
}

/// On every kernel, every format and tile shape (rows and activation rows that fill whole
/// tiles and ones that leave remainders) agrees with the plain dot product of each pair.
#[test]
fn block_products_match_the_plain_code_on_every_kernel() {
    for format in FORMATS {
        // Whole groups of 16 rows and a padded last one (or only that); a half group; tiles of
        // activation rows and remainders.
        for (rows, m) in [(9usize, 1usize), (8, 3), (37, 7), (4, 2), (32, 9)] {
            let cols = width(format, 4);
            let blocks = random_blocks(format, rows, cols, 7 + rows as u64);
            let w = BlockMatrix::new(format, rows, cols, blocks.clone()).unwrap();
            let x = crate::rng::signed_values(m * cols, 3 + m as u64);
            let acts: Vec<QuantizedRow> = x.chunks_exact(cols).map(|r| quantize_row_at(r, format.has_min(), SimdLevel::Scalar)).collect();
            let row_bytes = cols / format.block_values() * format.block_bytes();
            for kernel in every_kernel() {
                let y = BlockMatrix::multiply_many_on(&[&w], &x, kernel).remove(0);
                for c in 0..m {
                    for o in 0..rows {
                        let want = dot_gguf(format, &blocks[o * row_bytes..(o + 1) * row_bytes], &acts[c]);
                        let got = y[c * rows + o];
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{format:?} {kernel:?} {rows}x{m}: ({c}, {o}) {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

/// Weights at their largest and smallest values against activations at ±127: the kernels'
/// 16-bit partial sums (`vpmaddubsw`'s pairs, Q8_0's within 2 · 127 · 127 of the limit, and
/// the 5-bit formats' two pairs added before widening) do not saturate, so the products
/// still equal the plain code's.
#[test]
fn the_largest_values_do_not_saturate_the_partial_sums() {
    let rows = 32;
    for format in FORMATS {
        let cols = width(format, 8);
        // Activation rows quantising to +127, -127 and alternating ±127 in every block.
        let mut x = vec![1.0f32; cols];
        x.extend(vec![-1.0f32; cols]);
        x.extend((0..cols).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 }));
        let mut blocks = random_blocks(format, rows, cols, 3);
        // Where a block's value bits lie, and (K formats) its scales'.
        let (values, scales) = match format {
            BlockFormat::Q4_K | BlockFormat::Q5_K => (16..format.block_bytes(), 4..16),
            BlockFormat::Q6_K => (0..192, 192..208),
            _ => {
                let (_, qh_at, qs_at) = packed::source_offsets(format);
                (qh_at.unwrap_or(qs_at)..format.block_bytes(), 0..0)
            }
        };
        let largest = if format == BlockFormat::Q8_0 { 0x7f } else { 0xff };
        // Even rows at the format's largest values, odd rows at its smallest; the K formats'
        // scales at their largest (Q6_K's signed ones alternating 127 and -128).
        let per_row = cols / format.block_values();
        for (i, b) in blocks.chunks_exact_mut(format.block_bytes()).enumerate() {
            let bits = if (i / per_row).is_multiple_of(2) { largest } else { largest ^ 0xfe };
            b[values.clone()].iter_mut().for_each(|v| *v = bits);
            let scale = if format == BlockFormat::Q6_K { [0x7f, 0x80][i % 2] } else { 0xff };
            b[scales.clone()].iter_mut().for_each(|v| *v = scale);
        }
        let w = BlockMatrix::new(format, rows, cols, blocks.clone()).unwrap();
        let acts: Vec<QuantizedRow> = x.chunks_exact(cols).map(|r| quantize_row_at(r, format.has_min(), SimdLevel::Scalar)).collect();
        assert!(acts.iter().all(|a| a.q.iter().all(|q| q.abs() == 127)));
        let row_bytes = per_row * format.block_bytes();
        for kernel in every_kernel() {
            let y = BlockMatrix::multiply_many_on(&[&w], &x, kernel).remove(0);
            for (c, act) in acts.iter().enumerate() {
                for o in 0..rows {
                    let want = dot_gguf(format, &blocks[o * row_bytes..(o + 1) * row_bytes], act);
                    let got = y[c * rows + o];
                    assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "{format:?} {kernel:?}: ({c}, {o}) {got} vs {want}");
                }
            }
        }
    }
}

/// A row's result is the same bits alone and inside a prompt's batch (every tile computes
/// each pair alike), and the same on every int8 kernel: `vpdpbusd` at 512 and 256 bits and
/// `vpmaddubsw` (each that this CPU runs; CI's kinds differ in which).
#[test]
fn a_rows_result_does_not_depend_on_its_batch_or_the_int8_instructions() {
    let rows = 27;
    let kernels = Int8Kernel::runnable();
    for format in FORMATS {
        let cols = width(format, 6);
        let w = BlockMatrix::random(format, rows, cols, 5);
        let x = crate::rng::signed_values(7 * cols, 9);
        let on = |x: &[f32], k| BlockMatrix::multiply_many_on(&[&w], x, Some(k)).remove(0);
        for &kernel in &kernels {
            let batch = on(&x, kernel);
            for c in 0..7 {
                let alone = on(&x[c * cols..(c + 1) * cols], kernel);
                assert_eq!(alone, batch[c * rows..(c + 1) * rows], "{format:?} {kernel:?}: row {c}");
            }
            assert_eq!(batch, on(&x, kernels[0]), "{format:?}: {kernel:?} and {:?} differ", kernels[0]);
        }
    }
}

/// The vector quantiser rounds exactly as the plain one.
#[test]
fn activation_quantisation_is_the_same_at_every_level() {
    let x = crate::rng::signed_values(4 * BLOCK, 5);
    // Ties and zeros too: values on the half steps of a block whose max is 127.
    let mut ties: Vec<f32> = (0..BLOCK).map(|i| i as f32 - 15.5).collect();
    ties[0] = 127.0;
    let zeros = vec![0f32; BLOCK];
    for input in [x, ties, zeros] {
        let plain = quantize_row_at(&input, true, SimdLevel::Scalar);
        let best = quantize_row_at(&input, true, SimdLevel::detected());
        assert_eq!((plain.d, plain.sum, plain.half, plain.s, plain.q), (best.d, best.sum, best.half, best.s, best.q));
    }
}

/// The AVX512-VNNI kernels, their sources run on plain-code stand-ins for their instructions
/// (`avx512_stand_ins`), on any CPU: against the plain code, and the same bits as the kernels
/// this CPU runs (the tests above, where the CPU has AVX512-VNNI, run the real ones).
#[test]
fn the_avx512_kernels_on_stand_ins_match_the_plain_code() {
    for format in FORMATS {
        for (rows, m) in [(9usize, 1usize), (37, 7), (32, 9), (16, 4)] {
            let cols = width(format, 4);
            let blocks = random_blocks(format, rows, cols, 11 + rows as u64);
            let w = BlockMatrix::new(format, rows, cols, blocks.clone()).unwrap();
            let x = crate::rng::signed_values(m * cols, 5 + m as u64);
            let acts: Vec<QuantizedRow> = x.chunks_exact(cols).map(|r| quantize_row(r, format.has_min())).collect();
            let y = product_on_avx512_stand_ins(&w, &acts);
            let row_bytes = cols / format.block_values() * format.block_bytes();
            for c in 0..m {
                for o in 0..rows {
                    let want = dot_gguf(format, &blocks[o * row_bytes..(o + 1) * row_bytes], &acts[c]);
                    let got = y[c * rows + o];
                    assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "{format:?} {rows}x{m}: ({c}, {o}) {got} vs {want}");
                }
            }
            for kernel in Int8Kernel::runnable() {
                let on_cpu = BlockMatrix::multiply_many_on(&[&w], &x, Some(kernel)).remove(0);
                assert_eq!(y, on_cpu, "{format:?} {rows}x{m}: the stand-ins and {kernel:?} differ");
            }
        }
    }
}
