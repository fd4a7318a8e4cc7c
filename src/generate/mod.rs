//! Autoregressive generation with a KV cache: sampling settings, eos and stop-string handling,
//! streamed text, and the figures a user wants (time to first token, tokens/s).

pub mod constraint;
pub mod detokenize;
pub mod json_schema;
pub mod perplexity;
pub mod stream;

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};
use models::{CausalLm, KvCache, RowAdapters, ServingAdapter};
use serde::Serialize;
use serde_json::Value;

use crate::tokenize::TextTokenizer;
use detokenize::Detokenizer;
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
    /// Per generated token, with `SamplingParams::logprobs`: its log-probability and the top
    /// alternatives (absent otherwise).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<TokenLogprob>,
}

/// One sequence being generated, advanced a token at a time: the unit a serving loop
/// interleaves (each sequence owns its KV cache, sampler and stop-string state).
pub struct Sequence {
    sampler: LogitsProcessor,
    params: SamplingParams,
    cache: KvCache,
    stream: TextStream,
    eos_ids: HashSet<u32>,
    /// Prompt and generated ids (for the repetition penalty).
    context: Vec<u32>,
    prompt_len: usize,
    generated: Vec<u32>,
    /// Ids the next forward consumes: the prompt first, then the last sampled token.
    pending: Vec<u32>,
    budget: usize,
    /// The generated ids' text, kept up to date token by token.
    detokenizer: Detokenizer,
    finish: Option<FinishReason>,
    /// The grammar the answer must follow (structured output), if any.
    constraint: Option<llguidance::Matcher>,
    /// The LoRA adapter this sequence runs with over the base (multi-LoRA serving), if any.
    adapter: Option<Arc<ServingAdapter>>,
}

/// What one step produced.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceStep {
    /// Text now safe to show (may be empty).
    pub text: String,
    /// The sampled token, unless it was an eos token.
    pub token: Option<u32>,
    /// Its log-probability and the top alternatives, when asked for.
    pub logprob: Option<TokenLogprob>,
    /// Set when the sequence is done.
    pub finished: Option<FinishReason>,
    /// On the first step, with `SamplingParams::prompt_logprobs`: prompt tokens 1.. scored.
    pub prompt_logprobs: Option<Vec<TokenLogprob>>,
}

/// Log-probabilities (natural log, of the distribution after penalties, before temperature) of
/// a sampled token and of the most likely tokens at its position.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Applies OpenAI's logit bias and presence/frequency penalties, then min-p filtering, to
/// `logits`.
fn adjust_logits(logits: &mut [f32], generated: &[u32], params: &SamplingParams) {
    for &(t, bias) in &params.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += bias;
        }
    }
    if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
        let mut counts: std::collections::HashMap<u32, usize> = std::collections::HashMap::new();
        for &t in generated {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= params.presence_penalty + params.frequency_penalty * c as f32;
            }
        }
    }
    if let (Some(min_p), true) = (params.min_p, params.temperature > 0.0) {
        if min_p > 0.0 {
            // p_i < min_p * p_max  <=>  (l_i - l_max) / T < ln(min_p)
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let cut = max as f64 + params.temperature * min_p.ln();
            logits.iter_mut().filter(|l| (**l as f64) < cut).for_each(|l| *l = f32::NEG_INFINITY);
        }
    }
}

