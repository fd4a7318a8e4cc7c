//! One sequence being generated: its KV cache, sampler, stop strings and streamed text,
//! advanced a forward at a time (a chunk of its prompt, then one token per step).

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use models::{CausalLm, KvCache, RowAdapters, ServingAdapter, SharedBlock, KV_BLOCK};
use serde::Serialize;

use super::detokenize::Detokenizer;
use super::prefix_cache::Namespace;
use super::reasoning::ThinkSplit;
use super::sampler::Sampler;
use super::{constraint, FinishReason, SamplingParams, TextStream};
use crate::tokenize::TextTokenizer;

/// One sequence being generated, advanced a token at a time: the unit a serving loop
/// interleaves (each sequence owns its KV cache, sampler and stop-string state).
pub struct Sequence {
    sampler: Sampler,
    params: SamplingParams,
    pub(super) cache: KvCache,
    stream: TextStream,
    eos_ids: HashSet<u32>,
    /// Prompt and generated ids (for the repetition penalty).
    context: Vec<u32>,
    prompt_len: usize,
    generated: Vec<u32>,
    /// Ids the next forwards consume: the prompt first (chunk by chunk), then the last sampled
    /// token.
    pub(super) pending: Vec<u32>,
    /// With `SamplingParams::prompt_logprobs`: the prompt's tokens scored by the chunks fed so far.
    scored_prompt: Vec<TokenLogprob>,
    /// Prompt tokens a prefix cache supplied.
    cached_prompt_tokens: usize,
    budget: usize,
    /// The generated ids' text, kept up to date token by token.
    detokenizer: Detokenizer,
    /// The sampled tokens' summed log-probability (with `OutputControls::cumulative_logprob`).
    cumulative_logprob: f64,
    finish: Option<FinishReason>,
    /// The stop string that ended the answer, if one did.
    stopped_by: Option<String>,
    /// The eos token that ended the answer, if one did (it is not among the generated ids).
    ended_by_eos: Option<u32>,
    /// The grammar the answer must follow (structured output), if any.
    constraint: Option<llguidance::Matcher>,
    /// A reasoning model's thinking, followed as the text grows: it counts the thinking's
    /// tokens, and the grammar holds only the answer after it.
    thinking: Option<Thinking>,
    /// The LoRA adapter this sequence runs with over the base (multi-LoRA serving), if any.
    pub(super) adapter: Option<Arc<ServingAdapter>>,
    /// When its first token was sampled (`OutputControls::max_predict_time` counts from there).
    generating_since: Option<std::time::Instant>,
}

/// Where a reasoning model's answer is: in its thinking or past it.
struct Thinking {
    split: ThinkSplit,
    /// Bytes of the generated text fed to `split`.
    fed: usize,
    /// Generated tokens when the thinking ended.
    ended_at: Option<usize>,
    /// The end of the thinking still to write once its budget is spent (then `Some`).
    closing: Option<VecDeque<u32>>,
}

/// What one step produced (nothing, `default()`, for a chunk of a prompt with more to feed).
#[derive(Debug, Clone, PartialEq, Default)]
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

