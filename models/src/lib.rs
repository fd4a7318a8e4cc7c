//! Llama-family causal language models in plain candle: architecture only (config, layers,
//! model, LoRA and multi-LoRA, quantised weights, KV cache storage). The arithmetic is the `ops`
//! crate's (tensor ops with their backward) over the `kernels` crate's (CPU kernels); this crate
//! only says which op a layer calls.
//!
//! Knows nothing about sharding or distribution: a model is built from a `VarBuilder`, and each
//! decoder layer can be built on its own from a `VarBuilder` over just that layer's tensors.

pub mod config;
pub mod ends;
pub mod kv_cache;
pub mod layers;
pub mod lora;
pub mod lora_settings;
pub mod masks;
pub mod mode;
pub mod model;
pub mod multi_lora;
pub mod quantized;
pub mod staged;
pub mod tensors;

pub use config::{Architecture, ModelConfig, RopeScaling, SUPPORTED_ARCHITECTURES};
pub use kv_cache::{KvCache, LayerKvCache, SharedBlock, BLOCK as KV_BLOCK};
pub use layers::DecoderLayer;
pub use lora::LoraSettings;
pub use mode::OpMode;
pub use model::CausalLm;
pub use multi_lora::{RowAdapters, ServingAdapter};
pub use quantized::{LinearWeight, QuantizedWeights};
pub use staged::{LlamaStages, Packing, StageContext, StagedModel};
pub use tensors::{expected_tensors, TensorSpec};
