//! Graceful shutdown on SIGTERM and SIGINT, as a process manager (systemd, Kubernetes) expects:
//! the listener closes and requests on open connections get 503; running generations may finish
//! for `--shutdown-grace` seconds, after which streams end with an error event and `[DONE]` (and
//! waiting non-streamed requests with a 503); running fine-tuning jobs are cancelled with the
//! reason (their process groups stopped; queued jobs stay queued and run at the next start).
//! Then the process exits 0.

use std::sync::Arc;

use serde_json::json;
use tokio::sync::watch;

use super::jobs::spec::JobStatus;
use super::process::kill_group;
use super::store::Store;

/// Where the server is in its shutdown.
pub struct Shutdown {
    begun: watch::Sender<bool>,
    forced: watch::Sender<bool>,
}

impl Shutdown {
    pub fn new() -> Arc<Self> {
        Arc::new(Self { begun: watch::channel(false).0, forced: watch::channel(false).0 })
    }

    /// A signal came: no new work.
    pub fn begun(&self) -> bool {
        *self.begun.borrow()
    }

    pub fn begin(&self) {
        self.begun.send_replace(true);
    }

    /// Resolves once a signal came.
    pub async fn begun_wait(&self) {
        let mut rx = self.begun.subscribe();
        let _ = rx.wait_for(|b| *b).await;
    }

    /// The grace period is over: generations still running end now.
    pub fn force(&self) {
        self.forced.send_replace(true);
    }

    /// Resolves once the grace period is over (at once if it already is).
    pub async fn forced(&self) {
        let mut rx = self.forced.subscribe();
        let _ = rx.wait_for(|f| *f).await;
    }
}

/// Waits for SIGTERM or SIGINT; names the one that came.
pub async fn signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        // Without handlers the default action (exit) applies; never resolve.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

/// Cancels the running jobs, saying why, and stops their processes. Returns how many.
pub fn stop_jobs(store: &Store, why: &str) -> anyhow::Result<usize> {
    let running = store.running_jobs()?;
    for (id, pgid) in &running {
        // Cancelled first: the runner then takes the dying processes for a cancel, not a failure.
        let err = json!({"code": "server_shutdown", "message": format!("The server shut down ({why}) while this job was running; create a new job to train again."), "param": null});
        store.set_status(id, JobStatus::Cancelled, Some(err), None, None)?;
        store.add_event(id, "warn", &format!("Job cancelled: the server shut down ({why})"), "message", None)?;
        if let Some(pgid) = pgid {
            kill_group(*pgid);
        }
    }
    Ok(running.len())
}
