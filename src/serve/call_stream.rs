//! A forced answer's function calls as they are generated, for streaming them as OpenAI and
//! vLLM do: a call's first chunk carries its name as soon as the name is complete, its argument
//! fragments follow as the text of `arguments` arrives, and they concatenate to the arguments
//! of the finished call (the raw text the grammar produced, so the streamed and the whole
//! answer agree to the byte).
//!
//! The answer is a named function's arguments (`Named`) or a list of `{"name", "arguments"}`
//! objects, or such objects one after another (`required`, and the calls of a model's own format,
//! `tool_format`; Llama 3.1 writes `parameters` for `arguments`). A call identical to an earlier one is never shown:
//! while a call's text is still a prefix of an earlier call's, its events are held, and dropped
//! if it completes identical: [`CallStream::repeated`] then tells the engine to end the answer
//! (a small model would otherwise repeat the call until `max_tokens`).

/// What a call stream tells.
#[derive(Debug, Clone, PartialEq)]
pub enum CallEvent {
    /// Call `index` is `name` (its id is the response shaper's to give).
    Start { index: usize, name: String },
    /// More text of call `index`'s arguments.
    Args { index: usize, fragment: String },
}

/// A finished call: its name and the raw text of its arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamedCall {
    pub name: String,
    pub arguments: String,
}

/// Where the scanner is inside a `{"name": ..., "arguments": ...}` object.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Slot {
    /// Waiting for a key (or the object's end).
    Key,
    /// Inside a key string.
    InKey,
    /// After a key, waiting for `:`.
    Colon,
    /// The key's value.
    Value,
}

/// The call being written.
#[derive(Default)]
struct Current {
    /// The name's text as written (escaped), then decoded once its string closes.
    name_raw: String,
    name: Option<String>,
    started: bool,
    arguments: String,
    /// The call's text from its `{`, for telling a repeat.
    raw: String,
    /// Events held while `raw` is a prefix of an earlier call's.
    held: Vec<CallEvent>,
    live: bool,
}

pub struct CallStream {
    /// A named function's answer is the arguments object alone.
    named: Option<String>,
    depth: usize,
    in_string: bool,
    escaped: bool,
    /// Inside the value of `arguments`.
    in_args: bool,
    /// The depth at which calls open: 1 inside a list, 0 for a lone object; None before either.
    call_depth: Option<usize>,
    slot: Slot,
    key: String,
    current: Option<Current>,
    /// Finished calls (raw text) and their contents, in order, repeats left out.
    done_raw: Vec<String>,
    done: Vec<StreamedCall>,
    shown: usize,
    repeated: bool,
}

impl CallStream {
    /// For a named function's answer (its arguments), or for `required`'s list of calls.
    pub fn new(named: Option<&str>) -> Self {
        Self {
            named: named.map(str::to_string),
            depth: 0,
            in_string: false,
            escaped: false,
            in_args: false,
            call_depth: None,
            slot: Slot::Key,
            key: String::new(),
            current: None,
            done_raw: vec![],
            done: vec![],
            shown: 0,
            repeated: false,
        }
    }

    /// Whether the answer has repeated a call it already made.
    pub fn repeated(&self) -> bool {
        self.repeated
    }

    /// Reads more of the answer; returns what it tells.
    pub fn push(&mut self, text: &str) -> Vec<CallEvent> {
        let mut out = vec![];
        if let Some(name) = self.named.clone() {
            let cur = self.current.get_or_insert_with(Current::default);
            if !cur.started {
                cur.started = true;
                out.push(CallEvent::Start { index: 0, name });
            }
            cur.arguments.push_str(text);
            if !text.is_empty() {
                out.push(CallEvent::Args { index: 0, fragment: text.to_string() });
            }
            return out;
        }
        let mut fragment = String::new();
        for c in text.chars() {
            self.step(c, &mut fragment, &mut out);
        }
        self.flush(&mut fragment, &mut out);
        out
    }

