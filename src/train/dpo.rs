//! Direct preference optimisation's objective (Rafailov et al., 2023) as TRL's
//! `DPOTrainer.dpo_loss` computes it, kept out of the engine like the SFT loss (`loss.rs`).
//!
//! A micro-batch holds whole pairs, each pair's chosen row followed by its rejected row, so a
//! pair never straddles micro-batches or ranks and the loss, a sum of independent per-pair terms,
//! is what one rank computes on the whole batch once every rank scales by 1 / the global pairs.
//! A row's log-probability is minus the sum of its completion positions' token losses (the
//! prompt's positions carry no target, as in SFT's loss masks).
//!
//! With `h = (log π(c) − log π(r)) − (log ref(c) − log ref(r))` per pair:
//! - `sigmoid` (the paper's DPO, TRL's default): `−log σ(β h)`;
//! - `hinge` (SLiC): `max(0, 1 − β h)`;
//! - `ipo` (Azar et al.): `(h − 1 / (2β))²`, with each row's log-probability divided by its
//!   completion's token count first (TRL averages IPO's log-probabilities over tokens).
//!
//! TRL's logged statistics come with it: rewards `β (log π − log ref)` of the chosen and the
//! rejected rows, their margin, the accuracy (chosen reward above the rejected one), and the
//! policy's log-probabilities, as sums over pairs so that micro-batches and ranks add them up.

use std::str::FromStr;

use candle_core::{Result, Tensor, D};

/// Which preference loss (`--dpo-loss`), by TRL's `loss_type` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DpoLossKind {
    #[default]
    Sigmoid,
    Hinge,
    Ipo,
}

impl FromStr for DpoLossKind {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s {
            "sigmoid" => Ok(Self::Sigmoid),
            "hinge" => Ok(Self::Hinge),
            "ipo" => Ok(Self::Ipo),
            other => anyhow::bail!("--dpo-loss {other:?}: expected sigmoid, hinge or ipo (TRL's loss_type names)"),
        }
    }
}

/// `--method dpo`'s settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DpoSettings {
    pub beta: f64,
    pub loss: DpoLossKind,
}

/// TRL's default beta.
pub const DEFAULT_BETA: f64 = 0.1;

impl DpoSettings {
    /// The settings of `--method M --dpo-beta B --dpo-loss L`: `None` for SFT, which refuses
    /// the DPO flags rather than ignore them.
    pub fn from_flags(method: &str, beta: Option<f64>, loss: Option<&str>) -> anyhow::Result<Option<Self>> {
        match method {
            "sft" => {
                if beta.is_some() || loss.is_some() {
                    anyhow::bail!("--dpo-beta and --dpo-loss apply to --method dpo (this run is --method sft)");
                }
                Ok(None)
            }
            "dpo" => {
                let beta = beta.unwrap_or(DEFAULT_BETA);
                if !(beta.is_finite() && beta > 0.0) {
                    anyhow::bail!("--dpo-beta must be a positive number, got {beta}");
                }
                Ok(Some(Self { beta, loss: loss.map(str::parse).transpose()?.unwrap_or_default() }))
            }
            "grpo" => {
                if beta.is_some() || loss.is_some() {
                    anyhow::bail!(
                        "--dpo-beta and --dpo-loss apply to --method dpo (this run is --method grpo: see --beta and --loss-type)"
                    );
                }
                Ok(None)
            }
            other => anyhow::bail!("--method {other:?}: use sft, dpo or grpo"),
        }
    }
}

/// TRL's per-step statistics, summed over pairs (divide by `pairs` for TRL's means).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DpoStats {
    pub pairs: usize,
    pub rewards_chosen: f64,
    pub rewards_rejected: f64,
    /// Pairs whose chosen reward is above the rejected one.
    pub accurate: usize,
    pub logps_chosen: f64,
    pub logps_rejected: f64,
}

impl DpoStats {
    pub fn add(&mut self, other: &DpoStats) {
        self.pairs += other.pairs;
        self.rewards_chosen += other.rewards_chosen;
        self.rewards_rejected += other.rewards_rejected;
        self.accurate += other.accurate;
        self.logps_chosen += other.logps_chosen;
        self.logps_rejected += other.logps_rejected;
    }

    /// (name, mean over pairs) in TRL's metric names.
    pub fn means(&self) -> Vec<(&'static str, f64)> {
        let n = self.pairs.max(1) as f64;
        vec![
            ("rewards/chosen", self.rewards_chosen / n),
            ("rewards/rejected", self.rewards_rejected / n),
            ("rewards/accuracies", self.accurate as f64 / n),
            ("rewards/margins", (self.rewards_chosen - self.rewards_rejected) / n),
            ("logps/chosen", self.logps_chosen / n),
            ("logps/rejected", self.logps_rejected / n),
        ]
    }
}

