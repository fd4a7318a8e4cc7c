//! `--quantize q8_0|q4_k|...`: a model's matrices quantised to a GGUF block format as it loads
//! (mistral.rs's in-situ quantisation), so safetensors decode from 8 or 4.5 bits per weight.
//!
//! Which matrices, in which format, follows llama.cpp's quantizer (`llama_tensor_get_type`), so
//! `--quantize q4_k_m` gives the blocks a Q4_K_M file of the model holds: every linear layer in
//! the base format, the LM head (the embedding table when tied) in Q6_K for the k-quants (Q8_0
//! for q8_0); the `_m` mixes also give `v_proj` and `down_proj` Q6_K in the first and last eighth
//! of the layers and every third one between (llama.cpp's `use_more_bits`); a matrix whose rows
//! do not split into a format's 256-value super-blocks takes llama.cpp's fallback (Q4_K to Q5_0,
//! Q5_K to Q5_1, Q6_K to Q8_0): SmolLM2's 576-wide layers take that path.

use anyhow::{bail, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Tensor;
use models::{ModelConfig, QuantizedWeights};

/// The formats `--quantize` takes, by the names llama.cpp's `llama-quantize` uses.
const FORMATS: &[(&str, GgmlDType)] = &[
    ("q4_0", GgmlDType::Q4_0),
    ("q4_1", GgmlDType::Q4_1),
    ("q5_0", GgmlDType::Q5_0),
    ("q5_1", GgmlDType::Q5_1),
    ("q8_0", GgmlDType::Q8_0),
    ("q4_k", GgmlDType::Q4K),
    ("q5_k", GgmlDType::Q5K),
    ("q6_k", GgmlDType::Q6K),
    // Not blocks: 2-byte weights that decode from their 2 bytes while activations stay f32.
    ("f16", GgmlDType::F16),
    ("bf16", GgmlDType::BF16),
];

/// What `--quantize` asked for: a base format, and whether llama.cpp's `_M` mix applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantizeSpec {
    pub base: GgmlDType,
    pub mix: bool,
}

/// The mixes `--quantize` takes besides the plain formats.
const MIXES: &[(&str, GgmlDType)] = &[("q4_k_m", GgmlDType::Q4K), ("q5_k_m", GgmlDType::Q5K)];

/// Parses `--quantize`.
pub fn parse_quantize(s: &str) -> Result<QuantizeSpec> {
    let lower = s.to_ascii_lowercase();
    if let Some((_, base)) = FORMATS.iter().find(|(name, _)| *name == lower) {
        return Ok(QuantizeSpec { base: *base, mix: false });
    }
    if let Some((_, base)) = MIXES.iter().find(|(name, _)| *name == lower) {
        return Ok(QuantizeSpec { base: *base, mix: true });
    }
    let names: Vec<&str> = FORMATS.iter().chain(MIXES).map(|(n, _)| *n).collect();
    bail!("--quantize {s:?} is not a format fsdp-app quantises to; use one of {}", names.join(", "))
}

/// llama.cpp's `use_more_bits`: the layers whose v_proj and down_proj a `_M` mix keeps at 6 bits.
fn more_bits(layer: usize, layers: usize) -> bool {
    // Short-circuit keeps `layer - layers / 8` from underflowing.
    layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2
}

/// llama.cpp's format for a matrix with rows of `in_dim` values when `asked` does not fit them.
fn fitting(asked: GgmlDType, in_dim: usize) -> GgmlDType {
    if in_dim.is_multiple_of(asked.block_size()) {
        return asked;
    }
    let fallback = match asked {
        GgmlDType::Q4K => GgmlDType::Q5_0,
        GgmlDType::Q5K => GgmlDType::Q5_1,
        GgmlDType::Q6K => GgmlDType::Q8_0,
        other => other,
    };
    match in_dim.is_multiple_of(fallback.block_size()) {
        true => fallback,
        // Rows not even a multiple of 32: keep the matrix dense (llama.cpp refuses the file).
        false => GgmlDType::F32,
    }
}

