//! `text_similarity`'s metrics, each a score in [0, 1], computed as the Python libraries
//! OpenAI's graders name compute them (tests/reference/make_grader_reference.py checks them
//! against those libraries):
//! - `fuzzy_match`: rapidfuzz's `fuzz.ratio` / 100, the normalised Indel similarity of the two
//!   strings' characters, `2 LCS / (|a| + |b|)`;
//! - `bleu`: sacrebleu's `sentence_bleu` / 100 (13a tokenisation, 4-grams, `exp` smoothing,
//!   effective order);
//! - `rouge_1`, `rouge_2`, `rouge_l`: rouge-score's F-measure (lower-cased alphanumeric tokens,
//!   no stemming).

use std::collections::HashMap;
use std::str::FromStr;

use anyhow::bail;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    FuzzyMatch,
    Bleu,
    Rouge1,
    Rouge2,
    RougeL,
}

impl FromStr for Metric {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        Ok(match s {
            "fuzzy_match" => Self::FuzzyMatch,
            "bleu" => Self::Bleu,
            "rouge_1" => Self::Rouge1,
            "rouge_2" => Self::Rouge2,
            "rouge_l" => Self::RougeL,
            other => bail!("{other:?} is not a metric this server computes (fuzzy_match, bleu, rouge_1, rouge_2, rouge_l)"),
        })
    }
}

impl Metric {
    pub fn score(self, output: &str, reference: &str) -> f64 {
        match self {
            Self::FuzzyMatch => fuzzy_match(output, reference),
            Self::Bleu => bleu(output, reference),
            Self::Rouge1 => rouge(output, reference, Some(1)),
            Self::Rouge2 => rouge(output, reference, Some(2)),
            Self::RougeL => rouge(output, reference, None),
        }
    }
}

/// Length of the longest common subsequence.
fn lcs<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    let mut row = vec![0usize; b.len() + 1];
    for x in a {
        let mut diag = 0;
        for (j, y) in b.iter().enumerate() {
            let up = row[j + 1];
            row[j + 1] = if x == y { diag + 1 } else { up.max(row[j]) };
            diag = up;
        }
    }
    row[b.len()]
}

pub fn fuzzy_match(a: &str, b: &str) -> f64 {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    if a.is_empty() && b.is_empty() {
        return 1.0;
    }
    2.0 * lcs(&a, &b) as f64 / (a.len() + b.len()) as f64
}

/// sacrebleu's `tokenizer_13a`: punctuation split off, periods and commas too unless beside
/// digits, a dash after a digit.
fn tokenize_13a(text: &str) -> Vec<String> {
    let text = text.replace("<skipped>", "").replace("-\n", "").replace('\n', " ");
    let text = text.replace("&quot;", "\"").replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">");
    let chars: Vec<char> = text.chars().collect();
    let punct = |c: char| matches!(c, '{'..='~' | '['..='`' | ' '..='&' | '('..='+' | ':'..='@' | '/');
    let mut out = String::new();
    for (i, &c) in chars.iter().enumerate() {
        let prev = if i > 0 { Some(chars[i - 1]) } else { None };
        let next = chars.get(i + 1).copied();
        let digit = |c: Option<char>| c.is_some_and(|c| c.is_ascii_digit());
        let split = if punct(c) {
            true
        } else if c == '.' || c == ',' {
            // Kept whole only between digits ("3.5", "1,000").
            !(digit(prev) && digit(next))
        } else {
            c == '-' && digit(prev)
        };
        if split {
            out.push(' ');
            out.push(c);
            out.push(' ');
        } else {
            out.push(c);
        }
    }
    out.split_whitespace().map(str::to_string).collect()
}

fn ngram_counts(tokens: &[String], n: usize) -> HashMap<&[String], usize> {
    let mut counts = HashMap::new();
    for g in tokens.windows(n) {
        *counts.entry(g).or_insert(0) += 1;
    }
    counts
}

pub fn bleu(output: &str, reference: &str) -> f64 {
    let (sys, refs) = (tokenize_13a(output), tokenize_13a(reference));
    if sys.is_empty() {
        return 0.0;
    }
    let (mut log_sum, mut smooth, mut order, mut any_correct) = (0.0, 1.0, 0, false);
    for n in 1..=4 {
        let total = sys.len().saturating_sub(n - 1);
        if total == 0 {
            // Effective order: a short sentence is scored on the n-grams it has.
            break;
        }
        order = n;
        let refs_n = ngram_counts(&refs, n);
        let correct: usize = ngram_counts(&sys, n).iter().map(|(g, c)| (*c).min(refs_n.get(g).copied().unwrap_or(0))).sum();
        any_correct |= correct > 0;
        let precision = if correct == 0 {
            smooth *= 2.0;
            1.0 / (smooth * total as f64)
        } else {
            correct as f64 / total as f64
        };
        log_sum += precision.ln();
    }
    // No n-gram in common at all: 0, whatever smoothing would make of it (sacrebleu #141).
    if !any_correct {
        return 0.0;
    }
    let brevity = if sys.len() < refs.len() { (1.0 - refs.len() as f64 / sys.len() as f64).exp() } else { 1.0 };
    brevity * (log_sum / order as f64).exp()
}

/// rouge-score's tokens: lower case, anything not a-z or 0-9 a separator.
fn rouge_tokens(text: &str) -> Vec<String> {
    let lower = text.to_lowercase();
    let cleaned: String = lower.chars().map(|c| if c.is_ascii_lowercase() || c.is_ascii_digit() { c } else { ' ' }).collect();
    cleaned.split_whitespace().map(str::to_string).collect()
}

/// ROUGE-N's F-measure (`n` given) or ROUGE-L's (`None`).
pub fn rouge(output: &str, reference: &str, n: Option<usize>) -> f64 {
    let (pred, target) = (rouge_tokens(output), rouge_tokens(reference));
    let (overlap, pred_total, target_total) = match n {
        Some(n) => {
            let (p, t) = (ngram_counts(&pred, n), ngram_counts(&target, n));
            let overlap: usize = p.iter().map(|(g, c)| (*c).min(t.get(g).copied().unwrap_or(0))).sum();
            (overlap, p.values().sum::<usize>(), t.values().sum::<usize>())
        }
        None => (lcs(&pred, &target), pred.len(), target.len()),
    };
    if pred_total == 0 || target_total == 0 || overlap == 0 {
        return 0.0;
    }
    let (p, r) = (overlap as f64 / pred_total as f64, overlap as f64 / target_total as f64);
    2.0 * p * r / (p + r)
}
