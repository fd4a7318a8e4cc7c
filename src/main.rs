//! The `fsdp-app` command line.

use std::collections::HashSet;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use fsdp_app::checkpoint::{load_model_with_adapter, parse_dtype, resolve_model};
use fsdp_app::generate::{generate, GenerationDefaults, SamplingParams};
use fsdp_app::memory::{human_bytes, peak_rss_bytes};
use fsdp_app::tokenize::{ChatMessage, TextTokenizer};

#[derive(Parser)]
#[command(name = "fsdp-app", version, about = "Fine-tune and serve Hugging Face causal language models, on candle")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt with a model from a local directory or the Hugging Face Hub.
    Generate(GenerateArgs),
    /// Convert a llama.cpp GGUF file into a Hugging Face model directory (safetensors, config,
    /// tokenizer, chat template).
    Convert(ConvertArgs),
    /// Full fine-tuning with FSDP-style sharding across ranks (`--world-size N` runs N ranks as
    /// threads of this process).
    Finetune(Box<FinetuneArgs>),
    /// Turn a sharded checkpoint into a Hugging Face model directory (one CPU process, memory
    /// about one tensor).
    Merge(MergeArgs),
    /// Start this node's ranks as processes with torchrun's variables, e.g.
    /// `fsdp-app launch --nproc-per-node 2 -- finetune --model M --data D --output-dir O`.
    Launch(LaunchArgs),
    /// Write a tiny random model directory (for tests and for trying fsdp-app offline).
    Fixture(FixtureArgs),
    /// Serve a model over an OpenAI-compatible HTTP API (/v1/models, /v1/completions,
    /// /v1/chat/completions with SSE streaming, /health, /metrics, /tokenize, /detokenize, /info).
    Serve(ServeArgs),
    /// Per-rank memory of a fine-tuning run (parameters, gradients, optimizer, gathered units,
    /// activations) from config.json alone, without reading weights.
    Estimate(EstimateArgs),
}

#[derive(Args)]
struct ModelArgs {
    /// Local model directory, or a Hub id such as `HuggingFaceTB/SmolLM2-135M-Instruct`.
    /// Hub downloads honour HF_ENDPOINT, HF_HOME, HF_HUB_CACHE, HF_TOKEN and HF_HUB_OFFLINE.
    #[arg(long)]
    model: String,
    /// Hub branch, tag or commit (Hub ids only).
    #[arg(long)]
    revision: Option<String>,
    /// Compute dtype: f32 (default; fastest on CPU), bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Where to run: cpu, cuda (GPU 0) or cuda:N; GPUs need a CUDA build (tests/gpu/build-cuda.sh).
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) to apply.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// A system message (with --chat).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy. Default: generation_config.json's when it samples, else 0.
    #[arg(long)]
    temperature: Option<f64>,
    /// Keep only the k most likely tokens (sampling only).
    #[arg(long)]
    top_k: Option<usize>,
    /// Nucleus sampling: keep the smallest set of tokens with this total probability.
    #[arg(long)]
    top_p: Option<f64>,
    /// Penalise tokens already in the context (1.0 = off), as transformers does.
    #[arg(long)]
    repetition_penalty: Option<f32>,
    #[arg(long, default_value_t = 299_792_458)]
    seed: u64,
    /// Stop when the text contains this string (repeatable); the string is not printed.
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// Print one JSON object (text, token ids, finish reason, figures) instead of streaming.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ConvertArgs {
    /// The GGUF file.
    #[arg(long)]
    gguf: PathBuf,
    /// Output directory (must not exist, or be empty).
    #[arg(long)]
    out: PathBuf,
    /// dtype of the written safetensors: bf16 (default) or f32.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f32"])]
    dtype: String,
}

