//! The `nccl` backend: one process per GPU (started by `fsdp-app launch`, torchrun, srun or
//! mpirun), NCCL moving the training traffic between the GPUs.
//!
//! Two layers, as PyTorch pairs NCCL with its TCPStore: the `tcp` backend's groups (joined at
//! MASTER_ADDR:MASTER_PORT) are the control plane (the rendezvous itself, rank 0's config and
//! tokenizer bytes, the loading scatter, barriers and aborts), and one NCCL communicator per group
//! (world, shard, replicate) carries the all-gathers, reduce-scatters and all-reduces of every
//! step. Rank 0 makes the communicators' unique ids and broadcasts them over the control plane.
//!
//! Each communicator runs on a CUDA stream of its own beside candle's (the compute stream), as
//! PyTorch's ProcessGroupNCCL does: a collective waits (on the GPU) for the compute issued
//! before it, and the compute that reads its result waits (on the GPU) for it when the caller
//! takes the result (`PendingTensor::wait`); the host never waits for a tensor collective, so
//! compute issued between a start and its wait runs beside the collective (the engine's
//! prefetch). The output buffers belong to the compute stream, and every input is kept until
//! the compute stream has waited for the collective, so no buffer is freed or reused under it.
//! The engine's per-step collectives take device tensors (`*_tensor`): NCCL reads and writes
//! their device memory directly. The host-slice API copies buffers in and out of the device
//! (used with `--cpu-offload`, and for the few host-side counts).
//!
//! NCCL waits forever for a peer that died. A watchdog thread (`watchdog`) follows every
//! collective's completion; one still running past the collective timeout has its
//! communicator aborted (`ncclCommAbort`, which ends its kernels), and the rank's next
//! collective, or the host read that waited for it, fails naming the operation and the group.
//! The launcher also stops the remaining ranks when one exits.

mod watchdog;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DeviceRepr};
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp};
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, DType, Device, Storage, Tensor};

use self::watchdog::Watched;
use super::env::DistEnv;
use super::tcp::Proxies;
use super::{communicator_slots, Collective, PendingTensor, ProcessGroups};

/// NCCL unique ids are 128 bytes.
const ID_LEN: usize = 128;

fn nccl_err<E: std::fmt::Debug>(what: &str) -> impl FnOnce(E) -> anyhow::Error + '_ {
    move |e| anyhow!("nccl {what}: {e:?}")
}

/// One group's communicator next to the same group's control-plane handle.
pub struct NcclGroup {
    control: Arc<dyn Collective>,
    comm: Arc<Watched>,
    /// candle's stream for the device: the compute the collectives are ordered with.
    compute: Arc<CudaStream>,
    /// The communicators' stream (one per rank, shared by its groups, whose collectives the
    /// engine issues in one order anyway).
    comm_stream: Arc<CudaStream>,
    /// candle's device the streams belong to (results become tensors on it).
    device: CudaDevice,
}

/// Joins the job described by `env` with the GPU `device` (this rank's, already opened: the
/// engine must use the same `Device`, whose stream the communicators share).
pub fn connect(env: &DistEnv, shard_size: usize, timeout: Duration, device: &Device) -> Result<(ProcessGroups, Proxies)> {
    let cuda = device.as_cuda_device().context("--backend nccl needs --device cuda")?;
    let compute = cuda.cuda_stream();
    // `FSDP_NCCL_STREAM=0` puts the communicators on the compute stream (collectives in line
    // with the kernels, as before they had a stream of their own), for comparisons.
    let comm_stream = if std::env::var("FSDP_NCCL_STREAM").is_ok_and(|v| v == "0") {
        compute.clone()
    } else {
        // The two streams are ordered by the events of `start` (see the module's comment), not
        // by cudarc's per-buffer events: those would add a wait and a record to every kernel
        // launch once the context has a second stream.
        // SAFETY: no tensor is freed before another stream's use of it is finished, used on
        // the communication stream before its allocation, or written by both streams at once:
        // `start` and its `PendingTensor` keep to that.
        unsafe { cuda.disable_event_tracking() };
        compute.context().new_stream().map_err(nccl_err("creating the communication stream"))?
    };
    let (control, proxies) = super::tcp::connect(env, shard_size, timeout)?;
    let slots = communicator_slots(env.rank, env.world_size, shard_size);
    let ids = if env.rank == 0 {
        let mut bytes = Vec::with_capacity(slots.count * ID_LEN);
        for _ in 0..slots.count {
            let id = Id::new().map_err(nccl_err("creating a unique id (is libnccl.so.2 on LD_LIBRARY_PATH?)"))?;
            bytes.extend(id.internal().iter().map(|&c| c as u8));
        }
        Some(bytes)
    } else {
        None
    };
    let ids = control.world.broadcast_bytes(0, ids)?;
    if ids.len() != slots.count * ID_LEN {
        bail!("nccl rendezvous: rank 0 sent {} bytes of unique ids, expected {}", ids.len(), slots.count * ID_LEN);
    }
    let id_at = |slot: usize| {
        let mut raw = [0 as std::ffi::c_char; ID_LEN];
        for (d, s) in raw.iter_mut().zip(&ids[slot * ID_LEN..(slot + 1) * ID_LEN]) {
            *d = *s as std::ffi::c_char;
        }
        Id::uninit(raw)
    };
    // Every rank creates the communicators in the same order (world, shard, replicate): each
    // creation waits for the group's members, and the groups of one kind are disjoint.
    let make = |ctl: &Arc<dyn Collective>, slot: usize, name: &'static str| -> Result<Arc<dyn Collective>> {
        let comm = Comm::from_rank(comm_stream.clone(), ctl.rank(), ctl.world_size(), id_at(slot)).map_err(nccl_err(&format!(
            "creating the {name} communicator (rank {} of {})",
            ctl.rank(),
            ctl.world_size()
        )))?;
        Ok(Arc::new(NcclGroup {
            control: ctl.clone(),
            comm: Watched::spawn(comm, timeout, name, compute.context().clone()),
            compute: compute.clone(),
            comm_stream: comm_stream.clone(),
            device: cuda.clone(),
        }))
    };
    let groups = ProcessGroups {
        world: make(&control.world, slots.world, "world")?,
        shard: make(&control.shard, slots.shard, "shard")?,
        replicate: make(&control.replicate, slots.replicate, "replicate")?,
    };
    Ok((groups, proxies))
}

