//! What the binary sets for the whole process, and nothing else does: the allocator (declared
//! by `main` as `#[global_allocator]` with [`Allocator`]), its options, and the settings of
//! candle's and rayon's threads, made by one call to [`init`] before any thread exists. A
//! library never changes its process: tests and benches that link it get these only by calling
//! [`init`] themselves (the bench harnesses do).

use anyhow::{bail, Result};

use crate::memory::{mi_option_set, MI_OPTION_PURGE_DELAY};

/// The allocator of every fsdp-app process (`main` declares it): a retaining allocator, since
/// every candle op allocates its output and glibc hands big blocks back to the kernel only to
/// page-fault them in again on the next step.
pub use mimalloc::MiMalloc as Allocator;

/// The whole-process settings, in one call, first thing in `main` (after parsing the command
/// line, which starts no thread): mimalloc keeps freed memory ([`keep_freed_memory`]), candle's
/// and rayon's threads follow `workload` ([`tune_cpu_threads`]), and the kernel switches
/// (`FSDP_SIMD`, `FSDP_MATMUL`, `FSDP_K_BLOCKS`) are checked. `threads` overrides the thread count (the benches
/// compare at a fixed count). Refuses to run once a second thread exists: the thread settings
/// are environment variables that candle and rayon read, and writing the environment while
/// another thread may read it is undefined behaviour.
pub fn init(workload: CpuWorkload, threads: Option<usize>) -> Result<()> {
    let running = threads_running();
    if running > 1 {
        bail!("process::init: {running} threads already run; it must be called before any thread starts");
    }
    keep_freed_memory();
    tune_cpu_threads(workload, threads);
    kernels::simd::check_env().map_err(anyhow::Error::msg)
}

/// Threads of this process (from /proc; 1 where the OS does not tell).
fn threads_running() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(1, |d| d.count())
}

/// mimalloc returns ("purges") freed memory to the kernel after a delay; a training step frees
/// and reallocates the same large buffers every step, and each purge turns into page faults and
/// page clearing on the next step. Keep freed memory in the process instead (mimalloc reads the
/// option at each purge decision). A server asks for purges again
/// (`memory::purge_freed_memory_after`). The user's own MIMALLOC_PURGE_DELAY wins.
pub fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: sets a plain integer option; mimalloc reads it on its next purge decision.
    unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
}

/// What a process mostly does with the CPU, which decides how long candle's idle threads spin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuWorkload {
    /// One generation at a time (`generate`, `perplexity`): many short parallel products a
    /// token with a little serial work between them; a worker that parks must be woken for each
    /// (docs/design.md, process and threads).
    Decode,
    /// `finetune` as the only training process on this machine (its ranks, if several, are
    /// threads of it): every product and elementwise op of a step runs on candle's pool, with
    /// short serial stretches between them (candle's backward bookkeeping). A worker that
    /// parks quickly is asleep for many of them, and waking it costs more than the wait: it
    /// spins longer here (docs/design.md, process and threads).
    Finetune,
    /// Serving, rank processes sharing a machine, and everything else: cores shared with other
    /// work, which a spinning worker slows down.
    Shared,
}

/// The workload of a `finetune` process: [`CpuWorkload::Finetune`] unless a launcher started
/// several rank processes on this machine (torchrun's LOCAL_WORLD_SIZE, Open MPI's
/// OMPI_COMM_WORLD_LOCAL_SIZE), whose spinning workers would take each other's cores.
pub fn finetune_workload() -> CpuWorkload {
    finetune_workload_with(|var| std::env::var(var).ok())
}

/// [`finetune_workload`] with the environment read through `env`.
fn finetune_workload_with(env: impl Fn(&str) -> Option<String>) -> CpuWorkload {
    match local_rank_processes(env) {
        1 => CpuWorkload::Finetune,
        _ => CpuWorkload::Shared,
    }
}

/// Rank processes a launcher started on this machine (LOCAL_WORLD_SIZE from torchrun or
/// `launch`, Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE), this one among them; 1 when none did.
fn local_rank_processes(env: impl Fn(&str) -> Option<String>) -> usize {
    let local_ranks = |var: &str| env(var).and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(1);
    local_ranks("LOCAL_WORLD_SIZE").max(local_ranks("OMPI_COMM_WORLD_LOCAL_SIZE")).max(1)
}

const SPIN: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";
const SHARED_SPINS: &str = "1000";
static SPIN_SET_BY_USER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
const THREADS: &str = "RAYON_NUM_THREADS";
static THREADS_SET_BY_USER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Two settings of candle's CPU threads, each applied unless the user set its variable (the
/// thread count also when `threads` gives it); [`init`] calls it before any thread exists.
/// - Its worker threads spin 25,000 times before parking while waiting for work; where other
///   threads or processes share the cores the spinning steals the cores the compute needs,
///   while decoding and a lone fine-tuning process want them awake (see [`CpuWorkload`]).
/// - Without `RAYON_NUM_THREADS`, every candle matmul counts the physical cores again by reading
///   and parsing /proc/cpuinfo (candle 0.11's `utils::get_num_threads`), a visible share of a
///   serving profile. The same count, taken once, is set instead;
///   rayon's pool, which runs our own kernels, then has that many threads too (one per physical
///   core, as candle chose, instead of one per logical CPU), but never more than the CPUs this
///   process may run on ([`cpu_threads`]).
fn tune_cpu_threads(workload: CpuWorkload, threads: Option<usize>) {
    if !set_by_user(&SPIN_SET_BY_USER, SPIN) {
        let spins = match workload {
            CpuWorkload::Decode => "100000",
            CpuWorkload::Finetune => "20000",
            CpuWorkload::Shared => SHARED_SPINS,
        };
        std::env::set_var(SPIN, spins);
    }
    if let Some(n) = threads {
        set_by_user(&THREADS_SET_BY_USER, THREADS);
        std::env::set_var(THREADS, n.to_string());
    } else if !set_by_user(&THREADS_SET_BY_USER, THREADS) {
        std::env::set_var(THREADS, cpu_threads().to_string());
    }
}

