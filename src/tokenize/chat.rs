//! Chat templates rendered with minijinja the way transformers renders them with jinja2:
//! `trim_blocks`, `lstrip_blocks`, `raise_exception`, a Python-style `tojson`, `strftime_now`,
//! and Python string/dict methods (`.strip()`, `.items()`, ...).

use std::path::Path;

use anyhow::{bail, Context, Result};
use minijinja::{context, Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

/// Read from JSON with the fields' names (the thinking's as either); written for templates by
/// the `Serialize` below.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's function calls, as chat templates take them:
    /// `[{"type": "function", "function": {"name", "arguments": {...}}}]` (arguments as an
    /// object, as transformers' and vLLM's templates expect).
    #[serde(default)]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` turn's answer to this call.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// Who speaks (OpenAI's message `name`: a user in a group, an agent of several); templates
    /// that read `message.name` render it, others leave it out.
    #[serde(default)]
    pub name: Option<String>,
    /// An assistant turn's thinking, apart from its `content` (a reasoning model's answer as the
    /// server returns it). Templates read it as `reasoning_content` (Qwen3's, DeepSeek's) or
    /// `reasoning` (vLLM's newer name): the message carries it under both, as vLLM passes it.
    /// Templates decide whether a past turn's thinking is shown again (Qwen3's keeps it only
    /// after the last user message, within a turn's function calls).
    #[serde(default, alias = "reasoning_content")]
    pub reasoning: Option<String>,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        Self { role: role.to_string(), content: content.to_string(), tool_calls: None, tool_call_id: None, name: None, reasoning: None }
    }
}

/// The message as a template sees it: the fields that are set, the thinking under both names.
impl Serialize for ChatMessage {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("role", &self.role)?;
        map.serialize_entry("content", &self.content)?;
        if let Some(calls) = &self.tool_calls {
            map.serialize_entry("tool_calls", calls)?;
        }
        if let Some(id) = &self.tool_call_id {
            map.serialize_entry("tool_call_id", id)?;
        }
        if let Some(name) = &self.name {
            map.serialize_entry("name", name)?;
        }
        if let Some(thinking) = &self.reasoning {
            map.serialize_entry("reasoning_content", thinking)?;
            map.serialize_entry("reasoning", thinking)?;
        }
        map.end()
    }
}

/// A message's thinking under either of its names, `reasoning_content` or vLLM's `reasoning`
/// (both given: they must agree), as requests and training rows carry it. The error: which key
/// is wrong, and why.
pub fn message_reasoning(m: &serde_json::Map<String, serde_json::Value>, role: &str) -> Result<Option<String>, (&'static str, String)> {
    use serde_json::Value;
    let mut found: Option<(&str, &String)> = None;
    for key in ["reasoning_content", "reasoning"] {
        match m.get(key) {
            None | Some(Value::Null) => {}
            Some(_) if role != "assistant" => return Err((key, format!("only assistant messages carry `{key}`"))),
            Some(Value::String(s)) => match found {
                Some((first, earlier)) if earlier != s => {
                    return Err((key, format!("`{key}` differs from `{first}`; give the thinking once")))
                }
                _ => found = Some((key, s)),
            },
            Some(_) => return Err((key, format!("`{key}` must be a string"))),
        }
    }
    Ok(found.map(|(_, s)| s.clone()))
}

/// The variables the server gives every template, which template arguments cannot replace.
pub const RENDER_VARIABLES: [&str; 5] = ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"];

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// The template reads `tools` (it renders function definitions itself).
    pub takes_tools: bool,
    /// The template reads a message's thinking (`reasoning_content` or `reasoning`); others
    /// drop it without a word.
    pub takes_reasoning: bool,
    /// Its text (what it writes tells, e.g., a reasoning model's think tags).
    pub source: String,
}

const TEMPLATE_NAME: &str = "chat";

/// `--chat-template` (vLLM's flag for `serve`, TRL's `chat_template_path` for training): a file,
/// or the template itself written inline (not a file, and holding `{{` or `{%`). Its text,
/// checked to compile; errors name the file.
pub fn template_argument(arg: &str) -> Result<String> {
    let path = Path::new(arg);
    let (text, named) = if path.is_file() {
        (std::fs::read_to_string(path).with_context(|| format!("--chat-template {}: cannot read", path.display()))?, arg.to_string())
    } else if arg.contains("{{") || arg.contains("{%") {
        (arg.to_string(), "(inline)".to_string())
    } else {
        bail!("--chat-template {arg}: no such file (an inline template holds `{{{{` or `{{%`)");
    };
    ChatTemplate::new(&text, None, None).with_context(|| format!("--chat-template {named}: not a template"))?;
    Ok(text)
}

/// Where transformers looks, in its order: `chat_template.jinja`, then `tokenizer_config.json`'s
/// `chat_template` (a string, or a list of named templates of which we take "default").
pub fn template_text(jinja_file: Option<&Path>, tokenizer_config: &serde_json::Value) -> Result<Option<String>> {
    if let Some(p) = jinja_file {
        return Ok(Some(std::fs::read_to_string(p).with_context(|| format!("{}: cannot read", p.display()))?));
    }
    match tokenizer_config.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(list)) => {
            let default = list.iter().find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"));
            Ok(default.and_then(|t| t.get("template")).and_then(|t| t.as_str()).map(str::to_string))
        }
        Some(_) => bail!("field `chat_template` must be a string or a list of {{name, template}}"),
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `json.dumps(value, ensure_ascii=False)` with Python's default separators, as transformers'
/// `tojson` does (minijinja's own is compact and HTML-escapes).
fn tojson(value: Value, indent: Option<usize>, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<usize>>("indent")?,
    };
    // transformers' tojson also takes these; key order is kept as given, like Python dicts.
    let _: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let json: serde_json::Value =
        serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_py_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// `json.dumps(value, ensure_ascii=False)`: Python's default separators (`", "`, `": "`), as
