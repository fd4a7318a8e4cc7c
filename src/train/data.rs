//! Training data from JSONL: `{"text": ...}` rows (tokenised, concatenated with the eos token
//! between documents, cut into `seq_len` blocks) or pre-tokenised `{"input_ids": [...],
//! "labels": [...]}` rows (labels optional, aligned with input_ids; -100 ignored; short rows
//! right-padded with ignored labels, long rows cut).

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

pub const IGNORE_INDEX: i64 = -100;

/// One training sample of exactly `seq_len` tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub input_ids: Vec<u32>,
    pub labels: Vec<i64>,
}

impl Sample {
    /// Target tokens after the shift (labels 1.. that are not ignored).
    pub fn target_tokens(&self) -> usize {
        self.labels.iter().skip(1).filter(|&&l| l != IGNORE_INDEX).count()
    }
}

/// Encodes text; given by the caller so that data code does not depend on a tokenizer type.
pub type Encode<'a> = &'a dyn Fn(&str) -> Result<Vec<u32>>;

pub fn load_jsonl(path: &Path, seq_len: usize, encode: Encode, eos_id: Option<u32>, pad_id: u32) -> Result<Vec<Sample>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let mut samples = vec![];
    let mut stream: Vec<u32> = vec![];
    let mut kind: Option<&'static str> = None;
    for (i, line) in text.lines().enumerate() {
        let lineno = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let row: Value = serde_json::from_str(line)
            .map_err(|e| anyhow::anyhow!("{}:{lineno}: not valid JSON: {e}", path.display()))?;
        let this_kind = if row.get("input_ids").is_some() {
            "input_ids"
        } else if row.get("text").is_some() {
            "text"
        } else {
            bail!("{}:{lineno}: row has neither `text` nor `input_ids`", path.display());
        };
        if *kind.get_or_insert(this_kind) != this_kind {
            bail!("{}:{lineno}: row uses `{this_kind}` but earlier rows use `{}`; one file, one kind", path.display(), kind.unwrap());
        }
        if this_kind == "text" {
            let t = row["text"].as_str().with_context(|| format!("{}:{lineno}: field `text` is not a string", path.display()))?;
            stream.extend(encode(t).with_context(|| format!("{}:{lineno}", path.display()))?);
            if let Some(eos) = eos_id {
                stream.push(eos);
            }
        } else {
            samples.push(pretokenized(&row, seq_len, pad_id).with_context(|| format!("{}:{lineno}", path.display()))?);
        }
    }
    if kind == Some("text") {
        // Whole blocks only, as transformers' run_clm does.
        for block in stream.chunks_exact(seq_len) {
            samples.push(Sample { input_ids: block.to_vec(), labels: block.iter().map(|&x| x as i64).collect() });
        }
        if samples.is_empty() {
            bail!("{}: {} tokens in all, fewer than one block of --seq-len {seq_len}", path.display(), stream.len());
        }
    }
    if samples.is_empty() {
        bail!("{}: no rows", path.display());
    }
    Ok(samples)
}

fn id_list(row: &Value, field: &str) -> Result<Option<Vec<i64>>> {
    match row.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_i64().with_context(|| format!("field `{field}` must hold integers, found {x}")))
            .collect::<Result<Vec<_>>>()
            .map(Some),
        Some(other) => bail!("field `{field}` must be a list of integers, found {other}"),
    }
}

fn pretokenized(row: &Value, seq_len: usize, pad_id: u32) -> Result<Sample> {
    let ids = id_list(row, "input_ids")?.context("missing field `input_ids`")?;
    if ids.is_empty() {
        bail!("field `input_ids` is empty");
    }
    if let Some(bad) = ids.iter().find(|&&x| x < 0 || x > u32::MAX as i64) {
        bail!("field `input_ids` holds {bad}, not a token id");
    }
    let labels = match id_list(row, "labels")? {
        Some(l) if l.len() != ids.len() => bail!("field `labels` has {} entries but `input_ids` has {}", l.len(), ids.len()),
        Some(l) => l,
        None => ids.clone(),
    };
    let mut input_ids: Vec<u32> = ids.iter().take(seq_len).map(|&x| x as u32).collect();
    let mut labels: Vec<i64> = labels.into_iter().take(seq_len).collect();
    input_ids.resize(seq_len, pad_id);
    labels.resize(seq_len, IGNORE_INDEX);
    Ok(Sample { input_ids, labels })
}

/// The order samples are visited in: file order, or a permutation per epoch from the seed.
pub fn epoch_order(n: usize, epoch: usize, seed: u64, shuffle: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if shuffle {
        // Fisher-Yates with SplitMix64: the same on every rank and every machine.
        let mut rng = crate::fixtures::SplitMix64(seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        for i in (1..n).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(lines: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), lines).unwrap();
        f
    }

    fn chars(s: &str) -> Result<Vec<u32>> {
        Ok(s.bytes().map(|b| b as u32).collect())
    }

    #[test]
    fn text_rows_are_concatenated_with_eos_and_cut_into_blocks() {
        let f = write("{\"text\": \"abc\"}\n\n{\"text\": \"defgh\"}\n");
        let s = load_jsonl(f.path(), 4, &chars, Some(0), 0).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].input_ids, vec![97, 98, 99, 0]);
        assert_eq!(s[1].input_ids, vec![100, 101, 102, 103]);
        assert_eq!(s[1].labels, vec![100, 101, 102, 103]);
    }

    #[test]
    fn pretokenized_rows_are_padded_and_cut() {
        let f = write("{\"input_ids\": [5, 6], \"labels\": [-100, 6]}\n{\"input_ids\": [1, 2, 3, 4, 5]}\n");
        let s = load_jsonl(f.path(), 4, &chars, None, 9).unwrap();
        assert_eq!(s[0], Sample { input_ids: vec![5, 6, 9, 9], labels: vec![-100, 6, -100, -100] });
        assert_eq!(s[0].target_tokens(), 1);
        assert_eq!(s[1].input_ids, vec![1, 2, 3, 4]);
    }

    #[test]
    fn bad_rows_name_file_and_line() {
        let f = write("{\"text\": \"abc\"}\n{oops\n");
        let e = format!("{:#}", load_jsonl(f.path(), 2, &chars, None, 0).unwrap_err());
        assert!(e.contains(":2: not valid JSON"), "{e}");
        let f = write("{\"txt\": \"abc\"}\n");
        let e = format!("{:#}", load_jsonl(f.path(), 2, &chars, None, 0).unwrap_err());
        assert!(e.contains(":1: row has neither `text` nor `input_ids`"), "{e}");
        let f = write("{\"input_ids\": [1, \"x\"]}\n");
        let e = format!("{:#}", load_jsonl(f.path(), 2, &chars, None, 0).unwrap_err());
        assert!(e.contains(":1") && e.contains("input_ids"), "{e}");
    }

    #[test]
    fn shuffling_is_a_seeded_permutation() {
        let a = epoch_order(10, 0, 1, true);
        assert_eq!(a, epoch_order(10, 0, 1, true));
        assert_ne!(a, epoch_order(10, 1, 1, true));
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        assert_eq!(epoch_order(4, 0, 1, false), vec![0, 1, 2, 3]);
    }
}
