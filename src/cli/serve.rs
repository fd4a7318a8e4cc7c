//! `fsdp-app serve`: the OpenAI-compatible HTTP server.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use fsdp_app::model_files::parse_dtype;
use fsdp_app::serve::ServeConfig;

#[derive(Args)]
pub struct ServeArgs {
    /// Local model directory or Hub id (`serve MODEL`, as `vllm serve MODEL`; or --model).
    #[arg(value_name = "MODEL", required_unless_present = "model", conflicts_with = "model")]
    model_argument: Option<String>,
    /// Local model directory or Hub id.
    #[arg(long)]
    model: Option<String>,
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
    /// Sequences generated together; more wait in the queue (vLLM's --max-num-seqs).
    #[arg(long, alias = "max-num-seqs", default_value_t = 8)]
    max_concurrent_requests: usize,
    /// Tokens one engine step runs at most, decode steps first (vLLM's max_num_batched_tokens):
    /// prompts are fed in chunks of what is left, so a short request is not held behind a long
    /// prompt. Smaller: lower latency for the others while a prompt is fed; larger: faster prompts.
    #[arg(long, alias = "max-num-batched-tokens", default_value_t = fsdp_app::generate::DEFAULT_MAX_PREFILL_TOKENS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    max_prefill_tokens: usize,
    /// MiB of KV blocks kept after their requests end for later prompts that start alike
    /// (prefix caching: chat turns, shared system prompts, agent loops), least recently used
    /// dropped first; 0 turns it off. Shows in `usage.prompt_tokens_details.cached_tokens`.
    /// The default keeps an idle server's growth small (about 5,800 tokens of SmolLM2 in f32).
    #[arg(long, default_value_t = 256)]
    kv_cache_memory: usize,
    /// Accepted so that vLLM's command lines run: prefix caching is on by default here
    /// (--kv-cache-memory).
    #[arg(long)]
    #[allow(dead_code)]
    enable_prefix_caching: bool,
    /// vLLM's switch for no prefix caching: --kv-cache-memory 0.
    #[arg(long, conflicts_with_all = ["kv_cache_memory", "enable_prefix_caching"])]
    no_enable_prefix_caching: bool,
    /// Accepted so that vLLM's command lines run: no model code is ever run here (architectures
    /// are built in; a model of another one is refused by name at start-up).
    #[arg(long)]
    #[allow(dead_code)]
    trust_remote_code: bool,
    /// Requests that may wait for a slot; beyond that the answer is 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// The chat template to use instead of the model's (vLLM's flag): a Jinja file, or the
    /// template written inline. Fine-tuning jobs on this server train with it too.
    #[arg(long)]
    chat_template: Option<String>,
    /// How a reasoning model's thinking is told apart from its answer (`reasoning_content`):
    /// `auto` splits `<think>` blocks for models whose chat template writes them; `qwen3` /
    /// `deepseek_r1` (vLLM's names) always; `none` leaves thinking in the answer's text.
    #[arg(long, default_value = "auto", value_parser = fsdp_app::generate::reasoning::ReasoningChoice::parse)]
    reasoning_parser: fsdp_app::generate::reasoning::ReasoningChoice,
    /// What the model is served for: `generate` (text; `/v1/embeddings` too), `embed` (only
    /// `/v1/embeddings`; the generation endpoints refuse it), or `auto`: embed for an embedding
    /// model (a bare `Qwen3Model`-style checkpoint, or one with sentence-transformers'
    /// modules.json), else generate.
    #[arg(long, default_value = "auto", value_parser = fsdp_app::serve::Task::parse)]
    task: fsdp_app::serve::Task,
    /// How embeddings pool a text's hidden states: `last` (the last token's), `mean` or `cls`
    /// (the first token's). Default: the model's sentence-transformers pooling, else `last`.
    #[arg(long, value_parser = fsdp_app::embed::Pooling::parse)]
    pooling: Option<fsdp_app::embed::Pooling>,
    /// How the model writes function calls when `tool_choice` is `auto` (vLLM's names):
    /// `hermes` (`<tool_call>` blocks: Hermes, Qwen 2.5 / 3), `llama3_json` (Llama 3.1+ JSON),
    /// `mistral` (`[TOOL_CALLS]`), or `auto`: the one the chat template writes, else `hermes`
    /// (the format the generic tool prompt asks for).
    #[arg(long, default_value = "auto", value_parser = fsdp_app::serve::tool_format::ToolParser::parse)]
    tool_call_parser: fsdp_app::serve::tool_format::ToolParser,
    /// Seconds a request may wait in the queue for a slot; one that waits longer is answered 429
    /// with Retry-After (streams too: their 200 comes only once they run), so a client with a
    /// 60 s timeout hears back in time. 0: wait as long as it takes.
    #[arg(long, default_value_t = 30.0)]
    max_queue_wait: f64,
    /// Longest prompt in tokens (default: the context minus one).
    #[arg(long)]
    max_input_tokens: Option<usize>,
    /// Longest prompt + completion in tokens (default: the model's context; vLLM's
    /// --max-model-len). `/v1/models` reports it as `max_model_len`.
    #[arg(long, alias = "max-model-len")]
    max_total_tokens: Option<usize>,
    /// Largest request body in bytes (file uploads: --max-upload-bytes).
    #[arg(long, default_value_t = 4 << 20)]
    max_body_bytes: usize,
    /// Largest fine-tuning file `POST /v1/files` takes (it streams to disk; larger is a 413).
    #[arg(long, default_value_t = 512 << 20)]
    max_upload_bytes: u64,
    /// Ignore request fields this server does not implement (tools, response_format, unknown
    /// keys), listing them in the `x-fsdp-app-ignored-params` response header, instead of
    /// answering 400 naming them.
    #[arg(long)]
    lenient: bool,
    /// Seconds running generations may go on after SIGTERM / SIGINT before their streams are
    /// ended (with an error event and [DONE]); running fine-tuning jobs are cancelled at once.
    #[arg(long, default_value_t = 30.0)]
    shutdown_grace: f64,
    /// Seconds a client may take to send a request's head; also how long a keep-alive
    /// connection may idle between requests (hyper arms the same timer for both).
    #[arg(long, default_value_t = 30.0)]
    header_timeout: f64,
    /// Seconds a request body may go without sending anything (a slow upload that keeps sending
    /// is never cut); then 408.
    #[arg(long, default_value_t = 60.0)]
    body_timeout: f64,
    /// Connections one client address may hold open; its next one is answered 429 and closed
    /// (default: no limit, so clients behind one proxy or NAT are not refused).
    #[arg(long)]
    max_connections_per_ip: Option<usize>,
    /// Where the models compute: cpu, cuda (GPU 0) or cuda:N (CUDA build).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Compute dtype: f32 (default; fastest on CPU), bf16 (GPUs) or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Quantise the model's matrices to this GGUF block format as it loads (q8_0, q4_k, q4_0,
    /// q4_1, q5_0, q5_1, q5_k, q6_k), as llama.cpp's quantizer would (see README). A GGUF
    /// file's own quantised matrices are served as they are without it.
    #[arg(long)]
    quantize: Option<String>,
    /// Where uploaded files, fine-tuning jobs (SQLite) and fine-tuned models are kept.
    #[arg(long, default_value = "fsdp-serve-data")]
    data_dir: PathBuf,
    /// Serve the LoRA adapter in DIR (PEFT's format, as `finetune --lora` writes it) as model
    /// NAME over the base, without merging it (repeatable).
    #[arg(long = "lora", value_name = "NAME=DIR")]
    loras: Vec<String>,
    /// vLLM's spelling of --lora: one or more `NAME=DIR`, or `{"name": NAME, "path": DIR}`.
    #[arg(long, value_name = "NAME=DIR", num_args = 1..)]
    lora_modules: Vec<String>,
    /// Accepted so that vLLM's command lines run: `tool_choice: auto` is always served here
    /// (its call format from --tool-call-parser).
    #[arg(long)]
    #[allow(dead_code)]
    enable_auto_tool_choice: bool,
    /// Accepted so that vLLM's command lines run: adapters are always served here (--lora,
    /// --lora-dir).
    #[arg(long)]
    #[allow(dead_code)]
    enable_lora: bool,
    /// Accepted so that vLLM's command lines run: `GET /tokenizer_info` is always served here.
    #[arg(long)]
    #[allow(dead_code)]
    enable_tokenizer_info_endpoint: bool,
    /// Let `POST /v1/load_lora_adapter` read adapters under ROOT (and only there); without it
    /// adapters are loaded only by --lora.
    #[arg(long, value_name = "ROOT")]
    lora_dir: Option<PathBuf>,
    /// LoRA adapters kept in memory at most; the least recently used is dropped and read again
    /// on its next request, so any number can be registered.
    #[arg(long, default_value_t = 8)]
    max_loras: usize,
}

