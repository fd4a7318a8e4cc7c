//! Phase 1, bootstrap: rank 0 resolves the model, a starting adapter and the data, and every
//! rank learns them as bytes (config, tokenizer and side files; adapter settings; the data file).
//! No rank but 0 ever opens a model or data file.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::config::{shard_size, FinetuneConfig};
use crate::checkpoint::identity::DataIdentity;
use crate::convert::dequantized_for_training;
use crate::dist::{root_tries, ProcessGroups};
use crate::fsdp::plan::{plan_units, UnitPlan};
use crate::model_files::adapter::{adapter_config_json, parse_adapter_config, read_adapter, Adapter};
use crate::model_files::files::CHAT_TEMPLATE;
use crate::model_files::{resolve_model, ModelFiles, WeightFormat};
use crate::tokenize::TextTokenizer;
use crate::train::data::{describe_sample, DataOptions, Dataset, Sample, TextTools, IGNORE_INDEX};
use crate::train::grpo::prompts::{load_prompts, PromptRow};

/// Files that travel as bytes from rank 0: (file name, contents).
pub(super) type SideFiles = Vec<(String, Vec<u8>)>;

/// What every rank knows before weights move.
pub(super) struct Bootstrap {
    /// Rank 0's resolved model files (the others: `None`).
    pub files: Option<ModelFiles>,
    /// config.json as text, for checkpoints to compare against.
    pub config_json: String,
    /// config.json, tokenizer files, generation_config.json, ... as rank 0 read them.
    pub side_files: SideFiles,
    /// config.json, parsed.
    pub model_cfg: models::ModelConfig,
    /// The run's LoRA settings (from `--adapter` or the flags); `None` for full fine-tuning.
    pub lora: Option<models::LoraSettings>,
    /// Rank 0's starting adapter (`--adapter`).
    pub start_adapter: Option<Adapter>,
    pub staged: Arc<dyn models::StagedModel>,
    pub plan: Vec<UnitPlan>,
    /// `--seq-len`, or its default for this model's context: what the data is cut to (the run's
    /// plan takes it from here).
    pub seq_len: usize,
    pub data: TrainingData,
}

impl Bootstrap {
    pub fn side_file(&self, name: &str) -> Option<&[u8]> {
        self.side_files.iter().find(|(n, _)| n == name).map(|(_, b)| b.as_slice())
    }

    pub fn total_params(&self) -> usize {
        self.plan.iter().map(|u| u.numel()).sum()
    }

    pub fn trainable_params(&self) -> usize {
        self.plan.iter().flat_map(|u| u.params.iter()).filter(|p| p.trainable).map(|p| p.numel()).sum()
    }
}

/// The samples and how the run walks them.
pub(super) struct TrainingData {
    /// SFT: one sample per example; DPO: each pair's chosen sample, then its rejected one.
    pub samples: Vec<Sample>,
    /// Samples per example (1, or 2 for DPO's pairs): batches, the data order and splits
    /// never separate an example's samples.
    pub group: usize,
    pub eval_samples: Vec<Sample>,
    /// GRPO: the prompts, by data row (`samples` then holds each prompt as a sample with no
    /// target, one per row, for the data order and the run's shape).
    pub prompts: Vec<PromptRow>,
    /// GRPO: the evaluation prompts (`--eval-data` or `--eval-split`).
    pub eval_prompts: Vec<PromptRow>,
    /// The training file's identity, for checkpoints to record: rank 0 only (the one that reads
    /// the file, writes checkpoints and checks resumes), so no other rank hashes it.
    pub identity: Option<DataIdentity>,
}

