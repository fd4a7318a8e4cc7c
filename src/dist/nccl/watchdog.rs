//! What bounds a collective's time when the host does not wait for it: one communicator's
//! state shared with a thread that follows its collectives (PyTorch's NCCL watchdog). A
//! collective running past the timeout gets the communicator aborted, and every later use of
//! the group fails with that reason.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaEvent};
use candle_core::cuda_backend::cudarc::nccl::safe::Comm;

/// How often the watchdog looks: well under any collective timeout, rare enough to cost nothing.
const POLL: Duration = Duration::from_millis(100);

/// NCCL communicators hold raw pointers, so `Comm` is neither `Send` nor `Sync`. NCCL allows a
/// communicator to be used from any thread as long as calls on it are not concurrent; the
/// mutex in [`Watched`] serialises them.
pub(super) struct CommHandle(pub Comm);
unsafe impl Send for CommHandle {}

/// A collective enqueued and not yet seen complete.
struct InFlight {
    /// Recorded on the communication stream behind the collective.
    done: Arc<CudaEvent>,
    since: Instant,
    op: &'static str,
}

/// One group's communicator, its collectives in flight, and why it was aborted.
pub(super) struct Watched {
    /// `None` once aborted.
    comm: Mutex<Option<CommHandle>>,
    in_flight: Mutex<VecDeque<InFlight>>,
    failure: Mutex<Option<String>>,
    timeout: Duration,
    /// "world", "shard" or "replicate", for messages.
    pub name: &'static str,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Watched {
    /// `comm` watched by a thread of its own, which ends when the returned value is dropped.
    pub fn spawn(comm: Comm, timeout: Duration, name: &'static str, ctx: Arc<CudaContext>) -> Arc<Self> {
        let watched = Arc::new(Self {
            comm: Mutex::new(Some(CommHandle(comm))),
            in_flight: Mutex::new(VecDeque::new()),
            failure: Mutex::new(None),
            timeout,
            name,
        });
        let weak = Arc::downgrade(&watched);
        std::thread::Builder::new()
            .name(format!("nccl-watchdog-{name}"))
            .spawn(move || watch(weak, ctx))
            .expect("spawning the NCCL watchdog thread");
        watched
    }

    /// The communicator, locked for one call; an error naming `op` and why once aborted.
    pub fn comm(&self, op: &str) -> Result<MutexGuard<'_, Option<CommHandle>>> {
        let guard = lock(&self.comm);
        if guard.is_none() {
            bail!("nccl {op} on the {} group: {}", self.name, self.why_aborted());
        }
        Ok(guard)
    }

    /// Follows a collective until `done` (recorded behind it) completes.
    pub fn track(&self, done: Arc<CudaEvent>, op: &'static str) {
        lock(&self.in_flight).push_back(InFlight { done, since: Instant::now(), op });
    }

    /// Fails when the communicator was aborted: a result the host waited for may then be
    /// what an aborted collective left, not the sum or gather asked for.
    pub fn check(&self, op: &str) -> Result<()> {
        self.comm(op).map(drop)
    }

    fn why_aborted(&self) -> String {
        lock(&self.failure).clone().unwrap_or_else(|| "the communicator was aborted after an earlier failure".into())
    }

    /// Aborts the communicator (`ncclCommAbort` frees the GPU from its kernels), remembering why.
    pub fn abort(&self, why: String) {
        lock(&self.failure).get_or_insert(why);
        drop_quietly(lock(&self.comm).take());
    }

    /// Drops collectives seen complete; the oldest one still running past the timeout, if any.
    fn overdue(&self) -> Option<String> {
        let mut queue = lock(&self.in_flight);
        while let Some(front) = queue.front() {
            match front.done.try_is_complete() {
                Ok(true) => {
                    queue.pop_front();
                }
                Ok(false) if front.since.elapsed() > self.timeout => {
                    return Some(format!(
                        "{} did not complete within {:.0}s: another rank died or stopped calling collectives",
                        front.op,
                        self.timeout.as_secs_f64()
                    ))
                }
                Ok(false) => return None,
                Err(e) => return Some(format!("{}: the GPU reported {e:?}", front.op)),
            }
        }
        None
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        drop_quietly(self.comm.get_mut().unwrap_or_else(|p| p.into_inner()).take());
    }
}

fn watch(watched: Weak<Watched>, ctx: Arc<CudaContext>) {
    // Event queries act on the context current to the calling thread.
    if ctx.bind_to_thread().is_err() {
        return;
    }
    loop {
        std::thread::sleep(POLL);
        let Some(w) = watched.upgrade() else { return };
        if let Some(why) = w.overdue() {
            eprintln!("nccl watchdog, {} group: {why}; aborting the communicator", w.name);
            w.abort(why);
            return;
        }
    }
}

/// cudarc's `Comm` drop panics when ncclCommAbort fails (e.g. the driver is already tearing
/// down at exit); a failed clean-up must not turn into a panic.
pub(super) fn drop_quietly(comm: Option<CommHandle>) {
    if let Some(c) = comm {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(c)));
    }
}
