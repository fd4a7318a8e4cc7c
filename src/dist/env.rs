//! Who this process is in a multi-process job, read from the launcher's environment:
//! torchrun / `fsdp-app launch` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
//! Open MPI's mpirun (OMPI_COMM_WORLD_*), or Slurm's srun (SLURM_PROCID, SLURM_NTASKS, ...).

use anyhow::{bail, Context, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// Which launcher set the variables, for messages.
    pub launcher: &'static str,
}

pub const DEFAULT_MASTER_PORT: u16 = 29500;

fn var(get: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<usize>> {
    match get(name) {
        None => Ok(None),
        Some(v) => v.trim().parse().map(Some).with_context(|| format!("environment variable {name}={v:?} is not a number")),
    }
}

impl DistEnv {
    /// Reads the process environment; `None` when no launcher started this process.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_lookup(&|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let (rank, world, local, launcher) = if let (Some(r), Some(w)) = (var(get, "RANK")?, var(get, "WORLD_SIZE")?) {
            (r, w, var(get, "LOCAL_RANK")?.unwrap_or(0), "torchrun")
        } else if let (Some(r), Some(w)) = (var(get, "OMPI_COMM_WORLD_RANK")?, var(get, "OMPI_COMM_WORLD_SIZE")?) {
            (r, w, var(get, "OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0), "mpirun")
        } else if let (Some(r), Some(w)) = (var(get, "SLURM_PROCID")?, var(get, "SLURM_NTASKS")?) {
            (r, w, var(get, "SLURM_LOCALID")?.unwrap_or(0), "srun")
        } else {
            return Ok(None);
        };
        if world == 0 || rank >= world {
            bail!("{launcher} environment gives rank {rank} of world size {world}");
        }
        let master_addr = get("MASTER_ADDR").or_else(|| get("SLURM_LAUNCH_NODE_IPADDR")).unwrap_or_else(|| "127.0.0.1".into());
        let master_port = match get("MASTER_PORT") {
            Some(p) => p.trim().parse().with_context(|| format!("MASTER_PORT={p:?} is not a port number"))?,
            None => DEFAULT_MASTER_PORT,
        };
        Ok(Some(Self { rank, world_size: world, local_rank: local, master_addr, master_port, launcher }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<Option<DistEnv>> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        DistEnv::from_lookup(&move |k| m.get(k).cloned())
    }

    #[test]
    fn launchers_are_recognised() {
        assert_eq!(env(&[]).unwrap(), None);
        let t = env(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "1234")])
            .unwrap()
            .unwrap();
        assert_eq!(
            (t.rank, t.world_size, t.local_rank, t.master_addr.as_str(), t.master_port, t.launcher),
            (1, 4, 1, "10.0.0.1", 1234, "torchrun")
        );
        let m = env(&[("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "4")]).unwrap().unwrap();
        assert_eq!((m.rank, m.world_size, m.master_port, m.launcher), (3, 4, 29500, "mpirun"));
        let s = env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_LAUNCH_NODE_IPADDR", "10.1.1.1")]).unwrap().unwrap();
        assert_eq!((s.rank, s.master_addr.as_str(), s.launcher), (0, "10.1.1.1", "srun"));
        assert!(env(&[("RANK", "4"), ("WORLD_SIZE", "4")]).is_err());
        assert!(env(&[("RANK", "x"), ("WORLD_SIZE", "4")]).unwrap_err().to_string().contains("RANK"));
    }
}
