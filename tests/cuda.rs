//! The GPU proofs: the fixtures' logits and gradients on CUDA against the CPU (f32 within 1e-4,
//! bf16 within bf16 rounding), fine-tuning on the GPU reproducing the CPU loss curve, and the
//! NCCL backend at world size 1 through the multi-GPU code path (TCP rendezvous of the unique
//! ids, communicators on candle's stream, all-gathers and reduce-scatters of real units), and
//! `--auto-find-batch-size` recovering from a real out-of-memory error.
//!
//! Built only with `--features cuda` (the NCCL tests with `nccl`): `tests/gpu/build-cuda.sh` makes
//! the binary and `tests/gpu/run.sh check` runs it on the GPU machine. There is no skipping: on a
//! machine without a GPU these tests fail.
#![cfg(feature = "cuda")]

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use common::*;
use fsdp_app::dist::local::LocalGroup;
use fsdp_app::fsdp::engine::{FsdpEngine, FsdpOptions, ProcessGroups};
use fsdp_app::fsdp::optim::AdamWConfig;
use fsdp_app::fsdp::plan::{plan_units, ShardingStrategy, WrapPolicy};
use fsdp_app::model_files::{load_model, resolve_model};
use fsdp_app::train::finetune::run_local;
use fsdp_app::train::loss::{next_token_targets, summed_token_loss};
use models::StageContext;

fn gpu() -> Device {
    Device::new_cuda(0).expect("these tests need an NVIDIA GPU and its driver")
}

/// ||a - b|| / ||b|| over all values.
fn rel_norm_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut d, mut n) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        d += ((x - y) as f64).powi(2);
        n += (*y as f64).powi(2);
    }
    (d / n.max(1e-30)).sqrt()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// Each of `names`' values that `run` makes on the GPU in f32 (within 1e-5 relative) and bf16
/// (within 2e-2) against what it makes on the CPU in f32.
fn gpu_matches_cpu<const N: usize>(what: &str, names: [&str; N], run: impl Fn(&Device, DType) -> [Vec<f32>; N]) {
    let expected = run(&Device::Cpu, DType::F32);
    for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
        for (name, (g, e)) in names.iter().zip(run(&gpu(), dtype).iter().zip(&expected)) {
            let diff = rel_norm_diff(g, e);
            eprintln!("{what} {dtype:?}: {name} relative difference {diff:.2e}");
            assert!(diff < tolerance, "{what} {dtype:?}: {name} differs from the CPU op by {diff}");
        }
    }
}

#[test]
fn logits_on_cuda_match_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = gpu();
    for name in fsdp_app::fixtures::FIXTURE_NAMES {
        let dir = fixture(name, tmp.path());
        let files = || resolve_model(dir.to_str().unwrap(), None).unwrap();
        let cpu = load_model(files(), DType::F32, &Device::Cpu).unwrap();
        let ids: Vec<u32> = (0..2 * 24).map(|i| (i * 37 + 11) % 384).collect();
        let expected = values(&cpu.model.forward(&Tensor::from_vec(ids.clone(), (2, 24), &Device::Cpu).unwrap()).unwrap());
        for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::BF16, 3e-2)] {
            let on_gpu = load_model(files(), dtype, &dev).unwrap();
            let got = values(&on_gpu.model.forward(&Tensor::from_vec(ids.clone(), (2, 24), &dev).unwrap()).unwrap());
            let d = rel_norm_diff(&got, &expected);
            eprintln!("{name} {dtype:?}: logits relative difference {d:.2e}");
            assert!(d < tolerance, "{name} {dtype:?}: CUDA logits differ from CPU by {d} (relative norm)");
        }
    }
}

/// An attention as the test below runs it: (q, k, v, mask) -> out.
type Attention<'a> = dyn Fn(&Tensor, &Tensor, &Tensor, Option<&Tensor>) -> candle_core::Result<Tensor> + 'a;