fn token_logprob(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_sum = logits.iter().map(|l| ((l - max) as f64).exp()).sum::<f64>().ln() as f32 + max;
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let top = top.min(logits.len());
    if top > 0 {
        order.select_nth_unstable_by(top - 1, |a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
        order.truncate(top);
        order.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
    } else {
        order.clear();
    }
    TokenLogprob {
        token,
        logprob: logits[token as usize] - log_sum,
        top: order.into_iter().map(|t| (t, logits[t as usize] - log_sum)).collect(),
    }
}

impl Sequence {
    /// Prepares a sequence's state. The sampling settings are checked by the caller, once
    /// (`SamplingParams::validate`: `generate` below, the server's validation); the prompt's
    /// length is the engine's invariant, refused here too.
    pub fn new(model: &CausalLm, prompt_ids: &[u32], eos_ids: &HashSet<u32>, params: &SamplingParams) -> Result<Self> {
        if prompt_ids.is_empty() {
            bail!("the prompt is empty: give at least one token");
        }
        let max_ctx = model.config().max_position_embeddings;
        if prompt_ids.len() >= max_ctx {
            bail!("the prompt has {} tokens; the model's context is {max_ctx}", prompt_ids.len());
        }
        Ok(Self {
            sampler: LogitsProcessor::from_sampling(params.seed, params.sampling()),
            params: params.clone(),
            cache: KvCache::new(model.config()),
            stream: TextStream::new(params.stop.clone()),
            eos_ids: eos_ids.clone(),
            context: prompt_ids.to_vec(),
            prompt_len: prompt_ids.len(),
            generated: vec![],
            pending: prompt_ids.to_vec(),
            budget: params.max_new_tokens.min(max_ctx - prompt_ids.len()),
            detokenizer: Detokenizer::default(),
            finish: None,
            constraint: None,
            adapter: None,
        })
    }

    /// Makes the answer follow `matcher`'s grammar (see `constraint`).
    pub fn constrain(&mut self, matcher: llguidance::Matcher) {
        self.constraint = Some(matcher);
    }

    /// Runs this sequence with `adapter`'s update over the base model's layers.
    pub fn adapt(&mut self, adapter: Arc<ServingAdapter>) {
        self.adapter = Some(adapter);
    }

    pub fn prompt_ids(&self) -> &[u32] {
        &self.context[..self.prompt_len]
    }

    pub fn generated_ids(&self) -> &[u32] {
        &self.generated
    }

    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// The text emitted so far (stop strings and held-back text excluded).
    pub fn text(&self) -> String {
        self.stream.emitted_text(self.detokenizer.text())
    }

    /// Runs one forward (the whole prompt on the first call) and samples one token.
    pub fn step(&mut self, model: &CausalLm, tokenizer: &TextTokenizer) -> Result<SequenceStep> {
        if let Some(done) = self.done_step() {
            return Ok(done);
        }
        let input = Tensor::new(self.pending.as_slice(), model.device())?.unsqueeze(0)?;
        let adapters = RowAdapters::all(self.adapter.as_ref());
        if let (Some(top), 0) = (self.params.prompt_logprobs, self.cache.seq_len()) {
            // The prompt's logits at every position: position i scores prompt token i + 1.
            let all = model.forward_cached_all(&input, &mut self.cache, &adapters)?.squeeze(0)?.to_dtype(DType::F32)?;
            let t = all.dim(0)?;
            let rows = all.to_vec2::<f32>()?;
            let scored = (0..t - 1).map(|i| token_logprob(&rows[i], self.pending[i + 1], top)).collect();
            let mut step = self.accept(all.get(t - 1)?, tokenizer)?;
            step.prompt_logprobs = Some(scored);
            return Ok(step);
        }
        let logits = model.forward_cached(&input, &mut self.cache, &adapters)?.squeeze(0)?;
        self.accept(logits, tokenizer)
    }

    /// The step of a sequence that has nothing left to run, if it is one.
    fn done_step(&mut self) -> Option<SequenceStep> {
        if let Some(f) = self.finish {
            return Some(SequenceStep { text: String::new(), token: None, logprob: None, finished: Some(f), prompt_logprobs: None });
        }
        if self.generated.len() >= self.budget {
            return Some(self.end(FinishReason::Length, None));
        }
        None
    }

    /// Whether the prompt is in the cache and the next step feeds a single token (so the step
    /// can join a batched decode, `decode_rows`).
    pub fn is_decoding(&self) -> bool {
        self.finish.is_none() && self.pending.len() == 1 && self.cache.seq_len() > 0 && self.generated.len() < self.budget
    }

    /// Samples from `logits` (vocab) of the sequence's next position: penalties, sampler, eos,
    /// stop strings, length.
    fn accept(&mut self, logits: Tensor, tokenizer: &TextTokenizer) -> Result<SequenceStep> {
        let logits = logits.to_dtype(DType::F32)?;
        let logits = if self.params.repetition_penalty != 1.0 {
            candle_transformers::utils::apply_repeat_penalty(&logits, self.params.repetition_penalty, &self.context)?
        } else {
            logits
        };
        let p = &self.params;
        let needs_values = p.presence_penalty != 0.0
            || p.frequency_penalty != 0.0
            || p.min_p.is_some_and(|m| m > 0.0)
            || p.logprobs.is_some()
            || !p.logit_bias.is_empty()
            || self.constraint.is_some();
        let (logits, values) = if needs_values {
            let mut v = logits.to_vec1::<f32>()?;
            if let Some(m) = &mut self.constraint {
                constraint::mask_logits(m, &mut v)?;
            }
            adjust_logits(&mut v, &self.generated, p);
            (Tensor::new(v.as_slice(), logits.device())?, Some(v))
        } else {
            (logits, None)
        };
        let next = self.sampler.sample(&logits)?;
        let logprob = match (&values, p.logprobs) {
            (Some(v), Some(top)) => Some(token_logprob(v, next, top)),
            _ => None,
        };
        if self.eos_ids.contains(&next) {
            return Ok(self.end(FinishReason::Stop, None));
        }
        if let Some(m) = &mut self.constraint {
            m.consume_token(next).map_err(|e| anyhow::anyhow!("the output grammar refused token {next}: {e}"))?;
        }
        self.generated.push(next);
        self.context.push(next);
        self.pending = vec![next];
        let step = self.stream.push(self.detokenizer.push(tokenizer, &self.generated)?);
        if step.stopped {
            self.finish = Some(FinishReason::Stop);
            return Ok(SequenceStep { text: step.text, token: Some(next), logprob, finished: self.finish, prompt_logprobs: None });
        }
        if self.generated.len() >= self.budget {
            let mut out = self.end(FinishReason::Length, Some(next));
            out.text = step.text + &out.text;
            out.logprob = logprob;
            return Ok(out);
        }
        Ok(SequenceStep { text: step.text, token: Some(next), logprob, finished: None, prompt_logprobs: None })
    }

    /// Ends the sequence at eos or the length limit: text held back for a possible stop string
    /// is released, since no stop string can complete any more.
    fn end(&mut self, reason: FinishReason, token: Option<u32>) -> SequenceStep {
        self.finish = Some(reason);
        SequenceStep {
            text: self.stream.finish(self.detokenizer.text()),
            token,
            logprob: None,
            finished: Some(reason),
            prompt_logprobs: None,
        }
    }
}

/// One decode step for every sequence in `seqs` that `is_decoding`, batched through
/// `CausalLm::forward_decode_rows`; the others (prompts not yet run, finished ones) take their
/// own `step`. Results come in the order of `seqs`.
pub fn step_all(model: &CausalLm, tokenizer: &TextTokenizer, seqs: &mut [&mut Sequence]) -> Vec<Result<SequenceStep>> {
    let decoding: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].is_decoding()).collect();
    let mut out: Vec<Option<Result<SequenceStep>>> = (0..seqs.len()).map(|_| None).collect();
    if decoding.len() > 1 {
        let tokens: Vec<u32> = decoding.iter().map(|&i| seqs[i].pending[0]).collect();
        let batched = {
            let per_row: Vec<Option<&Arc<ServingAdapter>>> = decoding.iter().map(|&i| seqs[i].adapter.as_ref()).collect();
            let adapters = RowAdapters::of_rows(&per_row, model.device());
            let mut caches: Vec<&mut KvCache> = seqs.iter_mut().filter(|q| q.is_decoding()).map(|q| &mut q.cache).collect();
            adapters.and_then(|a| Ok(model.forward_decode_rows(&tokens, &mut caches, &a)?))
        };
        match batched {
            Ok(logits) => {
                for (row, &i) in decoding.iter().enumerate() {
                    out[i] = Some(logits.get(row).map_err(anyhow::Error::from).and_then(|l| seqs[i].accept(l, tokenizer)));
                }
            }
            Err(e) => {
                let msg = format!("{e:#}");
                for &i in &decoding {
                    out[i] = Some(Err(anyhow::anyhow!("batched decode: {msg}")));
                }
            }
        }
    }
    for (i, slot) in out.iter_mut().enumerate() {
        if slot.is_none() {
            *slot = Some(seqs[i].step(model, tokenizer));
        }
    }
    out.into_iter().map(Option::unwrap).collect()
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
    let mut seq = Sequence::new(model, prompt_ids, eos_ids, params)?;
    let start = Instant::now();
    let (mut first_token_at, mut logprobs) = (None, vec![]);
    let finish = loop {
        let step = seq.step(model, tokenizer)?;
        first_token_at.get_or_insert_with(Instant::now);
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
