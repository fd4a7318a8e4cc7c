//! Accelerate's own config file, as `accelerate config` writes it: top-level launch and
//! environment keys plus the nested `fsdp_config:` block, FSDP1 and FSDP2 flavours. Each key
//! becomes the flags it stands for, is checked to be a value fsdp-app matches, or is refused
//! with the reason. Keys about the machine that do not change training (`compute_environment`,
//! `debug`, `tpu_*`, ...) are accepted as they are.

use yaml_rust2::Yaml;

/// Flags one key sets (clap ids and values as the flags take them).
pub type Flags = Vec<(&'static str, String)>;

/// What became of one key: not an Accelerate key (the caller goes on), its flags, or why it is
/// refused.
pub enum Outcome {
    NotOurs,
    Flags(Flags),
    Refused(String),
}

/// Top-level keys that describe the launch or the machine, not the training: accepted (the
/// launch keys are read by `fsdp-app launch --config`).
const ENVIRONMENT_KEYS: &[&str] = &[
    "debug",
    "main_training_function",
    "same_network",
    "enable_cpu_affinity",
    "downcast_bf16",
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "gpu_ids",
    "rdzv_backend",
];

/// Sections for other engines: accepted only empty.
const OTHER_ENGINES: &[&str] =
    &["deepspeed_config", "megatron_lm_config", "fp8_config", "ipex_config", "mpirun_config", "parallelism_config"];

fn text(v: &Yaml) -> Option<String> {
    match v {
        Yaml::String(s) => Some(s.clone()),
        Yaml::Integer(i) => Some(i.to_string()),
        Yaml::Boolean(b) => Some(b.to_string()),
        Yaml::Real(r) => Some(r.clone()),
        _ => None,
    }
}

fn boolean(v: &Yaml) -> Result<bool, String> {
    match v {
        Yaml::Boolean(b) => Ok(*b),
        // Accelerate writes some flags as 'true'/'false' strings in older files.
        Yaml::String(s) if s == "true" || s == "false" => Ok(s == "true"),
        _ => Err("expected true or false".into()),
    }
}

fn flags(list: &[(&'static str, &str)]) -> Outcome {
    Outcome::Flags(list.iter().map(|(f, v)| (*f, v.to_string())).collect())
}

/// One top-level key of an Accelerate file.
pub fn top_level(key: &str, v: &Yaml) -> Outcome {
    if ENVIRONMENT_KEYS.contains(&key) || key.starts_with("tpu_") {
        return Outcome::Flags(vec![]);
    }
    if OTHER_ENGINES.contains(&key) {
        return match v {
            Yaml::Hash(h) if h.is_empty() => Outcome::Flags(vec![]),
            Yaml::Null => Outcome::Flags(vec![]),
            _ => Outcome::Refused(format!("fsdp-app trains with FSDP only; remove the {key} section")),
        };
    }
    match key {
        "compute_environment" => match text(v).as_deref() {
            Some("LOCAL_MACHINE") => Outcome::Flags(vec![]),
            Some(other) => Outcome::Refused(format!("{other}: only LOCAL_MACHINE (this machine, or nodes you start `fsdp-app launch` on)")),
            None => Outcome::Refused("expected LOCAL_MACHINE".into()),
        },
        "distributed_type" => match text(v).as_deref() {
            Some("FSDP") | Some("NO") => Outcome::Flags(vec![]),
            // DDP: every rank holds the whole model and gradients are all-reduced, which is
            // FSDP's NO_SHARD.
            Some("MULTI_CPU") | Some("MULTI_GPU") => flags(&[("sharding_strategy", "NO_SHARD")]),
            Some("DEEPSPEED") => Outcome::Refused(
                "DEEPSPEED: fsdp-app trains with FSDP; ZeRO-3 corresponds to distributed_type: FSDP with FULL_SHARD, ZeRO-2 to SHARD_GRAD_OP".into(),
            ),
            Some(other) => Outcome::Refused(format!("{other}: fsdp-app runs FSDP (or MULTI_CPU / MULTI_GPU as NO_SHARD) on CPU ranks or NVIDIA GPUs")),
            None => Outcome::Refused("expected FSDP".into()),
        },
        "use_cpu" => match boolean(v) {
            Ok(true) => flags(&[("device", "cpu")]),
            // Accelerate then uses the GPUs there are: so do we.
            Ok(false) if gpus_usable() => flags(&[("device", "cuda")]),
            Ok(false) => Outcome::Flags(vec![]),
            Err(e) => Outcome::Refused(e),
        },
        "dynamo_backend" => match text(v).as_deref() {
            Some("NO") | Some("no") => Outcome::Flags(vec![]),
            _ => Outcome::Refused("torch.compile backends do not apply to fsdp-app: use NO".into()),
        },
        "dynamo_config" => match v {
            Yaml::Hash(h) if h.iter().all(|(k, v)| k.as_str() != Some("dynamo_backend") || matches!(v.as_str(), Some("NO") | Some("no"))) => {
                Outcome::Flags(vec![])
            }
            _ => Outcome::Refused("torch.compile does not apply to fsdp-app: dynamo_backend must be NO".into()),
        },
        _ => Outcome::NotOurs,
    }
}

/// GPUs this build could train on (a CUDA build with a visible NVIDIA device).
pub fn gpus_usable() -> bool {
    cfg!(feature = "cuda") && std::fs::read_dir("/proc/driver/nvidia/gpus").map(|d| d.count() > 0).unwrap_or(false)
}

/// FSDP1's `ShardingStrategy` by name or by its number (1-5), as Accelerate writes either.
fn strategy(v: &Yaml) -> Result<&'static str, String> {
    match text(v).as_deref() {
        Some("FULL_SHARD") | Some("1") => Ok("FULL_SHARD"),
        Some("SHARD_GRAD_OP") | Some("2") => Ok("SHARD_GRAD_OP"),
        Some("NO_SHARD") | Some("3") => Ok("NO_SHARD"),
        Some("HYBRID_SHARD") | Some("4") => Ok("HYBRID_SHARD"),
        Some("HYBRID_SHARD_ZERO2") | Some("5") => {
            Err("HYBRID_SHARD_ZERO2 (keeping gathered weights between forward and backward inside a group) is not implemented; use HYBRID_SHARD".into())
        }
        Some(other) => Err(format!("{other}: use FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or their numbers 1-4")),
        None => Err("expected a strategy name or number".into()),
    }
}

/// One key of the `fsdp_config:` block: its flags, or why it is refused.
pub fn fsdp_key(key: &str, v: &Yaml) -> Result<Flags, String> {
    match key {
        "fsdp_version" => match v {
            // FSDP1 files run with FSDP2's per-parameter sharding: same results, same strategies.
            Yaml::Integer(1) | Yaml::Integer(2) => Ok(vec![]),
            _ => Err("expected 1 or 2".into()),
        },
        "fsdp_sharding_strategy" => strategy(v).map(|s| vec![("sharding_strategy", s.to_string())]),
        "fsdp_reshard_after_forward" => match v {
            Yaml::Boolean(b) => Ok(vec![("sharding_strategy", if *b { "FULL_SHARD" } else { "SHARD_GRAD_OP" }.to_string())]),
            // Accelerate also takes FSDP1 strategy names here.
            other => strategy(other).map(|s| vec![("sharding_strategy", s.to_string())]),
        },
        "fsdp_auto_wrap_policy" => match text(v).as_deref() {
            Some(p @ ("TRANSFORMER_BASED_WRAP" | "SIZE_BASED_WRAP" | "NO_WRAP")) => Ok(vec![("wrap_policy", p.to_string())]),
            _ => Err("use TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP".into()),
        },
        "fsdp_transformer_layer_cls_to_wrap" => match v {
            Yaml::String(s) => Ok(vec![("transformer_cls_names_to_wrap", s.split(',').map(str::trim).collect::<Vec<_>>().join(","))]),
            _ => Err("expected the decoder layer's class name, e.g. LlamaDecoderLayer".into()),
        },
        "fsdp_min_num_params" => match v {
            Yaml::Integer(n) if *n >= 0 => Ok(vec![("min_num_params", n.to_string())]),
            _ => Err("expected a non-negative integer".into()),
        },
        "fsdp_activation_checkpointing" => boolean(v).map(|b| vec![("activation_checkpointing", b.to_string())]),
        // On GPUs: master weights, gradients and AdamW state in host memory. CPU ranks hold
        // them there anyway.
        "fsdp_offload_params" => boolean(v).map(|b| if b { vec![("cpu_offload", "true".to_string())] } else { vec![] }),
        "fsdp_cpu_ram_efficient_loading" => match boolean(v) {
            Ok(true) => Ok(vec![]),
            Ok(false) => {
                Err("fsdp-app always loads the checkpoint on rank 0 and streams it to the others; `false` is not available".into())
            }
            Err(e) => Err(e),
        },
        "fsdp_sync_module_states" => match boolean(v) {
            Ok(true) => Ok(vec![]),
            Ok(false) => Err("the other ranks always receive their weights from rank 0; `false` is not available".into()),
            Err(e) => Err(e),
        },
        "fsdp_state_dict_type" => match text(v).as_deref() {
            // The run always ends with the full model in the output directory; checkpoints are
            // sharded (resumable on any world size) and `fsdp-app merge` makes any of them a
            // full model. Both names describe that.
            Some("SHARDED_STATE_DICT") | Some("FULL_STATE_DICT") => Ok(vec![]),
            Some(other) => Err(format!("{other}: use SHARDED_STATE_DICT or FULL_STATE_DICT")),
            None => Err("expected SHARDED_STATE_DICT or FULL_STATE_DICT".into()),
        },
        // Prefetch: fsdp-app has one switch (`--prefetch`, forward and backward alike). FSDP1's
        // default BACKWARD_PRE (and BACKWARD_POST) leave it at `auto`: on where collectives run
        // beside compute (NCCL); NO_PREFETCH turns it off, `fsdp_forward_prefetch: true` on (the
        // two together conflict, and the settings' merge says so).
        "fsdp_backward_prefetch" => match v {
            Yaml::Null => Ok(vec![]),
            Yaml::String(s) if s == "BACKWARD_PRE" || s == "BACKWARD_POST" => Ok(vec![]),
            Yaml::String(s) if s == "NO_PREFETCH" => Ok(vec![("prefetch", "off".to_string())]),
            _ => Err("use BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH".into()),
        },
        "fsdp_forward_prefetch" => boolean(v).map(|b| if b { vec![("prefetch", "on".to_string())] } else { vec![] }),
        // Parameters keep their names and shapes either way.
        "fsdp_use_orig_params" => boolean(v).map(|_| vec![]),
        other => Err(format!(
            "unknown FSDP setting `{other}`; known: fsdp_version, fsdp_sharding_strategy, fsdp_reshard_after_forward, \
             fsdp_auto_wrap_policy, fsdp_transformer_layer_cls_to_wrap, fsdp_min_num_params, fsdp_activation_checkpointing, \
             fsdp_offload_params, fsdp_cpu_ram_efficient_loading, fsdp_sync_module_states, fsdp_state_dict_type, \
             fsdp_backward_prefetch, fsdp_forward_prefetch, fsdp_use_orig_params"
        )),
    }
}

/// What `fsdp-app launch --config FILE` takes from an Accelerate file.
#[derive(Debug, Default, PartialEq)]
pub struct LaunchSettings {
    pub num_processes: Option<usize>,
    pub num_machines: Option<usize>,
    pub machine_rank: Option<usize>,
    pub main_process_ip: Option<String>,
    pub main_process_port: Option<u16>,
    /// `gpu_ids` other than `all`, for CUDA_VISIBLE_DEVICES.
    pub gpu_ids: Option<String>,
}

/// Reads the launch keys of an Accelerate (or fsdp-app) config file; the rest is left to the
/// `finetune` it starts, which reads the same file.
pub fn launch_settings(path: &std::path::Path) -> anyhow::Result<LaunchSettings> {
    use anyhow::{bail, Context};
    let text_of = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let docs = yaml_rust2::YamlLoader::load_from_str(&text_of).map_err(|e| anyhow::anyhow!("{}: not valid YAML: {e}", path.display()))?;
    let mut s = LaunchSettings::default();
    let Some(Yaml::Hash(map)) = docs.into_iter().next() else {
        return Ok(s);
    };
    let count = |key: &str, v: &Yaml| -> anyhow::Result<usize> {
        match v {
            Yaml::Integer(n) if *n >= 0 => Ok(*n as usize),
            _ => bail!("{}: key `{key}`: expected a non-negative integer", path.display()),
        }
    };
    for (k, v) in map.iter() {
        match k.as_str().unwrap_or("") {
            "num_processes" => s.num_processes = Some(count("num_processes", v)?),
            "num_machines" => s.num_machines = Some(count("num_machines", v)?),
            "machine_rank" => s.machine_rank = Some(count("machine_rank", v)?),
            "main_process_ip" => s.main_process_ip = text(v),
            "main_process_port" => {
                let port = count("main_process_port", v)?;
                s.main_process_port = Some(
                    u16::try_from(port)
                        .ok()
                        .filter(|p| *p > 0)
                        .with_context(|| format!("{}: key `main_process_port`: {port} is not a port", path.display()))?,
                );
            }
            "gpu_ids" => s.gpu_ids = text(v).filter(|g| g != "all"),
            _ => {}
        }
    }
    Ok(s)
}
