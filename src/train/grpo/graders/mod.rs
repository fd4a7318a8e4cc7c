//! Graders: what turns a completion into a reward. OpenAI's reinforcement fine-tuning shapes
//! (`string_check`, `text_similarity`, `multi`), a JSON grader (`json_schema`), and a command
//! grader that runs a program of the user's, so any reward function works without Python in
//! this process.
//!
//! A grader reads a sample (`{{sample.output_text}}`, `{{sample.output_json.FIELD}}`) and its
//! data row (`{{item.FIELD}}`) through templates. Graders are checked when read (a bad one is
//! named by its field), and the fields their templates name are checked against every data row
//! before training starts ([`Grader::check_item`]).

mod command;
mod formula;
mod schema;
mod similarity;
mod template;

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

pub use command::CommandGrader;
pub use similarity::{bleu, fuzzy_match, rouge, Metric};
pub use template::Template;

/// One completion to grade, with the data row it answers.
pub struct GradeInput<'a> {
    pub output_text: &'a str,
    pub item: &'a Value,
}

/// A grader, as read from its JSON (or YAML) description.
#[derive(Debug, Clone)]
pub struct Grader {
    pub name: String,
    pub kind: Kind,
}

#[derive(Debug, Clone)]
pub enum Kind {
    StringCheck { input: Template, reference: Template, operation: StringOp },
    TextSimilarity { input: Template, reference: Template, metric: Metric, pass_threshold: Option<f64> },
    JsonSchema { input: Template, schema: Value, field: Option<String>, reference: Option<Template> },
    Multi { graders: Vec<Grader>, formula: formula::Formula },
    Command(CommandGrader),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StringOp {
    Eq,
    Ne,
    /// The reference occurs in the input.
    Like,
    /// As `like`, ignoring case.
    Ilike,
}

/// A batch's scores: the grader's, and every named grader's inside it (a `multi`'s parts), for
/// the per-grader metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scores {
    pub total: Vec<f64>,
    /// (grader name, its score per sample), the top grader first.
    pub by_grader: Vec<(String, Vec<f64>)>,
}

