//! Text <-> token ids with the model's own `tokenizer.json`, and its special tokens.

pub mod chat;
pub mod fim;
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
    /// tokenizer_config.json as read (Null without one), for `info`.
    config: Value,
}

/// `"<s>"` or `{"content": "<s>", ...}` as tokenizer_config.json writes special tokens.
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// tokenizer_config.json's added tokens (`{"content": "<s>", "special": true, ...}`, alone or
/// in `added_tokens_decoder`) as their text, as transformers serialises an `AddedToken`.
fn added_tokens_as_text(v: &Value) -> Value {
    const ADDED_TOKEN: &[&str] = &["__type", "content", "lstrip", "rstrip", "normalized", "single_word", "special"];
    match v {
        Value::Object(o) if o.get("content").is_some_and(Value::is_string) && o.keys().all(|k| ADDED_TOKEN.contains(&k.as_str())) => {
            o["content"].clone()
        }
        Value::Object(o) => Value::Object(o.iter().map(|(k, v)| (k.clone(), added_tokens_as_text(v))).collect()),
        Value::Array(a) => Value::Array(a.iter().map(added_tokens_as_text).collect()),
        other => other.clone(),
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
        Ok(Self { inner, bos_token, eos_token, chat_template, config: tok_cfg })
    }

    /// The tokenizer's settings as transformers hands them to a client (vLLM's `/tokenizer_info`,
    /// which lm-evaluation-harness reads to tokenize through the server): tokenizer_config.json's
    /// fields, special tokens as their text, without the files' paths, with the chat template in
    /// use and the fast tokenizer's class.
    pub fn info(&self) -> Value {
        let mut info = match &self.config {
            Value::Object(o) => o.iter().map(|(k, v)| (k.clone(), added_tokens_as_text(v))).collect(),
            _ => serde_json::Map::new(),
        };
        for path in ["vocab_file", "merges_file", "tokenizer_file", "chat_template"] {
            info.remove(path);
        }
        let class = match info.get("tokenizer_class").and_then(Value::as_str) {
            Some(c) if c.ends_with("Fast") => c.to_string(),
            Some(c) => format!("{c}Fast"),
            None => "PreTrainedTokenizerFast".to_string(),
        };
        info.insert("tokenizer_class".into(), Value::String(class));
        for (field, token) in [("bos_token", &self.bos_token), ("eos_token", &self.eos_token)] {
            info.insert(field.into(), token.clone().map_or(Value::Null, Value::String));
        }
        if let Some(t) = &self.chat_template {
            info.insert("chat_template".into(), Value::String(t.source.clone()));
        }
        Value::Object(info)
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

    /// `info` is tokenizer_config.json as transformers' `init_kwargs` reach a client through
    /// vLLM: added tokens as their text, no file paths, the fast class, the template in use.
    #[test]
    fn info_reads_as_transformers_init_kwargs() {
        let json = serde_json::json!({"version": "1.0", "added_tokens": [], "model": {"type": "WordLevel", "vocab": {"a": 0, "</s>": 1}, "unk_token": "a"}});
        let added = serde_json::json!({"content": "</s>", "lstrip": false, "normalized": false, "rstrip": false, "single_word": false, "special": true});
        let config = serde_json::json!({
            "tokenizer_class": "Qwen2Tokenizer", "eos_token": added, "pad_token": {"__type": "AddedToken", "content": "a"},
            "added_tokens_decoder": {"1": added}, "vocab_file": "/x/vocab.json", "model_max_length": 32,
            "chat_template": "{{ messages[0].content }}", "extra": {"content": 3}
        });
        let mut tok = TextTokenizer::from_bytes(json.to_string().as_bytes(), Some(config.to_string().as_bytes()), None).unwrap();
        let info = tok.info();
        assert_eq!(info["tokenizer_class"], "Qwen2TokenizerFast");
        assert_eq!((&info["eos_token"], &info["pad_token"], &info["bos_token"]), (&"</s>".into(), &"a".into(), &Value::Null));
        assert_eq!(info["added_tokens_decoder"], serde_json::json!({"1": "</s>"}));
        assert_eq!((&info["model_max_length"], &info["extra"]), (&32.into(), &serde_json::json!({"content": 3})));
        assert!(info.get("vocab_file").is_none());
        assert_eq!(info["chat_template"], "{{ messages[0].content }}");
        tok.replace_chat_template("{{ 'x' }}").unwrap();
        assert_eq!(tok.info()["chat_template"], "{{ 'x' }}");
    }
}
