//! Reading a list of function calls while it is being written: the complete elements of a JSON
//! array prefix (`[a, b, {"na` holds a and b). A forced call (`tool_choice: required`) keeps its
//! complete calls when `max_tokens` cuts the list, and the engine ends an answer as soon as it
//! repeats a call it already made (a small model would otherwise repeat it until `max_tokens`).

use serde_json::Value;

/// The complete top-level values of `text`: the elements of a JSON array so far (closed or
/// not), or `text` itself when it is not an array and parses whole.
pub fn complete_values(text: &str) -> Vec<Value> {
    let t = text.trim_start();
    let Some(body) = t.strip_prefix('[') else {
        return serde_json::from_str(t).ok().into_iter().collect();
    };
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    let (mut start, mut out) = (0usize, vec![]);
    let take = |from: usize, to: usize, out: &mut Vec<Value>| {
        let piece = body[from..to].trim();
        if let Ok(v) = serde_json::from_str(piece) {
            out.push(v);
        }
    };
    for (i, c) in body.char_indices() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' | '[' => depth += 1,
            '}' | ']' if depth > 0 => depth -= 1,
            ',' if depth == 0 => {
                take(start, i, &mut out);
                start = i + 1;
            }
            ']' => {
                take(start, i, &mut out);
                return out;
            }
            _ => {}
        }
    }
    out
}

/// A call's identity: its name and its arguments as canonical JSON (key order and spacing do
/// not make two calls different).
pub fn call_key(call: &Value) -> Option<(String, String)> {
    let name = call.get("name")?.as_str()?.to_string();
    let args = call.get("arguments").or_else(|| call.get("parameters")).cloned().unwrap_or(Value::Null);
    let args = match args {
        Value::String(s) => serde_json::from_str::<Value>(&s).unwrap_or(Value::String(s)),
        other => other,
    };
    Some((name, canonical(&args)))
}

fn canonical(v: &Value) -> String {
    match v {
        Value::Object(o) => {
            let mut keys: Vec<&String> = o.keys().collect();
            keys.sort();
            let fields: Vec<String> = keys.iter().map(|k| format!("{}:{}", Value::String((*k).clone()), canonical(&o[*k]))).collect();
            format!("{{{}}}", fields.join(","))
        }
        Value::Array(a) => format!("[{}]", a.iter().map(canonical).collect::<Vec<_>>().join(",")),
        other => other.to_string(),
    }
}

/// Whether the list of calls written so far repeats one (same name and arguments).
pub fn repeats_a_call(text: &str) -> bool {
    let mut seen = std::collections::HashSet::new();
    complete_values(text).iter().filter_map(call_key).any(|k| !seen.insert(k))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn complete_elements_of_a_cut_list_and_repeated_calls() {
        let a = r#"{"name": "f", "arguments": {"x": "a,]}"}}"#;
        let cut = format!("[{a}, {a}, {{\"name\": \"f\", \"argu");
        assert_eq!(complete_values(&cut).len(), 2);
        assert!(repeats_a_call(&cut));
        assert_eq!(complete_values(&format!("  [{a}]  ")), vec![serde_json::from_str::<Value>(a).unwrap()]);
        assert_eq!(complete_values("[").len(), 0);
        assert_eq!(complete_values(a).len(), 1, "a single call");
        assert_eq!(complete_values(r#"{"name": "f", "argu"#).len(), 0);
        let differ = r#"[{"name": "f", "arguments": {"x": 1, "y": 2}}, {"name": "f", "arguments": {"y": 2, "x": 1}}]"#;
        assert!(repeats_a_call(differ), "key order does not make a different call");
        assert!(!repeats_a_call(r#"[{"name": "f", "arguments": {"x": 1}}, {"name": "f", "arguments": {"x": 2}}]"#));
        assert_eq!(
            call_key(&json!({"name": "f", "arguments": "{\"b\": 1, \"a\": [1, 2]}"})),
            Some(("f".into(), r#"{"a":[1,2],"b":1}"#.into()))
        );
    }
}
