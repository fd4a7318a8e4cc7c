//! LoRA: PEFT adapters load and give PEFT's logits, merging matches `merge_and_unload`, training
//! on 1 and 2 ranks reproduces PEFT's 12 AdamW steps, the base is frozen (no gradient or
//! optimizer bytes), the output is PEFT's format, and bad settings name what exists.
//! References: tests/reference/make_lora_reference.py.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::training::max_rel_diff;
use common::*;
use fsdp_app::model_files::{load_model_with_adapter, resolve_model};
use fsdp_app::train::finetune::{run_local, FinetuneConfig};

fn peft_adapter() -> PathBuf {
    reference_dir().join("lora-llama")
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

fn logits_with(model: &Path, adapter: Option<&Path>, ids: &[u32]) -> Tensor {
    let m = load_model_with_adapter(resolve_model(model.to_str().unwrap(), None).unwrap(), adapter, DType::F32, &Device::Cpu).unwrap();
    let input = Tensor::from_vec(ids.to_vec(), (1, ids.len()), &Device::Cpu).unwrap();
    m.model.forward(&input).unwrap().squeeze(0).unwrap()
}

/// The settings of make_lora_reference.py's training run: the shared reference run, from PEFT's
/// adapter.
fn reference_config(model: &Path, out: &Path) -> FinetuneConfig {
    FinetuneConfig { adapter: Some(peft_adapter()), ..reference_training_config(model, out) }
}

#[test]
fn a_peft_adapter_gives_pefts_logits_and_merges_like_merge_and_unload() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let reference = reference_tensors("lora-llama.safetensors");
    let ids: Vec<u32> = reference["ids"].to_vec1::<i64>().unwrap().iter().map(|&x| x as u32).collect();
    let ours = logits_with(&model, Some(&peft_adapter()), &ids);
    let d = max_abs_diff(&ours, &reference["logits"]);
    assert!(d < 1e-4, "adapted logits differ from PEFT's by {d}");
    // The adapter matters: without it the logits are clearly different.
    let base = logits_with(&model, None, &ids);
    assert!(max_abs_diff(&base, &reference["logits"]) > 1e-2);

    let cfg = fsdp_app::model_files::read_model_config(&model.join("config.json")).unwrap();
    let adapter = fsdp_app::model_files::adapter::read_adapter(&peft_adapter(), &cfg).unwrap();
    let mut weights: HashMap<String, Tensor> = adapter.tensors.clone();
    for (k, t) in candle_core::safetensors::load(model.join("model-00001-of-00002.safetensors"), &Device::Cpu)
        .unwrap()
        .into_iter()
        .chain(candle_core::safetensors::load(model.join("model-00002-of-00002.safetensors"), &Device::Cpu).unwrap())
    {
        weights.insert(k, t.to_dtype(DType::F32).unwrap());
    }
    models::lora::merge_into(&mut weights, &adapter.settings).unwrap();
    assert!(!weights.keys().any(|k| k.contains("lora_")));
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"] {
        let d = max_abs_diff(&weights[name], &reference[&format!("merged.{name}")]);
        assert!(d < 1e-6, "merged {name} differs from merge_and_unload by {d}");
    }
}

/// An rsLoRA adapter (`use_rslora`: scaling alpha / sqrt(r)) gives PEFT's logits
/// (`tests/reference/make_rslora_reference.py`), which differ from the same weights scaled as
/// plain LoRA (alpha / r).
#[test]
fn an_rslora_adapter_gives_pefts_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let reference = reference_tensors("lora-llama-rslora.safetensors");
    let ids: Vec<u32> = reference["ids"].to_vec1::<i64>().unwrap().iter().map(|&x| x as u32).collect();
    let ours = logits_with(&model, Some(&reference_dir().join("lora-llama-rslora")), &ids);
    let d = max_abs_diff(&ours, &reference["logits"]);
    assert!(d < 1e-4, "rsLoRA logits differ from PEFT's by {d}");
    let apart = max_abs_diff(&reference["plain_logits"], &reference["logits"]);
    assert!(apart > 100.0 * 1e-4, "rsLoRA and plain LoRA scaling are too close ({apart}) for the check above to tell them apart");
}

