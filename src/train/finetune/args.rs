//! Every fine-tuning setting as users spell it: the `finetune` flags, their defaults (clap's, the
//! only place they are written), and the conversion into [`FinetuneConfig`]. The CLI parses
//! them, a YAML `--config` is written into the same typed arguments ([`FinetuneArgs::apply`]),
//! and the jobs API serialises a filled-in `FinetuneArgs` for its child (`finetune
//! --args-file`): one path for all three.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser};
use serde::{Deserialize, Serialize};

use super::config::FinetuneConfig;
use crate::checkpoint::identity::AllowedChanges;
use crate::fsdp::plan::{ShardingStrategy, WrapPolicy};
use crate::model_files::parse_dtype;
use crate::train::config_file::Setting;

#[derive(Args, Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FinetuneArgs {
    /// YAML settings: Accelerate FSDP plugin keys (fsdp_version, reshard_after_forward,
    /// mixed_precision, auto_wrap_policy, transformer_cls_names_to_wrap, min_num_params,
    /// activation_checkpointing, cpu_ram_efficient_loading, state_dict_type) and TrainingArguments
    /// keys (learning_rate, per_device_train_batch_size, ...). Flags given here win.
    /// Give it twice for two files (e.g. Accelerate's and a TrainingArguments one); two keys
    /// that set one flag differently are an error naming both.
    #[arg(long)]
    #[serde(skip)]
    pub config: Vec<PathBuf>,
    /// Every setting from a JSON file written by fsdp-app itself (the jobs API's children); no
    /// other flag may be given with it.
    #[arg(long, conflicts_with = "config")]
    #[serde(skip)]
    pub args_file: Option<PathBuf>,
    /// Local model directory or Hub id (resolved on rank 0 only).
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long)]
    pub revision: Option<String>,
    /// The chat template to render chat rows with instead of the model's (TRL's
    /// `chat_template_path`; vLLM's `--chat-template`): a Jinja file, or the template inline.
    /// The trained model is written with it, so it is served with the template it learned.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Training data: a file, or hf://datasets/ORG/NAME/FILE[@REVISION] (downloaded by rank 0).
    /// JSONL (a row per line), JSON (an array) or Parquet (snappy/zstd): {"text"}, {"prompt",
    /// "completion"}, {"messages": [{"role", "content"}]}, ShareGPT {"conversations": [{"from",
    /// "value"}]}, Alpaca {"instruction", "input", "output"}, or {"input_ids", "labels"}.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// What to train for: sft (next-token cross-entropy on the data's completions), dpo
    /// (direct preference optimisation on {"prompt", "chosen", "rejected"} pairs, OpenAI's DPO
    /// rows or pre-tokenised pairs; --batch-size and the global batch count pairs) or grpo
    /// (reinforcement learning on {"prompt", ...} rows scored by --grader; --batch-size counts
    /// prompts, each sampled --num-generations times).
    #[arg(long, default_value = "sft")]
    pub method: String,
    /// DPO's beta: how far the policy may move from the reference (TRL's default 0.1).
    #[arg(long)]
    pub dpo_beta: Option<f64>,
    /// DPO's loss: sigmoid (the paper's, default), hinge or ipo (TRL's loss_type names).
    #[arg(long)]
    pub dpo_loss: Option<String>,
    /// Which tokens the loss is on: auto (assistant turns of chats, completions, all of text),
    /// all, completion (the last assistant turn / the completion) or assistant (every assistant turn).
    #[arg(long, default_value = "auto")]
    pub train_on: String,
    /// Pack several samples into each --seq-len row (they cannot attend to each other; positions
    /// restart per sample) instead of padding each.
    #[arg(long)]
    pub packing: bool,
    /// Skip rows that cannot be read (and report how many) instead of stopping.
    #[arg(long)]
    pub skip_bad_rows: bool,
    /// Print the first training sample with the parts that are not trained on marked.
    #[arg(long)]
    pub show_sample: bool,
    /// Evaluation data (same formats as --data).
    #[arg(long)]
    pub eval_data: Option<PathBuf>,
    /// Hold out this fraction of the training rows (the last ones) for evaluation.
    #[arg(long)]
    pub eval_split: Option<f64>,
    /// Evaluate every N steps (and at the end); eval loss and perplexity go to the log and
    /// metrics.jsonl, and the curve to OUTPUT/loss.svg.
    #[arg(long)]
    pub eval_steps: Option<usize>,
    /// Where metrics.jsonl and the final Hugging Face model go (must be empty or absent).
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// Number of ranks as threads of this process (`local` backend; default 1). Under
    /// `fsdp-app launch`, torchrun, srun or mpirun the world comes from the environment instead.
    #[arg(long)]
    pub world_size: Option<usize>,
    #[command(flatten)]
    pub sharding: ShardingArgs,
    /// transformer_based_wrap: the layer class(es) that make units; must name the model's decoder
    /// layer (e.g. LlamaDecoderLayer). Checked, never ignored.
    #[arg(long)]
    pub transformer_cls_names_to_wrap: Option<String>,
    /// dtype gathered parameters travel in (f32, bf16, f16); on a GPU also the compute dtype.
    /// On a CPU compute is f32, and bf16 also rounds the linear layers' products to bf16 (f32
    /// sums, PyTorch's CPU autocast) where the CPU has AMX-BF16 tiles.
    #[arg(long, default_value = "f32")]
    pub param_dtype: String,
    /// dtype gradients are reduced in (f32, bf16, f16).
    #[arg(long, default_value = "f32")]
    pub reduce_dtype: String,
    #[arg(long, default_value_t = 2e-5)]
    pub lr: f64,
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Decay every parameter (default: not biases and norm weights).
    #[arg(long)]
    pub weight_decay_all: bool,
    /// Clip the global gradient norm to this (0 = off).
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f64,
    /// Sequences per rank per micro-batch.
    #[arg(long, default_value_t = 1)]
    pub batch_size: usize,
    /// Micro-batches accumulated per optimizer step.
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// Take the largest micro-batch (a divisor of --batch-size) that fits, accumulating more to
    /// keep the same global batch: on CPU ranks the one whose estimated memory per rank fits
    /// --max-memory-per-rank; on GPUs the first whose trial step does not run out of memory.
    #[arg(long)]
    pub auto_find_batch_size: bool,
    /// Memory budget per CPU rank for --auto-find-batch-size (e.g. 2GB, 800MB); default: the
    /// machine's available memory shared by its ranks.
    #[arg(long, requires = "auto_find_batch_size")]
    pub max_memory_per_rank: Option<String>,
    /// Tokens per sequence (default: 512, or the model's context when that is shorter; longer
    /// than the context is refused).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Stop after this many optimizer steps (overrides --epochs).
    #[arg(long)]
    pub max_steps: Option<usize>,
    #[arg(long, default_value_t = 1)]
    pub epochs: usize,
    #[arg(long, default_value_t = 0)]
    pub warmup_steps: usize,
    /// Warmup as a fraction of the run's optimizer steps (instead of --warmup-steps).
    #[arg(long)]
    pub warmup_ratio: Option<f64>,
    /// Print a step line every N steps (metrics.jsonl records every step).
    #[arg(long, default_value_t = 1)]
    pub logging_steps: usize,
    /// constant, linear or cosine (after linear warmup).
    #[arg(long, default_value = "linear")]
    pub lr_scheduler: String,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Take samples in file order.
    #[arg(long)]
    pub no_shuffle: bool,
    /// Collective backend: auto (local threads; under a launcher nccl with --device cuda, else
    /// tcp, or mpi under mpirun), local, tcp, mpi (build with --features mpi) or nccl (CUDA build).
    #[arg(long, default_value = "auto")]
    pub backend: String,
    /// Where each rank computes: cpu, or cuda (each rank its LOCAL_RANK GPU; CUDA build). The fp32
    /// master weights, gradients and AdamW state move to the GPU too (see --cpu-offload).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// With --device cuda: keep the fp32 master weights, gradients and AdamW state in host
    /// memory (FSDP2's CPUOffloadPolicy) instead of on the GPU; AdamW then runs on the CPU.
    #[arg(long)]
    pub cpu_offload: bool,
    /// Start each unit's all-gather while the unit before it computes, forward and backward,
    /// and leave each unit's reduce-scatter running under the next unit's backward (FSDP2's
    /// prefetch; one more unit's parameters and gradients held at a time): auto (with NCCL,
    /// whose collectives run on a stream of their own), on (also tcp, mpi and local, whose
    /// collectives then run on a thread of their own: CPU clusters, ranks sharing a GPU) or off.
    #[arg(long, default_value = "auto")]
    pub prefetch: String,
    /// Seconds a collective may wait for the other ranks before the run fails.
    #[arg(long, default_value_t = 600)]
    pub collective_timeout: u64,
    /// Largest safetensors file of the final export (e.g. 5GB, 500MB).
    #[arg(long, default_value = "5GB")]
    pub max_shard_size: String,
    /// Save a sharded checkpoint (weights, AdamW state, data cursor) to
    /// OUTPUT/checkpoint-STEP every N steps.
    #[arg(long)]
    pub save_steps: Option<usize>,
    /// When to save checkpoints, as TrainingArguments' `save_strategy`: `steps` (every
    /// --save-steps), `epoch` (at the end of every epoch) or `no`; default: `steps` with
    /// --save-steps, else `no`.
    #[arg(long, value_parser = ["no", "steps", "epoch"])]
    pub save_strategy: Option<String>,
    /// Keep only the newest K checkpoints.
    #[arg(long)]
    pub save_total_limit: Option<usize>,
    /// Continue from a checkpoint directory, or `latest` (the newest complete one in
    /// --output-dir). Any world size; the global batch must stay the same.
    #[arg(long)]
    pub resume_from_checkpoint: Option<String>,
    /// Resume although the checkpoint was trained on other data and/or with another tokenizer
    /// (refused by default, naming the difference).
    #[arg(long, value_delimiter = ',', value_parser = ["data", "tokenizer"])]
    pub resume_allow_changed: Vec<String>,
    /// Also write a full Hugging Face export to OUTPUT/export-STEP every N steps.
    #[arg(long)]
    pub save_full_every: Option<usize>,
    #[command(flatten)]
    pub lora: LoraArgs,
    #[command(flatten)]
    pub grpo: super::grpo_args::GrpoArgs,
    /// Continue training this PEFT LoRA adapter directory (its r, alpha, dropout and targets).
    #[arg(long, conflicts_with_all = ["lora_r", "lora_alpha", "lora_dropout", "lora_targets"])]
    pub adapter: Option<PathBuf>,
    /// With LoRA: also write the merged full model (W + alpha/r * B A) to OUTPUT/merged.
    #[arg(long)]
    pub merge_lora: bool,
}

