//! `fsdp-app finetune`: the flags are [`FinetuneArgs`] (in the library, where their defaults
//! live); a YAML `--config` is written into them (flags given on the command line win);
//! `--args-file` takes them all from a file.

use std::time::Instant;

use anyhow::Result;

use fsdp_app::memory::{human_bytes, peak_rss_bytes};
use fsdp_app::train::finetune::{FinetuneArgs, FinetuneConfig};

/// `given(flag)`: whether the command line set that flag.
pub fn run(a: FinetuneArgs, given: &dyn Fn(&str) -> bool) -> Result<()> {
    let a = match &a.args_file {
        Some(path) => settings_file(path, &a)?,
        None if a.config.is_empty() => a,
        None => {
            let settings = fsdp_app::train::config_file::load_all(&a.config)?;
            a.apply(&settings, given)?
        }
    };
    let world_flag = a.world_size;
    let cfg = FinetuneConfig::try_from(a)?;
    let env = fsdp_app::dist::env::DistEnv::from_env()?;
    if let (Some(env), Some(w)) = (&env, world_flag) {
        if w != env.world_size {
            anyhow::bail!("--world-size {w} disagrees with the {} environment (WORLD_SIZE {})", env.launcher, env.world_size);
        }
    }
    // Ctrl-C says which checkpoint to resume from (rank 0; every rank of a launch gets it).
    let speaks = env.as_ref().is_none_or(|e| e.rank == 0);
    fsdp_app::train::finetune::interrupt::exit_saying_how_to_resume(cfg.output_dir.clone(), speaks)?;
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
