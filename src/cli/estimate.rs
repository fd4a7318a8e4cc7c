//! `fsdp-app estimate`: per-rank memory of a fine-tuning run from config.json alone.

use anyhow::{Context, Result};
use clap::Args;

use fsdp_app::memory::human_bytes;
use fsdp_app::train::finetune::args::{lora_settings, LoraArgs, ShardingArgs};

#[derive(Args)]
pub struct EstimateArgs {
    /// Local model directory, GGUF file or Hub id (only config.json is read or downloaded; a
    /// GGUF file's metadata).
    #[arg(long)]
    model: String,
    #[arg(long)]
    revision: Option<String>,
    #[arg(long, default_value_t = 1)]
    world_size: usize,
    #[command(flatten)]
    sharding: ShardingArgs,
    /// Sequences per rank per micro-batch.
    #[arg(long, default_value_t = 1)]
    batch_size: usize,
    /// Tokens per sequence (default: 512, or the model's context when that is shorter).
    #[arg(long)]
    seq_len: Option<usize>,
    #[command(flatten)]
    lora: LoraArgs,
    /// How the ranks run: tcp (processes under `fsdp-app launch`; rank 0 relays collectives),
    /// mpi, or local (threads of one process, whose memory is the sum of its ranks').
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "mpi", "local"])]
    backend: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: EstimateArgs) -> Result<()> {
    use fsdp_app::train::estimate::{estimate, EstimateInput};
    let model = std::path::Path::new(&a.model);
    let config_path = if model.is_dir() {
        model.join("config.json")
    } else if model.is_file() {
        // A GGUF file (the only file --model takes): its config comes from its metadata.
        fsdp_app::model_files::resolve_model(&a.model, None)?.config
    } else {
        fsdp_app::model_files::hub::HubRepo::open(&a.model, a.revision.as_deref().unwrap_or("main"))?.get("config.json")?
    };
    let cfg = fsdp_app::model_files::read_model_config(&config_path)?;
    let lora = lora_settings(&a.lora);
    if let Some(l) = &lora {
        l.validate(&cfg)?;
    }
    let strategy = a.sharding.strategy()?;
    let wrap = a.sharding.wrap()?;
    if a.world_size == 0 || a.batch_size == 0 || a.seq_len == Some(0) {
        anyhow::bail!("--world-size, --batch-size and --seq-len must be positive");
    }
    let seq_len =
        fsdp_app::train::settle_seq_len(a.seq_len, cfg.max_position_embeddings).with_context(|| config_path.display().to_string())?;
    let shard_size = strategy.shard_count(a.world_size, a.sharding.shard_group_size)?;
    let input = EstimateInput {
        world_size: a.world_size,
        shard_size,
        strategy,
        wrap,
        activation_checkpointing: a.sharding.activation_checkpointing,
        batch_size: a.batch_size,
        seq_len,
        rank0_relays: a.backend == "tcp" && a.world_size > 1,
        lora: lora.clone(),
    };
    let staged = models::LlamaStages::new(&cfg, lora.clone());
    let e = estimate(&staged, &cfg, &input)?;
    if a.json {
        let mut m = serde_json::Map::new();
        for (name, bytes, _) in e.rows() {
            m.insert(name.replace(' ', "_"), serde_json::json!(bytes));
        }
        m.insert("total".into(), serde_json::json!(e.total()));
        m.insert("rank0_relay".into(), serde_json::json!(e.rank0_relay));
        m.insert("rank0_host".into(), serde_json::json!(e.rank0_host));
        m.insert("rank0_total".into(), serde_json::json!(e.rank0_total()));
        println!("{}", serde_json::Value::Object(m));
        return Ok(());
    }
    println!(
        "per-rank memory estimate: {} rank(s), {strategy}, batch {} x seq {}{}{}",
        a.world_size,
        a.batch_size,
        seq_len,
        if a.sharding.activation_checkpointing { ", activation checkpointing" } else { "" },
        lora.as_ref().map(|l| format!(", LoRA r={} {:?}", l.r, l.targets)).unwrap_or_default()
    );
    for (name, bytes, what) in e.rows() {
        println!("  {name:<15} {:>12}  {what}", human_bytes(bytes));
    }
    println!("  {:<15} {:>12}  peak resident memory of each rank", "total", human_bytes(e.total()));
    if e.rank0_relay + e.rank0_host > 0 {
        let relay = human_bytes(e.rank0_relay + e.rank0_host);
        println!("  {:<15} {:>12}  rank 0 also relays the others' collectives and hosts them (tcp backend)", "rank 0 relay", relay);
        println!("  {:<15} {:>12}", "rank 0 total", human_bytes(e.rank0_total()));
    }
    if a.backend == "local" && a.world_size > 1 {
        let process = e.process + (e.total() - e.process) * a.world_size as u64;
        println!("  {:<15} {:>12}  the one process holding all {} local ranks", "process total", human_bytes(process), a.world_size);
    }
    Ok(())
}
