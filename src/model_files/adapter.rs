//! LoRA adapters on disk in PEFT's format: `adapter_model.safetensors` (tensors named
//! `base_model.model.<module>.lora_A.weight`) and `adapter_config.json` (`LoraConfig` fields).
//! PEFT's `PeftModel.from_pretrained` loads what we write, and we load what it writes.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use models::lora::{layer_adapter_tensors, LoraSettings, LINEAR_MODULES};
use models::ModelConfig;
use serde_json::{json, Value};

pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// PEFT's prefix for a causal LM's module names.
const PEFT_PREFIX: &str = "base_model.model.";

/// An adapter read from a directory: its settings and its tensors under our module names
/// (`model.layers.0.self_attn.q_proj.lora_A.weight`).
pub struct Adapter {
    pub settings: LoraSettings,
    pub tensors: HashMap<String, Tensor>,
    pub base_model: Option<String>,
}

/// Parses `adapter_config.json` text; every unsupported PEFT option is refused by name.
pub fn parse_adapter_config(text: &str, source: &Path) -> Result<(LoraSettings, Option<String>)> {
    let v: Value = serde_json::from_str(text).with_context(|| format!("{}: not valid JSON", source.display()))?;
    let field = |k: &str| v.get(k).filter(|x| !x.is_null());
    let bad = |k: &str, why: &str| anyhow::anyhow!("{}: field {k:?} {why}", source.display());
    match field("peft_type").and_then(Value::as_str) {
        Some("LORA") => {}
        other => return Err(bad("peft_type", &format!("is {other:?}; only \"LORA\" adapters are supported"))),
    }
    let r = field("r").and_then(Value::as_u64).ok_or_else(|| bad("r", "must be a positive integer"))? as usize;
    let alpha = field("lora_alpha").and_then(Value::as_f64).ok_or_else(|| bad("lora_alpha", "must be a number"))?;
    let dropout =
        field("lora_dropout").map(|x| x.as_f64().ok_or_else(|| bad("lora_dropout", "must be a number"))).transpose()?.unwrap_or(0.0);
    let targets = match field("target_modules") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string).ok_or_else(|| bad("target_modules", "must hold strings")))
            .collect::<Result<Vec<_>>>()?,
        Some(Value::String(s)) if s == "all-linear" || LINEAR_MODULES.contains(&s.as_str()) => vec![s.clone()],
        Some(Value::String(s)) => {
            return Err(bad("target_modules", &format!("is the regular expression {s:?}; list module names instead")))
        }
        _ => return Err(bad("target_modules", "is missing")),
    };
    for (k, ok) in [
        ("use_dora", field("use_dora").is_none_or(|x| x == &json!(false))),
        ("bias", field("bias").is_none_or(|x| x == &json!("none"))),
        ("fan_in_fan_out", field("fan_in_fan_out").is_none_or(|x| x == &json!(false))),
        ("modules_to_save", field("modules_to_save").is_none_or(|x| x.as_array().is_some_and(|a| a.is_empty()))),
        ("layers_to_transform", field("layers_to_transform").is_none()),
        ("rank_pattern", field("rank_pattern").is_none_or(|x| x.as_object().is_some_and(|o| o.is_empty()))),
        ("alpha_pattern", field("alpha_pattern").is_none_or(|x| x.as_object().is_some_and(|o| o.is_empty()))),
        ("lora_bias", field("lora_bias").is_none_or(|x| x == &json!(false))),
        ("exclude_modules", field("exclude_modules").is_none()),
        ("layer_replication", field("layer_replication").is_none()),
        ("target_parameters", field("target_parameters").is_none()),
        ("trainable_token_indices", field("trainable_token_indices").is_none()),
    ] {
        if !ok {
            return Err(bad(k, &format!("is {}; fsdp-app supports only PEFT's default for it", v[k])));
        }
    }
    let use_rslora = field("use_rslora").and_then(Value::as_bool).unwrap_or(false);
    let base = field("base_model_name_or_path").and_then(Value::as_str).map(str::to_string);
    Ok((LoraSettings { r, alpha, dropout, targets, use_rslora }, base))
}