/// Eager attention's softmax kernels (`models/kernels/src/cuda/attention_softmax.cu`): values and q, k, v
/// gradients against the same attention composed of candle's ops on the GPU in f32, for a
/// causal mask with a cache offset and a window, a per-sequence (broadcast over heads) mask, and
/// no mask, over rows of a length that is no multiple of a warp.
#[test]
fn attention_softmax_kernels_match_composed_ops() {
    use candle_core::{Var, D};
    let dev = gpu();
    let (b, h, t, s, d) = (2, 3, 5, 37, 16);
    let scale = 1.0 / (d as f64).sqrt();
    let causal: Vec<f32> =
        (0..t * s).map(|i| if i % s > i / s + (s - t) || i % s + 20 < i / s + (s - t) { f32::NEG_INFINITY } else { 0.0 }).collect();
    let causal = Tensor::from_vec(causal, (t, s), &dev).unwrap();
    let per_sequence: Vec<f32> =
        (0..b * t * s).map(|i| if i % s < 3 * (i / (t * s)) { f32::NEG_INFINITY } else { (i % 7) as f32 * 0.1 }).collect();
    let per_sequence = Tensor::from_vec(per_sequence, (b, 1, t, s), &dev).unwrap();
    let composed = |q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>| {
        let scores = (q.matmul(&k.t()?)? * scale)?;
        let scores = match mask {
            Some(m) => scores.broadcast_add(m)?,
            None => scores,
        };
        candle_nn::ops::softmax(&scores, D::Minus1)?.matmul(v)
    };
    let inputs = [(b, h, t, d), (b, h, s, d), (b, h, s, d)].map(|shape| Tensor::randn(0f32, 1.0, shape, &dev).unwrap());
    let probe = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
    let run = |dtype: DType, mask: Option<&Tensor>, f: &Attention<'_>| {
        let vars: Vec<Var> = inputs.iter().map(|x| Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap()).collect();
        let mask = mask.map(|m| m.to_dtype(dtype).unwrap());
        let out = f(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor(), mask.as_ref()).unwrap();
        let grads = (out.to_dtype(DType::F32).unwrap() * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let mut all = vec![values(&out)];
        all.extend(vars.iter().map(|v| values(grads.get(v.as_tensor()).unwrap())));
        all
    };
    for (what, mask) in [("causal with offset and window", Some(&causal)), ("per sequence", Some(&per_sequence)), ("none", None)] {
        let expected = run(DType::F32, mask, &|q, k, v, m| composed(q, k, v, m));
        for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            let got = run(dtype, mask, &|q, k, v, m| ops::eager_attention::attention(q, k, v, m, scale));
            for (name, (g, e)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&expected)) {
                let diff = rel_norm_diff(g, e);
                eprintln!("mask {what}, {dtype:?}: {name} relative difference {diff:.2e}");
                assert!(diff < tolerance, "mask {what}, {dtype:?}: {name} differs from candle's composed ops by {diff}");
            }
        }
    }
}

/// Flash attention (`models/kernels/src/cuda/flash_attention.cu`, tensor cores): values and q, k,
/// v gradients against eager attention on the CPU in f32 over k and v repeated to every query
/// head, bf16 and f16, head dims 64 and 128, causal over a cache offset, a window, GQA, no mask,
/// lengths that are no multiple of the kernels' 64-row tiles. `tests/cuda_emulated.rs` runs the
/// same kernels on the CPU.
#[test]
fn flash_attention_matches_cpu_attention() {
    use candle_core::Var;
    use ops::flash_attention::{attention, Visibility};
    let dev = gpu();
    // (head dim, batch, heads, kv heads, T, S, causal, window)
    let cases = [
        (64, 2, 4, 2, 100, 100, true, None),
        (128, 1, 4, 1, 96, 200, true, Some(50)),
        (64, 1, 2, 2, 37, 150, true, None),
        (128, 1, 2, 2, 80, 90, false, None),
        (64, 1, 32, 4, 1024, 1024, true, None),
    ];
    for (d, b, h, hkv, t, s, causal, window) in cases {
        let visibility = Visibility { causal, offset: s - t, window };
        let scale = 1.0 / (d as f64).sqrt();
        for (dtype, tolerance) in [(DType::BF16, 1e-2), (DType::F16, 2e-3)] {
            let what = format!("{dtype:?} d {d}, heads {h}/{hkv}, T {t}, S {s}, {visibility:?}");
            let inputs = [(b, h, t, d), (b, hkv, s, d), (b, hkv, s, d)]
                .map(|shape| Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap());
            let probe = Tensor::randn(0f32, 1.0, (b, h, t, d), &Device::Cpu).unwrap();
            let run = |device: &Device, dtype: DType, f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>| {
                let vars: Vec<Var> =
                    inputs.iter().map(|x| Var::from_tensor(&x.to_dtype(dtype).unwrap().to_device(device).unwrap()).unwrap()).collect();
                let out = f(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor()).unwrap();
                let probe = probe.to_device(device).unwrap();
                let grads = (out.to_dtype(DType::F32).unwrap() * &probe).unwrap().sum_all().unwrap().backward().unwrap();
                let mut all = vec![values(&out)];
                all.extend(vars.iter().map(|v| values(grads.get(v.as_tensor()).unwrap())));
                all
            };
            let expected = run(&Device::Cpu, DType::F32, &|q, k, v| common::attention::reference_attention(q, k, v, causal, window, scale));
            let got = run(&dev, dtype, &|q, k, v| attention(q, k, v, visibility, scale));
            for (name, (g, e)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&expected)) {
                let diff = rel_norm_diff(g, e);
                eprintln!("{what}: {name} relative difference {diff:.2e}");
                assert!(diff < tolerance, "{what}: {name} differs from the CPU's attention by {diff}");
            }
        }
    }
}

