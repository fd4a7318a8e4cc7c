//! Training samples from JSONL or JSON files, with the loss mask that fits each row shape.
//!
//! - `text` rows are tokenised, joined with the eos token between documents and cut into
//!   `seq_len` blocks (every token trained on), as transformers' run_clm does.
//! - `prompt`/`completion` rows become one sequence, eos appended; by default only the
//!   completion (and eos) is trained on.
//! - chat rows are rendered with the model's chat template; by default only assistant tokens are
//!   trained on. Assistant spans are found by rendering the conversation's prefixes, so templates
//!   without `{% generation %}` markers work; tokens are matched to spans by their byte offsets.
//! - pre-tokenised rows keep their labels (aligned with input_ids; -100 ignored).
//!
//! Sequences are right-padded to `seq_len` with ignored labels and cut when longer.

mod chat_labels;

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use self::chat_labels::{chat_tokens, mask_by_spans};
use super::formats::{parse_row, Example};
use super::text_budget;
use crate::tokenize::ChatTemplate;

pub const IGNORE_INDEX: i64 = -100;

/// One training sample of exactly `seq_len` tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub input_ids: Vec<u32>,
    pub labels: Vec<i64>,
    /// Tokens before padding.
    pub len: usize,
    /// With `--packing`: the document id of each token (1, 2, ...; 0 = padding). Empty when the
    /// row holds one document.
    pub segments: Vec<u32>,
}

impl Sample {
    /// Target tokens after the shift (labels 1.. that are not ignored).
    pub fn target_tokens(&self) -> usize {
        self.labels.iter().skip(1).filter(|&&l| l != IGNORE_INDEX).count()
    }
}

/// Which tokens the loss is taken on (`--train-on`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrainOn {
    /// Chat: assistant messages; prompt/completion: the completion; text: everything.
    Auto,
    /// Every token.
    All,
    /// Chat: the last assistant message; prompt/completion: the completion.
    Completion,
    /// Chat: every assistant message; prompt/completion: the completion.
    Assistant,
}

impl std::str::FromStr for TrainOn {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => Self::Auto,
            "all" => Self::All,
            "completion" => Self::Completion,
            "assistant" => Self::Assistant,
            other => bail!("--train-on {other:?}: use all, completion or assistant"),
        })
    }
}

/// What the data code needs from the model's tokenizer.
pub struct TextTools<'a> {
    /// Token ids and their byte ranges in `text`.
    pub encode: &'a dyn Fn(&str, bool) -> Result<crate::tokenize::IdsWithOffsets>,
    pub decode: &'a dyn Fn(&[u32]) -> Result<String>,
    pub template: Option<&'a ChatTemplate>,
    pub eos_id: Option<u32>,
    pub pad_id: u32,
}

#[derive(Debug, Clone, Copy)]
pub struct DataOptions {
    pub seq_len: usize,
    pub train_on: TrainOn,
    pub skip_bad_rows: bool,
    /// Fill each row with several samples that cannot see each other.
    pub packing: bool,
}

/// Greedy, in-order packing of unpadded rows into `seq_len` blocks. The first token of every
/// document after the first in a block gets an ignored label: it would be predicted from the
/// previous document.
pub(crate) fn pack(rows: Vec<(Vec<u32>, Vec<i64>)>, seq_len: usize, pad_id: u32) -> Vec<Sample> {
    let mut out = vec![];
    let mut cur = Sample { input_ids: vec![], labels: vec![], len: 0, segments: vec![] };
    let flush = |cur: &mut Sample, out: &mut Vec<Sample>| {
        if cur.len > 0 {
            let mut s = std::mem::replace(cur, Sample { input_ids: vec![], labels: vec![], len: 0, segments: vec![] });
            s.input_ids.resize(seq_len, pad_id);
            s.labels.resize(seq_len, IGNORE_INDEX);
            s.segments.resize(seq_len, 0);
            out.push(s);
        }
    };
    for (ids, mut labels) in rows {
        if cur.len + ids.len() > seq_len {
            flush(&mut cur, &mut out);
        }
        let doc = cur.segments.last().copied().unwrap_or(0) + 1;
        if cur.len > 0 {
            labels[0] = IGNORE_INDEX;
        }
        cur.len += ids.len();
        cur.segments.extend(std::iter::repeat_n(doc, ids.len()));
        cur.input_ids.extend(ids);
        cur.labels.extend(labels);
    }
    flush(&mut cur, &mut out);
    out
}

