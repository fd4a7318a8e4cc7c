//! One pass from a request body to what the engine runs, as TGI's `validation.rs` does: the
//! fields checked against what the endpoint accepts, the model looked up, sampling read, the
//! prompt tokenised (chat through the template, with the functions), the answer's length settled
//! against the context, `n` against the server's capacity, and one grammar matcher per answer
//! built. Everything a client can get wrong is a 400 here; nothing after this pass refuses a
//! request for what it asked (the queue may still be full: 429).

pub mod anthropic;
pub mod infill;
pub mod llama_cpp;
mod no_op;
pub mod ollama;
mod prompt;
pub mod responses;
mod sampling;
pub mod structured;

use std::sync::Arc;

use serde_json::Value;

use super::error::ApiError;
use super::fields::{self, Fields};
use super::served_model::ServedModel;
use super::state::AppState;
use super::tools::{self, ToolChoice, Tools};
use crate::generate::constraint::OutputFormat;
use crate::generate::reasoning::{PromptThinking, ThinkingBudget};
use crate::generate::SamplingParams;
use models::ServingAdapter;
pub use prompt::{texts, token_ids, Prompt};
pub use sampling::{MAX_N, MAX_STOP};

/// `max_tokens` of a completion that gives none (OpenAI's default). A chat answer may take the
/// rest of the context.
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;

/// Which endpoint a request came through, with what shapes its answer.
pub enum RequestKind {
    /// `/v1/completions`; `echo`: the prompt text, returned before the answer.
    Completion { echo: Option<String> },
    /// `/v1/chat/completions`; `tools`: the functions the answer may call (none when the request
    /// gives none, or says `tool_choice: none`).
    Chat { tools: Option<Tools> },
    /// `/v1/responses`: chat's answer in output items; `echo`: the settings the response repeats.
    Responses { tools: Option<Tools>, echo: responses::Echo },
    /// `/v1/messages` (Anthropic's): chat's answer in content blocks; `thinking`: what its
    /// thinking becomes.
    Messages { tools: Option<Tools>, thinking: anthropic::ThinkingBlocks },
    /// `/completion` (llama.cpp's server's own API): what its answer repeats.
    LlamaCpp(Box<llama_cpp::Echo>),
    /// Ollama's `/api/chat` or `/api/generate` (`api`); `tools` as chat's.
    Ollama { tools: Option<Tools>, api: ollama::Api },
}

impl RequestKind {
    pub fn is_chat(&self) -> bool {
        matches!(self, Self::Chat { .. })
    }

    /// The functions the answer may call.
    pub fn tools(&self) -> Option<&Tools> {
        match self {
            Self::Chat { tools } | Self::Responses { tools, .. } | Self::Messages { tools, .. } | Self::Ollama { tools, .. } => {
                tools.as_ref()
            }
            Self::Completion { .. } | Self::LlamaCpp(_) => None,
        }
    }

    /// The parameter that holds the prompt, for messages.
    fn prompt_param(&self) -> &'static str {
        match self {
            Self::Completion { .. } | Self::LlamaCpp(_) | Self::Ollama { api: ollama::Api::Generate, .. } => "prompt",
            Self::Chat { .. } | Self::Messages { .. } | Self::Ollama { api: ollama::Api::Chat, .. } => "messages",
            Self::Responses { .. } => "input",
        }
    }
}