/// How parameters are sharded and wrapped (finetune and estimate).
#[derive(Args, Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardingArgs {
    /// FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD.
    #[arg(long, default_value = "FULL_SHARD")]
    pub sharding_strategy: String,
    /// HYBRID_SHARD: ranks per shard group (consecutive ranks); replicated across groups.
    #[arg(long)]
    pub shard_group_size: Option<usize>,
    /// transformer_based_wrap (one unit per decoder layer + root), size_based_wrap or no_wrap.
    #[arg(long, default_value = "transformer_based_wrap")]
    pub wrap_policy: String,
    /// size_based_wrap: smallest number of parameters in a unit.
    #[arg(long)]
    pub min_num_params: Option<usize>,
    /// Recompute each unit's forward in backward instead of keeping its graph.
    #[arg(long)]
    pub activation_checkpointing: bool,
}

impl ShardingArgs {
    pub fn strategy(&self) -> Result<ShardingStrategy> {
        self.sharding_strategy.parse()
    }

    /// The wrap policy, with --min-num-params applied (and refused for other policies).
    pub fn wrap(&self) -> Result<WrapPolicy> {
        let mut wrap: WrapPolicy = self.wrap_policy.parse()?;
        match (&mut wrap, self.min_num_params) {
            (WrapPolicy::SizeBased { min_num_params }, Some(n)) => *min_num_params = n,
            (_, Some(_)) => bail!("--min-num-params applies to --wrap-policy size_based_wrap only"),
            _ => {}
        }
        Ok(wrap)
    }
}

