//! Our GPU kernels op by op (`models/kernels/src/cuda/*.cu`, launched by `ops`), each against
//! the CPU op or the composition it replaces; `tests/cuda_emulated.rs` runs the same sources on
//! the CPU.

use super::*;

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
/// lengths that are no multiple of the kernels' 64-row tiles; heads-major and token-major.
/// `tests/cuda_emulated.rs` runs the same kernels on the CPU.
#[test]
fn flash_attention_matches_cpu_attention() {
    use candle_core::Var;
    use ops::flash_attention::{attention, attention_token_major, Visibility};
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
            // The same through the token-major entry, its tensors (batch, len, heads, d) as the
            // projections make them and its output (batch, T, heads · d).
            let token_major = run(&dev, dtype, &|q, k, v| {
                let tm = |x: &Tensor| x.transpose(1, 2)?.contiguous();
                let out = attention_token_major(&tm(q)?, &tm(k)?, &tm(v)?, visibility, scale)?;
                out.reshape((b, t, h, d))?.transpose(1, 2)
            });
            for (layout, got) in [("heads-major", got), ("token-major", token_major)] {
                for (name, (g, e)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&expected)) {
                    let diff = rel_norm_diff(g, e);
                    eprintln!("{what}, {layout}: {name} relative difference {diff:.2e}");
                    assert!(diff < tolerance, "{what}, {layout}: {name} differs from the CPU's attention by {diff}");
                }
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
/// of gyᵀ and x): y, dx and dW against the CPU op in f32, for 3-d inputs, the heads form and the
/// residual form (`linear_add_to`, its residual taken off again), dW through candle's store and
/// through a sink; bf16 within its rounding.
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
    let residual = Tensor::randn(0f32, 1.0, (2, 33, 40), &Device::Cpu).unwrap();
    // (y, dx, dW) on `device` in `dtype`, with dW through a sink or candle's store; the product
    // alone, in heads, or with the residual added (`linear_add_to`: y less the residual, and the
    // residual's gradient checked against the upstream one).
    let run = |device: &Device, dtype: DType, sink: bool, form: &str| {
        let on = |t: &Tensor| Var::from_tensor(&t.to_device(device).unwrap().to_dtype(dtype).unwrap()).unwrap();
        let (xv, wv, rv) = (on(&x), on(&w), on(&residual));
        let store = WeightGrads::new();
        let to = sink.then(|| WeightGradTarget { sink: store.clone(), name: "w".into() });
        let (xt, wt, rt) = (xv.as_tensor(), wv.as_tensor(), rv.as_tensor());
        let y = match form {
            "heads" => ops::linear::linear_heads_to(xt, wt, 4, to).unwrap().reshape((2, 33, 40)).unwrap(),
            "add" => ops::linear::linear_add_to(xt, wt, rt, to).unwrap(),
            _ => ops::linear::linear_to(xt, wt, to).unwrap(),
        };
        let probe = probe.to_device(device).unwrap();
        let grads = (y.to_dtype(DType::F32).unwrap() * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let dw = match sink {
            true => store.take("w").expect("the sink got dW").into_tensor(device).unwrap(),
            false => grads.get(wv.as_tensor()).unwrap().clone(),
        };
        let y = match form {
            "add" => {
                // The residual's gradient is the upstream one; the product is y less the residual.
                let dr = grads.get(rt).expect("the residual's gradient").to_dtype(DType::F32).unwrap();
                let off = rel_norm_diff(&values(&dr), &values(&probe.to_dtype(dtype).unwrap()));
                assert!(off < 1e-6, "{dtype:?}, sink {sink}: the residual's gradient is not the upstream one ({off})");
                (y.to_dtype(DType::F32).unwrap() - rt.to_dtype(DType::F32).unwrap()).unwrap()
            }
            _ => y,
        };
        [values(&y), values(grads.get(xv.as_tensor()).unwrap()), values(&dw)]
    };
    let expected = run(&Device::Cpu, DType::F32, false, "plain");
    for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
        for (sink, form) in [(false, "plain"), (true, "plain"), (true, "heads"), (false, "add"), (true, "add")] {
            for (name, (g, e)) in ["y", "dx", "dW"].iter().zip(run(&dev, dtype, sink, form).iter().zip(&expected)) {
                let diff = rel_norm_diff(g, e);
                eprintln!("{dtype:?}, sink {sink}, {form}: {name} relative difference {diff:.2e}");
                assert!(diff < tolerance, "{dtype:?}, sink {sink}, {form}: {name} differs from the CPU op by {diff}");
            }
        }
    }
}

