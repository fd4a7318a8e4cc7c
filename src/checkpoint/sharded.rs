//! Sharded training checkpoints: each shard writes its chunks of the fp32 weights and AdamW
//! moments; rank 0 adds the trainer state, config and tokenizer files, and writes the manifest
//! (shapes, files, sizes, SHA-256 hashes) last. Everything goes into a temporary directory that
//! is renamed into place only when every rank succeeded, so a directory without a complete,
//! verified manifest is never taken for a checkpoint.
//!
//! Chunks are stored flat with the full shapes in the manifest, so a checkpoint can be re-cut
//! for any world size (resume) or merged into a normal Hugging Face directory without the job.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::dist::{root_tries, ProcessGroups};
use crate::fsdp::engine::{FsdpEngine, StatePart};
use crate::model_files::load::StoredTensor;

pub const MANIFEST: &str = "manifest.json";
pub const TRAINER_STATE: &str = "trainer_state.json";
const FORMAT: &str = "fsdp-app-sharded-v1";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ParamEntry {
    pub name: String,
    pub shape: Vec<usize>,
    /// dtype of the stored weights and moments (always fp32 master state).
    pub dtype: String,
}

/// What one rank reports after writing (or not writing) its shard file.
#[derive(Debug, Serialize, Deserialize)]
struct WriteOutcome {
    error: Option<String>,
    /// (shard rank, bytes, SHA-256) of the file this rank wrote.
    shard: Option<(usize, u64, String)>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub bytes: u64,
    pub sha256: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub step: u64,
    pub world_size: usize,
    pub shard_size: usize,
    pub strategy: String,
    /// Full shapes; values are stored as f32.
    pub params: Vec<ParamEntry>,
    /// File holding shard k's chunks, for k in 0..shard_size.
    pub shard_files: Vec<String>,
    /// Every file of the checkpoint but the manifest.
    pub files: Vec<FileEntry>,
    pub config_sha256: String,
    pub tokenizer_sha256: Option<String>,
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn file_sha256(path: &Path) -> Result<(u64, String)> {
    let mut f = std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf)?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((n, hex(&h.finalize())))
}

fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 is plain old data; the file format is little endian like the targets we build for.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// Writes named flat f32 arrays as one safetensors file, streaming (no copy of the data),
/// and returns its size and SHA-256.
fn write_flat_safetensors(path: &Path, tensors: &[(String, &[f32])]) -> Result<(u64, String)> {
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    for (name, v) in tensors {
        header.insert(name.clone(), json!({"dtype": "F32", "shape": [v.len()], "data_offsets": [off, off + v.len() * 4]}));
        off += v.len() * 4;
    }
    let mut header = serde_json::to_vec(&Value::Object(header))?;
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    let mut h = Sha256::new();
    let mut put = |w: &mut std::io::BufWriter<std::fs::File>, b: &[u8]| -> Result<()> {
        h.update(b);
        w.write_all(b).with_context(|| format!("writing {}", path.display()))
    };
    put(&mut w, &(header.len() as u64).to_le_bytes())?;
    put(&mut w, &header)?;
    for (_, v) in tensors {
        put(&mut w, f32_bytes(v))?;
    }
    let file = w.into_inner().map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    file.sync_all()?;
    let n = file.metadata()?.len();
    Ok((n, hex(&h.finalize())))
}

fn fsync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// What rank 0 adds to a checkpoint besides the shards.
pub struct SaveExtras<'a> {
    pub trainer_state: Value,
    /// config.json, tokenizer files, generation_config.json (name, bytes).
    pub side_files: &'a [(String, Vec<u8>)],
    pub strategy: String,
    pub total_limit: Option<usize>,
}

/// Test hooks (cargo feature `fault-injection`, which only the tests enable): make a rank fail
/// while writing, or every rank pause just before writing its shard, to test the failure paths
/// for real (kills during a save). A release build has no such hook.
#[cfg(feature = "fault-injection")]
fn fault_fail_rank() -> Option<usize> {
    std::env::var("FSDP_FAULT_SAVE_FAIL_RANK").ok().and_then(|v| v.parse().ok())
}
#[cfg(feature = "fault-injection")]
fn fault_pause_in_save() -> Option<std::time::Duration> {
    std::env::var("FSDP_FAULT_PAUSE_IN_SAVE_MS").ok().and_then(|v| v.parse().ok()).map(std::time::Duration::from_millis)
}
#[cfg(not(feature = "fault-injection"))]
fn fault_fail_rank() -> Option<usize> {
    None
}
#[cfg(not(feature = "fault-injection"))]
fn fault_pause_in_save() -> Option<std::time::Duration> {
    None
}