/// A generation request, checked and ready to run.
pub struct ValidatedRequest {
    /// The model whose engine runs it (for an adapter, its base).
    pub model: Arc<ServedModel>,
    /// The LoRA adapter the answers run with over `model`, if the request named one.
    pub adapter: Option<Arc<ServingAdapter>>,
    /// The `model` the request named, which its answer repeats.
    pub model_id: String,
    pub kind: RequestKind,
    pub prompt_ids: Vec<u32>,
    /// The sampling of every answer (answer i seeds with `params.seed + i`), with
    /// `max_new_tokens` settled.
    pub params: SamplingParams,
    /// Answers returned.
    pub n: usize,
    /// Answers generated (at least `n`): the `n` with the highest cumulative log-probability are
    /// returned (`best_of`).
    pub best_of: usize,
    pub stream: bool,
    pub include_usage: bool,
    /// One grammar matcher per answer (`response_format`, a forced function call), or none.
    pub constraints: Vec<llguidance::Matcher>,
    /// Fields `--lenient` ignored, for the response header.
    pub ignored: Vec<String>,
    /// The client's `prompt_cache_key`: the prefix cache keeps this conversation's blocks
    /// longer than unnamed ones (`PrefixCache::insert`).
    pub cache_key: Option<String>,
    /// For a chat or Responses answer of a model whose thinking is split out: where the prompt
    /// leaves it.
    pub thinking: Option<PromptThinking>,
}

/// `/v1/completions`: one request per prompt (a batch's prompts each as if sent alone, in
/// order). A prompt's own error in a batch names it (`prompt[i]`); the batch's answers together
/// must fit the server's capacity, as they are admitted together.
pub fn completions(st: &AppState, v: &Value) -> Result<Vec<ValidatedRequest>, ApiError> {
    completions_as(st, v, |echo| RequestKind::Completion { echo })
}

/// [`completions`] for an endpoint whose answers take the shape `kind` gives (from the echoed
/// prompt), and its default length (`finish`).
fn completions_as(st: &AppState, v: &Value, kind: impl Fn(Option<String>) -> RequestKind) -> Result<Vec<ValidatedRequest>, ApiError> {
    let ignored = fields::check_lists(v, &[fields::COMPLETIONS, fields::VLLM_SAMPLING, structured::FIELDS], "", st.lenient)?;
    let target = Target::of(st, v)?;
    let prompts = prompt::prompts(v, target.model.vocab)?;
    batch(st, prompts, |_, p| completion(st, v, target.clone(), p, ignored.clone(), &kind))
}

/// A batch's requests, one per prompt (`one` validates prompt i), in order: a prompt's own error
/// names it (`prompt[i]`) when there are several, and the batch must fit the server at once,
/// as it is admitted whole.
fn batch<P>(
    st: &AppState,
    prompts: Vec<P>,
    mut one: impl FnMut(usize, P) -> Result<ValidatedRequest, ApiError>,
) -> Result<Vec<ValidatedRequest>, ApiError> {
    let several = prompts.len() > 1;
    let reqs = prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| one(i, p).map_err(|e| if several { in_batch(e, i) } else { e }))
        .collect::<Result<Vec<_>, _>>()?;
    let sequences: usize = reqs.iter().map(|r| r.best_of).sum();
    let capacity = st.max_concurrent + st.max_queue;
    if sequences > capacity {
        let message = format!(
            "{} prompts of {} answers each are {sequences} sequences, more than this server admits at once ({capacity}: --max-concurrent-requests + --max-queue).",
            reqs.len(),
            reqs[0].best_of
        );
        return Err(ApiError::invalid("prompt", message));
    }
    Ok(reqs)
}

/// A batch prompt's error: one about the prompt itself names it, one about its length says which.
fn in_batch(mut e: ApiError, i: usize) -> ApiError {
    let about_prompt = e.param.as_deref() == Some("prompt");
    if about_prompt {
        e.param = Some(format!("prompt[{i}]"));
    }
    if about_prompt || e.code == Some("context_length_exceeded") {
        e.message = format!("`prompt[{i}]`: {}", e.message);
    }
    e
}