#[derive(Args)]
struct FinetuneArgs {
    /// YAML settings: Accelerate FSDP plugin keys (fsdp_version, reshard_after_forward,
    /// mixed_precision, auto_wrap_policy, transformer_cls_names_to_wrap, min_num_params,
    /// activation_checkpointing, cpu_ram_efficient_loading, state_dict_type) and TrainingArguments
    /// keys (learning_rate, per_device_train_batch_size, ...). Flags given here win.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Local model directory or Hub id (resolved on rank 0 only).
    #[arg(long)]
    model: Option<String>,
    #[arg(long)]
    revision: Option<String>,
    /// Training data: a file, or hf://datasets/ORG/NAME/FILE[@REVISION] (downloaded by rank 0).
    /// JSONL (a row per line), JSON (an array) or Parquet (snappy/zstd): {"text"}, {"prompt",
    /// "completion"}, {"messages": [{"role", "content"}]}, ShareGPT {"conversations": [{"from",
    /// "value"}]}, Alpaca {"instruction", "input", "output"}, or {"input_ids", "labels"}.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Which tokens the loss is on: auto (assistant turns of chats, completions, all of text),
    /// all, completion (the last assistant turn / the completion) or assistant (every assistant turn).
    #[arg(long, default_value = "auto")]
    train_on: String,
    /// Pack several samples into each --seq-len row (they cannot attend to each other; positions
    /// restart per sample) instead of padding each.
    #[arg(long)]
    packing: bool,
    /// Skip rows that cannot be read (and report how many) instead of stopping.
    #[arg(long)]
    skip_bad_rows: bool,
    /// Print the first training sample with the parts that are not trained on marked.
    #[arg(long)]
    show_sample: bool,
    /// Evaluation data (same formats as --data).
    #[arg(long)]
    eval_data: Option<PathBuf>,
    /// Hold out this fraction of the training rows (the last ones) for evaluation.
    #[arg(long)]
    eval_split: Option<f64>,
    /// Evaluate every N steps (and at the end); eval loss and perplexity go to the log and
    /// metrics.jsonl, and the curve to OUTPUT/loss.svg.
    #[arg(long)]
    eval_steps: Option<usize>,
    /// Where metrics.jsonl and the final Hugging Face model go (must be empty or absent).
    #[arg(long)]
    output_dir: Option<PathBuf>,
    /// Number of ranks as threads of this process (`local` backend; default 1). Under
    /// `fsdp-app launch`, torchrun, srun or mpirun the world comes from the environment instead.
    #[arg(long)]
    world_size: Option<usize>,
    #[command(flatten)]
    sharding: ShardingArgs,
    /// transformer_based_wrap: the layer class(es) that make units; must name the model's decoder
    /// layer (e.g. LlamaDecoderLayer). Checked, never ignored.
    #[arg(long)]
    transformer_cls_names_to_wrap: Option<String>,
    /// dtype gathered parameters travel in (f32, bf16, f16); on a GPU also the compute dtype,
    /// on CPU compute is f32.
    #[arg(long, default_value = "f32")]
    param_dtype: String,
    /// dtype gradients are reduced in (f32, bf16, f16).
    #[arg(long, default_value = "f32")]
    reduce_dtype: String,
    #[arg(long, default_value_t = 2e-5)]
    lr: f64,
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Decay every parameter (default: not biases and norm weights).
    #[arg(long)]
    weight_decay_all: bool,
    /// Clip the global gradient norm to this (0 = off).
    #[arg(long, default_value_t = 1.0)]
    max_grad_norm: f64,
    /// Sequences per rank per micro-batch.
    #[arg(long, default_value_t = 1)]
    batch_size: usize,
    /// Micro-batches accumulated per optimizer step.
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    #[arg(long, default_value_t = 512)]
    seq_len: usize,
    /// Stop after this many optimizer steps (overrides --epochs).
    #[arg(long)]
    max_steps: Option<usize>,
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    #[arg(long, default_value_t = 0)]
    warmup_steps: usize,
    /// constant, linear or cosine (after linear warmup).
    #[arg(long, default_value = "linear")]
    lr_scheduler: String,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Take samples in file order.
    #[arg(long)]
    no_shuffle: bool,
    /// Collective backend: auto (local threads; under a launcher nccl with --device cuda, else
    /// tcp, or mpi under mpirun), local, tcp, mpi (build with --features mpi) or nccl (CUDA build).
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Where each rank computes: cpu, or cuda (each rank its LOCAL_RANK GPU; CUDA build). The fp32
    /// master weights, gradients and AdamW state move to the GPU too (see --cpu-offload).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// With --device cuda: keep the fp32 master weights, gradients and AdamW state in host
    /// memory (FSDP2's CPUOffloadPolicy) instead of on the GPU; AdamW then runs on the CPU.
    #[arg(long)]
    cpu_offload: bool,
    /// Seconds a collective may wait for the other ranks before the run fails.
    #[arg(long, default_value_t = 600)]
    collective_timeout: u64,
    /// Largest safetensors file of the final export (e.g. 5GB, 500MB).
    #[arg(long, default_value = "5GB")]
    max_shard_size: String,
    /// Save a sharded checkpoint (weights, AdamW state, data cursor) to
    /// OUTPUT/checkpoint-STEP every N steps.
    #[arg(long)]
    save_steps: Option<usize>,
    /// Keep only the newest K checkpoints.
    #[arg(long)]
    save_total_limit: Option<usize>,
    /// Continue from a checkpoint directory, or `latest` (the newest complete one in
    /// --output-dir). Any world size; the global batch must stay the same.
    #[arg(long)]
    resume_from_checkpoint: Option<String>,
    /// Resume although the checkpoint was trained on other data and/or with another tokenizer
    /// (refused by default, naming the difference).
    #[arg(long, value_delimiter = ',', value_parser = ["data", "tokenizer"])]
    resume_allow_changed: Vec<String>,
    /// Also write a full Hugging Face export to OUTPUT/export-STEP every N steps.
    #[arg(long)]
    save_full_every: Option<usize>,
    #[command(flatten)]
    lora: LoraArgs,
    /// Continue training this PEFT LoRA adapter directory (its r, alpha, dropout and targets).
    #[arg(long, conflicts_with_all = ["lora_r", "lora_alpha", "lora_dropout", "lora_targets"])]
    adapter: Option<PathBuf>,
    /// With LoRA: also write the merged full model (W + alpha/r * B A) to OUTPUT/merged.
    #[arg(long)]
    merge_lora: bool,
}