/// Decoding over the KV cache on the GPU (`flash_decode`): one query per sequence over real
/// `LayerKvCache`s of different lengths (blocks of 64 positions, filled by `append`), all
/// sequences in one launch, against eager attention on the CPU in f32 per sequence; bf16 and f16,
/// GQA 8:1, with and without a sliding window.
#[test]
fn flash_decode_matches_cpu_attention() {
    use models::LayerKvCache;
    let dev = gpu();
    let (h, hkv, d) = (32, 4, 64);
    let lens = [1usize, 63, 64, 65, 200, 1000];
    let scale = 1.0 / (d as f64).sqrt();
    for (dtype, tolerance) in [(DType::BF16, 1e-2), (DType::F16, 2e-3)] {
        for window in [None, Some(100)] {
            let what = format!("decode {dtype:?}, window {window:?}");
            let q = Tensor::randn(0f32, 1.0, (lens.len(), h, 1, d), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let kvs: Vec<(Tensor, Tensor)> = lens
                .iter()
                .map(|&len| {
                    let kv = || Tensor::randn(0f32, 1.0, (1, hkv, len, d), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
                    (kv(), kv())
                })
                .collect();
            let mut expected = vec![];
            for (r, (k, v)) in kvs.iter().enumerate() {
                let qr = q.narrow(0, r, 1).unwrap();
                expected.extend(values(&common::attention::reference_attention(&qr, k, v, true, window, scale).unwrap()));
            }
            for write_new in [false, true] {
                // Appended in parts, as a prompt and then tokens come; with `write_new` the last
                // position is only counted (`grow`) and the kernel writes it.
                let mut caches: Vec<LayerKvCache> = kvs
                    .iter()
                    .map(|(k, v)| {
                        let mut cache = LayerKvCache::default();
                        let len = k.dim(2).unwrap();
                        let stored = if write_new { len - 1 } else { len };
                        for (from, n) in [(0, stored / 2), (stored / 2, stored - stored / 2)].into_iter().filter(|(_, n)| *n > 0) {
                            let part = |x: &Tensor| x.narrow(2, from, n).unwrap().to_device(&dev).unwrap();
                            cache.append(&part(k), &part(v)).unwrap();
                        }
                        cache
                    })
                    .collect();
                let last = |x: &Tensor| x.narrow(2, x.dim(2).unwrap() - 1, 1).unwrap();
                let new_k = Tensor::cat(&kvs.iter().map(|(k, _)| last(k)).collect::<Vec<_>>(), 0).unwrap().to_device(&dev).unwrap();
                let new_v = Tensor::cat(&kvs.iter().map(|(_, v)| last(v)).collect::<Vec<_>>(), 0).unwrap().to_device(&dev).unwrap();
                if write_new {
                    for cache in caches.iter_mut() {
                        cache.grow((hkv, d), dtype, &dev).unwrap();
                    }
                }
                let tables: Vec<_> = caches.iter().map(|c| (c.blocks(), c.seq_len())).collect();
                let new = write_new.then_some((&new_k, &new_v));
                let got = ops::flash_attention::decode(&q.to_device(&dev).unwrap(), new, &tables, scale, window).unwrap();
                assert_eq!(got.dims(), [lens.len(), 1, h * d]);
                let diff = rel_norm_diff(&values(&got), &expected);
                eprintln!("{what}, the kernel writing the new position {write_new}: relative difference {diff:.2e}");
                assert!(
                    diff < tolerance,
                    "{what}, the kernel writing the new position {write_new}: differs from the CPU's attention by {diff}"
                );
                if write_new {
                    // The caches now hold every position, as appending them would have made them.
                    for (cache, (k, v)) in caches.iter().zip(&kvs) {
                        let (ck, cv) = cache.all().unwrap();
                        assert_eq!(values(&ck), values(k), "{what}: keys in the cache after the kernel wrote the new position");
                        assert_eq!(values(&cv), values(v), "{what}: values in the cache after the kernel wrote the new position");
                    }
                }
            }
        }
    }
}

/// The training linear op on the GPU (`ops::linear`: cuBLAS reading wᵀ in place, dW one product
/// of gyᵀ and x): y, dx and dW against the CPU op in f32, for 3-d inputs and the heads form, dW
/// through candle's store and through a sink; bf16 within its rounding.
#[test]
fn linear_op_on_cuda_matches_cpu() {
    use candle_core::Var;
    use ops::weight_grads::{WeightGradTarget, WeightGrads};
    let dev = gpu();
    let (x, w, probe) = (
        Tensor::randn(0f32, 1.0, (2, 33, 48), &Device::Cpu).unwrap(),
        Tensor::randn(0f32, 0.5, (40, 48), &Device::Cpu).unwrap(),
        Tensor::randn(0f32, 1.0, (2, 33, 40), &Device::Cpu).unwrap(),
    );
    // (y, dx, dW) on `device` in `dtype`, with dW through a sink or candle's store.
    let run = |device: &Device, dtype: DType, sink: bool, heads: bool| {
        let xv = Var::from_tensor(&x.to_device(device).unwrap().to_dtype(dtype).unwrap()).unwrap();
        let wv = Var::from_tensor(&w.to_device(device).unwrap().to_dtype(dtype).unwrap()).unwrap();
        let store = WeightGrads::new();
        let to = sink.then(|| WeightGradTarget { sink: store.clone(), name: "w".into() });
        let y = match heads {
            true => ops::linear::linear_heads_to(xv.as_tensor(), wv.as_tensor(), 4, to).unwrap().reshape((2, 33, 40)).unwrap(),
            false => ops::linear::linear_to(xv.as_tensor(), wv.as_tensor(), to).unwrap(),
        };
        let grads = (y.to_dtype(DType::F32).unwrap() * probe.to_device(device).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
        let dw = match sink {
            true => store.take("w").expect("the sink got dW").into_tensor(device).unwrap(),
            false => grads.get(wv.as_tensor()).unwrap().clone(),
        };
        [values(&y), values(grads.get(xv.as_tensor()).unwrap()), values(&dw)]
    };
    let expected = run(&Device::Cpu, DType::F32, false, false);
    for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
        for (sink, heads) in [(false, false), (true, false), (true, true)] {
            for (name, (g, e)) in ["y", "dx", "dW"].iter().zip(run(&dev, dtype, sink, heads).iter().zip(&expected)) {
                let diff = rel_norm_diff(g, e);
                eprintln!("{dtype:?}, sink {sink}, heads {heads}: {name} relative difference {diff:.2e}");
                assert!(diff < tolerance, "{dtype:?}, sink {sink}, heads {heads}: {name} differs from the CPU op by {diff}");
            }
        }
    }
}

/// RMSNorm's kernels (`models/kernels/src/cuda/fused.cu`): y, dx and the weight's gradient
/// against the CPU op in f32, over rows that fill no whole block of warps and a row length
/// that is no multiple of a warp; bf16 within its rounding.
#[test]
fn rms_norm_kernels_match_cpu() {
    use candle_core::Var;
    let x = Tensor::randn(0f32, 1.0, (3, 37, 200), &Device::Cpu).unwrap();
    let w = (Tensor::randn(0f32, 0.2, 200, &Device::Cpu).unwrap() + 1.0).unwrap();
    let probe = Tensor::randn(0f32, 1.0, (3, 37, 200), &Device::Cpu).unwrap();
    let run = |device: &Device, dtype: DType| {
        let xv = Var::from_tensor(&x.to_device(device).unwrap().to_dtype(dtype).unwrap()).unwrap();
        let wv = Var::from_tensor(&w.to_device(device).unwrap().to_dtype(dtype).unwrap()).unwrap();
        assert!(ops::fused::rms_norm_applies(xv.as_tensor(), wv.as_tensor()), "{device:?} {dtype:?}");
        let y = ops::fused::rms_norm(xv.as_tensor(), wv.as_tensor(), 1e-5).unwrap();
        let grads = (y.to_dtype(DType::F32).unwrap() * probe.to_device(device).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
        [values(&y), values(grads.get(xv.as_tensor()).unwrap()), values(grads.get(wv.as_tensor()).unwrap())]
    };
    gpu_matches_cpu("rms_norm", ["y", "dx", "dw"], run);
}

/// SwiGLU's kernels (`models/kernels/src/cuda/fused.cu`): y, da and db against the CPU op in f32,
/// over a length that fills no whole block; bf16 within its rounding.
#[test]
fn swiglu_kernels_match_cpu() {
    use candle_core::Var;
    let inputs = [3.0, 1.0].map(|scale| Tensor::randn(0f32, scale, (3, 37, 129), &Device::Cpu).unwrap());
    let probe = Tensor::randn(0f32, 1.0, (3, 37, 129), &Device::Cpu).unwrap();
    let run = |device: &Device, dtype: DType| {
        let [a, b] = inputs.clone().map(|t| Var::from_tensor(&t.to_device(device).unwrap().to_dtype(dtype).unwrap()).unwrap());
        assert!(ops::fused::swiglu_applies(a.as_tensor(), b.as_tensor()), "{device:?} {dtype:?}");
        let y = ops::fused::swiglu(a.as_tensor(), b.as_tensor()).unwrap();
        let grads = (y.to_dtype(DType::F32).unwrap() * probe.to_device(device).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
        [values(&y), values(grads.get(a.as_tensor()).unwrap()), values(grads.get(b.as_tensor()).unwrap())]
    };
    gpu_matches_cpu("swiglu", ["y", "da", "db"], run);
}

/// Rope's kernel (`models/kernels/src/cuda/fused.cu`): y and dx against the CPU op in f32, for
/// heads-major and token-major rows; bf16 within its rounding.
#[test]
fn rope_kernel_matches_cpu() {
    use candle_core::Var;
    let (b, h, t, d) = (2, 3, 37, 64);
    let angles = (Tensor::arange(0f32, (t * d / 2) as f32, &Device::Cpu).unwrap().reshape((t, d / 2)).unwrap() * 0.37).unwrap();
    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
    for token_major in [false, true] {
        let dims = if token_major { (b, t, h, d) } else { (b, h, t, d) };
        let x = Tensor::randn(0f32, 1.0, dims, &Device::Cpu).unwrap();
        let probe = Tensor::randn(0f32, 1.0, dims, &Device::Cpu).unwrap();
        let run = |device: &Device, dtype: DType| {
            let on = |t: &Tensor| t.to_device(device).unwrap().to_dtype(dtype).unwrap();
            let xv = Var::from_tensor(&on(&x)).unwrap();
            let (c, s) = (on(&cos), on(&sin));
            assert!(ops::fused::rope_applies(xv.as_tensor(), &c), "{device:?} {dtype:?}");
            let rope = if token_major { ops::fused::rope_token_major } else { ops::fused::rope };
            let y = rope(xv.as_tensor(), &c, &s).unwrap();
            let grads =
                (y.to_dtype(DType::F32).unwrap() * probe.to_device(device).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
            [values(&y), values(grads.get(xv.as_tensor()).unwrap())]
        };
        gpu_matches_cpu(&format!("rope (token-major {token_major})"), ["y", "dx"], run);
    }
}

/// Cross-entropy's kernels (`models/kernels/src/cuda/fused.cu`, `ops::cross_entropy`): per-row
/// losses and d logits against the CPU op in f32 over a 32,000-token vocabulary with ignored
/// targets; bf16 logits within their rounding.
#[test]
fn cross_entropy_kernels_match_cpu() {
    use candle_core::Var;
    let (rows, vocab) = (37, 32000);
    let logits = (Tensor::randn(0f32, 1.0, (rows, vocab), &Device::Cpu).unwrap() * 3.0).unwrap();
    let targets: Vec<i64> = (0..rows as i64).map(|r| if r % 7 == 2 { -100 } else { (r * 7919) % vocab as i64 }).collect();
    let probe = Tensor::randn(0f32, 1.0, rows, &Device::Cpu).unwrap();
    let run = |device: &Device, dtype: DType| {
        let x = Var::from_tensor(&logits.to_device(device).unwrap().to_dtype(dtype).unwrap()).unwrap();
        assert!(ops::cross_entropy::applies(x.as_tensor()), "{device:?} {dtype:?}");
        let loss = ops::cross_entropy::cross_entropy_rows(x.as_tensor(), &targets).unwrap();
        let grads = (&loss * probe.to_device(device).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
        [values(&loss), values(grads.get(x.as_tensor()).unwrap())]
    };
    gpu_matches_cpu("cross-entropy", ["loss", "d logits"], run);
}

/// The AdamW kernel (`models/kernels/src/cuda/adamw.cu`) against the host loop (`optim::adamw_step`) over three
/// steps of a chunk that is no multiple of a block, with and without weight decay and clipping:
/// the same IEEE operations, so the same values (checked to 1e-5 relative, the values whose bits differ counted).
#[test]
fn adamw_kernel_matches_the_host_loop() {
    use fsdp_app::fsdp::optim::{adamw_step, AdamWState};
    let dev = gpu();
    let n = 1000 * 257 + 3;
    let cfg = AdamWConfig { lr: 1e-3, weight_decay: 0.1, ..Default::default() };
    let wave = |seed: f32| (0..n).map(|i| (i as f32 * 0.37 + seed).sin() * 0.5).collect::<Vec<f32>>();
    for (weight_decay, clip) in [(0.1, Some(0.25f32)), (0.0, None)] {
        let mut host_param = wave(1.0);
        let mut host_state = AdamWState::new(n);
        let mut param = Tensor::from_slice(&host_param, n, &dev).unwrap();
        let (m, v) = (Tensor::zeros(n, DType::F32, &dev).unwrap(), Tensor::zeros(n, DType::F32, &dev).unwrap());
        for step in 1..=3u64 {
            let mut grad = wave(step as f32 * 2.0);
            let g = Tensor::from_slice(&grad, n, &dev).unwrap();
            param = fsdp_app::fsdp::adamw_cuda::adamw_step(&cfg, cfg.lr, weight_decay, step, clip, &param, &g, &m, &v).unwrap();
            adamw_step(&cfg, cfg.lr, weight_decay, step, &mut host_param, &mut grad, &mut host_state, clip);
        }
        for (what, got, want) in
            [("param", &param, &host_param), ("exp_avg", &m, &host_state.exp_avg), ("exp_avg_sq", &v, &host_state.exp_avg_sq)]
        {
            let got = values(got);
            let differ = got.iter().zip(want.iter()).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            let worst = got.iter().zip(want.iter()).map(|(a, b)| ((a - b).abs() / b.abs().max(1e-6)) as f64).fold(0f64, f64::max);
            eprintln!(
                "wd {weight_decay} clip {clip:?}: {what} differs from the host loop in {differ} of {n} values, worst relative {worst:.2e}"
            );
            assert!(worst <= 1e-5, "wd {weight_decay} clip {clip:?}: {what} differs from the host loop by {worst}");
        }
    }
}

/// A world-1 engine over fixture `dir`, weights loaded, computing on `device` in `param_dtype`.
fn engine_for(dir: &Path, device: &Device, param_dtype: DType, ac: bool) -> FsdpEngine {
    let files = resolve_model(dir.to_str().unwrap(), None).unwrap();
    let cfg = fsdp_app::model_files::read_model_config(&files.config).unwrap();
    let staged: Arc<dyn models::StagedModel> = Arc::new(models::LlamaStages::new(&cfg, None));
    let plan = plan_units(staged.as_ref(), WrapPolicy::TransformerBased, 1).unwrap();
    let g = |_: ()| -> Arc<dyn fsdp_app::dist::Collective> { Arc::new(LocalGroup::create(1, Duration::from_secs(10)).pop().unwrap()) };
    let groups = ProcessGroups { world: g(()), shard: g(()), replicate: g(()) };
    let opts = FsdpOptions { strategy: ShardingStrategy::FullShard, activation_checkpointing: ac, param_dtype, reduce_dtype: DType::F32 };
    let mut engine =
        FsdpEngine::new(staged, plan, groups, opts, AdamWConfig::default(), false).unwrap().with_device(device.clone(), true).unwrap();
    let mut stored = HashMap::new();
    for p in &files.weights {
        for (k, t) in candle_core::safetensors::load(p, &Device::Cpu).unwrap() {
            stored.insert(k, t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap());
        }
    }
    for u in 0..engine.units().count() {
        engine.load_unit(u, Some(stored.clone())).unwrap();
    }
    engine
}

#[test]
fn gradients_on_cuda_match_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = gpu();
    for name in fsdp_app::fixtures::FIXTURE_NAMES {
        let dir = fixture(name, tmp.path());
        let ids: Vec<u32> = (0..4 * 16).map(|i| (i * 53 + 7) % 384).collect();
        let labels: Vec<i64> = ids.iter().enumerate().map(|(i, &t)| if i % 16 < 3 { -100 } else { t as i64 }).collect();
        let targets = (0..4).map(|b| labels[b * 16 + 1..(b + 1) * 16].iter().filter(|&&x| x != -100).count()).sum::<usize>() as f64;
        let grads = |device: &Device, dtype: DType, ac: bool| {
            let mut engine = engine_for(&dir, device, dtype, ac);
            let input = Tensor::from_vec(ids.clone(), (4, 16), device).unwrap();
            let ctx = StageContext { targets: Some(next_token_targets(&labels, 4, 16)), ..Default::default() };
            let loss = engine.forward_backward(&input, &ctx, &summed_token_loss, 1.0 / targets).unwrap();
            (loss, engine.grad_chunks())
        };
        let (cpu_loss, cpu) = grads(&Device::Cpu, DType::F32, false);
        for (dtype, ac, tolerance) in [(DType::F32, false, 1e-4), (DType::F32, true, 1e-4), (DType::BF16, true, 5e-2)] {
            let (loss, got) = grads(&dev, dtype, ac);
            let dl = (loss - cpu_loss).abs() / cpu_loss;
            assert!(dl < tolerance, "{name} {dtype:?}: loss {loss} vs CPU {cpu_loss}");
            let mut worst = (0.0, String::new());
            let mut off = vec![];
            for (k, g) in &cpu {
                assert!(g.iter().any(|x| *x != 0.0), "{name}: {k} got no gradient on CPU");
                let d = rel_norm_diff(&got[k], g);
                if d > worst.0 {
                    worst = (d, k.clone());
                }
                if d >= tolerance {
                    off.push(k.clone());
                }
            }
            eprintln!("{name} {dtype:?} ac {ac}: loss rel diff {dl:.2e}, worst gradient rel diff {:.2e} ({})", worst.0, worst.1);
            off.sort();
            assert!(
                off.is_empty(),
                "{name} {dtype:?} ac {ac}: {} of {} gradients differ from CPU (worst {} by {}): {off:?}",
                off.len(),
                cpu.len(),
                worst.1,
                worst.0
            );
        }
    }
}

/// 12 AdamW steps on the GPU (f32) follow the CPU run, on 1 rank and on 2 rank threads sharing it.
#[test]
fn finetuning_on_cuda_follows_the_cpu_loss_curve() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let cpu = run_local(&reference_training_config(&model, &tmp.path().join("cpu"))).unwrap();
    for world in [1usize, 2] {
        let mut c = reference_training_config(&model, &tmp.path().join(format!("gpu{world}")));
        c.device = fsdp_app::device::DeviceSpec::Cuda(Some(0));
        c.world_size = world;
        c.batch_size = 4 / world;
        c.activation_checkpointing = world == 2;
        let run = run_local(&c).unwrap();
        let d = run.losses.iter().zip(&cpu.losses).map(|(a, b)| (a - b).abs() / b).fold(0.0, f64::max);
        eprintln!("world {world}: GPU losses {:?}\nCPU losses {:?}\nmax rel diff {d:.2e}", run.losses, cpu.losses);
        assert!(d < 2e-4, "world {world}: GPU losses differ from CPU by {d}");
    }
}

/// `--auto-find-batch-size` on a GPU: a micro-batch of 64 rows of 2,048 tokens through 40 layers
/// runs out of memory for real (without checkpointing each layer keeps its activations: some
/// 40 tensors of 64 x 2048 x 512 f32 values, 268 MB each; 8 layers fitted an H200 once the
/// attention scores were no longer kept), and the error says so; the auto run's trial
/// steps run out, are discarded and retried with half until one fits, and its losses are those
/// of the same global batch taken one row at a time.
#[test]
fn auto_batch_size_retries_a_step_that_ran_out_of_gpu_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture_with(
        "llama",
        &tmp.path().join("long-context"),
        &[
            ("max_position_embeddings", 2048),
            ("hidden_size", 512),
            ("intermediate_size", 1024),
            ("num_hidden_layers", 40),
            ("num_attention_heads", 8),
            ("num_key_value_heads", 8),
        ],
    );
    let data = tmp.path().join("rows.jsonl");
    let rows: String = (0..128u32)
        .map(|r| {
            // Rows as long as the sequence: a batch is padded only to its longest row. (Not 4,096:
            // 64 x 8 heads x 4096^2 scores are more values than candle's GPU kernels index.)
            let ids: Vec<u32> = (0..2048u32).map(|i| 3 + (i * 7 + r * 13) % 200).collect();
            format!("{}\n", serde_json::json!({"input_ids": ids, "labels": ids}))
        })
        .collect();
    std::fs::write(&data, rows).unwrap();
    let config = |name: &str, batch: usize, accum: usize, auto: bool| {
        let mut c = fsdp_app::train::finetune::FinetuneConfig::new(model.to_str().unwrap(), &data, &tmp.path().join(name));
        c.device = fsdp_app::device::DeviceSpec::Cuda(Some(0));
        (c.seq_len, c.batch_size, c.grad_accum, c.max_steps, c.lr, c.shuffle) = (Some(2048), batch, accum, Some(2), 1e-3, false);
        c.auto_find_batch_size = auto;
        c
    };
    let err = run_local(&config("fixed", 64, 1, false)).expect_err("64 rows of 2048 tokens fit the GPU: make the trial larger");
    assert!(fsdp_app::device::is_out_of_memory(&err), "not recognised as out of memory: {err:#}");
    assert!(!format!("{err:#}").contains(ops::eager_attention::TOO_LARGE_FOR_GPU_KERNELS), "not a real out-of-memory error: {err:#}");
    let auto = run_local(&config("auto", 64, 1, true)).unwrap_or_else(|e| panic!("{e:#}"));
    let one_by_one = run_local(&config("rows", 1, 64, false)).unwrap();
    let d = auto.losses.iter().zip(&one_by_one.losses).map(|(a, b)| (a - b).abs() / b).fold(0.0, f64::max);
    eprintln!("auto {:?} vs one row at a time {:?}: max rel diff {d:.2e}", auto.losses, one_by_one.losses);
    assert!(d < 1e-4, "the auto batch run's losses differ by {d}");
}

#[cfg(feature = "nccl")]
mod nccl {
    use super::*;
    use fsdp_app::dist::env::DistEnv;

    fn env() -> DistEnv {
        DistEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: free_port().parse().unwrap(),
            launcher: "torchrun",
        }
    }

    #[test]
    fn collectives_of_a_one_rank_job() {
        let dev = gpu();
        let (groups, _proxies) = fsdp_app::dist::nccl::connect(&env(), 1, Duration::from_secs(30), &dev).unwrap();
        for g in [&groups.world, &groups.shard, &groups.replicate] {
            assert_eq!((g.rank(), g.world_size()), (0, 1));
            let v: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
            assert_eq!(g.all_gather(&v).unwrap(), v);
            assert_eq!(g.reduce_scatter(&v).unwrap(), v);
            let mut w = v.clone();
            g.all_reduce(&mut w).unwrap();
            assert_eq!(w, v);
            let mut f = [1.5f64, -2.25];
            g.all_reduce_f64(&mut f).unwrap();
            assert_eq!(f, [1.5, -2.25]);
            assert_eq!(g.broadcast_bytes(0, Some(b"tokenizer".to_vec())).unwrap(), b"tokenizer");
            g.barrier().unwrap();
            // The engine's device-tensor collectives, in f32 and in the bf16/f16 the parameters
            // are gathered in: the result stays on the GPU, in the input's dtype.
            let t = Tensor::from_vec(v.clone(), v.len(), &dev).unwrap();
            for dt in [DType::F32, DType::BF16, DType::F16] {
                let x = t.to_dtype(dt).unwrap();
                for (op, y) in [
                    ("all_gather", g.all_gather_tensor(&x).unwrap()),
                    ("reduce_scatter", g.reduce_scatter_tensor(&x).unwrap()),
                    ("all_reduce", g.all_reduce_tensor(&x).unwrap()),
                ] {
                    assert!(y.device().is_cuda() && y.dtype() == dt, "{op} {dt:?}: got {:?} on {:?}", y.dtype(), y.device());
                    assert_eq!(values(&y), values(&x), "{op} {dt:?}");
                }
            }
        }
    }

    /// bf16 training through NCCL (NCCL all-gathers the bf16 chunks in device memory) computes
    /// what the same GPU computes with the local backend (whose tensor collectives go through
    /// host memory in f32): the dtype on the wire changes the traffic, not the values.
    #[test]
    fn bf16_gathers_through_nccl_match_the_host_path() {
        let tmp = tempfile::tempdir().unwrap();
        let model = fixture("llama", tmp.path());
        let mut host = reference_training_config(&model, &tmp.path().join("host"));
        host.device = fsdp_app::device::DeviceSpec::Cuda(Some(0));
        host.param_dtype = DType::BF16;
        let host = run_local(&host).unwrap();
        let mut c = reference_training_config(&model, &tmp.path().join("nccl-bf16"));
        c.device = fsdp_app::device::DeviceSpec::Cuda(None);
        c.backend = fsdp_app::train::finetune::Backend::Nccl;
        c.param_dtype = DType::BF16;
        let run = fsdp_app::train::finetune::run(&c, Some(&env())).unwrap().expect("rank 0 summary");
        let d = run.losses.iter().zip(&host.losses).map(|(a, b)| (a - b).abs() / b).fold(0.0, f64::max);
        eprintln!("bf16 nccl vs host path: losses {:?} vs {:?}, max rel diff {d:.2e}", run.losses, host.losses);
        assert!(d < 1e-6, "bf16 through nccl differs from the host path by {d}");
    }

    /// `finetune --backend nccl --device cuda` as one rank under a launcher's environment: the
    /// whole rank-0 loading, training and export path, against the CPU run.
    #[test]
    fn finetuning_through_nccl_follows_the_cpu_loss_curve() {
        let tmp = tempfile::tempdir().unwrap();
        let model = fixture("llama", tmp.path());
        let cpu = run_local(&reference_training_config(&model, &tmp.path().join("cpu"))).unwrap();
        for ac in [false, true] {
            let mut c = reference_training_config(&model, &tmp.path().join(format!("nccl-ac{ac}")));
            c.device = fsdp_app::device::DeviceSpec::Cuda(None);
            c.backend = fsdp_app::train::finetune::Backend::Nccl;
            c.activation_checkpointing = ac;
            let run = fsdp_app::train::finetune::run(&c, Some(&env())).unwrap().expect("rank 0 summary");
            let d = run.losses.iter().zip(&cpu.losses).map(|(a, b)| (a - b).abs() / b).fold(0.0, f64::max);
            eprintln!("nccl ac {ac}: max rel loss diff from CPU {d:.2e}");
            assert!(d < 2e-4, "nccl ac {ac}: losses differ from CPU by {d}\n{:?}\n{:?}", run.losses, cpu.losses);
            let out = tmp.path().join(format!("nccl-ac{ac}"));
            assert!(out.join("config.json").exists());
            // The per-step report carries the GPU's memory in use.
            let last: serde_json::Value =
                serde_json::from_str(std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().last().unwrap()).unwrap();
            assert!(last["gpu_memory_bytes_per_rank"][0].as_u64().unwrap() > 1 << 20, "{last}");
        }
    }
}
