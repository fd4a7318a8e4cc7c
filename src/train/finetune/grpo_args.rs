//! `--method grpo`'s flags, by TRL's `GRPOConfig` names, and their conversion into the run's
//! [`GrpoConfig`]. Given with another method, they are refused, not ignored.

use anyhow::{bail, Result};
use clap::Args;
use serde::{Deserialize, Serialize};

use crate::train::grpo::graders::Grader;
use crate::train::grpo::{GrpoConfig, GrpoSettings};

#[derive(Args, Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrpoArgs {
    /// GRPO: the grader that scores completions, a JSON or YAML file (OpenAI's string_check,
    /// text_similarity, multi; json_schema; command). See docs/grpo.md.
    #[arg(long)]
    pub grader: Option<std::path::PathBuf>,
    /// GRPO: completions sampled per prompt (TRL's default 8).
    #[arg(long)]
    pub num_generations: Option<usize>,
    /// GRPO: the most tokens a completion may have (TRL's default 256).
    #[arg(long)]
    pub max_completion_length: Option<usize>,
    /// GRPO: sampling temperature (default 1.0); the loss uses the same tempered distribution.
    #[arg(long)]
    pub temperature: Option<f64>,
    /// GRPO: nucleus sampling (default 1.0: off).
    #[arg(long)]
    pub top_p: Option<f64>,
    /// GRPO: sample among the K most likely tokens (default: all).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// GRPO: clipping of the probability ratio at 1 - epsilon (default 0.2).
    #[arg(long)]
    pub epsilon: Option<f64>,
    /// GRPO: upper clipping at 1 + epsilon_high (default: epsilon; DAPO uses 0.28).
    #[arg(long)]
    pub epsilon_high: Option<f64>,
    /// GRPO: optimizer steps per batch of rollouts (μ, default 1).
    #[arg(long)]
    pub num_iterations: Option<usize>,
    /// GRPO: KL coefficient to the reference model (default 0: no reference).
    #[arg(long)]
    pub beta: Option<f64>,
    /// GRPO: grpo, bnpo, dr_grpo or dapo (TRL's loss_type; default dapo).
    #[arg(long)]
    pub loss_type: Option<String>,
    /// GRPO: group, batch or none: what rewards are divided by (TRL's scale_rewards; default group).
    #[arg(long)]
    pub scale_rewards: Option<String>,
    /// GRPO: write every N-th step's rollouts to OUTPUT/rollouts.jsonl (default 1; 0: never).
    #[arg(long)]
    pub log_completions_steps: Option<usize>,
    /// GRPO: completions per evaluation prompt (--eval-data / --eval-split; default
    /// --num-generations).
    #[arg(long)]
    pub num_generations_eval: Option<usize>,
}

impl GrpoArgs {
    fn any_given(&self) -> Option<&'static str> {
        let given = [
            (self.grader.is_some(), "--grader"),
            (self.num_generations.is_some(), "--num-generations"),
            (self.max_completion_length.is_some(), "--max-completion-length"),
            (self.temperature.is_some(), "--temperature"),
            (self.top_p.is_some(), "--top-p"),
            (self.top_k.is_some(), "--top-k"),
            (self.epsilon.is_some(), "--epsilon"),
            (self.epsilon_high.is_some(), "--epsilon-high"),
            (self.num_iterations.is_some(), "--num-iterations"),
            (self.beta.is_some(), "--beta"),
            (self.loss_type.is_some(), "--loss-type"),
            (self.scale_rewards.is_some(), "--scale-rewards"),
            (self.log_completions_steps.is_some(), "--log-completions-steps"),
            (self.num_generations_eval.is_some(), "--num-generations-eval"),
        ];
        given.into_iter().find(|(g, _)| *g).map(|(_, name)| name)
    }

    /// The run's GRPO settings for `--method method` (`None` unless it is grpo).
    pub fn config(&self, method: &str) -> Result<Option<GrpoConfig>> {
        if method != "grpo" {
            if let Some(flag) = self.any_given() {
                bail!("{flag} applies to --method grpo (this run is --method {method})");
            }
            return Ok(None);
        }
        let d = GrpoSettings::default();
        let epsilon = self.epsilon.unwrap_or(d.epsilon);
        let settings = GrpoSettings {
            num_generations: self.num_generations.unwrap_or(d.num_generations),
            max_completion_length: self.max_completion_length.unwrap_or(d.max_completion_length),
            temperature: self.temperature.unwrap_or(d.temperature),
            top_p: self.top_p.unwrap_or(d.top_p),
            top_k: self.top_k,
            epsilon,
            epsilon_high: self.epsilon_high.unwrap_or(epsilon),
            num_iterations: self.num_iterations.unwrap_or(d.num_iterations),
            beta: self.beta.unwrap_or(d.beta),
            loss_type: self.loss_type.as_deref().map(str::parse).transpose()?.unwrap_or(d.loss_type),
            scale_rewards: self.scale_rewards.as_deref().map(str::parse).transpose()?.unwrap_or(d.scale_rewards),
            log_completions_steps: self.log_completions_steps.unwrap_or(d.log_completions_steps),
            num_generations_eval: self.num_generations_eval,
        };
        settings.validate()?;
        let Some(path) = &self.grader else {
            bail!("--method grpo needs --grader FILE: what scores the completions (see docs/grpo.md)");
        };
        Ok(Some(GrpoConfig { settings, grader: Some(Grader::from_file(path)?), given: None }))
    }
}