/// The LM head's format for `asked` (llama.cpp keeps the output layer at 6 bits or more).
fn head_format(asked: GgmlDType) -> GgmlDType {
    match asked {
        GgmlDType::Q8_0 | GgmlDType::F16 | GgmlDType::BF16 => asked,
        _ => GgmlDType::Q6K,
    }
}

/// The names of the matrices `--quantize` quantises, each with its format before fitting:
/// every linear layer, then the head.
fn targets(cfg: &ModelConfig, spec: QuantizeSpec) -> Vec<(String, GgmlDType)> {
    let layers = cfg.num_hidden_layers;
    let mut v: Vec<(String, GgmlDType)> = models::lora::linear_modules(cfg)
        .into_iter()
        .map(|(path, _, _)| {
            let layer: usize = path.split('.').nth(2).and_then(|l| l.parse().ok()).unwrap_or(0);
            let six_bits = spec.mix && (path.ends_with(".v_proj") || path.ends_with(".down_proj")) && more_bits(layer, layers);
            (format!("{path}.weight"), if six_bits { GgmlDType::Q6K } else { spec.base })
        })
        .collect();
    let head = models::tensors::head_weight_name(cfg);
    v.push((head.to_string(), head_format(spec.base)));
    v
}

/// Quantises the matrices of `cfg` that `read` returns (None: not there, or already quantised)
/// into `into`; returns how many it quantised.
pub fn quantize_weights(
    cfg: &ModelConfig,
    spec: QuantizeSpec,
    mut read: impl FnMut(&str) -> Result<Option<Tensor>>,
    into: &mut QuantizedWeights,
) -> Result<usize> {
    let mut n = 0;
    for (name, format) in targets(cfg, spec) {
        if into.get(&name).is_some() {
            continue;
        }
        let Some(w) = read(&name)? else { continue };
        let (_, in_dim) = w.dims2()?;
        let format = fitting(format, in_dim);
        if format == GgmlDType::F32 {
            continue;
        }
        let q = QTensor::quantize(&w, format).map_err(|e| anyhow::anyhow!("quantising {name} to {format:?}: {e}"))?;
        into.insert(name, q);
        n += 1;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_by_llama_cpp_names_and_bad_ones_are_listed() {
        assert_eq!(parse_quantize("Q4_K").unwrap(), QuantizeSpec { base: GgmlDType::Q4K, mix: false });
        assert_eq!(parse_quantize("q8_0").unwrap(), QuantizeSpec { base: GgmlDType::Q8_0, mix: false });
        assert_eq!(parse_quantize("q4_k_m").unwrap(), QuantizeSpec { base: GgmlDType::Q4K, mix: true });
        let e = parse_quantize("q3_k").unwrap_err().to_string();
        assert!(e.contains("q3_k") && e.contains("q4_k, q5_k") && e.contains("q4_k_m"), "{e}");
    }

    /// The layers llama.cpp's Q4_K_M of a 30-layer model (SmolLM2-135M) keeps at six bits.
    #[test]
    fn the_m_mix_picks_llama_cpps_layers() {
        let six: Vec<usize> = (0..30).filter(|&l| more_bits(l, 30)).collect();
        assert_eq!(six, vec![0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]);
    }

    #[test]
    fn rows_that_do_not_fit_super_blocks_take_llama_cpps_fallback() {
        assert_eq!(fitting(GgmlDType::Q4K, 1536), GgmlDType::Q4K);
        assert_eq!(fitting(GgmlDType::Q4K, 576), GgmlDType::Q5_0);
        assert_eq!(fitting(GgmlDType::Q6K, 576), GgmlDType::Q8_0);
        assert_eq!(fitting(GgmlDType::Q8_0, 576), GgmlDType::Q8_0);
        assert_eq!(fitting(GgmlDType::Q8_0, 50), GgmlDType::F32);
    }
}
