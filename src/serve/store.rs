//! Files and fine-tuning jobs, persisted in SQLite (embedded: no server to run) under the
//! server's data directory. File contents live next to the database under names the server
//! picks (`files/<id>.jsonl`); no request field is ever used as a path.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result};
use rusqlite::{params, Connection, OptionalExtension};
use serde_json::{json, Value};

use super::ids::{new_id, now_s};
use super::jobs::spec::{Hyperparameters, JobExtensions, JobStatus};

pub struct Store {
    conn: Mutex<Connection>,
    dir: PathBuf,
}

/// A job as the runner needs it.
#[derive(Debug, Clone)]
pub struct JobRow {
    pub id: String,
    pub model: String,
    pub training_file: String,
    pub validation_file: Option<String>,
    pub hyperparameters: Hyperparameters,
    pub extensions: JobExtensions,
    pub suffix: Option<String>,
    pub seed: i64,
    pub status: JobStatus,
    pub created_at: i64,
    pub finished_at: Option<i64>,
    pub fine_tuned_model: Option<String>,
    pub error: Option<Value>,
    pub trained_tokens: Option<i64>,
    pub output_dir: String,
}

impl JobRow {
    /// OpenAI's `fine_tuning.job` object.
    pub fn to_json(&self) -> Value {
        let mut hyperparameters = json!(self.hyperparameters);
        let kind = self.hyperparameters.method_type();
        let mut method = json!({"type": kind});
        method[kind] = json!({});
        if let Some(grader) = hyperparameters.as_object_mut().and_then(|h| h.remove("grader")) {
            method[kind]["grader"] = grader;
        }
        method[kind]["hyperparameters"] = hyperparameters.clone();
        json!({
            "id": self.id, "object": "fine_tuning.job", "model": self.model, "created_at": self.created_at,
            "finished_at": self.finished_at, "fine_tuned_model": self.fine_tuned_model, "organization_id": "org-fsdp-app",
            "result_files": [], "status": self.status.as_str(), "training_file": self.training_file,
            "validation_file": self.validation_file, "hyperparameters": hyperparameters,
            "trained_tokens": self.trained_tokens, "error": self.error, "seed": self.seed, "suffix": self.suffix,
            "estimated_finish": null, "integrations": [], "metadata": null,
            "method": method,
            "fsdp_app": self.extensions,
        })
    }
}

const JOB_COLUMNS: &str = "id, model, training_file, validation_file, hyperparameters, extensions, suffix, seed, status, created_at, \
                           finished_at, fine_tuned_model, error, trained_tokens, output_dir";

/// A JSON text column as `T`.
fn json_column<T: serde::de::DeserializeOwned>(r: &rusqlite::Row, i: usize) -> rusqlite::Result<T> {
    let text: String = r.get(i)?;
    serde_json::from_str(&text).map_err(|e| rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, Box::new(e)))
}

fn job_from_row(r: &rusqlite::Row) -> rusqlite::Result<JobRow> {
    let parse = |s: Option<String>| s.and_then(|s| serde_json::from_str(&s).ok());
    let status: String = r.get(8)?;
    let status = JobStatus::parse(&status)
        .ok_or_else(|| rusqlite::Error::InvalidColumnType(8, format!("status {status:?}"), rusqlite::types::Type::Text))?;
    Ok(JobRow {
        id: r.get(0)?,
        model: r.get(1)?,
        training_file: r.get(2)?,
        validation_file: r.get(3)?,
        hyperparameters: json_column(r, 4)?,
        extensions: json_column(r, 5)?,
        suffix: r.get(6)?,
        seed: r.get(7)?,
        status,
        created_at: r.get(9)?,
        finished_at: r.get(10)?,
        fine_tuned_model: r.get(11)?,
        error: parse(r.get(12)?),
        trained_tokens: r.get(13)?,
        output_dir: r.get(14)?,
    })
}

/// What a create request asks for, validated by the route.
#[derive(PartialEq)]
pub struct NewJob {
    pub model: String,
    pub training_file: String,
    pub validation_file: Option<String>,
    pub hyperparameters: Hyperparameters,
    pub extensions: JobExtensions,
    pub suffix: Option<String>,
    pub seed: i64,
}