/// Applies OpenAI's logit bias and presence/frequency penalties (on the tokens of `penalized`),
/// then min-p filtering, to `logits`.
fn adjust_logits(logits: &mut [f32], penalized: &[u32], params: &SamplingParams) {
    for &(t, bias) in &params.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += bias;
        }
    }
    if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
        let mut counts: std::collections::HashMap<u32, usize> = std::collections::HashMap::new();
        for &t in penalized {
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
            sampler: params.sampler(params.seed),
            params: params.clone(),
            cache: KvCache::new(model.config()),
            stream: TextStream::new(params.stop.clone(), params.output.include_stop_str_in_output)
                .with_min_indent(params.output.min_indent),
            eos_ids: eos_ids.clone(),
            context: prompt_ids.to_vec(),
            prompt_len: prompt_ids.len(),
            generated: vec![],
            pending: prompt_ids.to_vec(),
            scored_prompt: vec![],
            cached_prompt_tokens: 0,
            budget: params.max_new_tokens.min(max_ctx - prompt_ids.len()),
            detokenizer: Detokenizer::new(params.output.skip_special_tokens, params.output.spaces_between_special_tokens),
            cumulative_logprob: 0.0,
            finish: None,
            constraint: None,
            thinking: None,
            stopped_by: None,
            ended_by_eos: None,
            adapter: None,
            generating_since: None,
        })
    }

    /// Follows the answer's thinking (a reasoning model's, `inside`: the prompt opened the
    /// block): a grammar from [`Self::constrain`] then applies once the thinking is over.
    pub fn expect_thinking(&mut self, inside: bool) {
        self.thinking = Some(Thinking { split: ThinkSplit::new(inside), fed: 0, ended_at: None, closing: None });
    }

    /// Tokens of the answer's thinking: up to the one that ended it, or all when it never
    /// ended; 0 without thinking.
    pub fn reasoning_tokens(&self) -> usize {
        match &self.thinking {
            Some(t) if t.split.thought() => t.ended_at.unwrap_or(self.generated.len()),
            _ => 0,
        }
    }

    /// The token that replaces the sampled one: the thinking's end, once its budget
    /// (`OutputControls::thinking_budget`) is spent and until the end is written.
    fn forced_by_budget(&mut self) -> Option<u32> {
        let budget = self.params.output.thinking_budget.as_ref()?;
        let t = self.thinking.as_mut().filter(|t| t.ended_at.is_none())?;
        if t.closing.is_none() && t.split.thought() && self.generated.len() >= budget.tokens {
            t.closing = Some(budget.close_ids.iter().copied().collect());
        }
        t.closing.as_mut()?.pop_front()
    }

    /// Whether a grammar holds the next token (none before the thinking is over).
    fn constrained_now(&self) -> bool {
        self.constraint.is_some() && self.thinking.as_ref().is_none_or(|t| t.ended_at.is_some())
    }

    /// Makes the answer follow `matcher`'s grammar (see `constraint`).
    pub fn constrain(&mut self, matcher: llguidance::Matcher) {
        self.constraint = Some(matcher);
    }

    /// Runs this sequence with `adapter`'s update over the base model's layers.
    pub fn adapt(&mut self, adapter: Arc<ServingAdapter>) {
        self.adapter = Some(adapter);
    }

    /// Whose keys and values this sequence computes (prefix caching keeps them apart).
    pub fn namespace(&self) -> Namespace {
        self.adapter.as_ref().map(|a| a.instance)
    }

    /// Full KV blocks of the prompt that a prefix cache may supply: all but the block holding
    /// the last prompt token (whose logits give the first new token), none when the prompt's
    /// every position must be scored (`prompt_logprobs`).
    pub fn reusable_prompt_blocks(&self) -> usize {
        if self.params.prompt_logprobs.is_some() {
            0
        } else {
            (self.prompt_len - 1) / KV_BLOCK
        }
    }

    /// Starts from `blocks`, the keys and values of the prompt's first `blocks.len() · KV_BLOCK`
    /// positions computed by an earlier sequence (prefix caching): only the rest is fed.
    pub fn reuse_prefix(&mut self, model: &CausalLm, blocks: &[SharedBlock]) -> Result<()> {
        if blocks.len() > self.reusable_prompt_blocks() || self.cache.seq_len() > 0 {
            bail!(
                "{} cached blocks for a prompt of {} tokens that may reuse {}",
                blocks.len(),
                self.prompt_len,
                self.reusable_prompt_blocks()
            );
        }
        self.cache = KvCache::from_shared(model.config(), blocks)?;
        self.pending.drain(..blocks.len() * KV_BLOCK);
        self.cached_prompt_tokens = blocks.len() * KV_BLOCK;
        Ok(())
    }

    /// Starts from `cache`, the keys and values of this sequence's prompt but its last token,
    /// computed once for several sequences of the same prompt (a GRPO group): only the last
    /// prompt token is left, which joins the batched decode of the next step.
    pub fn start_after(&mut self, cache: &KvCache) -> Result<()> {
        if cache.seq_len() + 1 != self.prompt_len || self.cache.seq_len() > 0 {
            bail!("a cache of {} positions for a prompt of {} tokens (it must hold all but the last)", cache.seq_len(), self.prompt_len);
        }
        self.cache = cache.clone();
        self.pending.drain(..cache.seq_len());
        self.cached_prompt_tokens = cache.seq_len();
        Ok(())
    }

    /// Prompt tokens whose keys and values came from a prefix cache.
    pub fn cached_prompt_tokens(&self) -> usize {
        self.cached_prompt_tokens
    }

    /// The tokens at the cached positions, and the cache (for a prefix cache to keep).
    pub fn cached(&self) -> (&[u32], &KvCache) {
        (&self.context[..self.cache.seq_len()], &self.cache)
    }

    pub fn prompt_ids(&self) -> &[u32] {
        &self.context[..self.prompt_len]
    }

    pub fn generated_ids(&self) -> &[u32] {
        &self.generated
    }

    /// The sampled tokens' summed log-probability (0 unless the params ask for it).
    pub fn cumulative_logprob(&self) -> f64 {
        self.cumulative_logprob
    }

    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// The eos token that ended the answer (None when something else did).
    pub fn eos_token(&self) -> Option<u32> {
        self.ended_by_eos
    }

    /// The stop string that ended the answer (None when something else did).
    pub fn stop_string(&self) -> Option<&str> {
        self.stopped_by.as_deref()
    }

    /// The text emitted so far (stop strings and held-back text excluded).
    pub fn text(&self) -> String {
        self.stream.emitted_text(self.detokenizer.text())
    }

    /// Runs one forward over at most `max_tokens` (at least one) of the tokens waiting: a chunk
    /// of the prompt (chunked prefill: an empty step while more of it waits), or its rest and
    /// then one token at a time, sampling each next token.
    pub fn step(&mut self, model: &CausalLm, tokenizer: &TextTokenizer, max_tokens: usize) -> Result<SequenceStep> {
        if let Some(done) = self.done_step() {
            return Ok(done);
        }
        let n = self.pending.len().min(max_tokens.max(1));
        let chunk: Vec<u32> = self.pending.drain(..n).collect();
        let last = self.pending.is_empty();
        let input = Tensor::new(chunk.as_slice(), model.device())?.unsqueeze(0)?;
        let adapters = RowAdapters::all(self.adapter.as_ref());
        if let Some(top) = self.params.prompt_logprobs.filter(|_| self.generated.is_empty()) {
            // The chunk's logits at every position: each scores the prompt token after it.
            let all = model.forward_cached_all(&input, &mut self.cache, &adapters)?.squeeze(0)?.to_dtype(DType::F32)?;
            let rows = all.to_vec2::<f32>()?;
            let next = chunk[1..].iter().chain(self.pending.first());
            self.scored_prompt.extend(rows.iter().zip(next).map(|(row, &t)| token_logprob(row, t, top)));
            if !last {
                return Ok(SequenceStep::default());
            }
            let mut step = self.accept(all.get(n - 1)?, tokenizer)?;
            step.prompt_logprobs = Some(std::mem::take(&mut self.scored_prompt));
            return Ok(step);
        }
        if !last {
            model.feed(&input, &mut self.cache, &adapters)?;
            return Ok(SequenceStep::default());
        }
        let logits = model.forward_cached(&input, &mut self.cache, &adapters)?.squeeze(0)?;
        self.accept(logits, tokenizer)
    }

    /// Prompt tokens still to feed (0 once the prompt is in the cache and the sequence decodes).
    pub fn prompt_tokens_to_feed(&self) -> usize {
        if self.finish.is_some() || !self.generated.is_empty() {
            0
        } else {
            self.pending.len()
        }
    }

    /// The step of a sequence that has nothing left to run, if it is one.
    fn done_step(&mut self) -> Option<SequenceStep> {
        if let Some(f) = self.finish {
            return Some(SequenceStep { finished: Some(f), ..Default::default() });
        }
        if self.generated.len() >= self.budget {
            return Some(self.end(FinishReason::Length, None));
        }
        None
    }

    /// Whether the prompt is in the cache and the next step feeds a single token (so the step
    /// can join a batched decode, `decode_rows`).
    pub fn is_decoding(&self) -> bool {
        let scoring_prompt = self.params.prompt_logprobs.is_some() && self.generated.is_empty();
        self.finish.is_none()
            && self.pending.len() == 1
            && self.cache.seq_len() > 0
            && self.generated.len() < self.budget
            && !scoring_prompt
    }

    /// The logits the sampler draws from: as given, or (`as_values`) as a vector with the
    /// request's biases and penalties, the grammar's mask (`mask`) and the ends `min_tokens` holds
    /// back (`hold_ends`) applied, returned too for scores.
    fn adjusted(&mut self, logits: &Tensor, as_values: bool, mask: bool, hold_ends: bool) -> Result<(Tensor, Option<Vec<f32>>)> {
        if !as_values {
            return Ok((logits.clone(), None));
        }
        let mut v = logits.to_vec1::<f32>()?;
        if let Some(m) = self.constraint.as_mut().filter(|_| mask) {
            constraint::mask_logits(m, &mut v)?;
        }
        let penalized = match self.params.penalty_last_n {
            Some(n) => &self.context[self.context.len().saturating_sub(n)..],
            None => &self.generated[..],
        };
        adjust_logits(&mut v, penalized, &self.params);
        if hold_ends {
            for &t in self.eos_ids.iter().chain(&self.params.output.stop_token_ids) {
                if let Some(l) = v.get_mut(t as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        Ok((Tensor::new(v.as_slice(), logits.device())?, Some(v)))
    }

    /// Samples from `logits` (vocab) of the sequence's next position: penalties, sampler, eos,
    /// stop strings, length.
    pub(super) fn accept(&mut self, logits: Tensor, tokenizer: &TextTokenizer) -> Result<SequenceStep> {
        let forced = self.forced_by_budget();
        let logits = logits.to_dtype(DType::F32)?;
        let logits = if self.params.repetition_penalty != 1.0 {
            let n = self.params.penalty_last_n.unwrap_or(self.context.len());
            let window = &self.context[self.context.len().saturating_sub(n)..];
            candle_transformers::utils::apply_repeat_penalty(&logits, self.params.repetition_penalty, window)?
        } else {
            logits
        };
        let p = &self.params;
        // vLLM's min_tokens: eos and stop tokens are masked until the answer has that many (not
        // under a grammar, whose end may leave nothing else).
        let constrained = self.constrained_now();
        let hold_ends = self.generated.len() < p.output.min_tokens && !constrained;
        // Under a grammar, a token it allows needs no mask (computing one reads the whole
        // vocabulary): draw freely and mask only when the grammar refuses the draw, as llama.cpp
        // does. The same token when greedy, the same distribution with a temperature alone; not
        // when scores are reported (they are the masked distribution's).
        let check_first = constrained && p.logprobs.is_none() && !p.output.cumulative_logprob && p.draws_from_whole_distribution();
        let mask_now = constrained && !check_first;
        let needs_values = p.presence_penalty != 0.0
            || p.frequency_penalty != 0.0
            || p.min_p.is_some_and(|m| m > 0.0)
            || p.logprobs.is_some()
            || !p.logit_bias.is_empty()
            || mask_now
            || hold_ends
            || p.output.cumulative_logprob;
        let (scores, values) = self.adjusted(&logits, needs_values, mask_now, hold_ends)?;
        let mut sampled = self.sampler.sample(&scores)?;
        if check_first && forced.is_none() {
            let m = self.constraint.as_mut().expect("a grammar when constrained");
            let allowed = m.validate_tokens(&[sampled]).map_err(|e| anyhow::anyhow!("the output grammar: {e}"))? == 1;
            if !allowed {
                let (masked, _) = self.adjusted(&logits, true, true, false)?;
                sampled = self.sampler.sample(&masked)?;
            }
        }
        let p = &self.params;
        let next = forced.unwrap_or(sampled);
        let logprob = match (&values, p.logprobs) {
            (Some(v), Some(top)) => Some(token_logprob(v, next, top)),
            _ => None,
        };
        if let (Some(v), true) = (&values, p.output.cumulative_logprob) {
            self.cumulative_logprob += token_logprob(v, next, 0).logprob as f64;
        }
        // Under `ignore_eos` an eos token is an ordinary one, unless a grammar has ended.
        if self.eos_ids.contains(&next) && (constrained || !p.output.ignore_eos) {
            self.ended_by_eos = Some(next);
            return Ok(self.end(FinishReason::Stop, None));
        }
        if let Some(m) = self.constraint.as_mut().filter(|_| constrained) {
            m.consume_token(next).map_err(|e| anyhow::anyhow!("the output grammar refused token {next}: {e}"))?;
        }
        let stop_token = self.params.output.stop_token_ids.contains(&next);
        let keep_stop_text = self.params.output.include_stop_str_in_output;
        if stop_token && !keep_stop_text {
            // vLLM's stop_token_ids: the token is generated (counted) but its text is not shown.
            let mut out = self.end(FinishReason::Stop, Some(next));
            self.generated.push(next);
            self.context.push(next);
            out.logprob = logprob;
            return Ok(out);
        }
        self.generated.push(next);
        self.context.push(next);
        self.pending = vec![next];
        let check_stops = self.generated.len() >= self.params.output.min_tokens;
        let full = self.detokenizer.push(tokenizer, &self.generated)?;
        if let Some(t) = self.thinking.as_mut().filter(|t| t.ended_at.is_none()) {
            let complete = full.trim_end_matches('\u{FFFD}');
            if let Some(new) = complete.get(t.fed..) {
                t.split.push(new);
                t.fed = complete.len();
            }
            if t.split.answering() {
                t.ended_at = Some(self.generated.len());
            }
        }
        let step = self.stream.push(full, check_stops);
        if step.stopped.is_some() || step.under_indented {
            self.finish = Some(if step.under_indented { FinishReason::Length } else { FinishReason::Stop });
            self.stopped_by = step.stopped;
            return Ok(SequenceStep { text: step.text, token: Some(next), logprob, finished: self.finish, ..Default::default() });
        }
        let since = *self.generating_since.get_or_insert_with(std::time::Instant::now);
        let out_of_time = self.params.output.max_predict_time.is_some_and(|t| since.elapsed() > t && full.contains('\n'));
        if stop_token || out_of_time || self.generated.len() >= self.budget {
            let reason = if stop_token { FinishReason::Stop } else { FinishReason::Length };
            let mut out = self.end(reason, Some(next));
            out.text = step.text + &out.text;
            out.logprob = logprob;
            return Ok(out);
        }
        Ok(SequenceStep { text: step.text, token: Some(next), logprob, ..Default::default() })
    }

    /// Ends the sequence at eos or the length limit: text held back for a possible stop string
    /// is released, since no stop string can complete any more.
    fn end(&mut self, reason: FinishReason, token: Option<u32>) -> SequenceStep {
        self.finish = Some(reason);
        SequenceStep { text: self.stream.finish(self.detokenizer.text()), token, finished: Some(reason), ..Default::default() }
    }
}
