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
    /// Fine-tuning, serving and everything else: long rayon matmuls, or cores shared with other
    /// work, which a spinning worker slows down.
    Train,
}

const SPIN: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";
static SPIN_SET_BY_USER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Two settings of candle's CPU threads, each applied unless the user set its variable; call it
/// before any tensor work (and any other thread).
/// - Its worker threads spin 25,000 times before parking while waiting for work; on small
///   machines the spinning steals the cores the compute needs (measured here: fine-tuning SmolLM2
///   on 2 cores ran 2.5x faster with 1,000), while decoding wants them awake (see
///   [`CpuWorkload`]).
/// - Without `RAYON_NUM_THREADS`, every candle matmul counts the physical cores again by reading
///   and parsing /proc/cpuinfo (candle 0.11's `utils::get_num_threads`): 8% of a 16-stream
///   serving profile (`show_cpuinfo`, `vsnprintf`). The same count, taken once, is set instead;
///   rayon's pool, which runs our own kernels, then has that many threads too (one per physical
///   core, as candle chose, instead of one per logical CPU).
pub fn tune_cpu_threads(workload: CpuWorkload) {
    let by_user = *SPIN_SET_BY_USER.get_or_init(|| std::env::var_os(SPIN).is_some());
    if !by_user {
        let spins = match workload {
            CpuWorkload::Decode => "100000",
            CpuWorkload::Train => "1000",
        };
        std::env::set_var(SPIN, spins);
    }
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", candle_core::utils::get_num_threads().to_string());
    }
}

/// For a child process of another workload (a serving process's fine-tuning job): the spin limit
/// this process chose is removed from its environment, so the child chooses its own; one the
/// user set is kept.
pub fn child_keeps_spin_limit(cmd: &mut std::process::Command) {
    if SPIN_SET_BY_USER.get() == Some(&false) {
        cmd.env_remove(SPIN);
    }
}

#[cfg(test)]
mod tests {
    /// The load-time constructor ran: mimalloc keeps freed memory in this process.
    #[test]
    fn mimalloc_never_purges() {
        // SAFETY: reads an integer option.
        assert_eq!(unsafe { super::mi_option_get(super::MI_OPTION_PURGE_DELAY) }, -1);
    }
}
