//! `fsdp-app perplexity`: a text file's perplexity under a model, as llama.cpp's
//! `llama-perplexity` reports it (one window, or windows of `--ctx-size`), to compare formats and
//! quantisations on the same text.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use fsdp_app::generate::perplexity::{perplexity, perplexity_windows};
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
    /// Score the text in consecutive windows of this many tokens, each on its own with its
    /// second half scored (`llama-perplexity -c N`). Without it, a text that fits the model's
    /// context is one window (every token after the first scored) and a longer one is cut into
    /// windows of the model's context.
    #[arg(long)]
    ctx_size: Option<usize>,
}

pub fn run(a: PerplexityArgs) -> Result<()> {
    let (dtype, quantize, device) = a.model.settings()?;
    let text = std::fs::read_to_string(&a.file).with_context(|| format!("{}: cannot read", a.file.display()))?;
    let files = resolve_model(&a.model.model, a.model.revision.as_deref())?;
    let loaded = load_model_with(files, &LoadOptions { adapter: None, dtype, quantize }, &device)?;
    let tokenizer = TextTokenizer::load(&loaded.files, loaded.config.vocab_size)?;
    let ids = tokenizer.encode(&text, true)?;
    // The BOS each window starts with: the token the tokenizer adds in front, if it adds one.
    let bos = (ids.len() == tokenizer.encode(&text, false)?.len() + 1).then(|| ids[0]);
    let context = loaded.config.max_position_embeddings;
    let p = match a.ctx_size {
        Some(ctx) => perplexity_windows(&loaded.model, &ids, ctx, bos),
        None if ids.len() > context => perplexity_windows(&loaded.model, &ids, context, bos),
        None => perplexity(&loaded.model, &ids),
    }
    .with_context(|| format!("{}", a.file.display()))?;
    println!("{}", serde_json::to_string(&p)?);
    Ok(())
}