/// The embedding op on the GPU (`ops::embedding`: candle's `index_select`, then the table's
/// gradient by our kernel, each id's rows summed in token order): rows and the table's gradient,
/// through candle's store and through a sink, the padding row left out, against the CPU op in
/// f32; bf16 within its rounding.
#[test]
fn embedding_op_on_cuda_matches_cpu() {
    use candle_core::Var;
    use ops::weight_grads::{WeightGradTarget, WeightGrads};
    let dev = gpu();
    let (tokens, hidden, vocab, pad) = (2 * 333, 96, 500u32, 3u32);
    let ids: Vec<u32> = (0..tokens as u32).map(|t| (t * 7919) % vocab / (1 + t % 3)).collect();
    let table = Tensor::randn(0f32, 1.0, (vocab as usize, hidden), &Device::Cpu).unwrap();
    let probe = Tensor::randn(0f32, 1.0, (2, tokens / 2, hidden), &Device::Cpu).unwrap();
    let run = |device: &Device, dtype: DType, sink: bool| {
        let w = Var::from_tensor(&table.to_device(device).unwrap().to_dtype(dtype).unwrap()).unwrap();
        let ids = Tensor::from_vec(ids.clone(), (2, tokens / 2), device).unwrap();
        let store = WeightGrads::new();
        let to = sink.then(|| WeightGradTarget { sink: store.clone(), name: "w".into() });
        let rows = ops::embedding::embedding(w.as_tensor(), &ids, Some(pad), to).unwrap();
        let grads = (rows.to_dtype(DType::F32).unwrap() * probe.to_device(device).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
        let dw = match sink {
            true => store.take("w").expect("the sink got the table's gradient").into_tensor(device).unwrap(),
            false => grads.get(w.as_tensor()).unwrap().clone(),
        };
        [values(&rows), values(&dw)]
    };
    let expected = run(&Device::Cpu, DType::F32, false);
    for (dtype, tolerance) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
        for sink in [false, true] {
            let got = run(&dev, dtype, sink);
            let pad_row = &got[1][pad as usize * hidden..(pad as usize + 1) * hidden];
            assert!(pad_row.iter().all(|v| *v == 0.0), "{dtype:?}, sink {sink}: the padding row got a gradient");
            for (name, (g, e)) in ["rows", "dw"].iter().zip(got.iter().zip(&expected)) {
                let diff = rel_norm_diff(g, e);
                eprintln!("embedding {dtype:?}, sink {sink}: {name} relative difference {diff:.2e}");
                assert!(diff < tolerance, "embedding {dtype:?}, sink {sink}: {name} differs from the CPU op by {diff}");
            }
        }
    }
}

