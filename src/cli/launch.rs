//! `fsdp-app launch`: this node's ranks as processes with torchrun's variables. The flags are
//! torchrun's, in both its spellings (`--nproc_per_node` and `--nproc-per-node`), so existing
//! launch scripts keep working: `--standalone`, a static `--rdzv-endpoint HOST:PORT`, and
//! `--max-restarts 0` too. What torchrun does and we do not (restarting failed ranks, dynamic
//! rendezvous across nodes) is refused naming the flag.

use anyhow::{bail, Context, Result};
use clap::Args;
use fsdp_app::dist::launch::LaunchConfig;

#[derive(Args)]
pub struct LaunchArgs {
    /// Ranks (processes) on this node: a number, or torchrun's `auto` (one per GPU, else one
    /// per CPU core), `gpu` or `cpu`.
    #[arg(long, alias = "nproc_per_node")]
    nproc_per_node: String,
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    #[arg(long, alias = "node_rank", default_value_t = 0)]
    node_rank: usize,
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
        let explicit = self.master_addr.is_some() || self.master_port.is_some();
        let (master_addr, master_port) = match (&self.rdzv_endpoint, self.standalone) {
            (Some(_), true) => bail!("--standalone picks its own rendezvous address; drop --rdzv-endpoint {}", self.rdzv_endpoint.as_deref().unwrap()),
            (Some(_), false) if explicit => bail!("--rdzv-endpoint and --master-addr/--master-port both say where rank 0 listens: give one"),
            (Some(endpoint), false) => parse_endpoint(endpoint)?,
            (None, true) => {
                if self.nnodes != 1 {
                    bail!("--standalone is one node, but --nnodes is {}", self.nnodes);
                }
                if explicit {
                    bail!("--standalone picks its own rendezvous address; drop --master-addr/--master-port");
                }
                ("127.0.0.1".to_string(), free_local_port()?)
            }
            (None, false) => (
                self.master_addr.clone().unwrap_or_else(|| "127.0.0.1".to_string()),
                self.master_port.unwrap_or(fsdp_app::dist::env::DEFAULT_MASTER_PORT),
            ),
        };
        match self.rdzv_backend.as_deref() {
            None | Some("static") => {}
            Some("c10d") if self.nnodes == 1 => {}
            Some("c10d") => bail!("--rdzv-backend c10d: dynamic rendezvous across nodes is not supported; use the static one (give each node its --node-rank)"),
            Some(other) => bail!("--rdzv-backend {other}: not supported (use static, or c10d on one node)"),
        }
        Ok(LaunchConfig {
            nproc_per_node: parse_nproc(&self.nproc_per_node)?,
            nnodes: self.nnodes,
            node_rank: self.node_rank,
            master_addr,
            master_port,
            grace: std::time::Duration::from_secs(self.grace),
            command: self.command,
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
        n => n.parse().ok().filter(|n| *n > 0).with_context(|| format!("--nproc-per-node {n}: expected a positive number, auto, gpu or cpu")),
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
