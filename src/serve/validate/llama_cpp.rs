//! llama.cpp's own server API (`POST /completion`), read into the values the OpenAI endpoints
//! run, with llama.cpp's names and defaults: `n_predict` (-1: to the end of the context),
//! temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, its sampler chain (`samplers`: the cuts on
//! the model's distribution, the temperature last), penalties over the last `repeat_last_n`
//! tokens, `logit_bias` as `[[token or text, bias or false]]` or an object, `n_probs`, `grammar`
//! (GBNF) and `json_schema`. Its samplers this server does not have (typical-p, dynamic
//! temperature, Mirostat, DRY, XTC, top-n-sigma) are accepted only switched off, as llama.cpp's
//! defaults leave them; their tuning fields then change nothing and are accepted as such.

use serde_json::{json, Map, Value};

use super::{finish, matchers, requested_format, sampling, RequestKind, Target, ValidatedRequest};
use crate::generate::chain::ChainStep;
use crate::generate::ModelDefaults;
use crate::serve::error::ApiError;
use crate::serve::fields::{self, Fields};
use crate::serve::served_model::ServedModel;
use crate::serve::state::AppState;

/// llama.cpp's defaults for what a request leaves out (its `common_params_sampling`).
pub const DEFAULT_TEMPERATURE: f64 = 0.8;
pub const DEFAULT_TOP_K: i64 = 40;
pub const DEFAULT_TOP_P: f64 = 0.95;
pub const DEFAULT_MIN_P: f64 = 0.05;
pub const DEFAULT_REPEAT_LAST_N: i64 = 64;
/// The most stop words one request may give.
const MAX_STOP_WORDS: usize = 64;
/// llama.cpp's default chain, less the samplers that are off by default (and absent here).
const DEFAULT_SAMPLERS: &[&str] = &["penalties", "top_k", "top_p", "min_p", "temperature"];
/// Samplers a chain may name besides the default ones.
const OTHER_SAMPLERS: &[&str] = &["infill"];

/// The default chain's names (`/props`).
pub fn default_samplers() -> &'static [&'static str] {
    DEFAULT_SAMPLERS
}

/// The fields `/completion` reads.
pub const FIELDS: &[&str] = &[
    "model",
    "prompt",
    "n_predict",
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "seed",
    "stream",
    "n_probs",
    "grammar",
    "json_schema",
    "ignore_eos",
    "logit_bias",
    "samplers",
    "return_tokens",
    "id_slot",
    "cache_prompt",
    "n_keep",
    "n_discard",
    "n_cmpl",
    "min_keep",
    "post_sampling_probs",
    "timings_per_token",
    "return_progress",
    "response_fields",
    "lora",
    // Samplers this server lacks: taken only off ([`OFF_AT`]), when their tuning fields (the
    // `dry_*`, `mirostat_*`, `xtc_threshold`, `dynatemp_exponent`) change nothing.
    "typical_p",
    "dynatemp_range",
    "dynatemp_exponent",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "xtc_probability",
    "xtc_threshold",
    "top_n_sigma",
    // Code completion's limits (llama.vim, llama.vscode): the answer's least indentation after
    // its first line, and its generating time once it has a new line; the prompt's time limit
    // changes nothing (llama.cpp reads it and does not use it either).
    "n_indent",
    "t_max_predict_ms",
    "t_max_prompt_ms",
];

/// Whether a switch's value leaves its sampler off.
type IsOff = fn(f64) -> bool;

/// llama.cpp's samplers this server does not have, by the field that switches each on and the
/// values that leave it off.
const OFF_AT: &[(&str, &str, IsOff)] = &[
    ("typical_p", "1", |x| x >= 1.0),
    ("dynatemp_range", "0", |x| x <= 0.0),
    ("mirostat", "0", |x| x == 0.0),
    ("dry_multiplier", "0", |x| x <= 0.0),
    ("xtc_probability", "0", |x| x <= 0.0),
    ("top_n_sigma", "-1", |x| x <= 0.0),
    ("min_keep", "0 or 1", |x| x <= 1.0),
    ("n_cmpl", "1", |x| x == 1.0),
];

