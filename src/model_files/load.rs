//! Reading a resolved model from disk: config, a check of every tensor's name and shape, and the
//! model itself built over memory-mapped safetensors.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use models::{expected_tensors, CausalLm, ModelConfig, QuantizedWeights};

use super::resolve::{ModelFiles, WeightFormat};

/// A model ready to run, with the files it came from.
pub struct LoadedModel {
    pub model: CausalLm,
    pub config: ModelConfig,
    pub files: ModelFiles,
    pub dtype: DType,
}

/// Parses `config.json`; errors name the file.
pub fn read_model_config(path: &Path) -> Result<ModelConfig> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    ModelConfig::from_json_str(&text).with_context(|| format!("{}", path.display()))
}

/// Name, dtype and shape of one stored tensor, and the file holding it.
#[derive(Debug, Clone)]
pub struct StoredTensor {
    pub file: PathBuf,
    pub dtype: safetensors::Dtype,
    pub shape: Vec<usize>,
    /// Byte range of the data in the file.
    pub start: u64,
    pub end: u64,
}

impl StoredTensor {
    /// Appends values `range` (flat, row-major) of this tensor as f32 to `dst`, reading just
    /// those bytes, in blocks (no copy of the whole tensor in memory).
    pub fn append_f32(&self, range: std::ops::Range<usize>, dst: &mut Vec<f32>) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let width = match self.dtype {
            safetensors::Dtype::F32 => 4,
            safetensors::Dtype::BF16 | safetensors::Dtype::F16 => 2,
            other => bail!("{}: dtype {other:?} is not supported", self.file.display()),
        };
        let count = (self.end - self.start) as usize / width;
        if range.end > count {
            bail!("{}: values {range:?} are past the tensor's {count}", self.file.display());
        }
        let file = std::fs::File::open(&self.file).with_context(|| format!("{}: cannot open", self.file.display()))?;
        const BLOCK: usize = 1 << 20;
        let mut raw = vec![0u8; BLOCK.min(range.len()) * width];
        dst.reserve(range.len());
        let mut at = range.start;
        while at < range.end {
            let n = BLOCK.min(range.end - at);
            let bytes = &mut raw[..n * width];
            file.read_exact_at(bytes, self.start + (at * width) as u64)
                .with_context(|| format!("{}: reading tensor data", self.file.display()))?;
            match self.dtype {
                safetensors::Dtype::F32 => dst.extend(bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()))),
                safetensors::Dtype::BF16 => {
                    dst.extend(bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f32()))
                }
                _ => dst.extend(bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f32())),
            }
            at += n;
        }
        Ok(())
    }

    /// Reads just this tensor's bytes (no mmap of the whole file, so memory stays at the size of
    /// the tensor) and widens them to f32.
    pub fn read_f32(&self) -> Result<Vec<f32>> {
        let count = self.shape.iter().product();
        let mut values = Vec::new();
        self.append_f32(0..count, &mut values)?;
        Ok(values)
    }
}

/// Reads the header of every weight file (validating it against the file's length, so truncated
/// or corrupt files are reported here, by name) and returns what each file holds.
pub fn read_weight_headers(weights: &[PathBuf]) -> Result<BTreeMap<String, StoredTensor>> {
    let mut all = BTreeMap::new();
    for path in weights {
        let file = std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
        // SAFETY: the map is read-only and dropped before we return; a concurrent writer could
        // change the bytes under us, which at worst gives a wrong header error.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("{}: cannot mmap", path.display()))?;
        let st = safetensors::SafeTensors::deserialize(&mmap)
            .map_err(|e| anyhow::anyhow!("{}: not a valid safetensors file: {e}", path.display()))?;
        let (header_len, metadata) = safetensors::SafeTensors::read_metadata(&mmap)
            .map_err(|e| anyhow::anyhow!("{}: not a valid safetensors file: {e}", path.display()))?;
        let data_base = 8 + header_len as u64;
        for (name, view) in st.tensors() {
            let info = metadata.info(&name).expect("tensor listed in its own header");
            let (start, end) = (data_base + info.data_offsets.0 as u64, data_base + info.data_offsets.1 as u64);
            let dtype = view.dtype();
            if !matches!(dtype, safetensors::Dtype::F32 | safetensors::Dtype::BF16 | safetensors::Dtype::F16) {
                bail!("{}: tensor {name} has dtype {dtype:?}; supported: F32, BF16, F16", path.display());
            }
            if let Some(prev) =
                all.insert(name.clone(), StoredTensor { file: path.clone(), dtype, shape: view.shape().to_vec(), start, end })
            {
                bail!("tensor {name} is stored twice: in {} and {}", prev.file.display(), path.display());
            }
        }
    }
    Ok(all)
}