/// Reads an adapter directory and checks its tensors against `cfg` (missing, unexpected and
/// mis-shaped tensors are listed by name).
pub fn read_adapter(dir: &Path, cfg: &ModelConfig) -> Result<Adapter> {
    let config_path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&config_path)
        .with_context(|| format!("{}: cannot read (is {} a LoRA adapter directory?)", config_path.display(), dir.display()))?;
    let (settings, base_model) = parse_adapter_config(&text, &config_path)?;
    settings.validate(cfg).with_context(|| config_path.display().to_string())?;
    let weights = dir.join(ADAPTER_WEIGHTS);
    let raw = candle_core::safetensors::load(&weights, &Device::Cpu).with_context(|| format!("{}: cannot load", weights.display()))?;
    let mut tensors = HashMap::new();
    for (name, t) in raw {
        // PEFT writes `base_model.model.<module>.lora_A.weight`; older files keep the adapter
        // name (`.lora_A.default.weight`).
        let ours =
            name.strip_prefix(PEFT_PREFIX).unwrap_or(&name).replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.");
        tensors.insert(ours, t.to_dtype(DType::F32)?);
    }
    let expected: BTreeMap<String, Vec<usize>> =
        (0..cfg.num_hidden_layers).flat_map(|i| layer_adapter_tensors(cfg, &settings, i)).map(|t| (t.name, t.shape)).collect();
    let missing: Vec<&String> = expected.keys().filter(|k| !tensors.contains_key(*k)).collect();
    let unexpected: Vec<&String> = tensors.keys().filter(|k| !expected.contains_key(*k)).collect();
    let misshaped: Vec<String> = expected
        .iter()
        .filter_map(|(k, shape)| {
            tensors.get(k).filter(|t| t.dims() != shape.as_slice()).map(|t| format!("{k} is {:?}, expected {shape:?}", t.dims()))
        })
        .collect();
    if !missing.is_empty() || !unexpected.is_empty() || !misshaped.is_empty() {
        let show = |v: Vec<String>| if v.len() > 6 { format!("{} and {} more", v[..6].join(", "), v.len() - 6) } else { v.join(", ") };
        bail!(
            "{}: does not fit the model with r={} and target_modules {:?}: missing [{}], unexpected [{}], wrong shapes [{}]",
            weights.display(),
            settings.r,
            settings.targets,
            show(missing.into_iter().cloned().collect()),
            show(unexpected.into_iter().cloned().collect()),
            show(misshaped)
        );
    }
    Ok(Adapter { settings, tensors, base_model })
}

/// The `adapter_config.json` PEFT would write for these settings.
pub fn adapter_config_json(settings: &LoraSettings, base_model: &str) -> Value {
    // PEFT types lora_alpha as an int; write it as one when it is whole.
    let alpha =
        if settings.alpha.fract() == 0.0 && settings.alpha.abs() < 1e15 { json!(settings.alpha as i64) } else { json!(settings.alpha) };
    // `all-linear` is written resolved, as PEFT's save_pretrained does.
    let targets: Vec<String> = if settings.targets.iter().any(|t| t == "all-linear") {
        LINEAR_MODULES.iter().map(|m| m.to_string()).collect()
    } else {
        settings.targets.clone()
    };
    json!({
        "alpha_pattern": {},
        "auto_mapping": null,
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "layers_pattern": null,
        "layers_to_transform": null,
        "lora_alpha": alpha,
        "lora_dropout": settings.dropout,
        "modules_to_save": null,
        "peft_type": "LORA",
        "r": settings.r,
        "rank_pattern": {},
        "revision": null,
        "target_modules": targets,
        "task_type": "CAUSAL_LM",
        "use_dora": false,
        "use_rslora": settings.use_rslora,
    })
}

/// Writes `adapter_model.safetensors` and `adapter_config.json` into `dir` (created if needed),
/// each to a temporary name first; the config goes in last, so a directory with a config has
/// complete weights.
pub fn write_adapter(dir: &Path, tensors: &HashMap<String, Tensor>, settings: &LoraSettings, base_model: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let peft: HashMap<String, Tensor> = tensors.iter().map(|(k, t)| (format!("{PEFT_PREFIX}{k}"), t.clone())).collect();
    let tmp_weights = dir.join(format!(".{ADAPTER_WEIGHTS}.tmp"));
    candle_core::safetensors::save(&peft, &tmp_weights).with_context(|| format!("writing {}", tmp_weights.display()))?;
    std::fs::File::open(&tmp_weights)?.sync_all()?;
    let tmp_config = dir.join(format!(".{ADAPTER_CONFIG}.tmp"));
    let mut text = serde_json::to_string_pretty(&adapter_config_json(settings, base_model))?;
    text.push('\n');
    std::fs::write(&tmp_config, text).with_context(|| format!("writing {}", tmp_config.display()))?;
    std::fs::rename(&tmp_weights, dir.join(ADAPTER_WEIGHTS))?;
    std::fs::rename(&tmp_config, dir.join(ADAPTER_CONFIG))?;
    Ok(dir.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_peft_options_are_refused_by_name() {
        let p = Path::new("a/adapter_config.json");
        let ok = r#"{"peft_type":"LORA","r":4,"lora_alpha":8,"target_modules":["q_proj"]}"#;
        let (s, _) = parse_adapter_config(ok, p).unwrap();
        assert_eq!((s.r, s.alpha, s.scaling()), (4, 8.0, 2.0));
        for (text, field) in [
            (r#"{"peft_type":"IA3","r":4,"lora_alpha":8,"target_modules":["q_proj"]}"#, "peft_type"),
            (r#"{"peft_type":"LORA","lora_alpha":8,"target_modules":["q_proj"]}"#, "\"r\""),
            (r#"{"peft_type":"LORA","r":4,"lora_alpha":8,"target_modules":["q_proj"],"use_dora":true}"#, "use_dora"),
            (r#"{"peft_type":"LORA","r":4,"lora_alpha":8,"target_modules":".*proj"}"#, "target_modules"),
        ] {
            let err = parse_adapter_config(text, p).unwrap_err().to_string();
            assert!(err.contains(field) && err.contains("a/adapter_config.json"), "{err}");
        }
    }
}