#[test]
fn lora_training_reproduces_peft_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let reference = reference_tensors("lora-llama.safetensors");
    let expected = reference["losses"].to_vec1::<f64>().unwrap();
    let expected_norms = reference["grad_norms"].to_vec1::<f64>().unwrap();
    for (world, ac) in [(1usize, false), (2, false), (2, true)] {
        let mut c = reference_config(&model, &tmp.path().join(format!("out-{world}-{ac}")));
        c.world_size = world;
        c.batch_size = 4 / world;
        c.activation_checkpointing = ac;
        let run = run_local(&c).unwrap();
        let d = max_rel_diff(&run.losses, &expected);
        assert!(d < 1e-4, "world {world} ac {ac}: losses differ from PEFT's by {d}\n{:?}\n{expected:?}", run.losses);
        let dn = max_rel_diff(&run.grad_norms, &expected_norms);
        assert!(dn < 1e-4, "world {world} ac {ac}: grad norms differ by {dn}");
        // The frozen base has no gradient and no optimizer state: only the adapters' bytes.
        let trainable: usize = reference.keys().filter(|k| k.starts_with("grad.")).map(|k| reference[k].elem_count()).sum();
        let total: usize = run.rank_bytes.iter().map(|b| b.params).sum::<usize>() / 4;
        for (r, b) in run.rank_bytes.iter().enumerate() {
            assert_eq!(b.grads, trainable.div_ceil(world) * 4, "rank {r}: gradient bytes are the adapters' share");
            assert_eq!(b.optimizer, 2 * b.grads, "rank {r}: two AdamW moments per trained value");
            assert!(b.params >= total / world * 4 * 9 / 10, "rank {r}: holds its share of the (frozen) base");
        }
        assert!(trainable * 20 < run.total_params, "the adapters are a small part of the model");
    }
}

#[test]
fn the_output_is_a_peft_adapter_that_generate_applies_and_merge_lora_bakes_in() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let out = tmp.path().join("run");
    let data = reference_dir().join("train-data.jsonl");
    let o = run_cli(
        &[
            "finetune",
            "--model",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--output-dir",
            out.to_str().unwrap(),
            "--world-size",
            "2",
            "--seq-len",
            "16",
            "--batch-size",
            "2",
            "--max-steps",
            "4",
            "--lr",
            "1e-2",
            "--lora-r",
            "4",
            "--lora-alpha",
            "8",
            "--lora-targets",
            "q_proj,v_proj,down_proj",
            "--merge-lora",
            "--save-steps",
            "4",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let log = stderr(&o);
    assert!(log.contains("the base is frozen") && log.contains("trainable parameters"), "{log}");

    // Same tensor names and shapes, and the same LoRA fields, as PEFT's own save_pretrained.
    let ours = candle_core::safetensors::load(out.join("adapter_model.safetensors"), &Device::Cpu).unwrap();
    let peft = candle_core::safetensors::load(peft_adapter().join("adapter_model.safetensors"), &Device::Cpu).unwrap();
    let shapes = |m: &HashMap<String, Tensor>| -> Vec<(String, Vec<usize>)> {
        let mut v: Vec<_> = m.iter().map(|(k, t)| (k.clone(), t.dims().to_vec())).collect();
        v.sort();
        v
    };
    assert_eq!(shapes(&ours), shapes(&peft));
    let ours_cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap()).unwrap();
    let peft_cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(peft_adapter().join("adapter_config.json")).unwrap()).unwrap();
    for k in ["peft_type", "task_type", "r", "lora_alpha", "bias", "fan_in_fan_out", "use_rslora", "use_dora", "init_lora_weights"] {
        assert_eq!(ours_cfg[k], peft_cfg[k], "adapter_config.json field {k}");
    }
    let mut targets: Vec<String> = serde_json::from_value(ours_cfg["target_modules"].clone()).unwrap();
    targets.sort();
    assert_eq!(serde_json::json!(targets), peft_cfg["target_modules"]);
    // Training moved B away from zero (PEFT's initialisation), so the adapter does something.
    assert!(ours.iter().filter(|(k, _)| k.contains("lora_B")).all(|(_, t)| t
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        > 0.0));

    // base + adapter == merged model == `fsdp-app merge` of the LoRA checkpoint.
    let ids: Vec<u32> = (0..10).map(|i| (i * 41 + 5) % 384).collect();
    let adapted = logits_with(&model, Some(&out), &ids);
    let merged = logits_with(&out.join("merged"), None, &ids);
    let d = max_abs_diff(&adapted, &merged);
    assert!(d < 1e-4, "generate --adapter and the --merge-lora export differ by {d}");
    assert!(max_abs_diff(&adapted, &logits_with(&model, None, &ids)) > 1e-4, "the adapter changes the logits");
    let merged_ckpt = tmp.path().join("merged-ckpt");
    let m = run_cli(&["merge", out.join("checkpoint-4").to_str().unwrap(), merged_ckpt.to_str().unwrap()], &[]);
    assert!(m.status.success(), "{}", stderr(&m));
    assert!(!merged_ckpt.join("adapter_config.json").exists());
    let d = max_abs_diff(&logits_with(&merged_ckpt, None, &ids), &merged);
    assert!(d < 1e-4, "fsdp-app merge of the LoRA checkpoint differs from --merge-lora by {d}");

    // The CLI applies the adapter too.
    let g = run_cli(
        &[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--adapter",
            out.to_str().unwrap(),
            "--prompt",
            "hello",
            "--max-new-tokens",
            "3",
            "--json",
        ],
        &[],
    );
    assert!(g.status.success(), "{}", stderr(&g));
}

