//! `fsdp-app convert --gguf FILE --out DIR`: a llama.cpp GGUF file to a Hugging Face model
//! directory that transformers (and fsdp-app) load as a normal Llama; and the same conversion,
//! cached, that `finetune --model FILE.gguf` trains from.

pub mod gguf_tokenizer;
pub mod llama_meta;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};

use llama_meta::{hf_name, unpermute_rows, LlamaDims};

use crate::model_files::files::CONFIG;
use crate::model_files::write::StagedDir;
use crate::model_files::{gguf, load, read_model_config, resolve_model, ModelFiles};

/// What a finished conversion wrote.
pub struct ConvertReport {
    pub out: PathBuf,
    pub tensors: usize,
    pub parameters: usize,
}

pub fn convert_gguf(gguf_path: &Path, out: &Path, dtype: DType) -> Result<ConvertReport> {
    let mut file = std::fs::File::open(gguf_path).with_context(|| format!("{}: cannot open", gguf_path.display()))?;
    let content =
        gguf_file::Content::read(&mut file).map_err(|e| anyhow::anyhow!("{}: not a valid GGUF file: {e}", gguf_path.display()))?;
    let source = gguf_path.display().to_string();
    llama_meta::check_llama(&content, &source)?;
    let dims = LlamaDims::read(&content).with_context(|| source.clone())?;
    let side = llama_meta::side_files(&content, dtype, &source)?;

    let staged = StagedDir::new(out)?;
    let device = Device::Cpu;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut parameters = 0;
    for name in names {
        let hf = hf_name(name).with_context(|| format!("{}: unexpected GGUF tensor {name}", gguf_path.display()))?;
        let q =
            content.tensor(&mut file, name, &device).map_err(|e| anyhow::anyhow!("{}: reading tensor {name}: {e}", gguf_path.display()))?;
        let mut w = q.dequantize(&device)?;
        if name.ends_with("attn_q.weight") {
            w = unpermute_rows(&w, dims.heads)?;
        } else if name.ends_with("attn_k.weight") {
            w = unpermute_rows(&w, dims.kv_heads)?;
        }
        parameters += w.elem_count();
        tensors.insert(hf, w.to_dtype(dtype)?);
    }
    staged.write_safetensors("model.safetensors", &tensors)?;
    drop(tensors);

    side.write_into(&staged)?;

    // Check what we wrote with the same code that loads models, before it becomes visible.
    let staged_path = staged.path().to_path_buf();
    let cfg = read_model_config(&staged_path.join("config.json"))?;
    let stored = load::read_weight_headers(&[staged_path.join("model.safetensors")])?;
    load::check_tensors(&cfg, &stored, &staged_path.display().to_string())?;
    crate::tokenize::load_tokenizer_json(&staged_path.join("tokenizer.json"))?;
    let n = stored.len();
    let out = staged.commit()?;
    Ok(ConvertReport { out, tensors: n, parameters })
}

/// The model files to fine-tune from a GGUF model (`files` as `model_files::gguf::resolve_gguf`
/// made them): its weights dequantised to f32 safetensors, as transformers dequantises a GGUF
/// it loads to train, written once into a cache directory named after the file (its path,
/// length and modification time), beside the side files; `files.source` still names the GGUF.
pub fn dequantized_for_training(files: ModelFiles) -> Result<ModelFiles> {
    let gguf = files.weights.first().context("a GGUF model without its file")?.clone();
    let meta = std::fs::metadata(&gguf).with_context(|| format!("{}: cannot read", gguf.display()))?;
    let modified = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
    let path = std::fs::canonicalize(&gguf).unwrap_or_else(|_| gguf.clone());
    let key = format!("{}\n{}\n{modified}", path.display(), meta.len());
    let dir = gguf::cache_dir("f32-", key.as_bytes(), CONFIG, |dir| {
        eprintln!("{}: dequantising to f32 safetensors for training (once): {}", files.source, dir.display());
        convert_gguf(&gguf, dir, DType::F32).map(drop).with_context(|| format!("{}: dequantising for training", files.source))
    })?;
    let dequantized = resolve_model(&dir.display().to_string(), None)?;
    Ok(ModelFiles { source: files.source, ..dequantized })
}
