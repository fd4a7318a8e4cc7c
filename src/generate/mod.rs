//! Autoregressive generation with a KV cache: sampling settings, eos and stop-string handling,
//! streamed text, and the figures a user wants (time to first token, tokens/s).

pub mod chain;
pub mod constraint;
pub mod detokenize;
pub mod gbnf;
pub mod infill_sampler;
pub mod json_schema;
pub mod perplexity;
pub mod prefix_cache;
pub mod reasoning;
pub mod sampler;
pub mod schedule;
pub mod sequence;
pub mod stream;

use std::collections::HashSet;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_transformers::generation::Sampling;
use models::CausalLm;
use serde::Serialize;
use serde_json::Value;

use crate::tokenize::TextTokenizer;
pub use schedule::step_all;

/// Prompt tokens per forward unless told otherwise (`--max-prefill-tokens`): big enough that
/// the matrix products run at full speed, small enough that a chunk's activations stay small
/// and, in `serve`, that other sequences' decode steps are not held long behind a prompt.
pub const DEFAULT_MAX_PREFILL_TOKENS: usize = 256;
pub use sequence::{Sequence, SequenceStep, TokenLogprob};
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

/// What a model generates with when the command line or a request says nothing: decided once,
/// here, for `generate` and `serve` alike.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelDefaults {
    /// Generation stops at any of these: generation_config.json's eos ids and config.json's
    /// (their union: a chat model's end-of-turn token may be in only one of them).
    pub eos_token_ids: HashSet<u32>,
    /// generation_config's temperature when it samples (`do_sample`; 1.0 if unset), else 0.
    pub temperature: f64,
    /// When the model samples by default: generation_config's top_k, else transformers' 50.
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub repetition_penalty: f32,
}

impl ModelDefaults {
    /// From generation_config.json (`None` when the model has none) and config.json's eos ids.
    pub fn decide(generation_config: Option<&GenerationDefaults>, config_eos: &[u32]) -> Self {
        let g = generation_config.cloned().unwrap_or_default();
        let mut eos: HashSet<u32> = g.eos_token_ids.iter().copied().collect();
        eos.extend(config_eos.iter().copied());
        let sampling = g.do_sample;
        Self {
            eos_token_ids: eos,
            temperature: if sampling { g.temperature.unwrap_or(1.0) } else { 0.0 },
            // transformers samples with top_k = 50 unless told otherwise.
            top_k: if sampling { Some(g.top_k.unwrap_or(50)) } else { None },
            top_p: if sampling { g.top_p } else { None },
            repetition_penalty: g.repetition_penalty.unwrap_or(1.0),
        }
    }

    /// The model's defaults from its resolved files.
    pub fn of(files: &crate::model_files::ModelFiles, config_eos: &[u32]) -> Result<Self> {
        let g = files.generation_config.as_deref().map(GenerationDefaults::read).transpose()?;
        Ok(Self::decide(g.as_ref(), config_eos))
    }
}

/// Temperatures below this sample greedily (see [`SamplingParams::sampling`]).
const GREEDY_BELOW_TEMPERATURE: f64 = 1e-5;

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
    /// Drop tokens whose probability is below `min_p` times the most likely one's.
    pub min_p: Option<f64>,
    /// OpenAI's penalties on tokens already generated: `presence` once per seen token,
    /// `frequency` per occurrence, subtracted from the logits.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Report the sampled token's log-probability and this many top alternatives.
    pub logprobs: Option<usize>,
    /// OpenAI's `logit_bias`: added to these tokens' logits before sampling (-100 bans a
    /// token, 100 all but forces it).
    pub logit_bias: Vec<(u32, f32)>,
    /// Score the prompt too: each prompt token's log-probability given the tokens before it
    /// (none for the first) with this many top alternatives, in the first step's
    /// `prompt_logprobs` (OpenAI's `echo` with `logprobs`).
    pub prompt_logprobs: Option<usize>,
    /// Where the answer may end and how its text reads (vLLM's extensions).
    pub output: OutputControls,
    /// llama.cpp's sampler chain (`chain`), in place of `top_k`, `top_p` and `min_p` (which are
    /// then unset): its cuts in its order, the temperature where it stands.
    pub chain: Option<Vec<chain::ChainStep>>,
    /// llama.cpp's `repeat_last_n`: the repetition, presence and frequency penalties count the
    /// last n tokens of prompt and answer. None: vLLM's reading (repetition over prompt and
    /// answer, presence and frequency over the answer).
    pub penalty_last_n: Option<usize>,
}

/// vLLM's sampling extensions, with vLLM's names and meaning: where an answer may end and how its
/// text is written. The defaults change nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct OutputControls {
    /// Go on past eos tokens (they become ordinary tokens) until the length limit, a stop string
    /// or a stop token; a grammar's end still ends the answer.
    pub ignore_eos: bool,
    /// No eos token, stop token or stop string ends the answer before it has this many tokens
    /// (eos and stop tokens are masked until then).
    pub min_tokens: usize,
    /// Tokens that end the answer (finish reason `stop`); the token counts as generated, its
    /// text is kept only with `include_stop_str_in_output`.
    pub stop_token_ids: Vec<u32>,
    /// Keep the stop string (or stop token's text) that ended the answer in its text.
    pub include_stop_str_in_output: bool,
    /// Leave special tokens out of the text (true unless the client says otherwise).
    pub skip_special_tokens: bool,
    /// With special tokens kept: false writes a special token that follows another as its raw
    /// content, without the space some decoders put between tokens.
    pub spaces_between_special_tokens: bool,
    /// Sum each sampled token's log-probability (for `best_of`'s ranking).
    pub cumulative_logprob: bool,
    /// For a reasoning model's answer: the most tokens its thinking may take before the thinking
    /// is closed for it (Anthropic's `thinking.budget_tokens`).
    pub thinking_budget: Option<reasoning::ThinkingBudget>,
    /// Code completion (llama.cpp's `n_indent`): a line after the answer's first that starts
    /// with fewer spaces or tabs than this ends the answer there (finish `length`); 0: off.
    pub min_indent: usize,
    /// Code completion (llama.cpp's `t_max_predict_ms`): once the answer holds a new line, it
    /// ends (finish `length`) when it has been generating for longer than this.
    pub max_predict_time: Option<std::time::Duration>,
}