/// Saves `OUTPUT/checkpoint-STEP`. Every rank calls it; every rank gets the same outcome.
/// With device-resident state (GPUs) the shards are copied to the host first.
pub fn save(engine: &mut FsdpEngine, groups: &ProcessGroups, output_dir: &Path, extras: &SaveExtras) -> Result<PathBuf> {
    engine.sync_host()?;
    let engine = &*engine;
    let rank = groups.world.rank();
    let world = groups.world.world_size();
    let shard_size = groups.shard.world_size();
    let shard_rank = groups.shard.rank();
    let writer = groups.replicate.rank() == 0;
    let step = engine.step;
    let final_dir = checkpoint_dir(output_dir, step as usize);
    let tmp_dir = output_dir.join(format!(".{CHECKPOINT_PREFIX}{step}.tmp"));

    // 1. Rank 0 prepares the temporary directory; everyone learns whether that worked.
    root_tries(groups.world.as_ref(), &format!("prepare checkpoint {step} in {}", tmp_dir.display()), || {
        if tmp_dir.exists() {
            std::fs::remove_dir_all(&tmp_dir)?;
        }
        std::fs::create_dir_all(&tmp_dir).with_context(|| format!("checkpoint {step}: creating {}", tmp_dir.display()))?;
        Ok(((), vec![]))
    })?;

    if let Some(d) = fault_pause_in_save() {
        std::thread::sleep(d);
    }

    // 2. One rank per shard writes its chunks.
    let shard_file = format!("shard-{:05}-of-{shard_size:05}.safetensors", shard_rank);
    let written: Result<Option<(u64, String)>> = if writer {
        (|| {
            if fault_fail_rank() == Some(rank) {
                bail!("injected failure while writing {shard_file} (FSDP_FAULT_SAVE_FAIL_RANK)");
            }
            let state = engine.shard_state();
            let mut tensors: Vec<(String, &[f32])> = vec![];
            for shard in &state {
                for (part, data) in StatePart::ALL.iter().zip([shard.weights, shard.exp_avg, shard.exp_avg_sq]) {
                    // Frozen parameters (a LoRA base) have weights only.
                    if *part == StatePart::Master || shard.layout.trainable {
                        tensors.push((format!("{}{}", shard.layout.spec.name, part.suffix()), data));
                    }
                }
            }
            write_flat_safetensors(&tmp_dir.join(&shard_file), &tensors).map(Some)
        })()
    } else {
        Ok(None)
    };

    // 3. Agreement: every rank learns every rank's outcome (its error, or the file it wrote).
    let outcome = match &written {
        Err(e) => WriteOutcome { error: Some(format!("{e:#}")), shard: None },
        Ok(Some((bytes, sha))) => WriteOutcome { error: None, shard: Some((shard_rank, *bytes, sha.clone())) },
        Ok(None) => WriteOutcome { error: None, shard: None },
    };
    let outcomes: Vec<WriteOutcome> = groups
        .world
        .all_gather_bytes(serde_json::to_vec(&outcome)?)?
        .iter()
        .map(|b| serde_json::from_slice(b).context("a rank's checkpoint outcome"))
        .collect::<Result<_>>()?;
    let failed: Vec<usize> = (0..world).filter(|&r| outcomes[r].error.is_some()).collect();
    if !failed.is_empty() {
        if rank == 0 {
            let _ = std::fs::remove_dir_all(&tmp_dir);
        }
        let own = written.err().map(|e| format!(": {e:#}")).unwrap_or_default();
        bail!("checkpoint {step} not saved: writing failed on rank(s) {failed:?}{own}");
    }
    let mut shard_entries: Vec<Option<(u64, String)>> = vec![None; shard_size];
    for (k, bytes, sha) in outcomes.into_iter().filter_map(|o| o.shard) {
        shard_entries[k] = Some((bytes, sha));
    }

    // 4. Rank 0: trainer state and side files, then the manifest, then the rename; everyone
    // learns the outcome.
    let committed = root_tries(groups.world.as_ref(), &format!("save checkpoint {step}"), || {
        let dir = (|| -> Result<PathBuf> {
            let mut files = vec![];
            let mut shard_files = vec![];
            for (k, entry) in shard_entries.iter().enumerate() {
                let name = format!("shard-{k:05}-of-{shard_size:05}.safetensors");
                let Some((bytes, sha)) = entry else { bail!("no rank reported writing {name}") };
                files.push(FileEntry { name: name.clone(), bytes: *bytes, sha256: sha.clone() });
                shard_files.push(name);
            }
            let mut extra: Vec<(String, Vec<u8>)> = extras.side_files.to_vec();
            let mut ts = serde_json::to_vec_pretty(&extras.trainer_state)?;
            ts.push(b'\n');
            extra.push((TRAINER_STATE.to_string(), ts));
            let mut config_sha = String::new();
            let mut tokenizer_sha = None;
            for (name, bytes) in &extra {
                let path = tmp_dir.join(name);
                let mut f = std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
                f.write_all(bytes)?;
                f.sync_all()?;
                let sha = sha256_hex(bytes);
                if name == "config.json" {
                    config_sha = sha.clone();
                }
                if name == "tokenizer.json" {
                    tokenizer_sha = Some(sha.clone());
                }
                files.push(FileEntry { name: name.clone(), bytes: bytes.len() as u64, sha256: sha });
            }
            let params = engine_params(engine);
            let manifest = Manifest {
                format: FORMAT.into(),
                step,
                world_size: world,
                shard_size,
                strategy: extras.strategy.clone(),
                params,
                shard_files,
                files,
                config_sha256: config_sha,
                tokenizer_sha256: tokenizer_sha,
            };
            let tmp_manifest = tmp_dir.join(".manifest.json.tmp");
            let mut f = std::fs::File::create(&tmp_manifest)?;
            f.write_all(&serde_json::to_vec_pretty(&manifest)?)?;
            f.sync_all()?;
            std::fs::rename(&tmp_manifest, tmp_dir.join(MANIFEST))?;
            fsync_dir(&tmp_dir);
            if final_dir.exists() {
                std::fs::remove_dir_all(&final_dir)?;
            }
            std::fs::rename(&tmp_dir, &final_dir).with_context(|| format!("renaming {} into place", tmp_dir.display()))?;
            fsync_dir(output_dir);
            if let Some(k) = extras.total_limit {
                prune(output_dir, k)?;
            }
            Ok(final_dir.clone())
        })();
        if dir.is_err() {
            let _ = std::fs::remove_dir_all(&tmp_dir);
        }
        Ok((dir?, vec![]))
    });
    committed.map(|_| final_dir.clone()).with_context(|| format!("checkpoint {step} not saved"))
}

