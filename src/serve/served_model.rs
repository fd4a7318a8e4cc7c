//! One model being served: its engine thread, tokenizer, limits and sampling defaults, loaded
//! from a model directory (or Hub id); and how a conversation becomes its prompt.

use std::sync::Arc;

use anyhow::Result;
use candle_core::{DType, Device};
use serde_json::{json, Value};

use super::engine::{self, EngineHandle, EngineSettings};
use super::error::ApiError;
use super::metrics::Metrics;
use super::tool_format::{ToolFormat, ToolParser};
use super::tools::Tools;
use crate::embed::Pooling;
use crate::generate::constraint::Grammars;
use crate::generate::infill_sampler::InfillVocab;
use crate::generate::reasoning::{PromptThinking, ReasoningChoice, THINK_END};
use crate::generate::ModelDefaults;
use crate::tokenize::fim::{self, FimTokens};
use crate::tokenize::{tool_prompt, ChatMessage, TextTokenizer};

/// The `chat_template_kwargs` of a request: more variables for the chat template.
pub type TemplateKwargs = serde_json::Map<String, serde_json::Value>;

/// Where served models compute; the base model and fine-tuned ones alike.
#[derive(Debug, Clone)]
pub struct Placement {
    pub device: Device,
    pub dtype: DType,
    /// The GGUF block format matrices are quantised to as they load (`--quantize`).
    pub quantize: Option<crate::model_files::quantize::QuantizeSpec>,
}

/// What every served model is loaded with: where it computes and the server's limits.
#[derive(Clone)]
pub struct LoadSettings {
    pub placement: Placement,
    /// How each model's engine schedules and how much it caches.
    pub engine: EngineSettings,
    /// Longest prompt, and longest prompt + completion (`--max-input-tokens`,
    /// `--max-total-tokens`); both at most the model's context.
    pub limit_input: Option<usize>,
    pub limit_total: Option<usize>,
    pub metrics: Arc<Metrics>,
    /// `--reasoning-parser`: whether models' thinking is split out of their answers.
    pub reasoning: ReasoningChoice,
    /// `--chat-template`'s text: the template used instead of each model's own.
    pub chat_template: Option<String>,
    /// `--task`: whether models generate, or only embed.
    pub task: Task,
    /// `--pooling`: how texts' hidden states become embeddings (default: the model's own).
    pub pooling: Option<Pooling>,
    /// `--tool-call-parser`: how models write their calls.
    pub tool_parser: ToolParser,
}

/// What a served model is for (`serve --task`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// Embed only for an embedding model (a bare `...Model` checkpoint, or one with
    /// sentence-transformers' `modules.json`); else generate, and embed too.
    Auto,
    /// Generate text (and embed, last-token pooled, on `/v1/embeddings`).
    Generate,
    /// Embed only: the generation endpoints refuse the model.
    Embed,
}

impl Task {
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "auto" => Ok(Self::Auto),
            "generate" => Ok(Self::Generate),
            "embed" => Ok(Self::Embed),
            other => Err(format!("unknown task {other:?}: auto, generate or embed")),
        }
    }
}

pub struct ServedModel {
    pub id: String,
    pub engine: EngineHandle,
    pub tokenizer: Arc<TextTokenizer>,
    pub created: u64,
    pub context: usize,
    pub vocab: usize,
    pub max_input_tokens: usize,
    pub max_total_tokens: usize,
    pub defaults: ModelDefaults,
    /// The grammar engine's view of the vocabulary, for `response_format` and forced function
    /// calls; or why this model's tokenizer cannot have one.
    pub grammars: std::result::Result<Arc<Grammars>, String>,
    /// Its config.json (the shapes LoRA adapters served over it must fit).
    pub config: models::ModelConfig,
    /// Its answers' thinking is split out (`reasoning_content`): a reasoning model's template,
    /// or `--reasoning-parser` says so.
    pub splits_reasoning: bool,
    /// The end of a thinking block as the model writes it (`\n</think>\n\n`), tokenised: what a
    /// thinking budget writes for it (empty unless `splits_reasoning`).
    pub thinking_end_ids: Vec<u32>,
    /// It generates text (false: it only embeds, `--task embed`).
    pub generates: bool,
    /// How its embeddings pool the hidden states.
    pub pooling: Pooling,
    /// How it writes function calls when free to (`tool_choice: auto`).
    pub tool_format: ToolFormat,
    /// The embedding sizes `dimensions` may ask for (config.json's `matryoshka_dimensions`; empty
    /// with `is_matryoshka: true`: any size up to the full one), or None: only the full size.
    pub matryoshka: Option<Vec<usize>>,
    /// Its fill-in-the-middle tokens (`suffix`, `/infill`), or which of them it lacks.
    pub fim: std::result::Result<FimTokens, String>,
    /// What llama.cpp's infill sampler reads of its vocabulary, made at the first request that
    /// names the sampler (None: no token table, the grammar engine's, to read it from).
    infill_vocab: std::sync::OnceLock<Option<Arc<InfillVocab>>>,
}

