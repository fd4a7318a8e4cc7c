//! `fsdp-app generate`: one prompt, streamed to stdout (or one JSON object with --json).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;

use fsdp_app::generate::{generate, ModelDefaults, SamplingParams};
use fsdp_app::memory::{human_bytes, peak_rss_bytes};
use fsdp_app::model_files::quantize::parse_quantize;
use fsdp_app::model_files::{load_model_with, parse_dtype, resolve_model, LoadOptions};
use fsdp_app::tokenize::{ChatMessage, TextTokenizer};

#[derive(Args)]
pub struct ModelArgs {
    /// Local model directory, a llama.cpp GGUF file (its quantised weights kept), or a Hub id
    /// such as `HuggingFaceTB/SmolLM2-135M-Instruct` (`org/name:FILE.gguf` for a GGUF file of a
    /// Hub repo). Hub downloads honour HF_ENDPOINT, HF_HOME, HF_HUB_CACHE, HF_TOKEN and
    /// HF_HUB_OFFLINE.
    #[arg(long)]
    pub model: String,
    /// Hub branch, tag or commit (Hub ids only).
    #[arg(long)]
    pub revision: Option<String>,
    /// Compute dtype: f32 (default; fastest on CPU), bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Quantise the model's matrices to this GGUF block format as it loads (q8_0, q4_k, q4_0,
    /// q4_1, q5_0, q5_1, q5_k, q6_k), as llama.cpp's quantizer would (see README).
    #[arg(long)]
    quantize: Option<String>,
    /// Where to run: cpu, cuda (GPU 0) or cuda:N; GPUs need a CUDA build (tests/gpu/build-cuda.sh).
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(Args)]
pub struct GenerateArgs {
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
    /// The chat template to wrap the prompt with instead of the model's (with --chat): a Jinja
    /// file, or the template inline, as `serve --chat-template` takes it.
    #[arg(long, requires = "chat")]
    chat_template: Option<String>,
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
    /// The prompt is fed in chunks of at most this many tokens: memory for activations stays
    /// bounded however long the prompt.
    #[arg(long, default_value_t = fsdp_app::generate::DEFAULT_MAX_PREFILL_TOKENS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    max_prefill_tokens: usize,
    /// With --json: each generated token's log-probability and the N most likely tokens at its
    /// position (`logprobs`), as OpenAI's `top_logprobs` (0-20).
    #[arg(long, requires = "json", value_parser = clap::value_parser!(u8).range(0..=20))]
    top_logprobs: Option<u8>,
    /// Print one JSON object (text, token ids, finish reason, figures) instead of streaming.
    #[arg(long)]
    json: bool,
}

impl ModelArgs {
    /// The compute dtype, the `--quantize` format and the opened device.
    pub fn settings(&self) -> Result<(candle_core::DType, Option<fsdp_app::model_files::quantize::QuantizeSpec>, candle_core::Device)> {
        let dtype = parse_dtype(&self.dtype)?;
        let quantize = self.quantize.as_deref().map(parse_quantize).transpose()?;
        let device = self.device.parse::<fsdp_app::device::DeviceSpec>()?.open(0)?;
        Ok((dtype, quantize, device))
    }
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let (dtype, quantize, device) = a.model.settings()?;
    let load_start = Instant::now();
    let files = resolve_model(&a.model.model, a.model.revision.as_deref())?;
    let opts = LoadOptions { adapter: a.adapter.as_deref(), dtype, quantize };
    let loaded = load_model_with(files, &opts, &device)?;
    let mut tokenizer = TextTokenizer::load(&loaded.files, loaded.config.vocab_size)?;
    if let Some(arg) = &a.chat_template {
        tokenizer.replace_chat_template(&fsdp_app::tokenize::chat::template_argument(arg)?)?;
    }
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

    let defaults = ModelDefaults::of(&loaded.files, &loaded.config.eos_token_ids)?;
    let params = SamplingParams {
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature.unwrap_or(defaults.temperature),
        top_k: a.top_k.or(defaults.top_k),
        top_p: a.top_p.or(defaults.top_p),
        repetition_penalty: a.repetition_penalty.unwrap_or(defaults.repetition_penalty),
        seed: a.seed,
        stop: a.stop.clone(),
        logprobs: a.top_logprobs.map(usize::from),
        ..SamplingParams::greedy(a.max_new_tokens)
    };

    let stdout = std::io::stdout();
    let stream = !a.json;
    let out = generate(&loaded.model, &tokenizer, &prompt_ids, &defaults.eos_token_ids, &params, a.max_prefill_tokens, |text| {
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
