//! Phases 2 and 3: build the FSDP engine on the rank's device, then fill it, either from the
//! model's weights (rank 0 streams one unit at a time, each rank keeps its chunks) or from a
//! sharded checkpoint (resume).

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use serde_json::json;

use super::bootstrap::Bootstrap;
use super::config::FinetuneConfig;
use super::plan::RunPlan;
use crate::checkpoint::resume::{self, ResumingRun};
use crate::dist::{root_tries, ProcessGroups};
use crate::fsdp::engine::{FsdpEngine, FsdpOptions, ParamSource, StateBytes, StatePart};
use crate::fsdp::optim::AdamWConfig;
use crate::fsdp::plan::ParamLayout;
use crate::memory::human_bytes;
use crate::model_files::load;

/// The engine on this rank's device: `device` when the backend already opened it (NCCL), else
/// the rank's GPU (its LOCAL_RANK under a launcher, its rank for `local` threads) or the CPU.
pub(super) fn build_engine(groups: &ProcessGroups, cfg: &FinetuneConfig, boot: &Bootstrap, device: Option<Device>) -> Result<FsdpEngine> {
    let opts = FsdpOptions {
        strategy: cfg.strategy,
        activation_checkpointing: cfg.activation_checkpointing,
        param_dtype: cfg.param_dtype,
        reduce_dtype: cfg.reduce_dtype,
        // By default where collectives run beside compute (NCCL's stream); `FSDP_PREFETCH=0`
        // turns that off, for comparisons.
        prefetch: cfg
            .prefetch
            .unwrap_or_else(|| groups.shard.overlaps_compute() && std::env::var("FSDP_PREFETCH").map_or(true, |v| v != "0")),
    };
    let adam = AdamWConfig { lr: cfg.lr, weight_decay: cfg.weight_decay, ..Default::default() };
    let device = match device {
        Some(d) => d,
        None => cfg.device.open(crate::dist::env::DistEnv::from_env()?.map(|e| e.local_rank).unwrap_or(groups.world.rank()))?,
    };
    // The state lives on a GPU unless `--cpu-offload` (or a test) says otherwise.
    let state_on_device = cfg.cpu_offload.map(|offload| !offload).unwrap_or(!device.is_cpu());
    FsdpEngine::new(boot.staged.clone(), boot.plan.clone(), groups.clone(), opts, adam, cfg.weight_decay_all)?
        .with_device(device, state_on_device)
}

/// Fills the engine from `--resume-from-checkpoint` or from the model's weights, then reports
/// what each rank holds. Returns every rank's state bytes and, on rank 0 of a resumed run, the
/// checkpoint's directory.
pub(super) fn load_or_resume(
    engine: &mut FsdpEngine,
    groups: &ProcessGroups,
    cfg: &FinetuneConfig,
    plan: &RunPlan,
    boot: &Bootstrap,
) -> Result<(Vec<StateBytes>, Option<std::path::PathBuf>)> {
    let start = Instant::now();
    let resumed = match &cfg.resume_from {
        Some(from) => resume_from(engine, groups, cfg, plan, boot, from)?,
        None => {
            load_weights(engine, cfg, boot)?;
            None
        }
    };
    if engine.step as usize > plan.total_steps {
        bail!("the checkpoint is at step {}, past this run's {} steps", engine.step, plan.total_steps);
    }
    let bytes = all_state_bytes(engine, groups)?;
    if groups.world.rank() == 0 && cfg.verbose {
        report(cfg, plan, boot, engine.units().count(), &bytes, start.elapsed().as_secs_f64());
    }
    Ok((bytes, resumed))
}