/// Compares what is stored with what the config needs. Every problem is listed at once, like
/// PyTorch's `_IncompatibleKeys`, so a user fixes a checkpoint in one go.
pub fn check_tensors(cfg: &ModelConfig, stored: &BTreeMap<String, StoredTensor>, source: &str) -> Result<()> {
    let expected = expected_tensors(cfg);
    let expected_names: HashMap<&str, &[usize]> = expected.iter().map(|t| (t.name.as_str(), t.shape.as_slice())).collect();
    let mut missing = vec![];
    let mut misshaped = vec![];
    for t in &expected {
        match stored.get(&t.name) {
            None => missing.push(t.name.clone()),
            Some(s) if s.shape != t.shape => {
                misshaped.push(format!("{} is {:?} in {}, config needs {:?}", t.name, s.shape, s.file.display(), t.shape))
            }
            Some(_) => {}
        }
    }
    // A tied checkpoint may still carry `lm_head.weight` (some exporters write both); transformers
    // ignores it, and so do we.
    let unexpected: Vec<&String> = stored
        .keys()
        .filter(|n| !expected_names.contains_key(n.as_str()))
        .filter(|n| !(cfg.tie_word_embeddings && n.as_str() == "lm_head.weight"))
        .filter(|n| !n.ends_with("rotary_emb.inv_freq"))
        .collect();
    if missing.is_empty() && misshaped.is_empty() && unexpected.is_empty() {
        return Ok(());
    }
    let mut parts = vec![];
    let list = |v: Vec<String>| {
        let n = v.len();
        let shown: Vec<String> = v.into_iter().take(8).collect();
        if n > 8 {
            format!("{} (and {} more)", shown.join(", "), n - 8)
        } else {
            shown.join(", ")
        }
    };
    if !missing.is_empty() {
        parts.push(format!("missing tensors: {}", list(missing)));
    }
    if !unexpected.is_empty() {
        parts.push(format!("unexpected tensors: {}", list(unexpected.into_iter().cloned().collect())));
    }
    if !misshaped.is_empty() {
        parts.push(format!("wrong shapes: {}", list(misshaped)));
    }
    bail!("{source}: checkpoint does not match its config.json ({:?}): {}", cfg.architecture, parts.join("; "))
}

/// Loads the model in `dtype` on `device` after checking every tensor.
pub fn load_model(files: ModelFiles, dtype: DType, device: &Device) -> Result<LoadedModel> {
    load_model_with_adapter(files, None, dtype, device)
}

/// A bare model's embedding table (see `BareNames`).
const BARE_EMBED_WEIGHT: &str = "embed_tokens.weight";

/// Safetensors whose names lack the causal LM's `model.` when `bare`: the model asks for
/// `model.layers.0...`, the file has `layers.0...`.
struct BareNames {
    inner: candle_core::safetensors::MmapedSafetensors,
    bare: bool,
}

impl BareNames {
    fn stored_name<'a>(&self, name: &'a str) -> &'a str {
        if self.bare {
            name.strip_prefix("model.").unwrap_or(name)
        } else {
            name
        }
    }
}