impl Default for OutputControls {
    fn default() -> Self {
        Self {
            ignore_eos: false,
            min_tokens: 0,
            stop_token_ids: vec![],
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            spaces_between_special_tokens: true,
            cumulative_logprob: false,
            thinking_budget: None,
            min_indent: 0,
            max_predict_time: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of up to `max_new_tokens` tokens, nothing else.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            temperature: 0.0,
            top_k: None,
            top_p: None,
            repetition_penalty: 1.0,
            seed: 0,
            stop: vec![],
            min_p: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logprobs: None,
            logit_bias: vec![],
            prompt_logprobs: None,
            output: OutputControls::default(),
            chain: None,
            penalty_last_n: None,
        }
    }
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
        if let Some(p) = self.min_p {
            if !(0.0..=1.0).contains(&p) {
                bail!("min_p must be in [0, 1], got {p}");
            }
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                bail!("{name} must be in [-2, 2], got {v}");
            }
        }
        Ok(())
    }

    /// Whether sampling draws from the whole distribution (greedy, or a temperature alone): then
    /// a token drawn freely and kept only when a grammar allows it (else drawn again under the
    /// grammar's mask) is drawn as from the masked distribution, since that is rejection sampling.
    /// Not with top-k / top-p / min-p, which would cut a different distribution.
    pub fn draws_from_whole_distribution(&self) -> bool {
        matches!(self.sampling(), Sampling::ArgMax | Sampling::All { .. })
            && self.min_p.is_none_or(|m| m == 0.0)
            && self.chain.as_ref().is_none_or(|c| c.iter().all(|s| *s == chain::ChainStep::Temperature))
    }

    /// The sampler of a sequence seeded with `seed`.
    pub(crate) fn sampler(&self, seed: u64) -> sampler::Sampler {
        sampler::Sampler::with_chain(seed, self.sampling(), self.chain.clone())
    }

    fn sampling(&self) -> Sampling {
        // A temperature this close to 0 is greedy, as vLLM treats it (`_SAMPLING_EPS`): the
        // logits divided by it overflow to infinity (1e-308, found by schemathesis, made every
        // probability NaN and the request a 500), and what it samples is the argmax anyway.
        if self.temperature < GREEDY_BELOW_TEMPERATURE {
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
    /// Per generated token, with `SamplingParams::logprobs`: its log-probability and the top
    /// alternatives (absent otherwise).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<TokenLogprob>,
}

/// Generates from `prompt_ids`, calling `on_text` with each piece of text that is safe to show.
/// `max_prefill_tokens`: the prompt is fed in chunks of at most this many tokens (see
/// [`DEFAULT_MAX_PREFILL_TOKENS`]).
pub fn generate(
    model: &CausalLm,
    tokenizer: &TextTokenizer,
    prompt_ids: &[u32],
    eos_ids: &HashSet<u32>,
    params: &SamplingParams,
    max_prefill_tokens: usize,
    mut on_text: impl FnMut(&str) -> Result<()>,
) -> Result<GenerationOutput> {
    params.validate()?;
    let mut seq = Sequence::new(model, prompt_ids, eos_ids, params)?;
    let start = Instant::now();
    let (mut first_token_at, mut logprobs) = (None, vec![]);
    let finish = loop {
        let step = seq.step(model, tokenizer, max_prefill_tokens)?;
        if step.token.is_some() || step.finished.is_some() {
            first_token_at.get_or_insert_with(Instant::now);
        }
        if !step.text.is_empty() {
            on_text(&step.text)?;
        }
        // One entry per generated id (an eos token is not one).
        if let (Some(_), Some(l)) = (step.token, step.logprob) {
            logprobs.push(l);
        }
        if let Some(f) = step.finished {
            break f;
        }
    };
    let end = Instant::now();
    let first = first_token_at.unwrap_or(end);
    let generated = seq.generated_ids().to_vec();
    let decoded_after_first = generated.len().saturating_sub(1) as f64;
    let decode_s = (end - first).as_secs_f64();
    Ok(GenerationOutput {
        text: seq.text(),
        prompt_ids: prompt_ids.to_vec(),
        generated_ids: generated,
        finish_reason: finish,
        time_to_first_token_s: (first - start).as_secs_f64(),
        decode_tokens_per_s: if decode_s > 0.0 { decoded_after_first / decode_s } else { 0.0 },
        total_s: (end - start).as_secs_f64(),
        logprobs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A positive temperature too small to divide the logits by is greedy; one above the
    /// threshold samples.
    #[test]
    fn a_vanishing_temperature_is_greedy() {
        let at = |temperature| SamplingParams { temperature, ..SamplingParams::greedy(1) }.sampling();
        for t in [0.0, 1.1125369292536007e-308, 1e-6] {
            assert!(matches!(at(t), Sampling::ArgMax), "temperature {t}");
        }
        assert!(matches!(at(0.7), Sampling::All { .. }));
    }
}
