//! Every setting of a fine-tuning run, its defaults, and the checks that need no weights.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Result};
use candle_core::DType;

use crate::checkpoint::identity::AllowedChanges;
use crate::fsdp::optim::Schedule;
use crate::fsdp::plan::{ShardingStrategy, WrapPolicy};
use crate::train::data::TrainOn;
use models::LoraSettings;

#[derive(Debug, Clone)]
pub struct FinetuneConfig {
    pub model: String,
    pub revision: Option<String>,
    /// `--chat-template`: a file or an inline template used instead of the model's (read on
    /// rank 0, which hands it to the others with the tokenizer's files).
    pub chat_template: Option<String>,
    pub data: PathBuf,
    pub output_dir: PathBuf,
    /// Ranks as threads of this process (`local` backend); under a launcher its world decides
    /// (a `--world-size` that disagrees is refused).
    pub world_size: usize,
    pub shard_group_size: Option<usize>,
    pub lr: f64,
    pub weight_decay: f64,
    pub weight_decay_all: bool,
    /// None: no clipping.
    pub max_grad_norm: Option<f64>,
    pub batch_size: usize,
    pub grad_accum: usize,
    /// Lower the micro-batch (raising the accumulation) until it fits: on CPU ranks until the
    /// estimate fits `max_memory_per_rank` (default: the available memory shared by this
    /// machine's ranks), on GPUs until a trial step does not run out of memory.
    pub auto_find_batch_size: bool,
    pub max_memory_per_rank: Option<usize>,
    /// `None`: [`crate::train::DEFAULT_SEQ_LEN`] capped at the model's context. Settled into the
    /// run's plan (`RunPlan::seq_len`) once config.json is read; later phases read the plan.
    pub seq_len: Option<usize>,
    pub max_steps: Option<usize>,
    pub epochs: usize,
    pub warmup_steps: usize,
    /// Warmup as a fraction of the run's steps (TrainingArguments' warmup_ratio), instead of
    /// `warmup_steps`.
    pub warmup_ratio: Option<f64>,
    /// Print a step line every this many steps (metrics.jsonl has every step).
    pub logging_steps: usize,
    pub schedule: Schedule,
    pub seed: u64,
    pub shuffle: bool,
    pub strategy: ShardingStrategy,
    pub wrap: WrapPolicy,
    pub activation_checkpointing: bool,
    pub param_dtype: DType,
    pub reduce_dtype: DType,
    pub collective_timeout: Duration,
    pub backend: Backend,
    /// Where the units compute (`cuda` = each rank's LOCAL_RANK GPU).
    pub device: crate::device::DeviceSpec,
    /// Where master weights, gradients and AdamW moments live: `Some(true)` host memory
    /// (FSDP2's CPUOffloadPolicy), `Some(false)` the device, `None` the device's default (host
    /// on CPU, device on a GPU).
    pub cpu_offload: Option<bool>,
    /// Start each unit's all-gather a stage ahead and leave reduce-scatters running under the
    /// next backward (`FsdpOptions::prefetch`, `--prefetch`); `None`: where the backend's
    /// collectives run beside compute (NCCL), unless `FSDP_PREFETCH=0`. `Some(true)` on the
    /// other backends runs their collectives on a thread of their own (`dist::overlap`).
    pub prefetch: Option<bool>,
    pub max_shard_size: usize,
    /// Save a sharded checkpoint every this many steps.
    pub save_steps: Option<usize>,
    /// Also save a checkpoint at the end of every epoch (`--save-strategy epoch`).
    pub save_each_epoch: bool,
    /// Keep only the newest K checkpoints.
    pub save_total_limit: Option<usize>,
    /// A checkpoint directory, or "latest" (newest complete one under the output directory).
    pub resume_from: Option<String>,
    /// Differences from the checkpoint's data or tokenizer that resuming accepts.
    pub resume_allow_changed: AllowedChanges,
    /// Also write a full Hugging Face export to OUTPUT/export-STEP every this many steps.
    pub save_full_every: Option<usize>,
    /// `transformer_cls_names_to_wrap`, checked against the model's decoder layer class.
    pub layer_class_names: Option<String>,
    pub train_on: TrainOn,
    /// `--method dpo`: preference tuning with these settings; `None`: supervised fine-tuning.
    pub dpo: Option<crate::train::dpo::DpoSettings>,
    /// `--method grpo`: reinforcement learning with these settings and grader.
    pub grpo: Option<crate::train::grpo::GrpoConfig>,
    pub skip_bad_rows: bool,
    /// Several samples per row, unable to see each other.
    pub packing: bool,
    /// Evaluation data (same formats), or a fraction of the training rows held out.
    pub eval_data: Option<PathBuf>,
    pub eval_split: Option<f64>,
    /// Evaluate every this many steps (and always at the end when there is eval data).
    pub eval_steps: Option<usize>,
    /// Print the first sample with its untrained parts marked.
    pub show_sample: bool,
    /// Train a LoRA adapter on the frozen base instead of every weight.
    pub lora: Option<LoraSettings>,
    /// Start from this PEFT adapter directory (its settings replace `lora`).
    pub adapter: Option<PathBuf>,
    /// With LoRA: also write the merged full model to OUTPUT/merged.
    pub merge_lora: bool,
    /// Print per-step lines and a progress bar (rank 0).
    pub verbose: bool,
}

