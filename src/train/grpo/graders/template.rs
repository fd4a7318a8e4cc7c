//! Grader templates: text with `{{sample.output_text}}`, `{{sample.output_json.PATH}}` and
//! `{{item.PATH}}` (dotted paths) in it, as OpenAI's graders write them.

use anyhow::{bail, Context, Result};
use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq)]
enum Part {
    Text(String),
    OutputText,
    OutputJson(String),
    Item(String),
}

impl Template {
    pub fn parse(text: &str) -> Result<Self> {
        let mut parts = vec![];
        let mut rest = text;
        while let Some(open) = rest.find("{{") {
            if open > 0 {
                parts.push(Part::Text(rest[..open].to_string()));
            }
            let close = rest[open..].find("}}").with_context(|| format!("{text:?}: a `{{{{` without its `}}}}`"))? + open;
            let name = rest[open + 2..close].trim();
            parts.push(match name {
                "sample.output_text" => Part::OutputText,
                _ if name.starts_with("sample.output_json.") => Part::OutputJson(name["sample.output_json.".len()..].to_string()),
                _ if name.starts_with("item.") && name.len() > 5 => Part::Item(name[5..].to_string()),
                _ => bail!("{text:?}: `{{{{{name}}}}}` is not sample.output_text, sample.output_json.FIELD or item.FIELD"),
            });
            rest = &rest[close + 2..];
        }
        if !rest.is_empty() {
            parts.push(Part::Text(rest.to_string()));
        }
        Ok(Self { parts })
    }

    /// Checks that every `item.` path is in `item`.
    pub fn check_item(&self, item: &Value) -> Result<()> {
        for p in &self.parts {
            if let Part::Item(path) = p {
                if lookup(item, path).is_none() {
                    bail!("the row has no field `{path}` (the template reads {{{{item.{path}}}}})");
                }
            }
        }
        Ok(())
    }

    /// The text for one sample. A missing `output_json` path (or output that is not JSON)
    /// renders as empty text: the sample simply does not match.
    pub fn render(&self, output_text: &str, item: &Value) -> Result<String> {
        let mut out = String::new();
        let mut parsed: Option<Option<Value>> = None;
        for p in &self.parts {
            match p {
                Part::Text(t) => out.push_str(t),
                Part::OutputText => out.push_str(output_text),
                Part::OutputJson(path) => {
                    let json = parsed.get_or_insert_with(|| serde_json::from_str(output_text.trim()).ok());
                    if let Some(v) = json.as_ref().and_then(|j| lookup(j, path)) {
                        out.push_str(&as_text(v));
                    }
                }
                Part::Item(path) => {
                    let v = lookup(item, path).with_context(|| format!("the row has no field `{path}`"))?;
                    out.push_str(&as_text(v));
                }
            }
        }
        Ok(out)
    }
}

/// The value at a dotted path (`a.b.0.c`: object keys, list indices).
pub fn lookup<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, key| match v {
        Value::Object(m) => m.get(key),
        Value::Array(a) => key.parse::<usize>().ok().and_then(|i| a.get(i)),
        _ => None,
    })
}

/// A string's text, any other value's JSON.
pub fn as_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}
