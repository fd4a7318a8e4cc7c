//! GRPO's loss as TRL's `GRPOTrainer._compute_loss` computes it (token-level importance
//! sampling, two-sided bounds `1 - epsilon`, `1 + epsilon_high`):
//!
//! ```text
//! r   = exp(logp - old_logp)                    (1 on the first iteration: old = logp, detached)
//! l   = -min(r A, clamp(r, 1 - eps, 1 + eps_high) A) + beta (exp(ref - logp) - (ref - logp) - 1)
//! ```
//!
//! per completion token, `logp` the token's log-probability under the policy's logits divided
//! by the sampling temperature, `A` its completion's advantage. A micro-batch's loss weighs
//! each token by [`token_weights`] (the `loss_type`'s normalisation). The value and the slope
//! of `l` in `logp` are worked out in f64 and the graph sees the line through that point
//! (slope × logp plus a constant), as DPO's loss does: exact in value and gradient, with
//! PyTorch's conventions at the kinks (`min` splits a tie's gradient in halves; `clamp` passes
//! it on its bounds).

use std::ops::Range;

use candle_core::{DType, Result, Tensor, D};

use super::settings::{GrpoLossType, GrpoSettings};

/// One completion in a (rows, width) micro-batch: which positions' logits predict its tokens.
#[derive(Debug, Clone)]
pub struct CompletionRow {
    /// The batch row it sits in.
    pub row: usize,
    /// Positions (within the row) whose logits predict `tokens`, one each.
    pub positions: Range<usize>,
    pub tokens: Vec<u32>,
}

/// The flat positions (row-major in a batch `width` wide) whose logits predict `rows`' tokens,
/// in order: what the last stage keeps (`StageContext::keep_positions`).
pub fn completion_positions(rows: &[CompletionRow], width: usize) -> Result<Vec<u32>> {
    let mut index = vec![];
    for c in rows {
        if c.positions.len() != c.tokens.len() || c.positions.end > width {
            candle_core::bail!(
                "completion in row {}: {} positions for {} tokens (width {width})",
                c.row,
                c.positions.len(),
                c.tokens.len()
            );
        }
        index.extend(c.positions.clone().map(|p| (c.row * width + p) as u32));
    }
    Ok(index)
}

/// Each completion token's log-probability under `logits` divided by `temperature` (gradients
/// flow through it), in the order of `rows` and their tokens, and each token's entropy (no
/// gradient). `logits`: (rows, width, vocab), or (tokens, vocab) already at
/// [`completion_positions`].
pub fn completion_logps(logits: &Tensor, rows: &[CompletionRow], temperature: f64) -> Result<(Tensor, Vec<f32>)> {
    let targets: Vec<u32> = rows.iter().flat_map(|c| c.tokens.iter().copied()).collect();
    let n = targets.len();
    let dev = logits.device();
    let picked = match logits.dims() {
        &[kept, _] if kept == n => logits.to_dtype(DType::F32)?,
        &[_, width, vocab] => {
            let index = completion_positions(rows, width)?;
            logits.reshape(((), vocab))?.index_select(&Tensor::from_vec(index, n, dev)?, 0)?.to_dtype(DType::F32)?
        }
        other => candle_core::bail!("logits of shape {other:?} for {n} completion tokens"),
    };
    // At temperature 1 (TRL's default) no scaled copy of the logits is made.
    let scaled = if temperature == 1.0 { picked } else { (picked / temperature)? };
    if ops::applies(&scaled) {
        // The fused cross-entropy keeps no (tokens, vocab) intermediate for its backward: it
        // recomputes each row's softmax from the logits, which the graph holds anyway.
        let targets: Vec<i64> = targets.iter().map(|&t| t as i64).collect();
        let logps = ops::cross_entropy::cross_entropy_rows(&scaled, &targets)?.neg()?;
        let entropy = row_entropies(&scaled.detach())?;
        return Ok((logps, entropy));
    }
    let log_probs = candle_nn::ops::log_softmax(&scaled, D::Minus1)?;
    let logps = log_probs.gather(&Tensor::from_vec(targets, (n, 1), dev)?, 1)?.squeeze(1)?;
    let detached = log_probs.detach();
    let entropy = (detached.exp()? * &detached)?.sum(D::Minus1)?.neg()?.to_vec1::<f32>()?;
    Ok((logps, entropy))
}

