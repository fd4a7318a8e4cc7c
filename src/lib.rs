//! fsdp-app: fine-tune and serve Hugging Face causal language models on candle.
//!
//! Modules, one job each: `model_files` finds and loads model files (local or Hub) and writes
//! them atomically; `checkpoint` is training state (sharded checkpoints, resume); `tokenize` wraps tokenizer.json and chat templates; `generate` runs
//! autoregressive generation; `convert` imports GGUF files; `fixtures` makes tiny test models;
//! `memory` reports process memory; `dist` is the process group and its
//! collectives; `fsdp` shards parameters and runs training steps; `train` holds data loading and
//! the fine-tuning loop; `serve` is the OpenAI-compatible HTTP server.

pub mod checkpoint;
pub mod convert;
pub mod device;
pub mod dist;
pub mod fixtures;
pub mod fsdp;
pub mod generate;
pub mod memory;
pub mod model_files;
pub mod serve;
pub mod tokenize;
pub mod train;

/// The process allocator for every binary built on this library (the CLI, tests, benches).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc returns ("purges") freed memory to the kernel after a delay; a training step frees
/// and reallocates the same large buffers every step, and each purge turns into page faults and
/// page clearing on the next step (up to 15% of a 28M-model step in profiles here). Keep freed memory in the
/// process instead. mimalloc applies the option only when set before its first allocations, so
/// this runs as a load-time constructor, before `main` and before the Rust runtime allocates.
#[cfg(target_os = "linux")]
#[used]
#[link_section = ".init_array"]
static KEEP_FREED_MEMORY_AT_LOAD: extern "C" fn() = {
    extern "C" fn at_load() {
        keep_freed_memory();
    }
    at_load
};

use memory::mi_option_set;
#[cfg(test)]
extern "C" {
    fn mi_option_get(option: i32) -> std::ffi::c_long;
}

use memory::MI_OPTION_PURGE_DELAY;

fn keep_freed_memory() {
    // The user's own MIMALLOC_PURGE_DELAY wins (mimalloc reads it itself).
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: sets a plain integer option; mimalloc reads it on its next purge decision.
    unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
}

/// What a process mostly does with the CPU, which decides how long candle's idle threads spin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuWorkload {
    /// One generation at a time (`generate`, `perplexity`): ~120 short parallel products a
    /// token with a little serial work between them; a worker that parks must be woken for each
    /// (measured on 2 cores: SmolLM2 decodes 10-20% faster with 100,000 spins than with 1,000).
    Decode,
    /// `finetune` as the only training process on this machine (its ranks, if several, are
    /// threads of it): every product and elementwise op of a step runs on candle's pool, with
    /// short serial stretches between them (candle's backward bookkeeping). A worker that
    /// parks after ~27 µs (1,000 spins) is asleep for many of them, and waking it costs more
    /// than the wait: the calling thread then ran products alone. With 20,000 (~0.5 ms) the
    /// 28M Llama trained 3-4% faster on 2 AVX2 cores (1,000 / 10,000 / 30,000 / 100,000 spins:
    /// 743 / 769 / 772 / 745 tokens/s, medians of 4 alternating runs), SmolLM2 and the
    /// 2-thread-rank world no slower.
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

/// Two settings of candle's CPU threads, each applied unless the user set its variable; call it
/// before any tensor work (and any other thread).
/// - Its worker threads spin 25,000 times before parking while waiting for work; where other
///   threads or processes share the cores the spinning steals the cores the compute needs
///   (measured here when gemm's rayon threads ran beside candle's pool: fine-tuning SmolLM2 on 2
///   cores ran 2.5x faster with 1,000), while decoding and a lone fine-tuning process want them
///   awake (see [`CpuWorkload`]).
/// - Without `RAYON_NUM_THREADS`, every candle matmul counts the physical cores again by reading
///   and parsing /proc/cpuinfo (candle 0.11's `utils::get_num_threads`): 8% of a 16-stream
///   serving profile (`show_cpuinfo`, `vsnprintf`). The same count, taken once, is set instead;
///   rayon's pool, which runs our own kernels, then has that many threads too (one per physical
///   core, as candle chose, instead of one per logical CPU), but never more than the CPUs this
///   process may run on ([`cpu_threads`]).
pub fn tune_cpu_threads(workload: CpuWorkload) {
    if !set_by_user(&SPIN_SET_BY_USER, SPIN) {
        let spins = match workload {
            CpuWorkload::Decode => "100000",
            CpuWorkload::Finetune => "20000",
            CpuWorkload::Shared => SHARED_SPINS,
        };
        std::env::set_var(SPIN, spins);
    }
    if !set_by_user(&THREADS_SET_BY_USER, THREADS) {
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
///   allowed CPUs, spinning at every barrier: a 28M Llama step under `taskset -c 2,3` on a
///   16-core Xeon ran at ~145 tokens/s with 16 threads, ~1,100 with 2.
/// - Rank processes a launcher put on this machine split those CPUs between them (torchrun
///   gives each one OpenMP thread instead): `launch --nproc-per-node 2` of the 28M Llama on 2
///   cores ran 560-640 tokens/s with a thread per rank, 498-575 with two (4 runs each).
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

    /// The load-time constructor ran: mimalloc keeps freed memory in this process.
    #[test]
    fn mimalloc_never_purges() {
        // SAFETY: reads an integer option.
        assert_eq!(unsafe { super::mi_option_get(super::MI_OPTION_PURGE_DELAY) }, -1);
    }
}