impl TryFrom<ServeArgs> for ServeConfig {
    type Error = anyhow::Error;

    fn try_from(a: ServeArgs) -> Result<Self> {
        Ok(ServeConfig {
            model: a.model.or(a.model_argument).context("serve: give the model as MODEL or --model MODEL")?,
            revision: a.revision,
            served_model_name: a.served_model_name,
            host: a.host,
            port: a.port,
            api_key: a.api_key,
            max_concurrent_requests: a.max_concurrent_requests,
            max_prefill_tokens: a.max_prefill_tokens,
            kv_cache_memory: match a.no_enable_prefix_caching {
                true => 0,
                false => a.kv_cache_memory.checked_mul(1 << 20).context("--kv-cache-memory: too many MiB")?,
            },
            max_queue: a.max_queue,
            reasoning_parser: a.reasoning_parser,
            chat_template: a.chat_template.as_deref().map(fsdp_app::tokenize::chat::template_argument).transpose()?,
            task: a.task,
            pooling: a.pooling,
            tool_call_parser: a.tool_call_parser,
            max_queue_wait: match a.max_queue_wait {
                0.0 => None,
                s => Some(seconds("--max-queue-wait", s)?),
            },
            max_input_tokens: a.max_input_tokens,
            max_total_tokens: a.max_total_tokens,
            max_body_bytes: a.max_body_bytes,
            max_upload_bytes: a.max_upload_bytes,
            lenient: a.lenient,
            shutdown_grace: seconds("--shutdown-grace", a.shutdown_grace)?,
            limits: fsdp_app::serve::listen::ClientLimits {
                header: seconds("--header-timeout", a.header_timeout)?,
                body: seconds("--body-timeout", a.body_timeout)?,
                connections_per_ip: match a.max_connections_per_ip {
                    Some(0) => anyhow::bail!("--max-connections-per-ip must be positive (leave it out for no limit)"),
                    n => n,
                },
            },
            data_dir: a.data_dir,
            loras: a
                .loras
                .iter()
                .map(|l| lora_argument("--lora", l))
                .chain(a.lora_modules.iter().map(|l| lora_argument("--lora-modules", l)))
                .collect::<Result<_>>()?,
            lora_dir: a.lora_dir,
            max_loras: match a.max_loras {
                0 => anyhow::bail!("--max-loras must be at least 1"),
                n => n,
            },
            device: a.device.parse()?,
            dtype: parse_dtype(&a.dtype).context("--dtype")?,
            quantize: a.quantize.as_deref().map(fsdp_app::model_files::quantize::parse_quantize).transpose()?,
        })
    }
}