/// Each row's entropy `−Σ p log p` of softmax(row) for (rows, vocab) f32 CPU logits, read in
/// place: `log S − Σ e^(z−m) (z−m) / S` with `S = Σ e^(z−m)`, `m` the row's max.
fn row_entropies(logits: &Tensor) -> Result<Vec<f32>> {
    let (rows, vocab) = logits.dims2()?;
    let logits = logits.contiguous()?;
    let (storage, layout) = logits.storage_and_layout();
    let values = ops::cpu_f32_values(&storage, layout)?;
    Ok((0..rows)
        .map(|r| {
            let row = &values[r * vocab..(r + 1) * vocab];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let (mut sum, mut weighted) = (0f64, 0f64);
            for &z in row {
                let d = z as f64 - max;
                let e = d.exp();
                sum += e;
                weighted += e * d;
            }
            (sum.ln() - weighted / sum) as f32
        })
        .collect())
}

/// What the loss needs of each completion token besides the policy's log-probability, in the
/// order of [`completion_logps`]'s output.
#[derive(Debug, Clone, Default)]
pub struct TokenTerms {
    /// Its completion's advantage.
    pub advantage: Vec<f64>,
    /// The log-probability when the rollout was made (`None`: the first iteration, where it is
    /// the current one).
    pub old_logp: Option<Vec<f32>>,
    /// The reference model's log-probability (needed when beta > 0).
    pub ref_logp: Option<Vec<f32>>,
    /// What the token weighs in the step's loss ([`token_weights`]).
    pub weight: Vec<f64>,
}

/// TRL's logged statistics, as sums over completion tokens (divide by `tokens`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LossStats {
    pub tokens: f64,
    pub kl: f64,
    pub entropy: f64,
    pub low_clipped: f64,
    pub high_clipped: f64,
    pub region_clipped: f64,
    /// The loss's value, exact (f64).
    pub loss: f64,
}

impl LossStats {
    pub fn add(&mut self, o: &LossStats) {
        self.tokens += o.tokens;
        self.kl += o.kl;
        self.entropy += o.entropy;
        self.low_clipped += o.low_clipped;
        self.high_clipped += o.high_clipped;
        self.region_clipped += o.region_clipped;
        self.loss += o.loss;
    }

    pub fn to_vec(&self) -> Vec<f64> {
        vec![self.tokens, self.kl, self.entropy, self.low_clipped, self.high_clipped, self.region_clipped, self.loss]
    }

    pub fn from_slice(v: &[f64]) -> Self {
        Self { tokens: v[0], kl: v[1], entropy: v[2], low_clipped: v[3], high_clipped: v[4], region_clipped: v[5], loss: v[6] }
    }

    /// (name, token mean) in TRL's metric names; `kl` only with a KL term.
    pub fn means(&self, with_kl: bool) -> Vec<(&'static str, f64)> {
        let n = self.tokens.max(1.0);
        let mut out = vec![];
        if with_kl {
            out.push(("kl", self.kl / n));
        }
        out.extend([
            ("entropy", self.entropy / n),
            ("clip_ratio/low_mean", self.low_clipped / n),
            ("clip_ratio/high_mean", self.high_clipped / n),
            ("clip_ratio/region_mean", self.region_clipped / n),
        ]);
        out
    }
}

