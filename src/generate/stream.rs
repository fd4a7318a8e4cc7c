//! Turning generated token ids into text as it is produced: never emit broken UTF-8, stop at stop
//! strings that may span several tokens, hold back text that could still become a stop string,
//! and (code completion) stop at a line indented less than the answer's first.

/// Outcome of adding one token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamStep {
    /// New text that is now safe to show.
    pub text: String,
    /// The stop string completed, if one was; `text` ends right before it (or after it, with
    /// `include_stop`).
    pub stopped: Option<String>,
    /// A line started less indented than `min_indent`: `text` ends at its first character that
    /// is not a space or a tab (its indentation kept), and the answer with it.
    pub under_indented: bool,
}

/// Tracks the decoded text of the generated tokens. `decode` turns all generated ids into text;
/// decoding the whole sequence (not token by token) keeps the tokenizer's decoder rules right
/// (byte-level merges, leading-space handling).
pub struct TextStream {
    stop: Vec<String>,
    /// The stop string that ends the text stays in it (vLLM's `include_stop_str_in_output`).
    include_stop: bool,
    /// llama.cpp's `n_indent` (0: off): each line after the first must start with at least this
    /// many spaces or tabs, or the text ends there.
    min_indent: usize,
    emitted: usize,
}

impl TextStream {
    pub fn new(stop: Vec<String>, include_stop: bool) -> Self {
        Self { stop: stop.into_iter().filter(|s| !s.is_empty()).collect(), include_stop, min_indent: 0, emitted: 0 }
    }

    /// The text ends at a line (after its first) indented less than `min_indent` spaces or tabs.
    pub fn with_min_indent(self, min_indent: usize) -> Self {
        Self { min_indent, ..self }
    }

    /// `full` is the decoding of every generated token so far; `check_stops`: whether a stop
    /// string may end the text yet (not before vLLM's `min_tokens`: until then all is shown).
    pub fn push(&mut self, full: &str, check_stops: bool) -> StreamStep {
        // A trailing U+FFFD means the last token ended inside a multi-byte character.
        let complete = full.trim_end_matches('\u{FFFD}');
        if !check_stops {
            let text = complete.get(self.emitted..).unwrap_or("").to_string();
            self.emitted = self.emitted.max(complete.len());
            return StreamStep { text, stopped: None, under_indented: false };
        }
        let search_from = self.emitted.saturating_sub(self.stop.iter().map(String::len).max().unwrap_or(0));
        let search_from = floor_char_boundary(complete, search_from);
        // The first stop string that ends in text not yet shown (one shown before `min_tokens`
        // ended nothing then, and ends nothing now).
        let first_stop = self
            .stop
            .iter()
            .filter_map(|s| {
                complete[search_from..]
                    .match_indices(s.as_str())
                    .map(|(i, m)| (search_from + i, m.len()))
                    .find(|(at, len)| at + len > self.emitted)
            })
            .min();
        if let Some((at, len)) = first_stop {
            let matched = complete[at..at + len].to_string();
            let end = if self.include_stop { at + len } else { at };
            let text = complete.get(self.emitted..end).unwrap_or("").to_string();
            self.emitted = self.emitted.max(end);
            return StreamStep { text, stopped: Some(matched), under_indented: false };
        }
        if let Some(cut) = self.under_indented(complete).filter(|&cut| cut >= self.emitted) {
            let text = complete[self.emitted..cut].to_string();
            self.emitted = cut;
            return StreamStep { text, stopped: None, under_indented: true };
        }
        let safe_end = complete.len() - self.held_back(complete);
        let text = if safe_end > self.emitted { complete[self.emitted..safe_end].to_string() } else { String::new() };
        self.emitted = self.emitted.max(safe_end);
        StreamStep { text, stopped: None, under_indented: false }
    }

    /// Everything not yet emitted, at the end of generation (no more tokens will come).
    pub fn finish(&mut self, full: &str) -> String {
        let complete = full.trim_end_matches('\u{FFFD}');
        let rest = complete.get(self.emitted..).unwrap_or("").to_string();
        self.emitted = complete.len();
        rest
    }

    /// The text emitted so far (a prefix of `full`).
    pub fn emitted_text(&self, full: &str) -> String {
        full.get(..self.emitted).unwrap_or(full).to_string()
    }

    /// Where the first line after a new line that starts less indented than `min_indent`
    /// starts its text: the offset of its first character that is not a space or a tab (an
    /// empty line's new line counts, as in llama.cpp). None while every line is indented enough,
    /// or the last is only spaces so far.
    fn under_indented(&self, text: &str) -> Option<usize> {
        if self.min_indent == 0 {
            return None;
        }
        let mut line_start = text.find('\n')? + 1;
        loop {
            let line = &text[line_start..];
            let indent = line.len() - line.trim_start_matches([' ', '\t']).len();
            if indent == line.len() {
                return None;
            }
            if indent < self.min_indent {
                return Some(line_start + indent);
            }
            line_start += line.find('\n')? + 1;
        }
    }

