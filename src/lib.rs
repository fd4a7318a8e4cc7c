//! fsdp-app: fine-tune and serve Hugging Face causal language models on candle.
//!
//! Modules, one job each: `checkpoint` finds and loads model files (local or Hub) and writes
//! them atomically; `tokenize` wraps tokenizer.json and chat templates; `generate` runs
//! autoregressive generation; `convert` imports GGUF files; `fixtures` makes tiny test models;
//! `memory` reports process memory; `dist` is the process group and its
//! collectives; `fsdp` shards parameters and runs training steps; `train` holds data loading and
//! the fine-tuning loop.

pub mod checkpoint;
pub mod convert;
pub mod dist;
pub mod fixtures;
pub mod fsdp;
pub mod generate;
pub mod memory;
pub mod tokenize;
pub mod train;
