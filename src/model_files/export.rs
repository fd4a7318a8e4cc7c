//! Writing a full Hugging Face model directory a unit at a time, never the whole model in
//! memory: every tensor's file and byte range are fixed up front from the list of names and
//! shapes (`model-0000k-of-0000n.safetensors`, split at `max_shard_bytes`, with
//! `model.safetensors.index.json`; a single `model.safetensors` when everything fits), so each
//! gathered tensor is written straight to its place and dropped. config.json is moved in last,
//! so a directory interrupted half-way is never taken for a model.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use serde_json::{json, Value};

use super::write::{tensor_le_bytes, StagedDir};

/// Values converted and written at a time by [`ShardedExport::add`] (4 MiB of f32).
const WRITE_PIECE: usize = 1 << 20;

struct Placement {
    file: usize,
    /// Absolute byte offset of the tensor's data in its file.
    offset: u64,
    len: u64,
}

struct ShardFile {
    tmp_name: String,
    final_name: String,
    file: File,
    names: Vec<String>,
}

pub struct ShardedExport {
    staged: StagedDir,
    dest: PathBuf,
    dtype: DType,
    placements: HashMap<String, Placement>,
    files: Vec<ShardFile>,
    written: usize,
    total_bytes: u64,
}

/// config.json saying the dtype the tensors were written in (`torch_dtype`, and `dtype` as
/// transformers 5 writes it), so transformers loads them as they are instead of upcasting.
fn config_with_dtype(bytes: &[u8], dtype: DType) -> Result<Vec<u8>> {
    let mut config: Value = serde_json::from_slice(bytes).context("config.json of the export is not JSON")?;
    let name = match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F32 => "float32",
        other => bail!("cannot export dtype {other:?}"),
    };
    let obj = config.as_object_mut().context("config.json of the export is not a JSON object")?;
    obj.insert("torch_dtype".into(), json!(name));
    if obj.contains_key("dtype") {
        obj.insert("dtype".into(), json!(name));
    }
    Ok(serde_json::to_vec_pretty(&config)?)
}

fn st_dtype(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "F32",
        DType::BF16 => "BF16",
        DType::F16 => "F16",
        other => bail!("cannot export dtype {other:?}"),
    })
}

impl ShardedExport {
    /// Lays out `tensors` (names and shapes, in the order they will be added) into files of at
    /// most `max_shard_bytes` (a tensor larger than that gets a file of its own) under a staging
    /// directory inside `dest` (created if needed).
    pub fn new(dest: &Path, dtype: DType, max_shard_bytes: usize, tensors: &[(String, Vec<usize>)]) -> Result<Self> {
        std::fs::create_dir_all(dest).with_context(|| format!("creating {}", dest.display()))?;
        let staged = StagedDir::new(&dest.join(".export"))?;
        let elem = dtype.size_in_bytes() as u64;
        // Greedy split, in order.
        let mut groups: Vec<Vec<(String, Vec<usize>)>> = vec![];
        let mut size = 0u64;
        for (name, shape) in tensors {
            let bytes = shape.iter().product::<usize>() as u64 * elem;
            if groups.is_empty() || (size > 0 && size + bytes > max_shard_bytes as u64) {
                groups.push(vec![]);
                size = 0;
            }
            groups.last_mut().unwrap().push((name.clone(), shape.clone()));
            size += bytes;
        }
        let n = groups.len();
        let mut placements = HashMap::new();
        let mut files = vec![];
        let mut total_bytes = 0;
        for (k, group) in groups.into_iter().enumerate() {
            let final_name = if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", k + 1) };
            let mut header = serde_json::Map::new();
            header.insert("__metadata__".into(), json!({"format": "pt"}));
            let mut rel = 0u64;
            let mut names = vec![];
            for (name, shape) in &group {
                let len = shape.iter().product::<usize>() as u64 * elem;
                header.insert(name.clone(), json!({"dtype": st_dtype(dtype)?, "shape": shape, "data_offsets": [rel, rel + len]}));
                rel += len;
                names.push(name.clone());
            }
            let mut header = serde_json::to_vec(&Value::Object(header))?;
            // Pad the header to 8 bytes, as the safetensors library does, so data is aligned.
            while header.len() % 8 != 0 {
                header.push(b' ');
            }
            let data_start = 8 + header.len() as u64;
            let mut r = 0u64;
            for (name, shape) in &group {
                let len = shape.iter().product::<usize>() as u64 * elem;
                placements.insert(name.clone(), Placement { file: k, offset: data_start + r, len });
                r += len;
            }
            total_bytes += rel;
            let tmp_name = format!("part-{k}.safetensors");
            let path = staged.path().join(&tmp_name);
            let mut file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
            file.write_all(&(header.len() as u64).to_le_bytes())?;
            file.write_all(&header)?;
            file.set_len(data_start + rel)?;
            files.push(ShardFile { tmp_name, final_name, file, names });
        }
        Ok(Self { staged, dest: dest.to_path_buf(), dtype, placements, files, written: 0, total_bytes })
    }

