//! `fsdp-app finetune` as a user runs it: the step lines, metrics.jsonl and a model `generate`
//! loads; chat rows trained on their assistant turns as the model's template renders them.

mod common;

use common::training::{max_weight_diff, weights};
use common::*;

#[test]
fn finetune_cli_reports_steps_writes_metrics_and_a_model_generate_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen3", tmp.path());
    let data = tmp.path().join("text.jsonl");
    let rows: Vec<String> = (0..24)
        .map(|i| serde_json::json!({"text": format!("Row {i}: the quick brown fox jumps over the lazy dog {i} times.")}).to_string())
        .collect();
    std::fs::write(&data, rows.join("\n")).unwrap();
    let out = tmp.path().join("run");
    let o = run_cli(
        &[
            "finetune",
            "--model",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--output-dir",
            out.to_str().unwrap(),
            "--world-size",
            "2",
            "--seq-len",
            "16",
            "--batch-size",
            "2",
            "--max-steps",
            "3",
            "--lr",
            "1e-3",
            "--activation-checkpointing",
            "--warmup-steps",
            "1",
            "--lr-scheduler",
            "cosine",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let log = stderr(&o);
    for s in ["rank 0 holds", "rank 1 holds", "step     3 | loss", "tokens/s", "peak RSS", "fp32 master weights"] {
        assert!(log.contains(s), "missing {s:?} in:\n{log}");
    }
    let metrics: Vec<serde_json::Value> =
        std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(metrics.len(), 3);
    for (i, m) in metrics.iter().enumerate() {
        assert_eq!(m["step"], i + 1);
        for f in ["loss", "lr", "grad_norm", "tokens_per_s", "peak_rss_bytes"] {
            assert!(m[f].is_number(), "metrics row {i} lacks {f}: {m}");
        }
    }
    assert_eq!(metrics[0]["lr"], 0.0, "warmup starts at 0 like transformers");
    let g = run_cli(&["generate", "--model", out.to_str().unwrap(), "--prompt", "Row 1", "--max-new-tokens", "4", "--json"], &[]);
    assert!(g.status.success(), "{}", stderr(&g));
    // The exported weights are the trained ones, not the originals.
    assert!(max_weight_diff(&weights(&out), &weights(&model)) > 0.0);
}

#[test]
fn chat_rows_train_on_assistant_turns_rendered_with_the_models_template() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let data = tmp.path().join("chat.jsonl");
    let rows: Vec<String> = (0..8)
        .map(|i| {
            serde_json::json!({"messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": format!("What is {i} plus {i}?")},
                {"role": "assistant", "content": format!("It is {}.", 2 * i)},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(&data, rows.join("\n")).unwrap();
    let out = tmp.path().join("run");
    let o = run_cli(
        &[
            "finetune",
            "--model",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--output-dir",
            out.to_str().unwrap(),
            "--seq-len",
            "64",
            "--batch-size",
            "2",
            "--max-steps",
            "2",
            "--show-sample",
            "--world-size",
            "2",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let log = stderr(&o);
    // The template's system/user parts are masked; the assistant's answer (and its end token) is trained.
    assert!(
        log.contains("[masked]<|endoftext|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 0 plus 0?<|im_end|>\n<|im_start|>assistant\n[/masked]It is 0.<|im_end|>"),
        "{log}"
    );
    assert!(log.contains("data: 8 rows -> 8 samples of 64 tokens (0 skipped, 0 truncated)"), "{log}");
    assert!(log.contains("padding efficiency"), "{log}");
    // A file where nothing is trained on is refused before any weight is read.
    let none = tmp.path().join("none.jsonl");
    std::fs::write(&none, "{\"input_ids\": [1, 2, 3], \"labels\": [-100, -100, -100]}\n").unwrap();
    let o = run_cli(
        &[
            "finetune",
            "--model",
            model.to_str().unwrap(),
            "--data",
            none.to_str().unwrap(),
            "--output-dir",
            tmp.path().join("x").to_str().unwrap(),
            "--seq-len",
            "8",
        ],
        &[],
    );
    assert!(!o.status.success() && stderr(&o).contains("no token is trained on"), "{}", stderr(&o));
    // A turn's thinking this model's template would drop is refused by file and line, not
    // silently left untrained.
    let thinking = tmp.path().join("thinking.jsonl");
    let row = serde_json::json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning_content": "greet"}]});
    std::fs::write(&thinking, format!("{}\n{row}\n", rows[0])).unwrap();
    let args = ["finetune", "--model", model.to_str().unwrap(), "--data", thinking.to_str().unwrap(), "--output-dir"];
    let o = run_cli(&[&args[..], &[tmp.path().join("y").to_str().unwrap(), "--seq-len", "64"]].concat(), &[]);
    let e = stderr(&o);
    assert!(!o.status.success() && e.contains("thinking.jsonl:2") && e.contains("chat template writes no thinking"), "{e}");
}

/// `--chat-template` (TRL's `chat_template_path`): chat rows render with the given template
/// instead of the model's, and the trained model is written with it as its only template; a
/// file that is not there, or not a template, is named.
#[test]
fn chat_template_renders_the_rows_and_travels_with_the_trained_model() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let template =
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}";
    let file = tmp.path().join("plain.jinja");
    std::fs::write(&file, template).unwrap();
    let data = tmp.path().join("chat.jsonl");
    let row = serde_json::json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]});
    std::fs::write(&data, format!("{row}\n{row}\n")).unwrap();
    let run = |template: &str, out: &str| {
        let out = tmp.path().join(out);
        let args =
            ["finetune", "--model", model.to_str().unwrap(), "--data", data.to_str().unwrap(), "--output-dir", out.to_str().unwrap()];
        (run_cli(&[&args[..], &["--seq-len", "32", "--max-steps", "1", "--show-sample", "--chat-template", template]].concat(), &[]), out)
    };
    let (o, out) = run(file.to_str().unwrap(), "run");
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("[masked][user] Hi\n[assistant] [/masked]Hello\n"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(out.join("chat_template.jinja")).unwrap(), template);
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("tokenizer_config.json")).unwrap()).unwrap();
    assert!(config.get("chat_template").is_none() && config.get("eos_token").is_some(), "{config}");
    // Inline, as vLLM takes it.
    let (o, _) = run(template, "inline");
    assert!(o.status.success() && stderr(&o).contains("[assistant] [/masked]Hello"), "{}", stderr(&o));
    let (o, _) = run("/no/such.jinja", "missing");
    assert!(!o.status.success() && stderr(&o).contains("--chat-template /no/such.jinja: no such file"), "{}", stderr(&o));
    std::fs::write(&file, "{% for m in messages %}").unwrap();
    let (o, _) = run(file.to_str().unwrap(), "broken");
    assert!(!o.status.success() && stderr(&o).contains("not a template"), "{}", stderr(&o));
}
