//! OpenAI's fine-tuning jobs API (`/v1/fine_tuning/jobs`: create with `Idempotency-Key`, list
//! with `after`/`limit`, retrieve, cancel, events, checkpoints) and the runner that executes
//! them: one job at a time, as `fsdp-app launch ... -- finetune ...` child processes in their
//! own process group (so cancel stops every rank). Progress comes from the run's metrics.jsonl.
//! On success the model `ft:BASE:SUFFIX:JOBID` is served like any other.

use std::collections::HashMap;
use std::io::{BufRead, Seek};
use std::path::Path as FsPath;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::checkpoints::Recorder;
use super::error::ApiError;
use super::request::Fields;
use super::store::{CreatedJob, JobRow, NewJob};
use super::AppState;
use crate::train::finetune::FinetuneArgs;

fn internal(e: anyhow::Error) -> ApiError {
    ApiError::internal(format!("{e:#}"))
}

/// Wakes the runner when a job is created.
#[derive(Clone, Default)]
pub struct Wakeup(Arc<(Mutex<bool>, Condvar)>);

impl Wakeup {
    pub fn notify(&self) {
        *self.0 .0.lock().unwrap() = true;
        self.0 .1.notify_all();
    }

    fn wait(&self, timeout: Duration) {
        let guard = self.0 .0.lock().unwrap();
        let (mut flag, _) = self.0 .1.wait_timeout_while(guard, timeout, |f| !*f).unwrap();
        *flag = false;
    }
}

/// `method`: `{"type": "supervised", "supervised": {"hyperparameters": {...}}}`, OpenAI's
/// form; DPO and reinforcement fine-tuning are not implemented. Returns the method's
/// hyperparameters, if it gives any.
fn method(v: &Value, lenient: bool) -> Result<Option<Value>, ApiError> {
    let Some(m) = v.get("method").filter(|x| !x.is_null()) else { return Ok(None) };
    if !m.is_object() {
        return Err(ApiError::invalid("method", "`method` must be an object such as {\"type\": \"supervised\"}."));
    }
    match m.get("type").and_then(Value::as_str) {
        Some("supervised") => {}
        Some(t @ ("dpo" | "reinforcement")) => {
            return Err(ApiError::invalid("method.type", format!("`method.type` {t:?} is not supported by this server; use \"supervised\".")).with_code("unsupported_parameter"))
        }
        _ => return Err(ApiError::invalid("method.type", "`method.type` must be \"supervised\".")),
    }
    super::fields::check(m, &["type", "supervised"], "method", lenient)?;
    let Some(s) = m.get("supervised").filter(|x| !x.is_null()) else { return Ok(None) };
    super::fields::check(s, &["hyperparameters"], "method.supervised", lenient)?;
    Ok(s.get("hyperparameters").filter(|x| !x.is_null()).cloned())
}

/// `hyperparameters` (or `method.supervised.hyperparameters`, not both): n_epochs, batch_size
/// and learning_rate_multiplier, each a number or "auto".
fn hyperparameters(v: &Value, lenient: bool) -> Result<Value, ApiError> {
    let top = v.get("hyperparameters").filter(|x| !x.is_null()).cloned();
    let h = match (top, method(v, lenient)?) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid("hyperparameters", "Give `hyperparameters` or `method.supervised.hyperparameters`, not both."))
        }
        (h, m) => h.or(m).unwrap_or(json!({})),
    };
    if !h.is_object() {
        return Err(ApiError::invalid("hyperparameters", "`hyperparameters` must be an object."));
    }
    let auto_or = |k: &str, lo: f64, hi: f64, default: Value, int: bool| -> Result<Value, ApiError> {
        match h.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::String(s)) if s == "auto" => Ok(default),
            Some(Value::Number(n)) => {
                let x = n.as_f64().unwrap_or(f64::NAN);
                if !(lo..=hi).contains(&x) || (int && x.fract() != 0.0) {
                    return Err(ApiError::invalid(&format!("hyperparameters.{k}"), format!("`{k}` must be {} in [{lo}, {hi}] or \"auto\".", if int { "an integer" } else { "a number" })));
                }
                Ok(if int { json!(x as u64) } else { json!(x) })
            }
            _ => Err(ApiError::invalid(&format!("hyperparameters.{k}"), format!("`{k}` must be a number or \"auto\"."))),
        }
    };
    for k in h.as_object().unwrap().keys() {
        if !["n_epochs", "batch_size", "learning_rate_multiplier"].contains(&k.as_str()) {
            return Err(ApiError::invalid(&format!("hyperparameters.{k}"), format!("unknown hyperparameter `{k}`; use n_epochs, batch_size, learning_rate_multiplier.")));
        }
    }
    Ok(json!({
        "n_epochs": auto_or("n_epochs", 1.0, 50.0, json!(3), true)?,
        "batch_size": auto_or("batch_size", 1.0, 256.0, json!(1), true)?,
        "learning_rate_multiplier": auto_or("learning_rate_multiplier", 1e-3, 100.0, json!(1.0), false)?,
    }))
}