#[derive(Debug, Clone, Default)]
pub struct Dataset {
    pub samples: Vec<Sample>,
    pub rows: usize,
    pub skipped: usize,
    pub truncated: usize,
    /// Target tokens over all samples.
    pub supervised_tokens: usize,
}

impl Dataset {
    /// Share of sequence positions holding real tokens (the rest is padding).
    pub fn padding_efficiency(&self, seq_len: usize) -> f64 {
        let real: usize = self.samples.iter().map(|s| s.len).sum();
        real as f64 / (self.samples.len() * seq_len).max(1) as f64
    }
}

/// Where training data comes from: a local file, or `hf://datasets/ORG/NAME/PATH[@REVISION]`
/// (the Hub's URL scheme), downloaded with hf-hub into the shared cache.
pub fn resolve_data(spec: &str) -> Result<std::path::PathBuf> {
    let Some(rest) = spec.strip_prefix("hf://datasets/") else {
        let p = std::path::PathBuf::from(spec);
        if !p.is_file() {
            bail!("{spec}: no such file (Hub datasets are written hf://datasets/ORG/NAME/FILE)");
        }
        return Ok(p);
    };
    let (rest, revision) = match rest.rsplit_once('@') {
        Some((r, rev)) => (r, rev),
        None => (rest, "main"),
    };
    let parts: Vec<&str> = rest.splitn(3, '/').collect();
    if parts.len() < 3 || parts.iter().any(|p| p.is_empty()) {
        bail!("{spec}: expected hf://datasets/ORG/NAME/FILE[@REVISION]");
    }
    let repo = crate::model_files::hub::HubRepo::open_dataset(&format!("{}/{}", parts[0], parts[1]), revision)?;
    repo.get(parts[2]).with_context(|| format!("dataset file {spec}"))
}

fn is_parquet(path: &Path, bytes: &[u8]) -> bool {
    path.extension().is_some_and(|e| e == "parquet") || bytes.starts_with(b"PAR1")
}

/// Rows of a Parquet file (as `datasets` and pyarrow write them) as JSON objects, each with its
/// 1-based row number. Nested columns (a `messages` list of {role, content} structs) become
/// arrays of objects.
fn parquet_rows(path: &Path, bytes: &[u8]) -> Result<Vec<(usize, Result<Value>)>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let reader = SerializedFileReader::new(bytes::Bytes::copy_from_slice(bytes))
        .map_err(|e| anyhow::anyhow!("{}: not a readable Parquet file: {e}", path.display()))?;
    let rows = reader.get_row_iter(None).map_err(|e| anyhow::anyhow!("{}: cannot read its rows: {e}", path.display()))?;
    Ok(rows
        .enumerate()
        .map(|(i, r)| (i + 1, r.map(|row| row.to_json_value()).map_err(|e| anyhow::anyhow!("cannot decode the row: {e}"))))
        .collect())
}

/// Rows of a data file with their line (or row) numbers: Parquet, a `.json` array, or JSONL.
pub(super) fn read_rows_bytes(path: &Path, bytes: &[u8]) -> Result<Vec<(usize, Result<Value>)>> {
    if is_parquet(path, bytes) {
        return parquet_rows(path, bytes);
    }
    let text = std::str::from_utf8(bytes)
        .map_err(|e| anyhow::anyhow!("{}: not UTF-8 text ({e}); data files are JSONL, JSON or Parquet", path.display()))?;
    read_rows(path, without_bom(text))
}

/// `text` without a leading UTF-8 byte-order mark, which Windows editors and Excel write at the
/// start of a file and which would make the first row invalid JSON.
pub fn without_bom(text: &str) -> &str {
    text.strip_prefix('\u{feff}').unwrap_or(text)
}

