//! Model files: finding a model (local directory or Hugging Face Hub), checking and loading its
//! safetensors, PEFT adapters, and writing safetensors and Hugging Face directories atomically.
//! Training state (sharded checkpoints, resume) is `crate::checkpoint`'s.

pub mod adapter;
pub mod export;
pub mod files;
pub mod gguf;
pub mod hub;
pub mod load;
pub mod quantize;
pub mod resolve;
pub mod write;

pub use load::{load_model, load_model_with, load_model_with_adapter, parse_dtype, read_model_config, LoadOptions, LoadedModel};
pub use resolve::{resolve_model, ModelFiles, WeightFormat};