impl SimpleBackend for BareNames {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<candle_core::Tensor> {
        SimpleBackend::get(&self.inner, s, self.stored_name(name), h, dtype, dev)
    }
    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<candle_core::Tensor> {
        SimpleBackend::get_unchecked(&self.inner, self.stored_name(name), dtype, dev)
    }
    fn contains_tensor(&self, name: &str) -> bool {
        SimpleBackend::contains_tensor(&self.inner, self.stored_name(name))
    }
}

/// Looks tensors up in each backend in turn: a LoRA adapter's tensors over the base weights.
struct Layered(Vec<Box<dyn SimpleBackend>>);

impl SimpleBackend for Layered {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<candle_core::Tensor> {
        match self.0.iter().find(|b| b.contains_tensor(name)) {
            Some(b) => b.get(s, name, h, dtype, dev),
            None => self.0[0].get(s, name, h, dtype, dev),
        }
    }
    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<candle_core::Tensor> {
        match self.0.iter().find(|b| b.contains_tensor(name)) {
            Some(b) => b.get_unchecked(name, dtype, dev),
            None => self.0[0].get_unchecked(name, dtype, dev),
        }
    }
    fn contains_tensor(&self, name: &str) -> bool {
        self.0.iter().any(|b| b.contains_tensor(name))
    }
}

/// Loads the model, with the PEFT LoRA adapter in `adapter` (a directory) applied to its
/// targeted layers when given.
pub fn load_model_with_adapter(files: ModelFiles, adapter: Option<&Path>, dtype: DType, device: &Device) -> Result<LoadedModel> {
    load_model_with(files, &LoadOptions { adapter, dtype, quantize: None }, device)
}

/// How to load a model: an adapter to apply, the compute dtype, and a GGUF block format to
/// quantise its matrices to (`--quantize`).
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions<'a> {
    pub adapter: Option<&'a Path>,
    pub dtype: DType,
    pub quantize: Option<super::quantize::QuantizeSpec>,
}

pub fn load_model_with(files: ModelFiles, opts: &LoadOptions, device: &Device) -> Result<LoadedModel> {
    let config = read_model_config(&files.config)?;
    let mut quantized = QuantizedWeights::default();
    let weights: Box<dyn SimpleBackend> = match files.format {
        WeightFormat::Safetensors => {
            let stored = read_weight_headers(&files.weights)?;
            // A bare model's checkpoint (an embedding model saved from `AutoModel`) names its
            // tensors without the `model.` of a causal LM's.
            let bare = !stored.contains_key(models::tensors::EMBED_WEIGHT) && stored.contains_key(BARE_EMBED_WEIGHT);
            let stored = if bare { stored.into_iter().map(|(n, t)| (format!("model.{n}"), t)).collect() } else { stored };
            check_tensors(&config, &stored, &files.source)?;
            // SAFETY: the files were just validated; they must not be modified while the model
            // lives, the same contract as every mmap-based loader (transformers included).
            let base = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files.weights) }
                .with_context(|| format!("{}: mapping the weights", files.source))?;
            let base = BareNames { inner: base, bare };
            if let Some(format) = opts.quantize {
                let read =
                    |name: &str| Ok(stored.contains_key(name).then(|| base.inner.load(base.stored_name(name), device)).transpose()?);
                super::quantize::quantize_weights(&config, format, read, &mut quantized)?;
            }
            Box::new(base)
        }
        WeightFormat::Gguf => {
            let (dense, q) = super::gguf::read_gguf_weights(&files.weights[0], &config, device)?;
            quantized = q;
            if let Some(format) = opts.quantize {
                super::quantize::quantize_weights(&config, format, |name| Ok(dense.get(name).cloned()), &mut quantized)?;
            }
            Box::new(dense)
        }
    };
    if !quantized.is_empty() && opts.dtype != DType::F32 {
        bail!(
            "{}: --dtype {:?} with weights kept in a stored format (f16 or GGUF blocks): those compute in f32 (their \
             kernels take f32 activations); leave --dtype at f32",
            files.source,
            opts.dtype
        );
    }
    let mut backends: Vec<Box<dyn SimpleBackend>> = vec![];
    let mut lora = None;
    if let Some(dir) = opts.adapter {
        let a = super::adapter::read_adapter(dir, &config)?;
        lora = Some(a.settings);
        backends.push(Box::new(a.tensors));
    }
    backends.push(weights);
    let vb = VarBuilder::from_backend(Box::new(Layered(backends)), opts.dtype, device.clone());
    // Said before the model takes the matrices (the map is empty after).
    let summary = (!quantized.is_empty()).then(|| {
        let formats: Vec<String> = quantized.formats().into_iter().map(|(f, n)| format!("{n} {f}")).collect();
        format!(
            "{}: {} matrices quantised ({}), {:.1} MiB of blocks{}",
            files.source,
            quantized.len(),
            formats.join(", "),
            quantized.storage_bytes() as f64 / (1 << 20) as f64,
            k_kernels(&quantized, device)
        )
    });
    let model = CausalLm::with_quantized(&config, lora.as_ref(), &mut quantized, vb)
        .with_context(|| format!("{}: building the model", files.source))?;
    if let Some(summary) = summary {
        eprintln!("{summary}");
    }
    Ok(LoadedModel { model, config, files, dtype: opts.dtype })
}

