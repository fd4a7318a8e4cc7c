//! The Llama-family configuration, read from a Hugging Face `config.json`.
//!
//! One struct covers Llama 2/3, Mistral, Qwen2 and Qwen3: they differ only in a few switches
//! (biases on q/k/v, per-head q/k RMSNorm, rope scaling, sliding window). Both the transformers 4
//! layout (flat `rope_theta`, `rope_scaling`, `torch_dtype`) and the transformers 5 layout
//! (`rope_parameters`, `dtype`) are accepted.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;

/// The architectures this crate implements, as they appear in `config.json`'s `architectures`.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Architecture {
    /// The architecture of a `config.json` name: `...ForCausalLM`, or `...Model` for a checkpoint
    /// of the bare model without an LM head (embedding models: Qwen3-Embedding, e5-mistral).
    pub fn from_hf_name(name: &str) -> Result<Self> {
        Ok(match name {
            "LlamaModel" => Self::Llama,
            "MistralModel" => Self::Mistral,
            "Qwen2Model" => Self::Qwen2,
            "Qwen3Model" => Self::Qwen3,
            "LlamaForCausalLM" => Self::Llama,
            "MistralForCausalLM" => Self::Mistral,
            "Qwen2ForCausalLM" => Self::Qwen2,
            "Qwen3ForCausalLM" => Self::Qwen3,
            other => bail!(
                "unsupported architecture {other:?}; supported: {} (or the bare `...Model` of each, for embedding)",
                SUPPORTED_ARCHITECTURES.join(", ")
            ),
        })
    }

    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
        }
    }
}

/// How rotary frequencies are scaled (`rope_type` in transformers).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    Default,
    /// Positions divided by `factor`.
    Linear {
        factor: f64,
    },
    /// Llama 3.x frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// The checkpoint is the bare model (`architectures: ["Qwen3Model"]`): no LM head, so the
    /// embedding table stands in for it (tied); such a model is served for embeddings.
    pub headless: bool,
    /// Bias on q/k/v projections (Qwen2 always; Llama/Qwen3 when `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on o_proj (Llama's `attention_bias` covers o_proj too; Qwen2's does not).
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// Per-head RMSNorm on q and k before rope (Qwen3).
    pub qk_norm: bool,
    /// Attend to at most this many previous positions, self included (Mistral, Qwen2 when enabled).
    pub sliding_window: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The embedding's padding row (transformers' `padding_idx`): it receives no gradient from
    /// the lookup.
    pub pad_token_id: Option<u32>,
    /// `torch_dtype` / `dtype` as written in the file (informational).
    pub stored_dtype: Option<String>,
}

/// The raw JSON fields we read. Everything optional is defaulted the way transformers does.
#[derive(Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    sliding_window: Option<Value>,
    use_sliding_window: Option<bool>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
    pad_token_id: Option<Value>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    hidden_act: Option<String>,
}

/// Token ids may be `null`, a number, or a list of numbers.
pub fn token_id_list(v: &Option<Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect(),
        _ => vec![],
    }
}

fn required<T>(v: Option<T>, field: &str) -> Result<T> {
    v.with_context(|| format!("missing field `{field}`"))
}

impl ModelConfig {
    /// Parses `config.json` text. Errors name the missing or invalid field; the caller adds the path.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let raw: RawConfig = serde_json::from_str(text).context("invalid JSON")?;
        let archs = raw.architectures.clone().unwrap_or_default();
        let arch_name = archs.first().context(format!("missing field `architectures` (one of: {})", SUPPORTED_ARCHITECTURES.join(", ")))?;
        let architecture = Architecture::from_hf_name(arch_name)?;
        let headless = !arch_name.ends_with("ForCausalLM");
        if let Some(act) = &raw.hidden_act {
            if act != "silu" {
                bail!("field `hidden_act` is {act:?}; only \"silu\" is supported");
            }
        }
        let hidden_size = required(raw.hidden_size, "hidden_size")?;
        let num_attention_heads = required(raw.num_attention_heads, "num_attention_heads")?;
        let head_dim = raw.head_dim.unwrap_or(hidden_size / num_attention_heads.max(1));

        // transformers 5 folds rope_theta and the scaling into `rope_parameters`.
        let rope_obj = raw.rope_parameters.clone().or(raw.rope_scaling.clone());
        let rope_theta =
            raw.rope_theta.or_else(|| rope_obj.as_ref().and_then(|r| r.get("rope_theta")).and_then(Value::as_f64)).unwrap_or(10_000.0);
        let rope_scaling = parse_rope_scaling(rope_obj.as_ref())?;

        let attention_bias = raw.attention_bias.unwrap_or(false);
        let (qkv_bias, o_bias, qk_norm) = match architecture {
            Architecture::Qwen2 => (true, false, false),
            Architecture::Qwen3 => (attention_bias, attention_bias, true),
            Architecture::Llama | Architecture::Mistral => (attention_bias, attention_bias, false),
        };
        let window = raw.sliding_window.as_ref().and_then(Value::as_u64).map(|w| w as usize);
        let sliding_window = match architecture {
            Architecture::Mistral => window,
            // Qwen2/3 carry a window in config.json but use it only when `use_sliding_window`.
            Architecture::Qwen2 | Architecture::Qwen3 => {
                if raw.use_sliding_window.unwrap_or(false) {
                    window
                } else {
                    None
                }
            }
            Architecture::Llama => None,
        };
        let cfg = Self {
            architecture,
            vocab_size: required(raw.vocab_size, "vocab_size")?,
            hidden_size,
            intermediate_size: required(raw.intermediate_size, "intermediate_size")?,
            num_hidden_layers: required(raw.num_hidden_layers, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: raw.num_key_value_heads.unwrap_or(num_attention_heads),
            head_dim,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(2048),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false) || headless,
            headless,
            qkv_bias,
            o_bias,
            mlp_bias: raw.mlp_bias.unwrap_or(false),
            qk_norm,
            sliding_window,
            bos_token_id: token_id_list(&raw.bos_token_id).first().copied(),
            eos_token_ids: token_id_list(&raw.eos_token_id),
            pad_token_id: token_id_list(&raw.pad_token_id).first().copied(),
            stored_dtype: raw.dtype.or(raw.torch_dtype),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
        ];
        for (name, v) in positive {
            if v == 0 {
                bail!("field `{name}` must be positive");
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            bail!(
                "field `num_attention_heads` ({}) is not a multiple of `num_key_value_heads` ({})",
                self.num_attention_heads,
                self.num_key_value_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!("field `head_dim` ({}) must be even for rotary embeddings", self.head_dim);
        }
        Ok(())
    }
}

fn parse_rope_scaling(obj: Option<&Value>) -> Result<RopeScaling> {
    let Some(obj) = obj.filter(|v| v.is_object()) else {
        return Ok(RopeScaling::Default);
    };
    let kind = obj.get("rope_type").or_else(|| obj.get("type")).and_then(Value::as_str).unwrap_or("default");
    let f = |name: &str| -> Result<f64> {
        obj.get(name).and_then(Value::as_f64).with_context(|| format!("rope scaling `{kind}` needs field `{name}`"))
    };
    Ok(match kind {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear { factor: f("factor")? },
        "llama3" => RopeScaling::Llama3 {
            factor: f("factor")?,
            low_freq_factor: f("low_freq_factor")?,
            high_freq_factor: f("high_freq_factor")?,
            original_max_position_embeddings: f("original_max_position_embeddings")? as usize,
        },
        other => bail!("field `rope_scaling.rope_type` is {other:?}; supported: default, linear, llama3"),
    })
}
