//! Which flash kernel a launch takes where more than one is built for a pass: the variants that a
//! GPU measures against the defaults without a rebuild, each picked by an environment variable
//! (`run.sh ab` runs them side by side), and the rows a block of each covers.

use std::sync::OnceLock;

use candle_core::Result;

use super::ROWS;

/// The forward's kernel (its pass in [`super::kernel_name`]) and query rows a block: 16 a warp per
/// group, flash_attention.cu's `FORWARD_GROUPS(D)` groups (two at head dim 64, one at 128), or
/// at head dim 64 one group where `FSDP_FLASH_FORWARD_GROUPS=1` asks for it (the kernel built so
/// that a GPU can measure the two against each other without a rebuild).
pub(super) fn forward_kernel(head_dim: usize) -> Result<(&'static str, usize)> {
    static GROUPS: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    let groups = switch(&GROUPS, "FSDP_FLASH_FORWARD_GROUPS", "16-row groups a warp in the flash forward at head dim 64", [2, 1])?;
    Ok(match (head_dim, groups) {
        (64, 1) => ("forward_one_group", ROWS),
        (64, _) => ("forward", kernels::cuda::FLASH_FORWARD_GROUPS_D64 * ROWS),
        _ => ("forward", ROWS),
    })
}

/// A backward kernel (its pass in [`super::kernel_name`]) whose variant at head dim 64 stages 32 rows a
/// step where its default stages 64 (fewer registers, at twice the steps; the same bits): built so
/// that a GPU can measure the two without a rebuild.
/// At head dim 128 the kernel stages 32 either way.
pub(super) struct Staging {
    pass: &'static str,
    /// The 32-row kernel's pass.
    variant: &'static str,
    /// The switch that picks it (`=32`), and what it counts.
    var: &'static str,
    meaning: &'static str,
    chosen: OnceLock<std::result::Result<usize, String>>,
}

impl Staging {
    pub(super) fn kernel(&'static self, head_dim: usize) -> Result<&'static str> {
        Ok(match (head_dim, switch(&self.chosen, self.var, self.meaning, [64, 32])?) {
            (64, 32) => self.variant,
            _ => self.pass,
        })
    }
}

/// dq, by query rows: the keys it stages a step (`FSDP_FLASH_DQ_KEYS`).
pub(super) static DQ: Staging = Staging {
    pass: "backward_dq",
    variant: "backward_dq_k32",
    var: "FSDP_FLASH_DQ_KEYS",
    meaning: "keys a step of the flash dq kernel at head dim 64",
    chosen: OnceLock::new(),
};

/// dk and dv, by key rows: the queries they stage a step (`FSDP_FLASH_DKV_QUERIES`).
pub(super) static DKV: Staging = Staging {
    pass: "backward_dkv",
    variant: "backward_dkv_q32",
    var: "FSDP_FLASH_DKV_QUERIES",
    meaning: "queries a step of the flash dk/dv kernel at head dim 64",
    chosen: OnceLock::new(),
};

/// A kernel variant that the environment variable `var` picks, read once into `cell`: its
/// `default` where unset, else `default` or `other` (`meaning` says what the number counts).
fn switch(
    cell: &'static OnceLock<std::result::Result<usize, String>>,
    var: &str,
    meaning: &str,
    [default, other]: [usize; 2],
) -> Result<usize> {
    let chosen = cell.get_or_init(|| match std::env::var(var) {
        Err(_) => Ok(default),
        Ok(v) => match v.parse() {
            Ok(n) if n == default || n == other => Ok(n),
            _ => Err(format!("{var}: expected {default} or {other} ({meaning}), got {v:?}")),
        },
    });
    chosen.clone().map_err(candle_core::Error::Msg)
}