/// Whether the user set `var`: read before the first change this process makes to it, and
/// remembered in `flag` (for [`child_tunes_its_own_threads`] and [`child_shares_cores`]).
fn set_by_user(flag: &std::sync::OnceLock<bool>, var: &str) -> bool {
    *flag.get_or_init(|| std::env::var_os(var).is_some())
}

/// Threads for candle's and rayon's pools: one per physical core (candle's count), but at most
/// this process's share of the CPUs it may use.
/// - candle counts the machine's cores in /proc/cpuinfo, blind to an affinity mask (taskset,
///   numactl, a Slurm or MPI binding, a container's cpuset) and to a CPU quota (`docker
///   --cpus`), which `available_parallelism` honours. Too many threads take turns on the
///   allowed CPUs, spinning at every barrier.
/// - Rank processes a launcher put on this machine split those CPUs between them (torchrun
///   gives each one OpenMP thread instead). Figures: docs/design.md, process and threads.
pub fn cpu_threads() -> usize {
    cpu_threads_with(candle_core::utils::get_num_threads(), std::thread::available_parallelism().map_or(1, |n| n.get()), |var| {
        std::env::var(var).ok()
    })
}

/// [`cpu_threads`] for candle's count of `cores`, `usable` CPUs and the environment `env`.
fn cpu_threads_with(cores: usize, usable: usize, env: impl Fn(&str) -> Option<String>) -> usize {
    cores.min(usable / local_rank_processes(env)).max(1)
}

/// For a child process that shares this machine's cores with this one (a serving process's
/// fine-tuning job): the child gets the spin limit of [`CpuWorkload::Shared`] (the child would
/// otherwise choose its own, a lone `finetune`'s); one the user set is kept.
pub fn child_shares_cores(cmd: &mut std::process::Command) {
    if SPIN_SET_BY_USER.get() == Some(&false) {
        cmd.env(SPIN, SHARED_SPINS);
    }
}

/// For a child fsdp-app process that tunes its threads itself (a rank `launch` starts, which
/// knows it is one of several on the machine): the settings [`tune_cpu_threads`] made for this
/// process are not passed on as if the user had made them; the user's own are.
pub fn child_tunes_its_own_threads(cmd: &mut std::process::Command) {
    if SPIN_SET_BY_USER.get() == Some(&false) {
        cmd.env_remove(SPIN);
    }
    if THREADS_SET_BY_USER.get() == Some(&false) {
        cmd.env_remove(THREADS);
    }
}

#[cfg(test)]
mod tests {
    use super::{cpu_threads_with, finetune_workload_with, CpuWorkload};
    use crate::memory::MI_OPTION_PURGE_DELAY;

    /// An environment of these variables only.
    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |var: &str| pairs.iter().find(|(k, _)| *k == var).map(|(_, v)| v.to_string())
    }

    /// A lone fine-tuning process keeps its idle threads spinning; rank processes that a
    /// launcher put several to a machine do not.
    #[test]
    fn finetune_spins_unless_rank_processes_share_the_machine() {
        assert_eq!(finetune_workload_with(env(&[])), CpuWorkload::Finetune);
        assert_eq!(finetune_workload_with(env(&[("LOCAL_WORLD_SIZE", "1"), ("WORLD_SIZE", "4")])), CpuWorkload::Finetune);
        assert_eq!(finetune_workload_with(env(&[("LOCAL_WORLD_SIZE", "2")])), CpuWorkload::Shared);
        assert_eq!(finetune_workload_with(env(&[("OMPI_COMM_WORLD_LOCAL_SIZE", "4")])), CpuWorkload::Shared);
    }

    /// Threads: candle's count of cores, at most the usable CPUs, shared by a machine's rank
    /// processes, never none.
    #[test]
    fn threads_share_the_usable_cpus_between_local_ranks() {
        assert_eq!(cpu_threads_with(16, 2, env(&[])), 2);
        assert_eq!(cpu_threads_with(8, 16, env(&[])), 8);
        assert_eq!(cpu_threads_with(16, 16, env(&[("LOCAL_WORLD_SIZE", "4")])), 4);
        assert_eq!(cpu_threads_with(16, 16, env(&[("OMPI_COMM_WORLD_LOCAL_SIZE", "3")])), 5);
        assert_eq!(cpu_threads_with(2, 2, env(&[("LOCAL_WORLD_SIZE", "4")])), 1);
        assert_eq!(cpu_threads_with(4, 1, env(&[("LOCAL_WORLD_SIZE", "0")])), 1);
    }

    /// After keep_freed_memory, mimalloc keeps freed memory in this process.
    #[test]
    fn mimalloc_never_purges() {
        super::keep_freed_memory();
        // SAFETY: reads an integer option.
        assert_eq!(unsafe { mi_option_get(MI_OPTION_PURGE_DELAY) }, -1);
    }

    extern "C" {
        fn mi_option_get(option: i32) -> std::ffi::c_long;
    }
}
