//! Many LoRA adapters over one base model at serving time, the S-LoRA / punica way: each linear
//! layer's base matmul runs once for every row of the batch, then each adapter's low-rank update
//! `scaling * B (A x)` only for the rows that asked for it (rows grouped by adapter). Rows with
//! no adapter get the base alone. The base weights are never copied or merged, so an adapter
//! costs its own tensors, not a model.
//!
//! This module knows nothing of files or requests: an adapter is built from tensors under our
//! module names (`model.layers.0.self_attn.q_proj.lora_A.weight`), a batch's rows say which
//! adapter each uses.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

use crate::lora_settings::LoraSettings;
use ops::lora_rows::{add_lora_rows, RowsUpdate};

/// One adapter ready to apply: for each module it adapts, `A` (r, in) and `Bᵀ` (r, out), both
/// contiguous in the compute dtype (the layout `lora_rows` reads row by row), and its scaling.
#[derive(Debug)]
pub struct ServingAdapter {
    pub name: String,
    /// Unique to this loaded instance in the process (a name may be unloaded and loaded again
    /// from other weights): what caches of its keys and values are keyed by.
    pub instance: u64,
    modules: HashMap<String, (Tensor, Tensor)>,
    scaling: f64,
}

/// The next [`ServingAdapter::instance`].
static NEXT_INSTANCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl ServingAdapter {
    /// From tensors named `<module>.lora_A.weight` / `<module>.lora_B.weight`, moved to `dev`
    /// in `dtype`. Every A needs its B (and the reverse), with ranks that agree.
    pub fn new(name: &str, settings: &LoraSettings, tensors: HashMap<String, Tensor>, dtype: DType, dev: &Device) -> Result<Self> {
        let mut modules = HashMap::new();
        for (a_name, a) in &tensors {
            let Some(module) = a_name.strip_suffix(".lora_A.weight") else {
                if !a_name.ends_with(".lora_B.weight") {
                    bail!("{a_name} is not a LoRA tensor (lora_A.weight / lora_B.weight)");
                }
                continue;
            };
            let b_name = format!("{module}.lora_B.weight");
            let Some(b) = tensors.get(&b_name) else { bail!("{a_name} has no {b_name}") };
            let (a, b) = (a.to_device(dev)?.to_dtype(dtype)?.contiguous()?, b.to_device(dev)?.to_dtype(dtype)?.contiguous()?);
            if a.rank() != 2 || b.rank() != 2 || a.dim(0)? != b.dim(1)? {
                bail!("{a_name} {:?} and {b_name} {:?} are not (r, in) and (out, r)", a.dims(), b.dims());
            }
            modules.insert(module.to_string(), (a, b.t()?.contiguous()?));
        }
        if modules.len() * 2 != tensors.len() {
            bail!("{} tensors, {} A/B pairs: a lora_B.weight has no lora_A.weight", tensors.len(), modules.len());
        }
        let instance = NEXT_INSTANCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Self { name: name.to_string(), instance, modules, scaling: settings.scaling() })
    }
}

/// Which rows of a forward's batch use which adapter.
#[derive(Debug, Clone, Default)]
pub struct RowAdapters {
    groups: Vec<Group>,
}

#[derive(Debug, Clone)]
struct Group {
    adapter: Arc<ServingAdapter>,
    /// The rows, as indices and as a u32 tensor of them; None when the group is every row (a
    /// prompt of its own).
    rows: Option<(Vec<u32>, Tensor)>,
}

impl RowAdapters {
    /// Every row uses `adapter` (or the base alone, when None).
    pub fn all(adapter: Option<&Arc<ServingAdapter>>) -> Self {
        Self { groups: adapter.map(|a| Group { adapter: a.clone(), rows: None }).into_iter().collect() }
    }

    /// Row r uses `per_row[r]`; rows of the same adapter (the same `Arc`) form one group.
    pub fn of_rows(per_row: &[Option<&Arc<ServingAdapter>>], dev: &Device) -> Result<Self> {
        let mut groups: Vec<(Arc<ServingAdapter>, Vec<u32>)> = vec![];
        for (r, a) in per_row.iter().enumerate() {
            let Some(a) = a else { continue };
            match groups.iter_mut().find(|(g, _)| Arc::ptr_eq(g, a)) {
                Some((_, rows)) => rows.push(r as u32),
                None => groups.push(((*a).clone(), vec![r as u32])),
            }
        }
        let groups = groups
            .into_iter()
            .map(|(adapter, rows)| {
                let rows = match rows.len() == per_row.len() {
                    true => None,
                    false => {
                        let tensor = Tensor::new(rows.as_slice(), dev)?;
                        Some((rows, tensor))
                    }
                };
                Ok(Group { adapter, rows })
            })
            .collect::<Result<_>>()?;
        Ok(Self { groups })
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// `y`, the base output of module `module` for input `x` (rows first), plus each adapter's
    /// update on its rows: one pass for all groups on the CPU in f32 (`ops::lora_rows`), else
    /// per group gather, `B (A x)`, scatter-add.
    pub(crate) fn apply(&self, module: &str, x: &Tensor, mut y: Tensor) -> candle_core::Result<Tensor> {
        let updates: Vec<(&Group, &Tensor, &Tensor)> =
            self.groups.iter().filter_map(|g| g.adapter.modules.get(module).map(|(a, bt)| (g, a, bt))).collect();
        if updates.is_empty() {
            return Ok(y);
        }
        let rows_updates: Vec<RowsUpdate> = updates
            .iter()
            .map(|(g, a, bt)| RowsUpdate { rows: g.rows.as_ref().map(|(r, _)| r.as_slice()), a, bt, scaling: g.adapter.scaling as f32 })
            .collect();
        if let Some(y) = add_lora_rows(x, &y, &rows_updates)? {
            return Ok(y);
        }
        for (g, a, bt) in updates {
            y = match &g.rows {
                None => (&y + (x.broadcast_matmul(&a.t()?)?.broadcast_matmul(bt)? * g.adapter.scaling)?)?,
                Some((_, rows)) => {
                    let delta = (x.index_select(rows, 0)?.broadcast_matmul(&a.t()?)?.broadcast_matmul(bt)? * g.adapter.scaling)?;
                    y.index_add(rows, &delta, 0)?
                }
            };
        }
        Ok(y)
    }
}