impl FinetuneConfig {
    /// Warmup steps of a run of `total_steps`: `warmup_steps`, or `warmup_ratio` of the run
    /// rounded up (as TrainingArguments does).
    pub fn warmup_for(&self, total_steps: usize) -> usize {
        match self.warmup_ratio {
            Some(r) => (r * total_steps as f64).ceil() as usize,
            None => self.warmup_steps,
        }
    }
}

/// Checks that need no weights, so a wrong flag fails in milliseconds, not after loading. Runs
/// once per process, before any rank starts; `world`: the run's ranks (`--world-size`, or the
/// launcher's).
pub fn validate(cfg: &FinetuneConfig, world: usize) -> Result<()> {
    if world == 0 {
        bail!("--world-size must be positive");
    }
    if cfg.device.is_cuda() && !cfg!(feature = "cuda") {
        // The error that says how to get a CUDA build, before anything is read.
        cfg.device.open(0)?;
    }
    for (name, v) in [("--batch-size", cfg.batch_size), ("--grad-accum", cfg.grad_accum), ("--epochs", cfg.epochs)] {
        if v == 0 {
            bail!("{name} must be positive");
        }
    }
    if cfg.device.is_cuda() && cfg.max_memory_per_rank.is_some() {
        bail!("--max-memory-per-rank is the budget of CPU ranks; on GPUs --auto-find-batch-size finds the micro-batch by trial (drop the flag)");
    }
    if cfg.seq_len.is_some_and(|n| n < 2) {
        bail!("--seq-len must be at least 2 (a token and the next one to predict)");
    }
    if let Some(r) = cfg.warmup_ratio {
        if !(0.0..=1.0).contains(&r) {
            bail!("--warmup-ratio must be between 0 and 1, got {r}");
        }
        if cfg.warmup_steps > 0 {
            bail!("give --warmup-steps ({}) or --warmup-ratio ({r}), not both", cfg.warmup_steps);
        }
    }
    if cfg.logging_steps == 0 {
        bail!("--logging-steps must be positive");
    }
    if cfg.max_steps == Some(0) {
        bail!("--max-steps must be positive");
    }
    if !(cfg.lr.is_finite() && cfg.lr > 0.0) {
        bail!("--lr must be a positive number");
    }
    cfg.strategy.shard_count(world, cfg.shard_group_size)?;
    let is_hub = |p: &Path| p.to_string_lossy().starts_with("hf://");
    if !is_hub(&cfg.data) && !cfg.data.is_file() {
        bail!("--data {}: no such file", cfg.data.display());
    }
    if cfg.resume_from.is_none() && cfg.output_dir.exists() && std::fs::read_dir(&cfg.output_dir)?.next().is_some() {
        bail!(
            "--output-dir {} exists and is not empty (to continue a run there, add --resume-from-checkpoint latest)",
            cfg.output_dir.display()
        );
    }
    if let Some(f) = cfg.eval_split {
        if !(f > 0.0 && f < 1.0) {
            bail!("--eval-split must be between 0 and 1, got {f}");
        }
        if cfg.eval_data.is_some() {
            bail!("give --eval-data or --eval-split, not both");
        }
    }
    if let Some(p) = &cfg.eval_data {
        if !is_hub(p) && !p.is_file() {
            bail!("--eval-data {}: no such file", p.display());
        }
    }
    if let (Some(n), None, None) = (cfg.eval_steps, &cfg.eval_data, cfg.eval_split) {
        bail!("--eval-steps {n} needs evaluation data: add --eval-data FILE or --eval-split FRACTION (or drop --eval-steps)");
    }
    if cfg.merge_lora && cfg.lora.is_none() && cfg.adapter.is_none() {
        bail!("--merge-lora needs a LoRA run (--lora-r, --lora-targets, ... or --adapter)");
    }
    if cfg.dpo.is_some() {
        if cfg.packing {
            bail!("--packing cannot be used with --method dpo: a pair's chosen and rejected sequences are scored whole, one per row");
        }
        if cfg.train_on != TrainOn::Auto {
            bail!("--train-on applies to --method sft; DPO scores each pair's completions");
        }
    }
    if let Some(grpo) = &cfg.grpo {
        if cfg.packing {
            bail!("--packing cannot be used with --method grpo: each completion is scored whole, one per row");
        }
        if cfg.train_on != TrainOn::Auto {
            bail!("--train-on applies to --method sft; GRPO trains on its sampled completions");
        }
        // A checkpoint holds weights, not rollouts: it must fall where a batch of rollouts ends,
        // so that a resumed run samples that batch again from the same weights.
        let mu = grpo.settings.num_iterations;
        if let Some(n) = cfg.save_steps.filter(|n| !n.is_multiple_of(mu)) {
            bail!("--save-steps {n} must be a multiple of --num-iterations {mu}: a checkpoint falls where a batch of rollouts ends");
        }
    }
    if let Some(dir) = &cfg.adapter {
        if !dir.join(crate::model_files::adapter::ADAPTER_CONFIG).is_file() {
            bail!("--adapter {}: no {} there", dir.display(), crate::model_files::adapter::ADAPTER_CONFIG);
        }
    }
    for (name, v) in [
        ("--eval-steps", cfg.eval_steps),
        ("--save-steps", cfg.save_steps),
        ("--save-total-limit", cfg.save_total_limit),
        ("--save-full-every", cfg.save_full_every),
    ] {
        if v == Some(0) {
            bail!("{name} must be positive");
        }
    }
    Ok(())
}

/// Shard-group size of the run's strategy on `world` ranks.
pub(super) fn shard_size(cfg: &FinetuneConfig, world: usize) -> usize {
    // `validate` has checked the combination.
    cfg.strategy.shard_count(world, cfg.shard_group_size).unwrap_or(world)
}

/// Which collective backend runs the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `local` without a launcher; under a launcher `mpi` for mpirun (when built with MPI),
    /// else `tcp`.
    Auto,
    Local,
    Tcp,
    Mpi,
    /// One process per GPU (features cuda,nccl).
    Nccl,
}

impl std::str::FromStr for Backend {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => Self::Auto,
            "local" => Self::Local,
            "tcp" => Self::Tcp,
            "mpi" => Self::Mpi,
            "nccl" if cfg!(feature = "nccl") => Self::Nccl,
            "nccl" => bail!("--backend nccl needs a CUDA build (features cuda,nccl; tests/gpu/build-cuda.sh), which this build is not"),
            other => bail!("--backend {other:?}: use auto, local, tcp, mpi or nccl"),
        })
    }
}
