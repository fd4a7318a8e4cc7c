//! How the ranks of a run come to be: threads of this process (`local`), or this process as one
//! rank under a launcher (`tcp`, `mpi`, `nccl`). Each rank then runs [`super::run_rank_phases`].

use std::time::Duration;

use anyhow::{bail, Context, Result};
use candle_core::Device;

use super::config::{shard_size, validate, Backend, FinetuneConfig};
use super::RunSummary;
use crate::dist::env::DistEnv;
use crate::dist::{DistError, ProcessGroups};

/// Runs this process's part of a fine-tune: all ranks as threads (`local` backend) when no
/// launcher started us, else this process's rank (`tcp`, `mpi` or `nccl` backend). The settings
/// are checked once here, for the run's world (the launcher's, else `--world-size`). Rank 0
/// gets the summary.
pub fn run(cfg: &FinetuneConfig, env: Option<&DistEnv>) -> Result<Option<RunSummary>> {
    let world = env.map_or(cfg.world_size, |e| e.world_size);
    validate(cfg, world)?;
    let backend = match (cfg.backend, env) {
        (Backend::Auto, None) => Backend::Local,
        (Backend::Auto, Some(_)) if cfg.device.is_cuda() && cfg!(feature = "nccl") => Backend::Nccl,
        (Backend::Auto, Some(e)) if e.launcher == "mpirun" && cfg!(feature = "mpi") => Backend::Mpi,
        (Backend::Auto, Some(_)) => Backend::Tcp,
        (b, _) => b,
    };
    match (backend, env) {
        (Backend::Local, None) => run_threads(cfg).map(Some),
        (Backend::Local, Some(e)) => bail!("--backend local runs ranks as threads, but {} started this process as one rank", e.launcher),
        (Backend::Tcp, None) => bail!("--backend tcp needs a launcher (fsdp-app launch, torchrun, srun or mpirun)"),
        (Backend::Tcp, Some(env)) => {
            let (groups, proxies) = crate::dist::tcp::connect(env, shard_size(cfg, world), cfg.collective_timeout)?;
            let result = run_rank(groups, cfg, None);
            proxies.wait_for_ranks(linger(&result, cfg));
            result
        }
        (Backend::Nccl, None) => bail!("--backend nccl needs a launcher (fsdp-app launch, torchrun, srun or mpirun): one process per GPU"),
        (Backend::Nccl, Some(env)) => run_nccl(cfg, env),
        (Backend::Mpi, _) => run_mpi(cfg, world),
        (Backend::Auto, _) => unreachable!(),
    }
}

#[cfg(feature = "mpi")]
fn run_mpi(cfg: &FinetuneConfig, world: usize) -> Result<Option<RunSummary>> {
    let session = crate::dist::mpi::MpiSession::init()?;
    let result = (|| {
        if session.world_size() != world {
            bail!(
                "MPI started {} ranks, but this run was checked for {world} (--world-size, or the launcher's environment)",
                session.world_size()
            );
        }
        let groups = session.groups(shard_size(cfg, world))?;
        run_rank(groups, cfg, None)
    })();
    // Every group is dropped by now; dropping the session finalises MPI.
    drop(session);
    result
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_cfg: &FinetuneConfig, _world: usize) -> Result<Option<RunSummary>> {
    bail!("this fsdp-app was built without MPI; rebuild with `cargo build --release --features mpi` (needs libopenmpi-dev)")
}

/// One process per GPU: NCCL for the step's collectives, the tcp backend as control plane.
#[cfg(feature = "nccl")]
fn run_nccl(cfg: &FinetuneConfig, env: &DistEnv) -> Result<Option<RunSummary>> {
    if !cfg.device.is_cuda() {
        bail!("--backend nccl runs on GPUs: add --device cuda");
    }
    // One Device per process: the communicators and the engine share its stream.
    let device = cfg.device.open(env.local_rank)?;
    let (groups, proxies) = crate::dist::nccl::connect(env, shard_size(cfg, env.world_size), cfg.collective_timeout, &device)?;
    let result = run_rank(groups, cfg, Some(device));
    proxies.wait_for_ranks(linger(&result, cfg));
    result
}

#[cfg(not(feature = "nccl"))]
fn run_nccl(_cfg: &FinetuneConfig, _env: &DistEnv) -> Result<Option<RunSummary>> {
    bail!("--backend nccl: this fsdp-app was built without NCCL; build one with tests/gpu/build-cuda.sh (features cuda,nccl)")
}

/// How long rank 0 waits, before its process exits, for the other ranks to disconnect. Its
/// proxy threads still have to deliver the last replies (the final barrier's, or why the run
/// failed): leaving at once closes their sockets first, and a rank whose run succeeded would
/// fail reading "rank 0 exited". After success the others leave right after that barrier.
fn linger<T>(result: &Result<T>, cfg: &FinetuneConfig) -> Duration {
    match result {
        Ok(_) => cfg.collective_timeout.min(Duration::from_secs(60)),
        Err(_) => Duration::from_secs(5),
    }
}

/// Runs the fine-tune with the `local` backend, one thread per rank (the library's entry for
/// runs in one process; checks the settings as [`run`] does).
pub fn run_local(cfg: &FinetuneConfig) -> Result<RunSummary> {
    validate(cfg, cfg.world_size)?;
    run_threads(cfg)
}

/// `--world-size` ranks as threads of this process, on checked settings.
fn run_threads(cfg: &FinetuneConfig) -> Result<RunSummary> {
    let world = cfg.world_size;
    let all_groups = crate::dist::local::create_process_groups(world, shard_size(cfg, world), cfg.collective_timeout);
    let handles: Vec<_> = all_groups
        .into_iter()
        .enumerate()
        .map(|(r, groups)| {
            let cfg = cfg.clone();
            std::thread::Builder::new()
                .name(format!("rank-{r}"))
                .spawn(move || run_rank(groups, &cfg, None))
                .expect("spawning a rank thread")
        })
        .collect();
    let mut summary = None;
    let mut errors = vec![];
    for (r, h) in handles.into_iter().enumerate() {
        match h.join() {
            Ok(Ok(s)) => summary = summary.or(s),
            Ok(Err(e)) => errors.push((r, e)),
            Err(_) => errors.push((r, anyhow::anyhow!("rank {r} panicked"))),
        }
    }
    if !errors.is_empty() {
        // The first rank whose error is not just "another rank failed" is the cause.
        let (r, e) = errors.iter().find(|(_, e)| !DistError::is_echo(e)).unwrap_or(&errors[0]);
        bail!("rank {r}: {e:#}");
    }
    summary.context("rank 0 returned no summary")
}

/// `device`: the rank's device when the backend already opened it (NCCL), else opened here.
fn run_rank(groups: ProcessGroups, cfg: &FinetuneConfig, device: Option<Device>) -> Result<Option<RunSummary>> {
    // Prefetch asked of a backend that runs collectives on the calling thread: they move to a
    // thread of their own, so that a started one runs while the rank computes.
    let groups = match cfg.prefetch == Some(true) && !groups.shard.overlaps_compute() {
        true => crate::dist::overlap::overlapped(groups),
        false => groups,
    };
    let result = super::run_rank_phases(&groups, cfg, device);
    if let Err(e) = &result {
        groups.abort(&format!("{e:#}"));
    }
    result
}
