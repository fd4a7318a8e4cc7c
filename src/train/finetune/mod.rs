//! `fsdp-app finetune`: full or LoRA fine-tuning with the FSDP engine on N ranks.
//!
//! Each rank runs the same phases, in the nanoGPT spirit:
//!
//! 1. [`bootstrap`]: rank 0 resolves the model, a starting adapter and the data, and every rank
//!    learns them as bytes (no other rank opens a model or data file); then [`plan::RunPlan`]
//!    settles the run's shape (world, sequence length, micro-batch, accumulation, steps);
//! 2. [`setup::build_engine`]: the FSDP engine on the rank's device;
//! 3. [`setup::load_or_resume`]: rank 0 streams the weights unit by unit (each rank keeps its
//!    chunks), or every rank loads its chunks of a checkpoint (`checkpoint::resume`);
//! 4. [`train_loop::train`]: step, log, maybe evaluate, maybe save;
//! 5. [`export::export_result`]: the Hugging Face model (or PEFT adapter), through rank 0.
//!
//! [`ranks`] decides how the ranks exist (threads, or one process each under a launcher) and
//! checks the settings once; [`args`] holds every setting as users spell it (flags, YAML files,
//! the jobs API's settings file) and [`config`] the checked settings; [`interrupt`] says how to
//! resume when Ctrl-C stops a run.

pub mod args;
mod auto_batch;
mod bootstrap;
mod config;
mod export;
mod grpo_args;
mod grpo_eval;
mod grpo_step;
pub mod interrupt;
mod metrics_log;
mod objective;
pub mod plan;
mod ranks;
mod rollouts;
mod setup;
mod step;
mod train_loop;

use std::path::PathBuf;

use anyhow::Result;
use candle_core::Device;

pub use args::FinetuneArgs;
pub use config::{validate, Backend, FinetuneConfig};
pub use ranks::{run, run_local};

use crate::dist::ProcessGroups;
use crate::fsdp::engine::StateBytes;

/// What a run reports back (rank 0's view).
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub losses: Vec<f64>,
    pub grad_norms: Vec<f64>,
    /// What each rank's buffers held for parameters, gradients and optimizer state.
    pub rank_bytes: Vec<StateBytes>,
    pub total_params: usize,
    pub output_dir: PathBuf,
}

/// One rank's whole run. `device`: the rank's device when the backend already opened it (NCCL).
fn run_rank_phases(groups: &ProcessGroups, cfg: &FinetuneConfig, device: Option<Device>) -> Result<Option<RunSummary>> {
    let boot = bootstrap::bootstrap(groups, cfg)?;
    let batch = auto_batch::fit(groups, cfg, &boot, boot.seq_len)?;
    let plan = plan::RunPlan::settle(groups, cfg, &boot, batch)?;
    let mut engine = setup::build_engine(groups, cfg, &boot, device)?;
    let (rank_bytes, resumed) = setup::load_or_resume(&mut engine, groups, cfg, &plan, &boot)?;
    let plan = auto_batch::fit_by_trial(&mut engine, groups, cfg, &boot, plan)?;
    let objective = objective::Objective::settle(&mut engine, groups, cfg, &boot, plan.micro_batch, resumed.as_deref())?;
    let curve = train_loop::train(&mut engine, groups, cfg, &plan, &boot, &objective)?;
    export::export_result(&engine, &boot, &cfg.output_dir, cfg)?;
    let is_root = groups.world.rank() == 0;
    if is_root && cfg.verbose {
        say_where_the_result_is(cfg, boot.lora.is_some());
    }
    let summary = RunSummary {
        losses: curve.losses,
        grad_norms: curve.grad_norms,
        rank_bytes,
        total_params: boot.total_params(),
        output_dir: cfg.output_dir.clone(),
    };
    Ok(is_root.then_some(summary))
}

fn say_where_the_result_is(cfg: &FinetuneConfig, lora: bool) {
    let out = cfg.output_dir.display();
    if lora {
        eprintln!("wrote the LoRA adapter to {out} (use it with `fsdp-app generate --model {} --adapter {out}`)", cfg.model);
        if cfg.merge_lora {
            eprintln!("wrote the merged model to {out}/merged (`fsdp-app generate --model {out}/merged`)");
        }
    } else {
        eprintln!("wrote {out} (loadable with `fsdp-app generate --model {out}`)");
    }
}