    /// The finished calls (for a named function: its arguments when they are complete JSON).
    pub fn calls(&self) -> Vec<StreamedCall> {
        match (&self.named, &self.current) {
            (Some(name), Some(cur)) => {
                let arguments = cur.arguments.trim().to_string();
                let whole = serde_json::from_str::<serde_json::Value>(&arguments).is_ok();
                whole.then(|| StreamedCall { name: name.clone(), arguments }).into_iter().collect()
            }
            (Some(_), None) => vec![],
            (None, _) => self.done.clone(),
        }
    }

    fn open_call(&mut self) {
        self.depth += 1;
        self.current = Some(Current { raw: "{".into(), ..Default::default() });
        self.slot = Slot::Key;
        self.in_args = false;
    }

    fn step(&mut self, c: char, fragment: &mut String, out: &mut Vec<CallEvent>) {
        // Before the first call: a list's `[`, or a lone call's `{`.
        let Some(call_depth) = self.call_depth else {
            match c {
                '[' => (self.call_depth, self.depth) = (Some(1), 1),
                '{' => {
                    self.call_depth = Some(0);
                    self.open_call();
                }
                _ => {}
            }
            return;
        };
        // Between calls: only a call's `{` matters.
        let Some(cur) = self.current.as_mut() else {
            if c == '{' && self.depth == call_depth {
                self.open_call();
            }
            return;
        };
        cur.raw.push(c);
        let inside = call_depth + 1;
        if self.in_string {
            let closes = !self.escaped && c == '"';
            self.escaped = !self.escaped && c == '\\';
            self.in_string = !closes;
            if self.in_args {
                fragment.push(c);
            } else if self.slot == Slot::InKey {
                match closes {
                    true => self.slot = Slot::Colon,
                    false => self.key.push(c),
                }
            } else if self.slot == Slot::Value && self.key == "name" && self.depth == inside {
                match closes {
                    true => cur.name = serde_json::from_str::<String>(&format!("\"{}\"", cur.name_raw)).ok(),
                    false => cur.name_raw.push(c),
                }
            }
            return;
        }
        if self.in_args {
            // The arguments end where their call's level goes on: at `,` or the call's `}`.
            if self.depth == inside && (c == ',' || c == '}') {
                self.in_args = false;
                self.slot = Slot::Key;
            } else {
                fragment.push(c);
                match c {
                    '"' => self.in_string = true,
                    '{' | '[' => self.depth += 1,
                    '}' | ']' => self.depth -= 1,
                    _ => {}
                }
                return;
            }
        }
        // Llama 3.1's JSON calls name their arguments `parameters`.
        let args_key = self.key == "arguments" || self.key == "parameters";
        let arguments_start = self.depth == inside && self.slot == Slot::Value && args_key && !c.is_whitespace();
        match c {
            _ if arguments_start => {
                self.in_args = true;
                fragment.push(c);
                match c {
                    '"' => self.in_string = true,
                    '{' | '[' => self.depth += 1,
                    _ => {}
                }
            }
            '"' => {
                self.in_string = true;
                if self.depth == inside && self.slot == Slot::Key {
                    self.slot = Slot::InKey;
                    self.key.clear();
                }
            }
            ':' if self.depth == inside && self.slot == Slot::Colon => self.slot = Slot::Value,
            ',' if self.depth == inside => self.slot = Slot::Key,
            '}' if self.depth == inside => {
                self.depth -= 1;
                self.flush(fragment, out);
                self.finish_call(out);
            }
            '{' | '[' => self.depth += 1,
            '}' | ']' => self.depth = self.depth.saturating_sub(1),
            _ => {}
        }
    }

    /// Hands what this push read of the current call to the client: its start once its name is
    /// complete, then its arguments' text; held while the call may still be a repeat.
    fn flush(&mut self, fragment: &mut String, out: &mut Vec<CallEvent>) {
        let Some(cur) = self.current.as_mut() else { return };
        if let (Some(name), false) = (&cur.name, cur.started) {
            cur.started = true;
            cur.held.push(CallEvent::Start { index: self.shown, name: name.clone() });
        }
        if !fragment.is_empty() {
            cur.arguments.push_str(fragment);
            cur.held.push(CallEvent::Args { index: self.shown, fragment: std::mem::take(fragment) });
        }
        // Shown once it can no longer turn out a repeat of an earlier call.
        cur.live = cur.live || !self.done_raw.iter().any(|d| d.starts_with(&cur.raw));
        if cur.live {
            out.append(&mut cur.held);
        }
    }

