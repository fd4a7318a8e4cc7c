//! A shard group of one rank computes on its master chunks themselves (`UnitShards::lend`):
//! no copy is made when a unit is gathered, freed, refilled or dropped, and the chunks are back
//! in the unit's storage, unchanged, whenever no gathered tensor holds them. Values rounded to
//! a `param_dtype` are still gathered as a copy.

use std::time::Duration;

use candle_core::DType;

use super::*;
use crate::dist::local::create_process_groups;
use crate::fsdp::optim::AdamWConfig;
use crate::fsdp::plan::{plan_units, WrapPolicy};

/// A one-rank engine over the llama fixture, every parameter filled with known values, at
/// `param_dtype`.
fn engine(dir: &std::path::Path, param_dtype: DType) -> FsdpEngine {
    let files = crate::model_files::resolve_model(dir.to_str().unwrap(), None).unwrap();
    let cfg = crate::model_files::read_model_config(&files.config).unwrap();
    let staged: Arc<dyn StagedModel> = Arc::new(models::LlamaStages::new(&cfg, None));
    let plan = plan_units(staged.as_ref(), WrapPolicy::TransformerBased, 1).unwrap();
    let groups = create_process_groups(1, 1, Duration::from_secs(10)).pop().unwrap();
    let opts = FsdpOptions {
        strategy: ShardingStrategy::FullShard,
        activation_checkpointing: false,
        param_dtype,
        reduce_dtype: DType::F32,
        prefetch: false,
    };
    let mut engine = FsdpEngine::new(staged, plan, groups, opts, AdamWConfig::default(), false).unwrap();
    for u in 0..engine.units.len() {
        let full =
            engine.units[u].plan.params.iter().map(|p| (p.spec.name.clone(), (0..p.numel()).map(|i| i as f32 * 1e-3).collect())).collect();
        engine.load_unit(u, Some(full)).unwrap();
    }
    engine
}

/// Where each of unit `u`'s master chunks lives, and its values.
fn master(engine: &FsdpEngine, u: usize) -> Vec<(*const f32, Vec<f32>)> {
    engine.units[u].shards.as_host().unwrap().master.iter().map(|m| (m.as_ptr(), m.clone())).collect()
}

/// Where each of unit `u`'s gathered tensors keeps its values.
fn gathered(engine: &FsdpEngine, u: usize) -> Vec<*const f32> {
    let unit = &engine.units[u];
    let tensors = unit.gathered.tensors().unwrap();
    unit.plan.params.iter().map(|p| shards::with_f32_slice(&tensors[&p.spec.name], |v| v.as_ptr()).unwrap()).collect()
}

/// An engine at `param_dtype` (with the directory of its fixture), a decoder layer's unit
/// and the stage that reads it, and where that unit's master chunks live, with their values.
struct LayerUnit {
    _dir: tempfile::TempDir,
    e: FsdpEngine,
    u: usize,
    s: usize,
    before: Vec<(*const f32, Vec<f32>)>,
    home: Vec<*const f32>,
}

fn layer_unit(param_dtype: DType) -> LayerUnit {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(&crate::fixtures::write_fixture("llama", &dir.path().join("llama")).unwrap(), param_dtype);
    let u = 1;
    let s = (0..e.stage_units.len()).find(|&s| e.stage_units[s].contains(&u)).unwrap();
    let before = master(&e, u);
    let home = before.iter().map(|(at, _)| *at).collect();
    LayerUnit { _dir: dir, e, u, s, before, home }
}

#[test]
fn one_shard_computes_on_its_master_chunks_without_a_copy() {
    let LayerUnit { _dir, mut e, u, s, before, home } = layer_unit(DType::F32);
    let bytes = e.memory_bytes();

    e.ensure_gathered(s).unwrap();
    assert_eq!(gathered(&e, u), home, "the gathered tensors are the master chunks' own buffers");
    assert_eq!(e.memory_bytes(), bytes, "lent chunks are still counted");
    // Values read through the gathered tensors are the master's.
    let name = e.units[u].plan.params[0].spec.name.clone();
    let t = e.units[u].gathered.tensors().unwrap()[&name].clone();
    assert_eq!(t.flatten_all().unwrap().to_vec1::<f32>().unwrap(), before[0].1);
    // The storage refuses to update lent chunks (AdamW while a unit is gathered).
    let n = e.units[u].plan.params.len();
    let step = shards::AdamWStep { cfg: &e.adam, lr: 1e-3, step: 1, weight_decay: vec![0.0; n], clip: None };
    let unit = &mut e.units[u];
    let cx = unit_ctx(&unit.plan, &e.groups, &e.opts, &e.device);
    assert!(unit.shards.adamw(&cx, &step).is_err());

    // Freed (FULL_SHARD after the forward): the chunks are home, the tensors unreadable.
    e.reshard(u).unwrap();
    assert_eq!(master(&e, u), before);
    assert!(t.to_vec1::<f32>().is_err());
    // Refilled for the backward: lent again, still no copy.
    e.ensure_gathered(s).unwrap();
    assert_eq!(gathered(&e, u), home);
    // Dropped after the backward: home again, unchanged.
    e.drop_gathered(u).unwrap();
    assert_eq!(master(&e, u), before);
    assert!(matches!(e.units[u].gathered, super::Gathered::No) && !e.units[u].shards.is_lent());
}

#[test]
fn rounded_values_are_still_gathered_as_a_copy() {
    let LayerUnit { _dir, mut e, u, s, before, home } = layer_unit(DType::BF16);
    e.ensure_gathered(s).unwrap();
    assert!(!e.units[u].shards.is_lent());
    assert!(gathered(&e, u).iter().zip(&home).all(|(a, b)| a != b), "bf16-rounded values are a copy");
    assert_eq!(master(&e, u), before, "the master chunks stay in place, unrounded");
}
