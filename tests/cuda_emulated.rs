//! Our CUDA kernels run on the CPU, without a GPU: the source NVRTC compiles is compiled as C++
//! with `tests/cuda_emulation/emulate.h` (each GPU thread a fiber, the first warp running ahead
//! of the others as far as the barriers let it; the warp's shuffles and tensor-core products as
//! collectives of 32) and a driver per source that launches them as the ops do, and the results
//! are compared with the CPU's ops on the same inputs:
//! - flash attention (`flash_attention.cu`): forward, log-sum-exp and the three gradients against
//!   `ops::eager_attention` in f32 (tiling, indexing, masks, the online softmax);
//! - the fused training ops (`fused.cu`): RMSNorm, SwiGLU, rope and cross-entropy, forward and
//!   backward, and the embedding table's gradient, in f32 against `ops::fused`'s,
//!   `ops::cross_entropy`'s and `ops::embedding`'s CPU ops, in bf16 rope bit for bit against
//!   candle's `rope_slow`.
//!
//! Built under AddressSanitizer and UBSan's alignment checks (a GPU faults where they stop), and
//! for a few cases under ThreadSanitizer (a missing barrier). `tests/cuda/kernels.rs` checks the
//! same kernels on a GPU.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::{DType, Device, Tensor, Var, D};

/// One problem: (dtype, head dim, batch, heads, kv heads, T, S, causal, window).
type Case = (DType, usize, usize, usize, usize, usize, usize, bool, usize);

const CASES: [Case; 7] = [
    // One tile, GQA 2:1.
    (DType::BF16, 64, 1, 2, 1, 64, 64, true, 0),
    // Rows and keys past a tile's end, batch 2.
    (DType::BF16, 64, 2, 4, 2, 100, 100, true, 0),
    // Head dim 128 in f16.
    (DType::F16, 128, 1, 2, 2, 70, 70, true, 0),
    // 37 queries at the end of 150 keys (a prefill over a cache: offset 113).
    (DType::BF16, 64, 1, 2, 2, 37, 150, true, 0),
    // A sliding window of 40.
    (DType::BF16, 64, 1, 2, 1, 130, 130, true, 40),
    // No mask, T != S.
    (DType::F16, 64, 1, 2, 2, 80, 90, false, 0),
    // dk/dv's 32-query steps at head dim 128, GQA 4:1, a window.
    (DType::BF16, 128, 1, 4, 1, 96, 96, true, 50),
];

#[test]
fn flash_attention_kernels_match_the_cpu_attention() {
    let test = "flash_attention_kernels_match_the_cpu_attention";
    let Some(binary) = build(test, &kernels::cuda::FLASH_ATTENTION, "flash_attention.cpp", Sanitizer::Memory) else { return };
    for case in CASES {
        check(&binary, case, false, false);
    }
    // Token-major (batch, len, heads, D) tensors, as the projections make them: batch 2 with GQA
    // (dk, dv through the group sum), head dim 128 without GQA (written directly), and with a
    // window and GQA 4:1.
    for i in [1, 2, 6] {
        check(&binary, CASES[i], true, false);
    }
    // The variants at head dim 64 give the default kernels' bits (the driver compares them): the
    // one-group forward (`FSDP_FLASH_FORWARD_GROUPS=1`), 32-key dq (`FSDP_FLASH_DQ_KEYS=32`) and
    // 32-query dk/dv (`FSDP_FLASH_DKV_QUERIES=32`), over rows past a block's end with GQA,
    // token-major; queries at the end of a cache; a window; f16 without a mask.
    for (i, token_major) in [(1, true), (3, false), (4, false), (5, false)] {
        check(&binary, CASES[i], token_major, true);
    }
}

/// What a driver is built to catch besides wrong values, each where a GPU would fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Sanitizer {
    /// A misaligned typed load or store, or one past a buffer's end (a GPU faults).
    Memory,
    /// Data races between the GPU threads of a block (a missing `__syncthreads`: on a GPU, results
    /// that change with timing). ThreadSanitizer, with emulate.h's barriers made of atomics.
    Races,
}

