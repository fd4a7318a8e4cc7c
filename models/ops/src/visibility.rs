//! Which keys each query of an attention sees, as a rule (the model's masks as
//! `models::masks::causal_mask` makes them) rather than a tensor: what attention that masks as it
//! goes (`flash_attention`) takes.

/// Which keys each query sees, as the model's masks say it (`models::masks::causal_mask`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Visibility {
    /// Keys after a query's position are hidden.
    pub causal: bool,
    /// The position of query 0 among the keys (the cached tokens before these queries).
    pub offset: usize,
    /// Keys at or before a query's position minus this are hidden (Mistral's sliding window).
    pub window: Option<usize>,
}

impl Visibility {
    /// Causal attention of queries at `offset..` over keys `0..offset + T`.
    pub fn causal(offset: usize, window: Option<usize>) -> Self {
        Self { causal: true, offset, window }
    }
}
