//! Micro-batches as the model takes them: samples (each `--seq-len` long, padded at the end)
//! cut to the longest row of their batch, with the packing layout of packed rows.

use super::data::Sample;

/// A micro-batch as the model takes it: rows cut to the longest row's length rounded up to a
/// multiple of 8 (at most the samples' length), not padded to `--seq-len`.
pub struct Collated {
    pub input_ids: Vec<u32>,
    pub labels: Vec<i64>,
    pub rows: usize,
    pub width: usize,
    pub packing: Option<models::Packing>,
    /// Tokens before padding, summed over the rows.
    pub real_tokens: usize,
}

/// Collates `rows` (every sample `seq_len` long, padded at the end) into one micro-batch
/// padded only to its longest row. Padding sits after every real token and causal attention
/// never looks ahead, so the real positions compute what they would at full length.
pub fn collate(rows: &[&Sample]) -> Collated {
    let full = rows.first().map_or(0, |s| s.input_ids.len());
    let longest = rows.iter().map(|s| s.len).max().unwrap_or(0);
    // Multiples of 8 keep the kernels' row blocks whole; at least 2 tokens for one target.
    let width = longest.max(2).next_multiple_of(8).min(full);
    let cut = |s: &&Sample| Sample {
        input_ids: s.input_ids[..width].to_vec(),
        labels: s.labels[..width].to_vec(),
        len: s.len.min(width),
        segments: if s.segments.is_empty() { vec![] } else { s.segments[..width].to_vec() },
    };
    let cut_rows: Vec<Sample> = rows.iter().map(cut).collect();
    let refs: Vec<&Sample> = cut_rows.iter().collect();
    Collated {
        input_ids: cut_rows.iter().flat_map(|s| s.input_ids.iter().copied()).collect(),
        labels: cut_rows.iter().flat_map(|s| s.labels.iter().copied()).collect(),
        rows: rows.len(),
        width,
        packing: packing_for(&refs),
        real_tokens: rows.iter().map(|s| s.len).sum(),
    }
}

/// The packing layout of a micro-batch (positions restart per document), or None when no row
/// is packed.
pub fn packing_for(rows: &[&Sample]) -> Option<models::Packing> {
    if rows.iter().all(|s| s.segments.is_empty()) {
        return None;
    }
    let mut positions = vec![];
    let mut segments = vec![];
    for s in rows {
        let seg: Vec<u32> =
            if s.segments.is_empty() { (0..s.input_ids.len()).map(|i| u32::from(i < s.len)).collect() } else { s.segments.clone() };
        let mut pos = 0u32;
        for (i, &g) in seg.iter().enumerate() {
            if i > 0 && g != seg[i - 1] {
                pos = 0;
            }
            positions.push(pos);
            pos += 1;
        }
        segments.extend(seg);
    }
    Some(models::Packing { positions, segments })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::data::{self, IGNORE_INDEX};

    /// A packed row's positions restart with each document (padding counts from 0 too).
    #[test]
    fn packed_positions_restart_per_document() {
        let row = data::Sample {
            input_ids: vec![1, 2, 3, 4, 5, 0],
            labels: vec![1, 2, 3, -100, 5, -100],
            len: 5,
            segments: vec![1, 1, 1, 2, 2, 0],
        };
        let p = packing_for(&[&row]).unwrap();
        assert_eq!(p.positions, vec![0, 1, 2, 0, 1, 0]);
    }

    #[test]
    fn a_micro_batch_is_padded_to_its_longest_row_rounded_up_to_8() {
        let a = data::pad((1..=5).collect(), (1..=5).collect(), 32, 0);
        let b = data::pad((1..=11).collect(), (1..=11).collect(), 32, 0);
        let batch = collate(&[&a, &b]);
        assert_eq!((batch.rows, batch.width, batch.real_tokens), (2, 16, 16));
        assert_eq!(batch.input_ids.len(), 32);
        assert_eq!(&batch.input_ids[..6], &[1, 2, 3, 4, 5, 0]);
        assert_eq!(batch.labels[16 + 10], 11);
        assert_eq!(batch.labels[16 + 11], IGNORE_INDEX);
        assert!(batch.packing.is_none());
        // Never wider than the samples themselves.
        let full = data::pad((1..=30).collect(), (1..=30).collect(), 30, 0);
        assert_eq!(collate(&[&full]).width, 30);
        // Packed rows keep their document ids, cut to the width.
        let packed = data::pack(vec![((1..=3).collect(), (1..=3).collect()), ((4..=6).collect(), (4..=6).collect())], 32, 0);
        let batch = collate(&[&packed[0]]);
        assert_eq!(batch.width, 8);
        assert_eq!(batch.packing.unwrap().segments, [1, 1, 1, 2, 2, 2, 0, 0]);
    }
}