/// `driver` (in tests/cuda_emulation) built with `source` as NVRTC gets it, or None (skipped)
/// without g++. Each driver and sanitizer is compiled once for the whole test binary (two tests
/// run the flash driver under AddressSanitizer): a test asking for one being built waits for it.
fn build(test: &str, source: &kernels::cuda::RuntimeSource, driver: &'static str, sanitizer: Sanitizer) -> Option<PathBuf> {
    if Command::new("g++").arg("--version").output().is_err() {
        common::skip_or_fail(test, "g++ is not installed (apt install g++)");
        return None;
    }
    type Builds = Mutex<HashMap<(&'static str, Sanitizer), Arc<OnceLock<PathBuf>>>>;
    static BUILDS: OnceLock<Builds> = OnceLock::new();
    let slot = BUILDS.get_or_init(Default::default).lock().unwrap().entry((driver, sanitizer)).or_default().clone();
    Some(slot.get_or_init(|| compile(source, driver, sanitizer)).clone())
}

fn compile(source: &kernels::cuda::RuntimeSource, driver: &str, sanitizer: Sanitizer) -> PathBuf {
    let dir = scratch(&format!("{driver}-{sanitizer:?}"));
    std::fs::write(dir.join("kernel.cu"), source.source()).unwrap();
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_emulation");
    let binary = dir.join(driver.trim_end_matches(".cpp"));
    let sanitize: &[&str] = match sanitizer {
        Sanitizer::Memory => &["-fsanitize=alignment,address", "-fno-sanitize-recover=alignment"],
        Sanitizer::Races => &["-fsanitize=thread"],
    };
    let out = Command::new("g++")
        .args(["-std=c++20", "-O2", "-pthread"])
        .args(sanitize)
        .arg("-include")
        .arg(here.join("emulate.h"))
        .arg("-I")
        .arg(&dir)
        .arg(here.join(driver))
        .arg("-o")
        .arg(&binary)
        .output()
        .unwrap();
    assert!(out.status.success(), "g++ failed on the emulated kernels:\n{}", String::from_utf8_lossy(&out.stderr));
    binary
}

/// A fresh directory under target/tmp.
fn scratch(what: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/tmp/cuda-emulated").join(format!(
        "{what}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// One case through the emulated kernels, their tensors heads-major or (`token_major`) token-major;
/// with `variants` (head dim 64 only) the variant kernels a switch launches too (the one-group
/// forward, 32-key dq, 32-query dk/dv), whose bits must be the default's.
fn check(binary: &Path, (dtype, d, b, h, hkv, t, s, causal, window): Case, token_major: bool, variants: bool) {
    let what = format!(
        "{dtype:?} d {d}, batch {b}, heads {h}/{hkv}, T {t}, S {s}, causal {causal}, window {window}, token-major {token_major}, variants {variants}"
    );
    let cpu = Device::Cpu;
    let offset = s - t;
    let scale = 1.0 / (d as f64).sqrt();
    // Inputs rounded to the kernel's dtype once: both sides read the same values.
    let input = |dims: (usize, usize, usize, usize)| Tensor::randn(0f32, 1.0, dims, &cpu).unwrap().to_dtype(dtype).unwrap();
    let (q, k, v, dout) = (input((b, h, t, d)), input((b, hkv, s, d)), input((b, hkv, s, d)), input((b, h, t, d)));

    let dir = scratch("run");
    // Heads-major tensors to the layout the kernels are told, and back.
    let laid_out = |x: &Tensor| if token_major { x.transpose(1, 2).unwrap().contiguous().unwrap() } else { x.clone() };
    for (name, x) in [("q", &q), ("k", &k), ("v", &v), ("dout", &dout)] {
        write_values(&dir.join(format!("{name}.bin")), &laid_out(x));
    }
    let name = if dtype == DType::BF16 { "bf16" } else { "f16" };
    let args = [d, b, h, hkv, t, s, offset, causal as usize, window].map(|n| n.to_string());
    let out = Command::new(binary)
        .arg(&dir)
        .arg(name)
        .args(&args)
        .arg(format!("{scale}"))
        .arg(if token_major { "1" } else { "0" })
        .arg(if variants { "1" } else { "0" })
        .output()
        .unwrap();
    assert!(out.status.success(), "{what}: the emulated kernels failed: {}", String::from_utf8_lossy(&out.stderr));
    // (batch, heads, len, D) values of a result written for (heads, len) in the case's layout.
    let read = |file: &str, (heads, len): (usize, usize)| {
        let values = read_values(&dir.join(file), dtype);
        if !token_major {
            return values;
        }
        let x = Tensor::from_vec(values, (b, len, heads, d), &cpu).unwrap();
        common::f32_values(&x.transpose(1, 2).unwrap().contiguous().unwrap())
    };
    let (got_out, got_dq) = (read("out.bin", (h, t)), read("dq.bin", (h, t)));
    let (got_dk, got_dv) = (read("dk.bin", (hkv, s)), read("dv.bin", (hkv, s)));
    let got_lse: Vec<f32> =
        std::fs::read(dir.join("lse.bin")).unwrap().chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    let _ = std::fs::remove_dir_all(&dir);

    // The CPU: eager attention in f32 over k and v repeated to every query head.
    let f32_var = |x: &Tensor| Var::from_tensor(&x.to_dtype(DType::F32).unwrap()).unwrap();
    let (qv, kv, vv) = (f32_var(&q), f32_var(&k), f32_var(&v));
    let repeat = |x: &Tensor| x.unsqueeze(2).unwrap().broadcast_as((b, hkv, h / hkv, s, d)).unwrap().reshape((b, h, s, d)).unwrap();
    let mask = if causal { models::masks::causal_mask(t, offset, (window > 0).then_some(window), DType::F32, &cpu).unwrap() } else { None };
    let (ke, ve) = (repeat(kv.as_tensor()), repeat(vv.as_tensor()));
    let expected_out = ops::eager_attention::attention(qv.as_tensor(), &ke, &ve, mask.as_ref(), scale).unwrap();
    let loss = (&expected_out * dout.to_dtype(DType::F32).unwrap()).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let scores = (qv.as_tensor().matmul(&ke.t().unwrap()).unwrap() * scale).unwrap();
    let scores = match &mask {
        Some(m) => scores.broadcast_add(m).unwrap(),
        None => scores,
    };
    let max = scores.max_keepdim(D::Minus1).unwrap();
    let expected_lse = (scores.broadcast_sub(&max).unwrap().exp().unwrap().sum_keepdim(D::Minus1).unwrap().log().unwrap() + max).unwrap();

    // bf16 keeps 8 bits of mantissa, f16 11: the kernel rounds p to it before p · v.
    let tolerance = if dtype == DType::BF16 { 1e-2 } else { 2e-3 };
    let values = common::f32_values;
    for (name, got, expected, tolerance) in [
        ("out", &got_out, values(&expected_out), tolerance),
        ("lse", &got_lse, values(&expected_lse), 1e-5),
        ("dq", &got_dq, values(grads.get(qv.as_tensor()).unwrap()), tolerance),
        ("dk", &got_dk, values(grads.get(kv.as_tensor()).unwrap()), tolerance),
        ("dv", &got_dv, values(grads.get(vv.as_tensor()).unwrap()), tolerance),
    ] {
        assert_close(&format!("{what}: {name}"), got, &expected, tolerance);
    }
}

/// ||got - expected|| / ||expected|| under `tolerance`.
fn assert_close(what: &str, got: &[f32], expected: &[f32], tolerance: f64) {
    let rel = common::rel_norm_diff(got, expected);
    eprintln!("{what}: relative difference {rel:.2e}");
    assert!(rel < tolerance, "{what}: differs from the CPU's by {rel} (tolerance {tolerance})");
}

fn write_values(path: &Path, x: &Tensor) {
    let bytes: Vec<u8> = match x.dtype() {
        DType::F32 => x.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => x.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap().iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
        DType::F16 => x.flatten_all().unwrap().to_vec1::<half::f16>().unwrap().iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
        other => panic!("no half bits for {other:?}"),
    };
    std::fs::write(path, bytes).unwrap();
}

fn read_values(path: &Path, dtype: DType) -> Vec<f32> {
    let bits = std::fs::read(path).unwrap();
    if dtype == DType::F32 {
        return bits.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    }
    bits.chunks(2)
        .map(|c| {
            let h = u16::from_le_bytes([c[0], c[1]]);
            if dtype == DType::BF16 {
                half::bf16::from_bits(h).to_f32()
            } else {
                half::f16::from_bits(h).to_f32()
            }
        })
        .collect()
}

/// The fused training ops' kernels (`fused.cu`, launched as `ops::fused_cuda` does): RMSNorm over
/// rows of a length no multiple of a warp (dx and the weight's gradient summed over blocks),
/// SwiGLU over a length no multiple of a block, rope on heads-major and token-major rows,
/// cross-entropy over rows of 1,000 logits with ignored targets, each forward and backward. f32 within 1e-5 of `ops::fused`'s CPU ops; bf16 within 2e-2 of them,
/// and rope bit for bit what candle's `rope_slow` composes in bf16 (forward and backward).
#[test]
fn fused_kernels_match_the_cpu_ops() {
    let test = "fused_kernels_match_the_cpu_ops";
    if let Some(binary) = build(test, &kernels::cuda::FUSED, "fused.cpp", Sanitizer::Memory) {
        check_fused(&binary, &[(DType::F32, 1e-5), (DType::BF16, 2e-2)]);
    }
}

/// Every kernel of `fused.cu` through `binary`, against the CPU's ops (the test above), in each
/// (dtype, tolerance).
fn check_fused(binary: &Path, dtypes: &[(DType, f64)]) {
    let cpu = Device::Cpu;
    let random = |dims: &[usize]| Tensor::randn(0f32, 1.0, dims, &cpu).unwrap();
    // Each op's f32 inputs; both sides read them rounded to the dtype.
    let (rows, n) = (37, 96);
    let norm_inputs = [random(&[rows, n]), ((random(&[n]) * 0.1).unwrap() + 1.0).unwrap(), random(&[rows, n])];
    // 5,003 values: packs of 16 bytes and 3 left over; da's end, where db starts, off a 16-byte
    // boundary (the backward's values one at a time).
    let glu_inputs = [random(&[5003]), random(&[5003]), random(&[5003])];
    let (b, h, t, d) = (2, 3, 7, 16);
    let angles = Tensor::arange(0f32, (t * d / 2) as f32, &cpu).unwrap().reshape((t, d / 2)).unwrap() * 0.37;
    let (cos, sin) = (angles.as_ref().unwrap().cos().unwrap(), angles.unwrap().sin().unwrap());

    for &(dtype, tolerance) in dtypes {
        let held = |x: &Tensor| x.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
        let run = |op: &str, inputs: &[(&str, &Tensor)], args: &[String]| -> [Vec<f32>; 2] {
            let dir = scratch(op);
            for (name, x) in inputs {
                write_values(&dir.join(format!("{name}.bin")), &x.to_dtype(dtype).unwrap());
            }
            let name = if dtype == DType::F32 { "f32" } else { "bf16" };
            let out = Command::new(binary).arg(&dir).arg(name).arg(op).args(args).output().unwrap();
            assert!(out.status.success(), "{op} {dtype:?}: the emulated kernels failed: {}", String::from_utf8_lossy(&out.stderr));
            let got = [read_values(&dir.join("y.bin"), dtype), read_values(&dir.join("grads.bin"), dtype)];
            let _ = std::fs::remove_dir_all(&dir);
            got
        };

        // RMSNorm: y, then (dx; dw) as the kernel writes them.
        let [x, w, g] = &norm_inputs;
        let [y, grads] = run("rms_norm", &[("x", x), ("w", w), ("g", g)], &[rows.to_string(), n.to_string(), "1e-5".into()]);
        let (xv, wv) = (Var::from_tensor(&held(x)).unwrap(), Var::from_tensor(&held(w)).unwrap());
        let expected_y = ops::fused::rms_norm(xv.as_tensor(), wv.as_tensor(), 1e-5).unwrap();
        let all = (&expected_y * held(g)).unwrap().sum_all().unwrap().backward().unwrap();
        let expected_grads =
            Tensor::cat(&[all.get(xv.as_tensor()).unwrap().flatten_all().unwrap(), all.get(wv.as_tensor()).unwrap().clone()], 0).unwrap();
        assert_close(&format!("rms_norm {dtype:?}: y"), &y, &common::f32_values(&expected_y), tolerance);
        assert_close(&format!("rms_norm {dtype:?}: dx, dw"), &grads, &common::f32_values(&expected_grads), tolerance);

        // SwiGLU: y, then (da; db).
        let [a, bb, g] = &glu_inputs;
        let [y, grads] = run("swiglu", &[("a", a), ("b", bb), ("g", g)], &["5003".into()]);
        let (av, bv) = (Var::from_tensor(&held(a)).unwrap(), Var::from_tensor(&held(bb)).unwrap());
        let expected_y = ops::fused::swiglu(av.as_tensor(), bv.as_tensor()).unwrap();
        let all = (&expected_y * held(g)).unwrap().sum_all().unwrap().backward().unwrap();
        let expected_grads = Tensor::cat(&[all.get(av.as_tensor()).unwrap(), all.get(bv.as_tensor()).unwrap()], 0).unwrap();
        assert_close(&format!("swiglu {dtype:?}: y"), &y, &common::f32_values(&expected_y), tolerance);
        assert_close(&format!("swiglu {dtype:?}: da, db"), &grads, &common::f32_values(&expected_grads), tolerance);
        // The first 5,000 alone, where the backward runs in packs too: the same bits as its values
        // one at a time above (the forward ran in packs both times).
        let [y_packed, grads_packed] = run("swiglu", &[("a", a), ("b", bb), ("g", g)], &["5000".into()]);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&y_packed), bits(&y[..5000]), "swiglu {dtype:?}: y in packs and one at a time");
        let (da, db) = grads.split_at(5003);
        assert_eq!(bits(&grads_packed[..5000]), bits(&da[..5000]), "swiglu {dtype:?}: da in packs and one at a time");
        assert_eq!(bits(&grads_packed[5000..]), bits(&db[..5000]), "swiglu {dtype:?}: db in packs and one at a time");

        // Cross-entropy: per-row losses in f32, then d logits.
        let (rows, vocab) = (13, 1000);
        let logits = (random(&[rows, vocab]) * 3.0).unwrap();
        let targets: Vec<i64> = (0..rows as i64).map(|r| if r % 5 == 3 { -100 } else { (r * 379) % vocab as i64 }).collect();
        let g = random(&[rows]);
        let dir = scratch("cross_entropy");
        write_values(&dir.join("x.bin"), &logits.to_dtype(dtype).unwrap());
        std::fs::write(dir.join("targets.bin"), targets.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        write_values(&dir.join("g.bin"), &g);
        let name = if dtype == DType::F32 { "f32" } else { "bf16" };
        let out = Command::new(binary).arg(&dir).arg(name).args(["cross_entropy", &rows.to_string(), &vocab.to_string()]).output().unwrap();
        assert!(out.status.success(), "cross_entropy {dtype:?}: the emulated kernels failed: {}", String::from_utf8_lossy(&out.stderr));
        let (loss, grads) = (read_values(&dir.join("loss.bin"), DType::F32), read_values(&dir.join("grads.bin"), dtype));
        let _ = std::fs::remove_dir_all(&dir);
        let xv = Var::from_tensor(&held(&logits)).unwrap();
        let expected = ops::cross_entropy::cross_entropy_rows(xv.as_tensor(), &targets).unwrap();
        let all = (&expected * &g).unwrap().sum_all().unwrap().backward().unwrap();
        assert_close(&format!("cross_entropy {dtype:?}: loss"), &loss, &common::f32_values(&expected), 1e-5);
        assert_close(
            &format!("cross_entropy {dtype:?}: d logits"),
            &grads,
            &common::f32_values(all.get(xv.as_tensor()).unwrap()),
            tolerance,
        );

        // The embedding table's gradient: each id's rows summed in token order, the padding id's
        // left out, against the CPU op's (`ops::embedding`).
        let (tokens, n, vocab, pad) = (300, 40, 50u32, 7u32);
        let ids: Vec<u32> = (0..tokens as u32).map(|t| (t * 37 + t / 3) % vocab).collect();
        let g = random(&[tokens, n]);
        let (runs, count) = ops::embedding::id_runs(&ids, Some(pad));
        let dir = scratch("embedding");
        write_values(&dir.join("g.bin"), &g.to_dtype(dtype).unwrap());
        std::fs::write(dir.join("runs.bin"), runs.iter().flat_map(|r| r.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        let args = [tokens, count, n, vocab as usize].map(|v| v.to_string());
        let out = Command::new(binary).arg(&dir).arg(name).arg("embedding").args(&args).output().unwrap();
        assert!(out.status.success(), "embedding {dtype:?}: the emulated kernel failed: {}", String::from_utf8_lossy(&out.stderr));
        let got = read_values(&dir.join("grads.bin"), DType::F32);
        let _ = std::fs::remove_dir_all(&dir);
        let table = Var::from_tensor(&random(&[vocab as usize, n])).unwrap();
        let ids_tensor = Tensor::new(ids.as_slice(), &cpu).unwrap();
        let rows = ops::embedding::embedding(table.as_tensor(), &ids_tensor, Some(pad), None).unwrap();
        let all = (rows * held(&g)).unwrap().sum_all().unwrap().backward().unwrap();
        let expected = common::f32_values(all.get(table.as_tensor()).unwrap());
        assert!(expected[pad as usize * n..(pad as usize + 1) * n].iter().all(|v| *v == 0.0), "the padding row got a gradient");
        assert_close(&format!("embedding {dtype:?}: dw"), &got, &expected, 1e-5);

        // Rope, heads-major (b, h, t, d) and token-major (b, t, h, d): y, then g rotated back.
        for token_major in [false, true] {
            let (x, g) =
                if token_major { (random(&[b, t, h, d]), random(&[b, t, h, d])) } else { (random(&[b, h, t, d]), random(&[b, h, t, d])) };
            let heads = if token_major { h } else { 1 };
            let args = [b * h * t, t, heads, d / 2].map(|v| v.to_string());
            let [y, grads] = run("rope", &[("x", &x), ("cos", &cos), ("sin", &sin), ("g", &g)], &args);
            let rope = if token_major { ops::fused::rope_token_major } else { ops::fused::rope };
            let xv = Var::from_tensor(&held(&x)).unwrap();
            let expected_y = rope(xv.as_tensor(), &held(&cos), &held(&sin)).unwrap();
            let all = (&expected_y * held(&g)).unwrap().sum_all().unwrap().backward().unwrap();
            let what = format!("rope {dtype:?} token-major {token_major}");
            assert_close(&format!("{what}: y"), &y, &common::f32_values(&expected_y), tolerance);
            assert_close(&format!("{what}: dx"), &grads, &common::f32_values(all.get(xv.as_tensor()).unwrap()), tolerance);
            if dtype == DType::BF16 && !token_major {
                // What the GPU training ran before (candle's composition in bf16), bit for bit.
                let xv = Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap();
                let (c, s) = (cos.to_dtype(dtype).unwrap(), sin.to_dtype(dtype).unwrap());
                let composed = candle_nn::rotary_emb::rope_slow(xv.as_tensor(), &c, &s).unwrap();
                let all = (&composed * g.to_dtype(dtype).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
                assert_eq!(y, common::f32_values(&composed), "{what}: y differs from rope_slow's bits");
                assert_eq!(
                    grads,
                    common::f32_values(all.get(xv.as_tensor()).unwrap()),
                    "{what}: dx differs from rope_slow's backward bits"
                );
            }
        }
    }
}

/// One decoding problem: (dtype, head dim, heads, kv heads, window, the sequences' lengths).
type DecodeCase = (DType, usize, usize, usize, usize, &'static [usize]);

const DECODE_CASES: [DecodeCase; 4] = [
    (DType::BF16, 64, 4, 2, 0, &[1, 63, 64, 65, 200]),
    (DType::F16, 128, 8, 1, 0, &[130, 5]),
    // A group of 18 query heads: two blocks of threads.
    (DType::BF16, 64, 36, 2, 0, &[70]),
    (DType::BF16, 64, 4, 4, 50, &[130, 20]),
];

/// The decode kernel (`flash_decode` in flash_attention.cu): one query per sequence over its
/// cache blocks (64 positions each, as models::kv_cache keeps them) through a table of block
/// addresses, sequences of different lengths in one launch, against eager attention on the CPU per
/// sequence; with the new position's keys and values already in the blocks, and handed to the
/// kernel to write there itself (checked: those rows, and only those, change). Cached positions
/// past what is stored hold NaN (as stale memory might): the kernel must read none of them into
/// its sums. Groups of query heads over 16 take two blocks of threads.
#[test]
fn flash_decode_kernel_matches_the_cpu_attention() {
    let test = "flash_decode_kernel_matches_the_cpu_attention";
    let Some(binary) = build(test, &kernels::cuda::FLASH_ATTENTION, "flash_attention.cpp", Sanitizer::Memory) else { return };
    for case in DECODE_CASES {
        for append in [false, true] {
            check_decode(&binary, case, append);
        }
    }
}

fn check_decode(binary: &Path, (dtype, d, h, hkv, window, lens): DecodeCase, append: bool) {
    use kernels::paged_attention::BLOCK;
    let cpu = Device::Cpu;
    let what = format!("decode {dtype:?} d {d}, heads {h}/{hkv}, window {window}, lengths {lens:?}, appending {append}");
    let scale = 1.0 / (d as f64).sqrt();
    let dir = scratch("decode");
    let q = Tensor::randn(0f32, 1.0, (lens.len(), h, d), &cpu).unwrap().to_dtype(dtype).unwrap();
    write_values(&dir.join("q.bin"), &q);
    let (mut expected, mut new_k, mut new_v, mut stored_blocks) = (vec![], vec![], vec![], vec![]);
    for (r, &len) in lens.iter().enumerate() {
        let blocks = len.div_ceil(BLOCK);
        // Each cache: (1, kv_heads, len, d) values; stored as (blocks, kv_heads, BLOCK, d) with NaN
        // past what is stored (the last position too when the kernel is to write it).
        let stored = if append { len - 1 } else { len };
        let cache = |name: &str| {
            let values = Tensor::randn(0f32, 1.0, (1, hkv, len, d), &cpu).unwrap().to_dtype(dtype).unwrap();
            let padded = Tensor::full(f32::NAN, (1, hkv, blocks * BLOCK, d), &cpu).unwrap().to_dtype(dtype).unwrap();
            let padded = match stored {
                0 => padded,
                _ => padded.slice_assign(&[0..1, 0..hkv, 0..stored, 0..d], &values.narrow(2, 0, stored).unwrap()).unwrap(),
            };
            let layout = padded.reshape((hkv, blocks, BLOCK, d)).unwrap().transpose(0, 1).unwrap().contiguous().unwrap();
            write_values(&dir.join(format!("{name}{r}.bin")), &layout);
            (values, layout)
        };
        let ((k, k_layout), (v, v_layout)) = (cache("k"), cache("v"));
        new_k.push(k.narrow(2, len - 1, 1).unwrap().squeeze(0).unwrap().squeeze(1).unwrap());
        new_v.push(v.narrow(2, len - 1, 1).unwrap().squeeze(0).unwrap().squeeze(1).unwrap());
        stored_blocks.push((k_layout, v_layout));
        let qr = q.get(r).unwrap().reshape((1, h, 1, d)).unwrap();
        let window = (window > 0).then_some(window);
        expected.extend(common::f32_values(&common::attention::reference_attention(&qr, &k, &v, true, window, scale).unwrap()));
    }
    if append {
        write_values(&dir.join("k_new.bin"), &Tensor::stack(&new_k, 0).unwrap());
        write_values(&dir.join("v_new.bin"), &Tensor::stack(&new_v, 0).unwrap());
    }
    let name = if dtype == DType::BF16 { "bf16" } else { "f16" };
    let mut args: Vec<String> = ["decode".into(), name.into()].into();
    args.extend([d, h, hkv, window].map(|n| n.to_string()));
    args.push(format!("{scale}"));
    args.push((append as usize).to_string());
    args.extend(lens.iter().map(|n| n.to_string()));
    let out = Command::new(binary).arg(&dir).args(&args).output().unwrap();
    assert!(out.status.success(), "{what}: the emulated kernel failed: {}", String::from_utf8_lossy(&out.stderr));
    let got = read_values(&dir.join("out.bin"), dtype);
    assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite outputs (a cached position past a length was read)");
    assert_close(&what, &got, &expected, if dtype == DType::BF16 { 1e-2 } else { 2e-3 });
    if append {
        // The blocks afterwards: as stored, with the new position's rows written.
        for (r, &len) in lens.iter().enumerate() {
            for (name, stored, new) in [("k", &stored_blocks[r].0, &new_k[r]), ("v", &stored_blocks[r].1, &new_v[r])] {
                let (b, at) = ((len - 1) / BLOCK, (len - 1) % BLOCK);
                let want = stored.slice_assign(&[b..b + 1, 0..hkv, at..at + 1, 0..d], &new.reshape((1, hkv, 1, d)).unwrap()).unwrap();
                let after = read_values(&dir.join(format!("{name}{r}.out")), dtype);
                let same =
                    after.iter().zip(common::f32_values(&want)).all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()));
                assert!(same, "{what}: sequence {r}'s {name} blocks after the kernel are not the stored ones plus the new position");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The kernels under ThreadSanitizer: no two GPU threads of a block touch the same memory without
/// a barrier between them (shared-memory tiles refilled while a warp still reads them, partial
/// sums read before every warp wrote its own), which on a GPU gives results that change with
/// timing and here may pass the value checks by luck of the schedule. The same checks as above on
/// a few cases: flash attention's forward, backward and variants (GQA, token-major, rows past a
/// block; head dim 128), decoding (two blocks a kv head; appending), every fused kernel in bf16.
#[test]
fn the_kernels_have_no_data_races() {
    let test = "the_kernels_have_no_data_races";
    let Some(flash) = build(test, &kernels::cuda::FLASH_ATTENTION, "flash_attention.cpp", Sanitizer::Races) else { return };
    check(&flash, CASES[1], true, true);
    check(&flash, CASES[2], false, false);
    check_decode(&flash, DECODE_CASES[2], true);
    let Some(fused) = build(test, &kernels::cuda::FUSED, "fused.cpp", Sanitizer::Races) else { return };
    check_fused(&fused, &[(DType::BF16, 2e-2)]);
}
