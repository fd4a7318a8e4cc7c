//! `fsdp-app serve`: an OpenAI-compatible HTTP API over one model. One engine thread owns the
//! model (`engine`); the axum routes (`routes`) validate requests (`request`), admit them into a
//! bounded queue and stream the engine's tokens back; errors have OpenAI's shape (`error`).

pub mod checkpoints;
pub mod engine;
pub mod error;
pub mod fields;
pub mod files;
pub mod ids;
pub mod listen;
pub mod jobs;
pub mod metrics;
pub mod openapi;
pub mod request;
pub mod routes;
pub mod shutdown;
pub mod store;
pub mod tools;
pub mod web;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, RwLock};

use anyhow::{Context, Result};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use candle_core::{DType, Device};
use serde_json::{json, Value};

use self::engine::EngineHandle;
use self::error::ApiError;
use self::metrics::Metrics;
use crate::generate::ModelDefaults;
use crate::tokenize::{ChatMessage, TextTokenizer};

#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub model: String,
    pub revision: Option<String>,
    /// The id clients use (`model` in requests); default: the --model string.
    pub served_model_name: Option<String>,
    pub host: String,
    pub port: u16,
    pub api_key: Option<String>,
    pub max_concurrent_requests: usize,
    pub max_queue: usize,
    pub max_input_tokens: Option<usize>,
    pub max_total_tokens: Option<usize>,
    pub max_body_bytes: usize,
    /// Ignore request fields this server does not implement (listed in a response header)
    /// instead of answering 400 (see `fields`).
    pub lenient: bool,
    /// How long running generations may go on after SIGTERM / SIGINT (see `shutdown`).
    pub shutdown_grace: std::time::Duration,
    /// How long a client may stall in a request's head (or idle between requests) or body.
    pub limits: listen::ClientLimits,
    /// Where files, jobs (SQLite) and fine-tuned models live.
    pub data_dir: PathBuf,
    /// Where and in which dtype the models compute.
    pub device: crate::device::DeviceSpec,
    pub dtype: DType,
}

/// Where served models compute; the base model and fine-tuned ones alike.
#[derive(Debug, Clone)]
pub struct Placement {
    pub device: Device,
    pub dtype: DType,
}

/// How far past --max-body-bytes a body is still read, to answer 413 cleanly.
const READ_PAST_LIMIT: usize = 32 << 20;

/// One model being served: its engine thread, tokenizer and limits.
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
    /// The grammar engine's view of the vocabulary, for `response_format`; or why this
    /// model's tokenizer cannot have one.
    pub grammars: std::result::Result<Arc<crate::generate::constraint::Grammars>, String>,
}

/// What every route reads.
pub struct AppState {
    /// Loaded models by id: the base model, and fine-tuned ones once first asked for.
    pub models: RwLock<HashMap<String, Arc<ServedModel>>>,
    /// One lock per model ever loaded here (kept: a few bytes each), so that a model is loaded
    /// (or a checkpoint merged) once however many ask for it, while requests for the others go on.
    pub loading: std::sync::Mutex<HashMap<String, Arc<std::sync::Mutex<()>>>>,
    pub base_id: String,
    /// The --model the server was started with (what jobs fine-tune).
    pub base_source: String,
    pub store: Arc<store::Store>,
    pub jobs_wakeup: jobs::Wakeup,
    /// Requests admitted and not finished (queued + running), over all models.
    pub in_flight: Arc<AtomicUsize>,
    pub max_concurrent: usize,
    pub max_queue: usize,
    pub max_body_bytes: usize,
    pub lenient: bool,
    pub limit_input: Option<usize>,
    pub limit_total: Option<usize>,
    pub api_key: Option<String>,
    pub metrics: Arc<Metrics>,
    pub placement: Placement,
    pub shutdown: Arc<shutdown::Shutdown>,
}

