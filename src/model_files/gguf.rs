//! A llama.cpp GGUF file as a model, its weights kept in their block formats: `--model
//! FILE.gguf`, or a Hub repository's GGUF file (`--model org/name:FILE.gguf`).
//!
//! The model's config, tokenizer, chat template and generation defaults come from the file's
//! metadata (`crate::convert::llama_meta`), written once as the side files of a model directory
//! (a cache directory named after their content), so everything that reads a model's files
//! (tokenizer, chat template, `/v1/models`) works unchanged. The weights are read from the GGUF
//! itself: block-quantised matrices stay quantised (`models::QuantizedWeights`), float tensors
//! (norms; everything in an f16 or f32 GGUF) are ordinary tensors.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::quantized::gguf_file::{self, Content};
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use models::{ModelConfig, QuantizedWeights};

use super::files::{self, ModelFiles, WeightFormat};
use super::write::StagedDir;
use crate::convert::llama_meta::{self, hf_name, unpermute_quantized_rows, LlamaDims};

/// Whether `--model` names a GGUF file (by its extension).
pub fn is_gguf_name(model: &str) -> bool {
    model.to_ascii_lowercase().ends_with(".gguf")
}

fn read_content(path: &Path) -> Result<(std::fs::File, Content)> {
    let mut file = std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let content = gguf_file::Content::read(&mut file).map_err(|e| anyhow::anyhow!("{}: not a valid GGUF file: {e}", path.display()))?;
    Ok((file, content))
}

/// Where the side files of GGUF models (and their f32 copies for training) live:
/// `$XDG_CACHE_HOME/fsdp-app/gguf`, else `~/.cache/fsdp-app/gguf`.
fn side_files_root() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(".")).join(".cache"));
    base.join("fsdp-app").join("gguf")
}

/// FNV-1a, 64 bits: names a cache directory after what it holds.
fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// The cache directory `prefix` + a hash of `key` (what the directory is made from: the side
/// files after their content, `convert::dequantized_for_training`'s copy after the file it came
/// from), made by `make(dir)` unless it holds `marker` already. Several processes may make the
/// same one at once: a `make` that fails because another one's directory is there is no error.
pub fn cache_dir(prefix: &str, key: &[u8], marker: &str, make: impl FnOnce(&Path) -> Result<()>) -> Result<PathBuf> {
    let dir = side_files_root().join(format!("{prefix}{:016x}", fnv64(key)));
    if !dir.join(marker).is_file() {
        if let Err(e) = make(&dir) {
            if !dir.join(marker).is_file() {
                return Err(e);
            }
        }
    }
    Ok(dir)
}

/// The model files of the GGUF at `path`; `source` names it in messages.
pub fn resolve_gguf(path: &Path, source: String) -> Result<ModelFiles> {
    let (_file, content) = read_content(path)?;
    llama_meta::check_llama(&content, &source)?;
    let side = llama_meta::side_files(&content, DType::F32, &source)?;
    // Named after the content: the same file (or one with the same metadata) reuses the
    // directory, and a changed file or a changed converter never reads stale side files.
    let text = serde_json::to_string(&[&side.config, &side.tokenizer_json, &side.tokenizer_config, &side.generation_config])?;
    let dir = cache_dir("", text.as_bytes(), files::GENERATION_CONFIG, |dir| {
        let staged = StagedDir::new(dir)?;
        side.write_into(&staged)?;
        staged.commit().map(drop)
    })?;
    let optional = |name: &str| Some(dir.join(name)).filter(|p| p.is_file());
    Ok(ModelFiles {
        source,
        config: dir.join(files::CONFIG),
        weights: vec![path.to_path_buf()],
        index: None,
        tokenizer: optional(files::TOKENIZER),
        tokenizer_config: optional(files::TOKENIZER_CONFIG),
        generation_config: optional(files::GENERATION_CONFIG),
        chat_template: None,
        special_tokens_map: None,
        st_modules: None,
        st_pooling: None,
        format: WeightFormat::Gguf,
    })
}

/// The weights of a GGUF model, by transformers name, q_proj/k_proj rows back in transformers'
/// order: f32 tensors and vectors (converted to the compute dtype by the caller's `VarBuilder`),
/// and the matrices stored in f16, bf16 or a block format, kept so. Every tensor's name and shape is checked against `cfg` first.
pub fn read_gguf_weights(path: &Path, cfg: &ModelConfig, device: &Device) -> Result<(HashMap<String, Tensor>, QuantizedWeights)> {
    let (mut file, content) = read_content(path)?;
    let source = path.display().to_string();
    let dims = LlamaDims::read(&content).with_context(|| source.clone())?;
    let expected: HashMap<String, Vec<usize>> = models::expected_tensors(cfg).into_iter().map(|t| (t.name, t.shape)).collect();
    let mut dense = HashMap::new();
    let mut quantized = QuantizedWeights::default();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let hf = hf_name(name).with_context(|| format!("{source}: unexpected GGUF tensor {name}"))?;
        let info = &content.tensor_infos[name];
        // candle's reader reverses GGUF's innermost-first dimensions: (out, in) like transformers.
        let shape: Vec<usize> = info.shape.dims().to_vec();
        match expected.get(&hf) {
            Some(want) if want == &shape => {}
            Some(want) => anyhow::bail!("{source}: tensor {name} ({hf}) is {shape:?}, the metadata's config needs {want:?}"),
            None => anyhow::bail!("{source}: tensor {name} ({hf}) is not part of this model's config"),
        }
        let q = content.tensor(&mut file, name, device).map_err(|e| anyhow::anyhow!("{source}: reading tensor {name}: {e}"))?;
        let heads = match () {
            _ if name.ends_with("attn_q.weight") => Some(dims.heads),
            _ if name.ends_with("attn_k.weight") => Some(dims.kv_heads),
            _ => None,
        };
        let q = match heads {
            Some(h) => unpermute_quantized_rows(&q, h)?,
            None => q,
        };
        // f32 tensors and every vector are ordinary tensors; f16 / bf16 matrices and the block
        // formats are kept as stored (f16 weights then decode from their 2 bytes).
        if q.dtype() == GgmlDType::F32 || q.shape().rank() == 1 {
            dense.insert(hf, q.dequantize(device)?);
        } else {
            quantized.insert(hf, q);
        }
    }
    let missing: Vec<&String> = expected.keys().filter(|n| !dense.contains_key(*n) && quantized.get(n).is_none()).collect();
    if !missing.is_empty() {
        anyhow::bail!("{source}: missing tensors {missing:?}");
    }
    Ok((dense, quantized))
}
