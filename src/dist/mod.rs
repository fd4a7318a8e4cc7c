//! The process group: who we are (rank, world size) and the collectives the FSDP engine needs.
//!
//! Every backend implements [`Collective`]. Collectives work on f32 buffers (parameters,
//! gradients, counts) and on bytes (config and tokenizer files travelling from rank 0). A failure
//! on one rank must reach every other rank as an error that names the failing rank and the
//! operation, within a bounded time: no collective may wait forever.

pub mod env;
pub mod launch;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod overlap;
pub mod pending;
pub mod tcp;

use std::sync::Arc;

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};

pub use self::pending::{Pending, PendingTensor};

/// Collective operations over one group of ranks. A rank's handle is used by that rank only
/// (it is shared between the engine and the training loop of that rank).
pub trait Collective: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// Every rank's `shard` (all the same length), concatenated in rank order.
    fn all_gather(&self, shard: &[f32]) -> Result<Vec<f32>>;

    /// Sums `full` (length divisible by the world size) across ranks and returns this rank's
    /// chunk of the sum: elements `rank * n .. (rank + 1) * n` with `n = full.len() / world`.
    fn reduce_scatter(&self, full: &[f32]) -> Result<Vec<f32>>;

    /// [`Self::all_gather`] of a shard the caller gives up: a backend that holds every rank's
    /// shard while the others read it (the local one) keeps this one as it is instead of a copy.
    fn all_gather_owned(&self, shard: Vec<f32>) -> Result<Vec<f32>> {
        self.all_gather(&shard)
    }

    /// [`Self::reduce_scatter`] of a buffer the caller gives up (see `all_gather_owned`): on
    /// rank 0 of the tcp backend, each other rank's unit-sized gradient would be copied again.
    fn reduce_scatter_owned(&self, full: Vec<f32>) -> Result<Vec<f32>> {
        self.reduce_scatter(&full)
    }

    /// Elementwise sum across ranks, in place.
    fn all_reduce(&self, data: &mut [f32]) -> Result<()>;

    /// Elementwise sum across ranks in f64 (token counts, loss sums, squared norms).
    fn all_reduce_f64(&self, data: &mut [f64]) -> Result<()>;

    /// `root`'s chunks go one to each rank; returns this rank's. Only `root` passes `Some`.
    fn scatter(&self, root: usize, chunks: Option<Vec<Vec<f32>>>) -> Result<Vec<f32>>;

    /// `root`'s bytes, on every rank. Only `root` passes `Some`.
    fn broadcast_bytes(&self, root: usize, bytes: Option<Vec<u8>>) -> Result<Vec<u8>>;

    /// Every rank's `bytes` (any length each), in rank order, on every rank. The default sends
    /// each rank's in turn with [`Self::broadcast_bytes`]: world-size collectives of small
    /// messages, for control data (a checkpoint's file hashes), not for tensors.
    fn all_gather_bytes(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let (me, world) = (self.rank(), self.world_size());
        let mut mine = Some(bytes);
        (0..world).map(|root| self.broadcast_bytes(root, if root == me { mine.take() } else { None })).collect()
    }

    fn barrier(&self) -> Result<()>;

    /// Tells every other rank that this one failed, so their pending and future collectives
    /// return an error naming this rank instead of waiting.
    fn abort(&self, reason: &str);

    /// `all_gather` of a 1-D tensor (f32, or bf16/f16 for parameters gathered in
    /// `param_dtype`), the result on the tensor's device in its dtype. Backends that move
    /// device memory themselves (NCCL) override the three tensor collectives; the others go
    /// through host memory in f32 (exact for bf16/f16 values).
    ///
    /// A group of one rank returns the tensor itself, for all three: a single-GPU run without
    /// NCCL would otherwise copy every unit to the host and back twice a step (docs/design.md,
    /// FSDP).
    fn all_gather_tensor(&self, shard: &Tensor) -> Result<Tensor> {
        if let Some(t) = alone(self, shard)? {
            return Ok(t);
        }
        let all = self.all_gather(&host_f32(shard)?)?;
        back_to_device(all, shard)
    }

    /// `reduce_scatter` (sum) of a 1-D tensor, the result on the tensor's device in its dtype.
    fn reduce_scatter_tensor(&self, full: &Tensor) -> Result<Tensor> {
        if let Some(t) = alone(self, full)? {
            return Ok(t);
        }
        let mine = self.reduce_scatter(&host_f32(full)?)?;
        back_to_device(mine, full)
    }

    /// Starts [`Self::all_gather_tensor`]: where the backend runs collectives beside compute
    /// ([`Self::overlaps_compute`]), what is issued before [`PendingTensor::wait`] runs while
    /// the collective does. The default runs it at once.
    fn start_all_gather_tensor(&self, shard: &Tensor) -> Result<PendingTensor> {
        Ok(PendingTensor::ready(self.all_gather_tensor(shard)?))
    }

    /// Starts [`Self::reduce_scatter_tensor`] (see [`Self::start_all_gather_tensor`]).
    fn start_reduce_scatter_tensor(&self, full: &Tensor) -> Result<PendingTensor> {
        Ok(PendingTensor::ready(self.reduce_scatter_tensor(full)?))
    }

    /// Starts [`Self::all_gather_owned`] (see [`Self::start_all_gather_tensor`]).
    fn start_all_gather_owned(&self, shard: Vec<f32>) -> Result<Pending<Vec<f32>>> {
        Ok(Pending::ready(self.all_gather_owned(shard)?))
    }

    /// Starts [`Self::reduce_scatter_owned`] (see [`Self::start_all_gather_tensor`]).
    fn start_reduce_scatter_owned(&self, full: Vec<f32>) -> Result<Pending<Vec<f32>>> {
        Ok(Pending::ready(self.reduce_scatter_owned(full)?))
    }

    /// Whether a started collective runs beside the work issued after it (on a GPU stream or
    /// a thread of its own), so that starting it early pays: the engine prefetches then.
    fn overlaps_compute(&self) -> bool {
        false
    }

    /// `all_reduce` (sum) of a 1-D tensor, into a new tensor on its device, in its dtype.
    fn all_reduce_tensor(&self, data: &Tensor) -> Result<Tensor> {
        if let Some(t) = alone(self, data)? {
            return Ok(t);
        }
        let mut v = host_f32(data)?;
        self.all_reduce(&mut v)?;
        back_to_device(v, data)
    }
}

