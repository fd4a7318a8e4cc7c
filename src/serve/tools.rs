//! Function calling as OpenAI's chat API has it: `tools`, `tool_choice` (`none`, `auto`,
//! `required`, a named function), `parallel_tool_calls`, and the legacy `functions` /
//! `function_call`.
//!
//! - The prompt: the model's chat template gets the definitions as `tools` (and the history's
//!   `tool_calls` and `tool` turns) when it reads them; a template that does not gets the
//!   generic format below: a system turn listing the functions and asking for
//!   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, past calls written that way,
//!   tool results as `<tool_response>` user turns.
//! - `required` and a named function are constrained decoding (see `generate::constraint`):
//!   the answer is a call (or, with `parallel_tool_calls`, a list of calls) whose arguments
//!   follow the function's parameter schema; a named function's answer is its arguments.
//! - `auto` leaves the model free to write text or calls in its own format (`tool_format`:
//!   Hermes / Qwen `<tool_call>` blocks, Llama 3.1's JSON, Mistral's `[TOOL_CALLS]`); from the
//!   moment it opens a call, a lazy grammar holds the call to the functions' schemas. A bare
//!   `{"name", "arguments"}` answer naming a function is read as a call too (small models
//!   asked in the generic format write that).

use serde_json::{json, Map, Value};

use super::call_stream::CallStream;
use super::engine::StopWhen;
use super::error::ApiError;
use super::tool_format::{NativeCalls, Piece, ToolFormat, HERMES_CLOSE, HERMES_OPEN};
use crate::generate::constraint::OutputFormat;
use crate::generate::json_schema;
use crate::tokenize::tool_prompt;

#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's functions and how it wants them used.
#[derive(Debug, Clone)]
pub struct Tools {
    /// `[{"type": "function", "function": {"name", "description", "parameters"}}]`, as sent.
    pub definitions: Value,
    pub names: Vec<String>,
    /// Each function's parameter schema (an object schema), in `names` order.
    parameters: Vec<Value>,
    pub choice: ToolChoice,
    pub parallel: bool,
    /// How the model writes calls when free to (`auto`); set from the model (`tool_format`).
    pub format: ToolFormat,
}

/// A call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as a JSON string (OpenAI's `function.arguments`).
    pub arguments: String,
}

/// `tools` + `tool_choice` + `parallel_tool_calls`, or the legacy `functions` + `function_call`.
/// None when the request has no functions (`tool_choice` then may only be `none`).
pub fn parse(v: &Value) -> Result<Option<Tools>, ApiError> {
    let get = |k: &str| v.get(k).filter(|x| !x.is_null());
    let (definitions, choice_key) = match (get("tools"), get("functions")) {
        (Some(_), Some(_)) => return Err(ApiError::invalid("functions", "Give `tools` or the legacy `functions`, not both.")),
        (Some(t), None) => (t.clone(), "tool_choice"),
        (None, Some(Value::Array(f))) => {
            (Value::Array(f.iter().map(|f| json!({"type": "function", "function": f})).collect()), "function_call")
        }
        (None, Some(_)) => return Err(ApiError::invalid("functions", "`functions` must be a list of function definitions.")),
        (None, None) => {
            if get("tool_choice").is_some_and(|c| c != "none") {
                return Err(ApiError::invalid("tool_choice", "`tool_choice` needs `tools`."));
            }
            if get("function_call").is_some_and(|c| c != "none") {
                return Err(ApiError::invalid("function_call", "`function_call` needs `functions`."));
            }
            if get("parallel_tool_calls").is_some() {
                return Err(ApiError::invalid("parallel_tool_calls", "`parallel_tool_calls` needs `tools`."));
            }
            return Ok(None);
        }
    };
    let param = if choice_key == "tool_choice" { "tools" } else { "functions" };
    let Value::Array(list) = &definitions else {
        return Err(ApiError::invalid(param, "`tools` must be a list of {\"type\": \"function\", \"function\": {...}}."));
    };
    if list.is_empty() {
        return Err(ApiError::invalid(param, format!("`{param}` must not be empty.")));
    }
    let (mut names, mut parameters) = (vec![], vec![]);
    for (i, t) in list.iter().enumerate() {
        let at = format!("{param}[{i}]");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid(&format!("{at}.type"), "only tools of type \"function\" are supported."));
        }
        super::fields::check(t, &["type", "function"], &at, false)?;
        let f = t
            .get("function")
            .filter(|f| f.is_object())
            .ok_or_else(|| ApiError::invalid(&format!("{at}.function"), "`function` must be an object."))?;
        super::fields::check(f, &["name", "description", "parameters", "strict"], &format!("{at}.function"), false)?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty() && n.len() <= 64 && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'));
        let name = name
            .ok_or_else(|| ApiError::invalid(&format!("{at}.function.name"), "`name` is required: 1 to 64 letters, digits, '_' or '-'."))?;
        if names.iter().any(|n| n == name) {
            return Err(ApiError::invalid(&format!("{at}.function.name"), format!("two functions are named {name:?}.")));
        }
        let params = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => return Err(ApiError::invalid(&format!("{at}.function.parameters"), "`parameters` must be a JSON schema object.")),
        };
        names.push(name.to_string());
        parameters.push(params);
    }
    let choice = match get(choice_key) {
        None => ToolChoice::Auto,
        Some(Value::String(s)) if s == "none" => ToolChoice::None,
        Some(Value::String(s)) if s == "auto" => ToolChoice::Auto,
        Some(Value::String(s)) if s == "required" && choice_key == "tool_choice" => ToolChoice::Required,
        Some(c) => {
            // {"type": "function", "function": {"name"}} (tools) or {"name"} (functions).
            let name = c.pointer("/function/name").or_else(|| c.get("name")).and_then(Value::as_str);
            match name {
                Some(n) if names.iter().any(|x| x == n) => ToolChoice::Named(n.to_string()),
                Some(n) => {
                    return Err(ApiError::invalid(
                        choice_key,
                        format!("`{choice_key}` names {n:?}, which is not among the functions given."),
                    ))
                }
                None => {
                    return Err(ApiError::invalid(
                        choice_key,
                        format!(
                            "`{choice_key}` must be none, auto{}, or a function.",
                            if choice_key == "tool_choice" { ", required" } else { "" }
                        ),
                    ))
                }
            }
        }
    };
    let parallel = match get("parallel_tool_calls") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::invalid("parallel_tool_calls", "`parallel_tool_calls` must be a boolean.")),
    };
    Ok(Some(Tools { definitions, names, parameters, choice, parallel, format: ToolFormat::Hermes }))
}