/// Rank 0 opens and checks the checkpoint; every rank learns the step (or rank 0's error) and
/// loads its chunks.
fn resume_from(
    engine: &mut FsdpEngine,
    groups: &ProcessGroups,
    cfg: &FinetuneConfig,
    plan: &RunPlan,
    boot: &Bootstrap,
    from: &str,
) -> Result<Option<std::path::PathBuf>> {
    let (reader, bytes) = root_tries(groups.world.as_ref(), "resume", || {
        let mut params: Vec<(String, Vec<usize>)> =
            engine.units().flat_map(|u| u.params.iter().map(|p| (p.spec.name.clone(), p.spec.shape.clone()))).collect();
        params.sort();
        let data = boot.data.identity.as_ref().context("rank 0 knows the data's identity")?;
        let run = ResumingRun {
            config_json: &boot.config_json,
            params,
            global_batch: plan.global_batch,
            tokenizer: boot.side_file("tokenizer.json"),
            data,
            samples: boot.data.samples.len(),
            steps_per_epoch: plan.steps_per_epoch,
            allow: cfg.resume_allow_changed,
        };
        let (reader, _state) = resume::open_for_resume(from, &cfg.output_dir, &run)?;
        let msg = json!({"step": reader.manifest.step}).to_string().into_bytes();
        Ok((reader, msg))
    })?;
    let step = serde_json::from_slice::<serde_json::Value>(&bytes)?["step"].as_u64().unwrap_or(0);
    resume::load_state(engine, reader.as_ref())?;
    engine.step = step;
    if let (Some(r), true) = (&reader, cfg.verbose) {
        eprintln!("resumed from {} at step {step}", r.dir.display());
    }
    Ok(reader.map(|r| r.dir.clone()))
}

/// Rank 0 streams the model's weights one unit at a time, reading each rank's rows straight
/// from the files (its extra memory is about one unit); LoRA adapters come from `--adapter` or
/// are initialised as PEFT does.
fn load_weights(engine: &mut FsdpEngine, cfg: &FinetuneConfig, boot: &Bootstrap) -> Result<()> {
    let stored = match &boot.files {
        Some(f) => {
            let stored = load::read_weight_headers(&f.weights)?;
            load::check_tensors(&boot.model_cfg, &stored, &f.source)?;
            Some(stored)
        }
        None => None,
    };
    for u in 0..engine.units().count() {
        let source = match &stored {
            Some(stored) => {
                // Adapter tensors are small: made or read whole.
                let mut adapters = std::collections::HashMap::new();
                for p in engine.units().nth(u).unwrap().params.iter().filter(|p| models::lora::is_adapter_tensor(&p.spec.name)) {
                    let values = match &boot.start_adapter {
                        Some(a) => a.tensors[&p.spec.name].flatten_all()?.to_vec1::<f32>()?,
                        None => models::lora::init_adapter(&p.spec, cfg.seed),
                    };
                    adapters.insert(p.spec.name.clone(), values);
                }
                Some(WeightFiles { stored, adapters })
            }
            None => None,
        };
        engine.load_unit_part_from(u, StatePart::Master, source.as_ref().map(|s| s as &dyn ParamSource))?;
    }
    Ok(())
}

/// The model's weight files (read in place, a row range at a time) and its adapters.
struct WeightFiles<'a> {
    stored: &'a std::collections::BTreeMap<String, load::StoredTensor>,
    adapters: std::collections::HashMap<String, Vec<f32>>,
}

impl ParamSource for WeightFiles<'_> {
    fn append_rows(&self, p: &ParamLayout, rows: std::ops::Range<usize>, dst: &mut Vec<f32>) -> Result<()> {
        if self.adapters.contains_key(&p.spec.name) {
            return self.adapters.append_rows(p, rows, dst);
        }
        let t = self.stored.get(&p.spec.name).with_context(|| format!("missing tensor {}", p.spec.name))?;
        t.append_f32(rows.start * p.row_len..rows.end * p.row_len, dst)
    }
}

/// Every rank's parameter, gradient and optimizer bytes, as each rank's buffers hold them.
fn all_state_bytes(engine: &FsdpEngine, groups: &ProcessGroups) -> Result<Vec<StateBytes>> {
    let (rank, world) = (groups.world.rank(), groups.world.world_size());
    let mine = engine.memory_bytes();
    let mut all = vec![0f64; 3 * world];
    all[3 * rank..3 * rank + 3].copy_from_slice(&[mine.params as f64, mine.grads as f64, mine.optimizer as f64]);
    groups.world.all_reduce_f64(&mut all)?;
    Ok(all.chunks(3).map(|c| StateBytes { params: c[0] as usize, grads: c[1] as usize, optimizer: c[2] as usize }).collect())
}

