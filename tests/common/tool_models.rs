//! Models for the native tool-call tests: a qwen2 fixture with a chat template that renders
//! functions in one model family's own way (Hermes / Qwen, Llama 3.1, Mistral), fine-tuned by our
//! own `finetune` to answer the weather question with a call in that family's syntax and a
//! greeting with text, on prompts rendered exactly as the server renders them (the same template,
//! the same functions).

use std::path::{Path, PathBuf};

use fsdp_app::tokenize::{ChatMessage, ChatTemplate};
use serde_json::{json, Value};

use super::{fixture_with, run_cli, stderr};

/// The function every request declares (the trained prompts have exactly this JSON).
pub fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}])
}

pub const QUESTION: &str = "What is the weather in Paris?";
pub const GREETING: &str = "Hi";
pub const REPLY: &str = "Hello there!";

/// A model family's template and the call it is trained to write.
#[derive(Debug, Clone, Copy)]
pub enum Family {
    Hermes,
    Llama3,
    Mistral,
}

impl Family {
    pub fn template(self) -> &'static str {
        match self {
            // Qwen 2.5's shape: the functions in a system turn, calls in <tool_call> blocks.
            Self::Hermes => concat!(
                "{% if tools %}{{ '<|im_start|>system\\nYou may call functions.\\n<tools>\\n' }}{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}",
                "{{ '</tools>\\nTo call one, answer <tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}{% endif %}",
                "{% for m in messages %}{% if m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}",
                "{% elif m.tool_calls %}{{ '<|im_start|>assistant' }}{% for c in m.tool_calls %}{{ '\\n<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' }}{{ c.function.arguments | tojson }}{{ '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}",
                "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}",
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
            ),
            // Llama 3.1's shape: the functions in the last user turn, a call is the JSON answer.
            Self::Llama3 => concat!(
                "{{ bos_token }}{% for m in messages %}{% if loop.last and tools %}{{ '<|im_start|>user\\nGiven the following functions, respond with a JSON for a function call. ",
                "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.\\n' }}",
                "{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}{{ m.content + '<|im_end|>\\n' }}",
                "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}",
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
            ),
            // Mistral v0.3's shape: [AVAILABLE_TOOLS] before the last question, calls after [TOOL_CALLS].
            Self::Mistral => concat!(
                "{% for m in messages %}{% if m.role == 'user' %}{% if loop.last and tools %}{{ '[AVAILABLE_TOOLS] ' }}{{ tools | tojson }}{{ '[/AVAILABLE_TOOLS]' }}{% endif %}",
                "{{ '[INST] ' + m.content + ' [/INST]' }}{% elif m.tool_calls %}{{ '[TOOL_CALLS] ' }}{{ m.tool_calls | tojson }}{{ '<|im_end|>' }}",
                "{% elif m.role == 'tool' %}{{ '[TOOL_RESULTS] ' + m.content + '[/TOOL_RESULTS]' }}{% else %}{{ m.content + '<|im_end|>' }}{% endif %}{% endfor %}"
            ),
        }
    }

    /// The answer to `QUESTION` in the family's syntax.
    pub fn call(self) -> &'static str {
        match self {
            Self::Hermes => "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            Self::Llama3 => "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
            Self::Mistral => "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]",
        }
    }
}

/// The fixture of `family`, fine-tuned (see the module's comment); with `thinking`, its call
/// comes after `<think>{thinking}</think>\n\n`, as a reasoning model's does.
pub fn tool_model(root: &Path, family: Family, thinking: Option<&str>) -> PathBuf {
    let (base, tuned) = (root.join("base"), root.join("tuned"));
    // A vocabulary with room for Mistral's [TOOL_CALLS] special token after the tokenizer's own.
    fixture_with("qwen2", &base, &[("max_position_embeddings", 1024), ("vocab_size", 400)]);
    std::fs::write(base.join("chat_template.jinja"), family.template()).unwrap();
    let tokenizer_path = base.join("tokenizer.json");
    if let Family::Mistral = family {
        let mut t: Value = serde_json::from_str(&std::fs::read_to_string(&tokenizer_path).unwrap()).unwrap();
        let id = t["model"]["vocab"].as_object().unwrap().len();
        t["added_tokens"].as_array_mut().unwrap().push(json!({"id": id, "content": "[TOOL_CALLS]", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}));
        std::fs::write(&tokenizer_path, t.to_string()).unwrap();
    }
    let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path).unwrap();
    let template = ChatTemplate::new(family.template(), Some("<|endoftext|>".into()), Some("<|im_end|>".into())).unwrap();
    let end = tokenizer.token_to_id("<|im_end|>").unwrap();
    let mut rows = String::new();
    let call = thinking.map(|t| format!("<think>{t}</think>\n\n")).unwrap_or_default() + family.call();
    for (question, answer) in [(QUESTION, call.as_str()), (GREETING, REPLY)] {
        let prompt = template.render_with(&[ChatMessage::new("user", question)], Some(&tools()), true, &Default::default()).unwrap();
        let prompt_ids = tokenizer.encode(prompt.as_str(), false).unwrap().get_ids().to_vec();
        let mut answer_ids = tokenizer.encode(answer, false).unwrap().get_ids().to_vec();
        answer_ids.push(end);
        let labels: Vec<i64> = prompt_ids.iter().map(|_| -100).chain(answer_ids.iter().map(|&i| i as i64)).collect();
        let ids: Vec<u32> = prompt_ids.into_iter().chain(answer_ids).collect();
        rows += &format!("{}\n", json!({"input_ids": ids, "labels": labels})).repeat(4);
    }
    let data = root.join("rows.jsonl");
    std::fs::write(&data, rows).unwrap();
    let o = run_cli(
        &["finetune", "--model", base.to_str().unwrap(), "--data", data.to_str().unwrap(), "--output-dir", tuned.to_str().unwrap()]
            .into_iter()
            .chain(["--seq-len", "512", "--max-steps", "60", "--lr", "3e-3", "--lr-scheduler", "constant"])
            .collect::<Vec<_>>(),
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    tuned
}
