//! Starting the server: load the base model, open the data directory, recover jobs a crash left,
//! start the job runner, listen, and on SIGTERM / SIGINT drain (see `shutdown`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, RwLock};

use anyhow::{Context, Result};
use candle_core::DType;

use super::adapters::{check_adapter_name, Adapters};
use super::engine::EngineSettings;
use super::listen::{self, ClientLimits};
use super::metrics::Metrics;
use super::served_model::{LoadSettings, Placement, ServedModel};
use super::state::AppState;
use super::store::Store;
use super::{jobs, router, shutdown};

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
    /// Tokens per engine step (prompts fed in chunks of what decode steps leave).
    pub max_prefill_tokens: usize,
    /// Bytes of KV blocks each model's prefix cache keeps (0: no prefix caching).
    pub kv_cache_memory: usize,
    pub max_queue: usize,
    /// `--reasoning-parser`: how thinking is split out of answers.
    pub reasoning_parser: crate::generate::reasoning::ReasoningChoice,
    /// `--chat-template`'s text: the template used instead of the model's.
    pub chat_template: Option<String>,
    /// `--task` and `--pooling`: whether the model generates or only embeds, and how it pools.
    pub task: super::served_model::Task,
    pub pooling: Option<crate::embed::Pooling>,
    /// `--tool-call-parser`: how the model writes function calls.
    pub tool_call_parser: super::tool_format::ToolParser,
    /// Longest a request's sequence waits for a slot before it is answered 429 (None: no limit).
    pub max_queue_wait: Option<std::time::Duration>,
    pub max_input_tokens: Option<usize>,
    pub max_total_tokens: Option<usize>,
    pub max_body_bytes: usize,
    /// Largest upload of `POST /v1/files`.
    pub max_upload_bytes: u64,
    /// Ignore request fields this server does not implement (listed in a response header)
    /// instead of answering 400 (see `fields`).
    pub lenient: bool,
    /// How long running generations may go on after SIGTERM / SIGINT (see `shutdown`).
    pub shutdown_grace: std::time::Duration,
    /// How long a client may stall in a request's head (or idle between requests) or body.
    pub limits: ClientLimits,
    /// Where files, jobs (SQLite) and fine-tuned models live.
    pub data_dir: PathBuf,
    /// LoRA adapters served over the base from the start: (name, PEFT directory).
    pub loras: Vec<(String, PathBuf)>,
    /// Where run-time adapter loading may read (none: nowhere).
    pub lora_dir: Option<PathBuf>,
    /// Adapters kept in memory at most.
    pub max_loras: usize,
    /// Where and in which dtype the models compute.
    pub device: crate::device::DeviceSpec,
    pub dtype: DType,
    /// `--quantize`: the GGUF block format models' matrices are quantised to as they load.
    pub quantize: Option<crate::model_files::quantize::QuantizeSpec>,
}

/// Loads the model, opens the data directory, starts the engine and the job runner, and serves
/// until the process ends. Prints the address it listens on (`listening on http://HOST:PORT`)
/// once ready.
pub fn run(cfg: &ServeConfig) -> Result<()> {
    // Memory a finished request freed goes back to the OS (at once when the engine goes idle):
    // one long prompt must not leave the server's resident set high for good.
    crate::memory::purge_freed_memory_after(1000);
    let metrics = Arc::new(Metrics::default());
    let base_id = cfg.served_model_name.clone().unwrap_or_else(|| cfg.model.clone());
    let max_concurrent = cfg.max_concurrent_requests.max(1);
    let load = LoadSettings {
        placement: Placement { device: cfg.device.open(0)?, dtype: cfg.dtype, quantize: cfg.quantize },
        engine: EngineSettings {
            max_running: max_concurrent,
            max_batched_tokens: cfg.max_prefill_tokens.max(1),
            prefix_cache_bytes: cfg.kv_cache_memory,
            max_queue_wait: cfg.max_queue_wait,
        },
        limit_input: cfg.max_input_tokens,
        limit_total: cfg.max_total_tokens,
        metrics: metrics.clone(),
        reasoning: cfg.reasoning_parser,
        chat_template: cfg.chat_template.clone(),
        task: cfg.task,
        pooling: cfg.pooling,
        tool_parser: cfg.tool_call_parser,
    };
    let base = ServedModel::load(&base_id, &cfg.model, cfg.revision.as_deref(), &load)?;
    let adapters = Adapters::new(base.config.clone(), load.placement.clone(), cfg.max_loras, cfg.lora_dir.as_deref())?;
    for (name, dir) in &cfg.loras {
        check_adapter_name(name, &base_id)
            .and_then(|()| adapters.register(name, dir))
            .with_context(|| format!("--lora {name}={}", dir.display()))?;
    }
    let store = Arc::new(Store::open(&cfg.data_dir)?);
    let failed = jobs::recover(&store)?;
    if failed > 0 {
        eprintln!("{failed} job(s) were running when the server last stopped; marked failed");
    }
    // A local base model is fine-tuned from its absolute path, whatever the jobs' working directory.
    let base_source =
        if Path::new(&cfg.model).is_dir() { std::fs::canonicalize(&cfg.model)?.to_string_lossy().to_string() } else { cfg.model.clone() };
    let state = Arc::new(AppState {
        models: RwLock::new(HashMap::from([(base_id.clone(), Arc::new(base))])),
        loading: Default::default(),
        adapters,
        base_id,
        base_source,
        load,
        store,
        jobs_wakeup: jobs::Wakeup::default(),
        in_flight: Arc::new(AtomicUsize::new(0)),
        max_concurrent,
        max_queue: cfg.max_queue,
        max_body_bytes: cfg.max_body_bytes,
        max_upload_bytes: cfg.max_upload_bytes,
        lenient: cfg.lenient,
        api_key: cfg.api_key.clone(),
        metrics,
        shutdown: shutdown::Shutdown::new(),
    });
    jobs::start_runner(state.clone());
    let addr: SocketAddr =
        format!("{}:{}", cfg.host, cfg.port).parse().with_context(|| format!("--host {} --port {}: not an address", cfg.host, cfg.port))?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        let local = listener.local_addr()?;
        eprintln!("listening on http://{local} (model {})", state.base_id);
        let signalled = tokio::spawn(drain_on_signal(state.clone(), cfg.shutdown_grace));
        let (shutdown, metrics) = (state.shutdown.clone(), state.metrics.clone());
        listen::serve(listener, router::router(state), cfg.limits, metrics, shutdown).await.context("the server stopped")?;
        signalled.abort();
        eprintln!("shut down");
        Ok(())
    })
}

/// Waits for SIGTERM / SIGINT, then: no new requests, running jobs cancelled, and after `grace`
/// the generations still running are ended.
async fn drain_on_signal(st: Arc<AppState>, grace: std::time::Duration) {
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
}
