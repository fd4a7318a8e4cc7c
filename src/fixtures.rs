//! Tiny random Hugging Face checkpoints for tests and for trying fsdp-app without downloads.
//!
//! Each fixture is a complete model directory: config.json, safetensors weights (sharded with an
//! index for `llama`), a byte-level BPE tokenizer trained on a built-in corpus, a ChatML chat
//! template and generation_config.json. Weights come from a fixed-seed generator of our own, so
//! the same fixture is bit-identical on every machine and the committed transformers reference
//! values stay valid.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use serde_json::{json, Value};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use crate::model_files::write::StagedDir;
use kernels::rng::SplitMix64;

/// The causal LMs.
pub const FIXTURE_NAMES: &[&str] = &["llama", "qwen2", "qwen3", "mistral"];
/// An embedding model laid out as Qwen3-Embedding is (see `config_json`).
pub const EMBEDDING_FIXTURE: &str = "qwen3-embedding";

pub const VOCAB_SIZE: usize = 384;
const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}\
{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}\
{% if loop.first and message['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}{% endif %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}\
{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Text the fixture tokenizer is trained on: English, digits, code-ish punctuation, whitespace.
const CORPUS: &[&str] = &[
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "What is the capital of France? The capital of France is Paris.",
    "Fine-tuning a language model needs data, a tokenizer, and patience.",
    "In 2024 there were 365 days; in 1999 there were 12 months and 52 weeks.",
    "fn main() { println!(\"hello, world\"); }  // a comment\n\tindented line",
    "Sharded data parallel training splits parameters, gradients and optimizer state across ranks.",
    "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\nHi! How can I help you today?<|im_end|>",
    "Numbers like 3.14159 and 2.71828 appear in mathematics, physics and engineering.",
    "The model answered the question, then the user asked another question about the weather.",
    "Tokens, tokens everywhere: the tokenizer merges frequent pairs of bytes into new tokens.",
];

fn config_json(name: &str) -> Result<Value> {
    let common = json!({
        "vocab_size": VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 2, "hidden_act": "silu",
        "max_position_embeddings": 256, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "float32",
        "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": true,
    });
    let specific = match name {
        // GQA, untied, Llama 3 rope scaling (the frequencies it changes are all exercised).
        "llama" => json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "intermediate_size": 160,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": false, "attention_bias": false, "mlp_bias": false,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        }),
        // qkv bias, tied embeddings.
        "qwen2" => json!({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": true, "use_sliding_window": false,
            "sliding_window": null, "max_window_layers": 2,
        }),
        // per-head q/k norm, head_dim that is not hidden / heads.
        "qwen3" => json!({
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": false, "attention_bias": false,
            "use_sliding_window": false, "sliding_window": null, "max_window_layers": 2,
        }),
        // multi-query attention and a sliding window shorter than the test sequences.
        "mistral" => json!({
            "architectures": ["MistralForCausalLM"], "model_type": "mistral", "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": false, "sliding_window": 8,
        }),
        // An embedding model laid out as Qwen3-Embedding is: the bare model (no LM head, tensor
        // names without `model.`) with sentence-transformers' last-token pooling.
        EMBEDDING_FIXTURE => {
            let mut qwen3 = config_json("qwen3")?;
            qwen3["architectures"] = json!(["Qwen3Model"]);
            qwen3["tie_word_embeddings"] = json!(true);
            return Ok(qwen3);
        }
        other => bail!("unknown fixture {other:?}; available: {}, {EMBEDDING_FIXTURE}", FIXTURE_NAMES.join(", ")),
    };
    let mut cfg = common;
    for (k, v) in specific.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    Ok(cfg)
}

/// Trains the fixture's byte-level BPE tokenizer on `CORPUS`.
pub fn train_tokenizer() -> Result<Tokenizer> {
    let specials: Vec<AddedToken> = SPECIAL_TOKENS.iter().map(|t| AddedToken::from(t.to_string(), true)).collect();
    let alphabet: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(VOCAB_SIZE)
        .min_frequency(1)
        .show_progress(false)
        .special_tokens(specials)
        .initial_alphabet(alphabet)
        .build()
        .into();
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    tokenizer.with_post_processor(Some(ByteLevel::default().trim_offsets(false)));
    // Repeat the corpus so that pair counts are large enough to fill the vocabulary.
    let lines: Vec<String> = (0..4).flat_map(|_| CORPUS.iter().map(|s| s.to_string())).collect();
    tokenizer.train(&mut trainer, lines.into_iter()).map_err(|e| anyhow::anyhow!("training the fixture tokenizer: {e}"))?;
    let n = tokenizer.get_vocab_size(true);
    if n > VOCAB_SIZE {
        bail!("fixture tokenizer has {n} tokens, more than {VOCAB_SIZE}");
    }
    Ok(tokenizer)
}

/// Deterministic weights for every tensor the config needs, in `expected_tensors` order.
fn random_weights(cfg: &models::ModelConfig, seed: u64) -> Result<Vec<(String, Tensor)>> {
    let mut rng = SplitMix64(seed);
    let mut out = vec![];
    for spec in models::expected_tensors(cfg) {
        let n: usize = spec.shape.iter().product();
        let values: Vec<f32> = if spec.name.ends_with("norm.weight") {
            (0..n).map(|_| 1.0 + 0.2 * rng.next_signed()).collect()
        } else if spec.name.ends_with(".bias") {
            (0..n).map(|_| 0.1 * rng.next_signed()).collect()
        } else if spec.name == "model.embed_tokens.weight" {
            (0..n).map(|_| rng.next_signed()).collect()
        } else {
            // Uniform with variance 1/fan_in: activations stay O(1) through the layers.
            let fan_in = *spec.shape.last().unwrap() as f32;
            let a = (3.0 / fan_in).sqrt();
            (0..n).map(|_| a * rng.next_signed()).collect()
        };
        out.push((spec.name.clone(), Tensor::from_vec(values, spec.shape.as_slice(), &Device::Cpu)?));
    }
    Ok(out)
}

/// Writes fixture `name` into `out` (which must not exist or be empty).
pub fn write_fixture(name: &str, out: &Path) -> Result<PathBuf> {
    write_fixture_with(name, out, &[])
}

/// Like [`write_fixture`], with config.json fields replaced (`("hidden_size", 1024)`, ...):
/// random models of any size for benchmarks. A vocabulary larger than the tokenizer's is fine.
pub fn write_fixture_with(name: &str, out: &Path, overrides: &[(String, Value)]) -> Result<PathBuf> {
    let mut cfg_json = config_json(name)?;
    for (k, v) in overrides {
        if cfg_json.get(k).is_none() {
            bail!("fixture {name} has no config field `{k}` to set");
        }
        cfg_json[k] = v.clone();
    }
    let cfg = models::ModelConfig::from_json_str(&cfg_json.to_string()).context("fixture config")?;
    let staged = StagedDir::new(out)?;
    staged.write_json("config.json", &cfg_json)?;

    // Each fixture its own seed (the embedding model's follows the causal LMs').
    let seed = FIXTURE_NAMES.iter().position(|n| *n == name).unwrap_or(FIXTURE_NAMES.len()) as u64 + 1;
    let weights = random_weights(&cfg, seed)?;
    if name == "llama" {
        // Sharded like a big checkpoint: embeddings and layer 0 in the first file, the rest in the second.
        let (first, second): (Vec<_>, Vec<_>) =
            weights.into_iter().partition(|(n, _)| n.starts_with("model.embed_tokens") || n.starts_with("model.layers.0."));
        let files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
        let mut weight_map = BTreeMap::new();
        let mut total = 0usize;
        for (file, part) in files.iter().zip([first, second]) {
            for (n, t) in &part {
                weight_map.insert(n.clone(), json!(file));
                total += t.elem_count() * 4;
            }
            staged.write_safetensors(file, &part.into_iter().collect::<HashMap<_, _>>())?;
        }
        staged.write_json("model.safetensors.index.json", &json!({"metadata": {"total_size": total}, "weight_map": weight_map}))?;
    } else if cfg.headless {
        let bare = weights.into_iter().map(|(n, t)| (n.strip_prefix("model.").unwrap_or(&n).to_string(), t));
        staged.write_safetensors("model.safetensors", &bare.collect::<HashMap<_, _>>())?;
        staged.write_json(
            "modules.json",
            &json!([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]),
        )?;
        std::fs::create_dir_all(staged.path().join("1_Pooling"))?;
        staged.write_json(
            "1_Pooling/config.json",
            &json!({"word_embedding_dimension": cfg.hidden_size, "pooling_mode_cls_token": false,
            "pooling_mode_mean_tokens": false, "pooling_mode_max_tokens": false, "pooling_mode_mean_sqrt_len_tokens": false,
            "pooling_mode_weightedmean_tokens": false, "pooling_mode_lasttoken": true, "include_prompt": true}),
        )?;
    } else {
        staged.write_safetensors("model.safetensors", &weights.into_iter().collect::<HashMap<_, _>>())?;
    }

    let tokenizer = train_tokenizer()?;
    let tok_path = staged.path().join("tokenizer.json");
    tokenizer.save(&tok_path, false).map_err(|e| anyhow::anyhow!("writing {}: {e}", tok_path.display()))?;
    if name.starts_with("qwen") {
        // Real Qwen checkpoints split digits one by one (and transformers' Qwen2Tokenizer enforces
        // that pre-tokenizer whatever tokenizer.json says), so the Qwen fixtures carry it too.
        let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&tok_path)?)?;
        json["pre_tokenizer"] = crate::convert::gguf_tokenizer::pre_tokenizer("qwen2")?;
        staged.write_json("tokenizer.json", &json)?;
    }
    let added: serde_json::Map<String, Value> = SPECIAL_TOKENS
        .iter()
        .map(|t| {
            let id = tokenizer.token_to_id(t).expect("special token in vocabulary");
            (
                id.to_string(),
                json!({"content": t, "lstrip": false, "rstrip": false, "normalized": false,
                                    "single_word": false, "special": true}),
            )
        })
        .collect();
    staged.write_json(
        "tokenizer_config.json",
        &json!({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "unk_token": null, "add_bos_token": false, "add_eos_token": false,
            "clean_up_tokenization_spaces": false, "model_max_length": 256, "chat_template": CHAT_TEMPLATE,
            "added_tokens_decoder": Value::Object(added),
        }),
    )?;
    staged.write_json("generation_config.json", &json!({"bos_token_id": 0, "eos_token_id": 2, "do_sample": false}))?;
    staged.commit()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_fixed() {
        let mut r = SplitMix64(1);
        // Reference values of SplitMix64 seeded with 1.
        assert_eq!(r.next_u64(), 0x910A_2DEC_8902_5CC1);
        assert_eq!(r.next_u64(), 0xBEEB_8DA1_658E_EC67);
    }

    #[test]
    fn tokenizer_fills_vocab_and_keeps_specials_first() {
        let t = train_tokenizer().unwrap();
        assert_eq!(t.token_to_id("<|endoftext|>"), Some(0));
        assert_eq!(t.token_to_id("<|im_end|>"), Some(2));
        let n = t.get_vocab_size(true);
        assert!(n > 300 && n <= VOCAB_SIZE, "{n}");
    }
}