pub(super) fn bootstrap(groups: &ProcessGroups, cfg: &FinetuneConfig) -> Result<Bootstrap> {
    let (files, side_files) = share_model_files(groups, cfg)?;
    let config_json = String::from_utf8(side_files.iter().find(|(n, _)| n == "config.json").context("config.json")?.1.clone())
        .context("config.json is not UTF-8")?;
    let model_cfg = models::ModelConfig::from_json_str(&config_json).context("config.json")?;
    if let Some(names) = &cfg.layer_class_names {
        crate::train::config_file::check_layer_class(names, model_cfg.architecture)?;
    }
    let (start_adapter, lora) = share_adapter(groups, cfg, &model_cfg)?;
    if let Some(lora) = &lora {
        lora.validate(&model_cfg)?;
    }
    let staged: Arc<dyn models::StagedModel> = Arc::new(models::LlamaStages::new(&model_cfg, lora.clone()));
    let plan = plan_units(staged.as_ref(), cfg.wrap, shard_size(cfg, groups.world.world_size()))?;
    let seq_len = crate::train::settle_seq_len(cfg.seq_len, model_cfg.max_position_embeddings)?;
    // Data before weights: a bad file fails fast.
    let data = load_data(groups, cfg, seq_len, &model_cfg, &side_files)?;
    Ok(Bootstrap { files, config_json, side_files, model_cfg, lora, start_adapter, staged, plan, seq_len, data })
}

/// Rank 0 resolves the model (local directory or Hub) and sends config and tokenizer files.
fn share_model_files(groups: &ProcessGroups, cfg: &FinetuneConfig) -> Result<(Option<ModelFiles>, SideFiles)> {
    let (files, bytes) = root_tries(groups.world.as_ref(), "resolve the model", || {
        let f = resolve_model(&cfg.model, cfg.revision.as_deref())?;
        // Training reads f32 safetensors: a GGUF model's blocks are dequantised first.
        let f = match f.format {
            WeightFormat::Gguf => dequantized_for_training(f)?,
            WeightFormat::Safetensors => f,
        };
        let read = |p: &Path| std::fs::read(p).with_context(|| format!("{}: cannot read", p.display()));
        let mut side = vec![];
        for p in [&Some(f.config.clone()), &f.tokenizer, &f.tokenizer_config, &f.generation_config, &f.chat_template, &f.special_tokens_map]
            .into_iter()
            .flatten()
        {
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            side.push(json!({"name": name, "data": String::from_utf8_lossy(&read(p)?).to_string()}));
        }
        if let Some(arg) = &cfg.chat_template {
            with_chat_template(&mut side, &crate::tokenize::chat::template_argument(arg)?)?;
        }
        Ok((f, serde_json::to_vec(&json!({"files": side}))?))
    })?;
    let v: Value = serde_json::from_slice(&bytes)?;
    let side = v["files"]
        .as_array()
        .context("model files message")?
        .iter()
        .map(|f| (f["name"].as_str().unwrap_or_default().to_string(), f["data"].as_str().unwrap_or_default().as_bytes().to_vec()))
        .collect();
    Ok((files, side))
}

/// The model's files with `template` as its only chat template: chat_template.jinja, and
/// tokenizer_config.json without its own `chat_template` (so every reader of the written model,
/// transformers or another, finds this one).
fn with_chat_template(side: &mut Vec<Value>, template: &str) -> Result<()> {
    side.retain(|f| f["name"] != CHAT_TEMPLATE);
    if let Some(config) = side.iter_mut().find(|f| f["name"] == "tokenizer_config.json") {
        let mut parsed: Value =
            serde_json::from_str(config["data"].as_str().unwrap_or_default()).context("tokenizer_config.json: invalid JSON")?;
        if let Some(map) = parsed.as_object_mut() {
            if map.remove("chat_template").is_some() {
                config["data"] = json!(serde_json::to_string_pretty(&parsed)?);
            }
        }
    }
    side.push(json!({"name": CHAT_TEMPLATE, "data": template}));
    Ok(())
}

/// LoRA: rank 0 reads a starting adapter (if any); its settings travel to every rank. Returns
/// rank 0's adapter and the run's LoRA settings (the adapter's, else the flags').
fn share_adapter(
    groups: &ProcessGroups,
    cfg: &FinetuneConfig,
    model_cfg: &models::ModelConfig,
) -> Result<(Option<Adapter>, Option<models::LoraSettings>)> {
    let (adapter, bytes) = root_tries(groups.world.as_ref(), "read --adapter", || {
        Ok(match &cfg.adapter {
            Some(dir) => {
                let a = read_adapter(dir, model_cfg)?;
                let config = adapter_config_json(&a.settings, "").to_string().into_bytes();
                (Some(a), config)
            }
            None => (None, vec![]),
        })
    })?;
    let lora = match bytes.is_empty() {
        true => cfg.lora.clone(),
        false => Some(parse_adapter_config(&String::from_utf8_lossy(&bytes), Path::new("adapter_config.json"))?.0),
    };
    Ok((adapter.flatten(), lora))
}