/// The result of a tensor collective over a group of one rank: `t` itself (tensors are never
/// written in place, so sharing its storage is safe). None for a larger group.
fn alone<C: Collective + ?Sized>(group: &C, t: &Tensor) -> Result<Option<Tensor>> {
    if group.world_size() != 1 {
        return Ok(None);
    }
    check_1d(t)?;
    Ok(Some(t.clone()))
}

/// A 1-D tensor's values in host memory, as f32.
fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    check_1d(t)?;
    Ok(t.to_dtype(DType::F32)?.to_vec1::<f32>()?)
}

/// Tensor collectives take flat buffers.
fn check_1d(t: &Tensor) -> Result<()> {
    if t.rank() != 1 {
        bail!("tensor collective: expected a 1-D tensor, got shape {:?}", t.shape());
    }
    Ok(())
}

/// `values` as a tensor on `like`'s device, in `like`'s dtype.
fn back_to_device(values: Vec<f32>, like: &Tensor) -> Result<Tensor> {
    to_device(values, like.dtype(), like.device())
}

/// `values` as a tensor on `device`, in `dtype`.
fn to_device(values: Vec<f32>, dtype: DType, device: &candle_core::Device) -> Result<Tensor> {
    let n = values.len();
    Ok(Tensor::from_vec(values, n, device)?.to_dtype(dtype)?)
}

/// Failures of a collective that callers tell apart (by type, not by message).
#[derive(Debug, Clone, PartialEq)]
pub enum DistError {
    /// Another rank failed and said so (`abort`): this rank's `op` stopped because of it.
    PeerFailed { op: String, rank: usize, failed_rank: usize, reason: String },
    /// Rank 0 could not do `what`; every other rank learns its message.
    RootFailed { what: String, message: String },
    /// `op` on `rank` waited `waited_s` seconds for the group ranks in `missing`.
    Timeout { op: String, rank: usize, waited_s: f64, missing: Vec<usize> },
}

impl std::fmt::Display for DistError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::PeerFailed { op, rank, failed_rank, reason } => {
                write!(f, "{op} on rank {rank} stopped: rank {failed_rank} failed: {reason}")
            }
            Self::RootFailed { what, message } => write!(f, "rank 0 could not {what}: {message}"),
            Self::Timeout { op, rank, waited_s, missing } => {
                write!(f, "{op} timed out after {waited_s:.1}s on rank {rank}: waiting for group rank(s) {missing:?}")
            }
        }
    }
}

impl std::error::Error for DistError {}

impl DistError {
    /// Whether `e` only says that another rank failed (so it is not the cause of a failed run).
    pub fn is_echo(e: &anyhow::Error) -> bool {
        e.chain().any(|c| matches!(c.downcast_ref::<DistError>(), Some(DistError::PeerFailed { .. } | DistError::RootFailed { .. })))
    }
}