impl ServedModel {
    /// Loads a model directory (or Hub id) as model `id` and starts its engine thread.
    pub fn load(id: &str, source: &str, revision: Option<&str>, settings: &LoadSettings) -> Result<Self> {
        let placement = &settings.placement;
        let files = crate::model_files::resolve_model(source, revision)?;
        let own_pooling = Pooling::of_model(&files)?;
        let matryoshka = crate::embed::matryoshka_sizes(&files.config)?;
        let opts = crate::model_files::LoadOptions { adapter: None, dtype: placement.dtype, quantize: placement.quantize };
        let loaded = crate::model_files::load_model_with(files, &opts, &placement.device)?;
        // The engine thread computes on its own (per-thread) stream: the weights must have landed.
        placement.device.synchronize()?;
        let mut tokenizer = TextTokenizer::load(&loaded.files, loaded.config.vocab_size)?;
        if let Some(text) = &settings.chat_template {
            tokenizer.replace_chat_template(text)?;
        }
        let tokenizer = Arc::new(tokenizer);
        let defaults = ModelDefaults::of(&loaded.files, &loaded.config.eos_token_ids)?;
        let eos = defaults.eos_token_ids.clone();
        let context = loaded.config.max_position_embeddings;
        let vocab = loaded.config.vocab_size;
        // A constrained answer ends with the tokenizer's eos token (a chat model's end of turn).
        let answer_end = tokenizer
            .eos_token
            .as_deref()
            .and_then(|t| tokenizer.inner.token_to_id(t))
            .filter(|id| eos.contains(id))
            .or_else(|| eos.iter().min().copied());
        let grammars = match answer_end {
            None => Err("the model has no eos token to end a constrained answer".to_string()),
            Some(end) => {
                let vocabulary = tokenizer.inner.to_string(false).map_err(|e| anyhow::anyhow!("{e}"))?;
                Grammars::new(&vocabulary, vocab, end).map(Arc::new).map_err(|e| format!("{e:#}"))
            }
        };
        let config = loaded.config.clone();
        let generates = match settings.task {
            Task::Generate => true,
            Task::Embed => false,
            Task::Auto => !config.headless && own_pooling.is_none(),
        };
        let pooling = settings.pooling.or(own_pooling).unwrap_or(Pooling::Last);
        let template = tokenizer.chat_template.as_ref().map(|t| t.source.as_str());
        let splits_reasoning = settings.reasoning.splits(template);
        let thinking_end = format!("\n{THINK_END}\n\n");
        let thinking_end_ids = if splits_reasoning { tokenizer.encode(&thinking_end, false)? } else { vec![] };
        let tool_format = settings.tool_parser.format(template, |t| tokenizer.token_id(t)).map_err(|e| anyhow::anyhow!("{source}: {e}"))?;
        let fim = FimTokens::of(&tokenizer);
        let engine = engine::start(loaded.model, tokenizer.clone(), eos, settings.engine, settings.metrics.clone());
        let max_total_tokens = settings.limit_total.unwrap_or(context).min(context);
        Ok(Self {
            id: id.to_string(),
            engine,
            tokenizer,
            created: super::ids::now_s() as u64,
            context,
            vocab,
            max_input_tokens: settings.limit_input.unwrap_or(max_total_tokens - 1).min(max_total_tokens - 1),
            max_total_tokens,
            defaults,
            grammars,
            config,
            splits_reasoning,
            thinking_end_ids,
            generates,
            pooling,
            tool_format,
            matryoshka,
            fim,
            infill_vocab: std::sync::OnceLock::new(),
        })
    }

