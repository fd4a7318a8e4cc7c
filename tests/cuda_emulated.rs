//! Our flash-attention kernels (`models/kernels/src/cuda/flash_attention.cu`) run on the CPU,
//! without a GPU: the source NVRTC compiles is compiled as C++ with `tests/cuda_emulation/emulate.h`
//! (each GPU thread a thread, the warp's shuffles and tensor-core products as collectives of 32),
//! and its forward, log-sum-exp and three gradients are compared with the CPU's attention op
//! (`ops::eager_attention`, f32, on the same half-precision inputs). This checks the kernels' tiling,
//! indexing, masking and online softmax on every CI run; `tests/cuda.rs` checks them on a GPU.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

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
    let Some(binary) = build(test) else { return };
    for case in CASES {
        check(&binary, case);
    }
}

/// The driver built with the kernel source as NVRTC gets it, or None (skipped) without g++.
fn build(test: &str) -> Option<PathBuf> {
    if Command::new("g++").arg("--version").output().is_err() {
        common::skip_or_fail(test, "g++ is not installed (apt install g++)");
        return None;
    }
    let dir = scratch("build");
    std::fs::write(dir.join("kernel.cu"), kernels::cuda::FLASH_ATTENTION.source()).unwrap();
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_emulation");
    let binary = dir.join("flash_attention");
    let out = Command::new("g++")
        .args(["-std=c++20", "-O2", "-pthread", "-include"])
        .arg(here.join("emulate.h"))
        .arg("-I")
        .arg(&dir)
        .arg(here.join("flash_attention.cpp"))
        .arg("-o")
        .arg(&binary)
        .output()
        .unwrap();
    assert!(out.status.success(), "g++ failed on the emulated kernels:\n{}", String::from_utf8_lossy(&out.stderr));
    Some(binary)
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

fn check(binary: &Path, (dtype, d, b, h, hkv, t, s, causal, window): Case) {
    let what = format!("{dtype:?} d {d}, batch {b}, heads {h}/{hkv}, T {t}, S {s}, causal {causal}, window {window}");
    let cpu = Device::Cpu;
    let offset = s - t;
    let scale = 1.0 / (d as f64).sqrt();
    // Inputs rounded to the kernel's dtype once: both sides read the same values.
    let input = |dims: (usize, usize, usize, usize)| Tensor::randn(0f32, 1.0, dims, &cpu).unwrap().to_dtype(dtype).unwrap();
    let (q, k, v, dout) = (input((b, h, t, d)), input((b, hkv, s, d)), input((b, hkv, s, d)), input((b, h, t, d)));

    let dir = scratch("run");
    for (name, x) in [("q", &q), ("k", &k), ("v", &v), ("dout", &dout)] {
        write_half_bits(&dir.join(format!("{name}.bin")), x);
    }
    let name = if dtype == DType::BF16 { "bf16" } else { "f16" };
    let args = [d, b, h, hkv, t, s, offset, causal as usize, window].map(|n| n.to_string());
    let out = Command::new(binary).arg(&dir).arg(name).args(&args).arg(format!("{scale}")).output().unwrap();
    assert!(out.status.success(), "{what}: the emulated kernels failed: {}", String::from_utf8_lossy(&out.stderr));
    let read = |file: &str| read_half(&dir.join(file), dtype);
    let (got_out, got_dq, got_dk, got_dv) = (read("out.bin"), read("dq.bin"), read("dk.bin"), read("dv.bin"));
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
    let values = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for (name, got, expected, tolerance) in [
        ("out", &got_out, values(&expected_out), tolerance),
        ("lse", &got_lse, values(&expected_lse), 1e-5),
        ("dq", &got_dq, values(grads.get(qv.as_tensor()).unwrap()), tolerance),
        ("dk", &got_dk, values(grads.get(kv.as_tensor()).unwrap()), tolerance),
        ("dv", &got_dv, values(grads.get(vv.as_tensor()).unwrap()), tolerance),
    ] {
        assert_eq!(got.len(), expected.len(), "{what}: {name}");
        let (diff, norm) =
            got.iter().zip(&expected).fold((0f64, 0f64), |(d, n), (x, y)| (d + ((x - y) as f64).powi(2), n + (*y as f64).powi(2)));
        let rel = (diff / norm.max(1e-30)).sqrt();
        eprintln!("{what}: {name} relative difference {rel:.2e}");
        assert!(rel < tolerance, "{what}: {name} differs from the CPU's by {rel} (tolerance {tolerance})");
    }
}

fn write_half_bits(path: &Path, x: &Tensor) {
    let bytes: Vec<u8> = match x.dtype() {
        DType::BF16 => x.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap().iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
        DType::F16 => x.flatten_all().unwrap().to_vec1::<half::f16>().unwrap().iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
        other => panic!("no half bits for {other:?}"),
    };
    std::fs::write(path, bytes).unwrap();
}

fn read_half(path: &Path, dtype: DType) -> Vec<f32> {
    let bits = std::fs::read(path).unwrap();
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
