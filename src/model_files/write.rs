//! Writing model directories so that nothing half-written is ever left behind: everything goes
//! into a temporary sibling directory, is fsynced, and is renamed into place at the end.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::Tensor;

/// A directory being written. Dropped without `commit`, it removes itself.
pub struct StagedDir {
    tmp: PathBuf,
    dest: PathBuf,
    committed: bool,
}

impl StagedDir {
    /// Stages a new directory for `dest`. Refuses a `dest` that exists and is not empty, so a
    /// user's files are never replaced by surprise.
    pub fn new(dest: &Path) -> Result<Self> {
        if dest.exists() {
            let empty = dest.is_dir() && std::fs::read_dir(dest)?.next().is_none();
            if !empty {
                bail!("{} already exists and is not empty; choose another --out or remove it", dest.display());
            }
        }
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent).with_context(|| format!("creating {}", parent.display()))?;
        let name = dest.file_name().context("output path has no final component")?.to_string_lossy().to_string();
        let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp)?;
        }
        std::fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        Ok(Self { tmp, dest: dest.to_path_buf(), committed: false })
    }

    pub fn path(&self) -> &Path {
        &self.tmp
    }

    pub fn write_bytes(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let path = self.tmp.join(name);
        let mut f = std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        f.write_all(bytes).with_context(|| format!("writing {}", path.display()))?;
        f.sync_all()?;
        Ok(())
    }

    pub fn write_json(&self, name: &str, value: &serde_json::Value) -> Result<()> {
        let mut text = serde_json::to_string_pretty(value)?;
        text.push('\n');
        self.write_bytes(name, text.as_bytes())
    }

    pub fn write_safetensors(&self, name: &str, tensors: &HashMap<String, Tensor>) -> Result<()> {
        let path = self.tmp.join(name);
        let mut metadata = HashMap::new();
        // transformers checks this key when loading safetensors.
        metadata.insert("format".to_string(), "pt".to_string());
        let views: Vec<(String, TensorBytes)> =
            tensors.iter().map(|(k, t)| Ok((k.clone(), TensorBytes::new(t)?))).collect::<Result<_>>()?;
        safetensors::serialize_to_file(views, Some(metadata), &path).map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
        std::fs::File::open(&path)?.sync_all()?;
        Ok(())
    }

    /// Renames the staged directory into place.
    pub fn commit(mut self) -> Result<PathBuf> {
        if self.dest.exists() {
            std::fs::remove_dir(&self.dest).with_context(|| format!("replacing empty {}", self.dest.display()))?;
        }
        std::fs::rename(&self.tmp, &self.dest).with_context(|| format!("renaming {} to {}", self.tmp.display(), self.dest.display()))?;
        if let Some(parent) = self.dest.parent() {
            // fsync the parent so the rename itself survives a crash.
            if let Ok(d) = std::fs::File::open(if parent.as_os_str().is_empty() { Path::new(".") } else { parent }) {
                let _ = d.sync_all();
            }
        }
        self.committed = true;
        Ok(self.dest.clone())
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}

/// A tensor's bytes in the layout safetensors wants (row-major, little endian).
struct TensorBytes {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl TensorBytes {
    fn new(t: &Tensor) -> Result<Self> {
        use candle_core::DType;
        // On a GPU, reading a view copies its whole storage to the host first (candle's
        // `to_vec1`): the export's 1M-value pieces of a 1.1B model's parameters moved 87 GB
        // device -> host on an H200. A compact copy on the device moves only the view.
        let t = if t.device().is_cpu() { t.contiguous()? } else { t.force_contiguous()? };
        let shape = t.dims().to_vec();
        let flat = t.flatten_all()?;
        let (dtype, data) = match t.dtype() {
            DType::F32 => (safetensors::Dtype::F32, bytes_of(&flat.to_vec1::<f32>()?)),
            DType::BF16 => (safetensors::Dtype::BF16, bytes_of(&flat.to_vec1::<half::bf16>()?)),
            DType::F16 => (safetensors::Dtype::F16, bytes_of(&flat.to_vec1::<half::f16>()?)),
            other => bail!("cannot write dtype {other:?} to safetensors here"),
        };
        Ok(Self { dtype, shape, data })
    }
}

/// A tensor's safetensors dtype and little-endian bytes.
pub(crate) fn tensor_le_bytes(t: &Tensor) -> Result<(safetensors::Dtype, Vec<u8>)> {
    let b = TensorBytes::new(t)?;
    Ok((b.dtype, b.data))
}

fn bytes_of<T: Copy>(v: &[T]) -> Vec<u8> {
    // SAFETY: f32/bf16/f16 are plain old data; x86-64 and aarch64 are little endian like the format.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }.to_vec()
}

impl safetensors::View for TensorBytes {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}