/// Samplers a chain may name that are off here (their switch in [`OFF_AT`] is off).
const OFF_SAMPLERS: &[&str] = &["dry", "typ_p", "typical_p", "xtc", "top_n_sigma", "mirostat"];

/// What a `/completion` answer repeats beside the text.
#[derive(Debug, Clone)]
pub struct Echo {
    /// The prompt's place in the request's list of prompts (0 for one prompt).
    pub index: usize,
    /// The prompt as the model read it (special tokens written out).
    pub prompt: String,
    /// Top alternatives per token (`completion_probabilities`), 0 for none.
    pub n_probs: usize,
    /// Each token's id in `tokens`.
    pub return_tokens: bool,
    /// The settings that ran (`generation_settings`).
    pub settings: Value,
    /// `response_fields`: the answer holds only these (paths such as `timings/predicted_n`, each
    /// under its path as a key), when given.
    pub response_fields: Option<Vec<String>>,
}

/// `/completion`: one request per prompt (llama.cpp's list of prompts runs each as its own task).
pub fn completions(st: &AppState, v: &Value) -> Result<Vec<ValidatedRequest>, ApiError> {
    requests(st, v, false)
}

/// `/infill`: `/completion`'s request whose prompt fills in the middle (`infill::llama_cpp`).
pub fn infill(st: &AppState, v: &Value) -> Result<ValidatedRequest, ApiError> {
    Ok(requests(st, v, true)?.pop().expect("one prompt"))
}

