//! Group relative policy optimisation (Shao et al., 2024) as TRL's `GRPOTrainer` does it:
//! for each prompt, G completions sampled from the current policy, scored by graders, their
//! rewards normalised within the group into advantages, then a clipped policy-gradient loss with
//! an optional KL term to the reference model.
//!
//! - [`settings`]: `--method grpo`'s settings, by TRL's names and defaults;
//! - [`loss`]: the per-token loss and its normalisations (`loss_type`), from the last stage's
//!   logits, with the statistics TRL logs;
//! - [`advantages`]: rewards to advantages (`scale_rewards`) and the reward statistics;
//! - [`graders`]: OpenAI's grader shapes and a command grader;
//! - [`prompts`]: the prompt rows (TRL's and OpenAI's RFT rows).
//!
//! The rollouts themselves and the step that joins these parts are the trainer's
//! (`finetune::grpo_step`): this module knows no engine.

pub mod advantages;
pub mod graders;
pub mod loss;
pub mod prompts;
pub mod settings;

pub use settings::{GrpoLossType, GrpoSettings, ScaleRewards};

/// A GRPO run's settings, its grader, and (for tests that must not sample) given rollouts.
#[derive(Debug, Clone)]
pub struct GrpoConfig {
    pub settings: GrpoSettings,
    /// What scores the completions (`--grader`); `None` only with `given`.
    pub grader: Option<graders::Grader>,
    /// Completions and rewards to train on instead of sampled and graded ones: teacher
    /// forcing, for checking the loss against a reference implementation where sampling could
    /// never match another RNG. Not a command-line option.
    pub given: Option<GivenRollouts>,
}

/// For each data row (prompt), `num_generations` completions (token ids, eos included) and
/// their rewards.
#[derive(Debug, Clone, PartialEq)]
pub struct GivenRollouts {
    pub completions: Vec<Vec<Vec<u32>>>,
    pub rewards: Vec<Vec<f64>>,
}
