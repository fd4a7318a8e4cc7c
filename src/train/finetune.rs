//! `fsdp-app finetune`: full fine-tuning with the FSDP engine on N ranks.
//!
//! Rank 0 alone resolves the model and opens weight files: it sends config and tokenizer as
//! bytes, then streams the weights unit by unit, each rank receiving only its chunks. Every rank
//! reads the (small) data file and takes its own micro-batches of each global batch.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use crate::checkpoint::export::ShardedExport;
use crate::checkpoint::identity::{self, DataCursor, DataIdentity};
use crate::checkpoint::sharded::{self, CheckpointReader, SaveExtras};
use crate::checkpoint::{load, resolve_model};
use crate::dist::all_reduce_scalar;
use crate::dist::env::DistEnv;
use crate::fsdp::engine::{FsdpEngine, FsdpOptions, ProcessGroups, StatePart};
use crate::fsdp::optim::{lr_multiplier, AdamWConfig, Schedule};
use crate::fsdp::plan::{plan_units, ShardingStrategy, WrapPolicy};
use models::{LoraSettings, StageContext};
use crate::memory::{human_bytes, peak_rss_bytes};
use crate::tokenize::TextTokenizer;
use crate::train::report::LossHistory;
use crate::train::data::{describe_sample, epoch_order, packing_for, DataOptions, Sample, TextTools, TrainOn};

#[derive(Debug, Clone)]
pub struct FinetuneConfig {
    pub model: String,
    pub revision: Option<String>,
    pub data: PathBuf,
    pub output_dir: PathBuf,
    pub world_size: usize,
    pub shard_group_size: Option<usize>,
    pub lr: f64,
    pub weight_decay: f64,
    pub weight_decay_all: bool,
    /// None: no clipping.
    pub max_grad_norm: Option<f64>,
    pub batch_size: usize,
    pub grad_accum: usize,
    pub seq_len: usize,
    pub max_steps: Option<usize>,
    pub epochs: usize,
    pub warmup_steps: usize,
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
    pub max_shard_size: usize,
    /// Save a sharded checkpoint every this many steps.
    pub save_steps: Option<usize>,
    /// Keep only the newest K checkpoints.
    pub save_total_limit: Option<usize>,
    /// A checkpoint directory, or "latest" (newest complete one under the output directory).
    pub resume_from: Option<String>,
    /// Differences from the checkpoint's data or tokenizer that resuming accepts.
    pub resume_allow_changed: crate::checkpoint::identity::AllowedChanges,
    /// Also write a full Hugging Face export to OUTPUT/export-STEP every this many steps.
    pub save_full_every: Option<usize>,
    /// `transformer_cls_names_to_wrap`, checked against the model's decoder layer class.
    pub layer_class_names: Option<String>,
    pub train_on: TrainOn,
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
    /// The CLI's defaults for everything but model, data and output directory.
    pub fn new(model: &str, data: &Path, output_dir: &Path) -> Self {
        Self {
            model: model.to_string(),
            revision: None,
            data: data.to_path_buf(),
            output_dir: output_dir.to_path_buf(),
            world_size: 1,
            shard_group_size: None,
            lr: 2e-5,
            weight_decay: 0.0,
            weight_decay_all: false,
            max_grad_norm: Some(1.0),
            batch_size: 1,
            grad_accum: 1,
            seq_len: 512,
            max_steps: None,
            epochs: 1,
            warmup_steps: 0,
            schedule: Schedule::Linear,
            seed: 42,
            shuffle: true,
            strategy: ShardingStrategy::FullShard,
            wrap: WrapPolicy::TransformerBased,
            activation_checkpointing: false,
            param_dtype: DType::F32,
            reduce_dtype: DType::F32,
            collective_timeout: Duration::from_secs(600),
            backend: Backend::Auto,
            device: crate::device::DeviceSpec::Cpu,
            cpu_offload: None,
            max_shard_size: 5_000_000_000,
            save_steps: None,
            save_total_limit: None,
            resume_from: None,
            resume_allow_changed: Default::default(),
            save_full_every: None,
            layer_class_names: None,
            train_on: TrainOn::Auto,
            skip_bad_rows: false,
            packing: false,
            show_sample: false,
            eval_data: None,
            eval_split: None,
            eval_steps: None,
            lora: None,
            adapter: None,
            merge_lora: false,
            verbose: false,
        }
    }
}

/// What a run reports back (rank 0's view).
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub losses: Vec<f64>,
    pub grad_norms: Vec<f64>,
    /// Parameter, gradient and optimizer bytes of each rank.
    pub rank_bytes: Vec<(usize, usize, usize)>,
    pub total_params: usize,
    pub output_dir: PathBuf,
}