/// How parameters are sharded and wrapped (finetune and estimate).
#[derive(Args)]
struct ShardingArgs {
    /// FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD.
    #[arg(long, default_value = "FULL_SHARD")]
    sharding_strategy: String,
    /// HYBRID_SHARD: ranks per shard group (consecutive ranks); replicated across groups.
    #[arg(long)]
    shard_group_size: Option<usize>,
    /// transformer_based_wrap (one unit per decoder layer + root), size_based_wrap or no_wrap.
    #[arg(long, default_value = "transformer_based_wrap")]
    wrap_policy: String,
    /// size_based_wrap: smallest number of parameters in a unit.
    #[arg(long)]
    min_num_params: Option<usize>,
    /// Recompute each unit's forward in backward instead of keeping its graph.
    #[arg(long)]
    activation_checkpointing: bool,
}

impl ShardingArgs {
    fn strategy(&self) -> Result<fsdp_app::fsdp::plan::ShardingStrategy> {
        self.sharding_strategy.parse()
    }

    /// The wrap policy, with --min-num-params applied (and refused for other policies).
    fn wrap(&self) -> Result<fsdp_app::fsdp::plan::WrapPolicy> {
        use fsdp_app::fsdp::plan::WrapPolicy;
        let mut wrap: WrapPolicy = self.wrap_policy.parse()?;
        match (&mut wrap, self.min_num_params) {
            (WrapPolicy::SizeBased { min_num_params }, Some(n)) => *min_num_params = n,
            (_, Some(_)) => anyhow::bail!("--min-num-params applies to --wrap-policy size_based_wrap only"),
            _ => {}
        }
        Ok(wrap)
    }
}