impl AppState {
    /// The model `id`: loaded already, or a fine-tuned model from a succeeded job or a job's
    /// checkpoint, loaded now.
    pub fn model(&self, id: &str) -> Result<Arc<ServedModel>, ApiError> {
        if let Some(m) = self.models.read().unwrap().get(id) {
            return Ok(m.clone());
        }
        let internal = |e: anyhow::Error| ApiError::internal(format!("{e:#}"));
        let fine_tuned = self.store.fine_tuned_models().map_err(internal)?.into_iter().find(|(m, _)| m == id).map(|(_, d)| d);
        // An unknown name is answered at once, without waiting for any loading.
        if fine_tuned.is_none() && self.store.checkpoint_of_model(id).map_err(internal)?.is_none() {
            return Err(ApiError::model_not_found(id));
        }
        // The loading takes seconds: off the async workers, under this model's own lock.
        let slot = self.loading.lock().unwrap().entry(id.to_string()).or_default().clone();
        tokio::task::block_in_place(|| -> Result<Arc<ServedModel>, ApiError> {
            let _only_loader = slot.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(m) = self.models.read().unwrap().get(id) {
                return Ok(m.clone()); // loaded while this request waited
            }
            let dir = match fine_tuned {
                Some(d) => d,
                None => checkpoints::servable_dir(&self.store, id).map_err(internal)?.ok_or_else(|| ApiError::model_not_found(id))?,
            };
            let served = load_served(id, &dir.to_string_lossy(), None, self).map_err(|e| ApiError::internal(format!("loading {id}: {e:#}")))?;
            let served = Arc::new(served);
            self.models.write().unwrap().insert(id.to_string(), served.clone());
            Ok(served)
        })
    }

    pub fn base(&self) -> Arc<ServedModel> {
        self.models.read().unwrap()[&self.base_id].clone()
    }

    /// Every servable model: the loaded ones and every succeeded job's.
    pub fn model_objects(&self) -> Vec<Value> {
        let base = self.base();
        let mut out: Vec<Value> = vec![base.object()];
        for (id, _) in self.store.fine_tuned_models().unwrap_or_default() {
            out.push(json!({"id": id, "object": "model", "created": base.created, "owned_by": "fsdp-app", "parent": self.base_id}));
        }
        out
    }

    pub fn running(&self) -> usize {
        self.models.read().unwrap().values().map(|m| m.engine.running.load(std::sync::atomic::Ordering::SeqCst)).sum()
    }

    pub fn queued(&self) -> usize {
        self.in_flight.load(std::sync::atomic::Ordering::SeqCst).saturating_sub(self.running())
    }
}

impl ServedModel {
    pub fn object(&self) -> Value {
        json!({"id": self.id, "object": "model", "created": self.created, "owned_by": "fsdp-app", "max_model_len": self.context})
    }

    /// Token ids of a conversation rendered with the model's chat template, ready for the
    /// assistant's answer (as transformers' `apply_chat_template(..., add_generation_prompt=True)`).
    pub fn chat_ids(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
        self.chat_ids_with_tools(messages, None)
    }

    /// The prompt of a conversation with functions: through the template when it reads
    /// `tools`, else in the generic format (`tools::generic_messages`).
    pub fn chat_ids_with_tools(&self, messages: &[ChatMessage], tools: Option<&tools::Tools>) -> Result<Vec<u32>, ApiError> {
        let template = self
            .tokenizer
            .chat_template
            .as_ref()
            .ok_or_else(|| ApiError::bad_request("This model has no chat template; use /v1/completions."))?;
        let has_tool_turns = messages.iter().any(|m| m.tool_calls.is_some() || m.role == "tool");
        let rendered = if template.takes_tools {
            template.render_with_tools(messages, tools.map(|t| &t.definitions), true)
        } else if tools.is_some() || has_tool_turns {
            template.render(&tools::generic_messages(tools, messages), true)
        } else {
            template.render(messages, true)
        };
        let text = rendered.map_err(|e| ApiError::invalid("messages", format!("The chat template failed: {e:#}")))?;
        self.tokenizer.encode(&text, false).map_err(|e| ApiError::bad_request(format!("{e:#}")))
    }

    /// Completions' `logprobs` for tokens scored or not (`None`: the prompt's first token, which
    /// nothing before it scores): `text_offset` counts characters of the returned text, from
    /// `start` (where the first of these tokens begins in it). Returns the object and where
    /// the next token would begin. Prompt tokens are shown with special tokens as "" (they are
    /// not in the echoed prompt text); generated ones as decoded.
    pub fn completion_logprobs_json(&self, tokens: &[(u32, Option<&crate::generate::TokenLogprob>)], start: usize, prompt: bool) -> (Value, usize) {
        let text = |id: u32| self.tokenizer.decode(&[id], prompt).unwrap_or_default();
        let mut offset = start;
        let (mut strings, mut offsets, mut lps, mut tops) = (vec![], vec![], vec![], vec![]);
        for (id, lp) in tokens {
            let t = text(*id);
            offsets.push(offset);
            offset += t.chars().count();
            strings.push(t);
            lps.push(lp.map(|l| json!(l.logprob)).unwrap_or(Value::Null));
            tops.push(lp.map(|l| Value::Object(l.top.iter().map(|(id, lp)| (self.tokenizer.decode(&[*id], false).unwrap_or_default(), json!(lp))).collect())).unwrap_or(Value::Null));
        }
        (json!({"tokens": strings, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}), offset)
    }

