//! One unit's place in the engine: its plan, its share of the state, and where its full
//! parameters are (not gathered, being gathered, gathered, or freed in place).

use std::collections::HashMap;

use anyhow::Result;
use candle_core::Tensor;

use super::reshard;
use super::shards::{HostState, StartedGather, UnitShards};
use crate::fsdp::plan::UnitPlan;

pub(super) struct UnitState {
    pub plan: UnitPlan,
    /// This rank's share of the unit's state, where it lives.
    pub shards: Box<dyn UnitShards>,
    /// With device state: its host copy, made by `sync_host` for checkpoints and inspection.
    pub host_copy: Option<HostState>,
    /// Where the unit's full parameters are.
    pub gathered: Gathered,
}

/// A unit's full parameters: not gathered, being gathered, gathered, or gathered with their
/// bytes freed. The trainable ones are variables (`Var`), so that a forward over them builds
/// the graph backward needs.
pub(super) enum Gathered {
    /// Only the shards exist.
    No,
    /// The all-gather was started (prefetch) and may still be running.
    Coming(StartedGather),
    /// Gathered and readable.
    Full(HashMap<String, Tensor>),
    /// The tensors stay (a kept graph points at them) but their bytes were freed in place
    /// (FULL_SHARD between a unit's forward and its backward, see `reshard`); the unit is
    /// refilled before it runs again. Their storage is left unreadable (`reshard::free`), so a
    /// read that escaped this state fails loudly.
    Freed(HashMap<String, Tensor>),
}

impl Gathered {
    /// The gathered tensors, readable or freed.
    pub fn tensors(&self) -> Option<&HashMap<String, Tensor>> {
        match self {
            Gathered::No | Gathered::Coming(_) => None,
            Gathered::Full(t) | Gathered::Freed(t) => Some(t),
        }
    }

    /// The gather started for these parameters, if one was (leaving them not gathered).
    pub fn take_started(&mut self) -> Option<StartedGather> {
        match std::mem::replace(self, Gathered::No) {
            Gathered::Coming(started) => Some(started),
            other => {
                *self = other;
                None
            }
        }
    }
}

impl UnitState {
    /// Moves the master chunks this unit's gathered tensors hold (`UnitShards::lend`) back to
    /// its storage, no copy, leaving the tensors freed.
    pub fn return_lent(&mut self) -> Result<()> {
        let Some(params) = self.gathered.tensors() else { return Ok(()) };
        let values = self.plan.params.iter().map(|p| reshard::take(&params[&p.spec.name])).collect::<candle_core::Result<_>>()?;
        self.shards.give_back(values)
    }
}