#[test]
fn resuming_a_lora_run_continues_it_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let lora = models::LoraSettings { r: 4, alpha: 16.0, dropout: 0.1, targets: vec!["all-linear".into()], use_rslora: false };
    let mut full = reference_config(&model, &tmp.path().join("full"));
    full.adapter = None;
    full.lora = Some(lora.clone());
    full.max_steps = Some(6);
    full.save_steps = Some(3);
    let straight = run_local(&full).unwrap();
    let mut resumed = reference_config(&model, &tmp.path().join("full"));
    resumed.adapter = None;
    resumed.lora = Some(lora.clone());
    resumed.max_steps = Some(6);
    resumed.world_size = 2;
    resumed.batch_size = 2;
    resumed.output_dir = tmp.path().join("resumed");
    resumed.resume_from = Some(tmp.path().join("full").join("checkpoint-3").to_string_lossy().to_string());
    let second = run_local(&resumed).unwrap();
    let d = max_rel_diff(&second.losses, &straight.losses[3..]);
    assert!(d < 1e-5, "resumed losses {:?} vs {:?}", second.losses, &straight.losses[3..]);

    // Dropout is on and deterministic: the same masks on 2 ranks (above), and it changes the run.
    let mut no_dropout = full.clone();
    no_dropout.lora = Some(models::LoraSettings { dropout: 0.0, ..lora });
    no_dropout.output_dir = tmp.path().join("no-dropout");
    no_dropout.save_steps = None;
    let plain = run_local(&no_dropout).unwrap();
    assert!(max_rel_diff(&plain.losses[1..], &straight.losses[1..]) > 1e-4, "dropout 0.1 changed nothing");
}

#[test]
fn bad_lora_settings_name_what_exists() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let data = reference_dir().join("train-data.jsonl");
    let run = |extra: &[&str]| {
        let out = tmp.path().join(format!("o{}", extra.len()));
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
            "--max-steps",
            "1",
        ];
        args.extend_from_slice(extra);
        let o = run_cli(&args, &[]);
        assert!(!o.status.success());
        stderr(&o)
    };
    let e = run(&["--lora-targets", "q_proj,qkv_proj"]);
    assert!(
        e.contains("\"qkv_proj\" matches no module") && e.contains("q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
        "{e}"
    );
    let e = run(&["--merge-lora"]);
    assert!(e.contains("--merge-lora needs a LoRA run"), "{e}");
    let e = run(&["--lora-r", "0"]);
    assert!(e.contains("--lora-r must be at least 1"), "{e}");
    let e = run(&["--adapter", tmp.path().to_str().unwrap()]);
    assert!(e.contains("adapter_config.json"), "{e}");
    // An adapter for another shape of model lists what does not fit.
    let other = fixture("qwen2", tmp.path());
    let g = run_cli(&["generate", "--model", other.to_str().unwrap(), "--adapter", peft_adapter().to_str().unwrap(), "--prompt", "x"], &[]);
    assert!(!g.status.success());
    let e = stderr(&g);
    assert!(e.contains("adapter_model.safetensors") && e.contains("wrong shapes"), "{e}");
}

