//! The runner: one queued job at a time, as `fsdp-app launch ... -- finetune --args-file FILE`
//! child processes in their own process group (so cancel stops every rank). Progress comes from
//! the run's metrics.jsonl; on success the model `ft:BASE:SUFFIX:JOBID` is served like any other.

use std::io::{BufRead, Seek};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use serde_json::json;

use super::spec::{base_learning_rate, JobStatus};
use crate::serve::checkpoints::{self, Recorder};
use crate::serve::process::{free_port, kill_group, kill_stale_job_group};
use crate::serve::state::AppState;
use crate::serve::store::{JobRow, Store};
use crate::train::finetune::FinetuneArgs;
use crate::train::metrics_row::{MetricsRow, METRICS_FILE};

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
                        let _ = st.store.set_status(&job.id, JobStatus::Failed, Some(err), None, None);
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
/// their training processes. Returns how many jobs failed so.
pub fn recover(store: &Store) -> anyhow::Result<usize> {
    let groups = store.recover()?;
    for pgid in &groups {
        kill_stale_job_group(*pgid);
    }
    Ok(groups.len())
}

/// The model id a succeeded job's model is served as (OpenAI's spelling).
pub fn fine_tuned_model_id(base_id: &str, job: &JobRow) -> String {
    format!("ft:{}:{}:{}", base_id, job.suffix.as_deref().unwrap_or(""), job.id)
}

/// A job's fine-tuning settings: the `finetune` defaults with what the job asks for. The child
/// reads them from a file (`finetune --args-file`), so no flag is spelled twice.
/// `base_source`: what the server serves (a Hub id, or a local directory's absolute path);
/// `data`: a file id's path; `on_gpu`: the server computes on a GPU.
pub fn finetune_args(job: &JobRow, base_source: &str, data: &dyn Fn(&str) -> std::path::PathBuf, on_gpu: bool) -> FinetuneArgs {
    let (h, e) = (&job.hyperparameters, &job.extensions);
    let world = e.world_size.max(1);
    let mut a = FinetuneArgs::defaults();
    a.model = Some(base_source.to_string());
    a.data = Some(data(&job.training_file));
    a.eval_data = job.validation_file.as_deref().map(data);
    a.output_dir = Some(job.output_dir.clone().into());
    a.epochs = h.n_epochs as usize;
    a.batch_size = h.batch_size.max(1).div_ceil(world).max(1) as usize;
    a.seed = job.seed as u64;
    a.seq_len = Some(e.seq_len as usize);
    a.lr_scheduler = "linear".into();
    a.max_steps = e.max_steps.map(|s| s as usize);
    // A checkpoint at every epoch's end, the newest few kept, as OpenAI's jobs make them.
    a.save_strategy = Some("epoch".into());
    a.save_total_limit = Some(checkpoints::KEEP);
    a.lr = base_learning_rate(e.lora.is_some()) * h.learning_rate_multiplier;
    if let Some(beta) = h.beta {
        a.method = "dpo".into();
        a.dpo_beta = Some(beta);
    }
    if let Some(g) = h.num_generations() {
        // OpenAI's batch_size counts prompts here, each sampled num_generations times.
        a.method = "grpo".into();
        a.grpo.num_generations = Some(g);
        a.grpo.grader = Some(grader_path(job));
        // Unless told, a prompt may take half the rows and the completion the other half.
        a.grpo.max_completion_length = Some(e.max_completion_length.map_or((e.seq_len as usize / 2).max(1), |n| n as usize));
        a.eval_steps = h.eval_interval.map(|n| n as usize);
        a.grpo.num_generations_eval = h.eval_samples.map(|n| n as usize);
    }
    if let Some(l) = &e.lora {
        a.lora.lora_r = Some(l.r as usize);
        a.lora.lora_alpha = Some(l.alpha);
        a.lora.lora_dropout = Some(l.dropout);
        a.lora.lora_targets = Some(l.targets.join(","));
        // The adapter is served over the base (multi-LoRA); a merged copy only when asked for.
        a.merge_lora = e.merge;
    }
    // Jobs train where the server computes: on a GPU server each rank takes its LOCAL_RANK GPU,
    // in bf16 with fp32 master weights.
    if on_gpu {
        a.device = "cuda".into();
        a.param_dtype = "bf16".into();
    }
    a
}

