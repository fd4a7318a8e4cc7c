//! fsdp-app: fine-tune and serve Hugging Face causal language models on candle.
//!
//! Modules, one job each: `model_files` finds and loads model files (local or Hub) and writes
//! them atomically; `checkpoint` is training state (sharded checkpoints, resume); `tokenize` wraps tokenizer.json and chat templates; `generate` runs
//! autoregressive generation; `convert` imports GGUF files; `fixtures` makes tiny test models;
//! `memory` reports process memory; `process` is what the binary sets for the whole process; `dist` is the process group and its
//! collectives; `fsdp` shards parameters and runs training steps; `train` holds data loading and
//! the fine-tuning loop; `embed` pools hidden states into embeddings; `serve` is the
//! OpenAI-compatible HTTP server.

pub mod checkpoint;
pub mod convert;
pub mod device;
pub mod dist;
pub mod embed;
pub mod fixtures;
pub mod fsdp;
pub mod generate;
pub mod memory;
pub mod model_files;
pub mod process;
pub mod serve;
pub mod tokenize;
pub mod train;