impl Tools {
    /// What constrained decoding enforces: a named function's arguments, or for `required`
    /// one call (a list of calls with `parallel_tool_calls`) of any of the functions.
    pub fn output_format(&self) -> Option<OutputFormat> {
        match &self.choice {
            ToolChoice::None | ToolChoice::Auto => None,
            ToolChoice::Named(n) => Some(OutputFormat::JsonSchema(self.parameters[self.index(n)].clone())),
            ToolChoice::Required => {
                let mut defs = Map::new();
                let call = json!({"anyOf": self.call_schemas(&mut defs)});
                let mut schema = if self.parallel { json!({"type": "array", "items": call, "minItems": 1}) } else { call };
                schema["$defs"] = Value::Object(defs);
                Some(OutputFormat::JsonSchema(schema))
            }
        }
    }

    /// What an `auto` answer under a `response_format` may be: one call, as the bare
    /// `{"name", "arguments"}` object `calls_in` reads, or the format's JSON. OpenAI lets the
    /// model choose between calling and answering in the format (the Agents SDK sends both on
    /// every turn of an agent with tools and an `output_type`); constraining the whole answer to
    /// the format would make every call impossible.
    pub fn call_or(&self, answer: &OutputFormat) -> OutputFormat {
        let mut defs = Map::new();
        let mut choices = self.call_schemas(&mut defs);
        choices.push(match answer {
            OutputFormat::JsonObject => json!({"type": "object"}),
            // `$` cannot start a function's name, so this name meets none of theirs.
            OutputFormat::JsonSchema(s) => json_schema::embed(s, "$response_format", &mut defs),
            OutputFormat::Lark(_) | OutputFormat::Regex(_) => unreachable!("validate::tools_and_constraints joins only JSON with calls"),
        });
        OutputFormat::JsonSchema(json!({"anyOf": choices, "$defs": defs}))
    }

    /// One `{"name": ..., "arguments": ...}` schema per function. Each function's parameters
    /// move into the wrapper's `$defs` with their own definitions beside them, so their `$ref`s
    /// resolve as they did alone.
    fn call_schemas(&self, defs: &mut Map<String, Value>) -> Vec<Value> {
        self.call_schemas_with(defs, "arguments")
    }

