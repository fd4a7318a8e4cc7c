//! Training: row shapes (`formats`), samples and loss masks (`data`), micro-batches (`batch`),
//! the objective (`loss`), and the fine-tuning loop (`finetune`).

pub mod accelerate_config;
pub mod batch;
pub mod config_file;
pub mod data;
pub mod estimate;
pub mod finetune;
pub mod formats;
pub mod loss;
pub mod report;
