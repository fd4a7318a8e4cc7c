//! `fsdp-app launch`: this node's ranks as processes with torchrun's variables. The flags are
//! torchrun's, in both its spellings (`--nproc_per_node` and `--nproc-per-node`), so existing
//! launch scripts keep working: `--standalone`, a static `--rdzv-endpoint HOST:PORT`, and
//! `--max-restarts 0` too. What torchrun does and we do not (restarting failed ranks, dynamic
//! rendezvous across nodes) is refused naming the flag. `--config FILE` reads Accelerate's
//! launch keys (num_processes, num_machines, machine_rank, main_process_ip, main_process_port,
//! gpu_ids) and hands the file to the `finetune` it starts; flags given here win.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use fsdp_app::dist::launch::LaunchConfig;
use fsdp_app::train::accelerate_config::LaunchSettings;

#[derive(Args)]
pub struct LaunchArgs {
    /// Ranks (processes) on this node: a number, or torchrun's `auto` (one per GPU, else one
    /// per CPU core), `gpu` or `cpu`.
    #[arg(long, alias = "nproc_per_node")]
    nproc_per_node: Option<String>,
    /// Nodes in the job (default 1).
    #[arg(long)]
    nnodes: Option<usize>,
    /// This node's index (default 0).
    #[arg(long, alias = "node_rank")]
    node_rank: Option<usize>,
    /// An Accelerate config file (as `accelerate config` writes it) or an fsdp-app one: its
    /// launch keys set what these flags do not, and a `finetune` command gets `--config FILE`.
    #[arg(long, alias = "config_file", alias = "config-file")]
    config: Option<PathBuf>,
    /// Address of the node running rank 0.
    #[arg(long, alias = "master_addr")]
    master_addr: Option<String>,
    #[arg(long, alias = "master_port")]
    master_port: Option<u16>,
    /// One node, rank 0 on this machine at a free port (torchrun's --standalone).
    #[arg(long)]
    standalone: bool,
    /// Where rank 0 listens, HOST:PORT (torchrun's static rendezvous; instead of
    /// --master-addr/--master-port).
    #[arg(long, alias = "rdzv_endpoint")]
    rdzv_endpoint: Option<String>,
    /// torchrun's rendezvous backend: `static`, or `c10d` on one node (the same thing there).
    #[arg(long, alias = "rdzv_backend")]
    rdzv_backend: Option<String>,
    /// Only 0: a failed rank ends the job (resume it from its last checkpoint with --resume).
    #[arg(long, alias = "max_restarts", default_value_t = 0)]
    max_restarts: u32,
    /// Seconds the other ranks get to stop by themselves after one fails, before being killed.
    #[arg(long, default_value_t = 30)]
    grace: u64,
    /// The command each rank runs, e.g. `finetune --model ...` (after `--`, or simply last as
    /// torchrun takes its script).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<String>,
}

/// Runs the job `args` describes.
pub fn run(args: LaunchArgs) -> Result<()> {
    fsdp_app::dist::launch::launch(&args.into_config()?)
}