/// Whose kernels multiply a CPU model's Q4_K, Q5_K and Q6_K matrices, for the load's summary
/// (ours or candle's: `FSDP_K_BLOCKS`, else the CPU decides; `Kernels::k_blocks_ours`).
fn k_kernels(quantized: &QuantizedWeights, device: &Device) -> &'static str {
    match (
        device.is_cpu() && quantized.dtypes().any(ops::quant::is_k_format),
        kernels::quant_blocks::k_formats_run_here(kernels::simd::SimdLevel::current()),
    ) {
        (false, _) => "",
        (true, true) => "; Q4K, Q5K and Q6K on our block kernels",
        (true, false) => "; Q4K, Q5K and Q6K on candle's kernels",
    }
}

/// Parses `--dtype`.
pub fn parse_dtype(s: &str) -> Result<DType> {
    Ok(match s {
        // vLLM's and PyTorch's spellings too (`float`, `half`).
        "f32" | "float32" | "float" => DType::F32,
        "bf16" | "bfloat16" => DType::BF16,
        "f16" | "float16" | "half" => DType::F16,
        other => bail!("--dtype {other:?} is not supported; use f32, bf16 or f16"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;

    #[test]
    fn dtypes_take_vllms_spellings_and_refuse_auto() {
        assert_eq!(parse_dtype("half").unwrap(), DType::F16);
        assert_eq!(parse_dtype("float").unwrap(), DType::F32);
        assert_eq!(parse_dtype("bfloat16").unwrap(), DType::BF16);
        assert!(parse_dtype("auto").unwrap_err().to_string().contains("use f32, bf16 or f16"));
    }

    #[test]
    fn row_ranges_read_in_place_match_the_whole_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        // Over two of the reader's blocks of 1M values.
        let n = 2_100_000;
        let values: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.5 - 7.0).collect();
        let t = Tensor::from_vec(values.clone(), (n,), &Device::Cpu).unwrap();
        let tensors = std::collections::HashMap::from([("f".to_string(), t.clone()), ("b".to_string(), t.to_dtype(DType::BF16).unwrap())]);
        candle_core::safetensors::save(&tensors, &path).unwrap();
        let stored = read_weight_headers(&[path]).unwrap();
        for name in ["f", "b"] {
            let whole = stored[name].read_f32().unwrap();
            let mut parts = vec![];
            for range in [0..1, 1..1500, 1500..n] {
                stored[name].append_f32(range, &mut parts).unwrap();
            }
            assert_eq!(parts, whole, "{name}");
        }
        assert_eq!(stored["f"].read_f32().unwrap(), values);
        assert!(stored["f"].append_f32(n - 1..n + 1, &mut vec![]).is_err());
    }
}