/// One prompt of `/v1/completions`.
fn completion(
    st: &AppState,
    v: &Value,
    target: Target,
    prompt: Prompt,
    mut ignored: Vec<String>,
    kind: impl Fn(Option<String>) -> RequestKind,
) -> Result<ValidatedRequest, ApiError> {
    let model = target.model.clone();
    let mut s = sampling::parse(v, &model.defaults, false)?;
    s.params.logit_bias = sampling::logit_bias(v, model.vocab)?;
    s.params.output.stop_token_ids = sampling::stop_token_ids(v, model.vocab)?;
    let (prompt_ids, text) = match (prompt, Fields::of(v)?.string("suffix")?) {
        // Fill in the middle: the prompt is the text before the gap.
        (_, Some(_)) if s.echo => return Err(ApiError::invalid("echo", "`echo` cannot be combined with `suffix`.")),
        (prefix, Some(suffix)) => {
            let fim = infill::around(&model, prefix, suffix, "suffix")?;
            s.params.output.stop_token_ids.extend(fim.ends);
            (fim.ids, String::new())
        }
        (Prompt::Text(t), None) => (model.tokenizer.encode(&t, true).map_err(|e| ApiError::bad_request(format!("{e:#}")))?, t),
        (Prompt::Tokens(ids), None) => {
            let t = model.tokenizer.decode(&ids, false).unwrap_or_default();
            (ids, t)
        }
    };
    let echo = s.echo.then_some(text);
    // Echo with logprobs scores the prompt too (OpenAI's shape: the first token's is null).
    if echo.is_some() {
        s.params.prompt_logprobs = s.params.logprobs;
    }
    let constraints = match requested_format(st, v, &mut ignored)? {
        Some(r) => matchers(&model, &r.format, &r.param, s.n)?,
        None => vec![],
    };
    finish(st, target, kind(echo), prompt_ids, s, constraints, ignored)
}

/// `/v1/chat/completions`.
pub fn chat(st: &AppState, v: &Value) -> Result<ValidatedRequest, ApiError> {
    let mut ignored = fields::check_lists(v, &[fields::CHAT, fields::VLLM_SAMPLING, structured::FIELDS], "", st.lenient)?;
    no_op::check(v)?;
    let target = Target::of(st, v)?;
    let model = target.model.clone();
    let mut s = sampling::parse(v, &model.defaults, true)?;
    s.params.logit_bias = sampling::logit_bias(v, model.vocab)?;
    s.params.output.stop_token_ids = sampling::stop_token_ids(v, model.vocab)?;
    let mut messages = prompt::messages(v, st.lenient, &mut ignored)?;
    let prefill = prompt::continued_turn(v, &mut messages)?;
    let (tools, constraints) = tools_and_constraints(st, &model, v, &mut s, &mut ignored)?;
    let kwargs = prompt::chat_template_kwargs(v)?;
    let prompt_ids = model.chat_prompt_ids_continuing(&messages, tools.as_ref(), &kwargs, &prefill)?;
    let thinking = model.prompt_thinking(&prompt_ids);
    let mut req = finish(st, target, RequestKind::Chat { tools }, prompt_ids, s, constraints, ignored)?;
    req.thinking = thinking;
    Ok(req)
}

/// `/v1/responses`: read into chat's values (`responses`), then chat's checks, with the fields
/// named as the Responses API names them.
pub fn responses(st: &AppState, v: &Value) -> Result<ValidatedRequest, ApiError> {
    let mut ignored = fields::check(v, fields::RESPONSES, "", st.lenient)?;
    no_op::check(v)?;
    let target = Target::of(st, v)?;
    let model = target.model.clone();
    let r = responses::read(v, st.lenient, &mut ignored)?;
    let renamed = |e: ApiError| {
        let param = e
            .param
            .as_ref()
            .map(|p| p.replacen("response_format.json_schema", "text.format", 1).replacen("response_format", "text.format", 1));
        ApiError { param, ..e }
    };
    let mut s = sampling::parse(&r.chat, &model.defaults, true)?;
    s.max_tokens = r.max_output_tokens;
    let (tools, constraints) = tools_and_constraints(st, &model, &r.chat, &mut s, &mut ignored).map_err(renamed)?;
    let prompt_ids = model.chat_prompt_ids(&r.messages, tools.as_ref(), &Default::default())?;
    let thinking = model.prompt_thinking(&prompt_ids);
    let kind = RequestKind::Responses { tools, echo: r.echo };
    let named = |e: ApiError| ApiError { param: e.param.as_ref().map(|p| p.replace("max_tokens", "max_output_tokens")), ..e };
    let mut req = finish(st, target, kind, prompt_ids, s, constraints, ignored).map_err(named)?;
    req.thinking = thinking;
    Ok(req)
}

