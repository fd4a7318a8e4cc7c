//! What every route reads: the served models (the base one, and fine-tuned ones loaded on first
//! use), the files and jobs store, the admission counters, and the server's settings.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use models::ServingAdapter;
use serde_json::{json, Value};

use super::adapters::Adapters;
use super::error::ApiError;
use super::jobs::Wakeup;
use super::metrics::Metrics;
use super::served_model::{LoadSettings, ServedModel};
use super::shutdown::Shutdown;
use super::store::Store;

pub struct AppState {
    /// Loaded models by id: the base model, and fine-tuned ones once first asked for.
    pub models: RwLock<HashMap<String, Arc<ServedModel>>>,
    /// One lock per model ever loaded here (kept: a few bytes each), so that a model is loaded
    /// (or a checkpoint merged) once however many ask for it, while requests for the others go on.
    pub loading: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// LoRA adapters served over the base model by name.
    pub adapters: Adapters,
    pub base_id: String,
    /// The --model the server was started with (what jobs fine-tune).
    pub base_source: String,
    /// How every model is loaded (placement, limits).
    pub load: LoadSettings,
    pub store: Arc<Store>,
    pub jobs_wakeup: Wakeup,
    /// Requests admitted and not finished (queued + running), over all models.
    pub in_flight: Arc<AtomicUsize>,
    pub max_concurrent: usize,
    pub max_queue: usize,
    pub max_body_bytes: usize,
    /// Largest upload of `POST /v1/files` (counted as it streams to disk).
    pub max_upload_bytes: u64,
    pub lenient: bool,
    pub api_key: Option<String>,
    pub metrics: Arc<Metrics>,
    pub shutdown: Arc<Shutdown>,
}

impl AppState {
    /// What a request's `model` runs on: a model, and the LoRA adapter over it when `id` names
    /// one (its base's engine runs it, batched with the base's other requests). Fine-tuned models
    /// and job checkpoints load on first use: a full one as a model of its own, a LoRA one as an
    /// adapter over the base.
    pub fn target(&self, id: &str) -> Result<(Arc<ServedModel>, Option<Arc<ServingAdapter>>), ApiError> {
        if let Some(m) = self.models.read().unwrap().get(id) {
            return Ok((m.clone(), None));
        }
        if let Some(adapter) = self.adapters.get(id) {
            let adapter = adapter.map_err(|e| ApiError::internal(format!("reading adapter {id} again: {e:#}")))?;
            return Ok((self.base(), Some(adapter)));
        }
        let internal = |e: anyhow::Error| ApiError::internal(format!("{e:#}"));
        let fine_tuned = self.store.fine_tuned_models().map_err(internal)?.into_iter().find(|(m, _)| m == id).map(|(_, d)| d);
        // An unknown name is answered at once, without waiting for any loading.
        if fine_tuned.is_none() && self.store.checkpoint_of_model(id).map_err(internal)?.is_none() {
            return Err(ApiError::model_not_found(id));
        }
        // The loading takes seconds: off the async workers, under this model's own lock.
        let slot = self.loading.lock().unwrap().entry(id.to_string()).or_default().clone();
        tokio::task::block_in_place(|| {
            let _only_loader = slot.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(m) = self.models.read().unwrap().get(id) {
                return Ok((m.clone(), None)); // loaded while this request waited
            }
            let dir = match fine_tuned {
                Some(d) => d,
                None => {
                    super::checkpoints::servable_dir(&self.store, id).map_err(internal)?.ok_or_else(|| ApiError::model_not_found(id))?
                }
            };
            if dir.join(crate::model_files::adapter::ADAPTER_CONFIG).is_file() {
                // Registered once (under this model's loading lock), then looked up as any adapter.
                let adapter = match self.adapters.get(id) {
                    Some(a) => a,
                    None => self
                        .adapters
                        .register(id, &dir)
                        .map(|()| self.adapters.get(id).expect("just registered"))
                        .map_err(|e| ApiError::internal(format!("loading {id}: {e:#}")))?,
                };
                return Ok((self.base(), Some(adapter.map_err(internal)?)));
            }
            let served = ServedModel::load(id, &dir.to_string_lossy(), None, &self.load)
                .map_err(|e| ApiError::internal(format!("loading {id}: {e:#}")))?;
            let served = Arc::new(served);
            self.models.write().unwrap().insert(id.to_string(), served.clone());
            Ok((served, None))
        })
    }

    /// Whether `id` is already a model's id here (the base, a fine-tuned model, a checkpoint,
    /// an adapter), without loading anything.
    pub fn is_model_id(&self, id: &str) -> Result<bool, ApiError> {
        let internal = |e: anyhow::Error| ApiError::internal(format!("{e:#}"));
        Ok(self.models.read().unwrap().contains_key(id)
            || self.adapters.list().iter().any(|a| a.name == id)
            || self.store.fine_tuned_models().map_err(internal)?.iter().any(|(m, _)| m == id)
            || self.store.checkpoint_of_model(id).map_err(internal)?.is_some())
    }

    pub fn base(&self) -> Arc<ServedModel> {
        self.models.read().unwrap()[&self.base_id].clone()
    }

    /// Every servable model: the base model and every succeeded job's.
    pub fn model_objects(&self) -> Vec<Value> {
        let base = self.base();
        let mut out: Vec<Value> = vec![base.object()];
        for (id, _) in self.store.fine_tuned_models().unwrap_or_default() {
            out.push(json!({"id": id, "object": "model", "created": base.created, "owned_by": "fsdp-app", "parent": self.base_id}));
        }
        // As vLLM lists its LoRA modules: the adapter's directory as `root`, the base as `parent`.
        // (Fine-tuned LoRA models are listed above, as jobs made them.)
        for a in self.adapters.list().into_iter().filter(|a| !a.name.starts_with("ft:")) {
            out.push(json!({"id": a.name, "object": "model", "created": a.created, "owned_by": "fsdp-app", "parent": self.base_id,
                            "root": a.dir, "max_model_len": base.max_total_tokens, "lora": {"loaded": a.loaded}}));
        }
        out
    }

    /// Forgets a deleted fine-tuned model and its checkpoints' engines (each ends once the
    /// requests running on it end).
    pub fn unload_fine_tuned(&self, id: &str) {
        self.models.write().unwrap().retain(|m, _| m != id && !super::checkpoints::is_checkpoint_of(m, id));
        for a in self.adapters.list().into_iter().filter(|a| a.name == id || super::checkpoints::is_checkpoint_of(&a.name, id)) {
            self.adapters.unregister(&a.name);
        }
    }

    pub fn running(&self) -> usize {
        self.models.read().unwrap().values().map(|m| m.engine.running.load(Ordering::SeqCst)).sum()
    }

    pub fn queued(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst).saturating_sub(self.running())
    }
}
