//! OpenAI's fine-tuning jobs API: `POST /v1/fine_tuning/jobs` (with `Idempotency-Key`), list
//! with `after`/`limit`, retrieve, cancel, events and checkpoints. A request is read into the
//! typed job of `spec`; the runner (`runner`) takes it from the store.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::spec::{Hyperparameters, JobExtensions, JobLora, JobStatus};
use crate::serve::body::json_body;
use crate::serve::error::ApiError;
use crate::serve::fields::{self, Fields};
use crate::serve::files::{file_row_kind, RowKind};
use crate::serve::response::with_ignored;
use crate::serve::state::AppState;
use crate::serve::store::{CreatedJob, JobRow, NewJob};

fn internal(e: anyhow::Error) -> ApiError {
    ApiError::internal(format!("{e:#}"))
}

/// `method`: `{"type": "supervised" | "dpo" | "reinforcement", "<type>": {"hyperparameters":
/// {...}}}`, OpenAI's form (`reinforcement` also takes its `grader`, checked here: a bad one is a
/// 400 naming its field). Returns the method's type, its hyperparameters if it gives any, and
/// the grader.
fn method(v: &Value, lenient: bool, ignored: &mut Vec<String>) -> Result<(&'static str, Option<Value>, Option<Value>), ApiError> {
    let Some(m) = v.get("method").filter(|x| !x.is_null()) else { return Ok(("supervised", None, None)) };
    if !m.is_object() {
        return Err(ApiError::invalid("method", "`method` must be an object such as {\"type\": \"supervised\"}."));
    }
    let kind = match m.get("type").and_then(Value::as_str) {
        Some("supervised") => "supervised",
        Some("dpo") => "dpo",
        Some("reinforcement") => "reinforcement",
        _ => return Err(ApiError::invalid("method.type", "`method.type` must be \"supervised\", \"dpo\" or \"reinforcement\".")),
    };
    ignored.extend(fields::check(m, &["type", kind], "method", lenient)?);
    let settings = m.get(kind).filter(|x| !x.is_null());
    let grader = match kind {
        "reinforcement" => {
            let g = settings.and_then(|s| s.get("grader")).filter(|x| !x.is_null());
            let g = g.ok_or_else(|| {
                ApiError::invalid("method.reinforcement.grader", "A reinforcement job needs `method.reinforcement.grader`.")
            })?;
            Some(checked_grader(g)?)
        }
        _ => None,
    };
    let Some(s) = settings else { return Ok((kind, None, grader)) };
    let allowed: &[&str] = if kind == "reinforcement" { &["grader", "hyperparameters"] } else { &["hyperparameters"] };
    ignored.extend(fields::check(s, allowed, &format!("method.{kind}"), lenient)?);
    Ok((kind, s.get("hyperparameters").filter(|x| !x.is_null()).cloned(), grader))
}

/// A grader the trainer can run, or a 400 whose `param` names the bad field
/// (`method.reinforcement.grader.operation`, ...).
fn checked_grader(g: &Value) -> Result<Value, ApiError> {
    match crate::train::grpo::graders::Grader::from_json(g) {
        // A client of the server must not run programs on it.
        Ok(grader) if grader.runs_commands() => Err(ApiError::invalid(
            "method.reinforcement.grader",
            "`command` graders run a program on the server and are not accepted over HTTP; use them with `fsdp-app finetune --grader`.",
        )
        .with_code("unsupported_parameter")),
        Ok(_) => Ok(g.clone()),
        Err(e) => {
            let message = format!("{e:#}");
            // The grader's errors start with the field's path: `grader.graders.a.operation: ...`.
            let field = message.split(':').next().filter(|f| f.starts_with("grader") && !f.contains(' ')).unwrap_or("grader");
            Err(ApiError::invalid(&format!("method.reinforcement.{field}"), message))
        }
    }
}

