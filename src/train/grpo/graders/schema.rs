//! The JSON Schema subset the `json_schema` grader checks outputs against: `type`, `enum`,
//! `const`, `properties`, `required`, `additionalProperties`, `items`, `minItems` / `maxItems`,
//! `minLength` / `maxLength`, `minimum` / `maximum` (and their exclusive forms), `anyOf`,
//! `allOf`, `oneOf`, `not` and local `$ref`s. A schema using any other keyword is refused when
//! the grader is read, so nothing in it is silently ignored.

use anyhow::{bail, Result};
use serde_json::Value;

const KEYWORDS: &[&str] = &[
    "type",
    "enum",
    "const",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "anyOf",
    "allOf",
    "oneOf",
    "not",
    "$ref",
    "$defs",
    "definitions",
    // Annotations: they constrain nothing.
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
];

/// Refuses keywords outside the subset, naming where they are.
pub fn check_supported(schema: &Value) -> Result<()> {
    check_at(schema, "")
}

fn check_at(schema: &Value, at: &str) -> Result<()> {
    let Some(obj) = schema.as_object() else {
        return match schema {
            Value::Bool(_) => Ok(()),
            _ => bail!("{}: a schema is an object or a boolean", where_(at)),
        };
    };
    for (k, v) in obj {
        if !KEYWORDS.contains(&k.as_str()) {
            bail!("{}: the keyword `{k}` is not checked by this grader (it checks: {})", where_(at), KEYWORDS.join(", "));
        }
        let here = format!("{at}/{k}");
        match k.as_str() {
            "properties" | "$defs" | "definitions" => {
                for (name, s) in v.as_object().into_iter().flatten() {
                    check_at(s, &format!("{here}/{name}"))?;
                }
            }
            "items" | "additionalProperties" | "not" => check_at(v, &here)?,
            "anyOf" | "allOf" | "oneOf" => {
                for (i, s) in v.as_array().into_iter().flatten().enumerate() {
                    check_at(s, &format!("{here}/{i}"))?;
                }
            }
            "$ref" if !v.as_str().is_some_and(|r| r.starts_with('#')) => bail!("{here}: only local references (#/...) are followed"),
            _ => {}
        }
    }
    Ok(())
}

fn where_(at: &str) -> String {
    if at.is_empty() {
        "the schema".to_string()
    } else {
        format!("the schema at {at}")
    }
}

/// Whether `v` matches `schema`; `root` resolves `$ref`s.
pub fn matches(v: &Value, schema: &Value, root: &Value) -> bool {
    let obj = match schema {
        Value::Bool(b) => return *b,
        Value::Object(o) => o,
        _ => return false,
    };
    obj.iter().all(|(k, s)| match k.as_str() {
        "type" => match s {
            Value::String(t) => has_type(v, t),
            Value::Array(ts) => ts.iter().filter_map(Value::as_str).any(|t| has_type(v, t)),
            _ => false,
        },
        "enum" => s.as_array().is_some_and(|a| a.iter().any(|x| same(x, v))),
        "const" => same(s, v),
        "properties" => match (v, s) {
            (Value::Object(o), Value::Object(props)) => props.iter().all(|(name, ps)| o.get(name).is_none_or(|x| matches(x, ps, root))),
            _ => true,
        },
        "required" => match v {
            Value::Object(o) => s.as_array().into_iter().flatten().filter_map(Value::as_str).all(|r| o.contains_key(r)),
            _ => true,
        },
        "additionalProperties" => match v {
            Value::Object(o) => {
                let declared = obj.get("properties").and_then(Value::as_object);
                o.iter().filter(|(name, _)| declared.is_none_or(|d| !d.contains_key(*name))).all(|(_, x)| matches(x, s, root))
            }
            _ => true,
        },
        "items" => match v {
            Value::Array(a) => a.iter().all(|x| matches(x, s, root)),
            _ => true,
        },
        "minItems" | "maxItems" => match (v, s.as_u64()) {
            (Value::Array(a), Some(n)) => bound(k, a.len() as u64, n),
            _ => true,
        },
        "minLength" | "maxLength" => match (v, s.as_u64()) {
            (Value::String(t), Some(n)) => bound(k, t.chars().count() as u64, n),
            _ => true,
        },
        "minimum" | "maximum" | "exclusiveMinimum" | "exclusiveMaximum" => match (v.as_f64(), s.as_f64()) {
            (Some(x), Some(b)) => match k.as_str() {
                "minimum" => x >= b,
                "maximum" => x <= b,
                "exclusiveMinimum" => x > b,
                _ => x < b,
            },
            _ => true,
        },
        "anyOf" => s.as_array().is_some_and(|a| a.iter().any(|x| matches(v, x, root))),
        "allOf" => s.as_array().is_some_and(|a| a.iter().all(|x| matches(v, x, root))),
        "oneOf" => s.as_array().is_some_and(|a| a.iter().filter(|x| matches(v, x, root)).count() == 1),
        "not" => !matches(v, s, root),
        "$ref" => s.as_str().and_then(|r| resolve(root, r)).is_some_and(|target| matches(v, target, root)),
        _ => true,
    })
}

fn bound(keyword: &str, n: u64, limit: u64) -> bool {
    if keyword.starts_with("min") {
        n >= limit
    } else {
        n <= limit
    }
}

fn has_type(v: &Value, t: &str) -> bool {
    match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        "number" => v.is_number(),
        "integer" => v.as_f64().is_some_and(|x| x.fract() == 0.0),
        _ => false,
    }
}

/// JSON equality with numbers compared by value (1 and 1.0 are the same).
fn same(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// A local `$ref` (`#`, `#/$defs/X`, any `#/...` pointer).
fn resolve<'a>(root: &'a Value, reference: &str) -> Option<&'a Value> {
    root.pointer(reference.strip_prefix('#')?)
}
