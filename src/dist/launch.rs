//! `fsdp-app launch`: starts this node's ranks as child processes with torchrun's variables
//! (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and watches them:
//! when one fails, the others are stopped after a grace period (they normally stop by themselves,
//! saying which rank failed), and the launcher exits non-zero naming the failed ranks in the order
//! they ended. At the end it prints each rank's peak resident memory as the kernel counted it
//! (`wait4`'s `ru_maxrss`): a measurement from outside the ranks.

use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

#[derive(Debug, Clone)]
pub struct LaunchConfig {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// How long the other ranks get to stop on their own after one failed.
    pub grace: Duration,
    /// The fsdp-app subcommand and its arguments, run in every rank.
    pub command: Vec<String>,
    /// Extra environment of every rank (e.g. CUDA_VISIBLE_DEVICES from Accelerate's gpu_ids).
    pub env: Vec<(String, String)>,
}

fn describe(status: &ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return format!("was killed by signal {sig}");
        }
    }
    format!("exited with code {}", status.code().unwrap_or(-1))
}

/// Runs the ranks of this node until all succeed or one fails.
pub fn launch(cfg: &LaunchConfig) -> Result<()> {
    if cfg.nproc_per_node == 0 || cfg.nnodes == 0 {
        bail!("--nproc-per-node and --nnodes must be positive");
    }
    if cfg.node_rank >= cfg.nnodes {
        bail!("--node-rank {} must be below --nnodes {}", cfg.node_rank, cfg.nnodes);
    }
    if cfg.command.is_empty() {
        bail!("nothing to launch: give the command after `--`, e.g. `fsdp-app launch --nproc-per-node 2 -- finetune ...`");
    }
    let exe = std::env::current_exe().context("finding the fsdp-app executable")?;
    let world = cfg.nnodes * cfg.nproc_per_node;
    let mut children: Vec<(usize, Child)> = vec![];
    for local in 0..cfg.nproc_per_node {
        let rank = cfg.node_rank * cfg.nproc_per_node + local;
        let mut cmd = Command::new(&exe);
        // Each rank chooses its threads as one of LOCAL_WORLD_SIZE on this machine.
        crate::process::child_tunes_its_own_threads(&mut cmd);
        let child = cmd
            .args(&cfg.command)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", cfg.nproc_per_node.to_string())
            .env("MASTER_ADDR", &cfg.master_addr)
            .env("MASTER_PORT", cfg.master_port.to_string())
            .envs(cfg.env.iter().map(|(k, v)| (k, v)))
            .spawn()
            .with_context(|| format!("starting rank {rank}"))?;
        children.push((rank, child));
    }
    let mut failures: Vec<String> = vec![];
    let mut failed_at: Option<Instant> = None;
    let mut running: Vec<bool> = vec![true; children.len()];
    let mut peaks: Vec<Option<u64>> = vec![None; children.len()];
    while running.iter().any(|r| *r) {
        for (i, (rank, child)) in children.iter_mut().enumerate() {
            if !running[i] {
                continue;
            }
            if let Some((status, peak)) = try_wait_with_peak_rss(child)? {
                running[i] = false;
                peaks[i] = Some(peak);
                if !status.success() && failed_at.is_none_or(|t| t.elapsed() <= cfg.grace) {
                    failures.push(format!("rank {rank} {}", describe(&status)));
                    failed_at.get_or_insert_with(Instant::now);
                }
            }
        }
        if let Some(t) = failed_at {
            if t.elapsed() > cfg.grace {
                for (i, (_, child)) in children.iter_mut().enumerate() {
                    if running[i] {
                        let _ = child.kill();
                        let _ = child.wait();
                        running[i] = false;
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let report: Vec<String> = children
        .iter()
        .zip(&peaks)
        .filter_map(|((rank, _), peak)| peak.map(|b| format!("rank {rank} {}", crate::memory::human_bytes(b))))
        .collect();
    eprintln!("launch: peak RSS per rank (kernel's count): {}", report.join(", "));
    if !failures.is_empty() {
        // In the order they ended; each rank's own message (above) says what it saw.
        bail!("the job failed: {}", failures.join(", "));
    }
    Ok(())
}

/// `Child::try_wait` that also returns the child's peak resident set size in bytes, from the
/// kernel's accounting at reaping time (`wait4`), so no rank has to report its own memory.
fn try_wait_with_peak_rss(child: &mut Child) -> Result<Option<(ExitStatus, u64)>> {
    use std::os::unix::process::ExitStatusExt;
    let mut status: libc::c_int = 0;
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: plain syscall on our own child's pid with valid out-pointers.
    let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, libc::WNOHANG, &mut usage) };
    match pid {
        0 => Ok(None),
        p if p < 0 => Err(std::io::Error::last_os_error()).context("waiting for a rank"),
        // ru_maxrss is in KiB on Linux.
        _ => Ok(Some((ExitStatus::from_raw(status), usage.ru_maxrss as u64 * 1024))),
    }
}