    /// Writes one tensor to its place, [`WRITE_PIECE`] values at a time: a whole tensor's bytes
    /// were two extra copies of it (an embedding's 128 MiB twice), which made the exporting rank
    /// the heaviest of a run.
    pub fn add(&mut self, name: &str, tensor: &Tensor) -> Result<()> {
        let p = self.placements.get(name).with_context(|| format!("export: {name} was not announced"))?;
        let flat = tensor.flatten_all()?;
        let count = flat.elem_count();
        let width = self.dtype.size_in_bytes();
        if (count * width) as u64 != p.len {
            bail!("export: {name} has {} bytes, its place has {}", count * width, p.len);
        }
        let mut at = 0;
        while at < count {
            let n = WRITE_PIECE.min(count - at);
            let (_, bytes) = tensor_le_bytes(&flat.narrow(0, at, n)?.to_dtype(self.dtype)?)?;
            self.files[p.file].file.write_all_at(&bytes, p.offset + (at * width) as u64)?;
            at += n;
        }
        self.written += 1;
        Ok(())
    }

    /// Writes the side files (`name -> bytes`; `config.json` among them goes in last), the
    /// index, and moves everything into place.
    pub fn finish(self, side_files: &[(String, Vec<u8>)]) -> Result<PathBuf> {
        if self.written != self.placements.len() {
            bail!("export: {} of {} tensors were written", self.written, self.placements.len());
        }
        let mut renames = vec![];
        let mut weight_map = BTreeMap::new();
        for f in &self.files {
            f.file.sync_all()?;
            for t in &f.names {
                weight_map.insert(t.clone(), json!(f.final_name));
            }
            renames.push((f.tmp_name.clone(), f.final_name.clone()));
        }
        if self.files.len() > 1 {
            self.staged.write_json(
                "model.safetensors.index.json",
                &json!({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}),
            )?;
            renames.push(("model.safetensors.index.json".into(), "model.safetensors.index.json".into()));
        }
        let mut config = None;
        for (name, bytes) in side_files {
            if name == "config.json" {
                self.staged.write_bytes(name, &config_with_dtype(bytes, self.dtype)?)?;
            } else {
                self.staged.write_bytes(name, bytes)?;
            }
            if name == "config.json" {
                config = Some(name.clone());
            } else {
                renames.push((name.clone(), name.clone()));
            }
        }
        if let Some(c) = config {
            renames.push((c.clone(), c));
        }
        // Weights of an earlier export would mix with these: remove them first.
        if let Ok(entries) = std::fs::read_dir(&self.dest) {
            for e in entries.flatten() {
                let n = e.file_name().to_string_lossy().to_string();
                if n == "config.json" || n == "model.safetensors.index.json" || (n.starts_with("model") && n.ends_with(".safetensors")) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
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
        bail!("size {s:?} must be positive");
    }
    Ok((v * mult as f64) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn streamed_shards_load_back_with_an_index() {
        let dir = tempfile::tempdir().unwrap();
        let tensors: Vec<(String, Vec<usize>)> = vec![("a".into(), vec![3, 4]), ("b".into(), vec![5]), ("c".into(), vec![2, 2])];
        let mut ex = ShardedExport::new(dir.path(), DType::F32, 60, &tensors).unwrap();
        let vals: HashMap<&str, Tensor> = [
            ("a", Tensor::arange(0f32, 12.0, &Device::Cpu).unwrap().reshape((3, 4)).unwrap()),
            ("b", Tensor::arange(0f32, 5.0, &Device::Cpu).unwrap()),
            ("c", Tensor::arange(0f32, 4.0, &Device::Cpu).unwrap().reshape((2, 2)).unwrap()),
        ]
        .into_iter()
        .collect();
        for (n, _) in &tensors {
            ex.add(n, &vals[n.as_str()]).unwrap();
        }
        ex.finish(&[("config.json".into(), b"{}".to_vec())]).unwrap();
        let index: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join("model.safetensors.index.json")).unwrap()).unwrap();
        assert_eq!(index["weight_map"]["a"], "model-00001-of-00002.safetensors");
        assert_eq!(index["weight_map"]["c"], "model-00002-of-00002.safetensors");
        for (n, t) in &vals {
            let file = index["weight_map"][*n].as_str().unwrap();
            let back = candle_core::safetensors::load(dir.path().join(file), &Device::Cpu).unwrap();
            assert_eq!(back[*n].flatten_all().unwrap().to_vec1::<f32>().unwrap(), t.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        }
        assert!(!dir.path().join(".export").exists());
    }
}
