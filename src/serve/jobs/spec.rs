//! What a fine-tuning job is, typed: its status, its hyperparameters (OpenAI's) and our
//! extensions (`fsdp_app`), each default written once here. Requests are read into these
//! (`api`), the store keeps them as JSON, and the runner turns them into `finetune` settings.

use serde::{Deserialize, Serialize};

/// A job's status, OpenAI's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    ValidatingFiles,
    Queued,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobStatus {
    pub const ALL: [JobStatus; 6] = [Self::ValidatingFiles, Self::Queued, Self::Running, Self::Succeeded, Self::Failed, Self::Cancelled];
    /// Whose training processes may be alive.
    pub const ACTIVE: [JobStatus; 2] = [Self::ValidatingFiles, Self::Running];
    /// That no later status replaces.
    pub const FINAL: [JobStatus; 3] = [Self::Succeeded, Self::Failed, Self::Cancelled];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::ValidatingFiles => "validating_files",
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|x| x.as_str() == s)
    }

    pub fn is_final(self) -> bool {
        Self::FINAL.contains(&self)
    }

    /// `'a', 'b'` for an SQL `IN (...)`.
    pub fn sql_list(statuses: &[JobStatus]) -> String {
        statuses.iter().map(|s| format!("'{}'", s.as_str())).collect::<Vec<_>>().join(", ")
    }
}

impl std::fmt::Display for JobStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// OpenAI's `hyperparameters` ("auto" is the default).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hyperparameters {
    pub n_epochs: u64,
    /// Rows per step (pairs for DPO).
    pub batch_size: u64,
    /// Scales the base rate ([`base_learning_rate`]).
    pub learning_rate_multiplier: f64,
    /// DPO's beta: given exactly for `method.type` "dpo" (absent in jobs stored before DPO
    /// existed: supervised).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta: Option<f64>,
    /// Reinforcement fine-tuning's: given exactly for `method.type` "reinforcement".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_multiplier: Option<f64>,
    /// Reinforcement: evaluate on the validation file every this many steps (else at the end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_interval: Option<u64>,
    /// Reinforcement: completions per validation prompt (else as many as per training prompt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_samples: Option<u64>,
    /// Reinforcement fine-tuning's grader, as the request gave it (checked at creation). The
    /// job object shows it under `method.reinforcement.grader`, not among the hyperparameters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grader: Option<serde_json::Value>,
}

impl Default for Hyperparameters {
    fn default() -> Self {
        Self {
            n_epochs: 3,
            batch_size: 1,
            learning_rate_multiplier: 1.0,
            beta: None,
            compute_multiplier: None,
            eval_interval: None,
            eval_samples: None,
            grader: None,
        }
    }
}

impl Hyperparameters {
    /// OpenAI's `method.type`: "supervised", "dpo" or "reinforcement".
    pub fn method_type(&self) -> &'static str {
        match (self.beta, self.compute_multiplier) {
            (Some(_), _) => "dpo",
            (_, Some(_)) => "reinforcement",
            _ => "supervised",
        }
    }

    /// A reinforcement job's completions per prompt: TRL's 8 scaled by `compute_multiplier`
    /// (OpenAI's knob for the compute spent on exploring), at least 2.
    pub fn num_generations(&self) -> Option<usize> {
        self.compute_multiplier.map(|m| ((crate::train::grpo::settings::DEFAULT_NUM_GENERATIONS as f64 * m).round() as usize).max(2))
    }
}

/// The rate `learning_rate_multiplier` scales: 2e-5 for full fine-tuning, 2e-4 for LoRA (OpenAI
/// does not say its own).
pub fn base_learning_rate(lora: bool) -> f64 {
    if lora {
        2e-4
    } else {
        2e-5
    }
}

/// Our extensions of a job, under `fsdp_app`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobExtensions {
    /// Ranks (processes) the job trains on.
    pub world_size: u64,
    /// Tokens per row: min([`crate::train::DEFAULT_SEQ_LEN`], the model's context) unless given.
    pub seq_len: u64,
    pub max_steps: Option<u64>,
    /// Reinforcement jobs: the most tokens a completion may have (half of `seq_len` unless
    /// given; absent in jobs stored before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_length: Option<u64>,
    /// LoRA on the frozen base instead of full fine-tuning.
    pub lora: Option<JobLora>,
    /// With LoRA: also write the merged full model and serve that, instead of the adapter over
    /// the base (`fsdp_app.merge`; absent in jobs stored before it existed: false).
    #[serde(default)]
    pub merge: bool,
}

impl JobExtensions {
    /// A job that sets none, on a model of `context` tokens.
    pub fn defaults(context: usize) -> Self {
        Self {
            world_size: 1,
            seq_len: crate::train::DEFAULT_SEQ_LEN.min(context) as u64,
            max_steps: None,
            max_completion_length: None,
            lora: None,
            merge: false,
        }
    }
}

/// `fsdp_app.lora`: PEFT's settings, each unset one at `models::LoraSettings::default()`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobLora {
    pub r: u64,
    pub alpha: f64,
    pub dropout: f64,
    pub targets: Vec<String>,
}

impl Default for JobLora {
    fn default() -> Self {
        let d = models::LoraSettings::default();
        Self { r: d.r as u64, alpha: d.alpha, dropout: d.dropout, targets: d.targets }
    }
}
