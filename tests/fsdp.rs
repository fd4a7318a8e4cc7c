//! The FSDP engine's proofs: N ranks reproduce the single-rank run (losses and final weights),
//! one step's gradients and 12 AdamW steps match PyTorch + transformers, each rank holds 1/N of
//! the state, and bad settings fail before any weight is read.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::training::{assert_step_one_gradients_match, engine_for, max_rel_diff, max_weight_diff, weights};
use common::*;
use fsdp_app::fsdp::plan::ShardingStrategy;
use fsdp_app::train::finetune::{run_local, FinetuneConfig, RunSummary};
use fsdp_app::train::loss::{next_token_targets, summed_token_loss};
use models::StageContext;

fn training_data() -> PathBuf {
    reference_dir().join("train-data.jsonl")
}

/// The configuration the PyTorch reference used (see make_training_reference.py).
fn reference_config(model: &Path, out: &Path) -> FinetuneConfig {
    reference_training_config(model, out)
}

/// Largest per-tensor relative difference, ||a - b|| / ||b|| (Frobenius norms).
fn max_rel_weight_diff(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> (f64, String) {
    assert_eq!(a.len(), b.len());
    let norm = |t: &Tensor| t.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt() as f64;
    a.iter().map(|(k, t)| (norm(&(t - &b[k]).unwrap()) / norm(&b[k]).max(1e-12), k.clone())).fold((0.0, String::new()), |m, x| {
        if x.0 > m.0 {
            x
        } else {
            m
        }
    })
}

#[test]
fn n_ranks_reproduce_one_rank_for_every_strategy() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let base = |out: &str| {
        let mut c = reference_config(&model, &tmp.path().join(out));
        c.max_steps = Some(10);
        c.batch_size = 4;
        c
    };
    let single: RunSummary = run_local(&base("w1")).unwrap();
    let single_w = weights(&tmp.path().join("w1"));
    assert_eq!(single.losses.len(), 10);
    // World 3 does not divide 64-row weights: padding rows are exercised. Its global batch is 6.
    let mut c6 = base("w1-batch6");
    c6.batch_size = 6;
    let single6: RunSummary = run_local(&c6).unwrap();
    let single6_w = weights(&tmp.path().join("w1-batch6"));

    let mut cases = vec![];
    for world in [2usize, 4] {
        for strategy in [ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp] {
            for ac in [false, true] {
                cases.push((world, strategy, ac, None));
            }
        }
    }
    cases.push((2, ShardingStrategy::NoShard, true, None));
    cases.push((4, ShardingStrategy::HybridShard, false, Some(2)));
    cases.push((3, ShardingStrategy::FullShard, true, None));
    cases.push((3, ShardingStrategy::ShardGradOp, false, None));
    for (i, (world, strategy, ac, group)) in cases.into_iter().enumerate() {
        let out = format!("case{i}");
        let mut c = base(&out);
        c.world_size = world;
        let global = if world == 3 { 6 } else { 4 };
        c.batch_size = global / world; // same global batch as the single-rank run
        let (single, single_w) = if world == 3 { (&single6, &single6_w) } else { (&single, &single_w) };
        c.strategy = strategy;
        c.activation_checkpointing = ac;
        c.shard_group_size = group;
        let what = format!("world {world}, {strategy:?}, activation checkpointing {ac}");
        let run = run_local(&c).unwrap_or_else(|e| panic!("{what}: {e:#}"));
        let d = max_rel_diff(&run.losses, &single.losses);
        assert!(d < 1e-5, "{what}: losses differ from world 1 by {d} relative\n{:?}\n{:?}", run.losses, single.losses);
        let got = weights(&tmp.path().join(&out));
        let (w, name) = max_rel_weight_diff(&got, single_w);
        eprintln!("{what}: loss rel diff {d:.2e}, weight rel diff {w:.2e} ({name}), max abs {:.2e}", max_weight_diff(&got, single_w));
        assert!(w < 1e-5, "{what}: final weights differ by {w} relative ({name})");

        // Each rank holds 1/shards of params + grads + optimizer state, plus padding rows.
        let shards = match strategy {
            ShardingStrategy::NoShard => 1,
            ShardingStrategy::HybridShard => group.unwrap(),
            _ => world,
        };
        let total = run.total_params * 16;
        for (r, b) in run.rank_bytes.iter().enumerate() {
            assert_eq!(b.grads, b.params, "{what}: rank {r} gradient bytes");
            assert_eq!(b.optimizer, 2 * b.params, "{what}: rank {r} optimizer bytes");
            let held = b.total();
            let ideal = total / shards;
            // Padding: less than one row per parameter and shard (rows of at most 160 values here).
            let params_count = 9 * 2 + 3;
            assert!(held >= ideal && held <= ideal + params_count * 160 * 16, "{what}: rank {r} holds {held}, 1/{shards} is {ideal}");
        }
    }
}