/// The collectives the engine runs on device tensors.
#[derive(Clone, Copy)]
enum TensorOp {
    AllGather,
    ReduceScatter,
    AllReduce,
}

impl TensorOp {
    fn name(self) -> &'static str {
        match self {
            TensorOp::AllGather => "all_gather",
            TensorOp::ReduceScatter => "reduce_scatter",
            TensorOp::AllReduce => "all_reduce",
        }
    }
}

impl NcclGroup {
    /// Enqueues one collective on the communication stream, after everything issued on the
    /// compute stream so far, into a new buffer of `out_len` values that belongs to the
    /// compute stream. Returns the buffer and the event behind the collective, which the
    /// compute stream waits for before reading it (`finish`).
    fn start<T: DeviceRepr>(
        &self,
        op: &'static str,
        out_len: usize,
        launch: impl FnOnce(&Comm, &mut CudaSlice<T>) -> Result<()>,
    ) -> Result<(CudaSlice<T>, Arc<CudaEvent>)> {
        let guard = self.comm.comm(op)?;
        let comm = &guard.as_ref().expect("checked by `comm`").0;
        // SAFETY: every collective here writes all of its output before anything reads it.
        let mut out = unsafe { self.compute.alloc::<T>(out_len) }.map_err(nccl_err(op))?;
        // The inputs, and the output's allocation, are ready where the compute stream is now.
        let ready = self.compute.record_event(None).map_err(nccl_err(op))?;
        self.comm_stream.wait(&ready).map_err(nccl_err(op))?;
        launch(comm, &mut out)?;
        let done = Arc::new(self.comm_stream.record_event(None).map_err(nccl_err(op))?);
        self.comm.track(done.clone(), op);
        Ok((out, done))
    }

    /// Starts one collective from a 1-D tensor on this GPU into a new one of `out_len` values
    /// of the same dtype: NCCL reads the input's device memory and writes the output's. f32
    /// for gradients and counts; bf16/f16 for all-gathers of parameters in `param_dtype`
    /// (half the traffic, as FSDP2 gathers).
    fn start_tensor(&self, op: TensorOp, input: &Tensor, out_len: usize) -> Result<PendingTensor> {
        match input.dtype() {
            DType::F32 => self.start_tensor_typed::<f32>(op, input, out_len),
            DType::BF16 => self.start_tensor_typed::<half::bf16>(op, input, out_len),
            DType::F16 => self.start_tensor_typed::<half::f16>(op, input, out_len),
            dt => bail!("nccl {}: expected an f32, bf16 or f16 tensor, got {dt:?}", op.name()),
        }
    }