/// Rows of a `.jsonl` file (one object per line) or a `.json` file (an array of objects), each
/// with its line number (JSON arrays: the element's 1-based index).
fn read_rows(path: &Path, text: &str) -> Result<Vec<(usize, Result<Value>)>> {
    let is_json_array = path.extension().is_some_and(|e| e == "json") || text.trim_start().starts_with('[');
    if is_json_array {
        let v: Value = serde_json::from_str(text).map_err(|e| anyhow::anyhow!("{}:{}: not valid JSON: {e}", path.display(), e.line()))?;
        let rows = v.as_array().with_context(|| format!("{}: a .json data file must hold an array of rows", path.display()))?;
        return Ok(rows.iter().enumerate().map(|(i, r)| (i + 1, Ok(r.clone()))).collect());
    }
    Ok(text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| (i + 1, serde_json::from_str(l).map_err(|e| anyhow::anyhow!("not valid JSON: {e}"))))
        .collect())
}

/// A supervised row bounded for `seq_len`: samples keep their first `seq_len` tokens, so every
/// field keeps its start; a text row past [`text_budget::TEXT_ROW_LIMIT`] is refused.
pub fn bound_example(example: &mut Example, seq_len: usize) -> Result<()> {
    let budget = text_budget::bytes_for(seq_len);
    match example {
        Example::Text(t) if t.len() > text_budget::TEXT_ROW_LIMIT => {
            bail!(
                "field `text` holds {} bytes; text rows are tokenised whole, so split it into rows of at most {} bytes",
                t.len(),
                text_budget::TEXT_ROW_LIMIT
            )
        }
        Example::PromptCompletion { prompt, completion } => {
            text_budget::keep_start(prompt, budget);
            text_budget::keep_start(completion, budget);
        }
        Example::Chat(chat) => text_budget::contents(&mut chat.messages, budget, text_budget::keep_start),
        Example::Text(_) | Example::Tokens { .. } => {}
    }
    Ok(())
}

pub(crate) fn pad(mut ids: Vec<u32>, mut labels: Vec<i64>, seq_len: usize, pad_id: u32) -> Sample {
    let len = ids.len();
    ids.resize(seq_len, pad_id);
    labels.resize(seq_len, IGNORE_INDEX);
    Sample { input_ids: ids, labels, len, segments: vec![] }
}

pub fn load_dataset(path: &Path, opts: &DataOptions, tools: &TextTools) -> Result<Dataset> {
    let bytes = std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
    load_dataset_bytes(path, &bytes, opts, tools)
}

/// Like `load_dataset`, for a file's contents (`path` names it in messages and picks the format).
pub fn load_dataset_bytes(path: &Path, bytes: &[u8], opts: &DataOptions, tools: &TextTools) -> Result<Dataset> {
    let mut out = Dataset::default();
    let mut stream: Vec<u32> = vec![];
    let mut rows: Vec<(Vec<u32>, Vec<i64>)> = vec![];
    let mut longest = 0;
    for (line, row) in read_rows_bytes(path, bytes)? {
        out.rows += 1;
        let built = (|| -> Result<Option<(Vec<u32>, Vec<i64>)>> {
            let row = row?;
            let mut example = parse_row(&row, tools.template.is_some())?;
            bound_example(&mut example, opts.seq_len)?;
            Ok(match example {
                Example::Text(t) => {
                    stream.extend((tools.encode)(&t, true)?.0);
                    stream.extend(tools.eos_id);
                    None
                }
                Example::PromptCompletion { prompt, completion } => {
                    let text = format!("{prompt}{completion}");
                    let (mut ids, offsets) = (tools.encode)(&text, true)?;
                    let mut labels = if opts.train_on == TrainOn::All {
                        ids.iter().map(|&x| x as i64).collect()
                    } else {
                        mask_by_spans(&ids, &offsets, &[(prompt.len(), text.len())])
                    };
                    if let Some(eos) = tools.eos_id {
                        ids.push(eos);
                        labels.push(eos as i64);
                    }
                    Some((ids, labels))
                }
                Example::Chat(chat) => Some(chat_tokens(&chat, tools, opts.train_on)?),
                Example::Tokens { input_ids, labels } => {
                    let ids: Vec<u32> = input_ids.iter().map(|&x| x as u32).collect();
                    Some((ids, labels.unwrap_or(input_ids)))
                }
            })
        })();
        match built {
            Ok(Some((mut ids, mut labels))) => {
                longest = longest.max(ids.len());
                if ids.len() > opts.seq_len {
                    out.truncated += 1;
                    ids.truncate(opts.seq_len);
                    labels.truncate(opts.seq_len);
                }
                rows.push((ids, labels));
            }
            Ok(None) => {}
            Err(e) if opts.skip_bad_rows => {
                out.skipped += 1;
                if out.skipped <= 3 {
                    eprintln!("skipping {}:{line}: {e:#}", path.display());
                }
            }
            Err(e) => return Err(e.context(format!("{}:{line}", path.display()))),
        }
    }
    let n_rows = rows.len();
    if opts.packing {
        out.samples.extend(pack(rows, opts.seq_len, tools.pad_id));
    } else {
        out.samples.extend(rows.into_iter().map(|(ids, labels)| pad(ids, labels, opts.seq_len, tools.pad_id)));
    }
    // Text rows: whole blocks only.
    for block in stream.chunks_exact(opts.seq_len) {
        out.samples.push(Sample {
            input_ids: block.to_vec(),
            labels: block.iter().map(|&x| x as i64).collect(),
            len: opts.seq_len,
            segments: vec![],
        });
    }
    if out.samples.is_empty() {
        if !stream.is_empty() {
            bail!("{}: {} tokens of text in all, fewer than one block of --seq-len {}", path.display(), stream.len(), opts.seq_len);
        }
        bail!("{}: no usable rows ({} rows, {} skipped)", path.display(), out.rows, out.skipped);
    }
    if out.truncated > 0 && out.truncated == n_rows {
        bail!(
            "{}: every one of the {n_rows} rows is longer than --seq-len {} (the longest has {longest} tokens); raise --seq-len",
            path.display(),
            opts.seq_len
        );
    }
    out.supervised_tokens = out.samples.iter().map(Sample::target_tokens).sum();
    if out.supervised_tokens == 0 {
        bail!("{}: no token is trained on (every label is masked); check --train-on and the chat template", path.display());
    }
    Ok(out)
}

