//! The `mpi` backend (cargo feature `mpi`): one CPU process per rank under `mpirun` or `srun`,
//! collectives by Open MPI. MPI collectives cannot time out; failure handling is MPI's own: a
//! rank that fails prints its error and calls `MPI_Abort`, and mpirun ends every rank (a rank
//! that dies is noticed by mpirun the same way).

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use mpi::collective::SystemOperation;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;

use super::{Collective, ProcessGroups};

/// MPI for this process: initialised on creation, finalised when dropped (after every group).
pub struct MpiSession {
    universe: mpi::environment::Universe,
}

impl MpiSession {
    pub fn init() -> Result<Self> {
        let universe = mpi::initialize().context("MPI is already initialised in this process")?;
        Ok(Self { universe })
    }

    pub fn world_size(&self) -> usize {
        self.universe.world().size() as usize
    }

    /// World, shard (consecutive ranks) and replicate groups, as the local backend makes them.
    pub fn groups(&self, shard_size: usize) -> Result<ProcessGroups> {
        let world = self.universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        if shard_size == 0 || size % shard_size != 0 {
            bail!("shard group size {shard_size} does not divide the MPI world size {size}");
        }
        let shard = world.split_by_color(Color::with_value((rank / shard_size) as i32)).context("MPI split")?;
        let replicate = world.split_by_color(Color::with_value((rank % shard_size) as i32)).context("MPI split")?;
        let g = |comm: SimpleCommunicator| -> Arc<dyn Collective> { Arc::new(MpiGroup { comm, world_rank: rank }) };
        Ok(ProcessGroups { world: g(self.universe.world()), shard: g(shard), replicate: g(replicate) })
    }
}

struct MpiGroup {
    comm: SimpleCommunicator,
    world_rank: usize,
}

// SAFETY: MPI is initialised with MPI_THREAD_SINGLE semantics and a rank's groups are used by
// that rank's one thread only (the engine and the training loop take turns on it).
unsafe impl Send for MpiGroup {}
unsafe impl Sync for MpiGroup {}

impl MpiGroup {
    fn broadcast_len(&self, root: usize, len: Option<usize>) -> usize {
        let mut n = [len.unwrap_or(0) as u64];
        self.comm.process_at_rank(root as i32).broadcast_into(&mut n[..]);
        n[0] as usize
    }
}

impl Collective for MpiGroup {
    fn rank(&self) -> usize {
        self.comm.rank() as usize
    }
    fn world_size(&self) -> usize {
        self.comm.size() as usize
    }
    fn all_gather(&self, shard: &[f32]) -> Result<Vec<f32>> {
        let mut out = vec![0f32; shard.len() * self.world_size()];
        if shard.is_empty() {
            return Ok(out);
        }
        self.comm.all_gather_into(shard, &mut out[..]);
        Ok(out)
    }
    fn reduce_scatter(&self, full: &[f32]) -> Result<Vec<f32>> {
        let world = self.world_size();
        if !full.len().is_multiple_of(world) {
            bail!("reduce_scatter: length {} is not divisible by the world size {world}", full.len());
        }
        // One reduce per chunk, to the rank that keeps it, rather than MPI_Reduce_scatter_block:
        // Open MPI's default algorithm for it reduces the whole buffer on rank 0 first, so
        // rank 0 held a full-size temporary the others did not (300 MiB more at the peak of a
        // 220M model's run on four ranks).
        let n = full.len() / world;
        let mut out = vec![0f32; n];
        for (k, chunk) in full.chunks(n.max(1)).enumerate().take(world) {
            let root = self.comm.process_at_rank(k as i32);
            if k == self.rank() {
                root.reduce_into_root(chunk, &mut out[..], SystemOperation::sum());
            } else {
                root.reduce_into(chunk, SystemOperation::sum());
            }
        }
        Ok(out)
    }
    fn all_reduce(&self, data: &mut [f32]) -> Result<()> {
        let send = data.to_vec();
        self.comm.all_reduce_into(&send[..], data, SystemOperation::sum());
        Ok(())
    }
    fn all_reduce_f64(&self, data: &mut [f64]) -> Result<()> {
        let send = data.to_vec();
        self.comm.all_reduce_into(&send[..], data, SystemOperation::sum());
        Ok(())
    }
    fn scatter(&self, root: usize, chunks: Option<Vec<Vec<f32>>>) -> Result<Vec<f32>> {
        let is_root = self.rank() == root;
        let len = self.broadcast_len(root, chunks.as_ref().and_then(|c| c.first()).map(Vec::len));
        if len == 0 {
            return Ok(vec![]);
        }
        let root_proc = self.comm.process_at_rank(root as i32);
        let mut out = vec![];
        if is_root {
            let chunks = chunks.context("scatter: the root has no chunks")?;
            if chunks.len() != self.world_size() || chunks.iter().any(|c| c.len() != len) {
                bail!("scatter: the root needs {} chunks of equal length", self.world_size());
            }
            // Chunk by chunk, point to point: MPI_Scatter would need them concatenated, a second
            // copy of the unit on the root.
            for (k, chunk) in chunks.into_iter().enumerate() {
                if k == root {
                    out = chunk;
                } else {
                    self.comm.process_at_rank(k as i32).send(&chunk[..]);
                }
            }
        } else {
            out = vec![0f32; len];
            root_proc.receive_into(&mut out[..]);
        }
        Ok(out)
    }
    fn broadcast_bytes(&self, root: usize, bytes: Option<Vec<u8>>) -> Result<Vec<u8>> {
        let len = self.broadcast_len(root, bytes.as_ref().map(Vec::len));
        let mut buf = bytes.unwrap_or_else(|| vec![0u8; len]);
        // MPI rejects the dangling pointer of an empty buffer: nothing to send then.
        if len > 0 {
            self.comm.process_at_rank(root as i32).broadcast_into(&mut buf[..]);
        }
        Ok(buf)
    }
    fn barrier(&self) -> Result<()> {
        self.comm.barrier();
        Ok(())
    }
    fn abort(&self, reason: &str) {
        eprintln!("error: rank {} failed: {reason}; aborting the MPI job", self.world_rank);
        self.comm.abort(1)
    }
}