impl Grader {
    /// Reads a grader from a `.json`, `.yaml` or `.yml` file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("--grader {}: cannot read", path.display()))?;
        let value: Value = match path.extension().and_then(|e| e.to_str()) {
            Some("yaml" | "yml") => {
                crate::train::config_file::yaml_to_json(&text).with_context(|| format!("--grader {}", path.display()))?
            }
            _ => serde_json::from_str(&text).with_context(|| format!("--grader {}: not valid JSON", path.display()))?,
        };
        Self::from_json(&value).with_context(|| format!("--grader {}", path.display()))
    }

    /// A grader from its description; errors name the field (`grader.operation`, ...).
    pub fn from_json(v: &Value) -> Result<Self> {
        Self::parse(v, "grader")
    }

    fn parse(v: &Value, at: &str) -> Result<Self> {
        let obj = v.as_object().with_context(|| format!("{at}: expected an object"))?;
        let field = |name: &str| obj.get(name);
        let string = |name: &str| -> Result<String> {
            field(name).and_then(Value::as_str).map(str::to_string).with_context(|| format!("{at}.{name}: expected a string"))
        };
        let template = |name: &str| -> Result<Template> { Template::parse(&string(name)?).with_context(|| format!("{at}.{name}")) };
        let kind = string("type")?;
        let allowed: &[&str] = match kind.as_str() {
            "string_check" => &["type", "name", "input", "reference", "operation"],
            "text_similarity" => &["type", "name", "input", "reference", "evaluation_metric", "pass_threshold"],
            "json_schema" => &["type", "name", "input", "schema", "field", "reference"],
            "multi" => &["type", "name", "graders", "calculate_output"],
            "command" => &["type", "name", "command", "timeout_s"],
            other => {
                bail!("{at}.type: {other:?} is not a grader this server runs (string_check, text_similarity, json_schema, multi, command)")
            }
        };
        if let Some(k) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
            bail!("{at}.{k}: not a field of a {kind} grader (its fields: {})", allowed.join(", "));
        }
        let name = match field("name") {
            None => kind.clone(),
            Some(_) => string("name")?,
        };
        let kind = match kind.as_str() {
            "string_check" => Kind::StringCheck {
                input: template("input")?,
                reference: template("reference")?,
                operation: match string("operation")?.as_str() {
                    "eq" => StringOp::Eq,
                    "ne" => StringOp::Ne,
                    "like" => StringOp::Like,
                    "ilike" => StringOp::Ilike,
                    other => bail!("{at}.operation: {other:?}; expected eq, ne, like or ilike"),
                },
            },
            "text_similarity" => Kind::TextSimilarity {
                input: template("input")?,
                reference: template("reference")?,
                metric: string("evaluation_metric")?.parse().with_context(|| format!("{at}.evaluation_metric"))?,
                pass_threshold: match field("pass_threshold") {
                    None => None,
                    Some(t) => Some(t.as_f64().with_context(|| format!("{at}.pass_threshold: expected a number"))?),
                },
            },
            "json_schema" => {
                let schema = field("schema").cloned().with_context(|| format!("{at}.schema: required"))?;
                schema::check_supported(&schema).with_context(|| format!("{at}.schema"))?;
                let reference = field("reference").map(|_| template("reference")).transpose()?;
                let json_field = field("field").map(|_| string("field")).transpose()?;
                if reference.is_some() != json_field.is_some() {
                    bail!("{at}: `field` and `reference` go together (the output's field that must equal the reference)");
                }
                Kind::JsonSchema {
                    input: match field("input") {
                        None => Template::parse("{{sample.output_text}}")?,
                        Some(_) => template("input")?,
                    },
                    schema,
                    field: json_field,
                    reference,
                }
            }
            "multi" => {
                let parts = field("graders")
                    .and_then(Value::as_object)
                    .with_context(|| format!("{at}.graders: expected an object of named graders"))?;
                if parts.is_empty() {
                    bail!("{at}.graders: at least one grader");
                }
                let graders = parts
                    .iter()
                    .map(|(key, g)| {
                        let mut grader = Self::parse(g, &format!("{at}.graders.{key}"))?;
                        // The formula names graders by their key.
                        grader.name = key.clone();
                        Ok(grader)
                    })
                    .collect::<Result<Vec<_>>>()?;
                let names: Vec<&str> = graders.iter().map(|g| g.name.as_str()).collect();
                let formula =
                    formula::Formula::parse(&string("calculate_output")?, &names).with_context(|| format!("{at}.calculate_output"))?;
                Kind::Multi { graders, formula }
            }
            _ => Kind::Command(CommandGrader::parse(obj, at)?),
        };
        Ok(Self { name, kind })
    }

    /// Checks that every `{{item.FIELD}}` the grader reads is in `item` (a data row).
    pub fn check_item(&self, item: &Value) -> Result<()> {
        let templates: Vec<&Template> = match &self.kind {
            Kind::StringCheck { input, reference, .. } | Kind::TextSimilarity { input, reference, .. } => vec![input, reference],
            Kind::JsonSchema { input, reference, .. } => std::iter::once(input).chain(reference).collect(),
            Kind::Multi { graders, .. } => {
                return graders.iter().try_for_each(|g| g.check_item(item));
            }
            Kind::Command(_) => vec![],
        };
        for t in templates {
            t.check_item(item).with_context(|| format!("grader {:?}", self.name))?;
        }
        Ok(())
    }

    /// Scores every sample.
    pub fn score(&self, samples: &[GradeInput]) -> Result<Scores> {
        let mut by_grader = vec![];
        let total = self.score_into(samples, &mut by_grader)?;
        Ok(Scores { total, by_grader })
    }

    fn score_into(&self, samples: &[GradeInput], by_grader: &mut Vec<(String, Vec<f64>)>) -> Result<Vec<f64>> {
        let at = by_grader.len();
        by_grader.push((self.name.clone(), vec![]));
        let render = |t: &Template, s: &GradeInput| t.render(s.output_text, s.item).with_context(|| format!("grader {:?}", self.name));
        let scores: Vec<f64> = match &self.kind {
            Kind::StringCheck { input, reference, operation } => samples
                .iter()
                .map(|s| Ok(f64::from(u8::from(string_check(*operation, &render(input, s)?, &render(reference, s)?)))))
                .collect::<Result<_>>()?,
            Kind::TextSimilarity { input, reference, metric, .. } => {
                samples.iter().map(|s| Ok(metric.score(&render(input, s)?, &render(reference, s)?))).collect::<Result<_>>()?
            }
            Kind::JsonSchema { input, schema, field, reference } => samples
                .iter()
                .map(|s| {
                    let text = render(input, s)?;
                    let expected = reference.as_ref().map(|r| render(r, s)).transpose()?;
                    Ok(f64::from(u8::from(json_check(&text, schema, field.as_deref(), expected.as_deref()))))
                })
                .collect::<Result<_>>()?,
            Kind::Multi { graders, formula } => {
                let parts = graders.iter().map(|g| g.score_into(samples, by_grader)).collect::<Result<Vec<_>>>()?;
                (0..samples.len())
                    .map(|i| {
                        let values: Vec<f64> = parts.iter().map(|p| p[i]).collect();
                        formula.eval(&values)
                    })
                    .collect()
            }
            Kind::Command(c) => c.run(&self.name, samples)?,
        };
        by_grader[at].1 = scores.clone();
        Ok(scores)
    }

    /// Whether the grader (or one inside it) runs a program.
    pub fn runs_commands(&self) -> bool {
        match &self.kind {
            Kind::Command(_) => true,
            Kind::Multi { graders, .. } => graders.iter().any(Grader::runs_commands),
            _ => false,
        }
    }

    /// `text_similarity` graders with a pass threshold: (name, threshold), for the pass-rate
    /// metrics.
    pub fn pass_thresholds(&self) -> Vec<(String, f64)> {
        match &self.kind {
            Kind::TextSimilarity { pass_threshold: Some(t), .. } => vec![(self.name.clone(), *t)],
            Kind::Multi { graders, .. } => graders.iter().flat_map(Grader::pass_thresholds).collect(),
            _ => vec![],
        }
    }
}

fn string_check(op: StringOp, input: &str, reference: &str) -> bool {
    match op {
        StringOp::Eq => input == reference,
        StringOp::Ne => input != reference,
        StringOp::Like => input.contains(reference),
        StringOp::Ilike => input.to_lowercase().contains(&reference.to_lowercase()),
    }
}

/// Whether `text` is JSON that matches `schema` and, with `field`, whose value at that dotted
/// path equals `expected` (a string's text, or any other value's JSON).
fn json_check(text: &str, schema: &Value, field: Option<&str>, expected: Option<&str>) -> bool {
    let Ok(value) = serde_json::from_str::<Value>(text.trim()) else { return false };
    if !schema::matches(&value, schema, schema) {
        return false;
    }
    match (field, expected) {
        (Some(path), Some(expected)) => template::lookup(&value, path).is_some_and(|v| template::as_text(v) == expected),
        _ => true,
    }
}

#[cfg(test)]
mod tests;