/// `/completion`'s requests, or with `infill` `/infill`'s one.
fn requests(st: &AppState, v: &Value, infill: bool) -> Result<Vec<ValidatedRequest>, ApiError> {
    let accepted: &[&[&str]] = if infill { &[FIELDS, super::infill::INFILL_FIELDS] } else { &[FIELDS] };
    let mut ignored = fields::check_lists(v, accepted, "", st.lenient)?;
    let f = Fields::of(v)?;
    switched_off(&f)?;
    if f.value("lora").is_some_and(|l| l.as_array().is_none_or(|a| !a.is_empty())) {
        let message = "Per-request `lora` scales are not supported: name the adapter in `model` (as in `/v1/models`).";
        return Err(ApiError::invalid("lora", message));
    }
    // A slot is where llama.cpp keeps a prompt to reuse; here the prefix cache reuses any
    // request's prompt in any slot, so naming one of `/props`' `total_slots` changes nothing.
    let slots = st.max_concurrent as i64;
    if let Some(slot) = f.integer("id_slot", i64::MIN, i64::MAX)?.filter(|&s| s != -1 && !(0..slots).contains(&s)) {
        let message = format!("`id_slot` {slot}: this server's slots are 0 to {} (-1: any).", slots - 1);
        return Err(ApiError::invalid("id_slot", message));
    }
    for (k, why) in [
        ("post_sampling_probs", "probabilities are the model's, before the sampler's cuts"),
        ("timings_per_token", "timings come with the last event"),
        ("return_progress", "no progress events are sent"),
    ] {
        if f.bool(k)? == Some(true) {
            return Err(ApiError::invalid(k, format!("`{k}: true` is not supported ({why}).")));
        }
    }
    // Taken without effect, but type-checked: the prefix cache is always on, and the context is
    // never shifted (a prompt too long is refused), so nothing is kept or discarded.
    let _ = (f.bool("cache_prompt")?, f.integer("n_keep", -1, i64::MAX)?, f.integer("n_discard", 0, i64::MAX)?);
    let _ = f.integer("t_max_prompt_ms", i64::MIN, i64::MAX)?;
    let body = as_completion(&f)?;
    let target = Target::of(st, &body)?;
    let model = target.model.clone();
    let defaults =
        ModelDefaults { temperature: DEFAULT_TEMPERATURE, top_k: None, top_p: None, repetition_penalty: 1.0, ..model.defaults.clone() };
    let mut s = sampling::parse(&body, &defaults, false).map_err(renamed)?;
    s.params.chain = Some(chain(&f, &model)?);
    // The infill sampler may leave only tokens that end an answer: each of them does.
    for step in s.params.chain.iter().flatten() {
        if let ChainStep::Infill(vocab) = step {
            s.params.output.stop_token_ids.extend(vocab.ends());
        }
    }
    s.params.output.min_indent = f.integer("n_indent", i64::MIN, u32::MAX as i64)?.unwrap_or(0).max(0) as usize;
    let max_predict_ms = f.integer("t_max_predict_ms", i64::MIN, u32::MAX as i64)?.filter(|&t| t > 0);
    s.params.output.max_predict_time = max_predict_ms.map(|t| std::time::Duration::from_millis(t as u64));

    let repeat_last_n = f.integer("repeat_last_n", -1, i64::MAX)?.unwrap_or(DEFAULT_REPEAT_LAST_N);
    s.params.penalty_last_n = Some(if repeat_last_n < 0 { usize::MAX } else { repeat_last_n as usize });
    if !chain_names(&f)?.contains(&"penalties") {
        (s.params.repetition_penalty, s.params.presence_penalty, s.params.frequency_penalty) = (1.0, 0.0, 0.0);
    }
    s.params.logit_bias = logit_bias(&model, f.value("logit_bias"))?;
    s.params.stop = stop_words(f.value("stop"))?;
    let return_tokens = f.bool("return_tokens")?.unwrap_or(false);
    let n_probs = s.params.logprobs.unwrap_or(0);
    let requested = requested_format(st, &body, &mut ignored)?;
    let prompts = match infill {
        false => prompts(&model, f.value("prompt"))?,
        true => {
            let fim = super::infill::llama_cpp(&model, &f)?;
            s.params.output.stop_token_ids.extend(fim.ends);
            vec![fim.ids]
        }
    };
    let settings = settings(&model, &f, &s.params, s.max_tokens, s.stream)?;
    let response_fields = response_fields(f.value("response_fields"))?;
    super::batch(st, prompts, |index, prompt_ids| {
        let constraints = match &requested {
            Some(r) => matchers(&model, &r.format, &r.param, 1)?,
            None => vec![],
        };
        let prompt = model.tokenizer.decode(&prompt_ids, false).unwrap_or_default();
        let echo = Echo { index, prompt, n_probs, return_tokens, settings: settings.clone(), response_fields: response_fields.clone() };
        let kind = RequestKind::LlamaCpp(Box::new(echo));
        finish(st, target.clone(), kind, prompt_ids, s.clone(), constraints, ignored.clone()).map_err(renamed)
    })
}