/// Our extensions, under `fsdp_app`: world_size, seq_len (default min(512, the model's
/// context), at most the context), max_steps, lora {r, alpha, dropout, targets}.
fn extensions(v: &Value, lenient: bool, context: usize) -> Result<Value, ApiError> {
    let default_seq = crate::train::DEFAULT_SEQ_LEN.min(context) as i64;
    let Some(e) = v.get("fsdp_app").filter(|x| !x.is_null()) else { return Ok(json!({"world_size": 1, "seq_len": default_seq, "max_steps": null, "lora": null})) };
    let f = Fields::of(e).map_err(|_| ApiError::invalid("fsdp_app", "`fsdp_app` must be an object."))?;
    super::fields::check(e, super::fields::JOB_EXTENSION, "fsdp_app", lenient)?;
    let named = |err: ApiError| ApiError { param: err.param.map(|p| format!("fsdp_app.{p}")), ..err };
    let world = f.integer("world_size", 1, 16).map_err(named)?.unwrap_or(1);
    let seq = f.integer("seq_len", 16, 1 << 20).map_err(named)?.unwrap_or(default_seq);
    if seq as usize > context {
        return Err(ApiError::invalid("fsdp_app.seq_len", format!("`seq_len` {seq} is longer than the model's context ({context} tokens, max_position_embeddings).")));
    }
    let steps = f.integer("max_steps", 1, 1_000_000).map_err(named)?;
    let lora = match f.value("lora") {
        None => Value::Null,
        Some(l) => {
            let lf = Fields::of(l).map_err(|_| ApiError::invalid("fsdp_app.lora", "`lora` must be an object."))?;
            super::fields::check(l, super::fields::JOB_LORA, "fsdp_app.lora", lenient)?;
            let named = |err: ApiError| ApiError { param: err.param.map(|p| format!("fsdp_app.lora.{p}")), ..err };
            let targets: Vec<String> = match lf.value("targets") {
                None => vec!["q_proj".into(), "v_proj".into()],
                Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_string) => a.iter().map(|x| x.as_str().unwrap().to_string()).collect(),
                Some(Value::String(s)) => vec![s.clone()],
                Some(_) => return Err(ApiError::invalid("fsdp_app.lora.targets", "`targets` must be module names.")),
            };
            if let Some(bad) = targets.iter().find(|t| !(t.as_str() == "all-linear" || models::lora::LINEAR_MODULES.contains(&t.as_str()))) {
                return Err(ApiError::invalid("fsdp_app.lora.targets", format!("{bad:?} is not a linear module ({}, or all-linear).", models::lora::LINEAR_MODULES.join(", "))));
            }
            json!({
                "r": lf.integer("r", 1, 1024).map_err(named)?.unwrap_or(8),
                "alpha": lf.number("alpha", 1e-6, 1e6).map_err(named)?.unwrap_or(16.0),
                "dropout": lf.number("dropout", 0.0, 0.99).map_err(named)?.unwrap_or(0.0),
                "targets": targets,
            })
        }
    };
    Ok(json!({"world_size": world, "seq_len": seq, "max_steps": steps, "lora": lora}))
}