#[derive(Args, Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraArgs {
    /// Train a LoRA adapter (PEFT format, in OUTPUT) on the frozen base instead of every weight.
    /// Implied by any --lora-* flag.
    #[arg(long)]
    pub lora: bool,
    /// LoRA rank (default 8, as PEFT).
    #[arg(long)]
    pub lora_r: Option<usize>,
    /// LoRA alpha; the update is scaled by alpha / r (default 8, as PEFT).
    #[arg(long)]
    pub lora_alpha: Option<f64>,
    /// Dropout on the adapter's input while training (default 0).
    #[arg(long)]
    pub lora_dropout: Option<f64>,
    /// Modules to adapt, comma-separated: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    /// down_proj, or all-linear (default q_proj,v_proj, PEFT's choice for these models).
    #[arg(long)]
    pub lora_targets: Option<String>,
}

/// LoRA settings from the flags (each unset one at its default, `LoraSettings::default`), or
/// None when no LoRA flag is given.
pub fn lora_settings(a: &LoraArgs) -> Option<models::LoraSettings> {
    let on = a.lora || a.lora_r.is_some() || a.lora_alpha.is_some() || a.lora_dropout.is_some() || a.lora_targets.is_some();
    let d = models::LoraSettings::default();
    let targets = |t: &str| t.split(',').map(|t| t.trim().to_string()).filter(|t| !t.is_empty()).collect();
    on.then(|| models::LoraSettings {
        r: a.lora_r.unwrap_or(d.r),
        alpha: a.lora_alpha.unwrap_or(d.alpha),
        dropout: a.lora_dropout.unwrap_or(d.dropout),
        targets: a.lora_targets.as_deref().map(targets).unwrap_or(d.targets),
        use_rslora: d.use_rslora,
    })
}

