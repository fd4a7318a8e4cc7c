//! Our models against transformers: all-position logits, greedy continuations, tokenizer ids and
//! chat template rendering, for every fixture architecture. The reference values come from
//! tests/reference/make_references.py (PyTorch + transformers on CPU).

mod common;

use std::collections::HashSet;

use candle_core::{DType, Device, Module, Tensor};
use common::*;
use fsdp_app::generate::{generate, SamplingParams, DEFAULT_MAX_PREFILL_TOKENS};
use fsdp_app::model_files::{load_model, resolve_model};
use fsdp_app::tokenize::{ChatMessage, TextTokenizer};

fn greedy(n: usize) -> SamplingParams {
    SamplingParams::greedy(n)
}

#[test]
fn logits_and_greedy_tokens_match_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let dir = fixture(name, tmp.path());
        let loaded = load_model(resolve_model(dir.to_str().unwrap(), None).unwrap(), DType::F32, &Device::Cpu).unwrap();
        let reference = reference_tensors(&format!("fixture-{name}.safetensors"));
        let input = reference["input_ids"].to_dtype(DType::U32).unwrap();
        let logits = loaded.model.forward(&input).unwrap();
        let expected = &reference["logits"];
        assert_eq!(logits.dims(), expected.dims(), "{name}");
        let diff = (logits - expected).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-4, "{name}: all-position logits differ from transformers by {diff}");

        let tok = TextTokenizer::load(&loaded.files, loaded.config.vocab_size).unwrap();
        let prompt = tok.encode("What is the capital of France?", true).unwrap();
        assert_eq!(prompt, ids_u32(&reference["greedy_prompt"]), "{name}: prompt tokenisation");
        let out = generate(&loaded.model, &tok, &prompt, &HashSet::new(), &greedy(24), DEFAULT_MAX_PREFILL_TOKENS, |_| Ok(())).unwrap();
        assert_eq!(out.generated_ids, ids_u32(&reference["greedy_ids"]), "{name}: greedy continuation");
        assert_eq!(out.generated_ids.len(), 24);
    }
}

#[test]
fn cached_forward_matches_full_forward() {
    // The KV-cache path (fused ops) must give the same last-position logits as the training path.
    let tmp = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let dir = fixture(name, tmp.path());
        let loaded = load_model(resolve_model(dir.to_str().unwrap(), None).unwrap(), DType::F32, &Device::Cpu).unwrap();
        let ids: Vec<u32> = (0..14).map(|i| (i * 29 + 7) % 384).collect();
        let full = loaded.model.forward(&Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap()).unwrap();
        let mut cache = models::KvCache::new(&loaded.config);
        // Prefill 10 tokens, then feed the rest one by one.
        let mut last = loaded
            .model
            .forward_cached(&Tensor::new(&ids[..10], &Device::Cpu).unwrap().unsqueeze(0).unwrap(), &mut cache, &Default::default())
            .unwrap();
        let prefill_ref = full.get(0).unwrap().get(9).unwrap();
        let d = (last.get(0).unwrap() - &prefill_ref).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(d < 1e-4, "{name}: prefill logits differ by {d}");
        for (i, id) in ids.iter().enumerate().skip(10) {
            last = loaded
                .model
                .forward_cached(&Tensor::new(&[*id], &Device::Cpu).unwrap().unsqueeze(0).unwrap(), &mut cache, &Default::default())
                .unwrap();
            let r = full.get(0).unwrap().get(i).unwrap();
            let d = (last.get(0).unwrap() - &r).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d < 1e-4, "{name}: cached step {i} differs by {d}");
        }
    }
}

/// A prompt fed in chunks (chunked prefill: each chunk's queries attend over the cache by
/// tiles, `models::kv_cache`) scores every position as the full forward does (within 1e-5 of
/// the largest logit: a few f32 ulps),
/// for chunks from two tokens to the whole prompt, across tiles and cache blocks (one token
/// at a time is the decode step: `cached_forward_matches_full_forward`).
#[test]
fn chunked_prefill_matches_full_forward() {
    let tmp = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let dir = fixture(name, tmp.path());
        let loaded = load_model(resolve_model(dir.to_str().unwrap(), None).unwrap(), DType::F32, &Device::Cpu).unwrap();
        let ids: Vec<u32> = (0..150).map(|i| (i * 29 + 7) % 384).collect();
        let as_input = |ids: &[u32]| Tensor::new(ids, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let full = loaded.model.forward(&as_input(&ids)).unwrap().squeeze(0).unwrap();
        for chunk in [2, 7, 64, 100, 150] {
            let mut cache = models::KvCache::new(&loaded.config);
            let parts: Vec<Tensor> = ids
                .chunks(chunk)
                .map(|c| loaded.model.forward_cached_all(&as_input(c), &mut cache, &Default::default()).unwrap().squeeze(0).unwrap())
                .collect();
            let chunked = Tensor::cat(&parts, 0).unwrap();
            let d = (chunked - &full).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            let scale = full.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(
                d < 1e-5 * scale.max(1.0),
                "{name}: a 150-token prompt in chunks of {chunk}: logits differ from the full forward's by {d} (largest {scale})"
            );
        }
    }
}

