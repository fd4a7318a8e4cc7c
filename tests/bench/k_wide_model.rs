//! A GGUF model whose every matrix takes llama.cpp's K formats: SmolLM2's rows are 576 values
//! wide, which 256-value K super-blocks do not divide, so llama.cpp's Q4_K_M of SmolLM2 is
//! mostly Q5_0 and Q8_0; this model's 1024- and 2816-wide rows divide, as those of every Llama
//! from 1B up do. A Llama of SmolLM2's vocabulary and tokenizer (copied from its GGUF), 1024
//! wide, 8 layers, 16 query and 4 key-value heads of 64, an MLP of 2816, tied embeddings, f32
//! weights drawn at random (seeded): about SmolLM2's size, so rows of the two tables read alike.

use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

const HIDDEN: usize = 1024;
const MLP: usize = 2816;
const LAYERS: usize = 8;
const HEADS: usize = 16;
const KV_HEADS: usize = 4;
const HEAD_DIM: usize = 64;

/// Writes the model to `out` (temp name, then rename), its tokenizer from `tokenizer_from`.
pub fn write_k_wide_gguf(tokenizer_from: &Path, out: &Path) -> anyhow::Result<()> {
    let source = gguf_file::Content::read(&mut std::fs::File::open(tokenizer_from)?)?;
    let vocab = match source.metadata.get("tokenizer.ggml.tokens") {
        Some(Value::Array(tokens)) => tokens.len(),
        _ => anyhow::bail!("{}: no tokenizer.ggml.tokens", tokenizer_from.display()),
    };
    let u32_of = |v: usize| Value::U32(v as u32);
    let mut metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("llama".into())),
        ("general.name".into(), Value::String("k-wide-bench".into())),
        ("general.file_type".into(), u32_of(0)),
        ("llama.vocab_size".into(), u32_of(vocab)),
        ("llama.block_count".into(), u32_of(LAYERS)),
        ("llama.context_length".into(), u32_of(8192)),
        ("llama.embedding_length".into(), u32_of(HIDDEN)),
        ("llama.feed_forward_length".into(), u32_of(MLP)),
        ("llama.attention.head_count".into(), u32_of(HEADS)),
        ("llama.attention.head_count_kv".into(), u32_of(KV_HEADS)),
        ("llama.rope.dimension_count".into(), u32_of(HEAD_DIM)),
        ("llama.rope.freq_base".into(), Value::F32(100000.0)),
        ("llama.attention.layer_norm_rms_epsilon".into(), Value::F32(1e-5)),
    ];
    let mut tokenizer: Vec<(String, Value)> =
        source.metadata.iter().filter(|(k, _)| k.starts_with("tokenizer.")).map(|(k, v)| (k.clone(), v.clone())).collect();
    tokenizer.sort_by(|a, b| a.0.cmp(&b.0));
    metadata.extend(tokenizer);

    let mut state = 0x5eed_u64;
    let mut random = |rows: usize, cols: usize| -> candle_core::Result<QTensor> {
        // Uniform in ±0.035 (a standard deviation of 0.02).
        let values: Vec<f32> =
            (0..rows * cols).map(|_| kernels::rng::splitmix64(&mut state) as i64 as f32 / i64::MAX as f32 * 0.035).collect();
        QTensor::quantize(&Tensor::from_vec(values, (rows, cols), &Device::Cpu)?, GgmlDType::F32)
    };
    let ones = |n: usize| QTensor::quantize(&Tensor::ones(n, candle_core::DType::F32, &Device::Cpu)?, GgmlDType::F32);
    let mut tensors: Vec<(String, QTensor)> =
        vec![("token_embd.weight".into(), random(vocab, HIDDEN)?), ("output_norm.weight".into(), ones(HIDDEN)?)];
    for l in 0..LAYERS {
        let p = |name: &str| format!("blk.{l}.{name}.weight");
        tensors.push((p("attn_norm"), ones(HIDDEN)?));
        tensors.push((p("ffn_norm"), ones(HIDDEN)?));
        tensors.push((p("attn_q"), random(HEADS * HEAD_DIM, HIDDEN)?));
        tensors.push((p("attn_k"), random(KV_HEADS * HEAD_DIM, HIDDEN)?));
        tensors.push((p("attn_v"), random(KV_HEADS * HEAD_DIM, HIDDEN)?));
        tensors.push((p("attn_output"), random(HIDDEN, HEADS * HEAD_DIM)?));
        tensors.push((p("ffn_gate"), random(MLP, HIDDEN)?));
        tensors.push((p("ffn_up"), random(MLP, HIDDEN)?));
        tensors.push((p("ffn_down"), random(HIDDEN, MLP)?));
    }
    let partial = out.with_extension("gguf.partial");
    let mut file = std::fs::File::create(&partial)?;
    let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    gguf_file::write(&mut file, &metadata, &tensors)?;
    file.sync_all()?;
    std::fs::rename(&partial, out)?;
    Ok(())
}