impl FinetuneArgs {
    /// Every flag at its default (model, data and output directory unset).
    pub fn defaults() -> Self {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            args: FinetuneArgs,
        }
        Only::try_parse_from(["finetune"]).expect("every finetune flag has a default or is optional").args
    }

    /// These arguments with `settings` (from `--config` files) written in, except those whose
    /// flag `given` says the command line set (flags win). Each value goes into its field as
    /// serde reads the field, so a file's value means what the flag's does and a wrong type is
    /// refused naming the file and key.
    pub fn apply(self, settings: &[Setting], given: &dyn Fn(&str) -> bool) -> Result<Self> {
        let mut fields = serde_json::to_value(&self)?;
        for s in settings.iter().filter(|s| !given(s.flag)) {
            // The value as the flag would read it from text: a number or boolean where the field
            // is a string (a revision of digits), a quoted number where it is a number.
            let alternative = match &s.value {
                serde_json::Value::Number(n) => Some(serde_json::Value::String(n.to_string())),
                serde_json::Value::Bool(b) => Some(serde_json::Value::String(b.to_string())),
                serde_json::Value::String(t) => serde_json::from_str::<serde_json::Number>(t.trim()).ok().map(serde_json::Value::Number),
                _ => None,
            };
            fields = match (with_field(&fields, s, s.value.clone()), alternative) {
                (Ok(f), _) => f,
                (Err(e), Some(text)) => with_field(&fields, s, text).map_err(|_| e)?,
                (Err(e), None) => return Err(e),
            };
        }
        let mut out: Self = serde_json::from_value(fields)?;
        (out.config, out.args_file) = (self.config, self.args_file);
        Ok(out)
    }

    /// A settings file written by [`FinetuneArgs::write_file`] (the jobs runner's).
    pub fn read_file(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{}: not a finetune settings file", path.display()))
    }

    /// Writes the settings as JSON (temporary name, then rename).
    pub fn write_file(&self, path: &std::path::Path) -> Result<()> {
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(self)?).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
    }
}

/// The JSON field of flag `flag` in serialised [`FinetuneArgs`]: in one of the flattened groups
/// (`sharding`, `lora`: the `--lora` switch is `lora.lora`), else top-level.
fn field_mut<'a>(fields: &'a mut serde_json::Value, flag: &str) -> Option<&'a mut serde_json::Value> {
    match ["sharding", "lora", "grpo"].into_iter().find(|g| fields[*g].get(flag).is_some()) {
        Some(group) => fields[group].get_mut(flag),
        None => fields.get_mut(flag),
    }
}

/// `fields` (serialised [`FinetuneArgs`]) with setting `s`'s field set to `value`, if the
/// arguments still read; else the error, naming the file and key.
fn with_field(fields: &serde_json::Value, s: &Setting, value: serde_json::Value) -> Result<serde_json::Value> {
    let mut out = fields.clone();
    *field_mut(&mut out, s.flag).with_context(|| format!("{}: no finetune flag --{}", s.origin(), s.flag))? = value;
    match serde_json::from_value::<FinetuneArgs>(out.clone()) {
        Ok(_) => Ok(out),
        Err(e) => bail!("{}: {}", s.origin(), serde_reason(&e.into())),
    }
}

/// serde's complaint about a value, without the struct's position in the JSON.
fn serde_reason(e: &anyhow::Error) -> String {
    let text = format!("{e:#}");
    match text.find(" at line ") {
        Some(i) => text[..i].to_string(),
        None => text,
    }
}

