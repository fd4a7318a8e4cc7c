//! Models' own tool-call formats, as vLLM's `--tool-call-parser` names them: how a model writes
//! its calls when it is free to (`tool_choice: auto`), read back from the whole answer or as it
//! streams, and the lazy grammar that holds a call to the declared functions from the moment the
//! model opens one (the text before it is free).
//!
//! - `hermes` (Hermes, Qwen 2.5 / Qwen 3, SmolLM3, and our generic prompt for templates with no
//!   tool format): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per
//!   call, text before them allowed.
//! - `llama3_json` (Llama 3.1+): the whole answer is `{"name": ..., "parameters": {...}}`, several
//!   calls separated by `; `; an answer that does not start with `{` is text.
//! - `mistral` (Mistral v0.3, Nemo): the `[TOOL_CALLS]` special token, then a JSON list of
//!   `{"name", "arguments"}`; the token is kept in the text (`skip_special_tokens: false`) so the
//!   calls can be found, as vLLM does.

use serde_json::{json, Value};

use super::call_stream::{CallEvent, CallStream, StreamedCall};

pub const HERMES_OPEN: &str = "<tool_call>";
pub const HERMES_CLOSE: &str = "</tool_call>";
pub const MISTRAL_TRIGGER: &str = "[TOOL_CALLS]";

/// A model's way of writing calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
    /// With the `[TOOL_CALLS]` token's id.
    Mistral(u32),
}

/// `--tool-call-parser`: a format, or `auto` (from the chat template).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolParser {
    Auto,
    Hermes,
    Llama3Json,
    Mistral,
}

impl ToolParser {
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "auto" => Ok(Self::Auto),
            "hermes" => Ok(Self::Hermes),
            "llama3_json" => Ok(Self::Llama3Json),
            "mistral" => Ok(Self::Mistral),
            other => Err(format!("unknown tool-call parser {other:?}: auto, hermes, llama3_json or mistral")),
        }
    }

    /// The format of a model whose chat template is `template` and whose tokenizer gives
    /// `token_id`: the one named, or the one the template writes (`hermes` when it writes none:
    /// the generic prompt asks for that format).
    pub fn format(self, template: Option<&str>, token_id: impl Fn(&str) -> Option<u32>) -> Result<ToolFormat, String> {
        let template = template.unwrap_or_default();
        let mistral = || {
            token_id(MISTRAL_TRIGGER)
                .map(ToolFormat::Mistral)
                .ok_or_else(|| format!("the mistral format needs a {MISTRAL_TRIGGER} token; the tokenizer has none"))
        };
        match self {
            Self::Hermes => Ok(ToolFormat::Hermes),
            Self::Llama3Json => Ok(ToolFormat::Llama3Json),
            Self::Mistral => mistral(),
            Self::Auto if template.contains(MISTRAL_TRIGGER) => mistral(),
            Self::Auto if template.contains("<|python_tag|>") || template.contains("\"parameters\"") => Ok(ToolFormat::Llama3Json),
            Self::Auto => Ok(ToolFormat::Hermes),
        }
    }
}

impl ToolFormat {
    /// vLLM's name of the format.
    pub fn name(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Llama3Json => "llama3_json",
            Self::Mistral(_) => "mistral",
        }
    }

    /// The key a call's arguments are under.
    pub fn arguments_key(self) -> &'static str {
        match self {
            Self::Llama3Json => "parameters",
            Self::Hermes | Self::Mistral(_) => "arguments",
        }
    }

    /// Whether the text must keep special tokens for the calls to be found.
    pub fn needs_special_tokens(self) -> bool {
        matches!(self, Self::Mistral(_))
    }

    /// A call id in the form the model's template accepts back (Mistral's must be 9
    /// alphanumerics), else OpenAI's `call_...`.
    pub fn call_id(self) -> String {
        let id = super::ids::new_call_id();
        match self {
            Self::Mistral(_) => id.chars().filter(char::is_ascii_alphanumeric).rev().take(9).collect(),
            Self::Hermes | Self::Llama3Json => id,
        }
    }

    /// The lazy grammar of an `auto` answer (llguidance's Lark syntax): free text, and from a
    /// call's opening on, calls whose JSON follows `call` (a schema of one call, `$defs`
    /// inside); one call, or with `parallel` several.
    pub fn grammar(self, call: &Value, parallel: bool) -> String {
        match self {
            Self::Hermes => {
                let start = if parallel { "start: call* tail" } else { "start: call | tail" };
                format!(
                    "{start}\ncall: call_hd \"\\n\"? body \"\\n\"? \"{HERMES_CLOSE}\"\ncall_hd[lazy]: TEXT \"{HERMES_OPEN}\"\nbody: %json {call}\ntail: TEXT\nTEXT: /(\\n|.)*/\n"
                )
            }
            Self::Llama3Json => {
                let more = if parallel { " (\"; \" body)*" } else { "" };
                format!("start: calls | text\ncalls: body{more}\nbody: %json {call}\ntext: \"\" | /[^{{](\\n|.)*/\n")
            }
            Self::Mistral(token) => {
                // A list of calls: the call's schema moves into the list's `$defs`, beside the
                // definitions it refers to.
                let mut call = call.clone();
                let defs = call.as_object_mut().and_then(|o| o.remove("$defs")).unwrap_or(json!({}));
                let mut list = json!({"type": "array", "items": {"$ref": "#/$defs/call"}, "minItems": 1, "$defs": defs});
                if let Some(x) = call.as_object_mut().and_then(|o| o.remove("x-guidance")) {
                    list["x-guidance"] = x;
                }
                list["$defs"]["call"] = call;
                if !parallel {
                    list["maxItems"] = json!(1);
                }
                format!("start: calls | TEXT\ncalls: <[{token}]> \" \"? body\nbody: %json {list}\nTEXT: /(\\n|.)*/\n")
            }
        }
    }

    /// A reader of an `auto` answer's text and calls as it streams.
    pub fn stream(self) -> NativeCalls {
        NativeCalls { format: self, pending: String::new(), phase: Phase::Start, calls: CallStream::new(None), raw: None, called: false }
    }
}

