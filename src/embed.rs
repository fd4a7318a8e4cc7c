//! Embeddings from a causal LM's architecture: the final norm's hidden states of a text pooled
//! into one vector (the last token's, as Qwen3-Embedding, e5-mistral and gte-Qwen2 are trained;
//! the mean; or the first token's). The server scales them to unit length, as sentence-transformers
//! and vLLM return them, or as llama.cpp's `embd_normalize` asks ([`normalize_by`]).
//!
//! The pooling comes from the model's sentence-transformers files when it has them
//! (`modules.json` naming a `Pooling` module, whose `config.json` sets one `pooling_mode_*`),
//! else last-token (a causal LM's only position that has seen the whole text); `serve --pooling`
//! overrides both.

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use models::CausalLm;
use serde_json::Value;

use crate::model_files::ModelFiles;

/// How a text's hidden states become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The last position's state.
    Last,
    /// The mean over every position.
    Mean,
    /// The first position's state.
    Cls,
}

impl Pooling {
    /// `--pooling`'s names (vLLM's `--pooler-config` pooling types, lower-cased).
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "last" => Ok(Self::Last),
            "mean" => Ok(Self::Mean),
            "cls" => Ok(Self::Cls),
            other => Err(format!("unknown pooling {other:?}: last, mean or cls")),
        }
    }

    /// The pooling the model's sentence-transformers files name, if it has them.
    pub fn of_model(files: &ModelFiles) -> Result<Option<Self>> {
        let Some(modules) = &files.st_modules else { return Ok(None) };
        let list: Vec<Value> =
            read_json(modules)?.as_array().cloned().with_context(|| format!("{}: not a list of modules", modules.display()))?;
        let mut pooling = None;
        for (i, m) in list.iter().enumerate() {
            let kind = m.get("type").and_then(Value::as_str).unwrap_or_default();
            match kind.rsplit('.').next().unwrap_or_default() {
                "Transformer" | "Normalize" => {}
                "Pooling" => {
                    let config = files.st_pooling.as_deref().with_context(|| {
                        format!("{}: module {i} is a Pooling module; its settings must be in 1_Pooling/config.json", modules.display())
                    })?;
                    pooling = Some(Self::of_config(config)?);
                }
                _ => bail!("{}: module {i} is {kind:?}; only Transformer, Pooling and Normalize modules are supported", modules.display()),
            }
        }
        Ok(pooling)
    }

    /// The one `pooling_mode_*` set in a Pooling module's `config.json`.
    fn of_config(path: &Path) -> Result<Self> {
        let v = read_json(path)?;
        let set = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(false);
        let modes =
            [("pooling_mode_lasttoken", Self::Last), ("pooling_mode_mean_tokens", Self::Mean), ("pooling_mode_cls_token", Self::Cls)];
        let chosen: Vec<Self> = modes.iter().filter(|(k, _)| set(k)).map(|(_, p)| *p).collect();
        for k in ["pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens"] {
            if set(k) {
                bail!(
                    "{}: `{k}` is not supported (pooling_mode_lasttoken, pooling_mode_mean_tokens or pooling_mode_cls_token)",
                    path.display()
                );
            }
        }
        match chosen[..] {
            [one] => Ok(one),
            [] => bail!("{}: no pooling_mode_* is true", path.display()),
            _ => bail!(
                "{}: more than one pooling_mode_* is true (sentence-transformers would concatenate them; not supported)",
                path.display()
            ),
        }
    }
}

/// The embedding sizes a Matryoshka model may be cut to, from its config.json as vLLM reads them:
/// `matryoshka_dimensions`, or any size with `is_matryoshka: true` (an empty list); None for a
/// model that has only its full size.
pub fn matryoshka_sizes(config: &Path) -> Result<Option<Vec<usize>>> {
    let v = read_json(config)?;
    if let Some(list) = v.get("matryoshka_dimensions").filter(|l| !l.is_null()) {
        let sizes = list.as_array().and_then(|a| a.iter().map(|x| x.as_u64().map(|n| n as usize)).collect::<Option<Vec<_>>>());
        return sizes.map(Some).with_context(|| format!("{}: `matryoshka_dimensions` must be a list of sizes", config.display()));
    }
    Ok(v.get("is_matryoshka").and_then(Value::as_bool).unwrap_or(false).then(Vec::new))
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))
}