fn engine_params(engine: &FsdpEngine) -> Vec<ParamEntry> {
    let mut v: Vec<ParamEntry> = engine
        .units()
        .flat_map(|u| u.params.iter().map(|p| ParamEntry { name: p.spec.name.clone(), shape: p.spec.shape.clone(), dtype: "F32".into() }))
        .collect();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

/// What a checkpoint directory's name starts with: `OUTPUT/checkpoint-STEP`, as transformers'
/// Trainer names them (one being written is `.checkpoint-STEP.tmp`, which is not one).
const CHECKPOINT_PREFIX: &str = "checkpoint-";

/// Where the checkpoint of step `step` goes under `output_dir`.
pub fn checkpoint_dir(output_dir: &Path, step: usize) -> PathBuf {
    output_dir.join(format!("{CHECKPOINT_PREFIX}{step}"))
}

/// The step of a checkpoint directory named `name`, if that is one's name.
pub fn checkpoint_step(name: &str) -> Option<u64> {
    name.strip_prefix(CHECKPOINT_PREFIX)?.parse().ok()
}

/// Checkpoint directories under `output_dir` (step, path), newest first (complete or not:
/// `verify` says).
pub fn checkpoint_dirs(output_dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut v: Vec<(u64, PathBuf)> = std::fs::read_dir(output_dir)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.path().is_dir())
                .filter_map(|e| Some((checkpoint_step(&e.file_name().to_string_lossy())?, e.path())))
                .collect()
        })
        .unwrap_or_default();
    v.sort_by_key(|(step, _)| std::cmp::Reverse(*step));
    v
}

/// Keeps the newest `keep` checkpoints.
fn prune(output_dir: &Path, keep: usize) -> Result<()> {
    for (_, dir) in checkpoint_dirs(output_dir).into_iter().skip(keep) {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing old {}", dir.display()))?;
    }
    Ok(())
}