/// Vocabulary-sized weights (an embedding and a head of 8192 x 512 = 4M values) travel alone,
/// and their gradients come from the model's ops as rows made on demand (ids and upstream rows;
/// logit gradients and the head's input), reduce-scattered in rounds of rows: N ranks still
/// reproduce one rank, with and without activation checkpointing.
#[test]
fn vocabulary_sized_gradients_reduced_by_rows_reproduce_one_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture_with(
        "llama",
        &tmp.path().join("wide-vocab"),
        &[
            ("vocab_size", 8192),
            ("hidden_size", 512),
            ("intermediate_size", 128),
            ("num_hidden_layers", 1),
            ("num_attention_heads", 8),
            ("num_key_value_heads", 8),
        ],
    );
    let base = |out: &str, world: usize, ac: bool| {
        let mut c = reference_config(&model, &tmp.path().join(out));
        c.max_steps = Some(3);
        c.batch_size = 4 / world;
        c.world_size = world;
        c.activation_checkpointing = ac;
        c
    };
    let single = run_local(&base("w1", 1, false)).unwrap();
    let single_w = weights(&tmp.path().join("w1"));
    for (world, ac) in [(2, false), (4, false), (2, true)] {
        let out = format!("w{world}-ac{ac}");
        let run = run_local(&base(&out, world, ac)).unwrap();
        let what = format!("world {world}, activation checkpointing {ac}");
        let d = max_rel_diff(&run.losses, &single.losses);
        assert!(d < 1e-5, "{what}: losses differ from world 1 by {d} relative");
        let (w, name) = max_rel_weight_diff(&weights(&tmp.path().join(&out)), &single_w);
        assert!(w < 1e-5, "{what}: final weights differ by {w} relative ({name})");
    }
}

#[test]
fn losses_of_12_adamw_steps_match_pytorch() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["llama", "qwen2"] {
        let model = fixture(name, tmp.path());
        let reference = reference_tensors(&format!("training-{name}.safetensors"));
        let expected: Vec<f64> = reference["losses"].to_vec1::<f64>().unwrap();
        let expected_norms: Vec<f64> = reference["grad_norms"].to_vec1::<f64>().unwrap();
        // Two ranks with and without activation checkpointing: FULL_SHARD frees each unit after
        // its forward and refills it for backward either way (qwen2's tied embedding is
        // resharded between the first and the last stage).
        for (world, ac) in [(1usize, false), (2, false), (2, true)] {
            let mut c = reference_config(&model, &tmp.path().join(format!("{name}-out{world}-{ac}")));
            c.world_size = world;
            c.batch_size = 4 / world;
            c.activation_checkpointing = ac;
            let run = run_local(&c).unwrap();
            let d = max_rel_diff(&run.losses, &expected);
            assert!(d < 1e-4, "{name} world {world} (ac {ac}): losses differ from PyTorch by {d}\n{:?}\n{expected:?}", run.losses);
            let dn = max_rel_diff(&run.grad_norms, &expected_norms);
            assert!(dn < 1e-4, "{name} world {world} (ac {ac}): grad norms differ from torch's clip_grad_norm_ by {dn}");
        }
    }
}

