//! Sharded AdamW on fp32 chunks (exactly torch.optim.AdamW's arithmetic), learning-rate
//! schedules as transformers' `get_scheduler` defines them, and the clipping coefficient of
//! torch's `clip_grad_norm_`.

use anyhow::{bail, Result};
use candle_core::Tensor;
use kernels::adamw::AdamWConstants;

#[derive(Debug, Clone, Copy)]
pub struct AdamWConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self { lr: 1e-5, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }
}

/// Moments of one parameter chunk.
#[derive(Debug, Clone)]
pub struct AdamWState {
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
}

impl AdamWState {
    pub fn new(len: usize) -> Self {
        Self { exp_avg: vec![0.0; len], exp_avg_sq: vec![0.0; len] }
    }
}

/// One AdamW step on a chunk, `step` counting from 1. Follows torch's single-tensor
/// implementation operation by operation, in f32:
/// `p *= 1 - lr*wd; m = lerp(m, g, 1-b1); v = v*b2 + (1-b2)*g*g;
///  p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)`.
/// `clip`: the gradient-clipping coefficient, multiplied into each gradient as it is read
/// (torch scales the gradients in place first: the same f32 product). `grad` is left zeroed
/// for the next step's accumulation (zeroed by the thread that just read it, while its cache
/// lines are at hand, instead of by a separate one-thread pass).
#[allow(clippy::too_many_arguments)]
pub fn adamw_step(
    cfg: &AdamWConfig,
    lr: f64,
    weight_decay: f64,
    step: u64,
    param: &mut [f32],
    grad: &mut [f32],
    state: &mut AdamWState,
    clip: Option<f32>,
) {
    let k = AdamWConstants::new(cfg.beta1, cfg.beta2, cfg.eps, lr, weight_decay, step, clip);
    assert!(grad.len() == param.len(), "AdamW: chunk lengths differ");
    kernels::adamw::update(k, param, grad, &mut state.exp_avg, &mut state.exp_avg_sq);
}

/// A chunk's moments as tensors on the compute device (device-resident state).
pub struct AdamWTensors {
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
}

/// `adamw_step` as tensor operations on the chunk's device (1-D f32 tensors), the same f32
/// operations in the same order but for the loop's fused multiply-adds, which candle rounds in
/// two steps; returns the new parameter chunk.
pub fn adamw_step_tensors(
    cfg: &AdamWConfig,
    lr: f64,
    weight_decay: f64,
    step: u64,
    param: &Tensor,
    grad: &Tensor,
    state: &mut AdamWTensors,
) -> Result<Tensor> {
    // f32 constants, as the host loop uses them (affine takes f64 and applies them in f32).
    let f32c = |x: f64| x as f32 as f64;
    let bc1 = 1.0 - cfg.beta1.powi(step as i32);
    let bc2 = 1.0 - cfg.beta2.powi(step as i32);
    let param = if weight_decay != 0.0 { param.affine(f32c(1.0 - lr * weight_decay), 0.0)? } else { param.clone() };
    let (m, v) = (&state.exp_avg, &state.exp_avg_sq);
    // `1 - beta` in f64 rounded once to f32, as torch and the loop (`AdamWConstants`) take it.
    let m = (m + (grad - m)?.affine(f32c(1.0 - cfg.beta1), 0.0)?)?;
    let v = (v.affine(f32c(cfg.beta2), 0.0)? + (grad.affine(f32c(1.0 - cfg.beta2), 0.0)? * grad)?)?;
    let denom = ((v.sqrt()? / f32c(bc2.sqrt()))? + f32c(cfg.eps))?;
    let param = (param + (m.affine(-f32c(lr / bc1), 0.0)? / denom)?)?;
    *state = AdamWTensors { exp_avg: m, exp_avg_sq: v };
    Ok(param)
}

/// transformers' schedulers: multiplier of the base learning rate at `step` (0-based, the
/// optimizer step about to be taken).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    Constant,
    Linear,
    Cosine,
}

impl std::str::FromStr for Schedule {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "constant" | "constant_with_warmup" => Self::Constant,
            "linear" => Self::Linear,
            "cosine" => Self::Cosine,
            other => bail!("--lr-scheduler {other:?}: use constant, linear or cosine"),
        })
    }
}

pub fn lr_multiplier(schedule: Schedule, step: usize, warmup: usize, total: usize) -> f64 {
    if step < warmup {
        return step as f64 / warmup.max(1) as f64;
    }
    match schedule {
        Schedule::Constant => 1.0,
        Schedule::Linear => ((total.saturating_sub(step)) as f64 / (total.saturating_sub(warmup)).max(1) as f64).max(0.0),
        Schedule::Cosine => {
            let progress = (step - warmup) as f64 / (total.saturating_sub(warmup)).max(1) as f64;
            (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0)
        }
    }
}