    /// The same, the arguments under `key` (Llama 3.1 writes `parameters`).
    fn call_schemas_with(&self, defs: &mut Map<String, Value>, key: &str) -> Vec<Value> {
        self.names
            .iter()
            .zip(&self.parameters)
            .map(|(n, p)| {
                let arguments = json_schema::embed(p, n, defs);
                json!({"type": "object", "properties": {"name": {"enum": [n]}, key: arguments}, "required": ["name", key], "additionalProperties": false})
            })
            .collect()
    }

    /// The lazy grammar of an `auto` answer in the model's own format (None for other choices).
    pub fn auto_grammar(&self) -> Option<OutputFormat> {
        (self.choice == ToolChoice::Auto).then(|| {
            let mut defs = Map::new();
            let calls = self.call_schemas_with(&mut defs, self.format.arguments_key());
            let call = crate::generate::constraint::compact_json(&json!({"anyOf": calls, "$defs": defs}));
            OutputFormat::Lark(self.format.grammar(&call, self.parallel))
        })
    }

    /// A reader of an `auto` answer's text and calls as it streams (None for other choices).
    pub fn auto_stream(&self) -> Option<NativeCalls> {
        (self.choice == ToolChoice::Auto).then(|| self.format.stream())
    }

    /// A fresh id for a call, in the form the model's template takes back.
    pub fn new_call_id(&self) -> String {
        self.format.call_id()
    }

    /// OpenAI's `tool_calls` of a response message.
    pub fn calls_json(&self, calls: &[ToolCall]) -> Value {
        Value::Array(
            calls
                .iter()
                .map(|c| json!({"id": self.new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                .collect(),
        )
    }

    fn index(&self, name: &str) -> usize {
        self.names.iter().position(|n| n == name).expect("a known function")
    }

    /// Whether the answer must be a call (`required`, a named function): its text is never
    /// returned as content.
    pub fn forces_call(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Named(_))
    }

    /// The calls in an answer, and the text outside them (None when there is none). None when
    /// the answer is not a call (`auto`, `none`). A forced answer is read as it is streamed
    /// (`call_stream`): cut short, it keeps its complete calls; a call identical to an earlier
    /// one is dropped.
    pub fn calls_in(&self, answer: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
        match &self.choice {
            ToolChoice::None => None,
            ToolChoice::Named(_) | ToolChoice::Required => {
                let mut stream = self.call_stream()?;
                stream.push(answer);
                let calls = stream.calls().into_iter().map(|c| ToolCall { name: c.name, arguments: c.arguments }).collect();
                Some((None, calls))
            }
            ToolChoice::Auto => match self.format {
                ToolFormat::Hermes => self.detect(answer),
                ToolFormat::Llama3Json | ToolFormat::Mistral(_) => self.read_streamed(answer).or_else(|| self.detect(answer)),
            },
        }
    }

    /// A reader of a forced answer's calls as they are generated (None unless the choice forces
    /// a call).
    pub fn call_stream(&self) -> Option<CallStream> {
        match &self.choice {
            ToolChoice::Named(n) => Some(CallStream::new(Some(n))),
            ToolChoice::Required => Some(CallStream::new(None)),
            ToolChoice::None | ToolChoice::Auto => None,
        }
    }

    /// For the engine: a watch that ends a forced list of calls once it repeats one. None when
    /// this choice needs none.
    pub fn repeat_watch(&self) -> Option<StopWhen> {
        let mut stream = self.call_stream().filter(|_| self.choice == ToolChoice::Required && self.parallel)?;
        Some(Box::new(move |delta: &str| {
            stream.push(delta);
            stream.repeated()
        }))
    }

    /// A `{"name", "arguments"|"parameters"}` object naming one of the functions, as a call; its
    /// arguments as the model wrote them (as a streamed call's fragments add up to).
    fn call_of(&self, text: &str) -> Option<ToolCall> {
        let v: Value = serde_json::from_str(text).ok()?;
        let name = v.get("name")?.as_str()?;
        if !self.names.iter().any(|n| n == name) {
            return None;
        }
        let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
            None => "{}".to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(_) => {
                let mut reader = CallStream::new(None);
                reader.push(text);
                reader.calls().pop()?.arguments
            }
        };
        Some(ToolCall { name: name.to_string(), arguments })
    }

    /// Calls in a free answer read as it would stream (Llama 3.1's, Mistral's): the text before
    /// the calls, and the calls, each of a declared function (else the answer is text).
    fn read_streamed(&self, answer: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
        let mut stream = self.format.stream();
        let pieces: Vec<Piece> = stream.push(answer).into_iter().chain(stream.finish()).collect();
        let text: String = pieces.into_iter().filter_map(|p| if let Piece::Text(t) = p { Some(t) } else { None }).collect();
        if !stream.calling() {
            return None;
        }
        let calls: Vec<ToolCall> = stream.calls().into_iter().map(|c| ToolCall { name: c.name, arguments: c.arguments }).collect();
        if calls.is_empty() || !calls.iter().all(|c| self.names.contains(&c.name)) {
            return None;
        }
        let text = text.trim();
        Some(((!text.is_empty()).then(|| text.to_string()), calls))
    }

    /// Calls in a free answer: `<tool_call>` blocks, or the whole answer as one call object.
    fn detect(&self, answer: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
        const OPEN: &str = HERMES_OPEN;
        const CLOSE: &str = HERMES_CLOSE;
        let mut calls = vec![];
        let mut outside = String::new();
        let mut rest = answer;
        while let Some(at) = rest.find(OPEN) {
            outside.push_str(&rest[..at]);
            let body = &rest[at + OPEN.len()..];
            let end = body.find(CLOSE).unwrap_or(body.len());
            // A block that is not a call of ours: leave the text alone.
            calls.push(self.call_of(body[..end].trim())?);
            rest = body.get(end + CLOSE.len()..).unwrap_or("");
        }
        outside.push_str(rest);
        if calls.is_empty() {
            return Some((None, vec![self.call_of(answer.trim())?]));
        }
        let outside = outside.trim();
        Some(((!outside.is_empty()).then(|| outside.to_string()), calls))
    }
}

/// A message's `tool_calls` as the request has them (`arguments` a JSON string), checked, in the
/// form templates take (`arguments` an object); errors name the field under `at`.
pub fn message_tool_calls(calls: &Value, at: &str) -> Result<Value, ApiError> {
    tool_prompt::template_tool_calls(calls).map_err(|e| ApiError::invalid(&format!("{at}{}", e.at), e.message))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: Value) -> Tools {
        let body = json!({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
            "tool_choice": choice});
        parse(&body).unwrap().unwrap()
    }