impl LaunchArgs {
    /// torchrun's flags resolved to one rendezvous address and a rank count, or why not.
    fn into_config(self) -> Result<LaunchConfig> {
        if self.max_restarts != 0 {
            bail!("--max-restarts {}: fsdp-app does not restart failed ranks; a failed job ends, and `finetune --resume` continues it from its last checkpoint", self.max_restarts);
        }
        let file = match &self.config {
            // The whole file is checked now, so a refused key stops the job before any rank runs.
            Some(path) => {
                fsdp_app::train::config_file::load(path)?;
                fsdp_app::train::accelerate_config::launch_settings(path)?
            }
            None => LaunchSettings::default(),
        };
        let nnodes = self.nnodes.or(file.num_machines).unwrap_or(1);
        let node_rank = self.node_rank.or(file.machine_rank).unwrap_or(0);
        let nproc_per_node = match (&self.nproc_per_node, file.num_processes) {
            (Some(n), _) => parse_nproc(n)?,
            // Accelerate's num_processes counts every machine's processes.
            (None, Some(total)) if nnodes > 0 && total % nnodes == 0 && total > 0 => total / nnodes,
            (None, Some(total)) => {
                bail!("num_processes {total} in {} is not a multiple of {nnodes} machines", self.config.as_ref().unwrap().display())
            }
            (None, None) => bail!("--nproc-per-node is required (or num_processes in an Accelerate --config file)"),
        };
        let master_addr_flag = self.master_addr.clone().or(file.main_process_ip.clone());
        let master_port_flag = self.master_port.or(file.main_process_port);
        let explicit = self.master_addr.is_some() || self.master_port.is_some();
        let (master_addr, master_port) = match (&self.rdzv_endpoint, self.standalone) {
            (Some(_), true) => {
                bail!("--standalone picks its own rendezvous address; drop --rdzv-endpoint {}", self.rdzv_endpoint.as_deref().unwrap())
            }
            (Some(_), false) if explicit => {
                bail!("--rdzv-endpoint and --master-addr/--master-port both say where rank 0 listens: give one")
            }
            (Some(endpoint), false) => parse_endpoint(endpoint)?,
            (None, true) => {
                if nnodes != 1 {
                    bail!("--standalone is one node, but --nnodes is {nnodes}");
                }
                if explicit {
                    bail!("--standalone picks its own rendezvous address; drop --master-addr/--master-port");
                }
                ("127.0.0.1".to_string(), free_local_port()?)
            }
            (None, false) => (
                master_addr_flag.unwrap_or_else(|| "127.0.0.1".to_string()),
                master_port_flag.unwrap_or(fsdp_app::dist::env::DEFAULT_MASTER_PORT),
            ),
        };
        match self.rdzv_backend.as_deref() {
            None | Some("static") => {}
            Some("c10d") if nnodes == 1 => {}
            Some("c10d") => bail!("--rdzv-backend c10d: dynamic rendezvous across nodes is not supported; use the static one (give each node its --node-rank)"),
            Some(other) => bail!("--rdzv-backend {other}: not supported (use static, or c10d on one node)"),
        }
        let mut command = self.command;
        if let Some(path) = &self.config {
            let given = path.to_string_lossy().to_string();
            if command.first().map(String::as_str) == Some("finetune") && !command.contains(&given) {
                command.splice(1..1, ["--config".to_string(), given]);
            }
        }
        Ok(LaunchConfig {
            nproc_per_node,
            nnodes,
            node_rank,
            master_addr,
            master_port,
            grace: std::time::Duration::from_secs(self.grace),
            command,
            env: file.gpu_ids.map(|ids| vec![("CUDA_VISIBLE_DEVICES".to_string(), ids)]).unwrap_or_default(),
        })
    }
}

/// `HOST:PORT` (IPv6 hosts in brackets, as torchrun writes them).
fn parse_endpoint(endpoint: &str) -> Result<(String, u16)> {
    let bad = || format!("--rdzv-endpoint {endpoint}: expected HOST:PORT, e.g. 10.0.0.1:29500");
    let (host, port) = endpoint.rsplit_once(':').with_context(bad)?;
    let port: u16 = port.parse().ok().filter(|p| *p > 0).with_context(bad)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        bail!(bad());
    }
    Ok((host.to_string(), port))
}

/// torchrun's `--nproc-per-node`: a count, `gpu` (the visible GPUs), `cpu` (the usable cores)
/// or `auto` (GPUs when there are any, else cores).
fn parse_nproc(value: &str) -> Result<usize> {
    let cores = || std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    match value {
        "cpu" => Ok(cores()),
        "gpu" => match visible_gpus() {
            0 => bail!("--nproc-per-node gpu: no GPU is visible on this machine (CUDA_VISIBLE_DEVICES, /proc/driver/nvidia/gpus)"),
            n => Ok(n),
        },
        "auto" => Ok(match visible_gpus() {
            0 => cores(),
            n => n,
        }),
        n => {
            n.parse().ok().filter(|n| *n > 0).with_context(|| format!("--nproc-per-node {n}: expected a positive number, auto, gpu or cpu"))
        }
    }
}

/// GPUs a rank could use: CUDA_VISIBLE_DEVICES when set, else the NVIDIA driver's device list.
fn visible_gpus() -> usize {
    if let Ok(v) = std::env::var("CUDA_VISIBLE_DEVICES") {
        return v.split(',').filter(|d| !d.trim().is_empty() && !d.trim().starts_with('-')).count();
    }
    std::fs::read_dir("/proc/driver/nvidia/gpus").map(|d| d.count()).unwrap_or(0)
}

/// A port nothing listens on now, for --standalone (as torchrun picks one).
fn free_local_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("--standalone: finding a free local port")?;
    Ok(listener.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_and_rank_counts_parse_as_torchrun_writes_them() {
        assert_eq!(parse_endpoint("10.0.0.1:29500").unwrap(), ("10.0.0.1".to_string(), 29500));
        assert_eq!(parse_endpoint("[::1]:1234").unwrap(), ("::1".to_string(), 1234));
        for bad in ["10.0.0.1", ":29500", "host:port", "host:0"] {
            assert!(parse_endpoint(bad).unwrap_err().to_string().contains("--rdzv-endpoint"), "{bad}");
        }
        assert_eq!(parse_nproc("3").unwrap(), 3);
        assert_eq!(parse_nproc("cpu").unwrap(), std::thread::available_parallelism().unwrap().get());
        assert!(parse_nproc("0").unwrap_err().to_string().contains("--nproc-per-node 0"));
        assert!(parse_nproc("many").unwrap_err().to_string().contains("auto, gpu or cpu"));
    }
}
