//! A reasoning model for the tests: a qwen3 fixture that our own `finetune` teaches to think
//! before it answers, as Qwen3 does, with Qwen3's chat template's thinking switch.

use std::path::{Path, PathBuf};

use serde_json::json;

use super::{run_cli, stderr};

/// Qwen3's chat template's turns and generation prompt (its thinking switch included). A turn's
/// `reasoning_content` is written as a think block before its content on every turn, as
/// templates that keep thinking in the history do (Qwen3's own keeps only the current turn's).
pub const QWEN3_TEMPLATE: &str = r#"{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' }}{%- if message.reasoning_content %}{{- '<think>' + message.reasoning_content + '</think>' }}{%- endif %}{{- message.content + '<|im_end|>\n' }}{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"#;

pub const THINKING: &str = "\nplan a greeting\n";
pub const ANSWER: &str = "\n\nHello there!";

/// A qwen3 fixture fine-tuned until its greedy answer to "Hi" is `<think>THINKING</think>ANSWER`.
pub fn thinking_model(root: &Path) -> PathBuf {
    let (base, tuned) = (root.join("base"), root.join("tuned"));
    // A context long enough for the generic tool prompt (the template renders no tools itself).
    let o = run_cli(&["fixture", "--name", "qwen3", "--out", base.to_str().unwrap(), "--set", "max_position_embeddings=1024"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::write(base.join("chat_template.jinja"), QWEN3_TEMPLATE).unwrap();
    // The thinking as reasoning datasets carry it (`reasoning_content`), which the template
    // writes before the answer: `<think>THINKING</think>ANSWER` is what the model learns.
    let row =
        json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ANSWER, "reasoning_content": THINKING}]});
    let data = root.join("rows.jsonl");
    std::fs::write(&data, format!("{row}\n").repeat(4)).unwrap();
    let o = run_cli(
        &["finetune", "--model", base.to_str().unwrap(), "--data", data.to_str().unwrap(), "--output-dir", tuned.to_str().unwrap()]
            .into_iter()
            .chain(["--seq-len", "64", "--max-steps", "40", "--lr", "3e-3", "--lr-scheduler", "constant"])
            .collect::<Vec<_>>(),
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    tuned
}