/// The gated MLP op on the GPU (`ops::gated_mlp`: both products on cuBLAS, SwiGLU by our
/// kernels, gate and up kept for the backward): h, dx and both weights' gradients (one through
/// a sink, one through candle's store) against the CPU op in f32; bf16 within its rounding.
#[test]
fn gated_mlp_op_on_cuda_matches_cpu() {
    use candle_core::Var;
    use ops::weight_grads::{WeightGradTarget, WeightGrads};
    let inputs = [
        Tensor::randn(0f32, 1.0, (2, 33, 48), &Device::Cpu).unwrap(),
        Tensor::randn(0f32, 0.5, (72, 48), &Device::Cpu).unwrap(),
        Tensor::randn(0f32, 0.5, (72, 48), &Device::Cpu).unwrap(),
    ];
    let probe = Tensor::randn(0f32, 1.0, (2, 33, 72), &Device::Cpu).unwrap();
    let run = |device: &Device, dtype: DType| {
        let [x, w_gate, w_up] = inputs.clone().map(|t| Var::from_tensor(&t.to_device(device).unwrap().to_dtype(dtype).unwrap()).unwrap());
        assert!(device.is_cpu() || ops::gated_mlp::gpu_takes(x.as_tensor()), "{dtype:?}");
        let store = WeightGrads::new();
        let to_up = Some(WeightGradTarget { sink: store.clone(), name: "up".into() });
        let h = ops::gated_mlp::swiglu_linear_to(x.as_tensor(), w_gate.as_tensor(), w_up.as_tensor(), [None, to_up]).unwrap();
        let grads = (h.to_dtype(DType::F32).unwrap() * probe.to_device(device).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
        let dw_up = store.take("up").expect("the sink got d w_up").into_tensor(device).unwrap();
        [values(&h), values(grads.get(x.as_tensor()).unwrap()), values(grads.get(w_gate.as_tensor()).unwrap()), values(&dw_up)]
    };
    gpu_matches_cpu("gated_mlp", ["h", "dx", "dw_gate", "dw_up"], run);
}

/// A block's MLP half as one op on the GPU (`ops::residual_sublayer`: the norm and the gated MLP
/// outside the graph, x's two gradients in one sum): the output, x's, the norm weight's and each
/// projection's gradient (through sinks) against the CPU's, and on the GPU the bits of the three
/// ops one by one.
#[test]
fn residual_sublayer_op_on_cuda_matches_cpu() {
    use candle_core::Var;
    use ops::weight_grads::{WeightGradTarget, WeightGrads};
    let (b, t, hidden, inter) = (2, 33, 48, 72);
    let inputs = [
        Tensor::randn(0f32, 1.0, (b, t, hidden), &Device::Cpu).unwrap(),
        (Tensor::randn(0f32, 0.2, hidden, &Device::Cpu).unwrap() + 1.0).unwrap(),
        Tensor::randn(0f32, 0.5, (inter, hidden), &Device::Cpu).unwrap(),
        Tensor::randn(0f32, 0.5, (inter, hidden), &Device::Cpu).unwrap(),
        Tensor::randn(0f32, 0.5, (hidden, inter), &Device::Cpu).unwrap(),
    ];
    let probe = Tensor::randn(0f32, 1.0, (b, t, hidden), &Device::Cpu).unwrap();
    let names = ["gate", "up", "down"];
    // (y, dx, the norm weight's, gate's, up's and down's gradients): as one op, or op by op.
    let pass = |device: &Device, dtype: DType, one_op: bool| -> [Vec<f32>; 6] {
        let [x, norm, gate, up, down] =
            inputs.clone().map(|t| Var::from_tensor(&t.to_device(device).unwrap().to_dtype(dtype).unwrap()).unwrap());
        let sink = WeightGrads::new();
        let to = |i: usize| Some(WeightGradTarget { sink: sink.clone(), name: names[i].into() });
        let (g, u, d) = (gate.as_tensor(), up.as_tensor(), down.as_tensor());
        let y = match one_op {
            true => {
                let inside = |n: &Tensor| ops::gated_mlp::swiglu_linear_inside(n, g, u, [to(0), to(1)]);
                ops::residual_sublayer::prenorm_residual(x.as_tensor(), norm.as_tensor(), 1e-5, inside, (d.clone(), to(2))).unwrap()
            }
            false => {
                let n = ops::fused::rms_norm(x.as_tensor(), norm.as_tensor(), 1e-5).unwrap();
                let h = ops::gated_mlp::swiglu_linear_to(&n, g, u, [to(0), to(1)]).unwrap();
                ops::linear::linear_add_to(&h, d, x.as_tensor(), to(2)).unwrap()
            }
        };
        let grads = (y.to_dtype(DType::F32).unwrap() * probe.to_device(device).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
        let sunk = |i: usize| values(&sink.take(names[i]).expect("the sink got it").into_tensor(device).unwrap());
        [values(&y), values(grads.get(x.as_tensor()).unwrap()), values(grads.get(norm.as_tensor()).unwrap()), sunk(0), sunk(1), sunk(2)]
    };
    let run = |device: &Device, dtype: DType| {
        let one_op = pass(device, dtype, true);
        if !device.is_cpu() {
            assert!(one_op == pass(device, dtype, false), "{dtype:?}: not the bits of the ops one by one");
        }
        one_op
    };
    gpu_matches_cpu("residual sublayer", ["y", "dx", "dw_norm", "dw_gate", "dw_up", "dw_down"], run);
}

/// The attention layer's inside as one op on the GPU (`ops::self_attention_flash`: cuBLAS
/// products, our rope and flash kernels, x's gradient the one tensor candle's backward sums): the
/// output, x's gradient and each weight's (through sinks) in bf16 against the CPU's op
/// (`ops::self_attention`) in f32 with the same causal mask, at head dim 64 under GQA 2:1 over
/// rows past a tile's end; the output's bits those of the six ops it replaces on the GPU.
#[test]
fn self_attention_flash_op_on_cuda_matches_cpu() {
    use candle_core::Var;
    use ops::flash_attention::Visibility;
    use ops::weight_grads::{WeightGradTarget, WeightGrads};
    let dev = gpu();
    let (b, t, hidden, heads, d) = (2, 70, 96, (2, 1), 64);
    let inputs = [
        Tensor::randn(0f32, 1.0, (b, t, hidden), &Device::Cpu).unwrap(),
        Tensor::randn(0f32, 0.2, (heads.0 * d, hidden), &Device::Cpu).unwrap(),
        Tensor::randn(0f32, 0.2, (heads.1 * d, hidden), &Device::Cpu).unwrap(),
        Tensor::randn(0f32, 0.2, (heads.1 * d, hidden), &Device::Cpu).unwrap(),
    ];
    let angles: Vec<f32> = (0..t * d / 2).map(|i| (i / (d / 2)) as f32 / 10_000f32.powf((i % (d / 2)) as f32 / (d / 2) as f32)).collect();
    let angles = Tensor::from_vec(angles, (t, d / 2), &Device::Cpu).unwrap();
    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
    let probe = Tensor::randn(0f32, 1.0, (b, t, heads.0 * d), &Device::Cpu).unwrap();
    let scale = 1.0 / (d as f64).sqrt();
    let names = ["q", "k", "v"];
    // (out, dx, dW_q, dW_k, dW_v) on `device` in `dtype`: the CPU's op with its mask, the GPU's
    // with the same rule as a visibility.
    let run = |device: &Device, dtype: DType| {
        let [x, wq, wk, wv] = inputs.clone().map(|t| Var::from_tensor(&t.to_device(device).unwrap().to_dtype(dtype).unwrap()).unwrap());
        let sink = WeightGrads::new();
        let projections = [&wq, &wk, &wv]
            .iter()
            .zip(names)
            .map(|(w, name)| (w.as_tensor().clone(), Some(WeightGradTarget { sink: sink.clone(), name: name.into() })))
            .collect::<Vec<_>>()
            .try_into()
            .unwrap();
        let tables = (cos.to_device(device).unwrap().to_dtype(dtype).unwrap(), sin.to_device(device).unwrap().to_dtype(dtype).unwrap());
        let out = match device.is_cpu() {
            true => {
                let mask: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
                let mask = Tensor::from_vec(mask, (t, t), device).unwrap();
                ops::self_attention::self_attention(x.as_tensor(), projections, heads, (&tables.0, &tables.1), Some(&mask), scale).unwrap()
            }
            false => {
                let visibility = Visibility::causal(0, None);
                let out =
                    ops::self_attention_flash::self_attention(x.as_tensor(), projections, heads, (&tables.0, &tables.1), visibility, scale)
                        .unwrap();
                // The six ops it replaces, on detached inputs: the same output bits.
                let xd = x.as_tensor().detach();
                let project = |w: &Var, n: usize| ops::linear::linear_heads_to(&xd, &w.as_tensor().detach(), n, None).unwrap();
                let q = ops::fused::rope_token_major(&project(&wq, heads.0), &tables.0, &tables.1).unwrap();
                let k = ops::fused::rope_token_major(&project(&wk, heads.1), &tables.0, &tables.1).unwrap();
                let six = ops::flash_attention::attention_token_major(&q, &k, &project(&wv, heads.1), visibility, scale).unwrap();
                assert_eq!(values(&out), values(&six), "{dtype:?}: not the six ops' output");
                out
            }
        };
        let grads = (out.to_dtype(DType::F32).unwrap() * probe.to_device(device).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
        let mut got = vec![values(&out), values(grads.get(x.as_tensor()).expect("x's gradient"))];
        for (w, name) in [&wq, &wk, &wv].iter().zip(names) {
            assert!(grads.get(w.as_tensor()).is_none(), "{name}: a gradient in candle's store");
            got.push(values(&sink.take(name).expect("the sink got it").into_tensor(device).unwrap()));
        }
        got
    };
    let expected = run(&Device::Cpu, DType::F32);
    let got = run(&dev, DType::BF16);
    for (name, (g, e)) in ["out", "dx", "dW_q", "dW_k", "dW_v"].iter().zip(got.iter().zip(&expected)) {
        let diff = rel_norm_diff(g, e);
        eprintln!("self-attention (flash) BF16: {name} relative difference {diff:.2e}");
        assert!(diff < 3e-2, "self-attention (flash) BF16: {name} differs from the CPU op by {diff}");
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
