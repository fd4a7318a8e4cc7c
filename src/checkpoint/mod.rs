//! Finding a model (local directory or Hugging Face Hub), checking and loading its safetensors,
//! and writing safetensors files atomically.

pub mod adapter;
pub mod export;
pub mod hub;
pub mod identity;
pub mod load;
pub mod resolve;
pub mod resume;
pub mod sharded;
pub mod write;

pub use load::{load_model, load_model_with_adapter, parse_dtype, read_model_config, LoadedModel};
pub use resolve::{resolve_model, ModelFiles};