/// Reads and fully checks a checkpoint: manifest present and parseable, every file present,
/// of the recorded size and SHA-256. Errors say what is missing or wrong, by name.
pub fn verify(dir: &Path) -> Result<Manifest> {
    if !dir.is_dir() {
        bail!("{}: no such checkpoint directory", dir.display());
    }
    let mpath = dir.join(MANIFEST);
    if !mpath.is_file() {
        let present: Vec<String> = std::fs::read_dir(dir)?.flatten().map(|e| e.file_name().to_string_lossy().to_string()).collect();
        bail!(
            "{} is not a complete checkpoint: {MANIFEST} is missing (it is written last, so the save did not finish); \
             present: [{}]",
            dir.display(),
            present.join(", ")
        );
    }
    let manifest: Manifest =
        serde_json::from_slice(&std::fs::read(&mpath)?).with_context(|| format!("{}: not a valid manifest", mpath.display()))?;
    if manifest.format != FORMAT {
        bail!("{}: format {:?}, expected {FORMAT:?}", mpath.display(), manifest.format);
    }
    for f in &manifest.files {
        let p = dir.join(&f.name);
        if !p.is_file() {
            bail!("{} is not a complete checkpoint: {} is missing", dir.display(), p.display());
        }
        let (bytes, sha) = file_sha256(&p)?;
        if bytes != f.bytes {
            bail!("{}: {bytes} bytes, the manifest says {}; the file is truncated or was replaced", p.display(), f.bytes);
        }
        if sha != f.sha256 {
            bail!("{}: SHA-256 mismatch (manifest {}, file {sha}); the file is corrupt", p.display(), f.sha256);
        }
    }
    Ok(manifest)
}

/// The newest checkpoint under `output_dir` that verifies; incomplete or corrupt ones are
/// skipped with a message.
pub fn find_latest(output_dir: &Path) -> Result<(PathBuf, Manifest)> {
    let dirs = checkpoint_dirs(output_dir);
    for (_, dir) in &dirs {
        match verify(dir) {
            Ok(m) => return Ok((dir.clone(), m)),
            Err(e) => eprintln!("skipping {}: {e:#}", dir.display()),
        }
    }
    bail!("no complete checkpoint under {} (looked at {} checkpoint-* directories)", output_dir.display(), dirs.len())
}

/// Reads full tensors back from a verified checkpoint, one at a time.
pub struct CheckpointReader {
    pub dir: PathBuf,
    pub manifest: Manifest,
    shards: Vec<BTreeMap<String, StoredTensor>>,
}

impl CheckpointReader {
    pub fn open(dir: &Path, manifest: Manifest) -> Result<Self> {
        let shards = manifest
            .shard_files
            .iter()
            .map(|f| crate::model_files::load::read_weight_headers(&[dir.join(f)]))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { dir: dir.to_path_buf(), manifest, shards })
    }

    /// Full values of one part of parameter `name` (chunks of every shard, padding dropped).
    pub fn read(&self, name: &str, part: StatePart) -> Result<Vec<f32>> {
        let p = self.manifest.params.iter().find(|p| p.name == name).with_context(|| format!("checkpoint has no parameter {name}"))?;
        let numel: usize = p.shape.iter().product();
        let key = format!("{name}{}", part.suffix());
        let mut full = Vec::with_capacity(numel);
        for (k, shard) in self.shards.iter().enumerate() {
            let t = shard.get(&key).with_context(|| format!("{}: no tensor {key}", self.manifest.shard_files[k]))?;
            full.extend(t.read_f32()?);
        }
        full.truncate(numel);
        if full.len() != numel {
            bail!("checkpoint tensor {key} has {} values, its shape needs {numel}", full.len());
        }
        Ok(full)
    }

    /// Bytes of a side file (config.json, tokenizer.json, ...), if the checkpoint has it.
    pub fn side_file(&self, name: &str) -> Option<Vec<u8>> {
        self.manifest.files.iter().any(|f| f.name == name).then(|| std::fs::read(self.dir.join(name)).ok()).flatten()
    }

    /// The side files a Hugging Face directory needs (everything but shards and trainer state).
    pub fn side_files(&self) -> Result<Vec<(String, Vec<u8>)>> {
        self.manifest
            .files
            .iter()
            .filter(|f| !self.manifest.shard_files.contains(&f.name) && f.name != TRAINER_STATE)
            .map(|f| Ok((f.name.clone(), std::fs::read(self.dir.join(&f.name))?)))
            .collect()
    }
}