fn report(cfg: &FinetuneConfig, plan: &RunPlan, boot: &Bootstrap, n_units: usize, bytes: &[StateBytes], load_s: f64) {
    let (total, trainable) = (boot.total_params(), boot.trainable_params());
    eprintln!(
        "fsdp: {} rank(s), {}, {n_units} units, {:.1}M parameters; fp32 master weights and fp32 AdamW moments; \
         loaded on rank 0 and streamed in {load_s:.2}s",
        bytes.len(),
        cfg.strategy,
        total as f64 / 1e6,
    );
    eprintln!("{}", effective_settings(cfg, plan));
    if let Some(lora) = &boot.lora {
        eprintln!(
            "lora: r={} alpha={} dropout={} targets {:?}: {trainable} trainable parameters ({:.3}% of {total}); the base is frozen \
             (no gradients, no optimizer state)",
            lora.r,
            lora.alpha,
            lora.dropout,
            lora.targets,
            100.0 * trainable as f64 / total as f64,
        );
    }
    let unsharded = total * 4 + trainable * 12;
    for (r, b) in bytes.iter().enumerate() {
        eprintln!(
            "fsdp: rank {r} holds params {} + grads {} + optimizer {} = {} ({:.3} of the unsharded {})",
            human_bytes(b.params as u64),
            human_bytes(b.grads as u64),
            human_bytes(b.optimizer as u64),
            human_bytes(b.total() as u64),
            b.total() as f64 / unsharded as f64,
            human_bytes(unsharded as u64)
        );
    }
}

/// The settings the run uses, whatever set them (flags, `--config` files, defaults), in the
/// words of PyTorch FSDP and TrainingArguments, so a user can see a config file was honoured.
fn effective_settings(cfg: &FinetuneConfig, plan: &RunPlan) -> String {
    let (strategy, world, total_steps) = (cfg.strategy, plan.world_size, plan.total_steps);
    let dtype = |d: candle_core::DType| format!("{d:?}").to_lowercase();
    format!(
        "settings: sharding_strategy {strategy} (reshard_after_forward {}), activation_checkpointing {}, \
         param_dtype {}, reduce_dtype {}, world_size {world}, batch {} per rank x {} accumulation x {world} ranks = {} sequences of {} tokens, \
         lr {:e} ({:?}, {} warmup of {total_steps} steps), device {}",
        cfg.strategy.reshard_after_forward(),
        cfg.activation_checkpointing,
        dtype(cfg.param_dtype),
        dtype(cfg.reduce_dtype),
        plan.micro_batch,
        plan.grad_accum,
        plan.global_batch,
        plan.seq_len,
        cfg.lr,
        cfg.schedule,
        cfg.warmup_for(total_steps),
        // Threads as candle's pool has them (RAYON_NUM_THREADS, else `tune_cpu_threads`'s).
        match (cfg.device.is_cuda(), candle_core::utils::get_num_threads()) {
            (true, _) => "cuda".to_string(),
            (false, 1) => "cpu (1 thread)".to_string(),
            (false, n) => format!("cpu ({n} threads)"),
        },
    ) + &match (cfg.dpo, &cfg.grpo) {
        // A pair is two sequences: say how many pairs a step takes.
        (Some(d), _) => format!(", method dpo (beta {}, loss {:?}, {} pairs per step)", d.beta, d.loss, plan.global_batch / plan.group).to_lowercase(),
        // GRPO's rows are prompts, each sampled num_generations times.
        (_, Some(g)) => {
            let s = &g.settings;
            format!(
                ", method grpo ({} prompts x {} completions of at most {} tokens per step, loss_type {:?}, beta {}, epsilon {}/{}, num_iterations {}, scale_rewards {:?}, temperature {})",
                plan.global_batch,
                s.num_generations,
                s.max_completion_length,
                s.loss_type,
                s.beta,
                s.epsilon,
                s.epsilon_high,
                s.num_iterations,
                s.scale_rewards,
                s.temperature
            )
            .to_lowercase()
        }
        (None, None) => String::new(),
    }
}
