//! Rewards to advantages as TRL's `_generate_and_score_completions` makes them: each reward
//! minus its group's mean, divided (`scale_rewards`) by the group's or the whole batch's
//! standard deviation (unbiased, as `torch.std`) plus 1e-4; and the reward statistics TRL logs.

use super::settings::ScaleRewards;

/// What TRL adds to the standard deviation before dividing by it.
const STD_EPSILON: f64 = 1e-4;

/// The unbiased standard deviation (n − 1), as `torch.std`; 0 for a single value (where
/// torch gives NaN, which TRL never divides by).
fn std(values: &[f64]) -> f64 {
    if values.len() < 2 {
        return 0.0;
    }
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (values.len() - 1) as f64).sqrt()
}

/// The advantages of `rewards`, laid out as consecutive groups of `group` completions.
pub fn advantages(rewards: &[f64], group: usize, scale: ScaleRewards) -> Vec<f64> {
    let batch_std = std(rewards);
    rewards
        .chunks(group)
        .flat_map(|g| {
            let mean = g.iter().sum::<f64>() / g.len() as f64;
            let div = match scale {
                ScaleRewards::Group => std(g) + STD_EPSILON,
                ScaleRewards::Batch => batch_std + STD_EPSILON,
                ScaleRewards::None => 1.0,
            };
            g.iter().map(move |r| (r - mean) / div).collect::<Vec<_>>()
        })
        .collect()
}

/// `reward`, `reward_std` and `frac_reward_zero_std` of a step's rewards (grouped by `group`).
pub fn reward_metrics(rewards: &[f64], group: usize, scale: ScaleRewards) -> Vec<(&'static str, f64)> {
    let mean = rewards.iter().sum::<f64>() / rewards.len().max(1) as f64;
    // TRL checks the std it divides by (the group's, or with "batch" the batch's) for zero.
    let zero = |s: f64| s.abs() <= 1e-8;
    let groups = rewards.chunks(group).count().max(1);
    let zero_std = match scale {
        ScaleRewards::Batch => f64::from(u8::from(zero(std(rewards)))),
        _ => rewards.chunks(group).filter(|g| zero(std(g))).count() as f64 / groups as f64,
    };
    vec![("reward", mean), ("reward_std", std(rewards)), ("frac_reward_zero_std", zero_std)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_scaling_centres_and_scales_each_group() {
        let r = [1.0, 0.0, 1.0, 0.0, 0.5, 0.5];
        let a = advantages(&r, 2, ScaleRewards::Group);
        let s = 2f64.sqrt() / 2.0 + 1e-4;
        assert!((a[0] - 0.5 / s).abs() < 1e-12 && (a[1] + 0.5 / s).abs() < 1e-12);
        assert_eq!(&a[4..], &[0.0, 0.0]);
        let none = advantages(&r, 2, ScaleRewards::None);
        assert_eq!(none, vec![0.5, -0.5, 0.5, -0.5, 0.0, 0.0]);
        let batch = advantages(&r, 2, ScaleRewards::Batch);
        assert!((batch[0] - 0.5 / (std(&r) + 1e-4)).abs() < 1e-12);
        let m = reward_metrics(&r, 2, ScaleRewards::Group);
        assert_eq!(m[0], ("reward", 0.5));
        assert!((m[2].1 - 1.0 / 3.0).abs() < 1e-12, "{m:?}");
    }
}