impl TryFrom<FinetuneArgs> for FinetuneConfig {
    type Error = anyhow::Error;

    fn try_from(a: FinetuneArgs) -> Result<Self> {
        let wrap = a.sharding.wrap()?;
        let missing = |flag: &str, key: &str| anyhow::anyhow!("--{flag} is required (or `{key}` in --config)");
        if a.transformer_cls_names_to_wrap.is_some() && wrap != WrapPolicy::TransformerBased {
            bail!("transformer_cls_names_to_wrap applies to transformer_based_wrap only");
        }
        Ok(FinetuneConfig {
            lora: lora_settings(&a.lora),
            adapter: a.adapter,
            merge_lora: a.merge_lora,
            model: a.model.ok_or_else(|| missing("model", "model_name_or_path"))?,
            revision: a.revision,
            chat_template: a.chat_template,
            data: a.data.ok_or_else(|| missing("data", "train_file"))?,
            output_dir: a.output_dir.ok_or_else(|| missing("output-dir", "output_dir"))?,
            layer_class_names: a.transformer_cls_names_to_wrap,
            world_size: a.world_size.unwrap_or(1),
            shard_group_size: a.sharding.shard_group_size,
            lr: a.lr,
            weight_decay: a.weight_decay,
            weight_decay_all: a.weight_decay_all,
            max_grad_norm: (a.max_grad_norm > 0.0).then_some(a.max_grad_norm),
            batch_size: a.batch_size,
            grad_accum: a.grad_accum,
            auto_find_batch_size: a.auto_find_batch_size,
            max_memory_per_rank: a
                .max_memory_per_rank
                .as_deref()
                .map(crate::model_files::export::parse_size)
                .transpose()
                .context("--max-memory-per-rank")?,
            seq_len: a.seq_len,
            max_steps: a.max_steps,
            epochs: a.epochs,
            warmup_steps: a.warmup_steps,
            warmup_ratio: a.warmup_ratio,
            logging_steps: a.logging_steps,
            schedule: a.lr_scheduler.parse()?,
            seed: a.seed,
            shuffle: !a.no_shuffle,
            strategy: a.sharding.strategy()?,
            wrap,
            activation_checkpointing: a.sharding.activation_checkpointing,
            param_dtype: parse_dtype(&a.param_dtype).context("--param-dtype")?,
            reduce_dtype: parse_dtype(&a.reduce_dtype).context("--reduce-dtype")?,
            collective_timeout: std::time::Duration::from_secs(a.collective_timeout),
            backend: a.backend.parse()?,
            device: a.device.parse()?,
            cpu_offload: a.cpu_offload.then_some(true),
            prefetch: match a.prefetch.as_str() {
                "auto" => None,
                "on" | "true" => Some(true),
                "off" | "false" => Some(false),
                other => bail!("--prefetch: expected auto, on or off, got {other:?}"),
            },
            save_steps: a.save_steps,
            save_each_epoch: save_each_epoch(a.save_strategy.as_deref(), a.save_steps)?,
            save_total_limit: a.save_total_limit,
            resume_from: a.resume_from_checkpoint,
            resume_allow_changed: AllowedChanges::parse(&a.resume_allow_changed)?,
            save_full_every: a.save_full_every,
            train_on: a.train_on.parse()?,
            dpo: crate::train::dpo::DpoSettings::from_flags(&a.method, a.dpo_beta, a.dpo_loss.as_deref())?,
            grpo: a.grpo.config(&a.method)?,
            skip_bad_rows: a.skip_bad_rows,
            packing: a.packing,
            show_sample: a.show_sample,
            eval_data: a.eval_data,
            eval_split: a.eval_split,
            eval_steps: a.eval_steps,
            max_shard_size: crate::model_files::export::parse_size(&a.max_shard_size).context("--max-shard-size")?,
            verbose: true,
        })
    }
}

impl FinetuneConfig {
    /// The CLI's defaults (from [`FinetuneArgs`], where they are written) for everything but
    /// model, data and output directory; quiet.
    pub fn new(model: &str, data: &std::path::Path, output_dir: &std::path::Path) -> Self {
        let mut a = FinetuneArgs::defaults();
        (a.model, a.data, a.output_dir) = (Some(model.to_string()), Some(data.to_path_buf()), Some(output_dir.to_path_buf()));
        let mut cfg = Self::try_from(a).expect("the default settings convert");
        cfg.verbose = false;
        cfg
    }
}