#[test]
fn one_step_gradients_match_pytorch_and_reach_every_parameter() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["llama", "qwen2"] {
        let dir = fixture(name, tmp.path());
        let reference = reference_tensors(&format!("training-{name}.safetensors"));
        for ac in [false, true] {
            assert_step_one_gradients_match(&format!("{name} (ac {ac})"), &dir, ac, &reference);
        }
    }
}

#[test]
fn bad_settings_fail_before_loading_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let data = training_data();
    let run = |extra: &[&str]| {
        let out = tmp.path().join(format!("o{}", extra.join("_").replace(['-', '/'], "")));
        let mut args = vec![
            "finetune",
            "--model",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--output-dir",
            out.to_str().unwrap(),
            "--seq-len",
            "16",
        ];
        args.extend_from_slice(extra);
        run_cli(&args, &[])
    };
    let check = |o: std::process::Output, needles: &[&str]| {
        assert!(!o.status.success());
        let e = stderr(&o);
        assert!(e.lines().any(|l| l.starts_with("error: ")) && !e.contains("panicked"), "{e}");
        for n in needles {
            assert!(e.contains(n), "{n:?} not in {e}");
        }
    };
    check(run(&["--world-size", "0"]), &["--world-size must be positive"]);
    check(run(&["--batch-size", "40", "--world-size", "2"]), &["train-data.jsonl", "48 samples", "fewer than one global batch of 80"]);
    check(
        run(&["--wrap-policy", "size_based_wrap", "--min-num-params", "100000000"]),
        &["size_based_wrap", "no run of the model's 2 blocks"],
    );
    check(
        run(&["--sharding-strategy", "HYBRID_SHARD", "--world-size", "3", "--shard-group-size", "2"]),
        &["--shard-group-size 2 must divide --world-size 3"],
    );
    check(run(&["--sharding-strategy", "EVERYTHING"]), &["--sharding-strategy"]);

    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"ok\"}\n{\"text\": 5}\n").unwrap();
    let out = tmp.path().join("bad-out");
    let o = run_cli(
        &["finetune", "--model", model.to_str().unwrap(), "--data", bad.to_str().unwrap(), "--output-dir", out.to_str().unwrap()],
        &[],
    );
    check(o, &["bad.jsonl:2", "field `text` must be a string"]);
}

#[test]
fn evaluation_reports_loss_and_perplexity_the_same_on_any_world_size() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let mut evals = vec![];
    for world in [1usize, 3] {
        let out = tmp.path().join(format!("w{world}"));
        let o = run_cli(
            &[
                "finetune",
                "--model",
                model.to_str().unwrap(),
                "--data",
                training_data().to_str().unwrap(),
                "--output-dir",
                out.to_str().unwrap(),
                "--seq-len",
                "16",
                "--batch-size",
                &(6 / world).to_string(),
                "--world-size",
                &world.to_string(),
                "--max-steps",
                "4",
                "--lr",
                "1e-3",
                "--eval-split",
                "0.25",
                "--eval-steps",
                "2",
                "--no-shuffle",
            ],
            &[],
        );
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(stderr(&o).contains("eval      2 | loss") && stderr(&o).contains("perplexity"), "{}", stderr(&o));
        let rows: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .filter(|r: &serde_json::Value| r.get("eval_loss").is_some())
            .collect();
        assert_eq!(rows.iter().map(|r| r["step"].as_u64().unwrap()).collect::<Vec<_>>(), vec![2, 4]);
        for r in &rows {
            let (l, p) = (r["eval_loss"].as_f64().unwrap(), r["eval_perplexity"].as_f64().unwrap());
            assert!((p - l.exp()).abs() < 1e-6 * p);
        }
        let svg = std::fs::read_to_string(out.join("loss.svg")).unwrap();
        assert!(svg.contains("<polyline") && svg.contains("eval loss"), "{svg}");
        evals.push(rows.iter().map(|r| r["eval_loss"].as_f64().unwrap()).collect::<Vec<_>>());
    }
    // 12 held-out rows: world 3 evaluates them in differently sized rounds (with masked padding
    // batches) and must agree with world 1.
    for (a, b) in evals[0].iter().zip(&evals[1]) {
        assert!((a - b).abs() / a < 1e-5, "{evals:?}");
    }
}