#[derive(Args)]
struct LoraArgs {
    /// Train a LoRA adapter (PEFT format, in OUTPUT) on the frozen base instead of every weight.
    /// Implied by any --lora-* flag.
    #[arg(long)]
    lora: bool,
    /// LoRA rank (default 8, as PEFT).
    #[arg(long)]
    lora_r: Option<usize>,
    /// LoRA alpha; the update is scaled by alpha / r (default 8, as PEFT).
    #[arg(long)]
    lora_alpha: Option<f64>,
    /// Dropout on the adapter's input while training (default 0).
    #[arg(long)]
    lora_dropout: Option<f64>,
    /// Modules to adapt, comma-separated: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    /// down_proj, or all-linear (default q_proj,v_proj, PEFT's choice for these models).
    #[arg(long)]
    lora_targets: Option<String>,
}

#[derive(Args)]
struct ServeArgs {
    /// Local model directory or Hub id.
    #[arg(long)]
    model: String,
    #[arg(long)]
    revision: Option<String>,
    /// The model id clients send (default: the --model string).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Address to bind; 127.0.0.1 keeps the server local (use 0.0.0.0 to expose it).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0 picks a free one; the chosen address is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long, env = "FSDP_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Sequences generated together; more wait in the queue.
    #[arg(long, default_value_t = 8)]
    max_concurrent_requests: usize,
    /// Requests that may wait for a slot; beyond that the answer is 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Longest prompt in tokens (default: the context minus one).
    #[arg(long)]
    max_input_tokens: Option<usize>,
    /// Longest prompt + completion in tokens (default: the model's context).
    #[arg(long)]
    max_total_tokens: Option<usize>,
    /// Largest request body in bytes (file uploads: up to 512 MiB).
    #[arg(long, default_value_t = 4 << 20)]
    max_body_bytes: usize,
    /// Where the models compute: cpu, cuda (GPU 0) or cuda:N (CUDA build).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Compute dtype: f32 (default; fastest on CPU), bf16 (GPUs) or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Where uploaded files, fine-tuning jobs (SQLite) and fine-tuned models are kept.
    #[arg(long, default_value = "fsdp-serve-data")]
    data_dir: PathBuf,
}

#[derive(Args)]
struct EstimateArgs {
    /// Local model directory or Hub id (only config.json is read or downloaded).
    #[arg(long)]
    model: String,
    #[arg(long)]
    revision: Option<String>,
    #[arg(long, default_value_t = 1)]
    world_size: usize,
    #[command(flatten)]
    sharding: ShardingArgs,
    /// Sequences per rank per micro-batch.
    #[arg(long, default_value_t = 1)]
    batch_size: usize,
    #[arg(long, default_value_t = 512)]
    seq_len: usize,
    #[command(flatten)]
    lora: LoraArgs,
    /// How the ranks run: tcp (processes under `fsdp-app launch`; rank 0 relays collectives),
    /// mpi, or local (threads of one process, whose memory is the sum of its ranks').
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "mpi", "local"])]
    backend: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct MergeArgs {
    /// A sharded checkpoint directory (OUTPUT/checkpoint-STEP).
    checkpoint: PathBuf,
    /// Where the Hugging Face model goes (must not exist, or be empty).
    out: PathBuf,
    /// dtype of the written weights: f32 (as trained) or bf16.
    #[arg(long, default_value = "f32", value_parser = ["bf16", "f32", "f16"])]
    dtype: String,
    #[arg(long, default_value = "5GB")]
    max_shard_size: String,
}

