//! The JSON schemas constrained decoding enforces: tightened where the user's schema is silent,
//! and composed (a list of calls around each function's parameters) without breaking its
//! references.
//!
//! Small models fill every freedom a grammar leaves: undeclared keys, the same key again,
//! integers of a hundred digits. So where a schema says nothing, [`tighten`] closes it:
//! - an object schema that declares `properties` and says nothing of `additionalProperties` gets
//!   `additionalProperties: false`: the answer holds the declared properties only, each at most
//!   once (the grammar writes them in declared order). Opt out with `additionalProperties: true`
//!   (or a schema for the extra values);
//! - an `integer` with no bound on a side gets that side of [`INTEGER_BOUND`], so it fits an i64
//!   (and ends within 20 characters). Opt out with your own `minimum` / `maximum`.
//!
//! [`embed`] puts a root schema (with its own `$defs` and `$ref`s, as pydantic writes them) inside
//! another one's `$defs`: its definitions move beside it under prefixed names and every local
//! `$ref` (`#`, `#/$defs/X`, `#/definitions/X`, any other `#/...` pointer) is rewritten to where
//! its target went, so the schema means in the wrapper what it meant alone.

use serde_json::{json, Map, Value};

/// The bound a silent `integer` gets on each side: 2^63 - 1024, the largest magnitude inside
/// the i64 range that an f64 holds exactly (the grammar engine reads bounds as f64; 2^63 - 1
/// would round up past i64::MAX).
pub const INTEGER_BOUND: i64 = i64::MAX - 1023;

/// Keywords whose value is a schema.
const SCHEMA_KEYS: &[&str] = &["items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames", "unevaluatedItems"];
/// Keywords whose value is a list of schemas.
const SCHEMA_LIST_KEYS: &[&str] = &["anyOf", "allOf", "oneOf", "prefixItems"];
/// Keywords whose value maps names to schemas.
const SCHEMA_MAP_KEYS: &[&str] = &["properties", "patternProperties", "$defs", "definitions", "dependentSchemas"];

/// `schema` with the silent places closed (see the module's comment).
pub fn tighten(schema: &Value) -> Value {
    let mut out = schema.clone();
    tighten_in_place(&mut out);
    out
}

fn tighten_in_place(schema: &mut Value) {
    let Value::Object(o) = schema else { return };
    if o.contains_key("properties") && !o.contains_key("additionalProperties") && !o.contains_key("unevaluatedProperties") {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    if is_integer(o) {
        if !o.contains_key("minimum") && !o.contains_key("exclusiveMinimum") {
            o.insert("minimum".into(), json!(-INTEGER_BOUND));
        }
        if !o.contains_key("maximum") && !o.contains_key("exclusiveMaximum") {
            o.insert("maximum".into(), json!(INTEGER_BOUND));
        }
    }
    for_each_subschema(o, &mut tighten_in_place);
}

/// Whether the schema object says its value is an integer (alone, or among other types).
fn is_integer(o: &Map<String, Value>) -> bool {
    match o.get("type") {
        Some(Value::String(t)) => t == "integer",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "integer"),
        _ => false,
    }
}

/// Calls `f` on every direct subschema of `o` (properties, items, anyOf, $defs, ...).
fn for_each_subschema(o: &mut Map<String, Value>, f: &mut dyn FnMut(&mut Value)) {
    for (k, v) in o.iter_mut() {
        let k = k.as_str();
        if SCHEMA_KEYS.contains(&k) || k == "additionalProperties" || k == "unevaluatedProperties" {
            f(v); // a boolean here is left as it is
        } else if SCHEMA_LIST_KEYS.contains(&k) {
            v.as_array_mut().into_iter().flatten().for_each(&mut *f);
        } else if SCHEMA_MAP_KEYS.contains(&k) {
            v.as_object_mut().into_iter().flat_map(|m| m.values_mut()).for_each(&mut *f);
        }
    }
}

/// Moves root schema `schema` into `defs` as `defs[name]`, its own `$defs` / `definitions`
/// beside it as `defs["{name}.{X}"]`, every local `$ref` rewritten; returns the schema that
/// refers to it (`{"$ref": "#/$defs/NAME"}`). The wrapper must put `defs` at its root's `$defs`.
pub fn embed(schema: &Value, name: &str, defs: &mut Map<String, Value>) -> Value {
    let mut root = schema.clone();
    let mut own: Vec<(String, Value)> = vec![];
    if let Value::Object(o) = &mut root {
        for key in ["$defs", "definitions"] {
            if let Some(Value::Object(d)) = o.remove(key) {
                own.extend(d);
            }
        }
    }
    rewrite_refs(&mut root, name);
    for (def, mut value) in own {
        rewrite_refs(&mut value, name);
        defs.insert(format!("{name}.{def}"), value);
    }
    defs.insert(name.to_string(), root);
    json!({"$ref": format!("#/$defs/{name}")})
}

