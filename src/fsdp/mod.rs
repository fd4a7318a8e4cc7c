//! FSDP2-style sharding: units from wrap policies (`plan`), the step engine (`engine`), and the
//! sharded optimizer and schedules (`optim`). Knows no architecture: models come as
//! [`models::StagedModel`].

#[cfg(feature = "cuda")]
pub mod adamw_cuda;
pub mod engine;
pub mod optim;
pub mod plan;
