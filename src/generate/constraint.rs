//! Structured output by constrained decoding. Before each token the grammar engine (llguidance,
//! the one llama.cpp, mistral.rs and vLLM use) says which tokens may come next; the others get
//! no probability, so the answer follows the grammar at any temperature, token by token
//! (streaming included). A JSON schema compiles to such a grammar, tightened where it is silent
//! (`json_schema::tighten`); `json_object` is the schema of any object.
//!
//! The engine needs each token's bytes: they come from tokenizer.json's vocabulary (byte-level
//! BPE and SentencePiece byte-fallback vocabularies; `llguidance::token_bytes_from_tokenizer_json`),
//! so no second `tokenizers` version is linked for it.

use std::sync::Arc;

use anyhow::{Context, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

/// What a constrained answer must be.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputFormat {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against this schema (`response_format: {"type": "json_schema", ...}`).
    JsonSchema(Value),
    /// A grammar in llguidance's Lark syntax (an `auto` answer's calls, `serve::tool_format`; a
    /// request's grammar or choices, `serve::validate::structured`).
    Lark(String),
    /// Text the whole of which matches this regular expression (Rust's `regex` syntax).
    Regex(String),
}

impl OutputFormat {
    fn grammar(&self) -> TopLevelGrammar {
        match self {
            OutputFormat::JsonObject => TopLevelGrammar::from_json_schema(compact_json(&json!({"type": "object"}))),
            OutputFormat::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact_json(s)),
            OutputFormat::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            OutputFormat::Regex(r) => TopLevelGrammar::from_regex(r),
        }
    }
}

/// A schema as the grammar engine takes it: tightened (`json_schema::tighten`), and compact JSON
/// (", " and ": " as separators, no other whitespace) unless the schema says otherwise: with
/// free whitespace a model can pad its answer with blanks until max_tokens and never finish the
/// object.
pub fn compact_json(schema: &Value) -> Value {
    let mut schema = super::json_schema::tighten(schema);
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert(json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
    }
    schema
}

/// A model's vocabulary as the grammar engine sees it: built once per served model.
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    /// From tokenizer.json's contents. `vocab`: the model's vocabulary (its head's rows, which may
    /// exceed the tokenizer's: those extra ids are never allowed); `eos`: the token that ends a
    /// constrained answer once the grammar accepts.
    pub fn new(tokenizer_json: &str, vocab: usize, eos: u32) -> Result<Self> {
        let json: Value = serde_json::from_str(tokenizer_json).context("tokenizer.json")?;
        let mut bytes = llguidance::token_bytes_from_tokenizer_json(&json).context("reading the token bytes of tokenizer.json")?;
        if bytes.len() < vocab {
            bytes.resize(vocab, vec![]);
        }
        let trie = TokTrie::from(&TokRxInfo::new(bytes.len() as u32, eos), &bytes);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(Self { factory })
    }

    /// A token's bytes (a special token's text): a piece of text need not be whole UTF-8.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.factory.tok_env().tok_trie().decode_ext(&[id], true)
    }

    /// A token's bytes, empty for a special token (llama.cpp's `token_to_piece` without them).
    pub fn text_bytes(&self, id: u32) -> Vec<u8> {
        self.factory.tok_env().tok_trie().decode_ext(&[id], false)
    }

    /// A matcher for one answer. A schema the engine cannot compile is an error saying why.
    pub fn matcher(&self, format: &OutputFormat) -> Result<Matcher> {
        let parser = self.factory.create_parser(format.grammar())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            anyhow::bail!("{e}");
        }
        Ok(matcher)
    }
}

/// Sets the logits of tokens `matcher` does not allow next to -inf; an error when the engine
/// fails or allows nothing.
pub fn mask_logits(matcher: &mut Matcher, logits: &mut [f32]) -> Result<()> {
    let mask = matcher.compute_mask_or_eos().map_err(|e| anyhow::anyhow!("the output grammar: {e}"))?;
    for (i, l) in logits.iter_mut().enumerate() {
        if i >= mask.len() || !mask.is_allowed(i as u32) {
            *l = f32::NEG_INFINITY;
        }
    }
    if logits.iter().all(|l| *l == f32::NEG_INFINITY) {
        anyhow::bail!("the output grammar allows no token here");
    }
    Ok(())
}
