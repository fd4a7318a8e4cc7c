//! vLLM's structured outputs on completions and chat: `structured_outputs` with one of `json`,
//! `regex`, `choice`, `grammar` or `json_object`, and the older top-level `guided_json`,
//! `guided_regex`, `guided_choice` and `guided_grammar` that scripts written for vLLM before
//! 0.12 still send (through the `openai` client's `extra_body`), and llama.cpp's server's
//! top-level `grammar` and `json_schema`. A grammar is llguidance's Lark (vLLM's guidance
//! backend) or GBNF (llama.cpp's, and vLLM's docs' examples), told apart by `::=`
//! (`generate::gbnf`).

use serde_json::Value;

use super::super::error::ApiError;
use super::super::fields;
use crate::generate::constraint::OutputFormat;
use crate::generate::gbnf;

/// The body fields this module reads (completions and chat accept them).
pub const FIELDS: &[&str] = &[
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "grammar",
    "json_schema",
];

/// Top-level fields that are one kind of `structured_outputs` on their own: vLLM's older
/// spellings, and llama.cpp's server's.
const TOP_LEVEL: &[(&str, &str)] = &[
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
    ("grammar", "grammar"),
    ("json_schema", "json"),
];

/// What one of `structured_outputs`' kinds asks for.
const KINDS: &[&str] = &["json", "regex", "choice", "grammar", "json_object"];

/// `structured_outputs`' other keys: vLLM's switches of its own engines. Ours always writes
/// JSON without free whitespace and holds objects to the properties a schema names where it
/// says nothing (`constraint::compact_json`), and has no fallback engine, so they change nothing.
const SWITCHES: &[&str] = &["disable_fallback", "disable_any_whitespace", "disable_additional_properties"];

/// A request's structured output and the parameter it came from (named in its errors).
pub struct Requested {
    pub format: OutputFormat,
    pub param: String,
}

/// The structured output `v` asks for through vLLM's fields, if any.
pub fn read(v: &Value, lenient: bool, ignored: &mut Vec<String>) -> Result<Option<Requested>, ApiError> {
    let given = |k: &str| v.get(k).filter(|x| !x.is_null());
    let top: Vec<&(&str, &str)> = TOP_LEVEL.iter().filter(|(k, _)| given(k).is_some()).collect();
    if let Some(b) = given("guided_decoding_backend").filter(|b| !b.is_string()) {
        return Err(ApiError::invalid("guided_decoding_backend", format!("`guided_decoding_backend` must be a string, got {b}.")));
    }
    match (given("structured_outputs"), top.as_slice()) {
        (None, []) => Ok(None),
        (Some(_), [(k, _), ..]) => {
            Err(ApiError::invalid(k, format!("`{k}` and `structured_outputs` both constrain the answer; send one.")))
        }
        (None, [(a, _), (b, _), ..]) => Err(ApiError::invalid(b, format!("`{a}` and `{b}` both constrain the answer; send one."))),
        (None, [(k, what)]) => kind(k, what, &v[*k]).map(Some),
        (Some(so), []) => {
            const P: &str = "structured_outputs";
            if !so.is_object() {
                return Err(ApiError::invalid(P, "`structured_outputs` must be an object such as {\"choice\": [\"yes\", \"no\"]}."));
            }
            // `whitespace_pattern` and `structural_tag` are refused as not implemented (`fields`).
            ignored.extend(fields::check_lists(so, &[KINDS, SWITCHES], P, lenient)?);
            for k in SWITCHES {
                if so.get(*k).is_some_and(|x| !x.is_null() && !x.is_boolean()) {
                    return Err(ApiError::invalid(&format!("{P}.{k}"), format!("`{k}` must be a boolean.")));
                }
            }
            let kinds: Vec<&str> = KINDS.iter().copied().filter(|k| so.get(*k).is_some_and(|x| !x.is_null())).collect();
            match kinds.as_slice() {
                [] => Err(ApiError::invalid(P, format!("`structured_outputs` needs one of {}.", KINDS.join(", ")))),
                [k] => kind(&format!("{P}.{k}"), k, &so[*k]).map(Some),
                [a, b, ..] => {
                    Err(ApiError::invalid(&format!("{P}.{b}"), format!("`{a}` and `{b}` both constrain the answer; send one of them.")))
                }
            }
        }
    }
}

