//! The AdamW update of an f32 chunk (torch.optim.AdamW's single-tensor arithmetic, in f32) and
//! the sum of squares behind the gradient norm, over the thread pool.

use crate::disjoint::DisjointWrites;
use crate::simd::SimdLevel;

/// The per-step numbers of an update, by value so the loop keeps them in registers (and a GPU
/// kernel of the same update gets the same f32 values).
#[derive(Clone, Copy, Debug)]
pub struct AdamWConstants {
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
    /// The constants of step `step` (from 1) with these hyper-parameters; `clip` is the
    /// gradient-clipping coefficient multiplied into each gradient as it is read.
    pub fn new(beta1: f64, beta2: f64, eps: f64, lr: f64, weight_decay: f64, step: u64, clip: Option<f32>) -> Self {
        let bc1 = 1.0 - beta1.powi(step as i32);
        let bc2 = 1.0 - beta2.powi(step as i32);
        Self {
            decay: (weight_decay != 0.0).then_some((1.0 - lr * weight_decay) as f32),
            b2: beta2 as f32,
            // As torch: `1 - beta` in f64, then one rounding to f32 (`1.0 - beta as f32` rounds
            // beta first: 1 - 0.999f32 is 4.7e-5 off, enough to move a step's update).
            one_minus_b1: (1.0 - beta1) as f32,
            one_minus_b2: (1.0 - beta2) as f32,
            step_size: (lr / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: eps as f32,
            clip,
        }
    }
}

/// Elements per task of the pool.
const CHUNK: usize = 1 << 16;

/// One update of `param` with `grad` and the moments `ms`, `vs` (all the same length), in torch's
/// order: `p *= 1 - lr*wd; m = lerp(m, g, 1-b1); v = v*b2 + (1-b2)*g*g;
/// p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)`. `grad` is left zeroed for the next step's
/// accumulation (by the thread that just read it, while its cache lines are at hand).
///
/// # Panics
/// When the lengths differ.
pub fn update(k: AdamWConstants, param: &mut [f32], grad: &mut [f32], ms: &mut [f32], vs: &mut [f32]) {
    let n = param.len();
    assert!(grad.len() == n && ms.len() == n && vs.len() == n, "AdamW: chunk lengths differ");
    let level = SimdLevel::current();
    let (p, g, m, v) = (DisjointWrites::new(param), DisjointWrites::new(grad), DisjointWrites::new(ms), DisjointWrites::new(vs));
    // Elementwise, so split over the threads (the same values as one loop), on the pool where
    // the step's products ran.
    candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(CHUNK), |range| {
        for c in range {
            let r = c * CHUNK..((c + 1) * CHUNK).min(n);
            // SAFETY: chunk c's range of the four buffers goes to this thread only.
            let (param, grad, ms, vs) = unsafe { (p.piece(r.clone()), g.piece(r.clone()), m.piece(r.clone()), v.piece(r)) };
            update_chunk(level, k, param, grad, ms, vs);
            grad.fill(0.0);
        }
    });
}

/// One chunk's update at `level`.
fn update_chunk(level: SimdLevel, k: AdamWConstants, param: &mut [f32], grad: &[f32], ms: &mut [f32], vs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `usable` never exceeds the level this CPU has.
        match level.usable() {
            SimdLevel::Avx512 => return unsafe { chunk_avx512(k, param, grad, ms, vs) },
            SimdLevel::Avx2 => return unsafe { chunk_avx2(k, param, grad, ms, vs) },
            SimdLevel::Scalar => {}
        }
    }
    let _ = level;
    chunk(k, param, grad, ms, vs)
}

/// The update of one chunk, the scalar reference: torch's IEEE operations in torch's order, its
/// fused multiply-adds (in the moments' `lerp_` and `addcmul_`) written as `mul_add` and no
/// others (Rust never contracts on its own), so the vector copies below compute exactly what
/// this loop does, several lanes at a time.
#[inline(always)]
fn chunk(k: AdamWConstants, param: &mut [f32], grad: &[f32], ms: &mut [f32], vs: &mut [f32]) {
    for (((p, &g), m), v) in param.iter_mut().zip(grad).zip(ms.iter_mut()).zip(vs.iter_mut()) {
        let g = match k.clip {
            Some(c) => g * c,
            None => g,
        };
        if let Some(decay) = k.decay {
            *p *= decay;
        }
        // torch's CPU kernels: `lerp_` (weight under 0.5) is `m + w * (g - m)` as one fused
        // multiply-add, `addcmul_` is `v * b2 + ((1 - b2) * g) * g` with the last product fused,
        // and `addcdiv_` is `p + (-step_size * m) / denom`.
        *m = k.one_minus_b1.mul_add(g - *m, *m);
        *v = (k.one_minus_b2 * g).mul_add(g, *v * k.b2);
        let denom = v.sqrt() / k.bc2_sqrt + k.eps;
        *p += (-k.step_size * *m) / denom;
    }
}