/// One decode batch of the base and three serving adapters of different ranks and targets (rows:
/// base, a0, a1, a0, a2, prompts of different lengths) gives, row by row and step by step, the
/// logits of each adapter's merged model decoding alone; each prompt's prefill with its adapter
/// likewise. This is the serving path (`RowAdapters`, `ops::lora_rows`) without a server.
#[test]
fn a_mixed_batch_of_serving_adapters_equals_each_merged_model() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture("llama", tmp.path());
    let files = resolve_model(dir.to_str().unwrap(), None).unwrap();
    let cfg = fsdp_app::model_files::read_model_config(&files.config).unwrap();
    let mut base_weights = HashMap::new();
    for w in &files.weights {
        base_weights.extend(candle_core::safetensors::load(w, &Device::Cpu).unwrap());
    }
    let build = |w: HashMap<String, Tensor>| {
        models::CausalLm::new(&cfg, None, candle_nn::VarBuilder::from_tensors(w, DType::F32, &Device::Cpu)).unwrap()
    };
    let base = build(base_weights.clone());
    let mut seed = 7u64;
    let (mut adapters, mut merged) = (vec![], vec![]);
    for (i, (r, targets)) in [(4, "q_proj,v_proj"), (8, "all-linear"), (2, "o_proj,down_proj")].into_iter().enumerate() {
        let settings = models::LoraSettings {
            r,
            alpha: 2.0 * r as f64,
            targets: targets.split(',').map(String::from).collect(),
            ..Default::default()
        };
        let tensors: HashMap<String, Tensor> = (0..cfg.num_hidden_layers)
            .flat_map(|l| models::lora::layer_adapter_tensors(&cfg, &settings, l))
            .map(|spec| {
                let n: usize = spec.shape.iter().product();
                let v: Vec<f32> =
                    (0..n).map(|_| ((kernels::rng::splitmix64(&mut seed) >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2).collect();
                (spec.name.clone(), Tensor::from_vec(v, spec.shape.as_slice(), &Device::Cpu).unwrap())
            })
            .collect();
        adapters.push(std::sync::Arc::new(
            models::ServingAdapter::new(&format!("a{i}"), &settings, tensors.clone(), DType::F32, &Device::Cpu).unwrap(),
        ));
        let mut w = base_weights.clone();
        w.extend(tensors);
        models::lora::merge_into(&mut w, &settings).unwrap();
        merged.push(build(w));
    }
    let rows: [Option<usize>; 5] = [None, Some(0), Some(1), Some(0), Some(2)];
    let alone_model = |r: usize| rows[r].map_or(&base, |a| &merged[a]);
    let one = |ids: &[u32]| Tensor::new(ids, &Device::Cpu).unwrap().unsqueeze(0).unwrap();

    let (mut served, mut alone, mut next) = (vec![], vec![], vec![]);
    let mut smallest_effect = f32::INFINITY;
    for (r, adapter) in rows.iter().enumerate() {
        let prompt: Vec<u32> = (0..(3 + 2 * r) as u32).map(|i| (i * 31 + r as u32 * 7) % 300 + 3).collect();
        let (mut c1, mut c2) = (models::KvCache::new(&cfg), models::KvCache::new(&cfg));
        let rows_adapter = models::RowAdapters::all(adapter.map(|a| &adapters[a]));
        let got = base.forward_cached(&one(&prompt), &mut c1, &rows_adapter).unwrap();
        let want = alone_model(r).forward_cached(&one(&prompt), &mut c2, &Default::default()).unwrap();
        assert!(max_abs_diff(&got, &want) < 1e-4, "row {r} prefill: {}", max_abs_diff(&got, &want));
        if adapter.is_some() {
            let without = base.forward_cached(&one(&prompt), &mut models::KvCache::new(&cfg), &Default::default()).unwrap();
            smallest_effect = smallest_effect.min(max_abs_diff(&without, &want));
        }
        next.push(want.squeeze(0).unwrap().argmax(0).unwrap().to_scalar::<u32>().unwrap());
        served.push(c1);
        alone.push(c2);
    }
    let per_row: Vec<Option<&std::sync::Arc<models::ServingAdapter>>> = rows.iter().map(|a| a.map(|a| &adapters[a])).collect();
    let mixed = models::RowAdapters::of_rows(&per_row, &Device::Cpu).unwrap();
    for step in 0..4 {
        let mut refs: Vec<&mut models::KvCache> = served.iter_mut().collect();
        let batch = base.forward_decode_rows(&next, &mut refs, &mixed).unwrap();
        for (r, cache) in alone.iter_mut().enumerate() {
            let want = alone_model(r).forward_cached(&one(&[next[r]]), cache, &Default::default()).unwrap().squeeze(0).unwrap();
            let got = batch.get(r).unwrap();
            assert!(max_abs_diff(&got, &want) < 1e-4, "step {step} row {r}: {}", max_abs_diff(&got, &want));
        }
        next = (0..rows.len()).map(|r| batch.get(r).unwrap().argmax(0).unwrap().to_scalar::<u32>().unwrap()).collect();
    }
    assert!(smallest_effect > 1e-2, "an adapter hardly changes the logits ({smallest_effect}): the comparison proves nothing");
}
