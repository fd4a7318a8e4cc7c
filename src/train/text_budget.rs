//! How much of a row's text can reach a sample of `seq_len` tokens, so that no row hands the
//! tokenizer more than that. A tokenizer's working memory grows with its input (hundreds of
//! bytes per input byte): one row of tens of megabytes took a tiny model's run to gigabytes
//! while a sample kept 64 of its tokens.
//!
//! A token is a few bytes of text (no vocabulary we load has one near [`BYTES_PER_TOKEN`]), so
//! `seq_len` tokens never need more than [`bytes_for`]`(seq_len)` bytes of a field: a field cut
//! there, keeping the end that training keeps, tokenises to the same tokens where it matters.
//! Text rows (`{"text"}`, cut into blocks) use all of their text and are refused past
//! [`TEXT_ROW_LIMIT`] instead, naming the row.

use crate::tokenize::ChatMessage;

/// Every message's content (and thinking) cut by `cut` to `budget` bytes.
pub fn contents(messages: &mut [ChatMessage], budget: usize, cut: fn(&mut String, usize)) {
    for m in messages {
        cut(&mut m.content, budget);
        if let Some(thinking) = m.reasoning.as_mut() {
            cut(thinking, budget);
        }
    }
}

/// An upper bound on the bytes of text one token stands for.
pub const BYTES_PER_TOKEN: usize = 256;

/// The largest `{"text"}` row: tokenised whole, it is split into rows by its owner past this.
pub const TEXT_ROW_LIMIT: usize = 1 << 20;

/// Bytes of one field that can matter to a sample of `seq_len` tokens.
pub fn bytes_for(seq_len: usize) -> usize {
    seq_len.saturating_mul(BYTES_PER_TOKEN).saturating_add(4096)
}

/// `s` cut to at most `budget` bytes, its start kept (at a character boundary).
pub fn keep_start(s: &mut String, budget: usize) {
    if s.len() > budget {
        let mut at = budget;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
    }
}

/// `s` cut to at most `budget` bytes, its end kept (at a character boundary).
pub fn keep_end(s: &mut String, budget: usize) {
    if s.len() > budget {
        let mut at = s.len() - budget;
        while !s.is_char_boundary(at) {
            at += 1;
        }
        s.drain(..at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_keep_the_named_end_at_character_boundaries() {
        let mut s = "aé".repeat(10);
        keep_start(&mut s, 4);
        assert_eq!(s, "aéa");
        let mut s = "éa".repeat(10);
        keep_end(&mut s, 4);
        assert_eq!(s, "aéa");
        let mut short = "abc".to_string();
        keep_start(&mut short, 10);
        keep_end(&mut short, 10);
        assert_eq!(short, "abc");
    }
}
