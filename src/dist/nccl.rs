//! The `nccl` backend: one process per GPU (started by `fsdp-app launch`, torchrun, srun or
//! mpirun), NCCL moving the training traffic between the GPUs.
//!
//! Two layers, as PyTorch pairs NCCL with its TCPStore: the `tcp` backend's groups (joined at
//! MASTER_ADDR:MASTER_PORT) are the control plane (the rendezvous itself, rank 0's config and
//! tokenizer bytes, the loading scatter, barriers and aborts), and one NCCL communicator per group
//! (world, shard, replicate) carries the all-gathers, reduce-scatters and all-reduces of every
//! step. Rank 0 makes the communicators' unique ids and broadcasts them over the control plane.
//!
//! Each communicator is created on candle's own CUDA stream for the rank's device, so its
//! collectives are ordered with the kernels of that device without extra synchronisation.
//! The engine's per-step collectives take device tensors (`*_tensor`): NCCL reads and writes
//! their device memory directly. The host-slice API copies buffers in and out of the device
//! (used with `--cpu-offload`, and for the few host-side counts).
//!
//! NCCL waits forever for a peer that died. Every collective therefore records an event behind
//! its kernels and waits for it with the collective timeout; past it, the communicator is
//! aborted (`ncclCommAbort`) and the call fails naming the operation and the group. The launcher
//! also stops the remaining ranks when one exits.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp};
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, DType, Device, Storage, Tensor};

use super::env::DistEnv;
use super::tcp::Proxies;
use super::{communicator_slots, Collective, ProcessGroups};

/// NCCL unique ids are 128 bytes.
const ID_LEN: usize = 128;

fn nccl_err<E: std::fmt::Debug>(what: &str) -> impl FnOnce(E) -> anyhow::Error + '_ {
    move |e| anyhow!("nccl {what}: {e:?}")
}

/// NCCL communicators hold raw pointers, so `Comm` is neither `Send` nor `Sync`. NCCL allows a
/// communicator to be used from any thread as long as calls on it are not concurrent; the
/// mutex in [`NcclGroup`] serialises them.
struct CommHandle(Comm);
unsafe impl Send for CommHandle {}

/// One group's communicator next to the same group's control-plane handle.
pub struct NcclGroup {
    control: Arc<dyn Collective>,
    /// `None` once aborted.
    comm: Mutex<Option<CommHandle>>,
    stream: Arc<CudaStream>,
    /// candle's device the stream belongs to (results become tensors on it).
    device: CudaDevice,
    timeout: Duration,
    /// "world", "shard" or "replicate", for messages.
    name: &'static str,
}