    fn start_tensor_typed<T: NcclType + DeviceRepr + CudaDType + 'static>(
        &self,
        op: TensorOp,
        input: &Tensor,
        out_len: usize,
    ) -> Result<PendingTensor> {
        let name = op.name();
        if input.rank() != 1 {
            bail!("nccl {name}: expected a 1-D tensor, got shape {:?}", input.shape());
        }
        let input = input.contiguous()?;
        let (out, done) = {
            let (storage, layout) = input.storage_and_layout();
            let Storage::Cuda(cuda) = &*storage else { bail!("nccl {name}: the tensor is not on the GPU") };
            let (start, end) = layout.contiguous_offsets().context("contiguous tensor")?;
            let send = cuda.as_cuda_slice::<T>()?.slice(start..end);
            self.start(name, out_len, |comm, recv| {
                match op {
                    TensorOp::AllGather => comm.all_gather(&send, recv).map(drop),
                    TensorOp::ReduceScatter => comm.reduce_scatter(&send, recv, &ReduceOp::Sum).map(drop),
                    TensorOp::AllReduce => comm.all_reduce(&send, recv, &ReduceOp::Sum).map(drop),
                }
                .map_err(nccl_err(name))
            })?
        };
        let (compute, device, comm) = (self.compute.clone(), self.device.clone(), self.comm.clone());
        Ok(PendingTensor::running(Box::new(move || {
            // The compute stream waits for the collective (the host does not); the input may
            // be freed after that, in the compute stream's order.
            compute.wait(&done).map_err(nccl_err(name))?;
            drop(input);
            comm.check(name)?;
            let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(out, device));
            Ok(Tensor::from_storage(storage, out_len, BackpropOp::none(), false))
        })))
    }

    /// Host values as a tensor on this group's GPU (for the host-slice API).
    fn upload(&self, v: &[f32]) -> Result<Tensor> {
        Ok(Tensor::from_slice(v, v.len(), &Device::Cuda(self.device.clone()))?)
    }

    /// A result's values on the host: the read waits for the collective, which the watchdog
    /// bounds; an abort in the meantime fails it.
    fn download(&self, t: Tensor, op: &str) -> Result<Vec<f32>> {
        let v = t.to_vec1::<f32>()?;
        self.comm.check(op)?;
        Ok(v)
    }
}

impl Collective for NcclGroup {
    fn rank(&self) -> usize {
        self.control.rank()
    }

    fn world_size(&self) -> usize {
        self.control.world_size()
    }

    fn all_gather_tensor(&self, shard: &Tensor) -> Result<Tensor> {
        self.start_all_gather_tensor(shard)?.wait()
    }

    fn reduce_scatter_tensor(&self, full: &Tensor) -> Result<Tensor> {
        self.start_reduce_scatter_tensor(full)?.wait()
    }

    fn all_reduce_tensor(&self, data: &Tensor) -> Result<Tensor> {
        self.start_tensor(TensorOp::AllReduce, data, data.elem_count())?.wait()
    }

    fn start_all_gather_tensor(&self, shard: &Tensor) -> Result<PendingTensor> {
        let n = shard.elem_count() * self.world_size();
        self.start_tensor(TensorOp::AllGather, shard, n)
    }

    fn start_reduce_scatter_tensor(&self, full: &Tensor) -> Result<PendingTensor> {
        let world = self.world_size();
        if !full.elem_count().is_multiple_of(world) {
            bail!("reduce_scatter: {} values do not split over {world} ranks", full.elem_count());
        }
        self.start_tensor(TensorOp::ReduceScatter, full, full.elem_count() / world)
    }

    fn overlaps_compute(&self) -> bool {
        true
    }

    fn all_gather(&self, shard: &[f32]) -> Result<Vec<f32>> {
        self.download(self.all_gather_tensor(&self.upload(shard)?)?, "all_gather")
    }

    fn reduce_scatter(&self, full: &[f32]) -> Result<Vec<f32>> {
        self.download(self.reduce_scatter_tensor(&self.upload(full)?)?, "reduce_scatter")
    }

    fn all_reduce(&self, data: &mut [f32]) -> Result<()> {
        data.copy_from_slice(&self.download(self.all_reduce_tensor(&self.upload(data)?)?, "all_reduce")?);
        Ok(())
    }

    fn all_reduce_f64(&self, data: &mut [f64]) -> Result<()> {
        const OP: &str = "all_reduce_f64";
        let send = self.compute.clone_htod(data).map_err(nccl_err(OP))?;
        let (out, done) =
            self.start(OP, data.len(), |comm, recv| comm.all_reduce(&send, recv, &ReduceOp::Sum).map(drop).map_err(nccl_err(OP)))?;
        self.compute.wait(&done).map_err(nccl_err(OP))?;
        data.copy_from_slice(&self.compute.clone_dtoh(&out).map_err(nccl_err(OP))?);
        drop(send);
        self.comm.check(OP)
    }

    /// Loading traffic (rank 0 to each rank once per unit) stays on the control plane: it is
    /// host data on rank 0 anyway, and NCCL has no scatter.
    fn scatter(&self, root: usize, chunks: Option<Vec<Vec<f32>>>) -> Result<Vec<f32>> {
        self.control.scatter(root, chunks)
    }

    fn broadcast_bytes(&self, root: usize, bytes: Option<Vec<u8>>) -> Result<Vec<u8>> {
        self.control.broadcast_bytes(root, bytes)
    }

    fn barrier(&self) -> Result<()> {
        self.control.barrier()
    }

    fn abort(&self, reason: &str) {
        self.control.abort(reason);
        // ncclCommAbort: a collective still queued on this GPU must not keep it busy.
        self.comm.abort(format!("this rank failed: {reason}"));
    }
}
