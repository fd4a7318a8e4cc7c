//! `fsdp-app perplexity`: a text file's perplexity under a model (llama.cpp's `llama-perplexity`
//! for one window), to compare formats and quantisations on the same text.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use fsdp_app::generate::perplexity::perplexity;
use fsdp_app::model_files::{load_model_with, resolve_model, LoadOptions};
use fsdp_app::tokenize::TextTokenizer;

use super::generate::ModelArgs;

#[derive(Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The text to score (UTF-8), tokenised with the model's tokenizer and its BOS rule.
    #[arg(long)]
    file: PathBuf,
}

pub fn run(a: PerplexityArgs) -> Result<()> {
    let (dtype, quantize, device) = a.model.settings()?;
    let text = std::fs::read_to_string(&a.file).with_context(|| format!("{}: cannot read", a.file.display()))?;
    let files = resolve_model(&a.model.model, a.model.revision.as_deref())?;
    let loaded = load_model_with(files, &LoadOptions { adapter: None, dtype, quantize }, &device)?;
    let tokenizer = TextTokenizer::load(&loaded.files, loaded.config.vocab_size)?;
    let ids = tokenizer.encode(&text, true)?;
    let p = perplexity(&loaded.model, &ids).with_context(|| format!("{}", a.file.display()))?;
    println!("{}", serde_json::to_string(&p)?);
    Ok(())
}