/// `hyperparameters` (or `method.<type>.hyperparameters`, not both): n_epochs, batch_size and
/// learning_rate_multiplier, and for DPO beta, each a number or "auto".
fn hyperparameters(v: &Value, lenient: bool, ignored: &mut Vec<String>) -> Result<Hyperparameters, ApiError> {
    let top = v.get("hyperparameters").filter(|x| !x.is_null()).cloned();
    let (kind, from_method, grader) = method(v, lenient, ignored)?;
    let h = match (top, from_method) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "hyperparameters",
                format!("Give `hyperparameters` or `method.{kind}.hyperparameters`, not both."),
            ))
        }
        (h, m) => h.or(m).unwrap_or(json!({})),
    };
    if !h.is_object() {
        return Err(ApiError::invalid("hyperparameters", "`hyperparameters` must be an object."));
    }
    let d = Hyperparameters::default();
    // A number in [lo, hi] (an integer when `int`), or "auto" / absent for the default.
    let auto_or = |k: &str, lo: f64, hi: f64, default: f64, int: bool| -> Result<f64, ApiError> {
        match h.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::String(s)) if s == "auto" => Ok(default),
            Some(Value::Number(n)) => {
                let x = n.as_f64().unwrap_or(f64::NAN);
                if !(lo..=hi).contains(&x) || (int && x.fract() != 0.0) {
                    return Err(ApiError::invalid(
                        &format!("hyperparameters.{k}"),
                        format!("`{k}` must be {} in [{lo}, {hi}] or \"auto\".", if int { "an integer" } else { "a number" }),
                    ));
                }
                Ok(x)
            }
            _ => Err(ApiError::invalid(&format!("hyperparameters.{k}"), format!("`{k}` must be a number or \"auto\"."))),
        }
    };
    let known: &[&str] = match kind {
        "dpo" => &["n_epochs", "batch_size", "learning_rate_multiplier", "beta"],
        "reinforcement" => &["n_epochs", "batch_size", "learning_rate_multiplier", "compute_multiplier", "eval_interval", "eval_samples"],
        _ => &["n_epochs", "batch_size", "learning_rate_multiplier"],
    };
    for k in h.as_object().unwrap().keys() {
        if !known.contains(&k.as_str()) {
            return Err(ApiError::invalid(
                &format!("hyperparameters.{k}"),
                format!("unknown hyperparameter `{k}` for method {kind:?}; use {}.", known.join(", ")),
            ));
        }
    }
    Ok(Hyperparameters {
        n_epochs: auto_or("n_epochs", 1.0, 50.0, d.n_epochs as f64, true)? as u64,
        batch_size: auto_or("batch_size", 1.0, 256.0, d.batch_size as f64, true)? as u64,
        learning_rate_multiplier: auto_or("learning_rate_multiplier", 1e-3, 100.0, d.learning_rate_multiplier, false)?,
        // OpenAI takes beta in (0, 2]; "auto" is TRL's default.
        beta: match kind {
            "dpo" => Some(auto_or("beta", 1e-6, 2.0, crate::train::dpo::DEFAULT_BETA, false)?),
            _ => None,
        },
        compute_multiplier: match kind {
            "reinforcement" => Some(auto_or("compute_multiplier", 0.25, 8.0, 1.0, false)?),
            _ => None,
        },
        // 0 stands for "auto" here: absent.
        eval_interval: match kind {
            "reinforcement" => Some(auto_or("eval_interval", 1.0, 1e6, 0.0, true)? as u64).filter(|n| *n > 0),
            _ => None,
        },
        eval_samples: match kind {
            "reinforcement" => Some(auto_or("eval_samples", 2.0, 64.0, 0.0, true)? as u64).filter(|n| *n > 0),
            _ => None,
        },
        grader,
    })
}

/// Our extensions, under `fsdp_app`: world_size, seq_len (at most the model's context),
/// max_steps, lora {r, alpha, dropout, targets}, merge; what is not given takes [`JobExtensions`]'
/// and [`JobLora`]'s defaults.
fn extensions(v: &Value, lenient: bool, context: usize, ignored: &mut Vec<String>) -> Result<JobExtensions, ApiError> {
    let d = JobExtensions::defaults(context);
    let Some(e) = v.get("fsdp_app").filter(|x| !x.is_null()) else { return Ok(d) };
    let f = Fields::of(e).map_err(|_| ApiError::invalid("fsdp_app", "`fsdp_app` must be an object."))?;
    ignored.extend(fields::check(e, fields::JOB_EXTENSION, "fsdp_app", lenient)?);
    let named = |err: ApiError| ApiError { param: err.param.map(|p| format!("fsdp_app.{p}")), ..err };
    let world_size = f.integer("world_size", 1, 16).map_err(named)?.map_or(d.world_size, |n| n as u64);
    let seq_len = f.integer("seq_len", 16, 1 << 20).map_err(named)?.map_or(d.seq_len, |n| n as u64);
    if seq_len as usize > context {
        return Err(ApiError::invalid(
            "fsdp_app.seq_len",
            format!("`seq_len` {seq_len} is longer than the model's context ({context} tokens, max_position_embeddings)."),
        ));
    }
    let max_steps = f.integer("max_steps", 1, 1_000_000).map_err(named)?.map(|n| n as u64);
    let max_completion_length = f.integer("max_completion_length", 1, 1 << 20).map_err(named)?.map(|n| n as u64);
    if max_completion_length.is_some_and(|n| n >= seq_len) {
        return Err(ApiError::invalid(
            "fsdp_app.max_completion_length",
            "`max_completion_length` must leave room for the prompt in `seq_len`.",
        ));
    }
    let lora = f.value("lora").map(|l| lora(l, lenient, ignored)).transpose()?;
    let merge = f.bool("merge").map_err(named)?.unwrap_or(false);
    if merge && lora.is_none() {
        return Err(ApiError::invalid("fsdp_app.merge", "`merge` needs `lora`: it merges the trained adapter into the base."));
    }
    Ok(JobExtensions { world_size, seq_len, max_steps, max_completion_length, lora, merge })
}