/// What a streamed `auto` answer is, piece by piece.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    Call(CallEvent),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Nothing but whitespace yet (Llama 3.1's calls start the answer).
    Start,
    /// Text, watched for a call's opening.
    Text,
    /// Inside the calls: everything goes to the call reader.
    Calls,
}

/// An `auto` answer read as it streams: text until a call opens, then the calls (names as soon as
/// complete, argument fragments as they come, see `call_stream`). Text that may be the start of
/// a call's opening is held until the next piece tells.
pub struct NativeCalls {
    format: ToolFormat,
    pending: String,
    phase: Phase,
    calls: CallStream,
    /// An answer that starts with `{`, kept whole until a call in it is told (else it is text).
    raw: Option<String>,
    /// A call event has been told.
    called: bool,
}

impl NativeCalls {
    fn trigger(&self) -> Option<&'static str> {
        match self.format {
            ToolFormat::Hermes => Some(HERMES_OPEN),
            ToolFormat::Mistral(_) => Some(MISTRAL_TRIGGER),
            ToolFormat::Llama3Json => None,
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let mut out = vec![];
        self.pending.push_str(text);
        loop {
            match self.phase {
                Phase::Calls => {
                    let rest = std::mem::take(&mut self.pending);
                    if let Some(raw) = self.raw.as_mut() {
                        raw.push_str(&rest);
                    }
                    let events = self.calls.push(&rest);
                    self.called |= !events.is_empty();
                    out.extend(events.into_iter().map(Piece::Call));
                    return out;
                }
                Phase::Start => {
                    let body = self.pending.trim_start();
                    if body.is_empty() {
                        return out;
                    }
                    // Llama 3.1's calls start the answer; a Hermes answer that starts with `{` is
                    // the bare call small models write when asked in the generic format.
                    self.phase = match (self.format, body.starts_with('{')) {
                        (ToolFormat::Llama3Json | ToolFormat::Hermes, true) => {
                            self.pending = body.to_string();
                            self.raw = Some(String::new());
                            Phase::Calls
                        }
                        _ => Phase::Text,
                    };
                }
                Phase::Text => {
                    let Some(trigger) = self.trigger() else {
                        out.push(Piece::Text(std::mem::take(&mut self.pending)));
                        return out;
                    };
                    if let Some(at) = self.pending.find(trigger) {
                        let before = self.pending[..at].trim_end().to_string();
                        self.pending = self.pending[at + trigger.len()..].to_string();
                        if !before.is_empty() {
                            out.push(Piece::Text(before));
                        }
                        self.phase = Phase::Calls;
                        continue;
                    }
                    // Held: a beginning of the opening, and the whitespace before it (a call's
                    // text is trimmed, as the whole answer's is).
                    let shown = self.pending[..self.pending.len() - partial_len(&self.pending, trigger)].trim_end().len();
                    if shown > 0 {
                        out.push(Piece::Text(self.pending[..shown].to_string()));
                        self.pending.drain(..shown);
                    }
                    return out;
                }
            }
        }
    }