pub async fn create(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>) -> Result<Response, ApiError> {
    let v = super::request::json_body(body, st.max_body_bytes)?;
    let f = Fields::of(&v)?;
    let ignored = super::fields::check(&v, super::fields::JOB, "", st.lenient)?;
    let model = f.string("model")?.ok_or_else(|| ApiError::invalid("model", "`model` is required."))?;
    if model != st.base_id {
        return Err(ApiError::invalid("model", format!("This server fine-tunes `{}` only.", st.base_id)).with_code("model_not_available"));
    }
    let file = |k: &str, required: bool| -> Result<Option<String>, ApiError> {
        match f.string(k)? {
            None if required => Err(ApiError::invalid(k, format!("`{k}` is required."))),
            None => Ok(None),
            Some(id) => match st.store.file(id).map_err(internal)? {
                Some(_) => Ok(Some(id.to_string())),
                None => Err(ApiError::invalid(k, format!("No such file: {id}.")).with_code("invalid_file")),
            },
        }
    };
    let training_file = file("training_file", true)?.unwrap();
    let validation_file = file("validation_file", false)?;
    let suffix = f.string("suffix")?.map(str::to_string);
    if let Some(s) = &suffix {
        if s.len() > 64 || !s.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
            return Err(ApiError::invalid("suffix", "`suffix` is at most 64 letters, digits, '-' or '_'."));
        }
    }
    let seed = f.integer("seed", 0, i32::MAX as i64)?.unwrap_or(42);
    let job = NewJob {
        model: model.to_string(),
        training_file,
        validation_file,
        hyperparameters: hyperparameters(&v, st.lenient)?,
        extensions: extensions(&v, st.lenient, st.base().context)?,
        suffix,
        seed,
    };
    let key = headers.get("idempotency-key").and_then(|h| h.to_str().ok()).filter(|k| !k.is_empty() && k.len() <= 255);
    let row = match st.store.create_job(job, key).map_err(internal)? {
        CreatedJob::New(row) => {
            st.jobs_wakeup.notify();
            row
        }
        CreatedJob::Existing(row) => row,
        // As Stripe-style idempotency does: a key names one request, not a slot to reuse.
        CreatedJob::KeyReused(row) => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "invalid_request_error",
                format!(
                    "Idempotency-Key {:?} was already used for job {} with other settings; use a new key for a different job.",
                    key.unwrap_or_default(),
                    row.id
                ),
            )
            .with_code("idempotency_key_reused"))
        }
    };
    Ok(super::routes::with_ignored((StatusCode::OK, Json(row.to_json())).into_response(), &ignored))
}

fn page(q: &HashMap<String, String>) -> Result<(Option<String>, usize), ApiError> {
    let limit = match q.get("limit") {
        None => 20,
        Some(l) => l.parse::<usize>().ok().filter(|n| (1..=100).contains(n)).ok_or_else(|| ApiError::invalid("limit", "`limit` must be an integer from 1 to 100."))?,
    };
    Ok((q.get("after").cloned(), limit))
}

pub async fn list(State(st): State<Arc<AppState>>, q: Result<Query<HashMap<String, String>>, axum::extract::rejection::QueryRejection>) -> Result<Json<Value>, ApiError> {
    let q = q.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let (after, limit) = page(&q)?;
    let (rows, more) = st.store.jobs(after.as_deref(), limit).map_err(internal)?;
    Ok(Json(json!({"object": "list", "data": rows.iter().map(JobRow::to_json).collect::<Vec<_>>(), "has_more": more})))
}

fn job_or_404(st: &AppState, id: &str) -> Result<JobRow, ApiError> {
    st.store.job(id).map_err(internal)?.ok_or_else(|| ApiError::not_found(format!("No such fine-tuning job: {id}")))
}