/// One kind of constraint (`json`, `regex`, ...) with its value, `param` naming it.
fn kind(param: &str, kind: &str, value: &Value) -> Result<Requested, ApiError> {
    let bad = |what: &str| ApiError::invalid(param, format!("`{param}` must be {what}."));
    let format = match (kind, value) {
        ("json", Value::Object(_)) => OutputFormat::JsonSchema(value.clone()),
        // vLLM takes the schema as JSON text too.
        ("json", Value::String(s)) => match serde_json::from_str(s) {
            Ok(schema @ Value::Object(_)) => OutputFormat::JsonSchema(schema),
            _ => return Err(bad("a JSON schema (an object, or its JSON text)")),
        },
        ("json", _) => return Err(bad("a JSON schema (an object, or its JSON text)")),
        ("json_object", Value::Bool(true)) => OutputFormat::JsonObject,
        ("json_object", _) => return Err(bad("true")),
        ("regex", Value::String(r)) if !r.is_empty() => OutputFormat::Regex(r.clone()),
        ("regex", _) => return Err(bad("a regular expression (a non-empty string)")),
        ("choice", Value::Array(items)) if !items.is_empty() => {
            let choices = items.iter().map(|c| c.as_str().map(|s| serde_json::to_string(s).expect("a string"))).collect::<Option<Vec<_>>>();
            let choices = choices.ok_or_else(|| bad("a non-empty list of strings"))?;
            OutputFormat::Lark(format!("start: {}\n", choices.join(" | ")))
        }
        ("choice", _) => return Err(bad("a non-empty list of strings")),
        ("grammar", Value::String(g)) if !g.trim().is_empty() => match gbnf::is_gbnf(g) {
            true => OutputFormat::Lark(
                gbnf::to_lark(g).map_err(|e| ApiError::invalid(param, format!("The GBNF grammar cannot be used: {e:#}.")))?,
            ),
            false => OutputFormat::Lark(g.clone()),
        },
        ("grammar", _) => return Err(bad("a grammar (a non-empty string: Lark, or GBNF with `::=`)")),
        _ => unreachable!("`{kind}` is one of KINDS"),
    };
    Ok(Requested { format, param: param.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn param(v: Value) -> String {
        read(&v, false, &mut vec![]).err().unwrap().param.unwrap()
    }

    #[test]
    fn each_kind_reads_from_either_spelling() {
        let format = |v: Value| read(&v, false, &mut vec![]).unwrap().unwrap().format;
        let lark = OutputFormat::Lark("start: \"yes\" | \"no \\\"maybe\\\"\"\n".into());
        assert_eq!(format(json!({"structured_outputs": {"choice": ["yes", "no \"maybe\""]}})), lark);
        assert_eq!(format(json!({"guided_choice": ["yes", "no \"maybe\""]})), lark);
        assert_eq!(format(json!({"guided_regex": "[0-9]+"})), OutputFormat::Regex("[0-9]+".into()));
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(format(json!({"structured_outputs": {"json": schema.to_string()}})), OutputFormat::JsonSchema(schema.clone()));
        assert_eq!(format(json!({"guided_json": schema, "guided_decoding_backend": "guidance"})), OutputFormat::JsonSchema(schema));
        assert_eq!(format(json!({"structured_outputs": {"json_object": true, "disable_any_whitespace": true}})), OutputFormat::JsonObject);
        assert_eq!(format(json!({"structured_outputs": {"grammar": "start: \"a\"+"}})), OutputFormat::Lark("start: \"a\"+".into()));
        // llama.cpp's server's fields.
        assert_eq!(format(json!({"grammar": "start: \"a\"+"})), OutputFormat::Lark("start: \"a\"+".into()));
        assert_eq!(format(json!({"json_schema": {}})), OutputFormat::JsonSchema(json!({})));
        let Ok(Some(Requested { format: OutputFormat::Lark(g), param })) =
            read(&json!({"guided_grammar": "root ::= \"a\"+"}), false, &mut vec![])
        else {
            panic!()
        };
        assert_eq!((g.as_str(), param.as_str()), ("start: \"a\" +\n", "guided_grammar"));
        assert!(read(&json!({"structured_outputs": null, "guided_json": null}), false, &mut vec![]).unwrap().is_none());
    }

    #[test]
    fn conflicts_and_bad_values_are_named() {
        assert_eq!(param(json!({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]})), "guided_choice");
        assert_eq!(param(json!({"guided_regex": "a", "guided_choice": ["a"]})), "guided_choice");
        assert_eq!(param(json!({"guided_grammar": "start: \"a\"", "grammar": "start: \"a\""})), "grammar");
        assert_eq!(param(json!({"structured_outputs": {"regex": "a", "choice": ["a"]}})), "structured_outputs.choice");
        assert_eq!(param(json!({"structured_outputs": {}})), "structured_outputs");
        assert_eq!(param(json!({"structured_outputs": {"choice": []}})), "structured_outputs.choice");
        assert_eq!(param(json!({"structured_outputs": {"choice": ["a", 1]}})), "structured_outputs.choice");
        assert_eq!(param(json!({"structured_outputs": {"json": "{not json"}})), "structured_outputs.json");
        assert_eq!(param(json!({"structured_outputs": {"grammar": "root ::= x"}})), "structured_outputs.grammar");
        assert_eq!(
            param(json!({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}})),
            "structured_outputs.whitespace_pattern"
        );
        assert_eq!(param(json!({"structured_outputs": {"structural_tag": "{}"}})), "structured_outputs.structural_tag");
        assert_eq!(param(json!({"structured_outputs": {"regex": "a", "backend": "x"}})), "structured_outputs.backend");
        assert_eq!(param(json!({"structured_outputs": {"regex": "a", "disable_fallback": 1}})), "structured_outputs.disable_fallback");
        let mut ignored = vec![];
        read(&json!({"structured_outputs": {"regex": "a", "backend": "x", "whitespace_pattern": " "}}), true, &mut ignored).unwrap();
        assert_eq!(ignored, ["structured_outputs.backend", "structured_outputs.whitespace_pattern"]);
    }
}