/// One text's token ids pooled into one vector, as the model computes it (not scaled).
pub fn pooled(model: &CausalLm, ids: &[u32], pooling: Pooling) -> Result<Vec<f32>> {
    let input = Tensor::new(ids, model.device())?.unsqueeze(0)?;
    let hidden = model.final_hidden(&input)?.squeeze(0)?.to_dtype(DType::F32)?;
    let pooled = match pooling {
        Pooling::Last => hidden.get(ids.len() - 1)?,
        Pooling::Cls => hidden.get(0)?,
        Pooling::Mean => hidden.mean(0)?,
    };
    Ok(pooled.to_vec1::<f32>()?)
}

/// Scales `v` to unit length (a zero vector stays zero), as sentence-transformers' `Normalize`.
pub fn normalize(v: &mut [f32]) {
    let norm = v.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x = (*x as f64 / norm) as f32);
    }
}

/// Scales `v` as llama.cpp's `embd_normalize` says (`common_embd_normalize`): -1 not at all, 0 so
/// that its largest magnitude is 32760 (the int16 range), 2 to unit Euclidean length, any other
/// p to unit p-norm (1: taxicab). A zero vector stays zero.
pub fn normalize_by(v: &mut [f32], p: i64) {
    let values = || v.iter().map(|x| (*x as f64).abs());
    let norm = match p {
        -1 => return,
        0 => values().fold(0.0, f64::max) / 32760.0,
        2 => values().map(|x| x * x).sum::<f64>().sqrt(),
        p => values().map(|x| x.powi(p as i32)).sum::<f64>().powf(1.0 / p as f64),
    };
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x = (*x as f64 / norm) as f32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files_with(dir: &Path, modules: &str, pooling: Option<&str>) -> ModelFiles {
        std::fs::write(dir.join("modules.json"), modules).unwrap();
        let pooling_path = pooling.map(|p| {
            std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
            std::fs::write(dir.join("1_Pooling/config.json"), p).unwrap();
            dir.join("1_Pooling/config.json")
        });
        ModelFiles {
            source: dir.display().to_string(),
            config: dir.join("config.json"),
            weights: vec![],
            index: None,
            tokenizer: None,
            tokenizer_config: None,
            generation_config: None,
            chat_template: None,
            special_tokens_map: None,
            st_modules: Some(dir.join("modules.json")),
            st_pooling: pooling_path,
            format: Default::default(),
        }
    }

    #[test]
    fn pooling_comes_from_the_sentence_transformers_files() {
        let dir = tempfile::tempdir().unwrap();
        let st = r#"[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                     {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                     {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]"#;
        let mean = files_with(dir.path(), st, Some(r#"{"pooling_mode_mean_tokens": true, "pooling_mode_lasttoken": false}"#));
        assert_eq!(Pooling::of_model(&mean).unwrap(), Some(Pooling::Mean));
        let max = files_with(dir.path(), st, Some(r#"{"pooling_mode_max_tokens": true}"#));
        assert!(format!("{:#}", Pooling::of_model(&max).unwrap_err()).contains("pooling_mode_max_tokens"));
        let dense = r#"[{"idx": 0, "type": "sentence_transformers.models.Dense", "path": "2_Dense"}]"#;
        assert!(format!("{:#}", Pooling::of_model(&files_with(dir.path(), dense, None)).unwrap_err()).contains("Dense"));
        let mut v = vec![3.0, 4.0];
        normalize(&mut v);
        assert_eq!(v, [0.6, 0.8]);
    }

    #[test]
    fn normalize_by_follows_llama_cpps_embd_normalize() {
        let scaled = |p: i64| {
            let mut v = vec![3.0f32, -4.0, 0.0];
            normalize_by(&mut v, p);
            v
        };
        assert_eq!(scaled(-1), [3.0, -4.0, 0.0]);
        assert_eq!(scaled(0), [24570.0, -32760.0, 0.0]);
        assert_eq!(scaled(1), [3.0 / 7.0, -4.0 / 7.0, 0.0]);
        assert_eq!(scaled(2), [0.6, -0.8, 0.0]);
        let cubed = (27.0f64 + 64.0).powf(1.0 / 3.0);
        assert_eq!(scaled(3), [(3.0 / cubed) as f32, (-4.0 / cubed) as f32, 0.0]);
        let mut zero = vec![0.0f32; 3];
        normalize_by(&mut zero, 0);
        assert_eq!(zero, [0.0; 3]);
    }
}
