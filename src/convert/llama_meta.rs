//! What a llama.cpp GGUF file of a Llama-architecture model means in Hugging Face terms: the
//! tensor names, the shape numbers for config.json, the row order of q_proj/k_proj, and the side
//! files (config, tokenizer, tokenizer_config, generation_config) of an equivalent model
//! directory. Both `convert` (which writes such a directory) and loading a GGUF directly (which
//! keeps its quantised blocks) start here.

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{QStorage, QTensor};
use candle_core::{DType, Tensor};
use serde_json::{json, Value};

use super::gguf_tokenizer;

/// The file's architecture, refused unless it is Llama's layout (with the reason named).
pub fn check_llama(c: &Content, source: &str) -> Result<()> {
    let arch = meta_str(c, "general.architecture").unwrap_or_default();
    if arch != "llama" {
        bail!(
            "{source}: GGUF architecture {arch:?} is not supported; supported: llama (Llama 2/3, Mistral and SmolLM GGUFs \
             use it)"
        );
    }
    if c.tensor_infos.contains_key("rope_freqs.weight") {
        bail!("{source}: this GGUF carries Llama 3.1 rope frequency factors (rope_freqs.weight), which are not mapped back to rope_scaling yet");
    }
    Ok(())
}

fn meta_u32(c: &Content, key: &str) -> Result<u32> {
    let v = c.metadata.get(key).with_context(|| format!("GGUF metadata has no `{key}`"))?;
    v.to_u32().or_else(|_| v.to_u64().map(|x| x as u32)).map_err(|e| anyhow::anyhow!("GGUF metadata `{key}`: {e}"))
}

fn meta_f32(c: &Content, key: &str) -> Result<f32> {
    let v = c.metadata.get(key).with_context(|| format!("GGUF metadata has no `{key}`"))?;
    v.to_f32().map_err(|e| anyhow::anyhow!("GGUF metadata `{key}`: {e}"))
}

pub fn meta_str(c: &Content, key: &str) -> Option<String> {
    c.metadata.get(key).and_then(|v| v.to_string().ok().cloned())
}

/// The Llama shape numbers from GGUF metadata.
pub struct LlamaDims {
    pub layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub context: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
}

impl LlamaDims {
    pub fn read(c: &Content) -> Result<Self> {
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
pub fn hf_name(gguf: &str) -> Option<String> {
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
pub fn unpermute_rows(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (out, inp) = w.dims2()?;
    let d = out / heads;
    Ok(w.reshape((heads, d / 2, 2, inp))?.transpose(1, 2)?.contiguous()?.reshape((out, inp))?)
}

/// [`unpermute_rows`] on quantised blocks: each row of a GGUF matrix is its own run of blocks
/// (blocks run along the input dimension), so rows move as whole byte ranges and no value is
/// requantised.
pub fn unpermute_quantized_rows(w: &QTensor, heads: usize) -> Result<QTensor> {
    let (out, inp) = w.shape().dims2()?;
    let d = out / heads;
    let dtype = w.dtype();
    let row_bytes = inp / dtype.block_size() * dtype.type_size();
    let data = w.data()?;
    if data.len() != out * row_bytes {
        bail!("quantised {out}x{inp} {dtype:?} matrix holds {} bytes, expected {}", data.len(), out * row_bytes);
    }
    let mut moved = Vec::with_capacity(data.len());
    // Row r of the result is head h's row (i, half) in llama.cpp's order: out row
    // h*d + half*(d/2) + i comes from stored row h*d + 2*i + half.
    for h in 0..heads {
        for half in 0..2 {
            for i in 0..d / 2 {
                let src = h * d + 2 * i + half;
                moved.extend_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    let storage = QStorage::from_data(std::borrow::Cow::Owned(moved), &w.device(), dtype)?;
    Ok(QTensor::new(storage, (out, inp))?)
}

/// The transformers side files of the model in `c`.
pub struct SideFiles {
    pub config: Value,
    pub tokenizer_json: Value,
    pub tokenizer_config: Value,
    pub generation_config: Value,
}

/// Builds the side files; `dtype` is what config.json's `torch_dtype` says.
pub fn side_files(c: &Content, dtype: DType, source: &str) -> Result<SideFiles> {
    let dims = LlamaDims::read(c).with_context(|| source.to_string())?;
    let tok = gguf_tokenizer::convert_tokenizer(c).with_context(|| source.to_string())?;
    let vocab_size = tok.tokenizer_json["model"]["vocab"].as_object().map(|v| v.len()).unwrap_or(0);
    let tied = !c.tensor_infos.contains_key("output.weight");
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
    if let Some(t) = meta_str(c, "tokenizer.chat_template") {
        tokenizer_config["chat_template"] = json!(t);
    }
    let generation_config = json!({"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id});
    Ok(SideFiles { config, tokenizer_json: tok.tokenizer_json, tokenizer_config, generation_config })
}

impl SideFiles {
    /// Writes config.json, tokenizer.json, tokenizer_config.json and generation_config.json.
    pub fn write_into(&self, staged: &crate::model_files::write::StagedDir) -> Result<()> {
        staged.write_json("config.json", &self.config)?;
        staged.write_json("tokenizer.json", &self.tokenizer_json)?;
        staged.write_json("tokenizer_config.json", &self.tokenizer_config)?;
        staged.write_json("generation_config.json", &self.generation_config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;
    use candle_core::Device;

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
    fn quantized_rows_unpermute_like_dense_ones() {
        // 12 rows of 64 (two Q8_0 blocks each), three heads of 4 rows.
        let w = Tensor::arange(0f32, 12.0 * 64.0, &Device::Cpu).unwrap().reshape((12, 64)).unwrap();
        let w = (w.sin().unwrap() * 3.0).unwrap();
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_1] {
            let q = QTensor::quantize(&permute(&w, 3), dtype).unwrap();
            let dense = unpermute_rows(&q.dequantize(&Device::Cpu).unwrap(), 3).unwrap();
            let moved = unpermute_quantized_rows(&q, 3).unwrap();
            assert_eq!(moved.dtype(), dtype);
            assert_eq!(moved.dequantize(&Device::Cpu).unwrap().to_vec2::<f32>().unwrap(), dense.to_vec2::<f32>().unwrap(), "{dtype:?}");
        }
    }

    #[test]
    fn tensor_names_map_to_transformers() {
        assert_eq!(hf_name("blk.12.attn_q.weight").unwrap(), "model.layers.12.self_attn.q_proj.weight");
        assert_eq!(hf_name("output_norm.weight").unwrap(), "model.norm.weight");
        assert!(hf_name("blk.1.attn_q.bias").is_none());
    }
}
