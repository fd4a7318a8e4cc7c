//! llama.cpp's sampler chain (its server's `samplers`): the cuts run in the chain's order, each on
//! the candidates the step before left and on their own distribution (llama.cpp renormalises
//! before top-p), and the temperature where the chain puts it (by default last, so the cuts see
//! the model's distribution). vLLM's order, which every other endpoint keeps, is `sampler`'s:
//! the temperature first, then top-k and top-p of the whole vocabulary's mass.

use std::sync::Arc;

use super::infill_sampler::{self, InfillVocab};

/// One step of a chain, with llama.cpp's meaning.
#[derive(Debug, Clone, PartialEq)]
pub enum ChainStep {
    /// The `k` most likely candidates (k of at least the candidates' count keeps them all).
    TopK(usize),
    /// The most likely candidates whose probabilities (among the candidates) first sum to at
    /// least `p`, that last one included.
    TopP(f64),
    /// Candidates at least `p` times as likely as the most likely one.
    MinP(f64),
    /// The logits divided by the request's temperature.
    Temperature,
    /// llama.cpp's infill sampler over the model's vocabulary (`infill_sampler`).
    Infill(Arc<InfillVocab>),
}

impl ChainStep {
    /// llama.cpp's name of the step (`samplers` in its requests and `/props`).
    pub fn name(&self) -> &'static str {
        match self {
            Self::TopK(_) => "top_k",
            Self::TopP(_) => "top_p",
            Self::MinP(_) => "min_p",
            Self::Temperature => "temperature",
            Self::Infill(_) => "infill",
        }
    }
}

/// The candidates the chain leaves, as (token, weight): weights are unnormalised probabilities
/// at the temperature, most likely first where a step sorted them. Tokens whose logit is -inf
/// (masked) are never candidates; at least one candidate is always left.
pub fn candidates(logits: &[f32], steps: &[ChainStep], temperature: f64) -> Vec<(u32, f32)> {
    let mut c: Vec<(u32, f32)> = logits.iter().enumerate().filter(|(_, l)| **l > f32::NEG_INFINITY).map(|(i, &l)| (i as u32, l)).collect();
    let mut sorted = false;
    let mut scale = 1.0f32;
    for step in steps {
        match *step {
            ChainStep::TopK(k) if k > 0 && k < c.len() => {
                c.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1));
                c.truncate(k);
                c.sort_by(|a, b| b.1.total_cmp(&a.1));
                sorted = true;
            }
            ChainStep::TopP(p) if p < 1.0 && c.len() > 1 => {
                if !sorted {
                    c.sort_by(|a, b| b.1.total_cmp(&a.1));
                    sorted = true;
                }
                let probs = softmax(&c, scale);
                let mut sum = 0.0f64;
                let keep = probs.iter().position(|&q| {
                    sum += q as f64;
                    sum >= p
                });
                c.truncate(keep.map_or(c.len(), |i| i + 1));
            }
            ChainStep::MinP(p) if p > 0.0 && c.len() > 1 => {
                // p_i >= p · p_max  <=>  l_i >= l_max + ln(p) / scale, at the chain's scale so far.
                let max = c.iter().map(|x| x.1).fold(f32::NEG_INFINITY, f32::max);
                let cut = max as f64 + p.ln() / scale as f64;
                c.retain(|x| x.1 as f64 >= cut);
            }
            ChainStep::Temperature => scale = (1.0 / temperature) as f32,
            ChainStep::Infill(ref vocab) => {
                c = infill_sampler::apply(c, scale, vocab);
                sorted = true;
            }
            _ => {}
        }
    }
    let weights = softmax(&c, scale);
    c.iter().zip(weights).map(|(&(t, _), w)| (t, w)).collect()
}

