//! Tiny GGUF files for the tests: the tokenizer metadata of the real SmolLM2 GGUF over a small
//! random Llama (2 layers, hidden 256, so every k-quant's 256-value super-blocks fit), its
//! matrices quantised to a chosen format by candle's quantiser and written by candle's GGUF
//! writer in llama.cpp's layout (GGUF names, q/k rows in llama.cpp's interleaved rotary order).

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

pub const HIDDEN: usize = 256;
pub const INTERMEDIATE: usize = 512;
pub const LAYERS: usize = 2;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;

/// Deterministic values uniform in [-scale, scale).
fn random(dims: &[usize], seed: u64, scale: f32) -> Tensor {
    let mut state = seed;
    let n: usize = dims.iter().product();
    let values: Vec<f32> = (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(values, dims, &Device::Cpu).unwrap()
}

/// llama.cpp's `permute` of q/k rows (convert_hf_to_gguf.py).
fn permute(w: &Tensor, heads: usize) -> Tensor {
    let (out, inp) = w.dims2().unwrap();
    w.reshape((heads, 2, out / heads / 2, inp)).unwrap().transpose(1, 2).unwrap().contiguous().unwrap().reshape((out, inp)).unwrap()
}

/// Writes the tiny model to `out` with every matrix (the tied embedding too) in `format`, and
/// returns the weights the file holds, dequantised, by transformers name: the reference a
/// dense model is built from.
pub fn write_tiny_gguf(smollm2: &Path, format: GgmlDType, out: &Path) -> HashMap<String, Tensor> {
    let mut f = std::fs::File::open(smollm2).unwrap();
    let source = gguf_file::Content::read(&mut f).unwrap();
    let vocab = match &source.metadata["tokenizer.ggml.tokens"] {
        Value::Array(tokens) => tokens.len(),
        other => panic!("tokenizer.ggml.tokens is {other:?}"),
    };
    let mut metadata: Vec<(String, Value)> =
        source.metadata.iter().filter(|(k, _)| k.starts_with("tokenizer.")).map(|(k, v)| (k.clone(), v.clone())).collect();
    let u32s = [
        ("llama.block_count", LAYERS),
        ("llama.embedding_length", HIDDEN),
        ("llama.feed_forward_length", INTERMEDIATE),
        ("llama.attention.head_count", HEADS),
        ("llama.attention.head_count_kv", KV_HEADS),
        ("llama.context_length", 2048),
        ("llama.rope.dimension_count", HIDDEN / HEADS),
    ];
    metadata.extend(u32s.iter().map(|(k, v)| (k.to_string(), Value::U32(*v as u32))));
    metadata.push(("general.architecture".into(), Value::String("llama".into())));
    metadata.push(("llama.rope.freq_base".into(), Value::F32(10000.0)));
    metadata.push(("llama.attention.layer_norm_rms_epsilon".into(), Value::F32(1e-5)));

    let d = HIDDEN / HEADS;
    // (GGUF name, transformers name, shape, heads whose rows llama.cpp permutes)
    let mut specs: Vec<(String, String, Vec<usize>, Option<usize>)> =
        vec![("token_embd.weight".into(), "model.embed_tokens.weight".into(), vec![vocab, HIDDEN], None)];
    for l in 0..LAYERS {
        let m = |g: &str, h: &str, shape: Vec<usize>, heads: Option<usize>| {
            (format!("blk.{l}.{g}.weight"), format!("model.layers.{l}.{h}.weight"), shape, heads)
        };
        specs.push(m("attn_q", "self_attn.q_proj", vec![HEADS * d, HIDDEN], Some(HEADS)));
        specs.push(m("attn_k", "self_attn.k_proj", vec![KV_HEADS * d, HIDDEN], Some(KV_HEADS)));
        specs.push(m("attn_v", "self_attn.v_proj", vec![KV_HEADS * d, HIDDEN], None));
        specs.push(m("attn_output", "self_attn.o_proj", vec![HIDDEN, HEADS * d], None));
        specs.push(m("ffn_gate", "mlp.gate_proj", vec![INTERMEDIATE, HIDDEN], None));
        specs.push(m("ffn_up", "mlp.up_proj", vec![INTERMEDIATE, HIDDEN], None));
        specs.push(m("ffn_down", "mlp.down_proj", vec![HIDDEN, INTERMEDIATE], None));
        specs.push(m("attn_norm", "input_layernorm", vec![HIDDEN], None));
        specs.push(m("ffn_norm", "post_attention_layernorm", vec![HIDDEN], None));
    }
    specs.push(("output_norm.weight".into(), "model.norm.weight".into(), vec![HIDDEN], None));

    let mut reference = HashMap::new();
    let mut tensors = vec![];
    for (i, (gguf, hf, shape, heads)) in specs.into_iter().enumerate() {
        let (w, q) = if shape.len() == 1 {
            let w = (random(&shape, i as u64, 0.2) + 1.0).unwrap();
            (w.clone(), QTensor::quantize(&w, GgmlDType::F32).unwrap())
        } else {
            // Scaled like a trained model's weights: activations stay near unit size.
            let w = random(&shape, i as u64, 1.7 / (shape[1] as f32).sqrt());
            let stored = match heads {
                Some(h) => permute(&w, h),
                None => w.clone(),
            };
            // Quantisation works row by row, so permuting rows first changes no block.
            let q = QTensor::quantize(&w, format).unwrap();
            let deq = q.dequantize(&Device::Cpu).unwrap();
            (deq, QTensor::quantize(&stored, format).unwrap())
        };
        reference.insert(hf, w);
        tensors.push((gguf, q));
    }
    let meta_refs: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file = std::fs::File::create(out).unwrap();
    gguf_file::write(&mut file, &meta_refs, &tensor_refs).unwrap();
    reference
}

/// A copy of the GGUF at `source` with some tokens' texts replaced (`renames`: id and text), its
/// other metadata and tensors as they are.
pub fn with_renamed_tokens(source: &Path, renames: &[(usize, String)], out: &Path) {
    let mut f = std::fs::File::open(source).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut metadata = content.metadata.clone();
    let Some(Value::Array(tokens)) = metadata.get_mut("tokenizer.ggml.tokens") else { panic!("{}: no token list", source.display()) };
    for (id, text) in renames {
        tokens[*id] = Value::String(text.clone());
    }
    let tensors: Vec<(String, QTensor)> =
        content.tensor_infos.keys().map(|name| (name.clone(), content.tensor(&mut f, name, &Device::Cpu).unwrap())).collect();
    let meta_refs: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut std::fs::File::create(out).unwrap(), &meta_refs, &tensor_refs).unwrap();
}
