//! The text of the generated ids, kept up to date in constant work per token (the incremental
//! detokenization of TGI and vLLM). Decoding all generated ids at every step made each token
//! cost more as the answer grew (docs/design.md); here each step decodes only the ids since the text
//! last grew by whole characters, beside the ids just before them, whose decoded text is cut off
//! again: decoders treat a sequence's first token specially (SentencePiece drops its leading
//! space), so a window that starts one flushed step back decodes its new ids as they read in the
//! whole text.

use anyhow::Result;

use crate::tokenize::TextTokenizer;

/// The decoding of every id pushed so far: equal to decoding them all at once, including a
/// trailing U+FFFD while the last id ends inside a multi-byte character (`TextStream` holds
/// that back).
#[derive(Debug, Clone)]
pub struct Detokenizer {
    /// How the text is written (`TextTokenizer::decode_output`).
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
    /// Ids before `read` whose text is already in `text`, decoded again as context.
    prefix: usize,
    /// Ids before this one are in `text[..flushed]` for good.
    read: usize,
    text: String,
    flushed: usize,
}

impl Default for Detokenizer {
    /// Special tokens left out, as an answer's text is unless the client asks.
    fn default() -> Self {
        Self::new(true, true)
    }
}

impl Detokenizer {
    /// A detokenizer that writes text as [`TextTokenizer::decode_output`] with these settings.
    pub fn new(skip_special_tokens: bool, spaces_between_special_tokens: bool) -> Self {
        Self { skip_special_tokens, spaces_between_special_tokens, prefix: 0, read: 0, text: String::new(), flushed: 0 }
    }

    fn decode(&self, tokenizer: &TextTokenizer, ids: &[u32]) -> Result<String> {
        tokenizer.decode_output(ids, self.skip_special_tokens, self.spaces_between_special_tokens)
    }

    /// `ids`: every generated id so far (the previous call's plus new ones). Returns the text.
    pub fn push(&mut self, tokenizer: &TextTokenizer, ids: &[u32]) -> Result<&str> {
        let context = self.decode(tokenizer, &ids[self.prefix..self.read])?;
        let window = self.decode(tokenizer, &ids[self.prefix..])?;
        self.text.truncate(self.flushed);
        match window.strip_prefix(context.as_str()) {
            Some(new) => {
                self.text.push_str(new);
                // Whole characters: the text up to here is final, the window moves on.
                if !new.is_empty() && !new.ends_with('\u{FFFD}') {
                    self.flushed = self.text.len();
                    (self.prefix, self.read) = (self.read, ids.len());
                }
            }
            None => {
                // A decoder whose text for the context is not a prefix of the window's (none of
                // the supported tokenizers; kept correct, not fast): decode everything.
                self.text = self.decode(tokenizer, ids)?;
                (self.flushed, self.prefix, self.read) = (0, 0, 0);
            }
        }
        Ok(&self.text)
    }