/// Tokenises the training (and eval) data and works out the batch arithmetic.
fn load_data(
    groups: &ProcessGroups,
    cfg: &FinetuneConfig,
    seq_len: usize,
    model_cfg: &models::ModelConfig,
    side_files: &[(String, Vec<u8>)],
) -> Result<TrainingData> {
    let is_root = groups.world.rank() == 0;
    let side = |name: &str| side_files.iter().find(|(n, _)| n == name).map(|(_, b)| b.as_slice());
    let tokenizer = match side("tokenizer.json") {
        Some(t) => Some(TextTokenizer::from_bytes(t, side("tokenizer_config.json"), side("chat_template.jinja"))?),
        None => None,
    };
    let encode = |text: &str, special: bool| {
        tokenizer.as_ref().context("text and chat rows need the model's tokenizer.json")?.encode_with_offsets(text, special)
    };
    let decode = |ids: &[u32]| tokenizer.as_ref().context("no tokenizer.json")?.decode(ids, false);
    let eos = model_cfg.eos_token_ids.first().copied();
    let template = tokenizer.as_ref().and_then(|t| t.chat_template.as_ref());
    let tools = TextTools { encode: &encode, decode: &decode, template, eos_id: eos, pad_id: eos.unwrap_or(0) };
    if let Some(grpo) = &cfg.grpo {
        return load_grpo_prompts(groups, cfg, grpo, seq_len, &tools);
    }
    let opts = DataOptions { seq_len, train_on: cfg.train_on, skip_bad_rows: cfg.skip_bad_rows, packing: cfg.packing };
    let read = |spec: &Path| shared_dataset(groups, spec, &opts, &tools, cfg.dpo.is_some());
    let (dataset, identity) = read(&cfg.data)?;
    if is_root && cfg.verbose {
        report_dataset(&dataset, cfg, seq_len);
    }
    if is_root && cfg.show_sample {
        eprintln!("sample 0 ([masked]...[/masked] is not trained on):\n{}", describe_sample(&dataset.samples[0], &decode)?);
    }
    let mut samples = dataset.samples;
    let group = if cfg.dpo.is_some() { 2 } else { 1 };
    let eval_samples: Vec<Sample> = match (&cfg.eval_data, cfg.eval_split) {
        (Some(p), _) => read(p)?.0.samples,
        (None, Some(f)) => {
            // The last rows of the file, so the split is the same on every rank and every run;
            // whole examples (a pair's two samples stay together).
            let examples = samples.len() / group;
            let n = ((examples as f64 * f).round() as usize).max(1);
            if n >= examples {
                bail!("--eval-split {f} leaves no training examples ({examples} in all)");
            }
            samples.split_off((examples - n) * group)
        }
        (None, None) => vec![],
    };
    if is_root && cfg.verbose && !eval_samples.is_empty() {
        eprintln!("eval: {} samples", eval_samples.len());
    }
    Ok(TrainingData { samples, group, eval_samples, prompts: vec![], eval_prompts: vec![], identity })
}

