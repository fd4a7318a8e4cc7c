//! Sharded AdamW on fp32 chunks (exactly torch.optim.AdamW's arithmetic), learning-rate
//! schedules as transformers' `get_scheduler` defines them, and the clipping coefficient of
//! torch's `clip_grad_norm_`.

use anyhow::{bail, Result};
use candle_core::Tensor;

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
    let k = AdamWConstants::new(cfg, lr, weight_decay, step, clip);
    // Elementwise, so split over the threads (the same values as one loop), on candle's barrier
    // pool, where the step's products and attention ran: a second pool's threads would spin
    // against it for the cores.
    const CHUNK: usize = 1 << 16;
    let level = models::ops::kernels::SimdLevel::current();
    let n = param.len();
    assert!(grad.len() == n && state.exp_avg.len() == n && state.exp_avg_sq.len() == n, "AdamW: chunk lengths differ");
    let (p, g) = (Shared(param.as_mut_ptr()), Shared(grad.as_mut_ptr()));
    let (m, v) = (Shared(state.exp_avg.as_mut_ptr()), Shared(state.exp_avg_sq.as_mut_ptr()));
    candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(CHUNK), |range| {
        let (p, g, m, v) = (&p, &g, &m, &v);
        for c in range {
            let (lo, hi) = (c * CHUNK, ((c + 1) * CHUNK).min(n));
            // SAFETY: each chunk index belongs to one thread, so its element range of the four
            // buffers (all n long, checked above) is used by that thread alone.
            let (param, grad, ms, vs) = unsafe { (p.range(lo, hi), g.range(lo, hi), m.range(lo, hi), v.range(lo, hi)) };
            update_chunk(level, k, param, grad, ms, vs);
            grad.fill(0.0);
        }
    });
}

/// One chunk's update at the widest vector level the CPU has.
fn update_chunk(
    level: models::ops::kernels::SimdLevel,
    k: AdamWConstants,
    param: &mut [f32],
    grad: &[f32],
    ms: &mut [f32],
    vs: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        use models::ops::kernels::SimdLevel;
        // SAFETY: the level never exceeds what the CPU has.
        match level {
            SimdLevel::Avx512 => return unsafe { adamw_chunk_avx512(k, param, grad, ms, vs) },
            SimdLevel::Avx2 => return unsafe { adamw_chunk_avx2(k, param, grad, ms, vs) },
            SimdLevel::Scalar => {}
        }
    }
    adamw_chunk(k, param, grad, ms, vs)
}

/// A buffer the pool's threads write in disjoint ranges.
struct Shared(*mut f32);
// SAFETY: the threads write disjoint ranges (see `adamw_step`), and the buffer outlives the
// parallel region.
unsafe impl Sync for Shared {}
impl Shared {
    /// # Safety
    /// `lo..hi` must be inside the buffer and used by no other thread.
    // A mutable piece from a shared handle is the point: the threads share the handle and
    // the safety contract keeps their pieces apart.
    #[allow(clippy::mut_from_ref)]
    unsafe fn range(&self, lo: usize, hi: usize) -> &mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(lo), hi - lo)
    }
}

/// The per-step numbers of [`adamw_step`], by value so the loop keeps them in registers (and
/// the GPU kernel of `adamw_cuda` gets the same f32 values).
#[derive(Clone, Copy)]
pub(crate) struct AdamWConstants {
    pub decay: Option<f32>,
    pub b2: f32,
    pub one_minus_b1: f32,
    pub one_minus_b2: f32,
    pub step_size: f32,
    pub bc2_sqrt: f32,
    pub eps: f32,
    pub clip: Option<f32>,
}

