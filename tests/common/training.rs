//! The FSDP engine as the training tests drive it: a world-1 engine over a fixture, and the
//! comparison of one step's gradients with a PyTorch reference (make_training_reference.py's
//! first micro-batch).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use fsdp_app::dist::local::LocalGroup;
use fsdp_app::fsdp::engine::{FsdpEngine, FsdpOptions, ProcessGroups};
use fsdp_app::fsdp::optim::AdamWConfig;
use fsdp_app::fsdp::plan::{plan_units, ShardingStrategy, WrapPolicy};
use fsdp_app::train::loss::{next_token_targets, summed_token_loss};
use models::StageContext;

use super::reference_dir;

/// A world-1 engine over a fixture, weights loaded.
pub fn engine_for(dir: &Path, ac: bool) -> FsdpEngine {
    let files = fsdp_app::model_files::resolve_model(dir.to_str().unwrap(), None).unwrap();
    let cfg = fsdp_app::model_files::read_model_config(&files.config).unwrap();
    let staged: Arc<dyn models::StagedModel> = Arc::new(models::LlamaStages::new(&cfg, None));
    let plan = plan_units(staged.as_ref(), WrapPolicy::TransformerBased, 1).unwrap();
    let g = |_: ()| -> Arc<dyn fsdp_app::dist::Collective> { Arc::new(LocalGroup::create(1, Duration::from_secs(10)).pop().unwrap()) };
    let groups = ProcessGroups { world: g(()), shard: g(()), replicate: g(()) };
    let opts = FsdpOptions {
        strategy: ShardingStrategy::FullShard,
        activation_checkpointing: ac,
        param_dtype: DType::F32,
        reduce_dtype: DType::F32,
        prefetch: false,
    };
    let mut engine = FsdpEngine::new(staged, plan, groups, opts, AdamWConfig::default(), false).unwrap();
    let mut stored = HashMap::new();
    for p in &files.weights {
        for (k, t) in candle_core::safetensors::load(p, &Device::Cpu).unwrap() {
            stored.insert(k, t.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        }
    }
    let n = engine.units().count();
    for u in 0..n {
        engine.load_unit(u, Some(stored.clone())).unwrap();
    }
    engine
}

/// The gradients of one step over the first micro-batch of train-data.jsonl (4 rows padded with
/// eos to 16 tokens, as the reference scripts pad them), loss normalised by its target tokens.
pub fn step_one_gradients(dir: &Path, ac: bool) -> HashMap<String, Vec<f32>> {
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(reference_dir().join("train-data.jsonl"))
        .unwrap()
        .lines()
        .take(4)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let eos = 2u32;
    let mut ids = vec![];
    let mut labels = vec![];
    for r in &rows {
        let mut i: Vec<u32> = r["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        let mut l: Vec<i64> = r["labels"].as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect();
        i.resize(16, eos);
        l.resize(16, -100);
        ids.extend(i);
        labels.extend(l);
    }
    let targets = (0..4).map(|b| labels[b * 16 + 1..(b + 1) * 16].iter().filter(|&&x| x != -100).count()).sum::<usize>();
    let mut engine = engine_for(dir, ac);
    let input = Tensor::from_vec(ids, (4, 16), &Device::Cpu).unwrap();
    let ctx = StageContext { targets: Some(next_token_targets(&labels, 4, 16)), ..Default::default() };
    engine.forward_backward(&input, &ctx, &summed_token_loss, 1.0 / targets as f64).unwrap();
    engine.grad_chunks()
}

/// One step's gradients over the model in `dir` equal the reference's, parameter by parameter
/// (within 1e-4 of the largest), and every parameter got one.
pub fn assert_step_one_gradients_match(what: &str, dir: &Path, ac: bool, reference: &HashMap<String, Tensor>) -> HashMap<String, Vec<f32>> {
    let grads = step_one_gradients(dir, ac);
    let mut checked = 0;
    for (k, g) in &grads {
        let r = reference.get(k).unwrap_or_else(|| panic!("{what}: no reference gradient for {k}"));
        let r = r.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let scale = r.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = g.iter().zip(&r).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(d <= 1e-4 * scale.max(1.0), "{what}: gradient of {k} differs by {d} (max |g| {scale})");
        assert!(g.iter().any(|x| *x != 0.0), "{what}: {k} got no gradient");
        checked += 1;
    }
    // Tied weights: PyTorch lists lm_head.weight too, as the same tensor as the embedding.
    let expected = reference.keys().filter(|k| k.contains(".weight") || k.contains(".bias")).count();
    let tied_extra = usize::from(reference.contains_key("lm_head.weight") && !grads.contains_key("lm_head.weight"));
    assert_eq!(checked + tied_extra, expected, "{what}: every parameter compared");
    grads
}

/// Every tensor of the safetensors files in `dir`.
pub fn weights(dir: &Path) -> HashMap<String, Tensor> {
    let mut all = HashMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            all.extend(candle_core::safetensors::load(&p, &Device::Cpu).unwrap());
        }
    }
    all
}

/// Largest absolute difference between two sets of the same tensors.
pub fn max_weight_diff(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().map(|(k, t)| (t - &b[k]).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()).fold(0.0, f32::max)
}

/// Largest relative difference between two series of the same length (losses, grad norms).
pub fn max_rel_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1e-12)).fold(0.0, f64::max)
}
