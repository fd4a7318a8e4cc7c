//! Text <-> token ids with the model's own `tokenizer.json`, and its special tokens.

pub mod chat;
pub mod tool_prompt;

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::model_files::ModelFiles;
pub use chat::{ChatMessage, ChatTemplate};

/// Token ids and each token's byte range in the text they came from.
pub type IdsWithOffsets = (Vec<u32>, Vec<(usize, usize)>);

/// The tokenizer of one model plus what `tokenizer_config.json` says about it.
pub struct TextTokenizer {
    pub inner: Tokenizer,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub chat_template: Option<ChatTemplate>,
}

/// `"<s>"` or `{"content": "<s>", ...}` as tokenizer_config.json writes special tokens.
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl TextTokenizer {
    /// Loads `tokenizer.json` (with tokenizer_config.json and chat_template.jinja when present)
    /// and checks it fits a vocabulary of `vocab_size` rows.
    pub fn load(files: &ModelFiles, vocab_size: usize) -> Result<Self> {
        let path = files.tokenizer.as_ref().with_context(|| format!("{}: missing tokenizer.json", files.source))?;
        if !path.is_file() {
            bail!("{}: missing tokenizer file", path.display());
        }
        let read = |p: &Path| std::fs::read(p).with_context(|| format!("{}: cannot read", p.display()));
        let tokenizer_config = files.tokenizer_config.as_deref().map(read).transpose()?;
        let chat_template = files.chat_template.as_deref().map(read).transpose()?;
        let tok =
            Self::from_bytes(&read(path)?, tokenizer_config.as_deref(), chat_template.as_deref()).with_context(|| files.source.clone())?;
        let n = tok.inner.get_vocab_size(true);
        if n > vocab_size {
            bail!(
                "{}: tokenizer has {n} tokens but config.json's vocab_size is {vocab_size}; the tokenizer does not \
                 belong to this model",
                path.display()
            );
        }
        Ok(tok)
    }

    /// Builds a tokenizer from file contents (as they travel from rank 0): tokenizer.json,
    /// tokenizer_config.json and chat_template.jinja, each optional but the first.
    pub fn from_bytes(tokenizer_json: &[u8], tokenizer_config: Option<&[u8]>, chat_template_jinja: Option<&[u8]>) -> Result<Self> {
        let inner = Tokenizer::from_bytes(tokenizer_json).map_err(|e| anyhow::anyhow!("tokenizer.json: {e}"))?;
        let tok_cfg: Value = match tokenizer_config {
            Some(b) => serde_json::from_slice(b).context("tokenizer_config.json: invalid JSON")?,
            None => Value::Null,
        };
        let bos_token = token_string(tok_cfg.get("bos_token"));
        let eos_token = token_string(tok_cfg.get("eos_token"));
        let template_text = match chat_template_jinja {
            Some(b) => Some(String::from_utf8_lossy(b).to_string()),
            None => chat::template_text(None, &tok_cfg)?,
        };
        let chat_template = match template_text {
            Some(t) => Some(ChatTemplate::new(&t, bos_token.clone(), eos_token.clone()).context("chat template")?),
            None => None,
        };
        Ok(Self { inner, bos_token, eos_token, chat_template })
    }

    /// Uses `source` as the chat template instead of the model's own (`--chat-template`).
    pub fn replace_chat_template(&mut self, source: &str) -> Result<()> {
        self.chat_template = Some(ChatTemplate::new(source, self.bos_token.clone(), self.eos_token.clone()).context("--chat-template")?);
        Ok(())
    }

    /// Token ids and each token's byte range in `text`.
    pub fn encode_with_offsets(&self, text: &str, add_special_tokens: bool) -> Result<IdsWithOffsets> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// Encodes plain text the way transformers' `tokenizer(text)` does (special tokens per the
    /// tokenizer's post-processor, e.g. BOS for Llama 3).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| anyhow::anyhow!("decoding: {e}"))
    }

    /// An answer's text as vLLM's detokenizer writes it: `skip_special_tokens` leaves special
    /// tokens out; with them kept and `spaces_between_special_tokens` false, an added token that
    /// follows another is written as its raw content, without the space a decoder may put before
    /// a token (WordPiece's, for one), as vLLM's fast detokenizer does; otherwise the tokenizer's
    /// own decoding.
    pub fn decode_output(&self, ids: &[u32], skip_special_tokens: bool, spaces_between_special_tokens: bool) -> Result<String> {
        if skip_special_tokens || spaces_between_special_tokens {
            return self.decode(ids, skip_special_tokens);
        }
        let added = self.inner.get_added_tokens_decoder();
        // Token by token: each token's piece is what it adds to the decoding of the ids before it.
        let (mut text, mut before, mut after_added) = (String::new(), String::new(), false);
        for i in 0..ids.len() {
            let whole = self.decode(&ids[..=i], false)?;
            match added.get(&ids[i]) {
                Some(token) if after_added => text.push_str(&token.content),
                _ => text.push_str(whole.strip_prefix(before.as_str()).or_else(|| whole.get(before.len()..)).unwrap_or("")),
            }
            after_added = added.contains_key(&ids[i]);
            before = whole;
        }
        Ok(text)
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

pub fn load_tokenizer_json(path: &Path) -> Result<Tokenizer> {
    if !path.is_file() {
        bail!("{}: missing tokenizer file", path.display());
    }
    Tokenizer::from_file(path).map_err(|e| anyhow::anyhow!("{}: not a valid tokenizer.json: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A WordPiece decoder puts a space before every token: vLLM's
    /// `spaces_between_special_tokens: false` writes a special token after another without it,
    /// and changes nothing else; with special tokens skipped it changes nothing at all.
    #[test]
    fn spaces_between_special_tokens_as_vllm_writes_them() {
        let special = |id: u32, content: &str| serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [special(0, "[A]"), special(1, "[B]")],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": false},
            "model": {"type": "WordLevel", "vocab": {"[A]": 0, "[B]": 1, "hi": 2, "there": 3}, "unk_token": "[A]"}
        });
        let tok = TextTokenizer::from_bytes(json.to_string().as_bytes(), None, None).unwrap();
        let ids = [2, 0, 1, 3, 1];
        assert_eq!(tok.decode_output(&ids, false, true).unwrap(), "hi [A] [B] there [B]");
        assert_eq!(tok.decode_output(&ids, false, false).unwrap(), "hi [A][B] there [B]");
        assert_eq!(tok.decode_output(&ids, true, false).unwrap(), tok.decode(&ids, true).unwrap());
    }
}
