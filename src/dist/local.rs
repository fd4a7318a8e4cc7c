//! The `local` backend: ranks are threads of one process and collectives go through shared
//! memory. Each rank still owns only its own shards, so memory per rank is 1/N as with real
//! processes; it is how FSDP is tested and tried without GPUs or MPI.
//!
//! Every collective is one rendezvous: each rank deposits its contribution, the last to arrive
//! opens the round, each rank computes its own result from the deposits, and the last to leave
//! clears the slots for the next round. Waits are bounded by a timeout, and a rank that fails
//! calls `abort`, which wakes every waiter with an error naming it.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::{Collective, ProcessGroups};

#[derive(Clone)]
enum Deposit {
    Empty,
    F32(Arc<Vec<f32>>),
    F64(Arc<Vec<f64>>),
    Chunks(Arc<Vec<Vec<f32>>>),
    Bytes(Arc<Vec<u8>>),
}

#[derive(PartialEq, Eq, Clone, Copy)]
enum Phase {
    /// Ranks are depositing.
    Filling,
    /// Everyone deposited; ranks are reading.
    Draining,
}

struct State {
    slots: Vec<Deposit>,
    /// Which ranks deposited in this round.
    present: Vec<bool>,
    arrived: usize,
    departed: usize,
    phase: Phase,
    op: Option<&'static str>,
    failed: Option<String>,
    /// The rank that aborted the group, and why (see [`super::DistError::PeerFailed`]).
    aborted_by: Option<(usize, String)>,
}

struct Shared {
    world: usize,
    state: Mutex<State>,
    cv: Condvar,
}

/// One rank's handle on a local group.
pub struct LocalGroup {
    shared: Arc<Shared>,
    rank: usize,
    /// This rank's number in the whole job, for messages (differs from `rank` in sub-groups).
    world_rank: usize,
    timeout: Duration,
}

impl LocalGroup {
    /// Handles for all `world` ranks of a new group, in rank order.
    pub fn create(world: usize, timeout: Duration) -> Vec<LocalGroup> {
        assert!(world > 0);
        let shared = Arc::new(Shared {
            world,
            state: Mutex::new(State {
                slots: vec![Deposit::Empty; world],
                present: vec![false; world],
                arrived: 0,
                departed: 0,
                phase: Phase::Filling,
                op: None,
                failed: None,
                aborted_by: None,
            }),
            cv: Condvar::new(),
        });
        (0..world).map(|rank| LocalGroup { shared: shared.clone(), rank, world_rank: rank, timeout }).collect()
    }

