//! `fsdp-app launch`: this node's ranks as processes with torchrun's variables.

use clap::Args;

#[derive(Args)]
pub struct LaunchArgs {
    /// Ranks (processes) on this node.
    #[arg(long)]
    nproc_per_node: usize,
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of the node running rank 0.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    #[arg(long, default_value_t = fsdp_app::dist::env::DEFAULT_MASTER_PORT)]
    master_port: u16,
    /// Seconds the other ranks get to stop by themselves after one fails, before being killed.
    #[arg(long, default_value_t = 30)]
    grace: u64,
    /// The command each rank runs (after `--`).
    #[arg(last = true, required = true)]
    command: Vec<String>,
}


impl From<LaunchArgs> for fsdp_app::dist::launch::LaunchConfig {
    fn from(a: LaunchArgs) -> Self {
        Self {
            nproc_per_node: a.nproc_per_node,
            nnodes: a.nnodes,
            node_rank: a.node_rank,
            master_addr: a.master_addr,
            master_port: a.master_port,
            grace: std::time::Duration::from_secs(a.grace),
            command: a.command,
        }
    }
}