/// `--save-strategy` with `--save-steps`: whether to save at every epoch's end. A pair that
/// contradicts itself is refused rather than one of them ignored.
fn save_each_epoch(strategy: Option<&str>, save_steps: Option<usize>) -> Result<bool> {
    match (strategy, save_steps) {
        (Some("epoch"), None) => Ok(true),
        (None | Some("steps"), Some(_)) | (None | Some("no"), None) => Ok(false),
        (Some("steps"), None) => bail!("--save-strategy steps needs --save-steps N"),
        (Some(s), Some(n)) => bail!("--save-strategy {s} and --save-steps {n} contradict each other: give one"),
        (Some(s), None) => bail!("--save-strategy {s:?}: expected no, steps or epoch"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flags as the CLI parses them.
    fn flags(argv: &[&str]) -> FinetuneArgs {
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: FinetuneArgs,
        }
        Cli::try_parse_from(std::iter::once("finetune").chain(argv.iter().copied())).unwrap().args
    }

    fn from_yaml(text: &str, given: &dyn Fn(&str) -> bool) -> Result<FinetuneArgs> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.yaml");
        std::fs::write(&path, text).unwrap();
        FinetuneArgs::defaults().apply(&crate::train::config_file::load(&path)?, given)
    }

    #[test]
    fn config_values_go_into_the_typed_flags_or_are_refused_by_file_and_key() {
        let a = from_yaml("learning_rate: 2e-5\nper_device_train_batch_size: 4\nactivation_checkpointing: true\nrevision: 1234\nlora_alpha: \"16\"\nshuffle: false\n", &|_| false).unwrap();
        assert_eq!((a.lr, a.batch_size, a.sharding.activation_checkpointing), (2e-5, 4, true));
        assert_eq!((a.revision.as_deref(), a.lora.lora_alpha, a.no_shuffle), (Some("1234"), Some(16.0), true));
        let e = format!("{:#}", from_yaml("per_device_train_batch_size: two\n", &|_| false).unwrap_err());
        assert!(e.contains("c.yaml: key `per_device_train_batch_size` (two)") && e.contains("expected usize"), "{e}");
        let e = format!("{:#}", from_yaml("lora_r: 0.5\n", &|_| false).unwrap_err());
        assert!(e.contains("key `lora_r` (0.5)"), "{e}");
        // A flag the command line gave wins.
        assert_eq!(from_yaml("learning_rate: 1e-3\n", &|f| f == "lr").unwrap().lr, 2e-5);
    }

    /// PEFT's LoRA defaults, one place: `--lora` on the command line, `lora: true` in a YAML file
    /// and a job with `fsdp_app.lora: {}` train the same adapter; and the CLI and the YAML file
    /// give the same run otherwise.
    #[test]
    fn cli_yaml_and_a_job_with_nothing_set_take_the_same_lora_settings() {
        let required = ["--model", "m", "--data", "d.jsonl", "--output-dir", "out"];
        let cli = flags(&[&["--lora"][..], &required].concat());
        let yaml = from_yaml("lora: true\nmodel: m\ndata: d.jsonl\noutput_dir: out\n", &|_| false).unwrap();
        let job = crate::serve::jobs::runner::tests::job_args_with_default_lora();
        let settings = |a: FinetuneArgs| FinetuneConfig::try_from(a).unwrap();
        let (cli, yaml, job) = (settings(cli), settings(yaml), settings(job));
        assert_eq!(cli.lora, Some(models::LoraSettings::default()));
        assert_eq!((&yaml.lora, &job.lora), (&cli.lora, &cli.lora));
        assert_eq!(format!("{cli:?}"), format!("{yaml:?}"));
    }

    #[test]
    fn save_strategy_and_save_steps_agree_or_are_refused_by_name() {
        assert!(save_each_epoch(Some("epoch"), None).unwrap());
        assert!(!save_each_epoch(None, Some(5)).unwrap());
        assert!(!save_each_epoch(Some("steps"), Some(5)).unwrap());
        assert!(!save_each_epoch(None, None).unwrap());
        let err = save_each_epoch(Some("epoch"), Some(5)).unwrap_err().to_string();
        assert!(err.contains("--save-strategy epoch") && err.contains("--save-steps 5"), "{err}");
        assert!(save_each_epoch(Some("steps"), None).unwrap_err().to_string().contains("needs --save-steps"));
    }
}
