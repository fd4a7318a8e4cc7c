//! Phase 5, export: what a run leaves behind, in Hugging Face layout, streamed unit by unit
//! through rank 0 (the full model, or for LoRA the PEFT adapter and optionally the merged model).

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};

use super::bootstrap::Bootstrap;
use super::config::FinetuneConfig;
use crate::fsdp::engine::FsdpEngine;
use crate::model_files::export::ShardedExport;

/// What a run leaves in `dir`: the full model, or for LoRA the PEFT adapter (plus the merged
/// model in `dir/merged` with `--merge-lora`).
pub(super) fn export_result(engine: &FsdpEngine, boot: &Bootstrap, dir: &Path, cfg: &FinetuneConfig) -> Result<()> {
    let Some(lora) = &boot.lora else {
        return export_full(engine, boot, Some(dir), cfg.max_shard_size, None);
    };
    // One pass over the units: the adapter tensors are kept (they are small) and, with
    // --merge-lora, the merged model is streamed to OUTPUT/merged at the same time.
    let mut adapter = HashMap::new();
    let merged_dir = dir.join("merged");
    export_full(engine, boot, cfg.merge_lora.then_some(merged_dir.as_path()), cfg.max_shard_size, Some(&mut adapter))?;
    if engine.groups().world.rank() == 0 {
        let base = match Path::new(&cfg.model).is_dir() {
            true => std::fs::canonicalize(&cfg.model)?.to_string_lossy().to_string(),
            false => cfg.model.clone(),
        };
        crate::model_files::adapter::write_adapter(dir, &adapter, lora, &base)?;
        // The tokenizer travels with the adapter, as PEFT + Trainer save it.
        let tokenizer_files = boot
            .side_files
            .iter()
            .filter(|(n, _)| n.starts_with("tokenizer") || n == "special_tokens_map.json" || n == "chat_template.jinja");
        for (name, bytes) in tokenizer_files {
            std::fs::write(dir.join(name), bytes).with_context(|| format!("writing {}", dir.join(name).display()))?;
        }
    }
    engine.groups().world.barrier()?;
    Ok(())
}

/// Writes the full Hugging Face model into `dir`: each unit is gathered on every rank of the
/// shard group and rank 0 streams it into the safetensors files, so memory stays at one unit.
/// LoRA adapters are merged into their base weights (`W + scaling * B A`); `keep_adapter` gets
/// a copy of them (rank 0). With `dir` None no model is written (the pass only collects).
fn export_full(
    engine: &FsdpEngine,
    boot: &Bootstrap,
    dir: Option<&Path>,
    max_shard_size: usize,
    mut keep_adapter: Option<&mut HashMap<String, Tensor>>,
) -> Result<()> {
    let is_root = engine.groups().world.rank() == 0;
    let save_dtype = match boot.model_cfg.stored_dtype.as_deref() {
        Some("bfloat16") => DType::BF16,
        Some("float16") => DType::F16,
        _ => DType::F32,
    };
    let mut export = if let (true, Some(dir)) = (is_root, dir) {
        // Checkpoint order (embeddings, layers, norm, head), so the shards read naturally.
        let specs: Vec<(String, Vec<usize>)> = boot
            .staged
            .parameters()
            .iter()
            .filter(|t| !models::lora::is_adapter_tensor(&t.name))
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        Some(ShardedExport::new(dir, save_dtype, max_shard_size, &specs)?)
    } else {
        None
    };
    for u in 0..engine.units().count() {
        let mut full = engine.full_unit(u)?;
        if let (Some(keep), true) = (keep_adapter.as_deref_mut(), is_root) {
            keep.extend(full.iter().filter(|(n, _)| models::lora::is_adapter_tensor(n)).map(|(n, t)| (n.clone(), t.clone())));
        }
        if let (Some(lora), true) = (&boot.lora, export.is_some()) {
            models::lora::merge_into(&mut full, lora)?;
        }
        if let Some(ex) = export.as_mut() {
            for (n, t) in &full {
                ex.add(n, t)?;
            }
        }
    }
    engine.groups().world.barrier()?;
    if let Some(ex) = export {
        ex.finish(&boot.side_files)?;
    }
    Ok(())
}
