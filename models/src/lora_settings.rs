//! What a LoRA adapter is (PEFT's `LoraConfig`): rank, scale, dropout and targets, checked
//! against a model. Its own module because both the trained adapters (`lora`) and the served
//! ones (`multi_lora`) read it.

use anyhow::{bail, Result};

use crate::config::ModelConfig;
use crate::tensors::layer_tensors;

/// The linear modules of a decoder layer LoRA can target (PEFT matches on these names).
pub const LINEAR_MODULES: &[&str] = &["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

/// Rank, scale, dropout and targets of a LoRA adapter (PEFT's `LoraConfig` fields).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSettings {
    pub r: usize,
    pub alpha: f64,
    pub dropout: f64,
    /// Module names (`q_proj`, ...) or `all-linear`.
    pub targets: Vec<String>,
    pub use_rslora: bool,
}

/// PEFT's `LoraConfig` defaults, the one place fsdp-app writes them (the `finetune` flags, YAML
/// files and the jobs API all start here): r 8, alpha 8, no dropout, and for Llama-family
/// models PEFT's target modules q_proj and v_proj.
impl Default for LoraSettings {
    fn default() -> Self {
        Self { r: 8, alpha: 8.0, dropout: 0.0, targets: vec!["q_proj".into(), "v_proj".into()], use_rslora: false }
    }
}

impl LoraSettings {
    pub fn scaling(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }

    /// Whether the linear module at `path` (e.g. `model.layers.3.self_attn.q_proj`) is adapted.
    /// PEFT's rule: a target matches the full name or its last dotted components.
    pub fn targets_module(&self, path: &str) -> bool {
        self.targets.iter().any(|t| {
            if t == "all-linear" {
                return LINEAR_MODULES.iter().any(|m| path.ends_with(&format!(".{m}")));
            }
            path == t || path.ends_with(&format!(".{t}"))
        })
    }

    /// Checks the settings against a model: positive rank, dropout in [0, 1), and every target
    /// matching at least one module (the error lists the modules that exist).
    pub fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        if self.r == 0 {
            bail!("--lora-r must be at least 1");
        }
        if !(0.0..1.0).contains(&self.dropout) {
            bail!("--lora-dropout {} must be in [0, 1)", self.dropout);
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            bail!("--lora-alpha {} must be a positive number", self.alpha);
        }
        if self.targets.is_empty() {
            bail!("--lora-targets is empty; modules of this model: {}", LINEAR_MODULES.join(", "));
        }
        let modules = linear_modules(cfg);
        for t in &self.targets {
            let one = LoraSettings { targets: vec![t.clone()], ..self.clone() };
            if !modules.iter().any(|(path, _, _)| one.targets_module(path)) {
                bail!(
                    "--lora-targets {t:?} matches no module of this model; its linear modules are: {} (or all-linear)",
                    LINEAR_MODULES.join(", ")
                );
            }
        }
        Ok(())
    }
}

/// Every linear module of the decoder layers: (path, in_features, out_features), layer by layer.
pub fn linear_modules(cfg: &ModelConfig) -> Vec<(String, usize, usize)> {
    let mut out = vec![];
    for i in 0..cfg.num_hidden_layers {
        for t in layer_tensors(cfg, i) {
            if let Some(path) = t.name.strip_suffix(".weight") {
                if t.shape.len() == 2 {
                    out.push((path.to_string(), t.shape[1], t.shape[0]));
                }
            }
        }
    }
    out
}