/// The OpenAI completion body with the same meaning, for the checks every completion goes
/// through.
fn as_completion(f: &Fields) -> Result<Value, ApiError> {
    let mut body = Map::new();
    if let Some(model) = f.string("model")? {
        body.insert("model".into(), json!(model));
    }
    let n_predict = match (f.integer("n_predict", -1, 1 << 31)?, f.integer("max_tokens", -1, 1 << 31)?) {
        (Some(n), _) | (None, Some(n)) => n,
        (None, None) => -1,
    };
    if n_predict == 0 {
        return Err(ApiError::invalid("n_predict", "`n_predict` 0 (filling the cache without an answer) is not supported: ask for at least 1 token, or -1 for the rest of the context."));
    }
    if n_predict > 0 {
        body.insert("max_tokens".into(), json!(n_predict));
    }
    // llama.cpp samples greedily at a temperature of 0 or below.
    if let Some(t) = f.number("temperature", f64::MIN, f64::MAX)? {
        body.insert("temperature".into(), json!(t.max(0.0)));
    }
    for (ours, theirs) in [
        ("repetition_penalty", "repeat_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
        ("stream", "stream"),
        ("logprobs", "n_probs"),
        ("ignore_eos", "ignore_eos"),
        ("json_schema", "json_schema"),
    ] {
        if let Some(x) = f.value(theirs) {
            body.insert(ours.into(), x.clone());
        }
    }
    // llama.cpp's "no grammar" is an empty one; -1 (or any negative seed) is a random seed.
    if let Some(g) = f.value("grammar").filter(|g| g.as_str() != Some("")) {
        body.insert("grammar".into(), g.clone());
    }
    // Seeds are 32-bit there: a random one is too, so that the one reported can be sent again.
    let seed = f.integer("seed", i64::MIN, u32::MAX as i64)?.filter(|s| *s >= 0);
    body.insert("seed".into(), json!(seed.unwrap_or(crate::serve::ids::fresh_seed() as u32 as i64)));
    if body.get("logprobs").is_some_and(|n| n.as_i64() == Some(0)) {
        body.remove("logprobs");
    }
    Ok(Value::Object(body))
}

/// The names the OpenAI checks give parameters, in llama.cpp's spelling.
fn renamed(e: ApiError) -> ApiError {
    let param = e.param.as_deref().map(|p| match p {
        "max_tokens" => "n_predict".to_string(),
        "repetition_penalty" => "repeat_penalty".to_string(),
        "logprobs" => "n_probs".to_string(),
        p => p.to_string(),
    });
    let message = e
        .message
        .replace("`max_tokens`", "`n_predict`")
        .replace("`repetition_penalty`", "`repeat_penalty`")
        .replace("`logprobs`", "`n_probs`");
    ApiError { param, message, ..e }
}

/// A 400 for a sampler this server does not have, switched on.
fn switched_off(f: &Fields) -> Result<(), ApiError> {
    for (k, off, is_off) in OFF_AT {
        if let Some(x) = f.number(k, f64::MIN, f64::MAX)?.filter(|x| !is_off(*x)) {
            let message =
                format!("`{k}` {x} is not supported by this server (fsdp-app); send {off} (off, llama.cpp's default) or leave it out.");
            return Err(ApiError::invalid(k, message).with_code("unsupported_parameter"));
        }
    }
    Ok(())
}

/// `stop`: a list of strings (more than OpenAI's 4: front ends send a stop per speaker).
fn stop_words(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let Some(v) = v else { return Ok(vec![]) };
    let words = v
        .as_array()
        .filter(|a| a.len() <= MAX_STOP_WORDS)
        .and_then(|a| a.iter().map(|x| x.as_str().filter(|s| !s.is_empty()).map(str::to_string)).collect::<Option<Vec<_>>>());
    words.ok_or_else(|| ApiError::invalid("stop", format!("`stop` must be a list of up to {MAX_STOP_WORDS} non-empty strings.")))
}

/// `response_fields`: a list of field paths (`a/b` for `b` inside `a`).
fn response_fields(v: Option<&Value>) -> Result<Option<Vec<String>>, ApiError> {
    let Some(v) = v else { return Ok(None) };
    let fields = v.as_array().and_then(|a| a.iter().map(|x| x.as_str().map(str::to_string)).collect::<Option<Vec<_>>>());
    fields.map(Some).ok_or_else(|| {
        ApiError::invalid("response_fields", "`response_fields` must be a list of field paths such as \"timings/predicted_n\".")
    })
}

/// The chain's sampler names: the request's `samplers`, else llama.cpp's default order.
fn chain_names<'a>(f: &Fields<'a>) -> Result<Vec<&'a str>, ApiError> {
    const P: &str = "samplers";
    let Some(list) = f.value(P) else { return Ok(DEFAULT_SAMPLERS.to_vec()) };
    let Some(items) = list.as_array() else {
        return Err(ApiError::invalid(
            P,
            "`samplers` must be a list of sampler names such as [\"top_k\", \"top_p\", \"min_p\", \"temperature\"].",
        ));
    };
    let names: Vec<&str> = items
        .iter()
        .map(|x| x.as_str().ok_or_else(|| ApiError::invalid(P, format!("`samplers` entries must be strings, got {x}."))))
        .collect::<Result<_, _>>()?;
    for (i, name) in names.iter().enumerate() {
        let known = DEFAULT_SAMPLERS.contains(name) || OTHER_SAMPLERS.contains(name) || OFF_SAMPLERS.contains(name);
        if !known {
            return Err(ApiError::invalid(
                P,
                format!(
                    "`samplers[{i}]` {name:?} is not a sampler here; known: {}.",
                    [DEFAULT_SAMPLERS, OTHER_SAMPLERS, OFF_SAMPLERS].concat().join(", ")
                ),
            ));
        }
        if *name == "penalties" && names[..i].iter().any(|n| !OFF_SAMPLERS.contains(n)) {
            return Err(ApiError::invalid(P, "`penalties` must come before the other samplers here (it adjusts the logits they read)."));
        }
    }
    Ok(names)
}