    fn wait_until<'a>(
        &self,
        mut guard: MutexGuard<'a, State>,
        op: &str,
        deadline: Instant,
        ready: impl Fn(&State) -> bool,
    ) -> Result<MutexGuard<'a, State>> {
        loop {
            if let Some((failed_rank, reason)) = &guard.aborted_by {
                let e = super::DistError::PeerFailed {
                    op: op.into(),
                    rank: self.world_rank,
                    failed_rank: *failed_rank,
                    reason: reason.clone(),
                };
                return Err(e.into());
            }
            if let Some(f) = &guard.failed {
                bail!("{op} on rank {} stopped: {f}", self.world_rank);
            }
            if ready(&guard) {
                return Ok(guard);
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = guard.present.iter().enumerate().filter(|(_, p)| !**p).map(|(r, _)| r).collect();
                let e = super::DistError::Timeout { op: op.into(), rank: self.world_rank, waited_s: self.timeout.as_secs_f64(), missing };
                guard.failed = Some(e.to_string());
                self.shared.cv.notify_all();
                return Err(e.into());
            }
            guard = self.shared.cv.wait_timeout(guard, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Deposits `mine`, waits for every rank, returns all deposits in rank order.
    fn exchange(&self, op: &'static str, mine: Deposit) -> Result<Vec<Deposit>> {
        let deadline = Instant::now() + self.timeout;
        let world = self.shared.world;
        let guard = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        // Wait for the previous round to be fully read.
        let mut guard = self.wait_until(guard, op, deadline, |s| s.phase == Phase::Filling)?;
        if let Some(other) = guard.op {
            if other != op {
                let msg = format!("rank {} called {op} while another rank called {other}", self.world_rank);
                guard.failed = Some(msg.clone());
                self.shared.cv.notify_all();
                bail!(msg);
            }
        }
        guard.op = Some(op);
        guard.slots[self.rank] = mine;
        guard.present[self.rank] = true;
        guard.arrived += 1;
        if guard.arrived == world {
            guard.phase = Phase::Draining;
            self.shared.cv.notify_all();
        }
        let mut guard = self.wait_until(guard, op, deadline, |s| s.phase == Phase::Draining)?;
        let all = guard.slots.clone();
        guard.departed += 1;
        if guard.departed == world {
            for s in guard.slots.iter_mut() {
                *s = Deposit::Empty;
            }
            guard.present.iter_mut().for_each(|p| *p = false);
            guard.arrived = 0;
            guard.departed = 0;
            guard.op = None;
            guard.phase = Phase::Filling;
            self.shared.cv.notify_all();
        }
        Ok(all)
    }
}

/// World, shard and replicate groups for every rank of a `world`-rank job whose shard groups
/// have `shard_size` consecutive ranks (`shard_size` must divide `world`).
pub fn create_process_groups(world: usize, shard_size: usize, timeout: Duration) -> Vec<ProcessGroups> {
    assert!(shard_size > 0 && world.is_multiple_of(shard_size));
    let mut world_groups: Vec<Option<LocalGroup>> = LocalGroup::create(world, timeout).into_iter().map(Some).collect();
    let mut shard_groups: Vec<Option<LocalGroup>> = (0..world).map(|_| None).collect();
    for start in (0..world).step_by(shard_size) {
        for (i, mut h) in LocalGroup::create(shard_size, timeout).into_iter().enumerate() {
            h.world_rank = start + i;
            shard_groups[start + i] = Some(h);
        }
    }
    let mut replicate_groups: Vec<Option<LocalGroup>> = (0..world).map(|_| None).collect();
    for pos in 0..shard_size {
        let members: Vec<usize> = (pos..world).step_by(shard_size).collect();
        for (mut h, &r) in LocalGroup::create(members.len(), timeout).into_iter().zip(&members) {
            h.world_rank = r;
            replicate_groups[r] = Some(h);
        }
    }
    (0..world)
        .map(|r| ProcessGroups {
            world: Arc::new(world_groups[r].take().unwrap()),
            shard: Arc::new(shard_groups[r].take().unwrap()),
            replicate: Arc::new(replicate_groups[r].take().unwrap()),
        })
        .collect()
}

fn f32s(d: &Deposit) -> &[f32] {
    match d {
        Deposit::F32(v) => v,
        _ => unreachable!("deposit kinds are checked by op name"),
    }
}

impl Collective for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_gather(&self, shard: &[f32]) -> Result<Vec<f32>> {
        self.all_gather_owned(shard.to_vec())
    }

    fn all_gather_owned(&self, shard: Vec<f32>) -> Result<Vec<f32>> {
        let n = shard.len();
        let all = self.exchange("all_gather", Deposit::F32(Arc::new(shard)))?;
        let mut out = Vec::with_capacity(n * all.len());
        for (r, d) in all.iter().enumerate() {
            let v = f32s(d);
            if v.len() != n {
                bail!("all_gather: rank {r} sent {} values, rank {} sent {n}", v.len(), self.rank);
            }
            out.extend_from_slice(v);
        }
        Ok(out)
    }

    fn reduce_scatter(&self, full: &[f32]) -> Result<Vec<f32>> {
        self.reduce_scatter_owned(full.to_vec())
    }

    fn reduce_scatter_owned(&self, full: Vec<f32>) -> Result<Vec<f32>> {
        let world = self.shared.world;
        if !full.len().is_multiple_of(world) {
            bail!("reduce_scatter: length {} is not divisible by the world size {world}", full.len());
        }
        let n = full.len() / world;
        let all = self.exchange("reduce_scatter", Deposit::F32(Arc::new(full)))?;
        let range = self.rank * n..(self.rank + 1) * n;
        // Sum in rank order on every rank, so results are deterministic.
        let mut out = vec![0f32; n];
        for d in &all {
            for (o, x) in out.iter_mut().zip(&f32s(d)[range.clone()]) {
                *o += *x;
            }
        }
        Ok(out)
    }

    fn all_reduce(&self, data: &mut [f32]) -> Result<()> {
        let all = self.exchange("all_reduce", Deposit::F32(Arc::new(data.to_vec())))?;
        data.iter_mut().for_each(|x| *x = 0.0);
        for d in &all {
            for (o, x) in data.iter_mut().zip(f32s(d)) {
                *o += *x;
            }
        }
        Ok(())
    }

    fn all_reduce_f64(&self, data: &mut [f64]) -> Result<()> {
        let all = self.exchange("all_reduce_f64", Deposit::F64(Arc::new(data.to_vec())))?;
        data.iter_mut().for_each(|x| *x = 0.0);
        for d in &all {
            let Deposit::F64(v) = d else { unreachable!() };
            for (o, x) in data.iter_mut().zip(v.iter()) {
                *o += *x;
            }
        }
        Ok(())
    }

    fn scatter(&self, root: usize, chunks: Option<Vec<Vec<f32>>>) -> Result<Vec<f32>> {
        let mine = match (self.rank == root, chunks) {
            (true, Some(c)) => {
                if c.len() != self.shared.world {
                    bail!("scatter: {} chunks for {} ranks", c.len(), self.shared.world);
                }
                Deposit::Chunks(Arc::new(c))
            }
            (true, None) => bail!("scatter: root {root} has no chunks"),
            (false, _) => Deposit::Empty,
        };
        let all = self.exchange("scatter", mine)?;
        match &all[root] {
            Deposit::Chunks(c) => Ok(c[self.rank].clone()),
            _ => bail!("scatter: root {root} sent nothing"),
        }
    }

    fn broadcast_bytes(&self, root: usize, bytes: Option<Vec<u8>>) -> Result<Vec<u8>> {
        let mine = match (self.rank == root, bytes) {
            (true, Some(b)) => Deposit::Bytes(Arc::new(b)),
            (true, None) => bail!("broadcast: root {root} has no data"),
            (false, _) => Deposit::Empty,
        };
        let all = self.exchange("broadcast", mine)?;
        match &all[root] {
            Deposit::Bytes(b) => Ok(b.as_ref().clone()),
            _ => bail!("broadcast: root {root} sent nothing"),
        }
    }

    fn barrier(&self) -> Result<()> {
        self.exchange("barrier", Deposit::Empty).map(|_| ())
    }

    fn abort(&self, reason: &str) {
        let mut guard = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        if guard.failed.is_none() && guard.aborted_by.is_none() {
            guard.aborted_by = Some((self.world_rank, reason.to_string()));
        }
        self.shared.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_ranks<T: Send + 'static>(world: usize, f: impl Fn(LocalGroup) -> T + Send + Sync + 'static) -> Vec<T> {
        let f = Arc::new(f);
        let handles: Vec<_> = LocalGroup::create(world, Duration::from_secs(10))
            .into_iter()
            .map(|g| {
                let f = f.clone();
                std::thread::spawn(move || f(g))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn collectives_compute_what_they_promise() {
        let out = on_ranks(3, |g| {
            let r = g.rank() as f32;
            let gathered = g.all_gather(&[r, r + 10.0]).unwrap();
            let full: Vec<f32> = (0..6).map(|i| i as f32 * (r + 1.0)).collect();
            let rs = g.reduce_scatter(&full).unwrap();
            let mut ar = vec![r; 2];
            g.all_reduce(&mut ar).unwrap();
            let chunks = (g.rank() == 1).then(|| vec![vec![0.0], vec![1.0], vec![2.0]]);
            let sc = g.scatter(1, chunks).unwrap();
            let b = g.broadcast_bytes(2, (g.rank() == 2).then(|| b"cfg".to_vec())).unwrap();
            g.barrier().unwrap();
            (gathered, rs, ar, sc, b)
        });
        for (r, (gathered, rs, ar, sc, b)) in out.into_iter().enumerate() {
            assert_eq!(gathered, vec![0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
            // sum over ranks of i * (r + 1) = 6 i, for this rank's two elements
            assert_eq!(rs, vec![6.0 * (2 * r) as f32, 6.0 * (2 * r + 1) as f32]);
            assert_eq!(ar, vec![3.0, 3.0]);
            assert_eq!(sc, vec![r as f32]);
            assert_eq!(b, b"cfg");
        }
    }

    /// The trait's host-memory tensor collectives keep the input's dtype: parameters
    /// gathered in bf16 come back in bf16, with the values each rank sent.
    /// Bytes of any length from every rank, in rank order, on every rank.
    #[test]
    fn byte_gathers_carry_each_ranks_own_length() {
        let out = on_ranks(3, |g| g.all_gather_bytes(vec![b'a' + g.rank() as u8; g.rank() * 2]).unwrap());
        for got in out {
            assert_eq!(got, vec![vec![], b"bb".to_vec(), b"cccc".to_vec()]);
        }
    }

    #[test]
    fn tensor_collectives_keep_the_dtype() {
        use candle_core::{DType, Device, Tensor};
        let out = on_ranks(2, |g| {
            let r = g.rank() as f32;
            // 1/3 is not a bf16 value: the gather must carry the rounded one, not re-round it.
            let shard = Tensor::new(&[r + 1.0 / 3.0, -r], &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
            let gathered = g.all_gather_tensor(&shard).unwrap();
            let summed = g.reduce_scatter_tensor(&Tensor::new(&[1f32, 2., 3., 4.], &Device::Cpu).unwrap()).unwrap();
            (
                shard.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(),
                gathered.dtype(),
                gathered.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(),
                summed.to_vec1::<f32>().unwrap(),
            )
        });
        let sent: Vec<f32> = out.iter().flat_map(|(s, ..)| s.clone()).collect();
        for (r, (_, dtype, gathered, summed)) in out.into_iter().enumerate() {
            assert_eq!(dtype, DType::BF16);
            assert_eq!(gathered, sent);
            assert_eq!(summed, vec![2.0 * (2 * r + 1) as f32, 2.0 * (2 * r + 2) as f32]);
        }
        // What was sent is 1/3 rounded to bf16, so the check above saw no re-rounding.
        assert!(sent[0] != 1.0 / 3.0 && half::bf16::from_f32(sent[0]).to_f32() == sent[0]);
    }

    /// A group of one hands the tensor back as it is (no trip through host memory): the same
    /// tensor (not a copy), dtype included; a tensor of another rank than 1 is still refused.
    #[test]
    fn tensor_collectives_of_one_rank_return_the_tensor() {
        use candle_core::{DType, Device, Tensor};
        let g = LocalGroup::create(1, Duration::from_secs(5)).pop().unwrap();
        let t = Tensor::new(&[1f32 / 3.0, -2.0], &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
        for out in [g.all_gather_tensor(&t).unwrap(), g.reduce_scatter_tensor(&t).unwrap(), g.all_reduce_tensor(&t).unwrap()] {
            assert_eq!(out.id(), t.id(), "a copy was made");
            assert_eq!(out.dtype(), DType::BF16);
        }
        let e = g.all_gather_tensor(&t.reshape((1, 2)).unwrap()).unwrap_err().to_string();
        assert!(e.contains("1-D"), "{e}");
    }

    #[test]
    fn a_failing_rank_stops_the_others_with_its_name() {
        let out = on_ranks(3, |g| {
            if g.rank() == 1 {
                g.abort("out of memory while loading");
                return Err(anyhow::anyhow!("rank 1 gave up"));
            }
            g.all_gather(&[1.0]).map(|_| ())
        });
        for (r, res) in out.into_iter().enumerate() {
            let msg = format!("{:#}", res.unwrap_err());
            if r != 1 {
                assert!(msg.contains("all_gather") && msg.contains("rank 1 failed: out of memory"), "{msg}");
            }
        }
    }

    #[test]
    fn a_missing_rank_times_out_instead_of_hanging() {
        let groups = LocalGroup::create(2, Duration::from_millis(200));
        let start = Instant::now();
        let err = groups[0].barrier().unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(5));
        let msg = format!("{err:#}");
        assert!(msg.contains("barrier timed out") && msg.contains("[1]"), "{msg}");
        // The group is now failed for everyone.
        assert!(groups[1].barrier().is_err());
    }
}