    /// Chat's `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
    pub fn chat_logprobs_json(&self, lps: &[crate::generate::TokenLogprob]) -> Value {
        let text = |id: u32| self.tokenizer.decode(&[id], false).unwrap_or_default();
        let content: Vec<Value> = lps
            .iter()
            .map(|l| {
                let t = text(l.token);
                json!({
                    "token": t, "logprob": l.logprob, "bytes": t.as_bytes(),
                    "top_logprobs": l.top.iter().map(|(id, lp)| { let s = text(*id); json!({"token": s, "logprob": lp, "bytes": s.as_bytes()}) }).collect::<Vec<_>>(),
                })
            })
            .collect();
        json!({"content": content})
    }
}

/// Constant-time comparison, so response timing says nothing about the key.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() != b.len()) as u8;
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

/// Every route but /health and the static pages needs `Authorization: Bearer <key>` when a key
/// is set.
async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    // Draining: requests on connections still open get 503 (the listener is closed).
    if st.shutdown.begun() {
        let resp = ApiError::shutting_down().into_response();
        st.metrics.request(resp.status().as_u16());
        return resp;
    }
    if let Some(key) = &st.api_key {
        if req.uri().path() != "/health" && !web::PUBLIC_PATHS.contains(&req.uri().path()) {
            let given = req
                .headers()
                .get(axum::http::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .unwrap_or("");
            if !same_secret(given.as_bytes(), key.as_bytes()) {
                let resp = ApiError::unauthorized().into_response();
                st.metrics.request(resp.status().as_u16());
                return resp;
            }
        }
    }
    let resp = next.run(req).await;
    st.metrics.request(resp.status().as_u16());
    resp
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(routes::health))
        .route("/", get(web::index))
        .route("/finetune", get(web::finetune))
        .route("/web/app.js", get(web::app_js))
        .route("/web/app.css", get(web::app_css))
        .route("/metrics", get(routes::metrics))
        .route("/info", get(routes::info))
        .route("/openapi.json", get(routes::openapi))
        .route("/tokenize", post(routes::tokenize))
        .route("/detokenize", post(routes::detokenize))
        .route("/v1/models", get(routes::models))
        .route("/v1/models/{id}", get(routes::model).delete(routes::delete_model))
        .route("/v1/completions", post(routes::completions))
        .route("/v1/chat/completions", post(routes::chat_completions))
        .route("/v1/files", post(files::upload).get(files::list).layer(DefaultBodyLimit::max(files::MAX_UPLOAD_BYTES)))
        .route("/v1/files/{id}", get(files::get_one).delete(files::delete))
        .route("/v1/files/{id}/content", get(files::content))
        .route("/v1/fine_tuning/jobs", post(jobs::create).get(jobs::list))
        .route("/v1/fine_tuning/jobs/{id}", get(jobs::get_one))
        .route("/v1/fine_tuning/jobs/{id}/cancel", post(jobs::cancel))
        .route("/v1/fine_tuning/jobs/{id}/events", get(jobs::events))
        .route("/v1/fine_tuning/jobs/{id}/checkpoints", get(jobs::checkpoints))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        // Read oversized bodies (up to a cap) so the 413 reaches the client; see `request::json_body`.
        .layer(DefaultBodyLimit::max(state.max_body_bytes.saturating_add(READ_PAST_LIMIT)))
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth))
        .with_state(state)
}

/// Loads a model directory (or Hub id) and starts its engine thread.
fn load_served(id: &str, source: &str, revision: Option<&str>, st_limits: &AppState) -> Result<ServedModel> {
    let limits = (st_limits.max_concurrent, st_limits.limit_input, st_limits.limit_total);
    load_served_with(id, source, revision, limits, st_limits.metrics.clone(), &st_limits.placement)
}