/// Lists how two config.json texts differ, field by field.
pub fn config_differences(a: &str, b: &str) -> Vec<String> {
    let (Ok(Value::Object(a)), Ok(Value::Object(b))) = (serde_json::from_str::<Value>(a), serde_json::from_str::<Value>(b)) else {
        return vec!["config.json is not a JSON object".into()];
    };
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| {
            let show = |v: Option<&Value>| v.map(|v| v.to_string()).unwrap_or_else(|| "absent".into());
            format!("{k}: checkpoint {} vs model {}", show(a.get(k)), show(b.get(k)))
        })
        .collect()
}

/// `fsdp-app merge`: a sharded checkpoint to a Hugging Face directory, one tensor at a time.
pub fn merge(checkpoint: &Path, out: &Path, dtype: candle_core::DType, max_shard_size: usize) -> Result<PathBuf> {
    let manifest = verify(checkpoint)?;
    if out.exists() && std::fs::read_dir(out)?.next().is_some() {
        bail!("{} exists and is not empty", out.display());
    }
    let reader = CheckpointReader::open(checkpoint, manifest)?;
    // A LoRA run's checkpoint: its adapters are folded into the base weights (W + scaling B A).
    let lora = match reader.side_file(crate::model_files::adapter::ADAPTER_CONFIG) {
        Some(bytes) => Some(
            crate::model_files::adapter::parse_adapter_config(
                &String::from_utf8_lossy(&bytes),
                &checkpoint.join(crate::model_files::adapter::ADAPTER_CONFIG),
            )?
            .0,
        ),
        None => None,
    };
    let specs: Vec<(String, Vec<usize>)> = reader
        .manifest
        .params
        .iter()
        .filter(|p| !models::lora::is_adapter_tensor(&p.name))
        .map(|p| (p.name.clone(), p.shape.clone()))
        .collect();
    let all_names: std::collections::HashSet<&str> = reader.manifest.params.iter().map(|p| p.name.as_str()).collect();
    let mut export = crate::model_files::export::ShardedExport::new(out, dtype, max_shard_size, &specs)?;
    let tensor = |name: &str, shape: &[usize]| -> Result<candle_core::Tensor> {
        Ok(candle_core::Tensor::from_vec(reader.read(name, StatePart::Master)?, shape, &candle_core::Device::Cpu)?)
    };
    for (name, shape) in &specs {
        let mut one = std::collections::HashMap::from([(name.clone(), tensor(name, shape)?)]);
        if let (Some(lora), Some(module)) = (&lora, name.strip_suffix(".weight")) {
            let (a, b) = (format!("{module}.lora_A.weight"), format!("{module}.lora_B.weight"));
            if all_names.contains(a.as_str()) && all_names.contains(b.as_str()) {
                let r = lora.r;
                one.insert(a.clone(), tensor(&a, &[r, shape[1]])?);
                one.insert(b.clone(), tensor(&b, &[shape[0], r])?);
                models::lora::merge_into(&mut one, lora)?;
            }
        }
        export.add(name, &one[name])?;
    }
    let side: Vec<(String, Vec<u8>)> =
        reader.side_files()?.into_iter().filter(|(n, _)| n != crate::model_files::adapter::ADAPTER_CONFIG).collect();
    export.finish(&side)
}

/// A LoRA run's checkpoint as a PEFT adapter directory (its adapter tensors and
/// `adapter_config.json`, not the frozen base): what a multi-LoRA server serves over the base.
/// Fails when the checkpoint is not a LoRA run's.
pub fn export_adapter(checkpoint: &Path, out: &Path) -> Result<PathBuf> {
    use crate::model_files::adapter::{parse_adapter_config, write_adapter, ADAPTER_CONFIG};
    let reader = CheckpointReader::open(checkpoint, verify(checkpoint)?)?;
    let Some(config) = reader.side_file(ADAPTER_CONFIG) else { bail!("{} is not a LoRA run's checkpoint", checkpoint.display()) };
    let (settings, base) = parse_adapter_config(&String::from_utf8_lossy(&config), &checkpoint.join(ADAPTER_CONFIG))?;
    let mut tensors = std::collections::HashMap::new();
    for p in reader.manifest.params.iter().filter(|p| models::lora::is_adapter_tensor(&p.name)) {
        let values = reader.read(&p.name, StatePart::Master)?;
        tensors.insert(p.name.clone(), candle_core::Tensor::from_vec(values, p.shape.as_slice(), &candle_core::Device::Cpu)?);
    }
    write_adapter(out, &tensors, &settings, base.as_deref().unwrap_or(""))
}
