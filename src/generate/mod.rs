//! Autoregressive generation with a KV cache: sampling settings, eos and stop-string handling,
//! streamed text, and the figures a user wants (time to first token, tokens/s).

pub mod stream;

use std::collections::HashSet;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};
use models::{CausalLm, KvCache};
use serde::Serialize;
use serde_json::Value;

use crate::tokenize::TextTokenizer;
pub use stream::TextStream;

/// The fields of `generation_config.json` we use. Missing fields keep transformers' defaults.
#[derive(Debug, Clone, Default)]
pub struct GenerationDefaults {
    pub eos_token_ids: Vec<u32>,
    pub do_sample: bool,
    pub temperature: Option<f64>,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub repetition_penalty: Option<f32>,
    pub max_new_tokens: Option<usize>,
}

impl GenerationDefaults {
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
        let v: Value = serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
        let field_f64 = |name: &str| v.get(name).and_then(Value::as_f64);
        Ok(Self {
            eos_token_ids: models::config::token_id_list(&v.get("eos_token_id").cloned()),
            do_sample: v.get("do_sample").and_then(Value::as_bool).unwrap_or(false),
            temperature: field_f64("temperature"),
            top_k: v.get("top_k").and_then(Value::as_u64).map(|k| k as usize),
            top_p: field_f64("top_p"),
            repetition_penalty: field_f64("repetition_penalty").map(|p| p as f32),
            max_new_tokens: v.get("max_new_tokens").and_then(Value::as_u64).map(|n| n as usize),
        })
    }
}

/// Sampling settings of one request. `temperature == 0` is greedy.
#[derive(Debug, Clone)]
pub struct SamplingParams {
    pub max_new_tokens: usize,
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub repetition_penalty: f32,
    pub seed: u64,
    pub stop: Vec<String>,
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            bail!("--temperature must be >= 0 (0 = greedy), got {}", self.temperature);
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                bail!("--top-p must be in (0, 1], got {p}");
            }
        }
        if self.top_k == Some(0) {
            bail!("--top-k must be positive");
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            bail!("--repetition-penalty must be > 0, got {}", self.repetition_penalty);
        }
        Ok(())
    }

    fn sampling(&self) -> Sampling {
        if self.temperature == 0.0 {
            return Sampling::ArgMax;
        }
        let temperature = self.temperature;
        match (self.top_k, self.top_p.filter(|p| *p < 1.0)) {
            (None, None) => Sampling::All { temperature },
            (Some(k), None) => Sampling::TopK { k, temperature },
            (None, Some(p)) => Sampling::TopP { p, temperature },
            (Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature },
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An eos token or a stop string.
    Stop,
    /// `max_new_tokens` reached (or the model's context).
    Length,
}

#[derive(Debug, Clone, Serialize)]
pub struct GenerationOutput {
    pub text: String,
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    pub finish_reason: FinishReason,
    /// Seconds from start to the first generated token (prompt processing included).
    pub time_to_first_token_s: f64,
    /// Generated tokens per second after the first one (decode speed).
    pub decode_tokens_per_s: f64,
    pub total_s: f64,
}

/// Generates from `prompt_ids`, calling `on_text` with each piece of text that is safe to show.
pub fn generate(
    model: &CausalLm,
    tokenizer: &TextTokenizer,
    prompt_ids: &[u32],
    eos_ids: &HashSet<u32>,
    params: &SamplingParams,
    mut on_text: impl FnMut(&str) -> Result<()>,
) -> Result<GenerationOutput> {
    params.validate()?;
    if prompt_ids.is_empty() {
        bail!("the prompt is empty: give at least one token");
    }
    let max_ctx = model.config().max_position_embeddings;
    if prompt_ids.len() >= max_ctx {
        bail!("the prompt has {} tokens; the model's context is {max_ctx}", prompt_ids.len());
    }
    let device = model.device().clone();
    let mut sampler = LogitsProcessor::from_sampling(params.seed, params.sampling());
    let mut cache = KvCache::new(model.config());
    let mut stream = TextStream::new(params.stop.clone());
    let mut context: Vec<u32> = prompt_ids.to_vec();
    let mut generated: Vec<u32> = vec![];
    let mut finish = FinishReason::Length;
    let start = Instant::now();
    let mut first_token_at = None;
    let mut input = Tensor::new(prompt_ids, &device)?.unsqueeze(0)?;
    let budget = params.max_new_tokens.min(max_ctx - prompt_ids.len());
    let mut full_text = String::new();
    while generated.len() < budget {
        let logits = model.forward_cached(&input, &mut cache)?.squeeze(0)?.to_dtype(DType::F32)?;
        let logits = if params.repetition_penalty != 1.0 {
            candle_transformers::utils::apply_repeat_penalty(&logits, params.repetition_penalty, &context)?
        } else {
            logits
        };
        let next = sampler.sample(&logits)?;
        first_token_at.get_or_insert_with(Instant::now);
        if eos_ids.contains(&next) {
            finish = FinishReason::Stop;
            break;
        }
        generated.push(next);
        context.push(next);
        full_text = tokenizer.decode(&generated, true)?;
        let step = stream.push(&full_text);
        if !step.text.is_empty() {
            on_text(&step.text)?;
        }
        if step.stopped {
            finish = FinishReason::Stop;
            break;
        }
        input = Tensor::new(&[next], &device)?.unsqueeze(0)?;
    }
    if finish == FinishReason::Length {
        let rest = stream.finish(&full_text);
        if !rest.is_empty() {
            on_text(&rest)?;
        }
    }
    let end = Instant::now();
    let first = first_token_at.unwrap_or(end);
    let decoded_after_first = generated.len().saturating_sub(1) as f64;
    let decode_s = (end - first).as_secs_f64();
    let text = stream.emitted_text(&full_text);
    Ok(GenerationOutput {
        text,
        prompt_ids: prompt_ids.to_vec(),
        generated_ids: generated,
        finish_reason: finish,
        time_to_first_token_s: (first - start).as_secs_f64(),
        decode_tokens_per_s: if decode_s > 0.0 { decoded_after_first / decode_s } else { 0.0 },
        total_s: (end - start).as_secs_f64(),
    })
}