/// Rewrites every local `$ref` below `v` for a root schema that moved to `#/$defs/NAME` (see
/// [`embed`]).
fn rewrite_refs(v: &mut Value, name: &str) {
    match v {
        Value::Object(o) => {
            if let Some(Value::String(r)) = o.get_mut("$ref") {
                *r = moved_ref(r, name);
            }
            for (k, sub) in o.iter_mut() {
                // `enum` / `const` / `default` / `examples` hold values, not schemas.
                if !matches!(k.as_str(), "$ref" | "enum" | "const" | "default" | "examples") {
                    rewrite_refs(sub, name);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| rewrite_refs(x, name)),
        _ => {}
    }
}

/// Where local reference `r` of a root schema points once the root is `#/$defs/NAME` and its
/// definitions `#/$defs/NAME.X`; a reference to another document stays as it is.
fn moved_ref(r: &str, name: &str) -> String {
    let Some(pointer) = r.strip_prefix('#') else { return r.to_string() };
    for key in ["/$defs/", "/definitions/"] {
        if let Some(rest) = pointer.strip_prefix(key) {
            let (def, tail) = rest.split_once('/').map_or((rest, String::new()), |(d, t)| (d, format!("/{t}")));
            return format!("#/$defs/{name}.{def}{tail}");
        }
    }
    format!("#/$defs/{name}{pointer}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silent_objects_close_and_silent_integers_fit_64_bits() {
        let s = json!({"type": "object", "properties": {
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"t": {"type": ["integer", "null"], "minimum": 0}}}},
            "extra": {"type": "object", "properties": {}, "additionalProperties": true},
            "free": {"type": "object"}}});
        let t = tighten(&s);
        assert_eq!(t["additionalProperties"], false);
        assert_eq!(
            (&t["properties"]["age"]["minimum"], &t["properties"]["age"]["maximum"]),
            (&json!(-INTEGER_BOUND), &json!(INTEGER_BOUND))
        );
        assert_eq!(INTEGER_BOUND as f64 as i64, INTEGER_BOUND, "exact as an f64");
        let item = &t["properties"]["tags"]["items"];
        assert_eq!(
            (&item["additionalProperties"], &item["properties"]["t"]["minimum"], &item["properties"]["t"]["maximum"]),
            (&json!(false), &json!(0), &json!(INTEGER_BOUND))
        );
        assert_eq!(t["properties"]["extra"]["additionalProperties"], true, "an explicit choice stays");
        assert!(t["properties"]["free"].get("additionalProperties").is_none(), "an object that declares no properties is free-form");
    }

    #[test]
    fn an_embedded_schema_keeps_its_references() {
        let s = json!({"$defs": {"Item": {"type": "object", "properties": {"sub": {"$ref": "#/$defs/Item"}, "root": {"$ref": "#"}}}},
                       "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}, "same": {"$ref": "#/properties/item"},
                       "legacy": {"$ref": "#/definitions/Old/properties/x"}, "e": {"enum": [{"$ref": "#"}]}},
                       "definitions": {"Old": {"type": "object", "properties": {"x": {"type": "string"}}}}});
        let mut defs = Map::new();
        let wrapper_ref = embed(&s, "f", &mut defs);
        assert_eq!(wrapper_ref, json!({"$ref": "#/$defs/f"}));
        let root = &defs["f"];
        assert!(root.get("$defs").is_none() && root.get("definitions").is_none());
        assert_eq!(root["properties"]["item"]["$ref"], "#/$defs/f.Item");
        assert_eq!(root["properties"]["same"]["$ref"], "#/$defs/f/properties/item");
        assert_eq!(root["properties"]["legacy"]["$ref"], "#/$defs/f.Old/properties/x");
        assert_eq!(root["properties"]["e"]["enum"][0]["$ref"], "#", "values are not schemas");
        assert_eq!(defs["f.Item"]["properties"]["sub"]["$ref"], "#/$defs/f.Item");
        assert_eq!(defs["f.Item"]["properties"]["root"]["$ref"], "#/$defs/f");
        assert_eq!(moved_ref("https://example.com/s.json", "f"), "https://example.com/s.json");
    }
}
