//! Drawing a sequence's next token from its logits: greedy, or from the softmax at a temperature,
//! cut by top-k and / or top-p. The draws are candle's `LogitsProcessor`'s, with the same
//! generator seeded the same way and the same uniform number per draw, so a seed picks the same
//! tokens it picked there; the probabilities come from our vector softmax
//! (`kernels::exp::softmax_row`) in place of candle's tensor ops (a division by the temperature,
//! a softmax of scalar `expf`, a copy) and the draw walks the running sum instead of building
//! rand's `WeightedIndex` table: both ran on the scheduler's thread, one token at a time, while
//! the pool's other threads waited (docs/design.md, decoding, has the profile).

use anyhow::{bail, Result};
use candle_core::{DType, Tensor, D};
use candle_transformers::generation::Sampling;
use rand::distr::{Distribution, Uniform};
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::chain::{self, ChainStep};

/// A sequence's sampler: its sampling settings and its own seeded generator.
pub struct Sampler {
    rng: StdRng,
    sampling: Sampling,
    /// llama.cpp's chain of cuts in place of `sampling`'s top-k and top-p (not when greedy).
    chain: Option<Vec<ChainStep>>,
}

impl Sampler {
    pub fn new(seed: u64, sampling: Sampling) -> Self {
        Self { rng: StdRng::seed_from_u64(seed), sampling, chain: None }
    }

    /// A sampler whose draws at a temperature go through llama.cpp's chain of cuts (`chain`).
    pub fn with_chain(seed: u64, sampling: Sampling, chain: Option<Vec<ChainStep>>) -> Self {
        Self { chain, ..Self::new(seed, sampling) }
    }

    /// The next token from `logits` (vocab).
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        let temperature = match self.sampling {
            Sampling::ArgMax => return greedy(logits),
            Sampling::All { temperature }
            | Sampling::TopK { temperature, .. }
            | Sampling::TopP { temperature, .. }
            | Sampling::TopKThenTopP { temperature, .. } => temperature,
            Sampling::GumbelSoftmax { .. } => bail!("Gumbel-softmax sampling is not offered"),
        };
        if let Some(chain) = &self.chain {
            let logits = logits.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            let kept = chain::candidates(&logits, chain, temperature);
            let weights: Vec<f32> = kept.iter().map(|c| c.1).collect();
            return Ok(kept[self.draw(&weights)? as usize].0);
        }
        let mut probs = logits.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        kernels::exp::softmax_row(&mut probs, (1.0 / temperature) as f32, None);
        match self.sampling {
            Sampling::TopK { k, .. } => self.top_k(probs, k, None),
            Sampling::TopP { p, .. } if p > 0.0 && p < 1.0 => {
                cut_to_top_p(&mut probs, p as f32);
                self.draw(&probs)
            }
            Sampling::TopKThenTopP { k, p, .. } => self.top_k(probs, k, Some(p as f32)),
            _ => self.draw(&probs),
        }
    }

    /// A draw among the `k` most likely tokens (then cut to `top_p` of their sum, where given
    /// and below it), as candle's `sample_topk` / `sample_topk_topp`.
    fn top_k(&mut self, mut probs: Vec<f32>, k: usize, top_p: Option<f32>) -> Result<u32> {
        if k >= probs.len() {
            if let Some(p) = top_p {
                cut_to_top_p(&mut probs, p);
            }
            return self.draw(&probs);
        }
        let mut order: Vec<usize> = (0..probs.len()).collect();
        let (kept, _, _) = order.select_nth_unstable_by(k, |&i, &j| probs[j].total_cmp(&probs[i]));
        let mut kept_probs: Vec<f32> = kept.iter().map(|&i| probs[i]).collect();
        if let Some(p) = top_p {
            if p > 0.0 && p < kept_probs.iter().sum::<f32>() {
                cut_to_top_p(&mut kept_probs, p);
            }
        }
        Ok(kept[self.draw(&kept_probs)? as usize] as u32)
    }

    /// rand's `WeightedIndex` draw over `weights` without its table: one uniform number in
    /// [0, total) and the first index whose running sum (added in the same order, so the same
    /// sums) exceeds it.
    fn draw(&mut self, weights: &[f32]) -> Result<u32> {
        let mut total = 0f32;
        for (i, w) in weights.iter().enumerate() {
            if w.is_nan() || *w < 0.0 {
                bail!("sampling: the probability of token {i} is {w} (the logits hold NaN or are all -inf)");
            }
            // From 0: the first sum is the first weight exactly, as WeightedIndex starts.
            total += w;
        }
        if total <= 0.0 || !total.is_finite() {
            bail!("sampling: the probabilities sum to {total}");
        }
        let chosen = Uniform::new(0.0f32, total)?.sample(&mut self.rng);
        let mut running = 0f32;
        for (i, w) in weights[..weights.len() - 1].iter().enumerate() {
            running += w;
            if running > chosen {
                return Ok(i as u32);
            }
        }
        Ok(weights.len() as u32 - 1)
    }
}