#[test]
fn tokenizer_and_chat_template_match_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let dir = fixture(name, tmp.path());
        let files = resolve_model(dir.to_str().unwrap(), None).unwrap();
        let tok = TextTokenizer::load(&files, 384).unwrap();
        let reference = reference_json(&format!("fixture-{name}.json"));
        for case in reference["texts"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            assert_eq!(tok.encode(text, true).unwrap(), json_ids(&case["ids"]), "{name}: {text:?}");
            // Round trip through decode as well.
            assert_eq!(tok.decode(&json_ids(&case["ids"]), false).unwrap(), text, "{name}: decode");
        }
        let template = tok.chat_template.as_ref().expect("fixture has a chat template");
        for case in reference["chats"].as_array().unwrap() {
            let messages: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
            assert_eq!(template.render(&messages, true).unwrap(), case["rendered"].as_str().unwrap(), "{name}");
        }
        let err = template.render(&[ChatMessage::new("tool", "x")], true).unwrap_err();
        assert!(format!("{err:#}").contains("unknown role: tool"), "{err:#}");
    }
}

#[test]
fn every_parameter_gets_a_nonzero_gradient() {
    // The training forward must use only ops with a backward pass (DESIGN.md's trap list).
    let tmp = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let dir = fixture(name, tmp.path());
        let files = resolve_model(dir.to_str().unwrap(), None).unwrap();
        let cfg = fsdp_app::model_files::read_model_config(&files.config).unwrap();
        let varmap = candle_nn::VarMap::new();
        {
            let mut data = varmap.data().lock().unwrap();
            for path in &files.weights {
                for (k, t) in candle_core::safetensors::load(path, &Device::Cpu).unwrap() {
                    data.insert(k, candle_core::Var::from_tensor(&t).unwrap());
                }
            }
        }
        let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let model = models::CausalLm::new(&cfg, None, vb).unwrap();
        let ids: Vec<u32> = (0..12).map(|i| (i * 13 + 1) % 384).collect();
        let input = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let logits = model.forward(&input).unwrap().squeeze(0).unwrap();
        let targets = Tensor::new(&ids[1..], &Device::Cpu).unwrap();
        let loss = candle_nn::loss::cross_entropy(&logits.narrow(0, 0, 11).unwrap(), &targets).unwrap();
        let grads = loss.backward().unwrap();
        let data = varmap.data().lock().unwrap();
        assert_eq!(data.len(), models::expected_tensors(&cfg).len(), "{name}: one Var per tensor (tied = one)");
        for (k, v) in data.iter() {
            let g = grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name}: {k} got no gradient"));
            let norm = g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(norm > 0.0, "{name}: {k} has an all-zero gradient");
        }
    }
}

#[test]
fn decoder_layers_built_alone_reassemble_the_model() {
    // What the FSDP engine will do: build each decoder layer from a VarBuilder over just that
    // layer's tensors (names relative to the layer), run them in order, and get the model's logits.
    use models::layers::{OpMode, PositionInputs, RmsNorm, Rotary};
    use models::masks::causal_mask;
    let tmp = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let dir = fixture(name, tmp.path());
        let loaded = load_model(resolve_model(dir.to_str().unwrap(), None).unwrap(), DType::F32, &Device::Cpu).unwrap();
        let cfg = &loaded.config;
        let mut all = std::collections::HashMap::new();
        for p in &loaded.files.weights {
            all.extend(candle_core::safetensors::load(p, &Device::Cpu).unwrap());
        }
        let ids: Vec<u32> = (0..11).map(|i| (i * 17 + 2) % 384).collect();
        let input = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let expected = loaded.model.forward(&input).unwrap();

        let embed = &all["model.embed_tokens.weight"];
        let mut h = candle_nn::Embedding::new(embed.clone(), cfg.hidden_size).forward(&input).unwrap();
        let (cos, sin) = Rotary::new(cfg).tables(0, ids.len(), DType::F32, &Device::Cpu).unwrap();
        let mask = causal_mask(ids.len(), 0, cfg.sliding_window, DType::F32, &Device::Cpu).unwrap();
        let visibility = Some(ops::flash_attention::Visibility::causal(0, cfg.sliding_window));
        let pos = PositionInputs { cos, sin, mask, visibility, mode: OpMode::Train, row_seeds: None, adapters: Default::default() };
        for i in 0..cfg.num_hidden_layers {
            let prefix = format!("model.layers.{i}.");
            let own: std::collections::HashMap<String, Tensor> =
                all.iter().filter_map(|(k, t)| k.strip_prefix(&prefix).map(|rest| (rest.to_string(), t.clone()))).collect();
            let layer = models::DecoderLayer::new(cfg, None, candle_nn::VarBuilder::from_tensors(own, DType::F32, &Device::Cpu)).unwrap();
            h = layer.forward(&h, &pos, None).unwrap();
        }
        let norm_vb = candle_nn::VarBuilder::from_tensors(
            [("weight".to_string(), all["model.norm.weight"].clone())].into_iter().collect(),
            DType::F32,
            &Device::Cpu,
        );
        let h = RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, norm_vb).unwrap().forward(&h, OpMode::Train).unwrap();
        let head = all.get("lm_head.weight").unwrap_or(embed);
        let logits = h.broadcast_matmul(&head.t().unwrap()).unwrap();
        let d = (logits - expected).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(d < 1e-5, "{name}: layer-by-layer logits differ by {d}");
    }
}

