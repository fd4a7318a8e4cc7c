//! `finetune --config FILE.yaml`: keys named as in Accelerate's FSDP plugin (`fsdp_version`,
//! `reshard_after_forward`, `mixed_precision`, `auto_wrap_policy`, ...) and as in transformers'
//! TrainingArguments (`learning_rate`, `per_device_train_batch_size`, ...). Each key becomes the
//! command-line flag it stands for, so a file means exactly what the flags mean, and flags given
//! on the command line win. An unknown key, a wrong type or a value fsdp-app cannot honour is
//! an error naming the file and the key: nothing is silently ignored.

use std::path::Path;

use anyhow::{bail, Context, Result};
use yaml_rust2::{Yaml, YamlLoader};

/// A setting from the file: the flag (clap id) it sets and its value as the flag would take it.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    pub flag: &'static str,
    pub value: String,
    /// The key it came from, for messages.
    pub key: String,
}

#[derive(Clone, Copy)]
enum Kind {
    Bool,
    Int,
    Float,
    Str,
}

/// key -> (flag, kind). Keys with special handling are matched before this table.
const SIMPLE: &[(&str, &str, Kind)] = &[
    // Accelerate FSDP plugin.
    ("auto_wrap_policy", "wrap_policy", Kind::Str),
    ("min_num_params", "min_num_params", Kind::Int),
    ("activation_checkpointing", "activation_checkpointing", Kind::Bool),
    ("sharding_strategy", "sharding_strategy", Kind::Str),
    // Ours, for what Accelerate has no name.
    ("shard_group_size", "shard_group_size", Kind::Int),
    ("backend", "backend", Kind::Str),
    ("collective_timeout", "collective_timeout", Kind::Int),
    ("world_size", "world_size", Kind::Int),
    ("num_processes", "world_size", Kind::Int),
    // TrainingArguments / TRL.
    ("model_name_or_path", "model", Kind::Str),
    ("model", "model", Kind::Str),
    ("revision", "revision", Kind::Str),
    ("output_dir", "output_dir", Kind::Str),
    ("data", "data", Kind::Str),
    ("train_file", "data", Kind::Str),
    ("eval_file", "eval_data", Kind::Str),
    ("eval_data", "eval_data", Kind::Str),
    ("eval_split", "eval_split", Kind::Float),
    ("eval_steps", "eval_steps", Kind::Int),
    ("learning_rate", "lr", Kind::Float),
    ("weight_decay", "weight_decay", Kind::Float),
    ("weight_decay_all", "weight_decay_all", Kind::Bool),
    ("max_grad_norm", "max_grad_norm", Kind::Float),
    ("per_device_train_batch_size", "batch_size", Kind::Int),
    ("gradient_accumulation_steps", "grad_accum", Kind::Int),
    ("max_seq_length", "seq_len", Kind::Int),
    ("max_length", "seq_len", Kind::Int),
    ("max_steps", "max_steps", Kind::Int),
    ("num_train_epochs", "epochs", Kind::Int),
    ("warmup_steps", "warmup_steps", Kind::Int),
    ("lr_scheduler_type", "lr_scheduler", Kind::Str),
    ("seed", "seed", Kind::Int),
    ("save_steps", "save_steps", Kind::Int),
    ("save_total_limit", "save_total_limit", Kind::Int),
    ("save_full_every", "save_full_every", Kind::Int),
    ("resume_from_checkpoint", "resume_from_checkpoint", Kind::Str),
    ("max_shard_size", "max_shard_size", Kind::Str),
    ("packing", "packing", Kind::Bool),
    ("train_on", "train_on", Kind::Str),
    ("skip_bad_rows", "skip_bad_rows", Kind::Bool),
    // LoRA, with PEFT's / Axolotl's names.
    ("lora", "lora", Kind::Bool),
    ("lora_r", "lora_r", Kind::Int),
    ("lora_alpha", "lora_alpha", Kind::Float),
    ("lora_dropout", "lora_dropout", Kind::Float),
    ("lora_model_dir", "adapter", Kind::Str),
    ("merge_lora", "merge_lora", Kind::Bool),
];

/// Every key the file may hold, for the error on an unknown one.
pub fn known_keys() -> Vec<&'static str> {
    let mut k: Vec<&str> = SIMPLE.iter().map(|(k, _, _)| *k).collect();
    k.extend([
        "fsdp_version",
        "reshard_after_forward",
        "mixed_precision",
        "transformer_cls_names_to_wrap",
        "cpu_ram_efficient_loading",
        "state_dict_type",
        "shuffle",
        "lora_target_modules",
    ]);
    k.sort();
    k
}

fn type_name(y: &Yaml) -> &'static str {
    match y {
        Yaml::Real(_) => "a float",
        Yaml::Integer(_) => "an integer",
        Yaml::String(_) => "a string",
        Yaml::Boolean(_) => "a boolean",
        Yaml::Array(_) => "a list",
        Yaml::Hash(_) => "a mapping",
        Yaml::Null => "null",
        _ => "an unsupported value",
    }
}