/// Top-p (nucleus) as candle cuts it: in order of falling probability, every token after the
/// running sum reached `p` gets probability 0.
fn cut_to_top_p(probs: &mut [f32], p: f32) {
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&i, &j| probs[j].total_cmp(&probs[i]));
    let mut sum = 0.0;
    for i in order {
        if sum >= p {
            probs[i] = 0.0;
        } else {
            sum += probs[i];
        }
    }
}

/// The greedy token: candle's argmax, whose ties go to the first index (greedy parity holds on
/// it), read in place in vector passes (`kernels::exp::argmax`, the same index) for f32 logits
/// on the CPU, the case of every CPU decode.
fn greedy(logits: &Tensor) -> Result<u32> {
    if logits.dtype() == DType::F32 && logits.rank() == 1 {
        let (storage, layout) = logits.storage_and_layout();
        if let Ok(values) = ops::cpu_f32_values(&storage, layout) {
            if let Some(i) = kernels::exp::argmax(values) {
                return Ok(i as u32);
            }
        }
    }
    Ok(logits.argmax(D::Minus1)?.to_scalar::<u32>()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use candle_transformers::generation::LogitsProcessor;

    fn logits(n: usize, seed: u64) -> Tensor {
        let v: Vec<f32> = kernels::rng::signed_values(n, seed).iter().map(|x| x * 6.0).collect();
        Tensor::from_vec(v, n, &Device::Cpu).unwrap()
    }

    /// Each sampling mode draws the tokens candle's `LogitsProcessor` draws with the same seed
    /// over a run of steps (probabilities a rounding apart may, rarely, pick a neighbour:
    /// at most one step in a hundred here), and greedy is candle's argmax exactly.
    #[test]
    fn a_seed_draws_what_candles_sampler_draws() {
        let modes = [
            Sampling::ArgMax,
            Sampling::All { temperature: 0.7 },
            Sampling::All { temperature: 1.3 },
            Sampling::TopK { k: 40, temperature: 0.8 },
            Sampling::TopP { p: 0.9, temperature: 0.8 },
            Sampling::TopKThenTopP { k: 50, p: 0.8, temperature: 1.0 },
            Sampling::TopKThenTopP { k: 5000, p: 0.7, temperature: 0.9 },
        ];
        for mode in modes {
            let (mut ours, mut candles) = (Sampler::new(42, mode.clone()), LogitsProcessor::from_sampling(42, mode.clone()));
            let differ = (0..200)
                .filter(|step| {
                    let l = logits(4099, *step as u64 + 1);
                    ours.sample(&l).unwrap() != candles.sample(&l).unwrap()
                })
                .count();
            let allowed = if matches!(mode, Sampling::ArgMax) { 0 } else { 2 };
            assert!(differ <= allowed, "{mode:?}: {differ} of 200 draws differ from candle's");
        }
    }

    /// The draws follow the probabilities: 20,000 draws over five tokens land within 4 standard
    /// deviations of their expected counts, and top-k / top-p never pick a cut token.
    #[test]
    fn draws_follow_the_probabilities_and_the_cuts() {
        let l = Tensor::new(&[2.0f32, 1.0, 0.0, -1.0, 0.5], &Device::Cpu).unwrap();
        let mut want = l.to_vec1::<f32>().unwrap();
        kernels::exp::softmax_row(&mut want, 1.0, None);
        let mut s = Sampler::new(7, Sampling::All { temperature: 1.0 });
        let mut counts = [0usize; 5];
        let n = 20_000;
        for _ in 0..n {
            counts[s.sample(&l).unwrap() as usize] += 1;
        }
        for (c, p) in counts.iter().zip(&want) {
            let (mean, sd) = (n as f64 * *p as f64, (n as f64 * *p as f64 * (1.0 - *p as f64)).sqrt());
            assert!((*c as f64 - mean).abs() < 4.0 * sd, "{counts:?} vs {want:?}");
        }
        let mut top2 = Sampler::new(7, Sampling::TopK { k: 2, temperature: 1.0 });
        let mut nucleus = Sampler::new(7, Sampling::TopP { p: 0.5, temperature: 1.0 });
        for _ in 0..2000 {
            assert!(top2.sample(&l).unwrap() <= 1);
            // Token 0 alone holds 0.56 of the mass: the nucleus of 0.5 is token 0 alone.
            assert_eq!(nucleus.sample(&l).unwrap(), 0);
        }
    }

    /// Logits that leave no probability (all -inf, NaN) are an error naming the cause, not a
    /// token.
    #[test]
    fn logits_without_probabilities_are_an_error() {
        let mut s = Sampler::new(1, Sampling::All { temperature: 1.0 });
        for bad in [[f32::NEG_INFINITY; 3], [0.0, f32::NAN, 1.0]] {
            let e = s.sample(&Tensor::new(&bad, &Device::Cpu).unwrap()).unwrap_err().to_string();
            assert!(e.contains("sampling"), "{e}");
        }
    }
}