/// `fsdp_app.lora`.
fn lora(l: &Value, lenient: bool, ignored: &mut Vec<String>) -> Result<JobLora, ApiError> {
    let d = JobLora::default();
    let lf = Fields::of(l).map_err(|_| ApiError::invalid("fsdp_app.lora", "`lora` must be an object."))?;
    ignored.extend(fields::check(l, fields::JOB_LORA, "fsdp_app.lora", lenient)?);
    let named = |err: ApiError| ApiError { param: err.param.map(|p| format!("fsdp_app.lora.{p}")), ..err };
    let targets: Vec<String> = match lf.value("targets") {
        None => d.targets,
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_string) => {
            a.iter().map(|x| x.as_str().unwrap().to_string()).collect()
        }
        Some(Value::String(s)) => vec![s.clone()],
        Some(_) => return Err(ApiError::invalid("fsdp_app.lora.targets", "`targets` must be module names.")),
    };
    if let Some(bad) = targets.iter().find(|t| !(t.as_str() == "all-linear" || models::lora::LINEAR_MODULES.contains(&t.as_str()))) {
        return Err(ApiError::invalid(
            "fsdp_app.lora.targets",
            format!("{bad:?} is not a linear module ({}, or all-linear).", models::lora::LINEAR_MODULES.join(", ")),
        ));
    }
    Ok(JobLora {
        r: lf.integer("r", 1, 1024).map_err(named)?.map_or(d.r, |n| n as u64),
        alpha: lf.number("alpha", 1e-6, 1e6).map_err(named)?.unwrap_or(d.alpha),
        dropout: lf.number("dropout", 0.0, 0.99).map_err(named)?.unwrap_or(d.dropout),
        targets,
    })
}

pub async fn create(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Response, ApiError> {
    let v = json_body(body, st.max_body_bytes)?;
    let f = Fields::of(&v)?;
    let mut ignored = fields::check(&v, fields::JOB, "", st.lenient)?;
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
    let hyperparameters = hyperparameters(&v, st.lenient, &mut ignored)?;
    // Uploads hold one kind of row (checked at upload): the method must train on that kind.
    let wanted = match hyperparameters.method_type() {
        "dpo" => RowKind::Preference,
        "reinforcement" => RowKind::Prompt,
        _ => RowKind::Supervised,
    };
    if hyperparameters.eval_interval.is_some() && validation_file.is_none() {
        return Err(ApiError::invalid("hyperparameters.eval_interval", "`eval_interval` needs a `validation_file` to evaluate on."));
    }
    for (k, id) in [("training_file", Some(&training_file)), ("validation_file", validation_file.as_ref())] {
        let Some(id) = id else { continue };
        let kind = tokio::task::block_in_place(|| file_row_kind(&st.store.file_path(id))).map_err(internal)?;
        if kind != wanted {
            return Err(ApiError::invalid(
                k,
                format!(
                    "{id} holds {} rows, but `method.type` {:?} trains on {} rows.",
                    kind.name(),
                    hyperparameters.method_type(),
                    wanted.name()
                ),
            )
            .with_code("invalid_file"));
        }
    }
    if let Some(g) = &hyperparameters.grader {
        let grader = crate::train::grpo::graders::Grader::from_json(g).map_err(internal)?;
        let path = st.store.file_path(&training_file);
        tokio::task::block_in_place(|| crate::serve::files::check_grader_reads(&path, &grader))?;
    }
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
        hyperparameters,
        extensions: extensions(&v, st.lenient, st.base().context, &mut ignored)?,
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
    Ok(with_ignored((StatusCode::OK, Json(row.to_json())).into_response(), &ignored))
}

fn page(q: &HashMap<String, String>) -> Result<(Option<String>, usize), ApiError> {
    let limit = match q.get("limit") {
        None => 20,
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=100).contains(n))
            .ok_or_else(|| ApiError::invalid("limit", "`limit` must be an integer from 1 to 100."))?,
    };
    Ok((q.get("after").cloned(), limit))
}

pub async fn list(
    State(st): State<Arc<AppState>>,
    q: Result<Query<HashMap<String, String>>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
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
    if job.status.is_final() {
        return Err(ApiError::bad_request(format!("Job {id} has already {}.", job.status)).with_code("job_not_cancellable"));
    }
    // The runner sees the status at its next poll and stops the processes.
    if st.store.set_status(&id, JobStatus::Cancelled, None, None, None).map_err(internal)? {
        st.store.add_event(&id, "info", "Job cancelled", "message", None).map_err(internal)?;
    }
    Ok(Json(job_or_404(&st, &id)?.to_json()))
}

pub async fn events(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    q: Result<Query<HashMap<String, String>>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
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