/// torch's `clip_grad_norm_`: the factor gradients are multiplied by (at most 1).
pub fn clip_coefficient(total_norm: f64, max_norm: f64) -> f64 {
    (max_norm / (total_norm + 1e-6)).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Every step's parameters and both moments equal torch.optim.AdamW's (its single-tensor
    /// arithmetic, `tests/reference/make_optimizer_reference.py`): the update is torch's
    /// operations in torch's order, so all but a rare value (2 ulp, under 1% of places) are
    /// bit for bit, and any change of formula, rounding or order (a misplaced eps, `1 - beta`
    /// rounded differently, a fused multiply-add split in two) shows. With gradients of ~1e-6, eps is ~1% of each denominator. The second case has
    /// no decay, other betas and eps, gradients over 6 decades and a clip coefficient.
    #[test]
    fn adamw_follows_torch_step_by_step() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/adamw-steps.safetensors");
        let reference = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        for case in ["case0", "case1"] {
            let get = |k: &str| reference[&format!("{case}.{k}")].clone();
            let h = get("hyper").to_vec1::<f64>().unwrap();
            let cfg = AdamWConfig { lr: h[0], beta1: h[1], beta2: h[2], eps: h[3], weight_decay: h[4] };
            let clip = (h[5] != 1.0).then_some(h[5] as f32);
            let mut p = get("param0").to_vec1::<f32>().unwrap();
            let mut state = AdamWState::new(p.len());
            let grads = get("grads").to_vec2::<f32>().unwrap();
            let (want_p, want_m, want_v) = (
                get("params").to_vec2::<f32>().unwrap(),
                get("exp_avg").to_vec2::<f32>().unwrap(),
                get("exp_avg_sq").to_vec2::<f32>().unwrap(),
            );
            for (s, g) in grads.iter().enumerate() {
                adamw_step(&cfg, cfg.lr, cfg.weight_decay, s as u64 + 1, &mut p, &mut g.clone(), &mut state, clip);
                for (what, got, want) in
                    [("param", &p, &want_p[s]), ("exp_avg", &state.exp_avg, &want_m[s]), ("exp_avg_sq", &state.exp_avg_sq, &want_v[s])]
                {
                    // Units in the last place between each value and torch's (same sign).
                    let ulps: Vec<u32> =
                        got.iter().zip(want).map(|(a, b)| (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32).collect();
                    let (differ, worst) = (ulps.iter().filter(|&&u| u > 0).count(), ulps.iter().copied().max().unwrap_or(0));
                    assert!(
                        worst <= 2 && differ * 100 <= got.len(),
                        "{case} step {}: {what} differs from torch at {differ} of {} places, by up to {worst} ulp",
                        s + 1,
                        got.len()
                    );
                }
            }
        }
    }

    #[test]
    fn schedules_match_transformers_formulas() {
        assert_eq!(lr_multiplier(Schedule::Linear, 0, 2, 10), 0.0);
        assert_eq!(lr_multiplier(Schedule::Linear, 1, 2, 10), 0.5);
        assert_eq!(lr_multiplier(Schedule::Linear, 2, 2, 10), 1.0);
        assert_eq!(lr_multiplier(Schedule::Linear, 6, 2, 10), 0.5);
        assert!((lr_multiplier(Schedule::Cosine, 6, 2, 10) - 0.5).abs() < 1e-12);
        assert_eq!(lr_multiplier(Schedule::Constant, 9, 0, 10), 1.0);
    }

    #[test]
    fn first_adam_step_moves_by_lr_times_sign() {
        let cfg = AdamWConfig { lr: 0.1, ..Default::default() };
        let mut p = vec![1.0f32, 1.0];
        let mut st = AdamWState::new(2);
        let mut g = [0.5, -2.0];
        adamw_step(&cfg, 0.1, 0.0, 1, &mut p, &mut g, &mut st, None);
        assert_eq!(g, [0.0, 0.0], "the gradient is left zeroed");
        assert!((p[0] - 0.9).abs() < 1e-6 && (p[1] - 1.1).abs() < 1e-6, "{p:?}");
        assert!((clip_coefficient(2.0, 1.0) - 0.5).abs() < 1e-6 && clip_coefficient(0.5, 1.0) == 1.0);
    }

    /// The device-state optimizer computes what the host loop computes, step after step.
    #[test]
    fn tensor_adamw_follows_the_loop() {
        let cfg = AdamWConfig { lr: 1e-3, weight_decay: 0.1, ..Default::default() };
        let n = 1000;
        let mut state = 7u64;
        let mut draw =
            || (0..n).map(|_| (kernels::rng::splitmix64(&mut state) >> 40) as f32 / (1u64 << 23) as f32 - 1.0).collect::<Vec<f32>>();
        let mut p = draw();
        let start = p.clone();
        let mut st = AdamWState::new(n);
        let mut pt = Tensor::from_slice(&p, n, &Device::Cpu).unwrap();
        let mut stt = AdamWTensors {
            exp_avg: Tensor::zeros(n, candle_core::DType::F32, &Device::Cpu).unwrap(),
            exp_avg_sq: Tensor::zeros(n, candle_core::DType::F32, &Device::Cpu).unwrap(),
        };
        for step in 1..=20u64 {
            let g = draw();
            adamw_step(&cfg, 1e-3, 0.1, step, &mut p, &mut g.clone(), &mut st, None);
            pt = adamw_step_tensors(&cfg, 1e-3, 0.1, step, &pt, &Tensor::from_slice(&g, n, &Device::Cpu).unwrap(), &mut stt).unwrap();
        }
        // Parameters and both moments against the loop's own values.
        // Relative to each vector's scale: the loop's moment update is torch's fused
        // multiply-add, which candle's ops round in two steps.
        let rel = |got: &Tensor, want: &[f32]| {
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            got.to_vec1::<f32>().unwrap().iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale
        };
        for (what, got, want) in
            [("weights", &pt, &p), ("exp_avg", &stt.exp_avg, &st.exp_avg), ("exp_avg_sq", &stt.exp_avg_sq, &st.exp_avg_sq)]
        {
            let worst = rel(got, want);
            assert!(worst < 1e-5, "tensor AdamW {what} drifted from the loop by {worst}");
        }
        // The weights moved: twenty steps of lr 1e-3 move them far more than the tolerance above.
        let moved = p.iter().zip(&start).map(|(a, b)| (a - b).abs()).sum::<f32>() / n as f32;
        assert!(moved > 1e-3, "the loop barely moved the weights ({moved}): the comparison above proves little");
    }
}
