//! Training: data files (`data`) and the fine-tuning loop (`finetune`).

pub mod data;
pub mod finetune;
