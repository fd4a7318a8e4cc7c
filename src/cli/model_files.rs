//! Commands that write model directories: `convert` (GGUF -> Hugging Face), `merge` (sharded
//! checkpoint -> Hugging Face) and `fixture` (a tiny random model).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;

use fsdp_app::memory::{human_bytes, peak_rss_bytes};
use fsdp_app::model_files::parse_dtype;

#[derive(Args)]
pub struct ConvertArgs {
    /// The GGUF file.
    #[arg(long)]
    gguf: PathBuf,
    /// Output directory (must not exist, or be empty).
    #[arg(long)]
    out: PathBuf,
    /// dtype of the written safetensors: bf16 (default) or f32.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f32"])]
    dtype: String,
}

#[derive(Args)]
pub struct MergeArgs {
    /// A sharded checkpoint directory (OUTPUT/checkpoint-STEP).
    checkpoint: PathBuf,
    /// Where the Hugging Face model goes (must not exist, or be empty).
    out: PathBuf,
    /// dtype of the written weights: f32 (as trained) or bf16.
    #[arg(long, default_value = "f32", value_parser = ["bf16", "f32", "f16"])]
    dtype: String,
    #[arg(long, default_value = "5GB")]
    max_shard_size: String,
}

#[derive(Args)]
pub struct FixtureArgs {
    /// Which fixture: llama (GQA, untied, sharded, Llama 3 rope scaling), qwen2 (qkv bias, tied),
    /// qwen3 (q/k norm), mistral (sliding window); qwen3-embedding (a bare Qwen3Model with
    /// sentence-transformers' last-token pooling, laid out as Qwen3-Embedding is).
    #[arg(long, value_parser = [fsdp_app::fixtures::FIXTURE_NAMES, &[fsdp_app::fixtures::EMBEDDING_FIXTURE]].concat())]
    name: String,
    #[arg(long)]
    out: PathBuf,
    /// Replace a config.json field, e.g. `--set hidden_size=1024 --set num_hidden_layers=12`
    /// (value as JSON), to make random models of any size.
    #[arg(long = "set", value_name = "FIELD=VALUE")]
    set: Vec<String>,
}

pub fn run_convert(a: ConvertArgs) -> Result<()> {
    let start = Instant::now();
    let dtype = parse_dtype(&a.dtype)?;
    let report = fsdp_app::convert::convert_gguf(&a.gguf, &a.out, dtype)?;
    eprintln!(
        "converted {} -> {}: {} tensors, {:.1}M parameters, {:.1}s, peak RSS {}",
        a.gguf.display(),
        report.out.display(),
        report.tensors,
        report.parameters as f64 / 1e6,
        start.elapsed().as_secs_f64(),
        peak_rss_bytes().map(human_bytes).unwrap_or_else(|| "n/a".into())
    );
    Ok(())
}

pub fn run_merge(a: MergeArgs) -> Result<()> {
    let start = Instant::now();
    let dtype = parse_dtype(&a.dtype)?;
    let max = fsdp_app::model_files::export::parse_size(&a.max_shard_size).context("--max-shard-size")?;
    let out = fsdp_app::checkpoint::sharded::merge(&a.checkpoint, &a.out, dtype, max)?;
    eprintln!(
        "merged {} -> {} in {:.1}s, peak RSS {}",
        a.checkpoint.display(),
        out.display(),
        start.elapsed().as_secs_f64(),
        peak_rss_bytes().map(human_bytes).unwrap_or_else(|| "n/a".into())
    );
    Ok(())
}

pub fn run_fixture(a: FixtureArgs) -> Result<()> {
    let overrides = a
        .set
        .iter()
        .map(|kv| {
            let (k, v) = kv.split_once('=').with_context(|| format!("--set {kv:?}: expected FIELD=VALUE"))?;
            let v: serde_json::Value = serde_json::from_str(v).with_context(|| format!("--set {kv:?}: the value is not JSON"))?;
            Ok((k.to_string(), v))
        })
        .collect::<Result<Vec<_>>>()?;
    let p = fsdp_app::fixtures::write_fixture_with(&a.name, &a.out, &overrides)?;
    eprintln!("wrote fixture {} to {}", a.name, p.display());
    Ok(())
}
