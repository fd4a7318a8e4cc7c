//! Collectives on a thread of their own, for the backends that run a collective on the thread
//! that calls it (local, tcp, mpi): a started all-gather or reduce-scatter then runs while the
//! rank computes (FSDP2's prefetch, on CPU clusters and for ranks sharing a GPU over tcp).
//!
//! A rank's three groups share the one thread, and every call keeps the order the rank made it
//! in: a started collective queues behind those started before; a call that returns its result
//! waits until the thread has finished everything queued, then runs on the caller's thread with
//! nothing started in between. So the ranks still meet in the same collectives in the same
//! order. Tensors go to and from host memory on the caller's thread (a GPU orders work by the
//! thread that issues it).

use std::sync::{mpsc, Arc, Mutex, MutexGuard};

use anyhow::{anyhow, Result};
use candle_core::Tensor;

use super::{host_f32, to_device, Collective, Pending, PendingTensor, ProcessGroups};

/// `groups` with their collectives on a thread of their own (one for the three).
pub fn overlapped(groups: ProcessGroups) -> ProcessGroups {
    let worker = Worker::spawn();
    let wrap = |inner: Arc<dyn Collective>| -> Arc<dyn Collective> { Arc::new(Overlapped { inner, worker: worker.clone() }) };
    ProcessGroups { world: wrap(groups.world), shard: wrap(groups.shard), replicate: wrap(groups.replicate) }
}

type Job = Box<dyn FnOnce() + Send>;

/// The thread collectives run on, and the one order calls are made in.
struct Worker {
    /// Held while a call is queued, or runs on the caller's thread.
    jobs: Mutex<mpsc::Sender<Job>>,
}

fn ended() -> anyhow::Error {
    anyhow!("the collectives' thread ended (a collective on it panicked)")
}

impl Worker {
    fn spawn() -> Arc<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("collectives".into())
            .spawn(move || rx.into_iter().for_each(|job| job()))
            .expect("spawning the collectives' thread");
        Arc::new(Self { jobs: Mutex::new(tx) })
    }

    fn lock(&self) -> MutexGuard<'_, mpsc::Sender<Job>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `work` behind what was started before.
    fn start<T: Send + 'static>(&self, work: impl FnOnce() -> Result<T> + Send + 'static) -> Result<Pending<T>> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.lock()
            .send(Box::new(move || {
                let _ = tx.send(work());
            }))
            .map_err(|_| ended())?;
        Ok(Pending::running(Box::new(move || rx.recv().map_err(|_| ended())?)))
    }

    /// Runs `work` on the caller's thread once everything started before has finished.
    fn call<T>(&self, work: impl FnOnce() -> Result<T>) -> Result<T> {
        let jobs = self.lock();
        let (tx, rx) = mpsc::sync_channel(1);
        jobs.send(Box::new(move || {
            let _ = tx.send(());
        }))
        .map_err(|_| ended())?;
        rx.recv().map_err(|_| ended())?;
        work()
    }
}

/// One group whose collectives go through its rank's [`Worker`].
struct Overlapped {
    inner: Arc<dyn Collective>,
    worker: Arc<Worker>,
}

impl Overlapped {
    /// Starts `op` over `t`'s values in host memory, its result coming back as a tensor like
    /// `t` (what the backends' tensor collectives do, with the collective itself queued).
    fn start_tensor(&self, t: &Tensor, op: fn(&dyn Collective, Vec<f32>) -> Result<Vec<f32>>) -> Result<PendingTensor> {
        let values = host_f32(t)?;
        let (dtype, device) = (t.dtype(), t.device().clone());
        let inner = self.inner.clone();
        let started = self.worker.start(move || op(inner.as_ref(), values))?;
        Ok(Pending::running(Box::new(move || to_device(started.wait()?, dtype, &device))))
    }
}

fn all_gather_owned(c: &dyn Collective, v: Vec<f32>) -> Result<Vec<f32>> {
    c.all_gather_owned(v)
}

fn reduce_scatter_owned(c: &dyn Collective, v: Vec<f32>) -> Result<Vec<f32>> {
    c.reduce_scatter_owned(v)
}

impl Collective for Overlapped {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_gather(&self, shard: &[f32]) -> Result<Vec<f32>> {
        self.worker.call(|| self.inner.all_gather(shard))
    }

    fn reduce_scatter(&self, full: &[f32]) -> Result<Vec<f32>> {
        self.worker.call(|| self.inner.reduce_scatter(full))
    }

    fn all_gather_owned(&self, shard: Vec<f32>) -> Result<Vec<f32>> {
        self.worker.call(|| self.inner.all_gather_owned(shard))
    }