    fn finish_call(&mut self, out: &mut Vec<CallEvent>) {
        let Some(mut cur) = self.current.take() else { return };
        if self.done_raw.contains(&cur.raw) {
            self.repeated = true;
            return; // a repeat: never shown
        }
        out.append(&mut cur.held);
        self.done_raw.push(cur.raw);
        self.done.push(StreamedCall { name: cur.name.unwrap_or_default(), arguments: cur.arguments.trim().to_string() });
        self.shown += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text` in pieces of `n` characters; returns the events and the finished calls.
    fn run(named: Option<&str>, text: &str, n: usize) -> (Vec<CallEvent>, Vec<StreamedCall>) {
        let mut s = CallStream::new(named);
        let chars: Vec<char> = text.chars().collect();
        let events = chars.chunks(n).flat_map(|p| s.push(&p.iter().collect::<String>())).collect();
        (events, s.calls())
    }

    fn args_of(events: &[CallEvent], index: usize) -> String {
        events
            .iter()
            .filter_map(|e| match e {
                CallEvent::Args { index: i, fragment } if *i == index => Some(fragment.as_str()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn names_come_first_and_fragments_concatenate_to_the_arguments() {
        let text = r#"[{"name": "get_weather", "arguments": {"city": "Pa\"ris", "days": [1, 2]}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]"#;
        for n in [1, 3, 7, 1000] {
            let (events, calls) = run(None, text, n);
            assert_eq!(events[0], CallEvent::Start { index: 0, name: "get_weather".into() }, "pieces of {n}");
            assert_eq!(args_of(&events, 0), r#"{"city": "Pa\"ris", "days": [1, 2]}"#);
            assert_eq!(args_of(&events, 1), r#"{"zone": "UTC"}"#);
            assert_eq!(
                calls.iter().map(|c| c.arguments.as_str()).collect::<Vec<_>>(),
                [r#"{"city": "Pa\"ris", "days": [1, 2]}"#, r#"{"zone": "UTC"}"#]
            );
            let start_1 = events.iter().position(|e| matches!(e, CallEvent::Start { index: 1, .. })).unwrap();
            let last_args_0 = events.iter().rposition(|e| matches!(e, CallEvent::Args { index: 0, .. })).unwrap();
            assert!(start_1 > last_args_0);
        }
        // One call, not in a list.
        let (events, calls) = run(None, r#"{"name": "f", "arguments": {}}"#, 2);
        assert_eq!((args_of(&events, 0), calls.len()), ("{}".to_string(), 1));
    }

    #[test]
    fn a_repeated_call_is_never_shown_and_a_cut_call_is_not_finished() {
        let a = r#"{"name": "f", "arguments": {"x": 1}}"#;
        let text = format!(r#"[{a}, {{"name": "f", "arguments": {{"x": 2}}}}, {a}, {{"name": "f", "argu"#);
        let (events, calls) = run(None, &text, 4);
        assert_eq!(calls.len(), 2);
        assert_eq!((args_of(&events, 0), args_of(&events, 1)), (r#"{"x": 1}"#.to_string(), r#"{"x": 2}"#.to_string()));
        assert!(
            !events.iter().any(|e| matches!(e, CallEvent::Start { index: 2, .. }) || matches!(e, CallEvent::Args { index: 2, .. })),
            "{events:?}"
        );
        let mut watch = CallStream::new(None);
        watch.push(&format!("[{a}, "));
        assert!(!watch.repeated());
        watch.push(a);
        assert!(watch.repeated());
        // A named function's answer streams as it comes; whole only when it parses.
        let (events, calls) = run(Some("g"), r#"{"q": "a"}"#, 3);
        assert_eq!(
            (events[0].clone(), args_of(&events, 0), calls.len()),
            (CallEvent::Start { index: 0, name: "g".into() }, r#"{"q": "a"}"#.to_string(), 1)
        );
        assert!(run(Some("g"), r#"{"q": "#, 3).1.is_empty());
    }
}
