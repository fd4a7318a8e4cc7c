//! `finetune --config FILE.yaml`: keys named as in Accelerate's FSDP plugin (`fsdp_version`,
//! `reshard_after_forward`, `mixed_precision`, `auto_wrap_policy`, ...) and as in transformers'
//! TrainingArguments (`learning_rate`, `per_device_train_batch_size`, ...). Each key becomes the
//! setting of the `finetune` flag it stands for ([`Setting`]); `FinetuneArgs::apply` writes them
//! into the same typed arguments the flags fill (the field's type decides what a value may be),
//! so a file means exactly what the flags mean, and flags given on the command line win. An
//! unknown key, a wrong type or a value fsdp-app cannot honour is an error naming the file and
//! the key: nothing is silently ignored.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;
use yaml_rust2::{Yaml, YamlLoader};

use crate::train::accelerate_config::{fsdp_key, Outcome};

/// A setting from the file: the flag (clap id, the `FinetuneArgs` field) it sets and its value.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    pub flag: &'static str,
    pub value: Value,
    /// The key it came from (`fsdp_config.fsdp_x` for nested ones) and its value as written,
    /// and the file, for messages.
    pub key: String,
    pub written: String,
    pub file: std::path::PathBuf,
}

impl Setting {
    /// `file: key `k` (written)`, for messages.
    pub fn origin(&self) -> String {
        format!("{}: key `{}` ({})", self.file.display(), self.key, self.written)
    }
}

/// key -> flag, for keys whose value is the flag's as it is. Keys with special handling are
/// matched before this table.
const SIMPLE: &[(&str, &str)] = &[
    // Accelerate FSDP plugin.
    ("auto_wrap_policy", "wrap_policy"),
    ("min_num_params", "min_num_params"),
    ("activation_checkpointing", "activation_checkpointing"),
    ("sharding_strategy", "sharding_strategy"),
    // Ours, for what Accelerate has no name.
    ("shard_group_size", "shard_group_size"),
    ("backend", "backend"),
    ("collective_timeout", "collective_timeout"),
    ("prefetch", "prefetch"),
    ("world_size", "world_size"),
    ("num_processes", "world_size"),
    // TrainingArguments / TRL.
    ("model_name_or_path", "model"),
    ("model", "model"),
    ("revision", "revision"),
    ("chat_template_path", "chat_template"),
    ("chat_template", "chat_template"),
    ("output_dir", "output_dir"),
    ("data", "data"),
    ("train_file", "data"),
    ("eval_file", "eval_data"),
    ("eval_data", "eval_data"),
    ("eval_split", "eval_split"),
    ("eval_steps", "eval_steps"),
    ("learning_rate", "lr"),
    ("weight_decay", "weight_decay"),
    ("weight_decay_all", "weight_decay_all"),
    ("max_grad_norm", "max_grad_norm"),
    ("per_device_train_batch_size", "batch_size"),
    ("gradient_accumulation_steps", "grad_accum"),
    ("auto_find_batch_size", "auto_find_batch_size"),
    ("max_memory_per_rank", "max_memory_per_rank"),
    ("max_seq_length", "seq_len"),
    ("max_length", "seq_len"),
    ("max_steps", "max_steps"),
    ("num_train_epochs", "epochs"),
    ("warmup_steps", "warmup_steps"),
    ("lr_scheduler_type", "lr_scheduler"),
    ("seed", "seed"),
    ("save_steps", "save_steps"),
    ("save_strategy", "save_strategy"),
    ("save_total_limit", "save_total_limit"),
    ("save_full_every", "save_full_every"),
    ("warmup_ratio", "warmup_ratio"),
    ("logging_steps", "logging_steps"),
    ("gradient_checkpointing", "activation_checkpointing"),
    ("resume_from_checkpoint", "resume_from_checkpoint"),
    ("max_shard_size", "max_shard_size"),
    ("packing", "packing"),
    ("train_on", "train_on"),
    ("skip_bad_rows", "skip_bad_rows"),
    // LoRA, with PEFT's / Axolotl's names.
    ("lora", "lora"),
    ("lora_r", "lora_r"),
    ("lora_alpha", "lora_alpha"),
    ("lora_dropout", "lora_dropout"),
    ("lora_model_dir", "adapter"),
    ("merge_lora", "merge_lora"),
    // Preference tuning, with TRL's DPOConfig names and Axolotl's `rl: dpo`.
    ("method", "method"),
    ("rl", "method"),
    ("beta", "dpo_beta"),
    ("dpo_beta", "dpo_beta"),
    ("loss_type", "dpo_loss"),
    ("dpo_loss", "dpo_loss"),
];