/// Each row's summed log-probability from the last stage's per-position token losses of a
/// (rows, width) micro-batch: `−Σ` over the row (positions without a target add 0).
pub fn row_logps(per_position: &Tensor, rows: usize) -> Result<Tensor> {
    if per_position.rank() != 1 || !per_position.elem_count().is_multiple_of(rows.max(1)) {
        candle_core::bail!("expected {rows} rows of per-position losses, got shape {:?}", per_position.dims());
    }
    per_position.reshape((rows, ()))?.sum(D::Minus1)?.neg()
}

/// The pairs' loss, summed over pairs, and their statistics. `policy` holds the rows'
/// log-probabilities (chosen, rejected, chosen, ...; gradients flow through it), `reference` the
/// reference model's for the same rows, `completion_tokens` each row's completion length (used
/// by IPO only).
pub fn dpo_loss(
    kind: DpoLossKind,
    beta: f64,
    policy: &Tensor,
    reference: &[f32],
    completion_tokens: &[usize],
) -> Result<(Tensor, DpoStats)> {
    let rows = policy.elem_count();
    if !rows.is_multiple_of(2) || reference.len() != rows || completion_tokens.len() != rows {
        candle_core::bail!(
            "DPO needs chosen/rejected row pairs: {rows} policy rows, {} reference values, {} lengths",
            reference.len(),
            completion_tokens.len()
        );
    }
    // Written so that NaN is refused too.
    if beta.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
        candle_core::bail!("--dpo-beta must be above 0, got {beta}");
    }
    let pairs = rows / 2;
    let dev = policy.device();
    let reference_t = Tensor::from_slice(reference, rows, dev)?.to_dtype(policy.dtype())?;
    let (policy_n, reference_n) = match kind {
        DpoLossKind::Ipo => {
            let lengths: Vec<f32> = completion_tokens.iter().map(|&n| n.max(1) as f32).collect();
            let lengths = Tensor::from_vec(lengths, rows, dev)?.to_dtype(policy.dtype())?;
            (policy.div(&lengths)?, reference_t.div(&lengths)?)
        }
        _ => (policy.clone(), reference_t.clone()),
    };
    // (pairs, 2): column 0 the chosen rows, column 1 the rejected ones.
    let log_ratio = (policy_n - reference_n)?.reshape((pairs, 2))?;
    let h = (log_ratio.narrow(1, 0, 1)? - log_ratio.narrow(1, 1, 1)?)?.squeeze(1)?;
    // Each pair's loss and its slope in h, in f64; the graph sees the line through that point
    // (slope × h plus a constant), so both the value and the gradient are exact everywhere. A
    // composite of candle ops cannot be: the stable −log σ(x) = max(−x, 0) + log(1 + e^−|x|)
    // has its kinks at x = 0, where every pair starts (policy = reference).
    let hv: Vec<f64> = h.detach().to_dtype(candle_core::DType::F64)?.to_vec1()?;
    let (mut slopes, mut offset) = (Vec::with_capacity(pairs), 0.0);
    for &h in &hv {
        let (loss, slope) = pair_loss(kind, beta, h);
        slopes.push(slope);
        offset += loss - slope * h;
    }
    let slopes = Tensor::from_vec(slopes, pairs, dev)?.to_dtype(h.dtype())?;
    let loss = ((h * slopes)?.sum_all()? + offset)?;

    // Statistics from the unnormalised log-probabilities, as TRL logs them.
    let pol: Vec<f32> = policy.detach().to_dtype(candle_core::DType::F32)?.to_vec1()?;
    let mut stats = DpoStats { pairs, ..Default::default() };
    for p in 0..pairs {
        let (c, r) = (2 * p, 2 * p + 1);
        let chosen = beta * (pol[c] - reference[c]) as f64;
        let rejected = beta * (pol[r] - reference[r]) as f64;
        stats.rewards_chosen += chosen;
        stats.rewards_rejected += rejected;
        stats.accurate += usize::from(chosen > rejected);
        stats.logps_chosen += pol[c] as f64;
        stats.logps_rejected += pol[r] as f64;
    }
    Ok((loss, stats))
}