#[test]
fn packed_documents_do_not_see_each_other() {
    // Three documents packed into one row must give the same summed loss as the same documents
    // in rows of their own: the mask keeps them apart and positions restart per document.
    let tmp = tempfile::tempdir().unwrap();
    for name in ["llama", "mistral"] {
        let dir = fixture(name, tmp.path());
        let docs: Vec<Vec<u32>> = vec![
            (0..5).map(|i| (i * 31 + 7) % 384).collect(),
            (0..7).map(|i| (i * 17 + 3) % 384).collect(),
            (0..4).map(|i| (i * 53 + 11) % 384).collect(),
        ];
        let mut engine = engine_for(&dir, true);
        let mut unpacked = 0.0;
        for d in &docs {
            let mut ids = d.clone();
            let mut labels: Vec<i64> = d.iter().map(|&x| x as i64).collect();
            ids.resize(16, 2);
            labels.resize(16, -100);
            let ctx = StageContext { targets: Some(next_token_targets(&labels, 1, 16)), ..Default::default() };
            unpacked += engine.forward_loss(&Tensor::from_vec(ids, (1, 16), &Device::Cpu).unwrap(), &ctx, &summed_token_loss).unwrap();
        }
        let mut ids = vec![];
        let mut labels = vec![];
        let mut segments = vec![];
        let mut positions = vec![];
        for (k, d) in docs.iter().enumerate() {
            for (i, &t) in d.iter().enumerate() {
                ids.push(t);
                labels.push(if i == 0 && k > 0 { -100 } else { t as i64 });
                segments.push(k as u32 + 1);
                positions.push(i as u32);
            }
        }
        let packing = models::Packing { positions, segments };
        let ctx = StageContext { packing: Some(packing), targets: Some(next_token_targets(&labels, 1, 16)), ..Default::default() };
        let packed = engine.forward_loss(&Tensor::from_vec(ids, (1, 16), &Device::Cpu).unwrap(), &ctx, &summed_token_loss).unwrap();
        assert!((packed - unpacked).abs() / unpacked < 1e-5, "{name}: packed {packed} vs unpacked {unpacked}");
    }
    // And a packed run trains, reporting its packing efficiency.
    let model = fixture("qwen2", &tmp.path().join("q"));
    let out = tmp.path().join("packed-run");
    let o = run_cli(
        &[
            "finetune",
            "--model",
            model.to_str().unwrap(),
            "--data",
            training_data().to_str().unwrap(),
            "--output-dir",
            out.to_str().unwrap(),
            "--seq-len",
            "32",
            "--batch-size",
            "2",
            "--max-steps",
            "2",
            "--packing",
            "--world-size",
            "2",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("samples of 32 tokens") && stderr(&o).contains("packing efficiency"), "{}", stderr(&o));
}

/// The GPU's code path, run on CPU: master weights, gradients and AdamW moments as device
/// tensors (one all-gather / reduce-scatter of tensors per unit, AdamW as tensor operations)
/// give the host path's losses and final weights, for every strategy, with gradient
/// accumulation, with LoRA (frozen parameters between trainable ones) and through a sharded
/// checkpoint save and resume.
#[test]
fn device_resident_state_reproduces_the_host_path() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let lora = models::LoraSettings { r: 4, alpha: 16.0, dropout: 0.0, targets: vec!["all-linear".into()], use_rslora: false };
    // (world, strategy, AC, shard group, accumulation, LoRA, bf16 mixed precision)
    #[allow(clippy::type_complexity)] // a table of cases, one column each
    let cases: Vec<(usize, ShardingStrategy, bool, Option<usize>, usize, bool, bool)> = vec![
        (1, ShardingStrategy::FullShard, false, None, 1, false, false),
        (2, ShardingStrategy::FullShard, true, None, 2, false, false),
        (4, ShardingStrategy::ShardGradOp, false, None, 1, false, false),
        (3, ShardingStrategy::FullShard, true, None, 1, false, false),
        (2, ShardingStrategy::NoShard, false, None, 1, false, false),
        (4, ShardingStrategy::HybridShard, true, Some(2), 1, false, false),
        (2, ShardingStrategy::FullShard, false, None, 1, true, false),
        // The device path all-gathers bf16 chunks (cast before the gather), the host path
        // rounds after it: the same values.
        (2, ShardingStrategy::FullShard, true, None, 1, false, true),
    ];
    for (i, (world, strategy, ac, group, accum, with_lora, mixed)) in cases.into_iter().enumerate() {
        let what = format!("world {world} {strategy:?} ac {ac} accum {accum} lora {with_lora} bf16 {mixed}");
        let config = |name: &str, offload: bool, prefetch: bool| {
            let mut c = reference_config(&model, &tmp.path().join(format!("{name}{i}")));
            c.max_steps = Some(6);
            c.world_size = world;
            c.batch_size = if world == 3 { 1 } else { 4 / world / accum };
            c.grad_accum = accum;
            c.strategy = strategy;
            c.activation_checkpointing = ac;
            c.shard_group_size = group;
            c.cpu_offload = Some(offload);
            c.prefetch = Some(prefetch);
            c.lora = with_lora.then(|| lora.clone());
            c.weight_decay = 0.1;
            if mixed {
                c.param_dtype = DType::BF16;
                c.reduce_dtype = DType::BF16;
            }
            c
        };
        let host = run_local(&config("host", true, false)).unwrap_or_else(|e| panic!("{what}: {e:#}"));
        // Device state, and host state with prefetch: the next stage's all-gathers started
        // before a stage runs and each reduce-scatter finished a unit later, on the
        // collectives' own thread (`dist::overlap`): the same numbers.
        for (name, offload, prefetch) in [("dev", false, false), ("dev-prefetch", false, true), ("host-prefetch", true, true)] {
            let run = run_local(&config(name, offload, prefetch)).unwrap_or_else(|e| panic!("{what} {name}: {e:#}"));
            let d = max_rel_diff(&run.losses, &host.losses);
            let dn = max_rel_diff(&run.grad_norms, &host.grad_norms);
            let (w, wname) =
                max_rel_weight_diff(&weights(&tmp.path().join(format!("{name}{i}"))), &weights(&tmp.path().join(format!("host{i}"))));
            eprintln!("{what} {name}: loss {d:.1e}, grad norm {dn:.1e}, weights {w:.1e} ({wname})");
            assert!(d < 1e-5 && dn < 1e-5, "{what} {name}: losses/norms differ by {d}/{dn}\n{:?}\n{:?}", run.losses, host.losses);
            assert!(w < 1e-5, "{what} {name}: final weights differ by {w} ({wname})");
            assert_eq!(run.rank_bytes, host.rank_bytes, "{what} {name}");
        }
    }

    // Save at step 3 with device state, resume from it: the curve goes on as if uninterrupted.
    let mut full = reference_config(&model, &tmp.path().join("ckpt-full"));
    full.max_steps = Some(6);
    full.world_size = 2;
    full.batch_size = 2;
    full.cpu_offload = Some(false);
    let straight = run_local(&full).unwrap();
    let mut first = full.clone();
    first.output_dir = tmp.path().join("ckpt-run");
    first.save_steps = Some(3);
    first.max_steps = Some(3);
    run_local(&first).unwrap();
    let mut resumed = full.clone();
    resumed.output_dir = tmp.path().join("ckpt-run");
    resumed.resume_from = Some("latest".into());
    let rest = run_local(&resumed).unwrap();
    let d = max_rel_diff(&rest.losses, &straight.losses[3..]);
    assert!(d < 1e-6, "resumed device-state run differs by {d}: {:?} vs {:?}", rest.losses, &straight.losses[3..]);
}