/// `limits`: (sequences run together, longest prompt, longest prompt + completion).
fn load_served_with(
    id: &str,
    source: &str,
    revision: Option<&str>,
    (max_running, limit_input, limit_total): (usize, Option<usize>, Option<usize>),
    metrics: Arc<Metrics>,
    placement: &Placement,
) -> Result<ServedModel> {
    let files = crate::checkpoint::resolve_model(source, revision)?;
    let loaded = crate::checkpoint::load_model(files, placement.dtype, &placement.device)?;
    // The engine thread computes on its own (per-thread) stream: the weights must have landed.
    placement.device.synchronize()?;
    let tokenizer = Arc::new(TextTokenizer::load(&loaded.files, loaded.config.vocab_size)?);
    let defaults = ModelDefaults::of(&loaded.files, &loaded.config.eos_token_ids)?;
    let eos = defaults.eos_token_ids.clone();
    let context = loaded.config.max_position_embeddings;
    let vocab = loaded.config.vocab_size;
    // A constrained answer ends with the tokenizer's eos token (a chat model's end of turn).
    let answer_end = tokenizer.eos_token.as_deref().and_then(|t| tokenizer.inner.token_to_id(t)).filter(|id| eos.contains(id)).or_else(|| eos.iter().min().copied());
    let grammars = match answer_end {
        None => Err("the model has no eos token to end a constrained answer".to_string()),
        Some(end) => crate::generate::constraint::Grammars::new(&tokenizer.inner.to_string(false).map_err(|e| anyhow::anyhow!("{e}"))?, vocab, end)
            .map(Arc::new)
            .map_err(|e| format!("{e:#}")),
    };
    let engine = engine::start(loaded.model, tokenizer.clone(), eos, max_running, metrics);
    let max_total_tokens = limit_total.unwrap_or(context).min(context);
    Ok(ServedModel {
        id: id.to_string(),
        engine,
        tokenizer,
        created: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        context,
        vocab,
        max_input_tokens: limit_input.unwrap_or(max_total_tokens - 1).min(max_total_tokens - 1),
        max_total_tokens,
        defaults,
        grammars,
    })
}

/// Loads the model, opens the data directory, starts the engine and the job runner, and serves
/// until the process ends. Prints the address it listens on (`listening on http://HOST:PORT`)
/// once ready.
pub fn run(cfg: &ServeConfig) -> Result<()> {
    let metrics = Arc::new(Metrics::default());
    let base_id = cfg.served_model_name.clone().unwrap_or_else(|| cfg.model.clone());
    let max_concurrent = cfg.max_concurrent_requests.max(1);
    let placement = Placement { device: cfg.device.open(0)?, dtype: cfg.dtype };
    let limits = (max_concurrent, cfg.max_input_tokens, cfg.max_total_tokens);
    let base = load_served_with(&base_id, &cfg.model, cfg.revision.as_deref(), limits, metrics.clone(), &placement)?;
    let store = Arc::new(store::Store::open(&cfg.data_dir)?);
    let failed = jobs::recover(&store)?;
    if failed > 0 {
        eprintln!("{failed} job(s) were running when the server last stopped; marked failed");
    }
    // A local base model is fine-tuned from its absolute path, whatever the jobs' working directory.
    let base_source = if Path::new(&cfg.model).is_dir() { std::fs::canonicalize(&cfg.model)?.to_string_lossy().to_string() } else { cfg.model.clone() };
    let state = Arc::new(AppState {
        models: RwLock::new(HashMap::from([(base_id.clone(), Arc::new(base))])),
        loading: Default::default(),
        base_id,
        base_source,
        store: store.clone(),
        jobs_wakeup: jobs::Wakeup::default(),
        in_flight: Arc::new(AtomicUsize::new(0)),
        max_concurrent,
        max_queue: cfg.max_queue,
        max_body_bytes: cfg.max_body_bytes,
        lenient: cfg.lenient,
        limit_input: cfg.max_input_tokens,
        limit_total: cfg.max_total_tokens,
        api_key: cfg.api_key.clone(),
        metrics,
        placement,
        shutdown: shutdown::Shutdown::new(),
    });
    jobs::start_runner(state.clone());
    let addr: SocketAddr = format!("{}:{}", cfg.host, cfg.port).parse().with_context(|| format!("--host {} --port {}: not an address", cfg.host, cfg.port))?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        let local = listener.local_addr()?;
        eprintln!("listening on http://{local} (model {})", state.base_id);
        let (st, grace) = (state.clone(), cfg.shutdown_grace);
        let signalled = tokio::spawn(async move {
            let which = shutdown::signal().await;
            st.shutdown.begin();
            match shutdown::stop_jobs(&st.store, which) {
                Ok(0) => {}
                Ok(n) => eprintln!("{which}: cancelled {n} running fine-tuning job(s)"),
                Err(e) => eprintln!("{which}: stopping the running jobs: {e:#}"),
            }
            eprintln!("{which}: not accepting requests; running generations have {}s to finish", grace.as_secs_f64());
            tokio::time::sleep(grace).await;
            st.shutdown.force();
        });
        let (shutdown, metrics) = (state.shutdown.clone(), state.metrics.clone());
        listen::serve(listener, router(state), cfg.limits, metrics, shutdown).await.context("the server stopped")?;
        signalled.abort();
        eprintln!("shut down");
        Ok(())
    })
}