/// transformers' `tojson` writes JSON into prompts and as constrained decoding writes it.
pub fn python_json(v: &serde_json::Value) -> String {
    let mut out = String::new();
    write_py_json(v, None, 0, &mut out);
    out
}

fn write_py_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_py_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(o) if !o.is_empty() => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::to_string(k).unwrap());
                out.push_str(": ");
                write_py_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&serde_json::to_string(other).unwrap()),
    }
}

/// `strftime_now(fmt)` as transformers provides it (Llama 3 templates print today's date).
/// Supports the directives those templates use: %d %m %Y %y %b %B %H %M %S %%.
fn strftime_now(fmt: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    Ok(Value::from(format_utc(secs, &fmt)))
}

pub(crate) fn format_utc(secs: u64, fmt: &str) -> String {
    const MONTHS: [&str; 12] =
        ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            Some('B') => out.push_str(MONTHS[(month - 1) as usize]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string()).map_err(|e| anyhow::anyhow!("{e:#}"))?;
        let takes_tools = source.contains("tools");
        let takes_reasoning = source.contains("reasoning_content") || source.contains(".reasoning");
        Ok(Self { env, bos_token, eos_token, takes_tools, takes_reasoning, source: source.to_string() })
    }

    /// Renders a conversation; `add_generation_prompt` opens the assistant's turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, None, add_generation_prompt, &serde_json::Map::new())
    }

    /// As [`Self::render`], with function definitions (`[{"type": "function", "function":
    /// {...}}]`) in the template's `tools`, as transformers' `apply_chat_template(tools=...)`,
    /// and `kwargs`, more variables the template reads (`enable_thinking`, ...), as
    /// `apply_chat_template(**kwargs)`; they cannot replace [`RENDER_VARIABLES`].
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        if let Some(k) = kwargs.keys().find(|k| RENDER_VARIABLES.contains(&k.as_str())) {
            anyhow::bail!("`{k}` is set by the server, not by template arguments");
        }
        let tmpl = self.env.get_template(TEMPLATE_NAME)?;
        tmpl.render(context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
            ..minijinja::Value::from_serialize(kwargs)
        })
        .map_err(|e| anyhow::anyhow!("rendering the chat template: {e:#}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_format_like_strftime() {
        // 2024-02-29 13:05:09 UTC
        assert_eq!(format_utc(1_709_211_909, "%d %b %Y %H:%M:%S"), "29 Feb 2024 13:05:09");
        assert_eq!(format_utc(0, "%Y-%m-%d %B"), "1970-01-01 January");
    }

    #[test]
    fn tojson_uses_python_separators() {
        let t = ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}", None, None).unwrap();
        let env = &t.env;
        let out = env.get_template(TEMPLATE_NAME).unwrap().render(context! { x => serde_json::json!({"a": [1, "é<"], "b": {}}) }).unwrap();
        assert_eq!(out, "{\"a\": [1, \"é<\"], \"b\": {}}|{\n  \"a\": [\n    1,\n    \"é<\"\n  ],\n  \"b\": {}\n}");
    }

    #[test]
    fn a_turns_thinking_reaches_the_template_under_both_names() {
        let mut m = ChatMessage::new("assistant", "Hello");
        m.reasoning = Some("greet".into());
        let both = ChatTemplate::new(
            "{% for m in messages %}{{ m.reasoning_content }}|{{ m['reasoning'] }}|{{ m.content }}{% endfor %}",
            None,
            None,
        )
        .unwrap();
        assert_eq!(both.render(&[m.clone()], false).unwrap(), "greet|greet|Hello");
        assert!(both.takes_reasoning);
        let plain = ChatTemplate::new("{% for m in messages %}{{ m.content }}{% endfor %}", None, None).unwrap();
        assert_eq!((plain.render(&[m], false).unwrap().as_str(), plain.takes_reasoning), ("Hello", false));
    }

    #[test]
    fn a_chat_template_argument_is_a_file_or_inline_and_errors_name_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.jinja");
        std::fs::write(&file, "{{ messages[0].content }}").unwrap();
        assert_eq!(template_argument(file.to_str().unwrap()).unwrap(), "{{ messages[0].content }}");
        let inline = "{% for m in messages %}{{ m.content }}{% endfor %}";
        assert_eq!(template_argument(inline).unwrap(), inline);
        let missing = format!("{:#}", template_argument("/no/such.jinja").unwrap_err());
        assert!(missing.contains("--chat-template /no/such.jinja: no such file"), "{missing}");
        std::fs::write(&file, "{% for m in messages %}").unwrap();
        let broken = format!("{:#}", template_argument(file.to_str().unwrap()).unwrap_err());
        assert!(broken.contains(&format!("--chat-template {}: not a template", file.display())), "{broken}");
    }

    #[test]
    fn raise_exception_stops_rendering_with_its_message() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", None, None).unwrap();
        let err = t.render(&[], false).unwrap_err();
        assert!(format!("{err:#}").contains("roles must alternate"), "{err:#}");
    }
}