/// Where a reinforcement job's grader is written for its child (next to its settings).
fn grader_path(job: &JobRow) -> std::path::PathBuf {
    Path::new(&job.output_dir).with_extension("grader.json")
}

/// The `fsdp-app launch ... -- finetune --args-file FILE` command line of a job, after writing
/// its settings to FILE (next to the job's log), and a reinforcement job's grader and the
/// server's chat template beside them.
fn command_line(st: &AppState, job: &JobRow) -> anyhow::Result<Vec<String>> {
    if let Some(g) = &job.hyperparameters.grader {
        write_whole(&grader_path(job), &serde_json::to_vec_pretty(g)?)?;
    }
    let settings = Path::new(&job.output_dir).with_extension("args.json");
    let on_gpu = !st.load.placement.device.is_cpu();
    let mut args = finetune_args(job, &st.base_source, &|id| st.store.file_path(id), on_gpu);
    // The server's --chat-template: the job trains with the template its model is served with.
    if let Some(template) = &st.load.chat_template {
        let path = Path::new(&job.output_dir).with_extension("chat_template.jinja");
        write_whole(&path, template.as_bytes())?;
        args.chat_template = Some(path.to_string_lossy().to_string());
    }
    args.write_file(&settings)?;
    let world = job.extensions.world_size.max(1).to_string();
    let port = free_port().to_string();
    let settings = settings.to_string_lossy().to_string();
    Ok(["launch", "--nproc-per-node", &world, "--master-port", &port, "--", "finetune", "--args-file", &settings]
        .map(String::from)
        .to_vec())
}

/// Writes a file the job's child reads: under a temporary name, then renamed, so the child never
/// reads half of it.
fn write_whole(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Rows of metrics.jsonl added since `offset`.
fn new_metric_rows(path: &Path, offset: &mut u64) -> Vec<MetricsRow> {
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
        rows.extend(MetricsRow::parse(&line));
        line.clear();
    }
    rows
}

