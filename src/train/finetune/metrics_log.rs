//! What a run tells as it goes (rank 0 writes, every rank contributes its memory figures):
//! OUTPUT/metrics.jsonl (a row per step and per evaluation), OUTPUT/loss.svg, and the step
//! lines and progress bar on stderr.

use std::io::Write;

use anyhow::{Context, Result};
use candle_core::Device;
use serde_json::json;

use super::config::FinetuneConfig;
use crate::dist::ProcessGroups;
use crate::memory::{human_bytes, peak_rss_bytes};
use crate::train::report::LossHistory;

/// One finished optimizer step.
pub(super) struct StepReport {
    /// 1-based: steps done.
    pub step: usize,
    pub epoch: usize,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    /// Real tokens of the global batch (padding not counted): what tokens/s and a job's
    /// `trained_tokens` count.
    pub tokens: f64,
    pub secs: f64,
}

pub(super) struct MetricsLog {
    /// Rank 0 only.
    metrics: Option<std::fs::File>,
    progress: Option<indicatif::ProgressBar>,
    history: LossHistory,
    output_dir: std::path::PathBuf,
    verbose: bool,
    /// Step lines every this many steps, and at the last one.
    logging_steps: usize,
    total_steps: usize,
}

impl MetricsLog {
    pub fn open(groups: &ProcessGroups, cfg: &FinetuneConfig, total_steps: usize, start_step: usize) -> Result<Self> {
        let is_root = groups.world.rank() == 0;
        std::fs::create_dir_all(&cfg.output_dir).ok();
        let metrics = match is_root {
            // Appended to when resuming: the file keeps the whole run's history.
            true => Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(cfg.output_dir.join("metrics.jsonl"))
                    .context("opening metrics.jsonl")?,
            ),
            false => None,
        };
        let progress = (is_root && cfg.verbose).then(|| {
            let pb = indicatif::ProgressBar::new(total_steps as u64);
            pb.set_position(start_step as u64);
            pb.set_style(indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps {msg}").unwrap());
            pb
        });
        Ok(Self {
            metrics,
            progress,
            history: LossHistory::default(),
            output_dir: cfg.output_dir.clone(),
            verbose: cfg.verbose,
            logging_steps: cfg.logging_steps,
            total_steps,
        })
    }

    /// Records a step. Every rank calls it: the memory figures are gathered from all ranks.
    pub fn step(&mut self, groups: &ProcessGroups, device: &Device, r: &StepReport) -> Result<()> {
        let (rss, gpu) = memory_per_rank(groups, device)?;
        self.history.train.push((r.step, r.loss));
        let Some(f) = self.metrics.as_mut() else { return Ok(()) };
        let mut row = json!({
            "step": r.step, "epoch": r.epoch, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
            "tokens_per_s": r.tokens / r.secs, "peak_rss_bytes": rss.iter().copied().max(), "peak_rss_bytes_per_rank": rss,
            "step_s": r.secs, "tokens": r.tokens as u64,
        });
        if let Some(g) = &gpu {
            row["gpu_memory_bytes_per_rank"] = json!(g);
        }
        writeln!(f, "{row}")?;
        f.flush()?;
        self.history.write_svg(&self.output_dir.join("loss.svg"))?;
        let shown = r.step % self.logging_steps == 0 || r.step == self.total_steps;
        if let Some(pb) = &self.progress {
            if shown {
                let list = |v: &[u64]| v.iter().map(|&b| human_bytes(b)).collect::<Vec<_>>().join(", ");
                let mut line = format!(
                    "step {:>5} | loss {:.4} | lr {:.3e} | grad norm {:.4} | {:.0} tokens/s | peak RSS per rank [{}]",
                    r.step,
                    r.loss,
                    r.lr,
                    r.grad_norm,
                    r.tokens / r.secs,
                    list(&rss)
                );
                if let Some(g) = &gpu {
                    line += &format!(" | GPU memory per rank [{}]", list(g));
                }
                // A hidden bar (stderr not a terminal) drops println: print plainly then.
                if pb.is_hidden() {
                    eprintln!("{line}");
                } else {
                    pb.println(line);
                }
            }
            pb.set_message(format!("loss {:.4}", r.loss));
            pb.inc(1);
        }
        Ok(())
    }

    /// Records an evaluation (rank 0 writes it).
    pub fn eval(&mut self, step: usize, loss: f64, perplexity: f64) -> Result<()> {
        self.history.eval.push((step, loss));
        if let Some(f) = self.metrics.as_mut() {
            writeln!(f, "{}", json!({"step": step, "eval_loss": loss, "eval_perplexity": perplexity}))?;
            f.flush()?;
            self.history.write_svg(&self.output_dir.join("loss.svg"))?;
            if self.verbose {
                eprintln!("eval  {step:>5} | loss {loss:.4} | perplexity {perplexity:.3}");
            }
        }
        Ok(())
    }

    /// Clears the progress bar (the step lines stay).
    pub fn finish(&mut self) {
        if let Some(pb) = self.progress.take() {
            pb.finish_and_clear();
        }
    }
}

/// Peak RSS of every rank's process (the same process for local ranks) and, on GPUs, the
/// device memory in use on each rank at the end of the step.
fn memory_per_rank(groups: &ProcessGroups, device: &Device) -> Result<(Vec<u64>, Option<Vec<u64>>)> {
    let (rank, world) = (groups.world.rank(), groups.world.world_size());
    let mut all = vec![0f64; 2 * world];
    all[rank] = peak_rss_bytes().unwrap_or(0) as f64;
    let gpu_mem = crate::memory::gpu_memory_used(device);
    all[world + rank] = gpu_mem.unwrap_or(0) as f64;
    groups.world.all_reduce_f64(&mut all)?;
    let gpu = gpu_mem.map(|_| all[world..].iter().map(|&x| x as u64).collect());
    Ok((all[..world].iter().map(|&x| x as u64).collect(), gpu))
}
