//! SplitMix64: a tiny generator that is the same on every platform and version (unlike library
//! RNGs), for fixture weights, LoRA initialisation, dropout masks and ids.

/// Advances `state` and returns the next value.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// [`splitmix64`] as a generator object.
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        splitmix64(&mut self.0)
    }

    /// Uniform in [-1, 1).
    pub fn next_signed(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// `n` values uniform in [-1, 1) from `seed`: test inputs and fixture weights.
pub fn signed_values(n: usize, seed: u64) -> Vec<f32> {
    let mut r = SplitMix64(seed);
    (0..n).map(|_| r.next_signed()).collect()
}