/// Checks that need no weights, so a wrong flag fails in milliseconds, not after loading.
pub fn validate(cfg: &FinetuneConfig) -> Result<()> {
    if cfg.world_size == 0 {
        bail!("--world-size must be positive");
    }
    if cfg.device.is_cuda() && !cfg!(feature = "cuda") {
        // The error that says how to get a CUDA build, before anything is read.
        cfg.device.open(0)?;
    }
    for (name, v) in [("--batch-size", cfg.batch_size), ("--grad-accum", cfg.grad_accum), ("--seq-len", cfg.seq_len), ("--epochs", cfg.epochs)] {
        if v == 0 {
            bail!("{name} must be positive");
        }
    }
    if cfg.seq_len < 2 {
        bail!("--seq-len must be at least 2 (a token and the next one to predict)");
    }
    if cfg.max_steps == Some(0) {
        bail!("--max-steps must be positive");
    }
    if !(cfg.lr.is_finite() && cfg.lr > 0.0) {
        bail!("--lr must be a positive number");
    }
    cfg.strategy.shard_count(cfg.world_size, cfg.shard_group_size)?;
    let is_hub = |p: &Path| p.to_string_lossy().starts_with("hf://");
    if !is_hub(&cfg.data) && !cfg.data.is_file() {
        bail!("--data {}: no such file", cfg.data.display());
    }
    if cfg.resume_from.is_none() && cfg.output_dir.exists() && std::fs::read_dir(&cfg.output_dir)?.next().is_some() {
        bail!("--output-dir {} exists and is not empty (to continue a run there, add --resume-from-checkpoint latest)", cfg.output_dir.display());
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
    if cfg.merge_lora && cfg.lora.is_none() && cfg.adapter.is_none() {
        bail!("--merge-lora needs a LoRA run (--lora-r, --lora-targets, ... or --adapter)");
    }
    if let Some(dir) = &cfg.adapter {
        if !dir.join(crate::checkpoint::adapter::ADAPTER_CONFIG).is_file() {
            bail!("--adapter {}: no {} there", dir.display(), crate::checkpoint::adapter::ADAPTER_CONFIG);
        }
    }
    for (name, v) in [("--eval-steps", cfg.eval_steps), ("--save-steps", cfg.save_steps), ("--save-total-limit", cfg.save_total_limit), ("--save-full-every", cfg.save_full_every)] {
        if v == Some(0) {
            bail!("{name} must be positive");
        }
    }
    Ok(())
}

/// Shard-group size of a strategy on `world` ranks.
fn shard_size(cfg: &FinetuneConfig) -> usize {
    // `validate` has checked the combination.
    cfg.strategy.shard_count(cfg.world_size, cfg.shard_group_size).unwrap_or(cfg.world_size)
}

/// Runs this process's part of a fine-tune: all ranks as threads (`local` backend) when no
/// launcher started us, else this process's rank (`tcp` backend). Rank 0 gets the summary.
pub fn run(cfg: &FinetuneConfig, env: Option<&DistEnv>) -> Result<Option<RunSummary>> {
    let backend = match (cfg.backend, env) {
        (Backend::Auto, None) => Backend::Local,
        (Backend::Auto, Some(_)) if cfg.device.is_cuda() && cfg!(feature = "nccl") => Backend::Nccl,
        (Backend::Auto, Some(e)) if e.launcher == "mpirun" && cfg!(feature = "mpi") => Backend::Mpi,
        (Backend::Auto, Some(_)) => Backend::Tcp,
        (b, _) => b,
    };
    match (backend, env) {
        (Backend::Local, None) => run_local(cfg).map(Some),
        (Backend::Local, Some(e)) => bail!("--backend local runs ranks as threads, but {} started this process as one rank", e.launcher),
        (Backend::Tcp, None) => bail!("--backend tcp needs a launcher (fsdp-app launch, torchrun, srun or mpirun)"),
        (Backend::Tcp, Some(env)) => {
            let mut cfg = cfg.clone();
            cfg.world_size = env.world_size;
            validate(&cfg)?;
            let (groups, proxies) = crate::dist::tcp::connect(env, shard_size(&cfg), cfg.collective_timeout)?;
            let result = run_rank(groups, &cfg, None);
            if result.is_err() {
                // Let the proxies tell the other ranks why before this process exits.
                proxies.wait_for_ranks(Duration::from_secs(5));
            }
            result
        }
        (Backend::Nccl, None) => bail!("--backend nccl needs a launcher (fsdp-app launch, torchrun, srun or mpirun): one process per GPU"),
        (Backend::Nccl, Some(env)) => run_nccl(cfg, env),
        (Backend::Mpi, _) => run_mpi(cfg),
        (Backend::Auto, _) => unreachable!(),
    }
}

#[cfg(feature = "mpi")]
fn run_mpi(cfg: &FinetuneConfig) -> Result<Option<RunSummary>> {
    let session = crate::dist::mpi::MpiSession::init()?;
    let mut cfg = cfg.clone();
    cfg.world_size = session.world_size();
    let result = (|| {
        validate(&cfg)?;
        let groups = session.groups(shard_size(&cfg))?;
        run_rank(groups, &cfg, None)
    })();
    // Every group is dropped by now; dropping the session finalises MPI.
    drop(session);
    result
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_cfg: &FinetuneConfig) -> Result<Option<RunSummary>> {
    bail!("this fsdp-app was built without MPI; rebuild with `cargo build --release --features mpi` (needs libopenmpi-dev)")
}

/// One process per GPU: NCCL for the step's collectives, the tcp backend as control plane.
#[cfg(feature = "nccl")]
fn run_nccl(cfg: &FinetuneConfig, env: &DistEnv) -> Result<Option<RunSummary>> {
    let mut cfg = cfg.clone();
    cfg.world_size = env.world_size;
    validate(&cfg)?;
    if !cfg.device.is_cuda() {
        bail!("--backend nccl runs on GPUs: add --device cuda");
    }
    // One Device per process: the communicators and the engine share its stream.
    let device = cfg.device.open(env.local_rank)?;
    let (groups, proxies) = crate::dist::nccl::connect(env, shard_size(&cfg), cfg.collective_timeout, &device)?;
    let result = run_rank(groups, &cfg, Some(device));
    if result.is_err() {
        proxies.wait_for_ranks(Duration::from_secs(5));
    }
    result
}

#[cfg(not(feature = "nccl"))]
fn run_nccl(_cfg: &FinetuneConfig, _env: &DistEnv) -> Result<Option<RunSummary>> {
    bail!("--backend nccl: this fsdp-app was built without NCCL; build one with tests/gpu/build-cuda.sh (features cuda,nccl)")
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

/// Runs the fine-tune with the `local` backend: one thread per rank.
pub fn run_local(cfg: &FinetuneConfig) -> Result<RunSummary> {
    validate(cfg)?;
    let world = cfg.world_size;
    let all_groups = crate::dist::local::create_process_groups(world, shard_size(cfg), cfg.collective_timeout);
    let handles: Vec<_> = all_groups
        .into_iter()
        .enumerate()
        .map(|(r, groups)| {
            let cfg = cfg.clone();
            std::thread::Builder::new()
                .name(format!("rank-{r}"))
                .spawn(move || run_rank(groups, &cfg, None))
                .expect("spawning a rank thread")
        })
        .collect();
    let mut summary = None;
    let mut errors = vec![];
    for (r, h) in handles.into_iter().enumerate() {
        match h.join() {
            Ok(Ok(s)) => summary = summary.or(s),
            Ok(Err(e)) => errors.push((r, e)),
            Err(_) => errors.push((r, anyhow::anyhow!("rank {r} panicked"))),
        }
    }
    if !errors.is_empty() {
        // The first rank whose error is not just "another rank failed" is the cause.
        let (r, e) = errors
            .iter()
            .find(|(_, e)| !format!("{e:#}").contains("stopped: rank"))
            .unwrap_or(&errors[0]);
        bail!("rank {r}: {e:#}");
    }
    summary.context("rank 0 returned no summary")
}

/// Everything rank 0 sends the others before weights.
struct ModelBytes {
    config: String,
    tokenizer: Option<String>,
    side_files: Vec<(String, Vec<u8>)>,
}

fn share_model_files(groups: &ProcessGroups, files: Option<&crate::checkpoint::ModelFiles>) -> Result<ModelBytes> {
    let payload = match files {
        Some(f) => {
            let read = |p: &Path| std::fs::read(p).with_context(|| format!("{}: cannot read", p.display()));
            let mut side = vec![];
            for p in [&Some(f.config.clone()), &f.tokenizer, &f.tokenizer_config, &f.generation_config, &f.chat_template, &f.special_tokens_map]
                .into_iter()
                .flatten()
            {
                let name = p.file_name().unwrap().to_string_lossy().to_string();
                side.push(json!({"name": name, "data": String::from_utf8_lossy(&read(p)?).to_string()}));
            }
            Some(serde_json::to_vec(&json!({"files": side}))?)
        }
        None => None,
    };
    let bytes = groups.world.broadcast_bytes(0, payload)?;
    let v: Value = serde_json::from_slice(&bytes)?;
    let mut out = ModelBytes { config: String::new(), tokenizer: None, side_files: vec![] };
    for f in v["files"].as_array().context("model files message")? {
        let name = f["name"].as_str().unwrap_or_default().to_string();
        let data = f["data"].as_str().unwrap_or_default().to_string();
        match name.as_str() {
            "config.json" => out.config = data.clone(),
            "tokenizer.json" => out.tokenizer = Some(data.clone()),
            _ => {}
        }
        out.side_files.push((name, data.into_bytes()));
    }
    Ok(out)
}

/// `device`: the rank's device when the backend already opened it (NCCL), else opened here.
fn run_rank(groups: ProcessGroups, cfg: &FinetuneConfig, device: Option<Device>) -> Result<Option<RunSummary>> {
    let result = run_rank_inner(&groups, cfg, device);
    if let Err(e) = &result {
        groups.abort(&format!("{e:#}"));
    }
    result
}

fn run_rank_inner(groups_ref: &ProcessGroups, cfg: &FinetuneConfig, device: Option<Device>) -> Result<Option<RunSummary>> {
    let rank = groups_ref.world.rank();
    let world = groups_ref.world.world_size();
    let is_root = rank == 0;

    // 1. Rank 0 resolves the model; config and tokenizer travel as bytes.
    let files = if is_root { Some(resolve_model(&cfg.model, cfg.revision.as_deref())?) } else { None };
    let bytes = share_model_files(groups_ref, files.as_ref())?;
    let mut model_cfg = models::ModelConfig::from_json_str(&bytes.config).context("config.json")?;
    if let Some(names) = &cfg.layer_class_names {
        crate::train::config_file::check_layer_class(names, model_cfg.architecture)?;
    }
    // LoRA: rank 0 reads a starting adapter (if any); its settings travel to every rank.
    let start_adapter = match (&cfg.adapter, is_root) {
        (Some(dir), true) => Some(crate::checkpoint::adapter::read_adapter(dir, &model_cfg)),
        _ => None,
    };
    let lora_msg = match &start_adapter {
        Some(Ok(a)) => Some(json!({"ok": true, "config": crate::checkpoint::adapter::adapter_config_json(&a.settings, "")}).to_string().into_bytes()),
        Some(Err(e)) => Some(json!({"ok": false, "error": format!("{e:#}")}).to_string().into_bytes()),
        None if is_root => Some(b"{}".to_vec()),
        None => None,
    };
    let lora_shared: Value = serde_json::from_slice(&groups_ref.world.broadcast_bytes(0, lora_msg)?)?;
    let start_adapter = match start_adapter {
        Some(Err(e)) => return Err(e),
        Some(Ok(a)) => Some(a),
        None => None,
    };
    if lora_shared.get("ok") == Some(&json!(false)) {
        bail!("rank 0 could not read --adapter: {}", lora_shared["error"].as_str().unwrap_or("?"));
    }
    model_cfg.lora = match lora_shared.get("config") {
        Some(c) => Some(crate::checkpoint::adapter::parse_adapter_config(&c.to_string(), Path::new("adapter_config.json"))?.0),
        None => cfg.lora.clone(),
    };
    if let Some(lora) = &model_cfg.lora {
        lora.validate(&model_cfg)?;
    }
    let staged: Arc<dyn models::StagedModel> = Arc::new(models::LlamaStages::new(&model_cfg));
    let plan = plan_units(staged.as_ref(), cfg.wrap, shard_size(cfg))?;
    let total_params: usize = plan.iter().map(|u| u.numel()).sum();
    let trainable_params: usize = plan.iter().flat_map(|u| u.params.iter()).filter(|p| p.trainable).map(|p| p.numel()).sum();

    // 2. Data (before weights: a bad file or batch fails fast).
    let side = |name: &str| bytes.side_files.iter().find(|(n, _)| n == name).map(|(_, b)| b.as_slice());
    let tokenizer = match side("tokenizer.json") {
        Some(t) => Some(TextTokenizer::from_bytes(t, side("tokenizer_config.json"), side("chat_template.jinja"))?),
        None => None,
    };
    let encode = |text: &str, special: bool| -> Result<(Vec<u32>, Vec<(usize, usize)>)> {
        tokenizer.as_ref().context("text and chat rows need the model's tokenizer.json")?.encode_with_offsets(text, special)
    };
    let decode = |ids: &[u32]| -> Result<String> {
        tokenizer.as_ref().context("no tokenizer.json")?.decode(ids, false)
    };
    let eos = model_cfg.eos_token_ids.first().copied();
    let tools = TextTools {
        encode: &encode,
        decode: &decode,
        template: tokenizer.as_ref().and_then(|t| t.chat_template.as_ref()),
        eos_id: eos,
        pad_id: eos.unwrap_or(0),
    };
    let data_opts = DataOptions { seq_len: cfg.seq_len, train_on: cfg.train_on, skip_bad_rows: cfg.skip_bad_rows, packing: cfg.packing };
    let (dataset, data_identity) = shared_dataset(groups_ref, &cfg.data, &data_opts, &tools)?;
    if is_root && cfg.verbose {
        eprintln!(
            "data: {} rows -> {} samples of {} tokens ({} skipped, {} truncated); {} trained-on tokens; {} efficiency {:.1}%",
            dataset.rows,
            dataset.samples.len(),
            cfg.seq_len,
            dataset.skipped,
            dataset.truncated,
            dataset.supervised_tokens,
            if cfg.packing { "packing" } else { "padding" },
            100.0 * dataset.padding_efficiency(cfg.seq_len)
        );
    }
    if is_root && cfg.show_sample {
        eprintln!("sample 0 ([masked]...[/masked] is not trained on):\n{}", describe_sample(&dataset.samples[0], &decode)?);
    }
    let mut samples = dataset.samples;
    let eval_samples: Vec<Sample> = match (&cfg.eval_data, cfg.eval_split) {
        (Some(p), _) => shared_dataset(groups_ref, p, &data_opts, &tools)?.0.samples,
        (None, Some(f)) => {
            // The last rows of the file, so the split is the same on every rank and every run.
            let n = ((samples.len() as f64 * f).round() as usize).max(1);
            if n >= samples.len() {
                bail!("--eval-split {f} leaves no training samples ({} in all)", samples.len());
            }
            samples.split_off(samples.len() - n)
        }
        (None, None) => vec![],
    };
    if is_root && cfg.verbose && !eval_samples.is_empty() {
        eprintln!("eval: {} samples", eval_samples.len());
    }
    let global_batch = cfg.batch_size * world * cfg.grad_accum;
    let steps_per_epoch = samples.len() / global_batch;
    if steps_per_epoch == 0 {
        bail!(
            "{}: {} samples of {} tokens, fewer than one global batch of {global_batch} (batch size {} x {world} ranks x {} accumulation)",
            cfg.data.display(),
            samples.len(),
            cfg.seq_len,
            cfg.batch_size,
            cfg.grad_accum
        );
    }
    let total_steps = cfg.max_steps.unwrap_or(steps_per_epoch * cfg.epochs);

    // 3. The engine, filled by rank 0 one unit at a time.
    let opts = FsdpOptions {
        strategy: cfg.strategy,
        activation_checkpointing: cfg.activation_checkpointing,
        param_dtype: cfg.param_dtype,
        reduce_dtype: cfg.reduce_dtype,
    };
    let adam = AdamWConfig { lr: cfg.lr, weight_decay: cfg.weight_decay, ..Default::default() };
    // A rank's GPU: its LOCAL_RANK under a launcher, its rank for `local` threads.
    let device = match device {
        Some(d) => d,
        None => cfg.device.open(crate::dist::env::DistEnv::from_env()?.map(|e| e.local_rank).unwrap_or(rank))?,
    };
    let mut engine = FsdpEngine::new(staged.clone(), plan, groups_ref.clone(), opts, adam, cfg.weight_decay_all)?.with_device(device);
    if let Some(offload) = cfg.cpu_offload {
        engine = engine.with_cpu_offload(offload);
    }
    let n_units = engine.units().count();
    let load_start = Instant::now();
    // Resuming: rank 0 finds and verifies the checkpoint and checks it belongs to this model and
    // batch; the others learn the step (or the error) from it.
    let resume = match &cfg.resume_from {
        Some(from) => {
            let found = if is_root {
                Some((|| -> Result<(CheckpointReader, Value)> {
                    let (dir, manifest) = if from == "latest" {
                        sharded::find_latest(&cfg.output_dir)?
                    } else {
                        let dir = PathBuf::from(from);
                        let m = sharded::verify(&dir)?;
                        (dir, m)
                    };
                    let reader = CheckpointReader::open(&dir, manifest)?;
                    let ckpt_config = String::from_utf8(reader.side_file("config.json").unwrap_or_default()).unwrap_or_default();
                    if sharded::sha256_hex(bytes.config.as_bytes()) != reader.manifest.config_sha256 {
                        bail!(
                            "{} was saved from another model or config: {}",
                            dir.display(),
                            sharded::config_differences(&ckpt_config, &bytes.config).join("; ")
                        );
                    }
                    let mut ours: Vec<(String, Vec<usize>)> =
                        engine.units().flat_map(|u| u.params.iter().map(|p| (p.spec.name.clone(), p.spec.shape.clone()))).collect();
                    ours.sort();
                    let theirs: Vec<(String, Vec<usize>)> = reader.manifest.params.iter().map(|p| (p.name.clone(), p.shape.clone())).collect();
                    if ours != theirs {
                        bail!("{}: its parameters differ from this model's", dir.display());
                    }
                    let state: Value = serde_json::from_slice(&reader.side_file(sharded::TRAINER_STATE).context("trainer_state.json")?)?;
                    let saved_batch = state["global_batch"].as_u64().unwrap_or(0) as usize;
                    if saved_batch != global_batch {
                        bail!(
                            "{} was saved with a global batch of {saved_batch} sequences; this run has {global_batch} \
                             (batch size {} x {world} ranks x {} accumulation): keep the global batch to resume",
                            dir.display(),
                            cfg.batch_size,
                            cfg.grad_accum
                        );
                    }
                    let cursor = DataCursor::at(reader.manifest.step as usize, samples.len(), steps_per_epoch);
                    let warnings = identity::check_resume(
                        &dir.display().to_string(),
                        &state,
                        reader.manifest.tokenizer_sha256.as_deref(),
                        side("tokenizer.json"),
                        &data_identity,
                        &cursor,
                        cfg.resume_allow_changed,
                    )?;
                    for w in warnings {
                        eprintln!("warning: {w}");
                    }
                    Ok((reader, state))
                })())
            } else {
                None
            };
            let msg = match &found {
                Some(Ok((reader, state))) => json!({"ok": true, "step": reader.manifest.step, "dir": reader.dir, "state": state}),
                Some(Err(e)) => json!({"ok": false, "error": format!("{e:#}")}),
                None => Value::Null,
            };
            let shared: Value = serde_json::from_slice(&groups_ref.world.broadcast_bytes(0, is_root.then(|| msg.to_string().into_bytes()))?)?;
            if shared["ok"] != json!(true) {
                match found {
                    Some(Err(e)) => return Err(e),
                    _ => bail!("rank 0 could not resume: {}", shared["error"].as_str().unwrap_or("?")),
                }
            }
            Some((found.map(|f| f.unwrap().0), shared["step"].as_u64().unwrap_or(0)))
        }
        None => None,
    };
    match &resume {
        Some((reader, step)) => {
            for u in 0..n_units {
                for part in StatePart::ALL {
                    let full = match reader {
                        Some(r) => {
                            let mut m = std::collections::HashMap::new();
                            // Frozen parameters have no optimizer moments.
                            for p in engine.units().nth(u).unwrap().params.iter().filter(|p| part == StatePart::Master || p.trainable) {
                                m.insert(p.spec.name.clone(), r.read(&p.spec.name, part)?);
                            }
                            Some(m)
                        }
                        None => None,
                    };
                    engine.load_unit_part(u, part, full)?;
                }
            }
            engine.step = *step;
            if is_root && cfg.verbose {
                eprintln!("resumed from {} at step {step}", reader.as_ref().unwrap().dir.display());
            }
        }
        None => {
            let weights = match &files {
                Some(f) => {
                    let stored = load::read_weight_headers(&f.weights)?;
                    load::check_tensors(&model_cfg, &stored, &f.source)?;
                    Some(stored)
                }
                None => None,
            };
            for u in 0..n_units {
                let full = match &weights {
                    Some(st) => {
                        let mut m = std::collections::HashMap::new();
                        for p in &engine.units().nth(u).unwrap().params {
                            // One unit's tensors at a time: rank 0's extra memory is about one unit.
                            let values = if models::lora::is_adapter_tensor(&p.spec.name) {
                                match &start_adapter {
                                    Some(a) => a.tensors[&p.spec.name].flatten_all()?.to_vec1::<f32>()?,
                                    None => models::lora::init_adapter(&p.spec, cfg.seed),
                                }
                            } else {
                                st[&p.spec.name].read_f32()?
                            };
                            m.insert(p.spec.name.clone(), values);
                        }
                        Some(m)
                    }
                    None => None,
                };
                engine.load_unit(u, full)?;
            }
        }
    }
    let start_step = engine.step as usize;
    if start_step > total_steps {
        bail!("the checkpoint is at step {start_step}, past this run's {total_steps} steps");
    }
    let (pb, gb, ob) = engine.memory_bytes();
    let mut bytes_all = [pb as f64, gb as f64, ob as f64].repeat(world);
    bytes_all.iter_mut().enumerate().for_each(|(i, x)| if i / 3 != rank { *x = 0.0 });
    groups_ref.world.all_reduce_f64(&mut bytes_all)?;
    let rank_bytes: Vec<(usize, usize, usize)> =
        bytes_all.chunks(3).map(|c| (c[0] as usize, c[1] as usize, c[2] as usize)).collect();
    if is_root && cfg.verbose {
        eprintln!(
            "fsdp: {world} rank(s), {:?}, {} units, {:.1}M parameters; fp32 master weights and fp32 AdamW moments; \
             loaded on rank 0 and streamed in {:.2}s",
            cfg.strategy,
            n_units,
            total_params as f64 / 1e6,
            load_start.elapsed().as_secs_f64()
        );
        if let Some(lora) = &model_cfg.lora {
            eprintln!(
                "lora: r={} alpha={} dropout={} targets {:?}: {} trainable parameters ({:.3}% of {}); the base is frozen \
                 (no gradients, no optimizer state)",
                lora.r,
                lora.alpha,
                lora.dropout,
                lora.targets,
                trainable_params,
                100.0 * trainable_params as f64 / total_params as f64,
                total_params
            );
        }
        for (r, (p, g, o)) in rank_bytes.iter().enumerate() {
            let unsharded = total_params * 4 + trainable_params * 12;
            eprintln!(
                "fsdp: rank {r} holds params {} + grads {} + optimizer {} = {} ({:.3} of the unsharded {})",
                human_bytes(*p as u64),
                human_bytes(*g as u64),
                human_bytes(*o as u64),
                human_bytes((p + g + o) as u64),
                (p + g + o) as f64 / unsharded as f64,
                human_bytes(unsharded as u64)
            );
        }
    }

    // 4. Training.
    std::fs::create_dir_all(&cfg.output_dir).ok();
    let mut metrics = if is_root {
        // Appended to when resuming: the file keeps the whole run's history.
        Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .truncate(false)
                .open(cfg.output_dir.join("metrics.jsonl"))
                .context("opening metrics.jsonl")?,
        )
    } else {
        None
    };
    let progress = (is_root && cfg.verbose).then(|| {
        let pb = indicatif::ProgressBar::new(total_steps as u64);
        pb.set_position(start_step as u64);
        pb.set_style(indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps {msg}").unwrap());
        pb
    });
    // A LoRA checkpoint carries its adapter settings, so `fsdp-app merge` can fold it in.
    let mut checkpoint_side_files = bytes.side_files.clone();
    if let Some(lora) = &model_cfg.lora {
        let config = crate::checkpoint::adapter::adapter_config_json(lora, &cfg.model);
        checkpoint_side_files.push((crate::checkpoint::adapter::ADAPTER_CONFIG.to_string(), serde_json::to_vec_pretty(&config)?));
    }
    let mut losses = vec![];
    let mut grad_norms = vec![];
    let mut history = LossHistory::default();
    let run_eval = |engine: &mut FsdpEngine, step: usize, history: &mut LossHistory, metrics: &mut Option<std::fs::File>| -> Result<()> {
        if eval_samples.is_empty() {
            return Ok(());
        }
        let (loss, ppl) = evaluate(engine, &eval_samples, cfg.batch_size, cfg.seq_len, rank, world)?;
        history.eval.push((step, loss));
        if let Some(f) = metrics.as_mut() {
            writeln!(f, "{}", json!({"step": step, "eval_loss": loss, "eval_perplexity": ppl}))?;
            f.flush()?;
            history.write_svg(&cfg.output_dir.join("loss.svg"))?;
            if cfg.verbose {
                eprintln!("eval  {step:>5} | loss {loss:.4} | perplexity {ppl:.3}");
            }
        }
        Ok(())
    };
    // The data order is a pure function of (seed, epoch), so the cursor is the step.
    let mut order_epoch = start_step / steps_per_epoch;
    let mut order = epoch_order(samples.len(), order_epoch, cfg.seed, cfg.shuffle);
    for step in start_step..total_steps {
        let epoch = step / steps_per_epoch;
        let in_epoch = step % steps_per_epoch;
        if epoch != order_epoch {
            order_epoch = epoch;
            order = epoch_order(samples.len(), epoch, cfg.seed, cfg.shuffle);
        }
        let start = Instant::now();
        let lr = cfg.lr * lr_multiplier(cfg.schedule, step, cfg.warmup_steps, total_steps);
        let base = in_epoch * global_batch;
        let micro: Vec<Vec<&Sample>> = (0..cfg.grad_accum)
            .map(|a| {
                let first = base + (a * world + rank) * cfg.batch_size;
                (first..first + cfg.batch_size).map(|i| &samples[order[i]]).collect()
            })
            .collect();
        let local_targets: usize = micro.iter().flatten().map(|s| s.target_tokens()).sum();
        let global_targets = all_reduce_scalar(groups_ref.world.as_ref(), local_targets as f64)?;
        if global_targets == 0.0 {
            bail!("step {step}: the global batch has no target tokens (every label is -100)");
        }
        let mut local_loss = 0.0;
        for (a, mb) in micro.iter().enumerate() {
            let ids: Vec<u32> = mb.iter().flat_map(|s| s.input_ids.iter().copied()).collect();
            let labels: Vec<i64> = mb.iter().flat_map(|s| s.labels.iter().copied()).collect();
            let input = Tensor::from_vec(ids, (mb.len(), cfg.seq_len), engine.device())?;
            // Dropout seeds from (seed, step, place in the global batch): the same masks on any
            // number of ranks, and in an activation-checkpointing recompute.
            let first = (a * world + rank) * cfg.batch_size;
            let row_seeds = (first..first + mb.len()).map(|i| dropout_seed(cfg.seed, step, i)).collect();
            let ctx = StageContext { packing: packing_for(mb), row_seeds: Some(row_seeds) };
            local_loss += engine.forward_backward(&input, &labels, global_targets, &ctx)?;
        }
        let loss = all_reduce_scalar(groups_ref.world.as_ref(), local_loss)? / global_targets;
        let stats = engine.optimizer_step(lr, cfg.max_grad_norm)?;
        let secs = start.elapsed().as_secs_f64();
        let tokens = (global_batch * cfg.seq_len) as f64;
        // Peak RSS of every rank's process (the same process for local ranks).
        // ...and, on GPUs, the device memory in use at the end of the step (second half).
        let mut rss_all = vec![0f64; 2 * world];
        rss_all[rank] = peak_rss_bytes().unwrap_or(0) as f64;
        let gpu_mem = crate::memory::gpu_memory_used(engine.device());
        rss_all[world + rank] = gpu_mem.unwrap_or(0) as f64;
        groups_ref.world.all_reduce_f64(&mut rss_all)?;
        let gpu_per_rank: Option<Vec<u64>> = gpu_mem.map(|_| rss_all[world..].iter().map(|&x| x as u64).collect());
        rss_all.truncate(world);
        losses.push(loss);
        grad_norms.push(stats.grad_norm);
        history.train.push((step + 1, loss));
        if let Some(f) = metrics.as_mut() {
            let rss_per_rank: Vec<u64> = rss_all.iter().map(|&x| x as u64).collect();
            let rss = rss_per_rank.iter().copied().max();
            let mut row = json!({
                "step": step + 1, "epoch": epoch, "loss": loss, "lr": lr, "grad_norm": stats.grad_norm,
                "tokens_per_s": tokens / secs, "peak_rss_bytes": rss, "peak_rss_bytes_per_rank": rss_per_rank,
                "step_s": secs,
            });
            if let Some(g) = &gpu_per_rank {
                row["gpu_memory_bytes_per_rank"] = json!(g);
            }
            writeln!(f, "{row}")?;
            f.flush()?;
            history.write_svg(&cfg.output_dir.join("loss.svg"))?;
            if let Some(pb) = &progress {
                let per_rank: Vec<String> = rss_per_rank.iter().map(|&b| human_bytes(b)).collect();
                let mut line = format!(
                    "step {:>5} | loss {loss:.4} | lr {lr:.3e} | grad norm {:.4} | {:.0} tokens/s | peak RSS per rank [{}]",
                    step + 1,
                    stats.grad_norm,
                    tokens / secs,
                    per_rank.join(", ")
                );
                if let Some(g) = &gpu_per_rank {
                    line += &format!(" | GPU memory per rank [{}]", g.iter().map(|&b| human_bytes(b)).collect::<Vec<_>>().join(", "));
                }
                // A hidden bar (stderr not a terminal) drops println: print plainly then.
                if pb.is_hidden() {
                    eprintln!("{line}");
                } else {
                    pb.println(line);
                }
                pb.set_message(format!("loss {loss:.4}"));
                pb.inc(1);
            }
        }
        let done = step + 1;
        if cfg.eval_steps.is_some_and(|n| done % n == 0) && done != total_steps {
            run_eval(&mut engine, done, &mut history, &mut metrics)?;
        }
        if cfg.save_steps.is_some_and(|n| done % n == 0) {
            let t = Instant::now();
            let trainer_state = json!({
                "step": done, "epoch": done / steps_per_epoch, "samples_seen": done * global_batch,
                "global_batch": global_batch, "seed": cfg.seed, "shuffle": cfg.shuffle,
                "lr_schedule": {"type": format!("{:?}", cfg.schedule).to_lowercase(), "base_lr": cfg.lr,
                                "warmup_steps": cfg.warmup_steps, "total_steps": total_steps},
                // The only randomness in training is the data order, a function of (seed, epoch).
                "rng": {"shuffle_seed": cfg.seed},
                "data": identity::data_state(&data_identity, &DataCursor::at(done, samples.len(), steps_per_epoch)),
            });
            let extras = SaveExtras {
                trainer_state,
                side_files: &checkpoint_side_files,
                strategy: format!("{:?}", cfg.strategy),
                total_limit: cfg.save_total_limit,
            };
            let dir = sharded::save(&mut engine, groups_ref, &cfg.output_dir, &extras)?;
            if is_root && cfg.verbose {
                eprintln!("saved {} in {:.2}s", dir.display(), t.elapsed().as_secs_f64());
            }
        }
        if cfg.save_full_every.is_some_and(|n| done % n == 0) && done != total_steps {
            export_result(&engine, staged.as_ref(), &model_cfg, &bytes.side_files, &cfg.output_dir.join(format!("export-{done}")), cfg, is_root)?;
        }
    }
    if let Some(pb) = progress {
        pb.finish_and_clear();
    }
    run_eval(&mut engine, total_steps, &mut history, &mut metrics)?;

    // 5. Export: unit by unit, gathered on every shard-group rank, written by rank 0.
    export_result(&engine, staged.as_ref(), &model_cfg, &bytes.side_files, &cfg.output_dir, cfg, is_root)?;
    if is_root && cfg.verbose {
        let out = cfg.output_dir.display();
        if model_cfg.lora.is_some() {
            eprintln!("wrote the LoRA adapter to {out} (use it with `fsdp-app generate --model {} --adapter {out}`)", cfg.model);
            if cfg.merge_lora {
                eprintln!("wrote the merged model to {out}/merged (`fsdp-app generate --model {out}/merged`)");
            }
        } else {
            eprintln!("wrote {out} (loadable with `fsdp-app generate --model {out}`)");
        }
    }
    Ok(is_root.then(|| RunSummary { losses, grad_norms, rank_bytes, total_params, output_dir: cfg.output_dir.clone() }))
}

/// The dropout seed of the sample at `place` in step `step`'s global batch.
fn dropout_seed(seed: u64, step: usize, place: usize) -> u64 {
    let mut state = seed ^ ((step as u64) << 32) ^ place as u64;
    models::rng::splitmix64(&mut state)
}

/// Rank 0 resolves the data (a local file or a Hub dataset file, downloaded once) and sends its
/// bytes; every rank builds the same samples from them.
/// The dataset, and the identity of the file it came from (for checkpoints to record).
fn shared_dataset(groups: &ProcessGroups, spec: &Path, opts: &DataOptions, tools: &TextTools) -> Result<(crate::train::data::Dataset, DataIdentity)> {
    let is_root = groups.world.rank() == 0;
    let payload = if is_root {
        let bytes = (|| -> Result<Vec<u8>> {
            let path = crate::train::data::resolve_data(&spec.to_string_lossy())?;
            std::fs::read(&path).with_context(|| format!("{}: cannot read", path.display()))
        })();
        match bytes {
            Ok(b) => Some([vec![1u8], b].concat()),
            Err(e) => Some([vec![0u8], format!("{e:#}").into_bytes()].concat()),
        }
    } else {
        None
    };
    let got = groups.world.broadcast_bytes(0, payload)?;
    let (ok, body) = got.split_first().context("empty data message")?;
    if *ok == 0 {
        bail!("{}", String::from_utf8_lossy(body));
    }
    let identity = DataIdentity::of(&spec.to_string_lossy(), body);
    Ok((crate::train::data::load_dataset_bytes(spec, body, opts, tools)?, identity))
}

/// Mean token loss and perplexity over `samples`, each rank taking every world-th batch. Ranks
/// with no batch left run a fully masked one, so every rank makes the same collectives.
fn evaluate(engine: &mut FsdpEngine, samples: &[Sample], batch: usize, seq_len: usize, rank: usize, world: usize) -> Result<(f64, f64)> {
    let rounds = samples.len().div_ceil(batch * world);
    let (mut loss, mut tokens) = (0.0, 0.0);
    for r in 0..rounds {
        let first = (r * world + rank) * batch;
        let mb: Vec<Sample> = (first..first + batch)
            .map(|i| match samples.get(i) {
                Some(s) => s.clone(),
                None => Sample { input_ids: samples[0].input_ids.clone(), labels: vec![-100; seq_len], len: 0, segments: vec![] },
            })
            .collect();
        let ids: Vec<u32> = mb.iter().flat_map(|s| s.input_ids.iter().copied()).collect();
        let labels: Vec<i64> = mb.iter().flat_map(|s| s.labels.iter().copied()).collect();
        let refs: Vec<&Sample> = mb.iter().collect();
        loss += engine.forward_loss(&Tensor::from_vec(ids, (mb.len(), seq_len), engine.device())?, &labels, packing_for(&refs).as_ref())?;
        tokens += mb.iter().map(Sample::target_tokens).sum::<usize>() as f64;
    }
    let mut sums = [loss, tokens];
    engine.groups().world.all_reduce_f64(&mut sums)?;
    let mean = sums[0] / sums[1].max(1.0);
    Ok((mean, mean.exp()))
}

/// What a run leaves in `dir`: the full model, or for LoRA the PEFT adapter (plus the merged
/// model in `dir/merged` with `--merge-lora`).
fn export_result(
    engine: &FsdpEngine,
    model: &dyn models::StagedModel,
    model_cfg: &models::ModelConfig,
    side_files: &[(String, Vec<u8>)],
    dir: &Path,
    cfg: &FinetuneConfig,
    is_root: bool,
) -> Result<()> {
    let Some(lora) = &model_cfg.lora else {
        return export_full(engine, model, model_cfg, side_files, Some(dir), cfg.max_shard_size, is_root, None);
    };
    // One pass over the units: the adapter tensors are kept (they are small) and, with
    // --merge-lora, the merged model is streamed to OUTPUT/merged at the same time.
    let mut adapter = std::collections::HashMap::new();
    let merged_dir = dir.join("merged");
    export_full(engine, model, model_cfg, side_files, cfg.merge_lora.then_some(merged_dir.as_path()), cfg.max_shard_size, is_root, Some(&mut adapter))?;
    if is_root {
        let base = match Path::new(&cfg.model).is_dir() {
            true => std::fs::canonicalize(&cfg.model)?.to_string_lossy().to_string(),
            false => cfg.model.clone(),
        };
        crate::checkpoint::adapter::write_adapter(dir, &adapter, lora, &base)?;
        // The tokenizer travels with the adapter, as PEFT + Trainer save it.
        for (name, bytes) in side_files.iter().filter(|(n, _)| n.starts_with("tokenizer") || n == "special_tokens_map.json" || n == "chat_template.jinja") {
            std::fs::write(dir.join(name), bytes).with_context(|| format!("writing {}", dir.join(name).display()))?;
        }
    }
    engine.groups().world.barrier()?;
    Ok(())
}

/// Writes the full Hugging Face model into `dir`: each unit is gathered on every rank of the
/// shard group and rank 0 streams it into the safetensors files, so memory stays at one unit.
/// LoRA adapters are merged into their base weights (`W + scaling * B A`); `keep_adapter` gets
/// a copy of them (rank 0). With `dir` None no model is written (the pass only collects).
#[allow(clippy::too_many_arguments)]
fn export_full(
    engine: &FsdpEngine,
    model: &dyn models::StagedModel,
    model_cfg: &models::ModelConfig,
    side_files: &[(String, Vec<u8>)],
    dir: Option<&Path>,
    max_shard_size: usize,
    is_root: bool,
    mut keep_adapter: Option<&mut std::collections::HashMap<String, Tensor>>,
) -> Result<()> {
    let save_dtype = match model_cfg.stored_dtype.as_deref() {
        Some("bfloat16") => DType::BF16,
        Some("float16") => DType::F16,
        _ => DType::F32,
    };
    let mut export = if let (true, Some(dir)) = (is_root, dir) {
        // Checkpoint order (embeddings, layers, norm, head), so the shards read naturally.
        let specs: Vec<(String, Vec<usize>)> = model
            .parameters()
            .iter()
            .filter(|t| !models::lora::is_adapter_tensor(&t.name))
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        Some(ShardedExport::new(dir, save_dtype, max_shard_size, &specs)?)
    } else {
        None
    };
    for u in 0..engine.units().count() {
        let mut full = engine.full_unit(u)?;
        if let (Some(keep), true) = (keep_adapter.as_deref_mut(), is_root) {
            keep.extend(full.iter().filter(|(n, _)| models::lora::is_adapter_tensor(n)).map(|(n, t)| (n.clone(), t.clone())));
        }
        if let (Some(lora), true) = (&model_cfg.lora, export.is_some()) {
            models::lora::merge_into(&mut full, lora)?;
        }
        if let Some(ex) = export.as_mut() {
            for (n, t) in &full {
                ex.add(n, t)?;
            }
        }
    }
    engine.groups().world.barrier()?;
    if let Some(ex) = export {
        ex.finish(side_files)?;
    }
    Ok(())
}