/// `/v1/messages` (Anthropic's): read into chat's values (`anthropic`), then chat's checks, with
/// the fields named as the Messages API names them.
pub fn messages(st: &AppState, v: &Value) -> Result<ValidatedRequest, ApiError> {
    let mut ignored = fields::check(v, anthropic::accepted(false), "", st.lenient)?;
    let target = Target::named(st, v)?;
    let model = target.model.clone();
    let renamed = |e: ApiError| ApiError { param: e.param.as_deref().map(anthropic::rename_param), ..e };
    let r = anthropic::read(v, false, st.lenient, &mut ignored)?;
    let mut s = sampling::parse(&r.chat, &model.defaults, true).map_err(renamed)?;
    let (tools, constraints) = tools_and_constraints(st, &model, &r.chat, &mut s, &mut ignored).map_err(renamed)?;
    let prompt_ids = anthropic_prompt(&model, &r, tools.as_ref())?;
    let thinking = model.prompt_thinking(&prompt_ids);
    if model.splits_reasoning {
        s.params.output.thinking_budget = Some(thinking_budget(&model, r.thinking));
    } else if matches!(r.thinking, anthropic::Thinking::On { budget: Some(_), .. }) {
        // `adaptive` lets the model decide, and this one decides not to think.
        let message = "This model does not think: its chat template marks no thinking (see `--reasoning-parser`).";
        return Err(ApiError::invalid("thinking", message));
    }
    let kind = RequestKind::Messages { tools, thinking: r.thinking.blocks() };
    let mut req = finish(st, target, kind, prompt_ids, s, constraints, ignored).map_err(renamed)?;
    req.thinking = thinking;
    Ok(req)
}

/// Ollama's `/api/chat` and `/api/generate` (`ollama`): read into a chat body (or, for a raw
/// prompt, a completion's), then chat's or completions' checks, with parameters named as Ollama
/// names them.
pub fn ollama(st: &AppState, v: &Value, api: ollama::Api) -> Result<ValidatedRequest, ApiError> {
    let (r, ignored) = match api {
        ollama::Api::Chat => ollama::chat(v, st.lenient)?,
        ollama::Api::Generate => ollama::generate(v, st.lenient)?,
    };
    let renamed = |e: ApiError| ApiError { param: e.param.as_deref().map(ollama::rename_param), ..e };
    // Ollama's kind from the start: its answers run to the context's end by default (`finish`).
    let mut req = match r.raw {
        true => completions_as(st, &r.body, |_| RequestKind::Ollama { tools: None, api }).map_err(renamed)?.pop().expect("one prompt"),
        false => {
            let mut req = chat(st, &r.body).map_err(renamed)?;
            let tools = match std::mem::replace(&mut req.kind, RequestKind::Ollama { tools: None, api }) {
                RequestKind::Chat { tools } => tools,
                _ => None,
            };
            req.kind = RequestKind::Ollama { tools, api };
            req
        }
    };
    if r.think == Some(true) && !req.model.splits_reasoning {
        let message = format!("`{}` does not think: its chat template marks no thinking (see `--reasoning-parser`).", req.model_id);
        return Err(ApiError::invalid("think", message));
    }
    if let Some(n) = r.repeat_last_n {
        req.params.penalty_last_n = Some(if n < 0 { usize::MAX } else { n as usize });
    }
    req.model_id = v["model"].as_str().unwrap_or_default().to_string();
    req.ignored.extend(ignored.into_iter().chain(r.loading));
    Ok(req)
}