impl AdamWConstants {
    pub fn new(cfg: &AdamWConfig, lr: f64, weight_decay: f64, step: u64, clip: Option<f32>) -> Self {
        let bc1 = 1.0 - cfg.beta1.powi(step as i32);
        let bc2 = 1.0 - cfg.beta2.powi(step as i32);
        Self {
            decay: (weight_decay != 0.0).then_some((1.0 - lr * weight_decay) as f32),
            b2: cfg.beta2 as f32,
            one_minus_b1: 1.0 - cfg.beta1 as f32,
            one_minus_b2: 1.0 - cfg.beta2 as f32,
            step_size: (lr / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: cfg.eps as f32,
            clip,
        }
    }
}

/// The update of one chunk. Plain IEEE operations in torch's order (no fused multiply-add), so
/// the vector copies below compute exactly what this loop does, several lanes at a time.
#[inline(always)]
fn adamw_chunk(k: AdamWConstants, param: &mut [f32], grad: &[f32], ms: &mut [f32], vs: &mut [f32]) {
    for (((p, &g), m), v) in param.iter_mut().zip(grad).zip(ms.iter_mut()).zip(vs.iter_mut()) {
        let g = match k.clip {
            Some(c) => g * c,
            None => g,
        };
        if let Some(decay) = k.decay {
            *p *= decay;
        }
        *m += (g - *m) * k.one_minus_b1;
        *v = *v * k.b2 + k.one_minus_b2 * g * g;
        let denom = v.sqrt() / k.bc2_sqrt + k.eps;
        *p -= k.step_size * (*m / denom);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn adamw_chunk_avx512(k: AdamWConstants, param: &mut [f32], grad: &[f32], ms: &mut [f32], vs: &mut [f32]) {
    adamw_chunk(k, param, grad, ms, vs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn adamw_chunk_avx2(k: AdamWConstants, param: &mut [f32], grad: &[f32], ms: &mut [f32], vs: &mut [f32]) {
    adamw_chunk(k, param, grad, ms, vs)
}

/// `Σ x²` in f64 over both cores: eight running sums per task so the loop runs in vector lanes
/// (the gradient norm before clipping; the order of the f64 sums differs from one loop's only
/// far below f32's precision).
pub fn sum_of_squares(xs: &[f32]) -> f64 {
    const CHUNK: usize = 1 << 16;
    // On candle's barrier pool, as the rest of the step.
    let partial = models::ops::pool::pool_map(xs.len().div_ceil(CHUNK), |c| {
        let chunk = &xs[c * CHUNK..((c + 1) * CHUNK).min(xs.len())];
        let mut acc = [0f64; 8];
        let lanes = chunk.chunks_exact(8);
        let tail: f64 = lanes.remainder().iter().map(|&x| x as f64 * x as f64).sum();
        for l in lanes {
            for (a, &x) in acc.iter_mut().zip(l) {
                *a += x as f64 * x as f64;
            }
        }
        acc.iter().sum::<f64>() + tail
    });
    partial.iter().sum()
}

/// A chunk's moments as tensors on the compute device (device-resident state).
pub struct AdamWTensors {
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
}

/// `adamw_step` as tensor operations on the chunk's device (1-D f32 tensors), the same f32
/// arithmetic in the same order; returns the new parameter chunk.
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
    // 1 - b1 is exact in f32 (Sterbenz), so f32c(1 - b1 as f32) equals the loop's `1.0 - b1`.
    let m = (m + (grad - m)?.affine(f32c(1.0 - f32c(cfg.beta1)), 0.0)?)?;
    let v = (v.affine(f32c(cfg.beta2), 0.0)? + grad.sqr()?.affine(f32c(1.0 - f32c(cfg.beta2)), 0.0)?)?;
    let denom = ((v.sqrt()? / f32c(bc2.sqrt()))? + f32c(cfg.eps))?;
    let param = (param - (&m / denom)?.affine(f32c(lr / bc1), 0.0)?)?;
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

    /// The vector copies of the update compute bit for bit what the plain loop does.
    #[test]
    fn vectorised_adamw_equals_the_plain_loop() {
        let n = 1000;
        let mut r = models::rng::SplitMix64(5);
        let mut vals = |scale: f32| (0..n).map(|_| r.next_signed() * scale).collect::<Vec<f32>>();
        let (p0, g, m0) = (vals(1.0), vals(0.1), vals(0.01));
        let v0: Vec<f32> = vals(0.01).iter().map(|x| x * x).collect();
        let k = AdamWConstants {
            decay: Some(0.999),
            b2: 0.999,
            one_minus_b1: 0.1,
            one_minus_b2: 0.001,
            step_size: 1e-3,
            bc2_sqrt: 0.05,
            eps: 1e-8,
            clip: Some(0.7),
        };
        type Update<'a> = &'a dyn Fn(&mut [f32], &mut [f32], &mut [f32]);
        let run = |f: Update| {
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            f(&mut p, &mut m, &mut v);
            (p, m, v)
        };
        let plain = run(&|p, m, v| adamw_chunk(k, p, &g, m, v));
        #[cfg(target_arch = "x86_64")]
        {
            use models::ops::kernels::SimdLevel;
            if SimdLevel::detected() >= SimdLevel::Avx2 {
                assert_eq!(run(&|p, m, v| unsafe { adamw_chunk_avx2(k, p, &g, m, v) }), plain);
            }
            if SimdLevel::detected() == SimdLevel::Avx512 {
                assert_eq!(run(&|p, m, v| unsafe { adamw_chunk_avx512(k, p, &g, m, v) }), plain);
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
            || (0..n).map(|_| (models::rng::splitmix64(&mut state) >> 40) as f32 / (1u64 << 23) as f32 - 1.0).collect::<Vec<f32>>();
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
        let rel = |got: &Tensor, want: &[f32]| {
            got.to_vec1::<f32>().unwrap().iter().zip(want).map(|(a, b)| (a - b).abs() / b.abs().max(1e-3)).fold(0f32, f32::max)
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