pub async fn get_one(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    Ok(Json(job_or_404(&st, &id)?.to_json()))
}

pub async fn cancel(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let job = job_or_404(&st, &id)?;
    if job.is_final() {
        return Err(ApiError::bad_request(format!("Job {id} has already {}.", job.status)).with_code("job_not_cancellable"));
    }
    // The runner sees the status at its next poll and stops the processes.
    if st.store.set_status(&id, "cancelled", None, None, None).map_err(internal)? {
        st.store.add_event(&id, "info", "Job cancelled", "message", None).map_err(internal)?;
    }
    Ok(Json(job_or_404(&st, &id)?.to_json()))
}

pub async fn events(State(st): State<Arc<AppState>>, Path(id): Path<String>, q: Result<Query<HashMap<String, String>>, axum::extract::rejection::QueryRejection>) -> Result<Json<Value>, ApiError> {
    let q = q.map_err(|e| ApiError::bad_request(e.body_text()))?;
    job_or_404(&st, &id)?;
    let (after, limit) = page(&q)?;
    let (rows, more) = st.store.events(&id, after.as_deref(), limit).map_err(internal)?;
    Ok(Json(json!({"object": "list", "data": rows, "has_more": more})))
}

pub async fn checkpoints(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    job_or_404(&st, &id)?;
    let rows = st.store.checkpoints(&id).map_err(internal)?;
    Ok(Json(json!({"object": "list", "data": rows, "has_more": false, "first_id": null, "last_id": null})))
}

/// Why a training run failed, from its log: the first error a rank reported (`error: ...`), not
/// the launcher's summary that follows it ("the job failed: rank 0 exited with code 1") nor a
/// backtrace frame; the summary when it is all there is.
fn failure_cause(log: &str) -> Option<String> {
    let errors: Vec<&str> = log.lines().filter_map(|l| l.strip_prefix("error: ")).map(str::trim).filter(|l| !l.is_empty()).collect();
    errors.iter().find(|l| !l.starts_with("the job failed:")).or(errors.last()).map(|l| l.to_string())
}

// ---- the runner ----