fn run_job(st: &AppState, job: &JobRow) -> anyhow::Result<()> {
    let store = &st.store;
    if !store.set_status(&job.id, JobStatus::Running, None, None, None)? {
        return Ok(()); // cancelled before it started
    }
    store.add_event(&job.id, "info", "Fine-tuning job started", "message", None)?;
    let log_path = Path::new(&job.output_dir).with_extension("log");
    let log = std::fs::File::create(&log_path)?;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(command_line(st, job)?).stdout(log.try_clone()?).stderr(log).stdin(std::process::Stdio::null());
    // The job shares the cores with this server's requests: its idle threads must not spin.
    crate::process::child_shares_cores(&mut cmd);
    // Its own process group: cancel stops the launcher and every rank at once.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn()?;
    let pgid = child.id();
    store.set_pgid(&job.id, pgid)?;
    let metrics = Path::new(&job.output_dir).join(METRICS_FILE);
    let model = fine_tuned_model_id(&st.base_id, job);
    let mut checkpoints = Recorder::new(&job.id, Path::new(&job.output_dir), &model);
    let (mut offset, mut last_step, mut trained_tokens) = (0u64, 0i64, 0u64);
    let status = loop {
        for row in new_metric_rows(&metrics, &mut offset) {
            let step = row.step() as i64;
            match row {
                MetricsRow::Step(r) => {
                    trained_tokens += r.tokens;
                    last_step = step;
                    checkpoints.saw(step, "train_loss", r.loss);
                    let mut data = json!({"step": step, "train_loss": r.loss, "learning_rate": r.lr, "tokens_per_s": r.tokens_per_s});
                    let mut message = format!("Step {step}: training loss={:.4}", r.loss);
                    // A reinforcement job's mean reward, the number its user watches.
                    if let Some(reward) = r.preference.get("reward") {
                        data["reward"] = json!(reward);
                        message += &format!(", mean reward={reward:.4}");
                    }
                    store.add_event(&job.id, "info", &message, "metrics", Some(data))?;
                }
                MetricsRow::Eval(r) => {
                    checkpoints.saw(step, "valid_loss", r.eval_loss);
                    let mut data = json!({"step": step, "valid_loss": r.eval_loss});
                    let mut message = format!("Step {step}: validation loss={:.4}", r.eval_loss);
                    if let Some(reward) = r.preference.get("eval_reward") {
                        data["valid_reward"] = json!(reward);
                        message += &format!(", validation mean reward={reward:.4}");
                    }
                    store.add_event(&job.id, "info", &message, "metrics", Some(data))?;
                }
            }
        }
        checkpoints.sync(store)?;
        if store.job(&job.id)?.is_some_and(|j| j.status == JobStatus::Cancelled) {
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
        let error = json!({"code": "training_failed", "message": message, "param": null});
        store.set_status(&job.id, JobStatus::Failed, Some(error), None, None)?;
        store.add_event(&job.id, "error", &format!("Training failed: {message}"), "message", None)?;
        return Ok(());
    }
    checkpoints.finish(store, last_step)?;
    if store.set_status(&job.id, JobStatus::Succeeded, None, Some(&model), Some(trained_tokens as i64))? {
        store.add_event(&job.id, "info", &format!("New fine-tuned model created: {model}"), "message", None)?;
        store.add_event(&job.id, "info", "The job has successfully completed", "message", None)?;
    }
    Ok(())
}

/// Why a training run failed, from its log: the first error a rank reported (`error: ...`), not
/// the launcher's summary that follows it ("the job failed: rank 0 exited with code 1") nor a
/// backtrace frame; the summary when it is all there is.
fn failure_cause(log: &str) -> Option<String> {
    let errors: Vec<&str> = log.lines().filter_map(|l| l.strip_prefix("error: ")).map(str::trim).filter(|l| !l.is_empty()).collect();
    errors.iter().find(|l| !l.starts_with("the job failed:")).or(errors.last()).map(|l| l.to_string())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::serve::jobs::spec::{Hyperparameters, JobExtensions, JobLora};

    /// The `finetune` settings of a job that asks for LoRA and sets nothing else.
    pub(crate) fn job_args_with_default_lora() -> FinetuneArgs {
        let job = JobRow {
            id: "ftjob-1".into(),
            model: "m".into(),
            training_file: "file-1".into(),
            validation_file: None,
            hyperparameters: Hyperparameters::default(),
            extensions: JobExtensions { lora: Some(JobLora::default()), ..JobExtensions::defaults(512) },
            suffix: None,
            seed: 42,
            status: JobStatus::Queued,
            created_at: 0,
            finished_at: None,
            fine_tuned_model: None,
            error: None,
            trained_tokens: None,
            output_dir: "out".into(),
        };
        finetune_args(&job, "m", &|id| std::path::PathBuf::from(format!("{id}.jsonl")), false)
    }

    #[test]
    fn a_failed_job_names_the_ranks_first_error_not_the_launcher_nor_a_backtrace() {
        let log = "data: 2 rows\nerror: d.jsonl: no token is trained on (every label is masked)\n\nStack backtrace:\n   0: anyhow::error::<impl anyhow::Error>::msg\n             at src/error.rs:1:1\nlaunch: peak RSS per rank\nerror: the job failed: rank 0 exited with code 1\n\nStack backtrace:\n   0: main\n";
        assert_eq!(failure_cause(log).unwrap(), "d.jsonl: no token is trained on (every label is masked)");
        assert_eq!(
            failure_cause("error: the job failed: rank 1 was killed by signal 9\n").unwrap(),
            "the job failed: rank 1 was killed by signal 9"
        );
        assert_eq!(failure_cause("no errors here\n"), None);
    }
}