#[test]
fn half_precision_files_and_compute_dtypes_load() {
    // f16 and bf16 weight files load; bf16/f16 compute stays close to f32.
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture("qwen3", tmp.path());
    let f32_model = load_model(resolve_model(dir.to_str().unwrap(), None).unwrap(), DType::F32, &Device::Cpu).unwrap();
    let ids: Vec<u32> = (0..9).map(|i| (i * 5 + 1) % 384).collect();
    let input = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let reference = f32_model.model.forward(&input).unwrap();
    let w = dir.join("model.safetensors");
    let tensors = candle_core::safetensors::load(&w, &Device::Cpu).unwrap();
    for (file_dtype, compute, tol) in
        [(DType::F16, DType::F32, 0.05), (DType::BF16, DType::F32, 0.3), (DType::F32, DType::BF16, 0.5), (DType::F32, DType::F16, 0.05)]
    {
        let converted: std::collections::HashMap<String, Tensor> =
            tensors.iter().map(|(k, t)| (k.clone(), t.to_dtype(file_dtype).unwrap())).collect();
        candle_core::safetensors::save(&converted, &w).unwrap();
        let m = load_model(resolve_model(dir.to_str().unwrap(), None).unwrap(), compute, &Device::Cpu).unwrap();
        let logits = m.model.forward(&input).unwrap().to_dtype(DType::F32).unwrap();
        let d = (logits - &reference).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(d < tol, "file {file_dtype:?}, compute {compute:?}: logits differ by {d}");
    }
}

#[test]
fn batched_decode_of_sequences_of_different_lengths_equals_decoding_each_alone() {
    let tmp = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let dir = fixture(name, tmp.path());
        let m = load_model(resolve_model(dir.to_str().unwrap(), None).unwrap(), DType::F32, &Device::Cpu).unwrap().model;
        // Prompts longer and shorter than mistral's sliding window of 8.
        let prompts: Vec<Vec<u32>> =
            [3usize, 11, 6].iter().map(|&n| (0..n as u32).map(|i| (i * 37 + n as u32 * 5) % 300 + 3).collect()).collect();
        let mut alone: Vec<models::KvCache> = vec![];
        let mut next: Vec<u32> = vec![];
        for p in &prompts {
            let mut cache = models::KvCache::new(m.config());
            let logits = m
                .forward_cached(&Tensor::new(p.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap(), &mut cache, &Default::default())
                .unwrap();
            next.push(logits.squeeze(0).unwrap().argmax(0).unwrap().to_scalar::<u32>().unwrap());
            alone.push(cache);
        }
        let mut batched = alone.clone();
        for step in 0..6 {
            let mut refs: Vec<&mut models::KvCache> = batched.iter_mut().collect();
            let rows = m.forward_decode_rows(&next, &mut refs, &Default::default()).unwrap();
            for (r, cache) in alone.iter_mut().enumerate() {
                let one = m
                    .forward_cached(&Tensor::new(&[next[r]], &Device::Cpu).unwrap().unsqueeze(0).unwrap(), cache, &Default::default())
                    .unwrap()
                    .squeeze(0)
                    .unwrap();
                let d = (rows.get(r).unwrap() - &one).unwrap().abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
                assert!(d < 1e-4, "{name} step {step} row {r}: batched logits differ by {d}");
            }
            next = (0..prompts.len()).map(|r| rows.get(r).unwrap().argmax(0).unwrap().to_scalar::<u32>().unwrap()).collect();
        }
    }
}

/// The same weights give the same logits bit for bit, also while other threads compute on the
/// same thread pool (as the server's requests and the tests beside this one do): a two-thread
/// product once split its columns by the threads' measured speeds into pieces gemm sums in
/// another order, and two loads of one checkpoint gave logits 1e-6 apart (6 forwards in 300).
#[test]
fn logits_are_bitwise_reproducible_while_other_threads_compute() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture("llama", tmp.path());
    let load = || load_model(resolve_model(dir.to_str().unwrap(), None).unwrap(), DType::F32, &Device::Cpu).unwrap();
    let ids = Tensor::new(&[[1u32, 5, 9, 200, 17]], &Device::Cpu).unwrap();
    let bits = |m: &fsdp_app::model_files::LoadedModel| -> Vec<u32> {
        m.model.forward(&ids).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
    };
    let reference = bits(&load());
    let stop = AtomicBool::new(false);
    let differing = std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let m = load();
                let other = Tensor::new(&[[3u32; 40]], &Device::Cpu).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    m.model.forward(&other).unwrap();
                }
            });
        }
        let m = load();
        let differing = (0..300).filter(|_| bits(&m) != reference).count();
        stop.store(true, Ordering::Relaxed);
        differing
    });
    assert_eq!(differing, 0, "{differing} of 300 forwards gave other logits");
}