    /// What is held at the end (a call's opening begun and never finished is text).
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.pending);
        match self.phase {
            // An answer that started like a call and named none was text after all.
            Phase::Calls if !self.called && self.raw.is_some() => {
                vec![Piece::Text(self.raw.take().unwrap_or_default() + &rest)]
            }
            Phase::Calls => self.calls.push(&rest).into_iter().map(Piece::Call).collect(),
            Phase::Start | Phase::Text if rest.is_empty() => vec![],
            Phase::Start | Phase::Text => vec![Piece::Text(rest)],
        }
    }

    /// The calls finished so far.
    pub fn calls(&self) -> Vec<StreamedCall> {
        self.calls.calls()
    }

    /// Whether a call has opened.
    pub fn calling(&self) -> bool {
        self.phase == Phase::Calls && (self.called || self.raw.is_none())
    }
}

/// Length of the longest end of `text` that is a proper beginning of `tag`.
fn partial_len(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&n| text.len() >= n && text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(format: ToolFormat, text: &str, n: usize) -> (String, Vec<CallEvent>) {
        let mut s = format.stream();
        let chars: Vec<char> = text.chars().collect();
        let mut pieces: Vec<Piece> = chars.chunks(n).flat_map(|p| s.push(&p.iter().collect::<String>())).collect();
        pieces.extend(s.finish());
        let text = pieces.iter().filter_map(|p| if let Piece::Text(t) = p { Some(t.as_str()) } else { None }).collect();
        let calls = pieces.into_iter().filter_map(|p| if let Piece::Call(c) = p { Some(c) } else { None }).collect();
        (text, calls)
    }

    fn args(events: &[CallEvent], index: usize) -> String {
        events
            .iter()
            .filter_map(|e| if let CallEvent::Args { index: i, fragment } = e { (*i == index).then_some(fragment.as_str()) } else { None })
            .collect()
    }

    #[test]
    fn each_format_streams_its_text_then_its_calls() {
        let hermes = "Let me check.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";
        let llama = "{\"name\": \"weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"time\", \"parameters\": {}}";
        let mistral =
            "Sure[TOOL_CALLS] [{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"time\", \"arguments\": {}}]";
        for n in [1, 2, 5, 1000] {
            for (format, text, before) in [
                (ToolFormat::Hermes, hermes, "Let me check.\n"),
                (ToolFormat::Llama3Json, llama, ""),
                (ToolFormat::Mistral(5), mistral, "Sure"),
            ] {
                let (shown, calls) = run(format, text, n);
                assert_eq!(shown, before.trim_end(), "{format:?} in pieces of {n}");
                assert_eq!(calls[0], CallEvent::Start { index: 0, name: "weather".into() }, "{format:?} {n}");
                assert_eq!((args(&calls, 0), args(&calls, 1)), ("{\"city\": \"Paris\"}".to_string(), "{}".to_string()), "{format:?} {n}");
            }
        }
        // Text stays text: a tag that never completes, a Llama answer that does not start a call.
        assert_eq!(run(ToolFormat::Hermes, "a <tool_ca", 3), ("a <tool_ca".to_string(), vec![]));
        assert_eq!(run(ToolFormat::Llama3Json, "  The {answer}", 2), ("  The {answer}".to_string(), vec![]));
        assert_eq!(run(ToolFormat::Hermes, "{\"answer\": 42}", 3), ("{\"answer\": 42}".to_string(), vec![]), "JSON that calls nothing");
        let (text, bare) = run(ToolFormat::Hermes, "{\"name\": \"weather\", \"arguments\": {}}", 4);
        assert_eq!((text.as_str(), args(&bare, 0)), ("", "{}".to_string()), "the bare call of the generic prompt");
    }

    #[test]
    fn the_parser_comes_from_the_template_or_the_flag() {
        let none = |_: &str| None;
        assert_eq!(ToolParser::Auto.format(Some("{{ '<tool_call>' }}"), none), Ok(ToolFormat::Hermes));
        assert_eq!(ToolParser::Auto.format(Some("<|python_tag|>"), none), Ok(ToolFormat::Llama3Json));
        assert_eq!(ToolParser::Auto.format(Some("[TOOL_CALLS]"), |_| Some(7)), Ok(ToolFormat::Mistral(7)));
        assert!(ToolParser::Mistral.format(None, none).unwrap_err().contains("[TOOL_CALLS]"));
        assert_eq!(ToolParser::Auto.format(None, none), Ok(ToolFormat::Hermes));
        assert!(ToolFormat::Mistral(1).call_id().chars().all(|c| c.is_ascii_alphanumeric()) && ToolFormat::Mistral(1).call_id().len() == 9);
    }
}
