//! `--method grpo`'s settings with TRL's `GRPOConfig` names and defaults, checked once.

use std::str::FromStr;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// How the per-token losses of a micro-batch become its loss (TRL's `loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GrpoLossType {
    /// Each completion's mean over its tokens, then the mean over completions (the paper's).
    Grpo,
    /// The micro-batch's token mean.
    Bnpo,
    /// The sum over tokens divided by completions × `max_completion_length` (Dr. GRPO).
    DrGrpo,
    /// The sum over tokens divided by the global batch's tokens (DAPO; TRL's default).
    #[default]
    Dapo,
}

impl FromStr for GrpoLossType {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "grpo" => Self::Grpo,
            "bnpo" => Self::Bnpo,
            "dr_grpo" => Self::DrGrpo,
            "dapo" => Self::Dapo,
            other => bail!("--loss-type {other:?}: expected grpo, bnpo, dr_grpo or dapo (TRL's loss_type names)"),
        })
    }
}

/// How rewards are scaled into advantages (TRL's `scale_rewards`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleRewards {
    /// Divided by the group's standard deviation (TRL's default).
    #[default]
    Group,
    /// Divided by the whole batch's standard deviation.
    Batch,
    /// Not divided (Dr. GRPO's recommendation).
    None,
}

impl FromStr for ScaleRewards {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "group" | "true" => Self::Group,
            "batch" => Self::Batch,
            "none" | "false" => Self::None,
            other => bail!("--scale-rewards {other:?}: expected group, batch or none"),
        })
    }
}

/// Everything `--method grpo` adds to a fine-tuning run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GrpoSettings {
    /// Completions per prompt (G).
    pub num_generations: usize,
    /// The most tokens a completion may have.
    pub max_completion_length: usize,
    /// Sampling temperature; the loss's log-probabilities are those of the same tempered
    /// distribution, as TRL computes them.
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: Option<usize>,
    /// Lower clipping bound of the probability ratio: `1 - epsilon`.
    pub epsilon: f64,
    /// Upper clipping bound: `1 + epsilon_high` (`epsilon` unless set).
    pub epsilon_high: f64,
    /// Optimizer steps on each batch of rollouts (μ).
    pub num_iterations: usize,
    /// The KL term's coefficient (0: no reference model is consulted).
    pub beta: f64,
    pub loss_type: GrpoLossType,
    pub scale_rewards: ScaleRewards,
    /// Write the rollouts of every N-th step to `OUTPUT/rollouts.jsonl` (0: never).
    pub log_completions_steps: usize,
    /// Completions per evaluation prompt (TRL's `num_generations_eval`; `num_generations` unless
    /// set).
    pub num_generations_eval: Option<usize>,
}

/// TRL's defaults.
pub const DEFAULT_NUM_GENERATIONS: usize = 8;
pub const DEFAULT_MAX_COMPLETION_LENGTH: usize = 256;
pub const DEFAULT_EPSILON: f64 = 0.2;

impl Default for GrpoSettings {
    fn default() -> Self {
        Self {
            num_generations: DEFAULT_NUM_GENERATIONS,
            max_completion_length: DEFAULT_MAX_COMPLETION_LENGTH,
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            epsilon: DEFAULT_EPSILON,
            epsilon_high: DEFAULT_EPSILON,
            num_iterations: 1,
            beta: 0.0,
            loss_type: GrpoLossType::default(),
            scale_rewards: ScaleRewards::default(),
            log_completions_steps: 1,
            num_generations_eval: None,
        }
    }
}

impl GrpoSettings {
    pub fn eval_generations(&self) -> usize {
        self.num_generations_eval.unwrap_or(self.num_generations)
    }

    /// Refuses settings TRL would refuse or that cannot work, naming the flag.
    pub fn validate(&self) -> Result<()> {
        if self.num_generations < 2 {
            bail!("--num-generations must be at least 2 (advantages compare a prompt's completions), got {}", self.num_generations);
        }
        if self.max_completion_length == 0 {
            bail!("--max-completion-length must be positive");
        }
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            bail!("--temperature must be above 0 for GRPO (its completions are sampled), got {}", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("--top-p must be in (0, 1], got {}", self.top_p);
        }
        if self.top_k == Some(0) {
            bail!("--top-k must be positive");
        }
        for (name, v) in [("--epsilon", self.epsilon), ("--epsilon-high", self.epsilon_high)] {
            if !(v.is_finite() && v > 0.0) {
                bail!("{name} must be a positive number, got {v}");
            }
        }
        if self.epsilon >= 1.0 {
            bail!("--epsilon {} would let the ratio's lower bound 1 - epsilon reach 0 or below", self.epsilon);
        }
        if self.num_generations_eval.is_some_and(|n| n < 2) {
            bail!("--num-generations-eval must be at least 2 (an evaluation's advantages compare a prompt's completions)");
        }
        if self.num_iterations == 0 {
            bail!("--num-iterations must be positive");
        }
        if !(self.beta.is_finite() && self.beta >= 0.0) {
            bail!("--beta must be 0 or above, got {}", self.beta);
        }
        Ok(())
    }
}
