//! The GPU proofs: the fixtures' logits and gradients on CUDA against the CPU (f32 within 1e-4,
//! bf16 within bf16 rounding), fine-tuning on the GPU reproducing the CPU loss curve, and the
//! NCCL backend at world size 1 through the multi-GPU code path (TCP rendezvous of the unique
//! ids, communicators on candle's stream, all-gathers and reduce-scatters of real units), and
//! `--auto-find-batch-size` recovering from a real out-of-memory error.
//!
//! The kernels of our own, op by op, are in `kernels.rs`.
//!
//! Built only with `--features cuda` (the NCCL tests with `nccl`): `tests/gpu/build-cuda.sh` makes
//! the binary and `tests/gpu/run.sh check` runs it on the GPU machine. There is no skipping: on a
//! machine without a GPU these tests fail.
#![cfg(feature = "cuda")]

#[path = "../common/mod.rs"]
mod common;
mod kernels;

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

use common::f32_values as values;

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

/// Every fixture as written, and again with 64-value heads (head dims the flash-attention
/// kernels take, so that the models run on them; mistral's with its sliding window): (what, dir).
fn fixtures_with_kernel_heads(root: &Path) -> Vec<(String, std::path::PathBuf)> {
    let mut all = vec![];
    for name in fsdp_app::fixtures::FIXTURE_NAMES {
        all.push((name.to_string(), fixture(name, root)));
        // qwen2's head dim is hidden / heads (4 heads); the others name theirs.
        let heads_of_64: &[(&str, u64)] = if *name == "qwen2" { &[("hidden_size", 256)] } else { &[("head_dim", 64)] };
        all.push((format!("{name} (64-value heads)"), fixture_with(name, &root.join(format!("{name}-heads-64")), heads_of_64)));
    }
    all
}

#[test]
fn logits_on_cuda_match_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = gpu();
    for (name, dir) in fixtures_with_kernel_heads(tmp.path()) {
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

/// The attention kernels inside the models on the GPU (bf16, fixtures with 64-value heads): the
/// full forward runs flash attention, a cached prompt flash attention over the cache, each next
/// token the decode kernel (which writes the cache), several sequences' next tokens one decode
/// launch. Each cached step's logits against the full forward's at that position; the
/// several-sequence step against the full forward at each sequence's position.
#[test]
fn cached_decoding_on_cuda_follows_the_full_forward() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = gpu();
    let none = models::RowAdapters::default();
    for (name, dir) in fixtures_with_kernel_heads(tmp.path()).into_iter().filter(|(name, _)| name.contains("64-value")) {
        let loaded = load_model(resolve_model(dir.to_str().unwrap(), None).unwrap(), DType::BF16, &dev).unwrap();
        let model = &loaded.model;
        let ids: Vec<u32> = (0..24).map(|i| (i * 37 + 11) % 384).collect();
        let tokens = |range: std::ops::Range<usize>| Tensor::from_vec(ids[range.clone()].to_vec(), (1, range.len()), &dev).unwrap();
        let full = model.forward(&tokens(0..24)).unwrap().squeeze(0).unwrap();
        let at = |i: usize| values(&full.get(i).unwrap());
        let close = |what: String, got: &Tensor, i: usize| {
            let d = rel_norm_diff(&values(got), &at(i));
            eprintln!("{what}: relative difference {d:.2e}");
            assert!(d < 3e-2, "{what}: differs from the full forward at position {i} by {d}");
        };
        let mut cache = models::KvCache::new(&loaded.config);
        close(format!("{name}: a 16-token prompt"), &model.forward_cached(&tokens(0..16), &mut cache, &none).unwrap(), 15);
        for i in 16..24 {
            close(format!("{name}: token {i}"), &model.forward_cached(&tokens(i..i + 1), &mut cache, &none).unwrap(), i);
        }
        let lens = [5usize, 11, 20];
        let mut caches: Vec<models::KvCache> = lens
            .iter()
            .map(|&n| {
                let mut c = models::KvCache::new(&loaded.config);
                model.forward_cached(&tokens(0..n), &mut c, &none).unwrap();
                c
            })
            .collect();
        let mut refs: Vec<&mut models::KvCache> = caches.iter_mut().collect();
        let next: Vec<u32> = lens.iter().map(|&n| ids[n]).collect();
        let rows = model.forward_decode_rows(&next, &mut refs, &none).unwrap();
        for (r, &n) in lens.iter().enumerate() {
            close(format!("{name}: sequence {r} of a three-sequence step"), &rows.get(r).unwrap(), n);
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
    let opts = FsdpOptions {
        strategy: ShardingStrategy::FullShard,
        activation_checkpointing: ac,
        param_dtype,
        reduce_dtype: DType::F32,
        prefetch: false,
    };
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
    for (name, dir) in fixtures_with_kernel_heads(tmp.path()) {
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
        // The search's trials on stderr: what a failure here needs.
        c.verbose = true;
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

    /// Collectives started on NCCL's own stream, their inputs dropped at once and other work
    /// allocated and written on the compute stream before their results are taken: the results
    /// are still the inputs' (an input lives until the compute stream has waited for the
    /// collective; the output is never handed out before). A started one dropped unwaited
    /// leaves the group usable.
    #[test]
    fn started_collectives_outlive_their_inputs() {
        let dev = gpu();
        let (groups, _proxies) = fsdp_app::dist::nccl::connect(&env(), 1, Duration::from_secs(30), &dev).unwrap();
        let g = &groups.shard;
        assert!(g.overlaps_compute());
        let n = 1 << 24;
        let v: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
        let x = Tensor::from_vec(v.clone(), n, &dev).unwrap();
        let gathered = g.start_all_gather_tensor(&x).unwrap();
        let reduced = g.start_reduce_scatter_tensor(&(&x * 2.0).unwrap()).unwrap();
        drop(x);
        let noise: Vec<Tensor> = (0..8).map(|i| Tensor::full(-1f32 - i as f32, n, &dev).unwrap()).collect();
        let (a, b) = (gathered.wait().unwrap(), reduced.wait().unwrap());
        drop(noise);
        assert_eq!(a.to_vec1::<f32>().unwrap(), v);
        assert_eq!(b.to_vec1::<f32>().unwrap(), v.iter().map(|x| x * 2.0).collect::<Vec<_>>());
        drop(g.start_all_gather_tensor(&Tensor::ones(n, DType::BF16, &dev).unwrap()).unwrap());
        let mut f = [1.5f64];
        g.all_reduce_f64(&mut f).unwrap();
        assert_eq!(f, [1.5]);
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