/// Starts the thread that runs queued jobs, one at a time.
pub fn start_runner(st: Arc<AppState>) {
    std::thread::Builder::new()
        .name("jobs".into())
        .spawn(move || loop {
            // Shutting down: queued jobs stay queued for the next start.
            if st.shutdown.begun() {
                return;
            }
            match st.store.next_queued() {
                Ok(Some(job)) => {
                    if let Err(e) = run_job(&st, &job) {
                        let err = json!({"code": "internal_error", "message": format!("{e:#}"), "param": null});
                        let _ = st.store.set_status(&job.id, "failed", Some(err), None, None);
                    }
                }
                Ok(None) => st.jobs_wakeup.wait(Duration::from_secs(1)),
                Err(e) => {
                    eprintln!("jobs: {e:#}");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        })
        .expect("spawning the job runner");
}

/// At start-up: marks the jobs that were running when the server stopped as failed, and stops
/// their training processes (a group led by one of our processes only: pids get reused).
/// Returns how many jobs failed so.
pub fn recover(store: &super::store::Store) -> anyhow::Result<usize> {
    let groups = store.recover()?;
    for pgid in &groups {
        let cmdline = String::from_utf8_lossy(&std::fs::read(format!("/proc/{pgid}/cmdline")).unwrap_or_default()).to_string();
        if cmdline.contains("fsdp-app") || cmdline.contains("finetune") {
            kill_group(*pgid);
        }
    }
    Ok(groups.len())
}

/// SIGKILL to the process group `pgid` (a job's launcher and its ranks). Refuses the groups a
/// slip could turn into "everything" (0, 1) and the server's own group.
pub fn kill_group(pgid: u32) {
    let own = unsafe { libc::getpgrp() } as u32;
    if pgid > 1 && pgid != own && pgid <= i32::MAX as u32 {
        // SAFETY: plain syscall on a positive process-group id.
        unsafe {
            libc::kill(-(pgid as i32), libc::SIGKILL);
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(29500)
}

/// A job's fine-tuning settings: the `finetune` defaults with what the job asks for. The child
/// reads them from a file (`finetune --args-file`), so no flag is spelled twice.
fn finetune_args(st: &AppState, job: &JobRow, world: u64) -> FinetuneArgs {
    let h = &job.hyperparameters;
    let e = &job.extensions;
    let mut a = FinetuneArgs::defaults();
    a.model = Some(st.base_source.clone());
    a.data = Some(st.store.file_path(&job.training_file));
    a.eval_data = job.validation_file.as_ref().map(|v| st.store.file_path(v));
    a.output_dir = Some(job.output_dir.clone().into());
    a.epochs = h["n_epochs"].as_u64().unwrap_or(3) as usize;
    a.batch_size = h["batch_size"].as_u64().unwrap_or(1).max(1).div_ceil(world).max(1) as usize;
    a.seed = job.seed as u64;
    a.seq_len = e["seq_len"].as_u64().map(|n| n as usize);
    a.lr_scheduler = "linear".into();
    a.max_steps = e["max_steps"].as_u64().map(|s| s as usize);
    // A checkpoint at every epoch's end, the newest few kept, as OpenAI's jobs make them.
    a.save_strategy = Some("epoch".into());
    a.save_total_limit = Some(super::checkpoints::KEEP);
    let lora = e.get("lora").filter(|l| !l.is_null());
    // OpenAI scales a base rate; ours: 2e-5 for full fine-tuning, 2e-4 for LoRA.
    let base_lr = if lora.is_some() { 2e-4 } else { 2e-5 };
    a.lr = base_lr * h["learning_rate_multiplier"].as_f64().unwrap_or(1.0);
    if let Some(l) = lora {
        let targets: Vec<&str> = l["targets"].as_array().map(|a| a.iter().filter_map(|t| t.as_str()).collect()).unwrap_or_default();
        a.lora.lora_r = Some(l["r"].as_u64().unwrap_or(8) as usize);
        a.lora.lora_alpha = Some(l["alpha"].as_f64().unwrap_or(16.0));
        a.lora.lora_dropout = Some(l["dropout"].as_f64().unwrap_or(0.0));
        a.lora.lora_targets = Some(targets.join(","));
        a.merge_lora = true;
    }
    // Jobs train where the server computes: on a GPU server each rank takes its LOCAL_RANK GPU,
    // in bf16 with fp32 master weights.
    if !st.placement.device.is_cpu() {
        a.device = "cuda".into();
        a.param_dtype = "bf16".into();
    }
    a
}

/// The `fsdp-app launch ... -- finetune --args-file FILE` command line of a job, after writing
/// its settings to FILE (next to the job's log).
fn command_line(st: &AppState, job: &JobRow) -> anyhow::Result<Vec<String>> {
    let world = job.extensions["world_size"].as_u64().unwrap_or(1).max(1);
    let settings = FsPath::new(&job.output_dir).with_extension("args.json");
    finetune_args(st, job, world).write_file(&settings)?;
    Ok(vec![
        "launch".into(), "--nproc-per-node".into(), world.to_string(), "--master-port".into(), free_port().to_string(), "--".into(),
        "finetune".into(), "--args-file".into(), settings.to_string_lossy().to_string(),
    ])
}

/// Lines of metrics.jsonl added since `offset`.
fn new_metric_rows(path: &FsPath, offset: &mut u64) -> Vec<Value> {
    let Ok(mut f) = std::fs::File::open(path) else { return vec![] };
    if f.seek(std::io::SeekFrom::Start(*offset)).is_err() {
        return vec![];
    }
    let mut rows = vec![];
    let mut reader = std::io::BufReader::new(f);
    let mut line = String::new();
    while reader.read_line(&mut line).unwrap_or(0) > 0 {
        if !line.ends_with('\n') {
            break; // a row still being written: read it next time
        }
        *offset += line.len() as u64;
        if let Ok(v) = serde_json::from_str::<Value>(&line) {
            rows.push(v);
        }
        line.clear();
    }
    rows
}

fn run_job(st: &AppState, job: &JobRow) -> anyhow::Result<()> {
    let store = &st.store;
    if !store.set_status(&job.id, "running", None, None, None)? {
        return Ok(()); // cancelled before it started
    }
    store.add_event(&job.id, "info", "Fine-tuning job started", "message", None)?;
    let log_path = FsPath::new(&job.output_dir).with_extension("log");
    let log = std::fs::File::create(&log_path)?;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(command_line(st, job)?).stdout(log.try_clone()?).stderr(log).stdin(std::process::Stdio::null());
    // Its own process group: cancel stops the launcher and every rank at once.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn()?;
    let pgid = child.id();
    store.set_pgid(&job.id, pgid)?;
    let metrics = FsPath::new(&job.output_dir).join("metrics.jsonl");
    let model = format!("ft:{}:{}:{}", st.base_id, job.suffix.as_deref().unwrap_or(""), job.id);
    let mut checkpoints = Recorder::new(&job.id, FsPath::new(&job.output_dir), &model);
    let (mut offset, mut last_step, mut trained_tokens) = (0u64, 0i64, 0u64);
    let status = loop {
        for row in new_metric_rows(&metrics, &mut offset) {
            let step = row["step"].as_i64().unwrap_or(0);
            if let Some(loss) = row["loss"].as_f64() {
                trained_tokens += row["tokens"].as_u64().unwrap_or(0);
                last_step = step;
                checkpoints.saw(step, "train_loss", loss);
                store.add_event(&job.id, "info", &format!("Step {step}: training loss={loss:.4}"), "metrics",
                    Some(json!({"step": step, "train_loss": loss, "learning_rate": row["lr"], "tokens_per_s": row["tokens_per_s"]})))?;
            }
            if let Some(eval) = row["eval_loss"].as_f64() {
                checkpoints.saw(step, "valid_loss", eval);
                store.add_event(&job.id, "info", &format!("Step {step}: validation loss={eval:.4}"), "metrics", Some(json!({"step": step, "valid_loss": eval})))?;
            }
        }
        checkpoints.sync(store)?;
        if store.job(&job.id)?.is_some_and(|j| j.status == "cancelled") {
            kill_group(pgid);
            let _ = child.wait();
            return Ok(());
        }
        if let Some(s) = child.try_wait()? {
            break s;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    checkpoints.sync(store)?;
    if !status.success() {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        let message = failure_cause(&text).unwrap_or_else(|| format!("the training processes exited with {status}"));
        store.set_status(&job.id, "failed", Some(json!({"code": "training_failed", "message": message, "param": null})), None, None)?;
        store.add_event(&job.id, "error", &format!("Training failed: {message}"), "message", None)?;
        return Ok(());
    }
    checkpoints.finish(store, last_step)?;
    if store.set_status(&job.id, "succeeded", None, Some(&model), Some(trained_tokens as i64))? {
        store.add_event(&job.id, "info", &format!("New fine-tuned model created: {model}"), "message", None)?;
        store.add_event(&job.id, "info", "The job has successfully completed", "message", None)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_job_names_the_ranks_first_error_not_the_launcher_nor_a_backtrace() {
        let log = "data: 2 rows\nerror: d.jsonl: no token is trained on (every label is masked)\n\nStack backtrace:\n   0: anyhow::error::<impl anyhow::Error>::msg\n             at src/error.rs:1:1\nlaunch: peak RSS per rank\nerror: the job failed: rank 0 exited with code 1\n\nStack backtrace:\n   0: main\n";
        assert_eq!(failure_cause(log).unwrap(), "d.jsonl: no token is trained on (every label is masked)");
        assert_eq!(failure_cause("error: the job failed: rank 1 was killed by signal 9\n").unwrap(), "the job failed: rank 1 was killed by signal 9");
        assert_eq!(failure_cause("no errors here\n"), None);
    }
}