    fn reduce_scatter_owned(&self, full: Vec<f32>) -> Result<Vec<f32>> {
        self.worker.call(|| self.inner.reduce_scatter_owned(full))
    }

    fn all_reduce(&self, data: &mut [f32]) -> Result<()> {
        self.worker.call(|| self.inner.all_reduce(data))
    }

    fn all_reduce_f64(&self, data: &mut [f64]) -> Result<()> {
        self.worker.call(|| self.inner.all_reduce_f64(data))
    }

    fn scatter(&self, root: usize, chunks: Option<Vec<Vec<f32>>>) -> Result<Vec<f32>> {
        self.worker.call(|| self.inner.scatter(root, chunks))
    }

    fn broadcast_bytes(&self, root: usize, bytes: Option<Vec<u8>>) -> Result<Vec<u8>> {
        self.worker.call(|| self.inner.broadcast_bytes(root, bytes))
    }

    fn all_gather_bytes(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        self.worker.call(|| self.inner.all_gather_bytes(bytes))
    }

    fn barrier(&self) -> Result<()> {
        self.worker.call(|| self.inner.barrier())
    }

    /// At once, not behind the queue: the collective in flight may be the one that waits.
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }

    fn all_gather_tensor(&self, shard: &Tensor) -> Result<Tensor> {
        self.worker.call(|| self.inner.all_gather_tensor(shard))
    }

    fn reduce_scatter_tensor(&self, full: &Tensor) -> Result<Tensor> {
        self.worker.call(|| self.inner.reduce_scatter_tensor(full))
    }

    fn all_reduce_tensor(&self, data: &Tensor) -> Result<Tensor> {
        self.worker.call(|| self.inner.all_reduce_tensor(data))
    }

    // Alone, the tensor collectives return the tensor itself: nothing to start.
    fn start_all_gather_tensor(&self, shard: &Tensor) -> Result<PendingTensor> {
        match self.world_size() {
            1 => Ok(Pending::ready(self.all_gather_tensor(shard)?)),
            _ => self.start_tensor(shard, all_gather_owned),
        }
    }

    fn start_reduce_scatter_tensor(&self, full: &Tensor) -> Result<PendingTensor> {
        match self.world_size() {
            1 => Ok(Pending::ready(self.reduce_scatter_tensor(full)?)),
            _ => self.start_tensor(full, reduce_scatter_owned),
        }
    }

    fn start_all_gather_owned(&self, shard: Vec<f32>) -> Result<Pending<Vec<f32>>> {
        let inner = self.inner.clone();
        self.worker.start(move || inner.all_gather_owned(shard))
    }

    fn start_reduce_scatter_owned(&self, full: Vec<f32>) -> Result<Pending<Vec<f32>>> {
        let inner = self.inner.clone();
        self.worker.start(move || inner.reduce_scatter_owned(full))
    }

    fn overlaps_compute(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::dist::local::create_process_groups;

    /// A started collective returns at once, before the other rank has joined, and runs on the
    /// collectives' thread; a call made after it waits for it, so both ranks meet in the same
    /// collectives in the same order.
    #[test]
    fn started_collectives_run_beside_the_caller_and_keep_their_order() {
        let mut ranks = create_process_groups(2, 2, Duration::from_secs(20)).into_iter().map(overlapped);
        let (rank0, rank1) = (ranks.next().unwrap(), ranks.next().unwrap());
        assert!(rank0.shard.overlaps_compute());
        let first = std::thread::spawn(move || {
            let t = Instant::now();
            let gathered = rank0.shard.start_all_gather_owned(vec![1.0, 2.0]).unwrap();
            let started_in = t.elapsed();
            let reduced = rank0.shard.reduce_scatter(&[1.0, 2.0, 3.0, 4.0]).unwrap();
            (started_in, gathered.wait().unwrap(), reduced)
        });
        // Rank 1 joins late: rank 0's start must not have waited for it.
        std::thread::sleep(Duration::from_millis(400));
        let gathered = rank1.shard.start_all_gather_owned(vec![3.0, 4.0]).unwrap();
        let reduced = rank1.shard.reduce_scatter(&[10.0, 20.0, 30.0, 40.0]).unwrap();
        assert_eq!(gathered.wait().unwrap(), [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(reduced, [33.0, 44.0]);
        let (started_in, gathered0, reduced0) = first.join().unwrap();
        assert!(started_in < Duration::from_millis(200), "starting took {started_in:?}: it waited for the other rank");
        assert_eq!(gathered0, [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(reduced0, [11.0, 22.0]);
    }
}