/// [`chunk`] compiled for AVX-512 (FMA for its `mul_add`s; Rust contracts nothing else).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn chunk_avx512(k: AdamWConstants, param: &mut [f32], grad: &[f32], ms: &mut [f32], vs: &mut [f32]) {
    chunk(k, param, grad, ms, vs)
}

/// [`chunk`] compiled for AVX2 (and FMA, as above).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chunk_avx2(k: AdamWConstants, param: &mut [f32], grad: &[f32], ms: &mut [f32], vs: &mut [f32]) {
    chunk(k, param, grad, ms, vs)
}

/// `Σ x²` in f64 over the pool: eight running sums per task so the loop runs in vector lanes
/// (the gradient norm before clipping; the order of the f64 sums differs from one loop's only
/// far below f32's precision). Each level's copy sums in the same order, so all give the
/// same bits.
pub fn sum_of_squares(xs: &[f32]) -> f64 {
    let level = SimdLevel::current();
    let partial = crate::pool::pool_map(xs.len().div_ceil(CHUNK), |c| squares_at(level, &xs[c * CHUNK..((c + 1) * CHUNK).min(xs.len())]));
    partial.iter().sum()
}

/// [`squares`] at `level`: compiled for the baseline x86-64 the loop converts and sums two
/// values per instruction (docs/design.md, AdamW).
fn squares_at(level: SimdLevel, chunk: &[f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `usable` never exceeds the level this CPU has.
        match level.usable() {
            SimdLevel::Avx512 => return unsafe { squares_avx512(chunk) },
            SimdLevel::Avx2 => return unsafe { squares_avx2(chunk) },
            SimdLevel::Scalar => {}
        }
    }
    let _ = level;
    squares(chunk)
}

/// One task's `Σ x²`: eight f64 sums, element i into sum i mod 8, then the sums in order and
/// the tail.
#[inline(always)]
fn squares(chunk: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let lanes = chunk.chunks_exact(8);
    let tail: f64 = lanes.remainder().iter().map(|&x| x as f64 * x as f64).sum();
    for l in lanes {
        for (a, &x) in acc.iter_mut().zip(l) {
            *a += x as f64 * x as f64;
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// [`squares`] compiled for AVX-512 (no FMA contraction: Rust never contracts on its own).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn squares_avx512(chunk: &[f32]) -> f64 {
    squares(chunk)
}

/// [`squares`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn squares_avx2(chunk: &[f32]) -> f64 {
    squares(chunk)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector copies of the update compute bit for bit what the plain loop does.
    #[test]
    fn vectorised_adamw_equals_the_plain_loop() {
        let n = 1000;
        let mut r = crate::rng::SplitMix64(5);
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
        let run = |level: SimdLevel| {
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            update_chunk(level, k, &mut p, &g, &mut m, &mut v);
            (p, m, v)
        };
        let plain = run(SimdLevel::Scalar);
        for level in [SimdLevel::Avx2, SimdLevel::Avx512].into_iter().filter(|l| *l <= SimdLevel::detected()) {
            assert_eq!(run(level), plain, "{level:?}");
        }
    }

    /// Every level's sum of squares gives the plain loop's bits, tail included.
    #[test]
    fn vectorised_sums_of_squares_equal_the_plain_loop() {
        let mut r = crate::rng::SplitMix64(9);
        let xs: Vec<f32> = (0..CHUNK + 13).map(|_| r.next_signed() * 3.0).collect();
        let plain = squares(&xs);
        let f64_sum: f64 = xs.iter().map(|&x| x as f64 * x as f64).sum();
        assert!((plain - f64_sum).abs() <= 1e-12 * f64_sum, "{plain} vs {f64_sum}");
        for level in [SimdLevel::Avx2, SimdLevel::Avx512].into_iter().filter(|l| *l <= SimdLevel::detected()) {
            assert_eq!(squares_at(level, &xs).to_bits(), plain.to_bits(), "{level:?}");
        }
    }
}