/// The micro-batch's loss (gradients flow through `logps`) and its statistics; `entropy` is
/// each token's, from [`completion_logps`].
pub fn grpo_loss(settings: &GrpoSettings, logps: &Tensor, entropy: &[f32], terms: &TokenTerms) -> Result<(Tensor, LossStats)> {
    let values: Vec<f32> = logps.detach().to_dtype(DType::F32)?.to_vec1()?;
    let n = values.len();
    if terms.advantage.len() != n || terms.weight.len() != n || entropy.len() != n {
        candle_core::bail!("{n} tokens, {} advantages, {} weights, {} entropies", terms.advantage.len(), terms.weight.len(), entropy.len());
    }
    for (what, v) in [("old", &terms.old_logp), ("reference", &terms.ref_logp)] {
        if v.as_ref().is_some_and(|v| v.len() != n) {
            candle_core::bail!("{n} tokens, a different number of {what} log-probabilities");
        }
    }
    if settings.beta > 0.0 && terms.ref_logp.is_none() {
        candle_core::bail!("beta {} needs the reference model's log-probabilities", settings.beta);
    }
    let (lo, hi) = (1.0 - settings.epsilon, 1.0 + settings.epsilon_high);
    let mut stats = LossStats { tokens: n as f64, ..Default::default() };
    let (mut slopes, mut offset) = (Vec::with_capacity(n), 0.0);
    for i in 0..n {
        let logp = values[i] as f64;
        let a = terms.advantage[i];
        let old = terms.old_logp.as_ref().map_or(logp, |o| o[i] as f64);
        let r = (logp - old).exp();
        let clamped = r.clamp(lo, hi);
        let (unclipped, clipped) = (r * a, clamped * a);
        // d/dlogp of r is r; of clamp(r), r inside [lo, hi] (bounds included) and 0 outside.
        let d_unclipped = r * a;
        let d_clipped = if (lo..=hi).contains(&r) { r * a } else { 0.0 };
        let (mut loss, mut slope) = match unclipped.partial_cmp(&clipped) {
            Some(std::cmp::Ordering::Less) => (-unclipped, -d_unclipped),
            Some(std::cmp::Ordering::Greater) => (-clipped, -d_clipped),
            _ => (-unclipped, -(d_unclipped + d_clipped) / 2.0),
        };
        if settings.beta > 0.0 {
            let d = terms.ref_logp.as_ref().unwrap()[i] as f64 - logp;
            let kl = d.exp() - d - 1.0;
            loss += settings.beta * kl;
            slope += settings.beta * (1.0 - d.exp());
            stats.kl += kl;
        }
        let w = terms.weight[i];
        stats.loss += w * loss;
        stats.entropy += entropy[i] as f64;
        let low = r < lo && a < 0.0;
        let high = r > hi && a > 0.0;
        stats.low_clipped += f64::from(u8::from(low));
        stats.high_clipped += f64::from(u8::from(high));
        stats.region_clipped += f64::from(u8::from(low || high));
        slopes.push((w * slope) as f32);
        offset += w * (loss - slope * logp);
    }
    let slopes = Tensor::from_vec(slopes, n, logps.device())?;
    let loss = ((logps.to_dtype(DType::F32)? * slopes)?.sum_all()? + offset)?;
    Ok((loss, stats))
}