/// The chain of cuts the request's samplers make, in its order.
fn chain(f: &Fields, model: &ServedModel) -> Result<Vec<ChainStep>, ApiError> {
    let top_k = f.integer("top_k", i64::MIN, i64::MAX)?.unwrap_or(DEFAULT_TOP_K);
    let top_p = f.number("top_p", 0.0, 1.0)?.unwrap_or(DEFAULT_TOP_P);
    let min_p = f.number("min_p", 0.0, 1.0)?.unwrap_or(DEFAULT_MIN_P);
    let infill = || {
        let why = format!("`infill` reads the token table of `{}`, which it has none of.", model.id);
        model.infill_vocab().map(ChainStep::Infill).ok_or_else(|| ApiError::invalid("samplers", why))
    };
    chain_names(f)?
        .into_iter()
        .filter_map(|name| match name {
            "top_k" => Some(Ok(ChainStep::TopK(top_k.max(0) as usize))),
            "top_p" => Some(Ok(ChainStep::TopP(top_p))),
            "min_p" => Some(Ok(ChainStep::MinP(min_p))),
            "temperature" => Some(Ok(ChainStep::Temperature)),
            "infill" => Some(infill()),
            _ => None,
        })
        .collect()
}

/// llama.cpp's `logit_bias`: `[[token id or text, bias or false], ...]` (a text biases each of
/// its tokens; false bans), or an object from ids (or texts) to biases.
fn logit_bias(model: &ServedModel, v: Option<&Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    const P: &str = "logit_bias";
    let pairs: Vec<(Value, &Value)> = match v {
        None => return Ok(vec![]),
        Some(Value::Array(a)) => a
            .iter()
            .map(|pair| match pair.as_array().map(Vec::as_slice) {
                Some([k, b]) => Ok((k.clone(), b)),
                _ => Err(ApiError::invalid(P, format!("`logit_bias` entries must be [token, bias] pairs, got {pair}."))),
            })
            .collect::<Result<_, _>>()?,
        Some(Value::Object(o)) => o.iter().map(|(k, b)| (json!(k), b)).collect(),
        Some(_) => return Err(ApiError::invalid(P, "`logit_bias` must be a list of [token, bias] pairs or an object.")),
    };
    let mut out = vec![];
    for (k, b) in pairs {
        let bias = match b {
            Value::Bool(false) => f32::NEG_INFINITY,
            b => b
                .as_f64()
                .filter(|x| x.is_finite())
                .ok_or_else(|| ApiError::invalid(P, format!("a `logit_bias` bias must be a number or false, got {b}.")))?
                as f32,
        };
        let ids = match &k {
            Value::Number(n) => vec![n
                .as_u64()
                .filter(|&i| (i as usize) < model.vocab)
                .ok_or_else(|| ApiError::invalid(P, format!("`logit_bias` token {n} is not in [0, {}).", model.vocab)))?
                as u32],
            Value::String(s) => match s.parse::<u32>() {
                Ok(id) if (id as usize) < model.vocab => vec![id],
                _ => model.tokenizer.encode(s, false).map_err(|e| ApiError::invalid(P, format!("{e:#}")))?,
            },
            k => return Err(ApiError::invalid(P, format!("a `logit_bias` token must be an id or a text, got {k}."))),
        };
        out.extend(ids.into_iter().map(|id| (id, bias)));
    }
    Ok(out)
}

