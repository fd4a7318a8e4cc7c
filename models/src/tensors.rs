//! The list of tensors (name and shape) a checkpoint of a given config must contain.
//! Used to check a checkpoint before building the model, so that every missing, unexpected or
//! mis-shaped tensor is reported at once, by name.

use crate::config::ModelConfig;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
}

fn spec(name: impl Into<String>, shape: &[usize]) -> TensorSpec {
    TensorSpec { name: name.into(), shape: shape.to_vec() }
}

/// Tensors of decoder layer `i`, in a stable order.
pub fn layer_tensors(cfg: &ModelConfig, i: usize) -> Vec<TensorSpec> {
    let p = format!("model.layers.{i}");
    let (h, d, im) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let (q, kv) = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
    let mut v = vec![spec(format!("{p}.input_layernorm.weight"), &[h])];
    for (name, out, bias) in [("q_proj", q, cfg.qkv_bias), ("k_proj", kv, cfg.qkv_bias), ("v_proj", kv, cfg.qkv_bias)] {
        v.push(spec(format!("{p}.self_attn.{name}.weight"), &[out, h]));
        if bias {
            v.push(spec(format!("{p}.self_attn.{name}.bias"), &[out]));
        }
    }
    v.push(spec(format!("{p}.self_attn.o_proj.weight"), &[h, q]));
    if cfg.o_bias {
        v.push(spec(format!("{p}.self_attn.o_proj.bias"), &[h]));
    }
    if cfg.qk_norm {
        v.push(spec(format!("{p}.self_attn.q_norm.weight"), &[d]));
        v.push(spec(format!("{p}.self_attn.k_norm.weight"), &[d]));
    }
    v.push(spec(format!("{p}.post_attention_layernorm.weight"), &[h]));
    for (name, shape) in [("gate_proj", [im, h]), ("up_proj", [im, h]), ("down_proj", [h, im])] {
        v.push(spec(format!("{p}.mlp.{name}.weight"), &shape));
        if cfg.mlp_bias {
            v.push(spec(format!("{p}.mlp.{name}.bias"), &[shape[0]]));
        }
    }
    v
}

/// The embedding table's tensor.
pub const EMBED_WEIGHT: &str = "model.embed_tokens.weight";
/// An untied LM head's tensor.
pub const HEAD_WEIGHT: &str = "lm_head.weight";

/// The tensor the LM head multiplies by: its own, or with tied embeddings the embedding table
/// (one parameter, never two copies). The one place this is decided.
pub fn head_weight_name(cfg: &ModelConfig) -> &'static str {
    if cfg.tie_word_embeddings {
        EMBED_WEIGHT
    } else {
        HEAD_WEIGHT
    }
}

/// Every tensor of the model: embeddings, layers, final norm and (untied) LM head.
pub fn expected_tensors(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let mut v = vec![spec(EMBED_WEIGHT, &[cfg.vocab_size, cfg.hidden_size])];
    for i in 0..cfg.num_hidden_layers {
        v.extend(layer_tensors(cfg, i));
    }
    v.push(spec("model.norm.weight", &[cfg.hidden_size]));
    if !cfg.tie_word_embeddings {
        v.push(spec(HEAD_WEIGHT, &[cfg.vocab_size, cfg.hidden_size]));
    }
    v
}