/// What each token of a micro-batch weighs in the step's loss, so that the micro-batches of
/// every rank add up to TRL's logged loss and gradient (TRL divides each micro-batch's loss by
/// the accumulation steps; DDP averages the ranks' gradients):
/// - `grpo`: 1 / (its completion's tokens × the micro-batch's completions);
/// - `bnpo`: 1 / the micro-batch's tokens;
/// - `dr_grpo`: 1 / (the micro-batch's completions × `max_completion_length`);
///
/// each then divided by accumulation × world; `dapo`: 1 / the global batch's tokens.
/// `lengths`: the micro-batch's completions' token counts.
pub fn token_weights(
    loss_type: GrpoLossType,
    lengths: &[usize],
    max_completion_length: usize,
    (grad_accum, world): (usize, usize),
    global_tokens: usize,
) -> Vec<f64> {
    let rows = lengths.len() as f64;
    let tokens: usize = lengths.iter().sum();
    let share = 1.0 / (grad_accum * world) as f64;
    lengths
        .iter()
        .flat_map(|&len| {
            let w = match loss_type {
                GrpoLossType::Grpo => share / (len.max(1) as f64 * rows),
                GrpoLossType::Bnpo => share / tokens.max(1) as f64,
                GrpoLossType::DrGrpo => share / (rows * max_completion_length as f64),
                GrpoLossType::Dapo => 1.0 / global_tokens.max(1) as f64,
            };
            std::iter::repeat_n(w, len)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn settings(beta: f64) -> GrpoSettings {
        GrpoSettings { beta, epsilon: 0.2, epsilon_high: 0.28, ..Default::default() }
    }

    /// On the first iteration the ratio is 1: the loss is −Σ w A and its gradient −w A.
    #[test]
    fn the_first_iteration_is_the_policy_gradient() {
        let v = Var::new(&[-1.0f32, -2.0, -0.5], &Device::Cpu).unwrap();
        let terms = TokenTerms { advantage: vec![1.0, 1.0, -2.0], weight: vec![0.25, 0.25, 0.5], ..Default::default() };
        let (loss, stats) = grpo_loss(&settings(0.0), v.as_tensor(), &[0.0; 3], &terms).unwrap();
        let g: Vec<f32> = loss.backward().unwrap().get(v.as_tensor()).unwrap().to_vec1().unwrap();
        assert_eq!(g, vec![-0.25, -0.25, 1.0]);
        assert!((stats.loss - 0.5).abs() < 1e-12 && (loss.to_scalar::<f32>().unwrap() - 0.5).abs() < 1e-6);
        assert_eq!(stats.region_clipped, 0.0);
    }

    /// Past the bounds the clipped side wins and carries no gradient; inside, the ratio's.
    #[test]
    fn clipping_follows_the_sign_of_the_advantage() {
        let old = vec![0.0f32; 4];
        // Ratios e^0.5 ≈ 1.65 (above 1.28) and e^-0.5 ≈ 0.61 (below 0.8), each with A = ±1.
        let v = Var::new(&[0.5f32, 0.5, -0.5, -0.5], &Device::Cpu).unwrap();
        let terms = TokenTerms { advantage: vec![1.0, -1.0, 1.0, -1.0], old_logp: Some(old), weight: vec![1.0; 4], ..Default::default() };
        let (loss, stats) = grpo_loss(&settings(0.0), v.as_tensor(), &[0.0; 4], &terms).unwrap();
        let g: Vec<f32> = loss.backward().unwrap().get(v.as_tensor()).unwrap().to_vec1().unwrap();
        let (up, down) = (0.5f64.exp(), (-0.5f64).exp());
        // A > 0, r high: clipped at 1.28, no gradient. A < 0, r high: -min(-r, -1.28) = r.
        // A > 0, r low: -min(r, 0.8) = -r. A < 0, r low: -min(-r, -0.8) = 0.8, no gradient.
        let want = [0.0, up, -down, 0.0];
        for (a, b) in g.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-6, "{g:?} vs {want:?}");
        }
        assert!((stats.loss - (-1.28 + up - down + 0.8)).abs() < 1e-9, "{}", stats.loss);
        assert_eq!((stats.high_clipped, stats.low_clipped, stats.region_clipped), (1.0, 1.0, 2.0));
    }

    /// The KL term k3 = e^d − d − 1 (d = ref − logp) and its slope 1 − e^d.
    #[test]
    fn the_kl_term_is_k3() {
        let v = Var::new(&[-1.0f32], &Device::Cpu).unwrap();
        let terms = TokenTerms { advantage: vec![0.0], ref_logp: Some(vec![-1.5]), weight: vec![1.0], ..Default::default() };
        let (loss, stats) = grpo_loss(&settings(0.1), v.as_tensor(), &[0.0], &terms).unwrap();
        let g: Vec<f32> = loss.backward().unwrap().get(v.as_tensor()).unwrap().to_vec1().unwrap();
        let d: f64 = -0.5;
        assert!((stats.kl - (d.exp() - d - 1.0)).abs() < 1e-7);
        assert!((g[0] as f64 - 0.1 * (1.0 - d.exp())).abs() < 1e-6);
        assert!(grpo_loss(&settings(0.1), v.as_tensor(), &[0.0], &TokenTerms { ref_logp: None, ..terms }).is_err());
    }

    #[test]
    fn weights_follow_the_loss_type() {
        let lengths = [2, 4];
        let w = |t| token_weights(t, &lengths, 8, (2, 1), 12);
        assert_eq!(w(GrpoLossType::Grpo), vec![0.125, 0.125, 0.0625, 0.0625, 0.0625, 0.0625]);
        assert_eq!(w(GrpoLossType::Bnpo), vec![1.0 / 12.0; 6]);
        assert_eq!(w(GrpoLossType::DrGrpo), vec![1.0 / 32.0; 6]);
        assert_eq!(w(GrpoLossType::Dapo), vec![1.0 / 12.0; 6]);
    }

    /// Log-probabilities of tempered logits, gathered at the completion's positions.
    #[test]
    fn completion_logps_read_the_right_positions() {
        let logits = Tensor::new(&[[[0f32, 0.0], [2.0, 0.0], [0.0, 1.0]]], &Device::Cpu).unwrap();
        let rows = [CompletionRow { row: 0, positions: 1..3, tokens: vec![0, 1] }];
        let (lp, ent) = completion_logps(&logits, &rows, 2.0).unwrap();
        let lp: Vec<f32> = lp.to_vec1().unwrap();
        let want = [1.0 - (1f64.exp() + 1.0).ln(), 0.5 - (1.0 + 0.5f64.exp()).ln()];
        for (a, b) in lp.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-6, "{lp:?} vs {want:?}");
        }
        assert!(ent.iter().all(|e| *e > 0.0 && *e < std::f32::consts::LN_2 + 1e-6));
    }
}