/// One sample as text with the untrained parts marked, for `--show-sample`.
pub fn describe_sample(s: &Sample, decode: &dyn Fn(&[u32]) -> Result<String>) -> Result<String> {
    let mut out = String::new();
    let mut i = 0;
    while i < s.len {
        let trained = s.labels[i] != IGNORE_INDEX;
        let mut j = i;
        while j < s.len && (s.labels[j] != IGNORE_INDEX) == trained {
            j += 1;
        }
        let text = decode(&s.input_ids[i..j])?;
        if trained {
            out.push_str(&text);
        } else {
            out.push_str(&format!("[masked]{text}[/masked]"));
        }
        i = j;
    }
    Ok(out)
}

/// The order samples are visited in: file order, or a permutation per epoch from the seed.
pub fn epoch_order(n: usize, epoch: usize, seed: u64, shuffle: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if shuffle {
        // Fisher-Yates with SplitMix64: the same on every rank and every machine.
        let mut rng = kernels::rng::SplitMix64(seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        for i in (1..n).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
    }
    order
}

/// [`epoch_order`] of whole examples of `group` consecutive samples (DPO's pairs): the
/// examples are shuffled, never the samples inside one.
pub fn epoch_order_grouped(samples: usize, group: usize, epoch: usize, seed: u64, shuffle: bool) -> Vec<usize> {
    epoch_order(samples / group, epoch, seed, shuffle).into_iter().flat_map(|e| (0..group).map(move |k| e * group + k)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(name);
        std::fs::write(&p, text).unwrap();
        (d, p)
    }

    #[test]
    fn a_byte_order_mark_does_not_break_the_first_row() {
        let (_d, p) = write("bom.jsonl", "\u{feff}{\"text\": \"ab\"}\n{\"text\": \"cd\"}\n");
        let rows = read_rows_bytes(&p, &std::fs::read(&p).unwrap()).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].1.as_ref().unwrap()["text"], "ab");
        assert_eq!(without_bom("x"), "x");
    }

    /// A byte tokenizer: one token per byte, offsets exact.
    fn bytes(s: &str, _special: bool) -> Result<crate::tokenize::IdsWithOffsets> {
        Ok((s.bytes().map(|b| b as u32).collect(), (0..s.len()).map(|i| (i, i + 1)).collect()))
    }
    fn decode(ids: &[u32]) -> Result<String> {
        Ok(ids.iter().map(|&i| i as u8 as char).collect())
    }

    fn load(path: &Path, seq_len: usize, train_on: TrainOn, template: Option<&ChatTemplate>) -> Result<Dataset> {
        let tools = TextTools { encode: &bytes, decode: &decode, template, eos_id: Some(0), pad_id: 9 };
        load_dataset(path, &DataOptions { seq_len, train_on, skip_bad_rows: false, packing: false }, &tools)
    }

    #[test]
    fn text_rows_are_concatenated_with_eos_and_cut_into_blocks() {
        let (_d, p) = write("a.jsonl", "{\"text\": \"abc\"}\n\n{\"text\": \"defgh\"}\n");
        let s = load(&p, 4, TrainOn::Auto, None).unwrap().samples;
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].input_ids, vec![97, 98, 99, 0]);
        assert_eq!(s[1].labels, vec![100, 101, 102, 103]);
    }

    #[test]
    fn pretokenized_rows_are_padded_and_cut() {
        let (_d, p) = write("a.jsonl", "{\"input_ids\": [5, 6], \"labels\": [-100, 6]}\n{\"input_ids\": [1, 2, 3, 4, 5]}\n");
        let d = load(&p, 4, TrainOn::Auto, None).unwrap();
        assert_eq!(d.samples[0], Sample { input_ids: vec![5, 6, 9, 9], labels: vec![-100, 6, -100, -100], len: 2, segments: vec![] });
        assert_eq!(d.samples[0].target_tokens(), 1);
        assert_eq!((d.truncated, d.samples[1].input_ids.clone()), (1, vec![1, 2, 3, 4]));
        assert!((d.padding_efficiency(4) - 6.0 / 8.0).abs() < 1e-9);
    }

    #[test]
    fn completions_and_assistant_turns_are_the_trained_parts() {
        let (_d, p) = write("a.json", r#"[{"prompt": "Q:", "completion": "A"}]"#);
        let d = load(&p, 8, TrainOn::Auto, None).unwrap();
        assert_eq!(d.samples[0].labels[..4], [-100, -100, 65, 0]);
        let t = ChatTemplate::new(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}</>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
            None,
            None,
        )
        .unwrap();
        let row = r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}, {"role": "assistant", "content": "ok"}]}"#;
        let (_d2, p2) = write("c.jsonl", row);
        let shown = |on: TrainOn| describe_sample(&load(&p2, 80, on, Some(&t)).unwrap().samples[0], &decode).unwrap();
        assert_eq!(shown(TrainOn::Auto), "[masked]<user>hi</><assistant>[/masked]yo</>[masked]<user>?</><assistant>[/masked]ok</>");
        assert_eq!(shown(TrainOn::Completion), "[masked]<user>hi</><assistant>yo</><user>?</><assistant>[/masked]ok</>");
        assert_eq!(shown(TrainOn::All), "<user>hi</><assistant>yo</><user>?</><assistant>ok</>");
    }

    #[test]
    fn bad_data_is_named() {
        let (_d, p) = write("a.jsonl", "{\"text\": \"abc\"}\n{oops\n");
        let e = format!("{:#}", load(&p, 2, TrainOn::Auto, None).unwrap_err());
        assert!(e.contains("a.jsonl:2: not valid JSON"), "{e}");
        let (_d, p) = write("a.jsonl", "{\"txt\": \"abc\"}\n");
        let e = format!("{:#}", load(&p, 2, TrainOn::Auto, None).unwrap_err());
        assert!(e.contains("a.jsonl:1: row has none of the known fields"), "{e}");
        let (_d, p) = write("a.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}\n");
        let e = format!("{:#}", load(&p, 8, TrainOn::Auto, None).unwrap_err());
        assert!(e.contains("a.jsonl:1: chat rows need a chat template"), "{e}");
        let (_d, p) = write("a.jsonl", "{\"prompt\": \"abcdef\", \"completion\": \"g\"}\n");
        let e = format!("{:#}", load(&p, 3, TrainOn::Auto, None).unwrap_err());
        assert!(e.contains("every one of the 1 rows is longer than --seq-len 3"), "{e}");
        let (_d, p) = write("a.jsonl", "{\"input_ids\": [1, 2], \"labels\": [-100, -100]}\n");
        let e = format!("{:#}", load(&p, 3, TrainOn::Auto, None).unwrap_err());
        assert!(e.contains("no token is trained on"), "{e}");
        // --skip-bad-rows counts what it skipped.
        let (_d, p) = write("a.jsonl", "{\"input_ids\": [1, 2]}\n{oops\n{\"foo\": 1}\n");
        let tools = TextTools { encode: &bytes, decode: &decode, template: None, eos_id: None, pad_id: 0 };
        let d =
            load_dataset(&p, &DataOptions { seq_len: 4, train_on: TrainOn::Auto, skip_bad_rows: true, packing: false }, &tools).unwrap();
        assert_eq!((d.rows, d.skipped, d.samples.len()), (3, 2, 1));
    }

    #[test]
    fn packing_fills_rows_with_separate_documents() {
        let (_d, p) = write("a.jsonl", "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4, 5]}\n{\"input_ids\": [6, 7, 8, 9]}\n");
        let tools = TextTools { encode: &bytes, decode: &decode, template: None, eos_id: None, pad_id: 0 };
        let d =
            load_dataset(&p, &DataOptions { seq_len: 6, train_on: TrainOn::Auto, skip_bad_rows: false, packing: true }, &tools).unwrap();
        assert_eq!(d.samples.len(), 2);
        assert_eq!(d.samples[0].input_ids, vec![1, 2, 3, 4, 5, 0]);
        assert_eq!(d.samples[0].segments, vec![1, 1, 1, 2, 2, 0]);
        // Token 4 starts a new document: not predicted from token 3.
        assert_eq!(d.samples[0].labels, vec![1, 2, 3, -100, 5, -100]);
        assert!((d.padding_efficiency(6) - 9.0 / 12.0).abs() < 1e-9);
    }

    #[test]
    fn parquet_files_give_the_rows_of_their_jsonl_twins() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
        for (parquet, jsonl) in [("zephyrix-codename.parquet", "zephyrix-codename.jsonl"), ("alpaca-zstd.parquet", "alpaca.jsonl")] {
            let pq = read_rows_bytes(&dir.join(parquet), &std::fs::read(dir.join(parquet)).unwrap()).unwrap();
            let js = read_rows_bytes(&dir.join(jsonl), &std::fs::read(dir.join(jsonl)).unwrap()).unwrap();
            assert_eq!(pq.len(), js.len(), "{parquet}");
            for ((i, a), (_, b)) in pq.into_iter().zip(js) {
                assert_eq!(a.unwrap(), b.unwrap(), "{parquet} row {i}");
            }
        }
        // The same samples come out of both (Alpaca rows, byte tokenizer).
        let a = load(&dir.join("alpaca-zstd.parquet"), 256, TrainOn::Auto, None).unwrap();
        let b = load(&dir.join("alpaca.jsonl"), 256, TrainOn::Auto, None).unwrap();
        assert_eq!(a.samples.iter().map(|s| &s.labels).collect::<Vec<_>>(), b.samples.iter().map(|s| &s.labels).collect::<Vec<_>>());
        // A damaged file is named.
        let (_d, p) = write("bad.parquet", "PAR1 this is not parquet");
        let e = format!("{:#}", load(&p, 16, TrainOn::Auto, None).unwrap_err());
        assert!(e.contains("bad.parquet: not a readable Parquet file"), "{e}");
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

    #[test]
    fn a_huge_text_row_is_refused_by_size_and_other_fields_are_cut_to_the_budget() {
        let mut text = Example::Text("x".repeat(text_budget::TEXT_ROW_LIMIT + 1));
        let e = bound_example(&mut text, 64).unwrap_err().to_string();
        assert!(e.contains("field `text`") && e.contains(&format!("{}", text_budget::TEXT_ROW_LIMIT + 1)), "{e}");
        let mut pc = Example::PromptCompletion { prompt: "p".repeat(50_000_000), completion: "c".repeat(10) };
        bound_example(&mut pc, 64).unwrap();
        let Example::PromptCompletion { prompt, completion } = pc else { unreachable!() };
        assert_eq!((prompt.len(), completion.len()), (text_budget::bytes_for(64), 10));
    }
}
