//! Which ops a forward uses: the differentiable ones for training, the fused forward-only ones
//! for generation. Its own module because both `layers` and `lora` read it.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpMode {
    /// Differentiable composite ops (training, all-position logits).
    Train,
    /// Fused forward-only ops (generation).
    Generate,
}