/// One pair's loss and its derivative in `h` (the policy's log-ratio margin over the
/// reference's), TRL's formulas.
fn pair_loss(kind: DpoLossKind, beta: f64, h: f64) -> (f64, f64) {
    match kind {
        // −log σ(βh) = softplus(−βh), written to stay finite for large |βh|.
        DpoLossKind::Sigmoid => {
            let x = beta * h;
            let loss = (-x).max(0.0) + (-x.abs()).exp().ln_1p();
            // σ(−x), from whichever side keeps e^· ≤ 1.
            let s = if x >= 0.0 { (-x).exp() / (1.0 + (-x).exp()) } else { 1.0 / (1.0 + x.exp()) };
            (loss, -beta * s)
        }
        DpoLossKind::Hinge => {
            let m = 1.0 - beta * h;
            if m > 0.0 {
                (m, -beta)
            } else {
                (0.0, 0.0)
            }
        }
        DpoLossKind::Ipo => {
            let d = h - 1.0 / (2.0 * beta);
            (d * d, 2.0 * d)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn loss_names_are_trls() {
        assert_eq!("sigmoid".parse::<DpoLossKind>().unwrap(), DpoLossKind::Sigmoid);
        assert_eq!("ipo".parse::<DpoLossKind>().unwrap(), DpoLossKind::Ipo);
        let err = "kto".parse::<DpoLossKind>().unwrap_err().to_string();
        assert!(err.contains("--dpo-loss") && err.contains("sigmoid, hinge or ipo"), "{err}");
    }

    /// At the start the policy is the reference: every sigmoid pair loses log 2 and has reward 0.
    #[test]
    fn the_first_step_loses_log_2_per_pair() {
        let logps = [-12.5f32, -20.0, -3.0, -3.5];
        let policy = Var::new(&logps, &Device::Cpu).unwrap();
        let (loss, stats) = dpo_loss(DpoLossKind::Sigmoid, 0.1, policy.as_tensor(), &logps, &[5, 7, 2, 3]).unwrap();
        // d/dh −log σ(βh) at h = 0 is −β/2: the chosen rows' log-probabilities go up, the
        // rejected ones' down (a kink in a composite formula would give 0 or β here).
        let g: Vec<f32> = loss.backward().unwrap().get(policy.as_tensor()).unwrap().to_vec1().unwrap();
        assert_eq!(g, vec![-0.05, 0.05, -0.05, 0.05]);
        let loss = loss.to_scalar::<f32>().unwrap() as f64;
        assert!((loss - 2.0 * std::f64::consts::LN_2).abs() < 1e-6, "{loss}");
        assert_eq!((stats.pairs, stats.accurate, stats.rewards_chosen), (2, 0, 0.0));
        assert!((stats.logps_chosen - (-15.5)).abs() < 1e-9);
    }

    /// The three losses and their gradients, against the formulas written out in f64.
    #[test]
    fn losses_and_gradients_follow_the_formulas() {
        let pol = [-10.0f32, -14.0, -30.0, -29.0];
        let refr = [-11.0f32, -12.0, -31.0, -30.5];
        let lens = [4usize, 6, 10, 8];
        let beta = 0.5;
        for kind in [DpoLossKind::Sigmoid, DpoLossKind::Hinge, DpoLossKind::Ipo] {
            let v = Var::new(&pol, &Device::Cpu).unwrap();
            let (loss, _) = dpo_loss(kind, beta, v.as_tensor(), &refr, &lens).unwrap();
            let grads = loss.backward().unwrap();
            let g: Vec<f32> = grads.get(v.as_tensor()).unwrap().to_vec1().unwrap();
            let (mut want, mut want_g) = (0f64, [0f64; 4]);
            for p in 0..2 {
                let (c, r) = (2 * p, 2 * p + 1);
                let norm = |i: usize| if kind == DpoLossKind::Ipo { lens[i] as f64 } else { 1.0 };
                let h = (pol[c] - refr[c]) as f64 / norm(c) - (pol[r] - refr[r]) as f64 / norm(r);
                // dL/dh for this pair.
                let (l, dl) = match kind {
                    DpoLossKind::Sigmoid => {
                        let s = 1.0 / (1.0 + (-beta * h).exp());
                        (-s.ln(), -beta * (1.0 - s))
                    }
                    DpoLossKind::Hinge => ((1.0 - beta * h).max(0.0), if 1.0 - beta * h > 0.0 { -beta } else { 0.0 }),
                    DpoLossKind::Ipo => ((h - 1.0 / (2.0 * beta)).powi(2), 2.0 * (h - 1.0 / (2.0 * beta))),
                };
                want += l;
                want_g[c] = dl / norm(c);
                want_g[r] = -dl / norm(r);
            }
            let got = loss.to_scalar::<f32>().unwrap() as f64;
            assert!((got - want).abs() < 1e-5 * want.abs().max(1.0), "{kind:?}: {got} vs {want}");
            for (a, b) in g.iter().zip(want_g) {
                assert!((*a as f64 - b).abs() < 1e-5, "{kind:?}: gradient {g:?} vs {want_g:?}");
            }
        }
    }

    #[test]
    fn row_logps_sum_each_row() {
        let per_position = Tensor::new(&[1f32, 2.0, 0.0, 0.5, 0.5, 0.0], &Device::Cpu).unwrap();
        assert_eq!(row_logps(&per_position, 2).unwrap().to_vec1::<f32>().unwrap(), vec![-3.0, -1.0]);
        assert!(dpo_loss(DpoLossKind::Sigmoid, 0.1, &per_position, &[0.0; 6], &[1; 5]).is_err());
        assert!(dpo_loss(DpoLossKind::Sigmoid, 0.0, &per_position, &[0.0; 6], &[1; 6]).unwrap_err().to_string().contains("--dpo-beta"));
    }
}