#[derive(Args)]
struct LaunchArgs {
    /// Ranks (processes) on this node.
    #[arg(long)]
    nproc_per_node: usize,
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of the node running rank 0.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    #[arg(long, default_value_t = fsdp_app::dist::env::DEFAULT_MASTER_PORT)]
    master_port: u16,
    /// Seconds the other ranks get to stop by themselves after one fails, before being killed.
    #[arg(long, default_value_t = 30)]
    grace: u64,
    /// The command each rank runs (after `--`).
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

#[derive(Args)]
struct FixtureArgs {
    /// Which fixture: llama (GQA, untied, sharded, Llama 3 rope scaling), qwen2 (qkv bias, tied),
    /// qwen3 (q/k norm), mistral (sliding window).
    #[arg(long, value_parser = fsdp_app::fixtures::FIXTURE_NAMES.to_vec())]
    name: String,
    #[arg(long)]
    out: PathBuf,
    /// Replace a config.json field, e.g. `--set hidden_size=1024 --set num_hidden_layers=12`
    /// (value as JSON), to make random models of any size.
    #[arg(long = "set", value_name = "FIELD=VALUE")]
    set: Vec<String>,
}

/// Adds the flags a `finetune --config FILE` sets, except those given on the command line.
fn apply_config_file(argv: Vec<std::ffi::OsString>) -> Result<Vec<std::ffi::OsString>> {
    use clap::parser::ValueSource;
    use clap::CommandFactory;
    let Ok(matches) = Cli::command().try_get_matches_from(&argv) else { return Ok(argv) };
    let Some(("finetune", sub)) = matches.subcommand() else { return Ok(argv) };
    let Some(path) = sub.get_one::<PathBuf>("config") else { return Ok(argv) };
    let mut out = argv.clone();
    for setting in fsdp_app::train::config_file::load(path)? {
        if sub.value_source(setting.flag) == Some(ValueSource::CommandLine) {
            continue;
        }
        let flag = format!("--{}", setting.flag.replace('_', "-"));
        match setting.value.as_str() {
            "true" if is_switch(setting.flag) => out.push(flag.into()),
            "false" if is_switch(setting.flag) => {}
            v => {
                out.push(flag.into());
                out.push(v.into());
            }
        }
    }
    Ok(out)
}

fn is_switch(flag: &str) -> bool {
    matches!(flag, "activation_checkpointing" | "weight_decay_all" | "packing" | "skip_bad_rows" | "no_shuffle" | "lora" | "merge_lora")
}

/// LoRA settings from the flags, or None when no LoRA flag is given.
fn lora_settings(a: &LoraArgs) -> Option<models::LoraSettings> {
    let on = a.lora || a.lora_r.is_some() || a.lora_alpha.is_some() || a.lora_dropout.is_some() || a.lora_targets.is_some();
    on.then(|| models::LoraSettings {
        r: a.lora_r.unwrap_or(8),
        alpha: a.lora_alpha.unwrap_or(8.0),
        dropout: a.lora_dropout.unwrap_or(0.0),
        targets: a.lora_targets.as_deref().unwrap_or("q_proj,v_proj").split(',').map(|t| t.trim().to_string()).filter(|t| !t.is_empty()).collect(),
        use_rslora: false,
    })
}

fn main() {
    fsdp_app::tune_cpu_threads();
    let argv = match apply_config_file(std::env::args_os().collect()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    };
    let cli = Cli::parse_from(argv);
    let result = match cli.command {
        Command::Generate(a) => run_generate(a),
        Command::Convert(a) => run_convert(a),
        Command::Finetune(a) => run_finetune(*a),
        Command::Merge(a) => run_merge(a),
        Command::Launch(a) => fsdp_app::dist::launch::launch(&fsdp_app::dist::launch::LaunchConfig {
            nproc_per_node: a.nproc_per_node,
            nnodes: a.nnodes,
            node_rank: a.node_rank,
            master_addr: a.master_addr,
            master_port: a.master_port,
            grace: std::time::Duration::from_secs(a.grace),
            command: a.command,
        }),
        Command::Fixture(a) => run_fixture(a),
        Command::Estimate(a) => run_estimate(a),
        Command::Serve(a) => run_serve(a),
    };
    if let Err(e) = result {
        if std::env::var_os("RUST_BACKTRACE").is_some() {
            eprintln!("error: {e:?}");
        } else {
            eprintln!("error: {e:#}");
        }
        std::process::exit(1);
    }
}

fn run_serve(a: ServeArgs) -> Result<()> {
    fsdp_app::serve::run(&fsdp_app::serve::ServeConfig {
        model: a.model,
        revision: a.revision,
        served_model_name: a.served_model_name,
        host: a.host,
        port: a.port,
        api_key: a.api_key,
        max_concurrent_requests: a.max_concurrent_requests,
        max_queue: a.max_queue,
        max_input_tokens: a.max_input_tokens,
        max_total_tokens: a.max_total_tokens,
        max_body_bytes: a.max_body_bytes,
        data_dir: a.data_dir,
        device: a.device.parse()?,
        dtype: parse_dtype(&a.dtype).context("--dtype")?,
    })
}

fn run_finetune(a: FinetuneArgs) -> Result<()> {
    use fsdp_app::fsdp::plan::WrapPolicy;
    let wrap = a.sharding.wrap()?;
    let missing = |flag: &str, key: &str| anyhow::anyhow!("--{flag} is required (or `{key}` in --config)");
    if a.transformer_cls_names_to_wrap.is_some() && wrap != WrapPolicy::TransformerBased {
        anyhow::bail!("transformer_cls_names_to_wrap applies to transformer_based_wrap only");
    }
    let lora = lora_settings(&a.lora);
    let cfg = fsdp_app::train::finetune::FinetuneConfig {
        lora,
        adapter: a.adapter,
        merge_lora: a.merge_lora,
        model: a.model.ok_or_else(|| missing("model", "model_name_or_path"))?,
        revision: a.revision,
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
        seq_len: a.seq_len,
        max_steps: a.max_steps,
        epochs: a.epochs,
        warmup_steps: a.warmup_steps,
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
        save_steps: a.save_steps,
        save_total_limit: a.save_total_limit,
        resume_from: a.resume_from_checkpoint,
        resume_allow_changed: fsdp_app::checkpoint::identity::AllowedChanges::parse(&a.resume_allow_changed)?,
        save_full_every: a.save_full_every,
        train_on: a.train_on.parse()?,
        skip_bad_rows: a.skip_bad_rows,
        packing: a.packing,
        show_sample: a.show_sample,
        eval_data: a.eval_data,
        eval_split: a.eval_split,
        eval_steps: a.eval_steps,
        max_shard_size: fsdp_app::checkpoint::export::parse_size(&a.max_shard_size).context("--max-shard-size")?,
        verbose: true,
    };
    let env = fsdp_app::dist::env::DistEnv::from_env()?;
    if let (Some(env), Some(w)) = (&env, a.world_size) {
        if w != env.world_size {
            anyhow::bail!("--world-size {w} disagrees with the {} environment (WORLD_SIZE {})", env.launcher, env.world_size);
        }
    }
    let start = Instant::now();
    let Some(summary) = fsdp_app::train::finetune::run(&cfg, env.as_ref())? else {
        // A rank other than 0: rank 0 reports for the job; each process reports its own memory.
        eprintln!(
            "rank {}: done, peak RSS of this process {}",
            env.as_ref().map(|e| e.rank).unwrap_or(0),
            peak_rss_bytes().map(human_bytes).unwrap_or_else(|| "n/a".into())
        );
        return Ok(());
    };
    eprintln!(
        "rank 0: finetune: {} steps in {:.1}s, final loss {:.4}, peak RSS of this process {}",
        summary.losses.len(),
        start.elapsed().as_secs_f64(),
        summary.losses.last().copied().unwrap_or(f64::NAN),
        peak_rss_bytes().map(human_bytes).unwrap_or_else(|| "n/a".into())
    );
    Ok(())
}

fn run_merge(a: MergeArgs) -> Result<()> {
    let start = Instant::now();
    let dtype = parse_dtype(&a.dtype)?;
    let max = fsdp_app::checkpoint::export::parse_size(&a.max_shard_size).context("--max-shard-size")?;
    let out = fsdp_app::checkpoint::sharded::merge(&a.checkpoint, &a.out, dtype, max)?;
    eprintln!(
        "merged {} -> {} in {:.1}s, peak RSS {}",
        a.checkpoint.display(),
        out.display(),
        start.elapsed().as_secs_f64(),
        peak_rss_bytes().map(human_bytes).unwrap_or_else(|| "n/a".into())
    );
    Ok(())
}

fn run_estimate(a: EstimateArgs) -> Result<()> {
    use fsdp_app::train::estimate::{estimate, EstimateInput};
    let config_path = if std::path::Path::new(&a.model).is_dir() {
        std::path::Path::new(&a.model).join("config.json")
    } else {
        fsdp_app::checkpoint::hub::HubRepo::open(&a.model, a.revision.as_deref().unwrap_or("main"))?.get("config.json")?
    };
    let mut cfg = fsdp_app::checkpoint::read_model_config(&config_path)?;
    cfg.lora = lora_settings(&a.lora);
    if let Some(l) = &cfg.lora {
        l.validate(&cfg)?;
    }
    let strategy = a.sharding.strategy()?;
    let wrap = a.sharding.wrap()?;
    if a.world_size == 0 || a.batch_size == 0 || a.seq_len == 0 {
        anyhow::bail!("--world-size, --batch-size and --seq-len must be positive");
    }
    let shard_size = strategy.shard_count(a.world_size, a.sharding.shard_group_size)?;
    let input = EstimateInput {
        world_size: a.world_size,
        shard_size,
        strategy,
        wrap,
        activation_checkpointing: a.sharding.activation_checkpointing,
        batch_size: a.batch_size,
        seq_len: a.seq_len,
        rank0_relays: a.backend == "tcp" && a.world_size > 1,
    };
    let staged = models::LlamaStages::new(&cfg);
    let e = estimate(&staged, &cfg, &input)?;
    if a.json {
        let mut m = serde_json::Map::new();
        for (name, bytes, _) in e.rows() {
            m.insert(name.replace(' ', "_"), serde_json::json!(bytes));
        }
        m.insert("total".into(), serde_json::json!(e.total()));
        m.insert("rank0_relay".into(), serde_json::json!(e.rank0_relay));
        m.insert("rank0_total".into(), serde_json::json!(e.rank0_total()));
        println!("{}", serde_json::Value::Object(m));
        return Ok(());
    }
    println!(
        "per-rank memory estimate: {} rank(s), {strategy:?}, batch {} x seq {}{}{}",
        a.world_size,
        a.batch_size,
        a.seq_len,
        if a.sharding.activation_checkpointing { ", activation checkpointing" } else { "" },
        cfg.lora.as_ref().map(|l| format!(", LoRA r={} {:?}", l.r, l.targets)).unwrap_or_default()
    );
    for (name, bytes, what) in e.rows() {
        println!("  {name:<15} {:>12}  {what}", human_bytes(bytes));
    }
    println!("  {:<15} {:>12}  peak resident memory of each rank", "total", human_bytes(e.total()));
    if e.rank0_relay > 0 {
        println!("  {:<15} {:>12}  rank 0 also relays the others' collectives (tcp backend)", "rank 0 relay", human_bytes(e.rank0_relay));
        println!("  {:<15} {:>12}", "rank 0 total", human_bytes(e.rank0_total()));
    }
    if a.backend == "local" && a.world_size > 1 {
        let process = e.process + (e.total() - e.process) * a.world_size as u64;
        println!("  {:<15} {:>12}  the one process holding all {} local ranks", "process total", human_bytes(process), a.world_size);
    }
    Ok(())
}

fn run_fixture(a: FixtureArgs) -> Result<()> {
    let overrides = a
        .set
        .iter()
        .map(|kv| {
            let (k, v) = kv.split_once('=').with_context(|| format!("--set {kv:?}: expected FIELD=VALUE"))?;
            let v: serde_json::Value = serde_json::from_str(v).with_context(|| format!("--set {kv:?}: the value is not JSON"))?;
            Ok((k.to_string(), v))
        })
        .collect::<Result<Vec<_>>>()?;
    let p = fsdp_app::fixtures::write_fixture_with(&a.name, &a.out, &overrides)?;
    eprintln!("wrote fixture {} to {}", a.name, p.display());
    Ok(())
}

fn run_convert(a: ConvertArgs) -> Result<()> {
    let start = Instant::now();
    let dtype = parse_dtype(&a.dtype)?;
    let report = fsdp_app::convert::convert_gguf(&a.gguf, &a.out, dtype)?;
    eprintln!(
        "converted {} -> {}: {} tensors, {:.1}M parameters, {:.1}s, peak RSS {}",
        a.gguf.display(),
        report.out.display(),
        report.tensors,
        report.parameters as f64 / 1e6,
        start.elapsed().as_secs_f64(),
        peak_rss_bytes().map(human_bytes).unwrap_or_else(|| "n/a".into())
    );
    Ok(())
}

fn run_generate(a: GenerateArgs) -> Result<()> {
    let dtype = parse_dtype(&a.model.dtype)?;
    let device = a.model.device.parse::<fsdp_app::device::DeviceSpec>()?.open(0)?;
    let load_start = Instant::now();
    let files = resolve_model(&a.model.model, a.model.revision.as_deref())?;
    let defaults = match &files.generation_config {
        Some(p) => GenerationDefaults::read(p)?,
        None => GenerationDefaults::default(),
    };
    let loaded = load_model_with_adapter(files, a.adapter.as_deref(), dtype, &device)?;
    let tokenizer = TextTokenizer::load(&loaded.files, loaded.config.vocab_size)?;
    let load_s = load_start.elapsed().as_secs_f64();

    let prompt_ids = if a.chat {
        let template = tokenizer.chat_template.as_ref().with_context(|| {
            format!("{}: --chat needs a chat template (tokenizer_config.json `chat_template` or chat_template.jinja)", loaded.files.source)
        })?;
        let mut messages = vec![];
        if let Some(s) = &a.system {
            messages.push(ChatMessage::new("system", s));
        }
        messages.push(ChatMessage::new("user", &a.prompt));
        // transformers' apply_chat_template tokenises the rendered text without adding specials.
        tokenizer.encode(&template.render(&messages, true)?, false)?
    } else {
        tokenizer.encode(&a.prompt, true)?
    };

    let eos: HashSet<u32> = if defaults.eos_token_ids.is_empty() {
        loaded.config.eos_token_ids.iter().copied().collect()
    } else {
        defaults.eos_token_ids.iter().copied().collect()
    };
    let sampling_by_default = defaults.do_sample;
    let params = SamplingParams {
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature.unwrap_or(if sampling_by_default { defaults.temperature.unwrap_or(1.0) } else { 0.0 }),
        // transformers samples with top_k = 50 unless told otherwise.
        top_k: a.top_k.or(if sampling_by_default { Some(defaults.top_k.unwrap_or(50)) } else { None }),
        top_p: a.top_p.or(if sampling_by_default { defaults.top_p } else { None }),
        repetition_penalty: a.repetition_penalty.or(defaults.repetition_penalty).unwrap_or(1.0),
        seed: a.seed,
        stop: a.stop.clone(),
        ..SamplingParams::greedy(a.max_new_tokens)
    };

    let stdout = std::io::stdout();
    let stream = !a.json;
    let out = generate(&loaded.model, &tokenizer, &prompt_ids, &eos, &params, |text| {
        if stream {
            let mut lock = stdout.lock();
            lock.write_all(text.as_bytes())?;
            lock.flush()?;
        }
        Ok(())
    })?;
    let rss = peak_rss_bytes();
    if a.json {
        let mut v = serde_json::to_value(&out)?;
        v["peak_rss_bytes"] = serde_json::json!(rss);
        v["load_s"] = serde_json::json!(load_s);
        println!("{}", serde_json::to_string(&v)?);
    } else {
        println!();
        eprintln!(
            "prompt tokens: {} | generated tokens: {} | finish: {:?} | load: {load_s:.2}s | time to first token: {:.3}s | \
             {:.1} tokens/s | peak RSS: {}",
            out.prompt_ids.len(),
            out.generated_ids.len(),
            out.finish_reason,
            out.time_to_first_token_s,
            out.decode_tokens_per_s,
            rss.map(human_bytes).unwrap_or_else(|| "n/a".into())
        );
    }
    Ok(())
}