/// GRPO's prompts: rank 0 reads the file, every rank tokenises the same rows; each row must
/// hold what the grader reads (`{{item.FIELD}}`), and given rollouts must match the rows.
fn load_grpo_prompts(
    groups: &ProcessGroups,
    cfg: &FinetuneConfig,
    grpo: &crate::train::grpo::GrpoConfig,
    seq_len: usize,
    tools: &TextTools,
) -> Result<TrainingData> {
    let max_prompt = seq_len.checked_sub(grpo.settings.max_completion_length).filter(|n| *n > 0).with_context(|| {
        format!("--max-completion-length {} leaves no room for a prompt in --seq-len {seq_len}", grpo.settings.max_completion_length)
    })?;
    let (identity, body) = root_tries(groups.world.as_ref(), "read the data", || {
        let path = crate::train::data::resolve_data(&cfg.data.to_string_lossy())?;
        let bytes = std::fs::read(&path).with_context(|| format!("{}: cannot read", path.display()))?;
        Ok((DataIdentity::of(&cfg.data.to_string_lossy(), &bytes), bytes))
    })?;
    let check = |item: &Value| grpo.grader.as_ref().map_or(Ok(()), |g| g.check_item(item));
    let (mut prompts, skipped) = load_prompts(&cfg.data, &body, tools, max_prompt, cfg.skip_bad_rows, &check)?;
    let eval_prompts = match (&cfg.eval_data, cfg.eval_split) {
        (Some(path), _) => {
            let (_, body) = root_tries(groups.world.as_ref(), "read the eval data", || {
                let resolved = crate::train::data::resolve_data(&path.to_string_lossy())?;
                Ok(((), std::fs::read(&resolved).with_context(|| format!("{}: cannot read", resolved.display()))?))
            })?;
            load_prompts(path, &body, tools, max_prompt, cfg.skip_bad_rows, &check)?.0
        }
        // The last rows, as for SFT.
        (None, Some(f)) => {
            let n = ((prompts.len() as f64 * f).round() as usize).max(1);
            if n >= prompts.len() {
                bail!("--eval-split {f} leaves no training prompts ({} in all)", prompts.len());
            }
            prompts.split_off(prompts.len() - n)
        }
        (None, None) => vec![],
    };
    if let Some(given) = &grpo.given {
        let g = grpo.settings.num_generations;
        let groups_ok = given.completions.iter().zip(&given.rewards).all(|(c, r)| c.len() == g && r.len() == g);
        if given.completions.len() != prompts.len() || given.rewards.len() != prompts.len() || !groups_ok {
            bail!("given rollouts: {} groups for {} prompts, each of {g} completions", given.completions.len(), prompts.len());
        }
    }
    if groups.world.rank() == 0 && cfg.verbose {
        let tokens: usize = prompts.iter().map(|p| p.ids.len()).sum();
        eprintln!(
            "data: {} prompts ({skipped} skipped), {tokens} prompt tokens; each sampled {} times, at most {} tokens per completion",
            prompts.len(),
            grpo.settings.num_generations,
            grpo.settings.max_completion_length
        );
    }
    let samples = prompts
        .iter()
        .map(|p| Sample { input_ids: p.ids.clone(), labels: vec![IGNORE_INDEX; p.ids.len()], len: p.ids.len(), segments: vec![] })
        .collect();
    Ok(TrainingData { samples, group: 1, eval_samples: vec![], prompts, eval_prompts, identity })
}

fn report_dataset(dataset: &Dataset, cfg: &FinetuneConfig, seq_len: usize) {
    if cfg.dpo.is_some() {
        eprintln!(
            "data: {} rows -> {} preference pairs of at most {seq_len} tokens per sequence ({} skipped, {} truncated); {} completion tokens",
            dataset.rows,
            dataset.samples.len() / 2,
            dataset.skipped,
            dataset.truncated,
            dataset.supervised_tokens
        );
        return;
    }
    eprintln!(
        "data: {} rows -> {} samples of {} tokens ({} skipped, {} truncated); {} trained-on tokens; {} efficiency {:.1}%",
        dataset.rows,
        dataset.samples.len(),
        seq_len,
        dataset.skipped,
        dataset.truncated,
        dataset.supervised_tokens,
        if cfg.packing { "packing" } else { "padding" },
        100.0 * dataset.padding_efficiency(seq_len)
    );
}

/// Rank 0 resolves the data (a local file or a Hub dataset file, downloaded once) and sends its
/// bytes; every rank builds the same samples from them (preference pairs with `pairs`). Rank 0
/// also returns the file's identity.
fn shared_dataset(
    groups: &ProcessGroups,
    spec: &Path,
    opts: &DataOptions,
    tools: &TextTools,
    pairs: bool,
) -> Result<(Dataset, Option<DataIdentity>)> {
    let (identity, body) = root_tries(groups.world.as_ref(), "read the data", || {
        let path = crate::train::data::resolve_data(&spec.to_string_lossy())?;
        let bytes = std::fs::read(&path).with_context(|| format!("{}: cannot read", path.display()))?;
        Ok((DataIdentity::of(&spec.to_string_lossy(), &bytes), bytes))
    })?;
    let dataset = match pairs {
        true => crate::train::preference::load_preference_dataset(spec, &body, opts.seq_len, opts.skip_bad_rows, tools)?,
        false => crate::train::data::load_dataset_bytes(spec, &body, opts, tools)?,
    };
    Ok((dataset, identity))
}