fn scalar(y: &Yaml, kind: Kind) -> Option<String> {
    match (kind, y) {
        (Kind::Bool, Yaml::Boolean(b)) => Some(b.to_string()),
        (Kind::Int, Yaml::Integer(i)) if *i >= 0 => Some(i.to_string()),
        (Kind::Float, Yaml::Real(r)) => r.parse::<f64>().ok().map(|v| v.to_string()),
        (Kind::Float, Yaml::Integer(i)) => Some(i.to_string()),
        // YAML 1.2 reads `2e-5` as a float, but some writers quote numbers.
        (Kind::Float, Yaml::String(s)) => s.parse::<f64>().ok().map(|v| v.to_string()),
        (Kind::Str, Yaml::String(s)) => Some(s.clone()),
        (Kind::Str, Yaml::Integer(i)) => Some(i.to_string()),
        _ => None,
    }
}

/// `a,b` or `[a, b]` as the comma-separated value a flag takes; None for anything else.
fn name_list(v: &Yaml) -> Option<String> {
    match v {
        Yaml::String(s) => Some(s.split(',').map(str::trim).collect::<Vec<_>>().join(",")),
        Yaml::Array(a) => a.iter().map(|x| x.as_str().map(str::to_string)).collect::<Option<Vec<_>>>().map(|n| n.join(",")),
        _ => None,
    }
}

fn want(kind: Kind) -> &'static str {
    match kind {
        Kind::Bool => "true or false",
        Kind::Int => "a non-negative integer",
        Kind::Float => "a number",
        Kind::Str => "a string",
    }
}

fn dtype_name(s: &str) -> Option<&'static str> {
    match s {
        "no" | "fp32" | "f32" | "float32" => Some("f32"),
        "bf16" | "bfloat16" => Some("bf16"),
        "fp16" | "f16" | "float16" => Some("f16"),
        _ => None,
    }
}

/// Reads `path` into the flags it sets.
pub fn load(path: &Path) -> Result<Vec<Setting>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let docs = YamlLoader::load_from_str(&text).map_err(|e| anyhow::anyhow!("{}: not valid YAML: {e}", path.display()))?;
    let Some(doc) = docs.into_iter().next() else { return Ok(vec![]) };
    let Yaml::Hash(map) = doc else {
        bail!("{}: the top level must be a mapping of keys to values, found {}", path.display(), type_name(&doc));
    };
    let mut out = vec![];
    let err = |key: &str, msg: String| anyhow::anyhow!("{}: key `{key}`: {msg}", path.display());
    for (k, v) in map.iter() {
        let Yaml::String(key) = k else { bail!("{}: keys must be strings, found {}", path.display(), type_name(k)) };
        let set = |flag: &'static str, value: String| Setting { flag, value, key: key.clone() };
        if let Some((_, flag, kind)) = SIMPLE.iter().find(|(name, _, _)| name == key) {
            let value = scalar(v, *kind).ok_or_else(|| err(key, format!("expected {}, found {}", want(*kind), type_name(v))))?;
            out.push(set(flag, value));
            continue;
        }
        match key.as_str() {
            "fsdp_version" => match v {
                Yaml::Integer(2) => {}
                Yaml::Integer(n) => return Err(err(key, format!("fsdp-app implements FSDP2 semantics; version {n} is not available"))),
                other => return Err(err(key, format!("expected 2, found {}", type_name(other)))),
            },
            "reshard_after_forward" => match v {
                Yaml::Boolean(b) => out.push(set("sharding_strategy", if *b { "FULL_SHARD" } else { "SHARD_GRAD_OP" }.into())),
                other => return Err(err(key, format!("expected true or false, found {}", type_name(other)))),
            },
            "shuffle" => match v {
                Yaml::Boolean(false) => out.push(set("no_shuffle", "true".into())),
                Yaml::Boolean(true) => {}
                other => return Err(err(key, format!("expected true or false, found {}", type_name(other)))),
            },
            "mixed_precision" => match v {
                Yaml::String(s) => {
                    let d = dtype_name(s).ok_or_else(|| err(key, format!("{s:?}: use no, bf16 or fp16")))?;
                    out.push(set("param_dtype", d.into()));
                    out.push(set("reduce_dtype", d.into()));
                }
                Yaml::Hash(h) => {
                    for (pk, pv) in h.iter() {
                        let (Yaml::String(pk), Yaml::String(pv)) = (pk, pv) else {
                            return Err(err(key, "entries must be `param_dtype: bf16` style strings".into()));
                        };
                        let d = dtype_name(pv).ok_or_else(|| err(key, format!("{pk}: {pv:?} is not a dtype (fp32, bf16, fp16)")))?;
                        match pk.as_str() {
                            "param_dtype" => out.push(set("param_dtype", d.into())),
                            "reduce_dtype" => out.push(set("reduce_dtype", d.into())),
                            other => return Err(err(key, format!("unknown entry `{other}`; use param_dtype and reduce_dtype"))),
                        }
                    }
                }
                other => return Err(err(key, format!("expected no, bf16, fp16 or a mapping, found {}", type_name(other)))),
            },
            "transformer_cls_names_to_wrap" => {
                let names = name_list(v).ok_or_else(|| err(key, format!("expected a class name or a list of them, found {}", type_name(v))))?;
                out.push(set("transformer_cls_names_to_wrap", names));
            }
            "lora_target_modules" => {
                let names = name_list(v).ok_or_else(|| err(key, format!("expected a module name or a list of them, found {}", type_name(v))))?;
                out.push(set("lora_targets", names));
            }
            "cpu_ram_efficient_loading" => match v {
                Yaml::Boolean(true) => {}
                Yaml::Boolean(false) => {
                    return Err(err(key, "fsdp-app always loads on rank 0 and streams to the others; `false` is not available".into()))
                }
                other => return Err(err(key, format!("expected true, found {}", type_name(other)))),
            },
            "state_dict_type" => match v {
                Yaml::String(s) if s == "SHARDED_STATE_DICT" => {}
                Yaml::String(s) if s == "FULL_STATE_DICT" => {
                    return Err(err(
                        key,
                        "checkpoints are always sharded (re-cut for any world size); for a full model use --save-full-every \
                         or `fsdp-app merge`"
                            .into(),
                    ))
                }
                other => return Err(err(key, format!("expected SHARDED_STATE_DICT, found {}", type_name(other)))),
            },
            other => bail!("{}: unknown key `{other}`; known keys: {}", path.display(), known_keys().join(", ")),
        }
    }
    Ok(out)
}