    #[test]
    fn choices_parse_and_answers_become_calls() {
        assert_eq!(tools(json!("auto")).choice, ToolChoice::Auto);
        assert_eq!(tools(json!({"type": "function", "function": {"name": "get_weather"}})).choice, ToolChoice::Named("get_weather".into()));
        let e = parse(&json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        assert_eq!(parse(&json!({"tool_choice": "auto"})).unwrap_err().param.as_deref(), Some("tool_choice"));
        assert!(parse(&json!({"tool_choice": "none"})).unwrap().is_none());
        // Legacy functions.
        let legacy = parse(&json!({"functions": [{"name": "f"}], "function_call": {"name": "f"}})).unwrap().unwrap();
        assert_eq!(legacy.choice, ToolChoice::Named("f".into()));

        let auto = tools(json!("auto"));
        let (text, calls) =
            auto.calls_in("Sure. <tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>").unwrap();
        assert_eq!(text.as_deref(), Some("Sure."));
        assert_eq!(calls, vec![ToolCall { name: "get_weather".into(), arguments: "{\"city\": \"Paris\"}".into() }]);
        assert_eq!(
            auto.calls_in("{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}").unwrap().1[0].arguments,
            "{\"city\": \"Oslo\"}"
        );
        assert!(auto.calls_in("It is sunny.").is_none());
        assert!(auto.calls_in("{\"name\": \"other\", \"arguments\": {}}").is_none());
        let required = tools(json!("required"));
        assert_eq!(required.calls_in("[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]").unwrap().1.len(), 1);
    }

    #[test]
    fn auto_with_a_response_format_takes_one_call_or_the_answer_and_nothing_else() {
        use crate::generate::constraint::Grammars;
        let tok = crate::fixtures::train_tokenizer().unwrap();
        let eos = tok.token_to_id("<|im_end|>").unwrap();
        let grammars = Grammars::new(&tok.to_string(false).unwrap(), tok.get_vocab_size(true), eos).unwrap();
        let t = tools(json!("auto"));
        // The answer's schema has its own $defs, as pydantic writes it.
        let answer = json!({"$defs": {"T": {"type": "integer"}}, "type": "object", "properties": {"temp": {"$ref": "#/$defs/T"}}, "required": ["temp"]});
        let format = t.call_or(&OutputFormat::JsonSchema(answer));
        let accepts = |text: &str| {
            let mut m = grammars.matcher(&format).unwrap();
            let ids = m.tok_env().unwrap().tokenize_bytes(text.as_bytes());
            m.validate_tokens(&ids).unwrap() == ids.len() && m.consume_tokens(&ids).is_ok() && m.is_accepting().unwrap()
        };
        let call = r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#;
        assert!(accepts(call));
        assert!(accepts(r#"{"temp": 21}"#));
        assert!(!accepts(r#"{"temp": 21, "city": "Paris"}"#), "an undeclared key in the answer");
        assert!(!accepts(r#"{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}"#), "an undeclared argument");
        assert!(!accepts(r#"{"name": "other", "arguments": {}}"#), "a function not given");
        assert!(!accepts(r#"{"temp": "hot"}"#), "the answer's $ref");
        // What the grammar lets through is read back as the call it is.
        assert_eq!(t.calls_in(call).unwrap().1, vec![ToolCall { name: "get_weather".into(), arguments: "{\"city\": \"Paris\"}".into() }]);
        assert!(t.calls_in(r#"{"temp": 21}"#).is_none());
    }

    #[test]
    fn a_bad_call_is_named_under_its_message() {
        let e = message_tool_calls(&json!([{"function": {"name": "f", "arguments": "{bad"}}]), "messages[1].tool_calls").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1].tool_calls[0].function.arguments"));
    }

    #[test]
    fn the_lazy_grammars_leave_text_free_and_hold_calls_to_the_functions() {
        use crate::generate::constraint::{Grammars, OutputFormat};
        let mut tok = crate::fixtures::train_tokenizer().unwrap();
        tok.add_special_tokens(&[tokenizers::AddedToken::from(super::super::tool_format::MISTRAL_TRIGGER, true)]);
        let trigger = tok.token_to_id(super::super::tool_format::MISTRAL_TRIGGER).unwrap();
        let eos = tok.token_to_id("<|im_end|>").unwrap();
        let grammars = Grammars::new(&tok.to_string(false).unwrap(), tok.get_vocab_size(true), eos).unwrap();
        let body = json!({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]});
        let accepts = |format: ToolFormat, parallel: bool, special: Option<u32>, text: &str| {
            let mut tools = parse(&body).unwrap().unwrap();
            (tools.format, tools.parallel) = (format, parallel);
            let Some(OutputFormat::Lark(g)) = tools.auto_grammar() else { panic!("a lark grammar") };
            let mut m = grammars.matcher(&OutputFormat::Lark(g.clone())).unwrap_or_else(|e| panic!("{e}: {g}"));
            let mut ids: Vec<u32> = special.into_iter().collect();
            ids.extend(m.tok_env().unwrap().tokenize_bytes(text.as_bytes()));
            m.validate_tokens(&ids).unwrap() == ids.len() && m.consume_tokens(&ids).is_ok() && m.is_accepting().unwrap()
        };
        let call = |key: &str, city: &str| format!("{{\"name\": \"get_weather\", \"{key}\": {{\"city\": \"{city}\"}}}}");
        let hermes = |text: &str, parallel: bool| accepts(ToolFormat::Hermes, parallel, None, text);
        assert!(hermes("It is sunny.", true), "text alone");
        assert!(hermes(&format!("Let me look. <tool_call>\n{}\n</tool_call>", call("arguments", "Paris")), true));
        let two =
            format!("<tool_call>\n{}\n</tool_call>\n<tool_call>\n{}\n</tool_call>", call("arguments", "Paris"), call("arguments", "Oslo"));
        assert!(hermes(&two, true) && !hermes(&two, false), "a second call only with parallel_tool_calls");
        assert!(!hermes("<tool_call>\n{\"name\": \"other\", \"arguments\": {}}\n</tool_call>", true), "a function not given");
        assert!(
            !hermes("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"town\": \"x\"}}\n</tool_call>", true),
            "arguments off the schema"
        );
        let llama = |text: &str| accepts(ToolFormat::Llama3Json, true, None, text);
        assert!(llama(&call("parameters", "Paris")) && llama(&format!("{}; {}", call("parameters", "Paris"), call("parameters", "Rome"))));
        assert!(llama("It is sunny.") && !llama(&call("arguments", "Paris")), "Llama's calls have parameters");
        let mistral = |special: Option<u32>, text: &str| accepts(ToolFormat::Mistral(trigger), true, special, text);
        assert!(mistral(Some(trigger), &format!(" [{}]", call("arguments", "Paris"))) && mistral(None, "It is sunny."));
        assert!(!mistral(Some(trigger), "[{\"name\": \"other\", \"arguments\": {}}]"));
    }
}
