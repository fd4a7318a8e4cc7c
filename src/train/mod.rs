//! Training: row shapes (`formats`), samples and loss masks (`data`), micro-batches (`batch`),
//! the objective (`loss`), the fine-tuning loop (`finetune`), and how much text a row may give
//! the tokenizer (`text_budget`).

pub mod accelerate_config;
pub mod batch;
pub mod config_file;
pub mod data;
pub mod dpo;
pub mod estimate;
pub mod finetune;
pub mod formats;
pub mod grpo;
pub mod loss;
pub mod metrics_row;
pub mod preference;
pub mod report;
pub mod text_budget;

/// The sequence length of a run with no `--seq-len`: 512 tokens, or the model's context when
/// that is shorter (what the server's jobs use too).
pub const DEFAULT_SEQ_LEN: usize = 512;

/// The run's sequence length: `asked`, or [`DEFAULT_SEQ_LEN`] capped at the model's context.
/// Longer than the context (`max_position_embeddings`) is refused, both numbers named: the
/// model never saw those positions, and its rotary tables may not reach them.
pub fn settle_seq_len(asked: Option<usize>, context: usize) -> anyhow::Result<usize> {
    match asked {
        None => Ok(DEFAULT_SEQ_LEN.min(context)),
        Some(n) if n > context => anyhow::bail!(
            "--seq-len {n} is longer than the model's context ({context} tokens, max_position_embeddings in config.json); \
             use --seq-len {context} or less"
        ),
        Some(n) => Ok(n),
    }
}