/// A step abandoned after its backward (what `--auto-find-batch-size` does with a trial step
/// that ran out of GPU memory) leaves no trace: the next step's gradients and updated weights
/// are those of an engine that never ran it, with host and with device-resident state.
#[test]
fn a_discarded_step_leaves_no_trace() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture("llama", tmp.path());
    let batch = |seed: u32| {
        let ids: Vec<u32> = (0..32u32).map(|i| 3 + (i * 7 + seed) % 60).collect();
        let labels: Vec<i64> = ids.iter().map(|&x| i64::from(x)).collect();
        (
            Tensor::from_vec(ids, (2, 16), &Device::Cpu).unwrap(),
            StageContext { targets: Some(next_token_targets(&labels, 2, 16)), ..Default::default() },
        )
    };
    let (trial, trial_ctx) = batch(1);
    let (real, real_ctx) = batch(2);
    for on_device in [false, true] {
        let fresh = || engine_for(&dir, true).with_device(Device::Cpu, on_device).unwrap();
        let (mut clean, mut tried) = (fresh(), fresh());
        tried.forward_backward(&trial, &trial_ctx, &summed_token_loss, 1.0 / 30.0).unwrap();
        assert!(tried.grad_chunks().values().flatten().any(|g| *g != 0.0), "the trial made gradients");
        tried.discard_step().unwrap();
        for e in [&mut clean, &mut tried] {
            e.forward_backward(&real, &real_ctx, &summed_token_loss, 1.0 / 30.0).unwrap();
        }
        assert_eq!(clean.grad_chunks(), tried.grad_chunks(), "device state {on_device}: gradients");
        for e in [&mut clean, &mut tried] {
            e.optimizer_step(1e-3, Some(1.0)).unwrap();
        }
        for u in 0..clean.units().count() {
            let (a, b) = (clean.full_unit(u).unwrap(), tried.full_unit(u).unwrap());
            assert_eq!(max_weight_diff(&a, &b), 0.0, "device state {on_device}: unit {u} weights");
        }
    }
}

