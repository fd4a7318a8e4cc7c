//! What a run tells as it goes (rank 0 writes, every rank contributes its memory figures):
//! OUTPUT/metrics.jsonl (a row per step and per evaluation), OUTPUT/loss.svg, and the step
//! lines and progress bar on stderr.

use std::io::Write;

use anyhow::{Context, Result};
use candle_core::Device;

use super::config::FinetuneConfig;
use crate::dist::ProcessGroups;
use crate::memory::{human_bytes, peak_rss_bytes};
use crate::train::metrics_row::{EvalRow, MetricsRow, StepRow, METRICS_FILE};
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
    /// DPO's or GRPO's statistics (TRL's names); empty for SFT.
    pub metrics: Vec<(String, f64)>,
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
        let path = cfg.output_dir.join(METRICS_FILE);
        let metrics = match is_root {
            // Appended to when resuming: the file keeps the whole run's history, up to the
            // checkpoint's step (the steps after it run again).
            true => {
                if start_step > 0 {
                    keep_rows_up_to(&path, start_step)?;
                }
                Some(
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(&path)
                        .with_context(|| format!("opening {}", path.display()))?,
                )
            }
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
        if let Some((_, reward)) = r.metrics.iter().find(|(k, _)| k == "reward") {
            self.history.reward.push((r.step, *reward));
        }
        let Some(f) = self.metrics.as_mut() else { return Ok(()) };
        let row = MetricsRow::Step(StepRow {
            step: r.step,
            epoch: r.epoch,
            loss: r.loss,
            lr: r.lr,
            grad_norm: r.grad_norm,
            tokens_per_s: r.tokens / r.secs,
            peak_rss_bytes: rss.iter().copied().max(),
            peak_rss_bytes_per_rank: rss.clone(),
            step_s: r.secs,
            tokens: r.tokens as u64,
            gpu_memory_bytes_per_rank: gpu.clone(),
            preference: r.metrics.iter().cloned().collect(),
        });
        writeln!(f, "{}", serde_json::to_string(&row)?)?;
        f.flush()?;
        self.history.write_svg(&self.output_dir.join("loss.svg"))?;
        let shown = r.step.is_multiple_of(self.logging_steps) || r.step == self.total_steps;
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
                line += &preference_line(r.metrics.iter().map(|(k, v)| (k.as_str(), *v)));
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

    /// Records an evaluation (rank 0 writes it): SFT's perplexity, or DPO's or GRPO's statistics.
    pub fn eval(&mut self, step: usize, loss: f64, perplexity: Option<f64>, metrics: &[(String, f64)]) -> Result<()> {
        self.history.eval.push((step, loss));
        if let Some(f) = self.metrics.as_mut() {
            let preference = metrics.iter().map(|(k, v)| (format!("eval_{k}"), *v)).collect();
            let row = MetricsRow::Eval(EvalRow { step, eval_loss: loss, eval_perplexity: perplexity, preference });
            writeln!(f, "{}", serde_json::to_string(&row)?)?;
            f.flush()?;
            self.history.write_svg(&self.output_dir.join("loss.svg"))?;
            if self.verbose {
                let ppl = perplexity.map(|p| format!(" | perplexity {p:.3}")).unwrap_or_default();
                eprintln!("eval  {step:>5} | loss {loss:.4}{ppl}{}", preference_line(metrics.iter().map(|(k, v)| (k.as_str(), *v))));
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

/// DPO's or GRPO's statistics on a step or eval line: ` | rewards/chosen 0.0123 | ...`.
fn preference_line<'a>(metrics: impl Iterator<Item = (&'a str, f64)>) -> String {
    metrics.map(|(k, v)| format!(" | {k} {v:.4}")).collect()
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

/// Cuts `path` back to the rows of steps up to `step` (a resumed run's checkpoint): the rows a
/// run wrote after its last checkpoint describe steps that run again. Written to a temporary
/// name, then renamed.
fn keep_rows_up_to(path: &std::path::Path, step: usize) -> Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let kept: String = text.lines().filter(|l| MetricsRow::parse(l).is_some_and(|r| r.step() <= step)).map(|l| format!("{l}\n")).collect();
    let tmp = path.with_extension("jsonl.tmp");
    std::fs::write(&tmp, kept).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}
