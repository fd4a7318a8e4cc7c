//! `fsdp-app finetune`: the flags are [`FinetuneArgs`] (in the library, where their defaults
//! live); a YAML `--config` adds flags before parsing; `--args-file` takes them all from a file.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use clap::parser::ValueSource;

use fsdp_app::memory::{human_bytes, peak_rss_bytes};
use fsdp_app::train::finetune::{FinetuneArgs, FinetuneConfig};

/// Adds the flags a `finetune --config FILE` sets, except those given on the command line.
pub fn apply_config_file(argv: Vec<std::ffi::OsString>) -> Result<Vec<std::ffi::OsString>> {
    use clap::CommandFactory;
    let Ok(matches) = super::Cli::command().try_get_matches_from(&argv) else { return Ok(argv) };
    let Some(("finetune", sub)) = matches.subcommand() else { return Ok(argv) };
    let paths: Vec<PathBuf> = sub.get_many::<PathBuf>("config").map(|p| p.cloned().collect()).unwrap_or_default();
    if paths.is_empty() {
        return Ok(argv);
    }
    let mut out = argv.clone();
    for setting in fsdp_app::train::config_file::load_all(&paths)? {
        if sub.value_source(setting.flag) == Some(ValueSource::CommandLine) {
            continue;
        }
        let flag = format!("--{}", setting.flag.replace('_', "-"));
        match setting.value.as_str() {
            "true" if is_switch(setting.flag) => out.push(flag.into()),
            "false" if is_switch(setting.flag) => {}
            v => {
                out.push(flag.into());
                out.push(v.into());
            }
        }
    }
    Ok(out)
}

fn is_switch(flag: &str) -> bool {
    matches!(flag, "activation_checkpointing" | "weight_decay_all" | "packing" | "skip_bad_rows" | "no_shuffle" | "lora" | "merge_lora" | "auto_find_batch_size")
}

pub fn run(a: FinetuneArgs) -> Result<()> {
    let a = match &a.args_file {
        Some(path) => settings_file(path, &a)?,
        None => a,
    };
    let world_flag = a.world_size;
    let cfg = FinetuneConfig::try_from(a)?;
    let env = fsdp_app::dist::env::DistEnv::from_env()?;
    if let (Some(env), Some(w)) = (&env, world_flag) {
        if w != env.world_size {
            anyhow::bail!("--world-size {w} disagrees with the {} environment (WORLD_SIZE {})", env.launcher, env.world_size);
        }
    }
    let start = Instant::now();
    let Some(summary) = fsdp_app::train::finetune::run(&cfg, env.as_ref())? else {
        // A rank other than 0: rank 0 reports for the job; each process reports its own memory.
        eprintln!(
            "rank {}: done, peak RSS of this process {}",
            env.as_ref().map(|e| e.rank).unwrap_or(0),
            peak_rss_bytes().map(human_bytes).unwrap_or_else(|| "n/a".into())
        );
        return Ok(());
    };
    eprintln!(
        "rank 0: finetune: {} steps in {:.1}s, final loss {:.4}, peak RSS of this process {}",
        summary.losses.len(),
        start.elapsed().as_secs_f64(),
        summary.losses.last().copied().unwrap_or(f64::NAN),
        peak_rss_bytes().map(human_bytes).unwrap_or_else(|| "n/a".into())
    );
    Ok(())
}

/// `--args-file PATH`: every setting from the file; any other flag is refused rather than
/// silently overridden or ignored.
fn settings_file(path: &std::path::Path, given: &FinetuneArgs) -> Result<FinetuneArgs> {
    let mut others = given.clone();
    others.args_file = None;
    if serde_json::to_value(&others)? != serde_json::to_value(FinetuneArgs::defaults())? {
        anyhow::bail!("--args-file {} takes every setting from the file: give no other finetune flag with it", path.display());
    }
    FinetuneArgs::read_file(path)
}
