//! Turns `--model` (a local directory or a Hub id) into the list of files a model needs.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::hub::HubRepo;

pub use super::files::*;
use super::files::{OPTIONAL_FILES, PICKLE_WEIGHTS};

/// Distinguishes a Hub id (`org/name` or `name`) from a path. Anything that exists on disk, starts
/// like a path, or has more than one `/` is a path.
fn looks_like_hub_id(model: &str) -> bool {
    !Path::new(model).exists()
        && !model.starts_with(['/', '.', '~'])
        && model.matches('/').count() <= 1
        && !model.is_empty()
        && model.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
}

/// `org/name:FILE.gguf`, a GGUF file of a Hub repository (as `repo:file` in llama.cpp's
/// `--hf-repo`/`--hf-file` pair), split in two.
fn hub_gguf(model: &str) -> Option<(&str, &str)> {
    let (repo, file) = model.split_once(':')?;
    let file_ok = super::gguf::is_gguf_name(file) && !file.starts_with('/') && !file.split('/').any(|p| p == ".." || p.is_empty());
    (looks_like_hub_id(repo) && file_ok).then_some((repo, file))
}

pub fn resolve_model(model: &str, revision: Option<&str>) -> Result<ModelFiles> {
    if let Some((repo_id, file)) = hub_gguf(model) {
        let repo = HubRepo::open(repo_id, revision.unwrap_or("main"))?;
        eprintln!("resolving {file} of {} (cache {})", repo.description(), repo.cache_path().display());
        let path = repo.get(file)?;
        return super::gguf::resolve_gguf(&path, format!("{}:{file}", repo.description()));
    }
    if super::gguf::is_gguf_name(model) && !Path::new(model).exists() {
        // A GGUF file's name is never a Hub repository's: the Hub is not where this one is.
        bail!("{model}: no such GGUF file (a Hub repository's GGUF file is named as org/name:FILE.gguf)");
    }
    if looks_like_hub_id(model) {
        resolve_hub(model, revision.unwrap_or("main"))
    } else {
        if revision.is_some() {
            bail!("--revision applies to Hub ids only; {model} is a local path");
        }
        resolve_local(Path::new(model))
    }
}

fn pickle_refusal(what: &str, found: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "{what} has only pickle weights ({found}); fsdp-app refuses pickle files because loading one can run \
         arbitrary code. Convert them to safetensors first, e.g. `python -c \"from transformers import \
         AutoModelForCausalLM as M; M.from_pretrained('SRC').save_pretrained('DST')\"` (safetensors is the \
         default), then pass the new directory"
    )
}

/// Weight files listed by `model.safetensors.index.json`, unique, in order of first appearance.
pub fn index_weight_files(index_path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index_path).with_context(|| format!("reading {}", index_path.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", index_path.display()))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .with_context(|| format!("{}: missing field `weight_map`", index_path.display()))?;
    let mut files: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let file = file.as_str().with_context(|| format!("{}: weight_map entry {tensor:?} is not a file name", index_path.display()))?;
        if file.contains("..") || file.starts_with('/') {
            bail!("{}: weight_map entry {tensor:?} points outside the model directory: {file}", index_path.display());
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
    }
    files.sort();
    Ok(files)
}

fn resolve_local(dir: &Path) -> Result<ModelFiles> {
    if !dir.exists() {
        bail!("model directory {} does not exist", dir.display());
    }
    if dir.is_file() {
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if name.ends_with(".bin") || name.ends_with(".pt") || name.ends_with(".pth") || name.ends_with(".ckpt") {
            return Err(pickle_refusal(&dir.display().to_string(), name));
        }
        if super::gguf::is_gguf_name(name) {
            return super::gguf::resolve_gguf(dir, dir.display().to_string());
        }
        bail!(
            "{} is a file; --model takes a model directory (holding config.json and safetensors), a GGUF file or a Hub id",
            dir.display()
        );
    }
    let config = dir.join(CONFIG);
    if !config.is_file() {
        bail!("{}: missing config.json", dir.display());
    }
    let index_path = dir.join(WEIGHTS_INDEX);
    let (weights, index) = if index_path.is_file() {
        let files = index_weight_files(&index_path)?;
        let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
        for p in &paths {
            if !p.is_file() {
                bail!("{} lists {} but that file is missing", index_path.display(), p.display());
            }
        }
        (paths, Some(index_path))
    } else if dir.join(SINGLE_WEIGHTS).is_file() {
        (vec![dir.join(SINGLE_WEIGHTS)], None)
    } else {
        if let Some(p) = PICKLE_WEIGHTS.iter().find(|p| dir.join(p).exists()) {
            return Err(pickle_refusal(&dir.display().to_string(), p));
        }
        bail!("{}: no model.safetensors or model.safetensors.index.json", dir.display());
    };
    let mut files = ModelFiles {
        source: dir.display().to_string(),
        config,
        weights,
        index,
        tokenizer: None,
        tokenizer_config: None,
        generation_config: None,
        chat_template: None,
        special_tokens_map: None,
        st_modules: None,
        st_pooling: None,
        format: WeightFormat::Safetensors,
    };
    for name in OPTIONAL_FILES {
        let p = dir.join(name);
        files.set_optional(name, p.is_file().then_some(p));
    }
    if files.st_modules.is_some() {
        let p = dir.join(ST_POOLING);
        files.set_optional(ST_POOLING, p.is_file().then_some(p));
    }
    Ok(files)
}

fn resolve_hub(repo_id: &str, revision: &str) -> Result<ModelFiles> {
    let repo = HubRepo::open(repo_id, revision)?;
    let mode = if repo.is_offline() { "offline, from the cache" } else { "Hub" };
    eprintln!("resolving {} ({mode}, cache {})", repo.description(), repo.cache_path().display());
    let config = repo.get(CONFIG)?;
    let (weights, index) = match repo.get_optional(WEIGHTS_INDEX)? {
        Some(index_path) => {
            let files = index_weight_files(&index_path)?;
            let paths = files.iter().map(|f| repo.get(f)).collect::<Result<Vec<_>>>()?;
            (paths, Some(index_path))
        }
        None => match repo.get_optional(SINGLE_WEIGHTS)? {
            Some(p) => (vec![p], None),
            None if repo.is_offline() => bail!("{}: no safetensors weights in the cache and HF_HUB_OFFLINE is set", repo.description()),
            None => bail!(
                "{} has no model.safetensors or model.safetensors.index.json; pickle weights are refused \
                 because loading them can run arbitrary code",
                repo.description()
            ),
        },
    };
    let mut files = ModelFiles {
        source: repo.description(),
        config,
        weights,
        index,
        tokenizer: None,
        tokenizer_config: None,
        generation_config: None,
        chat_template: None,
        special_tokens_map: None,
        st_modules: None,
        st_pooling: None,
        format: WeightFormat::Safetensors,
    };
    for name in OPTIONAL_FILES {
        files.set_optional(name, repo.get_optional(name)?);
    }
    if files.st_modules.is_some() {
        files.set_optional(ST_POOLING, repo.get_optional(ST_POOLING)?);
    }
    Ok(files)
}