    /// Length of the longest suffix of `text` that is a proper prefix of some stop string.
    fn held_back(&self, text: &str) -> usize {
        let mut hold = 0;
        for s in &self.stop {
            for (i, _) in s.char_indices().skip(1) {
                if i > hold && text.ends_with(&s[..i]) {
                    hold = i;
                }
            }
        }
        hold
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(pieces: &[&str], stop: &[&str]) -> (Vec<String>, bool) {
        run_with(pieces, stop, false, 0)
    }

    /// `include`: keep the stop string; stop strings count from piece `from` on.
    fn run_with(pieces: &[&str], stop: &[&str], include: bool, from: usize) -> (Vec<String>, bool) {
        let mut s = TextStream::new(stop.iter().map(|x| x.to_string()).collect(), include);
        let mut full = String::new();
        let mut out = vec![];
        for (i, p) in pieces.iter().enumerate() {
            full.push_str(p);
            let step = s.push(&full, i + 1 >= from);
            out.push(step.text);
            if step.stopped.is_some() {
                return (out, true);
            }
        }
        out.push(s.finish(&full));
        (out, false)
    }

    #[test]
    fn stop_string_across_tokens_is_cut_and_never_shown() {
        let (out, stopped) = run(&["Hello ", "wor", "ld", "###", " end"], &["ld##"]);
        assert!(stopped);
        assert_eq!(out.concat(), "Hello wor");
        assert!(out.iter().all(|o| !o.contains('#')));
    }

    /// vLLM's `include_stop_str_in_output` keeps the stop string; `min_tokens` shows a stop
    /// string completed before it and stops at the next one.
    #[test]
    fn stop_string_kept_or_counted_only_after_min_tokens() {
        let (out, stopped) = run_with(&["Hello ", "wor", "ld", "###", " end"], &["ld##"], true, 0);
        assert!(stopped);
        assert_eq!(out.concat(), "Hello world##");
        let (out, stopped) = run_with(&["a.", "b", ".", "c"], &["."], false, 3);
        assert!(stopped);
        assert_eq!(out.concat(), "a.b");
        let (out, stopped) = run_with(&["a.", "b"], &["."], false, 3);
        assert!(!stopped);
        assert_eq!(out.concat(), "a.b");
    }

    #[test]
    fn possible_stop_prefix_is_held_then_released() {
        let mut s = TextStream::new(vec!["zz".into(), "b.".into(), "a".into()], false);
        assert_eq!(s.push("xb", true).stopped, None);
        // The stop that ends first wins, whichever of the list it is.
        assert_eq!(s.push("xb.za", true).stopped.as_deref(), Some("b."));
        let (out, stopped) = run(&["a<", "b"], &["<|end|>"]);
        assert!(!stopped);
        assert_eq!(out, vec!["a".to_string(), "<b".to_string(), String::new()]);
    }

    /// llama.cpp's `n_indent`: the first line is free; a later one indented less (an empty line
    /// too) ends the text at its first character, its indentation kept.
    #[test]
    fn a_line_indented_less_than_n_indent_ends_the_text() {
        let run = |pieces: &[&str], min: usize| {
            let mut s = TextStream::new(vec![], false).with_min_indent(min);
            let (mut full, mut out) = (String::new(), String::new());
            for p in pieces {
                full.push_str(p);
                let step = s.push(&full, true);
                out.push_str(&step.text);
                if step.under_indented {
                    return (out, true);
                }
            }
            out.push_str(&s.finish(&full));
            (out, false)
        };
        assert_eq!(run(&["x = 1", "\n    y", " = 2\n", "  ", "z = 3"], 4), ("x = 1\n    y = 2\n  ".to_string(), true));
        assert_eq!(run(&["return a\n", "\n", "def f():"], 4), ("return a\n".to_string(), true));
        assert_eq!(run(&["a\n\tb\n    c"], 1), ("a\n\tb\n    c".to_string(), false));
        assert_eq!(run(&["a\nb"], 0), ("a\nb".to_string(), false));
        // Spaces alone are not yet a line's start: shown, and the next piece decides.
        assert_eq!(run(&["a\n ", " b"], 2), ("a\n  b".to_string(), false));
    }

    #[test]
    fn incomplete_utf8_is_held_back() {
        // What decoding all ids gives after each token: the second token is the first byte of 'é'.
        let mut s = TextStream::new(vec![], false);
        assert_eq!(s.push("caf", true).text, "caf");
        assert_eq!(s.push("caf\u{FFFD}", true).text, "");
        assert_eq!(s.push("café", true).text, "é");
        assert_eq!(s.finish("café"), "");
    }
}
