//! What a training step reports, and the dropout seeds every objective's step uses.

/// What one step did, over all ranks.
pub(super) struct StepOutcome {
    /// Mean loss of the global batch (per target token for SFT, per pair for DPO, GRPO's as
    /// TRL logs it).
    pub loss: f64,
    pub grad_norm: f64,
    /// Real (unpadded) tokens of the global batch: what tokens/s counts.
    pub tokens: f64,
    /// DPO's or GRPO's statistics of the global batch (TRL's names and means); empty for SFT.
    pub metrics: Vec<(String, f64)>,
}

/// The dropout seed of the sample at `place` in step `step`'s global batch.
pub(super) fn dropout_seed(seed: u64, step: usize, place: usize) -> u64 {
    let mut state = seed ^ ((step as u64) << 32) ^ place as u64;
    kernels::rng::splitmix64(&mut state)
}
