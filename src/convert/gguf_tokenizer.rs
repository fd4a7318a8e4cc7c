//! Rebuilds a Hugging Face `tokenizer.json` from the tokenizer stored in GGUF metadata.
//!
//! The pre-tokenizer matters: llama.cpp keeps a table of pre-tokenizers selected by
//! `tokenizer.ggml.pre`, and a wrong one tokenises digits and whitespace differently from the
//! original (candle's `from_gguf` falls back to plain GPT-2 for names it does not know). We map the
//! names we know to the pre-tokenizer the original Hugging Face tokenizer uses, and refuse the rest
//! rather than guess.

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value as GValue};
use serde_json::{json, Value};

/// llama.cpp's token types.
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

const LLAMA3_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

pub const SUPPORTED_PRE_TOKENIZERS: &[&str] = &["default", "gpt2", "smollm", "llama-bpe", "qwen2"];

/// The tokenizer pieces a converted model directory needs.
pub struct ConvertedTokenizer {
    pub tokenizer_json: Value,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub pad_token: Option<String>,
    pub add_bos_token: bool,
    pub added_tokens: Vec<Value>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub pad_id: Option<u32>,
}

fn meta<'a>(c: &'a Content, key: &str) -> Option<&'a GValue> {
    c.metadata.get(key)
}

fn meta_u32(c: &Content, key: &str) -> Option<u32> {
    meta(c, key).and_then(|v| v.to_u32().ok().or_else(|| v.to_i32().ok().map(|x| x as u32)))
}

fn meta_strings(c: &Content, key: &str) -> Result<Vec<String>> {
    let v = meta(c, key).with_context(|| format!("GGUF metadata has no `{key}`"))?;
    v.to_vec()
        .map_err(|e| anyhow::anyhow!("GGUF metadata `{key}`: {e}"))?
        .iter()
        .map(|x| x.to_string().cloned().map_err(|e| anyhow::anyhow!("GGUF metadata `{key}`: {e}")))
        .collect()
}

pub(crate) fn pre_tokenizer(pre: &str) -> Result<Value> {
    let byte_level =
        |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |pattern: &str| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
    Ok(match pre {
        "default" | "gpt2" => byte_level(true),
        // SmolLM's tokenizer.json: each digit on its own, then GPT-2's byte-level regex.
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "llama-bpe" => json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_PATTERN), byte_level(false)]}),
        "qwen2" => json!({"type": "Sequence", "pretokenizers": [split(QWEN2_PATTERN), byte_level(false)]}),
        other => bail!(
            "GGUF `tokenizer.ggml.pre` is {other:?}, which fsdp-app does not know; supported: {}. Converting \
             with a guessed pre-tokenizer would tokenise differently from the original model",
            SUPPORTED_PRE_TOKENIZERS.join(", ")
        ),
    })
}

pub fn convert_tokenizer(c: &Content) -> Result<ConvertedTokenizer> {
    let model =
        meta(c, "tokenizer.ggml.model").and_then(|v| v.to_string().ok().cloned()).context("GGUF metadata has no `tokenizer.ggml.model`")?;
    if model != "gpt2" {
        bail!(
            "GGUF tokenizer model {model:?} is not supported; only byte-level BPE (`gpt2`, used by Llama 3, \
             SmolLM, Qwen) converts to tokenizer.json here"
        );
    }
    let pre = meta(c, "tokenizer.ggml.pre").and_then(|v| v.to_string().ok().cloned()).unwrap_or("default".into());
    let tokens = meta_strings(c, "tokenizer.ggml.tokens")?;
    let merges = meta_strings(c, "tokenizer.ggml.merges")?;
    let types: Vec<i32> = match meta(c, "tokenizer.ggml.token_type") {
        Some(v) => v
            .to_vec()
            .map_err(|e| anyhow::anyhow!("GGUF `tokenizer.ggml.token_type`: {e}"))?
            .iter()
            .map(|x| x.to_i32().unwrap_or(1))
            .collect(),
        None => vec![1; tokens.len()],
    };
    let mut vocab = serde_json::Map::new();
    let mut added_tokens = vec![];
    for (id, tok) in tokens.iter().enumerate() {
        vocab.insert(tok.clone(), json!(id));
        let ty = types.get(id).copied().unwrap_or(1);
        if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
            added_tokens.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": ty == TOKEN_TYPE_CONTROL,
            }));
        }
    }
    let merges: Vec<Value> = merges
        .iter()
        .map(|m| {
            let (a, b) = m.split_once(' ').with_context(|| format!("GGUF merge {m:?} is not two tokens"))?;
            Ok(json!([a, b]))
        })
        .collect::<Result<_>>()?;
    let name_of = |key: &str| meta_u32(c, key).and_then(|id| tokens.get(id as usize).cloned());
    let bos_id = meta_u32(c, "tokenizer.ggml.bos_token_id");
    let eos_id = meta_u32(c, "tokenizer.ggml.eos_token_id");
    let pad_id = meta_u32(c, "tokenizer.ggml.padding_token_id");
    let bos_token = name_of("tokenizer.ggml.bos_token_id");
    let add_bos_token = meta(c, "tokenizer.ggml.add_bos_token").and_then(|v| v.to_bool().ok()).unwrap_or(false);
    let byte_level_post = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true});
    let post_processor = match (&bos_token, bos_id, add_bos_token) {
        (Some(bos), Some(id), true) => json!({"type": "Sequence", "processors": [byte_level_post, {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos.as_str(): {"id": bos, "ids": [id], "tokens": [bos]}},
        }]}),
        _ => byte_level_post,
    };
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer(&pre)?,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            // Llama 3 tokenizers look whole words up in the vocabulary before merging.
            "ignore_merges": pre == "llama-bpe",
            "vocab": Value::Object(vocab), "merges": merges,
        },
    });
    Ok(ConvertedTokenizer {
        tokenizer_json,
        bos_token,
        eos_token: name_of("tokenizer.ggml.eos_token_id"),
        unk_token: name_of("tokenizer.ggml.unknown_token_id"),
        pad_token: name_of("tokenizer.ggml.padding_token_id"),
        add_bos_token,
        added_tokens,
        bos_id,
        eos_id,
        pad_id,
    })
}