    pub fn text(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// For every fixture tokenizer (byte-level BPE and SentencePiece with byte fallback), ids that
    /// include multi-byte characters split over tokens, special tokens and plain words: after each
    /// id the text equals decoding all ids so far.
    #[test]
    fn equals_decoding_everything_after_every_token() {
        let tmp = tempfile::tempdir().unwrap();
        for name in crate::fixtures::FIXTURE_NAMES {
            let dir = tmp.path().join(name);
            crate::fixtures::write_fixture(name, &dir).unwrap();
            let tok = TextTokenizer::from_bytes(&std::fs::read(dir.join("tokenizer.json")).unwrap(), None, None).unwrap();
            let text = "Hello world, café naïve — 日本語 ok!\n  spaced  out 🙂 end";
            let mut ids = tok.encode(text, false).unwrap();
            let vocab = tok.inner.get_vocab_size(true) as u32;
            // Interleave arbitrary ids (bytes, specials, pieces) with the real ones.
            let extra: Vec<u32> = (0..60).map(|i| (i * 7919 + 13) % vocab).collect();
            ids.splice(5..5, extra[..30].iter().copied());
            ids.extend(&extra[30..]);
            let mut d = Detokenizer::default();
            for n in 1..=ids.len() {
                let got = d.push(&tok, &ids[..n]).unwrap().to_string();
                assert_eq!(got, tok.decode(&ids[..n], true).unwrap(), "{name}: after {n} ids");
            }
        }
    }

    /// With special tokens kept (vLLM's `skip_special_tokens: false`), after each id the text
    /// equals decoding all ids so far the same way.
    #[test]
    fn keeps_special_tokens_when_asked() {
        let tmp = tempfile::tempdir().unwrap();
        let name = crate::fixtures::FIXTURE_NAMES[0];
        crate::fixtures::write_fixture(name, tmp.path()).unwrap();
        let tok = TextTokenizer::from_bytes(&std::fs::read(tmp.path().join("tokenizer.json")).unwrap(), None, None).unwrap();
        let specials: Vec<u32> = tok.inner.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, _)| id).collect();
        assert!(!specials.is_empty(), "{name} has special tokens");
        let mut ids = tok.encode("Hello world, café", false).unwrap();
        ids.insert(2, specials[0]);
        ids.push(specials[0]);
        for spaces in [true, false] {
            let mut d = Detokenizer::new(false, spaces);
            for n in 1..=ids.len() {
                let got = d.push(&tok, &ids[..n]).unwrap().to_string();
                assert_eq!(got, tok.decode_output(&ids[..n], false, spaces).unwrap(), "after {n} ids");
            }
            assert!(d.text().contains(&tok.decode(&specials[..1], false).unwrap()));
        }
    }

    /// A Llama-2-style SentencePiece tokenizer (`▁` for spaces, byte fallback, the decoder that
    /// strips the first token's leading space): windows that start at `▁world` must not lose its
    /// space, bytes of `é` and `🙂` split over tokens must come out whole.
    #[test]
    fn keeps_sentencepiece_spaces_and_byte_fallback() {
        let mut vocab = serde_json::Map::new();
        for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
            vocab.insert(t.to_string(), i.into());
        }
        for b in 0..=255u32 {
            vocab.insert(format!("<0x{b:02X}>"), (3 + b).into());
        }
        let pieces = ["\u{2581}Hello", "\u{2581}world", ",", "\u{2581}caf", "\u{2581}", "na", "ve", "!", "\u{2581}end"];
        for (i, p) in pieces.iter().enumerate() {
            vocab.insert(p.to_string(), (259 + i as u32).into());
        }
        let special = |id: u32, content: &str| serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "vocab": vocab, "merges": []}
        });
        let tok = TextTokenizer::from_bytes(json.to_string().as_bytes(), None, None).unwrap();
        let id = |t: &str| tok.token_id(t).unwrap_or_else(|| panic!("{t}"));
        let byte = |b: u8| 3 + b as u32;
        // "Hello world, café naïve 🙂! world" with <s> and </s> among them.
        let mut ids = vec![1, id("\u{2581}Hello"), id("\u{2581}world"), id(","), id("\u{2581}caf"), byte(0xC3), byte(0xA9)];
        ids.extend([id("\u{2581}"), id("na"), byte(0xC3), byte(0xAF), id("ve"), id("\u{2581}"), byte(0xF0), byte(0x9F), byte(0x99)]);
        ids.extend([byte(0x82), id("!"), 2, id("\u{2581}world"), id("\u{2581}end")]);
        let mut d = Detokenizer::default();
        for n in 1..=ids.len() {
            let got = d.push(&tok, &ids[..n]).unwrap().to_string();
            assert_eq!(got, tok.decode(&ids[..n], true).unwrap(), "after {n} ids");
        }
        assert_eq!(d.text(), "Hello world, café naïve 🙂! world end");
    }
}