/// Joins the job described by `env` with the GPU `device` (this rank's, already opened: the
/// engine must use the same `Device`, whose stream the communicators share).
pub fn connect(env: &DistEnv, shard_size: usize, timeout: Duration, device: &Device) -> Result<(ProcessGroups, Proxies)> {
    let cuda = device.as_cuda_device().context("--backend nccl needs --device cuda")?;
    let stream = cuda.cuda_stream();
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
        let comm = Comm::from_rank(stream.clone(), ctl.rank(), ctl.world_size(), id_at(slot)).map_err(nccl_err(&format!(
            "creating the {name} communicator (rank {} of {})",
            ctl.rank(),
            ctl.world_size()
        )))?;
        Ok(Arc::new(NcclGroup {
            control: ctl.clone(),
            comm: Mutex::new(Some(CommHandle(comm))),
            stream: stream.clone(),
            device: cuda.clone(),
            timeout,
            name,
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
    /// Runs one collective: `launch` enqueues it on the stream and returns the device buffer it
    /// fills; we wait for it, bounded by the collective timeout.
    fn run<T: DeviceRepr>(&self, op: &str, launch: impl FnOnce(&Comm, &Arc<CudaStream>) -> Result<CudaSlice<T>>) -> Result<CudaSlice<T>> {
        let mut guard = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        let Some(comm) = guard.as_ref() else {
            bail!("nccl {op} on the {} group: the communicator was aborted after an earlier failure", self.name);
        };
        let out = launch(&comm.0, &self.stream)?;
        let done = self.stream.record_event(None).map_err(nccl_err(op))?;
        let start = Instant::now();
        let mut spins = 0u32;
        while !done.try_is_complete().map_err(nccl_err(op))? {
            if start.elapsed() > self.timeout {
                // Frees the GPU from the stuck kernels; later calls see `None`.
                drop_quietly(guard.take());
                bail!(
                    "nccl {op} on the {} group did not complete within {:.0}s: another rank died or stopped calling collectives",
                    self.name,
                    self.timeout.as_secs_f64()
                );
            }
            // Spin briefly (most collectives finish in microseconds), then sleep.
            spins += 1;
            if spins < 2000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        Ok(out)
    }

    /// One collective from a 1-D tensor on this GPU into a new one of `out_len` values of the
    /// same dtype: NCCL reads the input's device memory and writes the output's. f32 for
    /// gradients and counts; bf16/f16 for all-gathers of parameters in `param_dtype` (half
    /// the traffic, as FSDP2 gathers).
    fn run_tensor(&self, op: TensorOp, input: &Tensor, out_len: usize) -> Result<Tensor> {
        match input.dtype() {
            DType::F32 => self.run_tensor_typed::<f32>(op, input, out_len),
            DType::BF16 => self.run_tensor_typed::<half::bf16>(op, input, out_len),
            DType::F16 => self.run_tensor_typed::<half::f16>(op, input, out_len),
            dt => bail!("nccl {}: expected an f32, bf16 or f16 tensor, got {dt:?}", op.name()),
        }
    }

    fn run_tensor_typed<T: NcclType + DeviceRepr + ValidAsZeroBits + CudaDType>(
        &self,
        op: TensorOp,
        input: &Tensor,
        out_len: usize,
    ) -> Result<Tensor> {
        let name = op.name();
        if input.rank() != 1 {
            bail!("nccl {name}: expected a 1-D tensor, got shape {:?}", input.shape());
        }
        let input = input.contiguous()?;
        let (storage, layout) = input.storage_and_layout();
        let Storage::Cuda(cuda) = &*storage else { bail!("nccl {name}: the tensor is not on the GPU") };
        let (start, end) = layout.contiguous_offsets().context("contiguous tensor")?;
        let send = cuda.as_cuda_slice::<T>()?.slice(start..end);
        let out = self.run(name, |comm, stream| {
            let mut recv = stream.alloc_zeros::<T>(out_len).map_err(nccl_err(name))?;
            match op {
                TensorOp::AllGather => comm.all_gather(&send, &mut recv).map(drop),
                TensorOp::ReduceScatter => comm.reduce_scatter(&send, &mut recv, &ReduceOp::Sum).map(drop),
                TensorOp::AllReduce => comm.all_reduce(&send, &mut recv, &ReduceOp::Sum).map(drop),
            }
            .map_err(nccl_err(name))?;
            Ok(recv)
        })?;
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(out, self.device.clone()));
        Ok(Tensor::from_storage(storage, out_len, BackpropOp::none(), false))
    }

    /// Host values as a tensor on this group's GPU (for the host-slice API).
    fn upload(&self, v: &[f32]) -> Result<Tensor> {
        Ok(Tensor::from_slice(v, v.len(), &Device::Cuda(self.device.clone()))?)
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
        let n = shard.elem_count() * self.world_size();
        self.run_tensor(TensorOp::AllGather, shard, n)
    }

    fn reduce_scatter_tensor(&self, full: &Tensor) -> Result<Tensor> {
        let world = self.world_size();
        if !full.elem_count().is_multiple_of(world) {
            bail!("reduce_scatter: {} values do not split over {world} ranks", full.elem_count());
        }
        self.run_tensor(TensorOp::ReduceScatter, full, full.elem_count() / world)
    }

    fn all_reduce_tensor(&self, data: &Tensor) -> Result<Tensor> {
        self.run_tensor(TensorOp::AllReduce, data, data.elem_count())
    }

    fn all_gather(&self, shard: &[f32]) -> Result<Vec<f32>> {
        Ok(self.all_gather_tensor(&self.upload(shard)?)?.to_vec1()?)
    }

    fn reduce_scatter(&self, full: &[f32]) -> Result<Vec<f32>> {
        Ok(self.reduce_scatter_tensor(&self.upload(full)?)?.to_vec1()?)
    }

    fn all_reduce(&self, data: &mut [f32]) -> Result<()> {
        data.copy_from_slice(&self.all_reduce_tensor(&self.upload(data)?)?.to_vec1::<f32>()?);
        Ok(())
    }

    fn all_reduce_f64(&self, data: &mut [f64]) -> Result<()> {
        let out = self.run("all_reduce_f64", |comm, stream| {
            let mut buf = stream.clone_htod(data).map_err(nccl_err("all_reduce_f64"))?;
            comm.all_reduce_in_place(&mut buf, &ReduceOp::Sum).map_err(nccl_err("all_reduce_f64"))?;
            Ok(buf)
        })?;
        data.copy_from_slice(&self.stream.clone_dtoh(&out).map_err(nccl_err("all_reduce_f64"))?);
        Ok(())
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
        let comm = self.comm.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop_quietly(comm);
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        let comm = self.comm.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        drop_quietly(comm);
    }
}

/// cudarc's `Comm` drop panics when ncclCommAbort fails (e.g. the driver is already tearing
/// down at exit); a failed clean-up must not turn into a panic.
fn drop_quietly(comm: Option<CommHandle>) {
    if let Some(c) = comm {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(c)));
    }
}