/// Every key the file may hold, for the error on an unknown one.
pub fn known_keys() -> Vec<&'static str> {
    let mut k: Vec<&str> = SIMPLE.iter().map(|(k, _)| *k).collect();
    k.extend([
        "fsdp_version",
        "reshard_after_forward",
        "mixed_precision",
        "transformer_cls_names_to_wrap",
        "cpu_ram_efficient_loading",
        "state_dict_type",
        "shuffle",
        "lora_target_modules",
        "bf16",
        "fp16",
        "fsdp_config",
        "distributed_type",
        "compute_environment",
        "use_cpu",
        "(Accelerate's environment keys: debug, num_machines, machine_rank, main_process_ip, main_process_port, gpu_ids, tpu_*, ...)",
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

/// A YAML scalar as JSON, for the flag's field to take (a mapping or a list is no flag's value).
fn scalar(y: &Yaml) -> Option<Value> {
    Some(match y {
        Yaml::Boolean(b) => Value::Bool(*b),
        Yaml::Integer(i) => Value::from(*i),
        Yaml::Real(r) => Value::from(r.parse::<f64>().ok()?),
        Yaml::String(s) => Value::String(s.clone()),
        _ => return None,
    })
}

/// A whole YAML document as JSON (mappings with string keys, lists, scalars): for files that
/// describe a structure rather than flags (a GRPO grader).
pub fn yaml_to_json(text: &str) -> Result<Value> {
    fn convert(y: &Yaml) -> Result<Value> {
        Ok(match y {
            Yaml::Hash(map) => {
                let mut out = serde_json::Map::new();
                for (k, v) in map {
                    let Yaml::String(key) = k else { bail!("keys must be strings, found {}", type_name(k)) };
                    out.insert(key.clone(), convert(v).with_context(|| format!("key `{key}`"))?);
                }
                Value::Object(out)
            }
            Yaml::Array(items) => Value::Array(items.iter().map(convert).collect::<Result<_>>()?),
            Yaml::Null => Value::Null,
            other => scalar(other).with_context(|| format!("{} is not a JSON value", type_name(other)))?,
        })
    }
    let docs = YamlLoader::load_from_str(text).map_err(|e| anyhow::anyhow!("not valid YAML: {e}"))?;
    match docs.first() {
        Some(doc) => convert(doc),
        None => bail!("the file is empty"),
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

fn dtype_name(s: &str) -> Option<&'static str> {
    match s {
        "no" | "fp32" | "f32" | "float32" => Some("f32"),
        "bf16" | "bfloat16" => Some("bf16"),
        "fp16" | "f16" | "float16" => Some("f16"),
        _ => None,
    }
}

/// Reads every `--config` file (an Accelerate file and a TrainingArguments one, or one file
/// with both) into the flags they set. Two keys that set one flag to different values, in one
/// file or across files, are an error naming both.
pub fn load_all(paths: &[std::path::PathBuf]) -> Result<Vec<Setting>> {
    let mut all: Vec<Setting> = vec![];
    for path in paths {
        for s in load(path)? {
            match all.iter().find(|o| o.flag == s.flag) {
                Some(other) if other.value != s.value => {
                    bail!(
                        "conflicting settings: {} and {} both set --{} ({} vs {})",
                        other.origin(),
                        s.origin(),
                        s.flag.replace('_', "-"),
                        other.value,
                        s.value
                    );
                }
                // Two keys saying the same thing (fsdp_activation_checkpointing and
                // gradient_checkpointing): one flag.
                Some(_) => {}
                None => all.push(s),
            }
        }
    }
    Ok(all)
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
    for (k, v) in map.iter() {
        let Yaml::String(key) = k else { bail!("{}: keys must be strings, found {}", path.display(), type_name(k)) };
        if key == "fsdp_config" {
            let Yaml::Hash(inner) = v else { bail!("{}: key `fsdp_config`: expected a mapping, found {}", path.display(), type_name(v)) };
            for (ik, iv) in inner.iter() {
                let name = format!("fsdp_config.{}", ik.as_str().unwrap_or("?"));
                let written = show(iv);
                let flags =
                    fsdp_key(ik.as_str().unwrap_or(""), iv).map_err(|why| anyhow::anyhow!("{}: key `{name}`: {why}", path.display()))?;
                out.extend(flags.into_iter().map(|(flag, value)| Setting {
                    flag,
                    value: flag_value(&value),
                    key: name.clone(),
                    written: written.clone(),
                    file: path.into(),
                }));
            }
            continue;
        }
        let written = show(v);
        let flags = key_settings(key, v).map_err(|why| match why.strip_prefix("unknown key") {
            Some(rest) => anyhow::anyhow!("{}: unknown key `{key}`{rest}", path.display()),
            None => anyhow::anyhow!("{}: key `{key}`: {why}", path.display()),
        })?;
        out.extend(flags.into_iter().map(|(flag, value)| Setting {
            flag,
            value,
            key: key.clone(),
            written: written.clone(),
            file: path.into(),
        }));
    }
    hybrid_groups_from_machines(&map, &mut out, path);
    Ok(out)
}

/// Accelerate's HYBRID_SHARD shards inside a machine and replicates across machines: with no
/// `shard_group_size` of ours, the group is the ranks of one machine.
fn hybrid_groups_from_machines(map: &yaml_rust2::yaml::Hash, out: &mut Vec<Setting>, path: &Path) {
    let int = |k: &str| map.get(&Yaml::String(k.into())).and_then(Yaml::as_i64).filter(|n| *n > 0);
    let hybrid = out.iter().any(|s| s.flag == "sharding_strategy" && s.value == "HYBRID_SHARD");
    if let (true, false, Some(procs), Some(machines)) =
        (hybrid, out.iter().any(|s| s.flag == "shard_group_size"), int("num_processes"), int("num_machines"))
    {
        let written = format!("num_processes {procs} / num_machines {machines}");
        out.push(Setting {
            flag: "shard_group_size",
            value: Value::from(procs / machines),
            key: "num_machines".into(),
            written,
            file: path.into(),
        });
    }
}

/// A value as the file writes it, for messages.
fn show(v: &Yaml) -> String {
    match v {
        Yaml::String(s) => s.clone(),
        Yaml::Integer(i) => i.to_string(),
        Yaml::Real(r) => r.clone(),
        Yaml::Boolean(b) => b.to_string(),
        Yaml::Null => "null".into(),
        other => type_name(other).to_string(),
    }
}

/// The settings one top-level key makes, or why it is refused.
fn key_settings(key: &str, v: &Yaml) -> std::result::Result<Vec<(&'static str, Value)>, String> {
    if let Some((_, flag)) = SIMPLE.iter().find(|(name, _)| *name == key) {
        let value = scalar(v).ok_or_else(|| format!("expected a value, found {}", type_name(v)))?;
        return Ok(vec![(*flag, value)]);
    }
    key_flags(key, v).map(|flags| flags.into_iter().map(|(flag, value)| (flag, flag_value(&value))).collect())
}

/// The flags (as strings) of a key with special handling.
fn key_flags(key: &str, v: &Yaml) -> std::result::Result<Vec<(&'static str, String)>, String> {
    let boolean = |v: &Yaml| match v {
        Yaml::Boolean(b) => Ok(*b),
        other => Err(format!("expected true or false, found {}", type_name(other))),
    };
    match key {
        // Our short names of Accelerate's FSDP settings: the same rules as in `fsdp_config`.
        "fsdp_version" => fsdp_key(key, v),
        "reshard_after_forward" | "cpu_ram_efficient_loading" | "state_dict_type" => fsdp_key(&format!("fsdp_{key}"), v),
        "shuffle" => Ok(if boolean(v)? { vec![] } else { vec![("no_shuffle", "true".into())] }),
        // TrainingArguments: bf16 / fp16 compute with fp32 master weights, which is FSDP's
        // param_dtype (reductions stay fp32).
        "bf16" => Ok(if boolean(v)? { vec![("param_dtype", "bf16".into())] } else { vec![] }),
        "fp16" => Ok(if boolean(v)? { vec![("param_dtype", "f16".into())] } else { vec![] }),
        "mixed_precision" => match v {
            Yaml::String(s) => {
                let d = dtype_name(s).ok_or_else(|| format!("{s:?}: use no, bf16 or fp16"))?;
                Ok(vec![("param_dtype", d.into()), ("reduce_dtype", d.into())])
            }
            Yaml::Hash(h) => h
                .iter()
                .map(|(pk, pv)| {
                    let (Yaml::String(pk), Yaml::String(pv)) = (pk, pv) else {
                        return Err("entries must be `param_dtype: bf16` style strings".to_string());
                    };
                    let d = dtype_name(pv).ok_or_else(|| format!("{pk}: {pv:?} is not a dtype (fp32, bf16, fp16)"))?;
                    match pk.as_str() {
                        "param_dtype" => Ok(("param_dtype", d.to_string())),
                        "reduce_dtype" => Ok(("reduce_dtype", d.to_string())),
                        other => Err(format!("unknown entry `{other}`; use param_dtype and reduce_dtype")),
                    }
                })
                .collect(),
            other => Err(format!("expected no, bf16, fp16 or a mapping, found {}", type_name(other))),
        },
        "transformer_cls_names_to_wrap" => {
            let names = name_list(v).ok_or_else(|| format!("expected a class name or a list of them, found {}", type_name(v)))?;
            Ok(vec![("transformer_cls_names_to_wrap", names)])
        }
        "lora_target_modules" => {
            let names = name_list(v).ok_or_else(|| format!("expected a module name or a list of them, found {}", type_name(v)))?;
            Ok(vec![("lora_targets", names)])
        }
        other => match crate::train::accelerate_config::top_level(other, v) {
            Outcome::Flags(f) => Ok(f),
            Outcome::Refused(why) => Err(why),
            Outcome::NotOurs => Err(format!("unknown key; known keys: {}", known_keys().join(", "))),
        },
    }
}

/// A flag value as a string (Accelerate's keys and ours with special handling) as JSON: `true` and
/// `false` as booleans, numbers as numbers, the rest as strings. `FinetuneArgs::apply` takes a
/// number as a string where the field is one.
fn flag_value(s: &str) -> Value {
    match s {
        "true" => Value::Bool(true),
        "false" => Value::Bool(false),
        _ => serde_json::from_str::<serde_json::Number>(s).map(Value::Number).unwrap_or_else(|_| Value::String(s.to_string())),
    }
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

    /// A value as the flag's text: strings bare, numbers and booleans as JSON writes them.
    fn shown(v: &Value) -> String {
        match v {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.as_f64().filter(|_| !n.is_i64()).map_or(n.to_string(), |x| format!("{x}")),
            other => other.to_string(),
        }
    }

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
        let flags: Vec<(&str, String)> = s.iter().map(|x| (x.flag, shown(&x.value))).collect();
        assert_eq!(
            flags,
            [
                ("sharding_strategy", "SHARD_GRAD_OP"),
                ("param_dtype", "bf16"),
                ("reduce_dtype", "bf16"),
                ("wrap_policy", "TRANSFORMER_BASED_WRAP"),
                ("transformer_cls_names_to_wrap", "LlamaDecoderLayer"),
                ("activation_checkpointing", "true"),
                ("lr", "0.00002"),
                ("batch_size", "4"),
            ]
            .map(|(f, v)| (f, v.to_string()))
            .to_vec()
        );
    }

    #[test]
    fn accelerate_files_as_written_become_flags_or_are_refused_by_key() {
        let flags = |t: &str| parse(t).unwrap().into_iter().map(|x| (x.flag, shown(&x.value))).collect::<Vec<_>>();
        // FSDP1 flavour: strategies by number, hybrid groups from the machines.
        let f = flags(
            "compute_environment: LOCAL_MACHINE\ndebug: false\ndistributed_type: FSDP\ndowncast_bf16: 'no'\nfsdp_config:\n  \
             fsdp_sharding_strategy: 4\n  fsdp_version: 1\n  fsdp_backward_prefetch: BACKWARD_PRE\n  fsdp_use_orig_params: true\n\
             machine_rank: 0\nmixed_precision: 'no'\nnum_machines: 2\nnum_processes: 4\ntpu_env: []\nuse_cpu: true\n",
        );
        assert!(f.contains(&("sharding_strategy", "HYBRID_SHARD".into())) && f.contains(&("shard_group_size", "2".into())), "{f:?}");
        assert!(f.contains(&("device", "cpu".into())) && f.contains(&("world_size", "4".into())), "{f:?}");
        assert_eq!(flags("fsdp_config:\n  fsdp_reshard_after_forward: false\n"), vec![("sharding_strategy", "SHARD_GRAD_OP".into())]);
        assert_eq!(flags("distributed_type: MULTI_CPU\n"), vec![("sharding_strategy", "NO_SHARD".into())]);
        // Prefetch: BACKWARD_PRE (above) leaves --prefetch at auto; these set it.
        assert!(!f.iter().any(|(flag, _)| *flag == "prefetch"), "{f:?}");
        assert_eq!(flags("fsdp_config:\n  fsdp_backward_prefetch: NO_PREFETCH\n"), vec![("prefetch", "off".into())]);
        assert_eq!(flags("fsdp_config:\n  fsdp_forward_prefetch: true\n"), vec![("prefetch", "on".into())]);
        assert_eq!(flags("prefetch: on\n"), vec![("prefetch", "on".into())]);
        assert_eq!(flags("warmup_ratio: 0.1\nbf16: true\ngradient_checkpointing: true\n").len(), 3);
        let e = |t: &str| format!("{:#}", parse(t).unwrap_err());
        assert!(e("distributed_type: DEEPSPEED\n").contains("key `distributed_type`: DEEPSPEED"));
        assert!(e("fsdp_config:\n  fsdp_sharding_strategy: 5\n").contains("key `fsdp_config.fsdp_sharding_strategy`: HYBRID_SHARD_ZERO2"));
        assert!(e("fsdp_config:\n  fsdp_sync_module_states: false\n").contains("fsdp_config.fsdp_sync_module_states"));
        assert!(e("fsdp_config:\n  fsdp_foo: 1\n").contains("unknown FSDP setting `fsdp_foo`"));
        assert!(e("compute_environment: AMAZON_SAGEMAKER\n").contains("only LOCAL_MACHINE"));
        assert!(e("deepspeed_config:\n  zero_stage: 3\n").contains("key `deepspeed_config`"));
    }

    #[test]
    fn two_keys_setting_one_flag_differently_are_named_with_their_files() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.yaml"), dir.path().join("b.yaml"));
        std::fs::write(&a, "sharding_strategy: FULL_SHARD\nreshard_after_forward: false\n").unwrap();
        let e = format!("{:#}", load_all(std::slice::from_ref(&a)).unwrap_err());
        assert!(
            e.contains("key `sharding_strategy` (FULL_SHARD)") && e.contains("key `reshard_after_forward` (false)") && e.contains("a.yaml"),
            "{e}"
        );
        std::fs::write(&a, "mixed_precision: bf16\n").unwrap();
        std::fs::write(&b, "bf16: false\nfp16: true\n").unwrap();
        let e = format!("{:#}", load_all(&[a.clone(), b.clone()]).unwrap_err());
        assert!(e.contains("a.yaml: key `mixed_precision` (bf16)") && e.contains("b.yaml: key `fp16` (true)"), "{e}");
        // Agreeing keys are fine.
        std::fs::write(&b, "bf16: true\nlearning_rate: 1e-4\n").unwrap();
        assert_eq!(load_all(&[a, b]).unwrap().len(), 3);
    }

    #[test]
    fn unknown_keys_wrong_types_and_unsupported_values_are_named() {
        let e = |t: &str| format!("{:#}", parse(t).unwrap_err());
        assert!(e("learning_rat: 1e-5\n").contains("unknown key `learning_rat`; known keys"));
        assert!(e("fsdp_version: 3\n").contains("expected 1 or 2"));
        assert!(e("cpu_ram_efficient_loading: false\n").contains("always loads the checkpoint on rank 0"));
        assert!(e("state_dict_type: LOCAL_STATE_DICT\n").contains("use SHARDED_STATE_DICT or FULL_STATE_DICT"));
        assert!(e("mixed_precision: fp8\n").contains("use no, bf16 or fp16"));
        assert!(e("lora_target_modules: 3\n").contains("key `lora_target_modules`: expected a module name or a list"));
        assert!(e("lora_r: [1]\n").contains("key `lora_r`: expected a value, found a list"));
        assert!(check_layer_class("GPT2Block", models::Architecture::Llama).unwrap_err().to_string().contains("LlamaDecoderLayer"));
    }
}
