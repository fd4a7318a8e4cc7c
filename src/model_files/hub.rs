//! Downloads from the Hugging Face Hub with the hf-hub client, honouring the same environment
//! variables and cache layout as the Python `huggingface_hub` client:
//! `HF_ENDPOINT`, `HF_HOME`, `HF_HUB_CACHE`, `HF_TOKEN`, `HF_HUB_OFFLINE`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Repo, RepoType};

pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// The hub cache directory: `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = non_empty_env("HF_HUB_CACHE") {
        return PathBuf::from(dir);
    }
    let home = non_empty_env("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
        home.join(".cache").join("huggingface")
    });
    home.join("hub")
}

/// `HF_TOKEN`, else the token file the Python client writes at `HF_HOME/token`.
fn token() -> Option<String> {
    if let Some(t) = non_empty_env("HF_TOKEN") {
        return Some(t);
    }
    let home = non_empty_env("HF_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("huggingface")))?;
    let t = std::fs::read_to_string(home.join("token")).ok()?;
    let t = t.trim();
    (!t.is_empty()).then(|| t.to_string())
}

pub fn offline() -> bool {
    matches!(std::env::var("HF_HUB_OFFLINE").unwrap_or_default().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
}

fn non_empty_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

pub fn endpoint() -> String {
    non_empty_env("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.to_string()).trim_end_matches('/').to_string()
}

/// A model repository at one revision, either online (download on demand) or offline (cache only).
pub struct HubRepo {
    repo_type: RepoType,
    repo_id: String,
    revision: String,
    online: Option<ApiRepo>,
    cache: PathBuf,
}

impl HubRepo {
    pub fn open(repo_id: &str, revision: &str) -> Result<Self> {
        Self::open_typed(RepoType::Model, repo_id, revision)
    }

    /// A dataset repository (`datasets--org--name` in the cache).
    pub fn open_dataset(repo_id: &str, revision: &str) -> Result<Self> {
        Self::open_typed(RepoType::Dataset, repo_id, revision)
    }

    fn open_typed(repo_type: RepoType, repo_id: &str, revision: &str) -> Result<Self> {
        let cache = cache_dir();
        let online = if offline() {
            None
        } else {
            let api = ApiBuilder::from_cache(hf_hub::Cache::new(cache.clone()))
                .with_endpoint(endpoint())
                .with_token(token())
                .with_progress(true)
                .build()
                .context("creating the Hugging Face Hub client")?;
            Some(api.repo(Repo::with_revision(repo_id.to_string(), repo_type, revision.to_string())))
        };
        Ok(Self { repo_type, repo_id: repo_id.to_string(), revision: revision.to_string(), online, cache })
    }

    /// `models--org--name` (or `datasets--...`) under the cache, as the Python client names it.
    fn repo_cache_dir(&self) -> PathBuf {
        let kind = match self.repo_type {
            RepoType::Dataset => "datasets",
            RepoType::Space => "spaces",
            _ => "models",
        };
        self.cache.join(format!("{kind}--{}", self.repo_id.replace('/', "--")))
    }

    /// The snapshot directory for the revision, if the cache knows it.
    fn cached_snapshot(&self) -> Option<PathBuf> {
        let dir = self.repo_cache_dir();
        let commit = match std::fs::read_to_string(dir.join("refs").join(&self.revision)) {
            Ok(c) => c.trim().to_string(),
            // A revision given as a commit hash has no ref file.
            Err(_) if self.revision.len() == 40 && self.revision.chars().all(|c| c.is_ascii_hexdigit()) => self.revision.clone(),
            Err(_) => return None,
        };
        Some(dir.join("snapshots").join(commit))
    }

    fn cached(&self, file: &str) -> Option<PathBuf> {
        self.cached_snapshot().map(|s| s.join(file)).filter(|p| p.exists())
    }

    /// Path of `file` in the local cache, downloading it first when online and not cached.
    /// `Ok(None)` when the file does not exist in the repository (or, offline, is not cached).
    pub fn get_optional(&self, file: &str) -> Result<Option<PathBuf>> {
        if let Some(p) = self.cached(file) {
            return Ok(Some(p));
        }
        let Some(api) = &self.online else { return Ok(None) };
        match api.get(file) {
            Ok(p) => Ok(Some(p)),
            Err(ApiError::RequestError(e)) if matches!(*e, ureq::Error::Status(404, _)) => Ok(None),
            Err(e) => Err(anyhow::anyhow!("downloading {file} of {} (revision {}) from {}: {e}", self.repo_id, self.revision, endpoint())),
        }
    }

    pub fn get(&self, file: &str) -> Result<PathBuf> {
        match self.get_optional(file)? {
            Some(p) => Ok(p),
            None if self.online.is_none() => bail!(
                "{file} of {} (revision {}) is not in the cache at {} and HF_HUB_OFFLINE is set",
                self.repo_id,
                self.revision,
                self.cache.display()
            ),
            None => bail!("{file} does not exist in {} (revision {})", self.repo_id, self.revision),
        }
    }

    pub fn description(&self) -> String {
        format!("{}@{}", self.repo_id, self.revision)
    }

    pub fn is_offline(&self) -> bool {
        self.online.is_none()
    }

    pub fn cache_path(&self) -> &Path {
        &self.cache
    }
}