/// Checks `transformer_cls_names_to_wrap` against the model: it must name the model's decoder
/// layer class, the one unit transformer_based_wrap makes.
pub fn check_layer_class(names: &str, architecture: models::Architecture) -> Result<()> {
    let class = match architecture {
        models::Architecture::Llama => "LlamaDecoderLayer",
        models::Architecture::Mistral => "MistralDecoderLayer",
        models::Architecture::Qwen2 => "Qwen2DecoderLayer",
        models::Architecture::Qwen3 => "Qwen3DecoderLayer",
    };
    if !names.split(',').any(|n| n.trim() == class) {
        bail!("transformer_cls_names_to_wrap is {names:?}, but this model's decoder layer is {class}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<Setting>> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        std::fs::write(&p, text).unwrap();
        load(&p)
    }

    #[test]
    fn accelerate_and_training_keys_become_flags() {
        let s = parse(
            "fsdp_version: 2\nreshard_after_forward: false\nmixed_precision: bf16\nauto_wrap_policy: TRANSFORMER_BASED_WRAP\n\
             transformer_cls_names_to_wrap: [LlamaDecoderLayer]\nactivation_checkpointing: true\ncpu_ram_efficient_loading: true\n\
             state_dict_type: SHARDED_STATE_DICT\nlearning_rate: 2e-5\nper_device_train_batch_size: 4\n",
        )
        .unwrap();
        let flags: Vec<(&str, &str)> = s.iter().map(|x| (x.flag, x.value.as_str())).collect();
        assert_eq!(
            flags,
            vec![
                ("sharding_strategy", "SHARD_GRAD_OP"),
                ("param_dtype", "bf16"),
                ("reduce_dtype", "bf16"),
                ("wrap_policy", "TRANSFORMER_BASED_WRAP"),
                ("transformer_cls_names_to_wrap", "LlamaDecoderLayer"),
                ("activation_checkpointing", "true"),
                ("lr", "0.00002"),
                ("batch_size", "4"),
            ]
        );
    }

    #[test]
    fn unknown_keys_wrong_types_and_unsupported_values_are_named() {
        let e = |t: &str| format!("{:#}", parse(t).unwrap_err());
        assert!(e("learning_rat: 1e-5\n").contains("unknown key `learning_rat`"));
        assert!(e("per_device_train_batch_size: two\n").contains("key `per_device_train_batch_size`: expected a non-negative integer, found a string"));
        assert!(e("fsdp_version: 1\n").contains("FSDP2"));
        assert!(e("cpu_ram_efficient_loading: false\n").contains("always loads on rank 0"));
        assert!(e("state_dict_type: FULL_STATE_DICT\n").contains("always sharded"));
        assert!(e("mixed_precision: fp8\n").contains("use no, bf16 or fp16"));
        assert!(e("lora_target_modules: 3\n").contains("key `lora_target_modules`: expected a module name or a list"));
        assert!(e("lora_r: 0.5\n").contains("key `lora_r`: expected a non-negative integer"));
        assert!(check_layer_class("GPT2Block", models::Architecture::Llama).unwrap_err().to_string().contains("LlamaDecoderLayer"));
    }
}
