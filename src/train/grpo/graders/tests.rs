//! Each grader against hand-computed scores.

use serde_json::json;

use super::*;

fn grade(grader: serde_json::Value, outputs: &[&str], item: serde_json::Value) -> Result<Scores> {
    let g = Grader::from_json(&grader)?;
    let inputs: Vec<GradeInput> = outputs.iter().map(|o| GradeInput { output_text: o, item: &item }).collect();
    g.check_item(&item)?;
    g.score(&inputs)
}

#[test]
fn string_check_operations() {
    let item = json!({"answer": "42"});
    let check = |op: &str| {
        let g = json!({"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": "{{item.answer}}", "operation": op});
        grade(g, &["42", "The answer is 42", "forty"], item.clone()).unwrap().total
    };
    assert_eq!(check("eq"), vec![1.0, 0.0, 0.0]);
    assert_eq!(check("ne"), vec![0.0, 1.0, 1.0]);
    assert_eq!(check("like"), vec![1.0, 1.0, 0.0]);
    let g = json!({"type": "string_check", "input": "{{sample.output_text}}", "reference": "ANSWER {{item.answer}}", "operation": "ilike"});
    assert_eq!(grade(g, &["the answer 42.", "answer: 42"], item).unwrap().total, vec![1.0, 0.0]);
}

#[test]
fn similarity_metrics_by_hand() {
    // LCS("kitten", "sitting") = 4 ("ittn"): 2 * 4 / 13.
    assert!((fuzzy_match("kitten", "sitting") - 8.0 / 13.0).abs() < 1e-12);
    assert_eq!(fuzzy_match("", ""), 1.0);
    // ROUGE-1: {the, cat, sat} vs {the, cat, ran}: P = R = 2/3. ROUGE-2: (the cat) only: 1/2.
    assert!((rouge("The cat sat", "the cat ran", Some(1)) - 2.0 / 3.0).abs() < 1e-12);
    assert!((rouge("The cat sat", "the cat ran", Some(2)) - 0.5).abs() < 1e-12);
    // ROUGE-L: LCS (a, c) = 2 of 3 and 4 tokens: P 2/3, R 1/2, F = 4/7.
    assert!((rouge("a b c", "a c d e", None) - 4.0 / 7.0).abs() < 1e-12);
    assert_eq!(bleu("same words here", "same words here"), 1.0);
    assert_eq!(bleu("", "x"), 0.0);
}

#[test]
fn json_schema_grader_checks_shape_and_field() {
    let item = json!({"answer": 7});
    let g = json!({"type": "json_schema", "name": "shape",
        "schema": {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"], "additionalProperties": false},
        "field": "answer", "reference": "{{item.answer}}"});
    let s = grade(g, &["{\"answer\": 7}", "{\"answer\": 8}", "{\"answer\": 7, \"x\": 1}", "not json", " {\"answer\":7} "], item).unwrap();
    assert_eq!(s.total, vec![1.0, 0.0, 0.0, 0.0, 1.0]);
    let bad = json!({"type": "json_schema", "schema": {"type": "string", "pattern": "a+"}});
    let err = format!("{:#}", Grader::from_json(&bad).unwrap_err());
    assert!(err.contains("grader.schema") && err.contains("`pattern`"), "{err}");
}

#[test]
fn multi_combines_named_graders() {
    let item = json!({"answer": "4"});
    let g = json!({"type": "multi", "name": "both",
        "graders": {
            "exact": {"type": "string_check", "input": "{{sample.output_text}}", "reference": "{{item.answer}}", "operation": "eq"},
            "has": {"type": "string_check", "input": "{{sample.output_text}}", "reference": "{{item.answer}}", "operation": "like"}
        },
        "calculate_output": "0.75 * exact + 0.25 * max(has, 0) - (1 - has) / 2"});
    let s = grade(g, &["4", "is 4", "5"], item).unwrap();
    assert_eq!(s.total, vec![1.0, 0.25, -0.5]);
    assert_eq!(s.by_grader.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["both", "exact", "has"]);
    let unknown = json!({"type": "multi", "graders": {"a": {"type": "string_check", "input": "x", "reference": "y", "operation": "eq"}},
        "calculate_output": "a + b"});
    let err = format!("{:#}", Grader::from_json(&unknown).unwrap_err());
    assert!(err.contains("grader.calculate_output") && err.contains("`b` names no grader"), "{err}");
}

#[test]
fn bad_graders_name_the_field() {
    let cases = [
        (json!({"type": "string_check", "input": "{{sample.output_text}}", "reference": "x", "operation": "contains"}), "grader.operation"),
        (json!({"type": "text_similarity", "input": "a", "reference": "b", "evaluation_metric": "meteor"}), "grader.evaluation_metric"),
        (json!({"type": "python", "source": "x"}), "grader.type"),
        (json!({"type": "string_check", "input": "{{sample.text}}", "reference": "x", "operation": "eq"}), "grader.input"),
        (json!({"type": "string_check", "input": "a", "reference": "b", "operation": "eq", "extra": 1}), "grader.extra"),
        (json!({"type": "command", "command": []}), "grader.command"),
    ];
    for (g, field) in cases {
        let err = format!("{:#}", Grader::from_json(&g).unwrap_err());
        assert!(err.contains(field), "{field}: {err}");
    }
    let g = Grader::from_json(&json!({"type": "string_check", "input": "a", "reference": "{{item.answer}}", "operation": "eq"})).unwrap();
    let err = format!("{:#}", g.check_item(&json!({"solution": 1})).unwrap_err());
    assert!(err.contains("no field `answer`"), "{err}");
}

fn command(script: &str, timeout_s: f64) -> serde_json::Value {
    json!({"type": "command", "name": "prog", "command": ["sh", "-c", script], "timeout_s": timeout_s})
}

#[test]
fn command_grader_reads_one_score_per_line() {
    // Scores each sample by its output's length, from the JSON line it reads.
    let script = "while read -r line; do echo \"$line\" | grep -c '\"output_text\":\"ab\"' || true; done";
    let s = grade(command(script, 10.0), &["ab", "abc", "ab"], json!({"k": 1})).unwrap();
    assert_eq!(s.total, vec![1.0, 0.0, 1.0]);
}

#[test]
fn command_grader_failures_are_named() {
    let err = |script: &str, timeout: f64| format!("{:#}", grade(command(script, timeout), &["a", "b"], json!({})).unwrap_err());
    let e = err("cat > /dev/null; echo boom >&2; exit 3", 10.0);
    assert!(e.contains("grader \"prog\"") && e.contains("exit status: 3") && e.contains("boom"), "{e}");
    let e = err("sleep 5", 0.2);
    assert!(e.contains("within 0.2s") && e.contains("timeout_s"), "{e}");
    let e = err("cat > /dev/null; echo 1", 10.0);
    assert!(e.contains("1 score lines for 2 samples"), "{e}");
    let e = err("cat > /dev/null; echo 1; echo x", 10.0);
    assert!(e.contains("output line 2") && e.contains("\"x\""), "{e}");
    let missing = json!({"type": "command", "command": ["/no/such/grader"]});
    let e = format!("{:#}", grade(missing, &["a"], json!({})).unwrap_err());
    assert!(e.contains("cannot start"), "{e}");
}