/// `--param-dtype bf16` on a CPU rounds the linear products' operands to bf16 on AMX-BF16 tiles
/// where the CPU has them (PyTorch's CPU autocast): two ranks reproduce one rank under them,
/// and on such a CPU the curve differs from the one with the products held to f32
/// (`FSDP_SIMD=avx512`, the same bf16 parameters), by bf16's rounding and no more.
#[test]
fn bf16_products_follow_the_f32_products_curve() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let run = |name: &str, world: usize, simd: Option<&str>| {
        let out = tmp.path().join(name);
        let mut cmd = std::process::Command::new(bin());
        cmd.args(["finetune", "--model", model.to_str().unwrap(), "--data", training_data().to_str().unwrap(), "--output-dir"]);
        cmd.arg(&out).args(["--seq-len", "16", "--max-steps", "6", "--lr", "1e-3", "--no-shuffle", "--param-dtype", "bf16"]);
        // The same global batch at every world (--batch-size is each rank's).
        cmd.args(["--world-size", &world.to_string(), "--batch-size", &(4 / world).to_string()]);
        if let Some(level) = simd {
            cmd.env("FSDP_SIMD", level);
        }
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
        metric_losses(&out)
    };
    let one = run("w1", 1, None);
    let two = run("w2", 2, None);
    let d = max_rel_diff(&two, &one);
    assert!(d < 1e-5, "two ranks differ from one by {d}: {two:?} vs {one:?}");
    if kernels::simd::Kernels::get().amx_bf16() {
        let f32_products = run("w1-f32-products", 1, Some("avx512"));
        let d = max_rel_diff(&one, &f32_products);
        eprintln!("bf16 products vs f32 products: losses differ by {d:.1e}");
        assert!(d > 1e-7 && d < 1e-2, "bf16 products' losses differ by {d} from f32 products': {one:?} vs {f32_products:?}");
    }
}