/// What a create with an `Idempotency-Key` came to.
pub enum CreatedJob {
    New(JobRow),
    /// A retry: the key's job, created with the same settings.
    Existing(JobRow),
    /// The key was used for a job with other settings.
    KeyReused(JobRow),
}

impl Store {
    pub fn open(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir.join("files")).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::create_dir_all(dir.join("jobs"))?;
        let conn = Connection::open(dir.join("serve.db")).with_context(|| format!("opening {}", dir.join("serve.db").display()))?;
        conn.execute_batch(
            "PRAGMA journal_mode = WAL;
             CREATE TABLE IF NOT EXISTS files (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, filename TEXT NOT NULL,
                 purpose TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, model TEXT NOT NULL,
                 training_file TEXT NOT NULL, validation_file TEXT, hyperparameters TEXT NOT NULL, extensions TEXT NOT NULL,
                 suffix TEXT, seed INTEGER NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL, finished_at INTEGER,
                 fine_tuned_model TEXT, error TEXT, trained_tokens INTEGER, output_dir TEXT NOT NULL, idempotency_key TEXT UNIQUE,
                 pgid INTEGER);
             CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, job_id TEXT NOT NULL,
                 created_at INTEGER NOT NULL, level TEXT NOT NULL, message TEXT NOT NULL, type TEXT NOT NULL, data TEXT);
             CREATE TABLE IF NOT EXISTS checkpoints (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, job_id TEXT NOT NULL,
                 created_at INTEGER NOT NULL, step INTEGER NOT NULL, metrics TEXT NOT NULL, model TEXT NOT NULL);",
        )
        .context("creating the tables")?;
        Ok(Self { conn: Mutex::new(conn), dir: dir.to_path_buf() })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn db(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    // ---- files ----

    /// Server-chosen path of a file's contents.
    pub fn file_path(&self, id: &str) -> PathBuf {
        self.dir.join("files").join(format!("{id}.jsonl"))
    }

    /// A fresh temporary path in the files directory, for an upload being received.
    pub fn upload_path(&self) -> PathBuf {
        self.dir.join("files").join(format!("{}.upload", new_id("tmp")))
    }

    /// Records an upload received (and validated) at `staged` (from [`Store::upload_path`]):
    /// renamed to its server-chosen name, then recorded.
    pub fn add_file(&self, filename: &str, purpose: &str, staged: &Path, bytes: u64) -> Result<Value> {
        let id = new_id("file");
        std::fs::rename(staged, self.file_path(&id)).with_context(|| format!("storing {}", staged.display()))?;
        let created = now_s();
        self.db().execute(
            "INSERT INTO files (id, filename, purpose, bytes, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![id, filename, purpose, bytes as i64, created],
        )?;
        Ok(file_json(&id, filename, purpose, bytes as i64, created))
    }

    pub fn file(&self, id: &str) -> Result<Option<Value>> {
        Ok(self
            .db()
            .query_row("SELECT id, filename, purpose, bytes, created_at FROM files WHERE id = ?1", [id], |r| {
                Ok(file_json(&r.get::<_, String>(0)?, &r.get::<_, String>(1)?, &r.get::<_, String>(2)?, r.get(3)?, r.get(4)?))
            })
            .optional()?)
    }

    pub fn files(&self) -> Result<Vec<Value>> {
        let db = self.db();
        let mut st = db.prepare("SELECT id, filename, purpose, bytes, created_at FROM files ORDER BY seq DESC")?;
        let rows = st.query_map([], |r| {
            Ok(file_json(&r.get::<_, String>(0)?, &r.get::<_, String>(1)?, &r.get::<_, String>(2)?, r.get(3)?, r.get(4)?))
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    pub fn delete_file(&self, id: &str) -> Result<bool> {
        let n = self.db().execute("DELETE FROM files WHERE id = ?1", [id])?;
        if n > 0 {
            let _ = std::fs::remove_file(self.file_path(id));
        }
        Ok(n > 0)
    }

    // ---- jobs ----

    /// Creates a queued job, or returns the job an earlier request with the same
    /// `Idempotency-Key` and the same settings created.
    pub fn create_job(&self, job: NewJob, idempotency_key: Option<&str>) -> Result<CreatedJob> {
        if let Some(key) = idempotency_key {
            let existing: Option<String> =
                self.db().query_row("SELECT id FROM jobs WHERE idempotency_key = ?1", [key], |r| r.get(0)).optional()?;
            if let Some(id) = existing {
                let row = self.job(&id)?.context("job vanished")?;
                let same = NewJob {
                    model: row.model.clone(),
                    training_file: row.training_file.clone(),
                    validation_file: row.validation_file.clone(),
                    hyperparameters: row.hyperparameters.clone(),
                    extensions: row.extensions.clone(),
                    suffix: row.suffix.clone(),
                    seed: row.seed,
                } == job;
                return Ok(if same { CreatedJob::Existing(row) } else { CreatedJob::KeyReused(row) });
            }
        }
        let id = new_id("ftjob");
        let out = self.dir.join("jobs").join(&id);
        self.db().execute(
            "INSERT INTO jobs (id, model, training_file, validation_file, hyperparameters, extensions, suffix, seed, status, created_at, output_dir, idempotency_key)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
            params![id, job.model, job.training_file, job.validation_file, serde_json::to_string(&job.hyperparameters)?, serde_json::to_string(&job.extensions)?,
                    job.suffix, job.seed, JobStatus::Queued.as_str(), now_s(), out.to_string_lossy(), idempotency_key],
        )?;
        self.add_event(&id, "info", "Created fine-tuning job", "message", None)?;
        Ok(CreatedJob::New(self.job(&id)?.context("job vanished")?))
    }

    pub fn job(&self, id: &str) -> Result<Option<JobRow>> {
        Ok(self.db().query_row(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?1"), [id], job_from_row).optional()?)
    }

    /// Newest first, after the job `after` (its id), at most `limit`; and whether more follow.
    pub fn jobs(&self, after: Option<&str>, limit: usize) -> Result<(Vec<JobRow>, bool)> {
        let db = self.db();
        let before_seq: i64 = match after {
            Some(a) => db.query_row("SELECT seq FROM jobs WHERE id = ?1", [a], |r| r.get(0)).optional()?.unwrap_or(i64::MAX),
            None => i64::MAX,
        };
        let mut st = db.prepare(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE seq < ?1 ORDER BY seq DESC LIMIT ?2"))?;
        let mut rows: Vec<JobRow> = st.query_map(params![before_seq, limit as i64 + 1], job_from_row)?.collect::<rusqlite::Result<_>>()?;
        let more = rows.len() > limit;
        rows.truncate(limit);
        Ok((rows, more))
    }

    /// The oldest queued job.
    pub fn next_queued(&self) -> Result<Option<JobRow>> {
        let sql = format!("SELECT {JOB_COLUMNS} FROM jobs WHERE status = ?1 ORDER BY seq LIMIT 1");
        Ok(self.db().query_row(&sql, [JobStatus::Queued.as_str()], job_from_row).optional()?)
    }

    /// Moves a job to `status`; final states get `finished_at`. Returns false when the job was
    /// already final (a cancel racing the runner keeps the first final state).
    pub fn set_status(
        &self,
        id: &str,
        status: JobStatus,
        error: Option<Value>,
        fine_tuned_model: Option<&str>,
        trained_tokens: Option<i64>,
    ) -> Result<bool> {
        let finished = status.is_final().then(now_s);
        let sql = format!(
            "UPDATE jobs SET status = ?2, error = COALESCE(?3, error), fine_tuned_model = COALESCE(?4, fine_tuned_model),
                 trained_tokens = COALESCE(?5, trained_tokens), finished_at = COALESCE(?6, finished_at)
             WHERE id = ?1 AND status NOT IN ({})",
            JobStatus::sql_list(&JobStatus::FINAL)
        );
        let n = self
            .db()
            .execute(&sql, params![id, status.as_str(), error.map(|e| e.to_string()), fine_tuned_model, trained_tokens, finished])?;
        Ok(n > 0)
    }

    /// Records the process group of a job's training processes (to stop them after a crash).
    pub fn set_pgid(&self, id: &str, pgid: u32) -> Result<()> {
        self.db().execute("UPDATE jobs SET pgid = ?2 WHERE id = ?1", params![id, pgid as i64])?;
        Ok(())
    }

    /// The jobs running now, with their process groups.
    pub fn running_jobs(&self) -> Result<Vec<(String, Option<u32>)>> {
        let db = self.db();
        let mut st = db.prepare(&format!("SELECT id, pgid FROM jobs WHERE status IN ({})", JobStatus::sql_list(&JobStatus::ACTIVE)))?;
        let rows = st
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, Option<i64>>(1)?.map(|p| p as u32))))?
            .collect::<rusqlite::Result<_>>()?;
        Ok(rows)
    }

    /// At start-up: a job that was running when the server stopped is marked failed; queued
    /// jobs stay queued and run. Returns the process groups those jobs ran in, for the jobs
    /// runner to stop (they outlive a killed server).
    pub fn recover(&self) -> Result<Vec<u32>> {
        let jobs = self.running_jobs()?;
        for (id, _) in &jobs {
            let err = json!({"code": "server_restarted", "message": "The server stopped while this job was running; create a new job to train again.", "param": null});
            self.set_status(id, JobStatus::Failed, Some(err), None, None)?;
            self.add_event(id, "error", "The server stopped while this job was running", "message", None)?;
        }
        Ok(jobs.into_iter().filter_map(|(_, pgid)| pgid).collect())
    }

    // ---- events and checkpoints ----

    pub fn add_event(&self, job: &str, level: &str, message: &str, kind: &str, data: Option<Value>) -> Result<()> {
        self.db().execute(
            "INSERT INTO events (id, job_id, created_at, level, message, type, data) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![new_id("ftevent"), job, now_s(), level, message, kind, data.map(|d| d.to_string())],
        )?;
        Ok(())
    }

    /// Newest first, like OpenAI's list_events.
    pub fn events(&self, job: &str, after: Option<&str>, limit: usize) -> Result<(Vec<Value>, bool)> {
        let db = self.db();
        let before_seq: i64 = match after {
            Some(a) => db.query_row("SELECT seq FROM events WHERE id = ?1", [a], |r| r.get(0)).optional()?.unwrap_or(i64::MAX),
            None => i64::MAX,
        };
        let mut st = db.prepare(
            "SELECT id, created_at, level, message, type, data FROM events WHERE job_id = ?1 AND seq < ?2 ORDER BY seq DESC LIMIT ?3",
        )?;
        let mut rows: Vec<Value> = st
            .query_map(params![job, before_seq, limit as i64 + 1], |r| {
                let data: Option<String> = r.get(5)?;
                Ok(json!({
                    "object": "fine_tuning.job.event", "id": r.get::<_, String>(0)?, "created_at": r.get::<_, i64>(1)?,
                    "level": r.get::<_, String>(2)?, "message": r.get::<_, String>(3)?, "type": r.get::<_, String>(4)?,
                    "data": data.and_then(|d| serde_json::from_str::<Value>(&d).ok()).unwrap_or(json!({})),
                }))
            })?
            .collect::<rusqlite::Result<_>>()?;
        let more = rows.len() > limit;
        rows.truncate(limit);
        Ok((rows, more))
    }

    pub fn add_checkpoint(&self, job: &str, step: i64, metrics: Value, model: &str) -> Result<()> {
        self.db().execute(
            "INSERT INTO checkpoints (id, job_id, created_at, step, metrics, model) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![new_id("ftckpt"), job, now_s(), step, metrics.to_string(), model],
        )?;
        Ok(())
    }

    pub fn checkpoints(&self, job: &str) -> Result<Vec<Value>> {
        let db = self.db();
        let mut st = db.prepare("SELECT id, created_at, step, metrics, model FROM checkpoints WHERE job_id = ?1 ORDER BY seq DESC")?;
        let rows = st.query_map([job], |r| {
            let metrics: String = r.get(3)?;
            Ok(json!({
                "object": "fine_tuning.job.checkpoint", "id": r.get::<_, String>(0)?, "created_at": r.get::<_, i64>(1)?,
                "step_number": r.get::<_, i64>(2)?, "metrics": serde_json::from_str::<Value>(&metrics).unwrap_or(json!({})),
                "fine_tuned_model_checkpoint": r.get::<_, String>(4)?, "fine_tuning_job_id": job,
            }))
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The steps of `job`'s recorded checkpoints.
    pub fn checkpoint_steps(&self, job: &str) -> Result<Vec<i64>> {
        let db = self.db();
        let mut st = db.prepare("SELECT step FROM checkpoints WHERE job_id = ?1 ORDER BY step")?;
        let rows = st.query_map([job], |r| r.get(0))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    pub fn delete_checkpoint(&self, job: &str, step: i64) -> Result<()> {
        self.db().execute("DELETE FROM checkpoints WHERE job_id = ?1 AND step = ?2", params![job, step])?;
        Ok(())
    }

    /// The checkpoint whose `fine_tuned_model_checkpoint` is `id`: (its job, its step).
    pub fn checkpoint_of_model(&self, id: &str) -> Result<Option<(String, i64)>> {
        Ok(self.db().query_row("SELECT job_id, step FROM checkpoints WHERE model = ?1", [id], |r| Ok((r.get(0)?, r.get(1)?))).optional()?)
    }

    /// Forgets fine-tuned model `id` (its job keeps its record, `fine_tuned_model` null) and
    /// returns the job's output directory, for the caller to delete. None: no such model.
    pub fn delete_fine_tuned_model(&self, id: &str) -> Result<Option<PathBuf>> {
        let db = self.db();
        let dir: Option<String> = db
            .query_row(
                "SELECT output_dir FROM jobs WHERE status = ?2 AND fine_tuned_model = ?1",
                params![id, JobStatus::Succeeded.as_str()],
                |r| r.get(0),
            )
            .optional()?;
        if dir.is_some() {
            // Its checkpoints live in the same directory: they go with it.
            db.execute("DELETE FROM checkpoints WHERE job_id = (SELECT id FROM jobs WHERE fine_tuned_model = ?1)", params![id])?;
            db.execute("UPDATE jobs SET fine_tuned_model = NULL WHERE fine_tuned_model = ?1", params![id])?;
        }
        Ok(dir.map(PathBuf::from))
    }

    /// Succeeded jobs' models: (model id, its directory).
    pub fn fine_tuned_models(&self) -> Result<Vec<(String, PathBuf)>> {
        let db = self.db();
        let mut st = db.prepare(
            "SELECT fine_tuned_model, output_dir, extensions FROM jobs WHERE status = ?1 AND fine_tuned_model IS NOT NULL ORDER BY seq",
        )?;
        let rows = st.query_map([JobStatus::Succeeded.as_str()], |r| {
            let dir: String = r.get(1)?;
            let ext: JobExtensions = json_column(r, 2)?;
            Ok((r.get::<_, String>(0)?, final_model_dir(Path::new(&dir), &ext)))
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }
}

/// Where a succeeded job's model is: its output directory (for LoRA, its adapter), or the merged
/// model in it when a LoRA job asked for one.
pub fn final_model_dir(output_dir: &Path, extensions: &JobExtensions) -> PathBuf {
    // A LoRA job's output directory is its PEFT adapter (served over the base); `merged` beside
    // it when the job asked for a merged copy.
    if extensions.lora.is_some() && extensions.merge {
        output_dir.join("merged")
    } else {
        output_dir.to_path_buf()
    }
}

fn file_json(id: &str, filename: &str, purpose: &str, bytes: i64, created: i64) -> Value {
    json!({"id": id, "object": "file", "bytes": bytes, "created_at": created, "filename": filename, "purpose": purpose, "status": "processed", "expires_at": null})
}