/// The candidates' probabilities at `scale` (1 / temperature).
fn softmax(c: &[(u32, f32)], scale: f32) -> Vec<f32> {
    let max = c.iter().map(|x| x.1).fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = c.iter().map(|x| ((x.1 - max) * scale).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.into_iter().map(|x| x / sum).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(c: &[(u32, f32)]) -> Vec<u32> {
        let mut v: Vec<u32> = c.iter().map(|x| x.0).collect();
        v.sort();
        v
    }

    /// Probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 at temperature 1.
    fn logits() -> Vec<f32> {
        [0.5f32, 0.25, 0.125, 0.0625, 0.0625].iter().map(|p| p.ln()).collect()
    }

    #[test]
    fn cuts_read_the_models_distribution_before_the_temperature() {
        use ChainStep::*;
        // llama.cpp's default order: top-p 0.7 of the model's distribution keeps 0.5 + 0.25
        // (0.75 >= 0.7), whatever the temperature after it.
        let kept = candidates(&logits(), &[TopP(0.7), Temperature], 5.0);
        assert_eq!(ids(&kept), vec![0, 1]);
        // At temperature 5 the two are nearly even: (0.5 / 0.25)^(1/5) = 1.149.
        let ratio = kept.iter().find(|x| x.0 == 0).unwrap().1 / kept.iter().find(|x| x.0 == 1).unwrap().1;
        assert!((ratio - 2f32.powf(0.2)).abs() < 1e-5, "{ratio}");
        // The temperature first flattens the distribution, and top-p then keeps more.
        let kept = candidates(&logits(), &[Temperature, TopP(0.7)], 5.0);
        assert_eq!(ids(&kept), vec![0, 1, 2, 3]);
    }

    /// llama.cpp's own samplers (tests/reference/make_llama_cpp_chain_reference.py) leave the
    /// same tokens with the same probabilities, in every order the cases chain them.
    #[test]
    fn leaves_what_llama_cpps_chain_leaves() {
        let reference: serde_json::Value = serde_json::from_str(include_str!("../../tests/reference/llama-cpp-chain.json")).unwrap();
        for case in reference["cases"].as_array().unwrap() {
            let logits: Vec<f32> = case["logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
            let steps: Vec<ChainStep> = case["chain"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| match s[0].as_str().unwrap() {
                    "top_k" => ChainStep::TopK(s[1].as_u64().unwrap() as usize),
                    "top_p" => ChainStep::TopP(s[1].as_f64().unwrap()),
                    "min_p" => ChainStep::MinP(s[1].as_f64().unwrap()),
                    _ => ChainStep::Temperature,
                })
                .collect();
            let mut ours = candidates(&logits, &steps, case["temperature"].as_f64().unwrap());
            ours.sort_by(|a, b| b.1.total_cmp(&a.1));
            let theirs = case["left"].as_array().unwrap();
            assert_eq!(ours.len(), theirs.len(), "{steps:?}: {ours:?} vs {theirs:?}");
            for ((id, p), t) in ours.iter().zip(theirs) {
                assert_eq!(*id as u64, t[0].as_u64().unwrap(), "{steps:?}");
                assert!((*p as f64 - t[1].as_f64().unwrap()).abs() < 1e-5, "{steps:?}: {p} vs {t}");
            }
        }
    }

    #[test]
    fn top_p_renormalises_after_top_k_and_min_p_reads_the_best() {
        use ChainStep::*;
        // After top-k 2 the candidates' own distribution is 2/3, 1/3: top-p 0.6 keeps one.
        assert_eq!(ids(&candidates(&logits(), &[TopK(2), TopP(0.6), Temperature], 1.0)), vec![0]);
        // min-p 0.24 of the model's distribution keeps 0.125 and up (a quarter of 0.5); with the
        // temperature 2 first the ratios are square roots, and 0.0625 (1/8 -> 0.354) passes too.
        assert_eq!(ids(&candidates(&logits(), &[MinP(0.24), Temperature], 2.0)), vec![0, 1, 2]);
        assert_eq!(ids(&candidates(&logits(), &[Temperature, MinP(0.24)], 2.0)), vec![0, 1, 2, 3, 4]);
        // Weights sum to 1; masked tokens are never candidates; nothing cuts the last one.
        let mut masked = logits();
        masked[0] = f32::NEG_INFINITY;
        let kept = candidates(&masked, &[TopK(1), TopP(0.01), MinP(1.0), Temperature], 0.5);
        assert_eq!(kept, vec![(1, 1.0)]);
        let all = candidates(&logits(), &[Temperature], 0.7);
        assert!((all.iter().map(|x| x.1).sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(all.len(), 5);
    }
}
