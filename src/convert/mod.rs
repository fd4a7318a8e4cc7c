//! `fsdp-app convert --gguf FILE --out DIR`: a llama.cpp GGUF file to a Hugging Face model
//! directory that transformers (and fsdp-app) load as a normal Llama.

pub mod gguf_tokenizer;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::{self, Content};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use crate::model_files::write::StagedDir;
use crate::model_files::{load, read_model_config};

/// What a finished conversion wrote.
pub struct ConvertReport {
    pub out: PathBuf,
    pub tensors: usize,
    pub parameters: usize,
}

fn meta_u32(c: &Content, key: &str) -> Result<u32> {
    let v = c.metadata.get(key).with_context(|| format!("GGUF metadata has no `{key}`"))?;
    v.to_u32().or_else(|_| v.to_u64().map(|x| x as u32)).map_err(|e| anyhow::anyhow!("GGUF metadata `{key}`: {e}"))
}

fn meta_f32(c: &Content, key: &str) -> Result<f32> {
    let v = c.metadata.get(key).with_context(|| format!("GGUF metadata has no `{key}`"))?;
    v.to_f32().map_err(|e| anyhow::anyhow!("GGUF metadata `{key}`: {e}"))
}

fn meta_str(c: &Content, key: &str) -> Option<String> {
    c.metadata.get(key).and_then(|v| v.to_string().ok().cloned())
}

/// The Llama shape numbers from GGUF metadata.
struct LlamaDims {
    layers: usize,
    hidden: usize,
    intermediate: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    context: usize,
    rope_theta: f32,
    rms_eps: f32,
}

impl LlamaDims {
    fn read(c: &Content) -> Result<Self> {
        let p = "llama";
        let hidden = meta_u32(c, &format!("{p}.embedding_length"))? as usize;
        let heads = meta_u32(c, &format!("{p}.attention.head_count"))? as usize;
        let head_dim = meta_u32(c, &format!("{p}.rope.dimension_count")).map(|d| d as usize).unwrap_or(hidden / heads);
        Ok(Self {
            layers: meta_u32(c, &format!("{p}.block_count"))? as usize,
            hidden,
            intermediate: meta_u32(c, &format!("{p}.feed_forward_length"))? as usize,
            heads,
            kv_heads: meta_u32(c, &format!("{p}.attention.head_count_kv")).map(|d| d as usize).unwrap_or(heads),
            head_dim,
            context: meta_u32(c, &format!("{p}.context_length"))? as usize,
            rope_theta: meta_f32(c, &format!("{p}.rope.freq_base")).unwrap_or(10_000.0),
            rms_eps: meta_f32(c, &format!("{p}.attention.layer_norm_rms_epsilon"))?,
        })
    }
}

