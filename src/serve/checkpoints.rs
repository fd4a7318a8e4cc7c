//! A job's checkpoints as OpenAI shows them (`GET /v1/fine_tuning/jobs/{id}/checkpoints`), and
//! serving each by the `fine_tuned_model_checkpoint` id it shows.
//!
//! Jobs save a sharded checkpoint at the end of every epoch and keep the newest [`KEEP`] (OpenAI
//! keeps the final model and the two epochs before it). While the job runs, the runner's
//! [`Recorder`] lists the `checkpoint-STEP` directories the training has written (a directory
//! appears only whole: training renames it into place) and records each with its step's
//! metrics; one rotated away is forgotten. The job's final model is recorded at its last step.
//!
//! A periodic checkpoint is training state (fp32 shards and AdamW moments), so the first request
//! for it writes it once beside it (`served/ckpt-step-STEP`, under a temporary name and renamed):
//! merged into a Hugging Face directory, or for a LoRA job its PEFT adapter, served over the base. The last step of a succeeded job is its final
//! model, served from where the job put it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use super::jobs::spec::JobStatus;
use super::store::{final_model_dir, Store};
use crate::checkpoint::sharded;
use crate::model_files::write::StagedDir;

/// Checkpoints a job keeps (its `--save-total-limit`).
pub const KEEP: usize = 3;

/// The id a checkpoint of fine-tuned model `model` is served as, OpenAI's spelling.
pub fn checkpoint_model_id(model: &str, step: i64) -> String {
    format!("{model}:ckpt-step-{step}")
}

/// Whether model id `id` names a checkpoint of fine-tuned model `model`.
pub fn is_checkpoint_of(id: &str, model: &str) -> bool {
    id.strip_prefix(model).is_some_and(|rest| rest.starts_with(":ckpt-step-"))
}

/// The steps of the `checkpoint-STEP` directories under `output_dir` (training renames a
/// checkpoint into place whole).
fn saved_steps(output_dir: &Path) -> BTreeSet<i64> {
    sharded::checkpoint_dirs(output_dir).into_iter().map(|(step, _)| step as i64).collect()
}

fn merged_dir(output_dir: &Path, step: i64) -> PathBuf {
    output_dir.join("served").join(format!("ckpt-step-{step}"))
}

/// The runner's side: records a running job's checkpoints as they appear and go.
pub struct Recorder {
    job: String,
    output_dir: PathBuf,
    /// The fine-tuned model's id (`ft:BASE:SUFFIX:JOB`).
    model: String,
    /// Each step's metrics as OpenAI names them (`step`, `train_loss`, `valid_loss`).
    metrics_at: BTreeMap<i64, Value>,
}

impl Recorder {
    pub fn new(job: &str, output_dir: &Path, model: &str) -> Self {
        Self { job: job.into(), output_dir: output_dir.into(), model: model.into(), metrics_at: BTreeMap::new() }
    }

    /// Notes a metric of step `step` (a row of the training's metrics.jsonl).
    pub fn saw(&mut self, step: i64, name: &str, value: f64) {
        let m = self.metrics_at.entry(step).or_insert_with(|| json!({"step": step}));
        m[name] = json!(value);
    }

    /// Records the checkpoint directories written since the last call, forgets those the
    /// training rotated away (and their merged copies).
    pub fn sync(&self, store: &Store) -> Result<()> {
        let on_disk = saved_steps(&self.output_dir);
        let recorded: BTreeSet<i64> = store.checkpoint_steps(&self.job)?.into_iter().collect();
        for &step in on_disk.difference(&recorded) {
            store.add_checkpoint(&self.job, step, self.metrics(step), &checkpoint_model_id(&self.model, step))?;
        }
        for &step in recorded.difference(&on_disk) {
            store.delete_checkpoint(&self.job, step)?;
            let _ = std::fs::remove_dir_all(merged_dir(&self.output_dir, step));
        }
        Ok(())
    }

    /// The job succeeded after `last_step` steps: its final model is a checkpoint too.
    pub fn finish(&self, store: &Store, last_step: i64) -> Result<()> {
        self.sync(store)?;
        if !store.checkpoint_steps(&self.job)?.contains(&last_step) {
            store.add_checkpoint(&self.job, last_step, self.metrics(last_step), &checkpoint_model_id(&self.model, last_step))?;
        }
        Ok(())
    }

    fn metrics(&self, step: i64) -> Value {
        self.metrics_at.get(&step).cloned().unwrap_or_else(|| json!({"step": step}))
    }
}

/// The Hugging Face directory checkpoint model `id` is served from, merging a periodic
/// checkpoint the first time; `None`: no checkpoint has that id.
pub fn servable_dir(store: &Store, id: &str) -> Result<Option<PathBuf>> {
    let Some((job_id, step)) = store.checkpoint_of_model(id)? else { return Ok(None) };
    let job = store.job(&job_id)?.with_context(|| format!("job {job_id} of checkpoint {id}"))?;
    let output_dir = PathBuf::from(&job.output_dir);
    let last = store.checkpoint_steps(&job_id)?.into_iter().max();
    if job.status == JobStatus::Succeeded && last == Some(step) {
        return Ok(Some(final_model_dir(&output_dir, &job.extensions)));
    }
    // A LoRA job's checkpoint is served as its adapter over the base, unless the job merges.
    let as_adapter = job.extensions.lora.is_some() && !job.extensions.merge;
    let merged = merged_dir(&output_dir, step);
    let written = if as_adapter { crate::model_files::adapter::ADAPTER_CONFIG } else { "config.json" };
    if !merged.join(written).is_file() {
        let checkpoint = sharded::checkpoint_dir(&output_dir, step as usize);
        if !checkpoint.is_dir() {
            // Rotated away since it was listed (the runner forgets it at its next look).
            return Ok(None);
        }
        // Written into a temporary sibling, renamed into place whole (removed if it fails).
        let staged = StagedDir::new(&merged)?;
        match as_adapter {
            true => sharded::export_adapter(&checkpoint, staged.path()),
            false => sharded::merge(&checkpoint, staged.path(), candle_core::DType::F32, usize::MAX),
        }
        .with_context(|| format!("writing {} to serve {id}", checkpoint.display()))?;
        staged.commit()?;
    }
    Ok(Some(merged))
}