/// `/v1/messages/count_tokens`: the model and the prompt's token count, as `/v1/messages` with
/// the same body would have it.
pub fn count_tokens(st: &AppState, v: &Value) -> Result<usize, ApiError> {
    fields::check(v, anthropic::accepted(true), "", false)?;
    let model = st.target(model_field(v)?)?.0;
    let r = anthropic::read(v, true, false, &mut vec![])?;
    let tools = tools::parse(&r.chat).map_err(|e| ApiError { param: e.param.as_deref().map(anthropic::rename_param), ..e })?;
    Ok(anthropic_prompt(&model, &r, tools.filter(|t| t.choice != ToolChoice::None).as_ref())?.len())
}

fn anthropic_prompt(model: &ServedModel, r: &anthropic::AsChat, tools: Option<&Tools>) -> Result<Vec<u32>, ApiError> {
    let kwargs = prompt::chat_template_kwargs(&r.chat)?;
    model.chat_prompt_ids_continuing(&r.messages, tools, &kwargs, &r.prefill)
}

/// The tokens a reasoning model's thinking may take (none with thinking off: a template that
/// cannot switch it off has it closed at once), and the text that closes it.
fn thinking_budget(model: &ServedModel, thinking: anthropic::Thinking) -> ThinkingBudget {
    let tokens = match thinking {
        anthropic::Thinking::Off => 0,
        anthropic::Thinking::On { budget, .. } => budget.unwrap_or(usize::MAX),
    };
    ThinkingBudget { tokens, close_ids: model.thinking_end_ids.clone() }
}

/// A chat-shaped body's functions (none when `tool_choice` is `none`), in the model's own call
/// format, and the grammar matchers its answers follow (`response_format`, a forced call, or an
/// `auto` answer's lazy grammar), one per answer. A format whose calls open with a special token
/// keeps special tokens in the text.
fn tools_and_constraints(
    st: &AppState,
    model: &ServedModel,
    v: &Value,
    s: &mut sampling::Sampling,
    ignored: &mut Vec<String>,
) -> Result<(Option<Tools>, Vec<llguidance::Matcher>), ApiError> {
    let tools = tools::parse(v)?.filter(|t| t.choice != ToolChoice::None).map(|mut t| {
        t.format = model.tool_format;
        t
    });
    // Read (and checked) even when a forced call decides this answer: `response_format` is then
    // for the text answer of a later turn (OpenAI's reading, and what the Agents SDK relies on).
    // Under `auto` the model picks a call or the format.
    let answer = requested_format(st, v, ignored)?;
    let tools_param = || "tools".to_string();
    let format = match tools.as_ref() {
        Some(t) if t.forces_call() => t.output_format().map(|f| (f, tools_param())),
        Some(t) => match answer {
            Some(a) if matches!(a.format, OutputFormat::JsonObject | OutputFormat::JsonSchema(_)) => {
                Some((t.call_or(&a.format), tools_param()))
            }
            Some(a) => {
                let message = format!(
                    "`{}` cannot be combined with `tools` under `tool_choice: auto`: only a JSON format can (the model then chooses between a call and the JSON). Send `tool_choice: none` or a JSON schema.",
                    a.param
                );
                return Err(ApiError::invalid(&a.param, message));
            }
            None => t.auto_grammar().map(|f| (f, tools_param())),
        },
        None => answer.map(|a| (a.format, a.param)),
    };
    if tools.as_ref().is_some_and(|t| t.choice == ToolChoice::Auto && t.format.needs_special_tokens()) {
        s.params.output.skip_special_tokens = false;
    }
    let constraints = match &format {
        None => vec![],
        Some((f, param)) => matchers(model, f, param, s.n)?,
    };
    Ok((tools, constraints))
}

/// The answer's format a body asks for: its `response_format`, or vLLM's structured outputs
/// (`structured::read`); both at once is a 400.
fn requested_format(st: &AppState, v: &Value, ignored: &mut Vec<String>) -> Result<Option<structured::Requested>, ApiError> {
    match (prompt::response_format(v, st.lenient, ignored)?, structured::read(v, st.lenient, ignored)?) {
        (Some(_), Some(r)) => {
            Err(ApiError::invalid(&r.param, format!("`{}` and `response_format` both constrain the answer; send one.", r.param)))
        }
        (Some(format), None) => {
            let param = match format {
                OutputFormat::JsonSchema(_) => "response_format.json_schema.schema",
                _ => "response_format",
            };
            Ok(Some(structured::Requested { format, param: param.to_string() }))
        }
        (None, r) => Ok(r),
    }
}