    /// OpenAI's `model` object, with vLLM's `max_model_len` (the longest prompt + answer served,
    /// as vLLM's --max-model-len sets it) and what the web page needs to know
    /// of a reasoning model: its thinking is split out (`reasoning`), its template reads
    /// `enable_thinking` (`thinking_switch`).
    pub fn object(&self) -> Value {
        let switch = self.tokenizer.chat_template.as_ref().is_some_and(|t| t.source.contains("enable_thinking"));
        json!({"id": self.id, "object": "model", "created": self.created, "owned_by": "fsdp-app", "max_model_len": self.max_total_tokens,
               "reasoning": self.splits_reasoning, "thinking_switch": switch})
    }

    /// The vocabulary as llama.cpp's infill sampler reads it: each token's text, the tokens that
    /// end an answer (its end-of-sequence ones, its FIM ends and those spelled as ends, as
    /// llama.cpp's end-of-generation set) and the one that ends an answer left without text.
    pub fn infill_vocab(&self) -> Option<Arc<InfillVocab>> {
        self.infill_vocab
            .get_or_init(|| {
                let grammars = self.grammars.as_ref().ok()?;
                let bytes = (0..self.vocab as u32).map(|id| grammars.text_bytes(id)).collect();
                // A FIM model's ends include the tokens spelled as ends; another has only those.
                let more = match &self.fim {
                    Ok(f) => f.ends(),
                    Err(_) => fim::end_of_generation(|t| self.tokenizer.token_id(t)),
                };
                let eos = &self.defaults.eos_token_ids;
                let first_eos = self.tokenizer.eos_token.as_deref().and_then(|t| self.tokenizer.token_id(t)).filter(|id| eos.contains(id));
                let end = first_eos.or_else(|| eos.iter().min().copied())?;
                let ends = eos.iter().copied().chain(more);
                Some(Arc::new(InfillVocab::new(bytes, ends, end)))
            })
            .clone()
    }

    /// The refusal of a generation request for a model that only embeds.
    pub fn check_generates(&self) -> Result<(), ApiError> {
        match self.generates {
            true => Ok(()),
            false => Err(ApiError::invalid(
                "model",
                format!("`{}` is served for embeddings only (an embedding model, or --task embed): use /v1/embeddings.", self.id),
            )),
        }
    }

    /// Where a chat prompt leaves the answer's thinking, for a model whose thinking is split out
    /// (None otherwise): from the rendered prompt's last tokens.
    pub fn prompt_thinking(&self, prompt_ids: &[u32]) -> Option<PromptThinking> {
        let tail = &prompt_ids[prompt_ids.len().saturating_sub(16)..];
        self.splits_reasoning.then(|| PromptThinking::of(&self.tokenizer.decode(tail, false).unwrap_or_default()))
    }

    /// Token ids of a conversation rendered with the model's chat template, ready for the
    /// assistant's answer (as transformers' `apply_chat_template(..., add_generation_prompt=True)`),
    /// with `kwargs` (the request's `chat_template_kwargs`) among the template's variables.
    /// With functions: through the template when it reads `tools`, else in the generic format
    /// (`tokenize::tool_prompt`), which also writes a history's calls and results.
    pub fn chat_prompt_ids(&self, messages: &[ChatMessage], tools: Option<&Tools>, kwargs: &TemplateKwargs) -> Result<Vec<u32>, ApiError> {
        self.chat_prompt_ids_continuing(messages, tools, kwargs, "")
    }

    /// The same, with the answer begun by `prefill` (an Anthropic request whose last turn is the
    /// assistant's: the answer continues it): the text follows the opened assistant turn, and
    /// the whole prompt is tokenised at once, as one text.
    pub fn chat_prompt_ids_continuing(
        &self,
        messages: &[ChatMessage],
        tools: Option<&Tools>,
        kwargs: &TemplateKwargs,
        prefill: &str,
    ) -> Result<Vec<u32>, ApiError> {
        let template = self
            .tokenizer
            .chat_template
            .as_ref()
            .ok_or_else(|| ApiError::bad_request("This model has no chat template; use /v1/completions."))?;
        let rendered = tool_prompt::render(template, messages, tools.map(|t| &t.definitions), true, kwargs);
        let text = rendered.map_err(|e| ApiError::invalid("messages", format!("The chat template failed: {e:#}")))? + prefill;
        self.tokenizer.encode(&text, false).map_err(|e| ApiError::bad_request(format!("{e:#}")))
    }
}
