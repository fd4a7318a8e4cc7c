//! LoRA adapters served over the base model (multi-LoRA): registered by name from a PEFT
//! directory (`serve --lora NAME=DIR`, `POST /v1/load_lora_adapter`), kept in memory up to
//! `--max-loras` (the least recently used is dropped, and read again on its next request), and
//! run by the base model's engine beside the base and each other (`models::multi_lora`): an
//! adapter costs its own tensors, not a model.
//!
//! Run-time loading reads only under `--lora-dir` (none without it), so a request cannot make the
//! server open any file it names.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use axum::http::StatusCode;
use models::{ModelConfig, ServingAdapter};

use super::error::ApiError;
use super::served_model::Placement;

/// Whether `name` may name an adapter: 1 to 128 visible characters, not the base model's id and
/// not in the fine-tuned models' `ft:` namespace.
pub fn check_adapter_name(name: &str, base_id: &str) -> Result<()> {
    if name.is_empty() || name.len() > 128 || name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        anyhow::bail!("adapter name {name:?}: 1 to 128 characters, no spaces");
    }
    if name == base_id || name.starts_with("ft:") {
        anyhow::bail!("adapter name {name:?} is taken: it is the base model's id or in the fine-tuned models' `ft:` namespace");
    }
    Ok(())
}

pub struct Adapters {
    registry: Mutex<Registry>,
    /// Adapters kept in memory at most (`--max-loras`).
    max_loaded: usize,
    /// The only directory `load_lora_adapter` reads under (`--lora-dir`), canonical.
    root: Option<PathBuf>,
    /// The base model's shapes, which every adapter must fit.
    base: ModelConfig,
    placement: Placement,
}

#[derive(Default)]
struct Registry {
    entries: HashMap<String, Entry>,
    /// Ticks on every use: the least recently used loaded adapter has the smallest `last_used`.
    clock: u64,
}

struct Entry {
    dir: PathBuf,
    loaded: Option<Arc<ServingAdapter>>,
    last_used: u64,
    created: u64,
}

/// One registered adapter, as `/v1/models` lists it.
pub struct Listed {
    pub name: String,
    pub dir: PathBuf,
    pub created: u64,
    pub loaded: bool,
}

impl Adapters {
    pub fn new(base: ModelConfig, placement: Placement, max_loaded: usize, root: Option<&Path>) -> Result<Self> {
        let root = root.map(|r| r.canonicalize().with_context(|| format!("--lora-dir {}", r.display()))).transpose()?;
        Ok(Self { registry: Mutex::default(), max_loaded: max_loaded.max(1), root, base, placement })
    }

    /// Reads the adapter at `dir`, checks it against the base, and serves it as `name`. An error
    /// names the file and what is wrong; nothing is registered then.
    pub fn register(&self, name: &str, dir: &Path) -> Result<()> {
        let adapter = self.read(name, dir)?;
        let mut reg = self.registry.lock().unwrap();
        if reg.entries.contains_key(name) {
            anyhow::bail!("an adapter named {name:?} is already loaded");
        }
        reg.clock += 1;
        let last_used = reg.clock;
        let created = super::ids::now_s() as u64;
        reg.entries.insert(name.to_string(), Entry { dir: dir.to_path_buf(), loaded: Some(adapter), last_used, created });
        self.evict(&mut reg);
        Ok(())
    }

    /// Forgets `name`; false when there is none. Requests already running with it finish.
    pub fn unregister(&self, name: &str) -> bool {
        self.registry.lock().unwrap().entries.remove(name).is_some()
    }

    /// The adapter `name`, read again from its directory if it was evicted; None when no adapter
    /// has that name.
    pub fn get(&self, name: &str) -> Option<Result<Arc<ServingAdapter>>> {
        let mut reg = self.registry.lock().unwrap();
        reg.clock += 1;
        let now = reg.clock;
        let entry = reg.entries.get_mut(name)?;
        entry.last_used = now;
        if let Some(a) = &entry.loaded {
            return Some(Ok(a.clone()));
        }
        // Reloaded under the lock: a second request for it waits rather than reading it twice.
        let dir = entry.dir.clone();
        let adapter = match self.read(name, &dir) {
            Ok(a) => a,
            Err(e) => return Some(Err(e)),
        };
        reg.entries.get_mut(name).expect("held under the lock").loaded = Some(adapter.clone());
        self.evict(&mut reg);
        Some(Ok(adapter))
    }

    /// Every registered adapter, by name.
    pub fn list(&self) -> Vec<Listed> {
        let reg = self.registry.lock().unwrap();
        let mut out: Vec<Listed> = reg
            .entries
            .iter()
            .map(|(name, e)| Listed { name: name.clone(), dir: e.dir.clone(), created: e.created, loaded: e.loaded.is_some() })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// `lora_path` of a run-time load, if the path policy lets it be read: an existing directory
    /// under `--lora-dir` (403 without that flag; 400 outside it).
    pub fn allowed_path(&self, lora_path: &str) -> Result<PathBuf, ApiError> {
        let Some(root) = &self.root else {
            let message = "Loading adapters at run time is off; start the server with --lora-dir ROOT to allow adapters under ROOT.";
            return Err(ApiError::new(StatusCode::FORBIDDEN, "permission_error", message).with_code("lora_loading_disabled"));
        };
        let path = Path::new(lora_path);
        let path = if path.is_absolute() { path.to_path_buf() } else { root.join(path) };
        let canonical = path.canonicalize().map_err(|e| ApiError::invalid("lora_path", format!("`lora_path` {}: {e}", path.display())))?;
        if !canonical.starts_with(root) {
            return Err(ApiError::invalid(
                "lora_path",
                format!(
                    "`lora_path` {} is outside --lora-dir {}; only adapters under it may be loaded.",
                    canonical.display(),
                    root.display()
                ),
            ));
        }
        Ok(canonical)
    }

    fn read(&self, name: &str, dir: &Path) -> Result<Arc<ServingAdapter>> {
        let read = crate::model_files::adapter::read_adapter(dir, &self.base)?;
        let p = &self.placement;
        let adapter = ServingAdapter::new(name, &read.settings, read.tensors, p.dtype, &p.device)
            .with_context(|| format!("{}", dir.join(crate::model_files::adapter::ADAPTER_WEIGHTS).display()))?;
        Ok(Arc::new(adapter))
    }

    /// Drops the least recently used loaded adapters beyond `max_loaded` (they stay registered).
    fn evict(&self, reg: &mut Registry) {
        loop {
            let loaded: Vec<(&String, u64)> =
                reg.entries.iter().filter(|(_, e)| e.loaded.is_some()).map(|(n, e)| (n, e.last_used)).collect();
            if loaded.len() <= self.max_loaded {
                return;
            }
            let oldest = loaded.iter().min_by_key(|(_, t)| *t).map(|(n, _)| (*n).clone()).expect("over the limit");
            reg.entries.get_mut(&oldest).expect("listed").loaded = None;
        }
    }
}