/// "Rank 0 tries, everyone learns the outcome": rank 0 runs `work`, which returns what rank 0
/// keeps and the bytes every rank needs; the others get the bytes, or
/// [`DistError::RootFailed`] with rank 0's message when `work` failed (rank 0 gets its own
/// error back). Only rank 0 calls `work`.
pub fn root_tries<T>(group: &dyn Collective, what: &str, work: impl FnOnce() -> Result<(T, Vec<u8>)>) -> Result<(Option<T>, Vec<u8>)> {
    if group.rank() == 0 {
        match work() {
            Ok((keep, bytes)) => {
                let sent = group.broadcast_bytes(0, Some([vec![1u8], bytes].concat()))?;
                Ok((Some(keep), sent[1..].to_vec()))
            }
            Err(e) => {
                group.broadcast_bytes(0, Some([vec![0u8], format!("{e:#}").into_bytes()].concat()))?;
                Err(e)
            }
        }
    } else {
        let got = group.broadcast_bytes(0, None)?;
        match got.split_first() {
            Some((1, bytes)) => Ok((None, bytes.to_vec())),
            Some((_, message)) => Err(DistError::RootFailed { what: what.into(), message: String::from_utf8_lossy(message).into() }.into()),
            None => bail!("{what}: rank 0 sent an empty message"),
        }
    }
}

/// Sums one number across ranks.
pub fn all_reduce_scalar(group: &dyn Collective, x: f64) -> Result<f64> {
    let mut buf = [x];
    group.all_reduce_f64(&mut buf)?;
    Ok(buf[0])
}

/// The three groups a rank belongs to. For FULL_SHARD and SHARD_GRAD_OP `shard` spans the world
/// and `replicate` is this rank alone; NO_SHARD is the reverse; HYBRID_SHARD splits the world
/// into shard groups of consecutive ranks, replicated across groups.
#[derive(Clone)]
pub struct ProcessGroups {
    pub world: Arc<dyn Collective>,
    pub shard: Arc<dyn Collective>,
    pub replicate: Arc<dyn Collective>,
}

impl ProcessGroups {
    /// Tells every group that this rank failed.
    pub fn abort(&self, reason: &str) {
        self.world.abort(reason);
        self.shard.abort(reason);
        self.replicate.abort(reason);
    }
}

/// Which of the job's communicators (one for the world, one per shard group, one per replica
/// group; numbered in that order) a rank belongs to. Shard groups are runs of `shard_size`
/// consecutive ranks and replica groups take every `shard_size`-th rank, as in
/// [`local::create_process_groups`]. Backends that need one id per communicator (NCCL) number
/// them this way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommunicatorSlots {
    /// How many communicators the job has.
    pub count: usize,
    pub world: usize,
    pub shard: usize,
    pub replicate: usize,
}

pub fn communicator_slots(rank: usize, world: usize, shard_size: usize) -> CommunicatorSlots {
    let shard_groups = world / shard_size;
    CommunicatorSlots {
        count: 1 + shard_groups + shard_size,
        world: 0,
        shard: 1 + rank / shard_size,
        replicate: 1 + shard_groups + rank % shard_size,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ranks get the same communicator exactly when the local backend puts them in the same group.
    #[test]
    fn communicator_slots_follow_the_local_groups() {
        for (world, shard) in [(1, 1), (4, 4), (4, 2), (4, 1), (6, 3)] {
            let groups = local::create_process_groups(world, shard, std::time::Duration::from_secs(5));
            let slots: Vec<_> = (0..world).map(|r| communicator_slots(r, world, shard)).collect();
            for a in 0..world {
                assert!(slots[a].shard < slots[a].count && slots[a].replicate < slots[a].count);
                assert_ne!(slots[a].shard, slots[a].replicate);
                for b in 0..world {
                    // Same group of the local backend <=> same slot; the group sizes tell.
                    let same_shard = a / shard == b / shard;
                    assert_eq!(slots[a].shard == slots[b].shard, same_shard, "world {world} shard {shard}: {a} {b}");
                    assert_eq!(slots[a].replicate == slots[b].replicate, a % shard == b % shard);
                }
                assert_eq!(groups[a].shard.world_size(), shard);
                assert_eq!(groups[a].shard.rank(), a % shard);
                assert_eq!(groups[a].replicate.world_size(), world / shard);
                assert_eq!(groups[a].replicate.rank(), a / shard);
            }
        }
    }
}