/// `/tokenize`: the model named (else the base model) and the ids of its `prompt` or `messages`.
pub fn tokenize(st: &AppState, v: &Value) -> Result<(Arc<ServedModel>, Vec<u32>), ApiError> {
    fields::check(v, fields::TOKENIZE, "", st.lenient)?;
    let model = model_or_base(st, v)?;
    let ids = if v.get("messages").is_some() {
        // The functions too, as the chat endpoint renders them.
        let tools = tools::parse(v)?;
        model.chat_prompt_ids(&prompt::messages(v, st.lenient, &mut vec![])?, tools.as_ref(), &prompt::chat_template_kwargs(v)?)?
    } else {
        match prompt::prompt(v, model.vocab)? {
            Prompt::Text(t) => {
                let special = Fields::of(v)?.bool("add_special_tokens")?;
                model.tokenizer.encode(&t, special.unwrap_or(true)).map_err(|e| ApiError::bad_request(format!("{e:#}")))?
            }
            Prompt::Tokens(ids) => ids,
        }
    };
    Ok((model, ids))
}

/// `/detokenize`: the model named (else the base model) and the `tokens` to decode.
pub fn detokenize(st: &AppState, v: &Value) -> Result<(Arc<ServedModel>, Vec<u32>), ApiError> {
    let model = model_or_base(st, v)?;
    let ids = match v.get("tokens") {
        Some(Value::Array(a)) => prompt::token_ids(a, model.vocab)
            .ok_or_else(|| ApiError::invalid("tokens", format!("`tokens` must be integers in [0, {}).", model.vocab)))?,
        _ => return Err(ApiError::invalid("tokens", "`tokens` must be a list of token ids.")),
    };
    Ok((model, ids))
}

/// The `model` field, checked (the model is looked up before the rest is read, because the
/// sampling defaults are the model's).
fn model_field(v: &Value) -> Result<&str, ApiError> {
    Fields::of(v)?.string("model")?.ok_or_else(|| ApiError::invalid("model", "`model` is required."))
}

/// The model a request names, else the served base model: `model` is optional but on
/// Anthropic's API (as vLLM and llama.cpp take it).
pub fn model_id<'a>(st: &'a AppState, v: &'a Value) -> Result<&'a str, ApiError> {
    Ok(Fields::of(v)?.string("model")?.unwrap_or(&st.base_id))
}

/// The model a utility request names, else the base model.
fn model_or_base(st: &AppState, v: &Value) -> Result<Arc<ServedModel>, ApiError> {
    st.target(model_id(st, v)?).map(|(model, _)| model)
}

/// One matcher per answer (each answer walks the grammar on its own); a schema, grammar or
/// regular expression the grammar engine cannot compile is named by `param`, the field it came from.
fn matchers(model: &ServedModel, format: &OutputFormat, param: &str, n: usize) -> Result<Vec<llguidance::Matcher>, ApiError> {
    let grammars = model
        .grammars
        .as_ref()
        .map_err(|why| ApiError::invalid(param, format!("Structured output is not available for this model: {why}.")))?;
    let what = match format {
        OutputFormat::JsonObject | OutputFormat::JsonSchema(_) => "schema",
        OutputFormat::Lark(_) => "grammar",
        OutputFormat::Regex(_) => "regular expression",
    };
    (0..n)
        .map(|_| grammars.matcher(format))
        .collect::<anyhow::Result<Vec<_>>>()
        .map_err(|e| ApiError::invalid(param, format!("The {what} cannot be used: {e:#}")))
}