/// `prompt` as llama.cpp's server splits it (`tokenize_input_prompts`): a string, token ids, or
/// ids and strings mixed are one prompt; a list of those (strings, lists) is one prompt each.
/// Each as its ids: a text with the tokenizer's special tokens (as llama.cpp adds BOS), ids
/// and texts mixed as `mixed_ids` reads them.
fn prompts(model: &ServedModel, v: Option<&Value>) -> Result<Vec<Vec<u32>>, ApiError> {
    const P: &str = "prompt";
    let text = |s: &str, param: &str| model.tokenizer.encode(s, true).map_err(|e| ApiError::invalid(param, format!("{e:#}")));
    let flat = |items: &[Value]| items.iter().all(|x| x.is_number() || x.is_string());
    match v {
        Some(Value::String(s)) => Ok(vec![text(s, P)?]),
        Some(Value::Array(items)) if items.iter().any(Value::is_number) => match flat(items) {
            true => Ok(vec![mixed_ids(model, items, P)?]),
            false => Err(ApiError::invalid(P, "A `prompt` list with token ids is one prompt: only ids and strings.")),
        },
        Some(Value::Array(items)) if items.is_empty() => Err(ApiError::invalid(P, "`prompt` must not be an empty list.")),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let param = format!("{P}[{i}]");
                match item {
                    Value::String(s) => text(s, &param),
                    Value::Array(a) if !a.is_empty() && flat(a) => mixed_ids(model, a, &param),
                    _ => Err(ApiError::invalid(&param, format!("`{param}` must be a string, token ids, or ids and strings mixed."))),
                }
            })
            .collect(),
        None => Err(ApiError::invalid(P, "`prompt` is required.")),
        Some(_) => Err(ApiError::invalid(P, "`prompt` must be a string, token ids (strings mixed in), or a list of those.")),
    }
}

/// One text given as llama.cpp's mixed list of token ids and strings (`param` names it): the
/// strings tokenized in place, special tokens added only to a string that opens the list.
pub fn mixed_ids(model: &ServedModel, items: &[Value], param: &str) -> Result<Vec<u32>, ApiError> {
    let mut ids = vec![];
    for (i, x) in items.iter().enumerate() {
        match x {
            Value::String(s) => ids.extend(model.tokenizer.encode(s, i == 0).map_err(|e| ApiError::invalid(param, format!("{e:#}")))?),
            n => ids.push(
                n.as_u64()
                    .filter(|&t| (t as usize) < model.vocab)
                    .ok_or_else(|| ApiError::invalid(param, format!("`{param}[{i}]` {n} is not a token id in [0, {}).", model.vocab)))?
                    as u32,
            ),
        }
    }
    Ok(ids)
}

/// `generation_settings`: what ran, in llama.cpp's names.
fn settings(
    model: &ServedModel,
    f: &Fields,
    p: &crate::generate::SamplingParams,
    max_tokens: Option<usize>,
    stream: bool,
) -> Result<Value, ApiError> {
    let step = |name: &str| p.chain.iter().flatten().find(|s| s.name() == name).cloned();
    let samplers: Vec<&str> = chain_names(f)?;
    Ok(json!({
        "n_ctx": model.max_total_tokens,
        "n_predict": max_tokens.map_or(-1, |m| m as i64),
        "model": model.id,
        "seed": p.seed,
        "temperature": p.temperature,
        "top_k": match step("top_k") { Some(ChainStep::TopK(k)) => k as i64, _ => 0 },
        "top_p": match step("top_p") { Some(ChainStep::TopP(x)) => x, _ => 1.0 },
        "min_p": match step("min_p") { Some(ChainStep::MinP(x)) => x, _ => 0.0 },
        "repeat_last_n": p.penalty_last_n.map_or(-1, |n| if n == usize::MAX { -1 } else { n as i64 }),
        "repeat_penalty": p.repetition_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "stop": p.stop,
        "ignore_eos": p.output.ignore_eos,
        "stream": stream,
        "n_probs": p.logprobs.unwrap_or(0),
        "grammar": f.value("grammar").cloned().unwrap_or(json!("")),
        "samplers": samplers,
    }))
}
