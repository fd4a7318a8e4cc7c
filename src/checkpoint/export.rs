//! Writing a full Hugging Face model directory a unit at a time: tensors are added as they are
//! gathered, written out whenever a shard file is full, and named
//! `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json` (or a single
//! `model.safetensors`) at the end. config.json is written last, so a directory interrupted
//! half-way is never taken for a model.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use serde_json::json;

use super::write::StagedDir;

pub struct ShardedExport {
    staged: StagedDir,
    dest: PathBuf,
    dtype: DType,
    max_shard_bytes: usize,
    pending: HashMap<String, Tensor>,
    pending_bytes: usize,
    /// (temporary file name, tensor names) per written shard.
    shards: Vec<(String, Vec<String>)>,
    total_bytes: usize,
}

impl ShardedExport {
    /// Stages an export whose files will be moved into `dest` (created if needed).
    pub fn new(dest: &Path, dtype: DType, max_shard_bytes: usize) -> Result<Self> {
        std::fs::create_dir_all(dest).with_context(|| format!("creating {}", dest.display()))?;
        let staged = StagedDir::new(&dest.join(".export"))?;
        Ok(Self {
            staged,
            dest: dest.to_path_buf(),
            dtype,
            max_shard_bytes,
            pending: HashMap::new(),
            pending_bytes: 0,
            shards: vec![],
            total_bytes: 0,
        })
    }

    pub fn add(&mut self, name: &str, tensor: &Tensor) -> Result<()> {
        let t = tensor.to_dtype(self.dtype)?;
        let bytes = t.elem_count() * self.dtype.size_in_bytes();
        if self.pending_bytes > 0 && self.pending_bytes + bytes > self.max_shard_bytes {
            self.flush()?;
        }
        self.pending_bytes += bytes;
        self.total_bytes += bytes;
        self.pending.insert(name.to_string(), t);
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let name = format!("part-{}.safetensors", self.shards.len());
        let mut names: Vec<String> = self.pending.keys().cloned().collect();
        names.sort();
        self.staged.write_safetensors(&name, &self.pending)?;
        self.shards.push((name, names));
        self.pending.clear();
        self.pending_bytes = 0;
        Ok(())
    }

    /// Writes the side files (`name -> bytes`; `config.json` among them is written last),
    /// names the shards, and moves everything into place.
    pub fn finish(mut self, side_files: &[(String, Vec<u8>)]) -> Result<PathBuf> {
        self.flush()?;
        let n = self.shards.len();
        let mut renames = vec![];
        let mut weight_map = BTreeMap::new();
        for (k, (tmp, names)) in self.shards.iter().enumerate() {
            let final_name =
                if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{:05}.safetensors", k + 1, n) };
            for t in names {
                weight_map.insert(t.clone(), json!(final_name));
            }
            renames.push((tmp.clone(), final_name));
        }
        if n > 1 {
            self.staged.write_json(
                "model.safetensors.index.json",
                &json!({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}),
            )?;
            renames.push(("model.safetensors.index.json".into(), "model.safetensors.index.json".into()));
        }
        let mut config = None;
        for (name, bytes) in side_files {
            self.staged.write_bytes(name, bytes)?;
            if name == "config.json" {
                config = Some(name.clone());
            } else {
                renames.push((name.clone(), name.clone()));
            }
        }
        if let Some(c) = config {
            renames.push((c.clone(), c));
        }
        // Stale weights of an earlier export would mix with these: remove them first.
        for old in ["model.safetensors", "model.safetensors.index.json", "config.json"] {
            let _ = std::fs::remove_file(self.dest.join(old));
        }
        for (from, to) in renames {
            std::fs::rename(self.staged.path().join(&from), self.dest.join(&to))
                .with_context(|| format!("moving {from} into {}", self.dest.display()))?;
        }
        Ok(self.dest.clone())
    }
}

/// "5GB", "500MB", "10KB" or a byte count, as transformers' `max_shard_size`.
pub fn parse_size(s: &str) -> Result<usize> {
    let t = s.trim().to_ascii_uppercase();
    let (num, mult) = if let Some(n) = t.strip_suffix("GB") {
        (n, 1_000_000_000)
    } else if let Some(n) = t.strip_suffix("MB") {
        (n, 1_000_000)
    } else if let Some(n) = t.strip_suffix("KB") {
        (n, 1_000)
    } else {
        (t.as_str(), 1)
    };
    let v: f64 = num.trim().parse().map_err(|_| anyhow::anyhow!("size {s:?}: use e.g. 5GB, 500MB or a byte count"))?;
    if v <= 0.0 {
        anyhow::bail!("size {s:?} must be positive");
    }
    Ok((v * mult as f64) as usize)
}
