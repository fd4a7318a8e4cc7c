//! Resuming a run from a sharded checkpoint (the other half of [`super::sharded::save`]):
//! rank 0 finds the checkpoint, verifies its files, and checks that it belongs to this run (model
//! config, parameter shapes, global batch, tokenizer, data and data cursor); then every rank
//! loads its chunks of weights and AdamW moments, re-cut for this run's world size.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::identity::{check_resume, AllowedChanges, DataCursor, DataIdentity};
use super::sharded::{self, CheckpointReader};
use crate::fsdp::engine::{FsdpEngine, StatePart};

/// What the run being resumed is, for the checkpoint to be compared with.
pub struct ResumingRun<'a> {
    pub config_json: &'a str,
    /// (name, full shape) of every parameter, sorted by name.
    pub params: Vec<(String, Vec<usize>)>,
    pub global_batch: usize,
    pub tokenizer: Option<&'a [u8]>,
    pub data: &'a DataIdentity,
    pub samples: usize,
    pub steps_per_epoch: usize,
    pub allow: AllowedChanges,
}

/// Rank 0: the checkpoint `from` (a directory, or "latest" under `output_dir`), verified and
/// checked against `run`, with its trainer state.
pub fn open_for_resume(from: &str, output_dir: &Path, run: &ResumingRun) -> Result<(CheckpointReader, Value)> {
    let (dir, manifest) = if from == "latest" {
        sharded::find_latest(output_dir)?
    } else {
        let dir = PathBuf::from(from);
        let m = sharded::verify(&dir)?;
        (dir, m)
    };
    let reader = CheckpointReader::open(&dir, manifest)?;
    if sharded::sha256_hex(run.config_json.as_bytes()) != reader.manifest.config_sha256 {
        let ckpt_config = String::from_utf8(reader.side_file("config.json").unwrap_or_default()).unwrap_or_default();
        bail!(
            "{} was saved from another model or config: {}",
            dir.display(),
            sharded::config_differences(&ckpt_config, run.config_json).join("; ")
        );
    }
    let theirs: Vec<(String, Vec<usize>)> = reader.manifest.params.iter().map(|p| (p.name.clone(), p.shape.clone())).collect();
    if run.params != theirs {
        bail!("{}: its parameters differ from this model's", dir.display());
    }
    let state: Value = serde_json::from_slice(&reader.side_file(sharded::TRAINER_STATE).context("trainer_state.json")?)?;
    let saved_batch = state["global_batch"].as_u64().unwrap_or(0) as usize;
    if saved_batch != run.global_batch {
        bail!(
            "{} was saved with a global batch of {saved_batch} sequences; this run has {}: keep the global batch \
             (batch size x ranks x accumulation) to resume",
            dir.display(),
            run.global_batch
        );
    }
    let cursor = DataCursor::at(reader.manifest.step as usize, run.samples, run.steps_per_epoch);
    let tokenizer_sha = reader.manifest.tokenizer_sha256.as_deref();
    for w in check_resume(&dir.display().to_string(), &state, tokenizer_sha, run.tokenizer, run.data, &cursor, run.allow)? {
        eprintln!("warning: {w}");
    }
    Ok((reader, state))
}

/// Fills `engine` from a checkpoint, unit by unit and part by part: rank 0 passes its reader,
/// the others `None` (they receive their chunks).
pub fn load_state(engine: &mut FsdpEngine, reader: Option<&CheckpointReader>) -> Result<()> {
    for u in 0..engine.units().count() {
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
    Ok(())
}