/// The checks that need the prompt's length and the server's capacity, then the request.
/// What a request's `model` names: the model that runs it, and the adapter over it.
#[derive(Clone)]
struct Target {
    id: String,
    model: Arc<ServedModel>,
    adapter: Option<Arc<ServingAdapter>>,
    /// `prompt_cache_key` (a string by `no_op::check`): the client's name for a conversation.
    cache_key: Option<String>,
}

impl Target {
    /// The model the request names, else the served base model (`model_id`).
    fn of(st: &AppState, v: &Value) -> Result<Self, ApiError> {
        Self::with_id(st, v, model_id(st, v)?)
    }

    /// The model the request must name (Anthropic's API requires it).
    fn named(st: &AppState, v: &Value) -> Result<Self, ApiError> {
        Self::with_id(st, v, model_field(v)?)
    }

    fn with_id(st: &AppState, v: &Value, id: &str) -> Result<Self, ApiError> {
        let (model, adapter) = st.target(id)?;
        model.check_generates()?;
        let cache_key = v.get("prompt_cache_key").and_then(Value::as_str).map(str::to_string);
        Ok(Self { id: id.to_string(), model, adapter, cache_key })
    }
}

fn finish(
    st: &AppState,
    target: Target,
    kind: RequestKind,
    prompt_ids: Vec<u32>,
    s: sampling::Sampling,
    constraints: Vec<llguidance::Matcher>,
    ignored: Vec<String>,
) -> Result<ValidatedRequest, ApiError> {
    let Target { id: model_id, model, adapter, cache_key } = target;
    let prompt_tokens = prompt_ids.len();
    let param = kind.prompt_param();
    if prompt_tokens == 0 {
        return Err(ApiError::invalid(param, "The prompt is empty."));
    }
    if prompt_tokens > model.max_input_tokens {
        let message =
            format!("The prompt has {prompt_tokens} tokens; this server accepts at most {} input tokens.", model.max_input_tokens);
        return Err(ApiError::invalid(param, message).with_code("context_length_exceeded"));
    }
    let default_max = match kind {
        RequestKind::Completion { .. } => DEFAULT_COMPLETION_MAX_TOKENS,
        RequestKind::Chat { .. }
        | RequestKind::Responses { .. }
        | RequestKind::Messages { .. }
        | RequestKind::LlamaCpp(_)
        | RequestKind::Ollama { .. } => model.max_total_tokens.saturating_sub(prompt_tokens),
    };
    let max_tokens = s.max_tokens.unwrap_or(default_max);
    if prompt_tokens + max_tokens > model.max_total_tokens || max_tokens == 0 {
        let message = format!(
            "This model's maximum context length is {} tokens. However, you requested {} tokens ({prompt_tokens} in the prompt, {max_tokens} for the completion).",
            model.max_total_tokens,
            prompt_tokens + max_tokens
        );
        let param = if s.max_tokens.is_some() { "max_tokens" } else { param };
        return Err(ApiError::invalid(param, message).with_code("context_length_exceeded"));
    }
    // Each answer generated takes a generation slot or a queue place, as separate requests would.
    let capacity = st.max_concurrent + st.max_queue;
    if s.best_of > capacity {
        let param = if s.best_of > s.n { "best_of" } else { "n" };
        let message = format!(
            "`{param}` = {} is more sequences than this server admits at once ({capacity}: --max-concurrent-requests + --max-queue).",
            s.best_of
        );
        return Err(ApiError::invalid(param, message));
    }
    if s.params.output.min_tokens > max_tokens {
        let message = format!("`min_tokens` ({}) is more than the answer may have ({max_tokens}).", s.params.output.min_tokens);
        return Err(ApiError::invalid("min_tokens", message));
    }
    let mut params = s.params;
    params.max_new_tokens = max_tokens;
    Ok(ValidatedRequest {
        model,
        adapter,
        model_id,
        kind,
        prompt_ids,
        params,
        n: s.n,
        best_of: s.best_of,
        stream: s.stream,
        include_usage: s.include_usage,
        constraints,
        ignored,
        cache_key,
        thinking: None,
    })
}
