//! One row of `OUTPUT/metrics.jsonl`, the run's record: a row per optimizer step and per
//! evaluation. The training writes it (`finetune::metrics_log`); the jobs runner and resume read
//! it back with the same types.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The file's name in the output directory.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// A finished optimizer step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRow {
    /// 1-based: steps done.
    pub step: usize,
    pub epoch: usize,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub tokens_per_s: f64,
    /// The largest of the ranks' peak RSS.
    pub peak_rss_bytes: Option<u64>,
    pub peak_rss_bytes_per_rank: Vec<u64>,
    pub step_s: f64,
    /// Real tokens of the global batch (padding not counted): what tokens/s and a job's
    /// `trained_tokens` count.
    pub tokens: u64,
    /// GPU runs: device memory in use on each rank at the end of the step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory_bytes_per_rank: Option<Vec<u64>>,
    /// DPO runs: TRL's statistics of the step (`rewards/chosen`, `rewards/rejected`,
    /// `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`).
    #[serde(flatten)]
    pub preference: BTreeMap<String, f64>,
}

/// An evaluation after step `step`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalRow {
    pub step: usize,
    pub eval_loss: f64,
    /// SFT runs (a token loss's perplexity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_perplexity: Option<f64>,
    /// DPO runs: the step row's statistics over the eval pairs, named `eval_rewards/chosen`, ...
    #[serde(flatten)]
    pub preference: BTreeMap<String, f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MetricsRow {
    // Tried first: a step row has no `eval_loss`.
    Eval(EvalRow),
    Step(StepRow),
}

impl MetricsRow {
    pub fn step(&self) -> usize {
        match self {
            Self::Eval(r) => r.step,
            Self::Step(r) => r.step,
        }
    }

    /// A line of the file; None for one that is not a row (a line cut short by a crash).
    pub fn parse(line: &str) -> Option<Self> {
        serde_json::from_str(line).ok()
    }
}