/// An adapter's name and directory from `NAME=DIR`, or (--lora-modules) vLLM's JSON form
/// `{"name": NAME, "path": DIR}`.
fn lora_argument(flag: &str, arg: &str) -> Result<(String, PathBuf)> {
    if arg.trim_start().starts_with('{') {
        let v: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(arg).with_context(|| format!("{flag} {arg:?}: not a JSON object"))?;
        if let Some(k) = v.keys().find(|k| !["name", "path"].contains(&k.as_str())) {
            anyhow::bail!("{flag} {arg:?}: `{k}` is not supported (give `name` and `path`)");
        }
        return match (v.get("name").and_then(|n| n.as_str()), v.get("path").and_then(|p| p.as_str())) {
            (Some(name), Some(path)) if !name.is_empty() && !path.is_empty() => Ok((name.to_string(), PathBuf::from(path))),
            _ => anyhow::bail!("{flag} {arg:?}: `name` and `path` must be non-empty strings"),
        };
    }
    match arg.split_once('=') {
        Some((name, dir)) if !name.is_empty() && !dir.is_empty() => Ok((name.to_string(), PathBuf::from(dir))),
        _ => anyhow::bail!("{flag} {arg:?}: expected NAME=DIR"),
    }
}

/// A positive number of seconds from flag `name`.
fn seconds(name: &str, s: f64) -> Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| anyhow::anyhow!("{name} must be a positive number of seconds, got {s}"))
}

pub fn run(a: ServeArgs) -> Result<()> {
    fsdp_app::serve::run(&ServeConfig::try_from(a)?)
}