/// Maps a GGUF tensor name to its transformers name.
fn hf_name(gguf: &str) -> Option<String> {
    let fixed = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Some(n.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let hf = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// llama.cpp's converter interleaves the two rotary halves of each head in q_proj and k_proj
/// (`permute` in convert_hf_to_gguf.py: reshape (heads, 2, d/2, in), swap axes 1 and 2). This is
/// its inverse, giving back the rotate-half layout transformers' Llama expects.
fn unpermute_rows(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (out, inp) = w.dims2()?;
    let d = out / heads;
    Ok(w.reshape((heads, d / 2, 2, inp))?.transpose(1, 2)?.contiguous()?.reshape((out, inp))?)
}

pub fn convert_gguf(gguf_path: &Path, out: &Path, dtype: DType) -> Result<ConvertReport> {
    let mut file = std::fs::File::open(gguf_path).with_context(|| format!("{}: cannot open", gguf_path.display()))?;
    let content =
        gguf_file::Content::read(&mut file).map_err(|e| anyhow::anyhow!("{}: not a valid GGUF file: {e}", gguf_path.display()))?;
    let arch = meta_str(&content, "general.architecture").unwrap_or_default();
    if arch != "llama" {
        bail!(
            "{}: GGUF architecture {arch:?} is not supported by convert; supported: llama (Llama 2/3, Mistral and \
             SmolLM GGUFs use it)",
            gguf_path.display()
        );
    }
    if content.tensor_infos.contains_key("rope_freqs.weight") {
        bail!("{}: this GGUF carries Llama 3.1 rope frequency factors (rope_freqs.weight), which convert does not map back to rope_scaling yet", gguf_path.display());
    }
    let dims = LlamaDims::read(&content).with_context(|| format!("{}", gguf_path.display()))?;
    let tok = gguf_tokenizer::convert_tokenizer(&content).with_context(|| format!("{}", gguf_path.display()))?;
    let vocab_size = tok.tokenizer_json["model"]["vocab"].as_object().map(|v| v.len()).unwrap_or(0);
    let tied = !content.tensor_infos.contains_key("output.weight");

    let staged = StagedDir::new(out)?;
    let device = Device::Cpu;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut parameters = 0;
    for name in names {
        let hf = hf_name(name).with_context(|| format!("{}: unexpected GGUF tensor {name}", gguf_path.display()))?;
        let q =
            content.tensor(&mut file, name, &device).map_err(|e| anyhow::anyhow!("{}: reading tensor {name}: {e}", gguf_path.display()))?;
        let mut w = q.dequantize(&device)?;
        if name.ends_with("attn_q.weight") {
            w = unpermute_rows(&w, dims.heads)?;
        } else if name.ends_with("attn_k.weight") {
            w = unpermute_rows(&w, dims.kv_heads)?;
        }
        parameters += w.elem_count();
        tensors.insert(hf, w.to_dtype(dtype)?);
    }
    staged.write_safetensors("model.safetensors", &tensors)?;
    drop(tensors);

    let dtype_name = match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    };
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": dims.context,
        "rms_norm_eps": dims.rms_eps as f64,
        "rope_theta": dims.rope_theta as f64,
        "rope_scaling": null,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "tie_word_embeddings": tied,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id,
        "initializer_range": 0.02,
        "use_cache": true,
        "torch_dtype": dtype_name,
    });
    staged.write_json("config.json", &config)?;
    staged.write_json("tokenizer.json", &tok.tokenizer_json)?;
    let mut added_decoder = serde_json::Map::new();
    for t in &tok.added_tokens {
        let mut entry = t.clone();
        let id = entry["id"].to_string();
        entry.as_object_mut().unwrap().remove("id");
        added_decoder.insert(id, entry);
    }
    let mut tokenizer_config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "unk_token": tok.unk_token,
        "pad_token": tok.pad_token,
        "add_bos_token": tok.add_bos_token,
        "add_eos_token": false,
        "clean_up_tokenization_spaces": false,
        "model_max_length": dims.context,
        "added_tokens_decoder": Value::Object(added_decoder),
    });
    if let Some(t) = meta_str(&content, "tokenizer.chat_template") {
        tokenizer_config["chat_template"] = json!(t);
    }
    staged.write_json("tokenizer_config.json", &tokenizer_config)?;
    staged.write_json(
        "generation_config.json",
        &json!({"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}),
    )?;

    // Check what we wrote with the same code that loads models, before it becomes visible.
    let staged_path = staged.path().to_path_buf();
    let cfg = read_model_config(&staged_path.join("config.json"))?;
    let stored = load::read_weight_headers(&[staged_path.join("model.safetensors")])?;
    load::check_tensors(&cfg, &stored, &staged_path.display().to_string())?;
    crate::tokenize::load_tokenizer_json(&staged_path.join("tokenizer.json"))?;
    let n = stored.len();
    let out = staged.commit()?;
    Ok(ConvertReport { out, tensors: n, parameters })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's permute, written out, to check our inverse against.
    fn permute(w: &Tensor, heads: usize) -> Tensor {
        let (out, inp) = w.dims2().unwrap();
        w.reshape((heads, 2, out / heads / 2, inp)).unwrap().transpose(1, 2).unwrap().contiguous().unwrap().reshape((out, inp)).unwrap()
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        let w = Tensor::arange(0f32, 8.0 * 3.0, &Device::Cpu).unwrap().reshape((8, 3)).unwrap();
        let back = unpermute_rows(&permute(&w, 2), 2).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
        // And it is not the identity: rows really move.
        assert_ne!(permute(&w, 2).to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
    }

    #[test]
    fn tensor_names_map_to_transformers() {
        assert_eq!(hf_name("blk.12.attn_q.weight").unwrap(), "model.layers.12.self_attn.q_proj.weight");
        assert_eq!(hf_name("output_norm.weight").unwrap(), "model.norm.weight");
        assert!(hf_name("blk.1.attn_q.bias").is_none());
    }
}
