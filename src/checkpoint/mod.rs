//! Training state: sharded checkpoints (each rank's fp32 chunks and AdamW moments, a manifest
//! written last), resuming them on any world size, and what a checkpoint was trained on. Model
//! files (Hub, safetensors, adapters, exports) are `crate::model_files`'s.

pub mod identity;
pub mod resume;
pub mod sharded;
